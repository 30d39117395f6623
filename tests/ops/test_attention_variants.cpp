// Tests of the attention variants (include/qkv/ops/attention.hpp): grouped-query heads, the window
// and the causal alignment, the softcap, ALiBi and sinks, alone and combined. The reference is held
// to an independent float64 implementation of the formula (support/attention_problems.hpp), the
// fused kernel on every SIMD target to the reference by the tolerance rule; float64 gradients
// against finite differences; bit-identity across thread counts; the edge cases and the refusals.

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/ops/additive_attention.hpp"
#include "qkv/ops/attention.hpp"
#include "support/attention_problems.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::all_finite;
using testing::bit_identical;
using testing::expect_float32_matches_reference;
using testing::Grads;
using testing::on_every_target;
using testing::random_dout;
using testing::random_mask;
using testing::random_tensor;
using testing::reference_backward;
using testing::reference_forward;
using testing::run_backward;
using testing::run_forward;
using testing::WorkersScope;
using Problem = testing::AttentionProblem;

// The sizes and options of one variant problem: q [B, H, Tq, Dk], k and v with Hkv heads.
struct Variant {
  std::string name = "";
  int64_t b = 1, h = 2, hkv = 2, tq = 9, tk = 11, dk = 8, dv = 5;
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::bottom_right;
  std::optional<AttentionWindow> window = std::nullopt;
  std::optional<double> softcap = std::nullopt;
  bool alibi = false;
  bool sinks = false;
  bool bias = false;
  // The bias's shape when it is broadcast; rank 0: [B, H, Tq, Tk].
  Shape bias_shape = {};
  bool mask = false;
};

Problem make_problem(const Variant& c, uint64_t seed, double stddev = 1.0) {
  Rng rng(seed);
  Problem p;
  p.q = random_tensor<double>({c.b, c.h, c.tq, c.dk}, rng, stddev);
  p.k = random_tensor<double>({c.b, c.hkv, c.tk, c.dk}, rng, stddev);
  p.v = random_tensor<double>({c.b, c.hkv, c.tk, c.dv}, rng);
  p.causal = c.causal;
  p.alignment = c.alignment;
  p.window = c.window;
  p.softcap = c.softcap;
  if (c.alibi) {
    const std::vector<double> slopes = alibi_slopes(c.h);
    Tensor<double> t({c.h});
    for (int64_t h = 0; h < c.h; ++h) t[h] = slopes[static_cast<size_t>(h)];
    p.alibi = t;
  }
  if (c.sinks) p.sinks = random_tensor<double>({c.h}, rng);
  if (c.bias)
    p.bias = random_tensor<double>(c.bias_shape.rank() == 0 ? Shape{c.b, c.h, c.tq, c.tk} : c.bias_shape, rng);
  if (c.mask) p.allowed = random_mask({1, c.h, c.tq, c.tk}, 0.8, seed + 7);
  return p;
}

// Each feature alone, pairs of them, and all of them in one call, on sizes off every tile
// multiple (and several blocks of queries and keys where the window and the band matter).
std::vector<Variant> variants() {
  const AttentionWindow narrow{.left = 5, .right = 2};
  return {
      {.name = "gqa g=2", .h = 4, .hkv = 2},
      {.name = "gqa g=3", .h = 6, .hkv = 2, .tq = 13, .tk = 17},
      {.name = "mqa", .h = 5, .hkv = 1, .causal = true},
      {.name = "window", .tq = 70, .tk = 140, .window = narrow},
      {.name = "window causal",
       .tq = 130,
       .tk = 130,
       .causal = true,
       .window = AttentionWindow{.left = 40, .right = -1}},
      {.name = "window left only", .tq = 67, .tk = 131, .window = AttentionWindow{.left = 3, .right = -1}},
      {.name = "window right only", .tq = 67, .tk = 131, .window = AttentionWindow{.left = -1, .right = 3}},
      {.name = "top-left causal Tq<Tk", .tq = 7, .tk = 19, .causal = true, .alignment = CausalAlignment::top_left},
      {.name = "top-left causal Tq>Tk", .tq = 19, .tk = 7, .causal = true, .alignment = CausalAlignment::top_left},
      {.name = "top-left window", .tq = 70, .tk = 100, .alignment = CausalAlignment::top_left, .window = narrow},
      {.name = "softcap", .softcap = 2.0},
      {.name = "softcap with bias", .softcap = 1.5, .bias = true},
      {.name = "alibi", .h = 3, .hkv = 3, .tq = 70, .tk = 90, .alibi = true},
      {.name = "alibi causal top-left",
       .h = 4,
       .hkv = 4,
       .causal = true,
       .alignment = CausalAlignment::top_left,
       .alibi = true},
      {.name = "sinks", .sinks = true},
      {.name = "sinks causal mask", .tq = 20, .tk = 20, .causal = true, .sinks = true, .mask = true},
      // The sink does not move with a shift of the row, so a bias broadcast over the keys has a gradient.
      {.name = "sinks with a bias per query",
       .h = 3,
       .hkv = 3,
       .tq = 21,
       .sinks = true,
       .bias = true,
       .bias_shape = {1, 1, 21, 1}},
      {.name = "everything",
       .b = 2,
       .h = 6,
       .hkv = 2,
       .tq = 75,
       .tk = 140,
       .causal = true,
       .window = AttentionWindow{.left = 30, .right = -1},
       .softcap = 3.0,
       .alibi = true,
       .sinks = true,
       .bias = true,
       .mask = true},
      {.name = "decode everything",
       .h = 4,
       .hkv = 1,
       .tq = 1,
       .tk = 1100,
       .causal = true,
       .window = AttentionWindow{.left = 700, .right = 0},
       .softcap = 5.0,
       .alibi = true,
       .sinks = true},
      // Windows narrower than a block of keys: the band starts the last chunk's keys off a block's
      // end, in a range shorter than a block, for the heads of a group read together.
      {.name = "decode narrow window gqa",
       .h = 4,
       .hkv = 1,
       .tq = 1,
       .tk = 1100,
       .causal = true,
       .window = AttentionWindow{.left = 10, .right = 0}},
      {.name = "decode narrow window two queries",
       .h = 2,
       .hkv = 1,
       .tq = 2,
       .tk = 1100,
       .causal = true,
       .window = AttentionWindow{.left = 3, .right = 0}},
  };
}

