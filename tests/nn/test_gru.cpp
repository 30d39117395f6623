#include "qkv/nn/gru.hpp"

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
using testing::numeric_gradient;
using testing::random_tensor;
using testing::throws_naming;

using testing::recurrent::abs_sum;
using testing::recurrent::Case;
using testing::recurrent::fd_tolerance;
using testing::recurrent::formula;
using testing::recurrent::kStep;
using testing::recurrent::NaiveOutputs;
using testing::recurrent::probe;
using testing::recurrent::Weights;
using testing::recurrent::weights_of;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();

// What the shared tests of recurrent_testing.hpp need to know of the GRU: its types and its definition.
struct GruTraits : testing::recurrent::LayerTypes<Gru, GruCache> {
  // PyTorch's GRU equations by the definition, one sequence and one step at a time, with every
  // product, sum and nonlinearity in Acc: the float64 reference when Acc is double, the naive float32
  // computation that sets the tolerance when Acc is float.
  template <class Acc>
  static NaiveOutputs<Acc> naive(const Tensor<double>& x, const Tensor<double>& h0, const std::vector<int64_t>& lengths,
                                 const Weights& w, bool reverse) {
    const int64_t in = x.shape()[2], hidden = h0.shape()[1];
    const auto sigmoid = [](Acc v) { return Acc{1} / (Acc{1} + std::exp(-v)); };
    return testing::recurrent::naive_recurrence<Acc>(
        x, h0, lengths, reverse, [&](const double* x_t, const std::vector<Acc>& h) {
          // W_ig x_t + b_ig and W_hg h + b_hg for gate g in (r, z, n).
          const auto input_part = [&](int64_t g, int64_t j) {
            const int64_t row = g * hidden + j;
            Acc acc = static_cast<Acc>(w.b_ih[row]);
            for (int64_t i = 0; i < in; ++i) acc += static_cast<Acc>(w.w_ih[row * in + i]) * static_cast<Acc>(x_t[i]);
            return acc;
          };
          const auto hidden_part = [&](int64_t g, int64_t j) {
            const int64_t row = g * hidden + j;
            Acc acc = static_cast<Acc>(w.b_hh[row]);
            for (int64_t i = 0; i < hidden; ++i)
              acc += static_cast<Acc>(w.w_hh[row * hidden + i]) * h[static_cast<size_t>(i)];
            return acc;
          };
          std::vector<Acc> next(static_cast<size_t>(hidden));
          for (int64_t j = 0; j < hidden; ++j) {
            const Acc r = sigmoid(input_part(0, j) + hidden_part(0, j));
            const Acc z = sigmoid(input_part(1, j) + hidden_part(1, j));
            const Acc n = std::tanh(input_part(2, j) + r * hidden_part(2, j));
            next[static_cast<size_t>(j)] = (Acc{1} - z) * n + z * h[static_cast<size_t>(j)];
          }
          return next;
        });
  }
};

TEST(Gru, DoubleMatchesFloat64Reference) {
  testing::recurrent::check_double_matches_reference<GruTraits>(1, [](const Case& c) {
    // Each state is a sum of In + H + 1 products per gate, carried through T steps whose Jacobians
    // have norm below 1 + Σ|W| (σ' ≤ 1/4, tanh' ≤ 1): a few ε per term and step.
    return 8.0 * static_cast<double>((c.in + c.hidden + 1) * c.steps) * kEps64;
  });
}

TEST(Gru, FloatMatchesFloat64Reference) { testing::recurrent::check_float_matches_reference<GruTraits>(2); }

// Each output sums In + 3H + 2 terms per step (see fd_tolerance).
void check_gradients(const Case& c, uint64_t seed) {
  testing::recurrent::check_gradients<Gru<double>, GruCache<double>>(
      c, seed, static_cast<double>(c.steps * (c.in + 3 * c.hidden + 2)));
}

TEST(Gru, GradientsMatchFiniteDifferences) {
  check_gradients({2, 4, 3, 5, {}, false, true}, 3);
  check_gradients({3, 5, 2, 4, {5, 2, 0}, false, true}, 4);
  check_gradients({3, 5, 2, 4, {3, 5, 1}, true, true}, 5);
  check_gradients({2, 3, 3, 2, {}, true, false}, 6);
  check_gradients({1, 1, 1, 1, {}, false, true}, 7);
  check_gradients({1, 6, 1, 1, {}, false, true}, 8);
}

