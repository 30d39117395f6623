// qkv: attention from the command line. See `qkv --help`.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/simd_target.hpp"

namespace {

// Exit codes: 0 success, 2 bad input (usage, files, shapes, values), 1 anything unexpected.
constexpr int kExitBadInput = 2;
constexpr int kExitInternal = 1;

// The version, and what the kernels will run on: the CPU, its caches and the instruction set.
std::string version_text() {
  return fmt::format("qkv 0.1.0\nCPU: {}\nSIMD target: {} (available: {})", qkv::cpu_summary(), qkv::simd_target(),
                     fmt::join(qkv::simd_targets(), ", "));
}

void use_simd_target_option(const std::string& target) {
  try {
    qkv::use_simd_target(target);
  } catch (const qkv::ValueError& e) {
    const std::string message = e.what();
    const std::string prefix = "target: ";
    throw qkv::ValueError("--simd-target: " +
                          (message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message));
  }
}

// What to say when no subcommand was recognised: the first word left over is a subcommand
// misspelt, or there was none.
std::string missing_subcommand(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
  const std::string known = fmt::format("{}", fmt::join(names, ", "));
  for (const std::string& word : app.remaining()) {
    if (word.starts_with('-')) continue;
    const std::optional<std::string> near = qkv::cli::closest_name(word, names);
    return fmt::format("SUBCOMMAND: expected one of {}, got \"{}\"{}", known, word,
                       near ? fmt::format(" (did you mean {}?)", *near) : "");
  }
  return fmt::format("SUBCOMMAND: expected one of {}, got none (see --help)", known);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkv: the attention mechanism, from softmax(QKᵀ/√d)V to a fast CPU kernel.", "qkv"};
  app.require_subcommand(1);
  // Before --version, so that `qkv --simd-target SSE4 --version` reports the target chosen; after
  // a subcommand too (fallthrough).
  app.add_option_function<std::string>("--simd-target", use_simd_target_option,
                                       "instruction set of the kernels: AVX3, AVX2, SSE4 or SCALAR, any case (default: "
                                       "$QKV_SIMD_TARGET, else the best this CPU runs; see --version)")
      ->type_name("NAME");
  app.fallthrough();
  app.set_version_flag("--version", version_text, "print the version, the CPU, its caches and the SIMD target");
  // A QKV_SIMD_TARGET that this CPU cannot run is refused before any subcommand starts its work.
  app.parse_complete_callback([] { qkv::simd_target(); });
  qkv::cli::register_demo(app);
  qkv::cli::register_attend(app);
  qkv::cli::register_attend_backward(app);
  qkv::cli::register_heatmap(app);
  qkv::cli::register_experiment(app);
  qkv::cli::register_translate(app);
  qkv::cli::register_bench(app);
  qkv::cli::register_soak(app);

  if (argc == 1) {
    fmt::print("{}", app.help());
    return 0;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::RequiredError& e) {
    if (!app.get_subcommands().empty()) {
      fmt::print(stderr, "qkv: error: {} (see --help)\n", e.what());
      return kExitBadInput;
    }
    fmt::print(stderr, "qkv: error: {}\n", missing_subcommand(app));
    return kExitBadInput;
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
