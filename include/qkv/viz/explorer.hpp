#pragma once
// The attention explorer: a whole model's attention, every layer and head, as one self-contained
// HTML page (no network), or its model view as a static image.
//
// The page has
//   - a model view: an L × H grid of thumbnails (each head on its own scale); a click opens that head;
//   - a matrix view of the chosen layer and head (or the mean of its heads, or the rollout up to that
//     layer): canvas, labels thinned by the zoom, a colour bar, the value under the pointer; the wheel
//     zooms about the pointer, dragging pans;
//   - a head view as bertviz draws it: queries left, keys right, a line per pair weighted by α, of
//     one head or of every head overlaid in its colour; every token, the wheel zooming into a long
//     sequence (labels thinned by the zoom) and dragging panning;
//   - selections: query tokens (a list or spans, "3 5-7", or clicks in the head view) give the sum or
//     mean of their rows; key tokens, who attends to them (the sum or mean of their columns);
//   - aggregates: the mean over heads, attention rollout (attention_summary.hpp, computed in the page
//     from the stored weights), and the per-head entropy and mean distance (computed here, float64).
// Weights are stored as 8-bit codes with a float32 scale per row (a weight is its code times its row's
// largest weight / 255, so each is within 1/510 of its row's largest weight), deflated (zlib) a head
// at a time and base64-encoded in the page, which inflates them with the browser's
// DecompressionStream. The first layer's codes come before the script and every other layer's after
// it, so the page is drawn from the first while the browser still parses the rest. The thumbnails
// of the model view come pooled from here. A canvas draws every matrix, so 4096 tokens are one
// image, not 16 million DOM nodes.
// Test hooks: window.qkvExplorer (state, decoded weights, the page's rollout and selections);
// body[data-ready=true] once the first layer is drawn, body[data-loaded=true] once every layer is
// inflated (the hooks that read weights need it), each with the page's clock then in data-ready-ms
// and data-loaded-ms (milliseconds from the start of the navigation).
//
// Shapes: attention is [L, H, Tq, Tk] (one batch entry), finite, each row a distribution.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/viz/colormap.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv {

// How an image's panels are coloured:
//   own     each panel on its own scale, as the page's model view: a panel is divided by its largest
//           value, which its caption gives ("layer 3 · h5 · max 0.41"), and the colour bar runs from
//           0 to 1, so that a diffuse head is as readable as a sharp one;
//   shared  one scale for all panels, from 0 to the largest value drawn, so that panels compare.
// With select_rows, each row (a panel's) is a panel.
enum class PanelScale { own, shared };

struct ExplorerOptions {
  std::vector<std::string> layer_names;   // L names; empty: "layer 0", "layer 1", ...
  std::vector<std::string> query_tokens;  // Tq labels; empty: numbered from 0
  std::vector<std::string> key_tokens;    // Tk labels; empty: numbered from 0
  std::string title;                      // the page's heading; empty: "Attention explorer"
  std::string source;                     // what the page was made from, shown under the title
  Colormap colormap = Colormap::viridis;
  PanelScale panel_scale = PanelScale::own;  // images only: the page's model view always uses each head's own
};

// What a static image of the model shows:
//   grid     every layer and head, a row of H panels a layer ("layer · head" captions);
//   mean     each layer's mean over its heads, a panel a layer;
//   rollout  the rollout up to each layer (attention_rollout), a panel a layer; self-attention only.
enum class ExplorerView { grid, mean, rollout };

// The view named `name`; ValueError naming `arg` otherwise ("--view: expected grid, mean or rollout, got x").
ExplorerView parse_explorer_view(std::string_view name, std::string_view arg);

// The panel scale named `name`; ValueError naming `arg` otherwise ("--panel-scale: expected own or shared, got x").
PanelScale parse_panel_scale(std::string_view name, std::string_view arg);

// "3 5-7" → {3, 5, 6, 7}: indices and inclusive spans below `count`, separated by spaces or commas,
// sorted, without repeats. ValueError naming `arg` for anything else or an empty list.
std::vector<int64_t> parse_index_list(std::string_view text, int64_t count, std::string_view arg);

// attention [L, H, Tq, Tk] → the bytes of a PNG, SVG or PDF of `view`. With `rows`, the image is
// instead one matrix of the mean of those queries' rows of the view: a row per panel of the view
// (layer, or layer · head), a column per key. Throws as render_explorer_html and render_heatmap, and
// ShapeError for a rollout of cross-attention.
std::string render_explorer_image(TensorView<const float> attention, const ExplorerOptions& options, ExplorerView view,
                                  const std::optional<std::vector<int64_t>>& rows, HeatmapFormat format);

// attention [L, H, Tq, Tk] → the bytes of the page. Throws ShapeError for another rank, a zero dim,
// or a label list that is neither empty nor one per layer (query, key).
std::string render_explorer_html(TensorView<const float> attention, const ExplorerOptions& options);

}  // namespace qkv
