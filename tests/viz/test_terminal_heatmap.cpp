// Tests of the terminal heatmap (HeatmapFormat::terminal, src/viz/heatmap_terminal.cpp): exact
// plain layouts, alignment of CJK labels by display width, colour escapes, the scale, label and option errors, terminal
// detection, masked cells, clipping on the scale line, and grids fitted to a width in columns.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/text.hpp"
#include "qkv/viz/heatmap.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Rows of α that fall clearly inside the shade bins (t·5 is never near an integer): 0.7 → ▓,
// 0.25 and 0.3 → ░, 0.55 → ▒, 1 → █, below 0.2 → blank.
Tensor<float> three_by_three() {
  return Tensor<float>({3, 3}, {0.7F, 0.25F, 0.05F,  //
                                0.0F, 1.0F, 0.0F,    //
                                0.15F, 0.55F, 0.3F});
}

HeatmapOptions labelled(std::vector<std::string> labels) {
  HeatmapOptions options;
  options.row_labels = labels;
  options.col_labels = labels;
  return options;
}

template <class T>
std::string terminal(TensorView<const T> alpha, const HeatmapOptions& options) {
  return render_heatmap(alpha, HeatmapFormat::terminal, options);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

// Sets an environment variable for the life of the object, then restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(TerminalHeatmap, PlainShadesMatchExactly) {
  const std::string expected =
      "    the cat sat\n"
      "the ▓▓▓ ░░░\n"
      "cat     ███\n"
      "sat     ▒▒▒ ░░░\n"
      "scale: 0.000 [ ░▒▓█] 1.000\n";
  EXPECT_EQ(terminal(three_by_three().cview(), labelled({"the", "cat", "sat"})), expected);
}

TEST(TerminalHeatmap, PlainValuesMatchExactly) {
  HeatmapOptions options = labelled({"the", "cat", "sat"});
  options.annotate = true;
  options.terminal.decimals = 2;
  options.terminal.legend = false;
  const std::string expected =
      "      the   cat   sat\n"
      "the ▓0.70 ░0.25  0.05\n"
      "cat  0.00 █1.00  0.00\n"
      "sat  0.15 ▒0.55 ░0.30\n";
  EXPECT_EQ(terminal(three_by_three().cview(), options), expected);
}

TEST(TerminalHeatmap, DoubleMatchesFloat) {
  const Tensor<float> alpha = three_by_three();
  const Tensor<double> alpha64 = testing::cast<double>(alpha);
  const HeatmapOptions options = labelled({"the", "cat", "sat"});
  EXPECT_EQ(terminal(alpha64.cview(), options), terminal(alpha.cview(), options));
}

TEST(TerminalHeatmap, CjkLabelsAlignByDisplayWidth) {
  // Every cell is full (█), so no line loses trailing blanks: each must span the header's width.
  const Tensor<float> ones({3, 3}, 1.0F);
  const std::string rendered = terminal(ones.cview(), labelled({"我", "阅读", "书"}));
  const std::string expected =
      "     我 阅读 书\n"
      "我   ██ ████ ██\n"
      "阅读 ██ ████ ██\n"
      "书   ██ ████ ██\n"
      "scale: 0.000 [ ░▒▓█] 1.000\n";
  EXPECT_EQ(rendered, expected);
  const std::vector<std::string> lines = lines_of(rendered);
  for (size_t i = 1; i <= 3; ++i) EXPECT_EQ(display_width(lines[i]), display_width(lines[0])) << lines[i];
}

TEST(TerminalHeatmap, MixedScriptLabelsAlign) {
  const Tensor<float> ones({2, 3}, 1.0F);
  HeatmapOptions options;
  options.row_labels = {"I", "書を"};
  options.col_labels = {"read", "本", "ｂｏｏｋ"};
  const std::vector<std::string> lines = lines_of(terminal(ones.cview(), options));
  ASSERT_EQ(lines.size(), 4U);
  EXPECT_EQ(lines[0], "     read 本 ｂｏｏｋ");
  EXPECT_EQ(display_width(lines[1]), display_width(lines[0]));
  EXPECT_EQ(display_width(lines[2]), display_width(lines[0]));
}

