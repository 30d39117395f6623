// The encoder-decoder of `qkv experiment alignment` (apps/qkv/experiments/seq2seq.cpp) and its
// synthetic language (toy_translation.cpp):
//   - the additive decoder attention, with its keys precomputed, against the library's reference
//     additive_attention_forward/backward in float64;
//   - central finite differences in float64 of the decoder step end to end (attention, GRU cell,
//     readout) for each scoring, on L = <dlogits, logits_i> + <ds, s_i>, with respect to the input,
//     the state, the encoder memory and every parameter; then of the whole teacher-forced model;
//   - properties: α rows are distributions over the source words only, a sentence's outputs do not
//     depend on its batch, greedy decoding agrees with teacher forcing on its own output, training
//     lowers the loss deterministically, a model survives its model file bit for bit and a
//     mismatched file is refused;
//   - the toy language: parallel lexicons, the gold alignment is a permutation, the reorderings hold.
//
// The models belong to the CLI, not to libqkv, so their sources are compiled into this test directly.
#include "seq2seq.hpp"
#include "toy_translation.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <string>

#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/ops/additive_attention.hpp"
#include "testing.hpp"

namespace qkv::cli {

// gtest names a failing case by this, not by the enum's bytes (found by argument-dependent lookup,
// so it lives in Score's namespace).
void PrintTo(Score score, std::ostream* os) {  // NOLINT(readability-identifier-naming): gtest looks it up by name
  *os << score_name(score);
}

namespace {

using qkv::testing::all_close;
using qkv::testing::numeric_gradient;
using qkv::testing::random_tensor;
using qkv::testing::throws_naming;

constexpr double kStep = 1e-6;
constexpr double kEps = std::numeric_limits<double>::epsilon();

// Central differences in float64 err by about ε·|L|/h (rounding) + h²·|L'''| (truncation); a
// thousand times that leaves room for the constants while still catching any wrong term.
double finite_difference_tolerance(double loss_magnitude) {
  return 1e3 * (kEps * std::max(loss_magnitude, 1.0) / kStep + kStep * kStep);
}

double inner(const Tensor<double>& a, const Tensor<double>& b) { return qkv::testing::dot(a, b); }

// Every parameter's accumulated gradient against central differences of `loss`.
void expect_parameter_gradients(Seq2Seq<double>& model, const std::function<double()>& loss, double tolerance) {
  for (const ParameterRef<double>& p : model.parameters()) {
    const Tensor<double> analytic = to_tensor<double, double>(p.grad);
    EXPECT_TRUE(all_close(p.name, analytic, numeric_gradient(loss, p.value, kStep), tolerance));
  }
}

Seq2SeqConfig tiny_config(Score score) {
  return {.source_vocabulary = 7,
          .target_vocabulary = 8,
          .embedding = 3,
          .encoder_hidden = 2,
          .decoder_hidden = 3,
          .attention_hidden = 2,
          .score = score};
}

// Three sentences of different lengths, one of a single word.
Seq2SeqBatch tiny_batch() {
  return make_seq2seq_batch({{3, 4, 5}, {6}, {4, 4, 3, 5}}, {{3, 7, 4}, {5}, {6, 3, 4, 5, 7}});
}

// A memory built by hand: random annotations and summary for sentences of `lengths` words.
EncoderMemory<double> random_memory(const Seq2Seq<double>& model, const std::vector<int64_t>& lengths, int64_t ts,
                                    Rng& rng) {
  const auto batch = static_cast<int64_t>(lengths.size());
  const int64_t width = 2 * model.config().encoder_hidden;
  EncoderMemory<double> memory;
  memory.annotations = random_tensor<double>(Shape{batch, ts, width}, rng);
  memory.summary = random_tensor<double>(Shape{batch, width}, rng);
  memory.lengths = lengths;
  memory.allowed = Tensor<uint8_t>(Shape{batch, 1, 1, ts});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < lengths[static_cast<size_t>(b)]; ++j) memory.allowed[b * ts + j] = 1;
  }
  model.attention().prepare(memory);
  return memory;
}

EncoderMemoryGradients<double> zero_gradients(const EncoderMemory<double>& memory) {
  return {.annotations = Tensor<double>(memory.annotations.shape()),
          .keys = Tensor<double>(memory.keys.shape()),
          .summary = Tensor<double>(memory.summary.shape())};
}

class ScoreTest : public ::testing::TestWithParam<Score> {};

