// The heatmap's figure as terminal text: one grid of cells per matrix drawn, columns aligned by
// display width, coloured with ANSI escapes or shaded with block characters.

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "heatmap_internal.hpp"
#include "qkv/core/text.hpp"

namespace qkv {
namespace heatmap_detail {
namespace {

// The xterm 256-colour cube: index 16 + 36 r + 6 g + b over these channel levels.
constexpr std::array<int, 6> kCubeLevels = {0, 95, 135, 175, 215, 255};

int nearest_cube_level(uint8_t channel) {
  int best = 0;
  for (int i = 1; i < 6; ++i) {
    if (std::abs(kCubeLevels[i] - channel) < std::abs(kCubeLevels[best] - channel)) best = i;
  }
  return best;
}

std::string background_escape(Rgb c, TerminalColor color) {
  if (color == TerminalColor::truecolor) return fmt::format("\x1b[48;2;{};{};{}m", c.r, c.g, c.b);
  return fmt::format("\x1b[48;5;{}m",
                     16 + 36 * nearest_cube_level(c.r) + 6 * nearest_cube_level(c.g) + nearest_cube_level(c.b));
}

// Black text on light backgrounds, bright white on dark ones.
std::string_view foreground_escape(Rgb c) { return is_light(c) ? "\x1b[30m" : "\x1b[97m"; }

constexpr std::string_view kReset = "\x1b[0m";
constexpr std::array<std::string_view, 5> kShades = {" ", "░", "▒", "▓", "█"};

std::string_view shade(double t) {
  const auto bin = static_cast<size_t>(std::clamp(std::floor(t * 5.0), 0.0, 4.0));
  return kShades[bin];
}

constexpr std::string_view kMaskedCell = "·";

// How a grid is laid out in its columns: each of the first `keys` keys takes `gap` blanks and then
// a cell `cell_width` columns wide, after a band of row labels `label_width` wide.
struct GridFit {
  int64_t label_width = 0;
  int64_t cell_width = 2;
  int64_t gap = 1;
  int64_t keys = 0;
  // Key labels as they fit, at their column's start and thinned to those that do not collide;
  // false: each column is as wide as its label, which is right-aligned on it.
  bool cut_labels = false;
  std::vector<int64_t> col_widths;  // without cut_labels: each column's width
};

// Key labels are cut to this many columns in a fitted grid: enough for a word or a number.
constexpr int64_t kCutLabelWidth = 8;

int64_t widest(const std::vector<std::string>& texts) {
  int64_t width = 0;
  for (const std::string& text : texts) width = std::max(width, display_width(text));
  return width;
}

// The grid as wide as its labels when that fits the terminal; else row labels cut to a quarter of
// it, then, while the keys do not fit: no blank between cells, cells one column wide (without
// values to hold), and at last only the first keys that fit.
GridFit fit_grid(const Figure& f, int64_t cell_width) {
  GridFit fit{.label_width = widest(f.row_labels),
              .cell_width = cell_width,
              .gap = 1,
              .keys = f.tk,
              .cut_labels = false,
              .col_widths = {}};
  int64_t natural = fit.label_width;
  for (const std::string& label : f.col_labels) {
    fit.col_widths.push_back(std::max(cell_width, display_width(label)));
    natural += 1 + fit.col_widths.back();
  }
  const int64_t max_width = f.terminal.max_width;
  if (max_width == 0 || natural <= max_width) return fit;

  fit.cut_labels = true;
  fit.col_widths.clear();
  fit.label_width = std::min(fit.label_width, max_width / 4);
  const int64_t room = max_width - fit.label_width;
  std::vector<std::pair<int64_t, int64_t>> choices = {{1, cell_width}};  // (gap, cell width)
  if (!f.annotate) choices.insert(choices.end(), {{0, 2}, {0, 1}});
  for (const auto& [gap, width] : choices) {
    fit.gap = gap;
    fit.cell_width = width;
    if (f.tk * (gap + width) <= room) return fit;
  }
  fit.keys = std::max<int64_t>(1, room / (fit.gap + fit.cell_width));
  return fit;
}

// The header of a fitted grid: each key's label cut to kCutLabelWidth, starting at its column, and
// left out where the one before it still runs.
std::string cut_header(const Figure& f, const GridFit& fit) {
  std::string out = pad_right("", fit.label_width);
  const int64_t end = fit.label_width + fit.keys * (fit.gap + fit.cell_width);
  int64_t used = fit.label_width;  // columns written so far
  int64_t free_from = fit.label_width;
  for (int64_t j = 0; j < fit.keys; ++j) {
    const int64_t at = fit.label_width + j * (fit.gap + fit.cell_width) + fit.gap;
    if (at < free_from) continue;
    const std::string& whole = f.col_labels[static_cast<size_t>(j)];
    const int64_t room = std::min(kCutLabelWidth, end - at);
    // A label cut to a column or two ("…", "1…") says nothing: the line ends without it.
    if (room < std::min<int64_t>(3, display_width(whole))) break;
    const std::string label = truncate_to_width(whole, room);
    out += pad_right("", at - used) + label;
    used = at + display_width(label);
    free_from = used + 1;
  }
  return out;
}

// One panel: a header of key labels, then a line per query.
void append_grid(std::string& out, const Figure& f, const Panel& panel, const GridFit& fit) {
  const TerminalStyle& style = f.terminal;
  const bool color = style.color != TerminalColor::none;
  const auto value_text = [&](double value) { return fmt::format("{:.{}f}", value, style.decimals); };

  // Plain lines lose the blanks that empty cells would leave at their end, so piped text is stable.
  const auto end_line = [&] {
    if (!color) out.erase(out.find_last_not_of(' ') + 1);
    out += '\n';
  };

  if (fit.cut_labels) {
    out += cut_header(f, fit);
  } else {
    out += pad_right("", fit.label_width);
    for (int64_t j = 0; j < f.tk; ++j) out += ' ' + pad_left(f.col_labels[j], fit.col_widths[j]);
  }
  end_line();

  const std::string gap(static_cast<size_t>(fit.gap), ' ');
  for (int64_t i = 0; i < f.tq; ++i) {
    out += pad_right(truncate_to_width(f.row_labels[i], fit.label_width), fit.label_width);
    for (int64_t j = 0; j < fit.keys; ++j) {
      out += gap;
      const int64_t width = fit.cut_labels ? fit.cell_width : fit.col_widths[j];
      const auto cell = static_cast<size_t>(i * f.tk + j);
      const double value = panel.values[cell];
      // A masked cell is no weight: it gets neither colour nor value, only the dot.
      if (panel.is_masked(cell)) {
        out += pad_left(kMaskedCell, width);
        continue;
      }
      const bool finite = std::isfinite(value);
      const std::string text = f.annotate ? value_text(value) : std::string();
      const Rgb rgb = finite ? f.color(value) : Rgb{};
      if (color && finite) {
        out += background_escape(rgb, style.color);
        if (!text.empty()) out += foreground_escape(rgb);
      }
      const std::string_view fill = color || !finite ? " " : shade(f.position(value));
      out += pad_left(text, width, fill);
      if (color && finite) out += kReset;
    }
    end_line();
  }
}

// What a fitted grid left out or changed, in a line of its own; empty when the grid is drawn whole.
std::string fit_note(const Figure& f, const GridFit& fit) {
  if (!fit.cut_labels) return {};
  if (fit.keys < f.tk) {
    return fmt::format("(keys 0–{} of {} shown to fit {} columns; a wider terminal or an image shows them all)",
                       fit.keys - 1, f.tk, f.terminal.max_width);
  }
  return fmt::format("(fitted to {} columns: key labels cut and thinned{})", f.terminal.max_width,
                     fit.cell_width == 1 ? ", each key one column" : "");
}

// "scale: 0.000 [ ░▒▓█] 0.700", or the colour map as coloured blanks between its ends; "≤" and "≥"
// on an end that values go beyond, and what a masked cell looks like when there are some.
void append_legend(std::string& out, const Figure& f) {
  const TerminalStyle& style = f.terminal;
  const auto value_text = [&](double value) { return fmt::format("{:.{}f}", value, style.decimals); };
  const std::string low = fmt::format("scale: {}{} ", f.layout.clipped_low ? "≤" : "", value_text(f.layout.vmin));
  const std::string high = fmt::format(" {}{}", f.layout.clipped_high ? "≥" : "", value_text(f.layout.vmax));
  const std::string masked = f.has_mask ? fmt::format(", {} masked", kMaskedCell) : std::string();
  std::string line = low;
  if (style.color != TerminalColor::none) {
    // As many colours as the line has room for, up to 16.
    const int64_t room =
        style.max_width == 0 ? 16 : style.max_width - display_width(low) - display_width(high) - display_width(masked);
    const int steps = static_cast<int>(std::clamp<int64_t>(room, 5, 16));
    for (int k = 0; k < steps; ++k) {
      line += background_escape(colormap_at(f.colormap, static_cast<double>(k) / (steps - 1)), style.color);
      line += ' ';
    }
    line += kReset;
    out += line + high + masked + '\n';
    return;
  }
  line += '[';
  for (const std::string_view s : kShades) line += s;
  line += ']';
  // Only plain text can be wrapped (an escape would count as columns): many decimals can need it.
  out += wrap_text(line + high + masked + '\n', style.max_width);
}

}  // namespace

std::string render_terminal(const Figure& figure) {
  const int64_t max_width = figure.terminal.max_width;
  std::string out;
  if (!figure.title.empty()) out += wrap_text(figure.title + '\n', max_width);
  // Every panel gets the cell width of the widest value, so that heads line up.
  int64_t value_width = 0;
  if (figure.annotate) {
    for (const Panel& panel : figure.panels) {
      for (size_t cell = 0; cell < panel.values.size(); ++cell) {
        if (panel.is_masked(cell)) continue;
        const std::string text = fmt::format("{:.{}f}", panel.values[cell], figure.terminal.decimals);
        value_width = std::max(value_width, display_width(text));
      }
    }
  }
  // A cell is its fill up to its column's width, then (with annotate) the value right-aligned; the
  // fill is the shade, or a space on the colour background. Two columns make a cell about square.
  const GridFit fit = fit_grid(figure, figure.annotate ? value_width + 1 : 2);
  const std::string note = fit_note(figure, fit);
  for (const Panel& panel : figure.panels) {
    if (!panel.caption.empty()) out += wrap_text(panel.caption + '\n', max_width);
    append_grid(out, figure, panel, fit);
    if (!note.empty()) out += wrap_text(note + '\n', max_width);
    if (figure.terminal.legend) append_legend(out, figure);
  }
  return out;
}

}  // namespace heatmap_detail

bool terminal_supports_truecolor() {
  const char* colorterm = std::getenv("COLORTERM");
  return colorterm != nullptr && (std::strcmp(colorterm, "truecolor") == 0 || std::strcmp(colorterm, "24bit") == 0);
}

bool terminal_supports_color(std::FILE* stream) {
  const char* no_color = std::getenv("NO_COLOR");
  if (no_color != nullptr && *no_color != '\0') return false;
  // A terminal without TERM is usually a bare one (a service, a container exec) that may not
  // understand escapes at all.
  const char* term = std::getenv("TERM");
  if (term == nullptr || *term == '\0' || std::strcmp(term, "dumb") == 0) return false;
  return stream != nullptr && isatty(fileno(stream)) == 1;
}

}  // namespace qkv
