#include "qkv/nn/self_attention.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::all_close;
using testing::cast;
using testing::numeric_gradient;
using testing::random_tensor;
using testing::throws_naming;
using testing::tolerance_from_naive;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();
constexpr double kEps32 = std::numeric_limits<float>::epsilon();
constexpr double kStep = 1e-6;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

using ParameterMap = std::map<std::string, Tensor<double>>;

std::string describe(const SelfAttentionConfig& c) {
  return fmt::format("d_model {}, n_heads {}, bias {}, output_projection {}, causal {}", c.d_model, c.n_heads, c.bias,
                     c.output_projection, c.causal);
}

// Every configuration the gradient and reference tests sweep.
std::vector<SelfAttentionConfig> sweep(int64_t d_model) {
  std::vector<SelfAttentionConfig> configs;
  for (int64_t heads : {1, 2, 4}) {
    for (bool bias : {false, true}) {
      for (bool projection : {false, true}) {
        for (bool causal : {false, true}) {
          configs.push_back(
              {.d_model = d_model, .n_heads = heads, .bias = bias, .output_projection = projection, .causal = causal});
        }
      }
    }
  }
  return configs;
}

template <class T>
ParameterMap parameters_of(const SelfAttention<T>& layer) {
  ParameterMap result;
  for (const ParameterRef<const T>& p : layer.parameters()) result.emplace(p.name, to_tensor<double, T>(p.value));
  return result;
}

template <class T>
ParameterMap gradients_of(const SelfAttention<T>& layer) {
  ParameterMap result;
  for (const ParameterRef<const T>& p : layer.parameters()) result.emplace(p.name, to_tensor<double, T>(p.grad));
  return result;
}

template <class T>
void copy_to(const Tensor<double>& src, TensorView<T> dst) {
  for (int64_t i = 0; i < src.numel(); ++i) dst.data[i] = static_cast<T>(src[i]);
}

// The mask of a test, materialised at [B, H, T, T] for the naive reference.
struct NaiveMask {
  bool causal = false;
  std::optional<Tensor<uint8_t>> allowed;
  std::optional<Tensor<double>> bias;
};

template <class Acc>
struct NaiveResult {
  Tensor<Acc> y;        // [B, T, d_model]
  Tensor<Acc> weights;  // [B, H, T, T]
};

// The layer by its definition, every operation in Acc: float64 is the reference, float32 the naive
// computation whose error sets the tolerance. x [B, T, d_model].
template <class Acc>
NaiveResult<Acc> naive_self_attention(const Tensor<double>& x, const ParameterMap& p, const SelfAttentionConfig& c,
                                      const NaiveMask& mask) {
  const int64_t batch = x.shape()[0], tokens = x.shape()[1], d = c.d_model, heads = c.n_heads, dh = d / heads;
  const auto project = [&](const Tensor<Acc>& in, const std::string& suffix) {
    const Tensor<double>& w = p.at("w_" + suffix);
    Tensor<Acc> out(Shape{batch, tokens, d});
    for (int64_t r = 0; r < batch * tokens; ++r) {
      for (int64_t o = 0; o < d; ++o) {
        Acc acc = c.bias ? static_cast<Acc>(p.at("b_" + suffix)[o]) : Acc{0};
        for (int64_t i = 0; i < d; ++i) acc += in[r * d + i] * static_cast<Acc>(w[o * d + i]);
        out[r * d + o] = acc;
      }
    }
    return out;
  };
  const Tensor<Acc> xa = cast<Acc>(x);
  const Tensor<Acc> q = project(xa, "q"), k = project(xa, "k"), v = project(xa, "v");
  const auto at = [&](const Tensor<Acc>& t, int64_t b, int64_t i, int64_t h, int64_t f) {
    return t[(b * tokens + i) * d + h * dh + f];
  };

  NaiveResult<Acc> result{.y = Tensor<Acc>(Shape{batch, tokens, d}),
                          .weights = Tensor<Acc>(Shape{batch, heads, tokens, tokens})};
  Tensor<Acc> context(Shape{batch, tokens, d});
  const Acc scale = Acc{1} / std::sqrt(static_cast<Acc>(dh));
  std::vector<Acc> scores(static_cast<size_t>(tokens));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < tokens; ++i) {
        const int64_t mask_row = ((b * heads + h) * tokens + i) * tokens;
        Acc max = static_cast<Acc>(kNegInf);
        for (int64_t j = 0; j < tokens; ++j) {
          const bool visible = (!mask.causal || j <= i) && (!mask.allowed || (*mask.allowed)[mask_row + j] != 0);
          Acc s = static_cast<Acc>(kNegInf);
          if (visible) {
            s = Acc{0};
            for (int64_t f = 0; f < dh; ++f) s += at(q, b, i, h, f) * at(k, b, j, h, f);
            s = s * scale + (mask.bias ? static_cast<Acc>((*mask.bias)[mask_row + j]) : Acc{0});
          }
          scores[static_cast<size_t>(j)] = s;
          max = std::max(max, s);
        }
        if (max == static_cast<Acc>(kNegInf)) continue;  // no visible key: α and the output row stay 0
        Acc sum = 0;
        for (Acc& s : scores) sum += (s = std::exp(s - max));
        for (int64_t j = 0; j < tokens; ++j) {
          const Acc alpha = scores[static_cast<size_t>(j)] / sum;
          result.weights[mask_row + j] = alpha;
          for (int64_t f = 0; f < dh; ++f) context[(b * tokens + i) * d + h * dh + f] += alpha * at(v, b, j, h, f);
        }
      }
    }
  }
  result.y = c.output_projection ? project(context, "o") : context;
  return result;
}

