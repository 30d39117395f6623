#pragma once
// What the SIMD kernels of the ops layer (simd/micro_gemm-inl.h and its callers) share and that
// does not depend on the instruction set: aligned scratch buffers and size arithmetic.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "hwy/aligned_allocator.h"

namespace qkv::simd {

// Aligned to Highway's vector alignment, so that full-vector loads of a buffer's start are aligned.
template <class T>
using Buffer = hwy::AlignedFreeUniquePtr<T[]>;

// Never empty, so that the pointer is valid even for a size of 0.
template <class T>
Buffer<T> Allocate(size_t n) {
  return hwy::AllocateAligned<T>(std::max<size_t>(n, 1));
}

inline size_t ToSize(int64_t x) { return static_cast<size_t>(x); }
inline size_t DivCeil(size_t x, size_t y) { return (x + y - 1) / y; }
inline size_t RoundUp(size_t x, size_t multiple) { return DivCeil(x, multiple) * multiple; }

}  // namespace qkv::simd
