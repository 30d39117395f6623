#pragma once
// Multi-head self-attention, as a layer with owned parameters: forward, backward, initialisation.
//
// Shapes: x [B, T, d_model] or [T, d_model] (read as B = 1); H = n_heads, Dh = d_model / H.
//   Q = x W_Qᵀ + b_Q,  K = x W_Kᵀ + b_K,  V = x W_Vᵀ + b_V          each [B, T, d_model]
//   head h takes features [h·Dh, (h+1)·Dh) of Q, K and V             [B, H, T, Dh]
//   O_h = attention(Q_h, K_h, V_h)  (qkv::attention_forward, scale 1/√Dh)
//   C = concat_h O_h                                                 [B, T, d_model]
//   y = C W_Oᵀ + b_O  with the output projection, y = C without       [B, T, d_model]
// Every W is [d_model, d_model] and every b [d_model]; the biases exist when config.bias is set.

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv {

struct SelfAttentionConfig {
  int64_t d_model = 0;            // features per token; a multiple of n_heads
  int64_t n_heads = 1;            // heads, each of d_model / n_heads features
  bool bias = true;               // b_Q, b_K, b_V (and b_O) are added
  bool output_projection = true;  // W_O (and b_O) map the concatenated heads to y
  bool causal = false;            // token t attends to tokens 0..t only
  // c > 0: the scaled scores become c·tanh(s / c) (AttentionParams::softcap).
  std::optional<double> softcap = std::nullopt;
};

// What the forward leaves for the backward: exactly the tensors the backward reads. A cache may be
// reused across calls; its tensors are reallocated only when the shapes change.
template <class T>
struct SelfAttentionCache {
  Tensor<T> x;        // [B, T, d_model] or [T, d_model]: the input, as given
  Tensor<T> q;        // [B, H, T, Dh]: the queries, split into heads
  Tensor<T> k;        // [B, H, T, Dh]
  Tensor<T> v;        // [B, H, T, Dh]
  Tensor<T> context;  // [B, T, d_model]: the heads' attention outputs concatenated (C, the input of W_O)
  Tensor<T> lse;      // [B, H, T]: each query's log-sum-exp of scores; −inf for a fully masked row
  // The mask of the forward, copied so that the backward sees the same one; shapes as given.
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::bottom_right;
  std::optional<AttentionWindow> window;
  std::optional<Tensor<uint8_t>> mask_allowed;
  std::optional<Tensor<T>> mask_bias;
  std::optional<Tensor<T>> alibi_slopes;
  std::optional<Tensor<int64_t>> cu_seqlens_q, cu_seqlens_k;
};

template <class T>
class SelfAttention {
 public:
  // Throws ValueError when n_heads < 1, d_model < 1 or d_model is not a multiple of n_heads.
  // Every projection is initialised as a fresh torch.nn.Linear(d_model, d_model) would be, in the
  // order W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, b_O; gradients start at zero.
  SelfAttention(const SelfAttentionConfig& config, Rng& rng);

  const SelfAttentionConfig& config() const { return config_; }
  int64_t head_dim() const { return config_.d_model / config_.n_heads; }

  // x [B, T, d_model] or [T, d_model] → y of x's shape. `mask` (AttentionMask semantics, its parts
  // broadcastable to [B, H, T, T]: window, alignment, ALiBi, packed sequences along T of a [T,
  // d_model] x) combines with config.causal; its tensors are copied into the cache. `weights` [B, H, T, T] ([H, T, T]
  // or [1, H, T, T] for a rank-2 x), when given, receives α.
  Tensor<T> forward(TensorView<const T> x, SelfAttentionCache<T>& cache, const AttentionMask<T>& mask = {},
                    std::optional<TensorView<T>> weights = std::nullopt) const;

  // dy [x's shape] = ∂L/∂y → dx [x's shape] += ∂L/∂x; every parameter gradient += its ∂L/∂W.
  void backward(const SelfAttentionCache<T>& cache, TensorView<const T> dy, TensorView<T> dx);

  // Sets every parameter gradient to 0.
  void zero_grad();

  // The parameters present under this config, in the order W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, b_O,
  // named "w_q", "b_q", ..., "w_o", "b_o".
  std::vector<ParameterRef<T>> parameters();
  std::vector<ParameterRef<const T>> parameters() const;

 private:
  SelfAttentionConfig config_;
  // Each [d_model, d_model] with its optional bias [d_model]; output_ is empty without the output
  // projection.
  Linear<T> query_, key_, value_, output_;
};

}  // namespace qkv
