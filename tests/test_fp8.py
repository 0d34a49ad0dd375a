"""FP8 (te_jax/fp8): recipes, scaling math against a numpy model, saturation, fp8_dot_general numerics,
Flax integration (autocast, state collection through jit / nn.scan / nn.remat / checkpoints), HLO converts.

Tiny shapes; the whole file runs in well under a minute on 2 CPU cores.
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import te_jax
from te_jax import fp8
from te_jax.fp8 import quantize as Q
from te_jax.fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
from te_jax.flax import DenseGeneral, LayerNormMLP, TransformerLayer
from helpers import cpu_mesh, norm_rel_err as _rel, rand
from jaxpr_walk import walk

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
DENSE_DN = (((2,), (0,)), ((), ()))


# --- recipes ---------------------------------------------------------------------------------------

def test_recipe_defaults_match_transformer_engine():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (0, Format.HYBRID, 1024, "max")
    assert Float8CurrentScaling().fp8_format is Format.HYBRID
    assert Float8BlockScaling().fp8_format is Format.E4M3
    assert Format.HYBRID.fwd_dtype == jnp.float8_e4m3fn and Format.HYBRID.bwd_dtype == jnp.float8_e5m2
    assert Format.E4M3.bwd_dtype == jnp.float8_e4m3fn
    assert (Format.HYBRID.max_fwd, Format.HYBRID.max_bwd) == (E4M3_MAX, E5M2_MAX)
    hash(r)  # frozen: usable as a static argument


@pytest.mark.parametrize("kwargs, field", [
    (dict(margin=-1), "margin"), (dict(amax_history_len=0), "amax_history_len"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"), (dict(fp8_format="HYBRID"), "fp8_format")])
def test_recipe_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DelayedScaling(**kwargs)


def test_other_recipe_validation():
    with pytest.raises(ValueError, match="fp8_format"):
        Float8CurrentScaling(fp8_format=1)
    with pytest.raises(ValueError, match="x_block"):
        Float8BlockScaling(x_block=0)
    with pytest.raises(ValueError, match="use_split_accumulator='yes' must be a bool"):
        Float8BlockScaling(use_split_accumulator="yes")
    with pytest.raises(ValueError, match="recipe"):
        with fp8.autocast(recipe="delayed"):
            pass


# --- scaling math against a numpy model ------------------------------------------------------------

def _np_delayed(hist, scale, a, fmax, margin, algo):
    """TE's delayed-scaling update, written independently in numpy."""
    hist = hist.copy()
    hist[0] = a if np.isfinite(a) else 0.0
    window = hist.max() if algo == "max" else hist[0]
    new = scale
    if np.isfinite(a) and window > 0 and np.isfinite(window):
        cand = fmax / window / 2.0 ** margin
        if np.isfinite(cand):
            new = cand
    hist = np.roll(hist, -1)
    hist[0] = 0.0
    return np.float32(new), hist


def test_delayed_update_explicit_history_roll():
    h, s = jnp.zeros(3), jnp.ones(1)
    expect = [(448.0, [0, 0, 1]), (112.0, [0, 1, 4]), (112.0, [0, 4, 2]), (112.0, [0, 2, 0.5]), (224.0, [0, 0.5, 0.25])]
    for a, (scale, hist) in zip([1.0, 4.0, 2.0, 0.5, 0.25], expect):
        s, h = Q.delayed_update(h, s, a, E4M3_MAX, 0, "max")
        np.testing.assert_allclose(s, [scale], rtol=1e-6)
        np.testing.assert_allclose(h, hist)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_update_matches_numpy_model(algo, margin):
    rng = np.random.default_rng(0)
    amaxes = list(np.exp(rng.normal(0, 2, 12)).astype(np.float32)) + [0.0, np.inf, np.nan, 3.0]
    L = 5
    h, s = jnp.zeros(L), jnp.ones(1)
    nh, ns = np.zeros(L, np.float32), np.float32(1.0)
    for a in amaxes:
        s, h = Q.delayed_update(h, s, a, E5M2_MAX, margin, algo)
        ns, nh = _np_delayed(nh, ns, np.float32(a), E5M2_MAX, margin, algo)
        np.testing.assert_allclose(np.asarray(s).reshape(()), ns, rtol=1e-6)
        np.testing.assert_allclose(h, nh, rtol=1e-6)
        assert np.all(np.isfinite(h)) and np.isfinite(np.asarray(s)).all()


def test_compute_scale_keeps_previous_on_bad_amax():
    prev = jnp.float32(7.0)
    for bad in [0.0, np.inf, -np.inf, np.nan, 1e-45]:  # 1e-45: fmax / amax overflows to inf
        assert float(Q.compute_scale(bad, prev, E4M3_MAX)) == 7.0
    np.testing.assert_allclose(Q.compute_scale(2.0, prev, E4M3_MAX, margin=1), 448.0 / 2 / 2)


def test_current_scaling_scale_is_fmax_over_amax():
    x = jnp.array([[0.5, -3.0], [1.0, 2.0]])
    np.testing.assert_allclose(Q.compute_scale(Q.amax(x), 1.0, E4M3_MAX), 448.0 / 3.0, rtol=1e-6)


# --- saturation / overflow -------------------------------------------------------------------------

def test_saturating_cast_never_inf_or_nan():
    x = jnp.array([1e30, -1e30, 5e5, -5e5, 3.0, 0.0], jnp.float32)
    q4 = Q.quantize(x, 1.0, jnp.float8_e4m3fn).astype(jnp.float32)
    q5 = Q.quantize(x, 1.0, jnp.float8_e5m2).astype(jnp.float32)
    assert np.all(np.isfinite(q4)) and np.all(np.isfinite(q5))
    np.testing.assert_array_equal(q4[:4], [448, -448, 448, -448])
    np.testing.assert_array_equal(q5[:2], [57344, -57344])
    np.testing.assert_array_equal(q4[4:], [3.0, 0.0])


def test_growing_amax_under_delayed_scaling_stays_finite():
    """x grows 16x per step: the delayed scale is stale every step (saturation), outputs stay finite."""
    r = DelayedScaling(amax_history_len=4)
    st = Q.init_state(4)
    w = jax.random.normal(jax.random.PRNGKey(1), (32, 16))
    x0 = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 32))
    @jax.jit
    def f(x, st, gscale):
        y, vjp = jax.vjp(lambda x, w, st: Q.fp8_dot_general(x, w, DENSE_DN, r, st), x, w, st)
        return (y, *vjp(jnp.ones_like(y) * gscale))

    for step in range(6):
        x = x0 * (16.0 ** step)
        y, dx, dw, st = f(x, st, 8.0 ** step)
        for a in (y, dx, dw, *st.values()):
            assert np.all(np.isfinite(np.asarray(a, np.float32)))
    # the history recorded the last amax; the next scale follows the largest amax of the window
    assert float(st["input_amax_history"][-1]) == pytest.approx(float(jnp.max(jnp.abs(x0))) * 16.0 ** 5, rel=1e-6)