TEST(TerminalHeatmap, ColorUsesViridisBackgrounds) {
  HeatmapOptions options = labelled({"the", "cat", "sat"});
  options.terminal.color = TerminalColor::truecolor;
  const std::string rendered = terminal(three_by_three().cview(), options);
  // α = 1 takes the top of the map and α = 0 its bottom.
  EXPECT_NE(rendered.find("\x1b[48;2;253;231;37m"), std::string::npos);
  EXPECT_NE(rendered.find("\x1b[48;2;68;1;84m"), std::string::npos);
  EXPECT_NE(rendered.find("\x1b[0m"), std::string::npos);
  EXPECT_EQ(rendered.find("█"), std::string::npos);

  options.terminal.color = TerminalColor::palette256;
  const std::string cube = terminal(three_by_three().cview(), options);
  EXPECT_NE(cube.find("\x1b[48;5;"), std::string::npos);
  EXPECT_EQ(cube.find("\x1b[48;2;"), std::string::npos);

  options.terminal.color = TerminalColor::none;
  EXPECT_EQ(terminal(three_by_three().cview(), options).find('\x1b'), std::string::npos);
}

TEST(TerminalHeatmap, ColorValuesContrastWithTheirBackground) {
  HeatmapOptions options = labelled({"a", "b", "c"});
  options.terminal.color = TerminalColor::truecolor;
  options.annotate = true;
  const std::string rendered = terminal(three_by_three().cview(), options);
  // Black on viridis' yellow end, bright white on its purple end.
  EXPECT_NE(rendered.find("\x1b[48;2;253;231;37m\x1b[30m 1.000\x1b[0m"), std::string::npos) << rendered;
  EXPECT_NE(rendered.find("\x1b[48;2;68;1;84m\x1b[97m 0.000\x1b[0m"), std::string::npos) << rendered;
}

TEST(TerminalHeatmap, LabelsCannotInjectEscapes) {
  HeatmapOptions options;
  options.row_labels = {"a\x1b[31m", "b\xff"};
  options.col_labels = {"x", "y"};
  const Tensor<float> alpha({2, 2}, 0.5F);
  const std::string rendered = terminal(alpha.cview(), options);
  EXPECT_EQ(rendered.find('\x1b'), std::string::npos);
  EXPECT_NE(rendered.find("a?[31m"), std::string::npos);
  EXPECT_NE(rendered.find("b\uFFFD"), std::string::npos);
}

TEST(TerminalHeatmap, MissingLabelsAreNumbered) {
  const Tensor<float> alpha({2, 3}, 1.0F);
  HeatmapOptions options;
  options.terminal.legend = false;
  EXPECT_EQ(terminal(alpha.cview(), options),
            "   0  1  2\n"
            "0 ██ ██ ██\n"
            "1 ██ ██ ██\n");
}

// The terminal refuses what every format refuses, in the same words (tests/viz/test_heatmap.cpp):
// label lists of the wrong length and an alpha that is not [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk].
TEST(TerminalHeatmap, LabelCountsMustMatchTheAxes) {
  const Tensor<float> alpha({3, 4});
  HeatmapOptions options;
  options.row_labels = {"a", "b"};
  options.col_labels = {"w", "x", "y", "z"};
  EXPECT_TRUE(testing::throws_naming<ShapeError>([&] { terminal(alpha.cview(), options); },
                                                 {"row_labels: expected 3 labels", "got 2"}));
  options.row_labels = {"a", "b", "c"};
  options.col_labels = {"w", "x", "y", "z", "extra"};
  EXPECT_TRUE(testing::throws_naming<ShapeError>([&] { terminal(alpha.cview(), options); },
                                                 {"col_labels: expected 4 labels", "got 5"}));
}

