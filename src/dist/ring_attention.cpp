// Ring attention over MPI (qkv/dist/ring_attention.hpp): the shards' layout, the agreement on
// errors, the forward's merge by log-sum-exp and the backward's travelling gradients. Every block
// of a query shard against a key shard is one call of the fused kernel; this file only moves
// shards, slices views and merges.

#include "qkv/dist/ring_attention.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "qkv/core/error.hpp"

namespace qkv::dist {

std::vector<TokenRange> shard_ranges(int64_t tokens, int ranks, int rank, ShardLayout layout) {
  if (tokens < 0) throw ValueError(fmt::format("tokens: expected at least 0, got {}", tokens));
  if (ranks < 1) throw ValueError(fmt::format("ranks: expected at least 1, got {}", ranks));
  if (rank < 0 || rank >= ranks) throw ValueError(fmt::format("rank: expected 0 to {}, got {}", ranks - 1, rank));
  const auto chunk = [tokens](int64_t c, int64_t chunks) {
    const int64_t start = c * tokens / chunks;
    return TokenRange{start, (c + 1) * tokens / chunks - start};
  };
  if (layout == ShardLayout::contiguous) return {chunk(rank, ranks)};
  return {chunk(rank, 2 * int64_t{ranks}), chunk(2 * int64_t{ranks} - 1 - rank, 2 * int64_t{ranks})};
}

int64_t shard_length(int64_t tokens, int ranks, int rank, ShardLayout layout) {
  int64_t length = 0;
  for (const TokenRange& r : shard_ranges(tokens, ranks, rank, layout)) length += r.length;
  return length;
}

namespace {

// Rows [start, start + length) of a view along `axis`.
template <class T>
TensorView<T> slice(TensorView<T> view, int axis, int64_t start, int64_t length) {
  view.data += start * view.strides[axis];
  view.shape[axis] = length;
  return view;
}

}  // namespace

Tensor<float> take_shard(TensorView<const float> whole, const std::vector<TokenRange>& ranges) {
  const TensorView<const float> w = as_bhtd(whole, "whole");
  int64_t length = 0;
  for (const TokenRange& r : ranges) {
    if (r.start < 0 || r.length < 0 || r.start + r.length > w.shape[2]) {
      throw ShapeError(fmt::format("ranges: tokens [{}, {}) lie outside the {} of whole, of shape {}", r.start,
                                   r.start + r.length, w.shape[2], whole.shape.str()));
    }
    length += r.length;
  }
  Shape shape = whole.shape;
  shape[shape.rank() - 2] = length;
  Tensor<float> shard(shape);
  float* dst = shard.data();
  for (int64_t b = 0; b < w.shape[0]; ++b)
    for (int64_t h = 0; h < w.shape[1]; ++h)
      for (const TokenRange& r : ranges)
        for (int64_t t = r.start; t < r.start + r.length; ++t, dst += w.shape[3])
          std::memcpy(dst, &w(b, h, t, 0), static_cast<size_t>(w.shape[3]) * sizeof(float));
  return shard;
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

struct Comm {
  MPI_Comm comm;
  int rank = 0;
  int size = 1;

  explicit Comm(MPI_Comm c) : comm(c) {
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
  }
  int next() const { return (rank + 1) % size; }
  int prev() const { return (rank + size - 1) % size; }
  // The rank whose shard of keys and values this one holds at step s.
  int origin(int step) const { return (rank + size - step % size) % size; }
};

}  // namespace

void all_or_none(MPI_Comm comm, const std::function<void()>& check) {
  const Comm c(comm);
  enum Kind : int { ok, shape, value, resource, io, other };
  int kind = ok;
  std::string message;
  try {
    check();
  } catch (const ShapeError& e) {
    kind = shape, message = e.what();
  } catch (const ValueError& e) {
    kind = value, message = e.what();
  } catch (const ResourceError& e) {
    kind = resource, message = e.what();
  } catch (const IoError& e) {
    kind = io, message = e.what();
  } catch (const std::exception& e) {
    kind = other, message = e.what();
  }
  const int mine = kind == ok ? INT_MAX : c.rank;
  int first = INT_MAX;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, c.comm);
  if (first == INT_MAX) return;
  int header[2] = {kind, static_cast<int>(message.size())};
  MPI_Bcast(header, 2, MPI_INT, first, c.comm);
  message.resize(static_cast<size_t>(header[1]));
  MPI_Bcast(message.data(), header[1], MPI_CHAR, first, c.comm);
  const std::string text = fmt::format("rank {}: {}", first, message);
  switch (header[0]) {
    case shape:
      throw ShapeError(text);
    case value:
      throw ValueError(text);
    case resource:
      throw ResourceError(text);
    case io:
      throw IoError(text);
    default:
      throw Error(text);
  }
}