# --- fp8_dot_general numerics ----------------------------------------------------------------------

def _dot_case(dn, xs, ws, seed=0):
    """x, w, an output cotangent g (numpy-drawn: no per-shape compile) and the fp32 GEMM's output and
    gradients (jitted: eagerly every op compiles on its own)."""
    rng = np.random.default_rng(seed)
    x, w = rand(rng, xs), rand(rng, ws)
    ref = lambda x, w: jax.lax.dot_general(x, w, dn, precision="highest")
    g = rand(rng, jax.eval_shape(ref, x, w).shape)
    y0, grads0 = jax.jit(lambda x, w, g: (lambda y, vjp: (y, vjp(g)))(*jax.vjp(ref, x, w)))(x, w, g)
    return x, w, g, y0, grads0


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(),
                                    Float8CurrentScaling(Format.E4M3), Float8BlockScaling(x_block=16, w_block=16)],
                         ids=["delayed", "current", "current_e4m3", "block"])
@pytest.mark.parametrize("style", ["direct", "qdq"])
def test_fp8_dot_general_forward_and_grads(recipe, style):
    x, w, g, y0, (dx0, dw0) = _dot_case(DENSE_DN, (4, 8, 64), (64, 48))
    st = Q.init_state(4) if isinstance(recipe, DelayedScaling) else None
    f = lambda x, w, st: Q.fp8_dot_general(x, w, DENSE_DN, recipe, st, gemm_style_override=style)
    fg = jax.jit(lambda x, w, st, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, x, w, st)))
    for _ in range(2):  # delayed: step 1 with scale 1, step 2 with the scales learnt in step 1
        y, dx, dw, new_st = fg(x, w, st, g)
        assert _rel(y, y0) < 2.0 ** -4
        assert _rel(dx, dx0) < 2.0 ** -3 and _rel(dw, dw0) < 2.0 ** -3
        st = new_st
    if isinstance(recipe, DelayedScaling):
        np.testing.assert_allclose(st["input_scale"], E4M3_MAX / float(jnp.max(jnp.abs(x))), rtol=1e-6)
        np.testing.assert_allclose(st["kernel_scale"], E4M3_MAX / float(jnp.max(jnp.abs(w))), rtol=1e-6)
        np.testing.assert_allclose(st["output_grad_scale"], E5M2_MAX / float(jnp.max(jnp.abs(g))), rtol=1e-6)
        np.testing.assert_allclose(st["output_grad_amax_history"][-1], float(jnp.max(jnp.abs(g))), rtol=1e-6)
    else:
        assert st is None


#: direct and qdq GEMMs on the same FP8 operands: bf16 rounding apart on the CPU; on a GPU XLA runs the qdq dots as
#: bf16 GEMMs (its Triton GEMM fusion takes the converts, quantize.py's docstring) and the direct ones as cuBLASLt
#: FP8 GEMMs with their own accumulation, so they sit further apart
_DIRECT_VS_QDQ = 2.0 ** -7 if jax.default_backend() == "cpu" else 2.0 ** -5


def test_fused_dense_path_takes_both_gemm_styles(monkeypatch):
    """The fused (cast_transpose, every GEMM "TN") dense path runs the qdq style as well as direct: the same FP8
    operands, so the forward, dx and dw agree to bf16 rounding, and both are close to the full-precision GEMM."""
    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")
    x, w, g, y0, (dx0, dw0) = _dot_case(DENSE_DN, (2, 16, 64), (64, 32), seed=5)
    x, w, g = (a.astype(jnp.bfloat16) for a in (x, w, g))
    outs = {}
    for style in ("direct", "qdq"):
        f = lambda x, w: Q.fp8_dot_general(x, w, DENSE_DN, Float8CurrentScaling(), gemm_style_override=style)
        outs[style] = jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, x, w)))(x, w, g)
        y = outs[style][0]
        assert _rel(y, y0) < 2.0 ** -4 and _rel(outs[style][1], dx0) < 2.0 ** -3 and _rel(outs[style][2], dw0) < 2.0 ** -3
    for a, b in zip(outs["direct"], outs["qdq"]):
        assert _rel(a, b) < _DIRECT_VS_QDQ
    for style, operand in (("direct", "xf8E4M3FN>"), ("qdq", "xbf16>")):  # the style decides the dots' operands
        text = jax.jit(lambda x, w: Q.fp8_dot_general(x, w, DENSE_DN, Float8CurrentScaling(),
                                                      gemm_style_override=style)).lower(x, w).as_text()
        dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
        assert "@cast_transpose" in text and len(dots) == 1 and operand + ", tensor<" in dots[0], (style, dots)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_wgrad_qdq_style_runs_only_the_weight_gradient_as_qdq(monkeypatch, fused):
    """GEMM style "wgrad_qdq": the forward and dgrad dots take the FP8 operands (direct), the wgrad dot the
    dequantized ones (qdq), in the fused and the unfused dense paths; values as the direct style's."""
    monkeypatch.setenv("TE_JAX_FP8_FUSED", fused)
    x, w, g, y0, (dx0, dw0) = _dot_case(DENSE_DN, (2, 16, 64), (64, 32), seed=6)
    x, w, g = (a.astype(jnp.bfloat16) for a in (x, w, g))
    outs = {}
    for style in ("direct", "wgrad_qdq"):
        f = lambda x, w: Q.fp8_dot_general(x, w, DENSE_DN, Float8CurrentScaling(), gemm_style_override=style)
        step = jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, x, w)))
        outs[style] = step(x, w, g)
        dots = [l for l in step.lower(x, w, g).as_text().splitlines() if "stablehlo.dot_general" in l]
        f8 = [d for d in dots if "xf8E" in d.split("->")[0]]
        assert len(dots) == 3 and len(f8) == (3 if style == "direct" else 2), (style, dots)
    y, dx, dw = outs["wgrad_qdq"]
    assert _rel(y, y0) < 2.0 ** -4 and _rel(dx, dx0) < 2.0 ** -3 and _rel(dw, dw0) < 2.0 ** -3
    for a, b in zip(outs["direct"], outs["wgrad_qdq"]):
        assert _rel(a, b) < _DIRECT_VS_QDQ


