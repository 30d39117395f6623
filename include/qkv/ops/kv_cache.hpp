#pragma once
// A KV cache for autoregressive decoding: the keys and values of any number of sequences, each
// growing token by token (or a block at a time), in fixed-size pages of a pool shared by all of
// them, with a table of pages per sequence (vLLM's paged layout: a sequence grows without moving
// what it holds, and a finished one gives its pages back). K and V are stored in any StorageType;
// attend() runs the fused kernel over a sequence's pages in place, converting a block of rows at a
// time as it reads them, with the split of the keys that decoding takes.
//
// Reading memory in pieces is slower than reading it in one stream, whatever the kernel does: on
// Zen 5, 64 KiB pieces 64 KiB apart read at 0.63× the pace of one stream, 16 KiB pieces at 0.47×.
// So the pools keep each head's pages together, and a sequence grows into the page after its last
// one when that page is free; a sequence that needs another page takes the start of the largest
// free run, or, when that run follows the last page of a sequence (which will want to grow into
// it), its middle. Sequences appended in turn then each lie in one run until they meet: one of two
// such sequences decoded at 0.61× the pace of a sequence alone (256-token pages) when pages were
// handed out in the order they were asked for. Once they meet, compact() puts each back in one run.
//
// int8 keys have one scale per channel and page (the step of each channel over the page's
// tokens, as KIVI argues for keys); a token whose channel exceeds its page's scale raises that
// scale at least twofold and requantises the page's earlier tokens of the channel, which costs
// O(page) and happens rarely once a page holds a few tokens. A key is then within one step of its
// page's last scale (less than 2·max|k|/127 over the page's channel), where a whole array
// quantised at once (quantize_int8) is within half a step. int8 values have one scale per token.

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/core/kv_cache_state.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv {

// What attend() adds to the queries' scores; the queries are the last Tq tokens of the sequence
// (bottom-right aligned, as decoding appends them).
struct KvAttendOptions {
  std::optional<double> scale = std::nullopt;  // 1/sqrt(Dk) when not given
  bool causal = true;                          // query i sees keys up to length − Tq + i
  std::optional<AttentionWindow> window = std::nullopt;
  std::optional<double> softcap = std::nullopt;
  std::optional<TensorView<const float>> sinks = std::nullopt;  // [H]
  // Broadcastable to [H, Tq, length]: nonzero = may attend, on top of causality and the window (a
  // tree of draft tokens verified in one step sees only its own branch).
  std::optional<TensorView<const uint8_t>> allowed = std::nullopt;
  // Broadcastable to [H, Tq, length]: added to the scaled (and softcapped) scores; −inf masks a key.
  std::optional<TensorView<const float>> bias = std::nullopt;
  // [H] ALiBi slopes (alibi_slopes(H) gives the standard ones): −slope_h·|i + length − Tq − j| is
  // added, the distance from query i's own position, as causality and the window measure it.
  std::optional<TensorView<const float>> alibi_slopes = std::nullopt;
};

class KvCache {
 public:
  explicit KvCache(const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }
  // A new, empty sequence: its id.
  int64_t add_sequence();
  // Gives the sequence's pages back to the pool; its id is not used again.
  void remove_sequence(int64_t id);
  int64_t length(int64_t id) const;
  int64_t free_pages() const { return free_count_; }
  // Ids handed out so far, removed sequences included.
  int64_t sequence_count() const { return static_cast<int64_t>(sequences_.size()); }

  // Appends n tokens to the sequence: k [Hkv, n, Dk] and v [Hkv, n, Dv], finite, stored in the
  // cache's type. They may be stored in any type (int8 with its scales, as attention takes them):
  // an operand of the cache's own float type is copied bit for bit, any other is stored from its
  // float32 values (rounded to the cache's type, or quantised to its int8 scales). Refused whole
  // (nothing appended) when the pool has too few free pages or an operand is not one the cache
  // takes.
  void append(int64_t id, const StoredView& k, const StoredView& v);
  void append(int64_t id, TensorView<const float> k, TensorView<const float> v) {
    append(id, StoredView::float32(k), StoredView::float32(v));
  }

  // The sequence's keys (values) as the kernels read them, float32 [Hkv, length, Dk (Dv)].
  Tensor<float> keys(int64_t id) const;
  Tensor<float> values(int64_t id) const;

  // Makes the pool `count` pages larger (count >= 0); what the sequences hold stays where it is.
  void add_pages(int64_t count);
  // Moves the pages so that each sequence's lie in one run, the sequences one after another in the
  // order of their ids and the free pages after them: sequences that grew into each other's way
  // read one stream again. Contents, lengths and ids are unchanged; an allocation failure (of one
  // page's worth of memory) leaves the cache as it was.
  void compact();

  // The cache as plain arrays, and the cache of such arrays: from_state checks everything a file
  // could get wrong (the shape, the arrays' sizes, every page in range and held exactly once, each
  // sequence's pages against its length, finite values and scales of at least 0) and throws
  // ValueError naming the field, what it expected and what it got.
  KvCacheState state() const;
  static KvCache from_state(KvCacheState state);

  // Attention of q [H, Tq, Dk] (H a multiple of Hkv) over the sequence: outputs.out [H, Tq, Dv]
  // and outputs.lse [H, Tq] when given; no weights.
  void attend(int64_t id, TensorView<const float> q, const AttentionOutputs<float>& outputs,
              const KvAttendOptions& options = {}) const;

 private:
  using Sequence = KvCacheSequence;
  // A cache whose arrays from_state moves in.
  struct Unallocated {};
  KvCache(const KvCacheShape& shape, Unallocated);
  const Sequence& sequence(int64_t id) const;
  int64_t head_elements(int64_t d) const { return shape_.page_tokens * d; }  // one head's rows in a page
  // A head's page among the pools' [Hkv][pages] blocks: its rows, its key scales (Dk) and its
  // value scales (page_tokens) are the block's.
  int64_t block_of(int64_t page, int64_t head) const { return head * shape_.pages + page; }
  // Element offset of a head's row in a page of a pool of rows of d elements.
  int64_t row_at(int64_t page, int64_t head, int64_t row, int64_t d) const {
    return block_of(page, head) * head_elements(d) + row * d;
  }
  // Row `at` (in elements) of a float32, float16 or bfloat16 pool: d values of x, converted.
  void store_float_row(PoolBytes& pool, int64_t at, const float* x, int64_t d) const;
  void store_key(int64_t page, int64_t head, int64_t row, const float* k);
  void store_value(int64_t page, int64_t head, int64_t row, const float* v);
  Tensor<float> read(int64_t id, bool keys) const;
  // The free page the sequence takes next (one must exist), and the free pages in order.
  int64_t next_page(const Sequence& s) const;
  std::vector<int64_t> free_list() const;

  KvCacheShape shape_;
  // Pools [Hkv][pages][page_tokens][D] of the storage type's elements (bytes), and for int8 the
  // scales: keys [Hkv][pages][Dk] (per channel and page), values [Hkv][pages][page_tokens].
  PoolBytes k_pool_, v_pool_;
  std::vector<float> k_scales_, v_scales_;
  std::vector<uint8_t> free_;  // [pages]: 1 where the page is free
  int64_t free_count_ = 0;
  std::vector<Sequence> sequences_;
};

}  // namespace qkv
