// Ring attention under mpirun: how much of the communication the compute hides, and what the
// zigzag layout buys under a causal mask. Run: mpirun -np P bench/mpi_ring_attention [T H D rounds].
//
// Each round times, on every rank and in alternation (so that a machine whose speed drifts moves
// both alike): the compute alone (the P calls of the fused kernel that the ring makes, on shards of
// the same sizes, with no message sent), the ring's K/V exchange alone (its P - 1 steps of sending
// a shard's K and V to the next rank, with no compute), the ring forward, the ring backward and the backward's
// compute alone; and, causal, the ring forward with the contiguous and with the zigzag layout. A
// time is the slowest rank's. Printed: the median over rounds of each ratio, with its range; and
// the model of when communication hides, c >= 2 F / B for a shard of c tokens, with F and B
// measured here (the kernel's FLOP/s and the exchange's bytes per second per rank).

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <vector>

#include "qkv/core/rng.hpp"
#include "qkv/dist/ring_attention.hpp"

namespace {

using qkv::AttentionOutputs;
using qkv::AttentionParams;
using qkv::Tensor;
using qkv::dist::RingShards;
using qkv::dist::ShardLayout;

double slowest(double seconds) {
  double top = 0;
  MPI_Allreduce(&seconds, &top, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return top;
}

template <class F>
double timed(F&& body) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  body();
  return slowest(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

struct Ratio {
  std::vector<double> values;
  double median() const {
    std::vector<double> v = values;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
  void print(const char* what) const {
    std::vector<double> v = values;
    std::sort(v.begin(), v.end());
    fmt::print("{:<58} {:6.3f}  (rounds {:.3f} to {:.3f})\n", what, median(), v.front(), v.back());
  }
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 16384, H = argc > 2 ? std::atoll(argv[2]) : 8,
                D = argc > 3 ? std::atoll(argv[3]) : 64;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 3;
  const int64_t n = qkv::dist::shard_length(T, ranks, rank, ShardLayout::contiguous);
  qkv::Rng rng(7 + static_cast<uint64_t>(rank));
  Tensor<float> q({H, n, D}), k({H, n, D}), v({H, n, D}), out({H, n, D}), lse({H, n}), dout({H, n, D});
  for (Tensor<float>* t : {&q, &k, &v, &dout}) rng.fill_normal(t->view(), 0.0, 1.0);
  Tensor<float> dq({H, n, D}), dk({H, n, D}), dv({H, n, D});
  const AttentionParams<float> params{
      .q = q.cview(), .k = k.cview(), .v = v.cview(), .scale = std::nullopt, .mask = {}};
  const AttentionOutputs<float> outputs{.out = out.view(), .weights = {}, .lse = lse.view()};
  const qkv::AttentionGradients<float> grads{.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}};
  const qkv::AttentionSaved<float> saved{.out = out.cview(), .lse = lse.cview()};
  if (rank == 0) {
    fmt::print("ring attention, P = {} ranks, T = {}, H = {}, D = {}, fp32, {} rounds; times are the slowest rank's\n",
               ranks, T, H, D, rounds);
  }
  // The zigzag shards: their lengths differ from the contiguous ones' when T is not a multiple of 2P.
  const int64_t zn = qkv::dist::shard_length(T, ranks, rank, ShardLayout::zigzag);
  Tensor<float> zq({H, zn, D}), zk({H, zn, D}), zv({H, zn, D}), zout({H, zn, D}), zlse({H, zn});
  for (Tensor<float>* t : {&zq, &zk, &zv}) rng.fill_normal(t->view(), 0.0, 1.0);
  AttentionParams<float> zparams{.q = zq.cview(), .k = zk.cview(), .v = zv.cview(), .scale = std::nullopt, .mask = {}};
  zparams.mask.causal = true;
  Ratio forward, backward, causal_speedup, wait_share, kernel_share, flops, link_bytes;
  const int next = (rank + 1) % ranks, previous = (rank + ranks - 1) % ranks;
  Tensor<float> incoming_k({H, n, D}), incoming_v({H, n, D});
  const auto shard_floats = static_cast<int>(H * n * D);
  for (int round = 0; round < rounds; ++round) {
    const double alone = timed([&] {
      for (int step = 0; step < ranks; ++step) qkv::attention_forward_fused(params, outputs);
    });
    const double exchange = timed([&] {
      for (int step = 0; step + 1 < ranks; ++step) {
        MPI_Sendrecv(k.data(), shard_floats, MPI_FLOAT, next, 0, incoming_k.data(), shard_floats, MPI_FLOAT, previous,
                     0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Sendrecv(v.data(), shard_floats, MPI_FLOAT, next, 1, incoming_v.data(), shard_floats, MPI_FLOAT, previous,
                     1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      }
    });
    qkv::dist::RingTimes times;
    const double ring = timed([&] {
      qkv::dist::ring_attention_forward(params, RingShards{.tq = T, .tk = T}, outputs, MPI_COMM_WORLD, &times);
    });
    const double backward_alone = timed([&] {
      for (int step = 0; step < ranks; ++step) qkv::attention_backward_fused<float>(params, dout.cview(), grads, saved);
    });
    const double ring_backward = timed([&] {
      qkv::dist::ring_attention_backward(params, RingShards{.tq = T, .tk = T}, dout.cview(), grads, saved,
                                         MPI_COMM_WORLD);
    });
    AttentionParams<float> causal = params;
    causal.mask.causal = true;
    const double contiguous = timed(
        [&] { qkv::dist::ring_attention_forward(causal, RingShards{.tq = T, .tk = T}, outputs, MPI_COMM_WORLD); });
    const double zigzag = timed([&] {
      qkv::dist::ring_attention_forward(zparams, RingShards{.tq = T, .tk = T, .layout = ShardLayout::zigzag},
                                        AttentionOutputs<float>{.out = zout.view(), .weights = {}, .lse = zlse.view()},
                                        MPI_COMM_WORLD);
    });
    forward.values.push_back(ring / alone);
    backward.values.push_back(ring_backward / backward_alone);
    causal_speedup.values.push_back(contiguous / zigzag);
    wait_share.values.push_back(slowest(times.wait_s) / ring);
    kernel_share.values.push_back(slowest(times.compute_s) / alone);
    flops.values.push_back(4.0 * static_cast<double>(ranks * n * n * H * D) / alone);
    if (ranks > 1) link_bytes.values.push_back(8.0 * static_cast<double>((ranks - 1) * H * n * D) / exchange);
    if (rank == 0) {
      fmt::print(
          "round {}: forward compute alone {:.3f} s, K/V exchange alone {:.3f} s, ring {:.3f} s (rank 0: {:.3f} s in "
          "the kernel and the merge, "
          "{:.3f} s waiting); backward alone {:.3f} s, ring {:.3f} s; causal contiguous {:.3f} s, zigzag {:.3f} s\n",
          round + 1, alone, exchange, ring, times.compute_s, times.wait_s, backward_alone, ring_backward, contiguous,
          zigzag);
    }
  }
  if (rank == 0) {
    forward.print("ring forward / its compute alone (1 = fully hidden)");
    backward.print("ring backward / its compute alone");
    wait_share.print("forward: share of the time blocked waiting for a shard");
    kernel_share.print("forward: the ring's kernel and merge time / the compute alone");
    causal_speedup.print("causal: zigzag speed-up over the contiguous split");
    if (ranks > 1) {
      const double f = flops.median(), b = link_bytes.median();
      fmt::print(
          "the model: the kernel runs at F = {:.1f} GFLOP/s per rank, the exchange at B = {:.2f} Gbit/s per rank, so "
          "communication hides for shards of c >= 2F/B = {:.0f} tokens (these shards: {}; twice that under a causal "
          "mask)\n",
          f * 1e-9, b * 8e-9, 2 * f / b, n);
    }
  }
  MPI_Finalize();
  return 0;
}
