// Tests of the tensor views (src/core/tensor.cpp) and the seedable RNG (src/core/rng.cpp).

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

TEST(Shape, NumelStringAndEquality) {
  EXPECT_EQ(Shape({2, 3, 4}).numel(), 24);
  EXPECT_EQ(Shape({}).numel(), 1);
  EXPECT_EQ(Shape({5, 0}).numel(), 0);
  EXPECT_EQ(Shape({2, 8, 128, 64}).str(), "[2, 8, 128, 64]");
  EXPECT_EQ(Shape({}).str(), "[]");
  EXPECT_EQ(Shape({1, 2}), Shape({1, 2}));
  EXPECT_FALSE(Shape({1, 2}) == Shape({1, 2, 1}));
  EXPECT_THROW(Shape({1, 2, 3, 4, 5}), ShapeError);
  EXPECT_THROW(Shape({-1}), ShapeError);
}

// A zero dim makes a shape empty but leaves its strides the products of the other dims, so a shape
// is refused when those overflow int64, before any caller forms a stride or a numel.
TEST(Shape, RefusesDimsWhoseProductOverflows) {
  using qkv::testing::throws_naming;
  EXPECT_TRUE(throws_naming<ShapeError>(
      [] {
        Shape({0, 2100000, 2100000, 2100000});
      },
      {"[0, 2100000, 2100000, 2100000]", "64 bits"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [] {
        Shape({int64_t{1} << 32, int64_t{1} << 32, 0});
      },
      {"[4294967296, 4294967296, 0]", "64 bits"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [] {
        Tensor<float>(Shape({int64_t{1} << 40, int64_t{1} << 40}));
      },
      {"[1099511627776, 1099511627776]", "64 bits"}));
  EXPECT_EQ(Shape({0, int64_t{1} << 31, int64_t{1} << 31}).numel(), 0);
  EXPECT_EQ(Shape({INT64_MAX}).numel(), INT64_MAX);
  EXPECT_EQ(contiguous_strides(Shape({2, 0, 3})), (Strides{0, 3, 1, 0}));

  // Shape's dims can be assigned after construction; strides and numel still refuse an overflow.
  Shape grown({0, 2, 2, 2});
  for (int axis = 1; axis < 4; ++axis) grown[axis] = 2100000;
  EXPECT_TRUE(throws_naming<ShapeError>([&] { contiguous_strides(grown); }, {"[0, 2100000, 2100000, 2100000]"}));
  grown[0] = 1;
  EXPECT_TRUE(throws_naming<ShapeError>([&] { (void)grown.numel(); }, {"[1, 2100000, 2100000, 2100000]"}));
}

TEST(TensorView, ContiguousIndexing) {
  Tensor<float> t({2, 3, 4, 5});
  for (int64_t n = 0; n < t.numel(); ++n) t[n] = static_cast<float>(n);
  const TensorView<float> v = t.view();
  EXPECT_EQ(v(1, 2, 3, 4), 119.0f);
  EXPECT_EQ(v(0, 1, 0, 2), 22.0f);
  EXPECT_TRUE(v.is_contiguous());
}

TEST(TensorView, AsBhtdPadsLeadingDims) {
  Tensor<double> t({3, 4});
  const TensorView<double> v = as_bhtd(t.view(), "x");
  EXPECT_EQ(v.shape, Shape({1, 1, 3, 4}));
  Tensor<double> scalar{Shape{}};
  EXPECT_THROW(as_bhtd(scalar.view(), "x"), ShapeError);
}

TEST(TensorView, BroadcastFollowsNumpyRules) {
  Tensor<uint8_t> mask({1, 5}, 1);
  const TensorView<uint8_t> b = broadcast_to(mask.view(), Shape{2, 3, 4, 5}, "mask");
  EXPECT_EQ(b.strides[0], 0);
  EXPECT_EQ(b.strides[2], 0);
  EXPECT_EQ(b.strides[3], 1);
  try {
    broadcast_to(mask.view(), Shape{2, 3, 4, 6}, "mask");
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(), "mask: shape [1, 5] does not broadcast to [2, 3, 4, 6]");
  }
}

TEST(TensorView, ToTensorCopiesStridedViews) {
  Tensor<float> t({3, 4});
  for (int64_t n = 0; n < t.numel(); ++n) t[n] = static_cast<float>(n);
  const TensorView<const float> column{t.data() + 1, Shape{3, 1}, {4, 1}};
  const Tensor<double> copy = to_tensor<double, float>(column);
  EXPECT_EQ(copy.values(), (std::vector<double>{1, 5, 9}));
}

TEST(CheckShape, NamesArgumentExpectedAndActual) {
  try {
    check_shape("k", Shape{2, 8, 16, 32}, Shape{2, 8, 16, 64});
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(), "k: expected shape [2, 8, 16, 64], got [2, 8, 16, 32]");
  }
}

TEST(Rng, SameSeedSameStreamDifferentSeedDifferentStream) {
  Rng a(42), b(42), c(43);
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.next_u64();
    EXPECT_EQ(x, b.next_u64());
    EXPECT_NE(x, c.next_u64());
  }
}

TEST(Rng, MomentsOfUniformAndNormal) {
  Rng rng(7);
  const int n = 200000;
  double su = 0, sn = 0, sn2 = 0;
  for (int i = 0; i < n; ++i) {
    const double u = rng.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    su += u;
    const double z = rng.normal();
    sn += z;
    sn2 += z * z;
  }
  // Five standard errors: σ/√n with σ = 1/√12 for the uniform, 1 and √2 for the normal's moments.
  EXPECT_NEAR(su / n, 0.5, 5 * std::sqrt(1.0 / 12 / n));
  EXPECT_NEAR(sn / n, 0.0, 5 * std::sqrt(1.0 / n));
  EXPECT_NEAR(sn2 / n, 1.0, 5 * std::sqrt(2.0 / n));
}

TEST(IndexStr, CountsInCOrder) {
  EXPECT_EQ(index_str(Shape{2, 3, 4}, 0), "[0, 0, 0]");
  EXPECT_EQ(index_str(Shape{2, 3, 4}, 23), "[1, 2, 3]");
  EXPECT_EQ(index_str(Shape{}, 0), "[]");
}

TEST(CheckFinite, NamesTheArgumentTheCountAndTheFirstIndex) {
  Tensor<float> x(Shape{2, 3});
  x[4] = std::nanf("");
  x[5] = INFINITY;
  try {
    check_finite(x.cview(), "q", NonFinite::refused, "pass allow_nonfinite=True to accept them");
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(),
                 "q: expected finite values, got 2 non-finite values (the first: nan at [1, 1]); pass "
                 "allow_nonfinite=True to accept them");
  }
}

TEST(CheckFinite, MinusInfinityIsABiasMaskingAKey) {
  Tensor<double> bias(Shape{2, 2});
  bias[1] = -INFINITY;
  EXPECT_NO_THROW(check_finite(bias.cview(), "mask", NonFinite::minus_infinity_allowed));
  bias[2] = INFINITY;
  EXPECT_THROW(check_finite(bias.cview(), "mask", NonFinite::minus_infinity_allowed), ValueError);
  EXPECT_THROW(check_finite(bias.cview(), "mask"), ValueError);
}

}  // namespace
}  // namespace qkv
