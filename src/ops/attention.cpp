#include "qkv/ops/attention.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attention_problem.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"

namespace qkv {
namespace {

using detail::AttentionProblem;
using detail::make_attention_problem;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Starting a parallel region costs microseconds, and far more while the cores are busy; a
// problem of a few thousand multiply-adds, or of one head, runs faster on the calling thread.
template <class T>
bool worth_threads(const AttentionProblem<T>& p) {
  constexpr double kMinWork = 1 << 16;
  const double work = static_cast<double>(p.tq()) * static_cast<double>(p.tk()) * static_cast<double>(p.dk() + p.dv()) *
                      static_cast<double>(p.batch() * p.heads());
  return p.batch() * p.heads() > 1 && work >= kMinWork;
}

template <class T>
void check_fits_reference(const AttentionProblem<T>& p, int matrices, std::string_view what) {
  const double bytes =
      static_cast<double>(matrices) * static_cast<double>(p.tq()) * static_cast<double>(p.tk()) * sizeof(double);
  check_allocation_fits(bytes, fmt::format("{} (the reference materialises {} float64 {}×{} matrices per head)", what,
                                           matrices, p.tq(), p.tk()));
}

// Fills probs [Tq, Tk] with α of head (b, h) and lse [Tq] with each row's log-sum-exp, in float64.
// Masked keys score −inf; a row with no visible key keeps lse = −inf and α = 0.
template <class T>
void head_probabilities(const AttentionProblem<T>& p, int64_t b, int64_t h, std::vector<double>& probs,
                        std::vector<double>& lse) {
  const int64_t tk = p.tk();
  for (int64_t i = 0; i < p.tq(); ++i) {
    double* row = probs.data() + i * tk;
    double max = kNegInf;
    for (int64_t j = 0; j < tk; ++j) {
      double s = kNegInf;
      if (p.visible(b, h, i, j)) {
        double dot = 0.0;
        for (int64_t d = 0; d < p.dk(); ++d)
          dot += static_cast<double>(p.q(b, h, i, d)) * static_cast<double>(p.k(b, h, j, d));
        s = p.scale * dot + (p.bias ? static_cast<double>((*p.bias)(b, h, i, j)) : 0.0);
      }
      row[j] = s;
      max = std::max(max, s);
    }
    if (max == kNegInf) {
      lse[static_cast<size_t>(i)] = kNegInf;
      std::fill(row, row + tk, 0.0);
      continue;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < tk; ++j) sum += std::exp(row[j] - max);
    lse[static_cast<size_t>(i)] = max + std::log(sum);
    // Normalising by the sum, not by exp(lse), keeps α's relative error at ε even for huge scores.
    for (int64_t j = 0; j < tk; ++j) row[j] = std::exp(row[j] - max) / sum;
  }
}

}  // namespace

double default_scale(int64_t dk) { return 1.0 / std::sqrt(static_cast<double>(dk)); }

template <class T>
void attention_forward_reference(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs) {
  const AttentionProblem<T> p = make_attention_problem(params);
  check_shape("out", outputs.out.shape, p.with_leading({p.tq(), p.dv()}));
  if (outputs.weights) check_shape("weights", outputs.weights->shape, p.with_leading({p.tq(), p.tk()}));
  if (outputs.lse) check_shape("lse", outputs.lse->shape, p.with_leading({p.tq()}));
  check_fits_reference(p, 1, "attention_forward_reference");

  const TensorView<T> out = as_bhtd(outputs.out, "out");
  const std::optional<TensorView<T>> weights =
      outputs.weights ? std::optional(as_bhtd(*outputs.weights, "weights")) : std::nullopt;
  const std::optional<TensorView<T>> lse = outputs.lse ? std::optional(as_rank4(*outputs.lse)) : std::nullopt;

  const int64_t heads = p.batch() * p.heads();
#pragma omp parallel if (worth_threads(p))
  {
    std::vector<double> probs(static_cast<size_t>(p.tq() * p.tk()));
    std::vector<double> row_lse(static_cast<size_t>(p.tq()));
    std::vector<double> acc(static_cast<size_t>(p.dv()));
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < heads; ++bh) {
      const int64_t b = bh / p.heads();
      const int64_t h = bh % p.heads();
      head_probabilities(p, b, h, probs, row_lse);
      for (int64_t i = 0; i < p.tq(); ++i) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < p.tk(); ++j) {
          const double alpha = probs[static_cast<size_t>(i * p.tk() + j)];
          if (alpha == 0.0) continue;
          for (int64_t d = 0; d < p.dv(); ++d)
            acc[static_cast<size_t>(d)] += alpha * static_cast<double>(p.v(b, h, j, d));
        }
        for (int64_t d = 0; d < p.dv(); ++d) out(b, h, i, d) = static_cast<T>(acc[static_cast<size_t>(d)]);
        if (weights) {
          for (int64_t j = 0; j < p.tk(); ++j)
            (*weights)(b, h, i, j) = static_cast<T>(probs[static_cast<size_t>(i * p.tk() + j)]);
        }
        if (lse) (*lse)(0, b, h, i) = static_cast<T>(row_lse[static_cast<size_t>(i)]);
      }
    }
  }
}

