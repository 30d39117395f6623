#pragma once
// The one way qkv's kernels use threads: parallel_for over OpenMP's thread pool. Kernels never
// create threads; they size per-thread scratch by max_workers() and index it by `worker`.
//
// Results must not depend on which worker runs a task: a task's output may depend only on the
// task index, so that any thread count gives bit-identical results.
//
// The one threading policy: a job's work is counted in multiply-adds (or element operations of
// about that cost). A job of less than kMinParallelWork runs on the calling thread: waking the
// pool costs microseconds, and far more while the cores are busy, which would outweigh it. A job
// split into blocks of items (parallel_for_blocks) gets tasks of about kTaskWork each, so that
// handing out a task costs little next to the work in it.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <type_traits>

namespace qkv {

// The number of threads parallel_for may use (OpenMP's max threads), at least 1.
int max_workers();

// Makes later parallel_for calls from this thread use at most `workers` threads (omp_set_num_threads).
// Throws ValueError when `workers` < 1.
void set_max_workers(int workers);

// Calls fn(task, worker) once for every task in [0, num_tasks), spread over up to max_workers()
// threads (and at most `max_threads` when that is positive: 1 keeps a job too small to be worth
// waking threads for on the calling thread), tasks handed out one at a time in increasing order so
// that uneven tasks balance. worker is in [0, max_workers()) and no two concurrent calls share one.
// Called from inside a parallel region it runs the tasks on the calling thread with worker 0. The
// first exception a task throws is rethrown here once every thread has stopped.
void parallel_for(int64_t num_tasks, const std::function<void(int64_t task, int worker)>& fn, int max_threads = 0);

inline constexpr double kMinParallelWork = 1 << 20;  // ≈ 10 µs of vectorised multiply-adds
inline constexpr int64_t kTaskWork = int64_t{1} << 15;

// The max_threads argument of parallel_for for a job of `work`: 1 below kMinParallelWork, else
// 0 (every worker).
inline int thread_limit(double work) { return work < kMinParallelWork ? 1 : 0; }

// Runs fn(begin, end) or fn(begin, end, worker) over [0, count) in blocks of items that each cost
// `work_per_item`, by the policy above.
template <class Fn>
void parallel_for_blocks(int64_t count, int64_t work_per_item, Fn&& fn) {
  const int64_t per_task = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(work_per_item, 1));
  const int64_t tasks = (count + per_task - 1) / per_task;
  parallel_for(
      tasks,
      [&](int64_t task, int worker) {
        const int64_t begin = task * per_task, end = std::min(count, (task + 1) * per_task);
        if constexpr (std::is_invocable_v<Fn&, int64_t, int64_t, int>) {
          fn(begin, end, worker);
        } else {
          fn(begin, end);
        }
      },
      thread_limit(static_cast<double>(count) * static_cast<double>(work_per_item)));
}

}  // namespace qkv
