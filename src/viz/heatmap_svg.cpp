// SVG heatmaps, written by hand rather than through cairo's SVG surface: cairo would draw each cell
// as a <path> and each label as glyph outlines. Here a cell is a <rect> with a <title> (its query,
// key and exact value, shown as a tooltip), and labels are <text>: the file is small, its text can
// be searched and selected, and it can be restyled or edited. The layout is the PNG's, measured with
// pango in the same fonts, which the file names first in its font-family list.
//
// Only cells and the outlines of marked cells are <rect> elements (the background, frames and ticks
// are <path>s), and the cells' are the children of <g class="cells">, so a reader can count them. A
// matrix of more than kMaxVectorCells cells is one embedded PNG, a pixel per cell, scaled without
// smoothing: a million <rect>s would make a file of a hundred megabytes.

#include <fmt/format.h>

#include "heatmap_internal.hpp"

namespace qkv::heatmap_detail {
namespace {

std::string hex(Rgb c) { return fmt::format("#{:02x}{:02x}{:02x}", c.r, c.g, c.b); }

std::string base64(std::string_view bytes) {
  constexpr std::string_view kDigits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t chunk = static_cast<uint32_t>(static_cast<unsigned char>(bytes[i])) << 16;
    if (i + 1 < bytes.size()) chunk |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i + 1])) << 8;
    if (i + 2 < bytes.size()) chunk |= static_cast<unsigned char>(bytes[i + 2]);
    out += kDigits[(chunk >> 18) & 63];
    out += kDigits[(chunk >> 12) & 63];
    out += i + 1 < bytes.size() ? kDigits[(chunk >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? kDigits[chunk & 63] : '=';
  }
  return out;
}

// A filled axis-aligned rectangle that is not a cell.
void box(std::string& out, double x, double y, double w, double h, std::string_view fill) {
  fmt::format_to(std::back_inserter(out), R"svg(<path d="M{} {}h{}v{}h{}z" fill="{}"/>)svg", x, y, w, h, -w, fill);
  out += '\n';
}

std::string_view anchor_name(Anchor a) { return a == Anchor::start ? "start" : a == Anchor::middle ? "middle" : "end"; }

// Ticks as <path>s, text as <text> elements: horizontally anchored at x, vertically centred on y.
class SvgPainter final : public Painter {
 public:
  explicit SvgPainter(std::string& out) : out_(out) {}

  void box(double x, double y, double w, double h, Rgb color) override {
    qkv::heatmap_detail::box(out_, x, y, w, h, hex(color));
  }

  void text(std::string_view content, double size, bool bold, Rgb color, double x, double y, Anchor anchor) override {
    fmt::format_to(
        std::back_inserter(out_),
        R"svg(<text x="{}" y="{}" font-size="{}" fill="{}" text-anchor="{}" dominant-baseline="central"{}>{}</text>)svg",
        x, y, size, hex(color), anchor_name(anchor), bold ? " font-weight=\"bold\"" : "", escape_markup(content));
    out_ += '\n';
  }

  void rotated_text(std::string_view content, double size, Rgb color, double x, double y, Anchor anchor) override {
    fmt::format_to(std::back_inserter(out_),
                   R"svg(<text transform="translate({} {}) rotate(-90)" font-size="{}" fill="{}" text-anchor="{}" )svg"
                   R"svg(dominant-baseline="central">{}</text>)svg",
                   x, y, size, hex(color), anchor_name(anchor), escape_markup(content));
    out_ += '\n';
  }

 private:
  std::string& out_;
};

