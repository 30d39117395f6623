"""qkv.SelfAttention: its forward against numpy maths on its own parameters, its backward against
central differences, parameters that alias the layer, and its refusals."""

import numpy as np
import pytest

import qkv
from conftest import WIDE, assert_close, attention_reference, randn


def layer_reference(layer, x, mask=None, dtype=WIDE):
    """y of the layer, recomputed from layer.parameters() in `dtype`."""
    p = {name: np.asarray(value, dtype=dtype) for name, value in layer.parameters().items()}
    x = np.asarray(x, dtype=dtype)

    def project(name):
        projected = x @ p[f"w_{name}"].T + p.get(f"b_{name}", 0)
        heads = projected.reshape(*x.shape[:-1], layer.n_heads, layer.head_dim)
        return np.swapaxes(heads, -2, -3)  # [.., H, T, Dh]

    context = attention_reference(project("q"), project("k"), project("v"), causal=layer.causal, mask=mask,
                                  dtype=dtype)[0]
    context = np.swapaxes(context, -2, -3).reshape(x.shape)
    if "w_o" not in p:
        return context
    return context @ p["w_o"].T + p.get("b_o", 0)


CONFIGS = [  # d_model, n_heads, bias, output_projection, causal
    (8, 1, True, True, False), (12, 3, True, True, True), (16, 4, False, True, False), (6, 2, True, False, True),
    (32, 1, False, False, False),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("d_model,n_heads,bias,output_projection,causal", CONFIGS)
@pytest.mark.parametrize("x_shape", [(7,), (2, 5)])
def test_forward_matches_numpy(rng, dtype, d_model, n_heads, bias, output_projection, causal, x_shape):
    layer = qkv.SelfAttention(d_model, n_heads, bias=bias, output_projection=output_projection, causal=causal,
                              seed=3, dtype=dtype)
    names = {"w_q", "w_k", "w_v"} | ({"w_o"} if output_projection else set())
    names |= {"b" + name[1:] for name in names} if bias else set()
    assert set(layer.parameters()) == names
    x = randn(rng, (*x_shape, d_model), dtype)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == np.dtype(dtype)
    assert_close(y, layer_reference(layer, x), layer_reference(layer, x, dtype=np.dtype(dtype).type))


def test_weights_and_mask(rng):
    layer = qkv.SelfAttention(8, 2, seed=1, dtype="float64")
    x = randn(rng, (3, 5, 8), np.float64)
    mask = rng.random((5, 5)) < 0.6
    mask[:, 0] = True
    y, weights = layer.forward(x, mask=mask, return_weights=True)
    assert weights.shape == (3, 2, 5, 5)
    np.testing.assert_allclose(weights.sum(axis=-1), 1)
    assert np.all(weights[..., ~mask] == 0)
    np.testing.assert_allclose(y, layer_reference(layer, x, mask=mask), rtol=1e-12, atol=1e-12)


def test_variants_reach_the_attention(rng):
    """softcap, window and alibi of the layer are those of qkv.attention, forward and backward."""
    options = dict(softcap=2.0, window=(2, 0), alibi=True)
    layer = qkv.SelfAttention(8, 2, causal=True, seed=4, dtype="float64", **options)
    x = randn(rng, (2, 6, 8), np.float64)
    p = layer.parameters()

    def heads(name):
        projected = x @ p[f"w_{name}"].T + p[f"b_{name}"]
        return np.swapaxes(projected.reshape(2, 6, 2, 4), 1, 2)

    context = qkv.attention(heads("q"), heads("k"), heads("v"), causal=True, impl="reference", softcap=2.0,
                            window=(2, 0), alibi="auto")
    expected = np.swapaxes(context, 1, 2).reshape(x.shape) @ p["w_o"].T + p["b_o"]
    np.testing.assert_allclose(layer(x), expected, rtol=0, atol=1e-13)
    plain = qkv.SelfAttention(8, 2, causal=True, seed=4, dtype="float64")
    assert not np.allclose(plain(x), expected)

    dy = randn(rng, x.shape, np.float64)
    layer(x)
    dx = layer.backward(dy)
    direction = randn(rng, x.shape, np.float64)
    numeric = central_difference(lambda moved: np.sum(dy * layer(moved)), x, direction)
    assert np.isclose(np.sum(dx * direction), numeric, rtol=1e-7)
    with pytest.raises(qkv.Error, match="window: expected None or a pair"):
        qkv.SelfAttention(8, 2, window=3)
    with pytest.raises(qkv.Error, match="softcap: expected a positive finite number, got -1"):
        qkv.SelfAttention(8, 2, softcap=-1.0)(x.astype(np.float32))


def test_initial_weights_follow_the_seed():
    one, same, other = (qkv.SelfAttention(8, 2, seed=seed) for seed in (5, 5, 6))
    np.testing.assert_array_equal(one.parameters()["w_q"], same.parameters()["w_q"])
    assert not np.array_equal(one.parameters()["w_q"], other.parameters()["w_q"])
    # torch.nn.Linear's init: uniform in +-1/sqrt(d_model).
    assert np.abs(one.parameters()["w_q"]).max() <= 1 / np.sqrt(8)


def central_difference(f, x, direction, h=1e-6):
    return (f(x + h * direction) - f(x - h * direction)) / (2 * h)


@pytest.mark.parametrize("n_heads,causal", [(1, False), (2, True)])
def test_backward_against_central_differences(rng, n_heads, causal):
    layer = qkv.SelfAttention(6, n_heads, causal=causal, seed=2, dtype="float64")
    x = randn(rng, (2, 4, 6), np.float64)
    dy = randn(rng, x.shape, np.float64)
    layer(x)
    dx = layer.backward(dy)
    assert dx.shape == x.shape

    def loss_of_x(moved):
        return np.sum(dy * layer(moved))

    direction = randn(rng, x.shape, np.float64)
    assert np.isclose(np.sum(dx * direction), central_difference(loss_of_x, x, direction), rtol=1e-7)

    for name in ("w_q", "b_v", "w_o"):
        parameter, grad = layer.parameters()[name], layer.grads()[name].copy()
        original = parameter.copy()

        def loss_of_parameter(value):
            parameter[...] = value
            return np.sum(dy * layer(x))

        direction = randn(rng, parameter.shape, np.float64)
        numeric = central_difference(loss_of_parameter, original, direction)
        parameter[...] = original
        assert np.isclose(np.sum(grad * direction), numeric, rtol=1e-7), name


def test_backward_accumulates_and_zero_grad_resets(rng):
    layer = qkv.SelfAttention(4, 2, seed=0, dtype="float64")
    x, dy = randn(rng, (3, 4), np.float64), randn(rng, (3, 4), np.float64)
    layer(x)
    layer.backward(dy)
    once = {name: grad.copy() for name, grad in layer.grads().items()}
    layer.backward(dy)
    for name, grad in layer.grads().items():
        np.testing.assert_allclose(grad, 2 * once[name], rtol=1e-14, atol=1e-15)
    layer.zero_grad()
    assert all(np.all(grad == 0) for grad in layer.grads().values())


def test_parameters_alias_the_layer(rng):
    layer = qkv.SelfAttention(4, 1, seed=0)
    x = randn(rng, (3, 4))
    before = layer(x)
    parameters = layer.parameters()
    parameters["b_o"][...] += 1  # the output bias adds to every output
    np.testing.assert_allclose(layer(x), before + 1, rtol=1e-6)
    parameters["w_v"][...] = 0
    np.testing.assert_allclose(layer(x), np.broadcast_to(parameters["b_o"] + parameters["w_o"] @ parameters["b_v"],
                                                         x.shape), rtol=1e-6)


def test_parameters_outlive_the_name():
    parameters = qkv.SelfAttention(4, 1, seed=0).parameters()  # the arrays keep the layer alive
    assert np.isfinite(parameters["w_q"]).all()


def test_properties_and_repr():
    layer = qkv.SelfAttention(12, 3, causal=True, dtype="float64")
    assert (layer.d_model, layer.n_heads, layer.head_dim, layer.causal, layer.dtype) == (12, 3, 4, True, "float64")
    assert repr(layer).startswith("qkv.SelfAttention(d_model=12, n_heads=3")


def test_backward_before_forward_is_refused():
    with pytest.raises(ValueError, match="backward: expected a forward call first"):
        qkv.SelfAttention(4).backward(np.zeros((2, 4), np.float32))


def test_wrong_dy_shape_is_refused(rng):
    layer = qkv.SelfAttention(4)
    layer(randn(rng, (3, 4)))
    with pytest.raises(qkv.ShapeError, match="dy"):
        layer.backward(np.zeros((2, 4), np.float32))


@pytest.mark.parametrize("d_model,n_heads,message", [
    (6, 4, r"d_model: expected a multiple of n_heads \(4\), got 6"),
    (4, 0, "n_heads: expected at least 1, got 0"),
    (0, 1, "d_model: expected at least 1, got 0"),
])
def test_bad_head_count_is_refused(d_model, n_heads, message):
    with pytest.raises(qkv.Error, match=message):
        qkv.SelfAttention(d_model, n_heads)


def test_bad_inputs_are_refused(rng):
    layer = qkv.SelfAttention(4)
    with pytest.raises(qkv.ShapeError, match="x: expected dtype float32"):
        layer(randn(rng, (3, 4), np.float64))
    with pytest.raises(qkv.ShapeError, match="x"):
        layer(randn(rng, (3, 5)))
    with pytest.raises(qkv.ShapeError, match="x: expected rank 2 or 3"):
        layer(randn(rng, (4,)))
    with pytest.raises(ValueError, match="dtype"):
        qkv.SelfAttention(4, dtype="float16")
