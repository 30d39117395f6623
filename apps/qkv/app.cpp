#include "app.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "cli_io.hpp"
#include "qkv/core/error.hpp"

namespace qkv::cli {
namespace {

// What to say when no subcommand was recognised: the first word left over is a subcommand
// misspelt, or there was none.
std::string missing_subcommand(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
  const std::string known = fmt::format("{}", fmt::join(names, ", "));
  for (const std::string& word : app.remaining()) {
    if (word.starts_with('-')) continue;
    const std::optional<std::string> near = closest_name(word, names);
    return fmt::format("SUBCOMMAND: expected one of {}, got \"{}\"{}", known, word,
                       near ? fmt::format(" (did you mean {}?)", *near) : "");
  }
  return fmt::format("SUBCOMMAND: expected one of {}, got none (see --help)", known);
}

}  // namespace

int run_app(CLI::App& app, int argc, const char* const* argv) {
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

}  // namespace qkv::cli
