// The interactive heatmap: one self-contained HTML file that opens from disk (file://) with no
// network. Styles and script are inline; the data is JSON in a <script type="application/json">
// element, read with JSON.parse (never evaluated), so no label can inject markup or code.
//
// The page shows
//   - a matrix view: a canvas of the cells with thinned labels, a colour bar, and on hover the
//     query, the key and the exact value (the float32 value's shortest decimal that reads back);
//   - a token view, as bertviz draws it: queries on the left, keys on the right; hovering (or
//     focusing) a query colours every key by α_ij and draws a line to it with opacity by α_ij,
//     hovering a key does the same for the queries that look at it;
//   - a head selector when alpha has more than one head.
// Colours come from a 256-entry table of the colour map written by the C++ side, so the page, the
// PNG and the terminal agree, and the scale (HeatmapScale) is applied as the C++ side applies it.
// Masked cells are light grey, their hover says "masked"; a clipped end of the colour bar gets a
// triangle (#clip-high, #clip-low). Hooks for tests: tokens carry data-i / data-j, and a highlighted
// token data-alpha (the exact value) or data-masked; the canvas carries its cell geometry as data
// attributes.

#include <fmt/format.h>

#include "heatmap_internal.hpp"

namespace qkv::heatmap_detail {

// A JSON string literal. '<', '>' and '&' are escaped too, so "</script>" in a label cannot end the
// data element, and U+2028/U+2029, which older JavaScript parsers refuse inside strings.
std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == '<' || c == '>' || c == '&') {
      out += fmt::format("\\u{:04x}", c);
    } else if (c == 0xE2 && text.substr(i, 3) == "\u2028") {
      out += "\\u2028";
      i += 2;
    } else if (c == 0xE2 && text.substr(i, 3) == "\u2029") {
      out += "\\u2029";
      i += 2;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string json_strings(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t k = 0; k < items.size(); ++k) {
    if (k > 0) out += ',';
    out += json_string(items[k]);
  }
  return out + "]";
}

namespace {

std::string figure_json(const Figure& f) {
  std::string out = "{";
  const std::string title = f.title.empty() ? "Attention weights α" : f.title;
  fmt::format_to(std::back_inserter(out), "\"title\":{},\"shape\":[{}],\"batch\":{},\"batches\":{},",
                 json_string(title), fmt::join(f.shape.dims(), ","), f.batch, f.shape.rank() == 4 ? f.shape[0] : 1);
  fmt::format_to(std::back_inserter(out), "\"tq\":{},\"tk\":{},\"rows\":{},\"cols\":{},\"labelsGiven\":{},", f.tq, f.tk,
                 json_strings(f.row_labels), json_strings(f.col_labels), f.labels_given);
  out += "\"heads\":[";
  for (size_t k = 0; k < f.panels.size(); ++k) {
    const Panel& panel = f.panels[k];
    fmt::format_to(std::back_inserter(out), "{}{{\"name\":{},\"values\":[", k == 0 ? "" : ",",
                   json_string(panel.caption.empty() ? "head 0" : panel.caption));
    for (size_t v = 0; v < panel.values.size(); ++v) {
      if (v > 0) out += ',';
      out += f.exact(panel.values[v]);
    }
    out += ']';
    if (!panel.masked.empty())
      fmt::format_to(std::back_inserter(out), ",\"masked\":[{}]", fmt::join(panel.masked, ","));
    out += '}';
  }
  fmt::format_to(std::back_inserter(out), "],\"initial\":{},\"vmin\":{},\"vmax\":{},\"ticks\":[{}],\"tickText\":{},",
                 f.first_head, f.layout.vmin, f.layout.vmax, fmt::join(f.layout.ticks, ","), json_strings(f.tick_text));
  std::vector<std::string> lut;
  for (int k = 0; k < 256; ++k) {
    const Rgb c = colormap_at(f.colormap, k / 255.0);
    lut.push_back(fmt::format("#{:02x}{:02x}{:02x}", c.r, c.g, c.b));
  }
  fmt::format_to(std::back_inserter(out), "\"scale\":{},\"diverging\":{},\"clippedLow\":{},\"clippedHigh\":{},",
                 json_string(heatmap_scale_name(f.scale)), colormap_is_diverging(f.colormap), f.layout.clipped_low,
                 f.layout.clipped_high);
  fmt::format_to(std::back_inserter(out), "\"colormap\":{},\"lut\":{}}}", json_string(colormap_name(f.colormap)),
                 json_strings(lut));
  return out;
}

constexpr std::string_view kHead = R"QKV(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="qkv heatmap">
<link rel="icon" href="data:,">
)QKV";

