"""Plain-jnp attention in fp32: the truth every kernel is tested against, and the `xla` backend.

All functions take canonical inputs: q [B, Sq, H, Dqk], k [B, Skv, G, Dqk], v [B, Skv, G, Dv]
(H % G == 0), a TokenMask, and an optional bias broadcastable to [B, H, Sq, Skv].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.masks import TokenMask, dense_mask


def _logits(q, k, bias, tm, *, scale, softcap, causal, window):
    """Masked fp32 logits [B, G, H/G, Sq, Skv] and the visibility mask."""
    b, sq, h, d = q.shape
    g = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, sq, g, h // g, d)
    s = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        bb = jnp.broadcast_to(bias.astype(jnp.float32), (b, h, sq, k.shape[1]))
        s = s + bb.reshape(b, g, h // g, sq, k.shape[1])
    visible = dense_mask(tm, causal, window)[:, :, None]  # [B,1,1,Sq,Skv]
    return s, visible


def reference_attention(q, k, v, tm: TokenMask, bias=None, *, scale: float, softcap=None,
                        causal: bool = False, window=(-1, -1), dropout_rate: float = 0.0,
                        dropout_rng=None):
    """Attention with every feature, in fp32. Returns (out [B,Sq,H,Dv] in q.dtype, lse [B,H,Sq] fp32).

    Rows with no visible key give out = 0 and lse = -inf, with finite gradients.
    Dropout (on the probabilities, rescaled by 1/(1-rate)) draws from `dropout_rng`.
    """
    b, sq, h, _ = q.shape
    g = k.shape[2]
    s, visible = _logits(q, k, bias, tm, scale=scale, softcap=softcap, causal=causal, window=window)
    s_masked = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s_masked, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    # Mask before exp: a hidden logit far above the row max would overflow and poison the gradient.
    p = jnp.exp(jnp.where(visible, s - m_safe, -jnp.inf))
    l = jnp.sum(p, axis=-1, keepdims=True)
    has_key = l > 0
    l_safe = jnp.where(has_key, l, 1.0)
    p = p / l_safe
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", p, v.astype(jnp.float32))
    out = out.reshape(b, sq, h, v.shape[-1]).astype(q.dtype)
    lse = jnp.where(has_key, m_safe + jnp.log(l_safe), -jnp.inf)
    lse = lse[..., 0].reshape(b, h, sq)
    del g
    return out, lse


def reference_attention_bwd(q, k, v, tm: TokenMask, bias, out, lse, dout, dlse=None, *, scale: float,
                            softcap=None, causal: bool = False, window=(-1, -1)):
    """Gradients of attention given the saved logsumexp (as a flash backward computes them).

    `out`, `lse` and `dout` may come from a larger computation (ring attention merges blocks with
    the logsumexp): P = exp(S - lse), delta = rowsum(dout * out) - dlse.
    Returns (dq, dk, dv, dbias) in the inputs' dtypes; dbias is None without a bias, else
    reduced to the bias's shape.
    """
    b, sq, h, dqk = q.shape
    skv, g, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    r = h // g
    s_raw = jnp.einsum("bqgrd,bkgd->bgrqk", q.astype(jnp.float32).reshape(b, sq, g, r, dqk),
                       k.astype(jnp.float32)) * scale
    s = softcap * jnp.tanh(s_raw / softcap) if softcap is not None else s_raw
    if bias is not None:
        s = s + jnp.broadcast_to(bias.astype(jnp.float32), (b, h, sq, skv)).reshape(b, g, r, sq, skv)
    visible = dense_mask(tm, causal, window)[:, :, None]
    lse_g = lse.reshape(b, g, r, sq)[..., None]
    p = jnp.exp(jnp.where(visible & jnp.isfinite(lse_g), s - jnp.where(jnp.isfinite(lse_g), lse_g, 0.0), -jnp.inf))
    do = dout.astype(jnp.float32).reshape(b, sq, g, r, dv_dim)
    o = out.astype(jnp.float32).reshape(b, sq, g, r, dv_dim)
    delta = jnp.einsum("bqgrd,bqgrd->bgrq", do, o)
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32).reshape(b, g, r, sq)
    dv = jnp.einsum("bgrqk,bqgrd->bkgd", p, do)
    dp = jnp.einsum("bqgrd,bkgd->bgrqk", do, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None])  # gradient w.r.t. the post-softcap, post-bias logits
    dbias = None
    if bias is not None:
        dbias_full = ds.reshape(b, h, sq, skv)
        axes = tuple(i for i, n in enumerate(bias.shape) if n == 1 and dbias_full.shape[i] != 1)
        dbias = jnp.sum(dbias_full, axis=axes, keepdims=True).reshape(bias.shape).astype(bias.dtype)
    if softcap is not None:
        t = jnp.tanh(s_raw / softcap)
        ds = ds * (1.0 - t * t)
    ds = ds * scale
    dq = jnp.einsum("bgrqk,bkgd->bqgrd", ds, k.astype(jnp.float32)).reshape(b, sq, h, dqk)
    dk = jnp.einsum("bgrqk,bqgrd->bkgd", ds, q.astype(jnp.float32).reshape(b, sq, g, r, dqk))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias
