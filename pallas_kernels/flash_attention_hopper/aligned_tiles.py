"""Document-aligned tiles for the Hopper data-mask forward (packed documents: thd, segment ids).

On the global grid a query tile of 2 x block_q rows that straddles a document's end computes its rows against
both documents' keys, and a key block that straddles a document's start is a partial tile for every query tile of
that document: on 11 documents in 16k tokens a quarter of the computed pairs are outside the visible area.  Here
the tiles start where the documents do (FlashAttention-3's varlen tiling):

    run_tiles(seg, tile, n_max) -> (starts [B, n_max], index [B, S], rows [B, n_max, 2])
        tiles of `tile` tokens for every run of equal segment ids (a document, or a padding run): the run's first
        tile starts at its first token rounded down to a multiple of ROW_ALIGN, the next ones every `tile` rows
        after it; index: each token's row in the tiles' padded layout (tile number * tile + offset); rows: the
        rows [lo, hi) of each tile that hold its run's tokens.  The rows of a first tile before its run's first
        token belong to the run before (and to that run's tile), those of a last tile past its run's end to the
        run after.  A batch row that would need more than n_max tiles keeps the global grid (correct, not aligned).
    AlignedTiles                     a kernel's tables on those tiles (arrays, traced); the forward's (and dQ's)
                                     tiles are query tiles walking key blocks, dK/dV's (transposed) key tiles
                                     walking query blocks:
        tile_rows [B, T]             each tile's first row, in units of ROW_ALIGN rows (T = aligned_tile_count);
                                     -1 for a tile the row does not use (its CTA exits)
        qm [B, 2, Tq * tq]           the query tiles' (segment id, position) rows; rows past a tile's run NO_SEGMENT
        km [B, 2, Tk * tk]           the key tiles' rows; rows past a tile's run segment 0 (padding)
        counts, blocks               data_mask.block_lists of every (tile, block) on these marks
        block_rows [B, T, Tb]        the listed blocks' first rows, in units of ROW_ALIGN (list order)
        out_index [B, S]             each of the tiles' tokens' row in their padded layout (lse comes back by it)
        stores [B, T, 4]             how each tile stores its rows (store_plan): its whole ROW_ALIGN-row groups
                                     [lo, hi), and the (at most two) groups it shares with a neighbouring run, or -1
    aligned_tables(marks, rule, q_tile, kv_tile, transposed) -> AlignedTiles   (XLA, from the mask's marks)
    aligned_mask_tables(mask, cfg, ...) -> MaskTables     (data_mask.mask_tables with `aligned` in place of `fwd`)
    aligned_backward_tables(t, rule, cfg) -> MaskTables   (the backward kernels' tables on aligned tiles too)
    merge_shared_groups(out, shared, tile_rows, stores) -> out   (the shared groups summed into place)

The kernel loads Q and K/V at these rows (ROW_ALIGN * the table's value: Mosaic GPU must see that a TMA's row offset
is a multiple of the shared-memory tile's 8 rows; rows past the end read as zeros) and reads the marks of the padded
layout.  A tile's rows past its document, and a block's keys past its document, are padding in the marks, so they
are never counted as visible (the tiles inside a document are full, its diagonal ones compare positions only) and
their output rows come out exactly 0.  So the kernel stores O in token order: each group of ROW_ALIGN rows that
holds only the tile's own tokens by TMA in place; a group where a document starts or ends mid-group (its rows
split between two or more runs' tiles) goes to a small side buffer, and merge_shared_groups adds the tiles' copies
(the other runs' rows are zeros there, so the sum is exact).  lse goes to the padded layout (4 bytes a row: 32
bytes a group, below TMA's shared-memory alignment) and comes back by a gather (gather_row_values).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import aligned_merge
from .data_mask import (NO_SEGMENT, backward_rule, backward_tables, dkv_tiles, dq_tiles, lists_by_kernel,
                        marks_only, mask_rule, tile_lists, token_marks)


#: Tiles start at multiples of this many rows (the swizzled shared-memory tiles' rows: Mosaic GPU's layout inference
#: must be able to prove a TMA copy's dynamic row offset divisible by them).
ROW_ALIGN = 8


class AlignedTiles(NamedTuple):
    tile_rows: jax.Array
    qm: jax.Array
    km: jax.Array
    counts: jax.Array
    blocks: jax.Array
    block_rows: jax.Array
    out_index: jax.Array
    stores: jax.Array

    def kernel_args(self):
        """The tables a backward kernel takes, in its order: marks, lists, then the rows and store plans."""
        return (self.qm, self.km, self.counts, self.blocks, self.tile_rows, self.block_rows, self.stores)


def aligned_tile_count(length: int, tile: int) -> int:
    """T, the static number of aligned tiles of a batch row of `length` tokens: the global grid's n tiles plus room
    for max(4, n // 4) documents (each document adds at most one tile).  Rows with more documents than that keep
    the global grid (run_tiles)."""
    n = -(-length // tile)
    return n + max(4, n // 4)


def run_tiles(seg, tile: int, n_max: int):
    """(starts [B, n_max] int32, index [B, S] int32, rows [B, n_max, 2] int32) for segment ids seg [B, S] (S a
    multiple of ROW_ALIGN); see the module docstring.  A tile that holds no token has hi <= lo and start 0."""
    B, S = seg.shape
    if n_max * tile < S:
        raise ValueError(f"run_tiles: {n_max} tiles of {tile} cannot hold {S} tokens")
    if tile % ROW_ALIGN or S % ROW_ALIGN:
        raise ValueError(f"run_tiles: tile {tile} and length {S} must be multiples of {ROW_ALIGN} rows")
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    new_run = jnp.concatenate([jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run_start = lax.cummax(jnp.where(new_run, idx, 0), axis=1)
    in_tile = (idx - run_start // ROW_ALIGN * ROW_ALIGN) % tile  # tiles from the run's start, rounded down
    first = new_run | (in_tile == 0)  # the token opens a tile
    tile_id = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1
    fits = (tile_id[:, -1] < n_max)[:, None]
    tile_id = jnp.where(fits, tile_id, idx // tile)
    in_tile = jnp.where(fits, in_tile, idx % tile)
    # each tile's (start, lo) from its first token, hi from its last (set-scatters: the other tokens are dropped);
    # a tile without a token keeps (0, 0, 0)
    edge = jnp.ones((B, 1), bool)
    change = tile_id[:, 1:] != tile_id[:, :-1]
    opens, closes = jnp.concatenate([edge, change], axis=1), jnp.concatenate([change, edge], axis=1)
    # one scatter into [B, n_max * 3] (start, lo, hi): a token writes the fields of its tile it opens or closes
    b = jnp.arange(B, dtype=jnp.int32)[:, None]
    at = lambda hit, field: jnp.where(hit, tile_id * 3 + field, 3 * n_max)
    where = jnp.concatenate([at(opens, 0), at(opens, 1), at(closes, 2)], axis=1)
    fields = jnp.zeros((B, n_max * 3), jnp.int32).at[b, where].set(
        jnp.concatenate([idx - in_tile, in_tile, in_tile + 1], axis=1), mode="drop").reshape(B, n_max, 3)
    return fields[..., 0], tile_id * tile + in_tile, fields[..., 1:]


def store_plan(rows):
    """[B, T, 4] int32 from run_tiles' rows [B, T, 2] ([lo, hi) of each tile's tokens): (lo_g, hi_g, shared_0,
    shared_1) in ROW_ALIGN-row groups of the tile: the groups [lo_g, hi_g) hold only its tokens (stored in place);
    shared_0 / shared_1 (-1: none) are the first / last group it touches where that group also holds another run's
    tokens (a document starting or ending mid-group; one group can be both, then shared_1 is -1)."""
    g = ROW_ALIGN
    lo, hi = rows[..., 0], rows[..., 1]
    used = hi > lo
    g0, g1 = lo // g, (hi - 1) // g
    first_shared = used & ((lo % g != 0) | (hi < g0 * g + g))
    last_shared = used & (g1 != g0) & (hi % g != 0)
    whole_lo = jnp.where(used, g0 + first_shared, 0)
    whole_hi = jnp.where(used, g1 + 1 - last_shared, 0)
    return jnp.stack([whole_lo, whole_hi, jnp.where(first_shared, g0, -1), jnp.where(last_shared, g1, -1)],
                     axis=-1).astype(jnp.int32)


def _tile_marks(seg, pos, starts, tile: int, keep):
    """The padded layout's (segment ids, positions) [B, T * tile] from the tokens' [B, S]: row r of tile t holds
    token starts[b, t] + r's where keep[b, t, r], else (0, 0); one gather."""
    B, S = seg.shape
    tokens = jnp.clip(starts[:, :, None] + jnp.arange(tile, dtype=jnp.int32), 0, S - 1).reshape(B, -1)
    keep = keep.reshape(B, -1)
    return tuple(jnp.where(keep, jnp.take_along_axis(a, tokens, axis=1), 0) for a in (seg, pos))


