"""GPU benchmark of the FP8 cast kernels (pallas_kernels/fp8_cast) against XLA doing the same math.

Run on the device machine from the repo root:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.fp8_cast_gpu 2>&1 | tee $OUT/fp8_cast_log.txt
    (--sweep also times every (block_m, block_n, num_warps) of a small grid per kernel; --only act,dact picks kernels)
CPU smoke test of the script itself (tiny sizes, interpret mode):
    PYTHONPATH=. python -m benchmarks.fp8_cast_gpu --cpu-smoke

Shapes: the Llama MLP of benchmarks/fp8_layer_gpu.py (tokens M = 4 x 2048, hidden 4096, SwiGLU FFN 14336), bf16:
  act_cast             gu [M, 2, F] -> a_q [M, F], a_qT [F, M], amax          (forward, after the wi GEMM)
  dact_cast_transpose  dh [M, F], gu -> dgu_q [M, 2F], dgu_qT [2F, M], amax   (backward, before the wi GEMMs)
  cast_transpose       x [M, D] -> x_q, x_qT, amax                            (the norm output; dy likewise)
  norm_stats_cast_transpose  x [M, D], gamma -> RMSNorm(x)_q, its transpose, amax (statistics in the kernel;
                       --sweep times its own grid: rows per program, column chunk, warps, stages)
"xla" is the same math as whole-array jnp (pallas_kernels/fp8_cast/reference.py) under jit: XLA's own fusions,
the unfused path's passes. Reported: ms (median of interleaved rounds) and TB/s of the fused kernel's minimal
traffic (each input read once, each output written once), so both variants are rated on the same bytes.
Correctness: kernel vs xla outputs at most one FP8 step apart, amax within fp32 rounding. JSON to $OUT.
act_cast, dact_cast_transpose and the two cast + transposes also run their TMA twins (pallas_kernels/fp8_cast/tma.py,
tiles of 64 and 128; GPU only, not with --cpu-smoke), checked and timed beside the Triton-lowered kernels.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from pallas_kernels import fp8_cast as K
from pallas_kernels.fp8_cast import reference as R
from pallas_kernels.fp8_cast import tma as T
from pallas_kernels.norms import reference as NR

E4, E5, BF = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16


def _ulps(a, b):
    def ordinal(x):
        bits = np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)).astype(np.int32)
        return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)

    return np.abs(ordinal(a) - ordinal(b))


def _tma_variants(fn):
    """{"tma block=64": jit(fn(..., b=64)), "tma block=128": ...}: a TMA twin (pallas_kernels/fp8_cast/tma.py; GPU
    only) at both tiles, run beside the case's Triton-lowered kernel."""
    return {f"tma block={b}": jax.jit(functools.partial(fn, b=b)) for b in (64, 128)}


def cases(M, D, F):
    k = jax.random.split(jax.random.key(0), 4)
    w1 = (jax.random.normal(k[3], (D, 2 * F), jnp.float32) * 0.02).astype(BF)
    gu = jax.random.normal(k[0], (M, 2, F), jnp.float32).astype(BF)
    dh = jax.random.normal(k[1], (M, F), jnp.float32).astype(BF)
    x = jax.random.normal(k[2], (M, D), jnp.float32).astype(BF)
    s = jnp.float32(100.0)
    act = dict(activation="silu", gated=True, round_to=BF)
    gamma = (1.0 + 0.1 * jax.random.normal(k[3], (D,), jnp.float32)).astype(BF)
    return {
        "norm_stats_cast_transpose (RMSNorm)": dict(
            args=(x, gamma, s), nbytes=M * D * 2 + 2 * M * D,
            kernel=lambda cfg: jax.jit(lambda x, g, s: K.norm_stats_cast_transpose(
                x, g, None, s, rms=True, epsilon=1e-6, out_dtype=E4, **cfg)[:3]),
            xla=jax.jit(lambda x, g, s: R.cast_transpose(NR.rmsnorm(x, g, epsilon=1e-6), s, out_dtype=E4)),
            sweep=[dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                   for bm, bn, w, st in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8), (1, 2))
                   if 2048 <= bm * bn <= 32768]
            + [dict(block_m=bm, block_n=D, num_warps=w)  # one chunk spans the row: read once, kept in registers
               for bm, w in itertools.product((2, 4, 8, 16), (4, 8, 16)) if bm * D <= 65536]),
        "act_cast": dict(
            args=(gu, s), nbytes=M * 2 * F * 2 + 2 * M * F,
            kernel=lambda cfg: jax.jit(lambda gu, s: K.act_cast(gu, s, out_dtype=E4, transpose=True, **act, **cfg)),
            xla=jax.jit(lambda gu, s: R.act_cast(gu, s, out_dtype=E4, transpose=True, **act)),
            extra=_tma_variants(lambda gu, s, b: T.act_cast_tma(gu, s, out_dtype=E4, block=b, **act))),
        "dact_cast_transpose": dict(
            args=(dh, gu, s), nbytes=M * F * 2 + M * 2 * F * 2 + 2 * M * 2 * F,
            kernel=lambda cfg: jax.jit(lambda dh, gu, s: K.dact_cast_transpose(dh, gu, s, out_dtype=E5, **act, **cfg)),
            xla=jax.jit(lambda dh, gu, s: R.dact_cast_transpose(dh, gu, s, out_dtype=E5, **act)),
            extra=_tma_variants(lambda dh, gu, s, b: T.dact_cast_transpose_tma(dh, gu, s, out_dtype=E5, block=b,
                                                                                **act))),
        "act_amax": dict(
            args=(gu,), nbytes=M * 2 * F * 2,
            kernel=lambda cfg: jax.jit(lambda gu: (K.act_amax(gu, **act, **cfg),)),
            xla=jax.jit(lambda gu: (R.act_amax(gu, **act),))),
        "dact_amax": dict(
            args=(dh, gu), nbytes=M * F * 2 + M * 2 * F * 2,
            kernel=lambda cfg: jax.jit(lambda dh, gu: (K.dact_amax(dh, gu, **act, **cfg),)),
            xla=jax.jit(lambda dh, gu: (R.dact_amax(dh, gu, **act),))),
        "cast_transposed (weight wi [D, 2F])": dict(
            args=(w1, s), nbytes=D * 2 * F * 2 + D * 2 * F,
            kernel=lambda cfg: jax.jit(lambda w, s: K.cast_transposed(w, s, out_dtype=E4, round_to=BF, **cfg)),
            xla=jax.jit(lambda w, s: R.cast_transpose(w, s, out_dtype=E4, round_to=BF)[1:]),
            extra=_tma_variants(lambda w, s, b: T.cast_transpose_tma(w, s, out_dtype=E4, round_to=BF, write_q=False,
                                                                     block=b)[1:])),
        "cast_transpose": dict(
            args=(x, s), nbytes=M * D * 2 + 2 * M * D,
            kernel=lambda cfg: jax.jit(lambda x, s: K.cast_transpose(x, s, out_dtype=E4, **cfg)),
            xla=jax.jit(lambda x, s: R.cast_transpose(x, s, out_dtype=E4)),
            extra=_tma_variants(lambda x, s, b: T.cast_transpose_tma(x, s, out_dtype=E4, block=b))),
    }


