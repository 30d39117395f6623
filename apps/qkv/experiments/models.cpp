#include "models.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace qkv::cli {
namespace {

// torch.nn.Linear(in, out), its parameters named w_SUFFIX and b_SUFFIX.
template <class Scalar>
Linear<Scalar> linear(int64_t in, int64_t out, const char* suffix, Rng& rng) {
  return Linear<Scalar>({.in_features = in,
                         .out_features = out,
                         .weight_name = fmt::format("w_{}", suffix),
                         .bias_name = fmt::format("b_{}", suffix)},
                        rng);
}

// Position T − 1 of x [B, T, D], as [B, 1, D].
template <class U>
TensorView<U> last_position(TensorView<U> x) {
  const int64_t t = x.shape[1];
  return {
      x.data + (t - 1) * x.strides[1], Shape{x.shape[0], 1, x.shape[2]}, {x.strides[0], x.strides[1], x.strides[2], 0}};
}

// A [B, 1, N] tensor read as [B, N] (the same elements).
template <class Scalar>
Tensor<Scalar> drop_middle(Tensor<Scalar> t) {
  const Shape shape{t.shape()[0], t.shape()[2]};
  return Tensor<Scalar>(shape, std::move(t.values()));
}

template <class Scalar>
TensorView<const Scalar> with_middle(TensorView<const Scalar> t) {
  return make_view(t.data, Shape{t.shape[0], 1, t.shape[1]});
}

}  // namespace

template <class Scalar>
PairEmbedding<Scalar>::PairEmbedding(int64_t vocabulary, int64_t dim, Rng& rng)
    : table_({.num_embeddings = vocabulary, .dim = dim}, rng) {}

template <class Scalar>
Tensor<Scalar> PairEmbedding<Scalar>::forward(TensorView<const int64_t> ids) {
  const Tensor<Scalar> pairs = table_.forward(ids, cache_);  // [B, T, 2, D]
  const int64_t b = ids.shape[0], t = ids.shape[1], d = table_.config().dim;
  Tensor<Scalar> x(Shape{b, t, d});
  for (int64_t row = 0; row < b * t; ++row) {
    for (int64_t j = 0; j < d; ++j) x[row * d + j] = pairs[(2 * row) * d + j] + pairs[(2 * row + 1) * d + j];
  }
  return x;
}

template <class Scalar>
void PairEmbedding<Scalar>::backward(TensorView<const Scalar> dx) {
  const int64_t b = dx.shape[0], t = dx.shape[1], d = dx.shape[2];
  // Both ids of a position receive the whole of dx: the sum passes its gradient to each term.
  Tensor<Scalar> dpairs(Shape{b, t, 2, d});
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t ti = 0; ti < t; ++ti) {
      for (int64_t j = 0; j < d; ++j) {
        const int64_t row = bi * t + ti;
        dpairs[(2 * row) * d + j] = dx(bi, ti, j);
        dpairs[(2 * row + 1) * d + j] = dx(bi, ti, j);
      }
    }
  }
  table_.backward(cache_, dpairs.cview());
}

template <class Scalar>
AttentionReader<Scalar>::AttentionReader(const AttentionReaderConfig& config, Rng& rng)
    : config_(config),
      query_(linear<Scalar>(config.dim, config.dim, "q", rng)),
      key_(linear<Scalar>(config.dim, config.dim, "k", rng)),
      value_(linear<Scalar>(config.dim, config.dim, "v", rng)),
      output_(linear<Scalar>(config.dim, config.dim, "o", rng)),
      norm_({.dim = config.dim}),
      classifier_(linear<Scalar>(config.dim, config.classes, "c", rng)) {}

