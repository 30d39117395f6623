// The paged KV cache (src/ops/kv_cache.cpp): sequences grown in blocks of every size over pages
// of awkward lengths, in every storage type, attended to on every SIMD target bit-identically to
// the fused kernel on the contiguous float32 values the cache holds; what it stores against what
// was appended; its refusals.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/kv_cache.hpp"
#include "qkv/ops/quantize.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::bit_identical;
using testing::cast;
using testing::on_every_target;

Tensor<float> random_rows(const Shape& shape, Rng& rng, double sigma = 1.0) {
  return cast<float>(testing::random_tensor<double>(shape, rng, sigma));
}

struct Attended {
  Tensor<double> out, lse;
};

Attended from_cache(const KvCache& cache, int64_t id, const Tensor<float>& q, const KvAttendOptions& options) {
  const Shape& s = q.shape();
  Tensor<float> out({s[0], s[1], cache.shape().dv}), lse({s[0], s[1]});
  cache.attend(id, q.cview(), {.out = out.view(), .weights = {}, .lse = lse.view()}, options);
  return {cast<double>(out), cast<double>(lse)};
}

// What attend() would compute with `options`, as attention over k and v [Hkv, length, D].
AttentionParams<float> params_of(const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v,
                                 const KvAttendOptions& options) {
  return {.q = q.cview(),
          .k = k.cview(),
          .v = v.cview(),
          .scale = options.scale,
          .mask = {.causal = options.causal,
                   .window = options.window,
                   .allowed = options.allowed,
                   .bias = options.bias,
                   .alibi_slopes = options.alibi_slopes},
          .softcap = options.softcap,
          .sinks = options.sinks};
}

// The fused kernel on the cache's contents copied out contiguous, float32.
Attended from_copy(const KvCache& cache, int64_t id, const Tensor<float>& q, const KvAttendOptions& options) {
  const Tensor<float> k = cache.keys(id), v = cache.values(id);
  const Shape& s = q.shape();
  Tensor<float> out({s[0], s[1], cache.shape().dv}), lse({s[0], s[1]});
  attention_forward<float>(params_of(q, k, v, options), {.out = out.view(), .weights = {}, .lse = lse.view()},
                           AttentionImpl::fused);
  return {cast<double>(out), cast<double>(lse)};
}

// The mask [1, Tq, length] of Tq draft tokens verified in one step: a binary tree whose node i has
// parent (i − 1) / 2, each seeing the sequence before the drafts and its own branch.
Tensor<uint8_t> tree_mask(int64_t tq, int64_t length) {
  Tensor<uint8_t> m({1, tq, length});
  for (int64_t i = 0; i < tq; ++i) {
    for (int64_t j = 0; j < length - tq; ++j) m.view()(0, i, j) = 1;
    for (int64_t a = i;; a = (a - 1) / 2) {
      m.view()(0, i, length - tq + a) = 1;
      if (a == 0) break;
    }
  }
  return m;
}

// ALiBi's standard slopes for `heads` heads, float32.
Tensor<float> standard_slopes(int64_t heads) {
  const std::vector<double> slopes = alibi_slopes(heads);
  return Tensor<float>(Shape{heads}, std::vector<float>(slopes.begin(), slopes.end()));
}

constexpr StorageType kAllTypes[] = {StorageType::float32, StorageType::float16, StorageType::bfloat16,
                                     StorageType::int8};

TEST(KvCache, AttendMatchesTheFusedKernelOnItsContentsBitForBit) {
  for (const StorageType type : kAllTypes) {
    for (const int64_t page_tokens : {int64_t{48}, int64_t{256}}) {
      SCOPED_TRACE(fmt::format("{}, pages of {} tokens", storage_name(type), page_tokens));
      KvCache cache({.kv_heads = 2, .dk = 72, .dv = 40, .type = type, .page_tokens = page_tokens, .pages = 64});
      const int64_t a = cache.add_sequence(), b = cache.add_sequence();
      Rng rng(static_cast<uint64_t>(page_tokens) + static_cast<uint64_t>(type));
      // Blocks of every size, the two sequences interleaved, so their pages interleave in the pool.
      for (const int64_t n : {1, 7, 300, 1, 64, 1, 1, 700, 5}) {
        for (const int64_t id : {a, b}) {
          cache.append(id, random_rows({2, n, 72}, rng, 2.0).cview(), random_rows({2, n, 40}, rng).cview());
        }
      }
      ASSERT_EQ(cache.length(a), 1080);
      for (const int64_t tq : {1, 3, 12, 40}) {
        const Tensor<float> q = random_rows({4, tq, 72}, rng);
        for (const bool causal : {true, false}) {
          const KvAttendOptions options{.causal = causal};
          on_every_target([&] {
            const Attended got = from_cache(cache, b, q, options), want = from_copy(cache, b, q, options);
            EXPECT_TRUE(bit_identical(got.out, want.out)) << "Tq=" << tq << (causal ? " causal" : "");
            EXPECT_TRUE(bit_identical(got.lse, want.lse)) << "Tq=" << tq;
          });
        }
      }
      const Tensor<float> q = random_rows({4, 1, 72}, rng);
      const KvAttendOptions windowed{.scale = 0.3, .window = AttentionWindow{.left = 100, .right = 0}, .softcap = 20.0};
      EXPECT_TRUE(bit_identical(from_cache(cache, a, q, windowed).out, from_copy(cache, a, q, windowed).out));
      // Seven drafts verified at once: a tree mask, a bias per head and key, and ALiBi.
      const Tensor<float> drafts = random_rows({4, 7, 72}, rng);
      const Tensor<uint8_t> tree = tree_mask(7, cache.length(a));
      const Tensor<float> bias = random_rows({4, 1, cache.length(a)}, rng), slopes = standard_slopes(4);
      const KvAttendOptions masked{.allowed = tree.cview(), .bias = bias.cview(), .alibi_slopes = slopes.cview()};
      on_every_target([&] {
        const Attended got = from_cache(cache, a, drafts, masked), want = from_copy(cache, a, drafts, masked);
        EXPECT_TRUE(bit_identical(got.out, want.out));
        EXPECT_TRUE(bit_identical(got.lse, want.lse));
      });
    }
  }
}

