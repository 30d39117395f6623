// The linear layer's matrix products (y = x Wᵀ + b, dx += dy W, dW += dyᵀ x) and bias gradient
// (db += Σ dy) as Highway SIMD code, compiled once per instruction set by src/ops/linear.cpp
// (hwy/foreach_target.h) and chosen at run time.
//
// ---- The algorithm -----------------------------------------------------------------------------
// One routine, Gemm, computes C [M, N] (+)= A [M, K] · B [K, N] (+ a bias row), and the three
// products of the layer are instances of it (rows = the leading dims of x flattened):
//   forward  y  = x Wᵀ + b   A = x [rows, In] row-major,  B = Wᵀ [In, Out] (W read column-major)
//   input    dx += dy W      A = dy [rows, Out],          B = W [Out, In]
//   weight   dW += dyᵀ x     A = dyᵀ [Out, rows] (dy read column-major), B = x [rows, In]
// db += Σ_rows dy is a sum over the depth of dW's A, taken while dW packs it (a_sums), or alone by
// ColumnSums in the same order.
//
// ---- Accuracy and determinism -------------------------------------------------------------------
// Everything is computed in T: float32 for float. The depth K is cut into chunks of kDepthChunk at
// fixed multiples of it; each chunk is summed from zero in a register by fused multiply-adds
// (one rounding per term) and then added to C:
//   C(i, j) = ((bias_j + s_0) + s_1) + …,   s_c = Σ_{k in chunk c} A(i, k) B(k, j)
// (C(i, j) + s_0 + s_1 + … when accumulating). That is blocked summation: the rounding error
// grows with ≈ kDepthChunk + K/kDepthChunk terms instead of K, which matters for dW, whose depth is
// the number of rows (thousands); over In or Out of a few hundred it is the naive loop's order.
// The chain of operations that produces one element depends only on (i, j, K), never on the tile,
// the task or the thread that computes it: every tile shape runs the same lane-wise FMAs, and
// columns past a row's end go through a lane buffer with the same adds. Results are therefore
// bit-identical for any thread count and for any other rows in the call (on one instruction set:
// targets without FMA round products separately).
//
// ---- Tiling and loop order ----------------------------------------------------------------------
// The micro-kernel (Tile) holds an R × (C vectors) tile of C in registers: per step of the depth
// it loads C vectors of a B row, broadcasts R elements of A and issues R·C FMAs (8 × 3 with
// AVX-512's 32 registers: 24 accumulators, 3 B vectors and a broadcast; 4 × 3 with 16 registers).
// B is packed into panels of C·N columns, zero-padded to whole vectors, stored depth-major
// ([k][C·N]): the kernel streams one contiguous panel, never reads past a row, and a panel chunk
// (kDepthChunk × C·N, 24 KiB in float) stays in L1 while every row tile of a task reuses it.
// Row-major A (x, dy) is read in place: R rows walked along the depth, each a sequential stream.
// Column-major A (dyᵀ) is packed into row tiles (see Packed). Loop order inside a task, for rows
// [m0, m1) and panels [p0, p1):
//   for each depth chunk:  for each panel:  for each row tile of R rows:  Tile
// Tasks are blocks of kBlockTiles row tiles × groups of panels; each owns the C elements it
// writes, so no reduction is ever split across threads.
//
// ---- Memory traffic -----------------------------------------------------------------------------
// The operands are packed kSuperChunks chunks of the depth at a time (all of W for the forward and
// dx; 2048 rows of x and dy for dW), by all threads, reading their sources row after row: the
// copy stays bounded for long sequences, and packed B (a few hundred KiB) is read by the tasks
// from L2 once per block of R·kBlockTiles rows. Each of x, dy, W, y, dx is read or written from
// memory about once per product, against a float64 loop that reread W (or x) for every row.
// Single thread, float, AVX-512, 2048×256×256: ≈ 95% of oneDNN's sgemm for the forward and dx,
// ≈ 80% for dW + db (bench/bench_linear.cpp).

// ---- Target-independent part: the parameter structs (normal include guard) -----------------------
#ifndef QKV_SRC_LINEAR_INL_H_
#define QKV_SRC_LINEAR_INL_H_

