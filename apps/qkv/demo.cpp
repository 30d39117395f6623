// qkv demo: the worked example of self-attention, end to end, on a handful of tokens.
//
// T tokens get random features X ~ N(0, 1) [T, 32] and three projections W_Q, W_K, W_V [32, 32]
// initialised as torch.nn.Linear(32, 32, bias=False) would be; then
//   1. project    Q = X W_Qᵀ, K = X W_Kᵀ, V = X W_Vᵀ                     [T, 32] each
//   2. score      e_ij = q_i·k_j / √32                                  [T, T]
//   3. normalise  α_i = softmax(e_i·), each row sums to 1               [T, T]
//   4. weigh      out_i = Σ_j α_ij v_j                                  [T, 32]
// and α, the "who looks at whom" matrix, is printed as numbers and as a heatmap, and saved as a
// picture (attention.png) and an interactive page (attention.html) in --out-dir, with the arrays
// themselves (X, W_Q, W_K, W_V, Q, K, V, α; attention_arrays/*.npy) so that numpy or the PyTorch
// original can be run on the same numbers. --score additive scores with Bahdanau's small network
// instead, e_ij = w·tanh(W_a q_i + U_a k_j), on the same Q and K. Everything is drawn from
// qkv::Rng(seed), so a seed reproduces the output byte for byte on every platform (at one terminal
// width: what is printed is fitted to it, see terminal_width in cli_io.hpp).

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/core/text.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/ops/additive_attention.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv::cli {
namespace {

constexpr int64_t kDim = 32;
constexpr int64_t kMaxTokens = 64;
// A sentence about reading a book, like the one the example was first told with.
constexpr std::string_view kDefaultTokens = "the student is reading a book";
// How many leading features of a row step 1 and 4 show, and how many terms of a weighted sum.
constexpr int64_t kShownFeatures = 4;
constexpr int64_t kShownTerms = 6;
// Up to this many tokens, the saved picture prints each weight on its cell.
constexpr int64_t kAnnotatedTokens = 12;

// The folder of --out-dir that the arrays go to, one .npy each.
constexpr std::string_view kArraysDir = "attention_arrays";

struct DemoOptions {
  uint64_t seed = 0;
  std::string score = "dot";
  std::string tokens;
  CLI::Option* tokens_option = nullptr;  // tells "--tokens ''" (refused) from no --tokens
  std::string tokens_file;               // --tokens-file: the tokens one per line
  CLI::Option* tokens_file_option = nullptr;
  bool explain = false;
  std::string color = "auto";
  std::string out_dir = ".";
  bool no_files = false;
};

// m [T, T] with token labels on both axes, 3 decimals, and a last column of row sums when asked.
// Columns are as wide as their label or their widest value, whichever is wider; when that is wider
// than `width`, labels are cut to the values' width and only the first columns that fit are shown,
// with a line saying so (the sums are of whole rows).
std::string labelled_matrix(TensorView<const double> m, const std::vector<std::string>& tokens, bool row_sums,
                            int64_t width) {
  const auto format = [](double value) { return fmt::format("{:.3f}", value); };
  const int64_t n = m.shape[0];
  int64_t value_width = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) value_width = std::max(value_width, display_width(format(m(i, j))));
  }
  int64_t label_width = 0;
  for (const std::string& token : tokens) label_width = std::max(label_width, display_width(token));
  const std::string indent = "   ";
  const int64_t sums_width = row_sums ? 3 + value_width : 0;
  std::vector<int64_t> col_widths;
  int64_t natural = display_width(indent) + label_width + sums_width;
  for (const std::string& token : tokens) {
    col_widths.push_back(std::max(value_width, display_width(token)));
    natural += 1 + col_widths.back();
  }
  int64_t shown = n;
  if (natural > width) {
    label_width = std::min(label_width, std::max(value_width, width / 5));
    col_widths.assign(static_cast<size_t>(n), value_width);
    const int64_t room = width - display_width(indent) - label_width - sums_width;
    shown = std::clamp<int64_t>(room / (1 + value_width), 1, n);
  }
  const auto cell = [&](std::string_view text, int64_t j) {
    return ' ' + pad_left(truncate_to_width(text, col_widths[j]), col_widths[j]);
  };

  std::string out = indent + pad_right("", label_width);
  for (int64_t j = 0; j < shown; ++j) out += cell(tokens[j], j);
  if (row_sums) out += "   " + pad_left("sum", value_width);
  out += '\n';
  for (int64_t i = 0; i < n; ++i) {
    out += indent + pad_right(truncate_to_width(tokens[i], label_width), label_width);
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      if (j < shown) out += cell(format(m(i, j)), j);
      sum += m(i, j);
    }
    if (row_sums) out += "   " + pad_left(format(sum), value_width);
    out += '\n';
  }
  if (shown < n) {
    out += wrap_text(fmt::format("{}(columns 0–{} of {} shown to fit {} columns{})\n", indent, shown - 1, n, width,
                                 row_sums ? "; the sums are of whole rows" : ""),
                     width);
  }
  return out;
}

