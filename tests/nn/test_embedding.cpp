#include "qkv/nn/embedding.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "qkv/core/error.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::random_tensor;
using testing::throws_naming;

template <class T>
Tensor<T> weight_of(const Embedding<T>& embedding) {
  return to_tensor<T, T>(embedding.parameters()[0].value);
}

TEST(Embedding, ForwardCopiesTheRows) {
  Rng rng(1);
  for (const Shape& ids_shape : std::vector<Shape>{{5}, {3, 7}, {2, 3, 4}, {1}}) {
    SCOPED_TRACE(ids_shape.str());
    Embedding<float> embedding({.num_embeddings = 113, .dim = 7}, rng);
    Tensor<int64_t> ids(ids_shape);
    for (int64_t n = 0; n < ids.numel(); ++n) ids[n] = static_cast<int64_t>(rng.next_u64() % 113);
    EmbeddingCache<float> cache;
    const Tensor<float> y = embedding.forward(ids.cview(), cache);
    std::vector<int64_t> dims(ids_shape.dims().begin(), ids_shape.dims().end());
    dims.push_back(7);
    ASSERT_EQ(y.shape(), Shape(std::span<const int64_t>(dims)));
    const Tensor<float> weight = weight_of(embedding);
    for (int64_t n = 0; n < ids.numel(); ++n)
      for (int64_t d = 0; d < 7; ++d) EXPECT_EQ(y[n * 7 + d], weight[ids[n] * 7 + d]);
  }
}

// L = <dy, y> is linear in the weight: ∂L/∂W[v] = Σ_{n: id_n = v} dy_n, and rows never read get 0.
// The sum over repeated ids is taken in id order, as the reference below takes it: equal to the bit.
TEST(Embedding, BackwardScattersIntoTheRowsRead) {
  Rng rng(2);
  Embedding<double> embedding({.num_embeddings = 6, .dim = 3}, rng);
  const Tensor<int64_t> ids(Shape{2, 4}, {1, 4, 1, 1, 0, 4, 5, 1});
  EmbeddingCache<double> cache;
  embedding.forward(ids.cview(), cache);
  const Tensor<double> dy = random_tensor<double>(Shape{2, 4, 3}, rng);
  embedding.backward(cache, dy.cview());
  Tensor<double> expected(Shape{6, 3});
  for (int64_t n = 0; n < 8; ++n)
    for (int64_t d = 0; d < 3; ++d) expected[ids[n] * 3 + d] += dy[n * 3 + d];
  const ParameterRef<double> weight = embedding.parameters()[0];
  EXPECT_EQ(weight.name, "weight");
  EXPECT_TRUE(all_close("dweight", to_tensor<double, double>(weight.grad), expected, 0.0));

  // Accumulates: a second backward doubles the gradient; zero_grad clears it.
  embedding.backward(cache, dy.cview());
  for (double& e : expected.values()) e *= 2.0;
  EXPECT_TRUE(all_close("dweight", to_tensor<double, double>(weight.grad), expected, 0.0));
  embedding.zero_grad();
  EXPECT_TRUE(all_close("dweight", to_tensor<double, double>(weight.grad), Tensor<double>(Shape{6, 3}), 0.0));
}