// Forward and gradients of float64 runs within 1e-12 (out, lse) and 1e-11 (gradients) of `want`.
void expect_float64_close(const Problem& p, const testing::Forward& got, const Grads& g, const testing::Forward& want,
                          const Grads& gw) {
  EXPECT_TRUE(all_close("out", got.out, want.out, 1e-12));
  EXPECT_TRUE(all_close("lse", got.lse, want.lse, 1e-12));
  EXPECT_TRUE(all_close("dq", g.dq, gw.dq, 1e-11));
  EXPECT_TRUE(all_close("dk", g.dk, gw.dk, 1e-11));
  EXPECT_TRUE(all_close("dv", g.dv, gw.dv, 1e-11));
  if (p.bias) {
    EXPECT_TRUE(all_close("dbias", g.dbias, gw.dbias, 1e-11));
  }
  if (p.sinks) {
    EXPECT_TRUE(all_close("dsinks", g.dsinks, gw.dsinks, 1e-11));
  }
}

// The reference in float64 against the formula computed as it reads (naive_attention).
void expect_reference_matches_formula(const Problem& p, uint64_t seed) {
  const Tensor<double> dout = random_dout(p, seed);
  const testing::NaiveAttention<double> n = testing::naive_attention<double>(p, dout);
  expect_float64_close(p, reference_forward(p), reference_backward(p, dout), {n.out, n.lse},
                       {n.dq, n.dk, n.dv, n.dbias, n.dsinks});
}

// L = <dO, out> in float64, central differences with h = 1e-6 (accurate to ≈ 1e-10 here), for
// every gradient the problem has, from `impl`.
void expect_gradients_match_finite_differences(Problem p, uint64_t seed, AttentionImpl impl) {
  SCOPED_TRACE(impl == AttentionImpl::fused ? "fused" : "reference");
  constexpr double kGradTolerance = 1e-7;
  const Tensor<double> dout = random_dout(p, seed);
  const Grads g = run_backward<double>(p, dout, impl, false);
  auto loss = [&] { return testing::dot(run_forward<double>(p, impl).out, dout); };
  EXPECT_TRUE(all_close("dq", g.dq, testing::numeric_gradient(loss, p.q), kGradTolerance));
  EXPECT_TRUE(all_close("dk", g.dk, testing::numeric_gradient(loss, p.k), kGradTolerance));
  EXPECT_TRUE(all_close("dv", g.dv, testing::numeric_gradient(loss, p.v), kGradTolerance));
  if (p.bias) {
    EXPECT_TRUE(all_close("dbias", g.dbias, testing::numeric_gradient(loss, *p.bias), kGradTolerance));
  }
  if (p.sinks) {
    EXPECT_TRUE(all_close("dsinks", g.dsinks, testing::numeric_gradient(loss, *p.sinks), kGradTolerance));
  }
}

// --- the reference against the formula -----------------------------------------------------------

TEST(AttentionVariants, ReferenceMatchesTheFormulaInFloat64) {
  uint64_t seed = 100;
  for (const Variant& c : variants()) {
    SCOPED_TRACE(c.name);
    expect_reference_matches_formula(make_problem(c, seed), seed + 1);
    seed += 2;
  }
}

// --- the fused kernel against the reference ----------------------------------------------------

TEST(AttentionVariants, FusedFloat32WithinTwiceTheNaiveError) {
  uint64_t seed = 300;
  for (const Variant& c : variants()) {
    expect_float32_matches_reference(make_problem(c, seed), seed + 1, c.name);
    seed += 2;
  }
}

TEST(AttentionVariants, FusedFloat32WithLargeLogits) {
  // Scores in the hundreds: the softcap bounds them, ALiBi and the window shift and cut them.
  uint64_t seed = 400;
  for (Variant c : {Variant{.name = "gqa", .h = 4, .hkv = 1, .tq = 40, .tk = 70, .dk = 64, .dv = 16},
                    Variant{.name = "softcap", .tq = 40, .tk = 70, .dk = 64, .dv = 16, .softcap = 30.0},
                    Variant{.name = "window alibi sinks",
                    .tq = 70,
                    .tk = 70,
                    .dk = 64,
                    .dv = 16,
                    .causal = true,
                    .window = AttentionWindow{.left = 20, .right = 0},
                    .alibi = true,
                    .sinks = true}}) {
    expect_float32_matches_reference(make_problem(c, seed, 3.0), seed + 1, c.name + " (q, k of stddev 3)");
    seed += 2;
  }
}

