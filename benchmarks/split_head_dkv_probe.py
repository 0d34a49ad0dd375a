"""The split-head-dim backward's dK/dV launches on the GPU: two launches (dK, then dV) against one launch with both
accumulators (HopperConfig.bwd_dkv_together) at 64-row query blocks with 240 registers, and at 32-row query blocks
(bwd_dkv_block_q=32, 64-byte swizzle) with 232 or 240; fwd+bwd of hopper_attention, interleaved rounds, medians;
gradients compared with the two-launch ones.  Run with MOSAIC_GPU_DUMP_PTXAS=1 to see each kernel's spills.

    MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=. python3 -m benchmarks.split_head_dkv_probe --dims 192/128 [--short]
        [--mask documents|window]

--mask: the same under a data mask (4 documents per row, causal) or a band (causal window (1024, 0), positions
only), where auto keeps two launches; the config is the one te_jax passes masked calls (default_config non-causal).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks import timing
from pallas_kernels.flash_attention_hopper import hopper_attention
from pallas_kernels.flash_attention_hopper.config import default_config
from pallas_kernels.mask import AttentionMask

H = 16
VARIANTS = {"two launches": dict(bwd_dkv_together=False),
            "together r240": dict(bwd_dkv_together=True, bwd_compute_registers=240, bwd_dkv_block_q=None),
            "together q32": dict(bwd_dkv_together=True, bwd_dkv_block_q=32),
            "together q32 r240": dict(bwd_dkv_together=True, bwd_dkv_block_q=32, bwd_compute_registers=240)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="192/128", help="q/k and v head dims, e.g. 192/128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", action="store_true", help="B4 x 4k only (else also B1 x 16k)")
    ap.add_argument("--mask", choices=["none", "documents", "window"], default="none")
    a = ap.parse_args()
    D, DV = (int(x) for x in a.dims.split("/"))
    shapes = [(4, 4096, True), (4, 4096, False)] + ([] if a.short else [(1, 16384, True), (1, 16384, False)])
    if a.mask != "none":
        shapes = [(4, 4096, True)] + ([] if a.short else [(1, 16384, True)])
    print(jax.devices()[0].device_kind, jax.__version__, f"{D}/{DV}", flush=True)
    for B, S, causal in shapes:
        ks = jax.random.split(jax.random.key(S + causal), 4)
        q = jax.random.normal(ks[0], (B, S, H, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, S, H, D), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, S, H, DV), jnp.bfloat16)
        do = jax.random.normal(ks[3], (B, S, H, DV), jnp.bfloat16)
        mask, mask_kw = None, {}
        if a.mask == "documents":
            lens = [S * 3 // 8, S // 4, S // 4, S // 8]
            ids = jnp.repeat(jnp.arange(1, 5), jnp.array(lens), total_repeat_length=S)[None].repeat(B, 0)
            mask = AttentionMask.from_segments(ids.astype(jnp.int32), causal=True)
        elif a.mask == "window":
            mask, mask_kw = AttentionMask.full(B, S, S, causal=True, window=(1024, 0)), dict(mask_segments=False)
        masked = mask is not None
        base = default_config(D, S, causal and not masked, S, head_dim_v=DV)
        fns, grads = {}, {}
        for name, kw in VARIANTS.items():
            cfg = dataclasses.replace(base, **kw)

            def loss(q, k, v, cfg=cfg):
                o, _ = hopper_attention(q, k, v, scale=D ** -0.5, causal=causal and not masked, config=cfg,
                                        mask=mask, **mask_kw)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

            f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            print(f"=== compile {name} B{B} S{S} causal={causal}", file=sys.stderr, flush=True)
            try:
                grads[name] = [g.astype(jnp.float32) for g in f(q, k, v)]
                fns[name] = f
            except Exception as e:  # a variant that does not compile must not stop the others
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        ref = grads["two launches"]
        for name, g in grads.items():
            errs = [float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y)) for x, y in zip(g, ref)]
            print(f"B{B} S{S} causal={causal} {name}: rel diff vs two launches dq {errs[0]:.2e} dk {errs[1]:.2e} "
                  f"dv {errs[2]:.2e}", flush=True)
        secs = {n: [] for n in fns}
        for _ in range(a.rounds):
            for n, f in fns.items():
                secs[n].append(timing.measure(f, (q, k, v), samples=10)[0])
        vis = float(jnp.sum(mask.dense())) / B if masked else S * S * (0.5 if causal else 1.0)
        fl = 2 * B * H * vis * (D + DV) * 3.5
        base_t = statistics.median(secs["two launches"])
        print(f"B{B} S{S} causal={causal} mask={a.mask} fwd+bwd: " + " | ".join(
            f"{n} {statistics.median(t) * 1e3:.3f} ms ({fl / statistics.median(t) / 1e12:.0f} TFLOP/s, "
            f"x{base_t / statistics.median(t):.3f})" for n, t in secs.items()), flush=True)


if __name__ == "__main__":
    main()
