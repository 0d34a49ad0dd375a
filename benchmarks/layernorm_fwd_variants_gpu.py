"""What limits the Pallas LayerNorm forward? Experimental kernel variants, timed in interleaved rounds.

    PYTHONPATH=.:benchmarks python3 benchmarks/layernorm_fwd_variants_gpu.py            # GPU machine
    PYTHONPATH=.:benchmarks BENCH_SMALL=1 python3 benchmarks/layernorm_fwd_variants_gpu.py   # CPU, interpret mode

The library's LayerNorm forward (pallas_kernels/norms/norm.py) reaches ~2.5 TB/s on 32768x4096 bf16 on the
H100, its RMSNorm ~2.75 (= an XLA elementwise read+write). These variants each drop or change one piece of
the LayerNorm's work, so the table says which piece costs the bandwidth. They live here, not in the library;
a variant that wins is ported to the library kernel.
  lib        the library kernel (one-pass shifted statistics, beta, mean and rstd stored)
  fma        y = fma(fma(xs, rstd, -m1*rstd), g, b): 2 ops per element after the statistics
  unshifted  one-pass E[x^2] - E[x]^2 without the shift (less exact when |mean| >> std; timing only)
  blockspec  the same math with BlockSpec-tiled refs instead of explicit masked loads (no row mask)
  no_extras  no beta, no mean/rstd stores (not a LayerNorm API; timing only)
  rms        RMSNorm-shaped work (one reduction), for reference
"""
from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.norms import norm as pnorm
from pallas_kernels.norms import reference as nref
from te_jax._compat import pl, pltriton, triton_params

import timing  # benchmarks/timing.py

SMALL = os.environ.get("BENCH_SMALL") == "1"
ROUNDS = 2 if SMALL else int(os.environ.get("ROUNDS", "7"))
SAMPLES = 2 if SMALL else 15
INNER = 1 if SMALL else 10
EPS = 1e-6


def _kernel(x_ref, g_ref, b_ref, y_ref, mean_ref, rstd_ref, *, variant, block_rows, n_cols, n_rows):
    if variant == "blockspec":
        x = x_ref[...].astype(jnp.float32)
        g = g_ref[...].astype(jnp.float32)
        b = b_ref[...].astype(jnp.float32)
    else:
        rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
        cols = jnp.arange(n_cols)
        rmask = rows < n_rows
        x = pltriton.load(x_ref.at[rows[:, None], cols[None, :]], mask=rmask[:, None], other=0.0)
        x = x.astype(jnp.float32)
        g = pltriton.load(g_ref.at[cols]).astype(jnp.float32)
        b = pltriton.load(b_ref.at[cols]).astype(jnp.float32)
    if variant == "rms":
        rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / n_cols + EPS)
        y = x * rstd[:, None] * g[None, :]
        mean = rstd
    elif variant == "unshifted":
        mean = jnp.sum(x, axis=1) / n_cols
        var = jnp.maximum(jnp.sum(x * x, axis=1) / n_cols - mean * mean, 0.0)
        rstd = lax.rsqrt(var + EPS)
        y = (x * rstd[:, None] - (mean * rstd)[:, None]) * g[None, :] + b[None, :]
    else:
        if variant == "blockspec":
            shift = x[:, 0]  # a register slice
        else:
            shift = pltriton.load(x_ref.at[rows, 0], mask=rmask, other=0.0).astype(jnp.float32)
        xs = x - shift[:, None]
        m1 = jnp.sum(xs, axis=1) / n_cols
        var = jnp.maximum(jnp.sum(xs * xs, axis=1) / n_cols - m1 * m1, 0.0)
        rstd = lax.rsqrt(var + EPS)
        mean = shift + m1
        if variant == "fma":
            y = (xs * rstd[:, None] + (-m1 * rstd)[:, None]) * g[None, :] + b[None, :]
        elif variant == "no_extras":
            y = (xs - m1[:, None]) * rstd[:, None] * g[None, :]
        else:
            y = (xs - m1[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
    if variant == "blockspec":
        y_ref[...] = y.astype(y_ref.dtype)
        mean_ref[...] = mean
        rstd_ref[...] = rstd
        return
    pltriton.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=rmask[:, None])
    if variant != "no_extras":
        pltriton.store(mean_ref.at[rows], mean, mask=rmask)
        pltriton.store(rstd_ref.at[rows], rstd, mask=rmask)


def variant_fn(variant, block_rows=2, num_warps=8):
    def f(x, g, b):
        n_rows, n_cols = x.shape
        kernel = functools.partial(_kernel, variant=variant, block_rows=block_rows, n_cols=n_cols, n_rows=n_rows)
        out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((n_rows,), jnp.float32),
                     jax.ShapeDtypeStruct((n_rows,), jnp.float32)]
        kw = {}
        if variant == "blockspec":
            row_block = pl.BlockSpec((block_rows, n_cols), lambda i: (i, 0))
            vec = pl.BlockSpec((n_cols,), lambda i: (0,))
            stat = pl.BlockSpec((block_rows,), lambda i: (i,))
            kw = dict(in_specs=[row_block, vec, vec], out_specs=[row_block, stat, stat])
        return pl.pallas_call(kernel, out_shape=out_shape, grid=(pl.cdiv(n_rows, block_rows),),
                              compiler_params=triton_params(num_warps, 1), interpret=SMALL,
                              name=f"ln_fwd_{variant}", **kw)(x, g, b)[0]
    return jax.jit(f)


def main():
    m, d = (64, 512) if SMALL else (32768, 4096)
    k = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(k[0], (m, d)) + 0.5).astype(jnp.bfloat16)
    g = 1 + 0.1 * jax.random.normal(k[1], (d,))
    b = 0.1 * jax.random.normal(k[2], (d,))
    nbytes = 2 * x.size * x.dtype.itemsize
    variants = {"XLA bf16 negation (read+write ceiling)": jax.jit(lambda x, g, b: -x),
                "library layernorm (default)": jax.jit(lambda x, g, b: pnorm.layernorm(x, g, b))}
    for v in ("lib", "fma", "unshifted", "blockspec", "no_extras", "rms"):
        for br, nw in ((2, 8), (2, 4), (1, 4)):
            variants[f"{v} rows={br} warps={nw}"] = variant_fn(v, br, nw)

    ref = nref.layernorm(x.astype(jnp.float32), g, b)
    ref_nb = nref.layernorm(x.astype(jnp.float32), g, jnp.zeros_like(b))
    ref_rms = nref.rmsnorm(x.astype(jnp.float32), g)
    broken = set()
    for name, f in variants.items():
        if name.startswith("XLA"):
            continue
        try:
            y = f(x, g, b).astype(jnp.float32)
        except Exception as e:  # noqa: BLE001  (a variant Pallas does not lower: reported, not timed)
            print(f"{name}: FAILED to run: {type(e).__name__}: {str(e)[:300]}", flush=True)
            broken.add(name)
            continue
        r = ref_rms if name.startswith("rms") else ref_nb if name.startswith("no_extras") else ref
        err = float(jnp.max(jnp.abs(y - r)))
        print(f"{name}: max abs err {err:.2e}{'  <-- WRONG' if err > 0.05 else ''}", flush=True)
    for name in broken:
        variants.pop(name)

    timing.bandwidth_rounds(variants, (x, g, b), nbytes, rounds=ROUNDS, samples=SAMPLES, inner=INNER,
                            title=f"LayerNorm forward variants, {m}x{d} bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
