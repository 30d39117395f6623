#!/usr/bin/env python3
"""The attention variants through `qkv attend` and `qkv attend-backward`: --window, --causal with
its alignment, --softcap, --alibi, --sinks and grouped-query attention (K and V with fewer heads,
from the shapes alone), each alone and combined, against a float64 PyTorch implementation written
out here from the formula; attend-backward's --dq, --dk, --dv and --dsinks against torch autograd in
float64; and every bad input to these options refused with exit code 2 and one line naming the
option. The packed sequences (--cu-seqlens-q/-k) and dropout, which the library does not implement
yet, are tested in test_attend_varlen_dropout.py; their refusals that the CLI makes from the options
alone are here.

Most inputs are float64, so the run is float64 end to end and the outputs agree with torch to
rounding; one float32 case holds the float32 kernels to float32's rounding.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_attend_variants.py
"""

import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import Suite, run_suite  # noqa: E402  (the harness sits beside this script)

TOL64 = 1e-10
TOL32 = 2e-5


def alibi_slopes(heads):
    """Press et al.'s slopes: 2^(-8(h+1)/n) for n a power of two; else those of the power of two
    below, then every other slope of the one above."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    below = 2 ** int(math.floor(math.log2(heads)))
    return np.array(power_of_two(below) + power_of_two(2 * below)[0::2][: heads - below])


def attention(q, k, v, *, causal=None, window=None, softcap=None, alibi=None, sinks=None, bias=None,
              allowed=None, additive=None):
    """(out, weights, lse) in float64 torch for [B, H, T, D] tensors. causal: None, "bottom-right"
    or "top-left"; window (L, R) with -1 unbounded; K and V may have a divisor of q's heads. A row
    that sees no key gets out 0, weights 0 and lse -inf (the sink, with sinks)."""
    heads, tq, tk = q.shape[1], q.shape[2], k.shape[2]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if additive is None:
        x = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
    else:
        w_q, w_k, w = additive
        x = torch.tanh((q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)) @ w
    offset = 0 if causal == "top-left" else tk - tq
    i = torch.arange(tq).view(tq, 1)
    j = torch.arange(tk).view(1, tk)
    visible = torch.ones(tq, tk, dtype=torch.bool)
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (j >= i + offset - left)
        if right >= 0:
            visible = visible & (j <= i + offset + right)
    if causal is not None:
        visible = visible & (j <= i + offset)
    if allowed is not None:
        visible = visible & allowed
    s = x
    if bias is not None:
        s = s + bias
    if alibi is not None:
        s = s - alibi.view(1, heads, 1, 1) * (i + offset - j).abs()
    s = s.masked_fill(~visible, -math.inf)
    logits = s
    if sinks is not None:
        logits = torch.cat([s, sinks.view(1, heads, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    seen = torch.isfinite(lse).unsqueeze(-1)
    weights = torch.where(seen, torch.exp(s - torch.where(seen, lse.unsqueeze(-1), torch.zeros(()))),
                          torch.zeros(()))
    return weights @ v, weights, lse


def t64(array):
    return torch.from_numpy(np.asarray(array, dtype=np.float64))


def as4(array):
    """An array of rank 2 to 4 seen as [B, H, T, D], as qkv reads it."""
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


class VariantSuite(Suite):
    def close(self, name, args, expected, tol=TOL64):
        """`qkv ARGS` exits 0 and each output file (name -> expected array) is within tol of expected,
        NaN-free, of its shape; lse -inf where expected."""
        def check(_):
            for path, want in expected.items():
                got = np.load(self.path(path))
                want = np.asarray(want)
                if got.shape != want.shape:
                    return f"{path}: shape {got.shape}, expected {want.shape}"
                if np.isnan(got).any():
                    return f"{path}: NaN in the output"
                if not np.array_equal(np.isinf(got), np.isinf(want)) or not np.array_equal(got[np.isinf(got)],
                                                                                         want[np.isinf(want)]):
                    return f"{path}: infinities differ from the expected ones"
                finite = np.isfinite(want)
                error = np.abs(got[finite] - want[finite]).max(initial=0.0)
                if error > tol:
                    return f"{path}: differs from torch by {error:.3g} (tolerance {tol:g})"
            return None
        self.succeed(name, args, check)

    def same(self, name, args_a, args_b, output="a.npy"):
        """Two runs give a bit-identical OUTPUT, which each writes with -o unless its args name the outputs."""
        self.count += 1
        results = []
        for args in (args_a, args_b):
            result = self.run(args if "-o" in args else [*args, "-o", output])
            if result.returncode != 0:
                return self.fail(name, f"exit code {result.returncode}", result)
            results.append(np.load(self.path(output)))
        if not np.array_equal(results[0], results[1]):
            return self.fail(name, f"outputs differ by {np.abs(results[0] - results[1]).max():.3g}")
        print(f"ok   {name}")


def checks(t):
    rng = np.random.default_rng(11)
    B, H, Tq, Tk, D, Dv = 2, 4, 5, 7, 8, 6
    save = t.save
    q = rng.standard_normal((B, H, Tq, D))
    k = rng.standard_normal((B, H, Tk, D))
    v = rng.standard_normal((B, H, Tk, Dv))
    k2, v2 = k[:, :2], v[:, :2]  # two K/V heads: query heads 0, 1 read kv head 0; 2, 3 read kv head 1
    k1, v1 = k[:, :1], v[:, :1]
    sinks = rng.standard_normal(H)
    slopes = rng.uniform(0.1, 1.0, H)
    bias = rng.standard_normal((1, H, Tq, Tk))
    for name, array in [("q", q), ("k", k), ("v", v), ("k2", k2), ("v2", v2), ("k1", k1), ("v1", v1),
                        ("sinks", sinks), ("slopes", slopes), ("bias", bias)]:
        save(f"{name}.npy", array)
    save("q_big.npy", 4.0 * q)  # large logits, where a softcap of 2 changes them
    dout = rng.standard_normal((B, H, Tq, Dv))
    save("dout.npy", dout)
    attend = ["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy"]
    tq_, tk_, tv_ = t64(q), t64(k), t64(v)

    def want(**kwargs):
        return attention(tq_, tk_, tv_, **kwargs)

    def outputs(out, weights=None, lse=None):
        files = {"o.npy": out.numpy()}
        if weights is not None:
            files["a.npy"] = weights.numpy()
        if lse is not None:
            files["l.npy"] = lse.numpy()
        return files

    all_outputs = ["-o", "o.npy", "--weights", "a.npy", "--lse", "l.npy"]

    # ---- Each variant alone, through the reference (which gives the weights) and the fused kernel.
    for impl in ("reference", "fused"):
        extra = all_outputs if impl == "reference" else ["-o", "o.npy", "--lse", "l.npy"]
        with_weights = impl == "reference"

        def expect(**kwargs):
            out, weights, lse = want(**kwargs)
            return outputs(out, weights if with_weights else None, lse)

        for window in [(2, 1), (0, 0), (-1, 0), (3, -1), (1, 100)]:
            text = f"{window[0]},{window[1]}"
            t.close(f"{impl}: --window {text} (bottom-right, Tq < Tk)",
                    [*attend, "--impl", impl, f"--window={text}", *extra], expect(window=window))
        t.close(f"{impl}: --causal top-left (Tq < Tk: the last keys unseen)",
                [*attend, "--impl", impl, "--causal", "top-left", *extra], expect(causal="top-left"))
        t.close(f"{impl}: --causal bottom-right", [*attend, "--impl", impl, "--causal", "bottom-right", *extra],
                expect(causal="bottom-right"))
        t.close(f"{impl}: --causal top-left --window 1,0 (a band from the top-left diagonal)",
                [*attend, "--impl", impl, "--causal", "top-left", "--window", "1,0", *extra],
                expect(causal="top-left", window=(1, 0)))
        out, weights, lse = attention(4.0 * tq_, tk_, tv_, softcap=2.0)
        t.close(f"{impl}: --softcap 2", ["attend", "--q", "q_big.npy", "--k", "k.npy", "--v", "v.npy", "--impl", impl,
                                         "--softcap", "2", *extra],
                outputs(out, weights if with_weights else None, lse))
        t.close(f"{impl}: --alibi auto (the standard slopes)", [*attend, "--impl", impl, "--alibi", "auto", *extra],
                expect(alibi=t64(alibi_slopes(H))))
        t.close(f"{impl}: --alibi SLOPES.npy", [*attend, "--impl", impl, "--alibi", "slopes.npy", *extra],
                expect(alibi=t64(slopes)))
        t.close(f"{impl}: --sinks (lse includes the sink, rows sum to less than 1)",
                [*attend, "--impl", impl, "--sinks", "sinks.npy", *extra], expect(sinks=t64(sinks)))
        for kv, (kf, vf) in [(2, ("k2.npy", "v2.npy")), (1, ("k1.npy", "v1.npy"))]:
            out, weights, lse = attention(tq_, t64(k[:, :kv]), t64(v[:, :kv]))
            t.close(f"{impl}: grouped-query attention from the shapes, {kv} K/V head(s) for {H}",
                    ["attend", "--q", "q.npy", "--k", kf, "--v", vf, "--impl", impl, *extra],
                    outputs(out, weights if with_weights else None, lse))

    # --causal alone is bottom-right, today's behaviour, and differs from top-left when Tq < Tk.
    t.same("--causal alone is --causal bottom-right", [*attend, "--causal"], [*attend, "--causal", "bottom-right"])
    t.close("--causal alone (bottom-right)", [*attend, "--causal", "-o", "o.npy"],
            outputs(want(causal="bottom-right")[0]))

    # GQA in rank 3 ([H, T, D]) too, and with Tq == Tk.
    save("q3.npy", q[0])
    save("k3.npy", k2[0, :, :Tq])
    save("v3.npy", v2[0, :, :Tq])
    out, _, _ = attention(t64(q[:1]), t64(k2[:1, :, :Tq]), t64(v2[:1, :, :Tq]), causal="bottom-right")
    t.close("grouped-query attention of rank 3, causal", ["attend", "--q", "q3.npy", "--k", "k3.npy", "--v", "v3.npy",
                                                          "--causal", "-o", "o.npy"], {"o.npy": out[0].numpy()})

    # A row that the window and the mask leave without a key: output 0, lse -inf, or the sink's logit.
    allowed = np.ones((Tq, Tk), dtype=bool)
    allowed[1, 3] = False  # row 1's one key of window (0, 0) is key 1 + Tk - Tq = 3
    save("allowed.npy", allowed)
    for impl in ("reference", "fused"):
        extra = all_outputs if impl == "reference" else ["-o", "o.npy", "--lse", "l.npy"]
        out, weights, lse = want(window=(0, 0), allowed=torch.from_numpy(allowed))
        t.close(f"{impl}: a row left without keys", [*attend, "--impl", impl, "--window", "0,0", "--mask",
                                                     "allowed.npy", *extra],
                outputs(out, weights if impl == "reference" else None, lse))
        out, weights, lse = want(window=(0, 0), allowed=torch.from_numpy(allowed), sinks=t64(sinks))
        t.close(f"{impl}: a row left without keys, with sinks", [*attend, "--impl", impl, "--window", "0,0", "--mask",
                                                                 "allowed.npy", "--sinks", "sinks.npy", *extra],
                outputs(out, weights if impl == "reference" else None, lse))

    # ---- Everything at once: GQA, causal top-left, a window, softcap, ALiBi, sinks and a float mask.
    combined = dict(causal="top-left", window=(3, 0), softcap=3.0, alibi=t64(alibi_slopes(H)), sinks=t64(sinks),
                    bias=t64(bias))
    combined_args = ["--causal", "top-left", "--window", "3,0", "--softcap", "3", "--alibi", "auto", "--sinks",
                     "sinks.npy", "--mask", "bias.npy"]
    grouped = ["attend", "--q", "q.npy", "--k", "k2.npy", "--v", "v2.npy"]
    out, weights, lse = attention(tq_, t64(k2), t64(v2), **combined)
    t.close("combined, reference", [*grouped, *combined_args, "--impl", "reference", *all_outputs],
            outputs(out, weights, lse))
    t.close("combined, fused", [*grouped, *combined_args, "--impl", "fused", "-o", "o.npy", "--lse", "l.npy"],
            outputs(out, None, lse))
    # float32 inputs: the float32 kernels, to float32's rounding.
    for name in ("q", "k2", "v2", "sinks", "bias"):
        save(f"{name}_f32.npy", np.load(t.path(f"{name}.npy")).astype(np.float32))
    f32 = {name: t64(np.load(t.path(f"{name}_f32.npy"))) for name in ("q", "k2", "v2", "sinks", "bias")}
    out32, _, lse32 = attention(f32["q"], f32["k2"], f32["v2"], **{**combined, "sinks": f32["sinks"],
                                                                    "bias": f32["bias"]})
    args32 = ["attend", "--q", "q_f32.npy", "--k", "k2_f32.npy", "--v", "v2_f32.npy", "--causal", "top-left",
              "--window", "3,0", "--softcap", "3", "--alibi", "auto", "--sinks", "sinks_f32.npy", "--mask",
              "bias_f32.npy", "-o", "o.npy", "--lse", "l.npy"]
    for impl in ("fused", "reference"):
        t.close(f"combined in float32, {impl}", [*args32, "--impl", impl], outputs(out32, None, lse32), tol=TOL32)

    # --weights and --heatmap with variants come from the reference under --impl auto.
    t.close("--weights with variants under --impl auto", [*grouped, *combined_args, *all_outputs],
            outputs(out, weights, lse))
    t.succeed("--heatmap with variants", [*grouped, *combined_args, "-o", "o.npy", "--heatmap", "h.svg"],
              lambda _: None if open(t.path("h.svg")).read().lstrip().startswith("<") else "h.svg is not an SVG")
    os.remove(t.path("h.svg"))

    # ---- --score additive takes the window, the alignment and ALiBi (all three are the mask's).
    A = 5
    w_q, w_k, w = rng.standard_normal((A, D)), rng.standard_normal((A, D)), rng.standard_normal(A)
    for name, array in [("wq", w_q), ("wk", w_k), ("ww", w)]:
        save(f"{name}.npy", array.astype(np.float32))
    additive = ["--score", "additive", "--wq", "wq.npy", "--wk", "wk.npy", "--ww", "ww.npy"]
    q32, k32, v32 = (t64(x.astype(np.float32)) for x in (q, k, v))
    weights32 = tuple(t64(np.load(t.path(f"{n}.npy"))) for n in ("wq", "wk", "ww"))
    out, weights, lse = attention(q32, k32, v32, causal="top-left", window=(2, 0), alibi=t64(alibi_slopes(H)),
                                  additive=weights32)
    t.close("--score additive with --causal top-left, --window and --alibi auto",
            [*attend, *additive, "--causal", "top-left", "--window", "2,0", "--alibi", "auto", *all_outputs],
            outputs(out, weights, lse), tol=TOL32)

    # ---- An int32 mask, now that the reader takes int32, means what an int64 one does.
    save("allowed_i32.npy", allowed.astype(np.int32))
    t.same("an int32 mask is the bool mask", [*attend, "--mask", "allowed_i32.npy"], [*attend, "--mask", "allowed.npy"])

    # ---- attend-backward: dQ, dK, dV and dsinks against torch autograd, float64.
    def gradients(kk, vv, **kwargs):
        leaves = [t64(x).requires_grad_() for x in (q, kk, vv, sinks)]
        out, _, _ = attention(*leaves[:3], sinks=leaves[3], **kwargs)
        (out * t64(dout)).sum().backward()
        return [x.grad.numpy() for x in leaves]

    grads_out = ["--dq", "dq.npy", "--dk", "dk.npy", "--dv", "dv.npy", "--dsinks", "ds.npy"]
    for impl in ("reference", "fused"):
        dq, dk, dv, ds = gradients(k, v)
        t.close(f"{impl}: backward with --sinks: dq, dk, dv, dsinks",
                ["attend-backward", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--dout", "dout.npy",
                 "--sinks", "sinks.npy", "--impl", impl, *grads_out],
                {"dq.npy": dq, "dk.npy": dk, "dv.npy": dv, "ds.npy": ds}, tol=1e-9)
        dq, dk, dv, ds = gradients(k2, v2, **{key: value for key, value in combined.items() if key != "sinks"})
        t.close(f"{impl}: backward of everything at once (GQA: dk, dv summed over each group)",
                ["attend-backward", "--q", "q.npy", "--k", "k2.npy", "--v", "v2.npy", "--dout", "dout.npy",
                 *combined_args, "--impl", impl, *grads_out],
                {"dq.npy": dq, "dk.npy": dk, "dv.npy": dv, "ds.npy": ds}, tol=1e-9)

    # ---- Refusals: exit 2, one line naming the option, nothing written.
    for text, mention in [("5", "two integers"), ("a,b", "two integers"), ("1,2,3", "two integers"),
                          ("-2,0", "-1 (unbounded) or at least 0"),
                          ("0,-5", "-1 (unbounded) or at least 0")]:
        t.refuse(f"--window {text!r}", [*attend, f"--window={text}", "-o", "o.npy"], "--window:", mention,
                 f"got {text}")
    t.refuse("--causal sideways", [*attend, "--causal", "sideways", "-o", "o.npy"], "--causal", "sideways")
    for value in ["0", "-1", "inf", "nan"]:
        t.refuse(f"--softcap {value}", [*attend, "--softcap", value, "-o", "o.npy"], "--softcap:", "positive finite")
    t.refuse("--softcap not a number", [*attend, "--softcap", "big", "-o", "o.npy"], "--softcap")
    t.refuse("--alibi foo (neither auto nor a file)", [*attend, "--alibi", "foo", "-o", "o.npy"], "--alibi:", "foo",
             "auto")
    save("four_by_two.npy", np.ones((4, 2)))
    t.refuse("--alibi of the wrong shape", [*attend, "--alibi", "four_by_two.npy", "-o", "o.npy"], "--alibi:",
             "[4]", "[4, 2]")
    save("sinks3.npy", np.zeros(3))
    t.refuse("--sinks of H - 1", [*attend, "--sinks", "sinks3.npy", "-o", "o.npy"], "--sinks:", "[4]", "[3]")
    save("sinks_int.npy", np.zeros(H, dtype=np.int64))
    t.refuse("--sinks of integers", [*attend, "--sinks", "sinks_int.npy", "-o", "o.npy"], "--sinks:", "int64")
    save("sinks_nan.npy", np.array([0.0, np.nan, 0.0, 0.0]))
    t.refuse("--sinks with NaN", [*attend, "--sinks", "sinks_nan.npy", "-o", "o.npy"], "--sinks", "allow-nonfinite")
    save("slopes_inf.npy", np.array([0.5, np.inf, 0.5, 0.5]))
    t.refuse("--alibi with inf", [*attend, "--alibi", "slopes_inf.npy", "-o", "o.npy"], "--alibi", "allow-nonfinite")
    # A sink of -inf is no sink at all: accepted with --allow-nonfinite.
    save("sinks_minf.npy", np.full(H, -np.inf))
    t.close("--sinks of -inf with --allow-nonfinite is no sink",
            [*attend, "--sinks", "sinks_minf.npy", "--allow-nonfinite", "-o", "o.npy"], outputs(want()[0]))
    save("k3h.npy", k[:, :3])
    save("v3h.npy", v[:, :3])
    t.refuse("H not a multiple of Hkv (the library's message)",
             ["attend", "--q", "q.npy", "--k", "k3h.npy", "--v", "v3h.npy", "-o", "o.npy"], "--k:",
             "not a multiple of", "4", "3")
    t.refuse("V with other heads than K", ["attend", "--q", "q.npy", "--k", "k2.npy", "--v", "v.npy", "-o", "o.npy"],
             "--v:", str([B, 2, Tk, Dv]))
    for value in ["1", "-0.1", "1.5", "nan"]:
        t.refuse(f"--dropout {value}", [*attend, "--dropout", value, "-o", "o.npy"], "--dropout:", "[0, 1)")
    t.refuse("--seed without --dropout", [*attend, "--seed", "3", "-o", "o.npy"], "--seed:", "--dropout")
    t.refuse("--seed -1", [*attend, "--dropout", "0.1", "--seed", "-1", "-o", "o.npy"], "--seed", "0 to")
    save("cu.npy", np.array([0, 2, Tq], dtype=np.int64))
    t.refuse("--cu-seqlens-q alone", [*attend, "--cu-seqlens-q", "cu.npy", "-o", "o.npy"], "--cu-seqlens-k:",
             "both", "only --cu-seqlens-q")
    t.refuse("--cu-seqlens-k alone", [*attend, "--cu-seqlens-k", "cu.npy", "-o", "o.npy"], "--cu-seqlens-q:",
             "both", "only --cu-seqlens-k")
    save("cu_float.npy", np.array([0.0, 2.0, 5.0]))
    t.refuse("--cu-seqlens-q of floats", [*attend, "--cu-seqlens-q", "cu_float.npy", "--cu-seqlens-k", "cu.npy", "-o",
                                          "o.npy"], "--cu-seqlens-q:", "int32 or int64", "float64")
    save("cu_i16.npy", np.array([0, 2, 5], dtype=np.int16))
    t.refuse("--cu-seqlens-k of int16", [*attend, "--cu-seqlens-q", "cu.npy", "--cu-seqlens-k", "cu_i16.npy", "-o",
                                         "o.npy"], "--cu-seqlens-k:", "int32 or int64")
    additive_attend = [*attend, *additive, "-o", "o.npy"]
    t.refuse("--softcap with --score additive", [*additive_attend, "--softcap", "3"], "--softcap:", "--score dot")
    t.refuse("--sinks with --score additive", [*additive_attend, "--sinks", "sinks.npy"], "--sinks:", "--score dot")
    t.refuse("--dropout with --score additive", [*additive_attend, "--dropout", "0.1"], "--dropout:", "--score dot")
    t.refuse("GQA with --score additive", ["attend", "--q", "q.npy", "--k", "k2.npy", "--v", "v2.npy", *additive,
                                           "-o", "o.npy"], "--k:", "additive")
    backward = ["attend-backward", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--dout", "dout.npy"]
    t.refuse("--dsinks without --sinks", [*backward, "--dq", "dq2.npy", "--dsinks", "ds2.npy"], "--dsinks:",
             "--sinks")
    t.refuse("backward: --sinks of the wrong shape", [*backward, "--sinks", "sinks3.npy", "--dsinks", "ds2.npy"],
             "--sinks:", "[4]")
    t.refuse("backward: --window -2,0", [*backward, "--window=-2,0", "--dq", "dq2.npy"], "--window:")
    t.refuse("backward: --sinks with --score additive", [*backward, *additive, "--sinks", "sinks.npy", "--dq",
                                                         "dq2.npy"], "--sinks:")


if __name__ == "__main__":
    sys.exit(run_suite(VariantSuite, "qkv_attend_variants_", checks))
