"""Plain-jnp attention in fp32 on te_jax's canonical inputs: the truth every kernel is tested
against, and the basis of the `xla` backend.

q [B, Sq, H, Dqk], k [B, Skv, G, Dqk], v [B, Skv, G, Dv] (H % G == 0), a TokenMask, and an
optional bias broadcastable to [B, H, Sq, Skv]. The arithmetic is the kernels' own reference
(pallas_kernels/flash_attention/reference.py); this module adapts it to a TokenMask (with the
call's causal flag and window: an AttentionMask).
"""
from __future__ import annotations

from pallas_kernels.flash_attention import reference as _ref
from te_jax.masks import TokenMask


def reference_attention(q, k, v, tm: TokenMask, bias=None, *, scale: float, softcap=None,
                        causal: bool = False, window=(-1, -1), dropout_rate: float = 0.0,
                        dropout_rng=None):
    """Attention with every feature. Returns (out [B,Sq,H,Dv] in q.dtype, lse [B,H,Sq] fp32).

    Rows with no visible key give out = 0 and lse = -inf, with finite gradients.
    Dropout (on the probabilities, rescaled by 1/(1-rate)) draws from `dropout_rng`.
    """
    return _ref.reference_attention(q, k, v, tm.with_rule(causal, window), bias, scale=scale, softcap=softcap,
                                    dropout_rate=dropout_rate, dropout_rng=dropout_rng)


def reference_attention_bwd(q, k, v, tm: TokenMask, bias, out, lse, dout, dlse=None, *, scale: float,
                            softcap=None, causal: bool = False, window=(-1, -1)):
    """(dq, dk, dv, dbias) given the saved logsumexp; see the kernels' reference for the math."""
    return _ref.reference_attention_bwd(q, k, v, tm.with_rule(causal, window), bias, out, lse, dout, dlse,
                                        scale=scale, softcap=softcap)
