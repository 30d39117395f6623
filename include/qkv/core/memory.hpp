#pragma once
// Refusing work that would not fit in memory before allocating it, so that a too-large request
// is a clear error ("needs 32.0 GiB, 20.3 GiB available") instead of the kernel's OOM killer.

#include <cstdint>
#include <string>
#include <string_view>

namespace qkv {

// Bytes the system can still give this process without swapping (Linux: MemAvailable).
uint64_t available_memory_bytes();

// "1.5 GiB", "512.0 MiB", "12 bytes"
std::string format_bytes(double bytes);

// Throws ResourceError "`what` needs <bytes>, only <available> is available" when `bytes` exceeds
// what is available. `bytes` is a double so that a product of sizes cannot overflow first.
// Requests of at most 16 MiB are taken as fitting without asking the system.
void check_allocation_fits(double bytes, std::string_view what);

}  // namespace qkv
