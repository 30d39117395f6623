// The heatmap's figure and layout, shared by every file format: which matrices are drawn, their
// scale and labels, and where each piece lands. Text is measured with pango in the fonts the
// images use, so that labels never overlap the cells however long or wide (CJK) they are.

#include <fmt/format.h>
#include <pango/pangocairo.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>

#include "heatmap_internal.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/text.hpp"

namespace qkv {
namespace heatmap_detail {
namespace {

// ---- Geometry, in pixels -----------------------------------------------------------------------

constexpr int64_t kMargin = 16;
constexpr int64_t kMaxCell = 48;      // a 6×6 matrix gets 48 px cells
constexpr int64_t kTargetSide = 768;  // the side a matrix (or a grid of them) aims at
constexpr int64_t kMinSide = 96;      // a matrix is at least this tall and wide (unless cells hit kMaxCell)
constexpr int64_t kMaxLabelWidth = 160;
constexpr int64_t kPanelGap = 20;
constexpr int64_t kAxisTitleGap = 6;
constexpr int64_t kTitleGap = 10;
constexpr int64_t kColorbarGap = 24;
constexpr int64_t kColorbarWidth = 16;
constexpr int64_t kMinColorbarHeight = 120;
// The key of the marks: a swatch this big, its text this far right of it, entries this far apart.
constexpr int64_t kKeySwatch = 14;
constexpr int64_t kKeyTextGap = 5;
constexpr int64_t kKeyEntryGap = 18;
// cairo's image surfaces stop at 32767 pixels a side; 2^27 pixels (512 MiB as ARGB32) keeps a
// grid of many large heads from exhausting memory.
constexpr int64_t kMaxSide = 32767;
constexpr int64_t kMaxPixels = int64_t{1} << 27;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t ceil_px(double x) { return static_cast<int64_t>(std::ceil(x - 1e-9)); }

// The smallest of 1, 2, 5, 10, 20, 50, ... that is at least n: label every k-th token.
int64_t nice_step(int64_t n) {
  for (int64_t decade = 1;; decade *= 10) {
    for (const int64_t m : {1, 2, 5}) {
      if (m * decade >= n) return m * decade;
    }
  }
}

struct Ticks {
  std::vector<double> values;
  std::vector<std::string> text;
};

// 3 to 7 round values between vmin and vmax (steps of 1, 2, 2.5 or 5 times a power of ten),
// written with just the digits the step needs.
Ticks nice_ticks(double vmin, double vmax) {
  const double span = vmax - vmin;
  const double magnitude = std::pow(10.0, std::floor(std::log10(span / 5.0)));
  double step = magnitude;
  int extra_digit = 0;
  for (const double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    step = m * magnitude;
    extra_digit = m == 2.5 ? 1 : 0;
    if (span / step <= 6.0) break;
  }
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)) + extra_digit);
  Ticks ticks;
  const double tolerance = step * 1e-9;
  for (double k = std::ceil((vmin - tolerance) / step); k * step <= vmax + tolerance; k += 1.0) {
    const double value = std::clamp(k * step, vmin, vmax);
    ticks.values.push_back(value);
    std::string text = fmt::format("{:.{}f}", value, decimals);
    if (text.find_first_not_of("-0.") == std::string::npos) text = fmt::format("{:.{}f}", 0.0, decimals);  // no "-0"
    ticks.text.push_back(std::move(text));
  }
  return ticks;
}

