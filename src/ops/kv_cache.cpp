#include "qkv/ops/kv_cache.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_problem.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"

namespace qkv {
namespace {

int8_t quantize(float x, float scale) {
  if (scale == 0.0f) return 0;
  return static_cast<int8_t>(std::clamp(std::nearbyint(x / scale), -127.0f, 127.0f));
}

// The sizes of a cache's arrays, each checked against overflow and against the memory there is.
struct PoolSizes {
  size_t k_pool = 0, v_pool = 0, k_scales = 0, v_scales = 0;  // bytes, bytes, floats, floats
};

int64_t checked_product(std::initializer_list<int64_t> factors, std::string_view what) {
  int64_t product = 1;
  for (const int64_t f : factors) {
    if (__builtin_mul_overflow(product, f, &product)) {
      throw ResourceError(fmt::format("{}: more elements than an int64 counts", what));
    }
  }
  return product;
}

PoolSizes pool_sizes(const KvCacheShape& shape) {
  const auto at_least_one = [](int64_t value, const char* name) {
    if (value < 1) throw ValueError(fmt::format("KvCacheShape.{}: expected at least 1, got {}", name, value));
  };
  at_least_one(shape.kv_heads, "kv_heads");
  at_least_one(shape.dk, "dk");
  at_least_one(shape.dv, "dv");
  at_least_one(shape.page_tokens, "page_tokens");
  at_least_one(shape.pages, "pages");
  const int64_t bytes = storage_bytes(shape.type);
  const auto pool = [&](int64_t d, std::string_view name) {
    return checked_product({shape.kv_heads, shape.pages, shape.page_tokens, d, bytes},
                           fmt::format("KvCacheShape: {} of {} pages", name, shape.pages));
  };
  PoolSizes sizes{.k_pool = static_cast<size_t>(pool(shape.dk, "the keys")),
                  .v_pool = static_cast<size_t>(pool(shape.dv, "the values"))};
  if (shape.type == StorageType::int8) {
    sizes.k_scales = static_cast<size_t>(checked_product({shape.kv_heads, shape.pages, shape.dk}, "KvCacheShape"));
    sizes.v_scales =
        static_cast<size_t>(checked_product({shape.kv_heads, shape.pages, shape.page_tokens}, "KvCacheShape"));
  }
  check_allocation_fits(static_cast<double>(sizes.k_pool) + static_cast<double>(sizes.v_pool) +
                            4.0 * static_cast<double>(sizes.k_scales + sizes.v_scales),
                        "the KV cache's pages");
  return sizes;
}

// A pool [heads][pages][…] just grown to more pages, whose heads' first `old_head` elements still
// lie where the fewer pages put them: moves each head to its place, the last head first so that
// none is overwritten before it moves, and zeroes the pages it gains.
template <class Vector>
void spread_heads(Vector& pool, int64_t heads, size_t old_head) {
  using T = typename Vector::value_type;
  if (pool.empty()) return;
  const size_t head = pool.size() / static_cast<size_t>(heads);
  for (size_t h = static_cast<size_t>(heads); h-- > 0;) {
    std::memmove(pool.data() + h * head, pool.data() + h * old_head, old_head * sizeof(T));
    std::fill(pool.begin() + static_cast<ptrdiff_t>(h * head + old_head),
              pool.begin() + static_cast<ptrdiff_t>((h + 1) * head), T{0});
  }
}

// Moves page p of every head of a pool [heads][pages][block] to page dest[p] (dest a permutation of
// the pages) in place: each cycle of the permutation is followed with one block set aside (in
// `aside`, at least a block long), so the move needs a block more memory, not a second pool.
// `moved` has an element per page.
template <class Vector, class Aside>
void permute_pages(Vector& pool, int64_t heads, const std::vector<int64_t>& dest, Aside& aside,
                   std::vector<uint8_t>& moved) {
  const size_t pages = dest.size();
  if (pool.empty() || pages == 0) return;
  const size_t block = pool.size() / static_cast<size_t>(heads) / pages;
  const auto aside_end = aside.begin() + static_cast<ptrdiff_t>(block);
  for (size_t h = 0; h < static_cast<size_t>(heads); ++h) {
    const auto at = [&](size_t page) { return pool.begin() + static_cast<ptrdiff_t>((h * pages + page) * block); };
    std::fill(moved.begin(), moved.end(), 0);
    for (size_t start = 0; start < pages; ++start) {
      if (moved[start] != 0 || static_cast<size_t>(dest[start]) == start) continue;
      std::copy(at(start), at(start) + static_cast<ptrdiff_t>(block), aside.begin());
      size_t page = start;
      do {
        page = static_cast<size_t>(dest[page]);
        std::swap_ranges(aside.begin(), aside_end, at(page));
        moved[page] = 1;
      } while (page != start);
    }
  }
}

}  // namespace

KvCache::KvCache(const KvCacheShape& shape) : shape_(shape) {
  const PoolSizes sizes = pool_sizes(shape);
  k_pool_.resize(sizes.k_pool);
  v_pool_.resize(sizes.v_pool);
  k_scales_.resize(sizes.k_scales);
  v_scales_.resize(sizes.v_scales);
  free_.assign(static_cast<size_t>(shape.pages), 1);
  free_count_ = shape.pages;
}

int64_t KvCache::add_sequence() {
  sequences_.push_back({});
  return static_cast<int64_t>(sequences_.size()) - 1;
}

const KvCache::Sequence& KvCache::sequence(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(sequences_.size()) || !sequences_[static_cast<size_t>(id)].live) {
    throw ValueError(fmt::format("sequence: no sequence {} in the cache (ids 0 to {}, removed ones excepted)", id,
                                 static_cast<int64_t>(sequences_.size()) - 1));
  }
  return sequences_[static_cast<size_t>(id)];
}

