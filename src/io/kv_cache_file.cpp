#include "qkv/io/kv_cache_file.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
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

// The tensors' names; files written while a pool held each page's heads together ([pages, Hkv, …])
// name them k_pool, v_pool, k_scales and v_scales, and are read too.
struct TensorNames {
  const char *keys, *values, *key_scales, *value_scales;
};
constexpr TensorNames kHeadsFirst{"keys", "values", "key_scales", "value_scales"};
constexpr TensorNames kPagesFirst{"k_pool", "v_pool", "k_scales", "v_scales"};

// A pool's shape, [Hkv, pages, page_tokens, d], or the pages first.
Shape pool_shape(const KvCacheShape& s, int64_t d, bool pages_first = false) {
  return pages_first ? Shape{s.pages, s.kv_heads, s.page_tokens, d} : Shape{s.kv_heads, s.pages, s.page_tokens, d};
}

// A float32 pool as a tensor [Hkv, pages, page_tokens, d].
Tensor<float> float32_pool(const PoolBytes& pool, const KvCacheShape& s, int64_t d) {
  Tensor<float> values(pool_shape(s, d));
  if (values.numel() > 0) std::memcpy(values.data(), pool.data(), pool.size());
  return values;
}

// The pool's bytes from its values as float32, each of which the type must hold exactly: how files
// of format version 1 (float32 tensors alone) keep float16, bfloat16 and int8 pools.
PoolBytes pool_bytes(const Tensor<float>& values, const KvCacheShape& s, const std::string& source,
                     std::string_view name) {
  PoolBytes pool(static_cast<size_t>(values.numel() * storage_bytes(s.type)));
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

// Integers separated by spaces in `text`: entry `key`, or one part of it.
std::vector<int64_t> parse_ints(std::string_view text, const ModelFile& file, std::string_view key) {
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

void expect_shape(const ModelFile& file, std::string_view name, const Shape& actual, const Shape& expected) {
  if (actual != expected) {
    throw IoError(
        fmt::format("{}: tensor \"{}\": expected shape {}, got {}", file.source, name, expected.str(), actual.str()));
  }
}

bool has_tensor(const ModelFile& file, std::string_view name) {
  return file.narrow_tensor(name) != nullptr ||
         std::any_of(file.tensors.begin(), file.tensors.end(), [&](const auto& t) { return t.first == name; });
}

// [pages][heads][…] as [heads][pages][…].
template <class Vector>
Vector heads_first(const Vector& x, int64_t pages, int64_t heads) {
  Vector out(x.size());
  const auto blocks = static_cast<size_t>(pages * heads);
  const size_t inner = x.size() / blocks;
  for (size_t p = 0; p < static_cast<size_t>(pages); ++p) {
    for (size_t h = 0; h < static_cast<size_t>(heads); ++h) {
      std::copy_n(x.begin() + static_cast<ptrdiff_t>((p * static_cast<size_t>(heads) + h) * inner), inner,
                  out.begin() + static_cast<ptrdiff_t>((h * static_cast<size_t>(pages) + p) * inner));
    }
  }
  return out;
}

const Tensor<float>& tensor_of_shape(const ModelFile& file, std::string_view name, const Shape& shape) {
  const Tensor<float>& t = file.tensor(name);
  expect_shape(file, name, t.shape(), shape);
  return t;
}

// A pool's bytes: a narrow tensor of the cache's type as it is, or float32 values the type holds.
PoolBytes read_pool(ModelFile& file, std::string_view name, const KvCacheShape& s, int64_t d, bool pages_first) {
  const Shape shape = pool_shape(s, d, pages_first);
  for (auto& [narrow_name, narrow] : file.narrow_tensors) {
    if (narrow_name != name) continue;
    if (narrow.type != s.type) {
      throw IoError(fmt::format("{}: tensor \"{}\": expected {} values (entry \"type\"), got {}", file.source, name,
                                storage_name(s.type), storage_name(narrow.type)));
    }
    expect_shape(file, name, narrow.shape, shape);
    // Copied onto a cache line's boundary, and the file's copy freed at once, so that the memory
    // reading a cache takes peaks while the file is decoded, not here.
    PoolBytes pool(narrow.bytes.begin(), narrow.bytes.end());
    std::vector<uint8_t>().swap(narrow.bytes);
    return pool;
  }
  return pool_bytes(tensor_of_shape(file, name, shape), s, file.source, name);
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
  // Every sequence in two entries, so that a file's entries stay few however many sequences it has:
  // lengths (-1 for a removed sequence) and page lists separated by ';'.
  std::vector<int64_t> lengths;
  std::vector<std::string> pages;
  for (const KvCacheSequence& seq : state.sequences) {
    lengths.push_back(seq.live ? seq.length : -1);
    pages.push_back(fmt::format("{}", fmt::join(seq.pages, " ")));
  }
  file.set("sequence_lengths", fmt::format("{}", fmt::join(lengths, " ")));
  file.set("sequence_pages", fmt::format("{}", fmt::join(pages, ";")));
  if (s.type == StorageType::float32) {
    file.tensors.emplace_back(kHeadsFirst.keys, float32_pool(state.k_pool, s, s.dk));
    file.tensors.emplace_back(kHeadsFirst.values, float32_pool(state.v_pool, s, s.dv));
  } else {
    file.narrow_tensors.emplace_back(
        kHeadsFirst.keys,
        NarrowTensor{
            .type = s.type, .shape = pool_shape(s, s.dk), .bytes = {state.k_pool.begin(), state.k_pool.end()}});
    file.narrow_tensors.emplace_back(
        kHeadsFirst.values,
        NarrowTensor{
            .type = s.type, .shape = pool_shape(s, s.dv), .bytes = {state.v_pool.begin(), state.v_pool.end()}});
  }
  if (s.type == StorageType::int8) {
    file.tensors.emplace_back(kHeadsFirst.key_scales, Tensor<float>(Shape{s.kv_heads, s.pages, s.dk}, state.k_scales));
    file.tensors.emplace_back(kHeadsFirst.value_scales,
                              Tensor<float>(Shape{s.kv_heads, s.pages, s.page_tokens}, state.v_scales));
  }
  return encode_model_file(file);
}

namespace {

KvCacheState state_of(ModelFile file) {
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
  state.free_pages = parse_ints(file.value("free_pages"), file, "free_pages");
  const std::vector<int64_t> lengths = parse_ints(file.value("sequence_lengths"), file, "sequence_lengths");
  const std::string_view pages = file.value("sequence_pages");
  size_t at = 0;
  for (size_t id = 0; id < lengths.size(); ++id) {
    const size_t end = id + 1 == lengths.size() ? pages.size() : pages.find(';', at);
    if (end == std::string_view::npos || lengths[id] < -1) {
      throw IoError(
          fmt::format("{}: entries \"sequence_lengths\" and \"sequence_pages\": expected a length of at "
                      "least -1 (removed) and a list of pages for each of {} sequences",
                      file.source, lengths.size()));
    }
    state.sequences.push_back({.pages = parse_ints(pages.substr(at, end - at), file, "sequence_pages"),
                               .length = std::max<int64_t>(lengths[id], 0),
                               .live = lengths[id] >= 0});
    at = end + 1;
  }
  // A list too many ends in the last one, whose ';' parse_ints refuses; with no sequence, none.
  if (lengths.empty() && !pages.empty()) {
    throw IoError(
        fmt::format("{}: entry \"sequence_pages\": expected no pages for no sequence, got \"{}\"", file.source, pages));
  }
  try {
    const bool pages_first = has_tensor(file, kPagesFirst.keys);
    const TensorNames& names = pages_first ? kPagesFirst : kHeadsFirst;
    state.k_pool = read_pool(file, names.keys, s, s.dk, pages_first);
    state.v_pool = read_pool(file, names.values, s, s.dv, pages_first);
    if (s.type == StorageType::int8) {
      const auto scales = [&](const char* name, int64_t n) {
        const Tensor<float>& t =
            tensor_of_shape(file, name, pages_first ? Shape{s.pages, s.kv_heads, n} : Shape{s.kv_heads, s.pages, n});
        return std::vector<float>(t.data(), t.data() + t.numel());
      };
      state.k_scales = scales(names.key_scales, s.dk);
      state.v_scales = scales(names.value_scales, s.page_tokens);
    }
    if (pages_first) {
      for (auto* pool : {&state.k_pool, &state.v_pool}) *pool = heads_first(*pool, s.pages, s.kv_heads);
      for (auto* scales : {&state.k_scales, &state.v_scales}) *scales = heads_first(*scales, s.pages, s.kv_heads);
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
