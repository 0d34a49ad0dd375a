"""Shape helpers the kernels' wrappers share (block sizes and padding)."""
from __future__ import annotations

import jax.numpy as jnp


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def check_blocks(owner: str, **blocks) -> None:
    """ValueError naming `owner.field` unless each given block size is None or a power of two >= 16 (Triton's
    smallest dot)."""
    for name, b in blocks.items():
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"{owner}.{name}={b} must be a power of two >= 16")


def pad_axis(x, axis: int, size: int, value=0):
    """x zero-padded (or `value`-padded) along `axis` to `size`; x itself (no copy) when it is that long or None."""
    if x is None or x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads, constant_values=value)
