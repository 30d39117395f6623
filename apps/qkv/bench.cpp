// qkv bench: throughput and memory of attention on this machine, with the baselines that give the
// numbers a meaning measured in the same run (the performance targets are ratios, not absolute
// figures: this machine's speed moves too much for those).
//
//   qkv bench                                   # forward, T = 256, 1024, 4096, 8192, B=1 H=8 d=64
//   qkv bench --T 4096 --backward --json        # forward + backward, machine-readable
//   qkv bench --decode                          # Tq = 1, Tk = 32768, H = 32, d = 128 against a triad
//
// Per shape it prints the median time of one call, GFLOP/s and the peak extra memory, and ratios
// against the baselines: the reference (T <= 1024, where it takes seconds, not minutes), one thread
// (when --threads > 1) and the non-causal run (with --causal), timed in alternating rounds with the
// kernel (time_in_rounds) and reported as the median of per-round ratios with their spread. FLOPs:
// the forward 4·B·H·Tq·Tk·d (the same for causal, so skipped blocks show as speed), the backward
// 2.5× that, so forward + backward 3.5×. Decode reports the GB/s of K and V read against a
// streaming triad and a read stream timed in the same rounds.
//
// Memory: Linux lets a process reset its own peak resident set (writing 5 to /proc/self/clear_refs),
// so each measurement reads VmHWM after the run minus VmRSS before it, the inputs, outputs and
// gradients already allocated and touched: "peak extra" is what the kernel itself needed. Where the
// reset is refused, getrusage's ru_maxrss is used instead and "peak extra" only counts what the run
// added above every earlier peak of the process; the output says which method was used.

#include <fmt/format.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"
#include "support/machine_checks.hpp"
#include "support/progress.hpp"

namespace qkv::cli {
namespace {

// The reference materialises Tq×Tk in float64 per head: above this it takes minutes per shape.
constexpr int64_t kReferenceMaxT = 1024;
// Calls shorter than this are repeated within one sample, so that clock resolution and scheduler
// noise stay small against the sample.
constexpr double kMinSampleMs = 20.0;
// A call at least this long is its own warm-up: caches and thread start-up no longer matter.
constexpr double kLongCallMs = 1000.0;
// STREAM's triad over arrays of this many floats (128 MiB each): far larger than any cache.
constexpr int64_t kTriadFloats = int64_t{1} << 25;
constexpr double kForwardFlopsPerMac = 4.0;
constexpr double kBackwardOverForward = 2.5;

constexpr const char* kFooter =
    R"(FLOPs: forward 4·B·H·Tq·Tk·d (counted the same for causal), backward 2.5× forward.
Memory: peak resident set during the measurement (VmHWM, reset through /proc/self/clear_refs) minus
the resident set before it, with inputs, outputs and gradients already allocated ("peak extra").
Baselines: the reference (T <= 1024), 1 thread (when --threads > 1) and the non-causal run (with
--causal); --baselines picks them, "none" skips them. The kernel and its baselines (decode: a triad
and a read stream) are timed in --repeats alternating rounds, and each ratio is the median of the
per-round ratios, printed with its min–max: the machine's speed may drift during a run.
The CPU, its caches and the SIMD target are printed first (--simd-target or QKV_SIMD_TARGET choose it).
Warnings, on stderr at once and after the results (JSON: "warnings"): a load average before the run
that says other programs hold cores the threads need, and a decode whose K and V fit in the
last-level cache (its GB/s are then the cache's).
Progress goes to stderr; stdout holds only the results.
Examples:
  qkv bench --T 1024,4096 --backward
  qkv bench --T 65536 --heads 1 --backward --repeats 1 --baselines none
  qkv bench --decode --json)";

struct BenchOptions {
  std::vector<int64_t> t;
  int64_t d = 64;
  int64_t heads = 8;
  int64_t batch = 1;
  bool causal = false;
  bool backward = false;
  bool decode = false;
  int threads = 0;
  std::string impl = "fused";
  int repeats = 5;
  std::vector<std::string> baselines;
  bool json = false;
  CLI::Option* t_option = nullptr;
  CLI::Option* d_option = nullptr;
  CLI::Option* heads_option = nullptr;
  CLI::Option* threads_option = nullptr;
};

// Decode's shape when --T, --d and --heads are not given: one token of a 32-head model, d = 128,
// against a 32k context.
constexpr int64_t kDecodeTk = 32768;
constexpr int64_t kDecodeHeads = 32;
constexpr int64_t kDecodeDim = 128;

AttentionImpl parse_impl(const std::string& name) {
  if (name == "reference") return AttentionImpl::reference;
  if (name == "auto") return AttentionImpl::automatic;
  return AttentionImpl::fused;
}

// One measurement's memory, read from /proc/self/status (kB) or getrusage.
class PeakMemory {
 public:
  PeakMemory() {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.flush();
    reset_ = clear.good();
    before_ = reset_ ? status_kib("VmRSS:") : rusage_peak_kib();
  }
  // Bytes above the resident set at construction (or above the earlier peak, without the reset).
  double extra_bytes() const { return std::max(0.0, static_cast<double>(peak_kib() - before_) * 1024.0); }
  // The process's peak resident set during the measurement (since the process began, without the reset).
  double peak_bytes() const { return static_cast<double>(peak_kib()) * 1024.0; }
  bool reset() const { return reset_; }

