// qkv bench: throughput and memory of attention on this machine, with the baselines that give the
// numbers a meaning measured in the same run (the performance targets are ratios, not absolute
// figures: this machine's speed moves too much for those).
//
//   qkv bench                                   # forward, T = 256, 1024, 4096, 8192, B=1 H=8 d=64
//   qkv bench --T 4096 --backward --json        # forward + backward, machine-readable
//   qkv bench --decode                          # Tq = 1, Tk = 32768, H = 32, d = 128 against a triad
//   qkv bench --compare gqa --kv-heads 2        # a variant against the call without it, one ratio
//   qkv bench --decode --kv-dtype f16           # K and V stored as float16 against float32 ones
//   qkv bench --decode --kv-cache               # decode from a paged KvCache against contiguous K and V
//
// Per shape it prints the median time of one call, GFLOP/s and the peak extra memory, and ratios
// against the baselines: the reference (T <= 1024, where it takes seconds, not minutes), one thread
// (when --threads > 1) and the non-causal run (with --causal), timed in alternating rounds with the
// kernel (time_in_rounds) and reported as the median of per-round ratios with their spread. FLOPs:
// the forward 4·B·H·Tq·Tk·d (the same for causal, so skipped blocks show as speed), the backward
// 2.5× that, so forward + backward 3.5×. Decode reports the GB/s of K and V read against a
// streaming triad and a read stream timed in the same rounds.
//
// The variants (--kv-heads, --window, --softcap, --alibi, --sinks, --varlen, --dropout) change the
// call that every row times, baselines included. --compare times one variant against the same call
// without it in the same rounds, with FLOPs counted over the (q, k) pairs each call's mask leaves
// visible, so that a window's or a packed batch's skipped work is not counted as speed.
//
// --kv-dtype float16|bfloat16|int8 stores K and V so (int8: K's scales per channel, V's per token)
// and adds the same call on float32 K and V as a baseline of the same rounds: decode then reports
// the GB/s of the stored K and V against the triad and its tokens per second over float32's.
// --decode --kv-cache decodes from a paged KvCache (pages of kBenchPageTokens) holding the same K
// and V, against the contiguous ones in the same rounds, and times the append of one token to
// another sequence of the cache, as a fraction of the decode step.
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
#include <charconv>
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

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/kv_cache.hpp"
#include "qkv/ops/quantize.hpp"
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
// --varlen random: as many sequences as a training batch packs, of lengths from short to long.
constexpr int64_t kRandomSequences = 16;
constexpr int64_t kRandomMinLength = 100;
constexpr int64_t kRandomMaxLength = 4000;

constexpr const char* kFooter =
    R"(FLOPs: forward 4·B·H·Tq·Tk·d (counted the same for causal), backward 2.5× forward; "vis GFLOP/s"
(JSON: visible_flops) counts only the (q, k) pairs that causality, --window and --varlen leave.
Memory: peak resident set during the measurement (VmHWM, reset through /proc/self/clear_refs) minus
the resident set before it, with inputs, outputs and gradients already allocated ("peak extra").
Baselines: the reference (T <= 1024), 1 thread (when --threads > 1), the non-causal run (with
--causal) and float32 K and V (with --kv-dtype); --baselines picks them, "none" skips them. The kernel and its baselines (decode: a triad
and a read stream) are timed in --repeats alternating rounds, and each ratio is the median of the
per-round ratios, printed with its min–max: the machine's speed may drift during a run.
The CPU, its caches and the SIMD target are printed first (--simd-target or QKV_SIMD_TARGET choose it).
Warnings, on stderr at once and after the results (JSON: "warnings"): a load average before the run
that says other programs hold cores the threads need, and a decode whose K and V fit in the
last-level cache (its GB/s are then the cache's).
Progress goes to stderr; stdout holds only the results.
Variants change the call that is timed, baselines included, and the report names them: --kv-heads
(grouped-query attention), --window, --softcap, --alibi (the standard slopes), --sinks, --dropout
(with --seed) and --varlen (one packed batch, B = 1, T = the sum of the lengths; "random" draws 16
lengths from 100 to 4000 with --seed).
--compare times one variant against the same call without it, in the same rounds, and prints the
ratio of their GFLOP/s, each counted over the (q, k) pairs its mask leaves visible:
  gqa     the call with --kv-heads against K and V with --heads heads (the same FLOPs)
  window  the call with --window against the same call without it (add --causal for a causal band)
  varlen  the packed --varlen batch against separate calls, one per sequence, and against the
          sequences padded to the longest ([N, H, Tmax, d] with a key mask), all counted over the
          packed batch's pairs
Examples:
  qkv bench --T 1024,4096 --backward
  qkv bench --T 65536 --heads 1 --backward --repeats 1 --baselines none
  qkv bench --decode --json
  qkv bench --compare gqa --heads 32 --kv-heads 8 --T 4096
  qkv bench --compare window --T 16384 --window 1024,0 --causal
  qkv bench --compare varlen --varlen random --causal)";

struct BenchOptions {
  std::vector<int64_t> t;
  int64_t d = 64;
  int64_t heads = 8;
  int64_t kv_heads = 0;
  int64_t batch = 1;
  bool causal = false;
  std::string window;  // "L,R"
  double softcap = 0.0;
  bool alibi = false;
  bool sinks = false;
  std::string varlen;  // comma-separated lengths, or "random"
  double dropout = 0.0;
  uint64_t seed = 0;
  std::string compare;  // gqa, window or varlen
  bool backward = false;
  bool decode = false;
  std::string kv_dtype = "float32";
  std::string q_dtype = "float32";
  bool kv_cache = false;
  int threads = 0;
  std::string impl = "fused";
  int repeats = 5;
  std::vector<std::string> baselines;
  bool json = false;
  CLI::Option* t_option = nullptr;
  CLI::Option* d_option = nullptr;
  CLI::Option* heads_option = nullptr;
  CLI::Option* kv_heads_option = nullptr;
  CLI::Option* softcap_option = nullptr;
  CLI::Option* dropout_option = nullptr;
  CLI::Option* batch_option = nullptr;
  CLI::Option* seed_option = nullptr;
  CLI::Option* threads_option = nullptr;
};

// The attention variant of one timed call: what its params carry besides Q, K and V.
struct Variant {
  int64_t kv_heads = 0;  // K's and V's heads: H unless grouped
  bool causal = false;
  std::optional<AttentionWindow> window;
  std::optional<double> softcap;
  bool alibi = false;
  bool sinks = false;
  std::optional<AttentionDropout> dropout;
  // The lengths of the sequences packed into one batch entry (cu_seqlens); empty: not packed.
  std::vector<int64_t> packed;
  // Batch entry b sees only its first key_lengths[b] keys (a key mask, as padding needs); empty: all.
  std::vector<int64_t> key_lengths;
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
std::string cpu_line() {
  const char* bf16 = !attention_bf16_products() ? ""
                     : attention_bf16_tiles()   ? " with bf16 products on AMX tiles"
                                                : " with bf16 dot products";
  return fmt::format("CPU {}; SIMD {}{}", cpu_summary(), simd_target(), bf16);
}

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
// memory measurement sees only what the kernel adds. K and V have variant.kv_heads heads.
struct Problem {
  Tensor<float> q, k, v, out, lse, dout, dq, dk, dv;
  std::optional<Tensor<float>> alibi, sinks, dsinks;  // [H]
  std::optional<Tensor<int64_t>> cu_seqlens;          // [N+1], of queries and keys alike
  std::optional<Tensor<uint8_t>> allowed;             // [B, 1, 1, Tk]
  // K and V in the storage type of --kv-dtype (float32: k and v above).
  StorageType kv_type = StorageType::float32;
  StorageType q_type = StorageType::float32;
  Tensor<uint16_t> q_bits, k_bits, v_bits;
  std::optional<Int8Array> k_int8, v_int8;

