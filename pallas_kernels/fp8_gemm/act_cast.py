"""The MLP's activation and its gradient with the block casts fused (Triton-lowered Pallas): what
pallas_kernels.fp8_cast's act_cast / dact_cast_transpose are for per-tensor scales, in the 1x128 tiles of the
block-scaled GEMM.

    act_block_cast(gu [M, n, F], *, activation, out_dtype, round_to)
        a = act(gate) * up (n = 2: gate gu[:, 0], up gu[:, 1]) or act(gu[:, 0]) (n = 1), rounded to round_to
        -> (q [M, F], q_scales [F/128, M], qt [F, M], qt_scales [M/128, F])
    dact_block_cast_transpose(dh [M, F], gu [M, n, F], *, activation, out_dtype, round_to)
        dgu = d a / d(gate, up) * dh, rounded to round_to
        -> (q [M, n*F], q_scales [n*F/128, M], qt [n*F, M], qt_scales [M/128, n*F])
The outputs are block_cast_transpose(v, tiles="rows")'s of v = a (or dgu as [M, n*F]): q in 1x128 tiles along
its rows (the next GEMM's operand), qt = v^T in 1x128 tiles along M (the wgrad GEMM's operand), each with the
scales in the GEMM kernel's [K/128, rows] layout. One program per 128 x 128 tile of [M, F] reads gu (and dh) once
and writes every output; the activation math is pallas_kernels.fp8_cast.common's (fp32). M % 128 == F % 128 == 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._compat import default_interpret, pl, triton_params
from .._lower_once import lower_once
from ..fp8_cast import common as C
from .cast import quantize_tile
from .reference import BLOCK_K

_STATIC = ("activation", "out_dtype", "round_to", "interpret", "num_warps")


def _check(where, gu, out_dtype, activation, round_to, dh=None):
    C.check_common(where, activation=activation, out_dtype=out_dtype, round_to=round_to,
                   arrays=[("gu", gu)] + ([("dh", dh)] if dh is not None else []))
    if gu.ndim != 3 or gu.shape[1] not in (1, 2):
        raise ValueError(f"{where}: gu must be [M, n, F] with n = 2 (gate, up) or 1; got shape {tuple(gu.shape)}.")
    m, n, f = gu.shape
    if m % BLOCK_K or f % BLOCK_K:
        raise ValueError(f"{where}: gu [M, n, F] = {tuple(gu.shape)} needs M and F multiples of {BLOCK_K} (the "
                         "scale blocks); use the unfused path.")
    if dh is not None and tuple(dh.shape) != (m, f):
        raise ValueError(f"{where}: dh has shape {tuple(dh.shape)}; expected {(m, f)} for gu {tuple(gu.shape)}.")
    return m, n, f


def _outputs(m, n, f, out_dtype):
    """q [M, n, F], its scales [n, F/128, M], qt [n, F, M], its scales [M/128, n, F] (reshaped by the callers)."""
    b = BLOCK_K
    return [jax.ShapeDtypeStruct((m, n, f), out_dtype), jax.ShapeDtypeStruct((n, f // b, m), jnp.float32),
            jax.ShapeDtypeStruct((n, f, m), out_dtype), jax.ShapeDtypeStruct((m // b, n, f), jnp.float32)]


def _specs(n):
    b = BLOCK_K
    return [pl.BlockSpec((b, n, b), lambda i, j: (i, 0, j)), pl.BlockSpec((n, 1, b), lambda i, j: (0, j, i)),
            pl.BlockSpec((n, b, b), lambda i, j: (0, j, i)), pl.BlockSpec((1, n, b), lambda i, j: (i, 0, j))]


def _store(p, v, refs, out_dtype):
    """Part p (0 = gate / the activation, 1 = up) of the tile: v [128, 128] fp32 into the four outputs."""
    q_ref, qs_ref, qt_ref, qts_ref = refs
    q, s_rows, qt, s_cols = quantize_tile(v, out_dtype)
    q_ref[:, p, :] = q
    qs_ref[p, 0, :] = s_rows
    qt_ref[p, :, :] = qt
    qts_ref[0, p, :] = s_cols


def _act_kernel(gu_ref, *outs, fn, gated, round_to, out_dtype):
    g = gu_ref[:, 0, :].astype(jnp.float32)
    a = fn(g, gu_ref[:, 1, :].astype(jnp.float32)) if gated else fn(g)
    _store(0, C.maybe_round(a, round_to), outs, out_dtype)


def _dact_kernel(dh_ref, gu_ref, *outs, activation, gated, round_to, out_dtype):
    g = gu_ref[:, 0, :].astype(jnp.float32)
    u = gu_ref[:, 1, :].astype(jnp.float32) if gated else None
    for p, d in enumerate(C.dact(activation, gated, dh_ref[...].astype(jnp.float32), g, u)):
        _store(p, C.maybe_round(d, round_to), outs, out_dtype)


def _flat(q, qs, qt, qts):
    """[M, n, F], [n, F/128, M], [n, F, M], [M/128, n, F] -> [M, n*F], [n*F/128, M], [n*F, M], [M/128, n*F]."""
    m, n, f = q.shape
    return q.reshape(m, n * f), qs.reshape(-1, m), qt.reshape(n * f, m), qts.reshape(-1, n * f)


def _call(kernel, args, m, n_in, n_out, f, out_dtype, interpret, num_warps, name):
    b = BLOCK_K
    in_specs = [pl.BlockSpec((b, n_in, b), lambda i, j: (i, 0, j))]
    if len(args) == 2:  # dh
        in_specs = [pl.BlockSpec((b, b), lambda i, j: (i, j))] + in_specs
    outs = pl.pallas_call(
        kernel,
        out_shape=_outputs(m, n_out, f, out_dtype),
        grid=(m // b, f // b),
        in_specs=in_specs,
        out_specs=_specs(n_out),
        compiler_params=triton_params(num_warps, 1),
        interpret=default_interpret() if interpret is None else interpret,
        name=name,
    )(*args)
    return _flat(*outs)


@lower_once(static_argnames=_STATIC)
def act_block_cast(gu, *, activation, out_dtype, round_to=None, interpret=None, num_warps: int = 8):
    """See the module docstring. gu [M, n, F] (bf16 / fp16 / fp32)."""
    m, n, f = _check("act_block_cast", gu, out_dtype, activation, round_to)
    kernel = functools.partial(_act_kernel, fn=C.act_fn(activation, n == 2), gated=n == 2, round_to=round_to,
                               out_dtype=jnp.dtype(out_dtype))
    return _call(kernel, (gu,), m, n, 1, f, out_dtype, interpret, num_warps, f"te_fp8_act_block_cast_{activation}")


@lower_once(static_argnames=_STATIC)
def dact_block_cast_transpose(dh, gu, *, activation, out_dtype, round_to=None, interpret=None, num_warps: int = 8):
    """See the module docstring. dh [M, F] (a's cotangent), gu [M, n, F]."""
    m, n, f = _check("dact_block_cast_transpose", gu, out_dtype, activation, round_to, dh)
    kernel = functools.partial(_dact_kernel, activation=activation, gated=n == 2, round_to=round_to,
                               out_dtype=jnp.dtype(out_dtype))
    return _call(kernel, (dh, gu), m, n, n, f, out_dtype, interpret, num_warps,
                 f"te_fp8_dact_block_cast_{activation}")


__all__ = ["act_block_cast", "dact_block_cast_transpose"]
