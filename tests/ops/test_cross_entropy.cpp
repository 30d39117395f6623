#include "qkv/ops/cross_entropy.hpp"

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
using testing::random_tensor;
using testing::throws_naming;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();

Tensor<int64_t> random_targets(const Shape& shape, int64_t classes, Rng& rng) {
  Tensor<int64_t> t(shape);
  for (int64_t n = 0; n < t.numel(); ++n) t[n] = static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(classes));
  return t;
}

// −log softmax(x)_t computed as plainly as possible in float64: p = exp(x_t) / Σ exp(x_c).
double naive_row_loss(const double* x, int64_t classes, int64_t target) {
  double sum = 0.0;
  for (int64_t c = 0; c < classes; ++c) sum += std::exp(x[c]);
  return -std::log(std::exp(x[target]) / sum);
}

template <class T>
double run(const Tensor<T>& logits, const Tensor<int64_t>& targets, CrossEntropyCache<T>& cache,
           std::optional<int64_t> ignore_index = std::nullopt) {
  return cross_entropy_forward<T>({.logits = logits.cview(), .targets = targets.cview(), .ignore_index = ignore_index},
                                  cache);
}

TEST(CrossEntropy, LossIsMinusLogSoftmaxOfTheTarget) {
  Rng rng(1);
  for (const Shape& shape : std::vector<Shape>{{5, 7}, {1, 113}, {2, 3, 9}, {2, 2, 2, 4}}) {
    SCOPED_TRACE(shape.str());
    const int64_t classes = shape.from_back(1);
    const int64_t rows = shape.numel() / classes;
    const Tensor<double> logits = random_tensor<double>(shape, rng, 2.0);
    std::vector<int64_t> lead(shape.dims().begin(), shape.dims().end() - 1);
    const Tensor<int64_t> targets = random_targets(Shape(std::span<const int64_t>(lead)), classes, rng);
    CrossEntropyCache<double> cache;
    Tensor<double> row_losses(targets.shape());
    const double loss =
        cross_entropy_forward<double>({.logits = logits.cview(), .targets = targets.cview()}, cache, row_losses.view());
    double mean = 0.0;
    for (int64_t n = 0; n < rows; ++n) {
      const double expected = naive_row_loss(logits.data() + n * classes, classes, targets[n]);
      // exp of |x| ≲ 8 and a C-term sum: a few ε·C relative error on each side.
      EXPECT_NEAR(row_losses[n], expected, 8.0 * static_cast<double>(classes) * kEps64 * std::max(1.0, expected));
      mean += expected / static_cast<double>(rows);
    }
    EXPECT_NEAR(loss, mean, 8.0 * static_cast<double>(classes + rows) * kEps64 * std::max(1.0, mean));
  }
}

// ∂loss/∂x_{n,c} = (softmax(x_n)_c − [c = t_n]) / N, times dloss.
TEST(CrossEntropy, GradientIsSoftmaxMinusOneHot) {
  Rng rng(2);
  const Tensor<double> logits = random_tensor<double>(Shape{6, 5}, rng);
  const Tensor<int64_t> targets = random_targets(Shape{6}, 5, rng);
  CrossEntropyCache<double> cache;
  run(logits, targets, cache);
  Tensor<double> dlogits(logits.shape());
  cross_entropy_backward(cache, 3.0, dlogits.view());
  Tensor<double> expected(logits.shape());
  for (int64_t n = 0; n < 6; ++n) {
    double sum = 0.0;
    for (int64_t c = 0; c < 5; ++c) sum += std::exp(logits[n * 5 + c]);
    for (int64_t c = 0; c < 5; ++c) {
      expected[n * 5 + c] = 3.0 / 6.0 * (std::exp(logits[n * 5 + c]) / sum - (c == targets[n] ? 1.0 : 0.0));
    }
  }
  EXPECT_TRUE(all_close("dlogits", dlogits, expected, 16.0 * 5 * kEps64));
  // Each row's gradient sums to 0: the softmax sums to 1, the one-hot too.
  for (int64_t n = 0; n < 6; ++n) {
    double sum = 0.0;
    for (int64_t c = 0; c < 5; ++c) sum += dlogits[n * 5 + c];
    EXPECT_NEAR(sum, 0.0, 16.0 * 5 * kEps64);
  }
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  Rng rng(3);
  for (const Shape& shape : std::vector<Shape>{{4, 3}, {2, 3, 5}, {1, 1}, {3, 2}}) {
    SCOPED_TRACE(shape.str());
    const int64_t classes = shape.from_back(1);
    Tensor<double> logits = random_tensor<double>(shape, rng, 2.0);
    std::vector<int64_t> lead(shape.dims().begin(), shape.dims().end() - 1);
    Tensor<int64_t> targets = random_targets(Shape(std::span<const int64_t>(lead)), classes, rng);
    if (targets.numel() > 2) targets[1] = -100;  // one ignored row
    const auto loss = [&] {
      CrossEntropyCache<double> c;
      return run(logits, targets, c, -100);
    };
    CrossEntropyCache<double> cache;
    run(logits, targets, cache, -100);
    Tensor<double> dlogits(shape);
    cross_entropy_backward(cache, 1.0, dlogits.view());
    // The loss is smooth with |∂³loss/∂x³| ≤ 1/N' per row (softmax's derivatives are bounded by 1):
    // step h errs by h²/6 plus the rounding of two C-term evaluations (ε·C·|loss|) over 2h.
    const double step = 1e-5;
    const double tolerance = step * step + static_cast<double>(classes) * kEps64 * (1.0 + loss()) / step;
    EXPECT_TRUE(all_close("dlogits", dlogits, testing::numeric_gradient(loss, logits, step), tolerance));
  }
}

