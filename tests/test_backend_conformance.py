"""Backend conformance: every registered backend against one independent fp32 reference.

Attention: each backend of the registry (te_jax.backends.selection.BACKENDS, so a new backend is picked up
without an edit here) runs the same cases through the public front door, te_jax.dot_product_attention(...,
backend=name), forward and gradients (q, k, v), against softmax attention written out in fp32
(tests/naive_attention.py: the mask from explicit loops over the mask-type definitions). A backend that
cannot serve a case here (cudnn off a GPU) must say why in the explanation: the test checks the reason,
then skips, never passes silently. A capability the backend declares (`Capabilities`) must run: dense
masks, packed input read in place, split forward/backward with logsumexp, mask-free ring blocks, kernel
configurations. Each case runs in the first dtype the backend serves (fp32, else bf16). The cases a backend serves
run as one compiled program, their references as another (a compile of such programs is mostly fixed cost); each
case is checked on its own and named in failures.

Norms and the MLP: every backend of the norm/MLP tables (te_jax/backends/ops.py) gives LayerNorm and
RMSNorm as a plain fp32 reference does, forward and gradients.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import fwd_bwd, fwd_bwd_many, qkv, rand, ref_norm
from naive_attention import naive_attention, naive_mask
from te_jax.backends import base, ops, selection
from tolerance import assert_close

BACKENDS = tuple(selection.BACKENDS)
# dtype -> tolerance relative to max(|reference|, 1); a case runs in the first dtype its backend serves.
DTYPES = {"float32": 1e-4, "bfloat16": 4e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mask_type: str = "no_mask"
    b: int = 2
    sq: int = 16
    skv: int = 16
    h: int = 2
    g: int = 2
    d: int = 16
    padding: str | None = None  # "seqlens" | "segment_ids"
    window: tuple[int, int] | None = None
    bias: bool = False
    softcap: float | None = None

    def padding_arrays(self):
        """(front-door kwargs, naive_mask kwargs) for the case's padding."""
        if self.padding == "seqlens":
            q_lens, kv_lens = np.array([self.sq, self.sq - 6]), np.array([self.skv, self.skv - 3])
            return (dict(q_seqlens=jnp.asarray(q_lens, jnp.int32), kv_seqlens=jnp.asarray(kv_lens, jnp.int32)),
                    dict(q_lens=q_lens, kv_lens=kv_lens))
        if self.padding == "segment_ids":  # packed documents of uneven lengths, trailing padding
            seg = np.array([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 4 + [0] * 3], np.int32)
            return (dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg)),
                    dict(q_seg=seg, kv_seg=seg))
        return {}, {}

    def kwargs(self):
        """dot_product_attention's keyword arguments (bias drawn fresh), and the reference's mask [b, sq, skv]."""
        pad, ref_pad = self.padding_arrays()
        kw = dict(attn_mask_type=self.mask_type, window_size=self.window, softcap=self.softcap, **pad)
        if self.bias:
            kw["bias"] = rand(7, (1, self.h, self.sq, self.skv))
        mask = naive_mask(self.b, self.sq, self.skv, self.mask_type, window=self.window, **ref_pad)
        return kw, mask

    def shapes(self, dtype):
        return (jax.ShapeDtypeStruct((self.b, self.sq, self.h, self.d), dtype),
                jax.ShapeDtypeStruct((self.b, self.skv, self.g, self.d), dtype),
                jax.ShapeDtypeStruct((self.b, self.skv, self.g, self.d), dtype))


CASES = [
    Case("no_mask"),
    Case("causal_mqa_hd32", "causal", h=4, g=1, d=32),
    Case("causal_bottom_right_q8_kv24_gqa", "causal_bottom_right", sq=8, skv=24, h=4, g=2),
    Case("padding_causal_seqlens", "padding_causal", padding="seqlens"),
    Case("padding_segment_ids", "padding", padding="segment_ids"),
    Case("window_causal", "causal", window=(4, 0)),
    Case("bias", bias=True),
    Case("softcap", "causal", softcap=5.0),
]


