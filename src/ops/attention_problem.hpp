#pragma once
// The one validated form of an attention call, built at the API boundary and passed on: the
// reference and the fused dot-product attention and the additive attention all check their
// operands here, so they accept exactly the same calls with the same error messages. Internal to
// the ops layer (not installed).

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/ops/attention.hpp"

namespace qkv::detail {

// A bound of the band of visible keys that is not there: far beyond any j − i, and still far
// from overflowing when a token index is added to it.
inline constexpr int64_t kUnbounded = int64_t{1} << 62;

// q, k, v seen as [B, H, T, D] and the mask broadcast to [B, H, Tq, Tk]: what every attention
// reads, whatever its score.
template <class T>
struct AttentionOperands {
  TensorView<const T> q;                             // [B, H, Tq, Dq]
  TensorView<const T> k;                             // [B, Hkv, Tk, Dk]
  TensorView<const T> v;                             // [B, Hkv, Tk, Dv]
  std::optional<TensorView<const uint8_t>> allowed;  // [B, H, Tq, Tk]
  std::optional<TensorView<const T>> bias;           // [B, H, Tq, Tk]
  std::optional<TensorView<const T>> alibi;          // [H] ALiBi slopes
  // Causality and the window as one band: query i sees keys i + band_lo ≤ j ≤ i + band_hi
  // (±kUnbounded where there is no bound). causal narrows band_hi to the diagonal offset.
  int64_t band_lo = -kUnbounded;
  int64_t band_hi = kUnbounded;
  int64_t diagonal = 0;  // o: Tk − Tq bottom-right aligned, 0 top-left
  // What the band is made of, to set it again for each sequence of a packed batch.
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::bottom_right;
  std::optional<int64_t> diagonal_offset;
  std::optional<AttentionWindow> window;
  // Packed sequences: [N+1] offsets of each sequence's queries and keys; empty when not packed.
  std::vector<int64_t> cu_q, cu_k;
  // The batch index that b = 0 stands for in dropout's coordinates: the sequence, once unpacked.
  int64_t batch0 = 0;
  // The arguments' shapes as given, which their gradients must have; q's leading dims (rank 0 to
  // 2) are those of every output.
  Shape q_shape, k_shape, v_shape;
  std::optional<Shape> bias_shape;

  int64_t batch() const { return q.shape[0]; }
  int64_t heads() const { return q.shape[1]; }
  int64_t kv_heads() const { return k.shape[1]; }
  int64_t kv_head(int64_t h) const { return h / (heads() / kv_heads()); }
  int64_t tq() const { return q.shape[2]; }
  int64_t tk() const { return k.shape[2]; }
  int64_t dq() const { return q.shape[3]; }
  int64_t dk() const { return k.shape[3]; }
  int64_t dv() const { return v.shape[3]; }
  Shape scores() const { return {batch(), heads(), tq(), tk()}; }

  // q's leading dims + tail, e.g. with_leading({Tq, Dv}) for the output.
  Shape with_leading(std::initializer_list<int64_t> tail) const {
    return leading_dims_with(q_shape, q_shape.rank() - 2, tail);
  }

  bool packed() const { return !cu_q.empty(); }
  int64_t sequences() const { return static_cast<int64_t>(cu_q.size()) - 1; }

  // The band of this problem's Tq and Tk.
  void set_band() {
    diagonal = diagonal_offset ? *diagonal_offset : alignment == CausalAlignment::bottom_right ? tk() - tq() : 0;
    band_lo = -kUnbounded;
    band_hi = kUnbounded;
    if (window && window->left >= 0) band_lo = diagonal - window->left;
    if (window && window->right >= 0) band_hi = diagonal + window->right;
    if (causal) band_hi = std::min(band_hi, diagonal);
  }

  // Whether query i of head (b, h) may see key j, before any additive bias.
  bool visible(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (j - i < band_lo || j - i > band_hi) return false;
    return !allowed || (*allowed)(b, h, i, j) != 0;
  }

  // What is added to the scaled score of (i, j): the bias and ALiBi's −slope·|i + o − j|.
  double added_bias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    double sum = bias ? static_cast<double>((*bias)(b, h, i, j)) : 0.0;
    if (alibi) sum -= static_cast<double>((*alibi)(h)) * static_cast<double>(std::abs(i + diagonal - j));
    return sum;
  }
};

