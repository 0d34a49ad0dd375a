"""te_jax.flax modules against plain-Flax references written here, with the same parameters copied in.

Inits, outputs and gradients run jitted, the cases of a test (and their references) in one program
(fwd_and_grads_many, init_many): eagerly every op compiles on its own for each new shape, and a compile of such
tiny programs is mostly fixed cost. Every case is still checked on its own and a failure names it."""
import functools
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


def _first(o):
    return o[0] if isinstance(o, tuple) else o


def fwd_and_grads_many(cases, seed=99):
    """[(out, grads, full output)] for cases [(fn, params, *xs)]: out is fn's (first) output, grads the gradients of
    <out, random cotangent> w.r.t. params and the inputs; all cases in one jitted program."""
    fns, argss = [c[0] for c in cases], [tuple(c[1:]) for c in cases]
    cts = [rand(seed, _first(jax.eval_shape(fn, *a)).shape, jnp.float32) for fn, a in zip(fns, argss)]

    def run(argss, cts):
        res = []
        for fn, a, ct in zip(fns, argss, cts):
            out, vjp, full = jax.vjp(lambda *a, fn=fn: (lambda o: (_first(o), o))(fn(*a)), *a, has_aux=True)
            # = the gradient of sum(out.astype(fp32) * ct): the cotangent reaches out cast to its dtype
            res.append((out, vjp(ct.astype(out.dtype)), full))
        return res

    return jax.jit(run)(argss, cts)


def fwd_and_grads(fn, params, *xs, seed=99):
    """Output, and the gradients of <out, random cotangent> w.r.t. params and the inputs (one compile)."""
    return fwd_and_grads_many([(fn, params, *xs)], seed)[0][:2]


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


def init_many(cases):
    """Unboxed variables of module.init(*args, **kwargs) for cases [(module, args, kwargs)], in one jitted program."""
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    fn = jax.jit(lambda rngs, argss: [m.init(rngs, *a, **kw) for (m, _, kw), a in zip(cases, argss)])
    return [unbox(v) for v in fn(rngs, [tuple(c[1]) for c in cases])]


def init(module, *args, **kwargs):
    return init_many([(module, args, kwargs)])[0]


# ----------------------------------------------------------------------------- LayerNorm


LN_CASES = [(lt, zc, dtype) for lt in ("layernorm", "rmsnorm") for zc in (False, True)
            for dtype in (jnp.float32, jnp.bfloat16)]


def test_layernorm():
    """LayerNorm / RMSNorm, zero-centred gamma or not, fp32 / bf16 (LN_CASES, one compile)."""
    x = rand(1, (B, S, D), scale=2.0) + 0.5
    mods = [LayerNorm(layernorm_type=lt, zero_centered_gamma=zc, dtype=dtype) for lt, zc, dtype in LN_CASES]
    cases = []
    for (lt, zc, dtype), m, v in zip(LN_CASES, mods, init_many([(m, (x,), {}) for m in mods])):
        p = jax.tree_util.tree_map(lambda a: a + rand(7, a.shape, scale=0.3), v["params"])  # non-trivial params
        assert set(p) == ({"scale", "ln_bias"} if lt == "layernorm" else {"scale"})
        ours = functools.partial(lambda p, x, m, dtype: m.apply({"params": p}, x.astype(dtype)), m=m, dtype=dtype)
        ref = functools.partial(lambda p, x, lt, zc: ref_norm(x, p["scale"], p.get("ln_bias"), lt, 1e-6, zc),
                                lt=lt, zc=zc)
        cases += [(ours, p, x), (ref, p, x)]
    res = fwd_and_grads_many(cases)
    for i, (lt, zc, dtype) in enumerate(LN_CASES):
        (o, g, _), (ro, rg, _) = res[2 * i], res[2 * i + 1]
        name = f"{lt} zc={zc} {jnp.dtype(dtype).name}"
        assert o.dtype == dtype, name
        assert_close(o, ro, TOL[dtype], f"{name} out")
        assert_tree_close(g, rg, TOL[dtype] * 2, f"{name} grad")


# ----------------------------------------------------------------------------- DenseGeneral