  Problem(int64_t batch, int64_t heads, int64_t tq, int64_t tk, int64_t d, bool backward, const Variant& variant)
      : q({batch, heads, tq, d}),
        k({batch, variant.kv_heads, tk, d}),
        v({batch, variant.kv_heads, tk, d}),
        out({batch, heads, tq, d}),
        lse({batch, heads, tq}) {
    if (backward) {
      dout = Tensor<float>({batch, heads, tq, d});
      dq = Tensor<float>({batch, heads, tq, d});
      dk = Tensor<float>({batch, variant.kv_heads, tk, d});
      dv = Tensor<float>({batch, variant.kv_heads, tk, d});
    }
    Rng rng(1);
    for (Tensor<float>* t : {&q, &k, &v}) rng.fill_normal(t->view());
    if (backward) rng.fill_normal(dout.view());
    if (variant.alibi) {
      const std::vector<double> slopes = alibi_slopes(heads);
      alibi = Tensor<float>(Shape{heads}, std::vector<float>(slopes.begin(), slopes.end()));
    }
    if (variant.sinks) {
      sinks = Tensor<float>(Shape{heads});
      rng.fill_normal(sinks->view());
      if (backward) dsinks = Tensor<float>(Shape{heads});
    }
    if (!variant.packed.empty()) {
      std::vector<int64_t> offsets{0};
      for (const int64_t length : variant.packed) offsets.push_back(offsets.back() + length);
      const Shape shape{std::ssize(offsets)};
      cu_seqlens = Tensor<int64_t>(shape, std::move(offsets));
    }
    if (!variant.key_lengths.empty()) {
      allowed = Tensor<uint8_t>(Shape{batch, 1, 1, tk});
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t j = 0; j < variant.key_lengths[static_cast<size_t>(b)]; ++j) allowed->view()(b, 0, 0, j) = 1;
      }
    }
  }

  static double bytes(int64_t batch, int64_t heads, int64_t kv_heads, int64_t tq, int64_t tk, int64_t d,
                      bool backward) {
    const auto f = static_cast<double>(sizeof(float));
    const double per_token = static_cast<double>(batch) * static_cast<double>(d) * f;
    // Q and Out, K and V; their gradients the same again.
    const double tensors =
        per_token * (2.0 * static_cast<double>(heads * tq) + 2.0 * static_cast<double>(kv_heads * tk));
    const double forward = tensors + static_cast<double>(batch * heads * tq) * f;
    return backward ? forward + tensors : forward;
  }

  // Q stored as `type` (float32, float16 or bfloat16), read by the runs on stored K and V.
  void store_q(StorageType type) {
    q_type = type;
    if (type == StorageType::float16) q_bits = to_float16(q.cview());
    if (type == StorageType::bfloat16) q_bits = to_bfloat16(q.cview());
  }

  // K and V stored as `type`, read by every run but those on float32 K and V.
  void store_kv(StorageType type) {
    kv_type = type;
    if (type == StorageType::float16) {
      k_bits = to_float16(k.cview());
      v_bits = to_float16(v.cview());
    } else if (type == StorageType::bfloat16) {
      k_bits = to_bfloat16(k.cview());
      v_bits = to_bfloat16(v.cview());
    } else if (type == StorageType::int8) {
      k_int8 = quantize_int8(k.cview(), QuantizeGroup::per_channel);
      v_int8 = quantize_int8(v.cview(), QuantizeGroup::per_token);
    }
  }

  StoredView stored(const Tensor<float>& x, const Tensor<uint16_t>& bits, const std::optional<Int8Array>& int8,
                    StorageType type) const {
    switch (type) {
      case StorageType::float16:
        return StoredView::float16(bits.cview());
      case StorageType::bfloat16:
        return StoredView::bfloat16(bits.cview());
      case StorageType::int8:
        return int8->stored();
      case StorageType::float32:
        break;
    }
    return StoredView::float32(x.cview());
  }

  // One forward asking for out alone, as inference does, or a forward with lse (what training saves)
  // and a backward (the gradients accumulate; only time matters). `variant` is the problem's, or
  // one with less of it (no window, not causal): the arrays it needs are the problem's. K and V
  // are the stored ones unless `float32_kv`.
  void run(const Variant& variant, bool backward, AttentionImpl impl, bool float32_kv = false) {
    const auto view = [](const auto& tensor) { return tensor ? std::optional(tensor->cview()) : std::nullopt; };
    const bool packed = !variant.packed.empty();
    AttentionParams<float> params{.q = q.cview(),
                                  .k = k.cview(),
                                  .v = v.cview(),
                                  .scale = {},
                                  .mask = {.causal = variant.causal,
                                           .window = variant.window,
                                           .allowed = variant.key_lengths.empty() ? std::nullopt : view(allowed),
                                           .bias = {},
                                           .alibi_slopes = variant.alibi ? view(alibi) : std::nullopt,
                                           .cu_seqlens_q = packed ? view(cu_seqlens) : std::nullopt,
                                           .cu_seqlens_k = packed ? view(cu_seqlens) : std::nullopt},
                                  .softcap = variant.softcap,
                                  .sinks = variant.sinks ? view(sinks) : std::nullopt,
                                  .dropout = variant.dropout};
    AttentionOutputs<float> outputs{.out = out.view(), .weights = {}, .lse = {}};
    if (backward) outputs.lse = lse.view();
    if (kv_type != StorageType::float32 && !float32_kv) {
      const StoredAttentionParams stored_params{.q = stored(q, q_bits, std::nullopt, q_type),
                                                .k = stored(k, k_bits, k_int8, kv_type),
                                                .v = stored(v, v_bits, v_int8, kv_type),
                                                .scale = params.scale,
                                                .mask = params.mask,
                                                .softcap = params.softcap,
                                                .sinks = params.sinks};
      attention_forward(stored_params, outputs, impl);
      if (backward) {
        attention_backward(stored_params, dout.cview(),
                           {.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}, .dsinks = {}},
                           AttentionSaved<float>{.out = out.cview(), .lse = lse.cview()}, impl);
      }
      return;
    }
    attention_forward(params, outputs, impl);
    if (backward) {
      const AttentionGradients<float> grads{.dq = dq.view(),
                                            .dk = dk.view(),
                                            .dv = dv.view(),
                                            .dbias = {},
                                            .dsinks = params.sinks ? std::optional(dsinks->view()) : std::nullopt};
      attention_backward<float>(params, dout.cview(), grads,
                                AttentionSaved<float>{.out = out.cview(), .lse = lse.cview()}, impl);
    }
  }
};

