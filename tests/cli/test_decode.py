#!/usr/bin/env python3
"""`qkv decode`: new queries over keys and values stored as float32, float16, bfloat16 or int8,
attended as stored or through a paged KV cache of each type, against a float64 numpy reference on
the values the stored arrays stand for; and its refusals (exit 2, one line naming the option, no
file written).

The int8 files come from `qkv quantize` (keys per channel, values per token), the bfloat16 ones
too. An int8 cache quantises what it is given with its own scales, so it is held to the
quantisation's error against the float32 inputs, not to float32 rounding.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_decode.py
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import Suite, run_suite  # noqa: E402  (the harness sits beside this script)

# float32 accumulation over at most 61 keys of unit-size values, against float64.
TOL = 2e-5
# An int8 cache: one step of the page's scale on each key and value (up to 2 max|x| / 127), a few
# percent of the output here.
INT8_TOL = 5e-2


def attention(q, k, v, full=False, window=None, softcap=None, sinks=None, scale=None, mask=None, alibi=None):
    """float64 decode: q [H, Tq, D] as the last Tq tokens over k, v [Hkv, Tk, D]; mask: bool (may
    attend) or float (a bias), broadcasting to [H, Tq, Tk]; alibi: [H] slopes."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    h, tq, d = q.shape
    group = h // k.shape[0]
    k, v = np.repeat(k, group, 0), np.repeat(v, group, 0)
    tk = k.shape[1]
    s = q @ k.transpose(0, 2, 1) * (scale if scale is not None else 1 / np.sqrt(d))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(tq)[:, None] + tk - tq
    j = np.arange(tk)[None, :]
    visible = np.ones((tq, tk), bool) if full else j <= i
    if window:
        visible &= (j >= i - window[0]) & (j <= i + window[1])
    if alibi is not None:
        s = s - alibi[:, None, None] * np.abs(i - j)[None]
    if mask is not None and mask.dtype == bool:
        visible = visible[None] & mask
    elif mask is not None:
        s = s + mask
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=2, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[:, None, None])
    seen = np.isfinite(m)  # a query that sees no key: output 0, lse -inf
    m = np.where(seen, m, 0.0)
    e = np.exp(s - m)
    z = e.sum(axis=2, keepdims=True)
    if sinks is not None:
        z = z + np.exp(sinks[:, None, None] - m)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(seen, (e / np.where(seen, z, 1.0)) @ v, 0.0)
        lse = np.where(seen, m + np.log(z), -np.inf)
    return out, lse[..., 0]


