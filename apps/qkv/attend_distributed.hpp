#pragma once
// `qkv attend --distributed ring` and `qkv attend-backward --distributed ring`, run under mpirun:
// ring attention (qkv/dist/ring_attention.hpp) over the ranks of MPI_COMM_WORLD.

#include <optional>
#include <string>

#include "qkv/ops/attention.hpp"

namespace qkv::cli {

// What a distributed run takes, as given. A path with {rank} in it is one file per rank (the rank's
// shard, {rank} replaced by its number); a path without is one whole file that rank 0 reads and
// scatters (an input) or gathers and writes (an output).
struct RingRunOptions {
  std::string layout = "contiguous";  // or zigzag
  std::string q, k, v, dout;          // dout: attend-backward
  std::string out, lse;               // attend
  std::string dq, dk, dv, dsinks;     // attend-backward
  std::optional<double> scale, softcap;
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::bottom_right;
  std::optional<AttentionWindow> window;
  std::string alibi;  // "", auto or a file of slopes
  std::string sinks;
  bool allow_nonfinite = false;
  bool backward = false;
};

// Whether this qkv was built with MPI (qkv::dist).
bool ring_available();

void run_ring(const RingRunOptions& options);

}  // namespace qkv::cli
