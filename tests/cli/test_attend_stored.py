#!/usr/bin/env python3
"""`qkv attend` and `qkv attend-backward` on Q, K and V stored narrower than float32: float16,
bfloat16 ('<u2' bits with --dtype bf16) and int8 with scales (made by `qkv quantize`), each operand
in its own type, against a float64 numpy reference on the values the files stand for; the fused
output is the float32 run on those values, bit for bit; and the refusals (exit 2, one line naming
the option, no file written).

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_attend_stored.py
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import Suite, run_suite  # noqa: E402  (the harness sits beside this script)

# float32 accumulation over at most 29 keys of unit-size values, against float64.
TOL = 2e-5


def attention(q, k, v, causal=False, mask=None):
    """float64 (out, lse, weights) of q [..., H, Tq, D] over k, v [..., Hkv, Tk, D], bottom-right causal."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, -3), np.repeat(v, group, -3)
    tq, tk = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    visible = np.ones((tq, tk), bool)
    if causal:
        visible = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + tk - tq
    if mask is not None:
        visible = visible & mask
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    return (e / z) @ v, (m + np.log(z))[..., 0], e / z


def gradients(q, k, v, dout, causal=False):
    """float64 (dq, dk, dv) of sum(dout * out), summed over each group's query heads for dk and dv."""
    _, _, p = attention(q, k, v, causal)
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    group = q.shape[-3] // k.shape[-3]
    kr, vr = np.repeat(k, group, -3), np.repeat(v, group, -3)
    scale = 1 / np.sqrt(q.shape[-1])
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(vr, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq, dk = ds @ kr * scale, np.swapaxes(ds, -1, -2) @ q * scale
    fold = lambda x: x.reshape(*x.shape[:-3], -1, group, *x.shape[-2:]).sum(axis=-3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def checks(s):
    rng = np.random.default_rng(23)
    b, h, hkv, tq, tk, d, dv = 2, 4, 2, 6, 29, 16, 8
    q = rng.standard_normal((b, h, tq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, tk, d)).astype(np.float32)
    k[..., 3] *= 8  # an outlier channel, as keys have
    v = rng.standard_normal((b, hkv, tk, dv)).astype(np.float32)
    dout = rng.standard_normal((b, h, tq, dv)).astype(np.float32)
    for name, a in (("q", q), ("k", k), ("v", v), ("dout", dout), ("q16", q.astype(np.float16)),
                    ("k16", k.astype(np.float16)), ("v16", v.astype(np.float16))):
        s.save(f"{name}.npy", a)
    k8 = s.quantized("k.npy", "int8", "k8.npy", "per-channel")
    v8 = s.quantized("v.npy", "int8", "v8.npy", "per-token")
    qb, vb = s.quantized("q.npy", "bf16", "qb.npy"), s.quantized("v.npy", "bf16", "vb.npy")
    load = lambda name: np.load(s.path(name))  # noqa: E731
    q16, k16, v16 = (load(f"{n}16.npy").astype(np.float32) for n in ("q", "k", "v"))
    # The values as float32 files: the fused run on them is the one on the stored files.
    for name, a in (("k8f", k8), ("v8f", v8), ("qbf", qb), ("vbf", vb), ("q16f", q16), ("k16f", k16),
                    ("v16f", v16)):
        s.save(f"{name}.npy", a)

    def close(name, want, tol=TOL):
        def check(_):
            got = load(name)
            if got.shape != want.shape or got.dtype != np.float32:
                return f"{name}: shape {got.shape} {got.dtype}, expected {want.shape} float32"
            err = float(np.max(np.abs(got - want)))
            if err > tol * max(1.0, float(np.max(np.abs(want)))):
                return f"{name}: max error {err:.3g} > {tol}"
            return None
        return check

    def all_of(*checks):
        def check(result):
            return next((m for m in (c(result) for c in checks) if m), None)
        return check

    cases = {
        "float16 Q, K, V": (["--q", "q16.npy", "--k", "k16.npy", "--v", "v16.npy"], (q16, k16, v16),
                            ["--q", "q16f.npy", "--k", "k16f.npy", "--v", "v16f.npy"]),
        "bfloat16 Q and V, float16 K": (["--q", "qb.npy", "--k", "k16.npy", "--v", "vb.npy", "--dtype", "bf16"],
                                        (qb, k16, vb), ["--q", "qbf.npy", "--k", "k16f.npy", "--v", "vbf.npy"]),
        "int8 K and V": (["--q", "q.npy", "--k", "k8.npy", "--k-scales", "k8s.npy", "--v", "v8.npy", "--v-scales",
                          "v8s.npy"], (q, k8, v8), ["--q", "q.npy", "--k", "k8f.npy", "--v", "v8f.npy"]),
    }
    for label, (args, (wq, wk, wv), float_args) in cases.items():
        out, lse, _ = attention(wq, wk, wv, causal=True)
        s.succeed(f"{label}, causal", ["attend", *args, "--causal", "-o", "out.npy", "--lse", "lse.npy"],
                  all_of(close("out.npy", out), close("lse.npy", lse)))
        s.succeed(f"{label}: the float32 run on the values they stand for",
                  ["attend", *float_args, "--causal", "-o", "float.npy", "--lse", "float_lse.npy"],
                  lambda _: None if np.array_equal(load("float.npy"), load("out.npy")) else "outputs differ")
        dq, dk, dv_ = gradients(wq, wk, wv, dout, causal=True)
        s.succeed(f"{label}, backward", ["attend-backward", *args, "--causal", "--dout", "dout.npy", "--dq", "dq.npy",
                                         "--dk", "dk.npy", "--dv", "dv.npy"],
                  all_of(close("dq.npy", dq), close("dk.npy", dk), close("dv.npy", dv_)))
    mask = rng.random((tq, tk)) < 0.6
    s.save("mask.npy", mask)
    out, _, weights = attention(q16, k8, v16, mask=mask)
    s.succeed("float16 Q and V, int8 K, with a mask and the weights",
              ["attend", "--q", "q16.npy", "--k", "k8.npy", "--k-scales", "k8s.npy", "--v", "v16.npy", "--mask",
               "mask.npy", "-o", "out.npy", "--weights", "weights.npy"],
              all_of(close("out.npy", out), close("weights.npy", weights)))

    # Without --lse the kernels read the files in place by the library's own rules: bfloat16 Q, K and
    # V may take the CPU's bf16 dot product, which rounds the weights to bfloat16 before they meet V
    # (out moves by at most 2^-8 of sum_j P_ij |v_j| on top of float32's error), and int8 K and V for
    # a few queries scale the query and the weights instead of each element.
    kb = s.quantized("k.npy", "bf16", "kb.npy")
    out, _, p = attention(qb, kb, vb, causal=True)
    bf16_tol = TOL + 2.0 ** -8 * float(np.max(p @ np.abs(np.repeat(vb.astype(np.float64), h // hkv, -3))))
    s.succeed("bfloat16 Q, K, V without --lse", ["attend", "--q", "qb.npy", "--k", "kb.npy", "--v", "vb.npy",
                                                 "--dtype", "bf16", "--causal", "-o", "out.npy"],
              close("out.npy", out, bf16_tol))
    out, _, _ = attention(q, k8, v8)
    s.succeed("int8 K and V without --lse", ["attend", "--q", "q.npy", "--k", "k8.npy", "--k-scales", "k8s.npy",
                                             "--v", "v8.npy", "--v-scales", "v8s.npy", "-o", "out.npy"],
              close("out.npy", out))
    # The backward reads them in place too, with the float32 backward's bits on their values; bfloat16
    # Q and K may sum their scores in pairs on the bf16 dot product, within the reference's rule.
    s.save("kbf.npy", kb)
    for name, args in (("stored", ["--q", "qb.npy", "--k", "k16.npy", "--v", "vb.npy", "--dtype", "bf16"]),
                       ("float", ["--q", "qbf.npy", "--k", "k16f.npy", "--v", "vbf.npy"])):
        s.succeed(f"bfloat16 Q and V, float16 K, backward ({name} files)",
                  ["attend-backward", *args, "--causal", "--dout", "dout.npy", "--dq", f"dq_{name}.npy", "--dk",
                   f"dk_{name}.npy", "--dv", f"dv_{name}.npy"])
    same = all(np.array_equal(load(f"{g}_stored.npy"), load(f"{g}_float.npy")) for g in ("dq", "dk", "dv"))
    dq, dk, dv_ = gradients(qb, kb, vb, dout, causal=True)
    s.succeed("the stored backward gives the float32 backward's bits; bfloat16 Q, K, V within the rule",
              ["attend-backward", "--q", "qb.npy", "--k", "kb.npy", "--v", "vb.npy", "--dtype", "bf16", "--causal",
               "--dout", "dout.npy", "--dq", "dq.npy", "--dk", "dk.npy", "--dv", "dv.npy"],
              all_of(lambda _: None if same else "dq, dk or dv differ from the float32 files' run",
                     close("dq.npy", dq), close("dk.npy", dk), close("dv.npy", dv_)))
    # Five dims [L, B, H, T, D], run as [L·B, H, T, D]: the float32 run's bits; int8 is refused there.
    s.save("q5.npy", q.reshape(1, b, h, tq, d))
    s.save("k5.npy", k8.reshape(1, b, hkv, tk, d).astype(np.float16))
    s.save("v5.npy", v.reshape(1, b, hkv, tk, dv))
    s.save("k5f.npy", k8.reshape(1, b, hkv, tk, d).astype(np.float16).astype(np.float32))
    s.succeed("five dims, float16 K", ["attend", "--q", "q5.npy", "--k", "k5.npy", "--v", "v5.npy", "-o", "o5.npy"])
    s.succeed("five dims: the float32 run's bits",
              ["attend", "--q", "q5.npy", "--k", "k5f.npy", "--v", "v5.npy", "-o", "o5f.npy"],
              lambda _: None if np.array_equal(load("o5.npy"), load("o5f.npy")) else "outputs differ")

    s.save("k8_5.npy", np.load(s.path("k8.npy")).reshape(1, b, hkv, tk, d))
    s.save("k8s_5.npy", np.load(s.path("k8s.npy"))[None])
    s.refuse("an int8 K of five dims", ["attend", "--q", "q5.npy", "--k", "k8_5.npy", "--k-scales", "k8s_5.npy", "--v",
                                        "v5.npy", "-o", "x.npy"], "--k", "at most four dims", "[1, 2, 2, 29, 16]")

    # Refusals.
    for f in ("out.npy", "lse.npy"):
        os.remove(s.path(f))
    base = ["attend", "--q", "q.npy", "-o", "out.npy"]
    s.save("q8.npy", np.zeros((b, h, tq, d), np.int8))
    s.refuse("int8 K without its scales", [*base, "--k", "k8.npy", "--v", "v.npy"], "--k-scales", "int8")
    s.refuse("scales for a float16 K", [*base, "--k", "k16.npy", "--k-scales", "k8s.npy", "--v", "v.npy"],
             "--k-scales", "only int8")
    s.refuse("a '<u2' V without --dtype bf16", [*base, "--k", "k.npy", "--v", "vb.npy"], "--v", "--dtype bf16")
    s.refuse("--dtype bf16 with no '<u2' input", [*base, "--k", "k.npy", "--v", "v.npy", "--dtype", "bf16"],
             "--dtype")
    s.refuse("an int8 Q", ["attend", "--q", "q8.npy", "--k", "k.npy", "--v", "v.npy", "-o", "out.npy"], "--q", "int8")
    s.refuse("V's scales of the wrong shape", [*base, "--k", "k.npy", "--v", "v8.npy", "--v-scales", "k8s.npy"],
             "--v-scales", "broadcasts")
    s.refuse("stored inputs with --distributed ring",
             [*base, "--k", "k8.npy", "--k-scales", "k8s.npy", "--v", "v.npy", "--distributed", "ring"],
             "--distributed", "int8")


if __name__ == "__main__":
    sys.exit(run_suite(Suite, "qkv-attend-stored-", checks))
