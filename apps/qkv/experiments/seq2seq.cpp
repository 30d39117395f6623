#include "seq2seq.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>

#include "qkv/core/error.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/cross_entropy.hpp"
#include "qkv/ops/linear.hpp"
#include "qkv/ops/softmax.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv::cli {
namespace {

constexpr std::string_view kSpecials[] = {"<pad>", "<bos>", "<eos>"};

// x[:, t, :] of x [B, T, D], copied: [B, D].
template <class T>
Tensor<T> time_slice(const Tensor<T>& x, int64_t t) {
  const int64_t batch = x.shape()[0], steps = x.shape()[1], width = x.shape()[2];
  Tensor<T> out(Shape{batch, width});
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(x.data() + (b * steps + t) * width, width, out.data() + b * width);
  }
  return out;
}

// dst[b, offset .. offset + D) = src[b, :] for src [B, D] and dst [B, W].
template <class T>
void put_columns(TensorView<const T> src, Tensor<T>& dst, int64_t offset) {
  const int64_t width = dst.shape()[1];
  for (int64_t b = 0; b < src.shape[0]; ++b) {
    for (int64_t d = 0; d < src.shape[1]; ++d) dst[b * width + offset + d] = src(b, d);
  }
}

// dst[b, :] += src[b, offset .. offset + D) for src [B, W] and dst [B, D].
template <class T>
void add_columns(const Tensor<T>& src, int64_t offset, TensorView<T> dst) {
  const int64_t width = src.shape()[1];
  for (int64_t b = 0; b < dst.shape[0]; ++b) {
    for (int64_t d = 0; d < dst.shape[1]; ++d) dst(b, d) += src[b * width + offset + d];
  }
}

template <class T>
void add_into(TensorView<T> dst, const Tensor<T>& src) {
  const TensorView<T> d4 = as_rank4(dst);
  const TensorView<const T> s4 = as_rank4(src.cview());
  for (int64_t a = 0; a < d4.shape[0]; ++a)
    for (int64_t b = 0; b < d4.shape[1]; ++b)
      for (int64_t c = 0; c < d4.shape[2]; ++c)
        for (int64_t e = 0; e < d4.shape[3]; ++e) d4(a, b, c, e) += s4(a, b, c, e);
}

template <class T>
std::vector<ParameterRef<T>> prefixed(std::string_view prefix, std::vector<ParameterRef<T>> params) {
  for (ParameterRef<T>& p : params) p.name = fmt::format("{}.{}", prefix, p.name);
  return params;
}

template <class T>
void append(std::vector<T>& all, std::vector<T> more) {
  for (T& p : more) all.push_back(std::move(p));
}

void check_positive(std::string_view field, int64_t value) {
  if (value < 1) throw ValueError(fmt::format("{}: expected at least 1, got {}", field, value));
}

}  // namespace

// ---- Vocabulary ---------------------------------------------------------------------------------

Vocabulary::Vocabulary(std::vector<std::string> words) {
  for (const std::string_view special : kSpecials) {
    ids_.emplace(std::string(special), static_cast<int64_t>(words_.size()));
    words_.emplace_back(special);
  }
  for (std::string& w : words) {
    if (w.empty() || w.find_first_of(" \t\n\r\f\v") != std::string::npos) {
      throw ValueError(fmt::format("vocabulary: expected words without whitespace, got \"{}\"", w));
    }
    if (!ids_.emplace(w, static_cast<int64_t>(words_.size())).second) {
      throw ValueError(fmt::format("vocabulary: \"{}\" appears twice (or is a special token)", w));
    }
    words_.push_back(std::move(w));
  }
}

