"""Operands stored narrower than float32 from Python: float16, bfloat16 (bits in uint16, bf16=True)
and int8 with scales through qkv.attention and its backward, the conversions that make them, and
qkv.KvCache. The rule is the suite's: against float64 on the values the operands stand for, within
twice the error of the naive float32 computation on those values; on every SIMD target."""

from __future__ import annotations

import numpy as np
import pytest

import qkv
from conftest import assert_close, attention_backward_reference, attention_reference, randn, traced_peak


@pytest.fixture(params=qkv.simd_targets())
def target(request):
    qkv.use_simd_target(request.param)
    yield request.param
    qkv.use_simd_target("")


def stored(x: np.ndarray, kind: str, group: str = "channel"):
    """(the operand as qkv takes it, its keywords, the float32 values it stands for)."""
    if kind == "float32":
        return x, {}, x
    if kind == "float16":
        half = x.astype(np.float16)
        return half, {}, half.astype(np.float32)
    if kind == "bfloat16":
        bits = qkv.to_bfloat16(x)
        return bits, {"bf16": True}, qkv.from_bfloat16(bits)
    values, scales = qkv.quantize_int8(x, group)
    return values, {"scales": scales}, values.astype(np.float32) * scales


def operands(q, k, v, kinds):
    """q, k, v stored as kinds = (q's, k's, v's), the keywords of attention() that go with them, and
    their float32 values."""
    (qs, qkw, qf), (ks, kkw, kf), (vs, vkw, vf) = (stored(x, kind, group) for x, kind, group in
                                                   zip((q, k, v), kinds, ("channel", "channel", "token")))
    kw = {"bf16": any(d.get("bf16") for d in (qkw, kkw, vkw))}
    if "scales" in kkw:
        kw["k_scales"] = kkw["scales"]
    if "scales" in vkw:
        kw["v_scales"] = vkw["scales"]
    return (qs, ks, vs), kw, (qf, kf, vf)


KINDS = [("float16", "float16", "float16"), ("bfloat16", "bfloat16", "bfloat16"), ("float32", "int8", "int8"),
         ("float16", "int8", "bfloat16"), ("float32", "float16", "int8")]


@pytest.mark.parametrize("kinds", KINDS, ids=lambda k: "-".join(k))
@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize("tq, tk, causal", [(1, 37, True), (5, 5, False), (19, 70, True)])
def test_forward_matches_reference(rng, target, kinds, impl, tq, tk, causal):
    q, k, v = randn(rng, (4, tq, 21)), randn(rng, (2, tk, 21)), randn(rng, (2, tk, 13))
    (qs, ks, vs), kw, (qf, kf, vf) = operands(q, k, v, kinds)
    out, lse = qkv.attention(qs, ks, vs, causal=causal, impl=impl, return_lse=True, **kw)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    group = 2  # query heads per key/value head
    kf, vf = np.repeat(kf, group, axis=0), np.repeat(vf, group, axis=0)
    expected = attention_reference(qf, kf, vf, causal=causal)
    naive = attention_reference(qf, kf, vf, causal=causal, dtype=np.float32)
    assert_close(out, expected[0], naive[0], what="out")
    assert_close(lse, expected[1], naive[1], what="lse")


@pytest.mark.parametrize("kinds", KINDS, ids=lambda k: "-".join(k))
def test_masks_and_batches(rng, kinds):
    q, k, v = randn(rng, (2, 3, 6, 8)), randn(rng, (2, 3, 11, 8)), randn(rng, (2, 3, 11, 5))
    mask = rng.random((3, 6, 11)) < 0.7
    mask[1, 2] = False  # a row that sees no key
    (qs, ks, vs), kw, (qf, kf, vf) = operands(q, k, v, kinds)
    out = qkv.attention(qs, ks, vs, mask=mask, **kw)
    expected = attention_reference(qf, kf, vf, mask=mask)
    naive = attention_reference(qf, kf, vf, mask=mask, dtype=np.float32)
    assert_close(out, expected[0], naive[0], what="out")
    assert not np.isnan(out).any() and np.all(out[:, 1, 2] == 0)


