"""Activation functions by name, as used by LayerNormMLP.

`activations` is a tuple/list of names:
  * a single name, e.g. ("gelu",): the first GEMM produces F columns, result act(h);
  * a gated pair (act, "linear"), e.g. ("gelu", "linear") (GeGLU), ("silu", "linear") (SwiGLU),
    ("relu", "linear") (ReGLU): the first GEMM produces 2*F columns laid out as
    [act part | linear part] (w1 has shape [D, 2, F]) and the result is act(a) * b.

All functions are plain jnp, applied elementwise; callers compute them in fp32.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.ln_mlp.activations import (  # the math lives beside the kernels
    ACTIVATIONS,
    GATED_PAIRS,
    apply_activations,
    gelu,
    linear,
    quick_gelu,
    relu,
    silu,
    squared_relu,
)


def _valid_choices() -> str:
    singles = ", ".join(f"({n!r},)" for n in ACTIVATIONS)
    pairs = ", ".join(repr(p) for p in GATED_PAIRS)
    return f"a single name: {singles}; or a gated pair: {pairs}"


def validate_activations(activations, argname: str = "activations") -> tuple[str, ...]:
    """Return `activations` as a tuple of names; raise ValueError naming the argument if invalid."""
    if isinstance(activations, str):
        raise ValueError(
            f"{argname}={activations!r} is a string; expected a tuple/list of names. "
            f"Fix: pass ({activations!r},). Valid choices: {_valid_choices()}."
        )
    try:
        acts = tuple(activations)
    except TypeError:
        raise ValueError(
            f"{argname}={activations!r} is not a tuple/list of names. Valid choices: {_valid_choices()}."
        ) from None
    if len(acts) == 1 and isinstance(acts[0], str) and acts[0] in ACTIVATIONS:
        return acts
    if len(acts) == 2 and tuple(acts) in GATED_PAIRS:
        return acts
    unknown = [a for a in acts if not (isinstance(a, str) and a in ACTIVATIONS)]
    if unknown:
        what = f"unknown activation name(s) {unknown!r}"
    elif len(acts) == 2:
        what = "a gated pair must be (act, 'linear')"
    else:
        what = f"{len(acts)} names given; expected 1 name or a gated pair of 2"
    raise ValueError(f"{argname}={activations!r}: {what}. Valid choices: {_valid_choices()}.")


def get_activation(name: str) -> Callable:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is unknown; valid names: {list(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


__all__ = [
    "ACTIVATIONS",
    "GATED_PAIRS",
    "gelu",
    "relu",
    "silu",
    "quick_gelu",
    "squared_relu",
    "linear",
    "validate_activations",
    "get_activation",
    "apply_activations",
    "biased_activation_dropout",
]


def biased_activation_dropout(h, b1, activations, dropout_rate, dropout_rng, dtype):
    """The MLP's middle: (h [..., n_act, F] + b1) -> activation(s) in fp32 -> dropout; returns dtype.

    h is the first GEMM's output, rounded to `dtype` before the activation as a kernel would store it."""
    h = h.astype(jnp.float32)
    if b1 is not None:
        h = h + b1.astype(jnp.float32)
    a = apply_activations(h.astype(dtype).astype(jnp.float32), activations)
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, a.shape)
        a = jnp.where(keep, a / (1.0 - dropout_rate), 0.0)
    return a.astype(dtype)
