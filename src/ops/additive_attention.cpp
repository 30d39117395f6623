#include "qkv/ops/additive_attention.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "attention_problem.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"
#include "qkv/ops/softmax.hpp"

namespace qkv {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The arguments once checked: the operands every attention shares (attention_problem.hpp) and
// the score's weights.
template <class T>
struct Problem : detail::AttentionOperands<T> {
  int64_t hidden = 0;       // A
  TensorView<const T> w_q;  // [A, Dq]
  TensorView<const T> w_k;  // [A, Dk]
  std::vector<double> w;    // [A]
};

template <class T>
void check_tensor(TensorView<T> view, std::string_view name, const Shape& expected) {
  detail::check_dims_not_negative(TensorView<const T>(view), name);
  check_last_dim_contiguous(view, name);
  check_shape(name, view.shape, expected);
}

template <class T>
Problem<T> check_params(const AdditiveAttentionParams<T>& params) {
  Problem<T> p;
  static_cast<detail::AttentionOperands<T>&>(p) =
      detail::make_attention_operands(params.q, params.k, params.v, params.mask, detail::KeyDim::any);
  if (p.kv_heads() != p.heads()) {
    throw ShapeError(fmt::format("k: additive attention needs as many key heads as query heads ({}), got shape {}",
                                 p.heads(), params.k.shape.str()));
  }
  if (params.w_q.rank() != 2 || params.w_q.shape[1] != p.dq()) {
    throw ShapeError(fmt::format("w_q: expected shape [A, {}] ([A, Dq]), got {}", p.dq(), params.w_q.shape.str()));
  }
  detail::check_dims_not_negative(params.w_q, "w_q");
  check_last_dim_contiguous(params.w_q, "w_q");
  p.hidden = params.w_q.shape[0];
  check_tensor(params.w_k, "w_k", Shape{p.hidden, p.dk()});
  check_tensor(params.w, "w", Shape{p.hidden});
  p.w_q = params.w_q;
  p.w_k = params.w_k;
  for (int64_t a = 0; a < p.hidden; ++a) p.w.push_back(static_cast<double>(params.w(a)));
  return p;
}

// Refuses, before anything is allocated or written, a problem whose per-head float64 buffers
// (`doubles` of them, dominated by the Tq×Tk scores) exceed the memory available.
template <class T>
void check_fits_in_memory(const Problem<T>& p, double doubles, std::string_view op) {
  check_allocation_fits(doubles * static_cast<double>(sizeof(double)),
                        fmt::format("{} (Tq = {}, Tk = {}, A = {}: the reference materialises one float64 Tq×Tk "
                                    "matrix and the Tq×A, Tk×A projections per head)",
                                    op, p.tq(), p.tk(), p.hidden));
}

// The hidden pre-activations of one head's rows: proj[t, a] = Σ_d weight[a, d] x[b, h, t, d], [T, A].
template <class T>
void project(TensorView<const T> x, TensorView<const T> weight, int64_t b, int64_t h, std::vector<double>& proj) {
  const int64_t rows = x.shape[2], width = x.shape[3], hidden = weight.shape[0];
  proj.assign(static_cast<size_t>(rows * hidden), 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t a = 0; a < hidden; ++a) {
      double sum = 0.0;
      for (int64_t d = 0; d < width; ++d) sum += static_cast<double>(weight(a, d)) * static_cast<double>(x(b, h, t, d));
      proj[t * hidden + a] = sum;
    }
  }
}

// One head's softmax. From the projections pq [Tq, A] and pk [Tk, A] it fills probs [Tq, Tk] with
// α_ij and lse [Tq] with the row log-sum-exp. The tanh is evaluated only for visible pairs; a row
// with no visible key (its max is −inf) gets lse −inf and α 0 instead of exp(−inf − (−inf)) = NaN.
template <class T>
void head_softmax(const Problem<T>& p, int64_t b, int64_t h, const std::vector<double>& pq,
                  const std::vector<double>& pk, std::vector<double>& probs, std::vector<double>& lse) {
  const int64_t tq = p.tq(), tk = p.tk(), hidden = p.hidden;
  probs.assign(static_cast<size_t>(tq * tk), kNegInf);
  lse.assign(static_cast<size_t>(tq), kNegInf);
  for (int64_t i = 0; i < tq; ++i) {
    const std::span<double> e(probs.data() + i * tk, static_cast<size_t>(tk));
    const double* pq_i = pq.data() + i * hidden;
    for (int64_t j = 0; j < tk; ++j) {
      if (!p.visible(b, h, i, j)) continue;
      const double* pk_j = pk.data() + j * hidden;
      double score = 0.0;
      for (int64_t a = 0; a < hidden; ++a) score += p.w[a] * std::tanh(pq_i[a] + pk_j[a]);
      score += p.added_bias(b, h, i, j);
      e[static_cast<size_t>(j)] = score;
    }
    lse[i] = softmax<double>(e, e);
  }
}

