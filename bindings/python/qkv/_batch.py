"""Leading dims beyond the two that qkv's kernels take ([B, H, T, D]), as torch reads `...`.

q of shape [L1, ..., Ln, H, Tq, Dk] with n >= 2 runs as one batch of L1*...*Ln: k, v, dout, out and
lse must have the same batch dims, a mask broadcasts to [L1, ..., Ln, H, Tq, Tk], and every
result comes back with L1, ..., Ln again. A mask whose batch dims are all 1 or all L_i is reshaped
(no copy); one that mixes them is copied to every batch entry, and its gradient summed back.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ._qkv import ShapeError

_KERNEL_RANK = 4


def _dims(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class _Batch:
    def __init__(self, q):
        self.dims = tuple(q.shape[:-3])
        self.count = math.prod(self.dims)

    def flatten(self, array, name: str, meaning: str, trailing: int = 3):
        array = np.asarray(array)
        n = len(self.dims)
        if array.ndim != n + trailing or tuple(array.shape[:n]) != self.dims:
            raise ShapeError(f"{name}: expected the batch dims {_dims(self.dims)} of q, then {meaning}, got shape "
                             f"{_dims(array.shape)}")
        return array.reshape((self.count, *array.shape[n:]))

    def restore(self, array):
        return array.reshape((*self.dims, *array.shape[1:]))

    def flatten_scales(self, scales, name: str):
        """An int8 operand's scales, whose batch dims may be 1 where they broadcast, flattened as the operand."""
        scales = np.asarray(scales)
        n = len(self.dims)
        if scales.ndim < n + 3:
            # Broadcast from the right, as the kernels read scales of fewer dims.
            scales = scales.reshape((1,) * (n + 3 - scales.ndim) + scales.shape)
        own = tuple(scales.shape[:n])
        if scales.ndim != n + 3 or any(o not in (1, d) for o, d in zip(own, self.dims)):
            raise ShapeError(f"{name}: expected the batch dims {_dims(self.dims)} of q (or 1s), then [Hkv, Tk or 1, "
                             f"D or 1], got shape {_dims(np.shape(scales))}")
        rest = tuple(scales.shape[n:])
        return np.broadcast_to(scales, (*self.dims, *rest)).reshape((self.count, *rest))

    def flatten_mask(self, mask, scores):
        """(the mask as the kernels take it, its batch dims as given or None when they were left as they are,
        whether it was copied to every batch entry)."""
        mask = np.asarray(mask)
        n = len(self.dims)
        if mask.ndim > n + 3:
            raise ShapeError(f"mask: expected a shape that broadcasts to the scores [..., H, Tq, Tk] = "
                             f"{_dims(scores)}, got {_dims(mask.shape)}")
        if mask.ndim <= 3:
            return mask, None, False
        own = (1,) * (n + 3 - mask.ndim) + tuple(mask.shape[:-3])
        if any(o not in (1, d) for o, d in zip(own, self.dims)):
            raise ShapeError(f"mask: expected a shape that broadcasts to the scores [..., H, Tq, Tk] = "
                             f"{_dims(scores)}, got {_dims(mask.shape)}")
        rest = tuple(mask.shape[-3:])
        if all(o == 1 for o in own):
            return mask.reshape((1, *rest)), own, False
        if own == self.dims:
            return mask.reshape((self.count, *rest)), own, False
        full = np.broadcast_to(mask.reshape((*own, *rest)), (*self.dims, *rest))
        return np.ascontiguousarray(full).reshape((self.count, *rest)), own, True

    def mask_gradient(self, gradient, mask_shape, own, expanded):
        """dbias in the mask's own shape."""
        if expanded:
            full = gradient.reshape((*self.dims, *gradient.shape[1:]))
            axes = tuple(i for i, o in enumerate(own) if o == 1)
            gradient = full.sum(axis=axes, keepdims=True)
        return gradient.reshape(mask_shape)


