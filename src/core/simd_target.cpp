// The one instruction-set setting of the Highway kernels (attention_fused.cpp, linear.cpp), its
// environment variable, and what the operating system says of the CPU.

#include "qkv/core/simd_target.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/detail/simd_dispatch.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"

// HWY_TARGETS, the set Highway compiles and dispatches among, follows from HWY_DISABLED_TARGETS,
// which CMakeLists.txt defines for all of libqkv: the names listed here are the ones the kernels
// were compiled for, and the best of them is the one their dispatch picks.
#include "hwy/targets.h"

namespace qkv {
namespace {

constexpr const char* kEnvironmentVariable = "QKV_SIMD_TARGET";

bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::toupper(static_cast<unsigned char>(x)) == std::toupper(static_cast<unsigned char>(y));
         });
}

std::string joined_names(const std::vector<int64_t>& targets) {
  std::string names;
  for (const int64_t t : targets) names += fmt::format("{}{}", names.empty() ? "" : ", ", hwy::TargetName(t));
  return names;
}

// Every target compiled into the kernels, best (lowest bit) first, whether this CPU runs it or not.
std::vector<int64_t> compiled_targets() {
  std::vector<int64_t> targets;
  for (int64_t bit = 1; bit != 0 && bit <= static_cast<int64_t>(HWY_TARGETS); bit <<= 1) {
    if ((static_cast<int64_t>(HWY_TARGETS) & bit) != 0) targets.push_back(bit);
  }
  return targets;
}

// The target forced by use_simd_target, 0 when none. Highway's own mock (SetSupportedTargetsForTest)
// holds the choice that dispatch reads; this copy is what lets the list lift it for a moment.
int64_t g_forced_target = 0;

// What this CPU runs of the compiled targets, best first, with Highway's mock lifted.
std::vector<int64_t> cpu_targets() {
  hwy::SetSupportedTargetsForTest(0);
  std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  if (g_forced_target != 0) hwy::SetSupportedTargetsForTest(g_forced_target);
  return targets;
}

// `name` among `targets`, or 0.
int64_t find_target(const std::vector<int64_t>& targets, std::string_view name) {
  for (const int64_t t : targets) {
    if (same_name(name, hwy::TargetName(t))) return t;
  }
  return 0;
}

// The refusal of a name: not a target at all, or one this CPU cannot run.
std::string refusal(std::string_view argument, std::string_view name, const std::vector<int64_t>& runnable) {
  if (find_target(compiled_targets(), name) != 0) {
    return fmt::format("{}: this CPU cannot run \"{}\"; expected one of {}", argument, name, joined_names(runnable));
  }
  return fmt::format("{}: expected one of {}, got \"{}\"", argument, joined_names(runnable), name);
}

// QKV_SIMD_TARGET, read once: the target it names (0 when unset or empty) or why it was refused.
struct Environment {
  int64_t ceiling = 0;
  std::string error;
};

const Environment& environment() {
  static const Environment env = [] {
    Environment e;
    const char* value = std::getenv(kEnvironmentVariable);
    if (value == nullptr || *value == '\0') return e;
    const std::vector<int64_t> runnable = cpu_targets();
    e.ceiling = find_target(runnable, value);
    if (e.ceiling == 0) e.error = refusal(kEnvironmentVariable, value, runnable);
    return e;
  }();
  return env;
}

// The targets callers may choose among: what the CPU runs, from QKV_SIMD_TARGET's down. For
// callers that have run prepare_simd_dispatch, which refuses a bad QKV_SIMD_TARGET.
std::vector<int64_t> available_targets() {
  const Environment& env = environment();
  std::vector<int64_t> targets = cpu_targets();
  // Highway gives better targets lower bits.
  std::erase_if(targets, [&](int64_t t) { return env.ceiling != 0 && t < env.ceiling; });
  return targets;
}

// The target that runs when none is forced: the environment's, else the CPU's best.
void apply_default_target() {
  g_forced_target = environment().ceiling;
  hwy::SetSupportedTargetsForTest(g_forced_target);
}

std::once_flag g_environment_applied;

}  // namespace

namespace detail {

void prepare_simd_dispatch() {
  const Environment& env = environment();
  if (!env.error.empty()) throw ValueError(env.error);
  // Every entry point comes here first, so nothing has been forced yet the first time.
  std::call_once(g_environment_applied, apply_default_target);
}

}  // namespace detail

std::vector<std::string> simd_targets() {
  detail::prepare_simd_dispatch();
  std::vector<std::string> names;
  for (const int64_t target : available_targets()) names.emplace_back(hwy::TargetName(target));
  return names;
}

// HWY_DYNAMIC_DISPATCH runs the lowest bit of SupportedTargets() & HWY_TARGETS: with a forced
// target that is the forced one, else the best.
std::string simd_target() {
  detail::prepare_simd_dispatch();
  return hwy::TargetName(hwy::SupportedAndGeneratedTargets().front());
}

void use_simd_target(std::string_view target) {
  detail::prepare_simd_dispatch();
  if (target.empty()) {
    apply_default_target();
    return;
  }
  const std::vector<int64_t> available = available_targets();
  const int64_t chosen = find_target(available, target);
  if (chosen == 0) throw ValueError(refusal("target", target, available));
  g_forced_target = chosen;
  hwy::SetSupportedTargetsForTest(chosen);
}

namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// "32K", "512K", "32M" as sysfs writes cache sizes.
int64_t parse_size(const std::string& text) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text.front()))) return 0;
  size_t end = 0;
  const int64_t value = std::stoll(text, &end);
  const char unit = end < text.size() ? static_cast<char>(std::toupper(static_cast<unsigned char>(text[end]))) : ' ';
  return unit == 'K' ? value << 10 : unit == 'M' ? value << 20 : unit == 'G' ? value << 30 : value;
}

CpuInfo read_cpu_info() {
  CpuInfo info{.model = "unknown"};
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      info.model = line.substr(line.find(':') + 2);
      break;
    }
  }
  // sysfs describes each cache of cpu0 (level, type, size); sysconf is the fallback where it is absent.
  for (int index = 0; index < 8; ++index) {
    const std::string dir = fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/", index);
    const std::string level = read_first_line(dir + "level");
    if (level.empty()) break;
    const std::string type = read_first_line(dir + "type");
    const int64_t size = parse_size(read_first_line(dir + "size"));
    if (level == "1" && type == "Data") info.l1d_bytes = size;
    if (level == "2" && type != "Instruction") info.l2_bytes = size;
    if (level == "3" && type != "Instruction") info.l3_bytes = size;
  }
  auto fallback = [](int64_t& field, int name) {
    if (field == 0) field = std::max<int64_t>(0, sysconf(name));
  };
  fallback(info.l1d_bytes, _SC_LEVEL1_DCACHE_SIZE);
  fallback(info.l2_bytes, _SC_LEVEL2_CACHE_SIZE);
  fallback(info.l3_bytes, _SC_LEVEL3_CACHE_SIZE);
  return info;
}

}  // namespace

const CpuInfo& cpu_info() {
  static const CpuInfo info = read_cpu_info();
  return info;
}

std::string cpu_summary() {
  const CpuInfo& cpu = cpu_info();
  return fmt::format("{}; caches L1d {}, L2 {}, L3 {}", cpu.model, format_bytes(static_cast<double>(cpu.l1d_bytes)),
                     format_bytes(static_cast<double>(cpu.l2_bytes)), format_bytes(static_cast<double>(cpu.l3_bytes)));
}

}  // namespace qkv
