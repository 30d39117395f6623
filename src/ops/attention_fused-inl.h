// Fused attention (FlashAttention-2) on the CPU: the Highway SIMD code, compiled once per
// instruction set by src/ops/attention_fused.cpp (hwy/foreach_target.h) and chosen at run time.
//
// ---- The algorithm -----------------------------------------------------------------------------
// Forward, one head, queries i and keys j:  s_ij = scale·q_i·k_j + bias_ij (−inf where masked),
// lse_i = log Σ_j exp(s_ij),  out_i = Σ_j exp(s_ij − lse_i) v_j. The reference builds the Tq×Tk
// matrix s; here it only ever exists as one Bc×Br tile in a thread's scratch. Keys are visited a
// block at a time and each query row keeps its online-softmax state:
//   m_i  running max of the scores seen so far (starts at −inf, never a finite sentinel)
//   l_i  running sum  Σ_j exp(s_ij − m_i)
//   o_i  running output Σ_j exp(s_ij − m_i) v_j, unnormalised
// A new key block with block max m̃ gives m' = max(m, m̃), c = exp(m − m'), then
//   l ← c·l + Σ_j exp(s_ij − m'),   o ← c·o + Σ_j exp(s_ij − m') v_j,   m ← m'.
// At the end out_i = o_i / l_i and lse_i = m_i + log l_i. While a row has seen no visible key,
// m' = −inf: the exponentials are then taken relative to 0 instead of m' (exp(−inf − 0) = 0,
// never −inf − (−inf) = NaN), so o and l stay 0; a row that never sees a key gets out 0 and
// lse −inf. The result is exact softmax, not an approximation: only the order of the sums changes.
//
// Backward (FlashAttention-2), derived in src/ops/attention.cpp above attention_backward_reference:
//   P_ij = exp(s_ij − lse_i)        (recomputed from the saved lse; 0 where masked)
//   dV_j += Σ_i P_ij dO_i           dP_ij = dO_i·v_j         dS_ij = P_ij (dP_ij − D_i)
//   dQ_i += scale Σ_j dS_ij k_j     dK_j += scale Σ_i dS_ij q_i    dbias_ij += dS_ij
// with D_i = dO_i·out_i precomputed per row by the very chain of roundings that computes dP_ij, so
// that dP_ij − D_i is exactly 0 where it must be: for a query that sees a single key (out_i = v_j,
// as the first query of causal attention). A fully masked row has lse −inf; it is replaced by +inf
// so that P = exp(−inf − (+inf)) = 0 rather than NaN. When the backward runs the forward itself
// (nothing saved), lse is kept as two numbers hi + lo and P = exp((s − hi) − lo) is free of the
// half-ulp rounding of lse that a saved lse carries into every P of its row.
//
// ---- Variants -----------------------------------------------------------------------------------
// Grouped-query heads read K and V of head h / group in place; in decode, a group's query rows take
// each K and V row together (AttendSharedRows). Causality and the window are one band of visible
// j − i: tiles outside it are never visited (forward: the key range of a query block; backward:
// tiles skipped in both loops), tiles inside it take the unmasked path. Softcap and ALiBi are part
// of Scores, so both layouts and both passes compute them alike; the backward takes the softcap's
// slope from the same call. Sinks change only a row's lse and the factor of its output, when the
// outputs are written (their gradient is summed at the API). Dropout scales P by factors drawn
// from (seed; b, h, i, j) wherever P is used: the forward's P·V, the backward's dV and dP; the
// running sum l is the softmax's, before dropout. Packed sequences never reach the kernels: the
// API runs one call per sequence on views.
//
// ---- Stored operands ------------------------------------------------------------------------------
// Q, K and V may be stored as float16, bfloat16 or int8 with scales (StoredRows; float32 kernels).
// Wherever a tile of the forward or the backward reads a block of their rows (the backward: its key
// block once, its query block once for each key block), StageRows first converts those rows to
// float32 in the worker's scratch (F16C's conversion or its emulation, a shift, or int8 widened
// and multiplied by its scale), and the block is then used exactly as a float32 input's would be: every value is
// the one to_float32 gives, and every later operation is the float32 kernel's, so the result is
// bit-identical to the float32 kernel on the converted arrays, on every target (bfloat16 Q and K
// on a CPU with the bf16 dot product excepted: UsesBf16Scores); the conversion's
// load and store per element are nothing beside a tile's 2·Br multiply-adds per K and V element.
// The few-query layout (decode), which uses each element once, converts it in registers as it
// loads it (LoadRow, the same operations), so that it reads half or a quarter of the bytes at the
// pace of memory; there int8 scales multiply the query or a dot product, and the weights, instead
// of every element (KeyDots), and int8 results are held to the float64 reference's tolerance
// rather than to bit-identity.
//
// ---- Accuracy -----------------------------------------------------------------------------------
// Everything is computed in T (float32 or float64): the products, exp, the running sums. Sums over
// d and over key or query blocks are blocked (TileUpdate: chunks of kDepthChunk = 64 summed in
// registers from zero, then added), so their rounding error grows with ≈ 64 + n/64 terms rather
// than n: a score at d ≤ 64 is one chain, as in a naive implementation, while a sum over thousands
// of keys or queries (out, dK, dV) carries a small fraction of the naive error.
// Large logits are the hard case. A score carries an absolute rounding error of about an ulp of
// |q·k|, and exp turns it into a relative error of P: at |s| ≈ 500 that is 6·10⁻⁵, five hundred
// float epsilons, where a softmax computed from scratch (the naive one included) loses nothing on its
// largest weights, because s_max − m is exactly 0 whatever s_max's rounding. The backward keeps
// that cancellation only if it recomputes, for every (i, j), the very score the forward's lse
// came from, bit for bit. So every score is one lane's chain of TileUpdate: products over d in
// order, chunks of kDepthChunk from zero, chunk sums added in order. Lanes never meet in it, so
// the chain is the same whichever operand runs along the lanes (queries, keys) and however many
// lanes a vector has: the query-vector forward and both backward layouts give identical scores
// on every target, from AVX-512's 16 lanes to the scalar target's one. Scores by the bf16 dot
// product (UsesBf16Scores) are one lane's chain of pairs of dims in the same chunks, and so the
// same in all three layouts too. The few-query layout sums
// across lanes (an order that depends on the lane count) and so only serves forwards that return
// no lse, which no backward can read. Nor may the compiler fuse a multiply and an add that the
// code writes apart (libqkv is compiled with -ffp-contract=off): it would do so only on targets
// that have FMA, and then the forward's exp(scale·x − m) and the backward's s = scale·x, s − lse
// would round differently, by an ulp of |s| in every P, on AVX2 and AVX-512 and not elsewhere.
// A softcap's slope, the backward's factor on dS, is sech² from exp(−2|y|), lane by lane: 1 − tanh²
// loses its relative precision on tanh's tail and is 0 in float from |y| ≈ 9, where the slope and
// the gradients through it are still 10⁻⁸ of their size at y = 0.
//
// ---- Memory traffic -----------------------------------------------------------------------------
// The reference writes and reads Tq×Tk scores per head (64 MiB at T = 4096); here every score lives
// only in L1/L2 scratch, so DRAM sees Q, K, V, out (and dO, dQ, dK, dV) a few times each: O(T·d)
// per head instead of O(T²). Per worker the scratch is a few tiles (≈ 100 KiB at d = 64).
//
// ---- Tiling and loop order ----------------------------------------------------------------------
// Forward task = (head, block of Br = 64 queries); loop over key blocks of Bc = 64. The queries'
// Qᵀ [Dk][Br] is packed once per task, so the score tile is computed transposed, Sᵀ [Bc][Br] =
// K·Qᵀ: the vectors run along queries, which turns the online softmax into plain lane-wise
// Max/Exp/Add across the Bc rows (no horizontal reductions) and needs no per-block repacking of K.
// The output is kept transposed too, Oᵀ [Dv][Br] += Vᵀ·Pᵀ: Pᵀ's rows (in L1, just written) are
// the vectors and V's elements, read straight from the input, the broadcasts; the rescaling by
// exp(m_old − m_new) is then lane-wise as well.
// Causal: key blocks entirely above the diagonal of the query block are never visited; the
// heaviest (last) query blocks are handed out first so that causal work balances.
//
// Decode (Tq ≤ 16): one query block per head leaves a single core busy, so the keys are split into
// chunks, each chunk a task producing (m, l, o) partials, merged per row by log-sum-exp
// (partials of chunks that saw no key have m = −inf and weigh exactly 0). A block of at most 8
// queries (one query per head in decoding) would leave most lanes of the query-vector layout
// empty, so such blocks take a second layout, AttendFewQueries: lanes along keys, each score a dot
// product along d, blocks of one vector of keys; there the kernel reads each key and value row
// once and does little else, so for one query it runs at the pace of memory. Its work grows with
// the queries while the query-vector layout's does not: past about 8 queries the latter is faster.
// A forward that returns lse (what training saves for the backward) never takes it: see Accuracy.
//
// All products are one register-blocked micro-kernel, C[R×(C·N)] (+)= A·B: R rows of A broadcast,
// C vectors of a B row loaded, R·C accumulators held in registers across a chunk of the depth (4×4
// vectors with AVX-512's 32 registers, 6×2 with 16). B rows must be contiguous: Qᵀ, Kᵀ, Vᵀ, dOᵀ are
// packed; V, dO, Q, K rows are read in place; a last partial vector of columns is copied into a
// zero-padded panel so no load crosses the end of a row. Any Dk, Dv work (the fast paths are the
// multiples of the vector width: 64 and 128 fill 4 and 8 AVX-512 vectors); problems under ≈ 1M
// multiply-adds run on one thread.
//
// Backward without atomics, deterministic for any thread count. Two schedules with identical
// arithmetic per output element:
//  - one pass: task = head; for each key block (Kᵀ, Vᵀ packed once), for each query block: the tile
//    with queries as rows; dK, dV accumulate in scratch over the query blocks, dQ is added to the
//    output tile by tile (in key-block order).
//  - two passes, when there are too few heads for the threads: pass 1, task = (head, key block),
//    the same tiles giving dK, dV; pass 2, task = (head, query block), Qᵀ and dOᵀ packed once, the
//    tiles recomputed with keys as rows, adding dQ tile by tile in the same key-block order.
// Every score, P, dP and dS element is the same chain of operations in both layouts (the same FMAs
// over d in the same order, the same lane-wise Exp), so both give bit-identical gradients; which one
// runs depends on the thread count only for speed. dbias is summed in the key-block tasks; elements
// shared by several heads (a bias broadcast over B or H) are owned by one task that runs those
// heads in increasing order.

// ---- Target-independent part: the parameter structs (normal include guard) -----------------------
#ifndef QKV_SRC_ATTENTION_FUSED_INL_H_
#define QKV_SRC_ATTENTION_FUSED_INL_H_

#include <cstddef>
#include <cstdint>
#include <utility>

#include "qkv/core/rng.hpp"
#include "qkv/core/storage.hpp"

namespace qkv::fused {

// A [B, H, T, C] operand with any strides: element (b, h, t, c) is
// data[b·batch + h·head + t·row + c·col]. Absent when data is null.
template <class T>
struct StridedView4 {
  T* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;

  explicit operator bool() const { return data != nullptr; }
  T* row(int64_t b, int64_t h, int64_t t) const { return data + b * batch_stride + h * head_stride + t * row_stride; }
};

// Rows of Q, K, V, O and their gradients, [B, H, T, D]. col_stride is 1 for every operand the
// kernels load as vectors (checked at the API).
template <class T>
using RowsView = StridedView4<T>;

// Rows of Q, K or V stored narrower than float32 (float16, bfloat16, int8 with scales), or in the
// pages of a KV cache: the kernels convert (or copy) them where they read them, a block of rows at
// a time into float32 scratch (StageRows) or a vector at a time in registers (LoadRow). Neither
// narrower nor paged, the operand's RowsView<T> in Inputs is read.
struct StoredRows {
  StorageType type = StorageType::float32;
  const uint8_t* data = nullptr;
  int64_t batch_stride = 0;  // in elements of the storage type
  int64_t head_stride = 0;
  int64_t row_stride = 0;
  // int8: element (b, h, t, c) stands for scales(b, h, t, c)·x, the scales broadcast (stride 0).
  StridedView4<const float> scales;
  // Paged: token t of batch entry b is row t % page_tokens of page pages[b·page_table_stride +
  // t / page_tokens]; pages lie page_stride elements apart (their scales scale_page_stride apart),
  // and batch_stride is not used.
  const int64_t* pages = nullptr;
  int64_t page_table_stride = 0;
  int64_t page_tokens = 0;
  int64_t page_stride = 0;
  int64_t scale_page_stride = 0;

  // Whether the kernels read this instead of the operand's RowsView.
  explicit operator bool() const { return type != StorageType::float32 || pages != nullptr; }
  size_t element_bytes() const { return static_cast<size_t>(storage_bytes(type)); }
  // Paged: row t's entry in its batch entry's page table, and its row in that page.
  std::pair<int64_t, int64_t> PageAndSlot(int64_t t) const { return {t / page_tokens, t % page_tokens}; }
  const uint8_t* row(int64_t b, int64_t h, int64_t t) const {
    if (pages != nullptr) {
      const auto [index, slot] = PageAndSlot(t);
      const int64_t page = pages[b * page_table_stride + index];
      return data + static_cast<size_t>(page * page_stride + h * head_stride + slot * row_stride) * element_bytes();
    }
    return data + static_cast<size_t>(b * batch_stride + h * head_stride + t * row_stride) * element_bytes();
  }
  const float* scale_row(int64_t b, int64_t h, int64_t t) const {
    if (pages != nullptr) {
      const auto [index, slot] = PageAndSlot(t);
      const int64_t page = pages[b * page_table_stride + index];
      return scales.data + page * scale_page_stride + h * scales.head_stride + slot * scales.row_stride;
    }
    return scales.row(b, h, t);
  }
};

// A [B, H, Tq, Tk] operand (mask, bias, dbias), strides 0 along broadcast dims.
template <class T>
using ScoresView = StridedView4<T>;

// A [B, H, Tq] per-row statistic. Absent when data is null.
template <class T>
struct RowStatView {
  T* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t stride = 0;

  explicit operator bool() const { return data != nullptr; }
  T& at(int64_t b, int64_t h, int64_t i) const { return data[b * batch_stride + h * head_stride + i * stride]; }
};

// What every fused kernel reads, validated at the API (src/ops/attention_fused.cpp).
template <class T>
struct Inputs {
  int64_t batch = 0;    // B
  int64_t heads = 0;    // H
  int64_t tq = 0;       // Tq
  int64_t tk = 0;       // Tk
  int64_t dk = 0;       // Dk ≥ 1
  int64_t dv = 0;       // Dv
  RowsView<const T> q;  // [B, H, Tq, Dk], col_stride 1
  RowsView<const T> k;  // [B, H, Tk, Dk], col_stride 1
  RowsView<const T> v;  // [B, H, Tk, Dv], col_stride 1
  // The same operands when stored narrower (T = float only; the forward only): read instead.
  StoredRows q_stored, k_stored, v_stored;
  ScoresView<const uint8_t> allowed;  // nonzero = may attend; absent: every key may be attended
  ScoresView<const T> bias;           // added to the scaled scores; absent: 0
  // Query i sees keys i + band_lo ≤ j ≤ i + band_hi (causality and the window; bounds of ±2⁶²
  // are none).
  int64_t band_lo = 0;
  int64_t band_hi = 0;
  int64_t diagonal = 0;      // o, the key on query i's diagonal is i + o (for ALiBi)
  int64_t group = 1;         // query heads per kv head: head h reads K and V of head h / group
  T scale = 1;               // multiplies q·k
  T softcap = 0;             // > 0: scale·q·k becomes softcap·tanh(scale·q·k / softcap); 0: none
  const T* alibi = nullptr;  // [H] slopes: −slope_h·|i + o − j| is added; null: none
  // Dropout on P (off when dropout_scale is 0): kept weights are scaled by dropout_scale =
  // 1/(1 − p), those that `dropout` drops at (dropout_batch0 + b, h, i, j) become 0.
  DropoutDraw dropout = {};
  int64_t dropout_batch0 = 0;
  T dropout_scale = 0;

  int64_t heads_total() const { return batch * heads; }
  int64_t kv_head(int64_t h) const { return h / group; }
  // Bytes of one row of K and of V as they are read (stored, or T).
  int64_t key_row_bytes() const { return dk * static_cast<int64_t>(k_stored ? k_stored.element_bytes() : sizeof(T)); }
  int64_t value_row_bytes() const { return dv * static_cast<int64_t>(v_stored ? v_stored.element_bytes() : sizeof(T)); }
  // Keys from `begin` and before `end` narrowed to those some query of [q0, q0 + nq) may see: the
  // first query sees none before q0 + band_lo, the last none after q0 + nq − 1 + band_hi.
  int64_t BandBegin(int64_t q0, int64_t begin) const { return std::max(begin, q0 + band_lo); }
  int64_t BandEnd(int64_t q0, int64_t nq, int64_t end) const { return std::min(end, q0 + nq + band_hi); }
  // Whether some (i, j) with i in [q0, q0 + nq) and j in [j0, j0 + nk) is in the band.
  bool BandTouches(int64_t q0, int64_t nq, int64_t j0, int64_t nk) const {
    return j0 + nk - 1 - q0 >= band_lo && j0 - (q0 + nq - 1) <= band_hi;
  }
  // Whether every such pair is.
  bool BandCovers(int64_t q0, int64_t nq, int64_t j0, int64_t nk) const {
    return j0 - (q0 + nq - 1) >= band_lo && j0 + nk - 1 - q0 <= band_hi;
  }
};

template <class T>
struct ForwardParams {
  Inputs<T> in;
  RowsView<T> out;  // [B, H, Tq, Dv], overwritten; any col stride
  // [B, H, Tq], overwritten; absent: not wanted.
  RowStatView<T> lse;
  // [B·H·Tq] contiguous, row (b·H + h)·Tq + i, or null: what rounding lse to T lost (lse is
  // computed in float64), so that the backward can recompute P = exp(s − lse) without that error.
  // Only the backward's own forward asks for it.
  T* lse_lo = nullptr;
  // Whether every score must be computed by the backward's own chain of roundings (see "Accuracy"
  // above), as it must when the lse is returned, since a backward recomputes P from it. Then the
  // few-query layout, which sums q·k in another order, is not taken.
  bool scores_as_backward = false;
  // [H] the sinks' logits, joined to each row's softmax when its outputs are written; null: none.
  const T* sinks = nullptr;
};

template <class T>
struct BackwardParams {
  Inputs<T> in;
  RowsView<const T> dout;  // [B, H, Tq, Dv] ∂L/∂out, col_stride 1
  // [B·H·Tq] contiguous, row (b·H + h)·Tq + i: lse = lse_hi + lse_lo, the low part 0 when only a
  // T-precision lse is known. lse_hi is +inf for fully masked rows (lse −inf) so that exp(s − lse)
  // is 0 there instead of exp(−inf − (−inf)) = NaN.
  const T* lse_hi = nullptr;
  const T* lse_lo = nullptr;
  RowsView<const T> out;  // [B, H, Tq, Dv] the forward's output, for D_i = dO_i·out_i; any col stride
  RowsView<T> dq;         // [B, H, Tq, Dk], accumulated (+=); any col stride
  RowsView<T> dk;         // [B, H, Tk, Dk], accumulated
  RowsView<T> dv;         // [B, H, Tk, Dv], accumulated
  ScoresView<T> dbias;    // [B, H, Tq, Tk] over the bias's storage (stride 0 where broadcast); += ; absent: not wanted
};

}  // namespace qkv::fused

#endif  // QKV_SRC_ATTENTION_FUSED_INL_H_

// ---- Per-target part ---------------------------------------------------------------------------
#if defined(QKV_SRC_ATTENTION_FUSED_INL_H_TARGET) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_SRC_ATTENTION_FUSED_INL_H_TARGET
#undef QKV_SRC_ATTENTION_FUSED_INL_H_TARGET
#else
#define QKV_SRC_ATTENTION_FUSED_INL_H_TARGET
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_amx.hpp"
#include "attention_bf16.hpp"
#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "qkv/core/parallel.hpp"
#include "qkv/core/simd_target.hpp"
#include "simd/buffers.hpp"
#include "simd/micro_gemm-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using fused::BackwardParams;
using fused::ForwardParams;
using fused::Inputs;

constexpr size_t kQueryBlock = 64;  // Br: queries per tile (a multiple of every target's lane count)
constexpr size_t kKeyBlock = 64;    // Bc: keys per tile
constexpr size_t kLineBytes = 64;   // a cache line of every x86 CPU, the unit prefetches ask for
// Decode: at most this many queries make a problem "decode", whose keys are split into chunks.
constexpr int64_t kDecodeQueries = 16;
constexpr int64_t kDecodeMinChunk = 512;  // keys per chunk at least: merging partials costs Tq·Dv
constexpr int64_t kDecodeTasks = 64;      // chunks × heads aimed at: enough to balance any core count
// At most this many queries take the kernel with keys along the lanes (AttendFewQueries): measured
// at Tk = 32768, d = 128, it is faster than the query-vector layout up to 8 queries, slower from 12.
constexpr size_t kFewQueries = 8;
// How far ahead of its keys AttendFewQueries asks for the K and V rows it converts (float16,
// bfloat16, int8, paged) where a vector is a whole line (narrower vectors ask row by row), counted
// in bytes of K (32 KiB: 64 keys at d = 128). Chosen on Zen 3 when
// every operand was prefetched: 8 keys ahead (the next block) 62% of the triad, 16 keys 69–74%,
// 64 keys 74–76%, 128 and more lower.
constexpr size_t kFewQueriesPrefetchBytes = 32 * 1024;
// Key vectors AttendFewQueries takes per step of its online softmax when each key serves at least
// kFewQueriesWideRows query rows, or K or V is int8 (FewQueriesBlockVectors).
constexpr size_t kFewQueriesWideBlock = 4;
constexpr size_t kFewQueriesWideRows = 4;
static_assert(kKeyBlock % (kFewQueriesWideBlock * hn::MaxLanes(hn::ScalableTag<float>())) == 0,
              "decode ranges must end where AttendFewQueries' blocks do");

// Depth summed in registers before adding to C (see TileUpdate), a key block's worth. Every chunk
// ends with a load, add and store per accumulator: in a 6 × 2 AVX2 tile, chunks of 16 ran the
// micro-kernel at 80% of the speed of unchunked sums and chunks of 32 at 93% (measured in L1 on
// Zen 3), and the forward took 1.14× as long with 16 as with 64.
constexpr size_t kDepthChunk = kKeyBlock;
// Micro-kernel tile: rows × vectors of accumulators, sized to the register file. Two FMA pipes of
// four cycles' latency need at least 8 independent accumulators; more hide the loads' latency too.
constexpr int kTileRows = simd::HWY_NAMESPACE::kVectorRegisters == 32 ? 4 : 6;
// 16 accumulators + 4 B vectors + 1 broadcast of 32 registers, or 12 + 2 + 1 of 16.
constexpr int kTileVectors = simd::HWY_NAMESPACE::kVectorRegisters == 32 ? 4 : 2;

