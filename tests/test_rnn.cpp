#include "qkv/rnn.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/parallel.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::cast;
using testing::random_tensor;
using testing::throws_naming;
using testing::tolerance_from_naive;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();
constexpr double kStep = 1e-5;

// The parameters in float64, in PyTorch's order; zero biases when the layer has none.
struct Weights {
  Tensor<double> w_ih, w_hh, b_ih, b_hh;
};

template <class T>
Weights weights_of(const Rnn<T>& rnn) {
  const std::vector<ParameterRef<const T>> params = rnn.parameters();
  const int64_t hidden = rnn.config().hidden_size;
  return {to_tensor<double, T>(params[0].value), to_tensor<double, T>(params[1].value),
          params.size() > 2 ? to_tensor<double, T>(params[2].value) : Tensor<double>(Shape{hidden}),
          params.size() > 2 ? to_tensor<double, T>(params[3].value) : Tensor<double>(Shape{hidden})};
}

template <class Acc>
struct NaiveOutputs {
  Tensor<Acc> y, h_n;
};

// h_t = tanh(W_ih x_t + b_ih + W_hh h_{t−1} + b_hh) by the definition, one sequence and one step
// at a time, every operation in Acc: the float64 reference when Acc is double, the naive float32
// computation that sets the tolerance when Acc is float.
template <class Acc>
NaiveOutputs<Acc> naive_rnn(const Tensor<double>& x, const Tensor<double>& h0, const std::vector<int64_t>& lengths,
                            const Weights& w, bool reverse) {
  const int64_t batch = x.shape()[0], steps = x.shape()[1], in = x.shape()[2], hidden = h0.shape()[1];
  NaiveOutputs<Acc> out{Tensor<Acc>(Shape{batch, steps, hidden}), Tensor<Acc>(Shape{batch, hidden})};
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<Acc> h(static_cast<size_t>(hidden));
    for (int64_t j = 0; j < hidden; ++j) h[static_cast<size_t>(j)] = static_cast<Acc>(h0[b * hidden + j]);
    const int64_t length = lengths[static_cast<size_t>(b)];
    for (int64_t s = 0; s < length; ++s) {
      const int64_t t = reverse ? length - 1 - s : s;
      std::vector<Acc> next(static_cast<size_t>(hidden));
      for (int64_t j = 0; j < hidden; ++j) {
        Acc a = static_cast<Acc>(w.b_ih[j]) + static_cast<Acc>(w.b_hh[j]);
        for (int64_t i = 0; i < in; ++i) {
          a += static_cast<Acc>(w.w_ih[j * in + i]) * static_cast<Acc>(x[(b * steps + t) * in + i]);
        }
        for (int64_t i = 0; i < hidden; ++i) a += static_cast<Acc>(w.w_hh[j * hidden + i]) * h[static_cast<size_t>(i)];
        next[static_cast<size_t>(j)] = std::tanh(a);
      }
      h = next;
      for (int64_t j = 0; j < hidden; ++j) out.y[(b * steps + t) * hidden + j] = h[static_cast<size_t>(j)];
    }
    for (int64_t j = 0; j < hidden; ++j) out.h_n[b * hidden + j] = h[static_cast<size_t>(j)];
  }
  return out;
}

Tensor<double> numeric_gradient(const std::function<double()>& loss, TensorView<double> x) {
  Tensor<double> grad(x.shape);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double saved = x.data[i];
    x.data[i] = saved + kStep;
    const double up = loss();
    x.data[i] = saved - kStep;
    const double down = loss();
    x.data[i] = saved;
    grad[i] = (up - down) / (2.0 * kStep);
  }
  return grad;
}

double abs_sum(const Tensor<double>& t) {
  double sum = 0.0;
  for (double e : t.values()) sum += std::abs(e);
  return sum;
}

// Central differences with step h on L = <dy, y> + <dh_n, h_n>: the rounding of two evaluations of
// L over 2h (each output sums `depth` terms of unit magnitude, weighted by Σ|dy| + Σ|dh_n|) plus
// the truncation h²/6·|L'''| (tanh's first three derivatives are at most 2: the same weighted depth
// bounds it).
double fd_tolerance(double depth, double weight) { return depth * weight * (kEps64 / kStep + kStep * kStep); }

