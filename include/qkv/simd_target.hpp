#pragma once
// The SIMD instruction set of qkv's vectorised kernels (attention_forward_fused,
// attention_backward_fused, linear_forward_blocked, linear_backward_blocked and the paths that
// choose them).
//
// The kernels are compiled once per instruction set (Google Highway: AVX-512 "AVX3", "AVX2",
// "SSE4" and the portable "EMU128") and every call runs the best one this CPU supports. Highway
// keeps that choice once for the whole process, so there is one setting here for every kernel.
// Tests and benchmarks use these functions to run, and compare, each instruction set. None of
// them takes a tensor: there are no shapes.

#include <string>
#include <string_view>
#include <vector>

namespace qkv {

// The instruction sets the kernels were compiled for that this CPU can run, best first; whatever
// use_simd_target forced.
std::vector<std::string> simd_targets();

// The instruction set the next kernel call will run: the forced one, else the best.
std::string simd_target();

// Makes every kernel run `target` (a name from simd_targets()) until called again; an empty name
// goes back to the best. Process-wide and not thread-safe: for tests and benchmarks. Throws
// ValueError naming the available targets when `target` is not one of them.
void use_simd_target(std::string_view target);

}  // namespace qkv
