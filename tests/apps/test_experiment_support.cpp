// The CLI's support library that `qkv experiment` writes its results with: tables and reports
// (report.hpp), and Ctrl-C and progress (interrupt.hpp, progress.hpp).

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "files.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/viz/plot.hpp"
#include "support/interrupt.hpp"
#include "support/progress.hpp"
#include "support/report.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using qkv::testing::names_in;
using qkv::testing::read_file;
using qkv::testing::TempDir;
using qkv::testing::throws_naming;

TEST(Table, MarkdownAlignsColumnsAndCsvRoundTrips) {
  Table table({{"name", "{}"}, {"n", "{}"}, {"x", "{:.2f}"}});
  table.add_row({std::string("a|b"), int64_t{12}, 0.125});
  table.add_row({std::string("√d"), int64_t{3}, 1.0 / 3.0});
  EXPECT_EQ(table.markdown(),
            "| name |   n |    x |\n"
            "| ---- | --: | ---: |\n"
            "| a\\|b |  12 | 0.12 |\n"
            "| √d   |   3 | 0.33 |\n");
  EXPECT_EQ(table.csv(), "name,n,x\na|b,12,0.125\n√d,3,0.3333333333333333\n");
}

TEST(Table, CsvQuotesFieldsThatNeedIt) {
  Table table(std::vector<TableColumn>{{"text", "{}"}});
  table.add_row({std::string("a,b")});
  table.add_row({std::string("say \"hi\"")});
  table.add_row({std::numeric_limits<double>::quiet_NaN()});
  EXPECT_EQ(table.csv(), "text\n\"a,b\"\n\"say \"\"hi\"\"\"\nnan\n");
}

TEST(Table, RefusesRowsOfTheWrongWidthAndBadFormats) {
  Table table({{"a", "{}"}, {"b", "{}"}});
  EXPECT_TRUE(throws_naming<ValueError>([&] { table.add_row({int64_t{1}}); }, {"row", "expected 2 cells", "got 1"}));
  EXPECT_TRUE(throws_naming<ValueError>(
      [] {
        Table bad(std::vector<TableColumn>{{"a", "{:d}"}});
      },
      {"column \"a\"", "{:d}"}));
  EXPECT_TRUE(throws_naming<ValueError>([] { Table none(std::vector<TableColumn>{}); }, {"columns"}));
}

Report small_report() {
  Report report("Title");
  report.add_setting("seed", "0");
  report.add_paragraph("Some words.");
  Table table({{"d", "{}"}, {"v", "{:.3f}"}});
  table.add_row({int64_t{4}, 4.0123});
  report.add_table("Main", table, "results.csv");
  report.add_data("Every step", table, "steps.csv");
  PlotPanel panel;
  panel.title = "linear √d";
  panel.series = {{.label = "line", .x = {0, 1, 2}, .y = {1, 3, 2}, .markers = true, .dashed = false}};
  Figure figure;
  figure.panels = {panel};
  figure.panel_width_px = 320;
  figure.panel_height_px = 240;
  report.add_figure("A figure", figure, "figure.png");
  return report;
}

TEST(Report, WritesEveryFileAndAMarkdownThatNamesThem) {
  TempDir dir;
  const Report report = small_report();
  report.write(dir.path());
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"figure.png", "results.csv", "results.md", "steps.csv"}));
  const std::string md = read_file(dir.path() / "results.md");
  for (const char* part : {"# Title", "## Settings", "| seed    | 0     |", "Some words.", "## Main", "|   4 | 4.012 |",
                           "(CSV: `results.csv`)", "Every step: `steps.csv` (1 rows).", "![A figure](figure.png)"}) {
    EXPECT_NE(md.find(part), std::string::npos) << "results.md lacks " << part << ":\n" << md;
  }
  EXPECT_EQ(read_file(dir.path() / "results.csv"), "d,v\n4,4.0123\n");
  EXPECT_EQ(report.tables_markdown().find("Every step"), std::string::npos) << "data tables are not printed";
  EXPECT_EQ(report.file_names().back(), "results.md");
}

TEST(Report, RefusesTwoOutputsOfOneName) {
  TempDir dir;
  Report report = small_report();
  report.add_table("Again", Table(std::vector<TableColumn>{{"a", "{}"}}), "results.csv");
  EXPECT_TRUE(throws_naming<ValueError>([&] { report.write(dir.path()); }, {"results.csv"}));
  EXPECT_TRUE(names_in(dir.path()).empty());
}

TEST(Report, AFailedWriteLeavesTheOldResults) {
  TempDir dir;
  small_report().write(dir.path());
  const std::string before = read_file(dir.path() / "results.md");
  // A figure that fails after the tables were staged: nothing may change on disk.
  Report broken = small_report();
  broken.add_paragraph("changed");
  Figure bad;
  bad.panels.resize(1);
  bad.panels[0].series = {{.label = "x", .x = {1}, .y = {}, .markers = true, .dashed = false}};
  broken.add_figure("Broken", bad, "broken.png");
  EXPECT_THROW(broken.write(dir.path()), ValueError);
  EXPECT_EQ(read_file(dir.path() / "results.md"), before);
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"figure.png", "results.csv", "results.md", "steps.csv"}));
}

TEST(Interrupt, ASignalInsideTheScopeIsTakenAtThePollPoint) {
  {
    InterruptScope scope;
    EXPECT_FALSE(interrupt_requested());
    EXPECT_NO_THROW(throw_if_interrupted());
    std::raise(SIGINT);  // the handler only raises the flag: the test carries on
    EXPECT_TRUE(interrupt_requested());
    try {
      throw_if_interrupted();
      ADD_FAILURE() << "no Interrupted thrown";
    } catch (const Interrupted& e) {
      EXPECT_EQ(e.signal_number(), SIGINT);
      EXPECT_STREQ(e.what(), "interrupted by SIGINT");
    }
    Progress progress("[test]", 10);
    EXPECT_THROW(progress.update(1), Interrupted);
  }
  // A new scope starts clear.
  InterruptScope scope;
  EXPECT_FALSE(interrupt_requested());
}

TEST(Progress, ReportsOnStderrWithoutThrowing) {
  ::testing::internal::CaptureStderr();
  Progress progress("[test] task", 4, "steps");
  progress.update(1, "loss 1.0");
  progress.update(2);  // within the interval: not printed
  progress.done("finished");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("[test] task: 1/4 steps (25%)"), std::string::npos) << err;
  EXPECT_NE(err.find("loss 1.0"), std::string::npos) << err;
  EXPECT_NE(err.find("[test] task: 4/4 steps"), std::string::npos) << err;
  EXPECT_NE(err.find("finished"), std::string::npos) << err;
  EXPECT_EQ(err.find("2/4"), std::string::npos) << err;
}

}  // namespace
}  // namespace qkv
