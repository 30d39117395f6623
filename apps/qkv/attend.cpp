// qkv attend and qkv attend-backward: attention and its gradients over .npy files.
//
// Both subcommands read the same operands (Q, K, V, a mask, the scoring), check every one against
// the others with errors that name the option, compute with the library and only then write their
// outputs, all together (cli::OutputFiles), so that a refused or failed run leaves no file.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "attend_distributed.hpp"
#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/ops/additive_attention.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/ops/attention_visible.hpp"
#include "qkv/viz/heatmap.hpp"
#include "stored_input.hpp"

namespace qkv::cli {
namespace {

constexpr const char* kAttendFooter =
    R"(Shapes: Q [..., Tq, Dk], K [..., Tk, Dk], V [..., Tk, Dv], with the same leading dims: none,
[H], [B, H], or any number of batch dims [L1, ..., Ln, H] (run as one batch of L1*...*Ln), except
that K and V may have fewer heads Hkv, a divisor of H (grouped-query attention: query head h reads
K and V head h / (H / Hkv); Hkv = 1 is multi-query). --mask broadcasts to [..., H, Tq, Tk].
Out is [..., Tq, Dv], --weights [..., Tq, Tk] (rows sum to 1), --lse [..., Tq].
Inputs may be float32 or float64 .npy files. When Q, K or V is float64, the run is float64 end to
end (the other inputs are widened, the outputs are float64); else it is float32 (a float64 mask or
dOut is rounded). Q, K and V may also be stored narrower, each in its own type, and run in float32
on the values they stand for: float16 '<f2'; bfloat16 as its bits in a '<u2' file, with --dtype
bf16; int8 '|i1' (K and V) with float32 scales that broadcast to it (--k-scales [..., 1, Dk] per
channel, --v-scales [..., Tk, 1] per token; qkv quantize makes both). The fused kernels read them
in place, a block of rows at a time, with the float32 results on those values, except where the
library says otherwise (bfloat16 Q and K sum their scores on the CPU's bf16 dot product where it
has one, and with V bfloat16 too and no --lse round the weights to bfloat16 on it; int8 K and V
without --lse for a few queries scale the query and the weights), and no
copy of them is made; with --weights, --heatmap, --dropout, --cu-seqlens-q/-k, --score additive or
a float64 operand they are converted to float32 (float64) first. An int8 file has at most four
dims. See also qkv decode. --score additive runs in float32 only.
Every input and output is a file: - is not standard input or output (write ./- for a file named -).
Inputs are .npy files (C or Fortran order, either byte order), or arrays of an .npz archive that
np.savez wrote: --q arrays.npz:q reads its array q (arrays.npz alone, its only array).
Scores: s_ij = scale * q_i.k_j + mask_ij, scale = 1/sqrt(Dk) unless --scale. With --score additive,
s_ij = w . tanh(Wq q_i + Wk k_j) + mask_ij (--wq [A, Dq], --wk [A, Dk], --ww [A]; Q may then have
Dq != Dk, and there is no scale).
Mask (--mask, broadcast to [B, H, Tq, Tk]): a bool mask says which keys a query may attend to
(true = visible), and so does a uint8, int32 or int64 mask (nonzero = visible); a float mask is a bias
added to the scores, where -inf masks the key.
Causal (--causal, the same as --causal bottom-right) is bottom-right aligned: query i sees key
j <= i + o with o = Tk - Tq, the usual lower triangle when Tq == Tk; with Tq < Tk (a KV cache) the
last query sees every key. --causal top-left puts the diagonal at o = 0 (torch's is_causal): with
Tq < Tk the last keys are seen by no query. --window and --alibi measure from the same diagonal:
top-left with --causal top-left, bottom-right otherwise.
Variants, which combine with each other and with --mask:
  --window L,R  query i sees keys i + o - L to i + o + R (-1: unbounded); with --causal, a band
  --softcap C   the scaled scores x become C * tanh(x / C), before the mask is added
  --alibi auto  adds -m_h * |i + o - j| to head h (auto: the standard slopes m_h; or a .npy [H])
  --sinks S     S [H]: one logit per head joins each row's softmax with no value (rows sum to < 1)
  --cu-seqlens-q/-k  packed sequences (B = 1): [N+1] offsets from 0 to Tq (Tk); a query sees only
                its own sequence's keys, and causality, the window and ALiBi count within it
  --dropout P   drops each weight with probability P and scales the kept ones by 1/(1 - P); the
                dropped ones are a function of --seed alone; --weights and --lse are before dropout
--score additive takes --window, --causal and --alibi; --softcap, --sinks and --dropout are for
dot-product scores. A query that sees no key gets output 0, weights 0 and lse -inf (the sink's
logit, with --sinks), never NaN.
Example:
  qkv attend --q q.npy --k k.npy --v v.npy --causal -o out.npy --weights attn.npy
  qkv attend --q q.npy --k k.npy --v v.npy --causal top-left --window 128,0 --alibi auto -o out.npy)";

constexpr const char* kAttendBackwardFooter =
    R"(Gradients of L = <dO, Out> for Out = attention(Q, K, V) as in `qkv attend --help`: the same
inputs with the same meaning, plus --dout dO [..., Tq, Dv].
Outputs (at least one; only those given are written): --dq [..., Tq, Dk], --dk [..., Tk, Dk],
--dv [..., Tk, Dv] (with fewer K and V heads, summed over each group of query heads); --dbias
(needs a float --mask: its shape, summed over the dims it was broadcast along); --dsinks [H] (needs
--sinks; summed over batch and queries); with --score additive --dwq [A, Dq], --dwk [A, Dk],
--dww [A] (summed over batch and heads).
Mask: bool, uint8, int32 or int64 = may attend (nonzero = visible), float = additive bias (-inf
masks); it broadcasts to [B, H, Tq, Tk]. Causal: query i sees key j <= i + Tk - Tq (bottom-right
aligned), or j <= i with --causal top-left. --window, --softcap, --alibi, --sinks, --cu-seqlens-q/-k
and --dropout with --seed mean what they mean for attend; dropout drops the same weights as the
forward of the same seed. A query that sees no key has zero gradients.
Example:
  qkv attend-backward --q q.npy --k k.npy --v v.npy --mask bias.npy --dout dout.npy \
      --dq dq.npy --dk dk.npy --dv dv.npy --dbias dbias.npy
  qkv attend-backward --q q.npy --k k.npy --v v.npy --sinks sinks.npy --dout dout.npy --dsinks dsinks.npy)";

enum class Score { dot, additive };

// The options both subcommands take: operands, mask and scoring, as given on the command line.
struct InputOptions {
  std::string q, k, v, mask;
  std::string k_scales, v_scales;  // of int8 K and V
  std::string dtype;               // bf16: the '<u2' inputs hold bfloat16 bits
  double scale = 0.0;
  const CLI::Option* scale_option = nullptr;  // tells whether --scale was given
  std::string causal;                         // "" (not causal), bottom-right or top-left
  std::string window;                         // "L,R"
  double softcap = 0.0;
  const CLI::Option* softcap_option = nullptr;
  std::string alibi;  // auto or a file of slopes
  std::string sinks;
  std::string cu_seqlens_q, cu_seqlens_k;
  double dropout = 0.0;
  const CLI::Option* dropout_option = nullptr;
  uint64_t seed = 0;
  const CLI::Option* seed_option = nullptr;
  std::string impl = "auto";
  std::string score = "dot";
  std::string w_q, w_k, w;
  bool allow_nonfinite = false;
  std::string distributed;  // "" or ring
  std::string shards = "contiguous";
};

struct AttendOptions {
  InputOptions in;
  std::string out, weights, lse;
  std::string heatmap;  // a picture of the weights: .png, .svg, .pdf or .html
};

// An output option of attend-backward: its name, its help line and the path given ("" if none).
struct OutputOption {
  std::string_view arg;
  std::string_view help;
  std::string path;
};

struct BackwardOptions {
  InputOptions in;
  std::string dout;
  std::array<OutputOption, 8> outputs{{{"--dq", "write dQ.npy [..., Tq, Dk]", ""},
                                       {"--dk", "write dK.npy [..., Tk, Dk]", ""},
                                       {"--dv", "write dV.npy [..., Tk, Dv]", ""},
                                       {"--dbias", "write dBias.npy, the shape of the float --mask", ""},
                                       {"--dsinks", "write dSinks.npy [H], the gradient of --sinks", ""},
                                       {"--dwq", "write dWQ.npy [A, Dq] (--score additive)", ""},
                                       {"--dwk", "write dWK.npy [A, Dk] (--score additive)", ""},
                                       {"--dww", "write dW.npy [A] (--score additive)", ""}}};
};

void add_input_options(CLI::App& cmd, InputOptions& o) {
  cmd.add_option("--q", o.q, "queries Q.npy [..., Tq, Dk]")->type_name("FILE")->required();
  cmd.add_option("--k", o.k, "keys K.npy [..., Tk, Dk]")->type_name("FILE")->required();
  cmd.add_option("--v", o.v, "values V.npy [..., Tk, Dv]")->type_name("FILE")->required();
  cmd.add_option("--k-scales", o.k_scales, "for an int8 --k: its float32 scales, broadcasting to it (.npy)")
      ->type_name("FILE");
  cmd.add_option("--v-scales", o.v_scales, "for an int8 --v: its float32 scales, broadcasting to it (.npy)")
      ->type_name("FILE");
  cmd.add_option("--dtype", o.dtype, "bf16: the '<u2' inputs among --q, --k, --v hold bfloat16 bits")
      ->check(CLI::IsMember({"bf16"}));
  o.scale_option = cmd.add_option("--scale", o.scale, "multiplies q.k before the mask is added (default 1/sqrt(Dk))");
  cmd.add_option("--causal", o.causal,
                 "causal mask, bottom-right aligned when given alone (query i sees key j <= i + Tk - Tq) or "
                 "top-left (j <= i, torch's is_causal); the alignment also places --window and --alibi")
      ->expected(0, 1)
      ->default_str("bottom-right")
      ->check(CLI::IsMember({"bottom-right", "top-left"}))
      ->type_name("[ALIGN]");
  cmd.add_option("--window", o.window,
                 "sliding window: query i sees keys i + o - L to i + o + R, o the causal diagonal's offset; -1 is "
                 "unbounded, e.g. 128,0 or -1,0 (causal)")
      ->type_name("L,R");
  o.softcap_option =
      cmd.add_option("--softcap", o.softcap, "logit softcap C > 0: the scaled scores x become C * tanh(x / C)")
          ->type_name("C");
  cmd.add_option("--alibi", o.alibi,
                 "ALiBi: adds -m_h * |i + o - j| to head h; auto for the standard slopes, or SLOPES.npy [H]")
      ->type_name("auto|FILE");
  cmd.add_option("--sinks", o.sinks, "S.npy [H]: one attention-sink logit per head, joining every row's softmax")
      ->type_name("FILE");
  cmd.add_option("--cu-seqlens-q", o.cu_seqlens_q,
                 "F.npy [N+1], int32 or int64: packed sequences (B = 1), sequence n holding queries "
                 "cu[n] to cu[n+1] - 1; needs --cu-seqlens-k")
      ->type_name("FILE");
  cmd.add_option("--cu-seqlens-k", o.cu_seqlens_k,
                 "F.npy [N+1], int32 or int64: the keys of each packed sequence; needs --cu-seqlens-q")
      ->type_name("FILE");
  o.dropout_option = cmd.add_option("--dropout", o.dropout,
                                    "drop each attention weight with probability P in [0, 1), scaling the kept ones "
                                    "by 1/(1 - P); --weights and --lse stay those before dropout")
                         ->type_name("P");
  o.seed_option = cmd.add_option("--seed", o.seed,
                                 "seed of --dropout's mask (default 0), the same on every machine and thread count; "
                                 "only with --dropout")
                      ->check(CLI::Validator(uint64_error, "0..2^64-1"))
                      ->type_name("N");
  cmd.add_option("--mask", o.mask,
                 "M.npy, broadcast to [..., H, Tq, Tk]: bool, uint8, int32 or int64 = may attend (nonzero), float = "
                 "additive bias")
      ->type_name("FILE");
  cmd.add_option("--impl", o.impl,
                 "auto (the fastest implementation that supports the request), fused (tiled online softmax, O(T) "
                 "memory; dot scores only, no --weights or --heatmap) or reference (plain loops, float64 sums)")
      ->check(CLI::IsMember({"auto", "fused", "reference"}))
      ->capture_default_str();
  cmd.add_option("--score", o.score, "dot (scaled dot product) or additive (w . tanh(Wq q + Wk k))")
      ->check(CLI::IsMember({"dot", "additive"}))
      ->capture_default_str();
  cmd.add_option("--wq", o.w_q, "WQ.npy [A, Dq], the query projection of --score additive")->type_name("FILE");
  cmd.add_option("--wk", o.w_k, "WK.npy [A, Dk], the key projection of --score additive")->type_name("FILE");
  cmd.add_option("--ww", o.w, "W.npy [A], the score vector of --score additive")->type_name("FILE");
  cmd.add_flag("--allow-nonfinite", o.allow_nonfinite, "accept NaN and infinities in the inputs");
  cmd.add_option("--distributed", o.distributed,
                 "ring: under mpirun -np P, ring attention over the P ranks, the sequence split along T (float32; "
                 "a path with {rank} is one file per rank, its shard)")
      ->check(CLI::IsMember({"ring"}));
  cmd.add_option("--shards", o.shards,
                 "with --distributed: contiguous (rank r holds tokens r*T/P to (r+1)*T/P) or zigzag (chunks r and "
                 "2P-1-r of 2P: the same work on every rank under --causal)")
      ->check(CLI::IsMember({"contiguous", "zigzag"}));
}

// The options of a distributed run, those it cannot take refused by name.
RingRunOptions ring_options(const InputOptions& o) {
  const std::pair<std::string_view, bool> refused[] = {
      {"--mask", !o.mask.empty()},
      {"--cu-seqlens-q", !o.cu_seqlens_q.empty()},
      {"--dropout", o.dropout_option && o.dropout_option->count() > 0},
      {"--score additive", o.score == "additive"},
      {"--impl reference", o.impl == "reference"},
      {"float16, bfloat16 or int8 inputs (--k-scales, --v-scales, --dtype)",
       !o.k_scales.empty() || !o.v_scales.empty() || !o.dtype.empty()},
  };
  for (const auto& [option, given] : refused) {
    if (given) throw ValueError(fmt::format("--distributed: ring attention does not take {}", option));
  }
  RingRunOptions r;
  r.layout = o.shards;
  r.q = o.q;
  r.k = o.k;
  r.v = o.v;
  if (o.scale_option && o.scale_option->count() > 0) r.scale = o.scale;
  if (o.softcap_option && o.softcap_option->count() > 0) r.softcap = o.softcap;
  r.causal = !o.causal.empty();
  if (o.causal == "top-left") r.alignment = CausalAlignment::top_left;
  if (!o.window.empty()) r.window = parse_window(o.window, "--window");
  r.alibi = o.alibi;
  r.sinks = o.sinks;
  r.allow_nonfinite = o.allow_nonfinite;
  return r;
}

// Q, K or V as a run holds it: its shape as run, and its values as T, but for a file stored
// narrower that the kernels read in place (Operands::reads_stored), of which no copy is made.
template <class T>
struct Operand {
  Shape shape;
  std::optional<Tensor<T>> values;

