// qkv experiment long-range: one step between any two tokens (attention) against a chain of T
// steps (a recurrent network).
//
// What it shows. The task is marked-token retrieval: a sequence of T random tokens, one of them
// marked by an input flag; the answer, given at the end of the sequence, is the marked token. A GRU
// reads the sequence left to right and answers from its final state, so the marked token must
// survive up to T − 1 state updates, and the gradient that would teach it to keep the token must
// flow back through as many. One attention layer answers at the last position by attending to every
// position directly: the path from the mark to the answer is one step whatever T is. Both models
// have a similar parameter budget (within 2×, counted and reported) and train for the same steps
// with the same batches. The mark sits at the start (the farthest from where the GRU answers) or
// anywhere, uniformly. Then, at initialisation (no training), the norm of ∂loss/∂x_p for the marked
// input x_p is measured as a function of its distance from the output, in float64 so that a
// vanishing gradient shows its true size rather than float32's underflow.
//
// How to run:
//   qkv experiment long-range [--quick] [--sizes 8,32,128,512] [--steps N] [--seed N] [--out DIR]
// --sizes sets the sequence lengths T; the gradient against distance uses the largest.
//
// What the numbers mean:
//   results.csv     per (T, placement): held-out accuracy (chance = 1/vocabulary) and loss of each
//                   model after training
//   gradients.csv   per distance δ = T − 1 − p: the mean over a batch of ‖∂loss_b/∂x_p‖ (each
//                   sequence's own loss), GRU and attention, at initialisation, at the largest T
//   gradients_by_length.csv  the same at distance T − 1 (the mark on the first token), per T

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "experiments.hpp"
#include "models.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "support/progress.hpp"

