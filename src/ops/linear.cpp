// The linear layer: the API boundary (checks, the choice of implementation, the views handed to
// the kernels), the float64 reference, and the per-instruction-set dispatch of the blocked kernels,
// which, with the comment that explains them, are in linear-inl.h (compiled once per target below).

#include "qkv/ops/linear.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/core/detail/rows.hpp"
#include "qkv/core/detail/simd_dispatch.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"

// foreach_target.h includes this path itself, once per target; src/ is a private include
// directory of libqkv. Then the translation unit's own target (the baseline) follows. The order matters.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "linear-inl.h"
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "linear-inl.h"
// clang-format on

#if HWY_ONCE
namespace qkv {
namespace linear_simd {

HWY_EXPORT(GemmFloat);
HWY_EXPORT(GemmDouble);
HWY_EXPORT(ColumnSumsFloat);
HWY_EXPORT(ColumnSumsDouble);

namespace {

template <class T>
void gemm(const GemmParams<T>& p) {
  detail::prepare_simd_dispatch();
  if constexpr (std::is_same_v<T, float>) {
    HWY_DYNAMIC_DISPATCH(GemmFloat)(p);
  } else {
    HWY_DYNAMIC_DISPATCH(GemmDouble)(p);
  }
}

template <class T>
void column_sums(const ColumnSumParams<T>& p) {
  detail::prepare_simd_dispatch();
  if constexpr (std::is_same_v<T, float>) {
    HWY_DYNAMIC_DISPATCH(ColumnSumsFloat)(p);
  } else {
    HWY_DYNAMIC_DISPATCH(ColumnSumsDouble)(p);
  }
}

}  // namespace
}  // namespace linear_simd

namespace {

using rows::Rows;

// x's leading dims followed by `last`.
Shape with_last(const Shape& shape, int64_t last) {
  Shape result = shape;
  result[shape.rank() - 1] = last;
  return result;
}

// In and Out of one call, once w and b have been checked against x.
struct Sizes {
  int64_t in = 0;
  int64_t out = 0;
};

template <class T>
Sizes check_params(const LinearParams<T>& params) {
  const TensorView<const T>& x = params.x;
  if (x.rank() < 2 || x.rank() > 4) {
    throw ShapeError(fmt::format("x: expected rank 2 to 4 ([..., In]), got shape {}", x.shape.str()));
  }
  const int64_t in = x.shape.from_back(1);
  if (params.w.rank() != 2 || params.w.shape[1] != in) {
    throw ShapeError(
        fmt::format("w: expected shape [Out, {}] (In from x {}), got {}", in, x.shape.str(), params.w.shape.str()));
  }
  const int64_t out = params.w.shape[0];
  if (params.b) check_shape("b", params.b->shape, Shape{out});
  return {.in = in, .out = out};
}

// Layers with fewer weights than this (32×32) run the float64 reference: it costs at most about a
// microsecond per row there, and such tiny layers keep results that are rounded once. The choice
// depends on the layer alone, never on the number of rows, so that a row's result does not depend
// on the batch it came in.
constexpr int64_t kMinBlockedWeights = int64_t{1} << 10;

bool big_layer(const Sizes& n) { return n.in * n.out >= kMinBlockedWeights; }

// Checks dy and the gradients against the params; In and Out.
template <class T>
Sizes check_backward(const LinearParams<T>& params, TensorView<const T> dy, const LinearGradients<T>& grads) {
  const Sizes n = check_params(params);
  check_shape("dy", dy.shape, with_last(params.x.shape, n.out));
  if (grads.dx) check_shape("dx", grads.dx->shape, params.x.shape);
  if (grads.dw) check_shape("dw", grads.dw->shape, params.w.shape);
  if (params.b && grads.db) check_shape("db", grads.db->shape, Shape{n.out});
  return n;
}

// ---- Reference: plain loops, float64 accumulation, any strides ------------------------------------

template <class T>
void forward_reference(const LinearParams<T>& params, const Sizes& n, TensorView<T> y) {
  const Rows<const T> xs(params.x);
  const Rows<T> ys(y);
  const TensorView<const T> w = params.w;
  parallel_for_blocks(xs.count(), n.in * n.out, [&](int64_t begin, int64_t end, int /*worker*/) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x_row = xs.row(r);
      T* y_row = ys.row(r);
      for (int64_t o = 0; o < n.out; ++o) {
        double acc = params.b ? static_cast<double>((*params.b)(o)) : 0.0;
        for (int64_t i = 0; i < n.in; ++i) {
          acc += static_cast<double>(x_row[i * xs.step()]) * static_cast<double>(w(o, i));
        }
        y_row[o * ys.step()] = static_cast<T>(acc);
      }
    }
  });
}

