"""Dense boolean masks (TransformerEngine's convention, True = masked out) are applied exactly as given:
through te_jax.dot_product_attention(mask=...) / _packed on the xla and pallas backends, and through the
Flax DotProductAttention / MultiHeadAttention, against a plain-jnp fp32 reference (forward and gradients).
Before, the Flax modules read such a mask as padding only, so a causal or block-diagonal mask was dropped."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
import te_jax.attention as attention_mod
from helpers import attention_backends, qkv, rand as _rand
from te_jax.flax import DotProductAttention, MultiHeadAttention

B, S, H, G, D = 2, 16, 4, 2, 16
TOL = 1e-5  # fp32, relative to max(|reference|, 1)
DENSE_MASK_BACKENDS = attention_backends(dense_mask=True)  # the registered backends that take mask= and run here


def _qkv(seed=0, h=H, g=G):
    return qkv(seed, B, S, S, h, g, D)


def ref_attention(q, k, v, masked_out, bias=None, scale=None):
    """Plain jnp fp32: q [B,S,H,D], k/v [B,S,G,D], masked_out [B|1,H|1,Sq,Skv] (True = hidden).
    Hidden elements get probability 0; a row with every key hidden gives 0."""
    h, g = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    if bias is not None:
        s = s + bias
    keep = jnp.broadcast_to(~masked_out, s.shape)
    p = jax.nn.softmax(jnp.where(keep, s, -1e30), axis=-1)
    p = jnp.where(keep & keep.any(-1, keepdims=True), p, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


def assert_close(a, b, tol, what):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, f"{what}: {a.shape} vs {b.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite"
    err, ref = np.max(np.abs(a - b)), max(np.max(np.abs(b)), 1.0)
    assert err <= tol * ref, f"{what}: max err {err:.3g} > {tol:g} x {ref:.3g}"


# ----------------------------------------------------------------------------- the masks (True = masked out)

def causal_mask():
    return ~jnp.tril(jnp.ones((S, S), bool))[None, None]  # [1, 1, S, S]


def block_diagonal_mask():
    """Three documents per row (lengths differ per batch row), [B, 1, S, S]."""
    seg = np.array([[1] * 5 + [2] * 6 + [3] * 5, [1] * 3 + [2] * 9 + [3] * 4])
    return jnp.asarray(seg[:, None, :, None] != seg[:, None, None, :])


def random_mask():
    """[B, H, S, S] random, with query row 3 and key column 7 masked everywhere, row 10 in head 1 only."""
    m = jax.random.bernoulli(jax.random.key(7), 0.5, (B, H, S, S))
    return m.at[:, :, 3, :].set(True).at[:, :, :, 7].set(True).at[:, 1, 10, :].set(True)


LENS = jnp.array([S, 11], jnp.int32)


def padding_mask():
    valid = jnp.arange(S)[None] < LENS[:, None]
    return ~(valid[:, None, :, None] & valid[:, None, None, :])  # [B, 1, S, S]


MASKS = {"causal": causal_mask, "block_diagonal": block_diagonal_mask, "random_rows_cols": random_mask,
         "padding": padding_mask}


def _fwd_grads(fn, args, seed=99):
    """Output and grads of <out, random cotangent> w.r.t. every arg (jit: the kernel interprets faster)."""
    ct = _rand(seed, jax.eval_shape(fn, *args).shape)

    def loss(*a):
        out = fn(*a)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return out, grads


# ----------------------------------------------------------------------------- functional API

def _all_masks():
    """Every mask of MASKS, stacked along the batch ([len(MASKS)·B, H, S, S]): one compiled call covers them."""
    return jnp.concatenate([jnp.broadcast_to(f(), (B, H, S, S)) for f in MASKS.values()])


@pytest.mark.parametrize("backend", DENSE_MASK_BACKENDS)
def test_dense_mask_exact_vs_reference(backend):
    """mask with attn_mask_type='no_mask' (causal, block-diagonal, random with rows / columns hidden
    everywhere, padding): forward and dq/dk/dv equal the exactly masked fp32 reference."""
    n = len(MASKS)
    q, k, v = (jnp.concatenate([t] * n) for t in _qkv())
    m = _all_masks()
    out, grads = _fwd_grads(lambda q, k, v: te_jax.dot_product_attention(q, k, v, mask=m, backend=backend),
                            (q, k, v))
    rout, rgrads = _fwd_grads(lambda q, k, v: ref_attention(q, k, v, m), (q, k, v))
    for i, name in enumerate(MASKS):
        sl = slice(i * B, (i + 1) * B)
        assert_close(out[sl], rout[sl], TOL, f"{backend} {name} out")
        for n_, a, r in zip("qkv", grads, rgrads):
            assert_close(a[sl], r[sl], TOL, f"{backend} {name} d{n_}")
    rnd = slice(2 * B, 3 * B)  # random_rows_cols: rows hidden entirely give exact zeros, in every head or in one
    o, dk = np.asarray(out[rnd]), np.asarray(grads[1][rnd])
    assert np.all(o[:, 3] == 0) and np.all(o[:, 10, 1] == 0) and np.any(o[:, 10, 0] != 0)
    assert np.all(dk[:, 7] == 0), "a key column hidden everywhere gets no gradient"


@pytest.mark.parametrize("backend", DENSE_MASK_BACKENDS)
def test_dense_mask_with_bias_causal_type_and_padding(backend):
    """The mask composes with attn_mask_type (causal), seqlens padding and a bias; dbias is exact too."""
    q, k, v = _qkv(3)
    m = random_mask()
    bias = _rand(5, (1, H, S, S))
    valid = jnp.arange(S)[None] < LENS[:, None]
    hidden = m | causal_mask() | ~(valid[:, None, :, None] & valid[:, None, None, :])
    kw = dict(attn_mask_type="padding_causal", q_seqlens=LENS, kv_seqlens=LENS, mask=m, backend=backend)
    out, grads = _fwd_grads(lambda q, k, v, b: te_jax.dot_product_attention(q, k, v, bias=b, **kw), (q, k, v, bias))
    rout, rgrads = _fwd_grads(lambda q, k, v, b: ref_attention(q, k, v, hidden, bias=b), (q, k, v, bias))
    assert_close(out, rout, TOL, f"{backend} out")
    for n, a, r in zip(("dq", "dk", "dv", "dbias"), grads, rgrads):
        assert_close(a, r, TOL, f"{backend} {n}")


@pytest.mark.parametrize("backend", DENSE_MASK_BACKENDS)
def test_padding_mask_equals_seqlens(backend):
    q, k, v = _qkv(4)
    by_mask = jax.jit(lambda q, k, v: te_jax.dot_product_attention(q, k, v, mask=padding_mask(),
                                                                     backend=backend))(q, k, v)
    by_lens = jax.jit(lambda q, k, v: te_jax.dot_product_attention(
        q, k, v, attn_mask_type="padding", q_seqlens=LENS, kv_seqlens=LENS, backend=backend))(q, k, v)
    assert_close(by_mask, by_lens, 1e-6, f"{backend} padding mask vs seqlens")


def test_packed_in_place_and_thd():
    """dot_product_attention_packed (the portable kernel reads bs3hd in place) and thd take the mask too."""
    q, k, v = _qkv(6, h=2, g=2)
    m = block_diagonal_mask() | causal_mask()
    qkv = jnp.stack([q, k, v], axis=2)  # [B, S, 3, h, D]
    expl = te_jax.explain_attention_backend_packed(qkv, qkv_layout="bs3hd", mask=m, backend="pallas")
    assert "read in place" in expl.packed
    out, (dqkv,) = _fwd_grads(
        lambda x: te_jax.dot_product_attention_packed(x, qkv_layout="bs3hd", mask=m, backend="pallas"), (qkv,))
    rout, (rdqkv,) = _fwd_grads(lambda x: ref_attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], m), (qkv,))
    assert_close(out, rout, TOL, "packed out")
    assert_close(dqkv, rdqkv, TOL, "packed dqkv")
    # thd: one packed token axis (batch 1), a [1, 1, t, t] mask
    qt, kt, vt = (t[0] for t in (q, k, v))
    seg = jnp.asarray([1] * 9 + [2] * 7, jnp.int32)
    out_t = te_jax.dot_product_attention(qt, kt, vt, attn_input_format="thd", attn_mask_type="padding",
                                         q_segment_ids=seg, kv_segment_ids=seg, mask=causal_mask(), backend="xla")
    hidden = causal_mask() | (seg[:, None] != seg[None, :])[None, None]
    assert_close(out_t, ref_attention(q[:1], k[:1], v[:1], hidden)[0], TOL, "thd")


# ----------------------------------------------------------------------------- selection, explanation, errors

@pytest.fixture
def fake_h100(monkeypatch):
    """Pretend to be on an sm90 GPU: selection reasons only, nothing is executed."""
    monkeypatch.setattr(attention_mod, "current_platform", lambda: ("gpu", (9, 0)))
    for var in ("TE_JAX_ATTN_BACKEND", "TE_JAX_PALLAS_ATTN", "TE_JAX_CUDNN_ATTN", "TE_JAX_XLA_ATTN"):
        monkeypatch.delenv(var, raising=False)


def test_explain_names_the_mask_where_cudnn_and_hopper_refuse(fake_h100):
    q, k, v = (t.astype(jnp.bfloat16) for t in _qkv())
    plain = te_jax.explain_attention_backend(q, k, v, attn_mask_type="causal")
    assert plain.reasons["cudnn"] is None or plain.reasons["cudnn"].startswith("serves the call")
    choice = te_jax.explain_attention_backend(q, k, v, mask=causal_mask())
    assert choice.selected == "pallas"
    assert "mask" in choice.reasons["cudnn"] and "dense boolean mask" in choice.reasons["cudnn"]
    assert "Hopper kernel not used: mask" in choice.detail
    with pytest.raises(ValueError, match="dense boolean mask"):
        te_jax.dot_product_attention(q, k, v, mask=causal_mask(), backend="cudnn")


@pytest.mark.parametrize("bad,match", [
    (jnp.zeros((S, S), bool), r"mask: got shape \(16, 16\), expected \[batch or 1, heads or 1, q_seq, kv_seq\]"),
    (jnp.zeros((3, 1, S, S), bool), r"mask: got shape \(3, 1, 16, 16\).*\[2 or 1, 4 or 1, 16, 16\]"),
    (jnp.zeros((B, 1, S, S), jnp.int32), r"mask has dtype int32; it must be boolean with True = masked out"),
    (jnp.zeros((B, 1, S, S), jnp.float32), r"mask has dtype float32.*as `bias`"),
])
def test_mask_errors(bad, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        te_jax.dot_product_attention(q, k, v, mask=bad)


# ----------------------------------------------------------------------------- Flax modules

@pytest.mark.parametrize("backend", DENSE_MASK_BACKENDS)
def test_flax_dot_product_attention_applies_the_mask(backend):
    """TE's common pattern: a causal / block-diagonal boolean mask with attn_mask_type='no_mask'."""
    q, k, v = _qkv(8)
    mod = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, attn_mask_type="no_mask",
                              backend=backend)
    m = jnp.concatenate([jnp.broadcast_to(causal_mask(), (B, 1, S, S)), block_diagonal_mask()])
    q2, k2, v2 = (jnp.concatenate([t, t]) for t in (q, k, v))
    out, grads = _fwd_grads(lambda q, k, v: mod.apply({}, q, k, v, m), (q2, k2, v2))
    rout, rgrads = _fwd_grads(lambda q, k, v: ref_attention(q, k, v, m), (q2, k2, v2))
    for i, name in enumerate(("causal", "block_diagonal")):
        sl = slice(i * B, (i + 1) * B)
        assert_close(out[sl], rout[sl], TOL, f"{name} out")
        for n, a, r in zip("qkv", grads, rgrads):
            assert_close(a[sl], r[sl], TOL, f"{name} d{n}")
    # a padding mask still gives the seqlens result (padding type: the dense mask does the masking)
    pad = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, attn_mask_type="padding",
                              backend=backend)
    assert_close(pad.apply({}, q, k, v, padding_mask()),
                 pad.apply({}, q, k, v, q_seqlens=LENS, kv_seqlens=LENS), 1e-6, "padding mask vs seqlens")