// A layer's gradients from one forward and backward, from zero.
struct Gradients {
  Tensor<double> dx;
  ParameterMap params;
};

template <class T>
Gradients analytic_gradients(SelfAttention<T>& layer, const Tensor<T>& x, const Tensor<T>& dy,
                             const AttentionMask<T>& mask = {}) {
  layer.zero_grad();
  SelfAttentionCache<T> cache;
  layer.forward(x.view(), cache, mask);
  Tensor<T> dx(x.shape());
  layer.backward(cache, dy.view(), dx.view());
  return {.dx = cast<double>(dx), .params = gradients_of(layer)};
}

template <class T>
Tensor<T> forward(const SelfAttention<T>& layer, const Tensor<T>& x, const AttentionMask<T>& mask = {}) {
  SelfAttentionCache<T> cache;
  return layer.forward(x.view(), cache, mask);
}

double max_abs(const Tensor<double>& t) {
  double m = 0.0;
  for (double e : t.values()) m = std::max(m, std::abs(e));
  return m;
}

double sum_abs(const Tensor<double>& t) {
  double s = 0.0;
  for (double e : t.values()) s += std::abs(e);
  return s;
}

// The float64 layer against the float64 reference: both sum the same terms in other orders, so they
// differ by the rounding of the longest chain of sums (x→Q: d_model, scores: Dh, softmax and α·V:
// T, C→y: d_model), at most that many ε times the output magnitude, with a factor 8 for the exps.
double float64_tolerance(const SelfAttentionConfig& c, int64_t tokens, const Tensor<double>& exact) {
  return 8.0 * static_cast<double>(3 * c.d_model + 2 * tokens) * kEps64 * std::max(1.0, max_abs(exact));
}

// Central differences with step h err by h²/6·|L'''| (about 1e-12 here: negligible) plus the
// rounding of the two evaluations of L over 2h. Each evaluation ends in the sum <dY, Y> of numel
// terms after a chain of d_model + T-long sums, so it errs by at most (numel + 3·d_model + 2·T)·ε
// times Σ|dY|·max(1, max|Y|).
double finite_difference_tolerance(const SelfAttentionConfig& c, int64_t tokens, const Tensor<double>& dy,
                                   const Tensor<double>& y) {
  const double depth = static_cast<double>(dy.numel() + 3 * c.d_model + 2 * tokens);
  return depth * kEps64 * sum_abs(dy) * std::max(1.0, max_abs(y)) / kStep;
}

