"""Fused FP8 quantization: the Pallas cast kernels (pallas_kernels/fp8_cast) against their jnp reference, and the
fused FP8 MLP (te_jax/fp8/mlp.py) against the unfused FP8 path and an fp32 non-FP8 reference.

Small ragged shapes (M = 48 tokens, D = 32, F = 40); kernels run in interpret mode on the CPU.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import fp8_cast as K
from pallas_kernels.fp8_cast import reference as R
from te_jax import activations as A
from te_jax import fp8
from te_jax.fp8 import quantize as Q
from te_jax.fp8.fused import FUSED_ENV
from te_jax.fp8.mlp import fused_fp8_mlp
from te_jax.fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from te_jax.flax import LayerNormMLP

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
M, D, F = 48, 32, 40
#: XLA's default excess precision drops convert pairs (a bf16 rounding between two fp32 ops) in the unfused
#: path's fusions, so which roundings happen there depends on the compiler; with it off both paths round
#: exactly where their code says and must agree bit for bit.
EXACT = {"xla_allow_excess_precision": False}


ON_GPU = jax.default_backend() == "gpu"  # there the kernels run compiled (Triton), elsewhere in interpret mode
#: The activation's fp32 math compiled in another order (XLA's whole-array fusion vs the kernel's tile; on a GPU
#: Triton's exp / tanh vs XLA's): the amax of a / dgu may differ in its last bits.
_AMAX_RTOL = 2.0 ** -20 if ON_GPU else 2.0 ** -22


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(F32))


def _fp8_ulps(a, b):
    """Distance in FP8 steps between two FP8 arrays of the same dtype (sign-magnitude bits -> ordinals)."""
    def ordinal(x):
        bits = np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)).astype(np.int32)
        return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)

    return np.abs(ordinal(a) - ordinal(b))


def _assert_fp8_close(got, want):
    """Equal, or one FP8 step apart where the fp32 value before the cast differs in its last bits (activation
    math compiled in another order), and then rarely."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulps = _fp8_ulps(got, want)
    # Values within 2^-10 of the FP8 range of zero also pass: there an activation is a cancellation (gelu's
    # 1 + tanh(u) for very negative inputs), and the GPU's tanh (Triton's vs XLA's) leaves different tiny
    # remainders that are many FP8 steps apart yet equal to 2^-10 of the largest value.
    tiny = float(jnp.finfo(got.dtype).max) * 2.0 ** -10
    near_zero = (np.abs(_f32(got)) <= tiny) & (np.abs(_f32(want)) <= tiny)
    far = (ulps > 1) & ~near_zero
    rest = ulps[~near_zero]  # the near-zero values are many steps apart by design (above): not in the mean
    assert not far.any() and (rest.size == 0 or rest.mean() < 0.01), (int(far.sum()), ulps.max(), rest.mean())


def _rand(key, shape, dtype, scale=2.0):
    return (jax.random.normal(key, shape) * scale).astype(dtype)


def _scale_for(amax_value, out_dtype):
    # 1.5x past fp8_max / amax: the largest values saturate, the rest spread over the FP8 range
    return 1.5 * float(jnp.finfo(out_dtype).max) / float(amax_value)


# --- the kernels against the reference ------------------------------------------------------------

ACT_CASES = [  # activation, gated, input dtype, output dtype, round_to, (block_m, block_n)
    ("silu", True, BF, E4, None, (16, 16)),
    ("gelu", True, F16, E4, F16, (128, 64)),
    ("gelu", False, BF, E5, BF, (32, 16)),
    ("relu", False, F32, E4, None, (16, 32)),
    ("linear", True, F32, E5, None, (64, 16)),
]


@pytest.mark.parametrize("activation, gated, dtype, out_dtype, round_to, blocks", ACT_CASES)
def test_act_cast_matches_reference(activation, gated, dtype, out_dtype, round_to, blocks):
    gu = _rand(jax.random.PRNGKey(1), (M, 2, F) if gated else (M, F), dtype)
    kw = dict(activation=activation, gated=gated, round_to=round_to)
    ref_amax = R.act_amax(gu, **kw)
    scale = _scale_for(ref_amax, out_dtype)
    bm, bn = blocks
    q, qt, amax = K.act_cast(gu, scale, out_dtype=out_dtype, transpose=True, block_m=bm, block_n=bn, **kw)
    rq, _ = R.act_cast(gu, scale, out_dtype=out_dtype, **kw)
    _assert_fp8_close(q, rq)
    np.testing.assert_array_equal(_f32(qt), _f32(q).T)  # the same values, transposed by the same program
    np.testing.assert_allclose(amax, ref_amax, rtol=_AMAX_RTOL)
    np.testing.assert_array_equal(K.act_amax(gu, block_m=bm, block_n=bn, **kw), amax)
    if blocks == (128, 64):  # the defaults: one program covers the whole array; also without the transpose
        q2, amax2 = K.act_cast(gu, scale, out_dtype=out_dtype, **kw)
        np.testing.assert_array_equal(_f32(q2), _f32(q))
        np.testing.assert_array_equal(amax2, amax)
    assert np.abs(_f32(q)).max() == float(jnp.finfo(out_dtype).max)  # the largest values saturated


@pytest.mark.parametrize("activation, gated, dtype, out_dtype, round_to, blocks", ACT_CASES)
def test_dact_cast_transpose_matches_reference(activation, gated, dtype, out_dtype, round_to, blocks):
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    gu = _rand(k1, (M, 2, F) if gated else (M, F), dtype)
    dh = _rand(k2, (M, F), dtype, scale=1.0)
    kw = dict(activation=activation, gated=gated, round_to=round_to)
    ref_amax = R.dact_amax(dh, gu, **kw)
    scale = _scale_for(ref_amax, out_dtype)
    bm, bn = blocks
    q, qt, amax = K.dact_cast_transpose(dh, gu, scale, out_dtype=out_dtype, block_m=bm, block_n=bn, **kw)
    rq, rqt, _ = R.dact_cast_transpose(dh, gu, scale, out_dtype=out_dtype, **kw)
    assert q.shape == gu.shape and qt.shape == ((2 if gated else 1) * F, M)
    _assert_fp8_close(q, rq)
    np.testing.assert_array_equal(_f32(qt), _f32(q).reshape(M, -1).T)
    np.testing.assert_allclose(amax, ref_amax, rtol=_AMAX_RTOL)
    np.testing.assert_array_equal(K.dact_amax(dh, gu, block_m=bm, block_n=bn, **kw), amax)


def test_dact_traced_equals_dact():
    """common.dact_traced (dact's jaxpr run primitive by primitive, add_any as add: what the TMA kernel traces, since
    Mosaic GPU does not lower add_any) gives dact's values bit for bit, for every activation, gated and not."""
    from pallas_kernels.fp8_cast import common as C

    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    dh, g, u = (jax.random.normal(k, (16, 24), jnp.float32) * 3 for k in ks)
    for activation in ("gelu", "linear", "quick_gelu", "relu", "silu", "squared_relu"):
        for gated in (True, False):
            want = C.dact(activation, gated, dh, g, u if gated else None)
            got = C.dact_traced(activation, gated, dh, g, u if gated else None)
            assert len(got) == len(want) == (2 if gated else 1)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("activation, gated", [("silu", True), ("gelu", False), ("quick_gelu", True)])
