#include "qkv/core/parallel.hpp"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>

#include "qkv/core/cancel.hpp"
#include "qkv/core/error.hpp"

namespace qkv {
namespace {

// The `requested` function of the innermost CancelScope of this thread; null outside every scope.
thread_local bool (*cancel_requested)() = nullptr;

}  // namespace

Cancelled::Cancelled() : std::runtime_error("cancelled") {}

CancelScope::CancelScope(bool (*requested)()) : previous_(cancel_requested) { cancel_requested = requested; }

CancelScope::~CancelScope() { cancel_requested = previous_; }

int max_workers() { return std::max(omp_get_max_threads(), 1); }

void set_max_workers(int workers) {
  if (workers < 1) throw ValueError(fmt::format("workers: expected at least 1, got {}", workers));
  omp_set_num_threads(workers);
}

void parallel_for(int64_t num_tasks, const std::function<void(int64_t task, int worker)>& fn, int max_threads) {
  if (num_tasks <= 0) return;
  const int limit = max_threads > 0 ? std::min(max_threads, max_workers()) : max_workers();
  const int threads = static_cast<int>(std::min<int64_t>(limit, num_tasks));
  // Read here, on the calling thread: the pool's threads have scopes of their own (none).
  bool (*const requested)() = cancel_requested;
  if (threads == 1 || omp_in_parallel()) {
    for (int64_t task = 0; task < num_tasks; ++task) {
      if (requested && requested()) throw Cancelled();
      fn(task, 0);
    }
    return;
  }
  // An exception may not leave an OpenMP region: the first one is kept, later tasks are skipped.
  std::exception_ptr error;
  std::mutex error_mutex;
  std::atomic<bool> failed{false};
  std::atomic<bool> cancelled{false};
#pragma omp parallel num_threads(threads)
  {
    const int worker = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      if (failed.load(std::memory_order_relaxed) || cancelled.load(std::memory_order_relaxed)) continue;
      if (requested && requested()) {
        cancelled.store(true, std::memory_order_relaxed);
        continue;
      }
      try {
        fn(task, worker);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
      }
    }
  }
  if (error) std::rethrow_exception(error);
  if (cancelled.load(std::memory_order_relaxed)) throw Cancelled();
}

}  // namespace qkv
