"""Context-parallel attention (ring, all-gather) against single-device te_jax attention, on 8 fake CPU devices."""
import functools
import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import te_jax
from te_jax import _compat
from te_jax import context_parallel as tcp
from helpers import cpu_mesh as _mesh, fwd_bwd, fwd_bwd_many, qkv

B, S, H, G, D = 2, 32, 4, 2, 16
STRATEGIES = ("ring", "all_gather")


def _qkv(seed, b=B, sq=S, skv=S, h=H, g=G, d=D, dtype=jnp.float32):
    """q, k, v and an fp32 output cotangent in this file's shapes."""
    return qkv(seed, b, sq, skv, h, g, d, dtype=dtype, cotangent=True)


def _packed_segments(b, s):
    """[b, s] segment ids in ORIGINAL order: packed documents of uneven lengths, trailing padding."""
    rows = []
    for i in range(b):
        cuts = [0, 5 + 3 * i, s // 2 + i, s - 4 - i, s]
        seg = np.zeros(s, np.int32)
        for j in range(len(cuts) - 2):
            seg[cuts[j]:cuts[j + 1]] = j + 1
        rows.append(seg)  # the last run stays 0 (padding)
    return jnp.asarray(np.stack(rows))


def _mask_kwargs(mask_type, b, sq, skv):
    """Single-device keyword arguments (original order) for each tested mask flavour."""
    if mask_type == "padding":  # via seqlens; batch row 1 has few keys
        return dict(attn_mask_type="padding", q_seqlens=jnp.array([sq, sq - 7], jnp.int32),
                    kv_seqlens=jnp.array([skv - 3, 4], jnp.int32))
    if mask_type == "padding_causal":  # via segment ids (packed sequences)
        seg = _packed_segments(b, sq)
        return dict(attn_mask_type="padding_causal", q_segment_ids=seg, kv_segment_ids=seg)
    return dict(attn_mask_type=mask_type)


def _cp_fn(mesh, cp_axis, cp_size, lb, fmt="bshd", **kw):
    """f(q, k, v) in ORIGINAL bshd order → CP attention (reordered and back when load balancing)."""
    seq_axis = 1 if fmt == "bshd" else 0

    def f(q, k, v):
        kw2 = dict(kw)
        if fmt == "sbhd":
            q, k, v = (jnp.swapaxes(t, 0, 1) for t in (q, k, v))
        if lb:
            q, k, v = (tcp.reorder_causal_load_balancing(t, cp_size, seq_axis) for t in (q, k, v))
            for name in ("q_segment_ids", "kv_segment_ids"):
                if kw2.get(name) is not None:  # segment ids follow the tokens' order
                    kw2[name] = tcp.reorder_causal_load_balancing(kw2[name], cp_size, 1)
        out = tcp.context_parallel_attention(q, k, v, cp_axis=cp_axis, mesh=mesh, load_balanced=lb,
                                             attn_input_format=fmt, **kw2)
        if lb:
            out = tcp.inverse_reorder_causal_load_balancing(out, cp_size, seq_axis)
        if fmt == "sbhd":
            out = jnp.swapaxes(out, 0, 1)
        return out

    return f


def _ref_fn(**kw):
    return lambda q, k, v: te_jax.dot_product_attention(q, k, v, backend="xla", **kw)


def _compare(f_cp, f_ref, q, k, v, ct, tol=2e-5, jit_ctx=None):
    ctx = jit_ctx or _nullctx()
    with ctx:  # output and gradients of sum(out * ct) in one compile (helpers.fwd_bwd)
        out, grads = fwd_bwd(f_cp, (q, k, v), ct)
    q, k, v = (jnp.asarray(np.asarray(t)) for t in (q, k, v))  # the reference runs unsharded
    ref, grads_ref = fwd_bwd(f_ref, (q, k, v), ct)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
    for name, a, b in zip("qkv", grads, grads_ref):
        a = np.asarray(a, np.float32)
        assert np.isfinite(a).all(), f"d{name} not finite"
        np.testing.assert_allclose(a, np.asarray(b, np.float32), rtol=tol, atol=tol, err_msg=f"d{name}")
    return out


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _case(strategy, mask_type, lb, cp=4, window=None, seed=0, fmt="bshd", backend="auto", g=G, sq=S, skv=S):
    mesh = _mesh((cp,), ("cp",))
    q, k, v, ct = _qkv(seed, sq=sq, skv=skv, g=g)
    kw = _mask_kwargs(mask_type, B, sq, skv)
    if window is not None:
        kw["window_size"] = window
    f_cp = _cp_fn(mesh, "cp", cp, lb, fmt=fmt, strategy=strategy, backend=backend, **kw)
    _compare(f_cp, _ref_fn(**kw), q, k, v, ct)


def _cases(cases, cp=4, seed=0, tol=2e-5):
    """Like _case for several (name, strategy, mask_type, lb, window) on one cp mesh and one input draw: the CP
    runs in one compile, the (unsharded) references in another, one per mask; each case checked on its own."""
    mesh = _mesh((cp,), ("cp",))
    q, k, v, ct = _qkv(seed)
    refs, cp_runs = {}, []
    for name, strategy, mask_type, lb, window in cases:
        kw = _mask_kwargs(mask_type, B, S, S)
        if window is not None:
            kw["window_size"] = window
        refs.setdefault((mask_type, window), _ref_fn(**kw))
        cp_runs.append((_cp_fn(mesh, "cp", cp, lb, strategy=strategy, **kw), (q, k, v), ct))
    got = fwd_bwd_many(cp_runs)
    want = dict(zip(refs, fwd_bwd_many([(f, (q, k, v), ct) for f in refs.values()])))
    for (name, _, mask_type, _, window), (out, grads) in zip(cases, got):
        ref, grads_ref = want[(mask_type, window)]
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=tol, atol=tol, err_msg=name)
        for t, a, b in zip("qkv", grads, grads_ref):
            assert np.isfinite(np.asarray(a)).all(), f"{name}: d{t} not finite"
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol, err_msg=f"{name}: d{t}")