// The (q, k) pairs of one Tq×Tk sequence that causality and the window leave visible, with the
// library's bottom-right alignment.
double visible_pairs(int64_t tq, int64_t tk, const Variant& variant) {
  const int64_t diagonal = tk - tq;
  int64_t lo = -tk, hi = tk;  // j − i, unbounded within the sequence
  if (variant.window && variant.window->left >= 0) lo = diagonal - variant.window->left;
  if (variant.window && variant.window->right >= 0) hi = diagonal + variant.window->right;
  if (variant.causal) hi = std::min(hi, diagonal);
  double pairs = 0.0;
  for (int64_t i = 0; i < tq; ++i) {
    const int64_t first = std::max<int64_t>(0, i + lo), last = std::min(tk - 1, i + hi);
    if (last >= first) pairs += static_cast<double>(last - first + 1);
  }
  return pairs;
}

// The sequence lengths of a problem of `batch` entries of t tokens: the packed ones, else `batch`
// sequences of t.
std::vector<int64_t> sequences(int64_t batch, int64_t t, const Variant& variant) {
  return variant.packed.empty() ? std::vector<int64_t>(static_cast<size_t>(batch), t) : variant.packed;
}

// FLOPs of one call (forward, or forward + backward as `mac_factor` says) over every (q, k) pair
// of each sequence, or only over those the mask leaves visible.
double flops_of(const std::vector<int64_t>& lengths, int64_t heads, int64_t d, double mac_factor,
                const Variant& variant, bool visible_only) {
  double pairs = 0.0;
  for (const int64_t t : lengths) {
    pairs += visible_only ? visible_pairs(t, t, variant) : static_cast<double>(t) * static_cast<double>(t);
  }
  return mac_factor * static_cast<double>(heads) * static_cast<double>(d) * pairs;
}

struct Baseline {
  std::string name;  // reference, one_thread, non_causal
  Timing timing;
  Spread speedup;  // the baseline's time over the kernel's, round by round
};

struct Result {
  int64_t tq = 0, tk = 0;
  double flops = 0.0;
  double visible_flops = 0.0;  // over the (q, k) pairs the mask leaves visible
  double tensor_bytes = 0.0;
  Timing timing;
  std::vector<Baseline> baselines;
};

bool wants(const BenchOptions& o, const std::string& baseline) {
  return std::find(o.baselines.begin(), o.baselines.end(), "none") == o.baselines.end() &&
         (o.baselines.empty() || std::find(o.baselines.begin(), o.baselines.end(), baseline) != o.baselines.end());
}

// The storage of K and V, by its full name, and as the report's header says it.
std::string kv_name(const BenchOptions& o) {
  return std::string(storage_name(parse_storage(o.kv_dtype, "--kv-dtype")));
}
std::string kv_text(const BenchOptions& o) {
  const std::string name = kv_name(o);
  const std::string_view q = storage_name(parse_storage(o.q_dtype, "--q-dtype"));
  return name == "float32" ? "fp32" : fmt::format("{} Q, {} K and V", q == "float32" ? "fp32" : q, name);
}

// Decode's heads and head dimension: the options', else decode's own defaults.
int64_t decode_heads(const BenchOptions& o) { return o.heads_option->count() > 0 ? o.heads : kDecodeHeads; }
int64_t decode_dim(const BenchOptions& o) { return o.d_option->count() > 0 ? o.d : kDecodeDim; }

// The lengths --varlen gives: its comma-separated list, or for "random" kRandomSequences lengths
// drawn uniformly from kRandomMinLength to kRandomMaxLength with `seed`.
std::vector<int64_t> varlen_lengths(const std::string& text, uint64_t seed) {
  std::vector<int64_t> lengths;
  if (text == "random") {
    Rng rng(seed);
    for (int64_t n = 0; n < kRandomSequences; ++n) {
      lengths.push_back(
          kRandomMinLength +
          static_cast<int64_t>(rng.uniform() * static_cast<double>(kRandomMaxLength - kRandomMinLength + 1)));
    }
    return lengths;
  }
  std::string_view rest = text;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view part = rest.substr(0, comma);
    int64_t length = 0;
    const auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), length);
    if (ec != std::errc() || ptr != part.data() + part.size() || part.empty() || length < 1) {
      throw ValueError(fmt::format(
          "--varlen: expected sequence lengths >= 1, comma-separated, or random ({} lengths from {} to {}), got {}",
          kRandomSequences, kRandomMinLength, kRandomMaxLength, text));
    }
    lengths.push_back(length);
    if (comma == std::string_view::npos) return lengths;
    rest.remove_prefix(comma + 1);
  }
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
  if (o.kv_cache) {
    if (!o.decode) throw ValueError("--kv-cache: a KV cache is decode's; add --decode");
    if (o.batch != 1) throw ValueError(fmt::format("--kv-cache: times one sequence, got --batch {}", o.batch));
    if (parse_storage(o.q_dtype, "--q-dtype") != StorageType::float32) {
      throw ValueError(
          fmt::format("--kv-cache: the cache is attended by float32 queries, got --q-dtype {}", o.q_dtype));
    }
    if (o.softcap_option->count() > 0 || o.alibi || o.sinks) {
      throw ValueError("--kv-cache: times the plain call; --softcap, --alibi and --sinks are not taken with it");
    }
  }
  const StorageType q_type = parse_storage(o.q_dtype, "--q-dtype");
  if (q_type == StorageType::int8) {
    throw ValueError("--q-dtype: expected float32, float16 or bfloat16 (int8 is for K and V), got int8");
  }
  if (q_type != StorageType::float32 && parse_storage(o.kv_dtype, "--kv-dtype") == StorageType::float32) {
    throw ValueError(
        fmt::format("--q-dtype: a stored Q goes with stored K and V; add --kv-dtype, got --q-dtype {}", o.q_dtype));
  }
  if (parse_storage(o.kv_dtype, "--kv-dtype") != StorageType::float32) {
    if (!o.varlen.empty()) {
      throw ValueError(fmt::format("--varlen: stored K and V (--kv-dtype {}) take no packed sequences", o.kv_dtype));
    }
    if (o.dropout_option->count() > 0) {
      throw ValueError(
          fmt::format("--dropout: stored K and V (--kv-dtype {}) are for inference; no dropout", o.kv_dtype));
    }
    if (!o.compare.empty()) {
      throw ValueError(fmt::format("--compare: --kv-dtype {} has its own baseline (float32 K and V), got --compare {}",
                                   o.kv_dtype, o.compare));
    }
  }
  if (o.decode && o.causal) {
    throw ValueError("--causal: decode (--decode) has Tq = 1, whose one query sees every key anyway, got both");
  }
  const int64_t heads = o.decode ? decode_heads(o) : o.heads;
  if (o.kv_heads_option->count() > 0 && (o.kv_heads < 1 || heads % o.kv_heads != 0)) {
    throw ValueError(
        fmt::format("--kv-heads: expected a divisor of the {} query heads (--heads), got {}", heads, o.kv_heads));
  }
  if (!o.window.empty()) parse_window(o.window, "--window");
  if (o.softcap_option->count() > 0 && (!(o.softcap > 0.0) || !std::isfinite(o.softcap))) {
    throw ValueError(fmt::format("--softcap: expected a positive finite number, got {}", o.softcap));
  }
  if (o.dropout_option->count() > 0 && !(o.dropout >= 0.0 && o.dropout < 1.0)) {
    throw ValueError(fmt::format("--dropout: expected a probability in [0, 1), got {}", o.dropout));
  }
  if (o.seed_option->count() > 0 && o.dropout_option->count() == 0 && o.varlen != "random") {
    throw ValueError(
        fmt::format("--seed: only used by --dropout and --varlen random, got --seed {} with neither", o.seed));
  }
  if (!o.varlen.empty()) {
    varlen_lengths(o.varlen, o.seed);
    if (o.batch_option->count() > 0 && o.batch != 1) {
      throw ValueError(
          fmt::format("--batch: --varlen packs its sequences into one batch entry, got --batch {}", o.batch));
    }
    if (o.t_option->count() > 0) {
      throw ValueError(fmt::format("--T: --varlen sets T (the sum of its lengths), got --T {}", fmt::join(o.t, ",")));
    }
  }
  if (o.decode) {
    if (!o.window.empty()) {
      throw ValueError(
          fmt::format("--window: decode (--decode) counts all of K and V as read, which a window does "
                      "not read, got --window {}",
                      o.window));
    }
    if (!o.varlen.empty()) {
      throw ValueError(
          fmt::format("--varlen: decode (--decode) has one query and one sequence, got --varlen {}", o.varlen));
    }
    if (!o.compare.empty()) {
      throw ValueError(fmt::format(
          "--compare: decode (--decode) has its own baselines (a triad and a read stream), got --compare {}",
          o.compare));
    }
  }
  if (o.compare == "gqa" && (o.kv_heads_option->count() == 0 || o.kv_heads == heads)) {
    throw ValueError(
        fmt::format("--compare: gqa times --kv-heads K and V heads against --heads ({}), so it needs "
                    "--kv-heads below {}, got {}",
                    heads, heads, o.kv_heads_option->count() == 0 ? "none" : fmt::format("--kv-heads {}", o.kv_heads)));
  }
  if (!o.compare.empty() && !o.baselines.empty()) {
    throw ValueError(fmt::format("--baselines: --compare {} times its own baselines, got --baselines {}", o.compare,
                                 fmt::join(o.baselines, ",")));
  }
  if (o.compare == "window" && o.window.empty()) {
    throw ValueError("--compare: window times --window L,R against the call without it, got no --window");
  }
  if (o.compare == "varlen" && o.varlen.empty()) {
    throw ValueError(
        "--compare: varlen times the packed --varlen batch against separate and padded calls, got no --varlen");
  }
}