def test_flax_multi_head_attention_mask_equals_mask_type():
    """MultiHeadAttention(mask=causal TE mask, 'no_mask') == MultiHeadAttention('causal'): forward, param grads."""
    x = _rand(11, (B, S, 32))
    kw = dict(head_dim=D, num_attention_heads=2, enable_rotary_pos_emb=True)
    by_type = MultiHeadAttention(attn_mask_type="causal", **kw)
    by_mask = MultiHeadAttention(attn_mask_type="no_mask", **kw)
    p = by_type.init(jax.random.key(0), x)
    ct = _rand(12, x.shape)

    def run(mod, *a):
        return jax.jit(jax.value_and_grad(lambda p: jnp.sum(mod.apply(p, x, None, *a)[0] * ct)))(p)

    (l1, g1), (l2, g2) = run(by_type), run(by_mask, causal_mask())
    assert_close(l2, l1, TOL, "loss")
    for a, r in zip(jax.tree_util.tree_leaves(g2), jax.tree_util.tree_leaves(g1)):
        assert_close(a, r, TOL, "param grad")


def test_flax_mask_errors_with_context_parallelism_and_float_masks():
    q, k, v = _qkv()
    cp = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, attn_mask_type="no_mask",
                             context_parallel_axis="cp")
    with pytest.raises(ValueError, match=r"mask .*cannot be split over context_parallel_axis='cp'.*q_segment_ids"):
        cp.apply({}, q, k, v, causal_mask())
    mod = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, attn_mask_type="no_mask")
    with pytest.raises(ValueError, match="mask has dtype float32.*`bias`"):
        mod.apply({}, q, k, v, causal_mask().astype(jnp.float32))