#include <cstdint>

namespace qkv::linear_simd {

// How a matrix is laid out: element (i, j) is data[i·stride + j] (row-major) or data[j·stride + i]
// (column-major).
enum class Order { kRowMajor, kColMajor };

template <class T>
struct MatrixRef {
  const T* data = nullptr;
  int64_t stride = 0;  // elements between neighbouring rows (row-major) or columns (column-major)
  Order order = Order::kRowMajor;
};

// C [m, n] (+)= A [m, k] · B [k, n], validated by src/ops/linear.cpp.
template <class T>
struct GemmParams {
  int64_t m = 0;  // rows of A and C
  int64_t n = 0;  // columns of B and C
  int64_t k = 0;  // the depth summed over
  MatrixRef<T> a;
  MatrixRef<T> b;
  T* c = nullptr;           // C(i, j) = c[i·c_stride + j]; rows do not overlap
  int64_t c_stride = 0;     //
  const T* bias = nullptr;  // [n] at bias_stride, the first term of every row of C; null: none
  int64_t bias_stride = 0;  //
  bool accumulate = false;  // C += A·B (bias ignored); otherwise C = bias + A·B
  // [m] at a_sums_stride, += Σ_k A(i, k) summed as ColumnSums sums (db += Σ dy alongside dW, from
  // the same pass over dy); only for column-major A; null: not wanted.
  T* a_sums = nullptr;
  int64_t a_sums_stride = 0;
};

// out [cols] += Σ_i A(i, ·) for A [rows, cols] row-major: the bias gradient db += Σ_rows dy.
template <class T>
struct ColumnSumParams {
  const T* a = nullptr;  // A(i, j) = a[i·stride + j]
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;
  T* out = nullptr;  // out(j) = out[j·out_stride]
  int64_t out_stride = 0;
};

}  // namespace qkv::linear_simd

#endif  // QKV_SRC_LINEAR_INL_H_

// ---- Per-target part ---------------------------------------------------------------------------
#if defined(QKV_SRC_LINEAR_INL_H_TARGET) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_SRC_LINEAR_INL_H_TARGET
#undef QKV_SRC_LINEAR_INL_H_TARGET
#else
#define QKV_SRC_LINEAR_INL_H_TARGET
#endif

#include <algorithm>
#include <cstddef>
#include <vector>

#include "hwy/highway.h"
#include "qkv/core/parallel.hpp"
#include "simd/buffers.hpp"
#include "simd/micro_gemm-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::linear_simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Micro-kernel tile: rows × vectors of accumulators, sized to the register file: 24 accumulators
// + 3 B vectors + 1 broadcast of 32 registers, or 12 + 3 + 1 of 16.
constexpr size_t kTileRows = simd::HWY_NAMESPACE::kVectorRegisters == 32 ? 8 : 4;
constexpr size_t kTileVectors = 3;
// Depth summed in registers before it is added to C: the summation block and the L1 panel chunk.
constexpr size_t kDepthChunk = 128;
// Row tiles per task: enough rows that a task amortises reading its B panels from L2.
constexpr size_t kBlockTiles = 8;
// Tasks aimed at per product, so that any core count finds work to balance.
constexpr size_t kTargetTasks = 16;
// Depth chunks packed at once: bounds the copy of B (x, for dW) at 16·128 rows.
constexpr size_t kSuperChunks = 16;

using simd::Allocate;
using simd::Buffer;
using simd::DivCeil;
using simd::ToSize;

// What the first chunk of the depth does with C: overwrite it, start from the bias, or (every
// later chunk, and every chunk when accumulating) add to it.
enum class Store { kOverwrite, kBias, kAdd };

// Calls fn(row, rows) for the row tiles of [m0, m1) in order: whole tiles of kTileRows rows, then
// the leftover 4, 2 and 1. Packing and computing walk the same sequence.
template <class Fn>
HWY_INLINE void ForEachRowTile(size_t m0, size_t m1, const Fn& fn) {
  size_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows) fn(m, kTileRows);
  for (size_t rows : {size_t{4}, size_t{2}, size_t{1}}) {
    if (rows < kTileRows && m + rows <= m1) {
      fn(m, rows);
      m += rows;
    }
  }
}

