// The models that `qkv experiment` trains (apps/qkv/experiments/models.cpp): their hand-written
// backward passes against central finite differences in float64, on L = <dlogits, f(x)>, for the
// input and for every parameter; the float32 and float64 twins agree; training is deterministic.
//
// The models belong to the CLI, not to libqkv, so their source is compiled into this test directly.
#include "models.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include "testing.hpp"

namespace qkv::cli {
namespace {

using qkv::testing::all_close;
using qkv::testing::random_tensor;

constexpr double kStep = 1e-6;

// Central differences in float64 err by about ε·|L|/h (rounding) + h²·|L'''| (truncation); a
// thousand times that leaves room for the constants while still catching any wrong term.
double finite_difference_tolerance(double loss_magnitude) {
  return 1e3 * (std::numeric_limits<double>::epsilon() * std::max(loss_magnitude, 1.0) / kStep + kStep * kStep);
}

double inner(const Tensor<double>& a, const Tensor<double>& b) { return qkv::testing::dot(a, b); }

// Checks dx and every parameter gradient of `reader` against finite differences of
// L(x, θ) = <dlogits, reader(x)>.
void check_reader_gradients(SequenceReader<double>& reader, Tensor<double> x, int64_t classes, Rng& rng) {
  const int64_t batch = x.shape()[0];
  const Tensor<double> dlogits = random_tensor<double>(Shape{batch, classes}, rng);
  const auto loss = [&] { return inner(dlogits, reader.forward(x.cview())); };
  const double magnitude = std::abs(loss());

  for (ParameterRef<double>& p : reader.parameters()) {
    for (int64_t i = 0; i < p.grad.numel(); ++i) p.grad.data[i] = 0.0;
  }
  reader.forward(x.cview());
  Tensor<double> dx(x.shape());
  reader.backward(dlogits.cview(), dx.view());

  const Tensor<double> numeric_dx = qkv::testing::numeric_gradient(loss, x, kStep);
  EXPECT_TRUE(all_close("dx", dx, numeric_dx, finite_difference_tolerance(magnitude)));
  for (ParameterRef<double>& p : reader.parameters()) {
    Tensor<double> analytic(p.grad.shape), numeric(p.value.shape);
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      analytic[i] = p.grad.data[i];
      const double saved = p.value.data[i];
      p.value.data[i] = saved + kStep;
      const double up = loss();
      p.value.data[i] = saved - kStep;
      const double down = loss();
      p.value.data[i] = saved;
      numeric[i] = (up - down) / (2.0 * kStep);
    }
    EXPECT_TRUE(all_close(p.name, analytic, numeric, finite_difference_tolerance(magnitude)));
  }
}

struct ReaderCase {
  int64_t batch, length, dim, classes;
};

class ExperimentAttentionReader : public ::testing::TestWithParam<ReaderCase> {};

TEST_P(ExperimentAttentionReader, GradientsMatchFiniteDifferences) {
  const ReaderCase c = GetParam();
  Rng rng(11);
  // A scale other than 1/√D: the unscaled variant of `scaling` relies on the scale reaching both passes.
  for (const double scale : {1.0 / std::sqrt(static_cast<double>(c.dim)), 1.0}) {
    SCOPED_TRACE(::testing::Message() << "scale " << scale);
    AttentionReader<double> reader({.dim = c.dim, .classes = c.classes, .scale = scale}, rng);
    check_reader_gradients(reader, random_tensor<double>(Shape{c.batch, c.length, c.dim}, rng), c.classes, rng);
  }
}

// T = 1 (the query attends to itself only), D = 1, odd sizes.
INSTANTIATE_TEST_SUITE_P(Shapes, ExperimentAttentionReader,
                         ::testing::Values(ReaderCase{2, 5, 4, 3}, ReaderCase{1, 1, 3, 2}, ReaderCase{3, 7, 1, 4},
                                           ReaderCase{2, 13, 5, 3}));

class ExperimentGruReader : public ::testing::TestWithParam<ReaderCase> {};

TEST_P(ExperimentGruReader, GradientsMatchFiniteDifferences) {
  const ReaderCase c = GetParam();
  Rng rng(12);
  GruReader<double> reader({.dim = c.dim, .hidden = c.dim + 1, .classes = c.classes}, rng);
  check_reader_gradients(reader, random_tensor<double>(Shape{c.batch, c.length, c.dim}, rng), c.classes, rng);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ExperimentGruReader,
                         ::testing::Values(ReaderCase{2, 5, 4, 3}, ReaderCase{1, 1, 3, 2}, ReaderCase{3, 7, 1, 4}));

TEST(ExperimentPairEmbedding, SumsTwoRowsAndSendsTheGradientToBoth) {
  Rng rng(13);
  PairEmbedding<double> embedding(5, 3, rng);
  Tensor<int64_t> ids(Shape{1, 2, 2}, {1, 4, 2, 2});
  const Tensor<double> x = embedding.forward(ids.cview());
  const TensorView<double> table = embedding.parameters()[0].value;
  for (int64_t j = 0; j < 3; ++j) {
    EXPECT_EQ(x[j], table(1, j) + table(4, j));
    EXPECT_EQ(x[3 + j], 2.0 * table(2, j));
  }
  Tensor<double> dx(x.shape(), {1, 2, 3, 4, 5, 6});
  embedding.backward(dx.cview());
  const TensorView<double> grad = embedding.parameters()[0].grad;
  for (int64_t j = 0; j < 3; ++j) {
    EXPECT_EQ(grad(1, j), dx[j]);
    EXPECT_EQ(grad(4, j), dx[j]);
    EXPECT_EQ(grad(2, j), 2.0 * dx[3 + j]);  // the same id twice at one position collects both
    EXPECT_EQ(grad(0, j), 0.0);
  }
}

Batch small_batch(Rng& rng) {
  Batch batch{Tensor<int64_t>(Shape{4, 6, 2}), Tensor<int64_t>(Shape{4})};
  for (int64_t i = 0; i < batch.ids.numel(); ++i) batch.ids[i] = static_cast<int64_t>(rng.next_u64() % 7);
  for (int64_t i = 0; i < batch.targets.numel(); ++i) batch.targets[i] = static_cast<int64_t>(rng.next_u64() % 3);
  return batch;
}

template <class Scalar>
std::unique_ptr<Classifier<Scalar>> attention_classifier(uint64_t seed) {
  Rng rng(seed);
  PairEmbedding<Scalar> embedding(7, 4, rng);
  auto reader =
      std::make_unique<AttentionReader<Scalar>>(AttentionReaderConfig{.dim = 4, .classes = 3, .scale = 0.5}, rng);
  return std::make_unique<Classifier<Scalar>>(std::move(embedding), std::move(reader), AdamConfig{.lr = 1e-2});
}

TEST(ExperimentClassifier, TrainingIsDeterministicAndLowersTheLoss) {
  Rng data(14);
  const Batch batch = small_batch(data);
  auto a = attention_classifier<float>(3);
  auto b = attention_classifier<float>(3);
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 50; ++step) {
    const double loss_a = a->train_step(batch);
    EXPECT_EQ(loss_a, b->train_step(batch)) << "step " << step;
    if (step == 0) first = loss_a;
    last = loss_a;
  }
  EXPECT_LT(last, first);
}

