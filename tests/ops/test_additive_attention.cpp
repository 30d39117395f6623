// Tests of additive (Bahdanau) attention (src/ops/additive_attention.cpp): against a naive implementation
// written here from the formula (float64, and float32 for the tolerance rule), against central finite
// differences, its defining properties, every mask kind, edge cases and refusals.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/ops/additive_attention.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::cast;
using testing::numeric_gradient;
using testing::random_tensor;
using testing::tolerance_from_naive;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps64 = std::numeric_limits<double>::epsilon();

struct Sizes {
  int64_t b = 1, h = 1, tq = 1, tk = 1, dq = 1, dk = 1, dv = 1, a = 1;
};

// The length of the longest chain of float64 additions behind any result (a projection, a score,
// a softmax sum, an output, a weight gradient summed over every pair of every head): recursive
// summation of n terms errs by at most n·ε relative to the sum of their magnitudes.
double accumulation_length(const Sizes& s) {
  return static_cast<double>((s.dq + s.dk + 1) * s.a + s.tk * (s.dv + 2) + s.b * s.h * s.tq * s.tk + 1);
}

double max_abs(const Tensor<double>& t) {
  double m = 0.0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (std::isfinite(t[i])) m = std::max(m, std::abs(t[i]));
  }
  return m;
}

// Two float64 computations of the same quantity agree within their accumulated rounding.
double float64_tolerance(const Sizes& s, const Tensor<double>& expected) {
  return accumulation_length(s) * kEps64 * std::max(max_abs(expected), 1.0);
}

// q's shape with its last two dims replaced by `tail`.
Shape with_leading_dims_of(const Shape& q_shape, std::initializer_list<int64_t> tail) {
  std::vector<int64_t> dims(q_shape.dims().begin(), q_shape.dims().end() - 2);
  dims.insert(dims.end(), tail.begin(), tail.end());
  return Shape(std::span<const int64_t>(dims));
}

// Everything one call needs, contiguous; q, k, v are [B, H, T, D] unless a test says otherwise and
// masks are rank 4 with size-1 dims where they broadcast.
template <class T>
struct Inputs {
  Sizes sizes;
  Tensor<T> q, k, v, w_q, w_k, w;
  bool causal = false;
  std::optional<Tensor<uint8_t>> allowed;
  std::optional<Tensor<T>> bias;

  AdditiveAttentionParams<T> params() const {
    AdditiveAttentionParams<T> p{
        .q = q.view(), .k = k.view(), .v = v.view(), .w_q = w_q.view(), .w_k = w_k.view(), .w = w.view(), .mask = {}};
    p.mask.causal = causal;
    if (allowed) p.mask.allowed = allowed->view();
    if (bias) p.mask.bias = bias->view();
    return p;
  }
};

// Random inputs whose values are exactly representable in float32, so that the float32 and float64
// runs see the same numbers and differ only by how they compute. W_q and W_k are scaled so that the
// hidden pre-activations have unit variance and tanh is not saturated.
Inputs<double> random_inputs(const Sizes& s, uint64_t seed) {
  Rng rng(seed);
  Inputs<double> in;
  in.sizes = s;
  auto draw = [&](const Shape& shape, double stddev) {
    return cast<double>(cast<float>(random_tensor<double>(shape, rng, stddev)));
  };
  in.q = draw({s.b, s.h, s.tq, s.dq}, 1.0);
  in.k = draw({s.b, s.h, s.tk, s.dk}, 1.0);
  in.v = draw({s.b, s.h, s.tk, s.dv}, 1.0);
  in.w_q = draw({s.a, s.dq}, 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(s.dq + s.dk, 1))));
  in.w_k = draw({s.a, s.dk}, 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(s.dq + s.dk, 1))));
  in.w = draw({s.a}, 1.0);
  return in;
}

// An allowed mask of `shape` in which each key is visible with probability `visible`.
Tensor<uint8_t> random_allowed(const Shape& shape, uint64_t seed, double visible) {
  Rng rng(seed);
  Tensor<uint8_t> mask(shape);
  for (int64_t i = 0; i < mask.numel(); ++i) mask[i] = rng.uniform() < visible ? 1 : 0;
  return mask;
}

// A bias of `shape` with float32-exact normal entries, a fraction `masked` of them −inf.
Tensor<double> random_bias(const Shape& shape, uint64_t seed, double masked) {
  Rng rng(seed);
  Tensor<double> bias = cast<double>(cast<float>(random_tensor<double>(shape, rng)));
  for (int64_t i = 0; i < bias.numel(); ++i) {
    if (rng.uniform() < masked) bias[i] = -kInf;
  }
  return bias;
}

template <class To>
Inputs<To> cast_inputs(const Inputs<double>& in) {
  Inputs<To> out{.sizes = in.sizes,
                 .q = cast<To>(in.q),
                 .k = cast<To>(in.k),
                 .v = cast<To>(in.v),
                 .w_q = cast<To>(in.w_q),
                 .w_k = cast<To>(in.w_k),
                 .w = cast<To>(in.w),
                 .causal = in.causal,
                 .allowed = in.allowed,
                 .bias = std::nullopt};
  if (in.bias) out.bias = cast<To>(*in.bias);
  return out;
}

template <class T>
struct Forward {
  Tensor<T> out, weights, lse;
};

template <class T>
struct Grads {
  Tensor<T> dq, dk, dv, dw_q, dw_k, dw;
  std::optional<Tensor<T>> dbias;
};

// Runs the op; the outputs start as NaN so that an element the op forgets to write shows.
template <class T>
Forward<T> run_forward(const Inputs<T>& in) {
  const Shape& qs = in.q.shape();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  Forward<T> f{.out = Tensor<T>(with_leading_dims_of(qs, {qs.from_back(2), in.v.shape().from_back(1)}), nan),
               .weights = Tensor<T>(with_leading_dims_of(qs, {qs.from_back(2), in.k.shape().from_back(2)}), nan),
               .lse = Tensor<T>(with_leading_dims_of(qs, {qs.from_back(2)}), nan)};
  additive_attention_forward(
      in.params(), AttentionOutputs<T>{.out = f.out.view(), .weights = f.weights.view(), .lse = f.lse.view()});
  return f;
}

template <class T>
Grads<T> zero_grads(const Inputs<T>& in) {
  Grads<T> g{.dq = Tensor<T>(in.q.shape()),
             .dk = Tensor<T>(in.k.shape()),
             .dv = Tensor<T>(in.v.shape()),
             .dw_q = Tensor<T>(in.w_q.shape()),
             .dw_k = Tensor<T>(in.w_k.shape()),
             .dw = Tensor<T>(in.w.shape()),
             .dbias = std::nullopt};
  if (in.bias) g.dbias = Tensor<T>(in.bias->shape());
  return g;
}

