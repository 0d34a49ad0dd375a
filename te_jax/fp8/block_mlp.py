"""The FP8 MLP under Float8BlockScaling with the activation's block casts fused (what te_jax/fp8/mlp.py is for the
per-tensor recipes).

    x [M, D] dt  -- block cast, 1x128 --> x_q [M, D], x_qT [D, M]                    (block.py's block_cast)
    w1 [D, n*F]  -- 128x128 --> w1_qT [n*F, D]     (w1_q re-cast in the backward, or written by the same cast and
                                                   kept: fused.keep_weight_copies; likewise w2)
    gu [M, n*F] dt = x_q . w1_qT                                      (FP8 block GEMM, wi fprop)
    a_q [M, F], a_qT [F, M] + 1x128 scales = act_block_cast(gu)       (activation + both block casts, one pass)
    y [M, Dout] dt = a_q . w2_qT                                      (wo fprop)
  backward, dy [M, Dout]:
    dy_q, dy_qT = block cast of dy;  dh [M, F] = dy_q . w2_q;  dw2 [F, Dout] = a_qT . dy_qT
    dgu_q [M, n*F], dgu_qT [n*F, M] = dact_block_cast_transpose(dh, gu)   (one pass)
    dx [M, D] = dgu_q . w1_q;  dw1 [D, n*F] = x_qT . dgu_qT
n = 2 for a gated pair (act, "linear"), else 1. Numerics are the unfused path's (block.py's GEMMs around te_jax's
activation): a and dgu are rounded to dt before their block scales are taken. Where the cast kernels are off
(block.py's block_casts_fused(): TE_JAX_FP8_FUSED, a GPU by default) the activation and its block casts run in XLA.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_cast.common import act_fn, dact
from pallas_kernels.fp8_gemm import act_block_cast, dact_block_cast_transpose
from te_jax.fp8.block import (block_cast, block_casts_fused, block_gemm, block_gemm_mode, block_gemm_reason,
                              block_promotion)
from te_jax.fp8.fused import keep_weight_copies
from te_jax.fp8.recipe import Float8BlockScaling


def block_mlp_unavailable(recipe, *, has_bias: bool, dropout_rate: float, m: int, d: int, f: int,
                          d_out: int) -> str | None:
    """Why LayerNormMLP's block-scaled path would NOT run as fused_block_fp8_mlp (None: it does)."""
    if not isinstance(recipe, Float8BlockScaling):
        return f"{type(recipe).__name__} is not Float8BlockScaling"
    mode = block_gemm_mode()
    if mode == "xla":
        return "the FP8 block GEMM is off (no sm90 GPU with jax >= 0.11, or TE_JAX_FP8_BLOCK_GEMM=xla)"
    if recipe.x_block != 128 or recipe.w_block != 128:
        return f"block sizes {recipe.x_block}/{recipe.w_block} (the kernels take 128)"
    if has_bias:
        return "biases (use_bias=True)"
    if dropout_rate > 0.0:
        return "intermediate dropout is active"
    for gemm, x_shape, w_shape in (("wi", (m, d), (d, f)), ("wo", (m, f), (f, d_out))):  # F % 128: act kernels' too
        why = block_gemm_reason(x_shape, w_shape, 1)
        if why is not None:
            return f"{gemm} GEMM: {why}"
    return None


def _act(gu3, dt, activation, gated, fdt, fused):
    """gu [M, n, F] -> a's block casts (q, scales, qT, scales), as act_block_cast."""
    if fused:
        return act_block_cast(gu3, activation=activation, out_dtype=fdt, round_to=dt)
    fn, g = act_fn(activation, gated), gu3[:, 0].astype(jnp.float32)
    a = fn(g, gu3[:, 1].astype(jnp.float32)) if gated else fn(g)
    return block_cast(a.astype(dt), fdt, "rows", False)


