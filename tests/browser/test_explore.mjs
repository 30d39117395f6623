// The attention explorer (qkv explore -o page.html) in a real browser: Debian's Chromium, headless,
// driven by playwright-core, with no network.
//
// Checks: each page loads from file:// with no console error and no request beyond the file; a click
// on the model view opens that head (the selects, the state and the matrix's pixels change); zooming
// changes the matrix's scale and thins or thickens its labels; hovering a cell reads its value; the
// head view's overlay of all heads draws more lines and a hovered query fewer; query and key
// selections (typed spans and clicks on tokens) give the sum and the mean of rows and columns that a
// float64 sum of the page's weights gives; the page's weights are the file's within their 8-bit
// step; the page's rollout equals a float64 rollout computed here, from the page's weights (to
// rounding) and from the file's (within the bound the 8-bit step allows); cross-attention (Tq ≠ Tk)
// works and offers no rollout; a 4096-token page and a 12-layer, 12-head, 512-token page open
// within the bounds stated below.
//
// Run: QKV_BIN=build/release/apps/qkv node tests/browser/test_explore.mjs (after `npm ci --prefix
// tests/browser`). QKV_SCREENSHOT_DIR keeps the screenshots; QKV_TEST_TIME_SCALE (default 1)
// multiplies the time bounds on slow or instrumented builds.

import { execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { pathToFileURL } from "node:url";

import { chromium } from "playwright-core";

const qkv = process.env.QKV_BIN;
if (!qkv) {
  console.error("QKV_BIN must name the qkv binary");
  process.exit(2);
}
const chromiumPath = process.env.QKV_CHROMIUM || "/usr/bin/chromium";
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "qkv-explore-"));
const screenshotDir = process.env.QKV_SCREENSHOT_DIR || tmp;
const timeScale = Number(process.env.QKV_TEST_TIME_SCALE || "1");
// Opening time on the page's clock, from the navigation to the page drawn and answering for its
// first layer (the browser parses and inflates every later layer after, in the background), with
// room for a 2-core CI machine running other tests beside this one: a 4096 × 4096 page of two heads
// (33.5 M weights), and L = 12, H = 12, T = 512 (37.7 M), which opens in well under 2 s on an idle
// machine (docs/heatmaps.md has the figures).
const kLongOpenMs = 15000 * timeScale;
const kModelOpenMs = 6000 * timeScale;

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

function writeNpy(file, shape, values) {
  let header = `{'descr': '<f4', 'fortran_order': False, 'shape': (${shape.join(", ")}), }`;
  header += " ".repeat((64 - ((10 + header.length + 1) % 64)) % 64) + "\n";
  const prefix = Buffer.alloc(10);
  prefix.write("\x93NUMPY", 0, "latin1");
  prefix[6] = 1;
  prefix.writeUInt16LE(header.length, 8);
  const body = Buffer.from(values.buffer, values.byteOffset, values.byteLength);
  fs.writeFileSync(file, Buffer.concat([prefix, Buffer.from(header, "latin1"), body]));
}

// [L, H, Tq, Tk] rows of a softmax over made-up scores (a deterministic generator), as float32:
// scores uniform over [-sharpness, 0], or normal with standard deviation `sharpness` when `normal`.
function attention(L, H, tq, tk, seed, sharpness, normal = false) {
  const out = new Float32Array(L * H * tq * tk);
  let state = seed >>> 0;
  const uniform = () => {
    state = (Math.imul(state, 1664525) + 1013904223) >>> 0;
    return state / 4294967296;
  };
  const exps = new Float64Array(tk);
  for (let r = 0; r < L * H * tq; r++) {
    let sum = 0;
    for (let j = 0; j < tk; j++) {
      const score = normal ? Math.sqrt(-2 * Math.log(1 - uniform())) * Math.cos(2 * Math.PI * uniform()) : uniform() - 1;
      exps[j] = Math.exp(sharpness * score);
      sum += exps[j];
    }
    for (let j = 0; j < tk; j++) out[r * tk + j] = exps[j] / sum;
  }
  return out;
}