template <class T>
AdditiveAttentionGradients<T> views_of(Grads<T>& g) {
  AdditiveAttentionGradients<T> views{.dq = g.dq.view(),
                                      .dk = g.dk.view(),
                                      .dv = g.dv.view(),
                                      .dw_q = g.dw_q.view(),
                                      .dw_k = g.dw_k.view(),
                                      .dw = g.dw.view(),
                                      .dbias = std::nullopt};
  if (g.dbias) views.dbias = g.dbias->view();
  return views;
}

template <class T>
Grads<T> run_backward(const Inputs<T>& in, const Tensor<T>& dout) {
  Grads<T> g = zero_grads(in);
  additive_attention_backward(in.params(), dout.cview(), views_of(g));
  return g;
}

Tensor<double> random_dout(const Inputs<double>& in, uint64_t seed) {
  Rng rng(seed);
  const Shape& qs = in.q.shape();
  return cast<double>(
      cast<float>(random_tensor<double>(with_leading_dims_of(qs, {qs.from_back(2), in.v.shape().from_back(1)}), rng)));
}

// ---- The naive implementation: the formula read literally, in T, for rank-4 contiguous inputs. ----

int64_t flat4(const Shape& s, int64_t b, int64_t h, int64_t i, int64_t j) {
  auto at = [&](int axis, int64_t x) { return s[axis] == 1 ? 0 : x; };  // size-1 dims broadcast
  return ((at(0, b) * s[1] + at(1, h)) * s[2] + at(2, i)) * s[3] + at(3, j);
}

// z_ija = (W_q q_i)_a + (W_k k_j)_a, recomputed for every pair.
template <class T>
T hidden_preactivation(const Inputs<T>& in, int64_t b, int64_t h, int64_t i, int64_t j, int64_t a) {
  const Sizes& s = in.sizes;
  T z = 0;
  for (int64_t d = 0; d < s.dq; ++d) z += in.w_q[a * s.dq + d] * in.q[flat4(in.q.shape(), b, h, i, d)];
  for (int64_t d = 0; d < s.dk; ++d) z += in.w_k[a * s.dk + d] * in.k[flat4(in.k.shape(), b, h, j, d)];
  return z;
}

template <class T>
bool naive_visible(const Inputs<T>& in, int64_t b, int64_t h, int64_t i, int64_t j) {
  const Sizes& s = in.sizes;
  if (in.causal && j > i + s.tk - s.tq) return false;
  if (in.allowed && (*in.allowed)[flat4(in.allowed->shape(), b, h, i, j)] == 0) return false;
  return !(in.bias && (*in.bias)[flat4(in.bias->shape(), b, h, i, j)] == -std::numeric_limits<T>::infinity());
}

// Row i of α for head (b, h), and its lse; all zeros and −inf when no key is visible.
template <class T>
std::vector<T> naive_alpha_row(const Inputs<T>& in, int64_t b, int64_t h, int64_t i, T& lse) {
  const Sizes& s = in.sizes;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  std::vector<T> e(static_cast<size_t>(s.tk), neg_inf);
  T max = neg_inf;
  for (int64_t j = 0; j < s.tk; ++j) {
    if (!naive_visible(in, b, h, i, j)) continue;
    T score = 0;
    for (int64_t a = 0; a < s.a; ++a) score += in.w[a] * std::tanh(hidden_preactivation(in, b, h, i, j, a));
    if (in.bias) score += (*in.bias)[flat4(in.bias->shape(), b, h, i, j)];
    e[j] = score;
    max = std::max(max, score);
  }
  lse = neg_inf;
  if (max == neg_inf) return std::vector<T>(e.size(), T{0});
  T sum = 0;
  for (int64_t j = 0; j < s.tk; ++j) sum += std::exp(e[j] - max);
  lse = max + std::log(sum);
  for (T& x : e) x = std::exp(x - lse);
  return e;
}

template <class T>
Forward<T> naive_forward(const Inputs<T>& in) {
  const Sizes& s = in.sizes;
  Forward<T> f{.out = Tensor<T>({s.b, s.h, s.tq, s.dv}),
               .weights = Tensor<T>({s.b, s.h, s.tq, s.tk}),
               .lse = Tensor<T>({s.b, s.h, s.tq})};
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.h; ++h) {
      for (int64_t i = 0; i < s.tq; ++i) {
        T lse;
        const std::vector<T> alpha = naive_alpha_row(in, b, h, i, lse);
        f.lse[(b * s.h + h) * s.tq + i] = lse;
        for (int64_t j = 0; j < s.tk; ++j) f.weights[flat4(f.weights.shape(), b, h, i, j)] = alpha[j];
        for (int64_t d = 0; d < s.dv; ++d) {
          T sum = 0;
          for (int64_t j = 0; j < s.tk; ++j) sum += alpha[j] * in.v[flat4(in.v.shape(), b, h, j, d)];
          f.out[flat4(f.out.shape(), b, h, i, d)] = sum;
        }
      }
    }
  }
  return f;
}

// The chain rule pair by pair: de_ij = α_ij (dα_ij − Σ_l α_il dα_il), then through w and tanh into
// both projections (dz = de · w ∘ (1 − tanh²)), each weight touched directly.
template <class T>
Grads<T> naive_backward(const Inputs<T>& in, const Tensor<T>& dout) {
  const Sizes& s = in.sizes;
  Grads<T> g = zero_grads(in);
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.h; ++h) {
      for (int64_t i = 0; i < s.tq; ++i) {
        T lse;
        const std::vector<T> alpha = naive_alpha_row(in, b, h, i, lse);
        std::vector<T> dalpha(alpha.size(), T{0});
        T mean = 0;
        for (int64_t j = 0; j < s.tk; ++j) {
          for (int64_t d = 0; d < s.dv; ++d) {
            const T g_id = dout[flat4(dout.shape(), b, h, i, d)];
            dalpha[j] += g_id * in.v[flat4(in.v.shape(), b, h, j, d)];
            g.dv[flat4(g.dv.shape(), b, h, j, d)] += alpha[j] * g_id;
          }
          mean += alpha[j] * dalpha[j];
        }
        for (int64_t j = 0; j < s.tk; ++j) {
          if (alpha[j] == 0) continue;
          const T de = alpha[j] * (dalpha[j] - mean);
          if (g.dbias) (*g.dbias)[flat4(g.dbias->shape(), b, h, i, j)] += de;
          for (int64_t a = 0; a < s.a; ++a) {
            const T t = std::tanh(hidden_preactivation(in, b, h, i, j, a));
            g.dw[a] += de * t;
            const T dz = de * in.w[a] * (1 - t * t);
            for (int64_t d = 0; d < s.dq; ++d) {
              g.dq[flat4(g.dq.shape(), b, h, i, d)] += dz * in.w_q[a * s.dq + d];
              g.dw_q[a * s.dq + d] += dz * in.q[flat4(in.q.shape(), b, h, i, d)];
            }
            for (int64_t d = 0; d < s.dk; ++d) {
              g.dk[flat4(g.dk.shape(), b, h, j, d)] += dz * in.w_k[a * s.dk + d];
              g.dw_k[a * s.dk + d] += dz * in.k[flat4(in.k.shape(), b, h, j, d)];
            }
          }
        }
      }
    }
  }
  return g;
}

