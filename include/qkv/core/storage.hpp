#pragma once
// Storage types narrower than float32, for the operands that are read far more often than they are
// written (the keys and values of a KV cache): float16 (IEEE binary16), bfloat16 (float32's top
// half) and int8 with float32 scales. Values are stored as their bits (uint16_t) or as int8_t;
// arithmetic is always done in float32. A StoredView is an operand in any of them.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "qkv/core/tensor.hpp"

namespace qkv {

enum class StorageType { float32, float16, bfloat16, int8 };

// "float32", "float16", "bfloat16", "int8"
std::string_view storage_name(StorageType type);
// The type of a name storage_name gives, or of its short form ("f32", "f16", "bf16", "i8");
// ValueError naming `argument` and the accepted names otherwise.
StorageType parse_storage(std::string_view name, std::string_view argument);
// Bytes of one element.
constexpr int64_t storage_bytes(StorageType type) {
  switch (type) {
    case StorageType::float32:
      return 4;
    case StorageType::float16:
    case StorageType::bfloat16:
      return 2;
    case StorageType::int8:
      return 1;
  }
  return 0;
}

// Conversions, rounding to nearest even; NaN stays NaN and values past the largest finite one
// become infinities, as the hardware conversions (F16C, AVX512_BF16) do.
uint16_t float16_from_float(float value);
float float_from_float16(uint16_t bits);
uint16_t bfloat16_from_float(float value);
float float_from_bfloat16(uint16_t bits);
// The magnitude from which rounding a float32 to `type` gives an infinity: half an ulp past its
// largest finite value (float16 65504, bfloat16 0x7F7F); infinity for float32 and int8, whose
// values a finite float32 always gives.
float rounding_overflow_limit(StorageType type);

// An array of any storage type. Strides count elements of that type. For int8, element x stands
// for scale·x, the scales broadcast to the array's shape: one per channel ([..., 1, D]: along
// tokens) or per token ([..., T, 1]), or any broadcastable shape.
struct StoredView {
  StorageType type = StorageType::float32;
  const void* data = nullptr;
  Shape shape;
  Strides strides{};
  std::optional<TensorView<const float>> scales = std::nullopt;  // int8 only

  static StoredView float32(TensorView<const float> view);
  static StoredView float16(TensorView<const uint16_t> bits);
  static StoredView bfloat16(TensorView<const uint16_t> bits);
  static StoredView int8(TensorView<const int8_t> values, TensorView<const float> scales);

  int rank() const { return shape.rank(); }
};

// Element `at` (counted in elements) of data stored as `type`, as float32: exact for float16 and
// bfloat16, scale·x rounded once for int8 (`scale` is unused for the others). Inline: loops over
// every element of an operand call it.
inline float stored_value(StorageType type, const void* data, int64_t at, float scale) {
  switch (type) {
    case StorageType::float32:
      return static_cast<const float*>(data)[at];
    case StorageType::float16:
      return float_from_float16(static_cast<const uint16_t*>(data)[at]);
    case StorageType::bfloat16:
      return float_from_bfloat16(static_cast<const uint16_t*>(data)[at]);
    case StorageType::int8:
      return static_cast<float>(static_cast<const int8_t*>(data)[at]) * scale;
  }
  return 0.0f;
}

// Refuses a NaN or an infinity among the values `view` stands for, as check_finite does (naming the
// first; `remedy` appended). int8 values are always finite; their scales are the op's to check.
void check_finite(const StoredView& view, std::string_view name, std::string_view remedy = {});

// The values a StoredView stands for, in float32 (exact for float16 and bfloat16; scale·x rounded
// once for int8, as the kernels compute it), contiguous.
Tensor<float> to_float32(const StoredView& view);

}  // namespace qkv
