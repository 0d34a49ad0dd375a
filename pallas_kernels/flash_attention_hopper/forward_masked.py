"""Hopper (sm90) flash-attention forward under a data mask (data_mask.MaskTables: segment ids and positions per
token, per-tile block lists).  One CTA per (head, query tile of 2 x block_q rows, batch).
Mosaic GPU is imported lazily: this module imports on any machine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import mosaic_gpu, pl
from .aligned_tiles import ROW_ALIGN
from .common import (rem, ring_slots, run_producer, smem_transforms, store_planned, stream_ring,
                     warp_specialized_kernel, when)
from .config import HopperConfig, logit_units, rendezvous_named, ring_choices
from .data_mask import walk_groups
from .forward_step import _Sched, _fwd_kv_step, finish_tile, fwd_geometry, qo_refs, qo_scratch

def step_mask(plgpu, rule, q_marks, key_marks, slot):
    """A data-mask forward step's element mask: for a partial step (rule: its group's data_mask.MaskRule), a
    function that waits for the keys' (segment, position) rows in ring slot `slot`, hands the slot back and hides
    the invisible logits (-inf); for a full step (rule None) None, the slot handed back at once (the keys' marks
    are streamed for every step).  key_marks: (loaded barriers, the marks ring [stages, 2, bkv], its slot
    hand-back)."""
    km_bar, km_smem, km_slots = key_marks
    if rule is None:
        plgpu.barrier_wait(km_bar.at[slot])
        km_slots.release(slot)
        return None
    cols = plgpu.Layout.WGMMA.reduce(0)

    def apply_mask(x):
        plgpu.barrier_wait(km_bar.at[slot])
        k_marks = [plgpu.load(km_smem.at[slot, i], layout=cols) for i in range(2)]
        km_slots.release(slot)
        return rule.apply(x, q_marks, k_marks, -jnp.inf, q_axis=0)

    return apply_mask


def _flash_fwd_masked(q, k, v, qm, km, counts, blocks, *, scale: float, cfg: HopperConfig, interpret: bool,
                      softcap: float | None, rule, rows=None):
    """Forward under a data mask (pallas_kernels.mask: segment ids and positions, causal, window; rule: its
    data_mask.MaskRule), one CTA per (head, query tile of 2 x block_q rows, batch).

    qm [B, 2, S] and km [B, 2, Skv] int32: (segment id, position) of every query / key (data_mask.MaskTables);
    counts [B, S // (2 bq), n_groups + 1], blocks [B, S // (2 bq), Skv // bkv] (data_mask.block_lists): each
    tile's visible kv blocks, the partial ones (computed with the element mask, one loop per group of
    rule.partial_rules()) first, then the full ones; no other block is loaded.
    rows (aligned_tiles.AlignedTiles' tile_rows [B, T], block_rows [B, T, Tk], stores [B, T, 4]): document-aligned
    tiles.  Query tile t loads q from row ROW_ALIGN * tile_rows[b, t] and its listed block j's K / V from row
    ROW_ALIGN * block_rows[b, t, j] (aligned_tiles.ROW_ALIGN: a multiple Mosaic GPU can see; a tile with tile_rows -1
    does nothing); qm and km are then the tiles' padded layouts ([B, 2, T * 2 bq], [B, 2, Tk * bkv], blocks
    indexing km's blocks).  Then three outputs: out [B, S, H, Dv] in token order but for the groups tiles share
    (each tile stores by its plan, aligned_tiles.store_plan), lse [B, H, T * 2 bq] in the padded layout
    (aligned_tiles.gather_row_values) and the shared groups [B, T, 2, ROW_ALIGN, H, Dv]
    (aligned_tiles.merge_shared_groups).
    The memory warpgroup streams K, V and the keys' (segment, position) rows of the listed blocks.  Rows that see
    no key: out 0, lse -inf.
    """
    plgpu = mosaic_gpu()
    B, S, H, D, Skv, G, rep, dtype, bq, bkv, n_kv, stages, n_qt = fwd_geometry(q, k, cfg)
    if rows is not None:  # the tiles' padded layout: as many query tiles as it holds
        n_qt = qm.shape[-1] // (2 * bq)
        stages = max(1, min(cfg.stages, km.shape[-1] // bkv))
    n_groups = len(rule.partial_rules())
    if counts.shape[-1] != n_groups + 1:
        raise ValueError(f"counts {counts.shape}: expected [..., {n_groups + 1}] for {rule} (data_mask.mask_tables)")
    Dv = v.shape[-1]  # v's head_dim (O tiles as forward_step.qo_scratch places them where Dv != D)
    c, pre = logit_units(scale, softcap)
    named = rendezvous_named(cfg, interpret, "data mask")
    named_release, producer_warp = ring_choices(cfg, interpret, backward=False)
    wgmma_rows = plgpu.Layout.WGMMA.reduce(1)

    def body(q_ref, k_ref, v_ref, qm_ref, km_ref, counts_ref, blocks_ref, *refs):
        (q_rows_ref, kv_rows_ref, plan_ref), refs = (refs[:3], refs[3:]) if rows is not None else ((None,) * 3, refs)
        (o_ref, lse_ref), shared_ref = refs[:2], (refs[2] if rows is not None else None)
        smem, bars = refs[-2:]
        qo_smem2, o_tiles = qo_refs(smem[0], smem[6:], bq, D, Dv, dtype)
        k_smem, v_smem, lse_smem2, qm_smem2, km_smem = smem[1:6]
        k_bar, v_bar, q_bar, k_cons, v_cons, sched, qm_bar, km_bar, km_cons = bars
        k_slots, v_slots, km_slots = ring_slots(plgpu, (k_cons, v_cons, km_cons), stages, named=named_release,
                                                producer_warp=producer_warp, compute_wgs=2)
        wg = lax.axis_index("wg")
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        qt = lax.axis_index("q_seq")
        kvh = lax.div(h, jnp.int32(rep))
        ends = [counts_ref[b, qt, j] for j in range(n_groups + 1)]
        n_steps = ends[-1]
        sched = _Sched(plgpu, sched, named)
        active = True if rows is None else q_rows_ref[b, qt] >= 0  # aligned: a tile past the row's last exits

        @pl.when((wg < 2) & active)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            qm_smem = qm_smem2.at[wg]
            q0 = qt * (2 * bq) + wg * bq  # the tile's rows in the outputs and qm
            q_row = q0 if rows is None else q_rows_ref[b, qt] * ROW_ALIGN + wg * bq  # and in q
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_row, bq), h], qo_smem, q_bar.at[wg])
            plgpu.copy_gmem_to_smem(qm_ref.at[b, :, pl.ds(q0, bq)], qm_smem, qm_bar.at[wg])
            k_slots.prime()
            v_slots.prime()
            km_slots.prime()
            plgpu.barrier_wait(q_bar.at[wg])
            plgpu.barrier_wait(qm_bar.at[wg])
            q_marks = [plgpu.load(qm_smem.at[i], layout=wgmma_rows) for i in range(2)]

            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), wgmma_rows)
            l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), wgmma_rows)
            acc = plgpu.layout_cast(jnp.full((bq, Dv), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            when(n_steps > 0, lambda: plgpu.barrier_wait(k_bar.at[0]))
            pl.when(wg == 1)(sched.start)

            def kv_body(step, carry, group_rule):
                slot = rem(step, stages)
                apply_mask = step_mask(plgpu, group_rule, q_marks, (km_bar, km_smem, km_slots), slot)

                def wait_next_k():
                    @pl.when(step + 1 < n_steps)
                    def _():
                        plgpu.barrier_wait(k_bar.at[rem(step + 1, stages)])

                return _fwd_kv_step(
                    plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot], v_tile=v_smem.at[slot],
                    k_release=lambda: k_slots.release(slot), v_ready=v_bar.at[slot],
                    v_release=lambda: v_slots.release(slot),
                    sched=sched, c=c, dtype=dtype, interpret=interpret,
                    apply_mask=apply_mask, wait_next_k=wait_next_k, pre=pre, may_be_empty=group_rule is not None)

            carry = walk_groups(kv_body, ends, rule, (acc, m_i, l_i))
            pl.when(wg == 0)(sched.finish)
            finish_tile(plgpu, carry, o_tiles=o_tiles, qo_smem=qo_smem, lse_smem=lse_smem, wg=wg, dtype=dtype,
                        o_dst=o_ref.at[b, pl.ds(q0, bq), h], lse_dst=lse_ref.at[b, h, pl.ds(q0, bq)],
                        may_be_empty=True, read_only=cfg.exit_wait_read_only,  # a row without a key: out 0
                        o_store=None if rows is None else lambda src: store_planned(
                            plgpu, src, o_ref, shared_ref, plan_ref, b, h, qt, wg, q_rows_ref, bq))

        @pl.when((wg == 2) & active)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def coords(g):  # (K / V rows, the keys' marks) of step g
                marks = pl.ds(blocks_ref[b, qt, g] * bkv, bkv)
                kv = marks if rows is None else pl.ds(kv_rows_ref[b, qt, g] * ROW_ALIGN, bkv)
                return (b, kv, kvh), marks

            run_producer(plgpu, lambda: stream_ring(
                plgpu, n_steps, stages, coords,
                [(lambda c: k_ref.at[c[0]], k_smem, k_bar, k_slots),
                 (lambda c: v_ref.at[c[0]], v_smem, v_bar, v_slots),
                 (lambda c: km_ref.at[b, :, c[1]], km_smem, km_bar, km_slots)]), single_warp=producer_warp)

    tr, tr_v = smem_transforms(plgpu, dtype, D), smem_transforms(plgpu, dtype, Dv)
    q_tiles, o_extra = qo_scratch(plgpu, plgpu.SMEM((2, bq, D), dtype, transforms=tr), bq, D, Dv, dtype, tr_v)
    i32 = jnp.int32
    scratch = [
        (
            q_tiles,
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, Dv), dtype, transforms=tr_v),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, 2, bq), i32),
            plgpu.SMEM((stages, 2, bkv), i32),
        ) + o_extra,
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ),
    ]
    s_out = n_qt * 2 * bq
    out_type = (jax.ShapeDtypeStruct((B, S if rows is not None else s_out, H, Dv), dtype),
                jax.ShapeDtypeStruct((B, H, s_out), jnp.float32))
    if rows is not None:  # the groups a tile shares with a neighbouring run's tile
        out_type += (jax.ShapeDtypeStruct((B, n_qt, 2, ROW_ALIGN, H, Dv), dtype),)
    return warp_specialized_kernel(plgpu, body, out_type=out_type, scratch=scratch, grid=(H, n_qt, B),
                                   grid_names=("heads", "q_seq", "batch"), compute_wgs=2, interpret=interpret,
                                   name="te_jax_attn_fwd_masked" if rows is None else "te_jax_attn_fwd_aligned",
                                   no_auto_barriers=producer_warp)(
        q, k, v, qm, km, counts, blocks, *(() if rows is None else rows))
