"""Ring attention over MPI, from Python: one sequence split along T, one shard per rank of an mpi4py
communicator (docs/distributed.md).

    # mpirun -np 4 python3 this.py
    import qkv.dist
    q, k, v, dout = ...     # on every rank the whole [B, H, T, D] arrays, or only its own shards
    q, k, v, dout = (qkv.dist.take_shard(x, layout="zigzag") for x in (q, k, v, dout))
    out, lse = qkv.dist.ring_attention(q, k, v, layout="zigzag", causal=True, return_lse=True)
    dq, dk, dv = qkv.dist.ring_attention_backward(q, k, v, dout, layout="zigzag", causal=True,
                                                  out=out, lse=lse)

Each rank passes its shard of q, k and v (and dout), as shard_ranges says which tokens it holds,
and gets back its shard of out and lse (and of dq, dk, dv): the exact attention of its queries
over the whole sequence. The options are qkv.attention's, by the same names, with the whole
sequence's meaning: causal (either alignment), the window, ALiBi, the softcap, the sinks (dsinks,
summed over every rank's queries, is the same on every rank) and the scale; a bool mask that
broadcasts to [B, H, tq_r, Tk] (this rank's query rows over every key of the sequence, in sequence
order). Refused, with a ValueError: a float mask (an additive bias), packed sequences
(cu_seqlens_q, cu_seqlens_k) and dropout. float32 only; grouped-query heads (Hkv dividing H) are
taken. Shapes: q [B, H, tq_r, Dk], k [B, Hkv, tk_r, Dk], v [B, Hkv, tk_r, Dv], B or B and H may
be left out.

Every call is collective: every rank of comm must make it, with the same options. Each rank's
arguments are checked first, and the ranks agree before any array is sent: when one rank's are
wrong, every rank raises the same exception, naming that rank ("rank 1: q: expected ...").

Importing this module raises ImportError, saying why, where qkv was built without qkv._dist (no
Open MPI or no mpi4py C headers at build time) or where mpi4py does not import.
"""

from __future__ import annotations

import importlib.util

import numpy as np

if importlib.util.find_spec(f"{__package__}._dist") is None:
    raise ImportError("qkv.dist: this qkv was built without its MPI module qkv._dist (it is built where Open MPI "
                      "and mpi4py's C headers are found: Debian's libopenmpi-dev and python3-mpi4py)")
try:
    from mpi4py import MPI
except ImportError as error:
    raise ImportError(f"qkv.dist needs mpi4py (Debian: python3-mpi4py), which did not import: {error}") from error

from . import _dist  # noqa: E402  (after the checks above, which say why it would not import)

__all__ = ["ring_attention", "ring_attention_backward", "shard_ranges", "take_shard"]


def ring_attention(q, k, v, *, comm=None, layout="contiguous", tq=None, tk=None, scale=None, causal=False,
                   mask=None, return_lse=False, allow_nonfinite=False, window=None, softcap=None, alibi=None,
                   sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, dropout=0.0, seed=0):
    """This rank's shard of attention(q, k, v) over the whole sequence: out [B, H, tq_r, Dv], and
    lse [B, H, tq_r] with return_lse=True (as (out, lse)).

    q, k, v: this rank's shards, of shard_length(T) tokens along T as shard_ranges gives them.
    comm: an mpi4py MPI.Comm; None is MPI.COMM_WORLD.
    layout: "contiguous" (rank r holds tokens [r*T/P, (r+1)*T/P)) or "zigzag" (chunks r and 2P-1-r
        of 2P, in that order: under a causal mask every rank then does the same work).
    tq, tk: the whole sequence's numbers of queries and keys; None sums every rank's shards.
    The other arguments are qkv.attention's; a float mask, packed sequences and dropout are refused.
    """
    return _dist.ring_attention(q, k, v, comm=comm, layout=layout, tq=tq, tk=tk, scale=scale, causal=causal,
                                mask=mask, return_lse=return_lse, allow_nonfinite=allow_nonfinite, window=window,
                                softcap=softcap, alibi=alibi, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, dropout=dropout, seed=seed)


def ring_attention_backward(q, k, v, dout, *, comm=None, layout="contiguous", tq=None, tk=None, out=None, lse=None,
                            scale=None, causal=False, mask=None, allow_nonfinite=False, window=None, softcap=None,
                            alibi=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, dropout=0.0, seed=0):
    """This rank's (dq, dk, dv), and dsinks [H] when sinks are given, of L = sum over every rank of
    sum(dout * out), out being what ring_attention(q, k, v, ...) returns on that rank.

    dout [B, H, tq_r, Dv]: this rank's shard of the gradient of out. out, lse: this rank's
    ring_attention(..., return_lse=True), both or neither (the forward is run again without them).
    dsinks is summed over every rank's queries and is the same on every rank. The other arguments
    are ring_attention's, which must be given the same ones.
    """
    return _dist.ring_attention_backward(q, k, v, dout, comm=comm, layout=layout, tq=tq, tk=tk, out=out, lse=lse,
                                         scale=scale, causal=causal, mask=mask, allow_nonfinite=allow_nonfinite,
                                         window=window, softcap=softcap, alibi=alibi, sinks=sinks,
                                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, dropout=dropout,
                                         seed=seed)


def shard_ranges(tokens: int, ranks: int, rank: int, layout: str = "contiguous") -> list:
    """The tokens of a sequence of `tokens` that rank `rank` of `ranks` holds, as [(start, stop), ...]
    in the order its shard stores them: one range for "contiguous", two for "zigzag". Shards differ
    by at most a token per range when tokens is not a multiple of ranks (2 * ranks for zigzag); a
    range may be empty."""
    return _dist.shard_ranges(tokens, ranks, rank, layout)


def take_shard(whole, *, comm=None, layout: str = "contiguous", rank=None, axis: int = -2) -> np.ndarray:
    """Rank `rank`'s shard (this rank's of comm when None) of an array every rank holds whole:
    its tokens along `axis` (T, the second to last, for q, k, v, out and dout; -1 for lse), in
    shard_ranges' order, as one C-contiguous array."""
    comm = MPI.COMM_WORLD if comm is None else comm
    whole = np.asarray(whole)
    rank = comm.Get_rank() if rank is None else rank
    ranges = shard_ranges(whole.shape[axis], comm.Get_size(), rank, layout)
    return np.ascontiguousarray(np.concatenate([np.take(whole, range(start, stop), axis=axis)
                                                for start, stop in ranges], axis=axis))
