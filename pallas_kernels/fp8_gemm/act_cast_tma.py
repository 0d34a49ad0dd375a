"""The SwiGLU backward's block casts on Hopper's TMA (Pallas Mosaic GPU): act_cast.dact_block_cast_transpose with
each 128 x 128 tile staged in shared memory. NOT yet run on a GPU: it lowers for CUDA (tests/test_hopper_lowering.py)
and nothing in te_jax calls it; a GPU test against dact_block_cast_transpose must pass before it is wired in.

    dact_block_cast_transpose_tma(dh [M, F], gu [M, n, F], *, activation, out_dtype, round_to)
        -> (q [M, n*F], q_scales [n*F/128, M], qt [n*F, M], qt_scales [M/128, n*F])   as dact_block_cast_transpose

Why: the Triton kernel moves the SwiGLU backward's 1189 MB (Llama MLP, 8192 tokens) at 1.5 TB/s; its 128 x 128
tile's two-way quantization (a scale per row for q, per column for qt, and the transposed store) is what holds it
(benchmarks/results/fp8_block_cast_h100.md). Here one warpgroup per tile:
  1. TMA brings the tile of dh and of each part of gu (gate, up) into shared memory (96 KB, bf16);
  2. per part, the cotangent is computed in four 64 x 64 quarters (WGMMA register layout, fp32, rounded to
     round_to), parked in shared memory, and its row and column maxima of |value| taken (the 1x128 tiles of q run
     along a row of the tile, those of qt along a column);
  3. the parked quarters are read back, multiplied by the reciprocal scales (quantize_tile's formula) and stored
     twice: row-major into q's staging tile, and through a transposed view into qt's;
  4. TMA writes both tiles and both scale vectors, and the part's staging is free again.
Shared memory: about 160 KB, so one CTA per SM. M and F must be multiples of 128.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .._compat import mosaic_gpu, pl
from .._lower_once import lower_once
from ..flash_attention_hopper.common import smem_transforms
from ..fp8_cast import common as C
from .reference import BLOCK_K

_Q = 64  # the quarter tile's side


def _quarter(ref, h, c):
    return ref.at[pl.ds(h * _Q, _Q), pl.ds(c * _Q, _Q)]


@lower_once(static_argnames=("activation", "out_dtype", "round_to", "interpret"))
def dact_block_cast_transpose_tma(dh, gu, *, activation, out_dtype, round_to=None, interpret=None):
    """See the module docstring. dh [M, F] (a's cotangent), gu [M, n, F] (n = 2: gate, up; or 1), one dtype."""
    where = "dact_block_cast_transpose_tma"
    if interpret:
        raise ValueError(f"{where}: no interpret mode (sm90 only); use act_cast.dact_block_cast_transpose.")
    C.check_common(where, activation=activation, out_dtype=out_dtype, round_to=round_to,
                   arrays=[("dh", dh), ("gu", gu)])
    if gu.ndim != 3 or gu.shape[1] not in (1, 2):
        raise ValueError(f"{where}: gu must be [M, n, F] with n = 2 (gate, up) or 1; got shape {tuple(gu.shape)}.")
    m, n, f = gu.shape
    b = BLOCK_K
    if m % b or f % b or tuple(dh.shape) != (m, f) or dh.dtype != gu.dtype:
        raise ValueError(f"{where}: dh {tuple(dh.shape)} {dh.dtype} and gu {tuple(gu.shape)} {gu.dtype} must be "
                         f"[M, F] and [M, n, F] of one dtype with M and F multiples of {b}; use "
                         "act_cast.dact_block_cast_transpose.")
    plgpu = mosaic_gpu()
    gated, fmax = n == 2, float(jnp.finfo(out_dtype).max)
    park_dtype = jnp.dtype(round_to) if round_to is not None else jnp.dtype(jnp.float32)
    gu2 = gu.reshape(m, n * f)

    def body(dh_ref, gu_ref, q_ref, qs_ref, qt_ref, qts_ref, in_s, park, q_s, qt_s, rs_s, cs_s, bar):
        i, j = jax.lax.axis_index("m"), jax.lax.axis_index("f")
        rows = pl.ds(i * b, b)
        plgpu.copy_gmem_to_smem(dh_ref.at[rows, pl.ds(j * b, b)], in_s.at[0], bar)
        for t in range(n):
            plgpu.copy_gmem_to_smem(gu_ref.at[rows, pl.ds(t * f + j * b, b)], in_s.at[1 + t], bar)
        plgpu.barrier_wait(bar)
        for p in range(n):
            row_max, col_max = [None, None], [None, None]
            for h in range(2):
                for c in range(2):
                    tiles = [plgpu.load(_quarter(in_s.at[t], h, c), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                             for t in range(1 + n)]
                    d = C.maybe_round(C.dact_traced(activation, gated, *tiles)[p], round_to)
                    _quarter(park, h, c)[...] = d.astype(park_dtype)
                    a = jnp.abs(d)
                    r, cm = jnp.max(a, axis=1), jnp.max(a, axis=0)
                    row_max[h] = r if c == 0 else jnp.maximum(row_max[h], r)
                    col_max[c] = cm if h == 0 else jnp.maximum(col_max[c], cm)
            s_row = [jnp.where(x > 0, x / fmax, 1.0) for x in row_max]
            s_col = [jnp.where(x > 0, x / fmax, 1.0) for x in col_max]
            for h in range(2):
                rs_s.at[pl.ds(h * _Q, _Q)][...] = s_row[h]
                cs_s.at[pl.ds(h * _Q, _Q)][...] = s_col[h]
            for h in range(2):
                for c in range(2):
                    d = plgpu.load(_quarter(park, h, c), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                    inv_r = jax.lax.broadcast_in_dim(1.0 / s_row[h], (_Q, _Q), [0])
                    q = jnp.clip(d * inv_r, -fmax, fmax).astype(out_dtype)
                    q_s.at[c, pl.ds(h * _Q, _Q)][...] = q
                    inv_c = jax.lax.broadcast_in_dim(1.0 / s_col[c], (_Q, _Q), [1])
                    qt = jnp.clip(d * inv_c, -fmax, fmax)
                    qt = plgpu.layout_cast(qt, plgpu.Layout.WGMMA_TRANSPOSED)
                    plgpu.transpose_ref(qt_s.at[h, pl.ds(c * _Q, _Q)], (1, 0))[...] = qt.astype(out_dtype)
            plgpu.commit_smem()
            cols = pl.ds(p * f + j * b, b)
            for c in range(2):
                plgpu.copy_smem_to_gmem(q_s.at[c], q_ref.at[rows, pl.ds(p * f + j * b + c * _Q, _Q)])
            for h in range(2):
                plgpu.copy_smem_to_gmem(qt_s.at[h], qt_ref.at[cols, pl.ds(i * b + h * _Q, _Q)])
            plgpu.copy_smem_to_gmem(rs_s, qs_ref.at[p * (f // b) + j, rows])
            plgpu.copy_smem_to_gmem(cs_s, qts_ref.at[i, cols])
            plgpu.wait_smem_to_gmem(0)  # the staging tiles are the next part's

    body.__name__ = f"te_fp8_dact_block_cast_{activation}_tma"
    tr_in = smem_transforms(plgpu, dh.dtype, b)
    tr_out = smem_transforms(plgpu, out_dtype, _Q)
    out_type = (jax.ShapeDtypeStruct((m, n * f), out_dtype), jax.ShapeDtypeStruct((n * f // b, m), jnp.float32),
                jax.ShapeDtypeStruct((n * f, m), out_dtype), jax.ShapeDtypeStruct((m // b, n * f), jnp.float32))
    return plgpu.kernel(
        body, out_type=out_type, grid=(m // b, f // b), grid_names=("m", "f"),
        scratch_types=[plgpu.SMEM((1 + n, b, b), dh.dtype, transforms=tr_in),
                       plgpu.SMEM((b, b), park_dtype, transforms=smem_transforms(plgpu, park_dtype, b)),
                       plgpu.SMEM((2, b, _Q), out_dtype, transforms=tr_out),
                       plgpu.SMEM((2, b, _Q), out_dtype, transforms=tr_out),
                       plgpu.SMEM((b,), jnp.float32),
                       plgpu.SMEM((b,), jnp.float32),
                       plgpu.Barrier(num_arrivals=1 + n)],
    )(dh, gu2)


__all__ = ["dact_block_cast_transpose_tma"]
