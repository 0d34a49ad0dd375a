"""The factors of the block GEMM's "rescale" promotion (persistent.block_scaled_gemm_persistent), in plain jnp.

    rescale_factors(scales [K/128, R]) -> (ratios [K/128, R], final [1, R])

The kernel keeps each output element's running sum in units of the current K block's scales, so the wgmma
accumulates every block's product straight into it:
    acc_0 = P_0,   acc_k = acc_{k-1} * ratio_a[k, row] * ratio_b[k, col] + P_k,   C = acc_last * final_a * final_b
with ratio[k] = s[k-1] / s[k] (ratio[0] = 1) and final = s[last], for a's and b's scales alike.

A block whose scale is far below an earlier one in its row would multiply the sum by a huge ratio (a block of
amax 1e-35 after one of amax 1 overflows fp32). So each scale is first raised to at least FLOOR (2^-40) times the
largest scale before it in its row: the ratios of each operand stay below 2^40, their product below 2^80, and the
sum below 2^113. That changes the product only where a block is 2^40 times smaller than an earlier block of the
same row: its contribution, at most 2^-40 of that earlier block's scale, is weighted by a factor above its own
(a relative change of the result below 2^-30 of the largest block's contribution).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

FLOOR = 2.0 ** -40


def floored_scales(scales):
    """scales [K/128, R] (positive) -> each raised to FLOOR times the largest scale before it in its column r."""
    s = scales.astype(jnp.float32)
    before = lax.cummax(jnp.concatenate([jnp.zeros_like(s[:1]), s[:-1]]), axis=0)
    return jnp.maximum(s, before * FLOOR)


def rescale_factors(scales):
    """scales [K/128, R] -> (ratios [K/128, R]: s[k-1] / s[k], 1 for k = 0; final [1, R]: s[last]), on the
    floored scales (module docstring)."""
    s = floored_scales(scales)
    return jnp.concatenate([jnp.ones_like(s[:1]), s[:-1] / s[1:]]), s[-1:]
