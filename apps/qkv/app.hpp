#pragma once
// Running a parse of the qkv app: every error becomes one line on stderr and an exit code.
// main() runs every subcommand through it; the CLI's fuzz target runs attend and attend-backward.

#include <CLI/CLI.hpp>

namespace qkv::cli {

// Exit codes: 0 success, 2 bad input (usage, files, shapes, values), 1 anything unexpected.
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitInternal = 1;

// Parses argv into `app` (whose subcommands run as callbacks) and returns the exit code. Help and
// --version print to stdout and return 0.
int run_app(CLI::App& app, int argc, const char* const* argv);

}  // namespace qkv::cli
