// qkv.attention, qkv.attention_backward, qkv.additive_attention and its backward: numpy arrays
// through the C++ ops of qkv/ops/attention.hpp and qkv/ops/additive_attention.hpp.

#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "arrays.hpp"
#include "attention_args.hpp"
#include "module.hpp"
#include "qkv/core/error.hpp"
#include "qkv/ops/additive_attention.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv::python {
namespace {

using namespace pybind11::literals;

// float64 runs the plain-loop reference unless told otherwise: its float64 accumulation is what a
// float64 caller (gradcheck, a reference computation) wants.
AttentionImpl impl_for(std::string_view impl, Precision precision) {
  const AttentionImpl chosen = impl_of(impl);
  if (chosen == AttentionImpl::automatic && precision == Precision::float64) return AttentionImpl::reference;
  return chosen;
}

// The [B, H, T, D] reading of q's, k's and v's shapes, checked here only so that the outputs can be
// shaped; the op checks everything else.
struct Dims {
  Shape q_shape;
  int64_t tq, tk, dv;
  static int64_t dim(const Shape& shape, std::string_view name, int axis) {
    return as_bhtd(make_view<const float>(nullptr, shape), name).shape[axis];
  }
  Dims(const Shape& q, const Shape& k, const Shape& v)
      : q_shape(q), tq(dim(q, "q", 2)), tk(dim(k, "k", 2)), dv(dim(v, "v", 3)) {}
  int leading() const { return q_shape.rank() - 2; }
};

// The arrays a forward writes: out, and lse and weights when asked for; shaped from q, k and v.
template <class T>
struct ForwardArrays {
  py::array_t<T> out;
  std::optional<py::array_t<T>> lse, weights;

  ForwardArrays(const Shape& q, const Shape& k, const Shape& v, const ForwardRequest& r) {
    const Dims dims(q, k, v);
    out = new_array<T>(leading_dims_with(dims.q_shape, dims.leading(), {dims.tq, dims.dv}), "out");
    if (r.return_lse) lse = new_array<T>(leading_dims_with(dims.q_shape, dims.leading(), {dims.tq}), "lse");
    if (r.return_weights) {
      weights = new_array<T>(leading_dims_with(dims.q_shape, dims.leading(), {dims.tq, dims.tk}), "weights");
    }
  }

  AttentionOutputs<T> views() {
    AttentionOutputs<T> outputs{view_of(out), std::nullopt, std::nullopt};
    if (lse) outputs.lse = view_of(*lse);
    if (weights) outputs.weights = view_of(*weights);
    return outputs;
  }

