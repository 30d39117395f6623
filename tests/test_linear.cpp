#include "qkv/linear.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::throws_naming;
using testing::all_close;
using testing::cast;
using testing::numeric_gradient;
using testing::random_tensor;
using testing::tolerance_from_naive;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();
constexpr double kStep = 1e-6;

int64_t leading_rows(const Shape& shape) {
  int64_t rows = 1;
  for (int axis = 0; axis + 1 < shape.rank(); ++axis) rows *= shape[axis];
  return rows;
}

Shape with_last(Shape shape, int64_t last) {
  shape[shape.rank() - 1] = last;
  return shape;
}

// y = x Wᵀ + b by the definition with every product and sum in Acc: the float64 reference when Acc
// is double, the naive float32 computation that sets the tolerance when Acc is float.
template <class Acc>
Tensor<Acc> naive_linear(const Tensor<double>& x, const Tensor<double>& w, const std::optional<Tensor<double>>& b) {
  const int64_t out = w.shape()[0];
  const int64_t in = w.shape()[1];
  Tensor<Acc> y(with_last(x.shape(), out));
  for (int64_t r = 0; r < leading_rows(x.shape()); ++r) {
    for (int64_t o = 0; o < out; ++o) {
      Acc acc = b ? static_cast<Acc>((*b)[o]) : Acc{0};
      for (int64_t i = 0; i < in; ++i) acc += static_cast<Acc>(x[r * in + i]) * static_cast<Acc>(w[o * in + i]);
      y[r * out + o] = acc;
    }
  }
  return y;
}

// max over outputs of |b_o| + Σ_i |x_ri W_oi|: the magnitude that bounds a row's rounding error.
double max_terms(const Tensor<double>& x, const Tensor<double>& w, const std::optional<Tensor<double>>& b) {
  Tensor<double> abs_x = x, abs_w = w;
  for (double& e : abs_x.values()) e = std::abs(e);
  for (double& e : abs_w.values()) e = std::abs(e);
  std::optional<Tensor<double>> abs_b = b;
  if (abs_b) {
    for (double& e : abs_b->values()) e = std::abs(e);
  }
  const Tensor<double> terms = naive_linear<double>(abs_x, abs_w, abs_b);
  double result = 0.0;
  for (double e : terms.values()) result = std::max(result, e);
  return result;
}

template <class T>
LinearParams<T> params_of(const Tensor<T>& x, const Tensor<T>& w, const std::optional<Tensor<T>>& b) {
  return {.x = x.view(), .w = w.view(), .b = b ? std::optional(b->view()) : std::nullopt};
}

template <class T>
Tensor<T> run_linear(const Tensor<T>& x, const Tensor<T>& w, const std::optional<Tensor<T>>& b) {
  Tensor<T> y(with_last(x.shape(), w.shape()[0]));
  linear_forward(params_of(x, w, b), y.view());
  return y;
}

struct Case {
  Shape x;
  int64_t out;
};

// Shapes of every rank the op takes, with In = 113 (no multiple of any vector width), Out = 1 and
// sizes on both sides of the parallel threshold.
const std::vector<Case> kCases = {
    {.x = {1, 1}, .out = 1},       {.x = {7, 113}, .out = 37}, {.x = {3, 5, 113}, .out = 37},
    {.x = {2, 3, 4, 9}, .out = 1}, {.x = {64, 33}, .out = 65},
};

TEST(Linear, FloatMatchesFloat64Reference) {
  Rng rng(1);
  for (const Case& c : kCases) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "x " << c.x.str() << ", out " << c.out << ", bias " << with_bias);
      const int64_t in = c.x.from_back(1);
      const Tensor<float> x = random_tensor<float>(c.x, rng);
      const Tensor<float> w = random_tensor<float>(Shape{c.out, in}, rng, 1.0 / std::sqrt(static_cast<double>(in)));
      const std::optional<Tensor<float>> b =
          with_bias ? std::optional(random_tensor<float>(Shape{c.out}, rng)) : std::nullopt;
      const std::optional<Tensor<double>> b64 = b ? std::optional(cast<double>(*b)) : std::nullopt;

      const Tensor<double> exact = naive_linear<double>(cast<double>(x), cast<double>(w), b64);
      const Tensor<float> naive = naive_linear<float>(cast<double>(x), cast<double>(w), b64);
      EXPECT_TRUE(all_close("y", run_linear(x, w, b), exact, tolerance_from_naive(naive, exact)));
    }
  }
}