namespace {

// Past the agreement every rank is inside the ring: an error on one would leave its neighbours
// blocked in MPI_Wait for good, so it ends the job instead.
template <class F>
void or_abort(const Comm& c, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    fmt::print(stderr, "qkv ring attention, rank {}: {}; aborting the job\n", c.rank, e.what());
    MPI_Abort(c.comm, 2);
  }
}

// One call, checked and seen as [B, H, T, D], with the whole sequence's band of visible keys.
struct Ring {
  const AttentionParams<float>* params;
  RingShards shards;
  TensorView<const float> q, k, v;                   // this rank's shards, [B, H, tq_r, Dk] and [B, Hkv, tk_r, D]
  std::optional<TensorView<const uint8_t>> allowed;  // [B, H, tq_r, Tk]
  std::vector<TokenRange> q_ranges;
  int64_t diagonal = 0;  // the whole sequence's o
  int64_t band_lo = std::numeric_limits<int64_t>::min(), band_hi = std::numeric_limits<int64_t>::max();

  int64_t batch() const { return q.shape[0]; }
  int64_t heads() const { return q.shape[1]; }
  int64_t kv_heads() const { return k.shape[1]; }
  int64_t dk() const { return k.shape[3]; }
  int64_t dv() const { return v.shape[3]; }
  int64_t tq_r() const { return q.shape[2]; }
  // Floats of one token of a packed K/V shard (or of its gradients): Hkv·(Dk + Dv) per batch.
  int64_t token_floats() const { return batch() * kv_heads() * (dk() + dv()); }

  // Whether any query of `qr` may see any key of `kr` under the band (the allowed mask aside).
  bool may_see(const TokenRange& qr, const TokenRange& kr) const {
    if (qr.length == 0 || kr.length == 0) return false;
    const int64_t lowest = kr.start - (qr.start + qr.length - 1), highest = kr.start + kr.length - 1 - qr.start;
    return highest >= band_lo && lowest <= band_hi;
  }
};

Ring make_ring(const AttentionParams<float>& params, const RingShards& shards, const Comm& c) {
  const AttentionMask<float>& mask = params.mask;
  if (mask.bias) throw ValueError("mask.bias: not supported by ring attention; give mask.allowed instead");
  if (mask.cu_seqlens_q || mask.cu_seqlens_k)
    throw ValueError("cu_seqlens_q: packed sequences are not supported by ring attention");
  if (params.dropout && params.dropout->p != 0.0) throw ValueError("dropout: not supported by ring attention");
  if (mask.diagonal_offset)
    throw ValueError("mask.diagonal_offset: set by ring attention for each block, not by the caller");
  if (shards.tq < 0 || shards.tk < 0) {
    throw ValueError(fmt::format("shards: expected tq and tk at least 0, got {} and {}", shards.tq, shards.tk));
  }
  Ring r{.params = &params,
         .shards = shards,
         .q = as_bhtd(params.q, "q"),
         .k = as_bhtd(params.k, "k"),
         .v = as_bhtd(params.v, "v"),
         .allowed = std::nullopt,
         .q_ranges = shard_ranges(shards.tq, c.size, c.rank, shards.layout)};
  const int64_t tq_r = shard_length(shards.tq, c.size, c.rank, shards.layout);
  const int64_t tk_r = shard_length(shards.tk, c.size, c.rank, shards.layout);
  if (r.q.shape[2] != tq_r) {
    throw ShapeError(fmt::format("q: expected {} queries, this rank's shard of Tq = {} over {} ranks, got shape {}",
                                 tq_r, shards.tq, c.size, params.q.shape.str()));
  }
  if (r.k.shape[2] != tk_r) {
    throw ShapeError(fmt::format("k: expected {} keys, this rank's shard of Tk = {} over {} ranks, got shape {}", tk_r,
                                 shards.tk, c.size, params.k.shape.str()));
  }
  if (mask.allowed) r.allowed = broadcast_to(*mask.allowed, {r.batch(), r.heads(), tq_r, shards.tk}, "mask");
  r.diagonal = mask.alignment == CausalAlignment::bottom_right ? shards.tk - shards.tq : 0;
  if (mask.window && mask.window->left >= 0) r.band_lo = r.diagonal - mask.window->left;
  if (mask.window && mask.window->right >= 0) r.band_hi = r.diagonal + mask.window->right;
  if (mask.causal) r.band_hi = std::min(r.band_hi, r.diagonal);
  return r;
}

