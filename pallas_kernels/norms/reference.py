"""Plain-jnp LayerNorm / RMSNorm (fp32 statistics, output in x.dtype). Differentiable by autodiff."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _gamma(gamma, zero_centered_gamma):
    g = gamma.astype(jnp.float32)
    return 1.0 + g if zero_centered_gamma else g


def layernorm_fwd(x, gamma, beta, *, epsilon=1e-6, zero_centered_gamma=False):
    """-> (y [x.shape, x.dtype], mean [x.shape[:-1], f32], rstd [x.shape[:-1], f32])."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1)
    xc = xf - mean[..., None]
    var = jnp.mean(xc * xc, axis=-1)
    rstd = jax.lax.rsqrt(var + epsilon)
    y = xc * rstd[..., None] * _gamma(gamma, zero_centered_gamma)
    if beta is not None:
        y = y + beta.astype(jnp.float32)
    return y.astype(x.dtype), mean, rstd


def rmsnorm_fwd(x, gamma, *, epsilon=1e-6, zero_centered_gamma=False):
    """-> (y, rstd)."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1)
    rstd = jax.lax.rsqrt(var + epsilon)
    y = xf * rstd[..., None] * _gamma(gamma, zero_centered_gamma)
    return y.astype(x.dtype), rstd


def layernorm(x, gamma, beta, *, epsilon=1e-6, zero_centered_gamma=False):
    return layernorm_fwd(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)[0]


def rmsnorm(x, gamma, *, epsilon=1e-6, zero_centered_gamma=False):
    return rmsnorm_fwd(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)[0]


def norm(x, gamma, beta, *, layernorm_type="layernorm", epsilon=1e-6, zero_centered_gamma=False):
    if layernorm_type == "rmsnorm":
        return rmsnorm(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)
    return layernorm(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)


def apply_stats(x, gamma, beta, mean, rstd, *, zero_centered_gamma=False, out_dtype=None):
    """Recompute the normalized output from saved statistics (mean None for RMSNorm)."""
    xf = x.astype(jnp.float32)
    if mean is not None:
        xf = xf - mean[..., None]
    y = xf * rstd[..., None] * _gamma(gamma, zero_centered_gamma)
    if beta is not None:
        y = y + beta.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)
