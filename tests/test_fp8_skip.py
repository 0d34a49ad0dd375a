"""The skip connection through the FP8 fused norm paths (norm_fp8_dense(skip=True), fused_fp8_mlp(skip=True), and
the Flax modules' return_residual): x comes back unchanged, and its gradient is added inside the norm's backward
(the Pallas kernel's one pass, or XLA's) with the same values as the residual add done outside the op."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import norm_rel_err, ref_norm
from te_jax import fp8
from te_jax.flax import LayerNormMLP, MultiHeadAttention, TransformerLayer
from te_jax.fp8 import norm_cast, norm_dense
from te_jax.fp8 import quantize as Q
from te_jax.fp8.mlp import fused_fp8_mlp
from te_jax.fp8.recipe import DelayedScaling, Float8CurrentScaling

BF = jnp.bfloat16
RECIPES = [pytest.param(DelayedScaling(amax_history_len=3), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current")]
# the norm's backward: XLA's, the Pallas kernel as the norm's backend, the kernel for the skip only (auto on a GPU)
SPECS = [pytest.param(norm_cast.NormSpec("rmsnorm", 1e-6, False, "xla"), id="xla"),
         pytest.param(norm_cast.NormSpec("rmsnorm", 1e-6, False, "pallas"), id="pallas"),
         pytest.param(norm_cast.NormSpec("rmsnorm", 1e-6, False, "xla", skip_kernel=True), id="skip_kernel")]


def _data(seed, m, d):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = (jax.random.normal(ks[0], (m, d)) * 2 + 0.5).astype(BF)
    gamma = 1 + 0.1 * jax.random.normal(ks[1], (d,))
    c_skip = jax.random.normal(ks[2], (m, d))  # the skip path's cotangent: as large as the rest
    return ks[3], x, gamma, c_skip


def _against_fp32(got, want, names, tol):
    """The skip path's gradients against fp32 autodiff of the same math without FP8 (FP8-sized tolerance)."""
    for name, a, b in zip(names, got, want):
        assert norm_rel_err(a, b) < tol, (name, norm_rel_err(a, b))