// The label cut at a code point and ended with "…" until it fits `max_width`.
std::string fit_label(const std::string& label, double size, double max_width) {
  if (measure_text(label, size).width <= max_width) return label;
  std::vector<size_t> starts;  // byte offsets where code points start
  for (size_t i = 0; i < label.size(); ++i) {
    if ((static_cast<unsigned char>(label[i]) & 0xC0) != 0x80) starts.push_back(i);
  }
  size_t lo = 0;  // keep starts[0, lo) : fits
  size_t hi = starts.size();
  while (lo + 1 < hi) {
    const size_t mid = (lo + hi) / 2;
    if (measure_text(label.substr(0, starts[mid]) + "…", size).width <= max_width) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return label.substr(0, lo == 0 ? 0 : starts[lo]) + "…";
}

std::string shape_names(int rank) {
  switch (rank) {
    case 2:
      return "[Tq, Tk]";
    case 3:
      return "[H, Tq, Tk]";
    default:
      return "[B, H, Tq, Tk]";
  }
}

std::vector<std::string> figure_labels(const std::vector<std::string>& given, int64_t count, std::string_view name,
                                       std::string_view axis, const Shape& shape) {
  if (given.empty()) {
    std::vector<std::string> numbers;
    for (int64_t i = 0; i < count; ++i) numbers.push_back(std::to_string(i));
    return numbers;
  }
  if (static_cast<int64_t>(given.size()) != count) {
    throw ShapeError(fmt::format("{}: expected {} labels (one per {} of alpha {} {}), got {}", name, count, axis,
                                 shape_names(shape.rank()), shape.str(), given.size()));
  }
  std::vector<std::string> labels;
  for (const std::string& label : given) labels.push_back(sanitize_label(label));
  return labels;
}

void compute_scale(Figure& f, const HeatmapOptions& options) {
  for (const auto& [bound, name] : {std::pair{options.vmin, "vmin"}, std::pair{options.vmax, "vmax"}}) {
    if (bound && !std::isfinite(*bound)) {
      throw ValueError(fmt::format("{}: expected a finite value, got {}", name, *bound));
    }
  }
  double lo = 0.0;
  double hi = -std::numeric_limits<double>::infinity();
  // Only the drawn weights count: a masked cell's 0 is no weight.
  const auto for_each_weight = [&f](auto&& visit) {
    for (const Panel& panel : f.panels) {
      for (size_t cell = 0; cell < panel.values.size(); ++cell) {
        if (std::isfinite(panel.values[cell]) && !panel.is_masked(cell)) visit(panel.values[cell]);
      }
    }
  };
  for_each_weight([&](double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  });
  if (colormap_is_diverging(options.colormap)) {
    // A diverging map's middle is 0: the scale runs symmetrically to the largest magnitude.
    const double magnitude = std::max(std::abs(lo), hi > 0.0 ? hi : 0.0);
    lo = -magnitude;
    hi = magnitude;
  }
  double vmin = options.vmin.value_or(lo);
  double vmax = options.vmax.value_or(hi);
  if ((options.vmin || options.vmax) && !(vmin < vmax)) {
    throw ValueError(fmt::format("vmin, vmax: expected vmin < vmax, got vmin = {} and vmax = {}", vmin, vmax));
  }
  if (!(vmax > vmin)) vmax = vmin + 1.0;  // every value is vmin: a flat figure still gets a scale
  f.layout.vmin = vmin;
  f.layout.vmax = vmax;
  for_each_weight([&](double v) {
    f.layout.clipped_low = f.layout.clipped_low || v < vmin;
    f.layout.clipped_high = f.layout.clipped_high || v > vmax;
  });
  Ticks ticks = nice_ticks(vmin, vmax);
  f.layout.ticks = std::move(ticks.values);
  f.tick_text = std::move(ticks.text);
}

// ---- Layout --------------------------------------------------------------------------------------

void compute_layout(Figure& f) {
  HeatmapLayout& layout = f.layout;
  const auto count = static_cast<int64_t>(f.panels.size());
  const int64_t columns = f.grid_columns > 0 ? std::min(f.grid_columns, count)
                          : count == 1       ? 1
                                             : ceil_px(std::sqrt(static_cast<double>(count)));
  const int64_t rows = ceil_div(count, columns);

  // Square cells that fit the target side, unless that leaves one side of the matrix thinner than
  // kMinSide (a single query over many keys): that side's cells then grow.
  const int64_t target = std::max(kMinSide * 2, kTargetSide / columns);
  const int64_t fit_w = std::clamp<int64_t>(target / f.tk, 1, kMaxCell);
  const int64_t fit_h = std::clamp<int64_t>(target / f.tq, 1, kMaxCell);
  const int64_t square = std::min(fit_w, fit_h);
  int64_t cell_w = std::max(square, std::min(fit_w, ceil_div(kMinSide, f.tk)));
  int64_t cell_h = std::max(square, std::min(fit_h, ceil_div(kMinSide, f.tq)));
  if (f.annotate) {
    double text_w = 0.0;
    double text_h = 0.0;
    for (const double v : {layout.vmin, layout.vmax, 0.0}) {
      const TextSize size = measure_text(annotation(v), kAnnotationSize);
      text_w = std::max(text_w, size.width);
      text_h = std::max(text_h, size.height);
    }
    cell_w = std::max(cell_w, ceil_px(text_w) + 6);
    cell_h = std::max(cell_h, ceil_px(text_h) + 2);
  }
  const int64_t matrix_w = f.tk * cell_w;
  const int64_t matrix_h = f.tq * cell_h;

  const double line = measure_text("Ag书", kLabelSize).height;
  const int64_t row_step = nice_step(ceil_px(line / static_cast<double>(cell_h)));
  const int64_t col_step = nice_step(ceil_px(line / static_cast<double>(cell_w)));
  f.row_text.assign(static_cast<size_t>(f.tq), "");
  f.col_text.assign(static_cast<size_t>(f.tk), "");
  double row_band = 0.0;
  double col_band = 0.0;
  for (int64_t i = 0; i < f.tq; i += row_step) {
    auto& text = f.row_text[static_cast<size_t>(i)];
    text = fit_label(f.row_labels[static_cast<size_t>(i)], kLabelSize, kMaxLabelWidth);
    row_band = std::max(row_band, measure_text(text, kLabelSize).width);
  }
  for (int64_t j = 0; j < f.tk; j += col_step) {
    auto& text = f.col_text[static_cast<size_t>(j)];
    text = fit_label(f.col_labels[static_cast<size_t>(j)], kLabelSize, kMaxLabelWidth);
    col_band = std::max(col_band, measure_text(text, kLabelSize).width);
  }
  // Key labels stay upright when each fits its column (numbers, short CJK tokens) and read upwards
  // otherwise.
  const bool rotated = col_band + 4.0 > static_cast<double>(col_step * cell_w);
  const int64_t row_band_w = ceil_px(row_band);
  const int64_t col_band_h = rotated ? ceil_px(col_band) : ceil_px(line);
  const int64_t axis_title_h = ceil_px(measure_text("queries keys", kAxisTitleSize).height);
  const int64_t caption_h =
      f.panels.front().caption.empty() ? 0 : ceil_px(measure_text("head", kCaptionSize).height) + 4;

  // Left to right: margin, "queries" (rotated), row labels, ticks, the grid, the colour bar.
  const int64_t row_band_x = kMargin + axis_title_h + kAxisTitleGap;
  const int64_t grid_x = row_band_x + row_band_w + kLabelGap + kTickLength;
  const int64_t grid_w = columns * matrix_w + (columns - 1) * kPanelGap;

  int64_t y = kMargin;
  if (!f.title.empty()) {
    layout.title = {
        .x = kMargin, .y = y, .width = 0, .height = ceil_px(measure_text(f.title, kTitleSize, true).height)};
    y += layout.title.height + kTitleGap;
  }
  const auto has_panel = [&](int64_t r, int64_t c) { return c < columns && r * columns + c < count; };
  int64_t grid_bottom = y;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t matrix_y = y + caption_h;
    bool row_has_labels = false;
    for (int64_t c = 0; c < columns && has_panel(r, c); ++c) {
      HeatmapPanelLayout p;
      p.head = f.panels[static_cast<size_t>(r * columns + c)].head;
      p.matrix = {.x = grid_x + c * (matrix_w + kPanelGap), .y = matrix_y, .width = matrix_w, .height = matrix_h};
      p.cell_width = cell_w;
      p.cell_height = cell_h;
      p.row_label_step = row_step;
      p.col_label_step = col_step;
      p.col_labels_rotated = rotated;
      if (caption_h > 0) p.caption = {.x = p.matrix.x, .y = y, .width = matrix_w, .height = caption_h};
      if (c == 0) p.row_labels = {.x = row_band_x, .y = matrix_y, .width = row_band_w, .height = matrix_h};
      if (!has_panel(r + 1, c)) {
        p.col_labels = {.x = p.matrix.x,
                        .y = matrix_y + matrix_h + kTickLength + kLabelGap,
                        .width = matrix_w,
                        .height = col_band_h};
        row_has_labels = true;
      }
      layout.panels.push_back(p);
    }
    grid_bottom = matrix_y + matrix_h + (row_has_labels ? kTickLength + kLabelGap + col_band_h : 0);
    y = grid_bottom + kPanelGap;
  }
  const int64_t keys_title_bottom = grid_bottom + kAxisTitleGap + axis_title_h;
  const HeatmapPanelLayout& first = layout.panels.front();
  const int64_t last_matrix_bottom = layout.panels.back().matrix.y + matrix_h;
  layout.row_axis_title = {
      .x = kMargin, .y = first.matrix.y, .width = axis_title_h, .height = last_matrix_bottom - first.matrix.y};
  layout.col_axis_title = {.x = grid_x, .y = grid_bottom + kAxisTitleGap, .width = grid_w, .height = axis_title_h};
  layout.colorbar = {.x = grid_x + grid_w + kColorbarGap,
                     .y = first.matrix.y,
                     .width = kColorbarWidth,
                     .height = std::max(kMinColorbarHeight, last_matrix_bottom - first.matrix.y)};
  double tick_w = 0.0;
  double tick_h = 0.0;
  for (const std::string& text : f.tick_text) {
    const TextSize size = measure_text(text, kTickSize);
    tick_w = std::max(tick_w, size.width);
    tick_h = std::max(tick_h, size.height);
  }
  layout.colorbar_labels = {.x = layout.colorbar.x + kColorbarWidth + kTickLength + kLabelGap,
                            .y = layout.colorbar.y - ceil_px(tick_h / 2),
                            .width = ceil_px(tick_w),
                            .height = layout.colorbar.height + ceil_px(tick_h)};

  // The triangles sit in the margin above and below the bar, which is wider than they are tall.
  static_assert(kClipMarkerHeight + kClipMarkerGap < kMargin);
  if (layout.clipped_high) {
    layout.clip_high_marker = {.x = layout.colorbar.x,
                               .y = layout.colorbar.y - kClipMarkerGap - kClipMarkerHeight,
                               .width = kColorbarWidth,
                               .height = kClipMarkerHeight};
  }
  if (layout.clipped_low) {
    layout.clip_low_marker = {.x = layout.colorbar.x,
                              .y = layout.colorbar.y + layout.colorbar.height + kClipMarkerGap,
                              .width = kColorbarWidth,
                              .height = kClipMarkerHeight};
  }

  // The key of the marks: one line under the "keys" title, entries left to right from the grid's edge.
  int64_t bottom = keys_title_bottom;
  int64_t key_right = 0;
  if (!f.keys.empty()) {
    const int64_t key_y = keys_title_bottom + kAxisTitleGap;
    const int64_t line_h = std::max(kKeySwatch, ceil_px(measure_text("Ag书", kLabelSize).height));
    int64_t x = grid_x;
    for (const MarkKey& key : f.keys) {
      HeatmapKeyEntry entry;
      entry.swatch = {.x = x, .y = key_y + (line_h - kKeySwatch) / 2, .width = kKeySwatch, .height = kKeySwatch};
      const int64_t text_w = ceil_px(measure_text(key.text, kLabelSize).width);
      entry.text = {.x = x + kKeySwatch + kKeyTextGap, .y = key_y, .width = text_w, .height = line_h};
      layout.key.push_back(entry);
      key_right = entry.text.x + text_w;
      x = key_right + kKeyEntryGap;
    }
    bottom = key_y + line_h;
  }

  int64_t width = std::max(layout.colorbar_labels.x + layout.colorbar_labels.width, key_right) + kMargin;
  if (!f.title.empty()) width = std::max(width, ceil_px(measure_text(f.title, kTitleSize, true).width) + 2 * kMargin);
  layout.width = width;
  layout.height = std::max({bottom, layout.colorbar_labels.y + layout.colorbar_labels.height,
                            layout.clip_low_marker.y + layout.clip_low_marker.height}) +
                  kMargin;
  if (!f.title.empty()) layout.title.width = width - 2 * kMargin;

  if (layout.width > kMaxSide || layout.height > kMaxSide || layout.width * layout.height > kMaxPixels) {
    throw ValueError(fmt::format(
        "alpha: the image would be {} × {} pixels ({} panel{} of {} × {} cells of {} × {} px{}), beyond what one "
        "image holds ({} px a side, {} pixels in all); draw one head, fewer tokens, or no annotations",
        layout.width, layout.height, count, count == 1 ? "" : "s", f.tq, f.tk, cell_w, cell_h,
        f.annotate ? ", enlarged to hold their values" : "", kMaxSide, kMaxPixels));
  }
}

