"""qkv.torch: scaled_dot_product_attention against torch's own float64 maths and gradcheck, the
registered op, the SelfAttention module, and a training run that matches torch's attention step for
step."""

import copy

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from conftest import assert_close, attention_reference, randn

sdpa = qkv.torch.scaled_dot_product_attention


def top_left_allowed(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).tril()


def bottom_right_allowed(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)


def torch_math(q, k, v, attn_mask=None, is_causal=False, scale=None, causal_alignment="top_left"):
    """softmax(q k^T * scale + bias) v in torch, in q's dtype; rows that see no key give 0."""
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1 / q.shape[-1] ** 0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if is_causal:
        allowed = (top_left_allowed if causal_alignment == "top_left" else bottom_right_allowed)(tq, tk)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    seen = torch.isfinite(scores).any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~seen, 0), dim=-1).masked_fill(~seen | ~allowed, 0)
    return weights @ v


def tensors(rng, lead, tq, tk, dk, dv, dtype=torch.float64, requires_grad=True):
    shapes = ((*lead, tq, dk), (*lead, tk, dk), (*lead, tk, dv))
    return tuple(torch.from_numpy(rng.standard_normal(s)).to(dtype).requires_grad_(requires_grad) for s in shapes)


def gradcheck(function, *inputs):
    assert torch.autograd.gradcheck(function, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


SHAPES = [  # lead, tq, tk, dk, dv
    ((), 4, 4, 3, 3), ((2,), 3, 6, 4, 2), ((2, 2), 6, 3, 2, 5), ((1,), 1, 1, 1, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lead,tq,tk,dk,dv", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_forward_matches_torch_math(rng, dtype, lead, tq, tk, dk, dv, is_causal, alignment):
    q, k, v = tensors(rng, lead, tq, tk, dk, dv, dtype, requires_grad=False)
    out = sdpa(q, k, v, is_causal=is_causal, causal_alignment=alignment)
    assert out.dtype == dtype and out.shape == (*lead, tq, dv)
    mask = None
    if is_causal:
        mask = (top_left_allowed if alignment == "top_left" else bottom_right_allowed)(tq, tk).numpy()
    expected = attention_reference(q.numpy(), k.numpy(), v.numpy(), mask=mask)[0]
    naive = torch_math(q, k, v, is_causal=is_causal, causal_alignment=alignment)
    assert_close(out.numpy(), expected, naive.numpy())


@pytest.mark.parametrize("lead,tq,tk,dk,dv", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_gradcheck(rng, lead, tq, tk, dk, dv, is_causal, alignment):
    q, k, v = tensors(rng, lead, tq, tk, dk, dv)
    gradcheck(lambda q, k, v: sdpa(q, k, v, is_causal=is_causal, causal_alignment=alignment), q, k, v)


@pytest.mark.parametrize("mask_shape", [(5, 7), (1, 2, 1, 7), (2, 2, 5, 7)])
@pytest.mark.parametrize("is_causal,alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_gradcheck_float_mask(rng, mask_shape, is_causal, alignment):
    q, k, v = tensors(rng, (2, 2), 5, 7, 3, 4)
    bias = torch.from_numpy(rng.standard_normal(mask_shape)).requires_grad_()
    gradcheck(lambda q, k, v, bias: sdpa(q, k, v, bias, is_causal=is_causal, causal_alignment=alignment),
              q, k, v, bias)
    out = sdpa(q, k, v, bias, is_causal=is_causal, causal_alignment=alignment)
    expected = torch_math(q, k, v, bias, is_causal=is_causal, causal_alignment=alignment)
    torch.testing.assert_close(out, expected)


def test_bool_mask_with_an_empty_row(rng):
    q, k, v = tensors(rng, (2,), 4, 5, 3, 3)
    mask = torch.from_numpy(rng.random((4, 5)) < 0.6)
    mask[2] = False
    out = sdpa(q, k, v, mask)
    assert torch.all(out[:, 2] == 0) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, 2] == 0)
    torch.testing.assert_close(out, torch_math(q, k, v, mask))
    gradcheck(lambda q, k, v: sdpa(q, k, v, mask), q, k, v)


def test_no_keys(rng):
    # The C++ op accepts Tk = 0: every query sees no key, so out 0 and zero gradients.
    q, k, v = tensors(rng, (2,), 3, 0, 4, 5)
    out = sdpa(q, k, v)
    assert out.shape == (2, 3, 5) and torch.all(out == 0)
    out.sum().backward()
    assert torch.all(q.grad == 0) and k.grad.shape == (2, 0, 4)


def test_non_contiguous_inputs(rng):
    # q transposed from [.., D, T] (last dim not contiguous: copied), k and v a step on T (strided
    # views read in place).
    base_q = torch.from_numpy(rng.standard_normal((2, 3, 5))).requires_grad_()
    base_k = torch.from_numpy(rng.standard_normal((2, 12, 3))).requires_grad_()
    base_v = torch.from_numpy(rng.standard_normal((2, 12, 4))).requires_grad_()

    def function(base_q, base_k, base_v):
        return sdpa(base_q.transpose(-1, -2), base_k[:, ::2], base_v[:, 1::2], is_causal=True)

    out = function(base_q, base_k, base_v)
    expected = torch_math(base_q.transpose(-1, -2), base_k[:, ::2], base_v[:, 1::2], is_causal=True)
    torch.testing.assert_close(out, expected)
    gradcheck(function, base_q, base_k, base_v)


def test_float32_gradients_match_the_reference_rule(rng):
    q, k, v = tensors(rng, (2, 3), 9, 13, 8, 5, torch.float32)
    dout = torch.from_numpy(randn(rng, (2, 3, 9, 5)))
    sdpa(q, k, v, is_causal=True).backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    torch_math(q64, k64, v64, is_causal=True).backward(dout.double())
    q32, k32, v32 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch_math(q32, k32, v32, is_causal=True).backward(dout)
    for name, ours, wide, naive in zip("qkv", (q, k, v), (q64, k64, v64), (q32, k32, v32)):
        assert_close(ours.grad.numpy(), wide.grad.numpy(), naive.grad.numpy(), what=f"d{name}")


def test_tensors_reach_qkv_without_a_copy(rng, monkeypatch):
    q, k, v = tensors(rng, (2,), 4, 6, 3, 3, torch.float32)
    seen = {}

    def spy(name, function):
        def call(*args, **kwargs):
            seen[name] = [a.ctypes.data for a in args] + [kwargs[key].ctypes.data for key in ("out", "lse")
                                                          if key in kwargs]
            result = function(*args, **kwargs)
            seen[name + " result"] = [r.ctypes.data for r in result]
            return result
        return call

    monkeypatch.setattr(qkv.torch, "_batched_attention", spy("forward", qkv.torch._batched_attention))
    monkeypatch.setattr(qkv.torch, "_batched_attention_backward",
                        spy("backward", qkv.torch._batched_attention_backward))
    out = sdpa(q, k, v)
    dout = torch.ones_like(out)
    out.backward(dout)
    assert seen["forward"] == [t.data_ptr() for t in (q, k, v)]
    assert seen["forward result"][0] == out.data_ptr()
    assert seen["backward"][:3] == [t.data_ptr() for t in (q, k, v)]
    assert seen["backward"][4] == out.data_ptr()
    assert seen["backward result"] == [t.grad.data_ptr() for t in (q, k, v)]


def test_calls_no_gradient_flows_through_ask_for_no_lse(rng, monkeypatch):
    # Without the lse, a few queries over many keys take qkv's decode kernel; the attention is the same.
    asked = []
    attention = qkv.torch._batched_attention

    def spy(*args, **kwargs):
        asked.append(kwargs["return_lse"])
        return attention(*args, **kwargs)

    monkeypatch.setattr(qkv.torch, "_batched_attention", spy)
    q, k, v = tensors(rng, (3,), 1, 700, 16, 8, torch.float32, requires_grad=False)
    expected = attention_reference(q.numpy(), k.numpy(), v.numpy())[0]
    naive = torch_math(q, k, v)
    assert_close(sdpa(q, k, v).numpy(), expected, naive.numpy())
    q.requires_grad_()
    with torch.no_grad():
        out = sdpa(q, k, v)
    assert not out.requires_grad
    assert_close(out.numpy(), expected, naive.detach().numpy())
    assert asked == [False, False]
    sdpa(q, k, v).sum().backward()
    assert asked[2] is True and q.grad is not None


def test_registered_op(rng):
    assert hasattr(torch.ops.qkv, "attention_forward")
    q, k, v = tensors(rng, (2,), 3, 5, 4, 2)
    out, lse = torch.ops.qkv.attention_forward(q, k, v, None, True, None)  # is_causal bottom-right
    torch.testing.assert_close(out, torch_math(q, k, v, is_causal=True, causal_alignment="bottom_right"))
    assert lse.shape == (2, 3)
    gradcheck(lambda q, k, v: torch.ops.qkv.attention_forward(q, k, v, None, True, 0.7)[0], q, k, v)


def test_refusals(rng):
    q, k, v = tensors(rng, (), 3, 3, 2, 2)
    with pytest.raises(ValueError, match=r"^dropout_p: p must be in \[0, 1\), got 1.5"):
        sdpa(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="causal_alignment"):
        sdpa(q, k, v, is_causal=True, causal_alignment="top_right")
    with pytest.raises(ValueError, match="scale: expected a finite number"):
        sdpa(q, k, v, scale=float("nan"))
    with pytest.raises(qkv.ShapeError, match=r"^key: expected dtype float64 \(the dtype of q\), got float32"):
        sdpa(q, k.float(), v)
    with pytest.raises(TypeError, match="query: expected a torch.Tensor"):
        sdpa(q.detach().numpy(), k, v)
    with pytest.raises(ValueError, match="d_model, n_heads"):
        qkv.torch.SelfAttention(6, 4)


class TorchMathSelfAttention(qkv.torch.SelfAttention):
    """The same module with its attention computed by torch's own maths."""

    def forward(self, x, attn_mask=None, is_causal=False):
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        context = torch_math(q, k, v, attn_mask, is_causal=is_causal).transpose(-3, -2).flatten(-2)
        return self.out_proj(context) if self.out_proj is not None else context


def twins(module_args):
    """(qkv's module, torch maths' module), float32, with the same weights."""
    torch.manual_seed(0)
    ours = qkv.torch.SelfAttention(*module_args)
    theirs = TorchMathSelfAttention(*module_args)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("module_args", [(8, 2), (12, 3, False), (6, 1, True, False)])
@pytest.mark.parametrize("x_shape,is_causal", [((5,), False), ((2, 7), True)])
def test_self_attention_module_matches_torch_math(rng, module_args, x_shape, is_causal):
    ours, naive = twins(module_args)
    wide = copy.deepcopy(naive).double()
    x = torch.from_numpy(randn(rng, (*x_shape, module_args[0])))
    dy = torch.from_numpy(randn(rng, (*x_shape, module_args[0])))
    outputs = []
    for module, dtype in ((ours, torch.float32), (wide, torch.float64), (naive, torch.float32)):
        y = module(x.to(dtype), is_causal=is_causal)
        y.backward(dy.to(dtype))
        # Not k_proj.bias: it adds q . b_k to every score of a row, which the softmax ignores, so its
        # gradient is 0 up to cancellation.
        outputs.append([y.detach().numpy()] + [p.grad.numpy() for name, p in module.named_parameters()
                                               if name != "k_proj.bias"])
    for index, (actual, expected, plain) in enumerate(zip(*outputs)):
        assert_close(actual, expected, plain, what=f"output {index}")


def test_training_matches_torch_attention():
    """The seed's example, six tokens of d = 32 through W_Q, W_K, W_V (nn.Linear(d, d, bias=False)),
    with a linear head regressing a fixed target: 100 Adam steps give the same losses either way."""
    d, tokens, steps = 32, 6, 100
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, d, generator=generator)
    target = torch.randn(tokens, 1, generator=generator)

    def model(attention_class):
        torch.manual_seed(1)
        return torch.nn.Sequential(attention_class(d, 1, bias=False, output_projection=False), torch.nn.Linear(d, 1))

    curves = []
    for attention_class in (qkv.torch.SelfAttention, TorchMathSelfAttention):
        net = model(attention_class)
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves.append(np.array(losses))
    ours, theirs = curves
    assert theirs[-1] < theirs[0] / 100, "the model should learn the target"
    # Once the loss is small, float32 rounding of the predictions (about eps * |target|) dominates it.
    rounding = 8 * np.finfo(np.float32).eps * float(target.square().mean())
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=rounding)  # every step, the last included