// Every gradient of L = <dY, layer(X)> against central differences, in float64.
void check_gradients(const SelfAttentionConfig& config, const Shape& x_shape, uint64_t seed,
                     const AttentionMask<double>& mask = {}) {
  SCOPED_TRACE(describe(config) + ", x " + x_shape.str());
  Rng rng(seed);
  SelfAttention<double> layer(config, rng);
  Tensor<double> x = random_tensor<double>(x_shape, rng);
  const Tensor<double> dy = random_tensor<double>(x_shape, rng);
  const Gradients analytic = analytic_gradients(layer, x, dy, mask);
  const auto loss = [&] { return testing::dot(dy, forward(layer, x, mask)); };
  const double tolerance = finite_difference_tolerance(config, x_shape.from_back(2), dy, forward(layer, x, mask));

  for (double e : analytic.dx.values()) ASSERT_TRUE(std::isfinite(e));
  EXPECT_TRUE(all_close("dx", analytic.dx, numeric_gradient(loss, x, kStep), tolerance));
  for (const ParameterRef<double>& p : layer.parameters()) {
    Tensor<double> value = to_tensor<double, double>(p.value);
    const auto loss_of_parameter = [&] {
      copy_to(value, p.value);
      return loss();
    };
    const Tensor<double> numeric = numeric_gradient(loss_of_parameter, value, kStep);
    copy_to(value, p.value);
    EXPECT_TRUE(all_close("d" + p.name, analytic.params.at(p.name), numeric, tolerance));
  }
}

TEST(SelfAttention, Float64MatchesReference) {
  for (const SelfAttentionConfig& config : sweep(8)) {
    SCOPED_TRACE(describe(config));
    Rng rng(1);
    const SelfAttention<double> layer(config, rng);
    const Tensor<double> x = random_tensor<double>(Shape{2, 5, 8}, rng);
    Tensor<double> weights(Shape{2, config.n_heads, 5, 5});
    SelfAttentionCache<double> cache;
    const Tensor<double> y = layer.forward(x.view(), cache, {}, weights.view());
    const NaiveResult<double> exact =
        naive_self_attention<double>(x, parameters_of(layer), config,
                                     NaiveMask{.causal = config.causal, .allowed = std::nullopt, .bias = std::nullopt});
    EXPECT_TRUE(all_close("y", y, exact.y, float64_tolerance(config, 5, exact.y)));
    EXPECT_TRUE(all_close("weights", weights, exact.weights, float64_tolerance(config, 5, exact.weights)));
    // Without α asked for, the attention may take another implementation.
    EXPECT_TRUE(all_close("y without weights", forward(layer, x), exact.y, float64_tolerance(config, 5, exact.y)));
  }
}

TEST(SelfAttention, Float32MatchesReference) {
  // Three heads of 4 features and 13 tokens: sizes that are multiples of nothing in particular.
  const SelfAttentionConfig config{
      .d_model = 12, .n_heads = 3, .bias = true, .output_projection = true, .causal = true};
  for (bool causal : {false, true}) {
    SelfAttentionConfig c = config;
    c.causal = causal;
    SCOPED_TRACE(describe(c));
    Rng rng(2);
    const SelfAttention<float> layer(c, rng);
    const Tensor<float> x = random_tensor<float>(Shape{2, 13, 12}, rng);
    const ParameterMap params = parameters_of(layer);
    const NaiveMask causal_only{.causal = causal, .allowed = std::nullopt, .bias = std::nullopt};
    const NaiveResult<double> exact = naive_self_attention<double>(cast<double>(x), params, c, causal_only);
    const NaiveResult<float> naive = naive_self_attention<float>(cast<double>(x), params, c, causal_only);
    EXPECT_TRUE(all_close("y", forward(layer, x), exact.y, tolerance_from_naive(naive.y, exact.y)));
  }
}