TEST_P(ScoreTest, DecoderStepMatchesFiniteDifferences) {
  Rng rng(5);
  Seq2Seq<double> model(tiny_config(GetParam()), rng);
  const std::vector<int64_t> lengths = {3, 1, 4};
  EncoderMemory<double> memory = random_memory(model, lengths, 4, rng);
  const int64_t batch = 3, e = model.config().embedding, hd = model.config().decoder_hidden;
  Tensor<double> x = random_tensor<double>(Shape{batch, e}, rng);
  Tensor<double> s = random_tensor<double>(Shape{batch, hd}, rng, 0.5);
  const Tensor<double> dlogits = random_tensor<double>(Shape{batch, model.config().target_vocabulary}, rng);
  const Tensor<double> ds_next = random_tensor<double>(Shape{batch, hd}, rng);

  const auto loss = [&] {
    model.attention().prepare(memory);  // the keys follow the annotations
    DecoderStepCache<double> cache;
    const DecoderStepOutputs<double> out = model.step_forward(memory, x.cview(), s.cview(), cache);
    return inner(dlogits, out.logits) + inner(ds_next, out.state);
  };
  const double tolerance = finite_difference_tolerance(std::abs(loss()));

  model.zero_grad();
  DecoderStepCache<double> cache;
  model.step_forward(memory, x.cview(), s.cview(), cache);
  Tensor<double> dx(x.shape()), ds(s.shape());
  EncoderMemoryGradients<double> dmemory = zero_gradients(memory);
  model.step_backward(memory, cache, dlogits.cview(), ds_next.cview(), dx.view(), ds.view(), dmemory);
  model.attention().prepare_backward(memory, dmemory);

  EXPECT_TRUE(all_close("dx", dx, numeric_gradient(loss, x.view(), kStep), tolerance));
  EXPECT_TRUE(all_close("ds", ds, numeric_gradient(loss, s.view(), kStep), tolerance));
  EXPECT_TRUE(all_close("dannotations", dmemory.annotations, numeric_gradient(loss, memory.annotations.view(), kStep),
                        tolerance));
  EXPECT_TRUE(all_close("dsummary", dmemory.summary, numeric_gradient(loss, memory.summary.view(), kStep), tolerance));
  expect_parameter_gradients(model, loss, tolerance);
}

TEST_P(ScoreTest, TeacherForcedModelMatchesFiniteDifferences) {
  Rng rng(9);
  Seq2Seq<double> model(tiny_config(GetParam()), rng);
  const Seq2SeqBatch batch = tiny_batch();
  const Tensor<double> dlogits = random_tensor<double>(model.forward(batch).shape(), rng);
  const auto loss = [&] { return inner(dlogits, model.forward(batch)); };
  const double tolerance = finite_difference_tolerance(std::abs(loss()));
  model.zero_grad();
  model.forward(batch);
  model.backward(dlogits.cview());
  expect_parameter_gradients(model, loss, tolerance);
}

TEST_P(ScoreTest, AlphaRowsAreDistributionsOverTheSourceOnly) {
  Rng rng(2);
  Seq2Seq<double> model(tiny_config(GetParam()), rng);
  const Seq2SeqBatch batch = tiny_batch();
  model.forward(batch);
  const Tensor<double>& alpha = model.attention_weights();
  const int64_t tt = alpha.shape()[1], ts = alpha.shape()[2];
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t len = batch.source_lengths[b];
    for (int64_t i = 0; i < tt; ++i) {
      double sum = 0.0;
      for (int64_t j = 0; j < ts; ++j) {
        const double a = alpha[(b * tt + i) * ts + j];
        EXPECT_GE(a, 0.0);
        if (j >= len) {
          EXPECT_EQ(a, 0.0) << "padding position " << j << " of sentence " << b;
        }
        sum += a;
      }
      // Softmax of len terms in float64: the sum is 1 within len rounding errors.
      EXPECT_NEAR(sum, GetParam() == Score::none ? 0.0 : 1.0, 4.0 * static_cast<double>(ts) * kEps);
    }
  }
}

TEST_P(ScoreTest, ASentenceDoesNotDependOnItsBatch) {
  Rng rng(4);
  Seq2Seq<double> model(tiny_config(GetParam()), rng);
  const std::vector<std::vector<int64_t>> sources = {{3, 4, 5}, {6}, {4, 4, 3, 5}};
  const std::vector<std::vector<int64_t>> targets = {{3, 7, 4}, {5}, {6, 3, 4, 5, 7}};
  const Tensor<double> together = model.forward(make_seq2seq_batch(sources, targets));
  const int64_t tt = together.shape()[1], vt = together.shape()[2];
  for (size_t b = 0; b < sources.size(); ++b) {
    const Tensor<double> alone = model.forward(make_seq2seq_batch({sources[b]}, {targets[b]}));
    const int64_t steps = alone.shape()[1];
    Tensor<double> part(alone.shape());
    for (int64_t k = 0; k < steps * vt; ++k) part[k] = together[static_cast<int64_t>(b) * tt * vt + k];
    // Every sum runs over the same terms in the same order, whatever the padding around it.
    EXPECT_TRUE(all_close(fmt::format("sentence {}", b), alone, part, 0.0));
  }
}

TEST_P(ScoreTest, GreedyDecodingAgreesWithTeacherForcingOnItsOwnOutput) {
  Rng rng(8);
  Seq2Seq<double> model(tiny_config(GetParam()), rng);
  const std::vector<std::vector<int64_t>> sources = {{3, 4, 5}, {6}, {4, 4, 3, 5}};
  const std::vector<GreedyTranslation<double>> greedy = model.greedy_decode(sources, 6);
  for (size_t b = 0; b < sources.size(); ++b) {
    const GreedyTranslation<double>& g = greedy[b];
    ASSERT_EQ(g.alpha.shape()[0], static_cast<int64_t>(g.tokens.size()) + (g.finished ? 1 : 0));
    ASSERT_EQ(g.alpha.shape()[1], static_cast<int64_t>(sources[b].size()));
    if (g.tokens.empty()) continue;
    const Tensor<double> logits = model.forward(make_seq2seq_batch({sources[b]}, {g.tokens}));
    const int64_t vt = logits.shape()[2];
    for (size_t i = 0; i < g.tokens.size(); ++i) {
      const double* row = logits.data() + static_cast<int64_t>(i) * vt;
      EXPECT_EQ(std::max_element(row + kEosId, row + vt) - row, g.tokens[i]) << "sentence " << b << " step " << i;
      for (int64_t j = 0; j < g.alpha.shape()[1]; ++j) {
        EXPECT_EQ(g.alpha[static_cast<int64_t>(i) * g.alpha.shape()[1] + j],
                  model.attention_weights()[static_cast<int64_t>(i) * g.alpha.shape()[1] + j]);
      }
    }
  }
}

TEST_P(ScoreTest, TrainingLowersTheLossDeterministically) {
  const TranslationSplits data = make_translation_splits(1, 32, 0, 0);
  std::vector<std::vector<int64_t>> sources, targets;
  for (const SentencePair& p : data.train) {
    sources.push_back(p.source);
    targets.push_back(p.target);
  }
  const Seq2SeqBatch batch = make_seq2seq_batch(sources, targets);
  const ToyLanguage& language = toy_language();
  // One thread, as the experiment trains: products this small gain nothing from a second one, and
  // on a shared machine its barriers cost seconds. Results do not depend on the count.
  const int workers = max_workers();
  set_max_workers(1);
  const auto run = [&] {
    Rng rng(3);
    Seq2Seq<float> model({.source_vocabulary = language.source.size(),
                          .target_vocabulary = language.target.size(),
                          .embedding = 8,
                          .encoder_hidden = 8,
                          .decoder_hidden = 16,
                          .attention_hidden = 8,
                          .score = GetParam()},
                         rng);
    Adam<float> adam(model.parameters(), {.lr = 1e-2, .max_grad_norm = 1.0});
    std::vector<double> losses;
    for (int step = 0; step < 25; ++step) {
      losses.push_back(seq2seq_loss_and_gradients(model, batch));
      adam.step();
    }
    return losses;
  };
  const std::vector<double> first = run();
  const std::vector<double> second = run();
  set_max_workers(workers);
  EXPECT_LT(first.back(), 0.7 * first.front());
  EXPECT_EQ(first, second);
}

TEST_P(ScoreTest, ModelFileRoundTripGivesTheSameModel) {
  const ToyLanguage& language = toy_language();
  Rng rng(6);
  Seq2Seq<float> model({.source_vocabulary = language.source.size(),
                        .target_vocabulary = language.target.size(),
                        .embedding = 4,
                        .encoder_hidden = 3,
                        .decoder_hidden = 5,
                        .attention_hidden = 2,
                        .score = GetParam()},
                       rng);
  const ModelFile file =
      decode_model_file(encode_model_file(to_model_file(model, language.source, language.target, "test")), "m.qkvm");
  TranslationModel back = translation_model_from_file(file);
  EXPECT_EQ(back.model.config().score, GetParam());
  EXPECT_EQ(back.source.joined(), language.source.joined());
  EXPECT_EQ(back.target.joined(), language.target.joined());
  const Seq2SeqBatch batch = make_seq2seq_batch({{3, 9, 12, 4}}, {{5, 6, 7, 8}});
  const Tensor<float> expected = model.forward(batch);
  EXPECT_TRUE(all_close("logits", back.model.forward(batch), expected, 0.0));
}

