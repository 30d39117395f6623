#pragma once
// A trained model as one file: what kind of model it is, its configuration as text entries and its
// parameters as named tensors, under a version header and a checksum.
//
// Layout (every integer little-endian):
//   offset 0        8 bytes   magic "QKVMODEL"
//   offset 8        u32       format version (1 or 2)
//   offset 12       u64       payload length P
//   offset 20       P bytes   payload
//   offset 20 + P   u32       CRC-32 (IEEE 802.3, zlib's crc32) of bytes [0, 20 + P)
// and nothing after it. The payload:
//   string kind                                       e.g. "seq2seq"
//   u32 N, then N × (string key, string value)        the configuration (sizes, vocabularies)
//   u32 M, then M × tensor
// where a string is a u32 byte count then UTF-8 bytes, and a tensor is: string name, u8 dtype, u8
// rank (0 to 4), rank × u64 dims, then the numel values in C order. dtype 1 is float32, the only
// one of version 1; version 2 adds 2 = float16 and 3 = bfloat16 (each value its 16 bits) and 4 =
// int8 (one byte each), for arrays kept narrow on disk as in memory (a KV cache's pools). A file
// whose tensors are all float32 is written as version 1, so that builds which read version 1 alone
// still read it.
//
// Reading checks everything before returning: the magic, the version, the length against the file
// size, the checksum, every length inside the payload against what is left, duplicate keys and
// names, a dtype the version has, and that each value is finite. A file that fails any check is
// refused with an IoError naming the file and what is wrong ("model.qkvm: checksum mismatch (stored
// 0x1a2b3c4d, computed 0x...): the file is corrupt"); so is a file whose kind, entries or tensors
// do not fit the model that loads it.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {

inline constexpr std::string_view kModelFileMagic = "QKVMODEL";
// The newest version this build writes and reads; it reads every older one too.
inline constexpr uint32_t kModelFileVersion = 2;

// A tensor kept in a type narrower than float32: its values as that type lays them out in memory
// (StoredView's layout, C order).
struct NarrowTensor {
  StorageType type = StorageType::float16;  // float16, bfloat16 or int8
  Shape shape;
  std::vector<uint8_t> bytes;  // shape.numel() · storage_bytes(type)
};

struct ModelFile {
  std::string kind;                                            // what model this is, e.g. "seq2seq"
  std::vector<std::pair<std::string, std::string>> metadata;   // the configuration, in insertion order
  std::vector<std::pair<std::string, Tensor<float>>> tensors;  // the parameters, in insertion order
  // Tensors in a narrower type, written after `tensors`; a name names one tensor of either list.
  std::vector<std::pair<std::string, NarrowTensor>> narrow_tensors;
  // Where it came from ("model.qkvm", or "<memory>"): the name every error of the lookups gives.
  std::string source = "<memory>";

  // Adds an entry, or replaces the value of an existing key.
  void set(std::string key, std::string value);

  // The value of `key`; IoError "SOURCE: no entry "key"" when absent.
  const std::string& value(std::string_view key) const;
  // The value of `key` read as an integer in [min, max]; IoError naming the key, the range and the
  // text otherwise.
  int64_t int_value(std::string_view key, int64_t min, int64_t max) const;
  // The tensor `name`; IoError when absent.
  const Tensor<float>& tensor(std::string_view name) const;
  // The narrow tensor `name`, or null when there is none of that name.
  const NarrowTensor* narrow_tensor(std::string_view name) const;

  // IoError "SOURCE: expected a KIND model, got a OTHER model" when kind differs.
  void check_kind(std::string_view expected) const;
};

// The bytes of the file. Throws ValueError for a duplicate key or name, a non-finite value (which
// reading would refuse), and a narrow tensor whose type is float32 or whose bytes do not fit its
// shape.
std::string encode_model_file(const ModelFile& model);

// Parses and checks `bytes` (see the layout above); `source` names the file in errors and becomes
// the result's source.
ModelFile decode_model_file(std::string_view bytes, std::string source);

// Writes through a temporary file and a rename: the target keeps its old contents or has the new
// ones in full. Throws IoError naming the path.
void write_model_file(const std::filesystem::path& path, const ModelFile& model);

// Reads and decodes the file; IoError naming the path when it cannot be read or is refused.
ModelFile read_model_file(const std::filesystem::path& path);

// CRC-32 of the IEEE 802.3 polynomial, reflected, as zlib's crc32 (crc32("123456789") = 0xcbf43926).
uint32_t crc32(std::string_view bytes);

// Appends every parameter's value, converted to float32, as a tensor under its name.
template <class T>
void store_parameters(ModelFile& model, const std::vector<ParameterRef<T>>& params);

// Copies each parameter's tensor into its value. Refuses (IoError naming the source and the tensor)
// a parameter without a tensor, a tensor of another shape than the parameter's, and a tensor that
// is no parameter's: the file must hold exactly this model's parameters.
template <class T>
void load_parameters(const ModelFile& model, const std::vector<ParameterRef<T>>& params);

}  // namespace qkv
