#pragma once
// Random attention problems and the tolerance rule that judges an implementation on them, shared by
// the tests (tests/support/testing.hpp) and `qkv soak`, so that the soak holds the fused kernels to
// exactly the rule the suite does: a case's sizes, its random float64 tensors and masks, the views a
// call takes, the formula computed as it reads (in float64 for the exact answer, in float32 for the
// naive error the tolerance is a multiple of), and the tolerance itself. No test framework here.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "qkv/core/rng.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/quantize.hpp"

namespace qkv::testing {

template <class T>
Tensor<T> random_tensor(const Shape& shape, Rng& rng, double stddev = 1.0) {
  Tensor<T> t(shape);
  rng.fill_normal(t.view(), 0.0, stddev);
  return t;
}

template <class To, class From>
Tensor<To> cast(const Tensor<From>& t) {
  Tensor<To> result(t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) result[i] = static_cast<To>(t[i]);
  return result;
}

struct ErrorStats {
  double max_abs = 0.0;
  double mean_abs = 0.0;
  int64_t worst = -1;  // flat index of max_abs; -1 when the tensors are empty
  bool non_finite = false;
};

// |actual − expected| element-wise. Equal infinities count as no error; a NaN, or an infinity
// where the other side differs, is reported as non-finite.
template <class A, class E>
ErrorStats error_stats(const Tensor<A>& actual, const Tensor<E>& expected) {
  ErrorStats stats;
  double sum = 0.0;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double a = static_cast<double>(actual[i]);
    const double e = static_cast<double>(expected[i]);
    if (a == e) continue;
    const double err = std::abs(a - e);
    if (!std::isfinite(err)) {
      stats.non_finite = true;
      stats.worst = i;
      stats.max_abs = std::numeric_limits<double>::infinity();
      continue;
    }
    sum += err;
    if (err > stats.max_abs) {
      stats.max_abs = err;
      stats.worst = i;
    }
  }
  if (actual.numel() > 0) stats.mean_abs = sum / static_cast<double>(actual.numel());
  return stats;
}

// The tolerance rule of the tests: a result must be within `factor` times the error that the
// same computation, done naively in float32, makes against float64. The floor keeps a case in
// which the naive error happens to be 0 from demanding bit-exactness: a few float32 ulps of the
// largest expected magnitude.
template <class E>
double tolerance_from_naive(const Tensor<float>& naive, const Tensor<E>& exact, double factor = 2.0) {
  double magnitude = 0.0;
  for (int64_t i = 0; i < exact.numel(); ++i) {
    if (std::isfinite(static_cast<double>(exact[i])))
      magnitude = std::max(magnitude, std::abs(static_cast<double>(exact[i])));
  }
  const double floor = 4.0 * std::numeric_limits<float>::epsilon() * std::max(magnitude, 1.0);
  return std::max(factor * error_stats(naive, exact).max_abs, floor);
}

// The same rule against the worst of several naive computations (one per NaiveOrder): any of
// them is as fair a float32 answer as another, and a single one can happen to err little where a
// few elements decide the maximum (small problems, nearly tied large logits).
template <class E>
double tolerance_from_naive(const std::vector<const Tensor<float>*>& naives, const Tensor<E>& exact,
                            double factor = 2.0) {
  double tolerance = 0;
  for (const Tensor<float>* naive : naives)
    tolerance = std::max(tolerance, tolerance_from_naive(*naive, exact, factor));
  return tolerance;
}

inline double max_abs(const Tensor<double>& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t[i]));
  return m;
}

// Half an ulp of the largest finite lse in float: the relative error that rounding lse to float
// puts on every P recomputed from it (the same factor along a row).
inline double lse_rounding(const Tensor<double>& lse) {
  double rho = 0;
  for (int64_t i = 0; i < lse.numel(); ++i) {
    if (!std::isfinite(lse[i])) continue;
    const auto f = static_cast<float>(lse[i]);
    rho = std::max(rho, 0.5 * static_cast<double>(std::nextafter(std::abs(f), std::numeric_limits<float>::infinity()) -
                                                  std::abs(f)));
  }
  return rho;
}

// The sizes of one problem: q [B, H, Tq, Dk], k [B, H, Tk, Dk], v [B, H, Tk, Dv].
struct AttentionCase {
  int64_t b = 1, h = 1, tq = 5, tk = 7, dk = 4, dv = 3;
  bool causal = false;
};

