"""LayerNorm / RMSNorm: xla and pallas (interpret) backends vs an fp32 reference; validation; selection.

Kernels and references run jitted, a test's cases in one program (eagerly every op compiles on its own for
each new shape); every case is checked on its own."""
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norms import norm_bwd, norm_fwd
from helpers import fwd_bwd_many, rand, ref_norm
from te_jax import normalization as N
from te_jax.backends.ops import NAMES as BACKENDS


def inputs(seed, shape, dtype):
    """numpy-drawn (helpers.rand): no per-shape compile, which jax.random pays eagerly for every new shape."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    x = (rand(rng, shape, scale=1.5) + 0.3).astype(dtype)
    g = jnp.asarray(0.5 + rng.uniform(size=(d,)).astype(np.float32))
    b = rand(rng, (d,), scale=0.3)
    dy = rand(rng, shape, dtype)
    return x, g, b, dy


TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=4e-2, rtol=4e-2)}


NORM_CASES = [(layernorm_type, d, zc, dtype) for layernorm_type in ("layernorm", "rmsnorm")
              for d, zc in [(48, False), (100, True), (64, True)]  # 64: no padded column
              for dtype in (jnp.float32, jnp.bfloat16)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_fwd_bwd(backend):
    """NORM_CASES (norm type x hidden size / zero-centred gamma x dtype), output and gradients against the fp32
    reference: all cases and references in one compile, each checked and named on failure."""
    cases, runs = [], []
    for layernorm_type, d, zc, dtype in NORM_CASES:
        rms = layernorm_type == "rmsnorm"
        x, g, b, dy = inputs(hash((backend, layernorm_type, d, str(dtype))) % 1000, (2, 3, 5, d), dtype)
        f = functools.partial(lambda x, g, b, lt, zc: N.norm(x, g, b, layernorm_type=lt, zero_centered_gamma=zc,
                                                             backend=backend), lt=layernorm_type, zc=zc)
        fr = functools.partial(lambda x, g, b, rms, zc: ref_norm(x, g, b, rms, zc), rms=rms, zc=zc)
        cases.append((x, dy))
        runs += [(f, (x, g, b), dy), (fr, (x.astype(jnp.float32), g, b), dy.astype(jnp.float32))]
    res = fwd_bwd_many(runs)
    for i, ((layernorm_type, d, zc, dtype), (x, dy)) in enumerate(zip(NORM_CASES, cases)):
        name = f"{layernorm_type} d={d} zc={zc} {jnp.dtype(dtype).name}"
        (y, (dx, dg, db)), (yr, (dxr, dgr, dbr)) = res[2 * i], res[2 * i + 1]
        assert y.dtype == dtype and y.shape == x.shape, name
        tol = TOL[dtype]
        np.testing.assert_allclose(np.asarray(y, np.float32), yr, **tol, err_msg=f"{name} y")
        assert dx.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(dx, np.float32), dxr, **tol, err_msg=f"{name} dx")
        # dgamma/dbeta sum over rows: scale the tolerance with the reduction size.
        gtol = dict(atol=tol["atol"] * 10, rtol=tol["rtol"])
        np.testing.assert_allclose(dg, dgr, **gtol, err_msg=f"{name} dgamma")
        if layernorm_type != "rmsnorm":
            np.testing.assert_allclose(db, dbr, **gtol, err_msg=f"{name} dbeta")


def test_kernel_stats_and_partials():
    x, g, b, dy = inputs(7, (37, 100), jnp.float32)  # rows not a multiple of any block
    from pallas_kernels.norms import NormConfig

    @jax.jit  # kernels and reference in one compile
    def run(x, g, b, dy):
        y, mean, rstd = norm_fwd(x, g, b, rms=False, interpret=True)
        grads = norm_bwd(dy, x, g, mean, rstd, rms=False, config=NormConfig(bwd_grid=3, bwd_block_rows=4),
                         interpret=True)
        _, vjpr = jax.vjp(lambda x, g, b: ref_norm(x, g, b, False, False), x, g, b)
        return mean, rstd, grads, vjpr(dy)

    mean, rstd, (dx, dg, db), (dxr, dgr, dbr) = run(x, g, b, dy)
    np.testing.assert_allclose(mean, np.asarray(x).mean(-1), atol=1e-5)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(np.var(np.asarray(x), -1) + 1e-6), rtol=1e-4)
    np.testing.assert_allclose(dx, dxr, atol=1e-4)
    np.testing.assert_allclose(dg, dgr, atol=1e-4)
    np.testing.assert_allclose(db, dbr, atol=1e-4)


@pytest.mark.parametrize("rms", [False, True])
def test_kernel_backward_adds_a_residual_gradient(rms):
    """norm_bwd(..., dres=): dx = the norm's backward + dres in one pass, against the fp32 vjp of the reference plus
    dres (rows not a multiple of the block, a padded column count, bf16 in and out); a wrong shape is refused."""
    x, g, b, dy = inputs(11, (37, 100), jnp.bfloat16)
    dres = rand(np.random.default_rng(3), (37, 100), jnp.bfloat16)
    from pallas_kernels.norms import NormConfig

    @jax.jit
    def run(x, g, b, dy, dres):
        _, mean, rstd = norm_fwd(x, g, b, rms=rms, interpret=True)
        got = norm_bwd(dy, x, g, mean, rstd, rms=rms, has_beta=not rms, interpret=True, dres=dres,
                       config=NormConfig(bwd_grid=3, bwd_block_rows=4))
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        _, vjpr = jax.vjp(lambda x, g, b: ref_norm(x, g, b, rms, False), f32(x), g, b)
        dxr, dgr, _ = vjpr(f32(dy))
        return got, dxr + f32(dres), dgr

    (dx, dg, _), dxr, dgr = run(x, g, b, dy, dres)
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx, np.float32), dxr, atol=4e-2, rtol=2e-2)
    np.testing.assert_allclose(dg, dgr, atol=0.3, rtol=2e-2)
    assert float(jnp.max(jnp.abs(dres.astype(jnp.float32)))) > 1.0  # dres is not negligible against dx
    with pytest.raises(ValueError, match=r"dres has shape \(37, 99\); expected x's \(37, 100\)"):
        norm_bwd(dy, x, g, None, jnp.ones((37,)), rms=True, has_beta=False, interpret=True, dres=dres[:, :99])


def test_fwd_launch_rule_for_rows_padded_to_8192():
    """Hidden 4097-8191 (padded to 8192 columns): two rows per program on 8 warps; others unchanged."""
    from pallas_kernels.norms import NormConfig
    from pallas_kernels.norms.norm import _fwd_params

    assert _fwd_params(32768, 5120, NormConfig()) == (2, 8192, 8)
    assert _fwd_params(32768, 8192, NormConfig()) == (1, 8192, 8)  # no padding: one row
    assert _fwd_params(32768, 4096, NormConfig()) == (2, 4096, 8)
    assert _fwd_params(1, 5120, NormConfig()) == (1, 8192, 8)  # never more rows than the input has
    assert _fwd_params(64, 5120, NormConfig(block_rows=1, num_warps=4)) == (1, 8192, 4)  # explicit wins


@pytest.mark.parametrize("rms", [False, True])
def test_two_padded_rows_per_program_match_reference(rms):
    """The two-row, 8192-column block at hidden 5000 with an odd row count (last block half empty)."""
    x, g, b, _ = inputs(11, (3, 5000), jnp.float32)
    (y, _, rstd), ref = jax.jit(lambda x, g, b: (norm_fwd(x, g, None if rms else b, rms=rms, interpret=True),
                                                 ref_norm(x, g, b, rms, False)))(x, g, b)
    np.testing.assert_allclose(y, ref, atol=2e-5, rtol=2e-5)
    ms = np.mean(np.asarray(x) ** 2, -1) if rms else np.var(np.asarray(x), -1)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(ms + 1e-6), rtol=1e-4)


def test_wrappers_and_jit():
    x, g, b, _ = inputs(3, (4, 48), jnp.float32)
    y1 = jax.jit(lambda x, g, b: N.layernorm(x, g, b, backend="pallas"))(x, g, b)
    y2 = N.layernorm(x, g, b, backend="xla")
    np.testing.assert_allclose(y1, y2, atol=1e-5)
    r1, r2 = jax.jit(lambda x, g: (N.rmsnorm(x, g, backend="pallas"), N.rmsnorm(x, g, backend="xla")))(x, g)
    np.testing.assert_allclose(r1, r2, atol=1e-5)
    # norm(): beta ignored for rmsnorm
    np.testing.assert_allclose(N.norm(x, g, b, layernorm_type="rmsnorm"), N.rmsnorm(x, g), atol=1e-6)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("case,match", [
    ("gamma_shape", r"gamma has shape \(5,\); expected \(8,\)"),
    ("beta_shape", r"beta has shape \(8, 1\); expected \(8,\)"),
    ("beta_none", r"beta is None"),
    ("int_x", r"x has dtype int32.*floating-point.*astype"),
    ("int_gamma", r"gamma has dtype int32"),
    ("type", r"layernorm_type='batchnorm' is unknown.*'layernorm', 'rmsnorm'"),
    ("backend", r"backend='cuda' is not known.*'pallas', 'xla'"),
])
def test_bad_inputs(case, match):
    x, g, b = jnp.ones((2, 8)), jnp.ones((8,)), jnp.zeros((8,))
    kw = {}
    if case == "gamma_shape":
        g = jnp.ones((5,))
    elif case == "beta_shape":
        b = jnp.zeros((8, 1))
    elif case == "beta_none":
        b = None
    elif case == "int_x":
        x = jnp.ones((2, 8), jnp.int32)
    elif case == "int_gamma":
        g = jnp.ones((8,), jnp.int32)
    elif case == "type":
        kw["layernorm_type"] = "batchnorm"
    elif case == "backend":
        kw["backend"] = "cuda"
    with pytest.raises(ValueError, match=match):
        N.norm(x, g, b, **kw)


# ----------------------------------------------------------------------------- selection


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on a GPU, auto takes the pallas norm")
def test_auto_on_cpu_is_xla_and_explained():
    x = jax.ShapeDtypeStruct((4, 64), jnp.float32)
    e = N.explain_norm_backend(x, jnp.ones(64), jnp.zeros(64))
    assert e.selected == "xla"
    assert e.reasons == {"xla": None, "pallas": None}
    assert "interpret mode" in str(e)


def test_auto_on_gpu_takes_the_measured_faster_backend_and_cites_it(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # selection only: nothing runs
    x = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16)
    ln = N.explain_norm_backend(x, jnp.ones(64), jnp.zeros(64))
    assert ln.selected == "pallas"
    assert "fwd+bwd 1.32-1.99x" in str(ln) and "8192x768" in str(ln) and N.GPU_EVIDENCE_FILE in str(ln)
    rms = N.explain_norm_backend(x, jnp.ones(64), layernorm_type="rmsnorm")
    assert rms.selected == "xla" and rms.reasons["pallas"] is None
    assert "fwd+bwd 0.76-1.00x" in str(rms) and N.GPU_EVIDENCE_FILE in str(rms)


def test_env_force_and_disable(monkeypatch, caplog):
    x, g, b = jnp.ones((2, 8)), jnp.ones((8,)), jnp.zeros((8,))
    monkeypatch.setenv("TE_JAX_NORM_BACKEND", "pallas")
    e = N.explain_norm_backend(x, g, b)
    assert e.selected == "pallas" and "TE_JAX_NORM_BACKEND" in str(e)
    # explicit argument wins over the env var
    assert N.explain_norm_backend(x, g, b, backend="xla").selected == "xla"
    monkeypatch.setenv("TE_JAX_NORM_BACKEND", "tpu")
    with pytest.raises(ValueError, match="TE_JAX_NORM_BACKEND='tpu'"):
        N.layernorm(x, g, b)
    monkeypatch.delenv("TE_JAX_NORM_BACKEND")
    monkeypatch.setenv("TE_JAX_PALLAS_NORM", "0")
    e = N.explain_norm_backend(x, g, b)
    assert e.selected == "xla" and "TE_JAX_PALLAS_NORM=0" in e.reasons["pallas"]
    with pytest.raises(ValueError, match="forced but cannot serve.*TE_JAX_PALLAS_NORM=0"):
        N.layernorm(x, g, b, backend="pallas")
    monkeypatch.setenv("TE_JAX_DEBUG", "1")
    with caplog.at_level(logging.INFO, logger="te_jax"):
        N.layernorm(x, g, b)
    assert any("layernorm: backend='auto' -> 'xla'" in r.getMessage() for r in caplog.records)


def test_too_large_hidden_cannot_use_pallas():
    from pallas_kernels.norms import MAX_HIDDEN

    assert N.MAX_HIDDEN == MAX_HIDDEN
    x = jax.ShapeDtypeStruct((2, 40000), jnp.float32)
    e = N.explain_norm_backend(x, backend="pallas")
    assert e.selected is None and "40000" in e.error


@pytest.mark.parametrize("d", [300, 256])  # 256: the kernel's no-padded-column path
@pytest.mark.parametrize("fwd_stats", ["one_pass", "two_pass"])
def test_layernorm_stats_with_large_mean(fwd_stats, d):
    """fp32 rows with |mean| >> std (offset 1000, std 1): E[x²]-E[x]² without a shift would lose the
    variance to cancellation (error ~1e6·2^-24 per term); both modes must match a float64 reference."""
    from pallas_kernels.norms import NormConfig

    rng = np.random.default_rng(3)
    x = 1000.0 + rng.standard_normal((19, d), np.float32)
    x[:, 0] = 1003.0  # the shift (first element) is not the mean
    x = jnp.asarray(x)
    g = jnp.asarray(0.5 + rng.uniform(size=(d,)).astype(np.float32))
    b = rand(rng, (d,), scale=0.3)
    y, mean, rstd = jax.jit(lambda x, g, b: norm_fwd(x, g, b, rms=False, config=NormConfig(fwd_stats=fwd_stats),
                                                     interpret=True))(x, g, b)
    xd, gd, bd = (np.asarray(t, np.float64) for t in (x, g, b))
    mu, var = xd.mean(-1, keepdims=True), xd.var(-1, keepdims=True)
    np.testing.assert_allclose(mean, mu[:, 0], rtol=5e-7)  # a few fp32 ulps at 1000
    np.testing.assert_allclose(rstd, 1 / np.sqrt(var[:, 0] + 1e-6), rtol=1e-4)
    np.testing.assert_allclose(y, (xd - mu) / np.sqrt(var + 1e-6) * gd + bd, atol=1e-3)
    with pytest.raises(ValueError, match="fwd_stats"):
        norm_fwd(x, g, b, config=NormConfig(fwd_stats="welford"), interpret=True)
