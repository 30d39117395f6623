#include "qkv/core/memory.hpp"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "qkv/core/error.hpp"

namespace qkv {

namespace {

constexpr uint64_t kUnlimited = std::numeric_limits<uint64_t>::max();

// The "Key:  N kB" line of a /proc file (meminfo, self/status), in bytes; nullopt when absent.
std::optional<uint64_t> proc_kib_field(const char* path, std::string_view wanted) {
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    std::istringstream fields(line);
    std::string key;
    uint64_t kib = 0;
    if (fields >> key >> kib && key == wanted) return kib * 1024;
  }
  return std::nullopt;
}

// The system's MemAvailable: what it can still give without swapping.
uint64_t system_available() {
  if (const std::optional<uint64_t> available = proc_kib_field("/proc/meminfo", "MemAvailable:")) return *available;
  // Without /proc, the free physical pages are a lower bound of what can be had.
  const long pages = sysconf(_SC_AVPHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size) : 0;
}

// What a resource limit (`ulimit -v` is RLIMIT_AS; RLIMIT_DATA counts private mappings, which
// large allocations are) leaves above what this process already uses of it.
uint64_t left_under_limit(int resource, std::string_view used_key) {
  rlimit limit{};
  if (getrlimit(resource, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return kUnlimited;
  const uint64_t used = proc_kib_field("/proc/self/status", used_key).value_or(0);
  return limit.rlim_cur > used ? static_cast<uint64_t>(limit.rlim_cur) - used : 0;
}

// limit − usage read from two files of a cgroup folder; unlimited where they are absent or the
// limit is "max".
uint64_t left_in(const std::string& dir, const char* limit_name, const char* usage_name) {
  std::ifstream limit_file(dir + "/" + limit_name), usage_file(dir + "/" + usage_name);
  std::string limit_text;
  uint64_t limit = 0, usage = 0;
  if (!(limit_file >> limit_text) || !(usage_file >> usage)) return kUnlimited;
  const auto parsed = std::from_chars(limit_text.data(), limit_text.data() + limit_text.size(), limit);
  if (parsed.ec != std::errc() || parsed.ptr != limit_text.data() + limit_text.size()) return kUnlimited;
  return limit > usage ? limit - usage : 0;
}

// What this process's cgroup may still charge, as a container's memory limit sets it: cgroup v2's
// memory.max − memory.current, or v1's memory.limit_in_bytes − memory.usage_in_bytes (a v1 path
// from outside a cgroup namespace may not exist inside it: then the namespace's root).
uint64_t left_in_cgroup() {
  std::ifstream self("/proc/self/cgroup");
  std::string line;
  uint64_t left = kUnlimited;
  while (std::getline(self, line)) {
    if (line.starts_with("0::")) {
      left = std::min(left, left_in("/sys/fs/cgroup" + line.substr(3), "memory.max", "memory.current"));
    } else if (const size_t at = line.find(":memory:"); at != std::string::npos) {
      std::string dir = "/sys/fs/cgroup/memory" + line.substr(at + 8);
      std::error_code ignored;
      if (!std::filesystem::exists(dir, ignored)) dir = "/sys/fs/cgroup/memory";
      left = std::min(left, left_in(dir, "memory.limit_in_bytes", "memory.usage_in_bytes"));
    }
  }
  return left;
}

}  // namespace

uint64_t available_memory_bytes() {
  return std::min({system_available(), left_under_limit(RLIMIT_AS, "VmSize:"), left_under_limit(RLIMIT_DATA, "VmData:"),
                   left_in_cgroup()});
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

void advise_huge_pages(void* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr size_t kHugePage = size_t{2} << 20;
  constexpr size_t kAtLeast = size_t{4} << 20;
  if (data == nullptr || bytes < kAtLeast) return;
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + kHugePage - 1) / kHugePage * kHugePage;
  const uintptr_t last = (begin + bytes) / kHugePage * kHugePage;
  // Advice only: a kernel without transparent huge pages, or with them off, leaves 4 KiB pages.
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace qkv
