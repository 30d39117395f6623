#pragma once
// A KvCache in a file that outlives one run of qkv decode: a model file (qkv/io/model_file.hpp,
// versioned and checksummed) of kind "kv_cache". Its entries are the shape (type, kv_heads, dk,
// dv, page_tokens, pages), the free pages and each sequence's length and pages; its tensors the
// pools as the values they hold, k_pool [pages, Hkv, page_tokens, Dk] and v_pool [..., Dv], and for
// int8 the scales, k_scales [pages, Hkv, Dk] and v_scales [pages, Hkv, page_tokens]. A model file
// holds float32 alone, so a float16 or bfloat16 pool takes twice its bytes there and an int8 one four
// times; reading converts every value back exactly, and refuses one the cache's type cannot hold.

#include <filesystem>
#include <string>

#include "qkv/ops/kv_cache.hpp"

namespace qkv::cli {

// The bytes of the file of `cache` (qkv decode writes them with its other outputs, all or none).
std::string encode_kv_cache_file(const KvCache& cache);

// The cache of the file; IoError naming the file and what is wrong when it is not one (the model
// file's checks, then the entries, the tensors' shapes and values, then KvCache::from_state's).
KvCache read_kv_cache_file(const std::filesystem::path& path);

}  // namespace qkv::cli