TEST(Linear, DoubleMatchesFloat64Reference) {
  Rng rng(2);
  for (const Case& c : kCases) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "x " << c.x.str() << ", out " << c.out << ", bias " << with_bias);
      const int64_t in = c.x.from_back(1);
      const Tensor<double> x = random_tensor<double>(c.x, rng);
      const Tensor<double> w = random_tensor<double>(Shape{c.out, in}, rng);
      const std::optional<Tensor<double>> b =
          with_bias ? std::optional(random_tensor<double>(Shape{c.out}, rng)) : std::nullopt;
      // Summation of In + 1 terms errs by at most (In + 1)·ε·Σ|terms| (Higham's γ_n), on both sides.
      const double tolerance = 2.0 * static_cast<double>(in + 1) * kEps64 * max_terms(x, w, b);
      EXPECT_TRUE(all_close("y", run_linear(x, w, b), naive_linear<double>(x, w, b), tolerance));
    }
  }
}

TEST(Linear, StridedViewsGiveTheContiguousResult) {
  Rng rng(3);
  const int64_t rows = 6, in = 113, out = 5;
  // x and dx stored transposed: element (r, i) lives at i·rows + r.
  const Tensor<double> x_storage = random_tensor<double>(Shape{in, rows}, rng);
  const TensorView<const double> x_view{x_storage.data(), Shape{rows, in}, {1, rows, 0, 0}};
  const Tensor<double> x = to_tensor<double, double>(x_view);
  const Tensor<double> w = random_tensor<double>(Shape{out, in}, rng);
  const Tensor<double> b = random_tensor<double>(Shape{out}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{rows, out}, rng);

  Tensor<double> y(Shape{rows, out});
  linear_forward<double>({.x = x_view, .w = w.view(), .b = b.view()}, y.view());
  EXPECT_TRUE(all_close("y", y, run_linear<double>(x, w, b), 0.0));

  Tensor<double> dx_storage(Shape{in, rows});
  const TensorView<double> dx_view{dx_storage.data(), Shape{rows, in}, {1, rows, 0, 0}};
  linear_backward<double>({.x = x_view, .w = w.view(), .b = b.view()}, dy.view(),
                          {.dx = dx_view, .dw = std::nullopt, .db = std::nullopt});
  Tensor<double> dx(Shape{rows, in});
  linear_backward<double>(params_of<double>(x, w, b), dy.view(),
                          {.dx = dx.view(), .dw = std::nullopt, .db = std::nullopt});
  EXPECT_TRUE(all_close("dx", to_tensor<double, double>(TensorView<const double>(dx_view)), dx, 0.0));
}

TEST(Linear, GradientsMatchFiniteDifferences) {
  Rng rng(4);
  for (const Case& c :
       std::vector<Case>{{.x = {3, 4, 5}, .out = 6}, {.x = {1, 1}, .out = 1}, {.x = {2, 9}, .out = 1}}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "x " << c.x.str() << ", out " << c.out << ", bias " << with_bias);
      const int64_t in = c.x.from_back(1);
      Tensor<double> x = random_tensor<double>(c.x, rng);
      Tensor<double> w = random_tensor<double>(Shape{c.out, in}, rng);
      std::optional<Tensor<double>> b =
          with_bias ? std::optional(random_tensor<double>(Shape{c.out}, rng)) : std::nullopt;
      const Tensor<double> dy = random_tensor<double>(with_last(c.x, c.out), rng);
      const auto loss = [&] { return testing::dot(dy, run_linear(x, w, b)); };

      Tensor<double> dx(x.shape()), dw(w.shape()), db(Shape{c.out});
      linear_backward(params_of(x, w, b), dy.view(), {.dx = dx.view(), .dw = dw.view(), .db = db.view()});

      // Central differences err by h²/6·|L'''| (0: L is linear in each operand) plus the rounding of
      // the two evaluations of L over 2h; each evaluation sums rows·Out + In + 1 terms, so it errs by
      // at most that many ε times Σ|dy|·max|terms|.
      double dy_abs = 0.0;
      for (double e : dy.values()) dy_abs += std::abs(e);
      const double depth = static_cast<double>(leading_rows(c.x) * c.out + in + 1);
      const double tolerance = depth * kEps64 * dy_abs * max_terms(x, w, b) / kStep;

      EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x, kStep), tolerance));
      EXPECT_TRUE(all_close("dw", dw, numeric_gradient(loss, w, kStep), tolerance));
      if (b) {
        EXPECT_TRUE(all_close("db", db, numeric_gradient(loss, *b, kStep), tolerance));
      }
    }
  }
}

