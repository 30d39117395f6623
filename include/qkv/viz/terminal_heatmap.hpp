#pragma once
// The terminal heatmap of one matrix with the options it took before the terminal became a format
// of render_heatmap (HeatmapFormat::terminal, include/qkv/viz/heatmap.hpp), which draws it. Kept
// while apps/qkv/experiments/alignment.cpp still calls it; new code calls render_heatmap.

#include <optional>
#include <string>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/viz/colormap.hpp"

namespace qkv {

struct TerminalHeatmapOptions {
  // One UTF-8 label per row (Tq) and per column (Tk); an empty list numbers them from 0.
  std::vector<std::string> row_labels;
  std::vector<std::string> col_labels;
  // ANSI background colours instead of the shade characters.
  bool color = false;
  // The colour map of the backgrounds. Read only with color.
  Colormap colormap = Colormap::viridis;
  // 24-bit colour escapes; otherwise the nearest colour of the 256-colour cube. Read only with color.
  bool truecolor = false;
  // HeatmapOptions::vmin and vmax.
  std::optional<double> vmin;
  std::optional<double> vmax;
  // HeatmapOptions::annotate, with TerminalStyle::decimals and legend.
  bool show_values = false;
  int decimals = 3;
  bool legend = true;
};

// alpha [Tq, Tk] → render_heatmap(alpha, HeatmapFormat::terminal, options as HeatmapOptions). Throws
// ShapeError when alpha is not rank 2 ("alpha: expected a matrix [Tq, Tk], got shape [1, 3, 3]") or a
// label list is neither empty nor one per row/column ("row_labels: expected 6 labels (one per row of
// alpha [6, 6]), got 5"), and the errors of render_heatmap.
template <class T>
std::string render_terminal_heatmap(TensorView<const T> alpha, const TerminalHeatmapOptions& options);

}  // namespace qkv