// The buffers of shards, kept by each thread from one call to the next: a fresh buffer of a
// shard's size costs a page fault per 4 KiB on first touch, which on a virtual machine takes as
// long as the kernel's work on a short shard.
std::vector<std::vector<float>>& buffer_pool() {
  thread_local std::vector<std::vector<float>> pool;
  return pool;
}

// A float buffer from this thread's pool, given back when it goes.
class PooledFloats {
 public:
  PooledFloats() {
    auto& pool = buffer_pool();
    if (!pool.empty()) {
      values_ = std::move(pool.back());
      pool.pop_back();
    }
  }
  ~PooledFloats() {
    if (values_.capacity() > 0) buffer_pool().push_back(std::move(values_));
  }
  PooledFloats(PooledFloats&& other) noexcept : values_(std::exchange(other.values_, {})) {}
  PooledFloats& operator=(PooledFloats&& other) noexcept {
    std::swap(values_, other.values_);
    return *this;
  }
  PooledFloats(const PooledFloats&) = delete;
  PooledFloats& operator=(const PooledFloats&) = delete;

  std::vector<float>& values() { return values_; }
  float* data() { return values_.data(); }

 private:
  std::vector<float> values_;
};

// A packed shard of K and V (or of dK and dV) for `tokens` tokens: k [B, Hkv, n, Dk], then v.
struct KvShard {
  PooledFloats buffer;
  int64_t tokens = 0;

  TensorView<float> k(const Ring& r) { return make_view(buffer.data(), {r.batch(), r.kv_heads(), tokens, r.dk()}); }
  TensorView<float> v(const Ring& r) {
    return make_view(buffer.data() + r.batch() * r.kv_heads() * tokens * r.dk(),
                     {r.batch(), r.kv_heads(), tokens, r.dv()});
  }
  void resize(const Ring& r, int64_t n) {
    tokens = n;
    buffer.values().assign(static_cast<size_t>(n * r.token_floats()), 0.0f);
  }
};

void copy_into(TensorView<const float> from, TensorView<float> to) {
  for (int64_t b = 0; b < from.shape[0]; ++b)
    for (int64_t h = 0; h < from.shape[1]; ++h)
      for (int64_t t = 0; t < from.shape[2]; ++t)
        std::memcpy(&to(b, h, t, 0), &from(b, h, t, 0), static_cast<size_t>(from.shape[3]) * sizeof(float));
}

// The rank's own K and V, packed to travel.
KvShard pack_own(const Ring& r) {
  KvShard s;
  s.resize(r, r.k.shape[2]);
  copy_into(r.k, s.k(r));
  copy_into(r.v, s.v(r));
  return s;
}

