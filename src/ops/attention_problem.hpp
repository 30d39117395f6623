#pragma once
// The checks every scaled dot-product attention implementation makes at the API boundary, in one
// place so that the reference and the fused kernel accept exactly the same calls with the same
// error messages. Internal to libqkv (not installed).

#include <fmt/format.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <span>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv::detail {

// The operands of one call, validated and seen as [B, H, T, D]; masks broadcast to [B, H, Tq, Tk].
template <class T>
struct AttentionProblem {
  TensorView<const T> q;                             // [B, H, Tq, Dk]
  TensorView<const T> k;                             // [B, H, Tk, Dk]
  TensorView<const T> v;                             // [B, H, Tk, Dv]
  std::optional<TensorView<const uint8_t>> allowed;  // [B, H, Tq, Tk]
  std::optional<TensorView<const T>> bias;           // [B, H, Tq, Tk]
  bool causal = false;
  double scale = 1.0;
  Shape leading;  // the leading dims of q as given (rank 0 to 2), for output shapes

  int64_t batch() const { return q.shape[0]; }
  int64_t heads() const { return q.shape[1]; }
  int64_t tq() const { return q.shape[2]; }
  int64_t tk() const { return k.shape[2]; }
  int64_t dk() const { return q.shape[3]; }
  int64_t dv() const { return v.shape[3]; }

  // The shape `leading` + tail, e.g. with_leading({Tq, Dv}) for the output.
  Shape with_leading(std::initializer_list<int64_t> tail) const {
    std::vector<int64_t> dims(leading.dims().begin(), leading.dims().end());
    dims.insert(dims.end(), tail.begin(), tail.end());
    return Shape(std::span<const int64_t>(dims));
  }

  // Whether query i of head (b, h) may see key j, before any additive bias.
  bool visible(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (causal && j > i + tk() - tq()) return false;
    return !allowed || (*allowed)(b, h, i, j) != 0;
  }
};

template <class T>
AttentionProblem<T> make_attention_problem(const AttentionParams<T>& params) {
  AttentionProblem<T> p;
  p.q = as_bhtd(params.q, "q");
  const int leading_rank = params.q.rank() - 2;
  p.leading = Shape(std::span<const int64_t>(params.q.shape.dims().data(), static_cast<size_t>(leading_rank)));
  const int64_t dk = params.q.shape.from_back(1);
  if (dk == 0) throw ShapeError(fmt::format("q: d_k must be at least 1, got shape {}", params.q.shape.str()));
  // k and v carry q's leading dims; their token count Tk is theirs to choose.
  const int64_t tk = params.k.rank() >= 2 ? params.k.shape.from_back(2) : 0;
  check_shape("k", params.k.shape, p.with_leading({tk, dk}));
  const int64_t dv = params.v.rank() >= 1 ? params.v.shape.from_back(1) : 0;
  check_shape("v", params.v.shape, p.with_leading({tk, dv}));
  check_last_dim_contiguous(params.q, "q");
  check_last_dim_contiguous(params.k, "k");
  check_last_dim_contiguous(params.v, "v");
  p.k = as_bhtd(params.k, "k");
  p.v = as_bhtd(params.v, "v");

  const Shape scores{p.batch(), p.heads(), p.tq(), tk};
  if (params.mask.allowed) p.allowed = broadcast_to(*params.mask.allowed, scores, "mask");
  if (params.mask.bias) p.bias = broadcast_to(*params.mask.bias, scores, "bias");
  p.causal = params.mask.causal;
  p.scale = params.scale.value_or(default_scale(dk));
  if (!std::isfinite(p.scale)) throw ValueError(fmt::format("scale: expected a finite number, got {}", p.scale));
  return p;
}

}  // namespace qkv::detail
