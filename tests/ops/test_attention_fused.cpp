// Tests of the fused attention kernels (src/ops/attention_fused.cpp), each on every SIMD target this CPU
// runs: against the float64 reference on the tolerance rule (at most 2× the error of the same
// computation done naively in float32), on awkward sizes, masks, causal Tq ≠ Tk, strided inputs,
// the decode split, large logits; determinism across thread counts; float64 gradients against
// finite differences.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/ops/attention.hpp"
#include "support/attention_problems.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::cast;
using testing::lse_rounding;
using testing::max_abs;
using testing::random_dout;
using testing::random_mask;
using testing::random_problem;
using testing::random_tensor;
using Case = testing::AttentionCase;
using Problem = testing::AttentionProblem;
template <class T>
using Operands = testing::AttentionOperands<T>;

constexpr double kInf = std::numeric_limits<double>::infinity();

using testing::all_finite;
using testing::bit_identical;
using testing::expect_float32_matches_reference;
using testing::Forward;
using testing::Grads;
using testing::on_every_target;
using testing::reference_backward;
using testing::reference_forward;
using testing::run_backward;
using testing::run_forward;
using testing::WorkersScope;

// --- agreement with the reference ----------------------------------------------------------------

TEST(AttentionFused, AwkwardSizesMatchReference) {
  // T = 1, 7, 113, 1023, 1025 and d = 1, 17, 64, 72, 128, 256, none a multiple of every tile or
  // vector width; Dk ≠ Dv and B, H > 1 on the way.
  // T = 1023 and 1025 on one side only, so that the float64 reference stays cheap.
  const Case cases[] = {{1, 1, 1, 1, 1, 1},        {2, 3, 7, 7, 17, 17},      {1, 2, 113, 113, 64, 64},
                        {1, 1, 113, 7, 72, 72},    {1, 1, 7, 113, 128, 128},  {1, 1, 33, 70, 256, 256},
                        {1, 1, 1023, 40, 64, 64},  {1, 1, 1025, 65, 17, 128}, {1, 1, 65, 1025, 64, 1},
                        {1, 1, 20, 1023, 256, 72}, {2, 2, 5, 9, 1, 72}};
  uint64_t seed = 100;
  for (const Case& c : cases) {
    expect_float32_matches_reference(
        random_problem(c, seed), seed + 1,
        fmt::format("B={} H={} Tq={} Tk={} Dk={} Dv={}", c.b, c.h, c.tq, c.tk, c.dk, c.dv));
    seed += 2;
  }
}

TEST(AttentionFused, CasesOfTheReferenceTests) {
  // The shapes tests/ops/test_attention.cpp checks the reference on, now fused against it.
  const Case cases[] = {{},
                        {2, 3, 6, 6, 8, 8},
                        {1, 2, 9, 4, 5, 11},
                        {1, 1, 113, 17, 13, 7},
                        {2, 2, 33, 47, 64, 32},
                        {1, 4, 64, 64, 128, 128, true},
                        {1, 1, 5, 3, 2, 2, true},
                        {1, 1, 3, 6, 2, 3, true}};
  uint64_t seed = 50;
  for (const Case& c : cases) {
    expect_float32_matches_reference(random_problem(c, seed), seed + 1, fmt::format("reference case {}", seed));
    seed += 2;
  }
  Problem shared_bias = random_problem({2, 3, 4, 5, 3, 2}, 70);
  Rng rng(71);
  shared_bias.bias = random_tensor<double>({1, 3, 1, 5}, rng);
  expect_float32_matches_reference(shared_bias, 72, "bias [1, 3, 1, 5]");
  Problem masked = random_problem({1, 1, 4, 5, 3, 3}, 73);
  masked.allowed = Tensor<uint8_t>({4, 5}, 1);
  for (int64_t j = 0; j < 5; ++j) masked.allowed->view()(2, j) = 0;
  masked.allowed->view()(0, 1) = 0;
  expect_float32_matches_reference(masked, 74, "mask with a fully masked row");
}

TEST(AttentionFused, CausalWithTqAboveAndBelowTk) {
  // Bottom-right aligned: with Tq > Tk the first Tq − Tk queries see no key at all.
  const Case cases[] = {{1, 2, 130, 130, 64, 64, true}, {1, 1, 113, 70, 17, 33, true}, {1, 1, 70, 200, 64, 64, true},
                        {2, 1, 7, 1025, 72, 64, true},  {1, 1, 200, 3, 8, 8, true},    {1, 1, 1, 1, 1, 1, true}};
  uint64_t seed = 200;
  for (const Case& c : cases) {
    const Problem p = random_problem(c, seed);
    expect_float32_matches_reference(p, seed + 1, fmt::format("causal Tq={} Tk={} d={}", c.tq, c.tk, c.dk));
    if (c.tq > c.tk) {
      on_every_target([&] {
        const Forward f = run_forward<float>(p, AttentionImpl::fused);
        EXPECT_EQ(f.lse.view()(0, 0, 0), -kInf);
        EXPECT_EQ(f.out.view()(0, 0, 0, 0), 0.0);
      });
    }
    seed += 2;
  }
}

