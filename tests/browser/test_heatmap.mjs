// The interactive heatmap page (qkv heatmap -o page.html, qkv demo) in a real browser: Debian's
// Chromium, headless, driven by playwright-core, with no network.
//
// Checks: the page loads from file:// with no console error and no request beyond the file; the
// labels (CJK and markup-like ones) are shown as text; hovering a query token colours every key by
// α_ij, exactly as the data and the colour map say, and hovering a key does the same for the
// queries; the head selector switches heads; hovering a matrix cell shows its exact value and the
// cell is drawn in its colour; a screenshot is non-blank. Also the demo's page, a causal page
// (masked cells grey, their hover "masked", the sqrt scale, the clipping triangle) and a 256 × 256
// page.
//
// Run: QKV_BIN=build/release/apps/qkv node tests/browser/test_heatmap.mjs (after `npm ci --prefix
// tests/browser`, which scripts/install-deps.sh does). QKV_SCREENSHOT_DIR keeps the screenshots.

import { execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { pathToFileURL } from "node:url";
import zlib from "node:zlib";

import { chromium } from "playwright-core";

const qkv = process.env.QKV_BIN;
if (!qkv) {
  console.error("QKV_BIN must name the qkv binary");
  process.exit(2);
}
const chromiumPath = process.env.QKV_CHROMIUM || "/usr/bin/chromium";
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "qkv-browser-"));
const screenshotDir = process.env.QKV_SCREENSHOT_DIR || tmp;

let passed = 0;
const failures = [];
function check(condition, what) {
  if (condition) {
    passed++;
  } else {
    failures.push(what);
    console.error("FAIL: " + what);
  }
}

// ---- inputs -------------------------------------------------------------------------------------

// A float32 .npy file of `shape` holding `values` (C order).
function writeNpy(file, shape, values) {
  const dims = shape.length === 1 ? `${shape[0]},` : shape.join(", ");
  let header = `{'descr': '<f4', 'fortran_order': False, 'shape': (${dims}), }`;
  const unpadded = 10 + header.length + 1;
  header += " ".repeat((64 - (unpadded % 64)) % 64) + "\n";
  const prefix = Buffer.alloc(10);
  prefix.write("\x93NUMPY", 0, "latin1");
  prefix[6] = 1;
  prefix[7] = 0;
  prefix.writeUInt16LE(header.length, 8);
  const body = Buffer.from(new Float32Array(values).buffer);
  fs.writeFileSync(file, Buffer.concat([prefix, Buffer.from(header, "latin1"), body]));
}

// Rows of a softmax over made-up scores: every weight positive, every row summing to 1 in float32.
function softmaxRows(heads, tq, tk, seed) {
  const values = [];
  for (let h = 0; h < heads; h++) {
    for (let i = 0; i < tq; i++) {
      const scores = [];
      for (let j = 0; j < tk; j++) scores.push(Math.sin(seed + 1.7 * h + 0.9 * i * (j + 1) + 0.3 * j) * 2.5);
      const max = Math.max(...scores);
      const exps = scores.map((s) => Math.exp(s - max));
      const sum = exps.reduce((a, b) => a + b, 0);
      for (const e of exps) values.push(Math.fround(e / sum));
    }
  }
  return values;
}