// parallel_for's thread limit for the whole problem, by the one policy (core/parallel.hpp).
template <class T>
int ThreadLimit(const Inputs<T>& in) {
  return thread_limit(static_cast<double>(in.heads_total()) * static_cast<double>(in.tq) * static_cast<double>(in.tk) *
                      static_cast<double>(in.dk + in.dv));
}

using simd::Allocate;
using simd::Buffer;
using simd::DivCeil;
using simd::RoundUp;
using simd::ToSize;

// ---- The micro-kernel ------------------------------------------------------------------------------

// C (+)= A·B over `depth`, for C [rows][cols], with A read element by element (broadcast, so any
// strides) and B rows read as vectors (contiguous).
template <class T>
struct Gemm {
  const T* a = nullptr;  // A(r, k) = a[r·a_row + k·a_depth]
  size_t a_row = 0;
  size_t a_depth = 0;
  const T* b = nullptr;  // B(k, c) = b[k·b_row + c]
  size_t b_row = 0;
  T* c = nullptr;  // C(r, c) = c[r·c_row + c]; rows padded to whole vectors
  size_t c_row = 0;
  size_t rows = 0;
  size_t depth = 0;
};

// One R × (C vectors) tile of C at (r0, col0), by the one micro-kernel: the depth summed in chunks
// of kDepthChunk, each added to C (blocked summation, for one load, add and store per accumulator
// and chunk).
template <int R, int C, bool kAccumulate, class D, class T = hn::TFromD<D>>
HWY_INLINE void TileUpdate(D d, const Gemm<T>& g, size_t r0, size_t col0) {
  const size_t N = hn::Lanes(d);
  T* HWY_RESTRICT c = g.c + r0 * g.c_row + col0;
  const simd::HWY_NAMESPACE::TileOperands<T> operands{.a = g.a + r0 * g.a_row,
                                                      .a_row = g.a_row,
                                                      .a_depth = g.a_depth,
                                                      .b = g.b + col0,
                                                      .b_row = g.b_row,
                                                      .depth = g.depth};
  simd::HWY_NAMESPACE::MicroTile<R, C, kDepthChunk>(d, operands, [&](const auto& acc, bool first) HWY_ATTR {
    const bool overwrite = !kAccumulate && first;
    HWY_UNROLL(8)
    for (int r = 0; r < R; ++r) {
      HWY_UNROLL(8)
      for (int v = 0; v < C; ++v) {
        T* HWY_RESTRICT out = c + r * g.c_row + v * N;
        hn::StoreU(overwrite ? acc[r][v] : hn::Add(hn::LoadU(d, out), acc[r][v]), d, out);
      }
    }
  });
}

// R rows of C, all `vectors` column vectors.
template <int R, bool kAccumulate, class D, class T = hn::TFromD<D>>
HWY_INLINE void RowGroup(D d, const Gemm<T>& g, size_t r0, size_t vectors) {
  const size_t N = hn::Lanes(d);
  size_t v = 0;
  for (; v + kTileVectors <= vectors; v += kTileVectors) TileUpdate<R, kTileVectors, kAccumulate>(d, g, r0, v * N);
  if constexpr (kTileVectors > 2) {
    if (v + 2 <= vectors) {
      TileUpdate<R, 2, kAccumulate>(d, g, r0, v * N);
      v += 2;
    }
  }
  if (v < vectors) TileUpdate<R, 1, kAccumulate>(d, g, r0, v * N);
}

// C [rows][vectors·N] (+)= A·B: whole tiles, then the leftover rows four, two and one at a time.
// A single column vector (decode: one query) takes twice the rows at a time, for as many
// independent FMA chains.
template <bool kAccumulate, class D, class T = hn::TFromD<D>>
HWY_NOINLINE void MatMul(D d, const Gemm<T>& g, size_t vectors) {
  static_assert(kTileRows >= 4 && kTileRows < 8, "the row remainder below handles up to 7 rows");
  size_t r = 0;
  if (vectors == 1) {
    for (; r + 2 * kTileRows <= g.rows; r += 2 * kTileRows) TileUpdate<2 * kTileRows, 1, kAccumulate>(d, g, r, 0);
  }
  for (; r + kTileRows <= g.rows; r += kTileRows) RowGroup<kTileRows, kAccumulate>(d, g, r, vectors);
  if constexpr (kTileRows > 4) {
    if (r + 4 <= g.rows) {
      RowGroup<4, kAccumulate>(d, g, r, vectors);
      r += 4;
    }
  }
  if (r + 2 <= g.rows) {
    RowGroup<2, kAccumulate>(d, g, r, vectors);
    r += 2;
  }
  if (r < g.rows) RowGroup<1, kAccumulate>(d, g, r, vectors);
}

// C [rows][cols] (+)= A·B for any cols: B's last partial vector of columns is first copied into
// `panel` [depth][N], zero-padded, so that no load reads past the end of a B row.
template <bool kAccumulate, class D, class T = hn::TFromD<D>>
HWY_INLINE void MatMulCols(D d, const Gemm<T>& g, size_t cols, T* HWY_RESTRICT panel) {
  const size_t N = hn::Lanes(d);
  const size_t whole = cols / N;
  if (whole > 0) MatMul<kAccumulate>(d, g, whole);
  const size_t tail = cols - whole * N;
  if (tail == 0) return;
  for (size_t k = 0; k < g.depth; ++k) {
    const T* src = g.b + k * g.b_row + whole * N;
    for (size_t c = 0; c < N; ++c) panel[k * N + c] = c < tail ? src[c] : T{0};
  }
  Gemm<T> last = g;
  last.b = panel;
  last.b_row = N;
  last.c = g.c + whole * N;
  MatMul<kAccumulate>(d, last, 1);
}

// A strided sequence of `count` elements as a vector (lanes past count are `fill`).
template <class D, class T = hn::TFromD<D>, class E>
HWY_INLINE hn::Vec<D> LoadStrided(D d, const E* x, int64_t stride, size_t count, T fill) {
  if constexpr (std::is_same_v<E, T>) {
    if (stride == 1 && count == hn::Lanes(d)) return hn::LoadU(d, x);
  }
  HWY_ALIGN T lanes[hn::MaxLanes(d)];
  for (size_t l = 0; l < hn::Lanes(d); ++l)
    lanes[l] = l < count ? static_cast<T>(x[static_cast<int64_t>(l) * stride]) : fill;
  return hn::Load(d, lanes);
}

// A block of rows of T, row j at rows + j·stride.
template <class T>
struct RowBlock {
  const T* rows = nullptr;
  size_t stride = 0;

  const T* row(size_t j) const { return rows + j * stride; }
};

template <class T>
RowBlock<T> RowsOf(const fused::RowsView<const T>& x, int64_t b, int64_t h, int64_t t0) {
  return {x.row(b, h, t0), ToSize(x.row_stride)};
}

// Packs n rows of `cols` columns transposed: out[c·ld + t] = rows.row(t)[c], columns n..ld zero
// (ld is n rounded up to whole vectors, and the padding must not be NaN).
template <class T>
void PackTransposed(const RowBlock<T>& rows, size_t n, size_t cols, size_t ld, T* HWY_RESTRICT out) {
  for (size_t t = 0; t < n; ++t) {
    const T* HWY_RESTRICT src = rows.row(t);
    for (size_t c = 0; c < cols; ++c) out[c * ld + t] = src[c];
  }
  for (size_t c = 0; c < cols; ++c) std::fill(out + c * ld + n, out + (c + 1) * ld, T{0});
}

// One row of a stored operand as the kernels read it: a vector (LoadRow) or an element (RowAt) at
// a time, converted in registers from its storage type S: F16C's conversion (or its emulation) for
// float16, a shift for bfloat16, and for int8 widening to int32, conversion and one multiply by the
// scale, so that every value is exactly what to_float32 (core/storage.hpp) gives. A row of T read
// in place is a plain pointer with the same two functions.
template <StorageType S>
struct StoredRow {
  const uint8_t* data = nullptr;
  const float* scale = nullptr;  // int8: the row's scales, scale_step apart
  int64_t scale_step = 0;
};

template <class D, class T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> LoadRow(D d, const T* HWY_RESTRICT row, size_t c) {
  return hn::LoadU(d, row + c);
}

template <class T>
HWY_INLINE T RowAt(const T* HWY_RESTRICT row, size_t c) {
  return row[c];
}

// The integers of an int8 row as float32, without their scales: for kernels that apply the scales
// to fewer numbers than the row's elements (a query, a weight) instead.
struct Int8Integers {
  const int8_t* data = nullptr;
};

// The integers of int8 rows at a fixed stride, without their scales.
struct Int8RunIntegers {
  const int8_t* first = nullptr;
  size_t stride = 0;  // bytes

  HWY_INLINE Int8Integers row(size_t j) const { return {first + j * stride}; }
};

template <class D>
HWY_INLINE hn::Vec<D> LoadRow(D d, const Int8Integers& row, size_t c) {
  return hn::ConvertTo(d, hn::PromoteTo(hn::Rebind<int32_t, D>(), hn::LoadU(hn::Rebind<int8_t, D>(), row.data + c)));
}

HWY_INLINE float RowAt(const Int8Integers& row, size_t c) { return static_cast<float>(row.data[c]); }

// A row of T read in place that starts `shift` lanes past a vector boundary (a numpy array or a
// std::vector is 16-byte aligned, a row of 128 floats then 16 bytes past every 64-byte line): each
// vector is put together from the two aligned vectors it straddles, so that no load splits a cache
// line. The vector is the one LoadU would give, lane for lane, so the results do not depend on
// where the rows lie. A split load costs a streaming kernel about a fifth of its bandwidth (a
// decode on Zen 5 read 47 GB/s where the same rows 64-byte aligned read 55). Reads up to a vector
// before the row and after it, within the rows its RealignedRows was made for. Only vectors of a
// whole line are put together so: a 256-bit vector splits a line in every other load of such a
// row, and on Zen 3 (AVX2) those splits cost less than two loads and two permutes for every
// vector: decode read K and V 1.20–1.28× as fast with plain unaligned loads on one thread, and
// 1.10–1.26× on two (single-query multi-head and grouped-query, H = 32, Tk = 32768, d = 128).
template <class D, class T = hn::TFromD<D>>
struct RealignedRow {
  const T* HWY_RESTRICT base;  // the row's start rounded down to a vector
  size_t shift;
  hn::Vec<hn::RebindToSigned<D>> indices;  // lane l takes lane (l + shift) mod N
  hn::Mask<D> from_first;                  // the lanes taken from the first of the two vectors
};

template <class D, class T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> LoadRow(D d, const RealignedRow<D>& row, size_t c) {
  const auto indices = hn::IndicesFromVec(d, row.indices);
  const hn::Vec<D> first = hn::TableLookupLanes(hn::Load(d, row.base + c), indices);
  const hn::Vec<D> second = hn::TableLookupLanes(hn::Load(d, row.base + c + hn::Lanes(d)), indices);
  return hn::IfThenElse(row.from_first, first, second);
}

template <class D, class T = hn::TFromD<D>>
HWY_INLINE T RowAt(const RealignedRow<D>& row, size_t c) {
  return row.base[row.shift + c];
}

// Whether LoadRow converts a row's elements rather than reading them as they are stored.
template <class Row>
inline constexpr bool kConvertsRow = true;
template <class T>
inline constexpr bool kConvertsRow<const T*> = false;
template <class D>
inline constexpr bool kConvertsRow<RealignedRow<D>> = false;

// Rows of a RowBlock that all start `shift` lanes past a vector boundary, as RealignedRow.
template <class D, class T = hn::TFromD<D>>
class RealignedRows {
 public:
  RealignedRows(D d, const RowBlock<T>& rows, size_t shift)
      : rows_(rows),
        shift_(shift),
        indices_(hn::And(
            hn::Add(hn::Iota(hn::RebindToSigned<D>(), 0),
                    hn::Set(hn::RebindToSigned<D>(), static_cast<hn::TFromD<hn::RebindToSigned<D>>>(shift))),
            hn::Set(hn::RebindToSigned<D>(), static_cast<hn::TFromD<hn::RebindToSigned<D>>>(hn::Lanes(d) - 1)))),
        from_first_(hn::FirstN(d, hn::Lanes(d) - shift)) {}

  RealignedRow<D> row(size_t j) const { return {rows_.row(j) - shift_, shift_, indices_, from_first_}; }

 private:
  RowBlock<T> rows_;
  size_t shift_;
  hn::Vec<hn::RebindToSigned<D>> indices_;
  hn::Mask<D> from_first_;
};

// A row of T read in place whose vectors are whole cache lines (512-bit vectors) and start on one:
// each vector loaded asks for the line after it. Why that pays is not known; that it does was
// measured on Zen 5 (AVX3 target, 64-byte aligned float32 K and V, H = 32, Tk = 32768, d = 128, 2
// threads, the two reads alternated in one process): single-query multi-head decode 1.24–1.40× as
// fast as with plain loads, grouped-query (Hkv = 8) 1.09–1.15×, four queries 1.10–1.12×. Plain
// loads ran 1.12–1.28× slower than the same rows 16 or 32 bytes past a line, which RealignedRow
// reads with a load of the vector after each already. With 256-bit vectors (the AVX2 target on the
// same CPU) the request measured 0.68–1.0× (once per vector or once per line), so narrower vectors
// read such rows as plain pointers.
template <class T>
struct LookaheadRow {
  const T* HWY_RESTRICT row;
};

template <class D, class T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> LoadRow(D d, const LookaheadRow<T>& row, size_t c) {
  hwy::Prefetch(row.row + c + hn::Lanes(d));
  return hn::Load(d, row.row + c);
}

template <class T>
HWY_INLINE T RowAt(const LookaheadRow<T>& row, size_t c) {
  return row.row[c];
}

template <class T>
inline constexpr bool kConvertsRow<LookaheadRow<T>> = false;

// Rows of a RowBlock that start on a cache line, as LookaheadRow.
template <class T>
struct LookaheadRows {
  RowBlock<T> rows;

  LookaheadRow<T> row(size_t j) const { return {rows.row(j)}; }
};

template <class T>
const T* RowAddress(const LookaheadRow<T>& row) {
  return row.row;
}

template <class T>
const T* RowAddress(const T* row) {
  return row;
}

template <StorageType S>
const uint8_t* RowAddress(const StoredRow<S>& row) {
  return row.data;
}

template <class D, StorageType S>
HWY_INLINE hn::Vec<D> LoadRow(D d, const StoredRow<S>& row, size_t c) {
  static_assert(std::is_same_v<hn::TFromD<D>, float>, "the API converts stored operands only to float32");
  if constexpr (S == StorageType::float32) {
    return hn::LoadU(d, reinterpret_cast<const float*>(row.data) + c);
  } else if constexpr (S == StorageType::float16) {
    return hn::PromoteTo(
        d, hn::LoadU(hn::Rebind<hwy::float16_t, D>(), reinterpret_cast<const hwy::float16_t*>(row.data) + c));
  } else if constexpr (S == StorageType::bfloat16) {
    return hn::PromoteTo(
        d, hn::LoadU(hn::Rebind<hwy::bfloat16_t, D>(), reinterpret_cast<const hwy::bfloat16_t*>(row.data) + c));
  } else {
    const hn::Vec<D> value = LoadRow(d, Int8Integers{reinterpret_cast<const int8_t*>(row.data)}, c);
    const int64_t step = row.scale_step;
    const hn::Vec<D> factor =
        step == 0   ? hn::Set(d, row.scale[0])
        : step == 1 ? hn::LoadU(d, row.scale + c)
                    : LoadStrided(d, row.scale + static_cast<int64_t>(c) * step, step, hn::Lanes(d), 0.0f);
    return hn::Mul(value, factor);
  }
}

template <StorageType S>
HWY_INLINE float RowAt(const StoredRow<S>& row, size_t c) {
  if constexpr (S == StorageType::float32) {
    return reinterpret_cast<const float*>(row.data)[c];
  } else if constexpr (S == StorageType::float16) {
    return float_from_float16(reinterpret_cast<const uint16_t*>(row.data)[c]);
  } else if constexpr (S == StorageType::bfloat16) {
    return float_from_bfloat16(reinterpret_cast<const uint16_t*>(row.data)[c]);
  } else {
    return static_cast<float>(reinterpret_cast<const int8_t*>(row.data)[c]) *
           row.scale[static_cast<int64_t>(c) * row.scale_step];
  }
}

// Rows [t0, t0 + n) of a stored operand as StoredRow<S>: row(j) is row t0 + j. Unpaged, the rows
// lie at a fixed stride from the first. Paged, so do the rows of the first's page and of the
// pages that follow it in memory (the next page in the table being the next in the pool, as a
// sequence that grew alone has them): those form one run, read as an unpaged operand's rows are.
// The page after the run is found once, and rows beyond it through the page table. While a block's
// rows past its first page were found otherwise, decoding from pages of 256 tokens ran 0.86× as
// fast as from pages of 4096 laid out the same; as one run, 1.04–1.08× (Zen 5, float16).
template <StorageType S>
class StoredRowRange {
 public:
  StoredRowRange(const fused::StoredRows& x, int64_t b, int64_t h, int64_t t0, size_t n)
      : x_(x), b_(b), h_(h), t0_(t0) {
    if (x.pages == nullptr) {
      first_ = x.row(b, h, t0);
      if constexpr (S == StorageType::int8) first_scale_ = x.scale_row(b, h, t0);
      return;
    }
    // The row and its scales from one division (x.row and x.scale_row would each divide).
    const auto [index, slot] = x.PageAndSlot(t0);
    next_page_ = x.pages + b * x.page_table_stride + index;
    first_ = PageRow(*next_page_, slot);
    if constexpr (S == StorageType::int8) first_scale_ = PageScales(*next_page_, slot);
    ++next_page_;
    run_ = ToSize(x.page_tokens - slot);
    const bool pages_abut = x.page_stride == x.page_tokens * x.row_stride &&
                            (S != StorageType::int8 || x.scale_page_stride == x.page_tokens * x.scales.row_stride);
    while (pages_abut && run_ < n && *next_page_ == next_page_[-1] + 1) {
      run_ += ToSize(x.page_tokens);
      ++next_page_;
    }
  }

  HWY_INLINE StoredRow<S> row(size_t j) const {
    constexpr auto kBytes = static_cast<size_t>(storage_bytes(S));
    if (j < run_) {
      const uint8_t* data = first_ + j * static_cast<size_t>(x_.row_stride) * kBytes;
      if constexpr (S != StorageType::int8) return {data};
      return {data, first_scale_ + static_cast<int64_t>(j) * x_.scales.row_stride, x_.scales.col_stride};
    }
    const auto in_next = static_cast<int64_t>(j - run_);
    if (in_next < x_.page_tokens) {
      if constexpr (S != StorageType::int8) return {PageRow(*next_page_, in_next)};
      return {PageRow(*next_page_, in_next), PageScales(*next_page_, in_next), x_.scales.col_stride};
    }
    const int64_t t = t0_ + static_cast<int64_t>(j);
    if constexpr (S != StorageType::int8) return {x_.row(b_, h_, t)};
    return {x_.row(b_, h_, t), x_.scale_row(b_, h_, t), x_.scales.col_stride};
  }
  // Rows [0, run()) lie at a fixed stride from the first.
  size_t run() const { return run_; }
  const float* first() const { return reinterpret_cast<const float*>(first_); }
  size_t row_bytes() const { return static_cast<size_t>(x_.row_stride) * static_cast<size_t>(storage_bytes(S)); }
  // int8: the scales of rows [0, run()), scale_row_stride() apart from the first row's (0: they
  // share them, as per-channel scales do).
  const float* first_scale() const { return first_scale_; }
  int64_t scale_row_stride() const { return x_.scales.row_stride; }
  // Row j's integers alone (int8), those of the first run found without the row's scales.
  struct Integers {
    const StoredRowRange& rows;
    Int8RunIntegers in_run{reinterpret_cast<const int8_t*>(rows.first_), rows.row_bytes()};
    size_t run = rows.run_;
    HWY_INLINE Int8Integers row(size_t j) const {
      if (j < run) return in_run.row(j);
      return {reinterpret_cast<const int8_t*>(rows.row(j).data)};
    }
  };

 private:
  // Row `slot` of page `page` of the range's head, and its scales.
  const uint8_t* PageRow(int64_t page, int64_t slot) const {
    return x_.data + static_cast<size_t>(page * x_.page_stride + h_ * x_.head_stride + slot * x_.row_stride) *
                         static_cast<size_t>(storage_bytes(S));
  }
  const float* PageScales(int64_t page, int64_t slot) const {
    return x_.scales.data + page * x_.scale_page_stride + h_ * x_.scales.head_stride + slot * x_.scales.row_stride;
  }

  const fused::StoredRows& x_;
  int64_t b_, h_, t0_;
  const uint8_t* first_ = nullptr;
  const float* first_scale_ = nullptr;
  size_t run_ = std::numeric_limits<size_t>::max();  // rows at a fixed stride from the first
  const int64_t* next_page_ = nullptr;               // paged: the table's entry for row t0 + run_
};

// Calls f with rows [t0, t0 + n) of an operand as the kernels read them in place: a RowBlock<T>
// when it is stored as T, else the StoredRowRange of its storage type (chosen here, once per call).
// Paged float32 rows in one run are a RowBlock too, read as contiguous float32 is: through their
// StoredRowRange, decoding from a cache ran 0.88× as fast as from contiguous K and V (Zen 5).
template <class T, class F>
HWY_INLINE void WithRowsInPlace(const fused::RowsView<const T>& x, const fused::StoredRows& stored, int64_t b,
                                int64_t h, int64_t t0, size_t n, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (stored) {
      switch (stored.type) {
        case StorageType::float32: {
          const StoredRowRange<StorageType::float32> rows(stored, b, h, t0, n);
          if (rows.run() >= n) return f(RowBlock<T>{rows.first(), ToSize(stored.row_stride)});
          return f(rows);
        }
        case StorageType::float16:
          return f(StoredRowRange<StorageType::float16>(stored, b, h, t0, n));
        case StorageType::bfloat16:
          return f(StoredRowRange<StorageType::bfloat16>(stored, b, h, t0, n));
        case StorageType::int8:
          return f(StoredRowRange<StorageType::int8>(stored, b, h, t0, n));
      }
    }
  }
  HWY_DASSERT(!stored);
  f(RowsOf(x, b, h, t0));
}

// Rows [t0, t0 + n) of an operand that lie at a fixed stride from row t0, as stored: all n unless
// it is paged, else those of row t0's run of pages (StoredRowRange).
struct RowRun {
  const uint8_t* first = nullptr;
  size_t stride = 0;  // bytes
  size_t rows = 0;
};

