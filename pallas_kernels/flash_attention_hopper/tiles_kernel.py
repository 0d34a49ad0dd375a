"""Document-aligned tiles and their padded marks in one Triton-lowered Pallas kernel (aligned_tiles, kernel=True).

    run_tiles_marks(seg, pos, tile, n_max, *, interpret=None)
        -> (starts [B, n_max], index [B, S], rows [B, n_max, 2], seg_t [B, n_max * tile], pos_t [B, n_max * tile])
        seg, pos   [B, S] int32: the tokens' segment ids (0: padding) and positions; S <= MAX_TOKENS
        starts, index, rows   aligned_tiles.run_tiles(seg, tile, n_max)'s
        seg_t, pos_t          the tiles' padded layout (aligned_tiles' _tile_marks): row index[b, i] holds token
                              i's marks, every other row (0, 0)

The same values as XLA's run_tiles and _tile_marks (the tests compare them), from one program per batch row that
holds the row's tokens in vectors (S up to MAX_TOKENS, the next power of two of lanes):
1. runs: a token opens a run where its segment id differs from the token before; each run's number is a cumulative
   sum, and its first token comes back through a scratch row (a scatter, a barrier, a gather). Pallas' Triton
   lowering has cumsum but no cummax, which XLA uses for this.
2. tiles: a token opens a tile where it opens a run or sits a multiple of `tile` rows after its run's start rounded
   down to ROW_ALIGN; its tile is the cumulative count of openings. More than n_max tiles: the global grid.
3. each tile's (start, lo) from its opening token (scattered), hi from the next tile's opening (or the row's end);
   the padded marks scattered to index over rows first set to 0.
XLA runs the same as a dozen small kernels per tile size (cumulative max and sum trees, scatters, gathers).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._compat import default_interpret, pl, pltriton, triton_params

#: The most tokens a batch row may have for the kernel (its vectors hold the row; longer rows: XLA's run_tiles).
MAX_TOKENS = 1 << 15

#: Rows of the padded layout set to 0 per store.
_CLEAR = 4096

#: Where a masked lane of a scatter points: past every array (the GPU does not store it; the interpreter, which
#: stores every lane, drops it there instead of writing an old value over another lane's).
_NOWHERE = 1 << 24


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _kernel(seg_ref, pos_ref, index_ref, fields_ref, seg_t_ref, pos_t_ref, scratch_ref, *, S: int, tile: int,
            n_max: int, align: int, sync: bool):
    barrier = pltriton.debug_barrier if sync else (lambda: None)  # the interpreter runs in program order
    b = pl.program_id(0)
    lanes, tpad = _pow2(S), _pow2(n_max + 1)
    i = jnp.arange(lanes, dtype=jnp.int32)
    valid = i < S
    seg = pltriton.load(seg_ref.at[b, i], mask=valid, other=0)
    prev = pltriton.load(seg_ref.at[b, i - 1], mask=valid & (i > 0), other=0)
    opens_run = valid & ((i == 0) | (seg != prev))
    run = jnp.cumsum(opens_run.astype(jnp.int32)) - 1
    # 1. each run's first token by its number (scratch row: [0, lanes) run starts, then two tile rows)
    away = lambda hit, to: jnp.where(hit, to, _NOWHERE)
    pltriton.store(scratch_ref.at[b, away(opens_run, run)], i, mask=opens_run)
    barrier()
    run_start = pltriton.load(scratch_ref.at[b, jnp.maximum(run, 0)], mask=valid, other=0)
    # 2. tiles from each run's start rounded down to `align` rows, every `tile` rows
    in_run = (i - run_start // align * align) % tile
    opens = opens_run | (valid & (in_run == 0))
    total = jnp.sum(opens.astype(jnp.int32))
    fits = total <= n_max
    tile_id = jnp.where(fits, jnp.cumsum(opens.astype(jnp.int32)) - 1, i // tile)
    in_tile = jnp.where(fits, in_run, i % tile)
    opens = valid & jnp.where(fits, opens, in_tile == 0)
    total = jnp.where(fits, total, (S + tile - 1) // tile)
    index = tile_id * tile + in_tile
    pltriton.store(index_ref.at[b, away(valid, i)], index, mask=valid)
    # 3. each tile's opening token (its row) and lo, scattered; hi = lo + the tokens up to the next opening
    first_row, lo_row = lanes, lanes + tpad
    pltriton.store(scratch_ref.at[b, away(opens, first_row + tile_id)], i, mask=opens)
    pltriton.store(scratch_ref.at[b, away(opens, lo_row + tile_id)], in_tile, mask=opens)
    for c in range(0, n_max * tile, _CLEAR):  # the padded layout: 0 where no token lands
        rows = c + jnp.arange(_CLEAR, dtype=jnp.int32)
        zeros = jnp.zeros((_CLEAR,), jnp.int32)
        rows = away(rows < n_max * tile, rows)
        pltriton.store(seg_t_ref.at[b, rows], zeros, mask=rows < n_max * tile)
        pltriton.store(pos_t_ref.at[b, rows], zeros, mask=rows < n_max * tile)
    barrier()
    pltriton.store(seg_t_ref.at[b, away(valid, index)], seg, mask=valid)
    pltriton.store(pos_t_ref.at[b, away(valid, index)], pltriton.load(pos_ref.at[b, i], mask=valid, other=0),
                   mask=valid)
    t = jnp.arange(tpad, dtype=jnp.int32)
    used = t < total
    first = pltriton.load(scratch_ref.at[b, first_row + t], mask=used, other=0)
    nxt = jnp.where(t + 1 < total, pltriton.load(scratch_ref.at[b, first_row + t + 1], mask=t + 1 < total,
                                                  other=0), S)
    lo = pltriton.load(scratch_ref.at[b, lo_row + t], mask=used, other=0)
    start, hi = jnp.where(used, first - lo, 0), jnp.where(used, lo + nxt - first, 0)
    lo = jnp.where(used, lo, 0)
    in_range = t < n_max
    for f, v in enumerate((start, lo, hi)):
        pltriton.store(fields_ref.at[b, away(in_range, t * 3 + f)], v, mask=in_range)


def run_tiles_marks(seg, pos, tile: int, n_max: int, *, align: int, interpret=None):
    """See the module docstring; align: aligned_tiles.ROW_ALIGN (passed in: aligned_tiles imports this module)."""
    B, S = seg.shape
    if S > MAX_TOKENS:
        raise ValueError(f"run_tiles_marks: {S} tokens per row; the kernel takes at most {MAX_TOKENS} (use "
                         f"aligned_tiles.run_tiles).")
    if pos.shape != seg.shape:
        raise ValueError(f"run_tiles_marks: pos has shape {tuple(pos.shape)}; expected seg's {tuple(seg.shape)}.")
    if n_max * tile < S:
        raise ValueError(f"run_tiles_marks: {n_max} tiles of {tile} cannot hold {S} tokens")
    if tile % align or S % align:
        raise ValueError(f"run_tiles_marks: tile {tile} and length {S} must be multiples of {align} rows")
    interpret = default_interpret() if interpret is None else interpret
    lanes, tpad = _pow2(S), _pow2(n_max + 1)
    i32 = jax.ShapeDtypeStruct
    index, fields, seg_t, pos_t, _ = pl.pallas_call(
        functools.partial(_kernel, S=S, tile=tile, n_max=n_max, align=align, sync=not interpret),
        out_shape=(i32((B, S), jnp.int32), i32((B, n_max * 3), jnp.int32), i32((B, n_max * tile), jnp.int32),
                   i32((B, n_max * tile), jnp.int32), i32((B, lanes + 2 * tpad), jnp.int32)),
        grid=(B,),
        compiler_params=triton_params(8 if lanes <= 4096 else 32, 1),
        interpret=interpret,
        name="te_jax_attn_aligned_tiles",
    )(seg.astype(jnp.int32), pos.astype(jnp.int32))
    fields = fields.reshape(B, n_max, 3)
    return fields[..., 0], index, fields[..., 1:], seg_t, pos_t
