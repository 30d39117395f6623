// Tests of the reference scaled dot-product attention (src/ops/attention.cpp): against an independent
// float64 implementation, against finite differences, its defining properties, masks, edge cases
// and refusals.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/ops/attention.hpp"
#include "support/attention_problems.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::AttentionOperands;
using testing::cast;
using testing::naive_attention_forward;
using testing::numeric_gradient;
using testing::random_problem;
using testing::random_tensor;
using Case = testing::AttentionCase;
using Problem = testing::AttentionProblem;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Result {
  Tensor<double> out, weights, lse;
};

template <class T>
Result run_forward(const Problem& in) {
  const AttentionOperands<T> ops(in);
  const Shape& qs = ops.q.shape();
  const int r = qs.rank();
  std::vector<int64_t> lead(qs.dims().begin(), qs.dims().end() - 2);
  auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> d = lead;
    d.insert(d.end(), tail.begin(), tail.end());
    return Shape(std::span<const int64_t>(d));
  };
  Tensor<T> out(with({qs[r - 2], ops.v.shape().from_back(1)}));
  Tensor<T> weights(with({qs[r - 2], ops.k.shape().from_back(2)}));
  Tensor<T> lse(with({qs[r - 2]}));
  attention_forward_reference(ops.params(),
                              AttentionOutputs<T>{.out = out.view(), .weights = weights.view(), .lse = lse.view()});
  return {cast<double>(out), cast<double>(weights), cast<double>(lse)};
}

// L = <dO, out> in float64 and its gradients by the reference backward.
struct Grads {
  Tensor<double> dq, dk, dv, dbias;
};

Grads run_backward(const Problem& in, const Tensor<double>& dout) {
  Grads g{Tensor<double>(in.q.shape()), Tensor<double>(in.k.shape()), Tensor<double>(in.v.shape()),
          in.bias ? Tensor<double>(in.bias->shape()) : Tensor<double>()};
  AttentionGradients<double> grads{.dq = g.dq.view(), .dk = g.dk.view(), .dv = g.dv.view(), .dbias = std::nullopt};
  if (in.bias) grads.dbias = g.dbias.view();
  const AttentionOperands<double> ops(in);
  attention_backward_reference(ops.params(), dout.view(), grads);
  return g;
}

double loss(const Problem& in, const Tensor<double>& dout) { return testing::dot(run_forward<double>(in).out, dout); }

// The gradient of a smooth function of float64 inputs, by central differences with h = 1e-6, is
// accurate to about h² · |f'''| + ε·|f|/h ≈ 1e-10 here; 1e-7 leaves a wide margin.
constexpr double kGradTolerance = 1e-7;

void expect_gradients_match(Problem in, uint64_t seed) {
  Rng rng(seed);
  const Tensor<double> dout = random_tensor<double>(run_forward<double>(in).out.shape(), rng);
  const Grads g = run_backward(in, dout);
  EXPECT_TRUE(all_close("dq", g.dq, numeric_gradient([&] { return loss(in, dout); }, in.q), kGradTolerance));
  EXPECT_TRUE(all_close("dk", g.dk, numeric_gradient([&] { return loss(in, dout); }, in.k), kGradTolerance));
  EXPECT_TRUE(all_close("dv", g.dv, numeric_gradient([&] { return loss(in, dout); }, in.v), kGradTolerance));
  if (in.bias) {
    EXPECT_TRUE(
        all_close("dbias", g.dbias, numeric_gradient([&] { return loss(in, dout); }, *in.bias), kGradTolerance));
  }
}

// --- agreement with independent implementations -------------------------------------------------

TEST(AttentionReference, MatchesNaiveFloat64) {
  for (const Case& c : {Case{}, Case{2, 3, 6, 6, 8, 8}, Case{1, 2, 9, 4, 5, 11}, Case{1, 1, 113, 17, 13, 7}}) {
    const Problem in = random_problem(c, 1);
    const Result got = run_forward<double>(in);
    const testing::NaiveAttention<double> want = naive_attention_forward<double>(in);
    const double tol = 64 * std::numeric_limits<double>::epsilon() * static_cast<double>(c.dk + c.tk);
    EXPECT_TRUE(all_close("out", got.out, want.out, tol));
    EXPECT_TRUE(all_close("weights", got.weights, want.weights, tol));
    EXPECT_TRUE(all_close("lse", got.lse, want.lse, tol));
  }
}

