// qkv experiment scaling: why attention divides its scores by √d.
//
// What it shows. With q, k ~ N(0, I_d), q·k is a sum of d independent terms of variance 1, so
// Var(q·k) = d: the scores spread out as d grows, and softmax over them saturates: one key takes
// almost all the weight, the row's entropy falls from log Tk towards 0, and the softmax Jacobian
// diag(α) − ααᵀ (what carries the gradient from α back to the scores) shrinks towards 0. Dividing
// by √d gives the scores variance 1 at every d, and the three statistics no longer depend on d.
// Part 1 measures all of this at initialisation; part 2 asks whether it matters for learning: the
// same one-layer attention model (d = 256, one head) is trained on a content-retrieval task from
// the same initialisation and on the same batches, once with the 1/√d factor and once without.
//
// How to run:
//   qkv experiment scaling [--quick] [--sizes 4,16,64,256,1024] [--steps N] [--seed N] [--out DIR]
// --sizes sets the dimensions d of part 1; --steps the training steps of part 2.
//
// What the numbers mean (results.csv, one row per d, Tk = 64 keys per softmax row):
//   var_qk            sample variance of q·k over `samples` independent pairs (theory: d)
//   var_qk_over_d     var_qk / d (theory: 1); the test checks it is within 10% of 1 for d >= 16
//   max_weight_*      mean over rows of max_j α_j (1/Tk = 0.016 for uniform weights, 1 for one-hot)
//   entropy_*         mean over rows of −Σ_j α_j log α_j in nats (log Tk = 4.16 when uniform)
//   jacobian_norm_*   mean over rows of ‖diag(α) − ααᵀ‖_F (0.124 when uniform, 0 when one-hot)
// with * = unscaled (softmax of q·k) or scaled (softmax of q·k/√d).
// training.csv: per variant, the steps until the running mean of the training loss first reaches
// the target (an empty cell, and reached_target 0, when it did not within the run's steps: the
// column holds numbers only), the final loss and the accuracy on a held-out batch; loss_curves.csv:
// every step.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "experiments.hpp"
#include "models.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/ops/softmax.hpp"
#include "support/interrupt.hpp"
#include "support/progress.hpp"

