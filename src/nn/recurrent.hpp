#pragma once
// Internal to rnn.cpp and gru.cpp: the argument checks, step order and batched matrix-vector
// product that the recurrent layers share. Not installed.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/core/detail/rows.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/parameter.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/nn/rnn.hpp"
#include "qkv/ops/linear.hpp"

namespace qkv::recurrent {

// The cost of one tanh or sigmoid in multiply-adds, to size the tasks of elementwise phases.
inline constexpr int64_t kNonlinearityWork = 16;

struct Sizes {
  int64_t batch = 0;   // B
  int64_t steps = 0;   // T
  int64_t input = 0;   // In
  int64_t hidden = 0;  // H
};

// Checks config (In >= 0, H >= 1) and draws the parameters of a cell of `gates` gates, W_ih
// [gates·H, In], W_hh [gates·H, H] and, with config.bias, b_ih and b_hh [gates·H], each from
// U(−1/√H, 1/√H) in PyTorch's order, as torch.nn.RNN and torch.nn.GRU do.
template <class T, class Config>
void init_parameters(const Config& config, int64_t gates, Rng& rng, Parameter<T>& w_ih, Parameter<T>& w_hh,
                     Parameter<T>& b_ih, Parameter<T>& b_hh) {
  if (config.input_size < 0)
    throw ValueError(fmt::format("input_size: expected at least 0, got {}", config.input_size));
  if (config.hidden_size < 1) {
    throw ValueError(fmt::format("hidden_size: expected at least 1, got {}", config.hidden_size));
  }
  const int64_t h = config.hidden_size;
  w_ih = Parameter<T>(Shape{gates * h, config.input_size});
  w_hh = Parameter<T>(Shape{gates * h, h});
  const double bound = 1.0 / std::sqrt(static_cast<double>(h));
  rng.fill_uniform(w_ih.value.view(), -bound, bound);
  rng.fill_uniform(w_hh.value.view(), -bound, bound);
  if (config.bias) {
    b_ih = Parameter<T>(Shape{gates * h});
    b_hh = Parameter<T>(Shape{gates * h});
    rng.fill_uniform(b_ih.value.view(), -bound, bound);
    rng.fill_uniform(b_hh.value.view(), -bound, bound);
  }
}

// Checks x [B, T, In] and h0 [B, H] and reads the lengths into `lengths` (all T when absent),
// throwing ShapeError or ValueError naming the argument.
template <class T>
Sizes check_inputs(const RecurrentInputs<T>& inputs, int64_t input_size, int64_t hidden_size,
                   std::vector<int64_t>& lengths) {
  const TensorView<const T>& x = inputs.x;
  if (x.rank() != 3 || x.shape[2] != input_size) {
    throw ShapeError(fmt::format("x: expected shape [B, T, {}], got {}", input_size, x.shape.str()));
  }
  const Sizes sizes{.batch = x.shape[0], .steps = x.shape[1], .input = input_size, .hidden = hidden_size};
  if (inputs.h0) check_shape("h0", inputs.h0->shape, Shape{sizes.batch, hidden_size});
  lengths.assign(static_cast<size_t>(sizes.batch), sizes.steps);
  if (inputs.lengths) {
    check_shape("lengths", inputs.lengths->shape, Shape{sizes.batch});
    for (int64_t b = 0; b < sizes.batch; ++b) {
      const int64_t length = (*inputs.lengths)(b);
      if (length < 0 || length > sizes.steps) {
        throw ValueError(fmt::format("lengths: expected values in [0, {}] (T of x {}), got {} at [{}]", sizes.steps,
                                     x.shape.str(), length, b));
      }
      lengths[static_cast<size_t>(b)] = length;
    }
  }
  return sizes;
}

// Checks the backward's arguments against the forward's sizes: dy and dx against y_shape and x's,
// dh_n and dh0 against state_shape.
template <class T>
void check_gradients(const RecurrentOutputGradients<T>& output_grads, const RecurrentInputGradients<T>& input_grads,
                     const Shape& x_shape, const Shape& y_shape, const Shape& state_shape) {
  check_shape("dy", output_grads.dy.shape, y_shape);
  if (output_grads.dh_n) check_shape("dh_n", output_grads.dh_n->shape, state_shape);
  if (input_grads.dx) check_shape("dx", input_grads.dx->shape, x_shape);
  if (input_grads.dh0) check_shape("dh0", input_grads.dh0->shape, state_shape);
}

// The position read at step s (0-based, s < length) of a sequence of `length` tokens.
inline int64_t time_of(int64_t step, int64_t length, bool reverse) { return reverse ? length - 1 - step : step; }

// The state each sequence reads at step s, for the states h [B, T, H] and h0 [B, H]: h0 at its first
// step, the previous step's state after it, and null for a sequence that has no step s.
template <class T>
void previous_states(int64_t step, const std::vector<int64_t>& lengths, bool reverse, const Tensor<T>& h0,
                     const Tensor<T>& h, std::vector<const T*>& prev) {
  const int64_t steps = h.shape()[1];
  const int64_t hidden = h.shape()[2];
  for (size_t b = 0; b < lengths.size(); ++b) {
    const auto batch = static_cast<int64_t>(b);
    if (step >= lengths[b]) {
      prev[b] = nullptr;
    } else {
      prev[b] = step == 0 ? h0.data() + batch * hidden
                          : h.data() + (batch * steps + time_of(step - 1, lengths[b], reverse)) * hidden;
    }
  }
}

// h_{t−1} of every step t, [B, T, H] (0 past a sequence's length), for the weight gradients.
template <class T>
Tensor<T> shifted_states(const std::vector<int64_t>& lengths, bool reverse, const Tensor<T>& h0, const Tensor<T>& h) {
  const int64_t steps = h.shape()[1];
  const int64_t hidden = h.shape()[2];
  Tensor<T> result(h.shape());
  std::vector<const T*> prev(lengths.size());
  for (int64_t s = 0; s < steps; ++s) {
    previous_states(s, lengths, reverse, h0, h, prev);
    for (size_t b = 0; b < lengths.size(); ++b) {
      if (prev[b] == nullptr) continue;
      const int64_t t = time_of(s, lengths[b], reverse);
      std::copy_n(prev[b], hidden, result.data() + (static_cast<int64_t>(b) * steps + t) * hidden);
    }
  }
  return result;
}

// h_n [B, H]: each sequence's state after its last step (h0 when it has none), of h [B, T, H].
template <class T>
Tensor<T> final_states(const std::vector<int64_t>& lengths, bool reverse, const Tensor<T>& h0, const Tensor<T>& h) {
  const int64_t steps = h.shape()[1];
  const int64_t hidden = h.shape()[2];
  Tensor<T> result(Shape{h.shape()[0], hidden});
  for (size_t b = 0; b < lengths.size(); ++b) {
    const auto batch = static_cast<int64_t>(b);
    const int64_t length = lengths[b];
    const T* last = length > 0 ? h.data() + (batch * steps + time_of(length - 1, length, reverse)) * hidden
                               : h0.data() + batch * hidden;
    std::copy_n(last, hidden, result.data() + batch * hidden);
  }
  return result;
}

// ∂L/∂h of the last step, [B, H] in float64: dh_n, or 0 when absent.
template <class T>
Tensor<double> initial_carry(const std::optional<TensorView<const T>>& dh_n, int64_t batch, int64_t hidden) {
  Tensor<double> carry(Shape{batch, hidden});
  if (dh_n) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < hidden; ++j) carry[b * hidden + j] = static_cast<double>((*dh_n)(b, j));
  }
  return carry;
}

