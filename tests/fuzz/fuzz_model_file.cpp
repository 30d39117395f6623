// libFuzzer target: the model-file reader on arbitrary bytes, as they come and with the trailing
// CRC-32 rewritten to match them: a mutated file almost never keeps a valid checksum, and without
// the second call the fuzzer would explore little past the checksum test. Each input is read as a
// KV cache file too (a model file of kind kv_cache), whose entries and tensors make a cache's state,
// which KvCache::from_state then checks.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "qkv/core/error.hpp"
#include "qkv/io/kv_cache_file.hpp"
#include "qkv/io/model_file.hpp"
#include "qkv/ops/kv_cache.hpp"

namespace {

void decode(std::string_view bytes) {
  try {
    qkv::decode_model_file(bytes, "fuzz.qkvm");
  } catch (const qkv::Error&) {
  }
  try {
    qkv::KvCache::from_state(qkv::decode_kv_cache_file(bytes, "fuzz.qkvc"));
  } catch (const qkv::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  decode(bytes);
  if (size >= 4) {
    std::string fixed(bytes);
    const uint32_t crc = qkv::crc32(bytes.substr(0, size - 4));
    for (int i = 0; i < 4; ++i) fixed[size - 4 + static_cast<size_t>(i)] = static_cast<char>((crc >> (8 * i)) & 0xff);
    decode(fixed);
  }
  return 0;
}
