"""A norm followed by FP8 GEMMs that all read its output (TransformerEngine's layernorm_dense; with several kernels,
the query and key/value projections of GQA self-attention, which TransformerEngine quantizes twice).

    x [M, K] (compute dtype dt), gamma / beta [K], kernels w_i [K, N_i]:
    forward   x_q, x_qT, amax = norm_cast.cast(x, ...)            one pass over x; the norm's output is never stored
              w_qT_i = cast_transposed(w_i)                        (the backward re-casts w_i)
              y_i [M, N_i] = x_q . w_qT_i                          FP8 GEMMs ("TN")
    backward  g_i_q, g_i_qT = cast_transpose(g_i)
              dln = sum_i g_i_q . w_q_i                            dgrads, summed in dt (as autodiff sums them)
              dw_i = x_qT . g_i_qT                                 wgrads
              dx, dgamma, dbeta = the norm's backward of dln       (norm_cast.backward: the norm's own backend)
One input scale casts x for every GEMM: the first state's under DelayedScaling (the others' input histories still
record x's amax and their scales follow it), x's own under Float8CurrentScaling. Each GEMM keeps its own kernel and
output-gradient scales. The numerics are those of norm -> fp8_dot_general per kernel (quantize._dense_tn_dot).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_cast import cast_transpose, cast_transposed
from te_jax.fp8 import norm_cast as _nc
from te_jax.fp8.fused import launch_options
from te_jax.fp8.quantize import (STATE_KEYS, _read_scale, _tn_gemm, amax, compute_scale, delayed_update, quantize,
                                 wgrad_style)
from te_jax.fp8.recipe import DelayedScaling, Float8CurrentScaling


@dataclasses.dataclass(frozen=True)
class _Cfg:
    recipe: object
    norm: _nc.NormSpec
    style: str
    out_shapes: tuple  # per kernel: the output's trailing dims (the kernel's features)
    interpret: bool | None


def _update(recipe, history, scale, new_amax, fmax):
    s, h = delayed_update(history, scale, new_amax, fmax, recipe.margin, recipe.amax_compute_algo)
    return s.reshape(1), h


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _norm_dense(x, gamma, beta, kernels, states, cfg):
    return _fwd(x, gamma, beta, kernels, states, cfg)[0]


def _fwd(x, gamma, beta, kernels, states, cfg):
    recipe, dt = cfg.recipe, x.dtype
    fdt, fmax = recipe.fp8_format.fwd_dtype, recipe.fp8_format.max_fwd
    delayed = isinstance(recipe, DelayedScaling)
    kw = dict(interpret=cfg.interpret, **launch_options("cast", cfg.interpret))
    kw_w = dict(interpret=cfg.interpret, **launch_options("weight", cfg.interpret))
    st = _nc.stats(x, gamma, beta, cfg.norm)
    if delayed:
        sx = _read_scale(states[0]["input_scale"])
    else:
        sx = compute_scale(amax(_nc.output(x, gamma, beta, st, cfg.norm)), 1.0, fmax)
    xq, xqT, ax = _nc.cast(x, gamma, beta, st, sx, cfg.norm, fdt, **kw)
    ys, sws, new_fwd = [], [], []
    for i, w in enumerate(kernels):
        sw = _read_scale(states[i]["kernel_scale"]) if delayed else compute_scale(amax(w), 1.0, fmax)
        wqT, aw = cast_transposed(w, jnp.asarray(sw, jnp.float32).reshape(()), out_dtype=fdt, **kw_w)
        ys.append(_tn_gemm(xq, wqT, dt, 1.0 / sx, 1.0 / sw, cfg.style))
        sws.append(sw)
        if delayed:
            s = states[i]
            new_fwd.append(_update(recipe, s["input_amax_history"], _read_scale(s["input_scale"]), ax, fmax)
                           + _update(recipe, s["kernel_amax_history"], sw, aw, fmax)
                           + (s["output_grad_scale"], s["output_grad_amax_history"]))
    res = (x, gamma, beta, st, xqT, 1.0 / sx, tuple(kernels), tuple(sws), tuple(new_fwd) if delayed else None)
    return tuple(ys), res


def _bwd(cfg, res, gs):
    x, gamma, beta, st, xqT, sxi, kernels, sws, new_fwd = res
    recipe, dt = cfg.recipe, x.dtype
    fdt = recipe.fp8_format.fwd_dtype
    bdt, bmax = recipe.fp8_format.bwd_dtype, recipe.fp8_format.max_bwd
    kw = dict(interpret=cfg.interpret, **launch_options("cast", cfg.interpret))
    dln, dws, state_cts = None, [], []
    for i, (w, sw, g) in enumerate(zip(kernels, sws, gs)):
        g2 = g.astype(dt).reshape(x.shape[0], w.shape[1])
        if new_fwd is not None:
            sg = _read_scale(new_fwd[i][4])
        else:
            sg = compute_scale(amax(g2), 1.0, bmax)
        gq, gqT, ag = cast_transpose(g2, jnp.asarray(sg, jnp.float32).reshape(()), out_dtype=bdt, **kw)
        wq = quantize(w, sw, fdt)  # the values of the forward's w_qT, re-cast rather than kept
        d = _tn_gemm(gq, wq, dt, 1.0 / sg, 1.0 / sw, cfg.style)
        dln = d if dln is None else dln + d
        dws.append(_tn_gemm(xqT, gqT, dt, sxi, 1.0 / sg, wgrad_style(cfg.style)))  # [K, N_i] in dt (autodiff of
        # the wrapper's astype / reshape takes it to the kernel's dtype and shape)
        if new_fwd is not None:
            state_cts.append(dict(zip(STATE_KEYS, new_fwd[i][:4] + _update(recipe, new_fwd[i][5], sg, ag, bmax))))
    dx, dgamma, dbeta = _nc.backward(dln, x, gamma, beta, st, cfg.norm, cfg.interpret)
    if beta is not None and dbeta is None:
        dbeta = jnp.zeros_like(beta)
    return dx, dgamma, dbeta, tuple(dws), (tuple(state_cts) if new_fwd is not None else None)


_norm_dense.defvjp(_fwd, _bwd)


def norm_fp8_dense(x, gamma, beta, kernels, states, recipe, norm, *, gemm_style="direct", interpret=None):
    """(norm(x) . kernels[0], norm(x) . kernels[1], ...) with FP8 GEMMs, the norm fused into x's cast.

    x [..., K] in the compute dtype; gamma [K] (beta [K] for LayerNorm, else None); kernels: a tuple of [K, *features_i]
    (any float dtype: cast to x's dtype before quantization, gradients in their own dtypes); norm: a
    norm_cast.NormSpec; recipe DelayedScaling (states: one quantize.init_state dict per kernel, updated through their
    gradients) or Float8CurrentScaling (states None). Returns a tuple of [..., *features_i] in x's dtype.
    """
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise ValueError(f"norm_fp8_dense: recipe {type(recipe).__name__} is not per-tensor (DelayedScaling or "
                         "Float8CurrentScaling).")
    kernels = tuple(kernels)
    k = x.shape[-1]
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
    cfg = _Cfg(recipe, norm, gemm_style, tuple(tuple(w.shape[1:]) for w in kernels), interpret)
    flat = tuple(w.astype(dt).reshape(k, math.prod(w.shape[1:])) for w in kernels)
    ys = _norm_dense(x.reshape(-1, k), gamma, None if norm.layernorm_type == "rmsnorm" else beta, flat, states, cfg)
    return tuple(y.reshape(x.shape[:-1] + f) for y, f in zip(ys, cfg.out_shapes))


__all__ = ["norm_fp8_dense"]