  TensorView<const T> cview() const { return values.value().cview(); }
};

// The operands of one run: read, converted to T (float, or double for float64 dot-product runs)
// where the run needs them so, and checked against each other.
template <class T>
struct Operands {
  Score score = Score::dot;
  Operand<T> q;                            // [..., Tq, Dk] ([..., Tq, Dq] with additive scores)
  Operand<T> k;                            // [..., Tk, Dk]
  Operand<T> v;                            // [..., Tk, Dv]
  std::optional<Tensor<uint8_t>> allowed;  // a bool or integer --mask, broadcastable to [B, H, Tq, Tk]
  std::optional<Tensor<T>> bias;           // a float --mask, broadcastable to [B, H, Tq, Tk]
  Tensor<float> w_q;                       // [A, Dq], additive scores only
  Tensor<float> w_k;                       // [A, Dk], additive scores only
  Tensor<float> w;                         // [A], additive scores only
  std::optional<double> scale;
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::bottom_right;
  std::optional<AttentionWindow> window;
  std::optional<double> softcap;
  std::optional<Tensor<T>> alibi;  // [H] slopes
  std::optional<Tensor<T>> sinks;  // [H]
  std::optional<Tensor<int64_t>> cu_seqlens_q, cu_seqlens_k;
  std::optional<AttentionDropout> dropout;
  AttentionImpl impl = AttentionImpl::automatic;
  // The files stored narrower than float32 as read, and whether the kernels read them in place
  // (then those operands have no T values).
  std::optional<StoredArray> q_stored, k_stored, v_stored;
  bool reads_stored = false;
  Shape leading;           // the leading dims of Q as run: none, [H] or [B, H]
  Batch batch;             // Q's dims before [H, Tq, Dk] when it has more than four, run as B
  BatchedMask mask_batch;  // the mask's own shape, when Q has a batch
  int64_t tq = 0, tk = 0, dv = 0;

