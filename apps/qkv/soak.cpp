// qkv soak: random problems of the fused dot-product attention against the float64 reference, on
// every SIMD target this CPU runs and several thread counts, until the time is up or a case fails.
//
//   qkv soak --seconds 600 --seed 7          # ten minutes of cases 0, 1, 2, ... of seed 7
//   qkv soak --seed 7 --case 1234            # case 1234 of seed 7 alone, as a failure prints it
//
// A case is drawn from (seed, case number) alone, so any case can be rerun without those before it.
// It mixes what the kernels treat apart: sizes 0, 1, primes and sizes around multiples of the tile
// and vector widths (8, 16, 64); Tq ≠ Tk; causal, boolean masks and float biases with −inf, alone
// and combined, in broadcast shapes; scales from 0 to 10; logits up to 1e4; q, k and v strided
// (their rows padded, so no leading dim is contiguous); and the variants: grouped heads, windows,
// top-left alignment, softcap, ALiBi, sinks, dropout and packed sequences; Q, K and V stored as
// float16, bfloat16 or int8 (K and V), each type drawn apart; and K and V in a KvCache of any type,
// each batch one sequence appended in chunks, in turn with the others so that their pages
// interleave (with holes left by a removed sequence, or compacted), attended with its masks, bias
// and variants (all but dropout, packed sequences and top-left alignment, which a cache has not). The forward with lse
// and without it (which takes the few-query layout of decoding for up to 16 queries), and the backward (dq, dk, dv,
// dbias, dsinks; recomputing the forward and from the saved lse; not for a cache, which has none) are held to the
// suite's rule (attention_tolerance in support/attention_problems.hpp), on the values stored operands and the cache
// stand for. A case both implementations refuse with a qkv::Error counts as refused; one that only one of them refuses
// is a failure.
//
// Progress goes to stderr; the counts to stdout. The first failure prints the command that repeats
// it and the case, and exits 1; with --keep-going every failing case is reported and counted, and
// the exit is 1 at the end.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/parallel.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/simd_target.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/kv_cache.hpp"
#include "support/attention_problems.hpp"

