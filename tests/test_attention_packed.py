"""Packed q/k/v (bs3hd, bsh3d, bs(h+2g)d, bshd_bs2hd, bshd_bsh2d, thd forms) through
te_jax.dot_product_attention_packed and the kernel's flash_attention_packed (interpret mode on the CPU).

- in place: the Pallas kernels get the packed tensor itself (a reshaped view) as q, k and v; the jaxpr
  is inspected to prove that no slice / gather / pad of the packed tensor happens before them;
- split (fallback): padding needed, or another backend / the sbhd format: q, k, v are sliced first;
- forward and gradients (in the packed shape) against the naive fp32 attention on the sliced tensors;
- bad packed shapes raise ValueError naming the argument, the shape seen and the shape expected.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import rand
from jaxpr_walk import walk, walk_resolved
from naive_attention import naive_attention, naive_mask
from tolerance import rel_err
from pallas_kernels.flash_attention import AttentionMask, flash_attention_packed, packed_in_place_reason
from pallas_kernels.flash_attention.kernel import _Packed

B, H, D = 2, 4, 16
TOL = {jnp.float32: (2e-5, 1e-4), jnp.bfloat16: (2e-2, 4e-2)}  # (out, grads), relative to max |ref|
SLICING = {"slice", "dynamic_slice", "gather", "pad", "transpose", "copy", "copy_p", "squeeze"}


def packed_shape(layout, b, s, h, g, d):
    """Shape of the packed tensor of a te_jax layout (thd: no batch axis)."""
    kernel = {"t3hd": "bs3hd", "th3d": "bsh3d", "t(h+2g)d": "bs(h+2g)d", "thd_t2hd": "bshd_bs2hd",
              "sb3hd": "bs3hd", "sbhd_sb2hd": "bshd_bs2hd"}.get(layout, layout)
    shape = _Packed(kernel, h, g).expected_shape(b, s, d)
    if layout.startswith("t"):
        return shape[1:]
    if layout.startswith("sb"):
        return (s, b) + shape[2:]
    return shape


def make_qkv(layout, h, g, s, dtype, sq=None, seed=0):
    """The tensors a layout stores: (packed,) or (q, kv), random normal (numpy-drawn: no per-shape compile)."""
    rng = np.random.default_rng(seed)
    packed = rand(rng, packed_shape(layout, B, s, h, g, D), dtype)
    if "_" not in layout:  # qkv or gqa packed
        return (packed,)
    qshape = (B, sq or s, h, D) if layout.startswith("bs") else (sq or s, h, D)
    return rand(rng, qshape, dtype), packed


def reference(tensors, layout, h, g, mask, fmt):
    q, k, v = te_jax.unpack_qkv(*tensors, qkv_layout=layout, num_attention_heads=h, num_gqa_groups=g)
    q, k, v = (te_jax.to_bshd(t, fmt) for t in (q, k, v))
    return naive_attention(q, k, v, mask)


# ----------------------------------------------------------------------------- jaxpr inspection


def pallas_operands(jaxpr):
    """{kernel name: [(q, k, v) operand vars]} of every pallas_call (operands 1..3 follow the block bounds)."""
    out = {}
    for eqn, origin in walk_resolved(jaxpr):  # through nested jits: the kernels are lowered once (jit)
        if eqn.primitive.name == "pallas_call":
            name = str(getattr(eqn.params.get("name_and_src_info"), "name", eqn.params.get("name")))
            out.setdefault(name, []).append(tuple(origin(v) for v in eqn.invars[1:4]))
    return out


def slices_of_size(jaxpr, size):
    """Slicing-like equations (slice, gather, pad, transpose, ...) reading an array of `size` elements."""
    return [e.primitive.name for e in walk(jaxpr) if e.primitive.name in SLICING
            and any(hasattr(v, "aval") and getattr(v.aval, "size", None) == size for v in e.invars)]


# ----------------------------------------------------------------------------- in place vs reference

CASES = [
    # (layout, h, g, s, sq (kv-packed q length), mask_type, dtype)
    ("bs3hd", 4, 4, 32, None, "causal", jnp.float32),
    ("bs3hd", 4, 4, 32, None, "padding_causal", jnp.bfloat16),
    ("bs(h+2g)d", 4, 2, 32, None, "causal", jnp.bfloat16),
    ("bs(h+2g)d", 4, 1, 16, None, "padding", jnp.float32),
    ("bshd_bs2hd", 4, 2, 32, 24, "padding_causal_bottom_right", jnp.float32),
    ("bshd_bs2hd", 4, 1, 16, None, "causal", jnp.bfloat16),
    # the interleaved forms (head strides 3 / 2 in the index maps): long run only, the CI suite checks
    # their jaxpr (test_in_place_path_makes_no_slice) and forward
    # (test_interleaved_forms_forward_equal_split)
    pytest.param(("bsh3d", 2, 2, 16, None, "padding_causal", jnp.float32), marks=pytest.mark.slow),
    pytest.param(("bshd_bsh2d", 4, 2, 16, None, "padding", jnp.bfloat16), marks=pytest.mark.slow),
    ("t3hd", 2, 2, 32, None, "padding_causal", jnp.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}g{c[2]}-s{c[3]}-{c[5]}-{jnp.dtype(c[6]).name}")
def test_packed_in_place_matches_reference(case):
    layout, h, g, s, sq, mask_type, dtype = case
    fmt = te_jax.QKV_LAYOUTS[layout].attn_input_format
    tensors = make_qkv(layout, h, g, s, dtype, sq=sq, seed=hash(case) % 997)
    sq = sq or s
    b = 1 if fmt == "thd" else B
    kw, q_lens, kv_lens, seg = {}, None, None, None
    if fmt == "thd":  # two packed sequences per row of tokens, the last 3 tokens padding
        lens = np.array([s // 2 - 2, s // 2 - 1])
        kw = dict(q_seqlens=jnp.asarray(lens, jnp.int32), kv_seqlens=jnp.asarray(lens, jnp.int32))
        seg = np.zeros((1, s), np.int32)
        seg[0, :lens[0]], seg[0, lens[0]:lens.sum()] = 1, 2
    elif mask_type.startswith("padding"):
        q_lens, kv_lens = np.array([sq, sq - 5]), np.array([s, s - 3])
        kw = dict(q_seqlens=jnp.asarray(q_lens, jnp.int32), kv_seqlens=jnp.asarray(kv_lens, jnp.int32))
    mask = naive_mask(b, sq, s, mask_type, q_lens, kv_lens, q_seg=seg, kv_seg=seg)
    args = dict(qkv_layout=layout, num_attention_heads=h, num_gqa_groups=g, attn_mask_type=mask_type, **kw)

    choice = te_jax.explain_attention_backend_packed(tuple(tensors), backend="pallas", **args)
    assert choice.packed.startswith("read in place"), choice.packed

    def te(*t):
        return te_jax.dot_product_attention_packed(t, backend="pallas", **args)

    def ref(*t):
        out = reference(t, layout, h, g, mask, fmt)
        return out[0] if fmt == "thd" else out

    ct = rand(5, (b, sq, h, D) if fmt != "thd" else (sq, h, D))
    argnums = tuple(range(len(tensors)))

    @jax.jit
    def te_all(*t):  # one compile for the output and the gradients, the reference's too
        out, vjp = jax.vjp(te, *t)
        rgrads = jax.grad(lambda *a: jnp.sum(ref(*a) * ct), argnums=argnums)(*t)
        return out, vjp(ct.astype(out.dtype)), ref(*t), rgrads

    out, grads, rout, rgrads = te_all(*tensors)
    tol_o, tol_g = TOL[dtype]
    assert out.dtype == dtype and out.shape == rout.shape
    assert rel_err(out, rout) < tol_o, rel_err(out, rout)
    for a, r, t in zip(grads, rgrads, tensors):
        assert a.shape == t.shape and a.dtype == t.dtype  # gradient in the packed shape
        assert rel_err(a, r) < tol_g, rel_err(a, r)


# ----------------------------------------------------------------------------- no copy on the in-place path


@pytest.mark.parametrize("layout,h,g", [("bs3hd", 4, 4), ("bs(h+2g)d", 4, 1), ("bshd_bs2hd", 4, 1),
                                        ("bsh3d", 2, 2)])
def test_in_place_path_makes_no_slice(layout, h, g):
    """Forward and backward jaxprs: every Pallas kernel's q/k/v operands are the packed tensor (one var,
    reshaped to [b, s, heads, d]), and nothing slices, gathers, pads or transposes the packed tensor."""
    tensors = make_qkv(layout, h, g, 32, jnp.float32)
    packed = tensors[-1]
    loss = lambda *t: jnp.sum(te_jax.dot_product_attention_packed(
        t, qkv_layout=layout, num_attention_heads=h, num_gqa_groups=g, attn_mask_type="causal",
        backend="pallas"))
    for fn in (loss, jax.grad(loss, argnums=tuple(range(len(tensors))))):
        jaxpr = jax.make_jaxpr(fn)(*tensors).jaxpr
        ops = pallas_operands(jaxpr)
        kernels = {"te_flash_attention_fwd"} | ({"te_flash_attention_dkdv", "te_flash_attention_dq"}
                                                if fn is not loss else set())
        assert kernels <= set(ops), ops.keys()
        for name in kernels:
            for q, k, v in ops[name]:
                assert k is v, name  # one operand for k and v ...
                assert k.aval.shape == (B, 32, packed.size // (B * 32 * D), D), (name, k.aval.shape)
                if len(tensors) == 1:
                    assert q is k, name  # ... and for q too when q is packed with them
        assert slices_of_size(jaxpr, packed.size) == []


def test_split_path_slices_and_matches():
    """The fallback (sequence 24: the kernel would pad to 32) slices q, k, v out, says so, and is correct."""
    h, g, s = 4, 2, 24
    (packed,) = make_qkv("bs(h+2g)d", h, g, s, jnp.float32, seed=3)
    args = dict(qkv_layout="bs(h+2g)d", num_attention_heads=h, num_gqa_groups=g, attn_mask_type="causal")
    why = te_jax.explain_attention_backend_packed(packed, backend="pallas", **args).packed
    assert why.startswith("split") and "sequence length 24" in why and "padded to 32" in why, why
    assert "sequence length 24" in packed_in_place_reason(packed, layout="bs(h+2g)d", num_heads=h, num_kv_heads=g)
    f = lambda x: te_jax.dot_product_attention_packed(x, backend="pallas", **args)
    jaxpr = jax.make_jaxpr(f)(packed).jaxpr
    assert slices_of_size(jaxpr, packed.size)  # the positive control of the no-slice check
    (q, k, v), = pallas_operands(jaxpr)["te_flash_attention_fwd"]
    assert q is not k and k is not v
    mask = naive_mask(B, s, s, "causal")
    ref = lambda x: reference((x,), "bs(h+2g)d", h, g, mask, "bshd")
    ct = rand(1, (B, s, h, D))
    out, grad, rout, rgrad = jax.jit(lambda x: (lambda o, vjp: (o, vjp(ct)[0]))(*jax.vjp(f, x))
                                     + (ref(x), jax.grad(lambda y: jnp.sum(ref(y) * ct))(x)))(packed)
    assert rel_err(out, rout) < 2e-5
    assert grad.shape == packed.shape
    assert rel_err(grad, rgrad) < 1e-4


def test_head_dim_padding_falls_back_in_kernel():
    """Kernel entry alone: head_dim 24 (padded to 32) takes the split path, same numbers as slicing."""
    pk = _Packed("bs3hd", 2, 2)
    x = rand(0, pk.expected_shape(1, 16, 24))
    why = packed_in_place_reason(x, layout="bs3hd", num_heads=2)
    assert "head_dim 24" in why and "padded to 32" in why
    am = AttentionMask.full(1, 16, 16, causal=True)
    kw = dict(scale=0.2, interpret=True)
    from pallas_kernels.flash_attention import flash_attention
    (out, lse), (rout, rlse) = jax.jit(lambda x: (  # both in one compile
        flash_attention_packed(x, am, layout="bs3hd", num_heads=2, **kw),
        flash_attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], am, **kw)))(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(rout))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(rlse))


def test_interleaved_forms_forward_equal_split():
    """bsh3d / bshd_bsh2d (head stride 3 / 2 in the index maps), forward: the same numbers as slicing."""
    from pallas_kernels.flash_attention import flash_attention
    am = AttentionMask.full(1, 16, 16, causal=True)
    kw = dict(scale=0.25, interpret=True)
    x = rand(0, (1, 16, 2, 3, D))
    assert packed_in_place_reason(x, layout="bsh3d", num_heads=2) is None
    q = rand(1, (1, 16, 4, D))
    kv = rand(2, (1, 16, 2, 2, D))

    @jax.jit  # the four kernels in one compile
    def run(x, q, kv):
        return (flash_attention_packed(x, am, layout="bsh3d", num_heads=2, **kw)[0],
                flash_attention(x[..., 0, :], x[..., 1, :], x[..., 2, :], am, **kw)[0],
                flash_attention_packed((q, kv), am, layout="bshd_bsh2d", num_heads=4, num_kv_heads=2, **kw)[0],
                flash_attention(q, kv[..., 0, :], kv[..., 1, :], am, **kw)[0])

    out, rout, out2, rout2 = run(x, q, kv)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(rout))
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(rout2))


def test_other_backends_and_sbhd_split_and_say_why():
    (x,) = make_qkv("bs3hd", 2, 2, 16, jnp.float32)
    auto = te_jax.explain_attention_backend_packed(x, qkv_layout="bs3hd")
    if jax.default_backend() == "cpu":  # xla comes first off-GPU
        assert auto.selected == "xla" and auto.packed.startswith("split") and "'xla' backend" in auto.packed
        assert "packed input: split" in str(auto)
    else:  # on a GPU the choice varies with the chip; the packed note is there either way
        assert auto.packed.startswith(("split", "read in place")) and "packed input:" in str(auto)
    sb = jnp.swapaxes(x, 0, 1)  # [s, b, 3, h, d]
    why = te_jax.explain_attention_backend_packed(sb, qkv_layout="sb3hd", backend="pallas").packed
    assert why.startswith("split") and "sbhd" in why and "transposed" in why, why
    mask = naive_mask(B, 16, 16, "causal")
    out, out_x, ref = jax.jit(lambda x, sb: (  # one compile
        te_jax.dot_product_attention_packed(sb, qkv_layout="sb3hd", attn_mask_type="causal", backend="pallas"),
        te_jax.dot_product_attention_packed(x, qkv_layout="bs3hd", attn_mask_type="causal"),  # auto: xla on a CPU
        naive_attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], mask)))(x, sb)
    assert rel_err(jnp.swapaxes(out, 0, 1), ref) < 2e-5
    # auto on the CPU (xla) gives the same numbers from the same packed input
    assert rel_err(out_x, ref) < 2e-5


# ----------------------------------------------------------------------------- errors


def test_bad_packed_shapes_raise_clear_errors():
    x = jnp.zeros((B, 16, 2, H, D))
    with pytest.raises(ValueError, match=r"qkv: qkv_layout='bs3hd' expects shape \[b, s, 3, heads, d\], "
                                         r"got \(2, 16, 2, 4, 16\)\. Axis 2 must have size 3"):
        te_jax.dot_product_attention_packed(x, qkv_layout="bs3hd")
    gqa = jnp.zeros((B, 16, 7, D))
    with pytest.raises(ValueError, match=r"qkv: qkv_layout='bs\(h\+2g\)d' expects shape \[b, s, h \+ 2g = 8, d\], "
                                         r"got \(2, 16, 7, 16\)"):
        te_jax.dot_product_attention_packed(gqa, qkv_layout="bs(h+2g)d", num_attention_heads=4, num_gqa_groups=2)
    with pytest.raises(ValueError, match=r"needs num_attention_heads \(h\) and num_gqa_groups \(g\)"):
        te_jax.dot_product_attention_packed(gqa, qkv_layout="bs(h+2g)d")
    with pytest.raises(ValueError, match=r"qkv: qkv_layout='bshd_bs2hd' stores q, k, v in 2 tensor\(s\), got 1 "
                                         r"\(\(2, 16, 2, 4, 16\)\)\. Pass qkv=\(query, kv\)"):
        te_jax.dot_product_attention_packed(jnp.zeros((B, 16, 2, H, D)), qkv_layout="bshd_bs2hd")
    with pytest.raises(ValueError, match=r"attn_input_format='sbhd' but qkv_layout='bs3hd' is a 'bshd' layout"):
        te_jax.dot_product_attention_packed(jnp.zeros((B, 16, 3, H, D)), qkv_layout="bs3hd",
                                            attn_input_format="sbhd")
    with pytest.raises(ValueError, match=r"qkv_layout='bs4hd' is not a known layout"):
        te_jax.dot_product_attention_packed(x, qkv_layout="bs4hd")
    with pytest.raises(ValueError, match=r"query: num_attention_heads=2 but the query head axis has 4 heads"):
        te_jax.dot_product_attention_packed(jnp.zeros((B, 16, 3, H, D)), qkv_layout="bs3hd", num_attention_heads=2)
    with pytest.raises(ValueError, match=r"key: the query heads \(4\) must be a multiple of the key/value heads \(3\)"):
        te_jax.dot_product_attention_packed((jnp.zeros((B, 16, H, D)), jnp.zeros((B, 16, 2, 3, D))),
                                            qkv_layout="bshd_bs2hd")
    # the kernel entry checks too (plain ValueErrors, no policy)
    with pytest.raises(ValueError, match=r"packed shape \(2, 16, 2, 4, 16\) does not match layout='bs3hd'"):
        packed_in_place_reason(x, layout="bs3hd", num_heads=H)
    with pytest.raises(ValueError, match=r"layout='bs\(h\+2g\)d' .*expected \(2, 16, 8, 16\)"):
        packed_in_place_reason(gqa, layout="bs(h+2g)d", num_heads=4, num_kv_heads=2)


# ----------------------------------------------------------------------------- Flax


@pytest.mark.parametrize("g", [2, 1], ids=["fused-qkv", "gqa-fused-kv"])
def test_mha_fused_qkv_reads_packed_in_place(g):
    """MultiHeadAttention with fused QKV (and RoPE on the packed tensor) hands the projection output to the
    kernel as it is, and matches the xla backend (split) in output and parameter gradients.
    h == g: one [b, s, 3, h, d] tensor ("bs3hd"); GQA: q and one [b, s, 2, g, d] tensor ("bshd_bs2hd")."""
    from te_jax.flax import MultiHeadAttention

    x = rand(0, (B, 16, 32))
    kw = dict(head_dim=D, num_attention_heads=2, num_gqa_groups=g, attn_mask_type="causal",
              enable_rotary_pos_emb=True, scale_attn_logits=True)
    params = jax.jit(MultiHeadAttention(**kw).init)(jax.random.key(1), x)["params"]
    assert ("qkv" in params) == (g == 2) and ("kv" in params) == (g == 1)
    run = lambda backend: (lambda p: MultiHeadAttention(backend=backend, **kw).apply(
        {"params": p}, x, deterministic=True)[0])
    (q, k, v), = pallas_operands(jax.make_jaxpr(run("pallas"))(params).jaxpr)["te_flash_attention_fwd"]
    assert k is v and k.aval.shape == (B, 16, 6 if g == 2 else 2, D)
    assert (q is k) == (g == 2)
    with_grad = lambda f: (lambda p: (lambda o, vjp: (o, vjp(2 * o)[0]))(*jax.vjp(f, p)))  # d sum(o^2)
    (out_p, grad_p), (out_x, grad_x) = jax.jit(lambda p: (with_grad(run("pallas"))(p), with_grad(run("xla"))(p)))(
        params)  # one compile for both backends
    assert rel_err(out_p, out_x) < 2e-5
    for a, r in zip(jax.tree.leaves(grad_p), jax.tree.leaves(grad_x)):
        assert rel_err(a, r) < 1e-4
