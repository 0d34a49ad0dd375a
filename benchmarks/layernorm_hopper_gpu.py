"""An experimental LayerNorm / RMSNorm forward in Pallas Mosaic GPU against the Triton-lowered library
kernel, plain XLA and an XLA read+write ceiling, in one process on the H100; correctness first.

Why: the library's Triton forward (pallas_kernels/norms/norm.py) reloads fp32 gamma and beta in every
program (every 2 rows), and bf16 gamma/beta or dropping beta recover its last ~5%
(results/layernorm_fwd_variants_h100.txt).  This kernel reads gamma/beta once per CTA into registers;
a fixed set of CTAs (ctas_per_sm per SM) streams row blocks through a TMA pipeline; one warpgroup per CTA
normalises one row at a time (two-pass fp32 statistics from registers).  Result
(results/layernorm_hopper_h100.md): 2.42-2.48 TB/s against the Triton kernel's 2.39 in the same runs, for
LayerNorm and RMSNorm alike: the one-warpgroup-per-row structure is the limit now, not gamma/beta.  Not
in the library: +1-4% on one op does not pay for a second, GPU-only kernel the CPU suite cannot run (the
Mosaic GPU interpreter has no predicated copies, which the pipeline uses).

    PYTHONPATH=.:benchmarks python3 benchmarks/layernorm_hopper_gpu.py   # GPU machine (sm90)

Correctness: y, mean and rstd against the fp32 reference (pallas_kernels/norms/reference.py) for
LayerNorm (with beta, plain and zero-centred gamma) and RMSNorm, bf16 and fp32 x, at 32768x4096 and
1024x3072.  Timing: 32768x4096 bf16, fp32 gamma/beta, TB/s = (x read + y written) / time, every variant
timed once per round, ROUNDS interleaved rounds (benchmarks/timing.py).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.norms import norm as pnorm
from pallas_kernels.norms import reference as nref

import timing  # benchmarks/timing.py

_BOX = 256  # TMA box limit per dimension
_VEC = 8  # elements per thread per vector access (128-bit bf16 loads)


@dataclasses.dataclass(frozen=True)
class HopperNormConfig:
    """rows: rows per pipeline block; stages: blocks in flight (shared memory: 2 x stages x rows x D x
    itemsize); ctas: CTAs (None: ctas_per_sm x the SM count)."""

    rows: int = 2
    stages: int = 2
    ctas: int | None = None
    ctas_per_sm: int = 3
    #: y written from registers straight to global memory (no shared-memory staging / TMA store)
    direct_store: bool = False


def hopper_served(n_rows: int, n_cols: int, cfg: HopperNormConfig = HopperNormConfig()) -> str | None:
    """None if layernorm_fwd_hopper serves this shape, else why not."""
    if n_cols % (_BOX * 4):
        return f"hidden size {n_cols} is not a multiple of 1024"
    if n_rows % cfg.rows:
        return f"{n_rows} rows is not a multiple of the block's {cfg.rows} rows"
    return None


def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def norm_fwd_hopper(x, gamma, beta=None, *, rms: bool = False, epsilon: float = 1e-6,
                    zero_centered_gamma: bool = False, config: HopperNormConfig = HopperNormConfig()):
    """x [..., D] -> (y [..., D] x.dtype, mean [...] f32 or None (rms), rstd [...] f32)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    lead, D = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, D)
    N = x2.shape[0]
    why = hopper_served(N, D, config)
    if why is not None:
        raise ValueError(f"norm_fwd_hopper: {why}")
    R, C, W = config.rows, D // _BOX, _BOX
    n_blocks = N // R
    ctas = min(n_blocks, config.ctas or config.ctas_per_sm * _num_sms())
    steps = -(-n_blocks // ctas)
    has_beta = beta is not None and not rms
    layout = plgpu.Layout.WG_STRIDED((C, W), vec_size=_VEC)
    eps = float(epsilon)

    def kernel(*refs):
        x_gmem, g_gmem = refs[:2]
        b_gmem = refs[2] if has_beta else None
        y_gmem, *stat_gmems = refs[2 + int(has_beta):]
        cta = lax.axis_index("cta")

        def load_params(g_smem, b_smem, bar):
            # gamma/beta -> registers once; their shared memory is reused by the pipeline below
            plgpu.copy_gmem_to_smem(g_gmem, g_smem, bar.at[0])
            if has_beta:
                plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar.at[1])
            plgpu.barrier_wait(bar.at[0])
            g = plgpu.load(g_smem, layout=layout)
            if zero_centered_gamma:
                g = g + 1.0
            if not has_beta:
                return g, None
            plgpu.barrier_wait(bar.at[1])
            return g, plgpu.load(b_smem, layout=layout)

        g, b = pl.run_scoped(load_params, plgpu.SMEM((C, W), jnp.float32), plgpu.SMEM((C, W), jnp.float32),
                             plgpu.Barrier(num_barriers=2))

        def block_of(i):
            # CTA c takes blocks c, c + ctas, ...; the last round is clamped to the last block
            # (a CTA with nothing left redoes it and writes the same bytes again)
            return jnp.minimum(i * ctas + cta, n_blocks - 1)

        def block(idx, x_smem, y_smem=None):
            row0 = block_of(idx[0]) * R
            for r in range(R):
                xr = plgpu.load(x_smem.at[r], layout=layout).astype(jnp.float32)
                if rms:
                    xc = xr
                else:
                    mean = xr.sum() * (1.0 / D)
                    xc = xr - mean
                rstd = lax.rsqrt((xc * xc).sum() * (1.0 / D) + eps)
                y = xc * rstd * g
                if has_beta:
                    y = y + b
                if config.direct_store:
                    y_gmem[row0 + r] = y.astype(y_gmem.dtype)
                else:
                    y_smem[r] = y.astype(y_smem.dtype)
                if not rms:
                    stat_gmems[0][row0 + r] = mean
                stat_gmems[-1][row0 + r] = rstd

        row_block = lambda i: (block_of(i), 0, 0)
        pipeline = plgpu.emit_pipeline(
            block, grid=(steps,),
            in_specs=[pl.BlockSpec((R, C, W), row_block)],
            out_specs=[] if config.direct_store else [pl.BlockSpec((R, C, W), row_block)],
            max_concurrent_steps=config.stages)
        pipeline(x_gmem, *([] if config.direct_store else [y_gmem]))

    out_type = [jax.ShapeDtypeStruct((N, C, W), x.dtype)]
    out_type += [jax.ShapeDtypeStruct((N,), jnp.float32)] * (1 if rms else 2)
    args = [x2.reshape(N, C, W), gamma.astype(jnp.float32).reshape(C, W)]
    if has_beta:
        args.append(beta.astype(jnp.float32).reshape(C, W))
    outs = plgpu.kernel(
        kernel,
        out_type=tuple(out_type),
        grid=(ctas,),
        grid_names=("cta",),
    )(*args)
    y = outs[0].reshape(x.shape)
    rstd = outs[-1].reshape(lead)
    mean = None if rms else outs[1].reshape(lead)
    return y, mean, rstd


