"""Block-scaled FP8 GEMM on Hopper (sm90) in Pallas Mosaic GPU: the DeepSeek-V3 recipe's GEMM.

    block_scaled_gemm(a [M, K], b [N, K], a_scales [K/128, M], b_scales [K/128, N], *, out_dtype) -> [M, N]
        C = sum over 128-wide K blocks kb of (a[:, kb] . b[:, kb]^T) * a_scales[kb, :, None] * b_scales[kb, None, :]

Both operands are FP8 (float8_e4m3fn or float8_e5m2) and K-major ("TN", what FP8 wgmma takes); every row of a and
of b has its own scale per K block. So 1x128 activation tiles are one scale per row and block, and 128x128 weight
tiles are one scale repeated over 128 rows (reference.row_scales).

A CTA computes a 128 x block_n tile of C with two compute warpgroups (64 rows each) and a memory warpgroup. The
memory warpgroup streams the K blocks of a, b and their scales into a `stages`-deep ring with TMA. Each
warpgroup runs per K block:
- one wgmma into a fresh fp32 accumulator;
- the scaled sum into its running accumulator (the "promotion" of DeepGEMM), while the other warpgroup's wgmma
  runs.
M % 128 == 0, N % block_n == 0, K % 128 == 0.

GPU only: no Mosaic GPU interpreter on jax 0.10.2, and Mosaic GPU is imported lazily.
Checked on an H100 against reference.block_scaled_gemm_reference by tests/test_fp8_block_gemm.py and
benchmarks/fp8_block_gemm_gpu.py (which also times it: benchmarks/results/fp8_block_gemm_h100.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import mosaic_gpu, pl
from .._lower_once import lower_once
from ..flash_attention_hopper.common import (mma, rem, resolve_interpret, ring_slots, run_producer, smem_transforms,
                                             stream_ring, warp_specialized_kernel)
from .reference import BLOCK_K

BLOCK_M = 128  # two compute warpgroups of 64 rows
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def gemm_shape_reason(a_shape, b_shape, a_dtype, b_dtype, block_n: int = 128) -> str | None:
    """None when block_scaled_gemm takes these operands, else why not."""
    if len(a_shape) != 2 or len(b_shape) != 2:
        return f"a {tuple(a_shape)} and b {tuple(b_shape)} must be 2-D ([M, K] and [N, K])"
    (m, k), (n, k2) = a_shape, b_shape
    if k != k2:
        return f"contraction lengths differ: a [M, K] = {tuple(a_shape)}, b [N, K] = {tuple(b_shape)}"
    for name, dt in (("a", a_dtype), ("b", b_dtype)):
        if jnp.dtype(dt) not in _FP8:
            return f"{name} has dtype {jnp.dtype(dt).name}; expected float8_e4m3fn or float8_e5m2"
    for name, x, mult in (("M", m, BLOCK_M), ("N", n, block_n), ("K", k, BLOCK_K)):
        if x % mult:
            return f"{name}={x} is not a multiple of {mult}"
    return None


def check_operands(where: str, a, b, a_scales, b_scales, block_n: int, rows_multiple: int = BLOCK_M):
    """(M, N, K/128) of a block GEMM's operands, or a ValueError naming the operand, its shape and the one expected.
    rows_multiple: what M must divide into (128; 256 for clusters of two CTAs)."""
    why = gemm_shape_reason(a.shape, b.shape, a.dtype, b.dtype, block_n)
    if why is None and a.shape[0] % rows_multiple:
        why = f"M={a.shape[0]} is not a multiple of {rows_multiple}"
    if why is not None:
        raise ValueError(f"{where}: {why}")
    (m, k), n = a.shape, b.shape[0]
    nk = k // BLOCK_K
    for name, s, want in (("a_scales", a_scales, (nk, m)), ("b_scales", b_scales, (nk, n))):
        if tuple(s.shape) != want:
            raise ValueError(f"{where}: {name} has shape {tuple(s.shape)}; expected {want} "
                             f"([K/128, rows]: one scale per row and K block)")
    return m, n, nk


def scaled(x, s, uniform: bool):
    """x [64, n] times factors s: the row factors [64] (a's row factors times b's one scalar: uniform b) or
    (a's row factors [64], b's column factors [n])."""
    shape = x.shape
    if uniform:
        return x * lax.broadcast_in_dim(s, shape, [0])
    sa, sb = s
    return (x * lax.broadcast_in_dim(sa, shape, [0])) * lax.broadcast_in_dim(sb, shape, [1])


def promoted(acc, part, s, uniform: bool):
    """acc + this K block's product `part` [64, n] scaled by its scales s (as `scaled` takes them)."""
    return acc + scaled(part, s, uniform)