TEST(AttentionReference, Float32WithinTwiceNaiveFloat32Error) {
  for (const Case& c :
       {Case{2, 2, 33, 47, 64, 32, false}, Case{1, 4, 64, 64, 128, 128, true}, Case{1, 1, 113, 113, 17, 5}}) {
    const Problem in = random_problem(c, 2);
    const testing::NaiveAttention<double> exact = naive_attention_forward<double>(in);
    const double tol = testing::tolerance_from_naive(naive_attention_forward<float>(in).out, exact.out);
    EXPECT_TRUE(all_close("out (float32)", run_forward<float>(in).out, exact.out, tol));
  }
}

// --- gradients ------------------------------------------------------------------------------------

TEST(AttentionReference, GradientsMatchFiniteDifferences) {
  expect_gradients_match(random_problem({1, 1, 4, 5, 3, 2}, 3), 30);
  expect_gradients_match(random_problem({2, 2, 3, 3, 2, 4}, 4), 40);
  expect_gradients_match(random_problem({1, 1, 5, 3, 2, 2, true}, 5), 50);  // causal, Tq > Tk
  expect_gradients_match(random_problem({1, 1, 3, 6, 2, 3, true}, 6), 60);  // causal, Tq < Tk
}

TEST(AttentionReference, BiasGradientSumsOverBroadcastDims) {
  Problem in = random_problem({2, 3, 4, 5, 3, 2}, 7);
  Rng rng(70);
  in.bias = random_tensor<double>({1, 3, 1, 5}, rng);  // per head and key, shared by batch and query
  expect_gradients_match(in, 71);
}

TEST(AttentionReference, GradientsWithBooleanMaskAndFullyMaskedRow) {
  Problem in = random_problem({1, 1, 4, 5, 3, 3}, 8);
  in.allowed = Tensor<uint8_t>({4, 5}, 1);
  for (int64_t j = 0; j < 5; ++j) in.allowed->view()(2, j) = 0;  // query 2 sees nothing
  in.allowed->view()(0, 1) = 0;
  expect_gradients_match(in, 80);
}

// --- properties -----------------------------------------------------------------------------------

TEST(AttentionReference, RowsOfWeightsSumToOne) {
  const Result r = run_forward<double>(random_problem({2, 2, 9, 13, 4, 4}, 9));
  const TensorView<const double> w = r.weights.view();
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 9; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < 13; ++j) {
          EXPECT_GE(w(b, h, i, j), 0.0);
          sum += w(b, h, i, j);
        }
        EXPECT_NEAR(sum, 1.0, 16 * std::numeric_limits<double>::epsilon() * 13);
      }
}

TEST(AttentionReference, SelfAttentionIsPermutationEquivariant) {
  Rng rng(10);
  const Tensor<double> x = random_tensor<double>({1, 1, 8, 4}, rng);
  std::vector<int64_t> perm(8);
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[0], perm[5]);
  std::swap(perm[2], perm[7]);
  std::swap(perm[3], perm[4]);
  Tensor<double> xp(x.shape());
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t d = 0; d < 4; ++d) xp.view()(0, 0, i, d) = x.view()(0, 0, perm[static_cast<size_t>(i)], d);
  const Tensor<double> out = run_forward<double>(Problem{.q = x, .k = x, .v = x}).out;
  const Tensor<double> out_p = run_forward<double>(Problem{.q = xp, .k = xp, .v = xp}).out;
  Tensor<double> out_permuted(out.shape());
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t d = 0; d < 4; ++d) out_permuted.view()(0, 0, i, d) = out.view()(0, 0, perm[static_cast<size_t>(i)], d);
  EXPECT_TRUE(all_close("permuted output", out_p, out_permuted, 1e-14));
}

TEST(AttentionReference, ZeroScaleGivesMeanOfValues) {
  Problem in = random_problem({1, 2, 3, 6, 4, 5}, 11);
  in.scale = 0.0;
  const Result r = run_forward<double>(in);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t d = 0; d < 5; ++d) {
        double mean = 0;
        for (int64_t j = 0; j < 6; ++j) mean += in.v.view()(0, h, j, d) / 6.0;
        EXPECT_NEAR(r.out.view()(0, h, i, d), mean, 1e-15);
      }
}

TEST(AttentionReference, MaskedKeysGetZeroWeight) {
  Problem in = random_problem({1, 1, 4, 6, 3, 3}, 12);
  in.allowed = Tensor<uint8_t>({6}, 1);  // broadcast over queries
  in.allowed->view()(1) = 0;
  in.allowed->view()(4) = 0;
  in.bias = Tensor<double>({4, 6});
  in.bias->view()(2, 3) = -kInf;
  const Result r = run_forward<double>(in);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(r.weights.view()(0, 0, i, 1), 0.0);
    EXPECT_EQ(r.weights.view()(0, 0, i, 4), 0.0);
  }
  EXPECT_EQ(r.weights.view()(0, 0, 2, 3), 0.0);
  EXPECT_TRUE(all_close("out", r.out, naive_attention_forward<double>(in).out, 1e-14));
}

