// The one instruction-set setting of the Highway kernels (attention_fused.cpp, linear.cpp).

#include "qkv/simd_target.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/error.hpp"

// HWY_TARGETS, the set Highway compiles and dispatches among, follows from HWY_DISABLED_TARGETS,
// which CMakeLists.txt defines for all of libqkv: the names listed here are the ones the kernels
// were compiled for, and the best of them is the one their dispatch picks.
#include "hwy/targets.h"

namespace qkv {
namespace {

// The target forced by use_simd_target, 0 when none. Highway's own mock (SetSupportedTargetsForTest)
// holds the same choice; this copy is what lets simd_targets() lift it for a moment.
int64_t g_forced_target = 0;

// Best first: Highway gives better targets lower bits, and SupportedAndGeneratedTargets lists them
// from the lowest. The mock, when set, would hide every target but the forced one.
std::vector<int64_t> supported_targets() {
  if (g_forced_target != 0) hwy::SetSupportedTargetsForTest(0);
  std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  if (g_forced_target != 0) hwy::SetSupportedTargetsForTest(g_forced_target);
  return targets;
}

}  // namespace

std::vector<std::string> simd_targets() {
  std::vector<std::string> names;
  for (const int64_t target : supported_targets()) names.emplace_back(hwy::TargetName(target));
  return names;
}

// HWY_DYNAMIC_DISPATCH runs the lowest bit of SupportedTargets() & HWY_TARGETS: with a forced
// target that is the forced one, else the best.
std::string simd_target() { return hwy::TargetName(hwy::SupportedAndGeneratedTargets().front()); }

void use_simd_target(std::string_view target) {
  if (target.empty()) {
    g_forced_target = 0;
    hwy::SetSupportedTargetsForTest(0);
    return;
  }
  std::string available;
  for (const int64_t t : supported_targets()) {
    if (target == hwy::TargetName(t)) {
      g_forced_target = t;
      hwy::SetSupportedTargetsForTest(t);
      return;
    }
    available += fmt::format("{}{}", available.empty() ? "" : ", ", hwy::TargetName(t));
  }
  throw ValueError(fmt::format("target: expected one of {}, got \"{}\"", available, target));
}

}  // namespace qkv
