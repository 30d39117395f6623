#include "qkv/viz/plot.hpp"

#include <fmt/format.h>
#include <plplot.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/core/error.hpp"

namespace qkv {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// cmap0 indices: PLplot paints the page in colour 0 and draws axes in colour 1 by default.
constexpr PLINT kBackground = 0;
constexpr PLINT kForeground = 1;
constexpr PLINT kGrid = 2;
constexpr PLINT kFirstSeries = 3;
// Okabe and Ito's palette, which readers with any common colour blindness can tell apart.
constexpr std::array<std::array<PLINT, 3>, 7> kSeriesRgb = {
    {{0, 114, 178}, {213, 94, 0}, {0, 158, 115}, {204, 121, 167}, {230, 159, 0}, {86, 180, 233}, {0, 0, 0}}};
// Cycled together with the colours but with a different period, so that series stay distinct in grey.
constexpr std::array<const char*, 5> kMarkers = {"●", "■", "▲", "◆", "▼"};
// Character height relative to PLplot's default for a one-panel figure, and of a marker relative to
// the text. PLplot sizes characters by the whole page, so a figure of several panels shrinks them.
constexpr PLFLT kTextScale = 0.9;
constexpr PLFLT kMarkerScale = 0.6;
constexpr PLINT kSolid = 1;
constexpr PLINT kDashed = 2;

// PLplot's state is global: one figure at a time. The abort message is how PLplot reports a
// recoverable error (through plsabort) instead of printing it.
std::mutex plplot_mutex;
std::string plplot_abort_message;

void remember_abort(PLCHAR_VECTOR message) {
  if (plplot_abort_message.empty()) plplot_abort_message = message;
}

// PLplot calls exit() after its exit handler whatever it returns; render_png checks beforehand
// everything that could get here, so this is only a last word that keeps the CLI's exit code.
int report_fatal(PLCHAR_VECTOR message) {
  std::fprintf(stderr, "qkv: error: PLplot: %s\n", message);
  return 2;
}

bool has_pngcairo() {
  int count = 128;
  std::vector<PLCHAR_VECTOR> menus(static_cast<size_t>(count)), names(static_cast<size_t>(count));
  PLCHAR_VECTOR* menu_ptr = menus.data();
  PLCHAR_VECTOR* name_ptr = names.data();
  plgDevs(&menu_ptr, &name_ptr, &count);
  for (int i = 0; i < count; ++i) {
    if (std::string_view(names[static_cast<size_t>(i)]) == "pngcairo") return true;
  }
  return false;
}

// A value in axis units: log10 on a log axis. NaN for what the axis cannot show.
double to_axis(double value, AxisScale scale) {
  if (!std::isfinite(value)) return kNaN;
  if (scale == AxisScale::log10) return value > 0.0 ? std::log10(value) : kNaN;
  return value;
}

struct Limits {
  double min = 0.0;
  double max = 1.0;
};

// The range of one axis, in axis units: as given when both ends are, otherwise the data's with a
// little room around it (on a log axis, at least two powers of ten, the only labelled ticks).
Limits axis_limits(const PlotPanel& panel, bool is_x) {
  const AxisScale scale = is_x ? panel.x_scale : panel.y_scale;
  const std::optional<AxisRange>& given = is_x ? panel.x_range : panel.y_range;
  if (given) {
    const double lo = to_axis(given->min, scale);
    const double hi = to_axis(given->max, scale);
    if (std::isfinite(lo) && std::isfinite(hi) && lo < hi) return {lo, hi};
  }
  double lo = std::numeric_limits<double>::infinity();
  double hi = -lo;
  for (const PlotSeries& series : panel.series) {
    for (size_t i = 0; i < series.x.size(); ++i) {
      const double x = to_axis(series.x[i], panel.x_scale);
      const double y = to_axis(series.y[i], panel.y_scale);
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      lo = std::min(lo, is_x ? x : y);
      hi = std::max(hi, is_x ? x : y);
    }
  }
  if (given && std::isfinite(to_axis(given->min, scale))) lo = to_axis(given->min, scale);
  if (given && std::isfinite(to_axis(given->max, scale))) hi = to_axis(given->max, scale);
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {0.0, 1.0};
  if (scale == AxisScale::log10) {
    // A little room around the data; whole decades when fewer than two powers of ten would be labelled.
    const double pad = std::max(0.05 * (hi - lo), 0.1);
    lo -= pad;
    hi += pad;
    if (std::floor(hi) - std::ceil(lo) < 1.0) {
      // A hair beyond the decades, so that PLplot does not drop the labels at the very edges.
      lo = std::floor(lo) - 0.02;
      hi = std::ceil(hi) + 0.02;
    }
    return {lo, hi};
  }
  if (hi <= lo) {
    const double pad = std::max(std::abs(lo) * 0.1, 0.5);
    return {lo - pad, hi + pad};
  }
  const double pad = 0.05 * (hi - lo);
  return {lo - pad, hi + pad};
}

PLINT series_colour(size_t index) { return kFirstSeries + static_cast<PLINT>(index % kSeriesRgb.size()); }
const char* series_marker(size_t index) { return kMarkers[index % kMarkers.size()]; }

// The series in axis units, cut into runs of plottable points: a point the axes cannot show
// breaks the line.
void draw_series(const PlotPanel& panel, const PlotSeries& series, size_t index, PLFLT text_scale) {
  plcol0(series_colour(index));
  pllsty(series.dashed ? kDashed : kSolid);
  plwidth(series.dashed ? 1.5 : 2.0);
  std::vector<PLFLT> xs, ys;
  const auto flush = [&] {
    if (xs.size() >= 2) plline(static_cast<PLINT>(xs.size()), xs.data(), ys.data());
    if (series.markers && !series.dashed && !xs.empty()) {
      plschr(0.0, kMarkerScale * text_scale);
      plstring(static_cast<PLINT>(xs.size()), xs.data(), ys.data(), series_marker(index));
      plschr(0.0, text_scale);
    }
    xs.clear();
    ys.clear();
  };
  for (size_t i = 0; i < series.x.size(); ++i) {
    const double x = to_axis(series.x[i], panel.x_scale);
    const double y = to_axis(series.y[i], panel.y_scale);
    if (!std::isfinite(x) || !std::isfinite(y)) {
      flush();
      continue;
    }
    xs.push_back(x);
    ys.push_back(y);
  }
  flush();
  pllsty(kSolid);
}

// pllegend's placement: offsets of kLegendInset of the plot area from the corner named, inwards
// (outwards, from the right edge, for outside_right, which is centred vertically).
constexpr PLFLT kLegendInset = 0.02;

PLINT legend_position(LegendPosition position) {
  switch (position) {
    case LegendPosition::top_left:
      return PL_POSITION_TOP | PL_POSITION_LEFT | PL_POSITION_INSIDE;
    case LegendPosition::bottom_right:
      return PL_POSITION_BOTTOM | PL_POSITION_RIGHT | PL_POSITION_INSIDE;
    case LegendPosition::bottom_left:
      return PL_POSITION_BOTTOM | PL_POSITION_LEFT | PL_POSITION_INSIDE;
    case LegendPosition::outside_right:
      return PL_POSITION_RIGHT | PL_POSITION_OUTSIDE;
    case LegendPosition::top_right:
    case LegendPosition::automatic:
    case LegendPosition::none:
      break;
  }
  return PL_POSITION_TOP | PL_POSITION_RIGHT | PL_POSITION_INSIDE;
}

// A rectangle in fractions of the plot area: x from its left edge, y from its bottom edge.
struct Box {
  double x0 = 0.0, x1 = 0.0, y0 = 0.0, y1 = 0.0;
};

// Where pllegend puts a legend of `width` x `height` (fractions of the plot area) at `position`.
Box legend_box(LegendPosition position, double width, double height) {
  const double left = kLegendInset, right = 1.0 - kLegendInset - width;
  const double bottom = kLegendInset, top = 1.0 - kLegendInset - height;
  switch (position) {
    case LegendPosition::top_left:
      return {left, left + width, top, top + height};
    case LegendPosition::bottom_right:
      return {right, right + width, bottom, bottom + height};
    case LegendPosition::bottom_left:
      return {left, left + width, bottom, bottom + height};
    case LegendPosition::outside_right:
      return {1.0 + kLegendInset, 1.0 + kLegendInset + width, 0.5 - height / 2, 0.5 + height / 2};
    default:
      return {right, right + width, top, top + height};
  }
}

// Whether any drawn part of the panel's series falls in `box` (plot-area fractions, widened by a
// marker's half width): its points, and its lines sampled finely between them.
bool covers_data(const PlotPanel& panel, const Limits& x, const Limits& y, const Box& box) {
  constexpr double kMargin = 0.015;
  constexpr int kSamplesPerSegment = 32;
  const auto inside = [&](double fx, double fy) {
    return fx >= box.x0 - kMargin && fx <= box.x1 + kMargin && fy >= box.y0 - kMargin && fy <= box.y1 + kMargin;
  };
  for (const PlotSeries& series : panel.series) {
    double last_fx = kNaN, last_fy = kNaN;
    for (size_t i = 0; i < series.x.size(); ++i) {
      const double fx = (to_axis(series.x[i], panel.x_scale) - x.min) / (x.max - x.min);
      const double fy = (to_axis(series.y[i], panel.y_scale) - y.min) / (y.max - y.min);
      if (!std::isfinite(fx) || !std::isfinite(fy)) {
        last_fx = kNaN;
        continue;
      }
      if (inside(fx, fy)) return true;
      if (std::isfinite(last_fx)) {
        for (int k = 1; k < kSamplesPerSegment; ++k) {
          const double t = static_cast<double>(k) / kSamplesPerSegment;
          if (inside(last_fx + t * (fx - last_fx), last_fy + t * (fy - last_fy))) return true;
        }
      }
      last_fx = fx;
      last_fy = fy;
    }
  }
  return false;
}

// The legend's place: a named one as it is; for automatic, the first free corner, else beside the data.
LegendPosition resolve_legend(const PlotPanel& panel, const Limits& x, const Limits& y, double width, double height) {
  if (panel.legend != LegendPosition::automatic) return panel.legend;
  for (const LegendPosition corner : {LegendPosition::top_right, LegendPosition::top_left, LegendPosition::bottom_left,
                                      LegendPosition::bottom_right}) {
    if (!covers_data(panel, x, y, legend_box(corner, width, height))) return corner;
  }
  return LegendPosition::outside_right;
}

// The legend's entries, in the arrays pllegend reads.
struct LegendEntries {
  std::vector<PLINT> options, colours, styles, marker_counts;
  std::vector<PLFLT> widths, marker_scales;
  std::vector<const char*> texts, markers;
};

LegendEntries legend_entries(const PlotPanel& panel, PLFLT text_scale) {
  LegendEntries e;
  for (size_t i = 0; i < panel.series.size(); ++i) {
    const PlotSeries& series = panel.series[i];
    if (series.label.empty()) continue;
    const bool with_marker = series.markers && !series.dashed;
    e.options.push_back(PL_LEGEND_LINE | (with_marker ? PL_LEGEND_SYMBOL : 0));
    e.colours.push_back(series_colour(i));
    e.styles.push_back(series.dashed ? kDashed : kSolid);
    e.widths.push_back(series.dashed ? 1.5 : 2.0);
    e.marker_counts.push_back(with_marker ? 1 : 0);
    e.marker_scales.push_back(kMarkerScale * text_scale);
    e.texts.push_back(series.label.c_str());
    e.markers.push_back(with_marker ? series_marker(i) : "");
  }
  return e;
}

// Draws the legend at `position` and returns its size in fractions of the plot area. pllegend sizes
// its text from PLplot's default height, not the current one: it gets the figure's text scale itself.
std::pair<double, double> draw_legend(const PlotPanel& panel, LegendPosition position, PLFLT text_scale) {
  const LegendEntries e = legend_entries(panel, text_scale);
  if (e.texts.empty()) return {0.0, 0.0};
  PLFLT width = 0.0;
  PLFLT height = 0.0;
  const std::vector<PLINT> text_colours(e.texts.size(), kForeground);
  plwidth(1.0);
  pllegend(&width, &height, PL_LEGEND_BACKGROUND | PL_LEGEND_BOUNDING_BOX, legend_position(position), kLegendInset,
           kLegendInset, 0.08, kBackground, kForeground, kSolid, 0, 0, static_cast<PLINT>(e.texts.size()),
           e.options.data(), 0.8, 0.9 * text_scale, 1.8, 0.0, text_colours.data(), e.texts.data(), nullptr, nullptr,
           nullptr, nullptr, e.colours.data(), e.styles.data(), e.widths.data(), e.colours.data(),
           e.marker_scales.data(), e.marker_counts.data(), e.markers.data());
  return {width, height};
}

// Labelled ticks of one axis. PLplot labels a log axis ("l") at every decade, which stacks 60
// labels on an axis spanning 60 decades; such an axis is drawn as a linear one in log10 units
// instead, ticked every few decades and labelled 10^k by label_power_of_ten.
struct Ticks {
  std::string options;  // plbox's options for the axis line, ticks and labels
  std::string grid;     // plbox's options for the grid
  PLFLT spacing = 0.0;  // between labelled ticks, in axis units; 0 lets PLplot choose
  PLINT minor = 0;      // minor intervals per labelled one; 0 lets PLplot choose
};

Ticks axis_ticks(const Limits& limits, AxisScale scale, const std::string& base) {
  constexpr double kMaxLabels = 8.0;
  if (scale != AxisScale::log10) return {base, "g", 0.0, 0};
  const double span = limits.max - limits.min;
  if (span <= kMaxLabels) return {base + "l", "gl", 0.0, 0};
  double decades = 2.0;
  for (const double step : {2.0, 5.0, 10.0, 20.0, 50.0, 100.0}) {
    decades = step;
    if (span / step <= kMaxLabels) break;
  }
  return {base + "o", "g", decades, static_cast<PLINT>(decades)};
}

// "10^k" for a tick at k on an axis drawn in log10 units (#u and #d raise and lower the text).
void label_power_of_ten(PLINT /*axis*/, PLFLT value, PLCHAR_NC_VECTOR label, PLINT length, PLPointer /*data*/) {
  std::snprintf(label, static_cast<size_t>(length), "10#u%d#d", static_cast<int>(std::lround(value)));
}

// Where panel `index` of a figure of `columns` x `rows` panels sits on the page, as fractions of it
// (PLplot fills subpages left to right, then top to bottom).
Box subpage(int index, int columns, int rows) {
  const double x0 = static_cast<double>(index % columns) / columns;
  const double y1 = 1.0 - static_cast<double>(index / columns) / rows;
  return {x0, x0 + 1.0 / columns, y1 - 1.0 / rows, y1};
}

// Narrows the plot area (set by plvsta) on the right by a legend `width` wide (a fraction of it)
// and its inset, so that a legend outside_right fits in the panel.
void make_room_on_the_right(double width, const Box& page) {
  PLFLT x0 = 0.0, x1 = 0.0, y0 = 0.0, y1 = 0.0;
  plgvpd(&x0, &x1, &y0, &y1);
  const double right = x1 - (width + 2 * kLegendInset) * (x1 - x0);
  const double page_w = page.x1 - page.x0, page_h = page.y1 - page.y0;
  plvpor((x0 - page.x0) / page_w, (right - page.x0) / page_w, (y0 - page.y0) / page_h, (y1 - page.y0) / page_h);
}

// One panel. `legend_size` is the legend's size measured by an earlier pass (fractions of the plot
// area), which is what `automatic` places by; absent in that pass, which draws the legend top right.
PlotPanelLayout draw_panel(const PlotPanel& panel, const Box& page, PLFLT text_scale,
                           std::optional<std::pair<double, double>> legend_size) {
  const Limits x = axis_limits(panel, true);
  const Limits y = axis_limits(panel, false);
  const Ticks x_ticks = axis_ticks(x, panel.x_scale, "bcnst");
  const Ticks y_ticks = axis_ticks(y, panel.y_scale, "bcnstv");
  LegendPosition position = LegendPosition::top_right;
  if (legend_size) position = resolve_legend(panel, x, y, legend_size->first, legend_size->second);
  if (panel.legend == LegendPosition::none) position = LegendPosition::none;
  pladv(0);
  plvsta();
  if (position == LegendPosition::outside_right && legend_size) make_room_on_the_right(legend_size->first, page);
  plwind(x.min, x.max, y.min, y.max);
  plwidth(1.0);
  plslabelfunc(label_power_of_ten, nullptr);
  plcol0(kGrid);
  plbox(x_ticks.grid.c_str(), x_ticks.spacing, x_ticks.minor, y_ticks.grid.c_str(), y_ticks.spacing, y_ticks.minor);
  plcol0(kForeground);
  plbox(x_ticks.options.c_str(), x_ticks.spacing, x_ticks.minor, y_ticks.options.c_str(), y_ticks.spacing,
        y_ticks.minor);
  pllab(panel.x_label.c_str(), panel.y_label.c_str(), panel.title.c_str());
  if (legend_size) {
    for (size_t i = 0; i < panel.series.size(); ++i) draw_series(panel, panel.series[i], i, text_scale);
  }
  PlotPanelLayout layout;
  layout.x_axis = {x.min, x.max};
  layout.y_axis = {y.min, y.max};
  if (position == LegendPosition::none) return layout;
  const auto [width, height] = draw_legend(panel, position, text_scale);
  if (width <= 0.0) return layout;
  const Box box = legend_box(position, width, height);
  layout.legend = position;
  layout.legend_x = {x.min + box.x0 * (x.max - x.min), x.min + box.x1 * (x.max - x.min)};
  layout.legend_y = {y.min + box.y0 * (y.max - y.min), y.min + box.y1 * (y.max - y.min)};
  return layout;
}

void check_figure(const Figure& figure) {
  if (figure.panels.empty()) throw ValueError("figure: expected at least one panel, got none");
  if (figure.columns < 0) throw ValueError(fmt::format("figure.columns: expected >= 0, got {}", figure.columns));
  if (figure.panel_width_px < 1 || figure.panel_height_px < 1) {
    throw ValueError(fmt::format("figure: expected a positive panel size, got {} x {} px", figure.panel_width_px,
                                 figure.panel_height_px));
  }
  for (const PlotPanel& panel : figure.panels) {
    for (const PlotSeries& series : panel.series) {
      if (series.x.size() != series.y.size()) {
        throw ValueError(fmt::format("series \"{}\" of panel \"{}\": expected as many y as x values ({}), got {}",
                                     series.label, panel.title, series.x.size(), series.y.size()));
      }
    }
  }
}

}  // namespace