// Everything one call needs, in float64: q, k, v usually contiguous [B, H, T, D] (k and v may
// have fewer heads, a divisor of q's); masks in any shape that broadcasts to [B, H, Tq, Tk].
struct AttentionProblem {
  Tensor<double> q, k, v;
  std::optional<Tensor<uint8_t>> allowed = std::nullopt;
  std::optional<Tensor<double>> bias = std::nullopt;
  bool causal = false;
  std::optional<double> scale = std::nullopt;  // 1/sqrt(Dk) when absent
  CausalAlignment alignment = CausalAlignment::bottom_right;
  std::optional<AttentionWindow> window = std::nullopt;
  std::optional<double> softcap = std::nullopt;
  std::optional<Tensor<double>> alibi = std::nullopt;  // [H] slopes
  std::optional<Tensor<double>> sinks = std::nullopt;  // [H] logits
  std::optional<Tensor<int64_t>> cu_seqlens_q = std::nullopt, cu_seqlens_k = std::nullopt;
  std::optional<AttentionDropout> dropout = std::nullopt;

  Shape scores() const { return {q.shape()[0], q.shape()[1], q.shape()[2], k.shape()[2]}; }
};

// q, k and v drawn from N(0, 1); no mask beyond the case's causal flag.
inline AttentionProblem random_problem(const AttentionCase& c, uint64_t seed) {
  Rng rng(seed);
  AttentionProblem p;
  p.q = random_tensor<double>({c.b, c.h, c.tq, c.dk}, rng);
  p.k = random_tensor<double>({c.b, c.h, c.tk, c.dk}, rng);
  p.v = random_tensor<double>({c.b, c.h, c.tk, c.dv}, rng);
  p.causal = c.causal;
  return p;
}

// A random boolean mask of `shape` that allows about `keep` of the keys.
inline Tensor<uint8_t> random_mask(const Shape& shape, double keep, uint64_t seed) {
  Rng rng(seed);
  Tensor<uint8_t> m(shape);
  for (int64_t i = 0; i < m.numel(); ++i) m[i] = rng.uniform() < keep ? 1 : 0;
  return m;
}

// dO for a [B, H, Tq, Dk] problem: [B, H, Tq, Dv] drawn from N(0, 1).
inline Tensor<double> random_dout(const AttentionProblem& p, uint64_t seed) {
  Rng rng(seed);
  return random_tensor<double>({p.q.shape()[0], p.q.shape()[1], p.q.shape()[2], p.v.shape()[3]}, rng);
}

// The problem's tensors in type T and the AttentionParams viewing them; lives as long as its views.
template <class T>
struct AttentionOperands {
  Tensor<T> q, k, v;
  std::optional<Tensor<T>> bias, alibi, sinks;
  const AttentionProblem* problem;

  explicit AttentionOperands(const AttentionProblem& p)
      : q(cast<T>(p.q)), k(cast<T>(p.k)), v(cast<T>(p.v)), problem(&p) {
    if (p.bias) bias = cast<T>(*p.bias);
    if (p.alibi) alibi = cast<T>(*p.alibi);
    if (p.sinks) sinks = cast<T>(*p.sinks);
  }
  AttentionParams<T> params() const {
    AttentionParams<T> a{.q = q.view(), .k = k.view(), .v = v.view(), .scale = problem->scale, .mask = {}};
    a.mask.causal = problem->causal;
    a.mask.alignment = problem->alignment;
    a.mask.window = problem->window;
    if (problem->allowed) a.mask.allowed = problem->allowed->view();
    if (bias) a.mask.bias = bias->view();
    if (alibi) a.mask.alibi_slopes = alibi->view();
    a.softcap = problem->softcap;
    if (sinks) a.sinks = sinks->view();
    if (problem->cu_seqlens_q) a.mask.cu_seqlens_q = problem->cu_seqlens_q->view();
    if (problem->cu_seqlens_k) a.mask.cu_seqlens_k = problem->cu_seqlens_k->view();
    a.dropout = problem->dropout;
    return a;
  }
};

// A problem's q, k and v stored in the given types, with the tensors that hold them (the views
// point into them, so a Stored moves but is never copied).
struct Stored {
  Tensor<uint16_t> q16, k16, v16;
  std::optional<Int8Array> k8, v8;
  Tensor<float> q32, k32, v32;
  StoredView q, k, v;

