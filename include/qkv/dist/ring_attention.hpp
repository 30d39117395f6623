#pragma once
// Ring attention over MPI: one sequence split along T into P shards, one per rank of a
// communicator. Each rank keeps its shard of queries; the shards of keys and values travel around
// the ring (rank r sends to r + 1 and receives from r − 1), the next one already in flight
// (MPI_Isend / MPI_Irecv) while the fused kernel runs on the one at hand. Each rank ends with the
// exact attention of its queries over the whole sequence: the partial results of the P shards are
// merged by their log-sum-exp.
//
//   merge:  lse = log(exp(lse_a) + exp(lse_b)),  out = exp(lse_a − lse) out_a + exp(lse_b − lse) out_b
//
// A shard whose keys a query may not see at all has lse −inf and adds nothing (its weight is
// exp(−inf) = 0); a query that sees no key in the whole sequence gets out 0 and lse −inf, as in
// qkv/ops/attention.hpp. The merge accumulates in float64, in the ring's fixed order, so a result is
// bit-identical for any thread count and any run with the same P.
//
// The backward passes K and V around again, with the gradients dK and dV of each shard travelling
// beside it; after P steps every shard's gradients, summed in the ring's order, are back home.
//
// The causal mask, the window and ALiBi are the whole sequence's: a block of queries starting at
// position qs against keys starting at ks is attended with the diagonal offset qs − ks + o
// (AttentionMask::diagonal_offset). Under a causal mask the contiguous split leaves rank 0 one
// block of work and rank P − 1 P of them; the zigzag layout (rank r holds chunks r and 2P − 1 − r
// of 2P) gives every rank the same work.

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv::dist {

enum class ShardLayout {
  contiguous,  // rank r holds tokens [r·T/P, (r + 1)·T/P)
  zigzag,      // rank r holds chunks r and 2P − 1 − r of 2P equal chunks, in that order
};

// Tokens [start, start + length) of the whole sequence.
struct TokenRange {
  int64_t start = 0;
  int64_t length = 0;
};

// The tokens of a sequence of `tokens` that rank `rank` of `ranks` holds, in the order its shard
// stores them. Shards differ in length by at most one token per range when T is not a multiple of
// P (2P for zigzag); a range may be empty when T < 2P.
std::vector<TokenRange> shard_ranges(int64_t tokens, int ranks, int rank, ShardLayout layout);

// The number of tokens rank `rank` holds.
int64_t shard_length(int64_t tokens, int ranks, int rank, ShardLayout layout);

// Rows `ranges` of `whole` along its T axis (the second to last), gathered into one contiguous
// tensor: the shard a rank holds of an array every rank can read.
Tensor<float> take_shard(TensorView<const float> whole, const std::vector<TokenRange>& ranges);

// Runs `step` on every rank of `comm` (a collective call); when it throws on any of them, every
// rank throws the error of the lowest such rank, in its type (ShapeError, ValueError, IoError,
// ResourceError, else Error), its message prefixed "rank R: ". A program that checks its inputs in
// steps so guarded never leaves ranks waiting for a message that a failed rank will not send.
void all_or_none(MPI_Comm comm, const std::function<void()>& step);

// The whole sequence's Tq and Tk and the layout of both.
struct RingShards {
  int64_t tq = 0;  // queries of the whole sequence
  int64_t tk = 0;  // keys of the whole sequence (Tk ≠ Tq: both split by the same layout)
  ShardLayout layout = ShardLayout::contiguous;
};

// Where one call's time went on this rank: in the kernel, merging, and blocked in MPI waiting for
// a shard that the compute did not hide.
struct RingTimes {
  double compute_s = 0;
  double wait_s = 0;
  double total_s = 0;
};

// params: this rank's shards, q [B, H, tq_r, Dk], k [B, Hkv, tk_r, Dk], v [B, Hkv, tk_r, Dv] (tq_r
// and tk_r as shard_length gives them; leading dims as attention takes them), and what
// AttentionParams otherwise holds, with the whole sequence's meaning: causal and its alignment,
// the window, ALiBi, the softcap, the sinks and the scale. mask.allowed, when given, broadcasts to
// [B, H, tq_r, Tk]: this rank's query rows over every key of the sequence, in sequence order. Not
// supported (ValueError): an additive bias, packed sequences, dropout, a diagonal_offset.
//
// Every rank checks its arguments, and the ranks agree before anything is sent: when one rank's
// are wrong, every rank throws the same error, naming that rank ("rank 2: q: ..."). A failure
// after that (memory) aborts the job with MPI_Abort rather than leave the other ranks waiting.
//
// outputs: out [B, H, tq_r, Dv] and, optionally, lse [B, H, tq_r], for this rank's queries.
void ring_attention_forward(const AttentionParams<float>& params, const RingShards& shards,
                            const AttentionOutputs<float>& outputs, MPI_Comm comm, RingTimes* times = nullptr);

// Gradients of L = Σ over ranks <dout, out>, accumulated (+=) into this rank's dq, dk, dv (and
// dsinks: [H], summed over every rank's queries, the same on every rank). saved: this rank's out
// and lse from ring_attention_forward; recomputed when not given.
void ring_attention_backward(const AttentionParams<float>& params, const RingShards& shards,
                             TensorView<const float> dout, const AttentionGradients<float>& grads,
                             const std::optional<AttentionSaved<float>>& saved, MPI_Comm comm,
                             RingTimes* times = nullptr);

}  // namespace qkv::dist
