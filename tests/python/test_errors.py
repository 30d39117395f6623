"""Bad input: every refusal is an exception of the right class whose message names the argument,
odd but valid inputs work, and the messages the CLI shares read the same."""

import os
import pathlib
import subprocess

import numpy as np
import pytest

import qkv
from conftest import qkv_arrays, randn, traced_peak

REPO = pathlib.Path(__file__).resolve().parents[2]
CLI = pathlib.Path(os.environ.get("QKV_BIN", REPO / "build" / "release" / "apps" / "qkv"))


def test_exception_classes():
    assert issubclass(qkv.ShapeError, qkv.Error) and issubclass(qkv.Error, ValueError)
    assert issubclass(qkv.ResourceError, MemoryError) and issubclass(qkv.FileError, OSError)


@pytest.fixture
def qkv32(rng):
    return qkv_arrays(rng, (2,), 3, 3, 4, 4)


def refusals(q, k, v):
    """(what is wrong, call, exception class, message pattern)."""
    nan_q = q.copy()
    nan_q[1, 2, 3] = np.nan
    inf_k = k.copy()
    inf_k[0, 1, 0] = np.inf
    return [
        ("bool q", lambda: qkv.attention(q.astype(bool), k, v), qkv.ShapeError,
         r"q: expected dtype float32, float64, float16 or uint16 \(bfloat16 bits, with bf16=True\), got bool"),
        ("int q", lambda: qkv.attention(q.astype(np.int64), k, v), qkv.ShapeError,
         r"q: expected dtype float32, float64, float16 or uint16 \(bfloat16 bits, with bf16=True\), got int64"),
        ("string q", lambda: qkv.attention("q", k, v), qkv.ShapeError, "q: expected dtype float32, float64"),
        ("0-d q", lambda: qkv.attention(np.float32(1), k, v), qkv.ShapeError,
         r"q: expected rank 2 or more \(\[\.\.\., Tq, Dk\]\), got shape \[\]"),
        ("rank-1 q", lambda: qkv.attention(q[0, 0], k, v), qkv.ShapeError, "q: expected rank 2 or more"),
        ("rank-1 v", lambda: qkv.attention(q, k, v[0, 0, 0]), qkv.ShapeError, "v: expected rank 2 or more"),
        ("rank-5 q, rank-4 k", lambda: qkv.attention(q[None, None], k[None], v[None, None]), qkv.ShapeError,
         r"k: expected the batch dims \[1, 1\] of q, then \[Hkv, Tk, Dk\], got shape"),
        ("k of float64", lambda: qkv.attention(q, k.astype(np.float64), v), qkv.ShapeError,
         r"k: expected dtype float32 \(the dtype of q\), got float64"),
        ("v of int32", lambda: qkv.attention(q, k, v.astype(np.int32)), qkv.ShapeError,
         r"v: expected dtype float32 \(the dtype of q\), got int32"),
        ("float64 q, float16 v", lambda: qkv.attention(q.astype(np.float64), k, v.astype(np.float16)), qkv.ShapeError,
         r"q: expected float32 beside float16, bfloat16 or int8 operands \(float64 runs with q, k and v all float64\), "
         r"got float64"),
        ("batch differs", lambda: qkv.attention(q[None], k[None].repeat(2, 0), v[None].repeat(2, 0)), qkv.ShapeError,
         r"k: expected shape \[1, 2, "),
        ("heads not a divisor", lambda: qkv.attention(q, k.repeat(2, 0), v.repeat(2, 0)), qkv.ShapeError,
         "k: q has 2 heads, which is not a multiple of k's 4"),
        ("rank differs", lambda: qkv.attention(q[0], k, v), qkv.ShapeError, "k: expected shape"),
        ("Dk differs", lambda: qkv.attention(q, k[..., :3], v), qkv.ShapeError, r"k: expected shape .*got \[2, 3, 3\]"),
        ("Tk of v differs", lambda: qkv.attention(q, k, v[:, :2]), qkv.ShapeError, "v: expected shape"),
        ("NaN in q", lambda: qkv.attention(nan_q, k, v), qkv.Error,
         r"q: expected finite values, got 1 non-finite value \(the first: nan at \[1, 2, 3\]\); "
         "pass allow_nonfinite=True"),
        ("inf in k", lambda: qkv.attention(q, inf_k, v), qkv.Error, r"k: expected finite values.*inf at \[0, 1, 0\]"),
        ("NaN in the bias", lambda: qkv.attention(q, k, v, mask=np.full((3, 3), np.nan, np.float32)), qkv.Error,
         "mask: expected finite values or -inf, got 9 non-finite values"),
        ("+inf in the bias", lambda: qkv.attention(q, k, v, mask=np.full((3, 3), np.inf, np.float32)), qkv.Error,
         "mask: expected finite values or -inf"),
        ("mask shape", lambda: qkv.attention(q, k, v, mask=np.ones((3, 4), bool)), qkv.ShapeError,
         r"mask: shape \[3, 4\] does not broadcast"),
        ("float64 bias of float32 q", lambda: qkv.attention(q, k, v, mask=np.zeros((3, 3))), qkv.ShapeError,
         "mask: expected dtype bool or an integer type .*got float64"),
        ("complex mask", lambda: qkv.attention(q, k, v, mask=np.zeros((3, 3), np.complex64)), qkv.ShapeError,
         "mask: expected dtype .*got complex64"),
        ("rank-5 mask", lambda: qkv.attention(q, k, v, mask=np.ones((1, 1, 1, 3, 3), bool)), qkv.ShapeError,
         r"mask: expected a shape that broadcasts to the scores \[\.\.\., H, Tq, Tk\] = \[.*\], got \[1, 1, 1, 3, 3\]"),
        ("bad impl", lambda: qkv.attention(q, k, v, impl="flash"), qkv.Error,
         'impl: expected "auto", "fused" or "reference", got "flash"'),
        ("NaN scale", lambda: qkv.attention(q, k, v, scale=float("nan")), qkv.Error,
         "scale: expected a finite number, got nan"),
        ("infinite scale", lambda: qkv.attention(q, k, v, scale=float("inf")), qkv.Error, "scale: expected a finite"),
        ("fused weights", lambda: qkv.attention(q, k, v, impl="fused", return_weights=True), qkv.Error,
         'return_weights: impl="fused" never materialises the Tq×Tk weights; use impl="auto" or "reference"'),
        ("out without lse", lambda: qkv.attention_backward(q, k, v, q, out=q), qkv.Error,
         "out, lse: expected both .* or neither, got only out"),
        ("lse without out", lambda: qkv.attention_backward(q, k, v, q, lse=q[..., 0]), qkv.Error, "got only lse"),
        ("dout shape", lambda: qkv.attention_backward(q, k, v, q[:, :2]), qkv.ShapeError, "dout: expected shape"),
        ("dout dtype", lambda: qkv.attention_backward(q, k, v, q.astype(np.float64)), qkv.ShapeError,
         r"dout: expected dtype float32 \(the dtype of q\)"),
        ("lse shape", lambda: qkv.attention_backward(q, k, v, q, out=q, lse=q), qkv.ShapeError, "lse: expected shape"),
        ("NaN in dout", lambda: qkv.attention_backward(q, k, v, nan_q), qkv.Error, "dout: expected finite values"),
        ("additive w_q shape", lambda: qkv.additive_attention(q, k, v, np.ones((5, 3), np.float32),
                                                               np.ones((5, 4), np.float32), np.ones(5, np.float32)),
         qkv.ShapeError, r"w_q: expected shape \[A, 4\]"),
        ("additive w shape", lambda: qkv.additive_attention(q, k, v, np.ones((5, 4), np.float32),
                                                             np.ones((5, 4), np.float32), np.ones(6, np.float32)),
         qkv.ShapeError, r"w: expected shape \[5\], got \[6\]"),
        ("threads", lambda: qkv.set_num_threads(0), qkv.Error, "workers: expected at least 1, got 0"),
    ]