TEST(Gru, BackwardAddsIntoGradients) {
  testing::recurrent::check_backward_adds_into_gradients<Gru<double>, GruCache<double>>(9);
}

// Results depend only on the inputs: one, two and three threads give the same bits, both when the
// batch is split among threads and when one long sequence's rows are.
TEST(Gru, ThreadCountDoesNotChangeResults) {
  testing::recurrent::check_thread_count_does_not_change_results<Gru<float>, GruCache<float>>(
      {{16, 5, 9, 40}, {1, 4, 8, 200}}, 10);
}

TEST(Gru, PaddingMatchesTheShorterSequence) {
  Rng rng(11);
  Gru<double> gru({.input_size = 3, .hidden_size = 4, .reverse = true}, rng);
  const Tensor<double> x = random_tensor<double>(Shape{2, 6, 3}, rng);
  const Tensor<int64_t> lengths(Shape{2}, {6, 4});
  GruCache<double> cache;
  const RecurrentOutputs<double> out = gru.forward({.x = x.cview(), .lengths = lengths.cview()}, cache);
  // Sequence 1 alone, cut to its 4 tokens: the same states (the padding never reaches it).
  const TensorView<const double> second{x.data() + 6 * 3, Shape{1, 4, 3}, {0, 3, 1, 0}};
  GruCache<double> alone_cache;
  const RecurrentOutputs<double> alone = gru.forward({.x = second}, alone_cache);
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t j = 0; j < 4; ++j) {
      EXPECT_EQ(out.y[(6 + t) * 4 + j], t < 4 ? alone.y[t * 4 + j] : 0.0) << "t " << t << " j " << j;
    }
  for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(out.h_n[4 + j], alone.h_n[j]);
}

TEST(Gru, EmptySequences) {
  Rng rng(12);
  Gru<double> gru({.input_size = 2, .hidden_size = 3}, rng);
  const Tensor<double> h0 = random_tensor<double>(Shape{2, 3}, rng);
  {  // T = 0: no step; h_n is h0 and dh_n flows to dh0 unchanged.
    const Tensor<double> x(Shape{2, 0, 2});
    GruCache<double> cache;
    const RecurrentOutputs<double> out = gru.forward({.x = x.cview(), .h0 = h0.cview()}, cache);
    EXPECT_EQ(out.y.shape(), (Shape{2, 0, 3}));
    EXPECT_TRUE(all_close("h_n", out.h_n, h0, 0.0));
    const Tensor<double> dy(Shape{2, 0, 3});
    const Tensor<double> dh_n = random_tensor<double>(Shape{2, 3}, rng);
    Tensor<double> dx(x.shape()), dh0(Shape{2, 3});
    gru.backward(cache, {.dy = dy.cview(), .dh_n = dh_n.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});
    EXPECT_TRUE(all_close("dh0", dh0, dh_n, 0.0));
    for (const ParameterRef<double>& p : gru.parameters()) {
      EXPECT_TRUE(all_close("d" + p.name, to_tensor<double, double>(p.grad), Tensor<double>(p.grad.shape), 0.0));
    }
  }
  {  // No sequence at all.
    const Tensor<double> x(Shape{0, 4, 2});
    GruCache<double> cache;
    const RecurrentOutputs<double> out = gru.forward({.x = x.cview()}, cache);
    EXPECT_EQ(out.y.shape(), (Shape{0, 4, 3}));
    EXPECT_EQ(out.h_n.shape(), (Shape{0, 3}));
  }
}