 private:
  int64_t peak_kib() const { return reset_ ? status_kib("VmHWM:") : rusage_peak_kib(); }
  static int64_t rusage_peak_kib() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_maxrss;
  }
  static int64_t status_kib(const std::string& key) {
    std::ifstream status("/proc/self/status");
    std::string word;
    while (status >> word) {
      if (word == key) {
        int64_t kib = 0;
        status >> kib;
        return kib;
      }
    }
    return rusage_peak_kib();
  }

  bool reset_ = false;
  int64_t before_ = 0;
};

std::string memory_method(bool reset) {
  return reset ? "VmHWM after the run minus VmRSS before it (peak reset through /proc/self/clear_refs)"
               : "getrusage ru_maxrss growth (the peak could not be reset: earlier peaks hide smaller ones)";
}

struct Timing {
  double median_ms = 0.0;
  std::vector<double> samples_ms;  // one per round, in round order
  double extra_bytes = 0.0;
  double peak_bytes = 0.0;
  bool memory_reset = false;
};

// The median, least and greatest of a sample.
struct Spread {
  double median = 0.0, min = 0.0, max = 0.0;
};

Spread spread_of(std::vector<double> x) {
  if (x.empty()) return {};
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return {.median = n % 2 == 1 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]), .min = x.front(), .max = x.back()};
}

// The ratio baseline / kernel round by round (a speed-up when both are times), as its spread.
Spread ratio_by_round(const Timing& baseline, const Timing& kernel) {
  std::vector<double> ratios;
  for (size_t r = 0; r < std::min(baseline.samples_ms.size(), kernel.samples_ms.size()); ++r) {
    if (kernel.samples_ms[r] > 0.0) ratios.push_back(baseline.samples_ms[r] / kernel.samples_ms[r]);
  }
  return spread_of(ratios);
}

// Times `calls` (the kernel first, then what it is compared with) in `rounds` rounds, one sample of
// every call per round. This machine's speed can move by half within minutes; a baseline timed a
// minute apart from the kernel would carry that into the ratio, while the calls of one round share
// the minute, so ratios are taken round by round (ratio_by_round). Each call is first run once to
// warm caches and threads (that run of the kernel gives the memory figures), which also sets how
// many calls one sample averages: enough to last kMinSampleMs. When every warm-up took at least
// kLongCallMs, the warm-ups are the first round.
std::vector<Timing> time_in_rounds(const std::vector<std::function<void()>>& calls, int rounds) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point start) {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  };
  std::vector<Timing> timings(calls.size());
  std::vector<int> inner(calls.size(), 1);
  bool all_long = true;
  for (size_t c = 0; c < calls.size(); ++c) {
    const PeakMemory memory;
    const Clock::time_point start = Clock::now();
    calls[c]();
    const double first_ms = since(start);
    timings[c].extra_bytes = memory.extra_bytes();
    timings[c].peak_bytes = memory.peak_bytes();
    timings[c].memory_reset = memory.reset();
    timings[c].samples_ms.push_back(first_ms);
    all_long = all_long && first_ms >= kLongCallMs;
    if (first_ms < kMinSampleMs) {
      inner[c] = static_cast<int>(std::min(1000.0, std::ceil(kMinSampleMs / std::max(first_ms, 1e-3))));
    }
  }
  if (!all_long) {
    for (Timing& t : timings) t.samples_ms.clear();
  }
  for (int round = all_long ? 1 : 0; round < rounds; ++round) {
    for (size_t c = 0; c < calls.size(); ++c) {
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < inner[c]; ++i) calls[c]();
      timings[c].samples_ms.push_back(since(start) / inner[c]);
    }
  }
  for (Timing& t : timings) t.median_ms = spread_of(t.samples_ms).median;
  return timings;
}