TEST(SelfAttention, Float32GradientsMatchFloat64) {
  const SelfAttentionConfig config{.d_model = 8, .n_heads = 2, .bias = true, .output_projection = true, .causal = true};
  Rng rng(3);
  SelfAttention<float> layer32(config, rng);
  SelfAttention<double> layer64(config, rng);
  const std::vector<ParameterRef<float>> params32 = layer32.parameters();
  const std::vector<ParameterRef<double>> params64 = layer64.parameters();
  for (size_t i = 0; i < params32.size(); ++i) copy_to(to_tensor<double, float>(params32[i].value), params64[i].value);
  const Tensor<float> x = random_tensor<float>(Shape{2, 7, 8}, rng);
  const Tensor<float> dy = random_tensor<float>(Shape{2, 7, 8}, rng);
  const Gradients g32 = analytic_gradients(layer32, x, dy);
  const Gradients g64 = analytic_gradients(layer64, cast<double>(x), cast<double>(dy));
  // float32 stores each intermediate (Q, K, V, C, dC, dQ, ...) rounded to ½ε relative; every sum
  // behind a gradient has at most 2·(d_model + T)·B terms, each carrying such a rounding.
  const auto tolerance = [&](const Tensor<double>& exact) {
    return 2.0 * static_cast<double>(2 * (8 + 7)) * kEps32 * std::max(1.0, max_abs(exact));
  };
  EXPECT_TRUE(all_close("dx", g32.dx, g64.dx, tolerance(g64.dx)));
  for (const auto& [name, grad] : g64.params)
    EXPECT_TRUE(all_close("d" + name, g32.params.at(name), grad, tolerance(grad)));
}

TEST(SelfAttention, GradientsMatchFiniteDifferences) {
  uint64_t seed = 10;
  for (const SelfAttentionConfig& config : sweep(8)) check_gradients(config, Shape{2, 3, 8}, seed++);
}

TEST(SelfAttention, GradientsOfTinyAndUnbatchedInputs) {
  // d_model = 1 with one head; T = 1; an unbatched [T, d_model] input.
  check_gradients({.d_model = 1, .n_heads = 1, .bias = true, .output_projection = true, .causal = false},
                  Shape{2, 3, 1}, 40);
  check_gradients({.d_model = 1, .n_heads = 1, .bias = false, .output_projection = true, .causal = true}, Shape{3, 1},
                  41);
  check_gradients({.d_model = 4, .n_heads = 2, .bias = true, .output_projection = true, .causal = true}, Shape{2, 1, 4},
                  42);
  check_gradients({.d_model = 4, .n_heads = 4, .bias = true, .output_projection = false, .causal = false}, Shape{5, 4},
                  43);
}

// A boolean mask of shape [T, T] that hides every key from query 0 (its output row is then 0) and
// one key from query 2, plus an additive bias of shape [B, 1, T, T] with a −inf entry.
struct TestMask {
  static constexpr int64_t kBatch = 2, kTokens = 4;
  Tensor<uint8_t> allowed{Shape{kTokens, kTokens}, 1};
  Tensor<double> bias;

  explicit TestMask(Rng& rng) : bias(random_tensor<double>(Shape{kBatch, 1, kTokens, kTokens}, rng)) {
    for (int64_t j = 0; j < kTokens; ++j) allowed[j] = 0;
    allowed[2 * kTokens + 1] = 0;
    bias[kTokens * kTokens + 3 * kTokens + 2] = kNegInf;  // batch 1, query 3, key 2
  }
  AttentionMask<double> view() const { return {.causal = false, .allowed = allowed.view(), .bias = bias.view()}; }
  NaiveMask materialised(int64_t heads) const {
    const Shape scores{kBatch, heads, kTokens, kTokens};
    return {.causal = false,
            .allowed = to_tensor<uint8_t, uint8_t>(broadcast_to(allowed.cview(), scores, "allowed")),
            .bias = to_tensor<double, double>(broadcast_to(bias.cview(), scores, "bias"))};
  }
};