namespace qkv::cli {
namespace {

using testing::AttentionOperands;
using testing::AttentionProblem;
using testing::cast;
using testing::error_stats;
using testing::Stored;

// A soak failure is a finding about the kernels, not bad input: exit 1, apart from main's 2.
constexpr int kExitFailure = 1;
constexpr double kProgressSeconds = 10.0;
constexpr double kInf = std::numeric_limits<double>::infinity();

struct SoakOptions {
  double seconds = 60.0;
  uint64_t seed = 1;
  std::optional<uint64_t> only_case;
  std::optional<uint64_t> cases;  // run cases 0 .. cases − 1 instead of for `seconds`
  std::vector<int> threads{1, 2};
  bool keep_going = false;
};

// K and V of a case in a KvCache: sequence ids[b] holds batch b's; `history` says what else
// the cache went through, for a failure report.
struct CachedKeys {
  KvCache cache;
  std::vector<int64_t> ids;
  std::string history;
};

// One drawn case: the problem in float64, which of q, k and v the fused call sees strided, the
// operands in their storage types when any is not float32, or K and V in a cache (the problem then
// holds the values they stand for), and the words that describe it in a failure report.
struct SoakCase {
  AttentionProblem problem;
  std::array<bool, 3> strided{};
  std::optional<Stored> stored;
  std::optional<CachedKeys> cached;
  std::string description;
};

int64_t pick(Rng& rng, std::initializer_list<int64_t> choices) {
  const auto index = static_cast<size_t>(rng.uniform() * static_cast<double>(choices.size()));
  return *(choices.begin() + std::min(index, choices.size() - 1));
}

bool chance(Rng& rng, double p) { return rng.uniform() < p; }

// Sizes the kernels split on: 0 and 1, primes, and one off multiples of the widths they tile by.
int64_t draw_size(Rng& rng, int64_t max_multiple) {
  const double kind = rng.uniform();
  if (kind < 0.15) return pick(rng, {0, 1, 1, 2});
  if (kind < 0.4) return pick(rng, {3, 5, 7, 11, 13, 17, 31, 37, 61, 67, 113, 127, 131});
  const int64_t width = pick(rng, {8, 16, 64});
  const int64_t multiple = 1 + static_cast<int64_t>(rng.uniform() * static_cast<double>(max_multiple));
  return std::max<int64_t>(0, width * multiple + pick(rng, {-1, 0, 0, 1}));
}

// A shape that broadcasts to [B, H, Tq, Tk], the full one included.
Shape draw_mask_shape(Rng& rng, int64_t b, int64_t h, int64_t tq, int64_t tk) {
  switch (pick(rng, {0, 1, 2, 3, 4, 5})) {
    case 0:
      return {tq, tk};
    case 1:
      return {1, 1, tq, tk};
    case 2:
      return {1, h, 1, tk};
    case 3:
      return {tk};
    case 4:
      return {b, 1, tq, 1};
    default:
      return {b, h, tq, tk};
  }
}

// The first `heads` heads of a [B, H, T, D] tensor: K or V of grouped-query attention.
Tensor<double> first_heads(const Tensor<double>& t, int64_t heads) {
  const Shape& s = t.shape();
  Tensor<double> r({s[0], heads, s[2], s[3]});
  const TensorView<const double> from = t.view();
  const TensorView<double> to = r.view();
  for (int64_t a = 0; a < s[0]; ++a)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < s[2]; ++i)
        for (int64_t d = 0; d < s[3]; ++d) to(a, h, i, d) = from(a, h, i, d);
  return r;
}

// float32, float16, bfloat16 or, where `int8`, int8, each as likely.
StorageType draw_storage(Rng& rng, bool int8) {
  constexpr StorageType kTypes[] = {StorageType::float32, StorageType::float16, StorageType::bfloat16,
                                    StorageType::int8};
  const size_t choices = int8 ? 4 : 3;
  return kTypes[std::min(choices - 1, static_cast<size_t>(rng.uniform() * static_cast<double>(choices)))];
}

// p's K and V appended to a cache of a drawn type and page size, batch b as sequence b, in chunks
// of 1 to 70 tokens taken in turn from each sequence; p's k and v become the values it holds. A
// scratch sequence (a copy of batch 0's) may grow among them and be removed before the attention,
// leaving holes between their pages, and the cache may then be compacted.
CachedKeys cache_keys(Rng& rng, AttentionProblem& p) {
  const int64_t batches = p.k.shape()[0], hkv = p.k.shape()[1], tk = p.k.shape()[2];
  const StorageType type = draw_storage(rng, true);
  const int64_t page_tokens = pick(rng, {1, 3, 16, 64, 256});
  const bool scratch = chance(rng, 0.3), compact = chance(rng, 0.3);
  const int64_t sequences = batches + (scratch ? 1 : 0);
  const int64_t pages = std::max<int64_t>(1, sequences * ((tk + page_tokens - 1) / page_tokens) + pick(rng, {0, 1, 5}));
  CachedKeys c{KvCache(KvCacheShape{.kv_heads = hkv,
                                    .dk = p.k.shape()[3],
                                    .dv = p.v.shape()[3],
                                    .type = type,
                                    .page_tokens = page_tokens,
                                    .pages = pages}),
               {},
               fmt::format(" cache={} page_tokens={} pages={}{}{}", storage_name(type), page_tokens, pages,
                           scratch ? " scratch" : "", compact ? " compacted" : "")};
  std::vector<int64_t> ids;  // batch n's sequence, then the scratch one
  for (int64_t n = 0; n < sequences; ++n) ids.push_back(c.cache.add_sequence());
  // Token t of batch n's k or v, as the cache takes them: [Hkv, count, D] from t.
  const auto tokens = [](const Tensor<double>& x, int64_t n, int64_t t, int64_t count) {
    const Shape& s = x.shape();
    Tensor<float> r({s[1], count, s[3]});
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t i = 0; i < count; ++i)
        for (int64_t d = 0; d < s[3]; ++d) r.view()(h, i, d) = static_cast<float>(x.view()(n, h, t + i, d));
    return r;
  };
  std::vector<int64_t> appended(static_cast<size_t>(sequences), 0);
  for (bool more = true; more;) {
    more = false;
    for (int64_t n = 0; n < sequences; ++n) {
      int64_t& done = appended[static_cast<size_t>(n)];
      const int64_t count = std::min(tk - done, pick(rng, {1, 1, 2, 7, 70}));
      if (count == 0) continue;
      const int64_t source = n < batches ? n : 0;
      c.cache.append(ids[static_cast<size_t>(n)], tokens(p.k, source, done, count).cview(),
                     tokens(p.v, source, done, count).cview());
      done += count;
      more = more || done < tk;
    }
  }
  if (scratch) c.cache.remove_sequence(ids.back());
  if (compact) c.cache.compact();
  c.ids.assign(ids.begin(), ids.begin() + batches);
  for (int64_t n = 0; n < batches; ++n) {
    const Tensor<float> k = c.cache.keys(c.ids[static_cast<size_t>(n)]);
    const Tensor<float> v = c.cache.values(c.ids[static_cast<size_t>(n)]);
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t t = 0; t < tk; ++t) {
        for (int64_t d = 0; d < p.k.shape()[3]; ++d) p.k.view()(n, h, t, d) = k.view()(h, t, d);
        for (int64_t d = 0; d < p.v.shape()[3]; ++d) p.v.view()(n, h, t, d) = v.view()(h, t, d);
      }
  }
  return c;
}

