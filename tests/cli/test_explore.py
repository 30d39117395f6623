#!/usr/bin/env python3
"""`qkv explore` from the command line.

Happy paths: a .npy of [L, H, T, T], [H, T, T] and [L, B, H, T, T] (--batch), an .npz of one array a
layer (taken in the natural order of their names, layer2 before layer10, and named by them), and
cross-attention with --key-tokens, each written as a page with the data it should carry; the static
images (--view grid, mean, rollout; --select-rows) in PNG, SVG and PDF; a page of L = 12, H = 12,
T = 512 under 20 MB. Refusals: exit code 2, one error line naming the argument, the expected and the
actual, and no file written: wrong rank, layers of different shapes, token and layer-name counts that
do not match, NaN, negative weights, rows off 1 beyond the stated 0.01, a batch out of range, a
rollout of cross-attention, a bad -o. The page itself is checked in a browser by
tests/browser/test_explore.mjs.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_explore.py
"""

import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import Suite, run_suite  # noqa: E402  (the harness sits beside this script)

SIGNATURES = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-", ".html": b"<!DOCTYPE html>", ".svg": b"<?xml"}


def softmax_rows(shape, seed, spread=3.0):
    scores = np.random.default_rng(seed).standard_normal(shape) * spread
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


class ExploreSuite(Suite):
    timeout = 120

    def check(self, name, problems):
        self.count += 1
        for problem in problems:
            self.fail(name, problem)
        if not problems:
            print(f"ok   {name}")

    def page_data(self, name):
        with open(self.path(name), encoding="utf-8") as f:
            page = f.read()
        found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
        return json.loads(found.group(1)) if found else None

    def page(self, name, expect):
        """A check that the page `name` carries what `expect` (a dict of its data's fields) says."""
        def check(_):
            data = self.page_data(name)
            if data is None:
                return f"{name}: no data element"
            wrong = {k: data.get(k) for k, v in expect.items() if data.get(k) != v}
            return f"{name}: {wrong}, expected {expect}" if wrong else None
        return check

    def image(self, name):
        def check(_):
            with open(self.path(name), "rb") as f:
                head = f.read(16)
            ext = os.path.splitext(name)[1]
            return None if head.startswith(SIGNATURES[ext]) else f"{name} does not start with the {ext} signature"
        return check


