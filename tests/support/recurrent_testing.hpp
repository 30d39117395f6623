#pragma once
// Test helpers shared by the recurrent layers' tests (test_rnn.cpp, test_gru.cpp): the cases they
// sweep, one forward run of a case, the finite-difference check of every gradient and the checks
// that hold for any layer with the interface of qkv::Rnn (forward, backward, zero_grad, parameters).

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qkv/core/parallel.hpp"
#include "qkv/nn/rnn.hpp"
#include "testing.hpp"

namespace qkv::testing::recurrent {

inline constexpr double kStep = 1e-5;  // the finite-difference step

struct Case {
  int64_t batch, steps, in, hidden;
  std::vector<int64_t> lengths;  // empty: all full
  bool reverse;
  bool bias;
};

inline std::string describe(const Case& c) {
  return fmt::format("B {} T {} In {} H {} lengths [{}] reverse {} bias {}", c.batch, c.steps, c.in, c.hidden,
                     fmt::join(c.lengths, ", "), c.reverse, c.bias);
}

inline std::optional<TensorView<const int64_t>> lengths_view(const Tensor<int64_t>& lengths) {
  return lengths.numel() > 0 ? std::optional(lengths.cview()) : std::nullopt;
}

template <class Layer>
Layer make_layer(const Case& c, Rng& rng) {
  return Layer({.input_size = c.in, .hidden_size = c.hidden, .bias = c.bias, .reverse = c.reverse}, rng);
}

// One forward of a case on random x [B, T, In] and h0 [B, H], drawn from rng after the layer.
template <class T>
struct CaseRun {
  Tensor<T> x, h0;
  std::vector<int64_t> lengths;  // [B]: every len_b, T where the case gives none
  RecurrentOutputs<T> out;
};

template <class T, class Layer, class Cache>
CaseRun<T> run_case(const Layer& layer, const Case& c, Rng& rng) {
  CaseRun<T> run{.x = random_tensor<T>(Shape{c.batch, c.steps, c.in}, rng),
                 .h0 = random_tensor<T>(Shape{c.batch, c.hidden}, rng),
                 .lengths = c.lengths.empty() ? std::vector<int64_t>(static_cast<size_t>(c.batch), c.steps) : c.lengths,
                 .out = {}};
  const Tensor<int64_t> lengths(Shape{static_cast<int64_t>(c.lengths.size())}, c.lengths);
  Cache cache;
  run.out = layer.forward({.x = run.x.cview(), .h0 = run.h0.cview(), .lengths = lengths_view(lengths)}, cache);
  return run;
}

// A layer's parameters in float64, in PyTorch's order; zero biases when the layer has none.
struct Weights {
  Tensor<double> w_ih, w_hh, b_ih, b_hh;
};

template <class Layer>
Weights weights_of(const Layer& layer) {
  const auto params = layer.parameters();
  const int64_t rows = params[0].value.shape[0];  // gates · H
  const auto as_double = [](const auto& view) { return to_tensor<double>(view); };
  return {as_double(params[0].value), as_double(params[1].value),
          params.size() > 2 ? as_double(params[2].value) : Tensor<double>(Shape{rows}),
          params.size() > 2 ? as_double(params[3].value) : Tensor<double>(Shape{rows})};
}

template <class Acc>
struct NaiveOutputs {
  Tensor<Acc> y, h_n;
};

// A cell run by the definition, one sequence and one step at a time: the state starts at h0 [B, H],
// step s of sequence b reads x_t (t = s, or len_b − 1 − s when reversed) and
// cell(x_t, h) (x_t the In values of x [B, T, In]) returns the next state. y [B, T, H] holds each
// state (0 past a sequence's length), h_n [B, H] the last.
template <class Acc, class Cell>
NaiveOutputs<Acc> naive_recurrence(const Tensor<double>& x, const Tensor<double>& h0,
                                   const std::vector<int64_t>& lengths, bool reverse, const Cell& cell) {
  const int64_t batch = x.shape()[0], steps = x.shape()[1], in = x.shape()[2], hidden = h0.shape()[1];
  NaiveOutputs<Acc> out{Tensor<Acc>(Shape{batch, steps, hidden}), Tensor<Acc>(Shape{batch, hidden})};
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<Acc> h(static_cast<size_t>(hidden));
    for (int64_t j = 0; j < hidden; ++j) h[static_cast<size_t>(j)] = static_cast<Acc>(h0[b * hidden + j]);
    const int64_t length = lengths[static_cast<size_t>(b)];
    for (int64_t s = 0; s < length; ++s) {
      const int64_t t = reverse ? length - 1 - s : s;
      h = cell(x.data() + (b * steps + t) * in, h);
      for (int64_t j = 0; j < hidden; ++j) out.y[(b * steps + t) * hidden + j] = h[static_cast<size_t>(j)];
    }
    for (int64_t j = 0; j < hidden; ++j) out.h_n[b * hidden + j] = h[static_cast<size_t>(j)];
  }
  return out;
}

