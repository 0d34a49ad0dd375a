"""layernorm_mlp / layernorm_dense: xla and pallas (interpret) backends vs an fp32 reference.

The cases of a test are compiled as one program (helpers.fwd_bwd_many; about a third of the time of a compile
each) and checked one by one; the fp32 references are computed once per module (functools.cache)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import mlp as M
from helpers import fwd_bwd_many, rand, ref_norm
from te_jax.backends.ops import NAMES as BACKENDS
from tolerance import assert_close
from te_jax.activations import validate_activations

ACT = {
    "gelu": lambda x: 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
    "relu": lambda x: jnp.maximum(x, 0),
    "silu": lambda x: x / (1 + jnp.exp(-x)),
    "quick_gelu": lambda x: x / (1 + jnp.exp(-1.702 * x)),
    "squared_relu": lambda x: jnp.maximum(x, 0) ** 2,
    "linear": lambda x: x,
}


def ref_mlp(x, g, b, w1, b1, w2, b2, *, acts, rms=False, zc=False):
    ln = ref_norm(x, g, b, rms, zc)
    h = jnp.einsum("...d,dnf->...nf", ln, w1, precision="highest") + b1
    a = ACT[acts[0]](h[..., 0, :])
    if len(acts) == 2:
        a = a * ACT[acts[1]](h[..., 1, :])
    return jnp.einsum("...f,fo->...o", a, w2, precision="highest") + b2, ln


def make(seed, lead, d, f, do, n_act, dtype):
    """Drawn by numpy (helpers.rand): no per-shape compile, which jax.random pays eagerly for every new shape."""
    rng = np.random.default_rng(seed)
    x = rand(rng, (*lead, d), dtype)
    g = jnp.asarray(0.5 + rng.uniform(size=(d,)).astype(np.float32))
    b = rand(rng, (d,), scale=0.2)
    w1 = rand(rng, (d, n_act, f), dtype, scale=1 / np.sqrt(d))
    b1 = rand(rng, (n_act, f), dtype, scale=0.2)
    w2 = rand(rng, (f, do), dtype, scale=1 / np.sqrt(f))
    b2 = rand(rng, (do,), dtype, scale=0.2)
    dy = rand(rng, (*lead, do), dtype)
    return (x, g, b, w1, b1, w2, b2), dy


def f32(t):
    return jax.tree.map(lambda a: a.astype(jnp.float32), t)


def check_all(got, want, tol, what=""):
    """max|a - r| <= tol * (max|r| + 1e-6) for each pair (tests/tolerance.py)."""
    for i, (a, r) in enumerate(zip(got, want)):
        assert_close(a, r, tol, f"{what}[{i}]", floor=None)


ACTS = [("gelu",), ("relu",), ("silu",), ("quick_gelu",), ("squared_relu",), ("linear",),
        ("gelu", "linear"), ("silu", "linear"), ("relu", "linear"), ("quick_gelu", "linear"),
        ("squared_relu", "linear")]


@functools.cache
def _activation_cases():
    """Per activation of ACTS: (inputs, cotangent) and the fp32 reference's (output, gradients)."""
    inputs = [make(len(acts) * 7 + len(acts[0]), (2, 3), 48, 40, 24, len(acts), jnp.float32) for acts in ACTS]
    refs = fwd_bwd_many([(functools.partial(lambda *a, acts: ref_mlp(*a, acts=acts)[0], acts=acts), args, dy)
                         for acts, (args, dy) in zip(ACTS, inputs)])
    return inputs, refs


@pytest.mark.parametrize("backend", BACKENDS)
def test_activations_fp32(backend):
    """Every activation and gated pair of ACTS, output and gradients (one compile for all, each checked)."""
    inputs, refs = _activation_cases()
    got = fwd_bwd_many([(functools.partial(lambda *a, acts: M.layernorm_mlp(*a, activations=acts, backend=backend),
                                           acts=acts), args, dy) for acts, (args, dy) in zip(ACTS, inputs)])
    for acts, (y, grads), (yr, grads_r) in zip(ACTS, got, refs):
        name = "-".join(acts)
        check_all([y], [yr], 1e-4, f"{name} out")
        check_all(grads, grads_r, 1e-4, f"{name} grad")


