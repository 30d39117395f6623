#pragma once
// A KV cache in a file (qkv decode --cache-file, qkv.KvCache.save): a model file
// (qkv/io/model_file.hpp, versioned and checksummed) of kind "kv_cache". Its entries are the shape
// (type, kv_heads, dk, dv, page_tokens, pages), the free pages, the sequences' lengths (-1 for a
// removed one) and their pages (lists separated by ';'), so that they stay few however many
// sequences there are;
// its tensors the pools in the cache's own type, keys [Hkv, pages, page_tokens, Dk] and values
// [..., Dv] (float16, bfloat16 and int8 as the model file's narrow tensors, so the file is the
// size of the cache in memory), and for int8 the scales, key_scales
// [Hkv, pages, Dk] and value_scales [Hkv, pages, page_tokens]. Files written before the pools kept
// each head's pages together hold k_pool, v_pool, k_scales and v_scales, pages first ([pages, Hkv,
// …]), and are read too. Pools written as float32 values, as files of format version 1 keep every
// type, are read as well: each value is converted back exactly, and one the cache's type cannot
// hold is refused. Whether the state makes a cache (pages held once, lengths that fit them) is
// KvCache::from_state's to check.

#include <filesystem>
#include <string>
#include <string_view>

#include "qkv/core/kv_cache_state.hpp"

namespace qkv {

// The bytes of the file of `state`.
std::string encode_kv_cache_file(const KvCacheState& state);

// The state in `bytes`; IoError naming `source` and what is wrong (the model file's checks, then
// the entries, the tensors' shapes and the values the type cannot hold).
KvCacheState decode_kv_cache_file(std::string_view bytes, std::string source);

// Writes through a temporary file and a rename; IoError naming the path.
void write_kv_cache_file(const std::filesystem::path& path, const KvCacheState& state);

// Reads and decodes the file; IoError naming the path.
KvCacheState read_kv_cache_file(const std::filesystem::path& path);

}  // namespace qkv