function qkvRun(args) {
  return execFileSync(qkv, args, { cwd: tmp, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
}

// ---- a minimal PNG decoder for the screenshots (8-bit RGB or RGBA, not interlaced) ---------------

function decodePng(buffer) {
  let offset = 8;
  let width = 0;
  let height = 0;
  let channels = 0;
  const idat = [];
  while (offset < buffer.length) {
    const length = buffer.readUInt32BE(offset);
    const type = buffer.toString("latin1", offset + 4, offset + 8);
    const chunk = buffer.subarray(offset + 8, offset + 8 + length);
    if (type === "IHDR") {
      width = chunk.readUInt32BE(0);
      height = chunk.readUInt32BE(4);
      if (chunk[8] !== 8 || chunk[12] !== 0) throw new Error("unsupported PNG");
      channels = { 2: 3, 6: 4 }[chunk[9]];
      if (!channels) throw new Error("unsupported PNG colour type " + chunk[9]);
    } else if (type === "IDAT") {
      idat.push(chunk);
    }
    offset += 12 + length;
  }
  const raw = zlib.inflateSync(Buffer.concat(idat));
  const stride = width * channels;
  const pixels = Buffer.alloc(height * stride);
  for (let y = 0; y < height; y++) {
    const filter = raw[y * (stride + 1)];
    const line = raw.subarray(y * (stride + 1) + 1, (y + 1) * (stride + 1));
    for (let x = 0; x < stride; x++) {
      const a = x >= channels ? pixels[y * stride + x - channels] : 0;
      const b = y > 0 ? pixels[(y - 1) * stride + x] : 0;
      const c = x >= channels && y > 0 ? pixels[(y - 1) * stride + x - channels] : 0;
      let predictor = 0;
      if (filter === 1) predictor = a;
      else if (filter === 2) predictor = b;
      else if (filter === 3) predictor = (a + b) >> 1;
      else if (filter === 4) {
        const p = a + b - c;
        const pa = Math.abs(p - a);
        const pb = Math.abs(p - b);
        const pc = Math.abs(p - c);
        predictor = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
      }
      pixels[y * stride + x] = (line[x] + predictor) & 255;
    }
  }
  return { width, height, channels, pixels };
}

function screenshotStats(file) {
  const { width, height, channels, pixels } = decodePng(fs.readFileSync(file));
  const colours = new Set();
  let inked = 0;
  for (let p = 0; p < width * height; p++) {
    const r = pixels[p * channels];
    const g = pixels[p * channels + 1];
    const b = pixels[p * channels + 2];
    colours.add((r << 16) | (g << 8) | b);
    if (r < 235 || g < 235 || b < 235) inked++;
  }
  return { width, height, colours: colours.size, inkedFraction: inked / (width * height) };
}

// ---- the browser ---------------------------------------------------------------------------------

const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), "qkv-chromium-profile-"));
const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath: chromiumPath,
  headless: true,
  // The network is closed: without these Chromium keeps trying to reach its services.
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
  viewport: { width: 1400, height: 900 },
});

// Opens a page and records what must not happen: console errors, page errors, requests that leave
// the file.
async function open(file) {
  const page = await context.newPage();
  const problems = [];
  page.on("console", (message) => {
    if (message.type() === "error") problems.push("console error: " + message.text());
  });
  page.on("pageerror", (error) => problems.push("page error: " + error.message));
  page.on("request", (request) => {
    const url = request.url();
    if (!url.startsWith("file:") && !url.startsWith("data:") && !url.startsWith("blob:")) {
      problems.push("network request: " + url);
    }
  });
  await page.goto(pathToFileURL(file).href);
  await page.waitForSelector("body[data-ready=true]", { timeout: 15000 });
  return { page, problems };
}

const rgb = (hex) => {
  const n = parseInt(hex.slice(1), 16);
  return `rgb(${n >> 16}, ${(n >> 8) & 255}, ${n & 255})`;
};

// The colour the page's data says a value has: its position on the scale, looked up in the table.
function expectedColour(data, value) {
  const t = Math.min(1, Math.max(0, (value - data.vmin) / (data.vmax - data.vmin)));
  return rgb(data.lut[Math.round(t * (data.lut.length - 1))]);
}

async function tokenState(page, selector) {
  return page.$$eval(selector, (els) => els.map((el) => ({
    alpha: el.dataset.alpha,
    background: getComputedStyle(el).backgroundColor,
    source: el.classList.contains("source"),
  })));
}

