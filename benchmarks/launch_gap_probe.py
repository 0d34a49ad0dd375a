"""Where the host clock and the device clock part: Hopper attention under a documents mask (pre-pass, kernels,
merges), timed three ways per call, under XLA compile options.

    PYTHONPATH=. python3 -m benchmarks.launch_gap_probe [--masks thd,documents] [--rounds 3]

Per call: the host clock (benchmarks.timing: back-to-back calls, one block per sample: what the attention tables
report), the device clock's kernel time (the sum of the kernels' durations) and its span (first kernel start to last
kernel end, per call: kernels plus the GPU's idle gaps between them). Where the host clock exceeds the span, the
host's dispatch is the limit; where the span exceeds the kernel time, the GPU waits between kernels. Variants: XLA's
defaults; command buffers (CUDA graphs) taking segments of any length (xla_gpu_graph_min_graph_size=1); command
buffers off. Masks as in hopper_mask_probe.probe_masks, on document-aligned tiles as te_jax's auto takes them;
FlashAttention-3's varlen call beside them under XLA's defaults where flash-attn3-jax is installed
(PYTHONPATH=.:/tmp/site after benchmarks/install_peers.sh, carry .whl).

--pipeline: where the host clock's excess goes. Per call (jit, XLA's defaults), for thd and dense causal 4k, te_jax
and FlashAttention-3: the host's dispatch time (f(*args) returning, the GPU idle before), and the wall time of N calls
dispatched back to back then one block, N = 1..16: its slope is the steady cost per call, its intercept the latency a
sample pays once (timing.measure amortizes it over its `inner` calls only).
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_time, timing
from benchmarks.peer_rows import fa3_varlen

VARIANTS = {
    "xla defaults": {},
    "graphs of any size": {"xla_gpu_graph_min_graph_size": 1},
    "no command buffers": {"xla_gpu_enable_command_buffer": ""},
}


def _fa3_varlen(name, m, d):
    """FlashAttention-3's varlen call on the documents of mask `name` (flash-attn3-jax, when installed; the
    documents' lengths from the mask's segment ids), or None."""
    try:
        import flash_attn3_jax as fa3
    except ImportError:
        return None
    seg = np.asarray(m.q_segment_ids)
    if (seg == 0).any():  # padding: not a varlen row
        return None
    lens = [int(n) for row in seg for n in np.unique(row, return_counts=True)[1]]  # ids increase along a row
    return fa3_varlen(fa3, lens, d ** -0.5, m.causal)


def _pipeline_row(label, f, args, ns=(1, 2, 4, 8, 16), samples=9):
    """Print f's host dispatch time and the fit of N back-to-back calls' wall time (us)."""
    import time
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    disp = []
    for _ in range(samples):
        t = time.perf_counter()
        out = f(*args)
        disp.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    walls = []
    for n in ns:
        ts = []
        for _ in range(samples):
            t = time.perf_counter()
            jax.block_until_ready([f(*args) for _ in range(n)])
            ts.append(time.perf_counter() - t)
        walls.append(statistics.median(ts) * 1e6)
    slope, icpt = np.polyfit(np.asarray(ns, float), np.asarray(walls), 1)
    cells = "  ".join(f"N{n} {w / n:7.1f}" for n, w in zip(ns, walls))
    print(f"{label:28s} dispatch {statistics.median(disp) * 1e6:7.1f}  per call: {cells}  | slope {slope:7.1f}  "
          f"intercept {icpt:7.1f}", flush=True)


def pipeline():
    """--pipeline (module docstring)."""
    from benchmarks.hopper_mask_probe import _rebuilt, probe_masks
    from benchmarks.peer_rows import fwd_and_fb
    from pallas_kernels.flash_attention_hopper import hopper_attention

    try:
        import flash_attn3_jax as fa3
    except ImportError:
        fa3 = None
    h, d = 16, 128
    print(jax.devices()[0].device_kind, jax.__version__, "us; medians of 9 samples", flush=True)
    m = probe_masks("thd")["thd"]
    rows = {"thd": (m, (m.batch, m.q_len)), "dense causal B4x4k": (None, (4, 4096))}
    for row, (mask, (b, s)) in rows.items():
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
                       for kk in jax.random.split(jax.random.key(1), 4))
        if mask is None:
            ours = lambda q, k, v: hopper_attention(q, k, v, scale=d ** -0.5, causal=True)[0]
            peer = None if fa3 is None else (lambda q, k, v: fa3.flash_mha(q, k, v, softmax_scale=d ** -0.5,
                                                                          is_causal=True))
        else:
            ours = lambda q, k, v, m=mask: hopper_attention(q, k, v, scale=d ** -0.5, mask=_rebuilt(m),
                                                            mask_aligned=True)[0]
            peer = _fa3_varlen(row, mask, d)
        cudnn = None if mask is not None else (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=d ** -0.5, is_causal=True, implementation="cudnn"))
        for name, f in (("te_jax", ours), ("fa3", peer), ("cudnn", cudnn)):
            if f is None:
                continue
            fwd, fb = fwd_and_fb(f)
            _pipeline_row(f"{row} {name} fwd", fwd, (q, k, v))
            _pipeline_row(f"{row} {name} fwd+bwd", fb, (q, k, v, do))


def main():
    from benchmarks.hopper_mask_probe import _rebuilt, probe_masks
    from pallas_kernels.flash_attention_hopper import hopper_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--masks", default="thd,documents")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pipeline", action="store_true", help="dispatch time and N back-to-back calls' wall time")
    args = ap.parse_args()
    if args.pipeline:
        return pipeline()
    h, d = 16, 128
    print(jax.devices()[0].device_kind, jax.__version__, f"hd{d}, {h} heads, aligned tiles; {args.rounds} "
          f"interleaved rounds, medians; us per call", flush=True)
    for name, m in probe_masks(*args.masks.split(",")).items():
        q, k, v, do = (jax.random.normal(kk, (m.batch, m.q_len, h, d), jnp.float32).astype(jnp.bfloat16)
                       for kk in jax.random.split(jax.random.key(1), 4))
        call = lambda q, k, v, m=m: hopper_attention(q, k, v, scale=d ** -0.5, mask=_rebuilt(m), mask_aligned=True)[0]
        passes = {"fwd": lambda q, k, v, do: call(q, k, v),
                  "fwd+bwd": jax.grad(lambda q, k, v, do: jnp.sum(call(q, k, v).astype(jnp.float32)
                                                                  * do.astype(jnp.float32)), argnums=(0, 1, 2))}
        fns = {}
        for var, opts in VARIANTS.items():
            for p, f in passes.items():
                try:
                    fns[(var, p)] = jax.jit(f).lower(q, k, v, do).compile(compiler_options=opts or None)
                except Exception as e:  # noqa: BLE001 - an option this XLA does not take is a result
                    print(f"{name} {var} {p}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        fa3 = _fa3_varlen(name, m, d)
        if fa3 is not None:  # the peer under XLA's defaults: does it pay the same host-clock overhead?
            fns[("fa3 varlen", "fwd")] = jax.jit(lambda q, k, v, do: fa3(q, k, v))
            fns[("fa3 varlen", "fwd+bwd")] = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(
                fa3(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
        res = {key: {"host": [], "kernels": [], "span": [], "n": []} for key in fns}
        for _ in range(args.rounds):
            for key, f in fns.items():
                res[key]["host"].append(timing.measure(f, (q, k, v, do), samples=20)[0])
                prof = device_time.profiled(f, (q, k, v, do), calls=10)
                res[key]["kernels"].append(prof["kernel_s"])
                res[key]["span"].append(prof["span_s"])
                res[key]["n"].append(prof["kernels_per_call"])
        for (var, p), r in res.items():
            host, ker, span = (statistics.median(r[x]) * 1e6 for x in ("host", "kernels", "span"))
            print(f"{name:10s} {p:8s} {var:20s} host {host:7.1f}  span {span:7.1f}  kernels {ker:7.1f}  "
                  f"({statistics.median(r['n']):.0f} kernels; host - kernels {host - ker:6.1f})", flush=True)


if __name__ == "__main__":
    main()
