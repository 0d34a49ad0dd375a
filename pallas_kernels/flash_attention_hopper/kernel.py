"""Hopper (sm90) flash attention in Pallas Mosaic GPU: wgmma, TMA pipelines, warp specialisation.

Forward (FA3 layout): each CTA owns 2 x block_q query rows; two compute warpgroups (one per
block_q rows) and one memory warpgroup that streams K/V tiles into a `stages`-deep shared-memory
ring with TMA.  The two compute warpgroups ping-pong on the tensor cores through a
"schedule" barrier, so one warpgroup's softmax runs while the other's QK^T / PV wgmma runs.
Causal: the grid walks query tiles heaviest first, CTAs load only the K/V blocks left of the
diagonal, and only blocks that cross the diagonal are masked.

Backward: warp specialised with a TMA ring.
  * dK/dV: a CTA owns `wgs` x block_kv key rows of one KV head and loops over every query
    head of its GQA group and every query block (causal: only those at or below the diagonal),
    accumulating dK and dV in registers.  For head_dim 256 dK and dV run as two launches
    (two 64x256 fp32 accumulators do not fit in one warpgroup's registers).
  * dQ, either (bwd_dq_atomic; auto = atomic for head_dim 128 from 2k keys):
    - atomic: inside the dK/dV kernel.  The CTA's dS tile goes to shared memory; warpgroup w
      computes dQ[:, w*D/2:(w+1)*D/2] over all of the CTA's keys and adds it to an fp32 buffer
      with a TMA reduce-add (5 matmuls per block pair);
    - a separate dQ kernel: a CTA owns `wgs` x block_q query rows and loops over K/V blocks
      (recomputes S and dP: 7 matmuls per block pair, no fp32 buffer).
All recompute P from the saved log-sum-exp.

Mosaic GPU is imported lazily (inside functions) so that this module imports on any machine.
Only jax >= 0.11 (`plgpu.kernel` + `lax.axis_index`) is supported for the kernels themselves.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from te_jax._compat import default_interpret, mosaic_gpu, pl

LOG2E = math.log2(math.e)
ATOMIC_DQ_MIN_KV = 2048  # bwd_dq_atomic=None: atomic dQ from this key length on
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Block sizes.  Forward CTA = 2 * block_q query rows.  Backward CTA = bwd_wgs * block rows."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    bwd_block_q: int = 64
    bwd_block_kv: int = 64
    bwd_wgs: int = 2
    bwd_stages: int = 2
    # The mask is applied only on blocks that cross the diagonal when True; on every block
    # (simpler, slower) when False.  Kept for debugging.
    split_causal: bool = True
    # dQ accumulated inside the dK/dV kernel (FA3): the CTA's dS tile goes to shared memory and
    # each warpgroup adds its dQ columns to a float32 buffer with TMA reduce-add: 5 matmuls per
    # block pair instead of the dQ kernel's 7, plus a zero-fill and a conversion pass over dQ.
    # None (auto): on when served (see atomic_dq_served) and the key sequence is >= 2048
    # (H100: faster from 4k; at 1k the two extra passes over the fp32 buffer cost more).
    bwd_dq_atomic: bool | None = None
    # Forward, non-causal: a persistent grid (one CTA per SM looping over query tiles; the K/V
    # ring runs on across tiles and the next tile's Q is loaded during this tile's epilogue).
    # None (auto): on for non-causal calls.  Causal calls always use one CTA per query tile.
    fwd_persistent: bool | None = None
    fwd_ctas: int | None = None  # persistent CTAs; None: the device's SM count
    # The forward's ping-pong rendezvous on a hardware named barrier (`bar.sync`, inline PTX)
    # instead of an mbarrier arrive + wait.  None (auto): on the GPU; the interpreter always
    # uses the mbarrier.
    fwd_named_barrier: bool | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv"):
            if getattr(self, name) % 64:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 64")
        if self.block_kv % self.block_q:
            raise ValueError("block_kv must be a multiple of block_q")
        if self.stages < 1 or self.bwd_stages < 1:
            raise ValueError("stages must be >= 1")
        if self.bwd_wgs not in (1, 2):
            raise ValueError("bwd_wgs must be 1 or 2")


def default_config(head_dim: int) -> HopperConfig:
    if head_dim <= 64:
        return HopperConfig(block_q=64, block_kv=128, stages=3)
    if head_dim <= 128:
        return HopperConfig(block_q=64, block_kv=128, stages=2)
    return HopperConfig(block_q=64, block_kv=64, stages=2, bwd_wgs=1)


def _resolve_interpret(interpret):
    return default_interpret() if interpret is None else bool(interpret)


def _interpret_arg(interpret: bool):
    if not interpret:
        return None
    plgpu = mosaic_gpu()
    return plgpu.InterpretGPUParams()


def _mma_into(plgpu, acc, a, b, *, interpret: bool, after=None):
    """acc + a @ b on the tensor cores (wgmma).  `after` runs while the wgmma is in flight."""
    if interpret:
        # The CPU interpreter cannot seed an accumulator with a value, nor take the A operand
        # from registers: emulate with a plain dot (same bf16 operands, fp32 accumulation).
        if isinstance(a, jax.Array):
            out = acc + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
            if after is not None:
                after()
            return out

        def f(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            if after is not None:
                after()
            return acc_ref[...]

        return acc + pl.run_scoped(f, plgpu.ACC(acc.shape, jnp.float32))

    def g(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if after is not None:
            after()

    return pl.run_state(g)(plgpu.ACC.init(acc))


def _mma(plgpu, shape, a, b, *, after=None):
    """a @ b into a fresh fp32 accumulator."""

    def f(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if after is not None:
            after()
        return acc_ref[...]

    return pl.run_scoped(f, plgpu.ACC(shape, jnp.float32))


def _smem_transforms(plgpu, dtype):
    swizzle = 128
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _cdiv(a, b: int):
    if isinstance(a, int):
        return -(-a // b)
    return lax.div(a + (b - 1), jnp.int32(b))


def _rem(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    return lax.rem(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _div(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _when(cond, fn):
    """pl.when that also accepts a Python bool."""
    if isinstance(cond, bool):
        if cond:
            fn()
        return
    pl.when(cond)(fn)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------
_SCHED_BAR_ID = 4  # Mosaic GPU uses named barriers 0 (CTA) and 1 + warpgroup


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


def _fwd_kv_step(plgpu, carry, *, q_smem, k_tile, v_tile, k_cons, v_ready, v_cons, sched,
                 c: float, dtype, interpret: bool, mask=None, wait_next_k=None):
    """One K/V block of the forward for one compute warpgroup (online softmax, ping-pong).

    carry: (acc [bq, D] f32, m [bq] f32 (log2 units, scaled), l [bq] f32).  The QK^T wgmma is
    followed by a rendezvous on `sched` (the other warpgroup then runs its softmax while this
    one's wgmma runs); after the softmax a second rendezvous waits for the tensor cores.
    mask(shape) -> bool [bq, bkv] keeps logits (causal blocks); wait_next_k runs while the PV
    wgmma is in flight (the next K tile's barrier).
    """
    acc, m_i, l_i = carry
    D = acc.shape[-1]

    bq, bkv = q_smem.shape[0], k_tile.shape[0]
    s = _mma(plgpu, (bq, bkv), q_smem, k_tile.transpose((1, 0)), after=sched.sync)
    plgpu.barrier_arrive(k_cons)
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

    acc = _mma_into(plgpu, acc, p16, v_tile, interpret=interpret, after=wait_next_k)
    plgpu.barrier_arrive(v_cons)
    return acc, m_new, l_i


def flash_fwd(q, k, v, *, scale: float, causal: bool, config: HopperConfig | None = None,
              interpret: bool | None = None):
    """-> (out [B,S,H,D] q.dtype, lse [B,H,S] float32, natural log)."""
    plgpu = mosaic_gpu()
    interpret = _resolve_interpret(interpret)
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
    if not causal and cfg.fwd_persistent is not False and _persistent_fits(cfg, D, dtype):
        return _flash_fwd_persistent(q, k, v, scale=scale, cfg=cfg, interpret=interpret)
    n_kv = Skv // bkv
    stages = max(1, min(cfg.stages, n_kv))
    n_qt = S // (2 * bq)
    c = float(scale) * LOG2E
    named = cfg.fwd_named_barrier is not False and not interpret
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

        if causal:
            cta_steps = _cdiv((qt + 1) * (2 * bq), bkv)
        else:
            cta_steps = n_kv

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q0 = qt * (2 * bq) + wg * bq
            kv_steps = _cdiv(q0 + bq, bkv) if causal else n_kv

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
                slot = _rem(step, stages)

                def mask(shape):
                    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                    return rows + q0 >= cols + step * bkv

                def wait_next_k():
                    nxt = step + 1

                    @pl.when(nxt < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_bar.at[_rem(nxt, stages)])

                return _fwd_kv_step(
                    plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot], v_tile=v_smem.at[slot],
                    k_cons=k_cons.at[slot], v_ready=v_bar.at[slot], v_cons=v_cons.at[slot],
                    sched=sched, c=c, dtype=dtype, interpret=interpret,
                    mask=mask if masked else None, wait_next_k=wait_next_k)

            carry = (acc, m_i, l_i)
            if not causal:
                carry = lax.fori_loop(0, n_kv, functools.partial(kv_body, masked=False), carry)
            else:
                full = lax.div(q0, jnp.int32(bkv)) if split else jnp.int32(0)
                carry = lax.fori_loop(0, full, functools.partial(kv_body, masked=False), carry)
                carry = lax.fori_loop(full, kv_steps, functools.partial(kv_body, masked=True), carry)

                def flush(step, _):
                    # Keep the pipeline and the ping-pong in step when this warpgroup is done
                    # before the other one (causal: the first warpgroup has fewer blocks).
                    slot = _rem(step, stages)
                    plgpu.barrier_wait(k_bar.at[slot])  # observe every phase (no skipped waits)
                    plgpu.barrier_arrive(k_cons.at[slot])
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_arrive(v_cons.at[slot])
                    sched_sync()
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
            for i in range(stages):
                def _load(i=i):
                    sl = (b, pl.ds(i * bkv, bkv), kvh)
                    plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[i], k_bar.at[i])
                    plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[i], v_bar.at[i])
                _when(i < cta_steps, _load)

            def mem_body(step, _):
                t = step + stages
                slot = _rem(step, stages)
                sl = (b, pl.ds(t * bkv, bkv), kvh)
                plgpu.barrier_wait(k_cons.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_bar.at[slot])
                plgpu.barrier_wait(v_cons.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_bar.at[slot])

            lax.fori_loop(0, cta_steps - stages, mem_body, None)

            def drain(step, _):
                # Observe the last consumed phases so that every barrier phase is waited on
                # before the CTA exits (the GPU interpreter checks this).
                slot = _rem(step, stages)
                plgpu.barrier_wait(k_cons.at[slot])
                plgpu.barrier_wait(v_cons.at[slot])

            lax.fori_loop(jnp.maximum(cta_steps - stages, 0), cta_steps, drain, None)

    tr = _smem_transforms(plgpu, dtype)
    scratch = [
        (
            plgpu.SMEM((2, bq, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((2, bq), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ),
    ]
    out, lse = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                  jax.ShapeDtypeStruct((B, H, S), jnp.float32)),
        scratch_types=scratch,
        grid=(H, n_qt, B),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_arg(interpret),
    )(q, k, v)
    return out, lse


SMEM_BYTES = 227 * 1024  # sm90 dynamic shared memory per CTA


def _persistent_fits(cfg: HopperConfig, head_dim: int, dtype) -> bool:
    """The persistent forward's shared memory (2 Q/O buffers per warpgroup + the K/V ring)."""
    item = jnp.dtype(dtype).itemsize
    need = (4 * cfg.block_q + 2 * cfg.stages * cfg.block_kv) * head_dim * item + 4096
    return need <= SMEM_BYTES


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

    def body(q_ref, k_ref, v_ref, o_ref, lse_ref, smem, bars):
        qo_smem4, k_smem, v_smem, lse_smem2 = smem
        k_bar, v_bar, q_bar, k_cons, v_cons, sched = bars
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        n_my = _cdiv(n_tiles - cta, n_ctas)  # >= 1: n_ctas <= n_tiles

        def coords(i):
            t = cta + i * n_ctas
            bh = _div(t, n_qt)
            return _div(bh, H), _rem(bh, H), _rem(t, n_qt)  # batch, head, query tile

        sched = _Sched(plgpu, sched, named)
        sched_sync = sched.sync

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
                buf = _rem(i, 2)
                qo_smem = qo_smem4.at[wg, buf]
                q0 = qt * (2 * bq) + wg * bq
                g0 = i * n_kv  # this tile's first step in the CTA's K/V ring
                plgpu.barrier_wait(q_bar.at[2 * wg + buf])
                m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                plgpu.barrier_wait(k_bar.at[_rem(g0, stages)])
                pl.when(wg == 1)(sched_sync)

                def kv_body(step, carry):
                    g = g0 + step
                    slot = _rem(g, stages)

                    def wait_next_k():
                        @pl.when(step + 1 < n_kv)
                        def _():
                            plgpu.barrier_wait(k_bar.at[_rem(g + 1, stages)])

                    return _fwd_kv_step(
                        plgpu, carry, q_smem=qo_smem, k_tile=k_smem.at[slot],
                        v_tile=v_smem.at[slot], k_cons=k_cons.at[slot], v_ready=v_bar.at[slot],
                        v_cons=v_cons.at[slot], sched=sched, c=c, dtype=dtype,
                        interpret=interpret, wait_next_k=wait_next_k)

                acc, m_i, l_i = lax.fori_loop(0, n_kv, kv_body, (acc, m_i, l_i))
                pl.when(wg == 0)(sched_sync)
                # Q of this tile is consumed.  The other buffer staged the previous tile's O,
                # whose store was issued a whole tile ago: wait for it to be read, then load
                # the next tile's Q there while this tile's epilogue runs.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                _when(i + 1 < n_my, lambda: load_q(i + 1, 1 - buf))
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
            plgpu.set_max_registers(40, action="decrease")
            total = n_my * n_kv

            def load(g, slot):
                b, h, _ = coords(_div(g, n_kv))
                sl = (b, pl.ds(_rem(g, n_kv) * bkv, bkv), lax.div(h, jnp.int32(rep)))
                plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_bar.at[slot])

            for i in range(stages):
                _when(i < total, functools.partial(load, jnp.int32(i), i))

            def mem_body(step, _):
                slot = _rem(step, stages)
                g = step + stages
                b, h, _ = coords(_div(g, n_kv))
                sl = (b, pl.ds(_rem(g, n_kv) * bkv, bkv), lax.div(h, jnp.int32(rep)))
                plgpu.barrier_wait(k_cons.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_bar.at[slot])
                plgpu.barrier_wait(v_cons.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_bar.at[slot])

            lax.fori_loop(0, total - stages, mem_body, None)

            def drain(step, _):
                slot = _rem(step, stages)
                plgpu.barrier_wait(k_cons.at[slot])
                plgpu.barrier_wait(v_cons.at[slot])

            lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)

    tr = _smem_transforms(plgpu, dtype)
    scratch = [
        (
            plgpu.SMEM((2, 2, bq, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((2, bq), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=4),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ),
    ]
    out, lse = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                  jax.ShapeDtypeStruct((B, H, S), jnp.float32)),
        scratch_types=scratch,
        grid=(n_ctas,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_arg(interpret),
    )(q, k, v)
    return out, lse


# --------------------------------------------------------------------------------------------
# Backward: dK/dV
# --------------------------------------------------------------------------------------------
def _flash_bwd_dkv(q, k, v, do, lse2, delta, *, scale, causal, cfg: HopperConfig,
                   want_dk: bool, want_dv: bool, interpret: bool, dq_acc_ref=None):
    plgpu = mosaic_gpu()
    B, S, H, D = q.shape
    Skv, G = k.shape[1], k.shape[2]
    rep = H // G
    dtype = q.dtype
    bq, bkv, wgs = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_wgs
    if S % bq or Skv % (wgs * bkv):
        raise ValueError("sequence not a multiple of the backward blocks")
    nq = S // bq
    n_kt = Skv // (wgs * bkv)
    stages = cfg.bwd_stages
    c = float(scale) * LOG2E
    split = cfg.split_causal

    want_dq = dq_acc_ref is not None
    # atomic dQ: the CTA's `wgs` warpgroups share one (bq x wgs*bkv) dS tile through shared
    # memory; warpgroup w computes dQ columns [w*dqw, (w+1)*dqw) over all of the CTA's keys, so
    # each query block gets ONE fp32 reduce-add of bq x D per CTA step (not one per warpgroup).
    dqw = D // wgs
    if want_dq and not want_dk:
        raise ValueError("atomic dQ rides on the dK pass")

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if want_dq:
            dq_ref, rest = rest[0], rest[1:]
        outs = rest[: int(want_dk) + int(want_dv)]
        smem, bars = rest[len(outs):]
        dk_ref = outs[0] if want_dk else None
        dv_ref = outs[-1] if want_dv else None
        k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem = smem[:6]
        if want_dq:
            ds_smem3, dq_smem2 = smem[6:]
            bars, ds_ready = bars[:-1], bars[-1]
        (kv_bar, q_bar, do_bar, lse_bar, delta_bar,
         q_cons, do_cons, lse_cons, delta_cons) = bars
        b = lax.axis_index("batch")
        g = lax.axis_index("kv_heads")
        wg = lax.axis_index("wg")
        kt = lax.axis_index("kv_seq")
        if causal:
            kt = (n_kt - 1) - kt  # causal: the first key tiles see the most queries: start them first
        kv_cta0 = kt * (wgs * bkv)
        q_lo = lax.div(kv_cta0, jnp.int32(bq)) if causal else 0
        n_steps_h = nq - q_lo  # query blocks per query head
        # query blocks [q_lo, q_lo + n_mask) cross the diagonal of this CTA's keys
        if causal:
            n_mask = (_cdiv(kv_cta0 + wgs * bkv, bq) - q_lo) if split else n_steps_h
        total = rep * n_steps_h

        def step_coords(t):
            hh = g * rep + _div(t, n_steps_h)
            qb = q_lo + _rem(t, n_steps_h)
            return hh, qb

        def _compute(wq):
            # wq: this warpgroup's index as a Python int when dQ is accumulated here (its dQ
            # columns are a static slice of the swizzled K tile); refs are indexed with `wg`.
            plgpu.set_max_registers(232 if wgs == 2 else 240, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            kv0 = kv_cta0 + wg * bkv
            sl = (b, pl.ds(kv0, bkv), g)
            plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem, kv_bar.at[2 * wg])
            plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem, kv_bar.at[2 * wg + 1])
            plgpu.barrier_wait(kv_bar.at[2 * wg])
            plgpu.barrier_wait(kv_bar.at[2 * wg + 1])
            zero = plgpu.layout_cast(jnp.full((bkv, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            dk_acc = zero if want_dk else None
            dv_acc = zero if want_dv else None

            def step_body(t, qb, carry, masked: bool):
                dk_acc, dv_acc = carry
                slot = _rem(t, stages)
                plgpu.barrier_wait(q_bar.at[slot])
                sT = _mma(plgpu, (bkv, bq), k_smem, q_smem.at[slot].transpose((1, 0)))
                plgpu.barrier_wait(lse_bar.at[slot])
                lse = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                plgpu.barrier_arrive(lse_cons.at[slot])
                pT = jnp.exp2(sT * c - lax.broadcast_in_dim(lse, (bkv, bq), [1]))
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 1, layout=plgpu.Layout.WGMMA)
                    pT = jnp.where(cols + qb * bq >= rows + kv0, pT, 0.0)
                plgpu.barrier_wait(do_bar.at[slot])
                if want_dv and want_dk and not interpret:
                    # one wgmma group for dV += P^T dO and dP^T = V dO^T: a single wait
                    zT = plgpu.layout_cast(jnp.full((bkv, bq), 0.0, jnp.float32),
                                           plgpu.Layout.WGMMA)
                    pT16 = pT.astype(dtype)

                    def _dv_dp(refs):
                        dv_ref, dp_ref = refs
                        plgpu.wgmma(dv_ref, pT16, do_smem.at[slot])
                        plgpu.wgmma(dp_ref, v_smem, do_smem.at[slot].transpose((1, 0)))

                    dv_acc, dpT = pl.run_state(_dv_dp)((plgpu.ACC.init(dv_acc),
                                                        plgpu.ACC.init(zT)))
                else:
                    if want_dv:
                        dv_acc = _mma_into(plgpu, dv_acc, pT.astype(dtype), do_smem.at[slot],
                                           interpret=interpret)
                    if want_dk:
                        dpT = _mma(plgpu, (bkv, bq), v_smem, do_smem.at[slot].transpose((1, 0)))
                plgpu.barrier_arrive(do_cons.at[slot])
                if want_dk:
                    plgpu.barrier_wait(delta_bar.at[slot])
                    delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                    dsT = pT * (dpT - lax.broadcast_in_dim(delta, (bkv, bq), [1]))
                    plgpu.barrier_arrive(delta_cons.at[slot])
                    dsT16 = dsT.astype(dtype)
                    if want_dq and not interpret:
                        hh, _ = step_coords(t)
                        buf = _rem(t, 2)  # dS is double buffered: one 2-arrival barrier per step
                        ds_smem3.at[buf, wg][...] = dsT16
                        plgpu.commit_smem()  # generic-proxy stores -> visible to wgmma
                        plgpu.barrier_arrive(ds_ready.at[buf])
                        zq = plgpu.layout_cast(jnp.full((bq, dqw), 0.0, jnp.float32),
                                               plgpu.Layout.WGMMA)

                        def _dk_dq(refs):
                            dk_r, dq_r = refs
                            plgpu.wgmma(dk_r, dsT16, q_smem.at[slot])
                            plgpu.barrier_wait(ds_ready.at[buf])  # every warpgroup's dS stored
                            for w in range(wgs):
                                plgpu.wgmma(dq_r, ds_smem3.at[buf, w].transpose((1, 0)),
                                            k_smem2.at[w, :, pl.ds(wq * dqw, dqw)])

                        dk_acc, dq_part = pl.run_state(_dk_dq)((plgpu.ACC.init(dk_acc),
                                                                plgpu.ACC.init(zq)))
                        # the previous step's reduce-add must have read dq_smem
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        dq_smem2.at[wg][...] = dq_part
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            dq_smem2.at[wg],
                            dq_ref.at[b, pl.ds(qb * bq, bq), hh, pl.ds(wq * dqw, dqw)],
                            reduction_op="add")
                    else:
                        dk_acc = _mma_into(plgpu, dk_acc, dsT16, q_smem.at[slot],
                                           interpret=interpret)
                else:
                    plgpu.barrier_wait(delta_bar.at[slot])
                    plgpu.barrier_arrive(delta_cons.at[slot])
                plgpu.barrier_arrive(q_cons.at[slot])
                return dk_acc, dv_acc

            def head_body(i, carry):
                base = i * n_steps_h
                if causal:
                    def mbody(j, carry):
                        return step_body(base + j, q_lo + j, carry, masked=True)

                    def ubody(j, carry):
                        return step_body(base + j, q_lo + j, carry, masked=False)

                    carry = lax.fori_loop(0, n_mask, mbody, carry)
                    carry = lax.fori_loop(n_mask, n_steps_h, ubody, carry)
                else:
                    def ubody(j, carry):
                        return step_body(base + j, j, carry, masked=False)

                    carry = lax.fori_loop(0, n_steps_h, ubody, carry)
                return carry

            dk_acc, dv_acc = lax.fori_loop(0, rep, head_body, (dk_acc, dv_acc))
            if want_dq and not interpret:
                # the other warpgroups' last dQ wgmma reads this K tile: wait for them before
                # the tile is overwritten with dK (one more phase of the dS barrier)
                plgpu.barrier_arrive(ds_ready.at[_rem(total, 2)])
                plgpu.barrier_wait(ds_ready.at[_rem(total, 2)])
            if want_dk:
                k_smem[...] = (dk_acc * scale).astype(dtype)
            if want_dv:
                v_smem[...] = dv_acc.astype(dtype)
            plgpu.commit_smem()
            if want_dk:
                plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[sl], commit_group=False)
            if want_dv:
                plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[sl], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        if want_dq:
            for w in range(wgs):
                pl.when(wg == w)(functools.partial(_compute, w))
        else:
            pl.when(wg < wgs)(functools.partial(_compute, None))

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(t, slot):
                hh, qb = step_coords(t)
                qsl = (b, pl.ds(qb * bq, bq), hh)
                rsl = (b, hh, pl.ds(qb * bq, bq))
                plgpu.copy_gmem_to_smem(q_ref.at[qsl], q_smem.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[rsl], lse_smem.at[slot], lse_bar.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[qsl], do_smem.at[slot], do_bar.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[rsl], delta_smem.at[slot], delta_bar.at[slot])

            for i in range(stages):
                _when(i < total, functools.partial(issue, jnp.int32(i), i))

            def mem_body(step, _):
                t = step + stages
                slot = _rem(step, stages)
                hh, qb = step_coords(t)
                qsl = (b, pl.ds(qb * bq, bq), hh)
                rsl = (b, hh, pl.ds(qb * bq, bq))
                plgpu.barrier_wait(q_cons.at[slot])
                plgpu.copy_gmem_to_smem(q_ref.at[qsl], q_smem.at[slot], q_bar.at[slot])
                plgpu.barrier_wait(lse_cons.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[rsl], lse_smem.at[slot], lse_bar.at[slot])
                plgpu.barrier_wait(do_cons.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[qsl], do_smem.at[slot], do_bar.at[slot])
                plgpu.barrier_wait(delta_cons.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[rsl], delta_smem.at[slot], delta_bar.at[slot])

            lax.fori_loop(0, total - stages, mem_body, None)

            def drain(step, _):
                slot = _rem(step, stages)
                for bar in (q_cons, lse_cons, do_cons, delta_cons):
                    plgpu.barrier_wait(bar.at[slot])

            lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)

    tr = _smem_transforms(plgpu, dtype)
    scratch = [
        (
            plgpu.SMEM((wgs, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((wgs, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bq, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bq, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
        ) + ((
            plgpu.SMEM((2, wgs, bkv, bq), dtype, transforms=tr),
            plgpu.SMEM((wgs, bq, dqw), jnp.float32),
        ) if want_dq else ()),
        (plgpu.Barrier(num_barriers=2 * wgs),)
        + (plgpu.Barrier(num_barriers=stages),) * 4
        + (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 4
        + ((plgpu.Barrier(num_arrivals=wgs, num_barriers=2),) if want_dq else ()),
    ]
    out_type = []
    if want_dk:
        out_type.append(jax.ShapeDtypeStruct(k.shape, dtype))
    if want_dv:
        out_type.append(jax.ShapeDtypeStruct(v.shape, dtype))
    outs = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(G, n_kt, B),
        grid_names=("kv_heads", "kv_seq", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_arg(interpret),
    )(q, k, v, do, lse2, delta, *((dq_acc_ref,) if want_dq else ()))
    return tuple(outs)


# --------------------------------------------------------------------------------------------
# Backward: dQ
# --------------------------------------------------------------------------------------------
def _flash_bwd_dq(q, k, v, do, lse2, delta, *, scale, causal, cfg: HopperConfig,
                  interpret: bool):
    plgpu = mosaic_gpu()
    B, S, H, D = q.shape
    Skv, G = k.shape[1], k.shape[2]
    rep = H // G
    dtype = q.dtype
    bq, bkv, wgs = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_wgs
    if S % (wgs * bq) or Skv % bkv:
        raise ValueError("sequence not a multiple of the backward blocks")
    n_qt = S // (wgs * bq)
    n_kv = Skv // bkv
    stages = cfg.bwd_stages
    c = float(scale) * LOG2E
    split = cfg.split_causal

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, smem, bars):
        q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem = smem
        in_bar, k_bar, v_bar, k_cons, v_cons = bars
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        qt = lax.axis_index("q_seq")
        if causal:
            qt = (n_qt - 1) - qt
        kvh = lax.div(h, jnp.int32(rep))
        q_cta0 = qt * (wgs * bq)
        if causal:
            total = _cdiv(q_cta0 + wgs * bq, bkv)
            n_full = lax.div(q_cta0, jnp.int32(bkv)) if split else jnp.int32(0)
        else:
            total = n_kv

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(232 if wgs == 2 else 240, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
            q0 = q_cta0 + wg * bq
            qsl = (b, pl.ds(q0, bq), h)
            rsl = (b, h, pl.ds(q0, bq))
            plgpu.copy_gmem_to_smem(q_ref.at[qsl], q_smem, in_bar.at[4 * wg])
            plgpu.copy_gmem_to_smem(do_ref.at[qsl], do_smem, in_bar.at[4 * wg + 1])
            plgpu.copy_gmem_to_smem(lse_ref.at[rsl], lse_smem, in_bar.at[4 * wg + 2])
            plgpu.copy_gmem_to_smem(delta_ref.at[rsl], delta_smem, in_bar.at[4 * wg + 3])
            for j in range(4):
                plgpu.barrier_wait(in_bar.at[4 * wg + j])
            lse = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            delta = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            dq_acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def step_body(t, dq_acc, masked: bool):
                slot = _rem(t, stages)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])

                def _s_dp(s_ref, dp_ref):
                    # one wgmma group, one wait
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, do_smem, v_smem.at[slot].transpose((1, 0)))
                    return s_ref[...], dp_ref[...]

                s, dp = pl.run_scoped(_s_dp, plgpu.ACC((bq, bkv), jnp.float32),
                                      plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_arrive(v_cons.at[slot])
                p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, (bq, bkv), [0]))
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                    p = jnp.where(rows + q0 >= cols + t * bkv, p, 0.0)
                ds = p * (dp - lax.broadcast_in_dim(delta, (bq, bkv), [0]))
                dq_acc = _mma_into(plgpu, dq_acc, ds.astype(dtype), k_smem.at[slot],
                                   interpret=interpret)
                plgpu.barrier_arrive(k_cons.at[slot])
                return dq_acc

            if causal:
                dq_acc = lax.fori_loop(0, n_full, functools.partial(step_body, masked=False), dq_acc)
                dq_acc = lax.fori_loop(n_full, total, functools.partial(step_body, masked=True), dq_acc)
            else:
                dq_acc = lax.fori_loop(0, total, functools.partial(step_body, masked=False), dq_acc)
            q_smem[...] = (dq_acc * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[qsl])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for i in range(stages):
                def _load(i=i):
                    sl = (b, pl.ds(i * bkv, bkv), kvh)
                    plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[i], k_bar.at[i])
                    plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[i], v_bar.at[i])
                _when(i < total, _load)

            def mem_body(step, _):
                t = step + stages
                slot = _rem(step, stages)
                sl = (b, pl.ds(t * bkv, bkv), kvh)
                plgpu.barrier_wait(k_cons.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_bar.at[slot])
                plgpu.barrier_wait(v_cons.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_bar.at[slot])

            lax.fori_loop(0, total - stages, mem_body, None)

            def drain(step, _):
                slot = _rem(step, stages)
                plgpu.barrier_wait(k_cons.at[slot])
                plgpu.barrier_wait(v_cons.at[slot])

            lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)

    tr = _smem_transforms(plgpu, dtype)
    scratch = [
        (
            plgpu.SMEM((wgs, bq, D), dtype, transforms=tr),
            plgpu.SMEM((wgs, bq, D), dtype, transforms=tr),
            plgpu.SMEM((wgs, bq), jnp.float32),
            plgpu.SMEM((wgs, bq), jnp.float32),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
            plgpu.SMEM((stages, bkv, D), dtype, transforms=tr),
        ),
        (
            plgpu.Barrier(num_barriers=4 * wgs),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        ),
    ]
    dq = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=scratch,
        grid=(H, n_qt, B),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_arg(interpret),
    )(q, k, v, do, lse2, delta)
    return dq


