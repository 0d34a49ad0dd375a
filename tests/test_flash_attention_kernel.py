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


def _case(*, B=2, Sq=48, Skv=48, H=4, G=4, Dqk=32, Dv=32, dtype=jnp.float32, causal=False,
          wl=-1, wr=-1, softcap=None, bias_shape=None, qseg=None, kseg=None, qpos=None,
          kpos=None, blocks=SMALL, grads=True, seed=0, mask=None):
    """One case: its inputs, the kernel and the naive reference as functions of (q, k, v, bias) returning
    (out, lse, gradients of loss_fn or None), and what the checks need."""
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

    def with_grads(attn):
        def run(q, k, v, bias):  # forward and gradients
            out, lse = attn(q, k, v, bias)
            g = jax.grad(loss_fn(attn, w_out, w_lse), argnums=argnums)(q, k, v, bias) if grads else None
            return out, lse, g
        return run

    return dict(args=(q, k, v, bias), flash=with_grads(flash), naive=with_grads(naive), mask=mask, dtype=dtype,
                shape=(B, Sq, H, Dv), grads=grads)


def check_many(cases):
    """cases: {name: keyword arguments of _case}. The kernels of every case run in one jitted program, the naive
    fp32 references in another (a compile of such programs is partly fixed cost); each case is checked on its
    own, its name in every failure message."""
    built = {name: _case(**kw) for name, kw in cases.items()}
    got = jax.jit(lambda argss: {n: c["flash"](*argss[n]) for n, c in built.items()})(
        {n: c["args"] for n, c in built.items()})
    want = jax.jit(lambda argss: {n: c["naive"](*argss[n]) for n, c in built.items()})(
        {n: c["args"] for n, c in built.items()})
    for name, c in built.items():
        (out, lse, g), (rout, rlse, rg) = got[name], want[name]
        dtype, mask, (B, Sq, H, Dv) = c["dtype"], c["mask"], c["shape"]
        assert out.shape == (B, Sq, H, Dv) and out.dtype == dtype, name
        assert lse.shape == (B, H, Sq) and lse.dtype == jnp.float32, name
        assert not np.any(np.isnan(np.asarray(out, np.float32))), name
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(rlse)), err_msg=name)
        empty = ~mask.any(-1)  # [B, Sq]
        if empty.any():
            np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0, err_msg=name)
        tol_o = 1e-5 if dtype == jnp.float32 else 2e-2
        tol_g = 1e-4 if dtype == jnp.float32 else 4e-2
        assert rel_err(out, rout) < tol_o, (name, rel_err(out, rout))
        fin = np.isfinite(np.asarray(rlse))
        np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rlse)[fin],
                                   atol=1e-4 if dtype == jnp.float32 else 2e-2, err_msg=name)
        if not c["grads"]:
            continue
        for what, a, b in zip(("dq", "dk", "dv", "dbias"), g, rg):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, what)
            assert np.all(np.isfinite(np.asarray(a, np.float32))), (name, what)
            assert rel_err(a, b) < tol_g, (name, what, rel_err(a, b))
        if empty.any():  # fully masked query rows: zero gradient
            dq = np.asarray(g[0], np.float32)
            np.testing.assert_array_equal(dq[empty], 0.0, err_msg=name)


def check(**kw):
    check_many({"": kw})


# ----------------------------------------------------------------------------- cases
# Cases that share a theme run as one test (check_many: one compile for their kernels, one for their references),
# each checked on its own and named in failures.
def test_no_mask_causal_mqa_gqa():
    # GQA (G=2, causal) also runs in test_bf16 and test_bias
    check_many({"no_mask": {}, "causal": dict(causal=True), "mqa causal": dict(H=4, G=1, causal=True),
                "sliding window causal gqa": dict(causal=True, wl=11, H=4, G=2)})


def test_causal_mixed_blocks():
    check(causal=True, Sq=64, Skv=64, blocks=MIXED)


def test_windows():
    check_many({f"window ({wl}, {wr})": dict(wl=wl, wr=wr) for wl, wr in [(7, -1), (-1, 5), (9, 3)]})


def test_segments():
    """Padding and fully masked rows; packed sequences with positions restarting; empty blocks inside the
    visited range."""
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
    # Two packed sequences with positions restarting at 0, causal: block-diagonal mask.
    packed = jnp.asarray(np.repeat([1, 2], 32)[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(32), np.arange(32)])[None], jnp.int32)
    # Segments interleaved so that blocks inside [lo, hi) are empty: computed with the mask.
    inter = np.ones((1, 64), np.int32)
    inter[:, 16:32] = 2
    inter[:, 48:] = 2
    check_many({
        "padding and empty rows": dict(qseg=jnp.asarray(qseg), kseg=jnp.asarray(kseg), causal=True),
        "packed, positions restart": dict(B=1, Sq=64, Skv=64, qseg=packed, kseg=packed, qpos=pos, kpos=pos,
                                          causal=True),
        "empty blocks inside the range": dict(B=1, Sq=64, Skv=64, qseg=jnp.asarray(inter), kseg=jnp.asarray(inter)),
    })


def test_bias():
    check_many({f"bias {shape}": dict(Sq=40, Skv=56, bias_shape=shape, causal=True, H=4, G=2)
                for shape in [(1, 4, 40, 56), (2, 1, 40, 56), (2, 4, 40, 56)]})


def test_split_dkv_gqa_bias_softcap():
    import dataclasses

    check(Sq=40, Skv=56, H=4, G=2, bias_shape=(2, 4, 40, 56), softcap=3.0, wl=9,
          blocks=dataclasses.replace(SMALL, split_dkv=True))


