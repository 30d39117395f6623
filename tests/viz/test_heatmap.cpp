// Tests of the colour maps (src/viz/colormap.cpp) and the file heatmaps (src/heatmap*.cpp): PNGs are
// decoded and the colour at the centre of cells compared with the colour map's colour for the
// cell's value; label, title and colour-bar regions must hold ink; layouts stay within the image
// and never overlap up to T = 1024; SVGs have one <rect> per cell; pages carry their data as
// escaped JSON; every refusal names its argument.

#include <cairo.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "qkv/core/text.hpp"
#include "qkv/viz/colormap.hpp"
#include "qkv/viz/heatmap.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using testing::throws_naming;

// ---- helpers ------------------------------------------------------------------------------------

// α rows: a softmax of random scores, so every row sums to 1 (up to float32 rounding).
Tensor<float> softmax_rows(const Shape& shape, uint64_t seed, double spread = 2.0) {
  Rng rng(seed);
  Tensor<float> alpha = testing::random_tensor<float>(shape, rng, spread);
  const int64_t tk = shape.from_back(1);
  for (int64_t r = 0; r < alpha.numel() / tk; ++r) {
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < tk; ++j) max = std::max(max, static_cast<double>(alpha[r * tk + j]));
    double sum = 0.0;
    for (int64_t j = 0; j < tk; ++j) sum += std::exp(alpha[r * tk + j] - max);
    for (int64_t j = 0; j < tk; ++j) alpha[r * tk + j] = static_cast<float>(std::exp(alpha[r * tk + j] - max) / sum);
  }
  return alpha;
}

// A decoded PNG.
class Image {
 public:
  explicit Image(const std::string& png) {
    struct Reader {
      const std::string* bytes;
      size_t offset = 0;
    } reader{&png};
    cairo_surface_t* surface = cairo_image_surface_create_from_png_stream(
        [](void* closure, unsigned char* data, unsigned int length) {
          auto* r = static_cast<Reader*>(closure);
          if (r->offset + length > r->bytes->size()) return CAIRO_STATUS_READ_ERROR;
          std::copy_n(r->bytes->data() + r->offset, length, data);
          r->offset += length;
          return CAIRO_STATUS_SUCCESS;
        },
        &reader);
    status_ = cairo_surface_status(surface);
    if (status_ == CAIRO_STATUS_SUCCESS) {
      width_ = cairo_image_surface_get_width(surface);
      height_ = cairo_image_surface_get_height(surface);
      const int stride = cairo_image_surface_get_stride(surface);
      const unsigned char* data = cairo_image_surface_get_data(surface);
      pixels_.resize(static_cast<size_t>(width_) * static_cast<size_t>(height_));
      for (int y = 0; y < height_; ++y) {
        const auto* row = reinterpret_cast<const uint32_t*>(data + static_cast<ptrdiff_t>(y) * stride);
        std::copy_n(row, width_, pixels_.begin() + static_cast<ptrdiff_t>(y) * width_);
      }
    }
    cairo_surface_destroy(surface);
  }

  bool ok() const { return status_ == CAIRO_STATUS_SUCCESS; }
  int64_t width() const { return width_; }
  int64_t height() const { return height_; }
  Rgb at(int64_t x, int64_t y) const {
    const uint32_t p = pixels_[static_cast<size_t>(y * width_ + x)];
    return {static_cast<uint8_t>(p >> 16), static_cast<uint8_t>(p >> 8), static_cast<uint8_t>(p)};
  }
  // Pixels of the rectangle that are not the white background.
  int64_t ink(const PixelRect& r) const {
    int64_t count = 0;
    for (int64_t y = r.y; y < r.y + r.height; ++y)
      for (int64_t x = r.x; x < r.x + r.width; ++x) count += at(x, y) == Rgb{255, 255, 255} ? 0 : 1;
    return count;
  }

 private:
  cairo_status_t status_ = CAIRO_STATUS_NULL_POINTER;
  int width_ = 0;
  int height_ = 0;
  std::vector<uint32_t> pixels_;
};

std::string str(Rgb c) { return fmt::format("({}, {}, {})", c.r, c.g, c.b); }

int channel_distance(Rgb a, Rgb b) { return std::max({std::abs(a.r - b.r), std::abs(a.g - b.g), std::abs(a.b - b.b)}); }

Rgb expected_color(const HeatmapLayout& layout, Colormap map, double value) {
  return colormap_at(map, std::clamp((value - layout.vmin) / (layout.vmax - layout.vmin), 0.0, 1.0));
}

// Every cell's centre pixel has the colour map's colour for its value; returns the count checked.
int64_t check_cell_centres(const Image& image, const HeatmapLayout& layout, const HeatmapPanelLayout& panel,
                           const Tensor<float>& matrix, Colormap map, int64_t stride = 1) {
  const int64_t tk = matrix.shape()[1];
  int64_t checked = 0;
  for (int64_t i = 0; i < matrix.shape()[0]; i += stride) {
    for (int64_t j = 0; j < tk; j += stride) {
      const int64_t x = panel.matrix.x + j * panel.cell_width + panel.cell_width / 2;
      const int64_t y = panel.matrix.y + i * panel.cell_height + panel.cell_height / 2;
      const Rgb want = expected_color(layout, map, matrix[i * tk + j]);
      EXPECT_EQ(image.at(x, y), want) << "cell [" << i << ", " << j << "] at (" << x << ", " << y << "): got "
                                      << str(image.at(x, y)) << ", expected " << str(want);
      ++checked;
    }
  }
  return checked;
}

void expect_inside(const PixelRect& r, const HeatmapLayout& layout, std::string_view what) {
  EXPECT_GE(r.x, 0) << what;
  EXPECT_GE(r.y, 0) << what;
  EXPECT_LE(r.x + r.width, layout.width) << what;
  EXPECT_LE(r.y + r.height, layout.height) << what;
}

bool overlap(const PixelRect& a, const PixelRect& b) {
  return a.width > 0 && b.width > 0 && a.height > 0 && b.height > 0 && a.x < b.x + b.width && b.x < a.x + a.width &&
         a.y < b.y + b.height && b.y < a.y + a.height;
}

// The [Tq, Tk] matrix of head h of alpha [H, Tq, Tk].
Tensor<float> head_of(const Tensor<float>& alpha, int64_t h) {
  const int64_t tq = alpha.shape()[1];
  const int64_t tk = alpha.shape()[2];
  std::vector<float> values(alpha.values().begin() + h * tq * tk, alpha.values().begin() + (h + 1) * tq * tk);
  return Tensor<float>({tq, tk}, values);
}

size_t count(const std::string& text, std::string_view needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
  return n;
}

// ---- colour maps ----------------------------------------------------------------------------------

TEST(Colormap, EndsAndMiddles) {
  EXPECT_EQ(colormap_at(Colormap::viridis, 0.0), (Rgb{68, 1, 84}));
  EXPECT_EQ(colormap_at(Colormap::viridis, 1.0), (Rgb{253, 231, 37}));
  EXPECT_EQ(colormap_at(Colormap::magma, 0.0), (Rgb{0, 0, 4}));
  EXPECT_EQ(colormap_at(Colormap::magma, 1.0), (Rgb{252, 253, 191}));
  EXPECT_EQ(colormap_at(Colormap::magma, 0.5), (Rgb{182, 55, 121}));
  EXPECT_EQ(colormap_at(Colormap::gray, 0.0), (Rgb{0, 0, 0}));
  EXPECT_EQ(colormap_at(Colormap::gray, 0.5), (Rgb{128, 128, 128}));
  EXPECT_EQ(colormap_at(Colormap::gray, 1.0), (Rgb{255, 255, 255}));
  EXPECT_EQ(viridis(0.5), colormap_at(Colormap::viridis, 0.5));
  for (const Colormap map : kColormaps) {
    EXPECT_EQ(colormap_at(map, -1.0), colormap_at(map, 0.0));
    EXPECT_EQ(colormap_at(map, 2.0), colormap_at(map, 1.0));
    EXPECT_EQ(colormap_at(map, std::nan("")), colormap_at(map, 0.0));
  }
}

TEST(Colormap, SamplesAreWhatTheMapInterpolates) {
  for (const Colormap map : kColormaps) {
    const auto samples = colormap_samples(map);
    for (int k = 0; k < kColormapSamples; ++k) {
      EXPECT_EQ(colormap_at(map, k / 32.0), samples[static_cast<size_t>(k)]) << colormap_name(map) << " k = " << k;
    }
  }
}