TEST(AttentionFused, ScaleIsHonoured) {
  Problem p = random_problem({1, 2, 37, 41, 16, 8}, 300);
  p.scale = 0.37;
  expect_float32_matches_reference(p, 301, "scale 0.37");
}

TEST(AttentionFused, BooleanMasksInBroadcastShapes) {
  const Case c{2, 3, 75, 90, 24, 20};
  const Shape shapes[] = {{2, 3, 75, 90}, {75, 90}, {1, 3, 1, 90}, {2, 1, 75, 1}, {90}};
  uint64_t seed = 400;
  for (const Shape& shape : shapes) {
    Problem p = random_problem(c, seed);
    p.allowed = random_mask(shape, 0.7, seed + 1);
    expect_float32_matches_reference(p, seed + 2, "mask " + shape.str());
    seed += 3;
  }
}

TEST(AttentionFused, BiasInBroadcastShapesAndItsGradient) {
  const Case c{2, 3, 75, 90, 24, 20, true};
  // Full, shared by batch and queries (summed over both), shared by heads (summed over heads
  // whichever thread runs them), shared by keys and one number for everything.
  const Shape shapes[] = {{2, 3, 75, 90}, {1, 3, 1, 90}, {75, 90}, {2, 3, 75, 1}, {1}};
  uint64_t seed = 500;
  for (const Shape& shape : shapes) {
    Problem p = random_problem(c, seed);
    Rng rng(seed + 1);
    p.bias = random_tensor<double>(shape, rng);
    expect_float32_matches_reference(p, seed + 2, "bias " + shape.str());
    seed += 3;
    if (shape.from_back(1) != 1) continue;
    // A bias constant along the keys shifts a whole row of scores, which softmax ignores: its
    // gradient is exactly 0, and the fused kernel gives exactly 0.
    const Grads g = run_backward<float>(p, random_dout(p, seed), AttentionImpl::fused);
    EXPECT_TRUE(all_close("dbias", g.dbias, Tensor<double>(g.dbias.shape()), 0.0)) << shape.str();
  }
}

TEST(AttentionFused, BiasWithMinusInfinityMasksLikeBooleanMask) {
  on_every_target([] {
    Problem masked = random_problem({1, 2, 50, 60, 16, 16}, 600);
    Problem biased = masked;
    masked.allowed = random_mask({50, 60}, 0.5, 601);
    biased.bias = Tensor<double>({50, 60});
    for (int64_t i = 0; i < masked.allowed->numel(); ++i) (*biased.bias)[i] = (*masked.allowed)[i] ? 0.0 : -kInf;
    const Forward a = run_forward<float>(masked, AttentionImpl::fused);
    const Forward b = run_forward<float>(biased, AttentionImpl::fused);
    EXPECT_TRUE(all_close("out", a.out, b.out, 0.0));
    EXPECT_TRUE(all_close("lse", a.lse, b.lse, 0.0));
  });
}

TEST(AttentionFused, FullyMaskedRowsGiveZeroAndNoNaN) {
  Problem p = random_problem({1, 2, 70, 80, 16, 16}, 700);
  p.allowed = random_mask({1, 2, 70, 80}, 0.6, 701);
  for (int64_t j = 0; j < 80; ++j) {
    p.allowed->view()(0, 0, 3, j) = 0;   // one row of head 0
    p.allowed->view()(0, 1, 69, j) = 0;  // the last row of head 1
  }
  Rng rng(702);
  p.bias = random_tensor<double>({1, 2, 70, 80}, rng);
  expect_float32_matches_reference(p, 703, "fully masked rows");
  on_every_target([&] {
    const Forward f = run_forward<float>(p, AttentionImpl::fused);
    EXPECT_EQ(f.lse.view()(0, 0, 3), -kInf);
    EXPECT_EQ(f.lse.view()(0, 1, 69), -kInf);
    for (int64_t d = 0; d < 16; ++d) EXPECT_EQ(f.out.view()(0, 0, 3, d), 0.0);
    const Tensor<double> dout = random_dout(p, 704);
    const Grads g = run_backward<float>(p, dout, AttentionImpl::fused);
    for (int64_t d = 0; d < 16; ++d) EXPECT_EQ(g.dq.view()(0, 0, 3, d), 0.0);
    for (int64_t j = 0; j < 80; ++j) EXPECT_EQ(g.dbias.view()(0, 0, 3, j), 0.0);
    EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv) && all_finite(g.dbias));

    // Every key of every row masked: the whole output is 0 and every gradient 0.
    Problem none = random_problem({1, 1, 9, 130, 8, 8}, 705);
    none.allowed = Tensor<uint8_t>({9, 130}, 0);
    const Forward fn = run_forward<float>(none, AttentionImpl::fused);
    const Grads gn = run_backward<float>(none, random_dout(none, 706), AttentionImpl::fused);
    EXPECT_TRUE(all_close("out", fn.out, Tensor<double>(fn.out.shape()), 0.0));
    EXPECT_TRUE(all_close("dk", gn.dk, Tensor<double>(gn.dk.shape()), 0.0));
    EXPECT_TRUE(all_close("dv", gn.dv, Tensor<double>(gn.dv.shape()), 0.0));
  });
}

