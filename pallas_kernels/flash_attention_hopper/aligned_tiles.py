"""Document-aligned tiles for the Hopper data-mask forward (packed documents: thd, segment ids).

On the global grid a query tile of 2 x block_q rows that straddles a document's end computes its rows against
both documents' keys, and a key block that straddles a document's start is a partial tile for every query tile of
that document: on 11 documents in 16k tokens a quarter of the computed pairs are outside the visible area.  Here
the tiles start where the documents do (FlashAttention-3's varlen tiling):

    run_tiles(seg, tile, n_max) -> (starts [B, n_max], index [B, S], n_tiles [B])
        tiles of `tile` tokens for every run of equal segment ids (a document, or a padding run): the run's first
        tile starts at its first token rounded down to a multiple of ROW_ALIGN, the next ones every `tile` rows
        after it; index: each token's row in the tiles' padded layout (tile number * tile + offset).  The rows of a
        first tile before its run's first token belong to the run before (and to that run's tile): they are not the
        tile's.  A batch row that would need more than n_max tiles keeps the global grid (correct, not aligned).
    AlignedTiles                     the forward's tables on those tiles (arrays, traced):
        q_rows [B, T]                each query tile's first row in q, in units of ROW_ALIGN rows
                                     (T = aligned_tile_count); -1 for a tile the row does not use (its CTA exits)
        qm [B, 2, T * tq]            the tiles' (segment id, position) rows; rows past a tile's run NO_SEGMENT
        km [B, 2, Tk * bkv]          the key blocks' rows; rows past a block's run segment 0 (padding)
        counts, blocks               data_mask.block_lists of every (query tile, key block) on these marks
        kv_rows [B, T, Tk]           the listed key blocks' first rows in k / v, in units of ROW_ALIGN (list order)
        out_index [B, S]             each query's row in the forward's padded output [B, T * tq, ...]
    aligned_tables(tables, rule, cfg) -> AlignedTiles    (XLA, from data_mask.MaskTables' marks)
    aligned_mask_tables(mask, cfg, ...) -> MaskTables     (data_mask.mask_tables with `aligned` in place of `fwd`)

The kernel loads Q and K/V at these rows (ROW_ALIGN * the table's value: Mosaic GPU must see that a TMA's row offset
is a multiple of the shared-memory tile's 8 rows; rows past the end read as zeros), reads the marks of the padded
layout, and writes O and lse to the padded layout; `gather_rows` puts them back in token order.
A tile's rows past its document, and a block's keys past its document, are padding in the marks, so they are never
counted as visible: the tiles inside a document are full, its diagonal ones compare positions only.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .data_mask import NO_SEGMENT, backward_tables, marks_only, mask_rule, tile_lists


#: Tiles start at multiples of this many rows (the swizzled shared-memory tiles' rows: Mosaic GPU's layout inference
#: must be able to prove a TMA copy's dynamic row offset divisible by them).
ROW_ALIGN = 8


class AlignedTiles(NamedTuple):
    q_rows: jax.Array
    qm: jax.Array
    km: jax.Array
    counts: jax.Array
    blocks: jax.Array
    kv_rows: jax.Array
    out_index: jax.Array


def aligned_tile_count(length: int, tile: int) -> int:
    """T, the static number of aligned tiles of a batch row of `length` tokens: the global grid's n tiles plus room
    for max(4, n // 4) documents (each document adds at most one tile).  Rows with more documents than that keep
    the global grid (run_tiles)."""
    n = -(-length // tile)
    return n + max(4, n // 4)


def run_tiles(seg, tile: int, n_max: int):
    """(starts [B, n_max] int32, index [B, S] int32, n_tiles [B] int32) for segment ids seg [B, S]; see the module
    docstring.  Unused tiles start at row 0 and hold no token."""
    B, S = seg.shape
    if n_max * tile < S:
        raise ValueError(f"run_tiles: {n_max} tiles of {tile} cannot hold {S} tokens")
    if tile % ROW_ALIGN:
        raise ValueError(f"run_tiles: tile {tile} is not a multiple of {ROW_ALIGN} rows")
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    new_run = jnp.concatenate([jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run_start = lax.cummax(jnp.where(new_run, idx, 0), axis=1)
    in_tile = (idx - run_start // ROW_ALIGN * ROW_ALIGN) % tile  # tiles from the run's start, rounded down
    first = new_run | (in_tile == 0)  # the token opens a tile
    tile_id = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1
    fits = tile_id[:, -1] < n_max
    tile_id = jnp.where(fits[:, None], tile_id, idx // tile)
    in_tile = jnp.where(fits[:, None], in_tile, idx % tile)
    first = jnp.where(fits[:, None], first, in_tile == 0)
    index = tile_id * tile + in_tile
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    starts = jnp.zeros((B, n_max), jnp.int32).at[rows, jnp.where(first, tile_id, n_max)].set(idx - in_tile,
                                                                                              mode="drop")
    return starts, index, tile_id[:, -1] + 1


def _padded_marks(marks, index, size: int, fill_segment: int):
    """marks [B, 2, S] (segment id, position) scattered to the padded layout [B, 2, size] by index [B, S]; rows that
    hold no token get (fill_segment, 0)."""
    B = marks.shape[0]
    out = jnp.zeros((B, 2, size), jnp.int32).at[:, 0].set(fill_segment)
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    out = out.at[rows, 0, index].set(marks[:, 0])
    return out.at[rows, 1, index].set(marks[:, 1])


def aligned_tables(tables, rule, cfg) -> AlignedTiles:
    """The forward's AlignedTiles from data_mask.MaskTables `tables` (their global marks; lengths multiples of the
    tiles) for rule (data_mask.MaskRule: the forward's partial groups) and config cfg."""
    tq, bkv = 2 * cfg.block_q, cfg.block_kv
    q_seg = jnp.where(tables.qm[:, 0] == NO_SEGMENT, 0, tables.qm[:, 0])
    k_seg = tables.km[:, 0]
    n_q, n_k = aligned_tile_count(q_seg.shape[1], tq), aligned_tile_count(k_seg.shape[1], bkv)
    q_rows, q_index, q_tiles = run_tiles(q_seg, tq, n_q)
    q_rows = jnp.where(jnp.arange(n_q) < q_tiles[:, None], q_rows, -ROW_ALIGN)  # unused tiles: row -1 (skipped)
    k_starts, k_index, _ = run_tiles(k_seg, bkv, n_k)
    qm = _padded_marks(tables.qm, q_index, n_q * tq, NO_SEGMENT)
    km = _padded_marks(tables.km, k_index, n_k * bkv, 0)
    qs = jnp.where(qm[:, 0] == NO_SEGMENT, 0, qm[:, 0])
    counts, blocks = tile_lists(qs, qm[:, 1], km[:, 0], km[:, 1], rule, tq, bkv)
    kv_rows = jnp.take_along_axis(jnp.broadcast_to(k_starts[:, None, :], blocks.shape), blocks, axis=-1)
    return AlignedTiles(q_rows // ROW_ALIGN, qm, km, counts, blocks, kv_rows // ROW_ALIGN, q_index)


def aligned_mask_tables(mask, cfg, *, backward: bool = True, segments: bool = True, split: bool = True):
    """data_mask.mask_tables with the forward on document-aligned tiles: MaskTables whose `aligned` holds this
    module's AlignedTiles and whose `fwd` is None (the backward's lists as mask_tables builds them)."""
    rule = mask_rule(mask, segments, split)
    t = marks_only(mask)
    t = t._replace(aligned=aligned_tables(t, rule, cfg))
    return backward_tables(t, rule, cfg) if backward else t


def gather_rows(out_padded, lse_padded, out_index):
    """(out [B, S, H, Dv], lse [B, H, S]) in token order from the forward's padded layout
    (out_padded [B, T * tq, H, Dv], lse_padded [B, H, T * tq]) by out_index [B, S]."""
    # one row gather per batch row. On the H100 XLA's gather of thd's 64 MiB output took 213-275 us either this way
    # or as take_along_axis: the reason auto leaves the aligned forward off (attention_masks_h100.md)
    out = jax.vmap(lambda o, i: o[i])(out_padded, out_index)
    lse = jax.vmap(lambda s, i: s[:, i])(lse_padded, out_index)
    return out, lse