def aligned_tables(marks, rule, q_tile: int, kv_tile: int, *, transposed: bool = False,
                   kernel: bool = False) -> AlignedTiles:
    """AlignedTiles from the mask's token marks (q segment ids, q positions, kv segment ids, kv positions), each
    [B, S] int32 with segment 0 for padding (lengths multiples of the tiles), for rule (data_mask.MaskRule: the
    kernel's partial groups), on query tiles of q_tile rows and key tiles of kv_tile.  Without transposed the tiles
    are the query tiles (stored by plan: the forward's O, dQ) and the blocks they walk the key tiles; transposed,
    the tiles are the key tiles (dK, dV) walking query blocks.  Where queries and keys are one array and one tile
    size (self-attention), both sides are the same computations on the same values, which XLA computes once: runs,
    tiles, padded marks and their per-tile ranges.  kernel: the lists from list_kernel (data_mask.tile_lists)."""
    q_seg, q_pos, k_seg, k_pos = (a.astype(jnp.int32) for a in marks)
    n_q, n_k = aligned_tile_count(q_seg.shape[1], q_tile), aligned_tile_count(k_seg.shape[1], kv_tile)
    q_starts, q_index, q_tok = run_tiles(q_seg, q_tile, n_q)
    k_starts, k_index, k_tok = run_tiles(k_seg, kv_tile, n_k)
    in_rows = lambda t, n: (jnp.arange(n) >= t[..., :1]) & (jnp.arange(n) < t[..., 1:])  # [B, T, n]
    qs, qp = _tile_marks(q_seg, q_pos, q_starts, q_tile, in_rows(q_tok, q_tile))
    ks, kp = _tile_marks(k_seg, k_pos, k_starts, kv_tile, in_rows(k_tok, kv_tile))
    counts, blocks = tile_lists(qs, qp, ks, kp, rule, q_tile, kv_tile, transposed=transposed, kernel=kernel)
    qm = jnp.stack([jnp.where(qs == 0, NO_SEGMENT, qs), qp], axis=1)  # rows that are no query's: NO_SEGMENT
    km = jnp.stack([ks, kp], axis=1)  # keys that are no tile's: padding
    (starts, index, tok), block_starts = ((k_starts, k_index, k_tok), q_starts) if transposed else (
        (q_starts, q_index, q_tok), k_starts)
    tile_rows = jnp.where(tok[..., 1] > tok[..., 0], starts, -ROW_ALIGN)  # tiles holding no token: -1 (skipped)
    block_rows = jnp.take_along_axis(jnp.broadcast_to(block_starts[:, None, :], blocks.shape), blocks, axis=-1)
    return AlignedTiles(tile_rows // ROW_ALIGN, qm, km, counts, blocks, block_rows // ROW_ALIGN, index,
                        store_plan(tok))


