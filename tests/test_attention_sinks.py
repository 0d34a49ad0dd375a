"""Attention sinks (TransformerEngine's softmax_type "off-by-one" / "learnable") on every backend.

The truth is an fp32 softmax with an explicit extra column written out here: for each row the sink logit
(0, or softmax_offset[h]; not scaled, capped or biased) joins the visible logits in the denominator and
carries value 0. Checked: forward and gradients (q, k, v, softmax_offset) on the xla and pallas backends
(causal, GQA, padding with fully masked rows, bias + softcap + scale, a dense mask, packed inputs, dropout),
context parallelism, the cudnn refusal and its explanation, validation errors, and the Flax modules
(parameter, gradient, functional equivalence, decoding with the KV cache, per-shard runs under a mesh).

References run jitted, in the same program as what they check where possible (eagerly every op compiles on its
own for each new shape); inputs are drawn with numpy (no per-shape compile).
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import context_parallel as tcp
from te_jax import reference
from te_jax.flax import DotProductAttention, MultiHeadAttention, TransformerLayer
from helpers import fwd_bwd_pairs, rand
from tolerance import assert_close

B, S, H, G, D = 2, 16, 4, 2, 16
TOL = 2e-5


def _rand(i, shape, scale=1.0):
    return rand(i, shape, jnp.float32, scale)


def _qkv(seed=0, b=B, sq=S, skv=S, h=H, g=G, d=D):
    return _rand(seed, (b, sq, h, d)), _rand(seed + 1, (b, skv, g, d)), _rand(seed + 2, (b, skv, g, d))


OFFSET = jnp.array([0.7, -1.5, 2.0, 0.0], jnp.float32)  # one sink logit per query head (H = 4)


def sink_reference(q, k, v, sink, *, scale=None, causal=False, q_lens=None, kv_lens=None, bias=None,
                   softcap=None, mask=None):
    """fp32 attention whose softmax has an explicit extra column per row: the sink logit sink[h] (value 0).

    sink None: vanilla. mask: boolean [b|1, h|1, sq, skv], True = masked out."""
    b, sq, h, d = q.shape
    skv, g = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kk, vv = (jnp.repeat(t.astype(jnp.float32), h // g, axis=2) for t in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk, precision="highest") * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    visible = jnp.ones((b, 1, sq, skv), bool)
    if causal:
        visible &= jnp.tril(jnp.ones((sq, skv), bool))
    if q_lens is not None:
        visible &= (jnp.arange(sq)[None, :] < q_lens[:, None])[:, None, :, None]
    if kv_lens is not None:
        visible &= (jnp.arange(skv)[None, :] < kv_lens[:, None])[:, None, None, :]
    if mask is not None:
        visible &= ~mask
    s = jnp.where(visible, s, -jnp.inf)
    if sink is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        col = jnp.broadcast_to(jnp.asarray(sink, jnp.float32).reshape(1, h, 1, 1), (b, h, sq, 1))
        p = jax.nn.softmax(jnp.concatenate([s, col], axis=-1), axis=-1)[..., :skv]
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv, precision="highest")


def _check_many(cases, tol=TOL):
    """cases [(what, fn, ref_fn, args)]: forward and gradients w.r.t. every argument under a random cotangent,
    every fn and ref_fn in one jitted program (helpers.fwd_bwd_pairs); returns [(out, grads)] of the fns."""
    pairs = fwd_bwd_pairs(cases)
    for what, (out, grads), (ref, grads_ref) in pairs:
        assert_close(out, ref, tol, f"{what} out")
        for j, (a, r) in enumerate(zip(grads, grads_ref)):
            assert_close(a, r, tol, f"{what} grad {j}")
    return [mine for _, mine, _ in pairs]


def _check(fn, ref_fn, args, tol=TOL, what=""):
    return _check_many([(what, fn, ref_fn, args)], tol)[0]


# ----------------------------------------------------------------------------- against the reference

CASES = {
    # causal with GQA (4 query heads on 2 key/value heads)
    "causal_gqa": (dict(attn_mask_type="causal"), dict(causal=True)),
    # padding: batch row 1 has no key at all (every row fully masked) and 5 padded queries
    "padding_empty_rows": (dict(attn_mask_type="padding_causal", q_seqlens=jnp.array([S, S - 5]),
                                kv_seqlens=jnp.array([S - 3, 0])),
                           dict(causal=True, q_lens=jnp.array([S, S - 5]), kv_lens=jnp.array([S - 3, 0]))),
    # the sink is not scaled, soft-capped or biased
    "bias_softcap_scale": (dict(scale=0.4, softcap=3.0, bias=_rand(7, (1, H, S, S))),
                           dict(scale=0.4, softcap=3.0, bias=_rand(7, (1, H, S, S)))),
}


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_learnable_matches_reference(backend):
    """CASES, one compile for all and their references. (The sink convention -- not scaled, capped or biased --
    is the merge's, shared by the backends: checked on xla; pallas runs the kernels' own masks and padding.)"""
    names = [c for c in CASES if backend == "xla" or c != "bias_softcap_scale"]
    cases = []
    for case in names:
        kw, ref_kw = CASES[case]
        fn = functools.partial(lambda q, k, v, off, kw: te_jax.dot_product_attention(
            q, k, v, softmax_type="learnable", softmax_offset=off, backend=backend, **kw), kw=kw)
        ref_fn = functools.partial(lambda q, k, v, off, kw: sink_reference(q, k, v, off, **kw), kw=ref_kw)
        cases.append((f"{backend}/{case}", fn, ref_fn, (*_qkv(), OFFSET)))
    for case, (out, grads) in zip(names, _check_many(cases)):
        assert float(jnp.max(jnp.abs(grads[3]))) > 1e-3, case  # the offset is trained
        if case == "padding_empty_rows":
            assert float(jnp.max(jnp.abs(out[1, S - 5:]))) == 0.0  # padded queries
            assert float(jnp.max(jnp.abs(out[1]))) == 0.0  # batch row 1 sees no key: zeros, finite gradients


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_off_by_one_matches_reference_and_learnable_zero(backend):
    q, k, v = _qkv(3)
    kw = dict(attn_mask_type="causal", backend=backend)
    fn = lambda q, k, v: te_jax.dot_product_attention(q, k, v, softmax_type="off-by-one", **kw)
    a, _ = _check(fn, lambda q, k, v: sink_reference(q, k, v, jnp.zeros(H), causal=True), (q, k, v), what=backend)
    b, c = jax.jit(lambda q, k, v: (
        te_jax.dot_product_attention(q, k, v, softmax_type="learnable", softmax_offset=jnp.zeros(H), **kw),
        te_jax.dot_product_attention(q, k, v, softmax_type="off_by_one", **kw)))(q, k, v)  # TE-JAX's spelling
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_vanilla_unchanged(backend):
    q, k, v = _qkv(5)

    @jax.jit  # one compile
    def run(q, k, v):
        return (te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend=backend),
                te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend=backend, softmax_type="vanilla"),
                sink_reference(q, k, v, None, causal=True),
                te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend=backend,
                                             softmax_type="off-by-one"))

    a, b, ref, c = run(q, k, v)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_close(a, ref, TOL)
    # a sink only lowers each row's weights: |out| shrinks row by row by sigmoid(lse - sink) < 1
    assert np.all(np.abs(np.asarray(c)) <= np.abs(np.asarray(a)) + 1e-6)


def test_pallas_dense_mask_hiding_a_row():
    """A dense mask hiding a query row entirely: zeros (the kernel's folded-bias lse is discarded)."""
    q, k, v = _qkv(11)
    mask = jnp.zeros((B, 1, S, S), bool).at[0, 0, 3, :].set(True).at[1, 0, :, 5:9].set(True)
    fn = lambda q, k, v, off: te_jax.dot_product_attention(q, k, v, mask=mask, softmax_type="learnable",
                                                           softmax_offset=off, backend="pallas")
    out, _ = _check(fn, lambda q, k, v, off: sink_reference(q, k, v, off, mask=mask), (q, k, v, OFFSET))
    assert float(jnp.max(jnp.abs(out[0, 3]))) == 0.0


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_packed_and_formats(backend):
    """dot_product_attention_packed (bs3hd: read in place by the Pallas kernel) and sbhd / thd formats."""
    q, k, v = _qkv(13, g=H)
    qkv = jnp.stack([q, k, v], axis=2)  # [b, s, 3, h, d]
    kw = dict(attn_mask_type="causal", softmax_type="learnable", backend=backend)
    fn = lambda qkv, off: te_jax.dot_product_attention_packed(qkv, qkv_layout="bs3hd", softmax_offset=off, **kw)
    ref_fn = lambda qkv, off: sink_reference(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], off, causal=True)
    _check(fn, ref_fn, (qkv, OFFSET), what="packed")
    if backend == "pallas":
        choice = te_jax.explain_attention_backend_packed(qkv, qkv_layout="bs3hd", softmax_offset=OFFSET, **kw)
        assert choice.selected == "pallas" and choice.packed.startswith("read in place")

    @jax.jit  # one compile for the reference and the other formats
    def formats(q, k, v):
        want = sink_reference(q, k, v, OFFSET, causal=True)
        sb = None
        if backend == "xla":
            sb = te_jax.dot_product_attention(*(jnp.swapaxes(t, 0, 1) for t in (q, k, v)), attn_input_format="sbhd",
                                              softmax_offset=OFFSET, **kw)
        # thd: the two rows packed as two sequences of one token axis
        th = te_jax.dot_product_attention(*(t.reshape(B * S, *t.shape[2:]) for t in (q, k, v)),
                                          attn_input_format="thd", attn_mask_type="padding_causal",
                                          q_seqlens=jnp.array([S, S]), kv_seqlens=jnp.array([S, S]),
                                          softmax_offset=OFFSET, softmax_type="learnable", backend=backend)
        return want, sb, th

    want, sb, th = formats(q, k, v)
    if backend == "xla":
        assert_close(jnp.swapaxes(sb, 0, 1), want, TOL, "sbhd")
    assert_close(th.reshape(B, S, H, D), want, TOL, "thd")


