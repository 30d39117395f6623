#include "qkv/io/model_file.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include "qkv/core/error.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/staged_files.hpp"

namespace qkv {
namespace {

// Values are copied as they lie in memory, which is the file's little-endian layout only on a
// little-endian host.
static_assert(std::endian::native == std::endian::little, "qkv's model files assume a little-endian host");

// The dtype code of a narrow type in the file, and the type of a code (float32 for none of them).
uint8_t dtype_code(StorageType type) {
  switch (type) {
    case StorageType::float32:
      return 1;
    case StorageType::float16:
      return 2;
    case StorageType::bfloat16:
      return 3;
    case StorageType::int8:
      return 4;
  }
  return 0;
}

std::optional<StorageType> type_of_code(uint8_t code) {
  for (const StorageType type :
       {StorageType::float32, StorageType::float16, StorageType::bfloat16, StorageType::int8}) {
    if (dtype_code(type) == code) return type;
  }
  return std::nullopt;
}

// Element i of a narrow tensor, when it is not finite: float16 and bfloat16 with every exponent bit
// set, found by their bits, so that a cache of a gigabyte is checked without converting each value.
std::optional<float> non_finite_at(const NarrowTensor& t, size_t i) {
  if (t.type == StorageType::int8) return std::nullopt;
  uint16_t bits = 0;
  std::memcpy(&bits, t.bytes.data() + 2 * i, 2);
  const bool float16 = t.type == StorageType::float16;
  const uint16_t exponent = float16 ? 0x7C00 : 0x7F80;
  if ((bits & exponent) != exponent) return std::nullopt;
  return float16 ? float_from_float16(bits) : float_from_bfloat16(bits);
}
constexpr size_t kHeaderBytes = 8 + 4 + 8;  // magic, version, payload length
constexpr size_t kChecksumBytes = 4;

template <class U>
void put(std::string& out, U value) {
  char bytes[sizeof(U)];
  std::memcpy(bytes, &value, sizeof(U));
  out.append(bytes, sizeof(U));
}

void put_string(std::string& out, std::string_view text) {
  if (text.size() > std::numeric_limits<uint32_t>::max()) {
    throw ValueError(fmt::format("model file: a string of {} bytes is longer than a u32 length can say", text.size()));
  }
  put(out, static_cast<uint32_t>(text.size()));
  out.append(text);
}

// Reads the payload front to back; every read checks that the bytes are there first, so a length
// field that lies cannot make it read past the end or allocate more than the file holds.
class Reader {
 public:
  Reader(std::string_view bytes, const std::string& source) : bytes_(bytes), source_(source) {}

  template <class U>
  U get(std::string_view what) {
    need(sizeof(U), what);
    U value;
    std::memcpy(&value, bytes_.data() + offset_, sizeof(U));
    offset_ += sizeof(U);
    return value;
  }

  std::string get_string(std::string_view what) {
    const auto length = get<uint32_t>(what);
    need(length, what);
    std::string text(bytes_.substr(offset_, length));
    offset_ += length;
    return text;
  }

  void need(uint64_t count, std::string_view what) const {
    if (count > bytes_.size() - offset_) {
      throw IoError(fmt::format("{}: truncated payload: {} needs {} bytes at payload offset {}, only {} left", source_,
                                what, count, offset_, bytes_.size() - offset_));
    }
  }

  size_t offset() const { return offset_; }
  size_t left() const { return bytes_.size() - offset_; }
  std::string_view rest(size_t count) const { return bytes_.substr(offset_, count); }
  void skip(size_t count) { offset_ += count; }

