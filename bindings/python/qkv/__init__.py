"""qkv: attention, from the textbook formula to a fast CPU kernel, on numpy arrays.

    import numpy as np, qkv
    q, k, v = (np.random.randn(8, 128, 64).astype(np.float32) for _ in range(3))  # [H, T, D]
    out = qkv.attention(q, k, v, causal=True)                                      # [H, T, D]
    out, weights = qkv.attention(q, k, v, return_weights=True)
    qkv.heatmap(weights[0], path="head0.png")

Shapes follow one vocabulary: B batch, H heads, Tq queries, Tk keys, Dk and Dv feature widths;
q [B, H, Tq, Dk], k [B, Hkv, Tk, Dk], v [B, Hkv, Tk, Dv] (B, or B and H, may be left out; Hkv
divides H, and is H but for grouped-query attention).
float32 runs the fused kernel, float64 the float64 reference. qkv.torch adapts all of it to
PyTorch tensors and autograd. Errors are ValueError (qkv.Error, qkv.ShapeError), MemoryError
(qkv.ResourceError) and OSError (qkv.FileError).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple, Union

from ._qkv import (
    Error,
    FileError,
    ResourceError,
    SelfAttention,
    ShapeError,
    __version__,
    _format_for_path,
    _render_heatmap,
    _time_fused_forward,
    _write_file_atomically,
    additive_attention,
    additive_attention_backward,
    alibi_slopes,
    attention,
    attention_backward,
    cpu_summary,
    default_scale,
    get_num_threads,
    set_num_threads,
    simd_target,
    simd_targets,
    use_simd_target,
)
from ._batch import _backward, _forward

# Any number of batch dims before the heads, as torch takes them (qkv/_batch.py).
attention = _forward(attention)
additive_attention = _forward(additive_attention)
attention_backward = _backward(attention_backward, weight_count=0)
additive_attention_backward = _backward(additive_attention_backward, weight_count=3)

__all__ = [
    "Error", "FileError", "Heatmap", "ResourceError", "SelfAttention", "ShapeError", "__version__",
    "additive_attention", "additive_attention_backward", "alibi_slopes", "attention", "attention_backward",
    "cpu_summary", "default_scale", "get_num_threads", "heatmap", "set_num_threads", "simd_target",
    "simd_targets", "use_simd_target",
]

# Notebooks show a heatmap as SVG (sharp, with a tooltip per cell) while it stays small; beyond
# this many cells as PNG, whose size does not grow with the cell count.
_SVG_MAX_CELLS = 64 * 64


def _labels(labels: Union[None, str, Sequence[str]], what: str) -> list:
    if labels is None:
        return []
    if isinstance(labels, str):
        return labels.split()
    try:
        return [str(label) for label in labels]
    except TypeError:
        raise ShapeError(f"{what}: expected None, a string of labels separated by spaces or a sequence of "
                         f"strings, got {type(labels).__name__}") from None


class Heatmap:
    """An attention matrix drawn as an image: what qkv.heatmap returns.

    A notebook shows it inline (SVG, or PNG for large matrices). png(), svg(), pdf(), html() and
    text() return the drawing in that format (bytes; text() a str for the terminal), and
    save(path) writes one file, chosen by its extension (.png, .svg, .pdf, .html), whole or not
    at all.
    """

    def __init__(self, weights, options: dict):
        shape = getattr(weights, "shape", None)
        if shape is not None and len(shape) >= 2:
            for key, count, axis in (("rows", shape[-2], "query"), ("cols", shape[-1], "key")):
                given = len(options[key])
                if given and given != count:
                    raise ShapeError(f"{key}: expected {count} labels (one per {axis} of weights "
                                     f"{list(shape)}), got {given}")
        self._weights = weights
        self._options = options
        _render_heatmap(weights, "png", options, check_only=True)

    def _render(self, fmt: str) -> bytes:
        return _render_heatmap(self._weights, fmt, self._options)

    def png(self) -> bytes:
        return self._render("png")

    def svg(self) -> bytes:
        return self._render("svg")

    def pdf(self) -> bytes:
        return self._render("pdf")

    def html(self) -> bytes:
        """One self-contained interactive page: matrix and token views, values on hover."""
        return self._render("html")

    def text(self, color: bool = False) -> str:
        """The terminal drawing: shades " ░▒▓█" (or 24-bit colours with color=True)."""
        options = dict(self._options, color=color)
        return _render_heatmap(self._weights, "terminal", options).decode("utf-8")

    def save(self, path: Union[str, os.PathLike]) -> "Heatmap":
        path = os.fspath(path)
        _write_file_atomically(path, self._render(_format_for_path(path)))
        return self

    def _cells(self) -> int:
        shape = getattr(self._weights, "shape", ())
        heads = 1
        if len(shape) >= 3 and self._options["head"] is None:
            heads = shape[-3]
        return heads * (shape[-2] * shape[-1] if len(shape) >= 2 else 0)

    def _repr_mimebundle_(self, include=None, exclude=None):
        if self._cells() <= _SVG_MAX_CELLS:
            return {"image/svg+xml": self.svg().decode("utf-8")}
        return {"image/png": self.png()}

    def __repr__(self) -> str:
        return self.text()


def heatmap(weights, rows: Union[None, str, Sequence[str]] = None, cols: Union[None, str, Sequence[str]] = None,
            path: Union[None, str, os.PathLike] = None, *, title: str = "", colormap: str = "viridis",
            vmin: Optional[float] = None, vmax: Optional[float] = None, annotate: bool = False, batch: int = 0,
            head: Optional[int] = None, marked: Sequence[Tuple[int, int]] = (), decimals: int = 3, mask=None,
            scale: str = "linear") -> Heatmap:
    """Draws attention weights: rows are queries, columns keys ("who looks at whom").

    weights: [Tq, Tk], [H, Tq, Tk] or [B, H, Tq, Tk] (what attention(..., return_weights=True)
        gives), float32 or float64. One batch entry is drawn (batch); one head (head) or, when
        head is None, every head side by side on one colour scale.
    rows, cols: one label per query and per key (a list of str, or one str split at spaces);
        None numbers them from 0. CJK labels draw with fonts-noto-cjk.
    path: when given, the drawing is also written there, in the format its extension names
        (.png, .svg, .pdf, .html), whole or not at all.
    title, colormap ("viridis", "magma", "gray"; "coolwarm", diverging, for signed matrices such as
    scores or gradients, centres the scale on 0), vmin/vmax (the ends of the colour scale),
    annotate (print each cell's value), marked (cells (i, j) to outline), decimals (of the
    terminal's values) as for `qkv heatmap` on the command line.
    mask: which keys each query may see, as attention's mask= takes it (bool or integer, nonzero =
        may attend, broadcast to the weights' shape): the other cells are drawn as masked (hatched
        grey, '·' in the terminal), with no value and no part in the colour scale.
    scale: "linear", "sqrt" or "log" (three decades below vmax): how a weight maps to a colour;
        sqrt and log show small weights beside a few large ones.

    Returns a Heatmap, which a notebook shows inline.
    """
    options = {
        "rows": _labels(rows, "rows"), "cols": _labels(cols, "cols"), "title": title, "colormap": colormap,
        "vmin": vmin, "vmax": vmax, "annotate": annotate, "batch": batch, "head": head,
        "marked": [tuple(cell) for cell in marked], "color": False, "decimals": decimals, "mask": mask,
        "scale": scale,
    }
    drawing = Heatmap(weights, options)
    if path is not None:
        drawing.save(path)
    return drawing
