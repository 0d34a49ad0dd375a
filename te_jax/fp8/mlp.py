"""The FP8 MLP with fused quantization (TransformerEngine's layernorm_mlp under a per-tensor recipe).

    x [M, D] (compute dtype dt) -- cast_transpose --> x_q [M, D], x_qT [D, M]           (amax(x))
    w1 [D, n*F] (param dtype)   -- cast_transposed --> w1_qT [n*F, D]     (amax(w1 in dt); w1_q re-cast in the bwd)
    w2 [F, D]                   -- cast_transposed --> w2_qT [D, F]       (amax(w2 in dt); w2_q likewise)
    (kept copies, fused.keep_weight_copies: the default for DelayedScaling, TE_JAX_FP8_KEEP_WEIGHTS=1 for every
    recipe: cast_transpose writes w_q beside w_qT and the backward uses it, re-casting nothing)
    gu [M, n*F] dt = x_q . w1_qT                                      (FP8 GEMM, wi fprop)
    a_q [M, F], a_qT [F, M], amax(a) = act_cast(gu)                   (activation + cast + transpose, 1 pass)
    y [M, D] dt = a_q . w2_qT                                         (FP8 GEMM, wo fprop)
  backward, dy [M, D]:
    dy_q [M, D], dy_qT [D, M], amax(dy) = cast_transpose(dy)
    dh [M, F] dt    = dy_q . w2_q                                     (wo dgrad)
    dw2 [F, D]      = a_qT . dy_qT                                    (wo wgrad)
    dgu_q [M, n*F], dgu_qT [n*F, M], amax(dgu) = dact_cast_transpose(dh, gu)   (1 pass)
    dx [M, D] dt    = dgu_q . w1_q                                    (wi dgrad)
    dw1 [D, n*F]    = x_qT . dgu_qT                                   (wi wgrad)
With a norm in front (LayerNormMLP), x is the norm's input and its first cast is norm_cast.cast (the norm applied
in the cast kernel from XLA-computed row statistics; the backward turns dx into the norm input's gradient; with
skip, x comes out beside y for the residual add and its gradient is added in that same backward pass).
n = 2 for a gated pair (act, "linear"), else 1. Every GEMM is `a . b` = lax.dot_general(a [m, k], b [n, k],
(((1,), (1,)), ((), ()))) on float8 operands ("TN": both contracting dims minor, the layout cuBLASLt's FP8 GEMM
takes, so XLA inserts no transposes), through quantize._scaled_gemm (preferred_element_type dt, precision
DEFAULT, then the product of the two scale_invs). Forward operands are in the recipe's fwd dtype (E4M3 under
HYBRID), the gradients dy and dgu in its bwd dtype (E5M2). Every transposed operand is written by the kernel
that casts it, from the same registers; residuals kept for the backward: x_qT, w1_q, w2_q, a_qT (FP8) and gu (dt).

Numerics are those of the unfused path (quantize.fp8_dot_general around te_jax's activation): a and dgu are
rounded to dt before their amax and cast (the unfused path stores them in dt), the weights are rounded to dt
before theirs, dw1 / dw2 come out of the GEMM in dt and are then cast to the weights' dtype.

Scales (quantize.py's conventions and helpers): under DelayedScaling from the two Fp8Meta states (wi: input x,
kernel w1, output_grad dgu; wo: input a, kernel w2, output_grad dy), updated with the amaxes the kernels hand
out and returned as the states' "gradient" exactly as quantize._per_tensor_dot does. Under Float8CurrentScaling
each tensor's own amax comes first: amax(x), amax(w1), amax(w2) and amax(dy) in XLA (a plain reduction, fused
with its producer where XLA can), amax(a) and amax(dgu) from the kernels' amax-only mode (act_amax,
dact_amax: the same in-kernel activation math as the cast, one more read of gu (and dh), no write).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import fp8_cast as _k
from pallas_kernels.fp8_cast import tma as _tma
from te_jax.fp8 import norm_cast as _nc
from te_jax.fp8.fused import (TMA_BLOCK, fused_cast_unavailable, keep_weight_copies, launch_env, launch_options,
                              state_update_kernel, tma_cast)
from te_jax.fp8.quantize import (STATE_KEYS, _read_scale, _scaled_gemm, amax, compute_scale, delayed_updates, f8_dot,
                                 gemm_style, quantize, wgrad_style)
from te_jax.fp8.recipe import DelayedScaling, Float8CurrentScaling

_TN = (((1,), (1,)), ((), ()))


def fused_mlp_unavailable(recipe, *, has_bias: bool, dropout_rate: float) -> str | None:
    """Why LayerNormMLP's FP8 path would NOT run fused (None: it does); the switch is te_jax/fp8/fused.py's."""
    if has_bias:
        return "biases (use_bias=True)"
    if dropout_rate > 0.0:
        return "intermediate dropout is active"
    return fused_cast_unavailable(recipe)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    recipe: object
    activation: str
    gated: bool
    style: str  # quantize.gemm_style(): one of quantize.GEMM_STYLES
    w1_dtype: object
    w2_dtype: object
    interpret: bool | None
    norm: _nc.NormSpec | None = None  # x is the norm's input: the norm runs fused into x's cast (norm_cast.py)
    keep_weights: bool = False  # fused.keep_weight_copies(recipe): the forward's FP8 weight copies go to the backward
    state_kernel: bool = dataclasses.field(default_factory=state_update_kernel)  # quantize.delayed_updates' kernel
    # the launch overrides of this trace (fused.launch_overrides, read inside the custom VJP): part of the cache key
    launch: str = dataclasses.field(default_factory=launch_env)
    skip: bool = False  # (with norm) x is returned beside y; its gradient joins the norm's backward (norm_cast.py)


def _gemm(cfg, out_dtype, a_sinv, b_sinv, a, b):
    """a [m, k] . b [n, k] -> [m, n] in out_dtype (FP8 operands, per-tensor scale_invs)."""
    return _scaled_gemm(cfg.style, out_dtype, a_sinv, b_sinv)(a, b, _TN)


def _wgrad(cfg, out_dtype, a_sinv, b_sinv, a, b):
    """A weight-gradient GEMM (_gemm in quantize.wgrad_style(cfg.style))."""
    return _scaled_gemm(wgrad_style(cfg.style), out_dtype, a_sinv, b_sinv)(a, b, _TN)


def _gemm_owing_scale(cfg, out_dtype, a_sinv, b_sinv, a, b):
    """(y, scale y still owes) for a GEMM whose consumer is a cast kernel: the "direct" style leaves the product of
    the scale_invs to the kernel (its gu_scale / dh_scale: XLA would spend a pass over y on it, the cuBLASLt FP8
    call not folding it), so the kernel reads exactly what _gemm would have written. Other styles: (_gemm, None)."""
    if cfg.style not in ("direct", "wgrad_qdq"):
        return _gemm(cfg, out_dtype, a_sinv, b_sinv, a, b), None
    return f8_dot(a, b, _TN, out_dtype), (a_sinv * b_sinv).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _mlp(x, gamma, beta, w1, w2, wi_state, wo_state, cfg):
    return _mlp_fwd(x, gamma, beta, w1, w2, wi_state, wo_state, cfg)[0]


def _cast_transpose(kind, cfg, x, scale, out_dtype, *, write_q=True, round_to=None, **launch):
    """(x_q or None, x_qT, amax) of x [M, N]: the Triton cast kernel, or its TMA twin where tma_cast(kind) says so."""
    if tma_cast(kind, cfg.interpret, x):  # TE_JAX_FP8_TMA_CASTS (opt-in)
        return _tma.cast_transpose_tma(x, scale, out_dtype=out_dtype, round_to=round_to, write_q=write_q,
                                       block=TMA_BLOCK)
    if write_q:
        return _k.cast_transpose(x, scale, out_dtype=out_dtype, round_to=round_to, **launch)
    return (None,) + tuple(_k.cast_transposed(x, scale, out_dtype=out_dtype, round_to=round_to, **launch))


def _mlp_fwd(x, gamma, beta, w1, w2, wi_state, wo_state, cfg):
    """x [M, D] dt (the norm's input when cfg.norm, with gamma / beta [D]), w1 [D, n, F], w2 [F, Dout] -> y [M, Dout]
    dt."""
    recipe, dt = cfg.recipe, x.dtype
    fdt, fmax = recipe.fp8_format.fwd_dtype, recipe.fp8_format.max_fwd
    d, n, f = w1.shape
    w1f = w1.reshape(d, n * f)
    kw = dict(interpret=cfg.interpret, **launch_options("cast", cfg.interpret))
    kw_w = dict(interpret=cfg.interpret, **launch_options("weight", cfg.interpret))
    act = dict(activation=cfg.activation, gated=cfg.gated, round_to=dt, interpret=cfg.interpret)
    delayed = isinstance(recipe, DelayedScaling)
    if delayed:
        sx, sw1 = _read_scale(wi_state["input_scale"]), _read_scale(wi_state["kernel_scale"])
        sa, sw2 = _read_scale(wo_state["input_scale"]), _read_scale(wo_state["kernel_scale"])
    fused_stats = _nc.stats_in_kernel(x, cfg.norm, delayed)
    st = None if cfg.norm is None or fused_stats else _nc.stats(x, gamma, beta, cfg.norm)
    if not delayed:  # current scaling: the amax first (the unfused path's compute_scale(amax, 1, fmax))
        xin = x if cfg.norm is None else _nc.output(x, gamma, beta, st, cfg.norm)
        sx, sw1, sw2 = (compute_scale(amax(t), 1.0, fmax) for t in (xin, w1f.astype(dt), w2.astype(dt)))
    if cfg.norm is None:
        xq, xqT, ax = _cast_transpose("cast", cfg, x, sx, fdt, **kw)
    elif fused_stats:  # the norm's statistics inside the cast kernel (one read of x)
        xq, xqT, ax, st = _nc.stats_and_cast(x, gamma, beta, sx, cfg.norm, fdt, cfg.interpret)
    else:
        xq, xqT, ax = _nc.cast(x, gamma, beta, st, sx, cfg.norm, fdt, **kw)
    if cfg.keep_weights:  # both layouts from one read; the backward's dgrads take w_q as it is
        w1q, w1qT, aw1 = _cast_transpose("weight", cfg, w1f, sw1, fdt, round_to=dt, **kw_w)
        w2q, w2qT, aw2 = _cast_transpose("weight", cfg, w2, sw2, fdt, round_to=dt, **kw_w)
        kept = (w1q, w2q)
    else:  # the backward re-casts w1, w2
        _, w1qT, aw1 = _cast_transpose("weight", cfg, w1f, sw1, fdt, write_q=False, round_to=dt, **kw_w)
        _, w2qT, aw2 = _cast_transpose("weight", cfg, w2, sw2, fdt, write_q=False, round_to=dt, **kw_w)
        kept = None
    gu, s_gu = _gemm_owing_scale(cfg, dt, 1.0 / sx, 1.0 / sw1, xq, w1qT)  # [M, n*F]  wi fprop
    gu = gu.reshape(-1, n, f) if cfg.gated else gu
    if not delayed:
        sa = compute_scale(_k.act_amax(gu, gu_scale=s_gu, **act, **launch_options("act_amax", cfg.interpret)),
                           1.0, fmax)
    if tma_cast("act", cfg.interpret, gu.reshape(gu.shape[0], -1)):  # TE_JAX_FP8_TMA_CASTS (opt-in)
        aq, aqT, aa = _tma.act_cast_tma(gu, sa, out_dtype=fdt, gu_scale=s_gu, **act, block=TMA_BLOCK)
    else:
        aq, aqT, aa = _k.act_cast(gu, sa, out_dtype=fdt, transpose=True, gu_scale=s_gu, **act,
                                  **launch_options("act", cfg.interpret))
    y = _gemm(cfg, dt, 1.0 / sa, 1.0 / sw2, aq, w2qT)                     # [M, Dout] wo fprop
    new_fwd = None
    if delayed:  # the forward halves of the two states' updates (input_*, kernel_*), handed out by the backward
        ups = delayed_updates(recipe, [(wi_state["input_amax_history"], sx, ax, fmax),
                                       (wi_state["kernel_amax_history"], sw1, aw1, fmax),
                                       (wo_state["input_amax_history"], sa, aa, fmax),
                                       (wo_state["kernel_amax_history"], sw2, aw2, fmax)], cfg.interpret,
                              cfg.state_kernel)
        new_fwd = (ups[0] + ups[1], ups[2] + ups[3])
        grad_state = ((wi_state["output_grad_scale"], wi_state["output_grad_amax_history"]),
                      (wo_state["output_grad_scale"], wo_state["output_grad_amax_history"]))
    else:
        grad_state = None
    # By default the weights' FP8 copies are not kept for the backward: it re-casts them (one elementwise XLA pass,
    # same values), so the step holds no FP8 weight copy alongside its activations (temporary memory below bf16's).
    norm_res = None if cfg.norm is None else (x, gamma, beta, st)
    res = (xqT, w1f, w2, aqT, gu, s_gu, 1.0 / sx, sw1, 1.0 / sa, sw2, new_fwd, grad_state, norm_res, kept)
    return ((y, x) if cfg.skip else y), res


def _mlp_bwd(cfg, res, dy):
    xqT, w1f, w2, aqT, gu, s_gu, sxi, sw1, sai, sw2, new_fwd, grad_state, norm_res, kept = res
    dy, dskip = dy if cfg.skip else (dy, None)
    fdt = cfg.recipe.fp8_format.fwd_dtype
    if kept is not None:
        w1q, w2q = kept
    else:
        w1q = quantize(w1f.astype(gu.dtype), sw1, fdt)  # [D, n*F]: the values of the forward cast_transposed's w1_qT
        w2q = quantize(w2.astype(gu.dtype), sw2, fdt)   # [F, Dout]
    sw1i, sw2i = 1.0 / sw1, 1.0 / sw2
    recipe, dt = cfg.recipe, gu.dtype
    bdt, bmax = recipe.fp8_format.bwd_dtype, recipe.fp8_format.max_bwd
    kw = dict(interpret=cfg.interpret, **launch_options("cast", cfg.interpret))
    act = dict(activation=cfg.activation, gated=cfg.gated, round_to=dt, interpret=cfg.interpret)
    dy = dy.astype(dt)
    delayed = grad_state is not None
    if delayed:
        (wi_gs, wi_gh), (wo_gs, wo_gh) = grad_state
        sdgu, sdy = _read_scale(wi_gs), _read_scale(wo_gs)
    else:
        sdy = compute_scale(amax(dy), 1.0, bmax)
    dyq, dyqT, ady = _cast_transpose("cast", cfg, dy, sdy, bdt, **kw)
    dh, s_dh = _gemm_owing_scale(cfg, dt, 1.0 / sdy, sw2i, dyq, w2q)     # [M, F]     wo dgrad
    dw2 = _wgrad(cfg, dt, sai, 1.0 / sdy, aqT, dyqT)                       # [F, Dout]  wo wgrad
    owed = dict(gu_scale=s_gu, dh_scale=s_dh)
    if not delayed:
        sdgu = compute_scale(_k.dact_amax(dh, gu, **owed, **act, **launch_options("dact_amax", cfg.interpret)),
                             1.0, bmax)
    if tma_cast("dact", cfg.interpret, dh, gu.reshape(gu.shape[0], -1)):  # TE_JAX_FP8_TMA_CASTS (opt-in)
        dguq, dguqT, adgu = _tma.dact_cast_transpose_tma(dh, gu, sdgu, out_dtype=bdt, **owed, **act, block=TMA_BLOCK)
    else:
        dguq, dguqT, adgu = _k.dact_cast_transpose(dh, gu, sdgu, out_dtype=bdt, **owed, **act,
                                                   **launch_options("dact", cfg.interpret))
    dx = _gemm(cfg, dt, 1.0 / sdgu, sw1i, dguq.reshape(dh.shape[0], -1), w1q)   # [M, D]     wi dgrad
    dw1 = _wgrad(cfg, dt, sxi, 1.0 / sdgu, xqT, dguqT)                    # [D, n*F]   wi wgrad
    wi_ct = wo_ct = None
    if delayed:
        up_wi, up_wo = delayed_updates(recipe, [(wi_gh, sdgu, adgu, bmax), (wo_gh, sdy, ady, bmax)], cfg.interpret,
                                       cfg.state_kernel)
        wi_ct = dict(zip(STATE_KEYS, new_fwd[0] + up_wi))
        wo_ct = dict(zip(STATE_KEYS, new_fwd[1] + up_wo))
    dw1 = dw1.reshape(xqT.shape[0], -1, w2q.shape[0]).astype(cfg.w1_dtype)
    dgamma = dbeta = None
    if norm_res is not None:  # dx above is the norm output's cotangent
        x, gamma, beta, st = norm_res
        dx, dgamma, dbeta = _nc.backward(dx, x, gamma, beta, st, cfg.norm, cfg.interpret, dres=dskip)
    return dx, dgamma, dbeta, dw1, dw2.astype(cfg.w2_dtype), wi_ct, wo_ct


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def fused_fp8_mlp(x, w1, w2, recipe, wi_state=None, wo_state=None, *, activations, interpret=None, norm=None,
                  gamma=None, beta=None, skip=False):
    """y = act(norm(x) . w1) . w2 with FP8 GEMMs and fused quantization (see the module docstring).

    norm: a te_jax.fp8.norm_cast.NormSpec (with gamma, and beta for LayerNorm, [D]) runs the norm fused into x's
    cast (norm_cast.py: its output is never stored); None: x goes to the GEMM as it is.
    skip (with norm): return (y, x), x the same values, for the skip connection x + y: its gradient is then added
    inside the norm's backward pass (norm_cast.backward's dres) rather than by a separate one.

    x [..., D] in the compute dtype; w1 [D, n_act, F], w2 [F, Dout] in any float dtype (cast to x's dtype before
    quantization, gradients returned in their own dtypes); activations: a te_jax name tuple, (act,) or
    (act, "linear"); recipe DelayedScaling (wi_state, wo_state: quantize.init_state dicts, their updates come
    back as their gradients) or Float8CurrentScaling (no state). Returns y [..., Dout] in x's dtype.
    """
    acts = tuple(activations)
    if not (len(acts) == 1 or (len(acts) == 2 and acts[1] == "linear")):
        raise ValueError(f"fused_fp8_mlp: activations={acts!r} must be (act,) or (act, 'linear').")
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise ValueError(f"fused_fp8_mlp: recipe {type(recipe).__name__} is not per-tensor (DelayedScaling or "
                         "Float8CurrentScaling).")
    delayed = isinstance(recipe, DelayedScaling)
    if delayed:
        if wi_state is None or wo_state is None:
            raise ValueError("fused_fp8_mlp: DelayedScaling needs wi_state and wo_state.")
        wi_state, wo_state = ({k: jnp.asarray(s[k], jnp.float32) for k in STATE_KEYS} for s in (wi_state, wo_state))
    else:
        wi_state = wo_state = None
    d, n, f = w1.shape
    if n != len(acts) or x.shape[-1] != d or w2.ndim != 2 or w2.shape[0] != f:
        raise ValueError(f"fused_fp8_mlp: shapes x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)} "
                         f"do not fit activations {acts} (w1 [D, {len(acts)}, F], w2 [F, Dout]).")
    if norm is not None and (gamma is None or tuple(gamma.shape) != (d,)):
        raise ValueError(f"fused_fp8_mlp: norm={norm} needs gamma of shape ({d},); got "
                         f"{None if gamma is None else tuple(gamma.shape)}.")
    if skip and norm is None:
        raise ValueError("fused_fp8_mlp: skip=True needs a norm (its gradient joins the norm's backward).")
    cfg = _Cfg(recipe, acts[0], len(acts) == 2, gemm_style(), jnp.dtype(w1.dtype), jnp.dtype(w2.dtype), interpret,
               norm, keep_weight_copies(recipe), skip=bool(skip))
    if norm is None:
        gamma = beta = None
    out = _mlp(x.reshape(-1, d), gamma, beta, w1, w2, wi_state, wo_state, cfg)
    y, x_skip = out if skip else (out, None)
    y = y.reshape(x.shape[:-1] + (w2.shape[1],))
    return (y, x_skip.reshape(x.shape)) if skip else y


__all__ = ["fused_fp8_mlp", "fused_mlp_unavailable"]