ROUNDS = int(os.environ.get("ROUNDS", "7"))
SAMPLES, INNER, EPS = 15, 10, 1e-6
CONFIGS = {"rows=2 stages=2 x3/SM (default)": HopperNormConfig(rows=2, stages=2, ctas_per_sm=3),
           "rows=1 stages=4 x3/SM": HopperNormConfig(rows=1, stages=4, ctas_per_sm=3),
           "direct rows=2 stages=4 x3/SM": HopperNormConfig(rows=2, stages=4, ctas_per_sm=3, direct_store=True),
           "direct rows=2 stages=3 x3/SM": HopperNormConfig(rows=2, stages=3, ctas_per_sm=3, direct_store=True),
           "direct rows=4 stages=3 x2/SM": HopperNormConfig(rows=4, stages=3, ctas_per_sm=2, direct_store=True),
           "direct rows=1 stages=6 x3/SM": HopperNormConfig(rows=1, stages=6, ctas_per_sm=3, direct_store=True),
           "direct rows=2 stages=2 x4/SM": HopperNormConfig(rows=2, stages=2, ctas_per_sm=4, direct_store=True)}
DEFAULT = "rows=2 stages=2 x3/SM (default)"


def inputs(m, d, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(k[0], (m, d)) * 1.5 + 0.5).astype(dtype)
    g = 1 + 0.1 * jax.random.normal(k[1], (d,))
    b = 0.1 * jax.random.normal(k[2], (d,))
    return x, g, b