// The variant the options describe, once check_options has passed them, for a call of `heads` heads.
Variant variant_of(const BenchOptions& o, int64_t heads) {
  Variant v;
  v.kv_heads = o.kv_heads_option->count() > 0 ? o.kv_heads : heads;
  v.causal = o.causal;
  if (!o.window.empty()) v.window = parse_window(o.window, "--window");
  if (o.softcap_option->count() > 0) v.softcap = o.softcap;
  v.alibi = o.alibi;
  v.sinks = o.sinks;
  if (o.dropout_option->count() > 0) v.dropout = AttentionDropout{.p = o.dropout, .seed = o.seed};
  if (!o.varlen.empty()) v.packed = varlen_lengths(o.varlen, o.seed);
  return v;
}

// The variant in the reports: JSON fields (null where not used) and a line of text.
std::string variant_json(const Variant& v) {
  const auto or_null = [](const auto& value) { return value ? fmt::format("{}", *value) : std::string("null"); };
  return fmt::format(
      R"("variant": {{"kv_heads": {}, "window": {}, "softcap": {}, "alibi": {}, "sinks": {}, "dropout": {}, )"
      R"("seed": {}, "varlen": {}}})",
      v.kv_heads, v.window ? fmt::format("[{}, {}]", v.window->left, v.window->right) : "null", or_null(v.softcap),
      v.alibi, v.sinks, v.dropout ? fmt::format("{}", v.dropout->p) : "null",
      v.dropout ? fmt::format("{}", v.dropout->seed) : "null",
      v.packed.empty() ? "null" : fmt::format("[{}]", fmt::join(v.packed, ", ")));
}

std::string variant_text(const Variant& v, int64_t heads) {
  std::vector<std::string> parts;
  if (v.kv_heads != heads) {
    parts.push_back(fmt::format("K and V with {} head{} (grouped-query)", v.kv_heads, v.kv_heads == 1 ? "" : "s"));
  }
  if (v.window) parts.push_back(fmt::format("window ({}, {})", v.window->left, v.window->right));
  if (v.softcap) parts.push_back(fmt::format("softcap {}", *v.softcap));
  if (v.alibi) parts.emplace_back("ALiBi (standard slopes)");
  if (v.sinks) parts.emplace_back("sinks");
  if (v.dropout) parts.push_back(fmt::format("dropout {} (seed {})", v.dropout->p, v.dropout->seed));
  if (!v.packed.empty()) {
    parts.push_back(fmt::format("{} packed sequences ({})", v.packed.size(), fmt::join(v.packed, ", ")));
  }
  return fmt::format("variant: {}", parts.empty() ? "none" : fmt::format("{}", fmt::join(parts, ", ")));
}

std::string json_timing(const Timing& t, double flops) {
  return fmt::format(R"("median_ms": {:.6g}, "gflops": {:.6g}, "peak_extra_bytes": {:.0f}, "peak_rss_bytes": {:.0f})",
                     t.median_ms, flops * 1e-9 / (t.median_ms * 1e-3), t.extra_bytes, t.peak_bytes);
}

double gflops(double flops, const Timing& t) { return flops * 1e-9 / (t.median_ms * 1e-3); }

double mac_factor_of(const BenchOptions& o) {
  return kForwardFlopsPerMac * (o.backward ? 1.0 + kBackwardOverForward : 1.0);
}

// The T of each row: --T (or its defaults), or with --varlen the one packed batch.
std::vector<int64_t> sizes_of(const BenchOptions& o, const Variant& variant) {
  if (!variant.packed.empty()) return {std::reduce(variant.packed.begin(), variant.packed.end(), int64_t{0})};
  return o.t.empty() ? std::vector<int64_t>{256, 1024, 4096, 8192} : o.t;
}

