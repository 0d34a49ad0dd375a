"""Plain-jnp block scaling: the quantization of the DeepSeek-V3 recipe and the GEMM the kernel computes.

    quantize_blocks(x [R, C], block=(br, bc), dtype) -> (q [R, C] dtype, scale_inv [R / br, C / bc] float32)
        one scale per tile (amax / fp8_max; an all-zero tile gets 1), q = saturate(x * (1 / scale_inv));
        x ~= q * scale_inv.
    row_scales(scale_inv [R / br, C / bc], br) -> [C / bc, R] float32: the per-row scale of every block column,
        transposed (the GEMM kernel's layout: one contiguous row of scales per K block).
    block_scaled_gemm_reference(a [M, K], b [N, K], a_scales [K/128, M], b_scales [K/128, N]) -> [M, N] float32
        C = sum over K blocks kb of (a[:, kb] . b[:, kb]^T) * a_scales[kb, :, None] * b_scales[kb, None, :]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK_K = 128  # the contraction block of every scale


def quantize_blocks(x, block, dtype):
    """(q, scale_inv): x [R, C] (R % br == C % bc == 0) in tiles of `block`, one scale per tile."""
    br, bc = block
    r, c = x.shape
    if r % br or c % bc:
        raise ValueError(f"quantize_blocks: shape {x.shape} is not a multiple of the block {block}")
    fmax = float(jnp.finfo(dtype).max)
    t = x.astype(jnp.float32).reshape(r // br, br, c // bc, bc)
    amax = jnp.max(jnp.abs(t), axis=(1, 3), keepdims=True)
    scale_inv = jnp.where(amax > 0, amax / fmax, 1.0)
    q = jnp.clip(t * (1.0 / scale_inv), -fmax, fmax).astype(dtype).reshape(r, c)  # a multiply: the kernels' form
    return q, scale_inv.reshape(r // br, c // bc)


def row_scales(scale_inv, br: int):
    """[R / br, C / bc] block scales -> [C / bc, R]: each row's scale for every block column."""
    return jnp.repeat(scale_inv, br, axis=0).T


def block_scaled_gemm_reference(a, b, a_scales, b_scales, out_dtype=jnp.float32):
    """The kernel's product in fp32 (operands upcast exactly, per-K-block partial products scaled)."""
    m, k = a.shape
    n = b.shape[0]
    nk = k // BLOCK_K
    af = a.astype(jnp.float32).reshape(m, nk, BLOCK_K)
    bf = b.astype(jnp.float32).reshape(n, nk, BLOCK_K)
    part = jnp.einsum("mkc,nkc->kmn", af, bf, precision=jax.lax.Precision.HIGHEST)
    out = jnp.einsum("kmn,km,kn->mn", part, a_scales, b_scales, precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)