namespace qkv::cli {
namespace {

constexpr int64_t kKeys = 64;  // Tk of the softmax statistics
constexpr int64_t kMinDim = 1;
constexpr int64_t kMaxDim = 4096;
// Pairs of one parallel task of the variance estimate, and rows of one task of the softmax
// statistics: each task draws from its own stream, so the numbers do not depend on the threads.
constexpr int64_t kPairsPerTask = 2048;
constexpr int64_t kRowsPerTask = 32;

// Stream ids for derive_seed.
enum Stream : uint64_t { kVarianceStream = 1, kSoftmaxStream, kInitStream, kDataStream, kHeldOutStream };

struct Settings {
  std::vector<int64_t> dims;
  int64_t variance_samples = 0;  // q·k pairs per d
  int64_t softmax_rows = 0;      // softmax rows per d
  // Part 2: the retrieval task and its training.
  int64_t train_dim = 0;
  int64_t pairs = 0;        // (key, value) pairs per sequence; T = pairs + 1 with the query
  int64_t key_count = 0;    // distinct keys
  int64_t value_count = 0;  // distinct values = classes
  int64_t batch = 0;
  int64_t steps = 0;
  int64_t held_out = 0;  // sequences of the held-out batch
  double lr = 0.0;
  double max_grad_norm = 0.0;
  double target_loss = 0.0;
  int64_t smoothing = 0;  // the running mean over this many steps decides when the target is reached
};

Settings settings_for(const ExperimentOptions& options) {
  Settings s;
  s.dims = options.sizes.empty() ? std::vector<int64_t>{4, 16, 64, 256, 1024} : options.sizes;
  s.variance_samples = options.quick ? 20000 : 200000;
  s.softmax_rows = options.quick ? 512 : 4096;
  s.train_dim = options.quick ? 64 : 256;
  s.pairs = 8;
  s.key_count = 64;
  s.value_count = 64;
  s.batch = 32;
  s.steps = options.steps.value_or(options.quick ? 200 : 3000);
  s.held_out = options.quick ? 256 : 2048;
  s.lr = 1e-3;
  s.max_grad_norm = 1.0;
  s.target_loss = 0.1;
  s.smoothing = 25;
  return s;
}

// ---- Part 1: statistics at initialisation ---------------------------------------------------

// Per softmax variant (unscaled, scaled): sums over rows of the three row statistics.
struct RowSums {
  double max_weight = 0.0;
  double entropy = 0.0;
  double jacobian_norm = 0.0;
};

struct DimStats {
  int64_t d = 0;
  double var_qk = 0.0;
  RowSums unscaled, scaled;  // means over rows once measured
};

double dot(const std::vector<double>& a, const double* b) {
  double sum = 0.0;
  for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

// The sample variance of q·k over `samples` pairs q, k ~ N(0, I_d).
double qk_variance(int64_t d, int64_t samples, uint64_t seed) {
  const int64_t tasks = (samples + kPairsPerTask - 1) / kPairsPerTask;
  std::vector<double> sums(static_cast<size_t>(tasks)), squares(static_cast<size_t>(tasks));
  parallel_for(tasks, [&](int64_t task, int /*worker*/) {
    if (interrupt_requested()) return;
    Rng rng(derive_seed(seed, kVarianceStream, static_cast<uint64_t>(d) << 32 | static_cast<uint64_t>(task)));
    const int64_t count = std::min(kPairsPerTask, samples - task * kPairsPerTask);
    std::vector<double> q(static_cast<size_t>(d)), k(static_cast<size_t>(d));
    double sum = 0.0, square = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      for (double& x : q) x = rng.normal();
      for (double& x : k) x = rng.normal();
      const double s = dot(q, k.data());
      sum += s;
      square += s * s;
    }
    sums[static_cast<size_t>(task)] = sum;
    squares[static_cast<size_t>(task)] = square;
  });
  throw_if_interrupted();
  double sum = 0.0, square = 0.0;
  for (int64_t t = 0; t < tasks; ++t) {
    sum += sums[static_cast<size_t>(t)];
    square += squares[static_cast<size_t>(t)];
  }
  const double n = static_cast<double>(samples);
  return (square - sum * sum / n) / (n - 1.0);
}

// max α, entropy and ‖diag(α) − ααᵀ‖_F of one softmax row. The norm comes from
//   ‖J‖²_F = Σ_i α_i²(1 − α_i)² + Σ_{i≠j} α_i²α_j² = Σ α_i² − 2 Σ α_i³ + (Σ α_i²)²
// (expand the first sum and complete the second to (Σ α_i²)² − Σ α_i⁴).
void add_row_stats(const double* alpha, RowSums& sums) {
  double max = 0.0, entropy = 0.0, s2 = 0.0, s3 = 0.0;
  for (int64_t j = 0; j < kKeys; ++j) {
    const double a = alpha[j];
    max = std::max(max, a);
    if (a > 0.0) entropy -= a * std::log(a);
    s2 += a * a;
    s3 += a * a * a;
  }
  sums.max_weight += max;
  sums.entropy += entropy;
  sums.jacobian_norm += std::sqrt(std::max(0.0, s2 - 2.0 * s3 + s2 * s2));
}

// Row means of the softmax statistics over `rows` rows, each a fresh q and kKeys fresh keys.
void softmax_stats(int64_t d, int64_t rows, uint64_t seed, DimStats& stats) {
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<RowSums> unscaled(static_cast<size_t>(tasks)), scaled(static_cast<size_t>(tasks));
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
  parallel_for(tasks, [&](int64_t task, int /*worker*/) {
    if (interrupt_requested()) return;
    Rng rng(derive_seed(seed, kSoftmaxStream, static_cast<uint64_t>(d) << 32 | static_cast<uint64_t>(task)));
    const int64_t count = std::min(kRowsPerTask, rows - task * kRowsPerTask);
    Tensor<double> raw(Shape{count, kKeys}), divided(Shape{count, kKeys});
    std::vector<double> q(static_cast<size_t>(d)), k(static_cast<size_t>(d));
    for (int64_t r = 0; r < count; ++r) {
      for (double& x : q) x = rng.normal();
      for (int64_t j = 0; j < kKeys; ++j) {
        for (double& x : k) x = rng.normal();
        const double s = dot(q, k.data());
        raw[r * kKeys + j] = s;
        divided[r * kKeys + j] = s * inv_sqrt_d;
      }
    }
    Tensor<double> alpha_raw(raw.shape()), alpha_divided(divided.shape());
    softmax_forward<double>(raw.cview(), alpha_raw.view());
    softmax_forward<double>(divided.cview(), alpha_divided.view());
    for (int64_t r = 0; r < count; ++r) {
      add_row_stats(alpha_raw.data() + r * kKeys, unscaled[static_cast<size_t>(task)]);
      add_row_stats(alpha_divided.data() + r * kKeys, scaled[static_cast<size_t>(task)]);
    }
  });
  throw_if_interrupted();
  const auto total = [&](const std::vector<RowSums>& parts) {
    RowSums sum;
    for (const RowSums& p : parts) {
      sum.max_weight += p.max_weight;
      sum.entropy += p.entropy;
      sum.jacobian_norm += p.jacobian_norm;
    }
    const double n = static_cast<double>(rows);
    return RowSums{sum.max_weight / n, sum.entropy / n, sum.jacobian_norm / n};
  };
  stats.unscaled = total(unscaled);
  stats.scaled = total(scaled);
}

// ---- Part 2: training with and without 1/√d --------------------------------------------------

// A sequence of `pairs` (key, value) positions and a query: ids [B, pairs + 1, 2] with
//   position i < pairs: (key_i, K + value_i)      keys distinct within a sequence
//   position pairs:     (key_q, K + V)            key_q one of the sequence's keys; id K + V marks the query
// and the target the value stored with key_q. Only content can find it: the pairs are in random
// order and the model has no positional information.
Batch retrieval_batch(const Settings& s, int64_t batch, Rng& rng) {
  const int64_t t = s.pairs + 1;
  Batch out{Tensor<int64_t>(Shape{batch, t, 2}), Tensor<int64_t>(Shape{batch})};
  std::vector<int64_t> keys(static_cast<size_t>(s.key_count));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < s.key_count; ++i) keys[static_cast<size_t>(i)] = i;
    // The first `pairs` steps of a Fisher-Yates shuffle: distinct keys.
    for (int64_t i = 0; i < s.pairs; ++i) {
      const auto j = i + static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(s.key_count - i));
      std::swap(keys[static_cast<size_t>(i)], keys[static_cast<size_t>(j)]);
    }
    const auto query = static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(s.pairs));
    for (int64_t i = 0; i < s.pairs; ++i) {
      const auto value = static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(s.value_count));
      out.ids[(b * t + i) * 2] = keys[static_cast<size_t>(i)];
      out.ids[(b * t + i) * 2 + 1] = s.key_count + value;
      if (i == query) out.targets[b] = value;
    }
    out.ids[(b * t + s.pairs) * 2] = keys[static_cast<size_t>(query)];
    out.ids[(b * t + s.pairs) * 2 + 1] = s.key_count + s.value_count;
  }
  return out;
}

