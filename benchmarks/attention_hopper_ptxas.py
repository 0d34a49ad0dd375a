"""Compile the Hopper forward for a few configs with Mosaic GPU's ptxas/SASS dumps on, and summarise
what ptxas says (registers, spills, wgmma serialisation warnings) per config.

    MOSAIC_GPU_DUMP_TO=$OUT/dump PYTHONPATH=. python3 benchmarks/attention_hopper_ptxas.py \
        '{}' '{"stages": 3}'

Each argument is a JSON dict of HopperConfig fields (hd128, bf16, 4k, 16 heads; causal and not).
The dumps land in $MOSAIC_GPU_DUMP_TO (one folder per config); ptxas' own lines are printed."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
os.environ.setdefault("MOSAIC_GPU_DUMP_SASS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.flash_attention_hopper import default_config, flash_fwd  # noqa: E402


def main():
    base = os.environ.get("MOSAIC_GPU_DUMP_TO", "/tmp/mgpu_dump")
    B, S, H, D = 4, 4096, 16, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
    for i, spec in enumerate(sys.argv[1:] or ["{}"]):
        kw = json.loads(spec)
        for causal in (False, True):
            cfg = dataclasses.replace(default_config(D), **kw)
            out_dir = os.path.join(base, f"cfg{i}_{'causal' if causal else 'full'}")
            os.makedirs(out_dir, exist_ok=True)
            os.environ["MOSAIC_GPU_DUMP_TO"] = out_dir
            print(f"=== config {kw} causal={causal} -> {out_dir}", flush=True)
            f = jax.jit(lambda q, k, v: flash_fwd(q, k, v, scale=D ** -0.5, causal=causal, config=cfg)[0])
            jax.block_until_ready(f(q, k, v))
            for path in sorted(glob.glob(os.path.join(out_dir, "*"))):
                if "ptxas" in os.path.basename(path).lower():
                    txt = open(path, errors="replace").read()
                    for line in txt.splitlines():
                        if re.search(r"registers|spill|wgmma|serializ|warning", line, re.I):
                            print("   ", line.strip()[:300])
            names = [os.path.basename(p) for p in glob.glob(os.path.join(out_dir, "*"))]
            print("   files:", names[:8], flush=True)


if __name__ == "__main__":
    main()