template <class Scalar>
Tensor<Scalar> AttentionReader<Scalar>::forward(TensorView<const Scalar> x) {
  const int64_t b = x.shape[0], d = config_.dim;
  x_ = to_tensor<Scalar, Scalar>(x);
  const TensorView<const Scalar> last = last_position(x_.cview());
  q_ = query_.forward(last);
  k_ = key_.forward(x_.cview());
  v_ = value_.forward(x_.cview());
  // Rank 3 reads as [H, T, D]: the batch takes the place of the heads, each with one query.
  a_ = Tensor<Scalar>(Shape{b, 1, d});
  lse_ = Tensor<Scalar>(Shape{b, 1});
  attention_forward<Scalar>({.q = q_.cview(), .k = k_.cview(), .v = v_.cview(), .scale = config_.scale, .mask = {}},
                            {.out = a_.view(), .weights = std::nullopt, .lse = lse_.view()});
  h_ = output_.forward(a_.cview());
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < d; ++j) h_[i * d + j] += last(i, 0, j);
  }
  normed_ = norm_.forward(h_.cview(), norm_cache_);
  return drop_middle(classifier_.forward(normed_.cview()));
}

template <class Scalar>
void AttentionReader<Scalar>::backward(TensorView<const Scalar> dlogits, TensorView<Scalar> dx) {
  const int64_t b = x_.shape()[0], t = x_.shape()[1], d = config_.dim;
  Tensor<Scalar> dnormed(Shape{b, 1, d});
  classifier_.backward(normed_.cview(), with_middle(dlogits), dnormed.view());
  Tensor<Scalar> dh(Shape{b, 1, d});
  norm_.backward(norm_cache_, dnormed.cview(), dh.view());
  Tensor<Scalar> da(Shape{b, 1, d});
  output_.backward(a_.cview(), dh.cview(), da.view());
  Tensor<Scalar> dq(Shape{b, 1, d}), dk(Shape{b, t, d}), dv(Shape{b, t, d});
  attention_backward<Scalar>({.q = q_.cview(), .k = k_.cview(), .v = v_.cview(), .scale = config_.scale, .mask = {}},
                             da.cview(), {.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = std::nullopt},
                             AttentionSaved<Scalar>{.out = a_.cview(), .lse = lse_.cview()});
  key_.backward(x_.cview(), dk.cview(), dx);
  value_.backward(x_.cview(), dv.cview(), dx);
  const TensorView<Scalar> dlast = last_position(dx);
  query_.backward(last_position(x_.cview()), dq.cview(), dlast);
  // The residual x_{T−1} + W_O a hands dh to x_{T−1} unchanged.
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < d; ++j) dlast(i, 0, j) += dh[i * d + j];
  }
}

template <class Scalar>
std::vector<ParameterRef<Scalar>> AttentionReader<Scalar>::parameters() {
  std::vector<ParameterRef<Scalar>> params;
  for (Linear<Scalar>* p : {&query_, &key_, &value_, &output_}) {
    for (ParameterRef<Scalar>& r : p->parameters()) params.push_back(r);
  }
  for (ParameterRef<Scalar>& p : norm_.parameters()) params.push_back(p);
  for (ParameterRef<Scalar>& p : classifier_.parameters()) params.push_back(p);
  return params;
}

template <class Scalar>
GruReader<Scalar>::GruReader(const GruReaderConfig& config, Rng& rng)
    : config_(config),
      gru_({.input_size = config.dim, .hidden_size = config.hidden}, rng),
      norm_({.dim = config.hidden}),
      classifier_(linear<Scalar>(config.hidden, config.classes, "c", rng)) {}

template <class Scalar>
Tensor<Scalar> GruReader<Scalar>::forward(TensorView<const Scalar> x) {
  RecurrentOutputs<Scalar> outputs = gru_.forward({.x = x}, gru_cache_);
  h_n_ = std::move(outputs.h_n);
  normed_ = norm_.forward(h_n_.cview(), norm_cache_);
  return classifier_.forward(normed_.cview());
}

template <class Scalar>
void GruReader<Scalar>::backward(TensorView<const Scalar> dlogits, TensorView<Scalar> dx) {
  const int64_t b = h_n_.shape()[0], t = gru_cache_.x.shape()[1], h = config_.hidden;
  Tensor<Scalar> dnormed(Shape{b, h});
  classifier_.backward(normed_.cview(), dlogits, dnormed.view());
  Tensor<Scalar> dh_n(Shape{b, h});
  norm_.backward(norm_cache_, dnormed.cview(), dh_n.view());
  // Only the final state answers, so no gradient arrives at the per-step outputs y.
  const Tensor<Scalar> dy(Shape{b, t, h});
  gru_.backward(gru_cache_, {.dy = dy.cview(), .dh_n = dh_n.cview()}, {.dx = dx});
}