INSTANTIATE_TEST_SUITE_P(Scores, ScoreTest, ::testing::Values(Score::additive, Score::scaled_dot, Score::none),
                         [](const ::testing::TestParamInfo<Score>& param) {
                           return std::string(score_name(param.param));
                         });

TEST(DecoderAttention, AdditiveMatchesTheLibraryReference) {
  // Odd sizes, one sentence of one word, one using every position.
  const int64_t batch = 3, ts = 5, hd = 7, width = 6, hidden = 4;
  Rng rng(12);
  DecoderAttention<double> attention(Score::additive, hd, width, hidden, rng);
  EncoderMemory<double> memory;
  memory.annotations = random_tensor<double>(Shape{batch, ts, width}, rng);
  memory.lengths = {5, 1, 3};
  memory.allowed = Tensor<uint8_t>(Shape{batch, 1, 1, ts});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < memory.lengths[static_cast<size_t>(b)]; ++j) memory.allowed[b * ts + j] = 1;
  }
  attention.prepare(memory);
  const Tensor<double> s = random_tensor<double>(Shape{batch, hd}, rng);
  AttentionStepCache<double> cache;
  Tensor<double> context(Shape{batch, width});
  attention.forward(memory, s.cview(), cache, context.view());

  const std::vector<ParameterRef<double>> params = attention.parameters();  // w_q, w_k, w
  const TensorView<const double> keys = as_b1td(memory.annotations.cview());
  AdditiveAttentionParams<double> reference{.q = as_b11d(s.cview()),
                                            .k = keys,
                                            .v = keys,
                                            .w_q = params[0].value,
                                            .w_k = params[1].value,
                                            .w = params[2].value,
                                            .mask = {}};
  reference.mask.allowed = memory.allowed.cview();
  Tensor<double> out(Shape{batch, 1, 1, width}), weights(Shape{batch, 1, 1, ts});
  additive_attention_forward<double>(reference, {.out = out.view(), .weights = weights.view(), .lse = std::nullopt});
  // Both sum A·Dk products and Tk weighted values in float64, in different orders.
  const double tolerance = 8.0 * static_cast<double>(hidden * width + ts) * kEps;
  EXPECT_TRUE(all_close("context", context, Tensor<double>(Shape{batch, width}, out.values()), tolerance));
  EXPECT_TRUE(all_close("alpha", cache.alpha, Tensor<double>(Shape{batch, ts}, weights.values()), tolerance));

  const Tensor<double> dcontext = random_tensor<double>(Shape{batch, width}, rng);
  Tensor<double> ds(s.shape());
  EncoderMemoryGradients<double> dmemory{.annotations = Tensor<double>(memory.annotations.shape()),
                                         .keys = Tensor<double>(memory.keys.shape()),
                                         .summary = Tensor<double>()};
  attention.zero_grad();
  attention.backward(memory, cache, dcontext.cview(), ds.view(), dmemory);
  attention.prepare_backward(memory, dmemory);

  Tensor<double> dq(Shape{batch, 1, 1, hd}), dk(Shape{batch, 1, ts, width}), dv(Shape{batch, 1, ts, width});
  Tensor<double> dw_q(params[0].value.shape), dw_k(params[1].value.shape), dw(params[2].value.shape);
  additive_attention_backward<double>(reference, as_b11d(dcontext.cview()),
                                      {.dq = dq.view(),
                                       .dk = dk.view(),
                                       .dv = dv.view(),
                                       .dw_q = dw_q.view(),
                                       .dw_k = dw_k.view(),
                                       .dw = dw.view(),
                                       .dbias = std::nullopt});
  Tensor<double> dannotations(memory.annotations.shape());
  for (int64_t k = 0; k < dannotations.numel(); ++k) dannotations[k] = dk[k] + dv[k];
  const double backward_tolerance = 8.0 * static_cast<double>(batch * ts * hidden * width) * kEps;
  EXPECT_TRUE(all_close("ds", ds, Tensor<double>(s.shape(), dq.values()), backward_tolerance));
  EXPECT_TRUE(all_close("dannotations", dmemory.annotations, dannotations, backward_tolerance));
  EXPECT_TRUE(all_close("dw_q", to_tensor<double, double>(params[0].grad), dw_q, backward_tolerance));
  EXPECT_TRUE(all_close("dw_k", to_tensor<double, double>(params[1].grad), dw_k, backward_tolerance));
  EXPECT_TRUE(all_close("dw", to_tensor<double, double>(params[2].grad), dw, backward_tolerance));
}

