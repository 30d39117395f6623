#pragma once
// Refusing work that would not fit in memory before allocating it, so that a too-large request
// is a clear error ("needs 32.0 GiB, 20.3 GiB available") instead of the kernel's OOM killer.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

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

// Asks the kernel to back the whole 2 MiB pages inside [data, data + bytes) with transparent huge
// pages (Linux's madvise(MADV_HUGEPAGE); nothing elsewhere, nor for fewer than 4 MiB, nor where
// the kernel refuses), which it does for pages not yet touched. Streaming through 4 KiB pages
// costs a TLB miss every 4 KiB: single-query decode read K and V at a median 1.06× the pace from
// huge pages (0.94–1.22× over twelve probes, as the host placed them), a triad at 1.04–1.08× (Zen 5
// under KVM). numpy advises its arrays of 4 MiB or more the same way.
void advise_huge_pages(void* data, size_t bytes);

// v ← n copies of value, its storage advised to take huge pages (advise_huge_pages) before the
// copies touch it.
template <class T, class Allocator>
void assign_on_huge_pages(std::vector<T, Allocator>& v, size_t n, const T& value) {
  v.clear();
  v.reserve(n);
  advise_huge_pages(v.data(), n * sizeof(T));
  v.assign(n, value);
}

}  // namespace qkv
