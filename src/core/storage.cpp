#include "qkv/core/storage.hpp"

#include <fmt/format.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"

namespace qkv {

std::string_view storage_name(StorageType type) {
  switch (type) {
    case StorageType::float32:
      return "float32";
    case StorageType::float16:
      return "float16";
    case StorageType::bfloat16:
      return "bfloat16";
    case StorageType::int8:
      return "int8";
  }
  return "?";
}

StorageType parse_storage(std::string_view name, std::string_view argument) {
  for (const StorageType type :
       {StorageType::float32, StorageType::float16, StorageType::bfloat16, StorageType::int8}) {
    if (name == storage_name(type)) return type;
  }
  if (name == "f32") return StorageType::float32;
  if (name == "f16") return StorageType::float16;
  if (name == "bf16") return StorageType::bfloat16;
  if (name == "i8") return StorageType::int8;
  throw ValueError(
      fmt::format("{}: expected float32, float16, bfloat16 or int8 (or f32, f16, bf16, i8), got '{}'", argument, name));
}

uint16_t float16_from_float(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x1ffu));
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (magnitude < 0x38800000u) {
    // Below float16's smallest normal 2⁻¹⁴: a multiple of 2⁻²⁴, which adding 0.5 (whose ulp is
    // 2⁻²⁴) rounds to nearest even in float32's own rounding.
    const float shifted = std::bit_cast<float>(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(shifted) - 0x3f000000u));
  }
  // Normal: drop 13 mantissa bits, rounding half to even; a carry into the exponent is correct.
  const uint32_t odd = (magnitude >> 13) & 1u;
  const uint32_t rounded = magnitude + 0xfffu + odd;
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

float float_from_float16(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float subnormal = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -subnormal : subnormal;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t bfloat16_from_float(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  const uint32_t odd = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + odd) >> 16);
}

float float_from_bfloat16(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

float rounding_overflow_limit(StorageType type) {
  switch (type) {
    case StorageType::float16:
      return 65520.0f;
    case StorageType::bfloat16:
      return std::bit_cast<float>(uint32_t{0x7F7F8000});
    case StorageType::float32:
    case StorageType::int8:
      break;
  }
  return std::numeric_limits<float>::infinity();
}

StoredView StoredView::float32(TensorView<const float> view) {
  return {.type = StorageType::float32, .data = view.data, .shape = view.shape, .strides = view.strides};
}

StoredView StoredView::float16(TensorView<const uint16_t> bits) {
  return {.type = StorageType::float16, .data = bits.data, .shape = bits.shape, .strides = bits.strides};
}

StoredView StoredView::bfloat16(TensorView<const uint16_t> bits) {
  return {.type = StorageType::bfloat16, .data = bits.data, .shape = bits.shape, .strides = bits.strides};
}

StoredView StoredView::int8(TensorView<const int8_t> values, TensorView<const float> scales) {
  return {.type = StorageType::int8,
          .data = values.data,
          .shape = values.shape,
          .strides = values.strides,
          .scales = scales};
}

namespace {

// Element `flat` (C order) of a strided view of `shape`, as an offset in elements.
int64_t strided_offset(const Shape& shape, const Strides& strides, int64_t flat) {
  int64_t offset = 0;
  for (int axis = shape.rank() - 1; axis >= 0; --axis) {
    offset += flat % shape[axis] * strides[static_cast<size_t>(axis)];
    flat /= shape[axis];
  }
  return offset;
}

// Whether a row of float16 or bfloat16 bits holds an infinity or a NaN. The check runs on every
// input of a call, so it must cost little beside the op: an exponent of all ones carries into the
// sign bit when its lowest bit is added to it, and an OR of those carries is a branch-free
// reduction that the compiler vectorises.
bool row_has_nonfinite(const uint16_t* row, int64_t n, int64_t stride, uint32_t exponent, uint32_t exponent_one) {
  uint32_t carries = 0;
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) carries |= ((row[i] & exponent) + exponent_one) & 0x8000u;
  } else {
    for (int64_t i = 0; i < n; ++i) carries |= ((row[i * stride] & exponent) + exponent_one) & 0x8000u;
  }
  return carries != 0;
}

}  // namespace

void check_finite(const StoredView& view, std::string_view name, std::string_view remedy) {
  if (view.type == StorageType::int8) return;
  if (view.type == StorageType::float32) {
    check_finite(TensorView<const float>{static_cast<const float*>(view.data), view.shape, view.strides}, name,
                 NonFinite::refused, remedy);
    return;
  }
  // An all-ones exponent is an infinity or a NaN; only a refusal pays for the conversion that
  // names the first one.
  const bool float16 = view.type == StorageType::float16;
  const uint32_t exponent = float16 ? 0x7C00u : 0x7F80u, exponent_one = float16 ? 0x0400u : 0x0080u;
  const TensorView<const uint16_t> bits{static_cast<const uint16_t*>(view.data), view.shape, view.strides};
  const TensorView<const uint16_t> b4 = as_rank4(bits);
  bool bad = false;
  if (bits.is_contiguous()) {
    std::atomic<bool> found{false};
    parallel_for_blocks(bits.numel(), 1, [&](int64_t begin, int64_t end) {
      if (row_has_nonfinite(bits.data + begin, end - begin, 1, exponent, exponent_one)) {
        found.store(true, std::memory_order_relaxed);
      }
    });
    bad = found.load();
  } else {
    for (int64_t a = 0; a < b4.shape[0]; ++a)
      for (int64_t b = 0; b < b4.shape[1]; ++b)
        for (int64_t c = 0; c < b4.shape[2]; ++c)
          bad |= row_has_nonfinite(&b4(a, b, c, 0), b4.shape[3], b4.strides[3], exponent, exponent_one);
  }
  if (bad) check_finite(to_float32(view).cview(), name, NonFinite::refused, remedy);
}

Tensor<float> to_float32(const StoredView& view) {
  Tensor<float> out(view.shape);
  if (view.type == StorageType::int8 && !view.scales) {
    throw ValueError("scales: an int8 array needs its scales (value = scale · stored), got none");
  }
  std::optional<TensorView<const float>> scales;
  if (view.scales) scales = broadcast_to(*view.scales, view.shape, "scales");
  for (int64_t flat = 0; flat < out.numel(); ++flat) {
    const float scale = scales ? scales->data[strided_offset(view.shape, scales->strides, flat)] : 1.0f;
    out[flat] = stored_value(view.type, view.data, strided_offset(view.shape, view.strides, flat), scale);
  }
  return out;
}

}  // namespace qkv
