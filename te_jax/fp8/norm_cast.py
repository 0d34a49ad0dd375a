"""The norm in front of an FP8 GEMM, fused into the input's cast (TransformerEngine's layernorm + quantize).

Forward, x [M, D] in the compute dtype:
    stats  = mean (LayerNorm) and rstd [M], fp32      (one XLA reduction over x)
    x_q [M, D], x_qT [D, M], amax = norm_cast_transpose(x, stats, gamma, beta, scale)   (one Pallas pass)
or, under delayed scaling (the default; TE_JAX_FP8_NORM_STATS=xla turns it off: fused.norm_stats_in_kernel), both
in one kernel (`stats_and_cast`: norm_stats_cast_transpose; its sums run in another order than XLA's).
so the norm's output never goes to memory: the unfused path writes it in the compute dtype, then reads it again
to cast (and, under current scaling, once more for its amax). The values are the unfused path's exactly: the
kernel applies the statistics in the reference's order and rounds to the compute dtype before the amax and cast
(pallas_kernels/norms/reference.apply_stats). Current scaling takes the amax from an XLA reduction of that same
rounded output (recomputed from x and the statistics, not stored).
Backward, dln [M, D] (the GEMM's dgrad): dx, dgamma, dbeta by the norm's backend (te_jax.normalization: "pallas"
runs its backward kernel on the saved statistics, "xla" autodiff of the reference), as the unfused path would.
With a skip connection's gradient dres (the callers' `skip`: x also feeds a residual add), dx = the norm's backward
+ dres, in the Pallas kernel's one pass where NormSpec.skip_kernel (read dln, x and dres once, write dx), else XLA
adds it to its own backward.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_cast import norm_cast_transpose, norm_stats_cast_transpose
from pallas_kernels.norms import norm as _pallas_norm
from pallas_kernels.norms import reference as _ref
from te_jax import normalization as _norm
from te_jax.fp8.fused import launch_options, norm_stats_in_kernel


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """The norm in front of the GEMM: layernorm_type "layernorm" | "rmsnorm", epsilon, zero_centered_gamma, the
    backend its backward runs on ("xla" or "pallas", as te_jax.normalization chose), and skip_kernel: whether a
    backward that also adds a skip connection's gradient runs the Pallas kernel's one pass (skip_backend_choice)."""

    layernorm_type: str
    epsilon: float
    zero_centered_gamma: bool
    backend: str
    skip_kernel: bool = False


def norm_spec(x, gamma, beta, *, layernorm_type, epsilon, zero_centered_gamma, backend) -> NormSpec:
    """The NormSpec for te_jax.normalization.norm(x, gamma, beta, ...) (validates as it does)."""
    choice = _norm.explain_norm_backend(x, gamma, None if layernorm_type == "rmsnorm" else beta,
                                        layernorm_type=layernorm_type, backend=backend)
    if choice.error:
        raise ValueError(choice.error)
    _norm.check_epsilon(layernorm_type, epsilon)
    return NormSpec(layernorm_type, float(epsilon), bool(zero_centered_gamma), choice.selected,
                    skip_backend_choice(choice))


def skip_backend_choice(choice) -> bool:
    """Whether the norm's backward with a skip connection's gradient runs the Pallas kernel (one pass): where the
    norm's backend is pallas, or where it was chosen automatically on a GPU, the kernel serves x and
    tuning.NORM_BWD_WITH_SKIP says pallas. A backend named by argument or environment is kept (xla stays xla)."""
    from te_jax.backends.tuning import NORM_BWD_WITH_SKIP

    if choice.selected == "pallas":
        return True
    return (choice.source == "auto" and choice.reasons.get("pallas") is None and jax.default_backend() == "gpu"
            and NORM_BWD_WITH_SKIP.value == "pallas")


def describe_skip(spec) -> str:
    """For te_jax.fp8.explain: where the skip connection's gradient joins the norm's backward."""
    return ("the residual's gradient added in the norm's backward kernel (one pass)" if spec.skip_kernel else
            "the residual's gradient added to the norm's XLA backward")


def _rms(spec):
    return spec.layernorm_type == "rmsnorm"


def stats(x, gamma, beta, spec):
    """(mean [M] or None, rstd [M]) fp32, of x [M, D]."""
    if _rms(spec):
        return None, _ref.rmsnorm_fwd(x, gamma, epsilon=spec.epsilon)[1]
    _, mean, rstd = _ref.layernorm_fwd(x, gamma, beta, epsilon=spec.epsilon)
    return mean, rstd


def output(x, gamma, beta, st, spec):
    """The norm's output [M, D] in x's dtype, from the statistics (for current scaling's amax; XLA fuses it into
    the reduction that reads it, so it is not stored)."""
    return _ref.apply_stats(x, gamma, None if _rms(spec) else beta, st[0], st[1],
                            zero_centered_gamma=spec.zero_centered_gamma)


def cast(x, gamma, beta, st, scale, spec, out_dtype, **kernel_options):
    """(q [M, D], qT [D, M], amax) of the norm's output, cast with `scale`, in one pass over x."""
    return norm_cast_transpose(x, st[0], st[1], gamma, None if _rms(spec) else beta,
                               jnp.asarray(scale, jnp.float32).reshape(()), out_dtype=out_dtype,
                               zero_centered_gamma=spec.zero_centered_gamma, **kernel_options)


