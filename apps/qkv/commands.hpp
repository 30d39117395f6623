#pragma once
// Each subcommand of the qkv CLI lives in its own file and registers itself on the app here.
// A subcommand's callback throws qkv::Error for bad input; main() prints it as one line and exits 2.

#include <CLI/CLI.hpp>

namespace qkv::cli {

void register_demo(CLI::App& app);
void register_attend(CLI::App& app);
void register_attend_backward(CLI::App& app);
void register_heatmap(CLI::App& app);
void register_explore(CLI::App& app);
void register_experiment(CLI::App& app);
void register_translate(CLI::App& app);
void register_bench(CLI::App& app);
void register_soak(CLI::App& app);
void register_quantize(CLI::App& app);
void register_decode(CLI::App& app);

}  // namespace qkv::cli