// CIE L* (0 black to 100 white) of an sRGB colour: the lightness a reader perceives.
double lightness(Rgb c) {
  const auto linear = [](uint8_t v) {
    const double x = v / 255.0;
    return x <= 0.04045 ? x / 12.92 : std::pow((x + 0.055) / 1.055, 2.4);
  };
  const double y = 0.2126 * linear(c.r) + 0.7152 * linear(c.g) + 0.0722 * linear(c.b);
  const double f = y > 216.0 / 24389.0 ? std::cbrt(y) : (24389.0 / 27.0 * y + 16.0) / 116.0;
  return 116.0 * f - 16.0;
}

TEST(Colormap, LightnessRisesAlongEveryMap) {
  // What keeps a heatmap readable in grey and by colour-blind readers: perceived lightness grows
  // monotonically from 0 to 1. The tolerance, 0.5 L*, is half a just-noticeable difference (ΔE ≈ 1):
  // what rounding the channels to 8 bits may take back.
  for (const Colormap map : kColormaps) {
    if (colormap_is_diverging(map)) continue;
    double previous = -1.0;
    for (int k = 0; k <= 512; ++k) {
      const double l = lightness(colormap_at(map, k / 512.0));
      EXPECT_GE(l, previous - 0.5) << colormap_name(map) << " t = " << k / 512.0;
      previous = l;
    }
    EXPECT_GT(lightness(colormap_at(map, 1.0)) - lightness(colormap_at(map, 0.0)), 60.0) << colormap_name(map);
  }
}

TEST(Colormap, DivergingMapsAreLightestInTheMiddleAndEvenAtTheEnds) {
  // What lets a signed matrix read fairly: a value and its negative are about as far from the
  // light middle, and lightness falls monotonically away from it on both sides.
  for (const Colormap map : kColormaps) {
    if (!colormap_is_diverging(map)) continue;
    double previous = -1.0;
    for (int k = 0; k <= 256; ++k) {
      const double l = lightness(colormap_at(map, k / 512.0));
      EXPECT_GE(l, previous - 0.5) << colormap_name(map) << " t = " << k / 512.0;
      previous = l;
    }
    for (int k = 256; k <= 512; ++k) {
      const double l = lightness(colormap_at(map, k / 512.0));
      EXPECT_LE(l, previous + 0.5) << colormap_name(map) << " t = " << k / 512.0;
      previous = l;
    }
    EXPECT_NEAR(lightness(colormap_at(map, 0.0)), lightness(colormap_at(map, 1.0)), 8.0) << colormap_name(map);
    EXPECT_GT(lightness(colormap_at(map, 0.5)) - lightness(colormap_at(map, 0.0)), 30.0) << colormap_name(map);
  }
}

TEST(HeatmapLayout, ADivergingMapCentresTheScaleOnZero) {
  const Tensor<float> scores({2, 2}, {-0.5F, 2.0F, 0.25F, -1.0F});
  HeatmapOptions options;
  options.colormap = Colormap::coolwarm;
  const HeatmapLayout layout = heatmap_layout(scores.cview(), options);
  EXPECT_EQ(layout.vmin, -2.0);
  EXPECT_EQ(layout.vmax, 2.0);
  options.vmin = -4.0;
  EXPECT_EQ(heatmap_layout(scores.cview(), options).vmin, -4.0);
  options.colormap = Colormap::viridis;
  options.vmin.reset();
  EXPECT_EQ(heatmap_layout(scores.cview(), options).vmin, -1.0);
}

TEST(Colormap, NamesRoundTripAndUnknownNamesAreRefused) {
  for (const Colormap map : kColormaps) EXPECT_EQ(parse_colormap(colormap_name(map), "--cmap"), map);
  EXPECT_TRUE(throws_naming<ValueError>([] { parse_colormap("jet", "--cmap"); },
                                        {"--cmap: expected viridis, magma, gray or coolwarm, got jet"}));
}

TEST(Colormap, TerminalGridUsesTheChosenMap) {
  const Tensor<float> alpha({1, 2}, {0.0F, 1.0F});
  HeatmapOptions options;
  options.terminal.color = TerminalColor::truecolor;
  options.colormap = Colormap::magma;
  const std::string grid = render_heatmap(alpha.cview(), HeatmapFormat::terminal, options);
  EXPECT_NE(grid.find("\x1b[48;2;0;0;4m"), std::string::npos);
  EXPECT_NE(grid.find("\x1b[48;2;252;253;191m"), std::string::npos);
  EXPECT_EQ(grid.find("\x1b[48;2;253;231;37m"), std::string::npos);  // no viridis
}

// ---- small pieces ------------------------------------------------------------------------------------

TEST(HeatmapFormat, FromTheExtension) {
  EXPECT_EQ(heatmap_format_for_path("a.png", "-o"), HeatmapFormat::png);
  EXPECT_EQ(heatmap_format_for_path("dir/a.PNG", "-o"), HeatmapFormat::png);
  EXPECT_EQ(heatmap_format_for_path("a.svg", "-o"), HeatmapFormat::svg);
  EXPECT_EQ(heatmap_format_for_path("a.pdf", "-o"), HeatmapFormat::pdf);
  EXPECT_EQ(heatmap_format_for_path("a.html", "-o"), HeatmapFormat::html);
  EXPECT_EQ(heatmap_format_for_path("a.htm", "-o"), HeatmapFormat::html);
  EXPECT_TRUE(
      throws_naming<ValueError>([] { heatmap_format_for_path("attention.jpg", "-o"); },
                                {"-o: expected a file ending in .png, .svg, .pdf or .html, got attention.jpg"}));
  EXPECT_TRUE(throws_naming<ValueError>([] { heatmap_format_for_path("attention", "--heatmap"); },
                                        {"--heatmap:", "got attention"}));
  EXPECT_EQ(heatmap_format_name(HeatmapFormat::svg), "SVG");
}

// ---- checking α ---------------------------------------------------------------------------------------

TEST(CheckAttentionWeights, SoftmaxRowsPass) {
  const Tensor<float> alpha = softmax_rows({2, 3, 7, 113}, 1);
  const AttentionWeightsReport report = check_attention_weights(alpha.cview(), "ALPHA");
  EXPECT_EQ(report.rows, 2 * 3 * 7);
  EXPECT_EQ(report.rows_off, 0);
  EXPECT_EQ(report.rows_masked, 0);
}

TEST(CheckAttentionWeights, ReportsRowsOffOneAndMaskedRows) {
  const Tensor<float> alpha({3, 2}, {0.5F, 0.3F, 0.0F, 0.0F, 0.25F, 0.75F});
  const AttentionWeightsReport report = check_attention_weights(alpha.cview(), "ALPHA");
  EXPECT_EQ(report.rows_off, 1);
  EXPECT_EQ(report.rows_masked, 1);
  EXPECT_EQ(report.first_off, "row 0 sums to 0.8");
  const Tensor<float> heads({2, 2, 2}, {0.5F, 0.5F, 1.0F, 0.0F, 0.5F, 0.5F, 0.9F, 0.2F});
  EXPECT_EQ(check_attention_weights(heads.cview(), "ALPHA").first_off, "row [1, 1] sums to 1.1");
}

TEST(CheckAttentionWeights, ToleranceIsFloat32Rounding) {
  // Tk = 100 terms: a sum within 2 (Tk + 1) ε of 1 is float32 rounding, one beyond it is not.
  constexpr int64_t kTk = 100;
  const double eps = std::numeric_limits<float>::epsilon();
  Tensor<double> alpha({2, kTk}, 1.0 / kTk);
  alpha[0] += 1.5 * (kTk + 1) * eps;
  alpha[kTk] += 2.5 * (kTk + 1) * eps;
  const AttentionWeightsReport report = check_attention_weights(alpha.cview(), "w");
  EXPECT_EQ(report.rows_off, 1);
  EXPECT_EQ(report.first_off.rfind("row 1 ", 0), 0U) << report.first_off;
}