# The cases' names, for pytest's ids; each test draws its own arrays from the fixture.
CASES = [case[0] for case in refusals(*qkv_arrays(np.random.default_rng(0), (2,), 3, 3, 4, 4))]


@pytest.mark.parametrize("case", CASES)
def test_refusal(qkv32, case):
    _, call, error, message = next(c for c in refusals(*qkv32) if c[0] == case)
    with pytest.raises(error, match=message):
        call()


def test_huge_weights_are_a_memory_error():
    # [1, 1, 2^20, 2^20] weights would take 4 TiB; the inputs are broadcast views of one number.
    one = np.broadcast_to(np.float32(1), (1, 1, 2**20, 8))
    with pytest.raises(qkv.ResourceError, match="weights needs 4.0 TiB"):
        qkv.attention(one, one, one, return_weights=True)
    with pytest.raises(MemoryError, match="attention_forward_reference .* needs 8.0 TiB"):
        qkv.attention(one, one, one, impl="reference")


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_nonfinite_values_propagate_when_allowed(qkv32, impl):
    # A NaN in query row 0 makes every score of that row NaN: its output is NaN, not the 0 of a
    # row that sees no key; the other rows are untouched.
    q, k, v = qkv32
    q = q.copy()
    q[0, 0, 0] = np.nan
    out, lse = qkv.attention(q, k, v, allow_nonfinite=True, impl=impl, return_lse=True)
    assert np.isnan(out[0, 0]).all() and np.isnan(lse[0, 0])
    assert np.isfinite(out[0, 1:]).all() and np.isfinite(out[1]).all()


