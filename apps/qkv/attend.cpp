// qkv attend and qkv attend-backward: attention and its gradients over .npy files.
//
// Both subcommands read the same operands (Q, K, V, a mask, the scoring), check every one against
// the others with errors that name the option, compute with the library and only then write their
// outputs, all together (cli::OutputFiles), so that a refused or failed run leaves no file.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/ops/additive_attention.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv::cli {
namespace {

constexpr const char* kAttendFooter =
    R"(Shapes: Q [..., Tq, Dk], K [..., Tk, Dk], V [..., Tk, Dv], with the same leading dims: none,
[H] or [B, H]. Out is [..., Tq, Dv], --weights [..., Tq, Tk] (rows sum to 1), --lse [..., Tq].
Inputs may be float32 or float64 .npy files. When Q, K or V is float64, the run is float64 end to
end (the other inputs are widened, the outputs are float64); else it is float32 (a float64 mask or
dOut is rounded). --score additive runs in float32 only.
Every input and output is a file: - is not standard input or output (write ./- for a file named -).
Inputs are .npy files (C or Fortran order, either byte order), or arrays of an .npz archive that
np.savez wrote: --q arrays.npz:q reads its array q (arrays.npz alone, its only array).
Scores: s_ij = scale * q_i.k_j + mask_ij, scale = 1/sqrt(Dk) unless --scale. With --score additive,
s_ij = w . tanh(Wq q_i + Wk k_j) + mask_ij (--wq [A, Dq], --wk [A, Dk], --ww [A]; Q may then have
Dq != Dk, and there is no scale).
Mask (--mask, broadcast to [B, H, Tq, Tk]): a bool mask says which keys a query may attend to
(true = visible), and so does a uint8 or int64 mask (nonzero = visible); a float mask is a bias
added to the scores, where -inf masks the key.
Causal (--causal) is bottom-right aligned: query i sees key j <= i + Tk - Tq, the usual lower
triangle when Tq == Tk; with Tq < Tk (a KV cache) the last query sees every key. A query that
sees no key gets output 0, weights 0 and lse -inf, never NaN.
Example:
  qkv attend --q q.npy --k k.npy --v v.npy --causal -o out.npy --weights attn.npy)";

constexpr const char* kAttendBackwardFooter =
    R"(Gradients of L = <dO, Out> for Out = attention(Q, K, V) as in `qkv attend --help`: the same
inputs with the same meaning, plus --dout dO [..., Tq, Dv].
Outputs (at least one; only those given are written): --dq [..., Tq, Dk], --dk [..., Tk, Dk],
--dv [..., Tk, Dv]; --dbias (needs a float --mask: its shape, summed over the dims it was broadcast
along); with --score additive --dwq [A, Dq], --dwk [A, Dk], --dww [A] (summed over batch and heads).
Mask: bool, uint8 or int64 = may attend (nonzero = visible), float = additive bias (-inf masks); it
broadcasts to [B, H, Tq, Tk]. Causal: query i sees key j <= i + Tk - Tq (bottom-right aligned). A query that sees
no key has zero gradients.
Example:
  qkv attend-backward --q q.npy --k k.npy --v v.npy --mask bias.npy --dout dout.npy \
      --dq dq.npy --dk dk.npy --dv dv.npy --dbias dbias.npy)";

enum class Score { dot, additive };

// The options both subcommands take: operands, mask and scoring, as given on the command line.
struct InputOptions {
  std::string q, k, v, mask;
  double scale = 0.0;
  const CLI::Option* scale_option = nullptr;  // tells whether --scale was given
  bool causal = false;
  std::string impl = "auto";
  std::string score = "dot";
  std::string w_q, w_k, w;
  bool allow_nonfinite = false;
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
  std::array<OutputOption, 7> outputs{{{"--dq", "write dQ.npy [..., Tq, Dk]", ""},
                                       {"--dk", "write dK.npy [..., Tk, Dk]", ""},
                                       {"--dv", "write dV.npy [..., Tk, Dv]", ""},
                                       {"--dbias", "write dBias.npy, the shape of the float --mask", ""},
                                       {"--dwq", "write dWQ.npy [A, Dq] (--score additive)", ""},
                                       {"--dwk", "write dWK.npy [A, Dk] (--score additive)", ""},
                                       {"--dww", "write dW.npy [A] (--score additive)", ""}}};
};