template <class T>
RowRun RowRunOf(const fused::RowsView<const T>& x, const fused::StoredRows& stored, int64_t b, int64_t h, int64_t t0,
                size_t n) {
  const size_t stride = stored ? ToSize(stored.row_stride) * stored.element_bytes() : ToSize(x.row_stride) * sizeof(T);
  RowRun run;
  WithRowsInPlace(x, stored, b, h, t0, n, [&](const auto& rows) {
    if constexpr (std::is_same_v<std::decay_t<decltype(rows)>, RowBlock<T>>) {
      run = {reinterpret_cast<const uint8_t*>(rows.rows), stride, n};
    } else {
      run = {RowAddress(rows.row(0)), stride, std::min(n, rows.run())};
    }
  });
  return run;
}

// Rows of an operand asked for as the kernel reaches each key (a fixed distance ahead, or of the
// next block): the `bytes` of row j of the run, while the run has it.
struct RunAhead {
  RowRun run;
  size_t bytes = 0;

  HWY_INLINE void Ask(size_t j) const {
    if (j < run.rows) {
      const uint8_t* row = run.first + j * run.stride;
      for (size_t c = 0; c < bytes; c += kLineBytes) hwy::Prefetch(row + c);
    }
  }
};

// Rows of K and V asked for together, row j of each as the kernel reaches key j.
struct RowsAhead {
  RunAhead k, v;

  HWY_INLINE void Ask(size_t j) const {
    k.Ask(j);
    v.Ask(j);
  }
};

// Rows of an operand (in place or stored) that ask, as row j is read, for row j of `ahead`'s
// rows (a RunAhead or a RowsAhead).
template <class Rows, class Ahead>
struct AskingRows {
  Rows rows;
  Ahead ahead;

  HWY_INLINE auto row(size_t j) const {
    ahead.Ask(j);
    return rows.row(j);
  }
};

// The rows an AskingRows reads, for reads that must not ask again (an int8 row's scales), or the
// rows themselves.
template <class Rows>
HWY_INLINE const Rows& Unasked(const Rows& rows) {
  return rows;
}
template <class Rows, class Ahead>
HWY_INLINE const Rows& Unasked(const AskingRows<Rows, Ahead>& rows) {
  return rows.rows;
}

// Whether rows (asked for ahead or not) are an int8 operand's.
template <class Rows>
inline constexpr bool kInt8Rows =
    std::is_same_v<std::decay_t<decltype(Unasked(std::declval<const Rows&>()))>, StoredRowRange<StorageType::int8>>;

// An int8 operand's rows as their integers alone (StoredRowRange::Integers), asking as they did.
template <class Rows>
HWY_INLINE auto IntegersOf(const Rows& rows) {
  return typename Rows::Integers{rows};
}
template <class Rows, class Ahead>
HWY_INLINE auto IntegersOf(const AskingRows<Rows, Ahead>& rows) {
  return AskingRows<typename Rows::Integers, Ahead>{IntegersOf(rows.rows), rows.ahead};
}

// The integers of an int8 operand's first run alone (StoredRowRange::Integers::in_run), for
// blocks that lie in it. With them, and with the V sums asking for V's rows alone (RunAhead)
// rather than testing an empty run of K's as well, int8 decode with K and V in L3 ran 1.03× as
// fast (Zen 3, d = 128).
template <class Rows>
HWY_INLINE Int8RunIntegers RunIntegersOf(const Rows& rows) {
  return typename Rows::Integers{rows}.in_run;
}
template <class Rows, class Ahead>
HWY_INLINE auto RunIntegersOf(const AskingRows<Rows, Ahead>& rows) {
  return AskingRows<Int8RunIntegers, Ahead>{RunIntegersOf(rows.rows), rows.ahead};
}

// WithRowsInPlace for the n rows [t0, t0 + n) that AttendFewQueries streams. Where a vector is a
// whole cache line, rows of T (float32 read in place, or paged float32 rows in one run) whose
// stride is whole vectors are read as LookaheadRows when they start on a vector, and as
// RealignedRows when they start off a vector boundary, all by the same number of lanes, and a row
// lies before and after them (rows_total rows in all), so that every load stays within the
// operand. Narrower vectors read them as they lie (see RealignedRow).
template <class D, class T, class F>
HWY_INLINE void WithStreamedRows(D d, const fused::RowsView<const T>& x, const fused::StoredRows& stored, int64_t b,
                                 int64_t h, int64_t t0, size_t n, int64_t rows_total, F&& f) {
  constexpr size_t kVectorBytes = hn::MaxLanes(D()) * sizeof(T);
  const auto whole_vectors = [](const RowBlock<T>& rows) { return rows.stride * sizeof(T) % kVectorBytes == 0; };
  const auto shift = [](const RowBlock<T>& rows) {
    return reinterpret_cast<uintptr_t>(rows.rows) % kVectorBytes / sizeof(T);
  };
  if (!stored) {
    if constexpr (kVectorBytes >= kLineBytes) {
      const RowBlock<T> rows = RowsOf(x, b, h, t0);
      if (whole_vectors(rows) && shift(rows) != 0 && t0 >= 1 && t0 + static_cast<int64_t>(n) < rows_total) {
        return f(RealignedRows<D>(d, rows, shift(rows)));
      }
      if (whole_vectors(rows) && shift(rows) == 0) return f(LookaheadRows<T>{rows});
    }
  }
  if constexpr (std::is_same_v<T, float> && kVectorBytes >= kLineBytes) {
    if (stored && stored.type == StorageType::float32) {
      const StoredRowRange<StorageType::float32> paged(stored, b, h, t0, n);
      const RowBlock<T> rows{paged.first(), ToSize(stored.row_stride)};
      if (paged.run() >= n && whole_vectors(rows) && shift(rows) == 0) return f(LookaheadRows<T>{rows});
    }
  }
  WithRowsInPlace(x, stored, b, h, t0, n, std::forward<F>(f));
}

// Asks for rows [t0, t0 + n) of an operand (as stored) to be brought into the caches, so that
// reading them later overlaps the work in between: one prefetch per cache line. Nothing when n ≤ 0
// (row t0 may then not exist, nor its page).
template <class T>
void PrefetchRows(const fused::RowsView<const T>& x, const fused::StoredRows& stored, int64_t b, int64_t h, int64_t t0,
                  int64_t n, size_t cols) {
  if (n <= 0) return;
  const size_t bytes = cols * (stored ? stored.element_bytes() : sizeof(T));
  WithRowsInPlace(x, stored, b, h, t0, ToSize(n), [&](const auto& rows) {
    for (size_t j = 0; j < ToSize(n); ++j) {
      const auto* row = reinterpret_cast<const uint8_t*>(RowAddress(rows.row(j)));
      for (size_t c = 0; c < bytes; c += kLineBytes) hwy::Prefetch(row + c);
    }
  });
}

// Rows [t0, t0 + n) of an operand as rows of T: in place when it is stored as T, else converted
// into `stage` [n][cols]. The conversion costs a load and a store per element, which the n rows'
// use in a tile (by every query of a block, or every key) repays.
template <class D, class T = hn::TFromD<D>>
HWY_INLINE RowBlock<T> StageRows(D d, const fused::RowsView<const T>& x, const fused::StoredRows& stored, int64_t b,
                                 int64_t h, int64_t t0, size_t n, size_t cols, T* HWY_RESTRICT stage) {
  if (!stored) return RowsOf(x, b, h, t0);
  if (n == 0) return {stage, cols};
  WithRowsInPlace(fused::RowsView<const T>{}, stored, b, h, t0, n, [&](const auto& rows) {
    const size_t N = hn::Lanes(d);
    for (size_t j = 0; j < n; ++j) {
      const auto row = rows.row(j);
      T* HWY_RESTRICT out = stage + j * cols;
      size_t c = 0;
      for (; c + N <= cols; c += N) hn::StoreU(LoadRow(d, row, c), d, out + c);
      for (; c < cols; ++c) out[c] = RowAt(row, c);
    }
  });
  return {stage, cols};
}

// ---- Exponentials --------------------------------------------------------------------------------

// e^x for the softmax, where x ≤ 0 (s − m in the forward; s − lse in the backward, above 0 by at
// most a rounding), and for the softcap's slope. Highway's Exp serves the whole float range; this
// one needs about 16 vector operations instead of 27, and the exponentials are otherwise a fifth of
// the forward's vector work. Cody–Waite reduction: n = round(x / ln 2) by the 1.5·2²³ rounding
// trick (the fused multiply-add rounds x·log₂e + 1.5·2²³ once, leaving n in the low mantissa bits),
// r = x − n·ln 2 with ln 2 split in two so that r is exact to ½ ulp, e^r by the degree-7 polynomial
// of Cephes' expf (≈ 1 ulp on |r| ≤ ½ ln 2), then 2ⁿ assembled in the exponent bits. x is first
// raised to −127·ln 2, where n = −127 gives exponent bits 0, so every x below ≈ −87.7 (−inf
// included) gives exactly 0, as e^x, which is no longer a normal float there, would round to in
// effect. Valid for x < 88. Doubles keep Highway's Exp: their polynomial would need twice the
// degree.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V SoftmaxExp(D d, V x) {
  if constexpr (!std::is_same_v<hn::TFromD<D>, float>) {
    return hn::Exp(d, x);
  } else {
    const hn::RebindToSigned<D> di;
    const V round_magic = hn::Set(d, 12582912.0f);  // 1.5·2²³
    // NaN must stay NaN. x86's max returns its second operand when either is NaN; the scalar
    // target's Max returns the other operand, so there the bound is a compare and a select.
    const V bound = hn::Set(d, -88.02969193f);
    if constexpr (HWY_TARGET == HWY_SCALAR) {
      x = hn::IfThenElse(hn::Lt(x, bound), bound, x);
    } else {
      x = hn::Max(bound, x);
    }
    const V shifted = hn::MulAdd(x, hn::Set(d, 1.44269504088896341f), round_magic);
    const V n = hn::Sub(shifted, round_magic);
    V r = hn::MulAdd(n, hn::Set(d, -0.693359375f), x);
    r = hn::MulAdd(n, hn::Set(d, 2.12194440e-4f), r);
    V poly = hn::Set(d, 1.9875691500e-4f);
    poly = hn::MulAdd(poly, r, hn::Set(d, 1.3981999507e-3f));
    poly = hn::MulAdd(poly, r, hn::Set(d, 8.3334519073e-3f));
    poly = hn::MulAdd(poly, r, hn::Set(d, 4.1665795894e-2f));
    poly = hn::MulAdd(poly, r, hn::Set(d, 1.6666665459e-1f));
    poly = hn::MulAdd(poly, r, hn::Set(d, 5.0000001201e-1f));
    const V e_r = hn::Add(hn::MulAdd(poly, hn::Mul(r, r), r), hn::Set(d, 1.0f));
    // The low bits of `shifted` hold n (two's complement, offset by the magic's mantissa, whose low
    // 9 bits are 0); shifting them to the exponent field and adding the bias 127 gives 2ⁿ.
    const auto exponent = hn::ShiftLeft<23>(hn::Add(hn::BitCast(di, shifted), hn::Set(di, 127)));
    return hn::Mul(e_r, hn::BitCast(d, exponent));
  }
}

// ---- Scores: scale, bias, masks ----------------------------------------------------------------

// The (query, key) pairs of one vector's lanes: lane ℓ < count is (i + ℓ·di, j + ℓ·dj), with
// (di, dj) = (0, 1) when a vector runs along keys and (1, 0) when it runs along queries.
struct LaneRun {
  int64_t i = 0;
  int64_t j = 0;
  int64_t di = 0;
  int64_t dj = 0;
  size_t count = 0;
};

// s = scale·(q·k), softcapped, + bias + ALiBi, −inf where the boolean mask or the band (causality,
// the window) forbids the key. The same function serves both tile layouts so that both compute
// bit-identical scores. With a softcap, `cap_slope` (when given) receives d s / d(scale·q·k) =
// sech²(y), y = scale·q·k / c, for the backward.
template <class D, class T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> Scores(D d, const Inputs<T>& in, int64_t b, int64_t h, const LaneRun& run, hn::Vec<D> dot,
                             hn::Vec<D>* cap_slope = nullptr) {
  hn::Vec<D> s = hn::Mul(dot, hn::Set(d, in.scale));
  if (in.softcap > 0) {
    const hn::Vec<D> y = hn::Div(s, hn::Set(d, in.softcap));
    if (cap_slope != nullptr) {
      // sech² y = 4e / (1 + e)² with e = exp(−2|y|), not 1 − tanh² y: tanh rounds to ±1 in float
      // from |y| ≈ 9, where 1 − tanh² becomes 0 (and is coarse well before), while sech² is still
      // 10⁻⁸ and keeps its relative precision until it underflows.
      const hn::Vec<D> e = SoftmaxExp(d, hn::Mul(hn::Abs(y), hn::Set(d, T{-2})));
      const hn::Vec<D> one_plus_e = hn::Add(e, hn::Set(d, T{1}));
      *cap_slope = hn::Div(hn::Mul(hn::Set(d, T{4}), e), hn::Mul(one_plus_e, one_plus_e));
    }
    s = hn::Mul(hn::Set(d, in.softcap), hn::Tanh(d, y));
  }
  if (in.bias) {
    const T* x = in.bias.row(b, h, run.i) + run.j * in.bias.col_stride;
    const int64_t stride = run.di * in.bias.row_stride + run.dj * in.bias.col_stride;
    s = hn::Add(s, LoadStrided(d, x, stride, run.count, T{0}));
  }
  // Lane ℓ's j − i is first + ℓ·step.
  const int64_t first = run.j - run.i;
  const int64_t step = run.dj - run.di;
  if (in.alibi) {
    // |i + o − j| of every lane, exact in T (integers far below 2²⁴).
    const hn::Vec<D> distance = hn::Abs(hn::MulAdd(hn::Iota(d, T{0}), hn::Set(d, static_cast<T>(step)),
                                                   hn::Set(d, static_cast<T>(first - in.diagonal))));
    s = hn::NegMulAdd(hn::Set(d, in.alibi[h]), distance, s);
  }
  const hn::Vec<D> neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());
  if (in.allowed) {
    const uint8_t* x = in.allowed.row(b, h, run.i) + run.j * in.allowed.col_stride;
    const int64_t stride = run.di * in.allowed.row_stride + run.dj * in.allowed.col_stride;
    s = hn::IfThenElse(hn::Eq(LoadStrided(d, x, stride, run.count, T{1}), hn::Zero(d)), neg_inf, s);
  }
  const int64_t last = first + step * static_cast<int64_t>(run.count > 0 ? run.count - 1 : 0);
  const int64_t lowest = std::min(first, last), highest = std::max(first, last);
  if (highest > in.band_hi || lowest < in.band_lo) {
    // The bounds clamped to the lanes' range keep the same verdict and fit the lanes' integers.
    const hn::RebindToSigned<D> di;
    using I = hn::TFromD<decltype(di)>;
    const auto hi = static_cast<I>(std::clamp(in.band_hi, lowest - 1, highest));
    const auto lo = static_cast<I>(std::clamp(in.band_lo, lowest, highest + 1));
    const auto lane = step > 0 ? hn::Iota(di, 0) : hn::Neg(hn::Iota(di, 0));
    const auto gap = hn::Add(hn::Set(di, static_cast<I>(first)), lane);
    const auto outside = hn::Or(hn::Gt(gap, hn::Set(di, hi)), hn::Lt(gap, hn::Set(di, lo)));
    s = hn::IfThenElse(hn::RebindMask(d, outside), neg_inf, s);
  }
  return s;
}

// ---- Dropout --------------------------------------------------------------------------------------

// Dropout factors of one vector's (query, key) pairs: 0 or 1/(1 − p). The four keys j..j+3 with
// j a multiple of 4 share one Philox draw; consecutive lanes along keys reuse it.
template <class D, class T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> DropoutFactors(D d, const Inputs<T>& in, int64_t b, int64_t h, const LaneRun& run) {
  HWY_ALIGN T factors[hn::MaxLanes(d)];
  std::array<uint32_t, 4> words{};
  int64_t drawn_i = -1, drawn_block = -1;
  for (size_t l = 0; l < hn::Lanes(d); ++l) {
    const int64_t i = run.i + static_cast<int64_t>(l) * run.di, j = run.j + static_cast<int64_t>(l) * run.dj;
    if (l >= run.count) {
      factors[l] = T{0};
      continue;
    }
    if (i != drawn_i || (j >> 2) != drawn_block) {
      words = in.dropout.words(in.dropout_batch0 + b, h, i, j);
      drawn_i = i;
      drawn_block = j >> 2;
    }
    factors[l] = words[static_cast<size_t>(j & 3)] >= in.dropout.threshold ? in.dropout_scale : T{0};
  }
  return hn::Load(d, factors);
}

// The dropout factors of queries [i0, i0 + ni) and keys [j0, j0 + nj) into a tile laid out with
// keys as rows, tile[(j − j0)·ld + (i − i0)], the ld − ni padding columns 0: query by query, so
// that four consecutive keys take one Philox draw even where vectors run along queries.
template <class T>
void FillDropoutTile(const Inputs<T>& in, int64_t b, int64_t h, int64_t i0, size_t ni, int64_t j0, size_t nj, size_t ld,
                     T* HWY_RESTRICT tile) {
  for (size_t j = 0; j < nj; ++j) std::fill(tile + j * ld + ni, tile + (j + 1) * ld, T{0});
  for (size_t i = 0; i < ni; ++i) {
    const int64_t qi = i0 + static_cast<int64_t>(i);
    std::array<uint32_t, 4> words{};
    for (size_t j = 0; j < nj; ++j) {
      const int64_t kj = j0 + static_cast<int64_t>(j);
      if (j == 0 || (kj & 3) == 0) words = in.dropout.words(in.dropout_batch0 + b, h, qi, kj);
      tile[j * ld + i] = words[static_cast<size_t>(kj & 3)] >= in.dropout.threshold ? in.dropout_scale : T{0};
    }
  }
}

// ---- Forward ---------------------------------------------------------------------------------------

// Whether this target runs the bf16 dot product (attention_bf16.hpp): an AVX-512 target (never one
// below it, so that a forced QKV_SIMD_TARGET runs the portable arithmetic) on a CPU that has
// AVX512_BF16.
inline bool Bf16Products() {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  return bf16::dot_available();
#else
  return false;
#endif
}

// Whether the query-vector layouts, forward and backward, compute the scores q·k by the bf16 dot
// product: Q and K both stored as bfloat16, on a target that has it. Its products of bfloat16
// pairs are exact in float32 and summed as TileUpdate sums (pairs of dims in order, chunks of 64
// dims from zero, chunk sums added in order), each score one lane's chain whichever operand runs
// along the lanes, so that the backward's two layouts recompute the very scores of the forward's
// lse, as Accuracy requires; they differ from the float32 kernel's on the same values only in the
// order of their sums.
template <class T>
bool UsesBf16Scores(const Inputs<T>& in) {
  return std::is_same_v<T, float> && in.q_stored.type == StorageType::bfloat16 &&
         in.k_stored.type == StorageType::bfloat16 && Bf16Products();
}

// Whether the forward's second product, P·V, takes the bf16 dot product too: V stored as bfloat16
// as well. Only forwards that return no lse take it (`few` below), since it rounds the weights to
// bfloat16: out would then be off the function a backward differentiates by more than the
// float32 rule allows.
template <class T>
bool UsesBf16Values(const Inputs<T>& in) {
  return UsesBf16Scores(in) && in.v_stored.type == StorageType::bfloat16;
}

// The addresses of a block's bfloat16 rows, as the bf16 dot product's tiles take them.
struct Bf16RowTable {
  std::array<const uint16_t*, std::max(kQueryBlock, kKeyBlock)> rows{};

  // Rows [t0, t0 + n) of a stored operand of head (b, h).
  const uint16_t* const* operator()(const fused::StoredRows& x, int64_t b, int64_t h, int64_t t0, size_t n) {
    for (size_t t = 0; t < n; ++t) {
      rows[t] = reinterpret_cast<const uint16_t*>(x.row(b, h, t0 + static_cast<int64_t>(t)));
    }
    return rows.data();
  }
};

// Scores of n bfloat16 rows against t (bf16::pack_queries' layout) by AMX's tiles where the CPU has
// them, else by vdpbf16ps: every score of the forward and of the backward's two layouts comes here,
// so that all of them sum their products in one order.
inline void Bf16ScoreTile(const uint16_t* const* rows, size_t n, size_t dk, const uint32_t* t, size_t ld, float* out) {
  if (amx::available()) {
    amx::scores(rows, n, dk, t, ld, out);
  } else {
    bf16::scores(rows, n, dk, t, ld, out);
  }
}

template <class T>
struct ForwardScratch {
  bool bf16_scores;     // UsesBf16Scores
  bool bf16_values;     // UsesBf16Values
  size_t few_row;       // Dv rounded up to whole vectors
  Buffer<T> qt;         // [Dk][Br]       Qᵀ of the query block (scores come out as Sᵀ, queries along vectors)
  Buffer<T> st;         // [Bc][Br]       Sᵀ of one key block, then exp(Sᵀ − m)
  Buffer<T> drop;       // [Bc][Br]       the dropout factors of Sᵀ's pairs
  Buffer<T> acc;        // [Dv][Br]       oᵀ, the unnormalised outputs, queries along vectors like Sᵀ
  Buffer<T> few;        // [8][Dv_pad]    o of AttendFewQueries, one row per query
  Buffer<T> few_block;  // [Dv_pad]       one key block's Σ p·v (AttendFewQueries, rows wider than the registers)
  Buffer<T> q_scaled;   // [8][Dk]        AttendFewQueries' queries times an int8 K's per-channel scales
  Buffer<T> max;        // [Br]           m, running max
  Buffer<T> sum;        // [Br]           l, running sum
  Buffer<T> corr;       // [Br]           exp(m_old − m_new) of the last key block
  // The scales each row of q_scaled holds (null: none yet).
  std::array<const float*, kFewQueries> q_scaled_by{};
  // Rows of stored operands converted to T (StageRows); one element each when not stored. q_stage
  // also holds decode's queries at a stride of whole vectors (VectorAlignedQueries).
  Buffer<T> q_stage;  // [Br][Dk], and at least [8][Dk rounded up to vectors]
  Buffer<T> k_stage;  // [Bc][Dk]
  Buffer<T> v_stage;  // [Bc][Dv]
  // With bf16 products: Qᵀ, Pᵀ and V in pairs of bfloat16 (32-bit words), and the rows they read.
  Buffer<uint32_t> qt_pairs;  // [⌈Dk/2⌉ rounded up to 16][Br]
  Buffer<uint32_t> p_pairs;   // [Bc/2 rounded up to 16][Br]
  // V in pairs for every key block of one kv head, none on AMX's tiles (which keep their own Vᵀ):
  // the blocks that start on a multiple of Bc are packed by the first query block that reads them
  // and kept for the others, slot j0 / Bc holding v_pairs_keys[slot] keys (0: none yet) of head
  // v_pairs_head; the last slot takes the blocks that start elsewhere.
  Buffer<uint32_t> v_pairs;  // [ValuePairSlots][Bc/2][Dv]
  std::vector<size_t> v_pairs_keys;
  std::pair<int64_t, int64_t> v_pairs_head{-1, -1};
  Bf16RowTable Bf16Rows;

