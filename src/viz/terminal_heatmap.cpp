#include "qkv/viz/terminal_heatmap.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string_view>

#include "qkv/core/error.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv {
namespace {

void check_label_count(const std::vector<std::string>& labels, int64_t count, std::string_view name,
                       std::string_view axis, const Shape& shape) {
  if (!labels.empty() && static_cast<int64_t>(labels.size()) != count) {
    throw ShapeError(fmt::format("{}: expected {} labels (one per {} of alpha {}), got {}", name, count, axis,
                                 shape.str(), labels.size()));
  }
}

}  // namespace

template <class T>
std::string render_terminal_heatmap(TensorView<const T> alpha, const TerminalHeatmapOptions& options) {
  if (alpha.rank() != 2) {
    throw ShapeError(fmt::format("alpha: expected a matrix [Tq, Tk], got shape {}", alpha.shape.str()));
  }
  check_label_count(options.row_labels, alpha.shape[0], "row_labels", "row", alpha.shape);
  check_label_count(options.col_labels, alpha.shape[1], "col_labels", "column", alpha.shape);
  HeatmapOptions heatmap;
  heatmap.row_labels = options.row_labels;
  heatmap.col_labels = options.col_labels;
  heatmap.colormap = options.colormap;
  heatmap.vmin = options.vmin;
  heatmap.vmax = options.vmax;
  heatmap.annotate = options.show_values;
  if (options.color) heatmap.terminal.color = options.truecolor ? TerminalColor::truecolor : TerminalColor::palette256;
  heatmap.terminal.decimals = options.decimals;
  heatmap.terminal.legend = options.legend;
  return render_heatmap(alpha, HeatmapFormat::terminal, heatmap);
}

template std::string render_terminal_heatmap(TensorView<const float>, const TerminalHeatmapOptions&);
template std::string render_terminal_heatmap(TensorView<const double>, const TerminalHeatmapOptions&);

}  // namespace qkv
