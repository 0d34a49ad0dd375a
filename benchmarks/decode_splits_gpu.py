"""The decode kernel's KV split count on the rows where it trails a peer: TB/s for several DecodeConfig(num_splits=)
against the default (enough shares for DecodeConfig.min_programs programs) and cuDNN / FA3.

    bash benchmarks/install_peers.sh; PYTHONPATH=.:/tmp/site python3 -m benchmarks.decode_splits_gpu [--rounds 3]
    PYTHONPATH=. python3 -m benchmarks.decode_splits_gpu --launch [--rounds 2]

--launch sweeps the launch parameters instead (DecodeConfig block_kv x num_warps x num_stages, the default split
count) on LAUNCH_ROWS, timed by the device clock (benchmarks.device_time: the GPU time of a call's kernels, so
that the batch-1 rows are not timed by Python's dispatch), each variant's output checked against the default's.

Programs = batch x KV heads x row tiles x splits; an H100 holds about two per SM at once, so a count just above a
multiple of 264 leaves a last, mostly empty wave. The table says, per row, which split count read fastest.
"""
from __future__ import annotations

import argparse
import datetime
import statistics

import jax
import jax.numpy as jnp

from benchmarks import attention_hopper_gpu as ahg
from benchmarks import device_time, timing
from benchmarks.decode_gpu import D, H, drop_failing, makers

ROWS = [  # name, batch, q_len, kv heads, cache, split counts to try
    ("q1 b16 GQA 32/8 cache 8k", 16, 1, 8, 8192, (1, 2, 3, 4, 6, 8)),
    ("q1 b16 GQA 32/8 cache 32k", 16, 1, 8, 32768, (2, 3, 4, 6, 8)),
    ("q8 b16 GQA 32/8 cache 8k", 16, 8, 8, 8192, (1, 2, 3, 4, 6, 8)),
    ("q8 b16 GQA 32/8 cache 32k", 16, 8, 8, 32768, (2, 3, 4, 6, 8)),
    ("q1 b16 MHA cache 8k", 16, 1, 32, 8192, (1, 2)),
    ("q1 b1 MHA cache 32k", 1, 1, 32, 32768, (4, 8, 9, 16, 24)),
    ("q1 b1 MHA cache 128k", 1, 1, 32, 131072, (8, 9, 16, 24, 33)),
    ("q1 b1 GQA 32/8 cache 128k", 1, 1, 8, 131072, (16, 32, 33, 64, 66)),
]


LAUNCH_ROWS = [("q1 b16 GQA 32/8 cache 8k", 16, 1, 8, 8192), ("q1 b16 GQA 32/8 cache 32k", 16, 1, 8, 32768),
               ("q8 b16 GQA 32/8 cache 8k", 16, 8, 8, 8192), ("q1 b16 MHA cache 8k", 16, 1, 32, 8192),
               ("q1 b1 GQA 32/8 cache 32k", 1, 1, 8, 32768), ("q1 b1 MHA cache 32k", 1, 1, 32, 32768)]
LAUNCHES = [(bk, w, st) for bk in (64, 128, 256) for w, st in ((4, 2), (4, 3), (4, 4), (8, 3), (8, 4))]