struct TrainingRun {
  std::string variant;
  double scale = 0.0;
  std::vector<double> losses;  // training loss of every step
  std::optional<int64_t> steps_to_target;
  double final_loss = 0.0;  // the running mean at the last step
  double held_out_accuracy = 0.0;
  double held_out_loss = 0.0;
  double seconds = 0.0;
  int64_t parameters = 0;
};

TrainingRun train(const Settings& s, const std::string& variant, double scale, uint64_t seed) {
  // Both variants start from the same draw of every parameter and see the same batches.
  Rng init(derive_seed(seed, kInitStream));
  PairEmbedding<float> embedding(s.key_count + s.value_count + 1, s.train_dim, init);
  auto reader = std::make_unique<AttentionReader<float>>(
      AttentionReaderConfig{.dim = s.train_dim, .classes = s.value_count, .scale = scale}, init);
  Classifier<float> model(std::move(embedding), std::move(reader), {.lr = s.lr, .max_grad_norm = s.max_grad_norm});

  TrainingRun run;
  run.variant = variant;
  run.scale = scale;
  run.parameters = model.parameter_count();
  Rng data(derive_seed(seed, kDataStream));
  Progress progress(fmt::format("[scaling] training, {}", variant), s.steps);
  for (int64_t step = 0; step < s.steps; ++step) {
    const Batch batch = retrieval_batch(s, s.batch, data);
    run.losses.push_back(model.train_step(batch));
    progress.update(step + 1, fmt::format("loss {:.3f}", run.losses.back()));
  }
  const std::vector<double> smooth = running_mean(run.losses, s.smoothing);
  for (size_t i = 0; i < smooth.size(); ++i) {
    if (smooth[i] <= s.target_loss) {
      run.steps_to_target = static_cast<int64_t>(i) + 1;
      break;
    }
  }
  run.final_loss = smooth.empty() ? 0.0 : smooth.back();
  Rng held_out_rng(derive_seed(seed, kHeldOutStream));
  const Classifier<float>::Evaluation evaluation = model.evaluate(retrieval_batch(s, s.held_out, held_out_rng));
  run.held_out_accuracy = evaluation.accuracy;
  run.held_out_loss = evaluation.loss;
  run.seconds = progress.elapsed_seconds();
  progress.done(fmt::format("final loss {:.3f}, held-out accuracy {:.3f}", run.final_loss, run.held_out_accuracy));
  return run;
}