  Stored() = default;
  Stored(Stored&&) = default;
  Stored& operator=(Stored&&) = default;
  Stored(const Stored&) = delete;
  Stored& operator=(const Stored&) = delete;
};

// x in `type` (int8 with a scale per `group`), held by bits, int8 or f32.
inline StoredView store(const Tensor<double>& x, StorageType type, QuantizeGroup group, Tensor<uint16_t>& bits,
                        std::optional<Int8Array>& int8, Tensor<float>& f32) {
  f32 = cast<float>(x);
  switch (type) {
    case StorageType::float32:
      return StoredView::float32(f32.cview());
    case StorageType::float16:
      bits = to_float16(f32.cview());
      return StoredView::float16(bits.cview());
    case StorageType::bfloat16:
      bits = to_bfloat16(f32.cview());
      return StoredView::bfloat16(bits.cview());
    case StorageType::int8:
      int8 = quantize_int8(f32.cview(), group);
      return int8->stored();
  }
  return {};
}

// The problem's q, k and v stored in these types (int8 K with a scale per channel, int8 V per
// token), and the problem's own q, k, v replaced by the values the stored ones stand for, so that
// the float32 kernel and the float64 reference run on those.
inline Stored store_problem(AttentionProblem& p, StorageType q_type, StorageType k_type, StorageType v_type) {
  Stored s;
  std::optional<Int8Array> unused;
  s.q = store(p.q, q_type, QuantizeGroup::per_token, s.q16, unused, s.q32);
  s.k = store(p.k, k_type, QuantizeGroup::per_channel, s.k16, s.k8, s.k32);
  s.v = store(p.v, v_type, QuantizeGroup::per_token, s.v16, s.v8, s.v32);
  p.q = cast<double>(to_float32(s.q));
  p.k = cast<double>(to_float32(s.k));
  p.v = cast<double>(to_float32(s.v));
  return s;
}

// The call `like` makes, on the stored operands.
inline StoredAttentionParams stored_params(const Stored& s, const AttentionParams<float>& like) {
  return {.q = s.q,
          .k = s.k,
          .v = s.v,
          .scale = like.scale,
          .mask = like.mask,
          .softcap = like.softcap,
          .sinks = like.sinks};
}

// out [B, H, Tq, Dv], scores and weights [B, H, Tq, Tk] (scores −inf where masked), lse [B, H, Tq]
// and, when a dO was given, the gradients of L = <dO, out> (dbias in the bias's own shape, dsinks
// [H] with sinks).
template <class T>
struct NaiveAttention {
  // products: scale·q·k of the visible pairs before a softcap (0 elsewhere).
  Tensor<T> out, scores, products, weights, lse, dq, dk, dv, dbias, dsinks;
};

// The typical float32 error of a visible pair's score (root mean square, as the naive float32
// computation errs): `scores` of the scores themselves, `products` of scale·q·k before a softcap
// (0 without one). Where a softcap flattens most scores, their errors vanish with sech² while the
// products near 0 keep errors of a dot product's size, which the RMS of the scores hides.
struct ScoreErrors {
  double scores = 0;
  double products = 0;
};

// The orders a naive computation may take, each as straightforward as the other: every sum from
// its first term to its last, every sum from its last term to its first (over d, over keys and
// over queries), or the first with the scale multiplied into q before the products with k.
enum class NaiveOrder { forward, reversed, scale_first };
inline constexpr NaiveOrder kNaiveOrders[] = {NaiveOrder::forward, NaiveOrder::reversed, NaiveOrder::scale_first};

// What naive_attention computes: the results, or one of three measures of their size.
enum class Magnitude { none, terms, sums, exposure };

