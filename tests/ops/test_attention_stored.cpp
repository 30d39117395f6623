// Attention on Q, K, V stored as float16, bfloat16 and int8 (src/ops/attention_stored.cpp and the
// fused kernel's StageRows), on every SIMD target this CPU runs: the fused forward is bit-identical
// to the float32 kernel on the values the operands stand for, which holds the float64 reference's
// tolerance rule on those values; the conversions round to nearest even; int8 quantisation keeps
// every element within half a step; bad operands are refused with the argument named.

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/quantize.hpp"
#include "support/attention_problems.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::bf16_products_tolerance;
using testing::bit_identical;
using testing::cast;
using testing::expect_float32_matches_reference;
using testing::Forward;
using testing::on_every_target;
using testing::random_problem;
using testing::run_forward;
using testing::store;
using testing::store_problem;
using testing::Stored;
using testing::stored_params;
using Case = testing::AttentionCase;
using Problem = testing::AttentionProblem;

constexpr float kInf = std::numeric_limits<float>::infinity();

// --- conversions -----------------------------------------------------------------------------------

TEST(Storage, Float16RoundsToNearestEven) {
  EXPECT_EQ(float16_from_float(1.0f), 0x3c00);
  EXPECT_EQ(float16_from_float(-2.0f), 0xc000);
  EXPECT_EQ(float16_from_float(65504.0f), 0x7bff);
  EXPECT_EQ(float16_from_float(65519.0f), 0x7bff);  // below the midpoint to 2¹⁶
  EXPECT_EQ(float16_from_float(65520.0f), 0x7c00);  // the midpoint, to even: infinity
  EXPECT_EQ(float16_from_float(kInf), 0x7c00);
  EXPECT_EQ(float16_from_float(1.0f + 0x1p-11f), 0x3c00);      // tie, to even
  EXPECT_EQ(float16_from_float(1.0f + 3 * 0x1p-11f), 0x3c02);  // tie, to even
  EXPECT_EQ(float16_from_float(0x1p-24f), 0x0001);             // smallest subnormal
  EXPECT_EQ(float16_from_float(0x1p-25f), 0x0000);             // tie, to even: 0
  EXPECT_EQ(float16_from_float(3 * 0x1p-25f), 0x0002);         // tie, to even
  EXPECT_EQ(float16_from_float(0x1p-14f - 0x1p-26f), 0x0400);  // rounds up into the normals
  EXPECT_TRUE(std::isnan(float_from_float16(float16_from_float(std::nanf("")))));
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const auto half = static_cast<uint16_t>(bits);
    const float value = float_from_float16(half);
    if (std::isnan(value)) continue;
    ASSERT_EQ(float16_from_float(value), half) << "bits " << bits;
  }
}

