"""qkv.additive_attention and its backward against a wide numpy reference, and the backward's
reference itself against central differences."""

import numpy as np
import pytest

import qkv
from conftest import WIDE, assert_close, randn

LEADS = [(), (3,), (2, 3)]


def additive_problem(rng, lead, tq, tk, dq, dk, dv, hidden, dtype):
    """q, k, v, w_q [A, Dq], w_k [A, Dk], w [A]."""
    return (randn(rng, (*lead, tq, dq), dtype), randn(rng, (*lead, tk, dk), dtype), randn(rng, (*lead, tk, dv), dtype),
            randn(rng, (hidden, dq), dtype) / 2, randn(rng, (hidden, dk), dtype) / 2, randn(rng, hidden, dtype))


def additive_reference(q, k, v, w_q, w_k, w, *, causal=False, mask=None, dtype=WIDE):
    """(out, lse, weights, tanh terms u [.., Tq, Tk, A]) with e_ij = w . tanh(w_q q_i + w_k k_j) + bias_ij."""
    q, k, v, w_q, w_k, w = (np.asarray(x, dtype=dtype) for x in (q, k, v, w_q, w_k, w))
    tq, tk = q.shape[-2], k.shape[-2]
    u = np.tanh((q @ w_q.T)[..., :, None, :] + (k @ w_k.T)[..., None, :, :])
    scores = u @ w
    allowed = np.ones((tq, tk), dtype=bool)
    if causal:
        i, j = np.indices((tq, tk))
        allowed = j <= i + tk - tq
    if mask is not None and np.issubdtype(mask.dtype, np.floating):
        scores = scores + mask.astype(dtype)
    elif mask is not None:
        allowed = allowed & (mask != 0)
    allowed = allowed & (scores > -np.inf)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    seen = np.isfinite(row_max)
    exps = np.where(allowed, np.exp(scores - np.where(seen, row_max, 0)), 0)
    row_sum = exps.sum(axis=-1, keepdims=True)
    weights = np.where(seen, exps / np.where(seen, row_sum, 1), 0)
    lse = np.where(seen, row_max + np.log(np.where(seen, row_sum, 1)), -np.inf)[..., 0]
    return weights @ v, lse, weights, u


def additive_backward_reference(q, k, v, w_q, w_k, w, dout, *, causal=False, mask=None, dtype=WIDE):
    """(dq, dk, dv, dw_q, dw_k, dw) of L = sum(dout * out).

    With P the weights: dv = P^T dout, de = P * (dP - rowsum(dP * P)) where dP = dout v^T;
    dpre_ija = de_ij w_a (1 - u_ija^2); dq = (sum_j dpre) w_q, dk = (sum_i dpre) w_k,
    dw_q = sum over batch of (sum_j dpre)^T q, likewise dw_k, dw = sum de_ij u_ij.
    """
    _, _, p, u = additive_reference(q, k, v, w_q, w_k, w, causal=causal, mask=mask, dtype=dtype)
    q, k, v, w_q, w_k, w, dout = (np.asarray(x, dtype=dtype) for x in (q, k, v, w_q, w_k, w, dout))
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    de = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dpre = de[..., None] * w * (1 - u * u)
    da, db = dpre.sum(axis=-2), dpre.sum(axis=-3)  # [.., Tq, A], [.., Tk, A]
    batch_axes = tuple(range(q.ndim - 2))
    dw_q = (np.swapaxes(da, -1, -2) @ q).sum(axis=batch_axes)
    dw_k = (np.swapaxes(db, -1, -2) @ k).sum(axis=batch_axes)
    dw = (de[..., None] * u).sum(axis=tuple(range(u.ndim - 1)))
    return da @ w_q, db @ w_k, dv, dw_q, dw_k, dw


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("tq,tk,dq,dk,dv,hidden", [(1, 1, 1, 1, 1, 1), (5, 7, 4, 3, 2, 6), (9, 4, 3, 5, 7, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(rng, dtype, lead, tq, tk, dq, dk, dv, hidden, causal):
    args = additive_problem(rng, lead, tq, tk, dq, dk, dv, hidden, dtype)
    result = qkv.additive_attention(*args, causal=causal, return_lse=True, return_weights=True)
    expected = additive_reference(*args, causal=causal)
    naive = additive_reference(*args, causal=causal, dtype=dtype)
    for name, actual, wide, plain in zip(("out", "lse", "weights"), result, expected, naive):
        assert actual.dtype == dtype
        assert_close(actual, wide, plain, what=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bias"])
def test_backward_matches_reference(rng, dtype, lead, causal, mask_kind):
    args = additive_problem(rng, lead, 6, 8, 4, 3, 5, 7, dtype)
    mask = {"none": None, "bool": rng.random((6, 8)) < 0.7, "bias": randn(rng, (6, 8), dtype)}[mask_kind]
    dout = randn(rng, (*lead, 6, 5), dtype)
    grads = qkv.additive_attention_backward(*args, dout, causal=causal, mask=mask)
    expected = additive_backward_reference(*args, dout, causal=causal, mask=mask)
    naive = additive_backward_reference(*args, dout, causal=causal, mask=mask, dtype=dtype)
    names = ("dq", "dk", "dv", "dw_q", "dw_k", "dw")
    assert len(grads) == (7 if mask_kind == "bias" else 6)
    for name, actual, wide, plain, arg in zip(names, grads, expected, naive, args):
        assert actual.shape == arg.shape and actual.dtype == dtype
        assert_close(actual, wide, plain, what=name)


def test_backward_reference_against_central_differences(rng):
    # L(x) = sum(dout * out(x)); its derivative along a random direction of every argument.
    args = additive_problem(rng, (2,), 4, 5, 3, 2, 3, 4, np.float64)
    dout = randn(rng, (2, 4, 3), np.float64)
    grads = additive_backward_reference(*args, dout, causal=True, dtype=np.float64)
    h = 1e-6
    for index, (arg, grad) in enumerate(zip(args, grads)):
        direction = randn(rng, arg.shape, np.float64)

        def loss(step):
            moved = list(args)
            moved[index] = arg + step * direction
            return np.sum(dout * additive_reference(*moved, causal=True, dtype=np.float64)[0])

        numeric = (loss(h) - loss(-h)) / (2 * h)
        assert np.isclose(np.sum(grad * direction), numeric, rtol=1e-6, atol=1e-8), index


def test_fully_masked_row_gives_zero(rng):
    args = additive_problem(rng, (), 3, 4, 2, 2, 2, 3, np.float32)
    mask = np.ones((3, 4), dtype=bool)
    mask[0] = False
    out, lse = qkv.additive_attention(*args, mask=mask, return_lse=True)
    assert np.all(out[0] == 0) and lse[0] == -np.inf
    grads = qkv.additive_attention_backward(*args, np.ones_like(out), mask=mask)
    assert all(np.isfinite(g).all() for g in grads) and np.all(grads[0][0] == 0)


def test_bias_gradient(rng):
    args = additive_problem(rng, (2,), 4, 5, 3, 3, 3, 4, np.float64)
    bias = randn(rng, (1, 4, 5), np.float64)
    dout = randn(rng, (2, 4, 3), np.float64)
    dbias = qkv.additive_attention_backward(*args, dout, mask=bias)[6]
    assert dbias.shape == bias.shape
    h = 1e-6
    direction = randn(rng, bias.shape, np.float64)

    def loss(step):
        return np.sum(dout * qkv.additive_attention(*args, mask=bias + step * direction))

    numeric = (loss(h) - loss(-h)) / (2 * h)
    assert np.isclose(np.sum(dbias * direction), numeric, rtol=1e-6)
