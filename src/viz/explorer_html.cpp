// The explorer page (qkv/viz/explorer.hpp): the C++ side quantizes and packs the weights and writes
// the summaries; the script below draws every view from them. Like the heatmap page, the data is JSON
// in a <script type="application/json"> element, read with JSON.parse, so no label can inject code.

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "heatmap_internal.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/text.hpp"
#include "qkv/viz/attention_summary.hpp"
#include "qkv/viz/explorer.hpp"

namespace qkv {
namespace {

using heatmap_detail::json_string;
using heatmap_detail::json_strings;

std::string base64(std::string_view bytes) {
  static constexpr char kDigits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t k = 0;
  for (; k + 2 < bytes.size(); k += 3) {
    const uint32_t n = (static_cast<uint8_t>(bytes[k]) << 16) | (static_cast<uint8_t>(bytes[k + 1]) << 8) |
                       static_cast<uint8_t>(bytes[k + 2]);
    out += {kDigits[n >> 18], kDigits[(n >> 12) & 63], kDigits[(n >> 6) & 63], kDigits[n & 63]};
  }
  if (k + 1 == bytes.size()) {
    const uint32_t n = static_cast<uint8_t>(bytes[k]) << 16;
    out += {kDigits[n >> 18], kDigits[(n >> 12) & 63], '=', '='};
  } else if (k + 2 == bytes.size()) {
    const uint32_t n = (static_cast<uint8_t>(bytes[k]) << 16) | (static_cast<uint8_t>(bytes[k + 1]) << 8);
    out += {kDigits[n >> 18], kDigits[(n >> 12) & 63], kDigits[(n >> 6) & 63], '='};
  }
  return out;
}

std::string deflate(const std::string& bytes) {
  uLongf size = compressBound(bytes.size());
  std::string out(size, '\0');
  if (compress2(reinterpret_cast<Bytef*>(out.data()), &size, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size(),
                6) != Z_OK) {
    throw ResourceError(fmt::format("explorer: zlib could not deflate {} bytes of weights", bytes.size()));
  }
  out.resize(size);
  return out;
}

// The 8-bit codes of every row and each row's scale (its largest weight / 255, little-endian float32):
// weight ≈ code · scale. A row's largest weight is its code 255, so a peaked row keeps its peak exactly.
struct Packed {
  std::string codes;   // [L, H, Tq, Tk]
  std::string scales;  // [L, H, Tq] float32
  // [L, H, P, Q] with P = min(Tq, kThumbnail), Q = min(Tk, kThumbnail): each head's largest weight in
  // the block of cells a thumbnail pixel covers, as a code of that head's largest weight, so that the
  // model view is drawn before the weights are inflated, and a sharp head stays sharp at 4096 tokens.
  std::string thumbnails;
};

constexpr int64_t kThumbnail = 64;

Packed pack(TensorView<const float> attention) {
  const int64_t rows = attention.shape[0] * attention.shape[1] * attention.shape[2];
  const int64_t tk = attention.shape[3];
  const Tensor<float> dense = to_tensor<float, float>(attention);
  Packed packed;
  packed.codes.resize(static_cast<size_t>(rows * tk));
  packed.scales.reserve(static_cast<size_t>(rows * 4));
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = dense.data() + r * tk;
    const float largest = std::max(0.0F, *std::max_element(row, row + tk));
    const float scale = largest / 255.0F;
    for (int64_t j = 0; j < tk; ++j) {
      const double code = scale > 0.0F ? std::round(std::max(0.0F, row[j]) / scale) : 0.0;
      packed.codes[static_cast<size_t>(r * tk + j)] = static_cast<char>(static_cast<uint8_t>(std::min(255.0, code)));
    }
    const auto bits = std::bit_cast<uint32_t>(scale);
    for (int shift = 0; shift < 32; shift += 8) packed.scales += static_cast<char>((bits >> shift) & 0xFF);
  }
  const int64_t heads = attention.shape[0] * attention.shape[1], tq = attention.shape[2];
  const int64_t ph = std::min(tq, kThumbnail), pw = std::min(tk, kThumbnail);
  std::vector<float> pooled(static_cast<size_t>(ph * pw));
  for (int64_t head = 0; head < heads; ++head) {
    std::fill(pooled.begin(), pooled.end(), 0.0F);
    float largest = 0.0F;
    for (int64_t i = 0; i < tq; ++i) {
      const float* row = dense.data() + (head * tq + i) * tk;
      for (int64_t j = 0; j < tk; ++j) {
        float& p = pooled[static_cast<size_t>((i * ph / tq) * pw + j * pw / tk)];
        p = std::max(p, row[j]);
        largest = std::max(largest, row[j]);
      }
    }
    for (const float p : pooled) {
      const double code = largest > 0.0F ? std::round(255.0 * p / largest) : 0.0;
      packed.thumbnails += static_cast<char>(static_cast<uint8_t>(std::clamp(code, 0.0, 255.0)));
    }
  }
  return packed;
}

std::vector<std::string> labels_or_numbers(const std::vector<std::string>& given, int64_t count,
                                           std::string_view prefix, std::string_view what) {
  if (!given.empty() && static_cast<int64_t>(given.size()) != count) {
    throw ShapeError(fmt::format("{}: expected {} labels, got {}", what, count, given.size()));
  }
  std::vector<std::string> labels;
  for (int64_t k = 0; k < count; ++k) {
    labels.push_back(given.empty() ? fmt::format("{}{}", prefix, k) : sanitize_label(given[static_cast<size_t>(k)]));
  }
  return labels;
}

std::string json_numbers(const Tensor<double>& values) {
  std::string out = "[";
  for (int64_t k = 0; k < values.numel(); ++k) fmt::format_to(std::back_inserter(out), "{}{}", k ? "," : "", values[k]);
  return out + "]";
}

constexpr std::string_view kPage = R"QKV(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="qkv explore">
<link rel="icon" href="data:,">
<style>
:root { color-scheme: light; --ink: #222; --muted: #666; --rule: #ddd; --accent: #1f5fbf;
  font-family: "DejaVu Sans", "Noto Sans CJK SC", system-ui, sans-serif; color: var(--ink); background: #fff; }
body { margin: 20px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 15px; margin: 18px 0 6px; }
.meta, .hint { color: var(--muted); font-size: 13px; margin: 0 0 8px; max-width: 70em; }
.controls { display: flex; flex-wrap: wrap; gap: 14px; align-items: center; font-size: 14px; margin: 0 0 10px; }
#readout { min-height: 1.4em; font-size: 14px; margin: 0 0 10px; padding: 6px 10px; background: #f4f6f9;
  border-left: 3px solid var(--accent); max-width: 70em; }
.row { display: flex; flex-wrap: wrap; gap: 28px; align-items: flex-start; }
canvas { display: block; }
#matrix { cursor: crosshair; touch-action: none; }
#model, #heads { cursor: pointer; }
input[aria-invalid=true] { outline: 2px solid #c00; }
table.summary { border-collapse: collapse; font-size: 11px; font-variant-numeric: tabular-nums; }
table.summary td, table.summary th { padding: 2px 5px; text-align: right; }
table.summary td { cursor: pointer; }
#tooltip { position: fixed; pointer-events: none; background: rgba(25, 25, 25, .92); color: #fff; font-size: 12px;
  padding: 5px 8px; border-radius: 4px; white-space: pre; display: none; z-index: 2; }
</style>
)QKV";

