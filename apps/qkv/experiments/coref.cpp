// qkv experiment coref: does a pronoun's attention row point at its referent, and does that weight
// explain the prediction?
//
// What it shows. Synthetic sentences hold two candidate nouns and a pronoun whose referent is fixed
// by agreement alone: gender (the king ... the queen ... she) or number (the king ... the queens ...
// they), in four templates with 0 to 5 filler words between the nouns and the pronoun. A small
// Transformer encoder (encoder.hpp: self-attention + residual + LayerNorm + feed-forward, learned
// positions) is trained to name the referent (one of the noun roots) from the pronoun's output.
// The test split then gives: accuracy (overall, by cue and by distance), the attention mass that
// the pronoun's row puts on the referent and on the other candidate, per layer and head, and
// heatmaps of three examples. Finally the seed's warning that weights are not explanations is put
// to a test: per example and layer, the value vector of the referent is zeroed (in every head of
// that layer), then instead that of the most-attended other token; the drop in the probability of
// the right answer measures each token's effect. Attention and ablation agree on an example when
// the token with more weight is also the one whose removal hurts more.
//
// How to run:
//   qkv experiment coref [--quick] [--steps N] [--seed N] [--out DIR]
//
// What the numbers mean:
//   results.csv     test accuracy overall, by cue (gender, number) and by distance bucket
//   attention.csv   per layer and head: mean α(pronoun → referent), α(pronoun → other candidate),
//                   and how often the referent is the pronoun's most-attended token
//   ablation.csv    per layer: mean probability drop when the referent's value is zeroed, when the
//                   most-attended other token's is, and the share of examples where the two agree
//   training.csv    the training loss per step
//   heatmap_N.png   the last layer's α for three test sentences, every head; the pronoun's row framed
//                   in magenta, its referent's column in cyan, and a key under the image naming both
//   attention.npy   every layer's α [L, H, T, T] of the first of them, with attention_tokens.txt, for
//                   `qkv explore`, and attention.html, its explorer page

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "encoder.hpp"
#include "experiments.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/nn/adam.hpp"
#include "qkv/ops/cross_entropy.hpp"
#include "qkv/ops/softmax.hpp"
#include "qkv/viz/heatmap.hpp"
#include "support/progress.hpp"

namespace qkv::cli {
namespace {

enum Stream : uint64_t { kInitStream = 1, kTrainStream, kTestStream };

// Noun roots: the first half masculine, the second feminine. Each has a singular and a plural word.
constexpr std::array<const char*, 12> kRoots = {"king",  "boy",  "man",   "father", "prince",   "uncle",
                                                "queen", "girl", "woman", "mother", "princess", "aunt"};
constexpr std::array<const char*, 8> kFillers = {"later", "quietly", "again", "today", "soon", "very", "still", "then"};
constexpr std::array<const char*, 4> kVerbs = {"smiled", "left", "laughed", "slept"};

// The word list: padding, function words, fillers, verbs, pronouns, then the nouns (singular,
// plural, root by root).
class Lexicon {
 public:
  Lexicon() {
    for (const char* w : {"<pad>", "the", "saw", "and", "met", ",", ".", "after", "called", "while", "sang", "ran",
                          "he", "she", "they"}) {
      words_.emplace_back(w);
    }
    for (const char* w : kFillers) words_.emplace_back(w);
    for (const char* w : kVerbs) words_.emplace_back(w);
    first_noun_ = static_cast<int64_t>(words_.size());
    for (const char* root : kRoots) {
      words_.emplace_back(root);
      words_.push_back(std::string(root) + (std::string(root).ends_with("s") ? "es" : "s"));
    }
  }
  int64_t id(std::string_view word) const {
    return static_cast<int64_t>(std::find(words_.begin(), words_.end(), word) - words_.begin());
  }
  int64_t noun(int64_t root, bool plural) const { return first_noun_ + 2 * root + (plural ? 1 : 0); }
  int64_t size() const { return static_cast<int64_t>(words_.size()); }
  const std::string& word(int64_t id) const { return words_[static_cast<size_t>(id)]; }