# ---------------------------------------------------------------------------------------------
# Correctness against single-device attention (fp32, forward and gradients)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_masks_cp4_load_balanced_or_not(strategy):
    """Every mask flavour load balanced, causal and padding_causal also not load balanced (one compile)."""
    _cases([(f"{mask_type} lb={lb}", strategy, mask_type, lb, None)
            for mask_type, lb in [("no_mask", True), ("causal", True), ("padding", True), ("padding_causal", True),
                                  ("causal", False), ("padding_causal", False)]], seed=1)


@pytest.mark.parametrize("strategy,cp", [pytest.param("ring", 2, marks=pytest.mark.slow), ("ring", 8), ("all_gather", 8)])
def test_cp_sizes(strategy, cp):
    _case(strategy, "causal", lb=True, cp=cp, seed=3)


def test_sliding_window():
    """ring with a causal window, all_gather with a two-sided window (one compile)."""
    _cases([("ring causal (5, 0)", "ring", "causal", True, (5, 0)),
            ("all_gather no_mask (4, 3)", "all_gather", "no_mask", True, (4, 3))], seed=4)


def test_sbhd_ring_mha_softcap():
    mesh = _mesh((4,), ("cp",))
    q, k, v, ct = _qkv(5, g=H)  # plain multi-head (no GQA) here
    kw = dict(attn_mask_type="causal", softcap=3.0, scale=0.3)
    _compare(_cp_fn(mesh, "cp", 4, True, fmt="sbhd", strategy="ring", **kw), _ref_fn(**kw), q, k, v, ct)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp_cp_mesh_current_mesh(strategy):
    """2×4 mesh, batch sharded on 'dp' (read from the Explicit sharding), mesh from jax.set_mesh."""
    mesh = _mesh((2, 4), ("dp", "cp"))
    q, k, v, ct = _qkv(6)
    kw = _mask_kwargs("padding_causal", B, S, S)
    sh = NamedSharding(mesh, P("dp", "cp"))
    q, k, v = (jax.device_put(t, sh) for t in (q, k, v))
    f_cp = _cp_fn(None, "cp", 4, True, strategy=strategy, **kw)
    out = _compare(f_cp, _ref_fn(**kw), q, k, v, ct, jit_ctx=_compat.use_mesh(mesh))
    assert out.sharding.spec[0] == "dp"


