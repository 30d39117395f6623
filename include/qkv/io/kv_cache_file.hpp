#pragma once
// A KV cache in a file (qkv decode --cache-file, qkv.KvCache.save): a model file
// (qkv/io/model_file.hpp, versioned and checksummed) of kind "kv_cache". Its entries are the shape
// (type, kv_heads, dk, dv, page_tokens, pages), the free pages, the sequences' lengths (-1 for a
// removed one) and their pages (lists separated by ';'), so that they stay few however many
// sequences there are;
// its tensors the pools as the values they hold, k_pool [pages, Hkv, page_tokens, Dk] and v_pool
// [..., Dv], and for int8 the scales, k_scales [pages, Hkv, Dk] and v_scales [pages, Hkv,
// page_tokens]. A model file holds float32 alone, so a float16 or bfloat16 pool takes twice its
// bytes there and an int8 one four times; reading converts every value back exactly, and refuses
// one the cache's type cannot hold. Whether the state makes a cache (pages held once, lengths that
// fit them) is KvCache::from_state's to check.

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
