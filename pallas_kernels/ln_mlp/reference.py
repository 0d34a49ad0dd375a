"""Plain-XLA LayerNorm-MLP and LayerNorm-Dense (autodiff saves whatever XLA keeps).

Compute dtype is x.dtype: weights are cast to it, GEMMs accumulate in fp32, the
pre-activation is rounded to x.dtype, activations are evaluated in fp32.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.norms import reference as norm_ref
from pallas_kernels.ln_mlp.activations import apply_activations


def _norm(x, gamma, beta, rms, epsilon, zero_centered_gamma):
    if rms:
        return norm_ref.rmsnorm(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)
    return norm_ref.layernorm(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)


def mm(a, b):
    """[..., K] @ [K, ...] (last axis of a with the first of b), as fp32: the output keeps the inputs'
    dtype so that autodiff's backward GEMMs stay in x.dtype (an fp32-output dot would make them
    fp32 GEMMs); GPUs accumulate bf16 GEMMs in fp32 anyway. Callers upcast for the epilogue.
    Leading axes are contracted as they are (no reshape), so sharded activations keep their sharding."""
    return lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=a.dtype).astype(jnp.float32)


def layernorm_mlp(x, gamma, beta, w1, b1, w2, b2, *, rms=False, activations=("gelu",), epsilon=1e-6,
                  zero_centered_gamma=False, return_layernorm_output=False, dropout_fn=None):
    """x [..., D]; w1 [D, n_act, F]; b1 [n_act, F] | None; w2 [F, Dout]; b2 [Dout] | None."""
    dt = x.dtype
    ln = _norm(x, gamma, beta, rms, epsilon, zero_centered_gamma)
    h = mm(ln, w1.astype(dt))  # [..., n_act, F]
    if b1 is not None:
        h = h + b1.astype(jnp.float32)
    h = h.astype(dt)
    a = apply_activations(h.astype(jnp.float32), activations)
    if dropout_fn is not None:
        a = dropout_fn(a)
    a = a.astype(dt)
    y = mm(a, w2.astype(dt))
    if b2 is not None:
        y = y + b2.astype(jnp.float32)
    y = y.astype(dt)
    return (y, ln) if return_layernorm_output else y


def layernorm_dense(x, gamma, beta, w, b=None, *, rms=False, epsilon=1e-6, zero_centered_gamma=False,
                    return_layernorm_output=False):
    """x [..., D]; w [D, N]; b [N] | None -> y [..., N]."""
    dt = x.dtype
    ln = _norm(x, gamma, beta, rms, epsilon, zero_centered_gamma)
    y = mm(ln, w.astype(dt))
    if b is not None:
        y = y + b.astype(jnp.float32)
    y = y.astype(dt)
    return (y, ln) if return_layernorm_output else y