TEST(ExperimentClassifier, Float32AndFloat64TwinsAgree) {
  // The float64 twin measures gradients in `long-range`: it must be the same model as the float32 one.
  Rng data(15);
  const Batch batch = small_batch(data);
  const Tensor<float> g32 = attention_classifier<float>(4)->input_gradient(batch);
  const Tensor<double> g64 = attention_classifier<double>(4)->input_gradient(batch);
  double magnitude = 0.0;
  for (int64_t i = 0; i < g64.numel(); ++i) magnitude = std::max(magnitude, std::abs(g64[i]));
  // float32 rounding of inputs, weights and every intermediate, amplified by a few layers.
  const double tolerance = 1e3 * std::numeric_limits<float>::epsilon() * std::max(magnitude, 1e-3);
  EXPECT_TRUE(all_close("dx", qkv::testing::cast<double>(g32), g64, tolerance));
}

TEST(ExperimentClassifier, InputGradientLeavesTheParametersAlone) {
  Rng data(16);
  const Batch batch = small_batch(data);
  auto model = attention_classifier<double>(5);
  const auto before = model->evaluate(batch);
  model->input_gradient(batch);
  const auto after = model->evaluate(batch);
  EXPECT_EQ(before.loss, after.loss);
  EXPECT_EQ(before.accuracy, after.accuracy);
}

}  // namespace
}  // namespace qkv::cli
