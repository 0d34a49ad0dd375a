"""Helpers shared by the te_jax Flax modules: parameters with logical axes, input checks."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax import layouts

Initializer = Callable[..., jax.Array]

#: Logical names of the activations the modules annotate (nn.with_logical_constraint; a no-op
#: unless logical axis rules are active).
BATCH_AXES = "batch"
SEQ_AXES = "length"
HIDDEN_AXES = "embed"
#: Logical names of the per-head attention tensors' axes (as the projection kernels name them).
HEADS_AXES = "heads"
KV_HEADS_AXES = "kv_heads"
HEAD_DIM_AXES = "kv"
QKV_PACK_AXES = "qkv"

_HIDDEN_AXES_TEXT = {
    "bshd": "[batch, seq, hidden]",
    "sbhd": "[seq, batch, hidden]",
    "thd": "[tokens, hidden]",
}


def default_kernel_init() -> Initializer:
    """TransformerEngine's default: variance_scaling(1.0, 'fan_in', 'truncated_normal')."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def flat_init(init: Initializer, n_in: int) -> Initializer:
    """Call `init` on the 2-D [prod(in_dims), prod(out_dims)] view and reshape.

    Multi-axis kernels ([embed, 3, heads, head_dim], [heads, head_dim, embed]) then get the
    fan-in/fan-out of the matmul they implement, whatever their number of axes.
    """

    def fn(key, shape, dtype=jnp.float32):
        shape = tuple(shape)
        flat = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
        return init(key, flat, dtype).reshape(shape)

    return fn


def param(module: nn.Module, name: str, init: Initializer, shape: Sequence[int], dtype: Any,
          axes: Sequence[str] | None):
    """`module.param` with logical axis names (flax.linen.with_logical_partitioning) when given."""
    shape = tuple(int(s) for s in shape)
    if axes:
        axes = tuple(axes)
        if len(axes) != len(shape):
            raise ValueError(
                f"{type(module).__name__}.{name}: {len(axes)} logical axis names {axes} for a parameter of "
                f"shape {shape} (rank {len(shape)}); give one name (or None) per axis.")
        init = nn.with_logical_partitioning(init, axes)
    return module.param(name, init, shape, dtype)


def hidden_axes(attn_input_format: str):
    """Logical names of a [.., hidden] activation in this format."""
    return {"bshd": (BATCH_AXES, SEQ_AXES, HIDDEN_AXES), "sbhd": (SEQ_AXES, BATCH_AXES, HIDDEN_AXES),
            "thd": (SEQ_AXES, HIDDEN_AXES)}[attn_input_format]


def constrain(x, attn_input_format: str):
    """Sharding constraint by logical names; no-op when no logical axis rules are active."""
    return nn.with_logical_constraint(x, hidden_axes(attn_input_format))


def check_hidden_input(x, attn_input_format: str, argname: str, module: str, hidden: int | None = None):
    """Check a hidden-state tensor ([b, s, hidden], [s, b, hidden] or [t, hidden]) against the format."""
    fmt = layouts.check_format(attn_input_format)
    rank = 2 if fmt == "thd" else 3
    shape = tuple(x.shape)
    if len(shape) != rank:
        hint = ""
        if fmt != "thd" and len(shape) == 2:
            hint = (" A rank-2 input looks like packed tokens [tokens, hidden]: use attn_input_format='thd' "
                    "(with seqlens or segment ids), or add a batch axis.")
        elif fmt == "thd" and len(shape) == 3:
            hint = (" A rank-3 input looks like a padded batch: use attn_input_format='bshd' ([batch, seq, hidden]) "
                    "or 'sbhd' ([seq, batch, hidden]), or flatten it to [tokens, hidden].")
        elif len(shape) == rank + 1:
            hint = (" It looks like a per-head tensor [..., heads, head_dim]: merge the last two axes into "
                    "hidden first.")
        raise ValueError(
            f"{module}: {argname} has shape {shape} (rank {len(shape)}), but attn_input_format={fmt!r} expects a "
            f"rank-{rank} tensor {_HIDDEN_AXES_TEXT[fmt]}.{hint}")
    if hidden is not None and shape[-1] != hidden:
        raise ValueError(
            f"{module}: {argname} has shape {shape}; attn_input_format={fmt!r} expects {_HIDDEN_AXES_TEXT[fmt]} "
            f"with hidden = {hidden}, got hidden = {shape[-1]}. Fix: project the input to {hidden} features or "
            f"set hidden_size={shape[-1]}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{module}: {argname} has dtype {x.dtype}; expected a floating-point array.")


def batch_seq(x, attn_input_format: str):
    """(batch, seq) of a hidden-state tensor (thd: (1, tokens))."""
    if attn_input_format == "bshd":
        return x.shape[0], x.shape[1]
    if attn_input_format == "sbhd":
        return x.shape[1], x.shape[0]
    return 1, x.shape[0]


def check_positive(module: str, **values):
    for name, v in values.items():
        if v is None:
            continue
        if not isinstance(v, (int,)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{module}: {name}={v!r} must be a positive int.")


def check_rate(module: str, name: str, rate):
    if rate is None or not (0.0 <= float(rate) < 1.0):
        raise ValueError(f"{module}: {name}={rate!r} must be a float in [0, 1).")
    return float(rate)


def dropout(module: nn.Module, x, rate: float, deterministic: bool, rng_name: str = "dropout",
            broadcast_dims: Sequence[int] = ()):
    """Inverted dropout drawing from the named RNG stream; identity when deterministic or rate 0."""
    if deterministic or rate == 0.0:
        return x
    keep = 1.0 - rate
    mask_shape = list(x.shape)
    for d in broadcast_dims:
        mask_shape[d] = 1
    mask = jax.random.bernoulli(module.make_rng(rng_name), keep, tuple(mask_shape))
    return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype)).astype(x.dtype)
