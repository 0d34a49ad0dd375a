"""Hopper attention under HopperConfig variants against the tuned default, device clock: dense rows, and masks.

    PYTHONPATH=. python3 -m benchmarks.hopper_dense_config_probe --configs "stages3:bwd_stages=3;name2:k=v,k=v"
    PYTHONPATH=. python3 -m benchmarks.hopper_dense_config_probe --configs "full wait:exit_wait_read_only=False" \
        --rows 4096:0,4096:1,1024:1 --masks thd,documents --fwd

Dense rows (--rows S:causal, batch 16384 // S, at least 1): hd128 (--head-dim), 16 heads; default B4 x 4k non-causal
and causal, B1 x 16k causal. Mask rows (--masks, names of hopper_mask_probe.probe_masks): the mask built in the call
as te_jax builds it (pre-pass and merges included), on document-aligned tiles for the document masks (thd,
documents, mixed*: what te_jax's auto takes on rows of 4096+ tokens; "name@grid" keeps the global grid's tiles),
its base config masked_config. Each variant's gradients are compared with the default's (relative norm); a variant
that fails to build is reported, not fatal. TFLOP/s count the forward's 4 H D per visible pair (x 3.5 for
forward+backward). Rounds interleave the variants; each round profiles 10 calls; medians of the rounds. --fwd times
the forward alone too, --fwd-only only it.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp

from benchmarks import device_time
from benchmarks.hopper_mask_probe import config_overrides

ROWS = "4096:0,4096:1,16384:1"
ALIGNED_MASKS = ("thd", "documents", "mixed", "mixed_short", "64x256", "80x200")


def _cases(rows: str, masks: str, d: int):
    """(name, q, k, v, do, call(q, k, v, cfg) -> out, base config, forward FLOPs) per row."""
    from benchmarks.hopper_mask_probe import _rebuilt, probe_masks
    from pallas_kernels.flash_attention_hopper import hopper_attention, masked_config
    from pallas_kernels.flash_attention_hopper.config import default_config

    h = 16
    for spec in filter(None, rows.split(",")):
        s, causal = (int(x) for x in spec.split(":"))
        b = max(1, 16384 // s)
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
                       for kk in jax.random.split(jax.random.key(0), 4))
        call = lambda q, k, v, cfg, causal=bool(causal): hopper_attention(q, k, v, scale=d ** -0.5, causal=causal,
                                                                         config=cfg)[0]
        yield (f"B{b} S{s} causal={bool(causal)}", (q, k, v, do), call,
               default_config(d, kv_len=s, causal=bool(causal), q_len=s),
               4 * b * h * s * s * d * (0.5 if causal else 1.0))
    for spec in filter(None, masks.split(",")):
        name, _, tiles = spec.partition("@")  # "name@grid": the global grid's tiles even for documents
        m = probe_masks(name)[name]
        aligned = name in ALIGNED_MASKS and tiles != "grid"
        q, k, v, do = (jax.random.normal(kk, (m.batch, m.q_len, h, d), jnp.float32).astype(jnp.bfloat16)
                       for kk in jax.random.split(jax.random.key(1), 4))
        call = lambda q, k, v, cfg, m=m, al=aligned: hopper_attention(
            q, k, v, scale=d ** -0.5, mask=_rebuilt(m), mask_aligned=al, config=cfg)[0]
        yield (f"{name} ({'aligned' if aligned else 'grid'} tiles)", (q, k, v, do), call,
               masked_config(d, d, m.q_len, m.kv_len), 4 * h * d * int(jnp.sum(m.dense())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="stages3:bwd_stages=3")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", default=ROWS, help="dense rows S:causal, comma-separated ('' for none)")
    ap.add_argument("--masks", default="", help="mask rows: hopper_mask_probe.probe_masks names, comma-separated")
    ap.add_argument("--fwd", action="store_true", help="time the forward alone too")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward alone (gradients still compared)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__, f"hd{args.head_dim}, 16 heads; device clock, "
          f"{args.rounds} interleaved rounds of 10 calls, medians", flush=True)
    passes = ("fwd",) if args.fwd_only else ("fwd", "fwd+bwd") if args.fwd else ("fwd+bwd",)
    for row, (q, k, v, do), call, base, flops in _cases(args.rows, args.masks, args.head_dim):
        variants = {"default": base}
        variants.update({n: dataclasses.replace(base, **kw) for n, kw in config_overrides(args.configs).items()})
        fns, ref, errs = {}, None, {}
        for name, cfg in variants.items():
            try:
                fwd = jax.jit(lambda q, k, v, do, cfg=cfg: call(q, k, v, cfg))
                grad = jax.jit(jax.grad(lambda q, k, v, do, cfg=cfg: jnp.sum(
                    call(q, k, v, cfg).astype(jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
                g = grad(q, k, v, do)
                ref = g if ref is None else ref
                errs[name] = max(float(jnp.linalg.norm((a - r).astype(jnp.float32))
                                       / jnp.linalg.norm(r.astype(jnp.float32))) for a, r in zip(g, ref))
                fns[name] = {"fwd": fwd, "fwd+bwd": grad}
            except Exception as e:  # noqa: BLE001 - a variant that does not build is a result
                print(f"{row} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        times = {(n, p): [] for n in fns for p in passes}
        for _ in range(args.rounds):
            for n, fp in fns.items():
                for p in passes:
                    times[(n, p)].append(device_time.profiled(fp[p], (q, k, v, do), calls=10)["kernel_s"])
        for p in passes:
            ref_t = statistics.median(times[("default", p)]) if "default" in fns else None
            for n in fns:
                t = statistics.median(times[(n, p)])
                mult = 3.5 if p == "fwd+bwd" else 1.0
                rel = f"  x{ref_t / t:.3f} of default" if ref_t else ""
                print(f"{row:28s} {n:16s} {p:8s} {t * 1e6:8.1f} us  {mult * flops / t / 1e12:6.1f} TFLOP/s{rel}  "
                      f"grads vs default {errs[n]:.1e}", flush=True)


if __name__ == "__main__":
    main()
