"""The `xla` backend: the fp32 reference, compiled by XLA. Serves every call, on any platform."""
from __future__ import annotations

import jax.numpy as jnp

from te_jax import masks, reference
from te_jax.backends.base import Capabilities


class XlaBackend:
    name = "xla"
    capabilities = Capabilities(split_backward=True, dense_mask=True, returns_lse=True)

    def unsupported_reason(self, call, forced: bool = False) -> str | None:
        return None

    def choice_detail(self, call) -> str:
        return ""

    def forward(self, call, q, k, v, tm, bias, *, scale, softcap, causal, window, dropout_rate, dropout_rng,
                mask=None, with_lse=False):
        if mask is not None:
            # Exact: -inf on masked-out logits; the reference masks before exp, so a row hidden entirely
            # gives zeros (and zero gradients), and a hidden element gets exactly zero probability.
            bias = masks.fold_dense_mask(bias, mask, -jnp.inf)
        out, lse = reference.reference_attention(
            q, k, v, tm, bias, scale=scale, softcap=softcap, causal=causal, window=window,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng)
        # lse (plain jnp, differentiable) is the pre-dropout one: the sink merge rescales the dropped-out
        # probabilities by the same factor as the kept ones, which is dropout of the sink softmax.
        return (out, lse) if with_lse else out

    # Split forward/backward for context parallelism (no dropout there). config: always None (no
    # kernel_config capability: selection refuses a configured call for xla).
    def forward_only(self, q, k, v, tm, bias, *, scale, softcap, causal, window, config=None):
        return reference.reference_attention(q, k, v, tm, bias, scale=scale, softcap=softcap,
                                             causal=causal, window=window)

    def backward(self, q, k, v, tm, bias, out, lse, dout, dlse=None, *, scale, softcap, causal, window,
                 config=None):
        return reference.reference_attention_bwd(q, k, v, tm, bias, out, lse, dout, dlse, scale=scale,
                                                 softcap=softcap, causal=causal, window=window)