SMEM_BYTES = 227 * 1024 - 1024  # sm90's shared memory per CTA, less room for the barriers


def max_stages(block_n: int, out_dtype) -> int:
    """The deepest ring that fits shared memory beside the output tile (block_n 128: 5; 256: 3)."""
    per_stage = 2 * 64 * BLOCK_K + block_n * BLOCK_K + 2 * 64 * 4 + block_n * 4  # a, b (FP8), both scale rows
    out_tile = 2 * 64 * block_n * jnp.dtype(out_dtype).itemsize
    return max(1, (SMEM_BYTES - out_tile) // per_stage)


@lower_once(static_argnames=("out_dtype", "block_n", "stages", "b_uniform", "overlap", "interpret"))
def block_scaled_gemm(a, b, a_scales, b_scales, *, out_dtype=jnp.bfloat16, block_n: int = 128, stages: int = 4,
                      b_uniform: bool = False, overlap: bool = True, interpret: bool | None = None):
    """See the module docstring.  a_scales [K/128, M], b_scales [K/128, N] float32 (dequantization factors).

    stages: the ring depth, capped at the number of K blocks and at what shared memory holds (max_stages).

    b_uniform: every 128-row block of b has one scale per K block (128x128 weight tiles, as the forward and dgrad
        GEMMs of the recipe have): the kernel reads one scalar per K block instead of a scale per column, and the
        promotion is one multiply-add per element.  Only with block_n 128; ignored otherwise.
    overlap: the promotion of K block kb-1 runs while the wgmma of block kb is in flight (a second fp32 fragment
        of registers); without it the warpgroup waits for its wgmma, then promotes.  Only with block_n 128.
    """
    m, n, nk = check_operands("block_scaled_gemm", a, b, a_scales, b_scales, block_n)
    k = nk * BLOCK_K
    plgpu = mosaic_gpu()
    interpret = resolve_interpret(interpret)
    bn, bk = block_n, BLOCK_K
    stages = max(1, min(stages, nk, max_stages(bn, out_dtype)))
    uniform = b_uniform and bn == BLOCK_K
    overlap = overlap and bn == BLOCK_K
    named_release = producer_warp = not interpret
    wgmma_rows, wgmma_cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def body(a_ref, b_ref, sa_ref, sb_ref, c_ref, smem, bars):
        a_ring, b_ring, sa_ring, sb_ring, c_smem = smem
        a_bar, b_bar, sa_bar, sb_bar, a_cons, b_cons, sa_cons, sb_cons = bars
        rings = ring_slots(plgpu, (a_cons, b_cons, sa_cons, sb_cons), stages, named=named_release,
                           producer_warp=producer_warp, compute_wgs=2)
        a_sl, b_sl, sa_sl, sb_sl = rings
        mi = lax.axis_index("m")
        ni = lax.axis_index("n")
        wg = lax.axis_index("wg")

        def scales_of(slot):
            """This K block's scales: the row factors [64] (uniform b) or (a rows [64], b columns [bn])."""
            plgpu.barrier_wait(sa_bar.at[slot])
            plgpu.barrier_wait(sb_bar.at[slot])
            sa = plgpu.load(sa_ring.at[slot, wg], layout=wgmma_rows)
            if uniform:
                s = sa * sb_ring[slot, 0]
            else:
                s = (sa, plgpu.load(sb_ring.at[slot], layout=wgmma_cols))
            sa_sl.release(slot)
            sb_sl.release(slot)
            return s

        def promote(acc, part, s):
            return promoted(acc, part, s, uniform)

        def zeros(shape, layout):
            return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), layout)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            for ring in rings:
                ring.prime()
            acc = zeros((64, bn), plgpu.Layout.WGMMA)

            def wait_ab(slot):
                plgpu.barrier_wait(a_bar.at[slot])
                plgpu.barrier_wait(b_bar.at[slot])
                return a_ring.at[slot, wg], b_ring.at[slot].transpose((1, 0))

            def step(kb, acc):
                slot = rem(kb, stages)
                part = mma(plgpu, (64, bn), *wait_ab(slot))
                a_sl.release(slot)
                b_sl.release(slot)
                return promote(acc, part, scales_of(slot))

            def step_overlapped(kb, carry):
                acc, prev, s_prev = carry
                slot = rem(kb, stages)
                a_blk, b_blk = wait_ab(slot)

                def f(acc_ref):
                    plgpu.wgmma(acc_ref, a_blk, b_blk)
                    promoted = promote(acc, prev, s_prev)  # while this block's wgmma runs
                    s = scales_of(slot)
                    return acc_ref[...], promoted, s

                part, acc, s = pl.run_scoped(f, plgpu.ACC((64, bn), jnp.float32))
                a_sl.release(slot)
                b_sl.release(slot)
                return acc, part, s

            if overlap:
                s0 = (zeros((64,), wgmma_rows) if uniform
                      else (zeros((64,), wgmma_rows), zeros((bn,), wgmma_cols)))
                acc, last, s_last = lax.fori_loop(0, nk, step_overlapped,
                                                  (acc, zeros((64, bn), plgpu.Layout.WGMMA), s0))
                acc = promote(acc, last, s_last)
            else:
                acc = lax.fori_loop(0, nk, step, acc)
            c_smem.at[wg][...] = acc.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(c_smem.at[wg], c_ref.at[pl.ds(mi * BLOCK_M + wg * 64, 64), pl.ds(ni * bn, bn)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            run_producer(plgpu, lambda: stream_ring(
                plgpu, nk, stages, lambda kb: kb,
                [(lambda kb: a_ref.at[pl.ds(mi * 2, 2), :, pl.ds(kb * bk, bk)], a_ring, a_bar, a_sl),
                 (lambda kb: b_ref.at[pl.ds(ni * bn, bn), pl.ds(kb * bk, bk)], b_ring, b_bar, b_sl),
                 (lambda kb: sa_ref.at[kb, pl.ds(mi * 2, 2)], sa_ring, sa_bar, sa_sl),
                 (lambda kb: sb_ref.at[kb, pl.ds(ni * bn, bn)], sb_ring, sb_bar, sb_sl)]),
                single_warp=producer_warp)

    f8_tr = smem_transforms(plgpu, a.dtype)
    scratch = [
        (
            plgpu.SMEM((stages, 2, 64, bk), a.dtype, transforms=f8_tr),
            plgpu.SMEM((stages, bn, bk), b.dtype, transforms=smem_transforms(plgpu, b.dtype)),
            plgpu.SMEM((stages, 2, 64), jnp.float32),
            plgpu.SMEM((stages, bn), jnp.float32),
            plgpu.SMEM((2, 64, bn), out_dtype, transforms=smem_transforms(plgpu, out_dtype)),
        ),
        tuple(plgpu.Barrier(num_barriers=stages) for _ in range(4))
        + tuple(plgpu.Barrier(num_arrivals=2, num_barriers=stages) for _ in range(4)),
    ]
    kernel = warp_specialized_kernel(
        plgpu, body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), scratch=scratch, grid=(n // bn, m // BLOCK_M),
        grid_names=("n", "m"), compute_wgs=2, interpret=interpret, name="te_jax_fp8_block_gemm",
        no_auto_barriers=producer_warp)
    return kernel(a.reshape(m // 64, 64, k), b, a_scales.astype(jnp.float32).reshape(nk, m // 64, 64),
                  b_scales.astype(jnp.float32))
