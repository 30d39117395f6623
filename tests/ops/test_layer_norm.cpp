#include "qkv/ops/layer_norm.hpp"

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
using testing::cast;
using testing::numeric_gradient;
using testing::random_tensor;
using testing::throws_naming;
using testing::tolerance_from_naive;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();

int64_t rows_of(const Shape& shape) { return shape.numel() / shape.from_back(1); }

// LayerNorm by the definition, every operation in Acc (two-pass mean and variance): the float64
// reference when Acc is double, the naive float32 computation that sets the tolerance when float.
template <class Acc>
Tensor<Acc> naive_layer_norm(const Tensor<double>& x, const Tensor<double>& gamma, const Tensor<double>& beta,
                             double eps) {
  const int64_t dim = x.shape().from_back(1);
  Tensor<Acc> y(x.shape());
  for (int64_t r = 0; r < rows_of(x.shape()); ++r) {
    Acc mean = 0;
    for (int64_t j = 0; j < dim; ++j) mean += static_cast<Acc>(x[r * dim + j]);
    mean /= static_cast<Acc>(dim);
    Acc var = 0;
    for (int64_t j = 0; j < dim; ++j) {
      const Acc c = static_cast<Acc>(x[r * dim + j]) - mean;
      var += c * c;
    }
    var /= static_cast<Acc>(dim);
    const Acc rstd = Acc{1} / std::sqrt(var + static_cast<Acc>(eps));
    for (int64_t j = 0; j < dim; ++j) {
      y[r * dim + j] =
          static_cast<Acc>(gamma[j]) * (static_cast<Acc>(x[r * dim + j]) - mean) * rstd + static_cast<Acc>(beta[j]);
    }
  }
  return y;
}

// Sets γ and β to random values so that the tests see the affine part at work (it starts at 1, 0).
template <class T>
void randomise_affine(LayerNorm<T>& norm, Rng& rng) {
  for (const ParameterRef<T>& p : norm.parameters()) rng.fill_normal(p.value);
}

template <class T>
Tensor<double> param64(const LayerNorm<T>& norm, size_t index) {
  return to_tensor<double, T>(norm.parameters()[index].value);
}

const std::vector<Shape> kShapes = {{7}, {5, 113}, {2, 3, 7}, {2, 2, 3, 1}, {64, 33}};

TEST(LayerNorm, DoubleMatchesFloat64Reference) {
  Rng rng(1);
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(shape.str());
    const int64_t dim = shape.from_back(1);
    LayerNorm<double> norm({.dim = dim});
    randomise_affine(norm, rng);
    // An offset mean and a non-unit scale, as activations have.
    Tensor<double> x = random_tensor<double>(shape, rng, 3.0);
    for (double& e : x.values()) e += 5.0;
    LayerNormCache<double> cache;
    const Tensor<double> y = norm.forward(x.cview(), cache);
    // The mean and variance sum D terms (γ_D ε relative each); x̂ = (x − μ)·rstd then carries about
    // D·ε·(|μ| + |x|)/σ, scaled by |γ|: bound it by D·ε·(max|x|/σ_min)·max|γ|, with |x|/σ ≤ 10 here.
    double gamma_max = 0.0;
    const Tensor<double> gamma = param64(norm, 0);
    for (double g : gamma.values()) gamma_max = std::max(gamma_max, std::abs(g));
    const double tolerance = 8.0 * static_cast<double>(dim + 2) * kEps64 * 10.0 * (gamma_max + 1.0);
    EXPECT_TRUE(all_close("y", y, naive_layer_norm<double>(x, param64(norm, 0), param64(norm, 1), 1e-5), tolerance));
  }
}

TEST(LayerNorm, FloatMatchesFloat64Reference) {
  Rng rng(2);
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(shape.str());
    LayerNorm<float> norm({.dim = shape.from_back(1)});
    randomise_affine(norm, rng);
    Tensor<float> x = random_tensor<float>(shape, rng, 3.0);
    for (float& e : x.values()) e += 5.0f;
    LayerNormCache<float> cache;
    const Tensor<float> y = norm.forward(x.cview(), cache);
    const Tensor<double> exact = naive_layer_norm<double>(cast<double>(x), param64(norm, 0), param64(norm, 1), 1e-5);
    const Tensor<float> naive = naive_layer_norm<float>(cast<double>(x), param64(norm, 0), param64(norm, 1), 1e-5);
    EXPECT_TRUE(all_close("y", y, exact, tolerance_from_naive(naive, exact)));
  }
}