// ---- pango ----------------------------------------------------------------------------------------

// A 1×1 surface to measure on, one per thread (pango objects are not thread-safe).
class Measurer {
 public:
  Measurer()
      : surface_(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, 1, 1)),
        cr_(cairo_create(surface_)),
        layout_(pango_cairo_create_layout(cr_)) {
    configure_context(pango_layout_get_context(layout_));
    pango_layout_context_changed(layout_);
  }
  ~Measurer() {
    g_object_unref(layout_);
    cairo_destroy(cr_);
    cairo_surface_destroy(surface_);
  }
  Measurer(const Measurer&) = delete;
  Measurer& operator=(const Measurer&) = delete;

  PangoLayout* layout() const { return layout_; }

 private:
  cairo_surface_t* surface_;
  cairo_t* cr_;
  PangoLayout* layout_;
};

Measurer& measurer() {
  thread_local Measurer m;
  return m;
}

}  // namespace

void configure_context(PangoContext* context) {
  // Unhinted metrics: text is as wide in a PDF or an SVG as in the PNG that was laid out with it.
  cairo_font_options_t* options = cairo_font_options_create();
  cairo_font_options_set_hint_metrics(options, CAIRO_HINT_METRICS_OFF);
  cairo_font_options_set_hint_style(options, CAIRO_HINT_STYLE_NONE);
  cairo_font_options_set_antialias(options, CAIRO_ANTIALIAS_GRAY);
  pango_cairo_context_set_font_options(context, options);
  cairo_font_options_destroy(options);
}