@pytest.mark.parametrize("kinds", KINDS, ids=lambda k: "-".join(k))
def test_backward_matches_reference(rng, target, kinds):
    q, k, v = randn(rng, (2, 7, 9)), randn(rng, (2, 12, 9)), randn(rng, (2, 12, 6))
    dout = randn(rng, (2, 7, 6))
    (qs, ks, vs), kw, (qf, kf, vf) = operands(q, k, v, kinds)
    out, lse = qkv.attention(qs, ks, vs, causal=True, return_lse=True, **kw)
    for saved in ({}, {"out": out, "lse": lse}):
        grads = qkv.attention_backward(qs, ks, vs, dout, causal=True, **saved, **kw)
        expected = attention_backward_reference(qf, kf, vf, dout, causal=True)
        naive = attention_backward_reference(qf, kf, vf, dout, causal=True, dtype=np.float32)
        for name, actual, wide, plain, operand in zip(("dq", "dk", "dv"), grads, expected, naive, (qs, ks, vs)):
            assert actual.dtype == np.float32 and actual.shape == operand.shape
            assert_close(actual, wide, plain, what=name)


def test_batch_dims_beyond_four_take_broadcast_scales(rng):
    q, k, v = randn(rng, (2, 3, 4, 5, 8)), randn(rng, (2, 3, 2, 9, 8)), randn(rng, (2, 3, 2, 9, 8))
    kq, ks = qkv.quantize_int8(k, "channel")
    assert ks.shape == (2, 3, 2, 1, 8)
    vq, _ = qkv.quantize_int8(v, "tensor")
    vs = np.full((1, 1, 1, 1, 1), 0.02, np.float32)
    out = qkv.attention(q, kq, vq, k_scales=ks, v_scales=vs, causal=True)
    expected = qkv.attention(q.astype(np.float64), (kq * ks).astype(np.float64), (vq * vs).astype(np.float64),
                             causal=True)
    assert out.shape == (2, 3, 4, 5, 8)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_float16_operands_are_read_in_place(rng):
    q = randn(rng, (8, 1, 64))
    k, v = (randn(rng, (8, 8192, 64)).astype(np.float16) for _ in range(2))
    peak = traced_peak(lambda: qkv.attention(q, k, v))
    assert peak < k.nbytes // 4, f"{peak} bytes allocated beside {k.nbytes}-byte operands: a copy was made"


def test_conversions():
    x = np.array([[1.0, -2.5, 2.0**127, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 0.0]], np.float32)
    bits = qkv.to_bfloat16(x)
    assert bits.dtype == np.uint16
    # Round to nearest even: 1 + 2^-8 is a tie that goes down to 1, 1 + 3*2^-8 one that goes up.
    np.testing.assert_array_equal(qkv.from_bfloat16(bits), [[1.0, -2.5, 2.0**127, 1.0, 1.0 + 2.0**-6, 0]])
    big = np.arange(2 * 3 * 4 * 5 * 6, dtype=np.float32).reshape(2, 3, 4, 5, 6)
    assert qkv.from_bfloat16(qkv.to_bfloat16(big)).shape == big.shape
    # numpy would give an infinity, which attention() then refuses.
    with pytest.raises(ValueError, match=r"^x: expected values that bfloat16 holds \(\|x\| < 3\.39\d*e\+38\), got "
                       r"3\.4e\+38 at \[0, 1\]$"):
        qkv.to_bfloat16(np.array([[1.0, 3.4e38]], np.float32))
    values, scales = qkv.quantize_int8(np.array([[0.0, 1.0], [0.0, -2.0]], np.float32), "channel")
    np.testing.assert_array_equal(scales, np.array([[1.0, 2.0 / 127]], np.float32))  # a channel of zeros keeps scale 1
    np.testing.assert_array_equal(values, [[0, 64], [0, -127]])
    for group, shape in (("channel", (3, 1, 7)), ("token", (3, 5, 1)), ("tensor", (1, 1, 1))):
        x = np.random.default_rng(1).standard_normal((3, 5, 7)).astype(np.float32)
        values, scales = qkv.quantize_int8(x, group)
        assert values.dtype == np.int8 and scales.shape == shape
        assert np.all(np.abs(values * scales - x) <= scales / 2 * (1 + 1e-6))


