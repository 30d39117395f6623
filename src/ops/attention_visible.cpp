// The dense visibility of an attention mask, from the same band and mask views that the kernels
// read (attention_problem.hpp), so a picture and the computation cannot disagree.

#include "qkv/ops/attention_visible.hpp"

#include <fmt/format.h>

#include <cmath>

#include "attention_problem.hpp"
#include "qkv/core/error.hpp"

namespace qkv {
namespace {

// Fills visible [B, H, Tq, Tk] of one unpacked problem.
template <class T>
void fill_visible(const detail::AttentionOperands<T>& p, TensorView<uint8_t> visible) {
  for (int64_t b = 0; b < p.batch(); ++b) {
    for (int64_t h = 0; h < p.heads(); ++h) {
      for (int64_t i = 0; i < p.tq(); ++i) {
        for (int64_t j = 0; j < p.tk(); ++j) {
          // A bias of −inf is the other way a float mask hides a key.
          const bool hidden_by_bias = p.bias && std::isinf((*p.bias)(b, h, i, j)) && (*p.bias)(b, h, i, j) < 0;
          visible(b, h, i, j) = p.visible(b, h, i, j) && !hidden_by_bias ? 1 : 0;
        }
      }
    }
  }
}

}  // namespace

template <class T>
void attention_visible(TensorView<const T> q, TensorView<const T> k, const AttentionMask<T>& mask,
                       TensorView<uint8_t> visible) {
  // v only gives Dv, which visibility does not depend on: k stands in for it.
  const detail::AttentionOperands<T> p = detail::make_attention_operands(q, k, k, mask, detail::KeyDim::any);
  if (visible.shape != p.scores()) {
    throw ShapeError(
        fmt::format("visible: expected shape [B, H, Tq, Tk] = {}, got {}", p.scores().str(), visible.shape.str()));
  }
  for (int64_t b = 0; b < p.batch(); ++b) {
    for (int64_t h = 0; h < p.heads(); ++h) {
      for (int64_t i = 0; i < p.tq(); ++i) {
        for (int64_t j = 0; j < p.tk(); ++j) visible(b, h, i, j) = 0;
      }
    }
  }
  if (!p.packed()) {
    fill_visible(p, visible);
    return;
  }
  // Packed: each sequence's block of queries × keys is a problem of its own; the rest stays 0.
  for (int64_t n = 0; n < p.sequences(); ++n) {
    const detail::SequenceRange r = detail::sequence_range(p, n);
    fill_visible(detail::sequence_problem(p, r),
                 detail::token_range(detail::token_range(visible, 2, r.q0, r.q1), 3, r.k0, r.k1));
  }
}

template void attention_visible(TensorView<const float>, TensorView<const float>, const AttentionMask<float>&,
                                TensorView<uint8_t>);
template void attention_visible(TensorView<const double>, TensorView<const double>, const AttentionMask<double>&,
                                TensorView<uint8_t>);

}  // namespace qkv