// Stepping the cell token by token gives the sequence forward's states to the last bit, and the
// chained step backwards give its gradients (summed in another order: to rounding).
TEST(Gru, StepsMatchTheSequence) {
  Rng rng(13);
  Gru<double> gru({.input_size = 4, .hidden_size = 6}, rng);
  const int64_t batch = 3, steps = 5;
  const Tensor<double> x = random_tensor<double>(Shape{batch, steps, 4}, rng);
  const Tensor<double> h0 = random_tensor<double>(Shape{batch, 6}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{batch, steps, 6}, rng);
  GruCache<double> cache;
  const RecurrentOutputs<double> out = gru.forward({.x = x.cview(), .h0 = h0.cview()}, cache);
  Tensor<double> dx(x.shape()), dh0(h0.shape());
  gru.backward(cache, {.dy = dy.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});
  std::vector<Tensor<double>> sequence_grads;
  for (const ParameterRef<double>& p : gru.parameters()) sequence_grads.push_back(to_tensor<double, double>(p.grad));
  gru.zero_grad();

  const auto token = [&](const Tensor<double>& t, int64_t time, int64_t width) {
    return TensorView<const double>{t.data() + time * width, Shape{batch, width}, {steps * width, 1, 0, 0}};
  };
  std::vector<GruCache<double>> caches(static_cast<size_t>(steps));
  std::vector<Tensor<double>> states{h0};
  for (int64_t t = 0; t < steps; ++t) {
    states.push_back(gru.step_forward(token(x, t, 4), states.back().cview(), caches[static_cast<size_t>(t)]));
    EXPECT_TRUE(all_close(fmt::format("h_{}", t), states.back(), to_tensor<double, double>(token(out.y, t, 6)), 0.0));
  }
  Tensor<double> dh(Shape{batch, 6});
  Tensor<double> step_dx(x.shape());
  for (int64_t t = steps - 1; t >= 0; --t) {
    Tensor<double> dh_next = to_tensor<double, double>(token(dy, t, 6));
    for (int64_t i = 0; i < dh.numel(); ++i) dh_next[i] += dh[i];
    dh = Tensor<double>(Shape{batch, 6});
    const TensorView<double> dx_t{step_dx.data() + t * 4, Shape{batch, 4}, {steps * 4, 1, 0, 0}};
    gru.step_backward(caches[static_cast<size_t>(t)], dh_next.cview(), {.dx = dx_t, .dh = dh.view()});
  }
  const double tolerance = 64.0 * steps * kEps64;
  EXPECT_TRUE(all_close("dx", step_dx, dx, tolerance));
  EXPECT_TRUE(all_close("dh0", dh, dh0, tolerance));
  const std::vector<ParameterRef<double>> params = gru.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(
        all_close("d" + params[i].name, to_tensor<double, double>(params[i].grad), sequence_grads[i], tolerance));
  }
}

TEST(Gru, InitFollowsPyTorch) {
  Rng rng(14);
  const int64_t hidden = 16;
  const Gru<float> gru({.input_size = 7, .hidden_size = hidden}, rng);
  testing::recurrent::check_init_follows_pytorch(gru, 14, hidden, {{48, 7}, {48, 16}, {48}, {48}});
  Rng other(14);
  Gru<float> reversed({.input_size = 7, .hidden_size = hidden, .bias = false, .reverse = true}, other);
  const std::vector<ParameterRef<float>> reversed_params = reversed.parameters();
  ASSERT_EQ(reversed_params.size(), 2u);
  EXPECT_EQ(reversed_params[0].name, "weight_ih_l0_reverse");
  EXPECT_EQ(reversed_params[1].name, "weight_hh_l0_reverse");
}