// ---- Cases swept by the reference and precision tests. ----

struct Case {
  std::string name;
  Sizes sizes;
  bool causal = false;
  std::optional<Shape> allowed = std::nullopt;  // shape of a random allowed mask
  std::optional<Shape> bias = std::nullopt;     // shape of a random bias with some −inf
};

std::vector<Case> cases() {
  return {
      {.name = "plain", .sizes = {.b = 2, .h = 3, .tq = 5, .tk = 6, .dq = 4, .dk = 3, .dv = 2, .a = 7}},
      {.name = "causal Tq < Tk",
       .sizes = {.b = 1, .h = 2, .tq = 4, .tk = 9, .dq = 3, .dk = 5, .dv = 4, .a = 6},
       .causal = true},
      {.name = "causal Tq > Tk",
       .sizes = {.b = 2, .h = 1, .tq = 7, .tk = 4, .dq = 5, .dk = 2, .dv = 3, .a = 4},
       .causal = true},
      {.name = "all masks",
       .sizes = {.b = 2, .h = 2, .tq = 5, .tk = 8, .dq = 3, .dk = 4, .dv = 3, .a = 5},
       .causal = true,
       .allowed = Shape{2, 1, 5, 8},
       .bias = Shape{1, 2, 1, 8}},
      {.name = "allowed and full bias",
       .sizes = {.b = 1, .h = 3, .tq = 6, .tk = 6, .dq = 2, .dk = 2, .dv = 5, .a = 3},
       .allowed = Shape{1, 1, 6, 6},
       .bias = Shape{1, 3, 6, 6}},
      {.name = "T=1 D=1 A=1", .sizes = {.b = 1, .h = 1, .tq = 1, .tk = 1, .dq = 1, .dk = 1, .dv = 1, .a = 1}},
      {.name = "Dq=1 A=1",
       .sizes = {.b = 2, .h = 1, .tq = 3, .tk = 5, .dq = 1, .dk = 4, .dv = 2, .a = 1},
       .causal = true},
      {.name = "Tq=113",
       .sizes = {.b = 1, .h = 1, .tq = 113, .tk = 7, .dq = 7, .dk = 113, .dv = 5, .a = 3},
       .causal = true},
      {.name = "Tk=113",
       .sizes = {.b = 1, .h = 1, .tq = 7, .tk = 113, .dq = 113, .dk = 7, .dv = 113, .a = 7},
       .allowed = Shape{1, 1, 7, 113}},
  };
}

Inputs<double> inputs_for(const Case& c, uint64_t seed) {
  Inputs<double> in = random_inputs(c.sizes, seed);
  in.causal = c.causal;
  if (c.allowed) in.allowed = random_allowed(*c.allowed, seed + 1, 0.7);
  if (c.bias) in.bias = random_bias(*c.bias, seed + 2, 0.1);
  return in;
}

TEST(AdditiveAttention, MatchesNaiveFloat64) {
  uint64_t seed = 100;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs<double> in = inputs_for(c, ++seed);
    const Forward<double> got = run_forward(in);
    const Forward<double> want = naive_forward(in);
    EXPECT_TRUE(all_close("out", got.out, want.out, float64_tolerance(c.sizes, want.out)));
    EXPECT_TRUE(all_close("weights", got.weights, want.weights, float64_tolerance(c.sizes, want.weights)));
    EXPECT_TRUE(all_close("lse", got.lse, want.lse, float64_tolerance(c.sizes, want.lse)));

    const Tensor<double> dout = random_dout(in, seed);
    const Grads<double> g = run_backward(in, dout);
    const Grads<double> w = naive_backward(in, dout);
    EXPECT_TRUE(all_close("dq", g.dq, w.dq, float64_tolerance(c.sizes, w.dq)));
    EXPECT_TRUE(all_close("dk", g.dk, w.dk, float64_tolerance(c.sizes, w.dk)));
    EXPECT_TRUE(all_close("dv", g.dv, w.dv, float64_tolerance(c.sizes, w.dv)));
    EXPECT_TRUE(all_close("dw_q", g.dw_q, w.dw_q, float64_tolerance(c.sizes, w.dw_q)));
    EXPECT_TRUE(all_close("dw_k", g.dw_k, w.dw_k, float64_tolerance(c.sizes, w.dw_k)));
    EXPECT_TRUE(all_close("dw", g.dw, w.dw, float64_tolerance(c.sizes, w.dw)));
    if (c.bias) {
      EXPECT_TRUE(all_close("dbias", *g.dbias, *w.dbias, float64_tolerance(c.sizes, *w.dbias)));
    }
  }
}