def test_dense_general_multi_axis():
    """fp32 and bf16 (one compile)."""
    x = rand(1, (B, S, H, HD))
    cases = []
    for dtype in (jnp.float32, jnp.bfloat16):
        m = DenseGeneral(features=(3, 5), axis=(-2, -1), use_bias=True, kernel_axes=("heads", "kv", "qkv", "embed"),
                         bias_axes=("qkv", "embed"), dtype=dtype)
        v = jax.jit(m.init)(jax.random.key(0), x)
        assert isinstance(v["params"]["kernel"], nn.LogicallyPartitioned)
        assert v["params"]["kernel"].names == ("heads", "kv", "qkv", "embed")
        p = unbox(v)["params"]
        p["bias"] = rand(3, p["bias"].shape)
        assert p["kernel"].shape == (H, HD, 3, 5)
        cases += [(functools.partial(lambda p, x, m, dtype: m.apply({"params": p}, x.astype(dtype)), m=m, dtype=dtype),
                   p, x),
                  (lambda p, x: ref_dense(x, p["kernel"], p["bias"], 2), p, x)]
    res = fwd_and_grads_many(cases)
    for i, dtype in enumerate((jnp.float32, jnp.bfloat16)):
        (o, g, _), (ro, rg, _) = res[2 * i], res[2 * i + 1]
        name = jnp.dtype(dtype).name
        assert o.shape == (B, S, 3, 5) and o.dtype == dtype, name
        assert_close(o, ro, TOL[dtype], f"{name} out")
        assert_tree_close(g, rg, TOL[dtype] * 2, f"{name} grad")


# ----------------------------------------------------------------------------- LayerNormDenseGeneral


def test_layernorm_dense_general():
    """LayerNorm in fp32, RMSNorm in bf16 (one compile)."""
    x = rand(1, (B, S, D)) + 0.3
    configs = [("layernorm", jnp.float32), ("rmsnorm", jnp.bfloat16)]
    mods = [LayerNormDenseGeneral(features=(H, HD), layernorm_type=lt, use_bias=True, return_layernorm_output=True,
                                  dtype=dtype) for lt, dtype in configs]
    cases = []
    for (layernorm_type, dtype), m, v in zip(configs, mods, init_many([(m, (x,), {}) for m in mods])):
        p = v["params"]
        p["bias"] = rand(3, p["bias"].shape)
        p["scale"] = p["scale"] + rand(4, (D,), scale=0.2)

        def ours(p, x, m=m, dtype=dtype):
            y, ln = m.apply({"params": p}, x.astype(dtype))
            return y, ln

        def ref(p, x, layernorm_type=layernorm_type):
            ln = ref_norm(x, p["scale"], p.get("ln_bias"), layernorm_type)
            return ref_dense(ln, p["kernel"], p["bias"]), ln

        cases += [(ours, p, x), (ref, p, x)]
    res = fwd_and_grads_many(cases)  # out = y; the full output (y, ln) comes third
    for i, (layernorm_type, dtype) in enumerate(configs):
        (_, g, (o, ln)), (_, rg, (ro, rln)) = res[2 * i], res[2 * i + 1]
        assert o.shape == (B, S, H, HD)
        assert_close(o, ro, TOL[dtype], f"{layernorm_type} out")
        assert_close(ln, rln, TOL[dtype], f"{layernorm_type} ln_out")
        assert_tree_close(g, rg, TOL[dtype] * 2, f"{layernorm_type} grad")
    # default TE convention: (out, None)
    y, none = jax.jit(LayerNormDenseGeneral(features=4).apply)(init(LayerNormDenseGeneral(features=4), x), x)
    assert none is None and y.shape == (B, S, 4)


# ----------------------------------------------------------------------------- LayerNormMLP


MLP_CASES = [  # activations, use_bias, layernorm_type, dtype
    (("gelu",), False, "layernorm", jnp.float32),
    (("silu", "linear"), True, "rmsnorm", jnp.float32),
    # relu in fp32: in bf16, a pre-activation within rounding of 0 (some of the 768 always are) flips relu' between
    # the module and the fp32 reference, an ill-posed comparison; bf16 with biases is the gated gelu case below.
    (("relu",), True, "layernorm", jnp.float32),
    (("gelu", "linear"), True, "layernorm", jnp.bfloat16),
]


