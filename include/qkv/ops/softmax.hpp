#pragma once
// Numerically stable softmax and log-sum-exp along the last axis, forward and backward.
//
// Shapes: x [..., N] (rank 1 to 4); every leading index selects one row of N scores.
//   lse = m + log Σ_j exp(x_j − m),  m = max_j x_j         (the max keeps exp from overflowing)
//   y_j = exp(x_j − lse)
// Entries equal to −inf are masked out: they get y = 0. A row whose entries are all −inf (or an
// empty row) has lse = −inf and y = 0 everywhere, never NaN. Sums are accumulated in float64.

#include <optional>
#include <span>

#include "qkv/core/tensor.hpp"

namespace qkv {

// log Σ_j exp(x_j), −inf for an empty or fully −inf row.
template <class T>
double logsumexp(std::span<const T> row);

// The softmax of one row: y_j = exp(x_j − lse) (y may be x itself); returns lse. The one softmax
// every op, layer and experiment of qkv uses for a row it holds in memory.
template <class T>
double softmax(std::span<const T> x, std::span<T> y);

// y [..., N] (overwritten); lse [...] (overwritten) when given.
template <class T>
void softmax_forward(TensorView<const T> x, TensorView<T> y, std::optional<TensorView<T>> lse = std::nullopt);

// Given y = softmax(x) and dy = ∂L/∂y, adds ∂L/∂x = y ∘ (dy − Σ_j dy_j y_j) into dx.
template <class T>
void softmax_backward(TensorView<const T> y, TensorView<const T> dy, TensorView<T> dx);

// Given lse = logsumexp(x) and dlse = ∂L/∂lse [...], adds ∂L/∂x = dlse · softmax(x) into dx.
template <class T>
void logsumexp_backward(TensorView<const T> x, TensorView<const T> lse, TensorView<const T> dlse, TensorView<T> dx);

}  // namespace qkv
