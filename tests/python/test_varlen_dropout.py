"""Packed variable-length batches (cu_seqlens_q, cu_seqlens_k) and dropout through qkv.attention,
qkv.attention_backward and qkv.torch. Packed batches against the per-sequence float64 PyTorch
references of test_variants concatenated along T; dropout against the same maths with the mask
that an identity V shows (out = α ∘ keep / (1 - p) when v = I), on every SIMD target."""

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from test_variants import as_tensors, assert_tight, cast, compare, reference, with_every_target

sdpa = qkv.torch.scaled_dot_product_attention


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def spans(cu_q, cu_k):
    """(q0, q1, k0, k1) of each packed sequence."""
    return list(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]))


def packed_reference(t, cu_q, cu_k, options):
    """(out, lse) of the packed batch: each sequence's reference on its slices of t (q, k, v and
    the optional mask, sinks, alibi as tensors), concatenated along T."""
    outs, lses = [], []
    for q0, q1, k0, k1 in spans(cu_q, cu_k):
        q, k, v = t["q"][..., q0:q1, :], t["k"][..., k0:k1, :], t["v"][..., k0:k1, :]
        if k1 == k0 and t.get("sinks") is None:
            # No key to see, and torch has no max over none: qkv's out 0 and lse -inf.
            outs.append(q.new_zeros((*q.shape[:-1], v.shape[-1])))
            lses.append(q.new_full(q.shape[:-1], -math.inf))
            continue
        mask = None if t.get("mask") is None else t["mask"][..., q0:q1, k0:k1]
        out, lse, _ = reference(q, k, v, mask=mask, sinks=t.get("sinks"), alibi=t.get("alibi"), **options)
        outs.append(out)
        lses.append(lse.detach())
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def grad_names(arrays):
    names = ["q", "k", "v"]
    if arrays.get("mask") is not None and arrays["mask"].dtype != bool:
        names.append("mask")
    if arrays.get("sinks") is not None:
        names.append("sinks")
    return names


def packed_run(arrays, cu_q, cu_k, options, dout, dtype):
    """(out, lse, grads) of packed_reference in torch `dtype`, as numpy; grads by qkv's names."""
    names = grad_names(arrays)
    t = as_tensors(arrays, dtype, names)
    out, lse = packed_reference(t, cu_q, cu_k, options)
    out.backward(torch.from_numpy(dout).to(dtype))
    grads = {"d" + ("bias" if n == "mask" else n): t[n].grad.numpy() for n in names}
    return out.detach().numpy(), lse.numpy(), grads


def expectations(arrays, cu_q, cu_k, options, dout):
    """dtype -> (the float64 reference of the inputs rounded to dtype, the same maths in dtype)."""
    rounded = cast(arrays, np.float32), cu_q, cu_k, options, dout.astype(np.float32)
    wide64 = packed_run(arrays, cu_q, cu_k, options, dout, torch.float64)
    return {np.float32: (packed_run(*rounded, torch.float64), packed_run(*rounded, torch.float32)),
            np.float64: (wide64, wide64)}


def packed_arrays(rng, *, lens_q, lens_k, lead=(), heads=2, kv_heads=None, dk=4, dv=3, mask=None, sinks=False,
                  alibi=False):
    """q [*lead, H, Tq, Dk], k and v [*lead, Hkv, Tk, ...] holding the sequences back to back, the
    offsets, and the optional bias over the packed [Tq, Tk], sinks and ALiBi slopes."""
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    kv_heads = heads if kv_heads is None else kv_heads
    arrays = {"q": rng.standard_normal((*lead, heads, tq, dk)), "k": rng.standard_normal((*lead, kv_heads, tk, dk)),
              "v": rng.standard_normal((*lead, kv_heads, tk, dv))}
    if mask == "bias":
        arrays["mask"] = np.where(rng.random((tq, tk)) < 0.8, rng.standard_normal((tq, tk)), -np.inf)
    if sinks:
        arrays["sinks"] = rng.standard_normal(heads)
    if alibi:
        arrays["alibi"] = rng.random(heads) * 0.5
    return arrays, cu_q, cu_k


