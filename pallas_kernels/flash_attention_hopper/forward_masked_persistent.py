"""Hopper (sm90) flash-attention forward under a data mask on a persistent grid: one CTA per SM walking query tiles.
Same arguments and outputs as forward_masked._flash_fwd_masked (one CTA per query tile).
Mosaic GPU is imported lazily: this module imports on any machine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import mosaic_gpu, pl
from .common import num_sms, rem, ring_slots, run_producer, smem_transforms, warp_specialized_kernel
from .config import HopperConfig, logit_units, rendezvous_named, ring_choices
from .data_mask import walk_groups
from .forward_masked import step_mask
from .forward_step import _Sched, _fwd_kv_step, fwd_geometry
from .persistent_steps import (drain_rings, fresh_forward_tile, next_k_and_prefetch, snake_coords,
                               store_forward_tile, tiles_of_cta, wait_to_refill)


def _flash_fwd_masked_persistent(q, k, v, qm, km, counts, blocks, *, scale: float, cfg: HopperConfig,
                                 interpret: bool, softcap: float | None, rule):
    """The data-mask forward (see forward_masked._flash_fwd_masked for the tables) on n_ctas CTAs (cfg.fwd_ctas or
    the SM count), tiles dealt by snake_tile in (batch, head, query tile) order, so the CTAs running together read
    the same K/V in L2.

    What the grid version exposes at every tile and this one overlaps:
      * K/V: the memory warpgroup streams the blocks of all the CTA's tiles through one ring (a global step counter
        g, slot g % stages), so a tile's first blocks load during the previous tile's last steps;
      * Q: each compute warpgroup double-buffers its Q tile and query marks; the next tile's load is issued during
        this tile's second K/V step (its first, for a one-step tile), once the previous tile's O store has been
        read out of that buffer; this tile's O is staged in its own Q buffer and its store is not waited for;
      * the next tile's block counts are read from global memory a tile ahead.
    A tile whose list is empty (queries that see no key: padding) walks block 0 under the element mask, which hides
    every pair of such a tile, so every tile has at least one step (out 0, lse -inf) and no Q load waits for the end
    of a tile.  Shared memory: 2 Q/O buffers per warpgroup beside the K/V ring (config.persistent_fits); D == Dv.
    """
    plgpu = mosaic_gpu()
    n_groups = len(rule.partial_rules())
    B, S, H, D, Skv, G, rep, dtype, bq, bkv, n_kv, stages, n_qt = fwd_geometry(q, k, cfg)
    if v.shape[-1] != D:
        raise ValueError(f"the persistent data-mask forward needs v's head_dim {v.shape[-1]} == q/k's {D}")
    c, pre = logit_units(scale, softcap)
    named = rendezvous_named(cfg, interpret)
    named_release, producer_warp = ring_choices(cfg, interpret, backward=False)
    wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
    n_tiles = B * H * n_qt
    n_ctas = min(cfg.fwd_ctas or num_sms(), n_tiles)

    def tile_coords(cta, i):  # -> batch, head, query tile of the CTA's i-th tile
        return snake_coords(cta, i, n_ctas, H, n_qt)

    def steps_of(counts_ref, cta, i, my_tiles):
        """The step ends of the CTA's i-th tile (clamped to its last; forward_masked.walk_groups), an empty list as
        1 step under the whole rule (the last partial group)."""
        b, _, qt = tile_coords(cta, jnp.minimum(i, my_tiles - 1))
        ends = [counts_ref[b, qt, j] for j in range(n_groups + 1)]
        empty = ends[-1] == 0
        return tuple(jnp.where(empty, 0 if j < n_groups - 1 else 1, e) for j, e in enumerate(ends))

    def body(q_ref, k_ref, v_ref, qm_ref, km_ref, counts_ref, blocks_ref, o_ref, lse_ref, smem, bars):
        qo_smem4, k_smem, v_smem, lse_smem2, qm_smem4, km_smem = smem
        k_bar, v_bar, q_bar, k_cons, v_cons, sched, qm_bar, km_bar, km_cons = bars
        k_slots, v_slots, km_slots = ring_slots(plgpu, (k_cons, v_cons, km_cons), stages, named=named_release,
                                                producer_warp=producer_warp, compute_wgs=2)
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cta")
        my_tiles = tiles_of_cta(cta, n_tiles, n_ctas)
        sched = _Sched(plgpu, sched, named)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            lse_smem = lse_smem2.at[wg]

            def load_q(i, buf):
                b, h, qt = tile_coords(cta, i)
                q0 = qt * (2 * bq) + wg * bq
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], qo_smem4.at[wg, buf],
                                        q_bar.at[2 * wg + buf])
                plgpu.copy_gmem_to_smem(qm_ref.at[b, :, pl.ds(q0, bq)], qm_smem4.at[wg, buf],
                                        qm_bar.at[2 * wg + buf])

            load_q(0, 0)
            k_slots.prime()
            v_slots.prime()
            km_slots.prime()
            pl.when(wg == 1)(sched.start)

            def tile_body(i, carry):
                g0, ends = carry[0], carry[1:]
                n_steps = ends[-1]
                nxt = steps_of(counts_ref, cta, i + 1, my_tiles)  # read a tile ahead, used at the next tile
                b, h, qt = tile_coords(cta, i)
                buf = rem(i, 2)
                qo_smem = qo_smem4.at[wg, buf]
                q0 = qt * (2 * bq) + wg * bq
                plgpu.barrier_wait(q_bar.at[2 * wg + buf])
                plgpu.barrier_wait(qm_bar.at[2 * wg + buf])
                q_marks = [plgpu.load(qm_smem4.at[wg, buf, j], layout=wgmma_rows) for j in range(2)]
                plgpu.barrier_wait(k_bar.at[rem(g0, stages)])
                early_q = i + 1 < my_tiles
                early_step = jnp.minimum(1, n_steps - 1)

                def kv_body(step, carry, group_rule):
                    g = g0 + step
                    slot = rem(g, stages)
                    apply_mask = step_mask(plgpu, group_rule, q_marks, (km_bar, km_smem, km_slots), slot)
                    wait_next_k = next_k_and_prefetch(plgpu, step=step, n_steps=n_steps, g=g, stages=stages,
                                                      k_bar=k_bar, early=early_q & (step == early_step),
                                                      prefetch=lambda: load_q(i + 1, 1 - buf))
                    return _fwd_kv_step(
                        plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot], v_tile=v_smem.at[slot],
                        k_release=lambda: k_slots.release(slot), v_ready=v_bar.at[slot],
                        v_release=lambda: v_slots.release(slot),
                        sched=sched, c=c, dtype=dtype, interpret=interpret,
                        apply_mask=apply_mask, wait_next_k=wait_next_k, pre=pre, may_be_empty=group_rule is not None)

                carry = walk_groups(kv_body, ends, rule, fresh_forward_tile(plgpu, bq, D))
                store_forward_tile(plgpu, carry, qo_smem=qo_smem, lse_smem=lse_smem, dtype=dtype,
                                   o_dst=o_ref.at[b, pl.ds(q0, bq), h], lse_dst=lse_ref.at[b, h, pl.ds(q0, bq)])
                return (g0 + n_steps,) + nxt

            lax.fori_loop(0, my_tiles, tile_body, (jnp.int32(0),) + steps_of(counts_ref, cta, 0, my_tiles))
            pl.when(wg == 0)(sched.finish)
            plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_wait_read_only)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def produce():
                slots_of = (k_slots, v_slots, km_slots)

                def tile_loads(i, g0):
                    b, h, qt = tile_coords(cta, i)
                    kvh = lax.div(h, jnp.int32(rep))
                    n_steps = jnp.maximum(counts_ref[b, qt, n_groups], 1)  # an empty list walks block 0

                    def load(j, _):
                        g = g0 + j
                        slot = rem(g, stages)
                        rows = pl.ds(blocks_ref[b, qt, j] * bkv, bkv)
                        for slots in slots_of:
                            wait_to_refill(slots, slot, g, stages)
                        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kvh], k_smem.at[slot], k_bar.at[slot])
                        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kvh], v_smem.at[slot], v_bar.at[slot])
                        plgpu.copy_gmem_to_smem(km_ref.at[b, :, rows], km_smem.at[slot], km_bar.at[slot])
                        return None

                    lax.fori_loop(0, n_steps, load, None)
                    return g0 + n_steps

                total = lax.fori_loop(0, my_tiles, tile_loads, jnp.int32(0))
                drain_rings(slots_of, total, stages)

            run_producer(plgpu, produce, single_warp=producer_warp)

    tr = smem_transforms(plgpu, dtype, D)
    i32 = jnp.int32
    scratch = [
        (
            plgpu.SMEM((2, 2, bq, D), dtype, transforms=tr),  # [warpgroup, buffer]: Q, then the tile's O
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, 2, 2, bq), i32),  # [warpgroup, buffer]: the queries' (segment, position)
            plgpu.SMEM((stages, 2, bkv), i32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=4),  # Q loaded, per (warpgroup, buffer)
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_barriers=4),  # query marks loaded, per (warpgroup, buffer)
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ),
    ]
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((B, H, S), jnp.float32))
    return warp_specialized_kernel(plgpu, body, out_type=out_type, scratch=scratch, grid=(n_ctas,),
                                   grid_names=("cta",), compute_wgs=2, interpret=interpret,
                                   name="te_jax_attn_fwd_masked_persistent", no_auto_barriers=producer_warp)(
        q, k, v, qm, km, counts, blocks)
