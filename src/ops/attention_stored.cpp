// Attention on operands stored narrower than float32: the checks of each operand's type and scales,
// then one problem built by make_attention_problem on views that carry the operands' shapes, so
// that these calls take exactly the shapes, masks and options of the float32 ones, with the same
// messages. The fused forward and backward read the stored operands in place (attention_fused-inl.h
// converts them tile by tile); the reference runs on their float32 values.

#include <fmt/format.h>

#include <optional>
#include <string>
#include <string_view>

#include "attention_problem.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv {

namespace detail {

std::optional<TensorView<const float>> checked_stored_scales(const StoredView& view, std::string_view name,
                                                             bool int8_allowed) {
  if (view.data == nullptr && view.shape.numel() > 0) {
    throw ValueError(fmt::format("{}: no data for shape {}", name, view.shape.str()));
  }
  if (view.type == StorageType::int8 && !int8_allowed) {
    throw ValueError(
        fmt::format("{}: int8 storage is for k and v (with scales); store {} as float32, float16 or "
                    "bfloat16, got int8",
                    name, name));
  }
  if (view.type != StorageType::int8) {
    if (view.scales) {
      throw ValueError(
          fmt::format("{}.scales: given, but {} is {}; only int8 has scales", name, name, storage_name(view.type)));
    }
    return std::nullopt;
  }
  if (!view.scales) {
    throw ValueError(
        fmt::format("{}.scales: an int8 {} needs its scales (value = scale · stored), got none", name, name));
  }
  const std::string scales_name = fmt::format("{}.scales", name);
  if (view.scales->data == nullptr && view.scales->numel() > 0) {
    throw ValueError(fmt::format("{}: no data for shape {}", scales_name, view.scales->shape.str()));
  }
  const TensorView<const float> scales = broadcast_to(*view.scales, view.shape, scales_name);
  check_finite(*view.scales, scales_name);
  return scales;
}

}  // namespace detail

namespace {

// A float32 view with the operand's shape and strides: its data for a float32 operand, which the
// kernels then read through the problem, and none for the others, whose shape is all the checks read.
TensorView<const float> shape_view(const StoredView& view) {
  const auto* data = view.type == StorageType::float32 ? static_cast<const float*>(view.data) : nullptr;
  return {data, view.shape, view.strides};
}

detail::StoredOperand stored_operand(const StoredView& view, const std::optional<TensorView<const float>>& scales,
                                     std::string_view name) {
  detail::StoredOperand operand{
      .type = view.type, .data = view.data, .strides = as_bhtd(shape_view(view), name).strides, .scales = {}};
  if (scales) operand.scales = as_bhtd(*scales, name);
  return operand;
}

// The float32 params of the call on q, k and v: the shape views, or the operands' float32 values.
AttentionParams<float> float_params(const StoredAttentionParams& params, TensorView<const float> q,
                                    TensorView<const float> k, TensorView<const float> v) {
  return {.q = q,
          .k = k,
          .v = v,
          .scale = params.scale,
          .mask = params.mask,
          .softcap = params.softcap,
          .sinks = params.sinks,
          .dropout = std::nullopt};
}

struct CheckedCall {
  detail::AttentionProblem<float> problem;
  detail::StoredOperands stored;
};

CheckedCall check_call(const StoredAttentionParams& params) {
  const auto q_scales = detail::checked_stored_scales(params.q, "q", false);
  const auto k_scales = detail::checked_stored_scales(params.k, "k", true);
  const auto v_scales = detail::checked_stored_scales(params.v, "v", true);
  if (params.mask.cu_seqlens_q || params.mask.cu_seqlens_k) {
    throw ValueError(
        "cu_seqlens_q: packed sequences are not taken with stored (float16, bfloat16, int8) operands; make one call "
        "per sequence");
  }
  CheckedCall call{.problem = detail::make_attention_problem(
                       float_params(params, shape_view(params.q), shape_view(params.k), shape_view(params.v))),
                   .stored = {}};
  call.stored = {.q = stored_operand(params.q, q_scales, "q"),
                 .k = stored_operand(params.k, k_scales, "k"),
                 .v = stored_operand(params.v, v_scales, "v")};
  return call;
}

// The operands' values in float32, and the params that read them.
struct FloatCall {
  Tensor<float> q, k, v;
  AttentionParams<float> params;
};

FloatCall float_call(const StoredAttentionParams& params) {
  FloatCall call{.q = to_float32(params.q), .k = to_float32(params.k), .v = to_float32(params.v), .params = {}};
  call.params = float_params(params, call.q.cview(), call.k.cview(), call.v.cview());
  return call;
}

}  // namespace

void attention_forward(const StoredAttentionParams& params, const AttentionOutputs<float>& outputs,
                       AttentionImpl impl) {
  const CheckedCall call = check_call(params);
  if (impl == AttentionImpl::reference || (impl == AttentionImpl::automatic && outputs.weights)) {
    const FloatCall values = float_call(params);
    attention_forward(values.params, outputs, AttentionImpl::reference);
    return;
  }
  detail::forward_fused_stored(call.problem, call.stored, outputs);
}

void attention_backward(const StoredAttentionParams& params, TensorView<const float> dout,
                        const AttentionGradients<float>& grads, const std::optional<AttentionSaved<float>>& saved,
                        AttentionImpl impl) {
  const CheckedCall call = check_call(params);
  if (impl == AttentionImpl::reference) {
    const FloatCall values = float_call(params);
    attention_backward(values.params, dout, grads, saved, impl);
    return;
  }
  detail::backward_fused_stored(call.problem, call.stored, dout, grads, saved);
}

}  // namespace qkv
