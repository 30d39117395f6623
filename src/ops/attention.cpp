#include "qkv/ops/attention.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "attention_problem.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/ops/softmax.hpp"

namespace qkv {
namespace {

using detail::AttentionProblem;
using detail::make_attention_problem;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// parallel_for's thread limit for the whole problem, by the one policy (core/parallel.hpp).
template <class T>
int thread_limit_of(const AttentionProblem<T>& p) {
  return thread_limit(static_cast<double>(p.tq()) * static_cast<double>(p.tk()) * static_cast<double>(p.dk() + p.dv()) *
                      static_cast<double>(p.batch() * p.heads()));
}

// Per-worker float64 buffers of the reference, kept across the heads a worker runs.
struct HeadScratch {
  std::vector<double> probs, row_lse, acc, dscores, dq_row, dk_acc, dv_acc;
};

template <class T>
void check_fits_reference(const AttentionProblem<T>& p, int matrices, std::string_view what) {
  const double bytes =
      static_cast<double>(matrices) * static_cast<double>(p.tq()) * static_cast<double>(p.tk()) * sizeof(double);
  check_allocation_fits(bytes, fmt::format("{} (the reference materialises {} float64 {}×{} matrices per head)", what,
                                           matrices, p.tq(), p.tk()));
}

// Fills probs [Tq, Tk] with α of head (b, h) and lse [Tq] with each row's log-sum-exp, in float64.
// Masked keys score −inf; a row with no visible key keeps lse = −inf (the sink's logit, with a
// sink) and α = 0. A sink is one more score in the row's softmax, whose weight is dropped.
template <class T>
void head_probabilities(const AttentionProblem<T>& p, int64_t b, int64_t h, std::vector<double>& probs,
                        std::vector<double>& lse) {
  const auto tk = static_cast<size_t>(p.tk());
  const int64_t hk = p.kv_head(h);
  std::vector<double> with_sink(p.sinks ? tk + 1 : 0);
  for (int64_t i = 0; i < p.tq(); ++i) {
    const std::span<double> row(probs.data() + static_cast<size_t>(i) * tk, tk);
    for (int64_t j = 0; j < p.tk(); ++j) {
      double s = kNegInf;
      if (p.visible(b, h, i, j)) {
        double dot = 0.0;
        for (int64_t d = 0; d < p.dk(); ++d)
          dot += static_cast<double>(p.q(b, h, i, d)) * static_cast<double>(p.k(b, hk, j, d));
        s = p.capped(dot) + p.added_bias(b, h, i, j);
      }
      row[static_cast<size_t>(j)] = s;
    }
    if (p.sinks) {
      std::copy(row.begin(), row.end(), with_sink.begin());
      with_sink[tk] = static_cast<double>((*p.sinks)(h));
      lse[static_cast<size_t>(i)] = softmax<double>(with_sink, with_sink);
      std::copy(with_sink.begin(), with_sink.begin() + static_cast<ptrdiff_t>(tk), row.begin());
    } else {
      lse[static_cast<size_t>(i)] = softmax<double>(row, row);
    }
  }
}

}  // namespace

double default_scale(int64_t dk) { return 1.0 / std::sqrt(static_cast<double>(dk)); }

std::vector<double> alibi_slopes(int64_t heads) {
  if (heads < 0) throw ValueError(fmt::format("heads: expected at least 0, got {}", heads));
  const auto geometric = [](int64_t n) {
    std::vector<double> slopes(static_cast<size_t>(n));
    for (int64_t h = 0; h < n; ++h)
      slopes[static_cast<size_t>(h)] = std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(n));
    return slopes;
  };
  int64_t power = 1;
  while (power * 2 <= heads) power *= 2;
  std::vector<double> slopes = geometric(heads == 0 ? 0 : power);
  if (power < heads) {
    const std::vector<double> finer = geometric(2 * power);
    for (int64_t h = 0; static_cast<int64_t>(slopes.size()) < heads; ++h)
      slopes.push_back(finer[static_cast<size_t>(2 * h)]);
  }
  return slopes;
}

