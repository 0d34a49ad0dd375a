"""Plain-XLA float32 reference for the Hopper flash-attention kernel (the truth for tests):
the portable kernels' reference with no padding, top-left causal or no mask."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.flash_attention.reference import reference_attention
from pallas_kernels.mask import AttentionMask


def attention_reference(q, k, v, *, scale: float, causal: bool = False, softcap: float | None = None):
    """q [B,S,H,D], k/v [B,S,G,D] (GQA) -> (out [B,S,H,D] float32, lse [B,H,S] float32)."""
    mask = AttentionMask.full(q.shape[0], q.shape[1], k.shape[1], causal=causal)
    return reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask,
                               scale=scale, softcap=softcap)