TEST(AttentionVariants, SoftcapGradientsSurviveOnTanhsFlatTail) {
  // Every x / c between 6.75 and 14, where the cap's slope sech² is 5·10⁻⁵ to 3·10⁻¹², so dQ and dK
  // are that small too. In float32, 1 − tanh² is a multiple of 6·10⁻⁸ there, and 0 once tanh rounds
  // to ±1 (from |x / c| ≈ 9, the first two rows' smallest): a slope so computed leaves their dQ at 0
  // or off by its whole size. The kernel's slope keeps its relative precision, so its gradients stay
  // within 10⁻⁴ of the largest.
  Problem p;
  p.q = Tensor<double>({1, 1, 3, 1}, {1.0, -1.0, 0.75});
  p.k = Tensor<double>({1, 1, 5, 1}, {9.0, 10.0, 11.5, 13.0, 14.0});
  Rng rng(860);
  p.v = random_tensor<double>({1, 1, 5, 4}, rng);
  p.scale = 1.0;
  p.softcap = 1.0;
  const Tensor<double> dout = random_dout(p, 861);
  const Grads want = reference_backward(p, dout);
  on_every_target([&] {
    for (const bool saved : {false, true}) {
      SCOPED_TRACE(saved ? "with the saved lse" : "recomputing the forward");
      const Grads got = run_backward<float>(p, dout, AttentionImpl::fused, saved);
      EXPECT_TRUE(all_close("dq", got.dq, want.dq, 1e-4 * testing::max_abs(want.dq)));
      EXPECT_TRUE(all_close("dk", got.dk, want.dk, 1e-4 * testing::max_abs(want.dk)));
    }
  });
}

TEST(AttentionVariants, FusedFloat64MatchesReferenceClosely) {
  uint64_t seed = 500;
  for (const Variant& c : variants()) {
    SCOPED_TRACE(c.name);
    const Problem p = make_problem(c, seed++);
    const Tensor<double> dout = random_dout(p, seed++);
    const testing::Forward want = reference_forward(p);
    const Grads gw = reference_backward(p, dout);
    on_every_target([&] {
      expect_float64_close(p, run_forward<double>(p, AttentionImpl::fused),
                           run_backward<double>(p, dout, AttentionImpl::fused), want, gw);
    });
  }
}

// --- gradients ---------------------------------------------------------------------------------

TEST(AttentionVariants, GradientsMatchFiniteDifferences) {
  // The softcap and sinks have gradients of their own; through ALiBi, the window and the grouping
  // the gradients of q, k and v change, and dk, dv sum over each group.
  const Variant cases[] = {
      {.name = "softcap bias", .h = 2, .hkv = 1, .tq = 5, .tk = 6, .dk = 3, .dv = 2, .softcap = 0.7, .bias = true},
      {.name = "sinks", .h = 2, .hkv = 2, .tq = 5, .tk = 6, .dk = 3, .dv = 2, .causal = true, .sinks = true},
      {.name = "sinks with a bias per query and head",
       .h = 2,
       .hkv = 2,
       .tq = 5,
       .tk = 6,
       .dk = 3,
       .dv = 2,
       .sinks = true,
       .bias = true,
       .bias_shape = {1, 2, 5, 1}},
      {.name = "alibi window gqa",
       .h = 3,
       .hkv = 1,
       .tq = 6,
       .tk = 8,
       .dk = 3,
       .dv = 2,
       .window = AttentionWindow{.left = 2, .right = 1},
       .alibi = true},
  };
  uint64_t seed = 600;
  for (const Variant& c : cases) {
    SCOPED_TRACE(c.name);
    for (const AttentionImpl impl : {AttentionImpl::reference, AttentionImpl::fused}) {
      expect_gradients_match_finite_differences(make_problem(c, seed), seed + 1, impl);
    }
    seed += 2;
  }
}

TEST(AttentionVariants, GradientsBitIdenticalOnOneAndTwoThreads) {
  // Grouped heads add to the same dk, dv rows: one task runs each group, in head order, whether
  // the schedule is one pass (one thread) or two (two threads, few groups).
  const Variant cases[] = {
      {.name = "mqa window",
       .h = 4,
       .hkv = 1,
       .tq = 150,
       .tk = 200,
       .dk = 32,
       .dv = 16,
       .window = AttentionWindow{.left = 64, .right = 8}},
      {.name = "gqa softcap sinks alibi",
       .b = 2,
       .h = 6,
       .hkv = 3,
       .tq = 130,
       .tk = 129,
       .dk = 16,
       .dv = 16,
       .causal = true,
       .softcap = 4.0,
       .alibi = true,
       .sinks = true,
       .bias = true},
  };
  uint64_t seed = 700;
  on_every_target([&] {
    for (const Variant& c : cases) {
      SCOPED_TRACE(c.name);
      const Problem p = make_problem(c, seed);
      const Tensor<double> dout = random_dout(p, seed + 1);
      Grads one, two;
      testing::Forward f1, f2;
      {
        const WorkersScope workers(1);
        f1 = run_forward<float>(p, AttentionImpl::fused);
        one = run_backward<float>(p, dout, AttentionImpl::fused);
      }
      {
        const WorkersScope workers(2);
        f2 = run_forward<float>(p, AttentionImpl::fused);
        two = run_backward<float>(p, dout, AttentionImpl::fused);
      }
      EXPECT_TRUE(bit_identical(f1.out, f2.out));
      EXPECT_TRUE(bit_identical(one.dq, two.dq));
      EXPECT_TRUE(bit_identical(one.dk, two.dk));
      EXPECT_TRUE(bit_identical(one.dv, two.dv));
      EXPECT_TRUE(bit_identical(one.dbias, two.dbias));
      EXPECT_TRUE(bit_identical(one.dsinks, two.dsinks));
      seed += 2;
    }
  });
}