// The float32 op accumulates in float64, so it must stay within the error of the same computation
// done naively in float32 (the tolerance rule of tests/support/testing.hpp).
TEST(AdditiveAttention, Float32WithinNaiveFloat32Error) {
  uint64_t seed = 200;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs<double> in = inputs_for(c, ++seed);
    const Inputs<float> in32 = cast_inputs<float>(in);
    const Forward<double> exact = run_forward(in);
    const Forward<float> got = run_forward(in32);
    const Forward<float> naive = naive_forward(in32);
    EXPECT_TRUE(all_close("out", got.out, exact.out, tolerance_from_naive(naive.out, exact.out)));
    EXPECT_TRUE(all_close("weights", got.weights, exact.weights, tolerance_from_naive(naive.weights, exact.weights)));
    EXPECT_TRUE(all_close("lse", got.lse, exact.lse, tolerance_from_naive(naive.lse, exact.lse)));

    const Tensor<double> dout = random_dout(in, seed);
    const Tensor<float> dout32 = cast<float>(dout);
    const Grads<double> g64 = run_backward(in, dout);
    const Grads<float> g32 = run_backward(in32, dout32);
    const Grads<float> n32 = naive_backward(in32, dout32);
    EXPECT_TRUE(all_close("dq", g32.dq, g64.dq, tolerance_from_naive(n32.dq, g64.dq)));
    EXPECT_TRUE(all_close("dk", g32.dk, g64.dk, tolerance_from_naive(n32.dk, g64.dk)));
    EXPECT_TRUE(all_close("dv", g32.dv, g64.dv, tolerance_from_naive(n32.dv, g64.dv)));
    EXPECT_TRUE(all_close("dw_q", g32.dw_q, g64.dw_q, tolerance_from_naive(n32.dw_q, g64.dw_q)));
    EXPECT_TRUE(all_close("dw_k", g32.dw_k, g64.dw_k, tolerance_from_naive(n32.dw_k, g64.dw_k)));
    EXPECT_TRUE(all_close("dw", g32.dw, g64.dw, tolerance_from_naive(n32.dw, g64.dw)));
    if (c.bias) {
      EXPECT_TRUE(all_close("dbias", *g32.dbias, *g64.dbias, tolerance_from_naive(*n32.dbias, *g64.dbias)));
    }
  }
}

// Central differences of L = <dout, out> against every hand-derived gradient. The function is
// smooth (tanh, exp, log; masks only remove terms), so there are no kinks to skip. With step h
// the difference errs by h²/6·|L'''| (truncation, |L'''| of the order of the loss for inputs of
// unit scale) plus 2·δ/h where δ is the rounding of one evaluation of L.
TEST(AdditiveAttention, GradientsMatchFiniteDifferences) {
  const Sizes s{.b = 2, .h = 2, .tq = 3, .tk = 4, .dq = 3, .dk = 2, .dv = 3, .a = 5};
  Inputs<double> in = random_inputs(s, 300);
  in.causal = true;
  in.allowed = random_allowed({2, 1, 1, 4}, 301, 0.75);
  in.bias = random_bias({1, 2, 3, 4}, 302, 0.15);
  const Tensor<double> dout = random_dout(in, 303);
  const Grads<double> g = run_backward(in, dout);

  const auto loss = [&] { return testing::dot(dout, run_forward(in).out); };
  const double step = 1e-6;
  double scale = 1.0;
  for (int64_t i = 0; i < dout.numel(); ++i) scale += std::abs(dout[i]);
  const double rounding = accumulation_length(s) * kEps64 * scale;
  const double tolerance = step * step * scale + 2.0 * rounding / step;

  EXPECT_TRUE(all_close("dq", g.dq, numeric_gradient(loss, in.q, step), tolerance));
  EXPECT_TRUE(all_close("dk", g.dk, numeric_gradient(loss, in.k, step), tolerance));
  EXPECT_TRUE(all_close("dv", g.dv, numeric_gradient(loss, in.v, step), tolerance));
  EXPECT_TRUE(all_close("dw_q", g.dw_q, numeric_gradient(loss, in.w_q, step), tolerance));
  EXPECT_TRUE(all_close("dw_k", g.dw_k, numeric_gradient(loss, in.w_k, step), tolerance));
  EXPECT_TRUE(all_close("dw", g.dw, numeric_gradient(loss, in.w, step), tolerance));
  EXPECT_TRUE(all_close("dbias", *g.dbias, numeric_gradient(loss, *in.bias, step), tolerance));
}

// ---- Properties. ----

TEST(AdditiveAttention, RowsSumToOneAndMaskedKeysGetZero) {
  const Sizes s{.b = 2, .h = 3, .tq = 6, .tk = 9, .dq = 4, .dk = 5, .dv = 3, .a = 6};
  Inputs<double> in = random_inputs(s, 400);
  in.causal = true;
  in.allowed = random_allowed({2, 3, 6, 9}, 401, 0.5);
  in.bias = random_bias({1, 1, 6, 9}, 402, 0.2);
  const Forward<double> f = run_forward(in);
  int64_t rows_with_keys = 0;
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.h; ++h) {
      for (int64_t i = 0; i < s.tq; ++i) {
        double sum = 0.0;
        bool any_visible = false;
        for (int64_t j = 0; j < s.tk; ++j) {
          const double alpha = f.weights[flat4(f.weights.shape(), b, h, i, j)];
          if (!naive_visible(in, b, h, i, j)) {
            EXPECT_EQ(alpha, 0.0) << "masked key " << j << " of row " << i;
          } else {
            any_visible = true;
            EXPECT_GT(alpha, 0.0);
          }
          sum += alpha;
        }
        const double lse = f.lse[(b * s.h + h) * s.tq + i];
        if (any_visible) {
          ++rows_with_keys;
          EXPECT_NEAR(sum, 1.0, static_cast<double>(s.tk) * kEps64);
          EXPECT_TRUE(std::isfinite(lse));
        } else {
          EXPECT_EQ(sum, 0.0);
          EXPECT_EQ(lse, -kInf);
        }
      }
    }
  }
  EXPECT_GT(rows_with_keys, 0);
}

// Bottom-right alignment: query i sees key j iff j <= i + Tk − Tq, whichever of Tq and Tk is larger.
TEST(AdditiveAttention, CausalIsBottomRightAligned) {
  for (const auto& [tq, tk] : std::vector<std::pair<int64_t, int64_t>>{{3, 8}, {8, 3}, {5, 5}}) {
    SCOPED_TRACE(fmt::format("Tq = {}, Tk = {}", tq, tk));
    const Sizes s{.b = 1, .h = 2, .tq = tq, .tk = tk, .dq = 3, .dk = 2, .dv = 2, .a = 4};
    Inputs<double> in = random_inputs(s, 500 + static_cast<uint64_t>(tq));
    in.causal = true;
    const Forward<double> causal = run_forward(in);
    for (int64_t h = 0; h < s.h; ++h) {
      for (int64_t i = 0; i < tq; ++i) {
        for (int64_t j = 0; j < tk; ++j) {
          const double alpha = causal.weights[flat4(causal.weights.shape(), 0, h, i, j)];
          if (j <= i + tk - tq) {
            EXPECT_GT(alpha, 0.0) << "query " << i << " must see key " << j;
          } else {
            EXPECT_EQ(alpha, 0.0) << "query " << i << " must not see key " << j;
          }
        }
      }
    }
    // The same convention spelled as an explicit allowed mask gives the same result.
    Inputs<double> explicit_mask = in;
    explicit_mask.causal = false;
    explicit_mask.allowed = Tensor<uint8_t>({1, 1, tq, tk});
    for (int64_t i = 0; i < tq; ++i) {
      for (int64_t j = 0; j < tk; ++j) (*explicit_mask.allowed)[i * tk + j] = j <= i + tk - tq ? 1 : 0;
    }
    const Forward<double> masked = run_forward(explicit_mask);
    EXPECT_TRUE(all_close("out", causal.out, masked.out, 0.0));
    EXPECT_TRUE(all_close("lse", causal.lse, masked.lse, 0.0));
  }
}