// What the kernels are tuned by and run on, for the reports.
std::string cpu_line() { return fmt::format("CPU {}; SIMD {}", cpu_summary(), simd_target()); }

// `text` as the inside of a JSON string: quotes and backslashes escaped, control characters dropped.
std::string json_escape(std::string_view text) {
  std::string escaped;
  for (const char c : text) {
    if (c == '"' || c == '\\') escaped += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) escaped += c;
  }
  return escaped;
}

// The CPU, and the warnings about the machine that the run found, as JSON fields.
std::string machine_json(const std::vector<std::string>& warnings) {
  const CpuInfo& cpu = cpu_info();
  std::vector<std::string> quoted;
  for (const std::string& w : warnings) quoted.push_back(fmt::format("\"{}\"", json_escape(w)));
  return fmt::format(R"("cpu": {{"model": "{}", "l1d_bytes": {}, "l2_bytes": {}, "l3_bytes": {}}}, "warnings": [{}])",
                     json_escape(cpu.model), cpu.l1d_bytes, cpu.l2_bytes, cpu.l3_bytes, fmt::join(quoted, ", "));
}

// Shows a warning at once on stderr (beside the progress lines) and keeps it for the report.
void warn(std::vector<std::string>& warnings, std::optional<std::string> warning) {
  if (!warning) return;
  fmt::print(stderr, "qkv bench: {}\n", *warning);
  warnings.push_back(std::move(*warning));
}

// The warnings again, after the table they qualify.
void print_warnings(const std::vector<std::string>& warnings) {
  if (!warnings.empty()) fmt::print("\n");
  for (const std::string& w : warnings) fmt::print("{}\n", w);
}

// Inputs, outputs and gradients of one problem, allocated and written before any timing so that the
// memory measurement sees only what the kernel adds.
struct Problem {
  Tensor<float> q, k, v, out, lse, dout, dq, dk, dv;

  Problem(int64_t batch, int64_t heads, int64_t tq, int64_t tk, int64_t d, bool backward)
      : q({batch, heads, tq, d}),
        k({batch, heads, tk, d}),
        v({batch, heads, tk, d}),
        out({batch, heads, tq, d}),
        lse({batch, heads, tq}) {
    if (backward) {
      dout = Tensor<float>({batch, heads, tq, d});
      dq = Tensor<float>({batch, heads, tq, d});
      dk = Tensor<float>({batch, heads, tk, d});
      dv = Tensor<float>({batch, heads, tk, d});
    }
    Rng rng(1);
    for (Tensor<float>* t : {&q, &k, &v}) rng.fill_normal(t->view());
    if (backward) rng.fill_normal(dout.view());
  }

  static double bytes(int64_t batch, int64_t heads, int64_t tq, int64_t tk, int64_t d, bool backward) {
    const auto f = static_cast<double>(sizeof(float));
    const double b = static_cast<double>(batch) * static_cast<double>(heads) * static_cast<double>(d) * f;
    const double forward = b * (2.0 * static_cast<double>(tq) + 2.0 * static_cast<double>(tk)) +
                           static_cast<double>(batch * heads * tq) * f;
    return backward ? forward + b * (2.0 * static_cast<double>(tq) + 2.0 * static_cast<double>(tk)) : forward;
  }