// Without the affine part each row of y has mean 0 and variance σ²/(σ² + eps); y is invariant
// under x → a·x + c for a > 0 (up to how eps weighs against a²σ²).
TEST(LayerNorm, RowsAreNormalised) {
  Rng rng(3);
  const int64_t dim = 113;
  LayerNorm<double> norm({.dim = dim, .eps = 1e-12, .affine = false});
  EXPECT_TRUE(norm.parameters().empty());
  const Tensor<double> x = random_tensor<double>(Shape{4, dim}, rng, 2.0);
  LayerNormCache<double> cache;
  const Tensor<double> y = norm.forward(x.cview(), cache);
  for (int64_t r = 0; r < 4; ++r) {
    double mean = 0.0, var = 0.0;
    for (int64_t j = 0; j < dim; ++j) mean += y[r * dim + j];
    mean /= dim;
    for (int64_t j = 0; j < dim; ++j) var += (y[r * dim + j] - mean) * (y[r * dim + j] - mean);
    var /= dim;
    EXPECT_NEAR(mean, 0.0, 4.0 * dim * kEps64);
    EXPECT_NEAR(var, 1.0, 4.0 * dim * kEps64 + 1e-12 / 4.0);  // eps/σ² with σ² ≈ 4
  }
  Tensor<double> moved = x;
  for (double& e : moved.values()) e = 3.0 * e - 7.0;
  LayerNormCache<double> moved_cache;
  EXPECT_TRUE(all_close("y(3x − 7)", norm.forward(moved.cview(), moved_cache), y, 64.0 * dim * kEps64));
}

TEST(LayerNorm, GradientsMatchFiniteDifferences) {
  Rng rng(4);
  for (const Shape& shape : std::vector<Shape>{{3, 5}, {2, 2, 7}, {1, 2}, {4}}) {
    for (bool affine : {true, false}) {
      SCOPED_TRACE(::testing::Message() << shape.str() << " affine " << affine);
      const int64_t dim = shape.from_back(1);
      LayerNorm<double> norm({.dim = dim, .affine = affine});
      randomise_affine(norm, rng);
      Tensor<double> x = random_tensor<double>(shape, rng);
      const Tensor<double> dy = random_tensor<double>(shape, rng);
      const auto loss = [&] {
        LayerNormCache<double> cache;
        return testing::dot(dy, norm.forward(x.cview(), cache));
      };
      LayerNormCache<double> cache;
      norm.forward(x.cview(), cache);
      Tensor<double> dx(shape);
      norm.backward(cache, dy.cview(), dx.view());

      // x̂ is a smooth function of x whose k-th derivatives scale as rstd^k, so central differences
      // with step h err by h²/6·|L'''| <= h²·Σ|dy|·|γ|·rstd³, plus the rounding of the two
      // evaluations of L (D-term sums of magnitude <= Σ|dy|·(|γ|·√D + |β|)) over 2h.
      const double step = 1e-5;
      double dy_abs = 0.0, rstd_max = 0.0, affine_max = 1.0;
      for (double e : dy.values()) dy_abs += std::abs(e);
      for (double e : cache.rstd.values()) rstd_max = std::max(rstd_max, e);
      for (const ParameterRef<double>& p : norm.parameters()) {
        for (int64_t k = 0; k < p.value.numel(); ++k) affine_max = std::max(affine_max, std::abs(p.value.data[k]));
      }
      const double d = static_cast<double>(dim);
      const double tolerance =
          dy_abs * affine_max * (d * std::sqrt(d) * kEps64 / step + step * step * rstd_max * rstd_max * rstd_max);
      EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x, step), tolerance));
      for (const ParameterRef<double>& p : norm.parameters()) {
        EXPECT_TRUE(all_close("d" + p.name, to_tensor<double, double>(p.grad), numeric_gradient(loss, p.value, step),
                              tolerance));
      }
    }
  }
}

// A row of equal values has σ = 0: x̂ = 0, y = β, and its gradient is finite (rstd = 1/√eps); with
// D = 1 every row is such a row, and ∂L/∂x = 0 (x̂ does not depend on x).
TEST(LayerNorm, ConstantRowsStayFinite) {
  Rng rng(5);
  LayerNorm<double> norm({.dim = 1});
  randomise_affine(norm, rng);
  const Tensor<double> x = random_tensor<double>(Shape{6, 1}, rng);
  LayerNormCache<double> cache;
  const Tensor<double> y = norm.forward(x.cview(), cache);
  const double beta = norm.parameters()[1].value.data[0];
  EXPECT_TRUE(all_close("y", y, Tensor<double>(Shape{6, 1}, beta), 0.0));
  Tensor<double> dx(x.shape());
  norm.backward(cache, random_tensor<double>(Shape{6, 1}, rng).cview(), dx.view());
  EXPECT_TRUE(all_close("dx", dx, Tensor<double>(x.shape()), 0.0));

  LayerNorm<float> wide({.dim = 9});
  const Tensor<float> constant(Shape{2, 9}, 4.25f);
  LayerNormCache<float> wide_cache;
  const Tensor<float> y_constant = wide.forward(constant.cview(), wide_cache);
  EXPECT_TRUE(all_close("y", y_constant, Tensor<float>(Shape{2, 9}), 0.0));
  Tensor<float> dx_constant(constant.shape());
  wide.backward(wide_cache, random_tensor<float>(Shape{2, 9}, rng).cview(), dx_constant.view());
  for (float e : dx_constant.values()) EXPECT_TRUE(std::isfinite(e));
}

