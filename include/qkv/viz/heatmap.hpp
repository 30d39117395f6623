#pragma once
// The alignment matrix α drawn as a file or in the terminal: "who looks at whom", rows = queries,
// columns = keys. One figure (the matrices, their labels, title and scale) has five outputs:
//
//   PNG, PDF  cairo, with pango text (CJK labels through fontconfig's fallback to Noto Sans CJK);
//   SVG       hand-written: one <rect> per cell with a <title> tooltip and real <text> labels, so
//             the file stays small, selectable and editable; laid out with the same pango metrics;
//   HTML      one self-contained page (no network): a matrix view and a token view in which
//             hovering a query highlights the keys by α_ij (and hovering a key, the queries that
//             look at it), a head selector, the exact value on hover. The data is JSON inside it;
//   terminal  text: a grid of cells per matrix, columns aligned by display width (CJK takes two
//             columns a character), each cell an ANSI background colour or, without colour, one of
//             the shades " ░▒▓█" (five equal bins of the scale), so that piped output is stable text.
//
// Shapes: alpha is [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk] (what attention_forward writes as its
// weights). One batch entry is drawn (HeatmapOptions::batch). Images and the terminal draw one head
// (HeatmapOptions::head) or, when no head is named, every head of the batch (images as a grid of
// small multiples, the terminal one grid after another) sharing one colour scale; the page carries
// every head of the batch and opens at `head` (0 when none is named).
//
// Geometry, in pixels (PNG pixels, SVG px; a PDF has 0.75 pt per pixel, i.e. 96 dpi): cells are
// whole pixels, at most 48 and at least 1 on a side, so T up to 1024 (and beyond) fits one image;
// labels are thinned to every 2nd, 5th, 10th, ... when cells are shorter than a line of text. With
// `annotate` the cells grow to hold their value. A cell's colour is the colour map at t = s(u),
// u = (value − vmin) / (vmax − vmin) clamped to [0, 1] and s the HeatmapScale (u itself by default).
// Values beyond vmax (below vmin) are drawn in the end colour, and the colour bar then ends in a
// triangle at that end (the terminal's scale line says "≥ vmax", "≤ vmin").
//
// Masked cells (HeatmapOptions::allowed is 0 there: the query may not see that key) are not weights
// at all, and are drawn so that no colour map can be mistaken for them: light grey hatched with
// darker grey lines in PNG, PDF and SVG (flat light grey in a matrix drawn as one image), light grey
// on the page (whose hover says "masked"), '·' in the terminal; `annotate` writes no value on them,
// and they take no part in the default vmin and vmax.
//
// The terminal fits TerminalStyle::max_width columns when one is given. A grid as wide as its labels
// that does not fit cuts its query labels to a quarter of the width and its key labels to 8 columns,
// each starting at its key's column and thinned to those that do not run into each other; then, as
// long as the keys do not fit, it drops the blank between cells, draws each key one column wide (not
// with `annotate`), and at last shows only the first keys that fit. A line under the grid says what
// was done; it, the title and the scale line wrap at the width.
//
// The terminal, plain, for α = [[0.9, 0.05, 0.05], [0.3, 0.45, 0.25]] with labels {"I", "read"} ×
// {"I", "read", "書"}: the title and a head's caption (when there are any) on lines of their own, then
// the grid, each column as wide as its label (at least 2), and the line of its scale.
//         I read 書
//   I    ██
//   read ░░ ▒▒▒▒ ░░
//   scale: 0.000 [ ░▒▓█] 0.900

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/core/text.hpp"  // what labels go through: split_labels, sanitize_label
#include "qkv/viz/colormap.hpp"

