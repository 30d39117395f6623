// The heatmap primitives behind qkv.heatmap (qkv/__init__.py): drawing α as PNG, SVG, PDF, HTML or
// terminal text (qkv/viz/heatmap.hpp), and writing a file whole or not at all.

#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "module.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/staged_files.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv::python {
namespace {

using namespace pybind11::literals;

// "png", "svg", "pdf", "html", "terminal": the format's name as Python spells it.
std::string format_key(HeatmapFormat format) {
  std::string name(heatmap_format_name(format));
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

HeatmapFormat format_of(const std::string& name) {
  for (const HeatmapFormat f :
       {HeatmapFormat::png, HeatmapFormat::svg, HeatmapFormat::pdf, HeatmapFormat::html, HeatmapFormat::terminal}) {
    if (name == format_key(f)) return f;
  }
  throw ValueError(
      fmt::format("format: expected \"png\", \"svg\", \"pdf\", \"html\" or \"terminal\", got \"{}\"", name));
}

HeatmapOptions options_of(const py::dict& o) {
  HeatmapOptions options;
  options.row_labels = o["rows"].cast<std::vector<std::string>>();
  options.col_labels = o["cols"].cast<std::vector<std::string>>();
  options.title = o["title"].cast<std::string>();
  options.colormap = parse_colormap(o["colormap"].cast<std::string>(), "colormap");
  options.vmin = o["vmin"].cast<std::optional<double>>();
  options.vmax = o["vmax"].cast<std::optional<double>>();
  options.annotate = o["annotate"].cast<bool>();
  options.batch = o["batch"].cast<int64_t>();
  options.head = o["head"].cast<std::optional<int64_t>>();
  options.marked_cells = o["marked"].cast<std::vector<std::pair<int64_t, int64_t>>>();
  options.terminal.color = o["color"].cast<bool>() ? TerminalColor::truecolor : TerminalColor::none;
  options.terminal.decimals = o["decimals"].cast<int>();
  options.scale = parse_heatmap_scale(o["scale"].cast<std::string>(), "scale");
  return options;
}

template <class T>
py::bytes render_as(const py::object& weights, HeatmapFormat format, HeatmapOptions options, const py::object& mask,
                    bool check_only) {
  Inputs in;
  const TensorView<const T> alpha = in.floats<T>(weights, "weights", "", true);
  if (!mask.is_none()) {
    const AttentionMask<T> read = in.mask<T>(mask, false, true);
    // A float mask is a bias of the scores, which says nothing about cells once they are weights.
    if (read.bias) throw ValueError("mask: expected a bool or integer array (nonzero = may attend), got a float one");
    // Checked here too, so that the error names the argument as Python spells it.
    if (read.allowed) broadcast_to(*read.allowed, alpha.shape, "mask");
    options.allowed = read.allowed;
  }
  std::string bytes;
  run_without_gil([&] {
    if (check_only) {
      if (format != HeatmapFormat::terminal) heatmap_layout(alpha, options);
    } else {
      bytes = render_heatmap(alpha, format, options);
    }
  });
  return py::bytes(bytes);
}

// weights, "png" | "svg" | "pdf" | "html" | "terminal", the options of qkv.heatmap as a dict →
// the file's bytes (the terminal's UTF-8 text); with check_only, validates and returns b"".
py::bytes render(const py::object& weights, const std::string& format, const py::dict& options, bool check_only) {
  const HeatmapFormat f = format_of(format);
  const HeatmapOptions o = options_of(options);
  const py::object mask = options["mask"];
  if (precision_of(weights, "weights") == Precision::float32) return render_as<float>(weights, f, o, mask, check_only);
  return render_as<double>(weights, f, o, mask, check_only);
}

}  // namespace

void add_heatmap(py::module_& m) {
  m.def("_render_heatmap", &render, "weights"_a, "format"_a, "options"_a, "check_only"_a = false);
  m.def("_format_for_path", [](const std::string& path) { return format_key(heatmap_format_for_path(path, "path")); });
  m.def(
      "_write_file_atomically",
      [](const std::string& path, const py::bytes& bytes) {
        const std::string data = bytes;
        py::gil_scoped_release release;
        write_file_atomically(path, data);
      },
      "path"_a, "bytes"_a);
}

}  // namespace qkv::python