TEST(AttentionFused, NoKeysAtAll) {
  on_every_target([] {
    const Problem p = random_problem({1, 2, 5, 0, 8, 4}, 800);
    const Forward f = run_forward<float>(p, AttentionImpl::fused);
    EXPECT_TRUE(all_close("out", f.out, Tensor<double>(f.out.shape()), 0.0));
    for (int64_t i = 0; i < f.lse.numel(); ++i) EXPECT_EQ(f.lse[i], -kInf);
  });
}

// --- the decode path ---------------------------------------------------------------------------------

TEST(AttentionFused, DecodeSplitMatchesReference) {
  const Case cases[] = {{1, 1, 1, 4096, 128, 128}, {1, 2, 16, 2500, 64, 64}, {2, 1, 3, 1100, 17, 5, true}};
  uint64_t seed = 900;
  for (const Case& c : cases) {
    expect_float32_matches_reference(random_problem(c, seed), seed + 1, fmt::format("decode Tq={} Tk={}", c.tq, c.tk));
    seed += 2;
  }
}

TEST(AttentionFused, FewQueriesWithMasksBiasAndCausalityMatchReference) {
  // Blocks of ≤ 8 queries of a forward that returns no lse take the keys-along-lanes kernel: each Tq
  // from 1 to 9, Tk under and over one vector of keys and not a multiple of it, Dk and Dv with
  // partial vectors, a bias over keys, a boolean mask and causality, all at once. Forward only: the
  // backward has no such kernel, and its tiny-Tk cases are the other tests'.
  uint64_t seed = 950;
  for (int64_t tq = 1; tq <= 9; ++tq) {
    for (const int64_t tk : {int64_t{3}, int64_t{37}, int64_t{1000}}) {
      for (const bool masked : {false, true}) {
        SCOPED_TRACE(fmt::format("Tq={} Tk={} masked={}", tq, tk, masked));
        Problem p = random_problem({1, 2, tq, tk, 17, 21, masked}, seed);
        if (masked) {
          Rng rng(seed + 1);
          p.bias = random_tensor<double>({1, 2, 1, tk}, rng);
          p.allowed = random_mask({1, 2, tq, tk}, 0.7, seed + 2);
        }
        const testing::NaiveAttention<float> naive = testing::naive_attention<float>(p, random_dout(p, seed + 3));
        const Forward want = reference_forward(p);
        on_every_target([&] {
          const Forward got = run_forward<float>(p, AttentionImpl::fused, false);
          EXPECT_TRUE(all_close("out", got.out, want.out, testing::tolerance_from_naive(naive.out, want.out)));
        });
        seed += 4;
      }
    }
  }
}

TEST(AttentionFused, WideDecodeStepsThroughHiddenVectorsAndBlocks) {
  // Where each key serves four query rows or more (grouped heads, or four queries and more), a step
  // of the few-query kernel's softmax takes four vectors of keys. Hidden keys inside one such step,
  // whole steps hidden, and one row with every key hidden: the reference's out (0 for that row) on
  // every target, Dk and Dv off every vector multiple, and the same bits on one thread and on two.
  struct Shape4 {
    int64_t h, h_kv, tq;
  };
  uint64_t seed = 1000;
  for (const Shape4& s : {Shape4{8, 2, 1}, Shape4{2, 2, 4}, Shape4{4, 1, 3}, Shape4{3, 3, 1}}) {
    SCOPED_TRACE(fmt::format("H={} Hkv={} Tq={}", s.h, s.h_kv, s.tq));
    constexpr int64_t kTk = 1100, kDk = 40, kDv = 24;
    Problem p = random_problem({1, s.h, s.tq, kTk, kDk, kDv}, seed);
    Rng rng(seed + 1);
    p.k = random_tensor<double>({1, s.h_kv, kTk, kDk}, rng);
    p.v = random_tensor<double>({1, s.h_kv, kTk, kDv}, rng);
    p.allowed = Tensor<uint8_t>({1, s.h, s.tq, kTk}, 1);
    for (int64_t h = 0; h < s.h; ++h) {
      for (int64_t i = 0; i < s.tq; ++i) {
        for (int64_t j = 130; j < 139; ++j) p.allowed->view()(0, h, i, j) = 0;
        for (int64_t j = 260; j < 530; ++j) p.allowed->view()(0, h, i, j) = 0;
      }
    }
    for (int64_t j = 0; j < kTk; ++j) p.allowed->view()(0, s.h - 1, 0, j) = 0;
    const testing::NaiveAttention<float> naive = testing::naive_attention<float>(p, random_dout(p, seed + 2));
    const Forward want = reference_forward(p);
    on_every_target([&] {
      const Forward got = run_forward<float>(p, AttentionImpl::fused, false);
      EXPECT_TRUE(all_close("out", got.out, want.out, testing::tolerance_from_naive(naive.out, want.out)));
      for (int64_t c = 0; c < kDv; ++c) EXPECT_EQ(got.out.view()(0, s.h - 1, 0, c), 0.0);
      const WorkersScope one_worker(1);
      EXPECT_TRUE(bit_identical(run_forward<float>(p, AttentionImpl::fused, false).out, got.out));
    });
    seed += 3;
  }
}

