"""Pieces the persistent Hopper kernels share (forward_masked_persistent, forward_band_persistent,
backward_band_persistent): a CTA walks its tiles in turn, one K/V (or Q/dO) ring runs across them, and the next
tile's own operands are prefetched during the current one.  Mosaic GPU is passed in (plgpu): this module imports on
any machine."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .._compat import pl
from .common import div, rem, when
from .config import LN2


def snake_tile(cta, i, n_ctas: int):
    """The query tile (index in (batch, head, tile) order) CTA `cta` takes in its round i: position cta of the
    round's n_ctas consecutive tiles in even rounds, position n_ctas - 1 - cta in odd ones, so a CTA that took a
    long tile (late in a causal or padded row) takes a short one next.  Works on Python or traced ints; plain
    arithmetic (no select), so a single producer warp can compute it."""
    return i * n_ctas + cta + rem(i, 2) * ((n_ctas - 1) - 2 * cta)


def tile_parts(t, heads: int, per_head: int):
    """Tile index t in (batch, head, tile) order -> (batch, head, tile); per_head tiles per (batch, head)."""
    bh = div(t, per_head)
    return div(bh, heads), rem(bh, heads), rem(t, per_head)


def snake_coords(cta, i, n_ctas: int, heads: int, per_head: int):
    """(batch, head, tile) of the tile CTA `cta` takes in its round i (snake_tile)."""
    return tile_parts(snake_tile(cta, i, n_ctas), heads, per_head)


def tiles_of_cta(cta, n_tiles: int, n_ctas: int):
    """How many tiles CTA `cta` takes under snake_tile: every whole round, and the last partial round if its
    position there is among the round's first n_tiles % n_ctas."""
    rounds, rest = divmod(n_tiles, n_ctas)
    last_pos = cta if rounds % 2 == 0 else (n_ctas - 1) - cta
    return rounds + jnp.asarray(last_pos < rest).astype(jnp.int32)


def wait_to_refill(slots, slot, g, stages: int):
    """The memory warpgroup, before loading ring step g into `slot`: wait for the consumers to have handed the slot
    back (NamedSlots: always; MbarrierSlots: from the second lap of the ring on)."""
    if slots.primed:
        slots.wait(slot)
    else:
        when(g >= stages, lambda: slots.wait(slot))


def drain_rings(rings, total, stages: int):
    """After the memory warpgroup's last load of `total` ring steps: observe the last consumed phase of every slot
    handed back through mbarriers, so that every barrier phase is waited on before the CTA exits (the interpreter
    checks).  rings: the slot hand-backs (NamedSlots need nothing)."""
    pending = [slots for slots in rings if not slots.primed]
    if not pending:
        return

    def drain(g, _):
        for slots in pending:
            slots.wait(rem(g, stages))

    lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)


def fresh_forward_tile(plgpu, bq: int, d: int):
    """(acc [bq, d], m [bq] = -inf, l [bq] = 0) in the WGMMA layouts: a forward tile's online-softmax state."""
    rows = plgpu.Layout.WGMMA.reduce(1)
    return (plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), rows),
            plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), rows))


def next_k_and_prefetch(plgpu, *, step, n_steps, g, stages: int, k_bar, early, prefetch):
    """A forward step's wait_next_k (run while its PV wgmma is in flight): wait for the next K block of this tile,
    and at step `early` (a traced bool: this is the step, and a next tile exists) wait for the previous tile's O
    store to have read out the other buffer, then prefetch() the next tile's Q into it."""

    def wait_next_k():
        @pl.when(step + 1 < n_steps)
        def _():
            plgpu.barrier_wait(k_bar.at[rem(g + 1, stages)])

        @pl.when(early)
        def _():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the other buffer's O store read out
            prefetch()

    return wait_next_k


def store_forward_tile(plgpu, carry, *, qo_smem, lse_smem, o_dst, lse_dst, dtype):
    """A persistent forward tile's epilogue: out = acc / l into its Q buffer and lse (natural log; rows without a
    visible key: out 0, lse -inf) into lse_smem, both stored by TMA and not waited for (the previous tile's lse store
    is waited for first: lse_smem is single-buffered)."""
    acc, m_i, l_i = carry
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's lse store read out
    empty = l_i == 0.0
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l_i))
    qo_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
    lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(jnp.where(empty, 1.0, l_i))) * LN2)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, o_dst)
    plgpu.copy_smem_to_gmem(lse_smem, lse_dst)
