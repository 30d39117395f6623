// Fused attention, forward and backward: the API boundary (checks, views, saved statistics) and the
// per-instruction-set dispatch. The kernels, and the comment that explains them, are in
// attention_fused-inl.h, which Highway's foreach_target.h compiles once per target below.

#include "qkv/ops/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "attention_problem.hpp"
#include "qkv/core/detail/simd_dispatch.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"

// foreach_target.h includes this path itself, once per target; src/ is a private include
// directory of libqkv. Then the translation unit's own target (the baseline) follows. The order matters.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention_fused-inl.h"
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "attention_fused-inl.h"
// clang-format on

#if HWY_ONCE
namespace qkv {

HWY_EXPORT(ForwardFloat);
HWY_EXPORT(ForwardDouble);
HWY_EXPORT(BackwardFloat);
HWY_EXPORT(BackwardDouble);
HWY_EXPORT(Bf16Products);

namespace {

// A rank-4 view ([B, H, T, D] rows, or [B, H, Tq, Tk] scores) as the kernels see it.
template <class T>
fused::StridedView4<T> strided_of(TensorView<T> view4) {
  return {.data = view4.data,
          .batch_stride = view4.strides[0],
          .head_stride = view4.strides[1],
          .row_stride = view4.strides[2],
          .col_stride = view4.strides[3]};
}

// A [H] operand (ALiBi slopes, sinks) copied contiguous, as the kernels read it.
template <class T>
std::vector<T> per_head(const std::optional<TensorView<const T>>& view) {
  std::vector<T> values;
  if (view) {
    for (int64_t h = 0; h < view->shape[0]; ++h) values.push_back((*view)(h));
  }
  return values;
}

// The problem as the kernels read it; `alibi` holds the slopes it points to.
template <class T>
fused::Inputs<T> kernel_inputs(const detail::AttentionProblem<T>& p, const std::vector<T>& alibi) {
  fused::Inputs<T> in{.batch = p.batch(),
                      .heads = p.heads(),
                      .tq = p.tq(),
                      .tk = p.tk(),
                      .dk = p.dk(),
                      .dv = p.dv(),
                      .q = strided_of(p.q),
                      .k = strided_of(p.k),
                      .v = strided_of(p.v),
                      .q_stored = {},
                      .k_stored = {},
                      .v_stored = {},
                      .allowed = {},
                      .bias = {},
                      .band_lo = p.band_lo,
                      .band_hi = p.band_hi,
                      .diagonal = p.diagonal,
                      .group = std::max<int64_t>(1, p.heads() / std::max<int64_t>(1, p.kv_heads())),
                      .scale = static_cast<T>(p.scale),
                      .softcap = static_cast<T>(p.softcap),
                      .alibi = p.alibi ? alibi.data() : nullptr,
                      .dropout = p.dropout,
                      .dropout_batch0 = p.batch0,
                      .dropout_scale = p.dropout_p > 0.0 ? static_cast<T>(1.0 / (1.0 - p.dropout_p)) : T{0}};
  if (p.allowed) in.allowed = strided_of(*p.allowed);
  if (p.bias) in.bias = strided_of(*p.bias);
  return in;
}

fused::StoredRows stored_rows(const detail::StoredOperand& operand) {
  fused::StoredRows rows{.type = operand.type,
                         .data = static_cast<const uint8_t*>(operand.data),
                         .batch_stride = operand.strides[0],
                         .head_stride = operand.strides[1],
                         .row_stride = operand.strides[2],
                         .scales = {},
                         .pages = operand.pages,
                         .page_table_stride = 0,
                         .page_tokens = operand.page_tokens,
                         .page_stride = operand.page_stride,
                         .scale_page_stride = operand.scale_page_stride};
  if (operand.scales) rows.scales = strided_of(*operand.scales);
  return rows;
}

template <class T>
fused::ForwardParams<T> forward_params(const fused::Inputs<T>& in, const std::vector<T>& sinks, TensorView<T> out,
                                       std::optional<TensorView<T>> lse, T* lse_lo = nullptr) {
  fused::ForwardParams<T> p{.in = in,
                            .out = strided_of(as_bhtd(out, "out")),
                            .lse = {},
                            .lse_lo = lse_lo,
                            .scores_as_backward = lse.has_value(),
                            .sinks = sinks.empty() ? nullptr : sinks.data()};
  if (lse) {
    const TensorView<T> lse4 = as_rank4(*lse);  // [1, B, H, Tq]
    p.lse = {
        .data = lse4.data, .batch_stride = lse4.strides[1], .head_stride = lse4.strides[2], .stride = lse4.strides[3]};
  }
  return p;
}

template <class T>
void dispatch_forward(const fused::ForwardParams<T>& p) {
  detail::prepare_simd_dispatch();
  if constexpr (std::is_same_v<T, float>) {
    HWY_DYNAMIC_DISPATCH(ForwardFloat)(p);
  } else {
    HWY_DYNAMIC_DISPATCH(ForwardDouble)(p);
  }
}

template <class T>
void dispatch_backward(const fused::BackwardParams<T>& p) {
  detail::prepare_simd_dispatch();
  if constexpr (std::is_same_v<T, float>) {
    HWY_DYNAMIC_DISPATCH(BackwardFloat)(p);
  } else {
    HWY_DYNAMIC_DISPATCH(BackwardDouble)(p);
  }
}

// P_sink,bhi·D_bhi of every row (b·H + h)·Tq + i, with D = dO·out, in float64: O(B·H·Tq·Dv), next
// to nothing beside the kernel. The sink has no value (its dP is 0), so d sink_h = −Σ_(b, i) of
// them; and as a row's weights over its keys sum to 1 − P_sink, a bias broadcast over the keys gets
// Σ_j dS_ij = D_i − (1 − P_sink,i)·D_i = P_sink,i·D_i, which the kernel, summing no dbias for such a
// bias, leaves to this.
template <class T>
std::vector<double> sink_row_terms(const detail::AttentionProblem<T>& p, TensorView<const T> dout4,
                                   TensorView<const T> out4, const std::vector<T>& lse_hi,
                                   const std::vector<T>& lse_lo) {
  std::vector<double> terms(static_cast<size_t>(p.batch() * p.heads() * p.tq()));
  for (int64_t b = 0; b < p.batch(); ++b) {
    for (int64_t h = 0; h < p.heads(); ++h) {
      const double sink = static_cast<double>((*p.sinks)(h));
      for (int64_t i = 0; i < p.tq(); ++i) {
        const size_t row = static_cast<size_t>((b * p.heads() + h) * p.tq() + i);
        double delta = 0.0;
        for (int64_t c = 0; c < p.dv(); ++c)
          delta += static_cast<double>(dout4(b, h, i, c)) * static_cast<double>(out4(b, h, i, c));
        const double lse = static_cast<double>(lse_hi[row]) + static_cast<double>(lse_lo[row]);
        terms[row] = std::exp(sink - lse) * delta;
      }
    }
  }
  return terms;
}

// d sink_h += −Σ_(b, i) P_sink,bhi·D_bhi, summed in a fixed order.
template <class T>
void add_sink_gradients(const detail::AttentionProblem<T>& p, const std::vector<double>& terms, TensorView<T> dsinks) {
  for (int64_t h = 0; h < p.heads(); ++h) {
    double sum = 0.0;
    for (int64_t b = 0; b < p.batch(); ++b) {
      for (int64_t i = 0; i < p.tq(); ++i) sum -= terms[static_cast<size_t>((b * p.heads() + h) * p.tq() + i)];
    }
    dsinks(h) += static_cast<T>(sum);
  }
}

// dbias += P_sink·D for a bias broadcast over the keys (dbias seen as [B, H, Tq, Tk], stride 0
// along the keys), in a fixed order.
template <class T>
void add_key_broadcast_bias_gradients(const detail::AttentionProblem<T>& p, const std::vector<double>& terms,
                                      TensorView<T> dbias4) {
  for (int64_t b = 0; b < p.batch(); ++b) {
    for (int64_t h = 0; h < p.heads(); ++h) {
      for (int64_t i = 0; i < p.tq(); ++i)
        dbias4(b, h, i, 0) += static_cast<T>(terms[static_cast<size_t>((b * p.heads() + h) * p.tq() + i)]);
    }
  }
}

}  // namespace

namespace detail {

template <class T>
void forward_fused(const AttentionProblem<T>& problem, const AttentionOutputs<T>& outputs) {
  if (outputs.weights) {
    throw ValueError(
        "weights: the fused kernel never materialises the Tq×Tk weights α; use AttentionImpl::reference (or automatic) "
        "to get them");
  }
  check_forward_outputs(problem, outputs);
  if (problem.packed()) {
    for (int64_t n = 0; n < problem.sequences(); ++n) {
      const SequenceRange r = sequence_range(problem, n);
      forward_fused(sequence_problem(problem, r), sequence_outputs(outputs, r));
    }
    return;
  }
  const std::vector<T> alibi = per_head(problem.alibi), sinks = per_head(problem.sinks);
  dispatch_forward(forward_params(kernel_inputs(problem, alibi), sinks, outputs.out, outputs.lse));
}

void forward_fused_stored(const AttentionProblem<float>& problem, const StoredOperands& stored,
                          const AttentionOutputs<float>& outputs) {
  if (outputs.weights) {
    throw ValueError("weights: the fused kernel never materialises the Tq×Tk weights α; use AttentionImpl::reference");
  }
  check_forward_outputs(problem, outputs);
  const std::vector<float> alibi = per_head(problem.alibi), sinks = per_head(problem.sinks);
  fused::Inputs<float> in = kernel_inputs(problem, alibi);
  in.q_stored = stored_rows(stored.q);
  in.k_stored = stored_rows(stored.k);
  in.v_stored = stored_rows(stored.v);
  dispatch_forward(forward_params(in, sinks, outputs.out, outputs.lse));
}

template <class T>
void check_backward_call(const AttentionProblem<T>& problem, TensorView<const T> dout,
                         const AttentionGradients<T>& grads, const std::optional<AttentionSaved<T>>& saved) {
  check_backward_arguments(problem, dout, grads);
  check_sink_gradient(problem, grads);
  if (saved) {
    check_shape("saved.out", saved->out.shape, problem.with_leading({problem.tq(), problem.dv()}));
    check_shape("saved.lse", saved->lse.shape, problem.with_leading({problem.tq()}));
  }
}

// The backward of one sequence (or of a batch of equal ones) on the kernels' view of the problem,
// `in`, whose operands may be stored narrower (then only float32).
template <class T>
void backward_kernels(const AttentionProblem<T>& problem, const fused::Inputs<T>& in, const std::vector<T>& sinks,
                      TensorView<const T> dout, const AttentionGradients<T>& grads,
                      const std::optional<AttentionSaved<T>>& saved);

template <class T>
void backward_fused(const AttentionProblem<T>& problem, TensorView<const T> dout, const AttentionGradients<T>& grads,
                    const std::optional<AttentionSaved<T>>& saved) {
  check_backward_call(problem, dout, grads, saved);
  if (problem.packed()) {
    for (int64_t n = 0; n < problem.sequences(); ++n) {
      const SequenceRange r = sequence_range(problem, n);
      std::optional<AttentionSaved<T>> part;
      if (saved) {
        part = AttentionSaved<T>{.out = token_range(as_bhtd(saved->out, "saved.out"), 2, r.q0, r.q1),
                                 .lse = row_stat_range(saved->lse, r)};
      }
      backward_fused(sequence_problem(problem, r), token_range(as_bhtd(dout, "dout"), 2, r.q0, r.q1),
                     sequence_gradients(problem, grads, r), part);
    }
    return;
  }
  const std::vector<T> alibi = per_head(problem.alibi), sinks = per_head(problem.sinks);
  backward_kernels(problem, kernel_inputs(problem, alibi), sinks, dout, grads, saved);
}

void backward_fused_stored(const AttentionProblem<float>& problem, const StoredOperands& stored,
                           TensorView<const float> dout, const AttentionGradients<float>& grads,
                           const std::optional<AttentionSaved<float>>& saved) {
  check_backward_call(problem, dout, grads, saved);
  const std::vector<float> alibi = per_head(problem.alibi), sinks = per_head(problem.sinks);
  fused::Inputs<float> in = kernel_inputs(problem, alibi);
  in.q_stored = stored_rows(stored.q);
  in.k_stored = stored_rows(stored.k);
  in.v_stored = stored_rows(stored.v);
  backward_kernels(problem, in, sinks, dout, grads, saved);
}

template <class T>
void backward_kernels(const AttentionProblem<T>& problem, const fused::Inputs<T>& in, const std::vector<T>& sinks,
                      TensorView<const T> dout, const AttentionGradients<T>& grads,
                      const std::optional<AttentionSaved<T>>& saved) {
  // Without the forward's results, run it: out and lse are O(T·d), never O(T²). Its lse then
  // comes in two parts, so P is recomputed without the rounding of lse to T (a relative error of
  // up to half an ulp of lse in every P) that a saved lse carries.
  const size_t rows = static_cast<size_t>(in.heads_total() * in.tq);
  std::vector<T> lse_lo(rows);
  Tensor<T> recomputed_out, recomputed_lse;
  TensorView<const T> out = saved ? saved->out : TensorView<const T>{};
  TensorView<const T> lse = saved ? saved->lse : TensorView<const T>{};
  if (!saved) {
    recomputed_out = Tensor<T>(problem.with_leading({in.tq, in.dv}));
    recomputed_lse = Tensor<T>(problem.with_leading({in.tq}));
    dispatch_forward(forward_params<T>(in, sinks, recomputed_out.view(), recomputed_lse.view(), lse_lo.data()));
    out = recomputed_out.cview();
    lse = recomputed_lse.cview();
  }
  // The kernels load dO rows as vectors: a dout whose last dim is strided is copied first.
  Tensor<T> dout_copy;
  TensorView<const T> dout4 = as_bhtd(dout, "dout");
  if (dout4.shape[3] > 1 && dout4.strides[3] != 1) {
    dout_copy = to_tensor<T, T>(dout4);
    dout4 = dout_copy.cview();
  }

  // Per row, the lse that P is recomputed from; fully masked rows (−inf) become +inf, see lse_hi.
  const TensorView<const T> lse4 = as_rank4(lse);
  std::vector<T> lse_hi(rows);
  for (int64_t bh = 0; bh < in.heads_total(); ++bh) {
    for (int64_t i = 0; i < in.tq; ++i) {
      const T row_lse = lse4(0, bh / in.heads, bh % in.heads, i);
      lse_hi[static_cast<size_t>(bh * in.tq + i)] =
          row_lse == -std::numeric_limits<T>::infinity() ? std::numeric_limits<T>::infinity() : row_lse;
    }
  }

  fused::BackwardParams<T> p{.in = in,
                             .dout = strided_of(dout4),
                             .lse_hi = lse_hi.data(),
                             .lse_lo = lse_lo.data(),
                             .out = strided_of(as_bhtd(out, "saved.out")),
                             .dq = strided_of(as_bhtd(grads.dq, "dq")),
                             .dk = strided_of(as_bhtd(grads.dk, "dk")),
                             .dv = strided_of(as_bhtd(grads.dv, "dv")),
                             .dbias = {}};
  std::optional<TensorView<T>> dbias4;
  if (grads.dbias) {
    dbias4 = broadcast_to(*grads.dbias, problem.scores(), "dbias");
    p.dbias = strided_of(*dbias4);
  }
  dispatch_backward(p);
  const bool key_broadcast_bias = dbias4 && dbias4->strides[3] == 0;
  if (problem.sinks && (grads.dsinks || key_broadcast_bias)) {
    const std::vector<double> terms = sink_row_terms(problem, dout4, as_bhtd(out, "saved.out"), lse_hi, lse_lo);
    if (grads.dsinks) add_sink_gradients(problem, terms, *grads.dsinks);
    if (key_broadcast_bias) add_key_broadcast_bias_gradients(problem, terms, *dbias4);
  }
}

}  // namespace detail

template <class T>
void attention_forward_fused(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs) {
  detail::forward_fused(detail::make_attention_problem(params), outputs);
}

template <class T>
void attention_backward_fused(const AttentionParams<T>& params, TensorView<const T> dout,
                              const AttentionGradients<T>& grads, const std::optional<AttentionSaved<T>>& saved) {
  detail::backward_fused(detail::make_attention_problem(params), dout, grads, saved);
}

#define QKV_INSTANTIATE_ATTENTION_FUSED(T)                                                                             \
  template void detail::forward_fused(const detail::AttentionProblem<T>&, const AttentionOutputs<T>&);                 \
  template void detail::backward_fused(const detail::AttentionProblem<T>&, TensorView<const T>,                        \
                                       const AttentionGradients<T>&, const std::optional<AttentionSaved<T>>&);         \
  template void attention_forward_fused(const AttentionParams<T>&, const AttentionOutputs<T>&);                        \
  template void attention_backward_fused(const AttentionParams<T>&, TensorView<const T>, const AttentionGradients<T>&, \
                                         const std::optional<AttentionSaved<T>>&);

QKV_INSTANTIATE_ATTENTION_FUSED(float)
QKV_INSTANTIATE_ATTENTION_FUSED(double)
#undef QKV_INSTANTIATE_ATTENTION_FUSED

bool attention_bf16_products() {
  detail::prepare_simd_dispatch();
  return HWY_DYNAMIC_DISPATCH(Bf16Products)();
}

}  // namespace qkv
#endif  // HWY_ONCE