// Sequence r of a packed call as an unpacked call of its own, on views of the packed tensors.
template <class T>
AdditiveAttentionParams<T> sequence_params(const AdditiveAttentionParams<T>& params, const Problem<T>& p,
                                           const detail::SequenceRange& r) {
  AdditiveAttentionParams<T> s = params;
  s.q = detail::token_range(p.q, 2, r.q0, r.q1);
  s.k = detail::token_range(p.k, 2, r.k0, r.k1);
  s.v = detail::token_range(p.v, 2, r.k0, r.k1);
  s.mask.cu_seqlens_q = std::nullopt;
  s.mask.cu_seqlens_k = std::nullopt;
  if (p.allowed) s.mask.allowed = detail::token_range(detail::token_range(*p.allowed, 2, r.q0, r.q1), 3, r.k0, r.k1);
  if (p.bias) s.mask.bias = detail::token_range(detail::token_range(*p.bias, 2, r.q0, r.q1), 3, r.k0, r.k1);
  return s;
}

}  // namespace

template <class T>
void additive_attention_forward(const AdditiveAttentionParams<T>& params, const AttentionOutputs<T>& outputs) {
  const Problem<T> p = check_params(params);
  check_tensor(outputs.out, "out", p.with_leading({p.tq(), p.dv()}));
  if (outputs.weights) check_tensor(*outputs.weights, "weights", p.with_leading({p.tq(), p.tk()}));
  if (outputs.lse) check_tensor(*outputs.lse, "lse", p.with_leading({p.tq()}));
  if (p.packed()) {
    for (int64_t n = 0; n < p.sequences(); ++n) {
      const detail::SequenceRange r = detail::sequence_range(p, n);
      additive_attention_forward(sequence_params(params, p, r), detail::sequence_outputs(outputs, r));
    }
    return;
  }
  // probs, lse, pq, pk and one output row.
  check_fits_in_memory(p,
                       static_cast<double>(p.tq()) * static_cast<double>(p.tk()) +
                           static_cast<double>(p.tq() + p.tk()) * static_cast<double>(p.hidden) +
                           static_cast<double>(p.tq() + p.dv()),
                       "additive_attention_forward");

  const TensorView<T> out = as_rank4(outputs.out);
  std::optional<TensorView<T>> weights, lse_out;
  if (outputs.weights) weights = as_rank4(*outputs.weights);
  if (outputs.lse) lse_out = as_rank4(*outputs.lse);  // [1, B, H, Tq] once padded

  std::vector<double> pq, pk, probs, lse, row(static_cast<size_t>(p.dv()));
  for (int64_t b = 0; b < p.batch(); ++b) {
    for (int64_t h = 0; h < p.heads(); ++h) {
      project(p.q, p.w_q, b, h, pq);
      project(p.k, p.w_k, b, h, pk);
      head_softmax(p, b, h, pq, pk, probs, lse);
      for (int64_t i = 0; i < p.tq(); ++i) {
        const double* alpha = probs.data() + i * p.tk();
        std::fill(row.begin(), row.end(), 0.0);
        for (int64_t j = 0; j < p.tk(); ++j) {
          if (alpha[j] == 0.0) continue;
          for (int64_t d = 0; d < p.dv(); ++d) row[d] += alpha[j] * static_cast<double>(p.v(b, h, j, d));
        }
        for (int64_t d = 0; d < p.dv(); ++d) out(b, h, i, d) = static_cast<T>(row[d]);
        if (weights) {
          for (int64_t j = 0; j < p.tk(); ++j) (*weights)(b, h, i, j) = static_cast<T>(alpha[j]);
        }
        if (lse_out) (*lse_out)(0, b, h, i) = static_cast<T>(lse[i]);
      }
    }
  }
}