// x [H, T, D] as [1, H, T, D] in float64.
Tensor<double> batch_of_one(const Tensor<float>& x) {
  const Shape& s = x.shape();
  const Tensor<double> d = cast<double>(x);
  return Tensor<double>({1, s[0], s[1], s[2]}, std::vector<double>(d.data(), d.data() + d.numel()));
}

TEST(KvCache, DecodeOfOutAloneReadsThePagesInPlace) {
  // Out without lse (inference) takes the few-query layout, which reads the pages in place a block
  // of keys at a time wherever the pages end (pages of 13 tokens end inside blocks). float32:
  // bit-identical to the kernel on the contents copied out. The narrower types split the keys into
  // chunks of a size set by their bytes per row (so the partial sums merge in another order than a
  // float32 copy's), and int8's scales multiply queries and weights: within the float64 reference's
  // tolerance.
  for (const StorageType type : kAllTypes) {
    for (const int64_t page_tokens : {int64_t{13}, int64_t{48}}) {
      SCOPED_TRACE(fmt::format("{}, pages of {} tokens", storage_name(type), page_tokens));
      KvCache cache({.kv_heads = 2, .dk = 40, .dv = 24, .type = type, .page_tokens = page_tokens, .pages = 200});
      const int64_t id = cache.add_sequence();
      Rng rng(static_cast<uint64_t>(page_tokens) * 7 + static_cast<uint64_t>(type));
      for (const int64_t n : {1, 300, 7, 900}) {
        cache.append(id, random_rows({2, n, 40}, rng, 2.0).cview(), random_rows({2, n, 24}, rng).cview());
      }
      const Tensor<float> k = cache.keys(id), v = cache.values(id);
      const int64_t length = cache.length(id);
      const Tensor<float> bias = random_rows({4, 1, length}, rng), slopes = standard_slopes(4);
      for (const int64_t tq : {1, 5}) {
        const Tensor<float> q = random_rows({4, tq, 40}, rng);
        const Tensor<uint8_t> tree = tree_mask(tq, length);
        const KvAttendOptions options[] = {
            {.causal = true},
            {.scale = 0.3, .window = AttentionWindow{.left = 333, .right = 0}, .softcap = 20.0},
            {.allowed = tree.cview(), .bias = bias.cview(), .alibi_slopes = slopes.cview()}};
        for (const KvAttendOptions& o : options) {
          SCOPED_TRACE(fmt::format("Tq={}{}{}", tq, o.window ? ", window and softcap" : "",
                                   o.allowed ? ", a tree mask, a bias and ALiBi" : ""));
          on_every_target([&] {
            Tensor<float> got({4, tq, 24});
            cache.attend(id, q.cview(), {.out = got.view(), .weights = {}, .lse = {}}, o);
            if (type == StorageType::float32) {
              Tensor<float> want({4, tq, 24});
              attention_forward<float>(params_of(q, k, v, o), {.out = want.view(), .weights = {}, .lse = {}},
                                       AttentionImpl::fused);
              EXPECT_TRUE(bit_identical(cast<double>(got), cast<double>(want)));
              return;
            }
            testing::AttentionProblem p{.q = batch_of_one(q), .k = batch_of_one(k), .v = batch_of_one(v)};
            p.causal = o.causal;
            p.scale = o.scale;
            p.window = o.window;
            p.softcap = o.softcap;
            if (o.allowed) {
              p.allowed =
                  Tensor<uint8_t>({1, 1, tq, length}, std::vector<uint8_t>(tree.data(), tree.data() + tree.numel()));
              p.bias = batch_of_one(bias);
              p.alibi = cast<double>(slopes);
            }
            const testing::Forward exact = testing::reference_forward(p);
            const testing::AttentionYardsticks y = testing::attention_yardsticks(p, testing::random_dout(p, 3));
            EXPECT_TRUE(testing::all_close("out", batch_of_one(got), exact.out,
                                           testing::attention_tolerance(y, testing::NaiveResult::out, exact.out)));
          });
        }
      }
    }
  }
}

