"""Hopper (sm90) flash-attention forward in Pallas Mosaic GPU (FA3 layout).

Each CTA owns 2 x block_q query rows; two compute warpgroups (one per block_q rows) and one memory
warpgroup that streams K/V tiles into a `stages`-deep shared-memory ring with TMA.  The two compute
warpgroups ping-pong on the tensor cores through a rendezvous (a hardware named barrier on the GPU),
so one warpgroup's softmax runs while the other's QK^T / PV wgmma runs.
  * non-causal: a persistent grid (one CTA per SM looping over query tiles; see
    _flash_fwd_persistent) where shared memory allows;
  * causal (top-left, Sq == Skv): one CTA per query tile, heaviest tiles first; a CTA loads only the
    K/V blocks left of its diagonal and masks only the blocks that cross it.
Outputs: out [B,S,H,D] (q.dtype) and lse [B,H,S] float32 (natural log).
Mosaic GPU is imported lazily (inside functions): this module imports on any machine.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from te_jax._compat import mosaic_gpu, pl

from .common import (cdiv, div, mma, mma_into, rem, resolve_interpret, slot_releases, smem_transforms,
                     stream_ring, warp_specialized_kernel, when)
from .config import LN2, LOG2E, HopperConfig, default_config, persistent_fits


_SCHED_BAR_ID = 4  # Mosaic GPU uses named barriers 0 (CTA) and 1 + warpgroup
_RELEASE_BAR_ID = 5  # the K/V rings' named "slot consumed" barriers: 5 ..


class _Sched:
    """The two compute warpgroups' rendezvous (the forward's ping-pong schedule).

    mbarrier: one 2-arrival barrier, arrive + wait.  named: `bar.sync 4, 256` (both compute
    warpgroups' 256 threads), a hardware barrier with no memory round trip.
    """

    def __init__(self, plgpu, bar, named: bool):
        self.plgpu, self.bar, self.named = plgpu, bar, named

    def _bar_sync(self):
        from jax.experimental.mosaic import gpu as mgpu

        @self.plgpu.inline_mgpu()
        def _sync(_):
            mgpu.utils.inline_ptx(f"bar.sync {_SCHED_BAR_ID}, 256;", has_side_effects=True)

        _sync()

    def sync(self):
        if self.named:
            self._bar_sync()
        else:
            self.plgpu.barrier_arrive(self.bar)
            self.plgpu.barrier_wait(self.bar)

    def before_pv(self, v_ready):
        """After the softmax: V ready, and the other warpgroup done with the tensor cores."""
        if self.named:
            self.plgpu.barrier_wait(v_ready)
            self._bar_sync()
        else:
            self.plgpu.barrier_arrive(self.bar)  # done with softmax
            self.plgpu.barrier_wait(v_ready)
            self.plgpu.barrier_wait(self.bar)  # tensor cores free


def _fwd_kv_step(plgpu, carry, *, q_smem, k_tile, v_tile, release_k, v_ready, release_v, sched,
                 c: float, dtype, interpret: bool, mask=None, wait_next_k=None):
    """One K/V block of the forward for one compute warpgroup (online softmax, ping-pong).

    carry: (acc [bq, D] f32, m [bq] f32 (log2 units, scaled), l [bq] f32).  The QK^T wgmma is
    followed by a rendezvous on `sched` (the other warpgroup then runs its softmax while this
    one's wgmma runs); after the softmax a second rendezvous waits for the tensor cores.
    mask(shape) -> bool [bq, bkv] keeps logits (causal blocks); wait_next_k runs while the PV
    wgmma is in flight (the next K tile's barrier); release_k / release_v hand the slots back.
    """
    acc, m_i, l_i = carry
    D = acc.shape[-1]

    bq, bkv = q_smem.shape[0], k_tile.shape[0]
    s = mma(plgpu, (bq, bkv), q_smem, k_tile.transpose((1, 0)), after=sched.sync)
    release_k()
    if mask is not None:
        s = jnp.where(mask(s.shape), s, -jnp.inf)

    m_new = jnp.maximum(m_i, s.max(axis=1) * c)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l_i = l_i * alpha
    p16 = p.astype(dtype)

    def end_softmax():
        sched.before_pv(v_ready)

    if D <= 128:
        l_i = l_i + p.sum(axis=1)
        acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
        end_softmax()
    else:
        end_softmax()
        l_i = l_i + p.sum(axis=1)

    acc = mma_into(plgpu, acc, p16, v_tile, interpret=interpret, after=wait_next_k)
    release_v()
    return acc, m_new, l_i


def _softmax_step(s, m_i, l_i, *, c: float, dtype, mask=None):
    """Online softmax of one logits tile s [bq, bkv] f32 -> (p [bq, bkv] dtype, m_new, alpha, l_new);
    m in log2 units (scaled by c), alpha = exp2(m_i - m_new) rescales what was accumulated before."""
    if mask is not None:
        s = jnp.where(mask(s.shape), s, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1) * c)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_new = l_i * alpha + p.sum(axis=1)
    return p.astype(dtype), m_new, alpha, l_new


def _fwd_tile_overlapped(plgpu, *, q_smem, k_smem, v_smem, k_bar, v_bar, k_rel, v_rel, sched,
                         slot, n_steps, n_unmasked, mask_at, c: float, dtype, bq: int, D: int):
    """One compute warpgroup's K/V loop for one query tile with FA3's intra-warpgroup overlap.

    Step j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, hands the tensor cores to
    the other warpgroup (`sched`), waits for S_j only and runs softmax_j while the PV wgmma is
    still in flight; O is rescaled by alpha_j once that wgmma is done.  One rendezvous per step
    (the plain loop has two).  slot(j): ring slot of step j; steps >= n_unmasked take
    mask_at(j)(shape).  The caller has waited for K_0.  -> (acc [bq, D] f32, m, l).
    """
    bkv = k_smem.shape[1]
    row = plgpu.Layout.WGMMA.reduce(1)
    m0 = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row)
    l0 = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row)
    acc0 = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    s0 = mma(plgpu, (bq, bkv), q_smem, k_smem.at[slot(0)].transpose((1, 0)), after=sched.sync)
    k_rel.arrive(slot(0))
    mask0 = None if n_unmasked is None else mask_at(0)  # causal: step 0 may cross the diagonal
    p16, m_i, _, l_i = _softmax_step(s0, m0, l0, c=c, dtype=dtype, mask=mask0)

    def step(j, carry, masked: bool):
        acc, p_prev, m_i, l_i = carry
        sj, sp = slot(j), slot(j - 1)
        plgpu.barrier_wait(k_bar.at[sj])
        plgpu.barrier_wait(v_bar.at[sp])

        def issue(s_ref, o_ref):
            o_ref[...] = acc
            plgpu.wgmma(s_ref, q_smem, k_smem.at[sj].transpose((1, 0)))
            plgpu.wgmma(o_ref, p_prev, v_smem.at[sp])
            sched.sync()
            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
            k_rel.arrive(sj)
            p16, m_new, alpha, l_new = _softmax_step(s, m_i, l_i, c=c, dtype=dtype,
                                                     mask=mask_at(j) if masked else None)
            return o_ref[...], p16, m_new, alpha, l_new

        o, p16, m_new, alpha, l_new = pl.run_scoped(
            issue, plgpu.ACC((bq, bkv), jnp.float32), plgpu.ACC((bq, D), jnp.float32))
        v_rel.arrive(sp)
        return o * lax.broadcast_in_dim(alpha, o.shape, [0]), p16, m_new, l_new

    carry = (acc0, p16, m_i, l_i)
    if n_unmasked is None:  # no masked steps
        carry = lax.fori_loop(1, n_steps, functools.partial(step, masked=False), carry)
    else:
        first_masked = jnp.maximum(jnp.asarray(n_unmasked, jnp.int32), 1)
        carry = lax.fori_loop(1, first_masked, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(first_masked, n_steps, functools.partial(step, masked=True), carry)
    acc, p_last, m_i, l_i = carry
    last = slot(n_steps - 1)
    plgpu.barrier_wait(v_bar.at[last])

    def last_pv(o_ref):  # run_scoped, not run_state: `last` may be a Python int here
        o_ref[...] = acc
        plgpu.wgmma(o_ref, p_last, v_smem.at[last])
        sched.sync()
        return o_ref[...]

    acc = pl.run_scoped(last_pv, plgpu.ACC((bq, D), jnp.float32))
    v_rel.arrive(last)
    return acc, m_i, l_i


def _fwd_call(plgpu, body, q, k, v, *, q_buffers: int, bq: int, bkv: int, stages: int, grid, grid_names,
              interpret: bool, no_auto_barriers: bool):
    """plgpu.kernel for a forward body: 2 compute warpgroups + 1 memory warpgroup.

    Shared memory: Q/O tiles [2 warpgroups, *q_buffers, bq, D], the K and V rings [stages, bkv, D], lse
    staging [2, bq].  Barriers: k/v loaded (per slot), Q loaded (per warpgroup and buffer), k/v consumed
    (2 arrivals per slot), the ping-pong rendezvous (2 arrivals).
    """
    B, S, H, D = q.shape
    dtype = q.dtype
    tr = smem_transforms(plgpu, dtype)
    scratch = [
        (
            plgpu.SMEM((2, q_buffers, bq, D) if q_buffers > 1 else (2, bq, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((2, bq), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2 * q_buffers),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ),
    ]
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((B, H, S), jnp.float32))
    return warp_specialized_kernel(plgpu, body, out_type=out_type, scratch=scratch, grid=grid, grid_names=grid_names,
                                   compute_wgs=2, interpret=interpret,
                                   no_auto_barriers=no_auto_barriers)(q, k, v)


def flash_fwd(q, k, v, *, scale: float, causal: bool, config: HopperConfig | None = None,
              interpret: bool | None = None):
    """-> (out [B,S,H,D] q.dtype, lse [B,H,S] float32, natural log)."""
    plgpu = mosaic_gpu()
    interpret = resolve_interpret(interpret)
    B, S, H, D = q.shape
    Skv, G = k.shape[1], k.shape[2]
    cfg = config or default_config(D)
    rep = H // G
    dtype = q.dtype
    bq, bkv = cfg.block_q, cfg.block_kv
    if S % (2 * bq) or Skv % bkv:
        raise ValueError(f"sequence {S}/{Skv} not a multiple of {2 * bq}/{bkv}")
    if causal and S != Skv:
        raise ValueError("causal needs Sq == Skv")
    if not causal and cfg.fwd_persistent is not False and persistent_fits(cfg, D, dtype):
        return _flash_fwd_persistent(q, k, v, scale=scale, cfg=cfg, interpret=interpret)
    n_kv = Skv // bkv
    stages = max(1, min(cfg.stages, n_kv))
    n_qt = S // (2 * bq)
    c = float(scale) * LOG2E
    named = cfg.fwd_named_barrier is not False and not interpret
    named_release = bool(cfg.named_release) and not interpret
    overlap = bool(cfg.fwd_overlap) and not interpret
    split = cfg.split_causal

    def body(q_ref, k_ref, v_ref, o_ref, lse_ref, smem, bars):
        qo_smem2, k_smem, v_smem, lse_smem2 = smem
        k_bar, v_bar, q_bar, k_cons, v_cons, sched = bars
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        qt = lax.axis_index("q_seq")
        if causal:
            qt = (n_qt - 1) - qt  # heaviest tiles first
        kvh = lax.div(h, jnp.int32(rep))

        sched = _Sched(plgpu, sched, named)
        sched_sync = sched.sync
        k_rel, v_rel = slot_releases(plgpu, (k_cons, v_cons), stages=stages, named=named_release,
                                     first_id=_RELEASE_BAR_ID, compute_wgs=2)

        if causal:
            cta_steps = cdiv((qt + 1) * (2 * bq), bkv)
        else:
            cta_steps = n_kv

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q0 = qt * (2 * bq) + wg * bq
            kv_steps = cdiv(q0 + bq, bkv) if causal else n_kv

            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], qo_smem, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            plgpu.barrier_wait(k_bar.at[0])
            pl.when(wg == 1)(sched_sync)

            def kv_body(step, carry, masked: bool):
                slot = rem(step, stages)

                def mask(shape):
                    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                    return rows + q0 >= cols + step * bkv

                def wait_next_k():
                    nxt = step + 1

                    @pl.when(nxt < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_bar.at[rem(nxt, stages)])

                return _fwd_kv_step(
                    plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot], v_tile=v_smem.at[slot],
                    release_k=functools.partial(k_rel.arrive, slot), v_ready=v_bar.at[slot],
                    release_v=functools.partial(v_rel.arrive, slot),
                    sched=sched, c=c, dtype=dtype, interpret=interpret,
                    mask=mask if masked else None, wait_next_k=wait_next_k)

            full = (lax.div(q0, jnp.int32(bkv)) if split else jnp.int32(0)) if causal else None
            if overlap:
                def mask_at(j):
                    def mask(shape):
                        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                        return rows + q0 >= cols + j * bkv
                    return mask

                carry = _fwd_tile_overlapped(
                    plgpu, q_smem=qo_smem, k_smem=k_smem, v_smem=v_smem, k_bar=k_bar, v_bar=v_bar,
                    k_rel=k_rel, v_rel=v_rel, sched=sched, slot=lambda j: rem(j, stages),
                    n_steps=kv_steps, n_unmasked=full, mask_at=mask_at, c=c, dtype=dtype, bq=bq, D=D)
            elif not causal:
                carry = lax.fori_loop(0, n_kv, functools.partial(kv_body, masked=False), (acc, m_i, l_i))
            else:
                carry = lax.fori_loop(0, full, functools.partial(kv_body, masked=False), (acc, m_i, l_i))
                carry = lax.fori_loop(full, kv_steps, functools.partial(kv_body, masked=True), carry)
            if causal:

                def flush(step, _):
                    # Keep the pipeline and the ping-pong in step when this warpgroup is done
                    # before the other one (causal: the first warpgroup has fewer blocks).
                    slot = rem(step, stages)
                    plgpu.barrier_wait(k_bar.at[slot])  # observe every phase (no skipped waits)
                    k_rel.arrive(slot)
                    plgpu.barrier_wait(v_bar.at[slot])
                    v_rel.arrive(slot)
                    for _ in range(1 if overlap else 2):  # the loop's rendezvous per step
                        sched_sync()

                lax.fori_loop(kv_steps, cta_steps, flush, None)
            acc, m_i, l_i = carry
            pl.when(wg == 0)(sched_sync)

            inv = 1.0 / l_i
            acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            qo_smem[...] = acc.astype(dtype)
            lse_smem[...] = (m_i + jnp.log2(l_i)) * LN2
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(q0, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            stream_ring(plgpu, cta_steps, stages, lambda g: (b, pl.ds(g * bkv, bkv), kvh),
                        [(lambda sl: k_ref.at[sl], k_smem, k_bar, k_rel),
                         (lambda sl: v_ref.at[sl], v_smem, v_bar, v_rel)])

    out, lse = _fwd_call(plgpu, body, q, k, v, q_buffers=1, bq=bq, bkv=bkv, stages=stages, grid=(H, n_qt, B),
                         grid_names=("heads", "q_seq", "batch"), interpret=interpret,
                         no_auto_barriers=bool(cfg.no_auto_barriers))
    return out, lse


def _num_sms() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


def _flash_fwd_persistent(q, k, v, *, scale: float, cfg: HopperConfig, interpret: bool):
    """Non-causal forward on a persistent grid: CTA j takes query tiles j, j + n_ctas, ...

    Tiles are ordered (batch, head, query tile) so CTAs running together share K/V in L2.  The
    memory warpgroup streams K/V for all of the CTA's tiles through one ring (global step
    counter); each compute warpgroup double-buffers its Q tile in shared memory and loads the
    next tile's Q before this tile's epilogue (the O tile is staged in the buffer Q leaves).
    """
    plgpu = mosaic_gpu()
    B, S, H, D = q.shape
    Skv, G = k.shape[1], k.shape[2]
    rep = H // G
    dtype = q.dtype
    bq, bkv = cfg.block_q, cfg.block_kv
    n_kv = Skv // bkv
    stages = max(1, min(cfg.stages, n_kv))
    n_qt = S // (2 * bq)
    n_tiles = B * H * n_qt
    n_ctas = max(1, min(n_tiles, cfg.fwd_ctas or _num_sms()))
    c = float(scale) * LOG2E
    named = cfg.fwd_named_barrier is not False and not interpret
    named_release = bool(cfg.named_release) and not interpret
    overlap = bool(cfg.fwd_overlap) and not interpret

    def body(q_ref, k_ref, v_ref, o_ref, lse_ref, smem, bars):
        qo_smem4, k_smem, v_smem, lse_smem2 = smem
        k_bar, v_bar, q_bar, k_cons, v_cons, sched = bars
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        n_my = cdiv(n_tiles - cta, n_ctas)  # >= 1: n_ctas <= n_tiles

        def coords(i):
            t = cta + i * n_ctas
            bh = div(t, n_qt)
            return div(bh, H), rem(bh, H), rem(t, n_qt)  # batch, head, query tile

        sched = _Sched(plgpu, sched, named)
        sched_sync = sched.sync
        k_rel, v_rel = slot_releases(plgpu, (k_cons, v_cons), stages=stages, named=named_release,
                                     first_id=_RELEASE_BAR_ID, compute_wgs=2)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            def load_q(i, buf):
                b, h, qt = coords(i)
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(qt * (2 * bq) + wg * bq, bq), h],
                                        qo_smem4.at[wg, buf], q_bar.at[2 * wg + buf])

            load_q(0, 0)

            def tile_body(i, _):
                b, h, qt = coords(i)
                buf = rem(i, 2)
                qo_smem = qo_smem4.at[wg, buf]
                q0 = qt * (2 * bq) + wg * bq
                g0 = i * n_kv  # this tile's first step in the CTA's K/V ring
                plgpu.barrier_wait(q_bar.at[2 * wg + buf])
                m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                plgpu.barrier_wait(k_bar.at[rem(g0, stages)])
                pl.when(wg == 1)(sched_sync)

                def kv_body(step, carry):
                    g = g0 + step
                    slot = rem(g, stages)

                    def wait_next_k():
                        @pl.when(step + 1 < n_kv)
                        def _():
                            plgpu.barrier_wait(k_bar.at[rem(g + 1, stages)])

                    return _fwd_kv_step(
                        plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot],
                        v_tile=v_smem.at[slot], release_k=functools.partial(k_rel.arrive, slot),
                        v_ready=v_bar.at[slot], release_v=functools.partial(v_rel.arrive, slot), sched=sched, c=c, dtype=dtype,
                        interpret=interpret, wait_next_k=wait_next_k)

                if overlap:
                    acc, m_i, l_i = _fwd_tile_overlapped(
                        plgpu, q_smem=qo_smem, k_smem=k_smem, v_smem=v_smem, k_bar=k_bar, v_bar=v_bar,
                        k_rel=k_rel, v_rel=v_rel, sched=sched, slot=lambda j: rem(g0 + j, stages),
                        n_steps=n_kv, n_unmasked=None, mask_at=None, c=c, dtype=dtype, bq=bq, D=D)
                else:
                    acc, m_i, l_i = lax.fori_loop(0, n_kv, kv_body, (acc, m_i, l_i))
                pl.when(wg == 0)(sched_sync)
                # Q of this tile is consumed.  The other buffer staged the previous tile's O,
                # whose store was issued a whole tile ago: wait for it to be read, then load
                # the next tile's Q there while this tile's epilogue runs.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                when(i + 1 < n_my, lambda: load_q(i + 1, 1 - buf))
                inv = 1.0 / l_i
                acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                qo_smem[...] = acc.astype(dtype)
                lse_smem2.at[wg][...] = (m_i + jnp.log2(l_i)) * LN2
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(q0, bq), h])
                plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[b, h, pl.ds(q0, bq)])
                return None

            lax.fori_loop(0, n_my, tile_body, None)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            def kv_slice(g):  # the CTA's g-th K/V block: tile g // n_kv, block g % n_kv
                b, h, _ = coords(div(g, n_kv))
                return b, pl.ds(rem(g, n_kv) * bkv, bkv), lax.div(h, jnp.int32(rep))

            plgpu.set_max_registers(40, action="decrease")
            stream_ring(plgpu, n_my * n_kv, stages, kv_slice,
                        [(lambda sl: k_ref.at[sl], k_smem, k_bar, k_rel),
                         (lambda sl: v_ref.at[sl], v_smem, v_bar, v_rel)])

    out, lse = _fwd_call(plgpu, body, q, k, v, q_buffers=2, bq=bq, bkv=bkv, stages=stages, grid=(n_ctas,),
                         grid_names=("cta",), interpret=interpret,
                         no_auto_barriers=bool(cfg.no_auto_barriers))
    return out, lse
