// qkv experiment alignment: Bahdanau attention learns the word alignment of a translation.
//
// What it shows. A synthetic translation task (toy_translation.hpp) with a known gold alignment and
// real reordering: adjectives move behind their noun, the verb to the end, prepositions become
// postpositions, the adverb jumps from the end to after the subject. Three encoder-decoders with
// the same bidirectional-GRU encoder and GRU decoder (seq2seq.hpp) train on the same batches:
// additive attention (Bahdanau, Cho and Bengio 2015), scaled dot-product attention, and no
// attention (Cho et al. 2014: the decoder sees only the encoder's final states). On the test split
// it measures, by greedy decoding, exact-match and token accuracy; under teacher forcing, how often
// the argmax of α for a target word lands on its gold source word; all three by source length.
// The attention models should be near-perfect at every length and put α on the gold word; the
// no-attention model should fall with length, as the whole sentence must pass through one vector.
//
// How to run:
//   qkv experiment alignment [--quick] [--sizes H] [--steps N] [--seed N] [--out DIR]
// --sizes sets the decoder state H (the encoder has H/2 per direction, the additive scorer H/2).
//
// What the numbers mean:
//   results.csv     per model: test exact match (share of sentences translated word for word),
//                   token accuracy (share of reference words that the greedy output has at the same
//                   position), alignment accuracy (share of target words whose argmax α is the gold
//                   source word, under teacher forcing), training time (wall clock and processor),
//                   final validation loss
//   by_length.csv   the same per source-length bucket
//   alignment_by_class.csv  alignment accuracy per class of target word (determiner, noun, ...)
//   training.csv    training loss per step; validation.csv validation loss and token accuracy
//   heatmap_*.png   α of three test sentences (rows: target words, columns: source words), under
//                   teacher forcing, the gold cells outlined in red (a key under the image says so); the row labels
//                   name each word's gold source word; .svg twins of the same, with each cell's value as a tooltip
//   model_*.qkvm    the trained models, for `qkv translate --model FILE "sentence"`

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "experiments.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/io/model_file.hpp"
#include "qkv/ops/softmax.hpp"
#include "qkv/viz/heatmap.hpp"
#include "seq2seq.hpp"
#include "support/progress.hpp"
#include "toy_translation.hpp"

