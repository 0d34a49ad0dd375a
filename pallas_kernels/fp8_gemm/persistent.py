"""The block-scaled FP8 GEMM on a persistent grid with clusters of two CTAs (Hopper, Pallas Mosaic GPU).

    block_scaled_gemm_persistent(a [M, K], b [N, K], a_scales [K/128, M], b_scales [K/128, N], *, out_dtype,
                                 block_n=128, stages=4, cluster_m=True, b_uniform=False, tile_width=8,
                                 promotion="serial") -> [M, N]
    PROMOTIONS = ("serial", "rescale", "unscaled")

The same product as kernel.block_scaled_gemm (the same operands, scales and promotion), organised as jax's Hopper
matmul example (jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py) organises a bf16 GEMM, for the two limits
kernel.py's measurements point at (benchmarks/results/fp8_block_gemm_h100.md):
- **L2 traffic per FLOP.** With cluster_m, two CTAs computing vertically adjacent 128 x block_n tiles share the
  b tile: each loads half of it and TMA multicasts that half into both CTAs' shared memory (25% less traffic
  per FLOP at block_n 128).
- **Per-tile prologue and epilogue.** One CTA (or cluster) per SM loops over output tiles in a planar-snake order
  (L2 locality); a tile's output store is asynchronous and overlaps the next tile's first loads.
The K loop is plgpu.emit_pipeline_warp_specialized: a memory warpgroup streams a, b and both scale rows through
a `stages`-deep ring to the two compute warpgroups (64 rows each). How a warpgroup sums the K blocks:
- promotion "serial": per K block one wgmma into a fresh fp32 fragment, then, once it has finished, that product
  scaled and added into the running sum in registers (DeepSeek-V3's promotion; the other warpgroup's wgmma keeps
  the tensor cores busy meanwhile);
- promotion "rescale": no separate product fragment. The running accumulator is kept in units of the current K
  block's scales: before block kb's wgmma it is multiplied by s[kb-1] / s[kb] (per row, and per column or per 128
  columns of b; rescale.rescale_factors, a [K/128, rows] pass of XLA, which also bounds the ratios), the wgmma
  accumulates into it, and the epilogue multiplies by the last block's scales. Registers: one 64 x block_n
  fragment, so block_n 256 fits. The sum stays in the tensor cores' accumulator, as cuBLASLt's fast accumulation
  (TransformerEngine's use_split_accumulator=False); "serial" is the split accumulator;
- promotion "unscaled": no scales and no promotion, every K block accumulated by the wgmma itself. The result is
  wrong unless every scale is 1; it exists to time the pipeline's ceiling (benchmarks/fp8_block_gemm_gpu.py).
block_n 256: each warpgroup computes 64 x 256 as two 128-column halves, one wgmma each ("serial": promoted into
that half's running sum, 128 + 64 fp32 registers a thread; "rescale": 128; "unscaled" runs one 64 x 256 wgmma).
On the H100 "rescale" at block_n 256 is what te_jax runs: the 128 x 128 tile tops out near 1070 TFLOP/s even
unscaled, 128 x 256 near 1250 (benchmarks/results/fp8_block_gemm_h100.md, which also records the schedules tried
and dropped: promotion overlapped with the next wgmma, a wgmma left in flight, the warpgroups' ping-pong, one
64 x 256 wgmma under "rescale").

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
from .kernel import BLOCK_M, check_operands, max_stages, promoted, scaled
from .reference import BLOCK_K
from .rescale import rescale_factors


PROMOTIONS = ("serial", "rescale", "unscaled")


@lower_once(static_argnames=("out_dtype", "block_n", "stages", "cluster_m", "b_uniform", "tile_width", "n_ctas",
                             "promotion"))
def block_scaled_gemm_persistent(a, b, a_scales, b_scales, *, out_dtype=jnp.bfloat16, block_n: int = 128,
                                 stages: int = 4, cluster_m: bool = True, b_uniform: bool = False,
                                 tile_width: int = 8, n_ctas: int | None = None, promotion: str = "serial"):
    """See the module docstring.  b_uniform: b is in 128x128 tiles (kernel.block_scaled_gemm's; one scalar per K
    block and 128 columns of the tile).  block_n: 128 or 256.  n_ctas: CTAs launched (None: the SM count; a
    multiple of the cluster size).  promotion: one of PROMOTIONS (module docstring); stages is capped to what
    shared memory holds (3 at block_n 256)."""
    if promotion not in PROMOTIONS:
        raise ValueError(f"block_scaled_gemm_persistent: promotion={promotion!r}; expected one of {PROMOTIONS}")
    if block_n not in (BLOCK_K, 2 * BLOCK_K):
        raise ValueError(f"block_scaled_gemm_persistent: block_n={block_n}; expected 128 or 256")
    cluster = 2 if cluster_m else 1
    m, n, nk = check_operands("block_scaled_gemm_persistent", a, b, a_scales, b_scales, block_n, BLOCK_M * cluster)
    plgpu = mosaic_gpu()
    bn = block_n
    stages = max(1, min(stages, nk, max_stages(bn, out_dtype)))
    halves = bn // BLOCK_K
    rescale = promotion == "rescale"
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

    def body(a_ref, b_ref, sa_ref, sb_ref, fa_ref, fb_ref, o_ref):
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cluster") if cluster > 1 else 0
        ignore = lambda *_, **__: None

        @functools.partial(pl.run_scoped,
                           allocs=get_pipeline(ignore, ignore).get_allocations(a_ref, b_ref, sa_ref, sb_ref),
                           out_smem=plgpu.SMEM((2, 64, bn), out_dtype, transforms=tr_o),
                           # "rescale": each warpgroup's epilogue factors (a's 64 rows, b's bn columns)
                           f_smem=(plgpu.SMEM((2, 64), jnp.float32), plgpu.SMEM((2, bn), jnp.float32)) if rescale
                           else (),
                           f_bars=(plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)) if rescale else (),
                           collective_axes="wg")
        def _scope(allocs, out_smem, f_smem, f_bars):
            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
            def _tiles(info):
                (lin,) = info.index
                mc, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, tile_width)
                mi = mc * cluster + cta
                m_rows, n_cols = pl.ds(mi * BLOCK_M, BLOCK_M), pl.ds(ni * bn, bn)

                def store(accs):
                    """accs: the warpgroup's 64 x bn result, as one array or as 128-column halves."""
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read out_smem
                    for h, acc in enumerate(accs):
                        out_smem.at[wg, :, pl.ds(h * acc.shape[1], acc.shape[1])][...] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], o_ref.at[pl.ds(mi * BLOCK_M + wg * 64, 64), n_cols])

                def zeros(shape, layout):
                    return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), layout)

                def factors(ra, rb, h):
                    """The factors of columns [128 h, 128 h + 128), as kernel.scaled takes them: a's row factors
                    ra [64] (loaded) and b's from the [1, bn] ref rb (a scalar per 128 columns when b_uniform)."""
                    if b_uniform:
                        return ra * rb[0, h * BLOCK_K]
                    return ra, plgpu.load(rb.at[0, pl.ds(h * BLOCK_K, BLOCK_K)], layout=cols)

                def row_factors(ref):
                    return plgpu.load(ref.at[0, pl.ds(wg * 64, 64)], layout=rows)

                def a_and_b(a_blk, b_blk, h=None):
                    b_cols = b_blk if h is None else b_blk.at[pl.ds(h * BLOCK_K, BLOCK_K)]
                    return a_blk.at[pl.ds(wg * 64, 64)], b_cols.transpose((1, 0))

                if rescale:
                    def context(run_pipeline):
                        # the epilogue's factors, fetched into this warpgroup's slots while the K loop runs (the
                        # previous tile's epilogue read them before its store's commit_smem)
                        fa_src, fb_src = fa_ref.at[0, pl.ds(mi * BLOCK_M + wg * 64, 64)], fb_ref.at[0, n_cols]
                        for src, dst, bar in zip((fa_src, fb_src), f_smem, f_bars):
                            plgpu.copy_gmem_to_smem(src, dst.at[wg], bar.at[wg])
                        accs = run_pipeline(tuple(zeros((64, BLOCK_K), plgpu.Layout.WGMMA) for _ in range(halves)))
                        for bar in f_bars:
                            plgpu.barrier_wait(bar.at[wg])
                        fa = plgpu.load(f_smem[0].at[wg], layout=rows)
                        fb = f_smem[1].at[pl.ds(wg, 1)]
                        store([scaled(acc, factors(fa, fb, h), b_uniform) for h, acc in enumerate(accs)])

                    def step(_, a_blk, b_blk, ra_blk, rb_blk, accs):
                        ra = row_factors(ra_blk)
                        accs = tuple(scaled(acc, factors(ra, rb_blk, h), b_uniform) for h, acc in enumerate(accs))

                        def mma(refs):
                            for h, ref in enumerate(refs):
                                plgpu.wgmma(ref, *a_and_b(a_blk, b_blk, h if halves > 1 else None))

                        return pl.run_state(mma)(tuple(plgpu.ACC.init(acc) for acc in accs))
                elif promotion == "unscaled":
                    def context(run_pipeline):
                        def with_acc(acc_ref):
                            run_pipeline(acc_ref)
                            return acc_ref[...]

                        store([pl.run_scoped(with_acc, plgpu.ACC((64, bn), jnp.float32))])

                    def step(_, a_blk, b_blk, sa_blk, sb_blk, acc_ref):
                        plgpu.wgmma(acc_ref, *a_and_b(a_blk, b_blk))
                        plgpu.wgmma_wait(0)
                        return acc_ref
                else:
                    def context(run_pipeline):
                        store(run_pipeline(tuple(zeros((64, BLOCK_K), plgpu.Layout.WGMMA) for _ in range(halves))))

                    def step(_, a_blk, b_blk, sa_blk, sb_blk, accs):
                        sa, out = row_factors(sa_blk), []
                        for h, acc in enumerate(accs):
                            def mma(acc_ref, h=h):
                                plgpu.wgmma(acc_ref, *a_and_b(a_blk, b_blk, h if halves > 1 else None))
                                return acc_ref[...]

                            part = pl.run_scoped(mma, plgpu.ACC((64, BLOCK_K), jnp.float32))
                            out.append(promoted(acc, part, factors(sa, sb_blk, h), b_uniform))
                        return tuple(out)

                get_pipeline(step, context)(a_ref.at[m_rows, :], b_ref.at[n_cols, :], sa_ref.at[:, m_rows],
                                            sb_ref.at[:, n_cols], allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    body.__name__ = "te_jax_fp8_block_gemm_persistent"
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(grid_ctas,), grid_names=("cluster_grid",),
        cluster=(cluster,) if cluster > 1 else (), cluster_names=("cluster",) if cluster > 1 else (),
        num_threads=3, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))
    sa, sb = a_scales.astype(jnp.float32), b_scales.astype(jnp.float32)
    fa, fb = sa[-1:], sb[-1:]  # unused but by "rescale"
    if rescale:
        (sa, fa), (sb, fb) = rescale_factors(sa), rescale_factors(sb)
    return kernel(a, b, sa, sb, fa, fb)