// With y_n = W x_n + b and dy_n = ∂L/∂y_n for every row n:
//   ∂L/∂x_n = Wᵀ dy_n            dx[n, i] += Σ_o dy[n, o] W[o, i]
//   ∂L/∂W   = Σ_n dy_n x_nᵀ      dW[o, i] += Σ_n dy[n, o] x[n, i]
//   ∂L/∂b   = Σ_n dy_n           db[o]    += Σ_n dy[n, o]
// dx is computed by blocks of rows (rows are independent) and dW, db by blocks of outputs (outputs
// are independent), so each task owns what it writes; the inner loops run along a row of W or x,
// into a per-worker float64 row.
template <class T>
void backward_dx_reference(const LinearParams<T>& params, const Sizes& n, TensorView<const T> dy, TensorView<T> dx) {
  const Rows<const T> dys(dy);
  const Rows<T> dxs(dx);
  const TensorView<const T> w = params.w;
  std::vector<std::vector<double>> scratch(static_cast<size_t>(max_workers()), std::vector<double>(n.in));
  parallel_for_blocks(dys.count(), n.in * n.out, [&](int64_t begin, int64_t end, int worker) {
    std::vector<double>& acc = scratch[static_cast<size_t>(worker)];
    for (int64_t r = begin; r < end; ++r) {
      const T* dy_row = dys.row(r);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t o = 0; o < n.out; ++o) {
        const double g = dy_row[o * dys.step()];
        for (int64_t i = 0; i < n.in; ++i) acc[static_cast<size_t>(i)] += g * static_cast<double>(w(o, i));
      }
      T* dx_row = dxs.row(r);
      for (int64_t i = 0; i < n.in; ++i) dx_row[i * dxs.step()] += static_cast<T>(acc[static_cast<size_t>(i)]);
    }
  });
}

// dw and db (either may be absent).
template <class T>
void backward_dw_reference(const LinearParams<T>& params, const Sizes& n, TensorView<const T> dy,
                           std::optional<TensorView<T>> dw, std::optional<TensorView<T>> db) {
  const Rows<const T> xs(params.x);
  const Rows<const T> dys(dy);
  std::vector<std::vector<double>> scratch(static_cast<size_t>(max_workers()), std::vector<double>(n.in));
  parallel_for_blocks(n.out, dys.count() * n.in, [&](int64_t begin, int64_t end, int worker) {
    std::vector<double>& acc = scratch[static_cast<size_t>(worker)];
    for (int64_t o = begin; o < end; ++o) {
      std::fill(acc.begin(), acc.end(), 0.0);
      double bias_acc = 0.0;
      for (int64_t r = 0; r < dys.count(); ++r) {
        const double g = dys.row(r)[o * dys.step()];
        bias_acc += g;
        if (!dw) continue;
        const T* x_row = xs.row(r);
        for (int64_t i = 0; i < n.in; ++i) {
          acc[static_cast<size_t>(i)] += g * static_cast<double>(x_row[i * xs.step()]);
        }
      }
      if (dw) {
        for (int64_t i = 0; i < n.in; ++i) (*dw)(o, i) += static_cast<T>(acc[static_cast<size_t>(i)]);
      }
      if (db) (*db)(o) += static_cast<T>(bias_acc);
    }
  });
}

// ---- Blocked: the views as matrices for the SIMD kernels of linear-inl.h ----------------------------

// A [..., C] view read as a row-major matrix [rows, C].
template <class T>
struct Matrix {
  T* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;  // between rows, ≥ 0

  linear_simd::MatrixRef<std::remove_const_t<T>> ref(linear_simd::Order order) const {
    return {.data = data, .stride = stride, .order = order};
  }
};

// The view as a Matrix, or nothing when its last dim is strided, its leading dims do not step over
// rows at one non-negative stride (a slice of the middle of a dim, a broadcast), or, for a view that
// is written (`written`), two of its rows overlap.
template <class T>
std::optional<Matrix<T>> as_matrix(TensorView<T> v, bool written) {
  const int last = v.rank() - 1;
  Matrix<T> m{.data = v.data, .rows = 1, .cols = v.shape[last], .stride = v.shape[last]};
  if (m.cols > 1 && v.strides[last] != 1) return std::nullopt;
  int64_t span = 0;  // rows spanned by the dims inside `axis` of size > 1; 0 before the first
  for (int axis = last - 1; axis >= 0; --axis) {
    m.rows *= v.shape[axis];
    if (v.shape[axis] == 1) continue;
    if (span == 0) {
      m.stride = v.strides[axis];
      span = v.shape[axis];
    } else {
      if (v.strides[axis] != m.stride * span) return std::nullopt;
      span *= v.shape[axis];
    }
  }
  if (m.stride < 0 || (written && m.rows > 1 && m.stride < m.cols)) return std::nullopt;
  return m;
}

