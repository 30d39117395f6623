// The tile loops of attention_amx.hpp, written once over a Tiles type that holds the tile
// instructions: attention_amx.cpp instantiates them with the CPU's (inline assembly), and
// tests/ops/test_attention_amx.cpp with a plain-loop model of their documented semantics, so that the
// blocking, the padding and the chunked sums are checked on every CPU, AMX or not.
//
// Tiles provides, for tile registers given as template arguments:
//   StoreConfig(cfg), LoadConfig(cfg), Release(): sttilecfg, ldtilecfg and tilerelease of this
//                              thread's 64-byte tile configuration (all zero: no tiles held);
//   Zero<t>(), Load<t>(base, stride), Store<t>(base, stride) (strides in bytes);
//   Dot<c, a, b>()             c[m][n] += Σ_k a[m][k]·b[k][n] over the 16 pairs k of bfloat16 of a's
//                              row m and of b's row k, word n (tdpbf16ps);
//   PackValueColumns(rows, nk, dv, out) as amx::pack_value_columns.
// The includer defines QKV_AMX_TARGET: the target attribute of the functions below (AVX-512 in the
// library, so that the additions into the output are vectors; nothing in the test).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "attention_amx.hpp"
#include "qkv/core/storage.hpp"

namespace qkv::amx::tiles {

constexpr size_t kTileRows = 16;   // rows of every tile: keys, channels or pairs of depth
constexpr size_t kTileWords = 16;  // 64 bytes a row: 16 float32, or 16 pairs of bfloat16
// Pairs of dims a score sums from zero before the sum is added to the score: bf16::scores' chunks.
constexpr size_t kChunkPairs = 32;

// Palette 1, tiles 0–7 of 16 rows × 64 bytes.
inline constexpr TileConfig kTileConfig{
    .palette = 1, .bytes_per_row = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

// TileSession's (attention_amx.hpp) opening and closing over Tiles. Sessions nest: only the
// outermost loads the configuration and gives back what the thread held; Open says whether it was
// the outermost, and `held` keeps what Close gives back.
template <class Tiles>
int& SessionDepth() {
  thread_local int depth = 0;
  return depth;
}

template <class Tiles>
bool Open(TileConfig& held) {
  if (SessionDepth<Tiles>()++ > 0) return false;
  Tiles::StoreConfig(&held);
  if (std::memcmp(&held, &kTileConfig, sizeof held) != 0) Tiles::LoadConfig(&kTileConfig);
  return true;
}

template <class Tiles>
void Close(bool outermost, const TileConfig& held) {
  --SessionDepth<Tiles>();
  if (!outermost) return;
  if (held.palette == 0) {
    Tiles::Release();
  } else if (std::memcmp(&held, &kTileConfig, sizeof held) != 0) {
    Tiles::LoadConfig(&held);
  }
}

template <class Tiles>
class Session {
 public:
  Session() : outermost_(Open<Tiles>(held_)) {}
  ~Session() { Close<Tiles>(outermost_, held_); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

 private:
  TileConfig held_;
  bool outermost_;
};

// A tile operand: 16 rows of 64 bytes each `stride` bytes apart, row r at base + r·stride.
struct Rows {
  const std::byte* base;
  size_t stride;
};

// The buffers one thread's calls reuse.
struct Scratch {
  std::vector<uint16_t> rows;     // key or query rows, copied when they cannot be read in place
  std::vector<uint32_t> columns;  // Vᵀ by pairs of keys
  alignas(64) float tile[kTileRows * kTileWords];
};

// Whether the n rows of `depth` bfloat16 can be A tiles where they lie: whole tiles of rows and of
// depth (so that no tile reads past the block), each row a fixed positive stride after the last.
inline bool RowsInPlace(const uint16_t* const* rows, size_t n, size_t depth) {
  if (n == 0 || n % kTileRows != 0 || depth % (2 * kTileWords) != 0) return false;
  const ptrdiff_t stride = rows[1] - rows[0];
  if (stride <= 0) return false;
  for (size_t r = 2; r < n; ++r) {
    if (rows[r] - rows[r - 1] != stride) return false;
  }
  return true;
}

// rows → [n rounded up to 16][depth rounded up to 32] bfloat16, zero past the rows' elements.
inline Rows PackRows(const uint16_t* const* rows, size_t n, size_t depth, std::vector<uint16_t>& out) {
  const size_t row = (depth + 2 * kTileWords - 1) / (2 * kTileWords) * (2 * kTileWords);
  out.assign(RoundUpToTile(n) * row, uint16_t{0});
  for (size_t r = 0; r < n; ++r) std::memcpy(out.data() + r * row, rows[r], depth * sizeof(uint16_t));
  return {reinterpret_cast<const std::byte*>(out.data()), row * sizeof(uint16_t)};
}

// The plain loops of amx::pack_value_columns (which the library writes in AVX-512).
inline void PackValueColumnsByLoops(const uint16_t* const* rows, size_t nk, size_t dv, uint32_t* out) {
  const size_t pairs = (nk + 1) / 2;
  const size_t ld = RoundUpToTile(pairs);
  std::fill(out, out + RoundUpToTile(dv) * ld, uint32_t{0});
  for (size_t j2 = 0; j2 < pairs; ++j2) {
    for (size_t c = 0; c < dv; ++c) {
      const uint32_t high = 2 * j2 + 1 < nk ? rows[2 * j2 + 1][c] : 0;
      out[c * ld + j2] = rows[2 * j2][c] | high << 16;
    }
  }
}

// out[0..16) = in[0..16), or += where `add`: one row of a tile that went out through the scratch.
QKV_AMX_TARGET inline void PutRow(float* __restrict out, const float* __restrict in, bool add) {
  if (add) {
    for (size_t n = 0; n < kTileWords; ++n) out[n] += in[n];
  } else {
    for (size_t n = 0; n < kTileWords; ++n) out[n] = in[n];
  }
}

// How a tile of C begins a chunk: loaded from C, to sum on where C already holds the sum so far
// (a tile whose 16 rows all lie in C), or from zero.
template <class Tiles, int t>
QKV_AMX_TARGET void Begin(bool from_c, const float* c, size_t c_ld) {
  if (from_c) {
    Tiles::template Load<t>(c, c_ld * sizeof(float));
  } else {
    Tiles::template Zero<t>();
  }
}

// A tile of C (m_valid of its 16 rows, c_ld floats apart) at the end of a chunk: stored whole
// where it began from C or writes C's first chunk over 16 rows of C; else through the scratch,
// its valid rows written to C or, where `add`, added to it.
template <class Tiles, int t>
QKV_AMX_TARGET void End(bool from_c, float* c, size_t c_ld, size_t m_valid, bool add, Scratch& s) {
  if (from_c || (!add && m_valid == kTileRows)) {
    Tiles::template Store<t>(c, c_ld * sizeof(float));
    return;
  }
  Tiles::template Store<t>(s.tile, kTileWords * sizeof(float));
  for (size_t r = 0; r < m_valid; ++r) PutRow(c + r * c_ld, s.tile + r * kTileWords, add);
}

// C [m][n] of RM × RN tiles (1 or 2 each; tiles 0–3 C, 4–5 A, 6–7 B) at rows m0 and columns n0:
// over the pairs [0, pairs) of depth in chunks of `chunk` pairs, each summed from zero and then
// written to C (the first, unless `add`) or added to it; except that with `add` and one chunk, a
// tile whose rows all lie in C sums on from C's values in the tile itself.
template <class Tiles, size_t RM, size_t RN>
QKV_AMX_TARGET void Block(Rows a, const uint32_t* b, size_t b_ld, size_t m0, size_t m, size_t n0, size_t pairs,
                          size_t chunk, bool add, float* c, size_t c_ld, Scratch& s) {
  float* const at = c + m0 * c_ld + n0;
  float* const below = at + kTileRows * c_ld;
  const size_t rows0 = std::min(kTileRows, m - m0);
  const size_t rows1 = RM == 2 ? std::min(kTileRows, m - m0 - kTileRows) : 0;
  const bool one_chunk = chunk >= pairs;
  const bool from_c0 = add && one_chunk && rows0 == kTileRows;
  const bool from_c1 = add && one_chunk && rows1 == kTileRows;
  for (size_t k0 = 0; k0 < pairs; k0 += chunk) {
    Begin<Tiles, 0>(from_c0, at, c_ld);
    if constexpr (RN == 2) Begin<Tiles, 1>(from_c0, at + kTileWords, c_ld);
    if constexpr (RM == 2) Begin<Tiles, 2>(from_c1, below, c_ld);
    if constexpr (RM == 2 && RN == 2) Begin<Tiles, 3>(from_c1, below + kTileWords, c_ld);
    for (size_t k = k0; k < std::min(pairs, k0 + chunk); k += kTileRows) {
      const std::byte* a_at = a.base + m0 * a.stride + k * sizeof(uint32_t);
      const uint32_t* b_at = b + k * b_ld + n0;
      const size_t b_stride = b_ld * sizeof(uint32_t);
      Tiles::template Load<4>(a_at, a.stride);
      if constexpr (RM == 2) Tiles::template Load<5>(a_at + kTileRows * a.stride, a.stride);
      Tiles::template Load<6>(b_at, b_stride);
      if constexpr (RN == 2) Tiles::template Load<7>(b_at + kTileWords, b_stride);
      Tiles::template Dot<0, 4, 6>();
      if constexpr (RN == 2) Tiles::template Dot<1, 4, 7>();
      if constexpr (RM == 2) Tiles::template Dot<2, 5, 6>();
      if constexpr (RM == 2 && RN == 2) Tiles::template Dot<3, 5, 7>();
    }
    const bool add_chunk = add || k0 > 0;
    End<Tiles, 0>(from_c0, at, c_ld, rows0, add_chunk, s);
    if constexpr (RN == 2) End<Tiles, 1>(from_c0, at + kTileWords, c_ld, rows0, add_chunk, s);
    if constexpr (RM == 2) End<Tiles, 2>(from_c1, below, c_ld, rows1, add_chunk, s);
    if constexpr (RM == 2 && RN == 2) End<Tiles, 3>(from_c1, below + kTileWords, c_ld, rows1, add_chunk, s);
  }
}

// C [m][n] (n a multiple of 16) from A's m rows (zero up to a multiple of 16 rows) and B [pairs][n]
// words b_ld apart, pairs a multiple of 16; C's rows past m are neither read nor written.
template <class Tiles>
QKV_AMX_TARGET void Product(Rows a, const uint32_t* b, size_t b_ld, size_t m, size_t n, size_t pairs, size_t chunk,
                            bool add, float* c, size_t c_ld, Scratch& s) {
  for (size_t m0 = 0; m0 < m; m0 += 2 * kTileRows) {
    const bool two_rows = m - m0 > kTileRows;
    for (size_t n0 = 0; n0 < n; n0 += 2 * kTileWords) {
      const bool two_columns = n - n0 > kTileWords;
      if (two_rows && two_columns) {
        Block<Tiles, 2, 2>(a, b, b_ld, m0, m, n0, pairs, chunk, add, c, c_ld, s);
      } else if (two_rows) {
        Block<Tiles, 2, 1>(a, b, b_ld, m0, m, n0, pairs, chunk, add, c, c_ld, s);
      } else if (two_columns) {
        Block<Tiles, 1, 2>(a, b, b_ld, m0, m, n0, pairs, chunk, add, c, c_ld, s);
      } else {
        Block<Tiles, 1, 1>(a, b, b_ld, m0, m, n0, pairs, chunk, add, c, c_ld, s);
      }
    }
  }
}

template <class Tiles>
QKV_AMX_TARGET void Scores(const uint16_t* const* keys, size_t nk, size_t dk, const uint32_t* qt, size_t ld, float* st,
                           Scratch& s) {
  const Session<Tiles> session;
  const Rows a = RowsInPlace(keys, nk, dk) ? Rows{reinterpret_cast<const std::byte*>(keys[0]),
                                                  static_cast<size_t>(keys[1] - keys[0]) * sizeof(uint16_t)}
                                           : PackRows(keys, nk, dk, s.rows);
  Product<Tiles>(a, qt, ld, nk, ld, RoundUpToTile((dk + 1) / 2), kChunkPairs, false, st, ld, s);
}

template <class Tiles>
QKV_AMX_TARGET void AddValues(const uint16_t* const* values, size_t nk, size_t dv, const uint32_t* pp, size_t ld,
                              float* acc, size_t acc_row, Scratch& s) {
  const Session<Tiles> session;
  const size_t pairs = RoundUpToTile((nk + 1) / 2);
  s.columns.resize(RoundUpToTile(dv) * pairs);
  Tiles::PackValueColumns(values, nk, dv, s.columns.data());
  const Rows a{reinterpret_cast<const std::byte*>(s.columns.data()), pairs * sizeof(uint32_t)};
  Product<Tiles>(a, pp, ld, dv, ld, pairs, pairs, true, acc, acc_row, s);
}

// The check the library makes of the CPU's tiles before it trusts them (attention_amx.cpp, once a
// process): scores and weighted values of small integers, whose every sum is exact in whatever
// order the tiles add, through both products' loops (key rows read in place and copied, chunks of
// depth past the first, 2 × 2 blocks and partial tiles, sums carried on in the tile from C and
// added through the scratch), against the same sums in integers. The tiles have run only on a model
// of their instructions when qkv ships, so a fault that the model does not share (an operand's
// layout, the order of an instruction's operands) turns them off for vdpbf16ps rather than giving
// wrong attention. Empty where every value matches, else the first that does not.
inline std::string Mismatch(const char* what, const char* row_name, size_t row, const char* column_name, size_t column,
                            float got, int64_t want) {
  std::ostringstream out;
  out << what << " of " << row_name << " " << row << " and " << column_name << " " << column << " is " << got
      << " where " << want << " was expected";
  return out.str();
}

template <class Tiles>
std::string CheckTiles() {
  Scratch s;
  // Small integers, exact in bfloat16.
  const auto bf16 = [](int n) { return bfloat16_from_float(static_cast<float>(n)); };
  const auto key = [](size_t j, size_t c) { return static_cast<int>((3 * j + 5 * c) % 7) - 3; };
  const auto query = [](size_t i, size_t c) { return static_cast<int>((5 * i + 3 * c + 1) % 5) - 2; };
  struct ScoreShape {
    size_t nk, dk, ld;
  };
  for (const ScoreShape& c : {ScoreShape{64, 96, 32}, ScoreShape{40, 40, 16}}) {
    std::vector<uint16_t> k(c.nk * c.dk);
    std::vector<const uint16_t*> keys(c.nk);
    for (size_t j = 0; j < c.nk; ++j) {
      for (size_t e = 0; e < c.dk; ++e) k[j * c.dk + e] = bf16(key(j, e));
      keys[j] = k.data() + j * c.dk;
    }
    std::vector<uint32_t> qt(RoundUpToTile((c.dk + 1) / 2) * c.ld, 0);
    for (size_t i = 0; i < c.ld; ++i) {
      for (size_t e = 0; e < c.dk; ++e) qt[e / 2 * c.ld + i] |= uint32_t{bf16(query(i, e))} << (e % 2 * 16);
    }
    std::vector<float> st(RoundUpToTile(c.nk) * c.ld);
    Scores<Tiles>(keys.data(), c.nk, c.dk, qt.data(), c.ld, st.data(), s);
    for (size_t j = 0; j < c.nk; ++j) {
      for (size_t i = 0; i < c.ld; ++i) {
        int64_t want = 0;
        for (size_t e = 0; e < c.dk; ++e) want += key(j, e) * query(i, e);
        if (st[j * c.ld + i] != static_cast<float>(want))
          return Mismatch("the score", "key", j, "query", i, st[j * c.ld + i], want);
      }
    }
  }
  const auto value = [](size_t j, size_t c) { return static_cast<int>((2 * j + 7 * c) % 9) - 4; };
  const auto weight = [](size_t j, size_t i) { return static_cast<int>((j + 2 * i) % 3) - 1; };
  const auto before = [](size_t c, size_t i) { return static_cast<int>((c + i) % 4); };
  constexpr size_t kNk = 33, kDv = 40, kLd = 32;
  std::vector<uint16_t> v(kNk * kDv);
  std::vector<const uint16_t*> values(kNk);
  for (size_t j = 0; j < kNk; ++j) {
    for (size_t c = 0; c < kDv; ++c) v[j * kDv + c] = bf16(value(j, c));
    values[j] = v.data() + j * kDv;
  }
  std::vector<uint32_t> pp(RoundUpToTile((kNk + 1) / 2) * kLd, 0);
  for (size_t j = 0; j < kNk; ++j) {
    for (size_t i = 0; i < kLd; ++i) pp[j / 2 * kLd + i] |= uint32_t{bf16(weight(j, i))} << (j % 2 * 16);
  }
  std::vector<float> acc(kDv * kLd);
  for (size_t c = 0; c < kDv; ++c) {
    for (size_t i = 0; i < kLd; ++i) acc[c * kLd + i] = static_cast<float>(before(c, i));
  }
  AddValues<Tiles>(values.data(), kNk, kDv, pp.data(), kLd, acc.data(), kLd, s);
  for (size_t c = 0; c < kDv; ++c) {
    for (size_t i = 0; i < kLd; ++i) {
      int64_t want = before(c, i);
      for (size_t j = 0; j < kNk; ++j) want += value(j, c) * weight(j, i);
      if (acc[c * kLd + i] != static_cast<float>(want))
        return Mismatch("the sum", "channel", c, "query", i, acc[c * kLd + i], want);
    }
  }
  return "";
}

}  // namespace qkv::amx::tiles
