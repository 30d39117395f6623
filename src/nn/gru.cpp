#include "qkv/nn/gru.hpp"

#include <fmt/format.h>

#include <cmath>
#include <span>

#include "qkv/core/error.hpp"
#include "recurrent.hpp"

namespace qkv {
namespace {

using recurrent::kNonlinearityWork;
using recurrent::time_of;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Direction `index` of a [2, B, H] view: [B, H].
template <class U>
TensorView<U> direction_slice(TensorView<U> view, int64_t index) {
  return {view.data + index * view.strides[0], Shape{view.shape[1], view.shape[2]}, {view.strides[1], view.strides[2]}};
}

// Features [offset, offset + H) of a [B, T, 2H] view: [B, T, H].
template <class U>
TensorView<U> feature_slice(TensorView<U> view, int64_t offset, int64_t hidden) {
  return {view.data + offset * view.strides[2], Shape{view.shape[0], view.shape[1], hidden}, view.strides};
}

// A [B, D] view read as a sequence of one token, [B, 1, D].
template <class U>
TensorView<U> as_one_step(TensorView<U> view) {
  return {view.data, Shape{view.shape[0], 1, view.shape[1]}, {view.strides[0], 0, view.strides[1]}};
}

template <class U>
std::optional<TensorView<U>> as_one_step(std::optional<TensorView<U>> view) {
  return view ? std::optional(as_one_step(*view)) : std::nullopt;
}

}  // namespace

template <class T>
Gru<T>::Gru(const GruConfig& config, Rng& rng) : config_(config) {
  recurrent::init_parameters(config, 3, rng, w_ih_, w_hh_, b_ih_, b_hh_);
}

// Step s of every sequence at once: the batched product W_hh h_prev [3H] for every sequence that
// has a step s, then the gates elementwise. xp = W_ih x + b_ih of every step was computed before
// the loop by one linear_forward.
template <class T>
RecurrentOutputs<T> Gru<T>::forward(const RecurrentInputs<T>& inputs, GruCache<T>& cache) const {
  const int64_t hidden = config_.hidden_size;
  const recurrent::Sizes n = recurrent::check_inputs<T>(inputs, config_.input_size, hidden, cache.lengths);
  const Shape states{n.batch, n.steps, hidden};
  cache.x = to_tensor<T, T>(inputs.x);
  cache.h0 = inputs.h0 ? to_tensor<T, T>(*inputs.h0) : Tensor<T>(Shape{n.batch, hidden});
  for (Tensor<T>* t : {&cache.h, &cache.r, &cache.z, &cache.n, &cache.hn}) *t = Tensor<T>(states);

  const Tensor<T> xp = recurrent::project(cache.x, w_ih_, b_ih_, config_.bias);

  const auto offset = [&](int64_t b, int64_t time) { return (b * n.steps + time) * hidden; };
  std::vector<const T*> prev(static_cast<size_t>(n.batch));
  Tensor<double> wh(Shape{n.batch, 3 * hidden});  // W_hh h_prev of the current step
  for (int64_t s = 0; s < n.steps; ++s) {
    recurrent::previous_states(s, cache.lengths, config_.reverse, cache.h0, cache.h, prev);
    recurrent::matvec(w_hh_.value, std::span<const T* const>(prev), wh);
    parallel_for_blocks(n.batch, 3 * hidden * kNonlinearityWork, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const T* h_prev = prev[static_cast<size_t>(b)];
        if (h_prev == nullptr) continue;
        const int64_t at = offset(b, time_of(s, cache.lengths[static_cast<size_t>(b)], config_.reverse));
        const T* xp_row = xp.data() + at * 3;
        const double* wh_row = wh.data() + b * 3 * hidden;
        for (int64_t j = 0; j < hidden; ++j) {
          const auto hh = [&](int64_t gate) {
            const int64_t k = gate * hidden + j;
            return wh_row[k] + (config_.bias ? static_cast<double>(b_hh_.value[k]) : 0.0);
          };
          const double r = sigmoid(static_cast<double>(xp_row[j]) + hh(0));
          const double z = sigmoid(static_cast<double>(xp_row[hidden + j]) + hh(1));
          const double hn = hh(2);
          const double candidate = std::tanh(static_cast<double>(xp_row[2 * hidden + j]) + r * hn);
          cache.r[at + j] = static_cast<T>(r);
          cache.z[at + j] = static_cast<T>(z);
          cache.n[at + j] = static_cast<T>(candidate);
          cache.hn[at + j] = static_cast<T>(hn);
          cache.h[at + j] = static_cast<T>((1.0 - z) * candidate + z * static_cast<double>(h_prev[j]));
        }
      }
    });
  }

  return {.y = cache.h, .h_n = recurrent::final_states(cache.lengths, config_.reverse, cache.h0, cache.h)};
}