def test_xla_dropout_rescales_the_kept_probabilities():
    """With dropout the sink rescales each row of the dropped-out attention by sigmoid(lse - sink)."""
    q, k, v = _qkv(17)
    rng = jax.random.key(3)
    kw = dict(attn_mask_type="causal", dropout_rate=0.3, backend="xla")
    tm = te_jax.masks.build_token_mask(te_jax.masks.MaskSpec("causal"), "bshd", B, S, S, None, None, None, None)
    vanilla, sink, (_, lse) = jax.jit(lambda q, k, v, rng: (  # one compile
        te_jax.dot_product_attention(q, k, v, dropout_rng=rng, **kw),
        te_jax.dot_product_attention(q, k, v, softmax_type="learnable", softmax_offset=OFFSET, dropout_rng=rng, **kw),
        reference.reference_attention(q, k, v, tm, scale=1 / np.sqrt(D), causal=True)))(q, k, v, rng)
    w = jax.nn.sigmoid(lse - OFFSET[None, :, None])  # [b, h, s]
    assert_close(sink, vanilla * jnp.swapaxes(w, 1, 2)[..., None], TOL)


def _hopper_reason():
    from te_jax import _compat
    from te_jax.backends.pallas import hopper_device_reason

    return hopper_device_reason() if _compat.gpu_compute_capability() is not None else "not a GPU"


