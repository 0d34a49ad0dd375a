"""Hopper (sm90) flash-attention forward in Pallas Mosaic GPU (FA3 layout).

Each CTA owns 2 x block_q query rows; two compute warpgroups (one per block_q rows) and one memory
warpgroup that streams K/V tiles into a `stages`-deep shared-memory ring with TMA.  The two compute
warpgroups ping-pong on the tensor cores through a rendezvous (a hardware named barrier on the GPU),
so one warpgroup's softmax runs while the other's QK^T / PV wgmma runs.
  * a persistent grid (one CTA per SM looping over query tiles; see _flash_fwd_persistent) where shared
    memory allows: non-causal, and causal (top-left, Sq == Skv) with block_kv = 2 x block_q and an even
    number of query tiles (config.CausalDeal: heavy/light tile pairs, then the last tiles to the least-loaded CTA);
  * otherwise one CTA per query tile (causal: heaviest tiles first); a causal CTA loads only the K/V
    blocks left of its diagonal and masks only the blocks that cross it;
  * under a data mask (segment ids and positions): forward_masked.py, one CTA per query tile walking its block list.
The K/V step and the ping-pong schedule they share are in forward_step.py.
Outputs: out [B,S,H,D] (q.dtype) and lse [B,H,S] float32 (natural log).
Mosaic GPU is imported lazily (inside functions): this module imports on any machine.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._compat import mosaic_gpu, pl

from .._lower_once import lower_once

from .aligned_tiles import gather_row_values, merge_shared_groups
from .band import band_big, band_mask, every_query_sees_a_key, heavier_tiles_last, key_blocks, walk_band
from .common import (cdiv, div, num_sms, rem, resolve_interpret, ring_slots, run_producer, smem_transforms,
                     stream_ring, warp_specialized_kernel, when)
from .forward_masked import _flash_fwd_masked
from .forward_band_persistent import _flash_fwd_band_persistent
from .forward_masked_persistent import _flash_fwd_masked_persistent
from .forward_step import _Sched, _fwd_kv_step, finish_tile, fwd_geometry, qo_refs, qo_scratch
from .persistent_steps import tile_parts
from .config import (LN2, HopperConfig, TailSplit, causal_deal, check_lengths, default_config, logit_units,
                     persistent_band_fwd_chosen, persistent_causal_chosen, persistent_chosen, persistent_masked_chosen,
                     rendezvous_named, ring_choices, split_tail_chosen)


def _fwd_call(plgpu, body, q, k, v, *, q_buffers: int, bq: int, bkv: int, stages: int, grid, grid_names,
              interpret: bool, name: str, producer_warp: bool, extra_in=(), extra_out=()):
    """plgpu.kernel for a forward body: 2 compute warpgroups + 1 memory warpgroup.

    Shared memory: Q/O tiles [2 warpgroups, *q_buffers, bq, D], the K and V rings [stages, bkv, D] / [.., Dv], lse
    staging [2, bq].  Where v's head_dim Dv differs from q/k's D (q_buffers 1): with Dv < D the Q tiles are a
    RefUnion with (O tile of warpgroup 0, a gap, O tile of warpgroup 1), each O tile inside its own warpgroup's Q
    tile (o_tiles_in_q); else a separate O tile [2, bq, Dv] comes last.
    Barriers: k/v loaded (per slot), Q loaded (per warpgroup and buffer), k/v consumed (2 arrivals per slot), the
    ping-pong rendezvous (2 arrivals).
    """
    B, S, H, D = q.shape
    Dv = v.shape[-1]
    dtype = q.dtype
    tr, tr_v = smem_transforms(plgpu, dtype, D), smem_transforms(plgpu, dtype, Dv)
    q_tiles, o_extra = qo_scratch(
        plgpu, plgpu.SMEM((2, q_buffers, bq, D) if q_buffers > 1 else (2, bq, D), dtype, transforms=tr),
        bq, D, Dv, dtype, tr_v)
    scratch = [
        (
            q_tiles,
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, Dv), dtype, transforms=tr_v),
            plgpu.SMEM((2, bq), jnp.float32),
        ) + o_extra,
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2 * q_buffers),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ),
    ]
    out_type = (jax.ShapeDtypeStruct((B, S, H, Dv), dtype), jax.ShapeDtypeStruct((B, H, S), jnp.float32), *extra_out)
    return warp_specialized_kernel(plgpu, body, out_type=out_type, scratch=scratch, grid=grid, grid_names=grid_names,
                                   compute_wgs=2, interpret=interpret, name=name,
                                   no_auto_barriers=producer_warp)(q, k, v, *extra_in)


@lower_once(static_argnames=("scale", "causal", "config", "interpret", "softcap", "kv_valid", "mask_rule", "band"))
def flash_fwd(q, k, v, *, scale: float, causal: bool, config: HopperConfig | None = None,
              interpret: bool | None = None, softcap: float | None = None, kv_valid: int | None = None,
              mask_tables=None, mask_rule=None, band=None):
    """-> (out [B,S,H,Dv] q.dtype, lse [B,H,S] float32, natural log); q/k head_dim D, v's Dv (Dv != D: the grid
    or data-mask kernel, not the persistent ones).  softcap: logits softcap * tanh(s / softcap)
    (s = scale * q.k; tanh in the score path, before the mask).  kv_valid (non-causal): keys at or past it are
    padding (masked on every K/V step: the caller padded a ragged length up to a whole block).
    mask_tables / mask_rule (data_mask.MaskTables / MaskRule; causal False, kv_valid None): a data mask; rows
    that see no key give out 0 and lse -inf.  band ((offset, lo, hi): data_mask.MaskRule.band; causal False, no
    kv_valid or tables): key j is visible to query i iff lo <= j - i - offset <= hi; each query tile walks the K/V
    blocks of its band (band.key_blocks), masking the edges from iotas; rows that see no key as a data mask's."""
    plgpu = mosaic_gpu()
    interpret = resolve_interpret(interpret)
    Dv = v.shape[-1]
    cfg = config or default_config(q.shape[-1], k.shape[1], causal, q.shape[1], head_dim_v=Dv)
    B, S, H, D, Skv, G, rep, dtype, bq, bkv, n_kv, stages, n_qt = fwd_geometry(q, k, cfg)
    check_lengths(cfg, S, Skv, backward=False)
    split_dims = Dv != D  # q/k and v head_dims differ: the grid kernel with a separate O tile
    if causal and S != Skv:
        raise ValueError("causal needs Sq == Skv")
    if causal and kv_valid is not None:
        raise ValueError("kv_valid is for non-causal calls (causal padding is masked by the diagonal)")
    if band is not None and (causal or kv_valid is not None or mask_tables is not None):
        raise ValueError("flash_fwd: a band carries causal and windows itself (causal=False, no kv_valid, no mask "
                         "tables)")
    if mask_tables is not None:
        if causal or kv_valid is not None:
            raise ValueError("a data mask carries causal and padding itself (causal=False, kv_valid=None)")
        if mask_tables.aligned is not None:  # document-aligned tiles (aligned_tiles): the grid kernel
            a = mask_tables.aligned
            out, lse, shared = _flash_fwd_masked(q, k, v, a.qm, a.km, a.counts, a.blocks, scale=scale, cfg=cfg,
                                                 interpret=interpret, softcap=softcap, rule=mask_rule,
                                                 rows=(a.tile_rows, a.block_rows, a.stores))
            return (merge_shared_groups(out, shared, a.tile_rows, a.stores, interpret=interpret),
                    gather_row_values(lse, a.out_index))
        masked = (_flash_fwd_masked_persistent
                  if persistent_masked_chosen(cfg, D, Dv, dtype, tuple(mask_rule.window)) else _flash_fwd_masked)
        return masked(q, k, v, mask_tables.qm, mask_tables.km, *mask_tables.fwd, scale=scale, cfg=cfg,
                      interpret=interpret, softcap=softcap, rule=mask_rule)
    if (band is not None and persistent_band_fwd_chosen(cfg, D, Dv, dtype, band)
            and every_query_sees_a_key(band, S, Skv)):  # one CTA per SM walking query tiles
        return _flash_fwd_band_persistent(q, k, v, scale=scale, cfg=cfg, interpret=interpret, softcap=softcap,
                                          band=band, big=band_big(band, S, Skv))
    if band is None and not causal and not split_dims and persistent_chosen(cfg, Skv, D, dtype):
        return _flash_fwd_persistent(q, k, v, scale=scale, cfg=cfg, interpret=interpret, softcap=softcap,
                                     kv_valid=kv_valid)
    if causal and not split_dims and persistent_causal_chosen(cfg, S, D, dtype):
        return _flash_fwd_persistent(q, k, v, scale=scale, cfg=cfg, interpret=interpret, causal=True,
                                     softcap=softcap)
    c, pre = logit_units(scale, softcap)
    named = rendezvous_named(cfg, interpret)
    named_release, producer_warp = ring_choices(cfg, interpret, backward=False)
    split = cfg.split_causal
    reverse_band = band is not None and cfg.fwd_band_heavy_first is not False and heavier_tiles_last(
        band, S, Skv, 2 * bq, bkv)

    def body(q_ref, k_ref, v_ref, o_ref, lse_ref, smem, bars):
        qo_smem2, o_tiles = qo_refs(smem[0], smem[4:], bq, D, Dv, dtype)
        k_smem, v_smem, lse_smem2 = smem[1:4]
        k_bar, v_bar, q_bar, k_cons, v_cons, sched = bars
        k_slots, v_slots = ring_slots(plgpu, (k_cons, v_cons), stages, named=named_release,
                                      producer_warp=producer_warp, compute_wgs=2)
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        qt = lax.axis_index("q_seq")
        if causal or reverse_band:
            qt = (n_qt - 1) - qt  # heaviest tiles first
        kvh = lax.div(h, jnp.int32(rep))

        sched = _Sched(plgpu, sched, named)

        k_first = 0
        if causal:
            cta_steps = cdiv((qt + 1) * (2 * bq), bkv)
        elif band is not None:  # the K/V blocks of this query tile's band: masked, full, masked (both warpgroups)
            k_first, cta_steps, band_flo, band_fhi = key_blocks(band, qt * (2 * bq), (qt + 1) * (2 * bq), bkv, n_kv,
                                                                band_big(band, S, Skv))
        else:
            cta_steps = n_kv

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q0 = qt * (2 * bq) + wg * bq
            kv_steps = cdiv(q0 + bq, bkv) if causal else cta_steps

            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], qo_smem, q_bar.at[wg])
            k_slots.prime()
            v_slots.prime()
            with jax.named_scope("q_wait"):  # regions: common.profiling
                plgpu.barrier_wait(q_bar.at[wg])

            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((bq, Dv), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            with jax.named_scope("k0_wait"):
                if band is not None:  # a band's walk may be empty (rows that see no key)
                    when(cta_steps > 0, lambda: plgpu.barrier_wait(k_bar.at[0]))
                else:
                    plgpu.barrier_wait(k_bar.at[0])
            pl.when(wg == 1)(sched.start)

            def kv_body(step, carry, masked: bool):
                slot = rem(step, stages)

                def mask(shape):
                    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                    if kv_valid is not None:  # non-causal with padded keys
                        return cols + step * bkv < kv_valid
                    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                    return rows + q0 >= cols + step * bkv

                def wait_next_k():
                    nxt = step + 1

                    @pl.when(nxt < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_bar.at[rem(nxt, stages)])

                def apply_band(x):  # rows are queries, columns keys
                    rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=plgpu.Layout.WGMMA)
                    return band_mask(x, cols - rows, q0 + band[0] - (k_first + step) * bkv, band, -jnp.inf)

                by_band = band is not None and masked
                return _fwd_kv_step(
                    plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot], v_tile=v_smem.at[slot],
                    k_release=lambda: k_slots.release(slot), v_ready=v_bar.at[slot],
                    v_release=lambda: v_slots.release(slot),
                    sched=sched, c=c, dtype=dtype, interpret=interpret,
                    mask=mask if masked and band is None else None, wait_next_k=wait_next_k, pre=pre,
                    apply_mask=apply_band if by_band else None, may_be_empty=by_band)

            carry = (acc, m_i, l_i)
            if band is not None:
                with jax.named_scope("steps"):
                    carry = walk_band(lambda s, cr, masked: kv_body(s, cr, masked=masked), band_flo, band_fhi,
                                      cta_steps, carry)
            elif not causal:
                carry = lax.fori_loop(0, n_kv, functools.partial(kv_body, masked=kv_valid is not None), carry)
            else:
                full = lax.div(q0, jnp.int32(bkv)) if split else jnp.int32(0)
                carry = lax.fori_loop(0, full, functools.partial(kv_body, masked=False), carry)
                carry = lax.fori_loop(full, kv_steps, functools.partial(kv_body, masked=True), carry)

                def flush(step, _):
                    # Keep the pipeline and the ping-pong in step when this warpgroup is done
                    # before the other one (causal: the first warpgroup has fewer blocks).
                    slot = rem(step, stages)
                    plgpu.barrier_wait(k_bar.at[slot])  # observe every phase (no skipped waits)
                    k_slots.release(slot)
                    plgpu.barrier_wait(v_bar.at[slot])
                    v_slots.release(slot)
                    sched.flush_step()

                lax.fori_loop(kv_steps, cta_steps, flush, None)
            pl.when(wg == 0)(sched.finish)
            with jax.named_scope("epilogue"):
                finish_tile(plgpu, carry, o_tiles=o_tiles, qo_smem=qo_smem, lse_smem=lse_smem, wg=wg, dtype=dtype,
                            o_dst=o_ref.at[b, pl.ds(q0, bq), h], lse_dst=lse_ref.at[b, h, pl.ds(q0, bq)],
                            may_be_empty=band is not None, read_only=cfg.exit_wait_read_only)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            run_producer(plgpu, lambda: stream_ring(
                plgpu, cta_steps, stages, lambda g: (b, pl.ds((k_first + g) * bkv, bkv), kvh),
                [(lambda sl: k_ref.at[sl], k_smem, k_bar, k_slots),
                 (lambda sl: v_ref.at[sl], v_smem, v_bar, v_slots)]), single_warp=producer_warp)

    out, lse = _fwd_call(plgpu, body, q, k, v, q_buffers=1, bq=bq, bkv=bkv, stages=stages, grid=(H, n_qt, B),
                         grid_names=("heads", "q_seq", "batch"), interpret=interpret,
                         name="te_jax_attn_fwd_causal" if causal else "te_jax_attn_fwd", producer_warp=producer_warp)
    return out, lse


def _flash_fwd_persistent(q, k, v, *, scale: float, cfg: HopperConfig, interpret: bool, causal: bool = False,
                          softcap: float | None = None, kv_valid: int | None = None):
    """Forward on a persistent grid.  Non-causal: CTA j takes query tiles j, j + n_ctas, ...
    Causal (config.persistent_causal_served: block_kv = 2 x block_q, an even number of query tiles): config.CausalDeal
    -- rounds of heavy/light tile pairs of one (batch, head) (tile n_qt - 1 - j with tile j: n_qt + 1 K/V steps per
    pair, every pair the same), then the remaining tiles dealt longest first to the least-loaded CTA, read from a
    table in global memory; a tile's last K/V block is its diagonal one (masked), and both warpgroups run the same
    number of steps.

    Tiles are ordered (batch, head, query tile) so CTAs running together share K/V in L2.  The
    memory warpgroup streams K/V for all of the CTA's tiles through one ring (global step
    counter); each compute warpgroup double-buffers its Q tile in shared memory and loads the
    next tile's Q during this tile's second K/V step (the O tile is staged in the buffer Q leaves).  (Loading it
    after the tile's last step instead, an option until 2026-11-26, gave wrong output on the H100 and was removed.)
    With a TailSplit (config.split_tail_chosen) the last round is shared out by K/V steps: a CTA's work is a
    list of pieces (tile, first step, end step); a piece that is not the whole tile writes its
    normalised output (as hi + lo in q.dtype, through both Q buffers) and lse to a slot of the partial
    outputs, and _merge_cut_tiles combines the two pieces of each cut tile after the kernel.
    """
    plgpu = mosaic_gpu()
    B, S, H, D, Skv, G, rep, dtype, bq, bkv, n_kv, stages, n_qt = fwd_geometry(q, k, cfg)
    n_tiles = B * H * n_qt
    half = n_qt // 2  # causal: pairs per (batch, head)
    lpt = cfg.fwd_causal_lpt is not False
    n_units = B * H * half if causal and not lpt else n_tiles  # whole pairs to the end: every CTA one pair at least
    n_ctas = max(1, min(n_units, cfg.fwd_ctas or num_sms()))
    plan = None if causal else split_tail_chosen(cfg, n_tiles, n_kv, n_ctas, Skv)
    deal = causal_deal(B * H, n_qt, n_ctas, lpt=lpt) if causal else None
    c, pre = logit_units(scale, softcap)
    named = rendezvous_named(cfg, interpret)
    named_release, producer_warp = ring_choices(cfg, interpret, backward=False)

    def tile_coords(t):  # -> batch, head, query tile
        return tile_parts(t, H, n_qt)

    def body(q_ref, k_ref, v_ref, *rest):
        if causal:
            deal_ref, *rest = rest
        o_ref, lse_ref, *rest = rest
        if plan is None:
            smem, bars = rest
        else:
            part_o_ref, part_lse_ref, smem, bars = rest
        qo_smem4, k_smem, v_smem, lse_smem2 = smem
        k_bar, v_bar, q_bar, k_cons, v_cons, sched = bars
        k_slots, v_slots = ring_slots(plgpu, (k_cons, v_cons), stages, named=named_release,
                                      producer_warp=producer_warp, compute_wgs=2)
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")

        if causal:  # CausalDeal: pair rounds in closed form, then the tail tiles from the deal table
            pair_steps, pair_items = n_qt + 1, 2 * deal.pair_rounds
            dp_steps = deal.pair_rounds * pair_steps
            n_my = pair_items + deal_ref[cta, 0]
            total_steps = dp_steps + deal_ref[cta, 1]
            tail_items = deal.table_items

            def entry(i):  # the CTA's i-th tile in its tail: (tile, first ring step), read from the table
                k = jnp.clip(i - pair_items, 0, tail_items - 1)
                return deal_ref[cta, 2 + k], deal_ref[cta, 2 + tail_items + k]

            def piece(i, tail_tile, tail_g0):
                # -> (batch, head, query tile), first K/V step, end step, first step in the CTA's ring
                k = div(i, 2)
                p = cta + k * n_ctas  # the pair of a pair item: tiles n_qt - 1 - j (first) and j of (batch, head)
                light = rem(i, 2)
                j = rem(p, half)
                in_pairs = i < pair_items
                tile = jnp.where(in_pairs, div(p, half) * n_qt + jnp.where(light == 1, j, (n_qt - 1) - j), tail_tile)
                qt = rem(tile, n_qt)
                g0 = jnp.where(in_pairs, k * pair_steps + light * (n_qt - j), tail_g0)
                return tile_coords(tile), 0, qt + 1, g0

            def kv_block(g):  # the CTA's g-th K/V block -> (batch, head, query tile), block
                p = cta + div(g, pair_steps) * n_ctas
                j = rem(p, half)
                r, heavy = rem(g, pair_steps), n_qt - j
                x = deal_ref[cta, 2 + 2 * tail_items + jnp.clip(g - dp_steps, 0, deal.table_steps - 1)]
                in_pairs = g < dp_steps
                tile = jnp.where(in_pairs, div(p, half) * n_qt, div(x, n_qt))
                return tile_coords(tile), jnp.where(in_pairs, jnp.where(r < heavy, r, r - heavy), rem(x, n_qt))
        elif plan is None:
            n_my = cdiv(n_tiles - cta, n_ctas)  # >= 1: n_ctas <= n_tiles
            total_steps = n_my * n_kv

            def piece(i):  # -> (batch, head, query tile), first K/V step, end step, first step in the CTA's ring
                return tile_coords(cta + i * n_ctas), 0, n_kv, i * n_kv

            def entry(i):  # nothing read from memory
                return ()

            def kv_block(g):  # the CTA's g-th K/V block: tile g // n_kv, block g % n_kv
                return tile_coords(cta + div(g, n_kv) * n_ctas), rem(g, n_kv)
        else:
            dp_steps = plan.dp_rounds * n_kv
            s0 = div(cta * plan.units, n_ctas)  # TailSplit.start
            s1 = div((cta + 1) * plan.units, n_ctas)
            n_my = plan.dp_rounds + div(s1 - 1, n_kv) - div(s0, n_kv) + 1
            total_steps = dp_steps + s1 - s0

            def piece(i):
                t = div(s0, n_kv) + (i - plan.dp_rounds)  # tail-relative tile of a tail piece
                whole = i < plan.dp_rounds
                return (tile_coords(jnp.where(whole, cta + i * n_ctas, plan.first_tile + t)),
                        jnp.where(whole, 0, jnp.maximum(s0 - t * n_kv, 0)),
                        jnp.where(whole, n_kv, jnp.minimum(s1 - t * n_kv, n_kv)),
                        jnp.where(whole, i * n_kv, dp_steps + jnp.maximum(t * n_kv, s0) - s0))

            def kv_block(g):
                u = s0 + (g - dp_steps)
                whole = g < dp_steps
                return (tile_coords(jnp.where(whole, cta + div(g, n_kv) * n_ctas, plan.first_tile + div(u, n_kv))),
                        jnp.where(whole, rem(g, n_kv), rem(u, n_kv)))

            def entry(i):
                return ()

        sched = _Sched(plgpu, sched, named)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            def load_q(i, buf, e):  # e: entry(i)
                b, h, qt = piece(i, *e)[0]
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(qt * (2 * bq) + wg * bq, bq), h],
                                        qo_smem4.at[wg, buf], q_bar.at[2 * wg + buf])

            load_q(0, 0, entry(0))
            k_slots.prime()
            v_slots.prime()

            def tile_body(i, e):
                (b, h, qt), k0, k1, g0 = piece(i, *e)
                e_next = entry(i + 1)  # read a tile ahead (causal: its table entry), not when it is due
                buf = rem(i, 2)
                qo_smem = qo_smem4.at[wg, buf]
                q0 = qt * (2 * bq) + wg * bq
                plgpu.barrier_wait(q_bar.at[2 * wg + buf])
                m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                plgpu.barrier_wait(k_bar.at[rem(g0, stages)])
                pl.when(wg == 1)(sched.start)
                cut = None if plan is None else (k0 > 0) | (k1 < n_kv)
                # Early Q: the next tile's Q goes into the other buffer while this piece's second PV wgmma runs (its
                # first, for one-step pieces); the previous O store has long been read out of that buffer by then.
                # A cut piece needs both buffers for its epilogue: it loads the next Q after it (late).
                early_q = (i + 1 < n_my) if plan is None else (i + 1 < n_my) & jnp.logical_not(cut)
                early_step = k0 + jnp.minimum(1, k1 - k0 - 1)

                def kv_body(step, carry, masked=False):
                    g = g0 + (step - k0)
                    slot = rem(g, stages)

                    def mask(shape):  # causal: the tile's diagonal block; kv_valid: padded keys (every step)
                        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                        if kv_valid is not None:
                            return cols + step * bkv < kv_valid
                        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                        return rows + q0 >= cols + step * bkv

                    def wait_next_k():
                        @pl.when(step + 1 < k1)
                        def _():
                            plgpu.barrier_wait(k_bar.at[rem(g + 1, stages)])

                        @pl.when(early_q & (step == early_step))
                        def _():
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            load_q(i + 1, 1 - buf, e_next)

                    return _fwd_kv_step(
                        plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot],
                        v_tile=v_smem.at[slot], k_release=lambda: k_slots.release(slot),
                        v_ready=v_bar.at[slot], v_release=lambda: v_slots.release(slot), sched=sched, c=c, dtype=dtype,
                        interpret=interpret, mask=mask if masked else None, wait_next_k=wait_next_k, pre=pre)

                if causal:  # blocks left of the diagonal, then the diagonal block
                    carry = lax.fori_loop(k0, k1 - 1, kv_body, (acc, m_i, l_i))
                    acc, m_i, l_i = kv_body(k1 - 1, carry, masked=True)
                else:
                    acc, m_i, l_i = lax.fori_loop(k0, k1, functools.partial(kv_body, masked=kv_valid is not None),
                                                  (acc, m_i, l_i))
                pl.when(wg == 0)(sched.finish)
                # Q of this tile is consumed.  The other buffer staged the previous tile's O, whose store was issued
                # a whole tile ago: wait for it to be read (a cut piece writes there; the next
                # tile's Q is loaded there now, while this tile's epilogue runs).
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                inv = 1.0 / l_i
                out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                lse = (m_i + jnp.log2(l_i)) * LN2

                def whole_tile():
                    qo_smem[...] = out.astype(dtype)
                    lse_smem2.at[wg][...] = lse
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(q0, bq), h])
                    plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[b, h, pl.ds(q0, bq)])

                def cut_piece():
                    # fp32 output as hi + lo in q.dtype (both Q buffers: no fp32 staging fits beside the ring).
                    slot = jnp.where(k0 > 0, 0, 1)  # 0: the piece that ends a tile; 1: the one that starts it
                    hi = out.astype(dtype)
                    other = qo_smem4.at[wg, 1 - buf]
                    qo_smem[...] = hi
                    other[...] = (out - hi.astype(jnp.float32)).astype(dtype)
                    lse_smem2.at[wg][...] = lse
                    plgpu.commit_smem()
                    rows = pl.ds(wg * bq, bq)
                    plgpu.copy_smem_to_gmem(qo_smem, part_o_ref.at[cta, slot, 0, rows])
                    plgpu.copy_smem_to_gmem(other, part_o_ref.at[cta, slot, 1, rows])
                    plgpu.copy_smem_to_gmem(lse_smem2.at[wg], part_lse_ref.at[cta, slot, rows])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # `other` takes the next Q
                    when(i + 1 < n_my, lambda: load_q(i + 1, 1 - buf, e_next))

                if plan is None:
                    whole_tile()
                else:
                    pl.when(jnp.logical_not(cut))(whole_tile)
                    pl.when(cut)(cut_piece)
                return e_next

            lax.fori_loop(0, n_my, tile_body, entry(0))
            plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_wait_read_only)

        @pl.when(wg == 2)
        def _memory():
            def kv_slice(g):
                (b, h, _), blk = kv_block(g)
                return b, pl.ds(blk * bkv, bkv), lax.div(h, jnp.int32(rep))

            plgpu.set_max_registers(40, action="decrease")
            run_producer(plgpu, lambda: stream_ring(
                plgpu, total_steps, stages, kv_slice,
                [(lambda sl: k_ref.at[sl], k_smem, k_bar, k_slots),
                 (lambda sl: v_ref.at[sl], v_smem, v_bar, v_slots)]), single_warp=producer_warp)

    extra_out = () if plan is None else (jax.ShapeDtypeStruct((n_ctas, 2, 2, 2 * bq, D), dtype),
                                         jax.ShapeDtypeStruct((n_ctas, 2, 2 * bq), jnp.float32))
    extra_in = () if deal is None else (jnp.asarray(deal.table()),)
    outs = _fwd_call(plgpu, body, q, k, v, q_buffers=2, bq=bq, bkv=bkv, stages=stages, grid=(n_ctas,),
                     grid_names=("cta",), interpret=interpret,
                     name="te_jax_attn_fwd_persistent_causal" if causal else "te_jax_attn_fwd_persistent",
                     producer_warp=producer_warp, extra_in=extra_in, extra_out=extra_out)
    if plan is None:
        return outs
    return _merge_cut_tiles(*outs, plan=plan, n_qt=n_qt, rows=2 * bq)


