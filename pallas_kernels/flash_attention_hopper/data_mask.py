"""A data mask for the Hopper kernels: `pallas_kernels.mask.AttentionMask` as the kernels read it.

    MaskRule(causal, window)              static: the visibility rule's settings (hashable, a jit static argument)
    MaskTables(qm, km, fwd, dq, dkv)      arrays (traced):
        qm [B, 2, Sq], km [B, 2, Skv] int32: (segment id, position) of every query / key, one TMA copy per tile
        (a padding query's segment id is -1 in qm, so that it equals no key's, padding keys' 0 included);
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

from jax import lax

from ..mask import FULL, PARTIAL, AttentionMask, classify, tile_stats


class MaskRule(NamedTuple):
    causal: bool
    window: tuple[int, int]

    def apply(self, x, q_marks, k_marks, fill, *, q_axis: int):
        """x [rows, cols] with the hidden (query, key) pairs set to `fill`: `mask.visible` as a chain of selects,
        each comparison feeding its select at once (no boolean tile kept alive).  q_marks: (segment id, position)
        vectors along axis q_axis, the segment id -1 for a padding query (MaskTables.qm); k_marks along the other
        axis, segment 0 for a padding key (it equals no query's id)."""
        shape = x.shape
        qb = lambda a: lax.broadcast_in_dim(a, shape, [q_axis])
        kb = lambda a: lax.broadcast_in_dim(a, shape, [1 - q_axis])
        (q_seg, q_pos), (k_seg, k_pos) = q_marks, k_marks
        left, right = self.window
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
    group; the rest of the row is 0 (never read)."""
    n = classes.shape[-1]
    partial, full = classes == PARTIAL, classes == FULL
    n_partial = jnp.sum(partial, -1, dtype=jnp.int32)
    n_visible = n_partial + jnp.sum(full, -1, dtype=jnp.int32)
    slot = jnp.where(partial, jnp.cumsum(partial, -1) - 1,
                     jnp.where(full, n_partial[..., None] + jnp.cumsum(full, -1) - 1, n))  # n: dropped
    idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), classes.shape)
    blocks = jnp.zeros(classes.shape[:-1] + (n + 1,), jnp.int32)
    blocks = jnp.put_along_axis(blocks, slot.astype(jnp.int32), idx, axis=-1, inplace=False)[..., :n]
    return jnp.stack([n_partial, n_visible], -1), blocks


def mask_tables(mask: AttentionMask, cfg) -> MaskTables:
    """The kernels' tables for `mask` (its lengths already multiples of every tile: hopper_attention pads)."""
    rule = dict(causal=mask.causal, window=mask.window)
    qs, qp = mask.q_segment_ids.astype(jnp.int32), mask.q_positions.astype(jnp.int32)
    ks, kp = mask.kv_segment_ids.astype(jnp.int32), mask.kv_positions.astype(jnp.int32)

    def lists(q_tile, kv_tile, transposed=False):
        classes = classify(tile_stats(qs, qp, q_tile), tile_stats(ks, kp, kv_tile), **rule)
        return block_lists(jnp.swapaxes(classes, -1, -2) if transposed else classes)

    return MaskTables(
        qm=jnp.stack([jnp.where(qs == 0, -1, qs), qp], axis=1), km=jnp.stack([ks, kp], axis=1),
        fwd=lists(2 * cfg.block_q, cfg.block_kv),
        dq=lists(cfg.bwd_wgs * cfg.bwd_block_q, cfg.bwd_block_kv),
        dkv=lists(cfg.bwd_block_q, cfg.bwd_wgs * cfg.bwd_block_kv, transposed=True))


class DataMask(NamedTuple):
    """Tables and rule together, inside the kernels' Python (not a jit argument)."""
    tables: MaskTables
    rule: MaskRule

    def apply(self, x, q_marks, k_marks, fill, *, q_axis: int):
        return self.rule.apply(x, q_marks, k_marks, fill, q_axis=q_axis)

    def kernel_args(self, kind: str):
        """(qm, km, counts, blocks) for the "fwd", "dq" or "dkv" kernel."""
        return (self.tables.qm, self.tables.km) + tuple(getattr(self.tables, kind))