// Backward of L = Σ_i <dout_i, out_i> for one head, with
//   z_ija = (W_q q_i)_a + (W_k k_j)_a,  t_ija = tanh(z_ija),  e_ij = Σ_a w_a t_ija + bias_ij,
//   α_ij = softmax_j(e_ij),  out_i = Σ_j α_ij v_j:
//
//   dv_j       = Σ_i α_ij dout_i
//   dα_ij      = <dout_i, v_j>
//   de_ij      = α_ij (dα_ij − Σ_l α_il dα_il)   softmax backward, from ∂α_il/∂e_ij = α_il (δ_lj − α_ij)
//   dbias_ij   = de_ij                          summed over the dims along which the bias broadcasts
//   dw_a       = Σ_ij de_ij t_ija
//   dz_ija     = de_ij w_a (1 − t_ija²)          tanh' = 1 − tanh²
//   dpq_ia     = Σ_j dz_ija,  dpk_ja = Σ_i dz_ija   z is the sum of the two projections
//   dW_q[a, d] = Σ_i dpq_ia q_id,  dq_id = Σ_a dpq_ia W_q[a, d]
//   dW_k[a, d] = Σ_j dpk_ja k_jd,  dk_jd = Σ_a dpk_ja W_k[a, d]
//
// A masked pair has α_ij = 0, hence de_ij = 0 and no contribution anywhere: the loops skip every
// pair with de_ij = 0, which also gives a fully masked row exactly zero gradients. The tanh tensor
// [Tq, Tk, A] is recomputed here rather than kept from the forward.
template <class T>
void additive_attention_backward(const AdditiveAttentionParams<T>& params, TensorView<const T> dout,
                                 const AdditiveAttentionGradients<T>& grads) {
  const Problem<T> p = check_params(params);
  check_tensor(dout, "dout", p.with_leading({p.tq(), p.dv()}));
  check_tensor(grads.dq, "dq", params.q.shape);
  check_tensor(grads.dk, "dk", params.k.shape);
  check_tensor(grads.dv, "dv", params.v.shape);
  check_tensor(grads.dw_q, "dw_q", params.w_q.shape);
  check_tensor(grads.dw_k, "dw_k", params.w_k.shape);
  check_tensor(grads.dw, "dw", params.w.shape);
  if (grads.dbias) {
    if (!params.mask.bias) throw ShapeError("dbias: given, but the mask has no additive bias");
    check_shape("dbias", grads.dbias->shape, params.mask.bias->shape);
  }
  if (p.packed()) {
    for (int64_t n = 0; n < p.sequences(); ++n) {
      const detail::SequenceRange r = detail::sequence_range(p, n);
      additive_attention_backward(sequence_params(params, p, r),
                                  TensorView<const T>(detail::token_range(as_bhtd(dout, "dout"), 2, r.q0, r.q1)),
                                  detail::sequence_gradients(p, grads, r));
    }
    return;
  }
  // probs, lse, pq, dpq, pk, dpk, dv of one head, and the dbias accumulator.
  const double bias_numel = params.mask.bias ? static_cast<double>(params.mask.bias->numel()) : 0.0;
  check_fits_in_memory(p,
                       static_cast<double>(p.tq()) * static_cast<double>(p.tk()) + static_cast<double>(p.tq()) +
                           2.0 * static_cast<double>(p.tq() + p.tk()) * static_cast<double>(p.hidden) +
                           static_cast<double>(p.tk()) * static_cast<double>(p.dv()) + bias_numel,
                       "additive_attention_backward");

  const TensorView<const T> dout4 = as_rank4(dout);
  const TensorView<T> dq = as_rank4(grads.dq), dk = as_rank4(grads.dk), dv = as_rank4(grads.dv);
  const int64_t hidden = p.hidden;

  // Weight and bias gradients sum over every head: they are accumulated in float64 and added once.
  std::vector<double> dw_q(static_cast<size_t>(hidden * p.dq()), 0.0), dw_k(static_cast<size_t>(hidden * p.dk()), 0.0);
  std::vector<double> dw(static_cast<size_t>(hidden), 0.0);
  std::optional<Tensor<double>> dbias;
  std::optional<TensorView<double>> dbias_scores;  // [B, H, Tq, Tk], stride 0 along broadcast dims
  if (grads.dbias) {
    dbias.emplace(params.mask.bias->shape);
    dbias_scores = broadcast_to(dbias->view(), Shape{p.batch(), p.heads(), p.tq(), p.tk()}, "bias");
  }

  std::vector<double> pq, pk, de, lse, dpq, dpk, dalpha(static_cast<size_t>(p.tk())), dv_head;
  for (int64_t b = 0; b < p.batch(); ++b) {
    for (int64_t h = 0; h < p.heads(); ++h) {
      project(p.q, p.w_q, b, h, pq);
      project(p.k, p.w_k, b, h, pk);
      head_softmax(p, b, h, pq, pk, de, lse);  // de holds α; each row is overwritten by its de below
      dpq.assign(static_cast<size_t>(p.tq() * hidden), 0.0);
      dpk.assign(static_cast<size_t>(p.tk() * hidden), 0.0);
      dv_head.assign(static_cast<size_t>(p.tk() * p.dv()), 0.0);

      for (int64_t i = 0; i < p.tq(); ++i) {
        double* row = de.data() + i * p.tk();
        double expected_dalpha = 0.0;  // Σ_l α_il dα_il
        for (int64_t j = 0; j < p.tk(); ++j) {
          dalpha[j] = 0.0;
          if (row[j] == 0.0) continue;
          for (int64_t d = 0; d < p.dv(); ++d) {
            const double g = static_cast<double>(dout4(b, h, i, d));
            dalpha[j] += g * static_cast<double>(p.v(b, h, j, d));
            dv_head[j * p.dv() + d] += row[j] * g;
          }
          expected_dalpha += row[j] * dalpha[j];
        }
        for (int64_t j = 0; j < p.tk(); ++j) row[j] *= dalpha[j] - expected_dalpha;

        const double* pq_i = pq.data() + i * hidden;
        double* dpq_i = dpq.data() + i * hidden;
        for (int64_t j = 0; j < p.tk(); ++j) {
          const double de_ij = row[j];
          if (de_ij == 0.0) continue;
          if (dbias_scores) (*dbias_scores)(b, h, i, j) += de_ij;
          const double* pk_j = pk.data() + j * hidden;
          double* dpk_j = dpk.data() + j * hidden;
          for (int64_t a = 0; a < hidden; ++a) {
            const double t = std::tanh(pq_i[a] + pk_j[a]);
            dw[a] += de_ij * t;
            const double dz = de_ij * p.w[a] * (1.0 - t * t);
            dpq_i[a] += dz;
            dpk_j[a] += dz;
          }
        }
      }

      for (int64_t i = 0; i < p.tq(); ++i) {
        for (int64_t d = 0; d < p.dq(); ++d) {
          double sum = 0.0;
          for (int64_t a = 0; a < hidden; ++a) {
            sum += dpq[i * hidden + a] * static_cast<double>(p.w_q(a, d));
            dw_q[a * p.dq() + d] += dpq[i * hidden + a] * static_cast<double>(p.q(b, h, i, d));
          }
          dq(b, h, i, d) += static_cast<T>(sum);
        }
      }
      for (int64_t j = 0; j < p.tk(); ++j) {
        for (int64_t d = 0; d < p.dk(); ++d) {
          double sum = 0.0;
          for (int64_t a = 0; a < hidden; ++a) {
            sum += dpk[j * hidden + a] * static_cast<double>(p.w_k(a, d));
            dw_k[a * p.dk() + d] += dpk[j * hidden + a] * static_cast<double>(p.k(b, h, j, d));
          }
          dk(b, h, j, d) += static_cast<T>(sum);
        }
        for (int64_t d = 0; d < p.dv(); ++d) dv(b, h, j, d) += static_cast<T>(dv_head[j * p.dv() + d]);
      }
    }
  }

  for (int64_t a = 0; a < hidden; ++a) {
    for (int64_t d = 0; d < p.dq(); ++d) grads.dw_q(a, d) += static_cast<T>(dw_q[a * p.dq() + d]);
    for (int64_t d = 0; d < p.dk(); ++d) grads.dw_k(a, d) += static_cast<T>(dw_k[a * p.dk() + d]);
    grads.dw(a) += static_cast<T>(dw[a]);
  }
  if (grads.dbias) {
    const TensorView<T> target = as_rank4(*grads.dbias);
    const TensorView<const double> source = as_rank4(dbias->cview());
    for (int64_t i0 = 0; i0 < target.shape[0]; ++i0)
      for (int64_t i1 = 0; i1 < target.shape[1]; ++i1)
        for (int64_t i2 = 0; i2 < target.shape[2]; ++i2)
          for (int64_t i3 = 0; i3 < target.shape[3]; ++i3)
            target(i0, i1, i2, i3) += static_cast<T>(source(i0, i1, i2, i3));
  }
}

#define QKV_INSTANTIATE_ADDITIVE_ATTENTION(T)                                                              \
  template void additive_attention_forward(const AdditiveAttentionParams<T>&, const AttentionOutputs<T>&); \
  template void additive_attention_backward(const AdditiveAttentionParams<T>&, TensorView<const T>,        \
                                            const AdditiveAttentionGradients<T>&);

QKV_INSTANTIATE_ADDITIVE_ATTENTION(float)
QKV_INSTANTIATE_ADDITIVE_ATTENTION(double)
#undef QKV_INSTANTIATE_ADDITIVE_ATTENTION

}  // namespace qkv
