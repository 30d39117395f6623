// PNG and PDF heatmaps through cairo, text through pango.
//
// The figure is drawn to a surface that writes into memory (an image surface encoded by
// cairo_surface_write_to_png_stream, or a PDF stream surface), so a failure leaves no file: the
// caller writes the bytes atomically. Cells sit on whole pixels, so in a PNG the centre of a cell
// has exactly the colour map's colour for its value. Matrices of more than kMaxVectorCells cells
// are drawn as one image of Tk × Tq pixels scaled without interpolation, which is faster to draw
// and gives a PDF one small image instead of a million rectangles.

#include <cairo-pdf.h>
#include <fmt/format.h>

#include <cmath>
#include <memory>
#include <numbers>

#include "heatmap_internal.hpp"
#include "qkv/core/error.hpp"

namespace qkv::heatmap_detail {
namespace {

constexpr double kPdfPointsPerPixel = 0.75;  // 72 pt per inch at 96 px per inch

struct SurfaceDeleter {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};
struct ContextDeleter {
  void operator()(cairo_t* cr) const { cairo_destroy(cr); }
};
struct LayoutDeleter {
  void operator()(PangoLayout* layout) const { g_object_unref(layout); }
};
using Surface = std::unique_ptr<cairo_surface_t, SurfaceDeleter>;
using Context = std::unique_ptr<cairo_t, ContextDeleter>;
using Layout = std::unique_ptr<PangoLayout, LayoutDeleter>;

cairo_status_t append_to_string(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

void check(cairo_status_t status, std::string_view what) {
  if (status != CAIRO_STATUS_SUCCESS) {
    throw IoError(fmt::format("heatmap: cairo failed while {}: {}", what, cairo_status_to_string(status)));
  }
}

void set_color(cairo_t* cr, Rgb c) { cairo_set_source_rgb(cr, c.r / 255.0, c.g / 255.0, c.b / 255.0); }

void fill_rect(cairo_t* cr, double x, double y, double w, double h, Rgb color) {
  set_color(cr, color);
  cairo_rectangle(cr, x, y, w, h);
  cairo_fill(cr);
}

// Ticks as cairo rectangles, text with pango: horizontally anchored at x, vertically centred on y,
// along the current rotation.
class CairoPainter final : public Painter {
 public:
  explicit CairoPainter(cairo_t* cr) : cr_(cr), layout_(pango_cairo_create_layout(cr)) {
    configure_context(pango_layout_get_context(layout_.get()));
    pango_layout_context_changed(layout_.get());
  }

  void box(double x, double y, double w, double h, Rgb color) override { fill_rect(cr_, x, y, w, h, color); }

  void text(std::string_view content, double size, bool bold, Rgb color, double x, double y, Anchor anchor) override {
    set_text(layout_.get(), content, size, bold);
    pango_cairo_update_layout(cr_, layout_.get());
    PangoRectangle logical;
    pango_layout_get_extents(layout_.get(), nullptr, &logical);
    const double width = static_cast<double>(logical.width) / PANGO_SCALE;
    const double height = static_cast<double>(logical.height) / PANGO_SCALE;
    const double shift = anchor == Anchor::start ? 0.0 : anchor == Anchor::middle ? width / 2 : width;
    set_color(cr_, color);
    cairo_move_to(cr_, x - shift - static_cast<double>(logical.x) / PANGO_SCALE, y - height / 2);
    pango_cairo_show_layout(cr_, layout_.get());
  }

  void rotated_text(std::string_view content, double size, Rgb color, double x, double y, Anchor anchor) override {
    cairo_save(cr_);
    cairo_translate(cr_, x, y);
    cairo_rotate(cr_, -std::numbers::pi / 2);
    text(content, size, false, color, 0.0, 0.0, anchor);
    cairo_restore(cr_);
  }

 private:
  cairo_t* cr_;
  Layout layout_;
};

// One pixel per cell, in the figure's colours.
Surface cell_image(const Figure& f, const Panel& panel) {
  Surface image(cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(f.tk), static_cast<int>(f.tq)));
  check(cairo_surface_status(image.get()), "allocating the matrix image");
  cairo_surface_flush(image.get());
  unsigned char* data = cairo_image_surface_get_data(image.get());
  const int stride = cairo_image_surface_get_stride(image.get());
  for (int64_t i = 0; i < f.tq; ++i) {
    auto* row = reinterpret_cast<uint32_t*>(data + i * stride);
    for (int64_t j = 0; j < f.tk; ++j) {
      const auto cell = static_cast<size_t>(i * f.tk + j);
      const Rgb c = panel.is_masked(cell) ? kMaskedFill : f.color(panel.values[cell]);
      row[j] = (uint32_t{c.r} << 16) | (uint32_t{c.g} << 8) | uint32_t{c.b};
    }
  }
  cairo_surface_mark_dirty(image.get());
  return image;
}

// Diagonal lines across the masked cells: the matrix is crossed once, clipped to those cells.
void draw_hatching(cairo_t* cr, const Figure& f, const Panel& panel, const HeatmapPanelLayout& p) {
  if (panel.masked.empty()) return;
  const auto x0 = static_cast<double>(p.matrix.x);
  const auto y0 = static_cast<double>(p.matrix.y);
  const auto cw = static_cast<double>(p.cell_width);
  const auto ch = static_cast<double>(p.cell_height);
  cairo_save(cr);
  bool any = false;
  for (int64_t i = 0; i < f.tq; ++i) {
    for (int64_t j = 0; j < f.tk; ++j) {
      if (!panel.is_masked(static_cast<size_t>(i * f.tk + j))) continue;
      cairo_rectangle(cr, x0 + static_cast<double>(j) * cw, y0 + static_cast<double>(i) * ch, cw, ch);
      any = true;
    }
  }
  if (any) {
    cairo_clip(cr);
    const auto w = static_cast<double>(p.matrix.width);
    const auto h = static_cast<double>(p.matrix.height);
    set_color(cr, kMaskedHatch);
    cairo_set_line_width(cr, 1.0);
    for (double d = 0.0; d < w + h; d += static_cast<double>(kMaskedHatchGap)) {
      cairo_move_to(cr, x0 + d, y0);
      cairo_line_to(cr, x0 + d - h, y0 + h);
    }
    cairo_stroke(cr);
  }
  cairo_new_path(cr);
  cairo_restore(cr);
}

void draw_cells(cairo_t* cr, const Figure& f, const Panel& panel, const HeatmapPanelLayout& p, bool vector_seams) {
  const auto x0 = static_cast<double>(p.matrix.x);
  const auto y0 = static_cast<double>(p.matrix.y);
  const auto cw = static_cast<double>(p.cell_width);
  const auto ch = static_cast<double>(p.cell_height);
  if (f.tq * f.tk <= kMaxVectorCells) {
    // PDF viewers antialias each rectangle's edges, which shows as hairlines between cells: every
    // cell but the last of a row or column reaches half a pixel under its successor, drawn after it.
    const double overlap = vector_seams ? 0.5 : 0.0;
    for (int64_t i = 0; i < f.tq; ++i) {
      for (int64_t j = 0; j < f.tk; ++j) {
        const double w = cw + (j + 1 < f.tk ? overlap : 0.0);
        const double h = ch + (i + 1 < f.tq ? overlap : 0.0);
        const auto cell = static_cast<size_t>(i * f.tk + j);
        fill_rect(cr, x0 + static_cast<double>(j) * cw, y0 + static_cast<double>(i) * ch, w, h,
                  panel.is_masked(cell) ? kMaskedFill : f.color(panel.values[cell]));
      }
    }
    draw_hatching(cr, f, panel, p);
    return;
  }
  const Surface image = cell_image(f, panel);
  cairo_save(cr);
  cairo_translate(cr, x0, y0);
  cairo_scale(cr, cw, ch);
  cairo_set_source_surface(cr, image.get(), 0, 0);
  cairo_pattern_set_filter(cairo_get_source(cr), CAIRO_FILTER_NEAREST);
  cairo_rectangle(cr, 0, 0, static_cast<double>(f.tk), static_cast<double>(f.tq));
  cairo_fill(cr);
  cairo_restore(cr);
}

// The area between two nested rectangles, the inner one inset by `inset` on every side.
void fill_frame(cairo_t* cr, double x, double y, double w, double h, double inset, Rgb color) {
  set_color(cr, color);
  cairo_save(cr);
  cairo_set_fill_rule(cr, CAIRO_FILL_RULE_EVEN_ODD);
  cairo_rectangle(cr, x, y, w, h);
  cairo_rectangle(cr, x + inset, y + inset, w - 2 * inset, h - 2 * inset);
  cairo_fill(cr);
  cairo_restore(cr);
}

// Outlines sit inside their cell, on whole pixels, so that neighbouring marks stay apart and the
// frame is crisp in a PNG.
void draw_marks(cairo_t* cr, const Figure& f, const HeatmapPanelLayout& p) {
  const auto width = static_cast<double>(kMarkWidth);
  for (const Mark& mark : f.marks) {
    const MarkBox b = mark_box(mark, p);
    if (!b.outline) {
      fill_rect(cr, b.x, b.y, b.width, b.height, mark.color);
      continue;
    }
    fill_frame(cr, b.x, b.y, b.width, b.height, width, mark.color);
    if (b.lining) {
      fill_frame(cr, b.x + width, b.y + width, b.width - 2 * width, b.height - 2 * width, 1.0, kMarkLining);
    }
  }
}

void draw_panel(cairo_t* cr, CairoPainter& painter, const Figure& f, const Panel& panel, const HeatmapPanelLayout& p,
                bool vector_seams) {
  paint_caption(painter, panel, p);
  draw_cells(cr, f, panel, p, vector_seams);
  draw_marks(cr, f, p);
  if (f.annotate) paint_annotations(painter, f, panel, p);
  paint_axis_labels(painter, f, p);
}

// A triangle pointing away from the bar, in the colour of the bar's end: values beyond it are drawn
// in that colour.
void draw_clip_marker(cairo_t* cr, const PixelRect& r, bool up, Rgb color) {
  if (r.height == 0) return;
  const auto x = static_cast<double>(r.x);
  const auto y = static_cast<double>(r.y);
  const auto w = static_cast<double>(r.width);
  const auto h = static_cast<double>(r.height);
  const double base = up ? y + h : y;
  cairo_move_to(cr, x, base);
  cairo_line_to(cr, x + w, base);
  cairo_line_to(cr, x + w / 2, up ? y : y + h);
  cairo_close_path(cr);
  set_color(cr, color);
  cairo_fill_preserve(cr);
  set_color(cr, kMutedInk);
  cairo_set_line_width(cr, 1.0);
  cairo_stroke(cr);
}

void draw_colorbar(cairo_t* cr, CairoPainter& painter, const Figure& f) {
  const HeatmapLayout& layout = f.layout;
  const auto x = static_cast<double>(layout.colorbar.x);
  const auto y = static_cast<double>(layout.colorbar.y);
  const auto w = static_cast<double>(layout.colorbar.width);
  const auto h = static_cast<double>(layout.colorbar.height);
  cairo_pattern_t* gradient = cairo_pattern_create_linear(0, y + h, 0, y);
  const auto samples = colormap_samples(f.colormap);
  for (size_t k = 0; k < samples.size(); ++k) {
    const Rgb c = samples[k];
    cairo_pattern_add_color_stop_rgb(gradient, static_cast<double>(k) / static_cast<double>(samples.size() - 1),
                                     c.r / 255.0, c.g / 255.0, c.b / 255.0);
  }
  cairo_set_source(cr, gradient);
  cairo_rectangle(cr, x, y, w, h);
  cairo_fill(cr);
  cairo_pattern_destroy(gradient);

  set_color(cr, kMutedInk);
  cairo_set_line_width(cr, 1.0);
  cairo_rectangle(cr, x - 0.5, y - 0.5, w + 1, h + 1);
  cairo_stroke(cr);
  draw_clip_marker(cr, layout.clip_high_marker, true, colormap_at(f.colormap, 1.0));
  draw_clip_marker(cr, layout.clip_low_marker, false, colormap_at(f.colormap, 0.0));
  paint_colorbar_ticks(painter, f);
}

void draw_figure(cairo_t* cr, const Figure& f, bool vector_seams) {
  const HeatmapLayout& layout = f.layout;
  set_color(cr, {255, 255, 255});
  cairo_paint(cr);
  CairoPainter painter(cr);
  paint_title(painter, f);
  for (size_t k = 0; k < f.panels.size(); ++k) draw_panel(cr, painter, f, f.panels[k], layout.panels[k], vector_seams);
  paint_axis_titles(painter, f);
  paint_key(painter, f);
  draw_colorbar(cr, painter, f);
}

}  // namespace

std::string matrix_png(const Figure& f, const Panel& panel) {
  std::string bytes;
  check(cairo_surface_write_to_png_stream(cell_image(f, panel).get(), append_to_string, &bytes),
        "encoding the matrix image");
  return bytes;
}

std::string render_cairo(const Figure& f, HeatmapFormat format) {
  const HeatmapLayout& layout = f.layout;
  std::string bytes;
  if (format == HeatmapFormat::png) {
    Surface surface(cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(layout.width),
                                               static_cast<int>(layout.height)));
    check(cairo_surface_status(surface.get()), fmt::format("allocating a {} × {} image", layout.width, layout.height));
    {
      Context cr(cairo_create(surface.get()));
      draw_figure(cr.get(), f, false);
      check(cairo_status(cr.get()), "drawing the PNG");
    }
    check(cairo_surface_write_to_png_stream(surface.get(), append_to_string, &bytes), "encoding the PNG");
    return bytes;
  }
  Surface surface(cairo_pdf_surface_create_for_stream(append_to_string, &bytes,
                                                      static_cast<double>(layout.width) * kPdfPointsPerPixel,
                                                      static_cast<double>(layout.height) * kPdfPointsPerPixel));
  check(cairo_surface_status(surface.get()), "starting the PDF");
  cairo_pdf_surface_set_metadata(surface.get(), CAIRO_PDF_METADATA_TITLE,
                                 f.title.empty() ? "attention weights" : f.title.c_str());
  cairo_pdf_surface_set_metadata(surface.get(), CAIRO_PDF_METADATA_CREATOR, "qkv heatmap");
  {
    Context cr(cairo_create(surface.get()));
    cairo_scale(cr.get(), kPdfPointsPerPixel, kPdfPointsPerPixel);
    draw_figure(cr.get(), f, true);
    check(cairo_status(cr.get()), "drawing the PDF");
  }
  cairo_surface_finish(surface.get());
  check(cairo_surface_status(surface.get()), "writing the PDF");
  return bytes;
}

}  // namespace qkv::heatmap_detail