def test_dp_cp_tp_mesh_heads_sharded():
    """dp×cp×tp mesh: batch on dp, heads on tp (GQA, 4 query / 2 kv heads over tp=2), ring."""
    mesh = _mesh((2, 2, 2), ("dp", "cp", "tp"))
    q, k, v, ct = _qkv(7)
    sh = NamedSharding(mesh, P("dp", "cp", "tp"))
    q, k, v = (jax.device_put(t, sh) for t in (q, k, v))
    kw = dict(attn_mask_type="causal")
    f_cp = _cp_fn(mesh, "cp", 2, True, strategy="ring", **kw)
    _compare(f_cp, _ref_fn(**kw), q, k, v, ct, jit_ctx=_compat.use_mesh(mesh))


def test_mesh_with_unused_axis_gradients():
    """The mesh has a 'dp' axis the inputs are not sharded on: inputs replicated over it, grads exact."""
    mesh = _mesh((2, 4), ("dp", "cp"))
    q, k, v, ct = _qkv(8)
    kw = dict(attn_mask_type="causal")
    _compare(_cp_fn(mesh, "cp", 4, True, strategy="ring", **kw), _ref_fn(**kw), q, k, v, ct)


def test_bf16_ring():
    mesh = _mesh((4,), ("cp",))
    q, k, v, ct = _qkv(9, dtype=jnp.bfloat16)
    kw = dict(attn_mask_type="causal")
    f_cp = _cp_fn(mesh, "cp", 4, True, strategy="ring", **kw)
    out = jax.jit(f_cp)(q, k, v)
    assert out.dtype == jnp.bfloat16
    f32 = [t.astype(jnp.float32) for t in (q, k, v)]
    ref = _ref_fn(**kw)(*f32)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not hasattr(importlib.import_module("pallas_kernels.flash_attention"), "flash_attention_fwd"),
                    reason="pallas_kernels.flash_attention.flash_attention_fwd not available")
def test_ring_pallas_backend_interpret():
    mesh = _mesh((2,), ("cp",))
    q, k, v, ct = _qkv(10, b=1, h=2, g=1)
    kw = dict(attn_mask_type="causal")
    _compare(_cp_fn(mesh, "cp", 2, True, strategy="ring", backend="pallas", **kw), _ref_fn(**kw), q, k, v, ct)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,cp,lb,mask_type", list(itertools.product(
    STRATEGIES, (2, 4, 8), (True, False), ("no_mask", "causal", "padding", "padding_causal"))))