void set_text(PangoLayout* layout, std::string_view text, double size, bool bold) {
  PangoFontDescription* font = pango_font_description_from_string(std::string(kFontFamily).c_str());
  pango_font_description_set_absolute_size(font, size * PANGO_SCALE);
  pango_font_description_set_weight(font, bold ? PANGO_WEIGHT_BOLD : PANGO_WEIGHT_NORMAL);
  pango_layout_set_font_description(layout, font);
  pango_font_description_free(font);
  pango_layout_set_text(layout, text.data(), static_cast<int>(text.size()));
}

TextSize measure_text(std::string_view text, double size, bool bold) {
  PangoLayout* layout = measurer().layout();
  set_text(layout, text, size, bold);
  PangoRectangle logical;
  pango_layout_get_extents(layout, nullptr, &logical);
  return {.width = static_cast<double>(logical.width) / PANGO_SCALE,
          .height = static_cast<double>(logical.height) / PANGO_SCALE};
}

namespace {

double stretch(HeatmapScale scale, double u) {
  switch (scale) {
    case HeatmapScale::sqrt:
      return std::sqrt(u);
    case HeatmapScale::log:
      return std::log10(1.0 + 999.0 * u) / 3.0;
    case HeatmapScale::linear:
      break;
  }
  return u;
}

}  // namespace

