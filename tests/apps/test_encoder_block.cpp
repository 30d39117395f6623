// The encoder block and model of apps/qkv/experiments/encoder.hpp: float64 central finite
// differences of L = <dY, f(X)> against the hand-written backward, end to end (input and every
// parameter), with and without the causal mask and a key-padding mask; the value-drop measurement
// leaves the rows that cannot see the dropped token unchanged; bad configs are refused. Also the
// GRU language model of apps/qkv/experiments/encoder_lm.cpp (embedding → GRU → linear head), whose
// attention twin is the causal EncoderModel: the same finite-difference check, for every parameter.

#include "encoder.hpp"
#include "experiments.hpp"
#include "language_models.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "testing.hpp"

namespace qkv::cli {
namespace {

using testing::all_close;
using testing::numeric_gradient;
using testing::random_tensor;

constexpr double kEps64 = std::numeric_limits<double>::epsilon();
constexpr double kStep = 1e-6;

double dot(const Tensor<double>& a, const Tensor<double>& b) {
  double s = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences lose about (rounding of L) / step: L sums `terms` products, each carried
// through a network of `depth` layers of `width`-term dot products, so its rounding is about
// eps · terms · depth · width · max|dy·y|. Truncation, step² · f''', is far below that at step 1e-6.
double fd_tolerance(const Tensor<double>& dy, const Tensor<double>& y, int64_t depth, int64_t width) {
  double scale = 1.0;
  for (int64_t i = 0; i < y.numel(); ++i) scale = std::max(scale, std::abs(dy[i] * y[i]));
  return kEps64 * static_cast<double>(y.numel() * depth * width) * scale / kStep;
}

Tensor<double> copy_of(TensorView<double> v) {
  Tensor<double> t(v.shape);
  for (int64_t i = 0; i < t.numel(); ++i) t[i] = v.data[i];
  return t;
}

void put(const Tensor<double>& t, TensorView<double> v) {
  for (int64_t i = 0; i < t.numel(); ++i) v.data[i] = t[i];
}

// Checks every parameter's gradient of `loss` (which runs a forward) against `analytic`, the
// gradients the backward left, copied in parameter order.
void check_parameters(std::vector<ParameterRef<double>> params, const std::vector<Tensor<double>>& analytic,
                      const std::function<double()>& loss, double tolerance) {
  for (size_t n = 0; n < params.size(); ++n) {
    Tensor<double> value = copy_of(params[n].value);
    const auto loss_of_parameter = [&] {
      put(value, params[n].value);
      return loss();
    };
    const Tensor<double> numeric = numeric_gradient(loss_of_parameter, value, kStep);
    put(value, params[n].value);
    EXPECT_TRUE(all_close("d" + params[n].name, analytic[n], numeric, tolerance));
  }
}

struct Case {
  int64_t batch, length, dim, heads, ffn;
  bool causal, padding;
};

class EncoderBlockGradient : public ::testing::TestWithParam<Case> {};

TEST_P(EncoderBlockGradient, MatchesFiniteDifferences) {
  const Case c = GetParam();
  Rng rng(7);
  EncoderBlock<double> block({.dim = c.dim, .heads = c.heads, .ffn = c.ffn, .causal = c.causal}, rng);
  Tensor<double> x = random_tensor<double>(Shape{c.batch, c.length, c.dim}, rng);
  // Padding hides the last key of every sequence but the first (never a whole row under causal).
  Tensor<uint8_t> allowed(Shape{c.batch, 1, 1, c.length}, 1);
  if (c.padding && c.length > 1) {
    for (int64_t b = 1; b < c.batch; ++b) allowed[b * c.length + c.length - 1] = 0;
  }
  AttentionMask<double> mask;
  if (c.padding) mask.allowed = allowed.cview();
  const Tensor<double> dy = random_tensor<double>(Shape{c.batch, c.length, c.dim}, rng);

  const Tensor<double> y = block.forward(x.cview(), mask);
  Tensor<double> dx(x.shape());
  block.zero_grad();
  block.backward(dy.cview(), dx.view());
  std::vector<Tensor<double>> analytic;
  for (const ParameterRef<double>& p : block.parameters()) analytic.push_back(copy_of(p.grad));
  for (double g : dx.values()) ASSERT_TRUE(std::isfinite(g));

  const auto loss = [&] { return dot(dy, block.forward(x.cview(), mask)); };
  const double tolerance = fd_tolerance(dy, y, 4, std::max(c.dim, c.ffn));
  EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x, kStep), tolerance));
  check_parameters(block.parameters(), analytic, loss, tolerance);
}

INSTANTIATE_TEST_SUITE_P(Shapes, EncoderBlockGradient,
                         ::testing::Values(Case{2, 3, 4, 2, 5, false, false}, Case{2, 4, 4, 2, 3, true, false},
                                           Case{3, 3, 6, 3, 7, false, true}, Case{1, 1, 2, 1, 1, true, false},
                                           Case{2, 5, 1, 1, 2, false, true}),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           const Case& c = param_info.param;
                           return fmt::format("B{}_T{}_D{}_H{}_F{}{}{}", c.batch, c.length, c.dim, c.heads, c.ffn,
                                              c.causal ? "_causal" : "", c.padding ? "_padding" : "");
                         });

