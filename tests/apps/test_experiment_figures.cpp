// The figures of `qkv experiment` as laid out by the plot API: legends that cover no curve, and axes
// that fit the quantity drawn. Each test runs a small experiment (--quick, a few training steps).

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "experiments.hpp"
#include "files.hpp"
#include "plot_checks.hpp"
#include "qkv/viz/plot.hpp"

namespace qkv::cli {
namespace {

using qkv::testing::axis_units;
using qkv::testing::legend_over_data;
using qkv::testing::TempDir;

Report run_quick(const Experiment& experiment, const TempDir& dir, ExtraFiles& files, std::optional<int64_t> steps) {
  ExperimentOptions options;
  options.quick = true;
  options.steps = steps;
  options.directory = dir.path();
  options.extra_files = &files;
  return experiment.run(options);
}

void expect_legends_clear_of_data(const Figure& figure, const std::string& name) {
  const std::vector<PlotPanelLayout> layouts = plot_layout(figure);
  ASSERT_EQ(layouts.size(), figure.panels.size());
  for (size_t i = 0; i < layouts.size(); ++i) {
    EXPECT_NE(layouts[i].legend, LegendPosition::none) << name << " panel " << i << " has no legend";
    EXPECT_EQ(legend_over_data(figure.panels[i], layouts[i]), "") << name;
  }
}

TEST(ExperimentFigures, ScalingSoftmaxFitsItsRangeAndShowsTheUniformLine) {
  TempDir dir;
  ExtraFiles files;
  const Report report = run_quick(scaling_experiment(), dir, files, 5);
  const Figure* figure = report.figure("softmax.png");
  ASSERT_NE(figure, nullptr);
  expect_legends_clear_of_data(*figure, "softmax.png");

  const PlotPanel& max_panel = figure->panels.at(0);
  const PlotPanelLayout layout = plot_layout(*figure).at(0);
  // The largest weight of a row is at most 1: the axis ends just above it.
  EXPECT_LE(layout.y_axis.max, axis_units(1.15, max_panel.y_scale));
  EXPECT_GE(layout.y_axis.max, axis_units(1.0, max_panel.y_scale));
  // The uniform line is the last series (drawn over the curves), dashed, in the legend, and clear of
  // the axis by a tenth of its height at least.
  const PlotSeries& uniform = max_panel.series.back();
  EXPECT_NE(uniform.label.find("uniform"), std::string::npos) << uniform.label;
  EXPECT_TRUE(uniform.dashed);
  ASSERT_FALSE(uniform.y.empty());
  const double height = layout.y_axis.max - layout.y_axis.min;
  EXPECT_GT(axis_units(uniform.y.front(), max_panel.y_scale) - layout.y_axis.min, 0.1 * height);
}

TEST(ExperimentFigures, AlignmentAccuracyLegendsCoverNoCurve) {
  TempDir dir;
  ExtraFiles files;
  const Report report = run_quick(alignment_experiment(), dir, files, std::nullopt);
  const Figure* figure = report.figure("accuracy_by_length.png");
  ASSERT_NE(figure, nullptr);
  expect_legends_clear_of_data(*figure, "accuracy_by_length.png");
}

}  // namespace
}  // namespace qkv::cli
