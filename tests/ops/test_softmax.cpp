// Tests of softmax and log-sum-exp (src/ops/softmax.cpp): float64 reference, finite differences,
// −inf handling and numerical stability.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/ops/softmax.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::numeric_gradient;
using testing::random_tensor;

constexpr double kInf = std::numeric_limits<double>::infinity();

Tensor<double> softmax_of(const Tensor<double>& x, Tensor<double>* lse = nullptr) {
  Tensor<double> y(x.shape());
  std::optional<TensorView<double>> lse_view;
  if (lse) lse_view = lse->view();
  softmax_forward<double>(x.view(), y.view(), lse_view);
  return y;
}

TEST(Softmax, MatchesTheDefinitionAndRowsSumToOne) {
  Rng rng(1);
  const Tensor<double> x = random_tensor<double>({3, 4, 7}, rng, 3.0);
  Tensor<double> lse({3, 4});
  const Tensor<double> y = softmax_of(x, &lse);
  for (int64_t r = 0; r < 12; ++r) {
    double z = 0, sum = 0;
    for (int64_t j = 0; j < 7; ++j) z += std::exp(x[r * 7 + j]);
    for (int64_t j = 0; j < 7; ++j) {
      EXPECT_NEAR(y[r * 7 + j], std::exp(x[r * 7 + j]) / z, 1e-15);
      sum += y[r * 7 + j];
    }
    EXPECT_NEAR(sum, 1.0, 8 * std::numeric_limits<double>::epsilon());
    EXPECT_NEAR(lse[r], std::log(z), 1e-14);
  }
}

TEST(Softmax, Float32AgreesWithFloat64) {
  Rng rng(2);
  const Tensor<double> x = random_tensor<double>({5, 113}, rng, 5.0);
  const Tensor<float> xf = testing::cast<float>(x);
  Tensor<float> yf(xf.shape());
  softmax_forward<float>(xf.view(), yf.view());
  // One float32 rounding of the input (relative ε·|x| on the exponent) and one of the output.
  double max_abs_x = 0;
  for (double v : x.values()) max_abs_x = std::max(max_abs_x, std::abs(v));
  const double tol = 2 * std::numeric_limits<float>::epsilon() * (1 + 2 * max_abs_x);
  EXPECT_TRUE(all_close("softmax float32", yf, softmax_of(testing::cast<double>(xf)), tol));
}

TEST(Softmax, StableForHugeInputs) {
  const Tensor<double> x({3}, {1e4, 1e4 - 1.0, -1e4});
  Tensor<double> lse{Shape{}};
  const Tensor<double> y = softmax_of(x, &lse);
  EXPECT_NEAR(y[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-15);
  EXPECT_NEAR(lse[0], 1e4 + std::log1p(std::exp(-1.0)), 1e-11);
  EXPECT_EQ(y[2], 0.0);
}

TEST(Softmax, NegativeInfinityMasksAndEmptyRowsGiveZero) {
  const Tensor<double> x({3, 3}, {0.0, -kInf, 0.0, -kInf, -kInf, -kInf, 1.0, 1.0, 1.0});
  Tensor<double> lse({3});
  const Tensor<double> y = softmax_of(x, &lse);
  EXPECT_EQ(y[1], 0.0);
  EXPECT_DOUBLE_EQ(y[0], 0.5);
  for (int j = 3; j < 6; ++j) EXPECT_EQ(y[j], 0.0);
  EXPECT_EQ(lse[1], -kInf);
  EXPECT_EQ(logsumexp<double>(std::span<const double>()), -kInf);
}

// NaN is not a mask: a row of NaN (or one NaN among masked keys) gives NaN weights and lse, as the
// fused kernel does, never the zeros of a row that sees no key.
TEST(Softmax, NaNReachesEveryWeightOfItsRow) {
  const double nan = std::nan("");
  const Tensor<double> x({3, 2}, {nan, nan, -kInf, nan, nan, 1.0});
  Tensor<double> lse({3});
  const Tensor<double> y = softmax_of(x, &lse);
  for (int64_t i = 0; i < 6; ++i) EXPECT_TRUE(std::isnan(y[i])) << "weight " << i;
  for (int64_t i = 0; i < 3; ++i) EXPECT_TRUE(std::isnan(lse[i])) << "row " << i;
}

TEST(Softmax, OneRowMatchesTheTensorFormInPlaceAndMasked) {
  Rng rng(7);
  const Tensor<float> x = random_tensor<float>({3, 5}, rng, 4.0);
  Tensor<float> y({3, 5}), lse({3});
  softmax_forward<float>(x.cview(), y.view(), lse.view());
  for (int64_t r = 0; r < 3; ++r) {
    std::vector<float> row(x.data() + r * 5, x.data() + (r + 1) * 5);
    const double row_lse = softmax<float>(row, row);  // in place
    EXPECT_EQ(static_cast<float>(row_lse), lse[r]);
    for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(row[static_cast<size_t>(j)], y[r * 5 + j]) << "row " << r << ", " << j;
  }
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> masked = {-inf, -inf, -inf};
  EXPECT_EQ(softmax<double>(masked, masked), -inf);
  EXPECT_EQ(masked, (std::vector<double>{0, 0, 0}));
  std::vector<double> empty;
  EXPECT_EQ(softmax<double>(empty, empty), -inf);
  std::vector<double> shorter(2);
  EXPECT_THROW(softmax<double>(masked, shorter), ShapeError);
}

TEST(Softmax, BackwardMatchesFiniteDifferences) {
  Rng rng(3);
  Tensor<double> x = random_tensor<double>({2, 3, 5}, rng);
  const Tensor<double> dy = random_tensor<double>(x.shape(), rng);
  const Tensor<double> y = softmax_of(x);
  Tensor<double> dx(x.shape());
  softmax_backward<double>(y.view(), dy.view(), dx.view());
  const Tensor<double> numeric = numeric_gradient([&] { return testing::dot(softmax_of(x), dy); }, x);
  EXPECT_TRUE(all_close("dx", dx, numeric, 1e-8));
}

TEST(Softmax, LogSumExpBackwardMatchesFiniteDifferences) {
  Rng rng(4);
  Tensor<double> x = random_tensor<double>({4, 6}, rng);
  const Tensor<double> dlse = random_tensor<double>({4}, rng);
  Tensor<double> lse({4});
  softmax_of(x, &lse);
  Tensor<double> dx(x.shape());
  logsumexp_backward<double>(x.view(), lse.view(), dlse.view(), dx.view());
  auto loss = [&] {
    Tensor<double> l({4});
    softmax_of(x, &l);
    return testing::dot(l, dlse);
  };
  EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x), 1e-8));
}

TEST(Softmax, BackwardAccumulates) {
  const Tensor<double> y({2}, {0.25, 0.75});
  const Tensor<double> dy({2}, {1.0, 0.0});
  Tensor<double> dx({2}, {10.0, 10.0});
  softmax_backward<double>(y.view(), dy.view(), dx.view());
  EXPECT_DOUBLE_EQ(dx[0], 10.0 + 0.25 * (1.0 - 0.25));
  EXPECT_DOUBLE_EQ(dx[1], 10.0 + 0.75 * (0.0 - 0.25));
}

}  // namespace
}  // namespace qkv