def test_layernorm_mlp():
    """MLP_CASES in one compile, each checked against ref_mlp."""
    x = rand(1, (B, S, D))
    mods = [LayerNormMLP(intermediate_dim=48, activations=activations, use_bias=use_bias, layernorm_type=layernorm_type,
                         intermediate_dropout_rate=0.0, dtype=dtype)
            for activations, use_bias, layernorm_type, dtype in MLP_CASES]
    cases = []
    for (activations, use_bias, layernorm_type, dtype), m, v in zip(MLP_CASES, mods,
                                                                    init_many([(m, (x,), {}) for m in mods])):
        p = v["params"]
        assert p["wi_kernel"].shape == (D, len(activations), 48) and p["wo_kernel"].shape == (48, D)
        if use_bias:
            p["wi_bias"] = rand(5, p["wi_bias"].shape, scale=0.3)
            p["wo_bias"] = rand(6, p["wo_bias"].shape, scale=0.3)
        ours = functools.partial(lambda p, x, m, dtype: m.apply({"params": p}, x.astype(dtype), deterministic=True)[0],
                                 m=m, dtype=dtype)
        ref = functools.partial(lambda p, x, a, lt: ref_mlp(p, x, a, lt), a=activations, lt=layernorm_type)
        cases += [(ours, p, x), (ref, p, x)]
    res = fwd_and_grads_many(cases)
    for i, (activations, use_bias, layernorm_type, dtype) in enumerate(MLP_CASES):
        (o, g, _), (ro, rg, _) = res[2 * i], res[2 * i + 1]
        name = f"{'-'.join(activations)} bias={use_bias} {layernorm_type} {jnp.dtype(dtype).name}"
        assert o.dtype == dtype, name
        assert_close(o, ro, TOL[dtype], f"{name} out")
        assert_tree_close(g, rg, TOL[dtype] * 2, f"{name} grad")


