#pragma once
// The fused kernel's bf16 products on AMX tiles (Sapphire Rapids and later Xeons): the two products
// of attention_bf16.hpp, Sᵀ = K·Qᵀ and oᵀ += Vᵀ·Pᵀ, each as tdpbf16ps over 16 × 16 blocks of
// float32 with 32 bfloat16 of depth an instruction, where vdpbf16ps takes one vector of 16 lanes.
// Where available() says so the fused kernel calls these in place of bf16::scores and
// bf16::add_values, in the forward and in both layouts of the backward, so that the backward
// recomputes the forward's very scores.
//
// The operands are those of attention_bf16.hpp: Qᵀ (or Kᵀ) from bf16::pack_queries and Pᵀ from
// bf16::pack_weights, by pairs of depth, zero up to whole tiles of 16 pairs. A tile's A operand wants
// 16 rows of 64 bytes at one stride: the key (or query) rows are read in place where they lie at
// one stride and their depth fills whole tiles, else copied (pack_rows); V is turned into Vᵀ by pairs
// of keys (pack_value_columns). Sums: each chunk of 64 dims (32 pairs) of a score is summed from
// zero in the tile and the chunk sums added in order, as bf16::scores does. A key block's Σ p·v
// sums on from oᵀ's values loaded into the tile, where the tile's 16 channels all lie in oᵀ:
// adding the block's sum to oᵀ through memory (as bf16::add_values does, and as the tiles do for a
// last tile of fewer channels) took bf16 prefill's time outside the products from 30 to 67 ms on
// Zen 5 (T = 4096, H = 8, d = 64, with the tile instructions made no-ops); the weights' rounding
// to bfloat16 dwarfs what the longer chain of sums adds to the error. Within a tile the order in
// which the hardware adds its products is its own: the results differ from vdpbf16ps' in the last
// bits of the sums, and a score is the same whichever side is A, as both layouts of the backward
// need (each element of C sums the products of its own row and column pairs, in the same order).
//
// Tiles need the operating system's consent (Linux 5.16 on, arch_prctl), once a process, and a
// configuration loaded in each thread (TileSession); qkv uses them once they have also passed a
// check of their sums (tiles::CheckTiles in attention_amx-inl.h).

#include <cstddef>
#include <cstdint>
#include <string>

namespace qkv::amx {

// A count of rows rounded up to whole tiles, which take their operands 16 rows at a time: the rows
// of pairs that bf16::pack_queries and pack_weights zero, and that the fused kernel's buffers hold.
constexpr size_t RoundUpToTile(size_t rows) { return (rows + 15) / 16 * 16; }

// The 64-byte operand of ldtilecfg and sttilecfg: all zero where a thread holds no tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// This thread's tiles in the configuration scores and add_values use, for the session's lifetime
// (where `wanted` and available()); at its end the thread gets back what it held before, another
// library's configuration or none, since libraries that use tiles too (oneDNN inside PyTorch)
// remember what they last loaded on a thread rather than look. Each call to scores and add_values
// opens a session of its own, which costs a store and a load of the configuration and a release;
// a session around many calls (the fused kernel holds one a task) makes theirs free.
class TileSession {
 public:
  explicit TileSession(bool wanted);
  ~TileSession();
  TileSession(const TileSession&) = delete;
  TileSession& operator=(const TileSession&) = delete;

 private:
  TileConfig held_;
  bool open_ = false;
  bool outermost_ = false;
};

// Whether this CPU has AMX-BF16, the operating system lets this process use its tiles, and they
// pass the check of tiles::CheckTiles (all asked once). Tiles are used only beside AVX-512 with
// AVX512_BF16, which every CPU with AMX has.
bool available();

// Why available() is false (empty where it is true): no AMX, no AVX-512 beside it, Linux's refusal
// with its error, or the first value the tiles got wrong in the check, so that a CPU with AMX whose
// tiles are refused or faulty does not pass for one without.
const std::string& why_unavailable();

// Whether the CPU's tiles ran and failed that check.
bool failed_check();

// st[j·ld + i] = k_j·q_i for the nk ≤ 64 key rows of dk elements and the ld queries of qt
// (bf16::pack_queries' layout, rows zero up to a multiple of 16 pairs); as bf16::scores.
void scores(const uint16_t* const* keys, size_t nk, size_t dk, const uint32_t* qt, size_t ld, float* st);

// acc[c·acc_row + i] += Σ_j v_j[c]·p(j, i) over the nk ≤ 64 value rows of dv elements, with Pᵀ by
// pairs of keys from bf16::pack_weights (rows zero up to a multiple of 16 pairs).
void add_values(const uint16_t* const* values, size_t nk, size_t dv, const uint32_t* pp, size_t ld, float* acc,
                size_t acc_row);

// Vᵀ by pairs of keys: out[c·ld_pairs + j2] = (rows[2·j2][c], rows[2·j2 + 1][c]) for c < dv and
// j2 < ⌈nk/2⌉, 0 elsewhere in [dv rounded up to 16][ld_pairs], ld_pairs = ⌈nk/2⌉ rounded up to 16.
// AVX-512; exposed so that it can be checked on any CPU that has AVX-512, with or without AMX.
void pack_value_columns(const uint16_t* const* rows, size_t nk, size_t dv, uint32_t* out);

}  // namespace qkv::amx
