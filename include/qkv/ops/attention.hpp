#pragma once
// Scaled dot-product attention, forward and backward.
//
// Shapes (one vocabulary across qkv):
//   q   [B, H, Tq, Dk]     queries        out      [B, H, Tq, Dv]
//   k   [B, Hkv, Tk, Dk]   keys           weights  [B, H, Tq, Tk]   α, rows sum to 1 (less the sink)
//   v   [B, Hkv, Tk, Dv]   values         lse      [B, H, Tq]       log (Σ_j exp(s_ij) + exp(sink_h))
// B and H may be left out together or B alone: [Tq, Dk] and [H, Tq, Dk] are read as [1, 1, Tq, Dk]
// and [1, H, Tq, Dk]. k and v have q's leading dims, except that their heads Hkv may be any divisor
// of H (grouped-query attention; Hkv = 1 is multi-query): query head h reads kv head h / (H / Hkv),
// and K and V are never copied. Inputs may be strided; the last dim of each must be contiguous.
//
//   x_ij = scale · q_i·k_j,  c·tanh(x_ij / c) with a softcap c
//   s_ij = x_ij + bias_ij − slope_h·|i + o − j|     (ALiBi; −inf where the mask forbids key j)
//   α_ij = exp(s_ij − lse_i)                         out_i = Σ_j α_ij v_j
//
// o is the offset of the diagonal: Tk − Tq bottom-right aligned (the default), 0 top-left aligned.
// A row in which every key is masked has no distribution: qkv defines its output as 0, its lse as
// −inf (the sink's logit, with a sink), its α row as 0 and its gradients as 0: no NaN ever appears.
//
// The mask parts combine: a key is visible when it passes every part that is given.

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {

// Where query i's diagonal key is, for causality, the window and ALiBi.
enum class CausalAlignment {
  bottom_right,  // key i + Tk − Tq: with a KV cache (Tq < Tk) the last query sees every key
  top_left,      // key i (torch's is_causal): with Tq < Tk the last keys are seen by no query
};

// Query i sees keys i + o − left ≤ j ≤ i + o + right (o as for the alignment); −1 = unbounded.
// (0, 0) leaves each query its diagonal key alone; (−1, 0) is causal.
struct AttentionWindow {
  int64_t left = -1;
  int64_t right = -1;
};

template <class T>
struct AttentionMask {
  // Query i sees key j iff j <= i + o: with the default bottom-right alignment and Tq == Tk the
  // usual lower triangle, and with a KV cache (Tq < Tk) the last query sees every key.
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::bottom_right;
  // o itself, in place of the alignment's: for queries and keys that are blocks of one longer
  // sequence, starting at its positions qs and ks, o = qs − ks + the whole sequence's o. That is
  // how a block of a sharded sequence (ring attention) keeps the whole sequence's causality,
  // window and ALiBi. Not with packed sequences.
  std::optional<int64_t> diagonal_offset = std::nullopt;
  std::optional<AttentionWindow> window = std::nullopt;
  // Broadcastable to [B, H, Tq, Tk]; nonzero = may attend.
  std::optional<TensorView<const uint8_t>> allowed = std::nullopt;
  // Broadcastable to [B, H, Tq, Tk]; added to the scaled scores. −inf masks a key.
  std::optional<TensorView<const T>> bias = std::nullopt;
  // [H] ALiBi slopes (alibi_slopes(H) gives the standard ones): adds −slope_h·|i + o − j|, computed
  // where it is used, never stored.
  std::optional<TensorView<const T>> alibi_slopes = std::nullopt;
  // Packed variable-length batches (B = 1): [N+1] increasing offsets from 0 to Tq (to Tk), sequence
  // n holding queries [cu_q[n], cu_q[n+1]) and keys [cu_k[n], cu_k[n+1]). A query sees only its own
  // sequence's keys; causality, the window and ALiBi count i and j within the sequence. Both or
  // neither.
  std::optional<TensorView<const int64_t>> cu_seqlens_q = std::nullopt;
  std::optional<TensorView<const int64_t>> cu_seqlens_k = std::nullopt;
};

// Dropout on α: weight (b, h, i, j) is dropped with probability p and the kept ones are scaled
// by 1/(1 − p). Which are dropped is a function of (seed, b, h, i, j) alone (Philox 4x32-10,
// qkv/core/rng.hpp), the same for every implementation, thread count and SIMD target, so the
// backward replays the forward's mask from the seed. p = 0 is exactly no dropout.
struct AttentionDropout {
  double p = 0.0;  // in [0, 1)
  uint64_t seed = 0;
};

template <class T>
struct AttentionParams {
  TensorView<const T> q;  // [B, H, Tq, Dk]
  TensorView<const T> k;  // [B, Hkv, Tk, Dk], H a multiple of Hkv
  TensorView<const T> v;  // [B, Hkv, Tk, Dv]
  // Multiplies q·k before the bias is added; 1/sqrt(Dk) when not given.
  std::optional<double> scale;
  AttentionMask<T> mask;
  // c > 0: the scaled q·k become c·tanh(x / c), before the bias and the mask (Gemma 2's softcap).
  std::optional<double> softcap = std::nullopt;
  // [H] one logit per head that joins every row's softmax with no value (an attention sink): the
  // weights of a row sum to 1 − exp(sink_h − lse_i).
  std::optional<TensorView<const T>> sinks = std::nullopt;
  // Out is Σ_j α_ij·keep_ij/(1 − p)·v_j; weights and lse are those before dropout.
  std::optional<AttentionDropout> dropout = std::nullopt;
};

// Written by the forward (overwritten, not accumulated). Shapes take the same leading dims as q.
template <class T>
struct AttentionOutputs {
  TensorView<T> out;                     // [B, H, Tq, Dv]
  std::optional<TensorView<T>> weights;  // [B, H, Tq, Tk]
  std::optional<TensorView<T>> lse;      // [B, H, Tq]
};

// Accumulated by the backward (+=): callers zero them first, or sum gradients across calls.
template <class T>
struct AttentionGradients {
  TensorView<T> dq;  // [B, H, Tq, Dk]
  TensorView<T> dk;  // [B, Hkv, Tk, Dk], summed over the heads of each group
  TensorView<T> dv;  // [B, Hkv, Tk, Dv]
  // Same shape as mask.bias; summed over the dims along which the bias was broadcast.
  std::optional<TensorView<T>> dbias;
  std::optional<TensorView<T>> dsinks = std::nullopt;  // [H], with params.sinks; summed over B and Tq
};

// What the forward produced, handed back to the backward so that it need not recompute it.
template <class T>
struct AttentionSaved {
  TensorView<const T> out;  // [B, H, Tq, Dv]
  TensorView<const T> lse;  // [B, H, Tq]
};

enum class AttentionImpl {
  automatic,  // the fastest implementation that supports the request
  reference,  // plain loops, float64 accumulation, materialises the scores of one head at a time
  fused,      // tiled online softmax (FlashAttention-2): O(T) memory, SIMD, threads; never gives α
};

// Reference: per (batch, head) it builds the Tq×Tk score matrix in float64, normalises it and
// weighs V, exactly as the textbook formula reads. It refuses up front (ResourceError) a problem
// whose per-head Tq×Tk matrices would not fit in the memory available.
template <class T>
void attention_forward_reference(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs);

// Gradients of L = <dout, out> (dout [B, H, Tq, Dv]), recomputed in float64 from the inputs.
template <class T>
void attention_backward_reference(const AttentionParams<T>& params, TensorView<const T> dout,
                                  const AttentionGradients<T>& grads);

// Fused: the FlashAttention-2 algorithm on the CPU (src/ops/attention_fused.cpp). Same semantics as
// the reference, but only per-thread tiles are ever allocated: Tq×Tk is never materialised, so
// it cannot produce `weights` (ValueError when asked for them). The forward writes out and lse.
template <class T>
void attention_forward_fused(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs);

// Gradients of L = <dout, out>, with P recomputed tile by tile from the saved lse (the forward
// is run again when `saved` is not given). Deterministic: bit-identical for any thread count.
template <class T>
void attention_backward_fused(const AttentionParams<T>& params, TensorView<const T> dout,
                              const AttentionGradients<T>& grads,
                              const std::optional<AttentionSaved<T>>& saved = std::nullopt);

template <class T>
void attention_forward(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs,
                       AttentionImpl impl = AttentionImpl::automatic);

// `saved` is optional: implementations that recompute from the saved lse use it when given and
// recompute the forward otherwise; the reference always recomputes in float64.
template <class T>
void attention_backward(const AttentionParams<T>& params, TensorView<const T> dout, const AttentionGradients<T>& grads,
                        const std::optional<AttentionSaved<T>>& saved = std::nullopt,
                        AttentionImpl impl = AttentionImpl::automatic);

// ---- Q, K and V stored narrower than float32 ------------------------------------------------------
// float16 or bfloat16 Q, K, V, and int8 K and V with scales (qkv/core/storage.hpp), each operand
// in its own type, with the shapes, masks and options of AttentionParams<float> (packed sequences
// and dropout aside). Scores, softmax and the output accumulate in float32: the result is the
// float32 computation on the values the operands stand for (to_float32), and the fused forward is
// bit-identical to attention_forward on those values converted first. It converts them where it
// reads them, a tile of rows at a time, so no float32 copy of K or V is ever made.
// The exceptions, where attention_bf16_products() says so, take the CPU's bf16 dot product
// (AVX512_BF16). With Q and K both in bfloat16, the fused forward and backward compute every score
// by it: exact products summed in float32 in pairs of dims, as accurate as the float32 kernel's
// but summed in another order, so within the float32 rule rather than bit-identical, and the same
// in the forward and in the backward that reads its lse. A fused forward that returns no lse on V
// in bfloat16 too runs its blocks of more than 8 queries with both products on it, rounding the
// softmax's weights to bfloat16 before they multiply V: its out is within the rule of a bf16
// computation (docs/low-precision.md). Q stored as float32 keeps the float32 arithmetic.
struct StoredAttentionParams {
  StoredView q;  // float32, float16 or bfloat16
  StoredView k;  // any StorageType; int8 with scales (one per channel, [..., Hkv, 1, Dk], keeps
                 // the outlier channels of keys from setting every channel's step)
  StoredView v;  // any StorageType; int8 with scales (one per token, [..., Hkv, Tk, 1])
  std::optional<double> scale;
  AttentionMask<float> mask;
  std::optional<double> softcap = std::nullopt;
  std::optional<TensorView<const float>> sinks = std::nullopt;
};

// Whether this CPU, at the SIMD target in use (simd_target()), has the bf16 dot product above.
bool attention_bf16_products();

// Whether those bf16 products run on AMX's tiles (AMX-BF16: Sapphire Rapids and later Xeons, where
// the operating system grants them to the process) rather than on AVX512_BF16's vdpbf16ps. The two
// differ only in the order of each score's and each output's sums, within the same rule.
bool attention_bf16_tiles();

// automatic and fused: the fused kernel (weights: the reference); reference: the float64
// reference on to_float32 of the operands.
void attention_forward(const StoredAttentionParams& params, const AttentionOutputs<float>& outputs,
                       AttentionImpl impl = AttentionImpl::automatic);

// Gradients in float32 of the values the operands stand for (dq of q as to_float32 gives it,
// and so on), bit-identical to attention_backward on those values converted first. automatic and
// fused: the fused backward, which converts each block of rows of Q, K and V into float32 as its
// tiles read them (no float32 copy of a whole operand); reference: the float64 reference on
// to_float32 of the operands.
void attention_backward(const StoredAttentionParams& params, TensorView<const float> dout,
                        const AttentionGradients<float>& grads,
                        const std::optional<AttentionSaved<float>>& saved = std::nullopt,
                        AttentionImpl impl = AttentionImpl::automatic);

// The scale used when params.scale is not given: 1/sqrt(Dk).
double default_scale(int64_t dk);

// ALiBi's slopes for `heads` heads (Press et al.): 2^(−8(h+1)/n) for n = heads a power of two;
// otherwise those of the power of two below, then every other slope of the one above.
std::vector<double> alibi_slopes(int64_t heads);

}  // namespace qkv
