#pragma once
// Layer normalisation over the last axis, as torch.nn.LayerNorm(D): forward, backward.
//
// Shapes: x [..., D] (rank 1 to 4; every leading index selects one row), gamma [D], beta [D],
// y [x's shape].
//   μ = (1/D) Σ_j x_j      σ² = (1/D) Σ_j (x_j − μ)²      (biased variance, as PyTorch)
//   x̂_j = (x_j − μ) · rstd,  rstd = 1/√(σ² + eps)
//   y_j = γ_j x̂_j + β_j    (y = x̂ without the affine part)
// Row statistics are accumulated in float64; rows are independent, and the parameter gradients
// sum over rows in row order, so results do not depend on the thread count.

#include <cstdint>
#include <vector>

#include "qkv/core/parameter.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {

struct LayerNormConfig {
  int64_t dim = 0;     // D: the normalised (last) axis
  double eps = 1e-5;   // added to σ² inside the square root; > 0 keeps a constant row finite
  bool affine = true;  // γ (init 1) and β (init 0) are learned
};

// What the forward leaves for the backward. A cache may be reused across calls.
template <class T>
struct LayerNormCache {
  Tensor<T> xhat;  // [x's shape]: the normalised input x̂
  Tensor<T> rstd;  // [rows]: 1/√(σ² + eps) per row, rows = the product of x's leading dims
};

template <class T>
class LayerNorm {
 public:
  // Throws ValueError when dim < 1 or eps is not > 0 (or not finite).
  explicit LayerNorm(const LayerNormConfig& config);

  const LayerNormConfig& config() const { return config_; }

  // x [..., D] → y [x's shape].
  Tensor<T> forward(TensorView<const T> x, LayerNormCache<T>& cache) const;

  // dy [x's shape] = ∂L/∂y → dx [x's shape] += ∂L/∂x; dgamma, dbeta += theirs.
  void backward(const LayerNormCache<T>& cache, TensorView<const T> dy, TensorView<T> dx);

  void zero_grad();

  // {"weight" (γ), "bias" (β)}, each [D], as PyTorch names them; empty without the affine part.
  std::vector<ParameterRef<T>> parameters();
  std::vector<ParameterRef<const T>> parameters() const;

 private:
  LayerNormConfig config_;
  Parameter<T> gamma_, beta_;
};

}  // namespace qkv