// Attention is a weighted set operation over the keys: permuting keys and values together (and the
// mask's key axis with them) permutes α's columns and leaves the output unchanged.
TEST(AdditiveAttention, PermutingKeysAndValuesLeavesOutputUnchanged) {
  const Sizes s{.b = 2, .h = 2, .tq = 5, .tk = 7, .dq = 3, .dk = 4, .dv = 3, .a = 5};
  Inputs<double> in = random_inputs(s, 600);
  in.allowed = random_allowed({2, 2, 5, 7}, 601, 0.7);
  in.bias = random_bias({1, 1, 1, 7}, 602, 0.0);
  const std::vector<int64_t> perm = {3, 6, 0, 5, 1, 4, 2};
  Inputs<double> permuted = in;
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.h; ++h) {
      for (int64_t j = 0; j < s.tk; ++j) {
        for (int64_t d = 0; d < s.dk; ++d)
          permuted.k[flat4(in.k.shape(), b, h, j, d)] = in.k[flat4(in.k.shape(), b, h, perm[j], d)];
        for (int64_t d = 0; d < s.dv; ++d)
          permuted.v[flat4(in.v.shape(), b, h, j, d)] = in.v[flat4(in.v.shape(), b, h, perm[j], d)];
        for (int64_t i = 0; i < s.tq; ++i) {
          (*permuted.allowed)[flat4(in.allowed->shape(), b, h, i, j)] =
              (*in.allowed)[flat4(in.allowed->shape(), b, h, i, perm[j])];
        }
      }
    }
  }
  for (int64_t j = 0; j < s.tk; ++j) (*permuted.bias)[j] = (*in.bias)[perm[j]];
  const Forward<double> f = run_forward(in), p = run_forward(permuted);
  EXPECT_TRUE(all_close("out", p.out, f.out, float64_tolerance(s, f.out)));
  EXPECT_TRUE(all_close("lse", p.lse, f.lse, float64_tolerance(s, f.lse)));
  Tensor<double> unpermuted(p.weights.shape());
  for (int64_t r = 0; r < s.b * s.h * s.tq; ++r) {
    for (int64_t j = 0; j < s.tk; ++j) unpermuted[r * s.tk + perm[j]] = p.weights[r * s.tk + j];
  }
  EXPECT_TRUE(all_close("weights", unpermuted, f.weights, float64_tolerance(s, f.weights)));
}

// With w = 0 every visible key scores the same, so the output is the mean of the visible values:
// a check that needs no second implementation.
TEST(AdditiveAttention, ZeroScoreVectorAveragesVisibleValues) {
  const Sizes s{.b = 1, .h = 2, .tq = 4, .tk = 6, .dq = 3, .dk = 3, .dv = 2, .a = 4};
  Inputs<double> in = random_inputs(s, 700);
  in.w = Tensor<double>({s.a});
  in.causal = true;
  const Forward<double> f = run_forward(in);
  Tensor<double> mean(f.out.shape());
  for (int64_t h = 0; h < s.h; ++h) {
    for (int64_t i = 0; i < s.tq; ++i) {
      const int64_t visible = i + s.tk - s.tq + 1;
      for (int64_t d = 0; d < s.dv; ++d) {
        double sum = 0.0;
        for (int64_t j = 0; j < visible; ++j) sum += in.v[flat4(in.v.shape(), 0, h, j, d)];
        mean[flat4(mean.shape(), 0, h, i, d)] = sum / static_cast<double>(visible);
      }
    }
  }
  EXPECT_TRUE(all_close("out", f.out, mean, float64_tolerance(s, mean)));
}

TEST(AdditiveAttention, MinusInfBiasMasksLikeAllowed) {
  const Sizes s{.b = 2, .h = 1, .tq = 4, .tk = 5, .dq = 2, .dk = 3, .dv = 2, .a = 3};
  Inputs<double> by_allowed = random_inputs(s, 800);
  by_allowed.allowed = random_allowed({2, 1, 4, 5}, 801, 0.6);
  Inputs<double> by_bias = by_allowed;
  by_bias.allowed.reset();
  by_bias.bias = Tensor<double>({2, 1, 4, 5});
  for (int64_t i = 0; i < by_bias.bias->numel(); ++i) (*by_bias.bias)[i] = (*by_allowed.allowed)[i] ? 0.0 : -kInf;
  const Forward<double> a = run_forward(by_allowed), b = run_forward(by_bias);
  EXPECT_TRUE(all_close("out", a.out, b.out, 0.0));
  EXPECT_TRUE(all_close("weights", a.weights, b.weights, 0.0));
  EXPECT_TRUE(all_close("lse", a.lse, b.lse, 0.0));
}

// The weights are shared by every batch and head: their gradient is the sum over the heads, and
// each head's activations depend on that head alone.
TEST(AdditiveAttention, HeadsAreIndependentAndWeightGradientsSumOverThem) {
  const Sizes s{.b = 2, .h = 1, .tq = 3, .tk = 4, .dq = 2, .dk = 3, .dv = 2, .a = 4};
  const Inputs<double> both = random_inputs(s, 900);
  const Tensor<double> dout = random_dout(both, 901);
  const Forward<double> f = run_forward(both);
  const Grads<double> g = run_backward(both, dout);
  Grads<double> summed = zero_grads(both);
  for (int64_t b = 0; b < s.b; ++b) {
    Inputs<double> one = both;
    one.sizes.b = 1;
    auto slice = [b](const Tensor<double>& t) {
      const Shape& sh = t.shape();
      const int64_t per = t.numel() / sh[0];
      return Tensor<double>({1, sh[1], sh[2], sh[3]},
                            std::vector<double>(t.values().begin() + b * per, t.values().begin() + (b + 1) * per));
    };
    one.q = slice(both.q);
    one.k = slice(both.k);
    one.v = slice(both.v);
    const Tensor<double> dout_b = slice(dout);
    EXPECT_TRUE(all_close("out of one batch", run_forward(one).out, slice(f.out), 0.0));
    Grads<double> gb = zero_grads(one);
    additive_attention_backward(one.params(), dout_b.cview(), views_of(gb));
    EXPECT_TRUE(all_close("dq of one batch", gb.dq, slice(g.dq), 0.0));
    for (int64_t i = 0; i < gb.dw_q.numel(); ++i) summed.dw_q[i] += gb.dw_q[i];
    for (int64_t i = 0; i < gb.dw_k.numel(); ++i) summed.dw_k[i] += gb.dw_k[i];
    for (int64_t i = 0; i < gb.dw.numel(); ++i) summed.dw[i] += gb.dw[i];
  }
  EXPECT_TRUE(all_close("dw_q", g.dw_q, summed.dw_q, float64_tolerance(s, g.dw_q)));
  EXPECT_TRUE(all_close("dw_k", g.dw_k, summed.dw_k, float64_tolerance(s, g.dw_k)));
  EXPECT_TRUE(all_close("dw", g.dw, summed.dw, float64_tolerance(s, g.dw)));
}

