#include "qkv/ops/linear.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/simd_target.hpp"
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

// ---- The blocked kernels against the float64 reference ------------------------------------------

constexpr double kEps32 = std::numeric_limits<float>::epsilon();

// Every operand of a forward and a backward, drawn in float so that the float kernels and the
// float64 reference see the same numbers; the gradients start from random values (the backward adds).
struct Problem {
  Tensor<float> x, w, b, dy, dx, dw, db;
};

Problem make_problem(const Shape& x_shape, int64_t out, Rng& rng) {
  const int64_t in = x_shape.from_back(1);
  return {
      .x = random_tensor<float>(x_shape, rng),
      .w = random_tensor<float>(Shape{out, in}, rng, 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(in, 1)))),
      .b = random_tensor<float>(Shape{out}, rng),
      .dy = random_tensor<float>(with_last(x_shape, out), rng),
      .dx = random_tensor<float>(x_shape, rng),
      .dw = random_tensor<float>(Shape{out, in}, rng),
      .db = random_tensor<float>(Shape{out}, rng)};
}

// y and the gradients after one backward (which adds to the problem's starting values).
template <class T>
struct Results {
  Tensor<T> y, dx, dw, db;
};

enum class Impl { automatic, reference, blocked };

// y, dx, dw and db of two runs are the same to the last bit.
template <class T>
void expect_bit_identical(const Results<T>& got, const Results<T>& want) {
  EXPECT_TRUE(all_close("y", got.y, want.y, 0.0));
  EXPECT_TRUE(all_close("dx", got.dx, want.dx, 0.0));
  EXPECT_TRUE(all_close("dw", got.dw, want.dw, 0.0));
  EXPECT_TRUE(all_close("db", got.db, want.db, 0.0));
}

template <class T>
Results<T> run_all(const Problem& problem, Impl impl, bool with_bias) {
  const Tensor<T> x = cast<T>(problem.x), w = cast<T>(problem.w), b = cast<T>(problem.b), dy = cast<T>(problem.dy);
  Results<T> r{
      .y = Tensor<T>(dy.shape()), .dx = cast<T>(problem.dx), .dw = cast<T>(problem.dw), .db = cast<T>(problem.db)};
  const LinearParams<T> params{.x = x.view(), .w = w.view(), .b = with_bias ? std::optional(b.view()) : std::nullopt};
  const LinearGradients<T> grads{.dx = r.dx.view(), .dw = r.dw.view(), .db = r.db.view()};
  switch (impl) {
    case Impl::automatic:
      linear_forward(params, r.y.view());
      linear_backward(params, dy.view(), grads);
      break;
    case Impl::reference:
      linear_forward_reference(params, r.y.view());
      linear_backward_reference(params, dy.view(), grads);
      break;
    case Impl::blocked:
      linear_forward_blocked(params, r.y.view());
      linear_backward_blocked(params, dy.view(), grads);
      break;
  }
  return r;
}

// The four results by their definitions, every product and sum in Acc in index order, each sum
// starting from the bias or the gradient's starting value: the naive float32 computation when Acc
// is float; with |operands| and Acc = double, the Σ|terms| that bound the rounding error.
template <class Acc>
Results<Acc> naive_all(const Problem& problem, bool with_bias, bool absolute = false) {
  const auto value = [&](const Tensor<float>& t, int64_t i) {
    return static_cast<Acc>(absolute ? std::abs(t[i]) : t[i]);
  };
  const int64_t out = problem.w.shape()[0], in = problem.w.shape()[1], rows = leading_rows(problem.x.shape());
  Results<Acc> r{.y = Tensor<Acc>(problem.dy.shape()),
                 .dx = Tensor<Acc>(problem.dx.shape()),
                 .dw = Tensor<Acc>(problem.dw.shape()),
                 .db = Tensor<Acc>(problem.db.shape())};
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t o = 0; o < out; ++o) {
      Acc acc = with_bias ? value(problem.b, o) : Acc{0};
      for (int64_t i = 0; i < in; ++i) acc += value(problem.x, n * in + i) * value(problem.w, o * in + i);
      r.y[n * out + o] = acc;
    }
    for (int64_t i = 0; i < in; ++i) {
      Acc acc = value(problem.dx, n * in + i);
      for (int64_t o = 0; o < out; ++o) acc += value(problem.dy, n * out + o) * value(problem.w, o * in + i);
      r.dx[n * in + i] = acc;
    }
  }
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      Acc acc = value(problem.dw, o * in + i);
      for (int64_t n = 0; n < rows; ++n) acc += value(problem.dy, n * out + o) * value(problem.x, n * in + i);
      r.dw[o * in + i] = acc;
    }
    Acc acc = value(problem.db, o);
    if (with_bias) {
      for (int64_t n = 0; n < rows; ++n) acc += value(problem.dy, n * out + o);
    }
    r.db[o] = acc;
  }
  return r;
}

