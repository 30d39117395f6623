// The encoder block and model of encoder.hpp: forward and backward side by side.

#include "encoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "qkv/core/error.hpp"
#include "qkv/ops/residual.hpp"

namespace qkv::cli {
namespace {

void check_block_config(const EncoderBlockConfig& c) {
  if (c.dim < 1 || c.heads < 1 || c.ffn < 1) {
    throw ValueError(
        fmt::format("encoder block: expected dim, heads and ffn >= 1, got {}, {} and {}", c.dim, c.heads, c.ffn));
  }
  if (c.dim % c.heads != 0) {
    throw ValueError(fmt::format("encoder block: expected dim a multiple of heads ({}), got {}", c.heads, c.dim));
  }
}

template <class T>
TensorView<T> find_parameter(std::vector<ParameterRef<T>> params, const std::string& name) {
  for (ParameterRef<T>& p : params) {
    if (p.name == name) return p.value;
  }
  throw ValueError(fmt::format("encoder: expected a parameter named {}, found none", name));
}

template <class T>
void add_into(TensorView<const T> from, Tensor<T>& to) {
  residual_forward<T>(to.cview(), from, to.view());
}

}  // namespace

template <class T>
EncoderBlock<T>::EncoderBlock(const EncoderBlockConfig& config, Rng& rng)
    : config_((check_block_config(config), config)),
      ln1_(LayerNormConfig{.dim = config.dim}),
      ln2_(LayerNormConfig{.dim = config.dim}),
      attention_(SelfAttentionConfig{.d_model = config.dim, .n_heads = config.heads, .causal = config.causal}, rng),
      ffn1_({.in_features = config.dim, .out_features = config.ffn, .weight_name = "ffn.w1", .bias_name = "ffn.b1"},
            rng),
      ffn2_({.in_features = config.ffn, .out_features = config.dim, .weight_name = "ffn.w2", .bias_name = "ffn.b2"},
            rng) {}

template <class T>
Tensor<T> EncoderBlock<T>::forward(TensorView<const T> x, const AttentionMask<T>& mask,
                                   std::optional<TensorView<T>> weights,
                                   std::optional<std::span<const int64_t>> drop_value) {
  if (x.rank() != 3 || x.shape[2] != config_.dim) {
    throw ShapeError(fmt::format("x: expected shape [B, T, {}], got rank {} with last dim {}", config_.dim, x.rank(),
                                 x.rank() > 0 ? x.shape.from_back(1) : 0));
  }
  const int64_t batch = x.shape[0], length = x.shape[1], dim = config_.dim, heads = config_.heads;
  const Tensor<T> normed1 = ln1_.forward(x, ln1_cache_);
  Tensor<T> alpha;  // [B, H, T, T], when the caller wants α or a value is dropped
  if (drop_value && !weights) {
    alpha = Tensor<T>(Shape{batch, heads, length, length});
    weights = alpha.view();
  }
  Tensor<T> a = attention_.forward(normed1.cview(), attention_cache_, mask, weights);
  if (drop_value) {
    if (static_cast<int64_t>(drop_value->size()) != batch) {
      throw ShapeError(fmt::format("drop_value: expected {} positions, got {}", batch, drop_value->size()));
    }
    // Without v_j the head's output at query i loses α_ij v_j, and y_i loses W_O of that (the bias
    // b_O is not part of it).
    const TensorView<T> w_o = find_parameter(attention_.parameters(), "w_o");
    const int64_t head_dim = dim / heads;
    const Tensor<T>& v = attention_cache_.v;  // [B, H, T, Dh]
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t j = (*drop_value)[static_cast<size_t>(b)];
      if (j < 0) continue;
      if (j >= length)
        throw ValueError(fmt::format("drop_value[{}]: expected a position below {}, got {}", b, length, j));
      for (int64_t i = 0; i < length; ++i) {
        for (int64_t out = 0; out < dim; ++out) {
          double lost = 0.0;
          for (int64_t h = 0; h < heads; ++h) {
            const double weight = (*weights)(b, h, i, j);
            for (int64_t e = 0; e < head_dim; ++e) {
              lost += weight * static_cast<double>(w_o(out, h * head_dim + e)) *
                      static_cast<double>(v[((b * heads + h) * length + j) * head_dim + e]);
            }
          }
          a[(b * length + i) * dim + out] -= static_cast<T>(lost);
        }
      }
    }
  }
  add_into<T>(x, a);
  normed2_ = ln2_.forward(a.cview(), ln2_cache_);
  hidden_ = ffn1_.forward(normed2_.cview());
  for (T& h : hidden_.values()) h = std::max(h, T{0});
  Tensor<T> y = ffn2_.forward(hidden_.cview());
  add_into<T>(a.cview(), y);
  return y;
}