// ---- The measurement: both parts ---------------------------------------------------------------

// What the experiment measures: both parts' results, and the threads they ran on.
struct ScalingMeasurement {
  Settings settings;
  std::vector<DimStats> stats;    // part 1, one per d
  std::vector<TrainingRun> runs;  // part 2: scaled by 1/√d, then unscaled
  int threads = 0;
};

ScalingMeasurement measure_scaling(const ExperimentOptions& options) {
  ScalingMeasurement measurement;
  const Settings& s = measurement.settings = settings_for(options);
  measurement.threads = max_workers();

  std::vector<DimStats>& stats = measurement.stats;
  Progress progress("[scaling] statistics at initialisation", static_cast<int64_t>(s.dims.size()), "sizes of d");
  for (const int64_t d : s.dims) {
    DimStats dim;
    dim.d = d;
    dim.var_qk = qk_variance(d, s.variance_samples, options.seed);
    softmax_stats(d, s.softmax_rows, options.seed, dim);
    stats.push_back(dim);
    progress.update(static_cast<int64_t>(stats.size()), fmt::format("d = {}", d));
  }
  progress.done();

  const double unscaled = 1.0;
  const double scaled = 1.0 / std::sqrt(static_cast<double>(s.train_dim));
  measurement.runs.push_back(train(s, "scaled by 1/√d", scaled, options.seed));
  measurement.runs.push_back(train(s, "unscaled", unscaled, options.seed));
  return measurement;
}

// ---- The report --------------------------------------------------------------------------------

Figure variance_figure(const std::vector<DimStats>& stats) {
  std::vector<double> d, var, var_scaled;
  for (const DimStats& s : stats) {
    d.push_back(static_cast<double>(s.d));
    var.push_back(s.var_qk);
    var_scaled.push_back(s.var_qk / static_cast<double>(s.d));
  }
  PlotPanel panel =
      make_panel("Variance of the scores, q, k ~ N(0, I)", "d", "variance", AxisScale::log10, AxisScale::log10);
  panel.legend = LegendPosition::top_left;
  panel.series = {measured("Var(q·k)", d, var), reference("d (theory)", d, d), measured("Var(q·k/√d)", d, var_scaled),
                  reference("1 (theory)", d, std::vector<double>(d.size(), 1.0))};
  Figure figure;
  figure.panels = {panel};
  return figure;
}