def _cache(name, b, sq, g, s):
    ks = jax.random.split(jax.random.key(len(name)), 3)
    q = jax.random.normal(ks[0], (b, sq, H, D), jnp.bfloat16)
    part = min(s, 8192)
    k, v = (jnp.tile(jax.random.normal(kk, (b, part, g, D), jnp.bfloat16), (1, s // part, 1, 1)) for kk in ks[1:])
    return q, k, v


def launch_sweep(rounds, smoke, launches=None):
    """TB/s by the device clock for each (block_kv, num_warps, num_stages) on LAUNCH_ROWS; prints a table."""
    from pallas_kernels.flash_decode import DecodeConfig

    rows = [("smoke", 2, 1, 8, 512)] if smoke else LAUNCH_ROWS
    launches = launches or (LAUNCHES[:2] if smoke else LAUNCHES)
    default = DecodeConfig()
    table = []
    for name, b, sq, g, s in rows:
        q, k, v = _cache(name, b, sq, g, s)
        cfgs = {f"bk{bk} w{w} s{st}": DecodeConfig(block_kv=bk, num_warps=w, num_stages=st) for bk, w, st in launches}
        impls, _ = makers(sq, g, None, None, cfgs)
        impls.pop("cudnn", None)
        drop_failing(impls, q, k, v)
        ref = impls["te_jax"](q, k, v).astype(jnp.float32)
        for i in impls:
            assert ahg.rel(impls[i](q, k, v).astype(jnp.float32), ref) < 1e-2, (name, i)
        kern = {i: [] for i in impls}
        for _ in range(rounds):
            for i, f in impls.items():
                kern[i].append(device_time.profiled(f, (q, k, v), calls=10)["kernel_s"] if not smoke else 1.0)
        nbytes = 2 * b * s * g * D * 2
        tb = {i: nbytes / statistics.median(t) / 1e12 for i, t in kern.items()}
        best = max(tb, key=tb.get)
        launch = f"block_kv {default.block_kv or 'auto'}, w{default.num_warps} s{default.num_stages}"
        line = (f"| {name} | te_jax ({launch}) {tb['te_jax']:.2f} | " + " ".join(f"{i} {tb[i]:.2f};" for i in tb if i != "te_jax")
                + f" | {best} | {tb[best] / tb['te_jax']:.3f} |")
        print(line, flush=True)
        table.append(line)
        del q, k, v
    print(f"\n## Decode launch parameters, TB/s of K/V by the device clock ({rounds} interleaved rounds, medians), "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}\n")
    print("| row | default | variants | fastest | it / default |")
    print("|---|---|---|---|---|")
    print("\n".join(table))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launch", action="store_true", help="sweep block_kv x num_warps x num_stages (device clock)")
    ap.add_argument("--launches", default="", help='with --launch: "bk,warps,stages;..." instead of LAUNCHES')
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    from pallas_kernels.flash_decode import DecodeConfig

    if args.launch:
        if not args.cpu_smoke:
            ahg.gpu_warmup()
        chosen = [tuple(int(x) for x in t.split(",")) for t in args.launches.split(";") if t]
        return launch_sweep(args.rounds, args.cpu_smoke, chosen)

    fa3, _ = ahg.import_fa3()
    rows = [("smoke", 2, 1, 8, 512, (1, 2))] if args.cpu_smoke else ROWS
    if not args.cpu_smoke:
        ahg.gpu_warmup()
    table = []
    for name, b, sq, g, s, splits in rows:
        ks = jax.random.split(jax.random.key(len(name)), 3)
        q = jax.random.normal(ks[0], (b, sq, H, D), jnp.bfloat16)
        part = min(s, 8192)
        k, v = (jnp.tile(jax.random.normal(kk, (b, part, g, D), jnp.bfloat16), (1, s // part, 1, 1)) for kk in ks[1:])
        impls, _ = makers(sq, g, None, fa3, {f"splits {n}": DecodeConfig(num_splits=n) for n in splits})
        drop_failing(impls, q, k, v)
        ref = impls["te_jax"](q, k, v).astype(jnp.float32)
        for i in impls:
            if i.startswith("splits"):
                assert ahg.rel(impls[i](q, k, v).astype(jnp.float32), ref) < 1e-2, (name, i)
        times = {i: [] for i in impls}
        for _ in range(args.rounds):
            for i, f in impls.items():
                times[i].append(timing.measure(f, (q, k, v), samples=10)[0])
        nbytes = 2 * b * s * g * D * 2
        tb = {i: nbytes / statistics.median(t) / 1e12 for i, t in times.items()}
        best_split = max((i for i in tb if i.startswith("splits")), key=tb.get)
        peers = [i for i in tb if i in ("cudnn", "fa3")]
        best_peer = max(peers, key=tb.get) if peers else None
        line = (f"| {name} | " + " | ".join(f"{i} {tb[i]:.2f}" for i in tb) + f" | {best_split} | "
                + (f"{tb[best_split] / tb[best_peer]:.2f} of {best_peer}" if best_peer else "-") + " |")
        print(line, flush=True)
        table.append(line)
    print(f"\n## Decode split counts, TB/s of K/V ({args.rounds} interleaved rounds, medians), "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}\n")
    print("| row | implementations (TB/s; te_jax = default split count) | fastest split count | it / best peer |")
    print("|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()