template <class Scalar>
std::vector<ParameterRef<Scalar>> GruReader<Scalar>::parameters() {
  std::vector<ParameterRef<Scalar>> params = gru_.parameters();
  for (ParameterRef<Scalar>& p : norm_.parameters()) params.push_back(p);
  for (ParameterRef<Scalar>& p : classifier_.parameters()) params.push_back(p);
  return params;
}

namespace {

template <class Scalar>
std::vector<ParameterRef<Scalar>> concat(std::vector<ParameterRef<Scalar>> a,
                                         const std::vector<ParameterRef<Scalar>>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

template <class Scalar>
Classifier<Scalar>::Classifier(PairEmbedding<Scalar> embedding, std::unique_ptr<SequenceReader<Scalar>> reader,
                               const AdamConfig& adam)
    : embedding_(std::move(embedding)),
      reader_(std::move(reader)),
      adam_(concat(embedding_.parameters(), reader_->parameters()), adam) {}

template <class Scalar>
double Classifier<Scalar>::forward_backward(const Batch& batch, Tensor<Scalar>& dx) {
  const Tensor<Scalar> x = embedding_.forward(batch.ids.cview());
  const Tensor<Scalar> logits = reader_->forward(x.cview());
  CrossEntropyCache<Scalar> cache;
  const double loss =
      cross_entropy_forward<Scalar>({.logits = logits.cview(), .targets = batch.targets.cview()}, cache);
  Tensor<Scalar> dlogits(logits.shape());
  cross_entropy_backward<Scalar>(cache, 1.0, dlogits.view());
  dx = Tensor<Scalar>(x.shape());
  reader_->backward(dlogits.cview(), dx.view());
  return loss;
}

template <class Scalar>
double Classifier<Scalar>::train_step(const Batch& batch) {
  adam_.zero_grad();
  Tensor<Scalar> dx;
  const double loss = forward_backward(batch, dx);
  embedding_.backward(dx.cview());
  adam_.step();
  return loss;
}

template <class Scalar>
typename Classifier<Scalar>::Evaluation Classifier<Scalar>::evaluate(const Batch& batch) {
  const Tensor<Scalar> x = embedding_.forward(batch.ids.cview());
  const Tensor<Scalar> logits = reader_->forward(x.cview());
  CrossEntropyCache<Scalar> cache;
  const double loss =
      cross_entropy_forward<Scalar>({.logits = logits.cview(), .targets = batch.targets.cview()}, cache);
  const int64_t rows = logits.shape()[0], classes = logits.shape()[1];
  int64_t right = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const Scalar* row = logits.data() + r * classes;
    if (std::max_element(row, row + classes) - row == batch.targets[r]) ++right;
  }
  return {.accuracy = static_cast<double>(right) / static_cast<double>(rows), .loss = loss};
}

template <class Scalar>
Tensor<Scalar> Classifier<Scalar>::input_gradient(const Batch& batch) {
  Tensor<Scalar> dx;
  forward_backward(batch, dx);
  adam_.zero_grad();
  return dx;
}

template <class Scalar>
int64_t count_parameters(const std::vector<ParameterRef<Scalar>>& params) {
  int64_t total = 0;
  for (const ParameterRef<Scalar>& p : params) total += p.value.numel();
  return total;
}

template <class Scalar>
int64_t Classifier<Scalar>::parameter_count() {
  return count_parameters(concat(embedding_.parameters(), reader_->parameters()));
}

template <class Scalar>
int64_t Classifier<Scalar>::reader_parameter_count() {
  return count_parameters(reader_->parameters());
}

#define QKV_INSTANTIATE_MODELS(Scalar)    \
  template class PairEmbedding<Scalar>;   \
  template class AttentionReader<Scalar>; \
  template class GruReader<Scalar>;       \
  template class Classifier<Scalar>;      \
  template int64_t count_parameters<Scalar>(const std::vector<ParameterRef<Scalar>>& params);
QKV_INSTANTIATE_MODELS(float)
QKV_INSTANTIATE_MODELS(double)

}  // namespace qkv::cli
