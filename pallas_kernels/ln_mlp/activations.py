"""Activation math by name (plain jnp, elementwise), shared by the kernels and te_jax.activations."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp


def gelu(x):
    """GELU, tanh approximation (as Transformer Engine)."""
    return jax.nn.gelu(x, approximate=True)


def relu(x):
    return jnp.maximum(x, 0)


def silu(x):
    return x * jax.nn.sigmoid(x)


def quick_gelu(x):
    """x * sigmoid(1.702 x)."""
    return x * jax.nn.sigmoid(1.702 * x)


def squared_relu(x):
    r = jnp.maximum(x, 0)
    return r * r


def linear(x):
    return x


ACTIVATIONS: dict[str, Callable] = {
    "gelu": gelu,
    "relu": relu,
    "silu": silu,
    "quick_gelu": quick_gelu,
    "squared_relu": squared_relu,
    "linear": linear,
}

#: Gated pairs: (act, "linear") for every non-linear activation.
GATED_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (name, "linear") for name in ACTIVATIONS if name != "linear"
)



def apply_activations(h, activations: Sequence[str]):
    """h: [..., n_act, F] (n_act = len(activations)) -> [..., F].

    Single: act(h[..., 0, :]). Gated pair: act(h[..., 0, :]) * h[..., 1, :].
    Computes in h's dtype; pass fp32 for fp32 math.
    """
    acts = tuple(activations)
    out = ACTIVATIONS[acts[0]](h[..., 0, :])
    for i, name in enumerate(acts[1:], start=1):
        out = out * ACTIVATIONS[name](h[..., i, :])
    return out
