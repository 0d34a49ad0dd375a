"""Plain-jnp fp32 attention with the same interface and semantics as the flash kernels.

Materialises the full [B, H, Sq, Skv] logits: for tests, small shapes and the 'xla' path only.
"""
from __future__ import annotations

import jax.numpy as jnp


def visibility_mask(q_segment_ids, q_positions, kv_segment_ids, kv_positions, *,
                    causal=False, window_left=-1, window_right=-1):
    """Boolean [B, Sq, Skv]: key j is visible to query i (the one mask rule of te_jax)."""
    qs = q_segment_ids[:, :, None]
    ks = kv_segment_ids[:, None, :]
    qp = q_positions[:, :, None]
    kp = kv_positions[:, None, :]
    mask = (qs == ks) & (qs != 0)
    if causal:
        mask &= kp <= qp
    if window_left >= 0:
        mask &= kp >= qp - window_left
    if window_right >= 0:
        mask &= kp <= qp + window_right
    return mask


def reference_attention(q, k, v, q_segment_ids, q_positions, kv_segment_ids, kv_positions,
                        bias=None, *, scale: float, softcap: float | None = None,
                        causal: bool = False, window_left: int = -1, window_right: int = -1,
                        block_sizes=None, interpret=None):
    """(out [B, Sq, H, Dv] in q.dtype, lse [B, H, Sq] fp32); empty rows give 0 / -inf."""
    del block_sizes, interpret
    B, Sq, H, _ = q.shape
    G = k.shape[2]
    rep = H // G
    qf = q.astype(jnp.float32).reshape(B, Sq, G, rep, q.shape[-1])
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    s = jnp.einsum("bqgrd,bkgd->bgrqk", qf, kf).reshape(B, H, Sq, k.shape[1]) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    mask = visibility_mask(q_segment_ids, q_positions, kv_segment_ids, kv_positions,
                           causal=causal, window_left=window_left,
                           window_right=window_right)[:, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    l_safe = jnp.where(l > 0, l, 1.0)
    p = p / l_safe
    out = jnp.einsum("bgrqk,bkgd->bqgrd", p.reshape(B, G, rep, Sq, -1), vf)
    out = out.reshape(B, Sq, H, v.shape[-1]).astype(q.dtype)
    lse = jnp.where(l[..., 0] > 0, jnp.log(l_safe[..., 0]) + m[..., 0], -jnp.inf)
    return out, lse