TEST(KvCache, StoresWhatWasAppendedInItsType) {
  Rng rng(5);
  const Tensor<float> k = random_rows({3, 200, 16}, rng, 4.0), v = random_rows({3, 200, 8}, rng);
  for (const StorageType type : kAllTypes) {
    SCOPED_TRACE(storage_name(type));
    KvCache cache({.kv_heads = 3, .dk = 16, .dv = 8, .type = type, .page_tokens = 32, .pages = 7});
    const int64_t id = cache.add_sequence();
    // Token by token, so that int8 keys raise their page's scales as larger values arrive.
    for (int64_t t = 0; t < 200; ++t) {
      Tensor<float> kt({3, 1, 16}), vt({3, 1, 8});
      for (int64_t h = 0; h < 3; ++h) {
        for (int64_t c = 0; c < 16; ++c) kt.view()(h, 0, c) = k.view()(h, t, c);
        for (int64_t c = 0; c < 8; ++c) vt.view()(h, 0, c) = v.view()(h, t, c);
      }
      cache.append(id, kt.cview(), vt.cview());
    }
    const Tensor<float> keys = cache.keys(id), values = cache.values(id);
    for (int64_t h = 0; h < 3; ++h) {
      for (int64_t t = 0; t < 200; ++t) {
        for (int64_t c = 0; c < 16; ++c) {
          const float x = k.view()(h, t, c), got = keys.view()(h, t, c);
          if (type == StorageType::float32) {
            ASSERT_EQ(got, x);
          } else if (type == StorageType::float16) {
            ASSERT_EQ(got, float_from_float16(float16_from_float(x)));
          } else if (type == StorageType::bfloat16) {
            ASSERT_EQ(got, float_from_bfloat16(bfloat16_from_float(x)));
          } else {
            // Within the bound the header states: one step of the page's last scale, < 2·max|k|/127.
            float page_max = 0;
            for (int64_t r = t / 32 * 32; r < std::min<int64_t>(200, t / 32 * 32 + 32); ++r)
              page_max = std::max(page_max, std::abs(k.view()(h, r, c)));
            ASSERT_LE(std::abs(got - x), 2.0f * page_max / 127.0f * 1.0001f) << h << " " << t << " " << c;
          }
        }
        for (int64_t c = 0; c < 8; ++c) {
          if (type != StorageType::int8) continue;
          float row_max = 0;
          for (int64_t cc = 0; cc < 8; ++cc) row_max = std::max(row_max, std::abs(v.view()(h, t, cc)));
          ASSERT_LE(std::abs(values.view()(h, t, c) - v.view()(h, t, c)), 0.5f * row_max / 127.0f * 1.0001f);
        }
      }
    }
  }
}

// An operand of any storage type appended in blocks of awkward sizes (a strided one among them)
// holds, in every cache type, exactly what its float32 values appended would; one of the cache's
// own float type is held bit for bit.
TEST(KvCache, AppendsStoredOperandsAsTheirFloat32ValuesWould) {
  Rng rng(11);
  const Tensor<float> k32 = random_rows({2, 70, 16}, rng, 3.0), v32 = random_rows({2, 70, 24}, rng);
  // k as [Hkv, T, Dk] seen through a transposed copy, so that its rows are not contiguous.
  Tensor<float> k_t({16, 70, 2});
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t t = 0; t < 70; ++t)
      for (int64_t c = 0; c < 16; ++c) k_t.view()(c, t, h) = k32.view()(h, t, c);
  const Tensor<uint16_t> k16 = to_float16(k32.cview()), v16 = to_float16(v32.cview());
  const Tensor<uint16_t> kb = to_bfloat16(k32.cview()), vb = to_bfloat16(v32.cview());
  const Int8Array k8 = quantize_int8(k32.cview(), QuantizeGroup::per_channel);
  const Int8Array v8 = quantize_int8(v32.cview(), QuantizeGroup::per_token);
  const TensorView<const float> k_strided{k_t.data(), Shape{2, 70, 16}, Strides{1, 2, 140}};
  const std::pair<StoredView, StoredView> operands[] = {
      {StoredView::float32(k_strided), StoredView::float32(v32.cview())},
      {StoredView::float16(k16.cview()), StoredView::float16(v16.cview())},
      {StoredView::bfloat16(kb.cview()), StoredView::bfloat16(vb.cview())},
      {k8.stored(), v8.stored()},
      {StoredView::float16(k16.cview()), v8.stored()},
  };
  // Tokens [start, start + n) of a [Hkv, T, D] operand, its per-token scales with them.
  const auto tokens = [](StoredView x, int64_t start, int64_t n) {
    x.data = static_cast<const uint8_t*>(x.data) + start * x.strides[1] * storage_bytes(x.type);
    x.shape[1] = n;
    if (x.scales && x.scales->shape[1] != 1) {
      x.scales->data += start * x.scales->strides[1];
      x.scales->shape[1] = n;
    }
    return x;
  };
  for (const StorageType type : kAllTypes) {
    for (const auto& [k, v] : operands) {
      SCOPED_TRACE(fmt::format("cache {}, k {}, v {}", storage_name(type), storage_name(k.type), storage_name(v.type)));
      const KvCacheShape shape{.kv_heads = 2, .dk = 16, .dv = 24, .type = type, .page_tokens = 13, .pages = 6};
      KvCache stored(shape), values(shape);
      const int64_t id = stored.add_sequence();
      values.add_sequence();
      const Tensor<float> kf = to_float32(k), vf = to_float32(v);
      int64_t start = 0;
      for (const int64_t n : {1, 5, 13, 1, 50}) {
        stored.append(id, tokens(k, start, n), tokens(v, start, n));
        values.append(id, tokens(StoredView::float32(kf.cview()), start, n),
                      tokens(StoredView::float32(vf.cview()), start, n));
        start += n;
      }
      ASSERT_EQ(stored.length(id), 70);
      const KvCacheState a = stored.state(), b = values.state();
      EXPECT_EQ(a.k_pool, b.k_pool);
      EXPECT_EQ(a.v_pool, b.v_pool);
      EXPECT_EQ(a.k_scales, b.k_scales);
      EXPECT_EQ(a.v_scales, b.v_scales);
    }
  }
}