def _compare(run, skip_names):
    """run(skip) -> (loss, grads tuple): the skip path against the residual added outside the op."""
    (l1, g1), (l0, g0) = run(True), run(False)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for name, a, b in zip(skip_names, g1, g0):
        for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
            # dx: the skip gradient is added in fp32 before dx is rounded to bf16 (outside: two bf16 values summed)
            assert norm_rel_err(u, v) < (1e-2 if name == "x" else 1e-5), (name, jax.tree_util.keystr(path), norm_rel_err(u, v))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_norm_dense_skip_equals_the_residual_added_outside(recipe, spec, monkeypatch):
    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")
    key, x, gamma, c_skip = _data(3, 64, 32)
    ka, kb, kc = jax.random.split(key, 3)
    ws = (0.2 * jax.random.normal(ka, (32, 48)), 0.2 * jax.random.normal(kb, (32, 16)))
    cts = (jax.random.normal(kc, (64, 48)), jax.random.normal(ka, (64, 16)))
    delayed = isinstance(recipe, DelayedScaling)
    states = (Q.init_state(3), Q.init_state(3)) if delayed else None

    # without the skip, the kernel spec runs the norm's backward on the same kernel (then XLA adds the gradient)
    plain = dataclasses.replace(spec, backend="pallas") if spec.skip_kernel else spec

    def loss(x, gamma, ws, states, skip):
        outs = norm_dense.norm_fp8_dense(x, gamma, None, ws, states, recipe, spec if skip else plain,
                                         interpret=True, skip=skip)
        x_skip = outs[2] if skip else x
        if skip:
            assert x_skip.dtype == x.dtype and x_skip.shape == x.shape
        main = sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(outs[:2], cts))
        return main + jnp.sum(x_skip.astype(jnp.float32) * c_skip)

    def run(skip):
        f = jax.jit(jax.value_and_grad(lambda *a: loss(*a, skip), argnums=(0, 1, 2, 3)))
        return f(x, gamma, ws, states)

    _compare(run, ("x", "gamma", "ws", "states"))

    def loss32(x, gamma, ws):  # the same function in fp32, the skip added outside
        ln = ref_norm(x, gamma, None, rms=True)
        return sum(jnp.sum((ln @ w) * c) for w, c in zip(ws, cts)) + jnp.sum(x * c_skip)

    want = jax.grad(loss32, argnums=(0, 1, 2))(x.astype(jnp.float32), gamma, ws)
    got = run(True)[1]
    _against_fp32((got[0], got[1], got[2][0], got[2][1]), (want[0], want[1], want[2][0], want[2][1]),
                  ("x", "gamma", "w_q", "w_kv"), 0.1)
    with pytest.raises(ValueError, match="skip=True needs a norm"):
        norm_dense.norm_fp8_dense(x, gamma, None, ws, states, recipe, None, interpret=True, skip=True)
    # the skip output is x itself
    outs = jax.jit(lambda x: norm_dense.norm_fp8_dense(x, gamma, None, ws, states, recipe, spec, interpret=True,
                                                       skip=True))(x)
    np.testing.assert_array_equal(np.asarray(outs[2], np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("spec", SPECS[:2])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_mlp_skip_equals_the_residual_added_outside(recipe, spec, monkeypatch):
    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")
    key, x, gamma, c_skip = _data(4, 64, 32)
    ka, kb, kc = jax.random.split(key, 3)
    w1 = 0.2 * jax.random.normal(ka, (32, 2, 64))
    w2 = 0.2 * jax.random.normal(kb, (64, 32))
    cy = jax.random.normal(kc, (64, 32))
    delayed = isinstance(recipe, DelayedScaling)
    states = (Q.init_state(3), Q.init_state(3)) if delayed else (None, None)

    def loss(x, gamma, w1, w2, states, skip):
        out = fused_fp8_mlp(x, w1, w2, recipe, *states, activations=("silu", "linear"), interpret=True, norm=spec,
                            gamma=gamma, skip=skip)
        y, x_skip = out if skip else (out, x)
        return jnp.sum(y.astype(jnp.float32) * cy) + jnp.sum(x_skip.astype(jnp.float32) * c_skip)

    def run(skip):
        f = jax.jit(jax.value_and_grad(lambda *a: loss(*a, skip), argnums=(0, 1, 2, 3, 4)))
        return f(x, gamma, w1, w2, states)

    _compare(run, ("x", "gamma", "w1", "w2", "states"))

    def loss32(x, gamma, w1, w2):  # the same MLP in fp32, the skip added outside
        h = jnp.einsum("md,daf->maf", ref_norm(x, gamma, None, rms=True), w1)
        y = (jax.nn.silu(h[:, 0]) * h[:, 1]) @ w2
        return jnp.sum(y * cy) + jnp.sum(x * c_skip)

    want = jax.grad(loss32, argnums=(0, 1, 2, 3))(x.astype(jnp.float32), gamma, w1, w2)
    _against_fp32(run(True)[1][:4], want, ("x", "gamma", "w1", "w2"), 0.1)
    with pytest.raises(ValueError, match="skip=True needs a norm"):
        fused_fp8_mlp(x, w1, w2, recipe, *states, activations=("silu", "linear"), interpret=True, skip=True)


def test_skip_kernel_choice(monkeypatch):
    """auto takes the Pallas kernel for a backward with a skip gradient on a GPU (tuning.NORM_BWD_WITH_SKIP); a
    backend named by argument or environment is kept; on the CPU auto keeps XLA."""
    from te_jax.backends import tuning

    x, g = jax.ShapeDtypeStruct((64, 32), BF), jnp.ones((32,))

    def spec(backend="auto"):
        return norm_cast.norm_spec(x, g, None, layernorm_type="rmsnorm", epsilon=1e-6, zero_centered_gamma=False,
                                   backend=backend)

    assert spec("pallas").skip_kernel and not spec("xla").skip_kernel
    if jax.default_backend() == "cpu":
        assert not spec().skip_kernel
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert spec().skip_kernel and not spec("xla").skip_kernel
    monkeypatch.setenv("TE_JAX_NORM_BACKEND", "xla")
    assert not spec().skip_kernel
    monkeypatch.delenv("TE_JAX_NORM_BACKEND")
    monkeypatch.setattr(tuning, "NORM_BWD_WITH_SKIP", dataclasses.replace(tuning.NORM_BWD_WITH_SKIP, value="xla"))
    assert not spec().skip_kernel


def test_modules_return_residual_without_fp8():
    """return_residual: the inputs (ln_output with return_layernorm_output), with FP8 off."""
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 32))
    mha = MultiHeadAttention(head_dim=8, num_attention_heads=4, num_gqa_groups=2, layernorm_type="rmsnorm",
                             return_residual=True)
    v = mha.init(jax.random.PRNGKey(1), x, deterministic=True)
    y, res = mha.apply(v, x, deterministic=True)
    assert res is x and y.shape == x.shape
    y_ln, ln = mha.clone(return_layernorm_output=True).apply(v, x, deterministic=True)
    _, res_ln = mha.clone(return_layernorm_output=True, return_residual=True).apply(v, x, deterministic=True)
    np.testing.assert_array_equal(res_ln, ln)
    mlp = LayerNormMLP(intermediate_dim=64, layernorm_type="rmsnorm", return_residual=True)
    v = mlp.init(jax.random.PRNGKey(2), x, deterministic=True)
    _, res = mlp.apply(v, x, deterministic=True)
    assert res is x


@pytest.mark.parametrize("recipe", RECIPES)
def test_transformer_layer_skip_kernel_equals_xla(recipe, monkeypatch):
    """The layer under autocast with the fused paths: norm_backend="pallas" (the skip gradients added in the Pallas
    norm backward) against "xla" (added by XLA): the same loss and gradients up to fp32 summation order, and the
    explanation says where the residual's gradient joins."""
    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")
    kw = dict(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4, num_gqa_groups=2, layernorm_type="rmsnorm",
              mlp_activations=("silu", "linear"), hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
              enable_relative_embedding=False, enable_rotary_pos_emb=True, use_bias=False, dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 32)) * 2.0 + 0.5
    ct = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 32))

    def run(norm_backend):
        layer = TransformerLayer(**kw, norm_backend=norm_backend, mlp_backend=norm_backend)
        with fp8.autocast(recipe=recipe):
            v = jax.jit(lambda k: layer.init(k, x, deterministic=True))(jax.random.PRNGKey(0))
            info = fp8.explain(lambda: layer.apply(v, x, deterministic=True))
            f = jax.jit(jax.value_and_grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True) * ct)))
            return info, f(v)

    info_p, (lp, gp) = run("pallas")
    info_x, (lx, gx) = run("xla")
    np.testing.assert_allclose(float(lp), float(lx), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gp["params"]),
                            jax.tree_util.tree_leaves(gx["params"])):
        assert norm_rel_err(a, b) < 1e-4, jax.tree_util.keystr(path)
    for info, where in ((info_p, "in the norm's backward kernel"), (info_x, "to the norm's XLA backward")):
        joined = [i.module for i in info if "residual's gradient added " + where in i.reason]
        assert joined == ["attention/query", "attention/kv", "mlp", "mlp"], (where, [i.reason for i in info])