TEST(AdditiveAttention, BackwardAccumulatesIntoGradients) {
  const Sizes s{.b = 1, .h = 2, .tq = 3, .tk = 4, .dq = 2, .dk = 2, .dv = 3, .a = 3};
  Inputs<double> in = random_inputs(s, 1000);
  in.bias = random_bias({1, 1, 3, 4}, 1001, 0.0);
  const Tensor<double> dout = random_dout(in, 1002);
  const Grads<double> once = run_backward(in, dout);
  Grads<double> twice = zero_grads(in);
  additive_attention_backward(in.params(), dout.cview(), views_of(twice));
  additive_attention_backward(in.params(), dout.cview(), views_of(twice));
  auto doubled = [](const Tensor<double>& t) {
    Tensor<double> r = t;
    for (double& x : r.values()) x *= 2.0;
    return r;
  };
  EXPECT_TRUE(all_close("dq", twice.dq, doubled(once.dq), 0.0));
  EXPECT_TRUE(all_close("dv", twice.dv, doubled(once.dv), 0.0));
  EXPECT_TRUE(all_close("dw_k", twice.dw_k, doubled(once.dw_k), 0.0));
  EXPECT_TRUE(all_close("dbias", *twice.dbias, doubled(*once.dbias), 0.0));
}

// B and H may be left out, and a mask may have fewer dims than the scores.
TEST(AdditiveAttention, LeadingDimsAreOptional) {
  const Sizes s{.b = 1, .h = 1, .tq = 4, .tk = 5, .dq = 3, .dk = 2, .dv = 2, .a = 3};
  Inputs<double> full = random_inputs(s, 1100);
  full.allowed = random_allowed({1, 1, 4, 5}, 1101, 0.7);
  const Forward<double> want = run_forward(full);
  for (const int rank : {2, 3}) {
    SCOPED_TRACE(fmt::format("rank {}", rank));
    auto drop = [rank](const Tensor<double>& t) {
      const Shape& sh = t.shape();
      return Tensor<double>(rank == 2 ? Shape{sh[2], sh[3]} : Shape{sh[1], sh[2], sh[3]}, t.values());
    };
    Inputs<double> low = full;
    low.q = drop(full.q);
    low.k = drop(full.k);
    low.v = drop(full.v);
    low.allowed = Tensor<uint8_t>({4, 5}, full.allowed->values());
    const Forward<double> got = run_forward(low);
    EXPECT_EQ(got.out.shape(), drop(want.out).shape());
    EXPECT_TRUE(all_close("out", got.out, drop(want.out), 0.0));
    EXPECT_TRUE(all_close("weights", got.weights, drop(want.weights), 0.0));
    EXPECT_TRUE(all_close("lse", got.lse, Tensor<double>(got.lse.shape(), want.lse.values()), 0.0));
  }
}

TEST(AdditiveAttention, AcceptsStridedInputs) {
  const Sizes s{.b = 1, .h = 2, .tq = 3, .tk = 4, .dq = 3, .dk = 2, .dv = 2, .a = 3};
  const Inputs<double> in = random_inputs(s, 1200);
  const Forward<double> want = run_forward(in);
  // q embedded in a tensor twice as wide along H: every other head slice, a non-contiguous view.
  Tensor<double> wide({1, 4, 3, 3}, std::numeric_limits<double>::quiet_NaN());
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t x = 0; x < 9; ++x) wide[(2 * h) * 9 + x] = in.q[h * 9 + x];
  }
  AdditiveAttentionParams<double> p = in.params();
  p.q = TensorView<const double>{wide.data(), Shape{1, 2, 3, 3}, {36, 18, 3, 1}};
  Tensor<double> out(want.out.shape());
  additive_attention_forward(p,
                             AttentionOutputs<double>{.out = out.view(), .weights = std::nullopt, .lse = std::nullopt});
  EXPECT_TRUE(all_close("out", out, want.out, 0.0));
}

// ---- Edge cases. ----

TEST(AdditiveAttention, SingleKeyReturnsItsValue) {
  const Sizes s{.b = 1, .h = 1, .tq = 1, .tk = 1, .dq = 1, .dk = 1, .dv = 3, .a = 1};
  const Inputs<double> in = random_inputs(s, 1300);
  const Forward<double> f = run_forward(in);
  EXPECT_EQ(f.weights[0], 1.0);
  EXPECT_TRUE(all_close("out", f.out, Tensor<double>(f.out.shape(), in.v.values()), 0.0));
  // α is constant, so nothing but v has a gradient.
  const Grads<double> g = run_backward(in, random_dout(in, 1301));
  EXPECT_EQ(g.dq[0], 0.0);
  EXPECT_EQ(g.dw[0], 0.0);
}

TEST(AdditiveAttention, NoQueries) {
  const Sizes s{.b = 2, .h = 1, .tq = 0, .tk = 3, .dq = 2, .dk = 2, .dv = 2, .a = 3};
  const Inputs<double> in = random_inputs(s, 1400);
  const Forward<double> f = run_forward(in);
  EXPECT_EQ(f.out.numel(), 0);
  const Grads<double> g = run_backward(in, random_dout(in, 1401));
  for (const Tensor<double>* t : {&g.dk, &g.dv, &g.dw_q, &g.dw_k, &g.dw}) {
    EXPECT_TRUE(all_close("gradient", *t, Tensor<double>(t->shape()), 0.0));
  }
}