TEST(TerminalHeatmap, AlphaMustBeAMatrixOrHeads) {
  const Tensor<float> alpha({3});
  EXPECT_TRUE(testing::throws_naming<ShapeError>([&] { terminal(alpha.cview(), {}); }, {"alpha", "[3]"}));
}

TEST(TerminalHeatmap, RefusesBadOptions) {
  const Tensor<float> alpha = three_by_three();
  HeatmapOptions options;
  options.terminal.decimals = 10;
  EXPECT_THROW(terminal(alpha.cview(), options), ValueError);
  options.terminal.decimals = -1;
  EXPECT_THROW(terminal(alpha.cview(), options), ValueError);
  options = {};
  options.vmax = 0.0;  // not above the default vmin of 0
  EXPECT_THROW(terminal(alpha.cview(), options), ValueError);
  options.vmax = std::nan("");
  EXPECT_THROW(terminal(alpha.cview(), options), ValueError);
  options = {};
  options.vmin = -kInf;
  EXPECT_THROW(terminal(alpha.cview(), options), ValueError);
}

TEST(TerminalHeatmap, GivenScaleMovesTheShades) {
  // With vmax = 2, α = 1 sits at the middle of the scale (▒) and nothing reaches █.
  HeatmapOptions options = labelled({"the", "cat", "sat"});
  options.vmax = 2.0;
  const std::string rendered = terminal(three_by_three().cview(), options);
  EXPECT_EQ(lines_of(rendered)[2], "cat     ▒▒▒");
  EXPECT_EQ(lines_of(rendered)[4], "scale: 0.000 [ ░▒▓█] 2.000");
}

TEST(TerminalHeatmap, NonFiniteCellsStayBlank) {
  // Scores of a causal mask: −inf above the diagonal. The scale comes from the finite values.
  const Tensor<float> scores({2, 2}, {-1.0F, -kInf, 0.5F, 1.0F});
  HeatmapOptions options = labelled({"a", "b"});
  options.annotate = true;
  options.terminal.decimals = 1;
  const std::string expected =
      "      a     b\n"
      "a  -1.0  -inf\n"
      "b ▓▓0.5 ██1.0\n"
      "scale: -1.0 [ ░▒▓█] 1.0\n";
  EXPECT_EQ(terminal(scores.cview(), options), expected);
  options.terminal.color = TerminalColor::palette256;
  const std::string colored = terminal(scores.cview(), options);
  EXPECT_NE(colored.find(" -inf"), std::string::npos);
}

TEST(TerminalHeatmap, SingleTokenAndEmptyMatrix) {
  const Tensor<float> one({1, 1}, 1.0F);
  EXPECT_EQ(terminal(one.cview(), labelled({"书"})), "   书\n书 ██\nscale: 0.000 [ ░▒▓█] 1.000\n");
  const Tensor<float> empty({0, 2});
  HeatmapOptions options;
  options.terminal.legend = false;
  EXPECT_EQ(terminal(empty.cview(), options), "  0  1\n");
}

// The columns a line takes on a terminal: escapes (ESC [ ... m) take none.
int64_t columns_of(std::string line) {
  for (size_t esc; (esc = line.find('\x1b')) != std::string::npos;) line.erase(esc, line.find('m', esc) - esc + 1);
  return display_width(line);
}

// A causal 3 × 3 α whose cell (2, 0) is a weight of 0 that no mask forced.
Tensor<float> causal_three() { return Tensor<float>({3, 3}, {1.0F, 0.0F, 0.0F, 0.5F, 0.5F, 0.0F, 0.0F, 0.5F, 0.5F}); }
Tensor<uint8_t> causal_mask() { return Tensor<uint8_t>({3, 3}, {1, 0, 0, 1, 1, 0, 1, 1, 1}); }

