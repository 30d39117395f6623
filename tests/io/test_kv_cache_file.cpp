// KV cache files (include/qkv/io/kv_cache_file.hpp): a round trip keeps every byte of the cache in
// every storage type, and the file holds each pool in the cache's own type; files whose pools hold
// the pages first, of format version 1 (float32 values) or 2, still read to the same cache; values
// the type cannot hold, pools of another type, missing entries and tensors of the wrong shape are
// refused naming the file.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/io/kv_cache_file.hpp"
#include "qkv/io/model_file.hpp"
#include "qkv/ops/kv_cache.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

KvCacheState some_state(StorageType type) {
  KvCache cache({.kv_heads = 2, .dk = 5, .dv = 3, .type = type, .page_tokens = 4, .pages = 6});
  const int64_t a = cache.add_sequence(), gone = cache.add_sequence(), b = cache.add_sequence();
  Rng rng(5);
  for (const int64_t id : {a, gone, b}) {
    const int64_t n = 3 + id * 2;
    cache.append(id, testing::cast<float>(testing::random_tensor<double>({2, n, 5}, rng, 4.0)).cview(),
                 testing::cast<float>(testing::random_tensor<double>({2, n, 3}, rng)).cview());
  }
  cache.remove_sequence(gone);
  return cache.state();
}

TEST(KvCacheFile, RoundTripKeepsEveryByte) {
  for (const StorageType type :
       {StorageType::float32, StorageType::float16, StorageType::bfloat16, StorageType::int8}) {
    SCOPED_TRACE(storage_name(type));
    const KvCacheState state = some_state(type);
    const KvCacheState back = decode_kv_cache_file(encode_kv_cache_file(state), "c.qkvc");
    EXPECT_EQ(back.shape.type, type);
    EXPECT_EQ(back.shape.kv_heads, 2);
    EXPECT_EQ(back.shape.dk, 5);
    EXPECT_EQ(back.shape.dv, 3);
    EXPECT_EQ(back.shape.page_tokens, 4);
    EXPECT_EQ(back.shape.pages, 6);
    EXPECT_EQ(back.k_pool, state.k_pool);
    EXPECT_EQ(back.v_pool, state.v_pool);
    EXPECT_EQ(back.k_scales, state.k_scales);
    EXPECT_EQ(back.v_scales, state.v_scales);
    EXPECT_EQ(back.free_pages, state.free_pages);
    ASSERT_EQ(back.sequences.size(), 3U);
    for (size_t id = 0; id < 3; ++id) {
      EXPECT_EQ(back.sequences[id].live, state.sequences[id].live);
      EXPECT_EQ(back.sequences[id].length, state.sequences[id].length);
      EXPECT_EQ(back.sequences[id].pages, state.sequences[id].pages);
    }
    EXPECT_NO_THROW(KvCache::from_state(back));
  }
}

// [heads][pages][inner] elements of `bytes` bytes as [pages][heads][inner].
template <class Bytes>
std::vector<uint8_t> pages_first(const Bytes& x, int64_t heads, int64_t pages, int64_t bytes) {
  std::vector<uint8_t> out(x.size());
  const auto inner = static_cast<int64_t>(x.size()) / (heads * pages * bytes) * bytes;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t p = 0; p < pages; ++p) {
      std::memcpy(out.data() + (p * heads + h) * inner, x.data() + (h * pages + p) * inner, static_cast<size_t>(inner));
    }
  }
  return out;
}