// Finite differences of L = <dy, y>, which is linear in W: exact up to the rounding of the two
// evaluations (one product each) over 2h.
TEST(Embedding, GradientMatchesFiniteDifferences) {
  Rng rng(3);
  Embedding<double> embedding({.num_embeddings = 5, .dim = 2}, rng);
  const Tensor<int64_t> ids(Shape{3, 2}, {0, 3, 3, 4, 1, 3});
  const Tensor<double> dy = random_tensor<double>(Shape{3, 2, 2}, rng);
  EmbeddingCache<double> cache;
  embedding.forward(ids.cview(), cache);
  embedding.backward(cache, dy.cview());
  const ParameterRef<double> weight = embedding.parameters()[0];
  Tensor<double> numeric(weight.value.shape);
  const double step = 1e-6;
  const auto loss = [&] {
    EmbeddingCache<double> c;
    return testing::dot(dy, embedding.forward(ids.cview(), c));
  };
  for (int64_t k = 0; k < weight.value.numel(); ++k) {
    const double saved = weight.value.data[k];
    weight.value.data[k] = saved + step;
    const double up = loss();
    weight.value.data[k] = saved - step;
    const double down = loss();
    weight.value.data[k] = saved;
    numeric[k] = (up - down) / (2.0 * step);
  }
  double dy_abs = 0.0, w_abs = 0.0;
  for (double e : dy.values()) dy_abs += std::abs(e);
  for (int64_t k = 0; k < weight.value.numel(); ++k) w_abs = std::max(w_abs, std::abs(weight.value.data[k]));
  const double tolerance =
      2.0 * static_cast<double>(dy.numel()) * std::numeric_limits<double>::epsilon() * dy_abs * (w_abs + step) / step;
  EXPECT_TRUE(all_close("dweight", to_tensor<double, double>(weight.grad), numeric, tolerance));
}

// The float32 gradient sums a row's repeats in float32: within the naive float32 error of that sum.
TEST(Embedding, FloatGradientMatchesFloat64) {
  Rng rng(4);
  Embedding<float> embedding({.num_embeddings = 3, .dim = 113}, rng);
  Tensor<int64_t> ids(Shape{200});
  for (int64_t n = 0; n < ids.numel(); ++n) ids[n] = n % 3;
  const Tensor<float> dy = random_tensor<float>(Shape{200, 113}, rng);
  EmbeddingCache<float> cache;
  embedding.forward(ids.cview(), cache);
  embedding.backward(cache, dy.cview());
  Tensor<double> exact(Shape{3, 113});
  Tensor<float> naive(Shape{3, 113});
  for (int64_t n = 0; n < 200; ++n)
    for (int64_t d = 0; d < 113; ++d) {
      exact[ids[n] * 113 + d] += static_cast<double>(dy[n * 113 + d]);
      naive[ids[n] * 113 + d] += dy[n * 113 + d];
    }
  EXPECT_TRUE(all_close("dweight", to_tensor<float, float>(embedding.parameters()[0].grad), exact,
                        testing::tolerance_from_naive(naive, exact)));
}

TEST(Embedding, StridedInputs) {
  Rng rng(5);
  Embedding<double> embedding({.num_embeddings = 4, .dim = 2}, rng);
  // ids stored transposed: the view [3, 2] reads column-major storage.
  const Tensor<int64_t> storage(Shape{2, 3}, {0, 1, 2, 3, 0, 1});
  const TensorView<const int64_t> ids{storage.data(), Shape{3, 2}, {1, 3, 0, 0}};
  EmbeddingCache<double> cache;
  const Tensor<double> y = embedding.forward(ids, cache);
  EmbeddingCache<double> contiguous_cache;
  const Tensor<int64_t> contiguous = to_tensor<int64_t, int64_t>(ids);
  EXPECT_TRUE(all_close("y", y, embedding.forward(contiguous.cview(), contiguous_cache), 0.0));
  // dy strided too: [3, 2, 2] read from a [2, 3, 2] storage.
  const Tensor<double> dy_storage = random_tensor<double>(Shape{2, 3, 2}, rng);
  const TensorView<const double> dy{dy_storage.data(), Shape{3, 2, 2}, {2, 6, 1, 0}};
  embedding.backward(cache, dy);
  const Tensor<double> strided_grad = to_tensor<double, double>(embedding.parameters()[0].grad);
  embedding.zero_grad();
  const Tensor<double> dy_contiguous = to_tensor<double, double>(dy);
  embedding.backward(contiguous_cache, dy_contiguous.cview());
  EXPECT_TRUE(all_close("dweight", strided_grad, to_tensor<double, double>(embedding.parameters()[0].grad), 0.0));
}

