// The text and ticks around the cells of an image, placed once for PNG, PDF and SVG alike: each
// renderer hands its Painter to these and draws its cells, marks and colour bar itself.

#include <algorithm>
#include <cmath>

#include "heatmap_internal.hpp"

namespace qkv::heatmap_detail {
namespace {

double centre_x(const PixelRect& r) { return static_cast<double>(r.x) + static_cast<double>(r.width) / 2; }
double centre_y(const PixelRect& r) { return static_cast<double>(r.y) + static_cast<double>(r.height) / 2; }

}  // namespace

void paint_title(Painter& painter, const Figure& f) {
  if (f.layout.title.height > 0) {
    painter.text(f.title, kTitleSize, true, kInk, centre_x(f.layout.title), centre_y(f.layout.title), Anchor::middle);
  }
}

void paint_caption(Painter& painter, const Panel& panel, const HeatmapPanelLayout& p) {
  if (p.caption.height > 0) {
    painter.text(panel.caption, kCaptionSize, false, kInk, centre_x(p.matrix), centre_y(p.caption), Anchor::middle);
  }
}

void paint_annotations(Painter& painter, const Figure& f, const Panel& panel, const HeatmapPanelLayout& p) {
  const auto mx = static_cast<double>(p.matrix.x);
  const auto my = static_cast<double>(p.matrix.y);
  const auto cw = static_cast<double>(p.cell_width);
  const auto ch = static_cast<double>(p.cell_height);
  for (int64_t i = 0; i < f.tq; ++i) {
    for (int64_t j = 0; j < f.tk; ++j) {
      const auto cell = static_cast<size_t>(i * f.tk + j);
      if (panel.is_masked(cell)) continue;
      const double value = panel.values[cell];
      const Rgb ink = is_light(f.color(value)) ? Rgb{0, 0, 0} : Rgb{255, 255, 255};
      painter.text(annotation(value), kAnnotationSize, false, ink, mx + (static_cast<double>(j) + 0.5) * cw,
                   my + (static_cast<double>(i) + 0.5) * ch, Anchor::middle);
    }
  }
}

// Ticks are whole-pixel rectangles, crisp in a PNG; labels are centred on their cell.
void paint_axis_labels(Painter& painter, const Figure& f, const HeatmapPanelLayout& p) {
  const auto mx = static_cast<double>(p.matrix.x);
  const auto my = static_cast<double>(p.matrix.y);
  const auto cw = static_cast<double>(p.cell_width);
  const auto ch = static_cast<double>(p.cell_height);
  if (p.row_labels.width > 0) {
    for (int64_t i = 0; i < f.tq; i += p.row_label_step) {
      const double centre = my + (static_cast<double>(i) + 0.5) * ch;
      painter.box(mx - kTickLength, std::floor(centre), kTickLength, 1, kMutedInk);
      painter.text(f.row_text[static_cast<size_t>(i)], kLabelSize, false, kInk,
                   static_cast<double>(p.row_labels.x + p.row_labels.width), centre, Anchor::end);
    }
  }
  if (p.col_labels.height > 0) {
    const double bottom = my + static_cast<double>(p.matrix.height);
    for (int64_t j = 0; j < f.tk; j += p.col_label_step) {
      const double centre = mx + (static_cast<double>(j) + 0.5) * cw;
      painter.box(std::floor(centre), bottom, 1, kTickLength, kMutedInk);
      const std::string& label = f.col_text[static_cast<size_t>(j)];
      if (p.col_labels_rotated) {
        painter.rotated_text(label, kLabelSize, kInk, centre, static_cast<double>(p.col_labels.y), Anchor::end);
      } else {
        painter.text(label, kLabelSize, false, kInk, centre, centre_y(p.col_labels), Anchor::middle);
      }
    }
  }
}

void paint_axis_titles(Painter& painter, const Figure& f) {
  const PixelRect& rows = f.layout.row_axis_title;
  painter.rotated_text("queries", kAxisTitleSize, kMutedInk, centre_x(rows), centre_y(rows), Anchor::middle);
  const PixelRect& cols = f.layout.col_axis_title;
  painter.text("keys", kAxisTitleSize, false, kMutedInk, centre_x(cols), centre_y(cols), Anchor::middle);
}

void paint_colorbar_ticks(Painter& painter, const Figure& f) {
  const HeatmapLayout& layout = f.layout;
  const auto x = static_cast<double>(layout.colorbar.x);
  const auto y = static_cast<double>(layout.colorbar.y);
  const auto w = static_cast<double>(layout.colorbar.width);
  const auto h = static_cast<double>(layout.colorbar.height);
  for (size_t k = 0; k < layout.ticks.size(); ++k) {
    const double ty = y + (1.0 - f.position(layout.ticks[k])) * h;
    painter.box(x + w, std::min(std::floor(ty), y + h - 1), kTickLength, 1, kMutedInk);
    painter.text(f.tick_text[k], kTickSize, false, kInk, static_cast<double>(layout.colorbar_labels.x), ty,
                 Anchor::start);
  }
}

void paint_key(Painter& painter, const Figure& f) {
  const auto frame = [&](double x, double y, double w, double h, double t, Rgb color) {
    painter.box(x, y, w, t, color);
    painter.box(x, y + h - t, w, t, color);
    painter.box(x, y + t, t, h - 2 * t, color);
    painter.box(x + w - t, y + t, t, h - 2 * t, color);
  };
  for (size_t k = 0; k < f.keys.size() && k < f.layout.key.size(); ++k) {
    const PixelRect& s = f.layout.key[k].swatch;
    const auto x = static_cast<double>(s.x);
    const auto y = static_cast<double>(s.y);
    const auto w = static_cast<double>(s.width);
    const auto h = static_cast<double>(s.height);
    const auto t = static_cast<double>(kMarkWidth);
    // The swatch is a white cell framed as a mark is: the frame, then its white lining.
    painter.box(x, y, w, h, kMarkLining);
    frame(x, y, w, h, t, f.keys[k].color);
    painter.box(x + t + 1, y + t + 1, w - 2 * t - 2, h - 2 * t - 2, kMutedInk);
    const PixelRect& text = f.layout.key[k].text;
    painter.text(f.keys[k].text, kLabelSize, false, kInk, static_cast<double>(text.x), centre_y(text), Anchor::start);
  }
}

}  // namespace qkv::heatmap_detail
