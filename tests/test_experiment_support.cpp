// The pieces `qkv experiment` writes its results with: PLplot figures (plot.hpp), tables and
// reports (report.hpp), all-or-nothing file sets (staged_files.hpp), and Ctrl-C and progress
// (interrupt.hpp, progress.hpp).

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

#include "qkv/error.hpp"
#include "qkv/interrupt.hpp"
#include "qkv/plot.hpp"
#include "qkv/progress.hpp"
#include "qkv/report.hpp"
#include "qkv/staged_files.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using qkv::testing::throws_naming;

// A fresh directory, removed with everything in it at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "qkv-experiment-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The names in `dir`, so that a test sees leftover temporaries.
std::vector<std::string> names_in(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

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
  write_png(two_panel_figure(), path);
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
  write_png(figure, dir.path() / "grid.png");
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
  write_png(figure, dir.path() / "empty.png");
  EXPECT_EQ(png_size(read_file(dir.path() / "empty.png")).first, 2u * 720u);
}

TEST(Plot, RefusesMalformedFiguresAndUnwritablePaths) {
  TempDir dir;
  EXPECT_TRUE(throws_naming<ValueError>([&] { write_png(Figure{}, dir.path() / "a.png"); }, {"figure", "panel"}));
  Figure figure = two_panel_figure();
  figure.panels[0].series[0].y.pop_back();
  EXPECT_TRUE(throws_naming<ValueError>([&] { write_png(figure, dir.path() / "a.png"); },
                                        {"series \"line\"", "expected as many y as x values (3), got 2"}));
  figure = two_panel_figure();
  figure.panel_width_px = 0;
  EXPECT_TRUE(throws_naming<ValueError>([&] { write_png(figure, dir.path() / "a.png"); }, {"panel size"}));
  EXPECT_TRUE(throws_naming<IoError>([&] { write_png(two_panel_figure(), dir.path() / "missing" / "a.png"); },
                                     {"missing/a.png", "cannot write"}));
  EXPECT_TRUE(names_in(dir.path()).empty());
}

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
  Figure figure = two_panel_figure();
  figure.panels.resize(1);
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

TEST(StagedFiles, CommitRenamesEveryFileAndAbandonRemovesTheTemporaries) {
  TempDir dir;
  {
    StagedFiles files;
    files.stage(dir.path() / "a.txt", "alpha");
    std::ofstream(files.stage_path(dir.path() / "b.txt")) << "beta";
    EXPECT_EQ(names_in(dir.path()).size(), 2u);
    EXPECT_TRUE(throws_naming<IoError>([&] { files.stage(dir.path() / "a.txt", "again"); }, {"a.txt", "staged twice"}));
    files.commit();
    EXPECT_EQ(files.size(), 0u);
  }
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"a.txt", "b.txt"}));
  EXPECT_EQ(read_file(dir.path() / "b.txt"), "beta");
  {
    StagedFiles files;
    files.stage(dir.path() / "a.txt", "replaced");
    files.stage(dir.path() / "c.txt", "gamma");
  }  // destroyed without commit
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"a.txt", "b.txt"}));
  EXPECT_EQ(read_file(dir.path() / "a.txt"), "alpha");
}

TEST(StagedFiles, RefusesADirectoryThatDoesNotExist) {
  TempDir dir;
  StagedFiles files;
  EXPECT_TRUE(
      throws_naming<IoError>([&] { files.stage(dir.path() / "no" / "a.txt", "x"); }, {"no/a.txt", "cannot write"}));
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
