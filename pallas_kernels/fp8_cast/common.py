"""What the FP8 cast kernels and their reference share: activation math, the saturating cast, validation.

Conventions (TransformerEngine's, te_jax/fp8/quantize.py's): a per-tensor `scale` MULTIPLIES before the cast,
    q = saturate(v * scale) -> FP8,  saturate = clip to [-fp8_max, fp8_max] (NaN stays NaN),
with v in fp32. `round_to` (a dtype or None): v is first rounded to that dtype (and the amax is taken of the
rounded values): what a pipeline that stores v in, e.g., bf16 between the activation and the cast sees.
An input scale (`gu_scale`, `dh_scale`; None for none) multiplies an input after its load, rounded back to the
input's dtype (`prescale`): a GEMM's FP8 dequantization scale is applied here instead of in a separate pass.
"""
from __future__ import annotations

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp

from pallas_kernels.ln_mlp.activations import ACTIVATIONS  # the activation math te_jax uses (plain jnp)

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def saturate(v, scale, dtype):
    """clip(v * scale, -fp8_max, fp8_max) -> dtype; v fp32, scale an fp32 scalar. NaN stays NaN (the clip alone
    would map it to -fp8_max on Triton, whose max/min ignore NaN)."""
    m = fp8_max(dtype)
    y = v * scale
    return jnp.where(y == y, jnp.clip(y, -m, m), y).astype(dtype)


def abs_for_amax(v):
    """|v|, with NaN read as +inf: a max over a tile is then non-finite whenever a value is (Triton's max ignores
    NaN, XLA's propagates it; the recipes treat a NaN and an inf amax alike)."""
    return jnp.where(v == v, jnp.abs(v), jnp.inf)


def maybe_round(v, round_to):
    return v if round_to is None else v.astype(round_to).astype(jnp.float32)


def act_fn(activation: str, gated: bool):
    """(gate, up) -> act(gate) * up when gated, gate -> act(gate) otherwise (fp32 in, fp32 out)."""
    fn = ACTIVATIONS[activation]
    if gated:
        return lambda g, u: fn(g) * ACTIVATIONS["linear"](u)  # te_jax's apply_activations for (act, "linear")
    return fn


def dact(activation: str, gated: bool, dh, g, u=None):
    """The cotangents of act_fn's inputs for output cotangent dh, by autodiff (the same operations XLA's
    autodiff of te_jax's activations runs): (dgate, dup) when gated, (dgate,) otherwise; all fp32."""
    fn = act_fn(activation, gated)
    args = (g, u) if gated else (g,)
    return jax.vjp(fn, *args)[1](dh)


def dact_traced(activation: str, gated: bool, dh, g, u=None):
    """dact's values from the same operations, with autodiff's add_any (which Mosaic GPU does not lower) run as
    add: dact's jaxpr evaluated primitive by primitive (flat: the activations are plain jnp)."""
    args = (dh, g) + ((u,) if gated else ())
    closed = jax.make_jaxpr(lambda *a: dact(activation, gated, *a))(*args)
    env = dict(zip(closed.jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
    for eqn in closed.jaxpr.eqns:
        prim = jax.lax.add_p if eqn.primitive.name == "add_any" else eqn.primitive
        if eqn.params.get("jaxpr") is not None or eqn.params.get("call_jaxpr") is not None:
            raise NotImplementedError(f"dact_traced: {eqn.primitive} holds a sub-jaxpr")
        outs = prim.bind(*map(read, eqn.invars), **eqn.params)
        for var, val in zip(eqn.outvars, outs if prim.multiple_results else [outs]):
            env[var] = val
    return [read(v) for v in closed.jaxpr.outvars]


def check_common(where, *, activation=None, gated=None, out_dtype=None, round_to=None, arrays=()):
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation={activation!r} must be one of {sorted(ACTIVATIONS)}.")
    if gated is not None and not isinstance(gated, bool):
        raise ValueError(f"{where}: gated={gated!r} must be a bool.")
    if out_dtype is not None and jnp.dtype(out_dtype) not in FP8_DTYPES:
        raise ValueError(f"{where}: out_dtype={out_dtype!r} must be float8_e4m3fn or float8_e5m2.")
    if round_to is not None and jnp.dtype(round_to) not in IN_DTYPES:
        raise ValueError(f"{where}: round_to={round_to!r} must be None, bfloat16, float16 or float32.")
    for name, a in arrays:
        if jnp.dtype(a.dtype) not in IN_DTYPES:
            raise ValueError(f"{where}: {name} has dtype {a.dtype}; expected bfloat16, float16 or float32.")


def split_gated(gu, gated, where):
    """gu [M, 2, F] (gated) or [M, F] -> (gu2 [M, n*F], M, F, n)."""
    if gated:
        if gu.ndim != 3 or gu.shape[1] != 2:
            raise ValueError(f"{where}: gated input must have shape [M, 2, F]; got {tuple(gu.shape)}.")
        m, _, f = gu.shape
        return gu.reshape(m, 2 * f), m, f, 2
    if gu.ndim != 2:
        raise ValueError(f"{where}: non-gated input must have shape [M, F]; got {tuple(gu.shape)}.")
    return gu, gu.shape[0], gu.shape[1], 1


def scale_array(scale, *in_scales):
    """A scale (python float, scalar or shape-(1,) array) as an fp32 array of shape (1,); with input scales
    (None entries skipped), shape (1 + their number,): [scale, *in_scales]."""
    parts = [jnp.asarray(s, jnp.float32).reshape(1) for s in (scale,) + in_scales if s is not None]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def prescale(v, in_scale, dtype):
    """An input that still owes a per-tensor scale (a GEMM's unscaled output): v * in_scale rounded to the
    input's dtype (what `(v * in_scale).astype(dtype)` in XLA would have stored). v fp32; in_scale None: v."""
    return v if in_scale is None else (v * in_scale).astype(dtype).astype(jnp.float32)