def _dact(dh, gu3, dt, activation, gated, bdt, fused):
    """(dh [M, F], gu [M, n, F]) -> dgu's block casts as [M, n*F] (q, scales, qT, scales): in XLA or the Triton
    kernel (fused)."""
    if fused:
        return dact_block_cast_transpose(dh, gu3, activation=activation, out_dtype=bdt, round_to=dt)
    g = gu3[:, 0].astype(jnp.float32)
    u = gu3[:, 1].astype(jnp.float32) if gated else None
    parts = dact(activation, gated, dh.astype(jnp.float32), g, u)
    dgu = jnp.concatenate([p.astype(dt) for p in parts], axis=1)
    return block_cast(dgu, bdt, "rows", False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _mlp(x, w1, w2, activation, gated, recipe, mode, fused, keep):
    return _mlp_fwd(x, w1, w2, activation, gated, recipe, mode, fused, keep)[0]


def _mlp_fwd(x, w1, w2, activation, gated, recipe, mode, fused, keep):
    """x [M, D] dt, w1 [D, n, F], w2 [F, Dout] -> y [M, Dout] dt. keep: the weights' casts write both layouts and
    the backward's dgrads take w_q as it is (fused.keep_weight_copies), else the backward re-casts them."""
    dt, fdt = x.dtype, recipe.fp8_format.fwd_dtype
    promotion = block_promotion(recipe)
    d, n, f = w1.shape
    write = "both" if keep else "qt"
    w1f = w1.reshape(d, n * f).astype(dt)
    xq, xs, xqt, xts = block_cast(x, fdt, "rows", fused)
    w1q, w1s, w1qt, w1ts = block_cast(w1f, fdt, "square", fused, write=write)
    gu = block_gemm(mode, dt, True, promotion)(xq, w1qt, xs, w1ts)               # [M, n*F]   wi fprop
    aq, a_s, aqt, ats = _act(gu.reshape(-1, n, f), dt, activation, gated, fdt, fused)
    w2q, w2s, w2qt, w2ts = block_cast(w2.astype(dt), fdt, "square", fused, write=write)
    y = block_gemm(mode, dt, True, promotion)(aq, w2qt, a_s, w2ts)               # [M, Dout]  wo fprop
    kept = (w1q, w1s, w2q, w2s) if keep else None
    return y, (xqt, xts, w1, w2, aqt, ats, gu, kept)


def _mlp_bwd(activation, gated, recipe, mode, fused, keep, res, dy):
    xqt, xts, w1, w2, aqt, ats, gu, kept = res
    dt, fdt, bdt = gu.dtype, recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    promotion = block_promotion(recipe)
    d, n, f = w1.shape
    gq, gs, gqt, gts = block_cast(dy.astype(dt), bdt, "rows", fused)
    if kept is not None:
        w1q, w1s, w2q, w2s = kept
    else:  # re-cast: no FP8 weight kept
        w2q, w2s, _, _ = block_cast(w2.astype(dt), fdt, "square", fused, write="q")
        w1q, w1s, _, _ = block_cast(w1.reshape(d, n * f).astype(dt), fdt, "square", fused, write="q")
    dh = block_gemm(mode, dt, True, promotion)(gq, w2q, gs, w2s)                 # [M, F]     wo dgrad
    dw2 = block_gemm(mode, dt, False, promotion)(aqt, gqt, ats, gts)             # [F, Dout]  wo wgrad
    dguq, dgus, dguqt, dguts = _dact(dh, gu.reshape(-1, n, f), dt, activation, gated, bdt, fused)
    dx = block_gemm(mode, dt, True, promotion)(dguq, w1q, dgus, w1s)             # [M, D]     wi dgrad
    dw1 = block_gemm(mode, dt, False, promotion)(xqt, dguqt, xts, dguts)         # [D, n*F]   wi wgrad
    return dx, dw1.reshape(w1.shape).astype(w1.dtype), dw2.astype(w2.dtype)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def fused_block_fp8_mlp(x, w1, w2, recipe, *, activations):
    """y = act(x . w1) . w2 under Float8BlockScaling with FP8 block GEMMs and the activation's block casts fused
    (see the module docstring). x [..., D] in the compute dtype; w1 [D, n_act, F], w2 [F, Dout] (gradients in
    their own dtypes); activations (act,) or (act, "linear"). The caller checked block_mlp_unavailable."""
    acts = tuple(activations)
    if not (len(acts) == 1 or (len(acts) == 2 and acts[1] == "linear")):
        raise ValueError(f"fused_block_fp8_mlp: activations={acts!r} must be (act,) or (act, 'linear').")
    d, n, f = w1.shape
    if n != len(acts) or x.shape[-1] != d or w2.ndim != 2 or w2.shape[0] != f:
        raise ValueError(f"fused_block_fp8_mlp: shapes x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 "
                         f"{tuple(w2.shape)} do not fit activations {acts} (w1 [D, {len(acts)}, F], w2 [F, Dout]).")
    fused, m = block_casts_fused(), math.prod(x.shape[:-1])
    y = _mlp(x.reshape(m, d), w1, w2, acts[0], len(acts) == 2, recipe, block_gemm_mode(), fused,
             keep_weight_copies(recipe))
    return y.reshape(x.shape[:-1] + (w2.shape[1],))


__all__ = ["block_mlp_unavailable", "fused_block_fp8_mlp"]
