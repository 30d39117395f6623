#include "stored_input.hpp"

#include <fmt/format.h>

#include <utility>
#include <vector>

#include "cli_io.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/npy.hpp"

namespace qkv::cli {
namespace {

template <class T>
Tensor<T> tensor_of(NpyArray array) {
  return Tensor<T>(Shape(std::span<const int64_t>(array.shape)), std::move(std::get<std::vector<T>>(array.values)));
}

// Scales broadcast to the values: the same rank, each dim 1 or the values' own; and finite.
Tensor<float> load_scales(const std::string& path, const Shape& values, const StoredOption& option) {
  Tensor<float> scales = load_float32(path, option.scales_arg);
  bool broadcasts = scales.shape().rank() == values.rank();
  for (int i = 0; i < values.rank() && broadcasts; ++i) {
    broadcasts = scales.shape()[i] == 1 || scales.shape()[i] == values[i];
  }
  if (!broadcasts) {
    throw ShapeError(fmt::format(
        "{}: expected a shape that broadcasts to {}'s {} (each dim 1 or {}'s, e.g. [..., 1, D] or [..., T, 1]), got {}",
        option.scales_arg, option.arg, values.str(), option.arg, scales.shape().str()));
  }
  check_finite(scales.cview(), option.scales_arg);
  return scales;
}

}  // namespace

const Shape& StoredArray::shape() const {
  return std::visit([](const auto& t) -> const Shape& { return t.shape(); }, values);
}

StoredView StoredArray::view() const {
  switch (type) {
    case StorageType::float32:
      return StoredView::float32(std::get<Tensor<float>>(values).cview());
    case StorageType::float16:
      return StoredView::float16(std::get<Tensor<uint16_t>>(values).cview());
    case StorageType::bfloat16:
      return StoredView::bfloat16(std::get<Tensor<uint16_t>>(values).cview());
    case StorageType::int8:
      return StoredView::int8(std::get<Tensor<int8_t>>(values).cview(), scales->cview());
  }
  throw ValueError("unreachable storage type");
}

std::string stored_dtypes(const StoredOption& option) {
  if (!option.int8_allowed) return "float32, float64, float16 or uint16 (bfloat16 bits, with --dtype bf16)";
  return fmt::format("float32, float64, float16, uint16 (bfloat16 bits, with --dtype bf16) or int8 (with {})",
                     option.scales_arg);
}

StoredArray read_stored(const std::string& path, const std::string& scales, bool bfloat16, const StoredOption& option) {
  return stored_of(read_input(path, option.arg, stored_dtypes(option)), scales, bfloat16, option);
}

StoredArray stored_of(NpyArray array, const std::string& scales, bool bfloat16, const StoredOption& option) {
  const std::string accepted = stored_dtypes(option);
  StoredArray a;
  if (array.dtype == DType::int8) {
    if (!option.int8_allowed) {
      throw ValueError(
          fmt::format("{}: expected dtype {}, got int8 (only K and V are stored as int8)", option.arg, accepted));
    }
    if (scales.empty()) {
      throw ValueError(fmt::format("{}: expected the scales of int8 {} (value = scale · stored), got none",
                                   option.scales_arg, option.arg));
    }
    a.type = StorageType::int8;
    Tensor<int8_t> values = tensor_of<int8_t>(std::move(array));
    a.scales = load_scales(scales, values.shape(), option);
    a.values = std::move(values);
    return a;
  }
  if (!scales.empty()) {
    throw ValueError(fmt::format("{}: expected none for {} of dtype {} (only int8 has scales), got {}",
                                 option.scales_arg, option.arg, dtype_name(array.dtype), scales));
  }
  if (array.dtype == DType::float16) {
    a.type = StorageType::float16;
    a.values = tensor_of<uint16_t>(std::move(array));
  } else if (array.dtype == DType::uint16) {
    if (!bfloat16) {
      throw ValueError(fmt::format(
          "{}: expected --dtype bf16 for a uint16 ('<u2') file (the bits of bfloat16; numpy has no bfloat16 dtype), "
          "got none",
          option.arg));
    }
    a.type = StorageType::bfloat16;
    a.values = tensor_of<uint16_t>(std::move(array));
  } else if (array.dtype == DType::float32 || array.dtype == DType::float64) {
    a.values = to_float32(std::move(array), option.arg);
  } else {
    throw ShapeError(fmt::format("{}: expected dtype {}, got {} (shape {})", option.arg, accepted,
                                 dtype_name(array.dtype), array.shape_str()));
  }
  return a;
}

}  // namespace qkv::cli