 private:
  std::string_view bytes_;
  const std::string& source_;
  size_t offset_ = 0;
};

struct TensorHeader {
  StorageType type = StorageType::float32;
  std::vector<int64_t> dims;
  uint64_t numel = 0;
};

// A tensor's dtype, rank and dims, each checked, with its values' bytes checked to be there.
TensorHeader read_tensor_header(Reader& in, const std::string& source, const std::string& name, uint32_t version) {
  TensorHeader header;
  const auto dtype = in.get<uint8_t>(fmt::format("tensor \"{}\" dtype", name));
  const std::optional<StorageType> type = type_of_code(dtype);
  if (!type || (version < 2 && *type != StorageType::float32)) {
    throw IoError(fmt::format("{}: tensor \"{}\": expected dtype code {} of format version {}, got {}", source, name,
                              version < 2 ? "1 (float32)" : "1 to 4 (float32, float16, bfloat16, int8)", version,
                              dtype));
  }
  header.type = *type;
  const auto rank = in.get<uint8_t>(fmt::format("tensor \"{}\" rank", name));
  if (rank > kMaxRank) {
    throw IoError(fmt::format("{}: tensor \"{}\": expected rank 0 to {}, got {}", source, name, kMaxRank, rank));
  }
  for (int axis = 0; axis < rank; ++axis) {
    const auto dim = in.get<uint64_t>(fmt::format("tensor \"{}\" dim {}", name, axis));
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw IoError(
          fmt::format("{}: tensor \"{}\": dim {} is {}, more than fits in an int64", source, name, axis, dim));
    }
    header.dims.push_back(static_cast<int64_t>(dim));
  }
  const bool empty = std::ranges::find(header.dims, 0) != header.dims.end();
  // The values follow the dims, so only a non-empty tensor's dims are bounded by the bytes left;
  // each partial product stays within them, so that the next one cannot overflow.
  const auto element_bytes = static_cast<uint64_t>(storage_bytes(header.type));
  header.numel = empty ? 0 : 1;
  const uint64_t capacity = in.left() / element_bytes;
  for (size_t axis = 0; axis < header.dims.size() && !empty; ++axis) {
    const auto dim = static_cast<uint64_t>(header.dims[axis]);
    if (dim > capacity || header.numel > capacity / dim) {
      throw IoError(fmt::format("{}: tensor \"{}\": dim {} is {}, more values than the {} bytes left can hold", source,
                                name, axis, dim, in.left()));
    }
    header.numel *= dim;
  }
  in.need(header.numel * element_bytes, fmt::format("tensor \"{}\" values", name));
  return header;
}

Shape shape_of(const TensorHeader& header, const std::string& source, const std::string& name) {
  try {
    return Shape(std::span<const int64_t>(header.dims));
  } catch (const ShapeError& e) {
    throw IoError(fmt::format("{}: tensor \"{}\": {}", source, name, e.what()));
  }
}

Tensor<float> read_float32_values(Reader& in, const TensorHeader& header, const std::string& source,
                                  const std::string& name) {
  Tensor<float> tensor(shape_of(header, source, name));
  const uint64_t numel = header.numel;
  // memcpy takes no null pointer, even for zero bytes, and an empty tensor's data() may be null.
  if (numel > 0) std::memcpy(tensor.data(), in.rest(numel * sizeof(float)).data(), numel * sizeof(float));
  in.skip(numel * sizeof(float));
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    if (!std::isfinite(tensor[i])) {
      throw IoError(
          fmt::format("{}: tensor \"{}\": value {} at flat index {} is not finite", source, name, tensor[i], i));
    }
  }
  return tensor;
}

NarrowTensor read_narrow_values(Reader& in, const TensorHeader& header, const std::string& source,
                                const std::string& name) {
  NarrowTensor tensor{.type = header.type, .shape = shape_of(header, source, name), .bytes = {}};
  const auto bytes = static_cast<size_t>(header.numel) * static_cast<size_t>(storage_bytes(header.type));
  const std::string_view values = in.rest(bytes);
  tensor.bytes.assign(values.begin(), values.end());
  in.skip(bytes);
  for (size_t i = 0; i < header.numel; ++i) {
    if (const std::optional<float> value = non_finite_at(tensor, i)) {
      throw IoError(fmt::format("{}: tensor \"{}\": {} value {} at flat index {} is not finite", source, name,
                                storage_name(tensor.type), *value, i));
    }
  }
  return tensor;
}

// Appends a tensor's name, dtype, rank and dims.
void put_header(std::string& payload, std::string_view name, StorageType type, const Shape& shape) {
  put_string(payload, name);
  put(payload, dtype_code(type));
  put(payload, static_cast<uint8_t>(shape.rank()));
  for (const int64_t dim : shape.dims()) put(payload, static_cast<uint64_t>(dim));
}

}  // namespace