std::optional<int64_t> Vocabulary::find(std::string_view w) const {
  const auto it = ids_.find(std::string(w));
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

std::vector<int64_t> Vocabulary::encode(const std::vector<std::string>& words, std::string_view what) const {
  std::vector<int64_t> ids;
  for (const std::string& w : words) {
    const std::optional<int64_t> id = find(w);
    if (!id || *id <= kEosId) {
      throw ValueError(fmt::format("{}: unknown word \"{}\" (the model knows: {})", what, w, joined()));
    }
    ids.push_back(*id);
  }
  return ids;
}

std::vector<std::string> Vocabulary::decode(const std::vector<int64_t>& ids) const {
  std::vector<std::string> words;
  words.reserve(ids.size());
  for (const int64_t id : ids) words.push_back(id >= 0 && id < size() ? word(id) : fmt::format("<{}?>", id));
  return words;
}

std::string Vocabulary::joined() const {
  std::string text;
  for (size_t i = std::size(kSpecials); i < words_.size(); ++i) text += (text.empty() ? "" : " ") + words_[i];
  return text;
}

std::string_view score_name(Score score) {
  switch (score) {
    case Score::none:
      return "none";
    case Score::additive:
      return "additive";
    case Score::scaled_dot:
      return "dot";
  }
  return "?";
}

std::optional<Score> score_from_name(std::string_view name) {
  for (const Score s : {Score::none, Score::additive, Score::scaled_dot}) {
    if (score_name(s) == name) return s;
  }
  return std::nullopt;
}

Seq2SeqBatch make_seq2seq_batch(const std::vector<std::vector<int64_t>>& sources,
                                const std::vector<std::vector<int64_t>>& targets) {
  if (sources.empty()) throw ValueError("sources: expected at least one sentence, got none");
  if (sources.size() != targets.size()) {
    throw ValueError(
        fmt::format("targets: expected {} sentences (one per source), got {}", sources.size(), targets.size()));
  }
  const auto batch = static_cast<int64_t>(sources.size());
  int64_t ts = 0, tt = 0;
  for (size_t b = 0; b < sources.size(); ++b) {
    if (sources[b].empty()) throw ValueError(fmt::format("sources: sentence {} is empty", b));
    ts = std::max(ts, static_cast<int64_t>(sources[b].size()));
    tt = std::max(tt, static_cast<int64_t>(targets[b].size()) + 1);
  }
  Seq2SeqBatch out{.source = Tensor<int64_t>(Shape{batch, ts}, kPadId),
                   .source_lengths = Tensor<int64_t>(Shape{batch}),
                   .decoder_input = Tensor<int64_t>(Shape{batch, tt}, kPadId),
                   .decoder_target = Tensor<int64_t>(Shape{batch, tt}, kIgnoreTarget)};
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<int64_t>& src = sources[static_cast<size_t>(b)];
    const std::vector<int64_t>& tgt = targets[static_cast<size_t>(b)];
    std::copy(src.begin(), src.end(), out.source.data() + b * ts);
    out.source_lengths[b] = static_cast<int64_t>(src.size());
    out.decoder_input[b * tt] = kBosId;
    for (size_t i = 0; i < tgt.size(); ++i) {
      out.decoder_input[b * tt + static_cast<int64_t>(i) + 1] = tgt[i];
      out.decoder_target[b * tt + static_cast<int64_t>(i)] = tgt[i];
    }
    out.decoder_target[b * tt + static_cast<int64_t>(tgt.size())] = kEosId;
  }
  return out;
}

// ---- DecoderAttention ---------------------------------------------------------------------------

template <class Scalar>
DecoderAttention<Scalar>::DecoderAttention(Score score, int64_t query_size, int64_t key_size, int64_t hidden, Rng& rng)
    : score_(score), query_size_(query_size), key_size_(key_size), hidden_(hidden) {
  if (score == Score::additive) {
    query_ =
        Linear<Scalar>({.in_features = query_size, .out_features = hidden, .bias = false, .weight_name = "w_q"}, rng);
    key_ = Linear<Scalar>({.in_features = key_size, .out_features = hidden, .bias = false, .weight_name = "w_k"}, rng);
    w_ = Parameter<Scalar>(Shape{hidden});
    const double bound = linear_init_bound(hidden);
    rng.fill_uniform(w_.value.view(), -bound, bound);
  } else if (score == Score::scaled_dot) {
    query_ = Linear<Scalar>(
        {.in_features = query_size, .out_features = key_size, .weight_name = "w_q", .bias_name = "b_q"}, rng);
  }
}

template <class Scalar>
void DecoderAttention<Scalar>::prepare(EncoderMemory<Scalar>& memory) const {
  if (score_ != Score::additive) return;
  const Shape& shape = memory.annotations.shape();
  memory.keys = Tensor<Scalar>(Shape{shape[0], shape[1], hidden_});
  key_.forward(memory.annotations.cview(), memory.keys.view());
}

template <class Scalar>
void DecoderAttention<Scalar>::prepare_backward(const EncoderMemory<Scalar>& memory,
                                                EncoderMemoryGradients<Scalar>& dmemory) {
  if (score_ != Score::additive) return;
  key_.backward(memory.annotations.cview(), dmemory.keys.cview(), dmemory.annotations.view());
}

