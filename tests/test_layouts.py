"""QKV layouts: every packed form splits into q, k, v that attend exactly as separately made ones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import rand
from naive_attention import naive_attention, naive_mask

B, S, H, G, D = 2, 6, 4, 2, 8


def _separate(fmt, h=H, g=G, d=D, seed=0):
    """numpy-drawn (helpers.rand): no eager per-shape compile of jax.random."""
    rng = np.random.default_rng(seed)
    lead = {"bshd": (B, S), "sbhd": (S, B), "thd": (B * S,)}[fmt]
    return rand(rng, lead + (h, d)), rand(rng, lead + (g, d)), rand(rng, lead + (g, d))


def _pack(q, k, v, name, fmt):
    n_lead = 1 if fmt == "thd" else 2
    layout = te_jax.QKV_LAYOUTS[name]
    if layout.kind == "separate":
        return (q, k, v)
    if layout.kind == "kv_packed":
        return (q, jnp.stack([k, v], axis=layout.pack_axis))
    if layout.kind == "qkv_packed":
        return (jnp.stack([q, k, v], axis=layout.pack_axis),)
    return (jnp.concatenate([q, k, v], axis=n_lead),)


@pytest.mark.parametrize("name", sorted(te_jax.QKV_LAYOUTS))
def test_unpack_every_layout_round_trips(name):
    layout = te_jax.QKV_LAYOUTS[name]
    fmt = layout.attn_input_format
    g = H if layout.kind == "qkv_packed" else G
    q, k, v = _separate(fmt, g=g, seed=hash(name) % 1000)
    packed = _pack(q, k, v, name, fmt)
    q2, k2, v2 = te_jax.unpack_qkv(*packed, qkv_layout=name, num_attention_heads=H, num_gqa_groups=g)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        np.testing.assert_array_equal(a, b)
    # The same tensors are named back as this layout (bs2hd vs bsh2d is ambiguous only when g == 2).
    inferred = te_jax.infer_qkv_layout(*(packed + (None,) * (3 - len(packed))), attn_input_format=fmt,
                                       num_attention_heads=H, num_gqa_groups=g)
    if layout.kind in ("separate", "gqa_packed", "qkv_packed") or g != 2:
        assert inferred == name
    else:
        assert te_jax.QKV_LAYOUTS[inferred].kind == layout.kind


def test_sbhd_gqa_packed_attends_like_separate_tensors():
    """The TransformerEngine bug: sb(h+2g)d taken as sbhd_sbhd_sbhd gave results off by 6.2."""
    s, b, h, g, d = 16, 2, 16, 1, 64
    q, k, v = _separate("sbhd", h=h, g=g, d=d, seed=5)
    q, k, v = (rand(i, (s, b) + t.shape[2:]) for i, t in enumerate((q, k, v)))
    packed = jnp.concatenate([q, k, v], axis=2)  # [s, b, h + 2g, d]
    q2, k2, v2 = te_jax.unpack_qkv(packed, qkv_layout="sb(h+2g)d", num_attention_heads=h, num_gqa_groups=g)
    kw = dict(attn_input_format="sbhd", attn_mask_type="causal", window_size=(-1, 0), backend="xla")
    mask = naive_mask(b, s, s, "causal")
    out_packed, out_sep, ref = jax.jit(lambda q2, k2, v2, q, k, v: (  # one compile
        te_jax.dot_product_attention(q2, k2, v2, **kw), te_jax.dot_product_attention(q, k, v, **kw),
        naive_attention(*(jnp.swapaxes(t, 0, 1) for t in (q, k, v)), mask)))(q2, k2, v2, q, k, v)
    np.testing.assert_allclose(out_packed, out_sep, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jnp.swapaxes(out_packed, 0, 1), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fmt", te_jax.FORMATS)
def test_format_conversion_round_trip(fmt):
    q, _, _ = _separate(fmt)
    canon = te_jax.to_bshd(q, fmt)
    assert canon.ndim == 4
    np.testing.assert_array_equal(te_jax.from_bshd(canon, fmt), q)


BAD_UNPACK = [
    (dict(qkv_layout="bs3hd"), [(B, S, 2, H, D)], "qkv_layout='bs3hd' expects shape"),
    (dict(qkv_layout="bshd_bs2hd"), [(B, S, H, D), (B, S, 3, G, D)], "Axis 2 must have size 2"),
    (dict(qkv_layout="bs(h+2g)d", num_attention_heads=4, num_gqa_groups=2), [(B, S, 9, D)], "h + 2g = 8"),
    (dict(qkv_layout="bs(h+2g)d"), [(B, S, 8, D)], "needs num_attention_heads"),
    (dict(qkv_layout="bshd_bshd_bshd"), [(B, S, H * D), (B, S, G, D), (B, S, G, D)], "no head axis"),
    (dict(qkv_layout="bshd_bshd_bshd", num_gqa_groups=3), [(B, S, H, D), (B, S, G, D), (B, S, G, D)],
     "num_gqa_groups=3"),
    (dict(qkv_layout="nope"), [(B, S, H, D)], "not a known layout"),
    (dict(qkv_layout="bs3hd"), [(B, S, 3, H, D), (B, S, 3, H, D)], "in 1 tensor"),
]


@pytest.mark.parametrize("kwargs,shapes,msg", BAD_UNPACK)
def test_unpack_bad_shapes_name_the_problem(kwargs, shapes, msg):
    with pytest.raises(ValueError, match=None) as e:
        te_jax.unpack_qkv(*(jnp.zeros(s) for s in shapes), **kwargs)
    assert msg in str(e.value), str(e.value)