TEST(KvCache, AnEmptySequenceGivesZerosAndMinusInfinity) {
  KvCache cache({.kv_heads = 1, .dk = 8, .dv = 8, .type = StorageType::float16, .page_tokens = 16, .pages = 2});
  const int64_t id = cache.add_sequence();
  Rng rng(6);
  const Attended got = from_cache(cache, id, random_rows({2, 1, 8}, rng), {});
  for (int64_t i = 0; i < got.out.numel(); ++i) EXPECT_EQ(got.out[i], 0.0);
  EXPECT_EQ(got.lse[0], -std::numeric_limits<double>::infinity());
}

TEST(KvCache, AQueryTheMaskHidesEverythingFromGetsZerosAndMinusInfinity) {
  for (const StorageType type : kAllTypes) {
    SCOPED_TRACE(storage_name(type));
    KvCache cache({.kv_heads = 1, .dk = 24, .dv = 16, .type = type, .page_tokens = 16, .pages = 8});
    const int64_t id = cache.add_sequence();
    Rng rng(static_cast<uint64_t>(type) + 11);
    cache.append(id, random_rows({1, 70, 24}, rng).cview(), random_rows({1, 70, 16}, rng).cview());
    const Tensor<float> q = random_rows({2, 3, 24}, rng);
    // Query 1 sees no key; queries 0 and 2 see every other one, and a bias of −inf hides one more.
    Tensor<uint8_t> allowed({1, 3, 70});
    for (int64_t j = 0; j < 70; ++j) allowed.view()(0, 0, j) = allowed.view()(0, 2, j) = static_cast<uint8_t>(j % 2);
    Tensor<float> bias({1, 1, 70});
    bias[1] = -std::numeric_limits<float>::infinity();
    const Tensor<float> slopes = standard_slopes(2);
    const KvAttendOptions o{.allowed = allowed.cview(), .bias = bias.cview(), .alibi_slopes = slopes.cview()};
    on_every_target([&] {
      for (const bool with_lse : {true, false}) {
        Tensor<float> out({2, 3, 16}), lse({2, 3});
        AttentionOutputs<float> outputs{.out = out.view(), .weights = {}, .lse = {}};
        if (with_lse) outputs.lse = lse.view();
        cache.attend(id, q.cview(), outputs, o);
        for (int64_t h = 0; h < 2; ++h) {
          for (int64_t c = 0; c < 16; ++c) EXPECT_EQ(out.view()(h, 1, c), 0.0f) << "head " << h;
          for (const int64_t i : {0, 2}) {
            for (int64_t c = 0; c < 16; ++c) EXPECT_TRUE(std::isfinite(out.view()(h, i, c)));
          }
          if (with_lse) {
            EXPECT_EQ(lse.view()(h, 1), -std::numeric_limits<float>::infinity());
          }
        }
      }
    });
  }
}