namespace {

// One pass of PLplot over the figure, into a PNG. Without `legend_sizes` it only measures: every
// legend goes top right, no series is drawn, and the layouts say how big each legend came out.
std::string render_pass(const Figure& figure, const std::vector<std::pair<double, double>>* legend_sizes,
                        std::vector<PlotPanelLayout>& layouts) {
  const int panels = static_cast<int>(figure.panels.size());
  const int columns = figure.columns == 0 ? panels : std::min(figure.columns, panels);
  const int rows = (panels + columns - 1) / columns;

  // PLplot writes to a stream it is given; an in-memory one keeps the figure off the file system
  // until the caller decides where (and how atomically) it goes.
  char* buffer = nullptr;
  size_t size = 0;
  std::FILE* stream_file = open_memstream(&buffer, &size);
  if (stream_file == nullptr) throw IoError("figure: cannot allocate a stream for the image");

  PLINT stream = 0;
  plmkstrm(&stream);
  plsexit(report_fatal);
  plsabort(remember_abort);
  plplot_abort_message.clear();
  plsdev("pngcairo");
  plsfile(stream_file);
  plspage(0.0, 0.0, figure.panel_width_px * columns, figure.panel_height_px * rows, 0, 0);
  plscmap0n(kFirstSeries + static_cast<PLINT>(kSeriesRgb.size()));
  plscol0(kBackground, 255, 255, 255);
  plscol0(kForeground, 0, 0, 0);
  plscol0(kGrid, 220, 220, 220);
  for (size_t i = 0; i < kSeriesRgb.size(); ++i) {
    plscol0(kFirstSeries + static_cast<PLINT>(i), kSeriesRgb[i][0], kSeriesRgb[i][1], kSeriesRgb[i][2]);
  }
  plssub(columns, rows);
  plinit();
  const PLFLT text_scale = kTextScale / std::sqrt(static_cast<PLFLT>(std::max(columns, rows)));
  plschr(0.0, text_scale);
  layouts.clear();
  for (int i = 0; i < panels; ++i) {
    std::optional<std::pair<double, double>> size_of_legend;
    if (legend_sizes != nullptr) size_of_legend = (*legend_sizes)[static_cast<size_t>(i)];
    layouts.push_back(
        draw_panel(figure.panels[static_cast<size_t>(i)], subpage(i, columns, rows), text_scale, size_of_legend));
  }
  plend1();

  // plend1 closed the stream (PLplot closes the file it writes to), which is when open_memstream
  // sets `buffer` and `size`; the buffer is ours to free.
  std::string png(buffer == nullptr ? "" : std::string(buffer, size));
  std::free(buffer);
  if (!plplot_abort_message.empty()) {
    throw IoError(fmt::format("figure: PLplot could not draw it: {}", plplot_abort_message));
  }
  if (png.empty()) throw IoError("figure: PLplot drew no image");
  return png;
}

// The figure's PNG and its layout: a first pass measures the legends, the second places and draws.
std::string render(const Figure& figure, std::vector<PlotPanelLayout>& layouts) {
  check_figure(figure);
  const std::lock_guard lock(plplot_mutex);
  if (!has_pngcairo()) {
    throw IoError("figure: PLplot has no pngcairo device (Debian: install plplot-driver-cairo)");
  }
  render_pass(figure, nullptr, layouts);
  std::vector<std::pair<double, double>> sizes;
  for (const PlotPanelLayout& layout : layouts) {
    if (layout.legend == LegendPosition::none) {
      sizes.emplace_back(0.0, 0.0);
      continue;
    }
    const double width = (layout.legend_x.max - layout.legend_x.min) / (layout.x_axis.max - layout.x_axis.min);
    const double height = (layout.legend_y.max - layout.legend_y.min) / (layout.y_axis.max - layout.y_axis.min);
    sizes.emplace_back(width, height);
  }
  return render_pass(figure, &sizes, layouts);
}

}  // namespace

std::vector<PlotPanelLayout> plot_layout(const Figure& figure) {
  std::vector<PlotPanelLayout> layouts;
  render(figure, layouts);
  return layouts;
}

std::string render_png(const Figure& figure) {
  std::vector<PlotPanelLayout> layouts;
  return render(figure, layouts);
}

}  // namespace qkv
