#include "support/machine_checks.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "qkv/core/memory.hpp"

namespace qkv {

std::optional<double> load_average() {
  double load = 0.0;
  if (getloadavg(&load, 1) != 1) return std::nullopt;
  return load;
}

std::optional<std::string> busy_machine_warning(double load, int cpus, int threads) {
  // The load of the programs already running, beside the cores this run leaves idle.
  const double spare = std::max(0, cpus - std::min(threads, cpus));
  if (load <= spare + 0.5) return std::nullopt;
  return fmt::format(
      "warning: the load average is {:.2f} on {} CPU{} before the run: other programs keep cores busy that "
      "the {} thread{} here need, so these times are slow and the ratio of threads understates the kernel; "
      "rerun on a quiet machine",
      load, cpus, cpus == 1 ? "" : "s", threads, threads == 1 ? "" : "s");
}

std::optional<std::string> cache_resident_warning(std::string_view what, double working_set_bytes,
                                                  int64_t cache_bytes) {
  if (cache_bytes <= 0 || working_set_bytes > static_cast<double>(cache_bytes)) return std::nullopt;
  return fmt::format(
      "warning: {} streams {}, which fits in the last-level cache ({}): its GB/s are the cache's, not the "
      "memory's; take a size whose data exceeds the cache several times",
      what, format_bytes(working_set_bytes), format_bytes(static_cast<double>(cache_bytes)));
}

}  // namespace qkv