def check(name, cfg, m, d, dtype, rms, zc):
    x, g, b = inputs(m, d, dtype, seed=m + d)
    f = jax.jit(lambda x, g, b: norm_fwd_hopper(x, g, None if rms else b, rms=rms, epsilon=EPS,
                                                zero_centered_gamma=zc, config=cfg))
    y, mean, rstd = f(x, g, b)
    xf = x.astype(jnp.float32)
    if rms:
        ry, rrstd = nref.rmsnorm_fwd(xf, g, epsilon=EPS, zero_centered_gamma=zc)
        rmean = None
    else:
        ry, rmean, rrstd = nref.layernorm_fwd(xf, g, b, epsilon=EPS, zero_centered_gamma=zc)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    ey = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ry) / (1 + jnp.abs(ry))))
    er = float(jnp.max(jnp.abs(rstd / rrstd.reshape(rstd.shape) - 1)))
    em = 0.0 if rms else float(jnp.max(jnp.abs(mean - rmean.reshape(mean.shape))))
    ok = ey < tol and er < 1e-4 and em < 1e-4
    print(f"  {name} {m}x{d} {jnp.dtype(dtype).name} {'rms' if rms else 'layernorm'}"
          f"{' zero-centred' if zc else ''}: y {ey:.1e} mean {em:.1e} rstd {er:.1e}  {'OK' if ok else 'FAIL'}",
          flush=True)
    return ok


def main():
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    print("== correctness (max rel err of y vs fp32 reference; mean abs; rstd rel) ==")
    n_ok = n = 0
    for name, cfg in CONFIGS.items():
        cases = [(32768, 4096, jnp.bfloat16, False, False)]
        if name == DEFAULT:
            cases += [(32768, 4096, jnp.bfloat16, False, True), (32768, 4096, jnp.bfloat16, True, False),
                      (1024, 3072, jnp.float32, False, False), (1000, 3072, jnp.bfloat16, True, True),
                      (998, 8192, jnp.bfloat16, False, False)]
        for m, d, dt, rms, zc in cases:
            try:
                n_ok += check(name, cfg, m, d, dt, rms, zc)
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {m}x{d}: ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
            n += 1
    print(f"correctness: {n_ok}/{n} OK", flush=True)

    m, d = 32768, 4096
    x, g, b = inputs(m, d, jnp.bfloat16)
    nbytes = 2 * x.size * x.dtype.itemsize
    variants = {
        "XLA bf16 negation (read+write ceiling)": jax.jit(lambda x, g, b: -x),
        "XLA layernorm (plain jnp, fp32 stats)": jax.jit(
            lambda x, g, b: nref.layernorm(x.astype(jnp.float32), g, b).astype(x.dtype)),
        "Triton library layernorm": jax.jit(lambda x, g, b: pnorm.norm_fwd(x, g, b, epsilon=EPS)),
        "Triton library rmsnorm": jax.jit(lambda x, g, b: pnorm.norm_fwd(x, g, rms=True, epsilon=EPS)),
        "Mosaic rmsnorm (default config)": jax.jit(lambda x, g, b: norm_fwd_hopper(x, g, rms=True, epsilon=EPS)),
    }
    for name, cfg in CONFIGS.items():
        variants[f"Mosaic layernorm {name}"] = jax.jit(
            lambda x, g, b, cfg=cfg: norm_fwd_hopper(x, g, b, epsilon=EPS, config=cfg))
    broken = []
    for name, f in variants.items():
        try:
            jax.block_until_ready(f(x, g, b))
        except Exception as e:  # noqa: BLE001
            print(f"{name}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            broken.append(name)
    for name in broken:
        variants.pop(name)
    timing.bandwidth_rounds(variants, (x, g, b), nbytes, rounds=ROUNDS, samples=SAMPLES, inner=INNER,
                            title=f"Norm forward, {m}x{d} bf16 x, fp32 gamma/beta")
    return 0 if n_ok == n else 1


if __name__ == "__main__":
    sys.exit(main())
