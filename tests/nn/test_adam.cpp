#include "qkv/nn/adam.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::throws_naming;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();

// Two steps on p = [1, −2] with gradients [0.5, −1] then [−0.25, 0.3], lr 0.1 and the default
// betas and eps; for p[0], by hand:
//   t = 1: m = 0.1·0.5 = 0.05, v = 0.001·0.25 = 2.5e-4, m̂ = 0.05/0.1 = 0.5, v̂ = 2.5e-4/0.001 = 0.25,
//          p = 1 − 0.1·0.5/(√0.25 + 1e-8) = 1 − 0.05/0.50000001 = 0.900000002
//   t = 2: m = 0.045 − 0.025 = 0.02, v = 0.999·2.5e-4 + 0.001·0.0625 = 3.1225e-4,
//          m̂ = 0.02/0.19, v̂ = 3.1225e-4/0.001999,
//          p = 0.900000002 − 0.1·(0.02/0.19)/(√(3.1225e-4/0.001999) + 1e-8) = 0.8733662987078463
// (PyTorch 1.13's torch.optim.Adam prints the same numbers, and −1.900000001, −1.8572151424292265
// for p[1].)
TEST(Adam, TwoStepsByHand) {
  Parameter<double> p(Shape{2});
  p.value[0] = 1.0;
  p.value[1] = -2.0;
  Adam<double> adam({p.ref("p")}, {.lr = 0.1});
  p.grad[0] = 0.5;
  p.grad[1] = -1.0;
  EXPECT_NEAR(adam.step(), std::sqrt(1.25), kEps64);
  EXPECT_EQ(adam.steps(), 1);
  // A few roundings of numbers of magnitude ≤ 2 per step.
  const double tolerance = 16.0 * kEps64 * 2.0;
  EXPECT_NEAR(p.value[0], 0.900000002, tolerance);
  EXPECT_NEAR(p.value[1], -1.900000001, tolerance);
  p.grad[0] = -0.25;
  p.grad[1] = 0.3;
  adam.step();
  EXPECT_NEAR(p.value[0], 0.8733662987078463, tolerance);
  EXPECT_NEAR(p.value[1], -1.8572151424292265, tolerance);
}

// Weight decay λ = 0.5 on the same problem: AdamW first shrinks p by lr·λ (1 → 0.95, then the
// Adam step as above: 0.850000002), Adam adds λp to the gradient (0.5 + 0.5 = 1: the same first
// step size, as Adam's first step is lr·sign(g): 0.900000001). Values checked against PyTorch 1.13.
TEST(Adam, WeightDecayCoupledAndDecoupled) {
  for (bool decoupled : {true, false}) {
    SCOPED_TRACE(decoupled ? "AdamW" : "Adam + L2");
    Parameter<double> p(Shape{2});
    p.value[0] = 1.0;
    p.value[1] = -2.0;
    Adam<double> adam({p.ref("p")}, {.lr = 0.1, .weight_decay = 0.5, .decoupled_weight_decay = decoupled});
    const double tolerance = 16.0 * kEps64 * 2.0;
    p.grad[0] = 0.5;
    p.grad[1] = -1.0;
    adam.step();
    EXPECT_NEAR(p.value[0], decoupled ? 0.8500000019999999 : 0.900000001, tolerance);
    EXPECT_NEAR(p.value[1], decoupled ? -1.800000001 : -1.9000000005, tolerance);
    p.grad[0] = -0.25;
    p.grad[1] = 0.3;
    adam.step();
    EXPECT_NEAR(p.value[0], decoupled ? 0.7808662986078463 : 0.8196959042420043, tolerance);
    EXPECT_NEAR(p.value[1], decoupled ? -1.6672151423792263 : -1.8132675837534213, tolerance);
  }
}