namespace qkv::cli {
namespace {

constexpr int64_t kMinHidden = 4;
constexpr int64_t kMaxHidden = 512;

enum Stream : uint64_t { kDataStream = 1, kInitStream, kBatchStream };

// Source-length buckets of three lengths each: 4–6, 7–9, 10–12, 13–15.
constexpr int64_t kBucketWidth = 3;
constexpr int64_t kBuckets = (kToyMaxLength - kToyMinLength + 1) / kBucketWidth;
int64_t bucket_of(int64_t length) { return (length - kToyMinLength) / kBucketWidth; }
std::string bucket_name(int64_t bucket) {
  const int64_t low = kToyMinLength + bucket * kBucketWidth;
  return fmt::format("{}–{}", low, low + kBucketWidth - 1);
}

// Sentences per forward in evaluation: enough to batch, few enough to keep memory small.
constexpr int64_t kEvalChunk = 128;

struct Settings {
  int64_t train = 0, validation = 0, test = 0;  // sentences per split
  int64_t embedding = 0, encoder_hidden = 0, decoder_hidden = 0, attention_hidden = 0;
  int64_t batch = 0;
  int64_t steps = 0;
  int64_t evaluations = 0;  // validation points along training
  double lr = 0.0;
  double max_grad_norm = 0.0;
};

Settings settings_for(const ExperimentOptions& options) {
  if (options.sizes.size() > 1) {
    throw ValueError(
        fmt::format("--sizes: experiment alignment takes one decoder size H, got {}", join_sizes(options.sizes)));
  }
  Settings s;
  s.train = options.quick ? 600 : 12000;
  s.validation = options.quick ? 64 : 500;
  s.test = options.quick ? 96 : 1000;
  s.decoder_hidden = options.sizes.empty() ? (options.quick ? 32 : 64) : options.sizes.front();
  s.encoder_hidden = std::max<int64_t>(s.decoder_hidden / 2, 1);
  s.attention_hidden = std::max<int64_t>(s.decoder_hidden / 2, 1);
  s.embedding = options.quick ? 16 : 32;
  s.batch = options.quick ? 32 : 64;
  // 400 steps: the fewest after which both attention models translate and align visibly better
  // than the one without (60 left all three at chance), in about 12 s of training on one core.
  s.steps = options.steps.value_or(options.quick ? 400 : 1500);
  s.evaluations = options.quick ? 4 : 10;
  s.lr = 3e-3;
  s.max_grad_norm = 1.0;
  return s;
}

const char* model_label(Score score) {
  switch (score) {
    case Score::additive:
      return "additive attention";
    case Score::scaled_dot:
      return "scaled dot-product attention";
    case Score::none:
      return "no attention";
  }
  return "?";
}

std::vector<std::vector<int64_t>> sources_of(const std::vector<SentencePair>& pairs, size_t begin, size_t end) {
  std::vector<std::vector<int64_t>> out;
  for (size_t i = begin; i < end; ++i) out.push_back(pairs[i].source);
  return out;
}

Seq2SeqBatch batch_of(const std::vector<SentencePair>& pairs, const std::vector<size_t>& indices) {
  std::vector<std::vector<int64_t>> sources, targets;
  for (const size_t i : indices) {
    sources.push_back(pairs[i].source);
    targets.push_back(pairs[i].target);
  }
  return make_seq2seq_batch(sources, targets);
}

std::vector<size_t> range_indices(size_t begin, size_t end) {
  std::vector<size_t> out;
  for (size_t i = begin; i < end; ++i) out.push_back(i);
  return out;
}

struct ValidationPoint {
  int64_t step = 0;
  double loss = 0.0;
  double token_accuracy = 0.0;  // argmax under teacher forcing
};

// Teacher-forced loss and argmax accuracy over every word and <eos> of the split.
ValidationPoint validate(Seq2Seq<float>& model, const std::vector<SentencePair>& split, int64_t step) {
  double loss_sum = 0.0;
  int64_t tokens = 0, correct = 0;
  for (size_t begin = 0; begin < split.size(); begin += kEvalChunk) {
    const size_t end = std::min(split.size(), begin + static_cast<size_t>(kEvalChunk));
    const Seq2SeqBatch batch = batch_of(split, range_indices(begin, end));
    const Tensor<float> logits = model.forward(batch);
    const int64_t vt = logits.shape()[2];
    for (int64_t r = 0; r < batch.decoder_target.numel(); ++r) {
      const int64_t target = batch.decoder_target[r];
      if (target == kIgnoreTarget) continue;
      const float* row = logits.data() + r * vt;
      loss_sum +=
          logsumexp<float>(std::span<const float>(row, static_cast<size_t>(vt))) - static_cast<double>(row[target]);
      correct += (std::max_element(row, row + vt) - row) == target ? 1 : 0;
      ++tokens;
    }
  }
  return {.step = step,
          .loss = loss_sum / static_cast<double>(tokens),
          .token_accuracy = static_cast<double>(correct) / static_cast<double>(tokens)};
}

struct TrainedModel {
  Score score = Score::none;
  std::unique_ptr<Seq2Seq<float>> model;
  int64_t parameters = 0;
  std::vector<double> losses;
  std::vector<ValidationPoint> validation;
  double seconds = 0.0;      // wall-clock time of the training steps, validation excluded
  double cpu_seconds = 0.0;  // processor time of the same: what the steps cost on a machine of its own
};

// The processor time this process has used. On a machine shared with other jobs the wall clock
// counts the time spent waiting for a core; this does not.
double cpu_seconds_now() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

TrainedModel train(const Settings& s, Score score, const TranslationSplits& data, uint64_t seed) {
  const ToyLanguage& language = toy_language();
  const Seq2SeqConfig config{.source_vocabulary = language.source.size(),
                             .target_vocabulary = language.target.size(),
                             .embedding = s.embedding,
                             .encoder_hidden = s.encoder_hidden,
                             .decoder_hidden = s.decoder_hidden,
                             .attention_hidden = s.attention_hidden,
                             .score = score};
  Rng init(derive_seed(seed, kInitStream));
  TrainedModel out;
  out.score = score;
  out.model = std::make_unique<Seq2Seq<float>>(config, init);
  for (const auto& p : out.model->parameters()) out.parameters += p.value.numel();
  Adam<float> adam(out.model->parameters(), {.lr = s.lr, .max_grad_norm = s.max_grad_norm});
  // Every model sees the same batches in the same order.
  Rng batches(derive_seed(seed, kBatchStream));
  const int64_t every = std::max<int64_t>(s.steps / s.evaluations, 1);
  Progress progress(fmt::format("[alignment] {}", model_label(score)), s.steps);
  double seconds = 0.0;
  std::vector<size_t> indices(static_cast<size_t>(s.batch));
  for (int64_t step = 0; step < s.steps; ++step) {
    for (size_t& i : indices) i = static_cast<size_t>(batches.next_u64() % data.train.size());
    const Seq2SeqBatch batch = batch_of(data.train, indices);
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = cpu_seconds_now();
    out.losses.push_back(seq2seq_loss_and_gradients(*out.model, batch));
    adam.step();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    out.cpu_seconds += cpu_seconds_now() - cpu_start;
    if ((step + 1) % every == 0 || step + 1 == s.steps) {
      out.validation.push_back(validate(*out.model, data.validation, step + 1));
    }
    progress.update(step + 1, fmt::format("loss {:.3f}", running_mean(out.losses, 25).back()));
  }
  out.seconds = seconds;
  progress.done(fmt::format("validation loss {:.3f}, token accuracy {:.3f}", out.validation.back().loss,
                            out.validation.back().token_accuracy));
  return out;
}

// Counts over the test split, overall (index kBuckets) and per source-length bucket.
struct Counts {
  int64_t sentences = 0, exact = 0, words = 0, words_correct = 0, aligned = 0;
};

struct Evaluation {
  std::vector<Counts> by_bucket = std::vector<Counts>(static_cast<size_t>(kBuckets + 1));
  // Target words and those aligned to their gold source word, per class of toy_word_class.
  std::vector<Counts> by_class = std::vector<Counts>(std::size(kToyWordClasses));
  const Counts& total() const { return by_bucket.back(); }
};

double share(int64_t part, int64_t whole) {
  return whole == 0 ? std::nan("") : static_cast<double>(part) / static_cast<double>(whole);
}

// argmax_j α[i, j] over the first `len` columns of row i of a [rows, width] matrix.
int64_t argmax_row(const float* alpha, int64_t width, int64_t i, int64_t len) {
  const float* row = alpha + i * width;
  return std::max_element(row, row + len) - row;
}

Evaluation evaluate(Seq2Seq<float>& model, const std::vector<SentencePair>& test, Progress& progress, int64_t& done) {
  Evaluation e;
  for (size_t begin = 0; begin < test.size(); begin += kEvalChunk) {
    const size_t end = std::min(test.size(), begin + static_cast<size_t>(kEvalChunk));
    const std::vector<std::vector<int64_t>> sources = sources_of(test, begin, end);
    // A correct translation has as many words as its source; twice that plus a few is room enough
    // to see a model that does not stop.
    const std::vector<GreedyTranslation<float>> greedy = model.greedy_decode(sources, 2 * kToyMaxLength + 2);
    const Seq2SeqBatch batch = batch_of(test, range_indices(begin, end));
    model.forward(batch);
    const Tensor<float>& alpha = model.attention_weights();  // [B, Tt, Ts]
    const int64_t tt = alpha.shape()[1], ts = alpha.shape()[2];
    for (size_t n = 0; n < end - begin; ++n) {
      const SentencePair& pair = test[begin + n];
      const auto len = static_cast<int64_t>(pair.source.size());
      const GreedyTranslation<float>& out = greedy[n];
      for (Counts* c : {&e.by_bucket[static_cast<size_t>(bucket_of(len))], &e.by_bucket.back()}) {
        ++c->sentences;
        if (out.finished && out.tokens == pair.target) ++c->exact;
        for (size_t i = 0; i < pair.target.size(); ++i) {
          ++c->words;
          if (i < out.tokens.size() && out.tokens[i] == pair.target[i]) ++c->words_correct;
          const float* rows = alpha.data() + static_cast<int64_t>(n) * tt * ts;
          if (argmax_row(rows, ts, static_cast<int64_t>(i), len) == pair.alignment[i]) ++c->aligned;
        }
      }
      for (size_t i = 0; i < pair.target.size(); ++i) {
        Counts& c = e.by_class[static_cast<size_t>(toy_word_class(pair.target[i]))];
        ++c.words;
        const float* rows = alpha.data() + static_cast<int64_t>(n) * tt * ts;
        if (argmax_row(rows, ts, static_cast<int64_t>(i), len) == pair.alignment[i]) ++c.aligned;
      }
    }
    done += static_cast<int64_t>(end - begin);
    progress.update(done);
  }
  return e;
}

// The test sentences drawn as heatmaps: the first ones of about 6, 10 and 14 words.
std::vector<size_t> heatmap_sentences(const std::vector<SentencePair>& test) {
  std::vector<size_t> chosen;
  for (const int64_t wanted : {6, 10, 14}) {
    size_t best = 0;
    int64_t best_gap = kToyMaxLength + 1;
    for (size_t i = 0; i < test.size(); ++i) {
      const int64_t gap = std::abs(static_cast<int64_t>(test[i].source.size()) - wanted);
      if (gap < best_gap && std::find(chosen.begin(), chosen.end(), i) == chosen.end()) {
        best = i;
        best_gap = gap;
      }
    }
    if (best_gap <= kToyMaxLength) chosen.push_back(best);
  }
  return chosen;
}

std::string join_words(const std::vector<std::string>& words) { return fmt::format("{}", fmt::join(words, " ")); }

// α under teacher forcing for one sentence: [n + 1, len], the <eos> row last.
Tensor<float> forced_alignment(Seq2Seq<float>& model, const SentencePair& pair) {
  const Seq2SeqBatch batch = make_seq2seq_batch({pair.source}, {pair.target});
  model.forward(batch);
  const Tensor<float>& alpha = model.attention_weights();  // [1, n + 1, len]
  return Tensor<float>(Shape{alpha.shape()[1], alpha.shape()[2]}, alpha.values());
}

// The heatmap's labels: each target word with its gold source word, "hundo ← dog".
std::vector<std::string> row_labels(const SentencePair& pair) {
  const ToyLanguage& language = toy_language();
  std::vector<std::string> labels;
  for (size_t i = 0; i < pair.target.size(); ++i) {
    labels.push_back(fmt::format("{} ← {}", language.target.word(pair.target[i]),
                                 language.source.word(pair.source[static_cast<size_t>(pair.alignment[i])])));
  }
  labels.emplace_back("<eos>");
  return labels;
}

// The gold cells (i, alignment[i]) of a sentence, which its heatmaps outline.
std::vector<std::pair<int64_t, int64_t>> gold_cells(const SentencePair& pair) {
  std::vector<std::pair<int64_t, int64_t>> cells;
  for (size_t i = 0; i < pair.alignment.size(); ++i) cells.emplace_back(static_cast<int64_t>(i), pair.alignment[i]);
  return cells;
}

std::string model_file_name(Score score) { return fmt::format("model_{}.qkvm", score_name(score)); }

// Runs the experiment on one thread and restores the previous count after. Every product here is
// small (at most 64 rows of 200 features per decoder step), so a second thread costs a wake-up and
// a barrier for little work: on this 2-core machine, shared with other jobs, two threads trained
// ten times slower than one. Results do not depend on the thread count.
class OneWorker {
 public:
  OneWorker() : previous_(max_workers()) { set_max_workers(1); }
  OneWorker(const OneWorker&) = delete;
  OneWorker& operator=(const OneWorker&) = delete;
  ~OneWorker() { set_max_workers(previous_); }

