"""The block-scaled FP8 MLP with fused activation casts (te_jax/fp8/block_mlp.py over
pallas_kernels/fp8_gemm/act_cast.py): the kernels against quantize_blocks of XLA's activation, the fused MLP against
the unfused block path and fp32, and LayerNormMLP's dispatch. The GEMM runs as its jnp reference
(TE_JAX_FP8_BLOCK_GEMM=emulate); the cast kernels in interpret mode (TE_JAX_FP8_FUSED=1)."""
import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_gemm import act_block_cast, dact_block_cast_transpose, quantize_blocks

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF = jnp.bfloat16


def _as_f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _rows_casts(v, dtype):
    """block_cast_transpose(v, tiles="rows")'s outputs by quantize_blocks: (q, [C/128, R], q^T, [R/128, C])."""
    q, s = quantize_blocks(v, (1, 128), dtype)
    qt, st = quantize_blocks(v.T, (1, 128), dtype)
    return q, s.T, qt, st.T


def _act_ref(gu, activation, gated):
    """te_jax's activation (pallas_kernels.ln_mlp.activations, what the unfused path runs) in fp32."""
    from pallas_kernels.ln_mlp.activations import ACTIVATIONS

    g = gu[:, 0].astype(jnp.float32)
    fn = ACTIVATIONS[activation]
    return (fn(g) * gu[:, 1].astype(jnp.float32)) if gated else fn(g)


def _on_sm90():
    from te_jax.backends.pallas import hopper_device_reason

    return jax.default_backend() == "gpu" and hopper_device_reason() is None