TEST(SelfAttention, MaskIsPassedThrough) {
  Rng rng(50);
  const TestMask mask(rng);
  for (int64_t heads : {1, 2}) {
    const SelfAttentionConfig config{
        .d_model = 4, .n_heads = heads, .bias = true, .output_projection = true, .causal = false};
    SCOPED_TRACE(describe(config));
    const SelfAttention<double> layer(config, rng);
    const Tensor<double> x = random_tensor<double>(Shape{TestMask::kBatch, TestMask::kTokens, 4}, rng);
    SelfAttentionCache<double> cache;
    Tensor<double> weights(Shape{TestMask::kBatch, heads, TestMask::kTokens, TestMask::kTokens});
    const Tensor<double> y = layer.forward(x.view(), cache, mask.view(), weights.view());
    const NaiveResult<double> exact =
        naive_self_attention<double>(x, parameters_of(layer), config, mask.materialised(heads));
    EXPECT_TRUE(all_close("y", y, exact.y, float64_tolerance(config, TestMask::kTokens, exact.y)));
    EXPECT_TRUE(
        all_close("weights", weights, exact.weights, float64_tolerance(config, TestMask::kTokens, exact.weights)));
    // Query 0 sees no key: its context row is 0, so y is b_O there.
    for (int64_t b = 0; b < TestMask::kBatch; ++b) {
      for (int64_t f = 0; f < 4; ++f) EXPECT_EQ(y[b * 16 + f], parameters_of(layer).at("b_o")[f]);
    }
  }
  check_gradients({.d_model = 4, .n_heads = 2, .bias = true, .output_projection = true, .causal = false},
                  Shape{TestMask::kBatch, TestMask::kTokens, 4}, 51, mask.view());
  check_gradients({.d_model = 4, .n_heads = 1, .bias = false, .output_projection = false, .causal = true},
                  Shape{TestMask::kBatch, TestMask::kTokens, 4}, 52, mask.view());
}

TEST(SelfAttention, BackwardUsesTheMaskOfTheForward) {
  Rng rng(53);
  TestMask mask(rng);
  SelfAttention<double> layer({.d_model = 4, .n_heads = 2, .bias = true, .output_projection = true, .causal = false},
                              rng);
  const Tensor<double> x = random_tensor<double>(Shape{TestMask::kBatch, TestMask::kTokens, 4}, rng);
  const Tensor<double> dy = random_tensor<double>(x.shape(), rng);
  const Gradients expected = analytic_gradients(layer, x, dy, mask.view());

  layer.zero_grad();
  SelfAttentionCache<double> cache;
  layer.forward(x.view(), cache, mask.view());
  std::fill(mask.allowed.values().begin(), mask.allowed.values().end(), uint8_t{1});
  std::fill(mask.bias.values().begin(), mask.bias.values().end(), 5.0);
  Tensor<double> dx(x.shape());
  layer.backward(cache, dy.view(), dx.view());
  EXPECT_TRUE(all_close("dx", dx, expected.dx, 0.0));
  for (const auto& [name, grad] : expected.params)
    EXPECT_TRUE(all_close("d" + name, gradients_of(layer).at(name), grad, 0.0));
}

TEST(SelfAttention, VariantsArePassedThrough) {
  // The softcap of the config, and the window, ALiBi and packed sequences of the mask, reach the
  // attention of the forward and of the backward.
  Rng rng(60);
  const SelfAttentionConfig config{
      .d_model = 4, .n_heads = 2, .bias = true, .output_projection = true, .causal = true, .softcap = 1.5};
  const Tensor<double> slopes(Shape{2}, std::vector<double>{0.5, 0.25});
  const AttentionMask<double> mask{.window = AttentionWindow{.left = 2, .right = -1}, .alibi_slopes = slopes.view()};
  const SelfAttention<double> layer(config, rng);
  const Tensor<double> x = random_tensor<double>(Shape{2, 6, 4}, rng);
  SelfAttentionCache<double> cache;
  layer.forward(x.view(), cache, mask);
  Tensor<double> out(Shape{2, 2, 6, 2});
  const AttentionParams<double> params{
      .q = cache.q.view(),
      .k = cache.k.view(),
      .v = cache.v.view(),
      .scale = std::nullopt,
      .mask = {.causal = true, .window = AttentionWindow{.left = 2, .right = -1}, .alibi_slopes = slopes.view()},
      .softcap = 1.5};
  attention_forward(params, {.out = out.view(), .weights = {}, .lse = {}}, AttentionImpl::reference);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t t = 0; t < 6; ++t) {
        for (int64_t e = 0; e < 2; ++e) {
          EXPECT_NEAR(cache.context.view()(b, t, h * 2 + e), out.view()(b, h, t, e), 1e-15);
        }
      }
    }
  }
  check_gradients(config, Shape{2, 6, 4}, 61, mask);
  const Tensor<int64_t> cu(Shape{3}, std::vector<int64_t>{0, 3, 7});
  check_gradients(config, Shape{7, 4}, 62,
                  {.alibi_slopes = slopes.view(), .cu_seqlens_q = cu.view(), .cu_seqlens_k = cu.view()});
}