@pytest.mark.skipif(_hopper_reason() is not None, reason="needs the Hopper kernel (sm90, jax >= 0.11)")
@pytest.mark.parametrize("causal,g,padded", [(True, 2, False), (False, 4, False), (True, 2, True)])
def test_hopper_kernel_with_sinks(causal, g, padded):
    """GPU only: bf16 shapes the Hopper kernel serves; its (out, lse) take the sink, forward and backward; padded:
    padding_causal from seqlens (the data-mask schedule, one row's tail padded past a whole tile)."""
    s, h, d = 256, 4, 64
    q, k, v = (t.astype(jnp.bfloat16) for t in _qkv(80, sq=s, skv=s, h=h, g=g, d=d))
    kw = dict(attn_mask_type="causal" if causal else "no_mask", softmax_type="learnable")
    ref_kw = dict(causal=causal)
    if padded:
        lens = jnp.array([256, 100][:q.shape[0]], jnp.int32)
        kw.update(attn_mask_type="padding_causal", q_seqlens=lens, kv_seqlens=lens)
        ref_kw.update(q_lens=lens, kv_lens=lens)
    choice = te_jax.explain_attention_backend(q, k, v, softmax_offset=OFFSET, backend="pallas", **kw)
    assert choice.detail.startswith("Hopper"), choice
    assert ("data-mask schedule" in choice.detail) == padded, choice.detail
    fn = lambda q, k, v, off: te_jax.dot_product_attention(q, k, v, softmax_offset=off, backend="pallas", **kw)
    _check(fn, lambda q, k, v, off: sink_reference(q, k, v, off, **ref_kw), (q, k, v, OFFSET), tol=2e-2,
           what="hopper")