def qkv_kwargs(arrays, cu_q, cu_k, options):
    return dict(options, mask=arrays.get("mask"), sinks=arrays.get("sinks"), alibi=arrays.get("alibi"),
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def result_by_name(result, arrays):
    names = ["d" + ("bias" if n == "mask" else n) for n in grad_names(arrays)]
    assert len(result) == len(names), f"attention_backward returned {len(result)} arrays, expected {names}"
    return dict(zip(names, result))


# name -> (packed_arrays arguments, qkv.attention keywords). Empty sequences on either side and
# sequences of one token sit among the others; Tq != Tk within a sequence makes the alignment count.
PACKED = {
    "causal, lengths 0 and 1": (dict(lens_q=(3, 0, 1, 4, 2, 0), lens_k=(5, 2, 1, 4, 0, 0)), {"causal": True}),
    "top-left, gqa": (dict(lens_q=(4, 1, 6), lens_k=(2, 3, 7), heads=4, kv_heads=2), {"causal": "top-left"}),
    "window, gqa 3, rank 4": (dict(lead=(1,), lens_q=(5, 0, 7), lens_k=(6, 3, 4), heads=6, kv_heads=2),
                              {"window": (2, 1)}),
    "window, causal, sinks": (dict(lens_q=(3, 1, 0, 6), lens_k=(3, 1, 2, 6), sinks=True),
                              {"window": (2, 0), "causal": True}),
    "sinks, a sequence without keys": (dict(lens_q=(2, 3), lens_k=(0, 4), heads=3, sinks=True), {}),
    "alibi, bias, softcap": (dict(lens_q=(4, 2, 5), lens_k=(3, 2, 6), mask="bias", alibi=True),
                             {"causal": True, "softcap": 2.0}),
    "one sequence": (dict(lead=(1,), lens_q=(5,), lens_k=(7,), heads=2, kv_heads=1), {"causal": "top-left"}),
}


def build_packed(rng, name):
    shape_args, options = PACKED[name]
    arrays, cu_q, cu_k = packed_arrays(rng, **shape_args)
    dout = rng.standard_normal((*arrays["q"].shape[:-1], arrays["v"].shape[-1]))
    return arrays, cu_q, cu_k, dict(options), dout


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_forward(rng, name):
    arrays, cu_q, cu_k, options, dout = build_packed(rng, name)
    expected = expectations(arrays, cu_q, cu_k, options, dout)

    def check(target):
        for dtype in (np.float32, np.float64):
            given = cast(arrays, dtype)
            wide, naive = expected[dtype]
            for impl in ("reference", "fused"):
                what = f"{name}, {dtype.__name__}, {impl}, {target}"
                out, lse = qkv.attention(given["q"], given["k"], given["v"], impl=impl, return_lse=True,
                                         **qkv_kwargs(given, cu_q, cu_k, options))
                compare(out, wide[0], naive[0], dtype, f"out ({what})")
                compare(lse, wide[1], naive[1], dtype, f"lse ({what})")

    with_every_target(check)


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_backward(rng, name):
    arrays, cu_q, cu_k, options, dout = build_packed(rng, name)
    expected = expectations(arrays, cu_q, cu_k, options, dout)

    def check(target):
        for dtype in (np.float32, np.float64):
            given = cast(arrays, dtype)
            wide, naive = (run[2] for run in expected[dtype])
            kwargs = qkv_kwargs(given, cu_q, cu_k, options)
            out, lse = qkv.attention(given["q"], given["k"], given["v"], impl="fused", return_lse=True, **kwargs)
            runs = {"reference": {}, "fused": {}, "fused from out, lse": {"out": out, "lse": lse}}
            for run, saved in runs.items():
                grads = result_by_name(qkv.attention_backward(given["q"], given["k"], given["v"], dout.astype(dtype),
                                                              impl=run.split()[0], **saved, **kwargs), given)
                for label, actual in grads.items():
                    compare(actual, wide[label], naive[label], dtype,
                            f"{label} ({name}, {dtype.__name__}, {run}, {target})")

    with_every_target(check)


def test_packed_is_the_separate_calls(rng):
    """qkv's own separate calls on the slices, concatenated, are what the packed call gives, and
    the offsets read the same as int32, int64 (strided too) or lists."""
    arrays, cu_q, cu_k = packed_arrays(rng, lens_q=(3, 0, 1, 5), lens_k=(4, 2, 1, 3), heads=4, kv_heads=2)
    q, k, v = (arrays[n].astype(np.float32) for n in "qkv")
    for impl in ("reference", "fused"):
        packed = qkv.attention(q, k, v, causal=True, impl=impl, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        apart = np.concatenate([qkv.attention(q[:, a:b], k[:, c:d], v[:, c:d], causal=True, impl=impl)
                                for a, b, c, d in spans(cu_q, cu_k)], axis=1)
        np.testing.assert_array_equal(packed, apart, err_msg=impl)
        for form in (cu_q.astype(np.int32), np.repeat(cu_q, 2)[::2], cu_q.tolist()):
            again = qkv.attention(q, k, v, causal=True, impl=impl, cu_seqlens_q=form, cu_seqlens_k=cu_k.tolist())
            np.testing.assert_array_equal(again, packed, err_msg=f"{impl}, {type(form).__name__}")


def test_packed_additive_is_the_separate_calls(rng):
    """Additive attention takes packed sequences too: each attends within itself, causally."""
    arrays, cu_q, cu_k = packed_arrays(rng, lens_q=(3, 0, 1, 5), lens_k=(4, 2, 1, 3), heads=2, kv_heads=2)
    q, k, v = (arrays[n] for n in "qkv")
    w_q, w_k, w = rng.standard_normal((5, q.shape[-1])), rng.standard_normal((5, k.shape[-1])), rng.standard_normal(5)
    dout = rng.standard_normal((*q.shape[:-1], v.shape[-1]))
    packed = qkv.additive_attention(q, k, v, w_q, w_k, w, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    grads = qkv.additive_attention_backward(q, k, v, w_q, w_k, w, dout, causal=True, cu_seqlens_q=cu_q,
                                            cu_seqlens_k=cu_k)
    parts = [(qkv.additive_attention(q[:, a:b], k[:, c:d], v[:, c:d], w_q, w_k, w, causal=True),
              qkv.additive_attention_backward(q[:, a:b], k[:, c:d], v[:, c:d], w_q, w_k, w, dout[:, a:b], causal=True))
             for a, b, c, d in spans(cu_q, cu_k)]
    np.testing.assert_allclose(packed, np.concatenate([out for out, _ in parts], axis=1), rtol=0, atol=1e-14)
    for index, name in enumerate(("dq", "dk", "dv")):
        np.testing.assert_allclose(grads[index], np.concatenate([g[index] for _, g in parts], axis=1), rtol=0,
                                   atol=1e-14, err_msg=name)
    for index, name in ((3, "dw_q"), (4, "dw_k"), (5, "dw")):
        np.testing.assert_allclose(grads[index], sum(g[index] for _, g in parts), rtol=0, atol=1e-13, err_msg=name)


# ---- Dropout

def dropout_keep(heads, tq, tk, p, seed, *, lead=(), kv_heads=None, **packing):
    """[*lead, H, Tq, Tk] bool: the weights that dropout keeps, as an identity V shows them: with
    q = k = 0 every weight is 1/Tk (1/L within a sequence), and out = α ∘ keep / (1 - p). The mask
    is a function of the seed and (b, h, i, j) alone, so it is the one of any call of that shape."""
    kv_heads = heads if kv_heads is None else kv_heads
    q = np.zeros((*lead, heads, tq, 1))
    k = np.zeros((*lead, kv_heads, tk, 1))
    v = np.broadcast_to(np.eye(tk), (*lead, kv_heads, tk, tk)).copy()
    out = qkv.attention(q, k, v, dropout=p, seed=seed, impl="reference", **packing)
    return out != 0


def test_identity_v_shows_the_same_mask_everywhere(rng):
    """Reference and fused, float32 and float64, every SIMD target: out = α ∘ keep / (1 - p), the
    same keep for all of them, α the returned (pre-dropout) weights."""
    heads, kv_heads, tq, tk, p, seed = 4, 2, 19, 37, 0.3, 2024
    q = rng.standard_normal((1, heads, tq, 8))
    k = rng.standard_normal((1, kv_heads, tk, 8))
    v = np.broadcast_to(np.eye(tk), (1, kv_heads, tk, tk)).copy()
    keep = dropout_keep(heads, tq, tk, p, seed, lead=(1,), kv_heads=kv_heads)
    assert 0 < keep.mean() < 1
    _, weights = qkv.attention(q, k, v, return_weights=True, impl="reference")
    assert (weights > 0).all()  # so that every zero of out is a dropped weight
    expected = weights * keep / (1 - p)

    def check(target):
        for dtype in (np.float32, np.float64):
            for impl in ("reference", "fused"):
                what = f"{dtype.__name__}, {impl}, {target}"
                out = qkv.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), dropout=p, seed=seed, impl=impl)
                np.testing.assert_array_equal(out != 0, keep, err_msg=what)
                tol = 1e-5 if dtype == np.float32 else 1e-13
                np.testing.assert_allclose(out, expected, rtol=tol, atol=0, err_msg=what)

    with_every_target(check)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate(p):
    """Over 4 · 512 · 512 > 1e6 weights the kept fraction is within 4 standard deviations of 1 - p,
    and so is the fraction of neighbouring keys kept together, which share a Philox draw."""
    heads, t = 4, 512
    q = np.zeros((heads, t, 4), np.float32)
    v = np.eye(t, dtype=np.float32)[None].repeat(heads, axis=0)
    out = qkv.attention(q, q, v, dropout=p, seed=99, impl="fused")
    n = out.size
    sigma = math.sqrt(n * p * (1 - p))
    kept = int(np.count_nonzero(out))
    assert abs(kept - n * (1 - p)) <= 4 * sigma, f"kept {kept} of {n}, expected {n * (1 - p):.0f} ± {4 * sigma:.0f}"
    keep = out != 0
    both = keep[..., 0::2] & keep[..., 1::2]
    pairs, rate = both.size, (1 - p) ** 2
    together = int(np.count_nonzero(both))
    assert abs(together - pairs * rate) <= 4 * math.sqrt(pairs * rate * (1 - rate)), \
        f"kept {together} of {pairs} neighbouring pairs together, expected {pairs * rate:.0f}"


def test_seeds(rng):
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 9, 4), (3, 11, 4), (3, 11, 5)))
    for impl in ("reference", "fused"):
        first = qkv.attention(q, k, v, dropout=0.2, seed=5, impl=impl)
        np.testing.assert_array_equal(qkv.attention(q, k, v, dropout=0.2, seed=5, impl=impl), first, err_msg=impl)
        assert not np.array_equal(qkv.attention(q, k, v, dropout=0.2, seed=6, impl=impl), first), impl
        # Both 32-bit halves of the seed key the mask.
        assert not np.array_equal(qkv.attention(q, k, v, dropout=0.2, seed=5 + 2**32, impl=impl), first), impl
        high = qkv.attention(q, k, v, dropout=0.2, seed=2**64 - 1, impl=impl)
        np.testing.assert_array_equal(qkv.attention(q, k, v, dropout=0.2, seed=2**64 - 1, impl=impl), high)