def test_flax_mask_split_per_shard_under_a_dp_tp_mesh():
    """Under a data x tensor mesh the Pallas kernel runs per shard (shard_map over batch and heads) and the
    [b, h, s, s] mask is split with the batch and heads: equal to the reference on the global arrays
    (forward: the gradients of the same per-shard call are checked on one device above)."""
    import flax.linen as nn

    import jaxpr_walk
    from test_sharded_attention import DP_TP_RULES, _mesh

    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices; tests/conftest.py sets them")
    q, k, v = (jnp.concatenate([t, t]) for t in _qkv(13))  # batch 4
    m = jnp.concatenate([random_mask(), jnp.broadcast_to(block_diagonal_mask(), (B, H, S, S))])
    mod = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, attn_mask_type="no_mask",
                              backend="pallas")
    fn = lambda q, k, v: mod.apply({}, q, k, v, m)
    with jax.set_mesh(_mesh(2, 2)), nn.logical_axis_rules(DP_TP_RULES):
        jaxpr = jax.make_jaxpr(fn)(q, k, v).jaxpr
        out = jax.jit(fn)(q, k, v)
    assert any(e.primitive.name == "shard_map" for e in jaxpr_walk.walk(jaxpr)), "did not run per shard"
    assert_close(out, ref_attention(q, k, v, m), TOL, "per-shard out")