constexpr std::string_view kBody = R"QKV(</head>
<body>
<h1 id="title"></h1>
<p class="meta" id="meta"></p>
<p id="readout" aria-live="polite">Decoding the weights…</p>
<section>
<h2>Model view</h2>
<p class="hint">Every layer (rows) and head (columns), each on its own scale. Click one to open it below.</p>
<canvas id="model"></canvas>
</section>
<section>
<h2>Matrix and head views</h2>
<div class="controls">
<label>Layer <select id="layer"></select></label>
<label>Head <select id="head"></select></label>
<label>Show <select id="kind"><option value="attention">attention</option>
<option value="rollout">rollout up to this layer</option></select></label>
<button id="zoom-in" type="button">zoom in</button><button id="zoom-out" type="button">zoom out</button>
<button id="zoom-reset" type="button">whole matrix</button>
</div>
<div class="row">
<div><p class="hint">Rows are queries, columns keys. Wheel: zoom; drag: pan.</p>
<div class="row" style="gap:8px"><canvas id="matrix"></canvas><canvas id="bar"></canvas></div></div>
<div><p class="hint">Head view: queries left, keys right, lines by α. Hover a token for its lines; click one
to add it to the selection. Wheel: zoom; drag: pan; double-click: every token.
<label><input type="checkbox" id="all-heads"> all heads, in colours</label></p>
<canvas id="heads"></canvas></div>
</div>
</section>
<section>
<h2>Selections</h2>
<div class="controls">
<label>Query tokens <input id="queries" placeholder="3 5-7" size="18"></label>
<label>Key tokens <input id="keys" placeholder="0 2" size="18"></label>
<label>Combine <select id="combine"><option value="sum">sum</option><option value="mean">mean</option></select></label>
</div>
<p id="query-readout" class="hint"></p>
<canvas id="query-bars"></canvas>
<p id="key-readout" class="hint"></p>
<canvas id="key-bars"></canvas>
</section>
<section>
<h2>Per-head summaries</h2>
<p class="hint">Entropy of a row (nats; ln Tk is uniform) and mean attention distance |i − j| (tokens), averaged
over queries. Click a cell to open that head.</p>
<div class="row"><table class="summary" id="entropy"></table><table class="summary" id="distance"></table></div>
</section>
<div id="tooltip"></div>
)QKV";

