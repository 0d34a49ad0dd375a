"""GPU benchmark of the block casts of Float8BlockScaling (pallas_kernels/fp8_gemm: block_cast_transpose,
act_block_cast, dact_block_cast_transpose) against XLA doing the same math, at the Llama MLP's shapes (tokens
M = 4 x 2048, hidden 4096, SwiGLU FFN 14336, bf16), each with num_warps 8 and 16.

    PYTHONPATH=. python3 -m benchmarks.fp8_block_cast_gpu [--rounds 3]

  cast rows   x [M, 4096]       -> q, its 1x128 scales, q^T, its scales           (block.py's activation cast)
  act         gu [M, 2, F]      -> a's 1x128 casts (both layouts)                 (forward, after the wi GEMM)
  dact        dh [M, F], gu     -> dgu's 1x128 casts as [M, 2F] (both layouts)     (backward, before the wi GEMMs)
"xla" is quantize_blocks of the activation (and of its transpose) under jit. TB/s of the kernel's minimal traffic
(inputs read once, outputs written once, scales included), so every variant is rated on the same bytes; 3
interleaved rounds (benchmarks.timing.bandwidth_rounds). Correctness: each kernel's FP8 values against xla's.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from pallas_kernels.fp8_cast import common as C
from pallas_kernels.fp8_gemm import act_block_cast, block_cast_transpose, dact_block_cast_transpose, quantize_blocks

E4, E5, BF = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16


def _xla_rows(v, dtype):
    q, s = quantize_blocks(v, (1, 128), dtype)
    qt, st = quantize_blocks(v.T, (1, 128), dtype)
    return q, s.T, qt, st.T


def _xla_act(gu):
    return _xla_rows(C.act_fn("silu", True)(gu[:, 0].astype(jnp.float32), gu[:, 1].astype(jnp.float32)).astype(BF),
                     E4)


def _xla_dact(dh, gu):
    parts = C.dact("silu", True, dh.astype(jnp.float32), gu[:, 0].astype(jnp.float32), gu[:, 1].astype(jnp.float32))
    return _xla_rows(jnp.concatenate([p.astype(BF) for p in parts], axis=1), E5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    m, d, f = args.tokens, 4096, 14336
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (m, d), jnp.float32).astype(BF)
    gu = (jax.random.normal(k[1], (m, 2, f), jnp.float32) * 2).astype(BF)
    dh = jax.random.normal(k[2], (m, f), jnp.float32).astype(BF)
    fp8_out = lambda n_elems: 2 * n_elems + 2 * 4 * n_elems // 128  # both FP8 copies and their scales
    cases = {
        "cast rows": ((x,), 2 * m * d + fp8_out(m * d), lambda x: _xla_rows(x, E4),
                      lambda kw: (lambda x: block_cast_transpose(x, out_dtype=E4, tiles="rows", **kw))),
        "act": ((gu,), 2 * m * 2 * f + fp8_out(m * f), _xla_act,
                lambda kw: (lambda gu: act_block_cast(gu, activation="silu", out_dtype=E4, round_to=BF, **kw))),
        "dact": ((dh, gu), 2 * m * f + 2 * m * 2 * f + fp8_out(m * 2 * f), _xla_dact,
                 lambda kw: (lambda dh, gu: dact_block_cast_transpose(dh, gu, activation="silu", out_dtype=E5,
                                                                      round_to=BF, **kw))),
    }
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; tokens {m}, hidden {d}, FFN {f}", flush=True)
    for name, (operands, nbytes, xla, kernel) in cases.items():
        variants = {"xla": jax.jit(xla)}
        variants.update({f"kernel, {w} warps": jax.jit(kernel(dict(num_warps=w))) for w in (8, 16)})
        want = variants["xla"](*operands)
        for vname, fn in variants.items():
            got = fn(*operands)
            diff = max(float(np.mean(np.asarray(a, np.float32) != np.asarray(b, np.float32)))
                       for a, b in zip(got[::2], want[::2]))
            print(f"{name} {vname}: FP8 elements differing from xla {diff:.2e}", flush=True)
        timing.bandwidth_rounds(variants, operands, nbytes, rounds=args.rounds, samples=10, inner=5,
                                title=f"{name} ({nbytes / 1e6:.0f} MB minimal traffic)")


if __name__ == "__main__":
    main()