// Back through y = a + FFN(LN₂(a)), a = x + Attn(LN₁(x)): the residuals hand dy on unchanged
// (da = dy + ∂FFN-branch, dx = da + ∂Attn-branch); relu passes the gradient where its output is > 0.
template <class T>
void EncoderBlock<T>::backward(TensorView<const T> dy, TensorView<T> dx) {
  const Shape& shape = normed2_.shape();
  Tensor<T> dhidden(hidden_.shape());
  ffn2_.backward(hidden_.cview(), dy, dhidden.view());
  for (int64_t n = 0; n < dhidden.numel(); ++n) {
    if (!(hidden_[n] > T{0})) dhidden[n] = T{0};
  }
  Tensor<T> dnormed2(shape);
  ffn1_.backward(normed2_.cview(), dhidden.cview(), dnormed2.view());
  Tensor<T> da(shape);
  residual_forward<T>(dy, da.cview(), da.view());
  ln2_.backward(ln2_cache_, dnormed2.cview(), da.view());
  Tensor<T> dnormed1(shape);
  attention_.backward(attention_cache_, da.cview(), dnormed1.view());
  ln1_.backward(ln1_cache_, dnormed1.cview(), dx);
  residual_backward<T>(da.cview(), {.da = dx});
}

template <class T>
void EncoderBlock<T>::zero_grad() {
  ln1_.zero_grad();
  ln2_.zero_grad();
  attention_.zero_grad();
  ffn1_.zero_grad();
  ffn2_.zero_grad();
}

template <class T>
std::vector<ParameterRef<T>> EncoderBlock<T>::parameters() {
  std::vector<ParameterRef<T>> out;
  const auto add = [&](std::vector<ParameterRef<T>> refs, const std::string& prefix) {
    for (ParameterRef<T>& r : refs) out.push_back({prefix + r.name, r.value, r.grad});
  };
  add(ln1_.parameters(), "ln1.");
  add(attention_.parameters(), "attn.");
  add(ln2_.parameters(), "ln2.");
  for (Linear<T>* ffn : {&ffn1_, &ffn2_}) {
    for (ParameterRef<T>& r : ffn->parameters()) out.push_back(r);
  }
  return out;
}

template <class T>
EncoderModel<T>::EncoderModel(const EncoderModelConfig& config, Rng& rng)
    : config_(config),
      tokens_(EmbeddingConfig{.num_embeddings = config.vocabulary, .dim = config.block.dim}, rng),
      positions_(Shape{std::max<int64_t>(config.max_length, 1), config.block.dim}),
      final_norm_(LayerNormConfig{.dim = config.block.dim}) {
  if (config.max_length < 1 || config.classes < 1 || config.layers < 1) {
    throw ValueError(fmt::format("encoder model: expected max_length, classes and layers >= 1, got {}, {} and {}",
                                 config.max_length, config.classes, config.layers));
  }
  rng.fill_normal(positions_.value.view(), 0.0, 0.02);
  blocks_.reserve(static_cast<size_t>(config.layers));
  for (int64_t l = 0; l < config.layers; ++l) blocks_.emplace_back(config.block, rng);
  head_ = Linear<T>({.in_features = config.block.dim,
                     .out_features = config.classes,
                     .weight_name = "head.weight",
                     .bias_name = "head.bias"},
                    rng);
}