// Additive scoring with the keys W_k h_j precomputed, one batch entry at a time:
//   p = W_q s,  t_ja = tanh(p_a + (W_k h_j)_a),  e_j = Σ_a w_a t_ja,  α = softmax_{j < len}(e),
//   c = Σ_j α_j h_j
// Positions past the length get α = 0 and are never scored, so padding costs nothing.
template <class Scalar>
void DecoderAttention<Scalar>::forward(const EncoderMemory<Scalar>& memory, TensorView<const Scalar> s,
                                       AttentionStepCache<Scalar>& cache, TensorView<Scalar> context) const {
  const int64_t batch = memory.annotations.shape()[0], ts = memory.annotations.shape()[1];
  const int64_t width = memory.annotations.shape()[2];
  check_shape("s", s.shape, Shape{batch, query_size_});
  check_shape("context", context.shape, Shape{batch, width});
  cache.alpha = Tensor<Scalar>(Shape{batch, ts});
  if (score_ == Score::none) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t d = 0; d < width; ++d) context(b, d) = memory.summary[b * width + d];
    }
    return;
  }
  cache.query_state = to_tensor<Scalar, Scalar>(s);
  if (score_ == Score::scaled_dot) {
    cache.query = Tensor<Scalar>(Shape{batch, 1, 1, width});
    query_.forward(s, make_view(cache.query.data(), Shape{batch, width}));
    const TensorView<const Scalar> keys = as_b1td(memory.annotations.cview());
    AttentionParams<Scalar> params{.q = cache.query.cview(), .k = keys, .v = keys, .scale = std::nullopt, .mask = {}};
    params.mask.allowed = memory.allowed.cview();
    attention_forward_reference<Scalar>(params, {.out = as_b11d(context),
                                                 .weights = make_view(cache.alpha.data(), Shape{batch, 1, 1, ts}),
                                                 .lse = std::nullopt});
    return;
  }
  cache.query = Tensor<Scalar>(Shape{batch, hidden_});
  query_.forward(s, cache.query.view());
  cache.hidden = Tensor<Scalar>(Shape{batch, ts, hidden_});
  std::vector<double> scores(static_cast<size_t>(ts)), weights(static_cast<size_t>(ts)),
      row(static_cast<size_t>(width));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = memory.lengths[static_cast<size_t>(b)];
    for (int64_t j = 0; j < len; ++j) {
      const Scalar* key = memory.keys.data() + (b * ts + j) * hidden_;
      Scalar* t = cache.hidden.data() + (b * ts + j) * hidden_;
      double e = 0.0;
      for (int64_t a = 0; a < hidden_; ++a) {
        const double value = std::tanh(static_cast<double>(cache.query[b * hidden_ + a]) + static_cast<double>(key[a]));
        t[a] = static_cast<Scalar>(value);
        e += static_cast<double>(w_.value[a]) * value;
      }
      scores[static_cast<size_t>(j)] = e;
    }
    const auto scored = static_cast<size_t>(len);
    softmax<double>(std::span<const double>(scores).first(scored), std::span<double>(weights).first(scored));
    std::fill(row.begin(), row.end(), 0.0);
    for (int64_t j = 0; j < len; ++j) {
      const double alpha = weights[static_cast<size_t>(j)];
      cache.alpha[b * ts + j] = static_cast<Scalar>(alpha);
      const Scalar* h = memory.annotations.data() + (b * ts + j) * width;
      for (int64_t d = 0; d < width; ++d) row[static_cast<size_t>(d)] += alpha * static_cast<double>(h[d]);
    }
    for (int64_t d = 0; d < width; ++d) context(b, d) = static_cast<Scalar>(row[static_cast<size_t>(d)]);
  }
}