def test_softcap_and_head_dims_differ():
    check_many({"softcap": dict(softcap=2.0, causal=True), "head dims 48 / 32": dict(Dqk=48, Dv=32, causal=True)})


@pytest.mark.slow
def test_head_dims_192_128():
    check(B=1, H=2, G=1, Sq=40, Skv=40, Dqk=192, Dv=128, causal=True, dtype=jnp.bfloat16,
          blocks=None)


def test_odd_lengths():
    # Bottom-right alignment through positions: q position i + (Skv - Sq).
    B, Sq, Skv = 2, 37, 53
    mask = np.broadcast_to(np.tril(np.ones((Sq, Skv), bool), k=Skv - Sq), (B, Sq, Skv))
    check_many({"no mask": dict(Sq=Sq, Skv=Skv, H=2, G=1, causal=False),
                "bottom-right causal": dict(B=B, Sq=Sq, Skv=Skv, H=2, G=2, causal=True, qpos=iota(B, Sq, Skv - Sq),
                                            mask=np.array(mask))})


def test_single_query_many_keys_and_single_key():
    check_many({"1 query, 200 keys": dict(B=1, Sq=1, Skv=200, H=2, G=1, blocks=BlockSizes(16, 64, 16, 64)),
                "1 query, 200 keys, causal bottom-right": dict(B=1, Sq=1, Skv=200, H=2, G=2, causal=True,
                                                               qpos=iota(1, 1, 199), blocks=BlockSizes(16, 32, 16, 32)),
                "33 queries, 1 key": dict(Sq=33, Skv=1, H=2, G=1)})


@pytest.mark.slow
def test_single_query_1000_keys():
    check(B=1, Sq=1, Skv=1000, H=2, G=1, blocks=None)


def test_bf16():
    check_many({"causal gqa": dict(dtype=jnp.bfloat16, causal=True, H=4, G=2),
                "default blocks": dict(dtype=jnp.bfloat16, Sq=64, Skv=80, blocks=None),
                "softcap, bias, window": dict(softcap=5.0, wl=13, bias_shape=(1, 4, 48, 48), dtype=jnp.bfloat16)})


def test_fwd_bwd_entry_points_with_dlse():
    """flash_attention_fwd/bwd (context-parallel API) against jax.vjp of the naive reference."""
    B, S, H, G, D = 2, 40, 4, 2, 32
    q, k, v, _, dout, dlse = make_inputs(3, B, S, S, H, G, D, D, jnp.float32)
    seg, pos = jnp.ones((B, S), jnp.int32), iota(B, S)
    am = AttentionMask(seg, pos, seg, pos, causal=True, window=(17, -1))
    kw = dict(scale=0.3, block_sizes=SMALL, interpret=True)
    mask = dense_mask(seg, pos, seg, pos, True, 17, -1)

    @jax.jit  # every entry point and the reference in one compile
    def run(q, k, v, dout, dlse):
        out, lse = flash_attention_fwd(q, k, v, am, **kw)
        grads = flash_attention_bwd(q, k, v, am, None, out, lse, dout, dlse, **kw)
        g0 = flash_attention_bwd(q, k, v, am, None, out, lse, dout, None, **kw)
        g1 = flash_attention_bwd(q, k, v, am, None, out, lse, dout, jnp.zeros_like(lse), **kw)
        ref_grads = jax.vjp(lambda q, k, v: naive_attention(q, k, v, mask, None, 0.3, None), q, k, v)[1]((dout, dlse))
        return (out, lse), flash_attention(q, k, v, am, **kw), grads, g0, g1, ref_grads

    (out, lse), (out2, lse2), (dq, dk, dv, db), g0, g1, ref_grads = run(q, k, v, dout, dlse)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
    assert db is None
    for a, b in zip((dq, dk, dv), ref_grads):
        assert rel_err(a, b) < 1e-4
    # dlse=None equals dlse=0
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
    w = w_out.at[:, 48:].set(0.0)
    q_bad = q.at[:, :16].set(jnp.nan)

    @jax.jit  # one compile
    def run(q, k, v, k_bad, v_bad, q_bad):
        # dQ kernel skips the same blocks.
        dq = jax.grad(lambda q: jnp.sum(flash_attention(q, k_bad, v_bad, am, **kw)[0][:, :48] * w[:, :48]))(q)
        # dK/dV kernel: with causal, keys j >= 16 never see queries < 16, so NaN queries there
        # must not reach those keys' gradients.
        dk = jax.grad(lambda k: jnp.sum(flash_attention(q_bad, k, v, am, **kw)[0][:, 16:] * w_out[:, 16:]))(k)
        return flash_attention(q, k_bad, v_bad, am, **kw), flash_attention(q, k, v, am, **kw), dq, dk

    (out, lse), (rout, rlse), dq, dk = run(q, k, v, k_bad, v_bad, q_bad)
    np.testing.assert_allclose(np.asarray(out[:, :48]), np.asarray(rout[:, :48]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse[:, :, :48]), np.asarray(rlse[:, :, :48]),
                               atol=1e-6)
    assert np.all(np.isfinite(np.asarray(dq[:, :48])))
    assert np.all(np.isfinite(np.asarray(dk[:, 16:])))


def test_default_block_sizes_table():
    for d, dt in [(64, jnp.bfloat16), (128, jnp.bfloat16), (192, jnp.bfloat16),
                  (256, jnp.float16), (64, jnp.float32), (256, jnp.float32)]:
        bs = default_block_sizes(d, d, dt)
        assert isinstance(bs, BlockSizes)
    with pytest.raises(ValueError):
        BlockSizes(24, 16, 16, 16)