void ModelFile::set(std::string key, std::string value_text) {
  for (auto& [k, v] : metadata) {
    if (k == key) {
      v = std::move(value_text);
      return;
    }
  }
  metadata.emplace_back(std::move(key), std::move(value_text));
}

const std::string& ModelFile::value(std::string_view key) const {
  for (const auto& [k, v] : metadata) {
    if (k == key) return v;
  }
  throw IoError(fmt::format("{}: no entry \"{}\" (a {} model file needs it)", source, key, kind));
}

int64_t ModelFile::int_value(std::string_view key, int64_t min, int64_t max) const {
  const std::string& text = value(key);
  int64_t parsed = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), parsed);
  if (ec != std::errc() || end != text.data() + text.size() || parsed < min || parsed > max) {
    throw IoError(
        fmt::format("{}: entry \"{}\": expected an integer from {} to {}, got \"{}\"", source, key, min, max, text));
  }
  return parsed;
}

const Tensor<float>& ModelFile::tensor(std::string_view name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return t;
  }
  throw IoError(fmt::format("{}: no tensor \"{}\" (a {} model file needs it)", source, name, kind));
}

const NarrowTensor* ModelFile::narrow_tensor(std::string_view name) const {
  for (const auto& [n, t] : narrow_tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

void ModelFile::check_kind(std::string_view expected) const {
  if (kind != expected) {
    throw IoError(fmt::format("{}: expected a {} model, got a \"{}\" model", source, expected, kind));
  }
}

uint32_t crc32(std::string_view bytes) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1U) != 0 ? 0xEDB88320U ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFU;
  for (const char byte : bytes) crc = table[(crc ^ static_cast<uint8_t>(byte)) & 0xFFU] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFU;
}

std::string encode_model_file(const ModelFile& model) {
  // The payload is written in place behind the header, its length filled in at the end, and room
  // made first for the values and 4 KiB of names and entries (more only grows the string): a
  // cache's pools are most of the file, and are copied once.
  size_t value_bytes = 0;
  for (const auto& [name, tensor] : model.tensors) value_bytes += static_cast<size_t>(tensor.numel()) * sizeof(float);
  for (const auto& [name, tensor] : model.narrow_tensors) value_bytes += tensor.bytes.size();
  std::string bytes(kModelFileMagic);
  bytes.reserve(kHeaderBytes + value_bytes + 4096 + kChecksumBytes);
  put(bytes, model.narrow_tensors.empty() ? uint32_t{1} : kModelFileVersion);
  put(bytes, uint64_t{0});
  put_string(bytes, model.kind);
  std::set<std::string_view> keys;
  put(bytes, static_cast<uint32_t>(model.metadata.size()));
  for (const auto& [key, text] : model.metadata) {
    if (!keys.insert(key).second) throw ValueError(fmt::format("model file: entry \"{}\" given twice", key));
    put_string(bytes, key);
    put_string(bytes, text);
  }
  std::set<std::string_view> names;
  const size_t count = model.tensors.size() + model.narrow_tensors.size();
  if (count > std::numeric_limits<uint32_t>::max()) {
    throw ValueError(fmt::format("model file: {} tensors, more than a u32 count can say", count));
  }
  put(bytes, static_cast<uint32_t>(count));
  for (const auto& [name, tensor] : model.tensors) {
    if (!names.insert(name).second) throw ValueError(fmt::format("model file: tensor \"{}\" given twice", name));
    for (int64_t i = 0; i < tensor.numel(); ++i) {
      if (!std::isfinite(tensor[i])) {
        throw ValueError(
            fmt::format("model file: tensor \"{}\": value {} at flat index {} is not finite", name, tensor[i], i));
      }
    }
    put_header(bytes, name, StorageType::float32, tensor.shape());
    if (tensor.numel() > 0) {
      bytes.append(reinterpret_cast<const char*>(tensor.data()), static_cast<size_t>(tensor.numel()) * sizeof(float));
    }
  }
  for (const auto& [name, tensor] : model.narrow_tensors) {
    if (!names.insert(name).second) throw ValueError(fmt::format("model file: tensor \"{}\" given twice", name));
    if (tensor.type == StorageType::float32) {
      throw ValueError(
          fmt::format("model file: narrow tensor \"{}\": expected float16, bfloat16 or int8, got "
                      "float32 (a float32 tensor goes in `tensors`)",
                      name));
    }
    const auto numel = static_cast<size_t>(tensor.shape.numel());
    if (tensor.bytes.size() != numel * static_cast<size_t>(storage_bytes(tensor.type))) {
      throw ValueError(
          fmt::format("model file: narrow tensor \"{}\": expected {} bytes ({} {} values of shape {}), "
                      "got {}",
                      name, numel * static_cast<size_t>(storage_bytes(tensor.type)), numel, storage_name(tensor.type),
                      tensor.shape.str(), tensor.bytes.size()));
    }
    for (size_t i = 0; i < numel; ++i) {
      if (const std::optional<float> value = non_finite_at(tensor, i)) {
        throw ValueError(fmt::format("model file: tensor \"{}\": {} value {} at flat index {} is not finite", name,
                                     storage_name(tensor.type), *value, i));
      }
    }
    put_header(bytes, name, tensor.type, tensor.shape);
    bytes.append(reinterpret_cast<const char*>(tensor.bytes.data()), tensor.bytes.size());
  }
  const uint64_t length = bytes.size() - kHeaderBytes;
  std::memcpy(bytes.data() + kModelFileMagic.size() + sizeof(uint32_t), &length, sizeof(length));
  put(bytes, crc32(bytes));
  return bytes;
}