def _mlp_case(seed, batch, d, f, dout):
    """x [batch, 128, d], w1 [d, 2, f], w2 [f, dout], the output cotangent g (bf16, random)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, 128, d)), BF)
    w1 = jnp.asarray(rng.standard_normal((d, 2, f)) * d ** -0.5, BF)
    w2 = jnp.asarray(rng.standard_normal((f, dout)) * f ** -0.5, BF)
    g = jnp.asarray(rng.standard_normal((batch, 128, dout)), BF)
    return x, w1, w2, g


def _fused_mlp_step(recipe, x, w1, w2, g):
    """(y, dx, dw1, dw2) of the fused block SwiGLU MLP, jitted (settings read now: a fresh trace per call)."""
    from te_jax.fp8.block_mlp import fused_block_fp8_mlp

    fn = lambda x, w1, w2: fused_block_fp8_mlp(x, w1, w2, recipe, activations=("silu", "linear"))  # noqa: E731
    return jax.jit(lambda x, w1, w2: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(fn, x, w1, w2)))(x, w1, w2)


def _rel(a, b):
    a, b = a.astype(jnp.float32).ravel(), b.astype(jnp.float32).ravel()
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _assert_same_casts(got, want, max_mismatch):
    """q and q^T: at most max_mismatch of the elements differ; the scales agree to bf16 rounding. On a GPU (the
    kernel compiled by Triton, not interpreted) up to 5% of the FP8 values may sit one FP8 step from XLA's: on the
    H100 2.2% of the activation kernel's did (its fp32 math rounds differently near FP8 rounding midpoints);
    neither side is more exact."""
    on_gpu = jax.default_backend() == "gpu"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape, a.dtype, b.dtype)
        fa, fb = _as_f32(a), _as_f32(b)
        if i % 2:  # scales
            np.testing.assert_allclose(fa, fb, rtol=2 ** -7 if max_mismatch or on_gpu else 0)
            continue
        mismatch = np.mean(fa != fb)
        assert mismatch <= (max(max_mismatch, 0.05) if on_gpu else max_mismatch), (i, mismatch)
        step = 2.0 ** -(jnp.finfo(a.dtype).nmant)  # one FP8 step, relative
        # plus an absolute 2^-16 of the FP8 range (each tile's largest value maps to fp8_max): near a zero of
        # gelu's derivative, fp32 rounding of the activation math moves dgu by a large factor of a tiny value
        tiny = 2.0 ** -16 * float(jnp.finfo(a.dtype).max)
        assert np.all(np.abs(fa - fb) <= step * np.maximum(np.abs(fa), np.abs(fb)) + tiny), i


# silu: exact. gelu (tanh): XLA's CPU tanh differs in its last bits between fusions, so a few elements round to
# the neighbouring bf16 value before the cast
@pytest.mark.parametrize("activation,gated,dtype,max_mismatch", [("silu", True, E4, 0.0), ("gelu", False, E5, 1e-2),
                                                                 ("relu", True, E5, 0.0)])
def test_activation_block_casts_match_quantize_blocks(activation, gated, dtype, max_mismatch):
    """act_block_cast and dact_block_cast_transpose give quantize_blocks' values and scales (both layouts) of the
    activation / its gradient computed by jax (autodiff for the gradient) and rounded to bf16."""
    m, f, n = 256, 384, 2 if gated else 1
    k1, k2 = jax.random.split(jax.random.key(3))
    gu = (jax.random.normal(k1, (m, n, f)) * 3).astype(BF)
    dh = jax.random.normal(k2, (m, f)).astype(BF)
    got = act_block_cast(gu, activation=activation, out_dtype=dtype, round_to=BF, interpret=True)
    _assert_same_casts(got, _rows_casts(_act_ref(gu, activation, gated).astype(BF), dtype), max_mismatch)
    parts = jax.vjp(lambda gu: _act_ref(gu, activation, gated), gu.astype(jnp.float32))[1](dh.astype(jnp.float32))[0]
    dgu = parts.astype(BF).reshape(m, n * f)  # [M, n, F] -> [M, n*F]: gate columns, then up
    got = dact_block_cast_transpose(dh, gu, activation=activation, out_dtype=dtype, round_to=BF, interpret=True)
    assert got[0].shape == (m, n * f) and got[2].shape == (n * f, m)
    _assert_same_casts(got, _rows_casts(dgu, dtype), max(max_mismatch, 2e-3))  # autodiff inside vs outside


def test_activation_block_cast_refuses_shapes_off_the_block_grid():
    with pytest.raises(ValueError, match=r"gu \[M, n, F\] = \(256, 2, 200\) needs M and F multiples of 128"):
        act_block_cast(jnp.zeros((256, 2, 200), BF), activation="silu", out_dtype=E4)
    with pytest.raises(ValueError, match=r"dh has shape \(256, 128\); expected \(256, 256\)"):
        dact_block_cast_transpose(jnp.zeros((256, 128), BF), jnp.zeros((256, 2, 256), BF), activation="silu",
                                  out_dtype=E4)
    with pytest.raises(ValueError, match="gu must be \\[M, n, F\\] with n = 2"):
        act_block_cast(jnp.zeros((256, 3, 256), BF), activation="silu", out_dtype=E4)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_fused_block_mlp_matches_the_unfused_block_path(monkeypatch, fused):
    """fused_block_fp8_mlp (cast kernels on, or their XLA stand-in) against two fp8_dot_general calls with the
    activation between them (the unfused block path): y, dx, dw1, dw2 within a few FP8 roundings; both within FP8
    error of the fp32 MLP."""
    from te_jax.fp8 import quantize as Q
    from te_jax.fp8.block_mlp import fused_block_fp8_mlp
    from te_jax.fp8.recipe import Float8BlockScaling, Format

    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "emulate")
    monkeypatch.setenv("TE_JAX_FP8_FUSED", fused)
    recipe = Float8BlockScaling(fp8_format=Format.HYBRID)
    rng = np.random.default_rng(2)
    d, f, dout = 256, 384, 128
    x = jnp.asarray(rng.standard_normal((2, 128, d)), BF)
    w1 = jnp.asarray(rng.standard_normal((d, 2, f)) * d ** -0.5, BF)
    w2 = jnp.asarray(rng.standard_normal((f, dout)) * f ** -0.5, jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 128, dout)), BF)

    def unfused(x, w1, w2):
        gu = Q.fp8_dot_general(x, w1, (((2,), (0,)), ((), ())), recipe)
        a = (jax.nn.silu(gu[..., 0, :].astype(jnp.float32)) * gu[..., 1, :].astype(jnp.float32)).astype(BF)
        return Q.fp8_dot_general(a, w2.astype(BF), (((2,), (0,)), ((), ())), recipe)

    def exact(x, w1, w2):
        gu = jnp.einsum("bsd,dnf->bsnf", x.astype(jnp.float32), w1.astype(jnp.float32))
        return jnp.einsum("bsf,fo->bso", jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], w2)

    fused_fn = lambda x, w1, w2: fused_block_fp8_mlp(x, w1, w2, recipe, activations=("silu", "linear"))
    run = lambda fn: jax.jit(lambda x, w1, w2: (lambda y, vjp: (y, *vjp(g.astype(y.dtype))))(
        *jax.vjp(fn, x, w1, w2)))(x, w1, w2)
    got, ref, ex = run(fused_fn), run(unfused), run(exact)
    assert got[0].dtype == BF and got[2].dtype == BF and got[3].dtype == jnp.float32
    rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)).ravel())
                             / jnp.linalg.norm(b.astype(jnp.float32).ravel()))
    for name, a, b, e in zip(("y", "dx", "dw1", "dw2"), got, ref, ex):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert rel(a, b) < 2e-2, (name, rel(a, b))
        assert rel(a, e) < 0.1, (name, rel(a, e))


def test_layernorm_mlp_takes_the_fused_block_path_and_says_why_not(monkeypatch):
    """LayerNormMLP under Float8BlockScaling: the fused block MLP when the block GEMM is on and the shapes fit
    (te_jax.fp8.explain names it), the unfused path with the reason otherwise (biases; the GEMM off)."""
    from te_jax import fp8
    from te_jax.flax import LayerNormMLP
    from te_jax.fp8.recipe import Float8BlockScaling

    x = jnp.ones((2, 128, 128), BF)

    def why(**kw):
        m = LayerNormMLP(intermediate_dim=256, activations=("silu", "linear"), layernorm_type="rmsnorm",
                         intermediate_dropout_rate=0.0, dtype=BF, **kw)
        with fp8.autocast(recipe=Float8BlockScaling()):
            v = jax.eval_shape(lambda: m.init(jax.random.key(0), x, deterministic=True))
            return str(fp8.explain(lambda v: m.apply(v, x, deterministic=True), v))

    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "emulate")
    assert "fused block-scaled FP8 MLP" in why()
    assert "unfused FP8 MLP: biases" in why(use_bias=True)
    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "xla")
    assert "unfused FP8 MLP: the FP8 block GEMM is off" in why()
    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "emulate")
    m = LayerNormMLP(intermediate_dim=200, activations=("silu", "linear"), layernorm_type="rmsnorm",
                     intermediate_dropout_rate=0.0, dtype=BF)
    with fp8.autocast(recipe=Float8BlockScaling()):
        v = jax.eval_shape(lambda: m.init(jax.random.key(0), x, deterministic=True))
        assert "unfused FP8 MLP: wi GEMM: N=200 not a multiple of 128" in str(
            fp8.explain(lambda v: m.apply(v, x, deterministic=True), v))


@pytest.mark.skipif(not _on_sm90(), reason="the FP8 block GEMM kernel needs an sm90 GPU and jax >= 0.11")
@pytest.mark.parametrize("split", [True, False])
def test_fused_block_mlp_on_the_gpu(monkeypatch, split):
    """On the GPU: the fused block MLP with the real kernels (GEMMs and cast kernels) against the same path with
    the jnp reference GEMM (TE_JAX_FP8_BLOCK_GEMM=emulate): y and dw2 within 1%. So are dx and dw1 with the
    split accumulator; without it (the tensor cores' accumulation) they are within 2%: they come after dH is
    re-quantized to E5M2 (2 mantissa bits), where the GEMM's last-bit differences move whole FP8 steps (1.04%
    measured on the H100)."""
    from te_jax.fp8.recipe import Float8BlockScaling, Format

    recipe = Float8BlockScaling(fp8_format=Format.HYBRID, use_split_accumulator=split)
    case = _mlp_case(4, 4, 512, 768, 256)

    def run(mode):
        monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", mode)
        return _fused_mlp_step(recipe, *case)

    for name, a, b in zip(("y", "dx", "dw1", "dw2"), run("pallas"), run("emulate")):
        assert _rel(a, b) < (2e-2 if name in ("dx", "dw1") and not split else 1e-2), (name, _rel(a, b))


def test_fused_block_mlp_under_scan_and_remat(monkeypatch):
    """Three LayerNormMLP blocks under Float8BlockScaling on the fused block path (kernels in interpret mode),
    stacked with nn.scan: with nn.remat the loss and gradients equal those without it (the backward recomputes the
    same FP8 values), every gradient is finite, and all stay within FP8 error of the bf16 stack. (The scanned and
    an unrolled stack differ by up to 1% in some gradients already in bf16, through XLA's fusions: no sharp
    reference.)"""
    import flax.linen as nn

    from te_jax import fp8
    from te_jax.flax import LayerNormMLP
    from te_jax.fp8.recipe import Float8BlockScaling

    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "emulate")
    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y, _ = LayerNormMLP(intermediate_dim=256, activations=("silu", "linear"), layernorm_type="rmsnorm",
                                intermediate_dropout_rate=0.0, dtype=BF)(x, deterministic=True)
            return x + y, None

    def stack(remat):
        return nn.scan(nn.remat(Block) if remat else Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3, metadata_params={nn.PARTITION_NAME: "layers"})()

    x = jax.random.normal(jax.random.key(0), (2, 64, 128)).astype(BF)
    params = nn.unbox(stack(True).init(jax.random.key(1), x, None))
    loss = lambda remat: jax.jit(jax.value_and_grad(
        lambda p: jnp.mean(stack(remat).apply(p, x, None)[0].astype(jnp.float32) ** 2)))
    with fp8.autocast(recipe=Float8BlockScaling()):
        assert "fused block-scaled FP8 MLP" in str(fp8.explain(lambda p: stack(True).apply(p, x, None), params))
        (l_r, g_r), (l_n, g_n) = loss(True)(params), loss(False)(params)
    l_bf, g_bf = loss(True)(params)  # no autocast: bf16 GEMMs
    np.testing.assert_allclose(float(l_r), float(l_n), rtol=1e-6)
    leaves = lambda t: [np.asarray(a, np.float32) for a in jax.tree_util.tree_leaves(t)]
    for a, b, c in zip(leaves(g_r), leaves(g_n), leaves(g_bf)):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
        assert np.linalg.norm(a - c) / np.linalg.norm(c) < 0.15, np.linalg.norm(a - c) / np.linalg.norm(c)
    assert abs(float(l_r) - float(l_bf)) / float(l_bf) < 0.01


def test_block_gemm_path_is_not_taken_under_a_partitioned_mesh(monkeypatch):
    """Under a mesh whose axis XLA partitions (outside shard_map) the Pallas block GEMMs would run replicated: the
    dense GEMM takes the reference path and LayerNormMLP the unfused one, and te_jax.fp8.explain says why; the
    results equal the no-mesh reference path's."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (the CPU suite fakes 8)")
    from te_jax import fp8
    from te_jax.flax import LayerNormMLP
    from te_jax.fp8 import block
    from te_jax.fp8 import quantize as Q
    from te_jax.fp8.recipe import Float8BlockScaling

    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "emulate")
    recipe = Float8BlockScaling()
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    x = jax.random.normal(jax.random.key(0), (2, 128, 256)).astype(BF)
    w = (jax.random.normal(jax.random.key(1), (256, 128)) * 256 ** -0.5).astype(BF)
    dn = (((2,), (0,)), ((), ()))
    m = LayerNormMLP(intermediate_dim=256, activations=("silu", "linear"), layernorm_type="rmsnorm",
                     intermediate_dropout_rate=0.0, dtype=BF)
    with jax.set_mesh(mesh), fp8.autocast(recipe=recipe):
        assert "XLA partitions" in block.block_gemm_reason(x.shape, w.shape, 1)
        v = jax.eval_shape(lambda: m.init(jax.random.key(0), x, deterministic=True))
        info = fp8.explain(lambda v: m.apply(v, x, deterministic=True), v)
        assert all("unfused FP8 MLP: wi GEMM: under a mesh" in i.reason for i in info), info
        monkeypatch.setattr(Q, "block_scaled_dot", lambda *a, **k: (_ for _ in ()).throw(AssertionError("taken")))
        y_mesh = jax.jit(lambda x, w: Q.fp8_dot_general(x, w, dn, recipe))(x, w)
    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "xla")
    y_ref = jax.jit(lambda x, w: Q.fp8_dot_general(x, w, dn, recipe))(x, w)
    np.testing.assert_array_equal(np.asarray(y_mesh, np.float32), np.asarray(y_ref, np.float32))


