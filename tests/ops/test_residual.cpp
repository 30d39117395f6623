#include "qkv/ops/residual.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "qkv/core/error.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::random_tensor;
using testing::throws_naming;

// One addition per element, rounded once: the same bits as a + b computed here.
TEST(Residual, ForwardAdds) {
  Rng rng(1);
  for (const Shape& shape : std::vector<Shape>{{7}, {3, 113}, {2, 3, 4}, {1, 2, 1, 5}, {0, 4}}) {
    SCOPED_TRACE(shape.str());
    const Tensor<float> a = random_tensor<float>(shape, rng);
    const Tensor<float> b = random_tensor<float>(shape, rng);
    Tensor<float> y(shape);
    residual_forward(a.cview(), b.cview(), y.view());
    Tensor<float> expected(shape);
    for (int64_t i = 0; i < a.numel(); ++i) expected[i] = a[i] + b[i];
    EXPECT_TRUE(all_close("y", y, expected, 0.0));
  }
}

TEST(Residual, ForwardInPlace) {
  Rng rng(2);
  const Tensor<double> a = random_tensor<double>(Shape{4, 5}, rng);
  Tensor<double> b = random_tensor<double>(Shape{4, 5}, rng);
  Tensor<double> expected(b.shape());
  for (int64_t i = 0; i < b.numel(); ++i) expected[i] = a[i] + b[i];
  residual_forward<double>(a.cview(), b.cview(), b.view());
  EXPECT_TRUE(all_close("b", b, expected, 0.0));
}

// L = <dy, a + b> is linear: ∂L/∂a = ∂L/∂b = dy exactly, added into what is there.
TEST(Residual, BackwardPassesTheGradientToBothBranches) {
  Rng rng(3);
  const Tensor<double> dy = random_tensor<double>(Shape{3, 4}, rng);
  Tensor<double> da(Shape{3, 4}, 1.0), db(Shape{3, 4});
  residual_backward<double>(dy.cview(), {.da = da.view(), .db = db.view()});
  Tensor<double> expected = dy;
  EXPECT_TRUE(all_close("db", db, expected, 0.0));
  for (double& e : expected.values()) e += 1.0;
  EXPECT_TRUE(all_close("da", da, expected, 0.0));
  // A branch not asked for is not touched.
  Tensor<double> only(Shape{3, 4});
  residual_backward<double>(dy.cview(), {.db = only.view()});
  EXPECT_TRUE(all_close("db", only, dy, 0.0));
}

// Central differences of the linear L = <dy, a + b> are exact up to the rounding of the sum of
// 2·numel products over 2h.
TEST(Residual, GradientMatchesFiniteDifferences) {
  Rng rng(4);
  Tensor<double> a = random_tensor<double>(Shape{2, 3}, rng);
  Tensor<double> b = random_tensor<double>(Shape{2, 3}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{2, 3}, rng);
  const auto loss = [&] {
    Tensor<double> y(a.shape());
    residual_forward(a.cview(), b.cview(), y.view());
    return testing::dot(dy, y);
  };
  Tensor<double> da(a.shape()), db(b.shape());
  residual_backward<double>(dy.cview(), {.da = da.view(), .db = db.view()});
  const double step = 1e-6;
  const double tolerance = 12.0 * 8.0 * std::numeric_limits<double>::epsilon() / step;
  EXPECT_TRUE(all_close("da", da, testing::numeric_gradient(loss, a, step), tolerance));
  EXPECT_TRUE(all_close("db", db, testing::numeric_gradient(loss, b, step), tolerance));
}

TEST(Residual, StridedViews) {
  Rng rng(5);
  const Tensor<double> storage = random_tensor<double>(Shape{4, 3}, rng);
  const TensorView<const double> a{storage.data(), Shape{3, 4}, {1, 3, 0, 0}};  // a transposed read
  const Tensor<double> b = random_tensor<double>(Shape{3, 4}, rng);
  Tensor<double> y(Shape{3, 4});
  residual_forward<double>(a, b.cview(), y.view());
  const Tensor<double> a_contiguous = to_tensor<double, double>(a);
  Tensor<double> expected(Shape{3, 4});
  residual_forward<double>(a_contiguous.cview(), b.cview(), expected.view());
  EXPECT_TRUE(all_close("y", y, expected, 0.0));
}

TEST(Residual, BadShapesNameTheArgument) {
  const Tensor<double> a(Shape{2, 3});
  const Tensor<double> b(Shape{3, 2});
  Tensor<double> y(Shape{2, 3});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { residual_forward<double>(a.cview(), b.cview(), y.view()); },
                                        {"b:", "[2, 3]", "[3, 2]"}));
  Tensor<double> y_bad(Shape{6});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { residual_forward<double>(a.cview(), a.cview(), y_bad.view()); },
                                        {"y:", "[2, 3]", "[6]"}));
  Tensor<double> da_bad(Shape{2, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { residual_backward<double>(a.cview(), {.da = da_bad.view()}); },
                                        {"da:", "[2, 3]", "[2, 4]"}));
}

}  // namespace
}  // namespace qkv
