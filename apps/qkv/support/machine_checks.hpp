#pragma once
// What a benchmark says about the machine it ran on, so that a figure which measures something
// other than the kernel (a core held by another program, data that never left the cache) is not
// read as the kernel's. Each check returns the warning to print, or nothing.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace qkv {

// The 1-minute load average (getloadavg), or nothing where the system does not say.
std::optional<double> load_average();

// A warning when `load` (the load average before the run, when no part of it is ours) says other
// programs keep more than half a core busy of the `cpus` that a run on `threads` threads needs:
// their times, and a ratio of threads, then measure the sharing.
std::optional<std::string> busy_machine_warning(double load, int cpus, int threads);

// A warning when `working_set_bytes` (what a memory-bound measurement `what` streams) fits in
// the last-level cache of `cache_bytes` (0: unknown, no warning): its bandwidth is the cache's.
std::optional<std::string> cache_resident_warning(std::string_view what, double working_set_bytes, int64_t cache_bytes);

}  // namespace qkv