namespace detail {

template <class T>
void forward_reference(const AttentionProblem<T>& p, const AttentionOutputs<T>& outputs) {
  check_forward_outputs(p, outputs);
  if (p.packed()) {
    for (int64_t n = 0; n < p.sequences(); ++n) {
      const SequenceRange r = sequence_range(p, n);
      forward_reference(sequence_problem(p, r), sequence_outputs(outputs, r));
    }
    return;
  }
  check_fits_reference(p, 1, "attention_forward_reference");

  const TensorView<T> out = as_bhtd(outputs.out, "out");
  const std::optional<TensorView<T>> weights =
      outputs.weights ? std::optional(as_bhtd(*outputs.weights, "weights")) : std::nullopt;
  const std::optional<TensorView<T>> lse = outputs.lse ? std::optional(as_rank4(*outputs.lse)) : std::nullopt;

  std::vector<HeadScratch> scratch(static_cast<size_t>(max_workers()));
  parallel_for(
      p.batch() * p.heads(),
      [&](int64_t bh, int worker) {
        HeadScratch& s = scratch[static_cast<size_t>(worker)];
        s.probs.resize(static_cast<size_t>(p.tq() * p.tk()));
        s.row_lse.resize(static_cast<size_t>(p.tq()));
        s.acc.resize(static_cast<size_t>(p.dv()));
        const int64_t b = bh / p.heads();
        const int64_t h = bh % p.heads();
        const int64_t hk = p.kv_head(h);
        head_probabilities(p, b, h, s.probs, s.row_lse);
        for (int64_t i = 0; i < p.tq(); ++i) {
          std::fill(s.acc.begin(), s.acc.end(), 0.0);
          for (int64_t j = 0; j < p.tk(); ++j) {
            const double alpha = s.probs[static_cast<size_t>(i * p.tk() + j)] * p.dropout_factor(b, h, i, j);
            if (alpha == 0.0) continue;
            for (int64_t d = 0; d < p.dv(); ++d)
              s.acc[static_cast<size_t>(d)] += alpha * static_cast<double>(p.v(b, hk, j, d));
          }
          for (int64_t d = 0; d < p.dv(); ++d) out(b, h, i, d) = static_cast<T>(s.acc[static_cast<size_t>(d)]);
          if (weights) {
            for (int64_t j = 0; j < p.tk(); ++j)
              (*weights)(b, h, i, j) = static_cast<T>(s.probs[static_cast<size_t>(i * p.tk() + j)]);
          }
          if (lse) (*lse)(0, b, h, i) = static_cast<T>(s.row_lse[static_cast<size_t>(i)]);
        }
      },
      thread_limit_of(p));
}

// Backward of one head, with P = α [Tq, Tk] recomputed in float64 and dO = ∂L/∂out:
//   out_i = Σ_j P_ij v_j                 ⇒ dV_j  = Σ_i P_ij dO_i,     dP_ij = dO_i · v_j
//   P_ij = exp(s_ij) / Σ_l exp(s_il)     ⇒ dS_ij = P_ij (dP_ij − D_i), D_i = Σ_j P_ij dP_ij (= dO_i · out_i)
//   s_ij = x_ij + bias_ij, x = scale·q·k ⇒ dQ_i = scale Σ_j dX_ij k_j, dK_j = scale Σ_i dX_ij q_i, dbias_ij = dS_ij
// with dX = dS, or dX = dS sech²(x / c) through a softcap c·tanh(x / c). Dropout scales
// P_ij by its factor m_ij in out: dV_j = Σ_i P_ij m_ij dO_i and dP_ij = m_ij dO_i · v_j. A sink is a score
// with no value (dP = 0): d sink_h = Σ_i −P_sink,i D_i. Masked entries have P_ij = 0 and hence
// dS_ij = 0: no gradient reaches a key a query cannot see, and a fully masked row contributes
// nothing. The heads of a group share K and V: one task runs them in order, summing dK and dV.
template <class T>
void backward_reference(const AttentionProblem<T>& p, TensorView<const T> dout, const AttentionGradients<T>& grads) {
  check_backward_arguments(p, dout, grads);
  check_sink_gradient(p, grads);
  if (p.packed()) {
    for (int64_t n = 0; n < p.sequences(); ++n) {
      const SequenceRange r = sequence_range(p, n);
      backward_reference(sequence_problem(p, r), token_range(as_bhtd(dout, "dout"), 2, r.q0, r.q1),
                         sequence_gradients(p, grads, r));
    }
    return;
  }
  check_fits_reference(p, 2, "attention_backward_reference");

  const TensorView<const T> dout4 = as_bhtd(dout, "dout");
  const TensorView<T> dq = as_bhtd(grads.dq, "dq");
  const TensorView<T> dk = as_bhtd(grads.dk, "dk");
  const TensorView<T> dv = as_bhtd(grads.dv, "dv");
  const std::optional<TensorView<T>> dbias =
      grads.dbias ? std::optional(broadcast_to(*grads.dbias, p.scores(), "dbias")) : std::nullopt;
  // A bias broadcast over batch or heads sums the gradients of several heads into one element:
  // those heads run one after the other so that no two threads add to the same element.
  const bool heads_independent = !dbias || (dbias->strides[0] != 0 && dbias->strides[1] != 0);
  const int64_t group = p.heads() / std::max<int64_t>(1, p.kv_heads());
  // Σ_i −P_sink,i D_i of each (b, h), summed over b in order at the end.
  std::vector<double> sink_grads(grads.dsinks ? static_cast<size_t>(p.batch() * p.heads()) : 0);

  const auto tk = static_cast<size_t>(p.tk());
  std::vector<HeadScratch> scratch(static_cast<size_t>(max_workers()));
  parallel_for(
      p.batch() * p.kv_heads(),
      [&](int64_t bhk, int worker) {
        HeadScratch& s = scratch[static_cast<size_t>(worker)];
        s.probs.resize(static_cast<size_t>(p.tq()) * tk);
        s.row_lse.resize(static_cast<size_t>(p.tq()));
        s.dscores.resize(tk);
        s.dq_row.resize(static_cast<size_t>(p.dk()));
        s.dk_acc.assign(tk * static_cast<size_t>(p.dk()), 0.0);
        s.dv_acc.assign(tk * static_cast<size_t>(p.dv()), 0.0);
        const int64_t b = bhk / p.kv_heads();
        const int64_t hk = bhk % p.kv_heads();
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          head_probabilities(p, b, h, s.probs, s.row_lse);
          for (int64_t i = 0; i < p.tq(); ++i) {
            const double* prob_row = s.probs.data() + static_cast<size_t>(i) * tk;
            double row_dot = 0.0;  // D_i
            for (int64_t j = 0; j < p.tk(); ++j) {
              const double pij = prob_row[j];
              double dp = 0.0;  // ∂L/∂P_ij: dO_i·v_j through the dropout factor
              if (pij != 0.0) {
                const double factor = p.dropout_factor(b, h, i, j);
                for (int64_t d = 0; d < p.dv(); ++d)
                  dp += static_cast<double>(dout4(b, h, i, d)) * static_cast<double>(p.v(b, hk, j, d));
                dp *= factor;
                for (int64_t d = 0; d < p.dv(); ++d) {
                  s.dv_acc[static_cast<size_t>(j * p.dv() + d)] +=
                      pij * factor * static_cast<double>(dout4(b, h, i, d));
                }
              }
              s.dscores[static_cast<size_t>(j)] = dp;
              row_dot += pij * dp;
            }
            if (p.sinks && !sink_grads.empty()) {
              sink_grads[static_cast<size_t>(b * p.heads() + h)] -=
                  std::exp(static_cast<double>((*p.sinks)(h)) - s.row_lse[static_cast<size_t>(i)]) * row_dot;
            }
            std::fill(s.dq_row.begin(), s.dq_row.end(), 0.0);
            for (int64_t j = 0; j < p.tk(); ++j) {
              const double pij = prob_row[j];
              if (pij == 0.0) continue;
              const double ds = pij * (s.dscores[static_cast<size_t>(j)] - row_dot);
              if (dbias) (*dbias)(b, h, i, j) += static_cast<T>(ds);
              double dx = ds;
              if (p.softcap > 0.0) {
                double dot = 0.0;
                for (int64_t d = 0; d < p.dk(); ++d)
                  dot += static_cast<double>(p.q(b, h, i, d)) * static_cast<double>(p.k(b, hk, j, d));
                // 1 / cosh², not 1 − tanh², which is 0 from |x / c| ≈ 19 in double and coarse before.
                const double cosh_y = std::cosh(p.scale * dot / p.softcap);
                dx /= cosh_y * cosh_y;
              }
              for (int64_t d = 0; d < p.dk(); ++d) {
                s.dq_row[static_cast<size_t>(d)] += dx * static_cast<double>(p.k(b, hk, j, d));
                s.dk_acc[static_cast<size_t>(j * p.dk() + d)] += dx * static_cast<double>(p.q(b, h, i, d));
              }
            }
            for (int64_t d = 0; d < p.dk(); ++d)
              dq(b, h, i, d) += static_cast<T>(p.scale * s.dq_row[static_cast<size_t>(d)]);
          }
        }
        for (int64_t j = 0; j < p.tk(); ++j) {
          for (int64_t d = 0; d < p.dk(); ++d)
            dk(b, hk, j, d) += static_cast<T>(p.scale * s.dk_acc[static_cast<size_t>(j * p.dk() + d)]);
          for (int64_t d = 0; d < p.dv(); ++d)
            dv(b, hk, j, d) += static_cast<T>(s.dv_acc[static_cast<size_t>(j * p.dv() + d)]);
        }
      },
      heads_independent ? thread_limit_of(p) : 1);
  if (grads.dsinks) {
    for (int64_t h = 0; h < p.heads(); ++h) {
      double sum = 0.0;
      for (int64_t b = 0; b < p.batch(); ++b) sum += sink_grads[static_cast<size_t>(b * p.heads() + h)];
      (*grads.dsinks)(h) += static_cast<T>(sum);
    }
  }
}

}  // namespace detail