// A dot-product attention call: its operands, the scale of q·k, the softcap, the sinks, dropout.
template <class T>
struct AttentionProblem : AttentionOperands<T> {
  double scale = 1.0;
  double softcap = 0.0;                                     // 0: none
  std::optional<TensorView<const T>> sinks = std::nullopt;  // [H]
  double dropout_p = 0.0;                                   // 0: none
  DropoutDraw dropout = {};

  // The factor of weight (b, h, i, j) under dropout: 0 when dropped, 1/(1 − p) when kept.
  double dropout_factor(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (dropout_p == 0.0) return 1.0;
    return dropout.keeps(this->batch0 + b, h, i, j) ? 1.0 / (1.0 - dropout_p) : 0.0;
  }

  // scale·q·k (dot), softcapped.
  double capped(double dot) const {
    const double x = scale * dot;
    return softcap > 0.0 ? softcap * std::tanh(x / softcap) : x;
  }
};

// Which dims of k a score needs: dot products need Dk = Dq, additive scores take any Dk.
enum class KeyDim { same_as_query, any };

template <class T>
void check_dims_not_negative(TensorView<const T> view, std::string_view name) {
  for (int axis = 0; axis < view.rank(); ++axis) {
    if (view.shape[axis] < 0) {
      throw ShapeError(
          fmt::format("{}: dimension {} must not be negative, got shape {}", name, axis, view.shape.str()));
    }
  }
}

// [N+1] offsets of packed sequences along an axis of `total` tokens: 0 first, never decreasing (a
// sequence may be empty), `total` last.
inline std::vector<int64_t> sequence_offsets(TensorView<const int64_t> cu, std::string_view name, int64_t total,
                                             std::string_view axis) {
  if (cu.rank() != 1 || cu.shape[0] < 1) {
    throw ShapeError(fmt::format("{}: expected shape [N+1], the offsets of N sequences, got {}", name, cu.shape.str()));
  }
  std::vector<int64_t> offsets(static_cast<size_t>(cu.shape[0]));
  for (int64_t n = 0; n < cu.shape[0]; ++n) offsets[static_cast<size_t>(n)] = cu(n);
  if (offsets.front() != 0) throw ValueError(fmt::format("{}: expected 0 first, got {}", name, offsets.front()));
  for (size_t n = 1; n < offsets.size(); ++n) {
    if (offsets[n] < offsets[n - 1]) {
      throw ValueError(fmt::format("{}: offsets must not decrease, got {} after {} at index {}", name, offsets[n],
                                   offsets[n - 1], n));
    }
  }
  if (offsets.back() != total) {
    throw ValueError(
        fmt::format("{}: expected the last offset to be {} = {}, got {}", name, axis, total, offsets.back()));
  }
  return offsets;
}

