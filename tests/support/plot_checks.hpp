#pragma once
// What the plot tests check a legend with: where the series as drawn (points, and their lines
// sampled finely) fall against the legend's box in the panel's layout.

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "qkv/viz/plot.hpp"

namespace qkv::testing {

// A value in a panel's axis units: log10 on a log axis; NaN for what the axis cannot show.
inline double axis_units(double value, AxisScale scale) {
  if (!std::isfinite(value)) return std::nan("");
  if (scale == AxisScale::log10) return value > 0.0 ? std::log10(value) : std::nan("");
  return value;
}

// The first point of a series (or of its line) that lies inside the legend's box, described; empty
// when the legend covers no data or there is none.
inline std::string legend_over_data(const PlotPanel& panel, const PlotPanelLayout& layout) {
  if (layout.legend == LegendPosition::none) return "";
  constexpr int kSamples = 64;
  const auto inside = [&](double x, double y) {
    return x >= layout.legend_x.min && x <= layout.legend_x.max && y >= layout.legend_y.min && y <= layout.legend_y.max;
  };
  for (const PlotSeries& series : panel.series) {
    double last_x = std::nan(""), last_y = std::nan("");
    for (size_t i = 0; i < series.x.size(); ++i) {
      const double x = axis_units(series.x[i], panel.x_scale);
      const double y = axis_units(series.y[i], panel.y_scale);
      if (!std::isfinite(x) || !std::isfinite(y)) {
        last_x = std::nan("");
        continue;
      }
      for (int k = std::isfinite(last_x) ? 1 : kSamples; k <= kSamples; ++k) {
        const double t = static_cast<double>(k) / kSamples;
        const double px = std::isfinite(last_x) ? last_x + t * (x - last_x) : x;
        const double py = std::isfinite(last_x) ? last_y + t * (y - last_y) : y;
        if (inside(px, py)) {
          return fmt::format(
              "panel \"{}\": series \"{}\" at ({:.3g}, {:.3g}) (axis units) lies in the legend's box "
              "[{:.3g}, {:.3g}] x [{:.3g}, {:.3g}]",
              panel.title, series.label, px, py, layout.legend_x.min, layout.legend_x.max, layout.legend_y.min,
              layout.legend_y.max);
        }
      }
      last_x = x;
      last_y = y;
    }
  }
  return "";
}

}  // namespace qkv::testing