// dh0 += the carry left after the first step, when dh0 is wanted.
template <class T>
void add_carry(const Tensor<double>& carry, const std::optional<TensorView<T>>& dh0) {
  if (!dh0) return;
  const int64_t batch = carry.shape()[0];
  const int64_t hidden = carry.shape()[1];
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < hidden; ++j) (*dh0)(b, j) += static_cast<T>(carry[b * hidden + j]);
}

// x [B, T, C] → x wᵀ + b [B, T, R] for w [R, C] (b only when `bias`): the input projections of
// every step in one linear_forward.
template <class T>
Tensor<T> project(const Tensor<T>& x, const Parameter<T>& w, const Parameter<T>& b, bool bias) {
  Tensor<T> result(Shape{x.shape()[0], x.shape()[1], w.value.shape()[0]});
  linear_forward<T>({.x = x.cview(), .w = w.value.cview(), .b = bias ? std::optional(b.value.cview()) : std::nullopt},
                    result.view());
  return result;
}

// The backward of project for dy [B, T, R], summed over all steps: w.grad and (with `bias`)
// b.grad += theirs, and dx [B, T, C] += its gradient when given.
template <class T>
void project_backward(const Tensor<T>& x, const Tensor<T>& dy, Parameter<T>& w, Parameter<T>& b, bool bias,
                      const std::optional<TensorView<T>>& dx) {
  linear_backward<T>({.x = x.cview(), .w = w.value.cview(), .b = bias ? std::optional(b.value.cview()) : std::nullopt},
                     dy.cview(),
                     {.dx = dx, .dw = w.grad.view(), .db = bias ? std::optional(b.grad.view()) : std::nullopt});
}

