#include "qkv/nn/rnn.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "recurrent_testing.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::random_tensor;
using testing::throws_naming;

using testing::recurrent::Case;
using testing::recurrent::formula;
using testing::recurrent::NaiveOutputs;
using testing::recurrent::probe;
using testing::recurrent::Weights;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();

// What the shared tests of recurrent_testing.hpp need to know of the RNN: its types and its definition.
struct RnnTraits : testing::recurrent::LayerTypes<Rnn, RnnCache> {
  // h_t = tanh(W_ih x_t + b_ih + W_hh h_{t−1} + b_hh) by the definition, one sequence and one step
  // at a time, every operation in Acc: the float64 reference when Acc is double, the naive float32
  // computation that sets the tolerance when Acc is float.
  template <class Acc>
  static NaiveOutputs<Acc> naive(const Tensor<double>& x, const Tensor<double>& h0, const std::vector<int64_t>& lengths,
                                 const Weights& w, bool reverse) {
    const int64_t in = x.shape()[2], hidden = h0.shape()[1];
    return testing::recurrent::naive_recurrence<Acc>(
        x, h0, lengths, reverse, [&](const double* x_t, const std::vector<Acc>& h) {
          std::vector<Acc> next(static_cast<size_t>(hidden));
          for (int64_t j = 0; j < hidden; ++j) {
            Acc a = static_cast<Acc>(w.b_ih[j]) + static_cast<Acc>(w.b_hh[j]);
            for (int64_t i = 0; i < in; ++i) a += static_cast<Acc>(w.w_ih[j * in + i]) * static_cast<Acc>(x_t[i]);
            for (int64_t i = 0; i < hidden; ++i)
              a += static_cast<Acc>(w.w_hh[j * hidden + i]) * h[static_cast<size_t>(i)];
            next[static_cast<size_t>(j)] = std::tanh(a);
          }
          return next;
        });
  }
};

TEST(Rnn, DoubleMatchesFloat64Reference) {
  testing::recurrent::check_double_matches_reference<RnnTraits>(1, [](const Case& c) {
    // In + H + 2 products and sums per state, carried through T steps of a contraction (tanh' ≤ 1
    // times a W_hh of unit scale): a few ε per term and step.
    return 8.0 * static_cast<double>((c.in + c.hidden + 2) * c.steps) * kEps64;
  });
}

TEST(Rnn, FloatMatchesFloat64Reference) { testing::recurrent::check_float_matches_reference<RnnTraits>(2); }

// Each output sums In + H + 2 terms per step (see fd_tolerance).
void check_gradients(const Case& c, uint64_t seed) {
  testing::recurrent::check_gradients<Rnn<double>, RnnCache<double>>(
      c, seed, static_cast<double>(c.steps * (c.in + c.hidden + 2)));
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
  testing::recurrent::check_backward_adds_into_gradients<Rnn<double>, RnnCache<double>>(10);
}

// One, two and three threads give the same bits, with the batch split among threads and with the
// rows of one long sequence's steps split among them.
TEST(Rnn, ThreadCountDoesNotChangeResults) {
  testing::recurrent::check_thread_count_does_not_change_results<Rnn<float>, RnnCache<float>>(
      {{16, 5, 9, 70}, {1, 4, 8, 300}}, 11);
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
  const Rnn<float> rnn({.input_size = 7, .hidden_size = 16}, rng);
  testing::recurrent::check_init_follows_pytorch(rnn, 13, 16, {{16, 7}, {16, 16}, {16}, {16}});
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
TEST(Rnn, MatchesPyTorch) {
  Rng rng(15);
  Rnn<double> rnn({.input_size = 3, .hidden_size = 5}, rng);
  const std::vector<ParameterRef<double>> params = rnn.parameters();
  testing::recurrent::set_parameters_by_formula(params);
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
