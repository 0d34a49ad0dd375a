"""Several arrays with the same rows cast to FP8 in one kernel, their transposes stacked in one output.

    cast_transpose_many(xs, scales)     xs: [M, N_i] each -> ((x_q_i [M, N_i] each) or None, x_qT [sum N_i, M],
                                        (amax of |x_i| each))

x_qT is what one GEMM over the stacked operand reads: the query and key/value projections that share their input
(their weights, forward) or their transposed output gradients (the weight gradients' GEMM) as one GEMM, without
the concatenate XLA's dot merger otherwise copies the separate casts into. Each x_i keeps its own scale and amax.
The values are kernels.cast_transpose's for each x_i (common.saturate after the optional rounding to round_to).

One program per (block_m x block_n) tile of the [M, sum N_i] index space; a tile belongs to one x_i (every N_i a
multiple of block_n: `many_block` picks it), which the program takes by its column. block_m, block_n powers of
two; any M (masked).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._compat import default_interpret, pl, pltriton, triton_params
from .._lower_once import lower_once
from .._shapes import next_pow2 as _next_pow2
from . import common as C


def many_block(widths, block_n: int) -> int | None:
    """The column tile (a power of two up to block_n, at least 16) that divides every width, or None."""
    bn = block_n
    while bn >= 16:
        if all(w % bn == 0 for w in widths):
            return bn
        bn //= 2
    return None


def _kernel(*refs, k, m, widths, round_to, out_dtype, write_q, bm, bn, gn):
    xs, scale_ref = refs[:k], refs[k]
    outs = refs[k + 1:]
    qs = outs[:k] if write_q else ()
    qt_ref, amax_ref = outs[-2], outs[-1]
    i0, j = pl.program_id(0), pl.program_id(1)
    rows = i0 * bm + jnp.arange(bm)
    mask = jnp.broadcast_to((rows < m)[:, None], (bm, bn))
    start = 0  # the first column tile of x_i
    for i, w in enumerate(widths):
        tiles = w // bn

        @pl.when((j >= start) & (j < start + tiles))
        def _(i=i, start=start):
            cols = (j - start) * bn + jnp.arange(bn)
            x = pltriton.load(xs[i].at[rows[:, None], cols[None, :]], mask=mask, other=0.0).astype(jnp.float32)
            x = C.maybe_round(x, round_to)
            amax_ref[i0 * gn + j] = jnp.max(jnp.where(mask, C.abs_for_amax(x), 0.0))
            q = C.saturate(x, scale_ref[i], out_dtype)
            if write_q:
                pltriton.store(qs[i].at[rows[:, None], cols[None, :]], q, mask=mask)
            pltriton.store(qt_ref.at[(start * bn + cols)[None, :], rows[:, None]], q, mask=mask)

        start += tiles


@lower_once(static_argnames=("out_dtype", "write_q", "round_to", "interpret", "block_m", "block_n", "num_warps",
                             "num_stages"))
def cast_transpose_many(xs, scales, *, out_dtype, write_q: bool = True, round_to=None, interpret=None,
                        block_m: int = 64, block_n: int = 64, num_warps=None, num_stages: int = 1):
    """xs: a tuple of [M, N_i] arrays (one dtype); scales: one fp32 scalar each. Returns (a tuple of x_q_i, or None
    when not write_q; x_qT [sum N_i, M]; a tuple of each x_i's amax)."""
    where = "cast_transpose_many"
    xs = tuple(xs)
    if len(xs) < 1 or len(scales) != len(xs):
        raise ValueError(f"{where}: {len(xs)} arrays and {len(scales)} scales; expected one scale per array.")
    for i, x in enumerate(xs):
        C.check_common(where, out_dtype=out_dtype, round_to=round_to, arrays=[(f"xs[{i}]", x)])
        if x.ndim != 2 or x.shape[0] != xs[0].shape[0] or x.dtype != xs[0].dtype:
            raise ValueError(f"{where}: xs[{i}] has shape {tuple(x.shape)} and dtype {x.dtype}; expected [M, N] with "
                             f"M = {xs[0].shape[0]} and dtype {xs[0].dtype} (xs[0]'s).")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(b, int) or b < 1 or b & (b - 1):
            raise ValueError(f"{where}: {name}={b!r} must be a power of two.")
    m, widths = xs[0].shape[0], tuple(x.shape[1] for x in xs)
    bn = many_block(widths, block_n)
    if bn is None:
        raise ValueError(f"{where}: widths {list(widths)} share no column tile of 16 to {block_n} (a power of two "
                         f"dividing each). Fix: cast them separately (kernels.cast_transpose).")
    total = sum(widths)
    if m * total >= 2 ** 31:
        raise ValueError(f"{where}: [{m}, {total}] has 2**31 or more elements; split it.")
    bm = min(block_m, max(16, _next_pow2(m)))
    gm, gn = pl.cdiv(m, bm), total // bn
    kernel = functools.partial(_kernel, k=len(xs), m=m, widths=widths, round_to=round_to, out_dtype=out_dtype,
                               write_q=write_q, bm=bm, bn=bn, gn=gn)
    out_shape = [jax.ShapeDtypeStruct((m, w), out_dtype) for w in widths] if write_q else []
    out_shape += [jax.ShapeDtypeStruct((total, m), out_dtype), jax.ShapeDtypeStruct((gm * gn,), jnp.float32)]
    scale_vec = jnp.stack([jnp.asarray(s, jnp.float32).reshape(()) for s in scales])
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(gm, gn),
        compiler_params=triton_params(num_warps or (8 if bm * bn >= 8192 else 4 if bm * bn >= 2048 else 2),
                                      num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name="te_fp8_cast_transpose_many",
    )(*xs, scale_vec)
    parts = outs[-1].reshape(gm, gn)
    amaxes, start = [], 0
    for w in widths:
        amaxes.append(jnp.max(parts[:, start:start + w // bn]))
        start += w // bn
    # as kernels._launch: the barrier ties the amaxes to the outputs, so the partials are reduced and freed early
    res = jax.lax.optimization_barrier((tuple(outs[:-1]), tuple(amaxes)))
    cast_outs, amaxes = res
    qs = tuple(cast_outs[:-1]) if write_q else None
    return qs, cast_outs[-1], amaxes
