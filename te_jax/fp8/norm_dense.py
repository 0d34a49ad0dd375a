"""A norm followed by FP8 GEMMs that all read its output (TransformerEngine's layernorm_dense; with several kernels,
the query and key/value projections of GQA self-attention, which TransformerEngine quantizes twice).

    x [M, K] (compute dtype dt), gamma / beta [K], kernels w_i [K, N_i]:
    forward   x_q, x_qT, amax = norm_cast.cast(x, ...)            one pass over x; the norm's output is never stored
              w_qT_i = cast_transposed(w_i)                        (the backward re-casts w_i; with kept weight
                                                                   copies one cast writes w_q_i and w_qT_i)
              y_i [M, N_i] = x_q . w_qT_i                          FP8 GEMMs ("TN")
    backward  g_i_q, g_i_qT = cast_transpose(g_i)
              dln = sum_i g_i_q . w_q_i                            dgrads, summed in dt (as autodiff sums them)
              dw_i = x_qT . g_i_qT                                 wgrads
              dx, dgamma, dbeta = the norm's backward of dln       (norm_cast.backward: the norm's own backend)
              (skip=True: x is also returned for a residual add; its gradient dres joins here, dx = ... + dres, in
              the norm's backward pass: one read of dln, x and dres)
One input scale casts x for every GEMM: the first state's under DelayedScaling (the others' input histories still
record x's amax and their scales follow it), x's own under Float8CurrentScaling. Each GEMM keeps its own kernel and
output-gradient scales. The numerics are those of norm -> fp8_dot_general per kernel: both run quantize._tn_dense,
this module with the norm and several kernels, fp8_dot_general's fused path with neither.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from te_jax.fp8.fused import keep_weight_copies, merged_casts
from te_jax.fp8.quantize import STATE_KEYS, _tn_dense, _TNCfg
from te_jax.fp8.recipe import DelayedScaling, Float8CurrentScaling


def norm_fp8_dense(x, gamma, beta, kernels, states, recipe, norm, *, gemm_style="direct", interpret=None,
                   skip=False):
    """(norm(x) . kernels[0], norm(x) . kernels[1], ...) with FP8 GEMMs, the norm fused into x's cast.

    x [..., K] in the compute dtype; gamma [K] (beta [K] for LayerNorm, else None); kernels: a tuple of [K, *features_i]
    (any float dtype: cast to x's dtype before quantization, gradients in their own dtypes); norm: a
    norm_cast.NormSpec; recipe DelayedScaling (states: one quantize.init_state dict per kernel, updated through their
    gradients) or Float8CurrentScaling (states None). Returns a tuple of [..., *features_i] in x's dtype; skip=True:
    x itself comes last in the tuple (the same values), for the skip connection x + f(norm(x)), so that its gradient
    is added inside the norm's backward (norm_cast.backward's dres) instead of by a separate pass.
    """
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise ValueError(f"norm_fp8_dense: recipe {type(recipe).__name__} is not per-tensor (DelayedScaling or "
                         "Float8CurrentScaling).")
    kernels = tuple(kernels)
    k = x.shape[-1]
    if skip and norm is None:
        raise ValueError("norm_fp8_dense: skip=True needs a norm (its gradient joins the norm's backward).")
    for name, a in (("gamma", gamma), ("beta", beta)):
        if (a is not None or name == "gamma") and (a is None or tuple(a.shape) != (k,)):
            raise ValueError(f"norm_fp8_dense: {name} has shape {None if a is None else tuple(a.shape)}; expected "
                             f"({k},) for x {tuple(x.shape)} (one per feature of the normalized axis).")
    for i, w in enumerate(kernels):
        if w.ndim < 2 or w.shape[0] != k:
            raise ValueError(f"norm_fp8_dense: kernels[{i}] has shape {tuple(w.shape)}; expected [{k}, *features] for "
                             f"x {tuple(x.shape)}.")
    if isinstance(recipe, DelayedScaling):
        if states is None or len(states) != len(kernels):
            raise ValueError("norm_fp8_dense: DelayedScaling needs one state per kernel.")
        states = tuple({key: jnp.asarray(s[key], jnp.float32) for key in STATE_KEYS} for s in states)
    else:
        states = None
    dt = x.dtype
    cfg = _TNCfg(recipe, norm, dt, gemm_style, interpret, jnp.dtype(dt), keep_weight_copies(recipe, dense=True),
                 merged_casts(), skip=bool(skip))
    flat = tuple(w.astype(dt).reshape(k, math.prod(w.shape[1:])) for w in kernels)  # dw in dt, then w's dtype
    ys = _tn_dense(x.reshape(-1, k), gamma, None if norm.layernorm_type == "rmsnorm" else beta, flat, states, cfg)
    out = tuple(y.reshape(x.shape[:-1] + tuple(w.shape[1:])) for y, w in zip(ys, kernels))
    return out + ((ys[-1].reshape(x.shape),) if skip else ())


__all__ = ["norm_fp8_dense"]
