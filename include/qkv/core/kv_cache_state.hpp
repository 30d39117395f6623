#pragma once
// A paged KV cache as plain arrays (qkv/ops/kv_cache.hpp holds the cache itself): its shape, its
// pools of K and V in their storage type, its page tables. What a file of the cache holds
// (qkv/io/kv_cache_file.hpp), and what KvCache::from_state checks and makes a cache of.

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "qkv/core/memory.hpp"
#include "qkv/core/storage.hpp"

namespace qkv {

// Allocates on 64-byte boundaries, so that the rows of a pool whose rows are whole cache lines
// (d = 128 float16, 16 float32, …) start on one: a vector load split across two lines costs a
// streaming kernel about a fifth of its pace, and malloc puts large blocks 16 bytes past a page.
// Pools of 4 MiB or more are advised to take huge pages (advise_huge_pages), as decode streams them.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheLineAllocator() = default;
  template <class U>
  explicit CacheLineAllocator(const CacheLineAllocator<U>& /*other*/) {}
  T* allocate(size_t n) {
    T* p = static_cast<T*>(::operator new(n * sizeof(T), kAlignment));
    advise_huge_pages(p, n * sizeof(T));
    return p;
  }
  void deallocate(T* p, size_t /*n*/) { ::operator delete(p, kAlignment); }
  bool operator==(const CacheLineAllocator& /*other*/) const { return true; }
};

// A pool's elements, as bytes.
using PoolBytes = std::vector<uint8_t, CacheLineAllocator<uint8_t>>;

struct KvCacheShape {
  int64_t kv_heads = 1;  // Hkv
  int64_t dk = 0;        // key dim, ≥ 1
  int64_t dv = 0;        // value dim, ≥ 1
  StorageType type = StorageType::float16;
  int64_t page_tokens = 256;  // tokens per page, ≥ 1
  int64_t pages = 0;          // the pool: at most pages · page_tokens tokens over all sequences
};

// One sequence of a cache: its pages in order, and how many tokens it holds.
struct KvCacheSequence {
  std::vector<int64_t> pages;
  int64_t length = 0;
  bool live = true;  // false once removed (no pages, and its id is not used again)
};

// Everything a KvCache holds, as plain arrays: what a file of it stores (qkv/io/kv_cache_file.hpp).
struct KvCacheState {
  KvCacheShape shape;
  // [Hkv][pages][page_tokens][D] elements of the storage type, as bytes; for int8 the scales,
  // keys [Hkv][pages][Dk] and values [Hkv][pages][page_tokens] (empty for the other types).
  PoolBytes k_pool, v_pool;
  std::vector<float> k_scales, v_scales;
  std::vector<int64_t> free_pages;         // in any order
  std::vector<KvCacheSequence> sequences;  // by id
};

}  // namespace qkv