def test_layernorm_mlp_logical_axes_and_dropout():
    m = LayerNormMLP(intermediate_dim=48, activations=("gelu", "linear"), use_bias=True, intermediate_dropout_rate=0.5)
    x = rand(1, (B, S, D))
    v = jax.jit(m.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    names = {k: a.names for k, a in v["params"].items()}
    assert names == {"scale": ("embed",), "ln_bias": ("embed",), "wi_kernel": ("embed", "act", "mlp"),
                     "wi_bias": ("act", "mlp"), "wo_kernel": ("mlp", "embed"), "wo_bias": ("embed",)}
    p = unbox(v)
    det, ref = jax.jit(lambda p, x: (m.apply(p, x, deterministic=True)[0], ref_mlp(p["params"], x, ("gelu", "linear"))))(
        p, x)
    assert_close(det, ref, TOL[jnp.float32], "deterministic = no dropout")
    dropped = jax.jit(lambda p, x, key: m.apply(p, x, deterministic=False, rngs={"dropout": key})[0])
    d1 = dropped(p, x, jax.random.key(2))
    d1b = dropped(p, x, jax.random.key(2))
    d2 = dropped(p, x, jax.random.key(3))
    np.testing.assert_array_equal(d1, d1b)
    assert float(jnp.max(jnp.abs(d1 - det))) > 1e-3 and float(jnp.max(jnp.abs(d1 - d2))) > 1e-3
    with pytest.raises(Exception, match="dropout"):  # no RNG stream given
        m.apply(p, x, deterministic=False)


# ----------------------------------------------------------------------------- DotProductAttention


def test_dot_product_attention_vs_flax():
    """MHA, GQA, MQA in fp32 and GQA in bf16 (one compile), causal."""
    configs = [("mha", H, jnp.float32), ("gqa", 2, jnp.float32), ("mqa", 1, jnp.float32), ("gqa-bf16", 2, jnp.bfloat16)]
    cases = []
    for _, g, dtype in configs:
        m = DotProductAttention(head_dim=HD, num_attention_heads=H, num_gqa_groups=g, attn_mask_type="causal",
                                dtype=dtype)
        q, k, v = rand(1, (B, S, H, HD)), rand(2, (B, S, g, HD)), rand(3, (B, S, g, HD))
        ours = functools.partial(lambda p, q, k, v, m, dtype: m.apply(
            {}, q.astype(dtype), k.astype(dtype), v.astype(dtype), deterministic=True), m=m, dtype=dtype)
        ref = lambda p, q, k, v: ref_attention(q, k, v, causal_visible(S, S))
        cases += [(ours, {}, q, k, v), (ref, {}, q, k, v)]
    res = fwd_and_grads_many(cases)
    for i, (name, _, dtype) in enumerate(configs):
        (o, g1, _), (ro, rg, _) = res[2 * i], res[2 * i + 1]
        assert o.dtype == dtype, name
        assert_close(o, ro, TOL[dtype], f"{name} out")
        assert_tree_close(g1, rg, TOL[dtype] * 2, f"{name} grad")


def test_dot_product_attention_bshd_vs_sbhd_and_packed():
    q, k, v = rand(1, (B, S, H, HD)), rand(2, (B, S, H, HD)), rand(3, (B, S, H, HD))
    kw = dict(head_dim=HD, num_attention_heads=H, attn_mask_type="causal")
    t = lambda a: jnp.swapaxes(a, 0, 1)

    @jax.jit  # one compile for the four layouts
    def run(q, k, v):
        return (DotProductAttention(**kw).apply({}, q, k, v),
                DotProductAttention(attn_input_format="sbhd", **kw).apply({}, t(q), t(k), t(v)),
                DotProductAttention(qkv_layout="bs3hd", **kw).apply({}, jnp.stack([q, k, v], axis=2)),
                DotProductAttention(**kw).apply({}, q, jnp.stack([k, v], axis=2)))  # inferred bshd_bs2hd

    o, o_sb, o_qkv, o_kv = run(q, k, v)
    assert_close(t(o_sb), o, 1e-6, "sbhd")
    assert_close(o_qkv, o, 1e-6, "bs3hd")
    assert_close(o_kv, o, 1e-6, "bs2hd")


def test_dot_product_attention_mask_bias_softcap_window():
    q, k, v = rand(1, (B, S, H, HD)), rand(2, (B, S, H, HD)), rand(3, (B, S, H, HD))
    lens = jnp.array([5, 8])
    valid = jnp.arange(S)[None] < lens[:, None]
    te_mask = ~(valid[:, None, :, None] & valid[:, None, None, :])  # TE: True = masked out
    kw = dict(head_dim=HD, num_attention_heads=H)
    bias = rand(4, (1, H, S, S))
    i = jnp.arange(S)
    vis = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 2)

    @jax.jit  # one compile for every variant and its reference
    def run(q, k, v, te_mask, lens, bias):
        bf = lambda a: a.astype(jnp.bfloat16)
        return dict(
            pad=DotProductAttention(attn_mask_type="padding", **kw).apply({}, q, k, v, te_mask),
            pad_ref=ref_attention(q, k, v, ~te_mask),
            seqlens=DotProductAttention(attn_mask_type="padding", **kw).apply({}, q, k, v, kv_seqlens=lens,
                                                                              q_seqlens=lens),
            bias=DotProductAttention(attn_mask_type="no_mask", scale_factor=0.3, **kw).apply({}, q, k, v, bias=bias),
            bias_ref=ref_attention(q, k, v, None, 0.3, bias),
            pre=DotProductAttention(attn_mask_type="no_mask", scale_factor=0.3, attn_bias_type="pre_scale_bias",
                                    **kw).apply({}, q, k, v, bias=bias),
            pre_ref=ref_attention(q, k, v, None, 0.3, 0.3 * bias),
            window=DotProductAttention(attn_mask_type="causal", window_size=(2, 0), **kw).apply({}, q, k, v),
            window_ref=ref_attention(q, k, v, vis[None, None]),
            f32_logits=DotProductAttention(attn_mask_type="causal", float32_logits=True, dtype=jnp.bfloat16,
                                           **kw).apply({}, bf(q), bf(k), bf(v)),
            causal_ref=ref_attention(q, k, v, causal_visible(S, S)))

    r = run(q, k, v, te_mask, lens, bias)
    assert_close(r["pad"][0, :5], r["pad_ref"][0, :5], 2e-5, "padding mask")
    assert_close(r["pad"][1], r["pad_ref"][1], 2e-5, "padding mask")
    assert_close(r["seqlens"][0, :5], r["pad"][0, :5], 1e-6, "seqlens == mask")
    assert_close(r["bias"], r["bias_ref"], 2e-5, "bias + scale")
    assert_close(r["pre"], r["pre_ref"], 2e-5, "pre-scale bias")
    assert_close(r["window"], r["window_ref"], 2e-5, "sliding window")
    assert r["f32_logits"].dtype == jnp.bfloat16
    assert_close(r["f32_logits"], r["causal_ref"], 3e-2, "float32_logits")