def test_zero_dropout_is_no_dropout(rng):
    q, k, v = (rng.standard_normal(s) for s in ((2, 7, 4), (2, 9, 4), (2, 9, 3)))
    dout = rng.standard_normal((2, 7, 3))
    for dtype in (np.float32, np.float64):
        args = [x.astype(dtype) for x in (q, k, v)]
        for impl in ("reference", "fused"):
            what = f"{dtype.__name__}, {impl}"
            plain = qkv.attention(*args, causal=True, impl=impl, return_lse=True)
            zero = qkv.attention(*args, causal=True, impl=impl, return_lse=True, dropout=0.0, seed=123)
            for a, b in zip(zero, plain):
                np.testing.assert_array_equal(a, b, err_msg=what)
            grads = qkv.attention_backward(*args, dout.astype(dtype), causal=True, impl=impl)
            zero_grads = qkv.attention_backward(*args, dout.astype(dtype), causal=True, impl=impl, dropout=0.0,
                                                seed=123)
            for a, b in zip(zero_grads, grads):
                np.testing.assert_array_equal(a, b, err_msg=what)


def dropped_reference(t, factors, options):
    """out of the reference with its weights scaled by `factors` (0 or 1/(1 - p))."""
    _, _, weights = reference(t["q"], t["k"], t["v"], sinks=t.get("sinks"), **options)
    v = t["v"]
    heads, kv_heads = t["q"].shape[-3], v.shape[-3]
    v = v.repeat_interleave(heads // kv_heads, dim=-3)
    return (weights * factors) @ v


@pytest.mark.parametrize("options", [{}, {"causal": True, "window": (4, -1), "softcap": 3.0}],
                         ids=["plain", "causal window softcap"])
def test_dropout_backward(rng, options):
    """The gradients with dropout against autograd of the float64 reference with the mask the
    identity V shows, reference and fused (from out and lse too), every SIMD target."""
    heads, kv_heads, tq, tk, p, seed = 4, 2, 13, 21, 0.25, 77
    arrays = {"q": rng.standard_normal((1, heads, tq, 5)) * 1.5, "k": rng.standard_normal((1, kv_heads, tk, 5)),
              "v": rng.standard_normal((1, kv_heads, tk, 3)), "sinks": rng.standard_normal(heads)}
    dout = rng.standard_normal((1, heads, tq, 3))
    factors = torch.from_numpy(dropout_keep(heads, tq, tk, p, seed, lead=(1,), kv_heads=kv_heads) / (1 - p))

    def expected_in(inputs, dtype):
        names = ("q", "k", "v", "sinks")
        t = as_tensors(inputs, dtype, names)
        out = dropped_reference(t, factors.to(dtype), options)
        out.backward(torch.from_numpy(dout).to(dtype))
        return out.detach().numpy(), {"d" + n: t[n].grad.numpy() for n in names}

    rounded = cast(arrays, np.float32)
    expected = {np.float32: (expected_in(rounded, torch.float64), expected_in(rounded, torch.float32)),
                np.float64: (expected_in(arrays, torch.float64),) * 2}

    def check(target):
        for dtype in (np.float32, np.float64):
            given = cast(arrays, dtype)
            (wide_out, wide), (naive_out, naive) = expected[dtype]
            kwargs = dict(options, sinks=given["sinks"], dropout=p, seed=seed)
            out, lse = qkv.attention(given["q"], given["k"], given["v"], impl="fused", return_lse=True, **kwargs)
            compare(out, wide_out, naive_out, dtype, f"out ({dtype.__name__}, {target})")
            runs = {"reference": {}, "fused": {}, "fused from out, lse": {"out": out, "lse": lse}}
            for run, saved in runs.items():
                grads = qkv.attention_backward(given["q"], given["k"], given["v"], dout.astype(dtype),
                                               impl=run.split()[0], **saved, **kwargs)
                for label, actual in zip(("dq", "dk", "dv", "dsinks"), grads):
                    compare(actual, wide[label], naive[label], dtype, f"{label} ({dtype.__name__}, {run}, {target})")

    with_every_target(check)


def test_packed_dropout_keys_by_sequence(rng):
    """With packed sequences b is the sequence and i, j count within it: sequence n's mask is that
    of batch entry n of an unpacked call of its lengths."""
    lens_q, lens_k, heads, p, seed = (3, 0, 5, 2), (4, 1, 5, 3), 2, 0.4, 31
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    keep = dropout_keep(heads, int(cu_q[-1]), int(cu_k[-1]), p, seed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for n, (q0, q1, k0, k1) in enumerate(spans(cu_q, cu_k)):
        if q1 == q0 or k1 == k0:
            continue
        alone = dropout_keep(heads, q1 - q0, k1 - k0, p, seed, lead=(n + 1,))[n]
        np.testing.assert_array_equal(keep[:, q0:q1, k0:k1], alone, err_msg=f"sequence {n}")
    arrays, _, _ = packed_arrays(rng, lens_q=lens_q, lens_k=lens_k, heads=heads)
    q, k, v = (arrays[name].astype(np.float32) for name in "qkv")
    dout = rng.standard_normal((heads, int(cu_q[-1]), 3)).astype(np.float32)
    packing = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "dropout": p, "seed": seed}
    for impl in ("reference", "fused"):
        out = qkv.attention(q, k, v, impl=impl, **packing)
        np.testing.assert_array_equal(qkv.attention(q, k, v, impl=impl, **packing), out, err_msg=impl)
        grads = qkv.attention_backward(q, k, v, dout, impl=impl, **packing)
        assert all(np.isfinite(g).all() for g in grads), impl
    # The reference's and the fused kernel's packed gradients agree (each checked above alone).
    ref = qkv.attention_backward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                 dout.astype(np.float64), impl="reference", **packing)
    fused = qkv.attention_backward(q, k, v, dout, impl="fused", **packing)
    for a, b, label in zip(fused, ref, ("dq", "dk", "dv")):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=label)


