#pragma once
// Strided tensor views and an owning tensor: the only array types qkv's API takes.
//
// Shapes have rank 0 to 4. Attention ops see every operand as [B, H, T, D] (batch, heads, tokens,
// features); callers may pass rank 2 ([T, D]) or 3 ([H, T, D]) and the ops pad leading dims of 1.
// Strides count elements, not bytes. A stride of 0 repeats one slice: that is how a mask of shape
// [1, 1, Tq, Tk] is broadcast to [B, H, Tq, Tk] without a copy.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/memory.hpp"

namespace qkv {

inline constexpr int kMaxRank = 4;

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);

  int rank() const { return rank_; }
  int64_t operator[](int axis) const { return dims_[static_cast<size_t>(axis)]; }
  int64_t& operator[](int axis) { return dims_[static_cast<size_t>(axis)]; }
  // Size of the axis counted from the end: from_back(1) is the last dim.
  int64_t from_back(int n) const { return dims_[static_cast<size_t>(rank_ - n)]; }
  int64_t numel() const;
  std::span<const int64_t> dims() const { return {dims_.data(), static_cast<size_t>(rank_)}; }
  // "[2, 8, 128, 64]"
  std::string str() const;

  friend bool operator==(const Shape& a, const Shape& b);

 private:
  std::array<int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

using Strides = std::array<int64_t, kMaxRank>;

Strides contiguous_strides(const Shape& shape);

template <class T>
struct TensorView {
  T* data = nullptr;
  Shape shape;
  Strides strides{};

  int rank() const { return shape.rank(); }
  int64_t numel() const { return shape.numel(); }
  bool is_contiguous() const;

  // Element access for a view of rank 4, 3, 2 or 1 (no bounds checks: the API checked shapes).
  T& operator()(int64_t i) const { return data[i * strides[0]]; }
  T& operator()(int64_t i, int64_t j) const { return data[i * strides[0] + j * strides[1]]; }
  T& operator()(int64_t i, int64_t j, int64_t k) const {
    return data[i * strides[0] + j * strides[1] + k * strides[2]];
  }
  T& operator()(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return data[b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3]];
  }

  operator TensorView<const T>() const { return {data, shape, strides}; }  // NOLINT: implicit on purpose
};

template <class T>
TensorView<T> make_view(T* data, const Shape& shape) {
  return {data, shape, contiguous_strides(shape)};
}

// A contiguous, zero-initialised, owning tensor. One made from its shape takes huge pages where
// it is 4 MiB or more (advise_huge_pages), as kernels that stream it run faster from them.
template <class T>
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(const Shape& shape, T fill = T{}) : shape_(shape) {
    assign_on_huge_pages(values_, static_cast<size_t>(shape.numel()), fill);
  }
  Tensor(const Shape& shape, std::vector<T> values);

  const Shape& shape() const { return shape_; }
  int64_t numel() const { return static_cast<int64_t>(values_.size()); }
  T* data() { return values_.data(); }
  const T* data() const { return values_.data(); }
  std::vector<T>& values() { return values_; }
  const std::vector<T>& values() const { return values_; }
  T& operator[](int64_t flat) { return values_[static_cast<size_t>(flat)]; }
  const T& operator[](int64_t flat) const { return values_[static_cast<size_t>(flat)]; }

  TensorView<T> view() { return make_view(values_.data(), shape_); }
  TensorView<const T> view() const { return make_view(values_.data(), shape_); }
  TensorView<const T> cview() const { return view(); }

 private:
  Shape shape_;
  std::vector<T> values_;
};

// Copies any view (strided or broadcast) into a contiguous tensor, converting the element type.
template <class To, class From>
Tensor<To> to_tensor(TensorView<const From> view);

// The view with leading dims of size 1 added until its rank is 4.
template <class T>
TensorView<T> as_rank4(TensorView<T> view);

// The view seen as [B, H, T, D]: leading dims of size 1 are added in front of a rank-2 or rank-3
// view. `name` is the argument name used in the error raised for rank < 2 or > 4.
template <class T>
TensorView<T> as_bhtd(TensorView<T> view, std::string_view name);

// The view broadcast to `target` by numpy's rule (align trailing dims; size-1 dims repeat with
// stride 0). Throws ShapeError naming `name`, its shape and the target when it does not broadcast.
template <class T>
TensorView<T> broadcast_to(TensorView<T> view, const Shape& target, std::string_view name);

// The first `leading_rank` dims of `shape` followed by `tail`: the shape of a result that keeps an
// argument's leading (batch) dims, e.g. leading_dims_with(q.shape, q.rank() - 2, {Tq, Dv}).
Shape leading_dims_with(const Shape& shape, int leading_rank, std::initializer_list<int64_t> tail = {});

// Throws ShapeError "`name`: expected shape E, got A" when the shapes differ.
void check_shape(std::string_view name, const Shape& actual, const Shape& expected);

// Throws ShapeError when the last dim of `view` is not contiguous (stride 1, or size 1).
template <class T>
void check_last_dim_contiguous(TensorView<T> view, std::string_view name);

// "[0, 2, 1]": the index of element `flat` of a C-order array of `shape`.
std::string index_str(const Shape& shape, int64_t flat);

// Which non-finite values an input may hold.
enum class NonFinite {
  refused,
  minus_infinity_allowed,  // an additive mask bias, where −inf means "masked"
};

// Throws ValueError "`name`: expected finite values, got 3 non-finite values (the first: nan at
// [0, 2, 1])" when `values` holds a NaN or an infinity that `rule` does not allow; `remedy`, when
// given, is appended after a semicolon ("pass --allow-nonfinite to accept them").
template <class T>
void check_finite(TensorView<const T> values, std::string_view name, NonFinite rule = NonFinite::refused,
                  std::string_view remedy = {});

}  // namespace qkv
