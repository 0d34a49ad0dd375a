"""One timing method for the GPU benchmark scripts (imported by them as `timing`).

Warm-up, then the median of `samples` samples; each sample dispatches `inner` calls back to back and
blocks once with jax.block_until_ready, so host dispatch latency does not count against sub-ms
kernels. inner=None picks it from one timed call so that a sample lasts about `min_sample_s`.
"""
from __future__ import annotations

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
