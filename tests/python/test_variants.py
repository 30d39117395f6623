"""The attention variants (grouped-query heads, the window and the causal alignment, the softcap,
ALiBi, sinks) through qkv.attention, qkv.attention_backward and qkv.torch, against float64
PyTorch written out with plain tensor ops (torch 1.13 has none of them), on every SIMD target."""

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from conftest import assert_close

# Where the float64 kernels may differ from the float64 PyTorch maths: summation orders only,
# far below any semantic slip (which shows at 1e-3 and up).
TIGHT = 64 * np.finfo(np.float64).eps


def heads_of(x):
    return x.shape[-3] if x.ndim >= 3 else 1


def per_head(values, x):
    """[H] values shaped to broadcast over x's [..., H, Tq, Tk] (x of rank 2 has one head)."""
    return values.reshape((-1, 1, 1) if x.ndim >= 3 else (1, 1))


def reference(q, k, v, *, scale=None, causal=False, window=None, mask=None, softcap=None, alibi=None, sinks=None):
    """(out, lse, weights) in q's dtype, differentiable by autograd. causal as qkv.attention's."""
    heads, kv_heads = heads_of(q), heads_of(k)
    if kv_heads != heads:  # the reference copies K and V per query head; qkv never does
        k = k.repeat_interleave(heads // kv_heads, dim=-3)
        v = v.repeat_interleave(heads // kv_heads, dim=-3)
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    x = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    offset = 0 if causal == "top-left" else tk - tq
    rel = torch.arange(tk)[None, :] - torch.arange(tq)[:, None] - offset  # j - (i + o)
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        allowed = allowed & (rel <= 0)
    if window is not None:
        left, right = window
        if left >= 0:
            allowed = allowed & (rel >= -left)
        if right >= 0:
            allowed = allowed & (rel <= right)
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        x = x + mask
    if alibi is not None:
        x = x - per_head(alibi, x) * rel.abs().to(x.dtype)
    x = x.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        x = torch.cat([x, per_head(sinks, x).expand(*x.shape[:-1], 1)], dim=-1)
    row_max = x.max(dim=-1, keepdim=True).values
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    exps = torch.exp(x - row_max)
    total = exps.sum(dim=-1, keepdim=True)
    weights = exps / torch.where(total > 0, total, torch.ones_like(total))
    with torch.no_grad():
        lse = (row_max + torch.log(total))[..., 0]
    weights = weights[..., :tk]
    return weights @ v, lse, weights


def as_tensors(arrays, dtype, grad_names=()):
    """name -> tensor of `dtype` (bool and None stay), requiring grad for the names in grad_names."""
    tensors = {}
    for name, array in arrays.items():
        if array is None or isinstance(array, str):
            tensors[name] = array
        elif array.dtype == bool:
            tensors[name] = torch.from_numpy(array)
        else:
            tensors[name] = torch.from_numpy(np.asarray(array, np.float64)).to(dtype).requires_grad_(
                name in grad_names)
    return tensors


def reference_run(arrays, options, dout, dtype):
    """Forward and gradients of the reference in `dtype`: (out, lse, weights, grads), each as numpy;
    grads maps dq, dk, dv, dbias (a float mask) and dsinks (sinks) to their arrays."""
    names = ["q", "k", "v"] + [n for n in ("mask", "sinks") if arrays.get(n) is not None
                               and not (n == "mask" and arrays[n].dtype == bool)]
    t = as_tensors(arrays, dtype, names)
    kwargs = dict(options, mask=t.get("mask"), sinks=t.get("sinks"), alibi=t.get("alibi"))
    out, lse, weights = reference(t["q"], t["k"], t["v"], **kwargs)
    out.backward(torch.from_numpy(dout).to(dtype))
    grads = {"d" + ("bias" if n == "mask" else n): t[n].grad.numpy() for n in names}
    return out.detach().numpy(), lse.numpy(), weights.detach().numpy(), grads


def qkv_kwargs(arrays, options):
    return dict(options, mask=arrays.get("mask"), sinks=arrays.get("sinks"), alibi=arrays.get("alibi"))


def grads_by_name(result, arrays):
    names = ["dq", "dk", "dv"]
    if arrays.get("mask") is not None and arrays["mask"].dtype != bool:
        names.append("dbias")
    if arrays.get("sinks") is not None:
        names.append("dsinks")
    assert len(result) == len(names), f"attention_backward returned {len(result)} arrays, expected {names}"
    return dict(zip(names, result))


def assert_tight(actual, expected, *, what):
    """float64 against float64: the same non-finite entries, the rest within TIGHT of the scale."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    finite = np.isfinite(expected)
    assert np.array_equal(actual[~finite], expected[~finite]), f"{what}: non-finite entries differ"
    scale = max(1.0, float(np.abs(expected[finite]).max(initial=0)))
    err = float(np.abs(actual[finite] - expected[finite]).max(initial=0))
    assert err <= TIGHT * scale, f"{what}: max error {err:.3g} exceeds {TIGHT * scale:.3g}"


def with_every_target(check):
    """check(target) on every SIMD target this CPU runs, then the best one again."""
    try:
        for target in qkv.simd_targets():
            qkv.use_simd_target(target)
            check(target)
    finally:
        qkv.use_simd_target("")


def case_arrays(rng, *, lead=(2,), heads=3, kv_heads=None, tq=5, tk=7, dk=4, dv=3, q_scale=1.0, mask=None,
                sinks=False, alibi=None):
    """q [*lead, H, Tq, Dk], k and v with kv_heads heads, and the optional mask, sinks and alibi."""
    kv_heads = heads if kv_heads is None else kv_heads
    head_dims = (heads,) if heads else ()
    kv_dims = (kv_heads,) if heads else ()
    arrays = {
        "q": rng.standard_normal((*lead, *head_dims, tq, dk)) * q_scale,
        "k": rng.standard_normal((*lead, *kv_dims, tk, dk)),
        "v": rng.standard_normal((*lead, *kv_dims, tk, dv)),
    }
    allowed = rng.random((tq, tk)) < 0.75
    if mask == "bool":
        arrays["mask"] = allowed
    elif mask == "bias":
        arrays["mask"] = np.where(allowed, rng.standard_normal((tq, tk)), -np.inf)
    if sinks:
        arrays["sinks"] = rng.standard_normal(max(heads, 1))
    if alibi == "given":
        arrays["alibi"] = rng.random(max(heads, 1)) * 0.5
    elif alibi == "auto":
        arrays["alibi"] = "auto"
    return arrays


def cast(arrays, dtype):
    return {n: (a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype != bool else a) for n, a in arrays.items()}


def reference_arrays(arrays):
    """alibi="auto" as the slopes it stands for, for the reference."""
    if isinstance(arrays.get("alibi"), str):
        return dict(arrays, alibi=np.array(qkv.alibi_slopes(heads_of(arrays["q"]))))
    return arrays


# name -> (case_arrays arguments, qkv.attention keywords, where alibi is "auto" or "given": random
# slopes). Sizes stay small: every case runs on two dtypes, two implementations and every SIMD
# target, forward and backward.
CASES = {
    "gqa group 3": (dict(lead=(2,), heads=6, kv_heads=2), {}),
    "multi-query": (dict(lead=(1,), heads=4, kv_heads=1, tq=6, tk=6), {"causal": True}),
    "gqa rank 3": (dict(lead=(), heads=4, kv_heads=2), {}),
    "window": (dict(tq=9, tk=13), {"window": (3, 1)}),
    "window left only": (dict(tq=9, tk=13), {"window": (2, -1)}),
    "window right only": (dict(tq=13, tk=9), {"window": (-1, 1)}),
    "window causal bottom-right": (dict(tq=9, tk=13), {"window": (3, 2), "causal": "bottom-right"}),
    "window causal top-left": (dict(tq=9, tk=13), {"window": (2, 5), "causal": "top-left"}),
    "causal top-left, Tq > Tk": (dict(tq=13, tk=9), {"causal": "top-left"}),
    "window (0, 0)": (dict(tq=6, tk=9), {"window": (0, 0)}),
    "window beyond T": (dict(tq=6, tk=9), {"window": (100, 100)}),
    "softcap": (dict(q_scale=3.0), {"softcap": 2.0}),
    "softcap and bias": (dict(q_scale=3.0, mask="bias"), {"softcap": 1.5, "scale": 0.9}),
    "alibi auto": (dict(heads=6, tq=8, tk=8), {"alibi": "auto"}),
    "alibi given, KV cache": (dict(heads=3, tq=4, tk=11), {"alibi": "given", "causal": True}),
    "alibi top-left": (dict(heads=3, tq=4, tk=11), {"alibi": "auto", "causal": "top-left"}),
    "sinks": (dict(sinks=True), {}),
    "sinks, gqa, causal": (dict(heads=4, kv_heads=2, tq=7, tk=7, sinks=True), {"causal": True}),
    "sinks rank 2": (dict(lead=(), heads=0, sinks=True), {}),
    "T = 1, d = 1": (dict(heads=2, tq=1, tk=1, dk=1, dv=1, sinks=True), {"window": (0, 0), "softcap": 1.0}),
    "Tq = 67, Tk = 131": (dict(lead=(1,), heads=2, kv_heads=1, tq=67, tk=131, dk=9, dv=5, sinks=True),
                          {"window": (40, 3), "causal": True}),
    "everything": (dict(lead=(2,), heads=6, kv_heads=2, tq=11, tk=17, dk=5, dv=4, q_scale=2.0, mask="bias",
                        sinks=True),
                   {"causal": "top-left", "window": (6, -1), "softcap": 3.0, "scale": 0.6, "alibi": "given"}),
    "everything, bool mask": (dict(lead=(1,), heads=3, kv_heads=1, tq=17, tk=11, mask="bool", sinks=True),
                              {"causal": "bottom-right", "window": (4, 0), "softcap": 2.5, "alibi": "auto"}),
}
CASE_IDS = list(CASES)


def build_case(rng, name):
    shape_args, options = CASES[name]
    options = dict(options)
    alibi = options.pop("alibi", None)
    arrays = case_arrays(rng, alibi=alibi, **shape_args)
    return arrays, options


def dout_of(rng, arrays):
    return rng.standard_normal((*arrays["q"].shape[:-1], arrays["v"].shape[-1]))


def references(arrays, options, dout):
    """dtype -> (the float64 reference of the arrays rounded to dtype, the same maths in dtype)."""
    ref = reference_arrays(arrays)
    in_float32 = cast(ref, np.float32), options, dout.astype(np.float32)
    wide64 = reference_run(ref, options, dout, torch.float64)
    return {np.float32: (reference_run(*in_float32, torch.float64), reference_run(*in_float32, torch.float32)),
            np.float64: (wide64, wide64)}


def compare(actual, expected, naive, dtype, what):
    """The suite's rule in float32 (at most twice the plain float32 maths' error), TIGHT in float64."""
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    if dtype == np.float32:
        assert_close(actual, expected, naive, what=what)
    else:
        assert_tight(actual, expected, what=what)


@pytest.mark.parametrize("name", CASE_IDS)
def test_forward(rng, name):
    arrays, options = build_case(rng, name)
    expected = references(arrays, options, dout_of(rng, arrays))

    def check(target):
        for dtype in (np.float32, np.float64):
            given = cast(arrays, dtype)
            wide, naive = expected[dtype]
            for impl in ("reference", "fused"):
                what = f"{name}, {dtype.__name__}, {impl}, {target}"
                out, lse = qkv.attention(given["q"], given["k"], given["v"], impl=impl, return_lse=True,
                                         **qkv_kwargs(given, options))
                compare(out, wide[0], naive[0], dtype, f"out ({what})")
                compare(lse, wide[1], naive[1], dtype, f"lse ({what})")
            _, weights = qkv.attention(given["q"], given["k"], given["v"], impl="reference", return_weights=True,
                                       **qkv_kwargs(given, options))
            compare(weights, wide[2], naive[2], dtype, f"weights ({name}, {dtype.__name__}, {target})")

    with_every_target(check)


@pytest.mark.parametrize("name", CASE_IDS)
def test_backward(rng, name):
    arrays, options = build_case(rng, name)
    dout = dout_of(rng, arrays)
    expected = references(arrays, options, dout)

    def check(target):
        for dtype in (np.float32, np.float64):
            given = cast(arrays, dtype)
            wide, naive = (run[3] for run in expected[dtype])
            kwargs = qkv_kwargs(given, options)
            out, lse = qkv.attention(given["q"], given["k"], given["v"], impl="fused", return_lse=True, **kwargs)
            runs = {"reference": {}, "fused": {}, "fused from out, lse": {"out": out, "lse": lse}}
            for run, saved in runs.items():
                impl = run.split()[0]
                grads = grads_by_name(qkv.attention_backward(given["q"], given["k"], given["v"], dout.astype(dtype),
                                                             impl=impl, **saved, **kwargs), given)
                for label, actual in grads.items():
                    compare(actual, wide[label], naive[label], dtype, f"{label} ({name}, {dtype.__name__}, {run}, "
                                                                      f"{target})")

    with_every_target(check)


def loss_of(arrays, options, dout, **changed):
    """L = sum(dout * out) of the float64 reference implementation, with some arrays replaced."""
    given = dict(arrays, **changed)
    out = qkv.attention(given["q"], given["k"], given["v"], impl="reference", **qkv_kwargs(given, options))
    return float((dout * out).sum())


@pytest.mark.parametrize("options", [{"softcap": 0.8}, {"softcap": 1.3, "causal": "top-left", "window": (1, -1)}],
                         ids=["softcap", "softcap, top-left window"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_central_differences(rng, options, sinks):
    """The softcap's slope and the sinks' gradient, which no other path checks, against
    (L(x + h) - L(x - h)) / 2h in float64 for every entry of q, k and the sinks."""
    arrays = case_arrays(rng, lead=(1,), heads=2, kv_heads=1, tq=3, tk=4, dk=2, dv=2, q_scale=2.0, sinks=sinks)
    dout = dout_of(rng, arrays)
    grads = grads_by_name(qkv.attention_backward(arrays["q"], arrays["k"], arrays["v"], dout, impl="reference",
                                                 **qkv_kwargs(arrays, options)), arrays)
    h = 1e-6
    for name in ("q", "k") + (("sinks",) if sinks else ()):
        numeric = np.zeros_like(arrays[name])
        for index in np.ndindex(arrays[name].shape):
            step = np.zeros_like(arrays[name])
            step[index] = h
            numeric[index] = (loss_of(arrays, options, dout, **{name: arrays[name] + step})
                              - loss_of(arrays, options, dout, **{name: arrays[name] - step})) / (2 * h)
        np.testing.assert_allclose(grads["d" + name], numeric, rtol=1e-6, atol=1e-8, err_msg=f"d{name}")


def test_window_zero_zero_sees_the_diagonal_alone(rng):
    arrays = case_arrays(rng, tq=5, tk=8)
    for causal, offset in ((False, 3), ("top-left", 0)):
        for dtype in (np.float32, np.float64):
            given = cast(arrays, dtype)
            for impl in ("reference", "fused"):
                out = qkv.attention(given["q"], given["k"], given["v"], window=(0, 0), causal=causal, impl=impl)
                np.testing.assert_array_equal(out, given["v"][..., offset:offset + 5, :], err_msg=f"{causal}, {impl}")


def test_window_beyond_the_sequence_is_no_window(rng):
    arrays = case_arrays(rng, tq=6, tk=9)
    for window in ((9, 9), (1000, -1), (-1, 1000)):
        for impl in ("reference", "fused"):
            plain = qkv.attention(arrays["q"], arrays["k"], arrays["v"], impl=impl)
            windowed = qkv.attention(arrays["q"], arrays["k"], arrays["v"], window=window, impl=impl)
            np.testing.assert_allclose(windowed, plain, rtol=0, atol=1e-14, err_msg=f"{window}, {impl}")


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_a_row_emptied_by_window_and_mask(rng, sinks):
    """Row 2 sees key 4 alone through the window (0, 0), and the mask forbids it: out 0, lse -inf
    (the sink's logit with sinks), zero gradients for row 2 and key 4, no NaN anywhere."""
    arrays = case_arrays(rng, tq=5, tk=7, sinks=sinks)
    keep = np.ones((5, 7), bool)
    keep[2, 4] = False
    arrays["mask"] = keep
    options = {"window": (0, 0)}
    dout = dout_of(rng, arrays)
    for dtype in (np.float32, np.float64):
        given = cast(arrays, dtype)
        for impl in ("reference", "fused"):
            what = f"{dtype.__name__}, {impl}"
            out, lse = qkv.attention(given["q"], given["k"], given["v"], impl=impl, return_lse=True,
                                     **qkv_kwargs(given, options))
            grads = grads_by_name(qkv.attention_backward(given["q"], given["k"], given["v"], dout.astype(dtype),
                                                         impl=impl, **qkv_kwargs(given, options)), given)
            assert not np.isnan(out).any() and not np.isnan(lse).any(), what
            assert all(not np.isnan(g).any() for g in grads.values()), what
            np.testing.assert_array_equal(out[..., 2, :], 0, err_msg=what)
            expected_lse = np.broadcast_to(given["sinks"], lse.shape[:-1]) if sinks else -np.inf
            np.testing.assert_array_equal(lse[..., 2], expected_lse, err_msg=what)
            np.testing.assert_array_equal(grads["dq"][..., 2, :], 0, err_msg=what)
            np.testing.assert_array_equal(grads["dk"][..., 4, :], 0, err_msg=what)
            np.testing.assert_array_equal(grads["dv"][..., 4, :], 0, err_msg=what)


def press_slopes(n):
    """ALiBi's slopes as Press et al.'s code computes them."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + press_slopes(2 * closest)[0::2][:n - closest]


def test_alibi_slopes():
    for heads in range(1, 17):
        np.testing.assert_allclose(qkv.alibi_slopes(heads), press_slopes(heads), rtol=1e-14, err_msg=str(heads))
    assert list(qkv.alibi_slopes(0)) == []
    with pytest.raises(qkv.Error, match="heads: expected at least 0, got -1"):
        qkv.alibi_slopes(-1)


def test_alibi_auto_is_the_standard_slopes(rng):
    arrays = case_arrays(rng, heads=5, tq=6, tk=6)
    slopes = np.array(qkv.alibi_slopes(5), np.float32)
    for impl in ("reference", "fused"):
        auto = qkv.attention(*(arrays[n].astype(np.float32) for n in "qkv"), alibi="auto", causal=True, impl=impl)
        given = qkv.attention(*(arrays[n].astype(np.float32) for n in "qkv"), alibi=slopes, causal=True, impl=impl)
        np.testing.assert_array_equal(auto, given)


def test_per_head_values_as_lists(rng):
    """sinks and alibi given as lists of Python floats are taken in q's dtype, float32 too."""
    q, k, v = (x.astype(np.float32) for x in case_arrays(rng, heads=2).values())
    sinks, slopes = [0.5, -1.0], [0.25, 0.125]
    expected = qkv.attention(q, k, v, sinks=np.array(sinks, np.float32), alibi=np.array(slopes, np.float32))
    np.testing.assert_array_equal(qkv.attention(q, k, v, sinks=sinks, alibi=slopes), expected)
    # float32 sinks widen for a float64 q, as a float32 bias does.
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    np.testing.assert_array_equal(qkv.attention(q64, k64, v64, sinks=np.array(sinks, np.float32)),
                                  qkv.attention(q64, k64, v64, sinks=np.array(sinks)))


def test_additive_attention_takes_the_window_and_the_alignment(rng):
    """The band a window and a top-left causality make is the bool mask of the same keys."""
    tq, tk = 5, 8
    q, k, v = (rng.standard_normal(s) for s in ((2, tq, 3), (2, tk, 4), (2, tk, 2)))
    w_q, w_k, w = rng.standard_normal((6, 3)), rng.standard_normal((6, 4)), rng.standard_normal(6)
    rel = np.arange(tk)[None, :] - np.arange(tq)[:, None]
    band = (rel <= 0) & (rel >= -2)  # top-left: causal, two keys back
    dout = rng.standard_normal((2, tq, 2))
    out = qkv.additive_attention(q, k, v, w_q, w_k, w, causal="top-left", window=(2, 4))
    np.testing.assert_array_equal(out, qkv.additive_attention(q, k, v, w_q, w_k, w, mask=band))
    grads = qkv.additive_attention_backward(q, k, v, w_q, w_k, w, dout, causal="top-left", window=(2, 4))
    for actual, expected in zip(grads, qkv.additive_attention_backward(q, k, v, w_q, w_k, w, dout, mask=band)):
        np.testing.assert_array_equal(actual, expected)


def refusals(q, k, v):
    """(what is wrong, call, exception class, message pattern)."""
    sinks = np.zeros(4, np.float32)
    nan_sinks = sinks.copy()
    nan_sinks[1] = np.nan
    return [
        ("H not a multiple of Hkv", lambda: qkv.attention(q, k[:, :3], v[:, :3]), qkv.ShapeError,
         "k: q has 4 heads, which is not a multiple of k's 3"),
        ("v's heads differ from k's", lambda: qkv.attention(q, k[:, :2], v), qkv.ShapeError, "v: expected shape"),
        ("softcap 0", lambda: qkv.attention(q, k, v, softcap=0.0), qkv.Error,
         "softcap: expected a positive finite number, got 0"),
        ("negative softcap", lambda: qkv.attention(q, k, v, softcap=-1.5), qkv.Error,
         "softcap: expected a positive finite number, got -1.5"),
        ("infinite softcap", lambda: qkv.attention(q, k, v, softcap=float("inf")), qkv.Error, "softcap: expected"),
        ("window left < -1", lambda: qkv.attention(q, k, v, window=(-2, 0)), qkv.Error,
         r"window: left must be -1 \(unbounded\) or at least 0, got -2"),
        ("window right < -1", lambda: qkv.attention(q, k, v, window=(0, -5)), qkv.Error,
         "window: right must be -1 .*got -5"),
        ("window of one int", lambda: qkv.attention(q, k, v, window=3), qkv.Error,
         r"window: expected None or a pair \(left, right\) of ints .*got 3"),
        ("window of three", lambda: qkv.attention(q, k, v, window=(1, 2, 3)), qkv.Error,
         r"window: expected None or a pair .*got \(1, 2, 3\)"),
        ("window of floats", lambda: qkv.attention(q, k, v, window=(1.5, 2)), qkv.Error,
         r"window: expected None or a pair .*got \(1.5, 2\)"),
        ("bad causal string", lambda: qkv.attention(q, k, v, causal="top_left"), qkv.Error,
         r"causal: expected True, False, \"bottom-right\" or \"top-left\", got 'top_left'"),
        ("causal of another type", lambda: qkv.attention(q, k, v, causal=None), qkv.Error,
         "causal: expected True, False, .*got None"),
        ("sinks of the wrong shape", lambda: qkv.attention(q, k, v, sinks=sinks[:3]), qkv.ShapeError,
         r"sinks: expected shape \[4\], got \[3\]"),
        ("sinks per kv head", lambda: qkv.attention(q, k[:, :2], v[:, :2], sinks=sinks[:2]), qkv.ShapeError,
         r"sinks: expected shape \[4\], got \[2\]"),
        ("sinks of float64 for float32 q", lambda: qkv.attention(q, k, v, sinks=sinks.astype(np.float64)),
         qkv.ShapeError, r"sinks: expected dtype float32 \(the dtype of q\), got float64"),
        ("NaN in the sinks", lambda: qkv.attention(q, k, v, sinks=nan_sinks), qkv.Error,
         r"sinks: expected finite values, got 1 non-finite value \(the first: nan at \[1\]\); "
         "pass allow_nonfinite=True"),
        ("-inf in the sinks", lambda: qkv.attention(q, k, v, sinks=np.full(4, -np.inf, np.float32)), qkv.Error,
         "sinks: expected finite values"),
        ("alibi of the wrong shape", lambda: qkv.attention(q, k, v, alibi=sinks[:2]), qkv.ShapeError,
         r"alibi: expected shape \[4\], got \[2\]"),
        ("bad alibi string", lambda: qkv.attention(q, k, v, alibi="standard"), qkv.Error,
         r"alibi: expected None, \"auto\" or \[H\] slopes, got 'standard'"),
        ("NaN in alibi", lambda: qkv.attention(q, k, v, alibi=nan_sinks), qkv.Error, "alibi: expected finite values"),
        ("backward: H not a multiple of Hkv", lambda: qkv.attention_backward(q, k[:, :3], v[:, :3], q), qkv.ShapeError,
         "k: q has 4 heads"),
        ("backward: sinks of the wrong shape", lambda: qkv.attention_backward(q, k, v, q, sinks=sinks[:1]),
         qkv.ShapeError, r"sinks: expected shape \[4\]"),
        ("backward: softcap", lambda: qkv.attention_backward(q, k, v, q, softcap=-1.0), qkv.Error, "softcap: "),
        ("backward: window", lambda: qkv.attention_backward(q, k, v, q, window=(-3, -1)), qkv.Error, "window: "),
        ("backward: causal", lambda: qkv.attention_backward(q, k, v, q, causal="yes"), qkv.Error, "causal: "),
        ("additive: causal", lambda: qkv.additive_attention(q, k, v, q[0, 0], q[0, 0], q[0, 0, 0], causal="x"),
         qkv.Error, "causal: "),
        ("additive: window", lambda: qkv.additive_attention(q, k, v, q[0, 0], q[0, 0], q[0, 0, 0], window=(-2, 0)),
         qkv.Error, "window: left"),
        ("additive: grouped heads", lambda: qkv.additive_attention(q, k[:, :2], v[:, :2], q[0, 0], q[0, 0],
                                                                     q[0, 0, 0]),
         qkv.ShapeError, "k: additive attention needs as many key heads as query heads"),
    ]


CASES_REFUSED = refusals(*(np.zeros(s, np.float32) for s in ((2, 4, 3, 3), (2, 4, 5, 3), (2, 4, 5, 3))))


@pytest.mark.parametrize("what,call,error,pattern", CASES_REFUSED, ids=[c[0] for c in CASES_REFUSED])
def test_refusal(what, call, error, pattern):
    with pytest.raises(error, match=f"^{pattern}"):
        call()


def test_allow_nonfinite_takes_infinite_sinks(rng):
    """A sink of -inf is no sink: allowed with allow_nonfinite, and the same as none."""
    q, k, v = (x.astype(np.float32) for x in case_arrays(rng, heads=2).values())
    out = qkv.attention(q, k, v, sinks=np.full(2, -np.inf, np.float32), allow_nonfinite=True, impl="reference")
    np.testing.assert_allclose(out, qkv.attention(q, k, v, impl="reference"), rtol=0, atol=0)


sdpa = qkv.torch.scaled_dot_product_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal,alignment", [(False, "bottom_right"), (True, "top_left"), (True, "bottom_right")])
def test_torch_with_every_variant(rng, dtype, is_causal, alignment):
    """qkv.torch with grouped heads, a window, a softcap, ALiBi, sinks and a float mask against the
    reference through autograd, gradients of the sinks and the mask included."""
    arrays = case_arrays(rng, lead=(2,), heads=6, kv_heads=2, tq=7, tk=10, dk=4, dv=3, q_scale=2.0, mask="bias",
                         sinks=True, alibi="given")
    options = {"window": (3, 2), "softcap": 2.0, "scale": 0.7}
    causal = ("top-left" if alignment == "top_left" else "bottom-right") if is_causal else False
    dout = dout_of(rng, arrays)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    wide, naive = references(arrays, dict(options, causal=causal), dout)[np_dtype]
    t = as_tensors(cast(arrays, np_dtype), dtype, ("q", "k", "v", "mask", "sinks"))
    out = sdpa(t["q"], t["k"], t["v"], t["mask"], is_causal=is_causal, causal_alignment=alignment,
               alibi=t["alibi"], sinks=t["sinks"], **options)
    out.backward(torch.from_numpy(dout.astype(np_dtype)))
    compare(out.detach().numpy(), wide[0], naive[0], np_dtype, "out")
    for name, label in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("mask", "dbias"), ("sinks", "dsinks")):
        compare(t[name].grad.numpy(), wide[3][label], naive[3][label], np_dtype, label)


def test_torch_gradcheck_through_sinks_and_softcap(rng):
    arrays = case_arrays(rng, lead=(1,), heads=2, kv_heads=1, tq=3, tk=4, dk=2, dv=2, q_scale=2.0, sinks=True)
    t = as_tensors(arrays, torch.float64, ("q", "k", "v", "sinks"))
    alibi = torch.tensor(qkv.alibi_slopes(2), dtype=torch.float64)

    def f(q, k, v, sinks):
        return sdpa(q, k, v, is_causal=True, window=(1, -1), softcap=0.9, alibi=alibi, sinks=sinks)

    assert torch.autograd.gradcheck(f, (t["q"], t["k"], t["v"], t["sinks"]), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_torch_alibi_auto_and_gqa(rng):
    q, k, v = (torch.from_numpy(x) for x in case_arrays(rng, heads=4, kv_heads=1, tq=5, tk=5).values())
    slopes = torch.tensor(qkv.alibi_slopes(4), dtype=torch.float64)
    torch.testing.assert_close(sdpa(q, k, v, alibi="auto"), sdpa(q, k, v, alibi=slopes), rtol=0, atol=0)
    expected = reference(q, k, v, alibi=slopes)[0]
    torch.testing.assert_close(sdpa(q, k, v, alibi="auto"), expected)
    # Grouped heads alone stay on the registered op.
    torch.testing.assert_close(sdpa(q, k, v), reference(q, k, v)[0])


def test_torch_refusals(rng):
    q, k, v = (torch.from_numpy(x) for x in case_arrays(rng, heads=2, tq=3, tk=5).values())
    with pytest.raises(ValueError, match="causal_alignment: \"top_left\" places the window and ALiBi only with "
                                         "is_causal=True"):
        sdpa(q, k, v, window=(1, 1))
    with pytest.raises(ValueError, match="alibi: expected None, \"auto\" or a tensor"):
        sdpa(q, k, v, alibi="standard")
    with pytest.raises(qkv.ShapeError, match=r"^sinks: expected shape \[2\], got \[3\]"):
        sdpa(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(qkv.ShapeError, match="^key: q has 2 heads, which is not a multiple of k's 3"):
        sdpa(q, torch.cat([k, k[:, :1]], dim=1), torch.cat([v, v[:, :1]], dim=1))
    with pytest.raises(qkv.Error, match="^softcap: expected a positive finite number"):
        sdpa(q, k, v, softcap=0.0)
