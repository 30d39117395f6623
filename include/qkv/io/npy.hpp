#pragma once
// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0), and reading the arrays of
// .npz archives (np.savez).
//
// Read: dtypes float32 'f4', float64 'f8', float16 'f2', int32 'i4', int64 'i8' and uint16 'u2' in
// either byte order, bool '|b1', uint8 '|u1' and int8 '|i1'; C or Fortran order (np.save of a transposed array),
// returned in C order, little-endian. A file is read whole and checked before anything is returned: a malformed header,
// a truncated body, an unsupported dtype or trailing bytes raise IoError with a message naming the file and what is
// wrong. Written: C order, little-endian, to a temporary file in the same directory, renamed over the target only once
// complete, so a failure never leaves a partial file.

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "qkv/core/tensor.hpp"

namespace qkv {

// float16 and uint16 are both 16-bit patterns: float16 is numpy's half ('<f2'); uint16 ('<u2') is
// how qkv stores bfloat16, which numpy has no dtype for, so only the caller knows whether a '<u2'
// file holds bfloat16 bits (the CLI's --dtype bf16) or integers.
enum class DType { float32, float64, boolean, int64, uint8, int32, float16, uint16, int8 };

// "float32", "float64", "bool", "int64", "uint8", "int32", "float16", "uint16", "int8"
std::string dtype_name(DType dtype);

// An array as read from disk; shapes of any rank (qkv ops take rank <= 4, checked by the caller).
struct NpyArray {
  DType dtype = DType::float32;
  std::vector<int64_t> shape;
  // Exactly one alternative, matching dtype; booleans are stored as 0/1 bytes, uint8 as they are,
  // float16 and uint16 as their bits (uint16_t).
  std::variant<std::vector<float>, std::vector<double>, std::vector<uint8_t>, std::vector<int64_t>,
               std::vector<int32_t>, std::vector<uint16_t>, std::vector<int8_t>>
      values;

  int64_t numel() const;
  // "[2, 3, 4]"
  std::string shape_str() const;
};

// `path` is a .npy file, or an array of an .npz archive of stored members (np.savez; np.savez_compressed's
// deflated members are refused, naming np.savez): "arrays.npz:q" reads member q.npy, "arrays.npz"
// alone its only array (an archive of several names them in the error).
NpyArray read_npy(const std::filesystem::path& path);

// Every array of an .npz archive (np.savez), with its name (the member's without ".npy"), in the
// archive's order. IoError as read_npy's, and for an archive without arrays.
std::vector<std::pair<std::string, NpyArray>> read_npz_arrays(const std::filesystem::path& path);

// The same from bytes in memory: a whole .npy file, or an .npz archive and the name of one of its
// arrays (empty: its only one). `name` and `archive_path` are what the errors call the source.
NpyArray decode_npy(std::string_view bytes, const std::filesystem::path& name);
NpyArray decode_npz(std::string_view archive, const std::filesystem::path& archive_path, const std::string& name);

// The .npy file of a view (strided or not) as a C-order array of its element type; uint8_t is
// written as bool (every nonzero byte as 1), int8_t as '|i1'.
template <class T>
std::string encode_npy(TensorView<const T> view);
// The same elements, in the same order, stored with the shape `file_shape` (of the same number of
// elements): an array whose leading dims a caller flattened into qkv's rank-4 batch, written with
// them again.
template <class T>
std::string encode_npy(TensorView<const T> view, std::span<const int64_t> file_shape);

// encode_npy written to `path` all or nothing (write_file_atomically).
template <class T>
void write_npy(const std::filesystem::path& path, TensorView<const T> view);

// 16-bit patterns written as `dtype`: DType::float16 ('<f2') or DType::uint16 ('<u2', bfloat16's
// bits); ValueError for any other dtype.
std::string encode_npy_bits(TensorView<const uint16_t> bits, DType dtype);
void write_npy_bits(const std::filesystem::path& path, TensorView<const uint16_t> bits, DType dtype);

}  // namespace qkv