// The whole computation for a [B, H, T, D] problem written as the formula reads, in type T (float:
// the "naive float32" of the tolerance rule; double: an implementation independent of src/):
// materialised scores, sequential sums in `order`, std::exp. An empty `dout` (numel 0) computes the
// forward only. The three magnitudes compute each result's size in float64 instead (see
// attention_tolerance for what they bound): Magnitude::terms sums the absolute values of the
// gradients' terms (|P dO|, |dS k|, |dS q|, |dS|, with dS as |P (dP − D)|); Magnitude::sums sums
// the absolute values of everything any sum adds, dP and D apart (out Σ P|v|, lse the terms of the
// row's largest score, scale·Σ|q k| + |bias| + ALiBi's, plus |log z|, dS P (Σ|dO v| + Σ|dO| out));
// Magnitude::exposure gives how far each result moves under independent errors of the scores of the
// sizes `errors` gives, as root sums of squares (out_d sqrt(Σ_j (P_j w_j (v_jd − out_d))², a sink a
// term with v = 0; lse the row's largest error; dS P w |dP − D| + P Σ_d |dO_d| out_d, and through a
// softcap dX that times sech² plus the slope's own move, 2|tanh|·sech²/c times |dS| and the
// product's error; w_j as attention_tolerance derives it). Pair j's score errs by
// σ_j = sqrt((sech²_j·errors.products)² + errors.scores²): its product's error through the cap, and
// the scores' own. The variants (grouped heads, window, alignment, softcap, ALiBi, sinks, dropout,
// packed sequences) as include/qkv/ops/attention.hpp defines them.
template <class T>
NaiveAttention<T> naive_attention(const AttentionProblem& p, const Tensor<double>& dout_d,
                                  Magnitude magnitude = Magnitude::none, NaiveOrder order = NaiveOrder::forward,
                                  ScoreErrors errors = {}) {
  const bool absolute = magnitude != Magnitude::none, sums = magnitude == Magnitude::sums;
  const AttentionOperands<T> ops(p);
  const int64_t B = p.q.shape()[0], H = p.q.shape()[1], Tq = p.q.shape()[2], Tk = p.k.shape()[2], Dk = p.q.shape()[3],
                Dv = p.v.shape()[3];
  const int64_t group = H / std::max<int64_t>(1, p.k.shape()[1]);
  const auto softcap = static_cast<T>(p.softcap.value_or(0.0));
  const DropoutDraw draw{.seed = p.dropout ? p.dropout->seed : 0,
                         .threshold = p.dropout ? dropout_threshold(p.dropout->p) : 0};
  const T scale = static_cast<T>(p.scale.value_or(1.0 / std::sqrt(static_cast<double>(Dk))));
  const TensorView<const T> q = ops.q.view(), k = ops.k.view(), v = ops.v.view();
  const Tensor<T> dout_t = cast<T>(dout_d);
  const TensorView<const T> dout = dout_t.view();
  NaiveAttention<T> r{Tensor<T>({B, H, Tq, Dv}),
                      Tensor<T>({B, H, Tq, Tk}),
                      Tensor<T>({B, H, Tq, Tk}),
                      Tensor<T>({B, H, Tq, Tk}),
                      Tensor<T>({B, H, Tq}),
                      Tensor<T>(p.q.shape()),
                      Tensor<T>(p.k.shape()),
                      Tensor<T>(p.v.shape()),
                      p.bias ? Tensor<T>(p.bias->shape()) : Tensor<T>(),
                      p.sinks ? Tensor<T>(p.sinks->shape()) : Tensor<T>()};
  const Shape scores = p.scores();
  std::optional<TensorView<const uint8_t>> allowed;
  if (p.allowed) allowed = broadcast_to(p.allowed->view(), scores, "allowed");
  std::optional<TensorView<const T>> bias;
  std::optional<TensorView<T>> dbias;
  if (p.bias) {
    bias = broadcast_to(ops.bias->view(), scores, "bias");
    dbias = broadcast_to(r.dbias.view(), scores, "dbias");
  }
  const T inf = std::numeric_limits<T>::infinity();
  const bool reversed = order == NaiveOrder::reversed;
  // The n-th index of a sum over `count` terms, in the order's direction.
  const auto nth = [reversed](int64_t n, int64_t count) { return reversed ? count - 1 - n : n; };
  const T q_factor = order == NaiveOrder::scale_first ? scale : T{1};
  const T dot_factor = order == NaiveOrder::scale_first ? T{1} : scale;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t ni = 0; ni < Tq; ++ni) {
        const int64_t i = nth(ni, Tq);
        const int64_t hk = h / group;
        // A packed query sees the keys of its own sequence n, with indices counted from its start.
        int64_t n = 0, q0 = 0, k0 = 0, k1 = Tk, tq = Tq;
        if (p.cu_seqlens_q) {
          while ((*p.cu_seqlens_q)[n + 1] <= i) ++n;
          q0 = (*p.cu_seqlens_q)[n];
          tq = (*p.cu_seqlens_q)[n + 1] - q0;
          k0 = (*p.cu_seqlens_k)[n];
          k1 = (*p.cu_seqlens_k)[n + 1];
        }
        const int64_t li = i - q0;
        const int64_t diagonal = p.alignment == CausalAlignment::bottom_right ? (k1 - k0) - tq : 0;
        const int64_t dropout_b = p.cu_seqlens_q ? n : b;
        std::vector<T> s(static_cast<size_t>(Tk), -inf);
        std::vector<T> cap_slope(static_cast<size_t>(Tk), T{1});    // d s / d(scale·q·k)
        std::vector<T> cap_tanh(static_cast<size_t>(Tk), T{0});     // tanh(scale·q·k / c)
        std::vector<T> keep(static_cast<size_t>(Tk), T{1});         // the dropout factors
        std::vector<T> score_terms(static_cast<size_t>(Tk), T{0});  // what each score's sums add
        for (int64_t nj = 0; nj < Tk; ++nj) {
          const int64_t j = nth(nj, Tk);
          const int64_t lj = j - k0;
          if (j < k0 || j >= k1) continue;
          if (p.causal && lj > li + diagonal) continue;
          if (p.window && p.window->left >= 0 && lj < li + diagonal - p.window->left) continue;
          if (p.window && p.window->right >= 0 && lj > li + diagonal + p.window->right) continue;
          if (allowed && (*allowed)(b, h, i, j) == 0) continue;
          if (p.dropout && p.dropout->p > 0) {
            keep[static_cast<size_t>(j)] =
                draw.keeps(dropout_b, h, li, lj) ? static_cast<T>(1 / (1 - p.dropout->p)) : T{0};
          }
          T dot = 0;
          for (int64_t nd = 0; nd < Dk; ++nd) {
            const int64_t d = nth(nd, Dk);
            dot += (q_factor * q(b, h, i, d)) * k(b, hk, j, d);
          }
          T x = dot_factor * dot;
          r.products.view()(b, h, i, j) = x;
          if (softcap > 0) {
            const T t = std::tanh(x / softcap);
            x = softcap * t;
            cap_slope[static_cast<size_t>(j)] = 1 - t * t;
            cap_tanh[static_cast<size_t>(j)] = t;
          }
          T score = x + (bias ? (*bias)(b, h, i, j) : T{0});
          if (p.alibi) score -= static_cast<T>((*p.alibi)[h]) * static_cast<T>(std::abs(li + diagonal - lj));
          s[static_cast<size_t>(j)] = score;
          if (sums) {
            // A score that nearly cancels (q·k ≪ Σ|q k|) errs by the rounding of its terms, not of
            // its value: |m| alone put the tolerance of a one-key lse below float32's own error.
            T terms = 0;
            for (int64_t d = 0; d < Dk; ++d) terms += std::abs(q_factor * q(b, h, i, d) * k(b, hk, j, d));
            terms = std::abs(dot_factor) * terms + (bias ? std::abs((*bias)(b, h, i, j)) : T{0});
            if (p.alibi) terms += std::abs(static_cast<T>((*p.alibi)[h]) * static_cast<T>(li + diagonal - lj));
            score_terms[static_cast<size_t>(j)] = terms;
          }
        }
        for (int64_t j = 0; j < Tk; ++j) r.scores.view()(b, h, i, j) = s[static_cast<size_t>(j)];
        const T sink = p.sinks ? static_cast<T>((*p.sinks)[h]) : -inf;
        T m = sink;
        for (T x : s) m = std::max(m, x);
        if (m == -inf) {
          r.lse.view()(b, h, i) = absolute ? T{0} : -inf;
          continue;
        }
        T z = p.sinks ? std::exp(sink - m) : T{0};
        for (int64_t nj = 0; nj < Tk; ++nj) z += std::exp(s[static_cast<size_t>(nth(nj, Tk))] - m);
        if (sums) {
          const auto star = static_cast<size_t>(std::max_element(s.begin(), s.end()) - s.begin());
          const T largest = p.sinks && (s.empty() || sink >= s[star]) ? std::abs(sink) : score_terms[star];
          r.lse.view()(b, h, i) = largest + std::abs(std::log(z));
        } else {
          r.lse.view()(b, h, i) = m + std::log(z);
        }
        std::vector<T> prob(s.size());
        for (size_t j = 0; j < s.size(); ++j) prob[j] = std::exp(s[j] - m) / z;
        for (int64_t nj = 0; nj < Tk; ++nj) {
          const int64_t j = nth(nj, Tk);
          r.weights.view()(b, h, i, j) = prob[static_cast<size_t>(j)];
          for (int64_t d = 0; d < Dv; ++d) {
            const T value = sums ? std::abs(v(b, hk, j, d)) : v(b, hk, j, d);
            r.out.view()(b, h, i, d) += prob[static_cast<size_t>(j)] * keep[static_cast<size_t>(j)] * value;
          }
        }
        if (magnitude == Magnitude::exposure) {
          // Squares of independent contributions, summed here; square roots taken at the end. The
          // row's largest logit: the sink, when it is the largest, has no rounding of its own.
          const auto star = static_cast<size_t>(std::max_element(s.begin(), s.end()) - s.begin());
          const bool sink_is_star = p.sinks && (s.empty() || sink >= s[star]);
          const T p_star = sink_is_star ? std::exp(sink - m) / z : prob[star];
          std::vector<T> error(s.size(), T{0});  // σ_j
          T row_error = 0;                       // the row's largest σ_j
          for (size_t j = 0; j < s.size(); ++j) {
            if (s[j] == -inf) continue;
            const T through_cap = cap_slope[j] * static_cast<T>(errors.products);
            error[j] = std::sqrt(through_cap * through_cap + static_cast<T>(errors.scores * errors.scores));
            row_error = std::max(row_error, error[j]);
          }
          const auto exposure = [&](size_t j) {
            return T(j == star && !sink_is_star ? 0 : 1) * error[j] + (1 - p_star) * row_error;
          };
          // The sink is one more weight, of value 0, exposed to the errors of the scores beside it.
          const T sink_weight =
              p.sinks ? std::exp(sink - m) / z * (T(sink_is_star ? 0 : 1) + (1 - p_star)) * row_error : T{0};
          std::vector<T> out_i(static_cast<size_t>(Dv));
          for (int64_t d = 0; d < Dv; ++d) {
            out_i[static_cast<size_t>(d)] = r.out.view()(b, h, i, d);
            const T sink_term = sink_weight * out_i[static_cast<size_t>(d)];
            T square_sum = sink_term * sink_term;
            for (size_t j = 0; j < s.size(); ++j) {
              const auto jj = static_cast<int64_t>(j);
              const T x = prob[j] * exposure(j) * (keep[j] * v(b, hk, jj, d) - out_i[static_cast<size_t>(d)]);
              square_sum += x * x;
            }
            r.out.view()(b, h, i, d) = std::sqrt(square_sum);
          }
          r.lse.view()(b, h, i) = row_error;
          if (dout_d.numel() == 0) continue;
          // δD_i = dO_i·δout_i, bounded per unit of score error; it enters every dS_ij of the row.
          T row_dot = 0, row_dot_exposure = 0;
          for (int64_t d = 0; d < Dv; ++d) {
            row_dot += dout(b, h, i, d) * out_i[static_cast<size_t>(d)];
            row_dot_exposure += std::abs(dout(b, h, i, d)) * r.out.view()(b, h, i, d);
          }
          if (p.sinks) {
            const T x = sink_weight * std::abs(row_dot) + std::exp(sink - m) / z * row_dot_exposure;
            r.dsinks[h] += x * x;
          }
          for (size_t j = 0; j < s.size(); ++j) {
            const auto jj = static_cast<int64_t>(j);
            T dp = 0;
            for (int64_t d = 0; d < Dv; ++d) {
              dp += dout(b, h, i, d) * v(b, hk, jj, d);
              const T x = prob[j] * exposure(j) * keep[j] * dout(b, h, i, d);
              r.dv.view()(b, hk, jj, d) += x * x;
            }
            const T ds = prob[j] * exposure(j) * std::abs(keep[j] * dp - row_dot) + prob[j] * row_dot_exposure;
            // Through a softcap, dX = dS·sech²(x / c) moves with the product's own error too: an
            // error δx moves sech² by 2|tanh|·sech²/c·δx.
            const T cap_term = softcap > 0
                                   ? 2 * std::abs(cap_tanh[j]) * cap_slope[j] / softcap *
                                         static_cast<T>(errors.products) * std::abs(prob[j] * (keep[j] * dp - row_dot))
                                   : T{0};
            const T dx = std::abs(scale) * (ds * cap_slope[j] + cap_term);
            for (int64_t d = 0; d < Dk; ++d) {
              r.dq.view()(b, h, i, d) += (dx * k(b, hk, jj, d)) * (dx * k(b, hk, jj, d));
              r.dk.view()(b, hk, jj, d) += (dx * q(b, h, i, d)) * (dx * q(b, h, i, d));
            }
            if (dbias) (*dbias)(b, h, i, jj) += ds * ds;
          }
          continue;
        }
        if (dout_d.numel() == 0) continue;
        auto term = [&](T x) { return absolute ? std::abs(x) : x; };
        auto summand = [&](T x) { return sums ? std::abs(x) : x; };
        T row_dot = 0;  // D_i
        for (int64_t nd = 0; nd < Dv; ++nd) {
          const int64_t d = nth(nd, Dv);
          row_dot += summand(dout(b, h, i, d)) * r.out.view()(b, h, i, d);
        }
        if (p.sinks) r.dsinks[h] -= term(std::exp(sink - m) / z * row_dot);
        for (int64_t nj = 0; nj < Tk; ++nj) {
          const int64_t j = nth(nj, Tk);
          const T pij = prob[static_cast<size_t>(j)];
          const T mij = keep[static_cast<size_t>(j)];
          T dp = 0;
          for (int64_t nd = 0; nd < Dv; ++nd) {
            const int64_t d = nth(nd, Dv);
            dp += summand(dout(b, h, i, d) * v(b, hk, j, d));
            r.dv.view()(b, hk, j, d) += pij * mij * term(dout(b, h, i, d));
          }
          dp *= mij;
          const T ds = sums ? pij * (dp + row_dot) : term(pij * (dp - row_dot));
          const T dx = ds * cap_slope[static_cast<size_t>(j)];
          for (int64_t d = 0; d < Dk; ++d) {
            r.dq.view()(b, h, i, d) += term(scale) * dx * term(k(b, hk, j, d));
            r.dk.view()(b, hk, j, d) += term(scale) * dx * term(q(b, h, i, d));
          }
          if (dbias) (*dbias)(b, h, i, j) += ds;
        }
      }
  if (absolute && p.sinks) {
    for (int64_t h = 0; h < r.dsinks.numel(); ++h) r.dsinks[h] = std::abs(r.dsinks[h]);
  }
  if (magnitude == Magnitude::exposure) {
    for (Tensor<T>* squares : {&r.dq, &r.dk, &r.dv, &r.dbias, &r.dsinks}) {
      for (int64_t e = 0; e < squares->numel(); ++e) (*squares)[e] = std::sqrt((*squares)[e]);
    }
  }
  return r;
}