def test_fused_block_mlp_refuses_bad_arguments_by_name():
    from te_jax.fp8.block_mlp import fused_block_fp8_mlp
    from te_jax.fp8.recipe import Float8BlockScaling

    x, w1, w2 = jnp.zeros((128, 256), BF), jnp.zeros((256, 2, 128), BF), jnp.zeros((128, 128), BF)
    with pytest.raises(ValueError, match=r"activations=\('silu', 'gelu'\) must be \(act,\) or \(act, 'linear'\)"):
        fused_block_fp8_mlp(x, w1, w2, Float8BlockScaling(), activations=("silu", "gelu"))
    with pytest.raises(ValueError, match=r"shapes x \(128, 256\), w1 \(256, 2, 128\), w2 \(64, 128\) do not fit "
                                         r"activations \('silu', 'linear'\) \(w1 \[D, 2, F\], w2 \[F, Dout\]\)"):
        fused_block_fp8_mlp(x, w1, w2[:64], Float8BlockScaling(), activations=("silu", "linear"))
    with pytest.raises(ValueError, match=r"shapes x \(128, 256\), w1 \(256, 2, 128\)"):
        fused_block_fp8_mlp(x, w1, w2, Float8BlockScaling(), activations=("silu",))


@pytest.mark.parametrize("fused", ["1", "0"])
def test_kept_block_weight_copies_change_no_value(monkeypatch, fused):
    """TE_JAX_FP8_KEEP_WEIGHTS=1 under Float8BlockScaling: with the weights' FP8 copies kept (their forward casts
    write both layouts; auto keeps none: on the H100 it did not pay) the fused block MLP and a block dense GEMM give
    bitwise the values of the re-cast path ("0"), and with the cast kernels on, the kept path runs two fewer block
    casts in the MLP (w1 and w2 are not cast again in the backward) and one fewer in the dense GEMM."""
    from te_jax.fp8 import quantize as Q
    from te_jax.fp8.block_mlp import fused_block_fp8_mlp
    from te_jax.fp8.fused import keep_weight_copies
    from te_jax.fp8.recipe import Float8BlockScaling

    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "emulate")
    monkeypatch.setenv("TE_JAX_FP8_FUSED", fused)
    recipe = Float8BlockScaling()
    assert not keep_weight_copies(recipe) and not keep_weight_copies(recipe, dense=True)
    rng = np.random.default_rng(7)
    d, f, dout = 256, 256, 128
    x = jnp.asarray(rng.standard_normal((1, 128, d)), BF)
    w1 = jnp.asarray(rng.standard_normal((d, 2, f)) * d ** -0.5, BF)
    w2 = jnp.asarray(rng.standard_normal((f, dout)) * f ** -0.5, BF)

    def block_casts(jaxpr):
        n = 0
        for e in jaxpr.eqns:
            n += e.primitive.name == "pallas_call" and "te_fp8_block_cast_transpose" in str(e.params)
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        n += block_casts(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        n += block_casts(sub)
        return n

    def run(keep, fn):
        monkeypatch.setenv("TE_JAX_FP8_KEEP_WEIGHTS", keep)

        def step(x, w1, w2):
            y, vjp = jax.vjp(fn, x, w1, w2)
            return (y, *vjp(jax.random.normal(jax.random.key(3), y.shape, y.dtype)))

        return jax.jit(step)(x, w1, w2), block_casts(jax.make_jaxpr(step)(x, w1, w2).jaxpr)

    mlp = lambda x, w1, w2: fused_block_fp8_mlp(x, w1, w2, recipe, activations=("silu", "linear"))  # noqa: E731
    dense = lambda x, w1, w2: Q.fp8_dot_general(x, w1[:, 0], (((2,), (0,)), ((), ())), recipe)  # noqa: E731
    for fn, fewer in ((mlp, 2), (dense, 1)):
        (kept, n_kept), (recast, n_recast) = run("1", fn), run("0", fn)
        for a, b in zip(kept, recast):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        if fused == "1":
            assert n_recast - n_kept == fewer, (n_kept, n_recast)