// Additive backward, from c = Σ_j α_j h_j and the forward above:
//   dh_j  += α_j dc                       dα_j = <dc, h_j>
//   de_j   = α_j (dα_j − Σ_l α_l dα_l)    (softmax backward)
//   dw_a  += Σ_j de_j t_ja                dz_ja = de_j w_a (1 − t_ja²)
//   dkey_ja += dz_ja                      dp_a = Σ_j dz_ja, then ds += dp W_q, dW_q += dpᵀ s
template <class Scalar>
void DecoderAttention<Scalar>::backward(const EncoderMemory<Scalar>& memory, const AttentionStepCache<Scalar>& cache,
                                        TensorView<const Scalar> dcontext, TensorView<Scalar> ds,
                                        EncoderMemoryGradients<Scalar>& dmemory) {
  const int64_t batch = memory.annotations.shape()[0], ts = memory.annotations.shape()[1];
  const int64_t width = memory.annotations.shape()[2];
  check_shape("dcontext", dcontext.shape, Shape{batch, width});
  check_shape("ds", ds.shape, Shape{batch, query_size_});
  if (score_ == Score::none) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t d = 0; d < width; ++d) dmemory.summary[b * width + d] += dcontext(b, d);
    }
    return;
  }
  if (score_ == Score::scaled_dot) {
    const TensorView<const Scalar> keys = as_b1td(memory.annotations.cview());
    AttentionParams<Scalar> params{.q = cache.query.cview(), .k = keys, .v = keys, .scale = std::nullopt, .mask = {}};
    params.mask.allowed = memory.allowed.cview();
    Tensor<Scalar> dq(cache.query.shape());
    Tensor<Scalar> dv(Shape{batch, 1, ts, width});
    attention_backward_reference<Scalar>(
        params, as_b11d(dcontext),
        {.dq = dq.view(), .dk = as_b1td(dmemory.annotations.view()), .dv = dv.view(), .dbias = std::nullopt});
    add_into(as_b1td(dmemory.annotations.view()), dv);
    query_.backward(cache.query_state.cview(), make_view<const Scalar>(dq.data(), Shape{batch, width}), ds);
    return;
  }
  Tensor<Scalar> dquery(Shape{batch, hidden_});
  std::vector<double> dw(static_cast<size_t>(hidden_), 0.0), dalpha(static_cast<size_t>(ts));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = memory.lengths[static_cast<size_t>(b)];
    double expected = 0.0;  // Σ_l α_l dα_l
    for (int64_t j = 0; j < len; ++j) {
      const double alpha = static_cast<double>(cache.alpha[b * ts + j]);
      const Scalar* h = memory.annotations.data() + (b * ts + j) * width;
      Scalar* dh = dmemory.annotations.data() + (b * ts + j) * width;
      double da = 0.0;
      for (int64_t d = 0; d < width; ++d) {
        da += static_cast<double>(dcontext(b, d)) * static_cast<double>(h[d]);
        dh[d] += static_cast<Scalar>(alpha * static_cast<double>(dcontext(b, d)));
      }
      dalpha[static_cast<size_t>(j)] = da;
      expected += alpha * da;
    }
    for (int64_t j = 0; j < len; ++j) {
      const double de = static_cast<double>(cache.alpha[b * ts + j]) * (dalpha[static_cast<size_t>(j)] - expected);
      const Scalar* t = cache.hidden.data() + (b * ts + j) * hidden_;
      Scalar* dkey = dmemory.keys.data() + (b * ts + j) * hidden_;
      for (int64_t a = 0; a < hidden_; ++a) {
        const double ta = static_cast<double>(t[a]);
        dw[static_cast<size_t>(a)] += de * ta;
        const double dz = de * static_cast<double>(w_.value[a]) * (1.0 - ta * ta);
        dkey[a] += static_cast<Scalar>(dz);
        dquery[b * hidden_ + a] += static_cast<Scalar>(dz);
      }
    }
  }
  for (int64_t a = 0; a < hidden_; ++a) w_.grad[a] += static_cast<Scalar>(dw[static_cast<size_t>(a)]);
  query_.backward(cache.query_state.cview(), dquery.cview(), ds);
}

template <class Scalar>
void DecoderAttention<Scalar>::zero_grad() {
  query_.zero_grad();
  key_.zero_grad();
  w_.zero_grad();
}

// additive: W_q, W_k, then w; scaled_dot: W_q, b_q; none: nothing (both layers are empty).
template <class Scalar>
std::vector<ParameterRef<Scalar>> DecoderAttention<Scalar>::parameters() {
  std::vector<ParameterRef<Scalar>> result = query_.parameters();
  append(result, key_.parameters());
  if (score_ == Score::additive) result.push_back(w_.ref("w"));
  return result;
}

template <class Scalar>
std::vector<ParameterRef<const Scalar>> DecoderAttention<Scalar>::parameters() const {
  std::vector<ParameterRef<const Scalar>> result = query_.parameters();
  append(result, key_.parameters());
  if (score_ == Score::additive) result.push_back(w_.ref("w"));
  return result;
}

// ---- Seq2Seq ------------------------------------------------------------------------------------

namespace {

Seq2SeqConfig checked(const Seq2SeqConfig& c) {
  if (c.source_vocabulary <= kSpecialTokens) {
    throw ValueError(
        fmt::format("source_vocabulary: expected more than the 3 special tokens, got {}", c.source_vocabulary));
  }
  if (c.target_vocabulary <= kSpecialTokens) {
    throw ValueError(
        fmt::format("target_vocabulary: expected more than the 3 special tokens, got {}", c.target_vocabulary));
  }
  check_positive("embedding", c.embedding);
  check_positive("encoder_hidden", c.encoder_hidden);
  check_positive("decoder_hidden", c.decoder_hidden);
  check_positive("attention_hidden", c.attention_hidden);
  return c;
}

}  // namespace

