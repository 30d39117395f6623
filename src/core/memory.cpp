#include "qkv/core/memory.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "qkv/core/error.hpp"

namespace qkv {

uint64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key;
    uint64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") return kib * 1024;
  }
  // Without /proc, the free physical pages are a lower bound of what can be had.
  const long pages = sysconf(_SC_AVPHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size) : 0;
}

std::string format_bytes(double bytes) {
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024.0) return fmt::format("{:.0f} bytes", bytes);
  int unit = -1;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.1f} {}", bytes, kUnits[unit]);
}

void check_allocation_fits(double bytes, std::string_view what) {
  // Reading /proc/meminfo costs tens of microseconds, as much as a small attention call: a request
  // this small is not worth it, since a machine that cannot give it fails everywhere else first.
  constexpr double kAlwaysFits = 16.0 * 1024 * 1024;
  if (bytes <= kAlwaysFits) return;
  const auto available = static_cast<double>(available_memory_bytes());
  if (bytes > available) {
    throw ResourceError(fmt::format("{} needs {}, but only {} of memory is available", what, format_bytes(bytes),
                                    format_bytes(available)));
  }
}

}  // namespace qkv
