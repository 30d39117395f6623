// The linear layer: the blocked SIMD kernels (linear_forward_blocked / linear_backward_blocked, what
// linear_forward / linear_backward run for layers of 2^10 weights or more) against the float64
// plain loops they replaced (linear_forward_reference / linear_backward_reference), fp32, on 1 and
// 2 threads. Passes, each 2·rows·In·Out flops: Forward y = x Wᵀ + b, InputGrad dx += dy W and
// WeightGrad dW += dyᵀ x with db += Σ dy (the GRU's hot spot).
//
//   build/<dir>/bench/bench_linear                                  # everything (about a minute)
//   build/<dir>/bench/bench_linear --benchmark_filter='/rows:2048/in:256/out:256/'  # the headline
//
// Shapes rows×In×Out: 2048×256×256 (the target: a GRU over B·T = 2048 tokens with H = 256),
// 2048×256×768 (its three gates at once), 512×113×37 (no multiple of any vector width), 64×16×16
// (a layer small enough that linear_forward keeps the reference; the blocked kernels are timed
// anyway). After the runs a table gives, per shape and pass, blocked over reference on 1 and 2
// threads and 2 threads over 1, all measured in this same run. One-thread runs are timed in CPU
// time, which time spent descheduled by other work on a shared machine does not inflate; two-thread
// runs in real time (the main thread's CPU time would miss the other's work), so on a busy machine
// they show the waits for a descheduled thread: compare ratios, and rerun when a number looks odd.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/ops/linear.hpp"

namespace {

enum class Impl { reference, blocked };
enum class Pass { forward, input_grad, weight_grad };

constexpr const char* kPassNames[] = {"Forward", "InputGrad", "WeightGrad"};

// The inputs of every pass: x [rows, In], w [Out, In], b [Out], dy [rows, Out].
struct Problem {
  qkv::Tensor<float> x, w, b, dy;

