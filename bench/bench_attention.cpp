// Attention throughput: the fused kernel against the reference, forward and forward + backward,
// causal or not, 1 or 2 threads, and decode (Tq = 1, long Tk). Shapes are those of
// docs/performance.md: B = 1, H = 8, d = 64, fp32, Tq = Tk = T.
//
//   build/<dir>/bench/bench_attention                      # everything (the reference only up to T = 1024)
//   build/<dir>/bench/bench_attention --benchmark_filter=Fused/Forward
//
// GFLOP/s counts the forward as 4·B·H·Tq·Tk·d (the same for causal, so causal shows the blocks it
// skips as speed) and forward + backward as 3.5× that. After the runs a table gives, per shape,
// fused against the reference, causal against full, 2 threads against 1, all measured in this
// same run. Timings on a shared machine are noisy: compare ratios, not absolute numbers.

#include <benchmark/benchmark.h>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/ops/attention.hpp"

namespace {

using qkv::AttentionImpl;

constexpr int64_t kHeads = 8;
constexpr int64_t kDim = 64;

struct Problem {
  qkv::Tensor<float> q, k, v, out, lse, dout, dq, dk, dv;

  Problem(int64_t heads, int64_t tq, int64_t tk, int64_t d)
      : q({1, heads, tq, d}),
        k({1, heads, tk, d}),
        v({1, heads, tk, d}),
        out({1, heads, tq, d}),
        lse({1, heads, tq}),
        dout({1, heads, tq, d}),
        dq({1, heads, tq, d}),
        dk({1, heads, tk, d}),
        dv({1, heads, tk, d}) {
    qkv::Rng rng(1);
    for (qkv::Tensor<float>* t : {&q, &k, &v, &dout}) rng.fill_normal(t->view());
  }
  qkv::AttentionParams<float> params(bool causal) const {
    qkv::AttentionParams<float> p{.q = q.view(), .k = k.view(), .v = v.view(), .scale = {}, .mask = {}};
    p.mask.causal = causal;
    return p;
  }
};

double forward_flops(int64_t heads, int64_t tq, int64_t tk, int64_t d) {
  return 4.0 * static_cast<double>(heads) * static_cast<double>(tq) * static_cast<double>(tk) * static_cast<double>(d);
}

// Arguments: T, causal, backward, threads.
void run(benchmark::State& state, AttentionImpl impl) {
  const int64_t t = state.range(0);
  const bool causal = state.range(1) != 0, backward = state.range(2) != 0;
  const int threads = static_cast<int>(state.range(3));
  const int saved_workers = qkv::max_workers();
  qkv::set_max_workers(threads);
  Problem p(kHeads, t, t, kDim);
  const qkv::AttentionParams<float> params = p.params(causal);
  for (auto _ : state) {
    qkv::attention_forward(params, {.out = p.out.view(), .weights = {}, .lse = p.lse.view()}, impl);
    if (backward) {
      qkv::attention_backward<float>(params, p.dout.view(),
                                     {.dq = p.dq.view(), .dk = p.dk.view(), .dv = p.dv.view(), .dbias = {}},
                                     qkv::AttentionSaved<float>{.out = p.out.cview(), .lse = p.lse.cview()}, impl);
    }
    benchmark::DoNotOptimize(p.out.data());
    benchmark::ClobberMemory();
  }
  qkv::set_max_workers(saved_workers);
  const double flops = forward_flops(kHeads, t, t, kDim) * (backward ? 3.5 : 1.0);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(qkv::simd_target());
}

void fused(benchmark::State& state) { run(state, AttentionImpl::fused); }
void reference(benchmark::State& state) { run(state, AttentionImpl::reference); }

// Decode: one query against many keys, split over the threads; reported as GB/s of K and V read.
void decode(benchmark::State& state) {
  const int64_t tk = state.range(0), heads = state.range(1), d = state.range(2);
  Problem p(heads, 1, tk, d);
  const qkv::AttentionParams<float> params = p.params(false);
  for (auto _ : state) {
    qkv::attention_forward_fused(params, {.out = p.out.view(), .weights = {}, .lse = p.lse.view()});
    benchmark::DoNotOptimize(p.out.data());
  }
  const double bytes = 2.0 * static_cast<double>(heads * tk * d) * sizeof(float);
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void shapes(benchmark::internal::Benchmark* b, int64_t max_t) {
  b->ArgNames({"T", "causal", "backward", "threads"});
  for (int64_t t : {256, 1024, 4096}) {
    if (t > max_t) continue;
    for (int64_t backward : {0, 1}) {
      for (int64_t causal : {0, 1}) b->Args({t, causal, backward, 2});
      b->Args({t, 0, backward, 1});
    }
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.5);
}

BENCHMARK(fused)->Name("Fused")->Apply([](benchmark::internal::Benchmark* b) { shapes(b, 4096); });
// The reference materialises Tq×Tk in float64 and takes seconds per call at T = 4096.
BENCHMARK(reference)->Name("Reference")->Apply([](benchmark::internal::Benchmark* b) { shapes(b, 1024); });
BENCHMARK(decode)
    ->Name("Decode")
    ->ArgNames({"Tk", "H", "d"})
    ->Args({32768, 32, 128})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The machine's memory bandwidth as decode's roof: a = b + s·c over arrays far larger than the
// caches, on every thread (STREAM's triad, counting 3 arrays of traffic).
void triad(benchmark::State& state) {
  const int64_t n = int64_t{1} << 25;  // 128 MiB per array
  std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n), 1.0f), c(static_cast<size_t>(n), 2.0f);
  const int64_t chunks = 256;
  for (auto _ : state) {
    qkv::parallel_for(chunks, [&](int64_t chunk, int /*worker*/) {
      const int64_t begin = chunk * n / chunks, end = (chunk + 1) * n / chunks;
      for (int64_t i = begin; i < end; ++i)
        a[static_cast<size_t>(i)] = b[static_cast<size_t>(i)] + 3.0f * c[static_cast<size_t>(i)];
    });
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(3.0 * static_cast<double>(n) * sizeof(float) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(triad)->Name("Triad")->Unit(benchmark::kMillisecond)->UseRealTime();

// Collects every run's GFLOP/s so that main() can print ratios between runs of this process.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration) continue;
      for (const char* counter : {"GFLOP/s", "GB/s"}) {
        const auto it = run.counters.find(counter);
        if (it != run.counters.end()) rates_[run.benchmark_name()] = it->second.value;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  void PrintRatios() const {
    auto rate = [&](const char* impl, int64_t t, int causal, int backward, int threads) {
      char name[160];
      std::snprintf(name, sizeof name, "%s/T:%lld/causal:%d/backward:%d/threads:%d/min_time:0.500/real_time", impl,
                    static_cast<long long>(t), causal, backward, threads);
      const auto it = rates_.find(name);
      return it == rates_.end() ? 0.0 : it->second;
    };
    auto ratio = [](double a, double b) {
      char text[32];
      if (a > 0 && b > 0) {
        std::snprintf(text, sizeof text, "%13.2fx", a / b);
      } else {
        std::snprintf(text, sizeof text, "%14s", "-");
      }
      return std::string(text);
    };
    std::printf("\nRatios in this run (GFLOP/s over GFLOP/s; B=1 H=%lld d=%lld fp32):\n",
                static_cast<long long>(kHeads), static_cast<long long>(kDim));
    std::printf("%6s %10s %14s %14s %14s %14s\n", "T", "pass", "fused GFLOP/s", "fused/ref", "causal/full",
                "2 thr/1 thr");
    for (int64_t t : {256, 1024, 4096}) {
      for (int backward : {0, 1}) {
        const double f = rate("Fused", t, 0, backward, 2);
        if (f == 0) continue;
        std::printf("%6lld %10s %14.1f %s %s %s\n", static_cast<long long>(t), backward ? "fwd+bwd" : "forward", f,
                    ratio(f, rate("Reference", t, 0, backward, 2)).c_str(),
                    ratio(rate("Fused", t, 1, backward, 2), f).c_str(),
                    ratio(f, rate("Fused", t, 0, backward, 1)).c_str());
      }
    }
    const auto decode = rates_.find("Decode/Tk:32768/H:32/d:128/real_time");
    const auto triad = rates_.find("Triad/real_time");
    if (decode != rates_.end() && triad != rates_.end()) {
      std::printf("decode (Tq=1 Tk=32768 H=32 d=128): %.1f GB/s of K and V = %.0f%% of the triad's %.1f GB/s\n",
                  decode->second, 100.0 * decode->second / triad->second, triad->second);
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