// "[ 0.123, -0.456, …]": the first kShownFeatures values of row `i` of x [T, D].
std::string leading_values(const Tensor<float>& x, int64_t i) {
  const int64_t d = x.shape()[1];
  std::string out = "[";
  for (int64_t j = 0; j < std::min(d, kShownFeatures); ++j) {
    out += fmt::format("{}{:6.3f}", j == 0 ? "" : ", ", x[i * d + j]);
  }
  return out + (d > kShownFeatures ? ", …]" : "]");
}

double variance(const std::vector<double>& values) {
  double mean = 0.0;
  for (double v : values) mean += v;
  mean /= static_cast<double>(values.size());
  double sum = 0.0;
  for (double v : values) sum += (v - mean) * (v - mean);
  return sum / static_cast<double>(values.size());
}

// Lines of numpy that recompute α from the saved arrays, printed after a run that saved them. Code
// cannot be wrapped, so each line is at most 40 columns, the narrowest width qkv prints at.
constexpr std::string_view kDotSnippet =
    "  import numpy as np\n"
    "  P = \"attention_arrays/\"\n"
    "  L = lambda n: np.load(P + n + \".npy\")\n"
    "  x, a = L(\"X\"), L(\"alpha\")\n"
    "  q, k = x @ L(\"W_Q\").T, x @ L(\"W_K\").T\n"
    "  s = q @ k.T / np.sqrt(32)\n"
    "  e = np.exp(s - s.max(1)[:, None])\n"
    "  p = e / e.sum(1, keepdims=True)\n"
    "  print(abs(p - a).max())  # about 1e-7\n";
constexpr std::string_view kAdditiveSnippet =
    "  import numpy as np\n"
    "  P = \"attention_arrays/\"\n"
    "  L = lambda n: np.load(P + n + \".npy\")\n"
    "  q, k, a = L(\"Q\"), L(\"K\"), L(\"alpha\")\n"
    "  hq = (q @ L(\"W_a\").T)[:, None]\n"
    "  hk = (k @ L(\"U_a\").T)[None]\n"
    "  s = np.tanh(hq + hk) @ L(\"w\")[0]\n"
    "  e = np.exp(s - s.max(1)[:, None])\n"
    "  p = e / e.sum(1, keepdims=True)\n"
    "  print(abs(p - a).max())  # about 1e-7\n";

// e_ij = w·tanh(W_a q_i + U_a k_j) in float64, what additive_attention_forward scores with.
double additive_score(TensorView<const float> w_a, TensorView<const float> u_a, TensorView<const float> w,
                      const Tensor<float>& q, const Tensor<float>& k, int64_t i, int64_t j) {
  double score = 0.0;
  for (int64_t a = 0; a < kDim; ++a) {
    double hidden = 0.0;
    for (int64_t f = 0; f < kDim; ++f) {
      hidden += static_cast<double>(w_a(a, f)) * q[i * kDim + f] + static_cast<double>(u_a(a, f)) * k[j * kDim + f];
    }
    score += static_cast<double>(w(0, a)) * std::tanh(hidden);
  }
  return score;
}

