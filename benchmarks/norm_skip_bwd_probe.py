"""GPU probe: an RMSNorm backward that also adds the residual connection's gradient (the FP8 layer's two norm
backwards), three ways, at the Llama layer's shape (8192 tokens x 4096, bf16):

  xla two passes        jax.vjp of the reference rmsnorm, plus dres: what te_jax/fp8/norm_cast.backward runs today
                        ("xla" norm backend; XLA fuses the add into its second pass)
  pallas + xla add      pallas_kernels.norms.norm_bwd, then dx + dres in XLA
  pallas, dres fused    norm_bwd(..., dres=dres): one pass (reads dy, x, dres; writes dx)

    PYTHONPATH=. python3 -m benchmarks.norm_skip_bwd_probe [--rounds 3] [--rows 8192] [--cols 4096]

Prints kernel time (profiler, per call) and host time, interleaved rounds, and each variant's dx / dgamma against
an fp32 reference.
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from benchmarks import device_time, timing
from pallas_kernels.norms import norm as pn
from pallas_kernels.norms import reference as ref

BF = jnp.bfloat16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    args = ap.parse_args()
    m, d = args.rows, args.cols
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (m, d), jnp.float32).astype(BF)
    g = (1 + 0.1 * jax.random.normal(k[1], (d,), jnp.float32)).astype(BF)
    dy = jax.random.normal(k[2], (m, d), jnp.float32).astype(BF)
    dres = jax.random.normal(k[3], (m, d), jnp.float32).astype(BF)
    rstd = ref.rmsnorm_fwd(x, g, epsilon=1e-6)[1]

    def xla(x, g, dy, dres, rstd):
        dx, dg = jax.vjp(lambda x, g: ref.rmsnorm(x, g, epsilon=1e-6), x, g)[1](dy)
        return dx + dres, dg

    def pallas_add(x, g, dy, dres, rstd):
        dx, dg, _ = pn.norm_bwd(dy, x, g, None, rstd, rms=True, has_beta=False)
        return dx + dres, dg

    def pallas_fused(x, g, dy, dres, rstd):
        dx, dg, _ = pn.norm_bwd(dy, x, g, None, rstd, rms=True, has_beta=False, dres=dres)
        return dx, dg

    variants = {"xla two passes": xla, "pallas + xla add": pallas_add, "pallas, dres fused": pallas_fused}
    variants = {n: jax.jit(f) for n, f in variants.items()}
    operands = (x, g, dy, dres, rstd)
    f32 = [a.astype(jnp.float32) if a.dtype == BF else a for a in operands]
    want = jax.jit(xla)(*f32)
    for name, f in variants.items():
        got = f(*operands)
        errs = [float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b)) for a, b in zip(got, want)]
        print(f"{name}: rel err dx {errs[0]:.2e}, dgamma {errs[1]:.2e}", flush=True)
    nbytes = 4 * m * d * 2  # dy, x, dres read; dx written (the one-pass minimum)
    kern = {n: [] for n in variants}
    host = {n: [] for n in variants}
    for _ in range(args.rounds):
        for name, f in variants.items():
            kern[name].append(device_time.profiled(f, operands, calls=20)["kernel_s"])
            host[name].append(timing.measure(f, operands, samples=20, inner=10)[0])
    print(f"\nRMSNorm backward + residual gradient, {m}x{d} bf16, {jax.devices()[0].device_kind}, jax {jax.__version__};"
          f" {args.rounds} interleaved rounds; TB/s of the one-pass minimum ({nbytes / 1e6:.0f} MB)\n")
    print("| variant | kernel us | kernel TB/s | host us |")
    print("|---|---|---|---|")
    for name in variants:
        kt, ht = statistics.median(kern[name]), statistics.median(host[name])
        print(f"| {name} | {kt * 1e6:.1f} | {nbytes / kt / 1e12:.2f} | {ht * 1e6:.1f} |")


if __name__ == "__main__":
    main()
