// qkv experiment parallel: attention's positions are computed at once, an RNN's one after another.
//
// What it shows. A tanh RNN must finish step t − 1 before it can start step t: its forward pass is
// a chain of T dependent steps (and its backward another), so a second thread can only split the
// work inside one small step. A self-attention layer computes every position from the same inputs
// in a fixed number of matrix products: its chain of dependent steps does not grow with T, and the
// threads split the positions between them. This experiment times one forward + backward pass over
// one sequence (B = 1) of length T for both layers, at the same width D, on 1 and on 2 threads, and
// reports the median time of repeated runs and the speed-up from the second thread. It also shows
// the other side of the trade: attention does O(T²·D) work against the RNN's O(T·D²), so being
// parallel is not the same as being faster.
//
// How to run:
//   qkv experiment parallel [--quick] [--sizes 64,256,1024,4096] [--seed N] [--out DIR]
// --sizes sets the sequence lengths T. Timings depend on the machine and on what else runs on it:
// the settings record the load average at the start.
//
// What the numbers mean (results.csv, one row per T):
//   *_sequential_steps  dependent steps of the forward pass: T for the RNN, 1 for attention (its
//                       matrix products each cover every position at once)
//   *_ms_1t, *_ms_2t    median wall time of forward + backward, in milliseconds, on 1 and 2 threads
//   *_speedup           *_ms_1t / *_ms_2t: 2 is perfect use of the second thread, 1 no use at all

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "experiments.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/nn/rnn.hpp"
#include "qkv/nn/self_attention.hpp"
#include "support/progress.hpp"