double max_of(const Tensor<double>& t) {
  double result = 0.0;
  for (double e : t.values()) result = std::max(result, e);
  return result;
}

// Shapes for the blocked kernels: every rank, In and Out on both sides of every vector width and
// panel (1, 16, 48, 113, 257), depths that cross the 128-step summation chunk (In = 300; rows =
// 2100 for dW, which also crosses the 2048-step packing), single rows and columns.
const std::vector<Case> kBlockedCases = {
    {.x = {1, 1}, .out = 1},       {.x = {7, 113}, .out = 37}, {.x = {3, 5, 113}, .out = 37},
    {.x = {2, 3, 4, 9}, .out = 1}, {.x = {64, 33}, .out = 65}, {.x = {13, 300}, .out = 50},
    {.x = {129, 1}, .out = 49},    {.x = {1, 257}, .out = 97}, {.x = {9, 16}, .out = 48},
    {.x = {2100, 19}, .out = 5},
};

std::string describe(const Case& c, bool with_bias) {
  return fmt::format("x {}, out {}, bias {}, target {}", c.x.str(), c.out, with_bias, simd_target());
}

// The project's rule: within 2× the naive float32 error. For a tensor of a few elements (db with
// Out = 1) that compares two single rounding errors, which the draw decides; the summation bound
// of the next test holds for any draw.
TEST(LinearBlocked, FloatMatchesFloat64ReferenceOnEveryTarget) {
  const testing::SimdTargetScope guard;
  for (const std::string& target : simd_targets()) {
    use_simd_target(target);
    Rng rng(11);
    for (const Case& c : kBlockedCases) {
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE(describe(c, with_bias));
        const Problem problem = make_problem(c.x, c.out, rng);
        const Results<float> got = run_all<float>(problem, Impl::blocked, with_bias);
        const Results<double> exact = run_all<double>(problem, Impl::reference, with_bias);
        const Results<float> naive = naive_all<float>(problem, with_bias);
        EXPECT_TRUE(all_close("y", got.y, exact.y, tolerance_from_naive(naive.y, exact.y)));
        EXPECT_TRUE(all_close("dx", got.dx, exact.dx, tolerance_from_naive(naive.dx, exact.dx)));
        EXPECT_TRUE(all_close("dw", got.dw, exact.dw, tolerance_from_naive(naive.dw, exact.dw)));
        EXPECT_TRUE(all_close("db", got.db, exact.db, tolerance_from_naive(naive.db, exact.db)));
      }
    }
  }
}