TEST(TerminalHeatmap, MaskedCellsAreDotsNotZeroWeights) {
  const Tensor<float> alpha = causal_three();
  const Tensor<uint8_t> mask = causal_mask();
  HeatmapOptions options;
  options.allowed = mask.cview();
  // The unmasked 0 of row 2 is a blank shade; the masked cells are '·'.
  const std::string expected =
      "   0  1  2\n"
      "0 ██  ·  ·\n"
      "1 ▒▒ ▒▒  ·\n"
      "2    ▒▒ ▒▒\n"
      "scale: 0.000 [ ░▒▓█] 1.000, · masked\n";
  EXPECT_EQ(terminal(alpha.cview(), options), expected);

  options.annotate = true;
  options.terminal.decimals = 2;
  const std::vector<std::string> lines = lines_of(terminal(alpha.cview(), options));
  ASSERT_EQ(lines.size(), 5U);
  EXPECT_EQ(lines[1], "0 █1.00     ·     ·") << "masked cells carry no value";
  EXPECT_NE(lines[3].find("0.00"), std::string::npos) << "the unmasked 0 keeps its value: " << lines[3];

  options.terminal.color = TerminalColor::truecolor;
  const std::string colored = terminal(alpha.cview(), options);
  EXPECT_EQ(lines_of(colored)[1].substr(lines_of(colored)[1].size() - 2), "·") << "no background on a masked cell";
}

TEST(TerminalHeatmap, MaskMustBroadcastToAlpha) {
  const Tensor<float> alpha = causal_three();
  const Tensor<uint8_t> rows({3, 1}, {1, 1, 0});
  HeatmapOptions options;
  options.allowed = rows.cview();
  EXPECT_NE(terminal(alpha.cview(), options).find("2  ·  ·  ·"), std::string::npos) << "a [3, 1] mask masks row 2";
  const Tensor<uint8_t> wrong({2, 2}, {1, 1, 1, 1});
  options.allowed = wrong.cview();
  EXPECT_THROW(
      {
        try {
          terminal(alpha.cview(), options);
        } catch (const ShapeError& e) {
          EXPECT_NE(std::string(e.what()).find("allowed"), std::string::npos) << e.what();
          throw;
        }
      },
      ShapeError);
}

TEST(TerminalHeatmap, ScaleLineMarksClippedEnds) {
  const Tensor<float> alpha = three_by_three();
  HeatmapOptions options;
  EXPECT_EQ(lines_of(terminal(alpha.cview(), options)).back(), "scale: 0.000 [ ░▒▓█] 1.000");
  options.vmax = 0.5;
  EXPECT_EQ(lines_of(terminal(alpha.cview(), options)).back(), "scale: 0.000 [ ░▒▓█] ≥0.500");
  options.vmax = 1.5;
  EXPECT_EQ(lines_of(terminal(alpha.cview(), options)).back(), "scale: 0.000 [ ░▒▓█] 1.500") << "nothing clipped";
  // A masked value above vmax is no weight, and clips nothing.
  const Tensor<float> masked_big({1, 2}, {0.4F, 0.9F});
  const Tensor<uint8_t> mask({1, 2}, {1, 0});
  HeatmapOptions masked;
  masked.vmax = 0.5;
  masked.allowed = mask.cview();
  EXPECT_EQ(lines_of(terminal(masked_big.cview(), masked)).back(), "scale: 0.000 [ ░▒▓█] 0.500, · masked");
}

TEST(TerminalHeatmap, ScaleOptionMovesTheShades) {
  // 0.25 of vmax: the second shade (░) on a linear scale, the middle (▒, t = 0.5) under sqrt.
  const Tensor<float> alpha({1, 2}, {0.25F, 1.0F});
  HeatmapOptions options;
  EXPECT_EQ(lines_of(terminal(alpha.cview(), options))[1], "0 ░░ ██");
  options.scale = HeatmapScale::sqrt;
  EXPECT_EQ(lines_of(terminal(alpha.cview(), options))[1], "0 ▒▒ ██");
  // 0.01 of vmax under log: t = log10(10.99) / 3 = 0.347, the second shade; linear leaves it blank.
  const Tensor<float> small({1, 2}, {0.01F, 1.0F});
  options.scale = HeatmapScale::log;
  EXPECT_EQ(lines_of(terminal(small.cview(), options))[1], "0 ░░ ██");
  options.scale = HeatmapScale::linear;
  EXPECT_EQ(lines_of(terminal(small.cview(), options))[1], "0    ██");
}

