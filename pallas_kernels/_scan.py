"""Cumulative max / min along the last axis in two levels (plain jnp; the masks' pre-passes use them).

    cummax_last(x, reverse=False) -> lax.cummax(x, axis=-1, reverse=reverse), the same values
    cummin_last(x, reverse=False) -> lax.cummin(x, axis=-1, reverse=reverse)

lax.cummax lowers to one reduce_window over the whole axis. Where the axis is a multiple of BLOCK and longer than
it, these take the running max inside blocks of BLOCK elements, then across the blocks' maxima, and combine: a
window of BLOCK over every element plus one over S / BLOCK elements, whatever XLA makes of a full-length window.
Other lengths fall back to lax.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

#: Elements per block of the first level.
BLOCK = 128
_CUMMAX, _CUMMIN = lax.cummax, lax.cummin  # bound at import (a probe may swap jax.lax's for these functions)


def _two_level(x, reverse: bool, op, cum):
    s = x.shape[-1]
    if s <= BLOCK or s % BLOCK:
        return cum(x, axis=x.ndim - 1, reverse=reverse)
    blocks = x.reshape(x.shape[:-1] + (s // BLOCK, BLOCK))
    inner = cum(blocks, axis=blocks.ndim - 1, reverse=reverse)  # within each block
    edge = inner[..., 0] if reverse else inner[..., -1]  # each block's total
    outer = cum(edge, axis=edge.ndim - 1, reverse=reverse)  # over the blocks, inclusive
    # the blocks before each block (after it, reversed): the inclusive scan shifted by one
    if reverse:
        before = jnp.concatenate([outer[..., 1:], outer[..., -1:]], axis=-1)
        first = jnp.arange(s // BLOCK) == s // BLOCK - 1
    else:
        before = jnp.concatenate([outer[..., :1], outer[..., :-1]], axis=-1)
        first = jnp.arange(s // BLOCK) == 0
    out = jnp.where(first[:, None], inner, op(inner, before[..., None]))
    return out.reshape(x.shape)


def cummax_last(x, reverse: bool = False):
    """lax.cummax(x, axis=-1, reverse=reverse) in two levels (see the module docstring)."""
    return _two_level(x, reverse, jnp.maximum, _CUMMAX)


def cummin_last(x, reverse: bool = False):
    """lax.cummin(x, axis=-1, reverse=reverse) in two levels (see the module docstring)."""
    return _two_level(x, reverse, jnp.minimum, _CUMMIN)