// Going back from the last step, with dh = ∂L/∂h_t = dy_t + (what step t + 1 hands back) and the
// pre-activations a_r = W_ir x + b_ir + W_hr h_{t−1} + b_hr (a_z alike), a_n = W_in x + b_in + r ∘ hn,
// hn = W_hn h_{t−1} + b_hn:
//   h_t = (1 − z) n + z h_{t−1}  ⇒  dn = dh ∘ (1 − z),  dz = dh ∘ (h_{t−1} − n),  dh_{t−1} ∋ dh ∘ z
//   n = tanh(a_n)                ⇒  da_n = dn ∘ (1 − n²)
//   a_n ∋ r ∘ hn                 ⇒  dr = da_n ∘ hn,  dhn = da_n ∘ r
//   r = σ(a_r), z = σ(a_z)       ⇒  da_r = dr ∘ r(1 − r),  da_z = dz ∘ z(1 − z)
// The input side sees dxp = [da_r; da_z; da_n] (∂L/∂(W_ih x + b_ih)), the recurrent side
// dhp = [da_r; da_z; dhn] (∂L/∂(W_hh h_{t−1} + b_hh)), so
//   ∂L/∂h_{t−1} = dh ∘ z + W_hhᵀ dhp
// Every dxp and dhp is kept; the weights then see all steps in one linear_backward each:
//   dW_hh += Σ_t dhp_t h_{t−1}ᵀ, db_hh += Σ_t dhp_t, dW_ih += Σ_t dxp_t x_tᵀ, db_ih += Σ_t dxp_t,
//   dx_t += W_ihᵀ dxp_t.
template <class T>
void Gru<T>::backward(const GruCache<T>& cache, const RecurrentOutputGradients<T>& output_grads,
                      const RecurrentInputGradients<T>& input_grads) {
  const int64_t hidden = config_.hidden_size;
  const int64_t batch = cache.h.shape()[0];
  const int64_t steps = cache.h.shape()[1];
  recurrent::check_gradients(output_grads, input_grads, cache.x.shape(), cache.h.shape(), Shape{batch, hidden});
  const auto offset = [&](int64_t b, int64_t time) { return (b * steps + time) * hidden; };

  const Tensor<T> h_prev = recurrent::shifted_states(cache.lengths, config_.reverse, cache.h0, cache.h);

  Tensor<double> carry = recurrent::initial_carry(output_grads.dh_n, batch, hidden);  // ∂L/∂h_t from later steps
  Tensor<T> dxp(Shape{batch, steps, 3 * hidden});                                     // 0 past a sequence's length
  Tensor<T> dhp(Shape{batch, steps, 3 * hidden});
  const Tensor<T> w_hh_t = recurrent::transposed(w_hh_.value);
  Tensor<double> back(Shape{batch, hidden});  // W_hhᵀ dhp of the current step
  std::vector<const T*> dhp_rows(static_cast<size_t>(batch));
  for (int64_t s = steps - 1; s >= 0; --s) {
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t length = cache.lengths[static_cast<size_t>(b)];
      dhp_rows[static_cast<size_t>(b)] =
          s < length ? dhp.data() + 3 * offset(b, time_of(s, length, config_.reverse)) : nullptr;
    }
    parallel_for_blocks(batch, 3 * hidden, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t length = cache.lengths[static_cast<size_t>(b)];
        if (s >= length) continue;
        const int64_t t = time_of(s, length, config_.reverse);
        const int64_t at = offset(b, t);
        T* dxp_row = dxp.data() + 3 * at;
        T* dhp_row = dhp.data() + 3 * at;
        for (int64_t j = 0; j < hidden; ++j) {
          double& carried = carry[b * hidden + j];
          const double dh = static_cast<double>(output_grads.dy(b, t, j)) + carried;
          const auto r = static_cast<double>(cache.r[at + j]);
          const auto z = static_cast<double>(cache.z[at + j]);
          const auto candidate = static_cast<double>(cache.n[at + j]);
          const double dn = dh * (1.0 - z);
          const double dz = dh * (static_cast<double>(h_prev[at + j]) - candidate);
          const double da_n = dn * (1.0 - candidate * candidate);
          const double dr = da_n * static_cast<double>(cache.hn[at + j]);
          const double da_r = dr * r * (1.0 - r);
          const double da_z = dz * z * (1.0 - z);
          dxp_row[j] = static_cast<T>(da_r);
          dxp_row[hidden + j] = static_cast<T>(da_z);
          dxp_row[2 * hidden + j] = static_cast<T>(da_n);
          dhp_row[j] = static_cast<T>(da_r);
          dhp_row[hidden + j] = static_cast<T>(da_z);
          dhp_row[2 * hidden + j] = static_cast<T>(da_n * r);
          carried = dh * z;
        }
      }
    });
    recurrent::matvec(w_hh_t, std::span<const T* const>(dhp_rows), back);
    for (int64_t b = 0; b < batch; ++b) {
      if (dhp_rows[static_cast<size_t>(b)] == nullptr) continue;
      for (int64_t j = 0; j < hidden; ++j) carry[b * hidden + j] += back[b * hidden + j];
    }
  }
  recurrent::add_carry(carry, input_grads.dh0);

  recurrent::project_backward(h_prev, dhp, w_hh_, b_hh_, config_.bias, std::optional<TensorView<T>>());
  recurrent::project_backward(cache.x, dxp, w_ih_, b_ih_, config_.bias, input_grads.dx);
}