// One token of a packed shard as an MPI type, so that counts are in tokens and stay below INT_MAX.
class TokenType {
 public:
  explicit TokenType(const Ring& r) {
    MPI_Type_contiguous(static_cast<int>(r.token_floats()), MPI_FLOAT, &type_);
    MPI_Type_commit(&type_);
  }
  ~TokenType() { MPI_Type_free(&type_); }
  TokenType(const TokenType&) = delete;
  TokenType& operator=(const TokenType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

// Sends `out` to the next rank and receives the shard of `origin` from the previous one, into `in`.
void exchange(const Ring& r, const Comm& c, const TokenType& type, KvShard& out, KvShard& in, int origin,
              MPI_Request requests[2], int tag) {
  in.resize(r, shard_length(r.shards.tk, c.size, origin, r.shards.layout));
  MPI_Irecv(in.buffer.data(), static_cast<int>(in.tokens), type.get(), c.prev(), tag, c.comm, &requests[0]);
  MPI_Isend(out.buffer.data(), static_cast<int>(out.tokens), type.get(), c.next(), tag, c.comm, &requests[1]);
}

void wait_all(MPI_Request requests[2], double& wait_s) {
  const auto start = Clock::now();
  MPI_Waitall(2, requests, MPI_STATUSES_IGNORE);
  wait_s += seconds_since(start);
}

// A block: queries `qr` (at offset `q_at` in this rank's shard) against keys `kr` (at `k_at` in
// the shard held), with the whole sequence's causality, window and ALiBi carried by the offset.
struct Block {
  TokenRange qr, kr;
  int64_t q_at = 0, k_at = 0;
};

AttentionParams<float> block_params(const Ring& r, const Block& blk, KvShard& kv) {
  AttentionParams<float> p = *r.params;
  p.q = slice(r.q, 2, blk.q_at, blk.qr.length);
  p.k = slice(TensorView<const float>(kv.k(r)), 2, blk.k_at, blk.kr.length);
  p.v = slice(TensorView<const float>(kv.v(r)), 2, blk.k_at, blk.kr.length);
  p.mask.diagonal_offset = blk.qr.start - blk.kr.start + r.diagonal;
  if (r.allowed) p.mask.allowed = slice(slice(*r.allowed, 2, blk.q_at, blk.qr.length), 3, blk.kr.start, blk.kr.length);
  // The sinks join each row's softmax once, in the merge, not once per block.
  p.sinks = std::nullopt;
  return p;
}

// The blocks of this rank's queries against the shard of `origin` that may see anything, each
// range of queries cut into pieces of at least kPieceRows rows, about kPieces per range: between
// two pieces the ring lets MPI move the messages in flight (progress()), which a large message
// needs (its transfer advances only inside MPI calls). How a range is cut depends on its length
// alone, so the results do not depend on the messages' timing.
constexpr int64_t kPieces = 8;
constexpr int64_t kPieceRows = 64;

std::vector<Block> blocks_of(const Ring& r, const Comm& c, int origin) {
  std::vector<Block> blocks;
  int64_t q_at = 0;
  for (const TokenRange& qr : r.q_ranges) {
    const int64_t piece = std::max(kPieceRows, (qr.length + kPieces - 1) / kPieces);
    for (int64_t first = 0; first < qr.length; first += piece) {
      const TokenRange rows{qr.start + first, std::min(piece, qr.length - first)};
      int64_t k_at = 0;
      for (const TokenRange& kr : shard_ranges(r.shards.tk, c.size, origin, r.shards.layout)) {
        if (r.may_see(rows, kr)) blocks.push_back({rows, kr, q_at + first, k_at});
        k_at += kr.length;
      }
    }
    q_at += qr.length;
  }
  return blocks;
}

// Lets MPI advance the transfers of `requests` (those not yet complete), without waiting.
void progress(MPI_Request* requests, int count) {
  int done = 0;
  MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
}

// The rank's out, accumulated in place in the caller's [B, H, tq_r, Dv] (each merge computed in
// float64 and rounded once), and its lse [B, H, tq_r] in float64.
struct Merged {
  TensorView<float> out;
  std::vector<double> lse;
};

void merge_block(const Ring& r, const Block& blk, TensorView<const float> out, TensorView<const float> lse, Merged& m) {
  const int64_t B = r.batch(), H = r.heads(), n = blk.qr.length, dv = r.dv(), tq_r = r.tq_r();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const double lb = lse(b, h, i);
        if (lb == -std::numeric_limits<double>::infinity()) continue;
        double& la = m.lse[static_cast<size_t>((b * H + h) * tq_r + blk.q_at + i)];
        float* acc = &m.out(b, h, blk.q_at + i, 0);
        const float* part = &out(b, h, i, 0);
        const double top = std::max(la, lb);
        const double merged = top + std::log(std::exp(la - top) + std::exp(lb - top));
        const double wa = std::exp(la - merged), wb = std::exp(lb - merged);
        for (int64_t d = 0; d < dv; ++d) acc[d] = static_cast<float>(wa * acc[d] + wb * part[d]);
        la = merged;
      }
}

// The sinks' logits join every row's normaliser once: lse' = log(exp(lse) + exp(sink)), and the
// weights of the keys shrink by exp(lse − lse').
void merge_sinks(const Ring& r, Merged& m) {
  if (!r.params->sinks) return;
  const int64_t B = r.batch(), H = r.heads(), tq_r = r.tq_r(), dv = r.dv();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const auto sink = static_cast<double>((*r.params->sinks)(h));
      for (int64_t i = 0; i < tq_r; ++i) {
        const int64_t row = (b * H + h) * tq_r + i;
        double& la = m.lse[static_cast<size_t>(row)];
        const double top = std::max(la, sink);
        if (top == -std::numeric_limits<double>::infinity()) continue;
        const double merged = top + std::log(std::exp(la - top) + std::exp(sink - top));
        const double w = std::exp(la - merged);
        for (int64_t d = 0; d < dv; ++d) m.out(b, h, i, d) = static_cast<float>(w * m.out(b, h, i, d));
        la = merged;
      }
    }
}