double Figure::position(double value) const {
  const double u = std::clamp((value - layout.vmin) / (layout.vmax - layout.vmin), 0.0, 1.0);
  if (!colormap_is_diverging(colormap)) return stretch(scale, u);
  const double from_middle = 2.0 * u - 1.0;
  return (1.0 + std::copysign(stretch(scale, std::abs(from_middle)), from_middle)) / 2.0;
}

std::string Figure::exact(double value) const {
  return float32 ? fmt::format("{}", static_cast<float>(value)) : fmt::format("{}", value);
}

std::string annotation(double value) {
  std::string text = fmt::format("{:.2f}", value);
  return text == "-0.00" ? "0.00" : text;
}

template <class T>
Figure make_figure(TensorView<const T> alpha, const HeatmapOptions& options, HeatmapFormat format) {
  const int rank = alpha.rank();
  if (rank < 2 || rank > 4) {
    throw ShapeError(
        fmt::format("alpha: expected shape [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk], got {}", alpha.shape.str()));
  }
  Figure f;
  f.shape = alpha.shape;
  const TensorView<const T> a4 = as_rank4(alpha);
  const int64_t batches = a4.shape[0];
  f.heads = a4.shape[1];
  f.tq = a4.shape[2];
  f.tk = a4.shape[3];
  const std::string described = fmt::format("alpha {} {}", shape_names(rank), alpha.shape.str());
  const bool terminal = format == HeatmapFormat::terminal;
  if ((!terminal && (f.tq == 0 || f.tk == 0)) || f.heads == 0 || batches == 0) {
    throw ShapeError(
        fmt::format("alpha: expected at least one query, key, head and batch entry, got shape {}", alpha.shape.str()));
  }
  if (rank < 4 && options.batch != 0) {
    throw ShapeError(fmt::format("batch: {} has no batch dim, got batch {}", described, options.batch));
  }
  if (options.batch < 0 || options.batch >= batches) {
    throw ShapeError(fmt::format("batch: expected 0 to {} ({}), got {}", batches - 1, described, options.batch));
  }
  if (options.head && rank == 2 && *options.head != 0) {
    throw ShapeError(fmt::format("head: {} has no heads, got head {}", described, *options.head));
  }
  if (options.head && (*options.head < 0 || *options.head >= f.heads)) {
    throw ShapeError(fmt::format("head: expected 0 to {} ({}), got {}", f.heads - 1, described, *options.head));
  }
  if (!options.panel_captions.empty() && static_cast<int64_t>(options.panel_captions.size()) != f.heads) {
    throw ShapeError(fmt::format("panel_captions: expected {} (one per head of {}), got {}", f.heads, described,
                                 options.panel_captions.size()));
  }
  if (options.grid_columns < 0) {
    throw ValueError(fmt::format("grid_columns: expected 0 (about a square) or more, got {}", options.grid_columns));
  }
  f.grid_columns = options.grid_columns;
  f.batch = options.batch;
  f.first_head = options.head.value_or(0);
  f.labels_given = !options.row_labels.empty() || !options.col_labels.empty();
  f.row_labels = figure_labels(options.row_labels, f.tq, "row_labels", "query row", alpha.shape);
  f.col_labels = figure_labels(options.col_labels, f.tk, "col_labels", "key column", alpha.shape);
  f.title = sanitize_label(options.title);
  f.colormap = options.colormap;
  f.annotate = options.annotate;
  if (terminal && (options.terminal.decimals < 0 || options.terminal.decimals > 9)) {
    throw ValueError(fmt::format("terminal.decimals: expected 0 to 9, got {}", options.terminal.decimals));
  }
  if (terminal && options.terminal.max_width != 0 && options.terminal.max_width < kMinTerminalWidth) {
    throw ValueError(fmt::format("terminal.max_width: expected 0 (no limit) or at least {} columns, got {}",
                                 kMinTerminalWidth, options.terminal.max_width));
  }
  f.scale = options.scale;
  std::optional<TensorView<const uint8_t>> allowed;
  if (options.allowed) allowed = as_rank4(broadcast_to(*options.allowed, alpha.shape, "allowed"));
  f.terminal = options.terminal;
  f.marks.clear();
  for (const int64_t row : options.marked_rows) {
    if (row < 0 || row >= f.tq) {
      throw ValueError(
          fmt::format("marked_rows: expected a query (row) within [0, {}) of {}, got {}", f.tq, described, row));
    }
    f.marks.push_back({.row = row,
                       .col = 0,
                       .rows = 1,
                       .cols = f.tk,
                       .color = kRowMarkColor,
                       .tooltip = fmt::format("marked query: {}", f.row_labels[static_cast<size_t>(row)])});
  }
  for (const int64_t col : options.marked_cols) {
    if (col < 0 || col >= f.tk) {
      throw ValueError(
          fmt::format("marked_cols: expected a key (column) within [0, {}) of {}, got {}", f.tk, described, col));
    }
    f.marks.push_back({.row = 0,
                       .col = col,
                       .rows = f.tq,
                       .cols = 1,
                       .color = kColMarkColor,
                       .tooltip = fmt::format("marked key: {}", f.col_labels[static_cast<size_t>(col)])});
  }
  for (const auto& [row, col] : options.marked_cells) {
    if (row < 0 || row >= f.tq || col < 0 || col >= f.tk) {
      throw ValueError(fmt::format("marked_cells: expected (row, column) within [0, {}) × [0, {}) of {}, got ({}, {})",
                                   f.tq, f.tk, described, row, col));
    }
    f.marks.push_back({.row = row,
                       .col = col,
                       .rows = 1,
                       .cols = 1,
                       .color = kMarkColor,
                       .tooltip = fmt::format("marked: {} → {}", f.row_labels[static_cast<size_t>(row)],
                                              f.col_labels[static_cast<size_t>(col)])});
  }
  const auto add_key = [&](bool any, const std::string& label, Rgb color) {
    if (any && !label.empty()) f.keys.push_back({.color = color, .text = sanitize_label(label)});
  };
  add_key(!options.marked_cells.empty(), options.marked_cells_label, kMarkColor);
  add_key(!options.marked_rows.empty(), options.marked_rows_label, kRowMarkColor);
  add_key(!options.marked_cols.empty(), options.marked_cols_label, kColMarkColor);
  f.float32 = std::is_same_v<T, float>;

  const bool page = format == HeatmapFormat::html;
  for (int64_t h = 0; h < f.heads; ++h) {
    if (!page && options.head && h != *options.head) continue;
    Panel panel;
    panel.head = h;
    // The terminal names the batch entry of any rank-4 alpha, as `qkv heatmap` always printed it;
    // an image only when there are several to tell apart.
    if (!options.panel_captions.empty()) {
      panel.caption = sanitize_label(options.panel_captions[static_cast<size_t>(h)]);
    } else if (rank == 4 && (batches > 1 || terminal)) {
      panel.caption = fmt::format("batch {} · head {}", f.batch, h);
    } else if (rank >= 3) {
      panel.caption = fmt::format("head {}", h);
    }
    panel.values.reserve(static_cast<size_t>(f.tq * f.tk));
    for (int64_t i = 0; i < f.tq; ++i) {
      for (int64_t j = 0; j < f.tk; ++j) {
        const auto value = static_cast<double>(a4(f.batch, h, i, j));
        if (!terminal && !std::isfinite(value)) {
          std::vector<int64_t> index{f.batch, h, i, j};
          index.erase(index.begin(), index.begin() + (4 - rank));
          throw ValueError(fmt::format("alpha: expected finite values, got {} at [{}]", value, fmt::join(index, ", ")));
        }
        panel.values.push_back(value);
      }
    }
    if (allowed) {
      panel.masked.reserve(panel.values.size());
      for (int64_t i = 0; i < f.tq; ++i) {
        for (int64_t j = 0; j < f.tk; ++j) panel.masked.push_back((*allowed)(f.batch, h, i, j) == 0 ? 1 : 0);
      }
      f.has_mask = f.has_mask || std::ranges::find(panel.masked, 1) != panel.masked.end();
    }
    f.panels.push_back(std::move(panel));
  }
  compute_scale(f, options);
  if (!page && !terminal) compute_layout(f);
  return f;
}