TEST(Seq2Seq, RefusesBadConfigsAndBatches) {
  Rng rng(1);
  Seq2SeqConfig config = tiny_config(Score::additive);
  config.decoder_hidden = 0;
  EXPECT_TRUE(throws_naming<ValueError>([&] { Seq2Seq<double> refused(config, rng); }, {"decoder_hidden", "got 0"}));
  config = tiny_config(Score::additive);
  config.target_vocabulary = 3;
  EXPECT_TRUE(throws_naming<ValueError>([&] { Seq2Seq<double> refused(config, rng); }, {"target_vocabulary", "got 3"}));
  EXPECT_TRUE(throws_naming<ValueError>(
      [] {
        make_seq2seq_batch({{3}, {}}, {{3}, {4}});
      },
      {"sources", "sentence 1", "empty"}));
  EXPECT_TRUE(throws_naming<ValueError>(
      [] {
        make_seq2seq_batch({{3}}, {{3}, {4}});
      },
      {"targets", "expected 1", "got 2"}));
  EXPECT_TRUE(throws_naming<ValueError>([] { make_seq2seq_batch({}, {}); }, {"sources", "none"}));
  Seq2Seq<double> model(tiny_config(Score::additive), rng);
  EXPECT_TRUE(throws_naming<ValueError>([&] { model.greedy_decode({{3}}, 0); }, {"max_steps", "got 0"}));
}

TEST(Seq2Seq, ModelFilesThatDoNotFitAreRefused) {
  const ToyLanguage& language = toy_language();
  Rng rng(6);
  Seq2Seq<float> model({.source_vocabulary = language.source.size(),
                        .target_vocabulary = language.target.size(),
                        .embedding = 4,
                        .encoder_hidden = 3,
                        .decoder_hidden = 5,
                        .attention_hidden = 2,
                        .score = Score::additive},
                       rng);
  const ModelFile good = to_model_file(model, language.source, language.target, "test");

  ModelFile other = good;
  other.source = "x.qkvm";
  other.set("decoder_hidden", "6");
  EXPECT_TRUE(throws_naming<IoError>([&] { translation_model_from_file(other); },
                                     {"x.qkvm", "tensor \"init.weight\"", "expected shape [6, 6]", "got [5, 6]"}));
  other = good;
  other.source = "x.qkvm";
  other.set("score", "dot");
  EXPECT_TRUE(throws_naming<IoError>([&] { translation_model_from_file(other); }, {"x.qkvm", "attention"}));
  other = good;
  other.source = "x.qkvm";
  other.set("score", "cosine");
  EXPECT_TRUE(throws_naming<IoError>([&] { translation_model_from_file(other); }, {"x.qkvm", "\"score\"", "cosine"}));
  other = good;
  other.source = "x.qkvm";
  other.set("source_vocabulary", "the dog");
  EXPECT_TRUE(throws_naming<IoError>([&] { translation_model_from_file(other); },
                                     {"x.qkvm", "source_embedding.weight", "expected shape [5, 4]"}));
  other = good;
  other.source = "x.qkvm";
  other.set("target_vocabulary", "le le");
  EXPECT_TRUE(
      throws_naming<IoError>([&] { translation_model_from_file(other); }, {"x.qkvm", "target_vocabulary", "twice"}));
  other = good;
  other.source = "x.qkvm";
  other.kind = "encoder-lm";
  EXPECT_TRUE(
      throws_naming<IoError>([&] { translation_model_from_file(other); }, {"x.qkvm", "expected a seq2seq model"}));
  other = good;
  other.source = "x.qkvm";
  other.metadata.erase(other.metadata.begin() + 2);  // "embedding"
  EXPECT_TRUE(
      throws_naming<IoError>([&] { translation_model_from_file(other); }, {"x.qkvm", "no entry \"embedding\""}));
}

