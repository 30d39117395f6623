#pragma once
// What a whole model's attention says in a few numbers: attention rollout across layers and, per
// head, the entropy and the mean distance of its rows. Plain float64 loops: they are the reference
// that the explorer page's own arithmetic is tested against, and they draw the static images.
//
// Shapes: attention is [L, H, Tq, Tk], layer by layer from the input (what a model's
// output_attentions gives for one batch entry); rows are queries and sum to 1 (or are all 0).

#include "qkv/core/tensor.hpp"

namespace qkv {

// Attention rollout (Abnar & Zuidema 2020): each layer's mean over heads with the residual
// connection as an identity, Â_l = rownorm(0.5 · mean_h A_l + 0.5 · I), and the product from the
// input up, R_0 = Â_0, R_l = Â_l · R_{l-1}: R_l[i, j] is how much input token j flows into token i at
// the output of layer l. Self-attention only: a ShapeError names `name` when Tq ≠ Tk.
// attention [L, H, T, T] → rollout [L, T, T].
Tensor<double> attention_rollout(TensorView<const float> attention, std::string_view name);

// attention [L, H, Tq, Tk] → [L, H]: the mean over queries of a row's entropy −Σ_j a_j ln a_j, in
// nats (0 · ln 0 = 0). ln Tk is a head that looks everywhere alike, 0 one that looks at one key.
Tensor<double> attention_entropy(TensorView<const float> attention);

// attention [L, H, Tq, Tk] → [L, H]: the mean over queries of Σ_j a_ij · |i − j|, in tokens: how far
// a head looks. Query i sits at key position i (the same positions, as in self-attention).
Tensor<double> attention_distance(TensorView<const float> attention);

// attention [L, H, Tq, Tk] → [L, Tq, Tk]: each layer's mean over its heads.
Tensor<double> attention_head_mean(TensorView<const float> attention);

}  // namespace qkv