// --- edge cases -------------------------------------------------------------------------------

TEST(AttentionVariants, WindowZeroSeesOnlyTheDiagonalKey) {
  for (const CausalAlignment alignment : {CausalAlignment::bottom_right, CausalAlignment::top_left}) {
    const Variant c{.tq = 70, .tk = 75, .alignment = alignment, .window = AttentionWindow{.left = 0, .right = 0}};
    const Problem p = make_problem(c, 800);
    const int64_t offset = alignment == CausalAlignment::bottom_right ? c.tk - c.tq : 0;
    for (const AttentionImpl impl : {AttentionImpl::reference, AttentionImpl::fused}) {
      const testing::Forward f = run_forward<double>(p, impl);
      for (int64_t h = 0; h < c.h; ++h) {
        for (int64_t i = 0; i < c.tq; ++i) {
          for (int64_t d = 0; d < c.dv; ++d) {
            ASSERT_DOUBLE_EQ(f.out.view()(0, h, i, d), p.v.view()(0, h, i + offset, d)) << "query " << i;
          }
        }
      }
    }
  }
}

TEST(AttentionVariants, WindowWiderThanTheSequenceChangesNothing) {
  Variant wide{.tq = 67, .tk = 131, .causal = true, .window = AttentionWindow{.left = 1000, .right = 1000}};
  Variant plain = wide;
  plain.window = std::nullopt;
  const Problem pw = make_problem(wide, 810), pp = make_problem(plain, 810);
  on_every_target([&] {
    EXPECT_TRUE(bit_identical(run_forward<float>(pw, AttentionImpl::fused).out,
                              run_forward<float>(pp, AttentionImpl::fused).out));
  });
}

TEST(AttentionVariants, RowsThatTheWindowAndMaskEmptyGiveZeroAndNoNaN) {
  // Window (1, 0): query i sees keys i + o − 1 and i + o; the mask forbids both for even queries.
  Variant c{.tq = 70, .tk = 70, .window = AttentionWindow{.left = 1, .right = 0}};
  Problem p = make_problem(c, 820);
  Tensor<uint8_t> allowed({c.tq, c.tk});
  for (int64_t i = 0; i < c.tq; ++i) {
    for (int64_t j = 0; j < c.tk; ++j) allowed.view()(i, j) = (i % 2 == 0) ? 0 : 1;
  }
  p.allowed = allowed;
  const Tensor<double> dout = random_dout(p, 821);
  for (const bool sinks : {false, true}) {
    SCOPED_TRACE(sinks ? "with sinks" : "without sinks");
    if (sinks) {
      Rng rng(822);
      p.sinks = random_tensor<double>({c.h}, rng);
    }
    on_every_target([&] {
      for (const AttentionImpl impl : {AttentionImpl::reference, AttentionImpl::fused}) {
        const testing::Forward f = run_forward<float>(p, impl);
        const Grads g = run_backward<float>(p, dout, impl);
        EXPECT_TRUE(all_finite(f.out) && all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv));
        for (int64_t h = 0; h < c.h; ++h) {
          for (int64_t i = 0; i < c.tq; i += 2) {
            for (int64_t d = 0; d < c.dv; ++d) EXPECT_EQ(f.out.view()(0, h, i, d), 0.0);
            for (int64_t d = 0; d < c.dk; ++d) EXPECT_EQ(g.dq.view()(0, h, i, d), 0.0);
            // Without a sink the empty row has no distribution (lse −inf); with one, only the sink.
            const double sink = sinks ? static_cast<double>(static_cast<float>((*p.sinks)[h]))
                                      : -std::numeric_limits<double>::infinity();
            EXPECT_EQ(f.lse.view()(0, h, i), sink);
          }
        }
        if (sinks) {
          EXPECT_TRUE(all_finite(g.dsinks));
        }
      }
    });
  }
}

TEST(AttentionVariants, TinySizesMatchReference) {
  uint64_t seed = 830;
  for (const Variant& c : {Variant{.name = "T=1 d=1",
                          .h = 3,
                          .hkv = 1,
                          .tq = 1,
                          .tk = 1,
                          .dk = 1,
                          .dv = 1,
                          .softcap = 1.0,
                          .alibi = true,
                          .sinks = true},
                           Variant{.name = "Tq=1 window",
                           .tq = 1,
                           .tk = 9,
                           .dk = 1,
                           .dv = 2,
                           .window = AttentionWindow{.left = 2, .right = 0}},
                           Variant{.name = "no keys sinks", .tq = 3, .tk = 0, .sinks = true}}) {
    expect_float32_matches_reference(make_problem(c, seed), seed + 1, c.name);
    seed += 2;
  }
}

TEST(AttentionVariants, AlibiSlopesAreTheStandardOnes) {
  const std::vector<double> eight = alibi_slopes(8);
  ASSERT_EQ(eight.size(), 8U);
  for (size_t h = 0; h < 8; ++h) EXPECT_DOUBLE_EQ(eight[h], std::exp2(-static_cast<double>(h + 1)));
  // 12 heads: the 8 of the power of two below, then every other one of the 16 above.
  const std::vector<double> twelve = alibi_slopes(12);
  ASSERT_EQ(twelve.size(), 12U);
  for (size_t h = 0; h < 8; ++h) EXPECT_DOUBLE_EQ(twelve[h], eight[h]);
  for (size_t h = 0; h < 4; ++h) EXPECT_DOUBLE_EQ(twelve[8 + h], std::exp2(-0.5 - static_cast<double>(h)));
  EXPECT_EQ(alibi_slopes(1), std::vector<double>{1.0 / 256.0});
  EXPECT_TRUE(alibi_slopes(0).empty());
}