TEST(SelfAttention, MaskCausalFlagEqualsConfigCausal) {
  Rng rng(54);
  const SelfAttentionConfig config{
      .d_model = 4, .n_heads = 2, .bias = true, .output_projection = true, .causal = false};
  SelfAttentionConfig causal_config = config;
  causal_config.causal = true;
  Rng same_seed_a(55), same_seed_b(55);
  const SelfAttention<double> layer(config, same_seed_a);
  const SelfAttention<double> causal_layer(causal_config, same_seed_b);
  const Tensor<double> x = random_tensor<double>(Shape{2, 5, 4}, rng);
  EXPECT_TRUE(all_close("y", forward(layer, x, {.causal = true, .allowed = std::nullopt, .bias = std::nullopt}),
                        forward(causal_layer, x), 0.0));
}

TEST(SelfAttention, PermutingTokensPermutesOutputs) {
  const int64_t batch = 2, tokens = 7, d = 8;
  for (int64_t heads : {1, 2, 4}) {
    const SelfAttentionConfig config{
        .d_model = d, .n_heads = heads, .bias = true, .output_projection = true, .causal = false};
    SCOPED_TRACE(describe(config));
    Rng rng(60);
    const SelfAttention<double> layer(config, rng);
    const Tensor<double> x = random_tensor<double>(Shape{batch, tokens, d}, rng);
    const std::vector<int64_t> perm = {3, 6, 0, 5, 1, 4, 2};
    const auto permute = [&](const Tensor<double>& t) {
      Tensor<double> result(t.shape());
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < tokens; ++i)
          for (int64_t f = 0; f < d; ++f)
            result[(b * tokens + i) * d + f] = t[(b * tokens + perm[static_cast<size_t>(i)]) * d + f];
      return result;
    };
    const Tensor<double> expected = permute(forward(layer, x));
    EXPECT_TRUE(all_close("y", forward(layer, permute(x)), expected, float64_tolerance(config, tokens, expected)));
  }
}

TEST(SelfAttention, CausalOutputIgnoresLaterTokens) {
  Rng rng(61);
  const SelfAttention<double> layer(
      {.d_model = 8, .n_heads = 2, .bias = true, .output_projection = true, .causal = true}, rng);
  const Tensor<double> x = random_tensor<double>(Shape{1, 6, 8}, rng);
  Tensor<double> changed = x;
  for (int64_t i = 3 * 8; i < changed.numel(); ++i) changed[i] += 1.0;
  const Tensor<double> y = forward(layer, x), y_changed = forward(layer, changed);
  for (int64_t i = 0; i < 3 * 8; ++i) EXPECT_EQ(y[i], y_changed[i]) << "at flat index " << i;
}

TEST(SelfAttention, SingleTokenAttendsToItself) {
  // With one token α = 1, so C = V and y = (x W_Vᵀ + b_V) W_Oᵀ + b_O whatever Q and K are.
  for (int64_t heads : {1, 2}) {
    const SelfAttentionConfig config{
        .d_model = 2, .n_heads = heads, .bias = true, .output_projection = true, .causal = true};
    Rng rng(70);
    const SelfAttention<double> layer(config, rng);
    const ParameterMap p = parameters_of(layer);
    const Tensor<double> x = random_tensor<double>(Shape{3, 1, 2}, rng);
    Tensor<double> expected(x.shape());
    for (int64_t b = 0; b < 3; ++b) {
      double v[2];
      for (int64_t o = 0; o < 2; ++o)
        v[o] = p.at("b_v")[o] + p.at("w_v")[o * 2] * x[b * 2] + p.at("w_v")[o * 2 + 1] * x[b * 2 + 1];
      for (int64_t o = 0; o < 2; ++o)
        expected[b * 2 + o] = p.at("b_o")[o] + p.at("w_o")[o * 2] * v[0] + p.at("w_o")[o * 2 + 1] * v[1];
    }
    EXPECT_TRUE(all_close("y", forward(layer, x), expected, float64_tolerance(config, 1, expected)));
  }
}