TEST(CrossEntropy, IgnoredRowsAreLeftOut) {
  Rng rng(4);
  const Tensor<double> logits = random_tensor<double>(Shape{4, 3}, rng);
  const Tensor<int64_t> targets(Shape{4}, {2, -1, 0, -1});
  CrossEntropyCache<double> cache;
  Tensor<double> row_losses(Shape{4}, 9.0);
  const double loss = cross_entropy_forward<double>(
      {.logits = logits.cview(), .targets = targets.cview(), .ignore_index = -1}, cache, row_losses.view());
  const double expected = (naive_row_loss(logits.data(), 3, 2) + naive_row_loss(logits.data() + 6, 3, 0)) / 2.0;
  EXPECT_NEAR(loss, expected, 64.0 * kEps64);
  EXPECT_EQ(row_losses[1], 0.0);
  EXPECT_EQ(row_losses[3], 0.0);
  EXPECT_EQ(cache.counted, 2);
  Tensor<double> dlogits(logits.shape());
  cross_entropy_backward(cache, 1.0, dlogits.view());
  for (int64_t c = 0; c < 3; ++c) {
    EXPECT_EQ(dlogits[3 + c], 0.0);
    EXPECT_EQ(dlogits[9 + c], 0.0);
    EXPECT_NE(dlogits[c], 0.0);
  }
  // Every row ignored, or no row: the loss is 0 and so is every gradient, never NaN.
  const Tensor<int64_t> all_ignored(Shape{4}, {-1, -1, -1, -1});
  EXPECT_EQ(run(logits, all_ignored, cache, -1), 0.0);
  Tensor<double> dnone(logits.shape());
  cross_entropy_backward(cache, 1.0, dnone.view());
  EXPECT_TRUE(all_close("dlogits", dnone, Tensor<double>(logits.shape()), 0.0));
  const Tensor<double> empty(Shape{0, 3});
  EXPECT_EQ(run(empty, Tensor<int64_t>(Shape{0}), cache), 0.0);
}

// Large logits neither overflow nor lose the loss: adding a constant to a row changes nothing.
TEST(CrossEntropy, LargeLogitsAreStable) {
  Rng rng(5);
  const Tensor<float> logits = random_tensor<float>(Shape{3, 50}, rng);
  Tensor<float> shifted = logits;
  for (float& e : shifted.values()) e += 1e4f;
  const Tensor<int64_t> targets = random_targets(Shape{3}, 50, rng);
  CrossEntropyCache<float> cache, shifted_cache;
  const double loss = run(logits, targets, cache);
  const double shifted_loss = run(shifted, targets, shifted_cache);
  ASSERT_TRUE(std::isfinite(shifted_loss));
  // Rounding x + 1e4 to float32 moves each logit by up to ulp(1e4)/2 = 2^-11: the loss by twice that.
  EXPECT_NEAR(shifted_loss, loss, 2.0 * std::ldexp(1.0, -11));
  // A confident correct row has loss ≈ 0 and a confident wrong one ≈ the margin, both exact-ish.
  const Tensor<double> sharp(Shape{2, 2}, {1000.0, 0.0, 1000.0, 0.0});
  const Tensor<int64_t> sharp_targets(Shape{2}, {0, 1});
  CrossEntropyCache<double> sharp_cache;
  Tensor<double> row_losses(Shape{2});
  cross_entropy_forward<double>({.logits = sharp.cview(), .targets = sharp_targets.cview()}, sharp_cache,
                                row_losses.view());
  EXPECT_EQ(row_losses[0], 0.0);
  EXPECT_EQ(row_losses[1], 1000.0);
}

