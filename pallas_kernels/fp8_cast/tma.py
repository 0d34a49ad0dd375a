"""FP8 dActivation + cast + transpose on Hopper's TMA (Pallas Mosaic GPU): the SwiGLU backward's cast, written to
reach copy bandwidth where the Triton-lowered kernel (kernels.dact_cast_transpose) is limited by its transposed
stores.  Not yet run on a GPU: opt-in (te_jax: TE_JAX_FP8_DACT_KERNEL=tma), lowered for CUDA in CI.

    dact_cast_transpose_tma(dh, gu, scale, ...)   the same call and results as kernels.dact_cast_transpose:
        dh [M, F], gu [M, 2, F] (gated) | [M, F] -> dgu_q [gu's shape], dgu_qT [n*F, M], amax (f32 scalar)

One CTA (one warpgroup) per (block x block) tile of [M, F]: TMA brings the tile of dh and of each half of gu into
shared memory; the warpgroup computes d(gate, up) in fp32 in the WGMMA register layout, casts it (common.saturate)
and stores it twice, row-major and through a transposed view of a second tile (the register layout switched to its
transpose first, one shuffle per pair of registers); TMA writes both tiles and the tile's row maxima of |dgu|.
M and F must be multiples of the block (64 or 128).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .._compat import mosaic_gpu, pl
from .._lower_once import lower_once
from . import common as C


def _swizzled(plgpu, dtype, cols: int):
    """Shared-memory transforms for a [rows, cols] tile of `dtype` (the widest swizzle its rows fill)."""
    row_bytes = cols * jnp.dtype(dtype).itemsize
    swizzle = 128 if row_bytes % 128 == 0 else 64 if row_bytes % 64 == 0 else 32
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


@lower_once(static_argnames=("activation", "gated", "out_dtype", "round_to", "block", "interpret"))
def dact_cast_transpose_tma(dh, gu, scale, *, activation, gated, out_dtype, round_to=None, gu_scale=None,
                            dh_scale=None, block: int = 64, interpret=None):
    """As kernels.dact_cast_transpose (dh [M, F] the cotangent of a = act(gate) * up or act(gu); scale, gu_scale,
    dh_scale fp32 scalars), on the GPU's TMA.  Returns (dgu_q [gu's shape], dgu_qT [n*F, M], amax f32 scalar)."""
    where = "dact_cast_transpose_tma"
    C.check_common(where, activation=activation, gated=gated, out_dtype=out_dtype, round_to=round_to,
                   arrays=[("dh", dh), ("gu", gu)])
    gu2, m, f, n = C.split_gated(gu, gated, where)
    if tuple(dh.shape) != (m, f):
        raise ValueError(f"{where}: dh has shape {tuple(dh.shape)}; expected {(m, f)} for gu {tuple(gu.shape)}.")
    if interpret:
        raise ValueError(f"{where}: no interpret mode (the TMA kernel runs on an sm90 GPU only); use "
                         f"kernels.dact_cast_transpose, which interprets on the CPU.")
    if block not in (64, 128) or m % block or f % block:
        raise ValueError(f"{where}: M={m} and F={f} must be multiples of block={block} (64 or 128); use "
                         f"kernels.dact_cast_transpose for other shapes.")
    plgpu = mosaic_gpu()
    scales = C.scale_array(scale, gu_scale, dh_scale)
    in_scaled = (gu_scale is not None, dh_scale is not None)
    gm, gf = m // block, f // block
    in_dt = (dh.dtype, gu.dtype)

    def body(dh_ref, gu_ref, scale_ref, q_ref, qt_ref, amax_ref, dh_s, gu_s, q_s, qt_s, amax_s, bar):
        i, j = jax.lax.axis_index("m"), jax.lax.axis_index("f")
        rows, cols = pl.ds(i * block, block), pl.ds(j * block, block)
        plgpu.copy_gmem_to_smem(dh_ref.at[rows, cols], dh_s, bar)
        for h in range(n):
            plgpu.copy_gmem_to_smem(gu_ref.at[rows, pl.ds(h * f + j * block, block)], gu_s.at[h], bar)
        k = iter(range(1, 3))
        s_gu, s_dh = (scale_ref[next(k)] if on else None for on in in_scaled)
        plgpu.barrier_wait(bar)
        load = lambda ref: plgpu.load(ref, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        d_h = C.prescale(load(dh_s), s_dh, in_dt[0])
        g = C.prescale(load(gu_s.at[0]), s_gu, in_dt[1])
        u = C.prescale(load(gu_s.at[1]), s_gu, in_dt[1]) if gated else None
        grads = [C.maybe_round(d, round_to) for d in C.dact_traced(activation, gated, d_h, g, u)]
        t = C.abs_for_amax(grads[0])
        for d in grads[1:]:
            t = jnp.maximum(t, C.abs_for_amax(d))
        amax_s[...] = t.max(axis=1)
        s = scale_ref[0]
        for h, d in enumerate(grads):
            q_s.at[h][...] = C.saturate(d, s, out_dtype)
            dt = plgpu.layout_cast(d, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.transpose_ref(qt_s.at[h], (1, 0))[...] = C.saturate(dt, s, out_dtype)
        plgpu.commit_smem()
        for h in range(n):
            plgpu.copy_smem_to_gmem(q_s.at[h], q_ref.at[rows, pl.ds(h * f + j * block, block)])
            plgpu.copy_smem_to_gmem(qt_s.at[h], qt_ref.at[pl.ds(h * f + j * block, block), rows])
        plgpu.copy_smem_to_gmem(amax_s, amax_ref.at[i * gf + j])
        plgpu.wait_smem_to_gmem(0)

    tr_in, tr_out = _swizzled(plgpu, dh.dtype, block), _swizzled(plgpu, out_dtype, block)
    body.__name__ = f"te_fp8_dact_{activation}{'_glu' if gated else ''}_tma"  # the GPU kernel's name in profiles
    q, qt, parts = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((m, n * f), out_dtype), jax.ShapeDtypeStruct((n * f, m), out_dtype),
                  jax.ShapeDtypeStruct((gm * gf, block), jnp.float32)),
        grid=(gm, gf), grid_names=("m", "f"),
        scratch_types=[plgpu.SMEM((block, block), dh.dtype, transforms=tr_in),
                       plgpu.SMEM((n, block, block), gu.dtype, transforms=_swizzled(plgpu, gu.dtype, block)),
                       plgpu.SMEM((n, block, block), out_dtype, transforms=tr_out),
                       plgpu.SMEM((n, block, block), out_dtype, transforms=tr_out),
                       plgpu.SMEM((block,), jnp.float32),
                       plgpu.Barrier(num_arrivals=1 + n)],
    )(dh, gu2, scales)
    return q.reshape(gu.shape), qt, jnp.max(parts)


__all__ = ["dact_cast_transpose_tma"]
