"""te_jax.flax modules against plain-Flax references written here, with the same parameters copied in."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rand
from tolerance import assert_close
from te_jax.flax import (
    DenseGeneral,
    DotProductAttention,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    MultiHeadAttention,
    RelativePositionBiases,
)

HI = jax.lax.Precision.HIGHEST
B, S, D, H, HD = 2, 8, 32, 4, 8
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 4e-2}


# ----------------------------------------------------------------------------- helpers


def unbox(v):
    return nn.meta.unbox(v)


# max |a - b| <= tol * max(max|b|, 1), leaf by leaf (tests/tolerance.py; arrays or pytrees)
assert_tree_close = assert_close


def fwd_and_grads(fn, params, *xs, seed=99):
    """Output, and the gradients of <out, random cotangent> w.r.t. params and the inputs."""
    out = fn(params, *xs)
    out0 = out[0] if isinstance(out, tuple) else out
    ct = rand(seed, out0.shape, jnp.float32)

    def loss(p, *x):
        o = fn(p, *x)
        o = o[0] if isinstance(o, tuple) else o
        return jnp.sum(o.astype(jnp.float32) * ct)

    grads = jax.grad(loss, argnums=tuple(range(1 + len(xs))))(params, *xs)
    return out0, grads


def ref_norm(x, scale, bias, layernorm_type="layernorm", eps=1e-6, zero_centered_gamma=False):
    """flax.linen LayerNorm / RMSNorm in fp32 with the given parameters."""
    g = scale + 1.0 if zero_centered_gamma else scale
    x = x.astype(jnp.float32)
    if layernorm_type == "rmsnorm":
        return nn.RMSNorm(epsilon=eps).apply({"params": {"scale": g}}, x)
    return nn.LayerNorm(epsilon=eps).apply({"params": {"scale": g, "bias": bias}}, x)


def ref_dense(x, kernel, bias=None, n_contract=1):
    y = jnp.tensordot(x.astype(jnp.float32), kernel.astype(jnp.float32), axes=n_contract, precision=HI)
    return y if bias is None else y + bias


ACT = {"gelu": lambda z: nn.gelu(z, approximate=True), "relu": nn.relu, "silu": nn.silu, "linear": lambda z: z}


def ref_mlp(p, x, activations, layernorm_type="layernorm", eps=1e-6):
    ln = ref_norm(x, p["scale"], p.get("ln_bias"), layernorm_type, eps)
    h = jnp.einsum("...d,daf->...af", ln, p["wi_kernel"], precision=HI)
    if "wi_bias" in p:
        h = h + p["wi_bias"]
    a = ACT[activations[0]](h[..., 0, :])
    for i, name in enumerate(activations[1:], 1):
        a = a * ACT[name](h[..., i, :])
    y = jnp.einsum("...f,fd->...d", a, p["wo_kernel"], precision=HI)
    return (y + p["wo_bias"]) if "wo_bias" in p else y


def ref_rope(x, pos, method, windows=(1, 10000)):
    """RoPE via complex multiplication: x [b, s, h, d], pos [s] or [b, s]."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (windows[0] * (windows[1] / windows[0]) ** (np.arange(half) * 2.0 / d))
    pos = jnp.asarray(pos, jnp.float32)
    pos = pos[None] if pos.ndim == 1 else pos
    rot = jnp.exp(1j * pos[..., None, None] * inv)  # [b|1, s, 1, half]
    xf = x.astype(jnp.float32)
    if method == "consecutive":
        z = (xf[..., 0::2] + 1j * xf[..., 1::2]) * rot
        return jnp.stack([z.real, z.imag], -1).reshape(x.shape)
    z = (xf[..., :half] + 1j * xf[..., half:]) * rot
    return jnp.concatenate([z.real, z.imag], -1)


