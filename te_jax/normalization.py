"""LayerNorm / RMSNorm functional ops with backend selection.

    layernorm(x, gamma, beta, *, epsilon=1e-6, zero_centered_gamma=False, backend="auto")
    rmsnorm(x, gamma, *, epsilon=1e-6, zero_centered_gamma=False, backend="auto")
    norm(x, gamma, beta, *, layernorm_type="layernorm" | "rmsnorm", ...)
    explain_norm_backend(x, gamma, beta, *, layernorm_type=..., backend="auto") -> BackendChoice

Normalizes the last axis of x (any leading shape). Statistics are always fp32; the output
has x.dtype. zero_centered_gamma=True means y = norm(x) * (1 + gamma).

Backends: "xla" (plain jnp, autodiff) and "pallas" (Triton-lowered Pallas kernels with a
custom_vjp; on a non-GPU backend they run in interpret mode, which is for tests only).
"auto" picks pallas on a GPU where it serves and was measured faster
(benchmarks/results/norms_mlp_h100.md), xla elsewhere, and xla under a mesh whose axes XLA
partitions (jax.set_mesh, outside shard_map): a Pallas kernel is opaque to the SPMD partitioner
and would run replicated on the whole global array (the Flax modules with layernorm_input_axes
run pallas per shard through shard_map instead).
Order of precedence: an explicit backend= argument, then TE_JAX_NORM_BACKEND=<name>, then auto.
TE_JAX_PALLAS_NORM=0 makes pallas unavailable (a forced pallas then raises).
TE_JAX_DEBUG=1 logs every choice with its reasons (logger "te_jax"; shared policy in te_jax/backends/policy.py).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.norms import norm as _pallas_norm
from pallas_kernels.norms import reference as _ref
from te_jax.backends import choice as _choice
from te_jax.backends import ops as _ops
from te_jax.backends import tuning as _tuning

MAX_HIDDEN = 32768  # == pallas_kernels.norms.MAX_HIDDEN (checked in tests)


BACKENDS = _ops.NAMES
LAYERNORM_TYPES = ("layernorm", "rmsnorm")

#: The measured preference (value, evidence, results file) lives in te_jax/backends/tuning.py; these names
#: are views of it.
GPU_MEASURED_FASTER = {**{k: r.value for k, r in _tuning.NORM_GPU_PREFERENCE.items()},
                       "mlp": _tuning.MLP_GPU_PREFERENCE.value}
GPU_EVIDENCE = {k: r.evidence for k, r in _tuning.NORM_GPU_PREFERENCE.items()}
GPU_EVIDENCE_FILE = _tuning.NORM_RESULTS

_PALLAS_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# ----------------------------------------------------------------------------- backend choice


# One selector and one choice type for every op (te_jax/backends/choice.py); the norm/MLP table is in
# te_jax/backends/ops.py.
BackendChoice = _choice.BackendChoice
select_backend = _ops.select_backend


# ----------------------------------------------------------------------------- validation


def _shape_dtype(a):
    return tuple(np.shape(a)) if not hasattr(a, "shape") else tuple(a.shape), getattr(a, "dtype", None)


def check_float(op: str, name: str, a, *, allow_none: bool = False):
    if a is None:
        if allow_none:
            return
        raise ValueError(f"{op}: {name} is None; expected a floating-point array. Fix: pass {name}.")
    dtype = getattr(a, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{op}: {name} has dtype {dtype} (shape {tuple(np.shape(a))}); expected a floating-point "
            f"dtype (float32, bfloat16, float16). Fix: cast {name} with .astype(jnp.float32) or jnp.bfloat16.")


def check_vector(op: str, name: str, a, d: int, *, what: str = "x.shape[-1]"):
    shape = tuple(a.shape)
    if shape != (d,):
        raise ValueError(
            f"{op}: {name} has shape {shape}; expected ({d},) = (D,) with D = {what} = {d}. "
            f"Fix: pass a 1-D {name} with one entry per feature of the normalized axis.")


def check_epsilon(op: str, epsilon):
    """epsilon must be a finite number >= 0 (a negative one makes rsqrt(var + eps) NaN for small
    variances). A traced epsilon (under jit) is not checked."""
    if isinstance(epsilon, jax.core.Tracer):
        return
    try:
        e = float(epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: epsilon={epsilon!r} is not a number; expected a finite float >= 0 "
                         f"(e.g. 1e-6).") from None
    if not (math.isfinite(e) and e >= 0.0):
        raise ValueError(f"{op}: epsilon={epsilon!r} must be a finite number >= 0 (it is added to the variance "
                         f"before rsqrt; a negative one gives NaN). Fix: pass e.g. epsilon=1e-6.")


def validate_norm_args(op, x, gamma, beta, layernorm_type):
    if layernorm_type not in LAYERNORM_TYPES:
        raise ValueError(
            f"{op}: layernorm_type={layernorm_type!r} is unknown; expected one of {LAYERNORM_TYPES}. "
            f"Fix: pass layernorm_type='layernorm' or 'rmsnorm'.")
    check_float(op, "x", x)
    if len(x.shape) < 1:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)} (a scalar); expected [..., D] with at least "
                         "one axis. Fix: pass x with the features on the last axis.")
    d = x.shape[-1]
    check_float(op, "gamma", gamma)
    check_vector(op, "gamma", gamma, d)
    if layernorm_type == "layernorm":
        check_float(op, "beta", beta)
        check_vector(op, "beta", beta, d)
    elif beta is not None:
        check_float(op, "beta", beta)
        check_vector(op, "beta", beta, d)


def pallas_norm_reasons(x) -> str | None:
    d = x.shape[-1]
    if d > MAX_HIDDEN:
        return f"hidden size {d} > {MAX_HIDDEN}: the in-register Pallas kernel does not serve it"
    if jnp.dtype(x.dtype) not in [jnp.dtype(t) for t in _PALLAS_DTYPES]:
        return f"x dtype {x.dtype} is not one of float32/bfloat16/float16"
    if int(np.prod(x.shape[:-1])) == 0 or d == 0:
        return "empty input"
    return None


# ----------------------------------------------------------------------------- public ops


def explain_norm_backend(x, gamma=None, beta=None, *, layernorm_type="layernorm", epsilon=1e-6,
                         zero_centered_gamma=False, backend="auto") -> BackendChoice:
    """Which backend `norm(...)` would use for these arguments, and why (x may be a ShapeDtypeStruct)."""
    del epsilon, zero_centered_gamma
    op = layernorm_type if layernorm_type in LAYERNORM_TYPES else "norm"
    if gamma is not None:
        validate_norm_args(op, x, gamma, beta, layernorm_type)
    elif layernorm_type not in LAYERNORM_TYPES:
        validate_norm_args(op, x, gamma, beta, layernorm_type)
    reasons = {"xla": None, "pallas": pallas_norm_reasons(x)}
    return select_backend(op, backend, reasons, force_env="TE_JAX_NORM_BACKEND",
                          disable_env="TE_JAX_PALLAS_NORM", pref_key=layernorm_type)


def _run_norm(op, x, gamma, beta, layernorm_type, epsilon, zero_centered_gamma, backend):
    validate_norm_args(op, x, gamma, beta, layernorm_type)
    check_epsilon(op, epsilon)
    choice = explain_norm_backend(x, gamma, beta, layernorm_type=layernorm_type, backend=backend)
    if choice.error:
        raise ValueError(choice.error)
    rms = layernorm_type == "rmsnorm"
    if choice.selected == "pallas":
        if rms:
            return _pallas_norm.rmsnorm(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)
        return _pallas_norm.layernorm(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)
    if rms:
        return _ref.rmsnorm(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)
    return _ref.layernorm(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)


def layernorm(x, gamma, beta, *, epsilon=1e-6, zero_centered_gamma=False, backend="auto"):
    """LayerNorm over the last axis: (x - mean) * rstd * gamma + beta; fp32 stats, output x.dtype."""
    return _run_norm("layernorm", x, gamma, beta, "layernorm", epsilon, zero_centered_gamma, backend)


def rmsnorm(x, gamma, *, epsilon=1e-6, zero_centered_gamma=False, backend="auto"):
    """RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * gamma; fp32 stats, output x.dtype."""
    return _run_norm("rmsnorm", x, gamma, None, "rmsnorm", epsilon, zero_centered_gamma, backend)


def norm(x, gamma, beta=None, *, layernorm_type="layernorm", epsilon=1e-6, zero_centered_gamma=False,
         backend="auto"):
    """Dispatch by name: layernorm_type "layernorm" or "rmsnorm" (beta ignored for rmsnorm)."""
    if layernorm_type == "rmsnorm":
        beta = None
    op = layernorm_type if layernorm_type in LAYERNORM_TYPES else "norm"
    return _run_norm(op, x, gamma, beta, layernorm_type, epsilon, zero_centered_gamma, backend)


__all__ = [
    "layernorm",
    "rmsnorm",
    "norm",
    "explain_norm_backend",
    "BackendChoice",
    "LAYERNORM_TYPES",
]
