"""RoPE under load-balanced context parallelism: positions are computed in the ORIGINAL token order
(segment ids un-reordered first) and then zig-zag reordered, for every way packing is given.

Each case runs MultiHeadAttention / TransformerLayer with rotary embeddings on fake CPU devices with
context_parallel_load_balanced=True (inputs and segment ids reordered with
reorder_causal_load_balancing) and compares with the same parameters on one device in the original
order (the output un-reordered): forward and gradients w.r.t. the parameters. Context parallelism
refuses thd, so thd (segment ids and seqlens) is checked on `_positions` itself; seqlens in bshd/sbhd
only pad the end, so their positions are the reordered arange (checked there too).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_flax_modules import assert_close, assert_tree_close, rand, unbox
from helpers import cpu_mesh
from te_jax.context_parallel import inverse_reorder_causal_load_balancing, reorder_causal_load_balancing
from te_jax.flax import MultiHeadAttention, TransformerLayer
from te_jax.flax.attention import _positions

B, S, D, H = 2, 16, 32, 2  # head_dim 16
CP = 4  # _positions checks: 8 zig-zag chunks of 2 tokens


def _mesh(n):
    return cpu_mesh((n,), ("cp",))


def _segments():
    """[B, S] segment ids in ORIGINAL order: several documents per row crossing chunk boundaries
    (every 2 tokens), padding (0) at the end of row 1."""
    rows = [[1] * 5 + [2] * 6 + [3] * 5,
            [1] * 3 + [2] * 7 + [3] * 3 + [0] * 3]
    return jnp.asarray(np.array(rows, np.int32))


def _compare(module_cls, kw, fmt="bshd", cp=2, tol=2e-5):
    seq_axis = 1 if fmt == "bshd" else 0
    x = rand(1, (B, S, D))
    if fmt == "sbhd":
        x = jnp.swapaxes(x, 0, 1)
    ct = rand(2, x.shape)
    seg = _segments()
    segz = reorder_causal_load_balancing(seg, cp, 1)  # segment ids come in the tokens' (zig-zag) order
    single, multi = dict(q_segment_ids=seg, kv_segment_ids=seg), dict(q_segment_ids=segz, kv_segment_ids=segz)
    base = module_cls(**kw)
    # init jitted: eagerly every op would compile on its own
    p = unbox(jax.jit(lambda k, x, tok: base.init(k, x, **tok))(jax.random.key(0), x, single))

    def out(m, p, x, **tok):
        y = m.apply(p, x, **tok)
        return y[0] if isinstance(y, tuple) else y

    def loss(m, ct, **tok):
        def f(p, x):
            y = out(m, p, x, **tok)
            return jnp.sum(y * ct), y
        return jax.value_and_grad(f, has_aux=True)

    (_, y_ref), g_ref = jax.jit(loss(base, ct, **single))(p, x)
    m = module_cls(context_parallel_axis="cp", context_parallel_load_balanced=True, **kw)
    ctz = reorder_causal_load_balancing(ct, cp, seq_axis)
    with jax.set_mesh(_mesh(cp)):
        xz = reorder_causal_load_balancing(x, cp, seq_axis)
        (_, y), g = jax.jit(loss(m, ctz, **multi))(p, xz)
    y = inverse_reorder_causal_load_balancing(np.asarray(y), cp, seq_axis)
    assert_close(y, y_ref, tol, f"{module_cls.__name__} forward")
    assert_tree_close(g, g_ref, tol * 2.5, f"{module_cls.__name__} grads")


MHA = dict(head_dim=D // H, num_attention_heads=H, enable_rotary_pos_emb=True, attn_mask_type="causal")


def test_mha_rope_segments_load_balanced_cp_matches_one_device():
    _compare(MultiHeadAttention, MHA)


def test_mha_rope_load_balanced_cp_sbhd_gqa_alternate_segments():
    kw = dict(MHA, num_attention_heads=4, head_dim=8, num_gqa_groups=2, rotary_pos_emb_group_method="alternate",
              attn_input_format="sbhd")
    _compare(MultiHeadAttention, kw, fmt="sbhd")


def test_transformer_layer_rope_segments_load_balanced_cp_matches_one_device():
    kw = dict(hidden_size=D, mlp_hidden_size=64, num_attention_heads=H, num_gqa_groups=1, hidden_dropout=0.0,
              attention_dropout=0.0, intermediate_dropout=0.0, enable_relative_embedding=False,
              enable_rotary_pos_emb=True, self_attn_mask_type="causal")

    class Layer(TransformerLayer):
        def __call__(self, x, **tok):
            return super().__call__(x, deterministic=True, **tok)

    _compare(Layer, kw)


def test_mha_cross_attention_rope_load_balanced_kv_positions():
    """Cross-attention: K/V come zig-zag reordered too, so their RoPE positions are reordered as well
    (before, the key positions were the plain arange). Forward, no packing, causal, 2 devices."""
    cp = 2
    xq, xkv = rand(3, (B, S, D)), rand(4, (B, S, D))
    kw = dict(MHA, fuse_qkv_params=False)
    base = MultiHeadAttention(**kw)
    p = unbox(jax.jit(base.init)(jax.random.key(0), xq, xkv))
    y_ref = jax.jit(lambda p: base.apply(p, xq, xkv)[0])(p)
    m = MultiHeadAttention(context_parallel_axis="cp", context_parallel_load_balanced=True, **kw)
    z = lambda t: reorder_causal_load_balancing(t, cp, 1)
    with jax.set_mesh(_mesh(cp)):
        y = jax.jit(lambda p, a, b: m.apply(p, a, b)[0])(p, z(xq), z(xkv))
    assert_close(inverse_reorder_causal_load_balancing(np.asarray(y), cp, 1), y_ref, 2e-5, "cross-attention")


def _np_positions(seg):
    """Position of each token within its run of equal ids, numpy, on the last axis."""
    seg = np.asarray(seg)
    pos = np.zeros_like(seg)
    for idx in np.ndindex(seg.shape[:-1]):
        row = seg[idx]
        for t in range(1, row.shape[0]):
            pos[idx][t] = pos[idx][t - 1] + 1 if row[t] == row[t - 1] else 0
    return pos


def _np_zigzag(x, cp):
    """reorder_causal_load_balancing on the last axis, written out: device r holds chunks r, 2cp-1-r."""
    chunks = np.split(np.asarray(x), 2 * cp, axis=-1)
    return np.concatenate([chunks[c] for r in range(cp) for c in (r, 2 * cp - 1 - r)], axis=-1)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_positions_original_order_then_reordered(fmt):
    """_positions(cp_size=...) of zig-zag ordered segment ids (or original-order thd seqlens) equals the
    positions of the original order, reordered; documents do not restart at chunk boundaries."""
    seg = np.asarray(_segments())
    assert _np_positions(seg)[0].tolist() == list(range(5)) + list(range(6)) + list(range(5))
    if fmt == "thd":
        flat = seg.reshape(-1)
        want = _np_zigzag(_np_positions(flat), CP)
        got = _positions("thd", 1, 2 * S, 0, jnp.asarray(_np_zigzag(flat, CP)), cp_size=CP)
        assert np.array_equal(np.asarray(got), want)
        lens = jnp.array([5, 6, 5, 3, 7, 3], jnp.int32)  # thd seqlens describe the original order
        ids = np.concatenate([np.repeat(np.arange(1, 7), np.asarray(lens)), np.zeros(3, np.int32)])
        got_l = _positions("thd", 1, 2 * S, 0, None, lens, cp_size=CP)
        assert np.array_equal(np.asarray(got_l), _np_zigzag(_np_positions(ids), CP))
    else:
        want = _np_zigzag(_np_positions(seg), CP)
        got = _positions(fmt, B, S, 0, jnp.asarray(_np_zigzag(seg, CP)), cp_size=CP)
        assert np.array_equal(np.asarray(got), want if fmt == "bshd" else want.T)
        # no packing: the reordered arange
        got_a = _positions(fmt, B, S, 0, None, cp_size=CP)
        want_a = _np_zigzag(np.arange(S)[None], CP)
        assert np.array_equal(np.asarray(got_a), want_a if fmt == "bshd" else want_a.T)