template Figure make_figure(TensorView<const float>, const HeatmapOptions&, HeatmapFormat);
template Figure make_figure(TensorView<const double>, const HeatmapOptions&, HeatmapFormat);

}  // namespace heatmap_detail

using heatmap_detail::Figure;

HeatmapFormat heatmap_format_for_path(const std::filesystem::path& path, std::string_view arg) {
  std::string extension = path.extension().string();
  std::ranges::transform(extension, extension.begin(), [](unsigned char c) { return std::tolower(c); });
  if (extension == ".png") return HeatmapFormat::png;
  if (extension == ".svg") return HeatmapFormat::svg;
  if (extension == ".pdf") return HeatmapFormat::pdf;
  if (extension == ".html" || extension == ".htm") return HeatmapFormat::html;
  throw ValueError(fmt::format("{}: expected a file ending in .png, .svg, .pdf or .html, got {}", arg, path.string()));
}

std::string_view heatmap_scale_name(HeatmapScale scale) {
  switch (scale) {
    case HeatmapScale::sqrt:
      return "sqrt";
    case HeatmapScale::log:
      return "log";
    case HeatmapScale::linear:
      break;
  }
  return "linear";
}

HeatmapScale parse_heatmap_scale(std::string_view name, std::string_view arg) {
  for (const HeatmapScale scale : {HeatmapScale::linear, HeatmapScale::sqrt, HeatmapScale::log}) {
    if (name == heatmap_scale_name(scale)) return scale;
  }
  throw ValueError(fmt::format("{}: expected linear, sqrt or log, got {}", arg, name));
}