def stats_block(n: int) -> int | None:
    """The column chunk stats_and_cast walks a row of n features in (a power of two up to 256 dividing n), or None
    when no chunk of at least 16 divides it (then the statistics come from XLA and `cast`)."""
    for bn in (256, 128, 64, 32, 16):
        if n % bn == 0:
            return bn
    return None


def stats_in_kernel(x, spec, delayed: bool) -> bool:
    """Whether the norm `spec` (None: no norm) in front of x [M, D] runs `stats_and_cast` (delayed scaling,
    fused.norm_stats_in_kernel, and a stats_block for D) rather than `stats` then `cast`."""
    return spec is not None and _stats_inside(x.shape[-1], delayed)


def _stats_inside(d: int, delayed: bool) -> bool:
    return delayed and norm_stats_in_kernel() and stats_block(d) is not None


def describe_stats(recipe, d: int) -> str:
    """For te_jax.fp8.explain: where a norm in front of an FP8 GEMM over D = d features gets its row statistics."""
    from te_jax.fp8.recipe import DelayedScaling

    inside = _stats_inside(d, isinstance(recipe, DelayedScaling))
    return ("its row statistics computed in the same kernel (TE_JAX_FP8_NORM_STATS)" if inside else
            "its row statistics from an XLA reduction first")


def stats_and_cast(x, gamma, beta, scale, spec, out_dtype, interpret=None):
    """(q [M, D], qT [D, M], amax, (mean or None, rstd)): the norm's statistics and its output cast with `scale`, in
    one kernel that reads x from memory once (norm_stats_cast_transpose); x's D must have a stats_block. Launch:
    tuning.FP8_CAST_LAUNCH["norm_stats"] on a GPU; its block_n (a block_n >= D: one chunk spans the row, read once
    and kept in registers) where that chunk is a power of two dividing D, else stats_block(D)."""
    opts = launch_options("norm_stats", interpret)
    d = x.shape[-1]
    chunk = min(opts.pop("block_n", None) or stats_block(d), d)
    block_n = chunk if d % chunk == 0 and chunk & (chunk - 1) == 0 else stats_block(d)
    q, qt, am, mean, rstd = norm_stats_cast_transpose(
        x, gamma, None if _rms(spec) else beta, jnp.asarray(scale, jnp.float32).reshape(()), rms=_rms(spec),
        epsilon=spec.epsilon, out_dtype=out_dtype, zero_centered_gamma=spec.zero_centered_gamma, interpret=interpret,
        block_n=block_n, **opts)
    return q, qt, am, (mean, rstd)


def backward(dln, x, gamma, beta, st, spec, interpret=None, dres=None):
    """(dx [M, D] x's dtype, dgamma gamma's dtype, dbeta beta's dtype or None) for the output cotangent dln.
    dbeta is None exactly when beta is None (an RMSNorm given a beta gets zeros: it does not use it).
    dres [M, D] (optional): a skip connection's gradient of x, added to dx (in the Pallas kernel's pass where
    spec.skip_kernel or spec.backend is pallas)."""
    if _rms(spec) and beta is not None:
        dx, dg, _ = backward(dln, x, gamma, None, st, spec, interpret, dres)
        return dx, dg, jnp.zeros_like(beta)
    rms = _rms(spec)
    dln = dln.astype(x.dtype)
    if spec.backend == "pallas" or (dres is not None and spec.skip_kernel):
        dx, dg, db = _pallas_norm.norm_bwd(dln, x, gamma, st[0], st[1], rms=rms, has_beta=beta is not None,
                                           zero_centered_gamma=spec.zero_centered_gamma, interpret=interpret,
                                           dres=dres)
        return dx, dg.astype(gamma.dtype), (None if beta is None else db.astype(beta.dtype))
    if dres is not None:
        dx, dg, db = backward(dln, x, gamma, beta, st, spec, interpret)
        return (dx.astype(jnp.float32) + dres.astype(jnp.float32)).astype(x.dtype), dg, db
    kw = dict(epsilon=spec.epsilon, zero_centered_gamma=spec.zero_centered_gamma)
    if rms:
        dx, dg = jax.vjp(lambda x, g: _ref.rmsnorm(x, g, **kw), x, gamma)[1](dln)
        return dx, dg, None
    if beta is None:
        dx, dg = jax.vjp(lambda x, g: _ref.layernorm(x, g, None, **kw), x, gamma)[1](dln)
        return dx, dg, None
    return jax.vjp(lambda x, g, b: _ref.layernorm(x, g, b, **kw), x, gamma, beta)[1](dln)


__all__ = ["NormSpec", "norm_spec", "skip_backend_choice", "describe_skip", "stats", "output", "cast", "stats_block",
           "stats_in_kernel", "stats_and_cast", "describe_stats", "backward"]