// The cache file of `type` as files written while the pools kept each page's heads together hold
// it: tensors k_pool, v_pool [pages, Hkv, page_tokens, D] and k_scales, v_scales [pages, Hkv, …].
// In format version 2, the pools in the cache's type; in version 1, every pool as the float32
// values it holds.
ModelFile pages_first_file(StorageType type, uint32_t version = 1) {
  const KvCacheState state = some_state(type);
  const KvCacheShape& s = state.shape;
  ModelFile file = decode_model_file(encode_kv_cache_file(state), "c.qkvc");
  file.tensors.clear();
  file.narrow_tensors.clear();
  const auto bytes = storage_bytes(type);
  for (const auto& [name, pool, d] :
       {std::tuple{"k_pool", &state.k_pool, s.dk}, std::tuple{"v_pool", &state.v_pool, s.dv}}) {
    NarrowTensor t{.type = type,
                   .shape = Shape{s.pages, s.kv_heads, s.page_tokens, d},
                   .bytes = pages_first(*pool, s.kv_heads, s.pages, bytes)};
    if (version == 2 && type != StorageType::float32) {
      file.narrow_tensors.emplace_back(name, std::move(t));
      continue;
    }
    Tensor<float> values(t.shape);
    for (int64_t i = 0; i < values.numel(); ++i) {
      uint16_t bits = 0;
      if (bytes == 2) std::memcpy(&bits, t.bytes.data() + 2 * i, 2);
      values[i] = type == StorageType::float16    ? float_from_float16(bits)
                  : type == StorageType::bfloat16 ? float_from_bfloat16(bits)
                  : type == StorageType::int8     ? static_cast<float>(static_cast<int8_t>(t.bytes[i]))
                                                  : 0.0f;
      if (type == StorageType::float32) std::memcpy(&values[i], t.bytes.data() + 4 * i, 4);
    }
    file.tensors.emplace_back(name, std::move(values));
  }
  if (type == StorageType::int8) {
    for (const auto& [name, scales, n] :
         {std::tuple{"k_scales", &state.k_scales, s.dk}, std::tuple{"v_scales", &state.v_scales, s.page_tokens}}) {
      const std::vector<uint8_t> raw(reinterpret_cast<const uint8_t*>(scales->data()),
                                     reinterpret_cast<const uint8_t*>(scales->data() + scales->size()));
      const std::vector<uint8_t> moved = pages_first(raw, s.kv_heads, s.pages, 4);
      Tensor<float> t(Shape{s.pages, s.kv_heads, n});
      std::memcpy(t.data(), moved.data(), moved.size());
      file.tensors.emplace_back(name, std::move(t));
    }
  }
  return file;
}

TEST(KvCacheFile, PoolsTakeTheirOwnTypesBytes) {
  const auto file_bytes = [](StorageType type) { return encode_kv_cache_file(some_state(type)).size(); };
  const KvCacheState state = some_state(StorageType::float16);
  const size_t pools = state.k_pool.size() + state.v_pool.size();
  // The float16 file holds its pools (and a few hundred bytes of entries); the float32 one twice them.
  EXPECT_LT(file_bytes(StorageType::float16), pools + 1000);
  EXPECT_GT(file_bytes(StorageType::float32), 2 * pools);
  EXPECT_LT(file_bytes(StorageType::int8), pools / 2 + 1000 + (6 * 2 * 5 + 6 * 2 * 4) * sizeof(float));
  for (const StorageType type : {StorageType::float16, StorageType::bfloat16, StorageType::int8}) {
    SCOPED_TRACE(storage_name(type));
    const ModelFile file = decode_model_file(encode_kv_cache_file(some_state(type)), "c.qkvc");
    ASSERT_NE(file.narrow_tensor("keys"), nullptr);
    EXPECT_EQ(file.narrow_tensor("keys")->type, type);
    EXPECT_EQ(file.narrow_tensor("values")->type, type);
  }
}

TEST(KvCacheFile, PagesFirstFilesReadToTheSameCache) {
  for (const StorageType type :
       {StorageType::float32, StorageType::float16, StorageType::bfloat16, StorageType::int8}) {
    for (const uint32_t version : {1U, 2U}) {
      SCOPED_TRACE(fmt::format("{}, format version {}", storage_name(type), version));
      const KvCacheState state = some_state(type);
      const std::string old = encode_model_file(pages_first_file(type, version));
      uint32_t written = 0;
      std::memcpy(&written, old.data() + 8, 4);
      EXPECT_EQ(written, type == StorageType::float32 ? 1U : version);
      const KvCacheState back = decode_kv_cache_file(old, "old.qkvc");
      EXPECT_EQ(back.k_pool, state.k_pool);
      EXPECT_EQ(back.v_pool, state.v_pool);
      EXPECT_EQ(back.k_scales, state.k_scales);
      EXPECT_EQ(back.v_scales, state.v_scales);
    }
  }
}

void expect_refused(StorageType type, const std::function<void(ModelFile&)>& spoil, const std::string& message) {
  ModelFile file = pages_first_file(type);
  spoil(file);
  try {
    decode_kv_cache_file(encode_model_file(file), "c.qkvc");
    FAIL() << "accepted; expected: " << message;
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what() << "\n expected: " << message;
  }
}

