"""The block-scaled FP8 GEMM on a persistent grid with clusters of two CTAs (Hopper, Pallas Mosaic GPU).

    block_scaled_gemm_persistent(a [M, K], b [N, K], a_scales [K/128, M], b_scales [K/128, N], *, out_dtype,
                                 block_n=128, stages=4, cluster_m=True, b_uniform=False, tile_width=8) -> [M, N]

The same product as kernel.block_scaled_gemm (the same operands, scales and promotion), organised as jax's Hopper
matmul example (jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py) organises a bf16 GEMM, for the two limits
kernel.py's measurements point at (benchmarks/results/fp8_block_gemm_h100.md):
- **L2 traffic per FLOP.** With cluster_m, two CTAs computing vertically adjacent 128 x block_n tiles share the
  b tile: each loads half of it and TMA multicasts that half into both CTAs' shared memory (25% less traffic
  per FLOP at block_n 128).
- **Per-tile prologue and epilogue.** One CTA (or cluster) per SM loops over output tiles in a planar-snake order
  (L2 locality); a tile's output store is asynchronous and overlaps the next tile's first loads.
The K loop is plgpu.emit_pipeline_warp_specialized: a memory warpgroup streams a, b and both scale rows through
a `stages`-deep ring; each of the two compute warpgroups (64 rows each) runs per K block one wgmma into a fresh
accumulator and promotes it into the running one (carried in registers across the pipeline's steps).

M % (128 x cluster) == 0, N % block_n == 0, K % 128 == 0.
Checked on an H100 against reference.block_scaled_gemm_reference (tests/test_fp8_block_gemm.py); te_jax's block
path (te_jax/fp8/block.py) runs every block GEMM on it (speed: benchmarks/results/fp8_block_gemm_h100.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import mosaic_gpu, pl
from .._lower_once import lower_once
from ..flash_attention_hopper.common import num_sms, smem_transforms
from .kernel import BLOCK_M, check_operands, max_stages, promoted
from .reference import BLOCK_K


@lower_once(static_argnames=("out_dtype", "block_n", "stages", "cluster_m", "b_uniform", "tile_width", "n_ctas"))
def block_scaled_gemm_persistent(a, b, a_scales, b_scales, *, out_dtype=jnp.bfloat16, block_n: int = 128,
                                 stages: int = 4, cluster_m: bool = True, b_uniform: bool = False,
                                 tile_width: int = 8, n_ctas: int | None = None):
    """See the module docstring.  b_uniform as kernel.block_scaled_gemm's (one scalar b scale per K block, block_n
    128 only).  n_ctas: CTAs launched (None: the SM count; a multiple of the cluster size)."""
    cluster = 2 if cluster_m else 1
    m, n, nk = check_operands("block_scaled_gemm_persistent", a, b, a_scales, b_scales, block_n, BLOCK_M * cluster)
    plgpu = mosaic_gpu()
    bn = block_n
    stages = max(1, min(stages, nk, max_stages(bn, out_dtype)))
    uniform = b_uniform and bn == BLOCK_K
    m_iters, n_iters = m // (BLOCK_M * cluster), n // bn
    grid_ctas = (n_ctas or num_sms()) // cluster
    rows, cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    tr_a, tr_b, tr_o = (smem_transforms(plgpu, dt) for dt in (a.dtype, b.dtype, out_dtype))

    def get_pipeline(step, context):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(nk,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((BLOCK_M, BLOCK_K), lambda kb: (0, kb), transforms=tr_a, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((bn, BLOCK_K), lambda kb: (0, kb), transforms=tr_b, memory_space=plgpu.SMEM,
                                collective_axes=("cluster",) if cluster > 1 else ()),
                plgpu.BlockSpec((1, BLOCK_M), lambda kb: (kb, 0), memory_space=plgpu.SMEM),
                plgpu.BlockSpec((1, bn), lambda kb: (kb, 0), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=context,
        )

    def body(a_ref, b_ref, sa_ref, sb_ref, o_ref):
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cluster") if cluster > 1 else 0
        ignore = lambda *_, **__: None

        @functools.partial(pl.run_scoped,
                           allocs=get_pipeline(ignore, ignore).get_allocations(a_ref, b_ref, sa_ref, sb_ref),
                           out_smem=plgpu.SMEM((2, 64, bn), out_dtype, transforms=tr_o), collective_axes="wg")
        def _scope(allocs, out_smem):
            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
            def _tiles(info):
                (lin,) = info.index
                mc, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, tile_width)
                mi = mc * cluster + cta
                m_rows, n_cols = pl.ds(mi * BLOCK_M, BLOCK_M), pl.ds(ni * bn, bn)

                def context(run_pipeline):
                    acc = run_pipeline(plgpu.layout_cast(jnp.full((64, bn), 0.0, jnp.float32), plgpu.Layout.WGMMA))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read out_smem
                    out_smem.at[wg][...] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], o_ref.at[pl.ds(mi * BLOCK_M + wg * 64, 64), n_cols])

                def step(_, a_blk, b_blk, sa_blk, sb_blk, acc):
                    def mma(acc_ref):
                        plgpu.wgmma(acc_ref, a_blk.at[pl.ds(wg * 64, 64)], b_blk.transpose((1, 0)))
                        return acc_ref[...]

                    part = pl.run_scoped(mma, plgpu.ACC((64, bn), jnp.float32))
                    sa = plgpu.load(sa_blk.at[0, pl.ds(wg * 64, 64)], layout=rows)
                    if uniform:
                        return promoted(acc, part, sa * sb_blk[0, 0], True)
                    return promoted(acc, part, (sa, plgpu.load(sb_blk.at[0], layout=cols)), False)

                get_pipeline(step, context)(a_ref.at[m_rows, :], b_ref.at[n_cols, :], sa_ref.at[:, m_rows],
                                            sb_ref.at[:, n_cols], allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    body.__name__ = "te_jax_fp8_block_gemm_persistent"
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(grid_ctas,), grid_names=("cluster_grid",),
        cluster=(cluster,) if cluster > 1 else (), cluster_names=("cluster",) if cluster > 1 else (),
        num_threads=3, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))
    return kernel(a, b, a_scales.astype(jnp.float32), b_scales.astype(jnp.float32))
