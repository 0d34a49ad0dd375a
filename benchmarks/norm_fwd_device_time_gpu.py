"""Norm bandwidth on 32768x4096 bf16 timed three ways in one process (issue #5's 2.64 TB/s target).

    PYTHONPATH=.:benchmarks python3 benchmarks/norm_fwd_device_time_gpu.py        # on the GPU machine
    PYTHONPATH=.:benchmarks BENCH_SMALL=1 python3 benchmarks/norm_fwd_device_time_gpu.py   # CPU smoke test

Every earlier norm table used the host clock around back-to-back calls (`timing.py`). The shared notes'
targets (copy 2.94 TB/s, XLA LayerNorm forward 2.64, XLA forward+backward 1.38) are far above what that
method gave for the same XLA ops (2.57-2.74, 2.10-2.35, 1.02), so the method, not only the kernels, is in
question. Here each variant is timed, in interleaved rounds, by:

- host: the host clock around 10 back-to-back calls (`timing.measure`, the method of the earlier tables);
- kernel: the sum of the GPU kernel durations per call from a profiler trace (`device_time.profiled`);
- span: first kernel start to last kernel end per call in the same trace (gaps between kernels included);
- loop: x <- f(x) fifty times inside one executable, host-timed (`device_time.looped`; forward only).

TB/s: forward = (x read + y written) / time; forward+backward = four passes of x / time (as in
norms_mlp_gpu.py). Correctness of every Pallas variant against the fp32 reference is checked first.
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys

import jax
import jax.numpy as jnp

import te_jax
from pallas_kernels.norms import norm as pnorm
from pallas_kernels.norms import reference as nref

import device_time  # benchmarks/device_time.py
import timing  # benchmarks/timing.py
from norm_inputs import norm_inputs  # benchmarks/norm_inputs.py

SMALL = os.environ.get("BENCH_SMALL") == "1"
ROUNDS = 1 if SMALL else int(os.environ.get("ROUNDS", "5"))
METHODS = ("host", "kernel", "span", "loop")


def fwd_bwd(f, nargs):
    def step(x, g, b, dy):
        _, vjp = jax.vjp(f, x, g, b)
        return vjp(dy)[:nargs]
    return jax.jit(step)


def main():
    m, d = (64, 512) if SMALL else (32768, 4096)
    x, g, b, dy = norm_inputs(m, d, seed=1)
    pass_bytes = x.size * x.dtype.itemsize
    on_gpu = jax.default_backend() == "gpu"

    ln_pallas = lambda x, g, b: pnorm.layernorm(x, g, b)  # noqa: E731
    rms_pallas = lambda x, g, b: pnorm.rmsnorm(x, g)  # noqa: E731
    ln_xla = lambda x, g, b: nref.layernorm(x, g, b).astype(x.dtype)  # noqa: E731
    rms_xla = lambda x, g, b: nref.rmsnorm(x, g).astype(x.dtype)  # noqa: E731
    ln_te = lambda x, g, b: te_jax.layernorm(x, g, b)  # noqa: E731
    fwd = {
        "XLA bf16 negation (read+write ceiling)": lambda x, g, b: -x,
        "XLA bf16 x + x - x (one read, one write)": lambda x, g, b: x + x - x,
        "XLA layernorm": ln_xla,
        "XLA rmsnorm": rms_xla,
        "Pallas layernorm (library default)": ln_pallas,
        "Pallas rmsnorm (library default)": rms_pallas,
        "te_jax.layernorm (backend auto)": ln_te,
    }
    fwdbwd = {
        "XLA layernorm fwd+bwd": fwd_bwd(ln_xla, 3),
        "Pallas layernorm fwd+bwd": fwd_bwd(ln_pallas, 3),
        "XLA rmsnorm fwd+bwd": fwd_bwd(rms_xla, 2),
        "Pallas rmsnorm fwd+bwd": fwd_bwd(rms_pallas, 2),
    }

    ref = nref.layernorm(x.astype(jnp.float32), g, b)
    for name in ("Pallas layernorm (library default)", "te_jax.layernorm (backend auto)"):
        err = float(jnp.max(jnp.abs(jax.jit(fwd[name])(x, g, b).astype(jnp.float32) - ref)))
        print(f"{name}: max abs err vs fp32 reference {err:.2e}", flush=True)
        assert err < 0.05, name
    print(te_jax.explain_norm_backend(x, g, b), flush=True)

    res = {name: {mth: [] for mth in METHODS} for name in list(fwd) + list(fwdbwd)}
    for r in range(ROUNDS):
        for name, f in fwd.items():
            jf = jax.jit(f)
            res[name]["host"].append(2 * pass_bytes / timing.measure(jf, (x, g, b), samples=9, inner=10)[0])
            if on_gpu:
                p = device_time.profiled(jf, (x, g, b), calls=20)
                res[name]["kernel"].append(2 * pass_bytes / p["kernel_s"])
                res[name]["span"].append(2 * pass_bytes / p["span_s"])
                if r == 0:
                    print(f"  {name}: {p['kernels_per_call']:.1f} kernels/call; trace lines {p['lines']}",
                          flush=True)
            t = device_time.looped(lambda y, f=f: f(y, g, b), x, iters=4 if SMALL else 50)
            res[name]["loop"].append(2 * pass_bytes / t)
        for name, f in fwdbwd.items():
            res[name]["host"].append(4 * pass_bytes / timing.measure(f, (x, g, b, dy), samples=9, inner=10)[0])
            if on_gpu:
                p = device_time.profiled(f, (x, g, b, dy), calls=20)
                res[name]["kernel"].append(4 * pass_bytes / p["kernel_s"])
                res[name]["span"].append(4 * pass_bytes / p["span_s"])
                if r == 0:
                    print(f"  {name}: {p['kernels_per_call']:.1f} kernels/call", flush=True)
        print(f"round {r + 1}/{ROUNDS} done", flush=True)

    print(f"\n# Norm bandwidth, {m}x{d} bf16, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{datetime.date.today()}; {ROUNDS} interleaved rounds; TB/s median of rounds (min-max)\n")
    print("| variant | " + " | ".join(METHODS) + " |")
    print("|---|" + "---|" * len(METHODS))
    for name, per in res.items():
        cells = []
        for mth in METHODS:
            v = [t / 1e12 for t in per[mth]]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