Figure softmax_figure(const std::vector<DimStats>& stats) {
  std::vector<double> d, max_u, max_s, ent_u, ent_s, jac_u, jac_s;
  for (const DimStats& s : stats) {
    d.push_back(static_cast<double>(s.d));
    max_u.push_back(s.unscaled.max_weight);
    max_s.push_back(s.scaled.max_weight);
    ent_u.push_back(s.unscaled.entropy);
    ent_s.push_back(s.scaled.entropy);
    jac_u.push_back(s.unscaled.jacobian_norm);
    jac_s.push_back(s.scaled.jacobian_norm);
  }
  const auto flat = [&](double value) { return std::vector<double>(d.size(), value); };
  const double log_tk = std::log(static_cast<double>(kKeys));
  const double uniform_norm = std::sqrt(1.0 / kKeys - 1.0 / (kKeys * kKeys));

  // The largest weight lies in [1/Tk, 1]: on a log axis from just below 1/Tk to just above 1 the
  // uniform line (1/Tk = 0.016) sits well clear of the axis, which a linear one puts it on. Each
  // reference line is the last series, drawn over the curves.
  PlotPanel max_panel = make_panel(fmt::format("Largest weight of a row (Tk = {})", kKeys), "d", "mean max α",
                                   AxisScale::log10, AxisScale::log10);
  max_panel.y_range = AxisRange{0.5 / kKeys, 1.1};
  max_panel.series = {measured("softmax(q·k)", d, max_u), measured("softmax(q·k/√d)", d, max_s),
                      reference("1/Tk (uniform)", d, flat(1.0 / kKeys))};
  PlotPanel entropy_panel = make_panel("Entropy of a row", "d", "mean entropy (nats)", AxisScale::log10);
  entropy_panel.y_range = AxisRange{0.0, log_tk * 1.1};
  entropy_panel.series = {measured("softmax(q·k)", d, ent_u), measured("softmax(q·k/√d)", d, ent_s),
                          reference("log Tk (uniform)", d, flat(log_tk))};
  PlotPanel jacobian_panel = make_panel("Gradient that reaches the scores", "d", "mean ‖diag(α) − ααᵀ‖#dF#u",
                                        AxisScale::log10, AxisScale::log10);
  jacobian_panel.y_range = AxisRange{1e-3, 1.0};
  jacobian_panel.series = {measured("softmax(q·k)", d, jac_u), measured("softmax(q·k/√d)", d, jac_s),
                           reference("uniform α", d, flat(uniform_norm))};
  Figure figure;
  figure.panels = {max_panel, entropy_panel, jacobian_panel};
  return figure;
}

Figure training_figure(const std::vector<TrainingRun>& runs, const Settings& s) {
  PlotPanel panel = make_panel(fmt::format("Content retrieval, one attention layer, d = {}", s.train_dim), "step",
                               fmt::format("training loss (running mean of {} steps)", s.smoothing), AxisScale::linear,
                               AxisScale::log10);
  panel.legend = LegendPosition::bottom_left;
  std::vector<double> steps;
  for (int64_t i = 1; i <= s.steps; ++i) steps.push_back(static_cast<double>(i));
  for (const TrainingRun& run : runs) {
    PlotSeries curve = measured(run.variant, steps, running_mean(run.losses, s.smoothing));
    curve.markers = false;
    panel.series.push_back(std::move(curve));
  }
  panel.series.push_back(
      reference(fmt::format("target {}", s.target_loss), steps, std::vector<double>(steps.size(), s.target_loss)));
  Figure figure;
  figure.panels = {panel};
  figure.panel_width_px = 960;
  figure.panel_height_px = 600;
  return figure;
}