// Members are initialised in declaration order, which fixes the order of the draws from rng.
template <class Scalar>
Seq2Seq<Scalar>::Seq2Seq(const Seq2SeqConfig& config, Rng& rng)
    : config_(checked(config)),
      source_embedding_({.num_embeddings = config.source_vocabulary, .dim = config.embedding}, rng),
      target_embedding_({.num_embeddings = config.target_vocabulary, .dim = config.embedding}, rng),
      encoder_({.input_size = config.embedding, .hidden_size = config.encoder_hidden}, rng),
      attention_(config.score, config.decoder_hidden, 2 * config.encoder_hidden, config.attention_hidden, rng),
      decoder_({.input_size = config.embedding + 2 * config.encoder_hidden, .hidden_size = config.decoder_hidden}, rng),
      init_({.in_features = 2 * config.encoder_hidden, .out_features = config.decoder_hidden}, rng),
      readout_({.in_features = config.decoder_hidden + 2 * config.encoder_hidden + config.embedding,
                .out_features = config.target_vocabulary},
               rng) {}

template <class Scalar>
EncoderMemory<Scalar> Seq2Seq<Scalar>::encode(TensorView<const int64_t> source, TensorView<const int64_t> lengths,
                                              EncoderCache<Scalar>& cache) const {
  if (source.rank() != 2) throw ShapeError(fmt::format("source: expected shape [B, Ts], got {}", source.shape.str()));
  const int64_t batch = source.shape[0], ts = source.shape[1], he = config_.encoder_hidden;
  check_shape("source_lengths", lengths.shape, Shape{batch});
  EncoderMemory<Scalar> memory;
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths(b) < 1 || lengths(b) > ts) {
      throw ValueError(fmt::format("source_lengths: expected each in [1, {}], got {} at {}", ts, lengths(b), b));
    }
    memory.lengths.push_back(lengths(b));
  }
  const Tensor<Scalar> x = source_embedding_.forward(source, cache.embedding);
  RecurrentOutputs<Scalar> out = encoder_.forward({.x = x.cview(), .h0 = std::nullopt, .lengths = lengths}, cache.gru);
  memory.annotations = std::move(out.y);
  memory.summary = Tensor<Scalar>(Shape{batch, 2 * he});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t d = 0; d < he; ++d) {
      memory.summary[b * 2 * he + d] = out.h_n[b * he + d];
      memory.summary[b * 2 * he + he + d] = out.h_n[(batch + b) * he + d];
    }
  }
  memory.allowed = Tensor<uint8_t>(Shape{batch, 1, 1, ts});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < memory.lengths[static_cast<size_t>(b)]; ++j) memory.allowed[b * ts + j] = 1;
  }
  attention_.prepare(memory);
  return memory;
}

template <class Scalar>
Tensor<Scalar> Seq2Seq<Scalar>::initial_state(const EncoderMemory<Scalar>& memory) const {
  Tensor<Scalar> s = init_.forward(memory.summary.cview());
  for (Scalar& v : s.values()) v = std::tanh(v);
  return s;
}

template <class Scalar>
DecoderStepOutputs<Scalar> Seq2Seq<Scalar>::step_forward(const EncoderMemory<Scalar>& memory,
                                                         TensorView<const Scalar> x, TensorView<const Scalar> s,
                                                         DecoderStepCache<Scalar>& cache) const {
  const int64_t batch = memory.annotations.shape()[0], width = 2 * config_.encoder_hidden, e = config_.embedding;
  check_shape("x", x.shape, Shape{batch, e});
  Tensor<Scalar> context(Shape{batch, width});
  attention_.forward(memory, s, cache.attention, context.view());
  Tensor<Scalar> input(Shape{batch, e + width});
  put_columns(x, input, 0);
  put_columns(context.cview(), input, e);
  DecoderStepOutputs<Scalar> out;
  out.state = decoder_.step_forward(input.cview(), s, cache.gru);
  cache.readout = Tensor<Scalar>(Shape{batch, config_.decoder_hidden + width + e});
  put_columns(out.state.cview(), cache.readout, 0);
  put_columns(context.cview(), cache.readout, config_.decoder_hidden);
  put_columns(x, cache.readout, config_.decoder_hidden + width);
  out.logits = readout_.forward(cache.readout.cview());
  return out;
}

