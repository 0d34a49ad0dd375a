"""A data mask for the Hopper kernels: `pallas_kernels.mask.AttentionMask` as the kernels read it.

    MaskRule(causal, window)              static: the visibility rule's settings (hashable, a jit static argument)
    MaskTables(qm, km, fwd, dq, dkv)      arrays (traced):
        qm [B, 2, Sq], km [B, 2, Skv] int32: (segment id, position) of every query / key, one TMA copy per tile;
        fwd [B, Sq / (2 block_q), 4], dq [B, Sq / (bwd_wgs bwd_block_q), 4]: each query tile's kv-block loop
        bounds (lo, flo, fhi, hi) (`mask.loop_bounds`) at the forward's and the dQ kernel's tile sizes;
        dkv [B, Skv / (bwd_wgs bwd_block_kv), 4]: each key tile's query-block bounds (the transposed classes).
    mask_tables(mask, cfg) -> MaskTables   (XLA, before the kernels: a pass over the [B, S] mask arrays)

Every mask kind (padding, documents, causal top-left or bottom-right, windows, explicit positions) is data in
these arrays; the kernels skip the empty tiles, compute the full ones without the element mask and apply
`mask.visible` to the rest.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..mask import AttentionMask, classify, loop_bounds, tile_stats, visible


class MaskRule(NamedTuple):
    causal: bool
    window: tuple[int, int]

    def visible(self, q_seg, q_pos, kv_seg, kv_pos):
        return visible(q_seg, q_pos, kv_seg, kv_pos, causal=self.causal, window=self.window)


class MaskTables(NamedTuple):
    qm: jax.Array
    km: jax.Array
    fwd: jax.Array
    dq: jax.Array
    dkv: jax.Array


def mask_tables(mask: AttentionMask, cfg) -> MaskTables:
    """The kernels' tables for `mask` (its lengths already multiples of every tile: hopper_attention pads)."""
    rule = dict(causal=mask.causal, window=mask.window)
    qs, qp = mask.q_segment_ids.astype(jnp.int32), mask.q_positions.astype(jnp.int32)
    ks, kp = mask.kv_segment_ids.astype(jnp.int32), mask.kv_positions.astype(jnp.int32)

    def bounds(q_tile, kv_tile, transposed=False):
        classes = classify(tile_stats(qs, qp, q_tile), tile_stats(ks, kp, kv_tile), **rule)
        return loop_bounds(jnp.swapaxes(classes, -1, -2) if transposed else classes)

    return MaskTables(
        qm=jnp.stack([qs, qp], axis=1), km=jnp.stack([ks, kp], axis=1),
        fwd=bounds(2 * cfg.block_q, cfg.block_kv),
        dq=bounds(cfg.bwd_wgs * cfg.bwd_block_q, cfg.bwd_block_kv),
        dkv=bounds(cfg.bwd_block_q, cfg.bwd_wgs * cfg.bwd_block_kv, transposed=True))


class DataMask(NamedTuple):
    """Tables and rule together, inside the kernels' Python (not a jit argument)."""
    tables: MaskTables
    rule: MaskRule

    def visible(self, q_seg, q_pos, kv_seg, kv_pos):
        return self.rule.visible(q_seg, q_pos, kv_seg, kv_pos)

    def kernel_args(self, kind: str):
        """(qm, km, bounds) for the "fwd", "dq" or "dkv" kernel."""
        return self.tables.qm, self.tables.km, getattr(self.tables, kind)
