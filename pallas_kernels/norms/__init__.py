"""LayerNorm / RMSNorm Pallas kernels (forward + backward, custom_vjp) and a plain-jnp reference."""
from pallas_kernels.norms.norm import (  # noqa: F401
    MAX_HIDDEN,
    NormConfig,
    layernorm,
    norm_bwd,
    norm_fwd,
    rmsnorm,
)