// A layer's traits for the reference tests below: Layer<T> and Cache<T> (from LayerTypes), and
// naive<Acc>(x, h0, lengths, weights, reverse), the layer by the definition with every operation in Acc.
template <template <class> class LayerOf, template <class> class CacheOf>
struct LayerTypes {
  template <class T>
  using Layer = LayerOf<T>;
  template <class T>
  using Cache = CacheOf<T>;
};

// The float64 layer against its float64 definition, within tolerance(case), on cases that sweep
// reversal, lengths (0 included), no bias, T = In = H = 1 and In = 113.
template <class Traits, class Tolerance>
void check_double_matches_reference(uint64_t seed, const Tolerance& tolerance) {
  Rng rng(seed);
  for (const Case& c : std::vector<Case>{{2, 5, 3, 4, {}, false, true},
                                         {3, 7, 113, 7, {7, 0, 3}, true, true},
                                         {1, 1, 1, 1, {}, false, false},
                                         {4, 9, 5, 33, {9, 1, 8, 4}, false, true}}) {
    SCOPED_TRACE(describe(c));
    const auto layer = make_layer<typename Traits::template Layer<double>>(c, rng);
    const auto run = run_case<double, typename Traits::template Layer<double>, typename Traits::template Cache<double>>(
        layer, c, rng);
    const NaiveOutputs<double> ref =
        Traits::template naive<double>(run.x, run.h0, run.lengths, weights_of(layer), c.reverse);
    EXPECT_TRUE(all_close("y", run.out.y, ref.y, tolerance(c)));
    EXPECT_TRUE(all_close("h_n", run.out.h_n, ref.h_n, tolerance(c)));
  }
}

// The float32 layer against the float64 definition, within a multiple of the naive float32 error.
template <class Traits>
void check_float_matches_reference(uint64_t seed) {
  Rng rng(seed);
  for (const Case& c : std::vector<Case>{{2, 6, 113, 16, {6, 3}, false, true}, {3, 11, 7, 9, {}, true, true}}) {
    SCOPED_TRACE(describe(c));
    const auto layer = make_layer<typename Traits::template Layer<float>>(c, rng);
    const auto run =
        run_case<float, typename Traits::template Layer<float>, typename Traits::template Cache<float>>(layer, c, rng);
    const Tensor<double> x = cast<double>(run.x), h0 = cast<double>(run.h0);
    const Weights w = weights_of(layer);
    const NaiveOutputs<double> exact = Traits::template naive<double>(x, h0, run.lengths, w, c.reverse);
    const NaiveOutputs<float> naive = Traits::template naive<float>(x, h0, run.lengths, w, c.reverse);
    EXPECT_TRUE(all_close("y", run.out.y, exact.y, tolerance_from_naive(naive.y, exact.y)));
    EXPECT_TRUE(all_close("h_n", run.out.h_n, exact.h_n, tolerance_from_naive(naive.h_n, exact.h_n)));
  }
}

// The tensors of the PyTorch parity tests, which both sides build from a formula rather than a file:
// element k is 0.5·sin(1.3·k + salt).
inline Tensor<double> formula(const Shape& shape, double salt) {
  Tensor<double> t(shape);
  for (int64_t k = 0; k < t.numel(); ++k) t[k] = 0.5 * std::sin(1.3 * static_cast<double>(k) + salt);
  return t;
}

