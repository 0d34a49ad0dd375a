"""LayerNorm / RMSNorm forward and backward as Triton-lowered Pallas kernels.

Arrays in, arrays out. Any hidden size (the row is padded to a power of two inside the
block and masked), any leading shape (flattened to rows), fp32 statistics, optional
zero-centred gamma (y = norm(x) * (1 + gamma)).

Forward: one program per `block_rows` rows; each loads its rows whole into registers,
computes mean/rstd in fp32 and writes y (x.dtype), mean and rstd (fp32).
Backward: `grid` programs, each loops over row blocks (strided by `grid`), writes dx and
accumulates dgamma/dbeta partial sums in fp32 registers; the [grid, D] partials are
summed by XLA afterwards.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import default_interpret, pl, pltriton, triton_params

from .._lower_once import lower_once
from .._shapes import next_pow2 as _next_pow2

#: Largest hidden size the in-register kernels serve (a padded row must fit in registers).
MAX_HIDDEN = 32768


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Launch parameters; None picks a heuristic from the shape."""

    block_rows: int | None = None
    num_warps: int | None = None
    bwd_block_rows: int | None = None
    bwd_num_warps: int | None = None
    bwd_grid: int | None = None
    num_stages: int = 1
    #: LayerNorm forward statistics: "one_pass" sums (x-K) and (x-K)² together, K = the row's first
    #: element (a shift that keeps E[(x-K)²]-E[x-K]² exact enough in fp32 when |mean| >> std);
    #: "two_pass" computes the mean, then the variance of x - mean (one more reduction in sequence).
    fwd_stats: str = "one_pass"


