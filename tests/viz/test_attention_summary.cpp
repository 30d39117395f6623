// Tests of attention rollout, the per-head entropy and mean distance, and the mean over heads
// (src/viz/attention_summary.cpp): each against a value worked by hand, and rollout's identities
// (rows of R sum to 1; one layer of identity attention rolls out to the identity).

#include <gtest/gtest.h>

#include <cmath>

#include "qkv/core/error.hpp"
#include "qkv/viz/attention_summary.hpp"

namespace qkv {
namespace {

// Sums of float64 products of a few terms: exact to a few ulps.
constexpr double kTight = 1e-15;

TEST(AttentionRollout, OneLayerIsTheResidualAttention) {
  // One head, T = 2: A = [[0.25, 0.75], [1, 0]] → 0.5 A + 0.5 I = [[0.625, 0.375], [0.5, 0.5]], rows summing to 1.
  const Tensor<float> a({1, 1, 2, 2}, {0.25F, 0.75F, 1.0F, 0.0F});
  const Tensor<double> r = attention_rollout(a.cview(), "a");
  EXPECT_EQ(r.shape(), Shape({1, 2, 2}));
  EXPECT_NEAR(r[0], 0.625, kTight);
  EXPECT_NEAR(r[1], 0.375, kTight);
  EXPECT_NEAR(r[2], 0.5, kTight);
  EXPECT_NEAR(r[3], 0.5, kTight);
}

TEST(AttentionRollout, LayersMultiplyFromTheInputUp) {
  // Two layers of two equal heads. Â_0 = [[1, 0], [.5, .5]], Â_1 = [[.5, .5], [0, 1]]; R_1 = Â_1 · Â_0 =
  // [[.75, .25], [.5, .5]] (the other order would give [[.5, .5], [.25, .75]]).
  const Tensor<float> a({2, 2, 2, 2}, {1.0F, 0.0F, 1.0F, 0.0F, 1.0F, 0.0F, 1.0F, 0.0F,    // layer 0: all to key 0
                                       0.0F, 1.0F, 0.0F, 1.0F, 0.0F, 1.0F, 0.0F, 1.0F});  // layer 1: all to key 1
  const Tensor<double> r = attention_rollout(a.cview(), "a");
  const double expected[8] = {1.0, 0.0, 0.5, 0.5, 0.75, 0.25, 0.5, 0.5};
  for (int64_t k = 0; k < 8; ++k) EXPECT_NEAR(r[k], expected[k], kTight) << k;
}

TEST(AttentionRollout, RowsSumToOneAndZeroRowsAreTheResidual) {
  // A row of zeros (a query that sees no key) keeps only the residual: Â's row is e_i.
  const Tensor<float> a({3, 1, 3, 3}, {0.2F, 0.3F, 0.5F, 0.0F, 0.0F, 0.0F, 1.0F, 0.0F, 0.0F,  //
                                       0.1F, 0.1F, 0.8F, 0.6F, 0.4F, 0.0F, 0.0F, 0.5F, 0.5F,  //
                                       1.0F, 0.0F, 0.0F, 0.0F, 1.0F, 0.0F, 0.3F, 0.3F, 0.4F});
  const Tensor<double> r = attention_rollout(a.cview(), "a");
  for (int64_t row = 0; row < 9; ++row) {
    double sum = 0.0;
    for (int64_t j = 0; j < 3; ++j) sum += r[row * 3 + j];
    EXPECT_NEAR(sum, 1.0, 4 * kTight) << row;
  }
  EXPECT_NEAR(r[3], 0.0, kTight);
  EXPECT_NEAR(r[4], 1.0, kTight);
}

TEST(AttentionRollout, CrossAttentionIsRefused) {
  const Tensor<float> a({1, 1, 2, 3}, 1.0F / 3.0F);
  EXPECT_THROW(attention_rollout(a.cview(), "a"), ShapeError);
}

TEST(AttentionEntropy, UniformIsLnTkAndOneHotIsZero) {
  // Head 0 uniform over 4 keys, head 1 one-hot.
  Tensor<float> a({1, 2, 2, 4}, 0.25F);
  for (int64_t k = 8; k < 16; ++k) a[k] = k % 4 == 1 ? 1.0F : 0.0F;
  const Tensor<double> e = attention_entropy(a.cview());
  EXPECT_EQ(e.shape(), Shape({1, 2}));
  EXPECT_NEAR(e[0], std::log(4.0), 4 * kTight);
  EXPECT_EQ(e[1], 0.0);
}

TEST(AttentionDistance, IsTheMeanOfAlphaTimesOffset) {
  // Query 0 looks at key 2 (distance 2); query 1 splits over keys 0 and 1 (0.5 · 1 + 0.5 · 0).
  const Tensor<float> a({1, 1, 2, 3}, {0.0F, 0.0F, 1.0F, 0.5F, 0.5F, 0.0F});
  const Tensor<double> d = attention_distance(a.cview());
  EXPECT_NEAR(d[0], (2.0 + 0.5) / 2.0, kTight);
}

TEST(AttentionHeadMean, AveragesTheHeadsOfEachLayer) {
  const Tensor<float> a({1, 2, 1, 2}, {1.0F, 0.0F, 0.0F, 1.0F});
  const Tensor<double> m = attention_head_mean(a.cview());
  EXPECT_EQ(m.shape(), Shape({1, 1, 2}));
  EXPECT_EQ(m[0], 0.5);
  EXPECT_EQ(m[1], 0.5);
}

}  // namespace
}  // namespace qkv
