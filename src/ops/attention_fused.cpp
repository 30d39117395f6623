// Fused attention, forward and backward: the API boundary (checks, views, saved statistics) and the
// per-instruction-set dispatch. The kernels, and the comment that explains them, are in
// attention_fused-inl.h, which Highway's foreach_target.h compiles once per target below.

#include "qkv/ops/attention.hpp"

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

// The inputs of one call, checked by make_attention_problem (as the reference checks them), seen as
// [B, H, T, D].
template <class T>
struct Call {
  fused::Inputs<T> in;
  Shape leading;  // the leading dims of q as given (rank 0 to 2), for the shapes of outputs

  Shape with_leading(std::initializer_list<int64_t> tail) const {
    std::vector<int64_t> dims(leading.dims().begin(), leading.dims().end());
    dims.insert(dims.end(), tail.begin(), tail.end());
    return Shape(std::span<const int64_t>(dims));
  }
  Shape scores() const { return {in.batch, in.heads, in.tq, in.tk}; }
};

template <class T>
Call<T> make_call(const AttentionParams<T>& params) {
  const detail::AttentionProblem<T> problem = detail::make_attention_problem(params);
  Call<T> call;
  call.leading = problem.leading;
  call.in = {.batch = problem.batch(),
             .heads = problem.heads(),
             .tq = problem.tq(),
             .tk = problem.tk(),
             .dk = problem.dk(),
             .dv = problem.dv(),
             .q = strided_of(problem.q),
             .k = strided_of(problem.k),
             .v = strided_of(problem.v),
             .allowed = {},
             .bias = {},
             .causal = problem.causal,
             .scale = static_cast<T>(problem.scale)};
  if (problem.allowed) call.in.allowed = strided_of(*problem.allowed);
  if (problem.bias) call.in.bias = strided_of(*problem.bias);
  return call;
}

template <class T>
fused::ForwardParams<T> forward_params(const Call<T>& call, TensorView<T> out, std::optional<TensorView<T>> lse,
                                       T* lse_lo = nullptr) {
  fused::ForwardParams<T> p{.in = call.in, .out = strided_of(as_bhtd(out, "out")), .lse = {}, .lse_lo = lse_lo};
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

}  // namespace

template <class T>
void attention_forward_fused(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs) {
  const Call<T> call = make_call(params);
  const fused::Inputs<T>& in = call.in;
  check_shape("out", outputs.out.shape, call.with_leading({in.tq, in.dv}));
  if (outputs.weights) {
    throw ValueError(
        "weights: the fused kernel never materialises the Tq×Tk weights α; use AttentionImpl::reference (or automatic) "
        "to get them");
  }
  if (outputs.lse) check_shape("lse", outputs.lse->shape, call.with_leading({in.tq}));
  dispatch_forward(forward_params(call, outputs.out, outputs.lse));
}

template <class T>
void attention_backward_fused(const AttentionParams<T>& params, TensorView<const T> dout,
                              const AttentionGradients<T>& grads, const std::optional<AttentionSaved<T>>& saved) {
  const Call<T> call = make_call(params);
  const fused::Inputs<T>& in = call.in;
  check_shape("dout", dout.shape, call.with_leading({in.tq, in.dv}));
  check_shape("dq", grads.dq.shape, params.q.shape);
  check_shape("dk", grads.dk.shape, params.k.shape);
  check_shape("dv", grads.dv.shape, params.v.shape);
  if (grads.dbias && !params.mask.bias) throw ShapeError("dbias: given, but the mask has no additive bias");
  if (grads.dbias) check_shape("dbias", grads.dbias->shape, params.mask.bias->shape);
  if (saved) {
    check_shape("saved.out", saved->out.shape, call.with_leading({in.tq, in.dv}));
    check_shape("saved.lse", saved->lse.shape, call.with_leading({in.tq}));
  }

  // Without the forward's results, run it: out and lse are O(T·d), never O(T²). Its lse then
  // comes in two parts, so P is recomputed without the rounding of lse to T (a relative error of
  // up to half an ulp of lse in every P) that a saved lse carries.
  const size_t rows = static_cast<size_t>(in.heads_total() * in.tq);
  std::vector<T> lse_lo(rows);
  Tensor<T> recomputed_out, recomputed_lse;
  TensorView<const T> out = saved ? saved->out : TensorView<const T>{};
  TensorView<const T> lse = saved ? saved->lse : TensorView<const T>{};
  if (!saved) {
    recomputed_out = Tensor<T>(call.with_leading({in.tq, in.dv}));
    recomputed_lse = Tensor<T>(call.with_leading({in.tq}));
    dispatch_forward(forward_params<T>(call, recomputed_out.view(), recomputed_lse.view(), lse_lo.data()));
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
  if (grads.dbias) p.dbias = strided_of(broadcast_to(*grads.dbias, call.scores(), "dbias"));
  dispatch_backward(p);
}

#define QKV_INSTANTIATE_ATTENTION_FUSED(T)                                                                             \
  template void attention_forward_fused(const AttentionParams<T>&, const AttentionOutputs<T>&);                        \
  template void attention_backward_fused(const AttentionParams<T>&, TensorView<const T>, const AttentionGradients<T>&, \
                                         const std::optional<AttentionSaved<T>>&);

QKV_INSTANTIATE_ATTENTION_FUSED(float)
QKV_INSTANTIATE_ATTENTION_FUSED(double)
#undef QKV_INSTANTIATE_ATTENTION_FUSED

}  // namespace qkv
#endif  // HWY_ONCE
