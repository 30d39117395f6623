#!/usr/bin/env python3
"""`qkv quantize` and `qkv dequantize`: stored arrays against numpy, and their refusals.

Happy paths: float16 matches numpy's float16 bit for bit, bfloat16 numpy's bits rounded to nearest
even, int8 the scales max|x|/127 of each group and values within half a step of x; dequantize gives
back those values. Refusals exit 2 with one line naming the option, and write no file.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_quantize.py
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import Suite, run_suite  # noqa: E402  (the harness sits beside this script)


def bfloat16_bits(x):
    """The bits of float32 x rounded to bfloat16, nearest even (no NaNs in these inputs)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bfloat16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def checks(t):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 7, 5)).astype(np.float32)
    x[:, :, 1] *= 20  # an outlier channel, which per-channel scales keep to itself
    t.save("x.npy", x)

    def load(name):
        return np.load(t.path(name))

    def half_ok(_):
        out = load("h.npy")
        if out.dtype != np.float16 or not np.array_equal(out.view(np.uint16), x.astype(np.float16).view(np.uint16)):
            return f"float16 differs from numpy's: dtype {out.dtype}"
        back = load("hd.npy")
        if back.dtype != np.float32 or not np.array_equal(back, x.astype(np.float16).astype(np.float32)):
            return "dequantized float16 differs from numpy's float16 values"
        return None

    t.succeed("quantize --to f16", ["quantize", "x.npy", "--to", "f16", "-o", "h.npy"])
    t.succeed("dequantize float16", ["dequantize", "h.npy", "-o", "hd.npy"], half_ok)

    def bf16_ok(_):
        out = load("b.npy")
        if out.dtype != np.uint16 or not np.array_equal(out, bfloat16_bits(x)):
            return f"bfloat16 bits differ from numpy's rounding: dtype {out.dtype}"
        if not np.array_equal(load("bd.npy"), from_bfloat16(bfloat16_bits(x))):
            return "dequantized bfloat16 differs"
        return None

    t.succeed("quantize --to bf16", ["quantize", "x.npy", "--to", "bf16", "-o", "b.npy"])
    t.succeed("dequantize bfloat16", ["dequantize", "b.npy", "--dtype", "bf16", "-o", "bd.npy"], bf16_ok)

    for group, axis in (("per-channel", -2), ("per-token", -1), ("per-tensor", None)):
        def int8_ok(_, axis=axis):
            q, s, back = load("q.npy"), load("s.npy"), load("qd.npy").astype(np.float64)
            x64 = x.astype(np.float64)
            expected_s = np.abs(x64).max(axis=axis, keepdims=True) / 127 if axis is not None else \
                np.full((1, 1, 1), np.abs(x64).max() / 127)
            if q.dtype != np.int8 or s.dtype != np.float32 or s.shape != expected_s.shape:
                return f"dtypes {q.dtype}, {s.dtype}, scales {s.shape}, expected int8, float32, {expected_s.shape}"
            # The scale is max|x|/127 rounded to float32 once.
            if np.abs(s - expected_s).max() > np.finfo(np.float32).eps * expected_s.max():
                return f"scales differ from max|x|/127 by {np.abs(s - expected_s).max()}"
            stored = q.astype(np.float64) * s.astype(np.float64)
            # Half a step of rounding, and float32's rounding of scale·q in dequantize.
            step = np.broadcast_to(s.astype(np.float64), x.shape)
            if np.any(np.abs(stored - x64) > step * (0.5 + 1e-5)):
                return f"int8 values beyond half a step of x: {np.abs(stored - x64).max()}"
            if np.abs(back - stored).max() > np.finfo(np.float32).eps * np.abs(stored).max():
                return f"dequantized int8 differs from scale·q by {np.abs(back - stored).max()}"
            return None

        t.succeed(f"quantize --to int8 --group {group}",
                  ["quantize", "x.npy", "--to", "int8", "--group", group, "-o", "q.npy", "--scales", "s.npy"])
        t.succeed(f"dequantize int8 {group}", ["dequantize", "q.npy", "--scales", "s.npy", "-o", "qd.npy"], int8_ok)

    t.succeed("quantize default group is per-channel",
              ["quantize", "x.npy", "--to", "int8", "-o", "q.npy", "--scales", "s.npy"],
              lambda _: None if load("s.npy").shape == (2, 1, 5) else f"scales {load('s.npy').shape}")
    for name in ("h.npy", "hd.npy", "b.npy", "bd.npy", "qd.npy"):
        os.remove(t.path(name))

    t.refuse("int8 without --scales", ["quantize", "x.npy", "--to", "int8", "-o", "out.npy"], "--scales", "int8")
    t.refuse("scales with f16", ["quantize", "x.npy", "--to", "f16", "-o", "out.npy", "--scales", "o.npy"],
             "--scales", "f16")
    t.refuse("unknown --to", ["quantize", "x.npy", "--to", "int4", "-o", "out.npy"], "--to", "int4")
    t.refuse("--to float32", ["quantize", "x.npy", "--to", "f32", "-o", "out.npy"], "--to", "float32")
    t.refuse("unknown --group", ["quantize", "x.npy", "--to", "int8", "--group", "per-row", "-o", "out.npy",
                                 "--scales", "o.npy"], "--group", "per-row")
    x_nan = x.copy()
    x_nan[0, 1, 2] = np.nan
    t.save("nan.npy", x_nan)
    t.refuse("NaN input", ["quantize", "nan.npy", "--to", "int8", "-o", "out.npy", "--scales", "o.npy"],
             "IN", "finite", "nan")
    # numpy's astype would store these as infinities, which attend then refuses.
    x_big = x.copy()
    x_big[1, 2, 3] = 7e4
    t.save("big.npy", x_big)
    t.refuse("float16 overflow", ["quantize", "big.npy", "--to", "f16", "-o", "out.npy"],
             "IN", "float16", "65520", "70000", "[1, 2, 3]")
    x_big[1, 2, 3] = 3.4e38
    t.save("big.npy", x_big)
    t.refuse("bfloat16 overflow", ["quantize", "big.npy", "--to", "bf16", "-o", "out.npy"],
             "IN", "bfloat16", "[1, 2, 3]")
    t.refuse("--group without int8", ["quantize", "x.npy", "--to", "f16", "--group", "per-token", "-o", "out.npy"],
             "--group", "f16", "per-token")
    t.save("vec.npy", x[0, 0])
    t.refuse("int8 of rank 1", ["quantize", "vec.npy", "--to", "int8", "-o", "out.npy", "--scales", "o.npy"],
             "IN", "rank 2", "[5]")

    t.refuse("int8 IN without scales", ["dequantize", "q.npy", "-o", "out.npy"], "--scales", "int8")
    t.save("s_wrong.npy", np.ones((2, 1, 4), np.float32))
    t.refuse("scales of the wrong shape", ["dequantize", "q.npy", "--scales", "s_wrong.npy", "-o", "out.npy"],
             "--scales", "[2, 7, 5]", "[2, 1, 4]")
    s_nan = load("s.npy").copy()
    s_nan[0, 0, 3] = np.nan
    t.save("s_nan.npy", s_nan)
    t.refuse("NaN scales", ["dequantize", "q.npy", "--scales", "s_nan.npy", "-o", "out.npy"],
             "--scales", "nan", "[0, 0, 3]")
    t.save("u2.npy", bfloat16_bits(x))
    t.refuse("uint16 without --dtype", ["dequantize", "u2.npy", "-o", "out.npy"], "--dtype", "bf16", "uint16")
    t.refuse("unknown --dtype", ["dequantize", "u2.npy", "--dtype", "f8", "-o", "out.npy"], "--dtype", "f8")
    t.save("h.npy", x.astype(np.float16))
    t.refuse("float16 with --dtype bf16", ["dequantize", "h.npy", "--dtype", "bf16", "-o", "out.npy"],
             "--dtype", "float16")
    t.refuse("scales for float16", ["dequantize", "h.npy", "--scales", "s.npy", "-o", "out.npy"],
             "--scales", "float16")
    t.refuse("float32 IN", ["dequantize", "x.npy", "-o", "out.npy"], "IN", "float32", "int8")
    t.save("i16.npy", np.zeros((2, 3), np.int16))
    t.refuse("unsupported dtype", ["dequantize", "i16.npy", "-o", "out.npy"], "IN", "<i2")


if __name__ == "__main__":
    sys.exit(run_suite(Suite, "qkv_quantize_", checks))