TEST(CheckAttentionWeights, RefusesNonFiniteAndNegativeWeights) {
  Tensor<float> alpha({2, 3}, 0.25F);
  alpha[4] = std::nanf("");
  alpha[5] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_naming<ValueError>([&] { check_attention_weights(alpha.cview(), "ALPHA"); },
                                        {"ALPHA: expected finite weights, got 2 non-finite values (the first: nan "
                                         "at [1, 1])"}));
  Tensor<float> negative({2, 2, 2}, 0.5F);
  negative[6] = -0.25F;
  EXPECT_TRUE(throws_naming<ValueError>([&] { check_attention_weights(negative.cview(), "ALPHA"); },
                                        {"ALPHA: expected weights >= 0, got 1 negative value (the first: -0.25 at "
                                         "[1, 1, 0])"}));
  const Tensor<float> vector({4}, 0.25F);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { check_attention_weights(vector.cview(), "ALPHA"); },
                                        {"ALPHA: expected shape [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk], got [4]"}));
}

// ---- layout ----------------------------------------------------------------------------------------------

TEST(HeatmapLayout, SixTokensGetLargeCellsAndEveryLabel) {
  const Tensor<float> alpha = softmax_rows({6, 6}, 2);
  HeatmapOptions options;
  options.row_labels = split_labels("the student is reading a book");
  options.col_labels = options.row_labels;
  options.title = "who looks at whom";
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  ASSERT_EQ(layout.panels.size(), 1U);
  const HeatmapPanelLayout& p = layout.panels[0];
  EXPECT_EQ(p.cell_width, 48);
  EXPECT_EQ(p.cell_height, 48);
  EXPECT_EQ(p.matrix.width, 6 * 48);
  EXPECT_EQ(p.row_label_step, 1);
  EXPECT_EQ(p.col_label_step, 1);
  EXPECT_TRUE(p.col_labels_rotated);  // "student" is wider than 48 px
  EXPECT_GT(layout.title.height, 0);
  EXPECT_EQ(p.caption.height, 0);
  for (const PixelRect& r : {p.matrix, p.row_labels, p.col_labels, layout.title, layout.colorbar,
                             layout.colorbar_labels, layout.row_axis_title, layout.col_axis_title}) {
    expect_inside(r, layout, "6×6");
  }
  EXPECT_LE(p.row_labels.x + p.row_labels.width, p.matrix.x);
  EXPECT_GE(p.col_labels.y, p.matrix.y + p.matrix.height);
  EXPECT_GE(layout.colorbar.x, p.matrix.x + p.matrix.width);
  EXPECT_GE(p.matrix.y, layout.title.y + layout.title.height);
  EXPECT_FALSE(overlap(p.matrix, p.row_labels) || overlap(p.matrix, p.col_labels) ||
               overlap(p.matrix, layout.colorbar) || overlap(p.row_labels, p.col_labels));
  EXPECT_EQ(layout.ticks.front(), 0.0);
  EXPECT_LE(layout.ticks.back(), layout.vmax);
  EXPECT_GE(layout.ticks.size(), 3U);
}

TEST(HeatmapLayout, ShortKeyLabelsStayUpright) {
  const Tensor<float> alpha = softmax_rows({6, 6}, 2);
  HeatmapOptions options;
  options.row_labels = split_labels("我 阅读 这 本 书 。");
  options.col_labels = options.row_labels;
  EXPECT_FALSE(heatmap_layout(alpha.cview(), options).panels[0].col_labels_rotated);
}

TEST(HeatmapLayout, LargeMatricesThinTheirLabelsAndStayReadable) {
  for (const int64_t t : {113, 128, 500, 1024}) {
    const Tensor<float> alpha = softmax_rows({t, t}, 3);
    const HeatmapLayout layout = heatmap_layout(alpha.cview(), {});
    const HeatmapPanelLayout& p = layout.panels[0];
    EXPECT_GE(p.cell_width, 1) << t;
    EXPECT_EQ(p.cell_width, p.cell_height) << t;
    EXPECT_LE(layout.width, 1400) << t;  // one screen
    EXPECT_LE(layout.height, 1400) << t;
    // Labelled rows are at least a 12 px line apart, and the steps are round numbers.
    EXPECT_GE(p.row_label_step * p.cell_height, 12) << t;
    EXPECT_GE(p.col_label_step * p.cell_width, 12) << t;
    const int64_t step = p.row_label_step;
    EXPECT_TRUE(step == 1 || step == 2 || step == 5 || step % 10 == 0) << step;
    EXPECT_LE(p.row_labels.width, 160);
    expect_inside(layout.colorbar_labels, layout, "colour bar labels");
    expect_inside(p.col_labels, layout, "key labels");
  }
}

TEST(HeatmapLayout, ThinMatricesGrowTheirShortSide) {
  const Tensor<float> alpha = softmax_rows({1, 1000}, 4);
  const HeatmapPanelLayout p = heatmap_layout(alpha.cview(), {}).panels[0];
  EXPECT_EQ(p.cell_width, 1);
  EXPECT_EQ(p.cell_height, 48);
}

TEST(HeatmapLayout, LongLabelsAreCut) {
  const Tensor<float> alpha = softmax_rows({2, 2}, 5);
  HeatmapOptions options;
  options.row_labels = {std::string(300, 'w'), "short"};
  options.col_labels = {"a", std::string(100, 'x') + "书"};
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  EXPECT_LE(layout.panels[0].row_labels.width, 160);
  EXPECT_LE(layout.panels[0].col_labels.height, 160);
}

TEST(HeatmapLayout, AnnotationsGrowTheCells) {
  const Tensor<float> alpha = softmax_rows({128, 128}, 6);
  HeatmapOptions options;
  options.annotate = true;
  const HeatmapPanelLayout p = heatmap_layout(alpha.cview(), options).panels[0];
  EXPECT_GE(p.cell_width, 28);  // "0.00" at 11 px
  EXPECT_GE(p.cell_height, 14);
}

TEST(HeatmapLayout, AllHeadsMakeAGridOfSmallMultiples) {
  const Tensor<float> alpha = softmax_rows({8, 12, 12}, 7);
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), {});
  ASSERT_EQ(layout.panels.size(), 8U);
  for (size_t k = 0; k < 8; ++k) {
    const HeatmapPanelLayout& p = layout.panels[k];
    const size_t column = k % 3;
    EXPECT_EQ(p.head, static_cast<int64_t>(k));
    EXPECT_EQ(p.cell_width, layout.panels[0].cell_width);
    EXPECT_GT(p.caption.height, 0);
    EXPECT_EQ(p.row_labels.width > 0, column == 0) << k;
    // Key labels under a panel only when no panel is below it: heads 5, 6 and 7 of a 3-column grid.
    EXPECT_EQ(p.col_labels.height > 0, k >= 5) << k;
    expect_inside(p.matrix, layout, "panel");
    for (size_t other = 0; other < k; ++other) {
      EXPECT_FALSE(overlap(p.matrix, layout.panels[other].matrix)) << k << " and " << other;
      EXPECT_FALSE(overlap(p.col_labels, layout.panels[other].matrix)) << k << " and " << other;
      EXPECT_FALSE(overlap(p.caption, layout.panels[other].col_labels)) << k << " and " << other;
    }
  }
  HeatmapOptions one;
  one.head = 3;
  const HeatmapLayout single = heatmap_layout(alpha.cview(), one);
  ASSERT_EQ(single.panels.size(), 1U);
  EXPECT_EQ(single.panels[0].head, 3);
}

TEST(HeatmapLayout, ScaleDefaultsAndOverrides) {
  const Tensor<float> alpha({2, 2}, {0.2F, 0.8F, 0.6F, 0.4F});
  HeatmapLayout layout = heatmap_layout(alpha.cview(), {});
  EXPECT_EQ(layout.vmin, 0.0);
  EXPECT_EQ(layout.vmax, static_cast<double>(0.8F));
  HeatmapOptions options;
  options.vmax = 1.0;
  layout = heatmap_layout(alpha.cview(), options);
  EXPECT_EQ(layout.vmax, 1.0);
  EXPECT_EQ(layout.ticks, (std::vector<double>{0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0}));
  const Tensor<float> zeros({2, 2}, 0.0F);
  layout = heatmap_layout(zeros.cview(), {});
  EXPECT_EQ(layout.vmin, 0.0);
  EXPECT_EQ(layout.vmax, 1.0);  // a flat figure still has a scale
}

