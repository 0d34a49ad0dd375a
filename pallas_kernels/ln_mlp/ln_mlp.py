"""LayerNorm-MLP and LayerNorm-Dense with a memory-lean custom_vjp.

Arrays in, arrays out (x already flattened or not: any leading shape).

Forward (layernorm_mlp):
  ln, mean, rstd = norm(x)                 Pallas norm kernel (norm_impl="pallas") or jnp ("xla")
  h  = ln @ w1 + b1   (fp32 acc, rounded to x.dtype)      XLA GEMM, or the fused Pallas
                                                           LN-prologue GEMM (gemm_impl="pallas")
  a  = act(h)         (fp32 math, rounded to x.dtype)
  y  = a @ w2 + b2                                         XLA GEMM
Saved for the backward: x, mean, rstd (fp32, one per row) and h only. The backward
recomputes ln from (x, mean, rstd) and a = act(h), so neither ln nor a is kept alive.

Weights must already be in x.dtype (the te_jax op casts them outside, so autodiff carries
the cast's cotangent back to the parameter dtype); gamma/beta keep their own dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ln_mlp.activations import apply_activations
from pallas_kernels.norms import norm as pnorm
from pallas_kernels.norms import reference as norm_ref
from .._compat import default_interpret


# GEMMs accumulate in fp32 inside the matrix unit and write the compute dtype (as plain JAX does):
# an fp32 [tokens, F] or [D, F] output followed by a cast costs a round trip through memory.
def _mm(a, b, out_dtype=None):
    """a[M, K] @ b[K, N] -> [M, N] in out_dtype (default a.dtype)."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype or a.dtype)


def _mm_tn(a, b, out_dtype=None):
    """a[M, K]^T @ b[M, N] -> [K, N] in out_dtype (default a.dtype)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=out_dtype or a.dtype)


def _mm_nt(a, b, out_dtype=jnp.float32):
    """a[M, N] @ b[K, N]^T -> [M, K] (fp32 accumulation, out_dtype result)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


# ----------------------------------------------------------------------------- norm pieces


def _norm_fwd(x2, gamma, beta, rms, eps, zc, norm_impl, interpret):
    if norm_impl == "pallas":
        return pnorm.norm_fwd(x2, gamma, beta, rms=rms, epsilon=eps, zero_centered_gamma=zc,
                              interpret=interpret)
    if rms:
        y, rstd = norm_ref.rmsnorm_fwd(x2, gamma, epsilon=eps, zero_centered_gamma=zc)
        return y, None, rstd
    return norm_ref.layernorm_fwd(x2, gamma, beta, epsilon=eps, zero_centered_gamma=zc)


def _norm_bwd(dln, x2, gamma, beta, mean, rstd, rms, zc, norm_impl, interpret):
    """-> dx (x.dtype), dgamma (gamma.dtype), dbeta (beta.dtype or None)."""
    if norm_impl == "pallas":
        dx, dg, db = pnorm.norm_bwd(dln, x2, gamma, mean, rstd, rms=rms, has_beta=beta is not None,
                                    zero_centered_gamma=zc, interpret=interpret)
    else:
        # jnp backward from the saved statistics (what XLA autodiff would compute).
        xf = x2.astype(jnp.float32)
        xhat = (xf - mean[:, None]) * rstd[:, None] if mean is not None else xf * rstd[:, None]
        g = gamma.astype(jnp.float32) + (1.0 if zc else 0.0)
        dy = dln.astype(jnp.float32)
        wdy = dy * g
        n = x2.shape[-1]
        c1 = jnp.sum(xhat * wdy, axis=-1, keepdims=True) / n
        if mean is None:
            dxf = (wdy - xhat * c1) * rstd[:, None]
        else:
            c2 = jnp.sum(wdy, axis=-1, keepdims=True) / n
            dxf = (wdy - xhat * c1 - c2) * rstd[:, None]
        dx = dxf.astype(x2.dtype)
        dg = jnp.sum(dy * xhat, axis=0)
        db = jnp.sum(dy, axis=0) if beta is not None else None
    dg = dg.astype(gamma.dtype)
    db = None if beta is None else db.astype(beta.dtype)
    return dx, dg, db


def _stats(x2, rms, eps):
    """(mean or None, rstd) in fp32, as the norm kernels compute them."""
    xf = x2.astype(jnp.float32)
    if rms:
        return None, lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)
    mean = jnp.mean(xf, axis=-1)
    xc = xf - mean[:, None]
    return mean, lax.rsqrt(jnp.mean(xc * xc, axis=-1) + eps)