TEST(Storage, Bfloat16RoundsToNearestEven) {
  EXPECT_EQ(bfloat16_from_float(1.0f), 0x3f80);
  EXPECT_EQ(bfloat16_from_float(1.0f + 0x1p-8f), 0x3f80);      // tie, to even
  EXPECT_EQ(bfloat16_from_float(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie, to even
  EXPECT_EQ(bfloat16_from_float(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_TRUE(std::isnan(float_from_bfloat16(bfloat16_from_float(std::nanf("")))));
  EXPECT_EQ(float_from_bfloat16(0xc040), -3.0f);
}

TEST(Storage, NamesParseAndUnknownOnesAreRefused) {
  EXPECT_EQ(parse_storage("bf16", "--kv-dtype"), StorageType::bfloat16);
  EXPECT_EQ(parse_storage("float16", "--kv-dtype"), StorageType::float16);
  EXPECT_EQ(parse_storage("i8", "--kv-dtype"), StorageType::int8);
  try {
    parse_storage("fp8", "--kv-dtype");
    FAIL() << "fp8 was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("--kv-dtype: expected float32, float16, bfloat16 or int8"), std::string::npos)
        << e.what();
  }
}

// An array with a value that rounds to an infinity is refused, where numpy's astype would store the
// infinity and attention would then refuse the array.
TEST(Quantize, ValuesPastTheTypesRangeAreRefused) {
  Tensor<float> x({2, 3});
  x.view()(1, 2) = 65519.0f;
  EXPECT_EQ(to_float16(x.cview()).view()(1, 2), 0x7bff);
  x.view()(1, 2) = 65520.0f;
  const auto refused = [](auto convert, const std::string& message) {
    try {
      convert();
      ADD_FAILURE() << "accepted; expected: " << message;
    } catch (const ValueError& e) {
      EXPECT_EQ(std::string(e.what()), message);
    }
  };
  refused([&] { to_float16(x.cview(), "k"); },
          "k: expected values that float16 holds (|x| < 65520), got 65520 at [1, 2]");
  x.view()(1, 2) = std::numeric_limits<float>::max();
  refused([&] { to_bfloat16(x.cview()); },
          fmt::format("x: expected values that bfloat16 holds (|x| < {}), got {} at [1, 2]",
                      rounding_overflow_limit(StorageType::bfloat16), std::numeric_limits<float>::max()));
  x.view()(1, 2) = std::nanf("");
  refused([&] { to_bfloat16(x.cview()); },
          "x: expected finite values, got 1 non-finite value (the first: nan at [1, 2])");
}

TEST(Quantize, Int8KeepsEveryElementWithinHalfAStep) {
  Rng rng(11);
  Tensor<float> x = cast<float>(testing::random_tensor<double>({2, 3, 37, 19}, rng, 3.0));
  x.view()(0, 1, 5, 7) = 0.0f;
  for (const QuantizeGroup group : {QuantizeGroup::per_channel, QuantizeGroup::per_token, QuantizeGroup::per_tensor}) {
    const Int8Array q = quantize_int8(x.cview(), group);
    const Shape want = group == QuantizeGroup::per_channel ? Shape{2, 3, 1, 19}
                       : group == QuantizeGroup::per_token ? Shape{2, 3, 37, 1}
                                                           : Shape{1, 1, 1, 1};
    ASSERT_EQ(q.scales.shape(), want);
    const Tensor<float> back = to_float32(q.stored());
    const TensorView<const float> scale = broadcast_to(q.scales.cview(), x.shape(), "scales");
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t t = 0; t < 37; ++t)
          for (int64_t c = 0; c < 19; ++c) {
            const double err = std::abs(static_cast<double>(back.view()(b, h, t, c)) - x.view()(b, h, t, c));
            ASSERT_LE(err, 0.5 * scale(b, h, t, c) * (1 + 1e-6)) << b << h << t << c;
          }
  }
  // A group of zeros stores zeros, with a scale that is not 0.
  const Int8Array zeros = quantize_int8(Tensor<float>({4, 3}).cview(), QuantizeGroup::per_token);
  for (int64_t t = 0; t < 4; ++t) EXPECT_EQ(zeros.scales.view()(t, 0), 1.0f);
}

TEST(Quantize, PerChannelScalesKeepOutlierChannelsFromCostingTheRest) {
  Rng rng(12);
  Tensor<float> k = cast<float>(testing::random_tensor<double>({1, 1, 256, 64}, rng));
  for (int64_t t = 0; t < 256; ++t) k.view()(0, 0, t, 5) *= 50.0f;  // one outlier channel, as keys have
  const auto error = [&](QuantizeGroup group) {
    const Tensor<float> back = to_float32(quantize_int8(k.cview(), group).stored());
    double sum = 0;
    for (int64_t i = 0; i < k.numel(); ++i) sum += std::abs(static_cast<double>(back[i]) - k[i]);
    return sum / static_cast<double>(k.numel());
  };
  EXPECT_LT(5 * error(QuantizeGroup::per_channel), error(QuantizeGroup::per_tensor));
  EXPECT_LT(5 * error(QuantizeGroup::per_channel), error(QuantizeGroup::per_token));
}

// --- the stored forward ------------------------------------------------------------------------------

Forward run_stored(const Problem& p, const Stored& s, bool with_lse) {
  const testing::AttentionOperands<float> ops(p);
  const Shape& shape = p.q.shape();
  Tensor<float> out({shape[0], shape[1], shape[2], p.v.shape()[3]}), lse({shape[0], shape[1], shape[2]});
  AttentionOutputs<float> outputs{.out = out.view(), .weights = {}, .lse = {}};
  if (with_lse) outputs.lse = lse.view();
  attention_forward(stored_params(s, ops.params()), outputs);
  return {cast<double>(out), with_lse ? cast<double>(lse) : Tensor<double>()};
}

// Gradients of <dout, out> through the stored operands; `with_saved` hands the backward the stored
// forward's out and lse.
testing::Grads run_stored_backward(const Problem& p, const Stored& s, const Tensor<double>& dout, bool with_saved) {
  const testing::AttentionOperands<float> ops(p);
  return testing::backward_through<float>(p, stored_params(s, ops.params()), dout, AttentionImpl::automatic,
                                          with_saved);
}

// The stored forward and backward, as testing::expect_matches_reference runs them.
testing::FusedRuns stored_runs(const Problem& p, const Stored& s) {
  return {
      .forward = [&p, &s](bool with_lse) { return run_stored(p, s, with_lse); },
      .backward = [&p, &s](const Tensor<double>& dout, bool saved) { return run_stored_backward(p, s, dout, saved); },
      .forward_out_only = false};
}

constexpr StorageType kTypes[] = {StorageType::float16, StorageType::bfloat16, StorageType::int8};

// For every K/V type (with Q in float32 and in K's type where Q may take it): bit-identical to the
// float32 kernel on the stored values, with and without lse, on every target; then those values
// against the float64 reference by the suite's rule. The exceptions, held to the float64
// reference's rule instead: forwards without lse that do not convert every element exactly, int8
// (blocks of few queries apply its scales to the query and the weights instead of to each
// element) and bfloat16 Q, K and V on the bf16 dot product (weights rounded to bfloat16, the
// rounding added to the rule); and bfloat16 Q and K with lse on the bf16 dot product, whose scores
// sum their products in pairs (and the backward with them).
void expect_stored_matches_float(Problem p, uint64_t seed, const std::string& label, bool reference = true) {
  for (const StorageType kv : kTypes) {
    for (const StorageType q : {StorageType::float32, kv}) {
      if (q == StorageType::int8) continue;
      SCOPED_TRACE(fmt::format("{}: q {}, k and v {}", label, storage_name(q), storage_name(kv)));
      Problem stored_p = p;
      const Stored s = store_problem(stored_p, q, kv, kv);
      const bool int8 = kv == StorageType::int8;
      const bool bf16 = q == StorageType::bfloat16 && kv == StorageType::bfloat16;
      const Forward exact = int8 || bf16 ? testing::reference_forward(stored_p) : Forward{};
      const testing::AttentionYardsticks y =
          int8 || bf16 ? testing::attention_yardsticks(stored_p, testing::random_dout(stored_p, seed))
                       : testing::AttentionYardsticks{};
      on_every_target([&] {
        for (const bool with_lse : {true, false}) {
          const Forward got = run_stored(stored_p, s, with_lse);
          if (int8 && !with_lse) {
            EXPECT_TRUE(testing::all_close("int8 out without lse", got.out, exact.out,
                                           testing::attention_tolerance(y, testing::NaiveResult::out, exact.out)));
            continue;
          }
          if (bf16 && !with_lse && attention_bf16_products()) {
            EXPECT_TRUE(testing::all_close("bfloat16 out on bf16 products", got.out, exact.out,
                                           bf16_products_tolerance(y, exact.out)));
            continue;
          }
          if (bf16 && attention_bf16_products()) continue;  // expect_matches_reference, below
          const Forward want = run_forward<float>(stored_p, AttentionImpl::fused, with_lse);
          EXPECT_TRUE(bit_identical(got.out, want.out)) << (with_lse ? "with lse" : "out only");
          EXPECT_TRUE(bit_identical(got.lse, want.lse));
        }
      });
      if (reference && q == StorageType::float32) expect_float32_matches_reference(stored_p, seed, label);
      if (reference && bf16) testing::expect_matches_reference(stored_p, seed, label, stored_runs(stored_p, s));
    }
  }
}

TEST(AttentionStored, AwkwardSizesMatchTheFloatKernelBitForBit) {
  const Case cases[] = {{1, 1, 1, 1, 1, 1},
                        {2, 3, 7, 7, 17, 17},
                        {1, 2, 113, 70, 64, 64},
                        {1, 1, 65, 130, 72, 33},
                        {1, 1, 20, 300, 128, 128}};
  uint64_t seed = 10;
  for (const Case& c : cases) {
    expect_stored_matches_float(random_problem(c, seed), seed + 1,
                                fmt::format("B={} H={} Tq={} Tk={} Dk={} Dv={}", c.b, c.h, c.tq, c.tk, c.dk, c.dv));
    seed += 2;
  }
}

TEST(AttentionStored, MasksCausalityAndGroupedHeads) {
  Problem causal = random_problem({1, 2, 70, 200, 64, 64, true}, 30);
  expect_stored_matches_float(causal, 31, "causal Tq < Tk");
  Problem masked = random_problem({1, 1, 40, 90, 32, 16}, 32);
  masked.allowed = testing::random_mask({40, 90}, 0.7, 33);
  for (int64_t j = 0; j < 90; ++j) masked.allowed->view()(3, j) = 0;  // a fully masked row
  expect_stored_matches_float(masked, 34, "mask with a fully masked row");
  Problem gqa = random_problem({1, 4, 33, 80, 64, 64}, 35);
  Rng rng(36);
  gqa.k = testing::random_tensor<double>({1, 2, 80, 64}, rng);
  gqa.v = testing::random_tensor<double>({1, 2, 80, 64}, rng);
  expect_stored_matches_float(gqa, 37, "grouped-query heads, 4 over 2");
}

// A mask with a fully masked row, and grouped-query heads (4 over 2), added to `problems`.
void add_masked_and_grouped(std::vector<std::pair<std::string, Problem>>& problems, uint64_t& seed) {
  Problem masked = random_problem({1, 1, 40, 90, 32, 16}, seed++);
  masked.allowed = testing::random_mask({40, 90}, 0.7, seed++);
  for (int64_t j = 0; j < 90; ++j) masked.allowed->view()(3, j) = 0;
  problems.emplace_back("mask with a fully masked row", masked);
  Problem gqa = random_problem({1, 4, 33, 80, 64, 64}, seed++);
  Rng rng(seed++);
  gqa.k = testing::random_tensor<double>({1, 2, 80, 64}, rng);
  gqa.v = testing::random_tensor<double>({1, 2, 80, 64}, rng);
  problems.emplace_back("grouped-query heads, 4 over 2", gqa);
}

// The bf16 dot product's own checks, beyond the cases above: every size class of its tiles (d = 1,
// odd depths, key blocks and query vectors cut short), causality, a window, a fully masked row, grouped heads
// and a KvCache's pages' worth of keys; out within the bfloat16 rule on every AVX-512 target,
// the same bits for any thread count, and not the float32 kernel's (the weights were rounded).
TEST(AttentionStored, Bf16ProductsRoundOnlyTheWeights) {
  if (!attention_bf16_products()) {
    GTEST_SKIP() << "this CPU has no bf16 dot product at target " << simd_target()
                 << " (AVX512_BF16 on an AVX-512 target): bfloat16 operands run the float32 arithmetic, tested above";
  }
  std::vector<std::pair<std::string, Problem>> problems;
  const Case cases[] = {{1, 1, 9, 1, 1, 1},      {1, 2, 17, 33, 17, 31},           {2, 1, 64, 64, 64, 64},
                        {1, 1, 65, 130, 72, 33}, {1, 2, 100, 200, 128, 128, true}, {1, 1, 40, 97, 2, 200}};
  uint64_t seed = 300;
  for (const Case& c : cases) {
    problems.emplace_back(
        fmt::format("B={} H={} Tq={} Tk={} Dk={} Dv={}{}", c.b, c.h, c.tq, c.tk, c.dk, c.dv, c.causal ? " causal" : ""),
        random_problem(c, seed++));
  }
  // V's pairs are kept for the key blocks that start on a multiple of the block: a window starts
  // some query blocks' keys elsewhere, and the causal case above (Tq < Tk) reads one kept block with
  // fewer keys for its first query block than for its last.
  Problem windowed = random_problem({1, 2, 200, 200, 64, 48}, seed++);
  windowed.window = AttentionWindow{.left = 70, .right = 10};
  problems.emplace_back("window (70, 10)", windowed);
  add_masked_and_grouped(problems, seed);
  for (auto& [label, p] : problems) {
    SCOPED_TRACE(label);
    const Stored s = store_problem(p, StorageType::bfloat16, StorageType::bfloat16, StorageType::bfloat16);
    const Forward exact = testing::reference_forward(p);
    const testing::AttentionYardsticks y = testing::attention_yardsticks(p, testing::random_dout(p, seed));
    const Forward float32 = run_forward<float>(p, AttentionImpl::fused, false);
    for (const std::string& target : simd_targets()) {
      const testing::SimdTargetScope scope(target);
      if (!attention_bf16_products()) continue;
      SCOPED_TRACE("target " + target);
      const Forward got = run_stored(p, s, false);
      EXPECT_TRUE(testing::all_close("out", got.out, exact.out, bf16_products_tolerance(y, exact.out)));
      if (p.q.shape()[2] > 8 && p.k.shape()[3] > 1) {
        EXPECT_FALSE(bit_identical(got.out, float32.out));
      }
      const testing::WorkersScope one(1);
      EXPECT_TRUE(bit_identical(run_stored(p, s, false).out, got.out)) << "one thread against all";
    }
  }
}

TEST(AttentionStored, DecodeSplitsTheKeysAndTakesTheFewQueryLayout) {
  // Tk ≥ 1024 splits the keys into chunks; 1 and 3 queries take the few-query layout without lse.
  for (const int64_t tq : {1, 3, 12}) {
    Problem p = random_problem({1, 2, tq, 2100, 128, 128}, 40 + static_cast<uint64_t>(tq));
    expect_stored_matches_float(p, 50, fmt::format("decode Tq={}", tq), tq == 3);
  }
  // Four query heads on each K and V head: d = 64 fits the registers beside the four rows' chains
  // on every target; d = 128 does not on AVX2, where each key is converted for two rows at a time.
  // Where keys go two at a time, an odd Tk leaves one alone.
  for (const auto& [d, tk] : {std::pair<int64_t, int64_t>{64, 1500}, {128, 1500}, {128, 1501}}) {
    Problem gqa = random_problem({1, 8, 1, tk, d, d}, 60);
    Rng rng(61);
    gqa.k = testing::random_tensor<double>({1, 2, tk, d}, rng);
    gqa.v = testing::random_tensor<double>({1, 2, tk, d}, rng);
    expect_stored_matches_float(gqa, 62, fmt::format("decode, grouped heads, d = {}, Tk = {}", d, tk), false);
  }
}

TEST(AttentionStored, Int8DecodeTakesEveryScaleLayout) {
  // Decode applies a key's scale to its dot product (one scale per key), or to the query (one per
  // channel), a value's to its weight (one per token) or to every element (one per channel): each
  // pair of layouts, with sizes off every vector width, against the float64 reference on the
  // stored values, on every target.
  const QuantizeGroup groups[] = {QuantizeGroup::per_channel, QuantizeGroup::per_token, QuantizeGroup::per_tensor};
  uint64_t seed = 80;
  for (const QuantizeGroup k_group : groups) {
    for (const QuantizeGroup v_group : groups) {
      for (const int64_t tq : {1, 5}) {
        Problem p = random_problem({1, 3, tq, 1300, 37, 21}, seed++);
        Stored s;
        std::optional<Int8Array> unused;
        s.q = store(p.q, StorageType::float32, QuantizeGroup::per_token, s.q16, unused, s.q32);
        s.k = store(p.k, StorageType::int8, k_group, s.k16, s.k8, s.k32);
        s.v = store(p.v, StorageType::int8, v_group, s.v16, s.v8, s.v32);
        p.k = cast<double>(to_float32(s.k));
        p.v = cast<double>(to_float32(s.v));
        SCOPED_TRACE(
            fmt::format("k scales {}, v scales {}, Tq={}", static_cast<int>(k_group), static_cast<int>(v_group), tq));
        const Forward exact = testing::reference_forward(p);
        const testing::AttentionYardsticks y = testing::attention_yardsticks(p, testing::random_dout(p, seed));
        on_every_target([&] {
          const Forward got = run_stored(p, s, false);
          EXPECT_TRUE(testing::all_close("out", got.out, exact.out,
                                         testing::attention_tolerance(y, testing::NaiveResult::out, exact.out)));
        });
      }
    }
  }
}

TEST(AttentionStored, ReferenceAndBackwardRunOnTheStoredValues) {
  Problem p = random_problem({1, 2, 19, 23, 16, 8, true}, 70);
  const Stored s = store_problem(p, StorageType::bfloat16, StorageType::float16, StorageType::float16);
  const testing::AttentionOperands<float> ops(p);
  const StoredAttentionParams sp = stored_params(s, ops.params());
  Tensor<float> weights({1, 2, 19, 23}), out({1, 2, 19, 8});
  attention_forward(sp, {.out = out.view(), .weights = weights.view(), .lse = {}});
  Tensor<float> want_weights({1, 2, 19, 23}), want_out({1, 2, 19, 8});
  attention_forward(ops.params(), {.out = want_out.view(), .weights = want_weights.view(), .lse = {}},
                    AttentionImpl::reference);
  EXPECT_TRUE(bit_identical(cast<double>(weights), cast<double>(want_weights)));
  EXPECT_TRUE(bit_identical(cast<double>(out), cast<double>(want_out)));

  Rng rng(71);
  const Tensor<float> dout = cast<float>(testing::random_tensor<double>({1, 2, 19, 8}, rng));
  Tensor<float> dq({1, 2, 19, 16}), dk({1, 2, 23, 16}), dv({1, 2, 23, 8});
  Tensor<float> wq({1, 2, 19, 16}), wk({1, 2, 23, 16}), wv({1, 2, 23, 8});
  attention_backward(sp, dout.cview(), {.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}});
  attention_backward(ops.params(), dout.cview(), {.dq = wq.view(), .dk = wk.view(), .dv = wv.view(), .dbias = {}});
  EXPECT_TRUE(bit_identical(cast<double>(dq), cast<double>(wq)));
  EXPECT_TRUE(bit_identical(cast<double>(dk), cast<double>(wk)));
  EXPECT_TRUE(bit_identical(cast<double>(dv), cast<double>(wv)));
}

// The stored backward converts a block of rows of Q, K and V as each tile reads it. For every type
// (Q in float32 or in K's type), tiles cut short (Tq and Tk off the 64-row blocks, over several of
// them; odd and unit depths), causality, a fully masked row, grouped heads, a softcap with sinks and
// a bias's gradient: the float32 backward's bits on the stored values, with the forward's saved out
// and lse and without, on every target and on 1 and 2 threads. bfloat16 Q and K on the bf16 dot
// product sum their scores in pairs: the float64 reference's rule instead of the float32 bits.
TEST(AttentionStored, BackwardConvertsTileByTileToTheFloatBackwardsBits) {
  std::vector<std::pair<std::string, Problem>> problems;
  uint64_t seed = 400;
  problems.emplace_back("B=2 H=3 Tq=70 Tk=150 Dk=37 Dv=21", random_problem({2, 3, 70, 150, 37, 21}, seed++));
  problems.emplace_back("causal Tq < Tk, Dk = Dv = 1", random_problem({1, 2, 65, 130, 1, 1, true}, seed++));
  add_masked_and_grouped(problems, seed);
  Problem capped = random_problem({1, 2, 66, 70, 24, 24}, seed++);
  Rng rng(seed++);
  capped.softcap = 1.5;
  capped.sinks = testing::random_tensor<double>({2}, rng);
  capped.bias = testing::random_tensor<double>({1, 2, 66, 70}, rng);
  problems.emplace_back("softcap, sinks and a bias", capped);
  for (const auto& [label, problem] : problems) {
    for (const StorageType kv : kTypes) {
      for (const StorageType q : {StorageType::float32, kv}) {
        if (q == StorageType::int8) continue;
        SCOPED_TRACE(fmt::format("{}: q {}, k and v {}", label, storage_name(q), storage_name(kv)));
        Problem p = problem;
        const Stored s = store_problem(p, q, kv, kv);
        const Tensor<double> dout = testing::random_dout(p, seed);
        const bool bf16 = q == StorageType::bfloat16 && kv == StorageType::bfloat16;
        on_every_target([&] {
          for (const bool saved : {true, false}) {
            SCOPED_TRACE(saved ? "with the saved out and lse" : "recomputing the forward");
            const testing::Grads got = run_stored_backward(p, s, dout, saved);
            if (!bf16 || !attention_bf16_products()) {
              const testing::Grads want = testing::run_backward<float>(p, dout, AttentionImpl::fused, saved);
              EXPECT_TRUE(bit_identical(got.dq, want.dq));
              EXPECT_TRUE(bit_identical(got.dk, want.dk));
              EXPECT_TRUE(bit_identical(got.dv, want.dv));
              EXPECT_TRUE(bit_identical(got.dbias, want.dbias));
              EXPECT_TRUE(bit_identical(got.dsinks, want.dsinks));
            }
            const testing::WorkersScope one(1);
            const testing::Grads alone = run_stored_backward(p, s, dout, saved);
            EXPECT_TRUE(bit_identical(alone.dq, got.dq)) << "one thread against all";
            EXPECT_TRUE(bit_identical(alone.dk, got.dk)) << "one thread against all";
          }
        });
        if (bf16) testing::expect_matches_reference(p, seed, label, stored_runs(p, s));
      }
    }
  }
}

// Huge logits (testing::make_logits_huge, |q·k| ≈ 10⁴ at d = 64). bfloat16 Q and K take the bf16 dot product for
// the scores of the forward with lse and of both of the backward's layouts (one head on 2 threads
// takes two passes, on 1 thread one): within the rule of the float64 reference, and the same bits
// on 1 and 2 threads; on every target, decode (Tq = 1) included.
TEST(AttentionStored, Bf16ScoresKeepTheBackwardAccurateOnHugeLogits) {
  uint64_t seed = 500;
  for (const int64_t tq : {int64_t{1}, int64_t{8}, int64_t{70}}) {
    Problem p = random_problem({1, 1, tq, 90, 64, 48}, seed);
    testing::make_logits_huge(p);
    const Stored s = store_problem(p, StorageType::bfloat16, StorageType::bfloat16, StorageType::bfloat16);
    const std::string label = fmt::format("huge logits, bfloat16, Tq={}", tq);
    testing::expect_matches_reference(p, seed + 1, label, stored_runs(p, s));
    const Tensor<double> dout = testing::random_dout(p, seed + 2);
    on_every_target([&] {
      const testing::Grads both = run_stored_backward(p, s, dout, true);
      const testing::WorkersScope one(1);
      const testing::Grads alone = run_stored_backward(p, s, dout, true);
      EXPECT_TRUE(bit_identical(alone.dq, both.dq)) << label;
      EXPECT_TRUE(bit_identical(alone.dk, both.dk)) << label;
      EXPECT_TRUE(bit_identical(alone.dv, both.dv)) << label;
    });
    seed += 3;
  }
}

TEST(AttentionStored, Int8KeysWithOutlierChannelsNeedPerChannelScales) {
  // Keys with a few channels 20× the others (as trained models' keys have): the end error of int8 K
  // and V against the unquantised float32 inputs, with K's scales per channel and per tensor.
  Problem p = random_problem({1, 4, 16, 1024, 64, 64}, 90);
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t t = 0; t < 1024; ++t)
      for (const int64_t c : {3, 17, 40}) p.k.view()(0, h, t, c) *= 20.0;
  p.scale = 0.02;  // keeps the softmax from saturating on the outliers
  const Forward exact = run_forward<float>(p, AttentionImpl::fused, false);
  const testing::AttentionOperands<float> ops(p);
  const auto end_error = [&](QuantizeGroup k_group, StorageType kv) {
    Tensor<uint16_t> k16, v16;
    std::optional<Int8Array> k8, v8;
    StoredView k = StoredView::float32(ops.k.cview()), v = StoredView::float32(ops.v.cview());
    if (kv == StorageType::int8) {
      k8 = quantize_int8(ops.k.cview(), k_group);
      v8 = quantize_int8(ops.v.cview(), QuantizeGroup::per_token);
      k = k8->stored();
      v = v8->stored();
    } else {
      k16 = to_float16(ops.k.cview());
      v16 = to_float16(ops.v.cview());
      k = StoredView::float16(k16.cview());
      v = StoredView::float16(v16.cview());
    }
    Tensor<float> out(exact.out.shape());
    StoredAttentionParams sp = stored_params(Stored{}, ops.params());
    sp.q = StoredView::float32(ops.q.cview());
    sp.k = k;
    sp.v = v;
    attention_forward(sp, {.out = out.view(), .weights = {}, .lse = {}});
    double err = 0, norm = 0;
    for (int64_t i = 0; i < out.numel(); ++i) {
      err += std::pow(static_cast<double>(out[i]) - exact.out[i], 2);
      norm += std::pow(exact.out[i], 2);
    }
    return std::sqrt(err / norm);
  };
  const double channel = end_error(QuantizeGroup::per_channel, StorageType::int8);
  const double tensor = end_error(QuantizeGroup::per_tensor, StorageType::int8);
  const double half = end_error(QuantizeGroup::per_channel, StorageType::float16);
  RecordProperty("int8_per_channel_relative_error", fmt::format("{:.3g}", channel));
  RecordProperty("int8_per_tensor_relative_error", fmt::format("{:.3g}", tensor));
  RecordProperty("float16_relative_error", fmt::format("{:.3g}", half));
  std::printf("relative L2 error of out: int8 K per channel %.3g, int8 K per tensor %.3g, float16 %.3g\n", channel,
              tensor, half);
  EXPECT_LT(3 * channel, tensor);
  EXPECT_LT(half, channel);
}

// --- bad operands ------------------------------------------------------------------------------------

template <class Error>
void expect_refused(const StoredAttentionParams& params, const std::string& message) {
  Tensor<float> out({1, 1, 4, 8});
  try {
    attention_forward(params, {.out = out.view(), .weights = {}, .lse = {}});
    FAIL() << "accepted; expected: " << message;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

TEST(AttentionStored, BadOperandsAreRefusedNamingTheArgument) {
  Problem p = random_problem({1, 1, 4, 6, 8, 8}, 80);
  const Stored s = store_problem(p, StorageType::float32, StorageType::int8, StorageType::int8);
  const testing::AttentionOperands<float> ops(p);
  const StoredAttentionParams good = stored_params(s, ops.params());

  StoredAttentionParams no_scales = good;
  no_scales.k.scales.reset();
  expect_refused<ValueError>(no_scales, "k.scales: an int8 k needs its scales");

  Tensor<float> wrong({1, 1, 1, 5}, 1.0f);
  StoredAttentionParams wrong_shape = good;
  wrong_shape.v.scales = wrong.cview();
  expect_refused<ShapeError>(wrong_shape, "v.scales");

  Tensor<float> nan_scales({1, 1, 1, 8}, 1.0f);
  nan_scales.view()(0, 0, 0, 3) = std::nanf("");
  StoredAttentionParams with_nan = good;
  with_nan.k.scales = nan_scales.cview();
  expect_refused<ValueError>(with_nan, "k.scales: expected finite values");

  StoredAttentionParams int8_q = good;
  int8_q.q = s.k;
  expect_refused<ValueError>(int8_q, "q: int8 storage is for k and v");

  const Tensor<uint16_t> half = to_float16(s.v32.cview());
  StoredAttentionParams half_with_scales = good;
  half_with_scales.v = StoredView::float16(half.cview());
  half_with_scales.v.scales = nan_scales.cview();
  expect_refused<ValueError>(half_with_scales, "v.scales: given, but v is float16; only int8 has scales");

  const Tensor<int64_t> cu({2}, std::vector<int64_t>{0, 4});
  const Tensor<int64_t> cu_k({2}, std::vector<int64_t>{0, 6});
  StoredAttentionParams packed = good;
  packed.mask.cu_seqlens_q = cu.cview();
  packed.mask.cu_seqlens_k = cu_k.cview();
  expect_refused<ValueError>(packed, "packed sequences are not taken with stored");

  StoredAttentionParams short_k = good;
  short_k.k.shape = Shape{1, 1, 6, 7};
  expect_refused<ShapeError>(short_k, "k");
}

}  // namespace
}  // namespace qkv