// as_matrix; when `required` and the view does not qualify, a ShapeError naming it.
template <class T>
std::optional<Matrix<T>> blocked_matrix(TensorView<T> v, std::string_view name, bool written, bool required) {
  std::optional<Matrix<T>> m = as_matrix(v, written);
  if (!m && required) {
    std::string strides;
    for (int axis = 0; axis < v.rank(); ++axis) strides += fmt::format("{}{}", axis ? ", " : "", v.strides[axis]);
    throw ShapeError(fmt::format(
        "{}: expected rows at one stride{} and a contiguous last dim for the blocked kernels, got shape {} with "
        "strides [{}]",
        name, written ? " (not overlapping)" : "", v.shape.str(), strides));
  }
  return m;
}

// db [Out] is written element by element at its stride, which must not repeat an element.
template <class T>
bool gradient_of_bias_ok(TensorView<T> v, std::string_view name, bool required) {
  if (v.shape[0] <= 1 || v.strides[0] != 0) return true;
  if (required) throw ShapeError(fmt::format("{}: expected elements that do not overlap, got stride 0", name));
  return false;
}

// y = x Wᵀ + b as C = A·B with A = x, B = Wᵀ (W read column-major). False (nothing done) when a
// view does not qualify and `required` is not set.
template <class T>
bool forward_blocked(const LinearParams<T>& params, TensorView<T> y, bool required) {
  const auto x = blocked_matrix(params.x, "x", false, required);
  const auto w = blocked_matrix(params.w, "w", false, required);
  const auto ym = blocked_matrix(y, "y", true, required);
  if (!x || !w || !ym) return false;
  linear_simd::gemm<T>({.m = x->rows,
                        .n = w->rows,
                        .k = x->cols,
                        .a = x->ref(linear_simd::Order::kRowMajor),
                        .b = w->ref(linear_simd::Order::kColMajor),
                        .c = ym->data,
                        .c_stride = ym->stride,
                        .bias = params.b ? params.b->data : nullptr,
                        .bias_stride = params.b ? params.b->strides[0] : 0,
                        .accumulate = false,
                        .a_sums = nullptr,
                        .a_sums_stride = 0});
  return true;
}

// dx += dy W as C += A·B with A = dy, B = W.
template <class T>
bool backward_dx_blocked(const LinearParams<T>& params, TensorView<const T> dy, TensorView<T> dx, bool required) {
  const auto dym = blocked_matrix(dy, "dy", false, required);
  const auto w = blocked_matrix(params.w, "w", false, required);
  const auto dxm = blocked_matrix(dx, "dx", true, required);
  if (!dym || !w || !dxm) return false;
  linear_simd::gemm<T>({.m = dym->rows,
                        .n = w->cols,
                        .k = w->rows,
                        .a = dym->ref(linear_simd::Order::kRowMajor),
                        .b = w->ref(linear_simd::Order::kRowMajor),
                        .c = dxm->data,
                        .c_stride = dxm->stride,
                        .bias = nullptr,
                        .bias_stride = 0,
                        .accumulate = true,
                        .a_sums = nullptr,
                        .a_sums_stride = 0});
  return true;
}

// dW += dyᵀ x as C += A·B with A = dyᵀ (dy read column-major), B = x; db += Σ_rows dy.
template <class T>
bool backward_dw_blocked(const LinearParams<T>& params, TensorView<const T> dy, std::optional<TensorView<T>> dw,
                         std::optional<TensorView<T>> db, bool required) {
  const auto dym = blocked_matrix(dy, "dy", false, required);
  const auto x = blocked_matrix(params.x, "x", false, required);
  std::optional<Matrix<T>> dwm;
  if (dw) dwm = blocked_matrix(*dw, "dw", true, required);
  if (!dym || !x || (dw && !dwm) || (db && !gradient_of_bias_ok(*db, "db", required))) return false;
  // db rides along with dW, which reads every element of dy anyway (when In > 0 and dW runs).
  const bool db_with_dw = db && dwm && x->cols > 0;
  if (dwm) {
    linear_simd::gemm<T>({.m = dym->cols,
                          .n = x->cols,
                          .k = dym->rows,
                          .a = dym->ref(linear_simd::Order::kColMajor),
                          .b = x->ref(linear_simd::Order::kRowMajor),
                          .c = dwm->data,
                          .c_stride = dwm->stride,
                          .bias = nullptr,
                          .bias_stride = 0,
                          .accumulate = true,
                          .a_sums = db_with_dw ? db->data : nullptr,
                          .a_sums_stride = db_with_dw ? db->strides[0] : 0});
  }
  if (db && !db_with_dw) {
    linear_simd::column_sums<T>({.a = dym->data,
                                 .rows = dym->rows,
                                 .cols = dym->cols,
                                 .stride = dym->stride,
                                 .out = db->data,
                                 .out_stride = db->strides[0]});
  }
  return true;
}

