// The one register-blocked micro-kernel under every matrix product of the ops layer: the fused
// attention's Q·Kᵀ, P·V and backward products (attention_fused-inl.h) and the linear layer's three
// products (linear-inl.h). Included from their per-target parts, so it is compiled once per
// instruction set with them.
//
// MicroTile<R, C, kDepthChunk> holds an R × (C vectors) tile of C = A·B in registers. Per step of
// the depth it loads C vectors of a row of B, broadcasts R elements of A and issues R·C fused
// multiply-adds. A is read element by element through two strides, so row-major, column-major
// and packed A are all one form; B's rows are contiguous vectors. The depth is summed in chunks
// of kDepthChunk steps, each from zero in registers and then handed to the caller's store, which
// adds the chunk to C or writes it: blocked summation, whose rounding error grows with
// kDepthChunk + depth/kDepthChunk terms instead of the depth. The tile shape and the chunk are
// template parameters because they are each caller's summation order (and its results, bit for
// bit), chosen for its register file and its operands' sizes.

#if defined(QKV_SRC_OPS_SIMD_MICRO_GEMM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_SRC_OPS_SIMD_MICRO_GEMM_INL_H_
#undef QKV_SRC_OPS_SIMD_MICRO_GEMM_INL_H_
#else
#define QKV_SRC_OPS_SIMD_MICRO_GEMM_INL_H_
#endif

#include <algorithm>
#include <cstddef>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Vector registers of the target: what a caller sizes its tile by (accumulators, B vectors and a
// broadcast must fit without spilling).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
inline constexpr int kVectorRegisters = 32;
#else
inline constexpr int kVectorRegisters = 16;
#endif

// The operands of one tile: A(r, k) = a[r·a_row + k·a_depth], B(k, c) = b[k·b_row + c], over
// `depth` steps. B's rows hold at least C whole vectors from b.
template <class T>
struct TileOperands {
  const T* a = nullptr;
  size_t a_row = 0;
  size_t a_depth = 0;
  const T* b = nullptr;
  size_t b_row = 0;
  size_t depth = 0;
};

// Sums the tile chunk by chunk and calls store(acc, first) after each, with acc the chunk's
// hn::Vec<D>[R][C] and `first` true for the chunk at depth 0. A depth of 0 stores one chunk of
// zeros.
template <size_t R, size_t C, size_t kDepthChunk, class D, class Store, class T = hn::TFromD<D>>
HWY_INLINE void MicroTile(D d, const TileOperands<T>& t, const Store& store) {
  static_assert(R * C + C + 1 <= static_cast<size_t>(kVectorRegisters), "the tile does not fit the registers");
  const size_t N = hn::Lanes(d);
  hn::Vec<D> acc[R][C];
  size_t k0 = 0;
  do {
    const size_t k1 = std::min(t.depth, k0 + kDepthChunk);
    HWY_UNROLL(8)
    for (size_t r = 0; r < R; ++r) {
      HWY_UNROLL(8)
      for (size_t v = 0; v < C; ++v) acc[r][v] = hn::Zero(d);
    }
    for (size_t k = k0; k < k1; ++k) {
      const T* HWY_RESTRICT bk = t.b + k * t.b_row;
      const T* HWY_RESTRICT ak = t.a + k * t.a_depth;
      hn::Vec<D> bv[C];
      HWY_UNROLL(8)
      for (size_t v = 0; v < C; ++v) bv[v] = hn::LoadU(d, bk + v * N);
      HWY_UNROLL(8)
      for (size_t r = 0; r < R; ++r) {
        const hn::Vec<D> ar = hn::Set(d, ak[r * t.a_row]);
        HWY_UNROLL(8)
        for (size_t v = 0; v < C; ++v) acc[r][v] = hn::MulAdd(ar, bv[v], acc[r][v]);
      }
    }
    store(acc, k0 == 0);
    k0 = k1;
  } while (k0 < t.depth);
}

}  // namespace qkv::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
