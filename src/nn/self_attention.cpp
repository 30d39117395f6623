#include "qkv/nn/self_attention.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "qkv/core/error.hpp"

namespace qkv {
namespace {

void check_config(const SelfAttentionConfig& config) {
  if (config.n_heads < 1) throw ValueError(fmt::format("n_heads: expected at least 1, got {}", config.n_heads));
  if (config.d_model < 1) throw ValueError(fmt::format("d_model: expected at least 1, got {}", config.d_model));
  if (config.d_model % config.n_heads != 0) {
    throw ValueError(
        fmt::format("d_model: expected a multiple of n_heads ({}), got {} ({} features do not split into "
                    "{} equal heads)",
                    config.n_heads, config.d_model, config.d_model, config.n_heads));
  }
}

// A [T, D] view read as [1, T, D]; a [B, T, D] view unchanged.
template <class U>
TensorView<U> as_btd(TensorView<U> view) {
  if (view.rank() == 3) return view;
  return {view.data, Shape{1, view.shape[0], view.shape[1]}, {0, view.strides[0], view.strides[1], 0}};
}

// The [B, T, H·Dh] view `btd` seen as [B, H, T, Dh] without a copy: head h is features [h·Dh, (h+1)·Dh).
template <class U>
TensorView<U> split_heads(TensorView<U> btd, int64_t heads) {
  const int64_t dh = btd.shape[2] / heads;
  return {btd.data,
          Shape{btd.shape[0], heads, btd.shape[1], dh},
          {btd.strides[0], dh * btd.strides[2], btd.strides[1], btd.strides[2]}};
}

template <class U>
void copy_view(TensorView<const U> src, TensorView<U> dst) {
  const TensorView<const U> s = as_rank4(src);
  const TensorView<U> d = as_rank4(dst);
  for (int64_t a = 0; a < s.shape[0]; ++a)
    for (int64_t b = 0; b < s.shape[1]; ++b)
      for (int64_t c = 0; c < s.shape[2]; ++c)
        for (int64_t e = 0; e < s.shape[3]; ++e) d(a, b, c, e) = s(a, b, c, e);
}

// Gives `t` the shape `shape`, reallocating only when it differs; the contents are then undefined.
template <class U>
void ensure_shape(Tensor<U>& t, const Shape& shape) {
  if (!(t.shape() == shape)) t = Tensor<U>(shape);
}

template <class U>
void copy_into(Tensor<U>& dst, TensorView<const U> src) {
  ensure_shape(dst, src.shape);
  copy_view(src, dst.view());
}

// The attention problem of a forward, rebuilt from its cache for the backward.
template <class T>
AttentionParams<T> attention_params(const SelfAttentionConfig& config, const SelfAttentionCache<T>& cache) {
  AttentionMask<T> mask{.causal = cache.causal,
                        .alignment = cache.alignment,
                        .window = cache.window,
                        .allowed = std::nullopt,
                        .bias = std::nullopt};
  if (cache.mask_allowed) mask.allowed = cache.mask_allowed->view();
  if (cache.mask_bias) mask.bias = cache.mask_bias->view();
  if (cache.alibi_slopes) mask.alibi_slopes = cache.alibi_slopes->view();
  if (cache.cu_seqlens_q) mask.cu_seqlens_q = cache.cu_seqlens_q->view();
  if (cache.cu_seqlens_k) mask.cu_seqlens_k = cache.cu_seqlens_k->view();
  return {.q = cache.q.view(),
          .k = cache.k.view(),
          .v = cache.v.view(),
          .scale = std::nullopt,
          .mask = mask,
          .softcap = config.softcap};
}

}  // namespace

template <class T>
SelfAttention<T>::SelfAttention(const SelfAttentionConfig& config, Rng& rng) : config_(config) {
  check_config(config);
  const auto projection = [&](const char* suffix) {
    return Linear<T>({.in_features = config.d_model,
                      .out_features = config.d_model,
                      .bias = config.bias,
                      .weight_name = fmt::format("w_{}", suffix),
                      .bias_name = fmt::format("b_{}", suffix)},
                     rng);
  };
  query_ = projection("q");
  key_ = projection("k");
  value_ = projection("v");
  if (config.output_projection) output_ = projection("o");
}

template <class T>
Tensor<T> SelfAttention<T>::forward(TensorView<const T> x, SelfAttentionCache<T>& cache, const AttentionMask<T>& mask,
                                    std::optional<TensorView<T>> weights) const {
  const int64_t d = config_.d_model;
  const int64_t heads = config_.n_heads;
  if ((x.rank() != 2 && x.rank() != 3) || x.shape.from_back(1) != d) {
    throw ShapeError(fmt::format("x: expected shape [B, T, {}] or [T, {}], got {}", d, d, x.shape.str()));
  }
  copy_into(cache.x, x);
  const TensorView<const T> x3 = as_btd(cache.x.cview());
  const int64_t batch = x3.shape[0];
  const int64_t tokens = x3.shape[1];
  const Shape per_head{batch, heads, tokens, head_dim()};
  if (weights) {
    const Shape expected{batch, heads, tokens, tokens};
    if (weights->rank() < 3 || !(as_rank4(*weights).shape == expected)) {
      throw ShapeError(fmt::format("weights: expected shape {}, got {}", expected.str(), weights->shape.str()));
    }
  }

  // Each projection is computed token-major, then laid out head-major, as the attention reads it.
  Tensor<T> projected(x3.shape);
  const auto project = [&](const Linear<T>& p, Tensor<T>& dst) {
    p.forward(x3, projected.view());
    ensure_shape(dst, per_head);
    copy_view(split_heads(projected.cview(), heads), dst.view());
  };
  project(query_, cache.q);
  project(key_, cache.k);
  project(value_, cache.v);

  cache.causal = config_.causal || mask.causal;
  cache.alignment = mask.alignment;
  cache.window = mask.window;
  cache.mask_allowed.reset();
  cache.mask_bias.reset();
  cache.alibi_slopes.reset();
  cache.cu_seqlens_q.reset();
  cache.cu_seqlens_k.reset();
  if (mask.allowed) cache.mask_allowed = to_tensor<uint8_t, uint8_t>(*mask.allowed);
  if (mask.bias) cache.mask_bias = to_tensor<T, T>(*mask.bias);
  if (mask.alibi_slopes) cache.alibi_slopes = to_tensor<T, T>(*mask.alibi_slopes);
  if (mask.cu_seqlens_q) cache.cu_seqlens_q = to_tensor<int64_t, int64_t>(*mask.cu_seqlens_q);
  if (mask.cu_seqlens_k) cache.cu_seqlens_k = to_tensor<int64_t, int64_t>(*mask.cu_seqlens_k);

  ensure_shape(cache.context, x3.shape);
  ensure_shape(cache.lse, Shape{batch, heads, tokens});
  // With no token there is no score to normalise: context and y are empty.
  if (batch * tokens > 0) {
    const AttentionOutputs<T> outputs{.out = split_heads(cache.context.view(), heads),
                                      .weights = weights ? std::optional(as_rank4(*weights)) : std::nullopt,
                                      .lse = cache.lse.view()};
    attention_forward(attention_params(config_, cache), outputs);
  }

  Tensor<T> y(x.shape);
  if (config_.output_projection) {
    output_.forward(cache.context.cview(), as_btd(y.view()));
  } else {
    copy_view(cache.context.cview(), as_btd(y.view()));
  }
  return y;
}

// Back through the forward's steps in reverse; every step adds into what it is given:
//   y = C W_Oᵀ + b_O               ⇒ dC = dy W_O, dW_O += dyᵀ C, db_O += Σ dy   (dC = dy without W_O)
//   C = concat_h attention(Q_h, K_h, V_h) ⇒ dQ_h, dK_h, dV_h from attention_backward on dC's head h
//   Q = x W_Qᵀ + b_Q (K, V alike)  ⇒ dx += dQ W_Q + dK W_K + dV W_V, dW_Q += dQᵀ x, db_Q += Σ dQ, ...
template <class T>
void SelfAttention<T>::backward(const SelfAttentionCache<T>& cache, TensorView<const T> dy, TensorView<T> dx) {
  check_shape("dy", dy.shape, cache.x.shape());
  check_shape("dx", dx.shape, cache.x.shape());
  check_last_dim_contiguous(dy, "dy");
  const int64_t heads = config_.n_heads;
  const TensorView<const T> x3 = as_btd(cache.x.cview());
  const TensorView<const T> dy3 = as_btd(dy);
  const TensorView<T> dx3 = as_btd(dx);

  Tensor<T> dcontext_owned;
  TensorView<const T> dcontext = dy3;
  if (config_.output_projection) {
    dcontext_owned = Tensor<T>(x3.shape);
    output_.backward(cache.context.cview(), dy3, dcontext_owned.view());
    dcontext = dcontext_owned.cview();
  }

  Tensor<T> dq(cache.q.shape());
  Tensor<T> dk(cache.k.shape());
  Tensor<T> dv(cache.v.shape());
  if (x3.shape[0] * x3.shape[1] > 0) {
    const AttentionSaved<T> saved{.out = split_heads(cache.context.cview(), heads), .lse = cache.lse.view()};
    attention_backward(attention_params(config_, cache), split_heads(dcontext, heads),
                       {.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = std::nullopt},
                       std::optional<AttentionSaved<T>>(saved));
  }

  Tensor<T> dprojected(x3.shape);
  const auto project_back = [&](Linear<T>& p, const Tensor<T>& dheads) {
    copy_view(dheads.cview(), split_heads(dprojected.view(), heads));
    p.backward(x3, dprojected.cview(), dx3);
  };
  project_back(query_, dq);
  project_back(key_, dk);
  project_back(value_, dv);
}

template <class T>
void SelfAttention<T>::zero_grad() {
  for (Linear<T>* p : {&query_, &key_, &value_, &output_}) p->zero_grad();
}

// The two overloads differ only in constness; each is small enough to spell out.
template <class T>
std::vector<ParameterRef<T>> SelfAttention<T>::parameters() {
  std::vector<ParameterRef<T>> result;
  for (Linear<T>* p : {&query_, &key_, &value_, &output_}) {
    for (ParameterRef<T>& r : p->parameters()) result.push_back(r);
  }
  return result;
}

template <class T>
std::vector<ParameterRef<const T>> SelfAttention<T>::parameters() const {
  std::vector<ParameterRef<const T>> result;
  for (const Linear<T>* p : {&query_, &key_, &value_, &output_}) {
    for (ParameterRef<const T>& r : p->parameters()) result.push_back(r);
  }
  return result;
}

template struct SelfAttentionCache<float>;
template struct SelfAttentionCache<double>;
template class SelfAttention<float>;
template class SelfAttention<double>;

}  // namespace qkv