def checks(t):
    tokens = "the cat sat on a mat"
    a = softmax_rows((3, 2, 6, 6), 1)
    t.save("model.npy", a)
    t.succeed("a [L, H, T, T] array", ["explore", "model.npy", "--tokens", tokens, "-o", "model.html"],
              t.page("model.html", {"L": 3, "H": 2, "tq": 6, "tk": 6, "rows": tokens.split(),
                                    "layers": ["layer 0", "layer 1", "layer 2"]}))
    # The page's summaries are float64 of the file's weights.
    data = t.page_data("model.html")
    entropy = -(a.astype(np.float64) * np.log(a.astype(np.float64))).sum(-1).mean(-1)
    t.check("per-head entropy", [] if np.allclose(data["entropy"], entropy.ravel(), rtol=1e-12, atol=0) else
            [f"entropy {data['entropy']} != {entropy.ravel()}"])
    distance = (a.astype(np.float64) * np.abs(np.arange(6)[:, None] - np.arange(6)[None, :])).sum(-1).mean(-1)
    t.check("per-head mean distance", [] if np.allclose(data["distance"], distance.ravel(), rtol=1e-12, atol=0) else
            [f"distance {data['distance']} != {distance.ravel()}"])
    t.succeed("--layer-names", ["explore", "model.npy", "--layer-names", "emb mid top", "-o", "named.html"],
              t.page("named.html", {"layers": ["emb", "mid", "top"]}))
    t.save("one.npy", a[0])
    t.succeed("one layer [H, T, T]", ["explore", "one.npy", "-o", "one.html"], t.page("one.html", {"L": 1, "H": 2}))
    t.save("batched.npy", np.stack([a, a[:, ::-1]], axis=1))
    t.succeed("[L, B, H, T, T] with --batch", ["explore", "batched.npy", "--batch", "1", "-o", "batched.html"],
              t.page("batched.html", {"L": 3, "H": 2}))
    t.refuse("--batch out of range", ["explore", "batched.npy", "--batch", "2", "-o", "x.html"],
             "--batch", "expected 0 to 1", "got 2")
    t.refuse("--batch without a batch dim", ["explore", "model.npy", "--batch", "0", "-o", "x.html"],
             "--batch", "no batch dim")

    # An .npz: layers in the natural order of their names.
    np.savez(t.path("layers.npz"), layer10=a[2], layer2=a[1], layer1=a[0])
    t.succeed("an .npz in natural order", ["explore", "layers.npz", "-o", "npz.html"],
              t.page("npz.html", {"layers": ["layer1", "layer2", "layer10"]}))
    np.savez(t.path("batched.npz"), l0=np.stack([a[0], a[1]]), l1=np.stack([a[1], a[2]]))
    t.succeed("an .npz of [B, H, T, T] layers", ["explore", "batched.npz", "--batch", "1", "-o", "bnpz.html"],
              t.page("bnpz.html", {"L": 2, "H": 2}))
    t.refuse("--batch with unbatched layers", ["explore", "layers.npz", "--batch", "0", "-o", "x.html"],
             "--batch", "ATTN layer 'layer1'", "no batch dim")
    np.savez(t.path("ragged.npz"), l0=a[0], l1=softmax_rows((2, 5, 5), 2))
    t.refuse("layers of different shapes", ["explore", "ragged.npz", "-o", "x.html"],
             "ATTN layer 'l1'", "expected the shape of layer 'l0', [2, 6, 6]", "got [2, 5, 5]")
    np.savez(t.path("flat.npz"), l0=a[0, 0, 0])
    t.refuse("an .npz layer of rank 1", ["explore", "flat.npz", "-o", "x.html"], "ATTN layer 'l0'",
             "expected [H, Tq, Tk] or [B, H, Tq, Tk]", "got [6]")

    # Cross-attention.
    c = softmax_rows((2, 2, 4, 7), 3)
    t.save("cross.npy", c)
    t.succeed("cross-attention", ["explore", "cross.npy", "--tokens", "le chat est là", "--key-tokens",
                                  "the cat is there . a b", "-o", "cross.html"],
              t.page("cross.html", {"tq": 4, "tk": 7, "cols": "the cat is there . a b".split()}))
    t.refuse("cross-attention without --key-tokens", ["explore", "cross.npy", "--tokens", "le chat est là",
                                                      "-o", "x.html"], "--key-tokens", "Tq = 4, Tk = 7")
    t.refuse("a rollout of cross-attention", ["explore", "cross.npy", "--view", "rollout", "-o", "x.png"],
             "--view rollout", "Tq = Tk", "Tq = 4 and Tk = 7")

    # Refusals of the array and the labels.
    t.save("rank2.npy", a[0, 0])
    t.refuse("wrong rank", ["explore", "rank2.npy", "-o", "x.html"], "ATTN", "[L, H, Tq, Tk]", "got [6, 6]")
    t.refuse("too few tokens", ["explore", "model.npy", "--tokens", "the cat", "-o", "x.html"],
             "--tokens", "expected 6 tokens", "got 2")
    t.refuse("too many key tokens", ["explore", "cross.npy", "--tokens", "a b c d", "--key-tokens", "a b", "-o",
                                     "x.html"], "--key-tokens", "expected 7 tokens", "got 2")
    t.refuse("layer names that do not match", ["explore", "model.npy", "--layer-names", "a b", "-o", "x.html"],
             "--layer-names", "expected 3 names", "got 2")
    nan = a.copy()
    nan[1, 0, 2, 3] = np.nan
    t.save("nan.npy", nan)
    t.refuse("NaN", ["explore", "nan.npy", "-o", "x.html"], "ATTN", "expected finite weights", "nan",
             "[1, 0, 2, 3]")
    negative = a.copy()
    negative[0, 1, 0, 0] = -0.5
    t.save("negative.npy", negative)
    t.refuse("a negative weight", ["explore", "negative.npy", "-o", "x.html"], "ATTN", ">= 0", "[0, 1, 0, 0]")
    off = a.copy()
    off[2, 1, 4] *= 0.95
    t.save("off.npy", off)
    t.refuse("a row off 1", ["explore", "off.npy", "-o", "x.html"], "ATTN", "sum to 1 within 0.01", "0.95",
             "[2, 1, 4]")
    near = a.copy()
    near[2, 1, 4] *= 0.995
    t.save("near.npy", near)
    t.succeed("a row off 1 within the tolerance", ["explore", "near.npy", "-o", "near.html"])
    zero = a.copy()
    zero[0, 0, 1] = 0
    t.save("zero.npy", zero)
    t.succeed("an all-zero row (a query that sees no key)", ["explore", "zero.npy", "-o", "zero.html"])
    t.refuse("a bad -o", ["explore", "model.npy", "-o", "x.jpg"], "-o", ".png")
    t.refuse("--view on a page", ["explore", "model.npy", "--view", "rollout", "-o", "x.html"], "--view", "images")
    t.refuse("a bad --view", ["explore", "model.npy", "--view", "sideways", "-o", "x.png"], "--view",
             "grid, mean or rollout", "sideways")
    t.refuse("a bad --select-rows", ["explore", "model.npy", "--select-rows", "3-9", "-o", "x.png"],
             "--select-rows", "0 to 5", "3-9")
    t.refuse("a diverging --cmap", ["explore", "model.npy", "--cmap", "coolwarm", "-o", "x.html"], "--cmap")

    # Static images.
    for ext in (".png", ".svg", ".pdf"):
        t.succeed(f"the model view as {ext}", ["explore", "model.npy", "--tokens", tokens, "-o", "grid" + ext],
                  t.image("grid" + ext))
    t.succeed("the rollout as PNG", ["explore", "model.npy", "--view", "rollout", "-o", "rollout.png"],
              t.image("rollout.png"))
    t.succeed("the mean over heads as SVG", ["explore", "model.npy", "--view", "mean", "-o", "mean.svg"],
              t.image("mean.svg"))
    t.succeed("a selection as PNG", ["explore", "model.npy", "--tokens", tokens, "--view", "rollout",
                                     "--select-rows", "1 3-4", "-o", "selection.png"], t.image("selection.png"))

    # Panel scales: each head by its own largest weight (the default, as the page's model view), or shared.
    def captions(name, expected):
        def check(_):
            with open(t.path(name), encoding="utf-8") as f:
                svg = f.read()
            largest = a.reshape(6, -1).max(axis=1)
            found = [f"max {v:.3g}" in svg for v in largest]
            if expected and not all(found):
                return f"{name}: expected each head's largest weight {largest} in its caption"
            if not expected and " · max " in svg:
                return f"{name}: a shared scale names no panel's largest weight"
            return None
        return check
    t.succeed("--panel-scale own (the default) names each head's largest weight",
              ["explore", "model.npy", "-o", "own.svg"], captions("own.svg", True))
    t.succeed("--panel-scale shared", ["explore", "model.npy", "--panel-scale", "shared", "-o", "shared.svg"],
              captions("shared.svg", False))
    t.succeed("--panel-scale own of a selection", ["explore", "model.npy", "--select-rows", "2", "--panel-scale",
                                                   "own", "-o", "own_rows.svg"], t.image("own_rows.svg"))
    t.refuse("a bad --panel-scale", ["explore", "model.npy", "--panel-scale", "mine", "-o", "x.png"],
             "--panel-scale", "own or shared", "mine")
    t.refuse("--panel-scale on a page", ["explore", "model.npy", "--panel-scale", "shared", "-o", "x.html"],
             "--panel-scale", "images")

    # Size: L = 12, H = 12, T = 512 of a trained model's spread of scores.
    t.save("bert.npy", softmax_rows((12, 12, 512, 512), 4))
    def small(_):
        size = os.path.getsize(t.path("bert.html"))
        print(f"     L = 12, H = 12, T = 512: {size / 1e6:.1f} MB")
        return None if size < 20e6 else f"bert.html is {size} bytes, expected under 20 MB"
    t.succeed("L = 12, H = 12, T = 512 under 20 MB", ["explore", "bert.npy", "-o", "bert.html"], small)


if __name__ == "__main__":
    sys.exit(run_suite(ExploreSuite, "qkv-explore-", checks))