@pytest.mark.parametrize("name", ["window", "bottom_right"])
def test_sinks_with_a_window_and_bottom_right(name):
    """A sliding window and bottom-right causal with q shorter than kv, with learnable sinks and GQA, on the pallas
    backend: out and the gradients of q, k, v and softmax_offset against the fp32 reference with the dense mask
    written out.  On an sm90 GPU these run as bands on the Hopper kernels (no tables; the sink merges into their
    (out, lse) and its lse cotangent reaches their backward; the explanation says "as a band"); elsewhere on the
    portable kernel."""
    from pallas_kernels.mask import AttentionMask

    hopper = _hopper_reason() is None
    h, d, skv = 4, 64, 512 if hopper else 128
    sq = skv // 2 if name == "bottom_right" else skv
    q, k, v = _qkv(90, sq=sq, skv=skv, h=h, g=2, d=d)
    if hopper:
        q, k, v = (t.astype(jnp.bfloat16) for t in (q, k, v))
    if name == "window":
        window = (96, 0) if hopper else (24, 0)
        kw = dict(attn_mask_type="causal", window_size=window)
        dense = AttentionMask.full(q.shape[0], sq, skv, causal=True, window=window).dense()
    else:
        kw = dict(attn_mask_type="causal_bottom_right")
        dense = AttentionMask.full(q.shape[0], sq, skv, causal=True, bottom_right=True).dense()
    choice = te_jax.explain_attention_backend(q, k, v, softmax_offset=OFFSET, softmax_type="learnable",
                                              backend="pallas", **kw)
    assert ("as a band" in choice.detail) == hopper, choice.detail
    fn = lambda q, k, v, off: te_jax.dot_product_attention(q, k, v, softmax_offset=off, softmax_type="learnable",
                                                           backend="pallas", **kw)
    _check(fn, lambda q, k, v, off: sink_reference(q, k, v, off, mask=~dense[:, None]), (q, k, v, OFFSET),
           tol=2e-2 if hopper else TOL, what=f"{'hopper band' if hopper else 'portable'} {name}")


# ----------------------------------------------------------------------------- selection and validation


def test_cudnn_refused_with_a_reason():
    q, k, v = (t.astype(jnp.bfloat16) for t in _qkv())
    for st, off in (("learnable", OFFSET), ("off-by-one", None)):
        choice = te_jax.explain_attention_backend(q, k, v, softmax_type=st, softmax_offset=off)
        why = choice.reasons["cudnn"]
        assert f"softmax_type={st!r}" in why and "logsumexp" in why and "jax.nn.dot_product_attention" in why
        assert why.kind is te_jax.backends.base.ReasonKind.UNSUPPORTED
        sel = choice.selected  # auto never takes cudnn for a sink (xla on the CPU, pallas on an H100)
        assert sel in ("xla", "pallas"), sel
        assert any(n.startswith(f"softmax_type={st!r}: the sink is merged after the {sel} attention")
                   for n in choice.notes), choice.notes
        assert te_jax.explain_attention_backend(q, k, v, softmax_type=st, softmax_offset=off,
                                                backend="pallas").selected == "pallas"
        with pytest.raises(ValueError, match="softmax_type=.* returns the output only"):
            te_jax.dot_product_attention(q, k, v, softmax_type=st, softmax_offset=off, backend="cudnn")
    if jax.default_backend() != "gpu":
        assert te_jax.explain_attention_backend(q, k, v).reasons["cudnn"].startswith("not a GPU")
    caps = {n: b.capabilities.returns_lse for n, b in te_jax.backends.selection.BACKENDS.items()}
    assert caps == {"pallas": True, "cudnn": False, "xla": True}


