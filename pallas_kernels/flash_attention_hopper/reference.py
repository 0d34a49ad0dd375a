"""Plain-XLA float32 reference for the Hopper flash-attention kernel (the truth for tests)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q, k, v, *, scale: float, causal: bool = False):
    """q [B,S,H,D], k/v [B,S,G,D] (GQA) -> (out [B,S,H,D] float32, lse [B,H,S] float32)."""
    b, sq, h, d = q.shape
    skv, g = k.shape[1], k.shape[2]
    rep = h // g
    qf = q.astype(jnp.float32).reshape(b, sq, g, rep, d)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    s = jnp.einsum("bqgrd,bkgd->bgrqk", qf, kf, precision=jax.lax.Precision.HIGHEST) * scale
    if causal:
        mask = jnp.arange(sq)[:, None] >= jnp.arange(skv)[None, :]
        s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bgrqk,bkgd->bqgrd", p, vf, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, sq, h, d), lse.reshape(b, h, sq)