std::string_view heatmap_format_name(HeatmapFormat format) {
  switch (format) {
    case HeatmapFormat::svg:
      return "SVG";
    case HeatmapFormat::pdf:
      return "PDF";
    case HeatmapFormat::html:
      return "HTML";
    case HeatmapFormat::terminal:
      return "terminal";
    case HeatmapFormat::png:
      break;
  }
  return "PNG";
}

template <class T>
HeatmapLayout heatmap_layout(TensorView<const T> alpha, const HeatmapOptions& options) {
  return heatmap_detail::make_figure(alpha, options, HeatmapFormat::png).layout;
}

template <class T>
std::string render_heatmap(TensorView<const T> alpha, HeatmapFormat format, const HeatmapOptions& options) {
  const Figure figure = heatmap_detail::make_figure(alpha, options, format);
  switch (format) {
    case HeatmapFormat::svg:
      return heatmap_detail::render_svg(figure);
    case HeatmapFormat::html:
      return heatmap_detail::render_html(figure);
    case HeatmapFormat::terminal:
      return heatmap_detail::render_terminal(figure);
    case HeatmapFormat::png:
    case HeatmapFormat::pdf:
      break;
  }
  return heatmap_detail::render_cairo(figure, format);
}

std::vector<std::string> labels_without_glyphs(const std::vector<std::string>& labels) {
  std::vector<std::string> missing;
  for (const std::string& label : labels) {
    const std::string text = sanitize_label(label);
    PangoLayout* layout = heatmap_detail::measurer().layout();
    heatmap_detail::set_text(layout, text, heatmap_detail::kLabelSize, false);
    if (pango_layout_get_unknown_glyphs_count(layout) > 0) missing.push_back(text);
  }
  return missing;
}