namespace qkv::cli {
namespace {

constexpr int64_t kMinLength = 2;
constexpr int64_t kMaxLength = 4096;

enum Stream : uint64_t { kInitStream = 1, kDataStream, kHeldOutStream, kGradientStream };

enum class Placement { start, uniform };
const char* placement_name(Placement p) { return p == Placement::start ? "start" : "uniform"; }

enum class Model { gru, attention };
const char* model_name(Model m) { return m == Model::gru ? "GRU" : "attention"; }

// The order of the runs and of the rows: by T, then placement, then model.
constexpr Placement kPlacements[] = {Placement::start, Placement::uniform};
constexpr Model kModels[] = {Model::gru, Model::attention};

struct Settings {
  std::vector<int64_t> lengths;
  int64_t vocabulary = 0;  // tokens, = classes
  int64_t dim = 0;         // embedding width = attention width = GRU input
  int64_t hidden = 0;      // GRU state
  int64_t batch = 0;
  int64_t steps = 0;
  int64_t held_out = 0;
  double lr = 0.0;
  double max_grad_norm = 0.0;
  int64_t gradient_batch = 0;  // sequences per distance of the gradient measurement
};

Settings settings_for(const ExperimentOptions& options) {
  Settings s;
  s.lengths = options.sizes.empty()
                  ? (options.quick ? std::vector<int64_t>{8, 32} : std::vector<int64_t>{8, 32, 128, 512})
                  : options.sizes;
  std::sort(s.lengths.begin(), s.lengths.end());
  s.lengths.erase(std::unique(s.lengths.begin(), s.lengths.end()), s.lengths.end());
  s.vocabulary = 16;
  s.dim = 32;
  s.hidden = 32;
  s.batch = 32;
  s.steps = options.steps.value_or(options.quick ? 60 : 1000);
  s.held_out = options.quick ? 256 : 1024;
  s.lr = 3e-3;
  s.max_grad_norm = 1.0;
  s.gradient_batch = options.quick ? 8 : 32;
  return s;
}

// Token ids are [0, V); V marks a position and V + 1 leaves it unmarked.
// ids [B, T, 2] = (token, flag); the target is the marked token. `mark` < 0 draws the mark's
// position by `placement`; otherwise the mark sits at position `mark`.
Batch marked_batch(const Settings& s, int64_t batch, int64_t length, Placement placement, Rng& rng, int64_t mark = -1) {
  Batch out{Tensor<int64_t>(Shape{batch, length, 2}), Tensor<int64_t>(Shape{batch})};
  const auto draw = [&](int64_t n) { return static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(n)); };
  for (int64_t b = 0; b < batch; ++b) {
    int64_t p = mark;
    if (p < 0) p = placement == Placement::start ? 0 : draw(length);
    for (int64_t t = 0; t < length; ++t) {
      const int64_t token = draw(s.vocabulary);
      out.ids[(b * length + t) * 2] = token;
      out.ids[(b * length + t) * 2 + 1] = t == p ? s.vocabulary : s.vocabulary + 1;
      if (t == p) out.targets[b] = token;
    }
  }
  return out;
}

template <class Scalar>
std::unique_ptr<Classifier<Scalar>> make_model(const Settings& s, Model model, uint64_t seed) {
  Rng init(derive_seed(seed, kInitStream, static_cast<uint64_t>(model)));
  PairEmbedding<Scalar> embedding(s.vocabulary + 2, s.dim, init);
  std::unique_ptr<SequenceReader<Scalar>> reader;
  if (model == Model::gru) {
    reader = std::make_unique<GruReader<Scalar>>(
        GruReaderConfig{.dim = s.dim, .hidden = s.hidden, .classes = s.vocabulary}, init);
  } else {
    reader = std::make_unique<AttentionReader<Scalar>>(
        AttentionReaderConfig{
            .dim = s.dim, .classes = s.vocabulary, .scale = 1.0 / std::sqrt(static_cast<double>(s.dim))},
        init);
  }
  return std::make_unique<Classifier<Scalar>>(std::move(embedding), std::move(reader),
                                              AdamConfig{.lr = s.lr, .max_grad_norm = s.max_grad_norm});
}

struct TrainingResult {
  Model model = Model::gru;
  int64_t length = 0;
  Placement placement = Placement::start;
  double accuracy = 0.0;
  double loss = 0.0;
  double final_train_loss = 0.0;
  double seconds = 0.0;
};

TrainingResult train(const Settings& s, Model model, int64_t length, Placement placement, uint64_t seed) {
  auto classifier = make_model<float>(s, model, seed);
  // Both models see the same batches for a given (T, placement).
  const uint64_t data_stream = static_cast<uint64_t>(length) << 8 | static_cast<uint64_t>(placement);
  Rng data(derive_seed(seed, kDataStream, data_stream));
  Progress progress(
      fmt::format("[long-range] {}, T = {}, mark at {}", model_name(model), length, placement_name(placement)),
      s.steps);
  std::vector<double> losses;
  for (int64_t step = 0; step < s.steps; ++step) {
    losses.push_back(classifier->train_step(marked_batch(s, s.batch, length, placement, data)));
    progress.update(step + 1, fmt::format("loss {:.3f}", losses.back()));
  }
  Rng held_out(derive_seed(seed, kHeldOutStream, data_stream));
  const auto evaluation = classifier->evaluate(marked_batch(s, s.held_out, length, placement, held_out));
  TrainingResult result;
  result.model = model;
  result.length = length;
  result.placement = placement;
  result.accuracy = evaluation.accuracy;
  result.loss = evaluation.loss;
  result.final_train_loss = running_mean(losses, 25).back();
  result.seconds = progress.elapsed_seconds();
  progress.done(fmt::format("held-out accuracy {:.3f}", result.accuracy));
  return result;
}

// Distances 0, 1, 2, 4, ... up to length − 1 (always included).
std::vector<int64_t> gradient_distances(int64_t length) {
  std::vector<int64_t> distances = {0};
  for (int64_t d = 1; d < length - 1; d *= 2) distances.push_back(d);
  if (length > 1) distances.push_back(length - 1);
  return distances;
}

// Mean over a batch of ‖∂loss_b/∂x_p‖ for the mark at position p = length − 1 − distance, in float64
// at initialisation. input_gradient differentiates the batch's mean loss, so each sequence's own
// gradient is B times its row.
std::vector<double> gradient_norms(const Settings& s, Model model, int64_t length,
                                   const std::vector<int64_t>& distances, uint64_t seed, Progress& progress,
                                   int64_t& done) {
  auto classifier = make_model<double>(s, model, seed);
  std::vector<double> norms;
  for (const int64_t distance : distances) {
    Rng data(derive_seed(seed, kGradientStream, static_cast<uint64_t>(distance)));
    const int64_t p = length - 1 - distance;
    const Batch batch = marked_batch(s, s.gradient_batch, length, Placement::start, data, p);
    const Tensor<double> dx = classifier->input_gradient(batch);
    double sum = 0.0;
    for (int64_t b = 0; b < s.gradient_batch; ++b) {
      double square = 0.0;
      for (int64_t j = 0; j < s.dim; ++j) {
        const double g = dx[(b * length + p) * s.dim + j] * static_cast<double>(s.gradient_batch);
        square += g * g;
      }
      sum += std::sqrt(square);
    }
    norms.push_back(sum / static_cast<double>(s.gradient_batch));
    progress.update(++done, fmt::format("{}, distance {}", model_name(model), distance));
  }
  return norms;
}

int64_t reader_parameters(const Settings& s, Model model) {
  return make_model<float>(s, model, 0)->reader_parameter_count();
}

// What the experiment measures: the gradients at initialisation, the trained models' results and
// the parameter counts.
struct LongRangeMeasurement {
  Settings settings;
  int64_t gradient_length = 0;                     // T of the gradient against distance: the largest
  std::vector<int64_t> distances;                  // of the gradient against distance
  std::vector<double> gru_norms, attention_norms;  // per distance
  std::vector<double> gru_first, attention_first;  // per T, at distance T − 1
  std::vector<TrainingResult> results;             // per T and placement: the GRU's, then the attention's
  int64_t gru_params = 0, attention_params = 0, embedding_params = 0;
  int threads = 0;
};

LongRangeMeasurement measure_long_range(const ExperimentOptions& options) {
  LongRangeMeasurement m;
  const Settings& s = m.settings = settings_for(options);
  m.threads = max_workers();

  // Gradients at initialisation first: they take seconds, the training takes minutes.
  m.gradient_length = s.lengths.back();
  m.distances = gradient_distances(m.gradient_length);
  Progress gradient_progress("[long-range] gradients at initialisation",
                             static_cast<int64_t>(2 * (m.distances.size() + s.lengths.size())), "measurements");
  int64_t gradients_done = 0;
  m.gru_norms =
      gradient_norms(s, Model::gru, m.gradient_length, m.distances, options.seed, gradient_progress, gradients_done);
  m.attention_norms = gradient_norms(s, Model::attention, m.gradient_length, m.distances, options.seed,
                                     gradient_progress, gradients_done);
  // And at every T, for the mark at the start (distance T − 1): how the farthest gradient scales with T.
  for (const int64_t length : s.lengths) {
    const std::vector<int64_t> farthest = {length - 1};
    m.gru_first.push_back(
        gradient_norms(s, Model::gru, length, farthest, options.seed, gradient_progress, gradients_done).front());
    m.attention_first.push_back(
        gradient_norms(s, Model::attention, length, farthest, options.seed, gradient_progress, gradients_done).front());
  }
  gradient_progress.done();

  for (const int64_t length : s.lengths) {
    for (const Placement placement : kPlacements) {
      for (const Model model : kModels) m.results.push_back(train(s, model, length, placement, options.seed));
    }
  }

  m.gru_params = reader_parameters(s, Model::gru);
  m.attention_params = reader_parameters(s, Model::attention);
  m.embedding_params = (s.vocabulary + 2) * s.dim;
  return m;
}

Report report_long_range(const ExperimentOptions& options, const LongRangeMeasurement& m) {
  const Settings& s = m.settings;
  const int64_t gradient_length = m.gradient_length;
  const std::vector<int64_t>& distances = m.distances;
  const std::vector<TrainingResult>& results = m.results;
  const int64_t gru_params = m.gru_params, attention_params = m.attention_params;
  const int64_t embedding_params = m.embedding_params;

  Report report("Experiment: long-range (marked-token retrieval, GRU against one attention layer)");
  report.add_setting("command", command_line("long-range", options));
  report.add_setting("seed", fmt::format("{}", options.seed));
  report.add_setting("sequence lengths T", join_sizes(s.lengths));
  report.add_setting("task", fmt::format("T tokens from a vocabulary of {}, one marked by an input flag; answer the "
                                         "marked token at the end (chance {:.4f})",
                                         s.vocabulary, 1.0 / static_cast<double>(s.vocabulary)));
  report.add_setting("GRU model", fmt::format("embedding (D = {}) → GRU (H = {}) → LayerNorm → linear; {} parameters "
                                              "besides the embedding's {}",
                                              s.dim, s.hidden, gru_params, embedding_params));
  report.add_setting("attention model",
                     fmt::format("embedding (D = {}) → one attention layer (1 head, scale 1/√D, no positional "
                                 "information) read at the last position → residual → LayerNorm → linear; {} "
                                 "parameters besides the embedding's {}",
                                 s.dim, attention_params, embedding_params));
  report.add_setting(
      "parameter ratio",
      fmt::format("GRU / attention = {:.2f}", static_cast<double>(gru_params) / static_cast<double>(attention_params)));
  report.add_setting("training", fmt::format("{} steps, batch {}, Adam lr {}, gradient norm clipped to {}; the same "
                                             "batches for both models",
                                             s.steps, s.batch, s.lr, s.max_grad_norm));
  report.add_setting("held-out batch", fmt::format("{} sequences per (T, placement)", s.held_out));
  report.add_setting(
      "gradient measurement",
      fmt::format("T = {}, {} sequences per distance, float64, at initialisation", gradient_length, s.gradient_batch));
  report.add_setting("threads", fmt::format("{}", m.threads));

  Table table({{"T", "{}"},
               {"mark", "{}"},
               {"gru_accuracy", "{:.3f}"},
               {"attention_accuracy", "{:.3f}"},
               {"chance", "{:.4f}"},
               {"gru_loss", "{:.3f}"},
               {"attention_loss", "{:.3f}"},
               {"gru_seconds", "{:.1f}"},
               {"attention_seconds", "{:.1f}"}});
  for (size_t i = 0; i + 1 < results.size(); i += 2) {
    const TrainingResult& gru = results[i];
    const TrainingResult& attention = results[i + 1];
    table.add_row({gru.length, std::string(placement_name(gru.placement)), gru.accuracy, attention.accuracy,
                   1.0 / static_cast<double>(s.vocabulary), gru.loss, attention.loss, gru.seconds, attention.seconds});
  }
  report.add_paragraph(
      "Accuracy and loss are measured on a held-out batch after training. `mark` = start puts the "
      "marked token first, as far as it can be from the last position, where both models answer; "
      "uniform draws its position uniformly.");
  report.add_table("Accuracy after training", std::move(table), "results.csv");

  PlotPanel accuracy =
      make_panel("Marked-token retrieval after training", "sequence length T", "held-out accuracy", AxisScale::log10);
  accuracy.y_range = AxisRange{0.0, 1.05};
  accuracy.legend = LegendPosition::bottom_left;
  std::vector<double> lengths(s.lengths.begin(), s.lengths.end());
  for (const Model model : kModels) {
    for (const Placement placement : kPlacements) {
      std::vector<double> acc;
      for (const TrainingResult& r : results) {
        if (r.model == model && r.placement == placement) acc.push_back(r.accuracy);
      }
      accuracy.series.push_back(
          measured(fmt::format("{}, mark at {}", model_name(model), placement_name(placement)), lengths, acc));
    }
  }
  accuracy.series.push_back(
      reference("chance", lengths, std::vector<double>(lengths.size(), 1.0 / static_cast<double>(s.vocabulary))));
  Figure accuracy_figure;
  accuracy_figure.panels = {accuracy};
  report.add_figure("Accuracy against sequence length", accuracy_figure, "accuracy.png");

  Table gradients({{"distance", "{}"}, {"gru_grad_norm", "{:.3e}"}, {"attention_grad_norm", "{:.3e}"}});
  for (size_t i = 0; i < distances.size(); ++i) {
    gradients.add_row({distances[i], m.gru_norms[i], m.attention_norms[i]});
  }
  report.add_paragraph(fmt::format(
      "At initialisation, with T = {}: the mean over {} sequences of ‖∂loss/∂x_p‖ for the marked input x_p at "
      "distance T − 1 − p from the answering position. The figure's log axes leave out distance 0 (in the table).",
      gradient_length, s.gradient_batch));
  report.add_table("Gradient reaching the marked input at initialisation", std::move(gradients), "gradients.csv");

  Table by_length({{"T", "{}"}, {"gru_grad_norm", "{:.3e}"}, {"attention_grad_norm", "{:.3e}"}});
  for (size_t i = 0; i < s.lengths.size(); ++i) by_length.add_row({s.lengths[i], m.gru_first[i], m.attention_first[i]});
  report.add_paragraph(
      "The same measure with the mark on the first token (distance T − 1), at every T: how the gradient "
      "that reaches the farthest input scales with the length of the sequence.");
  report.add_table("Gradient reaching the first token at initialisation, against T", std::move(by_length),
                   "gradients_by_length.csv");

  PlotPanel gradient =
      make_panel(fmt::format("Against distance, T = {}", gradient_length), "distance from the output (steps)",
                 "mean ‖∂loss/∂x#dp#u‖ at initialisation", AxisScale::log10, AxisScale::log10);
  gradient.legend = LegendPosition::bottom_left;
  const std::vector<double> distance_axis(distances.begin(), distances.end());
  gradient.series = {measured("GRU", distance_axis, m.gru_norms),
                     measured("attention", distance_axis, m.attention_norms)};
  PlotPanel first = make_panel("At the first token, against T", "sequence length T",
                               "mean ‖∂loss/∂x#d0#u‖ at initialisation", AxisScale::log10, AxisScale::log10);
  first.legend = LegendPosition::bottom_left;
  first.series = {measured("GRU", lengths, m.gru_first), measured("attention", lengths, m.attention_first)};
  Figure gradient_figure;
  gradient_figure.panels = {gradient, first};
  report.add_figure("Gradient reaching the marked input", gradient_figure, "gradients.png");
  return report;
}

Report run_long_range(const ExperimentOptions& options) {
  return report_long_range(options, measure_long_range(options));
}

}  // namespace

Experiment long_range_experiment() {
  return {.name = "long-range",
          .summary = "marked-token retrieval, GRU against attention, and gradient against distance",
          .sizes_meaning = "sequence lengths T",
          .min_size = kMinLength,
          .max_size = kMaxLength,
          .trains = true,
          .run = run_long_range};
}

}  // namespace qkv::cli