void add_input_options(CLI::App& cmd, InputOptions& o) {
  cmd.add_option("--q", o.q, "queries Q.npy [..., Tq, Dk]")->type_name("FILE")->required();
  cmd.add_option("--k", o.k, "keys K.npy [..., Tk, Dk]")->type_name("FILE")->required();
  cmd.add_option("--v", o.v, "values V.npy [..., Tk, Dv]")->type_name("FILE")->required();
  o.scale_option = cmd.add_option("--scale", o.scale, "multiplies q.k before the mask is added (default 1/sqrt(Dk))");
  cmd.add_flag("--causal", o.causal, "query i sees key j <= i + Tk - Tq (bottom-right aligned)");
  cmd.add_option(
         "--mask", o.mask,
         "M.npy, broadcast to [B, H, Tq, Tk]: bool, uint8 or int64 = may attend (nonzero), float = additive bias")
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
}

// The operands of one run: read, converted to T (float, or double for float64 dot-product runs)
// and checked against each other.
template <class T>
struct Operands {
  Score score = Score::dot;
  Tensor<T> q;                             // [..., Tq, Dk] ([..., Tq, Dq] with additive scores)
  Tensor<T> k;                             // [..., Tk, Dk]
  Tensor<T> v;                             // [..., Tk, Dv]
  std::optional<Tensor<uint8_t>> allowed;  // a bool or integer --mask, broadcastable to [B, H, Tq, Tk]
  std::optional<Tensor<T>> bias;           // a float --mask, broadcastable to [B, H, Tq, Tk]
  Tensor<float> w_q;                       // [A, Dq], additive scores only
  Tensor<float> w_k;                       // [A, Dk], additive scores only
  Tensor<float> w;                         // [A], additive scores only
  std::optional<double> scale;
  bool causal = false;
  AttentionImpl impl = AttentionImpl::automatic;
  Shape leading;  // the leading dims of Q as given: none, [H] or [B, H]
  int64_t tq = 0, tk = 0, dv = 0;

  Shape with_leading(std::initializer_list<int64_t> tail) const {
    return leading_dims_with(leading, leading.rank(), tail);
  }