// The operands of one super-chunk of the depth (kSuperChunks·kDepthChunk steps at most), packed.
// B [k, n] goes into panels of `width` = kTileVectors·N columns: panel p holds columns
// [p·width, p·width + width_p) depth-major, row κ of the panel at panel(p) + κ·width_p, where
// width_p (≤ width) is its column count rounded up to whole vectors; the padding is zero.
// Column-major A [m, k] (dyᵀ) goes into tiles: chunk c's row tile at row q (ForEachRowTile's
// sequence) holds [chunk length][tile rows] at a_tile(c, q). In place, the R broadcasts of a step
// are neighbours but consecutive steps are a row of dy apart (often a power of two bytes), so a
// tile's chunk would fall into a few L1 sets and be reloaded for every panel; packed, it is one
// contiguous run. Both are read from their source row by row, as the hardware prefetches best.
template <class T>
struct Packed {
  size_t depth = 0;  // steps a super-chunk holds
  size_t width = 0;  // columns of a full panel
  size_t lanes = 0;  // N
  size_t n = 0;      // columns of B
  size_t m = 0;      // rows of A (when packed)
  Buffer<T> b;
  Buffer<T> a;     // empty when A is read in place
  Buffer<T> sums;  // [chunk][m]: Σ of A's steps in the chunk, per row; empty when not wanted

  size_t panels() const { return DivCeil(n, width); }
  size_t panel_width(size_t p) const { return std::min(width, DivCeil(n - p * width, lanes) * lanes); }
  T* panel(size_t p) const { return b.get() + p * width * depth; }
  // Chunk starting at step kc (of length `len`), row tile starting at row q.
  T* a_tile(size_t kc, size_t len, size_t q) const { return a.get() + kc * m + q * len; }
  T* chunk_sums(size_t kc) const { return sums.get() + kc / kDepthChunk * m; }
};

template <size_t R, bool kSum, class T>
HWY_INLINE void CopyRun(const T* HWY_RESTRICT from, T* HWY_RESTRICT to, T* HWY_RESTRICT sums) {
  HWY_UNROLL(8)
  for (size_t r = 0; r < R; ++r) {
    to[r] = from[r];
    if constexpr (kSum) sums[r] += from[r];
  }
}

template <bool kSum, class T>
HWY_INLINE void CopyRunOf(size_t rows, const T* HWY_RESTRICT from, T* HWY_RESTRICT to, T* HWY_RESTRICT sums) {
  if (rows == kTileRows) {
    CopyRun<kTileRows, kSum>(from, to, sums);
  } else if (rows == 4) {
    CopyRun<4, kSum>(from, to, sums);
  } else if (rows == 2) {
    CopyRun<2, kSum>(from, to, sums);
  } else {
    CopyRun<1, kSum>(from, to, sums);
  }
}

// Steps [kb, ke) of this super-chunk (from step k0 of A) into the tiles of packed.a, a few steps
// (rows of dy) at a time: their reads stay in L1 while every tile receives one contiguous run. With
// packed.sums, also the chunk's sum per row of A, from zero in step order.
template <class T>
HWY_NOINLINE void PackAChunk(const MatrixRef<T>& a, size_t k0, size_t kb, size_t ke, const Packed<T>& packed) {
  constexpr size_t kStepsAtOnce = 16;
  const size_t len = ke - kb;
  T* sums = packed.sums ? packed.chunk_sums(kb) : nullptr;
  if (sums) std::fill(sums, sums + packed.m, T{0});
  for (size_t k1 = kb; k1 < ke; k1 += kStepsAtOnce) {
    const size_t k2 = std::min(ke, k1 + kStepsAtOnce);
    ForEachRowTile(0, packed.m, [&](size_t q, size_t rows) {
      T* HWY_RESTRICT tile = packed.a_tile(kb, len, q);
      for (size_t k = k1; k < k2; ++k) {
        const T* HWY_RESTRICT src = a.data + (k0 + k) * ToSize(a.stride) + q;
        T* HWY_RESTRICT to = tile + (k - kb) * rows;
        if (sums) {
          CopyRunOf<true>(rows, src, to, sums + q);
        } else {
          CopyRunOf<false>(rows, src, to, sums);
        }
      }
    });
  }
}

