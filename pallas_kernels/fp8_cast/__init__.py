"""FP8 cast kernels: activation + cast (+ transpose), dActivation + cast + transpose, cast + transpose, each
with the amax of what it cast (TransformerEngine's fused quantization kernels), a norm + its statistics + cast +
transpose, several arrays cast with their transposes stacked, TMA twins of the casts (tma.py, Hopper only), and a
plain-jnp reference."""
from pallas_kernels.fp8_cast.kernels import (  # noqa: F401
    act_amax,
    act_cast,
    cast_transpose,
    cast_transposed,
    dact_amax,
    dact_cast_transpose,
    norm_cast_transpose,
)
from pallas_kernels.fp8_cast.many import cast_transpose_many, many_block  # noqa: F401
from pallas_kernels.fp8_cast.norm_stats import norm_stats_cast_transpose  # noqa: F401
from pallas_kernels.fp8_cast.tma import act_cast_tma, cast_transpose_tma, dact_cast_transpose_tma  # noqa: F401
