#pragma once
// Scaled dot-product attention, forward and backward.
//
// Shapes (one vocabulary across qkv):
//   q   [B, H, Tq, Dk]   queries          out      [B, H, Tq, Dv]
//   k   [B, H, Tk, Dk]   keys             weights  [B, H, Tq, Tk]   α, rows sum to 1
//   v   [B, H, Tk, Dv]   values           lse      [B, H, Tq]       log Σ_j exp(s_ij)
// B and H may be left out together or B alone: [Tq, Dk] and [H, Tq, Dk] are read as [1, 1, Tq, Dk]
// and [1, H, Tq, Dk]. q, k and v must have the same leading dims. Inputs may be strided; the last
// dim of each must be contiguous.
//
//   s_ij = scale · q_i·k_j + bias_ij      (−inf where the mask forbids key j)
//   α_ij = exp(s_ij − lse_i)              out_i = Σ_j α_ij v_j
//
// A row in which every key is masked has no distribution: qkv defines its output as 0, its lse as
// −inf, its α row as 0 and its gradients as 0, so that no NaN ever appears.
//
// The mask parts combine: a key is visible when it passes every part that is given.

#include <cstdint>
#include <optional>

#include "qkv/core/tensor.hpp"

namespace qkv {

template <class T>
struct AttentionMask {
  // Bottom-right aligned: query i sees key j iff j <= i + Tk - Tq. With a KV cache (Tq < Tk) the
  // last query sees every key; when Tq == Tk this is the usual lower triangle.
  bool causal = false;
  // Broadcastable to [B, H, Tq, Tk]; nonzero = may attend.
  std::optional<TensorView<const uint8_t>> allowed;
  // Broadcastable to [B, H, Tq, Tk]; added to the scaled scores. −inf masks a key.
  std::optional<TensorView<const T>> bias;
};

template <class T>
struct AttentionParams {
  TensorView<const T> q;  // [B, H, Tq, Dk]
  TensorView<const T> k;  // [B, H, Tk, Dk]
  TensorView<const T> v;  // [B, H, Tk, Dv]
  // Multiplies q·k before the bias is added; 1/sqrt(Dk) when not given.
  std::optional<double> scale;
  AttentionMask<T> mask;
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
  TensorView<T> dk;  // [B, H, Tk, Dk]
  TensorView<T> dv;  // [B, H, Tk, Dv]
  // Same shape as mask.bias; summed over the dims along which the bias was broadcast.
  std::optional<TensorView<T>> dbias;
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

// The scale used when params.scale is not given: 1/sqrt(Dk).
double default_scale(int64_t dk);

}  // namespace qkv