template <class T>
AttentionOperands<T> make_attention_operands(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                             const AttentionMask<T>& mask, KeyDim key_dim) {
  AttentionOperands<T> p;
  p.q = as_bhtd(q, "q");
  check_dims_not_negative(q, "q");
  p.q_shape = q.shape;
  const int64_t dq = q.shape.from_back(1);
  if (key_dim == KeyDim::same_as_query && dq == 0) {
    throw ShapeError(fmt::format("q: d_k must be at least 1, got shape {}", q.shape.str()));
  }
  // k and v carry q's leading dims, but for their heads (a divisor of q's) and their token count Tk.
  const int64_t tk = k.rank() >= 2 ? k.shape.from_back(2) : 0;
  const int64_t dk = key_dim == KeyDim::same_as_query ? dq : (k.rank() >= 1 ? k.shape.from_back(1) : 0);
  check_dims_not_negative(k, "k");
  Shape kv_leading = p.with_leading({});
  if (kv_leading.rank() >= 1 && k.rank() == q.rank()) {
    const int64_t heads = q.shape.from_back(3), kv_heads = k.shape.from_back(3);
    if (kv_heads >= 1 && heads % kv_heads == 0) {
      kv_leading = leading_dims_with(kv_leading, kv_leading.rank() - 1, {kv_heads});
    } else if (kv_heads != heads) {
      throw ShapeError(fmt::format(
          "k: q has {} heads, which is not a multiple of k's {} (grouped-query attention needs H % Hkv == 0); got q "
          "{} and k {}",
          heads, kv_heads, q.shape.str(), k.shape.str()));
    }
  }
  check_shape("k", k.shape, leading_dims_with(kv_leading, kv_leading.rank(), {tk, dk}));
  const int64_t dv = v.rank() >= 1 ? v.shape.from_back(1) : 0;
  check_dims_not_negative(v, "v");
  check_shape("v", v.shape, leading_dims_with(kv_leading, kv_leading.rank(), {tk, dv}));
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
  p.k = as_bhtd(k, "k");
  p.v = as_bhtd(v, "v");

  p.k_shape = k.shape;
  p.v_shape = v.shape;

  if (mask.allowed) p.allowed = broadcast_to(*mask.allowed, p.scores(), "mask");
  if (mask.bias) {
    p.bias = broadcast_to(*mask.bias, p.scores(), "bias");
    p.bias_shape = mask.bias->shape;
  }
  if (mask.alibi_slopes) {
    check_shape("alibi_slopes", mask.alibi_slopes->shape, Shape{p.heads()});
    p.alibi = *mask.alibi_slopes;
  }
  if (mask.window) {
    const auto bound = [](int64_t value, std::string_view side) {
      if (value < -1) {
        throw ValueError(fmt::format("window: {} must be -1 (unbounded) or at least 0, got {}", side, value));
      }
    };
    bound(mask.window->left, "left");
    bound(mask.window->right, "right");
  }
  p.causal = mask.causal;
  p.alignment = mask.alignment;
  if (mask.diagonal_offset) {
    if (*mask.diagonal_offset < -kUnbounded / 2 || *mask.diagonal_offset > kUnbounded / 2) {
      throw ValueError(fmt::format("diagonal_offset: expected |o| below 2^61, got {}", *mask.diagonal_offset));
    }
    if (mask.cu_seqlens_q || mask.cu_seqlens_k) {
      throw ValueError(
          "diagonal_offset: not with packed sequences (cu_seqlens_q), whose diagonals are each sequence's own");
    }
  }
  p.diagonal_offset = mask.diagonal_offset;
  p.window = mask.window;
  p.set_band();
  if (mask.cu_seqlens_q || mask.cu_seqlens_k) {
    if (!mask.cu_seqlens_q || !mask.cu_seqlens_k) {
      throw ValueError(fmt::format("{}: given without {}; packed sequences need the offsets of both",
                                   mask.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k",
                                   mask.cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q"));
    }
    if (p.batch() != 1) {
      throw ShapeError(fmt::format(
          "cu_seqlens_q: packed sequences lie along T of a batch of one ([H, T, D] or [1, H, T, D]), got q of shape {}",
          q.shape.str()));
    }
    p.cu_q = sequence_offsets(*mask.cu_seqlens_q, "cu_seqlens_q", p.tq(), "Tq");
    p.cu_k = sequence_offsets(*mask.cu_seqlens_k, "cu_seqlens_k", p.tk(), "Tk");
    if (p.cu_q.size() != p.cu_k.size()) {
      throw ShapeError(fmt::format("cu_seqlens_k: expected {} offsets, as many as cu_seqlens_q, got {}", p.cu_q.size(),
                                   p.cu_k.size()));
    }
    if (p.cu_q.size() < 2) {
      throw ShapeError("cu_seqlens_q: expected at least 2 offsets (one sequence), got 1");
    }
  }
  return p;
}

template <class T>
AttentionProblem<T> make_attention_problem(const AttentionParams<T>& params) {
  AttentionProblem<T> p{make_attention_operands(params.q, params.k, params.v, params.mask, KeyDim::same_as_query)};
  p.scale = params.scale.value_or(default_scale(p.dq()));
  if (!std::isfinite(p.scale)) throw ValueError(fmt::format("scale: expected a finite number, got {}", p.scale));
  if (params.softcap) {
    if (!(*params.softcap > 0.0) || !std::isfinite(*params.softcap)) {
      throw ValueError(fmt::format("softcap: expected a positive finite number, got {}", *params.softcap));
    }
    p.softcap = *params.softcap;
  }
  if (params.sinks) {
    check_shape("sinks", params.sinks->shape, Shape{p.heads()});
    p.sinks = *params.sinks;
  }
  if (params.dropout) {
    const double rate = params.dropout->p;
    if (!(rate >= 0.0 && rate < 1.0)) throw ValueError(fmt::format("dropout: p must be in [0, 1), got {}", rate));
    p.dropout_p = rate;
    p.dropout = DropoutDraw{.seed = params.dropout->seed, .threshold = dropout_threshold(rate)};
  }
  return p;
}

// The forward's outputs against the problem.
template <class T>
void check_forward_outputs(const AttentionOperands<T>& p, const AttentionOutputs<T>& outputs) {
  check_shape("out", outputs.out.shape, p.with_leading({p.tq(), p.dv()}));
  if (outputs.weights) check_shape("weights", outputs.weights->shape, p.with_leading({p.tq(), p.tk()}));
  if (outputs.lse) check_shape("lse", outputs.lse->shape, p.with_leading({p.tq()}));
}

// dO and the gradients of q, k, v and the bias (AttentionGradients or AdditiveAttentionGradients)
// against the problem: dbias only with a bias, of the bias's shape.
template <class T, class Gradients>
void check_backward_arguments(const AttentionOperands<T>& p, TensorView<const T> dout, const Gradients& grads) {
  check_shape("dout", dout.shape, p.with_leading({p.tq(), p.dv()}));
  check_shape("dq", grads.dq.shape, p.q_shape);
  check_shape("dk", grads.dk.shape, p.k_shape);
  check_shape("dv", grads.dv.shape, p.v_shape);
  if (grads.dbias && !p.bias_shape) throw ShapeError("dbias: given, but the mask has no additive bias");
  if (grads.dbias) check_shape("dbias", grads.dbias->shape, *p.bias_shape);
}

// The sinks' gradient against the problem: only with sinks, of shape [H].
template <class T>
void check_sink_gradient(const AttentionProblem<T>& p, const AttentionGradients<T>& grads) {
  if (grads.dsinks && !p.sinks) throw ShapeError("dsinks: given, but the call has no sinks");
  if (grads.dsinks) check_shape("dsinks", grads.dsinks->shape, Shape{p.heads()});
}

// ---- Packed sequences: each one is an attention call of its own, on views of the packed tensors.

// Tokens [begin, end) along `axis` of a rank-4 view.
template <class T>
TensorView<T> token_range(TensorView<T> view4, int axis, int64_t begin, int64_t end) {
  TensorView<T> part = view4;
  part.data += begin * view4.strides[static_cast<size_t>(axis)];
  part.shape[axis] = end - begin;
  return part;
}

// Sequence n's queries [q0, q1) and keys [k0, k1).
struct SequenceRange {
  int64_t index, q0, q1, k0, k1;
};

template <class T>
SequenceRange sequence_range(const AttentionOperands<T>& p, int64_t n) {
  const auto at = static_cast<size_t>(n);
  return {n, p.cu_q[at], p.cu_q[at + 1], p.cu_k[at], p.cu_k[at + 1]};
}

// The problem of one sequence, unpacked: rank-4 views of its tokens, its own band.
template <class P>
P sequence_problem(const P& p, const SequenceRange& r) {
  P s = p;
  s.q = token_range(p.q, 2, r.q0, r.q1);
  s.k = token_range(p.k, 2, r.k0, r.k1);
  s.v = token_range(p.v, 2, r.k0, r.k1);
  if (p.allowed) s.allowed = token_range(token_range(*p.allowed, 2, r.q0, r.q1), 3, r.k0, r.k1);
  if (p.bias) {
    s.bias = token_range(token_range(*p.bias, 2, r.q0, r.q1), 3, r.k0, r.k1);
    s.bias_shape = s.bias->shape;
  }
  s.q_shape = s.q.shape;
  s.k_shape = s.k.shape;
  s.v_shape = s.v.shape;
  s.cu_q.clear();
  s.cu_k.clear();
  s.batch0 = r.index;
  s.set_band();
  return s;
}

// Queries [q0, q1) of a per-row statistic (lse) [B, H, Tq] or [H, Tq], as [1, H, q1 − q0].
template <class T>
TensorView<T> row_stat_range(TensorView<T> stat, const SequenceRange& r) {
  const TensorView<T> part = token_range(as_rank4(stat), 3, r.q0, r.q1);  // [1, 1, H, n]
  return {part.data,
          Shape{part.shape[1], part.shape[2], part.shape[3]},
          {part.strides[1], part.strides[2], part.strides[3]}};
}

template <class T>
AttentionOutputs<T> sequence_outputs(const AttentionOutputs<T>& o, const SequenceRange& r) {
  AttentionOutputs<T> s{.out = token_range(as_bhtd(o.out, "out"), 2, r.q0, r.q1), .weights = {}, .lse = {}};
  if (o.weights) s.weights = token_range(token_range(as_bhtd(*o.weights, "weights"), 2, r.q0, r.q1), 3, r.k0, r.k1);
  if (o.lse) s.lse = row_stat_range(*o.lse, r);
  return s;
}

// dbias over the packed scores is seen through the bias's broadcast, so that each sequence's part
// keeps the bias's strides (0 along broadcast dims) and its gradient sums where the bias repeats.
template <class T, class Gradients>
Gradients sequence_gradients(const AttentionOperands<T>& p, const Gradients& g, const SequenceRange& r) {
  Gradients s = g;
  s.dq = token_range(as_bhtd(g.dq, "dq"), 2, r.q0, r.q1);
  s.dk = token_range(as_bhtd(g.dk, "dk"), 2, r.k0, r.k1);
  s.dv = token_range(as_bhtd(g.dv, "dv"), 2, r.k0, r.k1);
  if (g.dbias)
    s.dbias = token_range(token_range(broadcast_to(*g.dbias, p.scores(), "dbias"), 2, r.q0, r.q1), 3, r.k0, r.k1);
  return s;
}

// An operand stored narrower than float32 (qkv/core/storage.hpp) seen as [B, H, T, D] like the
// problem's views: its first element, its rank-4 strides and, for int8, its scales broadcast to
// [B, H, T, D]. A float32 operand is read from the problem's own view instead.
struct StoredOperand {
  StorageType type = StorageType::float32;
  const void* data = nullptr;
  Strides strides{};
  std::optional<TensorView<const float>> scales = std::nullopt;
  // In a KV cache's pages (null: not paged): token t is row t % page_tokens of page
  // pages[t / page_tokens], pages page_stride elements apart and their scales scale_page_stride.
  const int64_t* pages = nullptr;
  int64_t page_tokens = 0;
  int64_t page_stride = 0;
  int64_t scale_page_stride = 0;
};

struct StoredOperands {
  StoredOperand q, k, v;
};

// A stored operand's data, type and scales against what the kernels take (int8 only where
// int8_allowed, and then with finite scales that broadcast to its shape): those scales broadcast,
// or none for the other types. ValueError or ShapeError naming `name` otherwise.
std::optional<TensorView<const float>> checked_stored_scales(const StoredView& view, std::string_view name,
                                                             bool int8_allowed);

// The implementations behind attention_forward and attention_backward, on a problem built once
// (attention.cpp: the reference; attention_fused.cpp: the fused kernel).
template <class T>
void forward_reference(const AttentionProblem<T>& p, const AttentionOutputs<T>& outputs);
template <class T>
void backward_reference(const AttentionProblem<T>& p, TensorView<const T> dout, const AttentionGradients<T>& grads);
template <class T>
void forward_fused(const AttentionProblem<T>& p, const AttentionOutputs<T>& outputs);
// The fused forward reading the operands that `stored` holds narrower than float32 (attention_stored.cpp
// builds the problem, whose own views of them carry only their shapes).
void forward_fused_stored(const AttentionProblem<float>& p, const StoredOperands& stored,
                          const AttentionOutputs<float>& outputs);
template <class T>
void backward_fused(const AttentionProblem<T>& p, TensorView<const T> dout, const AttentionGradients<T>& grads,
                    const std::optional<AttentionSaved<T>>& saved);
// The fused backward reading the stored operands a tile at a time, as forward_fused_stored does.
void backward_fused_stored(const AttentionProblem<float>& p, const StoredOperands& stored, TensorView<const float> dout,
                           const AttentionGradients<float>& grads, const std::optional<AttentionSaved<float>>& saved);

}  // namespace qkv::detail