// The global norm runs over every parameter: grads [3] and [4] have norm 5. Clipped to 1 they are
// scaled by 1/(5 + 1e-6); below the limit they are left alone.
TEST(Adam, ClipGradNorm) {
  Parameter<double> a(Shape{1}), b(Shape{1, 1});
  a.grad[0] = 3.0;
  b.grad[0] = -4.0;
  const std::vector<ParameterRef<double>> params{a.ref("a"), b.ref("b")};
  EXPECT_EQ(grad_norm(params), 5.0);
  EXPECT_EQ(clip_grad_norm(params, 10.0), 5.0);
  EXPECT_EQ(a.grad[0], 3.0);
  EXPECT_EQ(b.grad[0], -4.0);
  EXPECT_EQ(clip_grad_norm(params, 1.0), 5.0);
  EXPECT_NEAR(a.grad[0], 3.0 / (5.0 + 1e-6), 2.0 * kEps64);
  EXPECT_NEAR(b.grad[0], -4.0 / (5.0 + 1e-6), 2.0 * kEps64);
  EXPECT_NEAR(grad_norm(params), 1.0, 1e-6);

  // Through Adam: the step sees the clipped gradient and reports the norm before clipping.
  Parameter<double> p(Shape{2});
  p.grad[0] = 30.0;
  p.grad[1] = 40.0;
  Adam<double> adam({p.ref("p")}, {.lr = 0.1, .max_grad_norm = 1.0});
  EXPECT_EQ(adam.step(), 50.0);
  EXPECT_NEAR(p.grad[0], 0.6, 1e-7);
  EXPECT_NEAR(p.grad[1], 0.8, 1e-7);

  p.grad[0] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(throws_naming<ValueError>([&] { adam.step(); }, {"gradients:", "nan"}));
  EXPECT_TRUE(throws_naming<ValueError>([&] { clip_grad_norm(params, 0.0); }, {"max_norm", "0"}));
}

// Adam's first step moves every element by lr·g/(|g| + eps) ≈ lr·sign(g), whatever the scale of g.
TEST(Adam, FirstStepIsScaleFree) {
  Parameter<float> p(Shape{4});
  const std::vector<float> grads{1e-3f, -5.0f, 200.0f, -0.5f};
  for (int64_t i = 0; i < 4; ++i) p.grad[i] = grads[static_cast<size_t>(i)];
  Adam<float> adam({p.ref("p")}, {.lr = 0.01});
  adam.step();
  for (int64_t i = 0; i < 4; ++i) {
    const double g = grads[static_cast<size_t>(i)];
    EXPECT_NEAR(p.value[i], -0.01 * g / (std::abs(g) + 1e-8), 0.01 * std::numeric_limits<float>::epsilon());
  }
}

// Minimises Σ (p − c)² from 0: Adam reaches c.
TEST(Adam, MinimisesAQuadratic) {
  Parameter<double> p(Shape{3});
  const std::vector<double> target{1.5, -0.25, 3.0};
  Adam<double> adam({p.ref("p")}, {.lr = 0.05});
  for (int step = 0; step < 2000; ++step) {
    adam.zero_grad();
    for (int64_t i = 0; i < 3; ++i) p.grad[i] = 2.0 * (p.value[i] - target[static_cast<size_t>(i)]);
    adam.step();
  }
  for (int64_t i = 0; i < 3; ++i) EXPECT_NEAR(p.value[i], target[static_cast<size_t>(i)], 1e-3);
}