void KvCache::remove_sequence(int64_t id) {
  sequence(id);
  Sequence& s = sequences_[static_cast<size_t>(id)];
  for (const int64_t page : s.pages) free_[static_cast<size_t>(page)] = 1;
  free_count_ += static_cast<int64_t>(s.pages.size());
  s = {.pages = {}, .length = 0, .live = false};
}

int64_t KvCache::length(int64_t id) const { return sequence(id).length; }

void KvCache::store_float_row(PoolBytes& pool, int64_t at, const float* x, int64_t d) const {
  if (shape_.type == StorageType::float32) {
    std::memcpy(pool.data() + at * 4, x, static_cast<size_t>(d) * 4);
    return;
  }
  auto* bits = reinterpret_cast<uint16_t*>(pool.data()) + at;
  for (int64_t c = 0; c < d; ++c) {
    bits[c] = shape_.type == StorageType::float16 ? float16_from_float(x[c]) : bfloat16_from_float(x[c]);
  }
}

void KvCache::store_key(int64_t page, int64_t head, int64_t row, const float* k) {
  const int64_t dk = shape_.dk;
  const int64_t first = row_at(page, head, 0, dk);
  const int64_t at = first + row * dk;
  if (shape_.type != StorageType::int8) {
    store_float_row(k_pool_, at, k, dk);
    return;
  }
  auto* q = reinterpret_cast<int8_t*>(k_pool_.data());
  float* scale = k_scales_.data() + block_of(page, head) * dk;
  for (int64_t c = 0; c < dk; ++c) {
    const float magnitude = std::abs(k[c]);
    if (magnitude > scale[c] * 127.0f) {
      // The channel's step grows, at least twofold, and its earlier tokens in this page are
      // stored again on the new one: each time with an error of up to half the new step, so
      // that, the steps at least doubling, all of them add up to less than the last step.
      const float wider = std::max(magnitude / 127.0f, 2.0f * scale[c]);
      for (int64_t r = 0; r < row; ++r) {
        int8_t& earlier = q[first + r * dk + c];
        earlier = quantize(static_cast<float>(earlier) * scale[c], wider);
      }
      scale[c] = wider;
    }
    q[at + c] = quantize(k[c], scale[c]);
  }
}