  ForwardScratch(size_t dk, size_t dv, size_t dv_pad, const Inputs<T>& in)
      : bf16_scores(UsesBf16Scores(in)),
        bf16_values(UsesBf16Values(in)),
        few_row(dv_pad),
        qt(Allocate<T>(dk * kQueryBlock)),
        st(Allocate<T>(kKeyBlock * kQueryBlock)),
        drop(Allocate<T>(kKeyBlock * kQueryBlock)),
        acc(Allocate<T>(dv * kQueryBlock)),
        few(Allocate<T>(kFewQueries * dv_pad)),
        few_block(Allocate<T>(dv_pad)),
        q_scaled(Allocate<T>(in.k_stored.type == StorageType::int8 ? kFewQueries * dk : 0)),
        max(Allocate<T>(kQueryBlock)),
        sum(Allocate<T>(kQueryBlock)),
        corr(Allocate<T>(kQueryBlock)),
        q_stage(Allocate<T>(
            std::max(in.q_stored ? kQueryBlock * dk : 0, kFewQueries * RoundUp(dk, hn::Lanes(hn::ScalableTag<T>()))))),
        k_stage(Allocate<T>(in.k_stored ? kKeyBlock * dk : 0)),
        v_stage(Allocate<T>(in.v_stored ? kKeyBlock * dv : 0)),
        qt_pairs(Allocate<uint32_t>(bf16_scores ? amx::RoundUpToTile(DivCeil(dk, 2)) * kQueryBlock : 0)),
        p_pairs(Allocate<uint32_t>(bf16_values ? amx::RoundUpToTile(kKeyBlock / 2) * kQueryBlock : 0)),
        v_pairs(Allocate<uint32_t>(bf16_values && !amx::available() ? ValuePairSlots(in) * kKeyBlock / 2 * dv : 0)),
        v_pairs_keys(bf16_values && !amx::available() ? ValuePairSlots(in) : 0) {}

  // One slot where every block holds at most kFewQueries queries: decode's blocks take the few-query
  // layout and never reach the pairs (only dropout brings them there), so keeping a whole head's
  // pairs would only add an allocation the size of its V to every decode step.
  static size_t ValuePairSlots(const Inputs<T>& in) {
    return in.tq > static_cast<int64_t>(kFewQueries) ? DivCeil(ToSize(in.tk), kKeyBlock) + 1 : 1;
  }

  // o(i, c): the unnormalised output of query i of the block, column c.
  T output(size_t i, size_t c) const { return acc[c * kQueryBlock + i]; }
};

// Turns the raw Sᵀ tile [nk][nq_pad] into exp(s − m') in place and advances the running max and
// sum of every query (one vector of queries at a time, lane-wise across the nk key rows).
template <class D, class T = hn::TFromD<D>>
HWY_INLINE void OnlineSoftmaxStep(D d, const Inputs<T>& in, int64_t b, int64_t h, int64_t q0, size_t nq, int64_t j0,
                                  size_t nk, ForwardScratch<T>& s) {
  const size_t N = hn::Lanes(d);
  const size_t ld = RoundUp(nq, N);
  const hn::Vec<D> neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());
  const hn::Vec<D> scale = hn::Set(d, in.scale);
  // With no bias, mask, ALiBi or softcap and every pair of the tile visible, a score is just scale·(q·k). The
  // first pass then only needs the largest raw product: for scale > 0 rounding is monotonic, so
  // max_j round(scale·x_j) = round(scale·max_j x_j) exactly, and the second pass scales each
  // product as Scores would. Same scores, one multiply and one store fewer per element.
  const bool plain = !in.bias && !in.allowed && !in.alibi && in.softcap == 0 && in.scale > 0 &&
                     in.BandCovers(q0, static_cast<int64_t>(nq), j0, static_cast<int64_t>(nk));
  for (size_t i = 0; i < ld; i += N) {
    T* HWY_RESTRICT col = s.st.get() + i;
    hn::Vec<D> block_max = neg_inf;
    if (plain) {
      hn::Vec<D> max1 = neg_inf;  // two chains, for twice the throughput of a chain of Max
      size_t j = 0;
      for (; j + 2 <= nk; j += 2) {
        block_max = hn::Max(block_max, hn::Load(d, col + j * ld));
        max1 = hn::Max(max1, hn::Load(d, col + (j + 1) * ld));
      }
      if (j < nk) block_max = hn::Max(block_max, hn::Load(d, col + j * ld));
      block_max = hn::Mul(hn::Max(block_max, max1), scale);
    } else {
      LaneRun run{.i = q0 + static_cast<int64_t>(i), .j = j0, .di = 1, .dj = 0, .count = std::min(N, nq - i)};
      for (size_t j = 0; j < nk; ++j, ++run.j) {
        const hn::Vec<D> x = Scores(d, in, b, h, run, hn::Load(d, col + j * ld));
        hn::Store(x, d, col + j * ld);
        block_max = hn::Max(block_max, x);
      }
    }
    const hn::Vec<D> old_max = hn::Load(d, s.max.get() + i);
    const hn::Vec<D> new_max = hn::Max(old_max, block_max);
    // Rows that have seen no visible key yet keep m = −inf; shifting by 0 there gives exp(−inf) = 0.
    const hn::Vec<D> shift = hn::IfThenZeroElse(hn::Eq(new_max, neg_inf), new_max);
    const hn::Vec<D> corr = SoftmaxExp(d, hn::Sub(old_max, shift));
    // Summed in chunks like TileUpdate's depth: l's rounding error is out's and lse's.
    hn::Vec<D> block_sum = hn::Zero(d);
    for (size_t c0 = 0; c0 < nk; c0 += kDepthChunk) {
      hn::Vec<D> chunk_sum = hn::Zero(d);
      for (size_t j = c0; j < std::min(nk, c0 + kDepthChunk); ++j) {
        const hn::Vec<D> x = hn::Load(d, col + j * ld);
        const hn::Vec<D> p = SoftmaxExp(d, hn::Sub(plain ? hn::Mul(x, scale) : x, shift));
        hn::Store(p, d, col + j * ld);
        chunk_sum = hn::Add(chunk_sum, p);
      }
      block_sum = hn::Add(block_sum, chunk_sum);
    }
    hn::Store(hn::MulAdd(hn::Load(d, s.sum.get() + i), corr, block_sum), d, s.sum.get() + i);
    hn::Store(new_max, d, s.max.get() + i);
    hn::Store(corr, d, s.corr.get() + i);
  }
}

// q·k for one query and one key over the whole vectors of `cols`, the key's row (a pointer or a
// StoredRow) read once from start to end: four chains of products summed lane-wise, then added,
// left in the lanes (SumLanesOfEach sums them for a block of keys at once).
// Rows of kUnrolledRowVectors vectors (d = 128 on AVX2, where q does not fit the registers beside
// the chains and is loaded again for each key) take the loop unrolled whole, the same chains in the
// same order: a key of int8 took 16 cycles rather than 20–22 in L1 (Zen 3, a loop written apart from
// qkv). In decode (Zen 3, H = 32, d = 128, two builds alternated in one process) that is less: from
// the last-level cache (Tk = 1024) int8 ran 1.015× as fast and float32 1.027×, float16 the same;
// from memory (Tk = 32768) int8 1.013×.
constexpr size_t kUnrolledRowVectors = 16;

// Calls four_vectors(c) at c = 0, 4N, 8N, … for the whole groups of four vectors in `cols`, unrolled
// whole when the row is kUnrolledRowVectors vectors long, and returns the first column after them.
template <class F>
HWY_INLINE size_t ForGroupsOfFourVectors(size_t N, size_t cols, const F& four_vectors) {
  size_t c = 0;
  if (cols == kUnrolledRowVectors * N) {
    HWY_UNROLL(4)
    for (; c < kUnrolledRowVectors * N; c += 4 * N) four_vectors(c);
  }
  for (; c + 4 * N <= cols; c += 4 * N) four_vectors(c);
  return c;
}

template <class D, class Row, class T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> RowDotLanes(D d, const T* HWY_RESTRICT q, const Row& k, size_t cols) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> a[4] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
  const auto four_vectors = [&](size_t c) HWY_ATTR {
    HWY_UNROLL(4)
    for (size_t g = 0; g < 4; ++g) a[g] = hn::MulAdd(hn::LoadU(d, q + c + g * N), LoadRow(d, k, c + g * N), a[g]);
  };
  size_t c = ForGroupsOfFourVectors(N, cols, four_vectors);
  for (; c + N <= cols; c += N) a[0] = hn::MulAdd(hn::LoadU(d, q + c), LoadRow(d, k, c), a[0]);
  return hn::Add(hn::Add(a[0], a[1]), hn::Add(a[2], a[3]));
}

// RowDotLanes of two queries against one row, each of the row's vectors loaded (and converted)
// once for both: the same chains in the same order, so the same sums. Two rows' four chains and a
// vector of the row fit 16 registers, where four rows' would not.
template <class D, class Row, class T = hn::TFromD<D>>
HWY_INLINE void RowPairDotLanes(D d, const T* HWY_RESTRICT q0, const T* HWY_RESTRICT q1, const Row& k, size_t cols,
                                hn::Vec<D>& lanes0, hn::Vec<D>& lanes1) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> a[4] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
  hn::Vec<D> b[4] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
  const auto four_vectors = [&](size_t c) HWY_ATTR {
    HWY_UNROLL(4)
    for (size_t g = 0; g < 4; ++g) {
      const hn::Vec<D> kg = LoadRow(d, k, c + g * N);
      a[g] = hn::MulAdd(hn::LoadU(d, q0 + c + g * N), kg, a[g]);
      b[g] = hn::MulAdd(hn::LoadU(d, q1 + c + g * N), kg, b[g]);
    }
  };
  size_t c = ForGroupsOfFourVectors(N, cols, four_vectors);
  for (; c + N <= cols; c += N) {
    const hn::Vec<D> kc = LoadRow(d, k, c);
    a[0] = hn::MulAdd(hn::LoadU(d, q0 + c), kc, a[0]);
    b[0] = hn::MulAdd(hn::LoadU(d, q1 + c), kc, b[0]);
  }
  lanes0 = hn::Add(hn::Add(a[0], a[1]), hn::Add(a[2], a[3]));
  lanes1 = hn::Add(hn::Add(b[0], b[1]), hn::Add(b[2], b[3]));
}

// RowDotLanes of the nk keys of a block, for a query of exactly kVectors vectors held in registers
// rather than loaded again for each key: the same chains in the same order, so the same sums.
// query(j, changed) is key j's query, `changed` true when it is not key j − 1's; key(j) its row.
// With q loaded once per block, a key costs the loads (and conversions) of its own row alone:
// decode ran 1.11–1.28× as fast from float16 K and V and 1.32–1.36× from bfloat16 (with
// SumLanesOfEach; Zen 5, two builds alternated in one process, medians of per-round ratios).
// float32, bound by memory, and int8 moved by no more than the machine's drift (0.90–1.15×,
// 1.00–1.03×), nor did grouped-query float32 (1.01×); grouped-query float16 gained 1.22×.
template <size_t kVectors, class D, class Query, class Key>
HWY_INLINE void HeldRowDotLanes(D d, size_t nk, const Query& query, const Key& key, hn::Vec<D>* HWY_RESTRICT lanes) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> held[kVectors];
  // Key 0's query always changes them; zeros first, since GCC cannot tell.
  HWY_UNROLL(8)
  for (size_t g = 0; g < kVectors; ++g) held[g] = hn::Zero(d);
  for (size_t j = 0; j < nk; ++j) {
    bool changed = false;
    const auto* HWY_RESTRICT q = query(j, changed);
    if (changed) {
      HWY_UNROLL(8)
      for (size_t g = 0; g < kVectors; ++g) held[g] = hn::LoadU(d, q + g * N);
    }
    const auto k = key(j);
    hn::Vec<D> a[4] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
    HWY_UNROLL(8)
    for (size_t g = 0; g < kVectors; ++g) a[g % 4] = hn::MulAdd(held[g], LoadRow(d, k, g * N), a[g % 4]);
    lanes[j] = hn::Add(hn::Add(a[0], a[1]), hn::Add(a[2], a[3]));
  }
}

// q·k over the columns past the last whole vector, one at a time.
template <class D, class Row, class T = hn::TFromD<D>>
HWY_INLINE T RowDotTail(D d, const T* HWY_RESTRICT q, const Row& k, size_t cols) {
  T dot = 0;
  for (size_t c = cols / hn::Lanes(d) * hn::Lanes(d); c < cols; ++c) dot += q[c] * RowAt(k, c);
  return dot;
}

// A vector whose lane j is the sum of the lanes of v[j], for the N vectors v[0..N): each level adds
// the even lanes of a pair of vectors to their odd lanes, ConcatEven and ConcatOdd placing the
// first vector's in the lower half, so that after log2 N levels the sums are in key order. N − 1
// pairs in all, where reducing each vector alone took log2 N shuffles and adds per key, a
// broadcast, and a store per sum that the block's scores were loaded back from, on the chain from
// the block's loads to its softmax. Each level is unrolled into an array of its own size, which
// stays in registers: written back into v, every level was stored and loaded again, and four rows
// sharing a key in L2 ran 1.04–1.05× slower (Zen 5, float32, the same bits).
#if HWY_TARGET != HWY_SCALAR
template <size_t kN, class D>
HWY_INLINE hn::Vec<D> SumLanesOfPairs(D d, const hn::Vec<D>* HWY_RESTRICT v) {
  hn::Vec<D> half[kN / 2];
  HWY_UNROLL(16)
  for (size_t j = 0; j < kN / 2; ++j) {
    half[j] = hn::Add(hn::ConcatEven(d, v[2 * j + 1], v[2 * j]), hn::ConcatOdd(d, v[2 * j + 1], v[2 * j]));
  }
  if constexpr (kN / 2 == 1) {
    return half[0];
  } else {
    return SumLanesOfPairs<kN / 2>(d, half);
  }
}
#endif

#if HWY_TARGET == HWY_AVX2
// SumLanesOfPairs for AVX2's 8 float lanes, the same sums ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) of
// each vector, with the first two levels within each 128-bit block (shuffles, adds and blends) and
// the halves of the blocks joined once at the end: two lane-crossing permutes for 8 keys rather
// than fourteen.
template <class D>
HWY_INLINE hn::Vec<D> SumLanesOfEight(D d, const hn::Vec<D>* HWY_RESTRICT v) {
  const hn::Repartition<uint64_t, D> d64;
  const auto pair_sums = [&](hn::Vec<D> a, hn::Vec<D> b) {  // a(01) b(01) a(23) b(23) | (45) (67)
    return hn::OddEven(hn::Add(b, hn::Shuffle2301(b)), hn::Add(a, hn::Shuffle2301(a)));
  };
  const auto quad_sums = [&](hn::Vec<D> ab, hn::Vec<D> cd) {  // a b c d (0123) | a b c d (4567)
    const hn::Vec<D> low = hn::Add(ab, hn::Shuffle1032(ab)), high = hn::Add(cd, hn::Shuffle1032(cd));
    return hn::BitCast(d, hn::OddEven(hn::BitCast(d64, high), hn::BitCast(d64, low)));
  };
  const hn::Vec<D> first = quad_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
  const hn::Vec<D> second = quad_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
  return hn::Add(hn::ConcatLowerLower(d, second, first), hn::ConcatUpperUpper(d, second, first));
}
#endif

template <class D>
HWY_INLINE hn::Vec<D> SumLanesOfEach(D d, const hn::Vec<D>* HWY_RESTRICT v) {
#if HWY_TARGET == HWY_AVX2
  if constexpr (hn::MaxLanes(D()) == 8) return SumLanesOfEight(d, v);
#endif
#if HWY_TARGET != HWY_SCALAR
  return SumLanesOfPairs<hn::MaxLanes(D())>(d, v);
#else
  (void)d;
  return v[0];
#endif
}

// o_row[c, c + C·N) ← corr·o_row + Σ_j p[j]·v_j[c, c + C·N) over the block's nk keys (v.row(j) a
// pointer or a StoredRow): the block's sum starts from zero in registers (blocked summation, as
// TileUpdate's) and the rescaling of the older sum rides on the same multiply-add.
template <size_t C, class D, class Rows, class T = hn::TFromD<D>>
HWY_INLINE void AccumulateWeightedColumns(D d, const Rows& v, size_t nk, const T* HWY_RESTRICT p, T corr, size_t c,
                                          T* HWY_RESTRICT o_row) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> sum[C];
  HWY_UNROLL(8)
  for (size_t g = 0; g < C; ++g) sum[g] = hn::Zero(d);
  for (size_t j = 0; j < nk; ++j) {
    const auto vj = v.row(j);
    const hn::Vec<D> pj = hn::Set(d, p[j]);
    HWY_UNROLL(8)
    for (size_t g = 0; g < C; ++g) sum[g] = hn::MulAdd(pj, LoadRow(d, vj, c + g * N), sum[g]);
  }
  HWY_UNROLL(8)
  for (size_t g = 0; g < C; ++g) {
    T* HWY_RESTRICT out = o_row + c + g * N;
    hn::Store(hn::MulAdd(hn::Load(d, out), hn::Set(d, corr), sum[g]), d, out);
  }
}

// Adds p[j + r]·v_(j + r) for kKeys keys from j into `block` (zeros in place of its values at j = 0),
// one multiply-add per key in key order, so that each column's sum is the same however many keys
// a pass takes.
template <size_t kKeys, class D, class Rows, class T = hn::TFromD<D>>
HWY_INLINE void AddRowsToBlock(D d, const Rows& v, size_t j, const T* HWY_RESTRICT p, size_t vectors,
                               T* HWY_RESTRICT block) {
  const size_t N = hn::Lanes(d);
  const auto rows = [&]<size_t... r>(std::index_sequence<r...>) {
    return std::array<decltype(v.row(0)), kKeys>{v.row(j + r)...};
  }
  (std::make_index_sequence<kKeys>());
  hn::Vec<D> weights[kKeys];
  HWY_UNROLL(4)
  for (size_t r = 0; r < kKeys; ++r) weights[r] = hn::Set(d, p[j + r]);
  for (size_t c = 0; c < vectors * N; c += N) {
    hn::Vec<D> sum = j == 0 ? hn::Zero(d) : hn::Load(d, block + c);
    HWY_UNROLL(4)
    for (size_t r = 0; r < kKeys; ++r) sum = hn::MulAdd(weights[r], LoadRow(d, rows[r], c), sum);
    hn::Store(sum, d, block + c);
  }
}

// AccumulateWeightedColumns over `vectors` column vectors, more than the registers hold, with the
// block's sum kept in `block` (L1) instead: the same operations in the same order, so the same
// result, but each V row is read once from start to end (see AttendFewQueries).
template <class D, class Rows, class T = hn::TFromD<D>>
HWY_INLINE void AccumulateWeightedRowsThroughMemory(D d, const Rows& v, size_t nk, const T* HWY_RESTRICT p, T corr,
                                                    size_t vectors, T* HWY_RESTRICT block, T* HWY_RESTRICT o_row) {
  const size_t N = hn::Lanes(d);
  size_t j = 0;
  // Converted rows are bound by the conversion, and several keys a pass share the loads and stores
  // of `block`: four rather than two ran decode 1.03× as fast from int8 (Tk = 32768 and 1024) and
  // 1.025× from float16 (Zen 3, d = 128, the same bits). Rows of T read in place are bound by
  // memory, where two streams at once measured 0.9× one (Zen 3, d = 128).
  if constexpr (kConvertsRow<decltype(v.row(0))>) {
    for (; j + 4 <= nk; j += 4) AddRowsToBlock<4>(d, v, j, p, vectors, block);
  }
  for (; j < nk; ++j) AddRowsToBlock<1>(d, v, j, p, vectors, block);
  for (size_t c = 0; c < vectors * N; c += N) {
    hn::Store(hn::MulAdd(hn::Load(d, o_row + c), hn::Set(d, corr), hn::Load(d, block + c)), d, o_row + c);
  }
}

// o_row ← corr·o_row + Σ_j p[j]·v_j over all `cols` columns: kGroup column vectors in registers
// (or, with more whole vectors than that, all of them through `block`), then single vectors, then
// the last partial vector one column at a time.
template <class D, class Rows, class T = hn::TFromD<D>>
HWY_INLINE void AccumulateWeightedRows(D d, const Rows& v, size_t nk, const T* HWY_RESTRICT p, T corr, size_t cols,
                                       T* HWY_RESTRICT block, T* HWY_RESTRICT o_row) {
  // Eight accumulators: enough independent chains for two 4-cycle FMA pipes on every x86 target
  // (measured ≈ 1.05–1.1× decode on Zen 3 against 2·kTileVectors = 4 there).
  constexpr size_t kGroup = 8;
  const size_t N = hn::Lanes(d);
  size_t c = 0;
  if (cols / N > kGroup) {
    AccumulateWeightedRowsThroughMemory(d, v, nk, p, corr, cols / N, block, o_row);
    c = cols / N * N;
  }
  for (; c + kGroup * N <= cols; c += kGroup * N) {
    AccumulateWeightedColumns<kGroup>(d, v, nk, p, corr, c, o_row);
  }
  for (; c + N <= cols; c += N) AccumulateWeightedColumns<1>(d, v, nk, p, corr, c, o_row);
  for (; c < cols; ++c) {
    T sum = 0;
    for (size_t j = 0; j < nk; ++j) sum += p[j] * RowAt(v.row(j), c);
    o_row[c] = o_row[c] * corr + sum;
  }
}

// Query i of AttendFewQueries times an int8 key's per-channel scales, kept in s.q_scaled while the
// keys share them (a contiguous K's, or a page's): recomputed, and `changed` set, when they change.
template <class T>
HWY_INLINE const T* ScaledQuery(const T* HWY_RESTRICT q, size_t i, const StoredRow<StorageType::int8>& k, size_t dk,
                                ForwardScratch<T>& s, bool& changed) {
  T* HWY_RESTRICT scaled = s.q_scaled.get() + i * dk;
  if (s.q_scaled_by[i] != k.scale) {
    for (size_t c = 0; c < dk; ++c) scaled[c] = q[c] * k.scale[static_cast<int64_t>(c) * k.scale_step];
    s.q_scaled_by[i] = k.scale;
    changed = true;
  }
  return scaled;
}