def test_tma_tile_math_equals_the_reference(activation, gated):
    """The TMA kernels' tile math (tma.dact_tile / act_tile: the owed input scales read from the scales array in
    its order, the prescale, dact_traced, the rounding), run on whole arrays on the CPU, gives the reference's
    values before the cast: the same bits."""
    from pallas_kernels.fp8_cast import common as C
    from pallas_kernels.fp8_cast.tma import act_tile, dact_tile

    k1, k2 = jax.random.split(jax.random.PRNGKey(5))
    gu = _rand(k1, (M, 2, F) if gated else (M, F), BF)
    dh = _rand(k2, (M, F), BF, scale=1.0)
    s_gu, s_dh = jnp.float32(0.75), jnp.float32(3.0)
    parts = [gu[:, 0], gu[:, 1]] if gated else [gu]
    f32 = lambda a: a.astype(jnp.float32)
    got = dact_tile(activation, gated, BF, (True, True), (BF, BF))(
        [f32(dh)] + [f32(p) for p in parts], C.scale_array(1.0, s_gu, s_dh))
    want = R.dact(dh, gu, activation=activation, gated=gated, round_to=BF, gu_scale=s_gu, dh_scale=s_dh)
    want = [want[:, 0], want[:, 1]] if gated else [want]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    (a,) = act_tile(activation, gated, BF, True, BF)([f32(p) for p in parts], C.scale_array(1.0, s_gu))
    np.testing.assert_array_equal(a, R.act(gu, activation=activation, gated=gated, round_to=BF, gu_scale=s_gu))


def test_tma_casts_bad_inputs_are_clear_errors():
    """The TMA casts refuse what they cannot run, naming the argument and the fix: shapes off the tile, a tile
    other than 64 / 128, interpret mode, inputs of two dtypes, dh of the wrong shape, x not 2-D."""
    from pallas_kernels.fp8_cast.tma import act_cast_tma, cast_transpose_tma, dact_cast_transpose_tma

    gu, dh = jnp.zeros((128, 2, 192), BF), jnp.zeros((128, 192), BF)
    act = dict(activation="silu", gated=True, out_dtype=E5)
    for call, match in (
            (lambda: dact_cast_transpose_tma(dh, gu, 1.0, block=128, **act), "F=192 must be multiples of block=128"),
            (lambda: act_cast_tma(gu, 1.0, block=32, **act), "block=32"),
            (lambda: act_cast_tma(gu, 1.0, interpret=True, **act), "no interpret mode"),
            (lambda: dact_cast_transpose_tma(dh.astype(jnp.float32), gu, 1.0, **act), "share one dtype"),
            (lambda: dact_cast_transpose_tma(dh[:64], gu, 1.0, **act), r"dh has shape \(64, 192\); expected"),
            (lambda: cast_transpose_tma(gu, 1.0, out_dtype=E4), "x must be 2-D")):
        with pytest.raises(ValueError, match=match):
            call()


def test_tma_casts_switch(monkeypatch):
    """TE_JAX_FP8_TMA_CASTS picks which casts run on the TMA kernels: DEFAULT_TMA_CASTS when unset, kinds separated by
    ',' or '+', 'none' for none; a listed kind only compiled (not in interpret mode) on an sm90 GPU, on arrays whose
    dims are multiples of the tile and whose dtypes agree; unknown kinds a clear error."""
    from te_jax.fp8 import fused
    from te_jax.fp8.fused import DEFAULT_TMA_CASTS, TMA_BLOCK, tma_cast, tma_cast_kinds

    b = TMA_BLOCK
    x, y = jnp.zeros((8 * b, 4 * b), BF), jnp.zeros((8 * b, 2 * b), BF)
    monkeypatch.delenv("TE_JAX_FP8_TMA_CASTS", raising=False)
    assert set(tma_cast_kinds()) == {k.strip() for k in DEFAULT_TMA_CASTS.split(",") if k.strip()}
    monkeypatch.setenv("TE_JAX_FP8_TMA_CASTS", "none")
    assert tma_cast_kinds() == () and not tma_cast("dact", False, x, y)
    monkeypatch.setenv("TE_JAX_FP8_TMA_CASTS", "dact+ act")
    assert tma_cast_kinds() == ("dact", "act")
    monkeypatch.setenv("TE_JAX_FP8_TMA_CASTS", "dact, act")
    assert tma_cast("dact", False, x, y) and tma_cast("act", False, x) and not tma_cast("weight", False, x)
    assert not tma_cast("dact", True, x, y)  # interpret mode
    assert not tma_cast("dact", False, x, jnp.zeros((8 * b, 2 * b + 8), BF))  # not whole tiles
    assert not tma_cast("dact", False, x, y.astype(jnp.float32))  # dtypes differ
    monkeypatch.setattr(fused, "gpu_compute_capability", lambda: (8, 0))
    assert not tma_cast("dact", False, x, y)  # not sm90: no TMA
    monkeypatch.setattr(fused, "gpu_compute_capability", lambda: (9, 0))
    monkeypatch.setenv("TE_JAX_FP8_TMA_CASTS", "dact,cuda")
    with pytest.raises(ValueError, match="TE_JAX_FP8_TMA_CASTS"):
        tma_cast("dact", False, x, y)


