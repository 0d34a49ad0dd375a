"""Launch-parameter sweep of the Pallas norms at the shapes where they trail XLA (norm_shapes_h100.md).

    PYTHONPATH=.:benchmarks python3 benchmarks/norm_configs_gpu.py            # GPU machine
    PYTHONPATH=.:benchmarks BENCH_SMALL=1 python3 benchmarks/norm_configs_gpu.py   # CPU smoke test

Per shape: the forward (block_rows, num_warps) grid for LayerNorm and RMSNorm, and the backward
(bwd_block_rows, bwd_num_warps, bwd_grid, num_stages) grid timed as forward+backward, each variant checked
against the default's output first; XLA timed alongside. Kernel time from a profiler trace
(`device_time.profiled`), median of ROUNDS interleaved rounds. Prints the default, the best config and XLA.
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.norms import norm as pnorm
from pallas_kernels.norms import reference as nref

import device_time  # benchmarks/device_time.py
import timing  # benchmarks/timing.py
from norm_inputs import norm_inputs  # benchmarks/norm_inputs.py

SMALL = os.environ.get("BENCH_SMALL") == "1"
ROUNDS = 1 if SMALL else int(os.environ.get("ROUNDS", "3"))
SHAPES = [(64, 768)] if SMALL else [(8192, 768), (32768, 5120), (32768, 8192)]
if os.environ.get("SHAPES"):  # e.g. SHAPES=32768x5120,16384x12288
    SHAPES = [tuple(int(v) for v in shape.split("x")) for shape in os.environ["SHAPES"].split(",")]
OPS = os.environ.get("OPS", "layernorm,rmsnorm").split(",")
DIRS = os.environ.get("DIRS", "fwd,f+b").split(",")
FWD = [(1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 8), (4, 16), (8, 8), (8, 16)]
BWD = [(1, 8, 528, 1), (1, 16, 528, 1), (1, 8, 264, 1), (1, 16, 264, 1), (1, 8, 1056, 1), (2, 16, 528, 1),
       (1, 8, 528, 2), (1, 16, 528, 2), (4, 8, 528, 1), (4, 16, 264, 1)]
if SMALL:
    FWD, BWD = FWD[:2], BWD[:2]


def fns_for(op, d):
    """{name: (jitted fn taking (x, g, b, dy), passes of x)} for one op: XLA, default, the sweep."""
    def pal(cfg):
        if op == "layernorm":
            return lambda x, g, b: pnorm.layernorm(x, g, b, config=cfg)
        return lambda x, g, b: pnorm.rmsnorm(x, g, config=cfg)

    xla = ((lambda x, g, b: nref.layernorm(x, g, b).astype(x.dtype)) if op == "layernorm"
           else (lambda x, g, b: nref.rmsnorm(x, g).astype(x.dtype)))

    def fwd(f):
        return jax.jit(lambda x, g, b, dy: f(x, g, b))

    def fb(f):
        def step(x, g, b, dy):
            if op == "layernorm":
                return jax.vjp(f, x, g, b)[1](dy)
            return jax.vjp(lambda x, g: f(x, g, b), x, g)[1](dy)
        return jax.jit(step)

    out = {"fwd xla": (fwd(xla), 2), "fwd default": (fwd(pal(pnorm.NormConfig())), 2),
           "f+b xla": (fb(xla), 4), "f+b default": (fb(pal(pnorm.NormConfig())), 4)}
    for br, nw in FWD:
        out[f"fwd rows={br} warps={nw}"] = (fwd(pal(pnorm.NormConfig(block_rows=br, num_warps=nw))), 2)
    for br, nw, grid, st in BWD:
        cfg = pnorm.NormConfig(bwd_block_rows=br, bwd_num_warps=nw, bwd_grid=grid, num_stages=st)
        out[f"f+b rows={br} warps={nw} grid={grid} stages={st}"] = (fb(pal(cfg)), 4)
    return out


def main():
    on_gpu = jax.default_backend() == "gpu"
    print(f"# Norm launch sweep, {jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}; "
          f"bf16 x; TB/s by {'kernel time' if on_gpu else 'host clock'}, median of {ROUNDS} rounds", flush=True)
    for m, d in SHAPES:
        x, g, b, dy = norm_inputs(m, d, seed=m * 7 + d)
        args = (x, g, b, dy)
        pass_bytes = x.size * x.dtype.itemsize
        for op in OPS:
            fns = {}
            for name, (f, passes) in fns_for(op, d).items():
                if name.split(" ")[0] not in DIRS:
                    continue
                try:
                    out = f(*args)
                except Exception as e:  # noqa: BLE001  (a config the compiler refuses: say so, go on)
                    print(f"  {m}x{d} {op} {name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                default = fns.get("fwd default" if name.startswith("fwd") else "f+b default")
                if "xla" not in name and not name.endswith("default") and default is not None:
                    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(default[2])):
                        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))))
                        scale = float(jnp.max(jnp.abs(r.astype(jnp.float32)))) + 1e-6
                        assert err <= 2e-2 * scale, (m, d, op, name, err, scale)
                fns[name] = (f, passes, out)
            res = {name: [] for name in fns}
            for _ in range(ROUNDS):
                for name, (f, passes, _) in fns.items():
                    if on_gpu:
                        t = device_time.profiled(f, args, calls=10)["kernel_s"]
                    else:
                        t = timing.measure(f, args, samples=3)[0]
                    res[name].append(passes * pass_bytes / t / 1e12)
            med = {name: statistics.median(v) for name, v in res.items()}
            for dirn in DIRS:
                cand = {n: v for n, v in med.items() if n.startswith(dirn) and "xla" not in n}
                best = max(cand, key=cand.get)
                print(f"{m}x{d} {op} {dirn}: xla {med[dirn + ' xla']:.2f}  default {med[dirn + ' default']:.2f}  "
                      f"best {cand[best]:.2f} ({best})", flush=True)
            print("   all: " + ", ".join(f"{n}: {v:.2f}" for n, v in med.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
