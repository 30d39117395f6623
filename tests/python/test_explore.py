"""qkv.explore: the explorer page from an array or a model's per-layer outputs, its images, and
refusals that write nothing."""

import json
import re

import numpy as np
import pytest

import qkv
from conftest import randn


def weights_of(rng, shape):
    scores = randn(rng, shape, np.float64) * 3
    exps = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (exps / exps.sum(axis=-1, keepdims=True)).astype(np.float32)


def page_data(page: bytes) -> dict:
    found = re.search(rb'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def test_page_of_an_array(rng, tmp_path):
    a = weights_of(rng, (3, 2, 5, 5))
    page = qkv.explore(a, "the cat sat on mats", path=tmp_path / "page.html", layer_names="emb mid top")
    assert page.startswith(b"<!DOCTYPE html>") and (tmp_path / "page.html").read_bytes() == page
    data = page_data(page)
    assert (data["L"], data["H"], data["tq"], data["tk"]) == (3, 2, 5, 5)
    assert data["layers"] == ["emb", "mid", "top"] and data["cols"] == data["rows"] == "the cat sat on mats".split()
    entropy = -(a.astype(np.float64) * np.log(a.astype(np.float64))).sum(-1).mean(-1)
    np.testing.assert_allclose(data["entropy"], entropy.ravel(), rtol=1e-12)


def test_page_of_output_attentions(rng):
    """A sequence of [B, H, T, T] layers, as a model's output_attentions: batch picks the entry."""
    layers = [weights_of(rng, (2, 3, 4, 4)) for _ in range(2)]
    data = page_data(qkv.explore(layers, batch=1))
    assert (data["L"], data["H"]) == (2, 3)


def test_cross_attention(rng):
    data = page_data(qkv.explore(weights_of(rng, (1, 1, 2, 3)), ["le", "chat"], ["the", "cat", "."]))
    assert (data["tq"], data["tk"], data["cols"]) == (2, 3, ["the", "cat", "."])
    with pytest.raises(qkv.ShapeError, match="key_tokens"):
        qkv.explore(weights_of(rng, (1, 1, 2, 3)), ["le", "chat"])


@pytest.mark.parametrize("name,view,rows,signature", [
    ("grid.png", "grid", None, b"\x89PNG"), ("rollout.svg", "rollout", None, b"<?xml"),
    ("mean.pdf", "mean", None, b"%PDF-"), ("selection.png", "rollout", [1, 2], b"\x89PNG")])
def test_images(rng, tmp_path, name, view, rows, signature):
    image = qkv.explore(weights_of(rng, (2, 2, 4, 4)), path=tmp_path / name, view=view, select_rows=rows)
    assert image.startswith(signature) and (tmp_path / name).read_bytes() == image


def test_panel_scales(rng, tmp_path):
    """Images colour each panel by its own largest weight, named in its caption, or all on one scale."""
    a = weights_of(rng, (2, 2, 4, 4))
    own = qkv.explore(a, path=tmp_path / "own.svg")
    shared = qkv.explore(a, path=tmp_path / "shared.svg", panel_scale="shared")
    for v in a.reshape(4, -1).max(axis=1):
        assert f"max {v:.3g}".encode() in own
    assert "· max ".encode() not in shared
    with pytest.raises(ValueError, match="panel_scale: expected own or shared, got mine"):
        qkv.explore(a, panel_scale="mine")


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a[0, 0], qkv.ShapeError, r"attention: expected \[L, H, Tq, Tk\]"),
    (lambda a: np.where(np.arange(a.size).reshape(a.shape) == 7, np.nan, a), ValueError, r"finite weights.*\[0, 0, 1, 3\]"),
    (lambda a: a * 0.9, ValueError, r"sum to 1 within 0.01"),
])
def test_refusals_write_nothing(rng, tmp_path, change, error, match):
    with pytest.raises(error, match=match):
        qkv.explore(change(weights_of(rng, (2, 2, 2, 4))), path=tmp_path / "x.html")
    assert list(tmp_path.iterdir()) == []


def test_label_counts_are_checked(rng):
    a = weights_of(rng, (2, 1, 3, 3))
    with pytest.raises(qkv.ShapeError, match="tokens: expected 3 tokens"):
        qkv.explore(a, "a b")
    with pytest.raises(qkv.ShapeError, match="layer_names: expected 2 names"):
        qkv.explore(a, layer_names="one")
    with pytest.raises(qkv.ShapeError, match="expected layer 1 of the shape of layer 0"):
        qkv.explore([a[0], a[1, :, :2, :2]])