// The [B, H, tq_r] view of an lse given in q's leading dims.
template <class T>
TensorView<T> lse_bht(TensorView<T> lse) {
  const TensorView<T> l4 = as_rank4(lse);
  return TensorView<T>{l4.data, {l4.shape[1], l4.shape[2], l4.shape[3]}, {l4.strides[1], l4.strides[2], l4.strides[3]}};
}

Shape out_shape(const AttentionParams<float>& p, int64_t tq_r, int64_t dv) {
  return leading_dims_with(p.q.shape, p.q.rank() - 2, {tq_r, dv});
}

Shape lse_shape(const AttentionParams<float>& p, int64_t tq_r) {
  return leading_dims_with(p.q.shape, p.q.rank() - 2, {tq_r});
}

// What every rank must share: the batch, heads, dims, lengths and options. A rank whose call
// differs from rank 0's throws.
void check_same_as_rank0(const Ring& r, const Comm& c) {
  const AttentionParams<float>& p = *r.params;
  const auto& m = p.mask;
  const int64_t mine[] = {r.batch(),
                          r.heads(),
                          r.kv_heads(),
                          r.dk(),
                          r.dv(),
                          r.shards.tq,
                          r.shards.tk,
                          static_cast<int64_t>(r.shards.layout),
                          m.causal ? 1 : 0,
                          static_cast<int64_t>(m.alignment),
                          m.window ? m.window->left : -2,
                          m.window ? m.window->right : -2,
                          m.allowed ? 1 : 0,
                          m.alibi_slopes ? 1 : 0,
                          p.sinks ? 1 : 0};
  constexpr int kCount = sizeof(mine) / sizeof(mine[0]);
  int64_t rank0[kCount];
  std::copy(std::begin(mine), std::end(mine), rank0);
  const double mine_real[2] = {p.scale.value_or(std::nan("")), p.softcap.value_or(0.0)};
  double rank0_real[2] = {mine_real[0], mine_real[1]};
  // Both broadcasts before any check: a rank that threw between them would leave the others in the second.
  MPI_Bcast(rank0, kCount, MPI_INT64_T, 0, c.comm);
  MPI_Bcast(rank0_real, 2, MPI_DOUBLE, 0, c.comm);
  static constexpr const char* kNames[kCount] = {"q: batch",
                                                 "q: heads",
                                                 "k: heads",
                                                 "k: Dk",
                                                 "v: Dv",
                                                 "shards.tq",
                                                 "shards.tk",
                                                 "shards.layout",
                                                 "mask.causal",
                                                 "mask.alignment",
                                                 "window.left",
                                                 "window.right",
                                                 "mask.allowed (given or not)",
                                                 "mask.alibi_slopes (given or not)",
                                                 "sinks (given or not)"};
  for (int i = 0; i < kCount; ++i) {
    if (mine[i] != rank0[i]) {
      throw ValueError(fmt::format("{}: expected {}, as on rank 0, got {}", kNames[i], rank0[i], mine[i]));
    }
  }
  static constexpr const char* kRealNames[2] = {"scale", "softcap"};
  for (int i = 0; i < 2; ++i) {
    const bool same = mine_real[i] == rank0_real[i] || (std::isnan(mine_real[i]) && std::isnan(rank0_real[i]));
    if (!same) {
      throw ValueError(
          fmt::format("{}: expected {}, as on rank 0, got {}", kRealNames[i], rank0_real[i], mine_real[i]));
    }
  }
}