struct Case {
  int64_t batch, steps, in, hidden;
  std::vector<int64_t> lengths;  // empty: all full
  bool reverse;
  bool bias;
};

std::string describe(const Case& c) {
  return fmt::format("B {} T {} In {} H {} lengths [{}] reverse {} bias {}", c.batch, c.steps, c.in, c.hidden,
                     fmt::join(c.lengths, ", "), c.reverse, c.bias);
}

std::optional<TensorView<const int64_t>> lengths_view(const Tensor<int64_t>& lengths) {
  return lengths.numel() > 0 ? std::optional(lengths.cview()) : std::nullopt;
}

std::vector<int64_t> lengths_or_full(const std::vector<int64_t>& lengths, int64_t batch, int64_t steps) {
  return lengths.empty() ? std::vector<int64_t>(static_cast<size_t>(batch), steps) : lengths;
}

RnnConfig config_of(const Case& c) {
  return {.input_size = c.in, .hidden_size = c.hidden, .bias = c.bias, .reverse = c.reverse};
}

TEST(Rnn, DoubleMatchesFloat64Reference) {
  Rng rng(1);
  for (const Case& c : std::vector<Case>{{2, 5, 3, 4, {}, false, true},
                                         {3, 7, 113, 7, {7, 0, 3}, true, true},
                                         {1, 1, 1, 1, {}, false, false},
                                         {4, 9, 5, 33, {9, 1, 8, 4}, false, true}}) {
    SCOPED_TRACE(describe(c));
    Rnn<double> rnn(config_of(c), rng);
    const Tensor<double> x = random_tensor<double>(Shape{c.batch, c.steps, c.in}, rng);
    const Tensor<double> h0 = random_tensor<double>(Shape{c.batch, c.hidden}, rng);
    const Tensor<int64_t> lengths(Shape{static_cast<int64_t>(c.lengths.size())}, c.lengths);
    RnnCache<double> cache;
    const RecurrentOutputs<double> out =
        rnn.forward({.x = x.cview(), .h0 = h0.cview(), .lengths = lengths_view(lengths)}, cache);
    const NaiveOutputs<double> ref =
        naive_rnn<double>(x, h0, lengths_or_full(c.lengths, c.batch, c.steps), weights_of(rnn), c.reverse);
    // In + H + 2 products and sums per state, carried through T steps of a contraction (tanh' ≤ 1
    // times a W_hh of unit scale): a few ε per term and step.
    const double tolerance = 8.0 * static_cast<double>((c.in + c.hidden + 2) * c.steps) * kEps64;
    EXPECT_TRUE(all_close("y", out.y, ref.y, tolerance));
    EXPECT_TRUE(all_close("h_n", out.h_n, ref.h_n, tolerance));
  }
}

TEST(Rnn, FloatMatchesFloat64Reference) {
  Rng rng(2);
  for (const Case& c : std::vector<Case>{{2, 6, 113, 16, {6, 3}, false, true}, {3, 11, 7, 9, {}, true, true}}) {
    SCOPED_TRACE(describe(c));
    Rnn<float> rnn(config_of(c), rng);
    const Tensor<float> x = random_tensor<float>(Shape{c.batch, c.steps, c.in}, rng);
    const Tensor<float> h0 = random_tensor<float>(Shape{c.batch, c.hidden}, rng);
    const Tensor<int64_t> lengths(Shape{static_cast<int64_t>(c.lengths.size())}, c.lengths);
    RnnCache<float> cache;
    const RecurrentOutputs<float> out =
        rnn.forward({.x = x.cview(), .h0 = h0.cview(), .lengths = lengths_view(lengths)}, cache);
    const std::vector<int64_t> full = lengths_or_full(c.lengths, c.batch, c.steps);
    const Weights w = weights_of(rnn);
    const NaiveOutputs<double> exact = naive_rnn<double>(cast<double>(x), cast<double>(h0), full, w, c.reverse);
    const NaiveOutputs<float> naive = naive_rnn<float>(cast<double>(x), cast<double>(h0), full, w, c.reverse);
    EXPECT_TRUE(all_close("y", out.y, exact.y, tolerance_from_naive(naive.y, exact.y)));
    EXPECT_TRUE(all_close("h_n", out.h_n, exact.h_n, tolerance_from_naive(naive.h_n, exact.h_n)));
  }
}

