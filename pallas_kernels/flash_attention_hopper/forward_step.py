"""The Hopper forward's shared step: one K/V block of the online softmax for one compute warpgroup, with the two
warpgroups' ping-pong on the tensor cores (used by the plain, persistent and data-mask forwards).
Mosaic GPU is imported lazily by the callers: this module imports on any machine."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from .._compat import pl
from .common import mma, mma_into, named_barrier
from .config import LN2, HopperConfig


class FwdGeometry(NamedTuple):
    """What every forward kernel derives from q [B,S,H,D], k [B,Skv,G,D] and its config."""
    B: int
    S: int
    H: int
    D: int
    Skv: int
    G: int
    rep: int  # query heads per K/V head
    dtype: object
    bq: int
    bkv: int
    n_kv: int  # K/V blocks
    stages: int  # K/V ring depth (at most n_kv)
    n_qt: int  # query tiles of 2 x block_q rows


def fwd_geometry(q, k, cfg: HopperConfig) -> FwdGeometry:
    B, S, H, D = q.shape
    Skv, G = k.shape[1], k.shape[2]
    n_kv = Skv // cfg.block_kv
    return FwdGeometry(B, S, H, D, Skv, G, H // G, q.dtype, cfg.block_q, cfg.block_kv, n_kv,
                       max(1, min(cfg.stages, n_kv)), S // (2 * cfg.block_q))


_SCHED_BAR_ID = 4  # Mosaic GPU uses named barriers 0 (CTA) and 1 + warpgroup


class _Sched:
    """The two compute warpgroups' ping-pong on the tensor cores (the forward's schedule).

    Each step of a warpgroup: QK^T wgmma, `after_qk`, softmax, `before_pv`, PV wgmma.  Warpgroup 1 calls `start`
    before its first step, warpgroup 0 `finish` after its last.  Both warpgroups meet after issuing QK^T and again
    before PV (mbarrier: one 2-arrival barrier; named: `bar.sync 4, 256`), so one's softmax runs while the other's
    wgmmas do.  (FA3's hand-off, each warpgroup waiting on its own barrier, is no faster and needs two barriers.)
    """

    def __init__(self, plgpu, bar, named: bool):
        self.plgpu, self.bar, self.named = plgpu, bar, named

    def _meet(self):
        if self.named:
            named_barrier(self.plgpu, "sync", _SCHED_BAR_ID, 256)
        else:
            self.plgpu.barrier_arrive(self.bar)
            self.plgpu.barrier_wait(self.bar)

    start = after_qk = finish = _meet

    def before_pv(self, v_ready):
        """After the softmax: V ready, and the other warpgroup done with the tensor cores."""
        if self.named:
            self.plgpu.barrier_wait(v_ready)
            self._meet()
        else:
            self.plgpu.barrier_arrive(self.bar)  # done with softmax
            self.plgpu.barrier_wait(v_ready)
            self.plgpu.barrier_wait(self.bar)  # tensor cores free

    def flush_step(self):
        """A step's two schedule points with no work (a warpgroup done before the other, causal)."""
        self._meet()
        self._meet()


def _fwd_kv_step(plgpu, carry, *, q_smem, k_tile, v_tile, k_release, v_ready, v_release, sched,
                 c: float, dtype, interpret: bool, mask=None, wait_next_k=None, pre=None, may_be_empty=False,
                 apply_mask=None):
    """One K/V block of the forward for one compute warpgroup (online softmax, ping-pong).

    carry: (acc [bq, D] f32, m [bq] f32 (log2 units, scaled), l [bq] f32).  The QK^T wgmma is
    followed by a rendezvous on `sched` (the other warpgroup then runs its softmax while this
    one's wgmma runs); after the softmax a second rendezvous waits for the tensor cores.
    pre (softcap): the logits are tanh(s * pre) in units of c (common.logit_units).
    mask(shape) -> bool [bq, bkv] keeps logits (causal blocks); wait_next_k runs while the PV
    wgmma is in flight (the next K tile's barrier).  k_release / v_release hand the K / V slot back.
    apply_mask(s) -> s with the hidden logits -inf (a data mask).  may_be_empty (a data mask): a row may have seen
    no visible key yet (its max still -inf); the exponentials then
    use 0 in its place, never -inf - -inf.
    """
    acc, m_i, l_i = carry
    D = acc.shape[-1]

    bq, bkv = q_smem.shape[0], k_tile.shape[0]
    s = mma(plgpu, (bq, bkv), q_smem, k_tile.transpose((1, 0)), after=sched.after_qk)
    k_release()
    if pre is not None:
        s = jnp.tanh(s * pre)
    if mask is not None:
        s = jnp.where(mask(s.shape), s, -jnp.inf)
    if apply_mask is not None:  # a data mask: s with the hidden logits -inf
        s = apply_mask(s)

    m_new = jnp.maximum(m_i, s.max(axis=1) * c)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if may_be_empty else m_new
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
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
    v_release()
    return acc, m_new, l_i


# --- Q tiles and O tiles where v's head_dim Dv differs from q/k's D --------------------------------------------

def o_tiles_in_q(bq: int, D: int, Dv: int, dtype) -> bool:
    """Whether each warpgroup's O tile [bq, Dv] can live inside its own Q tile [bq, D] (a RefUnion): Dv < D and both
    the O tile and the gap to the next Q tile whole multiples of the 1024-byte shared-memory alignment."""
    isz = jnp.dtype(dtype).itemsize
    return Dv < D and (bq * Dv * isz) % 1024 == 0 and (bq * (D - Dv) * isz) % 1024 == 0


def qo_scratch(plgpu, q_tiles, bq: int, D: int, Dv: int, dtype, tr_v):
    """(the Q tiles' scratch entry, extra scratch entries): Q tiles [2, bq, D] as given where Dv == D (O is staged
    in Q's buffer); a RefUnion with (O tile of warpgroup 0, a gap, O tile of warpgroup 1) where o_tiles_in_q; else
    the Q tiles and a separate O tile [2, bq, Dv] as an extra entry (last)."""
    if Dv == D:
        return q_tiles, ()
    o_tile = plgpu.SMEM((bq, Dv), dtype, transforms=tr_v)
    if o_tiles_in_q(bq, D, Dv, dtype):
        gap = plgpu.SMEM((bq * (D - Dv) * jnp.dtype(dtype).itemsize,), jnp.int8)
        return plgpu.RefUnion(q_tiles, (o_tile, gap, o_tile)), ()
    return q_tiles, (plgpu.SMEM((2, bq, Dv), dtype, transforms=tr_v),)


def qo_refs(q_entry, extra, bq: int, D: int, Dv: int, dtype):
    """The kernel-side refs of qo_scratch: (Q tiles [2, ...], O tiles (one per warpgroup) or None: O in Q's)."""
    if Dv == D:
        return q_entry, None
    if o_tiles_in_q(bq, D, Dv, dtype):
        q_tiles, (o0, _, o1) = q_entry
        return q_tiles, (o0, o1)
    return q_entry, (extra[0].at[0], extra[0].at[1])


def write_o(plgpu, o_tiles, qo_smem, wg, value):
    """value [bq, Dv] into this warpgroup's O tile (qo_smem where o_tiles is None); static refs per warpgroup."""
    if o_tiles is None:
        qo_smem[...] = value
        return
    for w, o_tile in enumerate(o_tiles):
        pl.when(wg == w)(functools.partial(o_tile.__setitem__, Ellipsis, value))


def store_o(plgpu, o_tiles, qo_smem, wg, dst, store=None):
    """TMA this warpgroup's O tile to dst (after commit_smem); store(src) instead issues the copies of the tile
    src itself (aligned_tiles: only the rows the tile owns)."""
    put = store or (lambda src: plgpu.copy_smem_to_gmem(src, dst))
    if o_tiles is None:
        put(qo_smem)
        return
    for w, o_tile in enumerate(o_tiles):
        pl.when(wg == w)(functools.partial(put, o_tile))


def finish_tile(plgpu, carry, *, o_tiles, qo_smem, lse_smem, wg, dtype, o_dst, lse_dst, may_be_empty: bool,
                o_store=None, read_only: bool = True):
    """A forward tile's epilogue: out = acc / l into the O tile and lse (natural log) into lse_smem, both TMA'd to
    o_dst / lse_dst (o_store(src): O's copies issued by the caller instead), then waited for.  may_be_empty (a data
    mask): a row that saw no key gives out 0, lse -inf.  read_only: wait only until the stores have read the shared
memory (HopperConfig.exit_wait_read_only)."""
    acc, m_i, l_i = carry
    if may_be_empty:
        empty = l_i == 0.0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l_i))
    else:
        inv = 1.0 / l_i
    acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    write_o(plgpu, o_tiles, qo_smem, wg, acc.astype(dtype))
    if may_be_empty:
        lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(jnp.where(empty, 1.0, l_i))) * LN2)
    else:
        lse_smem[...] = (m_i + jnp.log2(l_i)) * LN2
    plgpu.commit_smem()
    store_o(plgpu, o_tiles, qo_smem, wg, o_dst, o_store)
    plgpu.copy_smem_to_gmem(lse_smem, lse_dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=read_only)
