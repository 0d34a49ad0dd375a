"""A data mask for the Hopper kernels: `pallas_kernels.mask.AttentionMask` as the kernels read it.

    MaskRule(causal, window, segments, split, offset)
                                          static: the visibility rule's settings (hashable, a jit static argument;
                                          segments False: one segment, only positions are compared; offset an
                                          int: the positions are token indices, and the backward runs as a band)
    MaskTables(qm, km, fwd, dq, dkv)      arrays (traced):
        qm [B, 2, Sq], km [B, 2, Skv] int32: (segment id, position) of every query / key, one TMA copy per tile
        (a padding query's segment id is NO_SEGMENT in qm, so that it equals no key's, padding keys' 0 included);
        fwd, dq: per query tile (of the forward's 2 block_q rows / the dQ kernel's bwd_wgs bwd_block_q rows) the
        visible kv blocks as `block_lists` (counts [B, nq, n_groups + 1], blocks [B, nq, nk]): the partial blocks
        first, in the groups of `MaskRule.partial_rules` (the backward's: of `backward_rule`), then the full ones;
        counts are the groups' cumulative ends, the last one the number of visible blocks; dkv: per key tile
        (bwd_wgs bwd_block_kv keys) its visible query blocks.
        A list skips every empty tile, also between visible ones (documents: the tile that straddles a
        document's end looks possible to the whole document by its ranges, but no tile in between is walked).
    mask_tables(mask, cfg) -> MaskTables   (XLA, before the kernels: a pass over the [B, S] mask arrays)

Every mask kind (padding, documents, causal top-left or bottom-right, windows, explicit positions) is data in
these arrays; the kernels skip the empty tiles, compute the full ones without the element mask and apply
`mask.visible` to the rest.  The forward splits the partial tiles by what their element mask must compare
(`MaskRule.partial_rules`, `partial_kinds`): positions only (both tiles in one segment: a document's diagonal),
segments only (every same-segment pair passes the position rule: a tile that straddles a document's start), or
both; each group runs its own loop with one comparison fewer where it can (the backward kernels can too, but
walk one group: BACKWARD_SPLIT).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax import lax

from .._compat import default_interpret
from ..mask import FULL, PARTIAL, AttentionMask, TileStats, classify, tile_stats
from . import list_kernel
from .config import dkv_block_q


#: A padding query's segment id in MaskTables.qm (int32 min: no key's id, 0 included).
NO_SEGMENT = int(np.iinfo(np.int32).min)


class MaskRule(NamedTuple):
    causal: bool
    window: tuple[int, int]
    # False: every query and key is in one segment (no padding, no documents), so the element mask compares
    # positions only. (On the H100 dropping one of the mask's two compares made the documents' data-mask forward
    # 8-10% faster; on a causal window the segment compare is one of three, and the forward moved by 0-2%.)
    segments: bool = True
    # False: the forward's partial tiles stay in one group under the whole rule (partial_rules), for A/B timing.
    split: bool = True
    # An int (with segments False): the mask's positions are token indices, query i at i + offset and key j at j
    # (AttentionMask.full: 0 top-left, kv_len - q_len bottom-right), so every visible pair lies in a band of
    # key - query index differences (band()) and the backward walks it without tables or positions.  None: positions
    # are data (qm / km).
    offset: int | None = None

    def band(self):
        """(offset, lo, hi) for a rule with `offset`: key j is visible to query i iff lo <= j - i - offset <= hi (lo
        / hi None: unbounded); None without an offset."""
        if self.offset is None:
            return None
        left, right = self.window
        his = ([0] if self.causal else []) + ([right] if right >= 0 else [])
        return self.offset, (-left if left >= 0 else None), (min(his) if his else None)

    def apply(self, x, q_marks, k_marks, fill, *, q_axis: int):
        """x [rows, cols] with the hidden (query, key) pairs set to `fill`: `mask.visible` as a chain of selects,
        each comparison feeding its select at once (no boolean tile kept alive).  q_marks: (segment id, position)
        vectors along axis q_axis, the segment id NO_SEGMENT for a padding query (MaskTables.qm); k_marks along the other
        axis, segment 0 for a padding key (it equals no query's id)."""
        shape = x.shape
        qb = lambda a: lax.broadcast_in_dim(a, shape, [q_axis])
        kb = lambda a: lax.broadcast_in_dim(a, shape, [1 - q_axis])
        (q_seg, q_pos), (k_seg, k_pos) = q_marks, k_marks
        left, right = self.window
        if self.segments:
            x = jnp.where(kb(k_seg) == qb(q_seg), x, fill)
        if self.causal:
            x = jnp.where(kb(k_pos) <= qb(q_pos), x, fill)
        if left >= 0:
            x = jnp.where(kb(k_pos) >= qb(q_pos - left), x, fill)
        if right >= 0:
            x = jnp.where(kb(k_pos) <= qb(q_pos + right), x, fill)
        return x

    @property
    def compares_positions(self) -> bool:
        return self.causal or max(self.window) >= 0

    def partial_rules(self) -> tuple["MaskRule", ...]:
        """The element masks of the forward's partial-tile groups, in list order (partial_kinds numbers them):
        where the rule compares both segments and positions, (positions only, segments only, both); else the rule
        itself, one group."""
        if not (self.split and self.segments and self.compares_positions):
            return (self,)
        return (self._replace(segments=False), MaskRule(False, (-1, -1), True), self)


def walk_groups(body, ends, rule, carry):
    """Run a tile's steps group by group: ends (traced ints, block_lists' counts for the tile) close the partial
    groups of rule.partial_rules() and then the full blocks; body(step, carry, group_rule) with the group's rule
    (None: full blocks).  Every data-mask kernel walks its list this way."""
    start = 0
    for end, group_rule in zip(ends, rule.partial_rules() + (None,)):
        carry = lax.fori_loop(start, end, functools.partial(body, group_rule=group_rule), carry)
        start = end
    return carry


class MaskTables(NamedTuple):
    qm: jax.Array
    km: jax.Array
    fwd: tuple  # (counts [B, nq, n_groups + 1], blocks [B, nq, nk]) at the forward's tiles
    dq: tuple   # the same at the dQ kernel's tiles
    dkv: tuple  # per key tile: (counts [B, nkt, 2], query blocks [B, nkt, nq])
    # aligned_tiles.AlignedTiles: the forward on document-aligned tiles instead of `fwd` (None: the global grid)
    aligned: tuple | None = None
    # aligned_tiles.AlignedTiles at the dQ kernel's tiles instead of `dq`, and at the dK/dV kernel's (transposed)
    # instead of `dkv` (HopperConfig.bwd_aligned)
    aligned_dq: tuple | None = None
    aligned_dkv: tuple | None = None
    # the mask's own (q segment ids, q positions, kv segment ids, kv positions) [B, S] each, as the aligned tables
    # were built from (aligned_tiles.aligned_mask_tables): the backward's aligned tables start from the same arrays,
    # so XLA computes the runs and padded marks the forward's and backward's tiles share once
    marks: tuple | None = None


def block_lists(classes, groups=None, n_groups: int = 1):
    """int8 classes [..., n] (mask.classify) -> (counts [..., n_groups + 1] int32, blocks [..., n] int32): each
    row's visible blocks, the partial ones first, ordered by their group (groups [..., n] int32 in
    [0, n_groups), read at the partial blocks; None: one group), then the full ones, in index order within each
    group; the rest of the row is 0 (never read). counts: the cumulative ends of the partial groups, then the
    number of visible blocks (one group: (partial, partial + full)).  Rows of up to ONE_HOT_MAX blocks build the
    list as a one-hot sum (one fused XLA reduction, n^2 per row); longer ones by a stable sort."""
    partial, full = classes == PARTIAL, classes == FULL
    n = classes.shape[-1]
    key = jnp.where(partial, 0 if groups is None else groups, jnp.where(full, n_groups, n_groups + 1))
    key = key.astype(jnp.int32)  # list order: partial groups 0 .. n_groups - 1, full n_groups, not listed after
    sizes = [jnp.sum(key == g, -1, dtype=jnp.int32) for g in range(n_groups + 1)]
    ends = [sizes[0]]
    for size in sizes[1:]:
        ends.append(ends[-1] + size)
    counts = jnp.stack(ends, -1)
    if n > ONE_HOT_MAX:
        return counts, jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    slot = jnp.full(key.shape, n, jnp.int32)
    for g in range(n_groups + 1):
        start = 0 if g == 0 else ends[g - 1][..., None]
        slot = jnp.where(key == g, start + jnp.cumsum(key == g, -1, dtype=jnp.int32) - 1, slot)
    idx = jnp.arange(n, dtype=jnp.int32)
    hits = slot[..., :, None] == idx  # [..., block i, list slot j]
    return counts, jnp.sum(jnp.where(hits, idx[:, None], 0), axis=-2, dtype=jnp.int32)


#: Longest row (in blocks) that block_lists builds by a one-hot sum rather than a sort (128 blocks of 128 tokens:
#: 16k tokens).
ONE_HOT_MAX = 256


def _pooled(stats: TileStats, factor: int) -> TileStats:
    """TileStats of tiles `factor` times as long, from those of the short tiles ([..., n] -> [..., n / factor])."""
    if factor == 1:
        return stats
    cut = lambda x: x.reshape(x.shape[:-1] + (x.shape[-1] // factor, factor))
    return TileStats(cut(stats.seg_min).min(-1), cut(stats.seg_max).max(-1), cut(stats.pos_min).min(-1),
                     cut(stats.pos_max).max(-1), cut(stats.all_valid).all(-1))


#: partial_kinds' bounds for its combined marks segment * 2^21 + position + 2^20 (exact in int32): segment ids below
#: SEGMENT_BOUND, |positions| below POSITION_BOUND.  Where a mask exceeds them no tile is put in the segments-only
#: group (those tiles compare both), which is slower, never wrong.
SEGMENT_BOUND, POSITION_BOUND = 1 << 10, 1 << 20


def partial_kinds(q_stats: TileStats, kv_stats: TileStats, q_marks: TileStats, kv_marks: TileStats, rule,
                  fits=True):
    """The group (index into rule.partial_rules()) of every (q tile, kv tile), read at the partial ones:
    [..., nq, nk] int32.  0, positions only: both tiles free of padding and in one and the same segment.
    1, segments only: every pair passes the position rule on the combined marks g = segment * 2^21 + position
    (+ 2^20), ranges from q_marks / kv_marks (TileStats whose positions are g); for two tokens of one segment g's
    difference is the positions' difference, so every same-segment pair passes the rule itself (the segment
    compare hides the rest).  2: both.  fits (bool scalar, _combined_marks'): False where some token's g
    overflowed, which leaves no tile in group 1 (those compare both).  A rule with one group: all 0."""
    shape = jnp.broadcast_shapes(q_stats.seg_min[..., :, None].shape, kv_stats.seg_min[..., None, :].shape)
    if len(rule.partial_rules()) == 1:
        return jnp.zeros(shape, jnp.int32)
    qsmin, qsmax, _, _, qall = (x[..., :, None] for x in q_stats)
    ksmin, ksmax, _, _, kall = (x[..., None, :] for x in kv_stats)
    one_segment = qall & kall & (qsmin == qsmax) & (ksmin == ksmax) & (qsmin == ksmin)
    _, _, qgmin, qgmax, _ = (x[..., :, None] for x in q_marks)
    _, _, kgmin, kgmax, _ = (x[..., None, :] for x in kv_marks)
    positions_hold = jnp.ones(shape, bool)
    left, right = rule.window
    if rule.causal:
        positions_hold &= kgmax <= qgmin
    if left >= 0:
        positions_hold &= kgmin >= qgmax - left
    if right >= 0:
        positions_hold &= kgmax <= qgmin + right
    return jnp.where(one_segment, 0, jnp.where(positions_hold & fits, 1, 2)).astype(jnp.int32)


def _combined_marks(seg, pos):
    """(g [..., S] int32 = seg * 2^21 + pos + 2^20, whether every token fits partial_kinds' bounds)."""
    fits = jnp.all((seg >= 0) & (seg < SEGMENT_BOUND) & (jnp.abs(pos) < POSITION_BOUND))
    return jnp.where(fits, seg * (2 * POSITION_BOUND) + pos + POSITION_BOUND, 0).astype(jnp.int32), fits


def tile_lists(qs, qp, ks, kp, rule, q_tile: int, kv_tile: int, transposed: bool = False, kernel: bool = False):
    """(counts, blocks) of block_lists at these tiles, the partial tiles in partial_kinds' groups of `rule`
    (transposed: per key tile).  kernel: classified and listed by list_kernel (one Triton launch; the same lists,
    the unlisted blocks after them as the sort's) where its rows fit (list_kernel.MAX_COLS), else by XLA."""
    fine = math.gcd(64, q_tile, kv_tile)  # ranges reduced once at the smallest tile (32-row dK/dV blocks), pooled
    stats = lambda seg, pos, tile: _pooled(tile_stats(seg, pos, fine), tile // fine)
    q_stats, kv_stats = stats(qs, qp, q_tile), stats(ks, kp, kv_tile)
    n_groups = len(rule.partial_rules())
    marks = fits = None
    if n_groups > 1:
        (qg, q_fit), (kg, k_fit) = _combined_marks(qs, qp), _combined_marks(ks, kp)
        marks, fits = (stats(qs, qg, q_tile), stats(ks, kg, kv_tile)), q_fit & k_fit
    n_cols = (q_stats if transposed else kv_stats).seg_min.shape[-1]
    if kernel and n_cols <= list_kernel.MAX_COLS:
        rows, cols = (kv_stats, q_stats) if transposed else (q_stats, kv_stats)
        row_marks, col_marks = (None, None) if marks is None else (marks[::-1] if transposed else marks)
        return list_kernel.block_lists_kernel(rows, cols, row_marks, col_marks, fits, rule, transposed=transposed,
                                              kinds=partial_kinds)
    classes = classify(q_stats, kv_stats, causal=rule.causal, window=rule.window)
    groups = None
    if n_groups > 1:
        groups = partial_kinds(q_stats, kv_stats, *marks, rule, fits)
    if transposed:
        classes = jnp.swapaxes(classes, -1, -2)
        groups = None if groups is None else jnp.swapaxes(groups, -1, -2)
    return block_lists(classes, groups, n_groups)


def mask_tables(mask: AttentionMask, cfg, *, backward: bool = True, segments: bool = True,
                split: bool = True) -> MaskTables:
    """The kernels' tables for `mask` (its lengths already multiples of every tile: hopper_attention pads).
    backward=False: the forward's only (dq and dkv None; `backward_tables` adds them in the backward pass, so a
    forward-only call pays for one list).  segments, split: MaskRule's (mask_rule(mask, segments, split) is the
    rule the kernels must be given with these tables).  aligned_tiles.aligned_mask_tables builds the same with the
    forward on document-aligned tiles."""
    rule = mask_rule(mask, segments, split)
    t = marks_only(mask)
    t = t._replace(fwd=tile_lists(*token_marks(t), rule, 2 * cfg.block_q, cfg.block_kv,
                                  kernel=lists_by_kernel(cfg)))
    return backward_tables(t, rule, cfg) if backward else t


def lists_by_kernel(cfg) -> bool:
    """Whether the tables' block lists come from list_kernel (HopperConfig.lists_kernel; None (auto): on the GPU,
    where its one launch per table replaces XLA's dozen small kernels; XLA's where Pallas interprets)."""
    return (not default_interpret()) if cfg.lists_kernel is None else cfg.lists_kernel


def marks_only(mask: AttentionMask) -> MaskTables:
    """MaskTables with the marks qm / km of `mask` and no lists yet."""
    return MaskTables(qm=jnp.stack([jnp.where(mask.q_segment_ids == 0, NO_SEGMENT, mask.q_segment_ids),
                                    mask.q_positions], axis=1).astype(jnp.int32),
                      km=jnp.stack([mask.kv_segment_ids, mask.kv_positions], axis=1).astype(jnp.int32),
                      fwd=None, dq=None, dkv=None)


def mask_rule(mask: AttentionMask, segments: bool = True, split: bool = True, offset: int | None = None) -> MaskRule:
    """The static rule of `mask` (segments False: the caller knows it has one segment and no padding; split
    False: one group of partial tiles, MaskRule.split; offset: the caller knows the positions are token indices,
    query i at i + offset, key j at j (MaskRule.offset; only with segments False))."""
    if offset is not None and (segments or isinstance(offset, bool) or not isinstance(offset, int)):
        raise ValueError(f"mask_rule: offset={offset!r} must be an int, and it needs segments=False (positions are "
                         f"token indices only where every token is in one segment).")
    return MaskRule(mask.causal, tuple(mask.window), bool(segments), bool(split), offset)


def token_marks(t: MaskTables):
    """(q segment ids with 0 for padding, q positions, kv segment ids, kv positions) back from qm / km."""
    qs = jnp.where(t.qm[:, 0] == NO_SEGMENT, 0, t.qm[:, 0])
    return qs, t.qm[:, 1], t.km[:, 0], t.km[:, 1]


#: Whether the backward kernels group their partial tiles as the forward does (MaskRule.partial_rules).  They can
#: (the kernels walk any number of groups), but on the H100 (hopper_mask_probe --split-ab, 3 rounds) the grouped
#: backward was 2-3% faster on documents and 2-3% slower on padding and on causal given as data, so it walks one.
BACKWARD_SPLIT = False


def backward_rule(rule: MaskRule) -> MaskRule:
    """The rule the backward kernels and their tables use (BACKWARD_SPLIT)."""
    return rule._replace(split=rule.split and BACKWARD_SPLIT)


def backward_tables(t: MaskTables, rule: MaskRule, cfg) -> MaskTables:
    """t with the dQ kernel's and the dK/dV kernel's block lists (grouped by backward_rule(rule)).
    aligned_tiles.aligned_backward_tables builds both on document-aligned tiles instead (HopperConfig.bwd_aligned)."""
    if t.dq is not None:
        return t
    marks = token_marks(t)
    rule = backward_rule(rule)
    kernel = lists_by_kernel(cfg)
    return t._replace(dq=tile_lists(*marks, rule, *dq_tiles(cfg), kernel=kernel),
                      dkv=tile_lists(*marks, rule, *dkv_tiles(cfg), transposed=True, kernel=kernel))


def dq_tiles(cfg):
    """(query tile, key block) of the dQ kernel: wgs x bwd_block_q query rows walking bwd_block_kv keys."""
    return cfg.bwd_wgs * cfg.bwd_block_q, cfg.bwd_block_kv


def dkv_tiles(cfg):
    """(query block, key tile) of the dK/dV kernel: wgs x bwd_block_kv keys walking dkv_block_q query rows."""
    return dkv_block_q(cfg), cfg.bwd_wgs * cfg.bwd_block_kv


class DataMask(NamedTuple):
    """Tables and rule together, inside the kernels' Python (not a jit argument)."""
    tables: MaskTables
    rule: MaskRule

    def kernel_args(self, kind: str):
        """(qm, km, counts, blocks) for the "fwd", "dq" or "dkv" kernel."""
        return (self.tables.qm, self.tables.km) + tuple(getattr(self.tables, kind))