// The blocked float error also stays within the a-priori bound of a sum of `depth` terms, each
// product rounded once or twice: (depth + 2)·ε32·Σ|terms| (Higham's γ_n, first order), plus the
// final rounding to float of the float64 reference it is compared with.
TEST(LinearBlocked, FloatErrorWithinTheSummationBound) {
  Rng rng(12);
  for (const Case& c : kBlockedCases) {
    SCOPED_TRACE(describe(c, true));
    const Problem problem = make_problem(c.x, c.out, rng);
    const Results<float> got = run_all<float>(problem, Impl::blocked, true);
    const Results<double> exact = run_all<double>(problem, Impl::reference, true);
    const Results<double> terms = naive_all<double>(problem, true, /*absolute=*/true);
    const auto bound = [&](int64_t depth, const Tensor<double>& t) {
      return static_cast<double>(depth + 3) * kEps32 * max_of(t);
    };
    const int64_t rows = leading_rows(c.x), in = c.x.from_back(1);
    EXPECT_TRUE(all_close("y", got.y, exact.y, bound(in, terms.y)));
    EXPECT_TRUE(all_close("dx", got.dx, exact.dx, bound(c.out, terms.dx)));
    EXPECT_TRUE(all_close("dw", got.dw, exact.dw, bound(rows, terms.dw)));
    EXPECT_TRUE(all_close("db", got.db, exact.db, bound(rows, terms.db)));
  }
}

TEST(LinearBlocked, DoubleMatchesReferenceOnEveryTarget) {
  const testing::SimdTargetScope guard;
  for (const std::string& target : simd_targets()) {
    use_simd_target(target);
    Rng rng(13);
    for (const Case& c : kBlockedCases) {
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE(describe(c, with_bias));
        const Problem problem = make_problem(c.x, c.out, rng);
        const Results<double> got = run_all<double>(problem, Impl::blocked, with_bias);
        const Results<double> reference = run_all<double>(problem, Impl::reference, with_bias);
        const Results<double> terms = naive_all<double>(problem, with_bias, /*absolute=*/true);
        // Both sum depth + 1 terms in float64, each within (depth + 1)·ε·Σ|terms| of the exact value.
        const auto bound = [&](int64_t depth, const Tensor<double>& t) {
          return 2.0 * static_cast<double>(depth + 1) * kEps64 * max_of(t);
        };
        const int64_t rows = leading_rows(c.x), in = c.x.from_back(1);
        EXPECT_TRUE(all_close("y", got.y, reference.y, bound(in, terms.y)));
        EXPECT_TRUE(all_close("dx", got.dx, reference.dx, bound(c.out, terms.dx)));
        EXPECT_TRUE(all_close("dw", got.dw, reference.dw, bound(rows, terms.dw)));
        EXPECT_TRUE(all_close("db", got.db, reference.db, bound(rows, terms.db)));
      }
    }
  }
}

