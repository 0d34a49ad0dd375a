"""Plain-jnp fp32 attention with the same interface and semantics as the flash kernels.

The one attention reference of the project: the kernels' tests, te_jax's `xla` backend
(te_jax/reference.py adapts it to a TokenMask) and the Hopper kernel's tests all use it.
Materialises the full [B, H, Sq, Skv] logits: small shapes and the 'xla' path only. The mask is
an `AttentionMask`, materialised by `AttentionMask.dense()` (the rule of pallas_kernels/mask.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..mask import AttentionMask


def _precision(dtype):
    # fp32 inputs get true fp32 products (GPUs would otherwise use TF32); bf16/fp16 inputs upcast
    # to fp32 lose nothing at the default precision.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _logits(q, k, bias, *, scale, softcap):
    """Raw scaled logits [B, G, R, Sq, Skv] (R = H // G), and the post-softcap, post-bias ones."""
    b, sq, h, d = q.shape
    g = k.shape[2]
    qf = q.astype(jnp.float32).reshape(b, sq, g, h // g, d)
    s_raw = jnp.einsum("bqgrd,bkgd->bgrqk", qf, k.astype(jnp.float32), precision=_precision(q.dtype)) * scale
    s = softcap * jnp.tanh(s_raw / softcap) if softcap is not None else s_raw
    if bias is not None:
        skv = k.shape[1]
        s = s + jnp.broadcast_to(bias.astype(jnp.float32), (b, h, sq, skv)).reshape(b, g, h // g, sq, skv)
    return s_raw, s


def reference_attention(q, k, v, mask: AttentionMask, bias=None, *, scale: float,
                        softcap: float | None = None, dropout_rate: float = 0.0, dropout_rng=None,
                        block_sizes=None, interpret=None):
    """(out [B, Sq, H, Dv] in q.dtype, lse [B, H, Sq] fp32); empty rows give 0 / -inf.

    Dropout (rate > 0) drops probabilities with `dropout_rng` and rescales by 1/(1-rate); the
    returned lse is the pre-dropout one.
    """
    del block_sizes, interpret
    b, sq, h, _ = q.shape
    g = k.shape[2]
    _, s = _logits(q, k, bias, scale=scale, softcap=softcap)
    visible = mask.dense()[:, None, None]
    # Mask before exp: a hidden logit far above the row max must not overflow into the gradient.
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    l_safe = jnp.where(l > 0, l, 1.0)
    p = p / l_safe
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", p, v.astype(jnp.float32), precision=_precision(q.dtype))
    out = out.reshape(b, sq, h, v.shape[-1]).astype(q.dtype)
    lse = jnp.where(l[..., 0] > 0, jnp.log(l_safe[..., 0]) + m[..., 0], -jnp.inf).reshape(b, h, sq)
    del g
    return out, lse


def reference_attention_bwd(q, k, v, mask: AttentionMask, bias, out, lse, dout, dlse=None, *,
                            scale: float, softcap: float | None = None):
    """Gradients given the saved logsumexp, as a flash backward computes them.

    `out`, `lse`, `dout` may come from a larger computation (ring attention merges blocks with the
    logsumexp): P = exp(S - lse), delta = rowsum(dout * out) - dlse.
    Returns (dq, dk, dv, dbias) in the inputs' dtypes; dbias is None without a bias, else reduced
    to the bias's own shape.
    """
    b, sq, h, dqk = q.shape
    skv, g, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    r = h // g
    prec = _precision(q.dtype)
    s_raw, s = _logits(q, k, bias, scale=scale, softcap=softcap)
    visible = mask.dense()[:, None, None]
    lse_g = lse.reshape(b, g, r, sq)[..., None]
    finite = jnp.isfinite(lse_g)
    p = jnp.exp(jnp.where(visible & finite, s - jnp.where(finite, lse_g, 0.0), -jnp.inf))
    do = dout.astype(jnp.float32).reshape(b, sq, g, r, dv_dim)
    o = out.astype(jnp.float32).reshape(b, sq, g, r, dv_dim)
    delta = jnp.einsum("bqgrd,bqgrd->bgrq", do, o)
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32).reshape(b, g, r, sq)
    dv = jnp.einsum("bgrqk,bqgrd->bkgd", p, do, precision=prec)
    dp = jnp.einsum("bqgrd,bkgd->bgrqk", do, v.astype(jnp.float32), precision=prec)
    ds = p * (dp - delta[..., None])  # gradient w.r.t. the post-softcap, post-bias logits
    dbias = None
    if bias is not None:
        full = ds.reshape(b, h, sq, skv)
        axes = tuple(i for i, n in enumerate(bias.shape) if n == 1 and full.shape[i] != 1)
        dbias = jnp.sum(full, axis=axes, keepdims=True).reshape(bias.shape).astype(bias.dtype)
    if softcap is not None:
        t = jnp.tanh(s_raw / softcap)
        ds = ds * (1.0 - t * t)
    ds = ds * scale
    dq = jnp.einsum("bgrqk,bkgd->bqgrd", ds, k.astype(jnp.float32), precision=prec).reshape(b, sq, h, dqk)
    dk = jnp.einsum("bgrqk,bqgrd->bkgd", ds, q.astype(jnp.float32).reshape(b, sq, g, r, dqk), precision=prec)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias
