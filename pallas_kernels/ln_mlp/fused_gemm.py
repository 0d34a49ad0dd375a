"""LN-prologue GEMM: h = norm(x) @ w + b, with the row-block of x normalized in registers.

The per-row statistics (mean, rstd; fp32) come from the norm kernel; each program loads an
x tile [block_m, block_k], applies (x - mean) * rstd * gamma (+ beta), rounds to x.dtype and
feeds it straight to the dot, so the normalized activations never go to HBM. Bias is added
in the epilogue, the output is rounded to x.dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import default_interpret, pl, pltriton, triton_params

from .._lower_once import lower_once


def _p2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


def _kernel(*refs, m, n, k, bm, bn, bk, rms, has_beta, has_bias, zc):
    refs = list(refs)
    x_ref, g_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_beta else None
    mean_ref = None if rms else refs.pop(0)
    rstd_ref, w_ref = refs.pop(0), refs.pop(0)
    bias_ref = refs.pop(0) if has_bias else None
    o_ref = refs.pop(0)

    pid_m, pid_n = pl.program_id(0), pl.program_id(1)
    rows = pid_m * bm + jnp.arange(bm)
    cols = pid_n * bn + jnp.arange(bn)
    rmask, nmask = rows < m, cols < n
    rstd = pltriton.load(rstd_ref.at[rows], mask=rmask, other=0.0)
    mean = None if rms else pltriton.load(mean_ref.at[rows], mask=rmask, other=0.0)

    def body(i, acc):
        ks = i * bk + jnp.arange(bk)
        kmask = ks < k
        xb = pltriton.load(x_ref.at[rows[:, None], ks[None, :]], mask=rmask[:, None] & kmask[None, :],
                           other=0.0).astype(jnp.float32)
        g = pltriton.load(g_ref.at[ks], mask=kmask, other=0.0).astype(jnp.float32)
        if zc:
            g = jnp.where(kmask, g + 1.0, 0.0)
        if not rms:
            xb = xb - mean[:, None]
        xn = xb * rstd[:, None] * g[None, :]
        if has_beta:
            xn = xn + pltriton.load(b_ref.at[ks], mask=kmask, other=0.0).astype(jnp.float32)[None, :]
        wb = pltriton.load(w_ref.at[ks[:, None], cols[None, :]], mask=kmask[:, None] & nmask[None, :], other=0.0)
        return acc + jnp.dot(xn.astype(wb.dtype), wb, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(k, bk), body, jnp.zeros((bm, bn), jnp.float32))
    if has_bias:
        acc = acc + pltriton.load(bias_ref.at[cols], mask=nmask, other=0.0).astype(jnp.float32)[None, :]
    pltriton.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                   mask=rmask[:, None] & nmask[None, :])


@lower_once(static_argnames=("zero_centered_gamma", "block_m", "block_n", "block_k", "num_warps", "num_stages",
                             "interpret"))
def ln_gemm(x2, gamma, beta, mean, rstd, w, bias=None, *, zero_centered_gamma=False, block_m=128,
            block_n=128, block_k=64, num_warps=8, num_stages=3, interpret=None):
    """x2 [M, K]; gamma/beta [K]; mean (None for RMSNorm) / rstd [M] fp32; w [K, N]; bias [N] -> [M, N]."""
    if interpret is None:
        interpret = default_interpret()
    m, k = x2.shape
    n = w.shape[1]
    bm = max(16, min(block_m, _p2(m)))
    bn = max(16, min(block_n, _p2(n)))
    bk = max(16, min(block_k, _p2(k)))
    rms = mean is None
    has_beta = beta is not None
    has_bias = bias is not None
    args = [x2, gamma] + ([beta] if has_beta else []) + ([] if rms else [mean]) + [rstd, w]
    args += [bias] if has_bias else []
    kernel = functools.partial(_kernel, m=m, n=n, k=k, bm=bm, bn=bn, bk=bk, rms=rms, has_beta=has_beta,
                               has_bias=has_bias, zc=zero_centered_gamma)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x2.dtype),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="te_ln_gemm",
    )(*args)