TEST(Linear, BackwardAddsIntoGradients) {
  Rng rng(5);
  const Tensor<double> x = random_tensor<double>(Shape{4, 3}, rng);
  const Tensor<double> w = random_tensor<double>(Shape{2, 3}, rng);
  const Tensor<double> b = random_tensor<double>(Shape{2}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{4, 2}, rng);
  Tensor<double> dx(x.shape()), dw(w.shape()), db(b.shape());
  linear_backward(params_of<double>(x, w, b), dy.view(), {.dx = dx.view(), .dw = dw.view(), .db = db.view()});

  Tensor<double> dx2(x.shape(), 1.0), dw2(w.shape(), 1.0), db2(b.shape(), 1.0);
  linear_backward(params_of<double>(x, w, b), dy.view(), {.dx = dx2.view(), .dw = dw2.view(), .db = db2.view()});
  for (Tensor<double>* g : {&dx, &dw, &db}) {
    for (double& e : g->values()) e += 1.0;
  }
  EXPECT_TRUE(all_close("dx", dx2, dx, 0.0));
  EXPECT_TRUE(all_close("dw", dw2, dw, 0.0));
  EXPECT_TRUE(all_close("db", db2, db, 0.0));
}

TEST(Linear, GradientsNotAskedForAreLeftAlone) {
  Rng rng(6);
  const Tensor<double> x = random_tensor<double>(Shape{4, 3}, rng);
  const Tensor<double> w = random_tensor<double>(Shape{2, 3}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{4, 2}, rng);
  Tensor<double> dw(w.shape()), db(Shape{2}, 7.0);
  // No bias in the params: db is not touched even though it is given.
  linear_backward<double>(params_of<double>(x, w, std::nullopt), dy.view(),
                          {.dx = std::nullopt, .dw = dw.view(), .db = db.view()});
  EXPECT_TRUE(all_close("db", db, Tensor<double>(Shape{2}, 7.0), 0.0));
  Tensor<double> expected(w.shape());
  for (int64_t o = 0; o < 2; ++o)
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t r = 0; r < 4; ++r) expected[o * 3 + i] += dy[r * 2 + o] * x[r * 3 + i];
  // Summed in the order the op sums, from 0: equal to the last bit.
  EXPECT_TRUE(all_close("dw", dw, expected, 0.0));
}

TEST(Linear, EdgeSizes) {
  Rng rng(7);
  {  // No rows: an empty y, no gradient.
    const Tensor<double> x(Shape{0, 5});
    const Tensor<double> w = random_tensor<double>(Shape{3, 5}, rng);
    const Tensor<double> b = random_tensor<double>(Shape{3}, rng);
    EXPECT_EQ(run_linear<double>(x, w, b).shape(), (Shape{0, 3}));
    const Tensor<double> dy(Shape{0, 3});
    Tensor<double> dx(x.shape()), dw(w.shape()), db(b.shape());
    linear_backward(params_of<double>(x, w, b), dy.view(), {.dx = dx.view(), .dw = dw.view(), .db = db.view()});
    EXPECT_TRUE(all_close("dw", dw, Tensor<double>(w.shape()), 0.0));
    EXPECT_TRUE(all_close("db", db, Tensor<double>(b.shape()), 0.0));
  }
  {  // In = 0: y is the bias on every row, and db still collects dy.
    const Tensor<double> x(Shape{2, 0});
    const Tensor<double> w(Shape{3, 0});
    const Tensor<double> b(Shape{3}, {1.0, -2.0, 0.5});
    EXPECT_TRUE(all_close("y", run_linear<double>(x, w, b),
                          Tensor<double>(Shape{2, 3}, {1.0, -2.0, 0.5, 1.0, -2.0, 0.5}), 0.0));
    const Tensor<double> dy(Shape{2, 3}, {1.0, 2.0, 3.0, 4.0, 5.0, 6.0});
    Tensor<double> db(b.shape());
    linear_backward(params_of<double>(x, w, b), dy.view(), {.dx = std::nullopt, .dw = std::nullopt, .db = db.view()});
    EXPECT_TRUE(all_close("db", db, Tensor<double>(Shape{3}, {5.0, 7.0, 9.0}), 0.0));
  }
  {  // One row, one feature in and out: a scalar affine map.
    const Tensor<double> x(Shape{1, 1}, {3.0});
    const Tensor<double> w(Shape{1, 1}, {-0.5});
    const Tensor<double> b(Shape{1}, {0.25});
    EXPECT_TRUE(all_close("y", run_linear<double>(x, w, b), Tensor<double>(Shape{1, 1}, {-1.25}), 0.0));
  }
}