void KvCache::store_value(int64_t page, int64_t head, int64_t row, const float* v) {
  const int64_t dv = shape_.dv;
  const int64_t at = row_at(page, head, row, dv);
  if (shape_.type != StorageType::int8) {
    store_float_row(v_pool_, at, v, dv);
    return;
  }
  float magnitude = 0.0f;
  for (int64_t c = 0; c < dv; ++c) magnitude = std::max(magnitude, std::abs(v[c]));
  const float scale = magnitude > 0.0f ? magnitude / 127.0f : 1.0f;
  v_scales_[static_cast<size_t>(block_of(page, head) * shape_.page_tokens + row)] = scale;
  auto* q = reinterpret_cast<int8_t*>(v_pool_.data()) + at;
  for (int64_t c = 0; c < dv; ++c) q[c] = quantize(v[c], scale);
}

void KvCache::add_pages(int64_t count) {
  if (count < 0) throw ValueError(fmt::format("count: expected at least 0 pages, got {}", count));
  int64_t pages = 0;
  if (__builtin_add_overflow(shape_.pages, count, &pages)) {
    throw ResourceError(fmt::format("count: {} pages more than {} is more than an int64 counts", count, shape_.pages));
  }
  KvCacheShape grown = shape_;
  grown.pages = pages;
  const PoolSizes sizes = pool_sizes(grown);
  // All four grow or none: a pool left longer than the others would make a state from_state refuses.
  const PoolSizes before{k_pool_.size(), v_pool_.size(), k_scales_.size(), v_scales_.size()};
  try {
    k_pool_.resize(sizes.k_pool);
    v_pool_.resize(sizes.v_pool);
    k_scales_.resize(sizes.k_scales);
    v_scales_.resize(sizes.v_scales);
  } catch (...) {
    k_pool_.resize(before.k_pool);
    v_pool_.resize(before.v_pool);
    k_scales_.resize(before.k_scales);
    v_scales_.resize(before.v_scales);
    throw;
  }
  const int64_t heads = shape_.kv_heads;
  spread_heads(k_pool_, heads, before.k_pool / static_cast<size_t>(heads));
  spread_heads(v_pool_, heads, before.v_pool / static_cast<size_t>(heads));
  spread_heads(k_scales_, heads, before.k_scales / static_cast<size_t>(heads));
  spread_heads(v_scales_, heads, before.v_scales / static_cast<size_t>(heads));
  free_.resize(static_cast<size_t>(pages), 1);
  free_count_ += count;
  shape_.pages = pages;
}

void KvCache::compact() {
  const auto pages = static_cast<size_t>(shape_.pages);
  if (pages == 0) return;
  std::vector<int64_t> dest(pages, -1);
  int64_t next = 0;
  for (const Sequence& s : sequences_) {
    for (const int64_t page : s.pages) dest[static_cast<size_t>(page)] = next++;
  }
  // The free pages keep their order after the held ones.
  for (size_t page = 0; page < pages; ++page) {
    if (dest[page] < 0) dest[page] = next++;
  }
  // Everything the moves need is allocated before the first moves.
  const auto per_block = [&](size_t size) { return size / static_cast<size_t>(shape_.kv_heads) / pages; };
  PoolBytes row_aside(std::max(per_block(k_pool_.size()), per_block(v_pool_.size())));
  std::vector<float> scale_aside(std::max(per_block(k_scales_.size()), per_block(v_scales_.size())));
  std::vector<uint8_t> moved(pages);
  const int64_t heads = shape_.kv_heads;
  permute_pages(k_pool_, heads, dest, row_aside, moved);
  permute_pages(v_pool_, heads, dest, row_aside, moved);
  permute_pages(k_scales_, heads, dest, scale_aside, moved);
  permute_pages(v_scales_, heads, dest, scale_aside, moved);
  for (Sequence& s : sequences_) {
    for (int64_t& page : s.pages) page = dest[static_cast<size_t>(page)];
  }
  const int64_t held = shape_.pages - free_count_;
  std::fill(free_.begin(), free_.begin() + static_cast<ptrdiff_t>(held), 0);
  std::fill(free_.begin() + static_cast<ptrdiff_t>(held), free_.end(), 1);
}

KvCache::KvCache(const KvCacheShape& shape, Unallocated) : shape_(shape) {}

std::vector<int64_t> KvCache::free_list() const {
  std::vector<int64_t> pages;
  for (size_t page = 0; page < free_.size(); ++page) {
    if (free_[page] != 0) pages.push_back(static_cast<int64_t>(page));
  }
  return pages;
}