// Every gradient of L = <dy, y> + <dh_n, h_n> against central differences: x, h0, each parameter.
void check_gradients(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  Rng rng(seed);
  Rnn<double> rnn(config_of(c), rng);
  Tensor<double> x = random_tensor<double>(Shape{c.batch, c.steps, c.in}, rng);
  Tensor<double> h0 = random_tensor<double>(Shape{c.batch, c.hidden}, rng);
  const Tensor<int64_t> lengths(Shape{static_cast<int64_t>(c.lengths.size())}, c.lengths);
  const Tensor<double> dy = random_tensor<double>(Shape{c.batch, c.steps, c.hidden}, rng);
  const Tensor<double> dh_n = random_tensor<double>(Shape{c.batch, c.hidden}, rng);
  const RecurrentInputs<double> inputs{.x = x.cview(), .h0 = h0.cview(), .lengths = lengths_view(lengths)};
  const auto loss = [&] {
    RnnCache<double> cache;
    const RecurrentOutputs<double> out = rnn.forward(inputs, cache);
    return testing::dot(dy, out.y) + testing::dot(dh_n, out.h_n);
  };

  RnnCache<double> cache;
  rnn.forward(inputs, cache);
  Tensor<double> dx(x.shape()), dh0(h0.shape());
  rnn.backward(cache, {.dy = dy.cview(), .dh_n = dh_n.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});

  const double tolerance =
      fd_tolerance(static_cast<double>(c.steps * (c.in + c.hidden + 2)), abs_sum(dy) + abs_sum(dh_n));
  EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x.view()), tolerance));
  EXPECT_TRUE(all_close("dh0", dh0, numeric_gradient(loss, h0.view()), tolerance));
  for (const ParameterRef<double>& p : rnn.parameters()) {
    EXPECT_TRUE(all_close("d" + p.name, to_tensor<double, double>(p.grad), numeric_gradient(loss, p.value), tolerance));
  }
}

TEST(Rnn, GradientsMatchFiniteDifferences) {
  check_gradients({2, 4, 3, 5, {}, false, true}, 3);
  check_gradients({3, 5, 2, 4, {5, 2, 0}, false, true}, 4);
  check_gradients({3, 5, 2, 4, {3, 5, 1}, true, true}, 5);
  check_gradients({2, 3, 3, 2, {}, false, false}, 6);
  check_gradients({1, 1, 1, 1, {}, false, true}, 7);
  check_gradients({1, 7, 1, 1, {}, true, true}, 8);
}

// The chain the seed speaks of: what reaches x_0 from the last output passes T − 1 factors
// W_hhᵀ diag(1 − h²). With one unit and W_hh = w, ∂h_{T−1}/∂x_0 = W_ih Π_t w (1 − h_t²) exactly.
TEST(Rnn, GradientThroughTimeIsTheProductOfTheSteps) {
  Rng rng(9);
  Rnn<double> rnn({.input_size = 1, .hidden_size = 1, .bias = false}, rng);
  const std::vector<ParameterRef<double>> params = rnn.parameters();
  params[0].value.data[0] = 0.8;   // W_ih
  params[1].value.data[0] = -0.6;  // W_hh
  const int64_t steps = 12;
  const Tensor<double> x = random_tensor<double>(Shape{1, steps, 1}, rng);
  RnnCache<double> cache;
  const RecurrentOutputs<double> out = rnn.forward({.x = x.cview()}, cache);
  Tensor<double> dy(Shape{1, steps, 1});
  dy[steps - 1] = 1.0;
  Tensor<double> dx(x.shape());
  rnn.backward(cache, {.dy = dy.cview()}, {.dx = dx.view()});
  double chain = 0.8 * (1.0 - out.y[0] * out.y[0]);
  for (int64_t t = 1; t < steps; ++t) chain *= -0.6 * (1.0 - out.y[t] * out.y[t]);
  EXPECT_NEAR(dx[0], chain, 4.0 * steps * kEps64 * std::abs(chain));
}

