#pragma once
// The one validated form of an attention call, built at the API boundary and passed on: the
// reference and the fused dot-product attention and the additive attention all check their
// operands here, so they accept exactly the same calls with the same error messages. Internal to
// the ops layer (not installed).

#include <fmt/format.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <string_view>

#include "qkv/core/error.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv::detail {

// q, k, v seen as [B, H, T, D] and the mask broadcast to [B, H, Tq, Tk]: what every attention
// reads, whatever its score.
template <class T>
struct AttentionOperands {
  TensorView<const T> q;                             // [B, H, Tq, Dq]
  TensorView<const T> k;                             // [B, H, Tk, Dk]
  TensorView<const T> v;                             // [B, H, Tk, Dv]
  std::optional<TensorView<const uint8_t>> allowed;  // [B, H, Tq, Tk]
  std::optional<TensorView<const T>> bias;           // [B, H, Tq, Tk]
  bool causal = false;
  // The arguments' shapes as given, which their gradients must have; q's leading dims (rank 0 to
  // 2) are those of every output.
  Shape q_shape, k_shape, v_shape;
  std::optional<Shape> bias_shape;

  int64_t batch() const { return q.shape[0]; }
  int64_t heads() const { return q.shape[1]; }
  int64_t tq() const { return q.shape[2]; }
  int64_t tk() const { return k.shape[2]; }
  int64_t dq() const { return q.shape[3]; }
  int64_t dk() const { return k.shape[3]; }
  int64_t dv() const { return v.shape[3]; }
  Shape scores() const { return {batch(), heads(), tq(), tk()}; }

  // q's leading dims + tail, e.g. with_leading({Tq, Dv}) for the output.
  Shape with_leading(std::initializer_list<int64_t> tail) const {
    return leading_dims_with(q_shape, q_shape.rank() - 2, tail);
  }

  // Whether query i of head (b, h) may see key j, before any additive bias.
  bool visible(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (causal && j > i + tk() - tq()) return false;
    return !allowed || (*allowed)(b, h, i, j) != 0;
  }
};

// A dot-product attention call: its operands and the scale of q·k.
template <class T>
struct AttentionProblem : AttentionOperands<T> {
  double scale = 1.0;
};

// Which dims of k a score needs: dot products need Dk = Dq, additive scores take any Dk.
enum class KeyDim { same_as_query, any };

template <class T>
void check_dims_not_negative(TensorView<const T> view, std::string_view name) {
  for (int axis = 0; axis < view.rank(); ++axis) {
    if (view.shape[axis] < 0) {
      throw ShapeError(
          fmt::format("{}: dimension {} must not be negative, got shape {}", name, axis, view.shape.str()));
    }
  }
}

template <class T>
AttentionOperands<T> make_attention_operands(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                             const AttentionMask<T>& mask, KeyDim key_dim) {
  AttentionOperands<T> p;
  p.q = as_bhtd(q, "q");
  check_dims_not_negative(q, "q");
  p.q_shape = q.shape;
  const int64_t dq = q.shape.from_back(1);
  if (key_dim == KeyDim::same_as_query && dq == 0) {
    throw ShapeError(fmt::format("q: d_k must be at least 1, got shape {}", q.shape.str()));
  }
  // k and v carry q's leading dims; their token count Tk is theirs to choose.
  const int64_t tk = k.rank() >= 2 ? k.shape.from_back(2) : 0;
  const int64_t dk = key_dim == KeyDim::same_as_query ? dq : (k.rank() >= 1 ? k.shape.from_back(1) : 0);
  check_dims_not_negative(k, "k");
  check_shape("k", k.shape, p.with_leading({tk, dk}));
  const int64_t dv = v.rank() >= 1 ? v.shape.from_back(1) : 0;
  check_dims_not_negative(v, "v");
  check_shape("v", v.shape, p.with_leading({tk, dv}));
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
  p.k = as_bhtd(k, "k");
  p.v = as_bhtd(v, "v");

  p.k_shape = k.shape;
  p.v_shape = v.shape;

  if (mask.allowed) p.allowed = broadcast_to(*mask.allowed, p.scores(), "mask");
  if (mask.bias) {
    p.bias = broadcast_to(*mask.bias, p.scores(), "bias");
    p.bias_shape = mask.bias->shape;
  }
  p.causal = mask.causal;
  return p;
}

template <class T>
AttentionProblem<T> make_attention_problem(const AttentionParams<T>& params) {
  AttentionProblem<T> p{make_attention_operands(params.q, params.k, params.v, params.mask, KeyDim::same_as_query)};
  p.scale = params.scale.value_or(default_scale(p.dq()));
  if (!std::isfinite(p.scale)) throw ValueError(fmt::format("scale: expected a finite number, got {}", p.scale));
  return p;
}

// The forward's outputs against the problem.
template <class T>
void check_forward_outputs(const AttentionOperands<T>& p, const AttentionOutputs<T>& outputs) {
  check_shape("out", outputs.out.shape, p.with_leading({p.tq(), p.dv()}));
  if (outputs.weights) check_shape("weights", outputs.weights->shape, p.with_leading({p.tq(), p.tk()}));
  if (outputs.lse) check_shape("lse", outputs.lse->shape, p.with_leading({p.tq()}));
}

// dO and the gradients of q, k, v and the bias (AttentionGradients or AdditiveAttentionGradients)
// against the problem: dbias only with a bias, of the bias's shape.
template <class T, class Gradients>
void check_backward_arguments(const AttentionOperands<T>& p, TensorView<const T> dout, const Gradients& grads) {
  check_shape("dout", dout.shape, p.with_leading({p.tq(), p.dv()}));
  check_shape("dq", grads.dq.shape, p.q_shape);
  check_shape("dk", grads.dk.shape, p.k_shape);
  check_shape("dv", grads.dv.shape, p.v_shape);
  if (grads.dbias && !p.bias_shape) throw ShapeError("dbias: given, but the mask has no additive bias");
  if (grads.dbias) check_shape("dbias", grads.dbias->shape, *p.bias_shape);
}

// The implementations behind attention_forward and attention_backward, on a problem built once
// (attention.cpp: the reference; attention_fused.cpp: the fused kernel).
template <class T>
void forward_reference(const AttentionProblem<T>& p, const AttentionOutputs<T>& outputs);
template <class T>
void backward_reference(const AttentionProblem<T>& p, TensorView<const T> dout, const AttentionGradients<T>& grads);
template <class T>
void forward_fused(const AttentionProblem<T>& p, const AttentionOutputs<T>& outputs);
template <class T>
void backward_fused(const AttentionProblem<T>& p, TensorView<const T> dout, const AttentionGradients<T>& grads,
                    const std::optional<AttentionSaved<T>>& saved);

}  // namespace qkv::detail