REFUSALS = [
    (lambda a: qkv.attention(a["q"], a["kb"], a["v"]), ValueError, "k: expected bf16=True with a uint16 array"),
    (lambda a: qkv.attention(a["q"], a["k"], a["v"], bf16=True), ValueError, "bf16: True says which uint16"),
    (lambda a: qkv.attention(a["q"], a["kq"], a["v"]), ValueError, "k_scales: expected the scales of int8 k"),
    (lambda a: qkv.attention(a["q"], a["k"], a["v"], k_scales=a["ks"]), ValueError,
     "k_scales: expected none for k of dtype float32"),
    (lambda a: qkv.attention(a["q"], a["kq"], a["v"], k_scales=a["ks"][..., :3]), ValueError,
     "k_scales: shape [2, 1, 3] does not broadcast to [2, 9, 8]"),
    (lambda a: qkv.attention(a["q"], a["kq"], a["v"], k_scales=a["ks"] * np.nan), ValueError,
     "k_scales: expected finite values"),
    (lambda a: qkv.attention(a["q"], a["kq"], a["v"], k_scales=a["ks"].astype(np.int32)), ValueError,
     "k_scales: expected dtype float32 or float64, got int32"),
    (lambda a: qkv.attention(a["q"].astype(np.int8), a["kq"], a["v"], k_scales=a["ks"]), ValueError,
     "q: expected dtype float32, float16, uint16 (bfloat16 bits, with bf16=True), got int8"),
    (lambda a: qkv.attention(a["q"].astype(np.float64), a["kh"], a["v"]), ValueError,
     "q: expected float32 beside float16, bfloat16 or int8 operands"),
    (lambda a: qkv.attention(a["q"], a["kh"], a["v"].astype(np.float64)), ValueError,
     "v: expected float32 beside float16, bfloat16 or int8 operands"),
    (lambda a: qkv.attention(a["q"], a["kh"], a["v"], dropout=0.1), ValueError, "dropout: expected 0 with float16"),
    (lambda a: qkv.attention(a["q"], a["kh"] * np.float16(np.inf), a["v"]), ValueError, "k: expected finite values"),
    (lambda a: qkv.attention(a["q"], a["kh"], a["v"], cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 9]), ValueError,
     "packed sequences are not taken"),
    (lambda a: qkv.quantize_int8(a["k"], "row"), ValueError, "group: expected \"channel\", \"token\" or \"tensor\""),
    (lambda a: qkv.quantize_int8(a["k"] * np.inf, "channel"), ValueError, "expected finite values"),
    (lambda a: qkv.from_bfloat16(a["k"]), ValueError, "bits: expected dtype uint16"),
]