// The outlines of the marked rows, columns and cells, as the PNG draws them: inside their cells, on
// whole pixels.
void marks_svg(std::string& out, const Figure& f, const HeatmapPanelLayout& p) {
  if (f.marks.empty()) return;
  const auto width = static_cast<double>(kMarkWidth);
  out += "<g class=\"marks\" shape-rendering=\"crispEdges\">\n";
  for (const Mark& mark : f.marks) {
    const MarkBox b = mark_box(mark, p);
    const std::string tooltip = fmt::format("<title>{}</title>", escape_markup(mark.tooltip));
    if (!b.outline) {
      fmt::format_to(std::back_inserter(out), R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="{}">{}</rect>)svg",
                     b.x, b.y, b.width, b.height, hex(mark.color), tooltip);
      out += '\n';
      continue;
    }
    // A stroke is centred on its path: half its width in from the cell's edge puts it inside.
    fmt::format_to(
        std::back_inserter(out),
        R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="{}" stroke-width="{}">{}</rect>)svg",
        b.x + width / 2, b.y + width / 2, b.width - width, b.height - width, hex(mark.color), width, tooltip);
    out += '\n';
    if (b.lining) {
      fmt::format_to(std::back_inserter(out),
                     R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="{}" stroke-width="1"/>)svg",
                     b.x + width + 0.5, b.y + width + 0.5, b.width - 2 * width - 1, b.height - 2 * width - 1,
                     hex(kMarkLining));
      out += '\n';
    }
  }
  out += "</g>\n";
}

// The PNG's triangle past a clipped end of the colour bar, with the clipping as its tooltip.
void clip_marker_svg(std::string& out, const PixelRect& r, bool up, Rgb color, const std::string& tooltip) {
  if (r.height == 0) return;
  const auto x = static_cast<double>(r.x);
  const auto w = static_cast<double>(r.width);
  const auto base = static_cast<double>(up ? r.y + r.height : r.y);
  const auto tip = static_cast<double>(up ? r.y : r.y + r.height);
  fmt::format_to(std::back_inserter(out),
                 R"svg(<path class="clip-{}" d="M{} {}H{}L{} {}z" fill="{}" stroke="{}"><title>{}</title></path>)svg",
                 up ? "high" : "low", x, base, x + w, x + w / 2, tip, hex(color), hex(kMutedInk),
                 escape_markup(tooltip));
  out += '\n';
}

void panel_svg(std::string& out, SvgPainter& painter, const Figure& f, const Panel& panel,
               const HeatmapPanelLayout& p) {
  const auto mx = static_cast<double>(p.matrix.x);
  const auto my = static_cast<double>(p.matrix.y);
  const auto cw = static_cast<double>(p.cell_width);
  const auto ch = static_cast<double>(p.cell_height);
  paint_caption(painter, panel, p);
  if (f.tq * f.tk <= kMaxVectorCells) {
    fmt::format_to(std::back_inserter(out), "<g class=\"cells\" data-head=\"{}\" shape-rendering=\"crispEdges\">\n",
                   panel.head);
    for (int64_t i = 0; i < f.tq; ++i) {
      for (int64_t j = 0; j < f.tk; ++j) {
        const auto cell = static_cast<size_t>(i * f.tk + j);
        const double value = panel.values[cell];
        if (panel.is_masked(cell)) {
          fmt::format_to(std::back_inserter(out),
                         R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="url(#qkv-masked)" class="masked">)svg"
                         R"svg(<title>{} → {}: masked</title></rect>)svg",
                         mx + static_cast<double>(j) * cw, my + static_cast<double>(i) * ch, cw, ch,
                         escape_markup(f.row_labels[static_cast<size_t>(i)]),
                         escape_markup(f.col_labels[static_cast<size_t>(j)]));
          out += '\n';
          continue;
        }
        fmt::format_to(
            std::back_inserter(out),
            R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{} → {}: {}</title></rect>)svg",
            mx + static_cast<double>(j) * cw, my + static_cast<double>(i) * ch, cw, ch, hex(f.color(value)),
            escape_markup(f.row_labels[static_cast<size_t>(i)]), escape_markup(f.col_labels[static_cast<size_t>(j)]),
            f.exact(value));
        out += '\n';
      }
    }
    out += "</g>\n";
  } else {
    fmt::format_to(
        std::back_inserter(out),
        R"svg(<image x="{}" y="{}" width="{}" height="{}" preserveAspectRatio="none" )svg"
        R"svg(style="image-rendering:pixelated;image-rendering:crisp-edges" href="data:image/png;base64,{}"/>)svg",
        mx, my, p.matrix.width, p.matrix.height, base64(matrix_png(f, panel)));
    out += '\n';
  }
  marks_svg(out, f, p);
  if (f.annotate) {
    out += "<g class=\"annotations\">\n";
    paint_annotations(painter, f, panel, p);
    out += "</g>\n";
  }
  paint_axis_labels(painter, f, p);
}

}  // namespace

std::string escape_markup(std::string_view text, Markup markup) {
  const bool xml = markup == Markup::xml;
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '&') {
      out += "&amp;";
    } else if (c == '<') {
      out += "&lt;";
    } else if (c == '>') {
      out += "&gt;";
    } else if (xml && c == '"') {
      out += "&quot;";
    } else if (xml && text.substr(i, 2) == "\xEF\xBF" && i + 2 < text.size() &&
               (text[i + 2] == '\xBE' || text[i + 2] == '\xBF')) {
      out += "\uFFFD";
      i += 2;
    } else {
      out += c;
    }
  }
  return out;
}

std::string render_svg(const Figure& f) {
  const HeatmapLayout& layout = f.layout;
  std::string out;
  out += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  fmt::format_to(std::back_inserter(out),
                 R"svg(<svg xmlns="http://www.w3.org/2000/svg" width="{0}" height="{1}" viewBox="0 0 {0} {1}" )svg"
                 R"svg(font-family="{2}">)svg",
                 layout.width, layout.height, escape_markup(kFontFamily));
  out += '\n';
  fmt::format_to(std::back_inserter(out), "<title>{}</title>\n",
                 escape_markup(f.title.empty() ? "attention weights (rows = queries, columns = keys)" : f.title));
  out += "<defs><linearGradient id=\"qkv-colormap\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">\n";
  const auto samples = colormap_samples(f.colormap);
  for (size_t k = 0; k < samples.size(); ++k) {
    fmt::format_to(std::back_inserter(out), "<stop offset=\"{}\" stop-color=\"{}\"/>\n",
                   static_cast<double>(k) / static_cast<double>(samples.size() - 1), hex(samples[k]));
  }
  out += "</linearGradient>\n";
  // The PNG's hatching: a light grey tile with a diagonal line, repeated across each masked cell.
  fmt::format_to(std::back_inserter(out),
                 R"svg(<pattern id="qkv-masked" width="{0}" height="{0}" patternUnits="userSpaceOnUse" )svg"
                 R"svg(patternTransform="rotate(45)"><path d="M0 0h{0}v{0}h-{0}z" fill="{1}"/>)svg"
                 R"svg(<path d="M0 0v{0}" stroke="{2}" stroke-width="1.5"/></pattern>)svg",
                 kMaskedHatchGap, hex(kMaskedFill), hex(kMaskedHatch));
  out += "\n</defs>\n";
  box(out, 0, 0, static_cast<double>(layout.width), static_cast<double>(layout.height), "#ffffff");

  SvgPainter painter(out);
  paint_title(painter, f);
  for (size_t k = 0; k < f.panels.size(); ++k) panel_svg(out, painter, f, f.panels[k], layout.panels[k]);
  paint_axis_titles(painter, f);
  paint_key(painter, f);

  const auto bx = static_cast<double>(layout.colorbar.x);
  const auto by = static_cast<double>(layout.colorbar.y);
  const auto bw = static_cast<double>(layout.colorbar.width);
  const auto bh = static_cast<double>(layout.colorbar.height);
  box(out, bx - 1, by - 1, bw + 2, bh + 2, hex(kMutedInk));
  box(out, bx, by, bw, bh, "url(#qkv-colormap)");
  clip_marker_svg(out, layout.clip_high_marker, true, colormap_at(f.colormap, 1.0),
                  fmt::format("values above {} are drawn as {}", f.exact(layout.vmax), f.exact(layout.vmax)));
  clip_marker_svg(out, layout.clip_low_marker, false, colormap_at(f.colormap, 0.0),
                  fmt::format("values below {} are drawn as {}", f.exact(layout.vmin), f.exact(layout.vmin)));
  paint_colorbar_ticks(painter, f);
  out += "</svg>\n";
  return out;
}

}  // namespace qkv::heatmap_detail
