"""Where the Hopper data-mask forward spends its time: the kernel alone on prebuilt tables (documents, padding, and
documents with every step computed under the element mask), the XLA pre-pass (mask_tables) alone, and the whole
te_jax call.  bf16 hd128, B4 x 4k, 16 heads, causal.  GPU only.

    PYTHONPATH=. python3 -m benchmarks.hopper_mask_probe
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from pallas_kernels.flash_attention_hopper.config import default_config
from pallas_kernels.flash_attention_hopper.data_mask import MaskRule, mask_tables
from pallas_kernels.flash_attention_hopper.forward import flash_fwd
from pallas_kernels.mask import AttentionMask

B, S, H, D = 4, 4096, 16, 128


def main():
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
    cfg = default_config(D, S, False, S)
    docs = np.repeat(np.arange(1, 5), [1500, 1000, 1096, 500])[None].repeat(B, 0)
    pad = (np.arange(S)[None] < np.array([4096, 3000, 2048, 3500])[:, None]).astype(np.int32)
    masks = {"documents": AttentionMask.from_segments(docs, causal=True),
             "padding": AttentionMask.from_segments(pad, causal=True),
             "plain causal as data": AttentionMask.full(B, S, S, causal=True)}
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  B{B} S{S} H{H} D{D}  {cfg}")
    for name, m in masks.items():
        t = jax.jit(lambda m: mask_tables(m, cfg))(m)
        rule = MaskRule(m.causal, m.window)
        vis = int(jnp.sum(m.dense()))
        bounds = np.asarray(t.fwd)
        steps = int((bounds[..., 3] - bounds[..., 0]).sum()) * H
        masked = int(((bounds[..., 1] - bounds[..., 0]) + (bounds[..., 3] - bounds[..., 2])).sum()) * H
        variants = {"tables": t, "every step masked": t._replace(fwd=t.fwd.at[..., 1].set(t.fwd[..., 0])
                                                                   .at[..., 2].set(t.fwd[..., 0]))}
        for vname, tv in variants.items():
            f = jax.jit(lambda q, k, v, tv: flash_fwd(q, k, v, scale=D ** -0.5, causal=False, config=cfg,
                                                      mask_tables=tv, mask_rule=rule))
            sec = timing.measure(f, (q, k, v, tv), samples=20)[0]
            print(f"{name:22s} {vname:18s} kernel {sec * 1e6:8.1f} us  {4 * H * D * vis / sec / 1e12:6.0f} TFLOP/s  "
                  f"tile steps {steps} (masked {masked}: {sec * 1e9 / max(steps, 1):.2f} ns per step, whole GPU)")
        pre = jax.jit(lambda m: mask_tables(m, cfg))
        print(f"{name:22s} pre-pass (mask_tables) {timing.measure(pre, (m,), samples=20)[0] * 1e6:8.1f} us")
    dense = jax.jit(lambda q, k, v: flash_fwd(q, k, v, scale=D ** -0.5, causal=True, config=cfg))
    sec = timing.measure(dense, (q, k, v), samples=20)[0]
    print(f"plain causal kernel (persistent schedule) {sec * 1e6:8.1f} us  {4 * H * D * B * S * (S + 1) / 2 / sec / 1e12:6.0f}"
          " TFLOP/s")


if __name__ == "__main__":
    main()