template <class T>
Tensor<T> Gru<T>::step_forward(TensorView<const T> x, TensorView<const T> h, GruCache<T>& cache) const {
  if (x.rank() != 2 || x.shape[1] != config_.input_size) {
    throw ShapeError(fmt::format("x: expected shape [B, {}], got {}", config_.input_size, x.shape.str()));
  }
  check_shape("h", h.shape, Shape{x.shape[0], config_.hidden_size});
  RecurrentOutputs<T> outputs = forward({.x = as_one_step(x), .h0 = h, .lengths = std::nullopt}, cache);
  return std::move(outputs.h_n);
}

template <class T>
void Gru<T>::step_backward(const GruCache<T>& cache, TensorView<const T> dh_next, const GruStepGradients<T>& grads) {
  const int64_t batch = cache.h.shape().rank() == 3 ? cache.h.shape()[0] : 0;
  if (cache.h.shape().rank() != 3 || cache.h.shape()[1] != 1) {
    throw ShapeError(fmt::format("cache: expected the cache of one step (states [B, 1, {}]), got states {}",
                                 config_.hidden_size, cache.h.shape().str()));
  }
  check_shape("dh_next", dh_next.shape, Shape{batch, config_.hidden_size});
  if (grads.dx) check_shape("dx", grads.dx->shape, Shape{batch, config_.input_size});
  if (grads.dh) check_shape("dh", grads.dh->shape, Shape{batch, config_.hidden_size});
  // The output of the step is h' itself: its gradient arrives as dh_n, and y has none of its own.
  const Tensor<T> no_dy(cache.h.shape());
  backward(cache, {.dy = no_dy.cview(), .dh_n = dh_next}, {.dx = as_one_step(grads.dx), .dh0 = grads.dh});
}

template <class T>
void Gru<T>::zero_grad() {
  for (Parameter<T>* p : {&w_ih_, &w_hh_, &b_ih_, &b_hh_}) p->zero_grad();
}

template <class T>
std::vector<ParameterRef<T>> Gru<T>::parameters() {
  return recurrent::parameters<ParameterRef<T>>(w_ih_, w_hh_, b_ih_, b_hh_, config_.bias, config_.reverse);
}

template <class T>
std::vector<ParameterRef<const T>> Gru<T>::parameters() const {
  return recurrent::parameters<ParameterRef<const T>>(w_ih_, w_hh_, b_ih_, b_hh_, config_.bias, config_.reverse);
}

namespace {

GruConfig direction_config(const GruConfig& config, bool reverse) {
  if (config.reverse) {
    throw ValueError(
        "reverse: expected false for a bidirectional GRU (config describes its forward direction), got true");
  }
  GruConfig result = config;
  result.reverse = reverse;
  return result;
}

}  // namespace

