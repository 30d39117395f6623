// qkv: attention from the command line. See `qkv --help`.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <string>

#include "app.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/simd_target.hpp"

namespace {

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
  qkv::cli::register_explore(app);
  qkv::cli::register_experiment(app);
  qkv::cli::register_translate(app);
  qkv::cli::register_bench(app);
  qkv::cli::register_soak(app);
  qkv::cli::register_quantize(app);
  qkv::cli::register_decode(app);

  if (argc == 1) {
    fmt::print("{}", app.help());
    return 0;
  }
  return qkv::cli::run_app(app, argc, argv);
}