function qkvRun(args) {
  return execFileSync(qkv, args, { cwd: tmp, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
}

// Rollout in float64: Â_l = rownorm(0.5 · mean_h A_l + 0.5 · I), R_0 = Â_0, R_l = Â_l · R_{l-1}.
function referenceRollout(weightsOf, L, H, T) {
  const result = [];
  let below = null;
  for (let l = 0; l < L; l++) {
    const a = new Float64Array(T * T);
    for (let h = 0; h < H; h++) {
      const w = weightsOf(l, h);
      for (let k = 0; k < T * T; k++) a[k] += w[k] / H;
    }
    for (let i = 0; i < T; i++) {
      let sum = 0;
      for (let j = 0; j < T; j++) {
        a[i * T + j] = 0.5 * a[i * T + j] + (i === j ? 0.5 : 0);
        sum += a[i * T + j];
      }
      for (let j = 0; j < T; j++) a[i * T + j] /= sum;
    }
    let r = a;
    if (below) {
      r = new Float64Array(T * T);
      for (let i = 0; i < T; i++) {
        for (let j = 0; j < T; j++) {
          let s = 0;
          for (let m = 0; m < T; m++) s += a[i * T + m] * below[m * T + j];
          r[i * T + j] = s;
        }
      }
    }
    result.push(r);
    below = r;
  }
  return result;
}

const maxDiff = (a, b) => a.reduce((m, v, k) => Math.max(m, Math.abs(v - b[k])), 0);

// ---- the browser ---------------------------------------------------------------------------------

const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), "qkv-chromium-profile-"));
const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath: chromiumPath,
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
  viewport: { width: 1400, height: 900 },
});

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
  await page.waitForSelector("body[data-loaded=true]", { timeout: 120000 });
  // The page's own clock, from the start of the navigation: the harness's polling is not the reader's wait.
  const openMs = Number(await page.getAttribute("body", "data-ready-ms"));
  const loadedMs = Number(await page.getAttribute("body", "data-loaded-ms"));
  return { page, problems, openMs, loadedMs };
}

const shot = (page, selector) => page.locator(selector).screenshot();