def aligned_mask_tables(mask, cfg, *, backward: bool = True, segments: bool = True, split: bool = True):
    """data_mask.mask_tables with the forward on document-aligned tiles: MaskTables whose `aligned` holds this
    module's AlignedTiles and whose `fwd` is None (the backward's lists as mask_tables builds them)."""
    rule = mask_rule(mask, segments, split)
    t = marks_only(mask)
    marks = (mask.q_segment_ids, mask.q_positions, mask.kv_segment_ids, mask.kv_positions)
    t = t._replace(aligned=aligned_tables(marks, rule, 2 * cfg.block_q, cfg.block_kv,
                                          kernel=lists_by_kernel(cfg)), marks=marks)
    return backward_tables(t, rule, cfg) if backward else t


def aligned_backward_tables(t, rule, cfg):
    """data_mask.MaskTables t (whose forward is on aligned tiles) with both backward kernels' tables on
    document-aligned tiles too (HopperConfig.bwd_aligned): aligned_dq at the dQ kernel's tiles, aligned_dkv at the
    dK/dV kernel's (transposed), grouped by data_mask.backward_rule(rule).  From t.marks where the forward's tables
    kept them (the same arrays: XLA computes the runs both passes' tiles share once), else from qm / km."""
    if t.aligned_dq is not None:
        return t
    marks, rule = (token_marks(t) if t.marks is None else t.marks), backward_rule(rule)
    kernel = lists_by_kernel(cfg)
    return t._replace(aligned_dq=aligned_tables(marks, rule, *dq_tiles(cfg), kernel=kernel),
                      aligned_dkv=aligned_tables(marks, rule, *dkv_tiles(cfg), transposed=True, kernel=kernel))


