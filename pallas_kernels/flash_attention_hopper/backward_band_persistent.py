"""Hopper (sm90) dK/dV kernel for a band mask on a persistent grid: one CTA per SM walking key tiles.
Same arguments and outputs as backward._flash_bwd_dkv(band=...) with dK and dV both and no atomic dQ.
Mosaic GPU is imported lazily: this module imports on any machine.

Why: a narrow band (a sliding window) gives each key tile a short walk (about 18 query blocks for a (1024, 0) window
at 64-query blocks), so the grid kernel's per-tile prologue (the K/V load, the Q/dO ring filling) and epilogue
(staging and storing dK/dV) are not amortized. Here a CTA takes its key tiles in turn (snake_tile's dealing, in
(batch, KV head, key tile) order, so the CTAs running together share Q/dO in L2):
  * K/V are double-buffered per compute warpgroup: the next tile's slice is loaded while this tile walks (once
    the dK/dV store staged in that buffer two tiles back has been read out);
  * one Q / dO / lse / delta ring runs on across tiles (a global step counter), so the next tile's first query
    blocks load during this tile's last steps;
  * this tile's dK/dV are staged in its own K/V buffer and their store is not waited for.
HopperConfig.bwd_persistent_band (opt-in) chooses it; written without a GPU run (lowered for CUDA in CI).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import mosaic_gpu, pl
from .band import band_mask, query_blocks, walk_band
from .common import (backward_pT, div, dv_and_dpT, mma, mma_into, num_sms, rem, ring_slots, run_producer,
                     smem_transforms, warp_specialized_kernel, when)
from .config import HopperConfig, bwd_registers, dkv_geometry, logit_units, ring_choices
from .persistent_steps import drain_rings, snake_coords, tiles_of_cta, wait_to_refill


def _flash_bwd_dkv_band_persistent(q, k, v, do, lse2, delta, *, scale, cfg: HopperConfig, interpret: bool,
                                   softcap=None, band, big: int):
    """(dk [B, Skv, G, D], dv [B, Skv, G, D]) under the band (MaskRule.band(): key j sees query i iff lo <= j - i -
    offset <= hi), lse2 the base-2 lse [B, H, S] (rows without a key: 0), delta [B, H, S]; D == Dv <= 128."""
    plgpu = mosaic_gpu()
    B, S, H, D, Skv, G, rep, dtype, bq, bkv, wgs, nq, n_kt, stages = dkv_geometry(q, k, cfg)
    if v.shape[-1] != D:
        raise ValueError(f"the persistent band dK/dV kernel needs v's head_dim {v.shape[-1]} == q/k's {D}")
    c, pre = logit_units(scale, softcap)
    named_release, producer_warp = ring_choices(cfg, interpret, backward=True)
    regs, producer_regs = bwd_registers(cfg)
    n_tiles = B * G * n_kt
    n_ctas = min(cfg.bwd_ctas or num_sms(), n_tiles)

    def tile_coords(cta, i):  # -> batch, KV head, key tile of the CTA's i-th tile
        return snake_coords(cta, i, n_ctas, G, n_kt)

    def walk_of(kt):  # (first query block, blocks per head, masked lead, full end): band.query_blocks
        kv0 = kt * (wgs * bkv)
        return query_blocks(band, kv0, kv0 + wgs * bkv, bq, nq, big)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, smem, bars):
        k_smem4, v_smem4, q_smem, do_smem, lse_smem, delta_smem = smem
        kv_bar, q_bar, do_bar, lse_bar, delta_bar, q_cons, do_cons, lse_cons, delta_cons = bars
        q_slots, do_slots, lse_slots, delta_slots = ring_slots(
            plgpu, (q_cons, do_cons, lse_cons, delta_cons), stages, named=named_release,
            producer_warp=producer_warp, compute_wgs=wgs)
        all_slots = (q_slots, lse_slots, do_slots, delta_slots)
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cta")
        my_tiles = tiles_of_cta(cta, n_tiles, n_ctas)

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(regs, action="increase")

            def kv_rows(i):
                b, g, kt = tile_coords(cta, i)
                return b, pl.ds(kt * (wgs * bkv) + wg * bkv, bkv), g

            def load_kv(i, buf):
                sl = kv_rows(i)
                plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem4.at[buf, wg], kv_bar.at[4 * wg + 2 * buf])
                plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem4.at[buf, wg], kv_bar.at[4 * wg + 2 * buf + 1])

            load_kv(0, 0)
            for slots in all_slots:
                slots.prime()

            def step_body(t, qb, carry, masked: bool, *, k_smem, v_smem, kv0):
                """One query block qb (of the head the producer loaded at step t) against this warpgroup's keys
                [kv0, kv0 + bkv); t: the global ring step."""
                dk_acc, dv_acc = carry
                slot = rem(t, stages)
                plgpu.barrier_wait(q_bar.at[slot])
                pT, tT = backward_pT(plgpu, k_tile=k_smem, q_tile=q_smem.at[slot], lse_ready=lse_bar.at[slot],
                                     lse_tile=lse_smem.at[slot], lse_release=lambda: lse_slots.release(slot), c=c,
                                     pre=pre)  # softcap: tT, the tanh, for dS's 1 - tT^2
                if masked:  # rows are keys, columns queries
                    rows = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 1, layout=plgpu.Layout.WGMMA)
                    pT = band_mask(pT, rows - cols, qb * bq + band[0] - kv0, band)
                plgpu.barrier_wait(do_bar.at[slot])
                if interpret:
                    dv_acc = mma_into(plgpu, dv_acc, pT.astype(dtype), do_smem.at[slot], interpret=True)
                    dpT = mma(plgpu, (bkv, bq), v_smem, do_smem.at[slot].transpose((1, 0)))
                else:  # one wgmma group, a single wait
                    dv_acc, dpT = dv_and_dpT(plgpu, dv_acc, pT.astype(dtype), do_smem.at[slot], v_smem)
                do_slots.release(slot)
                plgpu.barrier_wait(delta_bar.at[slot])
                dl = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                dsT = pT * (dpT - lax.broadcast_in_dim(dl, (bkv, bq), [1]))
                if pre is not None:
                    dsT = dsT * (1.0 - tT * tT)
                delta_slots.release(slot)
                dk_acc = mma_into(plgpu, dk_acc, dsT.astype(dtype), q_smem.at[slot], interpret=interpret)
                q_slots.release(slot)
                return dk_acc, dv_acc

            def tile_body(i, g0):
                b, g, kt = tile_coords(cta, i)
                buf = rem(i, 2)
                k_smem, v_smem = k_smem4.at[buf, wg], v_smem4.at[buf, wg]
                kv0 = kt * (wgs * bkv) + wg * bkv
                q_first, n_h, flo, fhi = walk_of(kt)
                plgpu.barrier_wait(kv_bar.at[4 * wg + 2 * buf])
                plgpu.barrier_wait(kv_bar.at[4 * wg + 2 * buf + 1])
                # the previous tile's dK/dV store read out of the other buffer: the next tile's K/V go there
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                when(i + 1 < my_tiles, lambda: load_kv(i + 1, 1 - buf))
                zero = plgpu.layout_cast(jnp.full((bkv, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

                def head_body(h, carry):
                    base = g0 + h * n_h
                    return walk_band(lambda j, cr, masked: step_body(base + j, q_first + j, cr, masked, k_smem=k_smem,
                                                                     v_smem=v_smem, kv0=kv0), flo, fhi, n_h, carry)

                dk_acc, dv_acc = lax.fori_loop(0, rep, head_body, (zero, zero))
                k_smem[...] = (dk_acc * scale).astype(dtype)
                v_smem[...] = dv_acc.astype(dtype)
                plgpu.commit_smem()
                sl = (b, pl.ds(kv0, bkv), g)
                plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[sl], commit_group=False)
                plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[sl], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                return g0 + rep * n_h

            lax.fori_loop(0, my_tiles, tile_body, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_wait_read_only)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(producer_regs, action="decrease")

            def produce():
                def tile_loads(i, g0):
                    b, g, kt = tile_coords(cta, i)
                    q_first, n_h, _, _ = walk_of(kt)
                    per_head = jnp.maximum(n_h, 1)

                    def load(j, _):
                        step = g0 + j
                        slot = rem(step, stages)
                        hh, qb = g * rep + div(j, per_head), q_first + rem(j, per_head)
                        rows, vec = (b, pl.ds(qb * bq, bq), hh), (b, hh, pl.ds(qb * bq, bq))
                        for src, ring, loaded, slots in ((q_ref.at[rows], q_smem, q_bar, q_slots),
                                                         (lse_ref.at[vec], lse_smem, lse_bar, lse_slots),
                                                         (do_ref.at[rows], do_smem, do_bar, do_slots),
                                                         (delta_ref.at[vec], delta_smem, delta_bar, delta_slots)):
                            wait_to_refill(slots, slot, step, stages)
                            plgpu.copy_gmem_to_smem(src, ring.at[slot], loaded.at[slot])
                        return None

                    lax.fori_loop(0, rep * n_h, load, None)
                    return g0 + rep * n_h

                total = lax.fori_loop(0, my_tiles, tile_loads, jnp.int32(0))
                drain_rings(all_slots, total, stages)

            run_producer(plgpu, produce, single_warp=producer_warp)

    tr_d = smem_transforms(plgpu, dtype, D)
    scratch = [
        (
            plgpu.SMEM((2, wgs, bkv, D), dtype, transforms=tr_d),  # [buffer, warpgroup]: K, then the tile's dK
            plgpu.SMEM((2, wgs, bkv, D), dtype, transforms=tr_d),  # [buffer, warpgroup]: V, then the tile's dV
            plgpu.SMEM((stages, bq, D), dtype, transforms=tr_d),
            plgpu.SMEM((stages, bq, D), dtype, transforms=tr_d),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
        ),
        (plgpu.Barrier(num_barriers=4 * wgs),)  # K/V loaded, per (warpgroup, buffer, K or V)
        + (plgpu.Barrier(num_barriers=stages),) * 4
        + (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 4,
    ]
    out_type = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
    return warp_specialized_kernel(plgpu, body, out_type=out_type, scratch=scratch, grid=(n_ctas,),
                                   grid_names=("cta",), compute_wgs=wgs, interpret=interpret,
                                   name="te_jax_attn_bwd_dkdv_band_persistent",
                                   no_auto_barriers=producer_warp)(q, k, v, do, lse2, delta)
