"""FP8 recipes: what to quantize and how, with TransformerEngine's names and defaults.

Mirrors `transformer_engine/common/recipe` (the recipe, a plain description) which TransformerEngine keeps
apart from `transformer_engine/jax/quantize` (the math that carries it out; here te_jax/fp8/quantize.py).

    Format.E4M3     every FP8 tensor in float8_e4m3fn (max 448)
    Format.E5M2     every FP8 tensor in float8_e5m2 (max 57344)
    Format.HYBRID   forward tensors (activations, weights) in E4M3, backward (output gradients) in E5M2

    DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")
        one fp32 scale per tensor, computed from a window of past amaxes (te_jax.fp8.quantize.delayed_update):
        the amax of step t is written to amax_history[0], the scale for step t+1 is
        fp8_max / amax / 2**margin with amax = max(history) ("max") or history[0] ("most_recent"),
        then the history rotates by -1 and slot 0 is zeroed. Needs state (a Flax variable collection).
    Float8CurrentScaling(fp8_format=Format.HYBRID)
        one fp32 scale per tensor from the tensor's own amax (an extra read of the tensor), no state.
    Float8BlockScaling(fp8_format=Format.E4M3)
        DeepSeek-V3 style: one scale per 1x128 tile of activations and gradients, per 128x128 tile of
        weights. On XLA this is a REFERENCE implementation (quantize per block -> dequantize -> GEMM in the
        compute dtype): the numerics of block scaling, NOT an FP8 GEMM (cuBLASLt's per-tensor FP8 GEMM takes
        one scale per operand). te_jax.fp8.explain says so per GEMM.

Recipes are frozen dataclasses (hashable: usable as static arguments and jit cache keys). Invalid fields
raise ValueError naming the field.
"""
from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp


class Format(enum.Enum):
    """FP8 data formats of the forward and backward tensors (TransformerEngine's `Format`)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def fwd_dtype(self):
        """dtype of forward tensors (activations, weights)."""
        return jnp.float8_e5m2 if self is Format.E5M2 else jnp.float8_e4m3fn

    @property
    def bwd_dtype(self):
        """dtype of backward tensors (the output gradient)."""
        return jnp.float8_e4m3fn if self is Format.E4M3 else jnp.float8_e5m2

    @property
    def max_fwd(self) -> float:
        return float(jnp.finfo(self.fwd_dtype).max)

    @property
    def max_bwd(self) -> float:
        return float(jnp.finfo(self.bwd_dtype).max)


AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _check_format(cls: str, value):
    if not isinstance(value, Format):
        raise ValueError(f"{cls}: fp8_format={value!r} must be a te_jax.fp8.Format "
                         f"({', '.join('Format.' + f.name for f in Format)}).")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Recipe:
    """Base class of the FP8 recipes."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scaling from an amax history (TransformerEngine's DelayedScaling, same defaults).

    margin: the scale is divided by 2**margin (headroom against growth), >= 0.
    fp8_format: Format (HYBRID: E4M3 forward, E5M2 gradients).
    amax_history_len: length of the amax window per tensor, >= 1.
    amax_compute_algo: "max" (max over the window) or "most_recent" (this step's amax).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        if not (isinstance(self.margin, (int, float)) and not isinstance(self.margin, bool)) or self.margin < 0:
            raise ValueError(f"DelayedScaling: margin={self.margin!r} must be a number >= 0.")
        _check_format("DelayedScaling", self.fp8_format)
        if not _is_int(self.amax_history_len) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling: amax_history_len={self.amax_history_len!r} must be an int >= 1.")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"DelayedScaling: amax_compute_algo={self.amax_compute_algo!r} must be one of "
                             f"{AMAX_COMPUTE_ALGOS} (a callable is not supported).")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from the tensor's own amax, computed just before the cast (no state)."""

    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        _check_format("Float8CurrentScaling", self.fp8_format)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """Block scaling (DeepSeek-V3): 1 x `x_block` tiles for activations/gradients along the contraction,
    `w_block` x `w_block` tiles for weights; one fp32 scale per tile (amax of the tile).

    On XLA a reference implementation (dequantize per block, GEMM in the compute dtype): the numerics,
    not an FP8 GEMM. TransformerEngine's default format is E4M3 for this recipe.

    use_split_accumulator (TransformerEngine's name, one switch for the three GEMMs): whether the Hopper block
    GEMM promotes each 128-wide K block's product into fp32 registers (True: DeepSeek-V3's promotion, and
    TransformerEngine's default for this recipe) or keeps the running sum in the tensor cores' accumulator,
    rescaled to each block's scales (False, te_jax's default: 128 x 256 tiles, 10-20% faster GEMMs on the H100,
    the accumulation of cuBLASLt's fast-accumulation FP8 GEMMs that the per-tensor recipes use;
    benchmarks/results/fp8_block_gemm_h100.md). The reference path ignores it.
    """

    fp8_format: Format = Format.E4M3
    x_block: int = 128
    w_block: int = 128
    use_split_accumulator: bool = False

    def __post_init__(self):
        _check_format("Float8BlockScaling", self.fp8_format)
        for name in ("x_block", "w_block"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"Float8BlockScaling: {name}={v!r} must be an int >= 1.")
        if not isinstance(self.use_split_accumulator, bool):
            raise ValueError(f"Float8BlockScaling: use_split_accumulator={self.use_split_accumulator!r} must be a "
                             "bool.")


RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)


def check_recipe(recipe, where: str = "recipe"):
    """recipe if it is one of RECIPES, else ValueError naming `where`."""
    if not isinstance(recipe, RECIPES):
        raise ValueError(f"{where}={recipe!r} must be one of te_jax.fp8.DelayedScaling(), "
                         "Float8CurrentScaling(), Float8BlockScaling().")
    return recipe


__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "AMAX_COMPUTE_ALGOS", "RECIPES", "check_recipe"]
