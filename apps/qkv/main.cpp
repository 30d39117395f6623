// qkv: attention from the command line. See `qkv --help`.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "commands.hpp"
#include "qkv/error.hpp"

namespace {

// Exit codes: 0 success, 2 bad input (usage, files, shapes, values), 1 anything unexpected.
constexpr int kExitBadInput = 2;
constexpr int kExitInternal = 1;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkv: the attention mechanism, from softmax(QKᵀ/√d)V to a fast CPU kernel.", "qkv"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "qkv 0.1.0");
  qkv::cli::register_demo(app);
  qkv::cli::register_attend(app);
  qkv::cli::register_attend_backward(app);
  qkv::cli::register_heatmap(app);
  qkv::cli::register_experiment(app);
  qkv::cli::register_translate(app);
  qkv::cli::register_bench(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "qkv: error: {} (see --help)\n", e.what());
    return kExitBadInput;
  } catch (const qkv::Error& e) {
    fmt::print(stderr, "qkv: error: {}\n", e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {
    fmt::print(stderr, "qkv: internal error: {}\n", e.what());
    return kExitInternal;
  }
  return 0;
}
