// qkv explore: a whole model's attention (every layer and head) as one interactive page, or its
// model view, rollout or a selection as a static image.
//
// Everything is checked before anything is drawn: the output path, the array (its rank, each
// layer's shape, finite non-negative weights, rows that sum to 1), the batch, the tokens and the
// layer names against the shape. A refused run writes nothing and exits 2 with one line naming the
// argument, what was expected and what came.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "cli_io.hpp"
#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/text.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/viz/explorer.hpp"

namespace qkv::cli {
namespace {

// Rows of a softmax in float16 or bfloat16, widened, are off 1 by up to a few of their ε (2^-8 for
// bfloat16); more than this is not attention weights.
constexpr double kRowSumTolerance = 0.01;

constexpr const char* kFooter =
    R"(ATTN is the attention of a whole model: a .npy of [L, H, Tq, Tk] ([H, Tq, Tk] for one layer) or
[L, B, H, Tq, Tk] (--batch picks the entry, default 0), or an .npz with one array per layer, each
[H, Tq, Tk] or [B, H, Tq, Tk], as a model's output_attentions gives them. An .npz's layers are
ordered by their names in natural order (digits compared as numbers: layer2 before layer10), and
named by them unless --layer-names is given. float32 or float64; every weight finite and >= 0, and
every row summing to 1 within 0.01 (or all 0, a query that sees no key).
Tokens: --tokens labels the queries and, unless --key-tokens is given, the keys too (self-attention);
cross-attention (Tq != Tk) needs --key-tokens. Tokens are separated by spaces; the -file forms read
one token per line.
Output by the extension of -o:
  .html  one self-contained page (no network): the model view (L x H thumbnails), the matrix view
         (zoom, pan, values on hover), the head view (lines by weight, all heads overlaid), token
         selections (sum or mean of rows; who attends to chosen keys), the mean over heads, attention
         rollout (0.5 A + 0.5 I, rows renormalised, multiplied up the layers) and per-head entropy
         and mean distance. Weights are stored in 8 bits a row, deflated.
  .png, .svg, .pdf  --view grid (every layer and head), mean (each layer's mean over heads) or
         rollout (up to each layer); --select-rows "3 5-7" draws, per layer, the mean of those
         queries' rows of the chosen view instead. --panel-scale own (the default) colours each
         panel by its own largest value, as the page's model view does; shared, all on one scale.
Examples:
  qkv explore attention.npz --tokens "the cat sat on the mat" -o explorer.html
  qkv explore attention.npy --tokens-file tokens.txt --view rollout -o rollout.png
  qkv explore cross.npy --tokens "le chat" --key-tokens "the cat ." -o cross.html)";

struct ExploreCliOptions {
  std::string input;
  std::string out;
  std::string tokens, key_tokens, tokens_file, key_tokens_file;
  const CLI::Option* tokens_option = nullptr;
  const CLI::Option* key_tokens_option = nullptr;
  const CLI::Option* tokens_file_option = nullptr;
  const CLI::Option* key_tokens_file_option = nullptr;
  std::string layer_names;
  const CLI::Option* layer_names_option = nullptr;
  int64_t batch = 0;
  const CLI::Option* batch_option = nullptr;
  std::string title;
  std::string cmap = "viridis";
  std::string view = "grid";
  std::string panel_scale = "own";
  CLI::Option* panel_scale_option = nullptr;
  std::string select_rows;
  const CLI::Option* select_rows_option = nullptr;
};

// "layer2" < "layer10": runs of digits compare as numbers, the rest byte by byte.
bool natural_less(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = std::isdigit(static_cast<unsigned char>(a[i])) != 0;
    const bool db = std::isdigit(static_cast<unsigned char>(b[j])) != 0;
    if (da && db) {
      size_t ei = i, ej = j;
      while (ei < a.size() && std::isdigit(static_cast<unsigned char>(a[ei])) != 0) ++ei;
      while (ej < b.size() && std::isdigit(static_cast<unsigned char>(b[ej])) != 0) ++ej;
      std::string_view na = a.substr(i, ei - i), nb = b.substr(j, ej - j);
      while (na.size() > 1 && na.front() == '0') na.remove_prefix(1);
      while (nb.size() > 1 && nb.front() == '0') nb.remove_prefix(1);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ei;
      j = ej;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

// The array without its dim `axis`, at index `index` of it: [.., B, ..] → [.., ..].
NpyArray take(NpyArray array, size_t axis, int64_t index) {
  int64_t outer = 1, inner = 1;
  for (size_t d = 0; d < axis; ++d) outer *= array.shape[d];
  for (size_t d = axis + 1; d < array.shape.size(); ++d) inner *= array.shape[d];
  const int64_t count = array.shape[axis];
  std::visit(
      [&](auto& values) {
        std::remove_reference_t<decltype(values)> kept;
        kept.reserve(static_cast<size_t>(outer * inner));
        for (int64_t o = 0; o < outer; ++o) {
          const auto begin = values.begin() + (o * count + index) * inner;
          kept.insert(kept.end(), begin, begin + inner);
        }
        values = std::move(kept);
      },
      array.values);
  array.shape.erase(array.shape.begin() + static_cast<std::ptrdiff_t>(axis));
  return array;
}

// The batch entry of an array whose dim `axis` is the batch, checked against --batch.
NpyArray batch_entry(NpyArray array, size_t axis, const ExploreCliOptions& o, std::string_view what) {
  const int64_t batches = array.shape[axis];
  if (o.batch < 0 || o.batch >= batches) {
    throw ShapeError(
        fmt::format("--batch: expected 0 to {} (B of {} {}), got {}", batches - 1, what, array.shape_str(), o.batch));
  }
  if (o.batch_option->count() == 0 && batches > 1) {
    fmt::print(stderr, "qkv explore: note: {} {} holds {} batch entries; drawing batch 0 (--batch B for another)\n",
               what, array.shape_str(), batches);
  }
  return take(std::move(array), axis, o.batch);
}

struct ModelAttention {
  Tensor<float> weights;  // [L, H, Tq, Tk]
  std::vector<std::string> layer_names;
  std::string source;  // "attention.npz: 12 layers [L, H, T, T]"
};

ModelAttention read_npy_model(const ExploreCliOptions& o) {
  NpyArray array = read_input(o.input, "ATTN", kFloatDtypes);
  const size_t rank = array.shape.size();
  if (rank < 3 || rank > 5) {
    throw ShapeError(fmt::format(
        "ATTN: expected [L, H, Tq, Tk], [H, Tq, Tk] (one layer) or [L, B, H, Tq, Tk] (with --batch), got {}",
        array.shape_str()));
  }
  const std::string shape = array.shape_str();
  if (rank == 5) {
    array = batch_entry(std::move(array), 1, o, "ATTN");
  } else if (o.batch_option->count() > 0) {
    throw ShapeError(
        fmt::format("--batch: ATTN {} has no batch dim (only [L, B, H, Tq, Tk] has), got --batch {}", shape, o.batch));
  }
  if (array.shape.size() == 3) array.shape.insert(array.shape.begin(), 1);
  return {.weights = to_float32(std::move(array), "ATTN"), .layer_names = {}, .source = o.input + " " + shape};
}

ModelAttention read_npz_model(const ExploreCliOptions& o) {
  std::vector<std::pair<std::string, NpyArray>> arrays;
  try {
    arrays = read_npz_arrays(o.input);
  } catch (const IoError& e) {
    throw IoError(fmt::format("ATTN: {}", e.what()));
  }
  std::ranges::stable_sort(arrays, [](const auto& a, const auto& b) { return natural_less(a.first, b.first); });
  std::vector<std::string> names;
  std::vector<float> values;
  std::vector<int64_t> layer_shape;
  std::string first;
  for (auto& [name, array] : arrays) {
    const std::string what = fmt::format("ATTN layer '{}'", name);
    if (array.shape.size() != 3 && array.shape.size() != 4) {
      throw ShapeError(fmt::format("{}: expected [H, Tq, Tk] or [B, H, Tq, Tk], got {}", what, array.shape_str()));
    }
    if (array.shape.size() == 4) {
      array = batch_entry(std::move(array), 0, o, what);
    } else if (o.batch_option->count() > 0) {
      throw ShapeError(fmt::format("--batch: {} {} has no batch dim (only [B, H, Tq, Tk] has), got --batch {}", what,
                                   array.shape_str(), o.batch));
    }
    if (layer_shape.empty()) {
      layer_shape = array.shape;
      first = name;
    } else if (array.shape != layer_shape) {
      throw ShapeError(fmt::format("{}: expected the shape of layer '{}', [{}], got {}", what, first,
                                   fmt::join(layer_shape, ", "), array.shape_str()));
    }
    const Tensor<float> layer = to_float32(std::move(array), what);
    values.insert(values.end(), layer.values().begin(), layer.values().end());
    names.push_back(name);
  }
  const auto layers = static_cast<int64_t>(names.size());
  return {.weights = Tensor<float>({layers, layer_shape[0], layer_shape[1], layer_shape[2]}, std::move(values)),
          .layer_names = names,
          .source = fmt::format("{} ({} layers of [{}])", o.input, layers, fmt::join(layer_shape, ", "))};
}

// Finite, non-negative, and each row a distribution (or all 0): anything else is not attention.
void check_weights(const Tensor<float>& weights) {
  const Shape& shape = weights.shape();
  const int64_t tk = shape[3];
  for (int64_t n = 0; n < weights.numel(); ++n) {
    if (!std::isfinite(weights[n]) || weights[n] < 0.0F) {
      throw ValueError(fmt::format("ATTN: expected finite weights >= 0, got {} at [layer, head, query, key] = {}",
                                   weights[n], index_str(shape, n)));
    }
  }
  for (int64_t row = 0; row * tk < weights.numel(); ++row) {
    double sum = 0.0;
    for (int64_t j = 0; j < tk; ++j) sum += weights[row * tk + j];
    if (sum != 0.0 && std::abs(sum - 1.0) > kRowSumTolerance) {
      throw ValueError(fmt::format(
          "ATTN: expected every row to sum to 1 within {} (or to 0), got {:.6g} in row [layer, head, query] = {}",
          kRowSumTolerance, sum, index_str(Shape({shape[0], shape[1], shape[2]}), row)));
    }
  }
}

std::optional<std::vector<std::string>> given_tokens(const CLI::Option* text_option, const std::string& text,
                                                     const CLI::Option* file_option, const std::string& file,
                                                     std::string_view file_arg) {
  if (text_option->count() > 0) return split_labels(text);
  if (file_option->count() > 0) return read_tokens_file(file, file_arg);
  return std::nullopt;
}

void check_count(const std::vector<std::string>& labels, int64_t count, std::string_view arg, std::string_view what,
                 const Shape& shape) {
  if (static_cast<int64_t>(labels.size()) != count) {
    throw ShapeError(fmt::format("{}: expected {} tokens (one per {} of ATTN [L, H, Tq, Tk] = {}), got {}", arg, count,
                                 what, shape.str(), labels.size()));
  }
}

void run_explore(const ExploreCliOptions& o) {
  const HeatmapFormat format = heatmap_format_for_path(o.out, "-o");
  if (format == HeatmapFormat::terminal) throw ValueError("-o: expected a file, got -");
  OutputFiles().plan("-o", o.out);
  const Colormap colormap = parse_colormap(o.cmap, "--cmap");
  if (colormap_is_diverging(colormap)) {
    throw ValueError(fmt::format("--cmap: expected viridis, magma or gray (weights are >= 0), got {}", o.cmap));
  }
  const PanelScale panel_scale = parse_panel_scale(o.panel_scale, "--panel-scale");
  if (format == HeatmapFormat::html &&
      (o.view != "grid" || o.select_rows_option->count() > 0 || o.panel_scale_option->count() > 0)) {
    const std::string_view given = o.select_rows_option->count() > 0   ? "--select-rows"
                                   : o.panel_scale_option->count() > 0 ? "--panel-scale"
                                                                       : "--view";
    throw ValueError(
        fmt::format("{}: the page has every view; --view, --select-rows and --panel-scale are for images, got -o {}",
                    given, o.out));
  }

  ModelAttention model = o.input.ends_with(".npz") ? read_npz_model(o) : read_npy_model(o);
  const Shape& shape = model.weights.shape();
  if (model.weights.numel() == 0) {
    throw ShapeError(fmt::format("ATTN: expected at least one layer, head, query and key, got {}", shape.str()));
  }
  check_weights(model.weights);

  ExplorerOptions options;
  options.title = o.title;
  options.colormap = colormap;
  options.panel_scale = panel_scale;
  options.source = model.source;
  options.layer_names = model.layer_names;
  if (o.layer_names_option->count() > 0) {
    options.layer_names = split_labels(o.layer_names);
    if (static_cast<int64_t>(options.layer_names.size()) != shape[0]) {
      throw ShapeError(fmt::format("--layer-names: expected {} names (one per layer of ATTN {}), got {}", shape[0],
                                   shape.str(), options.layer_names.size()));
    }
  }
  const std::optional<std::vector<std::string>> tokens =
      given_tokens(o.tokens_option, o.tokens, o.tokens_file_option, o.tokens_file, "--tokens-file");
  const std::optional<std::vector<std::string>> keys =
      given_tokens(o.key_tokens_option, o.key_tokens, o.key_tokens_file_option, o.key_tokens_file, "--key-tokens-file");
  const std::string_view tokens_arg = o.tokens_option->count() > 0 ? "--tokens" : "--tokens-file";
  const std::string_view keys_arg = o.key_tokens_option->count() > 0 ? "--key-tokens" : "--key-tokens-file";
  if (tokens) {
    check_count(*tokens, shape[2], tokens_arg, "query (Tq)", shape);
    options.query_tokens = *tokens;
  }
  if (keys) {
    check_count(*keys, shape[3], keys_arg, "key (Tk)", shape);
    options.key_tokens = *keys;
  } else if (tokens) {
    if (shape[2] != shape[3]) {
      throw ShapeError(
          fmt::format("--key-tokens: expected for cross-attention (ATTN {} has Tq = {}, Tk = {}), got none",
                      shape.str(), shape[2], shape[3]));
    }
    options.key_tokens = *tokens;
  }

  std::string bytes;
  if (format == HeatmapFormat::html) {
    bytes = render_explorer_html(model.weights.cview(), options);
  } else {
    std::optional<std::vector<int64_t>> rows;
    if (o.select_rows_option->count() > 0) rows = parse_index_list(o.select_rows, shape[2], "--select-rows");
    bytes = render_explorer_image(model.weights.cview(), options, parse_explorer_view(o.view, "--view"), rows, format);
  }
  try {
    write_file_atomically(o.out, bytes);
  } catch (const IoError& e) {
    throw IoError(fmt::format("-o: {}", e.what()));
  }
}

}  // namespace

void register_explore(CLI::App& app) {
  auto o = std::make_shared<ExploreCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "explore",
      "explore a whole model's attention: an interactive page (every layer and head, rollout, selections) "
      "or its model view as an image");
  cmd->footer(kFooter);
  cmd->add_option("ATTN", o->input, "attention .npy [L, H, Tq, Tk] or [L, B, H, Tq, Tk], or .npz of one array a layer")
      ->type_name("FILE")
      ->required();
  cmd->add_option("-o,--out", o->out, "OUT.html (the explorer page), or OUT.png, OUT.svg, OUT.pdf (an image)")
      ->type_name("FILE")
      ->required();
  CLI::Option* tokens = cmd->add_option("--tokens", o->tokens, "labels of the queries (and keys, unless --key-tokens)");
  o->tokens_option = tokens;
  CLI::Option* key_tokens = cmd->add_option("--key-tokens", o->key_tokens, "labels of the keys (cross-attention)");
  o->key_tokens_option = key_tokens;
  o->tokens_file_option = cmd->add_option("--tokens-file", o->tokens_file, "--tokens from a file, one token per line")
                              ->type_name("FILE")
                              ->excludes(tokens);
  o->key_tokens_file_option =
      cmd->add_option("--key-tokens-file", o->key_tokens_file, "--key-tokens from a file, one token per line")
          ->type_name("FILE")
          ->excludes(key_tokens);
  o->layer_names_option =
      cmd->add_option("--layer-names", o->layer_names, "names of the layers, separated by spaces (one per layer)");
  o->batch_option =
      cmd->add_option("--batch", o->batch, "the batch entry of a batched ATTN (default 0)")->type_name("B");
  cmd->add_option("--title", o->title, "the page's (or image's) title");
  cmd->add_option("--cmap", o->cmap, "colour map: viridis, magma or gray")->capture_default_str();
  cmd->add_option("--view", o->view, "what an image shows: grid (every layer and head), mean or rollout")
      ->capture_default_str();
  o->panel_scale_option =
      cmd->add_option("--panel-scale", o->panel_scale,
                      "an image's colours: own (each panel by its largest value, given in its caption) or shared")
          ->capture_default_str();
  o->select_rows_option =
      cmd->add_option("--select-rows", o->select_rows,
                      "an image of the mean of these queries' rows, per layer: indices and spans, \"3 5-7\"");
  cmd->callback([o] { run_explore(*o); });
}

}  // namespace qkv::cli