try {
  // ---- self-attention: 3 layers, 4 heads, 6 tokens ------------------------------------------
  const L = 3;
  const H = 4;
  const T = 6;
  const weights = attention(L, H, T, T, 7, 4);
  writeNpy(path.join(tmp, "model.npy"), [L, H, T, T], weights);
  const tokens = ["the", "cat", "</script>", "sat", "猫", "mat"];
  qkvRun(["explore", "model.npy", "--tokens", tokens.join(" "), "--layer-names", "emb mid top", "-o", "model.html"]);
  const { page, problems } = await open(path.join(tmp, "model.html"));
  await page.screenshot({ path: path.join(screenshotDir, "explore_model.png"), fullPage: true });

  check((await page.textContent("#title")) === "Attention explorer", "the title is shown");
  check((await page.$$eval("#layer option", (o) => o.map((x) => x.textContent))).join(",") === "emb,mid,top",
    "the layer picker lists --layer-names");
  check((await page.$$eval("#head option", (o) => o.length)) === H + 1, "the head picker lists every head and the mean");

  // The page's weights are the file's, within half a step of 8 bits of each row's largest weight.
  let worstStep = 0;
  for (let l = 0; l < L; l++) {
    for (let h = 0; h < H; h++) {
      const got = await page.evaluate(([a, b]) => window.qkvExplorer.weights(a, b), [l, h]);
      for (let i = 0; i < T; i++) {
        const base = ((l * H + h) * T + i) * T;
        const largest = Math.max(...weights.subarray(base, base + T));
        for (let j = 0; j < T; j++) {
          worstStep = Math.max(worstStep, Math.abs(got[i * T + j] - weights[base + j]) / (largest / 255));
        }
      }
    }
  }
  check(worstStep <= 0.5 + 1e-4, `weights within half an 8-bit step of their row's largest (worst ${worstStep} steps)`);

  // The model view: a click on layer 2, head 3 opens it.
  const matrixBefore = await shot(page, "#matrix");
  const geometry = await page.evaluate(() => {
    const box = document.getElementById("model").getBoundingClientRect();
    return { left: box.left, top: box.top };
  });
  const thumbAt = await page.evaluate(() => Math.max(24, Math.min(96, Math.floor(900 / 4) - 6)));
  await page.mouse.click(geometry.left + 90 + 3 * (thumbAt + 6) + 10, geometry.top + 18 + 2 * (thumbAt + 6) + 10);
  const state = await page.evaluate(() => window.qkvExplorer.state());
  check(state.layer === 2 && state.head === 3, `a click on the model view opens layer 2, head 3 (got ${state.layer}, ${state.head})`);
  check((await page.inputValue("#layer")) === "2" && (await page.inputValue("#head")) === "3", "the pickers follow the click");
  check((await page.getAttribute("#model", "data-selected")) === "2,3", "the model view outlines the head opened");
  check(!(await shot(page, "#matrix")).equals(matrixBefore), "the matrix view redraws for the head opened");

  // Hovering a cell reads its value.
  const m = await page.evaluate(() => document.getElementById("matrix").dataset);
  const box = await page.locator("#matrix").boundingBox();
  await page.mouse.move(box.x + Number(m.x0) + 4.5 * Number(m.scale), box.y + Number(m.y0) + 1.5 * Number(m.scale));
  const readout = await page.textContent("#readout");
  const w213 = (await page.evaluate(() => window.qkvExplorer.weights(2, 3)))[1 * T + 4];
  check(readout.includes("query 1 \u201ccat\u201d \u2192 key 4 \u201c猫\u201d") &&
    readout.includes("= " + Number(w213.toPrecision(4))), `hovering cell (1, 4) reads its value (${readout})`);

  // Zoom: the scale doubles (to at most 64 px a cell) and the view moves.
  await page.click("#zoom-in");
  const zoomed = await page.evaluate(() => window.qkvExplorer.state().zoom);
  check(Math.abs(zoomed.scale - Math.min(64, 2 * Number(m.scale))) < 1e-9, `zoom in doubles the scale (${m.scale} → ${zoomed.scale})`);
  await page.click("#zoom-reset");

  // The head view: all heads overlaid draw more lines than one; a hovered query draws only its own.
  const oneHead = Number(await page.getAttribute("#heads", "data-lines"));
  await page.check("#all-heads");
  const allHeads = Number(await page.getAttribute("#heads", "data-lines"));
  check(allHeads > oneHead && (await page.getAttribute("#heads", "data-overlay")) === "true",
    `all heads overlaid draw more lines (${oneHead} → ${allHeads})`);
  const heads = await page.locator("#heads").boundingBox();
  await page.mouse.move(heads.x + 150, heads.y + 24 + 2.5 * 16);
  const hovered = Number(await page.getAttribute("#heads", "data-lines"));
  check(hovered > 0 && hovered < allHeads, `hovering a query draws only its lines (${hovered} of ${allHeads})`);
  await page.screenshot({ path: path.join(screenshotDir, "explore_heads.png"), fullPage: true });
  await page.uncheck("#all-heads");

  // Selections: rows 1 and 3-4 of layer 2, head 3, summed then averaged; columns 0 and 5.
  const w = await page.evaluate(() => window.qkvExplorer.weights(2, 3));
  await page.fill("#queries", "1 3-4");
  const rowsSum = await page.evaluate(() => window.qkvExplorer.rowResult());
  const expectedRows = [...Array(T).keys()].map((j) => w[1 * T + j] + w[3 * T + j] + w[4 * T + j]);
  check(rowsSum && maxDiff(rowsSum, expectedRows) < 1e-12, "the sum of the selected rows is their float64 sum");
  check((await page.textContent("#query-readout")).startsWith("The sum of queries 1, 3, 4"), "the readout names the selection");
  await page.selectOption("#combine", "mean");
  const rowsMean = await page.evaluate(() => window.qkvExplorer.rowResult());
  check(maxDiff(rowsMean, expectedRows.map((v) => v / 3)) < 1e-12, "the mean of the selected rows is their float64 mean");
  await page.fill("#keys", "0 5");
  const colsMean = await page.evaluate(() => window.qkvExplorer.colResult());
  const expectedCols = [...Array(T).keys()].map((i) => (w[i * T] + w[i * T + 5]) / 2);
  check(maxDiff(colsMean, expectedCols) < 1e-12, "who attends to the selected keys: their columns' float64 mean");
  check((await page.locator("#key-bars").boundingBox()).height > 0, "the key selection draws its bars");
  await page.fill("#queries", "9");
  check((await page.getAttribute("#queries", "aria-invalid")) === "true", "an index beyond Tq is marked invalid");
  // A click on a key token in the head view adds it to the selection.
  await page.mouse.click(heads.x + 470, heads.y + 24 + 2.5 * 16);
  check((await page.inputValue("#keys")) === "0 2 5", `a click on key 2 adds it (${await page.inputValue("#keys")})`);
  await page.screenshot({ path: path.join(screenshotDir, "explore_selection.png"), fullPage: true });

  // Mean over heads, then rollout.
  await page.selectOption("#head", "mean");
  check((await page.getAttribute("body", "data-view")) === "attention:2:mean", "the head picker shows the mean of heads");
  const beforeRollout = await shot(page, "#matrix");
  await page.selectOption("#kind", "rollout");
  check((await page.getAttribute("body", "data-view")).startsWith("rollout:2"), "the picker shows the rollout");
  check(!(await shot(page, "#matrix")).equals(beforeRollout), "the rollout is drawn");
  const pageWeights = [];
  for (let l = 0; l < L; l++) {
    pageWeights.push([]);
    for (let h = 0; h < H; h++) pageWeights[l].push(await page.evaluate(([a, b]) => window.qkvExplorer.weights(a, b), [l, h]));
  }
  const fromPage = referenceRollout((l, h) => pageWeights[l][h], L, H, T);
  const fromFile = referenceRollout((l, h) => weights.subarray((l * H + h) * T * T, (l * H + h + 1) * T * T), L, H, T);
  // Each weight is off by at most half a step, 1/510, so a row of Â by at most T/510 in sum before
  // renormalising and twice that after; rows of R add one such error a layer (stochastic matrices
  // do not grow errors in the row-sum norm).
  const bound = (l) => (l + 1) * 2 * T / 510;
  for (let l = 0; l < L; l++) {
    const got = await page.evaluate((a) => window.qkvExplorer.rollout(a), l);
    check(maxDiff(got, fromPage[l]) < 1e-12, `rollout to layer ${l} equals a float64 rollout of the page's weights (${maxDiff(got, fromPage[l])})`);
    check(maxDiff(got, fromFile[l]) < bound(l), `rollout to layer ${l} is within ${bound(l)} of the file's (${maxDiff(got, fromFile[l])})`);
    const row = await page.evaluate((a) => window.qkvExplorer.rolloutRow(3, a), l);
    check(maxDiff(row, got.slice(3 * T, 4 * T)) < 1e-12, `a rollout row alone equals the whole rollout's (layer ${l})`);
  }
  await page.screenshot({ path: path.join(screenshotDir, "explore_rollout.png"), fullPage: true });
  // A click on a summary cell opens that head.
  await page.click("#entropy td[data-layer='1'][data-head='2']");
  check((await page.getAttribute("body", "data-view")) === "attention:1:2", "a click on the entropy table opens that head");
  check(problems.length === 0, "the model page: " + (problems.join("; ") || "no problems"));
  await page.close();

  // ---- cross-attention: Tq = 4, Tk = 7 --------------------------------------------------------
  writeNpy(path.join(tmp, "cross.npy"), [2, 2, 4, 7], attention(2, 2, 4, 7, 3, 3));
  qkvRun(["explore", "cross.npy", "--tokens", "le chat est là", "--key-tokens", "the cat is there . <s> x", "-o", "cross.html"]);
  const cross = await open(path.join(tmp, "cross.html"));
  check(await cross.page.$eval("#kind option[value=rollout]", (o) => o.disabled), "cross-attention offers no rollout");
  await cross.page.fill("#keys", "1-2");
  const crossCols = await cross.page.evaluate(() => window.qkvExplorer.colResult());
  check(crossCols && crossCols.length === 4, "a key selection of cross-attention has one value a query");
  await cross.page.fill("#queries", "3");
  check((await cross.page.evaluate(() => window.qkvExplorer.rowResult())).length === 7, "a query selection has one value a key");
  await cross.page.screenshot({ path: path.join(screenshotDir, "explore_cross.png"), fullPage: true });
  check(cross.problems.length === 0, "the cross-attention page: " + (cross.problems.join("; ") || "no problems"));
  await cross.page.close();

  // ---- 4096 tokens ---------------------------------------------------------------------------
  const long = 4096;
  writeNpy(path.join(tmp, "long.npy"), [1, 2, long, long], attention(1, 2, long, long, 11, 12));
  qkvRun(["explore", "long.npy", "-o", "long.html"]);
  const longPage = await open(path.join(tmp, "long.html"));
  console.log(`4096 tokens: ${(fs.statSync(path.join(tmp, "long.html")).size / 1e6).toFixed(1)} MB, open in ` +
    `${longPage.openMs} ms, every layer inflated in ${longPage.loadedMs} ms`);
  check(longPage.openMs < kLongOpenMs, `a 4096-token page opens within ${kLongOpenMs} ms (${longPage.openMs} ms)`);
  const step = Number(await longPage.page.getAttribute("#matrix", "data-label-step"));
  for (let k = 0; k < 4; k++) await longPage.page.click("#zoom-in");
  const zoomedStep = Number(await longPage.page.getAttribute("#matrix", "data-label-step"));
  check(zoomedStep < step, `zooming in thins the labels less (every ${step}th → every ${zoomedStep}th)`);
  const row = await longPage.page.evaluate(() => window.qkvExplorer.rolloutRow(100, 0));
  check(Math.abs(row.reduce((a, b) => a + b, 0) - 1) < 1e-9, "a rollout row of 4096 tokens sums to 1");
  await longPage.page.fill("#queries", "100-110");
  check((await longPage.page.evaluate(() => window.qkvExplorer.rowResult())).length === long, "a selection over 4096 keys");
  check(longPage.problems.length === 0, "the 4096-token page: " + (longPage.problems.join("; ") || "no problems"));
  await longPage.page.close();

  // ---- L = 12, H = 12, T = 512 -----------------------------------------------------------------
  // Scores of a trained model's spread (a standard deviation of 3 within a row): the page's size
  // depends on how well the 8-bit codes deflate, and weights spread evenly over many decades (no
  // model's) would take about 32 MB.
  writeNpy(path.join(tmp, "bert.npy"), [12, 12, 512, 512], attention(12, 12, 512, 512, 5, 3, true));
  qkvRun(["explore", "bert.npy", "-o", "bert.html"]);
  const bertSize = fs.statSync(path.join(tmp, "bert.html")).size;
  const bert = await open(path.join(tmp, "bert.html"));
  console.log(`L = 12, H = 12, T = 512: ${(bertSize / 1e6).toFixed(1)} MB, open in ${bert.openMs} ms, every ` +
    `layer inflated in ${bert.loadedMs} ms`);
  check(bertSize < 20e6, `L = 12, H = 12, T = 512 is under 20 MB (${bertSize} bytes)`);
  check(bert.openMs < kModelOpenMs, `L = 12, H = 12, T = 512 opens within ${kModelOpenMs} ms (${bert.openMs} ms)`);
  // The head view holds every token: 512 in its 48 lines, labels thinned, until the wheel zooms in.
  const headsData = () => bert.page.evaluate(() => ({ ...document.getElementById("heads").dataset }));
  const whole = await headsData();
  check(whole.queryStart === "0" && whole.queryEnd === "511" && whole.keyEnd === "511" && Number(whole.lines) > 0,
    `the head view shows all 512 tokens and their lines (${JSON.stringify(whole)})`);
  await bert.page.locator("#heads").scrollIntoViewIfNeeded();
  const headsBox = await bert.page.locator("#heads").boundingBox();
  const wholeShot = await shot(bert.page, "#heads");
  await bert.page.mouse.move(headsBox.x + 320, headsBox.y + 24 + 400);
  for (let k = 0; k < 8; k++) await bert.page.mouse.wheel(0, -100);
  await bert.page.waitForFunction(() => Number(document.getElementById("heads").dataset.zoom) > 4);
  const zoomedIn = await headsData();
  check(Number(zoomedIn.queryStart) > 0 && Number(zoomedIn.queryEnd) < 511 &&
    Number(zoomedIn.labelStep.split(",")[0]) < Number(whole.labelStep.split(",")[0]),
    `the wheel zooms the head view about the pointer, labels less thinned (${JSON.stringify(zoomedIn)})`);
  check(!(await shot(bert.page, "#heads")).equals(wholeShot), "the zoomed head view redraws");
  await bert.page.mouse.move(headsBox.x + 150, headsBox.y + 24 + 400);
  const hoveredLong = await headsData();
  check(Number(hoveredLong.lines) > 0 && Number(hoveredLong.lines) < Number(zoomedIn.lines),
    `hovering a query of 512 draws only its lines (${hoveredLong.lines} of ${zoomedIn.lines})`);
  await bert.page.mouse.dblclick(headsBox.x + 320, headsBox.y + 24 + 400);
  check((await headsData()).zoom === "1", "a double-click shows every token again");
  check(bert.problems.length === 0, "the 12 × 12 × 512 page: " + (bert.problems.join("; ") || "no problems"));
  await bert.page.close();
} finally {
  await context.close();
  fs.rmSync(userDataDir, { recursive: true, force: true });
}

console.log(`${passed} checks passed, ${failures.length} failed`);
if (failures.length > 0) process.exit(1);
