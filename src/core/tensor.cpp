#include "qkv/core/tensor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"

namespace qkv {

template <class T>
TensorView<T> as_rank4(TensorView<T> view) {
  const int missing = kMaxRank - view.rank();
  std::array<int64_t, kMaxRank> dims{};
  Strides strides{};
  for (int i = 0; i < kMaxRank; ++i) {
    const auto axis = static_cast<size_t>(i);
    dims[axis] = i < missing ? 1 : view.shape[i - missing];
    strides[axis] = i < missing ? 0 : view.strides[static_cast<size_t>(i - missing)];
  }
  return {view.data, Shape(std::span<const int64_t>(dims)), strides};
}

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  if (dims.size() > static_cast<size_t>(kMaxRank)) {
    throw ShapeError(fmt::format("shape of rank {} given; qkv tensors have rank at most {}", dims.size(), kMaxRank));
  }
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] < 0) throw ShapeError(fmt::format("shape dimension {} is negative ({})", i, dims[i]));
    dims_[i] = dims[i];
  }
  rank_ = static_cast<int>(dims.size());
  // Strides are products of trailing dims and a zero dim does not make them small, so a shape is
  // refused whenever the product of its non-zero dims overflows, empty or not.
  int64_t product = 1;
  for (const int64_t dim : this->dims()) {
    if (dim != 0 && __builtin_mul_overflow(product, dim, &product)) {
      throw ShapeError(fmt::format("shape {}: the product of its non-zero dims does not fit in 64 bits", str()));
    }
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (const int64_t dim : dims()) {
    if (dim == 0) return 0;
    // Reachable only through the mutable operator[], past the constructor's check.
    if (__builtin_mul_overflow(n, dim, &n)) {
      throw ShapeError(fmt::format("shape {} has more elements than fit in 64 bits", str()));
    }
  }
  return n;
}

std::string Shape::str() const { return fmt::format("[{}]", fmt::join(dims(), ", ")); }