def merge_shared_groups(out, shared, tile_rows, stores, *, kernel: bool | None = None, interpret=None):
    """out [B, S, H, Dv] with the groups several tiles share filled in: shared [B, T, 2, ROW_ALIGN, H, Dv] holds
    each tile's copy of its shared groups (stores[..., 2:]; tile_rows in ROW_ALIGN units), the other runs' rows 0 in
    it, so each shared group is the sum of its copies (the kernel left it unwritten).  out and shared may be tuples
    of arrays on the same tiles (dK and dV): then a tuple comes back, merged in one launch.  kernel (None: where it
    serves every v head_dim): the Triton merge (aligned_merge), else XLA scatters."""
    many = isinstance(out, (tuple, list))
    outs, shareds = (tuple(out), tuple(shared)) if many else ((out,), (shared,))
    B, S = outs[0].shape[:2]
    group = stores[..., 2:]  # [B, T, 2]
    first = jnp.where(group >= 0, (tile_rows[..., None] + group) * ROW_ALIGN, -1)
    if all(aligned_merge.served(o.shape[-1]) for o in outs) if kernel is None else kernel:
        merged = aligned_merge.merge_shared_many(outs, tuple(s.reshape((B, -1) + s.shape[3:]) for s in shareds),
                                                 first.reshape(B, -1), interpret=interpret)
        return merged if many else merged[0]
    tokens = jnp.where(first >= 0, first, S)[..., None] + jnp.arange(ROW_ALIGN, dtype=jnp.int32)  # S+: dropped
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    merged = tuple(o.at[b, tokens].set(jnp.zeros((), o.dtype), mode="drop").at[b, tokens].add(s, mode="drop")
                   for o, s in zip(outs, shareds))
    return merged if many else merged[0]


def gather_row_values(padded, out_index):
    """Per-row values [B, H, S] in token order (the forward's lse, the dQ kernel's delta) from the tiles' padded
    layout padded [B, H, T * tile] by out_index [B, S] (O, dQ, dK and dV are stored in token order by the kernels)."""
    return jax.vmap(lambda s, i: s[:, i])(padded, out_index)