// Checks this rank's call: everything the kernel checks, on the block of no queries against the
// rank's own keys, and what ring attention adds. Then the ranks agree.
Ring checked_ring(const AttentionParams<float>& params, const RingShards& shards, const Comm& c,
                  const std::function<void(const Ring&)>& more) {
  std::optional<Ring> ring;
  all_or_none(c.comm, [&] {
    ring = make_ring(params, shards, c);
    AttentionParams<float> probe = params;
    probe.q = slice(ring->q, 2, 0, 0);
    probe.k = ring->k;
    probe.v = ring->v;
    probe.mask.allowed = std::nullopt;
    Tensor<float> out({ring->batch(), ring->heads(), 0, ring->dv()}), lse({ring->batch(), ring->heads(), 0});
    attention_forward_fused<float>(probe, AttentionOutputs<float>{.out = out.view(), .weights = {}, .lse = lse.view()});
    more(*ring);
  });
  all_or_none(c.comm, [&] { check_same_as_rank0(*ring, c); });
  return *ring;
}

// The forward into float64 accumulators; `times` collects compute and wait.
std::vector<double> forward_merged(const Ring& r, const Comm& c, TensorView<float> out, RingTimes& times) {
  const int64_t rows = r.batch() * r.heads() * r.tq_r();
  for (int64_t b = 0; b < r.batch(); ++b)
    for (int64_t h = 0; h < r.heads(); ++h)
      for (int64_t i = 0; i < r.tq_r(); ++i) std::fill_n(&out(b, h, i, 0), r.dv(), 0.0f);
  Merged m{out, std::vector<double>(static_cast<size_t>(rows), -std::numeric_limits<double>::infinity())};
  const TokenType type(r);
  KvShard held = pack_own(r), incoming;
  // One block's out and lse, reused by every block: a fresh allocation per block would cost its
  // page faults each time.
  PooledFloats out_scratch, lse_scratch;
  out_scratch.values().resize(static_cast<size_t>(rows * r.dv()));
  lse_scratch.values().resize(static_cast<size_t>(rows));
  for (int step = 0; step < c.size; ++step) {
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    const bool more = step + 1 < c.size;
    if (more) exchange(r, c, type, held, incoming, c.origin(step + 1), requests, 0);
    const auto start = Clock::now();
    for (const Block& blk : blocks_of(r, c, c.origin(step))) {
      const TensorView<float> block_out = make_view(out_scratch.data(), {r.batch(), r.heads(), blk.qr.length, r.dv()});
      const TensorView<float> lse = make_view(lse_scratch.data(), {r.batch(), r.heads(), blk.qr.length});
      attention_forward_fused<float>(block_params(r, blk, held),
                                     AttentionOutputs<float>{.out = block_out, .weights = {}, .lse = lse});
      merge_block(r, blk, block_out, lse, m);
      progress(requests, 2);
    }
    times.compute_s += seconds_since(start);
    if (more) {
      wait_all(requests, times.wait_s);
      std::swap(held, incoming);
    }
  }
  merge_sinks(r, m);
  return std::move(m.lse);
}

}  // namespace

