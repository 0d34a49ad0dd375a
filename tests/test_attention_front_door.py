"""dot_product_attention (xla backend) against the independent naive attention, every feature.

A test's cases run as one jitted program with their references (_check_many: a compile of such tiny programs is
mostly fixed cost, so one for all costs a fraction of one each); every case is checked on its own and named."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import fwd_bwd_pairs, qkv as _qkv, rand as _rand
from naive_attention import naive_attention, naive_mask

MASKS = te_jax.MASK_TYPES


def _padding_args(mask_type, b, sq, skv, rng):
    if not mask_type.startswith("padding"):
        return {}, None, None
    q_lens = rng.integers(1, sq + 1, size=b)
    kv_lens = rng.integers(1, skv + 1, size=b)
    q_lens[0], kv_lens[0] = sq, skv  # one full row, one padded
    return (dict(q_seqlens=jnp.asarray(q_lens, jnp.int32), kv_seqlens=jnp.asarray(kv_lens, jnp.int32)),
            q_lens, kv_lens)


def _fmt_in(x, fmt):
    return te_jax.from_bshd(x, fmt)


def _fmt_out(x, fmt):
    return te_jax.to_bshd(x, fmt)


def _check_many(cases, rtol_fwd=2e-5, rtol_grad=5e-5):
    """cases: [(name, fn_te, fn_ref, args)]; output and gradients of <out, ct> of fn_te against fn_ref, every case
    and reference in one compile. Returns the te outputs."""
    pairs = fwd_bwd_pairs(cases)
    for name, (out, g_te), (ref, g_ref) in pairs:
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=rtol_fwd, atol=rtol_fwd,
                                   err_msg=f"{name}: out")
        for t, a, b in zip("qkvb", g_te, g_ref):
            assert np.isfinite(np.asarray(a, np.float32)).all(), f"{name}: d{t}"
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=rtol_grad, atol=rtol_grad,
                                       err_msg=f"{name}: d{t}")
    return [out for _, (out, _), _ in pairs]


def _check(fn_te, fn_ref, args, rtol_fwd=2e-5, rtol_grad=5e-5):
    return _check_many([("", fn_te, fn_ref, args)], rtol_fwd, rtol_grad)[0]


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_mask_types_and_formats(fmt):
    """Every mask type (one compile), in each format."""
    b, sq, skv, h, g, d = 3, 7, 11, 4, 2, 16
    q, k, v = _qkv(1, b, sq, skv, h, g, d)
    cases = []
    for mask_type in MASKS:
        rng = np.random.default_rng(hash((fmt, mask_type)) % 2**32)
        pad, q_lens, kv_lens = _padding_args(mask_type, b, sq, skv, rng)
        mask = naive_mask(b, sq, skv, mask_type, q_lens, kv_lens)

        def te(q, k, v, mask_type=mask_type, pad=pad):
            o = te_jax.dot_product_attention(_fmt_in(q, fmt), _fmt_in(k, fmt), _fmt_in(v, fmt),
                                             attn_input_format=fmt, attn_mask_type=mask_type, backend="xla", **pad)
            return _fmt_out(o, fmt)

        cases.append((mask_type, te, functools.partial(lambda q, k, v, mask: naive_attention(q, k, v, mask),
                                                       mask=mask), (q, k, v)))
    _check_many(cases)


WINDOW_CASES = [
    ("no_mask", (2, 1)), ("no_mask", (0, 0)), ("no_mask", (-1, 2)), ("no_mask", (3, -1)),
    ("causal", (2, 0)), ("causal_bottom_right", (3, -1)), ("padding", (1, 2)), ("padding_causal", (2, 0)),
    ("padding_causal_bottom_right", (1, 0)),
]


def test_windows():
    """WINDOW_CASES (mask type, window), one compile."""
    b, sq, skv, h, g, d = 2, 9, 12, 2, 1, 8
    q, k, v = _qkv(2, b, sq, skv, h, g, d)
    cases = []
    for mask_type, window in WINDOW_CASES:
        pad, q_lens, kv_lens = _padding_args(mask_type, b, sq, skv, np.random.default_rng(3))
        mask = naive_mask(b, sq, skv, mask_type, q_lens, kv_lens, window=window)
        te = functools.partial(lambda q, k, v, mt, w, pad: te_jax.dot_product_attention(
            q, k, v, attn_mask_type=mt, window_size=w, backend="xla", **pad), mt=mask_type, w=window, pad=pad)
        cases.append((f"{mask_type} {window}", te,
                      functools.partial(lambda q, k, v, mask: naive_attention(q, k, v, mask), mask=mask), (q, k, v)))
    _check_many(cases)


def test_gqa_mqa_bias_softcap_scale():
    """MHA, GQA and MQA (8 query heads over 8, 2, 1 kv heads) with bias, softcap and scale, one compile."""
    b, sq, skv, d = 2, 6, 10, 16
    mask = naive_mask(b, sq, skv, "causal_bottom_right")
    te = lambda q, k, v, bias: te_jax.dot_product_attention(
        q, k, v, attn_mask_type="causal_bottom_right", bias=bias, softcap=2.5, scale=0.3, backend="xla")
    ref = lambda q, k, v, bias: naive_attention(q, k, v, mask, bias=bias, softcap=2.5, scale=0.3)
    cases = []
    for h, g in [(8, 8), (8, 2), (8, 1)]:
        q, k, v = _qkv(3, b, sq, skv, h, g, d)
        bias = _rand(4, (1, h, sq, skv))
        cases.append((f"h={h} g={g}", te, ref, (q, k, v, bias)))
    _check_many(cases)


def test_bias_broadcast_shapes():
    """Bias [b, h, sq, skv], [b, 1, ...], [1, 1, ...], one compile."""
    q, k, v = _qkv(5, 2, 5, 7, 3, 3, 8)
    mask = naive_mask(2, 5, 7, "no_mask")
    te = lambda q, k, v, bias: te_jax.dot_product_attention(q, k, v, bias=bias, backend="xla")
    ref = lambda q, k, v, bias: naive_attention(q, k, v, mask, bias=bias)
    _check_many([(str(bias_shape), te, ref, (q, k, v, _rand(6, bias_shape)))
                 for bias_shape in [(2, 3, 5, 7), (2, 1, 5, 7), (1, 1, 5, 7)]])


def test_head_dim_qk_differs_from_v():
    q, k, v = _qkv(7, 2, 5, 6, 4, 2, 24, dv=16)
    mask = naive_mask(2, 5, 6, "causal")
    te = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="xla")
    out = _check(te, lambda q, k, v: naive_attention(q, k, v, mask), (q, k, v))
    assert out.shape == (2, 5, 4, 16)


def test_query_length_one():
    """A decode step: one query against a long cache, every mask type (one compile)."""
    b, skv = 2, 40
    q, k, v = _qkv(8, b, 1, skv, 4, 1, 16)
    cases = []
    for mask_type in MASKS:
        pad, q_lens, kv_lens = _padding_args(mask_type, b, 1, skv, np.random.default_rng(8))
        mask = naive_mask(b, 1, skv, mask_type, q_lens, kv_lens)
        te = functools.partial(lambda q, k, v, mt, pad: te_jax.dot_product_attention(
            q, k, v, attn_mask_type=mt, backend="xla", **pad), mt=mask_type, pad=pad)
        cases.append((mask_type, te, functools.partial(lambda q, k, v, mask: naive_attention(q, k, v, mask),
                                                       mask=mask), (q, k, v)))
    _check_many(cases)


@pytest.mark.parametrize("source", ["seqlens", "segment_ids"])
def test_thd_packed_sequences(source):
    """thd with lengths or segment ids, the three padding mask types (one compile)."""
    q_lens, kv_lens = np.array([3, 5, 2]), np.array([4, 5, 6])
    tq, tkv = 12, 17  # some trailing padding tokens
    q, k, v = (t[0] for t in _qkv(9, 1, tq, tkv, 4, 2, 8))
    q_seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(q_lens)] + [np.zeros(tq - q_lens.sum(), int)])
    kv_seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(kv_lens)] + [np.zeros(tkv - kv_lens.sum(), int)])
    if source == "seqlens":
        pad = dict(q_seqlens=jnp.asarray(q_lens, jnp.int32), kv_seqlens=jnp.asarray(kv_lens, jnp.int32))
    else:
        pad = dict(q_segment_ids=jnp.asarray(q_seg, jnp.int32), kv_segment_ids=jnp.asarray(kv_seg, jnp.int32))
    cases = []
    for mask_type in ["padding", "padding_causal", "padding_causal_bottom_right"]:
        mask = naive_mask(1, tq, tkv, mask_type, q_seg=q_seg[None], kv_seg=kv_seg[None])
        te = functools.partial(lambda q, k, v, mt: te_jax.dot_product_attention(
            q, k, v, attn_input_format="thd", attn_mask_type=mt, backend="xla", **pad), mt=mask_type)
        ref = functools.partial(lambda q, k, v, mask: naive_attention(q[None], k[None], v[None], mask)[0], mask=mask)
        cases.append((mask_type, te, ref, (q, k, v)))
    _check_many(cases)


def test_segment_ids_in_bshd_with_window():
    b, s = 2, 10
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 7, 7, 7, 7, 7]])
    q, k, v = _qkv(10, b, s, s, 2, 2, 8)
    mask = naive_mask(b, s, s, "padding_causal", q_seg=seg, kv_seg=seg, window=(1, 0))
    te = lambda q, k, v: te_jax.dot_product_attention(
        q, k, v, attn_mask_type="padding_causal", q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg),
        window_size=(1, 0), backend="xla")
    _check(te, lambda q, k, v: naive_attention(q, k, v, mask), (q, k, v))


def test_fully_masked_rows_are_zero_with_finite_grads():
    q, k, v = _qkv(11, 2, 6, 6, 2, 2, 8)
    lens = jnp.array([4, 0], jnp.int32)  # second batch entirely padding
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="padding_causal", q_seqlens=lens,
                                                     kv_seqlens=lens, backend="xla")
    out, grads = jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(*a)))(q, k, v)
    assert np.all(np.asarray(out[0, 4:]) == 0) and np.all(np.asarray(out[1]) == 0)
    for gr in grads:
        assert np.isfinite(np.asarray(gr)).all()
    assert np.all(np.asarray(grads[0][1]) == 0)


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 3e-2), (jnp.float16, 5e-3)])
def test_low_precision_dtypes(dtype, tol):
    q, k, v = _qkv(12, 2, 8, 8, 4, 2, 16, dtype=dtype)
    mask = naive_mask(2, 8, 8, "causal")
    out, ref = jax.jit(lambda q, k, v: (te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="xla"),
                                        naive_attention(q, k, v, mask)))(q, k, v)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=tol, atol=tol)


def test_jit_grad_vmap():
    q, k, v = _qkv(13, 2, 5, 5, 2, 1, 8)
    f = jax.jit(lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal"))
    mask = naive_mask(2, 5, 5, "causal")
    naive = jax.jit(lambda q, k, v: naive_attention(q, k, v, mask))  # references jitted: one compile each
    np.testing.assert_allclose(f(q, k, v), naive(q, k, v), rtol=2e-5, atol=2e-5)
    # vmap over an extra leading axis: each slice equals the unbatched call.
    qs = jnp.stack([q, q * 2]); ks = jnp.stack([k, -k]); vs = jnp.stack([v, v + 1])
    batched = jax.jit(jax.vmap(lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal")))(
        qs, ks, vs)
    for i in range(2):
        np.testing.assert_allclose(batched[i], naive(qs[i], ks[i], vs[i]), rtol=2e-5, atol=2e-5)
    g = jax.jit(jax.grad(lambda q: f(q, k, v).sum()))(q)
    g_ref = jax.jit(jax.grad(lambda q: naive_attention(q, k, v, mask).sum()))(q)
    np.testing.assert_allclose(g, g_ref, rtol=5e-5, atol=5e-5)


def test_dropout_is_scaled_and_keyed():
    q, k, v = _qkv(14, 2, 16, 16, 2, 2, 8)
    f = lambda rng: te_jax.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng)
    jf = jax.jit(f)
    a, b, c = jf(jax.random.key(0)), jf(jax.random.key(0)), jf(jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    # Mean over many draws approaches the no-dropout output (inverted-dropout scaling).
    mean = jax.jit(lambda keys: jnp.mean(jax.vmap(f)(keys), axis=0))(jax.random.split(jax.random.key(2), 400))
    ref = jax.jit(lambda q, k, v: te_jax.dot_product_attention(q, k, v))(q, k, v)
    np.testing.assert_allclose(mean, ref, atol=0.15)
