"""One rank of test_dist.py's mpirun launches: every case of qkv.dist on this communicator.

    mpirun -np P python3 dist_worker.py [--end-with-uncaught-error]

Each rank builds the whole arrays from the same seed, takes its shard (qkv.dist.take_shard), runs
ring attention and its backward, and compares its shard of the results with the same shard of the
one-process qkv.attention and qkv.attention_backward: the float64 ones (the reference, plain loops
accumulating in float64), within twice the error of the float32 ones plus what the ring adds; and,
for one case, with a float64 numpy reference. Then the refusals: options ring attention does not
take, and bad input on one rank only, each of which every rank must raise alike and survive.

Prints "rank R ok: CASE" per case and "rank R done: N cases." at the end. A failed check aborts the
whole job (MPI Abort), so that no rank waits for one that stopped. --end-with-uncaught-error then
gives rank 1 a q of the wrong length and lets the error end every rank (test_dist.py checks that
mpirun exits non-zero, soon, and that the traceback names the argument).
"""

import os
import sys
import traceback

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qkv  # noqa: E402
import qkv.dist  # noqa: E402
from conftest import attention_backward_reference, attention_reference  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, RANKS = COMM.Get_rank(), COMM.Get_size()
EPS = float(np.finfo(np.float32).eps)
count = 0


def report(case):
    global count
    count += 1
    print(f"rank {RANK} ok: {case}", flush=True)


def check(what, got, single, want):
    """This rank's ring result `got` against its shard of the one-process float64 result `want`:
    within twice the error of the one-process float32 result `single`, plus the ring's own rounding:
    each row merges up to 2P partial results (and the gradients add up to 2P partials), each
    rounded to float32 before it joins, a few ε of the result's magnitude each (docs/distributed.md)."""
    got, single, want = (np.asarray(x, np.float64) for x in (got, single, want))
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite]), f"{what}: non-finite entries differ"
    assert np.isfinite(got[finite]).all(), f"{what}: non-finite values where the reference has none"
    scale = float(np.abs(want[finite]).max(initial=0)) or 1.0
    diff, single_diff = np.zeros(want.shape), np.zeros(want.shape)
    diff[finite] = np.abs(got[finite] - want[finite])
    single_diff[finite] = np.abs(single[finite] - want[finite])
    err = float(diff.max(initial=0))
    bound = 2 * float(single_diff.max(initial=0)) + 4 * RANKS * EPS * scale
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
    assert err <= bound, (f"{what}: max error {err:.3g} (mean {float(diff.mean()) if diff.size else 0:.3g}, worst "
                          f"at {worst}) exceeds 2 x one-process float32 + ring rounding = {bound:.3g}")


def shard(whole, layout, axis=-2):
    return qkv.dist.take_shard(whole, layout=layout, axis=axis)