SoakCase draw_case(uint64_t seed, uint64_t number) {
  Rng rng(seed * 0x9E3779B97F4A7C15ULL + number);  // the golden-ratio step spreads seeds apart
  // Most cases are small, so that many run; a few are large enough to be split among threads.
  const bool large = chance(rng, 0.08);
  const int64_t b = pick(rng, {1, 1, 1, 2, 3, 0});
  const int64_t h = pick(rng, {1, 1, 2, 3});
  int64_t tq = draw_size(rng, large ? 9 : 3);
  int64_t tk = chance(rng, 0.2) ? tq : draw_size(rng, large ? 9 : 3);
  if (chance(rng, 0.05)) tq = 1;
  if (large && chance(rng, 0.3)) tk = 1000 + pick(rng, {23, 24, 25, 88});
  const int64_t dk = std::max<int64_t>(1, draw_size(rng, 2));
  const int64_t dv = chance(rng, 0.5) ? dk : std::max<int64_t>(1, draw_size(rng, 2));

  SoakCase c;
  AttentionProblem& p = c.problem;
  const double logit = static_cast<double>(pick(rng, {1, 1, 10, 100, 1000, 10000}));
  p.causal = chance(rng, 0.4);
  if (chance(rng, 0.6)) {
    p.scale = chance(rng, 0.15) ? 0.0 : chance(rng, 0.3) ? static_cast<double>(pick(rng, {1, 10})) : rng.uniform(0, 10);
  }
  const double scale = p.scale.value_or(default_scale(dk));
  // q·k of N(0, σ²) entries has a spread of σ²·sqrt(Dk): σ is chosen for logits of about `logit`.
  const double sigma = scale > 0 ? std::sqrt(logit / (scale * std::sqrt(static_cast<double>(dk)))) : std::sqrt(logit);
  p.q = testing::random_tensor<double>({b, h, tq, dk}, rng, sigma);
  p.k = testing::random_tensor<double>({b, h, tk, dk}, rng, sigma);
  p.v = testing::random_tensor<double>({b, h, tk, dv}, rng);
  std::string masks;
  if (chance(rng, 0.35)) {
    const Shape shape = draw_mask_shape(rng, b, h, tq, tk);
    const double keep = static_cast<double>(pick(rng, {0, 5, 50, 90, 100})) / 100.0;
    p.allowed = Tensor<uint8_t>(shape);
    for (int64_t i = 0; i < p.allowed->numel(); ++i) (*p.allowed)[i] = chance(rng, keep) ? 1 : 0;
    masks += fmt::format(" allowed={} keep={}", shape.str(), keep);
  }
  if (chance(rng, 0.35)) {
    const Shape shape = draw_mask_shape(rng, b, h, tq, tk);
    const double spread = static_cast<double>(pick(rng, {1, 10, 1000, 10000}));
    const double minus_inf = static_cast<double>(pick(rng, {0, 0, 10, 50, 100})) / 100.0;
    p.bias = testing::random_tensor<double>(shape, rng, spread);
    for (int64_t i = 0; i < p.bias->numel(); ++i) {
      if (chance(rng, minus_inf)) (*p.bias)[i] = -kInf;
    }
    masks += fmt::format(" bias={} spread={} minus_inf={}", shape.str(), spread, minus_inf);
  }
  std::string strided;
  for (size_t operand = 0; operand < 3; ++operand) {
    c.strided[operand] = chance(rng, 0.4);
    if (c.strided[operand]) strided += std::string(1, "qkv"[operand]);
  }
  // The variants, drawn after everything above so that they leave its draws as they were.
  std::string variants;
  if (h > 1 && chance(rng, 0.25)) {
    const int64_t hkv = h % 2 == 0 && chance(rng, 0.5) ? h / 2 : 1;
    p.k = first_heads(p.k, hkv);
    p.v = first_heads(p.v, hkv);
    variants += fmt::format(" Hkv={}", hkv);
  }
  if (chance(rng, 0.15)) {
    p.window = AttentionWindow{.left = pick(rng, {-1, 0, 1, 5, 64}), .right = pick(rng, {-1, 0, 3})};
    variants += fmt::format(" window=({}, {})", p.window->left, p.window->right);
  }
  if ((p.causal || p.window) && chance(rng, 0.3)) {
    p.alignment = CausalAlignment::top_left;
    variants += " top-left";
  }
  if (chance(rng, 0.1)) {
    p.softcap = static_cast<double>(pick(rng, {1, 20, 50}));
    variants += fmt::format(" softcap={}", *p.softcap);
  }
  if (chance(rng, 0.1)) {
    const std::vector<double> slopes = alibi_slopes(h);
    p.alibi = Tensor<double>({h});
    for (int64_t i = 0; i < h; ++i) (*p.alibi)[i] = slopes[static_cast<size_t>(i)];
    variants += " alibi";
  }
  if (chance(rng, 0.1)) {
    p.sinks = testing::random_tensor<double>({h}, rng, logit);
    variants += " sinks";
  }
  if (chance(rng, 0.1)) {
    p.dropout = AttentionDropout{.p = static_cast<double>(pick(rng, {1, 5})) / 10.0,
                                 .seed = static_cast<uint64_t>(rng.uniform() * 1e9)};
    variants += fmt::format(" dropout={} seed={}", p.dropout->p, p.dropout->seed);
  }
  if (b == 1 && chance(rng, 0.15)) {
    // Packed sequences: Tq and Tk cut at the same number of random offsets (empty sequences too).
    const int64_t sequences = pick(rng, {1, 2, 3});
    const auto offsets = [&](int64_t total) {
      std::vector<int64_t> cuts{0, total};
      for (int64_t n = 1; n < sequences; ++n)
        cuts.push_back(static_cast<int64_t>(rng.uniform() * static_cast<double>(total + 1)));
      std::sort(cuts.begin(), cuts.end());
      Tensor<int64_t> t({sequences + 1});
      for (int64_t n = 0; n <= sequences; ++n) t[n] = std::min(cuts[static_cast<size_t>(n)], total);
      return t;
    };
    p.cu_seqlens_q = offsets(tq);
    p.cu_seqlens_k = offsets(tk);
    variants += fmt::format(" cu_seqlens_q=[{}] cu_seqlens_k=[{}]", fmt::join(p.cu_seqlens_q->values(), ","),
                            fmt::join(p.cu_seqlens_k->values(), ","));
  }
  // Stored operands, drawn last so that the draws above stay as they were. They are contiguous, and
  // take neither dropout nor packed sequences.
  if (!p.dropout && !p.cu_seqlens_q && chance(rng, 0.25)) {
    const StorageType q_type = draw_storage(rng, false);  // Q is never int8
    const StorageType k_type = draw_storage(rng, true);
    StorageType v_type = draw_storage(rng, true);
    if (q_type == StorageType::float32 && k_type == StorageType::float32 && v_type == StorageType::float32) {
      v_type = StorageType::float16;
    }
    c.stored = testing::store_problem(p, q_type, k_type, v_type);
    c.strided = {};
    strided.clear();
    variants += fmt::format(" q={} k={} v={}", storage_name(q_type), storage_name(k_type), storage_name(v_type));
  } else if (b > 0 && !p.dropout && !p.cu_seqlens_q && p.alignment == CausalAlignment::bottom_right &&
             chance(rng, 0.5)) {
    c.cached = cache_keys(rng, p);
    c.strided[1] = c.strided[2] = false;
    strided.erase(std::remove_if(strided.begin(), strided.end(), [](char x) { return x != 'q'; }), strided.end());
    variants += c.cached->history;
  }
  c.description = fmt::format("B={} H={} Tq={} Tk={} Dk={} Dv={} causal={} scale={}{}{} logits~{} strided={}", b, h, tq,
                              tk, dk, dv, p.causal, p.scale ? fmt::format("{}", *p.scale) : "default", masks, variants,
                              logit, strided.empty() ? "none" : strided);
  return c;
}

