// The benchmarks' warnings about the machine: a busy machine, a working set that fits in the cache.

#include <gtest/gtest.h>

#include "support/machine_checks.hpp"

namespace qkv {
namespace {

TEST(BusyMachineWarning, QuietWhenTheOtherProgramsFitInTheCoresLeftIdle) {
  EXPECT_FALSE(busy_machine_warning(0.3, 2, 2));
  EXPECT_FALSE(busy_machine_warning(1.4, 2, 1));  // one idle core takes the other program
  EXPECT_FALSE(busy_machine_warning(3.9, 8, 4));
}

TEST(BusyMachineWarning, SaysTheLoadTheCpusAndTheThreads) {
  const auto warning = busy_machine_warning(1.8, 2, 2);
  ASSERT_TRUE(warning);
  EXPECT_NE(warning->find("1.80 on 2 CPUs"), std::string::npos) << *warning;
  EXPECT_NE(warning->find("2 threads"), std::string::npos) << *warning;
  EXPECT_TRUE(busy_machine_warning(1.6, 2, 1));
  // More threads than CPUs leave no core idle.
  EXPECT_TRUE(busy_machine_warning(0.9, 2, 4));
}

TEST(CacheResidentWarning, OnlyWhenTheWorkingSetFitsAKnownCache) {
  const int64_t mib = 1 << 20;
  EXPECT_FALSE(cache_resident_warning("decode", 64.0 * mib, 32 * mib));
  EXPECT_FALSE(cache_resident_warning("decode", 1.0 * mib, 0));  // unknown cache: no claim
  const auto warning = cache_resident_warning("decode at Tk = 5 (K and V)", 40.0 * 1024, 32 * mib);
  ASSERT_TRUE(warning);
  EXPECT_NE(warning->find("decode at Tk = 5 (K and V) streams 40.0 KiB"), std::string::npos) << *warning;
  EXPECT_NE(warning->find("32.0 MiB"), std::string::npos) << *warning;
}

}  // namespace
}  // namespace qkv
