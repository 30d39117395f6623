#pragma once
// The SIMD instruction set of qkv's vectorised kernels (attention_forward_fused,
// attention_backward_fused, linear_forward_blocked, linear_backward_blocked and the paths that
// choose them), and the CPU they run on.
//
// The kernels are compiled once per instruction set (Google Highway: AVX-512 "AVX3", "AVX2",
// "SSE4" and the portable "SCALAR") and every call runs the best one this CPU supports. Highway
// keeps that choice once for the whole process, so there is one setting here for every kernel.
//
// The environment variable QKV_SIMD_TARGET (any of those names, in any case) makes the process
// behave as if the CPU's best were that target: the kernels run it and simd_targets() lists it and
// the ones below it. A name this CPU cannot run, or that is not a target, is refused by the first
// kernel call (and by every function here) with ValueError naming the variable and the choices.
// None of these functions takes a tensor: there are no shapes.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qkv {

// The instruction sets the kernels were compiled for that this CPU can run (at or below
// QKV_SIMD_TARGET when it is set), best first; whatever use_simd_target forced.
std::vector<std::string> simd_targets();

// The instruction set the next kernel call will run: the forced one, else the best.
std::string simd_target();

// Makes every kernel run `target` (a name from simd_targets(), in any case) until called again; an
// empty name goes back to the best. Process-wide and not thread-safe: for tests, benchmarks and the
// CLI's --simd-target. Throws ValueError naming the available targets when `target` is not one of
// them, and saying so when it is a target this CPU cannot run.
void use_simd_target(std::string_view target);

// What the kernels' tiling and the benchmarks' reports need to know of the CPU, read from the
// operating system at run time (0 where it does not say).
struct CpuInfo {
  std::string model;      // e.g. /proc/cpuinfo's "model name"; "unknown" where not found
  int64_t l1d_bytes = 0;  // level-1 data cache of one core
  int64_t l2_bytes = 0;   // level-2 cache of one core
  int64_t l3_bytes = 0;   // level-3 cache, shared
};

// Read once and kept.
const CpuInfo& cpu_info();

// cpu_info() in one line for reports: "MODEL; caches L1d 32.0 KiB, L2 512.0 KiB, L3 32.0 MiB".
std::string cpu_summary();

}  // namespace qkv