int64_t KvCache::next_page(const Sequence& s) const {
  const auto pages = static_cast<size_t>(shape_.pages);
  if (!s.pages.empty()) {
    const auto after = static_cast<size_t>(s.pages.back()) + 1;
    if (after < pages && free_[after] != 0) return static_cast<int64_t>(after);
  }
  // The pages where other sequences would grow next.
  std::vector<uint8_t> wanted(pages, 0);
  for (const Sequence& other : sequences_) {
    if (!other.pages.empty() && static_cast<size_t>(other.pages.back()) + 1 < pages) {
      wanted[static_cast<size_t>(other.pages.back()) + 1] = 1;
    }
  }
  size_t best = pages, best_room = 0;
  for (size_t start = 0; start < pages;) {
    if (free_[start] == 0) {
      ++start;
      continue;
    }
    size_t end = start;
    while (end < pages && free_[end] != 0) ++end;
    const size_t first = wanted[start] != 0 ? start + (end - start) / 2 : start;
    if (end - first > best_room) {
      best = first;
      best_room = end - first;
    }
    start = end;
  }
  return static_cast<int64_t>(best);
}

KvCacheState KvCache::state() const {
  return {.shape = shape_,
          .k_pool = k_pool_,
          .v_pool = v_pool_,
          .k_scales = k_scales_,
          .v_scales = v_scales_,
          .free_pages = free_list(),
          .sequences = sequences_};
}

namespace {

void expect_size(std::string_view field, size_t size, size_t expected, std::string_view meaning) {
  if (size != expected) {
    throw ValueError(fmt::format("{}: expected {} ({}), got {}", field, expected, meaning, size));
  }
}

}  // namespace

KvCache KvCache::from_state(KvCacheState state) {
  // The sizes are checked before anything is allocated, so that a state cannot ask for more.
  const KvCacheShape& sh = state.shape;
  const PoolSizes sizes = pool_sizes(sh);
  const auto bytes = static_cast<size_t>(storage_bytes(sh.type));
  const std::string type(storage_name(sh.type));
  expect_size("k_pool", state.k_pool.size(), sizes.k_pool,
              fmt::format("bytes of [Hkv, pages, page_tokens, Dk] {}", type));
  expect_size("v_pool", state.v_pool.size(), sizes.v_pool,
              fmt::format("bytes of [Hkv, pages, page_tokens, Dv] {}", type));
  expect_size("k_scales", state.k_scales.size(), sizes.k_scales, "[Hkv, pages, Dk] for int8, else none");
  expect_size("v_scales", state.v_scales.size(), sizes.v_scales, "[Hkv, pages, page_tokens] for int8, else none");
  std::vector<uint8_t> held(static_cast<size_t>(sh.pages), 0);
  const auto hold = [&](int64_t page, std::string_view where) {
    if (page < 0 || page >= sh.pages) {
      throw ValueError(fmt::format("{}: expected pages 0 to {}, got page {}", where, sh.pages - 1, page));
    }
    if (held[static_cast<size_t>(page)]++ != 0) {
      throw ValueError(fmt::format("{}: page {} is held twice (by a sequence or the free list)", where, page));
    }
  };
  for (const int64_t page : state.free_pages) hold(page, "free_pages");
  for (size_t id = 0; id < state.sequences.size(); ++id) {
    const KvCacheSequence& s = state.sequences[id];
    const std::string where = fmt::format("sequences[{}]", id);
    const int64_t pages = s.live && s.length > 0 ? s.length / sh.page_tokens + (s.length % sh.page_tokens != 0) : 0;
    if (s.length < 0 || (!s.live && s.length != 0) || static_cast<int64_t>(s.pages.size()) != pages) {
      throw ValueError(fmt::format("{}: expected {} pages for {} tokens of {} per page{}, got {} pages", where, pages,
                                   s.length, sh.page_tokens, s.live ? "" : " (removed)", s.pages.size()));
    }
    for (const int64_t page : s.pages) hold(page, where);
  }
  const auto unheld = std::find(held.begin(), held.end(), 0);
  if (unheld != held.end()) {
    throw ValueError(fmt::format("free_pages: page {} is held by no sequence and is not free", unheld - held.begin()));
  }
  if (sh.type == StorageType::int8) {
    for (const auto& [field, scales] :
         {std::pair{"k_scales", &state.k_scales}, std::pair{"v_scales", &state.v_scales}}) {
      const auto bad =
          std::find_if(scales->begin(), scales->end(), [](float x) { return !(x >= 0.0f) || std::isinf(x); });
      if (bad != scales->end()) {
        throw ValueError(
            fmt::format("{}: expected finite scales of at least 0, got {} at {}", field, *bad, bad - scales->begin()));
      }
    }
  } else {
    for (const auto& [field, pool, d] :
         {std::tuple{"k_pool", &state.k_pool, sh.dk}, std::tuple{"v_pool", &state.v_pool, sh.dv}}) {
      const int64_t rows = static_cast<int64_t>(pool->size() / bytes) / d;
      const Shape shape{rows, d};
      const TensorView<const uint16_t> bits{reinterpret_cast<const uint16_t*>(pool->data()), shape,
                                            contiguous_strides(shape)};
      check_finite(sh.type == StorageType::float32 ? StoredView::float32({reinterpret_cast<const float*>(pool->data()),
                                                                          shape, contiguous_strides(shape)})
                   : sh.type == StorageType::float16 ? StoredView::float16(bits)
                                                     : StoredView::bfloat16(bits),
                   field);
    }
  }
  KvCache cache(sh, Unallocated{});
  cache.k_pool_ = std::move(state.k_pool);
  cache.v_pool_ = std::move(state.v_pool);
  cache.k_scales_ = std::move(state.k_scales);
  cache.v_scales_ = std::move(state.v_scales);
  cache.free_.assign(static_cast<size_t>(sh.pages), 0);
  for (const int64_t page : state.free_pages) cache.free_[static_cast<size_t>(page)] = 1;
  cache.free_count_ = static_cast<int64_t>(state.free_pages.size());
  cache.sequences_ = std::move(state.sequences);
  return cache;
}