bool operator==(const Shape& a, const Shape& b) {
  if (a.rank_ != b.rank_) return false;
  for (int i = 0; i < a.rank_; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

Strides contiguous_strides(const Shape& shape) {
  Strides strides{};
  int64_t stride = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    strides[static_cast<size_t>(i)] = stride;
    // Shape's mutable operator[] can grow a dim after the constructor checked it. The product
    // with the first dim is no stride, so it is not formed.
    if (i > 0 && __builtin_mul_overflow(stride, shape[i], &stride)) {
      throw ShapeError(fmt::format("shape {}: its contiguous strides do not fit in 64 bits", shape.str()));
    }
  }
  return strides;
}

template <class T>
bool TensorView<T>::is_contiguous() const {
  const Strides expected = contiguous_strides(shape);
  for (int i = 0; i < shape.rank(); ++i) {
    if (shape[i] > 1 && strides[static_cast<size_t>(i)] != expected[static_cast<size_t>(i)]) return false;
  }
  return true;
}

template <class T>
Tensor<T>::Tensor(const Shape& shape, std::vector<T> values) : shape_(shape), values_(std::move(values)) {
  if (static_cast<int64_t>(values_.size()) != shape.numel()) {
    throw ShapeError(
        fmt::format("tensor of shape {} needs {} values, got {}", shape.str(), shape.numel(), values_.size()));
  }
}

template <class To, class From>
Tensor<To> to_tensor(TensorView<const From> view) {
  const TensorView<const From> v4 = as_rank4(view);
  Tensor<To> result(view.shape);
  int64_t flat = 0;
  for (int64_t a = 0; a < v4.shape[0]; ++a)
    for (int64_t b = 0; b < v4.shape[1]; ++b)
      for (int64_t c = 0; c < v4.shape[2]; ++c)
        for (int64_t d = 0; d < v4.shape[3]; ++d) result[flat++] = static_cast<To>(v4(a, b, c, d));
  return result;
}

Shape leading_dims_with(const Shape& shape, int leading_rank, std::initializer_list<int64_t> tail) {
  std::vector<int64_t> dims(shape.dims().begin(), shape.dims().begin() + leading_rank);
  dims.insert(dims.end(), tail.begin(), tail.end());
  return Shape(std::span<const int64_t>(dims));
}

template <class T>
TensorView<T> as_bhtd(TensorView<T> view, std::string_view name) {
  if (view.rank() < 2 || view.rank() > 4) {
    throw ShapeError(fmt::format("{}: expected rank 2 to 4 ([..., T, D]), got shape {}", name, view.shape.str()));
  }
  return as_rank4(view);
}

template <class T>
TensorView<T> broadcast_to(TensorView<T> view, const Shape& target, std::string_view name) {
  if (view.rank() > target.rank()) {
    throw ShapeError(fmt::format("{}: shape {} does not broadcast to {}", name, view.shape.str(), target.str()));
  }
  TensorView<T> result{view.data, target, {}};
  const int offset = target.rank() - view.rank();
  for (int i = 0; i < target.rank(); ++i) {
    const auto axis = static_cast<size_t>(i);
    if (i < offset) {
      result.strides[axis] = 0;
      continue;
    }
    const int64_t size = view.shape[i - offset];
    if (size == target[i]) {
      result.strides[axis] = view.strides[static_cast<size_t>(i - offset)];
    } else if (size == 1) {
      result.strides[axis] = 0;
    } else {
      throw ShapeError(fmt::format("{}: shape {} does not broadcast to {}", name, view.shape.str(), target.str()));
    }
  }
  return result;
}

void check_shape(std::string_view name, const Shape& actual, const Shape& expected) {
  if (!(actual == expected)) {
    throw ShapeError(fmt::format("{}: expected shape {}, got {}", name, expected.str(), actual.str()));
  }
}

template <class T>
void check_last_dim_contiguous(TensorView<T> view, std::string_view name) {
  if (view.rank() > 0 && view.shape.from_back(1) > 1 && view.strides[static_cast<size_t>(view.rank() - 1)] != 1) {
    throw ShapeError(fmt::format("{}: the last dim must be contiguous (stride 1), got stride {}", name,
                                 view.strides[static_cast<size_t>(view.rank() - 1)]));
  }
}

std::string index_str(const Shape& shape, int64_t flat) {
  std::vector<int64_t> index(static_cast<size_t>(shape.rank()));
  for (int axis = shape.rank() - 1; axis >= 0; --axis) {
    const int64_t size = std::max<int64_t>(shape[axis], 1);
    index[static_cast<size_t>(axis)] = flat % size;
    flat /= size;
  }
  return fmt::format("[{}]", fmt::join(index, ", "));
}

namespace {

// Whether every value of the row passes `rule`. The check runs on every input of every call, so it
// must cost little next to the op: on the bits, an exponent of all ones (infinity or NaN) carries
// into the sign bit when one is added to it, and an OR of those carries over the row is a
// branch-free reduction that the compiler vectorises on any x86 target.
template <class T>
bool row_passes(const T* row, int64_t n, int64_t stride, NonFinite rule) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr int kMantissa = std::numeric_limits<T>::digits - 1;
  constexpr Bits kSign = Bits{1} << (sizeof(T) * 8 - 1);
  constexpr Bits kExponent = ~kSign & ~((Bits{1} << kMantissa) - 1);
  constexpr Bits kExponentOne = Bits{1} << kMantissa;
  const Bits minus_infinity = std::bit_cast<Bits>(-std::numeric_limits<T>::infinity());
  const bool minus_infinity_allowed = rule == NonFinite::minus_infinity_allowed;
  Bits bad = 0;
  if (stride == 1 && !minus_infinity_allowed) {
    for (int64_t i = 0; i < n; ++i) bad |= ((std::bit_cast<Bits>(row[i]) & kExponent) + kExponentOne) & kSign;
    return bad == 0;
  }
  for (int64_t i = 0; i < n; ++i) {
    const Bits bits = std::bit_cast<Bits>(row[i * stride]);
    const Bits nonfinite = ((bits & kExponent) + kExponentOne) & kSign;
    bad |= (minus_infinity_allowed && bits == minus_infinity) ? 0 : nonfinite;
  }
  return bad == 0;
}

}  // namespace