@pytest.mark.parametrize("index", range(len(REFUSALS)))
def test_refusals(rng, index):
    q, k, v = randn(rng, (4, 4, 8)), randn(rng, (2, 9, 8)), randn(rng, (2, 9, 8))
    kq, ks = qkv.quantize_int8(k, "channel")
    arrays = {"q": q, "k": k, "v": v, "kq": kq, "ks": ks, "kb": qkv.to_bfloat16(k), "kh": k.astype(np.float16)}
    call, kind, message = REFUSALS[index]
    with pytest.raises(kind, match=None) as raised:
        call(arrays)
    assert message in str(raised.value)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_kv_cache_decodes_as_attention_on_what_it_holds(rng, target, dtype):
    cache = qkv.KvCache(2, 16, 8, dtype=dtype, page_tokens=5, pages=12)
    first, second = cache.add_sequence(), cache.add_sequence()
    k, v = randn(rng, (2, 23, 16)), randn(rng, (2, 23, 8))
    for start in range(0, 23, 7):  # appended in blocks that end inside pages
        cache.append(first, k[:, start:start + 7], v[:, start:start + 7])
    cache.append(second, k[:, :3], v[:, :3])
    assert cache.length(first) == 23 and cache.length(second) == 3 and cache.free_pages == 12 - 5 - 1
    assert cache.shape == {"kv_heads": 2, "dk": 16, "dv": 8, "dtype": dtype, "page_tokens": 5, "pages": 12}
    keys, values = cache.keys(first), cache.values(first)
    assert keys.shape == (2, 23, 16) and values.shape == (2, 23, 8)
    step = {"float32": 0, "float16": 2**-10, "bfloat16": 2**-7, "int8": 4 / 127}[dtype]
    assert np.abs(keys - k).max() <= step * np.abs(k).max()
    q = randn(rng, (4, 3, 16))
    out, lse = cache.attend(first, q, return_lse=True)
    kf, vf = np.repeat(keys, 2, axis=0), np.repeat(values, 2, axis=0)
    # Narrower queries are widened exactly, as qkv decode does.
    qb = qkv.to_bfloat16(q)
    np.testing.assert_array_equal(cache.attend(first, qb, bf16=True), cache.attend(first, qkv.from_bfloat16(qb)))
    qh = q.astype(np.float16)
    np.testing.assert_array_equal(cache.attend(first, qh), cache.attend(first, qh.astype(np.float32)))
    expected = attention_reference(q, kf, vf, causal=True)
    naive = attention_reference(q, kf, vf, causal=True, dtype=np.float32)
    assert_close(out, expected[0], naive[0], what="out")
    assert_close(lse, expected[1], naive[1], what="lse")
    windowed = cache.attend(first, q, window=(4, 0), softcap=5.0, sinks=[0.5, -1.0, 0.0, 2.0])
    np.testing.assert_allclose(windowed, qkv.attention(q, keys, values, causal=True, window=(4, 0), softcap=5.0,
                                                       sinks=np.array([0.5, -1.0, 0.0, 2.0], np.float32)),
                               atol=1e-5)
    # Three drafts in a tree (1 and 2 are children of 0), each seeing the sequence and its own
    # branch; a bias per key; ALiBi from each query's position in the sequence.
    tree = np.zeros((1, 3, 23), bool)
    tree[..., :20] = True
    for i, branch in enumerate(((0,), (0, 1), (0, 2))):
        tree[0, i, [20 + a for a in branch]] = True
    bias = randn(rng, (1, 1, 23))
    for mask in (tree, bias):
        masked = cache.attend(first, q, mask=mask, alibi="auto")
        np.testing.assert_allclose(masked, qkv.attention(q, keys, values, causal=True, mask=mask, alibi="auto"),
                                   atol=1e-5)
    blind = np.ones((4, 3, 23), np.int32)
    blind[:, 1] = 0
    out, lse = cache.attend(first, q, mask=blind, alibi=[0.1, 0.2, 0.3, 0.4], return_lse=True)
    assert np.all(out[:, 1] == 0) and np.all(lse[:, 1] == -np.inf) and np.all(np.isfinite(out))
    cache.remove_sequence(first)
    assert cache.free_pages == 12 - 1


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_kv_cache_compact_keeps_what_each_sequence_holds(rng, dtype):
    cache = qkv.KvCache(1, 8, 4, dtype=dtype, page_tokens=2, pages=20)
    first, second = cache.add_sequence(), cache.add_sequence()
    for n in (5, 7, 3):
        for seq in (first, second):
            cache.append(seq, randn(rng, (1, n, 8)), randn(rng, (1, n, 4)))
    q = randn(rng, (2, 1, 8))
    held = [(cache.keys(s), cache.values(s), cache.attend(s, q)) for s in (first, second)]
    cache.compact()
    for seq, (keys, values, out) in zip((first, second), held):
        assert np.array_equal(cache.keys(seq), keys) and np.array_equal(cache.values(seq), values)
        assert np.array_equal(cache.attend(seq, q), out)
    assert cache.free_pages == 20 - 8 - 8


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_kv_cache_is_saved_and_loaded_whole(rng, tmp_path, dtype):
    cache = qkv.KvCache(2, 8, 4, dtype=dtype, page_tokens=4, pages=6)
    first, second = cache.add_sequence(), cache.add_sequence()
    for seq, n in ((first, 9), (second, 5)):
        cache.append(seq, randn(rng, (2, n, 8)), randn(rng, (2, n, 4)))
    cache.remove_sequence(first)
    path = tmp_path / "cache.qkvc"
    cache.save(str(path))
    loaded = qkv.KvCache.load(str(path))
    assert loaded.shape == cache.shape and loaded.free_pages == cache.free_pages
    with pytest.raises(ValueError, match="no sequence 0"):
        loaded.length(first)
    # Both go on alike: the same pages, the same int8 scales.
    k, v, q = randn(rng, (2, 3, 8)), randn(rng, (2, 3, 4)), randn(rng, (4, 2, 8))
    for c in (cache, loaded):
        c.append(second, k, v)
    assert np.array_equal(loaded.attend(second, q), cache.attend(second, q))
    assert np.array_equal(loaded.keys(second), cache.keys(second))
    corrupt = bytearray(path.read_bytes())
    corrupt[60] ^= 1
    path.write_bytes(bytes(corrupt))
    with pytest.raises(OSError, match="cache.qkvc: checksum mismatch"):
        qkv.KvCache.load(str(path))
    with pytest.raises(OSError, match="cannot open"):
        qkv.KvCache.load(str(tmp_path / "missing.qkvc"))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("kind", ["float16", "bfloat16", "int8"])
