#pragma once
// A small Transformer encoder built from qkv's layers, with explicit forward and backward passes
// (no autograd), for the coref and encoder-lm experiments.
//
// One block (pre-LayerNorm, as GPT-2 orders it; it trains without warm-up at these sizes):
//   a = x + SelfAttention(LN₁(x))                          [B, T, D]
//   y = a + W₂ relu(W₁ LN₂(a) + b₁) + b₂                   [B, T, D], W₁ [F, D], W₂ [D, F]
// The model: token embedding plus a learned position embedding, N blocks, a final LayerNorm and a
// linear head at every position:
//   x₀[b, t] = E[ids[b, t]] + P[t]      logits = W_C LN(x_N) + b_C      [B, T, C]
// The residual stream carries each token's own embedding to the head; attention is the only path
// between positions (causal for a language model: position t sees 0..t).

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/nn/embedding.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/self_attention.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/layer_norm.hpp"

namespace qkv::cli {

struct EncoderBlockConfig {
  int64_t dim = 0;      // D: features per token; a multiple of heads
  int64_t heads = 1;    // H
  int64_t ffn = 0;      // F: width of the feed-forward layer
  bool causal = false;  // token t attends to tokens 0..t only
};

template <class T>
class EncoderBlock {
 public:
  // Throws ValueError for dim, heads or ffn < 1, or dim not a multiple of heads. Draws the
  // attention's parameters, then W₁, b₁, W₂, b₂ as torch.nn.Linear would.
  EncoderBlock(const EncoderBlockConfig& config, Rng& rng);

  const EncoderBlockConfig& config() const { return config_; }

  // x [B, T, D] → y [B, T, D]. `mask` (AttentionMask semantics, broadcastable to [B, H, T, T])
  // combines with config.causal. `weights` [B, H, T, T], when given, receives α.
  // `drop_value` [B], when given, names per sequence a position j (or −1 for none) whose value vector
  // v_j = W_V LN₁(x_j) + b_V is zeroed in every head: the attention output of each query i loses
  // α_ij v_j. A forward with drop_value is for measurement only: backward must not follow it.
  Tensor<T> forward(TensorView<const T> x, const AttentionMask<T>& mask = {},
                    std::optional<TensorView<T>> weights = std::nullopt,
                    std::optional<std::span<const int64_t>> drop_value = std::nullopt);

  // dy [B, T, D] = ∂L/∂y of the last forward → dx [B, T, D] += ∂L/∂x; parameter gradients += theirs.
  void backward(TensorView<const T> dy, TensorView<T> dx);

  void zero_grad();

  // The attention's parameters ("attn.w_q", ...), the LayerNorms' ("ln1.weight", ...) and the
  // feed-forward's ("ffn.w1", "ffn.b1", "ffn.w2", "ffn.b2").
  std::vector<ParameterRef<T>> parameters();

 private:
  EncoderBlockConfig config_;
  LayerNorm<T> ln1_, ln2_;
  SelfAttention<T> attention_;
  Linear<T> ffn1_, ffn2_;  // W₁, b₁ and W₂, b₂
  // The forward's intermediates, [B, T, D] unless noted.
  LayerNormCache<T> ln1_cache_, ln2_cache_;
  SelfAttentionCache<T> attention_cache_;
  Tensor<T> normed2_;  // LN₂(a)
  Tensor<T> hidden_;   // [B, T, F]: relu(W₁ LN₂(a) + b₁)
};

struct EncoderModelConfig {
  int64_t vocabulary = 0;  // ids run over [0, V)
  int64_t classes = 0;     // C: outputs of the head at each position
  int64_t max_length = 0;  // rows of the position table: the longest T
  int64_t layers = 1;
  EncoderBlockConfig block;
};

template <class T>
class EncoderModel {
 public:
  // Draws the token table, then the positions (N(0, 0.02²), as GPT-2), the blocks, the head.
  EncoderModel(const EncoderModelConfig& config, Rng& rng);

  const EncoderModelConfig& config() const { return config_; }

  // ids [B, T] (T <= max_length) → logits [B, T, C]. `mask` applies in every layer. `weights`, when
  // given, holds one [B, H, T, T] view per layer. `drop_value` ([B] positions or −1) applies in
  // layer `drop_layer` only, as EncoderBlock::forward describes (measurement only).
  Tensor<T> forward(TensorView<const int64_t> ids, const AttentionMask<T>& mask = {},
                    std::span<const TensorView<T>> weights = {},
                    std::optional<std::span<const int64_t>> drop_value = std::nullopt, int64_t drop_layer = 0);

  // dlogits [B, T, C] → every parameter gradient += its share.
  void backward(TensorView<const T> dlogits);

  void zero_grad();
  std::vector<ParameterRef<T>> parameters();
  int64_t parameter_count();

 private:
  EncoderModelConfig config_;
  Embedding<T> tokens_;
  Parameter<T> positions_;  // [max_length, D]
  std::vector<EncoderBlock<T>> blocks_;
  LayerNorm<T> final_norm_;
  Linear<T> head_;  // W_C [C, D], b_C [C]; built last, after the blocks have drawn
  EmbeddingCache<T> token_cache_;
  LayerNormCache<T> final_cache_;
  Tensor<T> normed_;  // LN(x_N) [B, T, D]
};

}  // namespace qkv::cli