Report report_scaling(const ExperimentOptions& options, const ScalingMeasurement& measurement) {
  const Settings& s = measurement.settings;
  const std::vector<DimStats>& stats = measurement.stats;
  const std::vector<TrainingRun>& runs = measurement.runs;

  Report report("Experiment: scaling (why divide the scores by √d)");
  report.add_setting("command", command_line("scaling", options));
  report.add_setting("seed", fmt::format("{}", options.seed));
  report.add_setting("d (part 1)", join_sizes(s.dims));
  report.add_setting("q·k pairs per d", fmt::format("{}", s.variance_samples));
  report.add_setting("softmax rows per d", fmt::format("{} rows of Tk = {} keys", s.softmax_rows, kKeys));
  report.add_setting("model (part 2)", fmt::format("embedding + one attention layer (1 head, d = {}) read at the "
                                                   "query + residual + LayerNorm + linear head; {} parameters",
                                                   s.train_dim, runs.front().parameters));
  report.add_setting("task (part 2)", fmt::format("{} (key, value) pairs + a query key, {} keys, {} values; answer "
                                                  "the query key's value",
                                                  s.pairs, s.key_count, s.value_count));
  report.add_setting("training", fmt::format("{} steps, batch {}, Adam lr {}, gradient norm clipped to {}", s.steps,
                                             s.batch, s.lr, s.max_grad_norm));
  report.add_setting("target loss",
                     fmt::format("{} nats (running mean over {} steps); chance is log {} = {:.2f}", s.target_loss,
                                 s.smoothing, s.value_count, std::log(static_cast<double>(s.value_count))));
  report.add_setting("held-out batch", fmt::format("{} sequences", s.held_out));
  report.add_setting("threads", fmt::format("{}", measurement.threads));

  Table table({{"d", "{}"},
               {"samples", "{}"},
               {"var_qk", "{:.4g}"},
               {"var_qk_over_d", "{:.4f}"},
               {"max_weight_unscaled", "{:.3f}"},
               {"max_weight_scaled", "{:.3f}"},
               {"entropy_unscaled", "{:.3f}"},
               {"entropy_scaled", "{:.3f}"},
               {"log_Tk", "{:.3f}"},
               {"jacobian_norm_unscaled", "{:.3g}"},
               {"jacobian_norm_scaled", "{:.3g}"}});
  for (const DimStats& d : stats) {
    table.add_row({d.d, s.variance_samples, d.var_qk, d.var_qk / static_cast<double>(d.d), d.unscaled.max_weight,
                   d.scaled.max_weight, d.unscaled.entropy, d.scaled.entropy, std::log(static_cast<double>(kKeys)),
                   d.unscaled.jacobian_norm, d.scaled.jacobian_norm});
  }
  report.add_paragraph(
      "Part 1 draws q, k ~ N(0, I_d). `var_qk` is the sample variance of q·k (theory: d). The softmax "
      "columns average over rows of Tk = 64 keys: the largest weight, the entropy in nats (log Tk when "
      "uniform) and the Frobenius norm of the softmax Jacobian diag(α) − ααᵀ, which multiplies every "
      "gradient on its way from α to the scores.");
  report.add_table("Statistics at initialisation", std::move(table), "results.csv");
  report.add_figure("Variance of q·k against d", variance_figure(stats), "variance.png");
  report.add_figure("Softmax saturation against d", softmax_figure(stats), "softmax.png");

  Table training({{"variant", "{}"},
                  {"scale", "{:.4g}"},
                  {"steps_to_target", "{}"},
                  {"reached_target", "{}"},
                  {"final_loss", "{:.4f}"},
                  {"held_out_accuracy", "{:.3f}"},
                  {"held_out_loss", "{:.4f}"},
                  {"seconds", "{:.1f}"}});
  for (const TrainingRun& run : runs) {
    // A number or nothing: "not reached" is said by reached_target, not by text in a numeric column.
    const Cell steps = run.steps_to_target ? Cell{*run.steps_to_target} : Cell{std::string()};
    const int64_t reached = run.steps_to_target ? 1 : 0;
    training.add_row({run.variant, run.scale, steps, reached, run.final_loss, run.held_out_accuracy, run.held_out_loss,
                      run.seconds});
  }
  report.add_paragraph(
      "Part 2 trains the same model from the same initialisation on the same batches, with the scores "
      "scaled by 1/√d and without. `steps_to_target` is the first step at which the running mean of "
      "the training loss reaches the target, and is empty (with `reached_target` 0) when the target was "
      "not reached within the run's steps; `final_loss` is that running mean at the last step.");
  report.add_table("Training with and without 1/√d", std::move(training), "training.csv");

  Table curves({{"step", "{}"}, {"loss_scaled", "{:.4f}"}, {"loss_unscaled", "{:.4f}"}});
  for (int64_t i = 0; i < s.steps; ++i) {
    curves.add_row({i + 1, runs[0].losses[static_cast<size_t>(i)], runs[1].losses[static_cast<size_t>(i)]});
  }
  report.add_figure("Loss curves", training_figure(runs, s), "training.png");
  report.add_data("The training loss of every step of both runs", std::move(curves), "loss_curves.csv");
  return report;
}

Report run_scaling(const ExperimentOptions& options) { return report_scaling(options, measure_scaling(options)); }

}  // namespace

Experiment scaling_experiment() {
  return {.name = "scaling",
          .summary = "Var(q·k) = d, softmax saturation with and without 1/√d, and training both ways",
          .sizes_meaning = "dimensions d of q and k",
          .min_size = kMinDim,
          .max_size = kMaxDim,
          .trains = true,
          .run = run_scaling};
}

}  // namespace qkv::cli
