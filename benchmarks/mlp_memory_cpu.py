"""Compiled temp bytes of the layernorm_mlp grad step at the GPU benchmark's shape, on the CPU
(compile only, nothing runs): plain JAX vs te_jax's recompute path. XLA:CPU's buffer assignment is
not the GPU's, so the absolute numbers differ; the comparison shows what a change does.

    PYTHONPATH=. python benchmarks/mlp_memory_cpu.py
"""
from __future__ import annotations

import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.argv = sys.argv[:1]  # norms_mlp_gpu reads its own flags at import
import norms_mlp_gpu as bench  # noqa: E402

TOKENS, HIDDEN, FFN = 8192, 4096, 16384


def temp_mib(fn, args, dy):
    def step(*a):
        _, vjp = jax.vjp(fn, *a[:-1])
        return vjp(a[-1])
    compiled = jax.jit(step).lower(*args, dy).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20


def main():
    print(f"layernorm_mlp grad step, {TOKENS} tokens, hidden {HIDDEN}, FFN {FFN}, bf16; XLA:CPU temp MiB")
    for acts in [("gelu",), ("silu", "linear")]:
        args, dy = bench.mlp_inputs(4, TOKENS, HIDDEN, FFN, acts)
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        dy = jax.ShapeDtypeStruct(dy.shape, dy.dtype)
        plain = temp_mib(bench.VARIANTS["plain JAX (xla)"](acts), args, dy)
        te = temp_mib(bench.VARIANTS["recompute vjp, XLA norm"](acts), args, dy)
        print(f"  {'+'.join(acts):12s} plain JAX {plain:7.0f}   te_jax recompute vjp {te:7.0f}   ({te / plain:.2f}x)")


if __name__ == "__main__":
    main()