def test_validation_errors():
    q, k, v = _qkv()
    f = lambda **kw: te_jax.dot_product_attention(q, k, v, **kw)
    with pytest.raises(ValueError, match=r"softmax_type='softmax1' is unknown; expected one of \('vanilla', "
                                         r"'off-by-one', 'learnable'\)"):
        f(softmax_type="softmax1")
    with pytest.raises(ValueError, match="softmax_type='learnable' needs softmax_offset"):
        f(softmax_type="learnable")
    with pytest.raises(ValueError, match=r"softmax_offset has shape \(2,\).*\[h\] = \[4\].*\[1, 4, 1, 1\]"):
        f(softmax_type="learnable", softmax_offset=jnp.zeros(2))
    with pytest.raises(ValueError, match="softmax_offset has dtype int32; it must be a float array"):
        f(softmax_type="learnable", softmax_offset=jnp.zeros(H, jnp.int32))
    for st in ("vanilla", "off-by-one"):
        with pytest.raises(ValueError, match=f"softmax_offset was given with softmax_type={st!r}"):
            f(softmax_type=st, softmax_offset=OFFSET)
    with pytest.raises(ValueError, match="is unknown"):
        te_jax.dot_product_attention_packed((q, k, v), qkv_layout="bshd_bshd_bshd", softmax_type="sink")
    with pytest.raises(ValueError, match="needs softmax_offset"):
        te_jax.explain_attention_backend(q, k, v, softmax_type="learnable")
    # TransformerEngine's [1, h, 1, 1] storage is accepted and means the same as [h]; any float dtype
    off = OFFSET.astype(jnp.bfloat16)
    np.testing.assert_array_equal(f(softmax_type="learnable", softmax_offset=off.reshape(1, H, 1, 1)),
                                  f(softmax_type="learnable", softmax_offset=off))


# ----------------------------------------------------------------------------- context parallelism


_FOUR_DEVICES = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (the CPU suite fakes 8)")


@_FOUR_DEVICES
@pytest.mark.parametrize("strategy,backend", [("ring", "xla"), ("all_gather", "pallas")])
def test_context_parallel(strategy, backend):
    """CP over 4 fake devices (load-balanced, padding_causal) against the single-device reference, including
    the offset's gradient (summed over the ring's devices by shard_map's transpose)."""
    cp = 4
    mesh = te_jax._compat.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    s = 16
    q, k, v = _qkv(21, sq=s, skv=s)
    lens = jnp.array([s, s - 5])

    def fn(q, k, v, off):
        q, k, v = (tcp.reorder_causal_load_balancing(t, cp, 1) for t in (q, k, v))
        out = tcp.context_parallel_attention(q, k, v, cp_axis="cp", mesh=mesh, strategy=strategy,
                                             load_balanced=True, attn_mask_type="padding_causal", q_seqlens=lens,
                                             kv_seqlens=lens, backend=backend, softmax_type="learnable",
                                             softmax_offset=off)
        return tcp.inverse_reorder_causal_load_balancing(out, cp, 1)

    ref_fn = lambda q, k, v, off: sink_reference(q, k, v, off, causal=True, q_lens=lens, kv_lens=lens)
    _check(fn, ref_fn, (q, k, v, OFFSET), what=f"cp {strategy}")
    with pytest.raises(ValueError, match="needs softmax_offset"):
        tcp.context_parallel_attention(q, k, v, cp_axis="cp", mesh=mesh, softmax_type="learnable")