// --- packed variable-length batches ---------------------------------------------------------------

// Sequences of query lengths 0, 1, 69, 5, 130 and key lengths 3, 1, 70, 9, 130, packed along T.
Problem packed_problem(const Variant& c, uint64_t seed) {
  const std::vector<int64_t> cu_q{0, 0, 1, 70, 75, 205}, cu_k{0, 3, 4, 74, 83, 213};
  Variant all = c;
  all.b = 1;
  all.tq = cu_q.back();
  all.tk = cu_k.back();
  Problem p = make_problem(all, seed);
  p.cu_seqlens_q = Tensor<int64_t>({static_cast<int64_t>(cu_q.size())}, cu_q);
  p.cu_seqlens_k = Tensor<int64_t>({static_cast<int64_t>(cu_k.size())}, cu_k);
  return p;
}

// Tokens [begin, end) of axis 2 of a [1, H, T, D] tensor.
Tensor<double> tokens(const Tensor<double>& x, int64_t begin, int64_t end) {
  Tensor<double> part({x.shape()[0], x.shape()[1], end - begin, x.shape()[3]});
  for (int64_t h = 0; h < x.shape()[1]; ++h) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t d = 0; d < x.shape()[3]; ++d) part.view()(0, h, t - begin, d) = x.view()(0, h, t, d);
    }
  }
  return part;
}

const Variant kPackedEverything{.h = 4,
                                .hkv = 2,
                                .dk = 8,
                                .dv = 6,
                                .causal = true,
                                .window = AttentionWindow{.left = 40, .right = -1},
                                .softcap = 4.0,
                                .alibi = true,
                                .sinks = true};

TEST(AttentionVariants, PackedSequencesMatchTheFormula) {
  for (const Variant& c :
       {Variant{.name = "plain"}, Variant{.name = "mask bias", .bias = true, .mask = true}, kPackedEverything}) {
    SCOPED_TRACE(c.name);
    const Problem p = packed_problem(c, 1000);
    expect_reference_matches_formula(p, 1001);
    expect_float32_matches_reference(p, 1002, c.name + " packed");
  }
}

TEST(AttentionVariants, PackedSequencesAreExactlyTheSeparateCalls) {
  const Problem packed = packed_problem(kPackedEverything, 1010);
  const Tensor<double> dout = random_dout(packed, 1011);
  const std::vector<int64_t>& cu_q = packed.cu_seqlens_q->values();
  const std::vector<int64_t>& cu_k = packed.cu_seqlens_k->values();
  on_every_target([&] {
    const testing::Forward f = run_forward<float>(packed, AttentionImpl::fused);
    const Grads g = run_backward<float>(packed, dout, AttentionImpl::fused);
    Tensor<double> dsinks_sum({kPackedEverything.h});
    for (size_t n = 0; n + 1 < cu_q.size(); ++n) {
      SCOPED_TRACE("sequence " + std::to_string(n));
      Problem one{.q = tokens(packed.q, cu_q[n], cu_q[n + 1]),
                  .k = tokens(packed.k, cu_k[n], cu_k[n + 1]),
                  .v = tokens(packed.v, cu_k[n], cu_k[n + 1])};
      one.causal = packed.causal;
      one.window = packed.window;
      one.softcap = packed.softcap;
      one.alibi = packed.alibi;
      one.sinks = packed.sinks;
      const testing::Forward fn = run_forward<float>(one, AttentionImpl::fused);
      const Grads gn = run_backward<float>(one, tokens(dout, cu_q[n], cu_q[n + 1]), AttentionImpl::fused);
      EXPECT_TRUE(bit_identical(tokens(f.out, cu_q[n], cu_q[n + 1]), fn.out));
      EXPECT_TRUE(bit_identical(tokens(g.dq, cu_q[n], cu_q[n + 1]), gn.dq));
      EXPECT_TRUE(bit_identical(tokens(g.dk, cu_k[n], cu_k[n + 1]), gn.dk));
      EXPECT_TRUE(bit_identical(tokens(g.dv, cu_k[n], cu_k[n + 1]), gn.dv));
      for (int64_t h = 0; h < dsinks_sum.numel(); ++h) {
        dsinks_sum[h] = static_cast<double>(static_cast<float>(dsinks_sum[h]) + static_cast<float>(gn.dsinks[h]));
      }
    }
    EXPECT_TRUE(bit_identical(g.dsinks, dsinks_sum));
  });
}