TEST(Gru, BadArgumentsNameTheArgument) {
  Rng rng(15);
  EXPECT_TRUE(
      throws_naming<ValueError>([&] { Gru<double>({.input_size = 3, .hidden_size = 0}, rng); }, {"hidden_size", "0"}));
  EXPECT_TRUE(
      throws_naming<ValueError>([&] { Gru<double>({.input_size = -1, .hidden_size = 2}, rng); }, {"input_size", "-1"}));
  Gru<double> gru({.input_size = 3, .hidden_size = 4}, rng);
  GruCache<double> cache;
  const Tensor<double> x(Shape{2, 5, 3});
  const Tensor<double> x_bad(Shape{2, 5, 4});
  EXPECT_TRUE(
      throws_naming<ShapeError>([&] { gru.forward({.x = x_bad.cview()}, cache); }, {"x:", "[B, T, 3]", "[2, 5, 4]"}));
  const Tensor<double> h0_bad(Shape{2, 3});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { gru.forward({.x = x.cview(), .h0 = h0_bad.cview()}, cache); },
                                        {"h0:", "[2, 4]", "[2, 3]"}));
  const Tensor<int64_t> lengths_bad(Shape{2}, {5, 6});
  EXPECT_TRUE(throws_naming<ValueError>([&] { gru.forward({.x = x.cview(), .lengths = lengths_bad.cview()}, cache); },
                                        {"lengths:", "[0, 5]", "6", "[1]"}));
  const Tensor<int64_t> lengths_short(Shape{3}, {1, 1, 1});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { gru.forward({.x = x.cview(), .lengths = lengths_short.cview()}, cache); },
                                        {"lengths:", "[2]", "[3]"}));
  gru.forward({.x = x.cview()}, cache);
  const Tensor<double> dy_bad(Shape{2, 5, 3});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { gru.backward(cache, {.dy = dy_bad.cview()}, {}); },
                                        {"dy:", "[2, 5, 4]", "[2, 5, 3]"}));
  const Tensor<double> dy(Shape{2, 5, 4});
  Tensor<double> dx_bad(Shape{2, 5, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { gru.backward(cache, {.dy = dy.cview()}, {.dx = dx_bad.view()}); },
                                        {"dx:", "[2, 5, 3]", "[2, 5, 4]"}));
  const Tensor<double> x_step(Shape{2, 3});
  const Tensor<double> h_bad(Shape{3, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { gru.step_forward(x_step.cview(), h_bad.cview(), cache); },
                                        {"h:", "[2, 4]", "[3, 4]"}));
  const Tensor<double> dh_next(Shape{2, 4});
  EXPECT_TRUE(
      throws_naming<ShapeError>([&] { gru.step_backward(cache, dh_next.cview(), {}); }, {"cache:", "[2, 5, 4]"}));
}

// The bidirectional layer is its two directions side by side, and its gradients match central
// differences through both.
TEST(BidirectionalGru, ConcatenatesTheTwoDirections) {
  Rng rng(16);
  BidirectionalGru<double> bi({.input_size = 3, .hidden_size = 4}, rng);
  const Tensor<double> x = random_tensor<double>(Shape{2, 5, 3}, rng);
  const Tensor<double> h0 = random_tensor<double>(Shape{2, 2, 4}, rng);
  const Tensor<int64_t> lengths(Shape{2}, {5, 3});
  BidirectionalGruCache<double> cache;
  const RecurrentOutputs<double> out =
      bi.forward({.x = x.cview(), .h0 = h0.cview(), .lengths = lengths.cview()}, cache);
  ASSERT_EQ(out.y.shape(), (Shape{2, 5, 8}));
  ASSERT_EQ(out.h_n.shape(), (Shape{2, 2, 4}));
  for (int64_t d : {0, 1}) {
    const NaiveOutputs<double> ref = GruTraits::naive<double>(
        x, to_tensor<double, double>(TensorView<const double>{h0.data() + d * 8, Shape{2, 4}, {4, 1, 0, 0}}), {5, 3},
        weights_of(bi.direction(static_cast<int>(d))), d == 1);
    const Tensor<double> y_half =
        to_tensor<double, double>(TensorView<const double>{out.y.data() + d * 4, Shape{2, 5, 4}, {40, 8, 1, 0}});
    const Tensor<double> h_half =
        to_tensor<double, double>(TensorView<const double>{out.h_n.data() + d * 8, Shape{2, 4}, {4, 1, 0, 0}});
    const double tolerance = 8.0 * (3 + 4 + 1) * 5 * kEps64;
    EXPECT_TRUE(all_close(fmt::format("y direction {}", d), y_half, ref.y, tolerance));
    EXPECT_TRUE(all_close(fmt::format("h_n direction {}", d), h_half, ref.h_n, tolerance));
  }
  std::vector<std::string> names;
  for (const ParameterRef<double>& p : bi.parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0",
                                             "weight_ih_l0_reverse", "weight_hh_l0_reverse", "bias_ih_l0_reverse",
                                             "bias_hh_l0_reverse"}));
  EXPECT_TRUE(throws_naming<ValueError>(
      [&] { BidirectionalGru<double>({.input_size = 3, .hidden_size = 4, .reverse = true}, rng); }, {"reverse"}));
  const Tensor<double> h0_bad(Shape{2, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { bi.forward({.x = x.cview(), .h0 = h0_bad.cview()}, cache); },
                                        {"h0:", "[2, 2, 4]", "[2, 4]"}));
}

