"""A data mask for the Hopper kernels: `pallas_kernels.mask.AttentionMask` as the kernels read it.

    MaskRule(causal, window, segments)    static: the visibility rule's settings (hashable, a jit static argument;
                                          segments False: one segment, only positions are compared)
    MaskTables(qm, km, fwd, dq, dkv)      arrays (traced):
        qm [B, 2, Sq], km [B, 2, Skv] int32: (segment id, position) of every query / key, one TMA copy per tile
        (a padding query's segment id is NO_SEGMENT in qm, so that it equals no key's, padding keys' 0 included);
        fwd, dq: per query tile (of the forward's 2 block_q rows / the dQ kernel's bwd_wgs bwd_block_q rows) the
        visible kv blocks as `block_lists` (counts [B, nq, 2], blocks [B, nq, nk]): the partial blocks first,
        then the full ones; dkv: per key tile (bwd_wgs bwd_block_kv keys) its visible query blocks.
        A list skips every empty tile, also between visible ones (documents: the tile that straddles a
        document's end looks possible to the whole document by its ranges, but no tile in between is walked).
    mask_tables(mask, cfg) -> MaskTables   (XLA, before the kernels: a pass over the [B, S] mask arrays)

Every mask kind (padding, documents, causal top-left or bottom-right, windows, explicit positions) is data in
these arrays; the kernels skip the empty tiles, compute the full ones without the element mask and apply
`mask.visible` to the rest.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax import lax

from ..mask import FULL, PARTIAL, AttentionMask, TileStats, classify, tile_stats


#: A padding query's segment id in MaskTables.qm (int32 min: no key's id, 0 included).
NO_SEGMENT = int(np.iinfo(np.int32).min)


class MaskRule(NamedTuple):
    causal: bool
    window: tuple[int, int]
    # False: every query and key is in one segment (no padding, no documents), so the element mask compares
    # positions only. (On the H100 dropping one of the mask's two compares made the documents' data-mask forward
    # 8-10% faster; on a causal window the segment compare is one of three, and the forward moved by 0-2%.)
    segments: bool = True

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


class MaskTables(NamedTuple):
    qm: jax.Array
    km: jax.Array
    fwd: tuple  # (counts [B, nq, 2], blocks [B, nq, nk]) at the forward's tiles
    dq: tuple   # the same at the dQ kernel's tiles
    dkv: tuple  # per key tile: (counts [B, nkt, 2], query blocks [B, nkt, nq])


def block_lists(classes):
    """int8 classes [..., n] (mask.classify) -> (counts [..., 2] int32 = (partial, partial + full), blocks [..., n]
    int32): each row's visible blocks, the partial ones first, then the full ones, in index order within each
    group; the rest of the row is 0 (never read).  Rows of up to ONE_HOT_MAX blocks build the list as a one-hot
    sum (one fused XLA reduction, n^2 per row); longer ones by a stable sort."""
    partial, full = classes == PARTIAL, classes == FULL
    n = classes.shape[-1]
    n_partial = jnp.sum(partial, -1, dtype=jnp.int32)
    n_visible = n_partial + jnp.sum(full, -1, dtype=jnp.int32)
    counts = jnp.stack([n_partial, n_visible], -1)
    if n > ONE_HOT_MAX:
        key = jnp.where(partial, 0, jnp.where(full, 1, 2)).astype(jnp.int32)
        return counts, jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    slot = jnp.where(partial, jnp.cumsum(partial, -1, dtype=jnp.int32) - 1,
                     jnp.where(full, n_partial[..., None] + jnp.cumsum(full, -1, dtype=jnp.int32) - 1, n))
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


def _lists(qs, qp, ks, kp, rule, q_tile: int, kv_tile: int, transposed: bool = False):
    fine = 64  # ranges reduced once at the smallest tile, then pooled
    q_stats = _pooled(tile_stats(qs, qp, fine), q_tile // fine)
    kv_stats = _pooled(tile_stats(ks, kp, fine), kv_tile // fine)
    classes = classify(q_stats, kv_stats, causal=rule.causal, window=rule.window)
    return block_lists(jnp.swapaxes(classes, -1, -2) if transposed else classes)


def mask_tables(mask: AttentionMask, cfg, *, backward: bool = True) -> MaskTables:
    """The kernels' tables for `mask` (its lengths already multiples of every tile: hopper_attention pads).
    backward=False: the forward's only (dq and dkv None; `backward_tables` adds them in the backward pass, so a
    forward-only call pays for one list)."""
    t = MaskTables(qm=jnp.stack([jnp.where(mask.q_segment_ids == 0, NO_SEGMENT, mask.q_segment_ids), mask.q_positions],
                                axis=1).astype(jnp.int32),
                   km=jnp.stack([mask.kv_segment_ids, mask.kv_positions], axis=1).astype(jnp.int32),
                   fwd=None, dq=None, dkv=None)
    rule = MaskRule(mask.causal, tuple(mask.window))
    t = t._replace(fwd=_lists(*_marks(t), rule, 2 * cfg.block_q, cfg.block_kv))
    return backward_tables(t, rule, cfg) if backward else t


def _marks(t: MaskTables):
    """(q segment ids with 0 for padding, q positions, kv segment ids, kv positions) back from qm / km."""
    qs = jnp.where(t.qm[:, 0] == NO_SEGMENT, 0, t.qm[:, 0])
    return qs, t.qm[:, 1], t.km[:, 0], t.km[:, 1]


def backward_tables(t: MaskTables, rule: MaskRule, cfg) -> MaskTables:
    """t with the dQ kernel's and the dK/dV kernel's block lists."""
    if t.dq is not None:
        return t
    marks = _marks(t)
    return t._replace(dq=_lists(*marks, rule, cfg.bwd_wgs * cfg.bwd_block_q, cfg.bwd_block_kv),
                      dkv=_lists(*marks, rule, cfg.bwd_block_q, cfg.bwd_wgs * cfg.bwd_block_kv, transposed=True))


class DataMask(NamedTuple):
    """Tables and rule together, inside the kernels' Python (not a jit argument)."""
    tables: MaskTables
    rule: MaskRule

    def kernel_args(self, kind: str):
        """(qm, km, counts, blocks) for the "fwd", "dq" or "dkv" kernel."""
        return (self.tables.qm, self.tables.km) + tuple(getattr(self.tables, kind))