def test_fp8_dot_general_batched_dimension_numbers():
    dn = (((2,), (1,)), ((0,), (0,)))  # [b, m, k] x [b, k, n] contracted k, batch b
    x, w, g, y0, (dx0, dw0) = _dot_case(dn, (3, 8, 32), (3, 32, 16), seed=3)
    y, dx, dw = jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(
        *jax.vjp(lambda x, w: Q.fp8_dot_general(x, w, dn, Float8CurrentScaling()), x, w)))(x, w, g)
    assert y.shape == y0.shape and dx.shape == x.shape and dw.shape == w.shape
    assert _rel(y, y0) < 2.0 ** -4 and _rel(dx, dx0) < 2.0 ** -3 and _rel(dw, dw0) < 2.0 ** -3


def test_block_scaling_beats_per_tensor_on_outlier_rows():
    x = jnp.asarray(np.asarray(jax.random.normal(jax.random.PRNGKey(0), (8, 32))) * np.logspace(-4, 2, 8)[:, None],
                    jnp.float32)
    blk = Q.block_qdq(x, (1, 16), jnp.float8_e4m3fn, jnp.float32)
    per = Q.qdq(x, Q.compute_scale(Q.amax(x), 1.0, E4M3_MAX), jnp.float8_e4m3fn)
    err = lambda a: float(jnp.max(jnp.abs(a - x)[0] / jnp.abs(x[0]).max()))  # smallest row
    assert err(blk) < 0.1 < err(per)


def test_fp8_dot_general_errors():
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    with pytest.raises(ValueError, match="state"):
        Q.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), DelayedScaling())
    with pytest.raises(ValueError, match="amax_history_len"):
        Q.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), DelayedScaling(amax_history_len=8), Q.init_state(4))
    with pytest.raises(ValueError, match="dense"):
        Q.fp8_dot_general(x, w.T, (((1,), (1,)), ((), ())), Float8BlockScaling())


# --- Flax: autocast, explain, state collection -----------------------------------------------------

def _tiny_layer(**kw):
    return TransformerLayer(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4, num_gqa_groups=2,
                            layernorm_type="rmsnorm", mlp_activations=("silu", "linear"), hidden_dropout=0.0,
                            attention_dropout=0.0, intermediate_dropout=0.0, enable_relative_embedding=False,
                            enable_rotary_pos_emb=True, self_attn_mask_type="causal", use_bias=False, **kw)


def test_explain_reports_each_gemm():
    layer = _tiny_layer()
    x = jnp.ones((1, 8, 32))
    off = fp8.explain(lambda: layer.init(jax.random.PRNGKey(0), x, deterministic=True))
    assert [g.gemm for g in off] == ["kernel", "kernel", "kernel", "wi_kernel", "wo_kernel"]
    assert not any(g.fp8 for g in off) and "autocast" in off[0].reason
    with fp8.autocast(recipe=Float8CurrentScaling()):
        on = fp8.explain(lambda: layer.init(jax.random.PRNGKey(0), x, deterministic=True))
    assert all(g.fp8 for g in on) and {g.module for g in on} == {"attention/query", "attention/kv",
                                                                 "attention/out", "mlp"}
    if jax.default_backend() == "cpu":
        assert "CPU" in str(on)  # on CPU the FP8 GEMM is an upcast GEMM, and the explanation says so
    with fp8.autocast(recipe=Float8BlockScaling()):
        blk = fp8.explain(lambda: layer.init(jax.random.PRNGKey(0), x, deterministic=True))
    assert all(g.fp8 and not g.fp8_gemm and "not an FP8 GEMM" in g.reason for g in blk)
    # per-module override: enable_fp8=False wins over autocast
    d = DenseGeneral(features=16, enable_fp8=False)
    with fp8.autocast():
        info = fp8.explain(lambda: d.init(jax.random.PRNGKey(0), x))
    assert not info[0].fp8 and "enable_fp8=False" in info[0].reason
    # enable_fp8=True with a module recipe, no autocast
    d = DenseGeneral(features=16, enable_fp8=True, fp8_recipe=Float8CurrentScaling())
    info = fp8.explain(lambda: d.init(jax.random.PRNGKey(0), x))
    assert info[0].fp8 and info[0].recipe == "Float8CurrentScaling"


def test_explain_mlp_backend_says_fp8_takes_xla():
    x, g = jax.ShapeDtypeStruct((8, 32), jnp.bfloat16), jax.ShapeDtypeStruct((32,), jnp.float32)
    choice = te_jax.explain_mlp_backend(x, g, backend="auto", fp8_recipe=DelayedScaling())
    assert choice.selected == "xla" and "FP8" in str(choice)


def test_transformer_layer_trains_under_delayed_scaling():
    """A few SGD steps under autocast(DelayedScaling): finite, falling loss within 10% of the fp32 loss of the
    same parameters (computed in the same jitted step with FP8 off), and the FP8 state moving every step."""
    layer = _tiny_layer(dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 32))
    tgt = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 32))
    init = jax.jit(lambda k: layer.init(k, x, deterministic=True))  # jitted: eager init is op-by-op (slow)
    base = init(jax.random.PRNGKey(0))
    recipe = DelayedScaling(amax_history_len=4)
    with fp8.autocast(recipe=recipe):
        v = init(jax.random.PRNGKey(0))  # autocast is part of jit's cache key: traced again, with FP8 state
    assert set(v) == {"params", fp8.FP8_COLLECTION}
    jax.tree_util.tree_map(np.testing.assert_array_equal, v["params"], base["params"])

    def loss_fn(variables):
        return jnp.mean((layer.apply(variables, x, deterministic=True) - tgt) ** 2)

    @jax.jit
    def step(v):
        loss, g = jax.value_and_grad(loss_fn)(v)
        with fp8.autocast(enabled=False):  # traced without FP8: the fp32 reference at the same parameters
            ref = loss_fn({"params": v["params"]})
        params = jax.tree_util.tree_map(lambda p, d: p - 0.05 * d, v["params"], g["params"])
        return loss, ref, fp8.update_fp8_state({**v, "params": params}, g)

    losses, states = [], []
    with fp8.autocast(recipe=recipe):
        for _ in range(4):
            loss, ref, v = step(v)
            losses.append(float(loss))
            states.append(v[fp8.FP8_COLLECTION]["mlp"]["wi_fp8_meta"])
            assert np.isfinite(float(loss)) and abs(float(loss) - float(ref)) / float(ref) < 0.1, (loss, ref)
    assert losses[-1] < losses[0]
    for s1, s2 in zip(states, states[1:]):
        assert not np.array_equal(s1["input_amax_history"], s2["input_amax_history"])
    assert float(states[0]["output_grad_scale"][0]) != 1.0  # the backward amax came back through the gradient


