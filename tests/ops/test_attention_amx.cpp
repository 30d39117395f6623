// The AMX tiles of the bf16 products (src/ops/attention_amx.hpp). Their loops run here on a model of
// the tile instructions as Intel documents them, on every CPU; the packing of V on every CPU that
// has AVX-512; and the CPU's tiles themselves where it has AMX-BF16, else those tests report
// skipped. Products are checked against float64 sums of the same bfloat16 values; attention through
// the tiles is checked end to end by test_attention_stored's bf16 tests, which take the tiles
// wherever amx::available() holds.

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_amx.hpp"
#include "attention_bf16.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/ops/attention.hpp"
#include "testing.hpp"

#define QKV_AMX_TARGET
#include "attention_amx-inl.h"

namespace {

using qkv::amx::RoundUpToTile;

// tdpbf16ps and its companions on eight tiles of 16 rows × 64 bytes, as the Software Developer's
// Manual defines them (Dot, below), bfloat16 subnormals read as 0.
struct ModelTiles {
  using Tile = std::array<std::array<uint32_t, 16>, 16>;
  static inline std::array<Tile, 8> tmm{};
  static inline qkv::amx::TileConfig config{};

  static void StoreConfig(qkv::amx::TileConfig* out) { *out = config; }
  static void LoadConfig(const qkv::amx::TileConfig* in) {
    config = *in;
    tmm = {};
  }
  static void Release() { LoadConfig(&kNone); }
  // Every tile instruction runs in the configuration the loops were written for.
  static void ExpectConfigured() {
    EXPECT_EQ(std::memcmp(&config, &qkv::amx::tiles::kTileConfig, sizeof config), 0) << "tiles not configured";
  }
  template <int t>
  static void Zero() {
    ExpectConfigured();
    tmm[t] = Tile{};
  }
  template <int t>
  static void Load(const void* base, size_t stride) {
    ExpectConfigured();
    for (size_t r = 0; r < 16; ++r) std::memcpy(tmm[t][r].data(), static_cast<const std::byte*>(base) + r * stride, 64);
  }
  template <int t>
  static void Store(void* base, size_t stride) {
    ExpectConfigured();
    for (size_t r = 0; r < 16; ++r) std::memcpy(static_cast<std::byte*>(base) + r * stride, tmm[t][r].data(), 64);
  }
  static constexpr qkv::amx::TileConfig kNone{};
  static float Widen(uint32_t bits16) {
    if ((bits16 & 0x7f80) == 0) bits16 &= 0x8000;
    const uint32_t bits = bits16 << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  }
  static float FlushSubnormal(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
  // The SDM's form: the even and the odd elements of the pairs each summed from zero by fused
  // multiply-adds, then C + (even + odd); subnormal inputs (C's too) read as 0, subnormal results
  // flushed to zero.
  template <int c, int a, int b>
  static void Dot() {
    ExpectConfigured();
    for (size_t m = 0; m < 16; ++m) {
      for (size_t n = 0; n < 16; ++n) {
        float even = 0, odd = 0;
        for (size_t k = 0; k < 16; ++k) {
          const uint32_t aw = tmm[a][m][k], bw = tmm[b][k][n];
          even = FlushSubnormal(std::fma(Widen(aw & 0xffff), Widen(bw & 0xffff), even));
          odd = FlushSubnormal(std::fma(Widen(aw >> 16), Widen(bw >> 16), odd));
        }
        float sum;
        std::memcpy(&sum, &tmm[c][m][n], sizeof sum);
        sum = FlushSubnormal(FlushSubnormal(sum) + FlushSubnormal(even + odd));
        std::memcpy(&tmm[c][m][n], &sum, sizeof sum);
      }
    }
  }
  static void PackValueColumns(const uint16_t* const* rows, size_t nk, size_t dv, uint32_t* out) {
    qkv::amx::tiles::PackValueColumnsByLoops(rows, nk, dv, out);
  }
};

double Value(uint16_t bits) {
  const uint32_t wide = uint32_t{bits} << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

// Random bfloat16 in about [-2, 2]: a float32 cut to its top half.
std::vector<uint16_t> RandomBf16(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<uint16_t> out(n);
  for (uint16_t& x : out) {
    const float f = dist(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    x = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// Row pointers into `data` (rows of `depth`), `stride` elements apart, or every other row apart
// from the last when scattered (as a paged cache's rows may be).
std::vector<const uint16_t*> RowTable(const std::vector<uint16_t>& data, size_t n, size_t stride, bool scattered) {
  std::vector<const uint16_t*> rows(n);
  for (size_t r = 0; r < n; ++r) rows[r] = data.data() + (scattered ? (n - 1 - r) : r) * stride;
  return rows;
}

// Each float is within `bound` of the float64 sum, where bound grows with the terms' magnitudes.
void ExpectNear(double got, double exact, double magnitude, size_t terms, const std::string& what) {
  const double bound = 2.0 * static_cast<double>(terms + 1) * 0x1p-24 * magnitude + 1e-30;
  EXPECT_LE(std::abs(got - exact), bound) << what << ": got " << got << ", float64 " << exact;
}

struct ScoreCase {
  size_t nk, dk, ld;
  bool scattered;
};

// st from `scores` (the CPU's tiles or the model's) against Σ_c k_j[c]·q_i[c] in float64; the rows
// of st past nk are left as they were.
template <class ScoresFn>
void CheckScores(const ScoreCase& c, uint64_t seed, ScoresFn&& scores) {
  std::mt19937_64 rng(seed);
  const size_t stride = c.dk + (c.scattered ? 3 : 0);
  const std::vector<uint16_t> k = RandomBf16(c.nk * stride, rng), q = RandomBf16(c.ld * c.dk, rng);
  const std::vector<const uint16_t*> keys = RowTable(k, c.nk, stride, c.scattered);
  const std::vector<const uint16_t*> queries = RowTable(q, c.ld, c.dk, false);
  std::vector<uint32_t> qt(RoundUpToTile((c.dk + 1) / 2) * c.ld, 0xdeadbeef);
  qkv::bf16::pack_queries(queries.data(), c.ld, c.dk, c.ld, qt.data());
  const float untouched = -12345.0f;
  std::vector<float> st(64 * c.ld, untouched);
  scores(keys.data(), c.nk, c.dk, qt.data(), c.ld, st.data());
  const std::string label = "nk=" + std::to_string(c.nk) + " dk=" + std::to_string(c.dk) +
                            " ld=" + std::to_string(c.ld) + (c.scattered ? " scattered" : "");
  for (size_t j = 0; j < c.nk; ++j) {
    for (size_t i = 0; i < c.ld; ++i) {
      double exact = 0, magnitude = 0;
      for (size_t d = 0; d < c.dk; ++d) {
        const double term = Value(keys[j][d]) * Value(queries[i][d]);
        exact += term;
        magnitude += std::abs(term);
      }
      ExpectNear(st[j * c.ld + i], exact, magnitude, c.dk, label);
    }
  }
  for (size_t j = c.nk; j < 64; ++j) {
    for (size_t i = 0; i < c.ld; ++i) ASSERT_EQ(st[j * c.ld + i], untouched) << label << ": row " << j << " written";
  }
}

// Pᵀ by pairs of keys, rows zero up to a multiple of 16 pairs (bf16::pack_weights' layout), from
// weights already bfloat16.
std::vector<uint32_t> WeightPairs(const std::vector<uint16_t>& p, size_t nk, size_t ld) {
  std::vector<uint32_t> out(RoundUpToTile((nk + 1) / 2) * ld, 0);
  for (size_t j = 0; j < nk; ++j) {
    for (size_t i = 0; i < ld; ++i) out[j / 2 * ld + i] |= uint32_t{p[j * ld + i]} << (j % 2 * 16);
  }
  return out;
}

struct ValueCase {
  size_t nk, dv, ld;
};

// acc from `add_values` against its old values plus Σ_j v_j[c]·p(j, i) in float64.
template <class AddValuesFn>
void CheckAddValues(const ValueCase& c, uint64_t seed, AddValuesFn&& add_values) {
  std::mt19937_64 rng(seed);
  const std::vector<uint16_t> v = RandomBf16(c.nk * c.dv, rng), p = RandomBf16(c.nk * c.ld, rng);
  const std::vector<const uint16_t*> values = RowTable(v, c.nk, c.dv, false);
  const std::vector<uint32_t> pp = WeightPairs(p, c.nk, c.ld);
  const size_t acc_row = 64;
  std::vector<float> acc(c.dv * acc_row);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : acc) x = dist(rng);
  const std::vector<float> before = acc;
  add_values(values.data(), c.nk, c.dv, pp.data(), c.ld, acc.data(), acc_row);
  const std::string label =
      "nk=" + std::to_string(c.nk) + " dv=" + std::to_string(c.dv) + " ld=" + std::to_string(c.ld);
  for (size_t ch = 0; ch < c.dv; ++ch) {
    for (size_t i = 0; i < acc_row; ++i) {
      if (i >= c.ld) {
        ASSERT_EQ(acc[ch * acc_row + i], before[ch * acc_row + i]) << label << ": a column past ld written";
        continue;
      }
      double exact = 0, magnitude = std::abs(before[ch * acc_row + i]);
      for (size_t j = 0; j < c.nk; ++j) {
        const double term = Value(values[j][ch]) * Value(p[j * c.ld + i]);
        exact += term;
        magnitude += std::abs(term);
      }
      ExpectNear(acc[ch * acc_row + i], before[ch * acc_row + i] + exact, magnitude, c.nk + 1, label);
    }
  }
}

// Every size class of the tiles: one row, rows and depths off 16 and 32, one and two tiles of each
// side, chunks of 64 dims past the first, keys read in place and copied.
const ScoreCase kScoreCases[] = {{1, 1, 16, false},   {15, 33, 16, false},  {16, 32, 32, false}, {17, 64, 48, false},
                                 {33, 2, 64, false},  {64, 64, 64, false},  {64, 64, 64, true},  {48, 128, 32, false},
                                 {64, 200, 64, true}, {31, 129, 16, false}, {64, 96, 48, false}, {32, 256, 64, false}};
const ValueCase kValueCases[] = {{1, 1, 16},   {2, 16, 16},   {3, 17, 32},   {31, 33, 48},
                                 {64, 64, 64}, {64, 128, 64}, {40, 200, 16}, {64, 48, 32}};

TEST(AttentionAmx, ModelTilesComputeTheScores) {
  uint64_t seed = 1;
  for (const ScoreCase& c : kScoreCases) {
    qkv::amx::tiles::Scratch scratch;
    CheckScores(c, seed++, [&](auto... args) { qkv::amx::tiles::Scores<ModelTiles>(args..., scratch); });
  }
}

TEST(AttentionAmx, ModelTilesAddTheWeightedValues) {
  uint64_t seed = 100;
  for (const ValueCase& c : kValueCases) {
    qkv::amx::tiles::Scratch scratch;
    CheckAddValues(c, seed++, [&](auto... args) { qkv::amx::tiles::AddValues<ModelTiles>(args..., scratch); });
  }
}

TEST(AttentionAmx, EveryCallGivesBackTheTilesItFound) {
  // Other code in the process may hold tiles of its own between two calls (see attention_amx.hpp).
  using qkv::amx::TileConfig;
  qkv::amx::tiles::Scratch scratch;
  const auto scores = [&](auto... args) { qkv::amx::tiles::Scores<ModelTiles>(args..., scratch); };
  const auto add_values = [&](auto... args) { qkv::amx::tiles::AddValues<ModelTiles>(args..., scratch); };
  const auto same = [](const TileConfig& a, const TileConfig& b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  const TileConfig foreign{.palette = 1, .bytes_per_row = {32, 64}, .rows = {8, 16}};
  for (const TileConfig& before : {ModelTiles::kNone, foreign, qkv::amx::tiles::kTileConfig}) {
    ModelTiles::config = before;
    CheckScores({16, 32, 16, false}, 7, scores);
    EXPECT_TRUE(same(ModelTiles::config, before)) << "palette " << int{before.palette};
    CheckAddValues({16, 16, 16}, 8, add_values);
    EXPECT_TRUE(same(ModelTiles::config, before)) << "palette " << int{before.palette};
  }
  // Inside a session the calls leave the tiles configured; its end gives back what it found.
  ModelTiles::config = foreign;
  {
    const qkv::amx::tiles::Session<ModelTiles> session;
    CheckScores({16, 32, 16, false}, 9, scores);
    EXPECT_TRUE(same(ModelTiles::config, qkv::amx::tiles::kTileConfig));
  }
  EXPECT_TRUE(same(ModelTiles::config, foreign));
}

// ModelTiles with one fault the model of the instructions would not show: each pair's second
// element left out of the products.
struct TilesThatDropHalfThePairs : ModelTiles {
  template <int c, int a, int b>
  static void Dot() {
    for (const int t : {a, b}) {
      for (auto& row : tmm[t]) {
        for (uint32_t& word : row) word &= 0xffff;
      }
    }
    ModelTiles::Dot<c, a, b>();
  }
};

// Tiles whose products land in the transposed places of C: A and B swapped.
struct TilesThatSwapTheirOperands : ModelTiles {
  template <int c, int a, int b>
  static void Dot() {
    ModelTiles::Dot<c, b, a>();
  }
};

TEST(AttentionAmx, TheCheckAtFirstUseTellsRightTilesFromFaultyOnes) {
  EXPECT_EQ(qkv::amx::tiles::CheckTiles<ModelTiles>(), "");
  EXPECT_NE(qkv::amx::tiles::CheckTiles<TilesThatDropHalfThePairs>(), "");
  EXPECT_NE(qkv::amx::tiles::CheckTiles<TilesThatSwapTheirOperands>(), "");
}

TEST(AttentionAmx, ValueColumnsMatchTheirLoops) {
  if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl")) {
    GTEST_SKIP() << "this CPU has no AVX-512 (BW, VL), which amx::pack_value_columns is written in";
  }
  std::mt19937_64 rng(200);
  for (const auto& [nk, dv] : std::vector<std::pair<size_t, size_t>>{{1, 1}, {2, 16}, {33, 17}, {64, 64}, {63, 200}}) {
    const std::vector<uint16_t> v = RandomBf16(nk * dv, rng);
    const std::vector<const uint16_t*> rows = RowTable(v, nk, dv, true);
    const size_t words = RoundUpToTile(dv) * RoundUpToTile((nk + 1) / 2);
    std::vector<uint32_t> got(words, 0xdeadbeef), want(words, 0xfeedface);
    qkv::amx::pack_value_columns(rows.data(), nk, dv, got.data());
    qkv::amx::tiles::PackValueColumnsByLoops(rows.data(), nk, dv, want.data());
    EXPECT_EQ(got, want) << "nk=" << nk << " dv=" << dv;
  }
}

TEST(AttentionAmx, TilesRunOnlyBesideTheBf16Products) {
  for (const std::string& target : qkv::simd_targets()) {
    const qkv::testing::SimdTargetScope scope(target);
    EXPECT_EQ(qkv::attention_bf16_tiles(), qkv::attention_bf16_products() && qkv::amx::available()) << target;
  }
}

TEST(AttentionAmx, SaysWhyTheTilesDoNotRun) {
  EXPECT_EQ(qkv::amx::why_unavailable().empty(), qkv::amx::available()) << qkv::amx::why_unavailable();
}

TEST(AttentionAmx, CpuTilesPassTheCheckAtFirstUse) {
  // Where they fail it, attention takes vdpbf16ps and stays right; this test is what shows it.
  if (!qkv::amx::available() && !qkv::amx::failed_check()) GTEST_SKIP() << qkv::amx::why_unavailable();
  EXPECT_FALSE(qkv::amx::failed_check()) << qkv::amx::why_unavailable();
}

std::string NoTilesReason() {
  return qkv::amx::why_unavailable() +
         ": the bf16 products run by vdpbf16ps, and the tiles' loops are checked on the model above";
}

TEST(AttentionAmx, CpuTilesComputeTheScores) {
  if (!qkv::amx::available()) GTEST_SKIP() << NoTilesReason();
  uint64_t seed = 300;
  for (const ScoreCase& c : kScoreCases) CheckScores(c, seed++, qkv::amx::scores);
}

TEST(AttentionAmx, CpuTilesAddTheWeightedValues) {
  if (!qkv::amx::available()) GTEST_SKIP() << NoTilesReason();
  uint64_t seed = 400;
  for (const ValueCase& c : kValueCases) CheckAddValues(c, seed++, qkv::amx::add_values);
}

TEST(AttentionAmx, CpuTilesGiveAScoreTheSameBitsWhicheverSideIsA) {
  // The backward computes its scores with keys as A in one layout and queries as A in the other.
  if (!qkv::amx::available()) GTEST_SKIP() << NoTilesReason();
  std::mt19937_64 rng(500);
  struct Sides {
    size_t nk, nq, dk;
    bool scattered;
  };
  for (const Sides& c : {Sides{64, 64, 128, false}, Sides{40, 17, 33, true}, Sides{64, 48, 200, false},
                         Sides{16, 64, 64, true}, Sides{33, 1, 1, false}}) {
    SCOPED_TRACE("nk=" + std::to_string(c.nk) + " nq=" + std::to_string(c.nq) + " dk=" + std::to_string(c.dk));
    const size_t stride = c.dk + (c.scattered ? 5 : 0);
    const std::vector<uint16_t> k = RandomBf16(c.nk * stride, rng), q = RandomBf16(c.nq * stride, rng);
    const std::vector<const uint16_t*> keys = RowTable(k, c.nk, stride, c.scattered);
    const std::vector<const uint16_t*> queries = RowTable(q, c.nq, stride, c.scattered);
    const size_t ld_q = RoundUpToTile(c.nq), ld_k = RoundUpToTile(c.nk), pairs = RoundUpToTile((c.dk + 1) / 2);
    std::vector<uint32_t> qt(pairs * ld_q), kt(pairs * ld_k);
    qkv::bf16::pack_queries(queries.data(), c.nq, c.dk, ld_q, qt.data());
    qkv::bf16::pack_queries(keys.data(), c.nk, c.dk, ld_k, kt.data());
    std::vector<float> st(64 * ld_q), s(64 * ld_k);
    qkv::amx::scores(keys.data(), c.nk, c.dk, qt.data(), ld_q, st.data());
    qkv::amx::scores(queries.data(), c.nq, c.dk, kt.data(), ld_k, s.data());
    for (size_t j = 0; j < c.nk; ++j) {
      for (size_t i = 0; i < c.nq; ++i) ASSERT_EQ(st[j * ld_q + i], s[i * ld_k + j]) << "key " << j << ", query " << i;
    }
  }
}

}  // namespace