  // One forward asking for out alone, as inference does, or a forward with lse (what training saves)
  // and a backward (the gradients accumulate; only time matters).
  void run(bool causal, bool backward, AttentionImpl impl) {
    AttentionParams<float> params{.q = q.cview(), .k = k.cview(), .v = v.cview(), .scale = {}, .mask = {}};
    params.mask.causal = causal;
    AttentionOutputs<float> outputs{.out = out.view(), .weights = {}, .lse = {}};
    if (backward) outputs.lse = lse.view();
    attention_forward(params, outputs, impl);
    if (backward) {
      attention_backward<float>(params, dout.cview(), {.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}},
                                AttentionSaved<float>{.out = out.cview(), .lse = lse.cview()}, impl);
    }
  }
};

struct Baseline {
  std::string name;  // reference, one_thread, non_causal
  Timing timing;
  Spread speedup;  // the baseline's time over the kernel's, round by round
};

struct Result {
  int64_t tq = 0, tk = 0;
  double flops = 0.0;
  double tensor_bytes = 0.0;
  Timing timing;
  std::vector<Baseline> baselines;
};

bool wants(const BenchOptions& o, const std::string& baseline) {
  return std::find(o.baselines.begin(), o.baselines.end(), "none") == o.baselines.end() &&
         (o.baselines.empty() || std::find(o.baselines.begin(), o.baselines.end(), baseline) != o.baselines.end());
}

void check_options(const BenchOptions& o) {
  for (const int64_t t : o.t) {
    if (t < 1) throw ValueError(fmt::format("--T: expected sizes >= 1, got {}", t));
  }
  if (o.d < 1) throw ValueError(fmt::format("--d: expected >= 1, got {}", o.d));
  if (o.heads < 1) throw ValueError(fmt::format("--heads: expected >= 1, got {}", o.heads));
  if (o.batch < 1) throw ValueError(fmt::format("--batch: expected >= 1, got {}", o.batch));
  if (o.threads < 1) throw ValueError(fmt::format("--threads: expected >= 1, got {}", o.threads));
  if (o.repeats < 1) throw ValueError(fmt::format("--repeats: expected >= 1, got {}", o.repeats));
  if (o.decode && o.backward) throw ValueError("--backward: decode (--decode) times the forward only, got both");
  if (o.decode && o.causal) {
    throw ValueError("--causal: decode (--decode) has Tq = 1, whose one query sees every key anyway, got both");
  }
}

std::string json_timing(const Timing& t, double flops) {
  return fmt::format(R"("median_ms": {:.6g}, "gflops": {:.6g}, "peak_extra_bytes": {:.0f}, "peak_rss_bytes": {:.0f})",
                     t.median_ms, flops * 1e-9 / (t.median_ms * 1e-3), t.extra_bytes, t.peak_bytes);
}

// Every --T of the attention benchmark, with its baselines.
std::vector<Result> measure_attention(const BenchOptions& o) {
  const AttentionImpl impl = parse_impl(o.impl);
  const std::vector<int64_t> sizes = o.t.empty() ? std::vector<int64_t>{256, 1024, 4096, 8192} : o.t;
  const double mac_factor = kForwardFlopsPerMac * (o.backward ? 1.0 + kBackwardOverForward : 1.0);
  Progress progress("[bench] attention", std::ssize(sizes), "shapes");
  std::vector<Result> results;
  for (const int64_t t : sizes) {
    const double bytes = Problem::bytes(o.batch, o.heads, t, t, o.d, o.backward);
    check_allocation_fits(bytes, fmt::format("qkv bench at T = {}", t));
    Problem p(o.batch, o.heads, t, t, o.d, o.backward);
    set_max_workers(o.threads);
    // The kernel and its baselines, timed in alternating rounds.
    std::vector<std::string> names;
    std::vector<std::function<void()>> calls = {[&] { p.run(o.causal, o.backward, impl); }};
    if (impl != AttentionImpl::reference && t <= kReferenceMaxT && wants(o, "reference")) {
      names.emplace_back("reference");
      calls.emplace_back([&] { p.run(o.causal, o.backward, AttentionImpl::reference); });
    }
    if (o.threads > 1 && wants(o, "threads")) {
      names.emplace_back("one_thread");
      calls.emplace_back([&] {
        set_max_workers(1);
        p.run(o.causal, o.backward, impl);
        set_max_workers(o.threads);
      });
    }
    if (o.causal && wants(o, "causal")) {
      names.emplace_back("non_causal");
      calls.emplace_back([&] { p.run(false, o.backward, impl); });
    }
    progress.update(std::ssize(results),
                    fmt::format("T={} {}{}{}", t, o.impl, names.empty() ? "" : " and ", fmt::join(names, ", ")));
    const std::vector<Timing> timings = time_in_rounds(calls, o.repeats);
    Result r{.tq = t,
             .tk = t,
             .flops = mac_factor * static_cast<double>(o.batch * o.heads) * static_cast<double>(t) *
                      static_cast<double>(t) * static_cast<double>(o.d),
             .tensor_bytes = bytes,
             .timing = timings.front(),
             .baselines = {}};
    for (size_t b = 0; b < names.size(); ++b) {
      r.baselines.push_back({names[b], timings[b + 1], ratio_by_round(timings[b + 1], timings.front())});
    }
    results.push_back(std::move(r));
  }
  progress.done();
  return results;
}

