// The AMX tiles of attention_amx.hpp. The tile instructions are written as inline assembly, which
// GCC and clang both take without -mamx flags, and every function that uses AVX-512 carries its
// target as an attribute, as in attention_bf16.cpp, so that nothing here leaks AVX-512 into code
// the rest of the library shares.

#include "attention_amx.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "attention_bf16.hpp"
#include "qkv/ops/attention.hpp"

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define QKV_AMX 1
#define QKV_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#include "attention_amx-inl.h"
#else
#define QKV_AMX 0
#endif

namespace qkv::amx {

#if QKV_AMX

namespace {

// Linux's arch_prctl request and state component for the tiles' data (asm/prctl.h from 5.16 on).
constexpr long kRequestComponentPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr long kTileDataComponent = 18;               // XFEATURE_XTILEDATA

struct CpuTiles {
  static void StoreConfig(TileConfig* config) { asm volatile("sttilecfg %0" : "=m"(*config)); }
  static void LoadConfig(const TileConfig* config) { asm volatile("ldtilecfg %0" : : "m"(*config)); }
  static void Release() { asm volatile("tilerelease"); }
  template <int t>
  static void Zero() {
    asm volatile("tilezero %%tmm%c0" : : "i"(t));
  }
  template <int t>
  static void Load(const void* base, size_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(base), "r"(stride), "i"(t) : "memory");
  }
  template <int t>
  static void Store(void* base, size_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" : : "r"(base), "r"(stride), "i"(t) : "memory");
  }
  template <int c, int a, int b>
  static void Dot() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(c), "i"(a), "i"(b));
  }
  static void PackValueColumns(const uint16_t* const* rows, size_t nk, size_t dv, uint32_t* out) {
    pack_value_columns(rows, nk, dv, out);
  }
};

// GCC 12 takes the self-initialised "undefined" vector that its AVX-512 intrinsics pass as the
// unused operand for an uninitialised read, in functions that have AVX-512 by attribute alone.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// The 16 × 16 words of r transposed in place: r[i] lane j ↔ r[j] lane i.
QKV_AMX_TARGET void Transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

tiles::Scratch& ThreadScratch() {
  thread_local tiles::Scratch scratch;
  return scratch;
}

// Whether the tiles can be used, and why not where they cannot.
struct Verdict {
  std::string refusal;  // empty where they can
  bool failed_check = false;
};

const Verdict& TheVerdict() {
  static const Verdict verdict = []() -> Verdict {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool cpuid = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx);
    if (!cpuid || (edx >> 22 & 1) == 0 || (edx >> 24 & 1) == 0) return {"this CPU has no AMX-BF16 tiles"};
    // pack_value_columns' masked loads of 16 elements need AVX512VL beside the dot product's AVX-512.
    if (!bf16::dot_available() || !__builtin_cpu_supports("avx512vl")) {
      return {"this CPU has AMX-BF16 but not the AVX-512 (F, BW, VL, BF16) the tiles are used beside"};
    }
    if (syscall(SYS_arch_prctl, kRequestComponentPermission, kTileDataComponent) != 0) {
      return {std::string("this CPU has AMX-BF16 but Linux refused its tiles (arch_prctl(ARCH_REQ_XCOMP_PERM, "
                          "XFEATURE_XTILEDATA): ") +
              std::strerror(errno) + ")"};
    }
    const std::string mismatch = tiles::CheckTiles<CpuTiles>();
    if (!mismatch.empty()) {
      return {
          "this CPU's AMX tiles failed qkv's check at first use: " + mismatch + "; the bf16 products take vdpbf16ps",
          true};
    }
    return {};
  }();
  return verdict;
}

}  // namespace

bool available() { return TheVerdict().refusal.empty(); }

const std::string& why_unavailable() { return TheVerdict().refusal; }

bool failed_check() { return TheVerdict().failed_check; }

QKV_AMX_TARGET void pack_value_columns(const uint16_t* const* rows, size_t nk, size_t dv, uint32_t* out) {
  const size_t ld = RoundUpToTile((nk + 1) / 2);
  for (size_t c0 = 0; c0 < dv; c0 += 16) {
    const size_t channels = std::min<size_t>(16, dv - c0);
    const __mmask16 load = static_cast<__mmask16>((uint32_t{1} << channels) - 1);
    for (size_t j0 = 0; j0 < ld; j0 += 16) {
      __m512i words[16];
      for (size_t t = 0; t < 16; ++t) {
        const size_t first = 2 * (j0 + t);
        const __m512i low = first < nk ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(load, rows[first] + c0))
                                       : _mm512_setzero_si512();
        const __m512i high = first + 1 < nk
                                 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(load, rows[first + 1] + c0))
                                 : _mm512_setzero_si512();
        words[t] = _mm512_or_si512(low, _mm512_slli_epi32(high, 16));
      }
      Transpose16(words);
      for (size_t c = 0; c < 16; ++c) _mm512_storeu_si512(out + (c0 + c) * ld + j0, words[c]);
    }
  }
}

#pragma GCC diagnostic pop

TileSession::TileSession(bool wanted) : open_(wanted && available()) {
  if (open_) outermost_ = tiles::Open<CpuTiles>(held_);
}

TileSession::~TileSession() {
  if (open_) tiles::Close<CpuTiles>(outermost_, held_);
}

void scores(const uint16_t* const* keys, size_t nk, size_t dk, const uint32_t* qt, size_t ld, float* st) {
  tiles::Scores<CpuTiles>(keys, nk, dk, qt, ld, st, ThreadScratch());
}

void add_values(const uint16_t* const* values, size_t nk, size_t dv, const uint32_t* pp, size_t ld, float* acc,
                size_t acc_row) {
  tiles::AddValues<CpuTiles>(values, nk, dv, pp, ld, acc, acc_row, ThreadScratch());
}

#else

TileSession::TileSession(bool) {}
TileSession::~TileSession() = default;
bool available() { return false; }
bool failed_check() { return false; }
void scores(const uint16_t* const*, size_t, size_t, const uint32_t*, size_t, float*) {}
void add_values(const uint16_t* const*, size_t, size_t, const uint32_t*, size_t, float*, size_t) {}
void pack_value_columns(const uint16_t* const*, size_t, size_t, uint32_t*) {}
const std::string& why_unavailable() {
  static const std::string why = "qkv was built without AMX's tiles (they need x86-64 Linux and GCC or clang)";
  return why;
}

#endif

}  // namespace qkv::amx

namespace qkv {

bool attention_bf16_tiles() { return attention_bf16_products() && amx::available(); }

}  // namespace qkv
