// The explorer's static images (qkv/viz/explorer.hpp): the panels of a view are made into one
// [panels, Tq, Tk] array and drawn by the heatmap, so an image of the model has the heatmap's labels,
// colour bar and formats.

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <set>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/viz/attention_summary.hpp"
#include "qkv/viz/explorer.hpp"

namespace qkv {
namespace {

std::vector<std::string> names_or_numbers(const std::vector<std::string>& given, int64_t count) {
  if (!given.empty()) return given;
  std::vector<std::string> names;
  for (int64_t k = 0; k < count; ++k) names.push_back(fmt::format("layer {}", k));
  return names;
}

// The panels of a view, [panels, Tq, Tk] in float64, their captions, and what they show (for the
// title; empty for the grid, whose captions say it).
struct Panels {
  Tensor<double> values;
  std::vector<std::string> captions;
  std::string what;
};

Panels view_panels(TensorView<const float> attention, ExplorerView view, const std::vector<std::string>& names) {
  const int64_t layers = attention.shape[0], heads = attention.shape[1];
  const int64_t tq = attention.shape[2], tk = attention.shape[3];
  Panels panels;
  if (view == ExplorerView::grid) {
    panels.values = Tensor<double>({layers * heads, tq, tk});
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t h = 0; h < heads; ++h) {
        panels.captions.push_back(fmt::format("{} · h{}", names[static_cast<size_t>(l)], h));
        for (int64_t i = 0; i < tq; ++i) {
          for (int64_t j = 0; j < tk; ++j) panels.values[((l * heads + h) * tq + i) * tk + j] = attention(l, h, i, j);
        }
      }
    }
    return panels;
  }
  panels.values =
      view == ExplorerView::mean ? attention_head_mean(attention) : attention_rollout(attention, "--view rollout");
  panels.captions.assign(names.begin(), names.end());
  panels.what = view == ExplorerView::mean ? "the mean over heads" : "the rollout up to each layer";
  return panels;
}

// Divides each of `count` runs of `size` values by its largest and appends that largest to its caption.
void scale_each_panel(Tensor<double>& values, int64_t count, int64_t size, std::vector<std::string>& captions) {
  for (int64_t p = 0; p < count; ++p) {
    double* panel = values.data() + p * size;
    const double largest = *std::max_element(panel, panel + size);
    if (largest > 0.0) std::for_each(panel, panel + size, [largest](double& v) { v /= largest; });
    captions[static_cast<size_t>(p)] += fmt::format(" · max {:.3g}", largest);
  }
}

}  // namespace

PanelScale parse_panel_scale(std::string_view name, std::string_view arg) {
  if (name == "own") return PanelScale::own;
  if (name == "shared") return PanelScale::shared;
  throw ValueError(fmt::format("{}: expected own or shared, got {}", arg, name));
}

ExplorerView parse_explorer_view(std::string_view name, std::string_view arg) {
  if (name == "grid") return ExplorerView::grid;
  if (name == "mean") return ExplorerView::mean;
  if (name == "rollout") return ExplorerView::rollout;
  throw ValueError(fmt::format("{}: expected grid, mean or rollout, got {}", arg, name));
}

std::vector<int64_t> parse_index_list(std::string_view text, int64_t count, std::string_view arg) {
  std::set<int64_t> indices;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find_first_of(" ,", at), text.size());
    const std::string_view part = text.substr(at, end - at);
    at = end + 1;
    if (part.empty()) continue;
    const size_t dash = part.find('-');
    const std::string_view first = part.substr(0, dash);
    const std::string_view last = dash == std::string_view::npos ? first : part.substr(dash + 1);
    int64_t from = -1, to = -1;
    const auto parse = [](std::string_view digits, int64_t& value) {
      const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
      return ec == std::errc() && ptr == digits.data() + digits.size() && !digits.empty();
    };
    if (!parse(first, from) || !parse(last, to) || from > to || to >= count) {
      throw ValueError(fmt::format("{}: expected query indices or spans from 0 to {} (\"3 5-7\"), got \"{}\"", arg,
                                   count - 1, part));
    }
    for (int64_t k = from; k <= to; ++k) indices.insert(k);
  }
  if (indices.empty()) {
    throw ValueError(
        fmt::format("{}: expected query indices or spans from 0 to {} (\"3 5-7\"), got none", arg, count - 1));
  }
  return {indices.begin(), indices.end()};
}

std::string render_explorer_image(TensorView<const float> attention, const ExplorerOptions& options, ExplorerView view,
                                  const std::optional<std::vector<int64_t>>& rows, HeatmapFormat format) {
  if (attention.rank() != 4 || attention.numel() == 0) {
    throw ShapeError(fmt::format("attention: expected [L, H, Tq, Tk] with no dim of 0, got {}", attention.shape.str()));
  }
  const int64_t tq = attention.shape[2], tk = attention.shape[3];
  const std::vector<std::string> names = names_or_numbers(options.layer_names, attention.shape[0]);
  Panels panels = view_panels(attention, view, names);
  const int64_t count = panels.values.shape()[0];
  const bool own = options.panel_scale == PanelScale::own;
  HeatmapOptions heatmap;
  heatmap.colormap = options.colormap;
  heatmap.col_labels = options.key_tokens;
  if (own) {
    heatmap.vmin = 0.0;
    heatmap.vmax = 1.0;
  }
  if (!rows) {
    if (own) scale_each_panel(panels.values, count, tq * tk, panels.captions);
    std::vector<std::string> parts;
    if (!panels.what.empty()) parts.push_back(panels.what);
    if (own) parts.emplace_back("each panel on its own scale: its largest value is 1");
    heatmap.title = !options.title.empty() ? options.title : fmt::format("{}", fmt::join(parts, "; "));
    heatmap.row_labels = options.query_tokens;
    heatmap.panel_captions = panels.captions;
    heatmap.grid_columns = view == ExplorerView::grid ? attention.shape[1] : 0;
    return render_heatmap(panels.values.cview(), format, heatmap);
  }
  // One row a panel: the mean of the selected queries' rows.
  Tensor<double> selected({count, tk});
  for (int64_t p = 0; p < count; ++p) {
    for (const int64_t i : *rows) {
      for (int64_t j = 0; j < tk; ++j) selected[p * tk + j] += panels.values[(p * tq + i) * tk + j];
    }
    for (int64_t j = 0; j < tk; ++j) selected[p * tk + j] /= static_cast<double>(rows->size());
  }
  std::vector<std::string> picked;
  for (const int64_t i : *rows) {
    picked.push_back(options.query_tokens.empty() ? fmt::format("{}", i)
                                                  : options.query_tokens[static_cast<size_t>(i)]);
  }
  if (own) scale_each_panel(selected, count, tk, panels.captions);
  heatmap.title =
      !options.title.empty()
          ? options.title
          : fmt::format("{}mean of the rows of {}{}", panels.what.empty() ? "" : panels.what + ": ",
                        fmt::join(picked, ", "), own ? "; each row on its own scale: its largest is 1" : "");
  heatmap.row_labels = panels.captions;
  return render_heatmap(selected.cview(), format, heatmap);
}

}  // namespace qkv
