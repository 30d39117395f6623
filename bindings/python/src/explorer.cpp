// The explorer behind qkv.explore (qkv/__init__.py): a whole model's attention as the explorer page
// or as an image of its model view, rollout or a selection (qkv/viz/explorer.hpp).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "module.hpp"
#include "qkv/viz/explorer.hpp"

namespace qkv::python {
namespace {

using namespace pybind11::literals;

// attention float32 [L, H, Tq, Tk] (checked by qkv.explore), the options as a dict, "html" or an
// image format, the image's view and selected rows → the file's bytes.
py::bytes render(const py::object& attention, const py::dict& o, const std::string& format, const std::string& view,
                 const std::optional<std::vector<int64_t>>& rows) {
  Inputs in;
  const TensorView<const float> weights = in.floats<float>(attention, "attention", "", false);
  ExplorerOptions options;
  options.layer_names = o["layer_names"].cast<std::vector<std::string>>();
  options.query_tokens = o["tokens"].cast<std::vector<std::string>>();
  options.key_tokens = o["key_tokens"].cast<std::vector<std::string>>();
  options.title = o["title"].cast<std::string>();
  options.source = o["source"].cast<std::string>();
  options.colormap = parse_colormap(o["colormap"].cast<std::string>(), "colormap");
  options.panel_scale = parse_panel_scale(o["panel_scale"].cast<std::string>(), "panel_scale");
  const HeatmapFormat f = heatmap_format_for_path("x." + format, "format");
  const ExplorerView v = parse_explorer_view(view, "view");
  std::string bytes;
  run_without_gil([&] {
    bytes = f == HeatmapFormat::html ? render_explorer_html(weights, options)
                                     : render_explorer_image(weights, options, v, rows, f);
  });
  return py::bytes(bytes);
}

}  // namespace

void add_explorer(py::module_& m) {
  m.def("_render_explorer", &render, "attention"_a, "options"_a, "format"_a, "view"_a = "grid",
        "rows"_a = std::nullopt);
}

}  // namespace qkv::python
