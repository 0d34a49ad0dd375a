"""Where the host clock loses to kernel time: idle gaps between back-to-back calls on the GPU, per implementation.

    bash benchmarks/install_peers.sh; export PYTHONPATH=.:benchmarks:/tmp/site   # carry [".whl"]
    python3 benchmarks/attention_hopper_gaps_gpu.py

For the forward (and forward+backward) of the hd128 rows where the host clock and kernel time disagree (1k and 4k
non-causal), each implementation runs 20 calls back to back under the profiler. Printed per implementation: the
kernel time per call, the median idle gap on the GPU between one call's last event and the next call's first, the
median gap between events inside a call, and the host time to dispatch one call (fn(*args) returning, no block).
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import attention_hopper_gpu as ahg  # benchmarks/attention_hopper_gpu.py: makers, inputs, tokamax import
import device_time  # benchmarks/device_time.py
from pallas_kernels.flash_attention_hopper import default_config

CALLS = 20
H, D, TOKENS = 16, 128, 16384


def gaps(events, per_call):
    """(between calls, inside a call) median idle ns, from events sorted by start, `per_call` events per call."""
    calls = [events[i:i + per_call] for i in range(0, len(events), per_call)]
    between = [nxt[0][0] - max(e for _, e, _ in cur) for cur, nxt in zip(calls, calls[1:])]
    inside = [b[0] - a[1] for c in calls for a, b in zip(c, c[1:])]
    return statistics.median(between), (statistics.median(inside) if inside else 0.0)


def dispatch_us(fn, args, n=50):
    jax.block_until_ready(fn(*args))
    outs = []
    t = time.perf_counter()
    for _ in range(n):
        outs.append(fn(*args))
    dt = (time.perf_counter() - t) / n
    jax.block_until_ready(outs)
    return dt * 1e6


def main():
    tk, tk_info = ahg.import_tokamax("mosaic")
    print(tk_info, flush=True)
    ahg.gpu_warmup()
    print(f"# GPU gaps between calls, {jax.devices()[0].device_kind}, jax {jax.__version__}; bf16 H={H} D={D} "
          f"B*S={TOKENS}; {CALLS} calls under the profiler", flush=True)
    for S, causal in ((1024, False), (4096, False), (1024, True)):
        B = TOKENS // S
        q, k, v, do = ahg.inputs(jax.random.key(S + causal), B, S, H, H, D, jnp.bfloat16)
        scale = D ** -0.5
        impls = {"te_jax": ahg.make_ours(scale, causal)}
        if not causal:
            impls["te_jax per-tile grid"] = ahg.make_ours(
                scale, causal, dataclasses.replace(default_config(D, S, causal, S), fwd_persistent=False))
        impls["cuDNN"] = ahg.make_jax_nn("cudnn", scale, causal)
        if tk is not None:
            impls["tokamax"] = ahg.make_tokamax(tk, "mosaic", scale, causal)
        print(f"\n## S={S} causal={causal} (B={B})", flush=True)
        print("| impl | pass | kernel us/call | events/call | GPU gap between calls us | gap inside a call us "
              "| host dispatch us/call |", flush=True)
        print("|---|---|---|---|---|---|---|", flush=True)
        for name, (fwd, fb) in impls.items():
            for label, fn, args in (("fwd", fwd, (q, k, v)), ("fwd+bwd", fb, (q, k, v, do))):
                r = device_time.profiled(fn, args, calls=CALLS)
                per_call = round(r["kernels_per_call"])
                between, inside = gaps(r["events"], per_call)
                print(f"| {name} | {label} | {r['kernel_s'] * 1e6:.1f} | {per_call} | {between / 1e3:.1f} | "
                      f"{inside / 1e3:.1f} | {dispatch_us(fn, args):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