// Whether int8 keys [first, first + nk) of `keys`, k the first, lie in one run and share its
// per-channel scales (a contiguous K's, or a page's): a query scaled once by k's scales then serves
// them all, and their integers lie at a fixed stride from k's.
template <class Rows>
HWY_INLINE bool SharesChannelScalesInOneRun(const Rows& keys, size_t first, size_t nk,
                                            const StoredRow<StorageType::int8>& k) {
  return first + nk <= keys.run() && keys.scale_row_stride() == 0 && k.scale_step != 0;
}

// Lane j = q·k_(first + j) for nk keys of a block's rows (0 past nk), q being query i of
// AttendFewQueries. An int8 key's scales multiply the dot product (one scale per key) or the query
// (one per channel, kept in s.q_scaled while the keys share them), not each element, which makes
// int8 decode bound by memory rather than by a multiply per element (measured 1.8× on Zen 3): the
// scores then differ from the float32 kernel's on to_float32's values by the rounding of those
// products, within the same tolerance. Keys that lie in one run and share their scales take the
// query scaled once and their rows at a fixed stride, not each key's row and scales looked up and
// compared. Each key asks for its row of `ahead` (none when empty) just before it is read, rather
// than a vector of keys asking at once. Together, int8 decode (Zen 3, H = 32, Tk = 32768, two builds
// alternated in one process) ran 1.14× as fast with one thread and 1.09–1.10× with two. Where the
// query is too wide to be held in registers (HeldRowDotLanes), such keys take a loop of their asks,
// loads and sums alone, without the tests the general loop makes for every key: with K and V in
// L3, int8 decode ran 1.07× as fast (Zen 3, d = 128, the same sums).
template <class D, class Rows, class T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> KeyDots(D d, const Rows& keys, size_t first, size_t nk, const T* HWY_RESTRICT q, size_t i,
                              size_t dk, ForwardScratch<T>& s, const RunAhead ahead) {
  constexpr bool kInt8 = kInt8Rows<Rows>;
  constexpr size_t kN = hn::MaxLanes(D());
  hn::Vec<D> lanes[kN];
  HWY_ALIGN T tails[kN] = {};
  HWY_ALIGN T key_scales[kN] = {};
  bool per_key = false;
  const T* shared_query = nullptr;  // int8 keys in one run that share per-channel scales: q scaled
  const int8_t* run_first = nullptr;
  size_t run_stride = 0;
  if constexpr (kInt8) {
    const StoredRow<StorageType::int8> k = keys.row(first);
    if (SharesChannelScalesInOneRun(keys, first, nk, k)) {
      bool changed = false;
      shared_query = ScaledQuery(q, i, k, dk, s, changed);
      run_first = reinterpret_cast<const int8_t*>(k.data);
      run_stride = keys.row_bytes();
    }
  }
  const auto query = [&](size_t j, bool& changed) -> const T* {
    changed = j == 0;
    if constexpr (kInt8) {
      if (shared_query != nullptr) return shared_query;
      const StoredRow<StorageType::int8> k = keys.row(first + j);
      if (k.scale_step == 0) {
        per_key = true;
        key_scales[j] = k.scale[0];
        return q;
      }
      return ScaledQuery(q, i, k, dk, s, changed);
    } else {
      return q;
    }
  };
  // An int8 key's integers alone: its scales are the query's or the product's (above).
  const auto key = [&](size_t j) {
    ahead.Ask(first + j);
    if constexpr (kInt8) {
      if (shared_query != nullptr) return Int8Integers{run_first + j * run_stride};
      return Int8Integers{reinterpret_cast<const int8_t*>(keys.row(first + j).data)};
    } else {
      return keys.row(first + j);
    }
  };
  const size_t vectors = dk / hn::Lanes(d);
  const bool tail = dk % hn::Lanes(d) != 0;
  const bool held = !tail && (vectors == 8 || vectors == 4);
  if (shared_query != nullptr && !tail && !held) {
    if constexpr (kInt8) {
      const int8_t* HWY_RESTRICT k = run_first;
      for (size_t j = 0; j < nk; ++j, k += run_stride) {
        ahead.Ask(first + j);
        lanes[j] = RowDotLanes(d, shared_query, Int8Integers{k}, dk);
      }
    }
  } else if (held && vectors == 8) {
    HeldRowDotLanes<8>(d, nk, query, key, lanes);
  } else if (held) {
    HeldRowDotLanes<4>(d, nk, query, key, lanes);
  } else {
    for (size_t j = 0; j < nk; ++j) {
      bool changed = false;
      const T* HWY_RESTRICT qk = query(j, changed);
      const auto k = key(j);
      lanes[j] = RowDotLanes(d, qk, k, dk);
      if (tail) tails[j] = RowDotTail(d, qk, k, dk);
    }
  }
  for (size_t j = nk; j < kN; ++j) lanes[j] = hn::Zero(d);
  hn::Vec<D> dots = SumLanesOfEach(d, lanes);
  if (tail) dots = hn::Add(dots, hn::Load(d, tails));
  return per_key ? hn::Mul(dots, hn::Load(d, key_scales)) : dots;
}

// Calls f with the nk values of a block as the weighted sums read them. An int8 value's scale, one
// per token, multiplies its weight in each of the `rows` rows of weights p[r] (in place) rather
// than each element, as KeyDots does for keys, and f gets the integers alone; scales per channel
// multiply each element.
template <class Rows, class T, class F>
HWY_INLINE void WithWeightedValues(const Rows& values, size_t nk, T* const* p, size_t rows, F&& f) {
  if constexpr (kInt8Rows<Rows>) {
    if (Unasked(values).row(0).scale_step == 0) {
      const auto weigh = [&](const auto& scale_of, const auto& integers) {
        for (size_t j = 0; j < nk; ++j) {
          const T scale = scale_of(j);
          for (size_t r = 0; r < rows; ++r) p[r][j] *= scale;
        }
        return f(integers);
      };
      if (nk <= Unasked(values).run()) {  // the rows and their scales a fixed stride apart
        const float* HWY_RESTRICT scale = Unasked(values).first_scale();
        const int64_t step = Unasked(values).scale_row_stride();
        return weigh([&](size_t j) { return scale[static_cast<int64_t>(j) * step]; }, RunIntegersOf(values));
      }
      return weigh([&](size_t j) { return Unasked(values).row(j).scale[0]; }, IntegersOf(values));
    }
  }
  f(values);
}

// o_row ← corr·o_row + Σ_j p[j]·v_j for the nk values of a block (AccumulateWeightedRows). Only
// int8 values, whose token scales weigh p first, go through WithWeightedValues: the lambda it
// calls is a call the compiler need not inline, and GCC 12 stopped inlining it for float32 values
// once AttendFewQueries had grown, which made single-query float32 decode 0.82× as fast (Zen 5,
// AVX3 target, H = 32, Tk = 32768, two builds alternated in one process; the same bits).
template <class D, class Rows, class T = hn::TFromD<D>>
HWY_INLINE void ValueSums(D d, const Rows& values, size_t nk, T* HWY_RESTRICT p, T corr, size_t dv,
                          ForwardScratch<T>& s, T* HWY_RESTRICT o_row) {
  if constexpr (kInt8Rows<Rows>) {
    T* const weights[1] = {p};
    WithWeightedValues(values, nk, weights, 1, [&](const auto& rows) {
      AccumulateWeightedRows(d, rows, nk, p, corr, dv, s.few_block.get(), o_row);
    });
  } else {
    AccumulateWeightedRows(d, values, nk, p, corr, dv, s.few_block.get(), o_row);
  }
}

// One step of the online softmax of query i (scratch s) over a block's `vectors` vectors of
// scores: advances its m and l, leaves the weights exp(s − m) in p and returns exp(m_old − m_new),
// the factor of the older sums.
template <class D, class T = hn::TFromD<D>>
HWY_INLINE T FewQueriesSoftmaxStep(D d, const hn::Vec<D>* HWY_RESTRICT scores, size_t vectors, size_t i,
                                   ForwardScratch<T>& s, T* HWY_RESTRICT p) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> block_max = scores[0];
  for (size_t v = 1; v < vectors; ++v) block_max = hn::Max(block_max, scores[v]);
  const T old_max = s.max[i];
  const T new_max = std::max(old_max, hn::GetLane(hn::MaxOfLanes(d, block_max)));
  // As in OnlineSoftmaxStep: a row that has seen no visible key shifts by 0, not by −inf.
  const T shift = new_max == -std::numeric_limits<T>::infinity() ? T{0} : new_max;
  const T corr = hn::GetLane(SoftmaxExp(d, hn::Set(d, old_max - shift)));
  hn::Vec<D> block_sum = SoftmaxExp(d, hn::Sub(scores[0], hn::Set(d, shift)));
  hn::StoreU(block_sum, d, p);
  for (size_t v = 1; v < vectors; ++v) {
    const hn::Vec<D> weights = SoftmaxExp(d, hn::Sub(scores[v], hn::Set(d, shift)));
    hn::StoreU(weights, d, p + v * N);
    block_sum = hn::Add(block_sum, weights);
  }
  s.sum[i] = s.sum[i] * corr + hn::GetLane(hn::SumOfLanes(d, block_sum));
  s.max[i] = new_max;
  return corr;
}

// Key vectors per step of AttendFewQueries' online softmax. Each step's max, exponentials, sum and
// rescaling form a chain of reductions from the block's dot products to its V sums, the same
// whatever the block's width, so a block of kFewQueriesWideBlock vectors shares it among four times
// the keys: a (head, key) pair in L2 took 0.82–0.85× as long (Zen 5; float32, float16, int8).
// From memory, a key that serves a single query row is bound by its bytes instead, and there the
// wide blocks lost: single-query multi-head decode ran 0.83–0.89× as fast from float16 K and V and
// 0.87–0.88× from bfloat16 (float32 1.01–1.13×, int8 1.07–1.11×; two queries, float16 0.97×).
// With four rows or more per key it gained everywhere: grouped-query decode (4 heads per K and V
// head) 1.11–1.23× from float32, 1.07–1.08× from float16, 1.15–1.22× from int8; four queries on
// multi-head 1.12–1.22×, eight 1.10–1.25× (Zen 5, H = 32, Tk = 32768, d = 128, two builds
// alternated in one process). Otherwise the width follows the storage types only where results
// are not bound to the float32 kernel's bits: float16 and bfloat16 operands must take the float32
// kernel's steps on their converted values to give its bits, but int8 ones, whose scales multiply
// the query and the weights rather than each element, are held to the float64 reference's rule
// instead, so int8 K or V always take the wide steps (single-query multi-head: 1.08–1.19×).
inline bool StoredAsInt8(const fused::StoredRows& x) { return x && x.type == StorageType::int8; }

template <class T>
size_t FewQueriesBlockVectors(const Inputs<T>& in, size_t nq) {
  const bool wide =
      ToSize(in.group) * nq >= kFewQueriesWideRows || StoredAsInt8(in.k_stored) || StoredAsInt8(in.v_stored);
  return wide ? kFewQueriesWideBlock : 1;
}

// Keys from j to the end of its block, for blocks of `width` keys that start `shift` keys past the
// multiples of width (j ≥ 0, shift < width): 1 to width.
inline int64_t KeysToBlockEnd(int64_t j, int64_t width, int64_t shift) { return width - (j + width - shift) % width; }

// The forward for nq ≤ kFewQueries queries (decode): with a single query, lanes along queries
// would leave all but one lane idle, so here the lanes run along keys instead. A block is one
// vector of N keys, or kFewQueriesWideBlock of them (FewQueriesBlockVectors): each score is a dot
// product along d (KeyDots), each vector of the block's scores goes through Scores and the
// exponential, and the block max and sum are reductions across lanes. Every key is used by at
// most nq queries, so memory, not arithmetic, sets the pace: the kernel does little more per key
// than load k and v once. Advances m, l and o like the other layout, o summed in rows (s.few) that
// EndQueryBlock transposes.
// K and V rows read in place stream from memory, and each is read once from start to end: K one
// key at a time, V whole rows (through s.few_block when they are wider than the registers), with
// no software prefetch ahead. The hardware prefetchers keep far more lines in flight on one
// sequential stream per operand than software prefetches can, and they lose the stream on the
// short strided runs of reading four rows at once or a row in register-sized pieces (measured on
// Zen 3, d = 128: 1.16× one thread and 1.11× two over that, with every line prefetched 64 keys
// ahead). Where a vector is a whole line, rows of T that start off a vector boundary are put
// together from aligned loads (RealignedRow), as a load split across two cache lines costs the
// stream a fifth of its pace, and rows that start on a line ask for the line after each vector
// (LookaheadRow). Stored rows (float16, bfloat16, int8, paged) are read the same way, converted in
// registers, and asked for ahead, kFewQueriesPrefetchBytes of K, since converting them holds their
// loads back (without it, int8 measured 0.9×).
// With vectors narrower than a line the first query's V reads ask instead for the K and V rows of
// the next block, key by key (AskingRows), in every storage type, so that each stream's prefetcher
// has a block's rows requested ahead of it (a block of 8 keys of 128 float32 channels is 4 KiB of
// each operand), with the requests spread over the block rather than issued at its start. Zen 3,
// AVX2, H = 32, d = 128, 2 threads, the variants alternated call by call in one process:
// - against each K row read asking for its key's V row as well: float16 1.02× at Tk = 32768 and
//   1.07× at Tk = 1024 (K and V in the last-level cache), float32 1.00×, int8 0.97× and 1.09×;
// - against int8's former requests 32 KiB ahead of its stored rows: 1.06× and 0.95×;
// - against no requests at all, int8: 1.09× and 0.95×. Where K and V are in the caches already
//   the requests cost a little, but a decode step of a model reads K and V that the other layers'
//   weights have pushed out of them.
// Requests to the second-level cache alone (prefetcht2) measured 0.98–1.01× for float16 and float32
// and 1.01–1.06× for int8 in three runs, too little to set int8 apart.
// Wide blocks (kBlockVectors > 1: int8, or four query rows and more) ask for the next block's K
// rows from the K reads and its V rows from the V reads, so that requests go out during both
// passes: an int8 K pass of 32 keys takes longer than the memory needs for the rows asked for in
// the V pass before it, and with every request in the V pass the memory idled through it (at
// Tk = 32768 a step without the V sums took as long, one without K's dot products 0.57 as long).
// Against every request in the V pass (Zen 3, the same alternation): int8 1.04–1.08× at
// Tk = 32768, 0.96× at Tk = 1024; four queries 0.99–1.02×. Narrow blocks of 8 keys keep every
// request in the V pass: split, a float32 block's K requests came too late, 0.83× (float16 0.91×).
template <size_t kBlockVectors, class D, class T = hn::TFromD<D>>
void AttendFewQueries(D d, const Inputs<T>& in, int64_t b, int64_t h, int64_t q0, size_t nq, int64_t key_begin,
                      int64_t key_end, int64_t prefetch_end, ForwardScratch<T>& s) {
  const size_t N = hn::Lanes(d);
  const int64_t hk = in.kv_head(h);
  const size_t dk = ToSize(in.dk);
  const hn::Vec<D> neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());
  const size_t dv = ToSize(in.dv);
  T* HWY_RESTRICT p = s.st.get();
  const auto prefetch_keys =
      static_cast<int64_t>(RoundUp(kFewQueriesPrefetchBytes / ToSize(in.key_row_bytes()) + 1, N));
  const RowBlock<T> queries = StageRows(d, in.q, in.q_stored, b, h, q0, nq, dk, s.q_stage.get());
  constexpr bool kAsksAhead = hn::MaxLanes(D()) * sizeof(T) < kLineBytes;
  s.q_scaled_by.fill(nullptr);
  // Blocks start at the keys N/2 past a multiple of their width, not at the multiples: K and V of
  // a head usually start on a page (or 16 bytes in, as malloc and numpy place large arrays), and a
  // vector of 16 keys of 128 float16 channels is one 4 KiB page. A stream whose blocks each begin
  // a new page read 33 GB/s on Zen 5 (bfloat16 and float16 alike), the same rows with the blocks
  // half a page later 67 GB/s, the triad's pace; float32 gained 1.08×, int8 nothing. The blocks
  // depend on the key positions and the problem alone, not on the ranges the keys come in (whose
  // ends lie N/2 past multiples of kKeyBlock, and so of every block width) nor on where the arrays
  // lie.
  const auto block_keys = static_cast<int64_t>(kBlockVectors * N);
  // The range's K and V rows that lie at a fixed stride from its first (all of them unless paged):
  // a block's rows to ask for are found in these, not looked up again for every block (which took
  // a quarter of int8 decode's time outside its dot products and sums).
  RowRun k_rows, v_rows;
  if (kAsksAhead && key_begin < key_end) {
    k_rows = RowRunOf(in.k, in.k_stored, b, hk, key_begin, ToSize(key_end - key_begin));
    v_rows = RowRunOf(in.v, in.v_stored, b, hk, key_begin, ToSize(key_end - key_begin));
  }
  const auto run_ahead = [&](const RowRun& rows, const auto& x, const fused::StoredRows& stored, int64_t t0, size_t nt,
                             size_t bytes) {
    const auto offset = ToSize(t0 - key_begin);
    if (offset + nt <= rows.rows) return RunAhead{{rows.first + offset * rows.stride, rows.stride, nt}, bytes};
    return RunAhead{RowRunOf(x, stored, b, hk, t0, nt), bytes};
  };
  int64_t n = KeysToBlockEnd(key_begin, block_keys, static_cast<int64_t>(N / 2));
  for (int64_t j0 = key_begin; j0 < key_end; j0 += n, n = block_keys) {
    const size_t nk = ToSize(std::min<int64_t>(n, key_end - j0));
    const size_t vectors = kBlockVectors == 1 ? 1 : DivCeil(nk, N);
    const int64_t ahead = j0 + prefetch_keys;
    if (!kAsksAhead && ahead < prefetch_end) {
      const int64_t n_ahead = std::min<int64_t>(block_keys, prefetch_end - ahead);
      if (in.k_stored) PrefetchRows(in.k, in.k_stored, b, hk, ahead, n_ahead, dk);
      if (in.v_stored) PrefetchRows(in.v, in.v_stored, b, hk, ahead, n_ahead, dv);
    }
    const int64_t next = j0 + static_cast<int64_t>(nk);
    // The next block's rows, asked for as the first query reads this block's: K's with K's and V's
    // with V's in wide blocks, both with V's in narrow ones.
    RowsAhead next_rows;
    if (kAsksAhead && next < key_end) {
      const size_t n_next = ToSize(std::min<int64_t>(block_keys, key_end - next));
      next_rows = {.k = run_ahead(k_rows, in.k, in.k_stored, next, n_next, ToSize(in.key_row_bytes())),
                   .v = run_ahead(v_rows, in.v, in.v_stored, next, n_next, ToSize(in.value_row_bytes()))};
    }
    for (size_t i = 0; i < nq; ++i) {
      const int64_t qi = q0 + static_cast<int64_t>(i);
      const T* HWY_RESTRICT q = queries.row(i);
      hn::Vec<D> scores[kBlockVectors];
      const auto key_dots = [&](const auto& keys) {
        for (size_t v = 0; v < vectors; ++v) {
          const size_t count = std::min(N, nk - v * N);
          const bool asks = kAsksAhead && kBlockVectors > 1 && i == 0;
          const hn::Vec<D> dots = KeyDots(d, keys, v * N, count, q, i, dk, s, asks ? next_rows.k : RunAhead{});
          const LaneRun run{.i = qi, .j = j0 + static_cast<int64_t>(v * N), .di = 0, .dj = 1, .count = count};
          scores[v] = hn::IfThenElse(hn::FirstN(d, count), Scores(d, in, b, h, run, dots), neg_inf);
        }
      };
      WithStreamedRows(d, in.k, in.k_stored, b, hk, j0, nk, in.tk, key_dots);
      const T corr = FewQueriesSoftmaxStep(d, scores, vectors, i, s, p);
      T* HWY_RESTRICT o_row = s.few.get() + i * s.few_row;
      WithStreamedRows(d, in.v, in.v_stored, b, hk, j0, nk, in.tk, [&](const auto& values) {
        if constexpr (kAsksAhead) {
          using Values = std::decay_t<decltype(values)>;
          if (i == 0 && next < key_end) {
            if constexpr (kBlockVectors > 1) {
              return ValueSums(d, AskingRows<Values, RunAhead>{values, next_rows.v}, nk, p, corr, dv, s, o_row);
            } else {
              return ValueSums(d, AskingRows<Values, RowsAhead>{values, next_rows}, nk, p, corr, dv, s, o_row);
            }
          }
        }
        ValueSums(d, values, nk, p, corr, dv, s, o_row);
      });
    }
  }
}

// One query row of a decode step whose K and V rows other rows read too (the query heads of a
// grouped-query group, each with its queries): its query, head, position and scratch.
template <class T>
struct SharedRow {
  const T* HWY_RESTRICT q;
  int64_t h;
  size_t i;  // the query's index in its head's block, and in the head's scratch
  ForwardScratch<T>* s;
};

// Rows AttendSharedRows takes at once: each key's K vectors are loaded once for all of them, and
// each row keeps four chains of dot products in registers meanwhile: 4·rows + the key's vectors,
// 16 + 8 of AVX-512's 32 registers at d = 128. AVX2's 16 registers do not hold four rows' chains
// beside a key (d = 64), nor a key of d = 128, which rows then read again from L1 two at a time
// (RowPairDotLanes: a converted key converted once per pair, not per row, ran grouped-query decode
// 1.07× as fast from float16 and 1.10× from int8 at Tk = 32768; Zen 3, the same bits); yet four
// rows at once beat two at once and then two more reading the keys from L2: grouped-query decode
// (4 query heads per K and V head, H = 32, Tk = 32768, 2 threads) ran 1.25–1.56× as fast from
// float32 at d = 128, 1.21–1.32× at d = 64, 1.09–1.15× from float16, 1.00–1.11× from int8 (Zen 3).
constexpr size_t kSharedRowsAtOnce = HWY_TARGET == HWY_SCALAR ? 1 : (HWY_TARGET <= HWY_AVX2 ? 4 : 2);
// How far ahead of the key it reaches AttendSharedRows asks for K and V rows, in bytes of K, one
// key at a time. With several rows' arithmetic between its loads, a core kept too few of them in
// flight: taking the rows together read K and V at 0.63–0.73× the pace of taking them one after
// another (each from L2 after the first) when nothing, or a block's or a vector's rows at once,
// was asked for ahead. One key at a time, 2 KiB ahead measured 0.97–1.12× that pace, 4 KiB
// 1.06–1.11×, 8 KiB 1.02–1.12× (grouped-query decode, Zen 5, float32, float16, bfloat16, int8).
constexpr int64_t kSharedRowsAheadBytes = 4096;

