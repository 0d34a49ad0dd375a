"""The block-scaled FP8 GEMM (pallas_kernels.fp8_gemm, the DeepSeek-V3 recipe) on the GPU: correctness against the
fp32 reference, then TFLOP/s beside XLA's per-tensor FP8 GEMM (cuBLASLt) and the bf16 GEMM, on the Llama-style
layer's GEMM shapes (tokens 8192, hidden 4096, SwiGLU 14336, GQA 32/8 x 128).

    PYTHONPATH=. python3 -m benchmarks.fp8_block_gemm_gpu [--rounds 3] [--variants default,serial,...]

Operands: x [M, K] in 1x128 tiles along K (one scale per row and K block), w^T [N, K] in 128x128 tiles, E4M3
(forward rows); for the wgrad rows both operands are activations in 1x128 tiles along the token axis.
Kernel variants (VARIANTS: block_n, stages, b_uniform, overlap, promotion) are timed side by side; the "unscaled"
variants are the pipeline's ceiling (no scales: not checked, not counted as the best block GEMM). Peers: XLA's
per-tensor FP8 GEMM as a dot then a scale pass, and as te_jax's per-tensor recipes run it (scale folded into
cuBLASLt), and the bf16 GEMM.
Timing: interleaved rounds, each the median of timing.measure's samples, after warm-up.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from te_jax.fp8.quantize import f8_dot
from pallas_kernels.fp8_gemm import (block_scaled_gemm, block_scaled_gemm_persistent, block_scaled_gemm_reference,
                                     quantize_blocks, row_scales)

E4M3 = jnp.float8_e4m3fn
# name: (M, K, N) of y = x [M, K] . w [K, N]
SHAPES = {
    "qkv fprop": (8192, 4096, 6144),
    "out fprop": (8192, 4096, 4096),
    "mlp up (gate+up) fprop": (8192, 4096, 28672),
    "mlp down fprop": (8192, 14336, 4096),
    "qkv wgrad": (4096, 8192, 6144),
    "mlp up wgrad": (4096, 8192, 28672),
}
# name: kernel keyword arguments (b_uniform applies to the weight-operand rows only); "persistent" selects
# persistent.block_scaled_gemm_persistent (clusters of two CTAs with b multicast when cluster_m) over kernel.py's grid
VARIANTS = {
    "default": dict(block_n=128, stages=4, b_uniform=True, overlap=True),
    "serial": dict(block_n=128, stages=4, b_uniform=True, overlap=False),
    "per-column b": dict(block_n=128, stages=4, b_uniform=False, overlap=True),
    "stages 5": dict(block_n=128, stages=5, b_uniform=True, overlap=True),
    "persistent": dict(persistent=True, block_n=128, stages=4, b_uniform=True, cluster_m=False),
    "persistent cluster": dict(persistent=True, block_n=128, stages=4, b_uniform=True, cluster_m=True),
    "persistent cluster stages 5": dict(persistent=True, block_n=128, stages=5, b_uniform=True, cluster_m=True),
    "persistent cluster 256": dict(persistent=True, block_n=256, stages=3, b_uniform=True, cluster_m=True),
    "persistent cluster rescale": dict(persistent=True, block_n=128, stages=4, b_uniform=True, cluster_m=True,
                                       promotion="rescale"),
    # what te_jax runs (te_jax/fp8/block.py, use_split_accumulator False)
    "persistent cluster rescale 256": dict(persistent=True, block_n=256, stages=3, b_uniform=True, cluster_m=True,
                                           promotion="rescale"),
    # the pipeline's ceilings: no scales, no promotion (wrong numbers unless every scale is 1; timing only)
    "persistent cluster unscaled": dict(persistent=True, block_n=128, stages=4, b_uniform=True, cluster_m=True,
                                        promotion="unscaled"),
    "persistent cluster unscaled 256": dict(persistent=True, block_n=256, stages=3, b_uniform=True, cluster_m=True,
                                            promotion="unscaled"),
}
CEILING_VARIANTS = tuple(v for v in VARIANTS if "unscaled" in v)


def operands(key, m, k, n, b_tiles=(128, 128)):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    xq, xs = quantize_blocks(x, (1, 128), E4M3)       # [M, K], [M, K/128]
    wq, ws = quantize_blocks(w.T, b_tiles, E4M3)     # [N, K], [N/b_tiles[0], K/128]
    return x, w, xq, wq, xs.T, row_scales(ws, b_tiles[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="persistent cluster,persistent cluster rescale 256,"
                    "persistent cluster unscaled 256")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    args = ap.parse_args()
    dev = jax.devices()[0]
    names = args.variants.split(",")
    print(f"{datetime.date.today()}  {dev.device_kind}  jax {jax.__version__}  variants {names}", flush=True)

    def kern(variant, wgrad):
        kw = dict(VARIANTS[variant])
        kw["b_uniform"] = kw["b_uniform"] and not wgrad
        if not kw.get("persistent"):
            kw.pop("promotion", None)
        fn = block_scaled_gemm_persistent if kw.pop("persistent", False) else block_scaled_gemm
        return jax.jit(lambda a, b, sa, sb: fn(a, b, sa, sb, **kw))

    # correctness: a small shape and a slice of the largest, against the fp32 reference on the same FP8 operands
    for variant in names:
        if variant in CEILING_VARIANTS:
            continue
        for (m, k, n) in ((256, 512, 256), (1024, 4096, 2048)):
            for wgrad in (False, True):
                _, _, xq, wq, sa, sb = operands(jax.random.key(m + n), m, k, n, (1, 128) if wgrad else (128, 128))
                got = np.asarray(kern(variant, wgrad)(xq, wq, sa, sb), np.float32)
                ref = np.asarray(block_scaled_gemm_reference(xq, wq, sa, sb))
                rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                print(f"correctness {variant} {m}x{k}x{n} b {'1x128' if wgrad else '128x128'}: rel err vs fp32 "
                      f"reference {rel:.2e} ({'ok' if rel < 1e-2 else 'FAIL'})", flush=True)

    # the one-pass block cast, compiled, against XLA's quantize_blocks (values may differ in the last FP8 step where
    # the division rounds differently)
    from pallas_kernels.fp8_gemm import block_cast_transpose
    x = jax.random.normal(jax.random.key(7), (8192, 4096), jnp.float32).astype(jnp.bfloat16)
    for tiles, block in (("rows", (1, 128)), ("square", (128, 128))):
        q, qs, qt, qts = jax.jit(lambda x: block_cast_transpose(x, out_dtype=E4M3, tiles=tiles))(x)
        rq, _ = quantize_blocks(x, block, E4M3)
        rqt, _ = quantize_blocks(x.T, block, E4M3)
        diff = float(jnp.mean((q.astype(jnp.float32) != rq.astype(jnp.float32)).astype(jnp.float32)))
        difft = float(jnp.mean((qt.astype(jnp.float32) != rqt.astype(jnp.float32)).astype(jnp.float32)))
        t = timing.measure(jax.jit(lambda x: block_cast_transpose(x, out_dtype=E4M3, tiles=tiles)), (x,),
                           samples=10)[0]
        moved = x.size * (2 + 1 + 1)  # read bf16, write two FP8 copies
        print(f"block_cast_transpose {tiles}: elements differing from XLA {diff:.2e} (q) {difft:.2e} (q^T); "
              f"{t * 1e6:.1f} us, {moved / t / 1e12:.2f} TB/s", flush=True)

    rows, results = [], {}
    for name in args.shapes.split(","):
        m, k, n = SHAPES[name]
        wgrad = "wgrad" in name
        x, w, xq, wq, sa, sb = operands(jax.random.key(1), m, k, n, (1, 128) if wgrad else (128, 128))
        wt8 = wq  # per-tensor peer: the same FP8 values, one scale each
        impls = {
            **{f"block {v}": (kern(v, wgrad), (xq, wq, sa, sb)) for v in names},
            "per-tensor FP8 (XLA/cuBLASLt)": (jax.jit(lambda a, b, s: (jax.lax.dot_general(
                a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16).astype(jnp.float32)
                * s).astype(jnp.bfloat16)), (xq, wt8, jnp.float32(1.0))),
            # what te_jax's per-tensor recipes run in the layer: the FP8 algorithm preset, the scale folded into
            # the cuBLASLt call (te_jax.fp8.quantize._scaled_gemm, "direct" on FP8 tensor cores)
            "per-tensor FP8, scale folded (te_jax's delayed/current)": (jax.jit(lambda a, b, s: f8_dot(
                a, b, (((1,), (1,)), ((), ())), jnp.bfloat16) * s.astype(jnp.bfloat16)), (xq, wt8, jnp.float32(1.0))),
            "bf16 (XLA/cuBLAS)": (jax.jit(lambda a, b: a @ b), (x, w)),
        }
        times = {i: [] for i in impls}
        for _ in range(args.rounds):
            for i, (f, a) in impls.items():
                times[i].append(timing.measure(f, a, samples=10)[0])
        flops = 2 * m * k * n
        tf = {i: flops / statistics.median(t) / 1e12 for i, t in times.items()}
        results[name] = dict(shape=(m, k, n), tflops=tf)
        best = max(tf[f"block {v}"] for v in names if v not in CEILING_VARIANTS)
        folded = tf["per-tensor FP8, scale folded (te_jax's delayed/current)"]
        rows.append(f"| {name} ({m}x{k}x{n}) | " + " | ".join(f"{tf[i]:.0f}" for i in impls)
                    + f" | {best / tf['per-tensor FP8 (XLA/cuBLASLt)']:.2f} | {best / folded:.2f} |")
        print(rows[-1], flush=True)
    print(f"\n## Block-scaled FP8 GEMM, TFLOP/s ({args.rounds} interleaved rounds, medians), {dev.device_kind}, "
          f"jax {jax.__version__}, {datetime.date.today()}\n")
    print("| GEMM | " + " | ".join(f"block {v}" for v in names)
          + " | per-tensor FP8 (XLA) | per-tensor FP8, scale folded | bf16 (XLA) | best block / per-tensor"
          " | best block / folded |")
    print("|---" * (len(names) + 6) + "|")
    for r in rows:
        print(r)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "fp8_block_gemm.json"), "w") as f:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