ModelFile decode_model_file(std::string_view bytes, std::string source) {
  if (bytes.size() < kModelFileMagic.size() || bytes.substr(0, kModelFileMagic.size()) != kModelFileMagic) {
    throw IoError(fmt::format("{}: not a qkv model file (it does not start with \"{}\")", source, kModelFileMagic));
  }
  if (bytes.size() < kHeaderBytes + kChecksumBytes) {
    throw IoError(fmt::format("{}: truncated: {} bytes, shorter than the {}-byte header and checksum", source,
                              bytes.size(), kHeaderBytes + kChecksumBytes));
  }
  uint32_t version = 0;
  uint64_t payload_length = 0;
  std::memcpy(&version, bytes.data() + 8, sizeof(version));
  std::memcpy(&payload_length, bytes.data() + 12, sizeof(payload_length));
  if (version < 1 || version > kModelFileVersion) {
    throw IoError(
        fmt::format("{}: format version {}; this qkv reads versions 1 to {}", source, version, kModelFileVersion));
  }
  const uint64_t expected_size = kHeaderBytes + kChecksumBytes + payload_length;
  if (payload_length > bytes.size() || bytes.size() != expected_size) {
    throw IoError(
        fmt::format("{}: the header announces a payload of {} bytes, so a file of {} bytes; got {} bytes ({})", source,
                    payload_length, kHeaderBytes + kChecksumBytes + payload_length, bytes.size(),
                    bytes.size() < expected_size ? "truncated" : "trailing bytes"));
  }
  const size_t checked = kHeaderBytes + static_cast<size_t>(payload_length);
  uint32_t stored = 0;
  std::memcpy(&stored, bytes.data() + checked, sizeof(stored));
  const uint32_t computed = crc32(bytes.substr(0, checked));
  if (stored != computed) {
    throw IoError(fmt::format("{}: checksum mismatch (stored {:#010x}, computed {:#010x}): the file is corrupt", source,
                              stored, computed));
  }

  ModelFile model;
  model.source = std::move(source);
  Reader in(bytes.substr(kHeaderBytes, static_cast<size_t>(payload_length)), model.source);
  model.kind = in.get_string("kind");
  const auto entries = in.get<uint32_t>("entry count");
  // A KV cache file has two entries a sequence: duplicates are found in a set, not by a search each.
  std::set<std::string> keys;
  for (uint32_t e = 0; e < entries; ++e) {
    std::string key = in.get_string(fmt::format("entry {} key", e));
    std::string text = in.get_string(fmt::format("entry \"{}\" value", key));
    if (!keys.insert(key).second) throw IoError(fmt::format("{}: entry \"{}\" appears twice", model.source, key));
    model.metadata.emplace_back(std::move(key), std::move(text));
  }
  const auto count = in.get<uint32_t>("tensor count");
  std::set<std::string> names;
  for (uint32_t t = 0; t < count; ++t) {
    std::string name = in.get_string(fmt::format("tensor {} name", t));
    if (!names.insert(name).second) throw IoError(fmt::format("{}: tensor \"{}\" appears twice", model.source, name));
    const TensorHeader header = read_tensor_header(in, model.source, name, version);
    if (header.type == StorageType::float32) {
      Tensor<float> tensor = read_float32_values(in, header, model.source, name);
      model.tensors.emplace_back(std::move(name), std::move(tensor));
    } else {
      NarrowTensor tensor = read_narrow_values(in, header, model.source, name);
      model.narrow_tensors.emplace_back(std::move(name), std::move(tensor));
    }
  }
  if (in.left() != 0) {
    throw IoError(fmt::format("{}: {} bytes of the payload follow the last tensor", model.source, in.left()));
  }
  return model;
}

