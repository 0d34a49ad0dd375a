"""Block-scaled FP8 GEMM (the DeepSeek-V3 recipe: 1x128 activation tiles, 128x128 weight tiles) on Hopper, and its
plain-jnp reference and quantization, and the one-pass block casts (cast.py; fused with the MLP's activation in
act_cast.py). The GEMM kernels: kernel.py (one CTA per tile) and persistent.py (what te_jax runs)."""
from pallas_kernels.fp8_gemm.act_cast import act_block_cast, dact_block_cast_transpose  # noqa: F401
from pallas_kernels.fp8_gemm.cast import block_cast_transpose  # noqa: F401
from pallas_kernels.fp8_gemm.kernel import BLOCK_M, block_scaled_gemm, gemm_shape_reason  # noqa: F401
from pallas_kernels.fp8_gemm.persistent import PROMOTIONS, block_scaled_gemm_persistent  # noqa: F401
from pallas_kernels.fp8_gemm.reference import (  # noqa: F401
    BLOCK_K,
    block_scaled_gemm_reference,
    quantize_blocks,
    row_scales,
)
from pallas_kernels.fp8_gemm.rescale import rescale_factors  # noqa: F401