// [tq, tk] of values that take every shade.
Tensor<float> ramp(int64_t tq, int64_t tk) {
  Tensor<float> alpha({tq, tk});
  for (int64_t n = 0; n < tq * tk; ++n) alpha[n] = static_cast<float>(n % 7) / 7.0F;
  return alpha;
}

std::vector<std::string> numbered(const std::string& prefix, int64_t n) {
  std::vector<std::string> labels;
  for (int64_t i = 0; i < n; ++i) labels.push_back(prefix + std::to_string(i));
  return labels;
}

// Every line of `text` takes at most `width` columns; the widest.
int64_t widest_line(const std::string& text) {
  int64_t widest = 0;
  for (const std::string& line : lines_of(text)) widest = std::max(widest, columns_of(line));
  return widest;
}

TEST(TerminalHeatmap, WideGridsFitTheWidthWithAWindowOfKeys) {
  const Tensor<float> alpha = ramp(100, 100);
  HeatmapOptions options = labelled(numbered("k", 100));
  const std::string whole = terminal(alpha.cview(), options);
  EXPECT_GT(widest_line(whole), 300) << "without a width the grid is as wide as its labels";
  for (const int64_t width : {80, 60, 40}) {
    options.terminal.max_width = width;
    for (const TerminalColor color : {TerminalColor::none, TerminalColor::truecolor}) {
      options.terminal.color = color;
      const std::string text = terminal(alpha.cview(), options);
      EXPECT_LE(widest_line(text), width) << text;
      // Row labels ("k99") take 3 columns, each key one: the keys beyond the width are left out.
      const int64_t shown = width - 3;
      EXPECT_NE(text.find(fmt::format("(keys 0–{} of 100 shown", shown - 1)), std::string::npos) << text;
      const std::vector<std::string> lines = lines_of(text);
      EXPECT_EQ(std::ranges::count_if(lines, [](const std::string& line) { return line.starts_with("k"); }), 100);
      EXPECT_FALSE(lines[0].ends_with(" …") || lines[0].ends_with("k…")) << "a label cut to nothing: " << lines[0];
      // Coloured lines keep their blanks: a row fills the width exactly.
      if (color != TerminalColor::none) {
        EXPECT_EQ(columns_of(lines[1]), width) << lines[1];
      }
    }
  }
}

TEST(TerminalHeatmap, GridsThatFitNarrowerCellsAreDrawnWhole) {
  // 30 keys: three columns a key do not fit 80, two do; labels are cut and thinned, every key shown.
  const Tensor<float> alpha = ramp(30, 30);
  HeatmapOptions options = labelled(numbered("tok", 30));
  options.terminal.max_width = 80;
  const std::string text = terminal(alpha.cview(), options);
  EXPECT_LE(widest_line(text), 80) << text;
  EXPECT_NE(text.find("(fitted to 80 columns: key labels cut and thinned)"), std::string::npos) << text;
  EXPECT_EQ(text.find("shown"), std::string::npos) << text;
  const std::vector<std::string> lines = lines_of(text);
  EXPECT_EQ(lines[0].rfind("     tok0", 0), 0U) << "labels start at their key's column: " << lines[0];
  options.terminal.color = TerminalColor::truecolor;
  EXPECT_EQ(columns_of(lines_of(terminal(alpha.cview(), options))[1]), 5 + 30 * 2) << "two columns a key, no gap";
}

