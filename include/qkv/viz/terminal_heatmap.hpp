#pragma once
// A matrix drawn in the terminal as a labelled grid of cells: attention weights α [Tq, Tk] seen as
// "who looks at whom" (rows = queries, columns = keys).
//
// Shapes: alpha [Tq, Tk]; row_labels has Tq entries and col_labels Tk (or none: then rows and
// columns are numbered from 0). Labels are UTF-8 and columns are aligned by display width, so CJK
// tokens (two terminal columns per character) line up with ASCII ones.
//
// A cell's colour is t = (value − vmin) / (vmax − vmin), clamped to [0, 1]:
//   color    ANSI background from a colour map (viridis unless asked: dark purple at 0, yellow
//            at 1), as 24-bit escapes or the nearest entry of the 256-colour cube;
//   plain    one of the shades " ░▒▓█" (five equal bins of t), so that piped output is stable text.
// Non-finite values (e.g. −inf scores of masked keys) have no colour: their cells stay blank.
//
// Layout, plain, for α = [[0.9, 0.05, 0.05], [0.3, 0.45, 0.25]] with labels {"I", "read"} × {"I",
// "read", "書"}: rows = queries, columns = keys, each column as wide as its label (at least 2).
//         I read 書
//   I    ██
//   read ░░ ▒▒▒▒ ░░
//   scale: 0.000 [ ░▒▓█] 0.900

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/viz/colormap.hpp"

namespace qkv {

struct TerminalHeatmapOptions {
  // One UTF-8 label per row (Tq) and per column (Tk); an empty list numbers them from 0. Control
  // characters are shown as '?' and invalid UTF-8 as U+FFFD, so a label cannot break the grid.
  std::vector<std::string> row_labels;
  std::vector<std::string> col_labels;
  // ANSI background colours instead of the shade characters.
  bool color = false;
  // The colour map of the backgrounds. Read only with color.
  Colormap colormap = Colormap::viridis;
  // 24-bit colour escapes; otherwise the nearest colour of the 256-colour cube. Read only with color.
  bool truecolor = false;
  // The ends of the scale: vmin defaults to min(0, smallest finite value), vmax to the largest finite
  // value. Given, they must be finite with vmin < vmax (ValueError otherwise).
  std::optional<double> vmin;
  std::optional<double> vmax;
  // Each cell also shows its value, right-aligned, with `decimals` digits after the point.
  bool show_values = false;
  // Digits after the point of the cell values and of the legend; 0 to 9.
  int decimals = 3;
  // A last line that maps shades or colours to values: "scale: 0.000 [ ░▒▓█] 0.700".
  bool legend = true;
};

// alpha [Tq, Tk] → the grid as lines ending in '\n': a header of column labels, then one line per
// row. Plain lines carry no trailing spaces. Throws ShapeError when alpha is not rank 2 or a label
// list is neither empty nor one per row/column ("row_labels: expected 6 labels (one per row of alpha
// [6, 6]), got 5"), and ValueError for decimals outside 0..9 or a bad vmin/vmax.
template <class T>
std::string render_terminal_heatmap(TensorView<const T> alpha, const TerminalHeatmapOptions& options);

// Whether to colour what is written to `stream`: it is a terminal, NO_COLOR is unset or empty
// (https://no-color.org) and TERM is set and not "dumb".
bool terminal_supports_color(std::FILE* stream);

// Whether the terminal announces 24-bit colour: COLORTERM is "truecolor" or "24bit".
bool terminal_supports_truecolor();

// Terminal columns taken by UTF-8 text: 2 for East Asian Wide and Fullwidth characters (CJK, Hangul,
// kana, fullwidth forms, most emoji), 0 for combining marks, zero-width characters and controls, 1
// otherwise. An invalid byte counts 1 (terminals show it as one replacement character).
int64_t display_width(std::string_view utf8);

// The label as a grid or an image shows it: controls (an ESC would start an escape sequence, a
// newline would break a row) become '?', bytes that are not well-formed UTF-8 U+FFFD.
std::string sanitize_label(std::string_view label);

}  // namespace qkv