def test_dot_product_attention_dropout():
    q, k, v = rand(1, (B, S, H, HD)), rand(2, (B, S, H, HD)), rand(3, (B, S, H, HD))
    m = DotProductAttention(head_dim=HD, num_attention_heads=H, attention_dropout=0.5)
    det, ref = jax.jit(lambda q, k, v: (m.apply({}, q, k, v, deterministic=True),
                                        ref_attention(q, k, v, causal_visible(S, S))))(q, k, v)
    assert_close(det, ref, 2e-5, "deterministic")
    dropped = jax.jit(lambda q, k, v, key: m.apply({}, q, k, v, deterministic=False, rngs={"dropout": key}))
    r = lambda s: dropped(q, k, v, jax.random.key(s))
    np.testing.assert_array_equal(r(1), r(1))
    assert float(jnp.max(jnp.abs(r(1) - det))) > 1e-3 and float(jnp.max(jnp.abs(r(1) - r(2)))) > 1e-3


# ----------------------------------------------------------------------------- MultiHeadAttention


MHA_CASES = [
    dict(num_gqa_groups=None, fuse_qkv_params=True),   # fused [embed, 3, h, d]
    dict(num_gqa_groups=None, fuse_qkv_params=False),  # separate q/k/v
    dict(num_gqa_groups=2, fuse_qkv_params=True),      # GQA: q + fused kv
    dict(num_gqa_groups=1, fuse_qkv_params=False),     # MQA
]


def test_mha_vs_reference():
    """Fused, separate, GQA, MQA projections in fp32, fused and GQA in bf16 (one compile, each checked)."""
    configs = [("fused", MHA_CASES[0], jnp.float32), ("separate", MHA_CASES[1], jnp.float32),
               ("gqa", MHA_CASES[2], jnp.float32), ("mqa", MHA_CASES[3], jnp.float32),
               ("fused-bf16", MHA_CASES[0], jnp.bfloat16), ("gqa-bf16", MHA_CASES[2], jnp.bfloat16)]
    x = rand(1, (B, S, D))
    mods = [MultiHeadAttention(head_dim=HD, num_attention_heads=H, attn_mask_type="causal", use_bias=True,
                               dtype=dtype, **case) for _, case, dtype in configs]
    cases = []
    for (_, case, dtype), m, v in zip(configs, mods, init_many([(m, (x,), {}) for m in mods])):
        p = jax.tree_util.tree_map(lambda a: a + 0.1 * rand(int(a.size) % 97, a.shape), v["params"])  # non-zero biases
        g = case["num_gqa_groups"] or H
        ours = functools.partial(lambda p, x, m, dtype: m.apply({"params": p}, x.astype(dtype), deterministic=True)[0],
                                 m=m, dtype=dtype)
        ref = functools.partial(lambda p, x, g: ref_mha(p, x, h=H, g=g, visible=causal_visible(S, S))[0], g=g)
        cases += [(ours, p, x), (ref, p, x)]
    res = fwd_and_grads_many(cases)
    for i, (name, _, dtype) in enumerate(configs):
        (o, gr, _), (ro, rg, _) = res[2 * i], res[2 * i + 1]
        assert o.dtype == dtype, name
        assert_close(o, ro, TOL[dtype], f"{name} out")
        assert_tree_close(gr, rg, TOL[dtype] * 2, f"{name} grad")