void run_demo(const DemoOptions& options) {
  const bool from_file = options.tokens_file_option->count() > 0;
  const bool tokens_given = options.tokens_option->count() > 0;
  const std::vector<std::string> tokens = from_file ? read_tokens_file(options.tokens_file, "--tokens-file")
                                                    : split_labels(tokens_given ? options.tokens : kDefaultTokens);
  const auto t = static_cast<int64_t>(tokens.size());
  if (t < 1 || t > kMaxTokens) {
    throw ValueError(fmt::format("{}: expected 1 to {} tokens {}, got {}", from_file ? "--tokens-file" : "--tokens",
                                 kMaxTokens, from_file ? "one per line" : "separated by spaces", tokens.size()));
  }
  const bool additive = options.score == "additive";
  const std::filesystem::path png_path = std::filesystem::path(options.out_dir) / "attention.png";
  const std::filesystem::path html_path = std::filesystem::path(options.out_dir) / "attention.html";
  const std::filesystem::path arrays_dir = std::filesystem::path(options.out_dir) / kArraysDir;
  if (!options.no_files) {
    OutputFiles pictures;  // checks the directory before any work; the files are written below
    pictures.plan("--out-dir", png_path);
    pictures.plan("--out-dir", html_path);
  }

  // The draws, in this order: X, then W_Q, W_K, W_V row by row (what nn.Linear's init would do).
  Rng rng(options.seed);
  Tensor<float> x({t, kDim});
  rng.fill_normal(x.view());
  const LinearConfig projection{.in_features = kDim, .out_features = kDim, .bias = false};
  const Linear<float> w_q(projection, rng), w_k(projection, rng), w_v(projection, rng);

  const Tensor<float> q = w_q.forward(x.cview()), k = w_k.forward(x.cview()), v = w_v.forward(x.cview());

  // Additive scoring's network, drawn after W_V as nn.Linear(32, 32, bias=False) twice and
  // nn.Linear(32, 1, bias=False) would be: W_a for queries, U_a for keys, w reads the score.
  const LinearConfig score_vector{.in_features = kDim, .out_features = 1, .bias = false};
  std::optional<Linear<float>> w_a, u_a, w_e;
  if (additive) {
    w_a.emplace(projection, rng);
    u_a.emplace(projection, rng);
    w_e.emplace(score_vector, rng);
  }
  const auto weight = [](const Linear<float>& layer) { return layer.parameters().front().value; };

  Tensor<float> out({t, kDim});
  Tensor<float> alpha({t, t});
  const AttentionOutputs<float> outputs{.out = out.view(), .weights = alpha.view(), .lse = std::nullopt};
  if (additive) {
    const TensorView<const float> w = weight(*w_e);
    additive_attention_forward<float>({.q = q.cview(),
                                       .k = k.cview(),
                                       .v = v.cview(),
                                       .w_q = weight(*w_a),
                                       .w_k = weight(*u_a),
                                       .w = {w.data, Shape{kDim}, {1}},
                                       .mask = {}},
                                      outputs);
  } else {
    // The default scale, 1/√d, is the example's.
    attention_forward<float>({.q = q.cview(), .k = k.cview(), .v = v.cview(), .scale = std::nullopt, .mask = {}},
                             outputs);
  }
  const Tensor<double> alpha64 = to_tensor<double, float>(alpha.cview());

  const double sqrt_d = std::sqrt(static_cast<double>(kDim));
  // Prose is wrapped at the terminal's width; the tables and the heatmap are made to fit it.
  const int64_t width = terminal_width();
  std::string text;
  const auto say = [&](const std::string& paragraph, int64_t hanging = 0) {
    text += wrap_text(paragraph, width, hanging);
  };
  say(fmt::format("qkv demo: self-attention over T = {} tokens, d = {}, seed {}\n", t, kDim, options.seed));
  say(fmt::format("tokens: {}\n", fmt::join(tokens, " | ")), 8);
  say(fmt::format(
      "X ~ N(0, 1) [{0}, {1}]; W_Q, W_K, W_V ~ U(−1/√{1}, 1/√{1}) [{1}, {1}], as nn.Linear({1}, {1}, bias=False)\n", t,
      kDim));
  if (additive) {
    say(fmt::format("W_a, U_a [{0}, {0}], w [{0}] ~ U(−1/√{0}, 1/√{0}): additive scoring's network, drawn after W_V\n",
                    kDim));
  }
  text += '\n';

  if (options.explain) {
    say(fmt::format("1. project: X [{0}, {1}] · W_Qᵀ [{1}, {1}] → Q [{0}, {1}]; likewise K = X W_Kᵀ, V = X W_Vᵀ.\n", t,
                    kDim),
        3);
    say(
        fmt::format("   Each token's features become a query (what it looks for), a key (what it offers) and a "
                    "value (what it passes on). For token 0, \"{}\":\n",
                    tokens[0]));
    say(fmt::format("     x_0 = {}\n", leading_values(x, 0)));
    say(fmt::format("     q_0 = {}\n", leading_values(q, 0)));
    say(fmt::format("     k_0 = {}\n", leading_values(k, 0)));
    say(fmt::format("     v_0 = {}\n\n", leading_values(v, 0)));

    // The scores, recomputed here in float64 because the ops keep them to themselves.
    Tensor<double> e({t, t});
    std::vector<double> raw_dots;
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t j = 0; j < t; ++j) {
        double dot = 0.0;
        for (int64_t f = 0; f < kDim; ++f) dot += static_cast<double>(q[i * kDim + f]) * k[j * kDim + f];
        raw_dots.push_back(dot);
        e[i * t + j] = dot / sqrt_d;
        if (additive) e[i * t + j] = additive_score(weight(*w_a), weight(*u_a), weight(*w_e), q, k, i, j);
      }
    }
    if (additive) {
      say(fmt::format("2. score (additive, Bahdanau): e_ij = w·tanh(W_a q_i + U_a k_j), W_a, U_a [{0}, {0}], w [{0}] → "
                      "e [{1}, {1}]\n",
                      kDim, t),
          3);
      say("   A small network scores each pair instead of a dot product; tanh bounds it, so no √d is needed.\n");
    } else {
      say(fmt::format("2. score: e = Q Kᵀ / √{} = [{}, {}] · [{}, {}] / {:.3f} → e [{}, {}]\n", kDim, t, kDim, kDim, t,
                      sqrt_d, t, t),
          3);
      say("   e_ij = q_i·k_j / √d: how well key j answers query i (rows = queries, columns = keys).\n");
    }
    text += labelled_matrix(e.cview(), tokens, false, width);
    text += '\n';

    say("3. normalise: α = softmax(e) along each row, α_ij = exp(e_ij) / Σ_k exp(e_ik): each row sums to 1.\n", 3);
    text += labelled_matrix(alpha64.cview(), tokens, true, width);
    if (!additive) {
      say(fmt::format(
          "   Why divide by √d: q·k adds up d products, so its variance grows with d (d·σ_q²·σ_k² for independent "
          "entries). Large scores push softmax towards a one-hot row whose gradients vanish; dividing by √d keeps the "
          "scores' spread the same whatever d is. Here var(q·k) = {:.3f} (about d/9 = {:.3f}, as nn.Linear's init "
          "gives q and k entries of variance 1/3) and var(e) = var(q·k) / {} = {:.3f}.\n\n",
          variance(raw_dots), static_cast<double>(kDim) / 9.0, kDim, variance(raw_dots) / static_cast<double>(kDim)));
    }

    say(fmt::format("4. weigh: out = α V = [{0}, {0}] · [{0}, {1}] → out [{0}, {1}]; out_i = Σ_j α_ij v_j, a blend of "
                    "the values, mixed in the proportions row i of α gives. For token 0:\n",
                    t, kDim),
        3);
    std::string terms;
    for (int64_t j = 0; j < std::min(t, kShownTerms); ++j) {
      terms += fmt::format("{}{:.3f}·v_{}", j == 0 ? "" : " + ", alpha[j], j);
    }
    if (t > kShownTerms) terms += " + …";
    say(fmt::format("     out_0 = {}\n", terms), 8);
    say(fmt::format("           = {}\n\n", leading_values(out, 0)));
  } else {
    const std::string formula =
        additive ? fmt::format("α = softmax(e) [{}, {}] with additive scoring, e_ij = w·tanh(W_a q_i + U_a k_j)", t, t)
                 : fmt::format("α = softmax(Q Kᵀ / √{}) [{}, {}]", kDim, t, t);
    say(formula +
        ": row i says how token i spreads its attention over the tokens (rows = queries, columns = keys); out = α V "
        "blends the values in those proportions.\n");
    text += labelled_matrix(alpha64.cview(), tokens, true, width);
    text += '\n';
  }

  HeatmapOptions heatmap;
  heatmap.row_labels = tokens;
  heatmap.col_labels = tokens;
  heatmap.terminal.color = terminal_color(options.color);
  heatmap.terminal.max_width = width;
  say("heatmap of α: who looks at whom (rows = queries, columns = keys)\n");
  text += render_heatmap(alpha.cview(), HeatmapFormat::terminal, heatmap);
  text += '\n';
  if (!options.no_files) {
    HeatmapOptions picture = heatmap;
    picture.title = additive ? std::string("α with additive scores: who looks at whom")
                             : fmt::format("α = softmax(Q Kᵀ / √{}): who looks at whom", kDim);
    picture.annotate = t <= kAnnotatedTokens;
    const std::string png = render_heatmap(alpha.cview(), HeatmapFormat::png, picture);
    const std::string html = render_heatmap(alpha.cview(), HeatmapFormat::html, picture);
    std::vector<std::pair<std::string, TensorView<const float>>> arrays = {
        {"X", x.cview()}, {"W_Q", weight(w_q)}, {"W_K", weight(w_k)}, {"W_V", weight(w_v)},
        {"Q", q.cview()}, {"K", k.cview()},     {"V", v.cview()},     {"alpha", alpha.cview()}};
    if (additive) {
      arrays.insert(arrays.end(), {{"W_a", weight(*w_a)}, {"U_a", weight(*u_a)}, {"w", weight(*w_e)}});
    }
    std::error_code made;
    std::filesystem::create_directories(arrays_dir, made);
    if (made)
      throw IoError(fmt::format("--out-dir: {}: cannot create the folder: {}", arrays_dir.string(), made.message()));
    StagedFiles files;  // the pictures and the arrays, all or none
    files.stage(png_path, png);
    files.stage(html_path, html);
    for (const auto& [name, array] : arrays) files.stage(arrays_dir / (name + ".npy"), encode_npy(array));
    files.commit();
    const auto shown = [](const std::filesystem::path& p) {
      return std::filesystem::absolute(p).lexically_normal().string();
    };
    say(fmt::format("saved: {} (the heatmap as an image)\n", shown(png_path)), 7);
    say(fmt::format("       {} (open it in a browser: hover a token to see whom it looks at)\n", shown(html_path)));
    say(fmt::format("       {}/ (X, W_Q, W_K, W_V, Q, K, V, alpha{} as .npy; W_* as nn.Linear weights [out, in])\n",
                    shown(arrays_dir), additive ? ", W_a, U_a, w" : ""));
    say(fmt::format("α again, with numpy, from the saved arrays (run in {}):\n", shown(options.out_dir)));
    text += additive ? kAdditiveSnippet : kDotSnippet;
    text += '\n';
  }
  say("The weights are random, so this pattern means nothing yet: training W_Q and W_K is what teaches each token to "
      "look at the ones that matter to it (a verb at its object, a pronoun at its noun).\n");
  text += "Try next:\n";
  for (const std::string_view next : {"qkv demo --explain", "qkv demo --score additive",
                                      "qkv demo --tokens \"我 阅读 这 本 书 。\"", "qkv attend --help"}) {
    say(fmt::format("  {}\n", next), 2);
  }
  std::fputs(text.c_str(), stdout);
}

}  // namespace

