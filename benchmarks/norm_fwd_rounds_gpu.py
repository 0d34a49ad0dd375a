"""Norm forward bandwidth on 32768x4096 bf16, measured in interleaved rounds (issue #5's 2.64 TB/s target).

    PYTHONPATH=. python3 benchmarks/norm_fwd_rounds_gpu.py          # on the GPU machine
    PYTHONPATH=. BENCH_SMALL=1 python3 benchmarks/norm_fwd_rounds_gpu.py   # CPU smoke test (interpret mode)

Single measurements of the same kernel moved by 4% between runs (2.44 vs 2.54 TB/s), so every variant is
timed once per round, ROUNDS rounds in turn, and the table gives the median over rounds with min-max.
Variants: a plain XLA elementwise op (bf16 negation: the read+write ceiling), XLA LayerNorm, Pallas
RMSNorm, Pallas LayerNorm (one-pass and two-pass statistics, and a launch sweep).
TB/s = (bytes of x read + bytes of y written) / time.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.norms import norm as pnorm
from pallas_kernels.norms import reference as nref

import timing  # benchmarks/timing.py
from norm_inputs import norm_inputs  # benchmarks/norm_inputs.py

SMALL = os.environ.get("BENCH_SMALL") == "1"
ROUNDS = 2 if SMALL else int(os.environ.get("ROUNDS", "7"))
SAMPLES = 2 if SMALL else 15
INNER = 1 if SMALL else 10


def main():
    m, d = (64, 512) if SMALL else (32768, 4096)
    x, g, b, _ = norm_inputs(m, d, seed=0)
    nbytes = 2 * x.size * x.dtype.itemsize

    ln = lambda cfg: jax.jit(lambda x, g, b: pnorm.layernorm(x, g, b, config=cfg))  # noqa: E731
    variants = {
        "XLA bf16 negation (read+write ceiling)": jax.jit(lambda x, g, b: -x),
        "XLA layernorm": jax.jit(lambda x, g, b: nref.layernorm(x, g, b)),
        "Pallas rmsnorm (default)": jax.jit(lambda x, g, b: pnorm.rmsnorm(x, g)),
        "Pallas layernorm (default: one-pass)": ln(pnorm.NormConfig()),
        "Pallas layernorm two-pass": ln(pnorm.NormConfig(fwd_stats="two_pass")),
    }
    for br, nw in [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]:
        variants[f"Pallas layernorm rows={br} warps={nw}"] = ln(pnorm.NormConfig(block_rows=br, num_warps=nw))

    ref = nref.layernorm(x.astype(jnp.float32), g, b)
    for name, f in variants.items():
        if "layernorm" in name and "Pallas" in name:
            err = float(jnp.max(jnp.abs(f(x, g, b).astype(jnp.float32) - ref)))
            print(f"{name}: max abs err vs fp32 reference {err:.2e}", flush=True)
            assert err < 0.05, name

    timing.bandwidth_rounds(variants, (x, g, b), nbytes, rounds=ROUNDS, samples=SAMPLES, inner=INNER,
                            title=f"Norm forward, {m}x{d} bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