// Lane sums of q_r·key over exactly kVectors vectors for kRows queries (RowDotLanes' chains), into
// lanes[r][j]: each key vector loaded once for every row.
template <size_t kRows, size_t kVectors, class D, class Key, class T = hn::TFromD<D>, size_t kN = hn::MaxLanes(D())>
HWY_INLINE void SharedRowDots(D d, const T* HWY_RESTRICT const* q, const Key& key, size_t j,
                              hn::Vec<D> (*HWY_RESTRICT lanes)[kN]) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> k[kVectors];
  HWY_UNROLL(8)
  for (size_t g = 0; g < kVectors; ++g) k[g] = LoadRow(d, key, g * N);
  hn::Vec<D> a[kRows][4];
  HWY_UNROLL(4)
  for (size_t r = 0; r < kRows; ++r) {
    HWY_UNROLL(4)
    for (size_t g = 0; g < 4; ++g) a[r][g] = hn::MulAdd(hn::LoadU(d, q[r] + g * N), k[g], hn::Zero(d));
    HWY_UNROLL(4)
    for (size_t g = 4; g < kVectors; ++g) a[r][g % 4] = hn::MulAdd(hn::LoadU(d, q[r] + g * N), k[g], a[r][g % 4]);
  }
  HWY_UNROLL(4)
  for (size_t r = 0; r < kRows; ++r) lanes[r][j] = hn::Add(hn::Add(a[r][0], a[r][1]), hn::Add(a[r][2], a[r][3]));
}

// SharedRowDots for two keys at once, lanes[r][j] and lanes[r][j + 1]: each query vector loaded
// once for both keys, with each (row, key) pair's chains as SharedRowDots has them, so the same
// sums. Both keys' vectors stay in registers, which only targets with 32 of them hold. It stays
// apart from SharedRowDots: one function for one or two keys, taking them as an array, made
// grouped-query decode 0.92–0.96× as fast (Zen 5; float32 and int8, the same bits).
template <size_t kRows, size_t kVectors, class D, class Key, class T = hn::TFromD<D>, size_t kN = hn::MaxLanes(D())>
HWY_INLINE void SharedRowDotsOfTwoKeys(D d, const T* HWY_RESTRICT const* q, const Key& key0, const Key& key1, size_t j,
                                       hn::Vec<D> (*HWY_RESTRICT lanes)[kN]) {
  const size_t N = hn::Lanes(d);
  hn::Vec<D> k0[kVectors], k1[kVectors];
  HWY_UNROLL(8)
  for (size_t g = 0; g < kVectors; ++g) {
    k0[g] = LoadRow(d, key0, g * N);
    k1[g] = LoadRow(d, key1, g * N);
  }
  HWY_UNROLL(4)
  for (size_t r = 0; r < kRows; ++r) {
    hn::Vec<D> a0[4], a1[4];
    HWY_UNROLL(4)
    for (size_t g = 0; g < 4; ++g) {
      const hn::Vec<D> qg = hn::LoadU(d, q[r] + g * N);
      a0[g] = hn::MulAdd(qg, k0[g], hn::Zero(d));
      a1[g] = hn::MulAdd(qg, k1[g], hn::Zero(d));
    }
    HWY_UNROLL(4)
    for (size_t g = 4; g < kVectors; ++g) {
      const hn::Vec<D> qg = hn::LoadU(d, q[r] + g * N);
      a0[g % 4] = hn::MulAdd(qg, k0[g], a0[g % 4]);
      a1[g % 4] = hn::MulAdd(qg, k1[g], a1[g % 4]);
    }
    lanes[r][j] = hn::Add(hn::Add(a0[0], a0[1]), hn::Add(a0[2], a0[3]));
    lanes[r][j + 1] = hn::Add(hn::Add(a1[0], a1[1]), hn::Add(a1[2], a1[3]));
  }
}

// Lane j of dots[r] = row r's q·k_(first + j) for nk keys (0 past nk), as KeyDots gives it to each
// row alone: the same chains in the same order, so the same sums.
template <size_t kRows, class D, class Rows, class T = hn::TFromD<D>>
HWY_INLINE void SharedKeyDots(D d, const Rows& keys, size_t first, size_t nk, const SharedRow<T>* rows, size_t dk,
                              const RowsAhead& ahead, hn::Vec<D>* HWY_RESTRICT dots) {
  constexpr bool kInt8 = kInt8Rows<Rows>;
  constexpr size_t kN = hn::MaxLanes(D());
  const size_t N = hn::Lanes(d);
  hn::Vec<D> lanes[kRows][kN];
  // Zeroed only when used: filled for every call, their kRows·kN floats cost a `rep stos` a vector
  // of keys, 4% of grouped-query int8 decode's time (Zen 3).
  HWY_ALIGN T tails[kRows][kN];
  HWY_ALIGN T key_scales[kN] = {};
  bool per_key = false;
  const bool tail = dk % N != 0;
  if (tail) std::fill(&tails[0][0], &tails[0][0] + kRows * kN, T{0});
  const T* HWY_RESTRICT q[kRows];
  for (size_t r = 0; r < kRows; ++r) q[r] = rows[r].q;
  // The channel scales the rows' queries were last scaled by: keys share them (a head's, a page's),
  // and looking up each row's scaled query again for every key made int8 decode of grouped-query
  // heads or several queries 1.12–1.16× slower (Zen 5; the same bits).
  const void* scaled_by = nullptr;
  // int8 keys that lie in one run and share per-channel scales take the queries scaled once and
  // their integers at a fixed stride, as KeyDots takes them, rather than each key's row and scales
  // looked up and compared: grouped-query int8 decode ran 1.06× as fast with K and V in L2 or L3
  // and from memory, and four queries of one head 1.08× (Zen 5, one thread and two; the same bits).
  Int8RunIntegers run;
  if constexpr (kInt8) {
    const StoredRow<StorageType::int8> k = keys.row(first);
    if (SharesChannelScalesInOneRun(keys, first, nk, k)) {
      bool changed = false;
      for (size_t r = 0; r < kRows; ++r) q[r] = ScaledQuery(rows[r].q, rows[r].i, k, dk, *rows[r].s, changed);
      run = {reinterpret_cast<const int8_t*>(k.data), keys.row_bytes()};
    }
  }
  // Key j's row as the dot products read it, the rows' queries made its own first.
  const auto key_row = [&](size_t j) {
    if constexpr (kInt8) {
      if (run.first != nullptr) return run.row(j);
      const StoredRow<StorageType::int8> k = keys.row(first + j);
      if (k.scale_step == 0) {
        per_key = true;
        key_scales[j] = k.scale[0];
      } else if (k.scale != scaled_by) {
        bool changed = false;
        for (size_t r = 0; r < kRows; ++r) q[r] = ScaledQuery(rows[r].q, rows[r].i, k, dk, *rows[r].s, changed);
        scaled_by = k.scale;
      }
      return Int8Integers{reinterpret_cast<const int8_t*>(k.data)};
    } else {
      return keys.row(first + j);
    }
  };
  // Whether key j takes the queries key j − 1 took (an int8 key's channel scales change them).
  const auto same_queries = [&](size_t j) {
    if constexpr (kInt8) {
      if (run.first != nullptr) return true;
      const StoredRow<StorageType::int8> k = keys.row(first + j);
      return k.scale_step == 0 || k.scale == scaled_by;
    } else {
      return true;
    }
  };
  const size_t vectors = dk / N;
  constexpr bool kTwoKeys = simd::HWY_NAMESPACE::kVectorRegisters >= 32;
  // int8 keys of one run that fill whole vectors go two at a time through a loop of their requests
  // and products alone, without the general loop's tests of each key's row and scales; that loop
  // takes the rest. The same sums: grouped-query int8 decode ran 1.05–1.10× as fast with K and V in
  // L2 and L3 (one thread) and 0.99–1.05× from memory (two threads; Zen 5, two builds alternated in
  // one process). Float32 rows as they lie gained 1.05× in L2 and L3 but lost 0.97× from memory,
  // and float16 ones lost 0.90× (GCC's code for their conversions), so they keep the general loop.
  size_t paired = 0;
  const auto in_pairs = [&](auto vectors_constant, const auto& row) {
    constexpr size_t kVectors = decltype(vectors_constant)::value;
    for (; paired + 1 < nk; paired += 2) {
      ahead.Ask(first + paired);
      ahead.Ask(first + paired + 1);
      SharedRowDotsOfTwoKeys<kRows, kVectors>(d, q, row(paired), row(paired + 1), paired, lanes);
    }
  };
  const auto by_pairs = [&](const auto& row) {
    if (tail) return;
    if (vectors == 8) in_pairs(std::integral_constant<size_t, 8>(), row);
    if (vectors == 4) in_pairs(std::integral_constant<size_t, 4>(), row);
  };
  if constexpr (kTwoKeys && kInt8) {
    if (run.first != nullptr) by_pairs([&](size_t j) { return run.row(j); });
  }
  for (size_t j = paired; j < nk;) {
    ahead.Ask(first + j);
    const auto key = key_row(j);
    if (kTwoKeys && !tail && (vectors == 8 || vectors == 4) && j + 1 < nk && same_queries(j + 1)) {
      ahead.Ask(first + j + 1);
      const auto next = key_row(j + 1);
      if (vectors == 8) {
        SharedRowDotsOfTwoKeys<kRows, 8>(d, q, key, next, j, lanes);
      } else {
        SharedRowDotsOfTwoKeys<kRows, 4>(d, q, key, next, j, lanes);
      }
      j += 2;
      continue;
    }
    if (!tail && vectors == 8) {
      SharedRowDots<kRows, 8>(d, q, key, j, lanes);
    } else if (!tail && vectors == 4) {
      SharedRowDots<kRows, 4>(d, q, key, j, lanes);
    } else if constexpr (kRows % 2 == 0 && kConvertsRow<std::remove_cv_t<decltype(key)>>) {
      for (size_t r = 0; r < kRows; r += 2) {
        RowPairDotLanes(d, q[r], q[r + 1], key, dk, lanes[r][j], lanes[r + 1][j]);
      }
    } else {
      for (size_t r = 0; r < kRows; ++r) lanes[r][j] = RowDotLanes(d, q[r], key, dk);
    }
    if (tail) {
      for (size_t r = 0; r < kRows; ++r) tails[r][j] = RowDotTail(d, q[r], key, dk);
    }
    ++j;
  }
  for (size_t r = 0; r < kRows; ++r) {
    for (size_t j = nk; j < kN; ++j) lanes[r][j] = hn::Zero(d);
    hn::Vec<D> sum = SumLanesOfEach(d, lanes[r]);
    if (tail) sum = hn::Add(sum, hn::Load(d, tails[r]));
    dots[r] = per_key ? hn::Mul(sum, hn::Load(d, key_scales)) : sum;
  }
}

// o_r ← corr_r·o_r + Σ_j p_r[j]·v_j for the rows' nk values of a block, each V vector loaded once
// for all rows: per element, the same operations in the same order as AccumulateWeightedRows.
template <size_t kRows, class D, class Rows, class T = hn::TFromD<D>>
HWY_INLINE void SharedValueSums(D d, const Rows& values, size_t nk, T* const* p, const T* corr, size_t dv,
                                T* const* o) {
  const size_t N = hn::Lanes(d);
  // Sums in registers for kColumns vectors of every row, and the values' kColumns vectors.
  constexpr size_t kColumns = std::max<size_t>(1, (HWY_TARGET <= HWY_AVX3 ? 16 : 8) / kRows);
  size_t c = 0;
  for (; c + kColumns * N <= dv; c += kColumns * N) {
    hn::Vec<D> sum[kRows][kColumns];
    for (size_t r = 0; r < kRows; ++r) {
      for (size_t u = 0; u < kColumns; ++u) sum[r][u] = hn::Zero(d);
    }
    for (size_t j = 0; j < nk; ++j) {
      const auto vj = values.row(j);
      hn::Vec<D> v[kColumns];
      HWY_UNROLL(16)
      for (size_t u = 0; u < kColumns; ++u) v[u] = LoadRow(d, vj, c + u * N);
      HWY_UNROLL(4)
      for (size_t r = 0; r < kRows; ++r) {
        const hn::Vec<D> pj = hn::Set(d, p[r][j]);
        HWY_UNROLL(16)
        for (size_t u = 0; u < kColumns; ++u) sum[r][u] = hn::MulAdd(pj, v[u], sum[r][u]);
      }
    }
    for (size_t r = 0; r < kRows; ++r) {
      for (size_t u = 0; u < kColumns; ++u) {
        T* HWY_RESTRICT out = o[r] + c + u * N;
        hn::Store(hn::MulAdd(hn::Load(d, out), hn::Set(d, corr[r]), sum[r][u]), d, out);
      }
    }
  }
  for (; c + N <= dv; c += N) {
    for (size_t r = 0; r < kRows; ++r) AccumulateWeightedColumns<1>(d, values, nk, p[r], corr[r], c, o[r]);
  }
  for (; c < dv; ++c) {
    for (size_t r = 0; r < kRows; ++r) {
      T sum = 0;
      for (size_t j = 0; j < nk; ++j) sum += p[r][j] * RowAt(values.row(j), c);
      o[r][c] = o[r][c] * corr[r] + sum;
    }
  }
}

// AttendFewQueries for kRows query rows that read the same K and V rows (one kv head), together:
// each block's K and V rows come from memory once and serve every row from registers, where
// taking the rows one after another read them from memory once and from L2 for each other row.
// Both ways give the same results. The rows are asked for kSharedRowsAheadBytes ahead.
template <size_t kBlockVectors, size_t kRows, class D, class T = hn::TFromD<D>>
void AttendSharedRows(D d, const Inputs<T>& in, int64_t b, int64_t hk, const SharedRow<T>* rows, int64_t key_begin,
                      int64_t key_end, int64_t prefetch_end, bool ask_ahead) {
  const size_t N = hn::Lanes(d);
  const size_t dk = ToSize(in.dk);
  const size_t dv = ToSize(in.dv);
  const hn::Vec<D> neg_inf = hn::Set(d, -std::numeric_limits<T>::infinity());
  const int64_t ahead = DivCeil(kSharedRowsAheadBytes, in.key_row_bytes());
  T* p[kRows];
  T* o[kRows];
  T corr[kRows];
  for (size_t r = 0; r < kRows; ++r) {
    p[r] = rows[r].s->st.get() + rows[r].i * kBlockVectors * N;
    o[r] = rows[r].s->few.get() + rows[r].i * rows[r].s->few_row;
  }
  const auto block_keys = static_cast<int64_t>(kBlockVectors * N);
  int64_t n = KeysToBlockEnd(key_begin, block_keys, static_cast<int64_t>(N / 2));
  for (int64_t j0 = key_begin; j0 < key_end; j0 += n, n = block_keys) {
    const size_t nk = ToSize(std::min<int64_t>(n, key_end - j0));
    const size_t vectors = kBlockVectors == 1 ? 1 : DivCeil(nk, N);
    hn::Vec<D> scores[kRows][kBlockVectors];
    RowsAhead block_ahead;
    if (ask_ahead && j0 + ahead < prefetch_end) {
      const size_t n_ahead = ToSize(std::min<int64_t>(prefetch_end - j0 - ahead, static_cast<int64_t>(nk)));
      block_ahead =
          RowsAhead{.k = {RowRunOf(in.k, in.k_stored, b, hk, j0 + ahead, n_ahead), ToSize(in.key_row_bytes())},
                    .v = {RowRunOf(in.v, in.v_stored, b, hk, j0 + ahead, n_ahead), ToSize(in.value_row_bytes())}};
    }
    WithStreamedRows(d, in.k, in.k_stored, b, hk, j0, nk, in.tk, [&](const auto& keys) {
      for (size_t v = 0; v < vectors; ++v) {
        const size_t count = std::min(N, nk - v * N);
        const int64_t jv = j0 + static_cast<int64_t>(v * N);
        hn::Vec<D> dots[kRows];
        SharedKeyDots<kRows>(d, keys, v * N, count, rows, dk, block_ahead, dots);
        for (size_t r = 0; r < kRows; ++r) {
          const LaneRun run{.i = static_cast<int64_t>(rows[r].i), .j = jv, .di = 0, .dj = 1, .count = count};
          scores[r][v] = hn::IfThenElse(hn::FirstN(d, count), Scores(d, in, b, rows[r].h, run, dots[r]), neg_inf);
        }
      }
    });
    for (size_t r = 0; r < kRows; ++r)
      corr[r] = FewQueriesSoftmaxStep(d, scores[r], vectors, rows[r].i, *rows[r].s, p[r]);
    WithStreamedRows(d, in.v, in.v_stored, b, hk, j0, nk, in.tk, [&](const auto& values) {
      WithWeightedValues(values, nk, p, kRows,
                         [&](const auto& weighted) { SharedValueSums<kRows>(d, weighted, nk, p, corr, dv, o); });
    });
  }
}

// The online softmax of queries [q0, q0 + nq) (nq ≤ Br) of head (b, h), over keys given in
// consecutive ranges: BeginQueryBlock, then ContinueQueryBlock for each range of keys, then
// EndQueryBlock leave m, l and o in the scratch; K and V rows are asked for ahead up to
// prefetch_end, which may lie past the range (the next range's keys). A block of at most kFewQueries queries takes
// AttendFewQueries when `few` allows it (see ForwardParams::scores_as_backward for when it must not).
template <class T>
bool FewQueryLayout(const Inputs<T>& in, size_t nq, bool few) {
  return few && nq <= kFewQueries && in.dropout_scale == 0;
}

template <class D, class T = hn::TFromD<D>>
void BeginQueryBlock(D d, const Inputs<T>& in, int64_t b, int64_t h, int64_t q0, size_t nq, bool few,
                     ForwardScratch<T>& s) {
  const size_t ld = RoundUp(nq, hn::Lanes(d));
  std::fill(s.max.get(), s.max.get() + ld, -std::numeric_limits<T>::infinity());
  std::fill(s.sum.get(), s.sum.get() + ld, T{0});
  if (FewQueryLayout(in, nq, few)) {
    std::fill(s.few.get(), s.few.get() + nq * s.few_row, T{0});
    return;
  }
  std::fill(s.acc.get(), s.acc.get() + ToSize(in.dv) * kQueryBlock, T{0});
  const size_t dk = ToSize(in.dk);
  if (s.bf16_scores) {
    bf16::pack_queries(s.Bf16Rows(in.q_stored, b, h, q0, nq), nq, dk, ld, s.qt_pairs.get());
    return;
  }
  PackTransposed(StageRows(d, in.q, in.q_stored, b, h, q0, nq, dk, s.q_stage.get()), nq, dk, ld, s.qt.get());
}

template <class T>
void EndQueryBlock(const Inputs<T>& in, size_t nq, bool few, ForwardScratch<T>& s) {
  if (!FewQueryLayout(in, nq, few)) return;
  for (size_t i = 0; i < nq; ++i) {
    for (size_t c = 0; c < ToSize(in.dv); ++c) s.acc[c * kQueryBlock + i] = s.few[i * s.few_row + c];
  }
}

// Sᵀ [nk][ld] = K·Qᵀ of a key block by bf16 products (UsesBf16Scores, which only float takes).
template <class T>
void Bf16Scores(const Inputs<T>& in, int64_t b, int64_t hk, int64_t j0, size_t nk, size_t ld, ForwardScratch<T>& s) {
  if constexpr (std::is_same_v<T, float>) {
    Bf16ScoreTile(s.Bf16Rows(in.k_stored, b, hk, j0, nk), nk, ToSize(in.dk), s.qt_pairs.get(), ld, s.st.get());
  }
}

// oᵀ [Dv][ld] += Vᵀ·Pᵀ of a key block by bf16 products, Pᵀ (s.st) rounded to bfloat16.
template <class T>
void Bf16AddValues(const Inputs<T>& in, int64_t b, int64_t hk, int64_t j0, size_t nk, size_t ld, ForwardScratch<T>& s) {
  if constexpr (std::is_same_v<T, float>) {
    const size_t dv = ToSize(in.dv);
    const uint16_t* const* values = s.Bf16Rows(in.v_stored, b, hk, j0, nk);
    bf16::pack_weights(s.st.get(), nk, ld, s.p_pairs.get());
    if (amx::available()) {
      amx::add_values(values, nk, dv, s.p_pairs.get(), ld, s.acc.get(), kQueryBlock);
      return;
    }
    if (s.v_pairs_head != std::pair{b, hk}) {
      std::fill(s.v_pairs_keys.begin(), s.v_pairs_keys.end(), 0);
      s.v_pairs_head = {b, hk};
    }
    const size_t last = s.v_pairs_keys.size() - 1;
    const size_t slot = j0 % static_cast<int64_t>(kKeyBlock) == 0 ? std::min(ToSize(j0) / kKeyBlock, last) : last;
    const bool kept = slot != last;
    uint32_t* pairs = s.v_pairs.get() + slot * (kKeyBlock / 2) * dv;
    if (!kept || s.v_pairs_keys[slot] != nk) {
      bf16::pack_values(values, nk, dv, pairs);
      if (kept) s.v_pairs_keys[slot] = nk;
    }
    bf16::add_values(pairs, DivCeil(nk, 2), dv, s.p_pairs.get(), ld, s.acc.get(), kQueryBlock);
  }
}

