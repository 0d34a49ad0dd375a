"""Block quantization in one pass (Triton-lowered Pallas): an array and its transpose in FP8 with the block scales
the block-scaled GEMM takes.

    block_cast_transpose(x [R, C], *, out_dtype, tiles="rows" | "square", write="both" | "q" | "qt")
        -> (q [R, C], q_scales [C/128, R], qt [C, R], qt_scales [R/128, C])
        write: which layouts the kernel writes; the others come back as None (a weight's forward needs only qt,
        its backward only q: writing one saves a byte per element).
    "rows":   1x128 tiles: q has one scale per row and 128-wide column block, qt (= x^T's 1x128 tiles) one per
              column and 128-tall row block (activations and gradients: the GEMM's operand and its wgrad operand);
    "square": 128x128 tiles, one scale per tile, repeated over its rows in both layouts (weights).
Each scale is amax / fp8_max (1 for an all-zero tile); q = saturate(x * (1 / scale)), as reference.quantize_blocks,
whose values it reproduces. One program per 128x128 tile reads x once and writes both copies and their scales.
R % 128 == C % 128 == 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._compat import default_interpret, pl, triton_params
from .._lower_once import lower_once
from .reference import BLOCK_K

_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
TILES = ("rows", "square")


def quantize_tile(x, out_dtype, square: bool = False):
    """x [128, 128] fp32 -> (q = x in 1x128 row tiles, its per-row scales [128], qt = x^T in 1x128 tiles (x's
    column tiles), its per-column scales [128]); square: one scale for the whole tile, repeated in both.
    q = x * (1 / scale), as reference.quantize_blocks: one multiply per element (on the H100 a division per
    element held these kernels at 1.1-1.4 TB/s; benchmarks/results/fp8_block_cast_h100.md)."""
    fmax = float(jnp.finfo(out_dtype).max)
    ax = jnp.abs(x)
    if square:
        amax = jnp.max(ax)
        s = jnp.where(amax > 0, amax / fmax, 1.0)
        s_rows = jnp.full((x.shape[0],), s, jnp.float32)
        s_cols = jnp.full((x.shape[1],), s, jnp.float32)
    else:
        a_rows, a_cols = jnp.max(ax, axis=1), jnp.max(ax, axis=0)
        s_rows = jnp.where(a_rows > 0, a_rows / fmax, 1.0)
        s_cols = jnp.where(a_cols > 0, a_cols / fmax, 1.0)
    q = jnp.clip(x * (1.0 / s_rows)[:, None], -fmax, fmax).astype(out_dtype)
    qt = jnp.clip(x * (1.0 / s_cols)[None, :], -fmax, fmax).astype(out_dtype).T
    return q, s_rows, qt, s_cols


def _kernel(x_ref, *outs, out_dtype, square, write):
    q, s_rows, qt, s_cols = quantize_tile(x_ref[...].astype(jnp.float32), out_dtype, square)
    outs = list(outs)
    if write in ("both", "q"):
        q_ref, qs_ref = outs.pop(0), outs.pop(0)
        q_ref[...] = q
        qs_ref[...] = s_rows[None, :]
    if write in ("both", "qt"):
        qt_ref, qts_ref = outs
        qt_ref[...] = qt
        qts_ref[...] = s_cols[None, :]


WRITES = ("both", "q", "qt")


@lower_once(static_argnames=("out_dtype", "tiles", "interpret", "num_warps", "write"))
def block_cast_transpose(x, *, out_dtype, tiles: str = "rows", interpret: bool | None = None, num_warps: int = 8,
                         write: str = "both"):
    """See the module docstring."""
    if tiles not in TILES:
        raise ValueError(f"block_cast_transpose: tiles={tiles!r} must be one of {TILES}.")
    if write not in WRITES:
        raise ValueError(f"block_cast_transpose: write={write!r} must be one of {WRITES}.")
    if jnp.dtype(out_dtype) not in _FP8:
        raise ValueError(f"block_cast_transpose: out_dtype={out_dtype!r} must be float8_e4m3fn or float8_e5m2.")
    if x.ndim != 2 or x.shape[0] % BLOCK_K or x.shape[1] % BLOCK_K:
        raise ValueError(f"block_cast_transpose: x must be [R, C] with R and C multiples of {BLOCK_K}; got shape "
                         f"{tuple(x.shape)}.")
    r, c = x.shape
    b = BLOCK_K
    tile = pl.BlockSpec((b, b), lambda i, j: (i, j))
    shapes, specs = [], []
    if write in ("both", "q"):
        shapes += [jax.ShapeDtypeStruct((r, c), out_dtype), jax.ShapeDtypeStruct((c // b, r), jnp.float32)]
        specs += [tile, pl.BlockSpec((1, b), lambda i, j: (j, i))]
    if write in ("both", "qt"):
        shapes += [jax.ShapeDtypeStruct((c, r), out_dtype), jax.ShapeDtypeStruct((r // b, c), jnp.float32)]
        specs += [pl.BlockSpec((b, b), lambda i, j: (j, i)), pl.BlockSpec((1, b), lambda i, j: (i, j))]
    outs = pl.pallas_call(
        functools.partial(_kernel, out_dtype=jnp.dtype(out_dtype), square=tiles == "square", write=write),
        out_shape=shapes,
        grid=(r // b, c // b),
        in_specs=[tile],
        out_specs=specs,
        compiler_params=triton_params(num_warps, 1),
        interpret=default_interpret() if interpret is None else interpret,
        name="te_fp8_block_cast_transpose",
    )(x)
    if write == "q":
        return outs[0], outs[1], None, None
    if write == "qt":
        return None, None, outs[0], outs[1]
    return tuple(outs)
