#include "qkv/nn/rnn.hpp"

#include <cmath>
#include <span>

#include "recurrent.hpp"

namespace qkv {

using recurrent::kNonlinearityWork;
using recurrent::time_of;

template <class T>
Rnn<T>::Rnn(const RnnConfig& config, Rng& rng) : config_(config) {
  recurrent::init_parameters(config, 1, rng, w_ih_, w_hh_, b_ih_, b_hh_);
}

// Step s of every sequence at once: the batched product W_hh h_{prev} (every sequence that has a
// step s), then h = tanh(xp + b_hh + W_hh h_prev) elementwise. xp = W_ih x + b_ih for every step
// was computed before the loop by one linear_forward.
template <class T>
RecurrentOutputs<T> Rnn<T>::forward(const RecurrentInputs<T>& inputs, RnnCache<T>& cache) const {
  const int64_t hidden = config_.hidden_size;
  const recurrent::Sizes n = recurrent::check_inputs<T>(inputs, config_.input_size, hidden, cache.lengths);
  cache.x = to_tensor<T, T>(inputs.x);
  cache.h0 = inputs.h0 ? to_tensor<T, T>(*inputs.h0) : Tensor<T>(Shape{n.batch, hidden});
  cache.h = Tensor<T>(Shape{n.batch, n.steps, hidden});

  Tensor<T> xp = recurrent::project(cache.x, w_ih_, b_ih_, config_.bias);

  const auto row = [&](Tensor<T>& t, int64_t b, int64_t time) { return t.data() + (b * n.steps + time) * hidden; };
  std::vector<const T*> prev(static_cast<size_t>(n.batch));
  Tensor<double> recurrent_part(Shape{n.batch, hidden});
  for (int64_t s = 0; s < n.steps; ++s) {
    recurrent::previous_states(s, cache.lengths, config_.reverse, cache.h0, cache.h, prev);
    recurrent::matvec(w_hh_.value, std::span<const T* const>(prev), recurrent_part);
    parallel_for_blocks(n.batch, hidden * kNonlinearityWork, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        if (prev[static_cast<size_t>(b)] == nullptr) continue;
        const int64_t t = time_of(s, cache.lengths[static_cast<size_t>(b)], config_.reverse);
        const T* xp_row = row(xp, b, t);
        const double* wh = recurrent_part.data() + b * hidden;
        T* h_row = row(cache.h, b, t);
        for (int64_t j = 0; j < hidden; ++j) {
          const double bias = config_.bias ? static_cast<double>(b_hh_.value[j]) : 0.0;
          h_row[j] = static_cast<T>(std::tanh(static_cast<double>(xp_row[j]) + bias + wh[j]));
        }
      }
    });
  }

  return {.y = cache.h, .h_n = recurrent::final_states(cache.lengths, config_.reverse, cache.h0, cache.h)};
}

// With a_t = W_ih x_t + b_ih + W_hh h_{t−1} + b_hh and h_t = tanh(a_t), going back from the last
// step, the gradient reaching h_t is what y_t receives plus what step t + 1 hands back:
//   ∂L/∂h_t = dy_t + W_hhᵀ ∂L/∂a_{t+1}        (dh_n at the last step instead of W_hhᵀ ∂L/∂a)
//   ∂L/∂a_t = ∂L/∂h_t ∘ (1 − h_t²)            (tanh' = 1 − tanh²)
// and after the first step ∂L/∂h0 = W_hhᵀ ∂L/∂a_0. Every ∂L/∂a_t is kept, so the weights see all
// steps in one pass each afterwards:
//   dW_hh += Σ_t ∂L/∂a_t h_{t−1}ᵀ, db_hh += Σ_t ∂L/∂a_t     (linear_backward with x = h_{t−1})
//   dW_ih += Σ_t ∂L/∂a_t x_tᵀ,     db_ih += Σ_t ∂L/∂a_t,    dx_t += W_ihᵀ ∂L/∂a_t
template <class T>
void Rnn<T>::backward(const RnnCache<T>& cache, const RecurrentOutputGradients<T>& output_grads,
                      const RecurrentInputGradients<T>& input_grads) {
  const int64_t hidden = config_.hidden_size;
  const int64_t batch = cache.h.shape()[0];
  const int64_t steps = cache.h.shape()[1];
  recurrent::check_gradients(output_grads, input_grads, cache.x.shape(), cache.h.shape(), Shape{batch, hidden});

  Tensor<double> carry = recurrent::initial_carry(output_grads.dh_n, batch, hidden);  // ∂L/∂h_t from later steps
  Tensor<T> da(Shape{batch, steps, hidden});  // ∂L/∂a_t, 0 past a sequence's length
  const Tensor<T> w_hh_t = recurrent::transposed(w_hh_.value);
  const auto row = [&](const Tensor<T>& t, int64_t b, int64_t time) { return t.data() + (b * steps + time) * hidden; };
  std::vector<const T*> da_rows(static_cast<size_t>(batch));
  for (int64_t s = steps - 1; s >= 0; --s) {
    parallel_for_blocks(batch, hidden, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t length = cache.lengths[static_cast<size_t>(b)];
        if (s >= length) continue;
        const int64_t t = time_of(s, length, config_.reverse);
        const T* h_row = row(cache.h, b, t);
        T* da_row = da.data() + (b * steps + t) * hidden;
        for (int64_t j = 0; j < hidden; ++j) {
          const double dh = static_cast<double>(output_grads.dy(b, t, j)) + carry[b * hidden + j];
          const double h = static_cast<double>(h_row[j]);
          da_row[j] = static_cast<T>(dh * (1.0 - h * h));
        }
      }
    });
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t length = cache.lengths[static_cast<size_t>(b)];
      da_rows[static_cast<size_t>(b)] = s < length ? row(da, b, time_of(s, length, config_.reverse)) : nullptr;
    }
    // A sequence without step s keeps its carry: its first step backwards is still to come.
    recurrent::matvec(w_hh_t, std::span<const T* const>(da_rows), carry);
  }
  recurrent::add_carry(carry, input_grads.dh0);

  const Tensor<T> h_prev = recurrent::shifted_states(cache.lengths, config_.reverse, cache.h0, cache.h);
  recurrent::project_backward(h_prev, da, w_hh_, b_hh_, config_.bias, std::optional<TensorView<T>>());
  recurrent::project_backward(cache.x, da, w_ih_, b_ih_, config_.bias, input_grads.dx);
}

template <class T>
void Rnn<T>::zero_grad() {
  for (Parameter<T>* p : {&w_ih_, &w_hh_, &b_ih_, &b_hh_}) p->zero_grad();
}

template <class T>
std::vector<ParameterRef<T>> Rnn<T>::parameters() {
  return recurrent::parameters<ParameterRef<T>>(w_ih_, w_hh_, b_ih_, b_hh_, config_.bias, config_.reverse);
}

template <class T>
std::vector<ParameterRef<const T>> Rnn<T>::parameters() const {
  return recurrent::parameters<ParameterRef<const T>>(w_ih_, w_hh_, b_ih_, b_hh_, config_.bias, config_.reverse);
}

template struct RnnCache<float>;
template struct RnnCache<double>;
template class Rnn<float>;
template class Rnn<double>;

}  // namespace qkv