TEST(Rnn, BackwardAddsIntoGradients) {
  Rng rng(10);
  Rnn<double> rnn({.input_size = 3, .hidden_size = 4}, rng);
  const Tensor<double> x = random_tensor<double>(Shape{2, 3, 3}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{2, 3, 4}, rng);
  RnnCache<double> cache;
  rnn.forward({.x = x.cview()}, cache);
  Tensor<double> dx(x.shape()), dh0(Shape{2, 4});
  rnn.backward(cache, {.dy = dy.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});
  std::vector<Tensor<double>> first;
  for (const ParameterRef<double>& p : rnn.parameters()) first.push_back(to_tensor<double, double>(p.grad));

  Tensor<double> dx2(x.shape(), 1.0), dh02(Shape{2, 4}, 1.0);
  rnn.backward(cache, {.dy = dy.cview()}, {.dx = dx2.view(), .dh0 = dh02.view()});
  for (double& e : dx.values()) e += 1.0;
  for (double& e : dh0.values()) e += 1.0;
  EXPECT_TRUE(all_close("dx", dx2, dx, 0.0));
  EXPECT_TRUE(all_close("dh0", dh02, dh0, 0.0));
  const std::vector<ParameterRef<double>> params = rnn.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor<double> twice = first[i];
    for (double& e : twice.values()) e *= 2.0;
    EXPECT_TRUE(all_close("d" + params[i].name, to_tensor<double, double>(params[i].grad), twice, 0.0));
  }
  rnn.zero_grad();
  for (const ParameterRef<double>& p : rnn.parameters()) {
    EXPECT_TRUE(all_close("d" + p.name, to_tensor<double, double>(p.grad), Tensor<double>(p.grad.shape), 0.0));
  }
}

// One, two and three threads give the same bits, with the batch split among threads and with the
// rows of one long sequence's steps split among them.
TEST(Rnn, ThreadCountDoesNotChangeResults) {
  struct Shapes {
    int64_t batch, steps, in, hidden;
  };
  const int original_workers = max_workers();
  for (const Shapes& s : std::vector<Shapes>{{16, 5, 9, 70}, {1, 4, 8, 300}}) {
    SCOPED_TRACE(::testing::Message() << "B " << s.batch << " H " << s.hidden);
    std::vector<std::vector<float>> reference;
    for (int threads : {1, 2, 3}) {
      set_max_workers(threads);
      Rng rng(11);
      Rnn<float> rnn({.input_size = s.in, .hidden_size = s.hidden}, rng);
      const Tensor<float> x = random_tensor<float>(Shape{s.batch, s.steps, s.in}, rng);
      const Tensor<float> dy = random_tensor<float>(Shape{s.batch, s.steps, s.hidden}, rng);
      RnnCache<float> cache;
      const RecurrentOutputs<float> out = rnn.forward({.x = x.cview()}, cache);
      Tensor<float> dx(x.shape()), dh0(Shape{s.batch, s.hidden});
      rnn.backward(cache, {.dy = dy.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});
      std::vector<std::vector<float>> results{out.y.values(), dx.values(), dh0.values()};
      for (const ParameterRef<float>& p : rnn.parameters()) results.push_back(to_tensor<float, float>(p.grad).values());
      if (reference.empty()) {
        reference = results;
      } else {
        for (size_t i = 0; i < results.size(); ++i) {
          EXPECT_EQ(results[i], reference[i]) << "result " << i << ", " << threads << " threads";
        }
      }
    }
  }
  set_max_workers(original_workers);
}