# ---- qkv.torch

def test_torch_dropout_gradcheck(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).requires_grad_() for s in ((2, 4, 3), (2, 5, 3), (2, 5, 2)))
    sinks = torch.from_numpy(rng.standard_normal(2)).requires_grad_()

    def f(q, k, v, sinks):
        return sdpa(q, k, v, dropout_p=0.3, seed=11, is_causal=True, causal_alignment="bottom_right", sinks=sinks)

    undropped = sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right", sinks=sinks)
    assert not torch.allclose(f(q, k, v, sinks), undropped)
    assert torch.autograd.gradcheck(f, (q, k, v, sinks), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_torch_dropout_seeds(rng):
    """Without seed=, each call draws one from torch's generator: calls differ, torch.manual_seed
    repeats them, and the backward replays the forward's mask (v = I shows it: dv = outᵀ dout)."""
    q = torch.from_numpy(rng.standard_normal((3, 6, 4)))
    v = torch.eye(8, dtype=torch.float64).expand(3, 8, 8).clone().requires_grad_()
    k = torch.from_numpy(rng.standard_normal((3, 8, 4)))
    torch.manual_seed(3)
    first = sdpa(q, k, v, dropout_p=0.5)
    second = sdpa(q, k, v, dropout_p=0.5)
    assert not torch.equal(first, second)
    torch.manual_seed(3)
    again = sdpa(q, k, v, dropout_p=0.5)
    assert torch.equal(again, first)
    dout = torch.from_numpy(rng.standard_normal(again.shape))
    again.backward(dout)
    torch.testing.assert_close(v.grad, again.detach().transpose(-1, -2) @ dout, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(sdpa(q, k, v, dropout_p=0.5, seed=8).detach().numpy(),
                                  qkv.attention(q.numpy(), k.numpy(), v.detach().numpy(), dropout=0.5, seed=8))
    # p = 0 draws nothing, as PyTorch's own sdpa.
    state = torch.get_rng_state()
    sdpa(q, k, v, dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), state)


def test_torch_packed(rng):
    """Packed sequences through qkv.torch, offsets as an int32 tensor or a list, against the
    per-sequence references; top-left causality counts within each sequence even where the totals
    agree (Tq = Tk = 8 with sequences of 2 queries and 3 keys, then 6 and 5)."""
    cu_q, cu_k = np.array([0, 2, 8]), np.array([0, 3, 8])
    arrays = {"q": rng.standard_normal((2, 8, 4)), "k": rng.standard_normal((1, 8, 4)),
              "v": rng.standard_normal((1, 8, 3))}
    dout = rng.standard_normal((2, 8, 3))
    expected_out, _, expected = packed_run(arrays, cu_q, cu_k, {"causal": "top-left", "window": (1, -1)}, dout,
                                           torch.float64)
    for form in (torch.from_numpy(cu_q.astype(np.int32)), cu_q.tolist()):
        t = as_tensors(arrays, torch.float64, ("q", "k", "v"))
        out = sdpa(t["q"], t["k"], t["v"], is_causal=True, window=(1, -1), cu_seqlens_q=form,
                   cu_seqlens_k=torch.from_numpy(cu_k))
        out.backward(torch.from_numpy(dout))
        assert_tight(out.detach().numpy(), expected_out, what="out")
        for name in "qkv":
            assert_tight(t[name].grad.numpy(), expected["d" + name], what="d" + name)


# ---- Refusals

def refusals(q, k, v):
    """(what is wrong, call, exception class, message pattern)."""
    cu = np.array([0, 2, 5])
    dout = np.zeros((4, 5, 3), np.float32)
    w = np.zeros((2, 3), np.float32)
    return [
        ("decreasing offsets", lambda: qkv.attention(q, k, v, cu_seqlens_q=[0, 3, 2, 5], cu_seqlens_k=[0, 2, 4, 7]),
         qkv.Error, "cu_seqlens_q: offsets must not decrease, got 2 after 3 at index 2"),
        ("last offset not Tk", lambda: qkv.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=[0, 2, 6]), qkv.Error,
         "cu_seqlens_k: expected the last offset to be Tk = 7, got 6"),
        ("last offset not Tq", lambda: qkv.attention(q, k, v, cu_seqlens_q=[0, 2, 4], cu_seqlens_k=[0, 2, 7]),
         qkv.Error, "cu_seqlens_q: expected the last offset to be Tq = 5, got 4"),
        ("first offset not 0", lambda: qkv.attention(q, k, v, cu_seqlens_q=[1, 5], cu_seqlens_k=[0, 7]), qkv.Error,
         "cu_seqlens_q: expected 0 first, got 1"),
        ("cu_seqlens_q alone", lambda: qkv.attention(q, k, v, cu_seqlens_q=cu), qkv.Error,
         "cu_seqlens_q: given without cu_seqlens_k; packed sequences need the offsets of both"),
        ("cu_seqlens_k alone", lambda: qkv.attention(q, k, v, cu_seqlens_k=[0, 3, 7]), qkv.Error,
         "cu_seqlens_k: given without cu_seqlens_q"),
        ("batch of two", lambda: qkv.attention(np.stack([q, q]), np.stack([k, k]), np.stack([v, v]), cu_seqlens_q=cu,
                                               cu_seqlens_k=[0, 3, 7]),
         qkv.ShapeError, r"cu_seqlens_q: packed sequences lie along T of a batch of one \(\[H, T, D\] or "
                         r"\[1, H, T, D\]\), got q of shape \[2, 4, 5, 3\]"),
        ("offsets of different counts", lambda: qkv.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=[0, 7]),
         qkv.ShapeError, "cu_seqlens_k: expected 3 offsets, as many as cu_seqlens_q, got 2"),
        ("float offsets", lambda: qkv.attention(q, k, v, cu_seqlens_q=cu.astype(np.float64), cu_seqlens_k=cu),
         qkv.ShapeError, "cu_seqlens_q: expected dtype int32 or int64, got float64"),
        ("a list with a float", lambda: qkv.attention(q, k, v, cu_seqlens_q=[0, 2.5, 5], cu_seqlens_k=cu),
         qkv.ShapeError, "cu_seqlens_q: expected dtype int32 or int64, got float64"),
        ("int16 offsets", lambda: qkv.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu.astype(np.int16)),
         qkv.ShapeError, "cu_seqlens_k: expected dtype int32 or int64, got int16"),
        ("offsets of rank 2", lambda: qkv.attention(q, k, v, cu_seqlens_q=cu[None], cu_seqlens_k=cu[None]),
         qkv.ShapeError, r"cu_seqlens_q: expected shape \[N\+1\], the offsets of N sequences, got \[1, 3\]"),
        ("no offsets", lambda: qkv.attention(q, k, v, cu_seqlens_q=[], cu_seqlens_k=[]), qkv.ShapeError,
         r"cu_seqlens_q: expected shape \[N\+1\], the offsets of N sequences, got \[0\]"),
        ("one offset", lambda: qkv.attention(q[:, :0], k[:, :0], v[:, :0], cu_seqlens_q=[0], cu_seqlens_k=[0]),
         qkv.ShapeError, r"cu_seqlens_q: expected at least 2 offsets \(one sequence\), got 1"),
        ("dropout 1", lambda: qkv.attention(q, k, v, dropout=1.0), qkv.Error, r"dropout: p must be in \[0, 1\), got 1"),
        ("dropout < 0", lambda: qkv.attention(q, k, v, dropout=-0.1), qkv.Error,
         r"dropout: p must be in \[0, 1\), got -0.1"),
        ("dropout NaN", lambda: qkv.attention(q, k, v, dropout=float("nan")), qkv.Error,
         r"dropout: p must be in \[0, 1\), got nan"),
        ("negative seed", lambda: qkv.attention(q, k, v, dropout=0.5, seed=-1), qkv.Error,
         r"seed: expected an int in \[0, 2\*\*64\), got -1"),
        ("seed of 2**64", lambda: qkv.attention(q, k, v, dropout=0.5, seed=2**64), qkv.Error,
         r"seed: expected an int in \[0, 2\*\*64\), got 18446744073709551616"),
        ("seed of a float", lambda: qkv.attention(q, k, v, dropout=0.5, seed=1.5), qkv.Error,
         r"seed: expected an int .*got 1.5"),
        ("seed of a bool", lambda: qkv.attention(q, k, v, dropout=0.5, seed=True), qkv.Error,
         r"seed: expected an int .*got True"),
        ("backward: decreasing offsets",
         lambda: qkv.attention_backward(q, k, v, dout, cu_seqlens_q=[0, 4, 3, 5], cu_seqlens_k=[0, 2, 4, 7]),
         qkv.Error, "cu_seqlens_q: offsets must not decrease"),
        ("backward: cu_seqlens_k alone", lambda: qkv.attention_backward(q, k, v, dout, cu_seqlens_k=[0, 7]),
         qkv.Error, "cu_seqlens_k: given without cu_seqlens_q"),
        ("backward: dropout 1", lambda: qkv.attention_backward(q, k, v, dout, dropout=1.0), qkv.Error,
         r"dropout: p must be in \[0, 1\), got 1"),
        ("backward: negative seed", lambda: qkv.attention_backward(q, k, v, dout, seed=-3), qkv.Error,
         r"seed: expected an int in \[0, 2\*\*64\), got -3"),
    ]