// `values` copied into rows padded by a few floats: every dim but the last is strided.
struct PaddedCopy {
  Tensor<float> storage;
  TensorView<const float> view;
};

PaddedCopy padded_copy(const Tensor<double>& values, bool strided) {
  const Shape& s = values.shape();
  const int64_t pad = strided ? 3 : 0;
  PaddedCopy copy{Tensor<float>(Shape{s[0], s[1], s[2], s[3] + pad}), {}};
  const TensorView<float> full = copy.storage.view();
  const TensorView<float> inner{full.data, s, full.strides};
  const TensorView<const double> from = values.view();
  for (int64_t a = 0; a < s[0]; ++a)
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t t = 0; t < s[2]; ++t)
        for (int64_t d = 0; d < s[3]; ++d) inner(a, h, t, d) = static_cast<float>(from(a, h, t, d));
  copy.view = inner;
  return copy;
}

// Batch n of a [B, H, T, D] or [B, H, T] view: the view without its first dim.
template <class T>
TensorView<T> batch(const TensorView<T>& x, int64_t n) {
  const Shape shape = x.rank() == 4 ? Shape{x.shape[1], x.shape[2], x.shape[3]} : Shape{x.shape[1], x.shape[2]};
  return {x.data + n * x.strides[0], shape, Strides{x.strides[1], x.strides[2], x.strides[3]}};
}