def checks(s):
    rng = np.random.default_rng(17)
    h, hkv, tq, tk, d = 4, 2, 3, 61, 16
    q = rng.standard_normal((h, tq, d)).astype(np.float32)
    k = rng.standard_normal((hkv, tk, d)).astype(np.float32)
    k[:, :, 3] *= 8  # an outlier channel, as keys have
    v = rng.standard_normal((hkv, tk, d)).astype(np.float32)
    for name, a in (("q", q), ("k", k), ("v", v), ("q16", q.astype(np.float16)), ("k16", k.astype(np.float16)),
                    ("v16", v.astype(np.float16))):
        s.save(f"{name}.npy", a)
    k8 = s.quantized("k.npy", "int8", "k8.npy", "per-channel")
    v8 = s.quantized("v.npy", "int8", "v8.npy", "per-token")
    kb, vb = s.quantized("k.npy", "bf16", "kb.npy"), s.quantized("v.npy", "bf16", "vb.npy")
    load = lambda name: np.load(s.path(name))  # noqa: E731
    k16, v16, q16 = (load(f"{n}16.npy").astype(np.float32) for n in ("k", "v", "q"))

    def matches(want_q, want_k, want_v, tol=TOL, **options):
        want_out, want_lse = attention(want_q, want_k, want_v, **options)

        def check(_):
            out, lse = load("out.npy"), load("lse.npy")
            if out.shape != want_out.shape or out.dtype != np.float32:
                return f"out: shape {out.shape} {out.dtype}, expected {want_out.shape} float32"
            err = float(np.max(np.abs(out - want_out)))
            finite = np.isfinite(want_lse)
            if not np.array_equal(np.isfinite(lse), finite):
                return "lse: -inf where the reference has a finite value, or the other way round"
            lse_err = float(np.max(np.abs(lse[finite] - want_lse[finite])))
            if err > tol * max(1.0, float(np.max(np.abs(want_out)))) or lse_err > tol * float(
                    np.max(np.abs(want_lse[finite]))):
                return f"max error {err:.3g} (lse {lse_err:.3g}) > {tol}"
            return None
        return check

    stored = {
        "float32": (["--k", "k.npy", "--v", "v.npy"], k, v),
        "float16": (["--k", "k16.npy", "--v", "v16.npy"], k16, v16),
        "bfloat16": (["--k", "kb.npy", "--v", "vb.npy", "--dtype", "bf16"], kb, vb),
        "int8": (["--k", "k8.npy", "--k-scales", "k8s.npy", "--v", "v8.npy", "--v-scales", "v8s.npy"], k8, v8),
    }
    outputs = ["-o", "out.npy", "--lse", "lse.npy"]
    for name, (args, want_k, want_v) in stored.items():
        s.succeed(f"{name} K/V as stored", ["decode", "--q", "q.npy", *args, *outputs], matches(q, want_k, want_v))
        # A cache of the inputs' own type holds them exactly (int8: a cache of float32 does).
        cache = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int8": "f32"}[name]
        s.succeed(f"{name} K/V through a {cache} cache of 7-token pages",
                  ["decode", "--q", "q.npy", *args, "--cache", cache, "--page-tokens", "7", *outputs],
                  matches(q, want_k, want_v))
    s.succeed("an int8 cache of float32 K/V, 16-token pages",
              ["decode", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--cache", "int8", "--page-tokens", "16",
               *outputs], matches(q, k, v, tol=INT8_TOL))
    s.succeed("float16 queries", ["decode", "--q", "q16.npy", "--k", "k16.npy", "--v", "v16.npy", *outputs],
              matches(q16, k16, v16))

    # Three drafts verified in one step: draft 0 and its children 1 and 2 (a tree), each seeing the
    # sequence before them and its own branch; a bias per head and key; ALiBi's standard slopes.
    def tree(length):
        m = np.zeros((1, tq, length), bool)
        m[:, :, :length - tq] = True
        for i, branch in enumerate(((0,), (0, 1), (0, 2))):
            m[0, i, [length - tq + a for a in branch]] = True
        return m
    sinks = np.array([0.5, -1.0, 0.0, 2.0], np.float32)
    s.save("sinks.npy", sinks)
    options = ["--window", "20,0", "--softcap", "4", "--sinks", "sinks.npy", "--scale", "0.3"]
    s.succeed("window, softcap, sinks and scale, as stored",
              ["decode", "--q", "q.npy", "--k", "k16.npy", "--v", "v16.npy", *options, *outputs],
              matches(q, k16, v16, window=(20, 0), softcap=4.0, sinks=sinks.astype(np.float64), scale=0.3))
    s.succeed("window, softcap, sinks and scale, through an f16 cache",
              ["decode", "--q", "q.npy", "--k", "k16.npy", "--v", "v16.npy", "--cache", "f16", *options, *outputs],
              matches(q, k16, v16, window=(20, 0), softcap=4.0, sinks=sinks.astype(np.float64), scale=0.3))
    s.succeed("--full: every key", ["decode", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--full", *outputs],
              matches(q, k, v, full=True))

    bias = rng.standard_normal((h, 1, tk)).astype(np.float32)
    slopes = 2.0 ** (-8.0 / h * np.arange(1, h + 1))
    s.save("tree.npy", tree(tk))
    s.save("bias.npy", bias)
    s.save("slopes.npy", slopes.astype(np.float32))
    for cache in ([], ["--cache", "f16", "--page-tokens", "7"]):
        where = " through an f16 cache" if cache else ", as stored"
        s.succeed("a tree mask and ALiBi" + where,
                  ["decode", "--q", "q.npy", "--k", "k16.npy", "--v", "v16.npy", *cache, "--mask", "tree.npy",
                   "--alibi", "auto", *outputs], matches(q, k16, v16, mask=tree(tk), alibi=slopes))
        s.succeed("a bias and ALiBi slopes from a file" + where,
                  ["decode", "--q", "q.npy", "--k", "k16.npy", "--v", "v16.npy", *cache, "--mask", "bias.npy",
                   "--alibi", "slopes.npy", *outputs],
                  matches(q, k16, v16, mask=bias.astype(np.float64), alibi=slopes))
    blind = np.ones((h, tq, tk), np.uint8)
    blind[:, 1] = 0
    s.save("blind.npy", blind)
    s.succeed("a query the mask hides every key from", ["decode", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy",
                                                        "--mask", "blind.npy", *outputs],
              matches(q, k, v, mask=blind.astype(bool)))

    # A cache file kept across runs: a prompt of 40 tokens, then 20, then 1, is the cache of all 61
    # built in one run, bit for bit, in every type; the file grows its pool as the sequence does.
    for name, cut in (("k", k), ("v", v)):
        for part, (a, b) in enumerate(((0, 40), (40, 60), (60, tk))):
            s.save(f"{name}_part{part}.npy", cut[:, a:b])
    for cache in ("f32", "f16", "bf16", "int8"):
        whole = ["decode", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--cache", cache, "--page-tokens", "16",
                 "-o", "whole.npy", "--lse", "whole_lse.npy"]
        s.succeed(f"{cache} cache of all 61 tokens in one run", whole)
        state = f"state_{cache}.qkvc"
        for part in range(3):
            pages = ["--page-tokens", "16"] if part == 0 else []
            run = ["decode", "--q", "q.npy", "--k", f"k_part{part}.npy", "--v", f"v_part{part}.npy", "--cache", cache,
                   *pages, "--cache-file", state, *outputs]
            same = (lambda _: None if np.array_equal(load("out.npy"), load("whole.npy")) and
                    np.array_equal(load("lse.npy"), load("whole_lse.npy")) else "differs from the one-run cache")
            s.succeed(f"{cache} cache file, run {part + 1} of 3", run, same if part == 2 else None)
    # With a cache file, a mask covers the tokens the file held and the new ones.
    s.save("tree60.npy", tree(60))
    s.save("tree20.npy", tree(20))
    grown = ["--cache", "f32", "--cache-file", "state_mask.qkvc"]
    s.succeed("a cache file of 40 tokens", ["decode", "--q", "q.npy", "--k", "k_part0.npy", "--v", "v_part0.npy",
                                             *grown, *outputs])
    s.refuse("a mask of the new tokens alone", ["decode", "--q", "q.npy", "--k", "k_part1.npy", "--v", "v_part1.npy",
                                                *grown, "--mask", "tree20.npy", *outputs], "--mask", "[4, 3, 60]")
    s.succeed("a tree mask over the cache file's 40 tokens and 20 new ones",
              ["decode", "--q", "q.npy", "--k", "k_part1.npy", "--v", "v_part1.npy", *grown, "--mask", "tree60.npy",
               *outputs], matches(q, k[:, :60], v[:, :60], mask=tree(60)))
    s.save("v_part2_wide.npy", np.zeros((hkv, 1, d + 1), np.float32))
    more = ["decode", "--q", "q.npy", "-o", "out.npy"]
    new_token = ["--k", "k_part2.npy", "--v", "v_part2.npy"]
    s.refuse("another type than the cache file's", [*more, *new_token, "--cache", "f16", "--cache-file",
                                                    "state_int8.qkvc"], "--cache", "int8")
    s.refuse("other pages than the cache file's", [*more, *new_token, "--cache", "int8", "--page-tokens", "8",
                                                   "--cache-file", "state_int8.qkvc"], "--page-tokens", "16")
    s.refuse("values of another Dv than the cache file's",
             [*more, "--k", "k_part2.npy", "--v", "v_part2_wide.npy", "--cache", "int8", "--cache-file",
              "state_int8.qkvc"], "--v", "Dv = 16")
    s.refuse("--cache-file without --cache", [*more, *new_token, "--cache-file", "state_int8.qkvc"],
             "--cache-file", "--cache")
    with open(s.path("state_int8.qkvc"), "rb") as f:
        corrupt = bytearray(f.read())
    corrupt[100] ^= 0x40
    with open(s.path("corrupt.qkvc"), "wb") as f:
        f.write(bytes(corrupt))
    s.refuse("a corrupt cache file", [*more, *new_token, "--cache", "int8", "--cache-file", "corrupt.qkvc"],
             "--cache-file", "checksum")
    for f in ("out.npy", "lse.npy"):
        os.remove(s.path(f))

    # Refusals.
    base = ["decode", "--q", "q.npy", "-o", "out.npy"]
    nan_scales = load("k8s.npy").copy()
    nan_scales[0, 0, 2] = np.nan
    s.save("nan_scales.npy", nan_scales)
    k16_nan = k.astype(np.float16)
    k16_nan[1, 5, 0] = np.inf
    s.save("k16_nan.npy", k16_nan)
    s.save("q8.npy", np.zeros((h, tq, d), np.int8))
    s.save("k_wide.npy", np.zeros((hkv, tk, d + 1), np.float32))
    s.save("v_short.npy", v[:, :-1])
    s.save("scales_short.npy", np.ones((hkv, tk - 1, 1), np.float32))
    s.save("k3.npy", np.zeros((3, tk, d), np.float32))
    s.save("v3.npy", np.zeros((3, tk, d), np.float32))
    s.refuse("int8 K without its scales", [*base, "--k", "k8.npy", "--v", "v.npy"], "--k-scales", "int8")
    s.refuse("scales for a float16 K", [*base, "--k", "k16.npy", "--k-scales", "k8s.npy", "--v", "v.npy"],
             "--k-scales", "only int8")
    s.refuse("a '<u2' K without --dtype bf16", [*base, "--k", "kb.npy", "--v", "v.npy"], "--k", "--dtype bf16")
    s.refuse("--dtype bf16 with no '<u2' input", [*base, "--k", "k.npy", "--v", "v.npy", "--dtype", "bf16"],
             "--dtype")
    s.refuse("NaN among K's scales", [*base, "--k", "k8.npy", "--k-scales", "nan_scales.npy", "--v", "v.npy"],
             "--k-scales")
    s.refuse("V's scales of the wrong shape",
             [*base, "--k", "k.npy", "--v", "v8.npy", "--v-scales", "scales_short.npy"], "--v-scales", "broadcasts")
    s.refuse("an int8 Q", ["decode", "--q", "q8.npy", "--k", "k.npy", "--v", "v.npy", "-o", "out.npy"], "--q", "int8")
    s.refuse("an infinity in a float16 K", [*base, "--k", "k16_nan.npy", "--v", "v.npy"], "--k")
    s.refuse("K of another Dk", [*base, "--k", "k_wide.npy", "--v", "v.npy"], "--k", "Dk")
    s.refuse("V of another Tk", [*base, "--k", "k.npy", "--v", "v_short.npy"], "--v", "Tk")
    s.refuse("K's heads do not divide Q's", [*base, "--k", "k3.npy", "--v", "v3.npy"], "--k")
    s.refuse("an unknown cache type", [*base, "--k", "k.npy", "--v", "v.npy", "--cache", "f8"], "--cache")
    s.refuse("pages of no tokens", [*base, "--k", "k.npy", "--v", "v.npy", "--cache", "f16", "--page-tokens", "0"],
             "--page-tokens")
    s.refuse("--page-tokens without --cache", [*base, "--k", "k.npy", "--v", "v.npy", "--page-tokens", "8"],
             "--page-tokens", "--cache")
    s.refuse("sinks of the wrong length", [*base, "--k", "k.npy", "--v", "v.npy", "--sinks", "k8s.npy"], "--sinks")
    s.save("mask_short.npy", np.ones((1, tq, tk - 1), bool))
    bias_nan = bias.copy()
    bias_nan[2, 0, 9] = np.nan
    s.save("bias_nan.npy", bias_nan)
    s.save("mask16.npy", np.ones((1, tq, tk), np.float16))
    s.save("slopes3.npy", np.ones(3, np.float32))
    s.refuse("a mask of another Tk", [*base, "--k", "k.npy", "--v", "v.npy", "--mask", "mask_short.npy"], "--mask",
             f"[H, Tq, L] = [{h}, {tq}, {tk}]")
    s.refuse("a NaN in the bias", [*base, "--k", "k.npy", "--v", "v.npy", "--mask", "bias_nan.npy"], "--mask",
             "finite values or -inf")
    s.refuse("a float16 mask", [*base, "--k", "k.npy", "--v", "v.npy", "--mask", "mask16.npy"], "--mask", "bool")
    s.refuse("ALiBi slopes of the wrong length", [*base, "--k", "k.npy", "--v", "v.npy", "--alibi", "slopes3.npy"],
             "--alibi", f"[{h}]")
    s.refuse("ALiBi neither auto nor a file", [*base, "--k", "k.npy", "--v", "v.npy", "--alibi", "standard"],
             "--alibi", "auto")
    k_big = k.copy()
    k_big[1, 7, 4] = 7e4
    s.save("k_big.npy", k_big)
    s.refuse("a K value past float16's range for an f16 cache",
             [*base, "--k", "k_big.npy", "--v", "v.npy", "--cache", "f16"], "--k", "float16 cache", "70000")


if __name__ == "__main__":
    sys.exit(run_suite(Suite, "qkv-decode-", checks))
