"""qkv for PyTorch: differentiable attention on CPU tensors, without linking libtorch.

    import torch, qkv.torch
    out = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True)   # like F.sdpa
    out.sum().backward()                                                    # through qkv's backward

Tensors reach qkv's kernels over DLPack without a copy (np.from_dlpack), the results come back
with torch.from_numpy, also without a copy. The autograd function keeps q, k, v, out and lse for
the backward, never the Tq x Tk weights.

The op is registered with PyTorch too, as torch.ops.qkv.attention_forward(q, k, v, attn_mask,
is_causal, scale) -> (out, lse): with torch.library.custom_op, register_fake and
register_autograd where PyTorch has them (2.4 and later, so torch.compile can trace it), and with
torch.library.Library("qkv", "DEF") before that (Debian 12's torch 1.13). Its is_causal is qkv's
bottom-right one. The op keeps that signature: scaled_dot_product_attention's window, softcap,
alibi, sinks, packed sequences, dropout and seed, and its top-left causality when Tq != Tk, go
through the autograd function alone.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import _qkv
# qkv.attention and its backward, which take any number of batch dims.
from . import attention as _batched_attention, attention_backward as _batched_attention_backward

__all__ = ["SelfAttention", "scaled_dot_product_attention"]

_CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
# The dtypes qkv reads as stored (float32 arithmetic, float32 results, cast back to the operand's dtype).
_NARROW = (torch.float16, torch.bfloat16)


def _array(tensor: torch.Tensor, name: str) -> np.ndarray:
    """The tensor as a numpy array over the same memory."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on {tensor.device}")
    tensor = tensor.detach()
    if tensor.dtype == torch.bool:
        # DLPack in torch 1.13 has no bool; the bytes are the same 0/1 that qkv reads.
        tensor = tensor.view(torch.uint8)
    if tensor.dtype == torch.bfloat16:
        # numpy has no bfloat16: its bits as uint16, which qkv.attention reads as bfloat16 with bf16=True.
        return np.from_dlpack(tensor.view(torch.int16)).view(np.uint16)
    return np.from_dlpack(tensor)


def _float32_array(tensor: Optional[torch.Tensor], name: str) -> Optional[np.ndarray]:
    """A mask, ALiBi's slopes or the sinks: float16 and bfloat16 ones widened to float32, which qkv takes with
    operands of any dtype (a bfloat16 mask's bits would read as an integer mask)."""
    if tensor is None:
        return None
    if isinstance(tensor, torch.Tensor) and tensor.dtype in _NARROW:
        tensor = tensor.float()
    return _array(tensor, name)