def _recompute_ln(x2, gamma, beta, mean, rstd, zc):
    return norm_ref.apply_stats(x2, gamma, beta, mean, rstd, zero_centered_gamma=zc)


# ----------------------------------------------------------------------------- layernorm_mlp


def _first_gemm(ln, x2, gamma, beta, mean, rstd, w1f, b1f, zc, gemm_impl, interpret):
    if gemm_impl == "pallas":
        from pallas_kernels.ln_mlp.fused_gemm import ln_gemm

        return ln_gemm(x2, gamma, beta, mean, rstd, w1f, b1f, zero_centered_gamma=zc, interpret=interpret)
    h = _mm(ln, w1f)
    if b1f is not None:
        h = h.astype(jnp.float32) + b1f.astype(jnp.float32)
    return h.astype(ln.dtype)


def _mlp_forward(x2, gamma, beta, w1, b1, w2, b2, cfg):
    rms, acts, eps, zc, ret_ln, norm_impl, gemm_impl, interpret = cfg
    d, n_act, f = w1.shape
    dt = x2.dtype
    if gemm_impl == "pallas" and not ret_ln:
        # The fused GEMM normalizes in its prologue: only the per-row statistics are needed.
        ln, mean, rstd = None, *_stats(x2, rms, eps)
    else:
        ln, mean, rstd = _norm_fwd(x2, gamma, beta, rms, eps, zc, norm_impl, interpret)
    w1f = w1.reshape(d, n_act * f)
    b1f = None if b1 is None else b1.reshape(n_act * f)
    h = _first_gemm(ln, x2, gamma, beta, mean, rstd, w1f, b1f, zc, gemm_impl, interpret)
    a = apply_activations(h.astype(jnp.float32).reshape(-1, n_act, f), acts).astype(dt)
    y = _mm(a, w2)
    if b2 is not None:
        y = y.astype(jnp.float32) + b2.astype(jnp.float32)
    y = y.astype(dt)
    return y, ln, mean, rstd, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ln_mlp(x2, gamma, beta, w1, b1, w2, b2, cfg):
    y, ln, _, _, _ = _mlp_forward(x2, gamma, beta, w1, b1, w2, b2, cfg)
    return (y, ln) if cfg[4] else y


def _ln_mlp_fwd(x2, gamma, beta, w1, b1, w2, b2, cfg):
    y, ln, mean, rstd, h = _mlp_forward(x2, gamma, beta, w1, b1, w2, b2, cfg)
    out = (y, ln) if cfg[4] else y
    # Saved: x, the statistics, the pre-activation h; params are the caller's arrays.
    return out, (x2, gamma, beta, mean, rstd, w1, b1, w2, b2, h)


def _ln_mlp_bwd(cfg, res, ct):
    rms, acts, eps, zc, ret_ln, norm_impl, gemm_impl, interpret = cfg
    x2, gamma, beta, mean, rstd, w1, b1, w2, b2, h = res
    if ret_ln:
        dy, dln_extra = ct
    else:
        dy, dln_extra = ct, None
    dt = x2.dtype
    d, n_act, f = w1.shape
    dy = dy.astype(dt)
    db2 = None if b2 is None else jnp.sum(dy.astype(jnp.float32), axis=0).astype(b2.dtype)

    hf = h.astype(jnp.float32).reshape(-1, n_act, f)
    a, act_vjp = jax.vjp(lambda t: apply_activations(t, acts), hf)
    a = a.astype(dt)
    dw2 = _mm_tn(a, dy, w2.dtype)
    # GEMM outputs in x.dtype (fp32 accumulation inside): an fp32 [T, F] output would double temp memory.
    da = _mm_nt(dy, w2, dt).astype(jnp.float32)          # [T, F]
    (dh,) = act_vjp(da)                                  # [T, n_act, F], fp32 inside the fusion only
    # Rounded to x.dtype before anything else reads it (db1 included), as plain autodiff does: an fp32
    # [T, n_act*F] cotangent kept for the bias reduction would stay alive in memory.
    dh = dh.reshape(-1, n_act * f).astype(dt)
    db1 = None if b1 is None else jnp.sum(dh.astype(jnp.float32), axis=0).reshape(b1.shape).astype(b1.dtype)

    ln = _recompute_ln(x2, gamma, beta, mean, rstd, zc)
    w1f = w1.reshape(d, n_act * f)
    dw1 = _mm_tn(ln, dh, w1.dtype).reshape(w1.shape)
    dln = _mm_nt(dh, w1f, dt if dln_extra is None else jnp.float32)
    if dln_extra is not None:
        dln = dln + dln_extra.astype(jnp.float32)
    dx, dgamma, dbeta = _norm_bwd(dln.astype(dt), x2, gamma, beta, mean, rstd, rms, zc, norm_impl,
                                  interpret)
    return dx, dgamma, dbeta, dw1, db1, dw2, db2