template <class Error>
void expect_refused(const std::function<void()>& call, const std::string& message) {
  try {
    call();
    FAIL() << "accepted; expected: " << message;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

TEST(KvCache, BadCallsAreRefusedAndChangeNothing) {
  KvCache cache({.kv_heads = 2, .dk = 16, .dv = 8, .type = StorageType::int8, .page_tokens = 64, .pages = 3});
  const int64_t id = cache.add_sequence();
  Rng rng(7);
  cache.append(id, random_rows({2, 100, 16}, rng).cview(), random_rows({2, 100, 8}, rng).cview());
  expect_refused<ShapeError>(
      [&] {
        cache.append(id, random_rows({3, 5, 16}, rng).cview(), random_rows({3, 5, 8}, rng).cview());
      },
      "k: expected shape [2, 5, 16], got [3, 5, 16]");
  expect_refused<ShapeError>(
      [&] {
        cache.append(id, random_rows({2, 5, 16}, rng).cview(), random_rows({2, 4, 8}, rng).cview());
      },
      "v: expected shape [2, 5, 8], got [2, 4, 8]");
  expect_refused<ResourceError>(
      [&] {
        cache.append(id, random_rows({2, 100, 16}, rng).cview(), random_rows({2, 100, 8}, rng).cview());
      },
      "k: appending 100 tokens to sequence 0 (length 100) needs 2 more pages of 64 tokens, but the cache has 1 of "
      "its 3 free");
  Tensor<float> nan_k({2, 1, 16});
  nan_k.view()(1, 0, 3) = std::nanf("");
  expect_refused<ValueError>(
      [&] {
        cache.append(id, nan_k.cview(), random_rows({2, 1, 8}, rng).cview());
      },
      "k: expected finite values");
  const Int8Array k8 = quantize_int8(random_rows({2, 1, 16}, rng).cview(), QuantizeGroup::per_channel);
  StoredView no_scales = k8.stored();
  no_scales.scales.reset();
  expect_refused<ValueError>(
      [&] {
        cache.append(id, no_scales, StoredView::float32(random_rows({2, 1, 8}, rng).cview()));
      },
      "k.scales: an int8 k needs its scales");
  expect_refused<ValueError>(
      [&] {
        cache.append(id, StoredView::int8(k8.values.cview(), {}),
                     StoredView::float32(random_rows({2, 1, 8}, rng).cview()));
      },
      "k.scales: no data for shape []");
  Tensor<float> nan_scales = k8.scales;
  nan_scales.view()(1, 0, 2) = std::nanf("");
  expect_refused<ValueError>(
      [&] {
        cache.append(id, StoredView::int8(k8.values.cview(), nan_scales.cview()),
                     StoredView::float32(random_rows({2, 1, 8}, rng).cview()));
      },
      "k.scales: expected finite values");
  const Tensor<float> three_scales({3, 1, 16});
  expect_refused<ShapeError>(
      [&] {
        cache.append(id, StoredView::int8(k8.values.cview(), three_scales.cview()),
                     StoredView::float32(random_rows({2, 1, 8}, rng).cview()));
      },
      "k.scales");
  Tensor<uint16_t> inf_bits = to_float16(random_rows({2, 1, 8}, rng).cview());
  inf_bits.view()(0, 0, 5) = 0x7C00;
  expect_refused<ValueError>(
      [&] {
        cache.append(id, StoredView::float32(random_rows({2, 1, 16}, rng).cview()),
                     StoredView::float16(inf_bits.cview()));
      },
      "v: expected finite values");
  EXPECT_EQ(cache.length(id), 100);
  expect_refused<ShapeError>(
      [&] {
        Tensor<float> out({3, 1, 8});
        cache.attend(id, random_rows({3, 1, 16}, rng).cview(), {.out = out.view(), .weights = {}, .lse = {}});
      },
      "q: expected H a multiple of the cache's 2 kv heads, got shape [3, 1, 16]");
  // Four query heads over the sequence's 100 keys, with `options`.
  const auto attend_with = [&](const KvAttendOptions& options) {
    return [&cache, &rng, id, options] {
      Tensor<float> out({4, 1, 8});
      cache.attend(id, random_rows({4, 1, 16}, rng).cview(), {.out = out.view(), .weights = {}, .lse = {}}, options);
    };
  };
  const Tensor<float> three_slopes({3}), short_bias({4, 2, 100});
  const Tensor<uint8_t> short_mask({1, 1, 99});
  expect_refused<ShapeError>(attend_with({.alibi_slopes = three_slopes.cview()}),
                             "alibi_slopes: expected shape [4], got [3]");
  expect_refused<ShapeError>(attend_with({.allowed = short_mask.cview()}),
                             "mask: shape [1, 1, 99] does not broadcast to [4, 1, 100]");
  expect_refused<ShapeError>(attend_with({.bias = short_bias.cview()}),
                             "bias: shape [4, 2, 100] does not broadcast to [4, 1, 100]");
  const int64_t other = cache.add_sequence();
  EXPECT_EQ(cache.free_pages(), 1);
  cache.remove_sequence(id);
  EXPECT_EQ(cache.free_pages(), 3);
  expect_refused<ValueError>([&] { cache.length(id); }, "sequence: no sequence 0 in the cache");
  cache.append(other, random_rows({2, 192, 16}, rng).cview(), random_rows({2, 192, 8}, rng).cview());
  EXPECT_EQ(cache.free_pages(), 0);
  expect_refused<ValueError>([] { KvCache({.kv_heads = 0, .dk = 1, .dv = 1, .pages = 1}); },
                             "KvCacheShape.kv_heads: expected at least 1, got 0");
}

// A value the cache's type cannot hold would be stored as an infinity, which attention and a saved
// cache's file refuse: the append is refused instead, before anything is stored.
TEST(KvCache, ValuesItsTypeCannotHoldAreRefused) {
  Rng rng(12);
  KvCache half({.kv_heads = 1, .dk = 4, .dv = 4, .type = StorageType::float16, .page_tokens = 4, .pages = 2});
  const int64_t id = half.add_sequence();
  Tensor<float> k = random_rows({1, 3, 4}, rng);
  k.view()(0, 2, 1) = 70000.0f;
  expect_refused<ValueError>(
      [&] {
        half.append(id, k.cview(), random_rows({1, 3, 4}, rng).cview());
      },
      "k: expected values that a float16 cache holds (finite, |x| < 65520), got 70000 at [0, 2, 1]");
  k.view()(0, 2, 1) = 65504.0f;
  half.append(id, k.cview(), random_rows({1, 3, 4}, rng).cview());
  EXPECT_EQ(half.keys(id).view()(0, 2, 1), 65504.0f);

  KvCache brain({.kv_heads = 1, .dk = 1, .dv = 1, .type = StorageType::bfloat16, .page_tokens = 4, .pages = 1});
  const int64_t seq = brain.add_sequence();
  const float largest = float_from_bfloat16(0x7F7F);  // rounds to itself; half an ulp more, to infinity
  Tensor<float> near({1, 2, 1});
  near[0] = largest;
  near[1] = -std::nextafter(std::bit_cast<float>(uint32_t{0x7F7F8000}), 0.0f);
  brain.append(seq, near.cview(), near.cview());
  EXPECT_EQ(brain.keys(seq)[1], -largest);
  near[1] = std::bit_cast<float>(uint32_t{0x7F7F8000});
  expect_refused<ValueError>([&] { brain.append(seq, near.cview(), near.cview()); },
                             "k: expected values that a bfloat16 cache holds (finite), got");
  EXPECT_EQ(brain.length(seq), 2);

  KvCache wide({.kv_heads = 1, .dk = 4, .dv = 4, .type = StorageType::float32, .page_tokens = 4, .pages = 2});
  const int64_t other = wide.add_sequence();
  Int8Array v = quantize_int8(random_rows({1, 3, 4}, rng).cview(), QuantizeGroup::per_token);
  v.scales.view()(0, 1, 0) = 1e37f;
  for (int64_t c = 0; c < 4; ++c) v.values.view()(0, 1, c) = c == 3 ? -127 : 10;
  expect_refused<ValueError>(
      [&] {
        wide.append(other, StoredView::float32(random_rows({1, 3, 4}, rng).cview()), v.stored());
      },
      "v: expected values that a float32 cache holds (finite), got -inf at [0, 1, 3]");
  EXPECT_EQ(half.length(id), 3);
  EXPECT_EQ(wide.length(other), 0);
}

// Whether the pages lie one after another in the pool.
bool consecutive(const std::vector<int64_t>& pages) {
  for (size_t i = 1; i < pages.size(); ++i) {
    if (pages[i] != pages[i - 1] + 1) return false;
  }
  return true;
}

TEST(KvCache, SequencesAppendedInTurnEachLieInOneRun) {
  KvCache cache({.kv_heads = 1, .dk = 4, .dv = 4, .type = StorageType::float16, .page_tokens = 4, .pages = 40});
  const int64_t a = cache.add_sequence(), b = cache.add_sequence();
  Rng rng(3);
  const Tensor<float> k = random_rows({1, 1, 4}, rng), v = random_rows({1, 1, 4}, rng);
  for (int t = 0; t < 80; ++t) {
    for (const int64_t id : {a, b}) cache.append(id, k.cview(), v.cview());
  }
  // b starts halfway through the pages a grows into, and each takes its half.
  KvCacheState state = cache.state();
  EXPECT_EQ(state.sequences[0].pages.front(), 0);
  EXPECT_EQ(state.sequences[1].pages.front(), 20);
  EXPECT_TRUE(consecutive(state.sequences[0].pages));
  EXPECT_TRUE(consecutive(state.sequences[1].pages));
  // A sequence that starts where a removed one lay takes the start of its run.
  cache.remove_sequence(a);
  const int64_t c = cache.add_sequence();
  cache.append(c, random_rows({1, 9, 4}, rng).cview(), random_rows({1, 9, 4}, rng).cview());
  state = cache.state();
  EXPECT_EQ(state.sequences[static_cast<size_t>(c)].pages, (std::vector<int64_t>{0, 1, 2}));
  // Once they meet, a sequence goes on in the largest free run.
  KvCache full({.kv_heads = 1, .dk = 4, .dv = 4, .type = StorageType::float16, .page_tokens = 4, .pages = 12});
  const int64_t x = full.add_sequence(), y = full.add_sequence();
  for (int t = 0; t < 20; ++t) {
    for (const int64_t id : {x, y}) full.append(id, k.cview(), v.cview());
  }
  full.append(x, random_rows({1, 8, 4}, rng).cview(), random_rows({1, 8, 4}, rng).cview());
  EXPECT_EQ(full.state().sequences[1].pages, (std::vector<int64_t>{6, 7, 8, 9, 10}));
  EXPECT_EQ(full.state().sequences[0].pages, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 11}));
}