def test_mha_parameter_names_and_axes():
    x = rand(1, (B, S, D))
    v = jax.jit(MultiHeadAttention(head_dim=HD, num_attention_heads=H, num_gqa_groups=2).init)(jax.random.key(0),
                                                                                              x)["params"]
    assert v["query"]["kernel"].names == ("embed", "heads", "kv")
    assert v["kv"]["kernel"].names == ("embed", "qkv", "kv_heads", "kv")
    assert v["kv"]["kernel"].value.shape == (D, 2, 2, HD)
    assert v["out"]["kernel"].names == ("heads", "kv", "embed")
    v = jax.jit(MultiHeadAttention(head_dim=HD, num_attention_heads=H).init)(jax.random.key(0), x)["params"]
    assert v["qkv"]["kernel"].names == ("embed", "qkv", "heads", "kv")
    # scaled_query_init: the query block is initialised 1/sqrt(head_dim) smaller
    w = v["qkv"]["kernel"].value
    ratio = float(jnp.std(w[:, 0]) / jnp.std(w[:, 1]))
    assert 0.5 / math.sqrt(HD) < ratio < 2.0 / math.sqrt(HD)


def test_mha_rope():
    """Both RoPE groupings (one compile), each against the reference, and unlike the other grouping."""
    methods = ("consecutive", "alternate")
    x = rand(1, (B, S, D))
    mods = [MultiHeadAttention(head_dim=HD, num_attention_heads=H, num_gqa_groups=2, enable_rotary_pos_emb=True,
                               rotary_pos_emb_group_method=method, scale_attn_logits=True) for method in methods]
    ref = lambda p, x, rope: ref_mha(p, x, h=H, g=2, visible=causal_visible(S, S), scale=HD ** -0.5, rope=rope)[0]
    cases = []
    for method, m, v in zip(methods, mods, init_many([(m, (x,), {}) for m in mods])):
        other = "alternate" if method == "consecutive" else "consecutive"
        p = v["params"]
        cases += [(functools.partial(lambda p, x, m: m.apply({"params": p}, x)[0], m=m), p, x),
                  (functools.partial(ref, rope=method), p, x), (functools.partial(ref, rope=other), p, x)]
    res = fwd_and_grads_many(cases)
    for i, method in enumerate(methods):
        (o, gr, _), (ro, rg, _), (wrong, _, _) = res[3 * i:3 * i + 3]
        assert_close(o, ro, 2e-5, f"{method} out")
        assert_tree_close(gr, rg, 4e-5, f"{method} grad")
        assert float(jnp.max(jnp.abs(wrong - o))) > 1e-3, method  # the two groupings differ


def test_mha_cross_attention():
    m = MultiHeadAttention(head_dim=HD, num_attention_heads=H, attn_mask_type="padding", fuse_qkv_params=True)
    x, enc = rand(1, (B, S, D)), rand(2, (B, 12, D))
    p = init(m, x, enc)["params"]
    assert "kv" in p and "query" in p
    kv_len = jnp.array([12, 7])
    vis = jnp.broadcast_to((jnp.arange(12)[None, :] < kv_len[:, None])[:, None, None, :], (B, 1, S, 12))
    (o, gr, _), (ro, rg, _) = fwd_and_grads_many([(lambda p, x, e: m.apply({"params": p}, x, e, ~vis)[0], p, x, enc),
                                                  (lambda p, x, e: ref_mha(p, x, e, h=H, g=H, visible=vis)[0], p, x,
                                                   enc)])
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
    full = jax.jit(lambda p, x: m.apply(p, x)[0])(params, xf)
    outs = []
    chunks = [(0, 3)] + [(t, t + 1) for t in range(3, L)]  # a 3-token prefill, then one token a step
    decode = jax.jit(lambda v, x: m.apply(v, x, decode=True, mutable=["cache"]))  # compiles for 3 tokens and for 1
    for a, b in chunks:
        step = jax.lax.slice_in_dim(xf, a, b, axis=seq_axis)
        y, mut = decode({**params, "cache": cache}, step)
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
    x = jax.ShapeDtypeStruct((2, 6, 16), jnp.bfloat16)  # a jaxpr needs shapes only: nothing is compiled
    params = jax.eval_shape(m.init, jax.random.key(1), x)

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