template <class D, class T = hn::TFromD<D>>
void ContinueQueryBlock(D d, const Inputs<T>& in, int64_t b, int64_t h, int64_t q0, size_t nq, int64_t key_begin,
                        int64_t key_end, int64_t prefetch_end, bool few, ForwardScratch<T>& s) {
  const size_t N = hn::Lanes(d);
  const int64_t hk = in.kv_head(h);
  const size_t ld = RoundUp(nq, N);
  const size_t dv = ToSize(in.dv);
  // Keys outside the band of every query of the block (causality, the window) are never visited.
  key_begin = in.BandBegin(q0, key_begin);
  key_end = in.BandEnd(q0, static_cast<int64_t>(nq), key_end);
  prefetch_end = in.BandEnd(q0, static_cast<int64_t>(nq), prefetch_end);
  if (FewQueryLayout(in, nq, few)) {
    // Compiled per width, so that the one-vector step keeps its loop: with the width a run-time
    // value, float16 multi-head decode measured 0.93–0.98× the one-vector kernel's pace.
    if (FewQueriesBlockVectors(in, nq) == kFewQueriesWideBlock) {
      AttendFewQueries<kFewQueriesWideBlock>(d, in, b, h, q0, nq, key_begin, key_end, prefetch_end, s);
    } else {
      AttendFewQueries<1>(d, in, b, h, q0, nq, key_begin, key_end, prefetch_end, s);
    }
    return;
  }
  for (int64_t j0 = key_begin; j0 < key_end; j0 += static_cast<int64_t>(kKeyBlock)) {
    const size_t nk = ToSize(std::min<int64_t>(static_cast<int64_t>(kKeyBlock), key_end - j0));
    if (nq <= static_cast<size_t>(kDecodeQueries)) {
      // With few queries every key is used by few rows: memory, not arithmetic, is the limit, so
      // the next block's K and V stream in while this block is computed.
      const int64_t next = j0 + static_cast<int64_t>(kKeyBlock);
      const int64_t next_n = std::min<int64_t>(static_cast<int64_t>(kKeyBlock), prefetch_end - next);
      PrefetchRows(in.k, in.k_stored, b, hk, next, next_n, ToSize(in.dk));
      PrefetchRows(in.v, in.v_stored, b, hk, next, next_n, dv);
    }
    // Sᵀ [nk][ld] = K · Qᵀ
    if (s.bf16_scores) {
      Bf16Scores(in, b, hk, j0, nk, ld, s);
    } else {
      const RowBlock<T> keys = StageRows(d, in.k, in.k_stored, b, hk, j0, nk, ToSize(in.dk), s.k_stage.get());
      MatMul<false>(d,
                    Gemm<T>{.a = keys.rows,
                            .a_row = keys.stride,
                            .a_depth = 1,
                            .b = s.qt.get(),
                            .b_row = ld,
                            .c = s.st.get(),
                            .c_row = ld,
                            .rows = nk,
                            .depth = ToSize(in.dk)},
                    ld / N);
    }
    OnlineSoftmaxStep(d, in, b, h, q0, nq, j0, nk, s);
    if (in.dropout_scale != 0) {
      // l has summed the weights before dropout (the softmax's); only out sees the mask.
      FillDropoutTile(in, b, h, q0, nq, j0, nk, ld, s.drop.get());
      for (size_t at = 0; at < nk * ld; at += N) {
        hn::Store(hn::Mul(hn::Load(d, s.st.get() + at), hn::Load(d, s.drop.get() + at)), d, s.st.get() + at);
      }
    }
    for (size_t i = 0; i < ld; i += N) {
      const hn::Vec<D> corr = hn::Load(d, s.corr.get() + i);
      if (hn::AllTrue(d, hn::Eq(corr, hn::Set(d, T{1})))) continue;
      for (size_t c = 0; c < dv; ++c) {
        T* HWY_RESTRICT at = s.acc.get() + c * kQueryBlock + i;
        hn::Store(hn::Mul(hn::Load(d, at), corr), d, at);
      }
    }
    // oᵀ [Dv][nq] += Vᵀ · Pᵀ: V's elements are broadcast, each once per key block, and the vectors
    // come from Pᵀ, which the softmax step has just left in L1; the other way round (o += P·V,
    // vectors of V rows) reads every V row once per 4 queries.
    if (s.bf16_values && few) {
      Bf16AddValues(in, b, hk, j0, nk, ld, s);
      continue;
    }
    const RowBlock<T> values = StageRows(d, in.v, in.v_stored, b, hk, j0, nk, dv, s.v_stage.get());
    MatMul<true>(d,
                 Gemm<T>{.a = values.rows,
                         .a_row = 1,
                         .a_depth = values.stride,
                         .b = s.st.get(),
                         .b_row = ld,
                         .c = s.acc.get(),
                         .c_row = kQueryBlock,
                         .rows = dv,
                         .depth = nk},
                 ld / N);
  }
}

// The whole online softmax of a query block over keys [key_begin, key_end).
template <class D, class T = hn::TFromD<D>>
void AttendQueryBlock(D d, const Inputs<T>& in, int64_t b, int64_t h, int64_t q0, size_t nq, int64_t key_begin,
                      int64_t key_end, bool few, ForwardScratch<T>& s) {
  BeginQueryBlock(d, in, b, h, q0, nq, few, s);
  ContinueQueryBlock(d, in, b, h, q0, nq, key_begin, key_end, key_end, few, s);
  EndQueryBlock(in, nq, few, s);
}

// Stores lse rounded to T and, when wanted, the rest.
template <class T>
void WriteLse(const ForwardParams<T>& p, int64_t b, int64_t h, int64_t i, double lse) {
  if (!p.lse) return;
  const T rounded = static_cast<T>(lse);
  p.lse.at(b, h, i) = rounded;
  if (p.lse_lo) {
    p.lse_lo[(b * p.in.heads + h) * p.in.tq + i] =
        std::isinf(lse) ? T{0} : static_cast<T>(lse - static_cast<double>(rounded));
  }
}

// A row's lse over its keys joined with head h's sink, when there is one: log(e^lse + e^sink),
// and the factor e^(lse − lse') by which the row's weights, and so its output, shrink.
struct SinkJoin {
  double lse;
  double keep;
};
template <class T>
SinkJoin JoinSink(const ForwardParams<T>& p, int64_t h, double lse) {
  if (p.sinks == nullptr) return {lse, 1.0};
  const double sink = static_cast<double>(p.sinks[h]);
  const double high = std::max(lse, sink);
  const double joined = high + std::log(std::exp(lse - high) + std::exp(sink - high));
  return {joined, std::exp(lse - joined)};
}

// out = o / l and lse = m + log l for the block's queries (with the sink joined); 0 and −inf (the
// sink) for rows that saw no key.
template <class T>
void WriteOutputs(const ForwardParams<T>& p, int64_t b, int64_t h, int64_t q0, size_t nq, const ForwardScratch<T>& s) {
  for (size_t i = 0; i < nq; ++i) {
    const int64_t qi = q0 + static_cast<int64_t>(i);
    T* out = p.out.row(b, h, qi);
    // A row that saw no visible key has m = −inf and l = 0. A NaN score leaves l NaN, and m −inf
    // on targets whose Max drops NaN (the scalar one): that row is NaN, not empty.
    const bool empty = s.max[i] == -std::numeric_limits<T>::infinity() && s.sum[i] == T{0};
    const double row_lse = empty ? -std::numeric_limits<double>::infinity()
                                 : static_cast<double>(s.max[i]) + std::log(static_cast<double>(s.sum[i]));
    const SinkJoin joined = JoinSink(p, h, row_lse);
    for (size_t c = 0; c < ToSize(p.in.dv); ++c) {
      T value = empty ? T{0} : s.output(i, c) / s.sum[i];
      if (p.sinks != nullptr) value = static_cast<T>(static_cast<double>(value) * joined.keep);
      out[static_cast<int64_t>(c) * p.out.col_stride] = value;
    }
    WriteLse(p, b, h, qi, joined.lse);
  }
}

// Chunks the keys of a decode problem are split into: enough tasks for any core count, none
// shorter than kDecodeMinChunk keys. Depends only on the problem, so results do not depend on
// the thread count.
template <class T>
int64_t DecodeChunks(const Inputs<T>& in) {
  if (in.tq > kDecodeQueries || in.tk < 2 * kDecodeMinChunk) return 1;
  const int64_t by_length = in.tk / kDecodeMinChunk;
  const int64_t kv_heads = in.heads_total() / in.group;
  const int64_t by_tasks = std::max<int64_t>(1, kDecodeTasks / std::max<int64_t>(1, kv_heads));
  return std::max<int64_t>(1, std::min(by_length, by_tasks));
}

// Keys a decode task hands to every query head of its group in turn, so that the heads after the
// first find them in L2: a quarter of this CPU's L2 (of 1 MiB when it does not say), in whole key
// blocks of K and V.
template <class T>
int64_t DecodeGroupKeys(const Inputs<T>& in) {
  const int64_t l2 = cpu_info().l2_bytes > 0 ? cpu_info().l2_bytes : int64_t{1} << 20;
  const int64_t row_bytes = in.key_row_bytes() + in.value_row_bytes();
  return static_cast<int64_t>(RoundUp(ToSize(std::max<int64_t>(1, l2 / 4 / row_bytes)), kKeyBlock));
}

// Queries [0, nq) of head (b, h) with every row starting on a vector: in place when they already
// do, else converted or copied into `stage` at a stride of whole vectors. AttendSharedRows loads
// its rows' query vectors again for every key, and rows that straddle cache lines (float32 Q from
// numpy or std::vector, 16 bytes past a line) split every one of those loads: four rows sharing a
// key in L2 ran 1.17–1.22× as fast from aligned copies, grouped-query decode from float16 and
// bfloat16 K and V 1.13–1.16× (Zen 5; the same bits, as the values are only copied).
template <class D, class T = hn::TFromD<D>>
RowBlock<T> VectorAlignedQueries(D d, const Inputs<T>& in, int64_t b, int64_t h, size_t nq, T* HWY_RESTRICT stage) {
  const size_t N = hn::Lanes(d);
  const size_t dk = ToSize(in.dk);
  const size_t stride = RoundUp(dk, N);
  if (!in.q_stored) {
    const RowBlock<T> rows = RowsOf(in.q, b, h, 0);
    if (reinterpret_cast<uintptr_t>(rows.rows) % (N * sizeof(T)) == 0 && rows.stride % N == 0) return rows;
    for (size_t i = 0; i < nq; ++i) std::copy(rows.row(i), rows.row(i) + dk, stage + i * stride);
    return {stage, stride};
  }
  for (size_t i = 0; i < nq; ++i)
    StageRows(d, in.q, in.q_stored, b, h, static_cast<int64_t>(i), 1, dk, stage + i * stride);
  return {stage, stride};
}

// The few-query layout's continuation for the nq queries of each of a group's heads (scratch s[r]
// for head h0 + r) over keys [key_begin, key_end): their rows taken kSharedRowsAtOnce at a time.
template <class D, class T = hn::TFromD<D>>
void ContinueSharedRows(D d, const Inputs<T>& in, int64_t b, int64_t h0, size_t nq, int64_t key_begin, int64_t key_end,
                        ForwardScratch<T>* s) {
  const int64_t hk = in.kv_head(h0);
  const int64_t prefetch_end = in.BandEnd(0, static_cast<int64_t>(nq), key_end);
  key_begin = in.BandBegin(0, key_begin);
  key_end = prefetch_end;
  std::vector<SharedRow<T>> rows;
  for (size_t r = 0; r < ToSize(in.group); ++r) {
    const int64_t h = h0 + static_cast<int64_t>(r);
    const RowBlock<T> queries = VectorAlignedQueries(d, in, b, h, nq, s[r].q_stage.get());
    s[r].q_scaled_by.fill(nullptr);
    for (size_t i = 0; i < nq; ++i) rows.push_back({queries.row(i), h, i, &s[r]});
  }
  const bool wide = FewQueriesBlockVectors(in, nq) == kFewQueriesWideBlock;
  // More rows than kSharedRowsAtOnce take the keys range by range, the later rows finding them in L2. Ranges
  // end where the blocks of AttendSharedRows do (half a vector past a multiple of kKeyBlock): the first
  // range at the first block end past key_begin (which the band may have moved off one) plus the range
  // less a block. The range is whole blocks, one at least, so every range holds keys.
  const bool by_ranges = rows.size() > kSharedRowsAtOnce;
  const int64_t range = DecodeGroupKeys(in);
  const auto half = static_cast<int64_t>(hn::Lanes(d) / 2);
  const auto block = static_cast<int64_t>(kKeyBlock);
  for (int64_t j0 = key_begin, j1 = 0; j0 < key_end; j0 = j1) {
    j1 = by_ranges ? std::min(key_end, j0 + KeysToBlockEnd(j0, block, half) + range - block) : key_end;
    for (size_t r = 0; r < rows.size();) {
      const size_t left = rows.size() - r;
      const bool ask = r == 0;
      const auto run = [&](auto rows_at_once) {
        constexpr size_t kRows = decltype(rows_at_once)::value;
        if (wide) {
          AttendSharedRows<kFewQueriesWideBlock, kRows>(d, in, b, hk, rows.data() + r, j0, j1, prefetch_end, ask);
        } else {
          AttendSharedRows<1, kRows>(d, in, b, hk, rows.data() + r, j0, j1, prefetch_end, ask);
        }
        r += kRows;
      };
      if (left >= kSharedRowsAtOnce) {
        run(std::integral_constant<size_t, kSharedRowsAtOnce>());
      } else if (kSharedRowsAtOnce > 2 && left >= 2) {
        run(std::integral_constant<size_t, std::min<size_t>(2, kSharedRowsAtOnce)>());
      } else {
        run(std::integral_constant<size_t, 1>());
      }
    }
  }
}

// Decode: every (kv head, key chunk) task leaves the partial (m, l, o) of the Tq ≤ 16 queries of
// each query head of its group, so that K and V come from memory once per group: in the few-query
// layout, with more than one query row in all, the rows take each K and V row together
// (ContinueSharedRows); otherwise each head in turn, range of keys by range of keys
// (DecodeGroupKeys). A second parallel_for merges the chunks of each head by log-sum-exp:
//   M = max_c m_c,  w_c = exp(m_c − M) (0 for a chunk that saw no key),  l = Σ_c w_c l_c,
//   out = Σ_c w_c o_c / l,  lse = M + log l;  M = −inf: out 0, lse −inf.
template <class D, class T = hn::TFromD<D>>
void ForwardDecode(D d, const ForwardParams<T>& p, int64_t chunks, std::vector<ForwardScratch<T>>& scratch) {
  const Inputs<T>& in = p.in;
  const size_t nq = ToSize(in.tq);
  const size_t dv = ToSize(in.dv);
  const auto group = ToSize(in.group);
  const int64_t chunk_len =
      static_cast<int64_t>(RoundUp(ToSize((in.tk + chunks - 1) / chunks), kKeyBlock));  // whole key blocks
  // One head alone takes its chunk in one go.
  const int64_t range = in.group > 1 ? DecodeGroupKeys(in) : chunk_len;
  // Ranges end where blocks do, so that the blocks, and the result, do not depend on the range
  // (which depends on the types): AttendFewQueries' blocks end half a vector past a multiple of
  // one, the other layout's at multiples of kKeyBlock.
  const bool few = !p.scores_as_backward;
  const bool shared = in.group * static_cast<int64_t>(nq) > 1 && FewQueryLayout(in, nq, few);
  const int64_t range_shift = FewQueryLayout(in, nq, few) ? static_cast<int64_t>(hn::Lanes(d) / 2) : 0;
  const int64_t heads = in.heads_total();
  const size_t parts = ToSize(heads * chunks);
  std::vector<T> part_max(parts * nq), part_sum(parts * nq), part_acc(parts * nq * dv);
  parallel_for(
      heads / in.group * chunks,
      [&](int64_t task, int worker) HWY_ATTR {
        const int64_t first = task / chunks * in.group;  // the group's first head, b·H + h
        const int64_t chunk = task % chunks;
        const int64_t begin = std::min(in.tk, chunk * chunk_len), end = std::min(in.tk, begin + chunk_len);
        ForwardScratch<T>* s = &scratch[ToSize(worker) * group];
        const amx::TileSession tiles(s->bf16_scores);
        for (size_t r = 0; r < group; ++r) {
          const int64_t bh = first + static_cast<int64_t>(r);
          BeginQueryBlock(d, in, bh / in.heads, bh % in.heads, 0, nq, few, s[r]);
        }
        if (shared) {
          ContinueSharedRows(d, in, first / in.heads, first % in.heads, nq, begin, end, s);
        } else {
          for (int64_t j0 = begin, j1 = 0; j0 < end; j0 = j1) {
            j1 = std::min(end, (j0 == begin ? begin + range_shift : j0) + range);
            for (size_t r = 0; r < group; ++r) {
              const int64_t bh = first + static_cast<int64_t>(r);
              ContinueQueryBlock(d, in, bh / in.heads, bh % in.heads, 0, nq, j0, j1, end, few, s[r]);
            }
          }
        }
        for (size_t r = 0; r < group; ++r) {
          EndQueryBlock(in, nq, few, s[r]);
          const size_t part = ToSize((first + static_cast<int64_t>(r)) * chunks + chunk);
          std::copy(s[r].max.get(), s[r].max.get() + nq, part_max.begin() + static_cast<ptrdiff_t>(part * nq));
          std::copy(s[r].sum.get(), s[r].sum.get() + nq, part_sum.begin() + static_cast<ptrdiff_t>(part * nq));
          for (size_t i = 0; i < nq; ++i) {
            for (size_t c = 0; c < dv; ++c) part_acc[(part * nq + i) * dv + c] = s[r].output(i, c);
          }
        }
      },
      ThreadLimit(in));
  parallel_for(
      heads,
      [&](int64_t bh, int /*worker*/) HWY_ATTR {
        const int64_t b = bh / in.heads, h = bh % in.heads;
        std::vector<double> weight(ToSize(chunks));
        for (size_t i = 0; i < nq; ++i) {
          auto at = [&](int64_t chunk) { return ToSize(bh * chunks + chunk) * nq + i; };
          double max = -std::numeric_limits<double>::infinity();
          for (int64_t c = 0; c < chunks; ++c) max = std::max(max, static_cast<double>(part_max[at(c)]));
          T* out = p.out.row(b, h, static_cast<int64_t>(i));
          if (max == -std::numeric_limits<double>::infinity()) {
            for (int64_t c = 0; c < in.dv; ++c) out[c * p.out.col_stride] = T{0};
            WriteLse(p, b, h, static_cast<int64_t>(i), JoinSink(p, h, max).lse);
            continue;
          }
          double sum = 0;
          for (int64_t c = 0; c < chunks; ++c) {
            weight[ToSize(c)] = std::exp(static_cast<double>(part_max[at(c)]) - max);  // exp(−inf) = 0
            sum += weight[ToSize(c)] * static_cast<double>(part_sum[at(c)]);
          }
          const SinkJoin joined = JoinSink(p, h, max + std::log(sum));
          for (int64_t col = 0; col < in.dv; ++col) {
            double value = 0;
            for (int64_t c = 0; c < chunks; ++c)
              value += weight[ToSize(c)] * static_cast<double>(part_acc[at(c) * dv + ToSize(col)]);
            out[col * p.out.col_stride] = static_cast<T>(value / sum * joined.keep);
          }
          WriteLse(p, b, h, static_cast<int64_t>(i), joined.lse);
        }
      },
      ThreadLimit(in));
}

template <class T>
void ForwardImpl(const ForwardParams<T>& p) {
  const hn::ScalableTag<T> d;
  const Inputs<T>& in = p.in;
  const size_t N = hn::Lanes(d);
  const size_t dv_pad = RoundUp(ToSize(in.dv), N);
  const int64_t chunks = DecodeChunks(in);
  // Decode runs the query heads of a group together, each with its own scratch.
  const size_t per_worker = chunks > 1 ? ToSize(in.group) : 1;
  std::vector<ForwardScratch<T>> scratch;
  scratch.reserve(ToSize(max_workers()) * per_worker);
  for (size_t w = 0; w < ToSize(max_workers()) * per_worker; ++w) {
    scratch.emplace_back(ToSize(in.dk), ToSize(in.dv), dv_pad, in);
  }

  if (chunks > 1) {
    ForwardDecode(d, p, chunks, scratch);
    return;
  }
  const int64_t blocks = (in.tq + static_cast<int64_t>(kQueryBlock) - 1) / static_cast<int64_t>(kQueryBlock);
  parallel_for(
      in.heads_total() * blocks,
      [&](int64_t task, int worker) HWY_ATTR {
        const int64_t bh = task / blocks;
        // The last query blocks see the most keys under causality: hand them out first.
        const int64_t block = blocks - 1 - task % blocks;
        const int64_t b = bh / in.heads, h = bh % in.heads;
        const int64_t q0 = block * static_cast<int64_t>(kQueryBlock);
        const size_t nq = ToSize(std::min(static_cast<int64_t>(kQueryBlock), in.tq - q0));
        ForwardScratch<T>& s = scratch[ToSize(worker)];
        const amx::TileSession tiles(s.bf16_scores);
        AttendQueryBlock(d, in, b, h, q0, nq, 0, in.tk, !p.scores_as_backward, s);
        WriteOutputs(p, b, h, q0, nq, s);
      },
      ThreadLimit(in));
}

// ---- Backward ------------------------------------------------------------------------------------

template <class T>
struct BackwardScratch {
  Buffer<T> kt;       // [Dk][Bc]      Kᵀ of the key block (one-pass and pass 1)
  Buffer<T> vt;       // [Dv][Bc]      Vᵀ of the key block
  Buffer<T> qt;       // [Dk][Br]      Qᵀ of the query block (pass 2)
  Buffer<T> dot;      // [Dv][Br]      dOᵀ of the query block
  Buffer<T> p;        // [Br·Bc]       P tile (either layout)
  Buffer<T> ds;       // [Br·Bc]       dP, then dS (times the softcap's slope), tile
  Buffer<T> ds_bias;  // [Br·Bc]       dS before the softcap's slope, for dbias
  Buffer<T> drop;     // [Bc][Br]      the dropout factors of a tile with keys as rows (pass 2)
  Buffer<T> dk_acc;   // [Bc][Dk_pad]  Σ_i dS_ij q_i of the key block
  Buffer<T> dv_acc;   // [Bc][Dv_pad]  Σ_i P_ij dO_i
  Buffer<T> dq;       // [Br][Dk_pad]  Σ_j dS_ij k_j of one tile
  Buffer<T> lse_hi;   // [Br]          lse of the query block (pass 2), high part
  Buffer<T> lse_lo;   // [Br]          and low part
  Buffer<T> delta;    // [Br]          D of the query block (pass 2)
  Buffer<T> panel;    // [max(Br, Bc)][N]
  Buffer<T> q_stage;  // [Br][Dk]      the query block's rows in T, when Q is stored narrower (StageRows)
  Buffer<T> k_stage;  // [Bc][Dk]      the key block's, when K is
  Buffer<T> v_stage;  // [Bc][Dv]      the value block's, when V is
  // With bf16 scores (UsesBf16Scores): Kᵀ (one pass and pass 1) or Qᵀ (pass 2) in pairs of
  // bfloat16 dims, and the rows of the other side.
  Buffer<uint32_t> t_pairs;  // [⌈Dk/2⌉ rounded up to 16][max(Br, Bc)]
  Bf16RowTable Bf16Rows;

  BackwardScratch(const fused::Inputs<T>& in, size_t dk, size_t dv, size_t lanes)
      : kt(Allocate<T>(dk * kKeyBlock)),
        vt(Allocate<T>(dv * kKeyBlock)),
        qt(Allocate<T>(dk * kQueryBlock)),
        dot(Allocate<T>(dv * kQueryBlock)),
        p(Allocate<T>(kQueryBlock * kKeyBlock)),
        ds(Allocate<T>(kQueryBlock * kKeyBlock)),
        ds_bias(Allocate<T>(kQueryBlock * kKeyBlock)),
        drop(Allocate<T>(kQueryBlock * kKeyBlock)),
        dk_acc(Allocate<T>(kKeyBlock * RoundUp(dk, lanes))),
        dv_acc(Allocate<T>(kKeyBlock * RoundUp(dv, lanes))),
        dq(Allocate<T>(kQueryBlock * RoundUp(dk, lanes))),
        lse_hi(Allocate<T>(kQueryBlock)),
        lse_lo(Allocate<T>(kQueryBlock)),
        delta(Allocate<T>(kQueryBlock)),
        panel(Allocate<T>(std::max(kQueryBlock, kKeyBlock) * lanes)),
        q_stage(Allocate<T>(in.q_stored ? kQueryBlock * dk : 0)),
        k_stage(Allocate<T>(in.k_stored ? kKeyBlock * dk : 0)),
        v_stage(Allocate<T>(in.v_stored ? kKeyBlock * dv : 0)),
        t_pairs(Allocate<uint32_t>(
            UsesBf16Scores(in) ? amx::RoundUpToTile(DivCeil(dk, 2)) * std::max(kQueryBlock, kKeyBlock) : 0)) {}
};