// Σ_i a_i b_i in float64 over four interleaved partial sums (fixed, so the result does not depend
// on the caller; independent sums let the compiler vectorise without reassociating).
template <class T>
double dot(const T* a, const T* b, int64_t n) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    s1 += static_cast<double>(a[i + 1]) * static_cast<double>(b[i + 1]);
    s2 += static_cast<double>(a[i + 2]) * static_cast<double>(b[i + 2]);
    s3 += static_cast<double>(a[i + 3]) * static_cast<double>(b[i + 3]);
  }
  for (; i < n; ++i) s0 += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return (s0 + s1) + (s2 + s3);
}

// out[b, r] = Σ_c w[r, c] · v_b[c] for every b whose v_b is not null (the others are left alone).
// w is [R, C], contiguous; out is [B, R]. Tasks are (batch element, block of rows): with many
// sequences each task is one element, with one long sequence the rows are split among threads.
template <class T>
void matvec(const Tensor<T>& w, std::span<const T* const> vectors, Tensor<double>& out) {
  const int64_t rows = w.shape()[0];
  const int64_t cols = w.shape()[1];
  const auto batch = static_cast<int64_t>(vectors.size());
  const int64_t blocks = std::clamp<int64_t>(rows * cols / kTaskWork, 1, std::max<int64_t>(rows, 1));
  const int64_t rows_per_block = (rows + blocks - 1) / std::max<int64_t>(blocks, 1);
  // Small batches of small matrices share a task rather than pay a parallel region per step.
  const int64_t elements_per_task =
      blocks > 1 ? 1 : std::max<int64_t>(1, kTaskWork / std::max<int64_t>(rows * cols, 1));
  const int64_t element_tasks = (batch + elements_per_task - 1) / elements_per_task;
  parallel_for(
      element_tasks * blocks,
      [&](int64_t task, int /*worker*/) {
        const int64_t first = (task / blocks) * elements_per_task;
        const int64_t block = task % blocks;
        const int64_t row_end = std::min(rows, (block + 1) * rows_per_block);
        for (int64_t b = first; b < std::min(batch, first + elements_per_task); ++b) {
          const T* v = vectors[static_cast<size_t>(b)];
          if (v == nullptr) continue;
          double* out_row = out.data() + b * rows;
          for (int64_t r = block * rows_per_block; r < row_end; ++r) out_row[r] = dot(w.data() + r * cols, v, cols);
        }
      },
      thread_limit(static_cast<double>(batch) * static_cast<double>(rows * cols)));
}

// w [R, C] as a contiguous [C, R], so that wᵀ v reads rows.
template <class T>
Tensor<T> transposed(const Tensor<T>& w) {
  const int64_t rows = w.shape()[0];
  const int64_t cols = w.shape()[1];
  Tensor<T> result(Shape{cols, rows});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) result[c * rows + r] = w[r * cols + c];
  return result;
}

// PyTorch's names for the parameters of layer 0, in its order, for the parameters present.
template <class Ref, class Param>
std::vector<Ref> parameters(Param& w_ih, Param& w_hh, Param& b_ih, Param& b_hh, bool bias, bool reverse) {
  const char* suffix = reverse ? "_reverse" : "";
  std::vector<Ref> result{w_ih.ref(fmt::format("weight_ih_l0{}", suffix)),
                          w_hh.ref(fmt::format("weight_hh_l0{}", suffix))};
  if (bias) {
    result.push_back(b_ih.ref(fmt::format("bias_ih_l0{}", suffix)));
    result.push_back(b_hh.ref(fmt::format("bias_hh_l0{}", suffix)));
  }
  return result;
}

}  // namespace qkv::recurrent