def run_case(name, *, h=2, hkv=None, batch=(), tq=37, tk=None, dk=16, dv=8, layout="contiguous", saved=True,
             numpy_reference=False, mask_density=None, lengths_given=False, **options):
    hkv = h if hkv is None else hkv
    tk = tq if tk is None else tk
    rng = np.random.default_rng(sum(name.encode()))
    q = rng.standard_normal((*batch, h, tq, dk)).astype(np.float32)
    k = rng.standard_normal((*batch, hkv, tk, dk)).astype(np.float32)
    v = rng.standard_normal((*batch, hkv, tk, dv)).astype(np.float32)
    dout = rng.standard_normal((*batch, h, tq, dv)).astype(np.float32)
    ring_options = dict(options, **({"tq": tq, "tk": tk} if lengths_given else {}))
    if options.get("sinks") is not None:
        options["sinks"] = ring_options["sinks"] = rng.standard_normal(h).astype(np.float32)
    if mask_density is not None:
        mask = rng.random((*batch, h, tq, tk)) < mask_density
        mask[..., 0, :] = False  # a query that sees no key: out 0 and lse -inf, never NaN
        options["mask"] = mask
        ring_options["mask"] = shard(mask, layout)  # this rank's query rows over every key
    mine = [shard(x, layout) for x in (q, k, v, dout)]

    out, lse = qkv.dist.ring_attention(*mine[:3], layout=layout, return_lse=True, **ring_options)
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    out64, lse64 = qkv.attention(*wide[:3], return_lse=True, **options)
    out32, lse32 = qkv.attention(q, k, v, return_lse=True, **options)
    check(f"{name}: out", out, shard(out32, layout), shard(out64, layout))
    check(f"{name}: lse", lse, shard(lse32, layout, -1), shard(lse64, layout, -1))

    given = {"out": out, "lse": lse} if saved else {}
    grads = qkv.dist.ring_attention_backward(*mine, layout=layout, **given, **ring_options)
    grads64 = qkv.attention_backward(*wide, **options)
    grads32 = qkv.attention_backward(q, k, v, dout, **options)
    assert len(grads) == len(grads64), f"{name}: {len(grads)} gradients, expected {len(grads64)}"
    for g, (what, got) in enumerate(zip(("dq", "dk", "dv", "dsinks"), grads)):
        if what == "dsinks":  # summed over every rank's queries: the whole one, on every rank
            check(f"{name}: dsinks", got, grads32[g], grads64[g])
        else:
            check(f"{name}: {what}", got, shard(grads32[g], layout), shard(grads64[g], layout))

    if numpy_reference:
        causal = options.get("causal", False)
        want_out, want_lse, _ = attention_reference(q, k, v, causal=causal, dtype=np.float64)
        check(f"{name}: out against numpy", out, shard(out32, layout), shard(want_out, layout))
        check(f"{name}: lse against numpy", lse, shard(lse32, layout, -1), shard(want_lse, layout, -1))
        want_grads = attention_backward_reference(q, k, v, dout, causal=causal, dtype=np.float64)
        for g, what in enumerate(("dq", "dk", "dv")):
            check(f"{name}: {what} against numpy", grads[g], shard(grads32[g], layout), shard(want_grads[g], layout))
    report(name)


def numeric_cases():
    # T = 37 is a multiple of neither P nor 2P for P = 2 and 3: the shards are uneven.
    run_case("contiguous", numpy_reference=True)
    run_case("contiguous causal", causal=True, saved=False)
    run_case("zigzag", layout="zigzag")
    run_case("zigzag causal", layout="zigzag", causal=True)
    run_case("zigzag causal Tq 13 Tk 29 (given)", layout="zigzag", tq=13, tk=29, causal=True, lengths_given=True)
    run_case("contiguous top-left Tq 13 Tk 29", tq=13, tk=29, causal="top-left")
    run_case("zigzag causal GQA B=2 H=4 Hkv=2", layout="zigzag", batch=(2,), h=4, hkv=2, causal=True)
    run_case("zigzag sinks window ALiBi softcap", layout="zigzag", sinks=True, window=(4, 1), alibi="auto",
             softcap=5.0, scale=0.3)
    run_case("contiguous bool mask", mask_density=0.6, causal=True)
    run_case("zigzag T=3 (empty ranges)", layout="zigzag", tq=3, causal=True)


def refused_everywhere(name, call, kind, *must_mention):
    """call() raises `kind` on every rank, the same message everywhere, naming must_mention."""
    try:
        call()
    except kind as error:
        message = str(error)
    else:
        raise AssertionError(f"{name}: no exception, expected {kind.__name__}")
    missing = [text for text in must_mention if text not in message]
    assert not missing, f"{name}: the message {message!r} does not mention {missing}"
    messages = COMM.allgather(message)
    assert len(set(messages)) == 1, f"{name}: the ranks raised different messages: {messages}"
    report(f"{name}: {message}")


