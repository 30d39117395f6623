#pragma once
// What the heatmap renderers (src/viz/heatmap*.cpp) share: the figure (the matrices to draw, their
// labels and scale, already checked) and its layout, the text styles, the pango metrics, and the
// Painter through which every image draws its text and ticks.
// Not installed: the public API is include/qkv/viz/heatmap.hpp.

#include <pango/pangocairo.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/viz/heatmap.hpp"

namespace qkv::heatmap_detail {

// Fonts of every text: Latin from DejaVu Sans (Debian's default sans), CJK from Noto Sans CJK SC;
// fontconfig falls back to any font that has a character neither has.
inline constexpr std::string_view kFontFamily = "DejaVu Sans, Noto Sans CJK SC, sans-serif";

// Text sizes, in pixels.
inline constexpr double kTitleSize = 16.0;
inline constexpr double kCaptionSize = 13.0;
inline constexpr double kLabelSize = 12.0;
inline constexpr double kAxisTitleSize = 12.0;
inline constexpr double kTickSize = 11.0;
inline constexpr double kAnnotationSize = 11.0;

// Lengths, in pixels.
inline constexpr int64_t kTickLength = 4;
inline constexpr int64_t kLabelGap = 3;  // between a tick and its label

// Colours of the furniture (text, ticks, frame).
inline constexpr Rgb kInk = {34, 34, 34};
inline constexpr Rgb kMutedInk = {85, 85, 85};

// A marked cell's outline: kMarkWidth px of kMarkColor on the cell's edge, lined inside with 1 px of
// kMarkLining. No colour map is pure red, and the lining parts the frame from a red-ish cell.
inline constexpr Rgb kMarkColor = {255, 0, 0};
inline constexpr Rgb kMarkLining = {255, 255, 255};
inline constexpr int64_t kMarkWidth = 2;
// Marked rows and columns: the same frame in colours that are neither red nor any map's.
inline constexpr Rgb kRowMarkColor = {255, 0, 255};
inline constexpr Rgb kColMarkColor = {0, 255, 255};

// A marked block of cells: rows [row, row + rows) × columns [col, col + cols), framed in `color`.
struct Mark {
  int64_t row = 0, col = 0, rows = 1, cols = 1;
  Rgb color = kMarkColor;
  std::string tooltip;  // the SVG's <title>: "marked: c → z"
};

// What the key says of one kind of mark; one per HeatmapLayout::key entry.
struct MarkKey {
  Rgb color = kMarkColor;
  std::string text;
};

// A masked cell: kMaskedFill crossed by diagonal kMaskedHatch lines kMaskedHatchGap px apart. The
// hatching, not the grey, is what tells it from the gray map's light end.
inline constexpr Rgb kMaskedFill = {224, 224, 224};
inline constexpr Rgb kMaskedHatch = {150, 150, 150};
inline constexpr int64_t kMaskedHatchGap = 6;

// The triangle that ends the colour bar where values were clipped, kClipMarkerHeight px tall and
// kClipMarkerGap px from the bar.
inline constexpr int64_t kClipMarkerHeight = 10;
inline constexpr int64_t kClipMarkerGap = 2;

// One [Tq, Tk] matrix of the figure.
struct Panel {
  int64_t head = 0;
  std::string caption;          // "head 3"; empty for rank 2
  std::vector<double> values;   // [Tq, Tk], row-major; finite but in a terminal figure
  std::vector<uint8_t> masked;  // [Tq, Tk], 1 where the query may not see the key; empty: none masked

  bool is_masked(size_t cell) const { return !masked.empty() && masked[cell] != 0; }
};

struct Figure {
  Shape shape;  // alpha as given
  int64_t tq = 0, tk = 0;
  int64_t heads = 1;  // H (1 for rank 2)
  int64_t batch = 0;
  int64_t first_head = 0;               // where the page opens
  std::vector<std::string> row_labels;  // Tq, sanitised; numbers when none were given
  std::vector<std::string> col_labels;  // Tk
  bool labels_given = false;
  std::string title;
  Colormap colormap = Colormap::viridis;
  HeatmapScale scale = HeatmapScale::linear;
  bool has_mask = false;  // some drawn cell is masked
  bool annotate = false;
  TerminalStyle terminal;
  std::vector<Mark> marks;    // the marked rows and columns, then the marked cells, checked
  std::vector<MarkKey> keys;  // the key's entries, as HeatmapLayout::key
  bool float32 = false;       // alpha was float: values are written as the shortest float that reads back
  int64_t grid_columns = 0;   // HeatmapOptions::grid_columns
  std::vector<Panel> panels;  // what an image draws (one head, or every head); the page carries all
  HeatmapLayout layout;       // of the image (the scale only for the page and the terminal)
  // Labels as the image draws them: cut with "…" to 160 px; only every k-th is set. Empty for the page.
  std::vector<std::string> row_text;
  std::vector<std::string> col_text;
  std::vector<std::string> tick_text;  // one per layout.ticks