TEST(AdditiveAttention, NoKeysGivesZeroOutputAndMinusInfLse) {
  const Sizes s{.b = 1, .h = 2, .tq = 3, .tk = 0, .dq = 2, .dk = 2, .dv = 2, .a = 3};
  const Inputs<double> in = random_inputs(s, 1500);
  const Forward<double> f = run_forward(in);
  EXPECT_TRUE(all_close("out", f.out, Tensor<double>(f.out.shape()), 0.0));
  EXPECT_TRUE(all_close("lse", f.lse, Tensor<double>(f.lse.shape(), -kInf), 0.0));
  const Grads<double> g = run_backward(in, random_dout(in, 1501));
  EXPECT_TRUE(all_close("dq", g.dq, Tensor<double>(g.dq.shape()), 0.0));
  EXPECT_TRUE(all_close("dw_q", g.dw_q, Tensor<double>(g.dw_q.shape()), 0.0));
}

// Rows masked by every mask kind (allowed all zero, bias all −inf, causal with Tq > Tk) have output
// 0, lse −inf, α 0 and give their query exactly zero gradient; no NaN anywhere, in either precision.
template <class T>
void check_fully_masked_rows() {
  const Sizes s{.b = 1, .h = 1, .tq = 6, .tk = 4, .dq = 3, .dk = 2, .dv = 2, .a = 3};
  Inputs<double> in64 = random_inputs(s, 1600);
  in64.causal = true;  // Tq − Tk = 2: rows 0 and 1 see no key
  in64.allowed = Tensor<uint8_t>({1, 1, s.tq, s.tk}, 1);
  in64.bias = Tensor<double>({1, 1, s.tq, s.tk});
  for (int64_t j = 0; j < s.tk; ++j) {
    (*in64.allowed)[2 * s.tk + j] = 0;   // row 2
    (*in64.bias)[4 * s.tk + j] = -kInf;  // row 4
  }
  const Inputs<T> in = cast_inputs<T>(in64);
  const Forward<T> f = run_forward(in);
  const Grads<T> g = run_backward(in, cast<T>(random_dout(in64, 1601)));
  for (int64_t i = 0; i < s.tq; ++i) {
    const bool masked = i <= 2 || i == 4;
    SCOPED_TRACE(fmt::format("row {}", i));
    EXPECT_EQ(f.lse[i] == -std::numeric_limits<T>::infinity(), masked);
    for (int64_t d = 0; d < s.dv; ++d) EXPECT_TRUE(std::isfinite(f.out[i * s.dv + d]));
    for (int64_t d = 0; d < s.dq; ++d) EXPECT_TRUE(std::isfinite(g.dq[i * s.dq + d]));
    if (!masked) continue;
    for (int64_t d = 0; d < s.dv; ++d) EXPECT_EQ(f.out[i * s.dv + d], T{0});
    for (int64_t d = 0; d < s.dq; ++d) EXPECT_EQ(g.dq[i * s.dq + d], T{0});
    for (int64_t j = 0; j < s.tk; ++j) {
      EXPECT_EQ(f.weights[i * s.tk + j], T{0});
      EXPECT_EQ((*g.dbias)[i * s.tk + j], T{0});
    }
  }
  for (const Tensor<T>* t : {&g.dk, &g.dv, &g.dw_q, &g.dw_k, &g.dw, &*g.dbias}) {
    for (int64_t i = 0; i < t->numel(); ++i) EXPECT_TRUE(std::isfinite((*t)[i]));
  }
}

TEST(AdditiveAttention, FullyMaskedRowsFloat64) { check_fully_masked_rows<double>(); }
TEST(AdditiveAttention, FullyMaskedRowsFloat32) { check_fully_masked_rows<float>(); }

// Huge queries and keys push every tanh to ±1: the scores stay bounded by Σ|w|, so nothing
// overflows, α still sums to 1 and the gradients are finite (and 0 through the saturated tanh).
template <class T>
void check_saturation(double scale) {
  const Sizes s{.b = 1, .h = 2, .tq = 5, .tk = 6, .dq = 4, .dk = 3, .dv = 2, .a = 5};
  Inputs<double> in64 = random_inputs(s, 1700);
  for (double& x : in64.q.values()) x *= scale;
  for (double& x : in64.k.values()) x *= scale;
  const Inputs<T> in = cast_inputs<T>(in64);
  const Forward<T> f = run_forward(in);
  const Grads<T> g = run_backward(in, cast<T>(random_dout(in64, 1701)));
  for (const Tensor<T>* t : {&f.out, &f.weights, &f.lse, &g.dq, &g.dk, &g.dv, &g.dw_q, &g.dw_k, &g.dw}) {
    for (int64_t i = 0; i < t->numel(); ++i) ASSERT_TRUE(std::isfinite((*t)[i])) << "element " << i;
  }
  for (int64_t r = 0; r < s.h * s.tq; ++r) {
    double sum = 0.0;
    for (int64_t j = 0; j < s.tk; ++j) sum += f.weights[r * s.tk + j];
    EXPECT_NEAR(sum, 1.0, static_cast<double>(s.tk) * std::numeric_limits<T>::epsilon());
  }
  const Forward<double> want = naive_forward(in64);
  EXPECT_TRUE(all_close("out", cast<double>(f.out), want.out,
                        accumulation_length(s) * std::numeric_limits<T>::epsilon() * std::max(max_abs(want.out), 1.0)));
}

TEST(AdditiveAttention, SaturatedTanhFloat64) { check_saturation<double>(1e150); }
TEST(AdditiveAttention, SaturatedTanhFloat32) { check_saturation<float>(1e30); }

// ---- Refusals. ----

template <class Error, class F>
void expect_error_naming(const std::string& name, F&& call) {
  try {
    call();
    ADD_FAILURE() << "expected an error naming " << name;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind(name + ":", 0), 0u) << message;
  }
}