 private:
  int previous_;
};

// What the experiment measures: everything its report shows, and the trained models it saves.
struct AlignmentMeasurement {
  Settings settings;
  TranslationSplits data;
  std::vector<TrainedModel> models;       // additive, scaled_dot, none
  std::vector<Evaluation> evaluations;    // one per model, on data.test
  std::vector<size_t> heatmap_sentences;  // indices into data.test
  // Per model, α under teacher forcing of each heatmap sentence; none for the model without attention.
  std::vector<std::vector<Tensor<float>>> heatmap_alpha;
};

AlignmentMeasurement measure_alignment(const ExperimentOptions& options) {
  const OneWorker one_worker;
  AlignmentMeasurement measurement;
  const Settings& s = measurement.settings = settings_for(options);
  measurement.data = make_translation_splits(derive_seed(options.seed, kDataStream), s.train, s.validation, s.test);
  const std::vector<Score> scores = {Score::additive, Score::scaled_dot, Score::none};

  measurement.models.reserve(scores.size());
  for (const Score score : scores) measurement.models.push_back(train(s, score, measurement.data, options.seed));

  Progress eval_progress("[alignment] test split", static_cast<int64_t>(scores.size() * measurement.data.test.size()),
                         "sentences");
  int64_t evaluated = 0;
  measurement.evaluations.reserve(measurement.models.size());
  for (TrainedModel& model : measurement.models) {
    measurement.evaluations.push_back(evaluate(*model.model, measurement.data.test, eval_progress, evaluated));
  }
  eval_progress.done();

  measurement.heatmap_sentences = heatmap_sentences(measurement.data.test);
  for (TrainedModel& model : measurement.models) {
    std::vector<Tensor<float>>& alphas = measurement.heatmap_alpha.emplace_back();
    if (model.score == Score::none) continue;
    for (const size_t i : measurement.heatmap_sentences)
      alphas.push_back(forced_alignment(*model.model, measurement.data.test[i]));
  }
  return measurement;
}

Report report_alignment(const ExperimentOptions& options, const AlignmentMeasurement& measurement) {
  const Settings& s = measurement.settings;
  const TranslationSplits& data = measurement.data;
  const std::vector<TrainedModel>& models = measurement.models;
  const std::vector<Evaluation>& evaluations = measurement.evaluations;
  const ToyLanguage& language = toy_language();

  Report report("Experiment: alignment (Bahdanau attention on a synthetic translation task)");
  report.add_setting("command", command_line("alignment", options));
  report.add_setting("seed", fmt::format("{}", options.seed));
  report.add_setting("task",
                     fmt::format("synthetic translation, {} source and {} target words, sentences of {} to {} "
                                 "words (lengths uniform); adjective after noun (mirrored), verb-final, "
                                 "postpositions, adverb after the subject",
                                 language.source.size() - 3, language.target.size() - 3, kToyMinLength, kToyMaxLength));
  report.add_setting("splits", fmt::format("train {}, validation {}, test {} sentences, no sentence twice", s.train,
                                           s.validation, s.test));
  report.add_setting(
      "encoder", fmt::format("embedding E = {} → bidirectional GRU, {} per direction", s.embedding, s.encoder_hidden));
  report.add_setting("decoder", fmt::format("GRU, state {}, input [embedding; context], readout linear on [state; "
                                            "context; embedding]; additive scorer width {}",
                                            s.decoder_hidden, s.attention_hidden));
  report.add_setting("training", fmt::format("{} steps, batch {}, Adam lr {}, gradient norm clipped to {}, teacher "
                                             "forcing, the same batches for every model",
                                             s.steps, s.batch, s.lr, s.max_grad_norm));
  report.add_setting("evaluation", "greedy decoding for exact match and token accuracy; teacher forcing for α");
  report.add_setting("threads", "1 (the per-step products are too small to share; see alignment.cpp)");

  Table results({{"model", "{}"},
                 {"parameters", "{}"},
                 {"exact_match", "{:.3f}"},
                 {"token_accuracy", "{:.3f}"},
                 {"alignment_accuracy", "{:.3f}"},
                 {"train_seconds", "{:.1f}"},
                 {"train_cpu_seconds", "{:.1f}"},
                 {"validation_loss", "{:.4f}"}});
  for (size_t k = 0; k < models.size(); ++k) {
    const Counts& c = evaluations[k].total();
    const bool attends = models[k].score != Score::none;
    results.add_row({std::string(score_name(models[k].score)), models[k].parameters, share(c.exact, c.sentences),
                     share(c.words_correct, c.words),
                     attends ? Cell{share(c.aligned, c.words)} : Cell{std::string("n/a")}, models[k].seconds,
                     models[k].cpu_seconds, models[k].validation.back().loss});
  }
  report.add_paragraph(fmt::format(
      "Test split of {} sentences. `exact_match`: the greedy translation equals the reference; `token_accuracy`: "
      "share of reference words that the greedy output has at the same position; `alignment_accuracy`: share of "
      "target words whose argmax α (under teacher forcing) is on the gold source word. `train_seconds` is the "
      "wall-clock time of the training steps (validation excluded), `train_cpu_seconds` the processor time they "
      "used: on a shared machine the first includes waiting for a core.",
      data.test.size()));
  report.add_table("Results on the test split", std::move(results), "results.csv");
  if (options.quick) {
    report.add_note(fmt::format(
        "A --quick run: {} steps on {} sentences, models of H = {}. The attention models already translate and "
        "align well ahead of the one without; the default run (1 500 steps on 12 000 sentences, H = 64, about two "
        "minutes) reaches exact match 1.000 for both and alignment accuracy 0.93–0.98 (docs/experiments.md).",
        s.steps, s.train, s.decoder_hidden));
  }

  std::vector<TableColumn> columns = {{"source_length", "{}"}, {"sentences", "{}"}};
  for (const TrainedModel& m : models) {
    const std::string name(score_name(m.score));
    columns.push_back({name + "_exact", "{:.3f}"});
    columns.push_back({name + "_token", "{:.3f}"});
    if (m.score != Score::none) columns.push_back({name + "_alignment", "{:.3f}"});
  }
  Table by_length(columns);
  for (int64_t bucket = 0; bucket < kBuckets; ++bucket) {
    std::vector<Cell> row = {bucket_name(bucket), evaluations.front().by_bucket[static_cast<size_t>(bucket)].sentences};
    for (size_t k = 0; k < models.size(); ++k) {
      const Counts& c = evaluations[k].by_bucket[static_cast<size_t>(bucket)];
      row.emplace_back(share(c.exact, c.sentences));
      row.emplace_back(share(c.words_correct, c.words));
      if (models[k].score != Score::none) row.emplace_back(share(c.aligned, c.words));
    }
    by_length.add_row(std::move(row));
  }
  report.add_table("Accuracy by source length", std::move(by_length), "by_length.csv");

  Table by_class(
      {{"word_class", "{}"}, {"words", "{}"}, {"additive_alignment", "{:.3f}"}, {"dot_alignment", "{:.3f}"}});
  for (size_t k = 0; k < std::size(kToyWordClasses); ++k) {
    by_class.add_row({std::string(kToyWordClasses[k]), evaluations[0].by_class[k].words,
                      share(evaluations[0].by_class[k].aligned, evaluations[0].by_class[k].words),
                      share(evaluations[1].by_class[k].aligned, evaluations[1].by_class[k].words)});
  }
  report.add_paragraph(
      "Alignment accuracy by the class of the target word: for which words the decoder's argmax α is on the "
      "gold source word. Several identical determiners in a sentence differ only in their position.");
  report.add_table("Alignment accuracy by word class", std::move(by_class), "alignment_by_class.csv");

  std::vector<double> bucket_axis;
  for (int64_t bucket = 0; bucket < kBuckets; ++bucket) {
    bucket_axis.push_back(static_cast<double>(kToyMinLength + bucket * kBucketWidth + 1));
  }
  PlotPanel exact = make_panel("Exact match by length", "source length (bucket centre)", "test exact match");
  PlotPanel token = make_panel("Token accuracy by length", "source length (bucket centre)", "test token accuracy");
  PlotPanel aligned =
      make_panel("Alignment accuracy by length", "source length (bucket centre)", "argmax α on gold word");
  for (PlotPanel* p : {&exact, &token, &aligned}) {
    // Curves near 1 and one falling with length leave no corner free for sure: the legend goes
    // where it covers none (PlotPanel's automatic).
    p->y_range = AxisRange{0.0, 1.05};
  }
  for (size_t k = 0; k < models.size(); ++k) {
    std::vector<double> e, t, a;
    for (int64_t bucket = 0; bucket < kBuckets; ++bucket) {
      const Counts& c = evaluations[k].by_bucket[static_cast<size_t>(bucket)];
      e.push_back(share(c.exact, c.sentences));
      t.push_back(share(c.words_correct, c.words));
      a.push_back(share(c.aligned, c.words));
    }
    const std::string label = model_label(models[k].score);
    exact.series.push_back(measured(label, bucket_axis, e));
    token.series.push_back(measured(label, bucket_axis, t));
    if (models[k].score != Score::none) aligned.series.push_back(measured(label, bucket_axis, a));
  }
  Figure accuracy_figure;
  accuracy_figure.panels = {exact, token, aligned};
  accuracy_figure.panel_width_px = 560;
  accuracy_figure.panel_height_px = 440;
  report.add_figure("Accuracy against source length", accuracy_figure, "accuracy_by_length.png");

  Table training({{"step", "{}"}, {"additive_loss", "{:.4f}"}, {"dot_loss", "{:.4f}"}, {"none_loss", "{:.4f}"}});
  for (size_t i = 0; i < models.front().losses.size(); ++i) {
    training.add_row({static_cast<int64_t>(i + 1), models[0].losses[i], models[1].losses[i], models[2].losses[i]});
  }
  report.add_data("Training loss per step", std::move(training), "training.csv");
  Table validation({{"step", "{}"},
                    {"additive_loss", "{:.4f}"},
                    {"dot_loss", "{:.4f}"},
                    {"none_loss", "{:.4f}"},
                    {"additive_token_accuracy", "{:.4f}"},
                    {"dot_token_accuracy", "{:.4f}"},
                    {"none_token_accuracy", "{:.4f}"}});
  for (size_t i = 0; i < models.front().validation.size(); ++i) {
    validation.add_row({models[0].validation[i].step, models[0].validation[i].loss, models[1].validation[i].loss,
                        models[2].validation[i].loss, models[0].validation[i].token_accuracy,
                        models[1].validation[i].token_accuracy, models[2].validation[i].token_accuracy});
  }
  report.add_data("Validation loss and teacher-forced token accuracy", std::move(validation), "validation.csv");

  PlotPanel loss = make_panel("Training loss", "step", "cross-entropy (running mean of 25 steps)", AxisScale::linear,
                              AxisScale::log10);
  PlotPanel held_out = make_panel("Validation loss", "step", "cross-entropy", AxisScale::linear, AxisScale::log10);
  for (const TrainedModel& m : models) {
    std::vector<double> steps, vsteps, vloss;
    for (size_t i = 0; i < m.losses.size(); ++i) steps.push_back(static_cast<double>(i + 1));
    for (const ValidationPoint& v : m.validation) {
      vsteps.push_back(static_cast<double>(v.step));
      vloss.push_back(v.loss);
    }
    loss.series.push_back({.label = model_label(m.score),
                           .x = steps,
                           .y = running_mean(m.losses, 25),
                           .markers = false,
                           .dashed = false});
    held_out.series.push_back(measured(model_label(m.score), vsteps, vloss));
  }
  Figure loss_figure;
  loss_figure.panels = {loss, held_out};
  report.add_figure("Training and validation loss", loss_figure, "loss.png");

  // Files a Report does not carry: heatmaps with the gold alignment, and the models. The command
  // renames them into DIR/alignment once the report's own files are in place.
  ExtraFiles& files = *options.extra_files;
  std::string heatmap_text =
      "The heatmaps below show α under teacher forcing for three test sentences (rows: target "
      "words, each labelled with its gold source word after ←; columns: source words); the gold cells "
      "are outlined in red, as the key under each image says. The `.svg` twins show each cell's exact value on "
      "hover.\n\n";
  const std::vector<size_t>& chosen = measurement.heatmap_sentences;
  for (size_t k = 0; k < models.size(); ++k) {
    if (models[k].score == Score::none) continue;
    for (size_t c = 0; c < chosen.size(); ++c) {
      const SentencePair& pair = data.test[chosen[c]];
      const Tensor<float>& alpha = measurement.heatmap_alpha[k][c];
      HeatmapOptions heatmap;
      heatmap.row_labels = row_labels(pair);
      heatmap.col_labels = language.source.decode(pair.source);
      heatmap.title = fmt::format("{}: {}", model_label(models[k].score), join_words(heatmap.col_labels));
      heatmap.vmin = 0.0;
      heatmap.vmax = 1.0;
      heatmap.marked_cells = gold_cells(pair);
      heatmap.marked_cells_label = "gold alignment (each target word's source word)";
      const std::string stem = fmt::format("heatmap_{}_{}", score_name(models[k].score), c + 1);
      files.stage(options.directory, stem + ".png", render_heatmap<float>(alpha.cview(), HeatmapFormat::png, heatmap));
      files.stage(options.directory, stem + ".svg", render_heatmap<float>(alpha.cview(), HeatmapFormat::svg, heatmap));
      heatmap_text += fmt::format("![{}, sentence {}]({}.png) ([SVG]({}.svg))\n\n", model_label(models[k].score), c + 1,
                                  stem, stem);
      if (k == 0 && c == 0) {
        HeatmapOptions terminal;
        terminal.row_labels = heatmap.row_labels;
        terminal.col_labels = heatmap.col_labels;
        terminal.vmin = 0.0;
        terminal.vmax = 1.0;
        heatmap_text += fmt::format("As `qkv translate` shows it (additive, sentence 1):\n\n```\n{}```\n\n",
                                    render_heatmap<float>(alpha.cview(), HeatmapFormat::terminal, terminal));
      }
    }
  }
  for (const TrainedModel& model : models) {
    const std::string description =
        fmt::format("qkv experiment alignment, {}, seed {}, {} steps", model_label(model.score), options.seed, s.steps);
    files.stage(options.directory, model_file_name(model.score),
                encode_model_file(to_model_file(*model.model, language.source, language.target, description)));
  }
  report.add_paragraph("## Heatmaps\n\n" + heatmap_text);
  report.add_paragraph(fmt::format(
      "The trained models are saved as {}, {} and {} (qkv model files, see include/qkv/io/model_file.hpp): `qkv "
      "translate --model {} \"the big dog sees a cat\"` translates a sentence and shows its alignment.",
      model_file_name(Score::additive), model_file_name(Score::scaled_dot), model_file_name(Score::none),
      model_file_name(Score::additive)));
  return report;
}

Report run_alignment(const ExperimentOptions& options) { return report_alignment(options, measure_alignment(options)); }

}  // namespace

Experiment alignment_experiment() {
  return {.name = "alignment",
          .summary = "Bahdanau attention on a synthetic translation task: accuracy and learned word alignment",
          .sizes_meaning = "one decoder state size H",
          .min_size = kMinHidden,
          .max_size = kMaxHidden,
          .trains = true,
          .run = run_alignment};
}

}  // namespace qkv::cli
