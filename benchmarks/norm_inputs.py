"""Random norm benchmark inputs (imported by the norm GPU scripts as `norm_inputs`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def norm_inputs(m: int, d: int, seed: int):
    """x [m, d] bf16, gamma [d] f32 (around 1), beta [d] f32, dy [m, d] bf16: fresh normal draws."""
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (m, d)).astype(jnp.bfloat16)
    g = 1 + 0.1 * jax.random.normal(k[1], (d,))
    b = 0.1 * jax.random.normal(k[2], (d,))
    dy = jax.random.normal(k[3], (m, d)).astype(jnp.bfloat16)
    return x, g, b, dy
