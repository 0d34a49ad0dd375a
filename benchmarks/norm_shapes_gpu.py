"""Norms across shapes: does `auto`'s per-op choice (layernorm -> pallas, rmsnorm -> xla) hold beyond 32768x4096?

    PYTHONPATH=. python3 -m benchmarks.norm_shapes_gpu            # GPU machine
    PYTHONPATH=. BENCH_SMALL=1 python3 -m benchmarks.norm_shapes_gpu   # CPU smoke test

For each (tokens, hidden) in SHAPES, bf16 x, fp32 gamma/beta: LayerNorm and RMSNorm, XLA and Pallas, forward
and forward+backward, checked against the fp32 reference first, then timed in `ROUNDS` interleaved rounds by
kernel time (profiler trace, `device_time.profiled`) and by the host clock (`timing.measure`).
TB/s: forward = 2 passes of x, forward+backward = 4 passes (as in norms_mlp_gpu.py).
The table gives Pallas / XLA per shape; > 1 means the Pallas kernel is faster.
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.norms import norm as pnorm
from pallas_kernels.norms import reference as nref

from benchmarks import device_time, timing
from benchmarks.cases import norm_inputs

SMALL = os.environ.get("BENCH_SMALL") == "1"
ROUNDS = 1 if SMALL else int(os.environ.get("ROUNDS", "3"))
SHAPES = ([(64, 768), (32, 1000)] if SMALL else
          [(8192, 768), (8192, 1024), (8192, 2048), (8192, 4096), (8192, 8192),
           (32768, 1024), (32768, 2048), (32768, 4096), (32768, 5120), (32768, 8192), (16384, 12288)])


def fwd_bwd(f, with_beta):
    def step(x, g, b, dy):
        if with_beta:
            _, vjp = jax.vjp(f, x, g, b)
        else:  # rmsnorm: b is unused, and not differentiated
            _, vjp = jax.vjp(lambda x, g: f(x, g, b), x, g)
        return vjp(dy)
    return jax.jit(step)


def variants():
    fns = {}
    for op in ("layernorm", "rmsnorm"):
        if op == "layernorm":
            xla = lambda x, g, b: nref.layernorm(x, g, b).astype(x.dtype)  # noqa: E731
            pal = lambda x, g, b: pnorm.layernorm(x, g, b)  # noqa: E731
        else:
            xla = lambda x, g, b: nref.rmsnorm(x, g).astype(x.dtype)  # noqa: E731
            pal = lambda x, g, b: pnorm.rmsnorm(x, g)  # noqa: E731
        for be, f in (("xla", xla), ("pallas", pal)):
            fns[(op, be, "fwd")] = (jax.jit(f), 2)
            fns[(op, be, "fwd+bwd")] = (fwd_bwd(f, op == "layernorm"), 4)
    return fns


def check(fns, x, g, b, dy):
    """Pallas output and gradients against the fp32 reference (bf16 x: rel. error < 1e-2)."""
    x32 = x.astype(jnp.float32)
    for op in ("layernorm", "rmsnorm"):
        ref_f = (lambda x, g, b: nref.layernorm(x, g, b)) if op == "layernorm" else (lambda x, g, b: nref.rmsnorm(x, g))
        y_ref, vjp = jax.vjp(ref_f, x32, g, b)
        refs = [y_ref, *vjp(dy.astype(jnp.float32))]
        outs = [fns[(op, "pallas", "fwd")][0](x, g, b), *fns[(op, "pallas", "fwd+bwd")][0](x, g, b, dy)]
        for name, o, r in zip(("y", "dx", "dgamma", "dbeta"), outs, refs):  # rmsnorm: no dbeta output
            err = float(jnp.linalg.norm(o.astype(jnp.float32) - r) / jnp.linalg.norm(r))
            assert err < 1e-2, (op, x.shape, name, err)


def main():
    on_gpu = jax.default_backend() == "gpu"
    fns = variants()
    rows = []
    for m, d in SHAPES:
        x, g, b, dy = norm_inputs(m, d, seed=m + d)
        check(fns, x, g, b, dy)
        pass_bytes = x.size * x.dtype.itemsize
        res = {(key, clk): [] for key in fns for clk in ("kernel", "host")}
        for _ in range(ROUNDS):
            for key, (f, passes) in fns.items():
                args = (x, g, b) if key[2] == "fwd" else (x, g, b, dy)
                res[(key, "host")].append(passes * pass_bytes / timing.measure(f, args, samples=7)[0] / 1e12)
                if on_gpu:
                    p = device_time.profiled(f, args, calls=10)
                    res[(key, "kernel")].append(passes * pass_bytes / p["kernel_s"] / 1e12)
        med = {k_: statistics.median(v) for k_, v in res.items() if v}
        rows.append((m, d, med))
        print(f"{m}x{d}: " + "  ".join(f"{'/'.join(key)} {clk} {v:.2f}" for (key, clk), v in med.items()), flush=True)

    print(f"\n# Norms across shapes, {jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}; "
          f"bf16 x; TB/s (median of {ROUNDS} rounds) and pallas/xla\n")
    for clk in ("kernel", "host") if on_gpu else ("host",):
        print(f"\n## clock: {clk}\n")
        print("| tokens x hidden | LN fwd xla | LN fwd pallas | ratio | LN f+b xla | LN f+b pallas | ratio "
              "| RMS fwd xla | RMS fwd pallas | ratio | RMS f+b xla | RMS f+b pallas | ratio |")
        print("|---|" + "---|" * 12)
        for m, d, med in rows:
            cells = []
            for op in ("layernorm", "rmsnorm"):
                for dirn in ("fwd", "fwd+bwd"):
                    xv, pv = med[((op, "xla", dirn), clk)], med[((op, "pallas", dirn), clk)]
                    cells += [f"{xv:.2f}", f"{pv:.2f}", f"{pv / xv:.2f}"]
            print(f"| {m}x{d} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