// Steps [kb, ke) of row-major B (rows of x) into every panel.
template <class T>
void PackBRows(const MatrixRef<T>& b, size_t k0, size_t kb, size_t ke, const Packed<T>& packed) {
  for (size_t k = kb; k < ke; ++k) {
    const T* HWY_RESTRICT src = b.data + (k0 + k) * ToSize(b.stride);
    for (size_t p = 0; p < packed.panels(); ++p) {
      const size_t col0 = p * packed.width;
      const size_t w = packed.panel_width(p);
      const size_t cols = std::min(w, packed.n - col0);
      T* HWY_RESTRICT out = packed.panel(p) + k * w;
      std::copy_n(src + col0, cols, out);
      std::fill(out + cols, out + w, T{0});
    }
  }
}

// Steps [kb, ke) of column-major B (Wᵀ) into panel p: a transpose, each column of B (a row of W)
// a contiguous run along the depth.
template <class T>
void PackBColumns(const MatrixRef<T>& b, size_t k0, size_t kb, size_t ke, size_t p, const Packed<T>& packed) {
  const size_t col0 = p * packed.width;
  const size_t w = packed.panel_width(p);
  const size_t cols = std::min(w, packed.n - col0);
  T* HWY_RESTRICT out = packed.panel(p);
  for (size_t c = 0; c < cols; ++c) {
    const T* HWY_RESTRICT src = b.data + (col0 + c) * ToSize(b.stride) + k0;
    for (size_t k = kb; k < ke; ++k) out[k * w + c] = src[k];
  }
  for (size_t k = kb; k < ke; ++k) std::fill(out + k * w + cols, out + (k + 1) * w, T{0});
}

// Steps [k0, k0 + depth) of B, and of A when it is packed, one task per depth chunk (and panel,
// for column-major B).
template <class T>
void PackOperands(const GemmParams<T>& p, size_t k0, size_t depth, const Packed<T>& packed, int max_threads) {
  const size_t chunks = DivCeil(depth, kDepthChunk);
  const size_t b_tasks = p.b.order == Order::kRowMajor ? chunks : chunks * packed.panels();
  const size_t a_tasks = packed.a ? chunks : 0;
  parallel_for(
      static_cast<int64_t>(b_tasks + a_tasks),
      [&](int64_t task, int /*worker*/) {
        const size_t chunk = ToSize(task) < b_tasks ? ToSize(task) % chunks : ToSize(task) - b_tasks;
        const size_t kb = chunk * kDepthChunk;
        const size_t ke = std::min(depth, kb + kDepthChunk);
        if (ToSize(task) >= b_tasks) {
          PackAChunk(p.a, k0, kb, ke, packed);
        } else if (p.b.order == Order::kRowMajor) {
          PackBRows(p.b, k0, kb, ke, packed);
        } else {
          PackBColumns(p.b, k0, kb, ke, ToSize(task) / chunks, packed);
        }
      },
      max_threads);
}

// One tile's view of the operands, at depth k0 of the current chunk.
template <class T>
struct TileArgs {
  const T* a = nullptr;  // A(m0, k0)
  size_t a_stride = 0;   // between rows of A (row-major) or depth steps (column-major)
  const T* b = nullptr;  // the panel's row k0
  size_t b_width = 0;    // the panel's width (elements between depth steps)
  size_t depth = 0;      // steps in this chunk
  T* c = nullptr;        // C(m0, col0)
  size_t c_stride = 0;
  size_t cols = 0;          // columns of C that exist from col0 on (the tile may cover fewer or more)
  const T* bias = nullptr;  // bias(col0) in a contiguous copy padded to whole panels
  Store store = Store::kAdd;
};

