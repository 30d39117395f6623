// CancelScope: a set flag stops parallel_for before its next task, on one thread and on several.

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>

#include "qkv/core/cancel.hpp"
#include "qkv/core/parallel.hpp"

namespace qkv {
namespace {

std::atomic<bool> stop{false};
bool stop_requested() { return stop.load(); }
bool never() { return false; }

class CancelTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    stop = false;
    set_max_workers(GetParam());
  }
  void TearDown() override { set_max_workers(saved_workers_); }

 private:
  int saved_workers_ = max_workers();
};

TEST_P(CancelTest, WithoutAScopeEveryTaskRuns) {
  std::atomic<int64_t> ran{0};
  parallel_for(100, [&](int64_t, int) { ++ran; });
  EXPECT_EQ(ran.load(), 100);
}

TEST_P(CancelTest, AScopeThatNeverAsksChangesNothing) {
  const CancelScope scope(never);
  std::atomic<int64_t> ran{0};
  parallel_for(100, [&](int64_t, int) { ++ran; });
  EXPECT_EQ(ran.load(), 100);
}

TEST_P(CancelTest, ARequestSkipsTheRemainingTasksAndThrowsCancelled) {
  const CancelScope scope(stop_requested);
  std::atomic<int64_t> ran{0};
  EXPECT_THROW(parallel_for(100000,
                            [&](int64_t task, int) {
                              ++ran;
                              if (task == 10) stop = true;
                            }),
               Cancelled);
  // A task asks before it starts: on one thread, exactly those up to the one that raised the flag
  // ran; on two, the other thread may have started a few more before it saw the flag.
  if (GetParam() == 1) {
    EXPECT_EQ(ran.load(), 11);
  } else {
    EXPECT_LT(ran.load(), 1000);
  }
}

TEST_P(CancelTest, TheScopeEndsWithItsLifetime) {
  stop = true;
  {
    const CancelScope scope(stop_requested);
    EXPECT_THROW(parallel_for(4, [](int64_t, int) {}), Cancelled);
  }
  std::atomic<int64_t> ran{0};
  parallel_for(4, [&](int64_t, int) { ++ran; });
  EXPECT_EQ(ran.load(), 4);
}

TEST_P(CancelTest, TheInnermostScopeIsAsked) {
  stop = true;
  const CancelScope outer(stop_requested);
  {
    const CancelScope inner(never);
    std::atomic<int64_t> ran{0};
    parallel_for(4, [&](int64_t, int) { ++ran; });
    EXPECT_EQ(ran.load(), 4);
  }
  EXPECT_THROW(parallel_for(4, [](int64_t, int) {}), Cancelled);
}

INSTANTIATE_TEST_SUITE_P(Threads, CancelTest, ::testing::Values(1, 2), [](const ::testing::TestParamInfo<int>& param) {
  return std::to_string(param.param) + "Threads";
});

}  // namespace
}  // namespace qkv
