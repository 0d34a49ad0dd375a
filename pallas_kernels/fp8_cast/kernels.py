"""FP8 cast kernels (Triton-lowered Pallas): fused activation + cast, dActivation + cast + transpose, cast +
transpose. Each also hands out the amax of what it cast.

    act_cast(gu, scale, ...)              gu [M, 2, F] (gated) | [M, F] -> a_q [M, F] (, a_qT [F, M]), amax
                                          (gu_scale=: a scale gu still owes, applied after the load)
    act_amax(gu, ...)                     amax of a only (current scaling: the scale before the cast)
    dact_cast_transpose(dh, gu, scale)    dh [M, F], gu -> dgu_q [gu's shape], dgu_qT [n*F, M], amax
    dact_amax(dh, gu, ...)                amax of dgu only
    cast_transpose(x, scale)              x [M, N] -> x_q [M, N], x_qT [N, M], amax
    cast_transposed(x, scale)             x [M, N] -> x_qT [N, M], amax (the transposed copy only)
    norm_cast_transpose(x, mean, rstd, gamma, beta, scale)
                                          x [M, N] -> the normalized x's q [M, N], qT [N, M], amax: LayerNorm
                                          (mean given) or RMSNorm (mean None) from the row statistics, applied,
                                          rounded to x's dtype, cast; the norm's output is never stored

a = act(gate) * up (gated; gate = gu[:, 0], up = gu[:, 1]) or act(gu); dgu = d a / d(gate, up) * dh, all in
fp32; values are cast with common.saturate (clip(v * scale) -> FP8, scale multiplies) after the optional
rounding to `round_to` (common.py). The amax is max |v| over the whole tensor as an fp32 scalar (NaN reads as
+inf): each program writes its tile's max to a partials vector, reduced by jnp.max outside the kernel.

One program per (block_m x block_n) tile of the [M, F] (or [M, N]) index space, masked at the ragged edges
(any M, F). A transposed output is written by the same program from the same registers: the store addresses
[col, row] (the compiler picks a layout whose consecutive threads write consecutive rows). block_m and
block_n must be powers of two; they shrink to the next power of two of small dimensions. Every operand must
have fewer than 2**31 elements (int32 indexing).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._compat import default_interpret, pl, pltriton, triton_params
from .._lower_once import lower_once
from .._shapes import next_pow2 as _next_pow2
from . import common as C

_STATIC = ("activation", "gated", "out_dtype", "round_to", "interpret", "block_m", "block_n", "num_warps",
           "num_stages")


def _block(requested, dim, where, name):
    if not isinstance(requested, int) or requested < 1 or requested & (requested - 1):
        raise ValueError(f"{where}: {name}={requested!r} must be a power of two.")
    return min(requested, max(16, _next_pow2(dim)))


def _launch(where, kernel, args, out_shape, m, n, block_m, block_n, num_warps, num_stages, interpret, name):
    for a in list(args) + list(out_shape):
        if a.size >= 2 ** 31:  # the kernels index with int32
            raise ValueError(f"{where}: an operand of shape {tuple(a.shape)} has 2**31 or more elements; split it.")
    bm, bn = _block(block_m, m, where, "block_m"), _block(block_n, n, where, "block_n")
    gm, gn = pl.cdiv(m, bm), pl.cdiv(n, bn)
    warps = num_warps or (8 if bm * bn >= 8192 else 4 if bm * bn >= 2048 else 2)
    outs = pl.pallas_call(
        functools.partial(kernel, bm=bm, bn=bn, gn=gn),
        out_shape=list(out_shape) + [jax.ShapeDtypeStruct((gm * gn,), jnp.float32)],
        grid=(gm, gn),
        compiler_params=triton_params(warps, num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name=name,
    )(*args)
    # The barrier ties the amax to the cast outputs, so the partials vector is reduced (and freed) before they are
    # used: the amax's own consumer (a delayed-scaling state update) may sit at the end of the step, and XLA kept the
    # vectors live until then (0.5 MiB of a Llama layer's temporary memory on an H100).
    outs = jax.lax.optimization_barrier((*outs[:-1], jnp.max(outs[-1])))
    return outs[:-1], outs[-1]


def _tile(m, n, bm, bn):
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    cols = pl.program_id(1) * bn + jnp.arange(bn)
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    return rows[:, None], cols[None, :], mask


def _load(ref, rows, cols, mask):
    return pltriton.load(ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)


def _tile_amax(vals, mask, amax_ref, gn):
    t = C.abs_for_amax(vals[0])
    for v in vals[1:]:
        t = jnp.maximum(t, C.abs_for_amax(v))  # elementwise first: one reduction per tile
    amax_ref[pl.program_id(0) * gn + pl.program_id(1)] = jnp.max(jnp.where(mask, t, 0.0))


# ----------------------------------------------------------------------------- activation + cast


def _act_kernel(*refs, m, f, act, gated, round_to, out_dtype, mode, in_dtype, bm, bn, gn):
    gu_ref, scale_ref, *outs = refs
    rows, cols, mask = _tile(m, f, bm, bn)
    s_gu = scale_ref[1] if scale_ref.shape[0] > 1 else None
    g = C.prescale(_load(gu_ref, rows, cols, mask), s_gu, in_dtype)
    a = act(g, C.prescale(_load(gu_ref, rows, f + cols, mask), s_gu, in_dtype)) if gated else act(g)
    a = C.maybe_round(a, round_to)
    _tile_amax([a], mask, outs[-1], gn)
    if mode == "amax":
        return
    q = C.saturate(a, scale_ref[0], out_dtype)
    pltriton.store(outs[0].at[rows, cols], q, mask=mask)
    if mode == "cast_t":
        pltriton.store(outs[1].at[cols, rows], q, mask=mask)


def _act_call(gu, scale, gu_scale, mode, activation, gated, out_dtype, round_to, interpret, block_m, block_n,
              num_warps, num_stages):
    where = "act_cast" if mode != "amax" else "act_amax"
    C.check_common(where, activation=activation, gated=gated, out_dtype=out_dtype, round_to=round_to,
                   arrays=[("gu", gu)])
    gu2, m, f, _ = C.split_gated(gu, gated, where)
    out_shape = []
    if mode != "amax":
        out_shape.append(jax.ShapeDtypeStruct((m, f), out_dtype))
    if mode == "cast_t":
        out_shape.append(jax.ShapeDtypeStruct((f, m), out_dtype))
    kernel = functools.partial(_act_kernel, m=m, f=f, act=C.act_fn(activation, gated), gated=gated,
                               round_to=round_to, out_dtype=out_dtype, mode=mode, in_dtype=gu.dtype)
    return _launch(where, kernel, (gu2, C.scale_array(scale, gu_scale)), out_shape, m, f, block_m, block_n, num_warps,
                   num_stages, interpret, f"te_fp8_act_{activation}{'_glu' if gated else ''}_{mode}")


@lower_once(static_argnames=_STATIC + ("transpose",))
def act_cast(gu, scale, *, activation, gated, out_dtype, round_to=None, transpose=False, gu_scale=None,
             interpret=None, block_m=128, block_n=64, num_warps=None, num_stages=1):
    """gu [M, 2, F] (gated) or [M, F]; scale an fp32 scalar (multiplies before the cast); gu_scale an optional
    fp32 scalar gu still owes (common.prescale: gu * gu_scale, rounded to gu's dtype, is the input).

    Returns (a_q [M, F] out_dtype, amax f32 scalar), or with transpose=True (a_q, a_qT [F, M], amax): a_qT is
    a_q transposed, written by the same program (the operand layout of a wgrad GEMM that contracts M)."""
    outs, amax = _act_call(gu, scale, gu_scale, "cast_t" if transpose else "cast", activation, gated, out_dtype, round_to,
                           interpret, block_m, block_n, num_warps, num_stages)
    return (*outs, amax)


@lower_once(static_argnames=("activation", "gated", "round_to", "interpret", "block_m", "block_n", "num_warps",
                             "num_stages"))
def act_amax(gu, *, activation, gated, round_to=None, gu_scale=None, interpret=None, block_m=128, block_n=64,
             num_warps=None, num_stages=1):
    """max |a| (f32 scalar) of the a that act_cast would cast; reads gu, writes only per-tile maxima."""
    return _act_call(gu, 1.0, gu_scale, "amax", activation, gated, None, round_to, interpret, block_m, block_n, num_warps,
                     num_stages)[1]


# ----------------------------------------------------------------------------- dActivation + cast + transpose


def _dact_kernel(*refs, m, f, activation, gated, round_to, out_dtype, mode, in_dtypes, in_scaled, bm, bn, gn):
    dh_ref, gu_ref, scale_ref, *outs = refs
    rows, cols, mask = _tile(m, f, bm, bn)
    k = iter(range(1, 3))
    s_gu, s_dh = (scale_ref[next(k)] if on else None for on in in_scaled)
    dh = C.prescale(_load(dh_ref, rows, cols, mask), s_dh, in_dtypes[0])
    g = C.prescale(_load(gu_ref, rows, cols, mask), s_gu, in_dtypes[1])
    u = C.prescale(_load(gu_ref, rows, f + cols, mask), s_gu, in_dtypes[1]) if gated else None
    grads = [C.maybe_round(d, round_to) for d in C.dact(activation, gated, dh, g, u)]
    _tile_amax(grads, mask, outs[-1], gn)
    if mode == "amax":
        return
    q_ref, qt_ref, _ = outs
    scale = scale_ref[0]
    for i, d in enumerate(grads):  # i = 0: d/dgate (columns [0, F)), i = 1: d/dup (columns [F, 2F))
        q = C.saturate(d, scale, out_dtype)
        pltriton.store(q_ref.at[rows, i * f + cols], q, mask=mask)
        pltriton.store(qt_ref.at[i * f + cols, rows], q, mask=mask)


def _dact_call(dh, gu, scale, gu_scale, dh_scale, mode, activation, gated, out_dtype, round_to, interpret, block_m,
               block_n, num_warps, num_stages):
    where = "dact_cast_transpose" if mode != "amax" else "dact_amax"
    C.check_common(where, activation=activation, gated=gated, out_dtype=out_dtype, round_to=round_to,
                   arrays=[("dh", dh), ("gu", gu)])
    gu2, m, f, n = C.split_gated(gu, gated, where)
    if tuple(dh.shape) != (m, f):
        raise ValueError(f"{where}: dh has shape {tuple(dh.shape)}; expected {(m, f)} for gu {tuple(gu.shape)}.")
    out_shape = []
    if mode != "amax":
        out_shape = [jax.ShapeDtypeStruct((m, n * f), out_dtype), jax.ShapeDtypeStruct((n * f, m), out_dtype)]
    kernel = functools.partial(_dact_kernel, m=m, f=f, activation=activation, gated=gated, round_to=round_to,
                               out_dtype=out_dtype, mode=mode, in_dtypes=(dh.dtype, gu.dtype),
                               in_scaled=(gu_scale is not None, dh_scale is not None))
    return _launch(where, kernel, (dh, gu2, C.scale_array(scale, gu_scale, dh_scale)), out_shape, m, f, block_m, block_n, num_warps,
                   num_stages, interpret, f"te_fp8_dact_{activation}{'_glu' if gated else ''}_{mode}")


@lower_once(static_argnames=_STATIC)
def dact_cast_transpose(dh, gu, scale, *, activation, gated, out_dtype, round_to=None, gu_scale=None,
                        dh_scale=None, interpret=None, block_m=128, block_n=64, num_warps=None, num_stages=1):
    """dh [M, F] (the cotangent of a), gu as act_cast's; scale an fp32 scalar; gu_scale / dh_scale optional
    fp32 scalars the inputs still owe (as act_cast's gu_scale).

    Returns (dgu_q [gu's shape] out_dtype, dgu_qT [n*F, M] out_dtype (n = 2 gated, else 1; row i*F + j is
    dgu_q[:, i, j]), amax f32 scalar of |dgu|)."""
    (q, qt), amax = _dact_call(dh, gu, scale, gu_scale, dh_scale, "cast_t", activation, gated, out_dtype, round_to, interpret,
                               block_m, block_n, num_warps, num_stages)
    return q.reshape(gu.shape), qt, amax


@lower_once(static_argnames=("activation", "gated", "round_to", "interpret", "block_m", "block_n", "num_warps",
                             "num_stages"))
def dact_amax(dh, gu, *, activation, gated, round_to=None, gu_scale=None, dh_scale=None, interpret=None,
              block_m=128, block_n=64, num_warps=None, num_stages=1):
    """max |dgu| (f32 scalar) of the dgu that dact_cast_transpose would cast; writes only per-tile maxima."""
    return _dact_call(dh, gu, 1.0, gu_scale, dh_scale, "amax", activation, gated, None, round_to, interpret, block_m, block_n,
                      num_warps, num_stages)[1]


# ----------------------------------------------------------------------------- cast + transpose


def _cast_t_kernel(x_ref, scale_ref, *outs, m, n, round_to, out_dtype, write_q, bm, bn, gn):
    rows, cols, mask = _tile(m, n, bm, bn)
    x = C.maybe_round(_load(x_ref, rows, cols, mask), round_to)
    _tile_amax([x], mask, outs[-1], gn)
    q = C.saturate(x, scale_ref[0], out_dtype)
    if write_q:
        pltriton.store(outs[0].at[rows, cols], q, mask=mask)
    pltriton.store(outs[-2].at[cols, rows], q, mask=mask)


def _cast_t_call(where, x, scale, write_q, out_dtype, round_to, interpret, block_m, block_n, num_warps, num_stages):
    C.check_common(where, out_dtype=out_dtype, round_to=round_to, arrays=[("x", x)])
    if x.ndim != 2:
        raise ValueError(f"{where}: x must be 2-D [M, N]; got shape {tuple(x.shape)}.")
    m, n = x.shape
    out_shape = ([jax.ShapeDtypeStruct((m, n), out_dtype)] if write_q else []) + [
        jax.ShapeDtypeStruct((n, m), out_dtype)]
    kernel = functools.partial(_cast_t_kernel, m=m, n=n, round_to=round_to, out_dtype=out_dtype, write_q=write_q)
    return _launch(where, kernel, (x, C.scale_array(scale)), out_shape, m, n, block_m, block_n, num_warps,
                   num_stages, interpret, "te_fp8_cast_transpose" if write_q else "te_fp8_cast_transposed")


@lower_once(static_argnames=("out_dtype", "round_to", "interpret", "block_m", "block_n", "num_warps",
                             "num_stages"))
def cast_transpose(x, scale, *, out_dtype, round_to=None, interpret=None, block_m=128, block_n=64,
                   num_warps=None, num_stages=1):
    """x [M, N] (bf16 / fp16 / fp32); scale an fp32 scalar. Returns (x_q [M, N], x_qT [N, M], amax of |x|)."""
    (q, qt), amax = _cast_t_call("cast_transpose", x, scale, True, out_dtype, round_to, interpret, block_m, block_n,
                                 num_warps, num_stages)
    return q, qt, amax


@lower_once(static_argnames=("out_dtype", "round_to", "interpret", "block_m", "block_n", "num_warps",
                             "num_stages"))
def cast_transposed(x, scale, *, out_dtype, round_to=None, interpret=None, block_m=128, block_n=64,
                    num_warps=None, num_stages=1):
    """x [M, N]; scale an fp32 scalar. Returns (x_qT [N, M], amax of |x|): cast_transpose's transposed copy alone
    (for a weight whose forward GEMM needs only that layout; it saves writing x_q)."""
    (qt,), amax = _cast_t_call("cast_transposed", x, scale, False, out_dtype, round_to, interpret, block_m, block_n,
                               num_warps, num_stages)
    return qt, amax


# ----------------------------------------------------------------------------- norm + cast + transpose


def _norm_cast_t_kernel(*refs, m, n, has_mean, has_beta, zero_centered, out_dtype, bm, bn, gn):
    x_ref, scale_ref = refs[0], refs[1]
    i = 2
    mean_ref = refs[i] if has_mean else None
    i += has_mean
    rstd_ref, gamma_ref = refs[i], refs[i + 1]
    i += 2
    beta_ref = refs[i] if has_beta else None
    i += has_beta
    outs = refs[i:]
    rows, cols, mask = _tile(m, n, bm, bn)
    x = _load(x_ref, rows, cols, mask)
    rmask, cmask = rows[:, 0] < m, cols[0] < n
    if has_mean:
        x = x - pltriton.load(mean_ref.at[rows[:, 0]], mask=rmask, other=0.0)[:, None]
    g = pltriton.load(gamma_ref.at[cols[0]], mask=cmask, other=0.0).astype(jnp.float32)
    g = 1.0 + g if zero_centered else g
    # the reference's order: (x - mean) * rstd * gamma (+ beta), in fp32, then rounded to x's dtype
    y = x * pltriton.load(rstd_ref.at[rows[:, 0]], mask=rmask, other=0.0)[:, None] * g[None, :]
    if has_beta:
        y = y + pltriton.load(beta_ref.at[cols[0]], mask=cmask, other=0.0).astype(jnp.float32)[None, :]
    y = y.astype(x_ref.dtype).astype(jnp.float32)
    _tile_amax([y], mask, outs[-1], gn)
    q = C.saturate(y, scale_ref[0], out_dtype)
    pltriton.store(outs[0].at[rows, cols], q, mask=mask)
    pltriton.store(outs[1].at[cols, rows], q, mask=mask)


@lower_once(static_argnames=("out_dtype", "zero_centered_gamma", "interpret", "block_m", "block_n", "num_warps",
                             "num_stages"))
def norm_cast_transpose(x, mean, rstd, gamma, beta, scale, *, out_dtype, zero_centered_gamma=False, interpret=None,
                        block_m=128, block_n=64, num_warps=None, num_stages=1):
    """x [M, N] (bf16 / fp16 / fp32); mean [M] fp32 (LayerNorm) or None (RMSNorm); rstd [M] fp32; gamma [N];
    beta [N] or None; scale an fp32 scalar. y = ((x - mean) * rstd * gamma' + beta) in fp32, rounded to x's dtype
    (gamma' = 1 + gamma when zero_centered_gamma): what pallas_kernels/norms/reference.apply_stats stores.
    Returns (y_q [M, N], y_qT [N, M], amax of |y|): the norm's output goes straight to FP8, never to memory."""
    where = "norm_cast_transpose"
    C.check_common(where, out_dtype=out_dtype, arrays=[("x", x)])
    if x.ndim != 2:
        raise ValueError(f"{where}: x must be 2-D [M, N]; got shape {tuple(x.shape)}.")
    m, n = x.shape
    for name, a, size in (("mean", mean, m), ("rstd", rstd, m), ("gamma", gamma, n), ("beta", beta, n)):
        if a is not None and tuple(a.shape) != (size,):
            raise ValueError(f"{where}: {name} has shape {tuple(a.shape)}; expected ({size},) for x {tuple(x.shape)}.")
    args = (x, C.scale_array(scale)) + tuple(jnp.asarray(a, jnp.float32) for a in (mean, rstd) if a is not None)
    args += tuple(a for a in (gamma, beta) if a is not None)
    kernel = functools.partial(_norm_cast_t_kernel, m=m, n=n, has_mean=mean is not None, has_beta=beta is not None,
                               zero_centered=zero_centered_gamma, out_dtype=out_dtype)
    out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((n, m), out_dtype)]
    (q, qt), amax = _launch(where, kernel, args, out_shape, m, n, block_m, block_n, num_warps, num_stages, interpret,
                            "te_fp8_norm_cast_transpose")
    return q, qt, amax
