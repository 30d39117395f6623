// attend_distributed.hpp for a qkv built without MPI: --distributed is refused with the reason.

#include "attend_distributed.hpp"

#include "qkv/core/error.hpp"

namespace qkv::cli {

bool ring_available() { return false; }

void run_ring(const RingRunOptions&) {
  throw ValueError("--distributed: this qkv was built without MPI (install libopenmpi-dev and build again)");
}

}  // namespace qkv::cli