TEST(Rnn, EmptySequences) {
  Rng rng(12);
  Rnn<double> rnn({.input_size = 2, .hidden_size = 3}, rng);
  const Tensor<double> h0 = random_tensor<double>(Shape{2, 3}, rng);
  const Tensor<double> x(Shape{2, 0, 2});
  RnnCache<double> cache;
  const RecurrentOutputs<double> out = rnn.forward({.x = x.cview(), .h0 = h0.cview()}, cache);
  EXPECT_EQ(out.y.shape(), (Shape{2, 0, 3}));
  EXPECT_TRUE(all_close("h_n", out.h_n, h0, 0.0));
  const Tensor<double> dy(Shape{2, 0, 3});
  const Tensor<double> dh_n = random_tensor<double>(Shape{2, 3}, rng);
  Tensor<double> dh0(Shape{2, 3});
  rnn.backward(cache, {.dy = dy.cview(), .dh_n = dh_n.cview()}, {.dh0 = dh0.view()});
  EXPECT_TRUE(all_close("dh0", dh0, dh_n, 0.0));
  for (const ParameterRef<double>& p : rnn.parameters()) {
    EXPECT_TRUE(all_close("d" + p.name, to_tensor<double, double>(p.grad), Tensor<double>(p.grad.shape), 0.0));
  }
  // A sequence of length 0 among others: its output is 0 and its state stays h0.
  const Tensor<double> x2 = random_tensor<double>(Shape{2, 3, 2}, rng);
  const Tensor<int64_t> lengths(Shape{2}, {3, 0});
  const RecurrentOutputs<double> out2 =
      rnn.forward({.x = x2.cview(), .h0 = h0.cview(), .lengths = lengths.cview()}, cache);
  for (int64_t k = 9; k < 18; ++k) EXPECT_EQ(out2.y[k], 0.0);
  for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(out2.h_n[3 + j], h0[3 + j]);
}

TEST(Rnn, InitFollowsPyTorch) {
  Rng rng(13);
  const int64_t hidden = 16;
  Rnn<float> rnn({.input_size = 7, .hidden_size = hidden}, rng);
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden));
  Rng replay(13);
  const std::vector<std::string> names{"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"};
  const std::vector<Shape> shapes{{16, 7}, {16, 16}, {16}, {16}};
  const std::vector<ParameterRef<float>> params = rnn.parameters();
  ASSERT_EQ(params.size(), 4u);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].name, names[i]);
    EXPECT_EQ(params[i].value.shape, shapes[i]);
    Tensor<float> expected(shapes[i]);
    replay.fill_uniform(expected.view(), -bound, bound);
    EXPECT_TRUE(all_close(params[i].name, to_tensor<float, float>(params[i].value), expected, 0.0));
  }
}

TEST(Rnn, BadArgumentsNameTheArgument) {
  Rng rng(14);
  EXPECT_TRUE(
      throws_naming<ValueError>([&] { Rnn<double>({.input_size = 3, .hidden_size = 0}, rng); }, {"hidden_size", "0"}));
  Rnn<double> rnn({.input_size = 3, .hidden_size = 4}, rng);
  RnnCache<double> cache;
  const Tensor<double> x_bad(Shape{5, 3});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { rnn.forward({.x = x_bad.cview()}, cache); }, {"x:", "[5, 3]"}));
  const Tensor<double> x(Shape{2, 5, 3});
  const Tensor<int64_t> lengths_bad(Shape{2}, {-1, 2});
  EXPECT_TRUE(throws_naming<ValueError>([&] { rnn.forward({.x = x.cview(), .lengths = lengths_bad.cview()}, cache); },
                                        {"lengths:", "-1", "[0]"}));
  rnn.forward({.x = x.cview()}, cache);
  const Tensor<double> dy(Shape{2, 5, 4});
  const Tensor<double> dh_n_bad(Shape{4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { rnn.backward(cache, {.dy = dy.cview(), .dh_n = dh_n_bad.cview()}, {}); },
                                        {"dh_n:", "[2, 4]", "[4]"}));
  Tensor<double> dh0_bad(Shape{2, 5});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { rnn.backward(cache, {.dy = dy.cview()}, {.dh0 = dh0_bad.view()}); },
                                        {"dh0:", "[2, 4]", "[2, 5]"}));
}

// Parity with PyTorch 1.13: torch.nn.RNN(3, 5, batch_first=True) in float64 on packed sequences of
// lengths [4, 2], with every tensor given by element k = 0.5·sin(1.3·k + salt) (salts: parameters
// 1..4 in PyTorch's order, x 20, h0 21, dy 22, dh_n 23), as in test_gru.cpp's MatchesPyTorch, whose
// comment holds the script. Gradients are compared through their projection on cos(0.7·k).
Tensor<double> formula(const Shape& shape, double salt) {
  Tensor<double> t(shape);
  for (int64_t k = 0; k < t.numel(); ++k) t[k] = 0.5 * std::sin(1.3 * static_cast<double>(k) + salt);
  return t;
}