namespace qkv {

enum class HeatmapFormat { png, svg, pdf, html, terminal };

// The file format named by a path's extension: .png, .svg, .pdf, .html or .htm, in any case. Throws
// ValueError naming `arg` otherwise ("-o: expected a file ending in .png, .svg, .pdf or .html, got
// attention.jpg").
HeatmapFormat heatmap_format_for_path(const std::filesystem::path& path, std::string_view arg);

// "PNG", "SVG", "PDF", "HTML", "terminal"
std::string_view heatmap_format_name(HeatmapFormat format);

// How the terminal colours a cell: one of the shades " ░▒▓█" (none), the ANSI background of the
// nearest colour of the xterm 256-colour cube (palette256), or a 24-bit ANSI background (truecolor).
enum class TerminalColor { none, palette256, truecolor };

// How a value's place u in [0, 1] between vmin and vmax becomes the colour map's t. sqrt and log
// spread the small weights that a few large ones (a causal map's first row, all 1) leave dark:
//   linear  t = u
//   sqrt    t = √u                       (u = 0.25 sits at the middle)
//   log     t = log10(1 + 999 u) / 3     (three decades: u = 0.001, 0.01, 0.1, 1 at 0.1, 0.35, 0.67, 1)
// With a diverging colour map the scale applies to each half from the middle out, so that 0 stays
// at the middle and ±x at the same distance from it.
enum class HeatmapScale { linear, sqrt, log };

// "linear", "sqrt", "log"
std::string_view heatmap_scale_name(HeatmapScale scale);

// The scale named `name`; throws ValueError naming `arg` otherwise ("--scale: expected linear, sqrt
// or log, got cubic").
HeatmapScale parse_heatmap_scale(std::string_view name, std::string_view arg);

// The narrowest TerminalStyle::max_width: what the scale line and a few keys need.
inline constexpr int64_t kMinTerminalWidth = 40;

// What only the terminal reads.
struct TerminalStyle {
  TerminalColor color = TerminalColor::none;
  // Digits after the point of the cell values (with `annotate`) and of the scale line; 0 to 9.
  int decimals = 3;
  // A line after each grid that maps shades or colours to values: "scale: 0.000 [ ░▒▓█] 0.700".
  bool legend = true;
  // The most columns a line may take (display columns: CJK two, escapes none), at least kMinTerminalWidth; 0 for
  // no limit. Callers pass the terminal's width (qkv uses COLUMNS, the terminal's own, else 80).
  int64_t max_width = 0;
};

struct HeatmapOptions {
  // One UTF-8 label per query (Tq) and per key (Tk); an empty list numbers them from 0. Controls
  // are drawn as '?' and invalid UTF-8 as U+FFFD; a label wider than 160 px is cut with "…".
  std::vector<std::string> row_labels;
  std::vector<std::string> col_labels;
  // Drawn above the matrix (as the page's title, as the terminal's first line); none when empty.
  std::string title;
  Colormap colormap = Colormap::viridis;
  // The ends of the scale: vmin defaults to min(0, smallest finite value) and vmax to the largest
  // finite value (vmin + 1 when every value is vmin); with a diverging colour map, to ∓ the largest
  // finite magnitude, so that 0 sits at the map's middle. Given, they must be finite with vmin < vmax.
  std::optional<double> vmin;
  std::optional<double> vmax;
  HeatmapScale scale = HeatmapScale::linear;
  // Which keys each query may see, broadcastable to alpha's shape (trailing dims aligned, each 1 or
  // alpha's), nonzero = may attend, as AttentionMask::allowed; the cells where it is 0 are drawn as
  // masked. None: every cell is a weight.
  std::optional<TensorView<const uint8_t>> allowed;
  // Each cell shows its value, black or white by the cell's lightness: with 2 decimals in an image,
  // right-aligned with TerminalStyle::decimals in the terminal.
  bool annotate = false;
  // Which entry of the batch dim of a rank-4 alpha is drawn; must be 0 for ranks 2 and 3.
  int64_t batch = 0;
  // Which head of a rank-3 or rank-4 alpha: images and the terminal draw it alone, and the page opens
  // at it. None: images and the terminal draw every head. Must be empty or 0 for rank 2.
  std::optional<int64_t> head;
  // Cells (query row, key column) outlined in every drawn panel, e.g. a gold alignment: a 2 px red
  // frame with a 1 px white lining inside, visible on any colour map. Each must lie in [0, Tq) ×
  // [0, Tk); the page and the terminal ignore them.
  std::vector<std::pair<int64_t, int64_t>> marked_cells;
  // Whole queries (rows) and keys (columns) marked in every drawn panel, e.g. a pronoun's row and
  // its referent's column: a frame around the row (column) as a marked cell has, in magenta for rows
  // and cyan for columns, drawn under the marked cells. Each must lie in [0, Tq) ([0, Tk)); the page
  // and the terminal ignore them.
  std::vector<int64_t> marked_rows;
  std::vector<int64_t> marked_cols;
  // What the marks mean ("gold alignment", "the pronoun", "its referent"): each non-empty one with
  // marks of its kind is an entry of a key under the image, a swatch framed as the marks are and the
  // text (sanitised as labels are). No key when all are empty.
  std::string marked_cells_label;
  std::string marked_rows_label;
  std::string marked_cols_label;
  // The caption of each head's panel in a grid, one per head of alpha (e.g. "layer 3 · head 5" when
  // the heads are a model's layers × heads); empty: "head h".
  std::vector<std::string> panel_captions;
  // The panels of a grid a row (e.g. H, so that each row is a layer); 0: about √(panels), a square.
  int64_t grid_columns = 0;
  TerminalStyle terminal;
};

// A rectangle of whole pixels; width or height 0 when there is nothing there.
struct PixelRect {
  int64_t x = 0, y = 0, width = 0, height = 0;
};

// Where one [Tq, Tk] matrix lands in an image.
struct HeatmapPanelLayout {
  int64_t head = 0;  // the head drawn (0 for rank 2)
  PixelRect matrix;  // cell (i, j) covers x + j·cell_width .. +cell_width, y + i·cell_height ..
  int64_t cell_width = 0;
  int64_t cell_height = 0;
  int64_t row_label_step = 1;  // every row_label_step-th query is labelled (0, k, 2k, ...)
  int64_t col_label_step = 1;
  PixelRect row_labels;             // right-aligned query labels left of the matrix; empty in inner columns of a grid
  PixelRect col_labels;             // key labels below the matrix; empty above another panel
  bool col_labels_rotated = false;  // read upwards, as some label is wider than its column
  PixelRect caption;                // "head 3" above the matrix of a grid; empty for a single panel
};

// One entry of the key of the marks: a square swatch framed as those marks are, then their text.
struct HeatmapKeyEntry {
  PixelRect swatch;
  PixelRect text;
};

struct HeatmapLayout {
  int64_t width = 0;
  int64_t height = 0;
  double vmin = 0.0;
  double vmax = 1.0;
  PixelRect title;
  std::vector<HeatmapPanelLayout> panels;
  PixelRect row_axis_title;   // "queries", rotated, left of the row labels
  PixelRect col_axis_title;   // "keys", below the key labels
  PixelRect colorbar;         // vmax at the top, vmin at the bottom
  PixelRect colorbar_labels;  // the tick values, right of the bar
  std::vector<double> ticks;  // values marked on the colour bar, within [vmin, vmax]
  // Whether a drawn (unmasked, finite) value lies below vmin or above vmax: the colour bar then ends
  // in a triangle of the end colour there, within the rectangle given.
  bool clipped_low = false;
  bool clipped_high = false;
  PixelRect clip_low_marker;   // below the colour bar; empty unless clipped_low
  PixelRect clip_high_marker;  // above the colour bar; empty unless clipped_high
  // The key of the marks, on one line under the "keys" title: the marked cells', rows' and columns'
  // entries, in that order, those with a label.
  std::vector<HeatmapKeyEntry> key;
};

// alpha [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk] → where everything of the image goes. Throws
// ShapeError for another rank, Tq or Tk of 0, a label list that is neither empty nor one per row
// (column), an `allowed` mask that does not broadcast to alpha, or a batch or head out of range; ValueError for a
// non-finite value, a bad vmin/vmax, a marked cell, row or column out of range, or an image beyond 32767 pixels a side
// (cairo's limit; a message says what made it so big).
template <class T>
HeatmapLayout heatmap_layout(TensorView<const T> alpha, const HeatmapOptions& options);

// alpha [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk] → the bytes of the file, or the terminal's text as
// lines ending in '\n' (a plain grid's lines carry no trailing spaces), with the errors of
// heatmap_layout but two: the terminal draws a Tq or Tk of 0 (as its header alone) and non-finite
// values (e.g. −inf scores of masked keys, whose cells it leaves blank), and throws ValueError for
// TerminalStyle's decimals outside 0..9 or a max_width from 1 to 39. Nothing is written: callers hand the bytes on to
// write_file_atomically or to the terminal.
template <class T>
std::string render_heatmap(TensorView<const T> alpha, HeatmapFormat format, const HeatmapOptions& options);

// Whether to colour what is written to `stream`: it is a terminal, NO_COLOR is unset or empty
// (https://no-color.org) and TERM is set and not "dumb".
bool terminal_supports_color(std::FILE* stream);

// Whether the terminal announces 24-bit colour: COLORTERM is "truecolor" or "24bit".
bool terminal_supports_truecolor();

// The labels (sanitised as drawn) that have a character no installed font can draw, which the
// images would show as a box: CJK labels need fonts-noto-cjk (or another CJK font).
std::vector<std::string> labels_without_glyphs(const std::vector<std::string>& labels);

// What check_attention_weights found about the rows of α.
struct AttentionWeightsReport {
  int64_t rows = 0;         // B·H·Tq
  int64_t rows_masked = 0;  // all zero: queries that see no key
  int64_t rows_off = 0;     // neither summing to 1 nor all zero
  std::string first_off;    // "row [0, 3] sums to 0.8125", the first of them
};

// alpha [..., Tq, Tk] of rank 2 to 4: throws ShapeError for another rank and ValueError, naming
// `name`, the count and the first index, for a NaN, an infinity or a negative weight; reports the
// rows whose sum is off 1 by more than float32 softmax can explain, 2 (Tk + 1) ε_float32 (the
// rounding of Tk terms, each normalised once, and of their sum), and the all-zero rows.
template <class T>
AttentionWeightsReport check_attention_weights(TensorView<const T> alpha, std::string_view name);

}  // namespace qkv