TEST(AttentionVariants, PackedAdditiveAttentionIsTheSeparateCalls) {
  // Query lengths 2, 0, 5 and key lengths 3, 4, 1; a bias broadcast over heads, a causal window.
  const std::vector<int64_t> cu_q{0, 2, 2, 7}, cu_k{0, 3, 7, 8};
  Rng rng(1020);
  const Tensor<double> q = random_tensor<double>({1, 2, 7, 3}, rng), k = random_tensor<double>({1, 2, 8, 4}, rng),
                       v = random_tensor<double>({1, 2, 8, 2}, rng), w_q = random_tensor<double>({5, 3}, rng),
                       w_k = random_tensor<double>({5, 4}, rng), w = random_tensor<double>({5}, rng),
                       bias = random_tensor<double>({7, 8}, rng), dout = random_tensor<double>({1, 2, 7, 2}, rng);
  const Tensor<int64_t> cq({4}, cu_q), ck({4}, cu_k);
  const AttentionMask<double> packed_mask{.causal = true,
                                          .window = AttentionWindow{.left = 1, .right = -1},
                                          .allowed = {},
                                          .bias = bias.view(),
                                          .cu_seqlens_q = cq.view(),
                                          .cu_seqlens_k = ck.view()};
  const AdditiveAttentionParams<double> packed{.q = q.view(),
                                               .k = k.view(),
                                               .v = v.view(),
                                               .w_q = w_q.view(),
                                               .w_k = w_k.view(),
                                               .w = w.view(),
                                               .mask = packed_mask};
  Tensor<double> out({1, 2, 7, 2}), lse({1, 2, 7});
  additive_attention_forward(packed, {.out = out.view(), .weights = {}, .lse = lse.view()});
  Tensor<double> dq(q.shape()), dk(k.shape()), dv(v.shape()), dw_q(w_q.shape()), dw_k(w_k.shape()), dw(w.shape()),
      dbias(bias.shape());
  additive_attention_backward(packed, dout.view(),
                              {.dq = dq.view(),
                               .dk = dk.view(),
                               .dv = dv.view(),
                               .dw_q = dw_q.view(),
                               .dw_k = dw_k.view(),
                               .dw = dw.view(),
                               .dbias = dbias.view()});
  Tensor<double> dw_sum(w.shape());
  for (size_t n = 0; n + 1 < cu_q.size(); ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    const Tensor<double> qn = tokens(q, cu_q[n], cu_q[n + 1]), kn = tokens(k, cu_k[n], cu_k[n + 1]),
                         vn = tokens(v, cu_k[n], cu_k[n + 1]), doutn = tokens(dout, cu_q[n], cu_q[n + 1]);
    Tensor<double> bn({cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]});
    for (int64_t i = 0; i < bn.shape()[0]; ++i) {
      for (int64_t j = 0; j < bn.shape()[1]; ++j) bn.view()(i, j) = bias.view()(cu_q[n] + i, cu_k[n] + j);
    }
    const AdditiveAttentionParams<double> one{
        .q = qn.view(),
        .k = kn.view(),
        .v = vn.view(),
        .w_q = w_q.view(),
        .w_k = w_k.view(),
        .w = w.view(),
        .mask = {.causal = true, .window = AttentionWindow{.left = 1, .right = -1}, .allowed = {}, .bias = bn.view()}};
    Tensor<double> on({1, 2, qn.shape()[2], 2});
    additive_attention_forward(one, {.out = on.view(), .weights = {}, .lse = {}});
    EXPECT_TRUE(all_close("out", tokens(out, cu_q[n], cu_q[n + 1]), on, 1e-15));
    Tensor<double> dqn(qn.shape()), dkn(kn.shape()), dvn(vn.shape()), dwq(w_q.shape()), dwk(w_k.shape()),
        dwn(w.shape()), dbn(bn.shape());
    additive_attention_backward(one, doutn.view(),
                                {.dq = dqn.view(),
                                 .dk = dkn.view(),
                                 .dv = dvn.view(),
                                 .dw_q = dwq.view(),
                                 .dw_k = dwk.view(),
                                 .dw = dwn.view(),
                                 .dbias = dbn.view()});
    EXPECT_TRUE(all_close("dq", tokens(dq, cu_q[n], cu_q[n + 1]), dqn, 1e-15));
    EXPECT_TRUE(all_close("dk", tokens(dk, cu_k[n], cu_k[n + 1]), dkn, 1e-15));
    EXPECT_TRUE(all_close("dv", tokens(dv, cu_k[n], cu_k[n + 1]), dvn, 1e-15));
    for (int64_t i = 0; i < dbn.shape()[0]; ++i) {
      for (int64_t j = 0; j < dbn.shape()[1]; ++j) {
        EXPECT_NEAR(dbias.view()(cu_q[n] + i, cu_k[n] + j), dbn.view()(i, j), 1e-15);
      }
    }
    for (int64_t a = 0; a < w.numel(); ++a) dw_sum[a] += dwn[a];
  }
  EXPECT_TRUE(all_close("dw", dw, dw_sum, 1e-14));
}

// --- dropout ------------------------------------------------------------------------------------------

// With V the identity (Tk = Dv), out_i is row i of the dropped weights α_ij·m_ij: the mask shows.
Problem identity_values(Problem p) {
  const int64_t tk = p.k.shape()[2];
  p.v = Tensor<double>({p.k.shape()[0], p.k.shape()[1], tk, tk});
  for (int64_t b = 0; b < p.v.shape()[0]; ++b) {
    for (int64_t h = 0; h < p.v.shape()[1]; ++h) {
      for (int64_t j = 0; j < tk; ++j) p.v.view()(b, h, j, j) = 1.0;
    }
  }
  return p;
}

int64_t count_zeros(const Tensor<double>& t) {
  int64_t zeros = 0;
  for (int64_t i = 0; i < t.numel(); ++i) zeros += t[i] == 0.0 ? 1 : 0;
  return zeros;
}