@pytest.mark.skipif(not ON_GPU, reason="the TMA kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("activation, gated, block", [("silu", True, 64), ("silu", True, 128), ("gelu", False, 64)])
def test_gpu_dact_tma_matches_the_triton_kernel(activation, gated, block):
    """On an sm90 GPU the TMA dact kernel (pallas_kernels/fp8_cast/tma.py) gives the Triton kernel's outputs: q and
    qT within one FP8 step of the reference, qT the transpose of q, the same amax; with owed input scales too."""
    from te_jax._compat import gpu_compute_capability
    from pallas_kernels.fp8_cast.tma import dact_cast_transpose_tma

    if (gpu_compute_capability() or (0, 0)) != (9, 0):
        pytest.skip("not sm90")
    m, f = 512, 768
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    gu = _rand(k1, (m, 2, f) if gated else (m, f), BF)
    dh = _rand(k2, (m, f), BF, scale=1.0)
    for owed in ({}, dict(gu_scale=jnp.float32(0.5), dh_scale=jnp.float32(3.0))):
        kw = dict(activation=activation, gated=gated, round_to=BF, **owed)
        scale = _scale_for(R.dact_amax(dh, gu, **kw), E5)
        q, qt, amax = dact_cast_transpose_tma(dh, gu, scale, out_dtype=E5, block=block, **kw)
        rq, _, ramax = R.dact_cast_transpose(dh, gu, scale, out_dtype=E5, **kw)
        tq, _, tamax = K.dact_cast_transpose(dh, gu, scale, out_dtype=E5, **kw)
        assert q.shape == gu.shape and qt.shape == ((2 if gated else 1) * f, m)
        _assert_fp8_close(q, rq)
        np.testing.assert_array_equal(_f32(qt), _f32(q).reshape(m, -1).T)
        np.testing.assert_allclose(amax, tamax, rtol=_AMAX_RTOL)
        np.testing.assert_allclose(amax, ramax, rtol=2.0 ** -8)


@pytest.mark.parametrize("gated", [True, False])
def test_owed_input_scales_equal_prescaled_inputs(gated):
    """gu_scale / dh_scale (a GEMM's dequantization scale applied in the kernel): the kernels read exactly what
    XLA's `(v * s).astype(bf16)` would have stored, bit for bit, and the reference agrees."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    gu = _rand(k1, (M, 2, F) if gated else (M, F), BF, scale=40.0)
    dh = _rand(k2, (M, F), BF, scale=30.0)
    s_gu, s_dh = jnp.float32(0.0371), jnp.float32(0.0213)
    pre = lambda v, s: (v.astype(jnp.float32) * s).astype(v.dtype)
    kw = dict(activation="silu", gated=gated, round_to=BF, block_m=32, block_n=16)
    scale = 7.0
    for got, want in [
        (K.act_cast(gu, scale, out_dtype=E4, transpose=True, gu_scale=s_gu, **kw),
         K.act_cast(pre(gu, s_gu), scale, out_dtype=E4, transpose=True, **kw)),
        ((K.act_amax(gu, gu_scale=s_gu, **kw),), (K.act_amax(pre(gu, s_gu), **kw),)),
        (K.dact_cast_transpose(dh, gu, scale, out_dtype=E5, gu_scale=s_gu, dh_scale=s_dh, **kw),
         K.dact_cast_transpose(pre(dh, s_dh), pre(gu, s_gu), scale, out_dtype=E5, **kw)),
        ((K.dact_amax(dh, gu, dh_scale=s_dh, **kw),), (K.dact_amax(pre(dh, s_dh), gu, **kw),)),
    ]:
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_f32(a), _f32(b))
    rkw = dict(activation="silu", gated=gated, round_to=BF)
    rq, _ = R.act_cast(gu, scale, out_dtype=E4, gu_scale=s_gu, **rkw)
    _assert_fp8_close(K.act_cast(gu, scale, out_dtype=E4, gu_scale=s_gu, **kw)[0], rq)
    rq, _, _ = R.dact_cast_transpose(dh, gu, scale, out_dtype=E5, gu_scale=s_gu, dh_scale=s_dh, **rkw)
    _assert_fp8_close(K.dact_cast_transpose(dh, gu, scale, out_dtype=E5, gu_scale=s_gu, dh_scale=s_dh, **kw)[0], rq)


@pytest.mark.parametrize("dtype, out_dtype, round_to, blocks", [
    (BF, E4, None, (16, 16)), (F32, E4, BF, (32, 64)), (F16, E5, None, (128, 64)), (F32, E5, None, (16, 32))])
def test_cast_transpose_matches_reference(dtype, out_dtype, round_to, blocks):
    x = _rand(jax.random.PRNGKey(3), (M, F), dtype)
    ref_amax = R.cast_transpose(x, 1.0, out_dtype=out_dtype, round_to=round_to)[2]
    scale = _scale_for(ref_amax, out_dtype)
    q, qt, amax = K.cast_transpose(x, scale, out_dtype=out_dtype, round_to=round_to, block_m=blocks[0],
                                   block_n=blocks[1])
    rq, rqt, _ = R.cast_transpose(x, scale, out_dtype=out_dtype, round_to=round_to)
    np.testing.assert_array_equal(_f32(q), _f32(rq))  # no activation math: bit for bit
    np.testing.assert_array_equal(_f32(qt), _f32(rqt))
    np.testing.assert_array_equal(amax, ref_amax)
    # the same as te_jax's quantize (the unfused path's cast)
    want = Q.quantize(x if round_to is None else x.astype(round_to), scale, out_dtype)
    np.testing.assert_array_equal(_f32(q), _f32(want))
    # cast_transposed: the transposed copy alone, the same bits and amax
    qt2, amax2 = K.cast_transposed(x, scale, out_dtype=out_dtype, round_to=round_to, block_m=blocks[0],
                                   block_n=blocks[1])
    np.testing.assert_array_equal(_f32(qt2), _f32(rqt))
    np.testing.assert_array_equal(amax2, ref_amax)


def test_cast_transpose_many_matches_reference():
    """Several arrays cast in one kernel (cast_transpose_many): each x_q and amax bit for bit the reference cast's
    with its own scale, and x_qT the transposes stacked; the transposed output alone (write_q=False) the same;
    mismatched rows, widths with no shared tile and a missing scale are ValueErrors naming the shapes."""
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    xs = (_rand(ks[0], (M, 64), BF), _rand(ks[1], (M, 32), BF, scale=5.0), _rand(ks[2], (M, 16), BF, scale=0.3))
    scales = [_scale_for(R.cast_transpose(x, 1.0, out_dtype=E5)[2], E5) for x in xs]
    qs, qt, amaxes = K.cast_transpose_many(xs, scales, out_dtype=E5, block_m=16, block_n=32)
    refs = [R.cast_transpose(x, s, out_dtype=E5) for x, s in zip(xs, scales)]
    for q, a, (rq, _, ra) in zip(qs, amaxes, refs):
        np.testing.assert_array_equal(_f32(q), _f32(rq))
        np.testing.assert_array_equal(a, ra)
    np.testing.assert_array_equal(_f32(qt), np.concatenate([_f32(r[1]) for r in refs]))
    none, qt2, _ = K.cast_transpose_many(xs, scales, out_dtype=E5, write_q=False, block_m=16, block_n=32)
    assert none is None
    np.testing.assert_array_equal(_f32(qt2), _f32(qt))
    with pytest.raises(ValueError, match=r"xs\[1\] has shape \(8, 32\).*expected \[M, N\] with M = 48"):
        K.cast_transpose_many((xs[0], xs[1][:8]), scales[:2], out_dtype=E5)
    with pytest.raises(ValueError, match=r"widths \[64, 24\] share no column tile"):
        K.cast_transpose_many((xs[0], xs[1][:, :24]), scales[:2], out_dtype=E5)
    with pytest.raises(ValueError, match="2 arrays and 1 scales"):
        K.cast_transpose_many(xs[:2], scales[:1], out_dtype=E5)


def _norm_problem(seed, m, n, layernorm, zero_centered, dtype):
    """(x [m, n], gamma, beta (None for RMSNorm), the norm reference's y, mean (None), rstd, a scale for y)."""
    from pallas_kernels.norms import reference as NR

    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (_rand(k[0], (m, n), F32) * 2.0 + 0.5).astype(dtype)
    g, b = _rand(k[1], (n,), F32), _rand(k[2], (n,), F32)
    if layernorm:
        y, mean, rstd = NR.layernorm_fwd(x, g, b, zero_centered_gamma=zero_centered)
    else:
        (y, rstd), mean, b = NR.rmsnorm_fwd(x, g, zero_centered_gamma=zero_centered), None, None
    return x, g, b, y, mean, rstd, _scale_for(jnp.max(jnp.abs(y.astype(F32))), E4)


@pytest.mark.parametrize("layernorm, zero_centered, dtype, blocks", [
    (True, False, BF, (16, 16)), (True, True, F32, (32, 64)), (False, True, BF, (128, 64)),
    (False, False, F16, (16, 32))])
def test_norm_cast_transpose_matches_reference(layernorm, zero_centered, dtype, blocks):
    """The norm applied in the cast kernel from the row statistics: bit for bit the norm's stored output cast (the
    norm reference's order of operations, rounded to x's dtype), and the amax of that output."""
    x, g, b, y, mean, rstd, scale = _norm_problem(7, M, F, layernorm, zero_centered, dtype)
    q, qt, amax = K.norm_cast_transpose(x, mean, rstd, g, b, scale, out_dtype=E4, zero_centered_gamma=zero_centered,
                                        block_m=blocks[0], block_n=blocks[1])
    rq, rqt, ramax = R.cast_transpose(y, scale, out_dtype=E4)
    np.testing.assert_array_equal(_f32(q), _f32(rq))
    np.testing.assert_array_equal(_f32(qt), _f32(rqt))
    np.testing.assert_array_equal(amax, ramax)
    with pytest.raises(ValueError, match="rstd"):
        K.norm_cast_transpose(x, mean, rstd[:-1], g, b, scale, out_dtype=E4)


@pytest.mark.parametrize("layernorm, zero_centered, dtype, m, n, block_n", [
    (True, False, BF, 50, 64, 16), (False, True, BF, 40, 96, 32), (True, True, F32, 33, 32, 256),
    (False, False, F16, 16, 48, 16), (False, False, BF, 37, 64, 64)])  # the last two: one chunk spans the row
def test_norm_stats_cast_transpose_matches_reference(layernorm, zero_centered, dtype, m, n, block_n):
    """The norm's statistics computed inside the cast kernel (norm_stats_cast_transpose): mean and rstd as the norm
    reference's (the same sums in another order: fp32 rounding apart), and the cast of the norm's stored output;
    a y on a rounding boundary may move by one unit of x's dtype, so q matches the reference cast except at
    such rare values, by at most one FP8 step; qT is q transposed; bad block sizes and an RMSNorm beta are errors."""
    x, g, b, y, mean, rstd, scale = _norm_problem(11, m, n, layernorm, zero_centered, dtype)
    q, qt, amax, kmean, krstd = K.norm_stats_cast_transpose(
        x, g, b, scale, rms=not layernorm, epsilon=1e-6, out_dtype=E4, zero_centered_gamma=zero_centered,
        block_m=16, block_n=block_n)
    np.testing.assert_allclose(krstd, rstd, rtol=2e-6)
    if layernorm:
        np.testing.assert_allclose(kmean, mean, rtol=1e-5, atol=1e-6)
    else:
        assert kmean is None
    rq, _, ramax = R.cast_transpose(y, scale, out_dtype=E4)
    diff = _f32(q) != _f32(rq)
    assert diff.mean() < 0.01, diff.mean()
    step = np.abs(_f32(rq)) * 2.0 ** -3 + 2.0 ** -9  # one E4M3 step at the reference's value
    assert np.all(np.abs(_f32(q) - _f32(rq)) <= step)
    np.testing.assert_array_equal(_f32(qt), _f32(q).T)
    np.testing.assert_allclose(amax, ramax, rtol=2.0 ** -7)
    with pytest.raises(ValueError, match="row length 48 is not a multiple of block_n=32"):
        K.norm_stats_cast_transpose(jnp.ones((16, 48), BF), jnp.ones(48), None, scale, rms=True, epsilon=1e-6,
                                    out_dtype=E4, block_n=32)
    with pytest.raises(ValueError, match="RMSNorm takes no beta"):
        K.norm_stats_cast_transpose(x, g, g, scale, rms=True, epsilon=1e-6, out_dtype=E4)
    with pytest.raises(ValueError, match=r"x \(16, 48\) has rows of 48, at most block_n=64.* not a power of two"):
        K.norm_stats_cast_transpose(jnp.ones((16, 48), BF), jnp.ones(48), None, scale, rms=True, epsilon=1e-6,
                                    out_dtype=E4, block_n=64)


def test_saturation_nan_and_inf():
    x = jnp.array([[1e30, -1e30, 3.0, 0.0], [np.nan, 2.0, -np.inf, 1.0]], F32)
    q, qt, amax = K.cast_transpose(x, 1.0, out_dtype=E4)
    qf = _f32(q)
    np.testing.assert_array_equal(qf[0], [448, -448, 3, 0])
    assert np.isnan(qf[1, 0]) and qf[1, 2] == -448  # NaN stays NaN, -inf saturates
    assert float(amax) == np.inf  # a NaN reads as +inf: non-finite, as the recipes need
    gu = jnp.zeros((2, 2, 4), BF).at[0, 0, 0].set(np.nan)
    assert float(K.act_amax(gu, activation="silu", gated=True)) == np.inf
    assert float(K.act_amax(jnp.zeros((2, 2, 4), BF), activation="silu", gated=True)) == 0.0


def test_bad_arguments_are_clear_errors():
    gu = jnp.ones((8, 2, 16), BF)
    with pytest.raises(ValueError, match="power of two"):
        K.act_cast(gu, 1.0, activation="silu", gated=True, out_dtype=E4, block_m=24)
    with pytest.raises(ValueError, match=r"\[M, 2, F\]"):
        K.act_cast(gu[:, 0], 1.0, activation="silu", gated=True, out_dtype=E4)
    with pytest.raises(ValueError, match="activation"):
        K.act_cast(gu, 1.0, activation="swish", gated=True, out_dtype=E4)
    with pytest.raises(ValueError, match="out_dtype"):
        K.cast_transpose(gu[:, 0], 1.0, out_dtype=BF)
    with pytest.raises(ValueError, match="dh has shape"):
        K.dact_cast_transpose(gu[:, 0, :8], gu, 1.0, activation="gelu", gated=True, out_dtype=E5)


# --- the fused MLP --------------------------------------------------------------------------------

def _unfused(x, w1, w2, s1, s2, recipe, acts):
    """Today's unfused path: fp8_dot_general, te_jax's activation (stored in x.dtype), fp8_dot_general."""
    dt = x.dtype
    h = Q.fp8_dot_general(x, w1.astype(dt), (((x.ndim - 1,), (0,)), ((), ())), recipe, s1)
    a = A.biased_activation_dropout(h, None, acts, 0.0, None, dt)
    return Q.fp8_dot_general(a, w2.astype(dt), (((a.ndim - 1,), (0,)), ((), ())), recipe, s2)


def _fused(x, w1, w2, s1, s2, recipe, acts):
    return fused_fp8_mlp(x, w1, w2, recipe, s1, s2, activations=acts)


def _fp32_mlp(x, w1, w2, acts):
    hp = lax.Precision.HIGHEST
    h = jnp.einsum("btd,dnf->btnf", x, w1, precision=hp)
    return jnp.einsum("btf,fe->bte", A.apply_activations(h, acts), w2, precision=hp)


def _problem(acts, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (2, M // 2, D)).astype(dtype)
    w1 = jax.random.normal(ks[1], (D, len(acts), F)) * D ** -0.5
    w2 = jax.random.normal(ks[2], (F, D)) * F ** -0.5
    g = jax.random.normal(ks[3], (2, M // 2, D)).astype(dtype)
    return x, w1, w2, g


def _steps(fn, recipe, acts, x, w1, w2, g, n=2, **jit_kw):
    """n consecutive steps (each one's new delayed-scaling state feeds the next): [(y, dx, dw1, dw2, s1, s2)]."""
    step = jax.jit(lambda x, w1, w2, s1, s2, g: (lambda y, vjp: (y, *vjp(g)))(
        *jax.vjp(lambda *a: fn(*a, recipe, acts), x, w1, w2, s1, s2)), **jit_kw)
    s1 = s2 = Q.init_state(recipe.amax_history_len) if isinstance(recipe, DelayedScaling) else None
    out = []
    for _ in range(n):
        y, dx, dw1, dw2, s1, s2 = step(x, w1, w2, s1, s2, g)
        out.append((y, dx, dw1, dw2, s1, s2))
    return out


def _rel(a, b):
    a, b = _f32(a).astype(np.float64), _f32(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("acts, recipe", [
    (("silu", "linear"), DelayedScaling(amax_history_len=3)),
    (("gelu", "linear"), Float8CurrentScaling()),
    (("gelu",), DelayedScaling(amax_history_len=2, margin=1, amax_compute_algo="most_recent")),
], ids=["swiglu-delayed", "geglu-current", "gelu-delayed"])
def test_fused_mlp_equals_the_unfused_fp8_path(acts, recipe):
    """Same quantized math: output, dx, dw1, dw2 and the updated delayed-scaling state are bitwise equal over
    two state-updating steps (under jit, XLA's excess precision off in both; on a GPU within rounding noise)."""
    x, w1, w2, g = _problem(acts, BF)
    fused = _steps(_fused, recipe, acts, x, w1, w2, g, compiler_options=EXACT)
    unfused = _steps(_unfused, recipe, acts, x, w1, w2, g, compiler_options=EXACT)
    for step_f, step_u in zip(fused, unfused):
        for name, a, b in zip(("y", "dx", "dw1", "dw2"), step_f, step_u):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            if ON_GPU:  # Triton's exp / tanh are not XLA's: an FP8 step apart here and there
                assert _rel(a, b) < 2.0 ** -5, (name, _rel(a, b))
            else:
                np.testing.assert_array_equal(_f32(a), _f32(b), err_msg=name)
        check = (lambda a, b: np.testing.assert_allclose(a, b, rtol=2.0 ** -6)) if ON_GPU else (
            np.testing.assert_array_equal)
        jax.tree_util.tree_map(check, step_f[4:], step_u[4:])
    _assert_near_fp32(fused, acts, x, w1, w2, g)
    if isinstance(recipe, DelayedScaling):
        s1, s2 = fused[0][4:]
        assert float(s2["input_scale"][0]) != 1.0 and float(s1["output_grad_scale"][0]) != 1.0
        # wo's input amax is amax(a), wi's output-grad amax is amax(dgu) (a history's last slot after a step)
        assert float(s2["input_amax_history"][-1]) > 0 and float(s1["output_grad_amax_history"][-1]) > 0


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=3),
                                    pytest.param(Float8CurrentScaling(), marks=pytest.mark.slow)],
                         ids=["delayed", "current"])
def test_kept_weight_copies_equal_the_recast(recipe, monkeypatch):
    """TE_JAX_FP8_KEEP_WEIGHTS=1 (the default for delayed scaling): the forward's cast writes w_q beside w_qT and the backward uses it. The values are
    the re-cast's (same scale, same rounding): y, dx, dw1, dw2 and the states equal the default path's over two
    steps and lie within FP8 error of the fp32 MLP; the step has two fewer weight-shaped FP8 casts outside the
    kernels (the backward's re-casts); LayerNormMLP's explanation names it; a bad setting is a ValueError."""
    acts = ("silu", "linear")
    x, w1, w2, g = _problem(acts, BF)

    def run(keep):
        monkeypatch.setenv("TE_JAX_FP8_KEEP_WEIGHTS", keep)
        steps = _steps(_fused, recipe, acts, x, w1, w2, g, compiler_options=EXACT)
        s = Q.init_state(3) if isinstance(recipe, DelayedScaling) else None
        jaxpr = jax.make_jaxpr(lambda x, w1, w2, s1, s2, g: jax.vjp(lambda *a: _fused(*a, recipe, acts), x, w1, w2,
                                                                    s1, s2)[1](g))(x, w1, w2, s, s, g)
        shapes = {(w1.shape[0], w1.shape[1] * w1.shape[2]), tuple(w2.shape)}
        casts = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "convert_element_type"
                 and jnp.dtype(e.params["new_dtype"]).itemsize == 1 and tuple(e.outvars[0].aval.shape) in shapes]
        return steps, len(casts)

    kept, n_kept = run("1")
    recast, n_recast = run("0")
    for step_k, step_r in zip(kept, recast):
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(_f32(a), _f32(b)), step_k, step_r)
    assert n_recast - n_kept == 2, (n_recast, n_kept)
    _assert_near_fp32(kept, acts, x, w1, w2, g)  # and within FP8 error of the fp32 MLP computed without FP8
    m, xm = _mlp_module(), jax.random.normal(jax.random.PRNGKey(3), (2, M // 2, D))
    monkeypatch.setenv(FUSED_ENV, "1")
    monkeypatch.setenv("TE_JAX_FP8_KEEP_WEIGHTS", "1")
    with fp8.autocast(recipe=recipe):
        v = jax.jit(lambda k: m.init(k, xm, deterministic=True))(jax.random.PRNGKey(0))
        info = fp8.explain(lambda: m.apply(v, xm, deterministic=True))
        assert info and all("copies kept for the backward" in i.reason for i in info), info
    monkeypatch.setenv("TE_JAX_FP8_KEEP_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="TE_JAX_FP8_KEEP_WEIGHTS='yes' must be one of"):
        _fused(x, w1, w2, None, None, Float8CurrentScaling(), acts)
    monkeypatch.delenv("TE_JAX_FP8_KEEP_WEIGHTS")  # the default, "auto": kept for delayed scaling only
    from te_jax.fp8.fused import keep_weight_copies
    assert keep_weight_copies(DelayedScaling()) and not keep_weight_copies(Float8CurrentScaling())


def _all_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (custom VJPs, pjit, ...)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def _assert_near_fp32(steps, acts, x, w1, w2, g):
    """Each step within FP8 error of the fp32 non-FP8 MLP (E5M2 gradients and a small F: 5-20% here)."""
    y0, vjp0 = jax.vjp(lambda x, w1, w2: _fp32_mlp(x, w1, w2, acts), x.astype(F32), w1, w2)
    ref = (y0, *vjp0(g.astype(F32)))
    for step in steps:
        for name, a, r, tol in zip(("y", "dx", "dw1", "dw2"), step, ref, (2**-3, 2**-2, 2**-2, 2**-3)):
            assert np.all(np.isfinite(_f32(a))), name
            assert _rel(a, r) < tol, (name, _rel(a, r))


def test_fused_mlp_against_fp32_and_unfused_default_jit():
    """Default jit options (non-gated relu, delayed scaling): within FP8 error of the fp32 MLP, and close to the
    unfused path (which may then skip some bf16 roundings); the second step uses the scales of the first."""
    acts, recipe = ("relu",), DelayedScaling(amax_history_len=4)
    x, w1, w2, g = _problem(acts, BF, seed=1)
    fused = _steps(_fused, recipe, acts, x, w1, w2, g)
    unfused = _steps(_unfused, recipe, acts, x, w1, w2, g)
    _assert_near_fp32(fused, acts, x, w1, w2, g)
    # Each path is within FP8 error of fp32 (above); between them a value that one path rounds in bf16 and the other
    # does not can land on the neighbouring FP8 value (spacing 2^-3 relative in E4M3), and the GEMMs accumulate in
    # their own orders: the H100 gave 0.033 on one run (2026-11-27), so the bound is 2^-4, not 2^-5.
    for step_f, step_u in zip(fused, unfused):
        for name, a, b in zip(("y", "dx", "dw1", "dw2"), step_f, step_u):
            assert _rel(a, b) < 2**-4, (name, _rel(a, b))
    assert fused[1][2].dtype == w1.dtype and fused[1][3].dtype == w2.dtype  # gradients in the weights' dtype


def test_fused_mlp_gemms_are_tn_fp8_dots():
    """Every GEMM of the fused forward + backward: dot_general on float8 operands, both contracting dims minor
    ("TN", cuBLASLt FP8's layout), DEFAULT precision, output in the compute dtype."""
    acts, recipe = ("silu", "linear"), DelayedScaling(amax_history_len=2)
    x, w1, w2, g = _problem(acts, BF)
    s = Q.init_state(2)
    f = lambda x, w1, w2, s1, s2, g: (lambda y, vjp: (y, vjp(g)))(
        *jax.vjp(lambda *a: _fused(*a, recipe, acts), x, w1, w2, s1, s2))
    text = jax.jit(f).lower(x, w1, w2, s, s, g).as_text()
    dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
    assert len(dots) == 6, dots
    for d in dots:
        assert "contracting_dims = [1] x [1]" in d and "batching_dims" not in d, d
        assert "precision = [DEFAULT, DEFAULT]" in d, d
        assert d.count("xf8E4M3FN>") + d.count("xf8E5M2>") == 2 and d.rstrip().endswith("xbf16>"), d


def test_fused_mlp_wgrad_qdq_style(monkeypatch):
    """TE_JAX_FP8_GEMM=wgrad_qdq: the two weight-gradient GEMMs take dequantized (bf16) operands, the other four
    stay FP8 dots; the values are direct's to bf16 rounding."""
    acts, recipe = ("silu", "linear"), DelayedScaling(amax_history_len=2)
    x, w1, w2, g = _problem(acts, BF, seed=2)
    outs = {}
    for style in ("direct", "wgrad_qdq"):
        monkeypatch.setenv("TE_JAX_FP8_GEMM", style)
        step = jax.jit(lambda x, w1, w2, s1, s2, g: (lambda y, vjp: (y, *vjp(g)))(
            *jax.vjp(lambda *a: _fused(*a, recipe, acts), x, w1, w2, s1, s2)))
        s = Q.init_state(2)
        outs[style] = step(x, w1, w2, s, s, g)
        dots = [ln for ln in step.lower(x, w1, w2, s, s, g).as_text().splitlines() if "stablehlo.dot_general" in ln]
        f8 = [d for d in dots if "xf8E" in d.split("->")[0]]
        assert len(dots) == 6 and len(f8) == (6 if style == "direct" else 4), (style, dots)
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), outs["direct"], outs["wgrad_qdq"]):
        assert _rel(b, a) < 2.0 ** -7, (name, _rel(b, a))


# --- the Flax path --------------------------------------------------------------------------------

def _mlp_module(**kw):
    return LayerNormMLP(intermediate_dim=F, activations=("silu", "linear"), intermediate_dropout_rate=0.0, dtype=BF,
                        **{"layernorm_type": "rmsnorm", **kw})


@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
def test_norm_statistics_in_the_cast_kernel(layernorm_type, monkeypatch):
    """TE_JAX_FP8_NORM_STATS=kernel under delayed scaling: LayerNormMLP's norm statistics come from its cast kernel
    (norm_stats_cast_transpose is in the traced step, norm_cast_transpose is not), and the step's loss, gradients and
    next FP8 state equal the default path's (statistics from XLA) up to fp32 summation order; "xla" keeps the old
    kernels."""
    from jaxpr_walk import walk

    m = _mlp_module(layernorm_type=layernorm_type)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, M // 2, D)) * 3.0 + 1.0
    ct = jax.random.normal(jax.random.PRNGKey(4), (2, M // 2, D))
    recipe = DelayedScaling(amax_history_len=4)
    monkeypatch.setenv(FUSED_ENV, "1")

    def loss(v, x):
        return jnp.sum(m.apply(v, x, deterministic=True)[0].astype(F32) * ct)

    def run(setting):
        monkeypatch.setenv("TE_JAX_FP8_NORM_STATS", setting)
        with fp8.autocast(recipe=recipe):
            v = nn.meta.unbox(jax.jit(lambda k: m.init(k, x, deterministic=True))(jax.random.PRNGKey(1)))
            step = jax.value_and_grad(loss, argnums=(0, 1))
            names = {str(getattr(e.params.get("name_and_src_info"), "name", e.params.get("name")))
                     for e in walk(jax.make_jaxpr(step)(v, x).jaxpr) if e.primitive.name == "pallas_call"}
            return names, jax.jit(step, compiler_options=EXACT)(v, x)

    names1, (y1, (gv1, gx1)) = run("kernel")
    names0, (y0, (gv0, gx0)) = run("xla")
    assert any("norm_stats" in n for n in names1) and not any("norm_cast" in n for n in names1), names1
    assert any("norm_cast" in n for n in names0) and not any("norm_stats" in n for n in names0), names0
    assert abs(float(y1) - float(y0)) <= 1e-5 * abs(float(y0)) + 1e-6
    assert _rel(gx1, gx0) < 1e-4
    for a, b in zip(jax.tree_util.tree_leaves(gv1), jax.tree_util.tree_leaves(gv0)):
        assert _rel(a, b) < 1e-4


def test_layernorm_mlp_runs_fused_and_the_switch_turns_it_off(monkeypatch):
    """LayerNormMLP under a per-tensor recipe takes the fused path (on a GPU, or anywhere with
    TE_JAX_FP8_FUSED=1) and explain says so; TE_JAX_FP8_FUSED=0 (read at trace time) gives the unfused
    path with the same result and state (excess precision off)."""
    m = _mlp_module()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, M // 2, D))
    recipe = DelayedScaling(amax_history_len=3)

    def run():
        with fp8.autocast(recipe=recipe):
            info = fp8.explain(lambda: m.init(jax.random.PRNGKey(1), x, deterministic=True))
            v = jax.jit(lambda k: m.init(k, x, deterministic=True))(jax.random.PRNGKey(1))
            f = jax.jit(jax.grad(lambda v, x: jnp.sum(m.apply(v, x, deterministic=True)[0].astype(F32) ** 2),
                                 argnums=(0, 1)), compiler_options=EXACT)
            return info, f(v, x)

    if jax.default_backend() != "gpu":
        monkeypatch.delenv(FUSED_ENV, raising=False)  # auto: off a GPU the unfused path, and explain says why
        with fp8.autocast(recipe=recipe):
            auto = fp8.explain(lambda: m.init(jax.random.PRNGKey(1), x, deterministic=True))
        assert all("unfused FP8 MLP: backend" in i.reason and "interpret mode" in i.reason for i in auto), auto
        monkeypatch.setenv(FUSED_ENV, "1")
    info, (gv, gx) = run()
    assert [i.gemm for i in info] == ["wi_kernel", "wo_kernel"]
    assert all(i.fp8 and "fused FP8 MLP" in i.reason and "unfused" not in i.reason for i in info), info
    monkeypatch.setenv(FUSED_ENV, "0")
    info0, (gv0, gx0) = run()
    assert all(i.fp8 and f"unfused FP8 MLP: {FUSED_ENV}=0" in i.reason for i in info0), info0
    if ON_GPU:
        assert _rel(gx, gx0) < 2.0 ** -5
    else:
        np.testing.assert_array_equal(gx, gx0)
        # bitwise, but the norm's gamma: the fused path (norm inside x's cast, te_jax/fp8/norm_cast.py) sums its
        # gradient over the rows in another order (f32 rounding)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nn.meta.unbox(gv)),
                                jax.tree_util.tree_leaves(nn.meta.unbox(gv0))):
            if "scale" in jax.tree_util.keystr(path) and "fp8" not in jax.tree_util.keystr(path):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=0, err_msg=jax.tree_util.keystr(path))
            else:
                np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    new = gv[fp8.FP8_COLLECTION]["wo_fp8_meta"]
    assert float(new["input_amax_history"][-1]) > 0 and float(new["output_grad_scale"][0]) != 1.0
    monkeypatch.setenv(FUSED_ENV, "2")
    with pytest.raises(ValueError, match=FUSED_ENV):
        run()


@pytest.mark.parametrize("layernorm_type, zero_centered, norm_backend, recipe", [  # two cases cover every option
    ("layernorm", True, "pallas", Float8CurrentScaling()),
    ("rmsnorm", False, "xla", DelayedScaling(amax_history_len=3)),
])
def test_norm_fused_into_the_cast_matches_the_unfused_path(layernorm_type, zero_centered, norm_backend, recipe,
                                                          monkeypatch):
    """The fused path applies the norm inside x's cast (te_jax/fp8/norm_cast.py; its output is never stored) and
    its backward runs the norm's own backend on the saved statistics: output, dx, dgamma, dbeta and the FP8 state
    equal the unfused path's (norm, then cast) up to f32 summation order, for LayerNorm / RMSNorm, zero-centered
    gamma or not, both backward backends and both per-tensor recipes; and both are within FP8 error of the same
    MLP without FP8."""
    m = _mlp_module(layernorm_type=layernorm_type, zero_centered_gamma=zero_centered, backend=norm_backend)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, M // 2, D)) * 3.0 + 1.0
    ct = jax.random.normal(jax.random.PRNGKey(4), (2, M // 2, D))

    def loss(v, x):
        return jnp.sum(m.apply(v, x, deterministic=True)[0].astype(F32) * ct)

    def run(setting, fp8_on=True):
        monkeypatch.setenv(FUSED_ENV, setting)
        with fp8.autocast(enabled=fp8_on, recipe=recipe):
            v = nn.meta.unbox(jax.jit(lambda k: m.init(k, x, deterministic=True))(jax.random.PRNGKey(1)))
            p = dict(v["params"])  # gamma and beta away from their init, so that their use is tested
            p = {**p, "scale": p["scale"] + 0.3 * jax.random.normal(jax.random.PRNGKey(5), p["scale"].shape)}
            if "ln_bias" in p:
                p["ln_bias"] = p["ln_bias"] + 0.2
            v = {**v, "params": p}
            info = fp8.explain(lambda: m.apply(v, x, deterministic=True))
            return info, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), compiler_options=EXACT)(v, x)

    info, (y1, (gv1, gx1)) = run("1")
    assert all("the norm fused into x's cast" in i.reason for i in info), info
    _, (y0, (gv0, gx0)) = run("0")
    _, (yr, (gvr, gxr)) = run("0", fp8_on=False)
    # GPU: the unfused path's GEMM folds its scale (rounded to bf16) into cuBLASLt, the fused path hands the f32
    # scale to its cast kernel, so the two roundings flip some FP8 casts downstream (3.6% on dx on the H100)
    tol = 2.0 ** -4 if ON_GPU else 1e-5
    assert abs(float(y1) - float(y0)) <= tol * abs(float(y0)) + 1e-6
    assert _rel(gx1, gx0) < tol
    for name in ("scale", "ln_bias", "wi_kernel", "wo_kernel"):
        if name in gv0["params"]:
            assert _rel(gv1["params"][name], gv0["params"][name]) < tol, name
            assert _rel(gv1["params"][name], gvr["params"][name]) < 0.15, name  # FP8 against no FP8
    assert _rel(gx1, gxr) < 0.15
    if isinstance(recipe, DelayedScaling):
        for meta in ("wi_fp8_meta", "wo_fp8_meta"):
            for k, a in gv0[fp8.FP8_COLLECTION][meta].items():
                np.testing.assert_allclose(gv1[fp8.FP8_COLLECTION][meta][k], a, rtol=1e-6, err_msg=f"{meta}/{k}")


@pytest.mark.parametrize("kw, recipe, why", [
    (dict(use_bias=True), Float8CurrentScaling(), "biases"),
    (dict(), Float8BlockScaling(x_block=16, w_block=16), "the FP8 block GEMM is off"),  # the CPU: no block GEMM
    (dict(intermediate_dropout_rate=0.1), Float8CurrentScaling(), "dropout"),
])
def test_layernorm_mlp_explains_why_not_fused(kw, recipe, why, monkeypatch):
    monkeypatch.setenv(FUSED_ENV, "1")  # the reasons below win over a forced fused path
    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "xla")  # the block GEMM off on any backend (a GPU would take it)
    m = _mlp_module(**kw) if "intermediate_dropout_rate" not in kw else LayerNormMLP(
        intermediate_dim=F, activations=("gelu",), dtype=BF, **kw)
    x = jnp.ones((2, 8, D))
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    with fp8.autocast(recipe=recipe):
        info = fp8.explain(lambda: m.init(rngs, x, deterministic=False))
    assert [i.gemm for i in info] == ["wi_kernel", "wo_kernel"]
    assert all("unfused FP8 MLP" in i.reason and why in i.reason for i in info), info


def test_layernorm_mlp_under_a_partitioned_mesh_is_not_fused(monkeypatch):
    """Under a mesh XLA partitions, the Pallas kernels would run replicated: the unfused path runs, and says so."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    monkeypatch.setenv(FUSED_ENV, "1")
    m = _mlp_module()
    x = jnp.ones((2, 8, D))
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh), fp8.autocast(recipe=Float8CurrentScaling()):
        info = fp8.explain(lambda: m.init(jax.random.PRNGKey(0), x, deterministic=True))
    assert all("unfused FP8 MLP" in i.reason and "XLA partitions" in i.reason for i in info), info


def _gpu_mlp_inputs(seed: int):
    """(x [2, 128, 256], w1 [256, 2, 512], w2 [512, 256], the output cotangent) bf16 for the GPU MLP tests."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (2, 128, 256)).astype(BF)
    w1 = (jax.random.normal(ks[1], (256, 2, 512)) * 256 ** -0.5).astype(BF)
    w2 = (jax.random.normal(ks[2], (512, 256)) * 512 ** -0.5).astype(BF)
    return x, w1, w2, jax.random.normal(ks[3], x.shape).astype(BF)


@pytest.mark.skipif(not ON_GPU, reason="cuBLASLt FP8 GEMMs and compiled Triton kernels need a GPU")
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_gpu_fused_mlp_compiles_to_six_fp8_gemms(recipe):
    """On an FP8-capable GPU the fused MLP's six GEMMs (wi, wo x fprop, dgrad, wgrad) are FP8 GEMMs, none other,
    with the cast kernels as Triton calls; its step agrees with the unfused path's."""
    from te_jax._compat import gpu_compute_capability
    from te_jax.fp8.hlo import gemm_kinds

    if (gpu_compute_capability() or (0, 0)) < (8, 9):
        pytest.skip("GPU without FP8 tensor cores")
    acts = ("silu", "linear")
    x, w1, w2, g = _gpu_mlp_inputs(0)
    s = Q.init_state(16) if isinstance(recipe, DelayedScaling) else None
    f = jax.jit(lambda x, w1, w2, s1, s2, g: (lambda y, vjp: (y, *vjp(g)))(
        *jax.vjp(lambda *a: _fused(*a, recipe, acts), x, w1, w2, s1, s2)))
    lowered = f.lower(x, w1, w2, s, s, g)
    # six casts, + 2 state updates (delayed: pallas_kernels/fp8_cast/history.py) or 2 amax-only passes (current)
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 8
    kinds = gemm_kinds(lowered.compile().as_text())
    assert kinds["other"] == 0 and kinds["fp8 cublaslt"] + kinds["fp8 fusion"] == 6, kinds
    fused = _steps(_fused, recipe, acts, x, w1, w2, g)
    unfused = _steps(_unfused, recipe, acts, x, w1, w2, g)
    for step_f, step_u in zip(fused, unfused):
        for name, a, b in zip(("y", "dx", "dw1", "dw2"), step_f, step_u):
            assert np.all(np.isfinite(_f32(a))) and _rel(a, b) < 2.0 ** -4, (name, _rel(a, b))


@pytest.mark.skipif(not ON_GPU, reason="the TMA kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("kinds", ["dact", "act,dact,weight,cast"])
def test_gpu_fused_mlp_with_the_tma_casts(kinds, monkeypatch):
    """TE_JAX_FP8_TMA_CASTS: the fused MLP's steps (delayed scaling, the state carried) equal the default's with the
    listed casts on their TMA kernels."""
    from te_jax._compat import gpu_compute_capability

    if (gpu_compute_capability() or (0, 0)) != (9, 0):
        pytest.skip("not sm90")
    acts = ("silu", "linear")
    x, w1, w2, g = _gpu_mlp_inputs(1)
    recipe = DelayedScaling(amax_history_len=16)
    monkeypatch.delenv("TE_JAX_FP8_TMA_CASTS", raising=False)
    want = _steps(_fused, recipe, acts, x, w1, w2, g)
    monkeypatch.setenv("TE_JAX_FP8_TMA_CASTS", kinds)
    got = _steps(_fused, recipe, acts, x, w1, w2, g)
    for step_g, step_w in zip(got, want):
        for name, a, b in zip(("y", "dx", "dw1", "dw2"), step_g, step_w):
            assert np.all(np.isfinite(_f32(a))) and _rel(a, b) < 2.0 ** -6, (name, _rel(a, b))


def test_cast_launch_overrides_from_the_environment(monkeypatch):
    """TE_JAX_FP8_CAST_LAUNCH replaces a kind's launch options on a compiled launch (not in interpret mode); bad
    kinds, keys and values are ValueErrors naming the variable."""
    from te_jax.fp8 import fused
    monkeypatch.setenv(fused.LAUNCH_ENV, "norm_stats:block_m=8+block_n=4096 cast:")
    assert fused.launch_options("norm_stats", False) == dict(block_m=8, block_n=4096)
    assert fused.launch_options("cast", False) == {}
    assert fused.launch_options("act", False) == fused.KERNEL_OPTIONS["act"]
    assert fused.launch_options("norm_stats", True) == {}
    # the FP8 paths' static configurations carry the value, so traces under two values are cached apart
    from te_jax.fp8 import mlp as fp8_mlp
    from te_jax.fp8 import quantize
    from te_jax.fp8.recipe import DelayedScaling
    cfgs = []
    for value in ("cast:block_m=64", "cast:block_m=32"):
        monkeypatch.setenv(fused.LAUNCH_ENV, value)
        cfgs.append((quantize._TNCfg(DelayedScaling(), None, BF, "direct", None, BF),
                     fp8_mlp._Cfg(DelayedScaling(), "silu", True, "direct", BF, BF, None)))
    assert cfgs[0][0] != cfgs[1][0] and cfgs[0][1] != cfgs[1][1]
    assert cfgs[0][0].launch == "cast:block_m=64"
    for bad in ("nrm:block_m=8", "norm_stats:bm=8", "cast:block_m=x", "cast", "act:block_m=8,num_warps=4"):
        monkeypatch.setenv(fused.LAUNCH_ENV, bad)
        with pytest.raises(ValueError, match="TE_JAX_FP8_CAST_LAUNCH"):
            fused.launch_options("cast", False)


@pytest.mark.parametrize("opts", [dict(block_m=16, block_n=32), dict(block_m=8, block_n=4096), dict(block_n=48)])
def test_norm_stats_launch_options_keep_the_values(monkeypatch, opts):
    """stats_and_cast under launch options (a column chunk, a block_n past the row: one chunk spans it, a chunk that
    does not divide the row and falls back to stats_block): the statistics and FP8 values of the kernel's defaults
    (sums in another order: rstd to fp32 rounding, a value on a rounding boundary one FP8 step away), qT = q
    transposed."""
    from te_jax.fp8 import norm_cast
    x, g, _, _, _, _, scale = _norm_problem(5, 24, 64, False, False, BF)
    spec = norm_cast.norm_spec(x, g, None, layernorm_type="rmsnorm", epsilon=1e-6, zero_centered_gamma=False,
                               backend="auto")
    want = norm_cast.stats_and_cast(x, g, None, scale, spec, E4, interpret=True)
    seen = []
    real = norm_cast.norm_stats_cast_transpose
    monkeypatch.setattr(norm_cast, "norm_stats_cast_transpose", lambda *a, **kw: seen.append(kw["block_n"]) or
                        real(*a, **kw))
    wide, gw = _norm_problem(6, 8, 512, False, False, BF)[:2]
    norm_cast.stats_and_cast(wide, gw, None, scale, spec, E4, interpret=True)
    assert seen == [256]  # no launch options: stats_block's chunks, not the whole 512-wide row
    monkeypatch.setattr(norm_cast, "launch_options", lambda kind, interpret: dict(opts))
    got = norm_cast.stats_and_cast(x, g, None, scale, spec, E4, interpret=True)
    assert seen[1] == {32: 32, 4096: 64, 48: 64}[opts["block_n"]]  # 48 does not divide 64: stats_block's 64
    np.testing.assert_allclose(got[3][1], want[3][1], rtol=2e-6)
    q, wq = _f32(got[0]), _f32(want[0])
    assert np.mean(q != wq) < 0.01
    assert np.all(np.abs(q - wq) <= np.abs(wq) * 2.0 ** -3 + 2.0 ** -9)
    np.testing.assert_array_equal(_f32(got[1]), q.T)
    np.testing.assert_allclose(got[2], want[2], rtol=2.0 ** -7)
