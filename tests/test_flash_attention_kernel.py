"""Flash attention Pallas kernels (interpret mode on CPU) against a naive fp32 reference.

The reference here is written independently of pallas_kernels/flash_attention/reference.py:
the mask is a dense numpy array built from the rule, GQA repeats K/V explicitly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import (
    AttentionMask,
    BlockSizes,
    block_schedule,
    default_block_sizes,
    flash_attention,
    flash_attention_bwd,
    flash_attention_fwd,
    reference_attention,
)
from helpers import rand
from tolerance import rel_err

SMALL = BlockSizes(16, 16, 16, 16, num_warps=4, num_stages=2)
MIXED = BlockSizes(32, 16, 16, 32, block_q_dq=32, block_kv_dq=16)


# ----------------------------------------------------------------------------- reference
def dense_mask(qseg, qpos, kseg, kpos, causal, wl, wr):
    """numpy bool [B, Sq, Skv]: the rule written out elementwise (same nonzero segment, causal / window bounds)."""
    qseg, qpos = (np.asarray(x)[:, :, None] for x in (qseg, qpos))  # [B, Sq, 1]
    kseg, kpos = (np.asarray(x)[:, None, :] for x in (kseg, kpos))  # [B, 1, Skv]
    m = (kseg == qseg) & (qseg != 0)
    if causal:
        m &= kpos <= qpos
    if wl >= 0:
        m &= kpos >= qpos - wl
    if wr >= 0:
        m &= kpos <= qpos + wr
    return m


def naive_attention(q, k, v, mask, bias, scale, softcap):
    """fp32; mask: numpy bool [B, Sq, Skv]. Returns (out, lse) with empty rows 0 / -inf."""
    H, G = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), H // G, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), H // G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    m = jnp.asarray(mask)[:, None]
    s = jnp.where(m, s, -1e30)
    p = jax.nn.softmax(s, axis=-1) * m
    row = m.any(-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vf)
    lse = jnp.where(row, jax.nn.logsumexp(s, axis=-1), -jnp.inf)
    return out, lse


# ----------------------------------------------------------------------------- helpers
def make_inputs(seed, B, Sq, Skv, H, G, Dqk, Dv, dtype, bias_shape=None):
    """Drawn by numpy (helpers.rand): no per-shape compile, which jax.random pays eagerly for every new shape."""
    rng = np.random.default_rng(seed)
    q = rand(rng, (B, Sq, H, Dqk), dtype)
    k = rand(rng, (B, Skv, G, Dqk), dtype)
    v = rand(rng, (B, Skv, G, Dv), dtype)
    bias = None if bias_shape is None else rand(rng, bias_shape, dtype)
    w_out = rand(rng, (B, Sq, H, Dv))
    w_lse = rand(rng, (B, H, Sq))
    return q, k, v, bias, w_out, w_lse


def iota(B, S, offset=0):
    return jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) + offset, (B, S))


def loss_fn(attn, w_out, w_lse):
    def f(q, k, v, bias):
        out, lse = attn(q, k, v, bias)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)

    return f


def check(*, B=2, Sq=48, Skv=48, H=4, G=4, Dqk=32, Dv=32, dtype=jnp.float32, causal=False,
          wl=-1, wr=-1, softcap=None, bias_shape=None, qseg=None, kseg=None, qpos=None,
          kpos=None, blocks=SMALL, grads=True, seed=0, mask=None):
    q, k, v, bias, w_out, w_lse = make_inputs(seed, B, Sq, Skv, H, G, Dqk, Dv, dtype,
                                              bias_shape)
    qseg = jnp.ones((B, Sq), jnp.int32) if qseg is None else qseg
    kseg = jnp.ones((B, Skv), jnp.int32) if kseg is None else kseg
    qpos = iota(B, Sq) if qpos is None else qpos
    kpos = iota(B, Skv) if kpos is None else kpos
    scale = 1.0 / np.sqrt(Dqk)
    if mask is None:
        mask = dense_mask(qseg, qpos, kseg, kpos, causal, wl, wr)
    am = AttentionMask(qseg, qpos, kseg, kpos, causal=causal, window=(wl, wr))

    def flash(q, k, v, bias):
        return flash_attention(q, k, v, am, bias, scale=scale, softcap=softcap, block_sizes=blocks,
                               interpret=True)

    def naive(q, k, v, bias):
        return naive_attention(q, k, v, mask, bias, scale, softcap)

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    @jax.jit
    def flash_all(q, k, v, bias):  # one compile for forward and gradients
        out, lse = flash(q, k, v, bias)
        g = jax.grad(loss_fn(flash, w_out, w_lse), argnums=argnums)(q, k, v, bias) \
            if grads else None
        return out, lse, g

    @jax.jit
    def naive_all(q, k, v, bias):  # the reference, jitted too: eager autodiff compiles every op per shape
        rout, rlse = naive(q, k, v, bias)
        rg = jax.grad(loss_fn(naive, w_out, w_lse), argnums=argnums)(q, k, v, bias) if grads else None
        return rout, rlse, rg

    out, lse, g = flash_all(q, k, v, bias)
    rout, rlse, rg = naive_all(q, k, v, bias)
    assert out.shape == (B, Sq, H, Dv) and out.dtype == q.dtype
    assert lse.shape == (B, H, Sq) and lse.dtype == jnp.float32
    assert not np.any(np.isnan(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(rlse)))
    empty = ~mask.any(-1)  # [B, Sq]
    if empty.any():
        np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)
    tol_o = 1e-5 if dtype == jnp.float32 else 2e-2
    tol_g = 1e-4 if dtype == jnp.float32 else 4e-2
    assert rel_err(out, rout) < tol_o
    fin = np.isfinite(np.asarray(rlse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rlse)[fin],
                               atol=1e-4 if dtype == jnp.float32 else 2e-2)
    if not grads:
        return
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), g, rg):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert rel_err(a, b) < tol_g, (name, rel_err(a, b))
    if empty.any():  # fully masked query rows: zero gradient
        dq = np.asarray(g[0], np.float32)
        np.testing.assert_array_equal(dq[empty], 0.0)


# ----------------------------------------------------------------------------- cases
def test_no_mask():
    check()


def test_causal():
    check(causal=True)


def test_causal_mixed_blocks():
    check(causal=True, Sq=64, Skv=64, blocks=MIXED)


@pytest.mark.parametrize("wl,wr", [(7, -1), (-1, 5), (9, 3)])
def test_windows(wl, wr):
    check(wl=wl, wr=wr)


def test_sliding_window_causal_gqa():
    check(causal=True, wl=11, H=4, G=2)


def test_segments_with_padding_and_empty_rows():
    B, S = 2, 48
    qseg = np.ones((B, S), np.int32)
    qseg[0, 20:40] = 2
    qseg[0, 40:] = 0          # padding queries
    qseg[1, :5] = 3           # segment absent from kv: fully masked rows
    qseg[1, 30:] = 2
    kseg = np.ones((B, S), np.int32)
    kseg[0, 20:40] = 2
    kseg[0, 40:] = 0
    kseg[1, 30:] = 2
    kseg[1, 44:] = 0
    check(qseg=jnp.asarray(qseg), kseg=jnp.asarray(kseg), causal=True)


def test_packed_segments_restart_positions():
    # Two packed sequences with positions restarting at 0, causal: block-diagonal mask.
    B, S = 1, 64
    qseg = jnp.asarray(np.repeat([1, 2], 32)[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(32), np.arange(32)])[None], jnp.int32)
    check(B=B, Sq=S, Skv=S, qseg=qseg, kseg=qseg, qpos=pos, kpos=pos, causal=True)


def test_mqa():
    # GQA (G=2, causal) runs in test_sliding_window_causal_gqa (fp32), test_bf16 and test_bias
    check(H=4, G=1, causal=True)


@pytest.mark.parametrize("bias_shape", [(1, 4, 40, 56), (2, 1, 40, 56), (2, 4, 40, 56)])
def test_bias(bias_shape):
    check(Sq=40, Skv=56, bias_shape=bias_shape, causal=True, H=4, G=2)


def test_split_dkv_gqa_bias_softcap():
    import dataclasses

    check(Sq=40, Skv=56, H=4, G=2, bias_shape=(2, 4, 40, 56), softcap=3.0, wl=9,
          blocks=dataclasses.replace(SMALL, split_dkv=True))


def test_softcap():
    check(softcap=2.0, causal=True)


def test_softcap_bias_window_bf16():
    check(softcap=5.0, wl=13, bias_shape=(1, 4, 48, 48), dtype=jnp.bfloat16)


def test_head_dims_differ():
    check(Dqk=48, Dv=32, causal=True)


@pytest.mark.slow
def test_head_dims_192_128():
    check(B=1, H=2, G=1, Sq=40, Skv=40, Dqk=192, Dv=128, causal=True, dtype=jnp.bfloat16,
          blocks=None)


def test_odd_lengths():
    check(Sq=37, Skv=53, H=2, G=1, causal=False)


def test_odd_lengths_bottom_right_causal():
    # Bottom-right alignment through positions: q position i + (Skv - Sq).
    B, Sq, Skv = 2, 37, 53
    mask = np.broadcast_to(np.tril(np.ones((Sq, Skv), bool), k=Skv - Sq), (B, Sq, Skv))
    check(B=B, Sq=Sq, Skv=Skv, H=2, G=2, causal=True, qpos=iota(B, Sq, Skv - Sq),
          mask=np.array(mask))


def test_single_query_many_keys():
    check(B=1, Sq=1, Skv=200, H=2, G=1, blocks=BlockSizes(16, 64, 16, 64))


def test_single_query_many_keys_causal_bottom_right():
    check(B=1, Sq=1, Skv=200, H=2, G=2, causal=True, qpos=iota(1, 1, 199),
          blocks=BlockSizes(16, 32, 16, 32))


@pytest.mark.slow
def test_single_query_1000_keys():
    check(B=1, Sq=1, Skv=1000, H=2, G=1, blocks=None)


def test_single_key():
    check(Sq=33, Skv=1, H=2, G=1)


def test_bf16():
    check(dtype=jnp.bfloat16, causal=True, H=4, G=2)


def test_bf16_default_blocks():
    check(dtype=jnp.bfloat16, Sq=64, Skv=80, blocks=None)


def test_fwd_bwd_entry_points_with_dlse():
    """flash_attention_fwd/bwd (context-parallel API) against jax.vjp of the naive reference."""
    B, S, H, G, D = 2, 40, 4, 2, 32
    q, k, v, _, dout, dlse = make_inputs(3, B, S, S, H, G, D, D, jnp.float32)
    seg, pos = jnp.ones((B, S), jnp.int32), iota(B, S)
    am = AttentionMask(seg, pos, seg, pos, causal=True, window=(17, -1))
    kw = dict(scale=0.3, block_sizes=SMALL, interpret=True)
    out, lse = flash_attention_fwd(q, k, v, am, **kw)
    out2, lse2 = flash_attention(q, k, v, am, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
    dq, dk, dv, db = flash_attention_bwd(q, k, v, am, None, out, lse, dout, dlse, **kw)
    assert db is None
    mask = dense_mask(seg, pos, seg, pos, True, 17, -1)
    ref_grads = jax.jit(lambda q, k, v, ct: jax.vjp(lambda q, k, v: naive_attention(q, k, v, mask, None, 0.3, None),
                                                    q, k, v)[1](ct))(q, k, v, (dout, dlse))
    for a, b in zip((dq, dk, dv), ref_grads):
        assert rel_err(a, b) < 1e-4
    # dlse=None equals dlse=0
    g0 = flash_attention_bwd(q, k, v, am, None, out, lse, dout, None, **kw)
    g1 = flash_attention_bwd(q, k, v, am, None, out, lse, dout, jnp.zeros_like(lse), **kw)
    for a, b in zip(g0[:3], g1[:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_reference_attention_matches_naive():
    B, Sq, Skv, H, G = 2, 20, 28, 4, 2
    q, k, v, bias, _, _ = make_inputs(5, B, Sq, Skv, H, G, 16, 24, jnp.float32,
                                      (1, H, Sq, Skv))
    seg, qpos, kpos = jnp.ones((B, Sq), jnp.int32).at[0, -3:].set(0), iota(B, Sq, 8), iota(B, Skv)
    kseg = jnp.ones((B, Skv), jnp.int32)
    am = AttentionMask(seg, qpos, kseg, kpos, causal=True, window=(6, -1))
    mask = dense_mask(seg, qpos, kseg, kpos, True, 6, -1)
    # both jitted (one compile each; eagerly every op compiles per shape)
    out, lse = jax.jit(lambda q, k, v, b: reference_attention(q, k, v, am, b, scale=0.2, softcap=3.0))(q, k, v, bias)
    rout, rlse = jax.jit(lambda q, k, v, b: naive_attention(q, k, v, mask, b, 0.2, 3.0))(q, k, v, bias)
    assert rel_err(out, rout) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), atol=1e-5)


# ----------------------------------------------------------------------------- block skipping
def test_block_schedule_counts():
    B, S = 1, 128
    pos = iota(B, S)
    seg = jnp.ones((B, S), jnp.int32)
    nb = S // 16
    causal = np.asarray(block_schedule(AttentionMask(seg, pos, seg, pos, causal=True)))[0]
    # q block i visits kv blocks 0..i; only the diagonal one is masked.
    np.testing.assert_array_equal(causal[:, 3] - causal[:, 0], np.arange(1, nb + 1))
    np.testing.assert_array_equal(causal[:, 2] - causal[:, 1], np.arange(nb))
    causal_t = np.asarray(block_schedule(AttentionMask(seg, pos, seg, pos, causal=True), transpose=True))[0]
    np.testing.assert_array_equal(causal_t[:, 3] - causal_t[:, 0], np.arange(nb, 0, -1))
    # sliding window of 16 keys (left 15): at most 2 kv blocks per q block.
    win = np.asarray(block_schedule(AttentionMask(seg, pos, seg, pos, causal=True, window=(15, -1))))[0]
    assert np.all(win[:, 3] - win[:, 0] <= 2)
    assert np.all(win[:, 2] == win[:, 1])  # no full blocks: all masked
    # no mask: everything full.
    nomask = np.asarray(block_schedule(AttentionMask(seg, pos, seg, pos)))[0]
    np.testing.assert_array_equal(nomask, np.tile([0, 0, nb, nb], (nb, 1)))
    # padding rows (segment 0) visit nothing.
    seg_p = seg.at[:, 96:].set(0)
    pad = np.asarray(block_schedule(AttentionMask(seg_p, pos, seg_p, pos)))[0]
    np.testing.assert_array_equal(pad[6:, 3] - pad[6:, 0], 0)
    np.testing.assert_array_equal(pad[:6], np.tile([0, 0, 6, 6], (6, 1)))


def test_skipped_blocks_are_not_touched():
    """NaN in K/V blocks that a causal mask rules out entirely must not reach the outputs:
    a computed-but-masked block would give 0 * NaN = NaN."""
    B, S, H, D = 1, 64, 2, 32
    q, k, v, _, w_out, _ = make_inputs(7, B, S, S, H, H, D, D, jnp.float32)
    pos, seg = iota(B, S), jnp.ones((B, S), jnp.int32)
    k_bad = k.at[:, 48:].set(jnp.nan)
    v_bad = v.at[:, 48:].set(jnp.nan)
    am = AttentionMask(seg, pos, seg, pos, causal=True)
    kw = dict(scale=0.2, block_sizes=SMALL, interpret=True)
    out, lse = flash_attention(q, k_bad, v_bad, am, **kw)
    rout, rlse = flash_attention(q, k, v, am, **kw)
    np.testing.assert_allclose(np.asarray(out[:, :48]), np.asarray(rout[:, :48]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse[:, :, :48]), np.asarray(rlse[:, :, :48]),
                               atol=1e-6)
    # dQ kernel skips the same blocks.
    w = w_out.at[:, 48:].set(0.0)
    dq = jax.jit(jax.grad(lambda q: jnp.sum(
        flash_attention(q, k_bad, v_bad, am, **kw)[0][:, :48] * w[:, :48])))(q)
    assert np.all(np.isfinite(np.asarray(dq[:, :48])))
    # dK/dV kernel: with causal, keys j >= 16 never see queries < 16, so NaN queries there
    # must not reach those keys' gradients.
    q_bad = q.at[:, :16].set(jnp.nan)
    dk = jax.jit(jax.grad(lambda k: jnp.sum(
        flash_attention(q_bad, k, v, am, **kw)[0][:, 16:] * w_out[:, 16:])))(k)
    assert np.all(np.isfinite(np.asarray(dk[:, 16:])))


def test_fully_masked_blocks_inside_range():
    """Segments interleaved so that blocks inside [lo, hi) are empty: computed with the mask."""
    B, S = 1, 64
    seg = np.ones((B, S), np.int32)
    seg[:, 16:32] = 2
    seg[:, 48:] = 2
    check(B=B, Sq=S, Skv=S, qseg=jnp.asarray(seg), kseg=jnp.asarray(seg))


def test_default_block_sizes_table():
    for d, dt in [(64, jnp.bfloat16), (128, jnp.bfloat16), (192, jnp.bfloat16),
                  (256, jnp.float16), (64, jnp.float32), (256, jnp.float32)]:
        bs = default_block_sizes(d, d, dt)
        assert isinstance(bs, BlockSizes)
    with pytest.raises(ValueError):
        BlockSizes(24, 16, 16, 16)
