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

// Where a panel's legend goes. `automatic` takes the first of the inside corners top right, top left,
// bottom left, bottom right whose legend box no curve, marker or point crosses, and right of the plot
// area (which then shrinks to make room) when each of them would cover data. A named corner is
// taken as it is, even over data; outside_right is always beside the data.
enum class LegendPosition { automatic, top_right, top_left, bottom_right, bottom_left, outside_right, none };

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
  LegendPosition legend = LegendPosition::automatic;
  std::vector<PlotSeries> series;
};

struct Figure {
  std::vector<PlotPanel> panels;  // laid out left to right, then top to bottom
  int columns = 0;                // panels per row; all in one row when 0
  int panel_width_px = 720;
  int panel_height_px = 540;
};

// Where render_png puts a panel's axes and legend, in the panel's axis units (log10 of the value on
// a log axis): what tests check a legend against the data with.
struct PlotPanelLayout {
  AxisRange x_axis;  // the ends of the drawn axes
  AxisRange y_axis;
  // Where the legend went: a corner or outside_right, never automatic; none when it has no entry.
  LegendPosition legend = LegendPosition::none;
  // The legend's box as PLplot drew it (its frame included); beyond x_axis.max when outside_right.
  AxisRange legend_x;
  AxisRange legend_y;
};

// The layout of each panel of `figure`, in order, as render_png draws it; the errors of render_png.
std::vector<PlotPanelLayout> plot_layout(const Figure& figure);

// The PNG image of `figure` (its bytes; writing them is the caller's: io/staged_files.hpp).
// Throws ValueError for a figure without panels, a series whose x and y differ in length or a
// non-positive panel size or column count; IoError when PLplot's pngcairo device is missing or
// PLplot reports an error.
std::string render_png(const Figure& figure);

}  // namespace qkv