def _checked_reason(choice, name, what):
    """The backend does not serve the call: its explanation must say why (a Reason with a kind)."""
    why = choice.reasons[name]
    assert isinstance(why, base.Reason) and why.strip(), f"{name} refuses {what} without a reason:\n{choice}"
    assert why.kind in (base.ReasonKind.UNSUPPORTED, base.ReasonKind.DISABLED), (why.kind, str(choice))
    assert why in str(choice)
    return why


def _skip_with_reason(choice, name, what):
    """The backend does not serve the call: its explanation must say why (a Reason with a kind); then skip."""
    pytest.skip(f"{name} does not serve {what} here: {_checked_reason(choice, name, what)}")


def _serving_dtype_or_refusal(explain, name):
    """(the first dtype of DTYPES in which `explain(dtype)` says `name` serves the call, its explanation), or
    (None, the float32 explanation) when it serves none."""
    first = None
    for dt in DTYPES:
        choice = explain(jnp.dtype(dt))
        if choice.reasons[name] is None:
            assert choice.selected == name, str(choice)
            return jnp.dtype(dt), choice
        first = first or choice
    return None, first


def _serving_dtype(explain, name, what):
    """The first dtype of DTYPES in which `explain(dtype)` says `name` serves the call; else check the
    float32 reason and skip."""
    dtype, choice = _serving_dtype_or_refusal(explain, name)
    if dtype is None:
        _skip_with_reason(choice, name, what)
    return dtype, choice


def _runs_here(name):
    """Whether `name` serves a plain call on this machine (capabilities are checked only where it does)."""
    shapes = Case("plain").shapes
    return any(te_jax.explain_attention_backend(*shapes(jnp.dtype(dt)), backend=name).reasons[name] is None
               for dt in DTYPES)


def _check(f, ref, args, ct, tol, what):
    (out, grads), (ref_out, ref_grads) = fwd_bwd_many([(f, args, ct),
                                                       (ref, tuple(a.astype(jnp.float32) for a in args), ct)])
    assert_close(out, ref_out, tol, f"{what} out")
    for i, (gr, rg) in enumerate(zip(grads, ref_grads)):
        assert_close(gr, rg, tol, f"{what} grad[{i}]")


# ----------------------------------------------------------------------------- the front door, every case

@functools.cache
def _case_inputs(case, dtype_name):
    """(q, k, v, ct, kwargs, reference function): one draw per case and dtype, shared by the backends."""
    kw, mask = case.kwargs()
    q, k, v, ct = qkv(1, case.b, case.sq, case.skv, case.h, case.g, case.d, dtype=dtype_name, cotangent=True)
    ref = lambda q, k, v: naive_attention(q, k, v, mask, bias=kw.get("bias"), softcap=case.softcap)
    return q, k, v, ct, kw, ref


@functools.cache
def _references(cases):
    """{(case, dtype name): reference (out, grads)} for (case, dtype name) pairs, in one compile."""
    runs = []
    for case, dtype_name in cases:
        q, k, v, ct, _, ref = _case_inputs(case, dtype_name)
        runs.append((ref, tuple(t.astype(jnp.float32) for t in (q, k, v)), ct))
    return dict(zip(cases, fwd_bwd_many(runs)))


@pytest.mark.parametrize("name", BACKENDS)
def test_front_door_matches_reference(name):
    """Every case of CASES. The served ones run in one compile (their references in another), each checked; the
    refused ones must give a reason (checked), and then the test skips, naming them."""
    served, refused = [], []
    for case in CASES:
        kw, _ = case.kwargs()
        dtype, choice = _serving_dtype_or_refusal(
            lambda dt: te_jax.explain_attention_backend(*case.shapes(dt), backend=name, **kw), name)
        if dtype is None:
            refused.append(f"{case.name} ({_checked_reason(choice, name, case.name)})")
        else:
            served.append((case, dtype.name))
    if served:
        refs = _references(tuple(served))
        runs = []
        for case, dtype_name in served:
            q, k, v, ct, kw, _ = _case_inputs(case, dtype_name)
            runs.append((functools.partial(lambda q, k, v, kw: te_jax.dot_product_attention(q, k, v, backend=name,
                                                                                            **kw), kw=kw),
                         (q, k, v), ct))
        for (case, dtype_name), (out, grads) in zip(served, fwd_bwd_many(runs)):
            ref_out, ref_grads = refs[(case, dtype_name)]
            tol, what = DTYPES[dtype_name], f"{name} {case.name}"
            assert_close(out, ref_out, tol, f"{what} out")
            for label, gr, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
                assert_close(gr, rg, tol, f"{what} {label}")
    if refused:
        pytest.skip(f"{name} does not serve here: " + "; ".join(refused))


