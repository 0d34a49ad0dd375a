"""Float8BlockScaling through FP8 GEMMs with block scales (pallas_kernels.fp8_gemm), the DeepSeek-V3 recipe.

    block_gemm_mode() -> "xla" | "pallas" | "emulate"   (env TE_JAX_FP8_BLOCK_GEMM, read at trace time)
      "auto" (default): "pallas" where this process can run the Hopper kernels (an sm90 GPU, jax >= 0.11), else
                "xla";
      "xla": quantize.py's reference (dequantize per block, GEMM in the compute dtype: FP8 numerics, not FP8
                speed);
      "pallas": the Hopper kernel on a persistent grid (pallas_kernels.fp8_gemm.block_scaled_gemm_persistent:
                pairs of CTAs share each weight tile by TMA multicast when M is a multiple of 256), sm90 only
                (speed: benchmarks/results/fp8_layer_h100.md, fp8_block_gemm_h100.md);
      "emulate": this module's layouts and scales with the kernel replaced by its jnp reference. The CPU tests
                 use it to check the plumbing against the "xla" path (same numerics).
    block_promotion(recipe) -> "rescale" | "serial"   (env TE_JAX_FP8_BLOCK_PROMOTION overrides the recipe)
      how the kernel sums the K blocks' products: "rescale" (recipe.use_split_accumulator False, the default): the
      running sum stays in the tensor cores' accumulator, rescaled to each K block's scales, on 128 x 256 tiles
      where N allows; "serial" (True): each block's product is promoted into fp32 registers (DeepSeek-V3's
      promotion) on 128 x 128 tiles. pallas_kernels/fp8_gemm/persistent.py describes both.
    block_gemm_reason(x_shape, w_shape, n_contract) -> None or why the block GEMM path cannot take the operands.
    block_scaled_dot(x [..., K], w [K, N], recipe, out_dtype, mode) -> [..., N]   (custom VJP)

The three GEMMs, each "TN" with per-row scales per 128-wide contraction block (M = tokens):
  forward  y  = x_q   [M, K] (1x128 tiles along K) . w^T_q [N, K] (128x128 tiles)
  dgrad    dx = g_q   [M, N] (1x128 along N)       . w_q   [K, N] (the same 128x128 tiles, transposed)
  wgrad    dw = x^T_q [K, M] (1x128 along M)       . g^T_q [N, M] (1x128 along M)
The weight tiles are square, so w and w^T quantize to the same values: each is cast in its own layout.
Quantization: each operand and its transpose in one pass of pallas_kernels.fp8_gemm.block_cast_transpose where
the FP8 casts are fused (TE_JAX_FP8_FUSED: on a GPU by default), else two XLA quantizations. The forward keeps
x^T's FP8 copy for the wgrad; the weight is re-cast in the backward, or (fused.keep_weight_copies(recipe,
dense=True)) its forward cast writes both layouts and the backward takes w_q as it is.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_gemm import (BLOCK_K, block_cast_transpose, block_scaled_gemm_persistent,
                                     block_scaled_gemm_reference, quantize_blocks, row_scales)
from te_jax.backends import policy
from te_jax.fp8.fused import fused_setting, keep_weight_copies

BLOCK_GEMM_ENV = "TE_JAX_FP8_BLOCK_GEMM"
BLOCK_GEMM_MODES = ("auto", "xla", "pallas", "emulate")
BLOCK_PROMOTION_ENV = "TE_JAX_FP8_BLOCK_PROMOTION"
BLOCK_PROMOTIONS = ("recipe", "rescale", "serial")


def block_gemm_mode() -> str:
    """The block GEMM path this trace takes: "xla", "pallas" or "emulate" ("auto" resolved: see the docstring)."""
    mode = policy.env_choice(BLOCK_GEMM_ENV, BLOCK_GEMM_MODES, "auto")
    if mode == "auto":
        from te_jax.backends.pallas import hopper_device_reason

        mode = "pallas" if hopper_device_reason() is None else "xla"
    return mode


def block_promotion(recipe) -> str:
    """"rescale" or "serial" (module docstring): TE_JAX_FP8_BLOCK_PROMOTION when set to one of them, else from
    recipe.use_split_accumulator."""
    choice = policy.env_choice(BLOCK_PROMOTION_ENV, BLOCK_PROMOTIONS, "recipe")
    if choice != "recipe":
        return choice
    return "serial" if recipe.use_split_accumulator else "rescale"


def block_gemm_reason(x_shape, w_shape, n_contract: int) -> str | None:
    """Why block_scaled_dot cannot take x [..., K...] . w [K..., N...] (None when it can): every one of M, K and
    N must be a multiple of 128 (the scale blocks and the kernel's tiles), and no mesh axis may be partitioned by
    XLA around the call (the Pallas kernels would run replicated: policy.pallas_replicated_reason)."""
    k = math.prod(x_shape[len(x_shape) - n_contract:])
    m = math.prod(x_shape[:len(x_shape) - n_contract])
    n = math.prod(w_shape[n_contract:])
    bad = [f"{name}={v}" for name, v in (("tokens M", m), ("K", k), ("N", n)) if v % BLOCK_K]
    if bad:
        return f"{', '.join(bad)} not a multiple of {BLOCK_K}"
    axes = policy.partitioned_mesh_axes()
    return policy.pallas_replicated_reason(axes) if axes else None


def block_gemm(mode, out_dtype, b_is_weight: bool, promotion: str = "rescale"):
    """The block GEMM of `mode`, a function (a [M, K], b [N, K], a_scales [K/128, M], b_scales [K/128, N]) ->
    [M, N] out_dtype; b_is_weight: b is in 128x128 tiles (one scale per K block and 128 rows); promotion: what
    block_promotion returns ("rescale" tiles are 256 columns wide where N is a multiple of 256)."""
    if mode == "emulate":
        return lambda a, b, sa, sb: block_scaled_gemm_reference(a, b, sa, sb, out_dtype)

    def gemm(a, b, sa, sb):
        wide = promotion == "rescale" and b.shape[0] % (2 * BLOCK_K) == 0
        return block_scaled_gemm_persistent(a, b, sa, sb, out_dtype=out_dtype, b_uniform=b_is_weight,
                                            cluster_m=a.shape[0] % (2 * BLOCK_K) == 0, promotion=promotion,
                                            block_n=2 * BLOCK_K if wide else BLOCK_K)  # stages: what fits

    return gemm


def block_cast(a, dtype, tiles: str, fused: bool, write: str = "both"):
    """a [R, C] -> (q [R, C], its scales [C/128, R], q^T [C, R], its scales [R/128, C]) in 1x128 ("rows") or
    128x128 ("square") tiles: one pass of pallas_kernels.fp8_gemm.block_cast_transpose when fused, else XLA
    (quantize_blocks of a and of a^T: the same values). write "q" / "qt": only that layout (the other pair None)."""
    if fused:
        return block_cast_transpose(a, out_dtype=dtype, tiles=tiles, write=write)
    block = (1, BLOCK_K) if tiles == "rows" else (BLOCK_K, BLOCK_K)
    out = [None] * 4
    if write in ("both", "q"):
        q, s = quantize_blocks(a, block, dtype)
        out[:2] = q, (s.T if tiles == "rows" else row_scales(s, BLOCK_K))
    if write in ("both", "qt"):
        qt, st = quantize_blocks(a.T, block, dtype)
        out[2:] = qt, (st.T if tiles == "rows" else row_scales(st, BLOCK_K))
    return tuple(out)


def block_casts_fused() -> bool:
    """Whether the block casts run in the Pallas kernels (te_jax/fp8/fused.py's switch: a GPU by default)."""
    setting = fused_setting()
    return setting == "1" or (setting == "auto" and jax.default_backend() == "gpu")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def _dot(x2, w2, fwd_dtype, bwd_dtype, out_dtype, mode, fused, promotion, keep):
    return _dot_fwd(x2, w2, fwd_dtype, bwd_dtype, out_dtype, mode, fused, promotion, keep)[0]


def _dot_fwd(x2, w2, fwd_dtype, bwd_dtype, out_dtype, mode, fused, promotion, keep):
    xq, xs, xqt, xts = block_cast(x2, fwd_dtype, "rows", fused)
    wq, ws, wqt, wts = block_cast(w2, fwd_dtype, "square", fused, write="both" if keep else "qt")
    # saved: x's transposed copy for the wgrad (FP8); the weight's FP8 copy when kept, else it is re-cast
    kept = (wq, ws) if keep else None
    return (block_gemm(mode, out_dtype, True, promotion)(xq, wqt, xs, wts),
            (xqt, xts, w2, jnp.zeros((), x2.dtype), kept))


def _dot_bwd(fwd_dtype, bwd_dtype, out_dtype, mode, fused, promotion, keep, res, g):
    xqt, xts, w2, x_dtype_carrier, kept = res
    gq, gs, gqt, gts = block_cast(g, bwd_dtype, "rows", fused)
    wq, ws = kept if kept is not None else block_cast(w2, fwd_dtype, "square", fused, write="q")[:2]
    dx = block_gemm(mode, x_dtype_carrier.dtype, True, promotion)(gq, wq, gs, ws)
    dw = block_gemm(mode, w2.dtype, False, promotion)(xqt, gqt, xts, gts)
    return dx, dw


_dot.defvjp(_dot_fwd, _dot_bwd)


def block_scaled_dot(x, w, n_contract: int, recipe, out_dtype, mode: str):
    """x [..., K...] . w [K..., N...] under Float8BlockScaling with FP8 block GEMMs (see the module docstring);
    the caller checked block_gemm_reason."""
    fmt = recipe.fp8_format
    k = math.prod(x.shape[x.ndim - n_contract:])
    y = _dot(x.reshape(-1, k), w.reshape(k, -1), fmt.fwd_dtype, fmt.bwd_dtype, jnp.dtype(out_dtype), mode,
             block_casts_fused(), block_promotion(recipe), keep_weight_copies(recipe, dense=True))
    return y.reshape(x.shape[:x.ndim - n_contract] + w.shape[n_contract:])


__all__ = ["BLOCK_GEMM_ENV", "BLOCK_GEMM_MODES", "BLOCK_PROMOTION_ENV", "BLOCK_PROMOTIONS", "block_cast",
           "block_casts_fused", "block_gemm", "block_gemm_mode", "block_gemm_reason", "block_promotion",
           "block_scaled_dot"]
