"""A/B of Hopper forward configs on issue #7's hd128 rows, by GPU kernel time, in interleaved rounds.

    bash benchmarks/install_peers.sh; export PYTHONPATH=.:benchmarks:/tmp/site   # carry [".whl"]
    python3 benchmarks/attention_hopper_fwd_ab_gpu.py [--rounds 4] [--rows 1024:1,4096:0] [--configs mbarrier]

Each config (CONFIGS, applied on top of the row's default config) is checked against the default's output
first (bf16: the same up to rounding), then every config and the peers (cuDNN via jax.nn.dot_product_attention,
tokamax mosaic when importable) are timed once per round, `rounds` rounds in turn; each cell is the median over
rounds of the kernel time from a profiler trace (benchmarks/device_time.py).  bf16, 16 heads, head_dim 128,
16k tokens; forward TFLOP/s = 4*B*H*S^2*D (half when causal) / time.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys

import jax
import jax.numpy as jnp

import attention_hopper_gpu as ahg  # benchmarks/attention_hopper_gpu.py: makers, inputs, rel, tokamax import
import device_time  # benchmarks/device_time.py
from pallas_kernels.flash_attention_hopper import default_config

TOKENS, H, D = 16384, 16, 128
ROWS = [(1024, False), (1024, True), (4096, False), (4096, True), (16384, False), (16384, True)]
CONFIGS = {
    "default": {},
    "mbarrier release, 4-warp producer": {"fwd_named_release": False, "fwd_producer_warp": False},
    "whole-tile tail": {"fwd_split_tail": False},  # the persistent forward's last round by whole tiles (no stream-K)
    "split tail": {"fwd_split_tail": True},  # stream-K tail at every length (auto: from 4k keys)
    "late Q (fwd_early_q=False)": {"fwd_early_q": False},  # the next tile's Q loaded after this tile's last step
    "per-tile causal grid (fwd_persistent_causal=False)": {"fwd_persistent_causal": False},
    "persistent causal (fwd_persistent_causal=True)": {"fwd_persistent_causal": True},
    "persistent causal, whole pairs to the end (fwd_causal_lpt=False)": {"fwd_persistent_causal": True,
                                                                          "fwd_causal_lpt": False},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rows", default="", help="comma-separated seq:causal (e.g. 1024:1,4096:0); default all six")
    ap.add_argument("--configs", default="", help="comma-separated substrings: only the configs that match")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--head-dim", type=int, default=D)
    ap.add_argument("--show-kernels", action="store_true", help="print each config's GPU kernels per call (once)")
    args = ap.parse_args()
    hd = args.head_dim
    rows = [(int(r.split(":")[0]), r.split(":")[1] == "1") for r in args.rows.split(",") if r] or ROWS
    wanted = [w for w in args.configs.split(",") if w]
    configs = {n: c for n, c in CONFIGS.items() if n == "default" or not wanted or any(w in n for w in wanted)}
    tk = None
    if not args.no_peers:
        tk, info = ahg.import_tokamax("mosaic")
        print(info, flush=True)
    ahg.gpu_warmup()
    scale = hd ** -0.5
    print(f"# Hopper forward A/B, {jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}; "
          f"bf16 H={H} D={hd} B*S={TOKENS}; kernel time, median of {args.rounds} interleaved rounds", flush=True)
    table = []
    for S, causal in rows:
        B = TOKENS // S
        q, k, v, _ = ahg.inputs(jax.random.key(S + causal), B, S, H, H, hd, jnp.bfloat16)
        flops = 4 * B * H * S * S * hd / (2 if causal else 1)
        impls = {n: ahg.make_ours(scale, causal, dataclasses.replace(default_config(hd, S, causal, S), **c))[0]
                 for n, c in configs.items()}
        base = impls["default"](q, k, v)
        for n, f in impls.items():
            e = ahg.rel(f(q, k, v), base)
            print(f"S={S} causal={causal} {n}: rel. diff of the output to the default {e:.1e}", flush=True)
            assert e < 1e-2, (n, e)
        if not args.no_peers:
            impls["cuDNN"] = ahg.make_jax_nn("cudnn", scale, causal)[0]
            if tk is not None:
                impls["tokamax"] = ahg.make_tokamax(tk, "mosaic", scale, causal)[0]
        res = {n: [] for n in impls}
        for r in range(args.rounds):
            for n, f in impls.items():
                p = device_time.profiled(f, (q, k, v), calls=10)
                res[n].append(flops / p["kernel_s"] / 1e12)
                if args.show_kernels and r == 0:
                    print(f"  {n} kernels per call: " + ", ".join(
                        f"{name[:60]} x{cnt:g} {p['durations'].get(name, 0) * 1e6:.1f} us" for name, cnt in p["names"].items()),
                          flush=True)
        print(f"  S={S} causal={causal}: " + "; ".join(f"{n} " + "/".join(f"{x:.0f}" for x in v)
                                                  for n, v in res.items()), flush=True)
        table.append((S, causal, {n: statistics.median(v) for n, v in res.items()}))
    names = list(table[0][2])
    print("\n| seq | causal | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for S, causal, med in table:
        base = med["default"]
        print(f"| {S} | {'yes' if causal else 'no'} | "
              + " | ".join(f"{med[n]:.0f}" + ("" if n == "default" else f" ({med[n] / base:.3f})") for n in names)
              + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