void ring_attention_forward(const AttentionParams<float>& params, const RingShards& shards,
                            const AttentionOutputs<float>& outputs, MPI_Comm comm, RingTimes* times) {
  const auto start = Clock::now();
  const Comm c(comm);
  const Ring r = checked_ring(params, shards, c, [&](const Ring& ring) {
    if (outputs.weights) throw ValueError("weights: ring attention never forms α; ask for out and lse");
    check_shape("out", outputs.out.shape, out_shape(params, ring.tq_r(), ring.dv()));
    if (outputs.lse) check_shape("lse", outputs.lse->shape, lse_shape(params, ring.tq_r()));
  });
  RingTimes t;
  or_abort(c, [&] {
    const std::vector<double> lse = forward_merged(r, c, as_bhtd(outputs.out, "out"), t);
    if (!outputs.lse) return;
    const TensorView<float> lse3 = lse_bht(*outputs.lse);
    for (int64_t b = 0; b < r.batch(); ++b)
      for (int64_t h = 0; h < r.heads(); ++h)
        for (int64_t i = 0; i < r.tq_r(); ++i) {
          lse3(b, h, i) = static_cast<float>(lse[static_cast<size_t>((b * r.heads() + h) * r.tq_r() + i)]);
        }
  });
  t.total_s = seconds_since(start);
  if (times) *times = t;
}

namespace {

// dsinks_h = −Σ over every rank's rows of exp(sink_h − lse_i)·(dout_i·out_i), summed rank by rank
// in rank order on rank 0 and sent to all, so that every rank adds the same, bit for bit.
void add_sink_gradients(const Ring& r, const Comm& c, TensorView<const float> dout, TensorView<const float> out,
                        TensorView<const float> lse, TensorView<float> dsinks) {
  const int64_t H = r.heads();
  std::vector<double> mine(static_cast<size_t>(H), 0.0);
  for (int64_t b = 0; b < r.batch(); ++b)
    for (int64_t h = 0; h < H; ++h) {
      const auto sink = static_cast<double>((*r.params->sinks)(h));
      for (int64_t i = 0; i < r.tq_r(); ++i) {
        double row_dot = 0;
        for (int64_t d = 0; d < r.dv(); ++d) row_dot += static_cast<double>(dout(b, h, i, d)) * out(b, h, i, d);
        mine[static_cast<size_t>(h)] -= std::exp(sink - static_cast<double>(lse(b, h, i))) * row_dot;
      }
    }
  std::vector<double> all(static_cast<size_t>(H * c.size));
  MPI_Gather(mine.data(), static_cast<int>(H), MPI_DOUBLE, all.data(), static_cast<int>(H), MPI_DOUBLE, 0, c.comm);
  std::vector<double> total(static_cast<size_t>(H), 0.0);
  if (c.rank == 0) {
    for (int rank = 0; rank < c.size; ++rank)
      for (int64_t h = 0; h < H; ++h) total[static_cast<size_t>(h)] += all[static_cast<size_t>(rank * H + h)];
  }
  MPI_Bcast(total.data(), static_cast<int>(H), MPI_DOUBLE, 0, c.comm);
  for (int64_t h = 0; h < H; ++h) dsinks(h) += static_cast<float>(total[static_cast<size_t>(h)]);
}

}  // namespace