// Every --T of the attention benchmark, with its baselines.
std::vector<Result> measure_attention(const BenchOptions& o, const Variant& variant) {
  const AttentionImpl impl = parse_impl(o.impl);
  const std::vector<int64_t> sizes = sizes_of(o, variant);
  const double mac_factor = mac_factor_of(o);
  Variant non_causal = variant;
  non_causal.causal = false;
  Progress progress("[bench] attention", std::ssize(sizes), "shapes");
  std::vector<Result> results;
  for (const int64_t t : sizes) {
    const double bytes = Problem::bytes(o.batch, o.heads, variant.kv_heads, t, t, o.d, o.backward);
    check_allocation_fits(bytes, fmt::format("qkv bench at T = {}", t));
    Problem p(o.batch, o.heads, t, t, o.d, o.backward, variant);
    p.store_kv(parse_storage(o.kv_dtype, "--kv-dtype"));
    p.store_q(parse_storage(o.q_dtype, "--q-dtype"));
    set_max_workers(o.threads);
    // The kernel and its baselines, timed in alternating rounds.
    std::vector<std::string> names;
    std::vector<std::function<void()>> calls = {[&] { p.run(variant, o.backward, impl); }};
    if (p.kv_type != StorageType::float32 && wants(o, "float32")) {
      names.emplace_back("float32");
      calls.emplace_back([&] { p.run(variant, o.backward, impl, true); });
    }
    if (impl != AttentionImpl::reference && t <= kReferenceMaxT && wants(o, "reference")) {
      names.emplace_back("reference");
      calls.emplace_back([&] { p.run(variant, o.backward, AttentionImpl::reference); });
    }
    if (o.threads > 1 && wants(o, "threads")) {
      names.emplace_back("one_thread");
      calls.emplace_back([&] {
        set_max_workers(1);
        p.run(variant, o.backward, impl);
        set_max_workers(o.threads);
      });
    }
    if (o.causal && wants(o, "causal")) {
      names.emplace_back("non_causal");
      calls.emplace_back([&] { p.run(non_causal, o.backward, impl); });
    }
    progress.update(std::ssize(results),
                    fmt::format("T={} {}{}{}", t, o.impl, names.empty() ? "" : " and ", fmt::join(names, ", ")));
    const std::vector<Timing> timings = time_in_rounds(calls, o.repeats);
    const std::vector<int64_t> lengths = sequences(o.batch, t, variant);
    Result r{.tq = t,
             .tk = t,
             .flops = flops_of(lengths, o.heads, o.d, mac_factor, variant, false),
             .visible_flops = flops_of(lengths, o.heads, o.d, mac_factor, variant, true),
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

void report_attention(const BenchOptions& o, const Variant& variant, const std::vector<Result>& results,
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
      rows.push_back(fmt::format(
          R"(    {{"Tq": {}, "Tk": {}, "flops": {:.6g}, "visible_flops": {:.6g}, "tensor_bytes": {:.0f}, {}, )"
          R"("visible_gflops": {:.6g}, "baselines": {{{}}}}})",
          r.tq, r.tk, r.flops, r.visible_flops, r.tensor_bytes, json_timing(r.timing, r.flops),
          gflops(r.visible_flops, r.timing), fmt::join(baselines, ", ")));
    }
    fmt::print(
        "{{\n  \"mode\": \"{}\", \"impl\": \"{}\", \"simd\": \"{}\", {}, \"dtype\": \"float32\", \"q_dtype\": \"{}\", "
        "\"kv_dtype\": \"{}\", "
        "\"batch\": {}, "
        "\"heads\": {}, \"d\": {}, \"causal\": {}, \"threads\": {}, \"repeats\": {},\n  {},\n  \"memory_method\": "
        "\"{}\",\n  \"results\": [\n{}\n  ]\n}}\n",
        mode, o.impl, simd_target(), machine_json(warnings), storage_name(parse_storage(o.q_dtype, "--q-dtype")),
        kv_name(o), o.batch, o.heads, o.d, o.causal, o.threads, o.repeats, variant_json(variant), memory_method(reset),
        fmt::join(rows, ",\n"));
    std::fflush(stdout);
    return;
  }
  fmt::print("qkv bench: {}{}, {}, B={} H={} d={}, {} thread{}, impl {}, median of {} rounds\n", mode,
             o.causal ? " causal" : "", kv_text(o), o.batch, o.heads, o.d, o.threads, o.threads == 1 ? "" : "s", o.impl,
             o.repeats);
  fmt::print("{}\n", variant_text(variant, o.heads));
  fmt::print("{}\n", cpu_line());
  fmt::print("memory: {}\n\n", memory_method(reset));
  fmt::print("{:>7}  {:>11}  {:>9}  {:>11}  {:>11}  {:>11}  {:>11}  {}\n", "T", "median ms", "GFLOP/s", "vis GFLOP/s",
             "peak extra", "peak RSS", "tensors", "speedup against baselines: median of rounds (min–max; their ms)");
  for (const Result& r : results) {
    std::vector<std::string> against;
    for (const Baseline& b : r.baselines) {
      against.push_back(fmt::format("{:.2f}× {} ({:.2f}–{:.2f}; {:.3g})", b.speedup.median, b.name, b.speedup.min,
                                    b.speedup.max, b.timing.median_ms));
    }
    fmt::print("{:>7}  {:>11.3f}  {:>9.1f}  {:>11.1f}  {:>11}  {:>11}  {:>11}  {}\n", r.tq, r.timing.median_ms,
               gflops(r.flops, r.timing), gflops(r.visible_flops, r.timing), format_bytes(r.timing.extra_bytes),
               format_bytes(r.timing.peak_bytes), format_bytes(r.tensor_bytes), fmt::join(against, ", "));
  }
  print_warnings(warnings);
  std::fflush(stdout);
}

// ---- --compare ------------------------------------------------------------------------------

Spread scaled(Spread s, double factor) { return {s.median * factor, s.min * factor, s.max * factor}; }

std::string json_spread(const std::string& name, const Spread& s) {
  return fmt::format(R"("{0}": {1:.6g}, "{0}_min": {2:.6g}, "{0}_max": {3:.6g})", name, s.median, s.min, s.max);
}

// A call that --compare times the variant against, with the FLOPs it is credited with.
struct CompareBaseline {
  std::string name;
  double flops = 0.0;
  Timing timing;
  Spread ratio;  // the variant's GFLOP/s over this call's, round by round
};

struct CompareResult {
  int64_t t = 0;
  double flops = 0.0;
  double tensor_bytes = 0.0;
  Timing timing;
  std::vector<CompareBaseline> baselines;
};

// What --compare `name` times against what, for the report.
std::string compare_text(const BenchOptions& o, const Variant& v) {
  if (o.compare == "gqa") {
    return fmt::format("the call with K and V of {} head{} against multi_head, K and V of {} heads (the same FLOPs)",
                       v.kv_heads, v.kv_heads == 1 ? "" : "s", o.heads);
  }
  if (o.compare == "window") {
    return fmt::format("the call with window ({}, {}) against no_window, the same call without it{}", v.window->left,
                       v.window->right, v.causal ? " (both causal)" : "");
  }
  return fmt::format(
      "the packed batch (B = 1, cu_seqlens) against separate, one call per sequence, and padded, "
      "[{}, H, {}, d] with a key mask; all credited with the packed batch's FLOPs",
      v.packed.size(), *std::max_element(v.packed.begin(), v.packed.end()));
}

// Each row of --compare: the variant and what it is compared with, timed in alternating rounds.
std::vector<CompareResult> measure_compare(const BenchOptions& o, const Variant& variant) {
  const AttentionImpl impl = parse_impl(o.impl);
  const std::vector<int64_t> sizes = sizes_of(o, variant);
  const double mac_factor = mac_factor_of(o);
  set_max_workers(o.threads);
  Progress progress(fmt::format("[bench] compare {}", o.compare), std::ssize(sizes), "shapes");
  std::vector<CompareResult> results;
  for (const int64_t t : sizes) {
    const std::vector<int64_t> lengths = sequences(o.batch, t, variant);
    const double flops = flops_of(lengths, o.heads, o.d, mac_factor, variant, true);
    // The problems stay where they are while the calls below hold pointers to them; the calls are
    // made after the branch that made them, so they capture what is local to it by value.
    std::vector<std::unique_ptr<Problem>> problems;
    double bytes = 0.0;
    const auto problem = [&](int64_t batch, int64_t tokens, const Variant& v) {
      const double more = Problem::bytes(batch, o.heads, v.kv_heads, tokens, tokens, o.d, o.backward);
      check_allocation_fits(bytes + more, fmt::format("qkv bench --compare {} at T = {}", o.compare, t));
      bytes += more;
      problems.push_back(std::make_unique<Problem>(batch, o.heads, tokens, tokens, o.d, o.backward, v));
      return problems.back().get();
    };
    std::vector<std::function<void()>> calls;
    std::vector<std::pair<std::string, double>> baselines;  // name, FLOPs credited
    if (o.compare == "gqa") {
      Variant mha = variant;
      mha.kv_heads = o.heads;
      Problem* grouped = problem(o.batch, t, variant);
      Problem* full = problem(o.batch, t, mha);
      calls = {[&, grouped] { grouped->run(variant, o.backward, impl); },
               [&, full, mha] { full->run(mha, o.backward, impl); }};
      baselines.emplace_back("multi_head", flops);
    } else if (o.compare == "window") {
      Variant full = variant;
      full.window.reset();
      Problem* p = problem(o.batch, t, variant);
      calls = {[&, p] { p->run(variant, o.backward, impl); }, [&, p, full] { p->run(full, o.backward, impl); }};
      baselines.emplace_back("no_window", flops_of(lengths, o.heads, o.d, mac_factor, full, true));
    } else {
      Variant single = variant;
      single.packed.clear();
      Variant padded = single;
      padded.key_lengths = variant.packed;
      const int64_t longest = *std::max_element(variant.packed.begin(), variant.packed.end());
      Problem* packed = problem(1, t, variant);
      std::vector<Problem*> separate;
      for (const int64_t length : variant.packed) separate.push_back(problem(1, length, single));
      Problem* batch = problem(std::ssize(variant.packed), longest, padded);
      calls = {[&, packed] { packed->run(variant, o.backward, impl); },
               [&, separate, single] {
                 for (Problem* p : separate) p->run(single, o.backward, impl);
               },
               [&, batch, padded] { batch->run(padded, o.backward, impl); }};
      baselines.emplace_back("separate", flops);
      baselines.emplace_back("padded", flops);
    }
    std::vector<std::string> names;
    for (const auto& baseline : baselines) names.push_back(baseline.first);
    progress.update(std::ssize(results), fmt::format("T={} {} against {}", t, o.impl, fmt::join(names, ", ")));
    const std::vector<Timing> timings = time_in_rounds(calls, o.repeats);
    CompareResult r{.t = t, .flops = flops, .tensor_bytes = bytes, .timing = timings.front(), .baselines = {}};
    for (size_t b = 0; b < baselines.size(); ++b) {
      const auto& [name, baseline_flops] = baselines[b];
      r.baselines.push_back({.name = name,
                             .flops = baseline_flops,
                             .timing = timings[b + 1],
                             .ratio = scaled(ratio_by_round(timings[b + 1], timings.front()), flops / baseline_flops)});
    }
    results.push_back(std::move(r));
  }
  progress.done();
  return results;
}

void report_compare(const BenchOptions& o, const Variant& variant, const std::vector<CompareResult>& results,
                    const std::vector<std::string>& warnings) {
  const std::string mode = o.backward ? "forward+backward" : "forward";
  const bool reset = results.empty() || results.front().timing.memory_reset;
  if (o.json) {
    std::vector<std::string> rows;
    for (const CompareResult& r : results) {
      std::vector<std::string> baselines;
      for (const CompareBaseline& b : r.baselines) {
        baselines.push_back(fmt::format(R"("{}": {{"flops": {:.6g}, {}, {}}})", b.name, b.flops,
                                        json_timing(b.timing, b.flops), json_spread("gflops_ratio", b.ratio)));
      }
      rows.push_back(fmt::format(R"(    {{"Tq": {}, "Tk": {}, "flops": {:.6g}, "tensor_bytes": {:.0f}, {}, )"
                                 R"("baselines": {{{}}}}})",
                                 r.t, r.t, r.flops, r.tensor_bytes, json_timing(r.timing, r.flops),
                                 fmt::join(baselines, ", ")));
    }
    fmt::print(
        "{{\n  \"mode\": \"{}\", \"compare\": \"{}\", \"impl\": \"{}\", \"simd\": \"{}\", {}, \"dtype\": \"float32\", "
        "\"batch\": {}, \"heads\": {}, \"d\": {}, \"causal\": {}, \"threads\": {}, \"repeats\": {},\n  {},\n  "
        "\"flops_counted\": \"visible (q, k) pairs\", \"memory_method\": \"{}\",\n  \"results\": [\n{}\n  ]\n}}\n",
        mode, o.compare, o.impl, simd_target(), machine_json(warnings), variant.packed.empty() ? o.batch : 1, o.heads,
        o.d, o.causal, o.threads, o.repeats, variant_json(variant), memory_method(reset), fmt::join(rows, ",\n"));
    std::fflush(stdout);
    return;
  }
  fmt::print("qkv bench --compare {}: {}{}, fp32, B={} H={} d={}, {} thread{}, impl {}, median of {} rounds\n",
             o.compare, mode, o.causal ? " causal" : "", variant.packed.empty() ? o.batch : 1, o.heads, o.d, o.threads,
             o.threads == 1 ? "" : "s", o.impl, o.repeats);
  fmt::print("{}\n", variant_text(variant, o.heads));
  fmt::print("{}\n", compare_text(o, variant));
  fmt::print("GFLOP/s over the (q, k) pairs each call's mask leaves visible; ratio: the variant's GFLOP/s over the\n");
  fmt::print("baseline's, median of per-round ratios (min–max)\n");
  fmt::print("{}\n", cpu_line());
  fmt::print("memory: {}\n\n", memory_method(reset));
  fmt::print("{:>7}  {:>11}  {:>11}  {:>11}  {}\n", "T", "median ms", "vis GFLOP/s", "peak extra",
             "GFLOP/s ratio against baselines (min–max; their ms, their vis GFLOP/s)");
  for (const CompareResult& r : results) {
    std::vector<std::string> against;
    for (const CompareBaseline& b : r.baselines) {
      against.push_back(fmt::format("{:.2f}× {} ({:.2f}–{:.2f}; {:.3g} ms, {:.1f})", b.ratio.median, b.name,
                                    b.ratio.min, b.ratio.max, b.timing.median_ms, gflops(b.flops, b.timing)));
    }
    fmt::print("{:>7}  {:>11.3f}  {:>11.1f}  {:>11}  {}\n", r.t, r.timing.median_ms, gflops(r.flops, r.timing),
               format_bytes(r.timing.extra_bytes), fmt::join(against, ", "));
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
    // On huge pages where the kernel gives them, as decode's K and V (Tensors) are.
    assign_on_huge_pages(a_, static_cast<size_t>(kTriadFloats), 0.0f);
    assign_on_huge_pages(b_, static_cast<size_t>(kTriadFloats), 1.0f);
    assign_on_huge_pages(c_, static_cast<size_t>(kTriadFloats), 2.0f);
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
    assign_on_huge_pages(x_, static_cast<size_t>(kElements), uint32_t{1});
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
  std::optional<Spread> over_float32;  // with --kv-dtype: tokens per second over float32 K and V's
  // With --kv-cache: tokens per second over contiguous K and V's, and one append's time over a step's.
  std::optional<Spread> over_contiguous, append_fraction;
};

constexpr int64_t kBenchPageTokens = 256;

// K and V of a decode problem in a paged cache, with a second sequence to time appends on.
struct CachedDecode {
  KvCache cache;
  int64_t id = 0, appended = 0;
  Tensor<float> k_token, v_token;  // [Hkv, 1, d]

  CachedDecode(const Problem& p, int64_t tk, int64_t d, int64_t kv_heads, int64_t appends)
      : cache({.kv_heads = kv_heads,
               .dk = d,
               .dv = d,
               .type = p.kv_type,
               .page_tokens = kBenchPageTokens,
               .pages = (tk + kBenchPageTokens - 1) / kBenchPageTokens + appends / kBenchPageTokens + 2}),
        k_token({kv_heads, 1, d}, 0.5f),
        v_token({kv_heads, 1, d}, 0.25f) {
    id = cache.add_sequence();
    appended = cache.add_sequence();
    cache.append(id, make_view(p.k.data(), {kv_heads, tk, d}), make_view(p.v.data(), {kv_heads, tk, d}));
  }
};

// Every --T (Tk) of the decode benchmark, each in rounds with the two streams.
std::vector<DecodeResult> measure_decode(const BenchOptions& o, const Variant& variant,
                                         std::vector<std::string>& warnings) {
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
    const double bytes = Problem::bytes(o.batch, heads, variant.kv_heads, 1, tk, d, false);
    check_allocation_fits(bytes, fmt::format("qkv bench --decode at Tk = {}", tk));
    progress.update(std::ssize(results), fmt::format("Tk={} {}, triad and read stream", tk, o.impl));
    Problem p(o.batch, heads, 1, tk, d, false, variant);
    p.store_kv(parse_storage(o.kv_dtype, "--kv-dtype"));
    p.store_q(parse_storage(o.q_dtype, "--q-dtype"));
    std::vector<std::function<void()>> calls = {[&] { p.run(variant, false, impl); }, [&] { triad.run(); },
                                                [&] { read.run(); }};
    const bool against_float32 = p.kv_type != StorageType::float32 && wants(o, "float32");
    if (against_float32) calls.emplace_back([&] { p.run(variant, false, impl, true); });
    std::optional<CachedDecode> cached;
    const size_t contiguous_at = calls.size();
    if (o.kv_cache) {
      // At most 1000 appends a sample, one sample a round and the warm-up.
      cached.emplace(p, tk, d, variant.kv_heads, 1000 * (o.repeats + 1));
      calls.front() = [&] {
        // Not causal, as the contiguous call: one query sees every key either way.
        cached->cache.attend(cached->id, make_view<const float>(p.q.data(), {heads, 1, d}),
                             {.out = make_view(p.out.data(), {heads, 1, d}), .weights = {}, .lse = {}},
                             {.causal = false});
      };
      calls.emplace_back([&] { p.run(variant, false, impl); });
      calls.emplace_back(
          [&] { cached->cache.append(cached->appended, cached->k_token.cview(), cached->v_token.cview()); });
    }
    const std::vector<Timing> timings = time_in_rounds(calls, o.repeats);
    std::optional<Spread> over_contiguous, append_fraction;
    if (o.kv_cache) {
      over_contiguous = ratio_by_round(timings[contiguous_at], timings[0]);
      append_fraction = ratio_by_round(timings[contiguous_at + 1], timings[0]);
    }
    // The bytes decode must stream: K and V once, shared by the query heads of each group, in their
    // storage type, and int8's scales (K's per channel, V's per token).
    const double elements = static_cast<double>(o.batch * variant.kv_heads * tk * d);
    double kv_bytes = 2.0 * elements * static_cast<double>(storage_bytes(p.kv_type));
    if (p.kv_type == StorageType::int8) {
      kv_bytes += static_cast<double>(p.k_int8->scales.numel() + p.v_int8->scales.numel()) * sizeof(float);
    }
    warn(warnings,
         cache_resident_warning(fmt::format("decode at Tk = {} (K and V)", tk), kv_bytes, cpu_info().l3_bytes));
    const auto gbs = [](double bytes_moved, const Timing& t) { return bytes_moved * 1e-9 / (t.median_ms * 1e-3); };
    results.push_back(
        {.result = {.tq = 1,
                    .tk = tk,
                    .flops = kForwardFlopsPerMac * static_cast<double>(o.batch * heads) * static_cast<double>(tk) *
                             static_cast<double>(d),
                    .tensor_bytes = bytes,
                    .timing = timings[0],
                    .baselines = {}},
         .kv_gbs = gbs(kv_bytes, timings[0]),
         .triad_gbs = gbs(Triad::bytes(), timings[1]),
         .read_gbs = gbs(ReadStream::bytes(), timings[2]),
         .of_triad = scaled(ratio_by_round(timings[1], timings[0]), kv_bytes / Triad::bytes()),
         .of_read = scaled(ratio_by_round(timings[2], timings[0]), kv_bytes / ReadStream::bytes()),
         .over_float32 = against_float32 ? std::optional(ratio_by_round(timings[3], timings[0])) : std::nullopt,
         .over_contiguous = over_contiguous,
         .append_fraction = append_fraction});
  }
  progress.done();
  return results;
}

void report_decode(const BenchOptions& o, const Variant& variant, const std::vector<DecodeResult>& results,
                   const std::vector<std::string>& warnings) {
  const int64_t heads = decode_heads(o);
  const int64_t d = decode_dim(o);
  const bool reset = results.empty() || results.front().result.timing.memory_reset;
  if (o.json) {
    std::vector<std::string> rows;
    for (const DecodeResult& r : results) {
      rows.push_back(fmt::format(
          R"(    {{"Tq": 1, "Tk": {}, "flops": {:.6g}, "tensor_bytes": {:.0f}, {}, "gbs": {:.6g}, "triad_gbs": {:.6g}, )"
          R"("read_gbs": {:.6g}, {}, {}{}}})",
          r.result.tk, r.result.flops, r.result.tensor_bytes, json_timing(r.result.timing, r.result.flops), r.kv_gbs,
          r.triad_gbs, r.read_gbs, json_spread("triad_fraction", r.of_triad), json_spread("read_fraction", r.of_read),
          (r.over_float32 ? ", " + json_spread("over_float32", *r.over_float32) : "") +
              (r.over_contiguous ? ", " + json_spread("paged_over_contiguous", *r.over_contiguous) + ", " +
                                       json_spread("append_fraction", *r.append_fraction)
                                 : "")));
    }
    // The first shape's streams at the top level too, for readers of one shape.
    const double triad_gbs = results.empty() ? 0.0 : results.front().triad_gbs;
    const double read_gbs = results.empty() ? 0.0 : results.front().read_gbs;
    fmt::print(
        "{{\n  \"mode\": \"decode\", \"impl\": \"{}\", \"simd\": \"{}\", {}, \"dtype\": \"float32\", \"q_dtype\": "
        "\"{}\", \"kv_dtype\": \"{}\", \"batch\": {}, "
        "\"heads\": {}, \"d\": {}, \"threads\": {}, \"repeats\": {}, \"triad_gbs\": {:.6g}, \"read_gbs\": {:.6g},\n  "
        "{},\n  \"memory_method\": \"{}\",\n  \"results\": [\n{}\n  ]\n}}\n",
        o.impl, simd_target(), machine_json(warnings), storage_name(parse_storage(o.q_dtype, "--q-dtype")), kv_name(o),
        o.batch, heads, d, o.threads, o.repeats, triad_gbs, read_gbs, variant_json(variant), memory_method(reset),
        fmt::join(rows, ",\n"));
    std::fflush(stdout);
    return;
  }
  fmt::print("qkv bench: decode (Tq = 1), {}, B={} H={} d={}, {} thread{}, impl {}, median of {} rounds\n", kv_text(o),
             o.batch, heads, d, o.threads, o.threads == 1 ? "" : "s", o.impl, o.repeats);
  fmt::print("{}\n", variant_text(variant, heads));
  fmt::print("{}\n", cpu_line());
  fmt::print("roofs, timed in the same rounds: a streaming triad a = b + s·c over 3 × {} arrays, and a read\n",
             format_bytes(kTriadFloats * 4.0));
  fmt::print("stream alone over {}; fractions are medians of per-round ratios (min–max)\n",
             format_bytes(kTriadFloats * 12.0));
  fmt::print("memory: {}\n\n", memory_method(reset));
  const bool stored = !results.empty() && results.front().over_float32;
  if (stored) fmt::print("over fp32: tokens per second over those of float32 K and V, timed in the same rounds\n");
  const bool paged = !results.empty() && results.front().over_contiguous;
  if (paged) {
    fmt::print(
        "paged: a KvCache's decode (pages of {} tokens) in tokens per second over contiguous K and V's; append: one\n"
        "token appended to another sequence of the cache, in time over the decode step's\n",
        kBenchPageTokens);
  }
  if (stored || paged) fmt::print("\n");
  fmt::print("{:>7}  {:>11}  {:>9}  {:>9}  {:>18}  {:>9}  {:>18}  {:>9}  {:>11}{}{}\n", "Tk", "median ms", "GB/s K+V",
             "triad", "of triad", "read", "of read", "GFLOP/s", "peak extra", stored ? "  over fp32" : "",
             paged ? "  paged over contiguous   append" : "");
  const auto percent = [](const Spread& s) {
    return fmt::format("{:.0f}% ({:.0f}–{:.0f}%)", 100.0 * s.median, 100.0 * s.min, 100.0 * s.max);
  };
  for (const DecodeResult& r : results) {
    std::string over = r.over_float32 ? fmt::format("  {:.2f}× ({:.2f}–{:.2f})", r.over_float32->median,
                                                    r.over_float32->min, r.over_float32->max)
                                      : "";
    if (r.over_contiguous) {
      over += fmt::format("  {:.3f}× ({:.3f}–{:.3f})  {:.4f}%", r.over_contiguous->median, r.over_contiguous->min,
                          r.over_contiguous->max, 100.0 * r.append_fraction->median);
    }
    fmt::print("{:>7}  {:>11.3f}  {:>9.1f}  {:>9.1f}  {:>18}  {:>9.1f}  {:>18}  {:>9.1f}  {:>11}{}\n", r.result.tk,
               r.result.timing.median_ms, r.kv_gbs, r.triad_gbs, percent(r.of_triad), r.read_gbs, percent(r.of_read),
               r.result.flops * 1e-9 / (r.result.timing.median_ms * 1e-3), format_bytes(r.result.timing.extra_bytes),
               over);
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
  const Variant variant = variant_of(o, o.decode ? decode_heads(o) : o.heads);
  if (o.decode) {
    const std::vector<DecodeResult> results = measure_decode(o, variant, warnings);
    report_decode(o, variant, results, warnings);
  } else if (!o.compare.empty()) {
    const std::vector<CompareResult> results = measure_compare(o, variant);
    report_compare(o, variant, results, warnings);
  } else {
    const std::vector<Result> results = measure_attention(o, variant);
    report_attention(o, variant, results, warnings);
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
  o->kv_heads_option =
      cmd->add_option("--kv-heads", o->kv_heads, "K and V heads, a divisor of H: grouped-query attention (default H)");
  o->batch_option = cmd->add_option("--batch", o->batch, "batch B")->capture_default_str();
  cmd->add_flag("--causal", o->causal, "causal mask (blocks above the diagonal are skipped)");
  cmd->add_option("--window", o->window, "sliding window: query i sees keys i - L to i + R (-1: unbounded)")
      ->type_name("L,R");
  o->softcap_option =
      cmd->add_option("--softcap", o->softcap, "logit softcap C > 0: scores become C * tanh(x / C)")->type_name("C");
  cmd->add_flag("--alibi", o->alibi, "ALiBi with the standard slopes");
  cmd->add_flag("--sinks", o->sinks, "one attention-sink logit per head (and its gradient with --backward)");
  cmd->add_option("--varlen", o->varlen,
                  "one packed batch of sequences of these lengths (cu_seqlens, B = 1, T = their sum), or random: "
                  "16 lengths from 100 to 4000 drawn with --seed")
      ->type_name("N,...|random");
  o->dropout_option =
      cmd->add_option("--dropout", o->dropout, "dropout on the attention weights, P in [0, 1)")->type_name("P");
  o->seed_option = cmd->add_option("--seed", o->seed, "seed of --dropout and of --varlen random (default 0)")
                       ->check(CLI::Validator(uint64_error, "0..2^64-1"))
                       ->type_name("N");
  cmd->add_option("--compare", o->compare,
                  "time one variant against the same call without it and print their GFLOP/s ratio, FLOPs counted "
                  "over visible pairs: gqa (needs --kv-heads), window (needs --window) or varlen (needs --varlen; "
                  "against separate calls and against padding)")
      ->check(CLI::IsMember({"gqa", "window", "varlen"}))
      ->type_name("WHAT");
  cmd->add_flag("--backward", o->backward, "time forward + backward (the gradients of all of Q, K and V)");
  cmd->add_flag("--decode", o->decode, "decode: one query against many keys, in GB/s against a streaming triad");
  cmd->add_flag("--kv-cache", o->kv_cache,
                "with --decode: decode from a paged KvCache, against contiguous K and V, and time an append");
  cmd->add_option("--kv-dtype", o->kv_dtype,
                  "K and V stored as float32, float16, bfloat16 or int8 (f32, f16, bf16, i8), timed against "
                  "float32 ones")
      ->capture_default_str();
  cmd->add_option("--q-dtype", o->q_dtype,
                  "with --kv-dtype: Q stored as float32, float16 or bfloat16 (bfloat16 Q, K and V take the CPU's bf16 "
                  "dot product where it has one)")
      ->capture_default_str();
  o->threads_option = cmd->add_option("--threads", o->threads, "threads (default: OpenMP's, here the cores)");
  cmd->add_option("--impl", o->impl, "fused, reference or auto")
      ->check(CLI::IsMember({"fused", "reference", "auto"}))
      ->capture_default_str();
  cmd->add_option("--repeats", o->repeats,
                  "rounds: timed samples of the kernel and of each baseline; medians are reported")
      ->capture_default_str();
  cmd->add_option(
         "--baselines", o->baselines,
         "baselines to measure, comma-separated: reference, threads, causal, float32, or none (default: all that "
         "apply)")
      ->delimiter(',')
      ->check(CLI::IsMember({"reference", "threads", "causal", "float32", "none"}))
      ->type_name("LIST");
  cmd->add_flag("--json", o->json, "print the results as JSON");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace qkv::cli