def test_gqa_kv_projection_casts_with_the_query_input_scale():
    """Self-attention with GQA under DelayedScaling: the K/V GEMM reads the query's normalized input and casts it
    with the query's input scale (one cast of ln(x), te_jax.fp8.state.dense), so its own stored input_scale does not
    change the output, while the query's does; the K/V state's input history still records the input's amax."""
    layer = _tiny_layer(dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 32))
    recipe = DelayedScaling(amax_history_len=4)
    with fp8.autocast(recipe=recipe):
        v = jax.jit(lambda k: layer.init(k, x, deterministic=True))(jax.random.PRNGKey(0))
        apply = jax.jit(lambda v: layer.apply(v, x, deterministic=True))
        grads = jax.jit(jax.grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True) ** 2)))(v)

    def with_scale(module, value):
        st = jax.tree_util.tree_map(lambda a: a, v[fp8.FP8_COLLECTION])
        meta = dict(st["attention"][module]["fp8_meta"])
        meta["input_scale"] = jnp.full((1,), value, jnp.float32)
        st = {**st, "attention": {**st["attention"], module: {**st["attention"][module], "fp8_meta": meta}}}
        return {**v, fp8.FP8_COLLECTION: st}

    with fp8.autocast(recipe=recipe):
        y = np.asarray(apply(v))
        np.testing.assert_array_equal(np.asarray(apply(with_scale("kv", 3.0))), y)   # kv's own scale: unused
        assert not np.array_equal(np.asarray(apply(with_scale("query", 3.0))), y)   # the query's: used by both
    d = DenseGeneral(features=8)
    with fp8.autocast(recipe=recipe), pytest.raises(ValueError, match=r"fp8_input_scale has shape \(2,\)"):
        d.init(jax.random.PRNGKey(0), x, fp8_input_scale=jnp.ones((2,)))
    new = grads[fp8.FP8_COLLECTION]["attention"]
    for k in ("input_amax_history", "input_scale"):  # each module gets its own next state, none twice
        np.testing.assert_array_equal(new["kv"]["fp8_meta"][k], new["query"]["fp8_meta"][k])
    assert float(np.max(new["kv"]["fp8_meta"]["input_amax_history"])) > 0


@pytest.mark.slow  # 18 s of CI time; in CI the fused GQA path runs in test_flax_decode's FP8 decode test and the
# norm inside the cast in test_fp8_fused_mlp's norm tests
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_gqa_query_and_kv_share_one_norm_cast(recipe, monkeypatch):
    """With the fused casts, GQA self-attention runs its input norm inside one cast of x that feeds the query and the
    K/V GEMMs (te_jax/fp8/norm_dense.py): the same parameter and FP8-state trees as the unfused modules, and the same
    loss, gradients and next FP8 state (up to f32 summation order in gamma's gradient)."""
    layer = _tiny_layer(dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 32)) * 2.0 + 0.5
    ct = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 32))

    def run(fused):
        monkeypatch.setenv("TE_JAX_FP8_FUSED", fused)
        with fp8.autocast(recipe=recipe):
            v = jax.jit(lambda k: layer.init(k, x, deterministic=True))(jax.random.PRNGKey(0))
            info = fp8.explain(lambda: layer.apply(v, x, deterministic=True))
            f = jax.jit(jax.value_and_grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True) * ct)),
                        compiler_options={"xla_allow_excess_precision": False})
            return v, info, f(v)

    v1, info1, (l1, g1) = run("1")
    v0, info0, (l0, g0) = run("0")
    assert jax.tree_util.tree_structure(v1) == jax.tree_util.tree_structure(v0)
    jax.tree_util.tree_map(np.testing.assert_array_equal, v1, v0)  # same names, same init values
    shared = [i for i in info1 if "shared by query and kv" in i.reason]
    assert [i.module for i in shared] == ["attention/query", "attention/kv"], info1
    assert not any("shared by query and kv" in i.reason for i in info0)
    # the explanation says where the norm's statistics come from (in the cast kernel: delayed scaling, the default)
    # and that the query and K/V weights are cast into one buffer (TE_JAX_FP8_MERGED_CASTS, the default)
    in_kernel = isinstance(recipe, DelayedScaling)
    for i in shared:
        assert ("computed in the same kernel" in i.reason) == in_kernel, i.reason
        assert ("XLA reduction first" in i.reason) == (not in_kernel), i.reason
        assert "one buffer for one GEMM" in i.reason, i.reason
    monkeypatch.setenv("TE_JAX_FP8_NORM_STATS", "xla")
    monkeypatch.setenv("TE_JAX_FP8_MERGED_CASTS", "0")
    _, info_off, _ = run("1")
    for i in (i for i in info_off if "shared by query and kv" in i.reason):
        assert "XLA reduction first" in i.reason and "one buffer" not in i.reason, i.reason
    if jax.default_backend() == "cpu":
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree_util.tree_leaves(g0)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    else:  # cuBLASLt's FP8 GEMMs accumulate in another order per layout, and a changed rounding moves FP8 values
        assert abs(float(l1) - float(l0)) <= 2.0 ** -5 * abs(float(l0))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1["params"]),
                                jax.tree_util.tree_leaves(g0["params"])):
            assert _rel(a, b) < 2.0 ** -5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=3), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_norm_fp8_dense_kept_weights_change_no_value(recipe, monkeypatch):
    """The fused dense path (quantize._tn_dense, here a norm in front of two GEMMs, GQA's query and K/V) with the
    weights' FP8 copies kept for the backward (TE_JAX_FP8_KEEP_WEIGHTS=1) gives bitwise the outputs, gradients and
    next FP8 states of the re-cast path over two steps, and its backward casts no weight outside the kernels; both
    are within FP8 error of the fp32 norm and GEMMs. auto keeps the dense copies for no recipe. With the norm's
    statistics in the cast kernel (TE_JAX_FP8_NORM_STATS=kernel) the values match up to fp32 summation order; with the
    query and K/V GEMMs as one over stacked casts (TE_JAX_FP8_MERGED_CASTS=1) up to a bf16 rounding."""
    from te_jax.fp8 import norm_cast, norm_dense

    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")
    monkeypatch.setenv("TE_JAX_FP8_NORM_STATS", "xla")  # the other settings are compared with this one below
    monkeypatch.setenv("TE_JAX_FP8_MERGED_CASTS", "0")
    spec = norm_cast.NormSpec("rmsnorm", 1e-6, False, "xla")
    ks = jax.random.split(jax.random.PRNGKey(5), 5)
    x = (jax.random.normal(ks[0], (64, 32)) * 2 + 0.5).astype(jnp.bfloat16)
    gamma = 1 + 0.1 * jax.random.normal(ks[1], (32,))
    ws = (0.2 * jax.random.normal(ks[2], (32, 64)), 0.2 * jax.random.normal(ks[3], (32, 16)))
    cts = (jax.random.normal(ks[4], (64, 64)), jax.random.normal(ks[0], (64, 16)))
    delayed = isinstance(recipe, DelayedScaling)

    def loss(x, gamma, ws, states):
        ys = norm_dense.norm_fp8_dense(x, gamma, None, ws, states, recipe, spec, interpret=True)
        return sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(ys, cts))

    def run(keep):
        monkeypatch.setenv("TE_JAX_FP8_KEEP_WEIGHTS", keep)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), compiler_options={
            "xla_allow_excess_precision": False})
        states = (Q.init_state(3), Q.init_state(3)) if delayed else None
        out = []
        for _ in range(2):
            l, g = step(x, gamma, ws, states)
            out.append((l, g[:3]))
            states = g[3] if delayed else None
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=2))(x, gamma, ws, (Q.init_state(3),) * 2 if delayed else None)
        eqns = list(walk(jaxpr.jaxpr))  # (not inside the cast kernels)
        w_casts = sum(e.primitive.name == "convert_element_type" and jnp.dtype(e.params["new_dtype"]).itemsize == 1
                      and tuple(e.outvars[0].aval.shape) in {(32, 64), (32, 16)} for e in eqns)
        return out, states, w_casts

    new, s_new, casts_new = run("1")
    old, s_old, casts_old = run("0")
    _, _, casts_auto = run("auto")
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                                      np.asarray(b, np.float32)), (new, s_new),
                           (old, s_old))
    assert casts_old == casts_auto == 2 and casts_new == 0, (casts_old, casts_auto, casts_new)  # the re-casts
    # the norm's statistics in the cast kernel (TE_JAX_FP8_NORM_STATS=kernel; delayed scaling only): the same up to
    # fp32 summation order
    monkeypatch.setenv("TE_JAX_FP8_NORM_STATS", "kernel")
    in_kernel, s_in_kernel, _ = run("0")
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                                   rtol=1e-4, atol=1e-5), (in_kernel, s_in_kernel),
                           (old, s_old))
    # the query and K/V GEMMs as one over stacked casts (TE_JAX_FP8_MERGED_CASTS=1), kept copies or not: each
    # output slice (and weight gradient) is rounded to the compute dtype before its own scale, so the values move by
    # about one bf16 rounding; the FP8 states are the same
    monkeypatch.setenv("TE_JAX_FP8_NORM_STATS", "xla")
    monkeypatch.setenv("TE_JAX_FP8_MERGED_CASTS", "1")
    for keep in ("0", "1"):
        merged, s_merged, _ = run(keep)
        for (l_m, g_m), (l_o, g_o) in zip(merged, old):
            assert abs(float(l_m) - float(l_o)) <= 2.0 ** -6 * abs(float(l_o)) + 1e-3
            for a, b in zip(jax.tree_util.tree_leaves(g_m), jax.tree_util.tree_leaves(g_o)):
                assert _rel(a, b) < 2.0 ** -6, (keep, _rel(a, b))
        if delayed:  # amaxes and scales: the same casts of the same values
            for a, b in zip(jax.tree_util.tree_leaves(s_merged), jax.tree_util.tree_leaves(s_old)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2.0 ** -6)
    xf = x.astype(jnp.float32)
    ref = lambda x, gamma, ws: sum(jnp.sum((x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * gamma
                                            ) @ w * c) for w, c in zip(ws, cts))
    l_ref, g_ref = jax.value_and_grad(ref, argnums=(0, 1, 2))(xf, gamma, ws)
    for l_new, g_new in (new[-1], merged[-1], in_kernel[-1]):  # kept copies, stacked casts, statistics in the kernel
        assert abs(float(l_new) - float(l_ref)) < 0.1 * abs(float(l_ref)) + 1.0
        for a, b in zip(jax.tree_util.tree_leaves(g_new), jax.tree_util.tree_leaves(g_ref)):
            assert _rel(a, b) < 0.15, _rel(a, b)