TEST(EncoderModel, GradientMatchesFiniteDifferences) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "bidirectional");
    Rng rng(11);
    EncoderModelConfig config{.vocabulary = 5,
                              .classes = 3,
                              .max_length = 6,
                              .layers = 2,
                              .block = {.dim = 4, .heads = 2, .ffn = 6, .causal = causal}};
    EncoderModel<double> model(config, rng);
    Tensor<int64_t> ids(Shape{2, 4}, std::vector<int64_t>{0, 3, 1, 3, 4, 2, 2, 0});
    const Tensor<double> dlogits = random_tensor<double>(Shape{2, 4, 3}, rng);
    const Tensor<double> logits = model.forward(ids.cview());
    model.zero_grad();
    model.backward(dlogits.cview());
    std::vector<Tensor<double>> analytic;
    for (const ParameterRef<double>& p : model.parameters()) analytic.push_back(copy_of(p.grad));
    const auto loss = [&] { return dot(dlogits, model.forward(ids.cview())); };
    check_parameters(model.parameters(), analytic, loss, fd_tolerance(dlogits, logits, 10, 6));
  }
}

TEST(GruLanguageModel, GradientMatchesFiniteDifferences) {
  constexpr int64_t kVocabulary = 5, kEmbed = 3, kHidden = 4, kBatch = 2, kLength = 4;
  Rng rng(13);
  GruLm<double> model(kVocabulary, kEmbed, kHidden, rng);
  // Token 1 appears twice in one window and token 3 in both: the embedding's scatter must add.
  const Tensor<int64_t> ids(Shape{kBatch, kLength}, std::vector<int64_t>{0, 3, 1, 1, 4, 2, 3, 0});
  const Tensor<double> dlogits = random_tensor<double>(Shape{kBatch, kLength, kVocabulary}, rng);
  const Tensor<double> logits = model.forward(ids);
  ASSERT_EQ(logits.shape(), (Shape{kBatch, kLength, kVocabulary}));
  for (const ParameterRef<double>& p : model.parameters()) {
    for (int64_t i = 0; i < p.grad.shape.numel(); ++i) p.grad.data[i] = 0.0;
  }
  model.backward(dlogits);
  std::vector<Tensor<double>> analytic;
  for (const ParameterRef<double>& p : model.parameters()) analytic.push_back(copy_of(p.grad));
  const auto loss = [&] { return dot(dlogits, model.forward(ids)); };
  // Depth: the embedding, kLength recurrent steps and the head.
  check_parameters(model.parameters(), analytic, loss, fd_tolerance(dlogits, logits, kLength + 2, kHidden));
}

TEST(EncoderBlock, DroppingAValueChangesOnlyTheRowsThatSeeIt) {
  Rng rng(3);
  EncoderBlock<double> block({.dim = 4, .heads = 2, .ffn = 5, .causal = true}, rng);
  const Tensor<double> x = random_tensor<double>(Shape{2, 5, 4}, rng);
  const Tensor<double> y = block.forward(x.cview());
  const std::vector<int64_t> none{-1, -1};
  const double exact = 64 * kEps64 * 4 * 5;
  EXPECT_TRUE(all_close("no drop", block.forward(x.cview(), {}, std::nullopt, none), y, exact));
  const std::vector<int64_t> drop{2, -1};
  const Tensor<double> dropped = block.forward(x.cview(), {}, std::nullopt, drop);
  double changed_before = 0.0, changed_at = 0.0;
  for (int64_t t = 0; t < 5; ++t) {
    for (int64_t e = 0; e < 4; ++e) {
      const double d0 = std::abs(dropped[t * 4 + e] - y[t * 4 + e]);
      if (t < 2) changed_before = std::max(changed_before, d0);
      if (t == 2) changed_at = std::max(changed_at, d0);
      EXPECT_NEAR(dropped[20 + t * 4 + e], y[20 + t * 4 + e], exact) << "sequence 1 dropped nothing";
    }
  }
  EXPECT_LE(changed_before, exact);
  EXPECT_GT(changed_at, 1e3 * exact);
}

TEST(EncoderBlock, RefusesBadConfigs) {
  Rng rng(1);
  EXPECT_THROW(EncoderBlock<float>({.dim = 6, .heads = 4, .ffn = 4}, rng), ValueError);
  EXPECT_THROW(EncoderBlock<float>({.dim = 4, .heads = 2, .ffn = 0}, rng), ValueError);
  EncoderBlock<float> block({.dim = 4, .heads = 2, .ffn = 4}, rng);
  const Tensor<float> x(Shape{1, 3, 5});
  EXPECT_THROW(block.forward(x.cview()), ShapeError);
}

}  // namespace
}  // namespace qkv::cli