def test_kv_cache_appends_stored_arrays_as_their_values(rng, dtype, kind):
    k, v = randn(rng, (2, 11, 8)), randn(rng, (2, 11, 4))
    (ks, kkw, kf), (vs, vkw, vf) = stored(k, kind, "channel"), stored(v, kind, "token")
    kw = {"bf16": bool(kkw.get("bf16"))}
    if "scales" in kkw:
        kw.update(k_scales=kkw["scales"], v_scales=vkw["scales"])
    as_stored, as_values = (qkv.KvCache(2, 8, 4, dtype=dtype, page_tokens=4, pages=3) for _ in range(2))
    for cache in (as_stored, as_values):
        cache.add_sequence()
    for part in (slice(0, 6), slice(6, 11)):  # per-token scales go with their tokens
        scales = {name: s[:, part] if s.shape[1] > 1 else s for name, s in kw.items() if name != "bf16"}
        as_stored.append(0, ks[:, part], vs[:, part], **{**kw, **scales})
        as_values.append(0, kf[:, part], vf[:, part])
    assert as_stored.length(0) == 11
    assert np.array_equal(as_stored.keys(0), as_values.keys(0))
    assert np.array_equal(as_stored.values(0), as_values.values(0))
    if dtype == kind == "float16":
        assert np.array_equal(as_stored.keys(0), kf)