template <class T>
BidirectionalGru<T>::BidirectionalGru(const GruConfig& config, Rng& rng)
    : forward_(direction_config(config, false), rng), reverse_(direction_config(config, true), rng) {}

template <class T>
RecurrentOutputs<T> BidirectionalGru<T>::forward(const RecurrentInputs<T>& inputs,
                                                 BidirectionalGruCache<T>& cache) const {
  const int64_t hidden = forward_.config().hidden_size;
  if (inputs.h0 && inputs.x.rank() == 3) check_shape("h0", inputs.h0->shape, Shape{2, inputs.x.shape[0], hidden});
  const auto h0_of = [&](int64_t index) {
    return inputs.h0 ? std::optional(direction_slice(*inputs.h0, index)) : std::nullopt;
  };
  const RecurrentOutputs<T> ahead =
      forward_.forward({.x = inputs.x, .h0 = h0_of(0), .lengths = inputs.lengths}, cache.forward);
  const RecurrentOutputs<T> behind =
      reverse_.forward({.x = inputs.x, .h0 = h0_of(1), .lengths = inputs.lengths}, cache.reverse);
  const int64_t batch = ahead.y.shape()[0];
  const int64_t steps = ahead.y.shape()[1];
  RecurrentOutputs<T> outputs{.y = Tensor<T>(Shape{batch, steps, 2 * hidden}),
                              .h_n = Tensor<T>(Shape{2, batch, hidden})};
  for (int64_t row = 0; row < batch * steps; ++row) {
    std::copy_n(ahead.y.data() + row * hidden, hidden, outputs.y.data() + row * 2 * hidden);
    std::copy_n(behind.y.data() + row * hidden, hidden, outputs.y.data() + row * 2 * hidden + hidden);
  }
  std::copy_n(ahead.h_n.data(), batch * hidden, outputs.h_n.data());
  std::copy_n(behind.h_n.data(), batch * hidden, outputs.h_n.data() + batch * hidden);
  return outputs;
}

template <class T>
void BidirectionalGru<T>::backward(const BidirectionalGruCache<T>& cache,
                                   const RecurrentOutputGradients<T>& output_grads,
                                   const RecurrentInputGradients<T>& input_grads) {
  const int64_t hidden = forward_.config().hidden_size;
  const int64_t batch = cache.forward.h.shape()[0];
  const int64_t steps = cache.forward.h.shape()[1];
  check_shape("dy", output_grads.dy.shape, Shape{batch, steps, 2 * hidden});
  const Shape states{2, batch, hidden};
  if (output_grads.dh_n) check_shape("dh_n", output_grads.dh_n->shape, states);
  if (input_grads.dh0) check_shape("dh0", input_grads.dh0->shape, states);
  for (int64_t index : {0, 1}) {
    Gru<T>& gru = index == 0 ? forward_ : reverse_;
    const RecurrentOutputGradients<T> out{
        .dy = feature_slice(output_grads.dy, index * hidden, hidden),
        .dh_n = output_grads.dh_n ? std::optional(direction_slice(*output_grads.dh_n, index)) : std::nullopt};
    const RecurrentInputGradients<T> in{
        .dx = input_grads.dx,
        .dh0 = input_grads.dh0 ? std::optional(direction_slice(*input_grads.dh0, index)) : std::nullopt};
    gru.backward(index == 0 ? cache.forward : cache.reverse, out, in);
  }
}

template <class T>
void BidirectionalGru<T>::zero_grad() {
  forward_.zero_grad();
  reverse_.zero_grad();
}

template <class T>
std::vector<ParameterRef<T>> BidirectionalGru<T>::parameters() {
  std::vector<ParameterRef<T>> result = forward_.parameters();
  for (ParameterRef<T>& p : reverse_.parameters()) result.push_back(std::move(p));
  return result;
}

template <class T>
std::vector<ParameterRef<const T>> BidirectionalGru<T>::parameters() const {
  std::vector<ParameterRef<const T>> result = forward_.parameters();
  for (ParameterRef<const T>& p : reverse_.parameters()) result.push_back(std::move(p));
  return result;
}

template struct GruCache<float>;
template struct GruCache<double>;
template class Gru<float>;
template class Gru<double>;
template struct BidirectionalGruCache<float>;
template struct BidirectionalGruCache<double>;
template class BidirectionalGru<float>;
template class BidirectionalGru<double>;

}  // namespace qkv