def _merge_cut_tiles(out, lse, part_o, part_lse, *, plan: TailSplit, n_qt: int, rows: int):
    """Write the tiles that TailSplit cut between two CTAs: the lse-weighted sum of their two pieces.

    out [B,S,H,D], lse [B,H,S]; part_o [n_ctas, 2 slots, 2 (hi, lo), rows, D] q.dtype; part_lse [n_ctas, 2, rows]
    float32.  Tile (cut between CTAs c - 1 and c) = slot 1 of c - 1 and slot 0 of c.
    """
    cuts = plan.cut_tiles()
    if not cuts:
        return out, lse
    H = out.shape[2]
    tiles = np.array([t for t, _ in cuts], np.int32)
    ctas = np.array([c for _, c in cuts], np.int32)
    b, h, qt = tiles // (H * n_qt), (tiles // n_qt) % H, tiles % n_qt
    f32 = jnp.float32
    o1, o2 = part_o[ctas - 1, 1].astype(f32), part_o[ctas, 0].astype(f32)  # [n, 2, rows, D]
    o1, o2 = o1[:, 0] + o1[:, 1], o2[:, 0] + o2[:, 1]
    l1, l2 = part_lse[ctas - 1, 1], part_lse[ctas, 0]  # [n, rows]
    merged_lse = jnp.logaddexp(l1, l2)
    merged = o1 * jnp.exp(l1 - merged_lse)[..., None] + o2 * jnp.exp(l2 - merged_lse)[..., None]
    row_idx = qt[:, None] * rows + np.arange(rows, dtype=np.int32)[None]  # [n, rows]
    out = out.at[b[:, None], row_idx, h[:, None]].set(merged.astype(out.dtype), unique_indices=True)
    lse = lse.at[b[:, None], h[:, None], row_idx].set(merged_lse, unique_indices=True)
    return out, lse