_ln_mlp.defvjp(_ln_mlp_fwd, _ln_mlp_bwd)


def layernorm_mlp(x, gamma, beta, w1, b1, w2, b2, *, rms=False, activations=("gelu",), epsilon=1e-6,
                  zero_centered_gamma=False, return_layernorm_output=False, norm_impl="pallas",
                  gemm_impl="xla", interpret=None):
    """x [..., D]; w1 [D, n_act, F] and w2 [F, Dout] in x.dtype; -> y [..., Dout] (, ln [..., D])."""
    if interpret is None:
        interpret = default_interpret()
    d = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d)
    beta = None if rms else beta
    cfg = (bool(rms), tuple(activations), float(epsilon), bool(zero_centered_gamma),
           bool(return_layernorm_output), norm_impl, gemm_impl, bool(interpret))
    out = _ln_mlp(x2, gamma, beta, w1, b1, w2, b2, cfg)
    if return_layernorm_output:
        y, ln = out
        return y.reshape(*lead, w2.shape[1]), ln.reshape(x.shape)
    return out.reshape(*lead, w2.shape[1])


# ----------------------------------------------------------------------------- layernorm_dense


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ln_dense(x2, gamma, beta, w, b, cfg):
    rms, eps, zc, ret_ln, norm_impl, interpret = cfg
    ln, _, _ = _norm_fwd(x2, gamma, beta, rms, eps, zc, norm_impl, interpret)
    y = _mm(ln, w)
    if b is not None:
        y = y.astype(jnp.float32) + b.astype(jnp.float32)
    y = y.astype(x2.dtype)
    return (y, ln) if ret_ln else y


def _ln_dense_fwd(x2, gamma, beta, w, b, cfg):
    rms, eps, zc, ret_ln, norm_impl, interpret = cfg
    ln, mean, rstd = _norm_fwd(x2, gamma, beta, rms, eps, zc, norm_impl, interpret)
    y = _mm(ln, w)
    if b is not None:
        y = y.astype(jnp.float32) + b.astype(jnp.float32)
    y = y.astype(x2.dtype)
    return ((y, ln) if ret_ln else y), (x2, gamma, beta, mean, rstd, w, b)


def _ln_dense_bwd(cfg, res, ct):
    rms, eps, zc, ret_ln, norm_impl, interpret = cfg
    x2, gamma, beta, mean, rstd, w, b = res
    dy, dln_extra = ct if ret_ln else (ct, None)
    dy = dy.astype(x2.dtype)
    db = None if b is None else jnp.sum(dy.astype(jnp.float32), axis=0).astype(b.dtype)
    ln = _recompute_ln(x2, gamma, beta, mean, rstd, zc)
    dw = _mm_tn(ln, dy, w.dtype)
    dln = _mm_nt(dy, w, x2.dtype if dln_extra is None else jnp.float32)
    if dln_extra is not None:
        dln = dln + dln_extra.astype(jnp.float32)
    dx, dgamma, dbeta = _norm_bwd(dln.astype(x2.dtype), x2, gamma, beta, mean, rstd, rms, zc, norm_impl,
                                  interpret)
    return dx, dgamma, dbeta, dw, db


_ln_dense.defvjp(_ln_dense_fwd, _ln_dense_bwd)


def layernorm_dense(x, gamma, beta, w, b=None, *, rms=False, epsilon=1e-6, zero_centered_gamma=False,
                    return_layernorm_output=False, norm_impl="pallas", interpret=None):
    """x [..., D]; w [D, N] in x.dtype; b [N] | None -> y [..., N] (, ln [..., D])."""
    if interpret is None:
        interpret = default_interpret()
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    beta = None if rms else beta
    cfg = (bool(rms), float(epsilon), bool(zero_centered_gamma), bool(return_layernorm_output), norm_impl,
           bool(interpret))
    out = _ln_dense(x2, gamma, beta, w, b, cfg)
    if return_layernorm_output:
        y, ln = out
        return y.reshape(*x.shape[:-1], w.shape[1]), ln.reshape(x.shape)
    return out.reshape(*x.shape[:-1], w.shape[1])