void write_model_file(const std::filesystem::path& path, const ModelFile& model) {
  write_file_atomically(path, encode_model_file(model));
}

ModelFile read_model_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw IoError(fmt::format("{}: cannot open for reading", path.string()));
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) throw IoError(fmt::format("{}: read failed", path.string()));
  return decode_model_file(contents.view(), path.string());
}

template <class T>
void store_parameters(ModelFile& model, const std::vector<ParameterRef<T>>& params) {
  for (const ParameterRef<T>& p : params) {
    model.tensors.emplace_back(p.name, to_tensor<float, std::remove_const_t<T>>(p.value));
  }
}

template <class T>
void load_parameters(const ModelFile& model, const std::vector<ParameterRef<T>>& params) {
  std::set<std::string_view> wanted;
  for (const ParameterRef<T>& p : params) wanted.insert(p.name);
  for (const auto& [name, tensor] : model.tensors) {
    if (!wanted.contains(name)) {
      throw IoError(
          fmt::format("{}: tensor \"{}\" is not a parameter of this {} model", model.source, name, model.kind));
    }
  }
  for (const auto& [name, tensor] : model.narrow_tensors) {
    throw IoError(fmt::format("{}: tensor \"{}\" is {}; the parameters of a {} model are float32", model.source, name,
                              storage_name(tensor.type), model.kind));
  }
  for (const ParameterRef<T>& p : params) {
    const Tensor<float>& stored = model.tensor(p.name);
    if (!(stored.shape() == p.value.shape)) {
      throw IoError(fmt::format("{}: tensor \"{}\": expected shape {} (from the model's configuration), got {}",
                                model.source, p.name, p.value.shape.str(), stored.shape().str()));
    }
  }
  for (const ParameterRef<T>& p : params) {
    const Tensor<float>& stored = model.tensor(p.name);
    const TensorView<T> target = as_rank4(p.value);
    const TensorView<const float> source = as_rank4(stored.cview());
    for (int64_t a = 0; a < target.shape[0]; ++a)
      for (int64_t b = 0; b < target.shape[1]; ++b)
        for (int64_t c = 0; c < target.shape[2]; ++c)
          for (int64_t d = 0; d < target.shape[3]; ++d) target(a, b, c, d) = static_cast<T>(source(a, b, c, d));
  }
}

template void store_parameters(ModelFile&, const std::vector<ParameterRef<float>>&);
template void store_parameters(ModelFile&, const std::vector<ParameterRef<const float>>&);
template void store_parameters(ModelFile&, const std::vector<ParameterRef<double>>&);
template void store_parameters(ModelFile&, const std::vector<ParameterRef<const double>>&);
template void load_parameters(const ModelFile&, const std::vector<ParameterRef<float>>&);
template void load_parameters(const ModelFile&, const std::vector<ParameterRef<double>>&);

}  // namespace qkv