def test_norm_fp8_dense_bad_arguments_are_clear_errors():
    from te_jax.fp8 import norm_cast, norm_dense

    x, g = jnp.ones((2, 8, 32)), jnp.ones((32,))
    spec = norm_cast.NormSpec("rmsnorm", 1e-6, False, "xla")
    with pytest.raises(ValueError, match=r"kernels\[1\] has shape \(16, 4\); expected \[32, \*features\]"):
        norm_dense.norm_fp8_dense(x, g, None, (jnp.ones((32, 4)), jnp.ones((16, 4))), None, Float8CurrentScaling(),
                                  spec)
    with pytest.raises(ValueError, match=r"gamma has shape \(16,\); expected \(32,\)"):
        norm_dense.norm_fp8_dense(x, jnp.ones((16,)), None, (jnp.ones((32, 4)),), None, Float8CurrentScaling(), spec)
    with pytest.raises(ValueError, match="one state per kernel"):
        norm_dense.norm_fp8_dense(x, g, None, (jnp.ones((32, 4)),), None, DelayedScaling(), spec)
    with pytest.raises(ValueError, match="not per-tensor"):
        norm_dense.norm_fp8_dense(x, g, None, (jnp.ones((32, 4)),), None, Float8BlockScaling(), spec)
    with pytest.raises(ValueError, match="layernorm_type"):
        norm_cast.norm_spec(x, g, None, layernorm_type="batchnorm", epsilon=1e-6, zero_centered_gamma=False,
                            backend="auto")


def test_missing_state_is_a_clear_error():
    d = DenseGeneral(features=16)
    x = jnp.ones((2, 32))
    v = d.init(jax.random.PRNGKey(0), x)  # no autocast: no FP8 state
    with fp8.autocast():
        with pytest.raises(ValueError, match="autocast"):
            d.apply(v, x)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        y, _ = LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"), layernorm_type="rmsnorm",
                            intermediate_dropout_rate=0.0)(x, deterministic=True)
        return x + y, None