TEST(AttentionReference, CausalIsBottomRightAligned) {
  for (const auto& [tq, tk] : {std::pair<int64_t, int64_t>{4, 4}, {2, 6}, {6, 3}}) {
    Problem in = random_problem({1, 1, tq, tk, 3, 2, true}, 13);
    const Result r = run_forward<double>(in);
    for (int64_t i = 0; i < tq; ++i)
      for (int64_t j = 0; j < tk; ++j) {
        const bool visible = j <= i + tk - tq;
        if (visible) {
          EXPECT_GT(r.weights.view()(0, 0, i, j), 0.0) << "query " << i << " key " << j;
        } else {
          EXPECT_EQ(r.weights.view()(0, 0, i, j), 0.0) << "query " << i << " key " << j;
        }
      }
    if (tq < tk) {
      EXPECT_GT(r.weights.view()(0, 0, tq - 1, tk - 1), 0.0);  // the last query sees every key
    }
  }
}

// --- edge cases -----------------------------------------------------------------------------------

TEST(AttentionReference, FullyMaskedRowsGiveZerosNeverNaN) {
  Problem in = random_problem({1, 1, 5, 2, 3, 3, true}, 14);  // causal with Tq > Tk: queries 0..2 see nothing
  const Result r = run_forward<double>(in);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r.lse.view()(0, 0, i), -kInf);
    for (int64_t d = 0; d < 3; ++d) EXPECT_EQ(r.out.view()(0, 0, i, d), 0.0);
  }
  Rng rng(140);
  Tensor<double> dout = random_tensor<double>(r.out.shape(), rng);
  const Grads g = run_backward(in, dout);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t d = 0; d < 3; ++d) EXPECT_EQ(g.dq.view()(0, 0, i, d), 0.0);
  for (const Tensor<double>* t : {&g.dq, &g.dk, &g.dv})
    for (int64_t n = 0; n < t->numel(); ++n) EXPECT_TRUE(std::isfinite((*t)[n]));
}

TEST(AttentionReference, EmptySequences) {
  const Result no_keys = run_forward<float>(random_problem({1, 2, 3, 0, 4, 5}, 15));
  for (int64_t n = 0; n < no_keys.out.numel(); ++n) EXPECT_EQ(no_keys.out[n], 0.0);
  for (int64_t n = 0; n < no_keys.lse.numel(); ++n) EXPECT_EQ(no_keys.lse[n], -kInf);
  EXPECT_EQ(run_forward<float>(random_problem({1, 2, 0, 3, 4, 5}, 16)).out.numel(), 0);
}

TEST(AttentionReference, SingleTokenAndSingleFeature) {
  for (const Case& c : {Case{1, 1, 1, 1, 1, 1}, Case{1, 1, 1, 9, 1, 1}, Case{1, 1, 7, 1, 5, 2}}) {
    const Problem in = random_problem(c, 17);
    EXPECT_TRUE(all_close("out", run_forward<double>(in).out, naive_attention_forward<double>(in).out, 1e-14));
    expect_gradients_match(in, 170);
  }
}

TEST(AttentionReference, HugeLogitsStayFinite) {
  Problem in = random_problem({1, 1, 6, 6, 4, 3}, 18);
  for (int64_t n = 0; n < in.q.numel(); ++n) in.q[n] *= 100.0;
  for (int64_t n = 0; n < in.k.numel(); ++n) in.k[n] *= 100.0;  // |q·k|/√d ~ 1e4
  const Result r = run_forward<float>(in);
  const testing::NaiveAttention<double> exact = naive_attention_forward<double>(in);
  const double tol = testing::tolerance_from_naive(naive_attention_forward<float>(in).out, exact.out);
  EXPECT_TRUE(all_close("out", r.out, exact.out, tol));
  for (int64_t n = 0; n < r.lse.numel(); ++n) EXPECT_TRUE(std::isfinite(r.lse[n]));
}