// Backward of one head, with P = α [Tq, Tk] recomputed in float64 and dO = ∂L/∂out:
//   out_i = Σ_j P_ij v_j                 ⇒ dV_j  = Σ_i P_ij dO_i,     dP_ij = dO_i · v_j
//   P_ij = exp(s_ij) / Σ_l exp(s_il)     ⇒ dS_ij = P_ij (dP_ij − D_i), D_i = Σ_j P_ij dP_ij (= dO_i · out_i)
//   s_ij = scale · q_i·k_j + bias_ij     ⇒ dQ_i = scale Σ_j dS_ij k_j, dK_j = scale Σ_i dS_ij q_i, dbias_ij = dS_ij
// Masked entries have P_ij = 0 and hence dS_ij = 0: no gradient reaches a key a query cannot see,
// and a fully masked row contributes nothing.
template <class T>
void attention_backward_reference(const AttentionParams<T>& params, TensorView<const T> dout,
                                  const AttentionGradients<T>& grads) {
  const AttentionProblem<T> p = make_attention_problem(params);
  check_shape("dout", dout.shape, p.with_leading({p.tq(), p.dv()}));
  check_shape("dq", grads.dq.shape, params.q.shape);
  check_shape("dk", grads.dk.shape, params.k.shape);
  check_shape("dv", grads.dv.shape, params.v.shape);
  if (grads.dbias && !params.mask.bias) throw ShapeError("dbias: given, but the mask has no additive bias");
  if (grads.dbias) check_shape("dbias", grads.dbias->shape, params.mask.bias->shape);
  check_fits_reference(p, 2, "attention_backward_reference");

  const TensorView<const T> dout4 = as_bhtd(dout, "dout");
  const TensorView<T> dq = as_bhtd(grads.dq, "dq");
  const TensorView<T> dk = as_bhtd(grads.dk, "dk");
  const TensorView<T> dv = as_bhtd(grads.dv, "dv");
  const Shape scores{p.batch(), p.heads(), p.tq(), p.tk()};
  const std::optional<TensorView<T>> dbias =
      grads.dbias ? std::optional(broadcast_to(*grads.dbias, scores, "dbias")) : std::nullopt;
  // A bias broadcast over batch or heads sums the gradients of several heads into one element:
  // those heads run one after the other so that no two threads add to the same element.
  const bool heads_independent = !dbias || (dbias->strides[0] != 0 && dbias->strides[1] != 0);

  const int64_t heads = p.batch() * p.heads();
  const auto tk = static_cast<size_t>(p.tk());
#pragma omp parallel if (heads_independent && worth_threads(p))
  {
    std::vector<double> probs(static_cast<size_t>(p.tq()) * tk);
    std::vector<double> row_lse(static_cast<size_t>(p.tq()));
    std::vector<double> dscores(tk);
    std::vector<double> dq_row(static_cast<size_t>(p.dk()));
    std::vector<double> dk_acc(tk * static_cast<size_t>(p.dk()));
    std::vector<double> dv_acc(tk * static_cast<size_t>(p.dv()));
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < heads; ++bh) {
      const int64_t b = bh / p.heads();
      const int64_t h = bh % p.heads();
      head_probabilities(p, b, h, probs, row_lse);
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0);
      for (int64_t i = 0; i < p.tq(); ++i) {
        const double* prob_row = probs.data() + static_cast<size_t>(i) * tk;
        double row_dot = 0.0;  // D_i
        for (int64_t j = 0; j < p.tk(); ++j) {
          const double pij = prob_row[j];
          double dp = 0.0;
          if (pij != 0.0) {
            for (int64_t d = 0; d < p.dv(); ++d)
              dp += static_cast<double>(dout4(b, h, i, d)) * static_cast<double>(p.v(b, h, j, d));
            for (int64_t d = 0; d < p.dv(); ++d)
              dv_acc[static_cast<size_t>(j * p.dv() + d)] += pij * static_cast<double>(dout4(b, h, i, d));
          }
          dscores[static_cast<size_t>(j)] = dp;
          row_dot += pij * dp;
        }
        std::fill(dq_row.begin(), dq_row.end(), 0.0);
        for (int64_t j = 0; j < p.tk(); ++j) {
          const double pij = prob_row[j];
          if (pij == 0.0) continue;
          const double ds = pij * (dscores[static_cast<size_t>(j)] - row_dot);
          if (dbias) (*dbias)(b, h, i, j) += static_cast<T>(ds);
          for (int64_t d = 0; d < p.dk(); ++d) {
            dq_row[static_cast<size_t>(d)] += ds * static_cast<double>(p.k(b, h, j, d));
            dk_acc[static_cast<size_t>(j * p.dk() + d)] += ds * static_cast<double>(p.q(b, h, i, d));
          }
        }
        for (int64_t d = 0; d < p.dk(); ++d) dq(b, h, i, d) += static_cast<T>(p.scale * dq_row[static_cast<size_t>(d)]);
      }
      for (int64_t j = 0; j < p.tk(); ++j) {
        for (int64_t d = 0; d < p.dk(); ++d)
          dk(b, h, j, d) += static_cast<T>(p.scale * dk_acc[static_cast<size_t>(j * p.dk() + d)]);
        for (int64_t d = 0; d < p.dv(); ++d)
          dv(b, h, j, d) += static_cast<T>(dv_acc[static_cast<size_t>(j * p.dv() + d)]);
      }
    }
  }
}