def test_sweep(strategy, cp, lb, mask_type):
    _case(strategy, mask_type, lb=lb, cp=cp, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mask_type", ["causal_bottom_right", "padding_causal_bottom_right"])
def test_cross_attention_bottom_right(strategy, mask_type):
    """q and kv of different lengths, bottom-right causal alignment."""
    sq, skv = 16, 32
    mesh = _mesh((4,), ("cp",))
    q, k, v, ct = _qkv(12, sq=sq, skv=skv)
    kw = dict(attn_mask_type=mask_type)
    if mask_type.startswith("padding"):
        kw.update(q_seqlens=jnp.array([sq, 9], jnp.int32), kv_seqlens=jnp.array([skv, 20], jnp.int32))
    _compare(_cp_fn(mesh, "cp", 4, True, strategy=strategy, **kw), _ref_fn(**kw), q, k, v, ct)


# ---------------------------------------------------------------------------------------------
# Ring schedule: skipped and halved steps
# ---------------------------------------------------------------------------------------------
def _step_branches(cp, lb, causal=True):
    """branch[r][t] for device r at ring step t (K/V from device r - t)."""
    s = 4 * cp
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    if lb:
        pos = tcp.reorder_causal_load_balancing(pos, cp, 1)
    seg = jnp.ones_like(pos)
    cfg = tcp._Cfg(backend="xla", strategy="ring", cp_axis="cp", cp_size=cp, scale=1.0, softcap=None,
                   causal=causal, window=(-1, -1), halves=True)
    blk = s // cp
    out = []
    for r in range(cp):
        row = []
        for t in range(cp):
            src = (r - t) % cp
            sl_q, sl_k = slice(r * blk, (r + 1) * blk), slice(src * blk, (src + 1) * blk)
            row.append(int(tcp._branch(cfg, seg[:, sl_q], pos[:, sl_q], seg[:, sl_k], pos[:, sl_k])))
        out.append(row)
    return out


def test_ring_schedule_zigzag_and_plain():
    cp = 4
    # Zig-zag: diagonal full (1); K/V from an earlier device → all q × first K/V half (2);
    # from a later device → second q half × all K/V (3). Every device does the same work.
    zz = _step_branches(cp, lb=True)
    for r in range(cp):
        for t in range(cp):
            src = (r - t) % cp
            assert zz[r][t] == (1 if t == 0 else 2 if src < r else 3), (r, t, zz)
    # Plain layout: blocks from later devices are skipped (0), earlier ones are full (1).
    plain = _step_branches(cp, lb=False)
    for r in range(cp):
        for t in range(cp):
            src = (r - t) % cp
            assert plain[r][t] == (1 if src <= r else 0), (r, t, plain)
    # No mask: everything is full.
    assert all(b == 1 for row in _step_branches(cp, lb=True, causal=False) for b in row)


# ---------------------------------------------------------------------------------------------
# Reorder and errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp,seq_axis", [(1, 1), (2, 1), (4, 0), (8, -2)])
def test_reorder_round_trip(cp, seq_axis):
    x = jax.random.normal(jax.random.key(0), (3, 32, 2) if seq_axis != 0 else (32, 3, 2))
    y = tcp.reorder_causal_load_balancing(x, cp, seq_axis)
    np.testing.assert_array_equal(np.asarray(tcp.inverse_reorder_causal_load_balancing(y, cp, seq_axis)),
                                  np.asarray(x))
    # device r's shard holds chunks r and 2·cp−1−r
    ax = seq_axis % 3
    idx = np.asarray(tcp.reorder_causal_load_balancing(jnp.arange(32), cp, 0))
    c = 32 // (2 * cp)
    for r in range(cp):
        shard = idx[2 * c * r:2 * c * (r + 1)]
        np.testing.assert_array_equal(shard, np.r_[r * c:(r + 1) * c, (2 * cp - 1 - r) * c:(2 * cp - r) * c])
    np.testing.assert_array_equal(np.asarray(y), np.take(np.asarray(x), idx, axis=ax))


def test_reorder_errors():
    with pytest.raises(ValueError, match=r"not divisible by 2·cp_size = 8"):
        tcp.reorder_causal_load_balancing(jnp.zeros((1, 12)), 4, 1)
    with pytest.raises(ValueError, match="cp_size"):
        tcp.inverse_reorder_causal_load_balancing(jnp.zeros((1, 12)), 0, 1)
    with pytest.raises(ValueError, match="seq_axis"):
        tcp.reorder_causal_load_balancing(jnp.zeros((1, 12)), 2, 2)


def _small(s, sq=None):
    q = jnp.zeros((1, sq or s, 2, 8))
    kv = jnp.zeros((1, s, 2, 8))
    return q, kv, kv


@pytest.mark.parametrize("s,lb,cp,match", [
    (12, True, 4, r"query sequence length 12 is not divisible by 2·cp_size = 8"),
    (1, True, 2, r"query sequence length 1 is not divisible by 2·cp_size = 4"),
    (6, False, 4, r"query sequence length 6 is not divisible by cp_size = 4"),
    (1, False, 2, r"query sequence length 1 is not divisible by cp_size = 2"),
])
def test_error_sequence_not_divisible(s, lb, cp, match):
    mesh = _mesh((cp,), ("cp",))
    with pytest.raises(ValueError, match=match):
        tcp.context_parallel_attention(*_small(s), cp_axis="cp", mesh=mesh, load_balanced=lb)


def test_error_kv_not_divisible():
    mesh = _mesh((2,), ("cp",))
    q = jnp.zeros((1, 8, 2, 8))
    kv = jnp.zeros((1, 10, 2, 8))
    with pytest.raises(ValueError, match=r"key/value sequence length 10 is not divisible by 2·cp_size = 4"):
        tcp.context_parallel_attention(q, kv, kv, cp_axis="cp", mesh=mesh)


def test_error_axis_and_mesh():
    mesh = _mesh((2,), ("cp",))
    with pytest.raises(ValueError, match=r"cp_axis='seq' is not an axis of the mesh.*'cp': 2"):
        tcp.context_parallel_attention(*_small(8), cp_axis="seq", mesh=mesh)
    with pytest.raises(ValueError, match="no mesh"):
        tcp.context_parallel_attention(*_small(8), cp_axis="cp")
    with pytest.raises(ValueError, match="batch_axes names axis 'dp'"):
        tcp.context_parallel_attention(*_small(8), cp_axis="cp", mesh=mesh, batch_axes="dp")
    with pytest.raises(ValueError, match="must shard the sequence only"):
        tcp.context_parallel_attention(*_small(8), cp_axis="cp", mesh=mesh, batch_axes="cp")
    mesh2 = _mesh((2, 2), ("cp", "tp"))
    with pytest.raises(ValueError, match=r"key/value heads size 2 is not divisible|heads size"):
        tcp.context_parallel_attention(jnp.zeros((1, 8, 2, 8)), jnp.zeros((1, 8, 1, 8)), jnp.zeros((1, 8, 1, 8)),
                                       cp_axis="cp", mesh=mesh2, head_axes="tp")


def test_error_format_strategy_backend():
    mesh = _mesh((2,), ("cp",))
    t = jnp.zeros((8, 2, 8))
    with pytest.raises(ValueError, match="attn_input_format='thd' is not supported"):
        tcp.context_parallel_attention(t, t, t, cp_axis="cp", mesh=mesh, attn_input_format="thd",
                                       attn_mask_type="padding", q_seqlens=jnp.array([8]))
    with pytest.raises(ValueError, match="strategy='ulysses' is not known"):
        tcp.context_parallel_attention(*_small(8), cp_axis="cp", mesh=mesh, strategy="ulysses")
    with pytest.raises(ValueError, match="cudnn"):
        tcp.context_parallel_attention(*_small(8), cp_axis="cp", mesh=mesh, backend="cudnn")
    with pytest.raises(ValueError, match="needs q_seqlens"):  # the shared validation still applies
        tcp.context_parallel_attention(*_small(8), cp_axis="cp", mesh=mesh, attn_mask_type="padding")


def test_explain_backend():
    mesh = _mesh((2,), ("cp",))
    choice = tcp.explain_context_parallel_backend(*_small(8), cp_axis="cp", mesh=mesh)
    assert choice.selected == ("pallas" if jax.default_backend() == "gpu" else "xla")
    assert "context parallelism" in choice.reasons["cudnn"] or jax.default_backend() != "gpu"


def test_input_batch_sharded_on_cp_axis_is_resharded():
    """An Explicit input sharded on cp_axis along the batch is resharded (sequence on cp), not refused."""
    mesh = _mesh((2,), ("cp",))
    q, k, v, _ = _qkv(13)
    sh = NamedSharding(mesh, P("cp"))
    qs, ks, vs = (jax.device_put(t, sh) for t in (q, k, v))
    f = functools.partial(tcp.context_parallel_attention, cp_axis="cp", mesh=mesh, strategy="all_gather",
                          load_balanced=False, attn_mask_type="causal")
    out = jax.jit(f)(qs, ks, vs)
    assert out.sharding.spec[1] == "cp"
    ref = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Mask-free ("dense") per-block kernels: the path the Hopper kernel takes on sm90
# ---------------------------------------------------------------------------------------------
def _local_tm(q, k):
    """Token mask of a mask-free kernel: one segment, local positions 0..s-1 (causal = top-left)."""
    from te_jax import masks

    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    ones = lambda s: jnp.ones((b, s), jnp.int32)  # noqa: E731
    pos = lambda s: jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))  # noqa: E731
    return masks.TokenMask(ones(sq), pos(sq), ones(skv), pos(skv))