void ring_attention_backward(const AttentionParams<float>& params, const RingShards& shards,
                             TensorView<const float> dout, const AttentionGradients<float>& grads,
                             const std::optional<AttentionSaved<float>>& saved, MPI_Comm comm, RingTimes* times) {
  const auto start = Clock::now();
  const Comm c(comm);
  const Ring r = checked_ring(params, shards, c, [&](const Ring& ring) {
    check_shape("dout", dout.shape, out_shape(params, ring.tq_r(), ring.dv()));
    check_shape("dq", grads.dq.shape, params.q.shape);
    check_shape("dk", grads.dk.shape, params.k.shape);
    check_shape("dv", grads.dv.shape, params.v.shape);
    if (grads.dbias) throw ValueError("dbias: ring attention takes no bias");
    if (params.sinks && !grads.dsinks) throw ValueError("dsinks: expected a [H] gradient with sinks, got none");
    if (grads.dsinks) check_shape("dsinks", grads.dsinks->shape, Shape{ring.heads()});
    if (saved) {
      check_shape("saved.out", saved->out.shape, out_shape(params, ring.tq_r(), ring.dv()));
      check_shape("saved.lse", saved->lse.shape, lse_shape(params, ring.tq_r()));
    }
  });
  RingTimes t;
  Tensor<float> out_recomputed, lse_recomputed;
  std::optional<AttentionSaved<float>> from = saved;
  if (!from) {
    out_recomputed = Tensor<float>(out_shape(params, r.tq_r(), r.dv()));
    lse_recomputed = Tensor<float>(lse_shape(params, r.tq_r()));
    RingTimes forward;
    ring_attention_forward(
        params, shards,
        AttentionOutputs<float>{.out = out_recomputed.view(), .weights = {}, .lse = lse_recomputed.view()}, comm,
        &forward);
    t.compute_s += forward.compute_s;
    t.wait_s += forward.wait_s;
    from = AttentionSaved<float>{.out = out_recomputed.cview(), .lse = lse_recomputed.cview()};
  }
  or_abort(c, [&] {
    const TensorView<const float> dout4 = as_bhtd(dout, "dout"), out4 = as_bhtd(from->out, "saved.out");
    const TensorView<const float> lse3 = lse_bht(from->lse);
    const TensorView<float> dq4 = as_bhtd(grads.dq, "dq");
    const TokenType type(r);
    KvShard held = pack_own(r), incoming, part, travelling_out, travelling_in;
    MPI_Request grad_requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    for (int step = 0; step < c.size; ++step) {
      MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
      const bool more = step + 1 < c.size;
      if (more) exchange(r, c, type, held, incoming, c.origin(step + 1), requests, 1);
      const auto compute_start = Clock::now();
      part.resize(r, held.tokens);
      for (const Block& blk : blocks_of(r, c, c.origin(step))) {
        const AttentionGradients<float> g{.dq = slice(dq4, 2, blk.q_at, blk.qr.length),
                                          .dk = slice(part.k(r), 2, blk.k_at, blk.kr.length),
                                          .dv = slice(part.v(r), 2, blk.k_at, blk.kr.length),
                                          .dbias = std::nullopt};
        const AttentionSaved<float> s{.out = slice(out4, 2, blk.q_at, blk.qr.length),
                                      .lse = slice(lse3, 2, blk.q_at, blk.qr.length)};
        attention_backward_fused<float>(block_params(r, blk, held), slice(dout4, 2, blk.q_at, blk.qr.length), g, s);
        progress(requests, 2);
        progress(grad_requests, 2);
      }
      t.compute_s += seconds_since(compute_start);
      // The gradients of the shard held so far arrive from the previous rank; this rank's part
      // joins them and they move on, towards the shard's home.
      if (step > 0) {
        wait_all(grad_requests, t.wait_s);
        std::vector<float>& sum = part.buffer.values();
        const std::vector<float>& before = travelling_in.buffer.values();
        for (size_t e = 0; e < sum.size(); ++e) sum[e] = before[e] + sum[e];
      }
      std::swap(travelling_out, part);
      if (c.size > 1) exchange(r, c, type, travelling_out, travelling_in, c.origin(step + 1), grad_requests, 2);
      if (more) {
        wait_all(requests, t.wait_s);
        std::swap(held, incoming);
      }
    }
    KvShard* home = &travelling_out;
    if (c.size > 1) {
      wait_all(grad_requests, t.wait_s);
      home = &travelling_in;
    }
    const TensorView<float> dk4 = as_bhtd(grads.dk, "dk"), dv4 = as_bhtd(grads.dv, "dv");
    const auto add = [](TensorView<float> from_view, TensorView<float> to) {
      for (int64_t b = 0; b < to.shape[0]; ++b)
        for (int64_t h = 0; h < to.shape[1]; ++h)
          for (int64_t i = 0; i < to.shape[2]; ++i)
            for (int64_t d = 0; d < to.shape[3]; ++d) to(b, h, i, d) += from_view(b, h, i, d);
    };
    add(home->k(r), dk4);
    add(home->v(r), dv4);
    if (r.params->sinks) add_sink_gradients(r, c, dout4, out4, lse3, *grads.dsinks);
  });
  t.total_s = seconds_since(start);
  if (times) *times = t;
}

}  // namespace qkv::dist
