#!/usr/bin/env python3
"""`qkv heatmap`, `qkv demo`'s pictures and `qkv attend --heatmap` from the command line.

Happy paths: every format is written whole (PNG, PDF and HTML by their signature; SVG parsed by
libxml2's xmllint with one <rect> per cell in its cells group); the terminal grid under NO_COLOR is exact, stable text;
colour only when asked or on a terminal. Refusals: exit code 2, one error line naming the argument
at fault, and the directory exactly as it was (no output, no temporary file, an existing output left
untouched). Rows that do not sum to 1 are drawn with a warning. The pixels of the PNGs are checked
by tests/viz/test_heatmap.cpp, the page in a browser by tests/browser/test_heatmap.mjs. Masked cells
(--mask, --causal, attend --heatmap's mask) are drawn as masked in every format, --scale and the
clipping marker behave as documented, and the terminal grid fits COLUMNS in display columns.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_heatmap.py
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unicodedata

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import QKV, Suite  # noqa: E402  (the harness sits beside this script)

SIGNATURES = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-", ".html": b"<!DOCTYPE html>", ".svg": b"<?xml"}


def display_width(line):
    """The columns a line takes on a terminal: escapes none, East Asian wide characters two."""
    line = re.sub("\x1b\\[[0-9;]*m", "", line)
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def softmax_rows(shape, seed, spread=2.0):
    scores = np.random.default_rng(seed).standard_normal(shape) * spread
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


class HeatmapSuite(Suite):
    timeout = 60
    # The terminal grid is compared as plain text unless a test asks for colour.
    env = {"NO_COLOR": "1"}

    def written(self, name, extension=None):
        """None if `name` exists and starts with its format's signature, else what is wrong."""
        path = self.path(name)
        if not os.path.exists(path):
            return f"{name} was not written"
        with open(path, "rb") as f:
            head = f.read(16)
        signature = SIGNATURES[extension or os.path.splitext(name)[1].lower()]
        return None if head.startswith(signature) else f"{name} starts with {head!r}"

    def svg_rects(self, name):
        """(None, the number of cell <rect>s) if xmllint parses the file, else (the problem, 0). Cells are the
        <rect>s of the <g class="cells"> groups: marked cells add outline <rect>s of their own."""
        parse = subprocess.run(["xmllint", "--noout", self.path(name)], capture_output=True, text=True)
        if parse.returncode != 0:
            return f"xmllint refuses {name}: {parse.stderr.strip()}", 0
        cells = 'count(//*[local-name()="g"][@class="cells"]/*[local-name()="rect"])'
        count = subprocess.run(["xmllint", "--xpath", cells, self.path(name)], capture_output=True, text=True)
        return None, int(float(count.stdout.strip()))


# The grid of tests/viz/test_terminal_heatmap.cpp, drawn by the CLI with 2 decimals on its scale.
THREE = np.array([[0.7, 0.25, 0.05], [0.0, 1.0, 0.0], [0.15, 0.55, 0.3]], dtype=np.float32)
THREE_PLAIN = ("    the cat sat\n"
               "the ▓▓▓ ░░░\n"
               "cat     ███\n"
               "sat     ▒▒▒ ░░░\n"
               "scale: 0.00 [ ░▒▓█] 1.00\n")