TEST(Vocabulary, SpecialsComeFirstAndUnknownWordsAreNamed) {
  const Vocabulary v({"the", "dog"});
  EXPECT_EQ(v.size(), 5);
  EXPECT_EQ(v.word(kPadId), "<pad>");
  EXPECT_EQ(v.word(kBosId), "<bos>");
  EXPECT_EQ(v.word(kEosId), "<eos>");
  EXPECT_EQ(*v.find("dog"), 4);
  EXPECT_EQ(v.encode({"dog", "the"}, "SENTENCE"), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(v.joined(), "the dog");
  EXPECT_TRUE(throws_naming<ValueError>(
      [&] {
        v.encode({"the", "cat"}, "SENTENCE");
      },
      {"SENTENCE", "unknown word \"cat\"", "the dog"}));
  EXPECT_TRUE(throws_naming<ValueError>([&] { v.encode({"<eos>"}, "SENTENCE"); }, {"unknown word \"<eos>\""}));
  EXPECT_TRUE(throws_naming<ValueError>([] { Vocabulary({"a", "a"}); }, {"\"a\"", "twice"}));
  EXPECT_TRUE(throws_naming<ValueError>([] { Vocabulary({"<bos>"}); }, {"<bos>"}));
  EXPECT_TRUE(throws_naming<ValueError>([] { Vocabulary({"a b"}); }, {"whitespace", "a b"}));
}

TEST(ToyLanguage, TranslationsFollowTheGrammarAndTheAlignmentIsAPermutation) {
  const ToyLanguage& language = toy_language();
  ASSERT_EQ(language.source.size(), language.target.size());
  const TranslationSplits splits = make_translation_splits(11, 400, 50, 50);
  std::set<int64_t> lengths;
  for (const SentencePair& p : splits.train) {
    const auto n = static_cast<int64_t>(p.source.size());
    lengths.insert(n);
    ASSERT_GE(n, kToyMinLength);
    ASSERT_LE(n, kToyMaxLength);
    ASSERT_EQ(p.target.size(), p.source.size());
    std::vector<int64_t> sorted = p.alignment;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i);
    // The lexicons are parallel: a target word's id is its source word's.
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(p.target[static_cast<size_t>(i)], p.source[static_cast<size_t>(p.alignment[static_cast<size_t>(i)])]);
    // Verb-final; every determiner is followed by its noun.
    const std::string last = language.target.word(p.target.back());
    EXPECT_EQ(last.substr(last.size() - 2), "as")
        << "not verb-final: " << fmt::format("{}", fmt::join(language.target.decode(p.target), " "));
    for (size_t i = 0; i + 1 < p.target.size(); ++i) {
      const std::string& w = language.target.word(p.target[i]);
      if (w == "le" || w == "un") {
        const std::string& next = language.target.word(p.target[i + 1]);
        EXPECT_EQ(next.back(), next == "kasa" ? 'a' : 'o') << "determiner not followed by a noun";
      }
    }
  }
  EXPECT_EQ(static_cast<int64_t>(lengths.size()), kToyMaxLength - kToyMinLength + 1);
}

TEST(ToyLanguage, SplitsAreDeterministicAndDisjoint) {
  const TranslationSplits a = make_translation_splits(3, 200, 40, 40);
  const TranslationSplits b = make_translation_splits(3, 200, 40, 40);
  ASSERT_EQ(a.train.size(), 200U);
  ASSERT_EQ(a.test.size(), 40U);
  for (size_t i = 0; i < a.train.size(); ++i) EXPECT_EQ(a.train[i].source, b.train[i].source);
  std::set<std::vector<int64_t>> seen;
  for (const auto* split : {&a.train, &a.validation, &a.test}) {
    for (const SentencePair& p : *split) EXPECT_TRUE(seen.insert(p.source).second);
  }
  // The test split comes first, so it does not change with the size of the training split.
  const TranslationSplits bigger = make_translation_splits(3, 400, 40, 40);
  for (size_t i = 0; i < a.test.size(); ++i) EXPECT_EQ(a.test[i].source, bigger.test[i].source);
  EXPECT_NE(make_translation_splits(4, 10, 0, 0).train[0].source, a.train[0].source);
  EXPECT_TRUE(throws_naming<ValueError>([] { make_translation_splits(1, -1, 0, 0); }, {"train", "got -1"}));
  Rng rng(1);
  EXPECT_TRUE(throws_naming<ValueError>([&] { random_sentence(rng, 3); }, {"length", "4 to 15", "got 3"}));
}

}  // namespace
}  // namespace qkv::cli