  Problem(int64_t rows, int64_t in, int64_t out) : x({rows, in}), w({out, in}), b({out}), dy({rows, out}) {
    qkv::Rng rng(1);
    for (qkv::Tensor<float>* t : {&x, &dy}) rng.fill_normal(t->view());
    qkv::linear_init(w.view(), std::optional(b.view()), rng);
  }
  qkv::LinearParams<float> params() const { return {.x = x.view(), .w = w.view(), .b = b.view()}; }
};

void run_pass(const Problem& p, Pass pass, Impl impl, qkv::Tensor<float>& y, qkv::Tensor<float>& dx,
              qkv::Tensor<float>& dw, qkv::Tensor<float>& db) {
  const qkv::LinearParams<float> params = p.params();
  if (pass == Pass::forward) {
    impl == Impl::reference ? qkv::linear_forward_reference(params, y.view())
                            : qkv::linear_forward_blocked(params, y.view());
    return;
  }
  const qkv::LinearGradients<float> grads =
      pass == Pass::input_grad ? qkv::LinearGradients<float>{.dx = dx.view(), .dw = std::nullopt, .db = std::nullopt}
                               : qkv::LinearGradients<float>{.dx = std::nullopt, .dw = dw.view(), .db = db.view()};
  impl == Impl::reference ? qkv::linear_backward_reference(params, p.dy.cview(), grads)
                          : qkv::linear_backward_blocked(params, p.dy.cview(), grads);
}

// Arguments: pass, impl, rows, In, Out, threads.
void linear(benchmark::State& state) {
  const auto pass = static_cast<Pass>(state.range(0));
  const auto impl = static_cast<Impl>(state.range(1));
  const int64_t rows = state.range(2), in = state.range(3), out = state.range(4);
  const int saved_workers = qkv::max_workers();
  qkv::set_max_workers(static_cast<int>(state.range(5)));
  Problem p(rows, in, out);
  qkv::Tensor<float> y(p.dy.shape()), dx(p.x.shape()), dw(p.w.shape()), db(p.b.shape());
  for (auto _ : state) {
    run_pass(p, pass, impl, y, dx, dw, db);
    benchmark::DoNotOptimize(y.data());
    benchmark::DoNotOptimize(dx.data());
    benchmark::DoNotOptimize(dw.data());
    benchmark::ClobberMemory();
  }
  qkv::set_max_workers(saved_workers);
  const double flops = 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(impl == Impl::blocked ? qkv::simd_target() : "float64 loops");
}

struct Shape {
  int64_t rows, in, out;
};

const std::vector<Shape> kShapes = {{2048, 256, 256}, {2048, 256, 768}, {512, 113, 37}, {64, 16, 16}};

bool is_tiny(const Shape& s) { return s.in * s.out < 1024; }

void shapes(benchmark::internal::Benchmark* b, int64_t threads) {
  b->ArgNames({"pass", "impl", "rows", "in", "out", "threads"});
  for (const Shape& s : kShapes) {
    if (is_tiny(s) && threads == 2) continue;  // one thread runs them either way
    for (int64_t pass = 0; pass < 3; ++pass) {
      for (int64_t impl = 0; impl < 2; ++impl) b->Args({pass, impl, s.rows, s.in, s.out, threads});
    }
  }
  b->MinTime(0.2);
  if (threads > 1) b->UseRealTime();
}

BENCHMARK(linear)->Name("Linear")->Apply([](benchmark::internal::Benchmark* b) { shapes(b, 1); });
BENCHMARK(linear)->Name("Linear")->Apply([](benchmark::internal::Benchmark* b) { shapes(b, 2); });

// Collects every run's GFLOP/s so that main() can print ratios between runs of this process.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration) continue;
      const auto it = run.counters.find("GFLOP/s");
      const std::string name = run.benchmark_name();
      if (it != run.counters.end()) rates_[name.substr(0, name.find("/min_time"))] = it->second.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }

  void PrintRatios() const {
    auto rate = [&](int64_t pass, int64_t impl, const Shape& s, int64_t threads) {
      char name[200];
      std::snprintf(name, sizeof name, "Linear/pass:%lld/impl:%lld/rows:%lld/in:%lld/out:%lld/threads:%lld",
                    static_cast<long long>(pass), static_cast<long long>(impl), static_cast<long long>(s.rows),
                    static_cast<long long>(s.in), static_cast<long long>(s.out), static_cast<long long>(threads));
      const auto it = rates_.find(name);
      return it == rates_.end() ? 0.0 : it->second;
    };
    auto ratio = [](double a, double b) {
      char text[32];
      if (a > 0 && b > 0) {
        std::snprintf(text, sizeof text, "%12.1fx", a / b);
      } else {
        std::snprintf(text, sizeof text, "%13s", "-");
      }
      return std::string(text);
    };
    std::printf("\nRatios in this run (fp32; blocked = the SIMD kernels, reference = the float64 loops):\n");
    std::printf("%16s %11s %15s %13s %13s %13s\n", "rows x In x Out", "pass", "blocked GF/s 1t", "blk/ref 1t",
                "blk/ref 2t", "2t/1t blk");
    for (const Shape& s : kShapes) {
      for (int64_t pass = 0; pass < 3; ++pass) {
        const double blocked = rate(pass, 1, s, 1);
        if (blocked == 0) continue;
        const std::string shape = std::to_string(s.rows) + "x" + std::to_string(s.in) + "x" + std::to_string(s.out);
        std::printf("%17s %11s %15.1f %s %s %s\n", shape.c_str(), kPassNames[pass], blocked,
                    ratio(blocked, rate(pass, 0, s, 1)).c_str(),
                    ratio(rate(pass, 1, s, 2), rate(pass, 0, s, 2)).c_str(),
                    ratio(rate(pass, 1, s, 2), blocked).c_str());
      }
    }
  }

 private:
  std::map<std::string, double> rates_;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  benchmark::Shutdown();
  return 0;
}