def main():
    if not QKV or not shutil.which("xmllint"):
        print("QKV_BIN must name the qkv binary, and xmllint (libxml2-utils) must be installed")
        return 1
    with tempfile.TemporaryDirectory() as workdir:
        t = HeatmapSuite(workdir)
        os.mkdir(t.path("outdir"))
        alpha = t.save("alpha.npy", softmax_rows((6, 6), 0))
        heads = t.save("heads.npy", softmax_rows((3, 4, 5), 1))
        batched = t.save("batched.npy", softmax_rows((2, 3, 4, 4), 2))
        t.save("three.npy", THREE)
        tokens = ["--tokens", "the student is reading a book"]

        # ---- Every format, written whole.
        for ext in (".png", ".svg", ".pdf", ".html"):
            out = f"outdir/a{ext}"
            t.succeed(f"{ext} with tokens and a title", ["heatmap", alpha, "-o", out, *tokens, "--title", "α"],
                      lambda _, out=out: t.written(out))
        t.succeed("an upper-case extension", ["heatmap", alpha, "-o", "A.PNG"], lambda _: t.written("A.PNG", ".png"))
        t.succeed("CJK labels, annotated, magma", ["heatmap", alpha, "-o", "cjk.png", "--rows", "我 阅读 这 本 书 。",
                                                   "--cols", "I read this book . !", "--annotate", "--cmap", "magma"],
                  lambda r: t.written("cjk.png") or (r.stderr and f"unexpected stderr: {r.stderr}"))

        def rects(name, expected):
            def check(_):
                problem, count = t.svg_rects(name)
                return problem or (None if count == expected else f"{name}: {count} <rect>s, expected {expected}")
            return check

        t.succeed("SVG: one rect per cell", ["heatmap", alpha, "-o", "a.svg", *tokens, "--title", "<&> \"q\""],
                  rects("a.svg", 36))
        t.succeed("SVG of every head", ["heatmap", heads, "--all-heads", "-o", "heads.svg"], rects("heads.svg", 60))
        t.succeed("SVG of one head", ["heatmap", heads, "--head", "2", "-o", "head2.svg"], rects("head2.svg", 20))
        t.succeed("SVG of a batch entry", ["heatmap", batched, "--batch", "1", "--all-heads", "-o", "b1.svg"],
                  rects("b1.svg", 48))
        t.succeed("a rank-4 alpha draws batch 0 and says so", ["heatmap", batched, "-o", "b0.png"],
                  lambda r: t.written("b0.png") or (None if "drawing batch 0" in r.stderr and "drawing head 0"
                                                    in r.stderr else f"no note: {r.stderr!r}"))
        t.succeed("the page needs no head note", ["heatmap", heads, "-o", "heads.html"],
                  lambda r: t.written("heads.html") or (f"unexpected stderr: {r.stderr}" if r.stderr else None))

        # ---- Rows that do not sum to 1 are drawn, with a warning naming the first.
        off = softmax_rows((4, 4), 3)
        off[2] *= 0.5
        t.save("off.npy", off)
        t.succeed("rows off 1 warn and draw", ["heatmap", "off.npy", "-o", "off.png"],
                  lambda r: t.written("off.png") or (None if "warning: ALPHA: 1 of 4 rows do not sum to 1" in r.stderr
                                                     and "row 2" in r.stderr else f"no warning: {r.stderr!r}"))
        masked = softmax_rows((3, 4), 4)
        masked[1] = 0.0
        t.save("masked.npy", masked)
        t.succeed("an all-zero row (a query that sees no key) is drawn silently",
                  ["heatmap", "masked.npy", "-o", "masked.png"],
                  lambda r: t.written("masked.png") or (f"unexpected stderr: {r.stderr}" if r.stderr else None))

        # ---- The terminal: stable text under NO_COLOR and when piped; colour only when asked.
        def exactly(expected):
            return lambda r: None if r.stdout == expected else f"stdout differs:\n{r.stdout}\nexpected:\n{expected}"

        t.succeed("terminal, NO_COLOR", ["heatmap", "three.npy", "--tokens", "the cat sat"], exactly(THREE_PLAIN))
        t.succeed("terminal with -o -", ["heatmap", "three.npy", "-o", "-", "--tokens", "the cat sat"],
                  exactly(THREE_PLAIN))
        t.succeed("terminal, piped without NO_COLOR", ["heatmap", "three.npy", "--tokens", "the cat sat"],
                  exactly(THREE_PLAIN), env={"NO_COLOR": "", "TERM": "xterm-256color"})
        t.succeed("terminal, --color always, truecolor",
                  ["heatmap", "three.npy", "--tokens", "the cat sat", "--color", "always"],
                  lambda r: None if "\x1b[48;2;253;231;37m" in r.stdout else "no 24-bit viridis background",
                  env={"COLORTERM": "truecolor"})
        t.succeed("terminal, --color always, magma", ["heatmap", "three.npy", "--color", "always", "--cmap", "magma"],
                  lambda r: None if "\x1b[48;2;252;253;191m" in r.stdout else "no magma background",
                  env={"COLORTERM": "truecolor"})
        t.succeed("terminal, CJK labels align",
                  ["heatmap", "three.npy", "--rows", "我 阅读 书", "--cols", "a b c"],
                  exactly("      a  b  c\n"
                          "我   ▓▓ ░░\n"
                          "阅读    ██\n"
                          "书      ▒▒ ░░\n"
                          "scale: 0.00 [ ░▒▓█] 1.00\n"))
        t.succeed("terminal, every head with its caption", ["heatmap", heads, "--all-heads"],
                  lambda r: None if [line for line in r.stdout.splitlines() if line.startswith("head ")]
                  == ["head 0", "head 1", "head 2"] else "missing head captions")
        t.succeed("terminal, annotated", ["heatmap", "three.npy", "--annotate", "--title", "T"],
                  lambda r: None if r.stdout.startswith("T\n") and "█1.00" in r.stdout else "no title or values")

        # ---- Refusals.
        t.save("rank1.npy", np.ones(4, dtype=np.float32))
        t.refuse("rank 1", ["heatmap", "rank1.npy", "-o", "r.png"], "ALPHA:", "[Tq, Tk]", "[4]")
        t.save("rank5.npy", np.ones((1, 1, 1, 2, 2), dtype=np.float32))
        t.refuse("rank 5", ["heatmap", "rank5.npy", "-o", "r.png"], "ALPHA:")
        nan = softmax_rows((4, 4), 5)
        nan[1, 2] = np.nan
        t.save("nan.npy", nan)
        t.refuse("NaN weight", ["heatmap", "nan.npy", "-o", "n.png"], "ALPHA:", "finite", "nan at [1, 2]")
        neg = softmax_rows((2, 4, 4), 6)
        neg[1, 0, 3] = -0.1
        t.save("neg.npy", neg)
        t.refuse("negative weight", ["heatmap", "neg.npy", "-o", "n.svg"], "ALPHA:", ">= 0", "[1, 0, 3]")
        t.save("int.npy", np.ones((2, 2), dtype=np.int64))
        t.refuse("int64 weights", ["heatmap", "int.npy", "-o", "i.png"], "ALPHA:", "int64")
        t.save("empty.npy", np.ones((0, 3), dtype=np.float32))
        t.refuse("no queries", ["heatmap", "empty.npy", "-o", "e.png"], "ALPHA:", "[0, 3]")
        t.refuse("missing input", ["heatmap", "nope.npy", "-o", "n.png"], "ALPHA:", "nope.npy")
        t.refuse("--rows too short", ["heatmap", alpha, "-o", "x.png", "--rows", "a b c"],
                 "--rows:", "expected 6 tokens", "got 3")
        t.refuse("--cols too long", ["heatmap", heads, "-o", "x.png", "--cols", "a b c d e f"],
                 "--cols:", "expected 5", "got 6")
        t.refuse("--rows given empty", ["heatmap", alpha, "-o", "x.png", "--rows", ""], "--rows:", "got 0")
        t.refuse("--tokens on a matrix that is not square", ["heatmap", heads, "--tokens", "a b c d"],
                 "--tokens:", "Tq = 4", "Tk = 5")
        t.refuse("unknown extension", ["heatmap", alpha, "-o", "a.jpg"], "-o:", ".png, .svg, .pdf or .html", "a.jpg")
        t.refuse("no extension", ["heatmap", alpha, "-o", "attention"], "-o:", "attention")
        t.refuse("missing directory", ["heatmap", alpha, "-o", "missing/a.png"], "-o:", "missing")
        t.refuse("output is a directory", ["heatmap", alpha, "-o", "outdir.png/"], "-o:")
        t.refuse("parent is a file", ["heatmap", alpha, "-o", "alpha.npy/a.png"], "-o:", "not a directory")
        t.refuse("--head of a matrix", ["heatmap", alpha, "--head", "0", "-o", "h.png"], "--head:", "no heads")
        t.refuse("--head out of range", ["heatmap", heads, "--head", "3", "-o", "h.png"], "--head:", "0 to 2", "got 3")
        t.refuse("--head negative", ["heatmap", heads, "--head", "-1", "-o", "h.png"], "--head:")
        t.refuse("--batch without a batch dim", ["heatmap", heads, "--batch", "0", "-o", "h.png"], "--batch:",
                 "no batch dim")
        t.refuse("--batch out of range", ["heatmap", batched, "--batch", "2", "-o", "h.png"], "--batch:", "0 to 1")
        t.refuse("--head with --all-heads", ["heatmap", heads, "--head", "1", "--all-heads", "-o", "h.png"], "--head")
        t.refuse("--tokens with --rows", ["heatmap", alpha, "--tokens", "a b c d e f", "--rows", "a b c d e f"],
                 "--rows")
        t.refuse("unknown --cmap", ["heatmap", alpha, "--cmap", "jet", "-o", "c.png"], "--cmap:", "viridis", "jet")
        # Signed matrices (scores, biases, gradients) are drawn with the diverging map, and only with it.
        scores = t.save("scores.npy", np.array([[-1.5, 0.5, 2.0], [0.0, -0.25, 1.0]], dtype=np.float32))
        t.refuse("negative values with a sequential map", ["heatmap", scores, "-o", "s.png"], "ALPHA:", "negative")
        t.succeed("signed scores with --cmap coolwarm", ["heatmap", scores, "--cmap", "coolwarm", "-o", "s.png"],
                  lambda _: t.written("s.png"))
        t.succeed("signed scores in the terminal", ["heatmap", scores, "--cmap", "coolwarm", "--vmax", "4"],
                  lambda r: None if "scale: -4.00 " in r.stdout and " 4.00" in r.stdout else f"no ±4 scale: {r.stdout!r}")
        t.save("scores_nan.npy", np.array([[np.nan, 1.0]], dtype=np.float32))
        t.refuse("NaN with --cmap coolwarm", ["heatmap", "scores_nan.npy", "--cmap", "coolwarm", "-o", "n.png"],
                 "ALPHA:", "non-finite")
        t.refuse("--vmax 0", ["heatmap", alpha, "--vmax", "0", "-o", "v.png"], "--vmax:", "above 0")
        t.refuse("--vmax nan", ["heatmap", alpha, "--vmax", "nan", "-o", "v.png"], "--vmax")
        t.refuse("--annotate on too many cells",
                 ["heatmap", t.save("huge.npy", np.full((1500, 1500), 1 / 1500, dtype=np.float32)), "--annotate",
                  "-o", "huge.png"], "the image would be")
        os.remove(t.path("huge.npy"))
        # A refused run leaves an existing picture as it was.
        t.succeed("a picture to keep", ["heatmap", alpha, "-o", "keep.png"], lambda _: t.written("keep.png"))
        t.refuse("a refused run keeps the old picture", ["heatmap", alpha, "-o", "keep.png", "--rows", "a"], "--rows:")

        # ---- qkv demo saves its pictures and says where.
        demo_dir = t.path("demo")
        os.mkdir(demo_dir)

        def demo_check(r):
            for name in ("attention.png", "attention.html"):
                problem = t.written(f"demo/{name}")
                if problem:
                    return problem
                if os.path.realpath(os.path.join(demo_dir, name)) not in r.stdout:
                    return f"stdout does not say where {name} is"
            return None

        t.succeed("demo saves attention.png and attention.html", ["demo", "--out-dir", "demo"], demo_check)
        t.succeed("demo --no-files saves nothing", ["demo", "--no-files", "--out-dir", "nowhere"],
                  lambda r: None if "attention.png" not in r.stdout else "it mentions a picture")
        t.refuse("demo into a missing directory", ["demo", "--out-dir", "missing"], "--out-dir:", "missing")

        # ---- qkv attend --heatmap draws the weights it computed, or nothing at all.
        rng = np.random.default_rng(7)
        for name, shape in (("q.npy", (2, 5, 8)), ("k.npy", (2, 6, 8)), ("v.npy", (2, 6, 3))):
            t.save(name, rng.standard_normal(shape).astype(np.float32))
        qkv = ["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy"]
        t.succeed("attend --heatmap SVG (every head)", [*qkv, "-o", "o.npy", "--heatmap", "w.svg"],
                  lambda _: rects("w.svg", 2 * 5 * 6)(None) or t.written("w.svg"))
        t.succeed("attend --heatmap with --weights", [*qkv, "-o", "o2.npy", "--weights", "w.npy", "--heatmap",
                                                      "outdir/w.html"], lambda _: t.written("outdir/w.html"))
        t.refuse("attend --heatmap with a bad extension", [*qkv, "-o", "o3.npy", "--heatmap", "w.gif"],
                 "--heatmap:", "w.gif")
        t.refuse("attend --heatmap into a missing directory", [*qkv, "-o", "o3.npy", "--heatmap", "missing/w.png"],
                 "--heatmap:", "missing")

        # ---- Masked cells are no weights: drawn apart from a weight of 0 in every format.
        causal = np.tril(np.ones((5, 5), dtype=np.float32))
        causal[4] = [0.0, 0.25, 0.25, 0.25, 0.25]  # an unmasked 0 at [4, 0]
        causal /= causal.sum(axis=1, keepdims=True)
        t.save("causal.npy", causal)
        t.save("tril.npy", np.tril(np.ones((5, 5), dtype=bool)))
        t.save("last_key.npy", np.array([[1, 1, 1, 1, 0]], dtype=np.int64))

        def masked_grid(r):
            lines = r.stdout.splitlines()
            if lines[1] != "0 ██  ·  ·  ·  ·":
                return f"row 0 is {lines[1]!r}, expected its masked keys as '·'"
            if not lines[5].startswith("4    ░░"):
                return f"row 4's unmasked 0 is not a blank shade: {lines[5]!r}"
            return None if lines[-1].endswith(", · masked") else f"the scale does not say '· masked': {lines[-1]!r}"

        t.succeed("terminal: --causal draws masked cells as '·'", ["heatmap", "causal.npy", "--causal"], masked_grid)
        t.succeed("terminal: a bool --mask is the same as --causal", ["heatmap", "causal.npy", "--mask", "tril.npy"],
                  masked_grid)
        t.succeed("terminal: an int64 [1, Tk] --mask broadcasts over the queries",
                  ["heatmap", "causal.npy", "--mask", "last_key.npy"],
                  lambda r: None if all(line.endswith("·") for line in r.stdout.splitlines()[1:6])
                  else f"key 4 is not masked in every row:\n{r.stdout}")
        t.succeed("terminal: --annotate writes no value on masked cells",
                  ["heatmap", "causal.npy", "--causal", "--annotate"],
                  lambda r: None if r.stdout.splitlines()[1] == "0 █1.00     ·     ·     ·     ·"
                  and "0.00" in r.stdout.splitlines()[5] else f"unexpected values:\n{r.stdout}")

        def svg_masked(name, masked, zeros_annotated):
            def check(_):
                with open(t.path(name), encoding="utf-8") as f:
                    svg = f.read()
                got = svg.count('class="masked"')
                if got != masked:
                    return f"{name}: {got} masked cells, expected {masked}"
                if zeros_annotated is not None and svg.count(">0.00</text>") != zeros_annotated:
                    return f"{name}: {svg.count('>0.00</text>')} cells annotated 0.00, expected {zeros_annotated}"
                return rects(name, 25)(None)
            return check

        t.succeed("SVG: --causal marks the 10 cells above the diagonal, annotated with no value",
                  ["heatmap", "causal.npy", "--causal", "--annotate", "-o", "causal.svg"],
                  svg_masked("causal.svg", 10, 1))
        t.succeed("HTML: --causal carries the mask for the hover",
                  ["heatmap", "causal.npy", "--causal", "-o", "causal.html"],
                  lambda _: None if '"masked":[0,1,1,1,1,' in open(t.path("causal.html"), encoding="utf-8").read()
                  else "no mask in the page's data")
        t.succeed("PNG and PDF with --causal", ["heatmap", "causal.npy", "--causal", "-o", "causal.png"],
                  lambda _: t.written("causal.png"))
        t.refuse("a --mask that does not broadcast", ["heatmap", "causal.npy", "--mask", t.save(
            "mask23.npy", np.ones((2, 3), dtype=bool)), "-o", "m.png"], "--mask:", "broadcasts", "[5, 5]", "[2, 3]")
        t.refuse("a float --mask", ["heatmap", "causal.npy", "--mask", t.save(
            "maskf.npy", np.zeros((5, 5), dtype=np.float32))], "--mask:", "float32")
        t.refuse("a missing --mask", ["heatmap", "causal.npy", "--mask", "none.npy"], "--mask:", "none.npy")
        t.succeed("attend --heatmap --causal draws what the mask hid as masked",
                  [*qkv, "--causal", "-o", "oc.npy", "--heatmap", "wc.svg"],
                  lambda _: (None if open(t.path("wc.svg"), encoding="utf-8").read().count('class="masked"') == 20
                             else "expected 2 heads × 10 masked cells of a bottom-right causal [5, 6]"))
        t.succeed("attend --heatmap without a mask masks nothing", [*qkv, "-o", "on.npy", "--heatmap", "wn.svg"],
                  lambda _: None if 'class="masked"' not in open(t.path("wn.svg"), encoding="utf-8").read()
                  else "masked cells without a mask")

        # ---- The colour scale: --scale, and clipping shown when --vmax clips.
        small = t.save("small.npy", np.array([[0.25, 0.75], [0.01, 0.99]], dtype=np.float32))
        scale_line = lambda r: r.stdout.splitlines()[-1]  # noqa: E731
        t.succeed("--scale sqrt moves the shades as documented", ["heatmap", small, "--scale", "sqrt"],
                  lambda r: None if r.stdout.splitlines()[1] == "0 ▒▒ ██" else f"row 0: {r.stdout.splitlines()[1]!r}")
        t.succeed("--scale linear is the default", ["heatmap", small, "--scale", "linear"],
                  lambda r: None if r.stdout.splitlines()[1] == "0 ░░ ▓▓" else f"row 0: {r.stdout.splitlines()[1]!r}")
        t.succeed("--scale log shows a weight of 0.01", ["heatmap", small, "--scale", "log"],
                  lambda r: None if r.stdout.splitlines()[2].startswith("1 ░░") else f"row 1: {r.stdout!r}")
        t.refuse("unknown --scale", ["heatmap", small, "--scale", "cubic"], "--scale:", "linear, sqrt or log", "cubic")
        t.succeed("no clipping marker when nothing is clipped", ["heatmap", small, "--vmax", "1"],
                  lambda r: None if scale_line(r) == "scale: 0.00 [ ░▒▓█] 1.00" else f"scale: {scale_line(r)!r}")
        t.succeed("the scale says >= when --vmax clips", ["heatmap", small, "--vmax", "0.5"],
                  lambda r: None if scale_line(r) == "scale: 0.00 [ ░▒▓█] ≥0.50" else f"scale: {scale_line(r)!r}")
        for vmax, marked in (("0.5", 1), ("1", 0)):
            t.succeed(f"SVG: a clipping triangle {'only ' if marked else 'not '}when --vmax {vmax} clips",
                      ["heatmap", small, "--vmax", vmax, "-o", f"clip{vmax}.svg"],
                      lambda _, vmax=vmax, marked=marked: (
                          None if open(t.path(f"clip{vmax}.svg"), encoding="utf-8").read().count('class="clip-high"')
                          == marked else f"expected {marked} clip-high markers"))

        # ---- The terminal grid fits COLUMNS: every line, counted in display columns.
        def fits(width, *must_have):
            def check(r):
                wide = [line for line in r.stdout.splitlines() if display_width(line) > width]
                if wide:
                    return f"{len(wide)} lines wider than {width}, the first: {wide[0]!r}"
                missing = [text for text in must_have if text not in r.stdout]
                return f"missing {missing}" if missing else None
            return check

        t.save("wide.npy", softmax_rows((64, 64), 8))
        t.succeed("64 keys at COLUMNS=60: a window of keys, and a line saying so", ["heatmap", "wide.npy"],
                  fits(60, "(keys 0–57 of 64 shown"), env={"COLUMNS": "60"})
        t.succeed("64 keys at COLUMNS=80: one column a key", ["heatmap", "wide.npy"],
                  fits(80, "(fitted to 80 columns"), env={"COLUMNS": "80"})
        t.succeed("64 keys piped without COLUMNS: 80 columns", ["heatmap", "wide.npy"],
                  fits(80, "(fitted to 80 columns"), env={"COLUMNS": "not a number"})
        t.succeed("64 keys, coloured, at COLUMNS=60", ["heatmap", "wide.npy", "--color", "always"],
                  fits(60, "(keys 0–"), env={"COLUMNS": "60", "COLORTERM": "truecolor"})
        cjk = " ".join(f"阅读{i}" for i in range(30))
        t.succeed("30 CJK tokens, annotated, at COLUMNS=60",
                  ["heatmap", t.save("t30.npy", softmax_rows((30, 30), 9)), "--tokens", cjk, "--annotate",
                   "--title", "注意力 " * 20], fits(60, "(keys 0–"), env={"COLUMNS": "60"})
        t.succeed("COLUMNS below 40 draws 40 wide", ["heatmap", "wide.npy"], fits(40, "(keys 0–37 of 64"),
                  env={"COLUMNS": "12"})

        t.succeed("heatmap --help", ["heatmap", "--help"],
                  lambda r: None if all(s in r.stdout for s in ("--all-heads", "--cmap", ".html", "NO_COLOR",
                                                                "--mask", "--causal", "--scale", "COLUMNS",
                                                                "Examples")) else "help lacks something")

        return t.report()


if __name__ == "__main__":
    sys.exit(main())
