#pragma once
// Operands stored narrower than float32, read from .npy files for the commands that take them
// (qkv decode, qkv attend, qkv dequantize). float16 is numpy's '<f2'; bfloat16, which numpy has no dtype for,
// is its bits as '<u2', read as bfloat16 only when the caller says so (a '<u2' file alone is
// ambiguous); int8 is '|i1' with its float32 scales in a second file, broadcasting to its shape.

#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/io/npy.hpp"

namespace qkv::cli {

// An operand as read: its elements in their storage type, and an int8 operand's scales.
struct StoredArray {
  StorageType type = StorageType::float32;
  std::variant<Tensor<float>, Tensor<uint16_t>, Tensor<int8_t>> values;
  std::optional<Tensor<float>> scales;

  const Shape& shape() const;
  StoredView view() const;
};

// What an operand may be stored as and how its options are named in messages.
struct StoredOption {
  std::string_view arg;         // the option giving the array, e.g. "--k"
  std::string_view scales_arg;  // the option giving an int8 array's scales, e.g. "--k-scales"
  bool int8_allowed = true;
};

// Reads `path` as float32 (float64 rounded), float16, bfloat16 bits (a '<u2' file, only when
// `bfloat16` is set) or int8 (only with `scales`, a float32 file that broadcasts to the array and
// is finite). Refuses, naming the option, every other dtype, a '<u2' file without `bfloat16`,
// scales for any type but int8, and int8 where the operand cannot take it.
StoredArray read_stored(const std::string& path, const std::string& scales, bool bfloat16, const StoredOption& option);
// The same for an array already read.
StoredArray stored_of(NpyArray array, const std::string& scales, bool bfloat16, const StoredOption& option);
// The dtypes `option`'s operand may have, as messages list them.
std::string stored_dtypes(const StoredOption& option);

}  // namespace qkv::cli