def check(name, got, want):
    *qs, amax = got
    *rqs, ramax = want
    worst = 0
    for q, rq in zip(qs, rqs):
        u = _ulps(q.reshape(rq.shape), rq)
        worst = max(worst, int(u.max()))
    rel = abs(float(amax) - float(ramax)) / max(abs(float(ramax)), 1e-30)
    # amax within one bf16 rounding: XLA may drop the reference's bf16 rounding of a before its amax (excess precision)
    ok = worst <= 1 and rel <= 2.0 ** -8
    print(f"{name}: max FP8 steps vs xla {worst}, amax rel diff {rel:.2e} -> {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time a grid of block sizes and warps per kernel")
    p.add_argument("--only", default="", help="comma-separated substrings of the kernel names to run")
    args = p.parse_args()
    M, D, F = (48, 32, 40) if args.cpu_smoke else (8192, 4096, 14336)
    if args.cpu_smoke:
        args.rounds, args.samples = 1, 2
    dev = jax.devices()[0]
    print(f"{datetime.date.today()} {dev.device_kind} jax {jax.__version__}; M {M}, D {D}, F {F}, bf16"
          + ("  [CPU SMOKE: timings meaningless]" if args.cpu_smoke else ""), flush=True)
    configs = [dict()]
    if args.sweep:
        configs += [dict(block_m=bm, block_n=bn, num_warps=w) for bm, bn, w in
                    itertools.product((32, 64, 128, 256), (32, 64, 128, 256), (4, 8))
                    if 2048 <= bm * bn <= 32768]
    results, all_ok = {}, True
    for name, c in cases(M, D, F).items():
        if args.only and not any(k in name for k in args.only.split(",")):
            continue
        variants = {"xla": c["xla"]}
        for cfg in (configs if "sweep" not in c or not args.sweep else [dict()] + c["sweep"]):
            variants["pallas " + (",".join(f"{k}={v}" for k, v in cfg.items()) or "default")] = c["kernel"](cfg)
        all_ok &= check(name, variants["pallas default"](*c["args"]), variants["xla"](*c["args"]))
        for v, f in ({} if args.cpu_smoke else c.get("extra", {})).items():  # other kernels for the same call
            variants[v] = f
            all_ok &= check(f"{name} ({v})", f(*c["args"]), variants["xla"](*c["args"]))
        times = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, f in variants.items():
                times[v].append(timing.measure(f, c["args"], samples=args.samples, warmup=2)[0])
        rows = sorted(((statistics.median(ts), v) for v, ts in times.items()))
        print(f"\n### {name} ({c['nbytes'] / 1e9:.3f} GB minimal traffic)\n\n| variant | ms | TB/s |\n|---|---|---|")
        for t, v in rows[:12]:
            print(f"| {v} | {t * 1e3:.3f} | {c['nbytes'] / t / 1e12:.2f} |")
        results[name] = {v: dict(ms=statistics.median(ts) * 1e3, tbps=c["nbytes"] / statistics.median(ts) / 1e12)
                         for v, ts in times.items()}
    out_dir = os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "fp8_cast.json")
    with open(out, "w") as f:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, shape=dict(M=M, D=D, F=F), correct=all_ok,
                       results=results), f, indent=1)
    print(f"\nwrote {out}; correctness {'ok' if all_ok else 'MISMATCH'}")


if __name__ == "__main__":
    main()