// out_only: the fused forward's out when it returns no lse (the reference's out serves as both).
struct Results {
  Tensor<double> out, lse, dq, dk, dv, dbias, dsinks, out_only;
};

// Forward with lse and without it (out_only), then the backward of L = <dout, out>, either
// recomputing the forward or from the saved out and lse.
Results run_fused(const SoakCase& c, const Tensor<double>& dout_d, bool from_saved) {
  const AttentionProblem& p = c.problem;
  const PaddedCopy q = padded_copy(p.q, c.strided[0]), k = padded_copy(p.k, c.strided[1]),
                   v = padded_copy(p.v, c.strided[2]);
  const AttentionOperands<float> ops(p);
  AttentionParams<float> params = ops.params();
  params.q = q.view;
  params.k = k.view;
  params.v = v.view;
  const std::optional<StoredAttentionParams> stored =
      c.stored ? std::optional(testing::stored_params(*c.stored, params)) : std::nullopt;
  const auto forward = [&](const AttentionOutputs<float>& outputs) {
    if (c.cached) {
      // Batch n's mask and bias, from their broadcast over the whole batch's scores.
      const auto batch_of = [&](const auto& mask, int64_t n) {
        return mask ? std::optional(batch(broadcast_to(*mask, p.scores(), "mask"), n)) : std::nullopt;
      };
      for (int64_t n = 0; n < p.q.shape()[0]; ++n) {
        const KvAttendOptions options{.scale = p.scale,
                                      .causal = p.causal,
                                      .window = p.window,
                                      .softcap = p.softcap,
                                      .sinks = params.sinks,
                                      .allowed = batch_of(params.mask.allowed, n),
                                      .bias = batch_of(params.mask.bias, n),
                                      .alibi_slopes = params.mask.alibi_slopes};
        AttentionOutputs<float> one{.out = batch(outputs.out, n), .weights = {}, .lse = {}};
        if (outputs.lse) one.lse = batch(*outputs.lse, n);
        c.cached->cache.attend(c.cached->ids[static_cast<size_t>(n)], batch(params.q, n), one, options);
      }
    } else if (stored) {
      attention_forward(*stored, outputs, AttentionImpl::fused);
    } else {
      attention_forward_fused(params, outputs);
    }
  };
  const Shape& s = p.q.shape();
  Tensor<float> out({s[0], s[1], s[2], p.v.shape()[3]}), lse({s[0], s[1], s[2]}), out_only(out.shape());
  forward(AttentionOutputs<float>{.out = out.view(), .weights = {}, .lse = lse.view()});
  forward(AttentionOutputs<float>{.out = out_only.view(), .weights = {}, .lse = {}});
  if (c.cached) return {cast<double>(out), cast<double>(lse), {}, {}, {}, {}, {}, cast<double>(out_only)};
  const Tensor<float> dout = cast<float>(dout_d);
  Tensor<float> dq(p.q.shape()), dk(p.k.shape()), dv(p.v.shape());
  Tensor<float> dbias = p.bias ? Tensor<float>(p.bias->shape()) : Tensor<float>();
  Tensor<float> dsinks = p.sinks ? Tensor<float>(p.sinks->shape()) : Tensor<float>();
  AttentionGradients<float> grads{.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = {}};
  if (p.bias) grads.dbias = dbias.view();
  if (p.sinks) grads.dsinks = dsinks.view();
  std::optional<AttentionSaved<float>> saved;
  if (from_saved) saved = AttentionSaved<float>{.out = out.cview(), .lse = lse.cview()};
  if (stored) {
    attention_backward(*stored, dout.cview(), grads, saved, AttentionImpl::fused);
  } else {
    attention_backward_fused(params, dout.cview(), grads, saved);
  }
  return {cast<double>(out), cast<double>(lse),   cast<double>(dq),     cast<double>(dk),
          cast<double>(dv),  cast<double>(dbias), cast<double>(dsinks), cast<double>(out_only)};
}