def ref_attention(q, k, v, visible=None, scale=None, bias=None):
    """flax.linen.dot_product_attention with GQA (k/v heads repeated); q [b, s, h, d]; visible True = attend."""
    h, g, d = q.shape[2], k.shape[2], q.shape[3]
    k = jnp.repeat(k, h // g, axis=2)
    v = jnp.repeat(v, h // g, axis=2)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = q.astype(jnp.float32) * (scale * math.sqrt(d))  # flax divides by sqrt(d)
    return nn.dot_product_attention(q, k.astype(jnp.float32), v.astype(jnp.float32), bias=bias, mask=visible,
                                    precision=HI)


def causal_visible(sq, skv):
    return jnp.tril(jnp.ones((sq, skv), bool))[None, None]


def ref_mha(p, x, kv=None, *, h, g, visible=None, scale=1.0, rope=None, bias=None, layernorm_type="layernorm",
            input_layernorm=True, positions=None, kv_positions=None):
    """Plain reference of MultiHeadAttention from its (unboxed) parameters; bshd."""
    first = p["qkv"] if "qkv" in p else p["query"]
    ln = ref_norm(x, first["scale"], first.get("ln_bias"), layernorm_type) if input_layernorm else x
    if "qkv" in p:
        qkv = ref_dense(ln, p["qkv"]["kernel"], p["qkv"].get("bias"))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q = ref_dense(ln, p["query"]["kernel"], p["query"].get("bias"))
        src = ln if kv is None else kv
        if "kv" in p:
            kvp = ref_dense(src, p["kv"]["kernel"], p["kv"].get("bias"))
            k, v = kvp[:, :, 0], kvp[:, :, 1]
        else:
            k = ref_dense(src, p["key"]["kernel"], p["key"].get("bias"))
            v = ref_dense(src, p["value"]["kernel"], p["value"].get("bias"))
    if rope is not None:
        sq, skv = q.shape[1], k.shape[1]
        q = ref_rope(q, np.arange(sq) if positions is None else positions, rope)
        k = ref_rope(k, np.arange(skv) if kv_positions is None else kv_positions, rope)
    o = ref_attention(q, k, v, visible, scale, bias)
    return ref_dense(o, p["out"]["kernel"], p["out"].get("bias"), n_contract=2), ln


def init(module, *args, **kwargs):
    return unbox(module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, *args, **kwargs))


# ----------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layernorm(layernorm_type, zero_centered_gamma, dtype):
    m = LayerNorm(layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma, dtype=dtype)
    x = rand(1, (B, S, D), scale=2.0) + 0.5
    v = init(m, x)
    p = jax.tree_util.tree_map(lambda a: a + rand(7, a.shape, scale=0.3), v["params"])  # non-trivial params
    assert set(p) == ({"scale", "ln_bias"} if layernorm_type == "layernorm" else {"scale"})
    ours = lambda p, x: m.apply({"params": p}, x.astype(dtype))
    ref = lambda p, x: ref_norm(x, p["scale"], p.get("ln_bias"), layernorm_type, 1e-6, zero_centered_gamma)
    o, g = fwd_and_grads(ours, p, x)
    assert o.dtype == dtype
    ro, rg = fwd_and_grads(ref, p, x)
    assert_close(o, ro, TOL[dtype], "out")
    assert_tree_close(g, rg, TOL[dtype] * 2, "grad")


# ----------------------------------------------------------------------------- DenseGeneral


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_general_multi_axis(dtype):
    m = DenseGeneral(features=(3, 5), axis=(-2, -1), use_bias=True, kernel_axes=("heads", "kv", "qkv", "embed"),
                     bias_axes=("qkv", "embed"), dtype=dtype)
    x = rand(1, (B, S, H, HD))
    v = m.init(jax.random.key(0), x)
    assert isinstance(v["params"]["kernel"], nn.LogicallyPartitioned)
    assert v["params"]["kernel"].names == ("heads", "kv", "qkv", "embed")
    p = unbox(v)["params"]
    p["bias"] = rand(3, p["bias"].shape)
    assert p["kernel"].shape == (H, HD, 3, 5)
    o, g = fwd_and_grads(lambda p, x: m.apply({"params": p}, x.astype(dtype)), p, x)
    ro, rg = fwd_and_grads(lambda p, x: ref_dense(x, p["kernel"], p["bias"], 2), p, x)
    assert o.shape == (B, S, 3, 5) and o.dtype == dtype
    assert_close(o, ro, TOL[dtype], "out")
    assert_tree_close(g, rg, TOL[dtype] * 2, "grad")


# ----------------------------------------------------------------------------- LayerNormDenseGeneral


@pytest.mark.parametrize("layernorm_type,dtype", [("layernorm", jnp.float32), ("rmsnorm", jnp.bfloat16)])
def test_layernorm_dense_general(layernorm_type, dtype):
    m = LayerNormDenseGeneral(features=(H, HD), layernorm_type=layernorm_type, use_bias=True,
                              return_layernorm_output=True, dtype=dtype)
    x = rand(1, (B, S, D)) + 0.3
    p = init(m, x)["params"]
    p["bias"] = rand(3, p["bias"].shape)
    p["scale"] = p["scale"] + rand(4, (D,), scale=0.2)

    def ours(p, x):
        y, ln = m.apply({"params": p}, x.astype(dtype))
        return y, ln

    def ref(p, x):
        ln = ref_norm(x, p["scale"], p.get("ln_bias"), layernorm_type)
        return ref_dense(ln, p["kernel"], p["bias"]), ln

    (o, ln), (ro, rln) = ours(p, x), ref(p, x)
    assert o.shape == (B, S, H, HD)
    assert_close(o, ro, TOL[dtype], "out")
    assert_close(ln, rln, TOL[dtype], "ln_out")
    _, g = fwd_and_grads(ours, p, x)
    _, rg = fwd_and_grads(ref, p, x)
    assert_tree_close(g, rg, TOL[dtype] * 2, "grad")
    # default TE convention: (out, None)
    y, none = LayerNormDenseGeneral(features=4).apply(init(LayerNormDenseGeneral(features=4), x), x)
    assert none is None and y.shape == (B, S, 4)


# ----------------------------------------------------------------------------- LayerNormMLP


@pytest.mark.parametrize("activations,use_bias,layernorm_type,dtype", [
    (("gelu",), False, "layernorm", jnp.float32),
    (("silu", "linear"), True, "rmsnorm", jnp.float32),
    # relu in fp32: in bf16, a pre-activation within rounding of 0 (some of the 768 always are) flips relu' between
    # the module and the fp32 reference, an ill-posed comparison; bf16 with biases is the gated gelu case below.
    (("relu",), True, "layernorm", jnp.float32),
    (("gelu", "linear"), True, "layernorm", jnp.bfloat16),
])
def test_layernorm_mlp(activations, use_bias, layernorm_type, dtype):
    m = LayerNormMLP(intermediate_dim=48, activations=activations, use_bias=use_bias, layernorm_type=layernorm_type,
                     intermediate_dropout_rate=0.0, dtype=dtype)
    x = rand(1, (B, S, D))
    p = init(m, x)["params"]
    assert p["wi_kernel"].shape == (D, len(activations), 48) and p["wo_kernel"].shape == (48, D)
    if use_bias:
        p["wi_bias"] = rand(5, p["wi_bias"].shape, scale=0.3)
        p["wo_bias"] = rand(6, p["wo_bias"].shape, scale=0.3)
    o, g = fwd_and_grads(lambda p, x: m.apply({"params": p}, x.astype(dtype), deterministic=True)[0], p, x)
    ro, rg = fwd_and_grads(lambda p, x: ref_mlp(p, x, activations, layernorm_type), p, x)
    assert o.dtype == dtype
    assert_close(o, ro, TOL[dtype], "out")
    assert_tree_close(g, rg, TOL[dtype] * 2, "grad")


def test_layernorm_mlp_logical_axes_and_dropout():
    m = LayerNormMLP(intermediate_dim=48, activations=("gelu", "linear"), use_bias=True, intermediate_dropout_rate=0.5)
    x = rand(1, (B, S, D))
    v = m.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    names = {k: a.names for k, a in v["params"].items()}
    assert names == {"scale": ("embed",), "ln_bias": ("embed",), "wi_kernel": ("embed", "act", "mlp"),
                     "wi_bias": ("act", "mlp"), "wo_kernel": ("mlp", "embed"), "wo_bias": ("embed",)}
    p = unbox(v)
    det = m.apply(p, x, deterministic=True)[0]
    ref = ref_mlp(p["params"], x, ("gelu", "linear"))
    assert_close(det, ref, TOL[jnp.float32], "deterministic = no dropout")
    d1 = m.apply(p, x, deterministic=False, rngs={"dropout": jax.random.key(2)})[0]
    d1b = m.apply(p, x, deterministic=False, rngs={"dropout": jax.random.key(2)})[0]
    d2 = m.apply(p, x, deterministic=False, rngs={"dropout": jax.random.key(3)})[0]
    np.testing.assert_array_equal(d1, d1b)
    assert float(jnp.max(jnp.abs(d1 - det))) > 1e-3 and float(jnp.max(jnp.abs(d1 - d2))) > 1e-3
    with pytest.raises(Exception, match="dropout"):  # no RNG stream given
        m.apply(p, x, deterministic=False)


# ----------------------------------------------------------------------------- DotProductAttention


@pytest.mark.parametrize("g,dtype", [(H, jnp.float32), (2, jnp.float32), (1, jnp.float32), (2, jnp.bfloat16)],
                         ids=["mha", "gqa", "mqa", "gqa-bf16"])
def test_dot_product_attention_vs_flax(g, dtype):
    m = DotProductAttention(head_dim=HD, num_attention_heads=H, num_gqa_groups=g, attn_mask_type="causal",
                            dtype=dtype)
    q, k, v = rand(1, (B, S, H, HD)), rand(2, (B, S, g, HD)), rand(3, (B, S, g, HD))
    ours = lambda p, q, k, v: m.apply({}, q.astype(dtype), k.astype(dtype), v.astype(dtype), deterministic=True)
    ref = lambda p, q, k, v: ref_attention(q, k, v, causal_visible(S, S))
    o, g1 = fwd_and_grads(ours, {}, q, k, v)
    ro, rg = fwd_and_grads(ref, {}, q, k, v)
    assert o.dtype == dtype
    assert_close(o, ro, TOL[dtype], "out")
    assert_tree_close(g1, rg, TOL[dtype] * 2, "grad")


def test_dot_product_attention_bshd_vs_sbhd_and_packed():
    q, k, v = rand(1, (B, S, H, HD)), rand(2, (B, S, H, HD)), rand(3, (B, S, H, HD))
    kw = dict(head_dim=HD, num_attention_heads=H, attn_mask_type="causal")
    o = DotProductAttention(**kw).apply({}, q, k, v)
    t = lambda a: jnp.swapaxes(a, 0, 1)
    o_sb = DotProductAttention(attn_input_format="sbhd", **kw).apply({}, t(q), t(k), t(v))
    assert_close(t(o_sb), o, 1e-6, "sbhd")
    o_qkv = DotProductAttention(qkv_layout="bs3hd", **kw).apply({}, jnp.stack([q, k, v], axis=2))
    assert_close(o_qkv, o, 1e-6, "bs3hd")
    o_kv = DotProductAttention(**kw).apply({}, q, jnp.stack([k, v], axis=2))  # inferred bshd_bs2hd
    assert_close(o_kv, o, 1e-6, "bs2hd")


def test_dot_product_attention_mask_bias_softcap_window():
    q, k, v = rand(1, (B, S, H, HD)), rand(2, (B, S, H, HD)), rand(3, (B, S, H, HD))
    lens = jnp.array([5, 8])
    valid = jnp.arange(S)[None] < lens[:, None]
    te_mask = ~(valid[:, None, :, None] & valid[:, None, None, :])  # TE: True = masked out
    kw = dict(head_dim=HD, num_attention_heads=H)
    o = DotProductAttention(attn_mask_type="padding", **kw).apply({}, q, k, v, te_mask)
    ro = ref_attention(q, k, v, ~te_mask)
    assert_close(o[0, :5], ro[0, :5], 2e-5, "padding mask")
    assert_close(o[1], ro[1], 2e-5, "padding mask")
    o2 = DotProductAttention(attn_mask_type="padding", **kw).apply({}, q, k, v, kv_seqlens=lens, q_seqlens=lens)
    assert_close(o2[0, :5], o[0, :5], 1e-6, "seqlens == mask")
    bias = rand(4, (1, H, S, S))
    o = DotProductAttention(attn_mask_type="no_mask", scale_factor=0.3, **kw).apply({}, q, k, v, bias=bias)
    assert_close(o, ref_attention(q, k, v, None, 0.3, bias), 2e-5, "bias + scale")
    o = DotProductAttention(attn_mask_type="no_mask", scale_factor=0.3, attn_bias_type="pre_scale_bias",
                            **kw).apply({}, q, k, v, bias=bias)
    assert_close(o, ref_attention(q, k, v, None, 0.3, 0.3 * bias), 2e-5, "pre-scale bias")
    o = DotProductAttention(attn_mask_type="causal", window_size=(2, 0), **kw).apply({}, q, k, v)
    i = jnp.arange(S)
    vis = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 2)
    assert_close(o, ref_attention(q, k, v, vis[None, None]), 2e-5, "sliding window")
    o32 = DotProductAttention(attn_mask_type="causal", float32_logits=True, dtype=jnp.bfloat16, **kw).apply(
        {}, q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    assert o32.dtype == jnp.bfloat16
    assert_close(o32, ref_attention(q, k, v, causal_visible(S, S)), 3e-2, "float32_logits")


def test_dot_product_attention_dropout():
    q, k, v = rand(1, (B, S, H, HD)), rand(2, (B, S, H, HD)), rand(3, (B, S, H, HD))
    m = DotProductAttention(head_dim=HD, num_attention_heads=H, attention_dropout=0.5)
    det = m.apply({}, q, k, v, deterministic=True)
    assert_close(det, ref_attention(q, k, v, causal_visible(S, S)), 2e-5, "deterministic")
    r = lambda s: m.apply({}, q, k, v, deterministic=False, rngs={"dropout": jax.random.key(s)})
    np.testing.assert_array_equal(r(1), r(1))
    assert float(jnp.max(jnp.abs(r(1) - det))) > 1e-3 and float(jnp.max(jnp.abs(r(1) - r(2)))) > 1e-3


# ----------------------------------------------------------------------------- MultiHeadAttention


MHA_CASES = [
    dict(num_gqa_groups=None, fuse_qkv_params=True),   # fused [embed, 3, h, d]
    dict(num_gqa_groups=None, fuse_qkv_params=False),  # separate q/k/v
    dict(num_gqa_groups=2, fuse_qkv_params=True),      # GQA: q + fused kv
    dict(num_gqa_groups=1, fuse_qkv_params=False),     # MQA
]


@pytest.mark.parametrize("case,dtype", [(c, jnp.float32) for c in MHA_CASES] + [(MHA_CASES[0], jnp.bfloat16),
                                                                              (MHA_CASES[2], jnp.bfloat16)],
                         ids=["fused", "separate", "gqa", "mqa", "fused-bf16", "gqa-bf16"])
def test_mha_vs_reference(case, dtype):
    m = MultiHeadAttention(head_dim=HD, num_attention_heads=H, attn_mask_type="causal", use_bias=True,
                           dtype=dtype, **case)
    x = rand(1, (B, S, D))
    p = init(m, x)["params"]
    p = jax.tree_util.tree_map(lambda a: a + 0.1 * rand(int(a.size) % 97, a.shape), p)  # non-zero biases
    g = case["num_gqa_groups"] or H
    o, gr = fwd_and_grads(lambda p, x: m.apply({"params": p}, x.astype(dtype), deterministic=True)[0], p, x)
    ro, rg = fwd_and_grads(lambda p, x: ref_mha(p, x, h=H, g=g, visible=causal_visible(S, S))[0], p, x)
    assert o.dtype == dtype
    assert_close(o, ro, TOL[dtype], "out")
    assert_tree_close(gr, rg, TOL[dtype] * 2, "grad")


def test_mha_parameter_names_and_axes():
    x = rand(1, (B, S, D))
    v = MultiHeadAttention(head_dim=HD, num_attention_heads=H, num_gqa_groups=2).init(jax.random.key(0), x)["params"]
    assert v["query"]["kernel"].names == ("embed", "heads", "kv")
    assert v["kv"]["kernel"].names == ("embed", "qkv", "kv_heads", "kv")
    assert v["kv"]["kernel"].value.shape == (D, 2, 2, HD)
    assert v["out"]["kernel"].names == ("heads", "kv", "embed")
    v = MultiHeadAttention(head_dim=HD, num_attention_heads=H).init(jax.random.key(0), x)["params"]
    assert v["qkv"]["kernel"].names == ("embed", "qkv", "heads", "kv")
    # scaled_query_init: the query block is initialised 1/sqrt(head_dim) smaller
    w = v["qkv"]["kernel"].value
    ratio = float(jnp.std(w[:, 0]) / jnp.std(w[:, 1]))
    assert 0.5 / math.sqrt(HD) < ratio < 2.0 / math.sqrt(HD)


@pytest.mark.parametrize("method", ["consecutive", "alternate"])
def test_mha_rope(method):
    m = MultiHeadAttention(head_dim=HD, num_attention_heads=H, num_gqa_groups=2, enable_rotary_pos_emb=True,
                           rotary_pos_emb_group_method=method, scale_attn_logits=True)
    x = rand(1, (B, S, D))
    p = init(m, x)["params"]
    o, gr = fwd_and_grads(lambda p, x: m.apply({"params": p}, x)[0], p, x)
    ro, rg = fwd_and_grads(lambda p, x: ref_mha(p, x, h=H, g=2, visible=causal_visible(S, S), scale=HD ** -0.5,
                                                rope=method)[0], p, x)
    assert_close(o, ro, 2e-5, "out")
    assert_tree_close(gr, rg, 4e-5, "grad")
    other = "alternate" if method == "consecutive" else "consecutive"
    wrong = ref_mha(p, x, h=H, g=2, visible=causal_visible(S, S), scale=HD ** -0.5, rope=other)[0]
    assert float(jnp.max(jnp.abs(wrong - o))) > 1e-3  # the two groupings differ


def test_mha_cross_attention():
    m = MultiHeadAttention(head_dim=HD, num_attention_heads=H, attn_mask_type="padding", fuse_qkv_params=True)
    x, enc = rand(1, (B, S, D)), rand(2, (B, 12, D))
    p = init(m, x, enc)["params"]
    assert "kv" in p and "query" in p
    kv_len = jnp.array([12, 7])
    vis = jnp.broadcast_to((jnp.arange(12)[None, :] < kv_len[:, None])[:, None, None, :], (B, 1, S, 12))
    o, gr = fwd_and_grads(lambda p, x, e: m.apply({"params": p}, x, e, ~vis)[0], p, x, enc)
    ro, rg = fwd_and_grads(lambda p, x, e: ref_mha(p, x, e, h=H, g=H, visible=vis)[0], p, x, enc)
    assert_close(o, ro, 2e-5, "out")
    assert_tree_close(gr, rg, 4e-5, "grad")


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_mha_decode_matches_full_forward(fmt):
    L = 8
    m = MultiHeadAttention(head_dim=HD, num_attention_heads=H, num_gqa_groups=2, attn_mask_type="causal",
                           enable_rotary_pos_emb=True, attn_input_format=fmt)
    x = rand(1, (B, L, D))
    xf = x if fmt == "bshd" else jnp.swapaxes(x, 0, 1)
    seq_axis = 1 if fmt == "bshd" else 0
    v = init(m, xf, decode=True)
    params, cache = {"params": v["params"]}, v["cache"]
    assert cache["cached_key"].shape == (B, L, 2, HD)
    full = m.apply(params, xf)[0]
    outs = []
    chunks = [(0, 3)] + [(t, t + 1) for t in range(3, L)]  # a 3-token prefill, then one token a step
    for a, b in chunks:
        step = jax.lax.slice_in_dim(xf, a, b, axis=seq_axis)
        y, mut = m.apply({**params, "cache": cache}, step, decode=True, mutable=["cache"])
        cache = mut["cache"]
        outs.append(y[0])
    np.testing.assert_array_equal(cache["cache_index"], [L] * B)  # one valid length per row
    assert_close(jnp.concatenate(outs, axis=seq_axis), full, 2e-5, "decode vs full")


# ----------------------------------------------------------------------------- RelativePositionBiases


def test_relative_position_biases():
    m = RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=H)
    v = m.init(jax.random.key(0), 6, 6)
    assert v["params"]["rel_embedding"].names == ("heads", "relpos_buckets")
    table = unbox(v)["params"]["rel_embedding"]
    out = m.apply(unbox(v), 6, 6, bidirectional=True)
    assert out.shape == (1, H, 6, 6)
    # small offsets each get an exact bucket: bucket(i, j) depends on j - i only, with distinct buckets for
    # -1, 0, +1 and the two directions in different halves.
    bk = RelativePositionBiases.buckets(6, 6, 8, 16, True)
    for i in range(6):
        for j in range(6):
            assert bk[i, j] == bk[0, j - i] if j >= i else bk[i, j] == bk[i - j, 0]
            np.testing.assert_allclose(out[0, :, i, j], table[:, bk[i, j]])
    assert len({bk[0, 0], bk[0, 1], bk[1, 0]}) == 3 and bk[0, 1] >= 4 > bk[1, 0]
    uni = RelativePositionBiases.buckets(6, 6, 8, 16, False)
    assert np.all(uni[np.triu_indices(6)] == 0)  # causal: future keys share bucket 0


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_modules():
    x = rand(1, (B, S, D))
    with pytest.raises(ValueError, match="layernorm_type"):
        LayerNorm(layernorm_type="batchnorm").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="activations"):
        LayerNormMLP(intermediate_dim=8, activations=("swish",)).init(jax.random.key(0), x)
    mha = lambda **kw: MultiHeadAttention(head_dim=HD, num_attention_heads=H, **kw)
    with pytest.raises(ValueError, match="num_gqa_groups=3"):
        mha(num_gqa_groups=3).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"\(2, 8, 4, 8\) \(rank 4\), but attn_input_format='bshd' expects a rank-3"):
        mha().init(jax.random.key(0), x.reshape(B, S, H, HD))
    with pytest.raises(ValueError, match=r"attn_input_format='thd' expects a rank-2 tensor \[tokens, hidden\]"):
        mha(attn_input_format="thd").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="attn_mask_type='diagonal'"):
        mha(attn_mask_type="diagonal").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="attn_input_format='bhsd'"):
        mha(attn_input_format="bhsd").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="rotary_pos_emb_group_method"):
        mha(enable_rotary_pos_emb=True, rotary_pos_emb_group_method="interleaved").init(jax.random.key(0), x)
    # sbhd input read as bshd: the [b, 1, sq, skv] mask no longer fits and the message says so
    xs = rand(1, (S, B, D))
    te_mask = jnp.zeros((B, 1, S, S), bool)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 1, 8, 8\); with attn_input_format='bshd'"):
        mha(attn_mask_type="padding").init(jax.random.key(0), xs, None, te_mask)
    dpa = DotProductAttention(head_dim=HD, num_attention_heads=H)
    q = rand(1, (B, S, H, HD))
    with pytest.raises(ValueError, match="rank-4"):
        dpa.apply({}, q[0], q[0], q[0])
    with pytest.raises(ValueError, match="head_dim=8 but the query"):
        dpa.apply({}, q[..., :4], q[..., :4], q[..., :4])
    with pytest.raises(ValueError, match="'sbhd' layout but attn_input_format='bshd'"):
        DotProductAttention(head_dim=HD, num_attention_heads=H, qkv_layout="sbhd_sbhd_sbhd").apply({}, q, q, q)


