#pragma once
// A fully connected layer, as torch.nn.Linear: forward, backward and PyTorch's initialisation.
//
// Shapes: x [..., In] (rank 2 to 4; every leading index selects one row), w [Out, In], b [Out],
// y [..., Out] with x's leading dims.
//   y_n = W x_n + b                    (y = x Wᵀ + b, one row at a time)
// Every dot product is accumulated in float64, so a row's result does not depend on the thread
// that computed it. Views may be strided; none needs to be contiguous.

#include <optional>

#include "qkv/rng.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

template <class T>
struct LinearParams {
  TensorView<const T> x;                 // [..., In]
  TensorView<const T> w;                 // [Out, In]
  std::optional<TensorView<const T>> b;  // [Out]; no bias when absent
};

// Accumulated by the backward (+=). A gradient that is not given is not computed.
template <class T>
struct LinearGradients {
  std::optional<TensorView<T>> dx;  // [..., In]
  std::optional<TensorView<T>> dw;  // [Out, In]
  std::optional<TensorView<T>> db;  // [Out]; only read when params.b is given
};

// y [..., Out] (overwritten).
template <class T>
void linear_forward(const LinearParams<T>& params, TensorView<T> y);

// Gradients of L = <dy, y> (dy [..., Out]): dx += dy W, dW += dyᵀ x, db += Σ_rows dy.
template <class T>
void linear_backward(const LinearParams<T>& params, TensorView<const T> dy, const LinearGradients<T>& grads);

// PyTorch's default for nn.Linear: w [Out, In] and b [Out] (when given) drawn from U(−1/√In, 1/√In),
// w first, row by row. (kaiming_uniform_ with a = √5 yields exactly that bound for w.) With
// In = 0 the bound is 0.
template <class T>
void linear_init(TensorView<T> w, std::optional<TensorView<T>> b, Rng& rng);

// The bound 1/√In of linear_init; 0 when In = 0.
double linear_init_bound(int64_t in_features);

}  // namespace qkv