def atomic_dq_served(head_dim: int, cfg: HopperConfig, interpret: bool) -> bool:
    """Whether flash_bwd accumulates dQ inside the dK/dV kernel for this config.

    Needs: the GPU (the CPU interpreter has no TMA reduce-add), head_dim <= 128 (shared memory),
    and head_dim / bwd_wgs a multiple of 64 (each warpgroup's dQ columns are whole swizzle tiles).
    """
    return (cfg.bwd_dq_atomic is not False and not interpret and head_dim <= 128
            and (head_dim // cfg.bwd_wgs) % 64 == 0)


def flash_bwd(q, k, v, out, lse, do, *, scale: float, causal: bool,
              config: HopperConfig | None = None, dlse=None, interpret: bool | None = None):
    """Gradients (dq, dk, dv) given the forward's out and natural-log lse [B,H,S]."""
    interpret = _resolve_interpret(interpret)
    D = q.shape[-1]
    cfg = config or default_config(D)
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    if dlse is not None:
        # d lse / d s = p, so a cotangent on lse adds p * dlse to dS: fold it into delta.
        delta = delta - dlse.astype(jnp.float32)
    lse2 = lse.astype(jnp.float32) * LOG2E
    kw = dict(scale=scale, causal=causal, cfg=cfg, interpret=interpret)
    atomic = atomic_dq_served(D, cfg, interpret) and (
        cfg.bwd_dq_atomic or k.shape[1] >= ATOMIC_DQ_MIN_KV)
    if atomic:
        dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
        dk, dv = _flash_bwd_dkv(q, k, v, do, lse2, delta, want_dk=True, want_dv=True,
                                dq_acc_ref=dq_acc, **kw)
        dq = (dq_acc[...] * scale).astype(q.dtype)
        return dq, dk, dv
    if D > 128:
        (dk,) = _flash_bwd_dkv(q, k, v, do, lse2, delta, want_dk=True, want_dv=False, **kw)
        (dv,) = _flash_bwd_dkv(q, k, v, do, lse2, delta, want_dk=False, want_dv=True, **kw)
    else:
        dk, dv = _flash_bwd_dkv(q, k, v, do, lse2, delta, want_dk=True, want_dv=True, **kw)
    dq = _flash_bwd_dq(q, k, v, do, lse2, delta, **kw)
    return dq, dk, dv