constexpr std::string_view kStyle = R"QKV(<style>
:root { color-scheme: light; --ink: #222; --muted: #666; --rule: #ddd; --accent: #1f5fbf;
  font-family: "DejaVu Sans", "Noto Sans CJK SC", system-ui, sans-serif; color: var(--ink); background: #fff; }
body { margin: 24px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 15px; margin: 0 0 6px; }
.meta, .hint { color: var(--muted); font-size: 13px; margin: 0 0 12px; max-width: 60em; }
.controls { display: flex; gap: 16px; align-items: center; margin: 0 0 16px; font-size: 14px; }
.controls[hidden] { display: none; }
#readout { min-height: 1.4em; font-size: 14px; margin: 0 0 16px; padding: 6px 10px; background: #f4f6f9;
  border-left: 3px solid var(--accent); max-width: 70em; }
main { display: flex; flex-wrap: wrap; gap: 40px; align-items: flex-start; }
.figure { display: flex; gap: 10px; align-items: flex-start; }
#matrix-wrap { position: relative; }
#matrix { display: block; cursor: crosshair; }
#cursor { position: absolute; pointer-events: none; box-shadow: 0 0 0 1px #fff, 0 0 0 2px #000; display: none; }
#tooltip { position: fixed; pointer-events: none; background: rgba(25, 25, 25, .92); color: #fff; font-size: 12px;
  padding: 5px 8px; border-radius: 4px; white-space: pre; display: none; z-index: 2; }
.colorbar { display: flex; gap: 6px; }
#bar { position: relative; width: 16px; border: 1px solid #555; }
.clip { position: absolute; left: -2px; width: 0; height: 0; border-left: 10px solid transparent;
  border-right: 10px solid transparent; }
.clip.high { bottom: 100%; margin-bottom: 2px; }
.clip.low { top: 100%; margin-top: 2px; }
#bar-ticks { position: relative; font-size: 11px; min-width: 3.5em; }
#bar-ticks span { position: absolute; left: 0; transform: translateY(50%); white-space: nowrap; }
#bar-ticks span::before { content: ""; display: inline-block; width: 4px; height: 1px; background: #555;
  vertical-align: middle; margin-right: 3px; }