void report_attention(const BenchOptions& o, const std::vector<Result>& results,
                      const std::vector<std::string>& warnings) {
  const std::string mode = o.backward ? "forward+backward" : "forward";
  const bool reset = results.empty() || results.front().timing.memory_reset;
  if (o.json) {
    std::vector<std::string> rows;
    for (const Result& r : results) {
      std::vector<std::string> baselines;
      for (const Baseline& b : r.baselines) {
        baselines.push_back(
            fmt::format(R"("{}": {{{}, "speedup": {:.6g}, "speedup_min": {:.6g}, "speedup_max": {:.6g}}})", b.name,
                        json_timing(b.timing, r.flops), b.speedup.median, b.speedup.min, b.speedup.max));
      }
      rows.push_back(
          fmt::format(R"(    {{"Tq": {}, "Tk": {}, "flops": {:.6g}, "tensor_bytes": {:.0f}, {}, "baselines": {{{}}}}})",
                      r.tq, r.tk, r.flops, r.tensor_bytes, json_timing(r.timing, r.flops), fmt::join(baselines, ", ")));
    }
    fmt::print(
        "{{\n  \"mode\": \"{}\", \"impl\": \"{}\", \"simd\": \"{}\", {}, \"dtype\": \"float32\", \"batch\": {}, "
        "\"heads\": {}, \"d\": {}, \"causal\": {}, \"threads\": {}, \"repeats\": {},\n  \"memory_method\": \"{}\",\n"
        "  \"results\": [\n{}\n  ]\n}}\n",
        mode, o.impl, simd_target(), machine_json(warnings), o.batch, o.heads, o.d, o.causal, o.threads, o.repeats,
        memory_method(reset), fmt::join(rows, ",\n"));
    std::fflush(stdout);
    return;
  }
  fmt::print("qkv bench: {}{}, fp32, B={} H={} d={}, {} thread{}, impl {}, median of {} rounds\n", mode,
             o.causal ? " causal" : "", o.batch, o.heads, o.d, o.threads, o.threads == 1 ? "" : "s", o.impl, o.repeats);
  fmt::print("{}\n", cpu_line());
  fmt::print("memory: {}\n\n", memory_method(reset));
  fmt::print("{:>7}  {:>11}  {:>9}  {:>11}  {:>11}  {:>11}  {}\n", "T", "median ms", "GFLOP/s", "peak extra",
             "peak RSS", "tensors", "speedup against baselines: median of rounds (min–max; their ms)");
  for (const Result& r : results) {
    std::vector<std::string> against;
    for (const Baseline& b : r.baselines) {
      against.push_back(fmt::format("{:.2f}× {} ({:.2f}–{:.2f}; {:.3g})", b.speedup.median, b.name, b.speedup.min,
                                    b.speedup.max, b.timing.median_ms));
    }
    fmt::print("{:>7}  {:>11.3f}  {:>9.1f}  {:>11}  {:>11}  {:>11}  {}\n", r.tq, r.timing.median_ms,
               r.flops * 1e-9 / (r.timing.median_ms * 1e-3), format_bytes(r.timing.extra_bytes),
               format_bytes(r.timing.peak_bytes), format_bytes(r.tensor_bytes), fmt::join(against, ", "));
  }
  print_warnings(warnings);
  std::fflush(stdout);
}