TEST(KvCache, CompactingPutsEachSequenceInOneRunAndChangesNothingElse) {
  for (const StorageType type : kAllTypes) {
    SCOPED_TRACE(storage_name(type));
    KvCache cache({.kv_heads = 2, .dk = 24, .dv = 8, .type = type, .page_tokens = 4, .pages = 30});
    const int64_t a = cache.add_sequence(), gone = cache.add_sequence(), b = cache.add_sequence();
    Rng rng(41 + static_cast<uint64_t>(type));
    // Appended in turn until they meet, then on in pieces: a and b each end up in several runs.
    for (const int64_t n : {9, 13, 6, 3}) {
      for (const int64_t id : {a, gone, b}) {
        cache.append(id, random_rows({2, n, 24}, rng, 3.0).cview(), random_rows({2, n, 8}, rng).cview());
      }
    }
    cache.remove_sequence(gone);
    ASSERT_FALSE(consecutive(cache.state().sequences[static_cast<size_t>(a)].pages) &&
                 consecutive(cache.state().sequences[static_cast<size_t>(b)].pages));
    const KvCache before = KvCache::from_state(cache.state());
    const Tensor<float> q = random_rows({4, 3, 24}, rng);
    cache.compact();
    const KvCacheState state = cache.state();
    const std::vector<int64_t>& pages_a = state.sequences[static_cast<size_t>(a)].pages;
    const std::vector<int64_t>& pages_b = state.sequences[static_cast<size_t>(b)].pages;
    EXPECT_EQ(pages_a.front(), 0);
    EXPECT_TRUE(consecutive(pages_a));
    EXPECT_EQ(pages_b.front(), pages_a.back() + 1);
    EXPECT_TRUE(consecutive(pages_b));
    EXPECT_EQ(state.free_pages.front(), pages_b.back() + 1);
    EXPECT_TRUE(consecutive(state.free_pages));
    EXPECT_EQ(cache.free_pages(), before.free_pages());
    EXPECT_THROW(cache.length(gone), ValueError);
    for (const int64_t id : {a, b}) {
      EXPECT_EQ(cache.length(id), before.length(id));
      EXPECT_TRUE(bit_identical(cast<double>(cache.keys(id)), cast<double>(before.keys(id))));
      EXPECT_TRUE(bit_identical(cast<double>(cache.values(id)), cast<double>(before.values(id))));
      EXPECT_TRUE(bit_identical(from_cache(cache, id, q, {}).out, from_cache(before, id, q, {}).out));
      EXPECT_TRUE(bit_identical(from_cache(cache, id, q, {}).lse, from_cache(before, id, q, {}).lse));
    }
    // It grows on as the cache it was would (the same int8 scales raised), from its new place.
    KvCache grown = KvCache::from_state(before.state());
    const Tensor<float> k = random_rows({2, 10, 24}, rng, 5.0), v = random_rows({2, 10, 8}, rng);
    for (KvCache* c : {&cache, &grown}) c->append(a, k.cview(), v.cview());
    EXPECT_TRUE(bit_identical(cast<double>(cache.keys(a)), cast<double>(grown.keys(a))));
    EXPECT_TRUE(bit_identical(from_cache(cache, a, q, {}).out, from_cache(grown, a, q, {}).out));
    EXPECT_NO_THROW(KvCache::from_state(cache.state()));
  }
}

