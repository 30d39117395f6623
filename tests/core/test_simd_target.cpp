// Tests of the one instruction-set setting (src/core/simd_target.cpp): the list of targets, forcing each
// and going back to the best, the refusal of an unknown name, and that a forced target reaches
// both families of Highway kernels (the blocked linear layer and the fused attention), which must
// still agree with their float64 references there.

#include "qkv/core/simd_target.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/linear.hpp"
#include "support/attention_problems.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::cast;
using testing::random_tensor;
using testing::throws_naming;
using testing::tolerance_from_naive;

// Every test ends on the best target, even one that a failed assertion cut short.
class SimdTarget : public ::testing::Test {
 protected:
  void TearDown() override { use_simd_target(""); }
};

TEST_F(SimdTarget, ListsDistinctTargetsAndRunsTheBest) {
  const std::vector<std::string> targets = simd_targets();
  ASSERT_FALSE(targets.empty());
  EXPECT_EQ(std::set<std::string>(targets.begin(), targets.end()).size(), targets.size());
  EXPECT_EQ(simd_target(), targets.front());
}

TEST_F(SimdTarget, EveryTargetCanBeForcedAndEmptyRestoresTheBest) {
  const std::vector<std::string> targets = simd_targets();
  for (const std::string& target : targets) {
    SCOPED_TRACE(target);
    use_simd_target(target);
    EXPECT_EQ(simd_target(), target);
    // A forced target does not hide the others from the list.
    EXPECT_EQ(simd_targets(), targets);
    use_simd_target("");
    EXPECT_EQ(simd_target(), targets.front());
  }
}

TEST_F(SimdTarget, RefusesAnUnknownNameNamingTheArgumentAndTheChoices) {
  const std::vector<std::string> targets = simd_targets();
  std::vector<std::string> parts = {"target:", "NOT_A_TARGET"};
  parts.insert(parts.end(), targets.begin(), targets.end());
  EXPECT_TRUE(throws_naming<ValueError>([] { use_simd_target("NOT_A_TARGET"); }, parts));
  EXPECT_EQ(simd_target(), targets.front());
  // A refusal while a target is forced leaves that one in force.
  use_simd_target(targets.back());
  EXPECT_TRUE(throws_naming<ValueError>([] { use_simd_target("not_a_target"); }, {"target:", "not_a_target"}));
  EXPECT_EQ(simd_target(), targets.back());
}

// y [Rows, Out] = x w^T + b computed as it reads, in float: the naive float32 of the tolerance rule.
Tensor<float> naive_linear_float32(const Tensor<double>& x, const Tensor<double>& w, const Tensor<double>& b) {
  const int64_t rows = x.shape()[0], in = x.shape()[1], out = w.shape()[0];
  const Tensor<float> xf = cast<float>(x), wf = cast<float>(w), bf = cast<float>(b);
  Tensor<float> y({rows, out});
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t o = 0; o < out; ++o) {
      float acc = bf[o];
      for (int64_t i = 0; i < in; ++i) acc += xf[n * in + i] * wf[o * in + i];
      y[n * out + o] = acc;
    }
  return y;
}

// The last target is the worst: the one furthest from what runs by default, so a setting that
// reached only one family of kernels would leave the other on the best.
TEST_F(SimdTarget, ForcingReachesTheLinearAndTheFusedAttentionKernels) {
  const std::string target = simd_targets().back();
  use_simd_target(target);
  ASSERT_EQ(simd_target(), target);

  // Sizes that are multiples of no vector width or tile.
  Rng rng(41);
  const Tensor<double> x = random_tensor<double>({7, 113}, rng), w = random_tensor<double>({37, 113}, rng),
                       b = random_tensor<double>({37}, rng);
  const Tensor<float> xf = cast<float>(x), wf = cast<float>(w), bf = cast<float>(b);
  Tensor<float> y({7, 37});
  linear_forward_blocked<float>({.x = xf.view(), .w = wf.view(), .b = bf.view()}, y.view());
  Tensor<double> exact({7, 37});
  linear_forward_reference<double>({.x = x.view(), .w = w.view(), .b = b.view()}, exact.view());
  EXPECT_TRUE(all_close("linear y", y, exact, tolerance_from_naive(naive_linear_float32(x, w, b), exact)));

  testing::AttentionProblem p = testing::random_problem({1, 2, 37, 41, 16, 9, true}, 42);
  p.allowed = testing::random_mask({37, 41}, 0.8, 43);
  const testing::AttentionOperands<float> ops(p);
  Tensor<float> out({1, 2, 37, 9}), lse({1, 2, 37});
  attention_forward(ops.params(), AttentionOutputs<float>{.out = out.view(), .weights = {}, .lse = lse.view()},
                    AttentionImpl::fused);
  const testing::NaiveAttention<double> want = testing::naive_attention_forward<double>(p);
  const testing::NaiveAttention<float> naive = testing::naive_attention_forward<float>(p);
  EXPECT_TRUE(all_close("attention out", out, want.out, tolerance_from_naive(naive.out, want.out)));
  EXPECT_TRUE(all_close("attention lse", lse, want.lse, tolerance_from_naive(naive.lse, want.lse)));
}

TEST(CpuInfo, NamesTheCpuAndItsCachesWhereTheSystemTellsThem) {
  const CpuInfo& cpu = cpu_info();
  EXPECT_FALSE(cpu.model.empty());
  EXPECT_GE(cpu.l1d_bytes, 0);
  EXPECT_GE(cpu.l2_bytes, 0);
  EXPECT_GE(cpu.l3_bytes, 0);
  // Linux describes the caches under sysfs; where it does, a first-level data cache is there.
  if (std::ifstream("/sys/devices/system/cpu/cpu0/cache/index0/size").good()) {
    EXPECT_GT(cpu.l1d_bytes, 0);
  }
  EXPECT_EQ(&cpu_info(), &cpu) << "read once and kept";
  EXPECT_EQ(cpu_summary().rfind(cpu.model + "; caches L1d ", 0), 0U) << cpu_summary();
}

}  // namespace
}  // namespace qkv