// Enough chunks that both threads stream from start to end without waiting for each other.
constexpr int64_t kStreamChunks = 256;

// a = b + s·c on every thread; its GB/s counts three arrays of traffic, as STREAM does.
class Triad {
 public:
  Triad() {
    check_allocation_fits(bytes(), "qkv bench --decode's triad");
    a_.assign(static_cast<size_t>(kTriadFloats), 0.0f);
    b_.assign(static_cast<size_t>(kTriadFloats), 1.0f);
    c_.assign(static_cast<size_t>(kTriadFloats), 2.0f);
  }
  static double bytes() { return 3.0 * static_cast<double>(kTriadFloats) * sizeof(float); }
  void run() {
    parallel_for(kStreamChunks, [&](int64_t chunk, int /*worker*/) {
      const auto begin = static_cast<size_t>(chunk * kTriadFloats / kStreamChunks);
      const auto end = static_cast<size_t>((chunk + 1) * kTriadFloats / kStreamChunks);
      for (size_t i = begin; i < end; ++i) a_[i] = b_[i] + 3.0f * c_[i];
    });
  }

 private:
  std::vector<float> a_, b_, c_;
};

// Reading alone, the traffic of decode: an integer sum (which the compiler vectorises, unlike a
// float one) over as many bytes as the triad's three arrays. On some machines a pure read stream
// is slower than the triad's mix of reads and writes; decode's K and V are such a stream.
class ReadStream {
 public:
  ReadStream() {
    check_allocation_fits(bytes(), "qkv bench --decode's read stream");
    x_.assign(static_cast<size_t>(kElements), 1);
    sums_.assign(static_cast<size_t>(kStreamChunks), 0);
  }
  static double bytes() { return static_cast<double>(kElements) * sizeof(uint32_t); }
  void run() {
    parallel_for(kStreamChunks, [&](int64_t chunk, int /*worker*/) {
      const auto begin = static_cast<size_t>(chunk * kElements / kStreamChunks);
      const auto end = static_cast<size_t>((chunk + 1) * kElements / kStreamChunks);
      uint32_t sum = 0;
      for (size_t i = begin; i < end; ++i) sum += x_[i];
      sums_[static_cast<size_t>(chunk)] = sum;
    });
    if (std::reduce(sums_.begin(), sums_.end(), uint64_t{0}) != static_cast<uint64_t>(kElements)) {
      throw ResourceError("qkv bench: the read stream summed wrongly");
    }
  }

 private:
  static constexpr int64_t kElements = 3 * kTriadFloats;
  std::vector<uint32_t> x_;
  std::vector<uint32_t> sums_;
};

// One decode shape against the two streams of its rounds: GB/s of each, and decode's K and V
// traffic as a fraction of each stream's, round by round.
struct DecodeResult {
  Result result;
  double kv_gbs = 0.0, triad_gbs = 0.0, read_gbs = 0.0;
  Spread of_triad, of_read;
};

Spread scaled(Spread s, double factor) { return {s.median * factor, s.min * factor, s.max * factor}; }

std::string json_spread(const std::string& name, const Spread& s) {
  return fmt::format(R"("{0}": {1:.6g}, "{0}_min": {2:.6g}, "{0}_max": {3:.6g})", name, s.median, s.min, s.max);
}

// Decode's heads and head dimension: the options', else decode's own defaults.
int64_t decode_heads(const BenchOptions& o) { return o.heads_option->count() > 0 ? o.heads : kDecodeHeads; }
int64_t decode_dim(const BenchOptions& o) { return o.d_option->count() > 0 ? o.d : kDecodeDim; }