// The forward of naive_attention alone.
template <class T>
NaiveAttention<T> naive_attention_forward(const AttentionProblem& p) {
  return naive_attention<T>(p, Tensor<double>(Shape{0}));
}

// One result of NaiveAttention, by name.
enum class NaiveResult { out, lse, dq, dk, dv, dbias, dsinks };

template <class T>
const Tensor<T>& naive_result(const NaiveAttention<T>& n, NaiveResult which) {
  switch (which) {
    case NaiveResult::out:
      return n.out;
    case NaiveResult::lse:
      return n.lse;
    case NaiveResult::dq:
      return n.dq;
    case NaiveResult::dk:
      return n.dk;
    case NaiveResult::dv:
      return n.dv;
    case NaiveResult::dbias:
      return n.dbias;
    case NaiveResult::dsinks:
      break;
  }
  return n.dsinks;
}

// What the tolerance rule measures a float32 result against: the naive float32 computation in
// every NaiveOrder, the magnitudes of the float64 one, and the typical errors of the naive float32
// scores (over the visible pairs), which the exposure is measured in.
struct AttentionYardsticks {
  std::vector<NaiveAttention<float>> naive;
  NaiveAttention<double> terms, sums, exposure;
  ScoreErrors score_errors;
};

// The root mean square of naive − exact over the pairs where exact `visible` is finite.
inline double rms_error(const Tensor<float>& naive, const Tensor<double>& exact, const Tensor<double>& visible) {
  double square_sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < exact.numel(); ++i) {
    if (!std::isfinite(visible[i])) continue;
    const double error = static_cast<double>(naive[i]) - exact[i];
    square_sum += error * error;
    ++count;
  }
  return count > 0 ? std::sqrt(square_sum / static_cast<double>(count)) : 0.0;
}