TEST(AttentionVariants, DropoutMasksAgreeEverywhereAndKeepOneMinusP) {
  // 4 heads × 512 × 512 = 2^20 weights, none of them 0 before dropout.
  Variant c{.h = 4, .hkv = 4, .tq = 512, .tk = 512, .dk = 8};
  Problem p = identity_values(make_problem(c, 1100, 0.3));
  constexpr double kRate = 0.3;
  p.dropout = AttentionDropout{.p = kRate, .seed = 42};
  const testing::Forward reference = run_forward<double>(p, AttentionImpl::reference);
  const double n = static_cast<double>(reference.out.numel());
  const double kept = n - static_cast<double>(count_zeros(reference.out));
  EXPECT_LE(std::abs(kept - n * (1 - kRate)), 4.0 * std::sqrt(n * kRate * (1 - kRate))) << kept << " of " << n;
  // The same zeros from the fused kernel on every target and thread count, and the same values.
  on_every_target([&] {
    for (const int workers : {1, 2}) {
      const WorkersScope scope(workers);
      const testing::Forward fused = run_forward<double>(p, AttentionImpl::fused);
      for (int64_t i = 0; i < fused.out.numel(); ++i) {
        ASSERT_EQ(fused.out[i] == 0.0, reference.out[i] == 0.0) << "weight " << i << ", " << workers << " threads";
      }
      EXPECT_TRUE(all_close("out", fused.out, reference.out, 1e-15));
    }
  });
  // Another seed drops other weights; p = 0 is exactly no dropout.
  Problem other = p;
  other.dropout->seed = 43;
  const testing::Forward reseeded = run_forward<double>(other, AttentionImpl::fused);
  int64_t differ = 0;
  for (int64_t i = 0; i < reseeded.out.numel(); ++i) differ += (reseeded.out[i] == 0.0) != (reference.out[i] == 0.0);
  EXPECT_GT(static_cast<double>(differ), 0.3 * n);
  Problem zero = p;
  zero.dropout = AttentionDropout{.p = 0.0, .seed = 42};
  Problem none = p;
  none.dropout = std::nullopt;
  EXPECT_TRUE(bit_identical(run_forward<float>(zero, AttentionImpl::fused).out,
                            run_forward<float>(none, AttentionImpl::fused).out));
}

TEST(AttentionVariants, DropoutBackwardReplaysTheMask) {
  uint64_t seed = 1200;
  for (Variant c : {Variant{.name = "dropout", .tq = 70, .tk = 90}, Variant{.name = "dropout with everything",
                                                                    .h = 4,
                                                                    .hkv = 2,
                                                                    .tq = 75,
                                                                    .tk = 140,
                                                                    .causal = true,
                                                                    .window = AttentionWindow{.left = 30, .right = -1},
                                                                    .softcap = 3.0,
                                                                    .alibi = true,
                                                                    .sinks = true,
                                                                    .bias = true}}) {
    Problem p = make_problem(c, seed);
    p.dropout = AttentionDropout{.p = 0.25, .seed = 7};
    expect_reference_matches_formula(p, seed + 1);
    expect_float32_matches_reference(p, seed + 2, c.name);
    // The packed form numbers each sequence's weights from 0, as its own batch.
    Problem packed = packed_problem(c, seed + 3);
    packed.dropout = p.dropout;
    expect_float32_matches_reference(packed, seed + 4, c.name + " packed");
    seed += 5;
  }
  // A different seed gives different gradients.
  Problem p = make_problem(Variant{.tq = 30, .tk = 30}, 1300);
  p.dropout = AttentionDropout{.p = 0.5, .seed = 1};
  const Tensor<double> dout = random_dout(p, 1301);
  Problem other = p;
  other.dropout->seed = 2;
  EXPECT_FALSE(bit_identical(run_backward<double>(p, dout, AttentionImpl::fused).dq,
                             run_backward<double>(other, dout, AttentionImpl::fused).dq));
}

TEST(AttentionVariants, DropoutGradientsMatchFiniteDifferences) {
  for (const AttentionImpl impl : {AttentionImpl::reference, AttentionImpl::fused}) {
    Problem p = make_problem(Variant{.h = 2, .hkv = 1, .tq = 5, .tk = 7, .dk = 3, .dv = 2, .sinks = true}, 1400);
    p.dropout = AttentionDropout{.p = 0.4, .seed = 3};
    expect_gradients_match_finite_differences(p, 1401, impl);
  }
}