namespace {

// Row (h, t) of a [Hkv, n, D] stored operand as float32 values, int8 ones by their scales broadcast.
void float_row(const StoredView& x, const std::optional<TensorView<const float>>& scales, int64_t h, int64_t t,
               float* row) {
  const int64_t d = x.shape[2];
  const int64_t at = h * x.strides[0] + t * x.strides[1], step = x.strides[2];
  for (int64_t c = 0; c < d; ++c) {
    row[c] = stored_value(x.type, x.data, at + c * step, scales ? (*scales)(h, t, c) : 1.0f);
  }
}

// Row (h, t) of a [Hkv, n, D] operand of `bytes`-byte elements, copied to `out`.
void copy_row(const StoredView& x, int64_t bytes, int64_t h, int64_t t, uint8_t* out) {
  const int64_t d = x.shape[2];
  const auto* first = static_cast<const uint8_t*>(x.data) + (h * x.strides[0] + t * x.strides[1]) * bytes;
  if (x.strides[2] == 1) {
    std::memcpy(out, first, static_cast<size_t>(d * bytes));
    return;
  }
  for (int64_t c = 0; c < d; ++c) {
    std::memcpy(out + c * bytes, first + c * x.strides[2] * bytes, static_cast<size_t>(bytes));
  }
}

// Refuses the first value of a [Hkv, n, D] operand that a cache of `type` cannot hold: one that
// rounds past float16's or bfloat16's largest value for such a cache, or an int8 value that its
// scale takes past float32's. Such a value would be stored as an infinity, which attention and a
// saved cache's file both refuse.
void check_representable(const StoredView& x, const std::optional<TensorView<const float>>& scales, StorageType type,
                         std::string_view name) {
  const bool narrowing = (type == StorageType::float16 && x.type != StorageType::float16) ||
                         (type == StorageType::bfloat16 && x.type == StorageType::float32);
  if (!narrowing && x.type != StorageType::int8) return;
  const float limit = rounding_overflow_limit(type);
  std::vector<float> row(static_cast<size_t>(x.shape[2]));
  for (int64_t h = 0; h < x.shape[0]; ++h) {
    for (int64_t t = 0; t < x.shape[1]; ++t) {
      float_row(x, scales, h, t, row.data());
      for (int64_t c = 0; c < x.shape[2]; ++c) {
        const float value = row[static_cast<size_t>(c)];
        if (!(std::abs(value) < limit)) {
          throw ValueError(fmt::format("{}: expected values that a {} cache holds (finite{}), got {} at [{}, {}, {}]",
                                       name, storage_name(type), type == StorageType::float16 ? ", |x| < 65520" : "",
                                       value, h, t, c));
        }
      }
    }
  }
}

}  // namespace

