"""Where the FP8 cast kernels stand against the copy bandwidth, and what their elementwise code costs.

    PYTHONPATH=. python3 -m benchmarks.fp8_cast_probe --ceiling
        x [8192, 4096] and [8192, 28672] bf16, device clock: XLA's copy (the ceiling), XLA's casts (rows, transposed,
        both) and the Triton cast_transpose / cast_transposed kernels at their tuned and other launches.
    PYTHONPATH=. python3 -m benchmarks.fp8_cast_probe --variant NAME   (one process per variant)
        act_cast and dact_cast_transpose at the Llama MLP shape (M 8192, F 14336, SwiGLU), device clock, with the
        kernels' elementwise code replaced before they are first lowered: base (as shipped); nosat (the cast without
        the clip and NaN select: the GPU's conversion saturates by itself, checked on the printed values); exp2 (silu
        as x / (1 + 2^(-x log2 e))); nosat_exp2; nosat_abs (also |v| without the NaN-as-inf select: an upper bound,
        the amax of a NaN then differs). Prints each variant's FP8 values against XLA's reference.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_time

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
VARIANTS = ("base", "nosat", "exp2", "nosat_exp2", "nosat_abs")


def _sat(x, s):
    from pallas_kernels.fp8_cast import common as C
    return C.saturate(x.astype(jnp.float32), s, E4)  # the kernels' own saturating cast, run by XLA


def ceiling():
    from pallas_kernels.fp8_cast import kernels as K
    from te_jax.fp8 import fused
    print(jax.devices()[0].device_kind, jax.__version__)
    for shape in ((8192, 4096), (8192, 28672)):
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
        s = jnp.float32(3.0)
        cast = fused.KERNEL_OPTIONS["cast"]
        variants = {
            "xla copy bf16 (4 B/elt)": (lambda x, s: x * 2, 4),
            "xla cast rows (3 B/elt)": (_sat, 3),
            "xla cast transposed (3 B/elt)": (lambda x, s: _sat(x, s).T, 3),
            "xla cast both (4 B/elt)": (lambda x, s: (_sat(x, s), _sat(x, s).T), 4),
            "pallas cast_transpose tuned (4 B/elt)": (lambda x, s: K.cast_transpose(x, s, out_dtype=E4, **cast), 4),
            "pallas cast_transpose 64x128 w8 (4 B/elt)": (
                lambda x, s: K.cast_transpose(x, s, out_dtype=E4, block_m=64, block_n=128, num_warps=8), 4),
            "pallas cast_transpose 128x128 w8 (4 B/elt)": (
                lambda x, s: K.cast_transpose(x, s, out_dtype=E4, block_m=128, block_n=128, num_warps=8), 4),
            "pallas cast_transposed only, weight tuning (3 B/elt)": (
                lambda x, s: K.cast_transposed(x, s, out_dtype=E4, **fused.KERNEL_OPTIONS["weight"]), 3),
        }
        print(f"\n## x {shape} bf16; device clock, us and TB/s")
        for name, (f, b) in variants.items():
            r = device_time.profiled(jax.jit(f), (x, s), calls=20)
            print(f"{name:55s} {r['kernel_s'] * 1e6:8.1f} us  {b * x.size / r['kernel_s'] / 1e12:5.2f} TB/s  "
                  f"kernels/call {r['kernels_per_call']:.0f}", flush=True)


def variant(name, m=8192, f=14336):
    from pallas_kernels.fp8_cast import common as C
    from pallas_kernels.fp8_cast import reference as R
    k = jax.random.split(jax.random.key(0), 2)
    gu = jax.random.normal(k[0], (m, 2, f), jnp.float32).astype(jnp.bfloat16)
    dh = jax.random.normal(k[1], (m, f), jnp.float32).astype(jnp.bfloat16)
    s = jnp.float32(100.0)
    act = dict(activation="silu", gated=True, round_to=jnp.bfloat16)
    want_a = R.act_cast(gu, s, out_dtype=E4, transpose=True, **act)
    want_d = R.dact_cast_transpose(dh, gu, s, out_dtype=E5, **act)
    jax.block_until_ready((want_a, want_d))
    if "nosat" in name:  # replaced before the kernels are first lowered (lower_once keeps the first lowering)
        C.saturate = lambda v, scale, dtype: (v * scale).astype(dtype)
    if name == "nosat_abs":
        C.abs_for_amax = jnp.abs
    if "exp2" in name:
        import pallas_kernels.ln_mlp.activations as A
        A.ACTIVATIONS["silu"] = lambda x: x / (1.0 + jnp.exp2(-x * 1.4426950408889634))
    from pallas_kernels.fp8_cast import kernels as K
    from te_jax.fp8 import fused
    fa = jax.jit(lambda gu, s: K.act_cast(gu, s, out_dtype=E4, transpose=True, **act, **fused.KERNEL_OPTIONS["act"]))
    fd = jax.jit(lambda dh, gu, s: K.dact_cast_transpose(dh, gu, s, out_dtype=E5, **act,
                                                          **fused.KERNEL_OPTIONS["dact"]))
    got_a, got_d = fa(gu, s), fd(dh, gu, s)

    def diff(a, b):
        a, b = (np.asarray(t.astype(jnp.float32)) for t in (a, b))
        return f"{np.mean(a != b):.2e} differ, max {np.max(np.abs(a - b))}"

    dev = jax.devices()[0].device_kind
    print(f"[{name}] {dev}: act q vs XLA {diff(got_a[0], want_a[0])}, amax {float(got_a[-1])} vs "
          f"{float(want_a[-1])}; dact q {diff(got_d[0], want_d[0])}, amax {float(got_d[-1])} vs {float(want_d[-1])}")
    t = jnp.array([[1e30, -1e30, 3.0, np.nan], [2.0, -np.inf, 1.0, 0.5]], jnp.float32)
    for dt in (E4, E5):
        q, _, am = K.cast_transpose(t, 1.0, out_dtype=dt)
        vals = np.asarray(q.astype(jnp.float32)).tolist()
        print(f"[{name}] saturation {jnp.dtype(dt).name}: {vals} amax {float(am)}")
    kernels = (("act_cast", fa, (gu, s), m * 2 * f * 2 + 2 * m * f),
               ("dact_cast_transpose", fd, (dh, gu, s), m * f * 2 + m * 2 * f * 2 + 2 * m * 2 * f))
    for kname, fn, args, nbytes in kernels:
        ts = [device_time.profiled(fn, args, calls=20)["kernel_s"] for _ in range(3)]
        t = sorted(ts)[1]
        print(f"[{name}] {kname}: {t * 1e6:.1f} us  {nbytes / t / 1e12:.2f} TB/s (rounds "
              f"{[round(x * 1e6, 1) for x in ts]})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ceiling", action="store_true")
    p.add_argument("--variant", choices=VARIANTS)
    args = p.parse_args()
    if args.ceiling:
        ceiling()
    if args.variant:
        variant(args.variant)


if __name__ == "__main__":
    main()