TEST(AttentionVariants, PhiloxMatchesItsPublishedAnswers) {
  // The known-answer vectors of Random123's Philox 4x32-10.
  EXPECT_EQ(philox4x32({0, 0, 0, 0}, {0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

// --- refusals ---------------------------------------------------------------------------------

using testing::throws_naming;

TEST(AttentionVariants, RefusesBadArgumentsNamingThem) {
  const Variant base{.h = 6, .hkv = 2};
  // Each edit of a valid problem, the error type it must raise and what its message must say, from
  // the reference and the fused kernel alike: one validation at the boundary.
  auto refused = [&](auto&& edit, const std::vector<std::string>& parts, auto error_type) {
    using E = decltype(error_type);
    Problem p = make_problem(base, 900);
    edit(p);
    EXPECT_TRUE(throws_naming<E>([&] { run_forward<float>(p, AttentionImpl::fused); }, parts));
    EXPECT_TRUE(throws_naming<E>([&] { run_forward<float>(p, AttentionImpl::reference); }, parts));
  };
  refused(
      [](Problem& p) {
        Rng rng(1);
        p.k = random_tensor<double>({1, 4, 11, 8}, rng);
        p.v = random_tensor<double>({1, 4, 11, 5}, rng);
      },
      {"k: q has 6 heads, which is not a multiple of k's 4", "[1, 6, 9, 8]", "[1, 4, 11, 8]"}, ShapeError(""));
  refused([](Problem& p) { p.softcap = 0.0; }, {"softcap: expected a positive finite number, got 0"}, ValueError(""));
  refused([](Problem& p) { p.softcap = -1.0; }, {"softcap", "got -1"}, ValueError(""));
  refused([](Problem& p) { p.window = AttentionWindow{.left = -2, .right = 0}; },
          {"window: left must be -1 (unbounded) or at least 0, got -2"}, ValueError(""));
  refused([](Problem& p) { p.window = AttentionWindow{.left = 0, .right = -3}; }, {"window: right", "got -3"},
          ValueError(""));
  refused([](Problem& p) { p.alibi = Tensor<double>({2}); }, {"alibi_slopes", "[6]", "[2]"}, ShapeError(""));
  refused([](Problem& p) { p.sinks = Tensor<double>({1, 6}); }, {"sinks", "[6]", "[1, 6]"}, ShapeError(""));
  refused([](Problem& p) { p.dropout = AttentionDropout{.p = 1.0, .seed = 0}; },
          {"dropout: p must be in [0, 1), got 1"}, ValueError(""));
  refused([](Problem& p) { p.dropout = AttentionDropout{.p = -0.1, .seed = 0}; }, {"dropout", "got -0.1"},
          ValueError(""));
  refused([](Problem& p) { p.dropout = AttentionDropout{.p = std::nan(""), .seed = 0}; }, {"dropout", "nan"},
          ValueError(""));
  const auto offsets = [](const std::vector<int64_t>& values) {
    return Tensor<int64_t>({static_cast<int64_t>(values.size())}, values);
  };
  // base: Tq = 9, Tk = 11.
  refused(
      [&](Problem& p) {
        p.cu_seqlens_q = offsets({0, 4, 9});
      },
      {"cu_seqlens_q: given without cu_seqlens_k"}, ValueError(""));
  refused(
      [&](Problem& p) {
        p.cu_seqlens_q = offsets({0, 5, 4, 9});
        p.cu_seqlens_k = offsets({0, 3, 6, 11});
      },
      {"cu_seqlens_q: offsets must not decrease, got 4 after 5 at index 2"}, ValueError(""));
  refused(
      [&](Problem& p) {
        p.cu_seqlens_q = offsets({0, 4, 9});
        p.cu_seqlens_k = offsets({0, 3, 10});
      },
      {"cu_seqlens_k: expected the last offset to be Tk = 11, got 10"}, ValueError(""));
  refused(
      [&](Problem& p) {
        p.cu_seqlens_q = offsets({1, 4, 9});
        p.cu_seqlens_k = offsets({0, 3, 11});
      },
      {"cu_seqlens_q: expected 0 first, got 1"}, ValueError(""));
  refused(
      [&](Problem& p) {
        p.cu_seqlens_q = offsets({0, 4, 9});
        p.cu_seqlens_k = offsets({0, 11});
      },
      {"cu_seqlens_k: expected 3 offsets, as many as cu_seqlens_q, got 2"}, ShapeError(""));
  refused(
      [&](Problem& p) {
        Rng rng(2);
        p.q = random_tensor<double>({2, 6, 9, 8}, rng);
        p.k = random_tensor<double>({2, 2, 11, 8}, rng);
        p.v = random_tensor<double>({2, 2, 11, 5}, rng);
        p.cu_seqlens_q = offsets({0, 9});
        p.cu_seqlens_k = offsets({0, 11});
      },
      {"cu_seqlens_q: packed sequences lie along T of a batch of one", "[2, 6, 9, 8]"}, ShapeError(""));
}

TEST(AttentionVariants, RefusesSinkGradientsWithoutSinks) {
  const Problem p = make_problem(Variant{}, 910);
  const testing::AttentionOperands<float> ops(p);
  Tensor<float> dout({1, 2, 9, 5}), dq(p.q.shape()), dk(p.k.shape()), dv(p.v.shape()), dsinks({2});
  const AttentionGradients<float> grads{
      .dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}, .dsinks = dsinks.view()};
  for (const AttentionImpl impl : {AttentionImpl::reference, AttentionImpl::fused}) {
    EXPECT_TRUE(throws_naming<ShapeError>(
        [&] { attention_backward(ops.params(), dout.cview(), grads, std::optional<AttentionSaved<float>>(), impl); },
        {"dsinks: given, but the call has no sinks"}));
  }
}

TEST(AttentionVariants, AdditiveAttentionRefusesGroupedHeads) {
  Rng rng(920);
  const Tensor<float> q = random_tensor<float>({4, 3, 2}, rng), k = random_tensor<float>({2, 5, 2}, rng),
                      v = random_tensor<float>({2, 5, 2}, rng), w_q = random_tensor<float>({3, 2}, rng),
                      w_k = random_tensor<float>({3, 2}, rng), w = random_tensor<float>({3}, rng);
  Tensor<float> out({4, 3, 2});
  const AdditiveAttentionParams<float> params{
      .q = q.view(), .k = k.view(), .v = v.view(), .w_q = w_q.view(), .w_k = w_k.view(), .w = w.view(), .mask = {}};
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { additive_attention_forward(params, {.out = out.view(), .weights = {}, .lse = {}}); },
      {"k: additive attention needs as many key heads as query heads (4)", "[2, 5, 2]"}));
}

}  // namespace
}  // namespace qkv