Tensor<float>& tensor(ModelFile& file, const std::string& name) {
  for (auto& [n, t] : file.tensors) {
    if (n == name) return t;
  }
  throw ValueError("no tensor " + name);
}

TEST(KvCacheFile, PoolsOfAnotherTypeOrShapeAreRefused) {
  ModelFile file = decode_model_file(encode_kv_cache_file(some_state(StorageType::float16)), "c.qkvc");
  file.set("type", "bfloat16");
  EXPECT_TRUE(testing::throws_naming<IoError>(
      [&] { decode_kv_cache_file(encode_model_file(file), "c.qkvc"); },
      {"c.qkvc", "tensor \"keys\"", "expected bfloat16 values (entry \"type\")", "got float16"}));
  file.set("type", "float16");
  file.narrow_tensors[1].second.shape = Shape{6, 2, 4, 3};
  EXPECT_TRUE(testing::throws_naming<IoError>(
      [&] { decode_kv_cache_file(encode_model_file(file), "c.qkvc"); },
      {"c.qkvc", "tensor \"values\"", "expected shape [2, 6, 4, 3]", "got [6, 2, 4, 3]"}));
  file.narrow_tensors.clear();
  EXPECT_TRUE(testing::throws_naming<IoError>([&] { decode_kv_cache_file(encode_model_file(file), "c.qkvc"); },
                                              {"c.qkvc", "\"keys\""}));
}

TEST(KvCacheFile, WhatTheCacheCannotHoldIsRefused) {
  expect_refused(
      StorageType::float16, [](ModelFile& f) { tensor(f, "k_pool")[7] = 0.1f; },
      "c.qkvc: tensor \"k_pool\": value 0.1 at flat index 7 is not a float16 value");
  expect_refused(
      StorageType::bfloat16, [](ModelFile& f) { tensor(f, "v_pool")[0] = 1.0f + 1.0f / 1024; },
      "is not a bfloat16 value");
  expect_refused(
      StorageType::int8, [](ModelFile& f) { tensor(f, "k_pool")[3] = 1.5f; }, "is not a int8 value");
  expect_refused(
      StorageType::int8, [](ModelFile& f) { tensor(f, "v_pool")[3] = 200.0f; }, "is not a int8 value");
  expect_refused(
      StorageType::int8,
      [](ModelFile& f) {
        tensor(f, "v_scales") = Tensor<float>(Shape{6, 2, 3});
      },
      "tensor \"v_scales\": expected shape [6, 2, 4], got [6, 2, 3]");
  expect_refused(
      StorageType::float32, [](ModelFile& f) { f.metadata.erase(f.metadata.begin() + 2); }, "no entry \"dk\"");
  expect_refused(
      StorageType::float32, [](ModelFile& f) { f.set("type", "int4"); }, "c.qkvc: entry type: expected float32");
  expect_refused(
      StorageType::float32, [](ModelFile& f) { f.set("free_pages", "1 x"); },
      "entry \"free_pages\": expected integers separated by spaces, got \"1 x\"");
  expect_refused(
      StorageType::float32, [](ModelFile& f) { f.set("pages", "7"); },
      "tensor \"k_pool\": expected shape [7, 2, 4, 5], got [6, 2, 4, 5]");
  expect_refused(
      StorageType::float32, [](ModelFile& f) { f.kind = "seq2seq"; }, "expected a kv_cache model");
  expect_refused(
      StorageType::float32, [](ModelFile& f) { f.set("sequence_lengths", f.value("sequence_lengths") + " 0"); },
      "expected a length of at least -1 (removed) and a list of pages for each of 4 sequences");
  expect_refused(
      StorageType::float32, [](ModelFile& f) { f.set("sequence_lengths", "3 -2 5"); }, "at least -1");
  expect_refused(
      StorageType::float32, [](ModelFile& f) { f.set("sequence_pages", f.value("sequence_pages") + ";7"); },
      "entry \"sequence_pages\": expected integers separated by spaces");
  expect_refused(
      StorageType::float32,
      [](ModelFile& f) {
        f.set("sequence_lengths", "");
        f.set("sequence_pages", "1");
      },
      "expected no pages for no sequence, got \"1\"");
}

}  // namespace
}  // namespace qkv
