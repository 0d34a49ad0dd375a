"""Device-side timing for the GPU benchmark scripts (`from benchmarks import device_time`), beside `timing.py`'s host clock.

- `profiled(fn, args, calls)`: runs `calls` calls under `jax.profiler.trace`, reads the XSpace back with
  `jax.profiler.ProfileData`, and returns per call: kernel time (the sum of the GPU events' durations, as a
  profiler's kernel table shows; memsets count too), span (first event start to last event end: gaps
  between kernels included), the events' names (count per call) and durations (seconds per call, per
  name) and the trace lines, so a log can be checked.
- `looped(step, x, iters)`: one jitted `lax.fori_loop` that applies `step` to its own output `iters`
  times, host-timed around the whole executable.  Only for elementwise steps: for the norms, XLA adds
  work inside the loop body (1.3-1.4 TB/s against 2.5-2.9 by the other clocks, run of 2026-11-23).
"""
from __future__ import annotations

import collections
import glob
import os
import statistics
import tempfile
import time

import jax
from jax import lax

# Lines of a GPU plane that re-list the same kernels (derived views), not streams.
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source", "TensorFlow", "Launch Stats")


def _gpu_kernel_events(xspace_dir):
    """[(line name, [(start_ns, end_ns, name)])] of the first GPU plane in the newest trace under xspace_dir."""
    paths = sorted(glob.glob(os.path.join(xspace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"no *.xplane.pb written under {xspace_dir}")
    data = jax.profiler.ProfileData.from_file(paths[-1])
    lines = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        for line in plane.lines:
            if any(tag in line.name for tag in _DERIVED_LINES):
                continue
            evs = [(e.start_ns, e.end_ns, e.name) for e in line.events]
            if evs:
                lines.append((line.name, evs))
        break
    else:
        raise RuntimeError("no /device:GPU: plane in the trace; planes: " + ", ".join(p.name for p in data.planes))
    return lines


def profiled(fn, args, *, calls=20, warmup=3):
    """dict(kernel_s, span_s, kernels_per_call, lines, names, durations, events) per call of fn(*args), from the
    profiler's GPU events (events: every (start_ns, end_ns, name) of the traced calls, by start)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            outs = [fn(*args) for _ in range(calls)]
            jax.block_until_ready(outs)
        del outs
        lines = _gpu_kernel_events(d)
    events = [e for _, evs in lines for e in evs]  # kernels, and memsets (device work too)
    if not events:
        raise RuntimeError("the trace holds no GPU events (is this a GPU?)")
    kernel_ns = sum(end - start for start, end, _ in events)
    span_ns = max(end for _, end, _ in events) - min(start for start, _, _ in events)
    names = collections.Counter(name[:60] for _, _, name in events)
    durations = collections.Counter()
    for start, end, name in events:
        durations[name[:60]] += (end - start) * 1e-9 / calls
    return dict(kernel_s=kernel_ns * 1e-9 / calls, span_s=span_ns * 1e-9 / calls,
                kernels_per_call=len(events) / calls,
                lines=[(name, len(evs)) for name, evs in lines],
                names={n: c / calls for n, c in names.most_common(8)},
                durations=dict(durations.most_common(8)),
                events=sorted(events))


def looped(step, x, *, iters=50, samples=7):
    """Median seconds per iteration of x <- step(x), `iters` iterations inside one executable."""
    run = jax.jit(lambda x: lax.fori_loop(0, iters, lambda _, y: step(y), x))
    jax.block_until_ready(run(x))
    ts = []
    for _ in range(samples):
        t = time.perf_counter()
        jax.block_until_ready(run(x))
        ts.append((time.perf_counter() - t) / iters)
    return statistics.median(ts)