TEST(LayerNorm, BackwardAddsIntoGradients) {
  Rng rng(6);
  LayerNorm<double> norm({.dim = 5});
  randomise_affine(norm, rng);
  const Tensor<double> x = random_tensor<double>(Shape{3, 5}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{3, 5}, rng);
  LayerNormCache<double> cache;
  norm.forward(x.cview(), cache);
  Tensor<double> dx(x.shape());
  norm.backward(cache, dy.cview(), dx.view());
  const Tensor<double> dgamma = to_tensor<double, double>(norm.parameters()[0].grad);
  Tensor<double> dx2(x.shape(), 1.0);
  norm.backward(cache, dy.cview(), dx2.view());
  for (double& e : dx.values()) e += 1.0;
  EXPECT_TRUE(all_close("dx", dx2, dx, 0.0));
  Tensor<double> twice = dgamma;
  for (double& e : twice.values()) e *= 2.0;
  EXPECT_TRUE(all_close("dweight", to_tensor<double, double>(norm.parameters()[0].grad), twice, 0.0));
  norm.zero_grad();
  EXPECT_TRUE(
      all_close("dweight", to_tensor<double, double>(norm.parameters()[0].grad), Tensor<double>(Shape{5}), 0.0));
}

TEST(LayerNorm, ThreadCountDoesNotChangeResults) {
  const int original_workers = max_workers();
  std::vector<std::vector<float>> reference;
  for (int threads : {1, 2, 3}) {
    set_max_workers(threads);
    Rng rng(7);
    LayerNorm<float> norm({.dim = 64});
    randomise_affine(norm, rng);
    const Tensor<float> x = random_tensor<float>(Shape{4, 300, 64}, rng);
    const Tensor<float> dy = random_tensor<float>(x.shape(), rng);
    LayerNormCache<float> cache;
    const Tensor<float> y = norm.forward(x.cview(), cache);
    Tensor<float> dx(x.shape());
    norm.backward(cache, dy.cview(), dx.view());
    std::vector<std::vector<float>> results{y.values(), dx.values()};
    for (const ParameterRef<float>& p : norm.parameters()) results.push_back(to_tensor<float, float>(p.grad).values());
    if (reference.empty()) {
      reference = results;
    } else {
      for (size_t i = 0; i < results.size(); ++i) EXPECT_EQ(results[i], reference[i]) << "result " << i;
    }
  }
  set_max_workers(original_workers);
}

TEST(LayerNorm, StridedViews) {
  Rng rng(8);
  LayerNorm<double> norm({.dim = 4});
  randomise_affine(norm, rng);
  // x [3, 4] read from a transposed [4, 3] storage.
  const Tensor<double> storage = random_tensor<double>(Shape{4, 3}, rng);
  const TensorView<const double> x{storage.data(), Shape{3, 4}, {1, 3, 0, 0}};
  const Tensor<double> x_contiguous = to_tensor<double, double>(x);
  LayerNormCache<double> cache, contiguous_cache;
  EXPECT_TRUE(all_close("y", norm.forward(x, cache), norm.forward(x_contiguous.cview(), contiguous_cache), 0.0));
  const Tensor<double> dy = random_tensor<double>(Shape{3, 4}, rng);
  Tensor<double> dx_storage(Shape{4, 3});
  norm.backward(cache, dy.cview(), TensorView<double>{dx_storage.data(), Shape{3, 4}, {1, 3, 0, 0}});
  Tensor<double> dx(Shape{3, 4});
  norm.backward(contiguous_cache, dy.cview(), dx.view());
  EXPECT_TRUE(
      all_close("dx", to_tensor<double, double>(TensorView<const double>{dx_storage.data(), Shape{3, 4}, {1, 3, 0, 0}}),
                dx, 0.0));
}

TEST(LayerNorm, BadArgumentsNameTheArgument) {
  EXPECT_TRUE(throws_naming<ValueError>([] { LayerNorm<double>({.dim = 0}); }, {"dim", "0"}));
  EXPECT_TRUE(throws_naming<ValueError>([] { LayerNorm<double>({.dim = 3, .eps = 0.0}); }, {"eps", "0"}));
  LayerNorm<double> norm({.dim = 4});
  LayerNormCache<double> cache;
  const Tensor<double> x_bad(Shape{2, 5});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { norm.forward(x_bad.cview(), cache); }, {"x:", "[..., 4]", "[2, 5]"}));
  const Tensor<double> x(Shape{2, 4});
  norm.forward(x.cview(), cache);
  const Tensor<double> dy_bad(Shape{3, 4});
  Tensor<double> dx(Shape{2, 4});
  EXPECT_TRUE(
      throws_naming<ShapeError>([&] { norm.backward(cache, dy_bad.cview(), dx.view()); }, {"dy:", "[2, 4]", "[3, 4]"}));
}

}  // namespace
}  // namespace qkv
