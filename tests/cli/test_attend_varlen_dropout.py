#!/usr/bin/env python3
"""Packed sequences (--cu-seqlens-q/-k) and dropout (--dropout, --seed) through `qkv attend` and
`qkv attend-backward`.

Packed: a batch of sequences of different lengths packed into one (B = 1) gives, sequence by
sequence, what attention over each sequence alone gives (torch, float64), with causality, the
window and ALiBi counted within the sequence, for int32 and int64 offset files, forward and
backward; offsets that do not describe such a batch are refused with one line naming the option.

Dropout: the same seed gives the same output and a different seed another one; p = 0 is exactly no
dropout; --weights and --lse are those before dropout. With V the identity (Dv = Tk), out_ij is
α_ij·keep_ij/(1 − p), which shows the mask itself: every weight is kept whole or dropped, about a
fraction p are dropped, the fused kernel and the reference drop the same ones, and the backward of
the same seed is the gradient of that masked forward (torch autograd with the mask fixed).

The library's interface has both (include/qkv/ops/attention.hpp); this file fails until the
library implements them.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_attend_varlen_dropout.py
"""

import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import run_suite  # noqa: E402  (the harness sits beside this script)
from test_attend_variants import VariantSuite, alibi_slopes, attention, t64  # noqa: E402


def packed_attention(q, k, v, cu_q, cu_k, **kwargs):
    """(out, weights, lse) of a packed batch, sequence by sequence: q [1, H, Tq, D], k and v
    [1, Hkv, Tk, D]; the weights are zero across sequences."""
    heads, tq, tk = q.shape[1], q.shape[2], k.shape[2]
    out = torch.zeros(1, heads, tq, v.shape[-1], dtype=torch.float64)
    weights = torch.zeros(1, heads, tq, tk, dtype=torch.float64)
    lse = torch.full((1, heads, tq), -math.inf, dtype=torch.float64)
    for n in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        o, w, l = attention(q[:, :, qs], k[:, :, ks], v[:, :, ks], **kwargs)
        out[:, :, qs], weights[:, :, qs, ks], lse[:, :, qs] = o, w, l
    return out, weights, lse


