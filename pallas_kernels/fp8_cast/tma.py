"""FP8 cast kernels on Hopper's TMA (Pallas Mosaic GPU), written to reach copy bandwidth where the Triton-lowered
kernels (kernels.py) are limited by their transposed stores.  Checked on an H100 (tests/test_fp8_fused_mlp.py's GPU
tests; speed: benchmarks/results/fp8_layer_h100.md); opt-in in te_jax (TE_JAX_FP8_TMA_CASTS).  Each takes the call
of its kernels.py twin and returns the same:

    dact_cast_transpose_tma(dh, gu, scale, ...)  dh [M, F], gu [M, 2, F] | [M, F] -> dgu_q [gu's shape],
                                                 dgu_qT [n*F, M], amax
    act_cast_tma(gu, scale, ...)                 gu -> a_q [M, F], a_qT [F, M], amax
    cast_transpose_tma(x, scale, ...)            x [M, N] -> x_q [M, N] (write_q), x_qT [N, M], amax

One CTA (one warpgroup) per (block x block) tile of the output's [M, F]: TMA brings the input tiles into shared
memory; the warpgroup computes in fp32 in the WGMMA register layout, casts (common.saturate) and stores each result
twice, row-major and through a transposed view of a second tile (the register layout switched to its transpose
first: one shuffle per pair of registers); TMA writes both tiles and the tile's row maxima of |value| (the amax is
their max).  M and every F must be multiples of the block (64 or 128); the inputs share one dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .._compat import mosaic_gpu, pl
from .._lower_once import lower_once
from ..flash_attention_hopper.common import smem_transforms
from . import common as C


def _tile_cast(where, loads, compute, scales, *, m: int, f: int, n_out: int, out_dtype, write_q: bool, block: int,
               interpret, name: str):
    """The shared kernel.  loads: [(array [M, W], column offset)] read per tile at rows [i*block, +block) and
    columns offset + [j*block, +block); compute(tiles f32, scale_ref) -> n_out f32 tiles (cast with scale_ref[0]).
    Returns (q [M, n_out*F] or None, qT [n_out*F, M], amax f32 scalar)."""
    if interpret:
        raise ValueError(f"{where}: no interpret mode (the TMA kernel runs on an sm90 GPU only); use its kernels.py "
                         f"twin, which interprets on the CPU.")
    if block not in (64, 128) or m % block or f % block:
        raise ValueError(f"{where}: M={m} and F={f} must be multiples of block={block} (64 or 128); use its "
                         f"kernels.py twin for other shapes.")
    in_dtype = loads[0][0].dtype
    if any(a.dtype != in_dtype for a, _ in loads):
        raise ValueError(f"{where}: the inputs must share one dtype; got {[str(a.dtype) for a, _ in loads]}; use "
                         f"its kernels.py twin.")
    plgpu = mosaic_gpu()
    gm, gf = m // block, f // block
    n_in = len(loads)

    def body(*refs):
        in_refs, scale_ref, refs = refs[:n_in], refs[n_in], refs[n_in + 1:]
        q_ref, refs = (refs[0], refs[1:]) if write_q else (None, refs)
        qt_ref, amax_ref, in_s, q_s, qt_s, amax_s, bar = refs
        i, j = jax.lax.axis_index("m"), jax.lax.axis_index("f")
        rows = pl.ds(i * block, block)
        for t, ((_, off), ref) in enumerate(zip(loads, in_refs)):
            plgpu.copy_gmem_to_smem(ref.at[rows, pl.ds(off + j * block, block)], in_s.at[t], bar)
        plgpu.barrier_wait(bar)
        tiles = [plgpu.load(in_s.at[t], layout=plgpu.Layout.WGMMA).astype(jnp.float32) for t in range(n_in)]
        outs = compute(tiles, scale_ref)
        amax = C.abs_for_amax(outs[0])
        for v in outs[1:]:
            amax = jnp.maximum(amax, C.abs_for_amax(v))
        amax_s[...] = amax.max(axis=1)
        s = scale_ref[0]
        for h, v in enumerate(outs):
            if write_q:
                q_s.at[h][...] = C.saturate(v, s, out_dtype)
            vt = plgpu.layout_cast(v, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.transpose_ref(qt_s.at[h], (1, 0))[...] = C.saturate(vt, s, out_dtype)
        plgpu.commit_smem()
        for h in range(n_out):
            cols = pl.ds(h * f + j * block, block)
            if write_q:
                plgpu.copy_smem_to_gmem(q_s.at[h], q_ref.at[rows, cols])
            plgpu.copy_smem_to_gmem(qt_s.at[h], qt_ref.at[cols, rows])
        plgpu.copy_smem_to_gmem(amax_s, amax_ref.at[i * gf + j])
        plgpu.wait_smem_to_gmem(0)

    tr_out = smem_transforms(plgpu, out_dtype, block)
    body.__name__ = name  # the GPU kernel's name in profiles
    out_type = (([jax.ShapeDtypeStruct((m, n_out * f), out_dtype)] if write_q else [])
                + [jax.ShapeDtypeStruct((n_out * f, m), out_dtype),
                   jax.ShapeDtypeStruct((gm * gf, block), jnp.float32)])
    outs = plgpu.kernel(
        body, out_type=tuple(out_type), grid=(gm, gf), grid_names=("m", "f"),
        scratch_types=[plgpu.SMEM((n_in, block, block), in_dtype, transforms=smem_transforms(plgpu, in_dtype, block)),
                       plgpu.SMEM((n_out if write_q else 1, block, block), out_dtype, transforms=tr_out),
                       plgpu.SMEM((n_out, block, block), out_dtype, transforms=tr_out),
                       plgpu.SMEM((block,), jnp.float32),
                       plgpu.Barrier(num_arrivals=n_in)],
    )(*(a for a, _ in loads), scales)
    q, (qt, parts) = (outs[0], outs[1:]) if write_q else (None, outs)
    return q, qt, jnp.max(parts)


def _in_scales(scale_ref, in_scaled):
    """The owed input scales, read from scale_ref[1:] in order (None where an input owes none)."""
    k = iter(range(1, 1 + sum(in_scaled)))
    return [scale_ref[next(k)] if on else None for on in in_scaled]


def dact_tile(activation, gated, round_to, in_scaled, dtypes):
    """The dact kernel's tile math: compute(tiles [dh, gate(, up)] fp32, scales) -> [dgate(, dup)] fp32, scales
    [scale, *owed input scales] (C.scale_array's order: gu's, then dh's); dtypes (dh's, gu's).  Plain jnp: it
    runs in the kernel and, on whole arrays, on the CPU (tests)."""
    def compute(tiles, scale_ref):
        s_gu, s_dh = _in_scales(scale_ref, in_scaled)
        d_h = C.prescale(tiles[0], s_dh, dtypes[0])
        g = C.prescale(tiles[1], s_gu, dtypes[1])
        u = C.prescale(tiles[2], s_gu, dtypes[1]) if gated else None
        return [C.maybe_round(d, round_to) for d in C.dact_traced(activation, gated, d_h, g, u)]

    return compute


def act_tile(activation, gated, round_to, gu_scaled: bool, dtype):
    """The act kernel's tile math: compute(tiles [gate(, up)] fp32, scales) -> [a] fp32 (as dact_tile)."""
    act = C.act_fn(activation, gated)

    def compute(tiles, scale_ref):
        (s_gu,) = _in_scales(scale_ref, (gu_scaled,))
        return [C.maybe_round(act(*[C.prescale(t, s_gu, dtype) for t in tiles]), round_to)]

    return compute


@lower_once(static_argnames=("activation", "gated", "out_dtype", "round_to", "block", "interpret"))
def dact_cast_transpose_tma(dh, gu, scale, *, activation, gated, out_dtype, round_to=None, gu_scale=None,
                            dh_scale=None, block: int = 64, interpret=None):
    """As kernels.dact_cast_transpose (dh [M, F] the cotangent of a = act(gate) * up or act(gu); scale, gu_scale,
    dh_scale fp32 scalars).  Returns (dgu_q [gu's shape], dgu_qT [n*F, M], amax f32 scalar)."""
    where = "dact_cast_transpose_tma"
    C.check_common(where, activation=activation, gated=gated, out_dtype=out_dtype, round_to=round_to,
                   arrays=[("dh", dh), ("gu", gu)])
    gu2, m, f, n = C.split_gated(gu, gated, where)
    if tuple(dh.shape) != (m, f):
        raise ValueError(f"{where}: dh has shape {tuple(dh.shape)}; expected {(m, f)} for gu {tuple(gu.shape)}.")
    compute = dact_tile(activation, gated, round_to, (gu_scale is not None, dh_scale is not None),
                        (dh.dtype, gu.dtype))
    loads = [(dh, 0)] + [(gu2, h * f) for h in range(n)]
    q, qt, amax = _tile_cast(where, loads, compute, C.scale_array(scale, gu_scale, dh_scale), m=m, f=f, n_out=n,
                             out_dtype=out_dtype, write_q=True, block=block, interpret=interpret,
                             name=f"te_fp8_dact_{activation}{'_glu' if gated else ''}_tma")
    return q.reshape(gu.shape), qt, amax


@lower_once(static_argnames=("activation", "gated", "out_dtype", "round_to", "block", "interpret"))
def act_cast_tma(gu, scale, *, activation, gated, out_dtype, round_to=None, gu_scale=None, block: int = 64,
                 interpret=None):
    """As kernels.act_cast(..., transpose=True) (a = act(gate) * up or act(gu); scale, gu_scale fp32 scalars).
    Returns (a_q [M, F], a_qT [F, M], amax f32 scalar)."""
    where = "act_cast_tma"
    C.check_common(where, activation=activation, gated=gated, out_dtype=out_dtype, round_to=round_to,
                   arrays=[("gu", gu)])
    gu2, m, f, n = C.split_gated(gu, gated, where)
    compute = act_tile(activation, gated, round_to, gu_scale is not None, gu.dtype)
    return _tile_cast(where, [(gu2, h * f) for h in range(n)], compute, C.scale_array(scale, gu_scale), m=m, f=f,
                      n_out=1, out_dtype=out_dtype, write_q=True, block=block, interpret=interpret,
                      name=f"te_fp8_act_{activation}{'_glu' if gated else ''}_tma")


@lower_once(static_argnames=("out_dtype", "round_to", "write_q", "block", "interpret"))
def cast_transpose_tma(x, scale, *, out_dtype, round_to=None, write_q: bool = True, block: int = 64, interpret=None):
    """As kernels.cast_transpose (write_q) or kernels.cast_transposed (not write_q): x [M, N] -> (x_q [M, N] or None,
    x_qT [N, M], amax f32 scalar)."""
    where = "cast_transpose_tma"
    C.check_common(where, out_dtype=out_dtype, round_to=round_to, arrays=[("x", x)])
    if x.ndim != 2:
        raise ValueError(f"{where}: x must be 2-D [M, N]; got shape {tuple(x.shape)}.")
    m, n = x.shape
    return _tile_cast(where, [(x, 0)], lambda tiles, _: [C.maybe_round(tiles[0], round_to)], C.scale_array(scale),
                      m=m, f=n, n_out=1, out_dtype=out_dtype, write_q=write_q, block=block, interpret=interpret,
                      name="te_fp8_cast_transpose_tma" if write_q else "te_fp8_cast_transposed_tma")


__all__ = ["act_cast_tma", "cast_transpose_tma", "dact_cast_transpose_tma"]
