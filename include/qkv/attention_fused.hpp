#pragma once
// The SIMD instruction sets of the fused attention kernels (attention_forward_fused and
// attention_backward_fused, declared in qkv/attention.hpp).
//
// The kernels are compiled once per instruction set (Google Highway: AVX-512 "AVX3", "AVX2",
// "SSE4" and the portable "EMU128") and every call runs the best one this CPU supports. Tests and
// benchmarks use these functions to run, and compare, each of them.

#include <string>
#include <string_view>
#include <vector>

namespace qkv {

// The instruction sets the fused kernels were compiled for that this CPU can run, best first.
std::vector<std::string> attention_fused_targets();

// The instruction set the next fused call will run.
std::string attention_fused_target();

// Makes the fused kernels run `target` (a name from attention_fused_targets()) until called again;
// an empty name goes back to the best. Process-wide and not thread-safe: for tests and benchmarks.
// Throws ValueError naming the available targets when `target` is not one of them.
void attention_fused_use_target(std::string_view target);

}  // namespace qkv
