#pragma once
// The two models of `qkv experiment encoder-lm` behind one interface: a causal Transformer encoder
// (encoder.hpp) and a GRU of about the same size.

#include <cstdint>
#include <vector>

#include "encoder.hpp"
#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/nn/embedding.hpp"
#include "qkv/nn/gru.hpp"
#include "qkv/nn/linear.hpp"

namespace qkv::cli {

// A language model over windows: ids [B, T] → logits [B, T, V], then backward from dlogits. The
// runs use float; tests/apps/test_encoder_block.cpp checks the backward in double.
template <class T>
class LanguageModel {
 public:
  virtual ~LanguageModel() = default;
  virtual Tensor<T> forward(const Tensor<int64_t>& ids) = 0;
  // dlogits [B, T, V] of the last forward → every parameter's gradient += its share.
  virtual void backward(const Tensor<T>& dlogits) = 0;
  virtual std::vector<ParameterRef<T>> parameters() = 0;
};

template <class T>
class AttentionLm : public LanguageModel<T> {
 public:
  AttentionLm(const EncoderModelConfig& config, Rng& rng) : model_(config, rng) {}
  Tensor<T> forward(const Tensor<int64_t>& ids) override { return model_.forward(ids.cview()); }
  void backward(const Tensor<T>& dlogits) override { model_.backward(dlogits.cview()); }
  std::vector<ParameterRef<T>> parameters() override { return model_.parameters(); }
  // ids [1, T] → each layer's α [1, H, T, T], from the input up.
  std::vector<Tensor<T>> attention(const Tensor<int64_t>& ids) {
    std::vector<Tensor<T>> alpha;
    std::vector<TensorView<T>> views;
    const int64_t t = ids.shape()[1];
    for (int64_t l = 0; l < model_.config().layers; ++l)
      alpha.emplace_back(Shape{1, model_.config().block.heads, t, t});
    for (Tensor<T>& a : alpha) views.push_back(a.view());
    model_.forward(ids.cview(), {}, views);
    return alpha;
  }

 private:
  EncoderModel<T> model_;
};

// Embedding [V, E] → GRU (E → H) → head [V, H] at every position.
template <class T>
class GruLm : public LanguageModel<T> {
 public:
  GruLm(int64_t vocabulary, int64_t embed, int64_t hidden, Rng& rng)
      : embedding_({.num_embeddings = vocabulary, .dim = embed}, rng),
        gru_({.input_size = embed, .hidden_size = hidden}, rng),
        head_(
            {.in_features = hidden, .out_features = vocabulary, .weight_name = "head.weight", .bias_name = "head.bias"},
            rng) {}
  Tensor<T> forward(const Tensor<int64_t>& ids) override {
    x_ = embedding_.forward(ids.cview(), embedding_cache_);
    h_ = gru_.forward({.x = x_.cview()}, gru_cache_).y;
    return head_.forward(h_.cview());
  }
  void backward(const Tensor<T>& dlogits) override {
    Tensor<T> dh(h_.shape());
    head_.backward(h_.cview(), dlogits.cview(), dh.view());
    Tensor<T> dx(x_.shape());
    gru_.backward(gru_cache_, {.dy = dh.cview()}, {.dx = dx.view()});
    embedding_.backward(embedding_cache_, dx.cview());
  }
  std::vector<ParameterRef<T>> parameters() override {
    std::vector<ParameterRef<T>> out = embedding_.parameters();
    for (ParameterRef<T>& p : gru_.parameters()) out.push_back(p);
    for (ParameterRef<T>& p : head_.parameters()) out.push_back(p);
    return out;
  }

 private:
  Embedding<T> embedding_;
  EmbeddingCache<T> embedding_cache_;
  Gru<T> gru_;
  GruCache<T> gru_cache_;
  Linear<T> head_;
  Tensor<T> x_, h_;  // the forward's embeddings [B, T, E] and GRU states [B, T, H], for backward
};

}  // namespace qkv::cli