  // out alone, or (out, lse), (out, weights), (out, lse, weights).
  py::object result() {
    if (!lse && !weights) return std::move(out);
    py::list results;
    results.append(out);
    if (lse) results.append(*lse);
    if (weights) results.append(*weights);
    return py::tuple(results);
  }
};

void refuse_fused_weights(const ForwardRequest& r) {
  if (r.return_weights && impl_of(r.impl) == AttentionImpl::fused) {
    throw ValueError(
        "return_weights: impl=\"fused\" never materialises the Tq×Tk weights; use impl=\"auto\" or "
        "\"reference\" to have them returned");
  }
}

// What q of attention() may be, as its refusals list them.
constexpr std::string_view kAttentionDtypes = "float32, float64, float16 or uint16 (bfloat16 bits, with bf16=True)";

// Whether q, k and v take the stored path (float32 out of float16, bfloat16 or int8 operands):
// when one of them has such a dtype, or scales or bf16=True say so.
bool stored_operands(const py::object& q, const py::object& k, const py::object& v, const ForwardRequest& r) {
  if (r.bf16 || !r.k_scales.is_none() || !r.v_scales.is_none()) return true;
  for (const py::object& operand : {q, k, v}) {
    const py::array array = py::array::ensure(operand);
    if (!array) continue;  // not an array: refused, by name, where its dtype is read
    const py::dtype dtype = array.dtype();
    if (dtype.kind() == 'u' || (dtype.kind() == 'f' && dtype.itemsize() == 2) ||
        (dtype.kind() == 'i' && dtype.itemsize() == 1)) {
      return true;
    }
  }
  return false;
}

StoredAttentionParams stored_params(Inputs& in, const py::object& q, const py::object& k, const py::object& v,
                                    const ForwardRequest& r) {
  if (r.dropout.p != 0) {
    throw ValueError(
        fmt::format("dropout: expected 0 with float16, bfloat16 or int8 operands (dropout is taken with float32 "
                    "and float64 ones), got {}",
                    r.dropout.p));
  }
  // float64 runs the float64 reference, which takes no narrower operand beside it.
  for (const auto& [operand, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    const py::array array = py::array::ensure(*operand);
    if (array && array.dtype().kind() == 'f' && array.itemsize() == 8) {
      throw ShapeError(
          fmt::format("{}: expected float32 beside float16, bfloat16 or int8 operands (float64 runs with "
                      "q, k and v all float64), got float64",
                      name));
    }
  }
  StoredAttentionParams p{.q = in.stored(q, "q", py::none(), "", r.bf16, r.allow_nonfinite),
                          .k = in.stored(k, "k", r.k_scales, "k_scales", r.bf16, r.allow_nonfinite),
                          .v = in.stored(v, "v", r.v_scales, "v_scales", r.bf16, r.allow_nonfinite),
                          .scale = r.scale,
                          .mask = mask_of<float>(in, r),
                          .softcap = r.softcap};
  check_bf16_flag(r.bf16, {&p.q, &p.k, &p.v}, "q, k, v");
  set_head_options<float>(in, r, Dims::dim(p.q.shape, "q", 1), p.mask, p.sinks);
  return p;
}

template <class T, class Params>
py::object forward_of(const Params& p, const ForwardRequest& r, AttentionImpl impl) {
  ForwardArrays<T> arrays(p.q.shape, p.k.shape, p.v.shape, r);
  const AttentionOutputs<T> outputs = arrays.views();
  run_without_gil([&] { attention_forward(p, outputs, impl); });
  return arrays.result();
}

template <class T>
py::object attention_as(const py::object& q, const py::object& k, const py::object& v, const ForwardRequest& r) {
  Inputs in;
  const AttentionParams<T> p = attention_params<T>(in, q, k, v, r);
  return forward_of<T>(p, r, impl_for(r.impl, sizeof(T) == 4 ? Precision::float32 : Precision::float64));
}

py::object attention(const py::object& q, const py::object& k, const py::object& v, std::optional<double> scale,
                     const py::object& causal, const py::object& mask, const std::string& impl, bool return_lse,
                     bool return_weights, bool allow_nonfinite, const py::object& window, std::optional<double> softcap,
                     const py::object& alibi, const py::object& sinks, const py::object& cu_seqlens_q,
                     const py::object& cu_seqlens_k, double dropout, const py::object& seed, const py::object& k_scales,
                     const py::object& v_scales, bool bf16) {
  const ForwardRequest r{.scale = scale,
                         .causality = causality_of(causal),
                         .window = window_of(window),
                         .mask = mask,
                         .impl = impl,
                         .return_lse = return_lse,
                         .return_weights = return_weights,
                         .allow_nonfinite = allow_nonfinite,
                         .softcap = softcap,
                         .alibi = alibi,
                         .sinks = sinks,
                         .cu_seqlens_q = cu_seqlens_q,
                         .cu_seqlens_k = cu_seqlens_k,
                         .dropout = {dropout, seed_of(seed)},
                         .k_scales = k_scales,
                         .v_scales = v_scales,
                         .bf16 = bf16};
  refuse_fused_weights(r);
  if (stored_operands(q, k, v, r)) {
    Inputs in;
    const StoredAttentionParams p = stored_params(in, q, k, v, r);
    return forward_of<float>(p, r, impl_of(r.impl));
  }
  if (precision_of(q, "q", kAttentionDtypes) == Precision::float32) return attention_as<float>(q, k, v, r);
  return attention_as<double>(q, k, v, r);
}

// `dtype_of` names what dout, out and lse take their dtype from: q's, or the float32 outputs of
// stored operands.
template <class T, class Params>
py::tuple backward_of(Inputs& in, const Params& p, const py::object& dout, const py::object& out, const py::object& lse,
                      const ForwardRequest& r, AttentionImpl impl, std::string_view dtype_of) {
  if (out.is_none() != lse.is_none()) {
    throw ValueError(
        fmt::format("out, lse: expected both (what attention(..., return_lse=True) returns) or neither, "
                    "got only {}",
                    out.is_none() ? "lse" : "out"));
  }
  const TensorView<const T> dout_view = in.floats<T>(dout, "dout", dtype_of, r.allow_nonfinite);
  std::optional<AttentionSaved<T>> saved;
  if (!out.is_none()) {
    saved = AttentionSaved<T>{in.floats<T>(out, "out", dtype_of, r.allow_nonfinite),
                              in.floats<T>(lse, "lse", dtype_of, true)};
  }
  auto dq = new_array<T>(p.q.shape, "dq", true);
  auto dk = new_array<T>(p.k.shape, "dk", true);
  auto dv = new_array<T>(p.v.shape, "dv", true);
  std::optional<py::array_t<T>> dbias, dsinks;
  AttentionGradients<T> grads{view_of(dq), view_of(dk), view_of(dv), std::nullopt};
  if (p.mask.bias) {
    dbias = new_array<T>(p.mask.bias->shape, "dbias", true);
    grads.dbias = view_of(*dbias);
  }
  if (p.sinks) {
    dsinks = new_array<T>(p.sinks->shape, "dsinks", true);
    grads.dsinks = view_of(*dsinks);
  }
  run_without_gil([&] { attention_backward(p, dout_view, grads, saved, impl); });
  py::list results;
  for (const auto& grad : {dq, dk, dv}) results.append(grad);
  if (dbias) results.append(*dbias);
  if (dsinks) results.append(*dsinks);
  return py::tuple(results);
}

template <class T>
py::tuple attention_backward_as(const py::object& q, const py::object& k, const py::object& v, const py::object& dout,
                                const py::object& out, const py::object& lse, const ForwardRequest& r) {
  Inputs in;
  const AttentionParams<T> p = attention_params<T>(in, q, k, v, r);
  return backward_of<T>(in, p, dout, out, lse, r,
                        impl_for(r.impl, sizeof(T) == 4 ? Precision::float32 : Precision::float64), "q");
}

py::tuple attention_backward(const py::object& q, const py::object& k, const py::object& v, const py::object& dout,
                             const py::object& out, const py::object& lse, std::optional<double> scale,
                             const py::object& causal, const py::object& mask, const std::string& impl,
                             bool allow_nonfinite, const py::object& window, std::optional<double> softcap,
                             const py::object& alibi, const py::object& sinks, const py::object& cu_seqlens_q,
                             const py::object& cu_seqlens_k, double dropout, const py::object& seed,
                             const py::object& k_scales, const py::object& v_scales, bool bf16) {
  const ForwardRequest r{.scale = scale,
                         .causality = causality_of(causal),
                         .window = window_of(window),
                         .mask = mask,
                         .impl = impl,
                         .allow_nonfinite = allow_nonfinite,
                         .softcap = softcap,
                         .alibi = alibi,
                         .sinks = sinks,
                         .cu_seqlens_q = cu_seqlens_q,
                         .cu_seqlens_k = cu_seqlens_k,
                         .dropout = {dropout, seed_of(seed)},
                         .k_scales = k_scales,
                         .v_scales = v_scales,
                         .bf16 = bf16};
  if (stored_operands(q, k, v, r)) {
    Inputs in;
    const StoredAttentionParams p = stored_params(in, q, k, v, r);
    return backward_of<float>(in, p, dout, out, lse, r, impl_of(r.impl),
                              "attention's outputs for float16, bfloat16 or int8 operands");
  }
  if (precision_of(q, "q", kAttentionDtypes) == Precision::float32) {
    return attention_backward_as<float>(q, k, v, dout, out, lse, r);
  }
  return attention_backward_as<double>(q, k, v, dout, out, lse, r);
}

template <class T>
AdditiveAttentionParams<T> additive_params(Inputs& in, const py::object& q, const py::object& k, const py::object& v,
                                           const py::object& w_q, const py::object& w_k, const py::object& w,
                                           const ForwardRequest& r) {
  return {in.floats<T>(q, "q", "", r.allow_nonfinite),
          in.floats<T>(k, "k", "q", r.allow_nonfinite),
          in.floats<T>(v, "v", "q", r.allow_nonfinite),
          in.floats<T>(w_q, "w_q", "q", r.allow_nonfinite),
          in.floats<T>(w_k, "w_k", "q", r.allow_nonfinite),
          in.floats<T>(w, "w", "q", r.allow_nonfinite),
          mask_of<T>(in, r)};
}

template <class T>
py::object additive_as(const py::object& q, const py::object& k, const py::object& v, const py::object& w_q,
                       const py::object& w_k, const py::object& w, const ForwardRequest& r) {
  Inputs in;
  const AdditiveAttentionParams<T> p = additive_params<T>(in, q, k, v, w_q, w_k, w, r);
  ForwardArrays<T> arrays(p.q.shape, p.k.shape, p.v.shape, r);
  const AttentionOutputs<T> outputs = arrays.views();
  run_without_gil([&] { additive_attention_forward(p, outputs); });
  return arrays.result();
}

py::object additive_attention(const py::object& q, const py::object& k, const py::object& v, const py::object& w_q,
                              const py::object& w_k, const py::object& w, const py::object& causal,
                              const py::object& mask, bool return_lse, bool return_weights, bool allow_nonfinite,
                              const py::object& window, const py::object& cu_seqlens_q,
                              const py::object& cu_seqlens_k) {
  const ForwardRequest r{.causality = causality_of(causal),
                         .window = window_of(window),
                         .mask = mask,
                         .impl = "reference",
                         .return_lse = return_lse,
                         .return_weights = return_weights,
                         .allow_nonfinite = allow_nonfinite,
                         .cu_seqlens_q = cu_seqlens_q,
                         .cu_seqlens_k = cu_seqlens_k};
  if (precision_of(q, "q") == Precision::float32) return additive_as<float>(q, k, v, w_q, w_k, w, r);
  return additive_as<double>(q, k, v, w_q, w_k, w, r);
}

template <class T>
py::tuple additive_backward_as(const py::object& q, const py::object& k, const py::object& v, const py::object& w_q,
                               const py::object& w_k, const py::object& w, const py::object& dout,
                               const ForwardRequest& r) {
  Inputs in;
  const AdditiveAttentionParams<T> p = additive_params<T>(in, q, k, v, w_q, w_k, w, r);
  const TensorView<const T> dout_view = in.floats<T>(dout, "dout", "q", r.allow_nonfinite);
  auto dq = new_array<T>(p.q.shape, "dq", true);
  auto dk = new_array<T>(p.k.shape, "dk", true);
  auto dv = new_array<T>(p.v.shape, "dv", true);
  auto dw_q = new_array<T>(p.w_q.shape, "dw_q", true);
  auto dw_k = new_array<T>(p.w_k.shape, "dw_k", true);
  auto dw = new_array<T>(p.w.shape, "dw", true);
  std::optional<py::array_t<T>> dbias;
  AdditiveAttentionGradients<T> grads{view_of(dq),   view_of(dk), view_of(dv), view_of(dw_q),
                                      view_of(dw_k), view_of(dw), std::nullopt};
  if (p.mask.bias) {
    dbias = new_array<T>(p.mask.bias->shape, "dbias", true);
    grads.dbias = view_of(*dbias);
  }
  run_without_gil([&] { additive_attention_backward(p, dout_view, grads); });
  if (dbias) return py::make_tuple(dq, dk, dv, dw_q, dw_k, dw, *dbias);
  return py::make_tuple(dq, dk, dv, dw_q, dw_k, dw);
}

py::tuple additive_attention_backward(const py::object& q, const py::object& k, const py::object& v,
                                      const py::object& w_q, const py::object& w_k, const py::object& w,
                                      const py::object& dout, const py::object& causal, const py::object& mask,
                                      bool allow_nonfinite, const py::object& window, const py::object& cu_seqlens_q,
                                      const py::object& cu_seqlens_k) {
  const ForwardRequest r{.causality = causality_of(causal),
                         .window = window_of(window),
                         .mask = mask,
                         .impl = "reference",
                         .allow_nonfinite = allow_nonfinite,
                         .cu_seqlens_q = cu_seqlens_q,
                         .cu_seqlens_k = cu_seqlens_k};
  if (precision_of(q, "q") == Precision::float32) return additive_backward_as<float>(q, k, v, w_q, w_k, w, dout, r);
  return additive_backward_as<double>(q, k, v, w_q, w_k, w, dout, r);
}

// bench/python_overhead.py's baseline: seconds per call of the float32 fused forward on q, k and v,
// `calls` calls timed in C++ into outputs allocated once, with no Python between them.
double time_fused_forward(const py::object& q, const py::object& k, const py::object& v, int64_t calls) {
  if (calls < 1) throw ValueError(fmt::format("calls: expected at least 1, got {}", calls));
  const ForwardRequest r{.impl = "fused", .return_lse = true};
  Inputs in;
  const AttentionParams<float> p = attention_params<float>(in, q, k, v, r);
  ForwardArrays<float> arrays(p.q.shape, p.k.shape, p.v.shape, r);
  const AttentionOutputs<float> outputs = arrays.views();
  double seconds = 0;
  run_without_gil([&] {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < calls; ++i) attention_forward_fused(p, outputs);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  return seconds / static_cast<double>(calls);
}

constexpr const char* kAttentionDoc = R"(Scaled dot-product attention: out = softmax(scale * q @ k^T + bias) @ v.

Shapes (B batch, H heads, Hkv key/value heads, Tq queries, Tk keys, Dk and Dv feature widths):
    q    [B, H, Tq, Dk]       out      [B, H, Tq, Dv]
    k    [B, Hkv, Tk, Dk]     lse      [B, H, Tq]       log (sum_j exp(s_ij) + exp(sink_h))
    v    [B, Hkv, Tk, Dv]     weights  [B, H, Tq, Tk]   alpha, each row sums to 1 (less the sink)
B and H may be left out together, or B alone: [Tq, Dk] and [H, Tq, Dk] work; B may also be any
number of batch dims, [B1, ..., Bn, H, Tq, Dk], run as one batch of B1*...*Bn. The outputs keep
q's leading dims. k and v have q's leading dims, except that Hkv may be any divisor of H
(grouped-query attention, Hkv = 1 multi-query): query head h reads key/value head h // (H // Hkv).

Arguments:
    scale: multiplies q . k; 1/sqrt(Dk) when None.
    causal: False, True or "bottom-right" (query i sees key j iff j <= i + Tk - Tq: with Tq < Tk,
        as with a KV cache, the last query sees every key), or "top-left" (j <= i, PyTorch's
        is_causal). The two agree when Tq == Tk. The window and ALiBi measure from the same
        diagonal: top-left with causal="top-left", bottom-right otherwise.
    window: None or (left, right): query i sees keys i + o - left <= j <= i + o + right, with o
        the diagonal's offset (Tk - Tq bottom-right, 0 top-left); -1 leaves a side unbounded.
        (0, 0) leaves each query its diagonal key alone; (-1, 0) is causal.
    mask: broadcastable to [..., H, Tq, Tk]. bool or integer: nonzero = may attend. float (q's dtype,
        or float32 for float64 q): a bias added to the scaled scores, -inf masks a key. It combines
        with causal and the window.
    softcap: None or c > 0: the scaled scores x become c * tanh(x / c) before the bias is added.
    alibi: None, "auto" (the standard slopes, alibi_slopes(H)) or [H] slopes m_h: adds
        -m_h * |i + o - j| to the scores.
    sinks: None or [H] logits, one per head, that join every row's softmax with no value: the
        weights of a row then sum to 1 - exp(sink_h - lse_i).
    cu_seqlens_q, cu_seqlens_k: None, or both: [N+1] offsets (int32 or int64 arrays, or lists)
        of N sequences packed along T in a batch of one (q [H, Tq, Dk] or [1, H, Tq, Dk]):
        sequence n holds queries cu_seqlens_q[n]:cu_seqlens_q[n+1] and keys
        cu_seqlens_k[n]:cu_seqlens_k[n+1], from 0 to Tq and Tk, never decreasing (a sequence
        may be empty). A query sees its own sequence's keys alone, and causal, the window and
        ALiBi count i and j within the sequence: the same as N separate calls, concatenated.
        A mask still spans the packed [Tq, Tk].
    dropout: p in [0, 1): each weight is dropped with probability p and the kept ones are scaled
        by 1/(1 - p) in out; lse and the returned weights are those before dropout. 0 is exactly
        no dropout.
    seed: an int in [0, 2**64) that, with (b, h, i, j), decides each drop (Philox 4x32-10; for
        packed sequences b is the sequence and i, j count within it): the same mask for both
        implementations, every thread count and SIMD target. Pass the backward the same one.
    impl: "auto" (the fused kernel for float32, the float64 reference for float64, the reference
        whenever weights are asked for), "fused" (tiled FlashAttention-2 kernel: O(T) memory, SIMD,
        threads; cannot return weights) or "reference" (plain loops accumulating in float64).
    return_lse, return_weights: also return lse and weights, in that order: (out, lse, weights).
    allow_nonfinite: accept NaN and infinities in q, k, v, the bias, alibi and sinks (refused
        otherwise).

dtype: float32 or float64, the same for q, k and v; the outputs have it too. Or operands stored
narrower, each in its own dtype, with float32 outputs: float16 (q, k, v), bfloat16 (q, k, v, as
its bits in a uint16 array, with bf16=True; to_bfloat16 makes them) and int8 (k and v, with
k_scales and v_scales: value = scale * stored, float32 scales broadcasting to the operand, e.g.
[..., Hkv, 1, Dk] per channel for k and [..., Hkv, Tk, 1] per token for v; quantize_int8 makes
both). Scores, softmax and out accumulate in float32; the fused kernel converts K and V a tile at
a time where it reads them, never copying them whole. The stored path takes every option above but
cu_seqlens_q/cu_seqlens_k and dropout. Other dtypes are refused (convert with .astype). alibi and sinks take q's dtype (float32 too for float64 q), or
are lists of numbers. C-contiguous arrays, and strided views whose last dim is contiguous, are
read in place; anything else is copied once.

A query whose every key is masked has out 0, lse -inf (the sink's logit, with sinks) and a weights
row of 0: never NaN.
The GIL is released while it computes; Ctrl-C interrupts it (KeyboardInterrupt).
Raises ValueError (qkv.ShapeError for shapes and dtypes) and MemoryError (qkv.ResourceError) when
the outputs, or the reference's per-head scores, would not fit in memory.)";

constexpr const char* kAttentionBackwardDoc =
    R"(Gradients of attention(q, k, v, ...): (dq, dk, dv), then dbias when mask is a float bias, then dsinks when sinks are given.

dout [B, H, Tq, Dv] is the gradient of the loss with respect to out. The gradients are those of
L = sum(dout * out) with respect to q [B, H, Tq, Dk], k [B, Hkv, Tk, Dk], v [B, Hkv, Tk, Dv] (summed
over the query heads of each group), the bias (dbias has the mask's shape, summed over the dims
along which it was broadcast) and the sinks (dsinks [H], summed over B and Tq). Fully masked rows
give zero gradients.

Arguments as in attention(), which must be given the same scale, causal, window, mask, softcap,
alibi, sinks, cu_seqlens_q, cu_seqlens_k, dropout and seed (from which it replays the dropout
mask), plus:
    out, lse: what attention(..., return_lse=True) returned, so that the fused kernel recomputes
        the probabilities tile by tile instead of running the forward again. Both or neither.
    impl: "auto" (fused for float32, the float64 reference for float64), "fused" or "reference".

With float16, bfloat16 or int8 operands (k_scales, v_scales and bf16 as in attention()), the
gradients are float32, those of the values the operands stand for.

Deterministic: bit-identical results for any number of threads.)";

constexpr const char* kAdditiveDoc =
    R"(Additive (Bahdanau) attention: e_ij = w . tanh(w_q @ q_i + w_k @ k_j) + bias_ij, out = softmax(e) @ v.

Shapes (A is the hidden size of the score network):
    q    [B, H, Tq, Dq]     w_q  [A, Dq]     out      [B, H, Tq, Dv]
    k    [B, H, Tk, Dk]     w_k  [A, Dk]     lse      [B, H, Tq]
    v    [B, H, Tk, Dv]     w    [A]         weights  [B, H, Tq, Tk]
Leading dims as in attention(), but k and v have as many heads as q; queries and keys may have
different widths. No scale: tanh bounds the scores. causal, window, mask, return_lse,
return_weights and allow_nonfinite as in attention(). Packed sequences (cu_seqlens_q,
cu_seqlens_k) are refused: call it per sequence.
Runs the reference implementation (float64 accumulation); float32 or float64 in and out.)";

constexpr const char* kAdditiveBackwardDoc =
    R"(Gradients of additive_attention(q, k, v, w_q, w_k, w, ...): (dq, dk, dv, dw_q, dw_k, dw), and dbias when mask is a float bias.

dout [B, H, Tq, Dv] is the gradient of the loss with respect to out. dw_q, dw_k and dw are summed
over every batch and head. Arguments as in additive_attention().)";

}  // namespace