TEST(HeatmapLayout, RefusesWhatItCannotDraw) {
  const Tensor<float> alpha = softmax_rows({2, 3, 4}, 8);
  HeatmapOptions options;
  options.row_labels = {"a", "b"};
  EXPECT_TRUE(throws_naming<ShapeError>([&] { heatmap_layout(alpha.cview(), options); },
                                        {"row_labels: expected 3 labels (one per query row of alpha [H, Tq, Tk] "
                                         "[2, 3, 4]), got 2"}));
  options = {};
  options.col_labels = {"a", "b", "c", "d", "e"};
  EXPECT_TRUE(throws_naming<ShapeError>([&] { heatmap_layout(alpha.cview(), options); },
                                        {"col_labels: expected 4 labels", "got 5"}));
  options = {};
  options.head = 2;
  EXPECT_TRUE(throws_naming<ShapeError>([&] { heatmap_layout(alpha.cview(), options); },
                                        {"head: expected 0 to 1 (alpha [H, Tq, Tk] [2, 3, 4]), got 2"}));
  options = {};
  options.batch = 1;
  EXPECT_TRUE(throws_naming<ShapeError>([&] { heatmap_layout(alpha.cview(), options); },
                                        {"batch: alpha [H, Tq, Tk] [2, 3, 4] has no batch dim, got batch 1"}));
  const Tensor<float> batched = softmax_rows({2, 1, 3, 3}, 9);
  options = {};
  options.batch = 2;
  EXPECT_TRUE(throws_naming<ShapeError>([&] { heatmap_layout(batched.cview(), options); },
                                        {"batch: expected 0 to 1", "got 2"}));
  const Tensor<float> matrix = softmax_rows({3, 3}, 10);
  options = {};
  options.head = 1;
  EXPECT_TRUE(throws_naming<ShapeError>([&] { heatmap_layout(matrix.cview(), options); },
                                        {"head: alpha [Tq, Tk] [3, 3] has no heads, got head 1"}));
  options = {};
  options.vmin = 0.5;
  options.vmax = 0.5;
  EXPECT_TRUE(throws_naming<ValueError>([&] { heatmap_layout(matrix.cview(), options); },
                                        {"vmin, vmax: expected vmin < vmax"}));
  options = {};
  options.vmax = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(throws_naming<ValueError>([&] { heatmap_layout(matrix.cview(), options); }, {"vmax: expected a finite"}));

  const Tensor<float> vector({3}, 0.5F);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { heatmap_layout(vector.cview(), {}); },
                                        {"alpha: expected shape [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk], got [3]"}));
  const Tensor<float> empty({0, 4});
  EXPECT_TRUE(throws_naming<ShapeError>([&] { heatmap_layout(empty.cview(), {}); }, {"alpha:", "[0, 4]"}));
  Tensor<float> nan = softmax_rows({3, 3}, 11);
  nan[5] = std::nanf("");
  EXPECT_TRUE(throws_naming<ValueError>([&] { heatmap_layout(nan.cview(), {}); },
                                        {"alpha: expected finite values, got nan at [1, 2]"}));
  const Tensor<float> huge({1500, 1500}, 0.001F);
  options = {};
  options.annotate = true;
  EXPECT_TRUE(throws_naming<ValueError>([&] { heatmap_layout(huge.cview(), options); },
                                        {"alpha: the image would be", "enlarged to hold their values", "32767"}));
}

// ---- PNG ------------------------------------------------------------------------------------------------

TEST(HeatmapPng, CellCentresHaveTheColourOfTheirValue) {
  const Tensor<float> alpha = softmax_rows({6, 6}, 12);
  for (const Colormap map : kColormaps) {
    HeatmapOptions options;
    options.colormap = map;
    options.row_labels = split_labels("the student is reading a book");
    options.col_labels = options.row_labels;
    options.title = "α";
    const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
    ASSERT_TRUE(image.ok());
    const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
    EXPECT_EQ(image.width(), layout.width);
    EXPECT_EQ(image.height(), layout.height);
    EXPECT_EQ(check_cell_centres(image, layout, layout.panels[0], alpha, map), 36) << colormap_name(map);
  }
}

TEST(HeatmapPng, LabelsTitleAndColourBarHoldInk) {
  const Tensor<float> alpha = softmax_rows({6, 6}, 13);
  HeatmapOptions options;
  options.row_labels = split_labels("the student is reading a book");
  options.col_labels = options.row_labels;
  options.title = "who looks at whom";
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  const HeatmapPanelLayout& p = layout.panels[0];
  // Text is a few percent of its box's pixels: demand more than a stray pixel per label.
  EXPECT_GT(image.ink(p.row_labels), 6 * 20);
  EXPECT_GT(image.ink(p.col_labels), 6 * 20);
  EXPECT_GT(image.ink(layout.title), 100);
  EXPECT_GT(image.ink(layout.colorbar_labels), 3 * 10);
  EXPECT_GT(image.ink(layout.row_axis_title), 20);
  EXPECT_GT(image.ink(layout.col_axis_title), 20);
  EXPECT_EQ(image.ink(layout.colorbar), layout.colorbar.width * layout.colorbar.height);

  // The colour bar runs from the top of the scale down to its bottom, through the colour map.
  const Colormap map = Colormap::viridis;
  const int64_t x = layout.colorbar.x + layout.colorbar.width / 2;
  const int64_t top = layout.colorbar.y;
  const int64_t bottom = layout.colorbar.y + layout.colorbar.height - 1;
  EXPECT_LE(channel_distance(image.at(x, top), colormap_at(map, 1.0)), 3) << str(image.at(x, top));
  EXPECT_LE(channel_distance(image.at(x, bottom), colormap_at(map, 0.0)), 3) << str(image.at(x, bottom));
  for (int64_t y = top; y <= bottom; y += 7) {
    const double t = 1.0 - (static_cast<double>(y - top) + 0.5) / static_cast<double>(layout.colorbar.height);
    EXPECT_LE(channel_distance(image.at(x, y), colormap_at(map, t)), 3) << "y = " << y << ": " << str(image.at(x, y));
  }
  // Outside every region, the background stays white: the top-left margin.
  EXPECT_EQ(image.ink({.x = 0, .y = 0, .width = 8, .height = 8}), 0);
}

TEST(HeatmapPng, LargeMatricesAreDrawnPixelExact) {
  // Beyond 128 × 128 cells the matrix is one scaled image: its cells must still be exact.
  const Tensor<float> alpha = softmax_rows({200, 151}, 14, 4.0);
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, {}));
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), {});
  EXPECT_EQ(check_cell_centres(image, layout, layout.panels[0], alpha, Colormap::viridis), 200 * 151);
  const HeatmapPanelLayout& p = layout.panels[0];
  EXPECT_GT(image.ink(p.row_labels), 200);
  EXPECT_GT(image.ink(p.col_labels), 200);
}

TEST(HeatmapPng, T1024FitsOneImageWithOnePixelCells) {
  const Tensor<float> alpha = softmax_rows({1024, 1024}, 15, 4.0);
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, {}));
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), {});
  EXPECT_EQ(layout.panels[0].cell_width, 1);
  EXPECT_EQ(check_cell_centres(image, layout, layout.panels[0], alpha, Colormap::viridis, 7), 147 * 147);
  EXPECT_GT(image.ink(layout.panels[0].row_labels), 500);
}

TEST(HeatmapPng, GivenVmaxClampsTheTop) {
  const Tensor<float> alpha({2, 2}, {0.1F, 0.9F, 0.5F, 0.5F});
  HeatmapOptions options;
  options.vmax = 0.5;
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  check_cell_centres(image, layout, layout.panels[0], alpha, Colormap::viridis);
  const HeatmapPanelLayout& p = layout.panels[0];
  EXPECT_EQ(image.at(p.matrix.x + p.cell_width * 3 / 2, p.matrix.y + p.cell_height / 2), viridis(1.0));
}

TEST(HeatmapPng, GridPanelsShowTheirOwnHead) {
  const Tensor<float> alpha = softmax_rows({5, 7, 9}, 16);
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, {}));
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), {});
  ASSERT_EQ(layout.panels.size(), 5U);
  for (int64_t h = 0; h < 5; ++h) {
    check_cell_centres(image, layout, layout.panels[static_cast<size_t>(h)], head_of(alpha, h), Colormap::viridis);
    EXPECT_GT(image.ink(layout.panels[static_cast<size_t>(h)].caption), 20) << "caption of head " << h;
  }
}

