#pragma once
// Softmax cross-entropy of logits against class indices, as torch.nn.functional.cross_entropy with
// reduction="mean": forward and backward.
//
// Shapes: logits [..., C] (rank 2 to 4; every leading index selects one row of C class scores),
// targets [...] (int64, logits' leading dims), row_losses [...] when asked for.
//   loss_n = lse_n − logits[n, t_n],   lse_n = log Σ_c exp(logits[n, c])   (= −log softmax_{t_n})
//   loss   = (1/N') Σ_{n counted} loss_n
// A row whose target equals ignore_index is not counted: it adds nothing to the loss, N' excludes
// it, and its gradient is 0. With no row counted (all ignored, or no rows) the loss is defined as 0
// with zero gradients, never NaN (PyTorch gives NaN there). Sums run in float64 in row order, so
// the loss does not depend on the thread count.

#include <cstdint>
#include <optional>

#include "qkv/core/tensor.hpp"

namespace qkv {

template <class T>
struct CrossEntropyParams {
  TensorView<const T> logits;                          // [..., C]
  TensorView<const int64_t> targets;                   // [...]: each in [0, C), or ignore_index
  std::optional<int64_t> ignore_index = std::nullopt;  // rows with this target are skipped; none when absent
};

// What the forward leaves for the backward.
template <class T>
struct CrossEntropyCache {
  Tensor<T> probs;          // [rows, C]: softmax of each row's logits; a row that is not counted is 0
  Tensor<int64_t> targets;  // [rows]: −1 for a row that is not counted
  int64_t counted = 0;      // N': the rows the mean divides by
};

// Returns the mean loss. `row_losses` [...] (overwritten), when given, receives loss_n, 0 for a row
// that is not counted. Throws ShapeError for mismatched shapes and ValueError naming the first
// target outside [0, C) that is not ignore_index, and its row.
template <class T>
double cross_entropy_forward(const CrossEntropyParams<T>& params, CrossEntropyCache<T>& cache,
                             std::optional<TensorView<T>> row_losses = std::nullopt);

// dloss = ∂L/∂loss (1 when the loss is the objective) → dlogits [..., C] += dloss/N' · (softmax − onehot(t))
// on every counted row.
template <class T>
void cross_entropy_backward(const CrossEntropyCache<T>& cache, double dloss, TensorView<T> dlogits);

}  // namespace qkv
