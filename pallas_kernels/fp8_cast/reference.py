"""Plain-jnp references of the FP8 cast kernels (same signatures, no launch parameters).

Same math as kernels.py (common.py's activation, rounding and saturating cast), written as whole-array XLA
ops; the amax is jnp.max of |v| (a NaN propagates here; the kernels read it as +inf).
"""
from __future__ import annotations

import jax.numpy as jnp

from . import common as C


def _amax(*vals):
    return jnp.max(jnp.stack([jnp.max(jnp.abs(v)) for v in vals])).astype(jnp.float32)


def _scale(scale):
    return C.scale_array(scale)[0]


def _in(v, in_scale):
    """An input in fp32, times the scale it still owes (rounded to its dtype; common.prescale)."""
    return C.prescale(v.astype(jnp.float32), None if in_scale is None else _scale(in_scale), v.dtype)


def act(gu, *, activation, gated, round_to=None, gu_scale=None):
    """a [M, F] fp32 (rounded to round_to if given)."""
    gu = _in(gu, gu_scale)
    a = C.act_fn(activation, gated)(gu[:, 0], gu[:, 1]) if gated else C.act_fn(activation, gated)(gu)
    return C.maybe_round(a, round_to)


def act_cast(gu, scale, *, activation, gated, out_dtype, round_to=None, transpose=False, gu_scale=None):
    a = act(gu, activation=activation, gated=gated, round_to=round_to, gu_scale=gu_scale)
    q = C.saturate(a, _scale(scale), out_dtype)
    return (q, q.T, _amax(a)) if transpose else (q, _amax(a))


def act_amax(gu, *, activation, gated, round_to=None, gu_scale=None):
    return _amax(act(gu, activation=activation, gated=gated, round_to=round_to, gu_scale=gu_scale))


def dact(dh, gu, *, activation, gated, round_to=None, gu_scale=None, dh_scale=None):
    """dgu in gu's shape, fp32 (rounded to round_to if given)."""
    dh, gu = _in(dh, dh_scale), _in(gu, gu_scale)
    if gated:
        dg, du = C.dact(activation, True, dh, gu[:, 0], gu[:, 1])
        d = jnp.stack([dg, du], axis=1)
    else:
        (d,) = C.dact(activation, False, dh, gu)
    return C.maybe_round(d, round_to)


def dact_cast_transpose(dh, gu, scale, *, activation, gated, out_dtype, round_to=None, gu_scale=None,
                        dh_scale=None):
    d = dact(dh, gu, activation=activation, gated=gated, round_to=round_to, gu_scale=gu_scale, dh_scale=dh_scale)
    q = C.saturate(d, _scale(scale), out_dtype)
    return q, q.reshape(q.shape[0], -1).T, _amax(d)


def dact_amax(dh, gu, *, activation, gated, round_to=None, gu_scale=None, dh_scale=None):
    return _amax(dact(dh, gu, activation=activation, gated=gated, round_to=round_to, gu_scale=gu_scale,
                      dh_scale=dh_scale))


def cast_transpose(x, scale, *, out_dtype, round_to=None):
    x = C.maybe_round(x.astype(jnp.float32), round_to)
    q = C.saturate(x, _scale(scale), out_dtype)
    return q, q.T, _amax(x)


def norm_cast_transpose(x, mean, rstd, gamma, beta, scale, *, out_dtype, zero_centered_gamma=False):
    xf = x.astype(jnp.float32)
    if mean is not None:
        xf = xf - mean[:, None]
    g = gamma.astype(jnp.float32)
    g = 1.0 + g if zero_centered_gamma else g
    y = xf * rstd[:, None] * g[None, :]
    if beta is not None:
        y = y + beta.astype(jnp.float32)[None, :]
    return cast_transpose(y.astype(x.dtype), scale, out_dtype=out_dtype)