TEST(BidirectionalGru, GradientsMatchFiniteDifferences) {
  Rng rng(17);
  BidirectionalGru<double> bi({.input_size = 2, .hidden_size = 3}, rng);
  Tensor<double> x = random_tensor<double>(Shape{2, 4, 2}, rng);
  Tensor<double> h0 = random_tensor<double>(Shape{2, 2, 3}, rng);
  const Tensor<int64_t> lengths(Shape{2}, {4, 2});
  const Tensor<double> dy = random_tensor<double>(Shape{2, 4, 6}, rng);
  const Tensor<double> dh_n = random_tensor<double>(Shape{2, 2, 3}, rng);
  const auto loss = [&] {
    BidirectionalGruCache<double> cache;
    const RecurrentOutputs<double> out =
        bi.forward({.x = x.cview(), .h0 = h0.cview(), .lengths = lengths.cview()}, cache);
    return testing::dot(dy, out.y) + testing::dot(dh_n, out.h_n);
  };
  BidirectionalGruCache<double> cache;
  bi.forward({.x = x.cview(), .h0 = h0.cview(), .lengths = lengths.cview()}, cache);
  Tensor<double> dx(x.shape()), dh0(h0.shape());
  bi.backward(cache, {.dy = dy.cview(), .dh_n = dh_n.cview()}, {.dx = dx.view(), .dh0 = dh0.view()});
  const double tolerance = fd_tolerance(2.0 * 4 * (2 + 3 * 3 + 2), abs_sum(dy) + abs_sum(dh_n));
  EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x, kStep), tolerance));
  EXPECT_TRUE(all_close("dh0", dh0, numeric_gradient(loss, h0, kStep), tolerance));
  for (const ParameterRef<double>& p : bi.parameters()) {
    EXPECT_TRUE(
        all_close("d" + p.name, to_tensor<double, double>(p.grad), numeric_gradient(loss, p.value, kStep), tolerance));
  }
}