TEST(KvCache, ItsStateMakesTheSameCacheAndGrowsIt) {
  for (const StorageType type : kAllTypes) {
    SCOPED_TRACE(storage_name(type));
    KvCache cache({.kv_heads = 2, .dk = 24, .dv = 8, .type = type, .page_tokens = 16, .pages = 12});
    const int64_t a = cache.add_sequence(), gone = cache.add_sequence(), b = cache.add_sequence();
    Rng rng(11 + static_cast<uint64_t>(type));
    for (const int64_t n : {5, 30, 1}) {
      for (const int64_t id : {a, gone, b}) {
        cache.append(id, random_rows({2, n, 24}, rng, 3.0).cview(), random_rows({2, n, 8}, rng).cview());
      }
    }
    cache.remove_sequence(gone);
    KvCache copy = KvCache::from_state(cache.state());
    EXPECT_EQ(copy.free_pages(), cache.free_pages());
    EXPECT_THROW(copy.length(gone), ValueError);
    // Both grow alike: the same pages handed out, the same int8 scales raised.
    copy.add_pages(5);
    EXPECT_EQ(copy.free_pages(), cache.free_pages() + 5);
    EXPECT_EQ(copy.shape().pages, 17);
    // Each head's pages moved apart to make room for the new ones: what they hold is unchanged.
    for (const int64_t id : {a, b}) {
      EXPECT_TRUE(bit_identical(cast<double>(copy.keys(id)), cast<double>(cache.keys(id))));
      EXPECT_TRUE(bit_identical(cast<double>(copy.values(id)), cast<double>(cache.values(id))));
    }
    const Tensor<float> k = random_rows({2, 40, 24}, rng, 5.0), v = random_rows({2, 40, 8}, rng);
    for (KvCache* c : {&cache, &copy}) c->append(b, k.cview(), v.cview());
    const Tensor<float> q = random_rows({4, 3, 24}, rng);
    EXPECT_TRUE(bit_identical(from_cache(copy, b, q, {}).out, from_cache(cache, b, q, {}).out));
    EXPECT_TRUE(bit_identical(from_cache(copy, a, q, {}).lse, from_cache(cache, a, q, {}).lse));
    // The added pages are used once the first ones run out.
    copy.append(a, random_rows({2, 100, 24}, rng).cview(), random_rows({2, 100, 8}, rng).cview());
    EXPECT_EQ(copy.length(a), 136);
    const KvCacheState grown = copy.state();
    EXPECT_NO_THROW(KvCache::from_state(grown));
    // Pools start on a cache line, so that rows of whole lines are read without split loads.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(grown.k_pool.data()) % 64, 0U);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(grown.v_pool.data()) % 64, 0U);
  }
}