NORM_CASES = [(lt, zc, acts, d, dtype)
              for dtype in (jnp.float32, jnp.bfloat16)
              for lt, zc, acts, d in [("rmsnorm", False, ("gelu",), 100),
                                      ("rmsnorm", True, ("silu", "linear"), 48),
                                      ("layernorm", True, ("gelu", "linear"), 100)]]


def _norm_case(layernorm_type, zc, acts, d, dtype, backend):
    """(te_jax fn, fp32 reference fn, args, dy); RMSNorm takes no beta."""
    args, dy = make(d + zc, (2, 2, 3), d, 40, 36, len(acts), dtype)
    fn = lambda *a: M.layernorm_mlp(*a, layernorm_type=layernorm_type, zero_centered_gamma=zc,
                                    activations=acts, backend=backend)
    if layernorm_type == "rmsnorm":
        fn2 = lambda x, g, w1, b1, w2, b2: fn(x, g, None, w1, b1, w2, b2)
        fr = lambda x, g, w1, b1, w2, b2: ref_mlp(x, g, 0.0, w1, b1, w2, b2, acts=acts, rms=True, zc=zc)[0]
        args = tuple(a for i, a in enumerate(args) if i != 2)
    else:
        fn2 = fn
        fr = lambda *a: ref_mlp(*a, acts=acts, zc=zc)[0]
    return fn2, fr, args, dy


