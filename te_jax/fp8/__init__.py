"""FP8 training for te_jax, after TransformerEngine: recipes (recipe.py), quantization math and the FP8
GEMM (quantize.py), autocast and explanations (context.py), Flax state helpers (state.py), the MLP with fused
quantization (mlp.py, over the pallas_kernels/fp8_cast kernels).

    from te_jax import fp8
    with fp8.autocast(recipe=fp8.DelayedScaling()):
        variables = model.init(key, x)
        ...
"""
from te_jax.fp8.recipe import (  # noqa: F401
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    Recipe,
)
from te_jax.fp8.quantize import fp8_dot_general  # noqa: F401
from te_jax.fp8.context import autocast, explain, fp8_autocast, get_autocast, is_fp8_enabled  # noqa: F401
from te_jax.fp8.state import FP8_COLLECTION, split_fp8_state, update_fp8_state  # noqa: F401

__all__ = ["DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "Format", "Recipe", "fp8_dot_general",
           "autocast", "fp8_autocast", "explain", "get_autocast", "is_fp8_enabled", "FP8_COLLECTION",
           "split_fp8_state", "update_fp8_state"]