def refusals():
    rng = np.random.default_rng(3)
    q, k, v = (shard(rng.standard_normal((2, 11, 4)).astype(np.float32), "contiguous") for _ in range(3))
    ring = qkv.dist.ring_attention
    bias = np.zeros((2, q.shape[1], 11), np.float32)
    refused_everywhere("a float mask", lambda: ring(q, k, v, mask=bias), ValueError, "mask", "bias")
    refused_everywhere("packed sequences", lambda: ring(q, k, v, cu_seqlens_q=[0, q.shape[1]],
                                                       cu_seqlens_k=[0, k.shape[1]]), ValueError, "cu_seqlens_q")
    refused_everywhere("dropout", lambda: ring(q, k, v, dropout=0.1), ValueError, "dropout")
    refused_everywhere("float64", lambda: ring(q.astype(np.float64), k, v), qkv.ShapeError, "q", "float32")
    refused_everywhere("a bad layout", lambda: ring(q, k, v, layout="diagonal"), ValueError, "layout", "diagonal")
    refused_everywhere("tq that is not the whole sequence's", lambda: ring(q, k, v, tq=2 * 11), qkv.ShapeError,
                       "q: expected", "Tq = 22")
    refused_everywhere("a comm that is not one", lambda: ring(q, k, v, comm="world"), TypeError, "comm")

    # Bad input on rank 1 alone: every rank raises rank 1's error, and none waits for the others.
    bad_k = k[..., :3] if RANK == 1 else k
    refused_everywhere("rank 1's k has Dk 3", lambda: ring(q, bad_k, v), qkv.ShapeError, "rank 1: ", "k")
    causal = "diagonal" if RANK == 1 else True
    refused_everywhere("rank 1's causal is no causality", lambda: ring(q, k, v, causal=causal), ValueError,
                       "rank 1: causal")
    refused_everywhere("rank 1 alone causal", lambda: ring(q, k, v, causal=RANK == 1), ValueError, "rank 1: ",
                       "causal")
    bad_dout = np.zeros((2, q.shape[1] + (RANK == 1), 4), np.float32)
    refused_everywhere("rank 1's dout has a token too many",
                       lambda: qkv.dist.ring_attention_backward(q, k, v, bad_dout), qkv.ShapeError, "rank 1: ",
                       "dout")
    # The ranks are still in step after all that.
    out = ring(q, k, v)
    assert out.shape == (2, q.shape[1], 4)
    report("a call after the refusals")


def shard_helpers():
    assert qkv.dist.shard_ranges(10, 2, 1, "contiguous") == [(5, 10)]
    assert qkv.dist.shard_ranges(10, 2, 0, "zigzag") == [(0, 2), (7, 10)]
    for layout in ("contiguous", "zigzag"):
        # Every token of T = 10 on exactly one rank.
        tokens = [t for r in range(RANKS) for start, stop in qkv.dist.shard_ranges(10, RANKS, r, layout)
                  for t in range(start, stop)]
        assert sorted(tokens) == list(range(10)), f"{layout}: the shards hold tokens {tokens}"
    whole = np.arange(2 * 10 * 3, dtype=np.float32).reshape(2, 10, 3)
    first, second = qkv.dist.shard_ranges(10, RANKS, RANK, "zigzag")
    mine = qkv.dist.take_shard(whole, layout="zigzag")
    assert np.array_equal(mine, np.concatenate([whole[:, slice(*first)], whole[:, slice(*second)]], axis=1))
    lse_mine = qkv.dist.take_shard(whole[..., 0], layout="zigzag", axis=-1)
    assert np.array_equal(lse_mine, mine[..., 0])
    report("shard_ranges and take_shard")


def main():
    print(f"rank {RANK} LD_PRELOAD=[{os.environ.get('LD_PRELOAD', '')}]", flush=True)
    try:
        shard_helpers()
        numeric_cases()
        refusals()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        COMM.Abort(1)
    print(f"rank {RANK} done: {count} cases.", flush=True)
    if "--end-with-uncaught-error" in sys.argv:
        q = np.zeros((2, 5 + (RANK == 1), 4), np.float32)
        k = np.zeros((2, 5, 4), np.float32)
        qkv.dist.ring_attention(q, k, k)
        print(f"rank {RANK}: no exception", flush=True)


main()