inline AttentionYardsticks attention_yardsticks(const AttentionProblem& p, const Tensor<double>& dout) {
  AttentionYardsticks y;
  for (const NaiveOrder order : kNaiveOrders) {
    y.naive.push_back(naive_attention<float>(p, dout, Magnitude::none, order));
  }
  y.terms = naive_attention<double>(p, dout, Magnitude::terms);
  y.sums = naive_attention<double>(p, dout, Magnitude::sums);
  const NaiveAttention<float>& first = y.naive.front();
  y.score_errors.scores = rms_error(first.scores, y.terms.scores, y.terms.scores);
  if (p.softcap) y.score_errors.products = rms_error(first.products, y.terms.products, y.terms.scores);
  y.exposure = naive_attention<double>(p, dout, Magnitude::exposure, NaiveOrder::forward, y.score_errors);
  return y;
}

// The tolerance rule of the attention tests and `qkv soak`, for one result: twice the largest error
// of the naive float32 computations (tolerance_from_naive), plus what float32 costs any
// implementation, which the naive ones can happen to escape where a few elements decide the
// maximum (small problems, nearly cancelling or nearly tied values):
//   - a float32 epsilon of the result's sums magnitude: rounding each sum about once, in whatever
//     order. The case it is there for: D_i and dP_ij of a row's largest weight nearly cancel in
//     dS, so their roundings, not their difference, set its error, and one naive order may round
//     them alike by chance. An epsilon of Σ|terms| stays below a sum's worst case (n/2 of them).
//   - independent errors of the typical float32 size σ_j in every score (ScoreErrors: the scores'
//     own, and through a softcap the products' times sech²): softmax ignores a shift of a row, so
//     errors e_j move P only through ε_j = e_j − e_* (e_* that of the row's largest logit): δP_j =
//     P_j (ε_j − ε̄), ε̄ = Σ_k P_k ε_k, and |ε_j − ε̄| is at most [j ≠ *]·σ_j + (1 − P_*)·max σ.
//     Summed as independent errors, that puts a standard deviation of at most 2·exposure on each
//     result; the rule allows kScoreSigmas of them, enough for the largest of a million outputs. A
//     row's largest weight is not exposed, so a kernel whose backward recomputes that weight with
//     an error of its own still fails. The products' error counts apart because a softcap hides it:
//     with a large scale most scores sit on tanh's flat tail and err by nothing, so the scores' RMS
//     error is far below that of a product near 0, whose slope sech² a dot product's rounding moves.
//   - for a gradient from a saved float32 lse, its relative error ρ on every P times the terms
//     magnitude, which bounds that error's effect.
inline constexpr double kScoreSigmas = 5.0;

