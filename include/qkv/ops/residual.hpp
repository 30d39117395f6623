#pragma once
// The residual connection y = x + f(x), as an op of its own: forward and backward.
//
// Shapes: a, b, y [...] (rank 1 to 4), all the same shape; views may be strided.
//   y = a + b
// Its backward hands dy unchanged to both branches: the identity path that lets a gradient reach
// early layers without passing through every transformation.

#include <optional>

#include "qkv/core/tensor.hpp"

namespace qkv {

// y [a's shape] (overwritten); y may be a or b itself (in-place).
template <class T>
void residual_forward(TensorView<const T> a, TensorView<const T> b, TensorView<T> y);

// Accumulated by the backward (+=); a gradient that is not given is not computed.
template <class T>
struct ResidualGradients {
  std::optional<TensorView<T>> da = std::nullopt;  // [a's shape]
  std::optional<TensorView<T>> db = std::nullopt;  // [a's shape]
};

// dy = ∂L/∂y → da += dy, db += dy.
template <class T>
void residual_backward(TensorView<const T> dy, const ResidualGradients<T>& grads);

}  // namespace qkv
