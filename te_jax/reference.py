"""Plain-jnp attention in fp32 on te_jax's canonical inputs: the truth every kernel is tested
against, and the basis of the `xla` backend.

q [B, Sq, H, Dqk], k [B, Skv, G, Dqk], v [B, Skv, G, Dv] (H % G == 0), a TokenMask, and an
optional bias broadcastable to [B, H, Sq, Skv]. The arithmetic is the kernels' own reference
(pallas_kernels/flash_attention/reference.py); this module adapts it to a TokenMask.
"""
from __future__ import annotations

from pallas_kernels.flash_attention import reference as _ref
from te_jax.masks import TokenMask


def _mask_args(tm: TokenMask):
    return tm.q_segment_ids, tm.q_positions, tm.kv_segment_ids, tm.kv_positions


def reference_attention(q, k, v, tm: TokenMask, bias=None, *, scale: float, softcap=None,
                        causal: bool = False, window=(-1, -1), dropout_rate: float = 0.0,
                        dropout_rng=None):
    """Attention with every feature. Returns (out [B,Sq,H,Dv] in q.dtype, lse [B,H,Sq] fp32).

    Rows with no visible key give out = 0 and lse = -inf, with finite gradients.
    Dropout (on the probabilities, rescaled by 1/(1-rate)) draws from `dropout_rng`.
    """
    return _ref.reference_attention(q, k, v, *_mask_args(tm), bias, scale=scale, softcap=softcap, causal=causal,
                                    window_left=window[0], window_right=window[1], dropout_rate=dropout_rate,
                                    dropout_rng=dropout_rng)


def reference_attention_bwd(q, k, v, tm: TokenMask, bias, out, lse, dout, dlse=None, *, scale: float,
                            softcap=None, causal: bool = False, window=(-1, -1)):
    """(dq, dk, dv, dbias) given the saved logsumexp; see the kernels' reference for the math."""
    return _ref.reference_attention_bwd(q, k, v, *_mask_args(tm), bias, out, lse, dout, dlse, scale=scale,
                                        softcap=softcap, causal=causal, window_left=window[0],
                                        window_right=window[1])
