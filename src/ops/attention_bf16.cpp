// The bf16 dot-product tiles of attention_bf16.hpp. Every function that uses AVX-512 carries its
// target as an attribute rather than the whole file taking -mavx512bf16: the compiler would
// otherwise be free to use AVX-512 in the inline functions of the headers this file includes, and
// the linker to keep those copies for the whole library, on CPUs that have no AVX-512.

#include "attention_bf16.hpp"

#include <algorithm>
#include <cstring>

#include "attention_amx.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define QKV_BF16_DOT 1
#define QKV_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#else
#define QKV_BF16_DOT 0
#endif

namespace qkv::bf16 {

#if QKV_BF16_DOT

namespace {

// Pairs of dims summed from zero in registers before being added to the tile: the blocked
// summation of the float32 kernel (64 elements a chunk).
constexpr size_t kChunkPairs = 32;
constexpr size_t kLanes = 16;
// A tile of four rows by up to four vectors of 16 lanes: 16 accumulators, four loaded vectors and a
// broadcast (six rows measured 0.93× on Zen 5). Every loop over a tile's rows or vectors is
// unrolled whole (`#pragma GCC unroll`), so that the accumulators live in registers alone: left as
// loops, GCC 12 kept them in an array on the stack as well, zeroed and stored for every tile and
// loaded back to be added to the output, and bf16 prefill ran 1.06× slower (Zen 5, the same bits).
constexpr size_t kTileRows = 4;

uint32_t pair_at(const uint16_t* row, size_t c2, size_t n) {
  const uint32_t low = row[2 * c2];
  const uint32_t high = 2 * c2 + 1 < n ? row[2 * c2 + 1] : 0;
  return low | high << 16;
}

// C[R][V vectors] over depth pairs [k0, k1): a(r, k2) broadcast, b rows b_row words apart.
template <size_t R, size_t V, class A>
QKV_BF16_TARGET inline void dot_tile(const A& a, const uint32_t* b, size_t b_row, size_t k0, size_t k1,
                                     __m512 (&acc)[R][V]) {
#pragma GCC unroll 4
  for (size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (size_t v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (size_t k = k0; k < k1; ++k) {
    __m512bh bv[V];
#pragma GCC unroll 4
    for (size_t v = 0; v < V; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + k * b_row + v * kLanes);
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a(r, k)));
#pragma GCC unroll 4
      for (size_t v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
    }
  }
}

// The key rows' words, whole pairs read as one 32-bit load; an odd dk's last pair is built.
struct KeyPairs {
  const uint16_t* const* rows;
  size_t dk;
  uint32_t operator()(size_t r, size_t k) const {
    if (2 * k + 1 < dk) {
      uint32_t word;
      std::memcpy(&word, rows[r] + 2 * k, sizeof word);
      return word;
    }
    return pair_at(rows[r], k, dk);
  }
};

template <size_t R, size_t V>
QKV_BF16_TARGET void score_rows(const uint16_t* const* keys, size_t dk, const uint32_t* qt, size_t ld, float* st) {
  const size_t pairs = (dk + 1) / 2;
  const KeyPairs a{keys, dk};
  for (size_t k0 = 0; k0 < pairs; k0 += kChunkPairs) {
    __m512 acc[R][V];
    dot_tile<R, V>(a, qt, ld, k0, std::min(pairs, k0 + kChunkPairs), acc);
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (size_t v = 0; v < V; ++v) {
        float* at = st + r * ld + v * kLanes;
        _mm512_storeu_ps(at, k0 == 0 ? acc[r][v] : _mm512_add_ps(_mm512_loadu_ps(at), acc[r][v]));
      }
    }
  }
}

template <size_t V>
QKV_BF16_TARGET void scores_of(const uint16_t* const* keys, size_t nk, size_t dk, const uint32_t* qt, size_t ld,
                               float* st) {
  size_t j = 0;
  for (; j + kTileRows <= nk; j += kTileRows) score_rows<kTileRows, V>(keys + j, dk, qt, ld, st + j * ld);
  for (; j < nk; ++j) score_rows<1, V>(keys + j, dk, qt, ld, st + j * ld);
}

struct ValuePairs {
  const uint32_t* vp;
  size_t dv;
  size_t c0;
  uint32_t operator()(size_t r, size_t k) const { return vp[k * dv + c0 + r]; }
};

template <size_t R, size_t V>
QKV_BF16_TARGET void value_rows(const uint32_t* vp, size_t pairs, size_t dv, size_t c0, const uint32_t* pp, size_t ld,
                                float* acc, size_t acc_row) {
  __m512 sum[R][V];
  dot_tile<R, V>(ValuePairs{vp, dv, c0}, pp, ld, 0, pairs, sum);
#pragma GCC unroll 4
  for (size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (size_t v = 0; v < V; ++v) {
      float* at = acc + (c0 + r) * acc_row + v * kLanes;
      _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), sum[r][v]));
    }
  }
}

template <size_t V>
QKV_BF16_TARGET void add_values_of(const uint32_t* vp, size_t pairs, size_t dv, const uint32_t* pp, size_t ld,
                                   float* acc, size_t acc_row) {
  size_t c = 0;
  for (; c + kTileRows <= dv; c += kTileRows) value_rows<kTileRows, V>(vp, pairs, dv, c, pp, ld, acc, acc_row);
  for (; c < dv; ++c) value_rows<1, V>(vp, pairs, dv, c, pp, ld, acc, acc_row);
}

