#!/usr/bin/env python3
"""`qkv heatmap`, `qkv demo`'s pictures and `qkv attend --heatmap` from the command line.

Happy paths: every format is written whole (PNG, PDF and HTML by their signature; SVG parsed by
libxml2's xmllint with one <rect> per cell in its cells group); the terminal grid under NO_COLOR is exact, stable text;
colour only when asked or on a terminal. Refusals: exit code 2, one error line naming the argument
at fault, and the directory exactly as it was (no output, no temporary file, an existing output left
untouched). Rows that do not sum to 1 are drawn with a warning. The pixels of the PNGs are checked
by tests/viz/test_heatmap.cpp, the page in a browser by tests/browser/test_heatmap.mjs.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_heatmap.py
"""

import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import QKV, Suite  # noqa: E402  (the harness sits beside this script)

SIGNATURES = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-", ".html": b"<!DOCTYPE html>", ".svg": b"<?xml"}


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

        t.succeed("heatmap --help", ["heatmap", "--help"],
                  lambda r: None if all(s in r.stdout for s in ("--all-heads", "--cmap", ".html", "NO_COLOR",
                                                                "Examples")) else "help lacks something")

        return t.report()


if __name__ == "__main__":
    sys.exit(main())
