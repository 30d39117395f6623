#pragma once
// Which keys each query may see under an attention mask, as a dense [B, H, Tq, Tk] array: what a
// picture of the weights needs to draw masked cells as masked rather than as weights of 0.
//
// The mask is read as attention_forward reads it (qkv/ops/attention.hpp): causality and its
// alignment, the window, `allowed`, packed sequences (a query sees only its own sequence's keys),
// and a bias of −inf. A finite bias and ALiBi hide no key, however small the weight they leave.

#include <cstdint>

#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv {

// q [B, H, Tq, Dq] (or [H, Tq, Dq], [Tq, Dq]) and k [B, Hkv, Tk, Dk] give the shapes, as attention
// reads them; Dq and Dk may differ (additive scores). visible [B, H, Tq, Tk], contiguous: 1 where
// query i of head (b, h) may see key j, else 0. Throws the errors of attention_forward about the
// mask, and ShapeError naming `visible` when its shape is not [B, H, Tq, Tk].
template <class T>
void attention_visible(TensorView<const T> q, TensorView<const T> k, const AttentionMask<T>& mask,
                       TensorView<uint8_t> visible);

}  // namespace qkv
