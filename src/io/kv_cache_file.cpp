#include "qkv/io/kv_cache_file.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/io/model_file.hpp"
#include "qkv/io/staged_files.hpp"

namespace qkv {
namespace {

constexpr std::string_view kKind = "kv_cache";

// A pool of the cache's type as the float32 values it holds, shaped [pages, Hkv, page_tokens, d].
Tensor<float> pool_values(const std::vector<uint8_t>& pool, const KvCacheShape& s, int64_t d) {
  Tensor<float> values(Shape{s.pages, s.kv_heads, s.page_tokens, d});
  for (int64_t i = 0; i < values.numel(); ++i) {
    switch (s.type) {
      case StorageType::float32:
        std::memcpy(&values[i], pool.data() + i * 4, 4);
        break;
      case StorageType::float16:
        values[i] = float_from_float16(reinterpret_cast<const uint16_t*>(pool.data())[i]);
        break;
      case StorageType::bfloat16:
        values[i] = float_from_bfloat16(reinterpret_cast<const uint16_t*>(pool.data())[i]);
        break;
      case StorageType::int8:
        values[i] = static_cast<float>(reinterpret_cast<const int8_t*>(pool.data())[i]);
        break;
    }
  }
  return values;
}

// The pool's bytes from its values, each of which the type must hold exactly.
std::vector<uint8_t> pool_bytes(const Tensor<float>& values, const KvCacheShape& s, const std::string& source,
                                std::string_view name) {
  std::vector<uint8_t> pool(static_cast<size_t>(values.numel() * storage_bytes(s.type)));
  for (int64_t i = 0; i < values.numel(); ++i) {
    const float x = values[i];
    bool exact = true;
    switch (s.type) {
      case StorageType::float32:
        std::memcpy(pool.data() + i * 4, &x, 4);
        break;
      case StorageType::float16: {
        const uint16_t bits = float16_from_float(x);
        exact = float_from_float16(bits) == x;
        reinterpret_cast<uint16_t*>(pool.data())[i] = bits;
        break;
      }
      case StorageType::bfloat16: {
        const uint16_t bits = bfloat16_from_float(x);
        exact = float_from_bfloat16(bits) == x;
        reinterpret_cast<uint16_t*>(pool.data())[i] = bits;
        break;
      }
      case StorageType::int8:
        exact = x == std::nearbyint(x) && x >= -128.0f && x <= 127.0f;
        reinterpret_cast<int8_t*>(pool.data())[i] = exact ? static_cast<int8_t>(x) : 0;
        break;
    }
    if (!exact) {
      throw IoError(fmt::format("{}: tensor \"{}\": value {} at flat index {} is not a {} value", source, name, x, i,
                                storage_name(s.type)));
    }
  }
  return pool;
}

std::vector<int64_t> parse_ints(const ModelFile& file, std::string_view key) {
  const std::string& text = file.value(key);
  std::vector<int64_t> values;
  const char* at = text.data();
  const char* const end = text.data() + text.size();
  while (at != end) {
    int64_t value = 0;
    const auto [next, ec] = std::from_chars(at, end, value);
    if (ec != std::errc() || (next != end && *next != ' ')) {
      throw IoError(
          fmt::format("{}: entry \"{}\": expected integers separated by spaces, got \"{}\"", file.source, key, text));
    }
    at = next == end ? end : next + 1;
    values.push_back(value);
  }
  return values;
}

const Tensor<float>& tensor_of_shape(const ModelFile& file, std::string_view name, const Shape& shape) {
  const Tensor<float>& t = file.tensor(name);
  if (t.shape() != shape) {
    throw IoError(
        fmt::format("{}: tensor \"{}\": expected shape {}, got {}", file.source, name, shape.str(), t.shape().str()));
  }
  return t;
}

}  // namespace

std::string encode_kv_cache_file(const KvCacheState& state) {
  const KvCacheShape& s = state.shape;
  ModelFile file;
  file.kind = kKind;
  file.set("type", std::string(storage_name(s.type)));
  for (const auto& [key, value] : {std::pair{"kv_heads", s.kv_heads}, std::pair{"dk", s.dk}, std::pair{"dv", s.dv},
                                   std::pair{"page_tokens", s.page_tokens}, std::pair{"pages", s.pages}}) {
    file.set(key, std::to_string(value));
  }
  file.set("free_pages", fmt::format("{}", fmt::join(state.free_pages, " ")));
  file.set("sequences", std::to_string(state.sequences.size()));
  for (size_t id = 0; id < state.sequences.size(); ++id) {
    const KvCacheSequence& seq = state.sequences[id];
    file.set(fmt::format("sequence {} length", id), seq.live ? std::to_string(seq.length) : "removed");
    file.set(fmt::format("sequence {} pages", id), fmt::format("{}", fmt::join(seq.pages, " ")));
  }
  file.tensors.emplace_back("k_pool", pool_values(state.k_pool, s, s.dk));
  file.tensors.emplace_back("v_pool", pool_values(state.v_pool, s, s.dv));
  if (s.type == StorageType::int8) {
    file.tensors.emplace_back("k_scales", Tensor<float>(Shape{s.pages, s.kv_heads, s.dk}, state.k_scales));
    file.tensors.emplace_back("v_scales", Tensor<float>(Shape{s.pages, s.kv_heads, s.page_tokens}, state.v_scales));
  }
  return encode_model_file(file);
}

namespace {

KvCacheState state_of(const ModelFile& file) {
  file.check_kind(kKind);
  KvCacheState state;
  KvCacheShape& s = state.shape;
  try {
    s.type = parse_storage(file.value("type"), "type");
  } catch (const ValueError& e) {
    throw IoError(fmt::format("{}: entry {}", file.source, e.what()));
  }
  constexpr int64_t kMaxDim = int64_t{1} << 40;
  s.kv_heads = file.int_value("kv_heads", 1, kMaxDim);
  s.dk = file.int_value("dk", 1, kMaxDim);
  s.dv = file.int_value("dv", 1, kMaxDim);
  s.page_tokens = file.int_value("page_tokens", 1, kMaxDim);
  s.pages = file.int_value("pages", 1, kMaxDim);
  state.free_pages = parse_ints(file, "free_pages");
  const int64_t sequences = file.int_value("sequences", 0, std::numeric_limits<int32_t>::max());
  for (int64_t id = 0; id < sequences; ++id) {
    const std::string length_key = fmt::format("sequence {} length", id);
    KvCacheSequence seq;
    seq.live = file.value(length_key) != "removed";
    seq.length = seq.live ? file.int_value(length_key, 0, std::numeric_limits<int64_t>::max()) : 0;
    seq.pages = parse_ints(file, fmt::format("sequence {} pages", id));
    state.sequences.push_back(std::move(seq));
  }
  state.k_pool = pool_bytes(tensor_of_shape(file, "k_pool", Shape{s.pages, s.kv_heads, s.page_tokens, s.dk}), s,
                            file.source, "k_pool");
  state.v_pool = pool_bytes(tensor_of_shape(file, "v_pool", Shape{s.pages, s.kv_heads, s.page_tokens, s.dv}), s,
                            file.source, "v_pool");
  if (s.type == StorageType::int8) {
    const Tensor<float>& ks = tensor_of_shape(file, "k_scales", Shape{s.pages, s.kv_heads, s.dk});
    const Tensor<float>& vs = tensor_of_shape(file, "v_scales", Shape{s.pages, s.kv_heads, s.page_tokens});
    state.k_scales.assign(ks.data(), ks.data() + ks.numel());
    state.v_scales.assign(vs.data(), vs.data() + vs.numel());
  }
  return state;
}

}  // namespace

KvCacheState decode_kv_cache_file(std::string_view bytes, std::string source) {
  return state_of(decode_model_file(bytes, std::move(source)));
}

void write_kv_cache_file(const std::filesystem::path& path, const KvCacheState& state) {
  write_file_atomically(path, encode_kv_cache_file(state));
}

KvCacheState read_kv_cache_file(const std::filesystem::path& path) { return state_of(read_model_file(path)); }

}  // namespace qkv
