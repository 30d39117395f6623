// Tests of attention_visible (src/ops/attention_visible.cpp): the dense visibility of every mask
// part (causal in both alignments, the window, allowed, a −inf bias, packed sequences) against the
// rule of qkv/ops/attention.hpp written out by hand, and its shape check.

#include "qkv/ops/attention_visible.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {
namespace {

// visible of q [H, Tq, 2] and k [H, Tk, 2] under `mask`, flattened [H, Tq, Tk].
std::vector<uint8_t> visible_of(int64_t heads, int64_t tq, int64_t tk, const AttentionMask<float>& mask,
                                int64_t dk = 2) {
  const Tensor<float> q({heads, tq, 3});  // Dq ≠ Dk: additive attention's operands are taken too
  const Tensor<float> k({heads, tk, dk});
  Tensor<uint8_t> visible({1, heads, tq, tk}, 7);
  attention_visible(q.cview(), k.cview(), mask, visible.view());
  return {visible.data(), visible.data() + visible.numel()};
}

TEST(AttentionVisible, NoMaskSeesEveryKey) { EXPECT_EQ(visible_of(1, 2, 3, {}), std::vector<uint8_t>(6, 1)); }

TEST(AttentionVisible, CausalInBothAlignmentsAndTheWindow) {
  // Tq = 2 < Tk = 4: bottom-right, query i sees j <= i + 2; top-left, j <= i.
  EXPECT_EQ(visible_of(1, 2, 4, {.causal = true}), (std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 1}));
  EXPECT_EQ(visible_of(1, 2, 4, {.causal = true, .alignment = CausalAlignment::top_left}),
            (std::vector<uint8_t>{1, 0, 0, 0, 1, 1, 0, 0}));
  // A window of one key back and none ahead, top-left: keys i - 1 and i.
  EXPECT_EQ(visible_of(1, 3, 3, {.alignment = CausalAlignment::top_left, .window = AttentionWindow{1, 0}}),
            (std::vector<uint8_t>{1, 0, 0, 1, 1, 0, 0, 1, 1}));
}

TEST(AttentionVisible, AllowedBroadcastAndMinusInfinityBias) {
  const Tensor<uint8_t> allowed({3}, {1, 0, 1});  // broadcast over heads and queries
  EXPECT_EQ(visible_of(2, 1, 3, {.allowed = allowed.cview()}), (std::vector<uint8_t>{1, 0, 1, 1, 0, 1}));
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // −inf hides a key; a finite bias, however negative, does not, nor does ALiBi.
  const Tensor<float> bias({2, 2}, {0.0F, -kInf, -1e30F, 0.0F});
  EXPECT_EQ(visible_of(1, 2, 2, {.bias = bias.cview()}), (std::vector<uint8_t>{1, 0, 1, 1}));
  const Tensor<float> slopes({1}, {100.0F});
  EXPECT_EQ(visible_of(1, 2, 2, {.alibi_slopes = slopes.cview()}), std::vector<uint8_t>(4, 1));
}

TEST(AttentionVisible, PackedSequencesSeeOnlyTheirOwnKeys) {
  const Tensor<int64_t> cu_q({3}, {0, 2, 3});
  const Tensor<int64_t> cu_k({3}, {0, 2, 4});
  // Queries 0, 1 see keys 0, 1 (causal within their sequence); query 2 sees keys 2, 3 (bottom-right:
  // its sequence has one query and two keys).
  EXPECT_EQ(visible_of(1, 3, 4, {.causal = true, .cu_seqlens_q = cu_q.cview(), .cu_seqlens_k = cu_k.cview()}),
            (std::vector<uint8_t>{1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1}));
}

TEST(AttentionVisible, RefusesAVisibleOfAnotherShape) {
  const Tensor<float> q({2, 3, 2});
  const Tensor<float> k({2, 4, 2});
  Tensor<uint8_t> visible({1, 2, 4, 3});
  try {
    attention_visible(q.cview(), k.cview(), {}, visible.view());
    ADD_FAILURE() << "a [1, 2, 4, 3] visible was taken for scores [1, 2, 3, 4]";
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(), "visible: expected shape [B, H, Tq, Tk] = [1, 2, 3, 4], got [1, 2, 4, 3]");
  }
}

}  // namespace
}  // namespace qkv
