#pragma once
// The fused kernel's products on bfloat16 operands by the CPU's bf16 dot product (AVX512_BF16's
// vdpbf16ps: each float32 lane adds a₀·b₀ + a₁·b₁ of a pair of bfloat16 elements, exactly, to its
// accumulator). Highway 1.0.3 has no such operation, so these are intrinsics, compiled for that
// instruction set alone in attention_bf16.cpp and run only where bf16_dot_available() says so.
//
// They serve the query-vector layouts of attention_fused-inl.h, in the same tiles as its float32
// products, with the depth of each product taken two elements at a time:
//   Sᵀ [nk][ld] = K·Qᵀ   over pairs of dims (Qᵀ packed by pack_queries, K rows read in place), the
//                        forward's scores and the backward's with keys as rows; the backward's with
//                        queries as rows swap the two (Kᵀ packed by pack_queries), which sums each
//                        score in the same chain: Q and K stored as bfloat16;
//   oᵀ [dv][ld] += Vᵀ·Pᵀ over pairs of keys (V packed by pack_values, Pᵀ by pack_weights): V too,
//                        in forwards that return no lse.
// The scores are exact products summed in float32, as the float32 kernel's (the instruction takes
// subnormal inputs, below 1.2·10⁻³⁸, as 0 and flushes subnormal sums); the weights P are
// rounded to bfloat16 before the second product (as every bf16 attention does), which is the one
// place where these results differ from the float32 kernel's on the same values.
// Words below are 32-bit: a pair of bfloat16, the first element in the low half. ld is the tile's
// queries rounded up to 16 (one vector), at most 64.

#include <cstddef>
#include <cstdint>

namespace qkv::bf16 {

// Whether this CPU (and its operating system) runs 512-bit vdpbf16ps.
bool dot_available();

// Qᵀ by pairs of dims: out[c2·ld + i] = (rows[i][2·c2], rows[i][2·c2 + 1]) for the nq query rows of
// dk elements; 0 for queries i ≥ nq, for the element past an odd dk and in the rows past ⌈dk/2⌉ up
// to a multiple of 16, which AMX's tiles read (attention_amx.hpp). [⌈dk/2⌉ rounded up to 16][ld] words.
void pack_queries(const uint16_t* const* rows, size_t nq, size_t dk, size_t ld, uint32_t* out);

// st[j·ld + i] = k_j·q_i for the nk key rows (dk elements each) and the ld queries of qt.
void scores(const uint16_t* const* keys, size_t nk, size_t dk, const uint32_t* qt, size_t ld, float* st);

// Pᵀ [nk][ld] (float32) by pairs of keys, each weight rounded to the nearest bfloat16:
// out[j2·ld + i] = (p[2·j2][i], p[2·j2 + 1][i]), 0 past nk and in the rows past ⌈nk/2⌉ up to a
// multiple of 16, as pack_queries. [⌈nk/2⌉ rounded up to 16][ld] words.
void pack_weights(const float* pt, size_t nk, size_t ld, uint32_t* out);

// V by pairs of keys: out[j2·dv + c] = (rows[2·j2][c], rows[2·j2 + 1][c]), 0 past nk. [⌈nk/2⌉][dv] words.
void pack_values(const uint16_t* const* rows, size_t nk, size_t dv, uint32_t* out);

// acc[c·acc_row + i] += Σ_j2 vp(j2, c)·pp(j2, i) over the `pairs` pairs of keys, for the dv
// channels and ld queries; the sum of the block starts from zero and is then added to acc.
void add_values(const uint32_t* vp, size_t pairs, size_t dv, const uint32_t* pp, size_t ld, float* acc, size_t acc_row);

}  // namespace qkv::bf16
