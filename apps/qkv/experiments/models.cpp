#include "models.hpp"

#include <algorithm>
#include <utility>

#include "qkv/ops/linear.hpp"

namespace qkv::cli {
namespace {

template <class Scalar>
Parameter<Scalar> linear_weight(int64_t out, int64_t in) {
  return Parameter<Scalar>(Shape{out, in});
}

// W [out, in] and b [out], drawn as torch.nn.Linear(in, out) draws them.
template <class Scalar>
void init_linear(Parameter<Scalar>& w, Parameter<Scalar>& b, Rng& rng) {
  b = Parameter<Scalar>(Shape{w.value.shape()[0]});
  linear_init<Scalar>(w.value.view(), b.value.view(), rng);
}

// y = x Wᵀ + b: x [..., In] → [..., Out].
template <class Scalar>
Tensor<Scalar> project(TensorView<const Scalar> x, const Parameter<Scalar>& w, const Parameter<Scalar>& b) {
  Shape shape = x.shape;
  shape[x.rank() - 1] = w.value.shape()[0];
  Tensor<Scalar> y(shape);
  linear_forward<Scalar>({.x = x, .w = w.value.cview(), .b = b.value.cview()}, y.view());
  return y;
}

// dW += dyᵀ x, db += Σ dy, and dx += dy W when dx is given.
template <class Scalar>
void project_backward(TensorView<const Scalar> x, Parameter<Scalar>& w, Parameter<Scalar>& b,
                      TensorView<const Scalar> dy, std::optional<TensorView<Scalar>> dx) {
  linear_backward<Scalar>({.x = x, .w = w.value.cview(), .b = b.value.cview()}, dy,
                          {.dx = dx, .dw = w.grad.view(), .db = b.grad.view()});
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
      w_q_(linear_weight<Scalar>(config.dim, config.dim)),
      w_k_(linear_weight<Scalar>(config.dim, config.dim)),
      w_v_(linear_weight<Scalar>(config.dim, config.dim)),
      w_o_(linear_weight<Scalar>(config.dim, config.dim)),
      w_c_(linear_weight<Scalar>(config.classes, config.dim)),
      norm_({.dim = config.dim}) {
  init_linear(w_q_, b_q_, rng);
  init_linear(w_k_, b_k_, rng);
  init_linear(w_v_, b_v_, rng);
  init_linear(w_o_, b_o_, rng);
  init_linear(w_c_, b_c_, rng);
}

template <class Scalar>
Tensor<Scalar> AttentionReader<Scalar>::forward(TensorView<const Scalar> x) {
  const int64_t b = x.shape[0], d = config_.dim;
  x_ = to_tensor<Scalar, Scalar>(x);
  const TensorView<const Scalar> last = last_position(x_.cview());
  q_ = project(last, w_q_, b_q_);
  k_ = project(x_.cview(), w_k_, b_k_);
  v_ = project(x_.cview(), w_v_, b_v_);
  // Rank 3 reads as [H, T, D]: the batch takes the place of the heads, each with one query.
  a_ = Tensor<Scalar>(Shape{b, 1, d});
  lse_ = Tensor<Scalar>(Shape{b, 1});
  attention_forward<Scalar>({.q = q_.cview(), .k = k_.cview(), .v = v_.cview(), .scale = config_.scale, .mask = {}},
                            {.out = a_.view(), .weights = std::nullopt, .lse = lse_.view()});
  h_ = project(a_.cview(), w_o_, b_o_);
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < d; ++j) h_[i * d + j] += last(i, 0, j);
  }
  normed_ = norm_.forward(h_.cview(), norm_cache_);
  return drop_middle(project(normed_.cview(), w_c_, b_c_));
}

template <class Scalar>
void AttentionReader<Scalar>::backward(TensorView<const Scalar> dlogits, TensorView<Scalar> dx) {
  const int64_t b = x_.shape()[0], t = x_.shape()[1], d = config_.dim;
  Tensor<Scalar> dnormed(Shape{b, 1, d});
  project_backward<Scalar>(normed_.cview(), w_c_, b_c_, with_middle(dlogits), dnormed.view());
  Tensor<Scalar> dh(Shape{b, 1, d});
  norm_.backward(norm_cache_, dnormed.cview(), dh.view());
  Tensor<Scalar> da(Shape{b, 1, d});
  project_backward<Scalar>(a_.cview(), w_o_, b_o_, dh.cview(), da.view());
  Tensor<Scalar> dq(Shape{b, 1, d}), dk(Shape{b, t, d}), dv(Shape{b, t, d});
  attention_backward<Scalar>({.q = q_.cview(), .k = k_.cview(), .v = v_.cview(), .scale = config_.scale, .mask = {}},
                             da.cview(), {.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = std::nullopt},
                             AttentionSaved<Scalar>{.out = a_.cview(), .lse = lse_.cview()});
  project_backward<Scalar>(x_.cview(), w_k_, b_k_, dk.cview(), dx);
  project_backward<Scalar>(x_.cview(), w_v_, b_v_, dv.cview(), dx);
  const TensorView<Scalar> dlast = last_position(dx);
  project_backward<Scalar>(last_position(x_.cview()), w_q_, b_q_, dq.cview(), dlast);
  // The residual x_{T−1} + W_O a hands dh to x_{T−1} unchanged.
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < d; ++j) dlast(i, 0, j) += dh[i * d + j];
  }
}

template <class Scalar>
std::vector<ParameterRef<Scalar>> AttentionReader<Scalar>::parameters() {
  std::vector<ParameterRef<Scalar>> params = {w_q_.ref("w_q"), b_q_.ref("b_q"), w_k_.ref("w_k"), b_k_.ref("b_k"),
                                              w_v_.ref("w_v"), b_v_.ref("b_v"), w_o_.ref("w_o"), b_o_.ref("b_o")};
  for (ParameterRef<Scalar>& p : norm_.parameters()) params.push_back(p);
  params.push_back(w_c_.ref("w_c"));
  params.push_back(b_c_.ref("b_c"));
  return params;
}

template <class Scalar>
GruReader<Scalar>::GruReader(const GruReaderConfig& config, Rng& rng)
    : config_(config),
      gru_({.input_size = config.dim, .hidden_size = config.hidden}, rng),
      norm_({.dim = config.hidden}),
      w_c_(linear_weight<Scalar>(config.classes, config.hidden)) {
  init_linear(w_c_, b_c_, rng);
}

template <class Scalar>
Tensor<Scalar> GruReader<Scalar>::forward(TensorView<const Scalar> x) {
  RecurrentOutputs<Scalar> outputs = gru_.forward({.x = x}, gru_cache_);
  h_n_ = std::move(outputs.h_n);
  normed_ = norm_.forward(h_n_.cview(), norm_cache_);
  return project(normed_.cview(), w_c_, b_c_);
}

template <class Scalar>
void GruReader<Scalar>::backward(TensorView<const Scalar> dlogits, TensorView<Scalar> dx) {
  const int64_t b = h_n_.shape()[0], t = gru_cache_.x.shape()[1], h = config_.hidden;
  Tensor<Scalar> dnormed(Shape{b, h});
  project_backward<Scalar>(normed_.cview(), w_c_, b_c_, dlogits, dnormed.view());
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
  params.push_back(w_c_.ref("w_c"));
  params.push_back(b_c_.ref("b_c"));
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