CASES_REFUSED = refusals(*(np.zeros(s, np.float32) for s in ((4, 5, 3), (4, 7, 3), (4, 7, 3))))


@pytest.mark.parametrize("what,call,error,pattern", CASES_REFUSED, ids=[c[0] for c in CASES_REFUSED])
def test_refusal(what, call, error, pattern):
    with pytest.raises(error, match=f"^{pattern}"):
        call()


def test_torch_refusals():
    q, k, v = (torch.zeros(s, dtype=torch.float64) for s in ((2, 5, 3), (2, 7, 3), (2, 7, 3)))
    with pytest.raises(qkv.Error, match=r"^dropout_p: p must be in \[0, 1\), got 1"):
        sdpa(q, k, v, dropout_p=1.0)
    with pytest.raises(qkv.Error, match=r"^dropout_p: p must be in \[0, 1\), got -0.5"):
        sdpa(q, k, v, dropout_p=-0.5)
    with pytest.raises(qkv.Error, match=r"^seed: expected an int in \[0, 2\*\*64\), got -1"):
        sdpa(q, k, v, dropout_p=0.1, seed=-1)
    with pytest.raises(qkv.Error, match="^cu_seqlens_q: given without cu_seqlens_k"):
        sdpa(q, k, v, cu_seqlens_q=torch.tensor([0, 5]))
    with pytest.raises(qkv.ShapeError, match="^cu_seqlens_k: expected dtype int32 or int64, got float32"):
        sdpa(q, k, v, cu_seqlens_q=[0, 5], cu_seqlens_k=torch.tensor([0.0, 7.0]))
    with pytest.raises(ValueError, match=r"causal_alignment: \"top_left\" places the window .*\(packed sequences "
                                         r"with Tq != Tk\)"):
        sdpa(q, k[:, :5], v[:, :5], window=(1, 1), cu_seqlens_q=[0, 2, 5], cu_seqlens_k=[0, 3, 5])