template <class T>
void attention_forward_reference(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs) {
  detail::forward_reference(make_attention_problem(params), outputs);
}

template <class T>
void attention_backward_reference(const AttentionParams<T>& params, TensorView<const T> dout,
                                  const AttentionGradients<T>& grads) {
  detail::backward_reference(make_attention_problem(params), dout, grads);
}

template <class T>
void attention_forward(const AttentionParams<T>& params, const AttentionOutputs<T>& outputs, AttentionImpl impl) {
  const AttentionProblem<T> p = make_attention_problem(params);
  switch (impl) {
    case AttentionImpl::automatic:
      // Only the reference materialises α; everything else the fused kernel does faster.
      if (outputs.weights) {
        detail::forward_reference(p, outputs);
      } else {
        detail::forward_fused(p, outputs);
      }
      return;
    case AttentionImpl::reference:
      detail::forward_reference(p, outputs);
      return;
    case AttentionImpl::fused:
      detail::forward_fused(p, outputs);
      return;
  }
}

template <class T>
void attention_backward(const AttentionParams<T>& params, TensorView<const T> dout, const AttentionGradients<T>& grads,
                        const std::optional<AttentionSaved<T>>& saved, AttentionImpl impl) {
  const AttentionProblem<T> p = make_attention_problem(params);
  switch (impl) {
    case AttentionImpl::automatic:
    case AttentionImpl::fused:
      detail::backward_fused(p, dout, grads, saved);
      return;
    case AttentionImpl::reference:
      detail::backward_reference(p, dout, grads);
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