// The step backward, from the readout back: the readout [s_i; c_i; x] splits dlogits' share three
// ways; s_i's share joins ds_next and goes through the GRU, whose input [x; c_i] splits again; c_i's
// two shares go through the attention to s_{i−1} and the memory.
template <class Scalar>
void Seq2Seq<Scalar>::step_backward(const EncoderMemory<Scalar>& memory, const DecoderStepCache<Scalar>& cache,
                                    TensorView<const Scalar> dlogits, TensorView<const Scalar> ds_next,
                                    TensorView<Scalar> dx, TensorView<Scalar> ds,
                                    EncoderMemoryGradients<Scalar>& dmemory) {
  const int64_t batch = memory.annotations.shape()[0], width = 2 * config_.encoder_hidden, e = config_.embedding;
  const int64_t hd = config_.decoder_hidden;
  check_shape("dlogits", dlogits.shape, Shape{batch, config_.target_vocabulary});
  check_shape("ds_next", ds_next.shape, Shape{batch, hd});
  check_shape("dx", dx.shape, Shape{batch, e});
  Tensor<Scalar> dreadout(cache.readout.shape());
  readout_.backward(cache.readout.cview(), dlogits, dreadout.view());
  Tensor<Scalar> dstate = to_tensor<Scalar, Scalar>(ds_next);
  add_columns(dreadout, 0, dstate.view());
  Tensor<Scalar> dcontext(Shape{batch, width});
  add_columns(dreadout, hd, dcontext.view());
  add_columns(dreadout, hd + width, dx);
  Tensor<Scalar> dinput(Shape{batch, e + width});
  decoder_.step_backward(cache.gru, dstate.cview(), {.dx = dinput.view(), .dh = ds});
  add_columns(dinput, 0, dx);
  add_columns(dinput, e, dcontext.view());
  attention_.backward(memory, cache.attention, dcontext.cview(), ds, dmemory);
}

template <class Scalar>
Tensor<Scalar> Seq2Seq<Scalar>::forward(const Seq2SeqBatch& batch) {
  if (batch.decoder_input.shape().rank() != 2 || batch.decoder_input.shape()[0] != batch.source.shape()[0]) {
    throw ShapeError(fmt::format("decoder_input: expected shape [{}, Tt], got {}", batch.source.shape()[0],
                                 batch.decoder_input.shape().str()));
  }
  check_shape("decoder_target", batch.decoder_target.shape(), batch.decoder_input.shape());
  const int64_t b = batch.decoder_input.shape()[0], tt = batch.decoder_input.shape()[1];
  const int64_t ts = batch.source.shape()[1], vt = config_.target_vocabulary;
  memory_ = encode(batch.source.cview(), batch.source_lengths.cview(), encoder_cache_);
  s0_ = initial_state(memory_);
  target_x_ = target_embedding_.forward(batch.decoder_input.cview(), target_cache_);
  steps_.resize(static_cast<size_t>(tt));
  Tensor<Scalar> logits(Shape{b, tt, vt});
  alpha_ = Tensor<Scalar>(Shape{b, tt, ts});
  Tensor<Scalar> s = s0_;
  for (int64_t i = 0; i < tt; ++i) {
    const Tensor<Scalar> x = time_slice(target_x_, i);
    DecoderStepCache<Scalar>& cache = steps_[static_cast<size_t>(i)];
    DecoderStepOutputs<Scalar> out = step_forward(memory_, x.cview(), s.cview(), cache);
    for (int64_t n = 0; n < b; ++n) {
      std::copy_n(out.logits.data() + n * vt, vt, logits.data() + (n * tt + i) * vt);
      std::copy_n(cache.attention.alpha.data() + n * ts, ts, alpha_.data() + (n * tt + i) * ts);
    }
    s = std::move(out.state);
  }
  return logits;
}

