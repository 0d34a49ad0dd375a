"""Hopper (sm90) flash-attention forward for a band mask on a persistent grid: one CTA per SM walking query tiles.
Same arguments and outputs as forward.flash_fwd(band=...)'s grid kernel, for bands where every query sees a key
(band.every_query_sees_a_key) and D == Dv.  Mosaic GPU is imported lazily: this module imports on any machine.

It is forward_masked_persistent's schedule (tiles dealt by snake_tile, one K/V ring across tiles, Q double-buffered
and prefetched during the tile's second step, O stores not waited for) with the band's walk in place of the
tables: each tile's K/V blocks come from band.key_blocks, the edge blocks masked from iotas; no pre-pass, no marks.
HopperConfig.fwd_persistent_band chooses it (auto: band.persistent_forward_band, wide causal windows and narrow
two-sided ones); its two warpgroups take turns through the hardware named barrier over wide bands and through
mbarriers over narrow ones (band.named_rendezvous).  Checked on an H100 (tests/test_flash_attention_hopper.py;
speed: benchmarks/results/attention_masks_h100.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import mosaic_gpu, pl
from .band import band_mask, key_blocks, walk_band
from .common import num_sms, rem, ring_slots, run_producer, smem_transforms, warp_specialized_kernel
from .config import HopperConfig, logit_units, rendezvous_named, ring_choices
from .forward_step import _Sched, _fwd_kv_step, fwd_geometry
from .persistent_steps import (drain_rings, fresh_forward_tile, next_k_and_prefetch, snake_coords, store_forward_tile,
                               tiles_of_cta, wait_to_refill)


def _flash_fwd_band_persistent(q, k, v, *, scale: float, cfg: HopperConfig, interpret: bool,
                               softcap: float | None, band, big: int):
    """(out [B, S, H, D], lse [B, H, S]) under the band (key j sees query i iff lo <= j - i - offset <= hi), on
    n_ctas CTAs (cfg.fwd_ctas or the SM count). Every query tile must see a key (its walk is not empty)."""
    plgpu = mosaic_gpu()
    B, S, H, D, Skv, G, rep, dtype, bq, bkv, n_kv, stages, n_qt = fwd_geometry(q, k, cfg)
    if v.shape[-1] != D:
        raise ValueError(f"the persistent band forward needs v's head_dim {v.shape[-1]} == q/k's {D}")
    c, pre = logit_units(scale, softcap)
    named = rendezvous_named(cfg, interpret, "persistent band", band)
    named_release, producer_warp = ring_choices(cfg, interpret, backward=False)
    n_tiles = B * H * n_qt
    n_ctas = min(cfg.fwd_ctas or num_sms(), n_tiles)

    def tile_coords(cta, i):  # -> batch, head, query tile of the CTA's i-th tile
        return snake_coords(cta, i, n_ctas, H, n_qt)

    def walk_of(qt):  # (first K/V block, steps, masked lead, full end) of query tile qt: band.key_blocks
        return key_blocks(band, qt * (2 * bq), (qt + 1) * (2 * bq), bkv, n_kv, big)

    def body(q_ref, k_ref, v_ref, o_ref, lse_ref, smem, bars):
        qo_smem4, k_smem, v_smem, lse_smem2 = smem
        k_bar, v_bar, q_bar, k_cons, v_cons, sched = bars
        k_slots, v_slots = ring_slots(plgpu, (k_cons, v_cons), stages, named=named_release,
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

            load_q(0, 0)
            k_slots.prime()
            v_slots.prime()
            pl.when(wg == 1)(sched.start)

            def tile_body(i, g0):
                b, h, qt = tile_coords(cta, i)
                k_first, n_steps, flo, fhi = walk_of(qt)
                buf = rem(i, 2)
                qo_smem = qo_smem4.at[wg, buf]
                q0 = qt * (2 * bq) + wg * bq
                with jax.named_scope("q_wait"):  # regions: common.profiling
                    plgpu.barrier_wait(q_bar.at[2 * wg + buf])
                with jax.named_scope("k0_wait"):
                    plgpu.barrier_wait(k_bar.at[rem(g0, stages)])
                early_q = i + 1 < my_tiles
                early_step = jnp.minimum(1, n_steps - 1)

                def kv_body(step, carry, masked: bool):
                    g = g0 + step
                    slot = rem(g, stages)
                    wait_next_k = next_k_and_prefetch(plgpu, step=step, n_steps=n_steps, g=g, stages=stages,
                                                      k_bar=k_bar, early=early_q & (step == early_step),
                                                      prefetch=lambda: load_q(i + 1, 1 - buf))

                    def apply_band(x):  # rows are queries, columns keys
                        rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
                        cols = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=plgpu.Layout.WGMMA)
                        return band_mask(x, cols - rows, q0 + band[0] - (k_first + step) * bkv, band, -jnp.inf)

                    return _fwd_kv_step(
                        plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot], v_tile=v_smem.at[slot],
                        k_release=lambda: k_slots.release(slot), v_ready=v_bar.at[slot],
                        v_release=lambda: v_slots.release(slot),
                        sched=sched, c=c, dtype=dtype, interpret=interpret, wait_next_k=wait_next_k, pre=pre,
                        apply_mask=apply_band if masked else None, may_be_empty=masked)

                with jax.named_scope("steps"):
                    carry = walk_band(kv_body, flo, fhi, n_steps, fresh_forward_tile(plgpu, bq, D))
                with jax.named_scope("epilogue"):
                    store_forward_tile(plgpu, carry, qo_smem=qo_smem, lse_smem=lse_smem, dtype=dtype,
                                       o_dst=o_ref.at[b, pl.ds(q0, bq), h], lse_dst=lse_ref.at[b, h, pl.ds(q0, bq)])
                return g0 + n_steps

            lax.fori_loop(0, my_tiles, tile_body, jnp.int32(0))
            pl.when(wg == 0)(sched.finish)
            plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_wait_read_only)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def produce():
                # the CTA's steps in order: tile i's K/V blocks k_first .. k_first + steps - 1, tile after tile
                def tile_loads(i, g0):
                    b, h, qt = tile_coords(cta, i)
                    k_first, n_steps, _, _ = walk_of(qt)
                    kvh = lax.div(h, jnp.int32(rep))

                    def load(j, _):
                        g = g0 + j
                        slot = rem(g, stages)
                        rows = (b, pl.ds((k_first + j) * bkv, bkv), kvh)
                        for slots, src, ring, loaded in ((k_slots, k_ref, k_smem, k_bar), (v_slots, v_ref, v_smem,
                                                                                             v_bar)):
                            wait_to_refill(slots, slot, g, stages)
                            plgpu.copy_gmem_to_smem(src.at[rows], ring.at[slot], loaded.at[slot])
                        return None

                    lax.fori_loop(0, n_steps, load, None)
                    return g0 + n_steps

                total = lax.fori_loop(0, my_tiles, tile_loads, jnp.int32(0))
                drain_rings((k_slots, v_slots), total, stages)

            run_producer(plgpu, produce, single_warp=producer_warp)

    tr = smem_transforms(plgpu, dtype, D)
    scratch = [
        (
            plgpu.SMEM((2, 2, bq, D), dtype, transforms=tr),  # [warpgroup, buffer]: Q, then the tile's O
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((2, bq), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=4),  # Q loaded, per (warpgroup, buffer)
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ),
    ]
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((B, H, S), jnp.float32))
    return warp_specialized_kernel(plgpu, body, out_type=out_type, scratch=scratch, grid=(n_ctas,),
                                   grid_names=("cta",), compute_wgs=2, interpret=interpret,
                                   name="te_jax_attn_fwd_band_persistent", no_auto_barriers=producer_warp)(q, k, v)