TEST(LinearBlocked, GradientsMatchFiniteDifferences) {
  Rng rng(14);
  for (const Case& c : std::vector<Case>{
           {.x = {3, 4, 5}, .out = 6}, {.x = {1, 1}, .out = 1}, {.x = {2, 9}, .out = 1}, {.x = {9, 17}, .out = 19}}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "x " << c.x.str() << ", out " << c.out << ", bias " << with_bias);
      const int64_t in = c.x.from_back(1);
      Tensor<double> x = random_tensor<double>(c.x, rng);
      Tensor<double> w = random_tensor<double>(Shape{c.out, in}, rng);
      std::optional<Tensor<double>> b =
          with_bias ? std::optional(random_tensor<double>(Shape{c.out}, rng)) : std::nullopt;
      const Tensor<double> dy = random_tensor<double>(with_last(c.x, c.out), rng);
      const auto loss = [&] {
        Tensor<double> y(with_last(x.shape(), c.out));
        linear_forward_blocked(params_of(x, w, b), y.view());
        return testing::dot(dy, y);
      };

      Tensor<double> dx(x.shape()), dw(w.shape()), db(Shape{c.out});
      linear_backward_blocked(params_of(x, w, b), dy.view(), {.dx = dx.view(), .dw = dw.view(), .db = db.view()});

      // As in GradientsMatchFiniteDifferences: L is linear in each operand, so only the rounding of
      // the two evaluations of L (rows·Out + In + 1 terms each) over 2h remains.
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

// Restores the thread count when a test that changes it ends.
struct WorkersGuard {
  int saved = max_workers();
  ~WorkersGuard() { set_max_workers(saved); }
};

TEST(LinearBlocked, BitIdenticalForAnyThreadCount) {
  const WorkersGuard guard;
  Rng rng(15);
  // Big enough (> 2^20 multiply-adds) to be split over threads; dW's depth crosses a packing.
  for (const Case& c : std::vector<Case>{{.x = {3, 100, 130}, .out = 70}, {.x = {2100, 40}, .out = 30}}) {
    SCOPED_TRACE(describe(c, true));
    const Problem problem = make_problem(c.x, c.out, rng);
    set_max_workers(1);
    const Results<float> one = run_all<float>(problem, Impl::blocked, true);
    const Results<double> one64 = run_all<double>(problem, Impl::blocked, true);
    for (int workers : {2, 3, 8}) {
      SCOPED_TRACE(::testing::Message() << workers << " workers");
      set_max_workers(workers);
      const Results<float> many = run_all<float>(problem, Impl::blocked, true);
      const Results<double> many64 = run_all<double>(problem, Impl::blocked, true);
      expect_bit_identical(many, one);
      EXPECT_TRUE(all_close("y (double)", many64.y, one64.y, 0.0));
      EXPECT_TRUE(all_close("dw (double)", many64.dw, one64.dw, 0.0));
    }
  }
}

// A row's result does not depend on the rows around it (which tile it falls in), nor an output's on
// its position among the outputs (a full vector or the lane buffer of a row's end): run alone, or
// with the outputs reversed, every element summed over the same depth in the same order is the
// same to the last bit (dx, whose depth is the outputs, is then summed in another order).
TEST(LinearBlocked, ElementsDoNotDependOnTheirPosition) {
  Rng rng(16);
  const int64_t rows = 37, in = 113, out = 50;
  const Problem problem = make_problem(Shape{rows, in}, out, rng);
  const Results<float> full = run_all<float>(problem, Impl::blocked, true);
  for (int64_t r : {int64_t{0}, int64_t{13}, rows - 1}) {
    Problem one = problem;
    one.x = Tensor<float>(Shape{1, in}, std::vector<float>(problem.x.data() + r * in, problem.x.data() + (r + 1) * in));
    one.dy = Tensor<float>(Shape{1, out},
                           std::vector<float>(problem.dy.data() + r * out, problem.dy.data() + (r + 1) * out));
    one.dx =
        Tensor<float>(Shape{1, in}, std::vector<float>(problem.dx.data() + r * in, problem.dx.data() + (r + 1) * in));
    const Results<float> alone = run_all<float>(one, Impl::blocked, true);
    const Tensor<float> y_row(Shape{1, out},
                              std::vector<float>(full.y.data() + r * out, full.y.data() + (r + 1) * out));
    const Tensor<float> dx_row(Shape{1, in},
                               std::vector<float>(full.dx.data() + r * in, full.dx.data() + (r + 1) * in));
    EXPECT_TRUE(all_close(fmt::format("y row {}", r), alone.y, y_row, 0.0));
    EXPECT_TRUE(all_close(fmt::format("dx row {}", r), alone.dx, dx_row, 0.0));
  }
  // Outputs reversed: W's rows, b, dy's columns and dW's, db's starting values.
  Problem reversed = problem;
  for (int64_t o = 0; o < out; ++o) {
    const int64_t from = out - 1 - o;
    std::copy_n(problem.w.data() + from * in, in, reversed.w.data() + o * in);
    std::copy_n(problem.dw.data() + from * in, in, reversed.dw.data() + o * in);
    reversed.b[o] = problem.b[from];
    reversed.db[o] = problem.db[from];
    for (int64_t r = 0; r < rows; ++r) reversed.dy[r * out + o] = problem.dy[r * out + from];
  }
  const Results<float> back = run_all<float>(reversed, Impl::blocked, true);
  Tensor<float> y_back(full.y.shape()), dw_back(full.dw.shape()), db_back(full.db.shape());
  for (int64_t o = 0; o < out; ++o) {
    const int64_t from = out - 1 - o;
    for (int64_t r = 0; r < rows; ++r) y_back[r * out + o] = back.y[r * out + from];
    std::copy_n(back.dw.data() + from * in, in, dw_back.data() + o * in);
    db_back[o] = back.db[from];
  }
  EXPECT_TRUE(all_close("y, outputs reversed", y_back, full.y, 0.0));
  EXPECT_TRUE(all_close("dw, outputs reversed", dw_back, full.dw, 0.0));
  EXPECT_TRUE(all_close("db, outputs reversed", db_back, full.db, 0.0));
}

// From 2^10 weights on, whatever the number of rows (even one), automatic is the blocked kernels;
// below, the reference, even for many rows.
// db is summed while dW packs dy, or on its own when dW is not asked for: in the same order.
TEST(LinearBlocked, BiasGradientIsTheSameWithOrWithoutTheWeightGradient) {
  Rng rng(23);
  const Problem problem = make_problem(Shape{2, 150, 40}, 35, rng);
  const LinearParams<float> params{.x = problem.x.view(), .w = problem.w.view(), .b = problem.b.view()};
  Tensor<float> dw = problem.dw, db_with = problem.db, db_alone = problem.db;
  linear_backward_blocked(params, problem.dy.view(), {.dx = std::nullopt, .dw = dw.view(), .db = db_with.view()});
  linear_backward_blocked(params, problem.dy.view(), {.dx = std::nullopt, .dw = std::nullopt, .db = db_alone.view()});
  EXPECT_TRUE(all_close("db", db_with, db_alone, 0.0));
}

TEST(LinearBlocked, AutomaticTakesBlockedForLayersOfAtLeast1024Weights) {
  Rng rng(17);
  for (bool with_bias : {false, true}) {
    for (const Shape& x_shape : {Shape{2, 20, 32}, Shape{1, 32}}) {  // 32·32 weights
      const Problem big = make_problem(x_shape, 32, rng);
      const Results<float> automatic = run_all<float>(big, Impl::automatic, with_bias);
      const Results<float> blocked = run_all<float>(big, Impl::blocked, with_bias);
      expect_bit_identical(automatic, blocked);
    }
    const Problem small = make_problem(Shape{300, 31}, 33, rng);  // 1023 weights: the reference
    const Results<double> small_automatic = run_all<double>(small, Impl::automatic, with_bias);
    const Results<double> small_reference = run_all<double>(small, Impl::reference, with_bias);
    expect_bit_identical(small_automatic, small_reference);
  }
}

TEST(LinearBlocked, AutomaticFallsBackToTheReferenceForStridedAndBroadcastViews) {
  Rng rng(18);
  const int64_t rows = 40, in = 113, out = 30;
  const Tensor<double> w = random_tensor<double>(Shape{out, in}, rng);
  const Tensor<double> b = random_tensor<double>(Shape{out}, rng);
  // x stored transposed: a strided last dim.
  const Tensor<double> x_storage = random_tensor<double>(Shape{in, rows}, rng);
  const TensorView<const double> x_t{x_storage.data(), Shape{rows, in}, {1, rows, 0, 0}};
  // x [4, 10, In] whose 4 batches are one [10, In] block: a broadcast leading dim.
  const Tensor<double> block = random_tensor<double>(Shape{10, in}, rng);
  const TensorView<const double> x_b{block.data(), Shape{4, 10, in}, {0, in, 1, 0}};
  for (const TensorView<const double>& x : {x_t, x_b}) {
    SCOPED_TRACE(x.shape.str());
    const LinearParams<double> params{.x = x, .w = w.view(), .b = b.view()};
    Tensor<double> y(with_last(x.shape, out)), y_reference(with_last(x.shape, out));
    linear_forward(params, y.view());
    linear_forward_reference(params, y_reference.view());
    EXPECT_TRUE(all_close("y", y, y_reference, 0.0));
    const Tensor<double> dy = random_tensor<double>(with_last(x.shape, out), rng);
    Tensor<double> dw(w.shape()), dw_reference(w.shape());
    linear_backward(params, dy.view(), {.dx = std::nullopt, .dw = dw.view(), .db = std::nullopt});
    linear_backward_reference(params, dy.view(), {.dx = std::nullopt, .dw = dw_reference.view(), .db = std::nullopt});
    EXPECT_TRUE(all_close("dw", dw, dw_reference, 0.0));
  }
}

// Slices of rows and columns of bigger tensors are rows at one stride: the blocked kernels read
// and write them in place, with the results of contiguous copies, and leave the rest alone.
TEST(LinearBlocked, ReadsAndWritesSlicesInPlace) {
  Rng rng(19);
  const int64_t rows = 21, in = 37, out = 19, pad = 5;
  const Problem problem = make_problem(Shape{rows, in}, out, rng);
  const Results<float> expected = run_all<float>(problem, Impl::blocked, true);

  // x: every other row of a [2·rows, in + pad] tensor, starting at column pad.
  Tensor<float> x_storage = random_tensor<float>(Shape{2 * rows, in + pad}, rng);
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(problem.x.data() + r * in, in, x_storage.data() + 2 * r * (in + pad) + pad);
  const TensorView<const float> x{x_storage.data() + pad, Shape{rows, in}, {2 * (in + pad), 1, 0, 0}};
  // y and dx: columns [pad, pad + width) of wider tensors filled with a sentinel.
  const float sentinel = 1234.5f;
  Tensor<float> y_storage(Shape{rows, out + 2 * pad}, sentinel), dx_storage(Shape{rows, in + 2 * pad}, sentinel);
  const TensorView<float> y{y_storage.data() + pad, Shape{rows, out}, {out + 2 * pad, 1, 0, 0}};
  const TensorView<float> dx{dx_storage.data() + pad, Shape{rows, in}, {in + 2 * pad, 1, 0, 0}};
  for (int64_t r = 0; r < rows; ++r) std::copy_n(problem.dx.data() + r * in, in, dx.data + r * dx.strides[0]);
  Tensor<float> dw = problem.dw, db = problem.db;
  Tensor<float> y3(Shape{1, rows, out});

  const LinearParams<float> params{.x = x, .w = problem.w.view(), .b = problem.b.view()};
  linear_forward_blocked(params, y);
  linear_backward_blocked(params, problem.dy.view(), {.dx = dx, .dw = dw.view(), .db = db.view()});
  // x again as [1, rows, in], its leading dim of size 1 with stride 0: still rows at one stride.
  linear_forward_blocked<float>({.x = TensorView<const float>{x.data, Shape{1, rows, in}, {0, x.strides[0], 1, 0}},
                                 .w = problem.w.view(),
                                 .b = problem.b.view()},
                                y3.view());
  EXPECT_TRUE(all_close("y", to_tensor<float, float>(TensorView<const float>(y)), expected.y, 0.0));
  EXPECT_TRUE(all_close("y [1, rows, out]", Tensor<float>(expected.y.shape(), y3.values()), expected.y, 0.0));
  EXPECT_TRUE(all_close("dx", to_tensor<float, float>(TensorView<const float>(dx)), expected.dx, 0.0));
  EXPECT_TRUE(all_close("dw", dw, expected.dw, 0.0));
  EXPECT_TRUE(all_close("db", db, expected.db, 0.0));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < pad; ++c) {
      EXPECT_EQ(y_storage[r * (out + 2 * pad) + c], sentinel);
      EXPECT_EQ(y_storage[r * (out + 2 * pad) + pad + out + c], sentinel);
      EXPECT_EQ(dx_storage[r * (in + 2 * pad) + c], sentinel);
      EXPECT_EQ(dx_storage[r * (in + 2 * pad) + pad + in + c], sentinel);
    }
  }
}