constexpr std::string_view kScript = R"QKV(<script>
"use strict";
(async () => {
  const data = JSON.parse(document.getElementById("qkv-data").textContent);
  const $ = (id) => document.getElementById(id);
  const { L, H, tq, tk, rows, cols, layers, lut } = data;
  const selfAttention = tq === tk;
  const plane = tq * tk;
  const rgbLut = lut.map((hex) => parseInt(hex.slice(1), 16));
  const quote = (s) => "\u201c" + s + "\u201d";
  const niceStep = (n) => {
    for (let decade = 1; ; decade *= 10) for (const m of [1, 2, 5]) if (m * decade >= n) return m * decade;
  };
  const fmtValue = (v) => Number(v.toPrecision(4)).toString();
  const headColor = (h) => "hsl(" + Math.round(360 * h / H) + ", 75%, 42%)";

  document.title = data.title;
  $("title").textContent = data.title;
  $("meta").textContent = (data.source ? data.source + " \u00b7 " : "") + L + " layers \u00d7 " + H + " heads \u00b7 " +
    tq + " queries \u00d7 " + tk + " keys \u00b7 weights stored in 8 bits per row (within 1/510 of the row's " +
    "largest) \u00b7 drawn by qkv explore";

  // ---- the weights ---------------------------------------------------------------------------
  const slowBytesOf = (b64) => {
    const text = atob(b64);
    const out = new Uint8Array(text.length);
    for (let k = 0; k < text.length; k++) out[k] = text.charCodeAt(k);
    return out;
  };
  const bytesOf = Uint8Array.fromBase64 ? (b64) => Uint8Array.fromBase64(b64) : slowBytesOf;
  // Every layer but the first is written after this script, so that the page is drawn while the
  // browser still parses the rest of the file; those layers wait for the whole document.
  const parsed = new Promise((resolve) => {
    if (document.readyState !== "loading") resolve();
    else document.addEventListener("DOMContentLoaded", resolve, { once: true });
  });
  // Inflating runs in workers, one a core (up to 4), so that heads inflate side by side and off the
  // thread that draws; a browser that refuses a worker from a blob inflates here instead.
  const inflate = async (bytes) =>
    new Uint8Array(await new Response(new Blob(bytes).stream().pipeThrough(new DecompressionStream("deflate")))
      .arrayBuffer());
  const pending = new Map();
  const workers = [];
  try {
    const source = "onmessage = async (event) => { const { k, bytes } = event.data; try { const out = new Uint8Array(" +
      "await new Response(new Blob(bytes).stream().pipeThrough(new DecompressionStream('deflate'))).arrayBuffer());" +
      " postMessage({ k, out }, [out.buffer]); } catch (error) { postMessage({ k, error: String(error) }); } };";
    const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
    for (let w = 0; w < Math.min(4, navigator.hardwareConcurrency || 2); w++) {
      const worker = new Worker(url);
      worker.onmessage = (event) => {
        const { k, out, error } = event.data;
        const { resolve, reject } = pending.get(k);
        pending.delete(k);
        if (error) reject(new Error("weights: head " + k + ": " + error));
        else resolve(out);
      };
      worker.onerror = (event) => {
        for (const { reject } of pending.values()) reject(new Error("weights: a worker failed: " + event.message));
        pending.clear();
      };
      workers.push(worker);
    }
  } catch (error) {
    workers.length = 0;
  }
  const inflateAway = (k, bytes) => {
    if (workers.length === 0) return inflate(bytes);
    return new Promise((resolve, reject) => {
      pending.set(k, { resolve, reject });
      workers[k % workers.length].postMessage({ k, bytes }, bytes.map((b) => b.buffer));
    });
  };
  // codes[l * H + h]: that head's [Tq, Tk] codes, once inflated. The first layer is inflated before
  // the page is ready, every other in the background after; a view waits for the layers it needs.
  const codes = new Array(L * H);
  const inflateHead = async (k) => {
    if (k >= H) await parsed;
    const parts = [...document.querySelectorAll("script[data-head='" + k + "']")];
    const bytes = parts.map((part) => bytesOf(part.textContent));
    for (const part of parts) part.remove();
    const out = await inflateAway(k, bytes);
    if (out.length !== plane) throw new Error("weights: head " + k + " holds " + out.length + " codes, expected " + plane);
    codes[k] = out;
  };
  const layerLoads = new Array(L);
  const loadLayer = (l) => {
    if (!layerLoads[l]) layerLoads[l] = Promise.all([...Array(H).keys()].map((h) => inflateHead(l * H + h)));
    return layerLoads[l];
  };
  const loadLayersUpTo = (l) => Promise.all([...Array(l + 1).keys()].map(loadLayer));
  const loaded = (l) => [...Array(H).keys()].every((h) => codes[l * H + h] !== undefined);
  await loadLayer(0);
  const scales = new Float32Array(bytesOf(data.scales).buffer);

  // [Tq, Tk] of one head, as float64 products of a code and its row's scale.
  function headWeights(l, h) {
    if (!loaded(l)) throw new Error("weights: layer " + l + " is not inflated yet (wait for body[data-loaded])");
    const out = new Float64Array(plane);
    const c = codes[l * H + h];
    for (let i = 0; i < tq; i++) {
      const s = scales[(l * H + h) * tq + i];
      for (let j = 0; j < tk; j++) out[i * tk + j] = c[i * tk + j] * s;
    }
    return out;
  }
  function headMean(l) {
    const out = new Float64Array(plane);
    for (let h = 0; h < H; h++) {
      const w = headWeights(l, h);
      for (let k = 0; k < plane; k++) out[k] += w[k];
    }
    for (let k = 0; k < plane; k++) out[k] /= H;
    return out;
  }
  // Rollout's Â_l = rownorm(0.5 · mean_h A_l + 0.5 · I) (Abnar & Zuidema), and R_l = Â_l · R_{l-1}.
  const residualCache = new Map();
  function residual(l) {
    if (!residualCache.has(l)) {
      const a = headMean(l);
      for (let i = 0; i < tq; i++) {
        let sum = 0;
        for (let j = 0; j < tk; j++) {
          a[i * tk + j] = 0.5 * a[i * tk + j] + (i === j ? 0.5 : 0);
          sum += a[i * tk + j];
        }
        for (let j = 0; j < tk; j++) a[i * tk + j] /= sum;
      }
      residualCache.set(l, a);
    }
    return residualCache.get(l);
  }
  const rolloutCache = [];
  function rollout(l) {
    if (!selfAttention) throw new Error("rollout needs self-attention (Tq = Tk)");
    if (tq > data.rolloutLimit) throw new Error("the whole rollout matrix is drawn up to " + data.rolloutLimit + " tokens");
    for (let k = rolloutCache.length; k <= l; k++) {
      const a = residual(k);
      if (k === 0) {
        rolloutCache.push(a);
        continue;
      }
      const below = rolloutCache[k - 1];
      const out = new Float64Array(plane);
      for (let i = 0; i < tq; i++) {
        for (let m = 0; m < tq; m++) {
          const w = a[i * tq + m];
          if (w === 0) continue;
          const from = m * tq;
          const to = i * tq;
          for (let j = 0; j < tq; j++) out[to + j] += w * below[from + j];
        }
      }
      rolloutCache.push(out);
    }
    return rolloutCache[l];
  }
  // Row i of R_l without the whole matrix: e_i · Â_l · ... · Â_0, T² a layer (any T).
  function rolloutRow(i, l) {
    let v = new Float64Array(tq);
    v[i] = 1;
    for (let k = l; k >= 0; k--) {
      const a = residual(k);
      const next = new Float64Array(tq);
      for (let r = 0; r < tq; r++) {
        if (v[r] === 0) continue;
        for (let j = 0; j < tq; j++) next[j] += v[r] * a[r * tq + j];
      }
      v = next;
    }
    return v;
  }

  // ---- what is shown ---------------------------------------------------------------------------
  const view = { kind: "attention", layer: 0, head: 0 };  // head: a number or "mean"
  const canRollOut = selfAttention;
  const wholeRollout = selfAttention && tq <= data.rolloutLimit;
  // One head is drawn from its codes, and its float64 [Tq, Tk] is made only when a selection needs it
  // (at 4096 tokens that is 134 MB). Every other view is made whole, unless it is a rollout too large.
  const oneHead = () => view.kind === "attention" && view.head !== "mean";
  let drawable = true;
  let matrix = null;
  let vmax = 1;
  function shownMatrix() {
    if (!matrix && drawable) {
      if (view.kind === "rollout") matrix = rollout(view.layer);
      else matrix = oneHead() ? headWeights(view.layer, view.head) : headMean(view.layer);
    }
    return matrix;
  }
  function valueAt(i, j) {
    if (!oneHead()) return matrix[i * tk + j];
    const k = view.layer * H + view.head;
    return codes[k][i * tk + j] * scales[k * tq + i];
  }
  function viewName() {
    if (view.kind === "rollout") return "rollout up to " + layers[view.layer];
    return layers[view.layer] + ", " + (view.head === "mean" ? "mean of heads" : "head " + view.head);
  }

  const layerSelect = $("layer");
  layers.forEach((name, l) => layerSelect.add(new Option(name, String(l))));
  const headSelect = $("head");
  for (let h = 0; h < H; h++) headSelect.add(new Option("head " + h, String(h)));
  headSelect.add(new Option("mean of heads", "mean"));
  const kindSelect = $("kind");
  if (!canRollOut) {
    kindSelect.options[1].disabled = true;
    kindSelect.options[1].textContent = "rollout (self-attention only)";
  }
  async function setView(next) {
    const wanted = { ...view, ...next };
    if (!(wanted.kind === "rollout" ? [...Array(wanted.layer + 1).keys()].every(loaded) : loaded(wanted.layer))) {
      $("readout").textContent = "Inflating the weights of " + layers[wanted.layer] + "\u2026";
      await (wanted.kind === "rollout" ? loadLayersUpTo(wanted.layer) : loadLayer(wanted.layer));
    }
    Object.assign(view, next);
    layerSelect.value = String(view.layer);
    headSelect.value = String(view.head);
    kindSelect.value = view.kind;
    headSelect.disabled = view.kind === "rollout";
    matrix = null;
    drawable = view.kind !== "rollout" || wholeRollout;
    vmax = 0;
    if (oneHead()) {
      // Each row's largest weight is its code 255.
      for (let i = 0; i < tq; i++) vmax = Math.max(vmax, 255 * scales[(view.layer * H + view.head) * tq + i]);
    } else if (shownMatrix()) {
      for (const v of matrix) if (v > vmax) vmax = v;
    }
    if (!(vmax > 0)) vmax = 1;
    buildCells();
    drawMatrix();
    drawBar();
    drawModel();
    drawHeads();
    drawSelections();
    $("readout").textContent = "Showing " + viewName() + (drawable ? "" : ": the whole rollout is drawn up to " +
      data.rolloutLimit + " tokens; select query tokens to see their rollout rows") + ".";
    document.body.dataset.view = view.kind + ":" + view.layer + ":" + view.head;
  }
  layerSelect.addEventListener("change", () => setView({ layer: Number(layerSelect.value) }));
  headSelect.addEventListener("change", () => setView({ head: headSelect.value === "mean" ? "mean" : Number(headSelect.value) }));
  kindSelect.addEventListener("change", () => setView({ kind: kindSelect.value }));

  // ---- model view ------------------------------------------------------------------------------
  const model = $("model");
  const thumb = Math.max(24, Math.min(96, Math.floor(900 / H) - 6));
  const gap = 6;
  const modelLeft = 90;
  const modelTop = 18;
  model.width = modelLeft + H * (thumb + gap);
  model.height = modelTop + L * (thumb + gap);
  const modelCtx = model.getContext("2d");
  const thumbnails = [];
  const [ph, pw] = data.thumbnailShape;
  const pooled = bytesOf(data.thumbnails);
  for (let k = 0; k < L * H; k++) {
    const image = modelCtx.createImageData(thumb, thumb);
    for (let y = 0; y < thumb; y++) {
      for (let x = 0; x < thumb; x++) {
        const c = rgbLut[pooled[k * ph * pw + Math.floor(y * ph / thumb) * pw + Math.floor(x * pw / thumb)]];
        const o = 4 * (y * thumb + x);
        image.data[o] = c >> 16;
        image.data[o + 1] = (c >> 8) & 255;
        image.data[o + 2] = c & 255;
        image.data[o + 3] = 255;
      }
    }
    thumbnails.push(image);
  }
  function drawModel() {
    modelCtx.fillStyle = "#fff";
    modelCtx.fillRect(0, 0, model.width, model.height);
    modelCtx.font = "11px \"DejaVu Sans\", sans-serif";
    modelCtx.fillStyle = "#444";
    modelCtx.textBaseline = "middle";
    for (let h = 0; h < H; h++) {
      modelCtx.textAlign = "center";
      modelCtx.fillText("h" + h, modelLeft + h * (thumb + gap) + thumb / 2, 8);
    }
    for (let l = 0; l < L; l++) {
      modelCtx.textAlign = "right";
      const name = layers[l].length > 12 ? layers[l].slice(0, 11) + "\u2026" : layers[l];
      modelCtx.fillText(name, modelLeft - 8, modelTop + l * (thumb + gap) + thumb / 2);
      for (let h = 0; h < H; h++) {
        modelCtx.putImageData(thumbnails[l * H + h], modelLeft + h * (thumb + gap), modelTop + l * (thumb + gap));
      }
    }
    if (view.kind === "attention" && view.head !== "mean") {
      modelCtx.strokeStyle = "#e00";
      modelCtx.lineWidth = 3;
      modelCtx.strokeRect(modelLeft + view.head * (thumb + gap) - 2, modelTop + view.layer * (thumb + gap) - 2,
        thumb + 4, thumb + 4);
      model.dataset.selected = view.layer + "," + view.head;
    } else {
      model.dataset.selected = "";
    }
  }
  model.addEventListener("click", (event) => {
    const box = model.getBoundingClientRect();
    const h = Math.floor((event.clientX - box.left - modelLeft) / (thumb + gap));
    const l = Math.floor((event.clientY - box.top - modelTop) / (thumb + gap));
    if (l >= 0 && l < L && h >= 0 && h < H) {
      setView({ kind: "attention", layer: l, head: h });
      $("matrix").scrollIntoView({ block: "nearest" });
    }
  });

  // ---- matrix view -----------------------------------------------------------------------------
  const canvas = $("matrix");
  const ctx = canvas.getContext("2d");
  const font = "11px \"DejaVu Sans\", \"Noto Sans CJK SC\", sans-serif";
  const fitScale = Math.min(64, 640 / Math.max(tq, tk));
  const plotWidth = Math.round(tk * fitScale);
  const plotHeight = Math.round(tq * fitScale);
  const x0 = 130;
  const y0 = 8;
  ctx.font = font;
  // Key labels read upwards below the matrix: room for the widest (cut at 90 px) and the axis title.
  const colBand = Math.min(90, Math.ceil(Math.max(0, ...cols.map((s) => ctx.measureText(s).width)))) + 34;
  const cssWidth = x0 + plotWidth + 8;
  const cssHeight = y0 + plotHeight + colBand;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.ceil(cssWidth * dpr);
  canvas.height = Math.ceil(cssHeight * dpr);
  canvas.style.width = cssWidth + "px";
  canvas.style.height = cssHeight + "px";
  const zoom = { scale: fitScale, ox: 0, oy: 0 };  // CSS px a cell; the cell at the plot's top left
  const cells = document.createElement("canvas");
  cells.width = tk;
  cells.height = tq;
  const cellsCtx = cells.getContext("2d");
  // The colour map as the canvas's RGBA bytes read as one little-endian 32-bit word.
  const rgbaLut = Uint32Array.from(rgbLut, (c) => (0xff000000 | (c & 255) << 16 | (c & 0xff00) | c >> 16) >>> 0);
  function buildCells() {
    const image = cellsCtx.createImageData(tk, tq);
    const out = new Uint32Array(image.data.buffer);
    if (oneHead()) {
      // A row's cells through a table of its 256 codes' colours.
      const k = view.layer * H + view.head;
      const c = codes[k];
      const table = new Uint32Array(256);
      for (let i = 0; i < tq; i++) {
        const step = scales[k * tq + i] / vmax * 255;
        for (let code = 0; code < 256; code++) table[code] = rgbaLut[Math.min(255, Math.round(code * step))];
        for (let j = 0; j < tk; j++) out[i * tk + j] = table[c[i * tk + j]];
      }
    } else if (drawable) {
      for (let k = 0; k < plane; k++) out[k] = rgbaLut[Math.min(255, Math.round(matrix[k] / vmax * 255))];
    } else {
      out.fill(0xffe0e0e0);
    }
    cellsCtx.putImageData(image, 0, 0);
  }
  const fit = (s, width) => {
    if (ctx.measureText(s).width <= width) return s;
    const chars = Array.from(s);
    while (chars.length > 0 && ctx.measureText(chars.join("") + "\u2026").width > width) chars.pop();
    return chars.join("") + "\u2026";
  };
  function clampZoom() {
    zoom.scale = Math.min(64, Math.max(fitScale, zoom.scale));
    zoom.ox = Math.max(0, Math.min(tk - plotWidth / zoom.scale, zoom.ox));
    zoom.oy = Math.max(0, Math.min(tq - plotHeight / zoom.scale, zoom.oy));
  }
  function drawMatrix() {
    clampZoom();
    const s = zoom.scale;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, cssWidth, cssHeight);
    ctx.save();
    ctx.beginPath();
    ctx.rect(x0, y0, plotWidth, plotHeight);
    ctx.clip();
    ctx.imageSmoothingEnabled = false;
    ctx.setTransform(dpr * s, 0, 0, dpr * s, dpr * (x0 - zoom.ox * s), dpr * (y0 - zoom.oy * s));
    ctx.drawImage(cells, 0, 0);
    // Selected queries and keys: a frame around their rows and columns.
    ctx.lineWidth = Math.max(2 / s, 0.15);
    ctx.strokeStyle = "#ff00cc";
    for (const i of selection.queries) ctx.strokeRect(0, i, tk, 1);
    ctx.strokeStyle = "#00c8ff";
    for (const j of selection.keys) ctx.strokeRect(j, 0, 1, tq);
    ctx.restore();
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.font = font;
    ctx.fillStyle = "#222";
    ctx.textBaseline = "middle";
    // Labels thinned to every 1st, 2nd, 5th, 10th, ... so that they never overlap at this zoom.
    const step = niceStep(Math.ceil(13 / s));
    const firstRow = Math.floor(zoom.oy);
    const lastRow = Math.min(tq, Math.ceil(zoom.oy + plotHeight / s));
    ctx.textAlign = "right";
    for (let i = Math.ceil(firstRow / step) * step; i < lastRow; i += step) {
      const y = y0 + (i + 0.5 - zoom.oy) * s;
      ctx.fillRect(x0 - 4, Math.floor(y), 4, 1);
      ctx.fillText(fit(rows[i], x0 - 12), x0 - 6, y);
    }
    const firstCol = Math.floor(zoom.ox);
    const lastCol = Math.min(tk, Math.ceil(zoom.ox + plotWidth / s));
    const bottom = y0 + plotHeight;
    for (let j = Math.ceil(firstCol / step) * step; j < lastCol; j += step) {
      const x = x0 + (j + 0.5 - zoom.ox) * s;
      ctx.fillRect(Math.floor(x), bottom, 1, 4);
      ctx.save();
      ctx.translate(x, bottom + 6);
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(fit(cols[j], 90), 0, 0);
      ctx.restore();
    }
    ctx.fillStyle = "#666";
    ctx.textAlign = "center";
    ctx.fillText("keys", x0 + plotWidth / 2, cssHeight - 8);
    Object.assign(canvas.dataset, { scale: s, ox: zoom.ox, oy: zoom.oy, x0, y0, labelStep: step });
  }
  const bar = $("bar");
  const barHeight = Math.max(120, plotHeight);
  bar.width = 70;
  bar.height = barHeight + 16;
  function drawBar() {
    const b = bar.getContext("2d");
    b.fillStyle = "#fff";
    b.fillRect(0, 0, bar.width, bar.height);
    for (let y = 0; y < barHeight; y++) {
      const c = rgbLut[Math.round((1 - y / (barHeight - 1)) * 255)];
      b.fillStyle = "#" + c.toString(16).padStart(6, "0");
      b.fillRect(0, y0 + y, 16, 1);
    }
    b.strokeStyle = "#555";
    b.strokeRect(0.5, y0 + 0.5, 16, barHeight - 1);
    b.fillStyle = "#222";
    b.font = font;
    b.textBaseline = "middle";
    for (const f of [0, 0.25, 0.5, 0.75, 1]) b.fillText(fmtValue(f * vmax), 20, y0 + (1 - f) * (barHeight - 1));
    bar.dataset.vmax = vmax;
  }
  const tooltip = $("tooltip");
  let drag = null;
  canvas.addEventListener("wheel", (event) => {
    event.preventDefault();
    const box = canvas.getBoundingClientRect();
    const px = event.clientX - box.left - x0;
    const py = event.clientY - box.top - y0;
    const cx = zoom.ox + px / zoom.scale;
    const cy = zoom.oy + py / zoom.scale;
    zoom.scale *= event.deltaY < 0 ? 1.25 : 0.8;
    clampZoom();
    zoom.ox = cx - px / zoom.scale;
    zoom.oy = cy - py / zoom.scale;
    drawMatrix();
  }, { passive: false });
  const zoomBy = (factor) => {
    const cx = zoom.ox + plotWidth / 2 / zoom.scale;
    const cy = zoom.oy + plotHeight / 2 / zoom.scale;
    zoom.scale *= factor;
    clampZoom();
    zoom.ox = cx - plotWidth / 2 / zoom.scale;
    zoom.oy = cy - plotHeight / 2 / zoom.scale;
    drawMatrix();
  };
  $("zoom-in").addEventListener("click", () => zoomBy(2));
  $("zoom-out").addEventListener("click", () => zoomBy(0.5));
  $("zoom-reset").addEventListener("click", () => {
    Object.assign(zoom, { scale: fitScale, ox: 0, oy: 0 });
    drawMatrix();
  });
  canvas.addEventListener("mousedown", (event) => {
    drag = { x: event.clientX, y: event.clientY, ox: zoom.ox, oy: zoom.oy };
  });
  window.addEventListener("mouseup", () => {
    drag = null;
  });
  canvas.addEventListener("mousemove", (event) => {
    if (drag) {
      zoom.ox = drag.ox - (event.clientX - drag.x) / zoom.scale;
      zoom.oy = drag.oy - (event.clientY - drag.y) / zoom.scale;
      drawMatrix();
      return;
    }
    const box = canvas.getBoundingClientRect();
    const j = Math.floor(zoom.ox + (event.clientX - box.left - x0) / zoom.scale);
    const i = Math.floor(zoom.oy + (event.clientY - box.top - y0) / zoom.scale);
    const inside = event.clientX - box.left >= x0 && event.clientY - box.top >= y0 && i >= 0 && j >= 0 && i < tq &&
      j < tk && drawable;
    if (!inside) {
      tooltip.style.display = "none";
      return;
    }
    const text = "query " + i + " " + quote(rows[i]) + " \u2192 key " + j + " " + quote(cols[j]) + "\n" +
      (view.kind === "rollout" ? "rollout" : "\u03b1") + " = " + fmtValue(valueAt(i, j)) + " (" + viewName() + ")";
    tooltip.textContent = text;
    tooltip.style.display = "block";
    tooltip.style.left = event.clientX + 14 + "px";
    tooltip.style.top = event.clientY + 14 + "px";
    $("readout").textContent = text.replace("\n", ": ");
  });
  canvas.addEventListener("mouseleave", () => {
    tooltip.style.display = "none";
  });

  // ---- head view -------------------------------------------------------------------------------
  // Every token, in two columns. Up to 48 tokens sit a line apart; a longer sequence is fitted into
  // 48 lines, and the wheel zooms (about the pointer) up to a line a token while dragging pans. Both
  // columns move by the same fraction of their length, so that the columns of a cross-attention
  // (Tq ≠ Tk) stay in proportion. The pairs drawn (α ≥ 0.01) are listed once a view, so that a redraw
  // on hover or zoom goes over them, not over Tq × Tk.
  const heads = $("heads");
  const headsCtx = heads.getContext("2d");
  const lineHeight = 16;
  const headsTop = 24;
  const qColumn = 190;
  const kColumn = 450;
  const longest = Math.max(tq, tk);
  const columnHeight = Math.min(longest, 48) * lineHeight;
  const pitchOf = (n) => Math.min(lineHeight, columnHeight / n);
  const headZoom = { z: 1, f: 0 };  // z: the zoom; f: the fraction of the longer column above the view
  const maxHeadZoom = lineHeight / pitchOf(longest);
  heads.width = 640;
  heads.height = headsTop + columnHeight + 4;
  const shift = (n) => Math.max(0, Math.min(headZoom.f * n * pitchOf(n) * headZoom.z,
    n * pitchOf(n) * headZoom.z - columnHeight));
  const yOf = (k, n) => headsTop + (k + 0.5) * pitchOf(n) * headZoom.z - shift(n);
  const indexAt = (y, n) => Math.floor((y - headsTop + shift(n)) / (pitchOf(n) * headZoom.z));
  function clampHeadZoom() {
    headZoom.z = Math.min(maxHeadZoom, Math.max(1, headZoom.z));
    headZoom.f = Math.max(0, Math.min(1 - 1 / headZoom.z, headZoom.f));
  }
  // [i, j, α, ...] of the pairs with α ≥ 0.01 (a rollout: of its largest value).
  const headPairs = new Map();
  function pairsOfHead(l, h) {
    const k = l * H + h;
    if (!headPairs.has(k)) {
      const c = codes[k];
      const out = [];
      for (let i = 0; i < tq; i++) {
        const s = scales[k * tq + i];
        const least = 0.01 / s;
        for (let j = 0; j < tk; j++) if (c[i * tk + j] >= least) out.push(i, j, c[i * tk + j] * s);
      }
      headPairs.set(k, out);
    }
    return headPairs.get(k);
  }
  let shownPairs = { of: null, pairs: [] };
  function pairsOfMatrix() {
    if (shownPairs.of !== matrix) {
      const out = [];
      const unit = view.kind === "rollout" ? vmax : 1;
      if (matrix) {
        for (let i = 0; i < tq; i++) {
          for (let j = 0; j < tk; j++) if (matrix[i * tk + j] / unit >= 0.01) out.push(i, j, matrix[i * tk + j] / unit);
        }
      }
      shownPairs = { of: matrix, pairs: out };
    }
    return shownPairs.pairs;
  }
  let hover = null;
  function drawHeads() {
    clampHeadZoom();
    const g = headsCtx;
    const bottom = headsTop + columnHeight;
    g.fillStyle = "#fff";
    g.fillRect(0, 0, heads.width, heads.height);
    g.font = font;
    g.textBaseline = "middle";
    g.fillStyle = "#666";
    g.textAlign = "right";
    g.fillText("queries", qColumn, 8);
    g.textAlign = "left";
    g.fillText("keys", kColumn, 8);
    const overlay = $("all-heads").checked && view.kind === "attention";
    const sources = overlay ? [...Array(H).keys()].map((h) => [pairsOfHead(view.layer, h), headColor(h)])
      : [[oneHead() ? pairsOfHead(view.layer, view.head) : pairsOfMatrix(),
        "#1f5fbf"]];
    // One path per 1/32 of opacity: a long sequence's thousands of lines are a few strokes.
    const levels = 32;
    let lines = 0;
    g.save();
    g.beginPath();
    g.rect(0, headsTop, heads.width, columnHeight);
    g.clip();
    g.lineWidth = pitchOf(longest) * headZoom.z >= 4 ? 2 : 1;
    for (const [pairs, color] of sources) {
      const paths = Array.from({ length: levels }, () => new Path2D());
      for (let p = 0; p < pairs.length; p += 3) {
        const i = pairs[p];
        const j = pairs[p + 1];
        if (hover && (hover.side === "query" ? hover.index !== i : hover.index !== j)) continue;
        const yq = yOf(i, tq);
        const yk = yOf(j, tk);
        if ((yq < headsTop && yk < headsTop) || (yq > bottom && yk > bottom)) continue;
        const path = paths[Math.min(levels - 1, Math.floor(pairs[p + 2] * levels))];
        path.moveTo(qColumn + 8, yq);
        path.lineTo(kColumn - 8, yk);
        lines++;
      }
      g.strokeStyle = color;
      paths.forEach((path, level) => {
        g.globalAlpha = (level + 0.5) / levels;
        g.stroke(path);
      });
    }
    // Labels thinned to every 1st, 2nd, 5th, 10th, ... so that they never overlap at this zoom.
    const labelSteps = [];
    for (const [side, n, labels, picked] of [["query", tq, rows, selection.queries], ["key", tk, cols, selection.keys]]) {
      const x = side === "query" ? qColumn : kColumn;
      const step = niceStep(Math.ceil(13 / (pitchOf(n) * headZoom.z)));
      labelSteps.push(step);
      const first = Math.max(0, indexAt(headsTop, n));
      const last = Math.min(n - 1, indexAt(bottom, n));
      g.textAlign = side === "query" ? "right" : "left";
      for (const k of picked) {
        if (k < first || k > last) continue;
        g.fillStyle = side === "query" ? "#ff00cc" : "#00c8ff";
        g.fillRect(side === "query" ? x + 2 : x - 6, yOf(k, n) - 1, 4, 3);
      }
      for (let k = Math.ceil(first / step) * step; k <= last; k += step) {
        if (picked.includes(k)) {
          g.fillStyle = side === "query" ? "#ffd6f5" : "#d0f4ff";
          g.fillRect(side === "query" ? x - 170 : x - 4, yOf(k, n) - 7, 174, 14);
        }
        g.fillStyle = hover && hover.side === side && hover.index === k ? "#1f5fbf" : "#222";
        g.fillText(fit(data.numbered ? labels[k] : k + " " + labels[k], 160), x, yOf(k, n));
      }
    }
    g.restore();
    if (overlay) {
      g.textAlign = "left";
      for (let h = 0; h < H; h++) {
        g.fillStyle = headColor(h);
        g.fillText("h" + h, qColumn + 20 + h * ((kColumn - qColumn - 40) / H), 8);
      }
    }
    const bottomIndex = (n) => Math.min(n - 1, indexAt(bottom - 1, n));
    Object.assign(heads.dataset, { lines, overlay, zoom: headZoom.z, queryStart: Math.max(0, indexAt(headsTop, tq)),
      queryEnd: bottomIndex(tq), keyStart: Math.max(0, indexAt(headsTop, tk)), keyEnd: bottomIndex(tk),
      labelStep: labelSteps.join(",") });
  }
  const tokenAt = (event) => {
    const box = heads.getBoundingClientRect();
    const x = event.clientX - box.left;
    const y = event.clientY - box.top;
    if (y < headsTop || y >= headsTop + columnHeight) return null;
    for (const [side, n, near] of [["query", tq, x < qColumn + 10], ["key", tk, x > kColumn - 10]]) {
      const k = indexAt(y, n);
      if (near && k >= 0 && k < n) return { side, index: k };
    }
    return null;
  };
  let headDrag = null;
  let dragged = false;  // a drag ends in a click, which then selects nothing
  heads.addEventListener("wheel", (event) => {
    event.preventDefault();
    const y = event.clientY - heads.getBoundingClientRect().top - headsTop;
    const whole = columnHeight * headZoom.z;
    const at = (y + headZoom.f * whole) / whole;  // the fraction of the longer column under the pointer
    headZoom.z *= event.deltaY < 0 ? 1.25 : 0.8;
    clampHeadZoom();
    headZoom.f = (at * columnHeight * headZoom.z - y) / (columnHeight * headZoom.z);
    drawHeads();
  }, { passive: false });
  heads.addEventListener("mousedown", (event) => {
    headDrag = { y: event.clientY, f: headZoom.f };
    dragged = false;
  });
  window.addEventListener("mouseup", () => {
    headDrag = null;
  });
  heads.addEventListener("mousemove", (event) => {
    if (headDrag && Math.abs(event.clientY - headDrag.y) > 3) {
      dragged = true;
      headZoom.f = headDrag.f - (event.clientY - headDrag.y) / (columnHeight * headZoom.z);
      drawHeads();
      return;
    }
    const next = tokenAt(event);
    if (JSON.stringify(next) === JSON.stringify(hover)) return;
    hover = next;
    if (hover) {
      const label = (hover.side === "query" ? rows : cols)[hover.index];
      $("readout").textContent = hover.side + " " + hover.index + " " + quote(label) + " (" + viewName() + ")";
    }
    drawHeads();
  });
  heads.addEventListener("mouseleave", () => {
    hover = null;
    drawHeads();
  });
  heads.addEventListener("click", (event) => {
    const t = tokenAt(event);
    if (dragged || !t) return;
    const list = t.side === "query" ? selection.queries : selection.keys;
    const at = list.indexOf(t.index);
    if (at >= 0) list.splice(at, 1);
    else list.push(t.index);
    list.sort((a, b) => a - b);
    $(t.side === "query" ? "queries" : "keys").value = list.join(" ");
    selectionChanged();
  });
  heads.addEventListener("dblclick", () => {
    Object.assign(headZoom, { z: 1, f: 0 });
    drawHeads();
  });
  $("all-heads").addEventListener("change", drawHeads);

  // ---- selections ------------------------------------------------------------------------------
  const selection = { queries: [], keys: [] };
  // "3 5-7" → [3, 5, 6, 7]; null when a part is not an index or span below n.
  function parseIndices(text, n) {
    const out = new Set();
    for (const part of text.split(/[\s,]+/).filter((p) => p.length > 0)) {
      const m = /^(\d+)(?:-(\d+))?$/.exec(part);
      if (!m) return null;
      const from = Number(m[1]);
      const to = m[2] === undefined ? from : Number(m[2]);
      if (to < from || to >= n) return null;
      for (let k = from; k <= to; k++) out.add(k);
    }
    return [...out].sort((a, b) => a - b);
  }
  for (const [id, key, n] of [["queries", "queries", tq], ["keys", "keys", tk]]) {
    $(id).addEventListener("input", () => {
      const parsed = parseIndices($(id).value, n);
      $(id).setAttribute("aria-invalid", parsed === null ? "true" : "false");
      if (parsed === null) return;
      selection[key] = parsed;
      selectionChanged();
    });
  }
  $("combine").addEventListener("change", () => selectionChanged());
  function selectionChanged() {
    drawMatrix();
    drawHeads();
    drawSelections();
  }
  // The sum (or mean) of the selected rows of what is shown, over the keys.
  function rowResult() {
    if (selection.queries.length === 0) return null;
    const out = new Float64Array(tk);
    for (const i of selection.queries) {
      const row = drawable ? shownMatrix().subarray(i * tk, (i + 1) * tk) : rolloutRow(i, view.layer);
      for (let j = 0; j < tk; j++) out[j] += row[j];
    }
    if ($("combine").value === "mean") for (let j = 0; j < tk; j++) out[j] /= selection.queries.length;
    return out;
  }
  // Who attends to the selected keys: the sum (or mean) of their columns, over the queries.
  function colResult() {
    if (selection.keys.length === 0 || !drawable) return null;
    shownMatrix();
    const out = new Float64Array(tq);
    for (let i = 0; i < tq; i++) for (const j of selection.keys) out[i] += matrix[i * tk + j];
    if ($("combine").value === "mean") for (let i = 0; i < tq; i++) out[i] /= selection.keys.length;
    return out;
  }
  const top = (values, labels) => [...values].map((v, k) => [v, k]).sort((a, b) => b[0] - a[0]).slice(0, 5)
    .map(([v, k]) => k + " " + quote(labels[k]) + " " + fmtValue(v)).join(", ");
  // Bars over the keys (or queries), labelled as the matrix is: thinned so that labels never overlap.
  function drawBars(target, values, color, labels) {
    const bars = 90;
    target.width = 880;
    target.height = values ? bars + 60 : 0;
    if (!values) return;
    const g = target.getContext("2d");
    let largest = 0;
    for (const v of values) if (v > largest) largest = v;
    g.fillStyle = "#f6f6f6";
    g.fillRect(0, 0, target.width, bars);
    const w = target.width / values.length;
    const step = niceStep(Math.ceil(13 / w));
    g.font = font;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let k = 0; k < values.length; k++) {
      const h = largest > 0 ? values[k] / largest * (bars - 4) : 0;
      g.fillStyle = color;
      g.fillRect(k * w, bars - h, Math.max(w - (w > 3 ? 1 : 0), 0.5), h);
      if (k % step !== 0) continue;
      g.save();
      g.translate(k * w + w / 2, bars + 4);
      g.rotate(-Math.PI / 2);
      g.fillStyle = "#222";
      g.fillText(fit(labels[k], 54), 0, 0);
      g.restore();
    }
  }
  function drawSelections() {
    const combine = $("combine").value;
    const rowsOut = rowResult();
    const colsOut = colResult();
    $("query-readout").textContent = rowsOut ? "The " + combine + " of queries " + selection.queries.join(", ") +
      " (" + viewName() + ") looks most at " + top(rowsOut, cols) : "Select query tokens to see where they look.";
    $("key-readout").textContent = colsOut ? "Keys " + selection.keys.join(", ") + " are looked at most by " +
      top(colsOut, rows) + " (" + combine + ", " + viewName() + ")"
      : selection.keys.length > 0 ? "The whole rollout is needed for keys; it is drawn up to " + data.rolloutLimit +
        " tokens." : "Select key tokens to see who attends to them.";
    drawBars($("query-bars"), rowsOut, "#c0399f", cols);
    drawBars($("key-bars"), colsOut, "#1b9ac4", rows);
  }

  // ---- per-head summaries ----------------------------------------------------------------------
  function summaryTable(table, values, caption) {
    let largest = 0;
    for (const v of values) if (v > largest) largest = v;
    const head = table.createTHead().insertRow();
    const th = document.createElement("th");
    th.textContent = caption;
    head.appendChild(th);
    for (let h = 0; h < H; h++) {
      const cell = document.createElement("th");
      cell.textContent = "h" + h;
      head.appendChild(cell);
    }
    const body = table.createTBody();
    for (let l = 0; l < L; l++) {
      const row = body.insertRow();
      const name = document.createElement("th");
      name.textContent = layers[l];
      row.appendChild(name);
      for (let h = 0; h < H; h++) {
        const cell = row.insertCell();
        const v = values[l * H + h];
        const c = rgbLut[Math.round((largest > 0 ? v / largest : 0) * 255)];
        cell.textContent = v.toFixed(2);
        cell.style.background = "#" + c.toString(16).padStart(6, "0");
        cell.style.color = 0.2126 * (c >> 16) + 0.7152 * ((c >> 8) & 255) + 0.0722 * (c & 255) > 128 ? "#000" : "#fff";
        cell.dataset.layer = l;
        cell.dataset.head = h;
        cell.addEventListener("click", () => setView({ kind: "attention", layer: l, head: h }));
      }
    }
  }
  summaryTable($("entropy"), data.entropy, "entropy");
  summaryTable($("distance"), data.distance, "distance");

  window.qkvExplorer = {
    state: () => ({ ...view, zoom: { ...zoom }, selection: { queries: [...selection.queries], keys: [...selection.keys] } }),
    weights: (l, h) => Array.from(headWeights(l, h)),
    rollout: (l) => Array.from(rollout(l)),
    rolloutRow: (i, l) => Array.from(rolloutRow(i, l)),
    rowResult: () => { const r = rowResult(); return r && Array.from(r); },
    colResult: () => { const r = colResult(); return r && Array.from(r); },
    setView,
  };
  await setView({});
  // On the page's clock, from the start of the navigation: the reader's wait, with no test harness in it.
  document.body.dataset.readyMs = Math.round(performance.now());
  document.body.dataset.ready = "true";
  await loadLayersUpTo(L - 1);
  for (const worker of workers) worker.terminate();
  document.body.dataset.loadedMs = Math.round(performance.now());
  document.body.dataset.loaded = "true";
})().catch((error) => {
  document.getElementById("readout").textContent = "The page could not be drawn: " + error.message;
  throw error;
});
</script>
)QKV";

}  // namespace