try {
  // ---- a two-head α with CJK and markup-like labels -------------------------------------------
  const H = 2;
  const TQ = 4;
  const TK = 5;
  const alpha = softmaxRows(H, TQ, TK, 0.4);
  const at = (h, i, j) => alpha[(h * TQ + i) * TK + j];
  writeNpy(path.join(tmp, "alpha.npy"), [H, TQ, TK], alpha);
  const rows = ["我", "阅读", "<b>bold</b>", "书"];
  const cols = ["I", "read", "a", "book", "</script>"];
  qkvRun(["heatmap", "alpha.npy", "-o", "page.html", "--rows", rows.join(" "), "--cols", cols.join(" "),
    "--title", "Two heads & <i>tags</i>"]);
  const { page, problems } = await open(path.join(tmp, "page.html"));

  check(await page.title() === "Two heads & <i>tags</i>", "the title is the given text, not markup");
  const shownRows = await page.$$eval("#queries .tok .t", (els) => els.map((el) => el.textContent));
  const shownCols = await page.$$eval("#keys .tok .t", (els) => els.map((el) => el.textContent));
  check(JSON.stringify(shownRows) === JSON.stringify(rows), "query tokens shown as given: " + shownRows);
  check(JSON.stringify(shownCols) === JSON.stringify(cols), "key tokens shown as given: " + shownCols);
  check(await page.$$eval("b, i", (els) => els.length) === 0, "labels and title injected no markup");

  const data = await page.evaluate(() => JSON.parse(document.getElementById("qkv-data").textContent));
  check(data.lut.length === 256 && data.lut[0] === "#440154" && data.lut[255] === "#fde725",
    "the page's colour table is viridis: " + data.lut[0] + " … " + data.lut[255]);
  const options = await page.$$eval("#head option", (els) => els.map((el) => el.textContent));
  check(JSON.stringify(options) === JSON.stringify(["head 0", "head 1"]),
    "a head selector with both heads: " + options);
  check(await page.isVisible("#head"), "the head selector is visible");

  // Hovering a query colours every key by α_ij of the shown head.
  async function checkQueries(head) {
    for (let i = 0; i < TQ; i++) {
      await page.hover(`#queries .tok[data-i="${i}"]`);
      const keys = await tokenState(page, "#keys .tok");
      const queries = await tokenState(page, "#queries .tok");
      check(queries[i].source, `head ${head}, query ${i}: the hovered token is marked`);
      for (let j = 0; j < TK; j++) {
        const want = at(head, i, j);
        check(Math.fround(Number(keys[j].alpha)) === want,
          `head ${head}, query ${i} → key ${j}: data-alpha ${keys[j].alpha}, expected ${want}`);
        check(keys[j].background === expectedColour(data, want), `head ${head}, query ${i} → key ${j}: ` +
          `background ${keys[j].background}, expected ${expectedColour(data, want)}`);
      }
      const lines = await page.$$eval("#links line",
        (els) => els.map((el) => Number(el.getAttribute("stroke-opacity"))));
      check(lines.length === TK, `head ${head}, query ${i}: a line to each key (${lines.length})`);
      // The strongest key gets the most opaque line and the lightest viridis colour.
      const strongest = [...Array(TK).keys()].reduce((a, b) => (at(head, i, b) > at(head, i, a) ? b : a));
      check(lines.indexOf(Math.max(...lines)) === strongest,
        `head ${head}, query ${i}: the strongest line goes to key ${strongest}`);
      const readout = await page.textContent("#readout");
      check(readout.includes(rows[i]) && readout.includes(cols[strongest]),
        `head ${head}, query ${i}: readout "${readout}"`);
    }
  }
  await checkQueries(0);

  // Hovering a key colours the queries that look at it.
  for (let j = 0; j < TK; j++) {
    await page.hover(`#keys .tok[data-j="${j}"]`);
    const queries = await tokenState(page, "#queries .tok");
    for (let i = 0; i < TQ; i++) {
      check(Math.fround(Number(queries[i].alpha)) === at(0, i, j),
        `key ${j} ← query ${i}: data-alpha ${queries[i].alpha}`);
      check(queries[i].background === expectedColour(data, at(0, i, j)), `key ${j} ← query ${i}: background`);
    }
  }

  // Leaving the tokens clears the highlight.
  await page.mouse.move(1, 1);
  check(await page.$$eval(".tok[data-alpha]", (els) => els.length) === 0, "leaving the tokens clears the highlight");

  // The head selector switches heads.
  const before = await page.evaluate(() => document.getElementById("matrix").toDataURL());
  await page.selectOption("#head", "1");
  const after = await page.evaluate(() => document.getElementById("matrix").toDataURL());
  check(before !== after, "switching heads redraws the matrix");
  await checkQueries(1);

  // Hovering a matrix cell shows its exact value; the cell is drawn in its colour.
  const geometry = await page.$eval("#matrix", (el) => {
    const box = el.getBoundingClientRect();
    return { left: box.left, top: box.top, x0: Number(el.dataset.x0), y0: Number(el.dataset.y0),
      cell: Number(el.dataset.cellWidth) };
  });
  for (const [i, j] of [[0, 0], [2, 3], [3, 4], [3, 1]]) {  // the last moves along a row: only the mark moves
    const x = geometry.x0 + (j + 0.5) * geometry.cell;
    const y = geometry.y0 + (i + 0.5) * geometry.cell;
    await page.mouse.move(geometry.left + x, geometry.top + y);
    const tooltip = await page.textContent("#tooltip");
    const value = at(1, i, j);
    // The float32 value's shortest decimal: it reads back as exactly the value in the file.
    const shown = /α = (\S+)/.exec(tooltip);
    check(await page.isVisible("#tooltip") && shown !== null && Math.fround(Number(shown[1])) === value &&
      shown[1].length <= 12 && tooltip.includes(rows[i]) && tooltip.includes(cols[j]),
      `cell [${i}, ${j}]: tooltip "${tooltip}" shows ${value}`);
    const pixel = await page.evaluate(([px, py]) => {
      const canvas = document.getElementById("matrix");
      const ratio = canvas.width / canvas.getBoundingClientRect().width;
      const d = canvas.getContext("2d").getImageData(Math.floor(px * ratio), Math.floor(py * ratio), 1, 1).data;
      return `rgb(${d[0]}, ${d[1]}, ${d[2]})`;
    }, [x, y]);
    check(pixel === expectedColour(data, value),
      `cell [${i}, ${j}]: drawn ${pixel}, expected ${expectedColour(data, value)}`);
    const marked = await page.$$eval("#keys .tok.marked", (els) => els.map((el) => el.dataset.j));
    check(marked.length === 1 && marked[0] === String(j), `cell [${i}, ${j}]: the token view marks key ${j}`);
    const keys = await tokenState(page, "#keys .tok");
    check(keys.every((k, jj) => Math.fround(Number(k.alpha)) === at(1, i, jj)),
      `cell [${i}, ${j}]: the token view shows row ${i} of head 1`);
  }

  await page.hover(`#queries .tok[data-i="1"]`);
  const shot = path.join(screenshotDir, "heatmap-page.png");
  await page.screenshot({ path: shot, fullPage: true });
  const stats = screenshotStats(shot);
  check(stats.colours > 50 && stats.inkedFraction > 0.05,
    `screenshot is not blank: ${stats.width}×${stats.height}, ${stats.colours} colours, ` +
    `${(100 * stats.inkedFraction).toFixed(1)}% inked`);
  check(problems.length === 0, "no console errors or network requests: " + problems.join("; "));
  await page.close();

  // ---- the demo's page ---------------------------------------------------------------------------
  qkvRun(["demo", "--out-dir", tmp]);
  {
    const { page: demo, problems: demoProblems } = await open(path.join(tmp, "attention.html"));
    const tokens = await demo.$$eval("#queries .tok .t", (els) => els.map((el) => el.textContent));
    check(tokens.join(" ") === "the student is reading a book", "the demo's page shows its tokens: " + tokens);
    check(!(await demo.isVisible("#head")), "the demo's page (one head) has no head selector");
    await demo.hover('#queries .tok[data-i="1"]');
    check(await demo.$$eval("#keys .tok[data-alpha]", (els) => els.length) === 6,
      "the demo's page highlights 6 keys");
    await demo.screenshot({ path: path.join(screenshotDir, "demo-page.png"), fullPage: true });
    check(demoProblems.length === 0, "demo page: no console errors: " + demoProblems.join("; "));
    await demo.close();
  }

  // ---- a causal page: masked cells, the sqrt scale, a clipped top ------------------------------
  {
    const T = 4;
    const causal = [];
    for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) causal.push(j <= i ? 1 / (i + 1) : 0);
    writeNpy(path.join(tmp, "causal.npy"), [T, T], causal);
    qkvRun(["heatmap", "causal.npy", "--causal", "--scale", "sqrt", "--vmax", "0.5", "-o", "causal.html"]);
    const { page: masked, problems: maskedProblems } = await open(path.join(tmp, "causal.html"));
    const geometry = await masked.$eval("#matrix", (el) => {
      const box = el.getBoundingClientRect();
      return { left: box.left, top: box.top, x0: Number(el.dataset.x0), y0: Number(el.dataset.y0),
        cell: Number(el.dataset.cellWidth) };
    });
    const cellAt = async (i, j) => {
      const x = geometry.x0 + (j + 0.5) * geometry.cell;
      const y = geometry.y0 + (i + 0.5) * geometry.cell;
      await masked.mouse.move(geometry.left + x, geometry.top + y);
      const pixel = await masked.evaluate(([px, py]) => {
        const canvas = document.getElementById("matrix");
        const ratio = canvas.width / canvas.getBoundingClientRect().width;
        const d = canvas.getContext("2d").getImageData(Math.floor(px * ratio), Math.floor(py * ratio), 1, 1).data;
        return `rgb(${d[0]}, ${d[1]}, ${d[2]})`;
      }, [x, y]);
      return { tooltip: await masked.textContent("#tooltip"), pixel };
    };
    const hidden = await cellAt(0, 3);
    check(hidden.tooltip.includes("masked") && !hidden.tooltip.includes("α ="),
      `a masked cell's hover says masked: "${hidden.tooltip}"`);
    check(hidden.pixel === "rgb(224, 224, 224)", `a masked cell is grey, drawn ${hidden.pixel}`);
    // 0.25 of a --vmax of 0.5 sits at √0.5 of the colour map under --scale sqrt.
    const data = await masked.evaluate(() => JSON.parse(document.getElementById("qkv-data").textContent));
    const quarter = await cellAt(3, 0);
    const want = rgb(data.lut[Math.round(Math.sqrt(0.5) * (data.lut.length - 1))]);
    check(quarter.pixel === want, `cell [3, 0] under --scale sqrt: drawn ${quarter.pixel}, expected ${want}`);
    check(quarter.tooltip.includes("α = 0.25"), `an unmasked cell's hover gives its value: "${quarter.tooltip}"`);
    await masked.mouse.move(0, 0);
    await masked.hover('#queries .tok[data-i="0"]');
    const keys = await masked.$$eval("#keys .tok", (els) => els.map((el) => ({
      masked: el.dataset.masked === "true", weight: el.querySelector(".w").textContent })));
    check(keys.map((k) => k.masked).join() === "false,true,true,true" &&
      keys.slice(1).every((k) => k.weight === "masked"),
      "query 0's masked keys say masked in the token view: " + JSON.stringify(keys));
    check(await masked.$("#clip-high") !== null && await masked.$("#clip-low") === null,
      "the colour bar shows the clipped top (weights of 1 above --vmax 0.5), and only it");
    check(maskedProblems.length === 0, "causal page: no console errors: " + maskedProblems.join("; "));
    await masked.close();
  }

  // ---- a large page ------------------------------------------------------------------------------
  {
    const T = 256;
    writeNpy(path.join(tmp, "big.npy"), [T, T], softmaxRows(1, T, T, 1.3));
    const started = Date.now();
    qkvRun(["heatmap", "big.npy", "-o", "big.html"]);
    const { page: big, problems: bigProblems } = await open(path.join(tmp, "big.html"));
    check(Date.now() - started < 20000, `a ${T} × ${T} page renders and loads in ${Date.now() - started} ms`);
    await big.hover(`#queries .tok[data-i="${T - 1}"]`);
    check(await big.$$eval("#keys .tok[data-alpha]", (els) => els.length) === T,
      `the ${T} × ${T} page highlights ${T} keys`);
    check(bigProblems.length === 0, "big page: no console errors: " + bigProblems.join("; "));
    await big.close();
  }
} catch (error) {
  failures.push("exception: " + (error && error.stack ? error.stack : error));
  console.error(error);
} finally {
  await context.close();
  fs.rmSync(userDataDir, { recursive: true, force: true });
  if (!process.env.QKV_SCREENSHOT_DIR) fs.rmSync(tmp, { recursive: true, force: true });
}

console.log(`browser: ${passed} passed, ${failures.length} failed`);
process.exit(failures.length === 0 ? 0 : 1);