TEST(HeatmapPng, AnnotationsWriteOnTheCells) {
  const Tensor<float> alpha = softmax_rows({4, 4}, 17);
  HeatmapOptions options;
  options.annotate = true;
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  const HeatmapPanelLayout& p = layout.panels[0];
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      const Rgb fill = expected_color(layout, Colormap::viridis, alpha[i * 4 + j]);
      const int64_t x0 = p.matrix.x + j * p.cell_width;
      const int64_t y0 = p.matrix.y + i * p.cell_height;
      EXPECT_EQ(image.at(x0 + 1, y0 + 1), fill);  // a corner keeps the cell's colour
      int64_t text = 0;
      for (int64_t y = y0; y < y0 + p.cell_height; ++y)
        for (int64_t x = x0; x < x0 + p.cell_width; ++x) text += image.at(x, y) == fill ? 0 : 1;
      EXPECT_GT(text, 20) << "cell [" << i << ", " << j << "] has no value written on it";
    }
  }
}

TEST(HeatmapPng, CjkLabelsHaveRealGlyphs) {
  // fonts-noto-cjk is installed with the build dependencies: every CJK label has its glyphs.
  EXPECT_TRUE(labels_without_glyphs({"我", "阅读", "这", "本", "书", "。", "the", "ｂｏｏｋ", "한국어"}).empty());
  // A private-use character has no glyph in any font: it is reported.
  EXPECT_EQ(labels_without_glyphs({"ok", "\U0010FFFD"}).size(), 1U);

  const Tensor<float> alpha = softmax_rows({2, 2}, 18);
  HeatmapOptions options;
  options.row_labels = {"阅读", "书"};
  options.col_labels = {"阅读", "书"};
  const std::string cjk = render_heatmap(alpha.cview(), HeatmapFormat::png, options);
  const Image image(cjk);
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  EXPECT_GT(image.ink(layout.panels[0].row_labels), 40);
  EXPECT_GT(image.ink(layout.panels[0].col_labels), 40);
  // Different characters draw differently (a missing glyph would draw the same box for both).
  options.row_labels = {"读阅", "书"};
  EXPECT_NE(render_heatmap(alpha.cview(), HeatmapFormat::png, options), cjk);
}

TEST(HeatmapPng, DoubleDrawsLikeFloat) {
  const Tensor<float> alpha = softmax_rows({3, 5}, 19);
  const Tensor<double> alpha64 = testing::cast<double>(alpha);
  EXPECT_EQ(render_heatmap(alpha64.cview(), HeatmapFormat::png, {}),
            render_heatmap(alpha.cview(), HeatmapFormat::png, {}));
}

// ---- SVG, PDF, HTML --------------------------------------------------------------------------------------