@functools.cache
def _norm_refs():
    cases = [_norm_case(*c, backend=None) for c in NORM_CASES]
    return fwd_bwd_many([(fr, f32(args), dy.astype(jnp.float32)) for _, fr, args, dy in cases])


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_types_dtypes(backend):
    """LayerNorm / RMSNorm, zero-centred gamma, fp32 and bf16 (NORM_CASES: one compile for all, each checked)."""
    cases = [_norm_case(*c, backend=backend) for c in NORM_CASES]
    got = fwd_bwd_many([(fn, args, dy) for fn, _, args, dy in cases])
    for (lt, zc, acts, d, dtype), (y, grads), (yr, grads_r) in zip(NORM_CASES, got, _norm_refs()):
        name = f"{lt}-zc{zc}-{'-'.join(acts)}-d{d}-{jnp.dtype(dtype).name}"
        assert y.dtype == dtype and y.shape == (2, 2, 3, 36), name
        tol = 1e-4 if dtype == jnp.float32 else 4e-2
        check_all([y], [yr], tol, f"{name} out")
        check_all(grads, grads_r, tol, f"{name} grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_layernorm_output(backend):
    acts = ("silu", "linear")
    args, dy = make(5, (3, 4), 48, 32, 48, 2, jnp.float32)
    dln = rand(9, (3, 4, 48))
    fn = lambda *a: M.layernorm_mlp(*a, activations=acts, backend=backend, return_layernorm_output=True)
    ((y, ln), grads), ((yr, lnr), grads_r) = fwd_bwd_many([(fn, args, (dy, dln)),
                                                          (lambda *a: ref_mlp(*a, acts=acts), args, (dy, dln))])
    check_all([y, ln], [yr, lnr], 1e-4)
    check_all(grads, grads_r, 1e-4)


def test_no_biases_and_fused_gemm_kernel():
    from pallas_kernels.ln_mlp import ln_mlp as kern

    acts = ("gelu", "linear")
    (x, g, b, w1, b1, w2, b2), dy = make(11, (5, 3), 40, 24, 20, 2, jnp.float32)
    for gemm in ("pallas",):
        fn = lambda x, g, b, w1, w2: kern.layernorm_mlp(x, g, b, w1, None, w2, None, activations=acts,
                                                        gemm_impl=gemm, interpret=True)
        fr = lambda x, g, b, w1, w2: ref_mlp(x, g, b, w1, 0.0, w2, 0.0, acts=acts)[0]
        (y, grads), (yr, grads_r) = fwd_bwd_many([(fn, (x, g, b, w1, w2), dy), (fr, (x, g, b, w1, w2), dy)])
        check_all([y], [yr], 1e-4)
        check_all(grads, grads_r, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layernorm_dense(backend):
    """LayerNorm and RMSNorm (one compile for both and their references, each checked)."""
    rng = np.random.default_rng(3)
    x = rand(rng, (2, 3, 48))
    g = jnp.asarray(0.5 + rng.uniform(size=(48,)).astype(np.float32))
    b = rand(rng, (48,), scale=0.2)
    w = rand(rng, (48, 4, 6), scale=1 / 7)
    bb = rand(rng, (4, 6))
    dy = rand(rng, (2, 3, 4, 6))
    dln = rand(rng, (2, 3, 48))
    cases, names = [], ("layernorm", "rmsnorm")
    for layernorm_type in names:
        rms = layernorm_type == "rmsnorm"
        fn = functools.partial(lambda x, g, b, w, bb, lt: M.layernorm_dense(
            x, g, b, w, bb, layernorm_type=lt, backend=backend, return_layernorm_output=True), lt=layernorm_type)

        def fr(x, g, b, w, bb, rms=rms):
            ln = ref_norm(x, g, 0.0 if rms else b, rms, False)
            return jnp.einsum("...d,dij->...ij", ln, w, precision="highest") + bb, ln

        cases += [(fn, (x, g, b, w, bb), (dy, dln)), (fr, (x, g, b, w, bb), (dy, dln))]
    res = fwd_bwd_many(cases)
    for i, name in enumerate(names):
        ((y, ln), grads), ((yr, lnr), grads_r) = res[2 * i], res[2 * i + 1]
        assert y.shape == (2, 3, 4, 6)
        check_all([y, ln], [yr, lnr], 1e-4, f"{name} out")
        check_all(grads, grads_r, 1e-4, f"{name} grad")


def test_dropout_xla_only():
    args, _ = make(1, (4,), 16, 32, 16, 1, jnp.float32)
    rng = jax.random.PRNGKey(0)
    kw = dict(dropout_rate=0.5, dropout_rng=rng, deterministic=False)
    y1 = M.layernorm_mlp(*args, **kw)
    y2 = M.layernorm_mlp(*args, **kw)
    y0 = M.layernorm_mlp(*args)
    np.testing.assert_allclose(y1, y2)
    assert not np.allclose(y1, y0)
    e = M.explain_mlp_backend(args[0], backend="auto", dropout_rate=0.5, deterministic=False)
    assert e.selected == "xla" and "xla path only" in e.reasons["pallas"]
    with pytest.raises(ValueError, match="dropout is served by the xla path only"):
        M.layernorm_mlp(*args, backend="pallas", **kw)
    with pytest.raises(ValueError, match="needs dropout_rng"):
        M.layernorm_mlp(*args, dropout_rate=0.1, deterministic=False)
    # deterministic=True: dropout off, pallas serves
    np.testing.assert_allclose(M.layernorm_mlp(*args, dropout_rate=0.5, backend="pallas"), y0, atol=1e-5)


@pytest.mark.parametrize("case,match", [
    ("w1_rank", r"w1 has shape \(8, 12\); expected \(D, n_act, F\) = \(8, 1, F\).*reshape\(8, 1, -1\)"),
    ("w1_nact", r"w1 has shape \(8, 1, 12\); expected \(D, n_act, F\) = \(8, 2, F\).*n_act = len\(activations\) = 2"),
    ("w1_d", r"w1 has shape \(9, 1, 12\); expected .*D = x.shape\[-1\] = 8"),
    ("b1", r"b1 has shape \(12,\); expected \(n_act, F\) = \(1, 12\)"),
    ("w2", r"w2 has shape \(10, 8\); expected \(F, D_out\) = \(12, D_out\).*hidden sizes"),
    ("b2", r"b2 has shape \(7,\); expected \(D_out,\) = \(8,\)"),
    ("gamma", r"gamma has shape \(4,\); expected \(8,\)"),
    ("act", r"activations=\('gelu', 'tanh'\).*unknown activation.*Valid choices"),
    ("act_str", r"activations='gelu' is a string"),
    ("type", r"layernorm_type='ln' is unknown"),
    ("backend", r"backend='triton' is not known"),
    ("int_w1", r"w1 has dtype int32"),
    ("rate", r"dropout_rate=1.5"),
])
def test_bad_inputs(case, match):
    x = jnp.ones((2, 8))
    kw = dict(activations=("gelu",))
    a = dict(gamma=jnp.ones(8), beta=jnp.zeros(8), w1=jnp.ones((8, 1, 12)), b1=jnp.zeros((1, 12)),
             w2=jnp.ones((12, 8)), b2=jnp.zeros(8))
    if case == "w1_rank":
        a["w1"] = jnp.ones((8, 12))
    elif case == "w1_nact":
        kw["activations"] = ("gelu", "linear")
    elif case == "w1_d":
        a["w1"] = jnp.ones((9, 1, 12))
    elif case == "b1":
        a["b1"] = jnp.zeros(12)
    elif case == "w2":
        a["w2"] = jnp.ones((10, 8))
    elif case == "b2":
        a["b2"] = jnp.zeros(7)
    elif case == "gamma":
        a["gamma"] = jnp.ones(4)
    elif case == "act":
        kw["activations"] = ("gelu", "tanh")
    elif case == "act_str":
        kw["activations"] = "gelu"
    elif case == "type":
        kw["layernorm_type"] = "ln"
    elif case == "backend":
        kw["backend"] = "triton"
    elif case == "int_w1":
        a["w1"] = jnp.ones((8, 1, 12), jnp.int32)
    elif case == "rate":
        kw["dropout_rate"] = 1.5
    with pytest.raises(ValueError, match=match):
        M.layernorm_mlp(x, **a, **kw)


def test_dense_bad_inputs():
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match=r"w has shape \(7, 4\); expected \(D, N\)"):
        M.layernorm_dense(x, jnp.ones(8), jnp.zeros(8), jnp.ones((7, 4)))
    with pytest.raises(ValueError, match=r"b has shape \(3,\); expected out_dims = \(4,\)"):
        M.layernorm_dense(x, jnp.ones(8), jnp.zeros(8), jnp.ones((8, 4)), jnp.ones(3))


def test_validate_activations():
    assert validate_activations(["silu", "linear"]) == ("silu", "linear")
    with pytest.raises(ValueError, match="gated pair must be"):
        validate_activations(("linear", "gelu"))


def test_env_vars_change_choice(monkeypatch):
    x = jnp.ones((2, 8))
    monkeypatch.setenv("TE_JAX_MLP_BACKEND", "pallas")
    e = M.explain_mlp_backend(x)
    assert e.selected == "pallas" and "TE_JAX_MLP_BACKEND" in str(e)
    monkeypatch.setenv("TE_JAX_PALLAS_MLP", "0")
    e = M.explain_mlp_backend(x)
    assert e.selected is None and "TE_JAX_PALLAS_MLP=0" in e.error
    monkeypatch.delenv("TE_JAX_MLP_BACKEND")
    e = M.explain_mlp_backend(x)
    assert e.selected == "xla" and "TE_JAX_PALLAS_MLP=0" in e.reasons["pallas"]


@pytest.mark.parametrize("activations", [("gelu",), ("silu", "linear")])
def test_recompute_backward_temp_memory_not_above_plain_autodiff(activations):
    """Compiled (not run) grad step, bf16, with biases: the custom backward's temp bytes stay at or
    below plain JAX autodiff's. It failed for SwiGLU (1.23x) while the fp32 activation cotangent was
    kept alive for the bias reduction."""
    from pallas_kernels.ln_mlp import ln_mlp as kern
    from pallas_kernels.ln_mlp import reference as mlp_reference

    t, d, f, n = 256, 128, 512, len(activations)
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    f32 = jax.ShapeDtypeStruct((d,), jnp.float32)
    args = [bf(t, d), f32, f32, bf(d, n, f), bf(n, f), bf(f, d), bf(d)]

    def temp_bytes(fn):
        def step(*a):
            _, vjp = jax.vjp(fn, *a[:-1])
            return vjp(a[-1])
        return jax.jit(step).lower(*args, bf(t, d)).compile().memory_analysis().temp_size_in_bytes

    plain = temp_bytes(lambda *a: mlp_reference.layernorm_mlp(*a, activations=activations))
    ours = temp_bytes(lambda *a: kern.layernorm_mlp(*a, activations=activations, norm_impl="xla", gemm_impl="xla"))
    assert ours <= plain, (activations, ours, plain)