// Parity with PyTorch 1.13 (torch.nn.GRU(3, 5, batch_first=True, bidirectional=True), float64,
// packed sequences of lengths [4, 2]) on weights and inputs given by a formula, so that both sides
// build them without a file: element k of the i-th tensor is 0.5·sin(1.3·k + salt). The expected
// numbers were printed by this script:
//   fill = lambda shape, salt: torch.tensor([0.5 * math.sin(1.3 * k + salt)
//                                            for k in range(math.prod(shape))]).reshape(shape)
//   m = torch.nn.GRU(3, 5, batch_first=True, bidirectional=True)
//   for i, p in enumerate(m.parameters()): p.data.copy_(fill(p.shape, i + 1))
//   x = fill((2, 4, 3), 20).requires_grad_(); h0 = fill((2, 2, 5), 21).requires_grad_()
//   out, hn = m(pack_padded_sequence(x, [4, 2], batch_first=True, enforce_sorted=False), h0)
//   y, _ = pad_packed_sequence(out, batch_first=True, total_length=4)
//   ((y * fill(y.shape, 22)).sum() + (hn * fill(hn.shape, 23)).sum()).backward()
//   print y, hn, and for each gradient g: (g * probe(g.shape)).sum(), probe_k = cos(0.7·k)
// (with torch.set_default_dtype(torch.float64)). Comparing projections of the gradients on a fixed
// probe keeps the expected values short while any wrong element would move them.
TEST(BidirectionalGru, MatchesPyTorch) {
  Rng rng(18);
  BidirectionalGru<double> bi({.input_size = 3, .hidden_size = 5}, rng);
  const std::vector<ParameterRef<double>> params = bi.parameters();
  testing::recurrent::set_parameters_by_formula(params);
  const Tensor<double> x = formula(Shape{2, 4, 3}, 20);
  const Tensor<double> h0 = formula(Shape{2, 2, 5}, 21);
  const Tensor<int64_t> lengths(Shape{2}, {4, 2});
  BidirectionalGruCache<double> cache;
  const RecurrentOutputs<double> out =
      bi.forward({.x = x.cview(), .h0 = h0.cview(), .lengths = lengths.cview()}, cache);

  const Tensor<double> torch_y(Shape{2, 4, 10}, {0.071432406920617142,
                                                 -0.45707675848735357,
                                                 -0.49600358824432161,
                                                 0.057449830695154747,
                                                 -0.00073884862546125252,
                                                 0.6113101597039946,
                                                 0.27428818283986611,
                                                 -0.19330381165026672,
                                                 -0.43010546583335518,
                                                 0.39428412051241646,
                                                 -0.3776901341389865,
                                                 -0.44600958711914812,
                                                 -0.20602111306614398,
                                                 0.10014751893738452,
                                                 0.12495164532987318,
                                                 0.54629809974557642,
                                                 0.27821060767943773,
                                                 -0.4318019690455811,
                                                 -0.23105292389521506,
                                                 0.37176192447458745,
                                                 -0.1259253577645108,
                                                 -0.5991713429796226,
                                                 -0.050537932813123798,
                                                 0.25446624109741878,
                                                 0.059925972366653958,
                                                 0.48354805619999774,
                                                 0.1159520453132285,
                                                 -0.14465305707503223,
                                                 -0.44247834611637837,
                                                 0.48183079166775189,
                                                 -0.21379348960699551,
                                                 -0.38164769618605432,
                                                 -0.0801691089971385,
                                                 0.34435591773324176,
                                                 0.16601535248105084,
                                                 0.42926143200275751,
                                                 -0.058201996086682306,
                                                 -0.27805915238706813,
                                                 -0.1122597560167366,
                                                 0.41542480654831038,
                                                 -0.19314534220408686,
                                                 -0.51022331589088499,
                                                 -0.22977305655141916,
                                                 -0.0037065444972325728,
                                                 0.33667631277643961,
                                                 0.44819093813532668,
                                                 0.12732486332868853,
                                                 -0.40254794397452115,
                                                 -0.2999603683608863,
                                                 0.50397941300772187,
                                                 -0.06861414886295944,
                                                 -0.56710159667130022,
                                                 -0.17410029578315905,
                                                 0.15154981159898073,
                                                 0.085705122004858386,
                                                 0.35823446828441236,
                                                 -0.1191909457628843,
                                                 -0.052916395361137042,
                                                 -0.43135181995793576,
                                                 0.53777043476425523,
                                                 0,
                                                 0,
                                                 0,
                                                 0,
                                                 0,
                                                 0,
                                                 0,
                                                 0,
                                                 0,
                                                 0,
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
      Shape{2, 2, 5},
      {-0.21379348960699551, -0.38164769618605432, -0.0801691089971385,  0.34435591773324176,  0.16601535248105084,
       -0.06861414886295944, -0.56710159667130022, -0.17410029578315905, 0.15154981159898073,  0.085705122004858386,
       0.6113101597039946,   0.27428818283986611,  -0.19330381165026672, -0.43010546583335518, 0.39428412051241646,
       0.44819093813532668,  0.12732486332868853,  -0.40254794397452115, -0.2999603683608863,  0.50397941300772187});
  // Two float64 implementations of the same sums in different orders: a few ε per term and step.
  const double tolerance = 8.0 * (3 + 5 + 1) * 4 * kEps64;
  EXPECT_TRUE(all_close("y", out.y, torch_y, tolerance));
  EXPECT_TRUE(all_close("h_n", out.h_n, torch_h_n, tolerance));

  Tensor<double> dx(x.shape()), dh0(h0.shape());
  bi.backward(cache, {.dy = formula(out.y.shape(), 22).cview(), .dh_n = formula(out.h_n.shape(), 23).cview()},
              {.dx = dx.view(), .dh0 = dh0.view()});
  struct Expected {
    std::string name;
    double value;
  };
  std::vector<Expected> expected{{"x", -0.65655579913911899},
                                 {"h0", -1.3986886297705259},
                                 {"weight_ih_l0", -0.11322473627181784},
                                 {"weight_hh_l0", -0.070583696908685711},
                                 {"bias_ih_l0", -2.9435271541636738},
                                 {"bias_hh_l0", -1.7046424251731849},
                                 {"weight_ih_l0_reverse", -0.30309652981057622},
                                 {"weight_hh_l0_reverse", 0.026513488212212957},
                                 {"bias_ih_l0_reverse", -3.7300873603617233},
                                 {"bias_hh_l0_reverse", -1.750773233338919}};
  std::vector<double> actual{probe(dx.cview()), probe(dh0.cview())};
  for (const ParameterRef<double>& p : params) actual.push_back(probe(p.grad));
  // A projection sums up to 75 gradient elements, each accurate to the tolerance above.
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i].value, 75.0 * tolerance) << "gradient of " << expected[i].name;
  }
}

}  // namespace
}  // namespace qkv
