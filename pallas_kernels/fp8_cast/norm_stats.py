"""LayerNorm / RMSNorm with its row statistics, cast to FP8 with its transpose, in one kernel.

    norm_stats_cast_transpose(x, gamma, beta, scale, rms=..., epsilon=...)
        x [M, N] -> (y_q [M, N], y_qT [N, M], amax of |y|, mean [M] f32 or None (RMSNorm), rstd [M] f32)

y = (x - mean) * rstd * gamma' (+ beta) in fp32, rounded to x's dtype, cast with common.saturate: the values
kernels.norm_cast_transpose writes from statistics computed outside (pallas_kernels/norms/reference.layernorm_fwd /
rmsnorm_fwd: mean, then the mean square of x - mean; for RMSNorm the mean square of x). Here the statistics are
computed in the kernel, so the input is read from memory once instead of twice (an XLA row reduction, then the
cast). They are the same sums taken in another order: rstd may differ from XLA's in its last bits, and then a y
that sits on a rounding boundary moves by one unit of x's dtype.

One program per block_m rows. It walks the row in block_n-column chunks: once (RMSNorm) or twice (LayerNorm:
the mean, then the centred variance) for the statistics, then once more to normalize and cast. The rereads come
from L2 (block_m x N elements per program). With block_n = N (one chunk) the row block is read once and kept in
registers (few rows per program: block_m x N fp32 values over the program's threads). The transposed output is
written from the same registers (addressing [col, row], as kernels.py does), block_m bytes contiguous per column.
Needs N % block_n == 0 (the caller picks block_n); any M (masked). block_m, block_n powers of two.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import default_interpret, pl, pltriton, triton_params
from .._lower_once import lower_once
from .._shapes import next_pow2 as _next_pow2
from . import common as C


def _kernel(*refs, m, n, rms, eps, zero_centered, has_beta, out_dtype, bm, bn):
    refs = list(refs)
    x_ref, scale_ref, g_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_beta else None
    q_ref, qt_ref = refs.pop(0), refs.pop(0)
    mean_ref = None if rms else refs.pop(0)
    rstd_ref, amax_ref = refs
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    rmask = rows < m
    tile_mask = jnp.broadcast_to(rmask[:, None], (bm, bn))
    n_chunks = n // bn

    def cols_of(j):
        return j * bn + jnp.arange(bn)

    def load(j):
        c = cols_of(j)
        return pltriton.load(x_ref.at[rows[:, None], c[None, :]], mask=tile_mask, other=0.0).astype(jnp.float32)

    whole = load(0) if n_chunks == 1 else None  # one chunk spans the row: read it once, keep it in registers

    def chunk(j):
        return whole if n_chunks == 1 else load(j)

    def row_sum(f):
        if n_chunks == 1:
            return jnp.sum(f(whole), axis=1)
        return lax.fori_loop(0, n_chunks, lambda j, s: s + jnp.sum(f(load(j)), axis=1), jnp.zeros((bm,), jnp.float32))

    if rms:
        mean = None
        var = row_sum(lambda v: v * v) / n
    else:
        mean = row_sum(lambda v: v) / n
        var = row_sum(lambda v: (v - mean[:, None]) ** 2) / n
    rstd = lax.rsqrt(var + eps)
    scale = scale_ref[0]

    def cast(j, amax):
        c = cols_of(j)
        xc = chunk(j) if rms else chunk(j) - mean[:, None]
        g = pltriton.load(g_ref.at[c]).astype(jnp.float32)
        g = 1.0 + g if zero_centered else g
        y = xc * rstd[:, None] * g[None, :]  # the reference's order
        if has_beta:
            y = y + pltriton.load(b_ref.at[c]).astype(jnp.float32)[None, :]
        y = y.astype(x_ref.dtype).astype(jnp.float32)
        amax = jnp.maximum(amax, jnp.max(jnp.where(tile_mask, C.abs_for_amax(y), 0.0)))
        q = C.saturate(y, scale, out_dtype)
        pltriton.store(q_ref.at[rows[:, None], c[None, :]], q, mask=tile_mask)
        pltriton.store(qt_ref.at[c[None, :], rows[:, None]], q, mask=tile_mask)
        return amax

    amax_ref[pl.program_id(0)] = (cast(0, jnp.float32(0.0)) if n_chunks == 1 else
                                  lax.fori_loop(0, n_chunks, cast, jnp.float32(0.0)))
    if not rms:
        pltriton.store(mean_ref.at[rows], mean, mask=rmask)
    pltriton.store(rstd_ref.at[rows], rstd, mask=rmask)


@lower_once(static_argnames=("rms", "epsilon", "zero_centered_gamma", "out_dtype", "interpret", "block_m", "block_n",
                             "num_warps", "num_stages"))
def norm_stats_cast_transpose(x, gamma, beta, scale, *, rms: bool, epsilon: float, out_dtype,
                              zero_centered_gamma: bool = False, interpret=None, block_m: int = 32,
                              block_n: int = 256, num_warps=None, num_stages: int = 1):
    """x [M, N] (bf16 / fp16 / fp32); gamma [N]; beta [N] or None (RMSNorm takes none); scale an fp32 scalar.
    Returns (y_q [M, N], y_qT [N, M], amax of |y|, mean [M] f32 or None (rms), rstd [M] f32)."""
    where = "norm_stats_cast_transpose"
    C.check_common(where, out_dtype=out_dtype, arrays=[("x", x)])
    if x.ndim != 2:
        raise ValueError(f"{where}: x must be 2-D [M, N]; got shape {tuple(x.shape)}.")
    m, n = x.shape
    if rms and beta is not None:
        raise ValueError(f"{where}: RMSNorm takes no beta.")
    for name, a in (("gamma", gamma), ("beta", beta)):
        if a is not None and tuple(a.shape) != (n,):
            raise ValueError(f"{where}: {name} has shape {tuple(a.shape)}; expected ({n},) for x {tuple(x.shape)}.")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(b, int) or b < 1 or b & (b - 1):
            raise ValueError(f"{where}: {name}={b!r} must be a power of two.")
    bn = min(block_n, n)
    if bn & (bn - 1):
        raise ValueError(f"{where}: x {tuple(x.shape)} has rows of {n}, at most block_n={block_n}, so one chunk would "
                         f"span a row, and {n} is not a power of two. Fix: a power-of-two block_n that divides {n}, "
                         f"or the two-pass path (norm_cast_transpose).")
    if n % bn:
        raise ValueError(f"{where}: the row length {n} is not a multiple of block_n={bn}. Fix: a block_n that "
                         f"divides it (a power of two), or the two-pass path (norm_cast_transpose).")
    if m * n >= 2 ** 31:
        raise ValueError(f"{where}: x of shape {tuple(x.shape)} has 2**31 or more elements; split it.")
    bm = min(block_m, max(16, _next_pow2(m)))
    gm = pl.cdiv(m, bm)
    kernel = functools.partial(_kernel, m=m, n=n, rms=bool(rms), eps=float(epsilon),
                               zero_centered=bool(zero_centered_gamma), has_beta=beta is not None,
                               out_dtype=out_dtype, bm=bm, bn=bn)
    out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((n, m), out_dtype)]
    out_shape += [] if rms else [jax.ShapeDtypeStruct((m,), jnp.float32)]
    out_shape += [jax.ShapeDtypeStruct((m,), jnp.float32), jax.ShapeDtypeStruct((gm,), jnp.float32)]
    args = [x, C.scale_array(scale), gamma] + ([] if beta is None else [beta])
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(gm,),
        compiler_params=triton_params(num_warps or (8 if bm * bn >= 8192 else 4), num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name="te_fp8_norm_stats_cast_transpose",
    )(*args)
    q, qt = outs[0], outs[1]
    mean = None if rms else outs[2]
    rstd, partials = outs[-2], outs[-1]
    # as kernels._launch: the barrier ties the amax to the outputs, so the partials are reduced and freed early
    q, qt, rstd, amax = jax.lax.optimization_barrier((q, qt, rstd, jnp.max(partials)))
    return q, qt, amax, mean, rstd
