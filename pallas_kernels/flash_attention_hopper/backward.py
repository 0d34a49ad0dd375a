"""Hopper (sm90) flash-attention backward in Pallas Mosaic GPU: warp specialised, TMA ring.

  * dK/dV: a CTA owns `wgs` x block_kv key rows of one KV head and loops over every query head of its
    GQA group and every query block (causal: only those at or below the diagonal), accumulating dK and
    dV in registers.  For head_dim 256 dK and dV run as two launches (two 64x256 fp32 accumulators do
    not fit in one warpgroup's registers).
  * dQ, either (bwd_dq_atomic; auto = atomic for head_dim 64 and 128 from 2k keys):
    - atomic: inside the dK/dV kernel.  The CTA's dS tile goes to shared memory; warpgroup w computes
      its share of the step's dQ block over all of the CTA's keys (hd128: columns w*D/2:(w+1)*D/2;
      hd64 with 128-row query blocks: rows w*64:(w+1)*64) and adds it to an fp32 buffer with a TMA
      reduce-add (5 matmuls per block pair);
    - a separate dQ kernel: a CTA owns `wgs` x block_q query rows and loops over K/V blocks
      (recomputes S and dP: 7 matmuls per block pair, no fp32 buffer).
  * non-causal, from 4k keys (bwd_split_tail): the last n_tiles % SMs key tiles are cut into pieces of their
    query walk, one CTA each (config.PieceSplit); their dK / dV partials are summed after the kernel.
All recompute P from the saved log-sum-exp.  Mosaic GPU is imported lazily.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._compat import mosaic_gpu, pl

from .._lower_once import lower_once

from .aligned_tiles import ROW_ALIGN, aligned_backward_tables, gather_row_values, merge_shared_groups
from .common import (backward_pT, cdiv, div, dv_and_dpT, mma, mma_into, num_sms, rem, resolve_interpret, ring_slots,
                     run_producer, smem_transforms, store_planned, stream_ring, warp_specialized_kernel)
from .backward_band_persistent import _flash_bwd_dkv_band_persistent
from .band import band_big, band_mask, key_blocks, query_blocks, walk_band
from .data_mask import DataMask, backward_rule, backward_tables, walk_groups
from .config import (LOG2E, HopperConfig, PieceSplit, aligned_backward_chosen, atomic_dq_chosen, bwd_registers,
                     check_lengths, default_config, delta_in_dq, dkv_geometry, dkv_together, dq_split, logit_units,
                     masked_atomic_dq_chosen, persistent_band_bwd_chosen, piece_split_chosen, ring_choices)


# --------------------------------------------------------------------------------------------
# Backward: dK/dV
# --------------------------------------------------------------------------------------------
def _flash_bwd_dkv(q, k, v, do, lse2, delta, *, scale, causal, cfg: HopperConfig,
                   want_dk: bool, want_dv: bool, interpret: bool, dq_acc_ref=None, softcap=None, kv_valid=None,
                   data_mask=None, band=None):
    """data_mask (a DataMask): the key tile's query-block walk is [lo, hi) of its bounds row (mask.loop_bounds on the
    transposed block classes), computed without the element mask on [flo, fhi); no PieceSplit, no reversal.
    band (MaskRule.band(): (offset, lo, hi)): key j sees query i iff lo <= j - i - offset <= hi; the key tile walks
    the query blocks of its band (band.query_blocks), masking the two edges.  Where data_mask's tables hold
    aligned_dkv (HopperConfig.bwd_aligned), the key tiles and the query blocks they walk are document-aligned
    (aligned_tiles): dK / dV are stored in token order by plan and the groups tiles share merged after the kernel."""
    plgpu = mosaic_gpu()
    B, S, H, D, Skv, G, rep, dtype, bq, bkv, wgs, nq, n_kt, stages = dkv_geometry(q, k, cfg)
    aligned = data_mask.tables.aligned_dkv if data_mask is not None else None
    if aligned is not None:
        n_kt = aligned.tile_rows.shape[1]
    Dv = v.shape[-1]  # v's head_dim (may differ from q/k's D: no atomic dQ, no PieceSplit then)
    c, pre = logit_units(scale, softcap)
    split = cfg.split_causal
    reverse = causal and cfg.bwd_causal_reverse is not False  # None (auto) = reverse
    dm = data_mask
    named_release, producer_warp = ring_choices(cfg, interpret, backward=True)
    regs, producer_regs = bwd_registers(cfg)

    want_dq = dq_acc_ref is not None
    # atomic dQ: the CTA's `wgs` warpgroups share one (bq x wgs*bkv) dS tile through shared
    # memory; warpgroup w computes its share of the step's (bq x D) dQ block over all of the CTA's
    # keys: columns [w*D/wgs, ...) of every row (dq_split "cols", hd128) or rows [w*bq/wgs, ...) of
    # every column ("rows", hd64 with 128-row query blocks).  So each query block gets ONE fp32
    # reduce-add of bq x D per CTA step (not one per warpgroup).
    dq_by = dq_split(D, cfg) if want_dq else None
    dq_rows, dq_cols = (bq // wgs, D) if dq_by == "rows" else (bq, D // wgs)
    if want_dq and not want_dk:
        raise ValueError("atomic dQ rides on the dK pass")
    if want_dq and dq_by is None:
        raise ValueError(f"atomic dQ: no 64-wide share per warpgroup for head_dim {D}, {cfg}")
    if want_dq and Dv != D:
        raise ValueError(f"atomic dQ needs equal q/k and v head_dims (got {D} and {Dv})")

    steps = rep * nq  # a non-causal key tile's walk
    plain_walk = not causal and dm is None and band is None and Dv == D
    plan = piece_split_chosen(cfg, G * n_kt * B, steps, cfg.bwd_ctas or num_sms(), Skv) if plain_walk else None
    n_grads = int(want_dk) + int(want_dv)

    def tile_coords(tile):
        # The 3-D grid's launch order: Mosaic GPU reverses the grid for CUDA (its last axis, batch, is the fastest),
        # so CTAs running together are the key tiles of one kv head (they share its Q / dO in L2).  -> batch, kv
        # head, key tile.  (With the kv head fastest instead, the CTAs running together share less and it is slower.)
        return rem(tile, B), div(tile, B * n_kt), rem(div(tile, B), n_kt)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if dm is not None:
            (qm_ref, km_ref, counts_ref, blocks_ref), rest = rest[:4], rest[4:]
        if aligned is not None:  # the key tiles' first rows, their query blocks' rows, their store plans
            (tile_rows_ref, block_rows_ref, plan_ref), rest = rest[:3], rest[3:]
        if want_dq:
            dq_ref, rest = rest[0], rest[1:]
        outs = rest[: n_grads * (2 if plan is not None or aligned is not None else 1)]
        smem, bars = rest[len(outs):]
        if dm is not None:
            (kvm_smem2, qm_ring), smem = smem[-2:], smem[:-2]
            (kvm_bar, qm_bar, qm_cons), bars = bars[-3:], bars[:-3]
        dk_ref = outs[0] if want_dk else None
        dv_ref = outs[n_grads - 1] if want_dv else None
        part_refs = outs[n_grads:]  # plan: partial dK / dV of the pieces [piece CTAs, hi/lo, rows, D]
        shared_dk = part_refs[0] if aligned is not None and want_dk else None  # aligned: the shared groups
        shared_dv = part_refs[-1] if aligned is not None and want_dv else None
        k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem = smem[:6]
        if want_dq:
            ds_smem3, dq_smem2 = smem[6:]
            bars, ds_ready = bars[:-1], bars[-1]
        (kv_bar, q_bar, do_bar, lse_bar, delta_bar,
         q_cons, do_cons, lse_cons, delta_cons) = bars
        rings = (q_cons, do_cons, lse_cons, delta_cons) + ((qm_cons,) if dm is not None else ())
        rings = ring_slots(plgpu, rings, stages, named=named_release, producer_warp=producer_warp, compute_wgs=wgs)
        q_cons, do_cons, lse_cons, delta_cons = rings[:4]
        if dm is not None:
            qm_cons = rings[4]
        wg = lax.axis_index("wg")
        if plan is None:
            b = lax.axis_index("batch")
            g = lax.axis_index("kv_heads")
            kt = lax.axis_index("kv_seq")
        else:
            # PieceSplit: CTA x < n_whole runs key tile x, steps [0, steps); piece CTA j = x - n_whole runs piece
            # j // rest of tile n_whole + j % rest (PieceSplit.cta_work).
            x = lax.axis_index("cta")
            piece_cta = x - plan.n_whole
            whole_cta = x < plan.n_whole
            k_piece = div(piece_cta, plan.rest)
            b, g, kt = tile_coords(jnp.where(whole_cta, x, plan.n_whole + rem(piece_cta, plan.rest)))
            lo = jnp.where(whole_cta, 0, div(k_piece * steps, plan.pieces))
            hi = jnp.where(whole_cta, steps, div((k_piece + 1) * steps, plan.pieces))
        # No reversal here (unlike the forward and dQ kernels): the GPU launches CTAs in grid order (kv_seq
        # ascending within a head), and causal key tile 0 sees every query, so ascending order already starts
        # the heaviest tiles first and leaves the light ones for the tail.  Reversed, the heaviest tile of the
        # last head would run alone at the end with the other SMs idle.
        kv_cta0 = kt * (wgs * bkv)  # the tile's first row in the keys' marks (and in k, v off aligned tiles)
        active = True if aligned is None else tile_rows_ref[b, kt] >= 0  # aligned: an unused tile exits
        q_lo = lax.div(kv_cta0, jnp.int32(bq)) if causal else 0
        if dm is not None:  # the visible query blocks of this key tile, the partial groups first (block_lists)
            dm_ends = [counts_ref[b, kt, j] for j in range(len(dm.rule.partial_rules()) + 1)]
            n_steps_h = dm_ends[-1]
        elif band is not None:  # the query blocks of this key tile's band: masked, full, masked
            q_first, n_steps_h, band_flo, band_fhi = query_blocks(band, kv_cta0, kv_cta0 + wgs * bkv, bq, nq,
                                                                  band_big(band, S, Skv))
        else:
            n_steps_h = nq - q_lo  # query blocks per query head
        # query blocks [q_lo, q_lo + n_mask) cross the diagonal of this CTA's keys
        if causal:
            n_mask = (cdiv(kv_cta0 + wgs * bkv, bq) - q_lo) if split else n_steps_h
        total = rep * n_steps_h
        n_div = jnp.maximum(n_steps_h, 1) if dm is not None or band is not None else n_steps_h  # may be empty

        def query_block(j):  # the j-th query block of a head's walk
            if dm is not None:
                return blocks_ref[b, kt, j]
            if band is not None:
                return q_first + j
            return (nq - 1) - j if reverse else q_lo + j

        def step_coords(t):
            return g * rep + div(t, n_div), query_block(rem(t, n_div))

        def _compute(wq):
            # wq: this warpgroup's index as a Python int when dQ is accumulated here (its dQ share
            # is a static slice of the swizzled K or dS tiles); refs are indexed with `wg`.
            plgpu.set_max_registers(regs, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]

            def load_kv(bb, gg, ktile):
                kv0 = ktile * (wgs * bkv) + wg * bkv
                row = kv0 if aligned is None else tile_rows_ref[bb, ktile] * ROW_ALIGN + wg * bkv
                sl = (bb, pl.ds(row, bkv), gg)
                plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem, kv_bar.at[2 * wg])
                plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem, kv_bar.at[2 * wg + 1])
                if dm is not None:
                    plgpu.copy_gmem_to_smem(km_ref.at[bb, :, pl.ds(kv0, bkv)], kvm_smem2.at[wg], kvm_bar.at[wg])
                return kv0, sl

            def prime_rings():
                for ring in (q_cons, do_cons, lse_cons, delta_cons) + ((qm_cons,) if dm is not None else ()):
                    ring.prime()

            key_marks = []  # (segment, position) of this warpgroup's keys, data mask only

            def fresh_accumulators():
                plgpu.barrier_wait(kv_bar.at[2 * wg])
                plgpu.barrier_wait(kv_bar.at[2 * wg + 1])
                if dm is not None:
                    plgpu.barrier_wait(kvm_bar.at[wg])
                    key_marks[:] = [plgpu.load(kvm_smem2.at[wg, i], layout=plgpu.Layout.WGMMA.reduce(1))
                                    for i in range(2)]
                def zero(d):
                    return plgpu.layout_cast(jnp.full((bkv, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

                z = zero(D)
                return (z if want_dk else None), ((z if Dv == D else zero(Dv)) if want_dv else None)

            def step_body(t, qb, carry, masked: bool, *, hh, bb, kv0, dm_rule=None):
                """One query block of query head hh against this warpgroup's keys.  t: the CTA's ring step (its Q /
                dO / lse / delta slot and its dS buffer).  dm_rule: the data mask's element mask for this step (a
                group of MaskRule.partial_rules), None for a full block."""
                dm_masked = dm_rule is not None
                dk_acc, dv_acc = carry
                slot = rem(t, stages)
                plgpu.barrier_wait(q_bar.at[slot])
                pT, tT = backward_pT(plgpu, k_tile=k_smem, q_tile=q_smem.at[slot], lse_ready=lse_bar.at[slot],
                                     lse_tile=lse_smem.at[slot], lse_release=lambda: lse_cons.release(slot), c=c,
                                     pre=pre)  # softcap: tT, the tanh, for dS's 1 - tT^2
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 1, layout=plgpu.Layout.WGMMA)
                    if band is None:
                        pT = jnp.where(cols + qb * bq >= rows + kv0, pT, 0.0)
                    else:  # rows are keys, columns queries
                        pT = band_mask(pT, rows - cols, qb * bq + band[0] - kv0, band)
                if kv_valid is not None:  # padded keys (non-causal, every step)
                    rows = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0, layout=plgpu.Layout.WGMMA)
                    pT = jnp.where(rows + kv0 < kv_valid, pT, 0.0)
                if dm is not None:  # the queries' (segment, position) rows are streamed every step
                    plgpu.barrier_wait(qm_bar.at[slot])
                    if dm_masked:
                        q_seg, q_pos = (plgpu.load(qm_ring.at[slot, i], layout=plgpu.Layout.WGMMA.reduce(0))
                                        for i in range(2))
                    qm_cons.release(slot)
                    if dm_masked:
                        pT = dm_rule.apply(pT, (q_seg, q_pos), key_marks, 0.0, q_axis=1)
                plgpu.barrier_wait(do_bar.at[slot])
                if want_dv and want_dk and not interpret:  # one wgmma group, a single wait
                    dv_acc, dpT = dv_and_dpT(plgpu, dv_acc, pT.astype(dtype), do_smem.at[slot], v_smem)
                else:
                    if want_dv:
                        dv_acc = mma_into(plgpu, dv_acc, pT.astype(dtype), do_smem.at[slot],
                                           interpret=interpret)
                    if want_dk:
                        dpT = mma(plgpu, (bkv, bq), v_smem, do_smem.at[slot].transpose((1, 0)))
                do_cons.release(slot)
                if want_dk:
                    plgpu.barrier_wait(delta_bar.at[slot])
                    delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                    dsT = pT * (dpT - lax.broadcast_in_dim(delta, (bkv, bq), [1]))
                    if pre is not None:
                        dsT = dsT * (1.0 - tT * tT)
                    delta_cons.release(slot)
                    dsT16 = dsT.astype(dtype)
                    if want_dq and not interpret:
                        buf = rem(t, 2)  # dS is double buffered: one 2-arrival barrier per step
                        ds_smem3.at[buf, wg][...] = dsT16
                        plgpu.commit_smem()  # generic-proxy stores -> visible to wgmma
                        plgpu.barrier_arrive(ds_ready.at[buf])
                        zq = plgpu.layout_cast(jnp.full((dq_rows, dq_cols), 0.0, jnp.float32),
                                               plgpu.Layout.WGMMA)

                        def _dk_dq(refs):
                            dk_r, dq_r = refs
                            plgpu.wgmma(dk_r, dsT16, q_smem.at[slot])
                            plgpu.barrier_wait(ds_ready.at[buf])  # every warpgroup's dS stored
                            for w in range(wgs):  # dQ share += dS[rows, keys of w] @ K_w[:, cols]
                                if dq_by == "rows":
                                    a = ds_smem3.at[buf, w, :, pl.ds(wq * dq_rows, dq_rows)]
                                    kb = k_smem2.at[w]
                                else:
                                    a = ds_smem3.at[buf, w]
                                    kb = k_smem2.at[w, :, pl.ds(wq * dq_cols, dq_cols)]
                                plgpu.wgmma(dq_r, a.transpose((1, 0)), kb)

                        dk_acc, dq_part = pl.run_state(_dk_dq)((plgpu.ACC.init(dk_acc),
                                                                plgpu.ACC.init(zq)))
                        # the previous step's reduce-add must have read dq_smem
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        dq_smem2.at[wg][...] = dq_part
                        plgpu.commit_smem()
                        r0, c0 = (wq * dq_rows, 0) if dq_by == "rows" else (0, wq * dq_cols)
                        plgpu.copy_smem_to_gmem(
                            dq_smem2.at[wg],
                            dq_ref.at[bb, pl.ds(qb * bq + r0, dq_rows), hh, pl.ds(c0, dq_cols)],
                            reduction_op="add")
                    else:
                        dk_acc = mma_into(plgpu, dk_acc, dsT16, q_smem.at[slot],
                                           interpret=interpret)
                else:
                    plgpu.barrier_wait(delta_bar.at[slot])
                    delta_cons.release(slot)
                q_cons.release(slot)
                return dk_acc, dv_acc

            def k_tile_released(ds_t):
                if want_dq and not interpret:
                    # the other warpgroups' last dQ wgmma reads this K tile: wait for them before
                    # the tile is overwritten with dK (one more phase of the dS barrier)
                    plgpu.barrier_arrive(ds_ready.at[rem(ds_t, 2)])
                    plgpu.barrier_wait(ds_ready.at[rem(ds_t, 2)])

            def write_grads(dk_acc, dv_acc, sl):
                if want_dk:
                    k_smem[...] = (dk_acc * scale).astype(dtype)
                if want_dv:
                    v_smem[...] = dv_acc.astype(dtype)
                plgpu.commit_smem()
                if aligned is not None:  # the tile's own groups in place, the shared ones to the side buffers
                    for tile, ref, side in ((k_smem, dk_ref, shared_dk), (v_smem, dv_ref, shared_dv)):
                        if ref is not None:
                            store_planned(plgpu, tile, ref, side, plan_ref, b, g, kt, wg, tile_rows_ref, bkv)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_wait_read_only)
                    return
                if want_dk:
                    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[sl], commit_group=False)
                if want_dv:
                    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[sl], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_wait_read_only)

            def whole_tile():  # the CTA's key tile (b, g, kt), every step: straight-line code, as without a plan
                kv0, sl = load_kv(b, g, kt)
                prime_rings()
                carry = fresh_accumulators()

                def head_body(i, carry):
                    base = i * n_steps_h
                    hh = g * rep + i

                    def walk(lo, hi, carry, masked):
                        def body(j, carry):
                            return step_body(base + j, query_block(j), carry, masked=masked, hh=hh, bb=b, kv0=kv0)

                        return lax.fori_loop(lo, hi, body, carry)

                    if dm is not None:  # group by group, the full blocks last
                        return walk_groups(lambda j, carry, group_rule: step_body(
                            base + j, query_block(j), carry, masked=False, hh=hh, bb=b, kv0=kv0, dm_rule=group_rule),
                            dm_ends, dm.rule, carry)
                    if band is not None:
                        return walk_band(lambda j, carry, masked: step_body(
                            base + j, query_block(j), carry, masked=masked, hh=hh, bb=b, kv0=kv0),
                            band_flo, band_fhi, n_steps_h, carry)
                    if reverse:  # from the last query block down: the diagonal blocks come last
                        carry = walk(0, n_steps_h - n_mask, carry, masked=False)
                        return walk(n_steps_h - n_mask, n_steps_h, carry, masked=True)
                    if causal:
                        carry = walk(0, n_mask, carry, masked=True)
                        return walk(n_mask, n_steps_h, carry, masked=False)
                    return walk(0, n_steps_h, carry, masked=False)

                dk_acc, dv_acc = lax.fori_loop(0, rep, head_body, carry)
                k_tile_released(total)
                write_grads(dk_acc, dv_acc, sl)

            def piece():  # PieceSplit: query steps [lo, hi) of the key tile (b, g, kt); the whole walk or a piece
                kv0, sl = load_kv(b, g, kt)
                prime_rings()
                carry = fresh_accumulators()

                def piece_step(t, carry):
                    hh, qb = step_coords(t)
                    return step_body(t - lo, qb, carry, masked=False, hh=hh, bb=b, kv0=kv0)

                dk_acc, dv_acc = lax.fori_loop(lo, hi, piece_step, carry)
                k_tile_released(hi - lo)

                def partial_grads():
                    # fp32 partial sums as hi + lo in q.dtype, staged through the K and V tiles (dK first, then dV)
                    rows = pl.ds(wg * bkv, bkv)
                    # (recomputed here: Mosaic GPU's interpreter hangs when the body-level value indexes this copy)
                    piece_index = lax.axis_index("cta") - plan.n_whole
                    grads = ([dk_acc * scale] if want_dk else []) + ([dv_acc] if want_dv else [])
                    for val, part_ref in zip(grads, part_refs):
                        hi16 = val.astype(dtype)
                        k_smem[...] = hi16
                        v_smem[...] = (val - hi16.astype(jnp.float32)).astype(dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(k_smem, part_ref.at[piece_index, 0, rows], commit_group=False)
                        plgpu.copy_smem_to_gmem(v_smem, part_ref.at[piece_index, 1, rows], commit_group=False)
                        plgpu.commit_smem_to_gmem_group()
                        plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_wait_read_only)

                pl.when(whole_cta)(lambda: write_grads(dk_acc, dv_acc, sl))
                pl.when(jnp.logical_not(whole_cta))(partial_grads)

            if plan is None:
                whole_tile()
            elif interpret:
                piece()  # every CTA through the piece path (the interpreter hangs on body-level TMA indices in branches)
            else:
                # whole tiles run the 3-D grid's static heads x blocks loops; pieces the flat loop
                pl.when(whole_cta)(whole_tile)
                pl.when(jnp.logical_not(whole_cta))(piece)

        if want_dq:
            for w in range(wgs):
                pl.when(wg == w)(functools.partial(_compute, w))
        else:
            pl.when((wg < wgs) & active)(functools.partial(_compute, None))

        @pl.when((wg == wgs) & active)
        def _memory():
            plgpu.set_max_registers(producer_regs, action="decrease")

            def rows(t):  # (q / dO slice, lse / delta slice, the queries' marks' rows) of ring step t
                hh, qb = step_coords(t if plan is None else lo + t)
                marks = pl.ds(qb * bq, bq)
                row = marks if aligned is None else pl.ds(block_rows_ref[b, kt, rem(t, n_div)] * ROW_ALIGN, bq)
                return (b, row, hh), (b, hh, row), marks

            run_producer(plgpu, lambda: stream_ring(
                plgpu, total if plan is None else hi - lo, stages, rows,
                [(lambda r: q_ref.at[r[0]], q_smem, q_bar, q_cons),
                 (lambda r: lse_ref.at[r[1]], lse_smem, lse_bar, lse_cons),
                 (lambda r: do_ref.at[r[0]], do_smem, do_bar, do_cons),
                 (lambda r: delta_ref.at[r[1]], delta_smem, delta_bar, delta_cons)]
                + ([(lambda r: qm_ref.at[b, :, r[2]], qm_ring, qm_bar, qm_cons)] if dm is not None else [])),
                single_warp=producer_warp)

    # dK += dS^T . Q and dV += P^T . dO contract over the bq query rows: their swizzle's row must divide bq
    most = min(128, bq * jnp.dtype(dtype).itemsize)
    tr = smem_transforms(plgpu, dtype)
    tr_d, tr_v = smem_transforms(plgpu, dtype, D, most), smem_transforms(plgpu, dtype, Dv, most)
    scratch = [
        (
            plgpu.SMEM((wgs, bkv, D), dtype, transforms=tr_d),
            plgpu.SMEM((wgs, bkv, Dv), dtype, transforms=tr_v),
            plgpu.SMEM((stages, bq, D), dtype, transforms=tr_d),
            plgpu.SMEM((stages, bq, Dv), dtype, transforms=tr_v),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
        ) + ((
            plgpu.SMEM((2, wgs, bkv, bq), dtype, transforms=tr),
            plgpu.SMEM((wgs, dq_rows, dq_cols), jnp.float32),
        ) if want_dq else ()),
        (plgpu.Barrier(num_barriers=2 * wgs),)
        + (plgpu.Barrier(num_barriers=stages),) * 4
        + (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 4
        + ((plgpu.Barrier(num_arrivals=wgs, num_barriers=2),) if want_dq else ())
        + ((plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)) if dm is not None else ()),
    ]
    if dm is not None:
        scratch[0] = scratch[0] + (plgpu.SMEM((wgs, 2, bkv), jnp.int32), plgpu.SMEM((stages, 2, bq), jnp.int32))
    out_type = []
    if want_dk:
        out_type.append(jax.ShapeDtypeStruct(k.shape, dtype))
    if want_dv:
        out_type.append(jax.ShapeDtypeStruct(v.shape, dtype))
    if plan is not None:
        out_type += [jax.ShapeDtypeStruct((plan.rest * plan.pieces, 2, wgs * bkv, D), dtype)] * n_grads
    if aligned is not None:  # the groups a key tile shares with a neighbouring run's tile, per gradient
        out_type += [jax.ShapeDtypeStruct((B, n_kt, 2, ROW_ALIGN, G, d), dtype)
                     for d, want in ((D, want_dk), (Dv, want_dv)) if want]
    outputs = ("dk" if want_dk else "") + ("dv" if want_dv else "") + ("dq" if want_dq else "")
    grid, grid_names = ((G, n_kt, B), ("kv_heads", "kv_seq", "batch")) if plan is None else (
        (plan.n_ctas,), ("cta",))
    tables = () if dm is None else dm.kernel_args("dkv") if aligned is None else aligned.kernel_args()
    outs = warp_specialized_kernel(plgpu, body, out_type=tuple(out_type), scratch=scratch, grid=grid,
                                   grid_names=grid_names, compute_wgs=wgs,
                                   interpret=interpret,
                                   name=f"te_jax_attn_bwd_{outputs}" + ("" if aligned is None else "_aligned"),
                                   no_auto_barriers=producer_warp)(
        q, k, v, do, lse2, delta, *tables, *((dq_acc_ref,) if want_dq else ()))
    if aligned is not None:  # the shared groups summed into place
        return merge_shared_groups(tuple(outs[:n_grads]), tuple(outs[n_grads:]), aligned.tile_rows, aligned.stores,
                                   interpret=interpret)
    if plan is None:
        return tuple(outs)
    return tuple(_sum_pieces(grad, part, plan=plan, B=B, n_kt=n_kt, rows=wgs * bkv)
                 for grad, part in zip(outs[:n_grads], outs[n_grads:]))


def _sum_pieces(grad, part, *, plan: PieceSplit, B: int, n_kt: int, rows: int):
    """Write the key tiles that PieceSplit cut into pieces: the sum of their pieces' partial gradients.

    grad [B,Skv,G,D] (dK or dV); part [pieces * rest, 2 (hi, lo), rows, D] q.dtype, piece k of cut tile i at
    k * rest + i.  Tiles are numbered in the 3-D grid's launch order (batch fastest, then key tile, then kv head).
    """
    tiles = plan.n_whole + np.arange(plan.rest, dtype=np.int32)
    b, g, kt = tiles % B, tiles // (B * n_kt), (tiles // B) % n_kt  # _flash_bwd_dkv's tile_coords
    total = part.astype(jnp.float32).reshape(plan.pieces, plan.rest, 2, rows, -1).sum(axis=(0, 2))  # [rest, rows, D]
    row_idx = kt[:, None] * rows + np.arange(rows, dtype=np.int32)[None]
    return grad.at[b[:, None], row_idx, g[:, None]].set(total.astype(grad.dtype), unique_indices=True)


# --------------------------------------------------------------------------------------------
# Backward: dQ
# --------------------------------------------------------------------------------------------
def _flash_bwd_dq(q, k, v, do, lse2, delta, *, scale, causal, cfg: HopperConfig,
                  interpret: bool, softcap=None, kv_valid=None, data_mask=None, band=None, out=None, dlse=None):
    """dq [B, S, H, D].  data_mask (a DataMask): the query tile's K/V walk is [lo, hi) of its bounds row, unmasked on
    [flo, fhi).  band (MaskRule.band()): the query tile walks the K/V blocks of its band (band.key_blocks), masking
    the two edges.  out (the forward's O [B, S, H, Dv], with delta None): the kernel computes delta = rowsum(O * dO)
    - dlse [B, H, S] (dlse: the cotangent on the natural-log lse, or None) from its tiles in fp32 and returns
    (dq, delta) (HopperConfig.bwd_delta_in_dq).  Where data_mask's tables hold aligned_dq (HopperConfig.bwd_aligned),
    the query tiles are document-aligned (aligned_tiles): dq comes back as (dq [B, S, H, D] but for the groups tiles
    share, shared [B, T, 2, ROW_ALIGN, H, D]) for aligned_tiles.merge_shared_groups, and a computed delta in the
    tiles' layout [B, H, T * wgs * bq] (aligned_tiles.gather_row_values brings it back); flash_bwd does both."""
    if (out is None) == (delta is None) or (dlse is not None and out is None):
        raise ValueError("_flash_bwd_dq: pass delta, or out (and dlse) to compute it in the kernel")
    fuse_delta = out is not None
    has_dlse = dlse is not None
    plgpu = mosaic_gpu()
    dm = data_mask
    aligned = dm.tables.aligned_dq if dm is not None else None
    B, S, H, D = q.shape
    Dv = v.shape[-1]
    Skv, G = k.shape[1], k.shape[2]
    rep = H // G
    dtype = q.dtype
    bq, bkv, wgs = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_wgs
    n_qt = S // (wgs * bq) if aligned is None else aligned.tile_rows.shape[1]
    n_kv = Skv // bkv
    stages = cfg.bwd_stages
    c, pre = logit_units(scale, softcap)
    split = cfg.split_causal
    named_release, producer_warp = ring_choices(cfg, interpret, backward=True)
    regs, producer_regs = bwd_registers(cfg)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        # fuse_delta: delta_ref is O [B, S, H, Dv] (then dlse [B, H, S] if has_dlse), delta [B, H, S] an output
        if has_dlse:
            dlse_ref, rest = rest[0], rest[1:]
        if dm is not None:
            (qm_ref, km_ref, counts_ref, blocks_ref), rest = rest[:4], rest[4:]
        if aligned is not None:  # the tiles' first rows, their blocks' rows, their store plans (aligned_tiles)
            (tile_rows_ref, block_rows_ref, plan_ref), rest = rest[:3], rest[3:]
        outs, (smem, bars) = rest[:-2], rest[-2:]
        dq_ref = outs[0]
        shared_ref = outs[-1] if aligned is not None else None
        if fuse_delta:
            delta_out_ref = outs[1]
            o_smem2, smem = smem[-1], smem[:-1]
            if has_dlse:
                (dlse_smem2, dlse_bar), smem, bars = (smem[-1], bars[-1]), smem[:-1], bars[:-1]
        if dm is not None:
            (qm_smem2, km_smem), smem = smem[-2:], smem[:-2]
            (km_bar, km_cons), bars = bars[-2:], bars[:-2]
        q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem = smem
        in_bar, k_bar, v_bar, k_cons, v_cons = bars
        rings = ring_slots(plgpu, (k_cons, v_cons) + ((km_cons,) if dm is not None else ()), stages,
                           named=named_release, producer_warp=producer_warp, compute_wgs=wgs)
        k_cons, v_cons = rings[:2]
        if dm is not None:
            km_cons = rings[2]
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        qt = lax.axis_index("q_seq")
        if causal:
            qt = (n_qt - 1) - qt
        kvh = lax.div(h, jnp.int32(rep))
        q_cta0 = qt * (wgs * bq)  # the tile's first row in the marks (and the delta written), and in q
        q_row0 = q_cta0 if aligned is None else tile_rows_ref[b, qt] * ROW_ALIGN
        active = True if aligned is None else tile_rows_ref[b, qt] >= 0  # aligned: an unused tile exits
        k_first = 0
        if dm is not None:  # the listed kv blocks, the partial groups first (block_lists)
            dm_ends = [counts_ref[b, qt, j] for j in range(len(dm.rule.partial_rules()) + 1)]
            total = dm_ends[-1]
        elif band is not None:  # the K/V blocks of this query tile's band: masked, full, masked
            k_first, total, band_flo, band_fhi = key_blocks(band, q_cta0, q_cta0 + wgs * bq, bkv, n_kv,
                                                            band_big(band, S, Skv))
        elif causal:
            total = cdiv(q_cta0 + wgs * bq, bkv)
            n_full = lax.div(q_cta0, jnp.int32(bkv)) if split else jnp.int32(0)
        else:
            total = n_kv

        @pl.when((wg < wgs) & active)
        def _compute():
            plgpu.set_max_registers(regs, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
            q0 = q_cta0 + wg * bq  # in the marks and the delta written
            qr0 = q0 if aligned is None else q_row0 + wg * bq  # in q, dO, O, lse, dlse and a given delta
            qsl = (b, pl.ds(qr0, bq), h)
            rsl = (b, h, pl.ds(qr0, bq))
            plgpu.copy_gmem_to_smem(q_ref.at[qsl], q_smem, in_bar.at[4 * wg])
            plgpu.copy_gmem_to_smem(do_ref.at[qsl], do_smem, in_bar.at[4 * wg + 1])
            plgpu.copy_gmem_to_smem(lse_ref.at[rsl], lse_smem, in_bar.at[4 * wg + 2])
            if fuse_delta:  # O's tile, for delta
                plgpu.copy_gmem_to_smem(delta_ref.at[qsl], o_smem2.at[wg], in_bar.at[4 * wg + 3])
                if has_dlse:
                    plgpu.copy_gmem_to_smem(dlse_ref.at[rsl], dlse_smem2.at[wg], dlse_bar.at[wg])
            else:
                plgpu.copy_gmem_to_smem(delta_ref.at[rsl], delta_smem, in_bar.at[4 * wg + 3])
            if dm is not None:
                plgpu.copy_gmem_to_smem(qm_ref.at[b, :, pl.ds(q0, bq)], qm_smem2.at[wg], in_bar.at[4 * wgs + wg])
                km_cons.prime()
            k_cons.prime()
            v_cons.prime()
            for j in range(4):
                plgpu.barrier_wait(in_bar.at[4 * wg + j])
            if dm is not None:
                plgpu.barrier_wait(in_bar.at[4 * wgs + wg])
                q_marks = [plgpu.load(qm_smem2.at[wg, i], layout=plgpu.Layout.WGMMA.reduce(1)) for i in range(2)]
            lse = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            if fuse_delta:  # delta = rowsum(O * dO) in fp32, written for the dK/dV kernel
                o_rows = plgpu.load(o_smem2.at[wg], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                do_rows = plgpu.load(do_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                delta = jnp.sum(o_rows * do_rows, axis=1)
                if has_dlse:  # d lse / d s = p: a cotangent on lse adds p * dlse to dS
                    plgpu.barrier_wait(dlse_bar.at[wg])
                    delta = delta - plgpu.load(dlse_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
                delta_smem[...] = delta
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(delta_smem, delta_out_ref.at[b, h, pl.ds(q0, bq)])
            else:
                delta = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            dq_acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def step_body(t, dq_acc, masked: bool, dm_rule=None):
                dm_masked = dm_rule is not None  # dm_rule: this step's element mask (a partial group's), or none
                slot = rem(t, stages)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                if dm is not None:  # the keys' (segment, position) rows are streamed every step
                    plgpu.barrier_wait(km_bar.at[slot])
                    if dm_masked:
                        k_marks = [plgpu.load(km_smem.at[slot, i], layout=plgpu.Layout.WGMMA.reduce(0))
                                   for i in range(2)]
                    km_cons.release(slot)

                def _s_dp(s_ref, dp_ref):
                    # one wgmma group, one wait
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, do_smem, v_smem.at[slot].transpose((1, 0)))
                    return s_ref[...], dp_ref[...]

                s, dp = pl.run_scoped(_s_dp, plgpu.ACC((bq, bkv), jnp.float32),
                                      plgpu.ACC((bq, bkv), jnp.float32))
                v_cons.release(slot)
                if pre is not None:  # softcap (th: t is the step)
                    th = jnp.tanh(s * pre)
                    s = th
                p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, (bq, bkv), [0]))
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                    if band is None:
                        p = jnp.where(rows + q0 >= cols + t * bkv, p, 0.0)
                    else:  # rows are queries, columns keys
                        p = band_mask(p, cols - rows, q0 + band[0] - (k_first + t) * bkv, band)
                if kv_valid is not None:  # padded keys (non-causal, every step)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                    p = jnp.where(cols + t * bkv < kv_valid, p, 0.0)
                if dm_masked:
                    p = dm_rule.apply(p, q_marks, k_marks, 0.0, q_axis=0)
                ds = p * (dp - lax.broadcast_in_dim(delta, (bq, bkv), [0]))
                if pre is not None:
                    ds = ds * (1.0 - th * th)
                dq_acc = mma_into(plgpu, dq_acc, ds.astype(dtype), k_smem.at[slot],
                                   interpret=interpret)
                k_cons.release(slot)
                return dq_acc

            if dm is not None:  # group by group, the full blocks last
                dq_acc = walk_groups(lambda t, acc, group_rule: step_body(t, acc, masked=False, dm_rule=group_rule),
                                     dm_ends, dm.rule, dq_acc)
            elif band is not None:
                dq_acc = walk_band(lambda t, acc, masked: step_body(t, acc, masked=masked), band_flo, band_fhi,
                                   total, dq_acc)
            elif causal:
                dq_acc = lax.fori_loop(0, n_full, functools.partial(step_body, masked=False), dq_acc)
                dq_acc = lax.fori_loop(n_full, total, functools.partial(step_body, masked=True), dq_acc)
            else:
                dq_acc = lax.fori_loop(0, total, functools.partial(step_body, masked=False), dq_acc)
            q_smem[...] = (dq_acc * scale).astype(dtype)
            plgpu.commit_smem()
            if aligned is None:
                plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[qsl])
            else:  # the tile's own groups in place, the shared ones to the side buffer
                store_planned(plgpu, q_smem, dq_ref, shared_ref, plan_ref, b, h, qt, wg, tile_rows_ref, bq)
            plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_wait_read_only)

        def coords(g):  # (K / V rows, the keys' marks) of step g
            marks = pl.ds((blocks_ref[b, qt, g] if dm is not None else k_first + g) * bkv, bkv)
            kv = marks if aligned is None else pl.ds(block_rows_ref[b, qt, g] * ROW_ALIGN, bkv)
            return (b, kv, kvh), marks

        @pl.when((wg == wgs) & active)
        def _memory():
            plgpu.set_max_registers(producer_regs, action="decrease")
            run_producer(plgpu, lambda: stream_ring(
                plgpu, total, stages, coords,
                [(lambda c: k_ref.at[c[0]], k_smem, k_bar, k_cons),
                 (lambda c: v_ref.at[c[0]], v_smem, v_bar, v_cons)]
                + ([(lambda c: km_ref.at[b, :, c[1]], km_smem, km_bar, km_cons)] if dm is not None else [])),
                single_warp=producer_warp)

    tr_d, tr_v = smem_transforms(plgpu, dtype, D), smem_transforms(plgpu, dtype, Dv)
    scratch = [
        (
            plgpu.SMEM((wgs, bq, D), dtype, transforms=tr_d),
            plgpu.SMEM((wgs, bq, Dv), dtype, transforms=tr_v),
            plgpu.SMEM((wgs, bq), jnp.float32),
            plgpu.SMEM((wgs, bq), jnp.float32),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr_d),
            plgpu.SMEM((stages, bkv, Dv), dtype, transforms=tr_v),
        ),
        (
            plgpu.Barrier(num_barriers=(5 if dm is not None else 4) * wgs),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        ),
    ]
    if dm is not None:
        scratch[0] = scratch[0] + (plgpu.SMEM((wgs, 2, bq), jnp.int32), plgpu.SMEM((stages, 2, bkv), jnp.int32))
        scratch[1] = scratch[1] + (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_arrivals=wgs,
                                                                                     num_barriers=stages))
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype),)
    if has_dlse:  # popped first in the body: the last scratch and barrier
        scratch[0] = scratch[0] + (plgpu.SMEM((wgs, bq), jnp.float32),)
        scratch[1] = scratch[1] + (plgpu.Barrier(num_barriers=wgs),)
    if fuse_delta:
        scratch[0] = scratch[0] + (plgpu.SMEM((wgs, bq, Dv), out.dtype, transforms=smem_transforms(
            plgpu, out.dtype, Dv)),)
        out_type += (jax.ShapeDtypeStruct((B, H, n_qt * wgs * bq), jnp.float32),)  # = S on the grid
    if aligned is not None:  # the groups a tile shares with a neighbouring run's tile
        out_type += (jax.ShapeDtypeStruct((B, n_qt, 2, ROW_ALIGN, H, D), dtype),)
    tables = () if dm is None else dm.kernel_args("dq") if aligned is None else aligned.kernel_args()
    outs = warp_specialized_kernel(plgpu, body, out_type=out_type, scratch=scratch,
                                   grid=(H, n_qt, B), grid_names=("heads", "q_seq", "batch"), compute_wgs=wgs,
                                   interpret=interpret,
                                   name="te_jax_attn_bwd_dq" if aligned is None else "te_jax_attn_bwd_dq_aligned",
                                   no_auto_barriers=producer_warp)(
        q, k, v, do, lse2, out if fuse_delta else delta, *((dlse.astype(jnp.float32),) if has_dlse else ()),
        *tables)
    if aligned is not None:
        outs = ((outs[0], outs[-1]),) + tuple(outs[1:-1])  # dq with its shared groups, then delta
    return outs if fuse_delta else outs[0]