template <class T>
AttentionWeightsReport check_attention_weights(TensorView<const T> alpha, std::string_view name) {
  if (alpha.rank() < 2 || alpha.rank() > 4) {
    throw ShapeError(
        fmt::format("{}: expected shape [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk], got {}", name, alpha.shape.str()));
  }
  const TensorView<const T> a4 = as_rank4(alpha);
  const int64_t tk = a4.shape[3];
  const int drop = 4 - alpha.rank();
  const auto index_of = [&](std::vector<int64_t> index) {
    index.erase(index.begin(), index.begin() + drop);
    return fmt::format("[{}]", fmt::join(index, ", "));
  };
  struct Bad {
    int64_t count = 0;
    T first = 0;  // printed in its own precision: -0.1f, not -0.10000000149011612
    std::string where;
    void add(T value, const std::string& at) {
      if (count++ == 0) first = value, where = at;
    }
  };
  Bad non_finite;
  Bad negative;
  AttentionWeightsReport report;
  const double tolerance = 2.0 * static_cast<double>(tk + 1) * std::numeric_limits<float>::epsilon();
  for (int64_t b = 0; b < a4.shape[0]; ++b) {
    for (int64_t h = 0; h < a4.shape[1]; ++h) {
      for (int64_t i = 0; i < a4.shape[2]; ++i) {
        double sum = 0.0;
        bool all_zero = true;
        for (int64_t j = 0; j < tk; ++j) {
          const T raw = a4(b, h, i, j);
          const auto value = static_cast<double>(raw);
          if (!std::isfinite(value)) {
            non_finite.add(raw, index_of({b, h, i, j}));
          } else if (value < 0.0) {
            negative.add(raw, index_of({b, h, i, j}));
          }
          sum += value;
          all_zero = all_zero && value == 0.0;
        }
        ++report.rows;
        if (all_zero) {
          ++report.rows_masked;
        } else if (std::isfinite(sum) && std::abs(sum - 1.0) > tolerance) {
          if (report.rows_off++ == 0) {
            const std::string row = index_of({b, h, i, 0});
            report.first_off =
                fmt::format("row {} sums to {:.6g}",
                            alpha.rank() == 2 ? std::to_string(i) : row.substr(0, row.rfind(',')) + "]", sum);
          }
        }
      }
    }
  }
  if (non_finite.count > 0) {
    throw ValueError(fmt::format("{}: expected finite weights, got {} non-finite value{} (the first: {} at {})", name,
                                 non_finite.count, non_finite.count == 1 ? "" : "s", non_finite.first,
                                 non_finite.where));
  }
  if (negative.count > 0) {
    throw ValueError(fmt::format("{}: expected weights >= 0, got {} negative value{} (the first: {} at {})", name,
                                 negative.count, negative.count == 1 ? "" : "s", negative.first, negative.where));
  }
  return report;
}

template HeatmapLayout heatmap_layout(TensorView<const float>, const HeatmapOptions&);
template HeatmapLayout heatmap_layout(TensorView<const double>, const HeatmapOptions&);
template std::string render_heatmap(TensorView<const float>, HeatmapFormat, const HeatmapOptions&);
template std::string render_heatmap(TensorView<const double>, HeatmapFormat, const HeatmapOptions&);
template AttentionWeightsReport check_attention_weights(TensorView<const float>, std::string_view);
template AttentionWeightsReport check_attention_weights(TensorView<const double>, std::string_view);

}  // namespace qkv