void register_demo(CLI::App& app) {
  auto options = std::make_shared<DemoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "the worked example: self-attention over 6 tokens (d = 32), α printed and drawn as a heatmap");
  cmd->footer(
      "Everything is printed to fit the terminal: COLUMNS when it is a whole number, else the terminal's width, else "
      "80 (at least 40). Prose wraps; the tables and the heatmap show the columns that fit, with a line saying "
      "which.");
  cmd->add_option("--seed", options->seed, "seed of X and of W_Q, W_K, W_V; a seed reproduces the output exactly")
      ->check(CLI::Validator(uint64_error, "0..2^64-1"))
      ->capture_default_str();
  options->tokens_option =
      cmd->add_option("--tokens", options->tokens,
                      fmt::format("the tokens, separated by spaces: 1 to {} of them, any UTF-8 text (default \"{}\")",
                                  kMaxTokens, kDefaultTokens));
  options->tokens_file_option =
      cmd->add_option(
             "--tokens-file", options->tokens_file,
             "the tokens from a UTF-8 text file, one per line (spaces kept, no blank lines), instead of --tokens")
          ->type_name("FILE")
          ->excludes(options->tokens_option);
  cmd->add_flag("--explain", options->explain, "walk through the four steps with shapes and values");
  cmd->add_option("--score", options->score,
                  "dot: e = q·k/√d (scaled dot product); additive: e = w·tanh(W_a q + U_a k) (Bahdanau)")
      ->check(CLI::IsMember({"dot", "additive"}))
      ->capture_default_str();
  cmd->add_option("--color", options->color,
                  "colour the heatmap: auto (on a terminal, unless NO_COLOR is set or TERM=dumb), always, never")
      ->check(CLI::IsMember({"auto", "always", "never"}))
      ->capture_default_str();
  cmd->add_option("--out-dir", options->out_dir,
                  "where attention.png, attention.html and attention_arrays/ (the arrays as .npy) are saved")
      ->type_name("DIR")
      ->capture_default_str();
  cmd->add_flag("--no-files", options->no_files, "save no files, only print");
  cmd->callback([options] { run_demo(*options); });
}

}  // namespace qkv::cli