TEST(Adam, ZeroGradAndLearningRate) {
  Parameter<float> a(Shape{2, 3}), b(Shape{5});
  for (float& g : a.grad.values()) g = 1.0f;
  for (float& g : b.grad.values()) g = -2.0f;
  Adam<float> adam({a.ref("a"), b.ref("b")}, {});
  adam.zero_grad();
  EXPECT_TRUE(all_close("a.grad", a.grad, Tensor<float>(Shape{2, 3}), 0.0));
  EXPECT_TRUE(all_close("b.grad", b.grad, Tensor<float>(Shape{5}), 0.0));
  // With lr 0 a step changes nothing but the step count.
  adam.set_lr(0.0);
  for (float& g : a.grad.values()) g = 1.0f;
  adam.step();
  EXPECT_TRUE(all_close("a", a.value, Tensor<float>(Shape{2, 3}), 0.0));
  EXPECT_EQ(adam.steps(), 1);
  EXPECT_TRUE(throws_naming<ValueError>([&] { adam.set_lr(-1.0); }, {"lr", "-1"}));
}

// A strided parameter view is updated element by element as a contiguous one would be.
TEST(Adam, StridedParameters) {
  Tensor<double> storage(Shape{3, 2}, {1.0, 9.0, 2.0, 9.0, 3.0, 9.0});
  Tensor<double> grad_storage(Shape{3, 2}, {0.1, 7.0, -0.2, 7.0, 0.3, 7.0});
  const ParameterRef<double> column{
      "column", {storage.data(), Shape{3}, {2, 0, 0, 0}}, {grad_storage.data(), Shape{3}, {2, 0, 0, 0}}};
  Parameter<double> plain(Shape{3});
  plain.value = Tensor<double>(Shape{3}, {1.0, 2.0, 3.0});
  plain.grad = Tensor<double>(Shape{3}, {0.1, -0.2, 0.3});
  Adam<double> strided_adam({column}, {.lr = 0.1});
  Adam<double> plain_adam({plain.ref("plain")}, {.lr = 0.1});
  strided_adam.step();
  plain_adam.step();
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(storage[2 * i], plain.value[i]);
    EXPECT_EQ(storage[2 * i + 1], 9.0);
  }
}

TEST(Adam, ThreadCountDoesNotChangeResults) {
  const int original_workers = max_workers();
  std::vector<float> reference;
  for (int threads : {1, 2, 3}) {
    set_max_workers(threads);
    Rng rng(1);
    Parameter<float> p(Shape{50000});
    rng.fill_normal(p.value.view());
    Adam<float> adam({p.ref("p")}, {.lr = 0.01, .weight_decay = 0.1, .max_grad_norm = 10.0});
    for (int step = 0; step < 3; ++step) {
      rng.fill_normal(p.grad.view());
      adam.step();
    }
    if (threads == 1) {
      reference = p.value.values();
    } else {
      EXPECT_EQ(p.value.values(), reference) << threads << " threads";
    }
  }
  set_max_workers(original_workers);
}

TEST(Adam, BadConfigNamesTheField) {
  Parameter<double> p(Shape{2});
  const auto make = [&](const AdamConfig& config) { return [&p, config] { Adam<double>({p.ref("p")}, config); }; };
  EXPECT_TRUE(throws_naming<ValueError>(make({.lr = -0.1}), {"lr", "-0.1"}));
  EXPECT_TRUE(throws_naming<ValueError>(make({.beta1 = 1.0}), {"beta1", "[0, 1)", "1"}));
  EXPECT_TRUE(throws_naming<ValueError>(make({.beta2 = -0.5}), {"beta2", "-0.5"}));
  EXPECT_TRUE(throws_naming<ValueError>(make({.eps = 0.0}), {"eps", "0"}));
  EXPECT_TRUE(throws_naming<ValueError>(make({.weight_decay = -1.0}), {"weight_decay", "-1"}));
  EXPECT_TRUE(throws_naming<ValueError>(make({.max_grad_norm = 0.0}), {"max_grad_norm", "0"}));
  Tensor<double> value(Shape{2}), grad(Shape{3});
  const ParameterRef<double> mismatched{"w", value.view(), grad.view()};
  EXPECT_TRUE(throws_naming<ShapeError>([&] { Adam<double>({mismatched}, {}); }, {"w (grad)", "[2]", "[3]"}));
}

}  // namespace
}  // namespace qkv
