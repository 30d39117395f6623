// Line plots (qkv/viz/plot.hpp): PNGs of the panels' size, grids, empty and unplottable panels,
// refused figures.

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "files.hpp"
#include "plot_checks.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/viz/plot.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using qkv::testing::legend_over_data;
using qkv::testing::names_in;
using qkv::testing::read_file;
using qkv::testing::TempDir;
using qkv::testing::throws_naming;

// Width and height from a PNG's IHDR, after checking its signature; {0, 0} when it is not a PNG.
std::pair<uint32_t, uint32_t> png_size(const std::string& bytes) {
  if (bytes.size() < 24 || bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0 || bytes.compare(12, 4, "IHDR") != 0)
    return {};
  const auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<unsigned char>(bytes[at + i]);
    return v;
  };
  return {be32(16), be32(20)};
}

Figure two_panel_figure() {
  PlotPanel linear;
  linear.title = "linear √d";
  linear.x_label = "x";
  linear.y_label = "y";
  linear.series = {{.label = "line", .x = {0, 1, 2}, .y = {1, 3, 2}, .markers = true, .dashed = false},
                   {.label = "ref", .x = {0, 2}, .y = {2, 2}, .markers = false, .dashed = true}};
  PlotPanel log = linear;
  log.x_scale = AxisScale::log10;
  log.y_scale = AxisScale::log10;
  // Zero, negative and NaN points cannot be shown on log axes: they break the line, not the plot.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  log.series = {{.label = "gaps",
                 .x = {1, 10, 100, 1000, 1e4},
                 .y = {1e-3, 0.0, nan, -1.0, 1e2},
                 .markers = true,
                 .dashed = false}};
  Figure figure;
  figure.panels = {linear, log};
  figure.panel_width_px = 320;
  figure.panel_height_px = 240;
  return figure;
}

TEST(Plot, WritesAPngOfThePanelsSize) {
  TempDir dir;
  const std::filesystem::path path = dir.path() / "figure.png";
  write_file_atomically(path, render_png(two_panel_figure()));
  const auto [width, height] = png_size(read_file(path));
  EXPECT_EQ(width, 640u);
  EXPECT_EQ(height, 240u);
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"figure.png"});
}

TEST(Plot, PanelsWrapIntoRows) {
  TempDir dir;
  Figure figure = two_panel_figure();
  figure.panels.push_back(figure.panels[0]);
  figure.columns = 2;
  write_file_atomically(dir.path() / "grid.png", render_png(figure));
  const auto [width, height] = png_size(read_file(dir.path() / "grid.png"));
  EXPECT_EQ(width, 640u);
  EXPECT_EQ(height, 480u);
}

TEST(Plot, EmptyAndAllUnplottablePanelsStillDraw) {
  TempDir dir;
  Figure figure;
  PlotPanel empty;
  PlotPanel nothing_positive;
  nothing_positive.y_scale = AxisScale::log10;
  nothing_positive.series = {{.label = "zeros", .x = {1, 2}, .y = {0, 0}, .markers = true, .dashed = false}};
  figure.panels = {empty, nothing_positive};
  write_file_atomically(dir.path() / "empty.png", render_png(figure));
  EXPECT_EQ(png_size(read_file(dir.path() / "empty.png")).first, 2u * 720u);
}

TEST(Plot, RefusesMalformedFiguresAndUnwritablePaths) {
  TempDir dir;
  EXPECT_TRUE(throws_naming<ValueError>([&] { write_file_atomically(dir.path() / "a.png", render_png(Figure{})); },
                                        {"figure", "panel"}));
  Figure figure = two_panel_figure();
  figure.panels[0].series[0].y.pop_back();
  EXPECT_TRUE(throws_naming<ValueError>([&] { write_file_atomically(dir.path() / "a.png", render_png(figure)); },
                                        {"series \"line\"", "expected as many y as x values (3), got 2"}));
  figure = two_panel_figure();
  figure.panel_width_px = 0;
  EXPECT_TRUE(throws_naming<ValueError>([&] { write_file_atomically(dir.path() / "a.png", render_png(figure)); },
                                        {"panel size"}));
  EXPECT_TRUE(throws_naming<IoError>(
      [&] { write_file_atomically(dir.path() / "missing" / "a.png", render_png(two_panel_figure())); },
      {"missing/a.png", "cannot write"}));
  EXPECT_TRUE(names_in(dir.path()).empty());
}

// Two curves near the top, as accuracies that stay near 1, and one that falls from the top left to
// the bottom right: only the bottom left corner is free.
PlotPanel crowded_panel() {
  PlotPanel panel;
  panel.title = "crowded";
  panel.y_range = AxisRange{0.0, 1.05};
  std::vector<double> x, high, higher, falling;
  for (int i = 0; i <= 10; ++i) {
    x.push_back(i);
    high.push_back(0.97);
    higher.push_back(1.0);
    falling.push_back(1.0 - 0.09 * i);
  }
  panel.series = {{.label = "additive attention", .x = x, .y = high},
                  {.label = "scaled dot attention", .x = x, .y = higher},
                  {.label = "no attention", .x = x, .y = falling}};
  return panel;
}

TEST(PlotLegend, AutomaticTakesACornerThatCoversNoData) {
  Figure figure;
  figure.panels = {crowded_panel()};
  const std::vector<PlotPanelLayout> layouts = plot_layout(figure);
  ASSERT_EQ(layouts.size(), 1U);
  EXPECT_EQ(layouts[0].legend, LegendPosition::bottom_left);
  EXPECT_EQ(legend_over_data(figure.panels[0], layouts[0]), "");
  EXPECT_GT(layouts[0].legend_x.max, layouts[0].legend_x.min);
  EXPECT_GT(layouts[0].legend_y.max, layouts[0].legend_y.min);
}

TEST(PlotLegend, GoesBesideThePlotWhenEveryCornerHoldsData) {
  PlotPanel panel = crowded_panel();
  std::vector<double> x, low;
  for (int i = 0; i <= 10; ++i) {
    x.push_back(i);
    low.push_back(0.02);
  }
  panel.series.push_back({.label = "floor", .x = x, .y = low});
  Figure figure;
  figure.panels = {panel, panel, panel};  // small panels, as accuracy_by_length's
  figure.panel_width_px = 560;
  figure.panel_height_px = 440;
  const std::vector<PlotPanelLayout> layouts = plot_layout(figure);
  ASSERT_EQ(layouts.size(), 3U);
  for (const PlotPanelLayout& layout : layouts) {
    EXPECT_EQ(layout.legend, LegendPosition::outside_right);
    EXPECT_GT(layout.legend_x.min, layout.x_axis.max);
    EXPECT_EQ(legend_over_data(panel, layout), "");
  }
  EXPECT_FALSE(render_png(figure).empty());
}

TEST(PlotLegend, ANamedCornerIsKeptAndNoneDrawsNoLegend) {
  PlotPanel panel = crowded_panel();
  panel.legend = LegendPosition::top_right;
  PlotPanel without = crowded_panel();
  without.legend = LegendPosition::none;
  Figure figure;
  figure.panels = {panel, without};
  const std::vector<PlotPanelLayout> layouts = plot_layout(figure);
  EXPECT_EQ(layouts[0].legend, LegendPosition::top_right);
  EXPECT_NE(legend_over_data(panel, layouts[0]), "") << "the test's data must lie under a top right legend";
  EXPECT_EQ(layouts[1].legend, LegendPosition::none);
}

}  // namespace
}  // namespace qkv