def test_kv_cache_refusals(rng):
    cache = qkv.KvCache(2, 4, 4, dtype="f16", page_tokens=4, pages=2)
    seq = cache.add_sequence()
    cache.append(seq, randn(rng, (2, 6, 4)), randn(rng, (2, 6, 4)))
    with pytest.raises(MemoryError, match="needs 1 more pages? of 4 tokens, but the cache has 0"):
        cache.append(seq, randn(rng, (2, 3, 4)), randn(rng, (2, 3, 4)))
    assert cache.length(seq) == 6  # refused whole
    with pytest.raises(ValueError, match=r"k: expected shape \[2, 1, 4\]"):
        cache.append(seq, randn(rng, (3, 1, 4)), randn(rng, (2, 1, 4)))
    with pytest.raises(ValueError, match="k: expected finite values"):
        cache.append(seq, np.full((2, 1, 4), np.nan, np.float32), randn(rng, (2, 1, 4)))
    with pytest.raises(ValueError, match=r"k: expected values that a float16 cache holds \(finite, \|x\| < 65520\), "
                       r"got 70000 at \[1, 0, 2\]"):
        big = np.zeros((2, 1, 4), np.float32)
        big[1, 0, 2] = 7e4
        cache.append(seq, big, randn(rng, (2, 1, 4)))
    values, scales = qkv.quantize_int8(randn(rng, (2, 1, 4)), "channel")
    with pytest.raises(ValueError, match="k_scales: expected the scales of int8 k"):
        cache.append(seq, values, randn(rng, (2, 1, 4)))
    with pytest.raises(ValueError, match="k_scales: expected finite values"):
        cache.append(seq, values, randn(rng, (2, 1, 4)), k_scales=np.full_like(scales, np.nan))
    with pytest.raises(ValueError, match="k_scales"):
        cache.append(seq, values, randn(rng, (2, 1, 4)), k_scales=np.ones((3, 1, 4), np.float32))
    with pytest.raises(ValueError, match="bf16: True says which uint16 arrays"):
        cache.append(seq, randn(rng, (2, 1, 4)), randn(rng, (2, 1, 4)), bf16=True)
    assert cache.length(seq) == 6
    with pytest.raises(ValueError, match=r"q: expected \[H, Tq, Dk\] with Dk = 4"):
        cache.attend(seq, randn(rng, (2, 1, 1, 4)))
    with pytest.raises(ValueError,
                       match=r"^q: expected H a multiple of the cache's 2 kv heads, got shape \[3, 1, 4\]$"):
        cache.attend(seq, randn(rng, (3, 1, 4)))
    with pytest.raises(ValueError,
                       match="^bf16: True says which uint16 arrays hold bfloat16 bits, but none of q is uint16$"):
        cache.attend(seq, randn(rng, (2, 1, 4)), bf16=True)
    with pytest.raises(ValueError, match="^q: expected bf16=True with a uint16 array"):
        cache.attend(seq, qkv.to_bfloat16(randn(rng, (2, 1, 4))))
    with pytest.raises(ValueError, match="no sequence 7"):
        cache.attend(7, randn(rng, (2, 1, 4)))
    with pytest.raises(ValueError, match=r"mask: shape \[1, 1, 5\] does not broadcast to \[2, 1, 6\]"):
        cache.attend(seq, randn(rng, (2, 1, 4)), mask=np.ones((1, 1, 5), bool))
    with pytest.raises(ValueError, match=r"bias: shape \[3, 1, 6\] does not broadcast to \[2, 1, 6\]"):
        cache.attend(seq, randn(rng, (2, 1, 4)), mask=np.zeros((3, 1, 6), np.float32))
    with pytest.raises(ValueError, match="mask: expected finite values or -inf"):
        cache.attend(seq, randn(rng, (2, 1, 4)), mask=np.full((1, 1, 6), np.nan, np.float32))
    with pytest.raises(ValueError, match=r"alibi: expected shape \[2\], got \[3\]"):
        cache.attend(seq, randn(rng, (2, 1, 4)), alibi=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="alibi: expected None, \"auto\" or"):
        cache.attend(seq, randn(rng, (2, 1, 4)), alibi="standard")
    with pytest.raises(ValueError, match="dtype: expected float32, float16, bfloat16 or int8"):
        qkv.KvCache(2, 4, 4, dtype="int4", pages=1)
    with pytest.raises(ValueError, match="pages: expected at least 1, got 0"):
        qkv.KvCache(2, 4, 4, pages=0)


def test_torch_half_tensors():
    torch = pytest.importorskip("torch")
    import qkv.torch

    torch.manual_seed(0)
    for dtype, step in ((torch.float16, 2**-10), (torch.bfloat16, 2**-7)):
        q = torch.randn(2, 4, 7, 16, dtype=dtype, requires_grad=True)
        k = torch.randn(2, 2, 9, 16, dtype=dtype, requires_grad=True)
        v = torch.randn(2, 2, 9, 8, dtype=dtype, requires_grad=True)
        mask = torch.randn(7, 9, dtype=dtype, requires_grad=True)
        out = qkv.torch.scaled_dot_product_attention(q, k, v, mask, is_causal=True, causal_alignment="bottom_right")
        assert out.dtype == dtype
        weights = torch.linspace(-1, 1, 8)
        (out.float() * weights).sum().backward()
        q64, k64, v64, m64 = (t.detach().double().requires_grad_() for t in (q, k, v, mask))
        scores = q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2) / 4 + m64
        scores = scores.masked_fill(~torch.ones(7, 9, dtype=torch.bool).tril(2), -float("inf"))
        expected = torch.softmax(scores, -1) @ v64.repeat_interleave(2, 1)
        (expected * weights.double()).sum().backward()
        # float32 arithmetic, then one rounding to the tensor's dtype.
        assert (out.double() - expected).abs().max() <= 2 * step * expected.abs().max()
        for tensor, reference in ((q, q64), (k, k64), (v, v64), (mask, m64)):
            assert tensor.grad.dtype == dtype
            error = (tensor.grad.double() - reference.grad).abs().max()
            assert error <= 4 * step * reference.grad.abs().max(), (dtype, error)


