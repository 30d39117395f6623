#pragma once
// Shared by the row-wise ops (cross_entropy.cpp, layer_norm.cpp, linear.cpp) and the recurrent
// layers: a [..., N] view read as rows. Not installed.

#include <cstdint>

#include "qkv/core/tensor.hpp"

namespace qkv::rows {

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