TEST(AttentionFused, DecodeRowsSharingKAndVTakeThemRangeByRange) {
  // Each K and V row of a decode step serves every query of every head of its group; more such rows
  // than one pass holds in registers take the keys range by range (a quarter of L2 at a time). Eight
  // heads on one K and V head, two queries each: sixteen rows, ranges inside every chunk of keys on
  // any cache size, and masked keys across a range's end. The reference's out on every target, and
  // the same bits on one thread and on two.
  uint64_t seed = 1050;
  for (const int64_t d : {int64_t{128}, int64_t{40}}) {
    SCOPED_TRACE(fmt::format("D={}", d));
    constexpr int64_t kH = 8, kTq = 2, kTk = 4096;
    Problem p = random_problem({1, kH, kTq, kTk, d, d}, seed);
    Rng rng(seed + 1);
    p.k = random_tensor<double>({1, 1, kTk, d}, rng);
    p.v = random_tensor<double>({1, 1, kTk, d}, rng);
    p.allowed = random_mask({1, kH, kTq, kTk}, 0.8, seed + 2);
    const testing::NaiveAttention<float> naive = testing::naive_attention<float>(p, random_dout(p, seed + 3));
    const Forward want = reference_forward(p);
    on_every_target([&] {
      const Forward got = run_forward<float>(p, AttentionImpl::fused, false);
      EXPECT_TRUE(all_close("out", got.out, want.out, testing::tolerance_from_naive(naive.out, want.out)));
      const WorkersScope one_worker(1);
      EXPECT_TRUE(bit_identical(run_forward<float>(p, AttentionImpl::fused, false).out, got.out));
    });
    seed += 4;
  }
}

TEST(AttentionFused, FewQueriesWithHugeLogitsKeepTheBackwardAccurate) {
  // |q·k| ≈ 10⁴, where an ulp of a score is 10⁻³: the few-query forward sums q·k in another order
  // than the backward, so its scores differ from the backward's by ulps. No forward that returns
  // an lse may take that layout (else P = exp(s − lse) is off by 10⁻³ in the backward), whether the
  // backward runs it itself or is handed its lse.
  uint64_t seed = 990;
  for (const int64_t tq : {int64_t{1}, int64_t{4}, int64_t{8}}) {
    Problem p = random_problem({1, 2, tq, 8, 8, 8}, seed);
    testing::make_logits_huge(p);
    expect_float32_matches_reference(p, seed + 1, fmt::format("huge logits Tq={}", tq));
    seed += 2;
  }
}

TEST(AttentionFused, LargeLogitsAndLargeScaleMatchReference) {
  // q and k of standard deviation 15 at d = 64 put |s| in the hundreds, where an ulp of a score is
  // 3·10⁻⁵ and exp turns it into the relative error of P; scale = 10 does the same through the
  // scale. Forward and backward, with and without a saved lse, decode included, every target. The
  // rule compares maxima, so each case has enough rows (≥ 48) for its maximum to be a statistic
  // rather than the rounding of a handful of scores.
  struct Large {
    Case c;
    double spread;
    std::optional<double> scale;
  };
  const Large cases[] = {
      {{1, 2, 256, 256, 64, 64}, 15.0, std::nullopt}, {{1, 2, 200, 200, 64, 64, true}, 15.0, std::nullopt},
      {{1, 16, 3, 1000, 64, 64}, 15.0, std::nullopt}, {{1, 2, 100, 300, 64, 64}, 1.0, 10.0},
      {{2, 2, 64, 130, 72, 40}, 3.0, 10.0},           {{1, 48, 1, 1100, 128, 128}, 10.0, std::nullopt}};
  uint64_t seed = 980;
  for (const Large& large : cases) {
    Problem p = random_problem(large.c, seed);
    for (int64_t i = 0; i < p.q.numel(); ++i) p.q[i] *= large.spread;
    for (int64_t i = 0; i < p.k.numel(); ++i) p.k[i] *= large.spread;
    p.scale = large.scale;
    expect_float32_matches_reference(
        p, seed + 1,
        fmt::format("Tq={} Tk={} H={} causal={} spread {} scale {}", large.c.tq, large.c.tk, large.c.h, large.c.causal,
                    large.spread, large.scale ? fmt::format("{}", *large.scale) : "1/sqrt(d)"));
    seed += 2;
  }
}