TEST(AttentionReference, AcceptsRankTwoAndThreeAndStridedInputs) {
  Rng rng(19);
  // A fused QKV buffer [T, 3·D]: q, k and v are strided column slices of it.
  const int64_t T = 7, D = 4;
  const Tensor<double> qkv_buffer = random_tensor<double>({T, 3 * D}, rng);
  auto slice = [&](int64_t part) {
    return TensorView<const double>{qkv_buffer.data() + part * D, Shape{T, D}, {3 * D, 1}};
  };
  Tensor<double> out({T, D});
  attention_forward_reference<double>({.q = slice(0), .k = slice(1), .v = slice(2), .scale = {}, .mask = {}},
                                      {.out = out.view(), .weights = {}, .lse = {}});
  Problem contiguous{.q = to_tensor<double, double>(slice(0)),
                     .k = to_tensor<double, double>(slice(1)),
                     .v = to_tensor<double, double>(slice(2))};
  for (Tensor<double>* t : {&contiguous.q, &contiguous.k, &contiguous.v}) {
    *t = Tensor<double>({1, 1, T, D}, t->values());
  }
  EXPECT_TRUE(all_close("out", Tensor<double>({1, 1, T, D}, out.values()),
                        naive_attention_forward<double>(contiguous).out, 1e-14));

  const Problem heads = random_problem({1, 3, 4, 5, 2, 2}, 20);
  Problem rank3{.q = Tensor<double>({3, 4, 2}, heads.q.values()),
                .k = Tensor<double>({3, 5, 2}, heads.k.values()),
                .v = Tensor<double>({3, 5, 2}, heads.v.values())};
  EXPECT_EQ(run_forward<double>(rank3).out.values(), run_forward<double>(heads).out.values());
}

// --- refusals -------------------------------------------------------------------------------------

void expect_error_mentions(const std::function<void()>& call, const std::vector<std::string>& fragments) {
  EXPECT_TRUE(testing::throws_naming<Error>(call, fragments));
}

TEST(AttentionReference, RefusesMismatchedShapes) {
  const Problem in = random_problem({2, 3, 4, 5, 6, 7}, 21);
  Tensor<float> out({2, 3, 4, 7});
  auto call = [&](const Tensor<double>& q, const Tensor<double>& k, const Tensor<double>& v) {
    Tensor<double> o({2, 3, 4, 7});
    attention_forward_reference<double>({.q = q.view(), .k = k.view(), .v = v.view(), .scale = {}, .mask = {}},
                                        {.out = o.view(), .weights = {}, .lse = {}});
  };
  expect_error_mentions(
      [&] {
        call(in.q, Tensor<double>({2, 3, 5, 5}), in.v);
      },
      {"k:", "[2, 3, 5, 6]", "[2, 3, 5, 5]"});
  expect_error_mentions([&] { call(in.q, in.k, Tensor<double>({2, 3, 4, 7})); }, {"v:", "[2, 3, 5, 7]"});
  expect_error_mentions([&] { call(in.q, Tensor<double>({3, 5, 6}), in.v); }, {"k:"});
  expect_error_mentions([&] { call(Tensor<double>({6}), in.k, in.v); }, {"q:", "rank"});
  expect_error_mentions([&] { call(Tensor<double>({2, 3, 4, 0}), Tensor<double>({2, 3, 5, 0}), in.v); }, {"q:", "d_k"});
  expect_error_mentions(
      [&] {
        Tensor<double> wrong_out({2, 3, 4, 6});
        attention_forward_reference<double>(
            {.q = in.q.view(), .k = in.k.view(), .v = in.v.view(), .scale = {}, .mask = {}},
            {.out = wrong_out.view(), .weights = {}, .lse = {}});
      },
      {"out:", "[2, 3, 4, 7]"});
}

TEST(AttentionReference, RefusesMasksThatDoNotBroadcast) {
  Problem in = random_problem({1, 2, 4, 5, 3, 3}, 22);
  in.allowed = Tensor<uint8_t>({4, 4}, 1);
  expect_error_mentions([&] { run_forward<double>(in); }, {"mask:", "[4, 4]", "[1, 2, 4, 5]"});
  in.allowed.reset();
  in.bias = Tensor<double>({3, 1, 1});
  expect_error_mentions([&] { run_forward<double>(in); }, {"bias:", "[3, 1, 1]"});
}

TEST(AttentionReference, RefusesNonFiniteScale) {
  Problem in = random_problem({}, 23);
  in.scale = std::numeric_limits<double>::quiet_NaN();
  expect_error_mentions([&] { run_forward<double>(in); }, {"scale"});
}

TEST(AttentionReference, RefusesProblemsLargerThanMemoryUpFront) {
  // One float broadcast to a million tokens: nothing is read before the size check refuses.
  const float one = 1.0f;
  const TensorView<const float> huge{&one, Shape{1, 1, 1'000'000, 1}, {0, 0, 0, 0}};
  Tensor<float> out_unused({1});
  const AttentionParams<float> p{.q = huge, .k = huge, .v = huge, .scale = {}, .mask = {}};
  const TensorView<float> out{out_unused.data(), Shape{1, 1, 1'000'000, 1}, {0, 0, 0, 0}};
  expect_error_mentions([&] { attention_forward_reference(p, {.out = out, .weights = {}, .lse = {}}); },
                        {"needs", "GiB", "available"});
}

}  // namespace
}  // namespace qkv
