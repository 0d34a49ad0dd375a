"""Dense Hopper attention, forward+backward, under HopperConfig variants against the tuned default, device clock.

    PYTHONPATH=. python3 -m benchmarks.hopper_dense_config_probe --configs "stages3:bwd_stages=3;name2:k=v,k=v"

Rows: hd128, 16 heads, B4 x 4k non-causal and causal, B1 x 16k causal. Each variant's gradients are compared with the
default's (relative norm); a variant that fails to build is reported, not fatal. TFLOP/s count 3.5 x the forward's
4 B H S^2 D (half when causal). The median of three profiled rounds of 10 calls.
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from benchmarks import device_time
from benchmarks.hopper_mask_probe import config_overrides

ROWS = ((4, 4096, False), (4, 4096, True), (1, 16384, True))


def main():
    from pallas_kernels.flash_attention_hopper import hopper_attention
    from pallas_kernels.flash_attention_hopper.config import default_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="stages3:bwd_stages=3")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    h, d = 16, args.head_dim
    for b, s, causal in ROWS:
        ks = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in ks)
        base = default_config(d, kv_len=s, causal=causal, q_len=s)
        variants = {"default": base}
        variants.update({n: dataclasses.replace(base, **kw) for n, kw in config_overrides(args.configs).items()})

        def grads(cfg):
            def loss(q, k, v, do):
                o, _ = hopper_attention(q, k, v, scale=d ** -0.5, causal=causal, config=cfg)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * 3.5
        ref = None
        for name, cfg in variants.items():
            try:
                f = grads(cfg)
                g = f(q, k, v, do)
                ref = g if ref is None else ref
                err = max(float(jnp.linalg.norm((a - r).astype(jnp.float32)) / jnp.linalg.norm(r.astype(jnp.float32)))
                          for a, r in zip(g, ref))
                ts = sorted(device_time.profiled(f, (q, k, v, do), calls=10)["kernel_s"] for _ in range(3))
                print(f"B{b} S{s} causal={causal} {name:16s} fwd+bwd {ts[1] * 1e6:8.1f} us  "
                      f"{flops / ts[1] / 1e12:6.1f} TFLOP/s  grads vs default {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that does not build is a result
                print(f"B{b} S{s} causal={causal} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