template <class Scalar>
void Seq2Seq<Scalar>::backward(TensorView<const Scalar> dlogits) {
  const int64_t b = target_x_.shape()[0], tt = target_x_.shape()[1], e = config_.embedding;
  const int64_t ts = memory_.annotations.shape()[1], he = config_.encoder_hidden, hd = config_.decoder_hidden;
  check_shape("dlogits", dlogits.shape, Shape{b, tt, config_.target_vocabulary});
  const Tensor<Scalar> dlogits_all = to_tensor<Scalar, Scalar>(dlogits);
  EncoderMemoryGradients<Scalar> dmemory{.annotations = Tensor<Scalar>(memory_.annotations.shape()),
                                         .keys = Tensor<Scalar>(memory_.keys.shape()),
                                         .summary = Tensor<Scalar>(memory_.summary.shape())};
  Tensor<Scalar> dtarget_x(target_x_.shape());
  Tensor<Scalar> ds_next(Shape{b, hd});
  for (int64_t i = tt - 1; i >= 0; --i) {
    const Tensor<Scalar> dlogits_i = time_slice(dlogits_all, i);
    Tensor<Scalar> dx(Shape{b, e}), ds(Shape{b, hd});
    step_backward(memory_, steps_[static_cast<size_t>(i)], dlogits_i.cview(), ds_next.cview(), dx.view(), ds.view(),
                  dmemory);
    for (int64_t n = 0; n < b; ++n) std::copy_n(dx.data() + n * e, e, dtarget_x.data() + (n * tt + i) * e);
    ds_next = std::move(ds);
  }
  // s_0 = tanh(pre): dpre = ds_0 ∘ (1 − s_0²).
  for (int64_t k = 0; k < ds_next.numel(); ++k) ds_next[k] *= Scalar{1} - s0_[k] * s0_[k];
  init_.backward(memory_.summary.cview(), ds_next.cview(), dmemory.summary.view());
  target_embedding_.backward(target_cache_, dtarget_x.cview());

  attention_.prepare_backward(memory_, dmemory);
  Tensor<Scalar> dh_n(Shape{2, b, he});
  for (int64_t n = 0; n < b; ++n) {
    for (int64_t d = 0; d < he; ++d) {
      dh_n[n * he + d] = dmemory.summary[n * 2 * he + d];
      dh_n[(b + n) * he + d] = dmemory.summary[n * 2 * he + he + d];
    }
  }
  Tensor<Scalar> dsource_x(Shape{b, ts, e});
  encoder_.backward(encoder_cache_.gru, {.dy = dmemory.annotations.cview(), .dh_n = dh_n.cview()},
                    {.dx = dsource_x.view(), .dh0 = std::nullopt});
  source_embedding_.backward(encoder_cache_.embedding, dsource_x.cview());
}

template <class Scalar>
std::vector<GreedyTranslation<Scalar>> Seq2Seq<Scalar>::greedy_decode(const std::vector<std::vector<int64_t>>& sources,
                                                                      int64_t max_steps) const {
  if (max_steps < 1) throw ValueError(fmt::format("max_steps: expected at least 1, got {}", max_steps));
  const Seq2SeqBatch batch = make_seq2seq_batch(sources, std::vector<std::vector<int64_t>>(sources.size()));
  const int64_t b = batch.source.shape()[0], ts = batch.source.shape()[1], vt = config_.target_vocabulary;
  EncoderCache<Scalar> encoder_cache;
  const EncoderMemory<Scalar> memory = encode(batch.source.cview(), batch.source_lengths.cview(), encoder_cache);
  Tensor<Scalar> s = initial_state(memory);
  Tensor<int64_t> previous(Shape{b}, kBosId);
  std::vector<std::vector<Scalar>> alphas(static_cast<size_t>(b));
  std::vector<GreedyTranslation<Scalar>> out(static_cast<size_t>(b));
  EmbeddingCache<Scalar> embedding_cache;
  DecoderStepCache<Scalar> cache;
  int64_t running = b;
  for (int64_t step = 0; step < max_steps && running > 0; ++step) {
    const Tensor<Scalar> x = target_embedding_.forward(previous.cview(), embedding_cache);
    DecoderStepOutputs<Scalar> next = step_forward(memory, x.cview(), s.cview(), cache);
    for (int64_t n = 0; n < b; ++n) {
      GreedyTranslation<Scalar>& t = out[static_cast<size_t>(n)];
      if (t.finished) continue;
      // <pad> and <bos> are never targets, so only <eos> and the words compete.
      const Scalar* row = next.logits.data() + n * vt;
      const int64_t best = std::max_element(row + kEosId, row + vt) - row;
      const int64_t len = memory.lengths[static_cast<size_t>(n)];
      for (int64_t j = 0; j < len; ++j) alphas[static_cast<size_t>(n)].push_back(cache.attention.alpha[n * ts + j]);
      previous[n] = best;
      if (best == kEosId) {
        t.finished = true;
        --running;
      } else {
        t.tokens.push_back(best);
      }
    }
    s = std::move(next.state);
  }
  for (int64_t n = 0; n < b; ++n) {
    const int64_t len = memory.lengths[static_cast<size_t>(n)];
    std::vector<Scalar>& a = alphas[static_cast<size_t>(n)];
    const Shape shape{static_cast<int64_t>(a.size()) / len, len};
    out[static_cast<size_t>(n)].alpha = Tensor<Scalar>(shape, std::move(a));
  }
  return out;
}

template <class Scalar>
void Seq2Seq<Scalar>::zero_grad() {
  for (ParameterRef<Scalar>& p : parameters()) std::fill_n(p.grad.data, p.grad.numel(), Scalar{0});
}

