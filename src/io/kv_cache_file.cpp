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
#include <unordered_map>
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

// The file's entries by key: a cache has two per sequence, which ModelFile::value would find by a
// search each.
class Entries {
 public:
  explicit Entries(const ModelFile& file) : file_(file) {
    for (const auto& [key, value] : file.metadata) index_.emplace(key, &value);
  }

  const std::string& text(std::string_view key) const {
    const auto found = index_.find(key);
    if (found == index_.end()) {
      throw IoError(fmt::format("{}: no entry \"{}\" (a {} file needs it)", file_.source, key, kKind));
    }
    return *found->second;
  }

  int64_t integer(std::string_view key, int64_t min, int64_t max) const {
    const std::string& value = text(key);
    int64_t parsed = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), parsed);
    if (ec != std::errc() || end != value.data() + value.size() || parsed < min || parsed > max) {
      throw IoError(fmt::format("{}: entry \"{}\": expected an integer from {} to {}, got \"{}\"", file_.source, key,
                                min, max, value));
    }
    return parsed;
  }

  std::vector<int64_t> integers(std::string_view key) const;

 private:
  const ModelFile& file_;
  std::unordered_map<std::string_view, const std::string*> index_;
};

std::vector<int64_t> Entries::integers(std::string_view key) const {
  const std::string& text = this->text(key);
  std::vector<int64_t> values;
  const char* at = text.data();
  const char* const end = text.data() + text.size();
  while (at != end) {
    int64_t value = 0;
    const auto [next, ec] = std::from_chars(at, end, value);
    if (ec != std::errc() || (next != end && *next != ' ')) {
      throw IoError(
          fmt::format("{}: entry \"{}\": expected integers separated by spaces, got \"{}\"", file_.source, key, text));
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
  const auto elements = [&](int64_t d) { return static_cast<size_t>(s.pages * s.kv_heads * s.page_tokens * d); };
  const auto bytes = static_cast<size_t>(storage_bytes(s.type));
  if (state.k_pool.size() != elements(s.dk) * bytes || state.v_pool.size() != elements(s.dv) * bytes) {
    throw ValueError(fmt::format("state: pools of {} and {} bytes do not fit its shape (KvCache::state() gives one)",
                                 state.k_pool.size(), state.v_pool.size()));
  }
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
    // Keys no other entry has: appended, not searched for as set() would.
    const KvCacheSequence& seq = state.sequences[id];
    file.metadata.emplace_back(fmt::format("sequence {} length", id),
                               seq.live ? std::to_string(seq.length) : "removed");
    file.metadata.emplace_back(fmt::format("sequence {} pages", id), fmt::format("{}", fmt::join(seq.pages, " ")));
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
  const Entries entries(file);
  KvCacheState state;
  KvCacheShape& s = state.shape;
  try {
    s.type = parse_storage(entries.text("type"), "type");
  } catch (const ValueError& e) {
    throw IoError(fmt::format("{}: entry {}", file.source, e.what()));
  }
  constexpr int64_t kMaxDim = int64_t{1} << 40;
  s.kv_heads = entries.integer("kv_heads", 1, kMaxDim);
  s.dk = entries.integer("dk", 1, kMaxDim);
  s.dv = entries.integer("dv", 1, kMaxDim);
  s.page_tokens = entries.integer("page_tokens", 1, kMaxDim);
  s.pages = entries.integer("pages", 1, kMaxDim);
  state.free_pages = entries.integers("free_pages");
  const int64_t sequences = entries.integer("sequences", 0, std::numeric_limits<int32_t>::max());
  for (int64_t id = 0; id < sequences; ++id) {
    const std::string length_key = fmt::format("sequence {} length", id);
    KvCacheSequence seq;
    seq.live = entries.text(length_key) != "removed";
    seq.length = seq.live ? entries.integer(length_key, 0, std::numeric_limits<int64_t>::max()) : 0;
    seq.pages = entries.integers(fmt::format("sequence {} pages", id));
    state.sequences.push_back(std::move(seq));
  }
  try {
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
  } catch (const IoError&) {
    throw;
  } catch (const Error& e) {
    // A shape whose element count overflows, from entries that are each in range.
    throw IoError(fmt::format("{}: {}", file.source, e.what()));
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