# ----------------------------------------------------------------------------- declared capabilities

DENSE = Case("dense_mask", "causal")


@pytest.mark.parametrize("name", BACKENDS)
def test_dense_mask(name):
    """A backend declaring dense_mask runs mask= wherever it runs; one that does not refuses it with a reason."""
    m = np.random.default_rng(3).random((DENSE.b, 1, DENSE.sq, DENSE.skv)) < 0.3
    m[1, 0, 4] = True  # a row the dense mask hides entirely: zeros
    kw, mask = DENSE.kwargs()
    explain = lambda dt: te_jax.explain_attention_backend(*DENSE.shapes(dt), mask=jnp.asarray(m), backend=name, **kw)
    if selection.BACKENDS[name].capabilities.dense_mask and _runs_here(name):
        assert explain(jnp.dtype("float32")).reasons[name] is None or explain(jnp.dtype("bfloat16")).reasons[name] \
            is None, f"{name} declares dense_mask but refuses it"
    dtype, _ = _serving_dtype(explain, name, "a dense mask")
    assert selection.BACKENDS[name].capabilities.dense_mask, f"{name} serves mask= without declaring dense_mask"
    q, k, v, ct = qkv(2, DENSE.b, DENSE.sq, DENSE.skv, DENSE.h, DENSE.g, DENSE.d, dtype=dtype, cotangent=True)
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, backend=name, mask=jnp.asarray(m), **kw)
    ref = lambda q, k, v: naive_attention(q, k, v, mask & ~m[:, 0])
    _check(f, ref, (q, k, v), ct, DTYPES[dtype.name], f"{name} dense mask")


@pytest.mark.parametrize("name", BACKENDS)
def test_packed_input(name):
    """dot_product_attention_packed (bs3hd) on every backend; one declaring packed_inputs reads it in place."""
    b, s, h, d = 2, 16, 2, 16
    explain = lambda dt: te_jax.explain_attention_backend_packed(
        jax.ShapeDtypeStruct((b, s, 3, h, d), dt), qkv_layout="bs3hd", attn_mask_type="causal", backend=name)
    dtype, choice = _serving_dtype(explain, name, "packed bs3hd input")
    if selection.BACKENDS[name].capabilities.packed_inputs:
        assert choice.packed.startswith("read in place"), choice.packed
    else:
        assert choice.packed.startswith("split"), choice.packed
    x = rand(4, (b, s, 3, h, d), dtype)
    ct = rand(5, (b, s, h, d))
    f = lambda x: te_jax.dot_product_attention_packed(x, qkv_layout="bs3hd", attn_mask_type="causal", backend=name)
    mask = naive_mask(b, s, s, "causal")
    ref = lambda x: naive_attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], mask)
    _check(f, ref, (x,), ct, DTYPES[dtype.name], f"{name} packed")


def _lse_reference(q, k, mask, scale):
    """log sum exp of the visible scaled logits, [b, h, sq] fp32."""
    h, g = q.shape[2], k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, h // g, axis=2)) * scale
    return jax.nn.logsumexp(jnp.where(jnp.asarray(mask)[:, None], s, -jnp.inf), axis=-1)


SPLIT = Case("split", "padding_causal", padding="segment_ids", h=4, g=2)