  AttentionMask<T> mask() const {
    return {.causal = causal,
            .allowed = allowed ? std::optional(allowed->cview()) : std::nullopt,
            .bias = bias ? std::optional(bias->cview()) : std::nullopt};
  }
  AttentionParams<T> dot_params() const {
    return {.q = q.cview(), .k = k.cview(), .v = v.cview(), .scale = scale, .mask = mask()};
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

void expect_shape(std::string_view arg, const Shape& actual, const Shape& expected, std::string_view meaning) {
  if (!(actual == expected)) {
    throw ShapeError(fmt::format("{}: expected shape {} ({}), got {}", arg, expected.str(), meaning, actual.str()));
  }
}

constexpr std::string_view kMaskDtypes = "bool, uint8 or int64 (nonzero = may attend) or float32/float64 (a bias)";

template <class T>
Tensor<T> to_tensor(NpyArray array, std::string_view arg) {
  if constexpr (std::is_same_v<T, double>) {
    return to_float64(std::move(array), arg);
  } else {
    return to_float32(std::move(array), arg);
  }
}

// Reads --mask as a bool or integer mask or a float bias and checks that it broadcasts to the scores.
template <class T>
void load_mask(const InputOptions& o, const Shape& scores, Operands<T>& x) {
  NpyArray array = read_input(o.mask, "--mask", kMaskDtypes);
  if (array.dtype == DType::boolean || array.dtype == DType::uint8 || array.dtype == DType::int64) {
    x.allowed = to_bool(std::move(array), "--mask");
  } else if (array.dtype == DType::float32 || array.dtype == DType::float64) {
    x.bias = to_tensor<T>(std::move(array), "--mask");
  } else {
    throw ShapeError(fmt::format("--mask: expected dtype {}, got {} (shape {})", kMaskDtypes, dtype_name(array.dtype),
                                 array.shape_str()));
  }
  const Shape shape = x.allowed ? x.allowed->shape() : x.bias->shape();
  bool broadcasts = shape.rank() <= scores.rank();
  for (int i = 1; i <= shape.rank() && broadcasts; ++i) {
    broadcasts = shape.from_back(i) == 1 || shape.from_back(i) == scores.from_back(i);
  }
  if (!broadcasts) {
    throw ShapeError(fmt::format("--mask: expected a shape that broadcasts to the scores [B, H, Tq, Tk] = {}, got {}",
                                 scores.str(), shape.str()));
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
};

Score score_of(const InputOptions& o) { return o.score == "additive" ? Score::additive : Score::dot; }

// The options that fit together, checked before any file is read.
void check_input_options(const InputOptions& o) {
  check_scoring_options(o, score_of(o));
  if (score_of(o) == Score::additive && impl_of(o.impl) == AttentionImpl::fused) {
    throw ValueError(
        "--impl: fused computes dot-product scores only; --score additive has only the reference "
        "implementation (use --impl auto or reference), got --impl fused");
  }
}

InputArrays read_inputs(const InputOptions& o) {
  return {.q = read_input(o.q, "--q", kFloatDtypes),
          .k = read_input(o.k, "--k", kFloatDtypes),
          .v = read_input(o.v, "--v", kFloatDtypes)};
}

// Dot-product attention runs in float64 when Q, K or V is float64, as numpy would promote them;
// additive attention has a float32 implementation only.
bool runs_in_float64(const InputOptions& o, const InputArrays& in) {
  return score_of(o) == Score::dot &&
         (in.q.dtype == DType::float64 || in.k.dtype == DType::float64 || in.v.dtype == DType::float64);
}

template <class T>
Operands<T> load_operands(const InputOptions& o, InputArrays in) {
  Operands<T> x;
  x.score = score_of(o);
  x.impl = impl_of(o.impl);
  x.causal = o.causal;
  if (o.scale_option->count() > 0) x.scale = o.scale;

  x.q = to_tensor<T>(std::move(in.q), "--q");
  const TensorView<const T> q4 = as_bhtd(x.q.cview(), "--q");
  x.leading = leading_dims_with(x.q.shape(), x.q.shape().rank() - 2);
  x.tq = q4.shape[2];
  const int64_t dq = q4.shape[3];
  if (x.score == Score::dot && dq == 0) {
    throw ShapeError(fmt::format("--q: expected d_k (the last dim) >= 1, got shape {}", x.q.shape().str()));
  }

  x.k = to_tensor<T>(std::move(in.k), "--k");
  as_bhtd(x.k.cview(), "--k");  // refuses a rank outside 2 to 4 before Tk is read off the shape
  x.tk = x.k.shape().from_back(2);
  const int64_t dk = x.k.shape().from_back(1);
  if (x.score == Score::dot) {
    expect_shape("--k", x.k.shape(), x.with_leading({x.tk, dq}), "[..., Tk, Dk]: the leading dims and Dk of --q");
  } else {
    expect_shape("--k", x.k.shape(), x.with_leading({x.tk, dk}), "[..., Tk, Dk]: the leading dims of --q");
  }

  x.v = to_tensor<T>(std::move(in.v), "--v");
  as_bhtd(x.v.cview(), "--v");  // the same for Dv
  x.dv = x.v.shape().from_back(1);
  expect_shape("--v", x.v.shape(), x.with_leading({x.tk, x.dv}), "[..., Tk, Dv]: the leading dims of --q, Tk of --k");

  if (!o.mask.empty()) load_mask(o, Shape{q4.shape[0], q4.shape[1], x.tq, x.tk}, x);

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
    check_input_finite(x.q.cview(), "--q");
    check_input_finite(x.k.cview(), "--k");
    check_input_finite(x.v.cview(), "--v");
    if (x.bias) check_input_finite(x.bias->cview(), "--mask", NonFinite::minus_infinity_allowed);
    if (x.score == Score::additive) {
      check_input_finite(x.w_q.cview(), "--wq");
      check_input_finite(x.w_k.cview(), "--wk");
      check_input_finite(x.w.cview(), "--ww");
    }
  }
  return x;
}

template <class T>
void attend(const Operands<T>& x, const std::optional<HeatmapFormat>& heatmap, OutputFiles& files);

void run_attend(const AttendOptions& o) {
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
    attend<double>(load_operands<double>(o.in, std::move(in)), heatmap, files);
  } else {
    attend<float>(load_operands<float>(o.in, std::move(in)), heatmap, files);
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
  if constexpr (std::is_same_v<T, float>) {
    if (x.score == Score::additive) {
      additive_attention_forward(x.additive_params(), outputs);
    } else {
      attention_forward(x.dot_params(), outputs, x.impl);
    }
  } else {
    attention_forward(x.dot_params(), outputs, x.impl);
  }

  // Every head of the first batch entry, written with the arrays: all the files or none.
  if (heatmap) files.set("--heatmap", render_heatmap(weights->cview(), *heatmap, {}));
  files.set("-o", std::move(out));
  if (weights) files.set("--weights", std::move(*weights));
  if (lse) files.set("--lse", std::move(*lse));
  files.commit();
}

template <class T>
void attend_backward(const BackwardOptions& o, const Operands<T>& x, OutputFiles& files);

void run_attend_backward(const BackwardOptions& o) {
  OutputFiles files;
  for (const OutputOption& output : o.outputs) {
    if (!output.path.empty()) files.plan(output.arg, output.path);
  }
  if (files.empty()) {
    throw ValueError(
        "attend-backward: expected at least one of --dq, --dk, --dv, --dbias, --dwq, --dwk, --dww, got none");
  }
  for (const std::string_view arg : {"--dwq", "--dwk", "--dww"}) {
    if (files.planned(arg) && o.in.score != "additive") {
      throw ValueError(fmt::format("{}: only computed with --score additive, got --score {}", arg, o.in.score));
    }
  }
  check_input_options(o.in);
  InputArrays in = read_inputs(o.in);
  if (runs_in_float64(o.in, in)) {
    attend_backward<double>(o, load_operands<double>(o.in, std::move(in)), files);
  } else {
    attend_backward<float>(o, load_operands<float>(o.in, std::move(in)), files);
  }
}

template <class T>
void attend_backward(const BackwardOptions& o, const Operands<T>& x, OutputFiles& files) {
  if (files.planned("--dbias") && !x.bias) {
    throw ValueError(fmt::format("--dbias: needs a float --mask (an additive bias), got {}",
                                 x.allowed ? "a bool or integer --mask" : "no --mask"));
  }
  Tensor<T> dout = to_tensor<T>(read_input(o.dout, "--dout", kFloatDtypes), "--dout");
  expect_shape("--dout", dout.shape(), x.with_leading({x.tq, x.dv}),
               "[..., Tq, Dv]: the shape of the attention output");
  if (!o.in.allow_nonfinite) check_input_finite(dout.cview(), "--dout");

  // The library computes dq, dk and dv whether or not they are written.
  Tensor<T> dq = allocate_output<T>(x.q.shape(), "--dq");
  Tensor<T> dk = allocate_output<T>(x.k.shape(), "--dk");
  Tensor<T> dv = allocate_output<T>(x.v.shape(), "--dv");
  std::optional<Tensor<T>> dbias;
  if (files.planned("--dbias")) dbias = allocate_output<T>(x.bias->shape(), "--dbias");
  const std::optional<TensorView<T>> dbias_view = dbias ? std::optional(dbias->view()) : std::nullopt;

  if (x.score == Score::dot) {
    const AttentionGradients<T> grads{.dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dbias = dbias_view};
    attention_backward<T>(x.dot_params(), dout.cview(), grads, std::nullopt, x.impl);
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
    additive_attention_backward(x.additive_params(), dout.cview(), grads);
    files.set("--dwq", std::move(dw_q));
    files.set("--dwk", std::move(dw_k));
    files.set("--dww", std::move(dw));
  }
  files.set("--dq", std::move(dq));
  files.set("--dk", std::move(dk));
  files.set("--dv", std::move(dv));
  if (dbias) files.set("--dbias", std::move(*dbias));
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
                  "also draw the weights (every head of batch 0): .png, .svg, .pdf or .html (see qkv heatmap)")
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