// The new value of C for accumulators `acc` of one vector of C at `out` (`lanes` of its N exist).
template <class D, class V = hn::Vec<D>, class T = hn::TFromD<D>>
HWY_INLINE void StoreVector(D d, Store store, V acc, const T* bias, T* HWY_RESTRICT out, size_t lanes) {
  if (lanes == hn::Lanes(d)) {
    if (store == Store::kAdd) acc = hn::Add(hn::LoadU(d, out), acc);
    if (store == Store::kBias) acc = hn::Add(hn::LoadU(d, bias), acc);
    hn::StoreU(acc, d, out);
    return;
  }
  // A row's last partial vector: the same adds through a lane buffer, so no access passes the row.
  HWY_ALIGN T buffer[hn::MaxLanes(d)] = {};
  if (store == Store::kAdd) std::copy_n(out, lanes, buffer);
  if (store == Store::kBias) std::copy_n(bias, lanes, buffer);
  if (store != Store::kOverwrite) acc = hn::Add(hn::Load(d, buffer), acc);
  hn::Store(acc, d, buffer);
  std::copy_n(buffer, lanes, out);
}

// C [R rows][C vectors] (+)= A·B over one depth chunk, by the one micro-kernel (its chunk is
// kDepthChunk too, so it sums the whole call in registers). Not inlined: inlined into the loops
// over panels and tiles, GCC spilled half of the accumulators to the stack.
template <size_t R, size_t C, Order kOrderA, class D, class T = hn::TFromD<D>>
HWY_NOINLINE void Tile(D d, const TileArgs<T>& t) {
  const size_t N = hn::Lanes(d);
  // Row-major A: rows a_stride apart, walked along the depth. Column-major (packed): the R
  // elements of a depth step are neighbours, steps a_stride apart.
  const simd::HWY_NAMESPACE::TileOperands<T> operands{.a = t.a,
                                                      .a_row = kOrderA == Order::kRowMajor ? t.a_stride : 1,
                                                      .a_depth = kOrderA == Order::kRowMajor ? 1 : t.a_stride,
                                                      .b = t.b,
                                                      .b_row = t.b_width,
                                                      .depth = t.depth};
  simd::HWY_NAMESPACE::MicroTile<R, C, kDepthChunk>(d, operands, [&](const auto& acc, bool first) HWY_ATTR {
    const Store store = first ? t.store : Store::kAdd;
    HWY_UNROLL(8)
    for (size_t r = 0; r < R; ++r) {
      HWY_UNROLL(4)
      for (size_t v = 0; v < C; ++v) {
        const size_t col = v * N;
        if (col < t.cols) {
          StoreVector(d, store, acc[r][v], t.bias + col, t.c + r * t.c_stride + col, std::min(N, t.cols - col));
        }
      }
    }
  });
}

// Rows [m0, m1) of one panel. Row-major A is read in place (t.a at row m0, t.a_stride between
// rows); column-major A has been packed (t.a: the chunk's tile at row m0; tiles follow each other).
template <size_t C, Order kOrderA, class D, class T = hn::TFromD<D>>
HWY_INLINE void PanelRows(D d, const TileArgs<T>& t, size_t m0, size_t m1) {
  ForEachRowTile(m0, m1, [&](size_t row, size_t rows) {
    TileArgs<T> tile = t;
    tile.c = t.c + (row - m0) * t.c_stride;
    if (kOrderA == Order::kRowMajor) {
      tile.a = t.a + (row - m0) * t.a_stride;
    } else {
      tile.a = t.a + (row - m0) * t.depth;
      tile.a_stride = rows;
    }
    if (rows == kTileRows) {
      Tile<kTileRows, C, kOrderA>(d, tile);
    } else if (rows == 4) {
      Tile<4, C, kOrderA>(d, tile);
    } else if (rows == 2) {
      Tile<2, C, kOrderA>(d, tile);
    } else {
      Tile<1, C, kOrderA>(d, tile);
    }
  });
}

template <Order kOrderA, class D, class T = hn::TFromD<D>>
HWY_NOINLINE void PanelRowsAnyWidth(D d, const TileArgs<T>& t, size_t vectors, size_t m0, size_t m1) {
  static_assert(kTileVectors == 3, "the switch below covers panels of 1 to 3 vectors");
  switch (vectors) {
    case 3:
      PanelRows<3, kOrderA>(d, t, m0, m1);
      break;
    case 2:
      PanelRows<2, kOrderA>(d, t, m0, m1);
      break;
    default:
      PanelRows<1, kOrderA>(d, t, m0, m1);
      break;
  }
}