@pytest.mark.parametrize("name", BACKENDS)
def test_split_forward_backward(name):
    """SplitBackward (what context parallelism calls): forward_only's (out, lse) and backward's (dq, dk, dv)
    from the saved logsumexp equal the reference's output, logsumexp and gradients. A backend declaring
    kernel_config runs them with a configuration (config=, as the context-parallel ring passes it)."""
    backend = selection.BACKENDS[name]
    if not backend.capabilities.split_backward:
        pytest.skip(f"{name} does not declare split_backward")
    kw, mask = SPLIT.kwargs()
    kw["config"] = _kernel_configs().get(name) if backend.capabilities.kernel_config else None
    from te_jax.attention import prepare_attention

    dtype, _ = _serving_dtype(lambda dt: selection.choose_backend(
        prepare_attention(*SPLIT.shapes(dt), needs_split_vjp=True, **kw).call, name), name, "a split forward/backward")
    q, k, v, ct = qkv(6, SPLIT.b, SPLIT.sq, SPLIT.skv, SPLIT.h, SPLIT.g, SPLIT.d, dtype=dtype, cotangent=True)
    prep = prepare_attention(q, k, v, needs_split_vjp=True, **kw)
    sk = dict(scale=prep.scale, softcap=prep.softcap, causal=prep.call.mask.causal, window=prep.window,
              config=prep.call.kernel_config)
    out, lse = jax.jit(lambda q, k, v: backend.forward_only(q, k, v, prep.token_mask, prep.bias, **sk))(q, k, v)
    dq, dk, dv, _ = jax.jit(lambda q, k, v, out, lse: backend.backward(
        q, k, v, prep.token_mask, prep.bias, out, lse, ct.astype(q.dtype), None, **sk))(q, k, v, out, lse)
    f32 = [t.astype(jnp.float32) for t in (q, k, v)]
    ref_out, ref_grads = fwd_bwd(lambda q, k, v: naive_attention(q, k, v, mask), f32, ct)
    tol = DTYPES[dtype.name]
    assert_close(out, ref_out, tol, f"{name} forward_only out")
    ref_lse = _lse_reference(*f32[:2], mask, prep.scale)
    visible = np.asarray(mask.any(-1))[:, None, :].repeat(SPLIT.h, 1)  # rows with a key: a finite lse
    assert_close(np.asarray(lse)[visible], np.asarray(ref_lse)[visible], tol, f"{name} forward_only lse")
    for what, gr, rg in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(gr, rg, tol, f"{name} backward {what}")


@pytest.mark.parametrize("name", BACKENDS)
def test_ring_blocks(name):
    """RingBlocks: the mask-free block kernel, where it says it serves (a reason otherwise), against the reference."""
    backend = selection.BACKENDS[name]
    if not backend.capabilities.ring_blocks:
        pytest.skip(f"{name} does not declare ring_blocks")
    from te_jax.attention import prepare_attention

    b, s, h, d = 1, 128, 2, 64  # a shape the Hopper kernel takes (never run off a GPU)
    dtype = jnp.dtype("bfloat16")
    call = prepare_attention(*Case("ring", "causal", b=b, sq=s, skv=s, h=h, g=h, d=d).shapes(dtype),
                             attn_mask_type="causal", needs_split_vjp=True).call
    why = backend.ring_block_reason(call, (b, s, h, d), (b, s, h, d), False)
    if why is not None:
        assert isinstance(why, str) and why.strip()
        pytest.skip(f"{name}'s mask-free block kernel does not serve here: {why}")
    q, k, v, ct = qkv(8, b, s, s, h, h, d, dtype=dtype, cotangent=True)
    scale = d ** -0.5
    out, lse = backend.dense_forward(q, k, v, scale=scale, causal=True)
    dq, dk, dv = backend.dense_backward(q, k, v, out, lse, ct.astype(dtype), scale=scale, causal=True)
    mask = naive_mask(b, s, s, "causal")
    ref_out, ref_grads = fwd_bwd(lambda q, k, v: naive_attention(q, k, v, mask),
                                  [t.astype(jnp.float32) for t in (q, k, v)], ct)
    assert_close(out, ref_out, DTYPES["bfloat16"], f"{name} dense_forward")
    for what, gr, rg in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(gr, rg, DTYPES["bfloat16"], f"{name} dense_backward {what}")


def _kernel_configs():
    """A kernel configuration per backend declaring kernel_config (a backend without an entry: its config= case
    is skipped, saying so)."""
    from pallas_kernels.flash_attention import BlockSizes

    return {"pallas": BlockSizes(block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=16)}