template <class Scalar>
std::vector<ParameterRef<Scalar>> Seq2Seq<Scalar>::parameters() {
  std::vector<ParameterRef<Scalar>> all;
  append(all, prefixed("source_embedding", source_embedding_.parameters()));
  append(all, prefixed("target_embedding", target_embedding_.parameters()));
  append(all, prefixed("encoder", encoder_.parameters()));
  append(all, prefixed("init", init_.parameters()));
  append(all, prefixed("attention", attention_.parameters()));
  append(all, prefixed("decoder", decoder_.parameters()));
  append(all, prefixed("readout", readout_.parameters()));
  return all;
}

template <class Scalar>
std::vector<ParameterRef<const Scalar>> Seq2Seq<Scalar>::parameters() const {
  std::vector<ParameterRef<const Scalar>> all;
  append(all, prefixed("source_embedding", source_embedding_.parameters()));
  append(all, prefixed("target_embedding", target_embedding_.parameters()));
  append(all, prefixed("encoder", encoder_.parameters()));
  append(all, prefixed("init", init_.parameters()));
  append(all, prefixed("attention", attention_.parameters()));
  append(all, prefixed("decoder", decoder_.parameters()));
  append(all, prefixed("readout", readout_.parameters()));
  return all;
}

template <class Scalar>
double seq2seq_loss_and_gradients(Seq2Seq<Scalar>& model, const Seq2SeqBatch& batch) {
  model.zero_grad();
  const Tensor<Scalar> logits = model.forward(batch);
  CrossEntropyCache<Scalar> cache;
  const double loss = cross_entropy_forward<Scalar>(
      {.logits = logits.cview(), .targets = batch.decoder_target.cview(), .ignore_index = kIgnoreTarget}, cache);
  Tensor<Scalar> dlogits(logits.shape());
  cross_entropy_backward<Scalar>(cache, 1.0, dlogits.view());
  model.backward(dlogits.cview());
  return loss;
}

// ---- Model files --------------------------------------------------------------------------------

ModelFile to_model_file(const Seq2Seq<float>& model, const Vocabulary& source, const Vocabulary& target,
                        std::string description) {
  const Seq2SeqConfig& c = model.config();
  ModelFile file;
  file.kind = std::string(kSeq2SeqKind);
  file.set("description", std::move(description));
  file.set("score", std::string(score_name(c.score)));
  file.set("embedding", fmt::format("{}", c.embedding));
  file.set("encoder_hidden", fmt::format("{}", c.encoder_hidden));
  file.set("decoder_hidden", fmt::format("{}", c.decoder_hidden));
  file.set("attention_hidden", fmt::format("{}", c.attention_hidden));
  file.set("source_vocabulary", source.joined());
  file.set("target_vocabulary", target.joined());
  store_parameters(file, model.parameters());
  return file;
}

TranslationModel translation_model_from_file(const ModelFile& file) {
  file.check_kind(kSeq2SeqKind);
  // Sizes far beyond anything trainable here are refused before anything is allocated.
  constexpr int64_t kMaxWidth = 1 << 16;
  const std::optional<Score> score = score_from_name(file.value("score"));
  if (!score) {
    throw IoError(fmt::format("{}: entry \"score\": expected none, additive or dot, got \"{}\"", file.source,
                              file.value("score")));
  }
  const auto vocabulary = [&](std::string_view key) {
    try {
      Vocabulary words(split_labels(file.value(key)));
      if (words.size() <= kSpecialTokens) throw ValueError("expected at least one word, got none");
      return words;
    } catch (const ValueError& e) {
      throw IoError(fmt::format("{}: entry \"{}\": {}", file.source, key, e.what()));
    }
  };
  Vocabulary source = vocabulary("source_vocabulary");
  Vocabulary target = vocabulary("target_vocabulary");
  const Seq2SeqConfig config{.source_vocabulary = source.size(),
                             .target_vocabulary = target.size(),
                             .embedding = file.int_value("embedding", 1, kMaxWidth),
                             .encoder_hidden = file.int_value("encoder_hidden", 1, kMaxWidth),
                             .decoder_hidden = file.int_value("decoder_hidden", 1, kMaxWidth),
                             .attention_hidden = file.int_value("attention_hidden", 1, kMaxWidth),
                             .score = *score};
  Rng unused(0);
  TranslationModel model{std::move(source), std::move(target), Seq2Seq<float>(config, unused)};
  load_parameters(file, model.model.parameters());
  return model;
}

template class DecoderAttention<float>;
template class DecoderAttention<double>;
template class Seq2Seq<float>;
template class Seq2Seq<double>;
template double seq2seq_loss_and_gradients(Seq2Seq<float>&, const Seq2SeqBatch&);
template double seq2seq_loss_and_gradients(Seq2Seq<double>&, const Seq2SeqBatch&);

}  // namespace qkv::cli
