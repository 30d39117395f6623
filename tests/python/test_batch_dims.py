"""Any number of batch dims before the heads, as torch takes them: q [L1, ..., Ln, H, Tq, Dk] runs as
one batch of L1*...*Ln through qkv.attention, attention_backward, the additive pair and qkv.torch,
and every result keeps the leading dims; masks broadcast over the batch (reshaped when their batch
dims are all 1 or all full, copied otherwise, with dbias summed back). Checked against float64
PyTorch and against the same call on the batch flattened by hand."""

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from conftest import randn
from test_variants import assert_tight, reference

MASKS = [
    None,
    ("bool", (5, 7)),              # no batch dims: as it is
    ("float", (2, 3, 4, 5, 7)),     # batch dims all full: reshaped
    ("float", (1, 1, 4, 1, 7)),     # all 1: reshaped
    ("float", (2, 1, 1, 1, 5, 7)),  # 2 and 1 over [2, 1, 3]: mixed, copied
    ("bool", (1, 3, 1, 5, 7)),      # 1 and 3 over [2, 3]: mixed
]


def draw(rng, lead, heads, kv_heads, mask, dtype=np.float64):
    q = randn(rng, (*lead, heads, 5, 4), dtype)
    k = randn(rng, (*lead, kv_heads, 7, 4), dtype)
    v = randn(rng, (*lead, kv_heads, 7, 3), dtype)
    m = None
    if mask is not None:
        kind, shape = mask
        m = rng.random(shape) < 0.8 if kind == "bool" else randn(rng, shape, dtype)
    return q, k, v, m


def broadcasts(mask, lead):
    if mask is None or len(mask[1]) <= 3:
        return True
    if len(mask[1]) > len(lead) + 3:
        return False
    own = (1,) * (len(lead) + 3 - len(mask[1])) + mask[1][:-3]
    return all(o in (1, d) for o, d in zip(own, lead))


CASES = [(lead, mask) for lead in [(2, 3), (2, 1, 3), (1, 2, 1, 2)] for mask in MASKS if broadcasts(mask, lead)]


@pytest.mark.parametrize("lead,mask", CASES, ids=[f"{list(lead)}-" + ("none" if m is None else f"{m[0]}{list(m[1])}")
                                                 for lead, m in CASES])
def test_batch_dims_match_float64_torch(rng, lead, mask):
    q, k, v, m = draw(rng, lead, heads=4, kv_heads=2, mask=mask)
    dout = randn(rng, (*lead, 4, 5, 3), np.float64)
    out, lse = qkv.attention(q, k, v, mask=m, causal=True, return_lse=True)
    assert out.shape == (*lead, 4, 5, 3) and lse.shape == (*lead, 4, 5)
    grads = qkv.attention_backward(q, k, v, dout, mask=m, causal=True)

    t = {name: torch.from_numpy(a).requires_grad_(a.dtype != bool) for name, a in
         dict(q=q, k=k, v=v, m=m).items() if a is not None}
    want, want_lse, _ = reference(t["q"], t["k"], t["v"], causal=True, mask=t.get("m"))
    want.backward(torch.from_numpy(dout))
    assert_tight(out, want.detach().numpy(), what="out")
    assert_tight(lse, want_lse.numpy(), what="lse")
    names = ["q", "k", "v"] + (["m"] if m is not None and m.dtype != bool else [])
    assert len(grads) == len(names)
    for name, g in zip(names, grads):
        assert g.shape == t[name].shape, name
        assert_tight(g, t[name].grad.numpy(), what="d" + name)


def test_batch_dims_are_the_flattened_call_bit_for_bit(rng):
    q, k, v, m = draw(rng, (2, 3), heads=2, kv_heads=2, mask=("float", (2, 3, 2, 5, 7)), dtype=np.float32)
    dout = randn(rng, (2, 3, 2, 5, 3))
    out = qkv.attention(q, k, v, mask=m)
    flat = qkv.attention(q.reshape(6, 2, 5, 4), k.reshape(6, 2, 7, 4), v.reshape(6, 2, 7, 3),
                         mask=m.reshape(6, 2, 5, 7))
    assert np.array_equal(out, flat.reshape(out.shape))
    grads = qkv.attention_backward(q, k, v, dout=dout, mask=m)
    flat_grads = qkv.attention_backward(q.reshape(6, 2, 5, 4), k.reshape(6, 2, 7, 4), v.reshape(6, 2, 7, 3),
                                        dout.reshape(6, 2, 5, 3), mask=m.reshape(6, 2, 5, 7))
    for g, f in zip(grads, flat_grads):
        assert np.array_equal(g, f.reshape(g.shape))


