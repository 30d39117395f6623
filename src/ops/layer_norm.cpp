#include "qkv/ops/layer_norm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "qkv/core/detail/rows.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"

namespace qkv {
namespace {

using rows::Rows;

}  // namespace

template <class T>
LayerNorm<T>::LayerNorm(const LayerNormConfig& config) : config_(config) {
  if (config.dim < 1) throw ValueError(fmt::format("dim: expected at least 1, got {}", config.dim));
  if (!(config.eps > 0.0) || !std::isfinite(config.eps)) {
    throw ValueError(fmt::format("eps: expected a finite value > 0, got {}", config.eps));
  }
  if (config.affine) {
    gamma_ = Parameter<T>(Shape{config.dim});
    beta_ = Parameter<T>(Shape{config.dim});
    std::fill(gamma_.value.values().begin(), gamma_.value.values().end(), T{1});
  }
}

// Two passes over each row in float64: the mean, then the variance about it (the one-pass
// E[x²] − μ² cancels catastrophically when |μ| ≫ σ).
template <class T>
Tensor<T> LayerNorm<T>::forward(TensorView<const T> x, LayerNormCache<T>& cache) const {
  const int64_t dim = config_.dim;
  if (x.rank() < 1 || x.shape.from_back(1) != dim) {
    throw ShapeError(fmt::format("x: expected shape [..., {}], got {}", dim, x.shape.str()));
  }
  const Rows<const T> xs(x);
  if (!(cache.xhat.shape() == x.shape)) cache.xhat = Tensor<T>(x.shape);
  if (!(cache.rstd.shape() == Shape{xs.count()})) cache.rstd = Tensor<T>(Shape{xs.count()});
  Tensor<T> y(x.shape);
  parallel_for_blocks(xs.count(), 4 * dim, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x_row = xs.row(r);
      double sum = 0.0;
      for (int64_t j = 0; j < dim; ++j) sum += static_cast<double>(x_row[j * xs.step()]);
      const double mean = sum / static_cast<double>(dim);
      double squares = 0.0;
      for (int64_t j = 0; j < dim; ++j) {
        const double centred = static_cast<double>(x_row[j * xs.step()]) - mean;
        squares += centred * centred;
      }
      const double rstd = 1.0 / std::sqrt(squares / static_cast<double>(dim) + config_.eps);
      cache.rstd[r] = static_cast<T>(rstd);
      T* xhat_row = cache.xhat.data() + r * dim;
      T* y_row = y.data() + r * dim;
      for (int64_t j = 0; j < dim; ++j) {
        const double xhat = (static_cast<double>(x_row[j * xs.step()]) - mean) * rstd;
        xhat_row[j] = static_cast<T>(xhat);
        y_row[j] =
            config_.affine
                ? static_cast<T>(static_cast<double>(gamma_.value[j]) * xhat + static_cast<double>(beta_.value[j]))
                : static_cast<T>(xhat);
      }
    }
  });
  return y;
}

// With g = ∂L/∂x̂ = dy ∘ γ (g = dy without the affine part), x̂_j = (x_j − μ)·rstd and
//   ∂μ/∂x_k = 1/D,   ∂rstd/∂x_k = −rstd³ (x_k − μ)/D = −rstd² x̂_k / D,
// the chain rule through x̂_j gives
//   ∂L/∂x_k = Σ_j g_j ∂x̂_j/∂x_k = rstd · (g_k − mean_j(g_j) − x̂_k · mean_j(g_j x̂_j)).
// The parameters see every row: dγ_j += Σ_rows dy_j x̂_j, dβ_j += Σ_rows dy_j. Rows are split
// among tasks for dx; feature blocks for dγ and dβ, each task summing its features over every row
// in row order.
template <class T>
void LayerNorm<T>::backward(const LayerNormCache<T>& cache, TensorView<const T> dy, TensorView<T> dx) {
  const Shape& shape = cache.xhat.shape();
  check_shape("dy", dy.shape, shape);
  check_shape("dx", dx.shape, shape);
  const int64_t dim = config_.dim;
  const Rows<const T> dys(dy);
  const Rows<T> dxs(dx);
  const int64_t rows = dys.count();
  const auto g_at = [&](const T* dy_row, int64_t j) {
    const double g = static_cast<double>(dy_row[j * dys.step()]);
    return config_.affine ? g * static_cast<double>(gamma_.value[j]) : g;
  };
  parallel_for_blocks(rows, 4 * dim, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* dy_row = dys.row(r);
      const T* xhat_row = cache.xhat.data() + r * dim;
      double g_sum = 0.0;
      double gx_sum = 0.0;
      for (int64_t j = 0; j < dim; ++j) {
        const double g = g_at(dy_row, j);
        g_sum += g;
        gx_sum += g * static_cast<double>(xhat_row[j]);
      }
      const double g_mean = g_sum / static_cast<double>(dim);
      const double gx_mean = gx_sum / static_cast<double>(dim);
      const double rstd = static_cast<double>(cache.rstd[r]);
      T* dx_row = dxs.row(r);
      for (int64_t j = 0; j < dim; ++j) {
        const double xhat = static_cast<double>(xhat_row[j]);
        dx_row[j * dxs.step()] += static_cast<T>(rstd * (g_at(dy_row, j) - g_mean - xhat * gx_mean));
      }
    }
  });
  if (!config_.affine) return;
  parallel_for_blocks(dim, 2 * rows, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      double dgamma = 0.0;
      double dbeta = 0.0;
      for (int64_t r = 0; r < rows; ++r) {
        const double g = static_cast<double>(dys.row(r)[j * dys.step()]);
        dgamma += g * static_cast<double>(cache.xhat[r * dim + j]);
        dbeta += g;
      }
      gamma_.grad[j] += static_cast<T>(dgamma);
      beta_.grad[j] += static_cast<T>(dbeta);
    }
  });
}

template <class T>
void LayerNorm<T>::zero_grad() {
  gamma_.zero_grad();
  beta_.zero_grad();
}

template <class T>
std::vector<ParameterRef<T>> LayerNorm<T>::parameters() {
  if (!config_.affine) return {};
  return {gamma_.ref("weight"), beta_.ref("bias")};
}

template <class T>
std::vector<ParameterRef<const T>> LayerNorm<T>::parameters() const {
  if (!config_.affine) return {};
  return {gamma_.ref("weight"), beta_.ref("bias")};
}

template struct LayerNormCache<float>;
template struct LayerNormCache<double>;
template class LayerNorm<float>;
template class LayerNorm<double>;

}  // namespace qkv