  double position(double value) const;    // of a finite value on the scale (HeatmapScale), in [0, 1]
  std::string exact(double value) const;  // the value as given, digits enough to read it back
  Rgb color(double value) const { return colormap_at(colormap, position(value)); }
};

// The figure of alpha for `format`: checks everything, selects the panels, computes the scale and
// (for images) the layout.
template <class T>
Figure make_figure(TensorView<const T> alpha, const HeatmapOptions& options, HeatmapFormat format);

// A cell's value as annotated: 2 decimals.
std::string annotation(double value);

// ---- pango metrics -----------------------------------------------------------------------------

struct TextSize {
  double width = 0.0;
  double height = 0.0;  // the logical line height
};

// The logical extent of `text` in the style (kFontFamily at `size` px, bold or not), as cairo and
// pango draw it with metric hinting off.
TextSize measure_text(std::string_view text, double size, bool bold = false);

// What every pango context of the heatmaps is set to (metric hinting off, grey antialiasing).
void configure_context(PangoContext* context);

// `text` in the style: kFontFamily at `size` px, bold or not.
void set_text(PangoLayout* layout, std::string_view text, double size, bool bold);

// Whether a marked cell of this size has room for the outline (else it is filled with kMarkColor)
// and for the lining inside it.
inline bool mark_has_outline(int64_t cell_width, int64_t cell_height) {
  return cell_width > 2 * kMarkWidth && cell_height > 2 * kMarkWidth;
}
inline bool mark_has_lining(int64_t cell_width, int64_t cell_height) {
  return cell_width > 2 * kMarkWidth + 2 && cell_height > 2 * kMarkWidth + 2;
}

// Where a mark lies in a panel, in pixels, and which of the above it has room for: the PNG, PDF
// and SVG writers draw the same rectangles.
struct MarkBox {
  double x = 0, y = 0, width = 0, height = 0;
  bool outline = false, lining = false;
};
inline MarkBox mark_box(const Mark& mark, const HeatmapPanelLayout& p) {
  const int64_t w_px = mark.cols * p.cell_width;
  const int64_t h_px = mark.rows * p.cell_height;
  return {.x = static_cast<double>(p.matrix.x) + static_cast<double>(mark.col * p.cell_width),
          .y = static_cast<double>(p.matrix.y) + static_cast<double>(mark.row * p.cell_height),
          .width = static_cast<double>(w_px),
          .height = static_cast<double>(h_px),
          .outline = mark_has_outline(w_px, h_px),
          .lining = mark_has_lining(w_px, h_px)};
}

// ---- what the images draw alike ------------------------------------------------------------------

// Whether a cell is light: its value is written on it in black then, in white otherwise, in every
// format (the terminal's too).
inline bool is_light(Rgb cell) { return luma(cell) > 128.0; }

// Where text sits on the point it is drawn at, horizontally.
enum class Anchor { start, middle, end };

// What the images draw the text and ticks around their cells with: cairo for PNG and PDF, elements
// for SVG, so that one piece of code (heatmap_paint.cpp) puts them in the same place in each.
class Painter {
 public:
  virtual ~Painter() = default;
  // A filled rectangle that is not a cell: a tick.
  virtual void box(double x, double y, double w, double h, Rgb color) = 0;
  // Text anchored at (x, y): horizontally by `anchor`, vertically on its centre line.
  virtual void text(std::string_view content, double size, bool bold, Rgb color, double x, double y, Anchor anchor) = 0;
  // The same, turned a quarter left (reading upwards).
  virtual void rotated_text(std::string_view content, double size, Rgb color, double x, double y, Anchor anchor) = 0;
};

void paint_title(Painter& painter, const Figure& figure);
// "head 3" above a panel of a grid.
void paint_caption(Painter& painter, const Panel& panel, const HeatmapPanelLayout& p);
// Each unmasked cell's value, centred on it.
void paint_annotations(Painter& painter, const Figure& figure, const Panel& panel, const HeatmapPanelLayout& p);
// The ticks and labels of a panel's queries (left of it) and keys (below it), where it has them.
void paint_axis_labels(Painter& painter, const Figure& figure, const HeatmapPanelLayout& p);
// "queries" and "keys".
void paint_axis_titles(Painter& painter, const Figure& figure);
// The ticks of the colour bar and their values.
void paint_colorbar_ticks(Painter& painter, const Figure& figure);

// The key of the marks (HeatmapLayout::key): each swatch framed as its marks are, then its text.
void paint_key(Painter& painter, const Figure& figure);

// ---- renderers -----------------------------------------------------------------------------------

// Matrices of more cells than this are drawn as one image (a pixel per cell) rather than a shape
// per cell.
inline constexpr int64_t kMaxVectorCells = 128 * 128;

std::string render_cairo(const Figure& figure, HeatmapFormat format);  // PNG and PDF
// A PNG of Tk × Tq pixels, one per cell of the panel, in the figure's colours.
std::string matrix_png(const Figure& figure, const Panel& panel);
std::string render_svg(const Figure& figure);
// Text for markup: '&', '<' and '>' as entities; for XML (SVG text and attribute values) also '"', and
// U+FFFE and U+FFFF, UTF-8 but not XML characters, as U+FFFD. Labels were sanitised (no controls).
enum class Markup { xml, html_text };
std::string escape_markup(std::string_view text, Markup markup = Markup::xml);
std::string render_html(const Figure& figure);

// A JSON string literal of UTF-8 text that is safe inside a <script> element: '<', '>', '&', the
// controls and U+2028/U+2029 escaped. json_strings: a JSON array of them.
std::string json_string(std::string_view text);
std::string json_strings(const std::vector<std::string>& items);
std::string render_terminal(const Figure& figure);

}  // namespace qkv::heatmap_detail