template <class E>
double attention_tolerance(const AttentionYardsticks& y, NaiveResult which, const Tensor<E>& exact,
                           double saved_lse_rho = 0.0) {
  std::vector<const Tensor<float>*> naives;
  for (const NaiveAttention<float>& n : y.naive) naives.push_back(&naive_result(n, which));
  return tolerance_from_naive(naives, exact) + kScoreSigmas * 2 * max_abs(naive_result(y.exposure, which)) +
         std::numeric_limits<float>::epsilon() * max_abs(naive_result(y.sums, which)) +
         saved_lse_rho * max_abs(naive_result(y.terms, which));
}

// Out without lse on bfloat16 Q, K and V where the CPU's bf16 dot product runs it: its weights are
// rounded to bfloat16 (a relative error of at most 2⁻⁸ each: 8 significant bits) before they
// multiply V, which moves out by at most 2⁻⁸·Σ_j P_ij·|v_j|, the terms magnitude of out; the rest is
// the float32 rule.
inline double bf16_products_tolerance(const AttentionYardsticks& y, const Tensor<double>& exact) {
  return attention_tolerance(y, NaiveResult::out, exact) +
         std::ldexp(1.0, -8) * max_abs(naive_result(y.terms, NaiveResult::out));
}

}  // namespace qkv::testing
