"""One forward (or backward) attention kernel run under Nsight Compute: te_jax Hopper, cuDNN or tokamax.

    ncu --clock-control none --kernel-name regex:'te_jax_attn|flash_attention|sdpa|fprop|dgrad' \
        --launch-skip 1 --launch-count 1 --set full -o $OUT/x \
        python3 benchmarks/attention_hopper_ncu_gpu.py --impl ours --seq 4096 [--causal] [--bwd]

The function runs `--calls` times (the first one compiles and warms up; ncu's --launch-skip skips it),
on bf16 inputs, 16 heads, head_dim 128, batch * seq = 16384 tokens (issue #7's rows).  Each run of this
script profiles one implementation, so ncu's kernel filter and skip count stay simple.
benchmarks/attention_hopper_ncu.sh runs it for the rows and implementations and prints the summaries.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import attention_hopper_gpu as ahg  # benchmarks/attention_hopper_gpu.py: makers, inputs, tokamax import

TOKENS, H, D = 16384, 16, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("ours", "cudnn", "tokamax"), required=True)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="profile forward+backward (else the forward)")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    S, causal, scale = args.seq, args.causal, D ** -0.5
    B = TOKENS // S
    q, k, v, do = ahg.inputs(jax.random.key(S + causal), B, S, H, H, D, jnp.bfloat16)
    if args.impl == "ours":
        f, fb = ahg.make_ours(scale, causal)
    elif args.impl == "cudnn":
        f, fb = ahg.make_jax_nn("cudnn", scale, causal)
    else:
        tk, info = ahg.import_tokamax("mosaic")
        print(info, flush=True)
        if tk is None:
            raise SystemExit(1)
        f, fb = ahg.make_tokamax(tk, "mosaic", scale, causal)
    fn, a = (fb, (q, k, v, do)) if args.bwd else (f, (q, k, v))
    for i in range(args.calls):
        jax.block_until_ready(fn(*a))
    print(f"ran {args.impl} S={S} causal={causal} bwd={args.bwd} x{args.calls}", flush=True)


if __name__ == "__main__":
    main()
