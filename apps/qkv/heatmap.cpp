// qkv heatmap: attention weights α from a .npy file, drawn as an image (PNG, SVG, PDF), an
// interactive page (HTML) or a coloured grid in the terminal.
//
// Everything is checked before anything is drawn: the output path (its extension and directory),
// the array (rank 2 to 4, finite, non-negative; of any sign with the diverging --cmap coolwarm),
// the token lists against the axes, the mask against alpha, the head and batch. Rows that do not sum to 1 are drawn
// anyway, with a warning. The file is rendered in memory and written through a temporary file and a rename, so a
// refused or failed run leaves no file.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/text.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv::cli {
namespace {

constexpr const char* kFooter =
    R"(ALPHA is [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk] (what `qkv attend --weights` writes), float32
or float64, finite and >= 0; rows are queries, columns keys. A row that does not sum to 1 is drawn
with a warning; an all-zero row (a query that sees no key) is drawn as it is.
Masked cells (--mask M.npy: bool or integer, nonzero = may attend, broadcast to ALPHA's shape as
qkv attend --mask is; --causal: key j is masked for query i when j > i + Tk - Tq) are drawn as no
weight: hatched grey in images, grey on the page, '·' in the terminal, with no --annotate value.
Colours: --scale sqrt or log spreads small weights that a few large ones (a causal map's first row)
leave dark; values above --vmax take the top colour, and the colour bar ends in a triangle then
(the terminal's scale says ">= vmax"). The terminal grid fits COLUMNS (or the terminal, else 80):
cells narrow, labels are cut, and at last only the first keys are shown, with a line saying so.
Output by the extension of -o: .png, .svg, .pdf (token labels, colour bar, optional values),
.html (one self-contained page: matrix and token views, hover for the exact value, a head
selector), or - for the terminal (the default): truecolor when COLORTERM says so, shade characters
under NO_COLOR or when piped. Images draw one head (--head, default 0) or a grid of every head
(--all-heads); the page carries every head. Labels: --tokens for self-attention (both axes), or
--rows and --cols; tokens are separated by spaces and may be any UTF-8 text (CJK included). Tokens
that hold spaces, or too many for one argument: --tokens-file (--rows-file, --cols-file), a UTF-8
text file with one token per line (no blank lines).
Examples:
  qkv attend --q q.npy --k k.npy --v v.npy -o out.npy --weights alpha.npy
  qkv heatmap alpha.npy --tokens "the student is reading a book" -o attention.png
  qkv heatmap alpha.npy --all-heads --cmap magma -o heads.svg
  qkv heatmap alpha.npy -o attention.html
  qkv heatmap alpha.npy --head 2 --annotate
  qkv heatmap alpha.npy --causal --scale sqrt -o causal.png)";

struct HeatmapCliOptions {
  std::string input;
  std::string out;
  std::string tokens, rows, cols;
  const CLI::Option* tokens_option = nullptr;  // a given but empty list is refused, an absent one numbers
  const CLI::Option* rows_option = nullptr;
  const CLI::Option* cols_option = nullptr;
  std::string tokens_file, rows_file, cols_file;  // the same lists as files, one token per line
  const CLI::Option* tokens_file_option = nullptr;
  const CLI::Option* rows_file_option = nullptr;
  const CLI::Option* cols_file_option = nullptr;
  int64_t head = 0;
  const CLI::Option* head_option = nullptr;
  bool all_heads = false;
  int64_t batch = 0;
  const CLI::Option* batch_option = nullptr;
  std::string title;
  std::string cmap = "viridis";
  bool annotate = false;
  double vmax = 0.0;
  const CLI::Option* vmax_option = nullptr;
  std::string scale = "linear";
  std::string mask;
  bool causal = false;
  std::string color = "auto";
};

void note(std::string_view kind, std::string_view message) {
  fmt::print(stderr, "qkv heatmap: {}: {}\n", kind, message);
}

// Labels as given, and the option they came from ("--rows", "--rows-file").
struct GivenLabels {
  std::string_view arg;
  bool from_file = false;
  std::vector<std::string> labels;
};

// The labels of `text` (tokens separated by spaces) or of `file` (one token a line), whichever was
// given (CLI11 refuses both); none when neither was.
std::optional<GivenLabels> given_labels(const CLI::Option* text_option, const std::string& text,
                                        std::string_view text_arg, const CLI::Option* file_option,
                                        const std::string& file, std::string_view file_arg) {
  if (text_option->count() > 0) return GivenLabels{.arg = text_arg, .from_file = false, .labels = split_labels(text)};
  if (file_option->count() > 0) {
    return GivenLabels{.arg = file_arg, .from_file = true, .labels = read_tokens_file(file, file_arg)};
  }
  return std::nullopt;
}

// The labels of one axis: those of both axes (--tokens, --tokens-file) or its own, checked against
// its length; none (numbered) when neither was given.
std::vector<std::string> axis_labels(const std::optional<GivenLabels>& both, const std::optional<GivenLabels>& own,
                                     int64_t count, std::string_view axis, const Shape& shape) {
  const std::optional<GivenLabels>& given = both ? both : own;
  if (!given) return {};
  if (static_cast<int64_t>(given->labels.size()) != count) {
    throw ShapeError(fmt::format("{}: expected {} tokens {} (one per {} of alpha {}), got {}", given->arg, count,
                                 given->from_file ? "one per line" : "separated by spaces", axis, shape.str(),
                                 given->labels.size()));
  }
  return given->labels;
}

void print_terminal(const Tensor<float>& alpha, const HeatmapCliOptions& o, HeatmapOptions options) {
  options.terminal.color = terminal_color(o.color);
  options.terminal.decimals = 2;
  options.terminal.max_width = terminal_width();
  const std::string text = render_heatmap(alpha.cview(), HeatmapFormat::terminal, options);
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

// Which keys each query may see: --mask read as attend reads a bool or integer mask, broadcast to
// alpha's shape, and --causal's lower triangle (bottom-right aligned, as attend's default).
std::optional<Tensor<uint8_t>> allowed_cells(const HeatmapCliOptions& o, const Shape& shape) {
  if (o.mask.empty() && !o.causal) return std::nullopt;
  Tensor<uint8_t> allowed(shape, 1);
  if (!o.mask.empty()) {
    const Tensor<uint8_t> mask = to_bool(read_input(o.mask, "--mask", "bool, uint8, int32 or int64"), "--mask");
    bool broadcasts = mask.shape().rank() <= shape.rank();
    for (int i = 1; i <= mask.shape().rank() && broadcasts; ++i) {
      broadcasts = mask.shape().from_back(i) == 1 || mask.shape().from_back(i) == shape.from_back(i);
    }
    if (!broadcasts) {
      throw ShapeError(
          fmt::format("--mask: expected a shape that broadcasts to ALPHA {}, got {}", shape.str(), mask.shape().str()));
    }
    const Tensor<uint8_t> dense = to_tensor<uint8_t, uint8_t>(broadcast_to(mask.cview(), shape, "--mask"));
    for (int64_t n = 0; n < allowed.numel(); ++n) allowed[n] = dense[n];
  }
  if (o.causal) {
    const int64_t tq = shape.from_back(2);
    const int64_t tk = shape.from_back(1);
    for (int64_t n = 0; n < allowed.numel(); ++n) {
      const int64_t i = (n / tk) % tq;
      const int64_t j = n % tk;
      if (j > i + tk - tq) allowed[n] = 0;
    }
  }
  return allowed;
}

void run_heatmap(const HeatmapCliOptions& o) {
  const bool terminal = o.out.empty() || o.out == "-";
  HeatmapFormat format = HeatmapFormat::png;
  if (!terminal) {
    format = heatmap_format_for_path(o.out, "-o");
    OutputFiles().plan("-o", o.out);  // refuses a missing or unwritable directory before any work
  }

  const Tensor<float> alpha = load_float32(o.input, "ALPHA");
  const Shape& shape = alpha.shape();
  const int rank = shape.rank();
  // A diverging map draws signed matrices (scores, biases, gradients): they are not weights, so
  // only finiteness is asked of them.
  const bool signed_values = colormap_is_diverging(parse_colormap(o.cmap, "--cmap"));
  if (signed_values) check_finite(alpha.cview(), "ALPHA");
  const AttentionWeightsReport report =
      signed_values ? AttentionWeightsReport{} : check_attention_weights(alpha.cview(), "ALPHA");
  const TensorView<const float> a4 = as_rank4(alpha.cview());
  const int64_t batches = a4.shape[0];
  const int64_t heads = a4.shape[1];
  const int64_t tq = a4.shape[2];
  const int64_t tk = a4.shape[3];
  if (tq == 0 || tk == 0 || heads == 0 || batches == 0) {
    throw ShapeError(fmt::format("ALPHA: expected at least one query and one key, got shape {}", shape.str()));
  }

  HeatmapOptions options;
  const std::optional<GivenLabels> both =
      given_labels(o.tokens_option, o.tokens, "--tokens", o.tokens_file_option, o.tokens_file, "--tokens-file");
  if (both && tq != tk) {
    throw ShapeError(fmt::format(
        "{}: labels both axes, but alpha {} has Tq = {} queries and Tk = {} keys; give --rows and --cols (or their "
        "-file forms)",
        both->arg, shape.str(), tq, tk));
  }
  const std::optional<GivenLabels> rows =
      given_labels(o.rows_option, o.rows, "--rows", o.rows_file_option, o.rows_file, "--rows-file");
  const std::optional<GivenLabels> cols =
      given_labels(o.cols_option, o.cols, "--cols", o.cols_file_option, o.cols_file, "--cols-file");
  options.row_labels = axis_labels(both, rows, tq, "query (Tq)", shape);
  options.col_labels = axis_labels(both, cols, tk, "key (Tk)", shape);
  options.title = o.title;
  options.colormap = parse_colormap(o.cmap, "--cmap");
  options.annotate = o.annotate;
  options.scale = parse_heatmap_scale(o.scale, "--scale");
  const std::optional<Tensor<uint8_t>> allowed = allowed_cells(o, shape);
  if (allowed) options.allowed = allowed->cview();
  if (o.vmax_option->count() > 0) {
    if (!std::isfinite(o.vmax) || o.vmax <= 0.0) {
      throw ValueError(fmt::format("--vmax: expected a finite number above 0 (weights start at 0), got {}", o.vmax));
    }
    options.vmax = o.vmax;
    if (signed_values) options.vmin = -o.vmax;  // 0 stays at the diverging map's middle
  }

  if (o.batch_option->count() > 0) {
    if (rank < 4) {
      throw ShapeError(fmt::format("--batch: alpha {} has no batch dim (only [B, H, Tq, Tk] has), got --batch {}",
                                   shape.str(), o.batch));
    }
    if (o.batch < 0 || o.batch >= batches) {
      throw ShapeError(
          fmt::format("--batch: expected 0 to {} (B of alpha {}), got {}", batches - 1, shape.str(), o.batch));
    }
    options.batch = o.batch;
  } else if (batches > 1) {
    note("note",
         fmt::format("alpha {} holds {} batch entries; drawing batch 0 (--batch B for another)", shape.str(), batches));
  }
  if (o.head_option->count() > 0) {
    if (rank < 3) {
      throw ShapeError(
          fmt::format("--head: alpha {} has no heads (only [H, Tq, Tk] and [B, H, Tq, Tk] have), got "
                      "--head {}",
                      shape.str(), o.head));
    }
    if (o.head < 0 || o.head >= heads) {
      throw ShapeError(fmt::format("--head: expected 0 to {} (H of alpha {}), got {}", heads - 1, shape.str(), o.head));
    }
    options.head = o.head;
  } else if (!o.all_heads) {
    options.head = 0;
    if (heads > 1 && (terminal || format != HeatmapFormat::html)) {
      note("note", fmt::format("alpha {} holds {} heads; drawing head 0 (--head H for another, --all-heads for all)",
                               shape.str(), heads));
    }
  }

  if (report.rows_off > 0) {
    note("warning", fmt::format("ALPHA: {} of {} rows do not sum to 1 (the first: {}); drawn anyway", report.rows_off,
                                report.rows, report.first_off));
  }

  if (terminal) {
    print_terminal(alpha, o, options);
    return;
  }

  if (format == HeatmapFormat::png || format == HeatmapFormat::pdf) {
    std::vector<std::string> labels = options.row_labels;
    labels.insert(labels.end(), options.col_labels.begin(), options.col_labels.end());
    const std::vector<std::string> missing = labels_without_glyphs(labels);
    if (!missing.empty()) {
      note("warning", fmt::format("no installed font has every character of {} label{} (the first: \"{}\"); they "
                                  "show as boxes (on Debian: apt-get install fonts-noto-cjk)",
                                  missing.size(), missing.size() == 1 ? "" : "s", missing.front()));
    }
  }
  const std::string bytes = render_heatmap(alpha.cview(), format, options);
  try {
    write_file_atomically(o.out, bytes);
  } catch (const IoError& e) {
    throw IoError(fmt::format("-o: {}", e.what()));
  }
}

}  // namespace

void register_heatmap(CLI::App& app) {
  auto o = std::make_shared<HeatmapCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "heatmap", "draw attention weights α: PNG, SVG or PDF image, interactive HTML page, or in the terminal");
  cmd->footer(kFooter);
  cmd->add_option("ALPHA", o->input, "attention weights .npy [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk]")
      ->type_name("FILE")
      ->required();
  cmd->add_option("-o,--out", o->out, "OUT.png, OUT.svg, OUT.pdf, OUT.html, or - for the terminal (the default)")
      ->type_name("FILE");
  CLI::Option* tokens = cmd->add_option("--tokens", o->tokens, "labels of both axes (self-attention: Tq = Tk)");
  o->tokens_option = tokens;
  CLI::Option* rows =
      cmd->add_option("--rows", o->rows, "labels of the queries (rows), \"tok tok …\"")->excludes(tokens);
  CLI::Option* cols =
      cmd->add_option("--cols", o->cols, "labels of the keys (columns), \"tok tok …\"")->excludes(tokens);
  o->rows_option = rows;
  o->cols_option = cols;
  CLI::Option* tokens_file =
      cmd->add_option("--tokens-file", o->tokens_file,
                      "labels of both axes from a UTF-8 text file, one token per line (spaces kept; no blank lines)")
          ->type_name("FILE")
          ->excludes(tokens)
          ->excludes(rows)
          ->excludes(cols);
  o->tokens_file_option = tokens_file;
  o->rows_file_option =
      cmd->add_option("--rows-file", o->rows_file, "labels of the queries from a file, as --tokens-file")
          ->type_name("FILE")
          ->excludes(tokens)
          ->excludes(tokens_file)
          ->excludes(rows);
  o->cols_file_option = cmd->add_option("--cols-file", o->cols_file, "labels of the keys from a file, as --tokens-file")
                            ->type_name("FILE")
                            ->excludes(tokens)
                            ->excludes(tokens_file)
                            ->excludes(cols);
  CLI::Option* all_heads = cmd->add_flag("--all-heads", o->all_heads, "draw every head, as a grid of small multiples");
  o->head_option = cmd->add_option("--head", o->head, "the head to draw (default 0); the page opens at it")
                       ->type_name("H")
                       ->excludes(all_heads);
  o->batch_option =
      cmd->add_option("--batch", o->batch, "the batch entry of a [B, H, Tq, Tk] alpha (default 0)")->type_name("B");
  cmd->add_option("--title", o->title, "a title above the matrix");
  cmd->add_option("--cmap", o->cmap,
                  "colour map: viridis, magma or gray for weights; coolwarm (diverging, centred on 0) for signed "
                  "matrices such as scores, biases or gradients, which it accepts")
      ->capture_default_str();
  cmd->add_flag("--annotate", o->annotate, "print each cell's value on it");
  o->vmax_option = cmd->add_option("--vmax", o->vmax,
                                   "the weight at the top of the colour scale (default: the largest; with coolwarm the "
                                   "scale runs from -X to X)")
                       ->type_name("X");
  cmd->add_option("--scale", o->scale,
                  "how weights map to colours: linear; sqrt (t = sqrt(u)) or log (three decades below --vmax) "
                  "to see small weights beside large ones")
      ->capture_default_str();
  cmd->add_option("--mask", o->mask,
                  "M.npy (bool or integer, nonzero = may attend, broadcast to ALPHA as for qkv attend --mask): "
                  "draw the cells it masks as masked")
      ->type_name("FILE");
  cmd->add_flag("--causal", o->causal, "draw the keys after each query's diagonal (j > i + Tk - Tq) as masked");
  cmd->add_option("--color", o->color,
                  "colour the terminal grid: auto (on a terminal, unless NO_COLOR is set or TERM=dumb), always, never")
      ->check(CLI::IsMember({"auto", "always", "never"}))
      ->capture_default_str();
  cmd->callback([o] { run_heatmap(*o); });
}

}  // namespace qkv::cli