  Shape with_leading(std::initializer_list<int64_t> tail) const {
    return leading_dims_with(leading, leading.rank(), tail);
  }

  AttentionMask<T> mask() const {
    const auto view = [](const auto& tensor) { return tensor ? std::optional(tensor->cview()) : std::nullopt; };
    return {.causal = causal,
            .alignment = alignment,
            .window = window,
            .allowed = view(allowed),
            .bias = view(bias),
            .alibi_slopes = view(alibi),
            .cu_seqlens_q = view(cu_seqlens_q),
            .cu_seqlens_k = view(cu_seqlens_k)};
  }
  AttentionParams<T> dot_params() const {
    return {.q = q.cview(),
            .k = k.cview(),
            .v = v.cview(),
            .scale = scale,
            .mask = mask(),
            .softcap = softcap,
            .sinks = sinks ? std::optional(sinks->cview()) : std::nullopt,
            .dropout = dropout};
  }
  // Whether the kernels can read the narrower files in place: a float32 run of dot-product scores
  // with no dropout and no packed sequences (which the stored operands do not take), each file in
  // the shape it runs in.
  bool can_read_stored() const {
    const auto fits = [](const std::optional<StoredArray>& stored, const Operand<T>& operand) {
      return !stored || stored->shape() == operand.shape;
    };
    return std::is_same_v<T, float> && (q_stored || k_stored || v_stored) && score == Score::dot && !dropout &&
           !cu_seqlens_q && !cu_seqlens_k && fits(q_stored, q) && fits(k_stored, k) && fits(v_stored, v);
  }
  StoredAttentionParams stored_params() const requires std::is_same_v<T, float> {
    const auto view = [](const std::optional<StoredArray>& stored, const Operand<float>& operand) {
      return stored ? stored->view() : StoredView::float32(operand.cview());
    };
    return {.q = view(q_stored, q),
            .k = view(k_stored, k),
            .v = view(v_stored, v),
            .scale = scale,
            .mask = mask(),
            .softcap = softcap,
            .sinks = sinks ? std::optional(sinks->cview()) : std::nullopt};
  }
  AdditiveAttentionParams<float> additive_params() const {
    return {.q = q.cview(),
            .k = k.cview(),
            .v = v.cview(),
            .w_q = w_q.cview(),
            .w_k = w_k.cview(),
            .w = w.cview(),
            .mask = mask()};
  }
};

// The scoring options that fit together: --scale only with dot scores and finite, the three
// weights exactly with additive scores.
void check_scoring_options(const InputOptions& o, Score score) {
  const bool scale_given = o.scale_option->count() > 0;
  if (scale_given && score == Score::additive) {
    throw ValueError(fmt::format("--scale: not used by --score additive (its scores are not scaled), got {}", o.scale));
  }
  if (scale_given && !std::isfinite(o.scale)) {
    throw ValueError(fmt::format("--scale: expected a finite number, got {}", o.scale));
  }
  const std::array<std::pair<std::string_view, const std::string*>, 3> weights{
      {{"--wq", &o.w_q}, {"--wk", &o.w_k}, {"--ww", &o.w}}};
  for (const auto& [arg, path] : weights) {
    if (score == Score::additive && path->empty()) {
      throw ValueError(
          fmt::format("{}: required with --score additive (--wq [A, Dq], --wk [A, Dk], --ww [A]), got nothing", arg));
    }
    if (score == Score::dot && !path->empty()) {
      throw ValueError(fmt::format("{}: only used with --score additive, got {} with --score dot", arg, *path));
    }
  }
}

// The variants' options that fit together, from their values alone, before any file is read. The
// shapes of --sinks and --alibi are checked once read; the offsets of --cu-seqlens-q/-k and whether
// K's heads divide Q's are the library's to check (naming_options names the option).
void check_variant_options(const InputOptions& o, Score score) {
  if (!o.window.empty()) parse_window(o.window, "--window");
  if (o.softcap_option->count() > 0 && (!(o.softcap > 0.0) || !std::isfinite(o.softcap))) {
    throw ValueError(fmt::format("--softcap: expected a positive finite number, got {}", o.softcap));
  }
  if (o.dropout_option->count() > 0 && (!(o.dropout >= 0.0 && o.dropout < 1.0))) {
    throw ValueError(fmt::format("--dropout: expected a probability in [0, 1), got {}", o.dropout));
  }
  if (o.seed_option->count() > 0 && o.dropout_option->count() == 0) {
    throw ValueError(
        fmt::format("--seed: only used by --dropout (it picks the dropped weights), got --seed {} "
                    "without --dropout",
                    o.seed));
  }
  if (o.cu_seqlens_q.empty() != o.cu_seqlens_k.empty()) {
    const bool has_q = !o.cu_seqlens_q.empty();
    throw ValueError(fmt::format("{}: packed sequences need both --cu-seqlens-q and --cu-seqlens-k, got only {} {}",
                                 has_q ? "--cu-seqlens-k" : "--cu-seqlens-q",
                                 has_q ? "--cu-seqlens-q" : "--cu-seqlens-k", has_q ? o.cu_seqlens_q : o.cu_seqlens_k));
  }
  if (score == Score::additive) {
    // AdditiveAttentionParams has no softcap, sinks or dropout; the window, the alignment and ALiBi
    // belong to the mask, which additive attention shares.
    struct DotOnly {
      std::string_view arg, what;
      bool given;
      std::string value;
    };
    const std::array<DotOnly, 3> dot_only{{
        {"--softcap", "softcap", o.softcap_option->count() > 0, fmt::format("{}", o.softcap)},
        {"--sinks", "sinks", !o.sinks.empty(), o.sinks},
        {"--dropout", "dropout", o.dropout_option->count() > 0, fmt::format("{}", o.dropout)},
    }};
    for (const DotOnly& option : dot_only) {
      if (option.given) {
        throw ValueError(
            fmt::format("{}: only used with --score dot (additive attention has no {}), got {} {} with "
                        "--score additive",
                        option.arg, option.what, option.arg, option.value));
      }
    }
  }
}

// `batch`: the shapes are those of a run with Q's batch flattened, shown as the files have them.
void expect_shape(std::string_view arg, const Shape& actual, const Shape& expected, std::string_view meaning,
                  const Batch& batch = {}) {
  if (!(actual == expected)) {
    const auto shown = [&](const Shape& shape) {
      return batch.dims.empty() ? shape.str() : fmt::format("[{}]", fmt::join(batch.file_shape(shape), ", "));
    };
    throw ShapeError(fmt::format("{}: expected shape {} ({}), got {}", arg, shown(expected), meaning, shown(actual)));
  }
}

// Reads --mask as a bool or integer mask or a float bias and checks that it broadcasts to the scores.
template <class T>
void load_mask(const InputOptions& o, const Shape& scores, Operands<T>& x) {
  NpyArray array = read_input(o.mask, "--mask", kMaskDtypes);
  if (!x.batch.dims.empty()) {
    std::vector<int64_t> batched_scores = x.batch.dims;
    batched_scores.insert(batched_scores.end(), scores.dims().begin() + 1, scores.dims().end());
    x.mask_batch = flatten_mask_batch(array, x.batch, batched_scores);
  }
  MaskArrays<T> mask = to_mask<T>(std::move(array), "--mask");
  expect_broadcasts("--mask", mask.shape(), scores, "[B, H, Tq, Tk]");
  x.allowed = std::move(mask.allowed);
  x.bias = std::move(mask.bias);
}

// One value per head of Q, as --sinks gives them.
template <class T>
Tensor<T> load_per_head(NpyArray array, std::string_view arg, int64_t heads, std::string_view meaning) {
  Tensor<T> values = to_tensor<T>(std::move(array), arg);
  expect_shape(arg, values.shape(), Shape{heads}, meaning);
  return values;
}

// The offsets of --cu-seqlens-q or --cu-seqlens-k as int64, whatever the integer width of the file.
Tensor<int64_t> load_offsets(const std::string& path, std::string_view arg) {
  return to_int64(read_input(path, arg, "int32 or int64"), arg);
}

// --alibi, --sinks and --cu-seqlens-q/-k, read and shaped against the `heads` of Q.
template <class T>
void load_variants(const InputOptions& o, int64_t heads, Operands<T>& x) {
  if (!o.alibi.empty()) x.alibi = read_alibi<T>(o.alibi, "--alibi", heads);
  if (!o.sinks.empty()) {
    x.sinks = load_per_head<T>(read_input(o.sinks, "--sinks", kFloatDtypes), "--sinks", heads,
                               "[H]: one logit per head of --q");
  }
  if (!o.cu_seqlens_q.empty()) {
    x.cu_seqlens_q = load_offsets(o.cu_seqlens_q, "--cu-seqlens-q");
    x.cu_seqlens_k = load_offsets(o.cu_seqlens_k, "--cu-seqlens-k");
  }
}

AttentionImpl impl_of(std::string_view name) {
  if (name == "fused") return AttentionImpl::fused;
  if (name == "reference") return AttentionImpl::reference;
  return AttentionImpl::automatic;
}

// Q, K and V as read, before the run's dtype is chosen from them.
struct InputArrays {
  NpyArray q, k, v;
  std::optional<StoredArray> q_stored, k_stored, v_stored;  // those stored narrower, as read
};

Score score_of(const InputOptions& o) { return o.score == "additive" ? Score::additive : Score::dot; }

// The options that fit together, checked before any file is read.
void check_input_options(const InputOptions& o) {
  check_scoring_options(o, score_of(o));
  check_variant_options(o, score_of(o));
  if (score_of(o) == Score::additive && impl_of(o.impl) == AttentionImpl::fused) {
    throw ValueError(
        "--impl: fused computes dot-product scores only; --score additive has only the reference "
        "implementation (use --impl auto or reference), got --impl fused");
  }
}

// An operand as read: a float32 or float64 file as it is; one stored narrower (float16, bfloat16,
// int8 with scales) in `stored`, as it is stored, and here with its shape alone: load_operands
// converts it to float values only for a run that cannot read it in place (--weights, dropout,
// packed sequences, additive scores, float64).
NpyArray read_operand(const std::string& path, const std::string& scales, const InputOptions& o,
                      const StoredOption& option, bool& bfloat16_read, std::optional<StoredArray>& stored) {
  NpyArray array = read_input(path, option.arg, stored_dtypes(option));
  if ((array.dtype == DType::float32 || array.dtype == DType::float64) && scales.empty()) return array;
  // A tensor has at most four dims: a file's batch dims before [H, T, D] are merged into one, as the
  // run merges them (flatten_batch), and the converted values keep the file's shape for that.
  const std::vector<int64_t> file_shape = array.shape;
  if (file_shape.size() > 4) {
    if (array.dtype == DType::int8) {
      throw ShapeError(
          fmt::format("{}: expected an int8 array of at most four dims (its scales are one array of the "
                      "same rank), got shape {}; merge the dims before [H, T, D]",
                      option.arg, array.shape_str()));
    }
    const auto heads = file_shape.end() - 3;
    array.shape = {std::accumulate(file_shape.begin(), heads, int64_t{1}, std::multiplies<>()), heads[0], heads[1],
                   heads[2]};
  }
  stored = stored_of(std::move(array), scales, !o.dtype.empty(), option);
  bfloat16_read = bfloat16_read || stored->type == StorageType::bfloat16;
  NpyArray shape_only;
  shape_only.shape = file_shape;
  return shape_only;
}

InputArrays read_inputs(const InputOptions& o) {
  bool bfloat16_read = false;
  InputArrays in;
  in.q = read_operand(o.q, "", o, {.arg = "--q", .scales_arg = "", .int8_allowed = false}, bfloat16_read, in.q_stored);
  in.k = read_operand(o.k, o.k_scales, o, {.arg = "--k", .scales_arg = "--k-scales"}, bfloat16_read, in.k_stored);
  in.v = read_operand(o.v, o.v_scales, o, {.arg = "--v", .scales_arg = "--v-scales"}, bfloat16_read, in.v_stored);
  if (!o.dtype.empty() && !bfloat16_read) {
    throw ValueError("--dtype: bf16 says which '<u2' files hold bfloat16 bits, but none of --q, --k, --v is '<u2'");
  }
  return in;
}

// Dot-product attention runs in float64 when Q, K or V is float64, as numpy would promote them;
// additive attention has a float32 implementation only.
bool runs_in_float64(const InputOptions& o, const InputArrays& in) {
  return score_of(o) == Score::dot &&
         (in.q.dtype == DType::float64 || in.k.dtype == DType::float64 || in.v.dtype == DType::float64);
}

// An operand's values as T from its file, or its shape alone for a file stored narrower (`stored`).
template <class T>
Operand<T> operand_of(NpyArray array, const std::optional<StoredArray>& stored, std::string_view arg) {
  if (stored) return {.shape = shape_of(array, arg), .values = std::nullopt};
  Tensor<T> values = to_tensor<T>(std::move(array), arg);
  return {.shape = values.shape(), .values = std::move(values)};
}

// The values a file stored narrower stands for, as T in the operand's shape.
template <class T>
void convert_stored(Operand<T>& operand, const std::optional<StoredArray>& stored) {
  if (!stored) return;
  Tensor<float> values = to_float32(stored->view());
  if constexpr (std::is_same_v<T, float>) {
    operand.values = Tensor<float>(operand.shape, std::move(values.values()));
  } else {
    operand.values = Tensor<T>(operand.shape, std::vector<T>(values.values().begin(), values.values().end()));
  }
}

// `weights_wanted`: the run forms the attention weights, which a forward reading stored operands
// never gives, so those are converted to T.
template <class T>
Operands<T> load_operands(const InputOptions& o, InputArrays in, bool weights_wanted) {
  Operands<T> x;
  x.score = score_of(o);
  x.impl = impl_of(o.impl);
  x.q_stored = std::move(in.q_stored);
  x.k_stored = std::move(in.k_stored);
  x.v_stored = std::move(in.v_stored);
  x.causal = !o.causal.empty();
  if (o.causal == "top-left") x.alignment = CausalAlignment::top_left;
  if (o.scale_option->count() > 0) x.scale = o.scale;
  if (!o.window.empty()) x.window = parse_window(o.window, "--window");
  if (o.softcap_option->count() > 0) x.softcap = o.softcap;
  if (o.dropout_option->count() > 0) x.dropout = AttentionDropout{.p = o.dropout, .seed = o.seed};

  x.batch = batch_of(in.q, "--q");
  flatten_batch(in.q, x.batch, "--q", "[H, Tq, Dk]");
  flatten_batch(in.k, x.batch, "--k", "[Hkv, Tk, Dk]");
  flatten_batch(in.v, x.batch, "--v", "[Hkv, Tk, Dv]");
  x.q = operand_of<T>(std::move(in.q), x.q_stored, "--q");
  const Shape q4 = as_bhtd(make_view<const T>(nullptr, x.q.shape), "--q").shape;
  x.leading = leading_dims_with(x.q.shape, x.q.shape.rank() - 2);
  x.tq = q4[2];
  const int64_t dq = q4[3];
  if (x.score == Score::dot && dq == 0) {
    throw ShapeError(fmt::format("--q: expected d_k (the last dim) >= 1, got shape {}", x.q.shape.str()));
  }

  x.k = operand_of<T>(std::move(in.k), x.k_stored, "--k");
  // Refuses a rank outside 2 to 4 before Tk is read off the shape.
  as_bhtd(make_view<const T>(nullptr, x.k.shape), "--k");
  x.tk = x.k.shape.from_back(2);
  const int64_t dk = x.k.shape.from_back(1);
  // K and V take their heads from K: whether they divide Q's is the library's check, in its words.
  Shape kv_leading = x.leading;
  if (kv_leading.rank() >= 1 && x.k.shape.rank() == x.q.shape.rank()) {
    kv_leading[kv_leading.rank() - 1] = x.k.shape.from_back(3);
  }
  const auto kv_shape = [&](int64_t t, int64_t d) { return leading_dims_with(kv_leading, kv_leading.rank(), {t, d}); };
  if (x.score == Score::dot) {
    expect_shape("--k", x.k.shape, kv_shape(x.tk, dq),
                 "[..., Hkv, Tk, Dk]: the leading dims of --q but for the heads, and Dk of --q", x.batch);
  } else {
    expect_shape("--k", x.k.shape, kv_shape(x.tk, dk), "[..., Hkv, Tk, Dk]: the leading dims of --q but for the heads",
                 x.batch);
  }

  x.v = operand_of<T>(std::move(in.v), x.v_stored, "--v");
  as_bhtd(make_view<const T>(nullptr, x.v.shape), "--v");  // the same for Dv
  x.dv = x.v.shape.from_back(1);
  expect_shape("--v", x.v.shape, kv_shape(x.tk, x.dv), "[..., Hkv, Tk, Dv]: the leading dims and Tk of --k", x.batch);

  if (!o.mask.empty()) load_mask(o, Shape{q4[0], q4[1], x.tq, x.tk}, x);
  load_variants(o, q4[1], x);

  if (x.score == Score::additive) {
    x.w_q = load_float32(o.w_q, "--wq");
    if (x.w_q.shape().rank() != 2 || x.w_q.shape()[1] != dq) {
      throw ShapeError(
          fmt::format("--wq: expected shape [A, {}] ([A, Dq]: Dq of --q), got {}", dq, x.w_q.shape().str()));
    }
    const int64_t hidden = x.w_q.shape()[0];
    x.w_k = load_float32(o.w_k, "--wk");
    expect_shape("--wk", x.w_k.shape(), Shape{hidden, dk}, "[A, Dk]: A of --wq, Dk of --k");
    x.w = load_float32(o.w, "--ww");
    expect_shape("--ww", x.w.shape(), Shape{hidden}, "[A]: A of --wq");
  }

  if (!o.allow_nonfinite) {
    const auto check_operand = [](const Operand<T>& operand, const std::optional<StoredArray>& stored,
                                  std::string_view arg) {
      if (stored) {
        check_input_finite(stored->view(), arg);
      } else {
        check_input_finite(operand.cview(), arg);
      }
    };
    check_operand(x.q, x.q_stored, "--q");
    check_operand(x.k, x.k_stored, "--k");
    check_operand(x.v, x.v_stored, "--v");
    if (x.bias) check_input_finite(x.bias->cview(), "--mask", NonFinite::minus_infinity_allowed);
    if (x.alibi) check_input_finite(x.alibi->cview(), "--alibi");
    if (x.sinks) check_input_finite(x.sinks->cview(), "--sinks");
    if (x.score == Score::additive) {
      check_input_finite(x.w_q.cview(), "--wq");
      check_input_finite(x.w_k.cview(), "--wk");
      check_input_finite(x.w.cview(), "--ww");
    }
  }
  x.reads_stored = !weights_wanted && x.can_read_stored();
  if (!x.reads_stored) {
    convert_stored(x.q, x.q_stored);
    convert_stored(x.k, x.k_stored);
    convert_stored(x.v, x.v_stored);
  }
  return x;
}

template <class T>
void attend(const Operands<T>& x, const std::optional<HeatmapFormat>& heatmap, OutputFiles& files);

void run_attend(const AttendOptions& o) {
  if (!o.in.distributed.empty()) {
    if (!o.weights.empty() || !o.heatmap.empty()) {
      throw ValueError(fmt::format("{}: ring attention never forms the attention weights; drop it",
                                   o.weights.empty() ? "--heatmap" : "--weights"));
    }
    RingRunOptions r = ring_options(o.in);
    r.out = o.out;
    r.lse = o.lse;
    run_ring(r);
    return;
  }
  OutputFiles files;
  files.plan("-o", o.out);
  if (!o.weights.empty()) files.plan("--weights", o.weights);
  if (!o.lse.empty()) files.plan("--lse", o.lse);
  std::optional<HeatmapFormat> heatmap;
  if (!o.heatmap.empty()) {
    heatmap = heatmap_format_for_path(o.heatmap, "--heatmap");
    files.plan("--heatmap", o.heatmap);
  }
  // The fused kernel never materialises the weights, so it cannot give them.
  if (o.in.impl == "fused") {
    for (const std::string_view arg : {"--weights", "--heatmap"}) {
      if (files.planned(arg)) {
        throw ValueError(
            fmt::format("{}: the fused implementation never forms the attention weights; drop {} or use "
                        "--impl auto or reference, got --impl fused",
                        arg, arg));
      }
    }
  }
  check_input_options(o.in);
  InputArrays in = read_inputs(o.in);
  if (runs_in_float64(o.in, in)) {
    attend<double>(load_operands<double>(o.in, std::move(in), files.planned("--weights") || heatmap), heatmap, files);
  } else {
    attend<float>(load_operands<float>(o.in, std::move(in), files.planned("--weights") || heatmap), heatmap, files);
  }
}

// An output computed with Q's batch flattened ([L1*...*Ln, ...]), written as [L1, ..., Ln, ...].
template <class T>
void set_output(OutputFiles& files, std::string_view arg, Tensor<T> values, const Batch& batch) {
  if (batch.dims.empty()) {
    files.set(arg, std::move(values));
  } else {
    files.set(arg, encode_npy(values.cview(), batch.file_shape(values.shape())));
  }
}

template <class T>
void attend(const Operands<T>& x, const std::optional<HeatmapFormat>& heatmap, OutputFiles& files) {
  Tensor<T> out = allocate_output<T>(x.with_leading({x.tq, x.dv}), "-o");
  std::optional<Tensor<T>> weights;
  std::optional<Tensor<T>> lse;
  if (files.planned("--weights") || heatmap) weights = allocate_output<T>(x.with_leading({x.tq, x.tk}), "--weights");
  if (files.planned("--lse")) lse = allocate_output<T>(x.with_leading({x.tq}), "--lse");
  const AttentionOutputs<T> outputs{.out = out.view(),
                                    .weights = weights ? std::optional(weights->view()) : std::nullopt,
                                    .lse = lse ? std::optional(lse->view()) : std::nullopt};
  naming_options([&] {
    if constexpr (std::is_same_v<T, float>) {
      if (x.score == Score::additive) {
        additive_attention_forward(x.additive_params(), outputs);
        return;
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      if (x.reads_stored) {
        attention_forward(x.stored_params(), outputs, x.impl);
        return;
      }
    }
    attention_forward(x.dot_params(), outputs, x.impl);
  });

  // Every head of the first batch entry, written with the arrays: all the files or none. The cells
  // the mask hid are drawn as masked, not as the weights of 0 they hold.
  if (heatmap) {
    Tensor<uint8_t> visible(weights->shape());
    naming_options([&] { attention_visible(x.q.cview(), x.k.cview(), x.mask(), as_rank4(visible.view())); });
    HeatmapOptions picture;
    picture.allowed = visible.cview();
    files.set("--heatmap", render_heatmap(weights->cview(), *heatmap, picture));
  }
  set_output(files, "-o", std::move(out), x.batch);
  if (weights) set_output(files, "--weights", std::move(*weights), x.batch);
  if (lse) set_output(files, "--lse", std::move(*lse), x.batch);
  files.commit();
}

template <class T>
void attend_backward(const BackwardOptions& o, const Operands<T>& x, OutputFiles& files);

void run_attend_backward(const BackwardOptions& o) {
  if (!o.in.distributed.empty()) {
    RingRunOptions r = ring_options(o.in);
    r.backward = true;
    r.dout = o.dout;
    for (const OutputOption& output : o.outputs) {
      if (output.path.empty()) continue;
      if (output.arg == "--dq")
        r.dq = output.path;
      else if (output.arg == "--dk")
        r.dk = output.path;
      else if (output.arg == "--dv")
        r.dv = output.path;
      else if (output.arg == "--dsinks")
        r.dsinks = output.path;
      else
        throw ValueError(fmt::format("{}: not computed by --distributed ring", output.arg));
    }
    if (r.dq.empty() && r.dk.empty() && r.dv.empty() && r.dsinks.empty()) {
      throw ValueError("attend-backward: expected at least one of --dq, --dk, --dv, --dsinks, got none");
    }
    if (!r.dsinks.empty() && r.sinks.empty()) {
      throw ValueError("--dsinks: needs --sinks (it is their gradient), got no --sinks");
    }
    run_ring(r);
    return;
  }
  OutputFiles files;
  for (const OutputOption& output : o.outputs) {
    if (!output.path.empty()) files.plan(output.arg, output.path);
  }
  if (files.empty()) {
    throw ValueError(
        "attend-backward: expected at least one of --dq, --dk, --dv, --dbias, --dsinks, --dwq, --dwk, --dww, got "
        "none");
  }
  if (files.planned("--dsinks") && o.in.sinks.empty()) {
    throw ValueError("--dsinks: needs --sinks (it is their gradient), got no --sinks");
  }
  for (const std::string_view arg : {"--dwq", "--dwk", "--dww"}) {
    if (files.planned(arg) && o.in.score != "additive") {
      throw ValueError(fmt::format("{}: only computed with --score additive, got --score {}", arg, o.in.score));
    }
  }
  check_input_options(o.in);
  InputArrays in = read_inputs(o.in);
  if (runs_in_float64(o.in, in)) {
    attend_backward<double>(o, load_operands<double>(o.in, std::move(in), false), files);
  } else {
    attend_backward<float>(o, load_operands<float>(o.in, std::move(in), false), files);
  }
}

template <class T>
void attend_backward(const BackwardOptions& o, const Operands<T>& x, OutputFiles& files) {
  if (files.planned("--dbias") && !x.bias) {
    throw ValueError(fmt::format("--dbias: needs a float --mask (an additive bias), got {}",
                                 x.allowed ? "a bool or integer --mask" : "no --mask"));
  }
  NpyArray dout_array = read_input(o.dout, "--dout", kFloatDtypes);
  flatten_batch(dout_array, x.batch, "--dout", "[H, Tq, Dv]");
  Tensor<T> dout = to_tensor<T>(std::move(dout_array), "--dout");
  expect_shape("--dout", dout.shape(), x.with_leading({x.tq, x.dv}), "[..., Tq, Dv]: the shape of the attention output",
               x.batch);
  if (!o.in.allow_nonfinite) check_input_finite(dout.cview(), "--dout");

  // The library computes dq, dk and dv whether or not they are written.
  Tensor<T> dq = allocate_output<T>(x.q.shape, "--dq");
  Tensor<T> dk = allocate_output<T>(x.k.shape, "--dk");
  Tensor<T> dv = allocate_output<T>(x.v.shape, "--dv");
  std::optional<Tensor<T>> dbias;
  if (files.planned("--dbias")) dbias = allocate_output<T>(x.bias->shape(), "--dbias");
  const std::optional<TensorView<T>> dbias_view = dbias ? std::optional(dbias->view()) : std::nullopt;
  std::optional<Tensor<T>> dsinks;
  if (files.planned("--dsinks")) dsinks = allocate_output<T>(x.sinks->shape(), "--dsinks");

  if (x.score == Score::dot) {
    const AttentionGradients<T> grads{.dq = dq.view(),
                                      .dk = dk.view(),
                                      .dv = dv.view(),
                                      .dbias = dbias_view,
                                      .dsinks = dsinks ? std::optional(dsinks->view()) : std::nullopt};
    naming_options([&] {
      if constexpr (std::is_same_v<T, float>) {
        if (x.reads_stored) {
          attention_backward(x.stored_params(), dout.cview(), grads, std::nullopt, x.impl);
          return;
        }
      }
      attention_backward<T>(x.dot_params(), dout.cview(), grads, std::nullopt, x.impl);
    });
  } else if constexpr (std::is_same_v<T, float>) {
    Tensor<float> dw_q = allocate_output(x.w_q.shape(), "--dwq");
    Tensor<float> dw_k = allocate_output(x.w_k.shape(), "--dwk");
    Tensor<float> dw = allocate_output(x.w.shape(), "--dww");
    const AdditiveAttentionGradients<float> grads{.dq = dq.view(),
                                                  .dk = dk.view(),
                                                  .dv = dv.view(),
                                                  .dw_q = dw_q.view(),
                                                  .dw_k = dw_k.view(),
                                                  .dw = dw.view(),
                                                  .dbias = dbias_view};
    naming_options([&] { additive_attention_backward(x.additive_params(), dout.cview(), grads); });
    files.set("--dwq", std::move(dw_q));
    files.set("--dwk", std::move(dw_k));
    files.set("--dww", std::move(dw));
  }
  set_output(files, "--dq", std::move(dq), x.batch);
  set_output(files, "--dk", std::move(dk), x.batch);
  set_output(files, "--dv", std::move(dv), x.batch);
  if (dbias && x.batch.dims.empty()) {
    files.set("--dbias", std::move(*dbias));
  } else if (dbias) {
    // The gradient of the mask as given: summed over the batch entries an expanded mask was copied to.
    const Tensor<T> own =
        x.mask_batch.expanded ? sum_expanded_mask_gradient(*dbias, x.batch, x.mask_batch) : std::move(*dbias);
    files.set("--dbias", encode_npy(own.cview(), x.mask_batch.shape));
  }
  if (dsinks) files.set("--dsinks", std::move(*dsinks));
  files.commit();
}

}  // namespace

void register_attend(CLI::App& app) {
  auto options = std::make_shared<AttendOptions>();
  CLI::App* cmd =
      app.add_subcommand("attend", "attention forward: Out = softmax(scale * Q Kᵀ + mask) V, from .npy files");
  cmd->footer(kAttendFooter);
  add_input_options(*cmd, options->in);
  cmd->add_option("-o,--out", options->out, "output Out.npy [..., Tq, Dv]")->type_name("FILE")->required();
  cmd->add_option("--weights", options->weights, "also write the attention weights A.npy [..., Tq, Tk]")
      ->type_name("FILE");
  cmd->add_option("--lse", options->lse, "also write each row's log-sum-exp of the scores L.npy [..., Tq]")
      ->type_name("FILE");
  cmd->add_option("--heatmap", options->heatmap,
                  "also draw the weights (every head of batch 0): .png, .svg, .pdf or .html (see qkv heatmap); "
                  "the keys the mask hides are drawn as masked")
      ->type_name("FILE");
  cmd->callback([options] { run_attend(*options); });
}

void register_attend_backward(CLI::App& app) {
  auto options = std::make_shared<BackwardOptions>();
  CLI::App* cmd = app.add_subcommand("attend-backward",
                                     "attention backward: dQ, dK, dV (and dbias, dW) from dOut, from .npy files");
  cmd->footer(kAttendBackwardFooter);
  add_input_options(*cmd, options->in);
  cmd->add_option("--dout", options->dout, "dOut.npy [..., Tq, Dv], the gradient of the loss w.r.t. the output")

      ->type_name("FILE")
      ->required();
  for (OutputOption& output : options->outputs) {
    cmd->add_option(std::string(output.arg), output.path, std::string(output.help))->type_name("FILE");
  }
  cmd->callback([options] { run_attend_backward(*options); });
}

}  // namespace qkv::cli