TEST(SelfAttention, NoTokens) {
  Rng rng(71);
  const SelfAttentionConfig config{.d_model = 4, .n_heads = 2, .bias = true, .output_projection = true, .causal = true};
  SelfAttention<double> layer(config, rng);
  const Tensor<double> x(Shape{2, 0, 4});
  SelfAttentionCache<double> cache;
  Tensor<double> weights(Shape{2, 2, 0, 0});
  const Tensor<double> y = layer.forward(x.view(), cache, {}, weights.view());
  EXPECT_EQ(y.shape(), x.shape());
  Tensor<double> dx(x.shape());
  layer.backward(cache, Tensor<double>(x.shape()).view(), dx.view());
  for (const auto& [name, grad] : gradients_of(layer))
    EXPECT_TRUE(all_close("d" + name, grad, Tensor<double>(grad.shape()), 0.0));
}

TEST(SelfAttention, UnbatchedInputEqualsBatchOfOne) {
  Rng rng(72);
  SelfAttention<double> layer({.d_model = 6, .n_heads = 3, .bias = true, .output_projection = true, .causal = true},
                              rng);
  const Tensor<double> x = random_tensor<double>(Shape{5, 6}, rng);
  const Tensor<double> dy = random_tensor<double>(Shape{5, 6}, rng);
  const Tensor<double> x3(Shape{1, 5, 6}, x.values());
  const Tensor<double> dy3(Shape{1, 5, 6}, dy.values());

  SelfAttentionCache<double> cache;
  Tensor<double> weights(Shape{3, 5, 5});
  const Tensor<double> y = layer.forward(x.view(), cache, {}, weights.view());
  EXPECT_EQ(y.shape(), x.shape());
  Tensor<double> weights3(Shape{1, 3, 5, 5});
  SelfAttentionCache<double> cache3;
  const Tensor<double> y3 = layer.forward(x3.view(), cache3, {}, weights3.view());
  EXPECT_EQ(y.values(), y3.values());
  EXPECT_EQ(weights.values(), weights3.values());

  const Gradients g = analytic_gradients(layer, x, dy);
  const Gradients g3 = analytic_gradients(layer, x3, dy3);
  EXPECT_EQ(g.dx.values(), g3.dx.values());
  for (const auto& [name, grad] : g3.params) EXPECT_EQ(g.params.at(name).values(), grad.values()) << name;
}

TEST(SelfAttention, BackwardAddsIntoGradients) {
  Rng rng(73);
  SelfAttention<double> layer({.d_model = 4, .n_heads = 2, .bias = true, .output_projection = true, .causal = false},
                              rng);
  const Tensor<double> x = random_tensor<double>(Shape{2, 3, 4}, rng);
  const Tensor<double> dy = random_tensor<double>(x.shape(), rng);
  const Gradients once = analytic_gradients(layer, x, dy);

  SelfAttentionCache<double> cache;
  layer.forward(x.view(), cache);
  Tensor<double> dx(x.shape(), 1.0);
  layer.backward(cache, dy.view(), dx.view());  // the gradients now hold twice the gradient of one pass
  for (const auto& [name, grad] : gradients_of(layer)) {
    Tensor<double> twice = once.params.at(name);
    for (double& e : twice.values()) e *= 2.0;
    EXPECT_TRUE(all_close("d" + name, grad, twice, 0.0));
  }
  Tensor<double> expected_dx = once.dx;
  for (double& e : expected_dx.values()) e += 1.0;
  // dx adds the three projections' parts onto 1 instead of 0: three roundings of partial sums, each
  // at most ½ε·(1 + Σ|parts|); the parts of random inputs are of |dx|'s size, so Σ|parts| ≤ 3·max|dx|
  // up to the cancellation between them, allowed for with another factor 3.
  EXPECT_TRUE(all_close("dx", dx, expected_dx, 1.5 * kEps64 * (1.0 + 9.0 * max_abs(once.dx))));

  layer.zero_grad();
  for (const auto& [name, grad] : gradients_of(layer)) EXPECT_EQ(max_abs(grad), 0.0) << name;
}