def _dot_output_dtypes(fn, *args):
    """Output dtypes of every dot_general in the jaxpr of fn(*args), sub-jaxprs included."""
    from jaxpr_walk import walk

    return [e.outvars[0].aval.dtype for e in walk(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("make", [
    lambda: DenseGeneral(features=(4, 8), use_bias=True, dtype=jnp.bfloat16),
    lambda: LayerNormDenseGeneral(features=24, use_bias=True, dtype=jnp.bfloat16, backend="xla"),
    lambda: LayerNormDenseGeneral(features=24, use_bias=True, dtype=jnp.bfloat16, backend="pallas"),
    lambda: LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"), use_bias=True, dtype=jnp.bfloat16,
                         intermediate_dropout_rate=0.0,
                         backend="xla"),
    lambda: LayerNormMLP(intermediate_dim=32, activations=("gelu",), use_bias=True, dtype=jnp.bfloat16,
                         intermediate_dropout_rate=0.0,
                         backend="pallas"),
])
def test_bf16_modules_run_every_gemm_in_bf16_forward_and_backward(make):
    """With a bf16 compute dtype every GEMM of the forward and of the gradient writes bf16 (fp32
    accumulation inside): an fp32-output GEMM made autodiff run the backward GEMMs in fp32, which
    cost the H100 TransformerLayer 7% (benchmarks/results/transformer_layer_profile_h100.md)."""
    m = make()
    x = jax.random.normal(jax.random.key(0), (2, 6, 16), jnp.float32).astype(jnp.bfloat16)
    params = m.init(jax.random.key(1), x)

    def loss(p, x):
        y = m.apply(p, x)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y.astype(jnp.float32) ** 2)

    dtypes = _dot_output_dtypes(jax.grad(loss, argnums=(0, 1)), params, x)
    assert dtypes and all(d == jnp.bfloat16 for d in dtypes), dtypes


@pytest.mark.parametrize("module", [
    lambda: LayerNorm(layernorm_input_axes=("batch", "embed")),
    lambda: LayerNormDenseGeneral(features=8, layernorm_input_axes=("batch", "embed")),
    lambda: LayerNormMLP(intermediate_dim=16, layernorm_input_axes=("batch", "embed")),
])
def test_layernorm_input_axes_of_the_wrong_rank_is_a_clear_error(module):
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    m = module()
    with pytest.raises(ValueError, match=r"layernorm_input_axes=\('batch', 'embed'\) names 2 axes but the input "
                                         r"has shape \(2, 3, 8\) \(rank 3\); give one logical name"):
        m.init(jax.random.key(1), x)
