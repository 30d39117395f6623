"""qkv.heatmap: the notebook's inline image, the files written by extension, the terminal grid,
labels, and refusals that write nothing."""

import xml.etree.ElementTree as ElementTree

import numpy as np
import pytest

import qkv
from conftest import randn


def weights_of(rng, shape):
    """Softmax rows of random scores: what attention(..., return_weights=True) gives."""
    scores = randn(rng, shape, np.float64)
    exps = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return exps / exps.sum(axis=-1, keepdims=True)


def test_small_matrix_shows_as_svg(rng):
    bundle = qkv.heatmap(weights_of(rng, (4, 6)))._repr_mimebundle_()
    assert list(bundle) == ["image/svg+xml"]
    ElementTree.fromstring(bundle["image/svg+xml"])


def test_large_matrix_shows_as_png(rng):
    bundle = qkv.heatmap(weights_of(rng, (65, 65)).astype(np.float32))._repr_mimebundle_()
    assert list(bundle) == ["image/png"]
    assert bundle["image/png"].startswith(b"\x89PNG\r\n\x1a\n")


def test_every_head_counts_toward_the_inline_format(rng):
    # Two heads of 48 x 48 are drawn side by side: 4608 cells, past the SVG limit of 64 * 64.
    assert list(qkv.heatmap(weights_of(rng, (2, 48, 48)))._repr_mimebundle_()) == ["image/png"]
    assert list(qkv.heatmap(weights_of(rng, (2, 48, 48)), head=1)._repr_mimebundle_()) == ["image/svg+xml"]


def is_png(data):
    return data.startswith(b"\x89PNG\r\n\x1a\n")


def is_pdf(data):
    return data.startswith(b"%PDF")


def is_svg(data):
    return ElementTree.fromstring(data).tag.endswith("svg")


def is_html(data):
    return b"<html" in data.lower()


@pytest.mark.parametrize("extension,check", [("png", is_png), ("svg", is_svg), ("pdf", is_pdf), ("html", is_html),
                                             ("PNG", is_png)])
def test_path_writes_the_format_its_extension_names(rng, tmp_path, extension, check):
    path = tmp_path / f"attention.{extension}"
    drawing = qkv.heatmap(weights_of(rng, (2, 3, 5, 5)), rows="a b c d e", cols=list("vwxyz"), path=path,
                          title="α", annotate=True, batch=1, head=0, marked=[(1, 2)])
    assert check(path.read_bytes())
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left behind
    assert drawing.save(tmp_path / "again.png") is drawing


def test_formats_in_memory(rng):
    drawing = qkv.heatmap(weights_of(rng, (3, 4)), colormap="magma", vmin=0, vmax=1)
    assert is_png(drawing.png()) and is_pdf(drawing.pdf()) and is_svg(drawing.svg()) and is_html(drawing.html())


def test_text_is_the_terminal_grid(rng):
    weights = np.array([[1.0, 0.0], [0.25, 0.75]])
    drawing = qkv.heatmap(weights, rows=["我", "书"], cols="k0 k1")
    lines = drawing.text().splitlines()
    assert lines[0].split() == ["k0", "k1"]
    assert lines[1] == "我 ██" and lines[2] == "书 ░░ ▓▓"  # a weight of 1 is full, 0 blank
    assert lines[-1] == "scale: 0.000 [ ░▒▓█] 1.000"
    assert "\x1b[48;2;253;231;37m" in drawing.text(color=True)  # viridis' top: the weight 1 cell
    assert repr(drawing) == drawing.text()


def test_mask_draws_masked_cells_apart_from_zero_weights():
    weights = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
    causal = np.tril(np.ones((3, 3), dtype=bool))
    drawing = qkv.heatmap(weights, mask=causal)
    lines = drawing.text().splitlines()
    assert lines[1] == "0 ██  ·  ·" and lines[3] == "2    ▒▒ ▒▒"  # masked '·', the unmasked 0 blank
    assert lines[-1] == "scale: 0.000 [ ░▒▓█] 1.000, · masked"
    assert drawing.svg().count(b'class="masked"') == 3
    assert qkv.heatmap(weights, mask=np.array([1, 1, 0], dtype=np.int32)).svg().count(b'class="masked"') == 3
    with pytest.raises(qkv.ShapeError, match="mask"):
        qkv.heatmap(weights, mask=np.ones((2, 3), dtype=bool))
    with pytest.raises(ValueError, match="mask: expected a bool or integer array"):
        qkv.heatmap(weights, mask=np.zeros((3, 3), np.float32))


def test_scale_spreads_small_weights():
    weights = np.array([[0.25, 1.0]])
    assert qkv.heatmap(weights).text().splitlines()[1] == "0 ░░ ██"
    assert qkv.heatmap(weights, scale="sqrt").text().splitlines()[1] == "0 ▒▒ ██"
    with pytest.raises(ValueError, match="scale: expected linear, sqrt or log, got cubic"):
        qkv.heatmap(weights, scale="cubic")


def test_bad_extension_raises_and_writes_nothing(rng, tmp_path):
    with pytest.raises(ValueError, match="path"):
        qkv.heatmap(weights_of(rng, (3, 3)), path=tmp_path / "attention.jpg")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rows,cols,message", [
    ("a b", None, r"rows: expected 3 labels \(one per query of weights \[3, 3\]\), got 2"),
    (None, ["x", "y", "z", "w"], r"cols: expected 3 labels \(one per key of weights \[3, 3\]\), got 4"),
    (["a"] * 4, None, "rows: expected 3 labels .*, got 4"),
])
def test_wrong_label_count_is_refused(rng, tmp_path, rows, cols, message):
    with pytest.raises(qkv.ShapeError, match=message):
        qkv.heatmap(weights_of(rng, (3, 3)), rows=rows, cols=cols, path=tmp_path / "a.png")
    assert list(tmp_path.iterdir()) == []


def test_labels_of_another_type_are_refused(rng):
    with pytest.raises(qkv.ShapeError, match="rows: expected None, a string of labels"):
        qkv.heatmap(weights_of(rng, (3, 3)), rows=3)


def test_bad_options_are_refused(rng, tmp_path):
    weights = weights_of(rng, (2, 3, 3))
    with pytest.raises(ValueError, match="colormap"):
        qkv.heatmap(weights, colormap="jet")
    with pytest.raises(ValueError, match="head"):
        qkv.heatmap(weights, head=2)
    with pytest.raises(qkv.ShapeError, match="weights: expected dtype float32 or float64, got int64"):
        qkv.heatmap(np.ones((3, 3), np.int64))
    with pytest.raises(OSError):
        qkv.heatmap(weights, path=tmp_path / "missing" / "a.png")
