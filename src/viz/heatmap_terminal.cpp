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

// One panel: a header of key labels, then a line per query.
void append_grid(std::string& out, const Figure& f, const Panel& panel) {
  const TerminalStyle& style = f.terminal;
  const bool color = style.color != TerminalColor::none;
  const auto value_text = [&](double value) { return fmt::format("{:.{}f}", value, style.decimals); };

  // A cell is its fill up to its column's width, then (with annotate) the value right-aligned; the
  // fill is the shade, or a space on the colour background. Two columns make a cell about square.
  int64_t value_width = 0;
  if (f.annotate) {
    for (const double value : panel.values) value_width = std::max(value_width, display_width(value_text(value)));
  }
  const int64_t cell_width = f.annotate ? value_width + 1 : 2;
  int64_t label_width = 0;
  for (const std::string& label : f.row_labels) label_width = std::max(label_width, display_width(label));
  std::vector<int64_t> col_widths;
  for (const std::string& label : f.col_labels) col_widths.push_back(std::max(cell_width, display_width(label)));

  // Plain lines lose the blanks that empty cells would leave at their end, so piped text is stable.
  const auto end_line = [&] {
    if (!color) out.erase(out.find_last_not_of(' ') + 1);
    out += '\n';
  };

  out += pad_right("", label_width);
  for (int64_t j = 0; j < f.tk; ++j) out += ' ' + pad_left(f.col_labels[j], col_widths[j]);
  end_line();

  for (int64_t i = 0; i < f.tq; ++i) {
    out += pad_right(f.row_labels[i], label_width);
    for (int64_t j = 0; j < f.tk; ++j) {
      out += ' ';
      const double value = panel.values[static_cast<size_t>(i * f.tk + j)];
      const bool finite = std::isfinite(value);
      const std::string text = f.annotate ? value_text(value) : std::string();
      const Rgb rgb = finite ? f.color(value) : Rgb{};
      if (color && finite) {
        out += background_escape(rgb, style.color);
        if (!text.empty()) out += foreground_escape(rgb);
      }
      const std::string_view fill = color || !finite ? " " : shade(f.position(value));
      out += pad_left(text, col_widths[j], fill);
      if (color && finite) out += kReset;
    }
    end_line();
  }
}

// "scale: 0.000 [ ░▒▓█] 0.700", or the colour map as 16 coloured blanks between its ends.
void append_legend(std::string& out, const Figure& f) {
  const TerminalStyle& style = f.terminal;
  const auto value_text = [&](double value) { return fmt::format("{:.{}f}", value, style.decimals); };
  out += fmt::format("scale: {} ", value_text(f.layout.vmin));
  if (style.color != TerminalColor::none) {
    constexpr int kSteps = 16;
    for (int k = 0; k < kSteps; ++k) {
      out += background_escape(colormap_at(f.colormap, static_cast<double>(k) / (kSteps - 1)), style.color);
      out += ' ';
    }
    out += kReset;
  } else {
    out += '[';
    for (const std::string_view s : kShades) out += s;
    out += ']';
  }
  out += fmt::format(" {}\n", value_text(f.layout.vmax));
}

}  // namespace

std::string render_terminal(const Figure& figure) {
  std::string out;
  if (!figure.title.empty()) out += figure.title + '\n';
  for (const Panel& panel : figure.panels) {
    if (!panel.caption.empty()) out += panel.caption + '\n';
    append_grid(out, figure, panel);
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
