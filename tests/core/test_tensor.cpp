// Tests of the tensor views (src/core/tensor.cpp) and the seedable RNG (src/core/rng.cpp).

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/storage.hpp"
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

TEST(Tensor, LargeTensorsOnHugePagesHoldTheirFillAsSmallOnesDo) {
  // From 4 MiB a tensor's storage is advised to take huge pages before it is filled; whether the
  // kernel grants them depends on the system, what the tensor holds must not.
  for (const int64_t n : {int64_t{1}, (int64_t{4} << 20) / 4 - 1, (int64_t{4} << 20) / 4, (int64_t{9} << 20) / 4 + 3}) {
    const Tensor<float> t(Shape{n}, 1.5f);
    ASSERT_EQ(t.numel(), n);
    EXPECT_EQ(t[0], 1.5f);
    EXPECT_EQ(t[n / 2], 1.5f);
    EXPECT_EQ(t[n - 1], 1.5f);
  }
  std::vector<uint32_t> values(3, 7);
  assign_on_huge_pages(values, size_t{5} << 20, uint32_t{2});
  EXPECT_EQ(values.size(), size_t{5} << 20);
  EXPECT_EQ(values.front(), 2u);
  EXPECT_EQ(values.back(), 2u);
  // Ranges of no whole huge page, and none at all, are left alone.
  advise_huge_pages(nullptr, size_t{1} << 30);
  advise_huge_pages(values.data() + 1, 100);
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

TEST(CheckFinite, FindsTheOneNonFiniteValueOfALongArrayOnAnyThreadCount) {
  // Long enough to be split over the threads, with its one NaN in the last block.
  Tensor<float> x(Shape{3, 100003});
  x[x.numel() - 2] = std::nanf("");
  const int all = max_workers();
  for (const int workers : {1, 2, 3}) {
    set_max_workers(workers);
    EXPECT_THROW(check_finite(x.cview(), "x"), ValueError) << workers << " workers";
  }
  set_max_workers(all);
  x[x.numel() - 2] = 0;
  EXPECT_NO_THROW(check_finite(x.cview(), "x"));
}

TEST(CheckFinite, StoredOperandsAreCheckedOnTheirBits) {
  // float16's and bfloat16's largest finite values pass; an all-ones exponent (inf, NaN) anywhere
  // in a contiguous or a strided view is refused and named as its float32 value would be.
  for (const StorageType type : {StorageType::float16, StorageType::bfloat16}) {
    const bool half = type == StorageType::float16;
    const uint16_t largest = half ? 0x7BFF : 0x7F7F, infinity = half ? 0x7C00 : 0x7F80, nan = half ? 0x7E00 : 0x7FC0;
    Tensor<uint16_t> bits(Shape{2, 70001, 2});
    for (int64_t i = 0; i < bits.numel(); ++i) bits[i] = i % 2 == 0 ? largest : static_cast<uint16_t>(largest | 0x8000);
    const auto stored = [&](TensorView<const uint16_t> view) {
      return half ? StoredView::float16(view) : StoredView::bfloat16(view);
    };
    EXPECT_NO_THROW(check_finite(stored(bits.cview()), "k"));
    const TensorView<const uint16_t> column{bits.data(), Shape{2, 70001}, Strides{70001 * 2, 2}};
    for (const int64_t at : {int64_t{0}, int64_t{2 * 70001 - 2}, bits.numel() - 1}) {
      bits[at] = at % 2 == 0 ? nan : infinity;
      EXPECT_THROW(check_finite(stored(bits.cview()), "k"), ValueError) << storage_name(type) << " at " << at;
      if (at % 2 == 0) {
        EXPECT_THROW(check_finite(stored(column), "k"), ValueError) << storage_name(type) << " at " << at;
      } else {
        EXPECT_NO_THROW(check_finite(stored(column), "k")) << "the view skips " << at;
      }
      bits[at] = largest;
    }
    bits[5] = static_cast<uint16_t>(infinity | 0x8000);
    try {
      check_finite(stored(bits.cview()), "k", "pass allow_nonfinite=True to accept them");
      FAIL() << "no error";
    } catch (const ValueError& e) {
      EXPECT_STREQ(e.what(),
                   "k: expected finite values, got 1 non-finite value (the first: -inf at [0, 2, 1]); pass "
                   "allow_nonfinite=True to accept them");
    }
  }
}

}  // namespace
}  // namespace qkv
