#pragma once
// Refusing work that would not fit in memory before allocating it, so that a too-large request
// is a clear error ("needs 32.0 GiB, 20.3 GiB available") instead of the kernel's OOM killer.

#include <cstdint>
#include <string>
#include <string_view>

namespace qkv {

// Bytes this process can still allocate: the least of what the system can give without swapping
// (Linux: MemAvailable), what `ulimit -v` (RLIMIT_AS) and RLIMIT_DATA leave above what the process
// already uses, and what its cgroup's memory limit (v2 or v1) leaves.
uint64_t available_memory_bytes();

// "1.5 GiB", "512.0 MiB", "12 bytes"
std::string format_bytes(double bytes);

// Throws ResourceError "`what` needs <bytes>, only <available> is available" when `bytes` exceeds
// what is available. `bytes` is a double so that a product of sizes cannot overflow first.
// Requests of at most 16 MiB are taken as fitting without asking the system.
void check_allocation_fits(double bytes, std::string_view what);

}  // namespace qkv