// Sets the i-th parameter (in PyTorch's order) to formula(its shape, i + 1), as the scripts do.
inline void set_parameters_by_formula(const std::vector<ParameterRef<double>>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor<double> values = formula(params[i].value.shape, static_cast<double>(i + 1));
    std::copy(values.values().begin(), values.values().end(), params[i].value.data);
  }
}

// A gradient's projection on cos(0.7·k): a short expected value that any wrong element would move.
inline double probe(TensorView<const double> grad) {
  const Tensor<double> g = to_tensor<double, double>(grad);
  double sum = 0.0;
  for (int64_t k = 0; k < g.numel(); ++k) sum += g[k] * std::cos(0.7 * static_cast<double>(k));
  return sum;
}

inline double abs_sum(const Tensor<double>& t) {
  double sum = 0.0;
  for (double e : t.values()) sum += std::abs(e);
  return sum;
}

// The error bound of central differences with step h on L = <dy, y> + <dh_n, h_n>: the rounding of
// the two evaluations of L over 2h — each output sums `depth` terms of at most unit magnitude
// (states are tanh-bounded, inputs and weights of unit scale), weighted by Σ|dy| + Σ|dh_n| — plus
// the truncation h²/6·|L'''|, where every third derivative of a chain of σ and tanh (each with
// derivatives at most 2 in magnitude up to the third) is bounded by the same weighted depth.
inline double fd_tolerance(double depth, double weight) {
  return depth * weight * (std::numeric_limits<double>::epsilon() / kStep + kStep * kStep);
}

// Every gradient of L = <dy, y> + <dh_n, h_n> against central differences: x, h0 and each
// parameter. `depth` is the number of terms each output sums over all steps (see fd_tolerance).
template <class Layer, class Cache>
void check_gradients(const Case& c, uint64_t seed, double depth) {
  SCOPED_TRACE(describe(c));
  Rng rng(seed);
  Layer layer = make_layer<Layer>(c, rng);
  Tensor<double> x = random_tensor<double>(Shape{c.batch, c.steps, c.in}, rng);
  Tensor<double> h0 = random_tensor<double>(Shape{c.batch, c.hidden}, rng);
  const Tensor<int64_t> lengths(Shape{static_cast<int64_t>(c.lengths.size())}, c.lengths);
  const Tensor<double> dy = random_tensor<double>(Shape{c.batch, c.steps, c.hidden}, rng);
  const Tensor<double> dh_n = random_tensor<double>(Shape{c.batch, c.hidden}, rng);
  const RecurrentInputs<double> inputs{.x = x.cview(), .h0 = h0.cview(), .lengths = lengths_view(lengths)};
  const auto loss = [&] {
    Cache cache;
    const RecurrentOutputs<double> out = layer.forward(inputs, cache);
    return dot(dy, out.y) + dot(dh_n, out.h_n);
  };

  Cache cache;
  layer.forward(inputs, cache);
  Tensor<double> dx(x.shape()), dh0(h0.shape());
  layer.backward(cache, {.dy = dy.cview(), .dh_n = dh_n.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});

  const double tolerance = fd_tolerance(depth, abs_sum(dy) + abs_sum(dh_n));
  EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x, kStep), tolerance));
  EXPECT_TRUE(all_close("dh0", dh0, numeric_gradient(loss, h0, kStep), tolerance));
  for (const ParameterRef<double>& p : layer.parameters()) {
    EXPECT_TRUE(
        all_close("d" + p.name, to_tensor<double, double>(p.grad), numeric_gradient(loss, p.value, kStep), tolerance));
  }
}