def packed_checks(t, rng):
    H, D, Dv = 4, 8, 6
    lengths_q, lengths_k = [3, 5, 2, 1], [4, 5, 3, 6]
    cu_q, cu_k = np.cumsum([0, *lengths_q]), np.cumsum([0, *lengths_k])
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    q = rng.standard_normal((1, H, Tq, D))
    k = rng.standard_normal((1, 2, Tk, D))  # grouped: two K/V heads
    v = rng.standard_normal((1, 2, Tk, Dv))
    sinks = rng.standard_normal(H)
    dout = rng.standard_normal((1, H, Tq, Dv))
    for name, array in [("pq", q), ("pk", k), ("pv", v), ("psinks", sinks), ("pdout", dout)]:
        t.save(f"{name}.npy", array)
    t.save("pq3.npy", q[0])
    t.save("pk3.npy", k[0])
    t.save("pv3.npy", v[0])
    for width in ("int32", "int64"):
        t.save(f"cu_q_{width}.npy", cu_q.astype(width))
        t.save(f"cu_k_{width}.npy", cu_k.astype(width))
    inputs = ["--q", "pq.npy", "--k", "pk.npy", "--v", "pv.npy"]
    packed = ["--cu-seqlens-q", "cu_q_int64.npy", "--cu-seqlens-k", "cu_k_int64.npy"]
    tq_, tk_, tv_ = t64(q), t64(k), t64(v)

    cases = [
        ("plain", [], {}),
        ("causal (bottom-right within each sequence)", ["--causal"], {"causal": "bottom-right"}),
        ("causal top-left", ["--causal", "top-left"], {"causal": "top-left"}),
        ("window 1,1", ["--window", "1,1"], {"window": (1, 1)}),
        ("causal, window, softcap, ALiBi, sinks", ["--causal", "--window", "2,0", "--softcap", "2", "--alibi", "auto",
                                                   "--sinks", "psinks.npy"],
         {"causal": "bottom-right", "window": (2, 0), "softcap": 2.0, "alibi": t64(alibi_slopes(H)),
          "sinks": t64(sinks)}),
    ]
    for name, args, kwargs in cases:
        out, weights, lse = packed_attention(tq_, tk_, tv_, cu_q, cu_k, **kwargs)
        t.close(f"packed, {name}, reference", ["attend", *inputs, *packed, *args, "--impl", "reference", "-o", "o.npy",
                                               "--weights", "a.npy", "--lse", "l.npy"],
                {"o.npy": out.numpy(), "a.npy": weights.numpy(), "l.npy": lse.numpy()})
        t.close(f"packed, {name}, fused", ["attend", *inputs, *packed, *args, "--impl", "fused", "-o", "o.npy",
                                           "--lse", "l.npy"], {"o.npy": out.numpy(), "l.npy": lse.numpy()})
    out, _, _ = packed_attention(tq_, tk_, tv_, cu_q, cu_k, causal="bottom-right")
    t.close("packed with int32 offsets, [H, T, D] inputs",
            ["attend", "--q", "pq3.npy", "--k", "pk3.npy", "--v", "pv3.npy", "--cu-seqlens-q", "cu_q_int32.npy",
             "--cu-seqlens-k", "cu_k_int32.npy", "--causal", "-o", "o.npy"], {"o.npy": out[0].numpy()})

    # Backward: the gradients of the per-sequence computation.
    leaves = [t64(x).requires_grad_() for x in (q, k, v, sinks)]
    out, _, _ = packed_attention(*leaves[:3], cu_q, cu_k, causal="bottom-right", window=(2, 0), sinks=leaves[3])
    (out * t64(dout)).sum().backward()
    dq, dk, dv, ds = (x.grad.numpy() for x in leaves)
    for impl in ("reference", "fused"):
        t.close(f"packed backward, {impl}", ["attend-backward", *inputs, *packed, "--causal", "--window", "2,0",
                                             "--sinks", "psinks.npy", "--dout", "pdout.npy", "--impl", impl,
                                             "--dq", "dq.npy", "--dk", "dk.npy", "--dv", "dv.npy", "--dsinks",
                                             "ds.npy"],
                {"dq.npy": dq, "dk.npy": dk, "dv.npy": dv, "ds.npy": ds}, tol=1e-9)

    # Offsets that do not describe a packed batch of these Q and K.
    bad = {
        "not increasing": (np.array([0, 5, 3, Tq]), "--cu-seqlens-q"),
        "not ending at Tq": (np.array([0, 3, Tq - 1]), "--cu-seqlens-q"),
        "not starting at 0": (np.array([1, 3, 8, 10, Tq]), "--cu-seqlens-q"),
        "of rank 2": (cu_q.reshape(1, -1), "--cu-seqlens-q"),
        "of one entry": (np.array([0]), "--cu-seqlens-q"),
    }
    for name, (offsets, option) in bad.items():
        t.save("bad_cu.npy", offsets.astype(np.int64))
        t.refuse(f"--cu-seqlens-q {name}", ["attend", *inputs, "--cu-seqlens-q", "bad_cu.npy", "--cu-seqlens-k",
                                            "cu_k_int64.npy", "-o", "o.npy"], option)
    t.save("bad_cu.npy", np.array([0, 4, 9, Tk - 1], dtype=np.int64))
    t.refuse("--cu-seqlens-k not ending at Tk", ["attend", *inputs, "--cu-seqlens-q", "cu_q_int64.npy",
                                                 "--cu-seqlens-k", "bad_cu.npy", "-o", "o.npy"], "--cu-seqlens-k")
    t.save("bad_cu.npy", np.array([0, 9, Tk], dtype=np.int64))
    t.refuse("fewer sequences of keys than of queries", ["attend", *inputs, "--cu-seqlens-q", "cu_q_int64.npy",
                                                         "--cu-seqlens-k", "bad_cu.npy", "-o", "o.npy"],
             "--cu-seqlens")
    t.save("pq_b2.npy", np.concatenate([q, q]))
    t.save("pk_b2.npy", np.concatenate([k, k]))
    t.save("pv_b2.npy", np.concatenate([v, v]))
    t.refuse("packed sequences with B = 2", ["attend", "--q", "pq_b2.npy", "--k", "pk_b2.npy", "--v", "pv_b2.npy",
                                             *packed, "-o", "o.npy"], "--cu-seqlens")