def test_backward_takes_out_and_lse_with_the_batch(rng):
    q, k, v, _ = draw(rng, (2, 2), heads=3, kv_heads=3, mask=None, dtype=np.float32)
    dout = randn(rng, (2, 2, 3, 5, 3))
    out, lse = qkv.attention(q, k, v, return_lse=True)
    with_saved = qkv.attention_backward(q, k, v, dout, out=out, lse=lse)
    for g, want in zip(with_saved, qkv.attention_backward(q, k, v, dout)):
        assert g.shape == want.shape
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_additive_attention_takes_batch_dims(rng):
    q, k, v, m = draw(rng, (2, 2), heads=2, kv_heads=2, mask=("float", (2, 1, 1, 5, 7)), dtype=np.float32)
    w_q, w_k, w = randn(rng, (6, 4)), randn(rng, (6, 4)), randn(rng, (6,))
    dout = randn(rng, (2, 2, 2, 5, 3))
    out = qkv.additive_attention(q, k, v, w_q, w_k, w, mask=m)
    assert out.shape == (2, 2, 2, 5, 3)
    full = np.broadcast_to(m, (2, 2, 2, 5, 7)).reshape(8, 5, 7)
    flat = qkv.additive_attention(q.reshape(8, 5, 4), k.reshape(8, 7, 4), v.reshape(8, 7, 3), w_q, w_k, w,
                                  mask=full)
    assert np.array_equal(out.reshape(8, 5, 3), flat)
    grads = qkv.additive_attention_backward(q, k, v, w_q, w_k, w, dout, mask=m)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, w_q.shape, w_k.shape, w.shape, m.shape]
    flat_grads = qkv.additive_attention_backward(q.reshape(8, 5, 4), k.reshape(8, 7, 4), v.reshape(8, 7, 3),
                                                 w_q, w_k, w, dout.reshape(8, 5, 3), mask=full)
    dbias = flat_grads[6].reshape(2, 2, 2, 5, 7).sum(axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(grads[6], dbias, rtol=1e-5, atol=1e-6)


def test_torch_adapter_takes_batch_dims():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, 3, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 1, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=b), (q, k, v, bias))


@pytest.mark.parametrize("call,message", [
    (lambda q, k, v: qkv.attention(q, k[0], v), "k: expected the batch dims [2, 3] of q, then [Hkv, Tk, Dk]"),
    (lambda q, k, v: qkv.attention(q, k, v[:, :1]), "v: expected the batch dims [2, 3] of q"),
    (lambda q, k, v: qkv.attention(q, k, v, mask=np.ones((3, 3, 1, 5, 7), bool)),
     "mask: expected a shape that broadcasts to the scores [..., H, Tq, Tk] = [2, 3, 2, 5, 7], got [3, 3, 1, 5, 7]"),
    (lambda q, k, v: qkv.attention(q, k, v, mask=np.ones((1, 2, 3, 2, 5, 7), bool)), "mask: expected a shape"),
    (lambda q, k, v: qkv.attention_backward(q, k, v, np.ones((2, 5, 3))), "dout: expected the batch dims [2, 3]"),
    (lambda q, k, v: qkv.attention_backward(q, k, v, np.ones((2, 3, 2, 5, 3)), lse=np.ones((2, 3, 2, 5, 1))),
     "lse: expected the batch dims [2, 3] of q, then [H, Tq]"),
    (lambda q, k, v: qkv.torch.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k[0]),
                                                           torch.from_numpy(v)), "key: expected the batch dims"),
])
def test_batch_dims_that_disagree_are_refused(rng, call, message):
    q, k, v, _ = draw(rng, (2, 3), heads=2, kv_heads=2, mask=None)
    with pytest.raises(qkv.ShapeError) as error:
        call(q, k, v)
    assert message in str(error.value)