TEST(LinearBlocked, RejectsLayoutsItCannotRead) {
  Rng rng(20);
  const Tensor<float> w = random_tensor<float>(Shape{3, 5}, rng);
  const Tensor<float> x = random_tensor<float>(Shape{4, 5}, rng);
  Tensor<float> y(Shape{4, 3});
  const Tensor<float> x_storage = random_tensor<float>(Shape{5, 4}, rng);
  const TensorView<const float> x_t{x_storage.data(), Shape{4, 5}, {1, 4, 0, 0}};
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { linear_forward_blocked<float>({.x = x_t, .w = w.view(), .b = std::nullopt}, y.view()); },
      {"x:", "[4, 5]", "strides [1, 4]"}));
  const Tensor<float> dy = random_tensor<float>(Shape{4, 3}, rng);
  Tensor<float> dx_storage(Shape{5});
  const TensorView<float> dx_overlapping{dx_storage.data(), Shape{4, 5}, {0, 1, 0, 0}};
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        linear_backward_blocked<float>({.x = x.view(), .w = w.view(), .b = std::nullopt}, dy.view(),
                                       {.dx = dx_overlapping, .dw = std::nullopt, .db = std::nullopt});
      },
      {"dx:", "not overlapping", "strides [0, 1]"}));
  const Tensor<float> b(Shape{3});
  Tensor<float> db_storage(Shape{1});
  const TensorView<float> db_repeated{db_storage.data(), Shape{3}, {0, 0, 0, 0}};
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        linear_backward_blocked<float>({.x = x.view(), .w = w.view(), .b = b.view()}, dy.view(),
                                       {.dx = std::nullopt, .dw = std::nullopt, .db = db_repeated});
      },
      {"db:", "stride 0"}));
  // The reference takes them all.
  EXPECT_NO_THROW(linear_forward<float>({.x = x_t, .w = w.view(), .b = std::nullopt}, y.view()));
}