TEST(HeatmapSvg, OneRectPerCellWithItsExactValue) {
  const Tensor<float> alpha({2, 3}, {0.7F, 0.2F, 0.1F, 0.25F, 0.25F, 0.5F});
  HeatmapOptions options;
  options.row_labels = {"a<b", "c&d"};
  options.col_labels = {"x", "\"y\"", "书"};
  options.title = "</svg> & more";
  const std::string svg = render_heatmap(alpha.cview(), HeatmapFormat::svg, options);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0U);
  EXPECT_EQ(count(svg, "<rect "), 6U);
  EXPECT_NE(svg.find(R"(fill="#fde725"><title>a&lt;b → x: 0.7</title>)"), std::string::npos) << svg;
  EXPECT_NE(svg.find("<title>c&amp;d → &quot;y&quot;: 0.25</title>"), std::string::npos);
  EXPECT_NE(svg.find("&lt;/svg&gt; &amp; more"), std::string::npos);
  EXPECT_EQ(count(svg, "</svg>"), 1U);
  EXPECT_NE(svg.find(">书</text>"), std::string::npos);

  const Tensor<float> heads = softmax_rows({3, 4, 5}, 20);
  EXPECT_EQ(count(render_heatmap(heads.cview(), HeatmapFormat::svg, {}), "<rect "), 3U * 4 * 5);
  HeatmapOptions one;
  one.head = 1;
  EXPECT_EQ(count(render_heatmap(heads.cview(), HeatmapFormat::svg, one), "<rect "), 4U * 5);
}

TEST(HeatmapPng, MarkedCellsHaveARedFrameInsideTheCell) {
  const Tensor<float> alpha = softmax_rows({5, 7}, 23);
  HeatmapOptions options;
  options.marked_cells = {{1, 2}, {2, 2}, {4, 6}};
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
  ASSERT_TRUE(image.ok());
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  const HeatmapPanelLayout& p = layout.panels[0];
  ASSERT_GT(p.cell_width, 8);
  ASSERT_GT(p.cell_height, 8);
  const Rgb red{255, 0, 0};
  const Rgb white{255, 255, 255};
  // The outer two pixels of every side are red, the next one white, and the centre keeps its colour.
  const auto border = [&](int64_t i, int64_t j, int64_t inset) {
    const int64_t x0 = p.matrix.x + j * p.cell_width;
    const int64_t y0 = p.matrix.y + i * p.cell_height;
    const int64_t x1 = x0 + p.cell_width - 1;
    const int64_t y1 = y0 + p.cell_height - 1;
    const int64_t xm = x0 + p.cell_width / 2;
    const int64_t ym = y0 + p.cell_height / 2;
    return std::vector<Rgb>{image.at(xm, y0 + inset),         image.at(xm, y1 - inset),
                            image.at(x0 + inset, ym),         image.at(x1 - inset, ym),
                            image.at(x0 + inset, y0 + inset), image.at(x1 - inset, y1 - inset)};
  };
  for (const auto& [i, j] : options.marked_cells) {
    for (int64_t inset = 0; inset < 2; ++inset) {
      for (const Rgb c : border(i, j, inset)) EXPECT_EQ(c, red) << "cell [" << i << ", " << j << "]: " << str(c);
    }
    for (const Rgb c : border(i, j, 2)) EXPECT_EQ(c, white) << "cell [" << i << ", " << j << "]: " << str(c);
  }
  // Every other cell is its colour up to its edge, and the centres of all cells are untouched.
  for (int64_t i = 0; i < 5; ++i) {
    for (int64_t j = 0; j < 7; ++j) {
      if (std::ranges::find(options.marked_cells, std::pair<int64_t, int64_t>{i, j}) != options.marked_cells.end()) {
        continue;
      }
      const Rgb want = expected_color(layout, Colormap::viridis, alpha[i * 7 + j]);
      for (int64_t inset = 0; inset < 3; ++inset) {
        for (const Rgb c : border(i, j, inset)) {
          EXPECT_EQ(c, want) << "unmarked cell [" << i << ", " << j << "]: " << str(c);
        }
      }
    }
  }
  EXPECT_EQ(check_cell_centres(image, layout, p, alpha, Colormap::viridis), 5 * 7);
}

TEST(HeatmapPng, MarkedCellsOfEveryPanelAndOfTinyCells) {
  // A grid marks the cell in each head; one-pixel cells are filled red, as a frame would not fit.
  const Tensor<float> heads = softmax_rows({2, 3, 4}, 24);
  HeatmapOptions options;
  options.marked_cells = {{0, 3}};
  const Image grid(render_heatmap(heads.cview(), HeatmapFormat::png, options));
  const HeatmapLayout layout = heatmap_layout(heads.cview(), options);
  ASSERT_EQ(layout.panels.size(), 2U);
  for (const HeatmapPanelLayout& p : layout.panels) {
    EXPECT_EQ(grid.at(p.matrix.x + 3 * p.cell_width, p.matrix.y), (Rgb{255, 0, 0})) << "head " << p.head;
  }
  const Tensor<float> large = softmax_rows({1024, 1024}, 25);
  HeatmapOptions one;
  one.marked_cells = {{500, 600}};
  const Image image(render_heatmap(large.cview(), HeatmapFormat::png, one));
  const HeatmapPanelLayout p = heatmap_layout(large.cview(), one).panels[0];
  ASSERT_EQ(p.cell_width, 1);
  EXPECT_EQ(image.at(p.matrix.x + 600, p.matrix.y + 500), (Rgb{255, 0, 0}));
}

TEST(HeatmapPng, MarkedRowsAndColumnsAreFramedAlongTheirLength) {
  const Tensor<float> alpha = softmax_rows({5, 7}, 28);
  HeatmapOptions options;
  options.marked_rows = {3};
  options.marked_cols = {1};
  options.marked_cells = {{3, 1}};  // drawn over the row's and the column's frames
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
  ASSERT_TRUE(image.ok());
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  const HeatmapPanelLayout& p = layout.panels[0];
  const Rgb magenta{255, 0, 255};
  const Rgb cyan{0, 255, 255};
  const Rgb white{255, 255, 255};
  const int64_t row_top = p.matrix.y + 3 * p.cell_height;
  const int64_t row_bottom = row_top + p.cell_height - 1;
  const int64_t col_left = p.matrix.x + 1 * p.cell_width;
  const int64_t col_right = col_left + p.cell_width - 1;
  // The row's frame runs along its top and bottom edges through every column but the marked ones,
  // and closes at the matrix's left and right edges; one pixel inside it is the white lining.
  for (const int64_t j : {0, 2, 4, 6}) {
    const int64_t x = p.matrix.x + j * p.cell_width + p.cell_width / 2;
    EXPECT_EQ(image.at(x, row_top), magenta) << "column " << j << ": " << str(image.at(x, row_top));
    EXPECT_EQ(image.at(x, row_bottom), magenta) << "column " << j;
    EXPECT_EQ(image.at(x, row_top + 2), white) << "column " << j;
  }
  EXPECT_EQ(image.at(p.matrix.x, row_top + p.cell_height / 2), magenta);
  EXPECT_EQ(image.at(p.matrix.x + p.matrix.width - 1, row_top + p.cell_height / 2), magenta);
  for (const int64_t i : {0, 1, 2, 4}) {
    const int64_t y = p.matrix.y + i * p.cell_height + p.cell_height / 2;
    EXPECT_EQ(image.at(col_left, y), cyan) << "row " << i << ": " << str(image.at(col_left, y));
    EXPECT_EQ(image.at(col_right, y), cyan) << "row " << i;
  }
  // The marked cell's red frame is on top where all three meet.
  EXPECT_EQ(image.at(col_left + p.cell_width / 2, row_top), (Rgb{255, 0, 0}));
  // Cells away from the frames keep their colour at their centres.
  EXPECT_EQ(check_cell_centres(image, layout, p, alpha, Colormap::viridis), 5 * 7);
}

TEST(HeatmapLayout, TheKeyNamesEachKindOfMarkBelowTheMatrix) {
  const Tensor<float> alpha = softmax_rows({4, 4}, 29);
  HeatmapOptions options;
  options.marked_cells = {{0, 0}};
  options.marked_rows = {2};
  options.marked_cols = {3};
  const HeatmapLayout none = heatmap_layout(alpha.cview(), options);
  EXPECT_TRUE(none.key.empty()) << "no labels, no key";
  options.marked_cells_label = "gold alignment";
  options.marked_rows_label = "the pronoun";
  options.marked_cols_label = "its referent";
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  ASSERT_EQ(layout.key.size(), 3U);
  EXPECT_GT(layout.height, none.height) << "the key takes a line of its own";
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
  ASSERT_TRUE(image.ok());
  const std::vector<Rgb> colours = {{255, 0, 0}, {255, 0, 255}, {0, 255, 255}};
  for (size_t k = 0; k < layout.key.size(); ++k) {
    const HeatmapKeyEntry& entry = layout.key[k];
    expect_inside(entry.swatch, layout, "key swatch");
    expect_inside(entry.text, layout, "key text");
    EXPECT_GE(entry.swatch.y, layout.col_axis_title.y + layout.col_axis_title.height) << "below the keys title";
    EXPECT_FALSE(overlap(entry.swatch, entry.text));
    if (k > 0) {
      EXPECT_GT(entry.swatch.x, layout.key[k - 1].text.x + layout.key[k - 1].text.width);
    }
    // The swatch is framed in its marks' colour.
    EXPECT_EQ(image.at(entry.swatch.x, entry.swatch.y + entry.swatch.height / 2), colours[k]) << "entry " << k;
  }
  // Only the kinds that have marks get an entry.
  HeatmapOptions rows_only;
  rows_only.marked_rows = {1};
  rows_only.marked_rows_label = "the pronoun";
  rows_only.marked_cols_label = "its referent";
  EXPECT_EQ(heatmap_layout(alpha.cview(), rows_only).key.size(), 1U);
  // The SVG draws the key's text and gives each framed row and column its tooltip.
  options.row_labels = {"a", "b", "he", "d"};
  options.col_labels = {"w", "x", "y", "dog"};
  const std::string svg = render_heatmap(alpha.cview(), HeatmapFormat::svg, options);
  for (const char* part : {">gold alignment<", ">the pronoun<", ">its referent<", "<title>marked query: he</title>",
                           "<title>marked key: dog</title>", "stroke=\"#ff00ff\"", "stroke=\"#00ffff\""}) {
    EXPECT_NE(svg.find(part), std::string::npos) << "the SVG lacks " << part;
  }
}

TEST(HeatmapLayout, RefusesMarkedRowsAndColumnsOutOfRange) {
  const Tensor<float> alpha = softmax_rows({2, 3}, 30);
  HeatmapOptions rows;
  rows.marked_rows = {2};
  EXPECT_TRUE(
      throws_naming<ValueError>([&] { heatmap_layout(alpha.cview(), rows); }, {"marked_rows:", "[0, 2)", "got 2"}));
  HeatmapOptions cols;
  cols.marked_cols = {-1};
  EXPECT_TRUE(
      throws_naming<ValueError>([&] { heatmap_layout(alpha.cview(), cols); }, {"marked_cols:", "[0, 3)", "got -1"}));
}

TEST(HeatmapLayout, RefusesMarkedCellsOutOfRange) {
  const Tensor<float> alpha = softmax_rows({2, 3}, 26);
  for (const auto& cell : {std::pair<int64_t, int64_t>{2, 0}, {0, 3}, {-1, 1}, {1, -1}}) {
    HeatmapOptions options;
    options.marked_cells = {{0, 0}, cell};
    const std::string got = fmt::format("got ({}, {})", cell.first, cell.second);
    for (const HeatmapFormat format : {HeatmapFormat::png, HeatmapFormat::svg, HeatmapFormat::pdf}) {
      EXPECT_TRUE(throws_naming<ValueError>([&] { render_heatmap(alpha.cview(), format, options); },
                                            {"marked_cells:", "[0, 2) × [0, 3)", "[2, 3]", got}));
    }
  }
}

TEST(HeatmapSvg, MarkedCellsAreOutlinesAfterTheCells) {
  const Tensor<float> alpha = softmax_rows({3, 4}, 27);
  HeatmapOptions options;
  options.row_labels = {"a", "b", "c"};
  options.col_labels = {"w", "x", "y", "z"};
  options.marked_cells = {{0, 1}, {2, 3}};
  const std::string svg = render_heatmap(alpha.cview(), HeatmapFormat::svg, options);
  const size_t cells = svg.find("<g class=\"cells\"");
  const size_t marks = svg.find("<g class=\"marks\"");
  ASSERT_NE(cells, std::string::npos);
  ASSERT_NE(marks, std::string::npos);
  EXPECT_LT(cells, marks);
  // The cells' group still holds one <rect> per cell; the marks are outlines, not fills.
  EXPECT_EQ(count(svg.substr(cells, marks - cells), "<rect "), 3U * 4);
  EXPECT_EQ(count(svg.substr(marks), "fill=\"none\" stroke=\"#ff0000\""), 2U);
  EXPECT_NE(svg.find("<title>marked: c → z</title>"), std::string::npos);
  EXPECT_EQ(count(render_heatmap(alpha.cview(), HeatmapFormat::svg, {}), "class=\"marks\""), 0U);
}

TEST(HeatmapSvg, LargeMatricesEmbedOnePixelImage) {
  const Tensor<float> alpha = softmax_rows({200, 200}, 21);
  const std::string svg = render_heatmap(alpha.cview(), HeatmapFormat::svg, {});
  EXPECT_EQ(count(svg, "<rect "), 0U);
  EXPECT_EQ(count(svg, "<image "), 1U);
  EXPECT_NE(svg.find("href=\"data:image/png;base64,iVBORw0KGgo"), std::string::npos);
  EXPECT_LT(svg.size(), 1000000U);
}

TEST(HeatmapPdf, IsACompletePdf) {
  const Tensor<float> alpha = softmax_rows({6, 6}, 22);
  HeatmapOptions options;
  options.row_labels = {"我", "阅读", "这", "本", "书", "。"};
  options.col_labels = options.row_labels;
  const std::string pdf = render_heatmap(alpha.cview(), HeatmapFormat::pdf, options);
  EXPECT_EQ(pdf.rfind("%PDF-", 0), 0U);
  EXPECT_NE(pdf.find("%%EOF", pdf.size() - 8), std::string::npos);
  EXPECT_NE(pdf.find("NotoSansCJK"), std::string::npos);  // the CJK glyphs come from an embedded font
}

TEST(HeatmapHtml, SelfContainedWithEscapedData) {
  const Tensor<float> alpha = softmax_rows({2, 3, 3}, 23);
  HeatmapOptions options;
  options.row_labels = {"</script><script>alert(1)</script>", "b", "书"};
  options.col_labels = {"x", "y", "z\u2028"};
  options.title = "<b>title</b>";
  const std::string html = render_heatmap(alpha.cview(), HeatmapFormat::html, options);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0U);
  // The data is one JSON element; nothing in it can close it.
  const size_t data = html.find("<script type=\"application/json\" id=\"qkv-data\">");
  ASSERT_NE(data, std::string::npos);
  const size_t end = html.find("</script>", data);
  const std::string json = html.substr(data, end - data);
  EXPECT_EQ(json.find("</"), std::string::npos);
  EXPECT_NE(json.find(R"(\u003c/script\u003e\u003cscript\u003ealert(1)\u003c/script\u003e)"), std::string::npos);
  EXPECT_NE(json.find(R"("z\u2028")"), std::string::npos);
  EXPECT_NE(html.find("<title>&lt;b&gt;title&lt;/b&gt;</title>"), std::string::npos);
  // Every head is carried, each value as the shortest decimal that reads back as the float.
  EXPECT_NE(json.find(R"("name":"head 1")"), std::string::npos);
  EXPECT_NE(json.find(fmt::format("{}", alpha[17])), std::string::npos);
  // No network: nothing is fetched (the one URL is the SVG namespace, an identifier).
  EXPECT_EQ(html.find("https://"), std::string::npos);
  EXPECT_EQ(count(html, "http://"), count(html, "http://www.w3.org/2000/svg"));
  EXPECT_EQ(html.find(" src="), std::string::npos);
  EXPECT_EQ(html.find("<link rel=\"stylesheet\""), std::string::npos);

  HeatmapOptions second;
  second.head = 1;
  EXPECT_NE(render_heatmap(alpha.cview(), HeatmapFormat::html, second).find("\"initial\":1,"), std::string::npos);
}