def _has_batch(q, k, v, kw) -> bool:
    """Whether q has batch dims; refuses, in the words of any rank, what has too few dims or a mask with more dims
    than the scores (the kernels' own messages speak of their ranks 2 to 4)."""
    ranks = [np.ndim(x) for x in (q, k, v)]
    for name, x, rank, meaning in zip("qkv", (q, k, v), ranks, ("[..., Tq, Dk]", "[..., Tk, Dk]", "[..., Tk, Dv]")):
        if rank < 2 and np.asarray(x).dtype.kind == "f":
            raise ShapeError(f"{name}: expected rank 2 or more ({meaning}), got shape {_dims(np.shape(x))}")
    mask = kw.get("mask")
    if mask is not None and ranks[0] >= 2 and np.ndim(mask) > max(ranks[0], _KERNEL_RANK):
        scores = (*np.shape(q)[:-1], np.shape(k)[-2] if ranks[1] >= 2 else 0)
        raise ShapeError(f"mask: expected a shape that broadcasts to the scores [..., H, Tq, Tk] = {_dims(scores)}, "
                         f"got {_dims(np.shape(mask))}")
    return ranks[0] > _KERNEL_RANK


def _scores(batch: _Batch, q, k) -> tuple:
    return (*batch.dims, q.shape[-3], q.shape[-2], k.shape[-2])


def _prepare(q, k, v, kw):
    """Flattens q, k, v and, among the keywords kw, the mask, dout, out and lse for the kernels; returns the batch,
    the flat q, k and v, and what dbias needs to be shaped as the mask."""
    q = np.asarray(q)
    batch = _Batch(q)
    k = np.asarray(k)
    scores = _scores(batch, q, k)
    flat = [batch.flatten(q, "q", "[H, Tq, Dk]"), batch.flatten(k, "k", "[Hkv, Tk, Dk]"),
            batch.flatten(v, "v", "[Hkv, Tk, Dv]")]
    for name, meaning, trailing in (("dout", "[H, Tq, Dv]", 3), ("out", "[H, Tq, Dv]", 3), ("lse", "[H, Tq]", 2)):
        if kw.get(name) is not None:
            kw[name] = batch.flatten(kw[name], name, meaning, trailing)
    for name in ("k_scales", "v_scales"):
        if kw.get(name) is not None:
            kw[name] = batch.flatten_scales(kw[name], name)
    mask_info = None
    if kw.get("mask") is not None:
        mask = np.asarray(kw["mask"])
        kw["mask"], own, expanded = batch.flatten_mask(mask, scores)
        mask_info = (mask.shape, own, expanded, np.issubdtype(mask.dtype, np.floating))
    return batch, flat, mask_info


def _forward(function):
    """attention or additive_attention taking any number of batch dims."""

    @functools.wraps(function)
    def call(q, k, v, *weights, **kw):
        if not _has_batch(q, k, v, kw):
            return function(q, k, v, *weights, **kw)
        batch, flat, _ = _prepare(q, k, v, kw)
        result = function(*flat, *weights, **kw)
        if isinstance(result, tuple):
            return tuple(batch.restore(r) for r in result)
        return batch.restore(result)

    return call


def _backward(function, weight_count: int):
    """attention_backward or additive_attention_backward taking any number of batch dims: dq, dk and dv come back
    with the batch, dbias in the mask's shape, the weights' and the sinks' gradients as they are."""

    @functools.wraps(function)
    def call(q, k, v, *rest, **kw):
        if not _has_batch(q, k, v, kw):
            return function(q, k, v, *rest, **kw)
        rest = list(rest)
        if len(rest) > weight_count:
            kw["dout"] = rest.pop(weight_count)
        batch, flat, mask_info = _prepare(q, k, v, kw)
        grads = list(function(*flat, *rest, **kw))
        grads[:3] = [batch.restore(g) for g in grads[:3]]
        if mask_info is not None and mask_info[3]:
            shape, own, expanded, _ = mask_info
            at = 3 + weight_count
            grads[at] = grads[at] if own is None else batch.mask_gradient(grads[at], shape, own, expanded)
        return tuple(grads)

    return call
