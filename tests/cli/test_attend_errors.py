#!/usr/bin/env python3
"""Bad input to `qkv attend` and `qkv attend-backward`, and a happy path of each.

Every refusal must exit with code 2, print one error line that names the option at fault, and
leave the working directory exactly as it was: no output, no temporary file, even when the bad
option is the second of two outputs. The happy paths check the outputs' shapes and a few values
against numpy, so that a refusal test cannot pass by the tool refusing everything.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_attend_errors.py
"""

import os
import resource
import signal
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import QKV, Suite  # noqa: E402  (the harness sits beside this script)


class AttendSuite(Suite):
    def write_bytes(self, name, data):
        with open(self.path(name), "wb") as f:
            f.write(data)
        return name


def softmax_attention(q, k, v, scale, mask=None):
    """float64 numpy reference for the happy paths (no fully masked rows)."""
    s = scale * (q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2))
    if mask is not None:
        s = s + mask
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v.astype(np.float64), p


def main():
    if not QKV or not os.access(QKV, os.X_OK):
        print(f"QKV_BIN must name the qkv binary, got {QKV!r}")
        return 1
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory(prefix="qkv_attend_errors_") as workdir:
        t = AttendSuite(workdir)
        f32 = np.float32
        B, H, Tq, Tk, Dk, Dv, A = 2, 3, 5, 7, 4, 6, 8
        t.save("q.npy", rng.standard_normal((B, H, Tq, Dk)).astype(f32))
        t.save("k.npy", rng.standard_normal((B, H, Tk, Dk)).astype(f32))
        t.save("v.npy", rng.standard_normal((B, H, Tk, Dv)).astype(f32))
        t.save("dout.npy", rng.standard_normal((B, H, Tq, Dv)).astype(f32))
        t.save("bias.npy", rng.standard_normal((1, H, Tq, Tk)).astype(f32))
        t.save("allowed.npy", rng.random((Tq, Tk)) < 0.7)
        t.save("wq.npy", rng.standard_normal((A, Dk)).astype(f32))
        t.save("wk.npy", rng.standard_normal((A, Dk)).astype(f32))
        t.save("ww.npy", rng.standard_normal((A,)).astype(f32))
        os.mkdir(t.path("outdir"))
        qkv = ["--q", "q.npy", "--k", "k.npy", "--v", "v.npy"]
        attend = ["attend", *qkv]
        backward = ["attend-backward", *qkv, "--dout", "dout.npy"]
        additive = ["--score", "additive", "--wq", "wq.npy", "--wk", "wk.npy", "--ww", "ww.npy"]

        # ---- Files that cannot be read, or are not .npy arrays qkv takes.
        t.refuse("missing input file", ["attend", "--q", "nope.npy", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "nope.npy")
        t.refuse("input is a directory", ["attend", "--q", "q.npy", "--k", "outdir", "--v", "v.npy", "-o", "o.npy"],
                 "--k:", "outdir")
        t.write_bytes("garbage.npy", b"this is not an npy file at all")
        t.refuse("not an npy file", ["attend", "--q", "q.npy", "--k", "k.npy", "--v", "garbage.npy", "-o", "o.npy"],
                 "--v:", "garbage.npy")
        with open(t.path("q.npy"), "rb") as f:
            t.write_bytes("truncated.npy", f.read()[:-10])
        t.refuse("truncated npy", ["attend", "--q", "truncated.npy", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "truncated")
        # numpy refuses to make this shape (its strides overflow int64), so the 128 bytes are written by hand.
        header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 0), }"
        header += b" " * (128 - 10 - len(header) - 1) + b"\n"
        t.write_bytes("huge_empty.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
        t.refuse("empty npy whose dims overflow int64",
                 ["attend", "--q", "huge_empty.npy", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "huge_empty.npy", "(4294967296, 4294967296, 0)")
        t.save("q_i64.npy", np.ones((B, H, Tq, Dk), dtype=np.int64))
        t.refuse("int64 Q", ["attend", "--q", "q_i64.npy", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "int64", "float32")
        # A float32 run rounds a float64 mask: a value beyond float32's range would become an infinity.
        t.save("bias_big.npy", np.full((Tq, Tk), 1e300))
        t.refuse("float64 beyond float32's range", [*attend, "--mask", "bias_big.npy", "-o", "o.npy"],
                 "--mask:", "range")

        # ---- Shapes that do not fit together.
        t.save("k_dk3.npy", np.ones((B, H, Tk, 3), dtype=f32))
        t.refuse("Dk of K differs from Q",
                 ["attend", "--q", "q.npy", "--k", "k_dk3.npy", "--v", "v.npy", "-o", "o.npy"], "--k:",
                 str([B, H, Tk, Dk]), str([B, H, Tk, 3]))
        t.save("v_tk6.npy", np.ones((B, H, 6, Dv), dtype=f32))
        t.refuse("Tk of V differs from K",
                 ["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v_tk6.npy", "-o", "o.npy"], "--v:",
                 str([B, H, 6, Dv]))
        # K and V may have fewer heads than Q (grouped-query attention), but not another batch.
        t.save("k_b1.npy", np.ones((1, H, Tk, Dk), dtype=f32))
        t.refuse("leading dims differ", ["attend", "--q", "q.npy", "--k", "k_b1.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--k:")
        t.save("q_rank1.npy", np.ones((Dk,), dtype=f32))
        t.refuse("Q of rank 1", ["attend", "--q", "q_rank1.npy", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "rank 2 or more")
        # Leading dims beyond [B, H] are a batch, which K, V and dOut must share and a mask broadcast over.
        t.save("q_rank5.npy", np.ones((1, B, H, Tq, Dk), dtype=f32))
        t.refuse("Q of rank 5, K of rank 4",
                 ["attend", "--q", "q_rank5.npy", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--k:", f"batch dims [1, {B}] of --q", f"got shape [{B}, {H}, {Tk}, {Dk}]")
        t.save("k_rank5.npy", np.ones((1, B, H, Tk, Dk), dtype=f32))
        t.save("v_rank5.npy", np.ones((1, B, H, Tk, Dv), dtype=f32))
        t.save("v_rank5_tk.npy", np.ones((1, B, H, Tk + 1, Dv), dtype=f32))
        t.refuse("V of rank 5 with another Tk",
                 ["attend", "--q", "q_rank5.npy", "--k", "k_rank5.npy", "--v", "v_rank5_tk.npy", "-o", "o.npy"],
                 "--v:", f"expected shape [1, {B}, {H}, {Tk}, {Dv}]", f"got [1, {B}, {H}, {Tk + 1}, {Dv}]")
        t.save("mask_rank5_b.npy", np.ones((3, B, 1, Tq, Tk), dtype=bool))
        t.refuse("a mask over a batch it does not broadcast to",
                 ["attend", "--q", "q_rank5.npy", "--k", "k_rank5.npy", "--v", "v_rank5.npy", "--mask",
                  "mask_rank5_b.npy", "-o", "o.npy"], "--mask:", f"[1, {B}, {H}, {Tq}, {Tk}]", f"got [3, {B}, 1")
        t.save("dout_rank4.npy", np.ones((B, H, Tq, Dv), dtype=f32))
        t.refuse("dOut without the batch of Q",
                 ["attend-backward", "--q", "q_rank5.npy", "--k", "k_rank5.npy", "--v", "v_rank5.npy", "--dout",
                  "dout_rank4.npy", "--dq", "dq.npy"], "--dout:", f"batch dims [1, {B}] of --q")
        t.save("q_d0.npy", np.ones((Tq, 0), dtype=f32))
        t.save("k_d0.npy", np.ones((Tk, 0), dtype=f32))
        t.refuse("d_k = 0", ["attend", "--q", "q_d0.npy", "--k", "k_d0.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "d_k")

        # ---- Non-finite values: refused with the count and the first index.
        q_nan = rng.standard_normal((B, H, Tq, Dk)).astype(f32)
        q_nan[1, 2, 3, 0] = np.nan
        q_nan[1, 2, 4, 1] = np.inf
        t.save("q_nan.npy", q_nan)
        t.refuse("NaN in Q", ["attend", "--q", "q_nan.npy", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "2 non-finite", "[1, 2, 3, 0]", "--allow-nonfinite")
        v_inf = rng.standard_normal((B, H, Tk, Dv))
        v_inf[0, 0, 0, 5] = -np.inf
        t.save("v_inf.npy", v_inf)
        t.refuse("-inf in float64 V", ["attend", "--q", "q.npy", "--k", "k.npy", "--v", "v_inf.npy", "-o", "o.npy"],
                 "--v:", "1 non-finite", "[0, 0, 0, 5]")
        bias_pinf = np.zeros((Tq, Tk), dtype=f32)
        bias_pinf[2, 3] = np.inf
        t.save("bias_pinf.npy", bias_pinf)
        t.refuse("+inf in a float mask", [*attend, "--mask", "bias_pinf.npy", "-o", "o.npy"], "--mask:", "[2, 3]")
        dout_nan = np.zeros((B, H, Tq, Dv), dtype=f32)
        dout_nan[0, 1, 2, 3] = np.nan
        t.save("dout_nan.npy", dout_nan)
        t.refuse("NaN in dO", ["attend-backward", *qkv, "--dout", "dout_nan.npy", "--dq", "dq.npy"],
                 "--dout:", "[0, 1, 2, 3]")
        wk_nan = np.ones((A, Dk), dtype=f32)
        wk_nan[3, 1] = np.nan
        t.save("wk_nan.npy", wk_nan)
        t.refuse("NaN in WK", [*attend, "--score", "additive", "--wq", "wq.npy", "--wk", "wk_nan.npy", "--ww", "ww.npy",
                               "-o", "o.npy"], "--wk:", "[3, 1]")

        # ---- Masks.
        t.save("mask_bad.npy", np.ones((Tq, 3), dtype=bool))
        t.refuse("mask that does not broadcast", [*attend, "--mask", "mask_bad.npy", "-o", "o.npy"],
                 "--mask:", str([B, H, Tq, Tk]), str([Tq, 3]))
        t.save("mask_h2.npy", np.zeros((2, Tq, Tk), dtype=f32))
        t.refuse("float mask with the wrong heads", [*attend, "--mask", "mask_h2.npy", "-o", "o.npy"], "--mask:")
        # A dtype the reader does not know: the refusal says what each option takes, not the reader's list.
        t.save("mask_i16.npy", np.ones((Tq, Tk), dtype=np.int16))
        t.refuse("int16 mask", [*attend, "--mask", "mask_i16.npy", "-o", "o.npy"],
                 "--mask:", "i2", "--mask takes bool, uint8, int32 or int64 (nonzero = may attend) or float32/float64")
        t.save("q_u8.npy", np.ones((B, H, Tq, Dk), dtype=np.uint8))
        t.refuse("uint8 Q", ["attend", "--q", "q_u8.npy", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "expected dtype float32, float64, float16", "got uint8")

        # ---- Options that do not fit together.
        t.refuse("--score additive without --wq", [*attend, "--score", "additive", "--wk", "wk.npy", "--ww", "ww.npy",
                                                   "-o", "o.npy"], "--wq:")
        t.refuse("--score additive without --ww", [*attend, "--score", "additive", "--wq", "wq.npy", "--wk", "wk.npy",
                                                   "-o", "o.npy"], "--ww:")
        t.refuse("--wq with --score dot", [*attend, "--wq", "wq.npy", "-o", "o.npy"], "--wq:")
        t.save("wk_bad.npy", np.ones((A, Dk + 1), dtype=f32))
        t.refuse("--wk of the wrong shape", [*attend, "--score", "additive", "--wq", "wq.npy", "--wk", "wk_bad.npy",
                                             "--ww", "ww.npy", "-o", "o.npy"], "--wk:", str([A, Dk]), str([A, Dk + 1]))
        t.save("ww_bad.npy", np.ones((A - 1,), dtype=f32))
        t.refuse("--ww of the wrong length", [*attend, "--score", "additive", "--wq", "wq.npy", "--wk", "wk.npy",
                                              "--ww", "ww_bad.npy", "-o", "o.npy"], "--ww:")
        t.refuse("--scale inf", [*attend, "--scale", "inf", "-o", "o.npy"], "--scale", "finite")
        t.refuse("--scale nan", [*attend, "--scale", "nan", "-o", "o.npy"], "--scale", "finite")
        t.refuse("--scale not a number", [*attend, "--scale", "abc", "-o", "o.npy"], "--scale")
        t.refuse("--scale with --score additive", [*attend, *additive, "--scale", "0.5", "-o", "o.npy"], "--scale")
        t.refuse("unknown --impl", [*attend, "--impl", "fast", "-o", "o.npy"], "--impl")
        t.refuse("unknown --score", [*attend, "--score", "cosine", "-o", "o.npy"], "--score")
        # An explicit --impl is honoured or refused, never swapped for another implementation.
        t.refuse("--impl fused with --weights", [*attend, "--impl", "fused", "-o", "o.npy", "--weights", "a.npy"],
                 "--weights:", "fused", "weights")
        t.refuse("--impl fused with --heatmap", [*attend, "--impl", "fused", "-o", "o.npy", "--heatmap", "a.svg"],
                 "--heatmap:", "fused")
        t.refuse("--impl fused with --score additive", [*attend, *additive, "--impl", "fused", "-o", "o.npy"],
                 "--impl:", "fused", "additive", "reference")
        t.refuse("backward --impl fused with --score additive",
                 [*backward, *additive, "--impl", "fused", "--dq", "dq.npy"], "--impl:", "fused", "additive")
        t.refuse("missing --q", ["attend", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"], "--q")
        t.refuse("missing -o", [*attend], "--out")

        # ---- Outputs: every path is checked before any work, so nothing is written when one is bad.
        t.refuse("output in a missing directory", [*attend, "-o", "missing/o.npy"], "-o:", "missing")
        t.refuse("second output in a missing directory", [*attend, "-o", "o.npy", "--weights", "missing/a.npy"],
                 "--weights:", "missing")
        t.refuse("third output is a directory", [*attend, "-o", "o.npy", "--weights", "a.npy", "--lse", "outdir"],
                 "--lse:", "directory")
        # "-" is never a file name nor standard input or output: binary arrays only go to files.
        t.refuse("-o -", [*attend, "-o", "-"], "-o:", "got -", "standard output", "./-")
        t.refuse("--lse -", [*attend, "-o", "o.npy", "--lse", "-"], "--lse:", "standard output")
        t.refuse("backward --dq -", [*backward, "--dq", "-"], "--dq:", "standard output")
        t.refuse("--q -", ["attend", "--q", "-", "--k", "k.npy", "--v", "v.npy", "-o", "o.npy"],
                 "--q:", "got -", "standard input", "./-")
        t.succeed("-o ./- writes a file named -", [*attend, "-o", "./-"],
                  lambda _: None if np.load(t.path("-")).shape == (B, H, Tq, Dv) else "no array in the file -")
        os.remove(t.path("-"))
        t.refuse("two outputs name one file", [*attend, "-o", "o.npy", "--weights", "./o.npy"], "--weights:", "-o")
        # Under a file-size limit that -o (848 bytes) fits and --weights (968) does not, the second
        # output fails while being written, after the first was, and neither may remain.
        def limit_file_size():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (900, 900))
        t.refuse("second output fails while being written", [*attend, "-o", "o.npy", "--weights", "a.npy"],
                 "--weights:", "File too large", preexec=limit_file_size)
        # A 250-character name is valid, and so is the temporary file written beside it.
        long_name = "w" * 246 + ".npy"
        t.succeed("a 250-character output name", [*attend, "-o", "o.npy", "--weights", long_name],
                  lambda result: None if os.path.exists(t.path(long_name)) else f"{long_name} was not written")
        os.remove(t.path(long_name))
        os.remove(t.path("o.npy"))
        t.refuse("backward: second output in a missing directory",
                 [*backward, "--dq", "dq.npy", "--dk", "missing/dk.npy"], "--dk:", "missing")
        t.refuse("backward: bad output and bad input", [*backward, "--mask", "mask_bad.npy", "--dq", "dq.npy"],
                 "--mask:")
        t.refuse("backward without outputs", [*backward], "--dq", "at least one")
        t.refuse("backward: --dbias without a mask", [*backward, "--dq", "dq.npy", "--dbias", "db.npy"], "--dbias:")
        t.refuse("backward: --dbias with a bool mask",
                 [*backward, "--mask", "allowed.npy", "--dq", "dq.npy", "--dbias", "db.npy"], "--dbias:", "bool")
        t.refuse("backward: --dwq with --score dot", [*backward, "--dq", "dq.npy", "--dwq", "dwq.npy"], "--dwq:")
        t.save("dout_bad.npy", np.ones((B, H, Tq, Dv + 1), dtype=f32))
        t.refuse("backward: dO of the wrong shape",
                 ["attend-backward", *qkv, "--dout", "dout_bad.npy", "--dq", "dq.npy"], "--dout:", str([B, H, Tq, Dv]))
        t.refuse("backward: missing dO file", ["attend-backward", *qkv, "--dout", "nope.npy", "--dq", "dq.npy"],
                 "--dout:")

        # ---- A problem whose per-head Tq×Tk scores would not fit in memory is refused before any work,
        # with the size it needs. Only the reference materialises them (and the weights, when asked
        # for); the fused kernel of --impl auto would run it, in hours, so these runs name the reference.
        n = 2_000_000
        t.save("long.npy", np.ones((n, 1), dtype=f32))
        long_qkv = ["--q", "long.npy", "--k", "long.npy", "--v", "long.npy"]
        t.refuse("per-head scores beyond memory", ["attend", *long_qkv, "--impl", "reference", "-o", "o.npy"],
                 "needs", "TiB")
        t.refuse("weights beyond memory", ["attend", *long_qkv, "-o", "o.npy", "--weights", "a.npy"],
                 "--weights", "needs", "TiB")
        t.refuse("backward beyond memory", ["attend-backward", *long_qkv, "--impl", "reference", "--dout", "long.npy",
                                            "--dq", "dq.npy", "--dv", "dv.npy"], "needs", "TiB")
        os.remove(t.path("long.npy"))

        # ---- Happy paths.
        q, k, v = (np.load(t.path(name)) for name in ("q.npy", "k.npy", "v.npy"))
        bias = np.load(t.path("bias.npy"))

        def check_forward(_):
            out, weights, lse = (np.load(t.path(name)) for name in ("outdir/o.npy", "outdir/a.npy", "outdir/l.npy"))
            want_out, want_p = softmax_attention(q, k, v, 1 / np.sqrt(Dk), bias)
            if out.dtype != np.float32 or out.shape != (B, H, Tq, Dv):
                return f"out: {out.dtype} {out.shape}"
            if weights.shape != (B, H, Tq, Tk) or lse.shape != (B, H, Tq):
                return f"weights {weights.shape}, lse {lse.shape}"
            # float32 outputs of a float64-accumulated computation on O(1) values: a few float32 ulps.
            tol = 16 * np.finfo(np.float32).eps
            if np.abs(out - want_out).max() > tol or np.abs(weights - want_p).max() > tol:
                return f"values differ from numpy by {np.abs(out - want_out).max():.3g} (out)"
            leftovers = sorted(f for f in os.listdir(t.path("outdir")) if f not in ("o.npy", "a.npy", "l.npy"))
            return f"stray files {leftovers}" if leftovers else None

        t.succeed("attend with every output",
                  [*attend, "--mask", "bias.npy", "-o", "outdir/o.npy", "--weights", "outdir/a.npy", "--lse",
                   "outdir/l.npy"], check_forward)
        t.succeed("attend overwrites an existing output", [*attend, "--mask", "bias.npy", "-o", "outdir/o.npy",
                                                           "--weights", "outdir/a.npy", "--lse", "outdir/l.npy"],
                  check_forward)
        t.save("q64.npy", q.astype(np.float64))
        # A float64 operand makes the run float64 end to end: outputs float64, at float64 accuracy.
        q64, k64, v64 = (rng.standard_normal(a.shape) for a in (q, k, v))
        for name, a in (("qd.npy", q64), ("kd.npy", k64), ("vd.npy", v64)):
            t.save(name, a)
        want64, want_p64 = softmax_attention(q64, k64, v64, 1 / np.sqrt(Dk))

        def float64_close(names_wants):
            def check(_):
                for name, want in names_wants:
                    got = np.load(t.path(name))
                    if got.dtype != np.float64:
                        return f"{name}: dtype {got.dtype}, expected float64"
                    if np.abs(got - want).max() > 1e-12:
                        return f"{name}: differs from numpy's float64 by {np.abs(got - want).max():.3g}"
                return None
            return check
        for impl in ("reference", "auto", "fused"):
            extra = ["--weights", "a64.npy"] if impl != "fused" else []
            t.succeed(f"float64 in, float64 out (--impl {impl})",
                      ["attend", "--q", "qd.npy", "--k", "kd.npy", "--v", "vd.npy", "--impl", impl, "-o", "o64d.npy",
                       *extra],
                      float64_close([("o64d.npy", want64)] + ([("a64.npy", want_p64)] if extra else [])))
        t.save("doutd.npy", np.ones((B, H, Tq, Dv)))
        # With dO all ones, dV_j is the sum of the weights of key j over the queries.
        t.succeed("attend-backward: float64 in, float64 out",
                  ["attend-backward", "--q", "qd.npy", "--k", "kd.npy", "--v", "vd.npy", "--dout", "doutd.npy",
                   "--dv", "dv64.npy"], float64_close([("dv64.npy", want_p64.sum(axis=-2)[..., None]
                                                        * np.ones((1, 1, 1, Dv)))]))
        t.succeed("--score additive with float64 inputs runs in float32",
                  ["attend", "--q", "qd.npy", "--k", "kd.npy", "--v", "vd.npy", *additive, "-o", "oadd64.npy"],
                  lambda _: None if np.load(t.path("oadd64.npy")).dtype == np.float32 else "not float32")
        t.succeed("float64 Q with float32 K and V runs in float64",
                  ["attend", "--q", "qd.npy", "--k", "k.npy", "--v", "v.npy", "-o", "omix.npy"],
                  lambda _: None if np.load(t.path("omix.npy")).dtype == np.float64 else "not float64")
        t.succeed("float64 input", ["attend", "--q", "q64.npy", "--k", "k.npy", "--v", "v.npy", "--causal",
                                    "--mask", "allowed.npy", "--impl", "reference", "-o", "o64.npy"],
                  lambda _: None if np.isfinite(np.load(t.path("o64.npy"))).all() else "non-finite output")
        # An integer mask means what a bool mask does: nonzero may attend.
        allowed = np.load(t.path("allowed.npy"))
        mask_i64 = np.where(allowed, np.array([1, -3, 7, 2, 9, 5, 4])[:Tk], 0).astype(np.int64)
        t.save("mask_i64.npy", mask_i64)
        def check_int_mask(_):
            want, _ = softmax_attention(q, k, v, 1 / np.sqrt(Dk), np.where(allowed, 0.0, -np.inf))
            got = np.load(t.path("o_i64.npy"))
            error = np.abs(got - want).max()
            return None if error <= 1e-5 else f"differs from numpy with the bool mask by {error:.3g}"
        t.succeed("int64 mask, nonzero = may attend", [*attend, "--mask", "mask_i64.npy", "-o", "o_i64.npy"],
                  check_int_mask)
        t.save("mask_u8.npy", (mask_i64 != 0).astype(np.uint8) * 9)
        t.succeed("uint8 mask, nonzero = may attend", [*attend, "--mask", "mask_u8.npy", "-o", "o_i64.npy"],
                  check_int_mask)

        # Whatever np.save and np.savez write is read as numpy reads it: Fortran order (a transposed
        # array), big-endian, an .npz archive's members.
        np.save(t.path("k_fortran.npy"), np.asfortranarray(k))
        np.save(t.path("v_big.npy"), v.astype(v.dtype.newbyteorder(">")))
        np.save(t.path("q_fortran.npy"), q.T.copy().T)  # the transpose of a C array is in Fortran order
        np.savez(t.path("qkv.npz"), q=q, k=k, v=v)
        t.succeed("plain files", [*attend, "-o", "o_plain.npy"])
        def same_as_plain(name):
            def check(_):
                error = np.abs(np.load(t.path(name)) - np.load(t.path("o_plain.npy"))).max()
                return None if error == 0 else f"differs from the plain files' output by {error:.3g}"
            return check
        t.succeed("Fortran-order K, big-endian V", ["attend", "--q", "q_fortran.npy", "--k", "k_fortran.npy", "--v",
                                                    "v_big.npy", "-o", "o_orders.npy"], same_as_plain("o_orders.npy"))
        t.succeed("Q, K, V from one .npz", ["attend", "--q", "qkv.npz:q", "--k", "qkv.npz:k", "--v", "qkv.npz:v",
                                            "-o", "o_npz.npy"], same_as_plain("o_npz.npy"))
        t.refuse("an .npz of several arrays without a name", ["attend", "--q", "qkv.npz", "--k", "k.npy", "--v",
                                                              "v.npy", "-o", "o.npy"], "--q:", "holds 3 arrays",
                 "qkv.npz:NAME")
        t.refuse("an .npz without that array", ["attend", "--q", "qkv.npz:x", "--k", "k.npy", "--v", "v.npy",
                                                "-o", "o.npy"], "--q:", "has no array 'x'", "q, k, v")
        np.savez_compressed(t.path("compressed.npz"), q=q)
        t.refuse("a compressed .npz", ["attend", "--q", "compressed.npz:q", "--k", "k.npy", "--v", "v.npy",
                                       "-o", "o.npy"], "--q:", "compressed", "np.savez")
        bias_ninf = np.zeros((Tq, Tk), dtype=f32)
        bias_ninf[:, 1:] = -np.inf
        t.save("bias_ninf.npy", bias_ninf)
        # Only key 0 is visible: its weight is 1 and the output is its value, up to float32 rounding.
        only_key0 = np.broadcast_to(v[:, :, :1], (B, H, Tq, Dv))
        t.succeed("-inf in a float mask masks", [*attend, "--mask", "bias_ninf.npy", "-o", "o_ninf.npy"],
                  lambda _: None if np.abs(np.load(t.path("o_ninf.npy")) - only_key0).max()
                  <= 4 * np.finfo(np.float32).eps * np.abs(v).max() else "out != the value of key 0")
        t.succeed("--allow-nonfinite accepts NaN", ["attend", "--q", "q_nan.npy", "--k", "k.npy", "--v", "v.npy",
                                                    "--allow-nonfinite", "-o", "o_nan.npy"],
                  lambda _: None if np.isnan(np.load(t.path("o_nan.npy"))).any() else "expected NaN in the output")

        def check_backward(names, shapes):
            def check(_):
                for name, shape in zip(names, shapes):
                    got = np.load(t.path(name))
                    if got.shape != shape or got.dtype != np.float32 or not np.isfinite(got).all():
                        return f"{name}: {got.dtype} {got.shape}, expected float32 {shape}, finite"
                return None
            return check

        t.succeed("attend-backward with every output",
                  [*backward, "--mask", "bias.npy", "--causal", "--dq", "dq.npy", "--dk", "dk.npy", "--dv", "dv.npy",
                   "--dbias", "db.npy"],
                  check_backward(["dq.npy", "dk.npy", "dv.npy", "db.npy"],
                                 [q.shape, k.shape, v.shape, bias.shape]))
        t.succeed("attend-backward writes only what is asked", [*backward, "--dv", "dv_only.npy"],
                  lambda _: None if not os.path.exists(t.path("dq_only.npy")) and os.path.exists(t.path("dv_only.npy"))
                  else "wrong files")
        t.succeed("attend --score additive", [*attend, *additive, "--mask", "allowed.npy", "-o", "o_add.npy"],
                  check_backward(["o_add.npy"], [(B, H, Tq, Dv)]))
        t.succeed("attend-backward --score additive",
                  [*backward, *additive, "--dq", "adq.npy", "--dwq", "dwq.npy", "--dwk", "dwk.npy", "--dww", "dww.npy"],
                  check_backward(["adq.npy", "dwq.npy", "dwk.npy", "dww.npy"], [q.shape, (A, Dk), (A, Dk), (A,)]))

        # ---- Help: the subcommands are listed, and each explains shapes, masks and the causal rule.
        def help_mentions(*texts):
            return lambda r: None if all(x in r.stdout for x in texts) else f"help lacks one of {texts}"

        t.succeed("qkv --help lists the subcommands", ["--help"], help_mentions("attend", "attend-backward"))
        t.succeed("attend --help", ["attend", "--help"],
                  help_mentions("[..., Tq, Dk]", "i + Tk - Tq", "true = visible", "-inf", "Example"))
        t.succeed("attend --help says what - means", ["attend", "--help"],
                  help_mentions("- is not standard input or output"))
        t.succeed("attend --help says which runs are float64", ["attend", "--help"],
                  help_mentions("When Q, K or V is float64", "--score additive runs in float32 only"))
        t.succeed("attend-backward --help", ["attend-backward", "--help"],
                  help_mentions("--dout", "i + Tk - Tq", "--dbias", "Example"))

        return t.report()


if __name__ == "__main__":
    sys.exit(main())