TEST(AttentionFused, DecodeMergesChunksThatSawNoKey) {
  // Tk = 4096 is split into chunks of a few hundred keys. Row 0 sees only the last 10 keys, so
  // every other chunk's partial has lse −inf and must weigh exactly 0; row 1 sees only key 0;
  // row 2 sees nothing at all.
  Problem p = random_problem({1, 2, 4, 4096, 64, 64}, 1000);
  p.allowed = random_mask({1, 2, 4, 4096}, 0.5, 1001);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t j = 0; j < 4096; ++j) {
      p.allowed->view()(0, h, 0, j) = j >= 4086 ? 1 : 0;
      p.allowed->view()(0, h, 1, j) = j == 0 ? 1 : 0;
      p.allowed->view()(0, h, 2, j) = 0;
    }
  expect_float32_matches_reference(p, 1002, "decode with empty chunks");
  on_every_target([&] {
    const Forward f = run_forward<float>(p, AttentionImpl::fused);
    EXPECT_EQ(f.lse.view()(0, 1, 2), -kInf);
    EXPECT_TRUE(all_finite(f.out));
    // Key 0 alone: out is v_0 (up to the rounding of P = 1).
    for (int64_t d = 0; d < 64; ++d) {
      EXPECT_NEAR(f.out.view()(0, 1, 1, d), static_cast<double>(static_cast<float>(p.v.view()(0, 1, 0, d))),
                  4 * std::numeric_limits<float>::epsilon());
    }
  });
}

// --- layouts ---------------------------------------------------------------------------------------

TEST(AttentionFused, StridedViewsIntoPackedQkvBuffer) {
  on_every_target([] {
    // x [B, T, 3·H·D], as a fused QKV projection writes it; q, k, v are views [B, H, T, D] into it.
    const int64_t B = 2, T = 77, H = 3, D = 24;
    Rng rng(1100);
    const Tensor<float> qkv = random_tensor<float>({B, T, 3 * H * D}, rng);
    auto view = [&](int64_t part) {
      return TensorView<const float>{qkv.data() + part * H * D, Shape{B, H, T, D},
                                     Strides{T * 3 * H * D, D, 3 * H * D, 1}};
    };
    Problem p;
    p.q = to_tensor<double, float>(view(0));
    p.k = to_tensor<double, float>(view(1));
    p.v = to_tensor<double, float>(view(2));
    p.causal = true;
    const Forward want = reference_forward(p);
    const Tensor<double> dout = random_dout(p, 1101);
    const Grads gwant = reference_backward(p, dout);
    const testing::NaiveAttention<float> nf = testing::naive_attention<float>(p, dout);

    AttentionParams<float> params{.q = view(0), .k = view(1), .v = view(2), .scale = {}, .mask = {}};
    params.mask.causal = true;
    Tensor<float> out({B, H, T, D}), lse({B, H, T});
    attention_forward_fused(params, {.out = out.view(), .weights = {}, .lse = lse.view()});
    EXPECT_TRUE(all_close("out", cast<double>(out), want.out, testing::tolerance_from_naive(nf.out, want.out)));

    // Gradients into strided views of a [B, T, 3·H·D] buffer too; dout with a non-unit last stride.
    Tensor<float> dqkv({B, T, 3 * H * D});
    auto grad_view = [&](int64_t part) {
      return TensorView<float>{dqkv.data() + part * H * D, Shape{B, H, T, D}, Strides{T * 3 * H * D, D, 3 * H * D, 1}};
    };
    Tensor<float> dout_wide({B, H, T, 2 * D});
    for (int64_t i = 0; i < dout.numel(); ++i) dout_wide[2 * i] = static_cast<float>(dout[i]);
    const TensorView<const float> dout_strided{dout_wide.data(), Shape{B, H, T, D},
                                               Strides{H * T * 2 * D, T * 2 * D, 2 * D, 2}};
    attention_backward_fused<float>(params, dout_strided,
                                    {.dq = grad_view(0), .dk = grad_view(1), .dv = grad_view(2), .dbias = {}},
                                    AttentionSaved<float>{.out = out.cview(), .lse = lse.cview()});
    EXPECT_TRUE(all_close("dq", to_tensor<double, float>(grad_view(0)), gwant.dq,
                          testing::tolerance_from_naive(nf.dq, gwant.dq)));
    EXPECT_TRUE(all_close("dk", to_tensor<double, float>(grad_view(1)), gwant.dk,
                          testing::tolerance_from_naive(nf.dk, gwant.dk)));
    EXPECT_TRUE(all_close("dv", to_tensor<double, float>(grad_view(2)), gwant.dv,
                          testing::tolerance_from_naive(nf.dv, gwant.dv)));
  });
}

