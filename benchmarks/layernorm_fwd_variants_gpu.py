"""What limits the Pallas LayerNorm forward? Experimental kernel variants, timed in interleaved rounds.

    PYTHONPATH=.:benchmarks python3 benchmarks/layernorm_fwd_variants_gpu.py            # GPU machine
    PYTHONPATH=.:benchmarks BENCH_SMALL=1 python3 benchmarks/layernorm_fwd_variants_gpu.py   # CPU, interpret mode
    VARIANTS=all (run 1 sweep), run2 (run 2 split) or run3 (live registers) instead of the default (run 4: cache hints)

The library's LayerNorm forward (pallas_kernels/norms/norm.py) reaches ~2.4 TB/s on 32768x4096 bf16 on the
H100, its RMSNorm ~2.6 (= an XLA elementwise read+write). These variants each drop or change one piece of
the LayerNorm's work, so the table says which piece costs the bandwidth. They live here, not in the library;
a variant that wins is ported to the library kernel.
  lib        the library's math with gamma/beta loaded right after x (one-pass shifted statistics, beta,
             mean and rstd stored); run 2: 2.10 TB/s vs the library's 2.42 (gamma/beta after the statistics)
  fma        y = fma(fma(xs, rstd, -m1*rstd), g, b): 2 ops per element after the statistics
  unshifted  one-pass E[x^2] - E[x]^2 without the shift (less exact when |mean| >> std; timing only)
  blockspec  the same math with BlockSpec-tiled refs instead of explicit masked loads (no row mask)
  no_extras  no beta, no mean/rstd stores (not a LayerNorm API; timing only)
  no_beta    no beta; mean/rstd stored (splits no_extras: which of the two costs?)
  no_stores  beta added; no mean/rstd stores
  g2d        gamma/beta passed as (1, D) and loaded with a 2D index (x's layout, no broadcast)
  gfull      gamma/beta loaded once per block row, (block_rows, D): exactly x's layout
  lib bf16 gamma/beta   the lib variant reading gamma and beta in bf16 (half the per-program L2 bytes)
  rms        RMSNorm-shaped work (one reduction), for reference
Run 2 (VARIANTS=run2): bf16 gamma/beta 2.50, no_beta 2.52, no_stores no gain: load placement and register
pressure (fewer resident programs, fewer bytes in flight) look like the limit. Run 3, the default: full
LayerNorms (fp32 statistics and gamma/beta, mean and rstd stored) that keep less live per thread:
  late       the library kernel's order exactly: x, shift, statistics, then gamma, multiply, then beta, add
             (without the library's all-true column mask, like every variant here: late vs library shows it)
  bf16hold   late, x held in bf16 and converted to fp32 in the statistics and again in the epilogue (Triton's
             CSE may merge the two conversions, and then it compiles as late: bf16bits cannot be merged)
  bf16bits   bf16hold with the epilogue's conversion done by integer ops (bits << 16), not an extf
  chunked    statistics from the whole tile, then the epilogue in NCHUNK column chunks, each re-loading its
             x chunk (an L2/L1 hit) and gamma/beta chunk: nothing of x's tile lives past the reductions
  stream     chunked, and the statistics too accumulated chunk by chunk: at most one chunk of x is live
(chunked with a bf16-held x is no variant: x's tile feeds only the statistics there, the same jaxpr.)
Run 3: none beats late (= the library). Reading fp32 gamma+beta (32 KB per 16 KB of x) is the cost. Run 4, the
default (VARIANTS=run3 for run 3's set):
  evict      late with cache hints: x loads and y stores evict_first, gamma/beta loads evict_last
  evict_ca   evict, and gamma/beta loaded with cache_modifier .ca (cached in L1: every program on an SM
             reads the same gamma/beta). jax 0.11.2's Triton lowering raises KeyError('.ca') for it (its
             _STR_TO_CACHE_MODIFIER is keyed by the enum's str, not '.ca'): reported as FAILED, not timed.
Run 4: evict 2.42 vs late 2.44-2.46 (no gain).
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
NCHUNK = 4
LEAN = ("late", "bf16hold", "bf16bits", "chunked", "stream", "evict", "evict_ca")  # runs 3-4: _lean_kernel


def _kernel(x_ref, g_ref, b_ref, y_ref, mean_ref, rstd_ref, *, variant, block_rows, n_cols, n_rows):
    if variant == "blockspec":
        x = x_ref[...].astype(jnp.float32)
        g = g_ref[...].astype(jnp.float32)[None, :]
        b = b_ref[...].astype(jnp.float32)[None, :]
    else:
        rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
        cols = jnp.arange(n_cols)
        rmask = rows < n_rows
        x = pltriton.load(x_ref.at[rows[:, None], cols[None, :]], mask=rmask[:, None], other=0.0)
        x = x.astype(jnp.float32)
        if variant in ("g2d", "gfull"):
            # gamma/beta passed as (1, n_cols): loaded straight into x's 2D layout (no 1D slice
            # layout broadcast); gfull loads them once per row of the block (same layout as x)
            prow = jnp.zeros((1 if variant == "g2d" else block_rows,), jnp.int32)
            g = pltriton.load(g_ref.at[prow[:, None], cols[None, :]]).astype(jnp.float32)
            b = pltriton.load(b_ref.at[prow[:, None], cols[None, :]]).astype(jnp.float32)
        else:
            g = pltriton.load(g_ref.at[cols]).astype(jnp.float32)[None, :]
            b = pltriton.load(b_ref.at[cols]).astype(jnp.float32)[None, :]
    if variant == "rms":
        rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / n_cols + EPS)
        y = x * rstd[:, None] * g
        mean = rstd
    elif variant == "unshifted":
        mean = jnp.sum(x, axis=1) / n_cols
        var = jnp.maximum(jnp.sum(x * x, axis=1) / n_cols - mean * mean, 0.0)
        rstd = lax.rsqrt(var + EPS)
        y = (x * rstd[:, None] - (mean * rstd)[:, None]) * g + b
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
            y = (xs * rstd[:, None] + (-m1 * rstd)[:, None]) * g + b
        elif variant in ("no_extras", "no_beta"):
            y = (xs - m1[:, None]) * rstd[:, None] * g
        else:
            y = (xs - m1[:, None]) * rstd[:, None] * g + b
    if variant == "blockspec":
        y_ref[...] = y.astype(y_ref.dtype)
        mean_ref[...] = mean
        rstd_ref[...] = rstd
        return
    pltriton.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=rmask[:, None])
    if variant not in ("no_extras", "no_stores"):
        pltriton.store(mean_ref.at[rows], mean, mask=rmask)
        pltriton.store(rstd_ref.at[rows], rstd, mask=rmask)


def _bf16_bits_to_f32(x):
    """bf16 -> fp32 as (bits << 16) reinterpreted: integer ops the compiler cannot CSE with an extf."""
    u = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(u << 16, jnp.float32)


def _lean_kernel(x_ref, g_ref, b_ref, y_ref, mean_ref, rstd_ref, *, variant, block_rows, n_cols, n_rows):
    """Run 3's variants (see the module docstring): the library's math and order, less live per thread."""
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    rmask = rows < n_rows

    hints = variant in ("evict", "evict_ca")  # run 4: x streams through the caches, gamma/beta stay
    x_kw = dict(eviction_policy="evict_first") if hints else {}
    p_kw = dict(eviction_policy="evict_last") if hints else {}
    if variant == "evict_ca":
        p_kw["cache_modifier"] = ".ca"

    def load_x(cols):  # x's (block_rows, len(cols)) tile in its input dtype
        return pltriton.load(x_ref.at[rows[:, None], cols[None, :]], mask=rmask[:, None], other=0.0,
                             **x_kw)

    width = n_cols // NCHUNK
    assert width * NCHUNK == n_cols and width & (width - 1) == 0, (n_cols, NCHUNK)
    chunks = [c * width + jnp.arange(width) for c in range(NCHUNK)]
    cols = jnp.arange(n_cols)
    shift = f32(pltriton.load(x_ref.at[rows, 0], mask=rmask, other=0.0))
    if variant == "stream":
        s1 = s2 = jnp.zeros((block_rows,), jnp.float32)
        for cc in chunks:
            xs = f32(load_x(cc)) - shift[:, None]
            s1, s2 = s1 + jnp.sum(xs, axis=1), s2 + jnp.sum(xs * xs, axis=1)
    else:
        x = load_x(cols)
        if variant not in ("bf16hold", "bf16bits"):
            x = f32(x)
        xs = f32(x) - shift[:, None]  # in bf16hold/bf16bits: the statistics' own conversion
        s1, s2 = jnp.sum(xs, axis=1), jnp.sum(xs * xs, axis=1)
    m1 = s1 / n_cols
    var = jnp.maximum(s2 / n_cols - m1 * m1, 0.0)
    rstd = lax.rsqrt(var + EPS)

    def epilogue(cc, xc):  # y for columns cc from xc = x - shift - m1 (fp32): gamma, then beta, loaded late
        y = xc * rstd[:, None] * f32(pltriton.load(g_ref.at[cc], **p_kw))[None, :]
        y = y + f32(pltriton.load(b_ref.at[cc], **p_kw))[None, :]
        pltriton.store(y_ref.at[rows[:, None], cc[None, :]], y.astype(y_ref.dtype), mask=rmask[:, None],
                       **x_kw)

    if variant in ("chunked", "stream"):
        for cc in chunks:
            epilogue(cc, (f32(load_x(cc)) - shift[:, None]) - m1[:, None])
    else:
        xe = _bf16_bits_to_f32(x) if variant == "bf16bits" else f32(x)  # bf16hold: a second conversion
        epilogue(cols, (xe - shift[:, None]) - m1[:, None])
    pltriton.store(mean_ref.at[rows], shift + m1, mask=rmask)
    pltriton.store(rstd_ref.at[rows], rstd, mask=rmask)


def variant_fn(variant, block_rows=2, num_warps=8, stats=False):
    """jitted (x, g, b) -> y, or (y, mean, rstd) with stats=True."""
    def f(x, g, b):
        n_rows, n_cols = x.shape
        kernel = functools.partial(_lean_kernel if variant in LEAN else _kernel, variant=variant,
                                   block_rows=block_rows, n_cols=n_cols, n_rows=n_rows)
        out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((n_rows,), jnp.float32),
                     jax.ShapeDtypeStruct((n_rows,), jnp.float32)]
        kw = {}
        if variant == "blockspec":
            row_block = pl.BlockSpec((block_rows, n_cols), lambda i: (i, 0))
            vec = pl.BlockSpec((n_cols,), lambda i: (0,))
            stat = pl.BlockSpec((block_rows,), lambda i: (i,))
            kw = dict(in_specs=[row_block, vec, vec], out_specs=[row_block, stat, stat])
        if variant in ("g2d", "gfull"):
            g, b = g.reshape(1, -1), b.reshape(1, -1)
        outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(pl.cdiv(n_rows, block_rows),),
                              compiler_params=triton_params(num_warps, 1), interpret=SMALL,
                              name=f"ln_fwd_{variant}", **kw)(x, g, b)
        return outs if stats else outs[0]
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
    which = os.environ.get("VARIANTS", "run4")
    g16, b16 = g.astype(jnp.bfloat16), b.astype(jnp.bfloat16)

    def add(v, br, nw):
        if v == "lib bf16 gamma/beta":
            lib = variant_fn("lib", br, nw)
            variants[f"{v} rows={br} warps={nw}"] = jax.jit(lambda x, g, b: lib(x, g16, b16))
        else:
            variants[f"{v} rows={br} warps={nw}"] = variant_fn(v, br, nw)

    if which == "all":
        for v in ("lib", "fma", "unshifted", "blockspec", "no_extras", "rms"):
            for br, nw in ((2, 8), (2, 4), (1, 4)):
                add(v, br, nw)
    elif which == "run2":
        for br, nw in ((2, 8), (2, 4)):
            for v in ("lib", "g2d", "gfull", "no_beta", "no_stores", "no_extras", "rms",
                      "lib bf16 gamma/beta"):
                add(v, br, nw)
    elif which == "run3":
        for br, nw in ((2, 8), (2, 4)):
            for v in LEAN + ("lib bf16 gamma/beta", "no_extras"):
                add(v, br, nw)
        for v in ("bf16hold", "bf16bits", "chunked", "stream"):
            add(v, 4, 8)
    elif which == "run4":
        for br, nw in ((2, 8), (2, 4)):
            for v in ("late", "evict", "evict_ca", "lib bf16 gamma/beta", "no_extras"):
                add(v, br, nw)
    else:
        raise SystemExit(f"VARIANTS={which!r}: expected all, run2, run3 or run4 (the default)")

    ref, ref_mean, ref_rstd = nref.layernorm_fwd(x.astype(jnp.float32), g, b, epsilon=EPS)
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
        r = (ref_rms if name.startswith("rms") else ref_nb if name.startswith(("no_extras", "no_beta"))
             else ref)
        err = float(jnp.max(jnp.abs(y - r)))
        print(f"{name}: max abs err {err:.2e}{'  <-- WRONG' if err > 0.05 else ''}", flush=True)
    for v in (LEAN[:5] if which == "run3" else ("late", "evict", "evict_ca") if which == "run4" else ()):  # run 3's variants are full LayerNorms: check mean and rstd too
        if f"{v} rows=2 warps=8" in broken:
            continue
        _, mean, rstd = variant_fn(v, 2, 8, stats=True)(x, g, b)
        err = max(float(jnp.max(jnp.abs(mean - ref_mean))), float(jnp.max(jnp.abs(rstd / ref_rstd - 1))))
        print(f"{v} rows=2 warps=8: mean abs / rstd rel err {err:.2e}{'  <-- WRONG' if err > 1e-4 else ''}",
              flush=True)
    for name in broken:
        variants.pop(name)

    timing.bandwidth_rounds(variants, (x, g, b), nbytes, rounds=ROUNDS, samples=SAMPLES, inner=INNER,
                            title=f"LayerNorm forward variants, {m}x{d} bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