def dropout_checks(t, rng):
    H, Tq, Tk, D = 2, 48, 40, 8
    q = rng.standard_normal((1, H, Tq, D))
    k = rng.standard_normal((1, H, Tk, D))
    v = rng.standard_normal((1, H, Tk, 5))
    eye = np.broadcast_to(np.eye(Tk), (1, H, Tk, Tk)).copy()  # V = identity: out shows α·keep/(1 − p)
    dout = rng.standard_normal((1, H, Tq, Tk))
    for name, array in [("dq_in", q), ("dk_in", k), ("dv_in", v), ("eye", eye), ("ddout", dout)]:
        t.save(f"{name}.npy", array)
    attend = ["attend", "--q", "dq_in.npy", "--k", "dk_in.npy", "--v", "dv_in.npy"]
    identity = ["attend", "--q", "dq_in.npy", "--k", "dk_in.npy", "--v", "eye.npy"]

    t.same("the same seed drops the same weights", [*attend, "--dropout", "0.3", "--seed", "5"],
           [*attend, "--dropout", "0.3", "--seed", "5"])
    t.count += 1
    outs = []
    for seed in ("5", "6"):
        result = t.run([*attend, "--dropout", "0.3", "--seed", seed, "-o", "a.npy"])
        outs.append(np.load(t.path("a.npy")) if result.returncode == 0 else None)
    if any(o is None for o in outs) or np.array_equal(outs[0], outs[1]):
        t.fail("another seed drops other weights", "seeds 5 and 6 gave the same output (or a run failed)")
    else:
        print("ok   another seed drops other weights")
    t.same("--seed defaults to 0", [*attend, "--dropout", "0.3"], [*attend, "--dropout", "0.3", "--seed", "0"])
    for impl in ("fused", "reference"):
        t.same(f"p = 0 is exactly no dropout, {impl}", [*attend, "--impl", impl, "--dropout", "0", "--seed", "9"],
               [*attend, "--impl", impl])
    t.same("--weights are those before dropout", [*attend, "--dropout", "0.5", "--weights", "w.npy", "-o", "x.npy"],
           [*attend, "--weights", "w.npy", "-o", "x.npy"], output="w.npy")
    t.same("--lse is that before dropout", [*attend, "--dropout", "0.5", "--lse", "l.npy", "-o", "x.npy"],
           [*attend, "--lse", "l.npy", "-o", "x.npy"], output="l.npy")

    # The mask itself, through V = identity.
    p = 0.3
    masks = {}
    for impl in ("reference", "fused"):
        t.count += 1
        result = t.run([*identity, "--impl", impl, "--dropout", str(p), "--seed", "7", "-o", "o.npy"])
        weights_run = t.run([*identity, "--impl", "reference", "-o", "x.npy", "--weights", "w.npy"])
        if result.returncode != 0 or weights_run.returncode != 0:
            t.fail(f"{impl}: the dropout mask", "a run failed", result)
            continue
        out, alpha = np.load(t.path("o.npy")), np.load(t.path("w.npy"))
        kept = np.isclose(out, alpha / (1 - p), rtol=1e-12, atol=0)
        dropped = out == 0
        dropped_share = dropped.mean()
        if not (kept | dropped).all():
            t.fail(f"{impl}: the dropout mask", "some weights are neither kept whole (α/(1 − p)) nor dropped")
        elif abs(dropped_share - p) > 0.05:
            t.fail(f"{impl}: the dropout mask", f"{dropped_share:.3f} of the weights dropped, expected about {p}")
        else:
            masks[impl] = kept
            print(f"ok   {impl}: the dropout mask ({dropped_share:.3f} dropped, p = {p})")
    if len(masks) == 2:
        t.count += 1
        if np.array_equal(masks["reference"], masks["fused"]):
            print("ok   the fused kernel and the reference drop the same weights")
        else:
            t.fail("the fused kernel and the reference drop the same weights", "the masks differ")

    # The backward replays the forward's mask: the gradients of out = (α ∘ keep / (1 − p)) V.
    if "reference" in masks:
        keep = torch.from_numpy(masks["reference"].astype(np.float64))
        leaves = [t64(x).requires_grad_() for x in (q, k, eye)]
        _, alpha, _ = attention(*leaves)
        out = (alpha * keep / (1 - p)) @ leaves[2]
        (out * t64(dout)).sum().backward()
        dq, dk, dv = (x.grad.numpy() for x in leaves)
        for impl in ("reference", "fused"):
            t.close(f"{impl}: backward with dropout is the gradient of the masked forward",
                    ["attend-backward", "--q", "dq_in.npy", "--k", "dk_in.npy", "--v", "eye.npy", "--dout", "ddout.npy",
                     "--dropout", str(p), "--seed", "7", "--impl", impl, "--dq", "gq.npy", "--dk", "gk.npy", "--dv",
                     "gv.npy"], {"gq.npy": dq, "gk.npy": dk, "gv.npy": dv}, tol=1e-9)


def checks(t):
    rng = np.random.default_rng(23)
    packed_checks(t, rng)
    dropout_checks(t, rng)


if __name__ == "__main__":
    sys.exit(run_suite(VariantSuite, "qkv_attend_varlen_dropout_", checks))