# ----------------------------------------------------------------------------- Flax modules

HD, HID = 8, 32


def _mha(**kw):
    args = dict(head_dim=HD, num_attention_heads=H, num_gqa_groups=G, attn_mask_type="causal",
                softmax_type="learnable", input_layernorm=False, fuse_qkv_params=False, backend="xla")
    args.update(kw)
    return MultiHeadAttention(**args)


def _with_offset(params, path, value):
    params = jax.tree.map(lambda a: a, nn.meta.unbox(params))
    node = params
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return params


def test_mha_learnable_parameter_gradient_and_functional_equivalence():
    x = _rand(30, (B, S, HID))
    m = _mha()
    boxed = jax.jit(lambda x: m.init(jax.random.key(0), x, deterministic=True))(x)["params"]
    assert boxed["softmax_offset"].names == ("heads",)  # sharded with the other head-sharded parameters
    params = _with_offset(boxed, ("softmax_offset",), OFFSET)
    assert params["softmax_offset"].shape == (H,) and params["softmax_offset"].dtype == jnp.float32
    np.testing.assert_array_equal(nn.meta.unbox(boxed)["softmax_offset"], np.zeros(H))  # TE's init

    apply = lambda mod: jax.jit(lambda p: mod.apply({"params": p}, x, deterministic=True)[0])
    y = apply(m)(params)

    @jax.jit  # the functional form and its reference, one compile
    def functional(params, x):
        q = jnp.einsum("bse,ehd->bshd", x, params["query"]["kernel"])
        k = jnp.einsum("bse,ehd->bshd", x, params["key"]["kernel"])
        v = jnp.einsum("bse,ehd->bshd", x, params["value"]["kernel"])
        attn = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", scale=1.0, softmax_type="learnable",
                                            softmax_offset=OFFSET, backend="xla")
        return attn, jnp.einsum("bshd,hde->bse", attn, params["out"]["kernel"]), sink_reference(
            q, k, v, OFFSET, scale=1.0, causal=True)

    attn, y_functional, attn_ref = functional(params, x)
    assert_close(y, y_functional, TOL)
    assert_close(attn, attn_ref, TOL)

    grads = jax.jit(jax.grad(lambda p: jnp.sum(m.apply({"params": p}, x, deterministic=True)[0] ** 2)))(params)
    assert float(jnp.min(jnp.abs(grads["softmax_offset"]))) > 0

    # pallas forced: the same output; off-by-one equals learnable at zero; vanilla has no parameter
    assert_close(apply(_mha(backend="pallas"))(params), y, TOL)
    zero = _with_offset(boxed, ("softmax_offset",), jnp.zeros(H))
    obo_params = {k2: v2 for k2, v2 in zero.items() if k2 != "softmax_offset"}
    assert_close(apply(_mha(softmax_type="off-by-one"))(obo_params), apply(m)(zero), TOL)
    assert "softmax_offset" not in jax.eval_shape(lambda: _mha(softmax_type="vanilla").init(jax.random.key(0), x))[
        "params"]
    with pytest.raises(ValueError, match="MultiHeadAttention: softmax_type='sinks' is unknown"):
        _mha(softmax_type="sinks").init(jax.random.key(0), x)


def test_dot_product_attention_module():
    q, k, v = _qkv(40)
    m = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, attn_mask_type="causal",
                            softmax_type="learnable")
    params = _with_offset(jax.jit(m.init)(jax.random.key(0), q, k, v)["params"], ("softmax_offset",), OFFSET)
    out, ref = jax.jit(lambda p, q, k, v: (m.apply({"params": p}, q, k, v, deterministic=True),
                                           sink_reference(q, k, v, OFFSET, causal=True)))(params, q, k, v)
    assert_close(out, ref, TOL)


