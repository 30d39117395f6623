#pragma once
// Additive (Bahdanau) attention, forward and backward: the score of a query and a key is a small
// one-hidden-layer network instead of a dot product, so queries and keys may have different widths.
//
// Shapes (the vocabulary of attention.hpp, plus Dq and A):
//   q    [B, H, Tq, Dq]   queries          out      [B, H, Tq, Dv]
//   k    [B, H, Tk, Dk]   keys             weights  [B, H, Tq, Tk]   α, rows sum to 1
//   v    [B, H, Tk, Dv]   values           lse      [B, H, Tq]       log Σ_j exp(e_ij)
//   w_q  [A, Dq]          query projection    A = attention hidden size; the three weights are
//   w_k  [A, Dk]          key projection      shared by every batch and head
//   w    [A]              score vector
// B and H may be left out together or B alone, exactly as in attention.hpp; q, k and v must have the
// same leading dims. Inputs may be strided; the last dim of each must be contiguous.
//
//   e_ij = wᵀ tanh(W_q q_i + W_k k_j) + bias_ij      (−inf where the mask forbids key j)
//   α_ij = exp(e_ij − lse_i)                         out_i = Σ_j α_ij v_j
//
// There is no 1/sqrt(D) scale: |e_ij − bias_ij| <= Σ_a |w_a| whatever the inputs, because tanh
// saturates. The mask is qkv::AttentionMask with its meaning in attention.hpp (causal is bottom-right
// aligned; allowed and bias broadcast to [B, H, Tq, Tk]). A row in which every key is masked has
// output 0, lse −inf, α row 0 and zero gradients, never NaN.
//
// These are reference implementations: plain loops with float64 accumulation, one (batch, head) at
// a time, materialising that head's Tq×Tk scores. They refuse up front (ResourceError) a problem
// whose per-head float64 buffers would not fit in the memory available.

#include <optional>

#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv {

template <class T>
struct AdditiveAttentionParams {
  TensorView<const T> q;    // [B, H, Tq, Dq]
  TensorView<const T> k;    // [B, H, Tk, Dk]
  TensorView<const T> v;    // [B, H, Tk, Dv]
  TensorView<const T> w_q;  // [A, Dq], maps a query into the hidden space
  TensorView<const T> w_k;  // [A, Dk], maps a key into the hidden space
  TensorView<const T> w;    // [A], reads a score off the hidden activation
  AttentionMask<T> mask;    // bias is added to e_ij
};

// Accumulated by the backward (+=): callers zero them first, or sum gradients across calls.
template <class T>
struct AdditiveAttentionGradients {
  TensorView<T> dq;    // [B, H, Tq, Dq]
  TensorView<T> dk;    // [B, H, Tk, Dk]
  TensorView<T> dv;    // [B, H, Tk, Dv]
  TensorView<T> dw_q;  // [A, Dq], summed over every batch and head
  TensorView<T> dw_k;  // [A, Dk], summed over every batch and head
  TensorView<T> dw;    // [A], summed over every batch and head
  // Same shape as mask.bias; summed over the dims along which the bias was broadcast. Giving it
  // without mask.bias is a ShapeError.
  std::optional<TensorView<T>> dbias;
};

// Writes outputs.out [B, H, Tq, Dv] and, when given, outputs.weights [B, H, Tq, Tk] and
// outputs.lse [B, H, Tq] (overwritten; same leading dims as q).
template <class T>
void additive_attention_forward(const AdditiveAttentionParams<T>& params, const AttentionOutputs<T>& outputs);

// Gradients of L = <dout, out> (dout [B, H, Tq, Dv]) with respect to q, k, v, the three weights and
// the bias, recomputed from the inputs in float64 and added into grads.
template <class T>
void additive_attention_backward(const AdditiveAttentionParams<T>& params, TensorView<const T> dout,
                                 const AdditiveAttentionGradients<T>& grads);

}  // namespace qkv