// Every --T (Tk) of the decode benchmark, each in rounds with the two streams.
std::vector<DecodeResult> measure_decode(const BenchOptions& o, std::vector<std::string>& warnings) {
  const AttentionImpl impl = parse_impl(o.impl);
  const std::vector<int64_t> sizes = o.t_option->count() > 0 ? o.t : std::vector<int64_t>{kDecodeTk};
  const int64_t heads = decode_heads(o);
  const int64_t d = decode_dim(o);
  set_max_workers(o.threads);
  Progress progress("[bench] decode", std::ssize(sizes), "shapes");
  Triad triad;
  ReadStream read;
  std::vector<DecodeResult> results;
  for (const int64_t tk : sizes) {
    const double bytes = Problem::bytes(o.batch, heads, 1, tk, d, false);
    check_allocation_fits(bytes, fmt::format("qkv bench --decode at Tk = {}", tk));
    progress.update(std::ssize(results), fmt::format("Tk={} {}, triad and read stream", tk, o.impl));
    Problem p(o.batch, heads, 1, tk, d, false);
    const std::vector<Timing> timings =
        time_in_rounds({[&] { p.run(false, false, impl); }, [&] { triad.run(); }, [&] { read.run(); }}, o.repeats);
    // The bytes decode must stream: K and V once.
    const double kv_bytes = 2.0 * static_cast<double>(o.batch * heads * tk * d) * sizeof(float);
    warn(warnings,
         cache_resident_warning(fmt::format("decode at Tk = {} (K and V)", tk), kv_bytes, cpu_info().l3_bytes));
    const auto gbs = [](double bytes_moved, const Timing& t) { return bytes_moved * 1e-9 / (t.median_ms * 1e-3); };
    results.push_back({.result = {.tq = 1,
                                  .tk = tk,
                                  .flops = kForwardFlopsPerMac * static_cast<double>(o.batch * heads) *
                                           static_cast<double>(tk) * static_cast<double>(d),
                                  .tensor_bytes = bytes,
                                  .timing = timings[0],
                                  .baselines = {}},
                       .kv_gbs = gbs(kv_bytes, timings[0]),
                       .triad_gbs = gbs(Triad::bytes(), timings[1]),
                       .read_gbs = gbs(ReadStream::bytes(), timings[2]),
                       .of_triad = scaled(ratio_by_round(timings[1], timings[0]), kv_bytes / Triad::bytes()),
                       .of_read = scaled(ratio_by_round(timings[2], timings[0]), kv_bytes / ReadStream::bytes())});
  }
  progress.done();
  return results;
}

void report_decode(const BenchOptions& o, const std::vector<DecodeResult>& results,
                   const std::vector<std::string>& warnings) {
  const int64_t heads = decode_heads(o);
  const int64_t d = decode_dim(o);
  const bool reset = results.empty() || results.front().result.timing.memory_reset;
  if (o.json) {
    std::vector<std::string> rows;
    for (const DecodeResult& r : results) {
      rows.push_back(fmt::format(
          R"(    {{"Tq": 1, "Tk": {}, "flops": {:.6g}, "tensor_bytes": {:.0f}, {}, "gbs": {:.6g}, "triad_gbs": {:.6g}, )"
          R"("read_gbs": {:.6g}, {}, {}}})",
          r.result.tk, r.result.flops, r.result.tensor_bytes, json_timing(r.result.timing, r.result.flops), r.kv_gbs,
          r.triad_gbs, r.read_gbs, json_spread("triad_fraction", r.of_triad), json_spread("read_fraction", r.of_read)));
    }
    // The first shape's streams at the top level too, for readers of one shape.
    const double triad_gbs = results.empty() ? 0.0 : results.front().triad_gbs;
    const double read_gbs = results.empty() ? 0.0 : results.front().read_gbs;
    fmt::print(
        "{{\n  \"mode\": \"decode\", \"impl\": \"{}\", \"simd\": \"{}\", {}, \"dtype\": \"float32\", \"batch\": {}, "
        "\"heads\": {}, \"d\": {}, \"threads\": {}, \"repeats\": {}, \"triad_gbs\": {:.6g}, \"read_gbs\": {:.6g},\n  "
        "\"memory_method\": \"{}\",\n  \"results\": [\n{}\n  ]\n}}\n",
        o.impl, simd_target(), machine_json(warnings), o.batch, heads, d, o.threads, o.repeats, triad_gbs, read_gbs,
        memory_method(reset), fmt::join(rows, ",\n"));
    std::fflush(stdout);
    return;
  }
  fmt::print("qkv bench: decode (Tq = 1), fp32, B={} H={} d={}, {} thread{}, impl {}, median of {} rounds\n", o.batch,
             heads, d, o.threads, o.threads == 1 ? "" : "s", o.impl, o.repeats);
  fmt::print("{}\n", cpu_line());
  fmt::print("roofs, timed in the same rounds: a streaming triad a = b + s·c over 3 × {} arrays, and a read\n",
             format_bytes(kTriadFloats * 4.0));
  fmt::print("stream alone over {}; fractions are medians of per-round ratios (min–max)\n",
             format_bytes(kTriadFloats * 12.0));
  fmt::print("memory: {}\n\n", memory_method(reset));
  fmt::print("{:>7}  {:>11}  {:>9}  {:>9}  {:>18}  {:>9}  {:>18}  {:>9}  {:>11}\n", "Tk", "median ms", "GB/s K+V",
             "triad", "of triad", "read", "of read", "GFLOP/s", "peak extra");
  const auto percent = [](const Spread& s) {
    return fmt::format("{:.0f}% ({:.0f}–{:.0f}%)", 100.0 * s.median, 100.0 * s.min, 100.0 * s.max);
  };
  for (const DecodeResult& r : results) {
    fmt::print("{:>7}  {:>11.3f}  {:>9.1f}  {:>9.1f}  {:>18}  {:>9.1f}  {:>18}  {:>9.1f}  {:>11}\n", r.result.tk,
               r.result.timing.median_ms, r.kv_gbs, r.triad_gbs, percent(r.of_triad), r.read_gbs, percent(r.of_read),
               r.result.flops * 1e-9 / (r.result.timing.median_ms * 1e-3), format_bytes(r.result.timing.extra_bytes));
  }
  print_warnings(warnings);
  std::fflush(stdout);
}