void KvCache::append(int64_t id, const StoredView& k, const StoredView& v) {
  sequence(id);
  Sequence& s = sequences_[static_cast<size_t>(id)];
  if (k.rank() != 3) {
    throw ShapeError(
        fmt::format("k: expected [Hkv, n, Dk] = [{}, n, {}], got shape {}", shape_.kv_heads, shape_.dk, k.shape.str()));
  }
  const int64_t n = k.shape[1];
  check_shape("k", k.shape, Shape{shape_.kv_heads, n, shape_.dk});
  check_shape("v", v.shape, Shape{shape_.kv_heads, n, shape_.dv});
  const auto k_scales = detail::checked_stored_scales(k, "k", true);
  const auto v_scales = detail::checked_stored_scales(v, "v", true);
  check_finite(k, "k");
  check_finite(v, "v");
  check_representable(k, k_scales, shape_.type, "k");
  check_representable(v, v_scales, shape_.type, "v");
  const int64_t pages_needed = (s.length + n + shape_.page_tokens - 1) / shape_.page_tokens;
  const int64_t more = pages_needed - static_cast<int64_t>(s.pages.size());
  if (more > free_pages()) {
    throw ResourceError(
        fmt::format("k: appending {} tokens to sequence {} (length {}) needs {} more pages of {} tokens, but the "
                    "cache has {} of its {} free",
                    n, id, s.length, more, shape_.page_tokens, free_pages(), shape_.pages));
  }
  std::vector<float> row(static_cast<size_t>(std::max(shape_.dk, shape_.dv)));
  const size_t held = s.pages.size();
  try {
    for (int64_t p = 0; p < more; ++p) {
      const int64_t page = next_page(s);
      s.pages.push_back(page);
      free_[static_cast<size_t>(page)] = 0;
      --free_count_;
    }
  } catch (...) {
    // Choosing a page allocates: a failure gives back the pages taken so far.
    for (size_t i = held; i < s.pages.size(); ++i) free_[static_cast<size_t>(s.pages[i])] = 1;
    free_count_ += static_cast<int64_t>(s.pages.size() - held);
    s.pages.resize(held);
    throw;
  }
  if (shape_.type == StorageType::int8) {
    for (size_t i = held; i < s.pages.size(); ++i) {
      for (int64_t h = 0; h < shape_.kv_heads; ++h) {
        const auto first = k_scales_.begin() + block_of(s.pages[i], h) * shape_.dk;
        std::fill(first, first + shape_.dk, 0.0f);
      }
    }
  }
  const int64_t bytes = storage_bytes(shape_.type);
  const bool copy_k = k.type == shape_.type && shape_.type != StorageType::int8;
  const bool copy_v = v.type == shape_.type && shape_.type != StorageType::int8;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t token = s.length + t;
    const int64_t page = s.pages[static_cast<size_t>(token / shape_.page_tokens)];
    const int64_t slot = token % shape_.page_tokens;
    for (int64_t h = 0; h < shape_.kv_heads; ++h) {
      if (copy_k) {
        copy_row(k, bytes, h, t, k_pool_.data() + row_at(page, h, slot, shape_.dk) * bytes);
      } else {
        float_row(k, k_scales, h, t, row.data());
        store_key(page, h, slot, row.data());
      }
      if (copy_v) {
        copy_row(v, bytes, h, t, v_pool_.data() + row_at(page, h, slot, shape_.dv) * bytes);
      } else {
        float_row(v, v_scales, h, t, row.data());
        store_value(page, h, slot, row.data());
      }
    }
  }
  s.length += n;
}