def test_batch_dims_take_scales_of_fewer_dims_and_inputs_numpy_cannot_read(rng):
    q, k, v = randn(rng, (2, 3, 4, 5, 8)), randn(rng, (2, 3, 2, 9, 8)), randn(rng, (2, 3, 2, 9, 8))
    kq, ks = qkv.quantize_int8(k, "tensor")
    shared = np.full((2, 1, 8), float(ks.max()), np.float32)  # [Hkv, 1, Dk], as every batch entry's
    out = qkv.attention(q, kq, v, k_scales=shared)
    expected = qkv.attention(q.astype(np.float64), (kq * shared).astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(out, expected, atol=1e-5)
    with pytest.raises(ValueError, match="dout: expected dtype float32 \\(the dtype of attention's outputs"):
        qkv.attention_backward(q[0, 0], k[0, 0].astype(np.float16), v[0, 0], np.ones((4, 5, 8), np.float16))
    cache = qkv.KvCache(2, 8, 8, pages=2)
    bad = randn(rng, (2, 1, 8))
    bad[1, 0, 3] = np.nan
    # No remedy is offered: append has no allow_nonfinite.
    with pytest.raises(ValueError, match=r"k: expected finite values, got 1 non-finite value \(the first: nan at "
                                         r"\[1, 0, 3\]\)$"):
        cache.append(cache.add_sequence(), bad, randn(rng, (2, 1, 8)))
    torch = pytest.importorskip("torch")
    # A bfloat16 tensor is no array to numpy (qkv.torch hands over its bits): refused by name.
    with pytest.raises(ValueError, match="k: expected an array numpy can read, got a Tensor"):
        qkv.attention(q[0, 0], torch.zeros(2, 9, 8, dtype=torch.bfloat16), v[0, 0])


def test_bf16_tiles_run_only_beside_the_bf16_products(target):
    """AMX's tiles take the bf16 products' place; no target without those products uses them."""
    assert isinstance(qkv.attention_bf16_tiles(), bool)
    assert not qkv.attention_bf16_tiles() or qkv.attention_bf16_products()


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_on_the_bf16_dot_product(rng, causal):
    """bfloat16 q, k and v asking for out alone: on a CPU with a bf16 dot product its weights are
    rounded to bfloat16 (8 significant bits) before they multiply v, which moves out by at most
    2^-8 of sum_j P_ij |v_j|; everywhere else out is the float32 kernel's, bit for bit."""
    q, k, v = randn(rng, (3, 70, 24)), randn(rng, (3, 90, 24)), randn(rng, (3, 90, 40))
    (qs, ks, vs), kw, (qf, kf, vf) = operands(q, k, v, ("bfloat16",) * 3)
    out = qkv.attention(qs, ks, vs, causal=causal, **kw)
    exact, _, weights = attention_reference(qf, kf, vf, causal=causal)
    if not qkv.attention_bf16_products():
        float32 = qkv.attention(qf, kf, vf, causal=causal)
        assert np.array_equal(out, float32)
        pytest.skip(f"no bf16 dot product at target {qkv.simd_target()} (AVX512_BF16 on an AVX-512 target); "
                    "the float32 arithmetic ran, bit for bit")
    bound = 2.0**-8 * (weights @ np.abs(vf.astype(np.float64))) + 1e-5
    assert np.all(np.abs(out - exact) <= bound), float(np.max(np.abs(out - exact) - bound))
    assert not np.array_equal(out, qkv.attention(qf, kf, vf, causal=causal)), "the weights were rounded"