TEST(TerminalHeatmap, CjkLabelsAndTitlesFitByColumns) {
  const Tensor<float> alpha = ramp(40, 40);
  HeatmapOptions options = labelled(numbered("书书书书书书", 40));
  options.title = std::string(30, 'x') + " " + "注意力权重注意力权重注意力权重注意力权重注意力权重";
  options.annotate = true;
  options.terminal.decimals = 2;
  options.terminal.max_width = 50;
  const std::string text = terminal(alpha.cview(), options);
  EXPECT_LE(widest_line(text), 50) << text;
  // A row label of 14 columns is cut to a quarter of 50 (12), with "…".
  EXPECT_NE(text.find("\n书书书书书…"), std::string::npos) << text;
  EXPECT_NE(text.find("(keys 0–"), std::string::npos) << text;
}

TEST(TerminalHeatmap, GridsThatFitAreUnchangedByAWidth) {
  const Tensor<float> alpha = three_by_three();
  const HeatmapOptions options = labelled({"the", "cat", "sat"});
  HeatmapOptions fitted = options;
  fitted.terminal.max_width = 40;
  EXPECT_EQ(terminal(alpha.cview(), fitted), terminal(alpha.cview(), options));
  fitted.terminal.max_width = 39;
  EXPECT_THROW(terminal(alpha.cview(), fitted), ValueError);
}

TEST(Viridis, EndsAndMiddle) {
  EXPECT_EQ(viridis(0.0), (Rgb{68, 1, 84}));
  EXPECT_EQ(viridis(1.0), (Rgb{253, 231, 37}));
  EXPECT_EQ(viridis(0.5), (Rgb{33, 144, 140}));
  EXPECT_EQ(viridis(-3.0), viridis(0.0));
  EXPECT_EQ(viridis(7.0), viridis(1.0));
  EXPECT_EQ(viridis(std::nan("")), viridis(0.0));
}

TEST(Viridis, LightnessGrowsAlongTheMap) {
  // What makes viridis readable in grey: its luma rises monotonically from 0 to 1.
  double previous = -1.0;
  for (int k = 0; k <= 256; ++k) {
    const Rgb c = viridis(k / 256.0);
    const double luma = 0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b;
    EXPECT_GE(luma, previous - 0.5) << "t = " << k / 256.0;
    previous = luma;
  }
}

TEST(TerminalDetection, HonoursNoColorTermAndTty) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  {
    const ScopedEnv no_color("NO_COLOR", nullptr);
    const ScopedEnv term("TERM", "xterm-256color");
    EXPECT_FALSE(terminal_supports_color(file));  // a file is not a terminal
  }
  {
    const ScopedEnv no_color("NO_COLOR", "1");
    const ScopedEnv term("TERM", "xterm-256color");
    EXPECT_FALSE(terminal_supports_color(stdout));
  }
  {
    const ScopedEnv no_color("NO_COLOR", nullptr);
    const ScopedEnv term("TERM", "dumb");
    EXPECT_FALSE(terminal_supports_color(stdout));
  }
  {
    const ScopedEnv no_color("NO_COLOR", nullptr);
    const ScopedEnv term("TERM", nullptr);
    EXPECT_FALSE(terminal_supports_color(stdout));
  }
  std::fclose(file);
}

TEST(TerminalDetection, TruecolorFromColorterm) {
  {
    const ScopedEnv colorterm("COLORTERM", "truecolor");
    EXPECT_TRUE(terminal_supports_truecolor());
  }
  {
    const ScopedEnv colorterm("COLORTERM", "24bit");
    EXPECT_TRUE(terminal_supports_truecolor());
  }
  {
    const ScopedEnv colorterm("COLORTERM", "");
    EXPECT_FALSE(terminal_supports_truecolor());
  }
  {
    const ScopedEnv colorterm("COLORTERM", nullptr);
    EXPECT_FALSE(terminal_supports_truecolor());
  }
}

}  // namespace
}  // namespace qkv
