"""Shared helpers of qkv's Python tests: seeded random arrays, a plain numpy reference of attention
(forward and backward, any dtype) and the suite's tolerance rule.

Shapes follow qkv's vocabulary: q [..., Tq, Dk], k [..., Tk, Dk], v [..., Tk, Dv], mask
broadcastable to [..., Tq, Tk]; the leading dims (0 to 2 of them: B, H) are the same for q, k, v.
"""

from __future__ import annotations

import numpy as np
import pytest

# Wider than float64 on x86 (80-bit extended), so that a float64 result's own rounding error is
# measurable against it; where longdouble is float64 the tolerance floor alone carries the rule.
WIDE = np.longdouble


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A Generator seeded from the test's name: each test draws the same numbers on every run."""
    seed = sum(request.node.name.encode())
    return np.random.default_rng(seed)


def randn(rng: np.random.Generator, shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def qkv_arrays(rng, lead=(2,), tq=5, tk=7, dk=4, dv=None, dtype=np.float32):
    """q [*lead, tq, dk], k [*lead, tk, dk], v [*lead, tk, dv] of standard normals."""
    dv = dk if dv is None else dv
    return (randn(rng, (*lead, tq, dk), dtype), randn(rng, (*lead, tk, dk), dtype),
            randn(rng, (*lead, tk, dv), dtype))


def allowed_of(tq: int, tk: int, causal: bool, mask) -> np.ndarray:
    """[..., Tq, Tk] bool: which keys each query may attend to (qkv's bottom-right causal rule)."""
    allowed = np.ones((tq, tk), dtype=bool)
    if causal:
        i, j = np.indices((tq, tk))
        allowed = j <= i + tk - tq
    if mask is not None and not np.issubdtype(np.asarray(mask).dtype, np.floating):
        allowed = allowed & (np.asarray(mask) != 0)
    return allowed


def attention_reference(q, k, v, *, scale=None, causal=False, mask=None, dtype=WIDE):
    """(out, lse, weights) of softmax(scale * q k^T + bias) v, every step in `dtype`.

    A query that sees no key gets out 0, lse -inf and a weights row of 0, as qkv promises.
    """
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * dtype(scale)
    if mask is not None and np.issubdtype(np.asarray(mask).dtype, np.floating):
        scores = scores + np.asarray(mask, dtype=dtype)
    allowed = allowed_of(tq, tk, causal, mask) & (scores > -np.inf)
    scores = np.where(allowed, scores, -np.inf)
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    exps = np.where(allowed, np.exp(scores - np.where(np.isfinite(row_max), row_max, 0)), 0)
    row_sum = exps.sum(axis=-1, keepdims=True)
    seen = row_sum > 0
    weights = np.where(seen, exps / np.where(seen, row_sum, 1), 0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, row_max + np.log(np.where(seen, row_sum, 1)), -np.inf)[..., 0]
    return np.matmul(weights, v), lse, weights


def sum_to_shape(x: np.ndarray, shape) -> np.ndarray:
    """x summed over the dims along which an array of `shape` was broadcast to x's shape."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead)))
    axes = tuple(axis for axis, n in enumerate(shape) if n == 1 and x.shape[axis] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def attention_backward_reference(q, k, v, dout, *, scale=None, causal=False, mask=None, dtype=WIDE):
    """(dq, dk, dv, dbias) of L = sum(dout * out), in `dtype`; dbias None unless mask is a float bias.

    With P the weights and S the scaled scores: dv = P^T dout, dP = dout v^T,
    dS = P * (dP - rowsum(dP * P)), dq = scale dS k, dk = scale dS^T q, dbias = dS.
    """
    _, _, p = attention_reference(q, k, v, scale=scale, causal=causal, mask=mask, dtype=dtype)
    q, k, v, dout = (np.asarray(x, dtype=dtype) for x in (q, k, v, dout))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    dv = np.matmul(np.swapaxes(p, -1, -2), dout)
    dp = np.matmul(dout, np.swapaxes(v, -1, -2))
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = np.matmul(ds, k) * dtype(scale)
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * dtype(scale)
    dbias = None
    if mask is not None and np.issubdtype(np.asarray(mask).dtype, np.floating):
        dbias = sum_to_shape(ds, np.shape(mask))
    return dq, dk, dv, dbias


def max_error(actual, expected) -> tuple:
    """(max abs error, mean abs error, index of the max) of actual against expected."""
    diff = np.abs(np.asarray(actual, dtype=WIDE) - np.asarray(expected, dtype=WIDE))
    if diff.size == 0:
        return 0.0, 0.0, ()
    worst = np.unravel_index(np.argmax(diff), diff.shape)
    return float(diff.max()), float(diff.mean()), tuple(int(i) for i in worst)


def assert_close(actual, expected, naive, *, what="result"):
    """The suite's tolerance rule: actual's max error against the wide `expected` is at most twice
    that of `naive` (the same maths computed plainly in actual's dtype) plus a floor of 8 ulps of
    actual's dtype at the output's scale, which covers outputs the naive path gets exactly right.
    """
    actual = np.asarray(actual)
    eps = np.finfo(actual.dtype).eps
    assert actual.shape == np.shape(expected), f"{what}: shape {actual.shape}, expected {np.shape(expected)}"
    expected = np.asarray(expected, dtype=WIDE)
    finite = np.isfinite(expected)
    assert np.array_equal(np.asarray(actual, dtype=WIDE)[~finite], expected[~finite]), \
        f"{what}: non-finite entries differ"
    actual, expected, naive = (np.where(finite, x, 0) for x in (actual, expected, np.asarray(naive, dtype=WIDE)))
    scale = float(np.abs(expected).max(initial=0)) or 1.0
    floor = 8 * eps * scale
    naive_err = max_error(naive, expected)[0]
    err, mean, worst = max_error(actual, expected)
    bound = 2 * naive_err + floor
    assert err <= bound, (f"{what}: max error {err:.3g} (mean {mean:.3g}, worst at {worst}) exceeds "
                          f"2 x naive {naive_err:.3g} + floor {floor:.3g}")


def assert_attention_matches(result, q, k, v, **kwargs):
    """What qkv.attention(q, k, v, **kwargs) returned, as (out,), (out, lse) or (out, lse, weights),
    against the reference; kwargs are attention()'s scale, causal and mask."""
    mask_kwargs = {key: kwargs[key] for key in ("scale", "causal", "mask") if key in kwargs}
    expected = attention_reference(q, k, v, **mask_kwargs)
    naive = attention_reference(q, k, v, dtype=q.dtype.type, **mask_kwargs)
    for name, actual, wide, plain in zip(("out", "lse", "weights"), result, expected, naive):
        assert actual.dtype == q.dtype, f"{name}: dtype {actual.dtype}, expected {q.dtype}"
        assert_close(actual, wide, plain, what=name)


def assert_gradients_match(grads, q, k, v, dout, **kwargs):
    """qkv.attention_backward's (dq, dk, dv[, dbias]) against the reference."""
    expected = attention_backward_reference(q, k, v, dout, **kwargs)
    naive = attention_backward_reference(q, k, v, dout, dtype=q.dtype.type, **kwargs)
    has_bias = expected[3] is not None
    assert len(grads) == (4 if has_bias else 3)
    for name, actual, wide, plain in zip(("dq", "dk", "dv", "dbias"), grads, expected, naive):
        assert actual.dtype == q.dtype, f"{name}: dtype {actual.dtype}, expected {q.dtype}"
        assert_close(actual, wide, plain, what=name)


def traced_peak(call) -> int:
    """The peak of the memory that numpy (and Python) allocate while call() runs, in bytes."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak - base


IMPLS_FLOAT32 = ("auto", "fused", "reference")
IMPLS_FLOAT64 = ("auto", "fused")  # auto is the reference for float64

# (dtype, impl) pairs every forward and backward test sweeps.
DTYPE_IMPLS = [(np.float32, impl) for impl in IMPLS_FLOAT32] + [(np.float64, impl) for impl in IMPLS_FLOAT64]