@pytest.mark.parametrize("name", BACKENDS)
def test_kernel_config(name):
    """A backend declaring kernel_config runs config= and records it in the explanation; the others refuse it
    with the reason that they take none."""
    case = Case("config", "causal", sq=32, skv=32)
    configs = _kernel_configs()
    cfg = configs.get(name, next(iter(configs.values())))
    explain = lambda dt: te_jax.explain_attention_backend(*case.shapes(dt), attn_mask_type="causal", config=cfg,
                                                          backend=name)
    if not selection.BACKENDS[name].capabilities.kernel_config:
        why = explain(jnp.dtype("float32")).reasons[name]
        assert why is not None and "takes no kernel configuration" in why, why
        return
    if name not in configs:
        pytest.skip(f"{name} declares kernel_config: add a configuration of its kernel to _kernel_configs to test it")
    dtype, choice = _serving_dtype(explain, name, f"config={cfg!r}")
    assert f"config={cfg!r}" in choice.detail, choice.detail
    q, k, v, ct = qkv(9, case.b, case.sq, case.skv, case.h, case.g, case.d, dtype=dtype, cotangent=True)
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", config=cfg, backend=name)
    mask = naive_mask(case.b, case.sq, case.skv, "causal")
    out, ref = jax.jit(lambda q, k, v: (f(q, k, v), naive_attention(q, k, v, mask)))(q, k, v)
    assert_close(out, ref, DTYPES[dtype.name], f"{name} config")


# ----------------------------------------------------------------------------- norms and the MLP (ops.py)

def _norm_inputs(dtype=jnp.float32):
    x = rand(10, (4, 8, 48), dtype, scale=1.5) + 0.3
    gamma = jnp.asarray(0.5 + np.random.default_rng(11).random(48, np.float32))
    return x, gamma, rand(12, (48,), scale=0.3), rand(13, (4, 8, 48))


@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("name", ops.NORM.names)
def test_norm_backend_matches_reference(name, layernorm_type):
    x, g, b, dy = _norm_inputs()
    rms = layernorm_type == "rmsnorm"
    choice = te_jax.explain_norm_backend(x, g, b, layernorm_type=layernorm_type, backend=name)
    if choice.reasons[name] is not None:
        _skip_with_reason(choice, name, layernorm_type)
    f = lambda x, g, b: te_jax.norm(x, g, b, layernorm_type=layernorm_type, backend=name)
    ref = lambda x, g, b: ref_norm(x, g, b, rms)
    (out, grads), (ref_out, ref_grads) = fwd_bwd_many([(f, (x, g, b), dy), (ref, (x, g, b), dy)])
    assert_close(out, ref_out, 1e-4, f"{name} {layernorm_type}")
    assert_close(grads[:2 if rms else 3], ref_grads[:2 if rms else 3], 1e-4, f"{name} {layernorm_type} grads")


@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("name", ops.MLP.names)
def test_mlp_backend_norm_matches_reference(name, layernorm_type):
    """Every backend of the MLP table: layernorm_dense's norm output and product, with gradients."""
    x, g, b, _ = _norm_inputs()
    w = rand(14, (48, 24), scale=48 ** -0.5)
    rms = layernorm_type == "rmsnorm"
    choice = te_jax.explain_mlp_backend(x, g, b, layernorm_type=layernorm_type, backend=name, op="layernorm_dense")
    if choice.reasons[name] is not None:
        _skip_with_reason(choice, name, f"layernorm_dense ({layernorm_type})")
    f = lambda x, g, b, w: te_jax.layernorm_dense(x, g, b, w, layernorm_type=layernorm_type, backend=name,
                                                  return_layernorm_output=True)

    def ref(x, g, b, w):
        ln = ref_norm(x, g, b, rms)
        return jnp.einsum("...d,df->...f", ln, w, precision="highest"), ln

    cts = (rand(15, (4, 8, 24)), rand(16, (4, 8, 48)))
    ((y, ln), grads), ((ry, rln), ref_grads) = fwd_bwd_many([(f, (x, g, b, w), cts), (ref, (x, g, b, w), cts)])
    assert_close((y, ln), (ry, rln), 1e-4, f"{name} {layernorm_type} layernorm_dense")
    keep = [0, 1, 3] if rms else [0, 1, 2, 3]
    assert_close([grads[i] for i in keep], [ref_grads[i] for i in keep], 1e-4, f"{name} {layernorm_type} grads")
