#pragma once
// Internal to the row-wise ops (cross_entropy.cpp, layer_norm.cpp, linear.cpp, the recurrent
// layers): a [..., N] view read as rows and the blocking of row loops into parallel tasks. Not
// installed.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "qkv/core/parallel.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv::rows {

// Runs fn(begin, end) or fn(begin, end, worker) over [0, count) in blocks of about
// task_work / work_per_item items, so that handing out a task costs little next to the work in it.
template <class Fn>
void for_each_block(int64_t count, int64_t work_per_item, int64_t task_work, Fn&& fn) {
  const int64_t per_task = std::max<int64_t>(1, task_work / std::max<int64_t>(work_per_item, 1));
  const int64_t tasks = (count + per_task - 1) / per_task;
  parallel_for(tasks, [&](int64_t task, int worker) {
    const int64_t begin = task * per_task, end = std::min(count, (task + 1) * per_task);
    if constexpr (std::is_invocable_v<Fn&, int64_t, int64_t, int>) {
      fn(begin, end, worker);
    } else {
      fn(begin, end);
    }
  });
}

// A [..., N] view read as rows of N elements: row r is the r-th leading index in row-major order.
template <class T>
class Rows {
 public:
  explicit Rows(TensorView<T> view) : view_(as_rank4(view)) {}
  int64_t count() const { return view_.shape[0] * view_.shape[1] * view_.shape[2]; }
  // Distance in elements between neighbours within a row.
  int64_t step() const { return view_.strides[3]; }
  T* row(int64_t r) const {
    const int64_t c = r % view_.shape[2];
    const int64_t b = (r / view_.shape[2]) % view_.shape[1];
    const int64_t a = r / (view_.shape[2] * view_.shape[1]);
    return view_.data + a * view_.strides[0] + b * view_.strides[1] + c * view_.strides[2];
  }

 private:
  TensorView<T> view_;
};

}  // namespace qkv::rows