TEST(CrossEntropy, FloatMatchesFloat64) {
  Rng rng(6);
  const Tensor<float> logits = random_tensor<float>(Shape{37, 113}, rng, 3.0);
  const Tensor<int64_t> targets = random_targets(Shape{37}, 113, rng);
  CrossEntropyCache<float> cache;
  CrossEntropyCache<double> cache64;
  const Tensor<double> logits64 = testing::cast<double>(logits);
  const double loss = run(logits, targets, cache);
  const double loss64 = run(logits64, targets, cache64);
  // Both accumulate in float64 from the same float32 inputs: only the rounding of the result's
  // pieces to float32 (probabilities) differs, and the loss is computed in float64 on both sides.
  EXPECT_NEAR(loss, loss64, 64.0 * 113 * kEps64 * loss64);
  Tensor<float> dlogits(logits.shape());
  Tensor<double> dlogits64(logits.shape());
  cross_entropy_backward(cache, 1.0, dlogits.view());
  cross_entropy_backward(cache64, 1.0, dlogits64.view());
  // Each gradient is (p − onehot)/N rounded once to float32 from a float32 p: two float32 roundings.
  EXPECT_TRUE(all_close("dlogits", dlogits, dlogits64,
                        2.0 * std::numeric_limits<float>::epsilon() * (1.0 + 1.0 / 37.0) / 37.0));
}

TEST(CrossEntropy, OneClassHasNoLoss) {
  const Tensor<double> logits(Shape{3, 1}, {5.0, -2.0, 0.0});
  const Tensor<int64_t> targets(Shape{3}, {0, 0, 0});
  CrossEntropyCache<double> cache;
  EXPECT_EQ(run(logits, targets, cache), 0.0);
  Tensor<double> dlogits(logits.shape());
  cross_entropy_backward(cache, 1.0, dlogits.view());
  EXPECT_TRUE(all_close("dlogits", dlogits, Tensor<double>(logits.shape()), 0.0));
}

TEST(CrossEntropy, ThreadCountDoesNotChangeResults) {
  const int original_workers = max_workers();
  std::vector<float> reference_grad;
  double reference_loss = 0.0;
  for (int threads : {1, 2, 3}) {
    set_max_workers(threads);
    Rng rng(7);
    const Tensor<float> logits = random_tensor<float>(Shape{8, 500, 65}, rng, 3.0);
    const Tensor<int64_t> targets = random_targets(Shape{8, 500}, 65, rng);
    CrossEntropyCache<float> cache;
    const double loss = run(logits, targets, cache);
    Tensor<float> dlogits(logits.shape());
    cross_entropy_backward(cache, 1.0, dlogits.view());
    if (threads == 1) {
      reference_loss = loss;
      reference_grad = dlogits.values();
    } else {
      EXPECT_EQ(loss, reference_loss) << threads << " threads";
      EXPECT_EQ(dlogits.values(), reference_grad) << threads << " threads";
    }
  }
  set_max_workers(original_workers);
}

TEST(CrossEntropy, BadArgumentsNameTheArgument) {
  const Tensor<double> logits(Shape{2, 3});
  CrossEntropyCache<double> cache;
  const Tensor<int64_t> out_of_range(Shape{2}, {1, 3});
  EXPECT_TRUE(
      throws_naming<ValueError>([&] { run(logits, out_of_range, cache); }, {"targets:", "[0, 3)", "3", "row 1"}));
  EXPECT_TRUE(throws_naming<ValueError>([&] { run(logits, out_of_range, cache, -100); }, {"targets:", "-100", "3"}));
  const Tensor<int64_t> wrong_shape(Shape{3}, {0, 0, 0});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { run(logits, wrong_shape, cache); }, {"targets:", "[2]", "[3]"}));
  const Tensor<double> vector(Shape{3});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { run(vector, Tensor<int64_t>(Shape{}), cache); }, {"logits:", "[3]"}));
  const Tensor<int64_t> targets(Shape{2}, {0, 2});
  run(logits, targets, cache);
  Tensor<double> dlogits_bad(Shape{2, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { cross_entropy_backward(cache, 1.0, dlogits_bad.view()); },
                                        {"dlogits:", "[2, 4]"}));
  Tensor<double> row_losses_bad(Shape{3});
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        cross_entropy_forward<double>({.logits = logits.cview(), .targets = targets.cview()}, cache,
                                      row_losses_bad.view());
      },
      {"row_losses:", "[2]", "[3]"}));
}

}  // namespace
}  // namespace qkv