// The 16-bit element order that makes word t of a result element first + t in its low half and
// element second + t in its high half (of one vector, or of the two that permutex2var reads).
QKV_BF16_TARGET __m512i interleave_index(int first, int second) {
  alignas(64) int16_t index[32];
  for (int t = 0; t < 16; ++t) {
    index[2 * t] = static_cast<int16_t>(first + t);
    index[2 * t + 1] = static_cast<int16_t>(second + t);
  }
  return _mm512_load_si512(index);
}

}  // namespace

bool dot_available() {
  static const bool available =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
  return available;
}

void pack_queries(const uint16_t* const* rows, size_t nq, size_t dk, size_t ld, uint32_t* out) {
  const size_t pairs = (dk + 1) / 2;
  for (size_t c2 = 0; c2 < pairs; ++c2) {
    uint32_t* line = out + c2 * ld;
    for (size_t i = 0; i < nq; ++i) line[i] = pair_at(rows[i], c2, dk);
    std::fill(line + nq, line + ld, uint32_t{0});
  }
  std::fill(out + pairs * ld, out + amx::RoundUpToTile(pairs) * ld, uint32_t{0});
}

QKV_BF16_TARGET void scores(const uint16_t* const* keys, size_t nk, size_t dk, const uint32_t* qt, size_t ld,
                            float* st) {
  switch (ld / kLanes) {
    case 1:
      return scores_of<1>(keys, nk, dk, qt, ld, st);
    case 2:
      return scores_of<2>(keys, nk, dk, qt, ld, st);
    case 3:
      return scores_of<3>(keys, nk, dk, qt, ld, st);
    default:
      return scores_of<4>(keys, nk, dk, qt, ld, st);
  }
}

QKV_BF16_TARGET void pack_weights(const float* pt, size_t nk, size_t ld, uint32_t* out) {
  // cvtne2ps gives [16 of the first row | 16 of the second]; word t takes element t of each.
  const __m512i order = interleave_index(0, 16);
  for (size_t j2 = 0; 2 * j2 < nk; ++j2) {
    const float* first = pt + 2 * j2 * ld;
    for (size_t i = 0; i < ld; i += kLanes) {
      const __m512 a = _mm512_loadu_ps(first + i);
      const __m512 b = 2 * j2 + 1 < nk ? _mm512_loadu_ps(first + ld + i) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      _mm512_storeu_si512(out + j2 * ld + i, _mm512_permutexvar_epi16(order, both));
    }
  }
  const size_t pairs = (nk + 1) / 2;
  std::fill(out + pairs * ld, out + amx::RoundUpToTile(pairs) * ld, uint32_t{0});
}

QKV_BF16_TARGET void pack_values(const uint16_t* const* rows, size_t nk, size_t dv, uint32_t* out) {
  const __m512i low = interleave_index(0, 32);
  const __m512i high = interleave_index(16, 48);
  for (size_t j2 = 0; 2 * j2 < nk; ++j2) {
    const uint16_t* first = rows[2 * j2];
    const uint16_t* second = 2 * j2 + 1 < nk ? rows[2 * j2 + 1] : nullptr;
    uint32_t* line = out + j2 * dv;
    for (size_t c = 0; c < dv; c += 2 * kLanes) {
      const size_t n = std::min(dv - c, 2 * kLanes);
      const __mmask32 load = n == 2 * kLanes ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << n) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(load, first + c);
      const __m512i b = second != nullptr ? _mm512_maskz_loadu_epi16(load, second + c) : _mm512_setzero_si512();
      const size_t n_low = std::min(n, kLanes), n_high = n - n_low;
      _mm512_mask_storeu_epi32(line + c, static_cast<__mmask16>((uint32_t{1} << n_low) - 1),
                               _mm512_permutex2var_epi16(a, low, b));
      if (n_high > 0) {
        _mm512_mask_storeu_epi32(line + c + kLanes, static_cast<__mmask16>((uint32_t{1} << n_high) - 1),
                                 _mm512_permutex2var_epi16(a, high, b));
      }
    }
  }
}

QKV_BF16_TARGET void add_values(const uint32_t* vp, size_t pairs, size_t dv, const uint32_t* pp, size_t ld, float* acc,
                                size_t acc_row) {
  switch (ld / kLanes) {
    case 1:
      return add_values_of<1>(vp, pairs, dv, pp, ld, acc, acc_row);
    case 2:
      return add_values_of<2>(vp, pairs, dv, pp, ld, acc, acc_row);
    case 3:
      return add_values_of<3>(vp, pairs, dv, pp, ld, acc, acc_row);
    default:
      return add_values_of<4>(vp, pairs, dv, pp, ld, acc, acc_row);
  }
}

#else

bool dot_available() { return false; }
void pack_queries(const uint16_t* const*, size_t, size_t, size_t, uint32_t*) {}
void scores(const uint16_t* const*, size_t, size_t, const uint32_t*, size_t, float*) {}
void pack_weights(const float*, size_t, size_t, uint32_t*) {}
void pack_values(const uint16_t* const*, size_t, size_t, uint32_t*) {}
void add_values(const uint32_t*, size_t, size_t, const uint32_t*, size_t, float*, size_t) {}

#endif

}  // namespace qkv::bf16
