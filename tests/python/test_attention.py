"""qkv.attention and qkv.attention_backward against the wide numpy reference of conftest.py, over
shapes, masks, implementations and memory layouts; and the promise that inputs are read in place."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import qkv
from conftest import (DTYPE_IMPLS, assert_attention_matches, assert_gradients_match, qkv_arrays, randn,
                      traced_peak)

# (tq, tk, dk, dv): T = 1, d = 1, Tq != Tk both ways, Dk != Dv, sizes off every tile width.
SIZES = [(1, 1, 1, 1), (5, 7, 4, 3), (7, 5, 4, 4), (16, 16, 8, 8), (33, 113, 17, 9), (113, 33, 9, 17)]
LEADS = [(), (3,), (2, 3)]


def mask_of(kind: str, rng, lead, tq, tk, dtype):
    """A mask of the given kind, broadcastable to [*lead, tq, tk], with some keys masked."""
    allowed = rng.random((tq, tk)) < 0.7
    if kind == "none":
        return None
    if kind == "bool":
        return allowed
    if kind == "int64":
        return allowed.astype(np.int64) * 3
    if kind == "uint8":
        return allowed.astype(np.uint8)
    if kind == "bias":
        return np.where(allowed, randn(rng, (tq, tk), dtype), -np.inf).astype(dtype)
    if kind == "bias_per_head_key":  # [1, H, 1, Tk] for lead [B, H]: one bias per head and key
        return randn(rng, (1, lead[1], 1, tk), dtype)
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype,impl", DTYPE_IMPLS)
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("tq,tk,dk,dv", SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(rng, dtype, impl, lead, tq, tk, dk, dv, causal):
    q, k, v = qkv_arrays(rng, lead, tq, tk, dk, dv, dtype)
    result = qkv.attention(q, k, v, causal=causal, impl=impl, return_lse=True)
    assert result[0].shape == (*lead, tq, dv) and result[1].shape == (*lead, tq)
    assert_attention_matches(result, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype,impl", DTYPE_IMPLS)
@pytest.mark.parametrize("kind", ["bool", "int64", "uint8", "bias", "bias_per_head_key"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_with_mask(rng, dtype, impl, kind, causal):
    lead, tq, tk = (2, 3), 9, 13
    q, k, v = qkv_arrays(rng, lead, tq, tk, 8, 5, dtype)
    mask = mask_of(kind, rng, lead, tq, tk, dtype)
    result = qkv.attention(q, k, v, causal=causal, mask=mask, impl=impl, return_lse=True)
    assert_attention_matches(result, q, k, v, causal=causal, mask=mask)


@pytest.mark.parametrize("dtype,impl", [(np.float32, "auto"), (np.float32, "reference"), (np.float64, "auto")])
def test_weights_and_scale(rng, dtype, impl):
    q, k, v = qkv_arrays(rng, (2,), 6, 9, 4, 4, dtype)
    result = qkv.attention(q, k, v, scale=0.3, causal=True, impl=impl, return_lse=True, return_weights=True)
    assert len(result) == 3
    assert_attention_matches(result, q, k, v, scale=0.3, causal=True)
    np.testing.assert_allclose(result[2].sum(axis=-1), 1, rtol=1e-5)
    _, weights = qkv.attention(q, k, v, scale=0.3, causal=True, impl=impl, return_weights=True)
    np.testing.assert_array_equal(weights, result[2])


def test_float32_bias_with_float64_q(rng):
    q, k, v = qkv_arrays(rng, (2,), 4, 6, 3, 3, np.float64)
    bias = randn(rng, (4, 6), np.float32)
    result = qkv.attention(q, k, v, mask=bias, return_lse=True)
    assert_attention_matches(result, q, k, v, mask=bias.astype(np.float64))


@pytest.mark.parametrize("dtype,impl", DTYPE_IMPLS)
def test_fully_masked_rows_give_zero(rng, dtype, impl):
    q, k, v = qkv_arrays(rng, (2,), 4, 5, 3, 3, dtype)
    mask = np.ones((4, 5), dtype=bool)
    mask[1] = False
    out, lse = qkv.attention(q, k, v, mask=mask, impl=impl, return_lse=True)
    assert np.all(out[:, 1] == 0) and np.all(lse[:, 1] == -np.inf)
    assert np.isfinite(out).all()
    grads = qkv.attention_backward(q, k, v, np.ones_like(out), mask=mask, impl=impl)
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(grads[0][:, 1] == 0)
    assert_gradients_match(grads, q, k, v, np.ones_like(out), mask=mask)


def test_bias_of_minus_infinity_masks_a_row():
    q = np.ones((2, 2), np.float32)
    bias = np.array([[0, 0], [-np.inf, -np.inf]], np.float32)
    out, lse, weights = qkv.attention(q, q, q, mask=bias, impl="reference", return_lse=True, return_weights=True)
    assert np.all(out[1] == 0) and lse[1] == -np.inf and np.all(weights[1] == 0)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_no_keys(rng, impl):
    # The C++ op (and `qkv attend`) accept Tk = 0: every query sees no key, so out 0 and lse -inf.
    q = randn(rng, (2, 3, 4))
    k, v = np.zeros((2, 0, 4), np.float32), np.zeros((2, 0, 5), np.float32)
    out, lse = qkv.attention(q, k, v, impl=impl, return_lse=True)
    assert out.shape == (2, 3, 5) and np.all(out == 0) and np.all(lse == -np.inf)
    dq, dk, dv = qkv.attention_backward(q, k, v, np.ones((2, 3, 5), np.float32), impl=impl)
    assert np.all(dq == 0) and dk.shape == (2, 0, 4) and dv.shape == (2, 0, 5)


def layouts(rng, dtype, name):
    """(q, k, v) of shape [2, 6, 4] / [2, 9, 4] / [2, 9, 3] laid out the way `name` says."""
    if name == "transposed":  # [.., D, T] transposed: last dim not contiguous, copied
        return tuple(randn(rng, (2, d, t), dtype).transpose(0, 2, 1) for t, d in ((6, 4), (9, 4), (9, 3)))
    if name == "t_step":  # a step on the T axis: a strided view read in place
        return tuple(randn(rng, (2, 2 * t, d), dtype)[:, ::2] for t, d in ((6, 4), (9, 4), (9, 3)))
    if name == "fortran":
        return tuple(np.asfortranarray(randn(rng, (2, t, d), dtype)) for t, d in ((6, 4), (9, 4), (9, 3)))
    if name == "reversed":  # negative strides: copied
        return tuple(randn(rng, (2, t, d), dtype)[:, ::-1] for t, d in ((6, 4), (9, 4), (9, 3)))
    if name == "misaligned":  # data one byte off the item size: copied
        arrays = []
        for t, d in ((6, 4), (9, 4), (9, 3)):
            raw = np.zeros(2 * t * d * np.dtype(dtype).itemsize + 1, np.uint8)[1:]
            array = raw.view(dtype).reshape(2, t, d)
            array[...] = randn(rng, (2, t, d), dtype)
            arrays.append(array)
        return tuple(arrays)
    if name == "broadcast_heads":  # stride 0 on a leading dim
        return tuple(np.broadcast_to(randn(rng, (1, t, d), dtype), (2, t, d)) for t, d in ((6, 4), (9, 4), (9, 3)))
    raise AssertionError(name)


@pytest.mark.parametrize("dtype,impl", DTYPE_IMPLS)
@pytest.mark.parametrize("layout", ["transposed", "t_step", "fortran", "reversed", "misaligned", "broadcast_heads"])
def test_layouts(rng, dtype, impl, layout):
    q, k, v = layouts(rng, dtype, layout)
    result = qkv.attention(q, k, v, causal=True, impl=impl, return_lse=True)
    assert_attention_matches(result, q, k, v, causal=True)
    dout = randn(rng, (2, 6, 3), dtype)
    assert_gradients_match(qkv.attention_backward(q, k, v, dout, causal=True, impl=impl), q, k, v, dout, causal=True)


def test_read_only_inputs_work(rng):
    q, k, v = qkv_arrays(rng, (2,), 4, 5, 3, 3)
    for array in (q, k, v):
        array.flags.writeable = False
    assert_attention_matches(qkv.attention(q, k, v, return_lse=True), q, k, v)


def test_array_likes_are_converted():
    q = [[1.0, 0.0], [0.0, 1.0]]  # a list of Python floats is float64
    out = qkv.attention(q, q, q)
    assert out.dtype == np.float64
    assert_attention_matches((out,), np.array(q), np.array(q), np.array(q))


@pytest.mark.parametrize("dtype,impl", DTYPE_IMPLS)
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("tq,tk,dk,dv", SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_reference(rng, dtype, impl, lead, tq, tk, dk, dv, causal):
    q, k, v = qkv_arrays(rng, lead, tq, tk, dk, dv, dtype)
    dout = randn(rng, (*lead, tq, dv), dtype)
    grads = qkv.attention_backward(q, k, v, dout, causal=causal, impl=impl)
    assert_gradients_match(grads, q, k, v, dout, causal=causal)


@pytest.mark.parametrize("dtype,impl", DTYPE_IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_from_saved_out_and_lse(rng, dtype, impl, causal):
    q, k, v = qkv_arrays(rng, (2, 3), 9, 13, 8, 5, dtype)
    dout = randn(rng, (2, 3, 9, 5), dtype)
    out, lse = qkv.attention(q, k, v, causal=causal, impl=impl, return_lse=True)
    grads = qkv.attention_backward(q, k, v, dout, out=out, lse=lse, causal=causal, impl=impl)
    assert_gradients_match(grads, q, k, v, dout, causal=causal)


@pytest.mark.parametrize("dtype,impl", DTYPE_IMPLS)
# Every shape varies along Tk: a bias constant along a row shifts every score of it alike, which the
# softmax ignores, so its gradient is 0 up to cancellation and no test of anything.
@pytest.mark.parametrize("mask_shape", [(9, 13), (1, 3, 1, 13), (2, 3, 9, 13), (3, 1, 13), (1, 13)])
@pytest.mark.parametrize("saved", [False, True])
def test_backward_dbias(rng, dtype, impl, mask_shape, saved):
    q, k, v = qkv_arrays(rng, (2, 3), 9, 13, 8, 5, dtype)
    dout = randn(rng, (2, 3, 9, 5), dtype)
    bias = randn(rng, mask_shape, dtype)
    saved_kwargs = {}
    if saved:
        out, lse = qkv.attention(q, k, v, mask=bias, impl=impl, return_lse=True)
        saved_kwargs = {"out": out, "lse": lse}
    grads = qkv.attention_backward(q, k, v, dout, mask=bias, impl=impl, **saved_kwargs)
    assert grads[3].shape == mask_shape
    assert_gradients_match(grads, q, k, v, dout, mask=bias)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_backward_is_deterministic_across_thread_counts(rng, impl):
    q, k, v = qkv_arrays(rng, (4,), 200, 300, 32, 16)
    dout = randn(rng, (4, 200, 16))
    previous = qkv.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            qkv.set_num_threads(threads)
            results.append(qkv.attention_backward(q, k, v, dout, causal=True, impl=impl))
    finally:
        qkv.set_num_threads(previous)
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


# Zero copy: numpy reports its allocations to tracemalloc, so the peak during a call counts the
# outputs qkv allocates and any copy of an input, but not the C++ kernel's own scratch.
H, T, D = 8, 1024, 64
ARRAY_BYTES = H * T * D * 4  # one float32 [H, T, D] array: 2 MiB


def big(rng, layout):
    if layout == "contiguous":
        return randn(rng, (H, T, D))
    if layout == "t_step":
        return randn(rng, (H, 2 * T, D))[:, ::2]
    return randn(rng, (H, D, T)).transpose(0, 2, 1)


@pytest.mark.parametrize("layout,copies", [("contiguous", 0), ("t_step", 0), ("transposed", 3)])
def test_forward_reads_inputs_in_place(rng, layout, copies):
    q, k, v = (big(rng, layout) for _ in range(3))
    outputs = ARRAY_BYTES + H * T * 4  # out and lse
    peak = traced_peak(lambda: qkv.attention(q, k, v, return_lse=True))
    assert outputs + copies * ARRAY_BYTES <= peak < outputs + copies * ARRAY_BYTES + ARRAY_BYTES // 4, \
        f"peak {peak} bytes for outputs of {outputs} bytes and {copies} input copies of {ARRAY_BYTES}"


@pytest.mark.parametrize("layout,copies", [("contiguous", 0), ("t_step", 0), ("transposed", 4)])
def test_backward_reads_inputs_in_place(rng, layout, copies):
    q, k, v, dout = (big(rng, layout) for _ in range(4))
    out, lse = qkv.attention(q, k, v, return_lse=True)
    gradients = 3 * ARRAY_BYTES
    peak = traced_peak(lambda: qkv.attention_backward(q, k, v, dout, out=out, lse=lse))
    assert gradients + copies * ARRAY_BYTES <= peak < gradients + copies * ARRAY_BYTES + ARRAY_BYTES // 4, \
        f"peak {peak} bytes for gradients of {gradients} bytes and {copies} input copies of {ARRAY_BYTES}"


# Threads and signals. One [8, 4096, 64] float32 problem takes about 0.6 s on one thread here.
def long_problem(rng, heads=8, t=4096):
    return tuple(randn(rng, (heads, t, 64)) for _ in range(3))


def call_on_one_thread(q, k, v, spans, index):
    """qkv.attention on one qkv thread, recording (start, end) of the call into spans[index]."""
    qkv.set_num_threads(1)
    start = time.perf_counter()
    qkv.attention(q, k, v)
    spans[index] = (start, time.perf_counter())


def test_the_gil_is_released(rng):
    q, k, v = long_problem(rng)
    spans = {}
    worker = threading.Thread(target=call_on_one_thread, args=(q, k, v, spans, 0))
    ticks, count = [], 0
    worker.start()
    while worker.is_alive():  # plain Python work, which needs the GIL
        count += 1
        if count % 1024 == 0:
            ticks.append(time.perf_counter())
    worker.join()
    start, end = spans[0]
    margin = (end - start) / 10
    during = sum(start + margin < tick < end - margin for tick in ticks)
    print(f"call {end - start:.2f} s; {during * 1024} main-thread iterations in the middle 80% of it")
    assert end - start > 0.1, "the call should be long enough to tell"
    assert during >= 10, "the main thread stood still while qkv computed: the GIL was held"


def test_two_threads_run_in_parallel(rng):
    q, k, v = long_problem(rng, heads=4)
    ratios, overlaps = [], []
    for _ in range(3):  # the best of three: another process may take a core for a while
        spans = {}
        call_on_one_thread(q, k, v, spans, "alone")
        workers = [threading.Thread(target=call_on_one_thread, args=(q, k, v, spans, i)) for i in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        (start0, end0), (start1, end1) = spans[0], spans[1]
        # Calls that held the GIL would run one after the other: no overlap, whatever the load.
        overlaps.append((min(end0, end1) - max(start0, start1)) / max(end0 - start0, end1 - start1))
        ratios.append((max(end0, end1) - min(start0, start1)) / (spans["alone"][1] - spans["alone"][0]))
    # The ratio depends on what else the machine runs (and whether its two CPUs are two cores), so it
    # is reported, not asserted; bench/python_overhead.py measures it on a quiet machine.
    print(f"two concurrent calls take {min(ratios):.2f}x one call's time and overlap {max(overlaps):.0%} "
          f"(tries: {[f'{r:.2f}' for r in ratios]})")
    assert max(overlaps) > 0.5


def interrupt_main_thread_after(seconds):
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    return timer


@pytest.mark.parametrize("call,uninterrupted_s", [
    (lambda q: qkv.attention(q, q, q), 5),  # [16, 8192, 64] fused: about 5 s
    (lambda q: qkv.attention_backward(q, q, q, q), 9),
    # The reference stops between heads: 16 of them, so that one round of tasks is a small part of the
    # call on any CPU (about 1 s in all on a Zen 5 core pair, 2 allowed for slower ones).
    (lambda q: qkv.attention(q[:, :1024], q[:, :1024], q[:, :1024], impl="reference"), 2),
])
def test_ctrl_c_interrupts_a_call(rng, call, uninterrupted_s):
    # The times above are a release build's; the asan test preset says how much slower its build is.
    uninterrupted_s *= float(os.environ.get("QKV_TEST_TIME_SCALE", "1"))
    q = randn(rng, (16, 8192, 64))
    timer = interrupt_main_thread_after(0.2)
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        call(q)
    elapsed = time.perf_counter() - start
    timer.join()
    print(f"interrupted after {elapsed:.2f} s")
    assert elapsed < 0.2 + uninterrupted_s / 4
    small = qkv_arrays(rng, (2,), 5, 7, 4, 3)
    assert_attention_matches(qkv.attention(*small, return_lse=True), *small)