// C = bias (or 0) when the depth is 0: no chunk runs to store anything.
template <class T>
void StoreBiasOnly(const GemmParams<T>& p) {
  for (int64_t i = 0; i < p.m; ++i) {
    T* row = p.c + i * p.c_stride;
    for (int64_t j = 0; j < p.n; ++j) row[j] = p.bias ? p.bias[j * p.bias_stride] : T{0};
  }
}

// The part of the product that one task owns: rows [m0, m1) × panels [p0, p1) of C, over the
// depth steps [k0, k0 + depth) that `packed` holds, chunk after chunk.
template <class D, class T = hn::TFromD<D>>
void MultiplyBlock(D d, const GemmParams<T>& p, const Packed<T>& packed, const T* bias, size_t k0, size_t depth,
                   size_t m0, size_t m1, size_t p0, size_t p1) {
  for (size_t kc = 0; kc < depth; kc += kDepthChunk) {
    const size_t len = std::min(kDepthChunk, depth - kc);
    const bool first = k0 + kc == 0 && !p.accumulate;
    for (size_t pi = p0; pi < p1; ++pi) {
      const size_t col0 = pi * packed.width;
      const size_t width = packed.panel_width(pi);
      const TileArgs<T> t{.a = packed.a ? packed.a_tile(kc, len, m0) : p.a.data + m0 * ToSize(p.a.stride) + k0 + kc,
                          .a_stride = ToSize(p.a.stride),
                          .b = packed.panel(pi) + kc * width,
                          .b_width = width,
                          .depth = len,
                          .c = p.c + m0 * ToSize(p.c_stride) + col0,
                          .c_stride = ToSize(p.c_stride),
                          .cols = ToSize(p.n) - col0,
                          .bias = bias + col0,
                          .store = first ? (p.bias ? Store::kBias : Store::kOverwrite) : Store::kAdd};
      if (packed.a) {
        PanelRowsAnyWidth<Order::kColMajor>(d, t, width / hn::Lanes(d), m0, m1);
      } else {
        PanelRowsAnyWidth<Order::kRowMajor>(d, t, width / hn::Lanes(d), m0, m1);
      }
    }
  }
}

template <class T>
void GemmImpl(const GemmParams<T>& p) {
  if (p.m == 0 || p.n == 0 || (p.k == 0 && p.accumulate)) return;  // (then A has no element to sum)
  if (p.k == 0) {
    StoreBiasOnly(p);
    return;
  }
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const size_t m = ToSize(p.m), n = ToSize(p.n), k = ToSize(p.k);
  const int max_threads = thread_limit(static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k));

  Packed<T> packed{.depth = std::min(k, kSuperChunks * kDepthChunk),
                   .width = kTileVectors * N,
                   .lanes = N,
                   .n = n,
                   .m = m,
                   .b = {},
                   .a = {},
                   .sums = {}};
  packed.b = Allocate<T>(packed.panels() * packed.width * packed.depth);
  if (p.a.order == Order::kColMajor) packed.a = Allocate<T>(packed.depth * m);
  // Row sums of A: chunk sums from the packing, added to `total` in chunk order, then to a_sums.
  Buffer<T> total;
  if (p.a_sums) {
    packed.sums = Allocate<T>(DivCeil(packed.depth, kDepthChunk) * m);
    total = Allocate<T>(m);
    std::fill(total.get(), total.get() + m, T{0});
  }
  Buffer<T> bias = Allocate<T>(packed.panels() * packed.width);
  std::fill(bias.get(), bias.get() + packed.panels() * packed.width, T{0});
  if (p.bias) {
    for (size_t j = 0; j < n; ++j) bias[j] = p.bias[static_cast<int64_t>(j) * p.bias_stride];
  }

  // The task grid: blocks of rows × groups of panels, fixed by the shape alone.
  const size_t block_rows = kBlockTiles * kTileRows;
  const size_t row_blocks = DivCeil(m, block_rows);
  const size_t panels_per_group =
      DivCeil(packed.panels(), std::min(packed.panels(), DivCeil(kTargetTasks, row_blocks)));
  const size_t panel_groups = DivCeil(packed.panels(), panels_per_group);

  for (size_t k0 = 0; k0 < k; k0 += packed.depth) {
    const size_t depth = std::min(packed.depth, k - k0);
    PackOperands(p, k0, depth, packed, max_threads);
    if (p.a_sums) {
      for (size_t kc = 0; kc < depth; kc += kDepthChunk) {
        const T* HWY_RESTRICT sums = packed.chunk_sums(kc);
        for (size_t i = 0; i < m; ++i) total[i] += sums[i];
      }
    }
    parallel_for(
        static_cast<int64_t>(row_blocks * panel_groups),
        [&](int64_t task, int /*worker*/) {
          const size_t m0 = ToSize(task) / panel_groups * block_rows;
          const size_t p0 = ToSize(task) % panel_groups * panels_per_group;
          MultiplyBlock(d, p, packed, bias.get(), k0, depth, m0, std::min(m, m0 + block_rows), p0,
                        std::min(packed.panels(), p0 + panels_per_group));
        },
        max_threads);
  }
  if (p.a_sums) {
    for (size_t i = 0; i < m; ++i) p.a_sums[static_cast<int64_t>(i) * p.a_sums_stride] += total[i];
  }
}

