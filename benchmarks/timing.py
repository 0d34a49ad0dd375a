"""One timing method for the GPU benchmark scripts (`from benchmarks import timing`).

Warm-up, then the median of `samples` samples; each sample dispatches `inner` calls back to back and
blocks once with jax.block_until_ready, so host dispatch latency does not count against sub-ms
kernels. inner=None picks it from one timed call so that a sample lasts about `min_sample_s`.
"""
from __future__ import annotations

import datetime
import statistics
import time

import jax


def measure(fn, args, *, samples=20, warmup=2, inner=None, min_sample_s=0.005, max_inner=20):
    """(median s/call, best s/call, first output) of fn(*args)."""
    out = fn(*args)
    jax.block_until_ready(out)
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if inner is None:
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        single = time.perf_counter() - t
        inner = max(1, min(max_inner, int(min_sample_s / max(single, 1e-6))))
    ts = []
    for _ in range(samples):
        t = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t) / inner)
        del outs
    return statistics.median(ts), min(ts), out


def bandwidth_rounds(variants, args, nbytes, *, rounds, samples, inner, title):
    """Time every variant once per round, `rounds` rounds in turn (run-to-run drift then hits all alike),
    and print a markdown table of TB/s = nbytes / time: median over rounds, min, max. Returns {name: [TB/s]}."""
    tbps = {name: [] for name in variants}
    for r in range(rounds):
        for name, f in variants.items():
            t = measure(f, args, samples=samples, warmup=2, inner=inner)[0]
            tbps[name].append(nbytes / t / 1e12)
        print(f"round {r + 1}/{rounds} done", flush=True)
    print(f"\n{title}, {jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}; {rounds} interleaved "
          f"rounds, each the median of {samples} samples x {inner} calls\n")
    print("| variant | TB/s median of rounds | min | max |")
    print("|---|---|---|---|")
    for name, v in tbps.items():
        print(f"| {name} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    return tbps