// P = exp((s − lse_hi) − lse_lo) and dS = P ∘ (dP − D) for one vector of (query, key) pairs, in
// place: p_inout holds q·k, ds_inout dO·v; with dropout, p_inout receives P times the pairs' dropout
// factors `dropout`. With a softcap,
// ds_inout receives dS times the cap's slope (the gradient of scale·q·k) and ds_bias, when given, dS itself (the bias's
// gradient). Shared by both tile layouts, so that both give bit-identical P and dS.
template <class D, class T = hn::TFromD<D>>
HWY_INLINE void ProbabilityAndScoreGradient(D d, const Inputs<T>& in, int64_t b, int64_t h, const LaneRun& run,
                                            hn::Vec<D> lse_hi, hn::Vec<D> lse_lo, hn::Vec<D> delta, hn::Vec<D> dropout,
                                            T* HWY_RESTRICT p_inout, T* HWY_RESTRICT ds_inout,
                                            T* HWY_RESTRICT ds_bias) {
  hn::Vec<D> cap_slope = hn::Set(d, T{1});
  const hn::Vec<D> s = Scores(d, in, b, h, run, hn::Load(d, p_inout), &cap_slope);
  const hn::Vec<D> p = SoftmaxExp(d, hn::Sub(hn::Sub(s, lse_hi), lse_lo));
  hn::Vec<D> dp = hn::Load(d, ds_inout);
  if (in.dropout_scale != 0) {
    // out = Σ_j P_ij m_ij v_j with m the dropout factors: dV takes P·m, and dS = P (dP·m − D).
    hn::Store(hn::Mul(p, dropout), d, p_inout);
    dp = hn::Mul(dp, dropout);
  } else {
    hn::Store(p, d, p_inout);
  }
  const hn::Vec<D> ds = hn::Mul(p, hn::Sub(dp, delta));
  if (in.softcap > 0) {
    if (ds_bias != nullptr) hn::Store(ds, d, ds_bias);
    hn::Store(hn::Mul(ds, cap_slope), d, ds_inout);
  } else {
    hn::Store(ds, d, ds_inout);
  }
}

// rows of x += scale · tile. Not inlined: both backward schedules run this very code, so the
// rounding of the update cannot differ between them.
template <class T>
HWY_NOINLINE void AddScaledRows(const fused::RowsView<T>& x, int64_t b, int64_t h, int64_t t0, size_t rows, size_t cols,
                                const T* HWY_RESTRICT tile, size_t ld, T scale) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto factor = hn::Set(d, scale);
  for (size_t r = 0; r < rows; ++r) {
    T* dst = x.row(b, h, t0 + static_cast<int64_t>(r));
    const T* src = tile + r * ld;
    size_t c = 0;
    if (x.col_stride == 1) {
      for (; c + N <= cols; c += N)
        hn::StoreU(hn::MulAdd(factor, hn::Load(d, src + c), hn::LoadU(d, dst + c)), d, dst + c);
    }
    for (; c < cols; ++c) {
      const hn::CappedTag<T, 1> d1;
      T* at = dst + static_cast<int64_t>(c) * x.col_stride;
      hn::StoreU(hn::MulAdd(hn::Set(d1, scale), hn::Set(d1, src[c]), hn::LoadU(d1, at)), d1, at);
    }
  }
}

// D_i = dO_i·out_i of every row of every head [B·H·Tq], summed lane for lane as TileUpdate sums
// dP_ij = dO_i·v_j: MulAdd over d, chunks of kDepthChunk from zero, each chunk added in turn.
template <class T>
std::vector<T> RowDeltas(const BackwardParams<T>& p) {
  const Inputs<T>& in = p.in;
  std::vector<T> delta(ToSize(in.heads_total() * in.tq));
  parallel_for(
      in.heads_total(),
      [&](int64_t bh, int /*worker*/) HWY_ATTR {
        const hn::CappedTag<T, 1> d1;
        const int64_t b = bh / in.heads, h = bh % in.heads;
        for (int64_t i = 0; i < in.tq; ++i) {
          const T* dout = p.dout.row(b, h, i);
          const T* out = p.out.row(b, h, i);
          auto total = hn::Zero(d1);
          for (int64_t c0 = 0; c0 < in.dv; c0 += static_cast<int64_t>(kDepthChunk)) {
            auto acc = hn::Zero(d1);
            const int64_t c1 = std::min(in.dv, c0 + static_cast<int64_t>(kDepthChunk));
            for (int64_t c = c0; c < c1; ++c)
              acc = hn::MulAdd(hn::Set(d1, dout[c]), hn::Set(d1, out[c * p.out.col_stride]), acc);
            total = c0 == 0 ? acc : hn::Add(total, acc);
          }
          delta[ToSize(bh * in.tq + i)] = hn::GetLane(total);
        }
      },
      ThreadLimit(in));
  return delta;
}

// Adds one tile's dS (queries as rows, row stride ld) into dbias. Where the bias was broadcast over
// queries, a tile's contributions to one element are first summed in float64, in query order, so
// that an element shared by many rows takes one rounding per tile rather than one per score.
template <class T>
void AddTileToBias(const fused::ScoresView<T>& dbias, int64_t b, int64_t h, int64_t q0, size_t nq, int64_t j0,
                   size_t nk, const T* HWY_RESTRICT ds, size_t ld) {
  if (dbias.row_stride == 0) {
    T* row = dbias.row(b, h, q0) + j0 * dbias.col_stride;
    for (size_t j = 0; j < nk; ++j) {
      double sum = 0;
      for (size_t i = 0; i < nq; ++i) sum += static_cast<double>(ds[i * ld + j]);
      row[static_cast<int64_t>(j) * dbias.col_stride] += static_cast<T>(sum);
    }
    return;
  }
  for (size_t i = 0; i < nq; ++i) {
    T* row = dbias.row(b, h, q0 + static_cast<int64_t>(i)) + j0 * dbias.col_stride;
    for (size_t j = 0; j < nk; ++j) row[static_cast<int64_t>(j) * dbias.col_stride] += ds[i * ld + j];
  }
}

// Heads that add to the same gradient elements form a group, run by one task in increasing head
// order: those that share K and V (grouped-query attention: their dK, dV rows), or every head
// when a bias broadcast over H shares its dbias, and over B too when it is broadcast over B.
struct HeadGroups {
  int64_t batch = 0, heads = 0;
  bool share_batch = false;
  int64_t group_heads = 1;  // consecutive heads per group, a divisor of heads

  int64_t per_batch() const { return heads / group_heads; }
  int64_t count() const { return (share_batch ? 1 : batch) * per_batch(); }
  int64_t size() const { return (share_batch ? batch : 1) * group_heads; }
  // Member m (in increasing b·H + h order) of group g, as (b, h).
  std::pair<int64_t, int64_t> member(int64_t g, int64_t m) const {
    const int64_t gb = share_batch ? 0 : g / per_batch();
    const int64_t h0 = (g % per_batch()) * group_heads;
    return {gb + (share_batch ? m / group_heads : 0), h0 + m % group_heads};
  }
};

template <class T>
class BackwardKernel {
 public:
  using D = hn::ScalableTag<T>;

  explicit BackwardKernel(const BackwardParams<T>& p)
      : p_(p),
        in_(p.in),
        // A bias broadcast over the keys (one value per query row) shifts every score of the row
        // alike, which softmax ignores: Σ_j dS_ij is exactly 0, or with a sink, which the shift
        // does not move, P_sink·D, which the API adds. Either way it is not summed here.
        dbias_(p.dbias && p.dbias.col_stride != 0 ? p.dbias : fused::ScoresView<T>{}),
        N_(hn::Lanes(D())),
        dk_(ToSize(in_.dk)),
        dv_(ToSize(in_.dv)),
        dk_pad_(RoundUp(dk_, N_)),
        dv_pad_(RoundUp(dv_, N_)),
        bf16_scores_(UsesBf16Scores(in_)),
        delta_(RowDeltas(p)) {
    const bool share_heads = dbias_ && dbias_.head_stride == 0 && in_.heads > 1;
    groups_ = HeadGroups{.batch = in_.batch,
                         .heads = in_.heads,
                         .share_batch = dbias_ && dbias_.batch_stride == 0 && in_.batch > 1,
                         .group_heads = share_heads ? in_.heads : in_.group};
    for (int w = 0; w < max_workers(); ++w) scratch_.emplace_back(in_, dk_, dv_, N_);
  }

  void Run() {
    const int64_t query_blocks = BlockCount(in_.tq, kQueryBlock);
    const int64_t key_blocks = BlockCount(in_.tk, kKeyBlock);
    const int64_t groups = groups_.count();
    // Cost in tiles: one pass does 5 products per tile, two passes 7 (QKᵀ and dO Vᵀ twice) but
    // split the heads' work over more tasks.
    const int thread_limit = ThreadLimit(in_);
    const int64_t workers = thread_limit == 1 ? 1 : max_workers();
    const bool one_pass = 5 * workers * ((groups + workers - 1) / workers) <= 7 * groups;
    if (one_pass) {
      parallel_for(
          groups,
          [&](int64_t g, int worker) HWY_ATTR {
            const amx::TileSession tiles(bf16_scores_);
            for (int64_t m = 0; m < groups_.size(); ++m) {
              const auto [b, h] = groups_.member(g, m);
              for (int64_t kb = 0; kb < key_blocks; ++kb)
                KeyBlock(b, h, kb, query_blocks, scratch_[ToSize(worker)], true);
            }
          },
          thread_limit);
      return;
    }
    parallel_for(
        groups * key_blocks,
        [&](int64_t task, int worker) HWY_ATTR {
          const amx::TileSession tiles(bf16_scores_);
          for (int64_t m = 0; m < groups_.size(); ++m) {
            const auto [b, h] = groups_.member(task / key_blocks, m);
            KeyBlock(b, h, task % key_blocks, query_blocks, scratch_[ToSize(worker)], false);
          }
        },
        thread_limit);
    parallel_for(
        groups * query_blocks,
        [&](int64_t task, int worker) HWY_ATTR {
          const amx::TileSession tiles(bf16_scores_);
          for (int64_t m = 0; m < groups_.size(); ++m) {
            const auto [b, h] = groups_.member(task / query_blocks, m);
            QueryBlock(b, h, task % query_blocks, key_blocks, scratch_[ToSize(worker)]);
          }
        },
        thread_limit);
  }

 private:
  static int64_t BlockCount(int64_t n, size_t block) {
    return (n + static_cast<int64_t>(block) - 1) / static_cast<int64_t>(block);
  }
  int64_t RowIndex(int64_t b, int64_t h, int64_t i) const { return (b * in_.heads + h) * in_.tq + i; }

  // Key block kb of head (b, h) against every query block that sees it: dK, dV and dbias of its
  // keys; with `with_dq` (one pass) also each tile's dQ.
  void KeyBlock(int64_t b, int64_t h, int64_t kb, int64_t query_blocks, BackwardScratch<T>& s, bool with_dq) {
    const D d;
    const int64_t hk = in_.kv_head(h);
    // With a softcap, dbias takes dS and dK, dQ take dS times the cap's slope.
    T* const ds_bias = dbias_ && in_.softcap > 0 ? s.ds_bias.get() : nullptr;
    const int64_t j0 = kb * static_cast<int64_t>(kKeyBlock);
    const size_t nk = ToSize(std::min(static_cast<int64_t>(kKeyBlock), in_.tk - j0));
    const size_t ld = RoundUp(nk, N_);
    const RowBlock<T> keys = StageRows(d, in_.k, in_.k_stored, b, hk, j0, nk, dk_, s.k_stage.get());
    if (bf16_scores_) {
      bf16::pack_queries(s.Bf16Rows(in_.k_stored, b, hk, j0, nk), nk, dk_, ld, s.t_pairs.get());
    } else {
      PackTransposed(keys, nk, dk_, ld, s.kt.get());
    }
    PackTransposed(StageRows(d, in_.v, in_.v_stored, b, hk, j0, nk, dv_, s.v_stage.get()), nk, dv_, ld, s.vt.get());
    std::fill(s.dk_acc.get(), s.dk_acc.get() + nk * dk_pad_, T{0});
    std::fill(s.dv_acc.get(), s.dv_acc.get() + nk * dv_pad_, T{0});
    for (int64_t qb = 0; qb < query_blocks; ++qb) {
      const int64_t q0 = qb * static_cast<int64_t>(kQueryBlock);
      const size_t nq = ToSize(std::min(static_cast<int64_t>(kQueryBlock), in_.tq - q0));
      if (!in_.BandTouches(q0, static_cast<int64_t>(nq), j0, static_cast<int64_t>(nk))) continue;
      // S [nq][ld] = Q·Kᵀ and dP = dO·Vᵀ
      const RowBlock<T> queries = StageRows(d, in_.q, in_.q_stored, b, h, q0, nq, dk_, s.q_stage.get());
      ScoreProducts(queries, RowsOf(p_.dout, b, h, q0), nq, s.kt.get(), s.vt.get(), ld, s,
                    bf16_scores_ ? s.Bf16Rows(in_.q_stored, b, h, q0, nq) : nullptr);
      for (size_t i = 0; i < nq; ++i) {
        const int64_t qi = q0 + static_cast<int64_t>(i);
        const hn::Vec<D> lse_hi = hn::Set(d, p_.lse_hi[RowIndex(b, h, qi)]);
        const hn::Vec<D> lse_lo = hn::Set(d, p_.lse_lo[RowIndex(b, h, qi)]);
        const hn::Vec<D> delta = hn::Set(d, delta_[ToSize(RowIndex(b, h, qi))]);
        for (size_t j = 0; j < ld; j += N_) {
          const LaneRun run{
              .i = qi, .j = j0 + static_cast<int64_t>(j), .di = 0, .dj = 1, .count = std::min(N_, nk - j)};
          const hn::Vec<D> dropout = in_.dropout_scale != 0 ? DropoutFactors(d, in_, b, h, run) : hn::Set(d, T{1});
          ProbabilityAndScoreGradient(d, in_, b, h, run, lse_hi, lse_lo, delta, dropout, s.p.get() + i * ld + j,
                                      s.ds.get() + i * ld + j, ds_bias == nullptr ? nullptr : ds_bias + i * ld + j);
        }
      }
      if (dbias_) AddTileToBias(dbias_, b, h, q0, nq, j0, nk, ds_bias == nullptr ? s.ds.get() : ds_bias, ld);
      // dV [nk] += Pᵀ·dO and dK += dSᵀ·Q (scaled when written out)
      MatMulCols<true>(d,
                       Gemm<T>{.a = s.p.get(),
                               .a_row = 1,
                               .a_depth = ld,
                               .b = p_.dout.row(b, h, q0),
                               .b_row = ToSize(p_.dout.row_stride),
                               .c = s.dv_acc.get(),
                               .c_row = dv_pad_,
                               .rows = nk,
                               .depth = nq},
                       dv_, s.panel.get());
      MatMulCols<true>(d,
                       Gemm<T>{.a = s.ds.get(),
                               .a_row = 1,
                               .a_depth = ld,
                               .b = queries.rows,
                               .b_row = queries.stride,
                               .c = s.dk_acc.get(),
                               .c_row = dk_pad_,
                               .rows = nk,
                               .depth = nq},
                       dk_, s.panel.get());
      // dQ tile [nq] = dS·K, added to dq now: tile by tile in key-block order, as pass 2 does.
      if (with_dq) AddQueryGradientTile(b, h, q0, nq, keys, nk, ld, 1, s);
    }
    AddScaledRows(p_.dk, b, hk, j0, nk, dk_, s.dk_acc.get(), dk_pad_, in_.scale);
    AddScaledRows(p_.dv, b, hk, j0, nk, dv_, s.dv_acc.get(), dv_pad_, T{1});
  }

  // Query block qb of head (b, h) against every key block it sees, tiles with keys as rows: dQ.
  void QueryBlock(int64_t b, int64_t h, int64_t qb, int64_t key_blocks, BackwardScratch<T>& s) {
    const D d;
    const int64_t q0 = qb * static_cast<int64_t>(kQueryBlock);
    const size_t nq = ToSize(std::min(static_cast<int64_t>(kQueryBlock), in_.tq - q0));
    const size_t ld = RoundUp(nq, N_);
    if (bf16_scores_) {
      bf16::pack_queries(s.Bf16Rows(in_.q_stored, b, h, q0, nq), nq, dk_, ld, s.t_pairs.get());
    } else {
      PackTransposed(StageRows(d, in_.q, in_.q_stored, b, h, q0, nq, dk_, s.q_stage.get()), nq, dk_, ld, s.qt.get());
    }
    PackTransposed(RowsOf(p_.dout, b, h, q0), nq, dv_, ld, s.dot.get());
    for (size_t i = 0; i < ld; ++i) {
      const int64_t qi = q0 + static_cast<int64_t>(i);
      s.lse_hi[i] = i < nq ? p_.lse_hi[RowIndex(b, h, qi)] : std::numeric_limits<T>::infinity();
      s.lse_lo[i] = i < nq ? p_.lse_lo[RowIndex(b, h, qi)] : T{0};
      s.delta[i] = i < nq ? delta_[ToSize(RowIndex(b, h, qi))] : T{0};
    }
    for (int64_t kb = 0; kb < key_blocks; ++kb) {
      const int64_t j0 = kb * static_cast<int64_t>(kKeyBlock);
      const size_t nk = ToSize(std::min(static_cast<int64_t>(kKeyBlock), in_.tk - j0));
      if (!in_.BandTouches(q0, static_cast<int64_t>(nq), j0, static_cast<int64_t>(nk))) continue;
      // Sᵀ [nk][ld] = K·Qᵀ and dPᵀ = V·dOᵀ
      const int64_t hk = in_.kv_head(h);
      const RowBlock<T> keys = StageRows(d, in_.k, in_.k_stored, b, hk, j0, nk, dk_, s.k_stage.get());
      ScoreProducts(keys, StageRows(d, in_.v, in_.v_stored, b, hk, j0, nk, dv_, s.v_stage.get()), nk, s.qt.get(),
                    s.dot.get(), ld, s, bf16_scores_ ? s.Bf16Rows(in_.k_stored, b, hk, j0, nk) : nullptr);
      if (in_.dropout_scale != 0) FillDropoutTile(in_, b, h, q0, nq, j0, nk, ld, s.drop.get());
      for (size_t j = 0; j < nk; ++j) {
        const int64_t kj = j0 + static_cast<int64_t>(j);
        for (size_t i = 0; i < ld; i += N_) {
          const LaneRun run{
              .i = q0 + static_cast<int64_t>(i), .j = kj, .di = 1, .dj = 0, .count = std::min(N_, nq - i)};
          const hn::Vec<D> dropout = in_.dropout_scale != 0 ? hn::Load(d, s.drop.get() + j * ld + i) : hn::Set(d, T{1});
          ProbabilityAndScoreGradient(d, in_, b, h, run, hn::Load(d, s.lse_hi.get() + i),
                                      hn::Load(d, s.lse_lo.get() + i), hn::Load(d, s.delta.get() + i), dropout,
                                      s.p.get() + j * ld + i, s.ds.get() + j * ld + i, static_cast<T*>(nullptr));
        }
      }
      // dQ tile [nq] = dS·K, with dS(i, j) = dSᵀ[j][i]
      AddQueryGradientTile(b, h, q0, nq, keys, nk, 1, ld, s);
    }
  }

  // The two products every tile starts from, in either layout: s.p = A·Bᵀ over Dk and
  // s.ds = A'·B'ᵀ over Dv, for `rows` rows of A and A' (Q and dO, or K and V, in place or staged),
  // against the other side packed transposed (Kᵀ and Vᵀ, or Qᵀ and dOᵀ) with `ld` columns. With
  // bf16 scores, s.p is A's bfloat16 rows `a_bf16` against s.t_pairs instead.
  void ScoreProducts(const RowBlock<T>& a, const RowBlock<T>& a_dv, size_t rows, const T* b_dk, const T* b_dv,
                     size_t ld, BackwardScratch<T>& s, const uint16_t* const* a_bf16) const {
    const D d;
    if (a_bf16 != nullptr) {
      if constexpr (std::is_same_v<T, float>) Bf16ScoreTile(a_bf16, rows, dk_, s.t_pairs.get(), ld, s.p.get());
    } else {
      MatMul<false>(d,
                    Gemm<T>{.a = a.rows,
                            .a_row = a.stride,
                            .a_depth = 1,
                            .b = b_dk,
                            .b_row = ld,
                            .c = s.p.get(),
                            .c_row = ld,
                            .rows = rows,
                            .depth = dk_},
                    ld / N_);
    }
    MatMul<false>(d,
                  Gemm<T>{.a = a_dv.rows,
                          .a_row = a_dv.stride,
                          .a_depth = 1,
                          .b = b_dv,
                          .b_row = ld,
                          .c = s.ds.get(),
                          .c_row = ld,
                          .rows = rows,
                          .depth = dv_},
                  ld / N_);
  }

  // dq rows [q0, q0 + nq) += scale · dS·K for the tile's nk keys, dS read from s.ds with dS(i, j) at
  // i·query_step + j·key_step: queries as rows (one pass) or keys as rows (pass 2).
  void AddQueryGradientTile(int64_t b, int64_t h, int64_t q0, size_t nq, const RowBlock<T>& keys, size_t nk,
                            size_t query_step, size_t key_step, BackwardScratch<T>& s) const {
    MatMulCols<false>(D(),
                      Gemm<T>{.a = s.ds.get(),
                              .a_row = query_step,
                              .a_depth = key_step,
                              .b = keys.rows,
                              .b_row = keys.stride,
                              .c = s.dq.get(),
                              .c_row = dk_pad_,
                              .rows = nq,
                              .depth = nk},
                      dk_, s.panel.get());
    AddScaledRows(p_.dq, b, h, q0, nq, dk_, s.dq.get(), dk_pad_, in_.scale);
  }

  const BackwardParams<T>& p_;
  const Inputs<T>& in_;
  fused::ScoresView<T> dbias_;  // absent when not wanted or broadcast over the keys
  size_t N_, dk_, dv_, dk_pad_, dv_pad_;
  bool bf16_scores_;      // UsesBf16Scores
  std::vector<T> delta_;  // [B·H·Tq] D_i
  HeadGroups groups_;
  std::vector<BackwardScratch<T>> scratch_;
};

// ---- Per-target entry points (non-templates, for HWY_EXPORT) ---------------------------------------

void ForwardFloat(const ForwardParams<float>& p) { ForwardImpl(p); }
void ForwardDouble(const ForwardParams<double>& p) { ForwardImpl(p); }
void BackwardFloat(const BackwardParams<float>& p) { BackwardKernel<float>(p).Run(); }
void BackwardDouble(const BackwardParams<double>& p) { BackwardKernel<double>(p).Run(); }

}  // namespace qkv::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