template <class T>
void check_finite(TensorView<const T> values, std::string_view name, NonFinite rule, std::string_view remedy) {
  const TensorView<const T> v4 = as_rank4(values);
  bool all_pass = true;
  if (values.is_contiguous()) {
    // One long row, in blocks over the threads: short rows would pay their loop's set-up and
    // reduction each, and one thread reads memory at a fraction of its bandwidth. Which block
    // fails does not matter, so the result is the same for any thread count.
    std::atomic<bool> failed{false};
    parallel_for_blocks(values.numel(), 1, [&](int64_t begin, int64_t end) {
      if (!row_passes(values.data + begin, end - begin, 1, rule)) failed.store(true, std::memory_order_relaxed);
    });
    all_pass = !failed.load();
  } else {
    for (int64_t a = 0; a < v4.shape[0]; ++a)
      for (int64_t b = 0; b < v4.shape[1]; ++b)
        for (int64_t c = 0; c < v4.shape[2]; ++c)
          all_pass &= row_passes(&v4(a, b, c, 0), v4.shape[3], v4.strides[3], rule);
  }
  if (all_pass) return;
  // Only a refusal pays for counting and for finding the first offender.
  int64_t count = 0;
  int64_t first = -1;
  T first_value = 0;
  int64_t flat = 0;
  for (int64_t a = 0; a < v4.shape[0]; ++a)
    for (int64_t b = 0; b < v4.shape[1]; ++b)
      for (int64_t c = 0; c < v4.shape[2]; ++c)
        for (int64_t d = 0; d < v4.shape[3]; ++d, ++flat) {
          const T x = v4(a, b, c, d);
          if (std::isfinite(x)) continue;
          if (rule == NonFinite::minus_infinity_allowed && x == -std::numeric_limits<T>::infinity()) continue;
          if (count++ == 0) {
            first = flat;
            first_value = x;
          }
        }
  const std::string_view allowed =
      rule == NonFinite::minus_infinity_allowed ? "finite values or -inf" : "finite values";
  throw ValueError(fmt::format("{}: expected {}, got {} non-finite value{} (the first: {} at {}){}{}", name, allowed,
                               count, count == 1 ? "" : "s", first_value, index_str(values.shape, first),
                               remedy.empty() ? "" : "; ", remedy));
}

template void check_finite(TensorView<const float>, std::string_view, NonFinite, std::string_view);
template void check_finite(TensorView<const double>, std::string_view, NonFinite, std::string_view);

#define QKV_INSTANTIATE_VIEW(T)                                                                   \
  template struct TensorView<T>;                                                                  \
  template struct TensorView<const T>;                                                            \
  template class Tensor<T>;                                                                       \
  template TensorView<T> as_rank4(TensorView<T>);                                                 \
  template TensorView<const T> as_rank4(TensorView<const T>);                                     \
  template TensorView<T> as_bhtd(TensorView<T>, std::string_view);                                \
  template TensorView<const T> as_bhtd(TensorView<const T>, std::string_view);                    \
  template TensorView<T> broadcast_to(TensorView<T>, const Shape&, std::string_view);             \
  template TensorView<const T> broadcast_to(TensorView<const T>, const Shape&, std::string_view); \
  template void check_last_dim_contiguous(TensorView<T>, std::string_view);                       \
  template void check_last_dim_contiguous(TensorView<const T>, std::string_view);

QKV_INSTANTIATE_VIEW(float)
QKV_INSTANTIATE_VIEW(double)
QKV_INSTANTIATE_VIEW(uint8_t)
QKV_INSTANTIATE_VIEW(int64_t)
QKV_INSTANTIATE_VIEW(uint16_t)
QKV_INSTANTIATE_VIEW(int8_t)
#undef QKV_INSTANTIATE_VIEW

template Tensor<float> to_tensor<float, float>(TensorView<const float>);
template Tensor<float> to_tensor<float, double>(TensorView<const double>);
template Tensor<double> to_tensor<double, float>(TensorView<const float>);
template Tensor<double> to_tensor<double, double>(TensorView<const double>);
template Tensor<uint8_t> to_tensor<uint8_t, uint8_t>(TensorView<const uint8_t>);
template Tensor<int64_t> to_tensor<int64_t, int64_t>(TensorView<const int64_t>);

}  // namespace qkv
