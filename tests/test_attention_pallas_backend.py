"""dot_product_attention(backend="pallas") through the front door (interpret mode on the CPU):
formats, every mask type, thd packing, GQA, bias, softcap, windows — against the naive attention.

The references run jitted, in the program of what they check (eagerly every op compiles on its own); the CASES
run as one program (helpers.fwd_bwd_many), each checked on its own."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import fwd_bwd_many, qkv, rand
from naive_attention import naive_attention, naive_mask

CASES = [
    # (fmt, mask_type, window, h, g, dqk, dv, sq, skv, bias, softcap)
    ("bshd", "no_mask", None, 4, 4, 16, 16, 9, 9, False, None),
    ("sbhd", "causal", None, 4, 2, 16, 16, 9, 13, False, None),
    ("bshd", "causal_bottom_right", (3, -1), 4, 1, 16, 8, 7, 12, False, None),
    ("sbhd", "padding", (2, 2), 2, 2, 16, 16, 10, 10, True, None),
    ("bshd", "padding_causal", None, 4, 2, 24, 16, 11, 11, False, 5.0),
    ("bshd", "padding_causal_bottom_right", None, 2, 1, 16, 16, 6, 10, True, 2.0),
    ("bshd", "causal", None, 4, 1, 16, 16, 1, 40, False, None),  # a decode step
]


def _case_name(c):
    return f"{c[0]}-{c[1]}-w{c[2]}-h{c[3]}g{c[4]}-s{c[7]}x{c[8]}"


def test_pallas_backend_matches_naive():
    """Every case of CASES, output and gradients; kernels and references in one compile."""
    runs = []
    for i, case in enumerate(CASES):
        fmt, mask_type, window, h, g, dqk, dv, sq, skv, use_bias, softcap = case
        b = 2
        q, k, v = qkv(i, b, sq, skv, h, g, dqk, dv)
        pad, q_lens, kv_lens = {}, None, None
        if mask_type.startswith("padding"):
            q_lens, kv_lens = np.array([sq, max(1, sq - 4)]), np.array([skv, max(1, skv - 3)])
            pad = dict(q_seqlens=jnp.asarray(q_lens, jnp.int32), kv_seqlens=jnp.asarray(kv_lens, jnp.int32))
        bias = rand(7, (1, h, sq, skv)) if use_bias else None
        mask = naive_mask(b, sq, skv, mask_type, q_lens, kv_lens, window=window)

        def te(q, k, v, bias=None, fmt=fmt, mask_type=mask_type, window=window, softcap=softcap, pad=pad):
            args = (te_jax.from_bshd(t, fmt) for t in (q, k, v))
            o = te_jax.dot_product_attention(*args, attn_input_format=fmt, attn_mask_type=mask_type,
                                             window_size=window, bias=bias, softcap=softcap, backend="pallas", **pad)
            return te_jax.to_bshd(o, fmt)

        ref = functools.partial(lambda q, k, v, bias=None, mask=None, softcap=None: naive_attention(
            q, k, v, mask, bias=bias, softcap=softcap), mask=mask, softcap=softcap)
        args = (q, k, v, bias) if use_bias else (q, k, v)
        ct = rand(3, (b, sq, h, dv))
        runs += [(te, args, ct), (ref, args, ct)]
    res = fwd_bwd_many(runs)
    for i, case in enumerate(CASES):
        (out, g_te), (expected, g_ref) = res[2 * i], res[2 * i + 1]
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg=_case_name(case))
        for a, r in zip(g_te, g_ref):
            np.testing.assert_allclose(a, r, rtol=2e-4, atol=2e-4, err_msg=_case_name(case))


def test_pallas_backend_thd_packed_sequences():
    q_lens, kv_lens = np.array([3, 6, 2]), np.array([5, 6, 4])
    tq, tkv, h, g, d = 12, 16, 4, 2, 16
    q, k, v = (t[0] for t in qkv(11, 1, tq, tkv, h, g, d))
    seg = lambda lens, t: np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)] + [np.zeros(t - lens.sum(), int)])
    mask = naive_mask(1, tq, tkv, "padding_causal_bottom_right", q_seg=seg(q_lens, tq)[None],
                      kv_seg=seg(kv_lens, tkv)[None])
    te = lambda q, k, v: te_jax.dot_product_attention(
        q, k, v, attn_input_format="thd", attn_mask_type="padding_causal_bottom_right",
        q_seqlens=jnp.asarray(q_lens, jnp.int32), kv_seqlens=jnp.asarray(kv_lens, jnp.int32), backend="pallas")
    ct = rand(12, (tq, h, d))
    (out, g_te), (ref, g_ref) = fwd_bwd_many([
        (te, (q, k, v), ct), (lambda q, k, v: naive_attention(q[None], k[None], v[None], mask)[0], (q, k, v), ct)])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    for a, r in zip(g_te, g_ref):
        np.testing.assert_allclose(a, r, rtol=2e-4, atol=2e-4)


def test_pallas_backend_bf16():
    q, k, v = (t.astype(jnp.bfloat16) for t in qkv(12, 2, 16, 16, 4, 2, 32))
    mask = naive_mask(2, 16, 16, "causal")
    out, ref = jax.jit(lambda q, k, v: (te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="pallas"),
                                        naive_attention(q, k, v, mask)))(q, k, v)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=3e-2, atol=3e-2)


def test_pallas_sbhd_from_packed_gqa_tensor_with_causal_window():
    """The issue's case, scaled down: s x b x (16 query heads + 2·1 kv heads) x 64 in one packed
    sb(h+2g)d tensor, window (-1, 0), against separately made q, k, v on the naive path."""
    s, b, h, g, d = 96, 1, 16, 1, 64
    packed = rand(21, (s, b, h + 2 * g, d))
    q, k, v = te_jax.unpack_qkv(packed, qkv_layout="sb(h+2g)d", num_attention_heads=h, num_gqa_groups=g)
    mask = naive_mask(b, s, s, "no_mask", window=(-1, 0))

    @jax.jit  # one compile
    def run(q, k, v, packed):
        qs, ks, vs = packed[:, :, :h], packed[:, :, h:h + g], packed[:, :, h + g:]
        return (te_jax.dot_product_attention(q, k, v, attn_input_format="sbhd", window_size=(-1, 0), backend="pallas"),
                naive_attention(*(jnp.swapaxes(t, 0, 1) for t in (qs, ks, vs)), mask))

    out, ref = run(q, k, v, packed)
    np.testing.assert_allclose(jnp.swapaxes(out, 0, 1), ref, rtol=1e-4, atol=1e-4)


def test_pallas_odd_length_and_eighteen_heads():
    """[2, 16534, 18, 128]-like, scaled down: an odd length that is no multiple of any block, 18 heads."""
    q, k, v = qkv(22, 2, 67, 67, 18, 18, 32)
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="pallas")
    mask = naive_mask(2, 67, 67, "causal")
    ref = lambda q, k, v: naive_attention(q, k, v, mask)
    out, expected, g_te, g_ref = jax.jit(lambda q, k, v: (  # one compile
        f(q, k, v), ref(q, k, v), jax.grad(lambda q: jnp.sum(f(q, k, v) ** 2))(q),
        jax.grad(lambda q: jnp.sum(ref(q, k, v) ** 2))(q)))(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_te, g_ref, rtol=2e-4, atol=2e-4)