namespace qkv::cli {
namespace {

constexpr int64_t kMinLength = 1;
constexpr int64_t kMaxLength = 8192;
constexpr int kThreadCounts[] = {1, 2};
// A configuration whose slowest run takes this many times its fastest was disturbed.
constexpr double kSpreadWarning = 3.0;

enum Stream : uint64_t { kInputStream = 1, kInitStream };

struct Settings {
  std::vector<int64_t> lengths;
  int64_t dim = 0;
  int64_t repeats = 0;  // timed runs per (layer, T, threads), after one untimed warm-up run
};

Settings settings_for(const ExperimentOptions& options) {
  Settings s;
  s.lengths = options.sizes.empty()
                  ? (options.quick ? std::vector<int64_t>{64, 256} : std::vector<int64_t>{64, 256, 1024, 4096})
                  : options.sizes;
  std::sort(s.lengths.begin(), s.lengths.end());
  s.lengths.erase(std::unique(s.lengths.begin(), s.lengths.end()), s.lengths.end());
  s.dim = 64;
  s.repeats = options.quick ? 3 : 21;
  return s;
}

double milliseconds_of(const std::function<void()>& run) {
  const auto start = std::chrono::steady_clock::now();
  run();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// One timed configuration: a layer's pass at one thread count.
struct Config {
  const char* layer;
  int threads;
  std::function<void()> pass;
  std::vector<double> ms;  // every timed run
};

struct Timing {
  int64_t length = 0;
  double rnn_ms[2] = {0.0, 0.0};  // medians by thread count, 1 then 2
  double attention_ms[2] = {0.0, 0.0};
};

// Forward + backward of one tanh RNN layer (D → D) over x [1, T, D], with dy [1, T, D].
std::function<void()> rnn_pass(Rnn<float>& rnn, const Tensor<float>& x, const Tensor<float>& dy) {
  return [&rnn, &x, &dy] {
    RnnCache<float> cache;
    const RecurrentOutputs<float> out =
        rnn.forward({.x = x.cview(), .h0 = std::nullopt, .lengths = std::nullopt}, cache);
    Tensor<float> dx(x.shape());
    rnn.backward(cache, {.dy = dy.cview(), .dh_n = std::nullopt}, {.dx = dx.view(), .dh0 = std::nullopt});
    rnn.zero_grad();
  };
}

// Forward + backward of one causal self-attention layer (D → D, one head) over x [1, T, D].
std::function<void()> attention_pass(SelfAttention<float>& layer, const Tensor<float>& x, const Tensor<float>& dy) {
  return [&layer, &x, &dy] {
    SelfAttentionCache<float> cache;
    const Tensor<float> y = layer.forward(x.cview(), cache);
    Tensor<float> dx(x.shape());
    layer.backward(cache, dy.cview(), dx.view());
    layer.zero_grad();
  };
}

// The 1-minute load average, NaN when the system does not say.
double load_average() {
  double load[1] = {0.0};
  return getloadavg(load, 1) == 1 ? load[0] : std::nan("");
}

// One timed run of a configuration.
struct TimedRun {
  std::string layer;
  int64_t length = 0;
  int64_t threads = 0;
  int64_t run = 0;  // 1, 2, ... in the order the runs went
  double ms = 0.0;
};

// The widest slowest/fastest ratio among the runs of one configuration: a run that something else
// on the machine slowed down shows here.
struct Spread {
  double ratio = 0.0;
  std::string where;
};

// What the experiment measures: the timings and the state of the machine around them.
struct ParallelMeasurement {
  Settings settings;
  std::vector<Timing> timings;  // per T
  std::vector<TimedRun> runs;   // every timed run, in order
  Spread spread;
  double load_before = 0.0, load_after = 0.0;  // 1-minute load averages
  unsigned cores = 0;                          // hardware threads
};

ParallelMeasurement measure_parallel(const ExperimentOptions& options) {
  ParallelMeasurement measurement;
  const Settings& s = measurement.settings = settings_for(options);
  measurement.load_before = load_average();
  const int previous_workers = max_workers();

  Rng init(derive_seed(options.seed, kInitStream));
  Rnn<float> rnn({.input_size = s.dim, .hidden_size = s.dim, .bias = true, .reverse = false}, init);
  SelfAttention<float> attention(
      {.d_model = s.dim, .n_heads = 1, .bias = true, .output_projection = true, .causal = true}, init);

  std::vector<Timing>& timings = measurement.timings;
  Spread& spread = measurement.spread;
  Progress progress("[parallel] timing forward + backward", static_cast<int64_t>(s.lengths.size()) * s.repeats,
                    "rounds");
  int64_t rounds = 0;
  try {
    for (const int64_t length : s.lengths) {
      Rng data(derive_seed(options.seed, kInputStream, static_cast<uint64_t>(length)));
      Tensor<float> x(Shape{1, length, s.dim}), dy(Shape{1, length, s.dim});
      data.fill_normal(x.view());
      data.fill_normal(dy.view());
      std::vector<Config> configs;
      for (const int threads : kThreadCounts) {
        configs.push_back({"rnn", threads, rnn_pass(rnn, x, dy), {}});
        configs.push_back({"attention", threads, attention_pass(attention, x, dy), {}});
      }
      // One untimed run of each sizes caches and pages memory in. The timed runs then go round the
      // configurations in turn, so that a change in the machine's load falls on all of them alike.
      for (Config& config : configs) {
        set_max_workers(config.threads);
        config.pass();
      }
      for (int64_t r = 0; r < s.repeats; ++r) {
        for (Config& config : configs) {
          set_max_workers(config.threads);
          config.ms.push_back(milliseconds_of(config.pass));
          measurement.runs.push_back({config.layer, length, int64_t{config.threads}, r + 1, config.ms.back()});
        }
        progress.update(++rounds, fmt::format("T = {}", length));
      }
      Timing timing;
      timing.length = length;
      for (const Config& config : configs) {
        const size_t t = config.threads == 1 ? 0 : 1;
        (std::string(config.layer) == "rnn" ? timing.rnn_ms : timing.attention_ms)[t] = median(config.ms);
        const auto [fastest, slowest] = std::minmax_element(config.ms.begin(), config.ms.end());
        if (*slowest / *fastest > spread.ratio) {
          spread = {*slowest / *fastest, fmt::format("{}, T = {}, {} thread(s)", config.layer, length, config.threads)};
        }
      }
      timings.push_back(timing);
    }
  } catch (...) {
    set_max_workers(previous_workers);
    throw;
  }
  set_max_workers(previous_workers);
  progress.done();
  measurement.load_after = load_average();
  measurement.cores = std::thread::hardware_concurrency();
  return measurement;
}

Report report_parallel(const ExperimentOptions& options, const ParallelMeasurement& measurement) {
  const Settings& s = measurement.settings;
  const double load_before = measurement.load_before;
  const unsigned cores = measurement.cores;
  const Spread& spread = measurement.spread;

  Report report("Experiment: parallel (RNN against self-attention, forward + backward time)");
  report.add_setting("command", command_line("parallel", options));
  report.add_setting("seed", fmt::format("{}", options.seed));
  report.add_setting("sequence lengths T", join_sizes(s.lengths));
  report.add_setting("width D", fmt::format("{}", s.dim));
  report.add_setting("RNN",
                     fmt::format("qkv::Rnn, tanh, D → D with biases; {} parameters", 2 * s.dim * s.dim + 2 * s.dim));
  report.add_setting("self-attention",
                     fmt::format("qkv::SelfAttention, 1 head, causal, W_Q, W_K, W_V, W_O with biases; {} parameters",
                                 4 * (s.dim * s.dim + s.dim)));
  report.add_setting("pass", "forward + backward over one sequence (B = 1), float32; dy ~ N(0, 1)");
  report.add_setting("timing", fmt::format("median of {} runs per layer, T and thread count, after 1 warm-up run "
                                           "each; the runs go round the four configurations in turn",
                                           s.repeats));
  report.add_setting("threads", "1 and 2 (qkv::set_max_workers)");
  report.add_setting("machine", fmt::format("{} hardware threads; 1-minute load average {:.2f} before the run, {:.2f} "
                                            "after",
                                            cores, load_before, measurement.load_after));
  // Before the run the load is the other processes' alone; more than cores − 1 of it leaves this
  // run's second thread no free core.
  if (load_before > static_cast<double>(cores) - 1.0) {
    report.add_paragraph(fmt::format(
        "**Warning: the machine was busy** (1-minute load average {:.2f} on {} hardware threads before the run). "
        "A second thread then waits for a core at every synchronisation, so the 2-thread times and the "
        "speed-ups below measure the contention as much as the layers. Compare `timings.csv`'s spread.",
        load_before, cores));
  }
  if (spread.ratio > kSpreadWarning) {
    report.add_paragraph(fmt::format(
        "**Warning: the timings were not steady**: the slowest of the {} runs of {} took {:.1f} times its fastest. "
        "Something else probably ran on the machine during the measurement; the medians hold as long as it "
        "lasted less than half of the runs (see `timings.csv`).",
        s.repeats, spread.where, spread.ratio));
  }

  Table table({{"T", "{}"},
               {"rnn_sequential_steps", "{}"},
               {"attention_sequential_steps", "{}"},
               {"rnn_ms_1t", "{:.3f}"},
               {"rnn_ms_2t", "{:.3f}"},
               {"rnn_speedup", "{:.2f}"},
               {"attention_ms_1t", "{:.3f}"},
               {"attention_ms_2t", "{:.3f}"},
               {"attention_speedup", "{:.2f}"}});
  for (const Timing& t : measurement.timings) {
    table.add_row({t.length, t.length, int64_t{1}, t.rnn_ms[0], t.rnn_ms[1], t.rnn_ms[0] / t.rnn_ms[1],
                   t.attention_ms[0], t.attention_ms[1], t.attention_ms[0] / t.attention_ms[1]});
  }
  report.add_paragraph(
      "Sequential steps count the dependent steps of the forward pass: the RNN's step t needs step t − 1, "
      "while every matrix product of the attention layer covers all positions at once. Times are "
      "wall-clock medians in milliseconds; speed-up is the 1-thread time over the 2-thread time.");
  report.add_table("Forward + backward time, 1 and 2 threads", std::move(table), "results.csv");
  Table raw({{"layer", "{}"}, {"T", "{}"}, {"threads", "{}"}, {"run", "{}"}, {"ms", "{:.4f}"}});
  for (const TimedRun& run : measurement.runs) raw.add_row({run.layer, run.length, run.threads, run.run, run.ms});
  report.add_data("Every timed run", std::move(raw), "timings.csv");

  std::vector<double> lengths(s.lengths.begin(), s.lengths.end());
  std::vector<double> rnn1, rnn2, att1, att2, rnn_speedup, att_speedup;
  for (const Timing& t : measurement.timings) {
    rnn1.push_back(t.rnn_ms[0]);
    rnn2.push_back(t.rnn_ms[1]);
    att1.push_back(t.attention_ms[0]);
    att2.push_back(t.attention_ms[1]);
    rnn_speedup.push_back(t.rnn_ms[0] / t.rnn_ms[1]);
    att_speedup.push_back(t.attention_ms[0] / t.attention_ms[1]);
  }
  PlotPanel time_panel = make_panel("Forward + backward, one sequence", "sequence length T", "median time (ms)",
                                    AxisScale::log10, AxisScale::log10);
  time_panel.legend = LegendPosition::top_left;
  // The same colour for a layer in both panels: the first series of each panel is the RNN's.
  time_panel.series = {measured("RNN, 1 thread", lengths, rnn1), measured("attention, 1 thread", lengths, att1),
                       measured("RNN, 2 threads", lengths, rnn2), measured("attention, 2 threads", lengths, att2)};
  PlotPanel speedup_panel = make_panel("Speed-up from the second thread", "sequence length T",
                                       "time(1 thread) / time(2 threads)", AxisScale::log10);
  speedup_panel.y_range = AxisRange{0.0, 2.5};
  speedup_panel.legend = LegendPosition::top_left;
  speedup_panel.series = {measured("RNN", lengths, rnn_speedup), measured("attention", lengths, att_speedup),
                          reference("perfect (2)", lengths, std::vector<double>(lengths.size(), 2.0)),
                          reference("none (1)", lengths, std::vector<double>(lengths.size(), 1.0))};
  Figure figure;
  figure.panels = {time_panel, speedup_panel};
  report.add_figure("Time and speed-up against sequence length", figure, "timing.png");
  return report;
}

Report run_parallel(const ExperimentOptions& options) { return report_parallel(options, measure_parallel(options)); }

}  // namespace

Experiment parallel_experiment() {
  return {.name = "parallel",
          .summary = "forward + backward time of an RNN and of self-attention on 1 and 2 threads",
          .sizes_meaning = "sequence lengths T",
          .min_size = kMinLength,
          .max_size = kMaxLength,
          .trains = false,
          .run = run_parallel};
}

}  // namespace qkv::cli
