#pragma once
// The one way qkv's kernels use threads: parallel_for over OpenMP's thread pool. Kernels never
// create threads; they size per-thread scratch by max_workers() and index it by `worker`.
//
// Results must not depend on which worker runs a task: a task's output may depend only on the
// task index, so that any thread count gives bit-identical results.

#include <cstdint>
#include <functional>

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

}  // namespace qkv