class _DenseStandIn:
    """What the Hopper kernel offers the ring (q, k, v, causal) → (out, lse), built on the reference,
    with a record of the causal flags it was called with."""

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, *, scale, causal, config=None):
        from te_jax import reference
        self.calls.append(("fwd", q.shape[1], k.shape[1], causal))
        return reference.reference_attention(q, k, v, _local_tm(q, k), None, scale=scale, softcap=None,
                                             causal=causal, window=(-1, -1))

    def backward(self, q, k, v, out, lse, dout, *, scale, causal, config=None):
        from te_jax import reference
        self.calls.append(("bwd", q.shape[1], k.shape[1], causal))
        dq, dk, dv, _ = reference.reference_attention_bwd(q, k, v, _local_tm(q, k), None, out, lse, dout,
                                                          None, scale=scale, softcap=None, causal=causal,
                                                          window=(-1, -1))
        return dq, dk, dv


@pytest.mark.parametrize("strategy,mask_type,lb,cp", [
    ("ring", "causal", True, 4), ("ring", "causal", True, 2), ("ring", "causal", False, 4),
    ("ring", "no_mask", True, 4), ("all_gather", "no_mask", True, 2)])
def test_dense_block_kernel_path(monkeypatch, strategy, mask_type, lb, cp):
    """With a mask-free block kernel the ring passes causal=True on the diagonal pair only and calls
    every other pair (or half pair) unmasked; the result must still equal single-device attention."""
    from te_jax.backends import selection

    standin = _DenseStandIn()
    xla = selection.BACKENDS["xla"]
    monkeypatch.setattr(xla, "dense_forward", standin.forward, raising=False)
    monkeypatch.setattr(xla, "dense_backward", standin.backward, raising=False)
    monkeypatch.setattr(tcp, "_inner_kernel", lambda backend, call, strategy, cp_size: (True, "stand-in"))
    mesh = _mesh((cp,), ("cp",))
    q, k, v, ct = _qkv(11, g=G)
    kw = dict(attn_mask_type=mask_type)
    f_cp = _cp_fn(mesh, "cp", cp, lb, strategy=strategy, backend="xla", **kw)
    _compare(f_cp, _ref_fn(**kw), q, k, v, ct)
    causal_calls = {c for c in standin.calls if c[3]}
    if mask_type == "causal":  # only the diagonal (full local blocks) is causal, forward and backward
        assert causal_calls == {("fwd", S // cp, S // cp, True), ("bwd", S // cp, S // cp, True)}, standin.calls
        if lb:  # zig-zag: off-diagonal steps run on half blocks
            assert any(c[1] != c[2] for c in standin.calls if not c[3]), standin.calls
    else:
        assert not causal_calls, standin.calls


def test_dense_path_explained():
    mesh = _mesh((2,), ("cp",))
    choice = tcp.explain_context_parallel_backend(*_small(512), cp_axis="cp", mesh=mesh, backend="pallas",
                                                  attn_mask_type="causal")
    if jax.default_backend() != "gpu":
        assert "portable Triton-lowered kernel with token masks (Hopper kernel not used: not a GPU" in choice.detail
    choice = tcp.explain_context_parallel_backend(*_small(512), cp_axis="cp", mesh=mesh, backend="pallas",
                                                  attn_mask_type="padding_causal",
                                                  q_seqlens=jnp.array([500]), kv_seqlens=jnp.array([500]))
    if jax.default_backend() == "gpu":
        assert "padding" in choice.detail
