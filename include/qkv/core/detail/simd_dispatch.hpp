#pragma once
// For the Highway kernels' dispatch (attention_fused.cpp, linear.cpp): what must happen before a
// HWY_DYNAMIC_DISPATCH call, so that QKV_SIMD_TARGET governs the very first one.

namespace qkv::detail {

// Applies QKV_SIMD_TARGET the first time it is called (every entry point of simd_target.hpp calls
// it before anything else); throws ValueError naming the variable when it names a target this CPU
// cannot run or no target at all.
void prepare_simd_dispatch();

}  // namespace qkv::detail