template <class T>
void attention_forward(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs, AttentionImpl impl) {
  switch (impl) {
    case AttentionImpl::automatic:
      // Only the reference materialises α; everything else the fused kernel does faster.
      if (outputs.weights) {
        attention_forward_reference(params, outputs);
      } else {
        attention_forward_fused(params, outputs);
      }
      return;
    case AttentionImpl::reference:
      attention_forward_reference(params, outputs);
      return;
    case AttentionImpl::fused:
      attention_forward_fused(params, outputs);
      return;
  }
}

template <class T>
void attention_backward(const AttentionParams<T>& params, TensorView<const T> dout, const AttentionGradients<T>& grads,
                        const std::optional<AttentionSaved<T>>& saved, AttentionImpl impl) {
  switch (impl) {
    case AttentionImpl::automatic:
    case AttentionImpl::fused:
      attention_backward_fused(params, dout, grads, saved);
      return;
    case AttentionImpl::reference:
      attention_backward_reference(params, dout, grads);
      return;
  }
}

#define QKV_INSTANTIATE_ATTENTION(T)                                                                             \
  template void attention_forward_reference(const AttentionParams<T>&, const AttentionOutputs<T>&);              \
  template void attention_backward_reference(const AttentionParams<T>&, TensorView<const T>,                     \
                                             const AttentionGradients<T>&);                                      \
  template void attention_forward(const AttentionParams<T>&, const AttentionOutputs<T>&, AttentionImpl);         \
  template void attention_backward(const AttentionParams<T>&, TensorView<const T>, const AttentionGradients<T>&, \
                                   const std::optional<AttentionSaved<T>>&, AttentionImpl);

QKV_INSTANTIATE_ATTENTION(float)
QKV_INSTANTIATE_ATTENTION(double)
#undef QKV_INSTANTIATE_ATTENTION

}  // namespace qkv