def _mask_array(mask: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    return _float32_array(mask, "attn_mask")


def _offsets(values, name: str):
    """cu_seqlens as qkv.attention takes them: a tensor as its array, a list or an array as given."""
    return _array(values, name) if isinstance(values, torch.Tensor) else values


# The numpy API's argument names as PyTorch's signature spells them, for the errors qkv raises.
_TORCH_NAMES = {"q": "query", "k": "key", "v": "value", "mask": "attn_mask", "dropout": "dropout_p"}


def _renamed(error: Exception) -> Exception:
    """The error with its leading argument name ("q: expected ...") in PyTorch's words."""
    name, sep, rest = str(error).partition(": ")
    if sep and name in _TORCH_NAMES:
        return type(error)(f"{_TORCH_NAMES[name]}: {rest}")
    return error


def _options(window=None, softcap=None, cu_seqlens_q=None, cu_seqlens_k=None, dropout=0.0, seed=0) -> dict:
    """The keywords of qkv.attention that carry no tensor with a gradient, as it takes them."""
    return {"window": window, "softcap": softcap, "cu_seqlens_q": _offsets(cu_seqlens_q, "cu_seqlens_q"),
            "cu_seqlens_k": _offsets(cu_seqlens_k, "cu_seqlens_k"), "dropout": dropout, "seed": seed}


def _bf16(*operands) -> bool:
    return any(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 for x in operands)


def _as_dtype_of(gradient: Optional[torch.Tensor], tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return gradient if gradient is None or tensor is None else gradient.to(tensor.dtype)


def _forward(q, k, v, attn_mask, causal, scale: Optional[float], sinks=None, alibi=None,
             options: Optional[dict] = None, return_lse: bool = True):
    """(out, lse), or out alone without return_lse, float32 for float16 and bfloat16 operands too;
    causal is qkv.attention's (False, True, "bottom-right" or "top-left"), options what _options
    returns."""
    try:
        result = _batched_attention(_array(q, "query"), _array(k, "key"), _array(v, "value"), scale=scale,
                                    causal=causal, mask=_mask_array(attn_mask), alibi=_float32_array(alibi, "alibi"),
                                    sinks=_float32_array(sinks, "sinks"), return_lse=return_lse, bf16=_bf16(q, k, v),
                                    **(options or {}))
    except (_qkv.Error, _qkv.ResourceError) as e:
        raise _renamed(e) from None
    if not return_lse:
        return torch.from_numpy(result)
    out, lse = result
    return torch.from_numpy(out), torch.from_numpy(lse)


def _gradient_wanted(*operands) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in operands)


def _compiling() -> bool:
    """Whether torch.compile is tracing the call, which must then go through the registered op."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())


def _backward(q, k, v, attn_mask, causal, scale, out, lse, dout, sinks=None, alibi=None,
              options: Optional[dict] = None):
    """(dq, dk, dv, dmask, dsinks), float32 for float16 and bfloat16 operands too (out is the float32
    one); dmask None unless attn_mask is a float bias, dsinks None without sinks."""
    if dout.dtype in _NARROW:
        dout = dout.float()
    try:
        grads = _batched_attention_backward(_array(q, "query"), _array(k, "key"), _array(v, "value"),
                                            _array(dout, "dout"), out=_array(out, "out"), lse=_array(lse, "lse"),
                                            scale=scale, causal=causal, mask=_mask_array(attn_mask),
                                            alibi=_float32_array(alibi, "alibi"),
                                            sinks=_float32_array(sinks, "sinks"), bf16=_bf16(q, k, v),
                                            **(options or {}))
    except (_qkv.Error, _qkv.ResourceError) as e:
        raise _renamed(e) from None
    grads = [torch.from_numpy(g) for g in grads]
    dsinks = grads.pop() if sinks is not None else None
    dmask = grads.pop() if len(grads) == 4 else None
    return (*grads, dmask, dsinks)


class _Attention(torch.autograd.Function):
    """(out, lse) of qkv's attention; the backward reads the saved out and lse, and replays the
    dropout mask from the seed in options. Gradients reach q, k, v, a float attn_mask and the sinks;
    alibi's slopes are constants. With float16 or bfloat16 operands, out has q's dtype and each
    gradient its tensor's, from float32 ones; the float32 out is kept for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, causal, scale, sinks, alibi, options):
        out, lse = _forward(q, k, v, attn_mask, causal, scale, sinks, alibi, options)
        ctx.save_for_backward(q, k, v, attn_mask, sinks, alibi, out, lse)
        ctx.causal, ctx.scale, ctx.options = causal, scale, options
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, attn_mask, sinks, alibi, out, lse = ctx.saved_tensors
        dq, dk, dv, dmask, dsinks = _backward(q, k, v, attn_mask, ctx.causal, ctx.scale, out, lse, dout, sinks,
                                              alibi, ctx.options)
        if not ctx.needs_input_grad[3]:
            dmask = None
        if not ctx.needs_input_grad[6]:
            dsinks = None
        return (_as_dtype_of(dq, q), _as_dtype_of(dk, k), _as_dtype_of(dv, v), _as_dtype_of(dmask, attn_mask), None,
                None, _as_dtype_of(dsinks, sinks), None, None)


def _attention(q, k, v, attn_mask, causal, scale, sinks=None, alibi=None, options=None):
    return _Attention.apply(q, k, v, attn_mask, causal, scale, sinks, alibi, options)


def _register_op():
    """Registers qkv::attention_forward with PyTorch's dispatcher; returns the callable to use."""
    if hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake"):
        @torch.library.custom_op("qkv::attention_forward", mutates_args=())
        def attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_mask: Optional[torch.Tensor], is_causal: bool,
                              scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
            return _forward(query, key, value, attn_mask, is_causal, scale)

        @attention_forward.register_fake
        def _(query, key, value, attn_mask, is_causal, scale):
            return (query.new_empty(query.shape[:-1] + value.shape[-1:]), query.new_empty(query.shape[:-1]))

        @torch.library.custom_op("qkv::attention_backward", mutates_args=())
        def attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attn_mask: Optional[torch.Tensor], is_causal: bool, scale: Optional[float],
                               out: torch.Tensor, lse: torch.Tensor,
                               dout: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            dq, dk, dv, dmask, _ = _backward(query, key, value, attn_mask, is_causal, scale, out, lse, dout)
            return dq, dk, dv, dmask if dmask is not None else query.new_empty(0)

        @attention_backward.register_fake
        def _(query, key, value, attn_mask, is_causal, scale, out, lse, dout):
            float_mask = attn_mask is not None and attn_mask.is_floating_point()
            return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
                    torch.empty_like(attn_mask) if float_mask else query.new_empty(0))

        def setup_context(ctx, inputs, output):
            query, key, value, attn_mask, is_causal, scale = inputs
            ctx.save_for_backward(query, key, value, attn_mask, *output)
            ctx.is_causal, ctx.scale = is_causal, scale

        def backward(ctx, dout, _dlse):
            query, key, value, attn_mask, out, lse = ctx.saved_tensors
            dq, dk, dv, dmask = torch.ops.qkv.attention_backward(query, key, value, attn_mask, ctx.is_causal,
                                                                 ctx.scale, out, lse, dout)
            float_mask = attn_mask is not None and attn_mask.is_floating_point()
            return dq, dk, dv, dmask if float_mask else None, None, None

        attention_forward.register_autograd(backward, setup_context=setup_context)
        return torch.ops.qkv.attention_forward

    library = torch.library.Library("qkv", "DEF")
    library.define("attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, bool is_causal, "
                   "float? scale) -> (Tensor, Tensor)")
    # The autograd function is the implementation for every dispatch key, so the op is differentiable.
    library.impl("attention_forward", _attention, "CompositeImplicitAutograd")
    _register_op.library = library  # a Library unregisters its ops when collected
    return _attention