@lower_once(static_argnames=("scale", "causal", "config", "interpret", "softcap", "kv_valid", "mask_rule", "band"))
def flash_bwd(q, k, v, out, lse, do, *, scale: float, causal: bool,
              config: HopperConfig | None = None, dlse=None, interpret: bool | None = None,
              softcap: float | None = None, kv_valid: int | None = None, mask_tables=None, mask_rule=None,
              band=None):
    """Gradients (dq, dk, dv) given the forward's out and natural-log lse [B,H,S] (softcap, kv_valid, mask_tables,
    mask_rule and band as flash_fwd's; padded keys get zero dk, dv; rows with lse -inf contribute nothing)."""
    interpret = resolve_interpret(interpret)
    D = q.shape[-1]
    Dv = v.shape[-1]
    cfg = config or default_config(D, k.shape[1], causal, q.shape[1], head_dim_v=Dv)
    check_lengths(cfg, q.shape[1], k.shape[1], forward=False)

    def xla_delta():
        delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
        if dlse is not None:
            # d lse / d s = p, so a cotangent on lse adds p * dlse to dS: fold it into delta.
            delta = delta - dlse.astype(jnp.float32)
        return delta

    lse2 = lse.astype(jnp.float32) * LOG2E
    if causal and kv_valid is not None:
        raise ValueError("kv_valid is for non-causal calls (causal padding is masked by the diagonal)")
    kw = dict(scale=scale, causal=causal, cfg=cfg, interpret=interpret, softcap=softcap, kv_valid=kv_valid)
    if band is not None and mask_tables is not None:
        raise ValueError("flash_bwd: pass a band or mask tables, not both")
    masked = mask_tables is not None or band is not None
    if masked:
        if causal or kv_valid is not None:
            raise ValueError("a data mask or band carries causal and padding itself (causal=False, kv_valid=None)")
        # rows without a visible key (lse -inf): 0, so that exp2(s - 0) is finite before the mask zeroes it
        lse2 = jnp.where(lse == -jnp.inf, 0.0, lse2)
        if band is not None:  # positions are token indices: walk the band, no tables (MaskRule.offset)
            kw["band"] = band
        else:
            tables = (aligned_backward_tables if mask_tables.aligned is not None and aligned_backward_chosen(cfg)
                      else backward_tables)(mask_tables, mask_rule, cfg)
            kw["data_mask"] = DataMask(tables, backward_rule(mask_rule))
    atomic = (masked_atomic_dq_chosen(D, Dv, k.shape[1], cfg, interpret, band=band) if masked
              else Dv == D and atomic_dq_chosen(D, k.shape[1], cfg, interpret))
    if atomic:
        dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
        dk, dv = _flash_bwd_dkv(q, k, v, do, lse2, xla_delta(), want_dk=True, want_dv=True,
                                dq_acc_ref=dq_acc, **kw)
        dq = (dq_acc[...] * scale).astype(q.dtype)
        return dq, dk, dv
    fused = delta_in_dq(cfg, interpret, D, Dv, marks="data_mask" in kw)  # the dQ kernel first: it writes delta
    if fused:
        dq, delta = _flash_bwd_dq(q, k, v, do, lse2, None, out=out, dlse=dlse, **kw)
    else:
        delta = xla_delta()
        dq = _flash_bwd_dq(q, k, v, do, lse2, delta, **kw)
    aligned = kw["data_mask"].tables.aligned_dq if "data_mask" in kw else None
    if aligned is not None:  # document-aligned dQ tiles: the shared groups summed, delta back to token order
        dq = merge_shared_groups(*dq, aligned.tile_rows, aligned.stores, interpret=interpret)
        delta = gather_row_values(delta, aligned.out_index) if fused else delta
    if not dkv_together(cfg, D, Dv, masked):  # above 128: both accumulators fill a warpgroup's registers
        (dk,) = _flash_bwd_dkv(q, k, v, do, lse2, delta, want_dk=True, want_dv=False, **kw)
        (dv,) = _flash_bwd_dkv(q, k, v, do, lse2, delta, want_dk=False, want_dv=True, **kw)
    elif band is not None and persistent_band_bwd_chosen(cfg, D, Dv):  # opt-in: one CTA per SM walking key tiles
        dk, dv = _flash_bwd_dkv_band_persistent(q, k, v, do, lse2, delta, scale=scale, cfg=cfg, interpret=interpret,
                                                softcap=softcap, band=band, big=band_big(band, q.shape[1], k.shape[1]))
    else:
        dk, dv = _flash_bwd_dkv(q, k, v, do, lse2, delta, want_dk=True, want_dv=True, **kw)
    return dq, dk, dv