TEST(Linear, InitFollowsPyTorch) {
  const int64_t out = 40, in = 113;
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  EXPECT_EQ(linear_init_bound(in), bound);
  EXPECT_EQ(linear_init_bound(0), 0.0);

  Rng rng(8);
  Tensor<float> w(Shape{out, in}), b(Shape{out});
  linear_init(w.view(), std::optional(b.view()), rng);
  float w_max = 0.0f;
  for (float e : w.values()) {
    EXPECT_GE(e, -bound);
    EXPECT_LE(e, bound);
    w_max = std::max(w_max, std::abs(e));
  }
  for (float e : b.values()) {
    EXPECT_GE(e, -bound);
    EXPECT_LE(e, bound);
  }
  // 4520 uniform draws: the largest |w| falls short of the bound by more than 1% with probability 0.99^4520.
  EXPECT_GT(w_max, 0.99 * bound);

  // The stream is w row by row, then b: the same draws as from a fresh Rng of the same seed.
  Rng replay(8);
  Tensor<float> w_expected(w.shape()), b_expected(b.shape());
  replay.fill_uniform(w_expected.view(), -bound, bound);
  replay.fill_uniform(b_expected.view(), -bound, bound);
  EXPECT_TRUE(all_close("w", w, w_expected, 0.0));
  EXPECT_TRUE(all_close("b", b, b_expected, 0.0));

  Rng other(9);
  Tensor<float> w_other(w.shape());
  linear_init<float>(w_other.view(), std::nullopt, other);
  EXPECT_NE(w_other.values(), w.values());
}

TEST(Linear, BadShapesNameTheArgument) {
  const Tensor<double> x(Shape{4, 5});
  const Tensor<double> w(Shape{3, 5});
  const Tensor<double> b(Shape{3});
  Tensor<double> y(Shape{4, 3});
  const Tensor<double> vector(Shape{5});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { linear_forward<double>(params_of<double>(vector, w, b), y.view()); },
                                        {"x:", "[5]"}));
  const Tensor<double> w_bad(Shape{3, 6});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { linear_forward<double>(params_of<double>(x, w_bad, b), y.view()); },
                                        {"w:", "[3, 6]", "5"}));
  const Tensor<double> b_bad(Shape{4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { linear_forward<double>(params_of<double>(x, w, b_bad), y.view()); },
                                        {"b:", "[3]", "[4]"}));
  Tensor<double> y_bad(Shape{4, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { linear_forward<double>(params_of<double>(x, w, b), y_bad.view()); },
                                        {"y:", "[4, 3]", "[4, 4]"}));
  const Tensor<double> dy_bad(Shape{3, 3});
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        linear_backward<double>(params_of<double>(x, w, b), dy_bad.view(),
                                {.dx = std::nullopt, .dw = std::nullopt, .db = std::nullopt});
      },
      {"dy:", "[4, 3]", "[3, 3]"}));
  Tensor<double> dx_bad(Shape{4, 4});
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        linear_backward<double>(params_of<double>(x, w, b), y.view(),
                                {.dx = dx_bad.view(), .dw = std::nullopt, .db = std::nullopt});
      },
      {"dx:", "[4, 5]", "[4, 4]"}));
  Rng rng(10);
  Tensor<double> w_vector(Shape{5});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { linear_init<double>(w_vector.view(), std::nullopt, rng); }, {"w:"}));
}

}  // namespace
}  // namespace qkv
