"""FP8 cast kernels: activation + cast (+ transpose), dActivation + cast + transpose, cast + transpose, each
with the amax of what it cast (TransformerEngine's fused quantization kernels), and a plain-jnp reference."""
from pallas_kernels.fp8_cast.kernels import (  # noqa: F401
    act_amax,
    act_cast,
    cast_transpose,
    cast_transposed,
    dact_amax,
    dact_cast_transpose,
    norm_cast_transpose,
)