std::string render_explorer_html(TensorView<const float> attention, const ExplorerOptions& options) {
  if (attention.rank() != 4) {
    throw ShapeError(fmt::format("attention: expected [L, H, Tq, Tk], got {}", attention.shape.str()));
  }
  const int64_t layers = attention.shape[0], heads = attention.shape[1];
  const int64_t tq = attention.shape[2], tk = attention.shape[3];
  if (attention.numel() == 0) {
    throw ShapeError(fmt::format("attention: expected no dim of 0, got {}", attention.shape.str()));
  }
  const std::vector<std::string> names = labels_or_numbers(options.layer_names, layers, "layer ", "layer_names");
  const std::vector<std::string> rows = labels_or_numbers(options.query_tokens, tq, "", "query_tokens");
  const std::vector<std::string> cols = labels_or_numbers(options.key_tokens, tk, "", "key_tokens");
  const std::string title = options.title.empty() ? "Attention explorer" : options.title;
  const Packed packed = pack(attention);
  std::vector<std::string> lut;
  for (int k = 0; k < 256; ++k) {
    const Rgb c = colormap_at(options.colormap, k / 255.0);
    lut.push_back(fmt::format("#{:02x}{:02x}{:02x}", c.r, c.g, c.b));
  }

  std::string out(kPage);
  fmt::format_to(std::back_inserter(out), "<title>{}</title>\n",
                 heatmap_detail::escape_markup(title, heatmap_detail::Markup::html_text));
  out += kBody;
  out += "<script type=\"application/json\" id=\"qkv-data\">";
  fmt::format_to(std::back_inserter(out), "{{\"title\":{},\"source\":{},\"L\":{},\"H\":{},\"tq\":{},\"tk\":{},",
                 json_string(title), json_string(options.source), layers, heads, tq, tk);
  fmt::format_to(
      std::back_inserter(out), "\"layers\":{},\"rows\":{},\"cols\":{},\"numbered\":{},\"lut\":{},\"rolloutLimit\":512,",
      json_strings(names), json_strings(rows), json_strings(cols), options.query_tokens.empty(), json_strings(lut));
  fmt::format_to(std::back_inserter(out), "\"entropy\":{},\"distance\":{},", json_numbers(attention_entropy(attention)),
                 json_numbers(attention_distance(attention)));
  fmt::format_to(std::back_inserter(out), "\"thumbnailShape\":[{},{}],\"thumbnails\":\"{}\",", std::min(tq, kThumbnail),
                 std::min(tk, kThumbnail), base64(packed.thumbnails));
  out += "\"scales\":\"" + base64(packed.scales) + "\"}</script>\n";
  // Each head's deflated codes in parts of at most kPartBytes, each its own base64 element: the
  // parser takes many small text nodes faster than one of megabytes. The first layer's come before
  // the script, so that the page is drawn from them, every other layer's after it.
  constexpr size_t kPartBytes = 3 << 18;
  const size_t plane = static_cast<size_t>(tq * tk);
  for (size_t head = 0; head * plane < packed.codes.size(); ++head) {
    if (head == static_cast<size_t>(heads)) out += kScript;
    const std::string deflated = deflate(packed.codes.substr(head * plane, plane));
    for (size_t at = 0; at < deflated.size(); at += kPartBytes) {
      fmt::format_to(std::back_inserter(out),
                     "<script type=\"application/octet-stream\" data-head=\"{}\">{}</script>\n", head,
                     base64(std::string_view(deflated).substr(at, kPartBytes)));
    }
  }
  if (layers == 1) out += kScript;
  out += "</body>\n</html>\n";
  return out;
}

}  // namespace qkv
