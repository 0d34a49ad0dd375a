"""Which tiles the non-causal persistent Hopper forward gets wrong with one K/V step per tile (GPU only; a
diagnostic for the zero tiles of tests/test_flash_attention_hopper.py::test_persistent_forward_loops_over_tiles[5],
gpu_tests_h100.md). It calls the persistent forward directly (auto no longer takes it for one-step tiles) on 12
query tiles over 2-6 CTAs, with one and two K/V steps per tile. For each run it prints the tiles whose output
differs from the fp32 reference, by CTA and by the tile's index in that CTA's loop.

    PYTHONPATH=. python3 -m benchmarks.hopper_persistent_probe
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash_attention_hopper.config import default_config
from pallas_kernels.flash_attention_hopper.forward import _flash_fwd_persistent
from pallas_kernels.flash_attention_hopper.reference import attention_reference


def main():
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}")
    B, H, D = 2, 3, 64
    for S in (256, 512):  # hd64 default: 256-key blocks -> 1 and 2 K/V steps per tile
        ks = jax.random.split(jax.random.key(S), 3)
        q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
        ref, _ = attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                     scale=D ** -0.5, causal=False)
        ref = np.asarray(ref)
        n_qt = S // 128
        n_tiles = B * H * n_qt
        for ctas, split_tail in [(c, False) for c in (2, 3, 4, 5, 6, 7)] + [(c, True) for c in (3, 5, 7)]:
            cfg = dataclasses.replace(default_config(D), fwd_ctas=ctas, fwd_split_tail=split_tail)
            out, _ = jax.jit(lambda q, k, v: _flash_fwd_persistent(q, k, v, scale=D ** -0.5, cfg=cfg,
                                                                  interpret=False))(q, k, v)
            out = np.asarray(out, np.float32)
            bad = []
            for t in range(n_tiles):  # tile t = (batch, head, query tile), CTA t % ctas, its (t // ctas)-th tile
                bh, qt = divmod(t, n_qt)
                b, h = divmod(bh, H)
                rows = slice(qt * 128, qt * 128 + 128)
                err = np.linalg.norm(out[b, rows, h] - ref[b, rows, h]) / np.linalg.norm(ref[b, rows, h])
                if err > 1e-2:
                    zero = "zero" if not out[b, rows, h].any() else f"err {err:.2f}"
                    bad.append(f"tile {t} (cta {t % ctas}, #{t // ctas}: {zero})")
            steps = S // cfg.block_kv
            print(f"S {S} ({steps} K/V step(s) per tile), {n_tiles} tiles on {ctas} CTAs, split tail {split_tail}: "
                  + ("all tiles right" if not bad else "; ".join(bad)), flush=True)


if __name__ == "__main__":
    main()