_attention_forward = _register_op()


def _lengths_differ(tq: int, tk: int, cu_seqlens_q, cu_seqlens_k) -> bool:
    """Whether some sequence has Tq != Tk, where the two causal alignments differ. Packed sequences
    share their offsets' 0, so they all have Tq == Tk iff the offsets are equal."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        return tq != tk
    cu_q, cu_k = (np.asarray(_offsets(cu, name)) for cu, name in ((cu_seqlens_q, "cu_seqlens_q"),
                                                                   (cu_seqlens_k, "cu_seqlens_k")))
    return not np.array_equal(cu_q, cu_k)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, *,
                                 causal_alignment: str = "top_left", window: Optional[Tuple[int, int]] = None,
                                 softcap: Optional[float] = None, alibi: Union[None, str, torch.Tensor] = None,
                                 sinks: Optional[torch.Tensor] = None, seed: Optional[int] = None,
                                 cu_seqlens_q: Union[None, torch.Tensor, Sequence[int]] = None,
                                 cu_seqlens_k: Union[None, torch.Tensor, Sequence[int]] = None) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention, computed by qkv and differentiable.

    query [B, H, Tq, E], key [B, Hkv, Tk, E], value [B, Hkv, Tk, Ev] -> [B, H, Tq, Ev], float32
    (the fused kernel) or float64 (the float64 reference); B, or B and H, may be left out.
    float16 and bfloat16 tensors (each of query, key and value in its own, or float32) run the
    fused kernel on them as stored, with float32 arithmetic: the result has query's dtype, each
    gradient its tensor's. Dropout and packed sequences are refused with them. Hkv may
    be any divisor of H (grouped-query attention, as PyTorch's enable_gqa=True): query head h
    reads key/value head h // (H // Hkv), and key.grad, value.grad have key's and value's shapes.
    attn_mask: broadcastable to [B, H, Tq, Tk]; bool (True = may attend) or a float bias added to
        the scores (its gradient is computed when it requires grad). It combines with is_causal.
    is_causal: with causal_alignment="top_left" (PyTorch's convention) query i sees keys j <= i;
        with "bottom_right" (qkv's, and FlashAttention's) j <= i + Tk - Tq, so that with a KV
        cache the last query sees every key. The two agree when Tq == Tk.
    scale: 1/sqrt(E) when None.
    window: None or (left, right): query i sees keys i + o - left <= j <= i + o + right, -1 for an
        unbounded side; o is the diagonal's offset, 0 top-left and Tk - Tq bottom-right.
    softcap: None or c > 0: the scaled scores x become c * tanh(x / c) before attn_mask is added.
    alibi: None, "auto" (qkv.alibi_slopes(H)) or [H] slopes m_h: adds -m_h * |i + o - j|.
    sinks: None or [H] logits that join every row's softmax with no value; they get a gradient
        when they require grad.
    The window's and ALiBi's o follows causal_alignment when is_causal; without is_causal it is
    bottom-right, and top_left (the default) with Tq != Tk is refused for them.
    dropout_p: in [0, 1), as PyTorch's: each weight is dropped with probability p, the kept ones
        scaled by 1/(1 - p); applied whenever it is nonzero (pass 0.0 in eval mode).
    seed: the int in [0, 2**64) that decides the dropout mask (qkv.attention's); when None and
        dropout_p > 0, one is drawn from torch's default generator (torch.manual_seed repeats it),
        so that calls differ. The backward replays the same mask.
    cu_seqlens_q, cu_seqlens_k: None, or both: [N+1] offsets (int32/int64 tensors or lists) of
        sequences packed along T of a batch of one, as qkv.attention's: each sequence attends
        within itself, is_causal, the window and ALiBi counted within it.

    A call no gradient flows through (under torch.no_grad(), or with no operand that requires grad)
    computes out alone, without the lse a backward needs, so that decoding a few queries over many
    keys takes qkv's decode kernel: 2.6x as fast at Tq = 1, Tk = 32768, H = 32, E = 128 (Zen 5), 3.7x
    with 8 key and value heads.

    Differs from PyTorch's: a query whose every key is masked gives 0 (and zero gradients), not
    NaN. The dropout mask is qkv's (Philox, keyed by the seed), not the one PyTorch would draw.
    """
    if causal_alignment not in _CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment: expected \"top_left\" or \"bottom_right\", got {causal_alignment!r}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    if isinstance(alibi, str):
        if alibi != "auto":
            raise ValueError(f"alibi: expected None, \"auto\" or a tensor of [H] slopes, got {alibi!r}")
        alibi = torch.tensor(_qkv.alibi_slopes(query.shape[-3] if query.ndim >= 3 else 1), dtype=query.dtype)
    if attn_mask is not None and not attn_mask.is_floating_point() and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask != 0  # an integer mask reads as bool: nonzero = may attend
    tq, tk = query.shape[-2] if query.ndim >= 2 else 0, key.shape[-2] if key.ndim >= 2 else 0
    top_left = causal_alignment == "top_left" and _lengths_differ(tq, tk, cu_seqlens_q, cu_seqlens_k)
    if top_left and not is_causal and (window is not None or alibi is not None):
        # qkv takes the alignment with causality alone; a silent bottom-right window would mislead.
        lengths = "packed sequences with Tq != Tk" if cu_seqlens_q is not None else f"Tq = {tq}, Tk = {tk}"
        raise ValueError(f"causal_alignment: \"top_left\" places the window and ALiBi only with is_causal=True; "
                         f"pass is_causal=True or causal_alignment=\"bottom_right\" ({lengths})")
    causal = ("top-left" if top_left else True) if is_causal else False
    if seed is None and dropout_p != 0.0:
        # From torch's default generator, so that torch.manual_seed repeats a run and successive
        # calls drop different weights, as PyTorch's own dropout does.
        seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    extras = (window, softcap, alibi, sinks, seed, cu_seqlens_q, cu_seqlens_k)
    narrow = any(isinstance(x, torch.Tensor) and x.dtype in _NARROW for x in (query, key, value))
    options = _options(window, softcap, cu_seqlens_q, cu_seqlens_k, dropout_p, 0 if seed is None else seed)
    if not _compiling() and not _gradient_wanted(query, key, value, attn_mask, sinks):
        # No lse for a backward: qkv may then take its decode kernel for a few queries, which sums
        # q·k in another order than the backward does.
        return _forward(query, key, value, attn_mask, causal, scale, sinks, alibi, options,
                        return_lse=False).to(query.dtype)
    if causal == "top-left" or dropout_p != 0.0 or narrow or any(x is not None for x in extras):
        return _attention(query, key, value, attn_mask, causal, scale, sinks, alibi, options)[0]
    return _attention_forward(query, key, value, attn_mask, causal, scale)[0]