void run_bench(BenchOptions& o) {
  if (o.threads_option->count() == 0) o.threads = max_workers();
  check_options(o);
  const int saved_workers = max_workers();
  std::vector<std::string> warnings;
  // Read before the run starts, when none of the load is the run's own.
  if (const std::optional<double> load = load_average()) {
    warn(warnings, busy_machine_warning(*load, static_cast<int>(std::thread::hardware_concurrency()), o.threads));
  }
  if (o.decode) {
    const std::vector<DecodeResult> results = measure_decode(o, warnings);
    report_decode(o, results, warnings);
  } else {
    const std::vector<Result> results = measure_attention(o);
    report_attention(o, results, warnings);
  }
  set_max_workers(saved_workers);
}

}  // namespace

void register_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand("bench", "time attention on this machine: GFLOP/s, memory, ratios to baselines");
  cmd->footer(kFooter);
  o->t_option = cmd->add_option("--T", o->t,
                                "sequence lengths Tq = Tk, comma-separated (default 256,1024,4096,8192; "
                                "with --decode: Tk, default 32768)")
                    ->delimiter(',')
                    ->type_name("T,...");
  o->d_option = cmd->add_option("--d", o->d, "head dimension Dk = Dv (default 64; with --decode 128)");
  o->heads_option = cmd->add_option("--heads", o->heads, "heads H (default 8; with --decode 32)");
  cmd->add_option("--batch", o->batch, "batch B")->capture_default_str();
  cmd->add_flag("--causal", o->causal, "causal mask (blocks above the diagonal are skipped)");
  cmd->add_flag("--backward", o->backward, "time forward + backward (the gradients of all of Q, K and V)");
  cmd->add_flag("--decode", o->decode, "decode: one query against many keys, in GB/s against a streaming triad");
  o->threads_option = cmd->add_option("--threads", o->threads, "threads (default: OpenMP's, here the cores)");
  cmd->add_option("--impl", o->impl, "fused, reference or auto")
      ->check(CLI::IsMember({"fused", "reference", "auto"}))
      ->capture_default_str();
  cmd->add_option("--repeats", o->repeats,
                  "rounds: timed samples of the kernel and of each baseline; medians are reported")
      ->capture_default_str();
  cmd->add_option(
         "--baselines", o->baselines,
         "baselines to measure, comma-separated: reference, threads, causal, or none (default: all that apply)")
      ->delimiter(',')
      ->check(CLI::IsMember({"reference", "threads", "causal", "none"}))
      ->type_name("LIST");
  cmd->add_flag("--json", o->json, "print the results as JSON");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace qkv::cli