TEST(Embedding, EdgeSizes) {
  Rng rng(6);
  {  // No ids: an empty output, no gradient.
    Embedding<double> embedding({.num_embeddings = 3, .dim = 4}, rng);
    const Tensor<int64_t> ids(Shape{0});
    EmbeddingCache<double> cache;
    EXPECT_EQ(embedding.forward(ids.cview(), cache).shape(), (Shape{0, 4}));
    const Tensor<double> dy(Shape{0, 4});
    embedding.backward(cache, dy.cview());
    EXPECT_TRUE(all_close("dweight", to_tensor<double, double>(embedding.parameters()[0].grad),
                          Tensor<double>(Shape{3, 4}), 0.0));
  }
  {  // One entry of one feature.
    Embedding<double> embedding({.num_embeddings = 1, .dim = 1}, rng);
    const Tensor<int64_t> ids(Shape{3}, {0, 0, 0});
    EmbeddingCache<double> cache;
    const Tensor<double> y = embedding.forward(ids.cview(), cache);
    const double w = embedding.parameters()[0].value.data[0];
    EXPECT_TRUE(all_close("y", y, Tensor<double>(Shape{3, 1}, w), 0.0));
    embedding.backward(cache, Tensor<double>(Shape{3, 1}, {1.0, 2.0, 4.0}).cview());
    EXPECT_EQ(embedding.parameters()[0].grad.data[0], 7.0);
  }
}

// torch.nn.Embedding draws its weight from N(0, 1): the same stream as a fresh Rng's fill_normal.
TEST(Embedding, InitIsStandardNormal) {
  Rng rng(7);
  Embedding<float> embedding({.num_embeddings = 50, .dim = 40}, rng);
  Rng replay(7);
  Tensor<float> expected(Shape{50, 40});
  replay.fill_normal(expected.view());
  EXPECT_TRUE(all_close("weight", weight_of(embedding), expected, 0.0));
  double sum = 0.0, squares = 0.0;
  for (float e : expected.values()) {
    sum += e;
    squares += static_cast<double>(e) * e;
  }
  // 2000 draws: the sample mean is within 4 standard errors (4/√2000) of 0, the variance within
  // 4·√(2/2000) of 1.
  EXPECT_LT(std::abs(sum / 2000.0), 4.0 / std::sqrt(2000.0));
  EXPECT_LT(std::abs(squares / 2000.0 - 1.0), 4.0 * std::sqrt(2.0 / 2000.0));
}

TEST(Embedding, BadArgumentsNameTheArgument) {
  Rng rng(8);
  EXPECT_TRUE(throws_naming<ValueError>([&] { Embedding<double>({.num_embeddings = 0, .dim = 3}, rng); },
                                        {"num_embeddings", "0"}));
  EXPECT_TRUE(
      throws_naming<ValueError>([&] { Embedding<double>({.num_embeddings = 3, .dim = 0}, rng); }, {"dim", "0"}));
  Embedding<double> embedding({.num_embeddings = 10, .dim = 3}, rng);
  EmbeddingCache<double> cache;
  const Tensor<int64_t> out_of_range(Shape{2, 3}, {1, 2, 3, 4, 10, 5});
  EXPECT_TRUE(throws_naming<ValueError>([&] { embedding.forward(out_of_range.cview(), cache); },
                                        {"ids:", "[0, 10)", "10", "[1, 1]"}));
  const Tensor<int64_t> negative(Shape{1}, {-1});
  EXPECT_TRUE(throws_naming<ValueError>([&] { embedding.forward(negative.cview(), cache); }, {"ids:", "-1", "[0]"}));
  const Tensor<int64_t> rank4(Shape{1, 1, 1, 1});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { embedding.forward(rank4.cview(), cache); }, {"ids:", "[1, 1, 1, 1]"}));
  const Tensor<int64_t> ids(Shape{2}, {1, 2});
  embedding.forward(ids.cview(), cache);
  const Tensor<double> dy_bad(Shape{2, 4});
  EXPECT_TRUE(
      throws_naming<ShapeError>([&] { embedding.backward(cache, dy_bad.cview()); }, {"dy:", "[2, 3]", "[2, 4]"}));
}

}  // namespace
}  // namespace qkv