class SelfAttention(torch.nn.Module):
    """Multi-head self-attention whose attention runs on qkv: a drop-in for the textbook block.

        x [B, T, d_model] or [T, d_model] -> y of x's shape
        Q, K, V = q_proj(x), k_proj(x), v_proj(x)   (torch.nn.Linear(d_model, d_model, bias))
        y = out_proj(concat_h attention(Q_h, K_h, V_h))   (without out_proj: output_projection=False)

    forward(x, attn_mask=None, is_causal=False): attn_mask and is_causal as in
    scaled_dot_product_attention, broadcastable to [B, n_heads, T, T].
    """

    def __init__(self, d_model: int, n_heads: int = 1, bias: bool = True, output_projection: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if n_heads < 1 or d_model < 1 or d_model % n_heads != 0:
            raise ValueError(f"d_model, n_heads: expected n_heads >= 1 dividing d_model >= 1, got d_model={d_model}, "
                             f"n_heads={n_heads}")
        self.d_model, self.n_heads = d_model, n_heads
        factory = {"device": device, "dtype": dtype}
        self.q_proj = torch.nn.Linear(d_model, d_model, bias=bias, **factory)
        self.k_proj = torch.nn.Linear(d_model, d_model, bias=bias, **factory)
        self.v_proj = torch.nn.Linear(d_model, d_model, bias=bias, **factory)
        self.out_proj = torch.nn.Linear(d_model, d_model, bias=bias, **factory) if output_projection else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [..., T, d_model] -> [..., H, T, Dh]: a strided view, which qkv reads in place.
        return x.unflatten(-1, (self.n_heads, self.d_model // self.n_heads)).transpose(-3, -2)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        context = scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal)
        context = context.transpose(-3, -2).flatten(-2)
        return self.out_proj(context) if self.out_proj is not None else context