@pytest.mark.parametrize("fused", ["0", "1"])
def test_state_through_scan_remat_and_checkpoint(fused, monkeypatch):
    """The delayed-scaling state under nn.scan(nn.remat(...)): one state per layer, updated, through a checkpoint.
    fused="1": the fused MLP (interpret mode here), whose state updates run in one kernel per pass; they equal the
    XLA ops' (TE_JAX_FP8_STATE_KERNEL=0) bitwise."""
    monkeypatch.setenv("TE_JAX_FP8_FUSED", fused)
    stack = nn.scan(nn.remat(_Block), variable_axes={"params": 0, fp8.FP8_COLLECTION: 0},
                    split_rngs={"params": True}, length=3, metadata_params={nn.PARTITION_NAME: "layers"})
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
    recipe = DelayedScaling(amax_history_len=5)

    def f(v):
        return jnp.sum(stack().apply(v, x, None)[0] ** 2)

    with fp8.autocast(recipe=recipe):
        v = jax.jit(lambda k: stack().init(k, x, None))(jax.random.PRNGKey(1))
        meta = v[fp8.FP8_COLLECTION]["LayerNormMLP_0"]["wo_fp8_meta"]
        assert meta["input_amax_history"].shape == (3, 5) and meta["input_scale"].shape == (3, 1)
        g = jax.jit(jax.grad(f))(v)
        v2 = fp8.update_fp8_state(v, g)
        new = v2[fp8.FP8_COLLECTION]["LayerNormMLP_0"]["wo_fp8_meta"]
        # one state per layer: three different amaxes recorded, three different scales learnt
        amaxes = np.asarray(new["input_amax_history"][:, -1])
        assert np.all(amaxes > 0) and len(set(amaxes.tolist())) == 3
        assert np.all(np.asarray(new["output_grad_amax_history"][:, -1]) > 0)
        # checkpoint round trip (flax.serialization)
        blob = serialization.msgpack_serialize(serialization.to_state_dict(v2))
        v3 = serialization.from_state_dict(jax.tree_util.tree_map(jnp.zeros_like, v2),
                                           serialization.msgpack_restore(blob))
        jax.tree_util.tree_map(np.testing.assert_array_equal, v3, v2)
        np.testing.assert_array_equal(f(v3), f(v2))
        if fused == "1":
            monkeypatch.setenv("TE_JAX_FP8_STATE_KERNEL", "0")
            g_ops = jax.jit(jax.grad(lambda v: f(v)))(v)
            jax.tree_util.tree_map(np.testing.assert_array_equal, g_ops[fp8.FP8_COLLECTION], g[fp8.FP8_COLLECTION])


@pytest.mark.parametrize("fused", ["0", "1"])
def test_hlo_has_fp8_converts_for_all_three_gemms(fused, monkeypatch):
    """Both dense paths: unfused (XLA casts) and fused (cast_transpose kernels, every GEMM "TN")."""
    monkeypatch.setenv("TE_JAX_FP8_FUSED", fused)
    m = DenseGeneral(features=32, use_bias=False, dtype=jnp.bfloat16)
    x = jnp.ones((4, 16, 64), jnp.bfloat16)
    with fp8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        v = jax.eval_shape(m.init, jax.random.PRNGKey(0), x)  # lowering needs shapes only
        f = jax.jit(jax.value_and_grad(lambda v, x: jnp.sum(m.apply(v, x).astype(jnp.float32)), argnums=(0, 1)))
        lowered = f.lower(v, x)
    text = lowered.as_text()
    dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
    assert len(dots) == 3
    # DEFAULT precision even under conftest's jax_default_matmul_precision="highest" (the FP8 rewrite wants it)
    assert all("precision = [DEFAULT, DEFAULT]" in d for d in dots), dots
    assert sum("xf8E4M3FN>, tensor<" in d and "xf8E4M3FN>)" in d for d in dots) == 1           # forward
    # dgrad g . w and wgrad x^T . g^T: one e5m2 (the gradient) and one e4m3 operand each
    assert sum(re.search(r"xf8E5M2>, tensor<[0-9x]*xf8E4M3FN>|xf8E4M3FN>, tensor<[0-9x]*xf8E5M2>", d) is not None
               for d in dots) == 2
    if fused == "1":  # every FP8 operand contracts its minor axis ("TN", cuBLASLt's FP8 layout): no FP8 transposes
        assert all("contracting_dims = [1] x [1]" in d for d in dots), dots
        assert "stablehlo.transpose" not in text
    compiled = lowered.compile().as_text()
    assert "f8e4m3fn" in compiled and "f8e5m2" in compiled


def test_autocast_is_part_of_the_jit_cache_key():
    """One jitted function called outside and inside autocast is traced for each setting (no stale trace)."""
    d = DenseGeneral(features=16, use_bias=False)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 32))
    v = d.init(jax.random.PRNGKey(1), x)
    f = jax.jit(lambda v, x: d.apply(v, x))
    y_off = f(v, x)
    with fp8.autocast(recipe=Float8CurrentScaling()):
        y_on = f(v, x)
    y_off2 = f(v, x)
    np.testing.assert_array_equal(y_off, y_off2)
    assert not np.array_equal(y_on, y_off) and _rel(y_on, y_off) < 2.0 ** -4


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuBLASLt FP8 GEMMs need a GPU (compute capability >= 8.9)")
# qdq is an FP8 GEMM only with XLA's Triton GEMM fusions off (with them on, the dequantizing converts go into a
# Triton fusion and the autotuner's fallback is a bf16 GEMM: benchmarks/results/fp8_layer_h100.md).
@pytest.mark.parametrize("style,options", [("direct", None), ("qdq", {"xla_gpu_enable_triton_gemm": False})])
def test_gpu_compiled_hlo_has_three_fp8_gemms(style, options, monkeypatch):
    """On an FP8-capable GPU the forward, dgrad and wgrad of one FP8 dense layer are cuBLASLt FP8 GEMMs."""
    from te_jax._compat import gpu_compute_capability

    if (gpu_compute_capability() or (0, 0)) < (8, 9):
        pytest.skip("GPU without FP8 tensor cores")
    monkeypatch.setenv("TE_JAX_FP8_GEMM", style)
    m = DenseGeneral(features=256, use_bias=False, dtype=jnp.bfloat16)
    kx, kc = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (4, 64, 128), jnp.bfloat16)
    ct = jax.random.normal(kc, (4, 64, 256), jnp.float32)
    # ct is an argument: with a constant cotangent (a plain sum loss) XLA folds the backward GEMMs away
    with fp8.autocast(recipe=DelayedScaling(amax_history_len=16)):
        v = m.init(jax.random.PRNGKey(0), x)
        f = jax.jit(lambda v, x, ct: jax.value_and_grad(
            lambda v, x: jnp.sum(m.apply(v, x).astype(jnp.float32) * ct), argnums=(0, 1))(v, x))
        hlo = f.lower(v, x, ct).compile(compiler_options=options).as_text()
    from te_jax.fp8.hlo import gemm_kinds

    kinds = gemm_kinds(hlo)
    # cuBLASLt FP8 calls, or (small shapes, XLA's autotuner's pick) Triton GEMM fusions on FP8 operands
    assert kinds["other"] == 0 and kinds["fp8 cublaslt"] + kinds["fp8 fusion"] == 3, (
        kinds, [l.strip()[:300] for l in hlo.splitlines() if "custom_call_target" in l or " dot(" in l])


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuBLASLt FP8 GEMMs need a GPU (compute capability >= 8.9)")
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_direct_gemm_folds_its_scale(out_dtype):
    """The direct style's scale (the product of two scale_invs, not a constant) goes into the cuBLASLt FP8 call:
    no fusion writes an array of the output's shape; the result equals the f32 reference of the same FP8 operands
    up to the output's rounding and the scale's rounding to the output dtype (2^-9 for bf16)."""
    from te_jax._compat import gpu_compute_capability
    from te_jax.fp8.quantize import _scaled_gemm

    if (gpu_compute_capability() or (0, 0)) < (8, 9):
        pytest.skip("GPU without FP8 tensor cores")
    ka, kb = jax.random.split(jax.random.PRNGKey(3))
    a = jax.random.normal(ka, (512, 256), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jax.random.normal(kb, (384, 256), jnp.float32).astype(jnp.float8_e5m2)
    sa, sb = jnp.float32(0.37), jnp.float32(1.9)
    tn = (((1,), (1,)), ((), ()))
    f = jax.jit(lambda a, b, sa, sb: _scaled_gemm("direct", out_dtype, sa, sb)(a, b, tn))
    hlo = f.lower(a, b, sa, sb).compile().as_text()
    assert "__cublas$lt$matmul$f8" in hlo
    full = [l.strip()[:200] for l in hlo.splitlines() if " fusion(" in l and "[512,384]" in l.split("=")[1][:40]]
    assert not full, full
    ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T) * (sa * sb)
    # (f32: the fast-accumulating FP8 tensor-core sums, about 2e-4 relative on the H100)
    assert _rel(f(a, b, sa, sb), ref) < (4e-3 if out_dtype == jnp.bfloat16 else 1e-3)


