"""LayerNorm-MLP and LayerNorm-Dense functional ops with backend selection.

    layernorm_mlp(x, gamma, beta, w1, b1, w2, b2, *, layernorm_type="layernorm", activations=("gelu",),
                  epsilon=1e-6, zero_centered_gamma=False, return_layernorm_output=False, backend="auto",
                  dropout_rate=0.0, dropout_rng=None, deterministic=True)
        x [..., D]; w1 [D, n_act, F] (n_act = len(activations)); b1 [n_act, F] | None;
        w2 [F, D_out]; b2 [D_out] | None  ->  y [..., D_out]  (or (y, ln_out))
    layernorm_dense(x, gamma, beta, w, b=None, *, layernorm_type="layernorm", epsilon=1e-6,
                    zero_centered_gamma=False, return_layernorm_output=False, backend="auto")
        x [..., D]; w [D, N] or [D, *out_dims]; b out_dims | None -> y [..., *out_dims]
    explain_mlp_backend(x, gamma, beta, w1, ..., backend="auto") -> BackendChoice

The compute dtype is x.dtype: weights are cast to it (gradients flow back to their own
dtype), GEMMs accumulate in fp32, normalization statistics are fp32.

Backends:
  "xla"    plain jnp; autodiff keeps what XLA keeps (LN output, pre-activation, activation...).
  "pallas" Pallas norm kernels + GEMMs inside a custom_vjp that saves only x, the per-row
           statistics and the first GEMM's pre-activation, recomputing the normalized input and
           the activation in the backward. The GEMMs are XLA (cuBLAS) GEMMs unless the fused
           LN-prologue Pallas GEMM was measured faster (see GPU_FIRST_GEMM).
  Dropout (dropout_rate > 0 and deterministic=False) is served by the xla path only.
Env: TE_JAX_MLP_BACKEND=<name> forces one (explicit backend= wins), TE_JAX_PALLAS_MLP=0 disables
pallas, TE_JAX_DEBUG=1 logs each choice (logger "te_jax").
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.ln_mlp import ln_mlp as _kern
from pallas_kernels.ln_mlp import reference as _ref
from te_jax.activations import validate_activations
from te_jax.backends import tuning as _tuning
from te_jax.normalization import (
    LAYERNORM_TYPES,
    BackendChoice,
    check_epsilon,
    check_float,
    pallas_norm_reasons,
    select_backend,
    validate_norm_args,
)

#: Which first-GEMM implementation the pallas backend uses on a GPU ("xla": cuBLAS via XLA;
#: "pallas": the fused LN-prologue Pallas GEMM): te_jax/backends/tuning.py MLP_FIRST_GEMM.
GPU_FIRST_GEMM = _tuning.MLP_FIRST_GEMM.value


def _dropout_active(dropout_rate, deterministic):
    return (dropout_rate is not None) and float(dropout_rate) > 0.0 and not deterministic


def _validate_mlp(x, gamma, beta, w1, b1, w2, b2, layernorm_type, activations, dropout_rate, dropout_rng,
                  deterministic):
    op = "layernorm_mlp"
    acts = validate_activations(activations)
    validate_norm_args(op, x, gamma, beta if layernorm_type == "layernorm" else None, layernorm_type)
    d = x.shape[-1]
    n_act = len(acts)
    check_float(op, "w1", w1)
    if w1.ndim != 3 or w1.shape[0] != d or w1.shape[1] != n_act:
        f_hint = w1.shape[-1] if w1.ndim >= 1 else "F"
        raise ValueError(
            f"{op}: w1 has shape {tuple(w1.shape)}; expected (D, n_act, F) = ({d}, {n_act}, F) with "
            f"D = x.shape[-1] = {d} and n_act = len(activations) = {n_act} for activations={acts}. "
            f"Fix: pass w1 of shape ({d}, {n_act}, {f_hint})"
            + (f", e.g. w1.reshape({d}, {n_act}, -1)" if w1.ndim == 2 and w1.shape[0] == d else "") + ".")
    f = w1.shape[2]
    if b1 is not None:
        check_float(op, "b1", b1)
        if tuple(b1.shape) != (n_act, f):
            raise ValueError(
                f"{op}: b1 has shape {tuple(b1.shape)}; expected (n_act, F) = ({n_act}, {f}) to match "
                f"w1 of shape {tuple(w1.shape)}. Fix: pass b1 of shape ({n_act}, {f}) or None.")
    check_float(op, "w2", w2)
    if w2.ndim != 2 or w2.shape[0] != f:
        raise ValueError(
            f"{op}: w2 has shape {tuple(w2.shape)}; expected (F, D_out) = ({f}, D_out) with F = "
            f"w1.shape[2] = {f} (the hidden sizes of w1 and w2 must match). "
            f"Fix: pass w2 of shape ({f}, D_out).")
    if b2 is not None:
        check_float(op, "b2", b2)
        if tuple(b2.shape) != (w2.shape[1],):
            raise ValueError(
                f"{op}: b2 has shape {tuple(b2.shape)}; expected (D_out,) = ({w2.shape[1]},) with "
                f"D_out = w2.shape[1]. Fix: pass b2 of shape ({w2.shape[1]},) or None.")
    if dropout_rate is None or not (0.0 <= float(dropout_rate) < 1.0):
        raise ValueError(f"{op}: dropout_rate={dropout_rate!r}; expected a float in [0, 1). "
                         "Fix: pass e.g. dropout_rate=0.1.")
    if _dropout_active(dropout_rate, deterministic) and dropout_rng is None:
        raise ValueError(f"{op}: dropout_rate={dropout_rate} with deterministic=False needs dropout_rng "
                         "(a jax.random key), got None. Fix: pass dropout_rng=key or deterministic=True.")
    return acts


def _mlp_pallas_reasons(x, dropout_rate, deterministic):
    r = pallas_norm_reasons(x)
    if _dropout_active(dropout_rate, deterministic):
        drop = (f"dropout is active (dropout_rate={dropout_rate}, deterministic=False); dropout is "
                "served by the xla path only")
        r = drop if r is None else r + "; " + drop
    return r


def _auto_notes():
    on_gpu = jax.default_backend() == "gpu"
    gemm = GPU_FIRST_GEMM if on_gpu else "xla"
    return (f"pallas path = Pallas norm kernel + {'fused LN-prologue Pallas' if gemm == 'pallas' else 'XLA'} "
            "first GEMM + XLA second GEMM, custom_vjp saving only x, mean/rstd and the pre-activation",
            f"auto prefers pallas on GPU: {_tuning.MLP_GPU_PREFERENCE.evidence}; first GEMM on "
            f"{_tuning.MLP_FIRST_GEMM.value}: {_tuning.MLP_FIRST_GEMM.evidence} ({_tuning.MLP_GPU_PREFERENCE.results})")


def explain_mlp_backend(x, gamma=None, beta=None, w1=None, b1=None, w2=None, b2=None, *,
                        layernorm_type="layernorm", activations=("gelu",), backend="auto", dropout_rate=0.0,
                        dropout_rng=None, deterministic=True, op="layernorm_mlp", fp8_recipe=None,
                        **unused) -> BackendChoice:
    """Which backend layernorm_mlp / layernorm_dense would use, and why (x may be a ShapeDtypeStruct).

    fp8_recipe: a te_jax.fp8 recipe in force (autocast / the module's fields): the Flax modules then run the
    norm and FP8 GEMMs on the XLA path, never the Pallas ln_mlp kernel (bf16 GEMMs in its custom_vjp)."""
    if layernorm_type not in LAYERNORM_TYPES:
        validate_norm_args(op, x, gamma, beta, layernorm_type)
    if w1 is not None and w2 is not None and gamma is not None:
        _validate_mlp(x, gamma, beta, w1, b1, w2, b2, layernorm_type, activations, dropout_rate, dropout_rng,
                      deterministic)
    reasons = {"xla": None, "pallas": _mlp_pallas_reasons(x, dropout_rate, deterministic)}
    if fp8_recipe is not None:
        why = (f"FP8 ({type(fp8_recipe).__name__}) runs norm + FP8 GEMMs on the XLA path (te_jax/fp8/state.py; "
               "on a GPU with its own fused Pallas cast kernels, te_jax/fp8/mlp.py: te_jax.fp8.explain says which); "
               "the Pallas ln_mlp custom_vjp has bf16 GEMMs inside")
        reasons["pallas"] = why if reasons["pallas"] is None else reasons["pallas"] + "; " + why
    return select_backend(op, backend, reasons, force_env="TE_JAX_MLP_BACKEND",
                          disable_env="TE_JAX_PALLAS_MLP", pref_key="mlp", auto_notes=_auto_notes())


def _make_dropout(dropout_rate, dropout_rng):
    keep = 1.0 - float(dropout_rate)

    def fn(a):
        mask = jax.random.bernoulli(dropout_rng, keep, a.shape)
        return jnp.where(mask, a / keep, 0.0).astype(a.dtype)

    return fn


def layernorm_mlp(x, gamma, beta, w1, b1, w2, b2, *, layernorm_type="layernorm", activations=("gelu",),
                  epsilon=1e-6, zero_centered_gamma=False, return_layernorm_output=False, backend="auto",
                  dropout_rate=0.0, dropout_rng=None, deterministic=True):
    """LayerNorm/RMSNorm -> x @ w1 + b1 -> activation (gated: act(a) * b) -> dropout -> @ w2 + b2."""
    acts = _validate_mlp(x, gamma, beta, w1, b1, w2, b2, layernorm_type, activations, dropout_rate,
                         dropout_rng, deterministic)
    check_epsilon("layernorm_mlp", epsilon)
    choice = explain_mlp_backend(x, backend=backend, dropout_rate=dropout_rate, deterministic=deterministic)
    if choice.error:
        raise ValueError(choice.error)
    rms = layernorm_type == "rmsnorm"
    beta = None if rms else beta
    dt = x.dtype
    w1c, w2c = w1.astype(dt), w2.astype(dt)
    if choice.selected == "pallas":
        gemm = GPU_FIRST_GEMM if jax.default_backend() == "gpu" else "xla"
        return _kern.layernorm_mlp(x, gamma, beta, w1c, b1, w2c, b2, rms=rms, activations=acts, epsilon=epsilon,
                                   zero_centered_gamma=zero_centered_gamma,
                                   return_layernorm_output=return_layernorm_output, norm_impl="pallas",
                                   gemm_impl=gemm)
    dropout_fn = _make_dropout(dropout_rate, dropout_rng) if _dropout_active(dropout_rate, deterministic) else None
    return _ref.layernorm_mlp(x, gamma, beta, w1c, b1, w2c, b2, rms=rms, activations=acts, epsilon=epsilon,
                              zero_centered_gamma=zero_centered_gamma,
                              return_layernorm_output=return_layernorm_output, dropout_fn=dropout_fn)


def _validate_dense(x, gamma, beta, w, b, layernorm_type):
    op = "layernorm_dense"
    validate_norm_args(op, x, gamma, beta if layernorm_type == "layernorm" else None, layernorm_type)
    d = x.shape[-1]
    check_float(op, "w", w)
    if w.ndim < 2 or w.shape[0] != d:
        raise ValueError(
            f"{op}: w has shape {tuple(w.shape)}; expected (D, N) or (D, *out_dims) with D = x.shape[-1] = {d}. "
            f"Fix: pass w with first axis {d}.")
    out_dims = tuple(w.shape[1:])
    if b is not None:
        check_float(op, "b", b)
        if tuple(b.shape) not in (out_dims, (math.prod(out_dims),)):
            raise ValueError(
                f"{op}: b has shape {tuple(b.shape)}; expected out_dims = {out_dims} (w.shape[1:]). "
                f"Fix: pass b of shape {out_dims} or None.")
    return out_dims


def layernorm_dense(x, gamma, beta, w, b=None, *, layernorm_type="layernorm", epsilon=1e-6,
                    zero_centered_gamma=False, return_layernorm_output=False, backend="auto"):
    """LayerNorm/RMSNorm fused with one GEMM: norm(x) @ w + b."""
    out_dims = _validate_dense(x, gamma, beta, w, b, layernorm_type)
    check_epsilon("layernorm_dense", epsilon)
    choice = explain_mlp_backend(x, backend=backend, op="layernorm_dense")
    if choice.error:
        raise ValueError(choice.error)
    rms = layernorm_type == "rmsnorm"
    beta = None if rms else beta
    d = x.shape[-1]
    n = math.prod(out_dims)
    wf = w.reshape(d, n).astype(x.dtype)
    bf = None if b is None else b.reshape(n)
    if choice.selected == "pallas":
        out = _kern.layernorm_dense(x, gamma, beta, wf, bf, rms=rms, epsilon=epsilon,
                                    zero_centered_gamma=zero_centered_gamma,
                                    return_layernorm_output=return_layernorm_output, norm_impl="pallas")
    else:
        out = _ref.layernorm_dense(x, gamma, beta, wf, bf, rms=rms, epsilon=epsilon,
                                   zero_centered_gamma=zero_centered_gamma,
                                   return_layernorm_output=return_layernorm_output)
    if return_layernorm_output:
        y, ln = out
        return y.reshape(*x.shape[:-1], *out_dims), ln
    return out.reshape(*x.shape[:-1], *out_dims)


__all__ = ["layernorm_mlp", "layernorm_dense", "explain_mlp_backend"]