TEST(LinearBlocked, EdgeSizes) {
  Rng rng(21);
  for (const Case& c : std::vector<Case>{
           {.x = {0, 5}, .out = 3}, {.x = {2, 0}, .out = 3}, {.x = {4, 6}, .out = 0}, {.x = {2, 3, 0, 4}, .out = 2}}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(describe(c, with_bias));
      const Problem problem = make_problem(c.x, c.out, rng);
      const Results<double> got = run_all<double>(problem, Impl::blocked, with_bias);
      const Results<double> reference = run_all<double>(problem, Impl::reference, with_bias);
      expect_bit_identical(got, reference);
    }
  }
}

// An infinite input reaches only the outputs that it enters; the zero padding of the packed
// panels (0·inf = NaN in lanes that are never stored) leaks nowhere.
TEST(LinearBlocked, InfinityStaysInItsOwnOutputs) {
  Rng rng(22);
  Problem problem = make_problem(Shape{9, 20}, 17, rng);
  problem.x[2 * 20 + 4] = std::numeric_limits<float>::infinity();
  problem.w[16 * 20 + 4] = -std::numeric_limits<float>::infinity();  // y[2, 16] = inf·(−inf), never inf − inf
  const Results<float> got = run_all<float>(problem, Impl::blocked, true);
  const Results<double> exact = run_all<double>(problem, Impl::reference, true);
  const Results<float> naive = naive_all<float>(problem, true);
  for (int64_t r = 0; r < 9; ++r) {
    for (int64_t o = 0; o < 17; ++o) {
      EXPECT_EQ(std::isfinite(got.y[r * 17 + o]), std::isfinite(exact.y[r * 17 + o])) << "y[" << r << ", " << o << "]";
    }
  }
  EXPECT_TRUE(all_close("y", got.y, exact.y, tolerance_from_naive(naive.y, exact.y)));
}

}  // namespace
}  // namespace qkv