TEST(AdditiveAttention, BadShapesNameTheArgument) {
  const Sizes s{.b = 2, .h = 2, .tq = 3, .tk = 4, .dq = 3, .dk = 2, .dv = 2, .a = 5};
  Inputs<double> in = random_inputs(s, 1800);
  in.bias = random_bias({1, 1, 3, 4}, 1801, 0.0);
  Forward<double> f = run_forward(in);
  const Tensor<double> dout = random_dout(in, 1802);
  Grads<double> g = zero_grads(in);
  const AttentionOutputs<double> outputs{.out = f.out.view(), .weights = f.weights.view(), .lse = f.lse.view()};

  Tensor<double> scratch({64});
  auto view = [&](const Shape& shape) { return make_view(scratch.data(), shape); };
  auto cview = [&](const Shape& shape) { return TensorView<const double>(view(shape)); };
  const auto forward_with =
      [&](const std::function<void(AdditiveAttentionParams<double>&, AttentionOutputs<double>&)>& edit) {
        return [&, edit] {
          AdditiveAttentionParams<double> p = in.params();
          AttentionOutputs<double> o = outputs;
          edit(p, o);
          additive_attention_forward(p, o);
        };
      };
  using P = AdditiveAttentionParams<double>;
  using O = AttentionOutputs<double>;
  expect_error_naming<ShapeError>("q", forward_with([&](P& p, O&) { p.q = cview({3}); }));
  expect_error_naming<ShapeError>("k", forward_with([&](P& p, O&) { p.k = cview({1, 2, 4, 2}); }));
  expect_error_naming<ShapeError>("k", forward_with([&](P& p, O&) { p.k = cview({4, 2}); }));
  expect_error_naming<ShapeError>("v", forward_with([&](P& p, O&) { p.v = cview({2, 2, 5, 2}); }));
  expect_error_naming<ShapeError>("w_q", forward_with([&](P& p, O&) { p.w_q = cview({5, 2}); }));
  expect_error_naming<ShapeError>("w_q", forward_with([&](P& p, O&) { p.w_q = cview({15}); }));
  expect_error_naming<ShapeError>("w_k", forward_with([&](P& p, O&) { p.w_k = cview({4, 2}); }));
  expect_error_naming<ShapeError>("w", forward_with([&](P& p, O&) { p.w = cview({4}); }));
  expect_error_naming<ShapeError>("bias", forward_with([&](P& p, O&) { p.mask.bias = cview({3, 3}); }));
  expect_error_naming<ShapeError>("out", forward_with([&](P&, O& o) { o.out = view({2, 2, 3, 3}); }));
  expect_error_naming<ShapeError>("weights", forward_with([&](P&, O& o) { o.weights = view({2, 2, 4, 3}); }));
  expect_error_naming<ShapeError>("lse", forward_with([&](P&, O& o) { o.lse = view({2, 2, 3, 1}); }));
  Tensor<uint8_t> bad_mask({2, 4});
  expect_error_naming<ShapeError>("mask", forward_with([&](P& p, O&) { p.mask.allowed = bad_mask.cview(); }));
  expect_error_naming<ShapeError>("q", forward_with([&](P& p, O&) {
                                    p.q = TensorView<const double>{scratch.data(), Shape{2, 2, 3, 3}, {0, 0, 3, 2}};
                                  }));

  // The message gives the expected and the actual shape.
  try {
    forward_with([&](P& p, O&) { p.w_k = cview({5, 3}); })();
    ADD_FAILURE() << "w_k of the wrong width was accepted";
  } catch (const ShapeError& e) {
    EXPECT_EQ(std::string(e.what()), "w_k: expected shape [5, 2], got [5, 3]");
  }

  const auto backward_with = [&](const std::function<void(AdditiveAttentionGradients<double>&)>& edit,
                                 TensorView<const double> d) {
    return [&, edit, d] {
      AdditiveAttentionGradients<double> grads = views_of(g);
      edit(grads);
      additive_attention_backward(in.params(), d, grads);
    };
  };
  using G = AdditiveAttentionGradients<double>;
  const auto none = [](G&) {};
  expect_error_naming<ShapeError>("dout", backward_with(none, cview({2, 2, 3, 3})));
  expect_error_naming<ShapeError>("dq", backward_with([&](G& gr) { gr.dq = view({2, 2, 3, 2}); }, dout.cview()));
  expect_error_naming<ShapeError>("dk", backward_with([&](G& gr) { gr.dk = view({2, 2, 3, 2}); }, dout.cview()));
  expect_error_naming<ShapeError>("dv", backward_with([&](G& gr) { gr.dv = view({2, 2, 4, 3}); }, dout.cview()));
  expect_error_naming<ShapeError>("dw_q", backward_with([&](G& gr) { gr.dw_q = view({3, 5}); }, dout.cview()));
  expect_error_naming<ShapeError>("dw_k", backward_with([&](G& gr) { gr.dw_k = view({5, 3}); }, dout.cview()));
  expect_error_naming<ShapeError>("dw", backward_with([&](G& gr) { gr.dw = view({5, 1}); }, dout.cview()));
  expect_error_naming<ShapeError>("dbias", backward_with([&](G& gr) { gr.dbias = view({3, 4}); }, dout.cview()));
  Inputs<double> no_bias = in;
  no_bias.bias.reset();
  expect_error_naming<ShapeError>("dbias",
                                  [&] { additive_attention_backward(no_bias.params(), dout.cview(), views_of(g)); });
}

// Problems too large to materialise are refused before anything is allocated or written: the
// inputs here are stride-0 views of a single number, as long as the problem says.
TEST(AdditiveAttention, RefusesProblemsThatDoNotFitInMemory) {
  const int64_t t = int64_t{1} << 26;  // 2^52 scores of 8 bytes: 32 PiB
  const double one = 1.0;
  const TensorView<const double> tokens{&one, Shape{t, 1}, {0, 1}};
  const TensorView<const double> weight{&one, Shape{1, 1}, {0, 1}};
  double sink = 0.0;
  const AdditiveAttentionParams<double> p{.q = tokens,
                                          .k = tokens,
                                          .v = tokens,
                                          .w_q = weight,
                                          .w_k = weight,
                                          .w = TensorView<const double>{&one, Shape{1}, {1}},
                                          .mask = {}};
  const TensorView<double> out{&sink, Shape{t, 1}, {0, 1}};
  EXPECT_THROW(
      additive_attention_forward(p, AttentionOutputs<double>{.out = out, .weights = std::nullopt, .lse = std::nullopt}),
      ResourceError);
  const TensorView<double> d_tokens{&sink, Shape{t, 1}, {0, 1}};
  const TensorView<double> d_weight{&sink, Shape{1, 1}, {0, 1}};
  const AdditiveAttentionGradients<double> grads{.dq = d_tokens,
                                                 .dk = d_tokens,
                                                 .dv = d_tokens,
                                                 .dw_q = d_weight,
                                                 .dw_k = d_weight,
                                                 .dw = TensorView<double>{&sink, Shape{1}, {1}},
                                                 .dbias = std::nullopt};
  EXPECT_THROW(additive_attention_backward(p, tokens, grads), ResourceError);
  EXPECT_EQ(sink, 0.0);
}

}  // namespace
}  // namespace qkv