// backward adds into dx, dh0 and the parameter gradients, and zero_grad clears the latter.
template <class Layer, class Cache>
void check_backward_adds_into_gradients(uint64_t seed) {
  Rng rng(seed);
  Layer layer({.input_size = 3, .hidden_size = 4}, rng);
  const Tensor<double> x = random_tensor<double>(Shape{2, 3, 3}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{2, 3, 4}, rng);
  Cache cache;
  layer.forward({.x = x.cview()}, cache);
  Tensor<double> dx(x.shape()), dh0(Shape{2, 4});
  layer.backward(cache, {.dy = dy.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});
  std::vector<Tensor<double>> first;
  for (const ParameterRef<double>& p : layer.parameters()) first.push_back(to_tensor<double, double>(p.grad));

  Tensor<double> dx2(x.shape(), 1.0), dh02(Shape{2, 4}, 1.0);
  layer.backward(cache, {.dy = dy.cview()}, {.dx = dx2.view(), .dh0 = dh02.view()});
  for (double& e : dx.values()) e += 1.0;
  for (double& e : dh0.values()) e += 1.0;
  EXPECT_TRUE(all_close("dx", dx2, dx, 0.0));
  EXPECT_TRUE(all_close("dh0", dh02, dh0, 0.0));
  const std::vector<ParameterRef<double>> params = layer.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor<double> twice = first[i];
    for (double& e : twice.values()) e *= 2.0;
    EXPECT_TRUE(all_close("d" + params[i].name, to_tensor<double, double>(params[i].grad), twice, 0.0));
  }
  layer.zero_grad();
  for (const ParameterRef<double>& p : layer.parameters()) {
    EXPECT_TRUE(all_close("d" + p.name, to_tensor<double, double>(p.grad), Tensor<double>(p.grad.shape), 0.0));
  }
}

struct Sizes {
  int64_t batch, steps, in, hidden;
};

// Results depend only on the inputs: one, two and three threads give the same bits, for each of
// `sizes` (a large batch splits the batch among threads, one long sequence splits its rows).
template <class Layer, class Cache>
void check_thread_count_does_not_change_results(const std::vector<Sizes>& sizes, uint64_t seed) {
  const int original_workers = max_workers();
  for (const Sizes& s : sizes) {
    SCOPED_TRACE(::testing::Message() << "B " << s.batch << " H " << s.hidden);
    std::vector<std::vector<float>> reference;
    for (int threads : {1, 2, 3}) {
      set_max_workers(threads);
      Rng rng(seed);
      Layer layer({.input_size = s.in, .hidden_size = s.hidden}, rng);
      const Tensor<float> x = random_tensor<float>(Shape{s.batch, s.steps, s.in}, rng);
      const Tensor<float> dy = random_tensor<float>(Shape{s.batch, s.steps, s.hidden}, rng);
      Cache cache;
      const RecurrentOutputs<float> out = layer.forward({.x = x.cview()}, cache);
      Tensor<float> dx(x.shape()), dh0(Shape{s.batch, s.hidden});
      layer.backward(cache, {.dy = dy.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});
      std::vector<std::vector<float>> results{out.y.values(), dx.values(), dh0.values()};
      for (const ParameterRef<float>& p : layer.parameters())
        results.push_back(to_tensor<float, float>(p.grad).values());
      if (reference.empty()) {
        reference = results;
      } else {
        for (size_t i = 0; i < results.size(); ++i)
          EXPECT_EQ(results[i], reference[i]) << "result " << i << ", " << threads << " threads";
      }
    }
  }
  set_max_workers(original_workers);
}

// Every parameter is drawn in PyTorch's order from one stream, each U(−1/√H, 1/√H), with PyTorch's
// names and the given shapes, and its gradient starts at 0.
template <class Layer>
void check_init_follows_pytorch(const Layer& layer, uint64_t seed, int64_t hidden, const std::vector<Shape>& shapes) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden));
  Rng replay(seed);
  const std::vector<std::string> names{"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"};
  const std::vector<ParameterRef<const float>> params = layer.parameters();
  ASSERT_EQ(params.size(), 4u);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].name, names[i]);
    EXPECT_EQ(params[i].value.shape, shapes[i]);
    Tensor<float> expected(shapes[i]);
    replay.fill_uniform(expected.view(), -bound, bound);
    EXPECT_TRUE(all_close(params[i].name, to_tensor<float, float>(params[i].value), expected, 0.0));
    EXPECT_TRUE(
        all_close("d" + params[i].name, to_tensor<float, float>(params[i].grad), Tensor<float>(shapes[i]), 0.0));
  }
}

}  // namespace qkv::testing::recurrent