// Column sums in the same blocked order as Gemm's depth: chunks of kDepthChunk rows summed from
// zero, added to a running total, which is added to `out` once. One task per block of
// kSumBlockVectors vectors of columns, which it reads row after row.
constexpr size_t kSumBlockVectors = 16;

// Columns [j0, j0 + kSumBlockVectors·N) ∩ [0, cols).
template <class D, class T = hn::TFromD<D>>
HWY_NOINLINE void ColumnSumBlock(D d, const ColumnSumParams<T>& p, size_t j0) {
  const size_t N = hn::Lanes(d);
  const size_t width = std::min(kSumBlockVectors * N, ToSize(p.cols) - j0);
  const size_t whole = width / N * N;
  const size_t rows = ToSize(p.rows);
  HWY_ALIGN T total[kSumBlockVectors * hn::MaxLanes(d)] = {};
  HWY_ALIGN T chunk[kSumBlockVectors * hn::MaxLanes(d)];
  for (size_t r0 = 0; r0 < rows; r0 += kDepthChunk) {
    std::fill(chunk, chunk + width, T{0});
    const size_t r1 = std::min(rows, r0 + kDepthChunk);
    for (size_t r = r0; r < r1; ++r) {
      const T* HWY_RESTRICT row = p.a + r * ToSize(p.stride) + j0;
      for (size_t j = 0; j < whole; j += N) {
        hn::Store(hn::Add(hn::Load(d, chunk + j), hn::LoadU(d, row + j)), d, chunk + j);
      }
      for (size_t j = whole; j < width; ++j) chunk[j] += row[j];
    }
    for (size_t j = 0; j < width; ++j) total[j] += chunk[j];
  }
  for (size_t j = 0; j < width; ++j) p.out[static_cast<int64_t>(j0 + j) * p.out_stride] += total[j];
}

template <class T>
void ColumnSumsImpl(const ColumnSumParams<T>& p) {
  if (p.cols == 0) return;
  const hn::ScalableTag<T> d;
  const size_t block = kSumBlockVectors * hn::Lanes(d);
  const int max_threads = thread_limit(static_cast<double>(p.rows) * static_cast<double>(p.cols));
  parallel_for(
      static_cast<int64_t>(DivCeil(ToSize(p.cols), block)),
      [&](int64_t task, int /*worker*/) { ColumnSumBlock(d, p, ToSize(task) * block); }, max_threads);
}

void GemmFloat(const GemmParams<float>& p) { GemmImpl(p); }
void GemmDouble(const GemmParams<double>& p) { GemmImpl(p); }
void ColumnSumsFloat(const ColumnSumParams<float>& p) { ColumnSumsImpl(p); }
void ColumnSumsDouble(const ColumnSumParams<double>& p) { ColumnSumsImpl(p); }

}  // namespace qkv::linear_simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // QKV_SRC_LINEAR_INL_H_TARGET