 private:
  std::vector<std::string> words_;
  int64_t first_noun_ = 0;
};

enum class Cue { gender, number };

struct Example {
  std::vector<int64_t> ids;
  int64_t referent_root = 0;  // the class
  int64_t referent = 0;       // position of the referent noun
  int64_t other = 0;          // position of the other candidate
  int64_t pronoun = 0;        // position of the pronoun
  Cue cue = Cue::gender;
};

int64_t draw(Rng& rng, int64_t n) { return static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(n)); }

Example make_example(const Lexicon& lex, Rng& rng) {
  const int64_t half = static_cast<int64_t>(kRoots.size()) / 2;
  Example e;
  e.cue = draw(rng, 2) == 0 ? Cue::gender : Cue::number;
  int64_t root_a = 0, root_b = 0;
  bool plural_a = false, plural_b = false;
  if (e.cue == Cue::gender) {
    root_a = draw(rng, half);
    root_b = half + draw(rng, half);
    if (draw(rng, 2) == 1) std::swap(root_a, root_b);
  } else {
    root_a = draw(rng, 2 * half);
    do root_b = draw(rng, 2 * half);
    while (root_b == root_a);
    plural_a = draw(rng, 2) == 1;
    plural_b = !plural_a;
  }
  const bool first_is_referent = draw(rng, 2) == 0;
  const int64_t ref_root = first_is_referent ? root_a : root_b;
  const bool ref_plural = first_is_referent ? plural_a : plural_b;
  const int64_t pronoun = ref_plural ? lex.id("they") : (ref_root < half ? lex.id("he") : lex.id("she"));
  std::vector<int64_t>& s = e.ids;
  int64_t pos_a = 0, pos_b = 0;
  const auto word = [&](std::string_view w) { s.push_back(lex.id(w)); };
  const auto noun_a = [&] {
    word("the");
    pos_a = static_cast<int64_t>(s.size());
    s.push_back(lex.noun(root_a, plural_a));
  };
  const auto noun_b = [&] {
    word("the");
    pos_b = static_cast<int64_t>(s.size());
    s.push_back(lex.noun(root_b, plural_b));
  };
  const auto fillers = [&] {
    for (int64_t n = draw(rng, 6); n > 0; --n) s.push_back(lex.id(kFillers[static_cast<size_t>(draw(rng, 8))]));
  };
  switch (draw(rng, 4)) {
    case 0:  // the A saw the B . F* PRON V .
      noun_a(), word("saw"), noun_b(), word("."), fillers();
      break;
    case 1:  // the A and the B met , F* PRON V .
      noun_a(), word("and"), noun_b(), word("met"), word(","), fillers();
      break;
    case 2:  // after the A called the B , F* PRON V .
      word("after"), noun_a(), word("called"), noun_b(), word(","), fillers();
      break;
    default:  // the A sang F* while the B ran , and PRON V .
      noun_a(), word("sang"), fillers(), word("while"), noun_b(), word("ran"), word(","), word("and");
      break;
  }
  e.pronoun = static_cast<int64_t>(s.size());
  s.push_back(pronoun);
  word(kVerbs[static_cast<size_t>(draw(rng, 4))]);
  word(".");
  e.referent_root = ref_root;
  e.referent = first_is_referent ? pos_a : pos_b;
  e.other = first_is_referent ? pos_b : pos_a;
  return e;
}

// A batch padded at the end: ids [B, T], key mask [B, 1, 1, T], targets [B, T] (−1 but at the pronoun).
struct Batch {
  Tensor<int64_t> ids;
  Tensor<uint8_t> allowed;
  Tensor<int64_t> targets;
};

Batch make_batch(const std::vector<Example>& examples, size_t begin, size_t end) {
  int64_t length = 1;
  for (size_t n = begin; n < end; ++n) length = std::max<int64_t>(length, static_cast<int64_t>(examples[n].ids.size()));
  const int64_t batch = static_cast<int64_t>(end - begin);
  Batch out{Tensor<int64_t>(Shape{batch, length}, 0), Tensor<uint8_t>(Shape{batch, 1, 1, length}, 0),
            Tensor<int64_t>(Shape{batch, length}, -1)};
  for (int64_t b = 0; b < batch; ++b) {
    const Example& e = examples[begin + static_cast<size_t>(b)];
    for (size_t t = 0; t < e.ids.size(); ++t) {
      out.ids[b * length + static_cast<int64_t>(t)] = e.ids[t];
      out.allowed[b * length + static_cast<int64_t>(t)] = 1;
    }
    out.targets[b * length + e.pronoun] = e.referent_root;
  }
  return out;
}

struct Settings {
  int64_t dim = 32, heads = 2, ffn = 64, layers = 2;
  int64_t batch = 32, steps = 0, test = 0;
  double lr = 3e-3, max_grad_norm = 1.0;
};

constexpr int64_t kMaxLength = 24;

// The probability of the right root at the pronoun of each sequence of a batch: logits [B, T, C].
std::vector<double> answer_probabilities(const Tensor<float>& logits, const std::vector<Example>& examples,
                                         size_t begin, std::vector<int64_t>* predictions = nullptr) {
  const int64_t batch = logits.shape()[0], length = logits.shape()[1], classes = logits.shape()[2];
  std::vector<double> out;
  // The logits in float64, so that the probabilities are not rounded to float32.
  std::vector<double> scores(static_cast<size_t>(classes)), p(static_cast<size_t>(classes));
  for (int64_t b = 0; b < batch; ++b) {
    const Example& e = examples[begin + static_cast<size_t>(b)];
    const float* row = logits.data() + (b * length + e.pronoun) * classes;
    std::copy_n(row, classes, scores.begin());
    softmax<double>(scores, p);
    out.push_back(p[static_cast<size_t>(e.referent_root)]);
    if (predictions) predictions->push_back(std::max_element(row, row + classes) - row);
  }
  return out;
}

struct LayerHeadStats {
  double referent = 0.0, other = 0.0, referent_top = 0.0;
};
struct AblationStats {
  double referent_drop = 0.0, other_drop = 0.0, agree = 0.0, referent_more_attended = 0.0;
};

// What the experiment measures: everything its report shows.
struct CorefMeasurement {
  Settings settings;
  int64_t parameters = 0;      // of the trained model
  std::vector<double> losses;  // the training loss of every step
  std::vector<Example> test;
  std::array<int64_t, 2> cue_total{}, cue_right{};        // by cue: gender, number
  std::array<int64_t, 3> bucket_total{}, bucket_right{};  // distance pronoun − referent: ≤ 4, 5–8, ≥ 9
  std::vector<LayerHeadStats> heads;                      // [layer · heads + head], sums over the test split
  std::vector<AblationStats> ablation;                    // per layer, sums over the test split
  // α of every layer, [1, H, T, T] each, of the first three test sentences, each run alone.
  std::vector<std::vector<Tensor<float>>> sentence_alpha;
};

CorefMeasurement measure_coref(const ExperimentOptions& options) {
  CorefMeasurement measurement;
  Settings& s = measurement.settings;
  s.steps = options.steps.value_or(options.quick ? 80 : 1500);
  s.test = options.quick ? 256 : 2000;
  const Lexicon lex;
  const int64_t classes = static_cast<int64_t>(kRoots.size());

  Rng init(derive_seed(options.seed, kInitStream));
  EncoderModel<float> model({.vocabulary = lex.size(),
                             .classes = classes,
                             .max_length = kMaxLength,
                             .layers = s.layers,
                             .block = {.dim = s.dim, .heads = s.heads, .ffn = s.ffn}},
                            init);
  measurement.parameters = model.parameter_count();
  Adam<float> adam(model.parameters(), {.lr = s.lr, .max_grad_norm = s.max_grad_norm});

  Rng train_rng(derive_seed(options.seed, kTrainStream));
  std::vector<double>& losses = measurement.losses;
  Progress progress("[coref] training", s.steps);
  for (int64_t step = 0; step < s.steps; ++step) {
    std::vector<Example> examples;
    for (int64_t b = 0; b < s.batch; ++b) examples.push_back(make_example(lex, train_rng));
    const Batch batch = make_batch(examples, 0, examples.size());
    AttentionMask<float> mask{.allowed = batch.allowed.cview(), .bias = {}};
    const Tensor<float> logits = model.forward(batch.ids.cview(), mask);
    CrossEntropyCache<float> ce;
    const double loss = cross_entropy_forward<float>(
        {.logits = logits.cview(), .targets = batch.targets.cview(), .ignore_index = -1}, ce);
    Tensor<float> dlogits(logits.shape());
    cross_entropy_backward<float>(ce, 1.0, dlogits.view());
    model.zero_grad();
    model.backward(dlogits.cview());
    adam.step();
    losses.push_back(loss);
    progress.update(step + 1, fmt::format("loss {:.3f}", loss));
  }
  progress.done(fmt::format("loss {:.3f}", losses.back()));

  // Evaluation on a fresh test split.
  Rng test_rng(derive_seed(options.seed, kTestStream));
  std::vector<Example>& test = measurement.test;
  for (int64_t n = 0; n < s.test; ++n) test.push_back(make_example(lex, test_rng));
  const size_t chunk = 100;
  std::array<int64_t, 2>& cue_total = measurement.cue_total;
  std::array<int64_t, 2>& cue_right = measurement.cue_right;
  std::array<int64_t, 3>& bucket_total = measurement.bucket_total;
  std::array<int64_t, 3>& bucket_right = measurement.bucket_right;
  std::vector<LayerHeadStats>& heads = measurement.heads;
  heads.resize(static_cast<size_t>(s.layers * s.heads));
  std::vector<AblationStats>& ablation = measurement.ablation;
  ablation.resize(static_cast<size_t>(s.layers));
  for (size_t begin = 0; begin < test.size(); begin += chunk) {
    const size_t end = std::min(test.size(), begin + chunk);
    const Batch batch = make_batch(test, begin, end);
    const int64_t bsz = batch.ids.shape()[0], length = batch.ids.shape()[1];
    AttentionMask<float> mask{.allowed = batch.allowed.cview(), .bias = {}};
    std::vector<Tensor<float>> alpha;
    std::vector<TensorView<float>> alpha_views;
    for (int64_t l = 0; l < s.layers; ++l) alpha.emplace_back(Shape{bsz, s.heads, length, length});
    for (Tensor<float>& a : alpha) alpha_views.push_back(a.view());
    std::vector<int64_t> predictions;
    const std::vector<double> base =
        answer_probabilities(model.forward(batch.ids.cview(), mask, alpha_views), test, begin, &predictions);
    for (int64_t b = 0; b < bsz; ++b) {
      const Example& e = test[begin + static_cast<size_t>(b)];
      const bool right = predictions[static_cast<size_t>(b)] == e.referent_root;
      const size_t cue = e.cue == Cue::gender ? 0 : 1;
      const int64_t distance = e.pronoun - e.referent;
      const size_t bucket = distance <= 4 ? 0 : distance <= 8 ? 1 : 2;
      ++cue_total[cue], ++bucket_total[bucket];
      cue_right[cue] += right, bucket_right[bucket] += right;
      for (int64_t l = 0; l < s.layers; ++l) {
        for (int64_t h = 0; h < s.heads; ++h) {
          const float* row = alpha[static_cast<size_t>(l)].data() + ((b * s.heads + h) * length + e.pronoun) * length;
          LayerHeadStats& st = heads[static_cast<size_t>(l * s.heads + h)];
          st.referent += row[e.referent];
          st.other += row[e.other];
          st.referent_top += (std::max_element(row, row + length) - row) == e.referent;
        }
      }
    }
    // Ablation, layer by layer: the referent's value, then the most-attended other token's (by
    // the pronoun's row averaged over heads).
    for (int64_t l = 0; l < s.layers; ++l) {
      std::vector<int64_t> drop_referent, drop_other;
      std::vector<double> weight_referent, weight_other;
      for (int64_t b = 0; b < bsz; ++b) {
        const Example& e = test[begin + static_cast<size_t>(b)];
        std::vector<double> mean_row(static_cast<size_t>(length), 0.0);
        for (int64_t h = 0; h < s.heads; ++h) {
          const float* row = alpha[static_cast<size_t>(l)].data() + ((b * s.heads + h) * length + e.pronoun) * length;
          for (int64_t t = 0; t < length; ++t)
            mean_row[static_cast<size_t>(t)] += row[t] / static_cast<double>(s.heads);
        }
        int64_t other = e.referent == 0 ? 1 : 0;
        for (int64_t t = 0; t < static_cast<int64_t>(e.ids.size()); ++t) {
          if (t != e.referent && mean_row[static_cast<size_t>(t)] > mean_row[static_cast<size_t>(other)]) other = t;
        }
        drop_referent.push_back(e.referent);
        drop_other.push_back(other);
        weight_referent.push_back(mean_row[static_cast<size_t>(e.referent)]);
        weight_other.push_back(mean_row[static_cast<size_t>(other)]);
      }
      const std::vector<double> p_ref = answer_probabilities(
          model.forward(batch.ids.cview(), mask, {}, std::span<const int64_t>(drop_referent), l), test, begin);
      const std::vector<double> p_other = answer_probabilities(
          model.forward(batch.ids.cview(), mask, {}, std::span<const int64_t>(drop_other), l), test, begin);
      AblationStats& a = ablation[static_cast<size_t>(l)];
      for (size_t b = 0; b < static_cast<size_t>(bsz); ++b) {
        const double d_ref = base[b] - p_ref[b], d_other = base[b] - p_other[b];
        a.referent_drop += d_ref;
        a.other_drop += d_other;
        const bool attention_says_referent = weight_referent[b] > weight_other[b];
        a.referent_more_attended += attention_says_referent;
        a.agree += attention_says_referent == (d_ref > d_other);
      }
    }
  }
  // The heatmaps' sentences run alone, without padding.
  for (size_t k = 0; k < 3 && k < test.size(); ++k) {
    const Batch batch = make_batch(test, k, k + 1);
    const int64_t length = batch.ids.shape()[1];
    std::vector<Tensor<float>> alpha;
    std::vector<TensorView<float>> views;
    for (int64_t l = 0; l < s.layers; ++l) alpha.emplace_back(Shape{1, s.heads, length, length});
    for (Tensor<float>& a : alpha) views.push_back(a.view());
    model.forward(batch.ids.cview(), {}, views);
    measurement.sentence_alpha.push_back(std::move(alpha));
  }
  return measurement;
}

Report report_coref(const ExperimentOptions& options, const CorefMeasurement& measurement) {
  const Settings& s = measurement.settings;
  const std::vector<Example>& test = measurement.test;
  const Lexicon lex;
  const int64_t classes = static_cast<int64_t>(kRoots.size());
  const std::array<int64_t, 2>& cue_total = measurement.cue_total;
  const std::array<int64_t, 2>& cue_right = measurement.cue_right;
  const std::array<int64_t, 3>& bucket_total = measurement.bucket_total;
  const std::array<int64_t, 3>& bucket_right = measurement.bucket_right;
  const std::vector<LayerHeadStats>& heads = measurement.heads;
  const std::vector<AblationStats>& ablation = measurement.ablation;
  const double n = static_cast<double>(test.size());

  Report report("Coreference: does the pronoun's attention row point at its referent?");
  report.add_setting("model", fmt::format("{} pre-LN encoder blocks, D = {}, {} heads, FFN {}, learned positions; {} "
                                          "parameters",
                                          s.layers, s.dim, s.heads, s.ffn, measurement.parameters));
  report.add_setting("training", fmt::format("{} steps of {} fresh sentences, Adam lr {}, clip {}", s.steps, s.batch,
                                             s.lr, s.max_grad_norm));
  report.add_setting("task", fmt::format("name the referent among {} noun roots; cue: gender or number; 4 templates, "
                                         "0-5 fillers; {} test sentences",
                                         classes, s.test));
  report.add_setting("seed", fmt::format("{}", options.seed));
  report.add_setting("command", command_line("coref", options));

  Table accuracy({{"split", "{}"}, {"sentences", "{}"}, {"accuracy", "{:.4f}"}});
  int64_t right = 0;
  for (size_t c = 0; c < 2; ++c) right += cue_right[c];
  accuracy.add_row({std::string("all"), static_cast<int64_t>(test.size()), static_cast<double>(right) / n});
  const std::array<const char*, 2> cue_names = {"cue: gender", "cue: number"};
  for (size_t c = 0; c < 2; ++c) {
    accuracy.add_row({std::string(cue_names[c]), cue_total[c],
                      cue_total[c] ? static_cast<double>(cue_right[c]) / static_cast<double>(cue_total[c]) : NAN});
  }
  const std::array<const char*, 3> bucket_names = {"distance <= 4", "distance 5-8", "distance >= 9"};
  for (size_t k = 0; k < 3; ++k) {
    accuracy.add_row(
        {std::string(bucket_names[k]), bucket_total[k],
         bucket_total[k] ? static_cast<double>(bucket_right[k]) / static_cast<double>(bucket_total[k]) : NAN});
  }
  report.add_table(
      fmt::format("Test accuracy (chance: 1/2 if the model only knew the two candidates, 1/{} if not)", classes),
      std::move(accuracy), "results.csv");

  Table attention({{"layer", "{}"},
                   {"head", "{}"},
                   {"alpha_referent", "{:.3f}"},
                   {"alpha_other_candidate", "{:.3f}"},
                   {"referent_is_argmax", "{:.3f}"}});
  for (int64_t l = 0; l < s.layers; ++l) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const LayerHeadStats& st = heads[static_cast<size_t>(l * s.heads + h)];
      attention.add_row({l, h, st.referent / n, st.other / n, st.referent_top / n});
    }
  }
  report.add_table("Attention mass of the pronoun's row (mean over test sentences)", std::move(attention),
                   "attention.csv");

  Table ablation_table({{"layer", "{}"},
                        {"drop_referent_value", "{:.4f}"},
                        {"drop_most_attended_other_value", "{:.4f}"},
                        {"referent_more_attended", "{:.3f}"},
                        {"attention_and_ablation_agree", "{:.3f}"}});
  for (int64_t l = 0; l < s.layers; ++l) {
    const AblationStats& a = ablation[static_cast<size_t>(l)];
    ablation_table.add_row({l, a.referent_drop / n, a.other_drop / n, a.referent_more_attended / n, a.agree / n});
  }
  report.add_table(
      "Value ablation: mean drop in p(right referent), and how often the more-attended token is the one "
      "whose removal hurts more",
      std::move(ablation_table), "ablation.csv");

  Table training({{"step", "{}"}, {"loss", "{:.4f}"}});
  for (size_t i = 0; i < measurement.losses.size(); ++i) {
    training.add_row({static_cast<int64_t>(i + 1), measurement.losses[i]});
  }
  report.add_data("Training loss per step", std::move(training), "training.csv");

  ExtraFiles& files = *options.extra_files;
  std::string text =
      "Heatmaps of three test sentences: every head of the last layer (rows: queries, columns: keys); "
      "the pronoun's row, framed in magenta, is the one to read, and its referent's column is framed in cyan "
      "(the key under each image says so).\n\n";
  for (size_t k = 0; k < measurement.sentence_alpha.size(); ++k) {
    HeatmapOptions heatmap;
    for (int64_t id : test[k].ids) heatmap.row_labels.push_back(lex.word(id));
    heatmap.col_labels = heatmap.row_labels;
    const std::string pronoun = lex.word(test[k].ids[static_cast<size_t>(test[k].pronoun)]);
    const std::string referent = lex.word(test[k].ids[static_cast<size_t>(test[k].referent)]);
    heatmap.title = fmt::format("last layer; \"{}\" refers to \"{}\"", pronoun, referent);
    heatmap.marked_rows = {test[k].pronoun};
    heatmap.marked_rows_label = fmt::format("the pronoun \"{}\" (its row)", pronoun);
    heatmap.marked_cols = {test[k].referent};
    heatmap.marked_cols_label = fmt::format("its referent \"{}\" (its column)", referent);
    heatmap.vmin = 0.0;
    heatmap.vmax = 1.0;
    const std::string name = fmt::format("heatmap_{}.png", k + 1);
    files.stage(options.directory, name,
                render_heatmap<float>(measurement.sentence_alpha[k].back().cview(), HeatmapFormat::png, heatmap));
    text += fmt::format("![sentence {}]({})\n\n", k + 1, name);
  }
  if (!measurement.sentence_alpha.empty()) {
    std::vector<std::string> words;
    for (int64_t id : test[0].ids) words.push_back(lex.word(id));
    text += stage_attention(files, options.directory, "attention", measurement.sentence_alpha[0], words,
                            fmt::format("{}", fmt::join(words, " ")));
  }
  report.add_paragraph(text);
  return report;
}

Report run_coref(const ExperimentOptions& options) { return report_coref(options, measure_coref(options)); }

}  // namespace

Experiment coref_experiment() {
  return {.name = "coref",
          .summary = "a pronoun's attention row, its referent, and value ablation (weights vs explanations)",
          .sizes_meaning = "",
          .trains = true,
          .run = run_coref};
}

}  // namespace qkv::cli