@pytest.mark.slow  # CI runs -m "not slow"; the TransformerLayer training test above covers the same path
def test_train_lm_example_fp8_delayed(tmp_path):
    """examples/train_lm.py --fp8 delayed: trains, the FP8 state is part of the train state and moves."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("train_lm_fp8_test", path)
    train_lm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train_lm  # dataclasses (the Flax module) look their module up by name
    spec.loader.exec_module(train_lm)
    out = train_lm.main(["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq-len", "16",
                         "--batch", "2", "--lr", "1e-2", "--warmup", "1", "--steps", "3", "--eval-batches", "1",
                         "--eval-every", "0", "--log-every", "1", "--no-progress", "--dtype", "fp32",
                         "--no-compile-cache", "--no-ckpt", "--no-plot", "--sample-len", "0", "--fp8", "delayed",
                         "--out-dir", str(tmp_path)])
    assert all(np.isfinite(v) for v in out["losses"].values()) and np.isfinite(out["eval_loss"])


def test_fp8_autocast_older_spelling():
    with fp8.fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        assert fp8.get_autocast() == (True, Float8CurrentScaling())
    assert fp8.get_autocast()[0] is False
    with pytest.raises(ValueError, match="mesh_resource"):
        with fp8.fp8_autocast(enabled=True, mesh_resource=object()):
            pass


def test_fp8_mlp_under_a_data_parallel_mesh_matches_one_device():
    """Under a mesh (batch over 'data', layernorm_input_axes given) the FP8 MLP runs under XLA's partitioner:
    the amax is the global max, so outputs, gradients and the new FP8 state equal the one-device run."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    m = LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"), layernorm_type="rmsnorm",
                     intermediate_dropout_rate=0.0, layernorm_input_axes=("batch", "length", "embed"))
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 16))
    recipe = DelayedScaling(amax_history_len=3)

    def run(x):
        with fp8.autocast(recipe=recipe):
            v = jax.jit(lambda k: m.init(k, x, deterministic=True))(jax.random.PRNGKey(1))
            f = jax.jit(jax.value_and_grad(lambda v, x: jnp.sum(m.apply(v, x, deterministic=True)[0] ** 2)))
            return f(v, x)

    loss1, g1 = run(x)
    mesh = cpu_mesh((2,), ("data",), auto=True)
    with jax.set_mesh(mesh), nn.logical_axis_rules((("batch", "data"), ("length", None), ("embed", None))):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        loss2, g2 = run(xs)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(nn.meta.unbox(g2)), jax.tree_util.tree_leaves(nn.meta.unbox(g1))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_fp8_mlp_under_a_tensor_parallel_mesh_matches_one_device():
    """Tensor parallelism: the MLP's hidden ('mlp') axis, so both kernels, sharded over 'model'. The FP8 MLP runs
    under XLA's partitioner, so every amax (the sharded weights' too) is the global max: outputs, gradients and
    the updated delayed-scaling state equal the one-device run's."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    m = LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"), layernorm_type="rmsnorm",
                     intermediate_dropout_rate=0.0)
    x = jax.random.normal(jax.random.PRNGKey(2), (4, 8, 16))
    recipe = DelayedScaling(amax_history_len=3)

    def run(mesh=None):
        with fp8.autocast(recipe=recipe):
            v = jax.jit(lambda k: m.init(k, x, deterministic=True))(jax.random.PRNGKey(3))
            if mesh is not None:  # place the kernels as the logical axis rules shard them
                shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(v), mesh, (("mlp", "model"),))
                v = jax.device_put(v, shardings)
                assert v["params"]["wi_kernel"].value.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
            step = jax.jit(lambda v, x: jax.value_and_grad(
                lambda p: jnp.sum(m.apply({**v, "params": p}, x, deterministic=True,
                                          mutable=[fp8.FP8_COLLECTION])[0][0] ** 2))(v["params"]))
            _, new_state = jax.jit(lambda v, x: m.apply(v, x, deterministic=True, mutable=[fp8.FP8_COLLECTION]))(v, x)
            return step(v, x), new_state

    (loss1, g1), s1 = run()
    mesh = cpu_mesh((2,), ("model",), auto=True)
    with jax.set_mesh(mesh), nn.logical_axis_rules((("mlp", "model"),)):
        (loss2, g2), s2 = run(mesh)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(nn.meta.unbox(g2)), jax.tree_util.tree_leaves(nn.meta.unbox(g1))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(s2), jax.tree_util.tree_leaves(s1)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_gemm_kinds_counts_cublaslt_and_fusion_fp8_gemms():
    """te_jax.fp8.hlo.gemm_kinds on hand-written optimized-HLO snippets (the GPU tests read real ones)."""
    from te_jax.fp8.hlo import fp8_gemm_count, gemm_kinds

    text = "\n".join([
        '  %p0 = f8e4m3fn[64,128]{1,0} parameter(0)',
        '  %p1 = f8e4m3fn[128,256]{1,0} parameter(1)',
        '  %p2 = bf16[64,128]{1,0} parameter(2)',
        '  %d0 = bf16[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}',
        '  %d1 = bf16[64,256]{1,0} dot(%p2, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}',
        '  %g = (bf16[64,256]{1,0}, s8[8]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$lt$matmul$f8"',
        '  %h = (bf16[64,256]{1,0}, s8[8]{0}) custom-call(%p2, %p2), custom_call_target="__cublas$lt$matmul"',
    ])
    k = gemm_kinds(text)
    assert (k["fp8 cublaslt"], k["fp8 fusion"], k["other"]) == (1, 1, 2)
    assert fp8_gemm_count(text) == 2


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()], ids=["delayed", "current"])
def test_fused_dense_matches_unfused_dense(recipe, monkeypatch):
    """fp8_dot_general through cast_transpose + TN GEMMs (fused) == the XLA-cast path, over two state updates:
    output, dx, dw and the delayed-scaling state (same quantized math, different kernels)."""
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(7), 3)
    x = jax.random.normal(kx, (3, 24, 40), jnp.float32) * 3.0   # M = 72, K = 40: ragged against the kernel blocks
    w = jax.random.normal(kw, (40, 2, 24), jnp.float32) * 0.2
    g = jax.random.normal(kg, (3, 24, 2, 24), jnp.float32)
    dn = (((2,), (0,)), ((), ()))
    state0 = Q.init_state(4) if isinstance(recipe, DelayedScaling) else None

    def run(fused):
        monkeypatch.setenv("TE_JAX_FP8_FUSED", fused)

        @jax.jit
        def step(x, w, state):
            y, vjp = jax.vjp(lambda x, w, s: Q.fp8_dot_general(x, w, dn, recipe, s), x, w, state)
            return (y,) + vjp(g)

        state, outs = state0, []
        for _ in range(2):
            y, dx, dw, ds = step(x, w, state)
            outs.append((y, dx, dw))
            state = ds if state is not None else None
        return outs, state

    (o_un, s_un), (o_fu, s_fu) = run("0"), run("1")
    # the same FP8 operands; on a GPU cuBLASLt takes other algorithms for the fused path's TN layouts, whose FP8
    # accumulation order differs (6.8e-5 seen on the H100), on the CPU the GEMMs are the same
    tol = 1e-5 if jax.default_backend() == "cpu" else 1e-3
    for a_un, a_fu in zip(o_un, o_fu):
        for a, b in zip(a_un, a_fu):
            assert _rel(b, a) < tol, _rel(b, a)
    if s_un is not None:
        for k in Q.STATE_KEYS:
            np.testing.assert_allclose(np.asarray(s_fu[k]), np.asarray(s_un[k]), rtol=1e-6)
    # and it is FP8 math, not the fp32 product
    ref = jnp.einsum("bsk,khn->bshn", x, w)
    assert 1e-4 < _rel(o_fu[-1][0], ref) < 0.1


def test_delayed_state_orbax_round_trip(tmp_path):
    """The FP8 collection survives an orbax checkpoint: restored after two state-updating steps, the next step
    gives the same loss, gradients and new state as continuing without the checkpoint."""
    ocp = pytest.importorskip("orbax.checkpoint")
    m = LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"), dtype=jnp.float32)
    kx, kc = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (2, 8, 16), jnp.float32)
    ct = jax.random.normal(kc, (2, 8, 16), jnp.float32)
    with fp8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        v = jax.jit(m.init)(jax.random.PRNGKey(0), x)

        @jax.jit
        def step(v):
            def loss(v):
                y = m.apply(v, x)
                y = y[0] if isinstance(y, tuple) else y
                return jnp.sum(y * ct)
            l, g = jax.value_and_grad(loss)(v)
            return l, g, fp8.update_fp8_state(v, g)

        for _ in range(2):
            _, _, v = step(v)
        assert float(jnp.max(v[fp8.FP8_COLLECTION]["wi_fp8_meta"]["input_amax_history"])) > 0  # state has moved
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp_path / "ckpt", v)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "ckpt", jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, v))
        l1, g1, v1 = step(v)
        l2, g2, v2 = step(restored)
    assert float(l1) == float(l2)
    for a, b in zip(jax.tree_util.tree_leaves((g1, v1)), jax.tree_util.tree_leaves((g2, v2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_delayed_scaling_state_moves_and_matches_linen():
    """NNX (bridged) TransformerLayer under DelayedScaling: grads w.r.t. te_nnx.FP8State give the next state,
    update_fp8_state writes it back; two steps equal the linen module's two steps (loss and FP8 state)."""
    from flax import nnx

    from te_jax.flax import nnx as te_nnx

    kw = dict(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
              intermediate_dropout=0.0, dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 8, 32))
    pure = getattr(nnx, "to_pure_dict", None) or (lambda st: st.to_pure_dict())
    with fp8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        m = te_nnx.TransformerLayer(**kw, rngs=nnx.Rngs(params=0))
        te_nnx.lazy_init(m, x, deterministic=True)
        lin = TransformerLayer(**kw)
        v = {"params": pure(nnx.state(m, nnx.Param)), fp8.FP8_COLLECTION: pure(nnx.state(m, te_nnx.FP8State))}

        def nnx_loss(m):
            return jnp.sum(jnp.square(m(x, deterministic=True)))

        def lin_loss(v):
            return jnp.sum(jnp.square(lin.apply(v, x, deterministic=True)))

        # jitted, traced under the autocast (eagerly every op compiles on its own)
        nnx_step = nnx.jit(nnx.value_and_grad(nnx_loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param,
                                                                                          te_nnx.FP8State))))
        lin_step = jax.jit(jax.value_and_grad(lin_loss))
        for _ in range(2):
            l_nnx, g = nnx_step(m)
            te_nnx.update_fp8_state(m, g)
            l_lin, gl = lin_step(v)
            v = fp8.update_fp8_state(v, gl)
            np.testing.assert_allclose(float(l_nnx), float(l_lin), rtol=1e-6)
    s_nnx = pure(nnx.state(m, te_nnx.FP8State))
    for a, b in zip(jax.tree_util.tree_leaves(s_nnx), jax.tree_util.tree_leaves(v[fp8.FP8_COLLECTION])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert any(float(np.max(a)) > 0 for a in jax.tree_util.tree_leaves(s_nnx))  # the histories moved