template <class T>
Tensor<T> EncoderModel<T>::forward(TensorView<const int64_t> ids, const AttentionMask<T>& mask,
                                   std::span<const TensorView<T>> weights,
                                   std::optional<std::span<const int64_t>> drop_value, int64_t drop_layer) {
  if (ids.rank() != 2 || ids.shape[1] < 1 || ids.shape[1] > config_.max_length) {
    throw ShapeError(
        fmt::format("ids: expected shape [B, T] with 1 <= T <= {}, got rank {}", config_.max_length, ids.rank()));
  }
  if (!weights.empty() && static_cast<int64_t>(weights.size()) != config_.layers) {
    throw ShapeError(fmt::format("weights: expected one view per layer ({}), got {}", config_.layers, weights.size()));
  }
  const int64_t batch = ids.shape[0], length = ids.shape[1], dim = config_.block.dim;
  Tensor<T> x = tokens_.forward(ids, token_cache_);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < length * dim; ++n) x[b * length * dim + n] += positions_.value[n];
  }
  for (int64_t l = 0; l < config_.layers; ++l) {
    std::optional<TensorView<T>> w;
    if (!weights.empty()) w = weights[static_cast<size_t>(l)];
    x = blocks_[static_cast<size_t>(l)].forward(x.cview(), mask, w, l == drop_layer ? drop_value : std::nullopt);
  }
  normed_ = final_norm_.forward(x.cview(), final_cache_);
  return head_.forward(normed_.cview());
}

template <class T>
void EncoderModel<T>::backward(TensorView<const T> dlogits) {
  const Shape& shape = normed_.shape();
  Tensor<T> dnormed(shape);
  head_.backward(normed_.cview(), dlogits, dnormed.view());
  Tensor<T> dx(shape);
  final_norm_.backward(final_cache_, dnormed.cview(), dx.view());
  for (int64_t l = config_.layers - 1; l >= 0; --l) {
    Tensor<T> dprev(shape);
    blocks_[static_cast<size_t>(l)].backward(dx.cview(), dprev.view());
    dx = std::move(dprev);
  }
  const int64_t batch = shape[0], per_sequence = shape[1] * shape[2];
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < per_sequence; ++n) positions_.grad[n] += dx[b * per_sequence + n];
  }
  tokens_.backward(token_cache_, dx.cview());
}

template <class T>
void EncoderModel<T>::zero_grad() {
  for (ParameterRef<T>& p : parameters()) std::fill(p.grad.data, p.grad.data + p.grad.numel(), T{0});
}

template <class T>
std::vector<ParameterRef<T>> EncoderModel<T>::parameters() {
  std::vector<ParameterRef<T>> out;
  for (ParameterRef<T>& r : tokens_.parameters()) out.push_back({"tokens." + r.name, r.value, r.grad});
  out.push_back(positions_.ref("positions"));
  for (size_t l = 0; l < blocks_.size(); ++l) {
    for (ParameterRef<T>& r : blocks_[l].parameters())
      out.push_back({fmt::format("block{}.{}", l, r.name), r.value, r.grad});
  }
  for (ParameterRef<T>& r : final_norm_.parameters()) out.push_back({"ln_f." + r.name, r.value, r.grad});
  for (ParameterRef<T>& r : head_.parameters()) out.push_back(r);
  return out;
}

template <class T>
int64_t EncoderModel<T>::parameter_count() {
  int64_t count = 0;
  for (const ParameterRef<T>& p : parameters()) count += p.value.numel();
  return count;
}

template class EncoderBlock<float>;
template class EncoderBlock<double>;
template class EncoderModel<float>;
template class EncoderModel<double>;

}  // namespace qkv::cli
