#pragma once
// A fully connected layer, as torch.nn.Linear: forward, backward and PyTorch's initialisation.
//
// Shapes: x [..., In] (rank 2 to 4; every leading index selects one row), w [Out, In], b [Out],
// y [..., Out] with x's leading dims.
//   y_n = W x_n + b                    (y = x Wᵀ + b, one row at a time)
//
// Two implementations, the same semantics; linear_forward and linear_backward choose:
//  - reference: plain loops, every dot product accumulated in float64; views may have any strides.
//  - blocked (src/ops/linear-inl.h): packed panels and a register-blocked SIMD micro-kernel (Highway,
//    the best instruction set of the CPU chosen at run time, see qkv/simd_target.hpp), accumulating
//    in T (float32 for float) in a fixed blocked order. Needs x, y, dy, dx to be rows at one stride
//    with a contiguous last dim (a contiguous tensor, or a slice of its rows or of its columns) and
//    w, dw to have contiguous rows. Its float error is that of a naive float32 loop or less: at most about
//    (depth + 2)·ε32·Σ|terms|, and over the rows (dW, db) it grows with 128 + rows/128 terms, not rows.
// linear_forward and linear_backward run the blocked one when the views allow it and the layer has
// at least 2^10 weights (In·Out; tiny layers keep the float64 loops), otherwise the reference. The
// choice never depends on the number of rows, and in both a row's result does not depend on the
// other rows of the call; both give results that are bit-identical for any thread count.

#include <optional>

#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"

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

// The reference: the shapes and semantics of linear_forward / linear_backward, any strides.
template <class T>
void linear_forward_reference(const LinearParams<T>& params, TensorView<T> y);
template <class T>
void linear_backward_reference(const LinearParams<T>& params, TensorView<const T> dy, const LinearGradients<T>& grads);

// The blocked implementation at any size. Throws ShapeError naming the view whose layout it cannot
// read (a strided last dim, rows that are not at one stride, output rows that overlap).
template <class T>
void linear_forward_blocked(const LinearParams<T>& params, TensorView<T> y);
template <class T>
void linear_backward_blocked(const LinearParams<T>& params, TensorView<const T> dy, const LinearGradients<T>& grads);

// PyTorch's default for nn.Linear: w [Out, In] and b [Out] (when given) drawn from U(−1/√In, 1/√In),
// w first, row by row. (kaiming_uniform_ with a = √5 yields exactly that bound for w.) With
// In = 0 the bound is 0.
template <class T>
void linear_init(TensorView<T> w, std::optional<TensorView<T>> b, Rng& rng);

// The bound 1/√In of linear_init; 0 when In = 0.
double linear_init_bound(int64_t in_features);

}  // namespace qkv