double probe(TensorView<const double> grad) {
  const Tensor<double> g = to_tensor<double, double>(grad);
  double sum = 0.0;
  for (int64_t k = 0; k < g.numel(); ++k) sum += g[k] * std::cos(0.7 * static_cast<double>(k));
  return sum;
}

TEST(Rnn, MatchesPyTorch) {
  Rng rng(15);
  Rnn<double> rnn({.input_size = 3, .hidden_size = 5}, rng);
  const std::vector<ParameterRef<double>> params = rnn.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor<double> values = formula(params[i].value.shape, static_cast<double>(i + 1));
    std::copy(values.values().begin(), values.values().end(), params[i].value.data);
  }
  const Tensor<double> x = formula(Shape{2, 4, 3}, 20);
  const Tensor<double> h0 = formula(Shape{2, 5}, 21);
  const Tensor<int64_t> lengths(Shape{2}, {4, 2});
  RnnCache<double> cache;
  const RecurrentOutputs<double> out =
      rnn.forward({.x = x.cview(), .h0 = h0.cview(), .lengths = lengths.cview()}, cache);
  const Tensor<double> torch_y(Shape{2, 4, 5}, {0.61198438657463272,
                                                -0.5331653214249743,
                                                0.55922612788762349,
                                                0.90371460866011155,
                                                0.61459119341038571,
                                                -0.45002102824317958,
                                                -0.14569304960461404,
                                                -0.12761629198568736,
                                                0.88421308031949664,
                                                0.89639877598999396,
                                                -0.19162566203920872,
                                                -0.72925141374868196,
                                                0.55919612683910946,
                                                0.80189562420526028,
                                                0.85133988297681262,
                                                -0.20711036382524947,
                                                -0.66727527881368986,
                                                -0.022190118474146939,
                                                0.91875672587285129,
                                                0.77417098369931237,
                                                -0.065231749826774432,
                                                0.10903541423041226,
                                                0.34742128615319018,
                                                0.84821137271946612,
                                                0.90517098771714133,
                                                -0.00035817640146101984,
                                                -0.83859370104393027,
                                                0.41488215844155768,
                                                0.79955523431354691,
                                                0.64114115623529866,
                                                0,
                                                0,
                                                0,
                                                0,
                                                0,
                                                0,
                                                0,
                                                0,
                                                0,
                                                0});
  const Tensor<double> torch_h_n(
      Shape{2, 5},
      {-0.20711036382524947, -0.66727527881368986, -0.022190118474146939, 0.91875672587285129, 0.77417098369931237,
       -0.00035817640146101984, -0.83859370104393027, 0.41488215844155768, 0.79955523431354691, 0.64114115623529866});
  const double tolerance = 8.0 * (3 + 5 + 2) * 4 * kEps64;
  EXPECT_TRUE(all_close("y", out.y, torch_y, tolerance));
  EXPECT_TRUE(all_close("h_n", out.h_n, torch_h_n, tolerance));

  Tensor<double> dx(x.shape()), dh0(h0.shape());
  rnn.backward(cache, {.dy = formula(out.y.shape(), 22).cview(), .dh_n = formula(out.h_n.shape(), 23).cview()},
               {.dx = dx.view(), .dh0 = dh0.view()});
  const std::vector<double> expected{0.13343942907501027, 0.2078328802586259,  -0.41044655046546991,
                                     0.8303967811684787,  -5.6120874704659105, -5.6120874704659096};
  std::vector<double> actual{probe(dx.cview()), probe(dh0.cview())};
  for (const ParameterRef<double>& p : params) actual.push_back(probe(p.grad));
  const std::vector<std::string> names{"x", "h0", "weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"};
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 25.0 * tolerance * std::max(1.0, std::abs(expected[i])))
        << "gradient of " << names[i];
  }
}

}  // namespace
}  // namespace qkv
