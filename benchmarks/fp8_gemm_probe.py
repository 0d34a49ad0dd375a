"""GPU probe: what XLA makes of one FP8 GEMM in each te_jax GEMM style (compile time, custom calls, speed).

    PYTHONPATH=. python3 -m benchmarks.fp8_gemm_probe [--m 8192 --n 28672 --k 4096]

For each style of te_jax.fp8.quantize.GEMM_STYLES: lower + compile time, the GEMM custom calls and fusions in the
optimized HLO (is the scale folded into __cublas$lt$matmul$f8, or left as a separate pass?), and the median time.
`--forms` adds candidate forms of the scaled FP8 GEMM that te_jax does not use (yet), by name:
  bf16_scale    dot -> bf16, times the scale rounded to bf16 (exact when the scales are powers of two, as
                TransformerEngine's power-of-2 scale option makes them): does XLA fold a bf16 multiply into
                cuBLASLt's alpha, so that a weight gradient needs no pass for its scale?
  f32_out       dot -> f32, times the scale, convert to bf16 (folds, with an f32 output and a convert pass)
  fast_bf16     dot with DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM -> bf16, times the bf16 scale: Triton's
                GEMM fusion refuses that algorithm (support_legacy.cc), so the FP8 GEMM rewriter sees the dot and
                the multiply together and can fold a runtime scale as cuBLASLt's d_scale (gemm_rewriter F8ScaleD)
  fast_f32      the same with an f32 output and f32 scale, then convert to bf16
  split_bf16    ANY_F8_ANY_F8_F32 (no fast accumulation: cuBLASLt promotes partial sums) -> bf16, times the scale
  highest_bf16  precision=HIGHEST (also refused by Triton; no fast accumulation) -> bf16, times the scale
  qdq_highest   the qdq form with precision=HIGHEST
Each form's output is compared with the direct style's (relative error; bf16 scale rounding shows here).
"""
from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp

from jax import lax

from te_jax.fp8.quantize import GEMM_STYLES, _scaled_gemm

_TN = (((1,), (1,)), ((), ()))


def _form(name):
    """(x, w, sa, sb) -> bf16 [M, N] for a candidate form of the scaled FP8 GEMM (see the module docstring)."""
    def dot(x, w, out):
        return lax.dot_general(x, w, _TN, precision=lax.Precision.DEFAULT, preferred_element_type=out)
    if name == "bf16_scale":
        return lambda x, w, sa, sb: dot(x, w, jnp.bfloat16) * (sa * sb).astype(jnp.bfloat16)
    if name == "f32_out":
        return lambda x, w, sa, sb: (dot(x, w, jnp.float32) * (sa * sb)).astype(jnp.bfloat16)
    preset = lax.DotAlgorithmPreset
    algo = {"fast": preset.ANY_F8_ANY_F8_F32_FAST_ACCUM, "split": preset.ANY_F8_ANY_F8_F32,
            "highest": lax.Precision.HIGHEST}

    def adot(x, w, out, a):
        return lax.dot_general(x, w, _TN, precision=algo[a], preferred_element_type=out)
    if name in ("fast_bf16", "split_bf16", "highest_bf16"):
        a = name.split("_")[0]
        return lambda x, w, sa, sb: adot(x, w, jnp.bfloat16, a) * (sa * sb).astype(jnp.bfloat16)
    if name == "fast_f32":
        return lambda x, w, sa, sb: (adot(x, w, jnp.float32, "fast") * (sa * sb)).astype(jnp.bfloat16)
    if name == "qdq_highest":
        bf = jnp.bfloat16
        return lambda x, w, sa, sb: lax.dot_general(x.astype(bf) * sa.astype(bf), w.astype(bf) * sb.astype(bf), _TN,
                                                    precision=lax.Precision.HIGHEST, preferred_element_type=bf)
    raise SystemExit(f"--forms: unknown form {name!r} (see the module docstring)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--n", type=int, default=28672)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--styles", default=",".join(GEMM_STYLES))
    p.add_argument("--forms", default="", help="comma-separated candidate forms (module docstring)")
    a = p.parse_args()
    ka, kb = jax.random.split(jax.random.key(0))
    x = jax.random.normal(ka, (a.m, a.k), jnp.float32).astype(jnp.float8_e4m3fn)
    w = jax.random.normal(kb, (a.n, a.k), jnp.float32).astype(jnp.float8_e4m3fn)
    sa, sb = jnp.float32(0.37), jnp.float32(0.81)  # not powers of two: a bf16-rounded scale shows in the error
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; x [{a.m},{a.k}] . w [{a.n},{a.k}]^T -> bf16",
          flush=True)
    runs = [(s, lambda x, w, sa, sb, s=s: _scaled_gemm(s, jnp.bfloat16, sa, sb)(x, w, _TN))
            for s in a.styles.split(",") if s]
    runs += [(f"form {n}", _form(n)) for n in a.forms.split(",") if n]
    ref = None
    for style, fn in runs:
        f = jax.jit(fn)
        t0 = time.perf_counter()
        try:
            c = f.lower(x, w, sa, sb).compile()
        except Exception as e:  # a form this jax / XLA refuses
            print(f"{style}: does not compile: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        tc = time.perf_counter() - t0
        hlo = c.as_text()
        calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
        fusions = [ln.split("=")[0].strip() + " -> " + ln.split("=")[1].split(" fusion(")[0].strip()
                   for ln in hlo.splitlines() if " fusion(" in ln and "ENTRY" not in ln][:6]
        y = c(x, w, sa, sb).astype(jnp.float32)
        ref = y if ref is None else ref
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        for _ in range(3):
            c(x, w, sa, sb).block_until_ready()
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            c(x, w, sa, sb).block_until_ready()
            ts.append(time.perf_counter() - t0)
        ms = statistics.median(ts) * 1e3
        tf = 2 * a.m * a.n * a.k / ms / 1e9
        print(f"{style}: compile {tc:.1f} s; custom calls {calls}; fusions {fusions}; {ms:.3f} ms ({tf:.0f} TFLOP/s); "
              f"vs the first form: rel {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
