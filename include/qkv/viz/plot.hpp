#pragma once
// Line plots as PNG files, drawn by PLplot (its C API and its pngcairo device): the figures of
// `qkv experiment`. A figure is one or more panels side by side; a panel is a set of labelled
// series on linear or log10 axes, with a legend.
//
// Series are data, not drawing commands: a point whose x or y is not finite, or is <= 0 on a log
// axis, is left out and breaks the line there, so a curve that vanishes (a gradient norm of 0)
// shows as a gap rather than a crash. Axis ranges come from the data unless given, with a little
// room around it; a log axis that would hold fewer than two powers of ten (PLplot labels only
// those) is widened to whole decades, and one spanning many decades is labelled every few.
//
// PLplot keeps global state, so rendering is serialised by a lock; callers need not care.

#include <optional>
#include <string>
#include <vector>

namespace qkv {

enum class AxisScale { linear, log10 };

enum class LegendPosition { top_right, top_left, bottom_right, bottom_left, none };

// One curve: the points (x[i], y[i]) joined in order. x and y have the same length.
struct PlotSeries {
  std::string label;  // its legend entry; a series with an empty label has none
  std::vector<double> x;
  std::vector<double> y;
  bool markers = true;  // a symbol at every point, as well as the line
  bool dashed = false;  // reference lines (a target, a bound) are dashed and drawn without markers
};

// An inclusive axis range in data units (not log10 units, even on a log axis).
struct AxisRange {
  double min = 0.0;
  double max = 1.0;
};

struct PlotPanel {
  std::string title;
  std::string x_label;
  std::string y_label;
  AxisScale x_scale = AxisScale::linear;
  AxisScale y_scale = AxisScale::linear;
  std::optional<AxisRange> x_range;  // from the data when absent
  std::optional<AxisRange> y_range;
  LegendPosition legend = LegendPosition::top_right;
  std::vector<PlotSeries> series;
};

struct Figure {
  std::vector<PlotPanel> panels;  // laid out left to right, then top to bottom
  int columns = 0;                // panels per row; all in one row when 0
  int panel_width_px = 720;
  int panel_height_px = 540;
};

// The PNG image of `figure` (its bytes; writing them is the caller's: io/staged_files.hpp).
// Throws ValueError for a figure without panels, a series whose x and y differ in length or a
// non-positive panel size or column count; IoError when PLplot's pngcairo device is missing or
// PLplot reports an error.
std::string render_png(const Figure& figure);

}  // namespace qkv