#token-scroll { max-height: 75vh; overflow: auto; border: 1px solid var(--rule); border-radius: 4px; padding: 8px; }
#pair { position: relative; display: grid; grid-template-columns: max-content 120px max-content; }
#links { position: absolute; left: 0; top: 0; pointer-events: none; overflow: visible; }
.column-title { font-size: 12px; color: var(--muted); padding: 0 0 6px; }
.tok { display: flex; justify-content: space-between; gap: 8px; font-size: 14px; line-height: 18px; padding: 1px 6px;
  margin: 1px 0; border-radius: 3px; background: #f0f0f0; cursor: default; min-width: 3em; }
.tok .w { font-size: 11px; font-variant-numeric: tabular-nums; opacity: .85; }
.tok.source { outline: 2px solid var(--accent); background: #fff; }
.tok.marked { outline: 2px dashed #000; }
.tok:focus-visible { outline: 2px solid var(--accent); }
</style>
)QKV";

constexpr std::string_view kBody = R"QKV(</head>
<body>
<h1 id="title"></h1>
<p class="meta" id="meta"></p>
<p class="controls" id="controls" hidden><label>Head <select id="head"></select></label></p>
<p id="readout" aria-live="polite">Hover a cell of the matrix, or a token, to see who looks at whom.</p>
<main>
<section>
<h2>Matrix</h2>
<p class="hint">Rows are queries, columns are keys: row i is how query i spreads its attention.</p>
<div class="figure">
<div id="matrix-wrap">
<canvas id="matrix" role="img" aria-label="attention weights: rows are queries, columns are keys"></canvas>
<div id="cursor"></div>
</div>
<div class="colorbar"><div id="bar"></div><div id="bar-ticks"></div></div>
</div>
</section>
<section>
<h2>Tokens</h2>
<p class="hint">Hover a query (left) to colour the keys it looks at by α;
hover a key (right) to see who looks at it.</p>
<div id="token-scroll"><div id="pair">
<div id="queries"><div class="column-title">queries</div></div>
<div></div>
<div id="keys"><div class="column-title">keys</div></div>
<svg id="links" xmlns="http://www.w3.org/2000/svg"></svg>
</div></div>
</section>
</main>
<div id="tooltip"></div>
)QKV";

constexpr std::string_view kScript = R"QKV(<script>
"use strict";
(() => {
  const data = JSON.parse(document.getElementById("qkv-data").textContent);
  const $ = (id) => document.getElementById(id);
  const { tq, tk, rows, cols, heads, lut } = data;
  const span = data.vmax - data.vmin;
  let head = data.initial;
  let selection = null;  // {kind: "query" | "key", index, mark}

  // The C++ side's HeatmapScale: each half of a diverging map is stretched from the middle out.
  const stretch = (u) => data.scale === "sqrt" ? Math.sqrt(u) : data.scale === "log" ? Math.log10(1 + 999 * u) / 3 : u;
  const position = (v) => {
    const u = Math.min(1, Math.max(0, (v - data.vmin) / span));
    if (!data.diverging) return stretch(u);
    const w = 2 * u - 1;
    return (1 + Math.sign(w) * stretch(Math.abs(w))) / 2;
  };
  const maskedColor = "#e0e0e0";
  const masked = (i, j) => heads[head].masked !== undefined && heads[head].masked[i * tk + j] === 1;
  const colorOf = (v) => lut[Math.round(position(v) * (lut.length - 1))];
  const inkOn = (hex) => {
    const n = parseInt(hex.slice(1), 16);
    return 0.2126 * (n >> 16) + 0.7152 * ((n >> 8) & 255) + 0.0722 * (n & 255) > 128 ? "#000" : "#fff";
  };
  const alpha = (i, j) => heads[head].values[i * tk + j];
  const exact = (v) => String(v);
  const quote = (s) => "\u201c" + s + "\u201d";
  const niceStep = (n) => {
    for (let decade = 1; ; decade *= 10) for (const m of [1, 2, 5]) if (m * decade >= n) return m * decade;
  };

  // ---- header --------------------------------------------------------------------------------
  document.title = data.title;
  $("title").textContent = data.title;
  const shape = "[" + data.shape.join(", ") + "]";
  $("meta").textContent = "\u03b1 " + shape + (data.batches > 1 ? " \u00b7 batch " + data.batch : "") +
    " \u00b7 " + tq + " queries \u00d7 " + tk + " keys \u00b7 colours: " + data.colormap + ", " +
    Number(data.vmin.toPrecision(4)) + " to " + Number(data.vmax.toPrecision(4)) + " \u00b7 drawn by qkv heatmap";
  if (heads.length > 1) {
    const select = $("head");
    heads.forEach((h, k) => select.add(new Option(h.name, String(k))));
    select.value = String(head);
    select.addEventListener("change", () => {
      head = Number(select.value);
      drawMatrix();
      refresh();  // the same selection, in the new head
    });
    $("controls").hidden = false;
  }

  // ---- matrix view -----------------------------------------------------------------------------
  const canvas = $("matrix");
  const font = "12px \"DejaVu Sans\", \"Noto Sans CJK SC\", system-ui, sans-serif";
  const cell = Math.max(1, Math.min(48, Math.floor(640 / Math.max(tq, tk))));
  const ctx = canvas.getContext("2d");
  ctx.font = font;
  const fit = (s) => {
    if (ctx.measureText(s).width <= 140) return s;
    const chars = Array.from(s);
    while (chars.length > 0 && ctx.measureText(chars.join("") + "\u2026").width > 140) chars.pop();
    return chars.join("") + "\u2026";
  };
  const rowStep = niceStep(Math.ceil(16 / cell));
  const colStep = niceStep(Math.ceil(16 / cell));
  const rowText = rows.map((s, i) => (i % rowStep === 0 ? fit(s) : ""));
  const colText = cols.map((s, j) => (j % colStep === 0 ? fit(s) : ""));
  const widest = (texts) => Math.ceil(Math.max(0, ...texts.map((s) => ctx.measureText(s).width)));
  const geometry = { x0: 0, y0: 0, width: tk * cell, height: tq * cell };
  geometry.x0 = 8 + 16 + 6 + widest(rowText) + 8;
  geometry.y0 = 4;
  const cssWidth = geometry.x0 + geometry.width + 8;
  // Key labels read upwards only when one is wider than its column.
  const rotated = widest(colText) + 4 > colStep * cell;
  const colBand = rotated ? widest(colText) : 14;
  const cssHeight = geometry.y0 + geometry.height + 8 + colBand + 6 + 16 + 4;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.ceil(cssWidth * dpr);
  canvas.height = Math.ceil(cssHeight * dpr);
  canvas.style.width = cssWidth + "px";
  canvas.style.height = cssHeight + "px";
  Object.assign(canvas.dataset, { x0: geometry.x0, y0: geometry.y0, cellWidth: cell, cellHeight: cell });

  function drawMatrix() {
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, cssWidth, cssHeight);
    const cells = document.createElement("canvas");
    cells.width = tk;
    cells.height = tq;
    const cellsCtx = cells.getContext("2d");
    const image = cellsCtx.createImageData(tk, tq);
    for (let i = 0; i < tq; i++) {
      for (let j = 0; j < tk; j++) {
        const n = parseInt((masked(i, j) ? maskedColor : colorOf(alpha(i, j))).slice(1), 16);
        const o = 4 * (i * tk + j);
        image.data[o] = n >> 16;
        image.data[o + 1] = (n >> 8) & 255;
        image.data[o + 2] = n & 255;
        image.data[o + 3] = 255;
      }
    }
    cellsCtx.putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(cells, geometry.x0, geometry.y0, geometry.width, geometry.height);

    ctx.font = font;
    ctx.fillStyle = "#222";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let i = 0; i < tq; i += rowStep) {
      const y = geometry.y0 + (i + 0.5) * cell;
      ctx.fillRect(geometry.x0 - 4, Math.floor(y), 4, 1);
      ctx.fillText(rowText[i], geometry.x0 - 7, y);
    }
    const bottom = geometry.y0 + geometry.height;
    for (let j = 0; j < tk; j += colStep) {
      const x = geometry.x0 + (j + 0.5) * cell;
      ctx.fillRect(Math.floor(x), bottom, 1, 4);
      if (rotated) {
        ctx.save();
        ctx.translate(x, bottom + 7);
        ctx.rotate(-Math.PI / 2);
        ctx.fillText(colText[j], 0, 0);
        ctx.restore();
      } else {
        ctx.textAlign = "center";
        ctx.fillText(colText[j], x, bottom + 7 + 7);
        ctx.textAlign = "right";
      }
    }
    ctx.fillStyle = "#666";
    ctx.textAlign = "center";
    ctx.fillText("keys", geometry.x0 + geometry.width / 2, cssHeight - 12);
    ctx.save();
    ctx.translate(16, geometry.y0 + geometry.height / 2);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText("queries", 0, 0);
    ctx.restore();
  }

  const bar = $("bar");
  const barHeight = Math.max(120, geometry.height);
  bar.style.height = barHeight + "px";
  bar.style.marginTop = geometry.y0 + "px";
  bar.style.background = "linear-gradient(to top, " +
    lut.map((c, k) => c + " " + (100 * k / (lut.length - 1)).toFixed(2) + "%").join(", ") + ")";
  const ticks = $("bar-ticks");
  ticks.style.height = barHeight + "px";
  ticks.style.marginTop = geometry.y0 + "px";
  // A triangle past each clipped end, in that end's colour: values beyond it are drawn in it.
  for (const [end, clipped, color] of [["high", data.clippedHigh, lut[lut.length - 1]], ["low", data.clippedLow, lut[0]]]) {
    if (!clipped) continue;
    const marker = document.createElement("div");
    marker.className = "clip " + end;
    marker.id = "clip-" + end;
    marker.style[end === "high" ? "borderBottom" : "borderTop"] = "10px solid " + color;
    marker.title = end === "high" ? "values above " + data.vmax + " are drawn as " + data.vmax
      : "values below " + data.vmin + " are drawn as " + data.vmin;
    bar.appendChild(marker);
  }
  data.ticks.forEach((t, k) => {
    const label = document.createElement("span");
    label.textContent = data.tickText[k];
    label.style.bottom = (100 * position(t)) + "%";
    ticks.appendChild(label);
  });

  const tooltip = $("tooltip");
  const cursor = $("cursor");
  canvas.addEventListener("mousemove", (event) => {
    const box = canvas.getBoundingClientRect();
    const j = Math.floor((event.clientX - box.left - geometry.x0) / cell);
    const i = Math.floor((event.clientY - box.top - geometry.y0) / cell);
    if (i < 0 || j < 0 || i >= tq || j >= tk) {
      leaveMatrix();
      return;
    }
    const a = alpha(i, j);
    const what = masked(i, j) ? "masked" : "\u03b1 = " + exact(a);
    tooltip.textContent = "query " + i + " " + quote(rows[i]) + " \u2192 key " + j + " " + quote(cols[j]) + "\n" + what;
    tooltip.style.display = "block";
    tooltip.style.left = (event.clientX + 14) + "px";
    tooltip.style.top = (event.clientY + 14) + "px";
    Object.assign(cursor.style, { display: "block", left: (geometry.x0 + j * cell) + "px",
      top: (geometry.y0 + i * cell) + "px", width: cell + "px", height: cell + "px" });
    select({ kind: "query", index: i, mark: j });
    $("readout").textContent = "\u03b1[" + i + ", " + j + "]" + (masked(i, j) ? " masked" : " = " + exact(a)) +
      ": query " + quote(rows[i]) +
      " \u2192 key " + quote(cols[j]) + (heads.length > 1 ? " (" + heads[head].name + ")" : "");
  });
  const leaveMatrix = () => {
    tooltip.style.display = "none";
    cursor.style.display = "none";
    select(null);
  };
  canvas.addEventListener("mouseleave", leaveMatrix);

  // ---- token view ----------------------------------------------------------------------------
  const makeTokens = (parent, labels, attribute) => labels.map((label, k) => {
    const el = document.createElement("div");
    el.className = "tok";
    el.tabIndex = 0;
    el.setAttribute(attribute, String(k));
    const text = document.createElement("span");
    text.className = "t";
    text.textContent = label;
    const weight = document.createElement("span");
    weight.className = "w";
    el.append(text, weight);
    parent.appendChild(el);
    return el;
  });
  const queryEls = makeTokens($("queries"), rows, "data-i");
  const keyEls = makeTokens($("keys"), cols, "data-j");
  const pair = $("pair");
  const links = $("links");
  const svgNS = "http://www.w3.org/2000/svg";

  function clearTokens() {
    for (const el of queryEls.concat(keyEls)) {
      el.classList.remove("source", "marked");
      el.style.background = "";
      el.style.color = "";
      el.removeAttribute("data-alpha");
      el.removeAttribute("data-masked");
      el.removeAttribute("title");
      el.querySelector(".w").textContent = "";
    }
    links.replaceChildren();
  }

  function paint(el, a, i, j) {
    if (masked(i, j)) {
      el.style.background = maskedColor;
      el.style.color = "#555";
      el.dataset.masked = "true";
      el.title = "\u03b1[" + i + ", " + j + "] masked";
      el.querySelector(".w").textContent = "masked";
      return;
    }
    const color = colorOf(a);
    el.style.background = color;
    el.style.color = inkOn(color);
    el.dataset.alpha = exact(a);
    el.title = "\u03b1[" + i + ", " + j + "] = " + exact(a);
    el.querySelector(".w").textContent = a.toFixed(3);
  }

  // A line from each query to each key of `pairs` ([from, to, α]), opaque as α. Every position is
  // read after every token was painted, so the browser lays the page out once, not once a line.
  function drawLinks(pairs) {
    const base = pair.getBoundingClientRect();
    links.setAttribute("width", base.width);
    links.setAttribute("height", base.height);
    const lines = document.createDocumentFragment();
    for (const [from, to, a] of pairs) {
      const f = from.getBoundingClientRect();
      const t = to.getBoundingClientRect();
      const line = document.createElementNS(svgNS, "line");
      line.setAttribute("x1", f.right - base.left);
      line.setAttribute("y1", f.top + f.height / 2 - base.top);
      line.setAttribute("x2", t.left - base.left);
      line.setAttribute("y2", t.top + t.height / 2 - base.top);
      line.setAttribute("stroke", "#1f5fbf");
      line.setAttribute("stroke-width", "2");
      line.setAttribute("stroke-opacity", position(a).toFixed(3));
      lines.appendChild(line);
    }
    links.replaceChildren(lines);
  }

  function top3(values, labels, seen) {
    return values.map((a, k) => [a, k]).filter(([, k]) => seen(k)).sort((x, y) => y[0] - x[0]).slice(0, 3)
      .map(([a, k]) => quote(labels[k]) + " " + a.toFixed(3)).join(", ");
  }

  function select(next) {
    const same = (a, b) => a === b || (a && b && a.kind === b.kind && a.index === b.index && a.mark === b.mark);
    if (same(selection, next)) return;
    const sameQuery = selection && next && selection.kind === next.kind && selection.index === next.index;
    if (sameQuery && next.mark !== undefined) {
      // Along a row of the matrix only the marked key moves: no need to repaint every token.
      if (selection.mark !== undefined) keyEls[selection.mark].classList.remove("marked");
      if (next.mark !== undefined) keyEls[next.mark].classList.add("marked");
      selection = next;
      return;
    }
    selection = next;
    refresh();
  }

  function refresh() {
    clearTokens();
    if (!selection) return;
    const { kind, index, mark } = selection;
    const pairs = [];
    const suffix = heads.length > 1 ? " (" + heads[head].name + ")" : "";
    if (kind === "query") {
      queryEls[index].classList.add("source");
      const values = [];
      for (let j = 0; j < tk; j++) {
        const a = alpha(index, j);
        values.push(a);
        paint(keyEls[j], a, index, j);
        if (a > 0 && !masked(index, j)) pairs.push([queryEls[index], keyEls[j], a]);
      }
      if (mark !== undefined) keyEls[mark].classList.add("marked");
      else $("readout").textContent = "query " + index + " " + quote(rows[index]) + " looks most at " +
        top3(values, cols, (j) => !masked(index, j)) + suffix;
    } else {
      keyEls[index].classList.add("source");
      const values = [];
      for (let i = 0; i < tq; i++) {
        const a = alpha(i, index);
        values.push(a);
        paint(queryEls[i], a, i, index);
        if (a > 0 && !masked(i, index)) pairs.push([queryEls[i], keyEls[index], a]);
      }
      $("readout").textContent = "key " + index + " " + quote(cols[index]) + " is looked at most by " +
        top3(values, rows, (i) => !masked(i, index)) + suffix;
    }
    drawLinks(pairs);
  }

  const bind = (els, kind) => els.forEach((el, k) => {
    el.addEventListener("mouseenter", () => select({ kind, index: k }));
    el.addEventListener("focus", () => select({ kind, index: k }));
    el.addEventListener("mouseleave", () => select(null));
    el.addEventListener("blur", () => select(null));
  });
  bind(queryEls, "query");
  bind(keyEls, "key");

  drawMatrix();
  document.body.dataset.ready = "true";
})();
</script>
)QKV";

}  // namespace

std::string render_html(const Figure& f) {
  std::string out(kHead);
  fmt::format_to(std::back_inserter(out), "<title>{}</title>\n",
                 escape_markup(f.title.empty() ? "Attention weights α" : f.title, Markup::html_text));
  out += kStyle;
  out += kBody;
  out += "<script type=\"application/json\" id=\"qkv-data\">";
  out += figure_json(f);
  out += "</script>\n";
  out += kScript;
  out += "</body>\n</html>\n";
  return out;
}

}  // namespace qkv::heatmap_detail