TEST(SelfAttention, InitFollowsNnLinear) {
  const SelfAttentionConfig config{
      .d_model = 16, .n_heads = 4, .bias = true, .output_projection = true, .causal = false};
  Rng rng(80);
  const SelfAttention<float> layer(config, rng);
  const double bound = 1.0 / 4.0;
  std::vector<std::string> names;
  Rng replay(80);
  for (const ParameterRef<const float>& p : layer.parameters()) {
    names.push_back(p.name);
    const Shape expected_shape = p.name[0] == 'w' ? Shape{16, 16} : Shape{16};
    EXPECT_EQ(p.value.shape, expected_shape) << p.name;
    EXPECT_EQ(p.grad.shape, expected_shape) << p.name;
    // The parameters are the stream of one Rng, in order, each U(−1/√d_model, 1/√d_model).
    Tensor<float> expected(expected_shape);
    replay.fill_uniform(expected.view(), -bound, bound);
    EXPECT_TRUE(all_close(p.name, to_tensor<float, float>(p.value), expected, 0.0));
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      EXPECT_GE(p.value.data[i], -bound) << p.name;
      EXPECT_LE(p.value.data[i], bound) << p.name;
      EXPECT_EQ(p.grad.data[i], 0.0f) << p.name;
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o"}));

  Rng same(80), different(81);
  EXPECT_EQ(parameters_of(SelfAttention<float>(config, same)).at("w_k").values(),
            parameters_of(layer).at("w_k").values());
  EXPECT_NE(parameters_of(SelfAttention<float>(config, different)).at("w_k").values(),
            parameters_of(layer).at("w_k").values());

  names.clear();
  Rng rng2(82);
  const SelfAttention<double> bare(
      {.d_model = 4, .n_heads = 1, .bias = false, .output_projection = false, .causal = false}, rng2);
  for (const ParameterRef<const double>& p : bare.parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"w_q", "w_k", "w_v"}));
}

TEST(SelfAttention, BadConfigsAreRefused) {
  Rng rng(90);
  EXPECT_TRUE(throws_naming<ValueError>(
      [&] {
        SelfAttention<float>({.d_model = 10, .n_heads = 3, .bias = true, .output_projection = true, .causal = false},
                             rng);
      },
      {"d_model", "n_heads", "10", "3"}));
  EXPECT_TRUE(throws_naming<ValueError>(
      [&] {
        SelfAttention<float>({.d_model = 8, .n_heads = 0, .bias = true, .output_projection = true, .causal = false},
                             rng);
      },
      {"n_heads", "0"}));
  EXPECT_TRUE(throws_naming<ValueError>(
      [&] {
        SelfAttention<float>({.d_model = 8, .n_heads = -2, .bias = true, .output_projection = true, .causal = false},
                             rng);
      },
      {"n_heads", "-2"}));
  EXPECT_TRUE(throws_naming<ValueError>(
      [&] {
        SelfAttention<float>({.d_model = 0, .n_heads = 1, .bias = true, .output_projection = true, .causal = false},
                             rng);
      },
      {"d_model", "0"}));
}

TEST(SelfAttention, BadShapesNameTheArgument) {
  Rng rng(91);
  SelfAttention<double> layer({.d_model = 4, .n_heads = 2, .bias = true, .output_projection = true, .causal = false},
                              rng);
  SelfAttentionCache<double> cache;
  for (const Shape& shape : {Shape{2, 3, 5}, Shape{4}, Shape{1, 2, 3, 4}, Shape{3, 3}}) {
    const Tensor<double> x(shape);
    EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.forward(x.view(), cache); }, {"x:", shape.str(), "4]"}));
  }
  const Tensor<double> x = random_tensor<double>(Shape{2, 3, 4}, rng);
  Tensor<double> weights(Shape{2, 2, 3, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.forward(x.view(), cache, {}, weights.view()); },
                                        {"weights:", "[2, 2, 3, 3]", "[2, 2, 3, 4]"}));
  layer.forward(x.view(), cache);
  Tensor<double> dx(x.shape());
  const Tensor<double> dy_bad(Shape{2, 4, 4});
  EXPECT_TRUE(
      throws_naming<ShapeError>([&] { layer.backward(cache, dy_bad.view(), dx.view()); }, {"dy:", "[2, 3, 4]"}));
  Tensor<double> dx_bad(Shape{3, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { layer.backward(cache, x.view(), dx_bad.view()); }, {"dx:", "[3, 4]"}));
}

}  // namespace
}  // namespace qkv