TEST(AttentionFused, FewQueriesGiveTheSameBitsWhereverQKAndVLie) {
  // The few-query kernel puts rows that start off a vector boundary together from aligned loads,
  // and on targets whose vectors are whole lines reads rows that start on one with a request for
  // the next line; rows that share K and V copy queries that start off a vector to aligned rows.
  // Q, K and V copied to every float offset of a 64-byte line must give the bits of the aligned
  // copies: depths that fill whole vectors on each target (128, 48, 24, 16), ones whose rows start
  // at different offsets (17, 20), Dk ≠ Dv, grouped heads, several queries, Tk not a multiple of
  // any vector.
  struct Shape4 {
    int64_t h, h_kv, tq, tk, dk, dv;
  };
  const Shape4 shapes[] = {{2, 2, 1, 301, 128, 128},
                           {4, 2, 3, 150, 48, 16},
                           {2, 1, 8, 77, 24, 24},
                           {1, 1, 2, 45, 17, 20},
                           // Long enough for decode's split of the keys, where rows share K and V.
                           {8, 2, 1, 1100, 128, 128},
                           {2, 1, 3, 1030, 20, 24}};
  constexpr int64_t kLine = 64 / sizeof(float);
  Rng rng(1150);
  for (const Shape4& s : shapes) {
    SCOPED_TRACE(fmt::format("H={} Hkv={} Tq={} Tk={} Dk={} Dv={}", s.h, s.h_kv, s.tq, s.tk, s.dk, s.dv));
    const Tensor<float> q = random_tensor<float>({1, s.h, s.tq, s.dk}, rng);
    const Tensor<float> k = random_tensor<float>({1, s.h_kv, s.tk, s.dk}, rng);
    const Tensor<float> v = random_tensor<float>({1, s.h_kv, s.tk, s.dv}, rng);
    // Room for every offset, starting on a line.
    std::vector<float> q_room(static_cast<size_t>(q.numel() + 2 * kLine));
    std::vector<float> k_room(static_cast<size_t>(k.numel() + 2 * kLine));
    std::vector<float> v_room(static_cast<size_t>(v.numel() + 2 * kLine));
    const auto copy_at = [&](const Tensor<float>& x, std::vector<float>& room, int64_t offset) {
      const auto misalignment = reinterpret_cast<uintptr_t>(room.data()) % 64 / sizeof(float);
      float* at = room.data() + (misalignment == 0 ? 0 : kLine - static_cast<int64_t>(misalignment)) + offset;
      std::copy(x.values().begin(), x.values().end(), at);
      return make_view<const float>(at, x.shape());
    };
    const auto attend = [&](int64_t offset) {
      const AttentionParams<float> params{.q = copy_at(q, q_room, offset),
                                          .k = copy_at(k, k_room, offset),
                                          .v = copy_at(v, v_room, offset),
                                          .scale = {},
                                          .mask = {}};
      Tensor<float> out({1, s.h, s.tq, s.dv});
      attention_forward_fused(params, {.out = out.view(), .weights = {}, .lse = {}});
      return cast<double>(out);
    };
    on_every_target([&] {
      const Tensor<double> aligned = attend(0);
      for (int64_t offset = 1; offset < kLine; ++offset) {
        EXPECT_TRUE(bit_identical(attend(offset), aligned)) << "Q, K and V " << offset << " floats past a line";
      }
    });
  }
}

TEST(AttentionFused, RankTwoAndThreeInputs) {
  on_every_target([] {
    Rng rng(1200);
    const Tensor<float> q = random_tensor<float>({3, 19, 8}, rng), k = random_tensor<float>({3, 23, 8}, rng),
                        v = random_tensor<float>({3, 23, 5}, rng);
    Tensor<float> out_fused({3, 19, 5}), out_ref({3, 19, 5});
    const AttentionParams<float> params{.q = q.view(), .k = k.view(), .v = v.view(), .scale = {}, .mask = {}};
    attention_forward_fused(params, {.out = out_fused.view(), .weights = {}, .lse = {}});
    attention_forward_reference(params, {.out = out_ref.view(), .weights = {}, .lse = {}});
    EXPECT_TRUE(all_close("out", out_fused, out_ref, 64 * std::numeric_limits<float>::epsilon()));
  });
}