def test_minus_infinity_bias_is_accepted(qkv32):
    q, k, v = qkv32
    bias = np.zeros((3, 3), np.float32)
    bias[:, 1] = -np.inf
    _, weights = qkv.attention(q, k, v, mask=bias, return_weights=True)
    assert np.all(weights[..., 1] == 0)


def test_odd_but_valid_inputs_work(qkv32):
    q, k, v = qkv32
    frozen = [x.copy() for x in (q, k, v)]
    for x in frozen:
        x.flags.writeable = False
    np.testing.assert_array_equal(qkv.attention(*frozen), qkv.attention(q, k, v))
    as_lists = qkv.attention(q.tolist(), k.tolist(), v.tolist())  # array-likes are converted (to float64)
    np.testing.assert_allclose(as_lists, qkv.attention(q, k, v).astype(np.float64), rtol=1e-5, atol=1e-6)
    int_mask = qkv.attention(q, k, v, mask=np.array([[1, 0, 2]] * 3, np.int32))
    np.testing.assert_array_equal(int_mask, qkv.attention(q, k, v, mask=np.array([[True, False, True]] * 3)))


def cli_error(tmp_path, arrays, *flags):
    """The one-line error of `qkv attend` on the given arrays, without its "qkv: error: " prefix."""
    if not CLI.exists():
        pytest.skip(f"no qkv CLI at {CLI}")
    args = []
    for name, array in arrays.items():
        np.save(tmp_path / f"{name}.npy", array)
        args += [f"--{name}", str(tmp_path / f"{name}.npy")]
    result = subprocess.run([str(CLI), "attend", *args, "-o", str(tmp_path / "out.npy"), *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    return result.stderr.strip().removeprefix("qkv: error: ")


def python_error(call):
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


def test_messages_read_as_the_cli_does(rng, tmp_path):
    q, k, v = qkv_arrays(rng, (2,), 3, 3, 4, 4)
    q[0, 0, 1] = np.nan
    cli = cli_error(tmp_path, {"q": q, "k": k, "v": v})
    assert cli == "--q: expected finite values, got 1 non-finite value (the first: nan at [0, 0, 1]); " \
                  "pass --allow-nonfinite to accept them"
    python = python_error(lambda: qkv.attention(q, k, v))
    assert python == cli.replace("--q", "q").replace("--allow-nonfinite", "allow_nonfinite=True")

    q[0, 0, 1] = 0
    cli = cli_error(tmp_path, {"q": q, "k": k, "v": v}, "--scale", "nan")
    assert python_error(lambda: qkv.attention(q, k, v, scale=float("nan"))) == cli.replace("--scale", "scale")

    cli = cli_error(tmp_path, {"q": q.astype(np.int64), "k": k, "v": v})
    python = python_error(lambda: qkv.attention(q.astype(np.int64), k, v))
    assert cli.replace("--q", "q").replace("--dtype bf16", "bf16=True").startswith(python)


def test_no_copy_of_a_broadcast_input(rng):
    # A stride-0 leading dim is read in place: 2^14 heads of one [64, 8] array allocate only out.
    q = np.broadcast_to(randn(rng, (1, 64, 8)), (2**14, 64, 8))
    out_bytes = q.size * 4
    assert out_bytes <= traced_peak(lambda: qkv.attention(q, q, q)) < out_bytes * 5 // 4