TEST(KvCache, AStateThatDoesNotFitIsRefused) {
  KvCache cache({.kv_heads = 1, .dk = 4, .dv = 4, .type = StorageType::float16, .page_tokens = 4, .pages = 4});
  const int64_t id = cache.add_sequence();
  Rng rng(3);
  cache.append(id, random_rows({1, 6, 4}, rng).cview(), random_rows({1, 6, 4}, rng).cview());
  const KvCacheState good = cache.state();
  const auto refused = [&](const std::function<void(KvCacheState&)>& spoil, const std::string& message) {
    KvCacheState state = good;
    spoil(state);
    expect_refused<ValueError>([&] { KvCache::from_state(state); }, message);
  };
  refused([](KvCacheState& s) { s.k_pool.pop_back(); },
          "k_pool: expected 128 (bytes of [Hkv, pages, page_tokens, Dk] float16), got 127");
  refused([](KvCacheState& s) { s.v_scales.push_back(1); }, "v_scales: expected 0");
  refused([](KvCacheState& s) { s.free_pages.push_back(9); }, "free_pages: expected pages 0 to 3, got page 9");
  refused([](KvCacheState& s) { s.free_pages.push_back(s.sequences[0].pages[0]); }, "is held twice");
  refused([](KvCacheState& s) { s.free_pages.pop_back(); }, "is held by no sequence and is not free");
  refused([](KvCacheState& s) { s.sequences[0].length = 9; }, "sequences[0]: expected 3 pages for 9 tokens");
  refused([](KvCacheState& s) { s.sequences[0].length = -1; }, "sequences[0]: expected");
  refused(
      [](KvCacheState& s) {
        reinterpret_cast<uint16_t*>(s.v_pool.data())[5] = 0x7C00;  // +inf
      },
      "v_pool: expected finite values");
  refused([](KvCacheState& s) { s.shape.dk = 0; }, "KvCacheShape.dk: expected at least 1, got 0");
  KvCache int8({.kv_heads = 1, .dk = 4, .dv = 4, .type = StorageType::int8, .page_tokens = 4, .pages = 1});
  KvCacheState scaled = int8.state();
  scaled.k_scales[2] = -1;
  expect_refused<ValueError>([&] { KvCache::from_state(scaled); },
                             "k_scales: expected finite scales of at least 0, got -1 at 2");
  expect_refused<ValueError>([&] { cache.add_pages(-1); }, "count: expected at least 0 pages, got -1");
  // Sizes past int64 or past the memory are refused before anything is allocated.
  refused([](KvCacheState& s) { s.sequences[0].length = std::numeric_limits<int64_t>::max(); },
          "sequences[0]: expected 2305843009213693952 pages");
  expect_refused<ResourceError>(
      [] {
        KvCache({.kv_heads = 1,
                 .dk = 1,
                 .dv = 1,
                 .type = StorageType::float32,
                 .page_tokens = (int64_t{1} << 62) + 1,
                 .pages = 4});
      },
      "more elements than an int64 counts");
  expect_refused<ResourceError>([&] { cache.add_pages(std::numeric_limits<int64_t>::max()); }, "int64");
  expect_refused<ResourceError>([&] { cache.add_pages(int64_t{1} << 50); }, "the KV cache's pages");
  EXPECT_EQ(cache.shape().pages, 4);
  KvCacheState huge = good;
  huge.shape.pages = int64_t{1} << 45;
  expect_refused<ResourceError>([&] { KvCache::from_state(huge); }, "the KV cache's pages");
}

}  // namespace
}  // namespace qkv