Results run_reference(const AttentionProblem& p, const Tensor<double>& dout) {
  const AttentionOperands<double> ops(p);
  const Shape& s = p.q.shape();
  Results r{Tensor<double>({s[0], s[1], s[2], p.v.shape()[3]}),
            Tensor<double>({s[0], s[1], s[2]}),
            Tensor<double>(p.q.shape()),
            Tensor<double>(p.k.shape()),
            Tensor<double>(p.v.shape()),
            p.bias ? Tensor<double>(p.bias->shape()) : Tensor<double>(),
            p.sinks ? Tensor<double>(p.sinks->shape()) : Tensor<double>(),
            Tensor<double>()};
  attention_forward_reference(ops.params(),
                              AttentionOutputs<double>{.out = r.out.view(), .weights = {}, .lse = r.lse.view()});
  AttentionGradients<double> grads{.dq = r.dq.view(), .dk = r.dk.view(), .dv = r.dv.view(), .dbias = {}};
  if (p.bias) grads.dbias = r.dbias.view();
  if (p.sinks) grads.dsinks = r.dsinks.view();
  attention_backward_reference(ops.params(), dout.cview(), grads);
  return r;
}

// What the reference and naive computations of a case give, computed once for all its runs.
struct Expected {
  Results exact;
  testing::AttentionYardsticks yardsticks;
  double rho = 0;
};