// A causal 3 × 3 α whose cell (2, 0) is a weight of 0 that no mask forced, and its mask.
Tensor<float> causal_three() { return Tensor<float>({3, 3}, {1.0F, 0.0F, 0.0F, 0.5F, 0.5F, 0.0F, 0.0F, 0.5F, 0.5F}); }
Tensor<uint8_t> causal_mask() { return Tensor<uint8_t>({3, 3}, {1, 0, 0, 1, 1, 0, 1, 1, 1}); }

PixelRect cell_rect(const HeatmapPanelLayout& p, int64_t i, int64_t j) {
  return {.x = p.matrix.x + j * p.cell_width,
          .y = p.matrix.y + i * p.cell_height,
          .width = p.cell_width,
          .height = p.cell_height};
}

// The pixels of a rectangle, row by row.
std::vector<Rgb> pixels(const Image& image, const PixelRect& r) {
  std::vector<Rgb> out;
  for (int64_t y = r.y; y < r.y + r.height; ++y)
    for (int64_t x = r.x; x < r.x + r.width; ++x) out.push_back(image.at(x, y));
  return out;
}

TEST(HeatmapPng, MaskedCellsAreHatchedGreyNotZeroWeights) {
  const Tensor<float> alpha = causal_three();
  const Tensor<uint8_t> mask = causal_mask();
  HeatmapOptions options;
  options.allowed = mask.cview();
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
  ASSERT_TRUE(image.ok());
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  const HeatmapPanelLayout& p = layout.panels[0];
  const Rgb zero = viridis(0.0);
  // The unmasked 0 is the colour map's bottom, all over.
  for (const Rgb c : pixels(image, cell_rect(p, 2, 0))) ASSERT_EQ(c, zero) << str(c);
  for (const auto& [i, j] : {std::pair{0, 1}, std::pair{0, 2}, std::pair{1, 2}}) {
    int64_t fill = 0;
    int64_t hatch = 0;
    for (const Rgb c : pixels(image, cell_rect(p, i, j))) {
      EXPECT_NE(c, zero) << "masked cell [" << i << ", " << j << "] has the colour of a 0 weight";
      EXPECT_TRUE(c.r == c.g && c.g == c.b) << "masked cell [" << i << ", " << j << "] is not grey: " << str(c);
      fill += c == Rgb{224, 224, 224} ? 1 : 0;
      hatch += c.r < 200 ? 1 : 0;
    }
    EXPECT_GT(fill, p.cell_width * p.cell_height / 3) << "cell [" << i << ", " << j << "]";
    EXPECT_GT(hatch, p.cell_width) << "cell [" << i << ", " << j << "] has no hatching";
  }
  // The other cells keep their colours, on a scale that the masked cells take no part in.
  EXPECT_EQ(image.at(p.matrix.x + p.cell_width / 2, p.matrix.y + p.cell_height / 2), viridis(1.0));
  EXPECT_EQ(image.at(p.matrix.x + p.cell_width * 3 / 2, p.matrix.y + p.cell_height * 3 / 2), viridis(0.5));

  // --annotate writes nothing on a masked cell, and "0.00" on the unmasked 0.
  HeatmapOptions annotated = options;
  annotated.annotate = true;
  const Image with_values(render_heatmap(alpha.cview(), HeatmapFormat::png, annotated));
  const HeatmapPanelLayout q = heatmap_layout(alpha.cview(), annotated).panels[0];
  EXPECT_EQ(pixels(with_values, cell_rect(q, 0, 1)), pixels(image, cell_rect(p, 0, 1)));
  EXPECT_NE(pixels(with_values, cell_rect(q, 2, 0)), pixels(image, cell_rect(p, 2, 0)));
}

TEST(HeatmapPng, LargeMaskedMatricesAreFlatGrey) {
  const int64_t t = 200;  // beyond kMaxVectorCells: one image, a pixel per cell
  Tensor<float> alpha({t, t});
  Tensor<uint8_t> mask({t, t});
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      alpha[i * t + j] = 1.0F / static_cast<float>(i + 1);
      mask[i * t + j] = 1;
    }
  }
  HeatmapOptions options;
  options.allowed = mask.cview();
  const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
  const HeatmapPanelLayout p = heatmap_layout(alpha.cview(), options).panels[0];
  EXPECT_EQ(image.at(p.matrix.x + (t - 1) * p.cell_width, p.matrix.y), (Rgb{224, 224, 224}));
}

TEST(HeatmapLayout, RefusesAMaskThatDoesNotBroadcast) {
  const Tensor<float> alpha = causal_three();
  const Tensor<uint8_t> mask({2, 3}, {1, 1, 1, 1, 1, 1});
  HeatmapOptions options;
  options.allowed = mask.cview();
  for (const HeatmapFormat format : {HeatmapFormat::png, HeatmapFormat::svg, HeatmapFormat::html}) {
    try {
      render_heatmap(alpha.cview(), format, options);
      ADD_FAILURE() << "a [2, 3] mask of a [3, 3] alpha was taken";
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find("allowed"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("[2, 3]"), std::string::npos) << e.what();
    }
  }
}

