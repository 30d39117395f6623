"""qkv: attention, from the textbook formula to a fast CPU kernel, on numpy arrays.

    import numpy as np, qkv
    q, k, v = (np.random.randn(8, 128, 64).astype(np.float32) for _ in range(3))  # [H, T, D]
    out = qkv.attention(q, k, v, causal=True)                                      # [H, T, D]
    out, weights = qkv.attention(q, k, v, return_weights=True)
    qkv.heatmap(weights[0], path="head0.png")

Shapes follow one vocabulary: B batch, H heads, Tq queries, Tk keys, Dk and Dv feature widths;
q [B, H, Tq, Dk], k [B, Hkv, Tk, Dk], v [B, Hkv, Tk, Dv] (B, or B and H, may be left out; Hkv
divides H, and is H but for grouped-query attention).
float32 runs the fused kernel, float64 the float64 reference; float16, bfloat16 (bits in uint16,
bf16=True) and int8 (with k_scales, v_scales; quantize_int8) operands run it too, with float32
outputs, and qkv.KvCache keeps a decoder's keys and values in those types. qkv.torch adapts all
of it to PyTorch tensors and autograd. Errors are ValueError (qkv.Error, qkv.ShapeError), MemoryError
(qkv.ResourceError) and OSError (qkv.FileError).
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from ._qkv import (
    Error,
    FileError,
    KvCache,
    ResourceError,
    SelfAttention,
    ShapeError,
    __version__,
    _format_for_path,
    _render_explorer,
    _render_heatmap,
    _time_fused_forward,
    _write_file_atomically,
    additive_attention,
    additive_attention_backward,
    alibi_slopes,
    attention,
    attention_backward,
    attention_bf16_products,
    attention_bf16_tiles,
    cpu_summary,
    default_scale,
    get_num_threads,
    set_num_threads,
    simd_target,
    simd_targets,
    use_simd_target,
)
from . import _qkv
from ._batch import _backward, _forward

# Any number of batch dims before the heads, as torch takes them (qkv/_batch.py).
attention = _forward(attention)
additive_attention = _forward(additive_attention)
attention_backward = _backward(attention_backward, weight_count=0)
additive_attention_backward = _backward(additive_attention_backward, weight_count=3)



# The conversions work on qkv's tensors of rank 4 at most; past that, the leading dims are one.
@functools.wraps(_qkv.quantize_int8)
def quantize_int8(x, group: str = "channel"):
    x = np.asarray(x)
    if x.ndim <= 4:
        return _qkv.quantize_int8(x, group)
    values, scales = _qkv.quantize_int8(x.reshape((-1, *x.shape[-2:])), group)
    lead = (1,) * (x.ndim - 2) if group == "tensor" else x.shape[:-2]
    return values.reshape(x.shape), scales.reshape((*lead, *scales.shape[-2:]))


@functools.wraps(_qkv.to_bfloat16)
def to_bfloat16(x):
    x = np.asarray(x)
    return _qkv.to_bfloat16(x.reshape(-1)).reshape(x.shape) if x.ndim > 4 else _qkv.to_bfloat16(x)


@functools.wraps(_qkv.from_bfloat16)
def from_bfloat16(bits):
    bits = np.asarray(bits)
    return _qkv.from_bfloat16(bits.reshape(-1)).reshape(bits.shape) if bits.ndim > 4 else _qkv.from_bfloat16(bits)


__all__ = [
    "Error", "FileError", "Heatmap", "KvCache", "ResourceError", "SelfAttention", "ShapeError", "__version__",
    "additive_attention", "additive_attention_backward", "alibi_slopes", "attention", "attention_backward",
    "attention_bf16_products", "attention_bf16_tiles", "cpu_summary", "default_scale", "explore", "from_bfloat16",
    "get_num_threads", "heatmap", "quantize_int8", "set_num_threads", "simd_target", "simd_targets", "to_bfloat16",
    "use_simd_target",
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


# Rows of a float16 or bfloat16 softmax, widened, are off 1 by a few of their ε; beyond this they are
# not attention weights (as `qkv explore` takes them).
_ROW_SUM_TOLERANCE = 0.01


def explore(attention, tokens: Union[None, str, Sequence[str]] = None,
            key_tokens: Union[None, str, Sequence[str]] = None, path: Union[None, str, os.PathLike] = None, *,
            layer_names: Union[None, str, Sequence[str]] = None, batch: int = 0, title: str = "",
            colormap: str = "viridis", view: str = "grid", select_rows: Optional[Sequence[int]] = None,
            panel_scale: str = "own") -> bytes:
    """A whole model's attention as the explorer page of `qkv explore` (every layer and head, head and
    matrix views, selections, rollout, per-head entropy and distance), or as an image.

    attention: [L, H, Tq, Tk], [L, B, H, Tq, Tk] (batch picks the entry), or a sequence of one
        [H, Tq, Tk] or [B, H, Tq, Tk] array per layer, as a model's output_attentions gives them
        (torch tensors too). Weights finite, >= 0, and each row summing to 1 within 0.01 (or all 0).
    tokens: labels of the queries and, unless key_tokens is given, of the keys.
    path: when given, the bytes are also written there whole or not at all: .html for the page,
        .png, .svg or .pdf for an image of `view` ("grid", "mean" or "rollout"); with select_rows,
        the mean of those queries' rows of the view, a row per panel. panel_scale "own" colours each
        panel (or row) by its own largest value, given in its caption, as the page's model view does;
        "shared" puts all on one scale. The page ignores it.

    Returns the page's (or the image's) bytes; the page's format when no path is given.
    """
    import numpy as np

    if isinstance(attention, (list, tuple)):
        layers = [np.asarray(layer.detach().cpu() if hasattr(layer, "detach") else layer) for layer in attention]
        for k, layer in enumerate(layers):
            if layer.ndim == 4:
                if not 0 <= batch < layer.shape[0]:
                    raise ShapeError(f"batch: expected 0 to {layer.shape[0] - 1} (B of layer {k} "
                                     f"{list(layer.shape)}), got {batch}")
                layers[k] = layer[batch]
            elif layer.ndim != 3:
                raise ShapeError(f"attention: expected layer {k} [H, Tq, Tk] or [B, H, Tq, Tk], got "
                                 f"{list(layer.shape)}")
            if layers[k].shape != layers[0].shape:
                raise ShapeError(f"attention: expected layer {k} of the shape of layer 0, {list(layers[0].shape)}, "
                                 f"got {list(layers[k].shape)}")
        weights = np.stack(layers)
    else:
        weights = np.asarray(attention)
        if weights.ndim == 5:
            if not 0 <= batch < weights.shape[1]:
                raise ShapeError(f"batch: expected 0 to {weights.shape[1] - 1} (B of attention "
                                 f"{list(weights.shape)}), got {batch}")
            weights = weights[:, batch]
    if weights.ndim != 4:
        raise ShapeError(f"attention: expected [L, H, Tq, Tk], [L, B, H, Tq, Tk] or a sequence of layers, got "
                         f"{list(weights.shape)}")
    if weights.dtype not in (np.float32, np.float64):
        raise ShapeError(f"attention: expected float32 or float64, got {weights.dtype}")
    bad = ~np.isfinite(weights) | (weights < 0)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"attention: expected finite weights >= 0, got {weights[at]} at [layer, head, query, key] = "
                         f"{list(at)}")
    sums = weights.astype(np.float64).sum(axis=-1)
    off = (sums != 0) & (np.abs(sums - 1) > _ROW_SUM_TOLERANCE)
    if off.any():
        at = tuple(int(i) for i in np.argwhere(off)[0])
        raise ValueError(f"attention: expected every row to sum to 1 within {_ROW_SUM_TOLERANCE} (or to 0), got "
                         f"{sums[at]:.6g} in row [layer, head, query] = {list(at)}")
    queries = _labels(tokens, "tokens")
    keys = _labels(key_tokens, "key_tokens") if key_tokens is not None else list(queries)
    tq, tk = weights.shape[2], weights.shape[3]
    if queries and len(queries) != tq:
        raise ShapeError(f"tokens: expected {tq} tokens (one per query of attention {list(weights.shape)}), "
                         f"got {len(queries)}")
    if keys and len(keys) != tk:
        raise ShapeError(f"key_tokens: expected {tk} tokens (one per key of attention {list(weights.shape)}), "
                         f"got {len(keys)}" + ("; give key_tokens for cross-attention" if key_tokens is None else ""))
    names = _labels(layer_names, "layer_names")
    if names and len(names) != weights.shape[0]:
        raise ShapeError(f"layer_names: expected {weights.shape[0]} names (one per layer), got {len(names)}")
    options = {"layer_names": names, "tokens": queries, "key_tokens": keys, "title": title, "colormap": colormap,
               "panel_scale": panel_scale,
               "source": f"qkv.explore of [{', '.join(str(d) for d in weights.shape)}]"}
    fmt = _format_for_path(os.fspath(path)) if path is not None else "html"
    rows = sorted({int(i) for i in select_rows}) if select_rows is not None else None
    if rows is not None and (not rows or rows[0] < 0 or rows[-1] >= tq):
        raise ValueError(f"select_rows: expected query indices from 0 to {tq - 1}, got {list(select_rows)}")
    page = _render_explorer(np.ascontiguousarray(weights, dtype=np.float32), options, fmt, view, rows)
    if path is not None:
        _write_file_atomically(os.fspath(path), page)
    return page
