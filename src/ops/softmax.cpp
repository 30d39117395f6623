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
Shape row_shape(const Shape& shape) {
  return Shape(std::span<const int64_t>(shape.dims().data(), static_cast<size_t>(shape.rank() - 1)));
}

template <class T>
double row_logsumexp(const Rows<T>& rows, int64_t r) {
  double max = kNegInf;
  for (int64_t j = 0; j < rows.length(); ++j) max = std::max(max, static_cast<double>(rows.at(r, j)));
  if (max == kNegInf) return kNegInf;  // guards −inf − (−inf) below
  double sum = 0.0;
  for (int64_t j = 0; j < rows.length(); ++j) sum += std::exp(static_cast<double>(rows.at(r, j)) - max);
  return max + std::log(sum);
}

}  // namespace

template <class T>
double logsumexp(std::span<const T> row) {
  const TensorView<const T> view = make_view(row.data(), Shape{static_cast<int64_t>(row.size())});
  return row_logsumexp(Rows<const T>(view, "row"), 0);
}

template <class T>
void softmax_forward(TensorView<const T> x, TensorView<T> y, std::optional<TensorView<T>> lse) {
  const Rows<const T> xs(x, "x");
  check_shape("y", y.shape, x.shape);
  if (lse) check_shape("lse", lse->shape, row_shape(x.shape));
  const Rows<T> ys(y, "y");
  for (int64_t r = 0; r < xs.count(); ++r) {
    double max = kNegInf;
    for (int64_t j = 0; j < xs.length(); ++j) max = std::max(max, static_cast<double>(xs.at(r, j)));
    // exp(x − max) / Σ rather than exp(x − lse): lse carries an absolute error of ε·|lse|, which for
    // large scores would become a relative error of every weight.
    double sum = 0.0;
    if (max != kNegInf) {
      for (int64_t j = 0; j < xs.length(); ++j) sum += std::exp(static_cast<double>(xs.at(r, j)) - max);
    }
    for (int64_t j = 0; j < xs.length(); ++j) {
      ys.at(r, j) = max == kNegInf ? T{0} : static_cast<T>(std::exp(static_cast<double>(xs.at(r, j)) - max) / sum);
    }
    if (lse) at_flat(as_rank4(*lse), r) = static_cast<T>(max == kNegInf ? kNegInf : max + std::log(sum));
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
  template void softmax_forward(TensorView<const T>, TensorView<T>, std::optional<TensorView<T>>); \
  template void softmax_backward(TensorView<const T>, TensorView<const T>, TensorView<T>);         \
  template void logsumexp_backward(TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<T>);

QKV_INSTANTIATE_SOFTMAX(float)
QKV_INSTANTIATE_SOFTMAX(double)
#undef QKV_INSTANTIATE_SOFTMAX

}  // namespace qkv
