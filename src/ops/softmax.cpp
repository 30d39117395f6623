#include "qkv/ops/softmax.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "qkv/core/error.hpp"

namespace qkv {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// A [..., N] view read as rows of N: row r of the view padded to [A, B, C, N].
template <class T>
class Rows {
 public:
  Rows(TensorView<T> view, std::string_view name) : view_(as_rank4(view)) {
    if (view.rank() < 1) throw ShapeError(fmt::format("{}: expected shape [..., N], got a scalar", name));
  }
  int64_t count() const { return view_.shape[0] * view_.shape[1] * view_.shape[2]; }
  int64_t length() const { return view_.shape[3]; }
  T& at(int64_t r, int64_t j) const {
    const int64_t c = r % view_.shape[2];
    const int64_t b = (r / view_.shape[2]) % view_.shape[1];
    const int64_t a = r / (view_.shape[2] * view_.shape[1]);
    return view_(a, b, c, j);
  }

 private:
  TensorView<T> view_;
};

// Element `flat` (row-major order) of a view padded to rank 4.
template <class T>
T& at_flat(const TensorView<T>& v4, int64_t flat) {
  const int64_t d = flat % v4.shape[3];
  const int64_t c = (flat / v4.shape[3]) % v4.shape[2];
  const int64_t b = (flat / (v4.shape[3] * v4.shape[2])) % v4.shape[1];
  const int64_t a = flat / (v4.shape[3] * v4.shape[2] * v4.shape[1]);
  return v4(a, b, c, d);
}

// The leading dims of a [..., N] shape: the shape of its per-row quantities.
Shape row_shape(const Shape& shape) { return leading_dims_with(shape, shape.rank() - 1); }

// The one softmax of a row of n scores, in float64: x(j) reads score j, y(j, value) stores weight
// j, and the row's log-sum-exp is returned. A row of −inf (every key masked) or an empty row gets
// weights 0 and lse −inf, never NaN.
// The max of a row and Σ_j exp(x_j − max); the sum is 0 for a row of −inf or an empty row.
struct RowStats {
  double max = kNegInf;
  double sum = 0.0;
  double lse() const { return max == kNegInf ? kNegInf : max + std::log(sum); }
};

template <class Load>
RowStats row_stats(int64_t n, Load&& x) {
  RowStats stats;
  // A NaN score makes the max NaN, so that it reaches every weight (as in the fused kernel) rather
  // than leaving a row of NaN looking like a row of masked keys.
  for (int64_t j = 0; j < n; ++j) {
    const double xj = static_cast<double>(x(j));
    if (xj > stats.max || std::isnan(xj)) stats.max = std::isnan(stats.max) ? stats.max : xj;
  }
  if (stats.max == kNegInf) return stats;  // guards −inf − (−inf) below
  for (int64_t j = 0; j < n; ++j) stats.sum += std::exp(static_cast<double>(x(j)) - stats.max);
  return stats;
}

template <class Load, class Store>
double softmax_of_row(int64_t n, Load&& x, Store&& y) {
  const RowStats stats = row_stats(n, x);
  const double max = stats.max, sum = stats.sum;
  if (max == kNegInf) {
    for (int64_t j = 0; j < n; ++j) y(j, 0.0);
    return kNegInf;
  }
  // exp(x − max) / Σ rather than exp(x − lse): lse carries an absolute error of ε·|lse|, which for
  // large scores would become a relative error of every weight.
  for (int64_t j = 0; j < n; ++j) y(j, std::exp(static_cast<double>(x(j)) - max) / sum);
  return stats.lse();
}

}  // namespace

template <class T>
double logsumexp(std::span<const T> row) {
  return row_stats(static_cast<int64_t>(row.size()), [&](int64_t j) { return row[static_cast<size_t>(j)]; }).lse();
}

template <class T>
double softmax(std::span<const T> x, std::span<T> y) {
  if (y.size() != x.size()) {
    throw ShapeError(fmt::format("y: expected {} elements like x, got {}", x.size(), y.size()));
  }
  return softmax_of_row(
      static_cast<int64_t>(x.size()), [&](int64_t j) { return x[static_cast<size_t>(j)]; },
      [&](int64_t j, double w) { y[static_cast<size_t>(j)] = static_cast<T>(w); });
}

template <class T>
void softmax_forward(TensorView<const T> x, TensorView<T> y, std::optional<TensorView<T>> lse) {
  const Rows<const T> xs(x, "x");
  check_shape("y", y.shape, x.shape);
  if (lse) check_shape("lse", lse->shape, row_shape(x.shape));
  const Rows<T> ys(y, "y");
  for (int64_t r = 0; r < xs.count(); ++r) {
    const double row_lse = softmax_of_row(
        xs.length(), [&](int64_t j) { return xs.at(r, j); },
        [&](int64_t j, double w) { ys.at(r, j) = static_cast<T>(w); });
    if (lse) at_flat(as_rank4(*lse), r) = static_cast<T>(row_lse);
  }
}

template <class T>
void softmax_backward(TensorView<const T> y, TensorView<const T> dy, TensorView<T> dx) {
  check_shape("dy", dy.shape, y.shape);
  check_shape("dx", dx.shape, y.shape);
  const Rows<const T> ys(y, "y");
  const Rows<const T> dys(dy, "dy");
  const Rows<T> dxs(dx, "dx");
  for (int64_t r = 0; r < ys.count(); ++r) {
    // ∂y_j/∂x_k = y_j (δ_jk − y_k), so ∂L/∂x_k = y_k (dy_k − Σ_j dy_j y_j).
    double dot = 0.0;
    for (int64_t j = 0; j < ys.length(); ++j)
      dot += static_cast<double>(dys.at(r, j)) * static_cast<double>(ys.at(r, j));
    for (int64_t j = 0; j < ys.length(); ++j) {
      const double yj = ys.at(r, j);
      dxs.at(r, j) += static_cast<T>(yj * (static_cast<double>(dys.at(r, j)) - dot));
    }
  }
}

template <class T>
void logsumexp_backward(TensorView<const T> x, TensorView<const T> lse, TensorView<const T> dlse, TensorView<T> dx) {
  const Shape rows_shape = row_shape(x.shape);
  check_shape("lse", lse.shape, rows_shape);
  check_shape("dlse", dlse.shape, rows_shape);
  check_shape("dx", dx.shape, x.shape);
  const Rows<const T> xs(x, "x");
  const Rows<T> dxs(dx, "dx");
  // ∂lse/∂x_j = exp(x_j − lse) = softmax(x)_j; an empty row has no gradient.
  for (int64_t r = 0; r < xs.count(); ++r) {
    const double row_lse = at_flat(as_rank4(lse), r);
    if (row_lse == kNegInf) continue;
    const double g = at_flat(as_rank4(dlse), r);
    for (int64_t j = 0; j < xs.length(); ++j) {
      dxs.at(r, j) += static_cast<T>(g * std::exp(static_cast<double>(xs.at(r, j)) - row_lse));
    }
  }
}

#define QKV_INSTANTIATE_SOFTMAX(T)                                                                 \
  template double logsumexp(std::span<const T>);                                                   \
  template double softmax(std::span<const T>, std::span<T>);                                       \
  template void softmax_forward(TensorView<const T>, TensorView<T>, std::optional<TensorView<T>>); \
  template void softmax_backward(TensorView<const T>, TensorView<const T>, TensorView<T>);         \
  template void logsumexp_backward(TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<T>);

QKV_INSTANTIATE_SOFTMAX(float)
QKV_INSTANTIATE_SOFTMAX(double)
#undef QKV_INSTANTIATE_SOFTMAX

}  // namespace qkv