void add_attention(py::module_& m) {
  m.def("attention", &attention, kAttentionDoc, "q"_a, "k"_a, "v"_a, py::kw_only(), "scale"_a = py::none(),
        "causal"_a = false, "mask"_a = py::none(), "impl"_a = "auto", "return_lse"_a = false,
        "return_weights"_a = false, "allow_nonfinite"_a = false, "window"_a = py::none(), "softcap"_a = py::none(),
        "alibi"_a = py::none(), "sinks"_a = py::none(), "cu_seqlens_q"_a = py::none(), "cu_seqlens_k"_a = py::none(),
        "dropout"_a = 0.0, "seed"_a = 0, "k_scales"_a = py::none(), "v_scales"_a = py::none(), "bf16"_a = false);
  m.def("attention_backward", &attention_backward, kAttentionBackwardDoc, "q"_a, "k"_a, "v"_a, "dout"_a, py::kw_only(),
        "out"_a = py::none(), "lse"_a = py::none(), "scale"_a = py::none(), "causal"_a = false, "mask"_a = py::none(),
        "impl"_a = "auto", "allow_nonfinite"_a = false, "window"_a = py::none(), "softcap"_a = py::none(),
        "alibi"_a = py::none(), "sinks"_a = py::none(), "cu_seqlens_q"_a = py::none(), "cu_seqlens_k"_a = py::none(),
        "dropout"_a = 0.0, "seed"_a = 0, "k_scales"_a = py::none(), "v_scales"_a = py::none(), "bf16"_a = false);
  m.def("additive_attention", &additive_attention, kAdditiveDoc, "q"_a, "k"_a, "v"_a, "w_q"_a, "w_k"_a, "w"_a,
        py::kw_only(), "causal"_a = false, "mask"_a = py::none(), "return_lse"_a = false, "return_weights"_a = false,
        "allow_nonfinite"_a = false, "window"_a = py::none(), "cu_seqlens_q"_a = py::none(),
        "cu_seqlens_k"_a = py::none());
  m.def("additive_attention_backward", &additive_attention_backward, kAdditiveBackwardDoc, "q"_a, "k"_a, "v"_a, "w_q"_a,
        "w_k"_a, "w"_a, "dout"_a, py::kw_only(), "causal"_a = false, "mask"_a = py::none(), "allow_nonfinite"_a = false,
        "window"_a = py::none(), "cu_seqlens_q"_a = py::none(), "cu_seqlens_k"_a = py::none());
  m.def(
      "alibi_slopes", [](int64_t heads) { return alibi_slopes(heads); }, "heads"_a,
      "ALiBi's slopes for `heads` heads (Press et al.), what alibi=\"auto\" uses: 2^(-8(h+1)/heads) when heads is "
      "a power of two; otherwise those of the power of two below, then every other slope of the one above.");
  m.def("_time_fused_forward", &time_fused_forward, "q"_a, "k"_a, "v"_a, "calls"_a);
}

}  // namespace qkv::python
