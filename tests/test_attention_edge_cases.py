"""Numerical edge cases, determinism and memory growth of attention (xla and pallas backends).

The naive references run jitted, in the program of what they check (eagerly every op compiles on its own)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import attention_backends, qkv as _qkv
from naive_attention import naive_attention, naive_mask

BACKENDS = attention_backends()  # every registered backend that runs here


def _out_and_grads(f, q, k, v, ref=None):
    """f(q, k, v) and the gradients of sum(f(q, k, v)**2), jitted as one program (one compile); with ref, also
    ref(q, k, v) in the same program."""
    def run(q, k, v):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, vjp(2 * out)) + (() if ref is None else (ref(q, k, v),))
    return jax.jit(run)(q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_and_whole_batches(backend):
    q, k, v = _qkv(0, 3, 8, 8, 2, 1, 16)
    q_lens = jnp.array([8, 3, 0], jnp.int32)
    kv_lens = jnp.array([0, 5, 0], jnp.int32)  # batch 0: queries but no keys at all
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="padding_causal", q_seqlens=q_lens,
                                                     kv_seqlens=kv_lens, backend=backend)
    mask = naive_mask(3, 8, 8, "padding_causal", np.array(q_lens), np.array(kv_lens))
    out, grads, ref = _out_and_grads(f, q, k, v, lambda q, k, v: naive_attention(q, k, v, mask))
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(out[2]) == 0)
    assert np.all(np.asarray(out[1, 3:]) == 0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for gr in grads:
        assert np.isfinite(np.asarray(gr)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_extreme_logits_stay_finite(backend, dtype):
    """Logits of ±thousands (and near-zero ones) in fp16/bf16: no inf or NaN, close to fp32 math.
    Both scales run through one compiled program (same shapes and dtypes; the scale is in the data)."""
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend=backend)
    mask = naive_mask(1, 16, 16, "causal")
    run = jax.jit(lambda q, k, v: _out_and_grads(f, q, k, v, lambda q, k, v: naive_attention(q, k, v, mask)))
    for scale in (60.0, 1e-4):
        q, k, v = _qkv(1, 1, 16, 16, 2, 2, 32, dtype=dtype, scale=1.0)
        q = (q.astype(jnp.float32) * scale).astype(dtype)
        out, grads, ref = run(q, k, v)
        assert np.isfinite(np.asarray(out, np.float32)).all(), scale
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2, rtol=3e-2, err_msg=f"scale {scale}")
        for gr in grads:
            assert np.isfinite(np.asarray(gr, np.float32)).all(), scale


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_with_huge_logits(backend):
    q, k, v = _qkv(2, 1, 8, 8, 2, 2, 16, scale=30.0)
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, softcap=20.0, backend=backend)
    mask = naive_mask(1, 8, 8, "no_mask")
    out, grads, ref = _out_and_grads(f, q, k, v, lambda q, k, v: naive_attention(q, k, v, mask, softcap=20.0))
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)
    for gr in grads:
        assert np.isfinite(np.asarray(gr)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_at_block_boundaries(backend):
    """Valid lengths on both sides of the kernel's block edges (the default q and kv blocks)."""
    s = 130
    q, k, v = _qkv(3, 4, s, s, 1, 1, 16)
    lens = np.array([63, 64, 65, 129])
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="padding_causal",
                                                     q_seqlens=jnp.asarray(lens), kv_seqlens=jnp.asarray(lens[::-1]),
                                                     backend=backend)
    mask = naive_mask(4, s, s, "padding_causal", lens, lens[::-1])
    out, ref = jax.jit(lambda q, k, v: (f(q, k, v), naive_attention(q, k, v, mask)))(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_length_one(backend):
    """Every mask type (one compile for all and their references)."""
    q, k, v = _qkv(4, 2, 5, 1, 2, 1, 8)
    fns = {}
    for mask_type in te_jax.MASK_TYPES:
        pad = {}
        q_lens = kv_lens = None
        if mask_type.startswith("padding"):
            q_lens, kv_lens = np.array([5, 2]), np.array([1, 1])
            pad = dict(q_seqlens=jnp.asarray(q_lens), kv_seqlens=jnp.asarray(kv_lens))
        mask = naive_mask(2, 5, 1, mask_type, q_lens, kv_lens)
        fns[mask_type] = (
            lambda q, k, v, mt=mask_type, pad=pad: te_jax.dot_product_attention(q, k, v, attn_mask_type=mt,
                                                                                backend=backend, **pad),
            lambda q, k, v, mask=mask: naive_attention(q, k, v, mask))
    got = jax.jit(lambda q, k, v: {mt: (f(q, k, v), ref(q, k, v)) for mt, (f, ref) in fns.items()})(q, k, v)
    for mask_type, (out, ref) in got.items():
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, err_msg=mask_type)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_deterministic(backend):
    """The same call twice gives bit-identical outputs and gradients (fresh compilation each time)."""
    q, k, v = _qkv(5, 2, 24, 24, 4, 2, 16, dtype=jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(9), (1, 4, 24, 24))

    def run():
        f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", bias=bias,
                                                         backend=backend)
        return _out_and_grads(f, q, k, v)

    (o1, g1), (o2, g2) = run(), run()
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _temp_bytes(seq, backend):
    spec = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)
    loss = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal",
                                                        backend=backend).astype(jnp.float32).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # 12 s of compiles (nothing runs)
def test_pallas_memory_grows_linearly_with_sequence():
    """Forward+backward at 16k and 64k compiles (not runs) with temp memory ~4x, not ~16x."""
    small, large = _temp_bytes(16384, "pallas"), _temp_bytes(65536, "pallas")
    assert large < 5.0 * small, (small, large)
    # The dense xla path, for contrast, grows with the square of the length.
    x1, x2 = _temp_bytes(1024, "xla"), _temp_bytes(4096, "xla")
    assert x2 > 10.0 * x1, (x1, x2)