TEST(HeatmapSvg, MaskedCellsAreHatchedRectsWithTheirOwnTooltip) {
  const Tensor<float> alpha = causal_three();
  const Tensor<uint8_t> mask = causal_mask();
  HeatmapOptions options;
  options.allowed = mask.cview();
  options.annotate = true;
  const std::string svg = render_heatmap(alpha.cview(), HeatmapFormat::svg, options);
  EXPECT_EQ(count(svg, R"svg(fill="url(#qkv-masked)" class="masked")svg"), 3U) << svg;
  EXPECT_NE(svg.find("<title>0 → 1: masked</title>"), std::string::npos);
  EXPECT_NE(svg.find(R"(fill="#440154"><title>2 → 0: 0</title>)"), std::string::npos) << "the unmasked 0";
  EXPECT_NE(svg.find(R"(<pattern id="qkv-masked")"), std::string::npos);
  EXPECT_EQ(count(svg, "<rect "), 9U) << "still one <rect> per cell";
  // Annotations: 6 values, none on the masked cells.
  EXPECT_EQ(count(svg, ">0.00</text>"), 1U) << svg;
  EXPECT_EQ(count(svg, ">0.50</text>"), 4U);
}

TEST(HeatmapHtml, CarriesTheMaskTheScaleAndClipping) {
  const Tensor<float> alpha = causal_three();
  const Tensor<uint8_t> mask = causal_mask();
  HeatmapOptions options;
  const std::string plain = render_heatmap(alpha.cview(), HeatmapFormat::html, options);
  EXPECT_EQ(plain.find("\"masked\":["), std::string::npos);
  EXPECT_NE(plain.find(R"("scale":"linear","diverging":false,"clippedLow":false,"clippedHigh":false)"),
            std::string::npos);
  options.allowed = mask.cview();
  options.scale = HeatmapScale::sqrt;
  options.vmax = 0.75;
  const std::string html = render_heatmap(alpha.cview(), HeatmapFormat::html, options);
  EXPECT_NE(html.find(R"("masked":[0,1,1,0,0,1,0,0,0])"), std::string::npos);
  EXPECT_NE(html.find(R"("scale":"sqrt","diverging":false,"clippedLow":false,"clippedHigh":true)"), std::string::npos);
  EXPECT_NE(html.find(R"(? "masked" :)"), std::string::npos) << "the hover names masked cells";
}

TEST(HeatmapPng, ScaleOptionsStretchSmallWeights) {
  const Tensor<float> alpha({1, 4}, {0.25F, 0.01F, 0.001F, 1.0F});
  for (const auto& [scale, stretch] :
       {std::pair{HeatmapScale::linear, +[](double u) { return u; }},
        std::pair{HeatmapScale::sqrt, +[](double u) { return std::sqrt(u); }},
        std::pair{HeatmapScale::log, +[](double u) { return std::log10(1.0 + 999.0 * u) / 3.0; }}}) {
    HeatmapOptions options;
    options.scale = scale;
    const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
    const HeatmapPanelLayout p = heatmap_layout(alpha.cview(), options).panels[0];
    for (int64_t j = 0; j < 4; ++j) {
      const Rgb got = image.at(p.matrix.x + j * p.cell_width + p.cell_width / 2, p.matrix.y + p.cell_height / 2);
      const Rgb want = viridis(stretch(static_cast<double>(alpha[j])));
      EXPECT_EQ(got, want) << heatmap_scale_name(scale) << " key " << j << ": got " << str(got) << ", expected "
                           << str(want);
    }
  }
  EXPECT_EQ(viridis(std::sqrt(0.25)), viridis(0.5));
  // A diverging map stretches each half from its middle: ±x stay as far from it.
  const Tensor<float> signed_values({1, 3}, {-0.25F, 0.0F, 0.25F});
  HeatmapOptions diverging;
  diverging.colormap = Colormap::coolwarm;
  diverging.vmax = 1.0;
  diverging.vmin = -1.0;
  diverging.scale = HeatmapScale::sqrt;
  const Image image(render_heatmap(signed_values.cview(), HeatmapFormat::png, diverging));
  const HeatmapPanelLayout p = heatmap_layout(signed_values.cview(), diverging).panels[0];
  const auto at = [&](int64_t j) {
    return image.at(p.matrix.x + j * p.cell_width + p.cell_width / 2, p.matrix.y + p.cell_height / 2);
  };
  EXPECT_EQ(at(0), colormap_at(Colormap::coolwarm, (1.0 - std::sqrt(0.25)) / 2.0));
  EXPECT_EQ(at(1), colormap_at(Colormap::coolwarm, 0.5));
  EXPECT_EQ(at(2), colormap_at(Colormap::coolwarm, (1.0 + std::sqrt(0.25)) / 2.0));

  EXPECT_EQ(parse_heatmap_scale("log", "--scale"), HeatmapScale::log);
  try {
    parse_heatmap_scale("cubic", "--scale");
    ADD_FAILURE() << "an unknown scale was taken";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "--scale: expected linear, sqrt or log, got cubic");
  }
}

TEST(HeatmapPng, TheColourBarShowsClippingExactlyWhenValuesExceedVmax) {
  const Tensor<float> alpha({2, 2}, {0.1F, 0.9F, 0.5F, 0.5F});
  const auto centre_of = [](const PixelRect& r) { return std::pair{r.x + r.width / 2, r.y + r.height * 2 / 3}; };
  for (const std::optional<double> vmax : {std::optional<double>(), std::optional(0.9), std::optional(0.5)}) {
    HeatmapOptions options;
    options.vmax = vmax;
    const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
    const bool clipped = vmax && *vmax < 0.9;
    EXPECT_EQ(layout.clipped_high, clipped) << (vmax ? *vmax : -1.0);
    EXPECT_FALSE(layout.clipped_low);
    EXPECT_EQ(layout.clip_low_marker.height, 0);
    const Image image(render_heatmap(alpha.cview(), HeatmapFormat::png, options));
    // Above the bar: the triangle, in the top colour, or the white margin.
    const PixelRect above = {
        .x = layout.colorbar.x, .y = layout.colorbar.y - 12, .width = layout.colorbar.width, .height = 10};
    if (clipped) {
      EXPECT_EQ(layout.clip_high_marker.height, 10);
      const auto [x, y] = centre_of(layout.clip_high_marker);
      EXPECT_EQ(image.at(x, y), viridis(1.0)) << str(image.at(x, y));
      expect_inside(layout.clip_high_marker, layout, "the clipping triangle");
    } else {
      EXPECT_EQ(layout.clip_high_marker.height, 0);
      EXPECT_EQ(image.ink(above), 0) << "a triangle with nothing clipped";
    }
    const std::string svg = render_heatmap(alpha.cview(), HeatmapFormat::svg, options);
    EXPECT_EQ(count(svg, R"(<path class="clip-high")"), clipped ? 1U : 0U);
  }
  // A diverging map clips both ends.
  const Tensor<float> signed_values({1, 2}, {-2.0F, 2.0F});
  HeatmapOptions diverging;
  diverging.colormap = Colormap::coolwarm;
  diverging.vmin = -1.0;
  diverging.vmax = 1.0;
  const HeatmapLayout layout = heatmap_layout(signed_values.cview(), diverging);
  EXPECT_TRUE(layout.clipped_low && layout.clipped_high);
  const Image image(render_heatmap(signed_values.cview(), HeatmapFormat::png, diverging));
  const PixelRect& low = layout.clip_low_marker;
  EXPECT_EQ(image.at(low.x + low.width / 2, low.y + low.height / 3), colormap_at(Colormap::coolwarm, 0.0));
  expect_inside(low, layout, "the low clipping triangle");
}

TEST(HeatmapGrid, ColumnsAndCaptionsAsAsked) {
  // Six heads as a model's 2 layers × 3 heads: rows of 3 panels, each with its own caption.
  const Tensor<float> alpha({6, 2, 2}, 0.5F);
  HeatmapOptions options;
  options.grid_columns = 3;
  options.panel_captions = {"l0 h0", "l0 h1", "l0 h2", "l1 h0", "l1 h1", "l1 h2"};
  const HeatmapLayout layout = heatmap_layout(alpha.cview(), options);
  ASSERT_EQ(layout.panels.size(), 6U);
  EXPECT_EQ(layout.panels[2].matrix.y, layout.panels[0].matrix.y);
  EXPECT_GT(layout.panels[3].matrix.y, layout.panels[0].matrix.y);
  EXPECT_EQ(layout.panels[3].matrix.x, layout.panels[0].matrix.x);
  EXPECT_GT(layout.panels[0].caption.height, 0);
  options.panel_captions.pop_back();
  EXPECT_THROW(heatmap_layout(alpha.cview(), options), ShapeError);
  options.panel_captions.clear();
  options.grid_columns = -1;
  EXPECT_THROW(heatmap_layout(alpha.cview(), options), ValueError);
}

}  // namespace
}  // namespace qkv
