#include "qkv/linear.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/parallel.hpp"

namespace qkv {
namespace {

// Multiply-adds per parallel task: enough that handing out a task costs little next to it, and a
// problem smaller than one task runs on the calling thread without a parallel region.
constexpr int64_t kTaskWork = int64_t{1} << 15;

// Runs fn(begin, end, worker) over [0, count) in blocks of items that each cost `work_per_item`
// multiply-adds, about kTaskWork per block.
void for_each_block(int64_t count, int64_t work_per_item, const std::function<void(int64_t, int64_t, int)>& fn) {
  const int64_t per_task = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(work_per_item, 1));
  const int64_t tasks = (count + per_task - 1) / per_task;
  parallel_for(tasks,
               [&](int64_t task, int worker) { fn(task * per_task, std::min(count, (task + 1) * per_task), worker); });
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

}  // namespace

double linear_init_bound(int64_t in_features) {
  return in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
}

template <class T>
void linear_forward(const LinearParams<T>& params, TensorView<T> y) {
  const Sizes n = check_params(params);
  check_shape("y", y.shape, with_last(params.x.shape, n.out));
  const Rows<const T> xs(params.x);
  const Rows<T> ys(y);
  const TensorView<const T> w = params.w;
  for_each_block(xs.count(), n.in * n.out, [&](int64_t begin, int64_t end, int /*worker*/) {
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
void linear_backward(const LinearParams<T>& params, TensorView<const T> dy, const LinearGradients<T>& grads) {
  const Sizes n = check_params(params);
  check_shape("dy", dy.shape, with_last(params.x.shape, n.out));
  if (grads.dx) check_shape("dx", grads.dx->shape, params.x.shape);
  if (grads.dw) check_shape("dw", grads.dw->shape, params.w.shape);
  const bool want_db = params.b && grads.db;
  if (want_db) check_shape("db", grads.db->shape, Shape{n.out});
  const Rows<const T> xs(params.x);
  const Rows<const T> dys(dy);
  const TensorView<const T> w = params.w;
  std::vector<std::vector<double>> scratch(static_cast<size_t>(max_workers()), std::vector<double>(n.in));

  if (grads.dx) {
    const Rows<T> dxs(*grads.dx);
    for_each_block(dys.count(), n.in * n.out, [&](int64_t begin, int64_t end, int worker) {
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

  if (grads.dw || want_db) {
    for_each_block(n.out, dys.count() * n.in, [&](int64_t begin, int64_t end, int worker) {
      std::vector<double>& acc = scratch[static_cast<size_t>(worker)];
      for (int64_t o = begin; o < end; ++o) {
        std::fill(acc.begin(), acc.end(), 0.0);
        double bias_acc = 0.0;
        for (int64_t r = 0; r < dys.count(); ++r) {
          const double g = dys.row(r)[o * dys.step()];
          bias_acc += g;
          if (!grads.dw) continue;
          const T* x_row = xs.row(r);
          for (int64_t i = 0; i < n.in; ++i) {
            acc[static_cast<size_t>(i)] += g * static_cast<double>(x_row[i * xs.step()]);
          }
        }
        if (grads.dw) {
          for (int64_t i = 0; i < n.in; ++i) (*grads.dw)(o, i) += static_cast<T>(acc[static_cast<size_t>(i)]);
        }
        if (want_db) (*grads.db)(o) += static_cast<T>(bias_acc);
      }
    });
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

#define QKV_INSTANTIATE_LINEAR(T)                                                                        \
  template void linear_forward(const LinearParams<T>&, TensorView<T>);                                   \
  template void linear_backward(const LinearParams<T>&, TensorView<const T>, const LinearGradients<T>&); \
  template void linear_init(TensorView<T>, std::optional<TensorView<T>>, Rng&);

QKV_INSTANTIATE_LINEAR(float)
QKV_INSTANTIATE_LINEAR(double)
#undef QKV_INSTANTIATE_LINEAR

}  // namespace qkv