// The first tensor of `got` outside its tolerance, described; nullopt when all are within.
// `bf16_weights`: the forward without lse rounded its weights to bfloat16 (bfloat16 Q, K and V on
// the bf16 dot product), which its tolerance allows for.
std::optional<std::string> first_mismatch(const Results& got, const Expected& want, bool from_saved, bool with_bias,
                                          bool with_sinks, bool bf16_weights, bool forward_only) {
  using R = testing::NaiveResult;
  struct Check {
    const char* name;
    const Tensor<double>& actual;
    const Tensor<double>& exact;
    R which;
    bool gradient;
  };
  const Check checks[] = {{"out", got.out, want.exact.out, R::out, false},
                          {"lse", got.lse, want.exact.lse, R::lse, false},
                          {"out without lse", got.out_only, want.exact.out, R::out, false},
                          {"dq", got.dq, want.exact.dq, R::dq, true},
                          {"dk", got.dk, want.exact.dk, R::dk, true},
                          {"dv", got.dv, want.exact.dv, R::dv, true},
                          {"dbias", got.dbias, want.exact.dbias, R::dbias, true},
                          {"dsinks", got.dsinks, want.exact.dsinks, R::dsinks, true}};
  for (const Check& check : checks) {
    // Without a bias or sinks there is no dbias or dsinks: the default Tensor it is left as is a
    // rank-0 one of 1 value.
    if (!with_bias && std::string_view(check.name) == "dbias") continue;
    if (!with_sinks && std::string_view(check.name) == "dsinks") continue;
    if (forward_only && check.gradient) continue;
    // The saved lse is rounded to float32, which moves every P recomputed from it by up to ρ.
    const double tolerance = bf16_weights && &check.actual == &got.out_only
                                 ? testing::bf16_products_tolerance(want.yardsticks, check.exact)
                                 : testing::attention_tolerance(want.yardsticks, check.which, check.exact,
                                                                from_saved && check.gradient ? want.rho : 0.0);
    const testing::ErrorStats stats = error_stats(check.actual, check.exact);
    if (stats.non_finite || stats.max_abs > tolerance) {
      return fmt::format("{}: max error {:.3e} > tolerance {:.3e} at flat index {} (got {:.9g}, expected {:.9g})",
                         check.name, stats.max_abs, tolerance, stats.worst,
                         stats.worst >= 0 ? check.actual[stats.worst] : 0.0,
                         stats.worst >= 0 ? check.exact[stats.worst] : 0.0);
    }
  }
  return std::nullopt;
}

struct Tally {
  int64_t cases = 0;
  int64_t refused = 0;
  int64_t failed = 0;
  int64_t stored = 0;                         // cases with a float16, bfloat16 or int8 operand
  int64_t cached = 0;                         // cases with K and V in a KvCache
  std::map<std::string, int64_t> per_target;  // runs: a case on one target at one thread count
};

void report_failure(const SoakOptions& o, uint64_t number, const SoakCase& c, const std::string& where,
                    const std::string& what) {
  fmt::print(stderr,
             "qkv soak: FAILED case {} of seed {} ({})\n  case: {}\n  {}\n  repeat it with: qkv soak --seed {} "
             "--case {}{}\n",
             number, o.seed, where, c.description, what, o.seed, number,
             o.threads == std::vector<int>{1, 2} ? "" : fmt::format(" --threads {}", fmt::join(o.threads, ",")));
  std::fflush(stderr);
}

// Runs case `number` on every target and thread count; false, after reporting it, at its first
// mismatch.
bool run_case(const SoakOptions& o, uint64_t number, Tally& tally) {
  const SoakCase c = draw_case(o.seed, number);
  const AttentionProblem& p = c.problem;
  const Tensor<double> dout =
      testing::random_dout(p, (o.seed * 0x9E3779B97F4A7C15ULL + number) ^ 0xD1B54A32D192ED03ULL);
  std::optional<Expected> want;
  std::string reference_refusal;
  try {
    want = Expected{run_reference(p, dout), testing::attention_yardsticks(p, dout), 0.0};
    want->rho = testing::lse_rounding(want->exact.lse);
  } catch (const Error& e) {
    reference_refusal = e.what();
  }
  ++tally.cases;
  if (!want) ++tally.refused;
  if (c.stored) ++tally.stored;
  if (c.cached) ++tally.cached;
  for (const std::string& target : simd_targets()) {
    use_simd_target(target);
    for (const int threads : o.threads) {
      set_max_workers(threads);
      const std::string where = fmt::format("target {}, {} thread{}", target, threads, threads == 1 ? "" : "s");
      for (const bool from_saved : {false, true}) {
        if (c.cached && from_saved) continue;  // a cache has no backward
        const std::string run =
            c.cached ? fmt::format("{}, forward through the cache", where)
                     : fmt::format("{}, backward {}", where, from_saved ? "from the saved lse" : "recomputing");
        std::optional<Results> got;
        try {
          got = run_fused(c, dout, from_saved);
        } catch (const Error& e) {
          if (!want) continue;
          report_failure(o, number, c, run, fmt::format("the fused kernels refused it: {}", e.what()));
          use_simd_target("");
          return false;
        }
        std::optional<std::string> mismatch;
        if (!want) {
          mismatch = fmt::format("the reference refused it ({}) but the fused kernels ran it", reference_refusal);
        } else {
          const bool bf16_weights = c.stored && c.stored->q.type == StorageType::bfloat16 &&
                                    c.stored->k.type == StorageType::bfloat16 &&
                                    c.stored->v.type == StorageType::bfloat16 && attention_bf16_products();
          mismatch = first_mismatch(*got, *want, from_saved, p.bias.has_value(), p.sinks.has_value(), bf16_weights,
                                    c.cached.has_value());
        }
        if (mismatch) {
          report_failure(o, number, c, run, *mismatch);
          use_simd_target("");
          return false;
        }
      }
      ++tally.per_target[target];
    }
  }
  use_simd_target("");
  return true;
}

