"""Where the hd128 causal backward loses to cuDNN: per-kernel GPU time, causal against non-causal, a few configs.

    PYTHONPATH=.:benchmarks python3 benchmarks/attention_hopper_bwd_breakdown_gpu.py [--rounds 3]

Run 8 found the causal backward at 16k running at ~0.92 of cuDNN's while the non-causal one ties. Here, at
16k tokens, head_dim --head-dim (128; heads = 2048 // head_dim), bf16, for seq 16k and 4k, causal and not
(--causal-only / --non-causal-only), forward+backward of the Hopper
kernel (defaults and the configs in CONFIGS) and of cuDNN, each timed by kernel time from a profiler trace,
with each GPU kernel's time per call (the te_jax kernels are named te_jax_attn_*). Gradients of every config are
checked against the default's first. Median over `rounds` interleaved rounds.
TFLOP/s per kernel counts that kernel's share of the work in matmuls (`kernel_share`): forward 4*B*H*S^2*D (half
when causal); dK+dV+dQ in one kernel 2.5x that, dK+dV 2x, the dQ kernel 1.5x.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys

import jax
import jax.numpy as jnp

import attention_hopper_gpu as ahg  # benchmarks/attention_hopper_gpu.py: makers, inputs, rel
import device_time  # benchmarks/device_time.py
from pallas_kernels.flash_attention_hopper import HopperConfig, default_config

TOKENS = 16384
CONFIGS = {
    "default": None,
    "dQ kernel (no atomic dQ)": HopperConfig(bwd_dq_atomic=False),
    "atomic dQ (bwd_dq_atomic=True)": HopperConfig(bwd_dq_atomic=True),
    "232 / 40 registers (bwd_compute_registers=232; hd128's default before run 10)": HopperConfig(
        bwd_compute_registers=232),
    "240 / 24 registers (bwd_compute_registers=240; hd128's default)": HopperConfig(bwd_compute_registers=240),
    "mask every block (split_causal=False)": HopperConfig(split_causal=False),
    "bwd_stages=3": HopperConfig(bwd_stages=3),
    "forward causal walk (bwd_causal_reverse=False)": HopperConfig(bwd_causal_reverse=False),
    "forward causal walk, dQ kernel": HopperConfig(bwd_causal_reverse=False, bwd_dq_atomic=False),
    "whole-tile forward tail (fwd_split_tail=False)": HopperConfig(fwd_split_tail=False),
    "whole-tile backward (bwd_split_tail=False)": HopperConfig(bwd_split_tail=False),
    "cut backward tiles at every length (bwd_split_tail=True)": HopperConfig(bwd_split_tail=True),
    # diagnostics: the piece grid with its last tiles whole (1 piece: the 1-D grid and the piece path, no cuts)
    "cut backward tiles, bwd_pieces=1": HopperConfig(bwd_split_tail=True, bwd_pieces=1),
    "cut backward tiles, bwd_pieces=2": HopperConfig(bwd_split_tail=True, bwd_pieces=2),
    "mbarrier release, 4-warp producer (bwd)": HopperConfig(bwd_named_release=False, bwd_producer_warp=False),
    "mbarrier release, 4-warp producer (fwd and bwd)": HopperConfig(
        bwd_named_release=False, bwd_producer_warp=False, fwd_named_release=False, fwd_producer_warp=False),
}


def changed(cfg):
    """The fields of cfg that differ from HopperConfig() (applied on top of the head_dim's default config)."""
    base = HopperConfig()
    return {f: v for f, v in cfg.__dict__.items() if getattr(base, f) != v}


def kernel_share(kname):
    """Work of a kernel in forward units (a forward = 2 matmuls; each matmul = 0.5), or None (not attention)."""
    if "fprop" in kname or "attn_fwd" in kname:
        return 1.0
    if "bprop" in kname or "attn_bwd_dkdvdq" in kname:  # S, dP, dV, dK, dQ
        return 2.5
    if "attn_bwd_dkdv" in kname:  # S, dP, dV, dK
        return 2.0
    if "attn_bwd_dq" in kname:  # S, dP, dQ
        return 1.5
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--causal-only", action="store_true")
    ap.add_argument("--non-causal-only", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128, help="heads = 2048 // head_dim (the same hidden size)")
    ap.add_argument("--configs", default="", help="comma-separated substrings: time only the configs that match")
    ap.add_argument("--seqs", default="16384,4096", help="comma-separated sequence lengths")
    args = ap.parse_args()
    wanted = [w for w in args.configs.split(",") if w]
    D = args.head_dim
    H = 2048 // D
    ahg.gpu_warmup()
    scale = D ** -0.5
    print(f"# Hopper backward breakdown, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{datetime.date.today()}; bf16 H={H} D={D} B*S={TOKENS}; kernel time, median of {args.rounds} rounds",
          flush=True)
    for S, causal in [(int(s), c) for s in args.seqs.split(",") for c in (True, False)]:
        if (args.causal_only and not causal) or (args.non_causal_only and causal):
            continue
        B = TOKENS // S
        q, k, v, do = ahg.inputs(jax.random.key(S * 3 + causal), B, S, H, H, D, jnp.bfloat16)
        fwd_flops = 4 * B * H * S * S * D / (2 if causal else 1)
        configs = {name: None if cfg is None else dataclasses.replace(default_config(D, S, causal, S), **changed(cfg))
                   for name, cfg in CONFIGS.items()}
        impls = {name: ahg.make_ours(scale, causal, cfg)[1] for name, cfg in configs.items()
                 if (causal or "causal" not in name)
                 and (name == "default" or not wanted or any(w in name for w in wanted))}
        impls["cuDNN"] = ahg.make_jax_nn("cudnn", scale, causal)[1]
        base = impls["default"](q, k, v, do)
        for name, fb in impls.items():
            errs = [ahg.rel(a, b) for a, b in zip(fb(q, k, v, do), base)]
            print(f"S={S} causal={causal} {name}: rel. diff of dq/dk/dv to the default "
                  + " ".join(f"{e:.1e}" for e in errs), flush=True)
            assert all(e < 1e-2 for e in errs), (name, errs)
        res = {name: [] for name in impls}
        for _ in range(args.rounds):
            for name, fb in impls.items():
                res[name].append(device_time.profiled(fb, (q, k, v, do), calls=8))
        print(f"\n## S={S} causal={causal} (B={B})", flush=True)
        for name, runs in res.items():
            total = statistics.median(r["kernel_s"] for r in runs)
            print(f"{name}: fwd+bwd {3.5 * fwd_flops / total / 1e12:.0f} TFLOP/s ({total * 1e3:.3f} ms/call)",
                  flush=True)
            kernels = sorted({n for r in runs for n in r["durations"]})
            for kname in kernels:
                t = statistics.median(r["durations"].get(kname, 0.0) for r in runs)
                share = kernel_share(kname)
                rate = f", {share * fwd_flops / t / 1e12:.0f} TFLOP/s" if share and t > 0 else ""
                print(f"    {kname}: {t * 1e3:.3f} ms{rate}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