def test_transformer_layer_learnable_sinks():
    x = _rand(50, (B, S, HID))
    layer = TransformerLayer(hidden_size=HID, mlp_hidden_size=64, num_attention_heads=H, num_gqa_groups=G,
                             hidden_dropout=0.0, attention_dropout=0.0, enable_relative_embedding=False,
                             softmax_type="learnable", attention_backend="xla", norm_backend="xla", mlp_backend="xla")
    params = nn.meta.unbox(jax.jit(lambda x: layer.init(jax.random.key(0), x, deterministic=True))(x)["params"])
    assert params["attention"]["softmax_offset"].shape == (H,)
    params = _with_offset(params, ("attention", "softmax_offset"), OFFSET)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x, deterministic=True) ** 2)))(params)
    assert float(jnp.min(jnp.abs(grads["attention"]["softmax_offset"]))) > 0
    # the sink changes the output; off-by-one equals learnable with zero offsets
    zero = _with_offset(params, ("attention", "softmax_offset"), jnp.zeros(H))
    no_offset = {**zero, "attention": {k: v for k, v in zero["attention"].items() if k != "softmax_offset"}}
    run = lambda mod, p: mod.apply({"params": p}, x, deterministic=True)
    y0, y_obo, y_van = jax.jit(lambda zero, no_offset: (  # the three layers in one compile
        run(layer, zero), run(layer.clone(softmax_type="off-by-one"), no_offset),
        run(layer.clone(softmax_type="vanilla"), no_offset)))(zero, no_offset)
    assert_close(y_obo, y0, TOL)
    assert float(jnp.max(jnp.abs(y_van - y0))) > 1e-3
    # a decoder layer: the cross-attention owns its own sink (TransformerEngine passes softmax_type to both)
    dec = layer.clone(layer_type="decoder")
    dparams = nn.meta.unbox(jax.eval_shape(lambda: dec.init(jax.random.key(1), x, x, deterministic=True))["params"])
    assert dparams["encoder_decoder_attention"]["softmax_offset"].shape == (H,)
    with pytest.raises(ValueError, match="TransformerLayer: softmax_type='x' is unknown"):
        layer.clone(softmax_type="x").init(jax.random.key(0), x)


def test_decode_with_sinks_matches_full_forward():
    """Prefill of 5 tokens, then one token a step (pallas): equal to the full forward, the sink applied at
    every step."""
    x = _rand(60, (B, S, HID))
    m = _mha(backend="pallas", enable_rotary_pos_emb=True)
    boxed = jax.jit(lambda x: m.init(jax.random.key(0), x, decode=True))(x)
    params = _with_offset(boxed["params"], ("softmax_offset",), OFFSET)
    cache = jax.tree.map(jnp.zeros_like, boxed["cache"])
    full, _ = jax.jit(lambda p: m.apply({"params": p}, x, deterministic=True))(params)
    step = jax.jit(lambda c, xs: m.apply({"params": params, "cache": c}, xs, decode=True, deterministic=True,
                                         mutable=["cache"]))
    outs = []
    for lo, hi in [(0, 5)] + [(t, t + 1) for t in range(5, S)]:
        (y, _), mut = step(cache, x[:, lo:hi])
        cache = mut["cache"]
        outs.append(y)
    assert_close(jnp.concatenate(outs, axis=1), full, TOL)


@_FOUR_DEVICES
def test_per_shard_under_a_mesh_splits_the_offset_with_the_heads():
    """DotProductAttention under a data=2 x tensor=2 mesh with logical rules: the attention runs per shard
    (the [h] offset split along "heads"); output and every gradient match one device."""
    rules = (("batch", "data"), ("heads", "tensor"), ("kv_heads", "tensor"), ("length", None), ("kv", None))
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    q, k, v = _qkv(70)
    m = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, attn_mask_type="causal",
                            softmax_type="learnable", backend="xla")
    params = _with_offset(jax.jit(m.init)(jax.random.key(0), q, k, v)["params"], ("softmax_offset",), OFFSET)
    ct = _rand(71, (B, S, H, D))

    def loss(p, q, k, v):
        return jnp.sum(m.apply({"params": p}, q, k, v, deterministic=True) * ct)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v)
        assert "shard_map" in str(jaxpr)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v)
    assert_close(got, want, TOL)
    assert float(jnp.min(jnp.abs(got[1][0]["softmax_offset"]))) > 0