Tensor<float> KvCache::read(int64_t id, bool keys) const {
  const Sequence& s = sequence(id);
  const int64_t d = keys ? shape_.dk : shape_.dv;
  const PoolBytes& pool = keys ? k_pool_ : v_pool_;
  Tensor<float> out({shape_.kv_heads, s.length, d});
  for (int64_t h = 0; h < shape_.kv_heads; ++h) {
    for (int64_t t = 0; t < s.length; ++t) {
      const int64_t page = s.pages[static_cast<size_t>(t / shape_.page_tokens)];
      const int64_t slot = t % shape_.page_tokens;
      const int64_t at = row_at(page, h, slot, d);
      for (int64_t c = 0; c < d; ++c) {
        float scale = 1.0f;
        if (shape_.type == StorageType::int8) {
          scale = keys ? k_scales_[static_cast<size_t>(block_of(page, h) * d + c)]
                       : v_scales_[static_cast<size_t>(block_of(page, h) * shape_.page_tokens + slot)];
        }
        out.view()(h, t, c) = stored_value(shape_.type, pool.data(), at + c, scale);
      }
    }
  }
  return out;
}

Tensor<float> KvCache::keys(int64_t id) const { return read(id, true); }
Tensor<float> KvCache::values(int64_t id) const { return read(id, false); }

void KvCache::attend(int64_t id, TensorView<const float> q, const AttentionOutputs<float>& outputs,
                     const KvAttendOptions& options) const {
  const Sequence& s = sequence(id);
  if (q.rank() != 3) {
    throw ShapeError(fmt::format("q: expected [H, Tq, Dk] with Dk = {}, got shape {}", shape_.dk, q.shape.str()));
  }
  const int64_t hkv = shape_.kv_heads, page = shape_.page_tokens;
  // Attention's own check would name k, which this call has none of.
  if (q.shape[0] % hkv != 0) {
    throw ShapeError(
        fmt::format("q: expected H a multiple of the cache's {} kv heads, got shape {}", hkv, q.shape.str()));
  }
  // Checked here so that a mask's message gives the cache's [H, Tq, length], not attention's
  // [B, H, Tq, Tk]; the names are attention's own.
  const Shape scores{q.shape[0], q.shape[1], s.length};
  if (options.allowed) broadcast_to(*options.allowed, scores, "mask");
  if (options.bias) broadcast_to(*options.bias, scores, "bias");
  // K and V's shapes, for the problem's checks; the kernel reads the pages.
  const Shape k_shape{hkv, s.length, shape_.dk}, v_shape{hkv, s.length, shape_.dv};
  AttentionParams<float> params{.q = q,
                                .k = {nullptr, k_shape, contiguous_strides(k_shape)},
                                .v = {nullptr, v_shape, contiguous_strides(v_shape)},
                                .scale = options.scale,
                                .mask = {.causal = options.causal,
                                         .window = options.window,
                                         .allowed = options.allowed,
                                         .bias = options.bias,
                                         .alibi_slopes = options.alibi_slopes},
                                .softcap = options.softcap,
                                .sinks = options.sinks};
  const detail::AttentionProblem<float> problem = detail::make_attention_problem(params);
  if (outputs.weights)
    throw ValueError("weights: a KV cache's attention runs the fused kernel, which gives no weights");
  const auto operand = [&](const PoolBytes& pool, int64_t d, const std::vector<float>& scales, bool per_channel) {
    detail::StoredOperand o{.type = shape_.type,
                            .data = pool.data(),
                            .strides = {0, shape_.pages * page * d, d, 1},
                            .scales = std::nullopt,
                            .pages = s.pages.data(),
                            .page_tokens = page,
                            .page_stride = page * d,
                            .scale_page_stride = 0};
    if (shape_.type == StorageType::int8) {
      // Keys: one scale per channel of a page's head; values: one per token.
      o.scales = TensorView<const float>{
          scales.data(), Shape{1, hkv, page, d},
          per_channel ? Strides{0, shape_.pages * d, 0, 1} : Strides{0, shape_.pages * page, 1, 0}};
      o.scale_page_stride = per_channel ? d : page;
    }
    return o;
  };
  const detail::StoredOperands stored{.q = {.type = StorageType::float32},
                                      .k = operand(k_pool_, shape_.dk, k_scales_, true),
                                      .v = operand(v_pool_, shape_.dv, v_scales_, false)};
  detail::forward_fused_stored(problem, stored, outputs);
}

}  // namespace qkv
