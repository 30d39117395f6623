#include "qkv/ops/quantize.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "qkv/core/error.hpp"

namespace qkv {
namespace {

Shape scales_shape(const Shape& shape, QuantizeGroup group) {
  Shape scales = shape;
  for (int axis = 0; axis < shape.rank(); ++axis) {
    const bool token_axis = axis == shape.rank() - 2, channel_axis = axis == shape.rank() - 1;
    const bool kept = (group == QuantizeGroup::per_channel && channel_axis) ||
                      (group == QuantizeGroup::per_token && token_axis) ||
                      (group != QuantizeGroup::per_tensor && axis < shape.rank() - 2);
    if (!kept) scales[axis] = 1;
  }
  return scales;
}

// Refuses a value that is not finite or that rounds past the type's largest one: stored as an
// infinity, it would give an array that attention refuses.
template <class F>
Tensor<uint16_t> convert(TensorView<const float> x, StorageType type, F round, std::string_view name) {
  check_finite(x, name);
  const Tensor<float> values = to_tensor<float, float>(x);
  const float limit = rounding_overflow_limit(type);
  Tensor<uint16_t> bits(x.shape);
  for (int64_t i = 0; i < values.numel(); ++i) {
    if (!(std::abs(values[i]) < limit)) {
      throw ValueError(fmt::format("{}: expected values that {} holds (|x| < {}), got {} at {}", name,
                                   storage_name(type), limit, values[i], index_str(x.shape, i)));
    }
    bits[i] = round(values[i]);
  }
  return bits;
}

}  // namespace

Int8Array quantize_int8(TensorView<const float> x, QuantizeGroup group) {
  if (x.rank() < 2)
    throw ShapeError(fmt::format("x: expected rank 2 or more ([..., T, D]), got shape {}", x.shape.str()));
  check_finite(x, "x");
  const Tensor<float> values = to_tensor<float, float>(x);
  Int8Array out{.values = Tensor<int8_t>(x.shape), .scales = Tensor<float>(scales_shape(x.shape, group))};
  // Each element's group, as the flat index of its scale: the scale's view broadcast to x's shape.
  Tensor<float> amax(out.scales.shape());
  const TensorView<float> amax_of = broadcast_to(amax.view(), x.shape, "scales");
  const auto each = [&](auto&& body) {
    const Shape& s = x.shape;
    for (int64_t flat = 0; flat < values.numel(); ++flat) {
      int64_t rest = flat, scale_at = 0;
      for (int axis = s.rank() - 1; axis >= 0; --axis) {
        scale_at += rest % s[axis] * amax_of.strides[static_cast<size_t>(axis)];
        rest /= s[axis];
      }
      body(flat, scale_at);
    }
  };
  each([&](int64_t flat, int64_t scale_at) { amax[scale_at] = std::max(amax[scale_at], std::abs(values[flat])); });
  for (int64_t g = 0; g < amax.numel(); ++g) out.scales[g] = amax[g] > 0.0f ? amax[g] / 127.0f : 1.0f;
  each([&](int64_t flat, int64_t scale_at) {
    const float q = std::nearbyint(values[flat] / out.scales[scale_at]);
    out.values[flat] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
  });
  return out;
}

Tensor<uint16_t> to_float16(TensorView<const float> x, std::string_view name) {
  return convert(x, StorageType::float16, float16_from_float, name);
}
Tensor<uint16_t> to_bfloat16(TensorView<const float> x, std::string_view name) {
  return convert(x, StorageType::bfloat16, bfloat16_from_float, name);
}

}  // namespace qkv
