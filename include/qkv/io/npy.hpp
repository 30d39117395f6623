#pragma once
// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0; C order; little-endian;
// dtypes float32 '<f4', float64 '<f8', bool '|b1', int64 '<i8').
//
// A file is read whole and checked before anything is returned: a malformed header, a truncated
// body, a big-endian or Fortran-order array, an unsupported dtype or trailing bytes raise IoError
// with a message naming the file and what is wrong. Writes go to a temporary file in the same
// directory, renamed over the target only once complete, so a failure never leaves a partial file.

#include <cstdint>
#include <filesystem>
#include <string>
#include <variant>
#include <vector>

#include "qkv/core/tensor.hpp"

namespace qkv {

enum class DType { float32, float64, boolean, int64 };

// "float32", "float64", "bool", "int64"
std::string dtype_name(DType dtype);

// An array as read from disk; shapes of any rank (qkv ops take rank <= 4, checked by the caller).
struct NpyArray {
  DType dtype = DType::float32;
  std::vector<int64_t> shape;
  // Exactly one alternative, matching dtype; booleans are stored as 0/1 bytes.
  std::variant<std::vector<float>, std::vector<double>, std::vector<uint8_t>, std::vector<int64_t>> values;

  int64_t numel() const;
  // "[2, 3, 4]"
  std::string shape_str() const;
};

NpyArray read_npy(const std::filesystem::path& path);

// The .npy file of a view (strided or not) as a C-order array of its element type; uint8_t is
// written as bool (every nonzero byte as 1).
template <class T>
std::string encode_npy(TensorView<const T> view);

// encode_npy written to `path` all or nothing (write_file_atomically).
template <class T>
void write_npy(const std::filesystem::path& path, TensorView<const T> view);

}  // namespace qkv