def _fwd_params(n_rows, n_cols, cfg: NormConfig):
    block_cols = _next_pow2(n_cols)
    # Rows padded from 4097-8191 columns up to 8192 (hidden 5120, 6144): two rows on 8 warps, faster than one
    # row there (benchmarks/results/norm_shapes_h100.md).
    padded_8k = block_cols == 8192 and n_cols < block_cols
    block_rows = cfg.block_rows or (2 if padded_8k else max(1, min(16, 8192 // block_cols)))
    block_rows = min(block_rows, _next_pow2(n_rows))
    elems = block_rows * block_cols
    default_warps = 8 if padded_8k else (16 if elems >= 16384 else 8 if elems >= 4096 else 4 if elems >= 1024 else 2)
    num_warps = cfg.num_warps or default_warps
    return block_rows, block_cols, num_warps


def _bwd_params(n_rows, n_cols, cfg: NormConfig):
    block_cols = _next_pow2(n_cols)
    block_rows = cfg.bwd_block_rows or max(1, min(16, 4096 // block_cols))
    block_rows = min(block_rows, _next_pow2(n_rows))
    elems = block_rows * block_cols
    num_warps = cfg.bwd_num_warps or (16 if elems >= 16384 else 8 if elems >= 4096 else 4 if elems >= 1024 else 2)
    n_blocks = pl.cdiv(n_rows, block_rows)
    grid = min(n_blocks, cfg.bwd_grid or 528)
    return block_rows, block_cols, num_warps, grid


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(*refs, n_rows, n_cols, block_rows, block_cols, eps, rms, zero_centered, has_beta, one_pass):
    refs = list(refs)
    x_ref, g_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_beta else None
    y_ref = refs.pop(0)
    mean_ref = None if rms else refs.pop(0)
    rstd_ref = refs.pop(0)

    pid = pl.program_id(0)
    rows = pid * block_rows + jnp.arange(block_rows)
    cols = jnp.arange(block_cols)
    rmask = rows < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    x = pltriton.load(x_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0).astype(jnp.float32)
    # Masked loads give 0 in padded rows and columns. Padded columns must be kept out of the statistics
    # where a shift or the mean is subtracted first; with no padded column (n_cols a power of two) that
    # select is skipped: fewer instructions per element between the load and the store.
    pad_cols = block_cols != n_cols
    if rms:
        xc = x
        var = jnp.sum(xc * xc, axis=1) / n_cols
    elif one_pass:
        shift = pltriton.load(x_ref.at[rows, 0], mask=rmask, other=0.0).astype(jnp.float32)
        xs = x - shift[:, None]
        if pad_cols:
            xs = jnp.where(cmask[None, :], xs, 0.0)
        m1 = jnp.sum(xs, axis=1) / n_cols
        var = jnp.maximum(jnp.sum(xs * xs, axis=1) / n_cols - m1 * m1, 0.0)
        mean = shift + m1
        xc = xs - m1[:, None]  # = x - mean; padded columns are never stored
    else:
        mean = jnp.sum(x, axis=1) / n_cols
        xc = x - mean[:, None]
        if pad_cols:
            xc = jnp.where(cmask[None, :], xc, 0.0)
        var = jnp.sum(xc * xc, axis=1) / n_cols
    rstd = lax.rsqrt(var + eps)
    g = pltriton.load(g_ref.at[cols], mask=cmask, other=0.0).astype(jnp.float32)
    if zero_centered:
        g = g + 1.0
    y = xc * rstd[:, None] * g[None, :]
    if has_beta:
        b = pltriton.load(b_ref.at[cols], mask=cmask, other=0.0).astype(jnp.float32)
        y = y + b[None, :]
    pltriton.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)
    if not rms:
        pltriton.store(mean_ref.at[rows], mean, mask=rmask)
    pltriton.store(rstd_ref.at[rows], rstd, mask=rmask)


@lower_once(static_argnames=("rms", "epsilon", "zero_centered_gamma", "config", "interpret"))
def norm_fwd(x, gamma, beta=None, *, rms=False, epsilon=1e-6, zero_centered_gamma=False,
             config: NormConfig = NormConfig(), interpret=None):
    """x [..., D] -> (y [..., D] x.dtype, mean [...] f32 or None (rms), rstd [...] f32)."""
    if interpret is None:
        interpret = default_interpret()
    lead, n_cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    n_rows = x2.shape[0]
    block_rows, block_cols, num_warps = _fwd_params(n_rows, n_cols, config)
    has_beta = (beta is not None) and not rms
    kernel = functools.partial(
        _fwd_kernel, n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
        eps=float(epsilon), rms=rms, zero_centered=zero_centered_gamma, has_beta=has_beta,
        one_pass=config.fwd_stats == "one_pass")
    if config.fwd_stats not in ("one_pass", "two_pass"):
        raise ValueError(f"NormConfig.fwd_stats={config.fwd_stats!r}: expected 'one_pass' or 'two_pass'")
    out_shape = [jax.ShapeDtypeStruct((n_rows, n_cols), x.dtype)]
    if not rms:
        out_shape.append(jax.ShapeDtypeStruct((n_rows,), jnp.float32))
    out_shape.append(jax.ShapeDtypeStruct((n_rows,), jnp.float32))
    args = [x2, gamma] + ([beta] if has_beta else [])
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(n_rows, block_rows),),
        compiler_params=triton_params(num_warps, config.num_stages),
        interpret=interpret,
        name="te_rmsnorm_fwd" if rms else "te_layernorm_fwd",
    )(*args)
    y = outs[0].reshape(x.shape)
    rstd = outs[-1].reshape(lead)
    mean = None if rms else outs[1].reshape(lead)
    return y, mean, rstd


# ----------------------------------------------------------------------------- backward


def _bwd_kernel(*refs, n_rows, n_cols, block_rows, block_cols, grid, n_iters, rms, zero_centered,
                has_beta, has_dres):
    refs = list(refs)
    x_ref, g_ref, dy_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    mean_ref = None if rms else refs.pop(0)
    rstd_ref = refs.pop(0)
    dres_ref = refs.pop(0) if has_dres else None
    dx_ref, dg_ref = refs.pop(0), refs.pop(0)
    db_ref = refs.pop(0) if has_beta else None

    pid = pl.program_id(0)
    cols = jnp.arange(block_cols)
    cmask = cols < n_cols
    g = pltriton.load(g_ref.at[cols], mask=cmask, other=0.0).astype(jnp.float32)
    if zero_centered:
        g = jnp.where(cmask, g + 1.0, 0.0)

    def body(i, carry):
        dg_acc, db_acc = carry
        rows = (pid + i * grid) * block_rows + jnp.arange(block_rows)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        idx = (rows[:, None], cols[None, :])
        x = pltriton.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
        dy = pltriton.load(dy_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
        rstd = pltriton.load(rstd_ref.at[rows], mask=rmask, other=0.0)
        if rms:
            xhat = x * rstd[:, None]
        else:
            mean = pltriton.load(mean_ref.at[rows], mask=rmask, other=0.0)
            xhat = jnp.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * g[None, :]
        c1 = jnp.sum(xhat * wdy, axis=1) / n_cols
        if rms:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = jnp.sum(wdy, axis=1) / n_cols
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if has_dres:  # the skip connection's gradient, added before dx is rounded
            dx = dx + pltriton.load(dres_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
        pltriton.store(dx_ref.at[idx], dx.astype(dx_ref.dtype), mask=mask)
        dg_acc = dg_acc + jnp.sum(dy * xhat, axis=0)
        if has_beta:
            db_acc = db_acc + jnp.sum(dy, axis=0)
        return dg_acc, db_acc

    zeros = jnp.zeros((block_cols,), jnp.float32)
    dg_acc, db_acc = lax.fori_loop(0, n_iters, body, (zeros, zeros))
    out_idx = pid * n_cols + cols
    pltriton.store(dg_ref.at[out_idx], dg_acc, mask=cmask)
    if has_beta:
        pltriton.store(db_ref.at[out_idx], db_acc, mask=cmask)


@lower_once(static_argnames=("rms", "has_beta", "zero_centered_gamma", "config", "interpret"))
def norm_bwd(dy, x, gamma, mean, rstd, *, rms=False, has_beta=True, zero_centered_gamma=False,
             config: NormConfig = NormConfig(), interpret=None, dres=None):
    """-> (dx [x.shape, x.dtype], dgamma [D] f32, dbeta [D] f32 or None).

    dres (x.shape, any float dtype, optional): a gradient of x from elsewhere (a residual connection's), added to dx
    in fp32 in the same pass, so dx = norm_backward(dy) + dres is rounded once and x's rows are read once."""
    if interpret is None:
        interpret = default_interpret()
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    dy2 = dy.reshape(-1, n_cols).astype(x.dtype) if dy.dtype != x.dtype else dy.reshape(-1, n_cols)
    n_rows = x2.shape[0]
    has_beta = has_beta and not rms
    block_rows, block_cols, num_warps, grid = _bwd_params(n_rows, n_cols, config)
    n_iters = pl.cdiv(pl.cdiv(n_rows, block_rows), grid)
    kernel = functools.partial(
        _bwd_kernel, n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
        grid=grid, n_iters=n_iters, rms=rms, zero_centered=zero_centered_gamma, has_beta=has_beta,
        has_dres=dres is not None)
    args = [x2, gamma, dy2]
    if not rms:
        args.append(mean.reshape(-1).astype(jnp.float32))
    args.append(rstd.reshape(-1).astype(jnp.float32))
    if dres is not None:
        if tuple(dres.shape) != tuple(x.shape):
            raise ValueError(f"norm_bwd: dres has shape {tuple(dres.shape)}; expected x's {tuple(x.shape)}.")
        args.append(dres.reshape(-1, n_cols))
    out_shape = [jax.ShapeDtypeStruct((n_rows, n_cols), x.dtype),
                 jax.ShapeDtypeStruct((grid * n_cols,), jnp.float32)]
    if has_beta:
        out_shape.append(jax.ShapeDtypeStruct((grid * n_cols,), jnp.float32))
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(grid,),
        compiler_params=triton_params(num_warps, config.num_stages),
        interpret=interpret,
        name="te_rmsnorm_bwd" if rms else "te_layernorm_bwd",
    )(*args)
    dx = outs[0].reshape(x.shape)
    dgamma = outs[1].reshape(grid, n_cols).sum(axis=0)
    dbeta = outs[2].reshape(grid, n_cols).sum(axis=0) if has_beta else None
    return dx, dgamma, dbeta


# ----------------------------------------------------------------------------- custom_vjp ops


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _layernorm(x, gamma, beta, epsilon, zero_centered_gamma, config, interpret):
    return norm_fwd(x, gamma, beta, rms=False, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                    config=config, interpret=interpret)[0]


def _layernorm_fwd(x, gamma, beta, epsilon, zero_centered_gamma, config, interpret):
    y, mean, rstd = norm_fwd(x, gamma, beta, rms=False, epsilon=epsilon,
                             zero_centered_gamma=zero_centered_gamma, config=config, interpret=interpret)
    return y, (x, gamma, beta, mean, rstd)


def _layernorm_bwd(epsilon, zero_centered_gamma, config, interpret, res, dy):
    x, gamma, beta, mean, rstd = res
    dx, dg, db = norm_bwd(dy, x, gamma, mean, rstd, rms=False, has_beta=beta is not None,
                          zero_centered_gamma=zero_centered_gamma, config=config, interpret=interpret)
    return dx, dg.astype(gamma.dtype), (None if beta is None else db.astype(beta.dtype))


_layernorm.defvjp(_layernorm_fwd, _layernorm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _rmsnorm(x, gamma, epsilon, zero_centered_gamma, config, interpret):
    return norm_fwd(x, gamma, None, rms=True, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                    config=config, interpret=interpret)[0]


def _rmsnorm_fwd(x, gamma, epsilon, zero_centered_gamma, config, interpret):
    y, _, rstd = norm_fwd(x, gamma, None, rms=True, epsilon=epsilon,
                          zero_centered_gamma=zero_centered_gamma, config=config, interpret=interpret)
    return y, (x, gamma, rstd)


def _rmsnorm_bwd(epsilon, zero_centered_gamma, config, interpret, res, dy):
    x, gamma, rstd = res
    dx, dg, _ = norm_bwd(dy, x, gamma, None, rstd, rms=True, has_beta=False,
                         zero_centered_gamma=zero_centered_gamma, config=config, interpret=interpret)
    return dx, dg.astype(gamma.dtype)


_rmsnorm.defvjp(_rmsnorm_fwd, _rmsnorm_bwd)


def layernorm(x, gamma, beta, *, epsilon=1e-6, zero_centered_gamma=False, config: NormConfig = NormConfig(),
              interpret=None):
    """Differentiable Pallas LayerNorm over the last axis (beta may be None)."""
    if interpret is None:
        interpret = default_interpret()
    return _layernorm(x, gamma, beta, float(epsilon), bool(zero_centered_gamma), config, bool(interpret))


def rmsnorm(x, gamma, *, epsilon=1e-6, zero_centered_gamma=False, config: NormConfig = NormConfig(),
            interpret=None):
    """Differentiable Pallas RMSNorm over the last axis."""
    if interpret is None:
        interpret = default_interpret()
    return _rmsnorm(x, gamma, float(epsilon), bool(zero_centered_gamma), config, bool(interpret))
