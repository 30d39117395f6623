// qkv decode: new queries attending to stored keys and values, the step of autoregressive
// decoding. K and V come from .npy files in any storage type (stored_input.hpp). They are attended
// as stored, the fused kernel converting a tile at a time; or, with --cache TYPE, first appended to
// a paged KvCache of that type and attended there, as a decoder that keeps its cache in that type
// would (the cache copies K and V of its own float type as they are and stores others in its type:
// int8 K/V given to an int8 cache are dequantised and quantised again, with the cache's own scales). With
// --cache-file the cache outlives the run: K and V are the tokens to append to the sequence the file
// holds (all of them when the file does not exist yet), and the cache is written back with the
// outputs.

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/storage.hpp"
#include "qkv/io/kv_cache_file.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/kv_cache.hpp"
#include "stored_input.hpp"

namespace qkv::cli {
namespace {

struct DecodeOptions {
  std::string q, k, v, k_scales, v_scales, dtype, cache, cache_file, window, sinks, mask, alibi, out, lse;
  int64_t page_tokens = 256;
  CLI::Option* page_tokens_option = nullptr;
  double scale = 0;
  CLI::Option* scale_option = nullptr;
  double softcap = 0;
  CLI::Option* softcap_option = nullptr;
  bool full = false;
};

void expect_rank3(const StoredArray& a, std::string_view arg, std::string_view meaning) {
  if (a.shape().rank() != 3) {
    throw ShapeError(fmt::format("{}: expected rank 3 ({}), got shape {}", arg, meaning, a.shape().str()));
  }
}

// The float32 values of an operand: its own array when it is stored as float32, else a converted
// copy kept in `copy`.
TensorView<const float> float32_values(const StoredArray& a, std::optional<Tensor<float>>& copy) {
  if (a.type == StorageType::float32) return std::get<Tensor<float>>(a.values).cview();
  copy = to_float32(a.view());
  return copy->cview();
}

// An empty cache of one sequence, its pages added as tokens come.
KvCache new_cache(int64_t kv_heads, int64_t dk, int64_t dv, StorageType type, int64_t page_tokens) {
  KvCache c(
      KvCacheShape{.kv_heads = kv_heads, .dk = dk, .dv = dv, .type = type, .page_tokens = page_tokens, .pages = 1});
  c.add_sequence();
  return c;
}

// A cache read from --cache-file against the run: one sequence, the inputs' heads and dims, the
// type of --cache and the pages of --page-tokens when given.
void check_stored_cache(const KvCache& c, const DecodeOptions& o, int64_t kv_heads, int64_t dk, int64_t dv,
                        StorageType type) {
  const KvCacheShape& s = c.shape();
  if (c.sequence_count() != 1) {
    throw IoError(fmt::format("--cache-file: {}: expected a cache of one sequence (as qkv decode writes), got {}",
                              o.cache_file, c.sequence_count()));
  }
  try {
    c.length(0);
  } catch (const ValueError&) {
    throw IoError(
        fmt::format("--cache-file: {}: expected a cache of one sequence (as qkv decode writes), got one "
                    "that was removed",
                    o.cache_file));
  }
  if (s.type != type) {
    throw ValueError(fmt::format("--cache: expected {} (the type of --cache-file {}), got {}", storage_name(s.type),
                                 o.cache_file, storage_name(type)));
  }
  if (o.page_tokens_option->count() > 0 && o.page_tokens != s.page_tokens) {
    throw ValueError(fmt::format("--page-tokens: expected {} (the pages of --cache-file {}), got {}", s.page_tokens,
                                 o.cache_file, o.page_tokens));
  }
  if (s.kv_heads != kv_heads || s.dk != dk || s.dv != dv) {
    throw ShapeError(fmt::format(
        "--k, --v: expected Hkv = {}, Dk = {}, Dv = {} (those of --cache-file {}), got Hkv = {}, Dk = {}, Dv = {}",
        s.kv_heads, s.dk, s.dv, o.cache_file, kv_heads, dk, dv));
  }
}

void run_decode(const DecodeOptions& o) {
  if (!o.dtype.empty() && o.dtype != "bf16") {
    throw ValueError(fmt::format("--dtype: expected bf16 (what a '<u2' input holds), got {}", o.dtype));
  }
  std::optional<StorageType> cache;
  if (!o.cache.empty()) cache = parse_storage(o.cache, "--cache");
  if (!cache && !o.cache_file.empty()) {
    throw ValueError("--cache-file: expected --cache TYPE with it (the type the cache stores), got none");
  }
  if (!cache && o.page_tokens_option->count() > 0) {
    throw ValueError("--page-tokens: expected --cache with it (it sizes the cache's pages), got none");
  }
  if (o.page_tokens < 1) throw ValueError(fmt::format("--page-tokens: expected at least 1, got {}", o.page_tokens));
  if (o.scale_option->count() > 0 && !std::isfinite(o.scale)) {
    throw ValueError(fmt::format("--scale: expected a finite number, got {}", o.scale));
  }
  if (o.softcap_option->count() > 0 && !(o.softcap > 0 && std::isfinite(o.softcap))) {
    throw ValueError(fmt::format("--softcap: expected a finite number > 0, got {}", o.softcap));
  }
  std::optional<AttentionWindow> window;
  if (!o.window.empty()) window = parse_window(o.window, "--window");
  OutputFiles files;
  files.plan("-o", o.out);
  if (!o.lse.empty()) files.plan("--lse", o.lse);
  // An existing --cache-file is the cache to go on with; either way it is written back with -o.
  std::optional<KvCache> stored_cache;
  if (!o.cache_file.empty() && std::filesystem::exists(o.cache_file)) {
    try {
      stored_cache = KvCache::from_state(read_kv_cache_file(o.cache_file));
    } catch (const IoError& e) {
      throw IoError(fmt::format("--cache-file: {}", e.what()));
    } catch (const Error& e) {
      throw IoError(fmt::format("--cache-file: {}: {}", o.cache_file, e.what()));
    }
  }
  if (!o.cache_file.empty()) files.plan("--cache-file", o.cache_file);

  const bool bf16 = !o.dtype.empty();
  const StoredArray q = read_stored(o.q, "", bf16, {.arg = "--q", .scales_arg = "", .int8_allowed = false});
  const StoredArray k = read_stored(o.k, o.k_scales, bf16, {.arg = "--k", .scales_arg = "--k-scales"});
  const StoredArray v = read_stored(o.v, o.v_scales, bf16, {.arg = "--v", .scales_arg = "--v-scales"});
  if (bf16 && q.type != StorageType::bfloat16 && k.type != StorageType::bfloat16 && v.type != StorageType::bfloat16) {
    throw ValueError("--dtype: bf16 says which '<u2' files hold bfloat16 bits, but none of --q, --k, --v is '<u2'");
  }
  expect_rank3(q, "--q", "[H, Tq, Dk]: the new queries");
  expect_rank3(k, "--k", "[Hkv, Tk, Dk]: the keys of the sequence, or with --cache-file of its new tokens");
  expect_rank3(v, "--v", "[Hkv, Tk, Dv]");
  const int64_t heads = q.shape()[0], tq = q.shape()[1], dk = q.shape()[2];
  const int64_t kv_heads = k.shape()[0], tk = k.shape()[1], dv = v.shape()[2];
  if (k.shape()[2] != dk) {
    throw ShapeError(fmt::format("--k: expected [Hkv, Tk, {}] (Dk of --q), got shape {}", dk, k.shape().str()));
  }
  if (v.shape()[0] != kv_heads || v.shape()[1] != tk) {
    throw ShapeError(
        fmt::format("--v: expected [{}, {}, Dv] (Hkv and Tk of --k), got shape {}", kv_heads, tk, v.shape().str()));
  }
  check_finite(q.view(), "--q");
  check_finite(k.view(), "--k");
  check_finite(v.view(), "--v");
  std::optional<Tensor<float>> sinks;
  if (!o.sinks.empty()) {
    sinks = load_float32(o.sinks, "--sinks");
    if (sinks->shape() != Shape{heads}) {
      throw ShapeError(
          fmt::format("--sinks: expected shape [{}] (one per head of --q), got {}", heads, sinks->shape().str()));
    }
    check_finite(sinks->cview(), "--sinks");
  }
  if (stored_cache) check_stored_cache(*stored_cache, o, kv_heads, dk, dv, *cache);
  // The sequence's length once K and V are appended: the keys a mask covers.
  const int64_t length = (stored_cache ? stored_cache->length(0) : 0) + tk;
  MaskArrays<float> mask;
  if (!o.mask.empty()) {
    mask = to_mask<float>(read_input(o.mask, "--mask", kMaskDtypes), "--mask");
    expect_broadcasts("--mask", mask.shape(), Shape{heads, tq, length}, "[H, Tq, L]");
    if (mask.bias) check_finite(mask.bias->cview(), "--mask", NonFinite::minus_infinity_allowed);
  }
  std::optional<Tensor<float>> alibi;
  if (!o.alibi.empty()) alibi = read_alibi<float>(o.alibi, "--alibi", heads);
  const std::optional<double> scale = o.scale_option->count() > 0 ? std::optional(o.scale) : std::nullopt;
  const std::optional<double> softcap = o.softcap_option->count() > 0 ? std::optional(o.softcap) : std::nullopt;
  const auto view_of = [](const auto& x) { return x ? std::optional(x->cview()) : std::nullopt; };

  Tensor<float> out = allocate_output<float>(Shape{heads, tq, dv}, "-o");
  std::optional<Tensor<float>> lse;
  if (!o.lse.empty()) lse = allocate_output<float>(Shape{heads, tq}, "--lse");
  const AttentionOutputs<float> outputs{
      .out = out.view(), .weights = {}, .lse = lse ? std::optional(lse->view()) : std::nullopt};
  naming_options([&] {
    if (!cache) {
      StoredAttentionParams p{.q = q.view(), .k = k.view(), .v = v.view(), .scale = scale, .mask = {}};
      p.mask.causal = !o.full;
      p.mask.window = window;
      p.softcap = softcap;
      p.sinks = view_of(sinks);
      p.mask.allowed = view_of(mask.allowed);
      p.mask.bias = view_of(mask.bias);
      p.mask.alibi_slopes = view_of(alibi);
      attention_forward(p, outputs, AttentionImpl::fused);
      return;
    }
    KvCache c = stored_cache ? std::move(*stored_cache) : new_cache(kv_heads, dk, dv, *cache, o.page_tokens);
    const int64_t id = 0;
    const int64_t page = c.shape().page_tokens;
    const int64_t pages_needed = (c.length(id) + tk + page - 1) / page;
    const int64_t held = (c.length(id) + page - 1) / page;
    c.add_pages(std::max<int64_t>(0, pages_needed - held - c.free_pages()));
    c.append(id, k.view(), v.view());
    std::optional<Tensor<float>> q_copy;
    c.attend(id, float32_values(q, q_copy), outputs,
             KvAttendOptions{.scale = scale,
                             .causal = !o.full,
                             .window = window,
                             .softcap = softcap,
                             .sinks = view_of(sinks),
                             .allowed = view_of(mask.allowed),
                             .bias = view_of(mask.bias),
                             .alibi_slopes = view_of(alibi)});
    if (!o.cache_file.empty()) files.set("--cache-file", encode_kv_cache_file(c.state()));
  });
  files.set("-o", std::move(out));
  if (lse) files.set("--lse", std::move(*lse));
  files.commit();
}

}  // namespace

void register_decode(CLI::App& app) {
  auto o = std::make_shared<DecodeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "decode",
      "New queries attending to stored keys and values (float32, float16, bfloat16 or int8 with scales), "
      "as stored or through a paged KV cache");
  cmd->footer(R"(Shapes: --q [H, Tq, Dk], --k [Hkv, Tk, Dk], --v [Hkv, Tk, Dv] (one sequence; Hkv divides H).
The queries are the last Tq tokens of the sequence: query i sees keys up to Tk - Tq + i (--full: every key).
Up to 16 queries a head take the decode kernel (keys split across the threads); more take prefill's tiles.
Storage: float32 or float64 (rounded to float32); float16 '<f2'; bfloat16 as its bits in a '<u2' file, read
as bfloat16 only with --dtype bf16; int8 '|i1' (K and V only) with float32 scales that broadcast to it
(--k-scales [Hkv, 1, Dk] per channel, --v-scales [Hkv, Tk, 1] per token; qkv quantize makes both).
Without --cache the fused kernel reads K and V as stored. With --cache TYPE (f32, f16, bf16, int8) they
are appended to a paged KV cache of that type, --page-tokens per page, and attended there. With
--cache-file F as well, the cache outlives the run: F is read when it exists, --k and --v are the new
tokens appended to it (Tk of them; all of the sequence's when F is new), the queries are the last Tq
tokens of the sequence after them, and F is written back with -o, all or nothing.
--mask, --window and --alibi cover the whole sequence after the append, L keys (with --cache-file, the
tokens the file held and the new ones): --mask is [H, Tq, L] or broadcasts to it; the mask of one step's
drafts (a tree of them, each seeing the sequence and its own branch) is [1, Tq, L]. A query that sees
no key gets output 0 and lse -inf.
Out is [H, Tq, Dv] and --lse [H, Tq], float32.)");
  cmd->add_option("--q", o->q, "the new queries, [H, Tq, Dk]: float32, float16 or bfloat16 (.npy)")->required();
  cmd->add_option("--k", o->k, "the keys, [Hkv, Tk, Dk], any storage type (.npy)")->required();
  cmd->add_option("--v", o->v, "the values, [Hkv, Tk, Dv], any storage type (.npy)")->required();
  cmd->add_option("--k-scales", o->k_scales, "for an int8 --k: its float32 scales (.npy)");
  cmd->add_option("--v-scales", o->v_scales, "for an int8 --v: its float32 scales (.npy)");
  cmd->add_option("--dtype", o->dtype, "bf16: the '<u2' inputs hold bfloat16 bits");
  cmd->add_option("--cache", o->cache, "attend through a paged KV cache of this type: f32, f16, bf16 or int8");
  cmd->add_option("--cache-file", o->cache_file,
                  "keep the --cache in this file across runs: --k, --v are then the tokens to append to it");
  o->page_tokens_option = cmd->add_option("--page-tokens", o->page_tokens,
                                          "tokens per page of --cache (256; an existing --cache-file keeps its own)");
  o->scale_option = cmd->add_option("--scale", o->scale, "the scores' scale (1/sqrt(Dk))");
  cmd->add_flag("--full", o->full, "every query sees every key (no causal mask)");
  cmd->add_option("--window", o->window, "LEFT,RIGHT: a query sees keys within LEFT before and RIGHT after it");
  o->softcap_option = cmd->add_option("--softcap", o->softcap, "cap the scores at C: C tanh(s / C)");
  cmd->add_option("--sinks", o->sinks, "one float32 logit per head [H], joining each row's normaliser (.npy)");
  cmd->add_option("--mask", o->mask,
                  "[H, Tq, L] (L: the sequence's length) or broadcasting to it: bool or integer = may attend "
                  "(nonzero), float = a bias added to the scores (-inf masks) (.npy)");
  cmd->add_option("--alibi", o->alibi,
                  "ALiBi: adds -m_h * |i + L - Tq - j| to head h; auto for the standard slopes, or SLOPES.npy [H]")
      ->type_name("auto|FILE");
  cmd->add_option("-o", o->out, "the output, [H, Tq, Dv] (.npy)")->required();
  cmd->add_option("--lse", o->lse, "the log-sum-exp of each query's scores, [H, Tq] (.npy)");
  cmd->callback([o] { run_decode(*o); });
}

}  // namespace qkv::cli