void run_soak(const SoakOptions& o) {
  if (!(o.seconds >= 0)) throw ValueError(fmt::format("--seconds: expected >= 0, got {}", o.seconds));
  for (const int threads : o.threads) {
    if (threads < 1) throw ValueError(fmt::format("--threads: expected counts >= 1, got {}", threads));
  }
  const int saved_workers = max_workers();
  Tally tally;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  double next_progress = kProgressSeconds;
  const auto run_one = [&](uint64_t number) {
    if (run_case(o, number, tally)) return;
    ++tally.failed;
    if (!o.keep_going) std::exit(kExitFailure);
  };
  if (o.only_case) {
    run_one(*o.only_case);
  } else {
    const auto more = [&](uint64_t number) { return o.cases ? number < *o.cases : elapsed() < o.seconds; };
    for (uint64_t number = 0; more(number); ++number) {
      run_one(number);
      if (elapsed() >= next_progress) {
        fmt::print(stderr, "qkv soak: {} cases in {:.0f} s (through case {}), {} failed\n", tally.cases, elapsed(),
                   number, tally.failed);
        next_progress += kProgressSeconds;
      }
    }
  }
  set_max_workers(saved_workers);
  fmt::print(
      "soak: seed {}, {} cases in {:.1f} s, {} failed ({} refused by both implementations; {} with float16, bfloat16 "
      "or int8 operands, {} with K and V in a KvCache)\n",
      o.seed, tally.cases, elapsed(), tally.failed, tally.refused, tally.stored, tally.cached);
  for (const auto& [target, runs] : tally.per_target) {
    fmt::print("  {}: {} cases × {} thread counts ({} runs)\n", target, runs / static_cast<int64_t>(o.threads.size()),
               o.threads.size(), runs);
  }
  std::fflush(stdout);
  if (tally.failed > 0) std::exit(kExitFailure);
}

}  // namespace

void register_soak(CLI::App& app) {
  auto o = std::make_shared<SoakOptions>();
  CLI::App* cmd =
      app.add_subcommand("soak", "random fused-attention problems against the float64 reference, until a failure");
  CLI::Option* seconds =
      cmd->add_option("--seconds", o->seconds, "how long to draw new cases (a case started is finished)")
          ->capture_default_str();
  const CLI::Validator uint64_range(uint64_error, "0..2^64-1");
  cmd->add_option("--seed", o->seed, "seed of the cases: case K of seed S is the same on every run")
      ->check(uint64_range)
      ->capture_default_str();
  CLI::Option* only_case = cmd->add_option_function<uint64_t>(
                                  "--case", [o](uint64_t number) { o->only_case = number; },
                                  "run this case alone (as a failure's report names it)")
                               ->check(uint64_range)
                               ->type_name("K");
  cmd->add_option_function<uint64_t>(
         "--cases", [o](uint64_t count) { o->cases = count; },
         "run cases 0 to N-1 of the seed, however long they take: the same cases on every machine")
      ->check(uint64_range)
      ->type_name("N")
      ->excludes(seconds)
      ->excludes(only_case);
  cmd->add_option("--threads", o->threads, "thread counts to run every case with, comma-separated")
      ->delimiter(',')
      ->type_name("N,...")
      ->capture_default_str();
  cmd->add_flag("--keep-going", o->keep_going,
                "report every failing case and go on; exit 1 at the end when any failed (counts include them)");
  cmd->callback([o] { run_soak(*o); });
}

}  // namespace qkv::cli