// The gradient of b when one is both wanted and defined (params.b given).
template <class T>
std::optional<TensorView<T>> wanted_db(const LinearParams<T>& params, const LinearGradients<T>& grads) {
  return params.b ? grads.db : std::nullopt;
}

}  // namespace

double linear_init_bound(int64_t in_features) {
  return in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
}

template <class T>
void linear_forward_reference(const LinearParams<T>& params, TensorView<T> y) {
  const Sizes n = check_params(params);
  check_shape("y", y.shape, with_last(params.x.shape, n.out));
  forward_reference(params, n, y);
}

template <class T>
void linear_backward_reference(const LinearParams<T>& params, TensorView<const T> dy, const LinearGradients<T>& grads) {
  const Sizes n = check_backward(params, dy, grads);
  if (grads.dx) backward_dx_reference(params, n, dy, *grads.dx);
  if (grads.dw || wanted_db(params, grads)) backward_dw_reference(params, n, dy, grads.dw, wanted_db(params, grads));
}

template <class T>
void linear_forward_blocked(const LinearParams<T>& params, TensorView<T> y) {
  const Sizes n = check_params(params);
  check_shape("y", y.shape, with_last(params.x.shape, n.out));
  forward_blocked(params, y, true);
}

template <class T>
void linear_backward_blocked(const LinearParams<T>& params, TensorView<const T> dy, const LinearGradients<T>& grads) {
  check_backward(params, dy, grads);
  if (grads.dx) backward_dx_blocked(params, dy, *grads.dx, true);
  if (grads.dw || wanted_db(params, grads)) backward_dw_blocked(params, dy, grads.dw, wanted_db(params, grads), true);
}

template <class T>
void linear_forward(const LinearParams<T>& params, TensorView<T> y) {
  const Sizes n = check_params(params);
  check_shape("y", y.shape, with_last(params.x.shape, n.out));
  if (big_layer(n) && forward_blocked(params, y, false)) return;
  forward_reference(params, n, y);
}

// dx and (dw, db) each take the blocked kernels when their views allow it.
template <class T>
void linear_backward(const LinearParams<T>& params, TensorView<const T> dy, const LinearGradients<T>& grads) {
  const Sizes n = check_backward(params, dy, grads);
  const bool big = big_layer(n);
  if (grads.dx && !(big && backward_dx_blocked(params, dy, *grads.dx, false))) {
    backward_dx_reference(params, n, dy, *grads.dx);
  }
  const std::optional<TensorView<T>> db = wanted_db(params, grads);
  if ((grads.dw || db) && !(big && backward_dw_blocked(params, dy, grads.dw, db, false))) {
    backward_dw_reference(params, n, dy, grads.dw, db);
  }
}

template <class T>
void linear_init(TensorView<T> w, std::optional<TensorView<T>> b, Rng& rng) {
  if (w.rank() != 2) throw ShapeError(fmt::format("w: expected shape [Out, In], got {}", w.shape.str()));
  if (b) check_shape("b", b->shape, Shape{w.shape[0]});
  const double bound = linear_init_bound(w.shape[1]);
  rng.fill_uniform(w, -bound, bound);
  if (b) rng.fill_uniform(*b, -bound, bound);
}

#define QKV_INSTANTIATE_LINEAR(T)                                                                                  \
  template void linear_forward(const LinearParams<T>&, TensorView<T>);                                             \
  template void linear_backward(const LinearParams<T>&, TensorView<const T>, const LinearGradients<T>&);           \
  template void linear_forward_reference(const LinearParams<T>&, TensorView<T>);                                   \
  template void linear_backward_reference(const LinearParams<T>&, TensorView<const T>, const LinearGradients<T>&); \
  template void linear_forward_blocked(const LinearParams<T>&, TensorView<T>);                                     \
  template void linear_backward_blocked(const LinearParams<T>&, TensorView<const T>, const LinearGradients<T>&);   \
  template void linear_init(TensorView<T>, std::optional<TensorView<T>>, Rng&);

QKV_INSTANTIATE_LINEAR(float)
QKV_INSTANTIATE_LINEAR(double)
#undef QKV_INSTANTIATE_LINEAR

}  // namespace qkv
#endif  // HWY_ONCE