TEST(AttentionFused, BackwardAccumulatesIntoGradients) {
  on_every_target([] {
    const Problem p = random_problem({1, 1, 20, 30, 8, 8}, 1400);
    const Operands<float> ops(p);
    const Tensor<float> dout = cast<float>(random_dout(p, 1401));
    Tensor<float> dq(p.q.shape(), 1.0f), dk(p.k.shape(), 2.0f), dv(p.v.shape(), 3.0f);
    Tensor<float> dq0(p.q.shape()), dk0(p.k.shape()), dv0(p.v.shape());
    attention_backward_fused(ops.params(), dout.view(),
                             {.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}});
    attention_backward_fused(ops.params(), dout.view(),
                             {.dq = dq0.view(), .dk = dk0.view(), .dv = dv0.view(), .dbias = {}});
    // The same sum up to where the rounding of each addition falls: an ulp or two of the result.
    auto expect_added = [](const Tensor<float>& with, const Tensor<float>& without, float start) {
      for (int64_t i = 0; i < with.numel(); ++i) {
        EXPECT_NEAR(with[i], start + without[i],
                    2 * std::numeric_limits<float>::epsilon() * (start + std::abs(without[i])));
      }
    };
    expect_added(dq, dq0, 1.0f);
    expect_added(dk, dk0, 2.0f);
    expect_added(dv, dv0, 3.0f);
  });
}

// --- float64, gradients ---------------------------------------------------------------------------

TEST(AttentionFused, Float64MatchesReferenceClosely) {
  on_every_target([] {
    Problem p = random_problem({2, 2, 113, 70, 17, 33, true}, 1500);
    Rng rng(1501);
    p.bias = random_tensor<double>({2, 1, 113, 70}, rng);
    p.allowed = random_mask({113, 70}, 0.8, 1502);
    const Tensor<double> dout = random_dout(p, 1503);
    // Both accumulate in float64; the difference is the order of sums over Tk and d terms.
    const double tol = 64 * std::numeric_limits<double>::epsilon() * static_cast<double>(70 + 33);
    const Forward want = reference_forward(p), got = run_forward<double>(p, AttentionImpl::fused);
    EXPECT_TRUE(all_close("out", got.out, want.out, tol));
    EXPECT_TRUE(all_close("lse", got.lse, want.lse, tol));
    const Grads gw = reference_backward(p, dout), gg = run_backward<double>(p, dout, AttentionImpl::fused);
    EXPECT_TRUE(all_close("dq", gg.dq, gw.dq, tol));
    EXPECT_TRUE(all_close("dk", gg.dk, gw.dk, tol));
    EXPECT_TRUE(all_close("dv", gg.dv, gw.dv, tol));
    EXPECT_TRUE(all_close("dbias", gg.dbias, gw.dbias, tol));
  });
}

TEST(AttentionFused, GradientsMatchFiniteDifferences) {
  on_every_target([] {
    // L = <dO, out> in float64, central differences with h = 1e-6: accurate to ≈ 1e-10 here.
    constexpr double kGradTolerance = 1e-7;
    Problem p = random_problem({1, 2, 5, 6, 3, 2, true}, 1600);
    Rng rng(1601);
    p.bias = random_tensor<double>({1, 2, 1, 6}, rng);
    const Tensor<double> dout = random_dout(p, 1602);
    const Grads g = run_backward<double>(p, dout, AttentionImpl::fused, false);
    auto loss = [&] { return testing::dot(run_forward<double>(p, AttentionImpl::fused).out, dout); };
    EXPECT_TRUE(all_close("dq", g.dq, testing::numeric_gradient(loss, p.q), kGradTolerance));
    EXPECT_TRUE(all_close("dk", g.dk, testing::numeric_gradient(loss, p.k), kGradTolerance));
    EXPECT_TRUE(all_close("dv", g.dv, testing::numeric_gradient(loss, p.v), kGradTolerance));
    EXPECT_TRUE(all_close("dbias", g.dbias, testing::numeric_gradient(loss, *p.bias), kGradTolerance));
  });
}

// --- determinism ---------------------------------------------------------------------------------

TEST(AttentionFused, GradientsBitIdenticalOnOneAndTwoThreads) {
  on_every_target([] {
    // One head: one thread runs the one-pass schedule, two threads the two-pass one. Three heads
    // (one pass on one thread, two passes on two), a bias shared by heads (dbias owned by head
    // groups) and one shared by queries (dbias summed over query blocks in a task) cover the other
    // task partitions.
    struct Variant {
      Case c;
      std::optional<Shape> bias;
    };
    const Variant variants[] = {{{1, 1, 300, 257, 64, 64, true}, std::nullopt},
                                {{1, 3, 130, 200, 17, 40, false}, Shape{1, 3, 130, 200}},
                                {{2, 2, 150, 129, 32, 32, true}, Shape{150, 129}},
                                {{1, 1, 150, 300, 16, 16, false}, Shape{1, 1, 1, 300}},
                                {{1, 1, 70, 130, 16, 8, false}, Shape{1}}};
    uint64_t seed = 1700;
    for (const Variant& variant : variants) {
      Problem p = random_problem(variant.c, seed);
      if (variant.bias) {
        Rng rng(seed + 1);
        p.bias = random_tensor<double>(*variant.bias, rng);
      }
      const Tensor<double> dout = random_dout(p, seed + 2);
      Grads one, two;
      {
        const WorkersScope workers(1);
        one = run_backward<float>(p, dout, AttentionImpl::fused);
      }
      {
        const WorkersScope workers(2);
        two = run_backward<float>(p, dout, AttentionImpl::fused);
      }
      SCOPED_TRACE(fmt::format("H={} Tq={} Tk={} bias {}", variant.c.h, variant.c.tq, variant.c.tk,
                               variant.bias ? variant.bias->str() : "none"));
      EXPECT_TRUE(bit_identical(one.dq, two.dq));
      EXPECT_TRUE(bit_identical(one.dk, two.dk));
      EXPECT_TRUE(bit_identical(one.dv, two.dv));
      EXPECT_TRUE(bit_identical(one.dbias, two.dbias));
      seed += 3;
    }
  });
}

// --- every SIMD target ---------------------------------------------------------------------------

TEST(AttentionFused, EveryCompiledTargetMatchesReference) {
  const std::vector<std::string> targets = simd_targets();
  ASSERT_FALSE(targets.empty());
  Problem p = random_problem({1, 2, 70, 150, 72, 17, true}, 1800);
  Rng rng(1801);
  p.bias = random_tensor<double>({1, 2, 70, 1}, rng);
  p.allowed = random_mask({70, 150}, 0.8, 1802);
  Problem decode = random_problem({1, 1, 2, 1100, 64, 64, false}, 1803);
  expect_float32_matches_reference(p, 1804, "mask, bias and causality");
  expect_float32_matches_reference(decode, 1805, "decode");
  for (const std::string& target : targets) {
    const testing::SimdTargetScope scope(target);
    EXPECT_EQ(simd_target(), target);
    // The schedules must agree bit for bit on every target, not only the best.
    const Tensor<double> dout = random_dout(p, 1806);
    Grads one, two;
    {
      const WorkersScope workers(1);
      one = run_backward<float>(p, dout, AttentionImpl::fused);
    }
    {
      const WorkersScope workers(2);
      two = run_backward<float>(p, dout, AttentionImpl::fused);
    }
    EXPECT_TRUE(bit_identical(one.dq, two.dq) && bit_identical(one.dk, two.dk) && bit_identical(one.dv, two.dv) &&
                bit_identical(one.dbias, two.dbias))
        << "target " << target;
  }
}

// --- dispatch and refusals -------------------------------------------------------------------------

TEST(AttentionFused, AutomaticFallsBackToReferenceForWeights) {
  const Problem p = random_problem({1, 1, 9, 11, 4, 4}, 1900);
  const Operands<float> ops(p);
  Tensor<float> out({1, 1, 9, 4}), weights({1, 1, 9, 11});
  attention_forward(ops.params(), {.out = out.view(), .weights = weights.view(), .lse = {}}, AttentionImpl::automatic);
  float row_sum = 0;
  for (int64_t j = 0; j < 11; ++j) row_sum += weights.view()(0, 0, 0, j);
  EXPECT_NEAR(row_sum, 1.0f, 16 * std::numeric_limits<float>::epsilon());
  EXPECT_THROW(
      attention_forward(ops.params(), {.out = out.view(), .weights = weights.view(), .lse = {}}, AttentionImpl::fused),
      ValueError);
}

TEST(AttentionFused, RefusesBadShapesLikeTheReference) {
  const Problem p = random_problem({1, 1, 9, 11, 4, 4}, 2000);
  const Operands<float> ops(p);
  Tensor<float> out({1, 1, 9, 5});
  EXPECT_THROW(attention_forward_fused(ops.params(), {.out = out.view(), .weights = {}, .lse = {}}), ShapeError);
  Tensor<float> good({1, 1, 9, 4});
  AttentionParams<float> strided = ops.params();
  strided.q.strides[3] = 2;
  EXPECT_THROW(attention_forward_fused(strided, {.out = good.view(), .weights = {}, .lse = {}}), ShapeError);
  Tensor<float> dq(p.q.shape()), dk(p.k.shape()), dv(p.v.shape()), dbias({9, 11});
  EXPECT_THROW(attention_backward_fused(ops.params(), good.cview(),
                                        {.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = dbias.view()}),
               ShapeError);
}

}  // namespace
}  // namespace qkv
