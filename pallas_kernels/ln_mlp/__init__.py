"""LayerNorm-MLP / LayerNorm-Dense: memory-lean custom_vjp over the Pallas norm kernels (and an
optional fused LN-prologue Pallas GEMM), plus a plain-XLA reference."""
from pallas_kernels.ln_mlp.ln_mlp import layernorm_dense, layernorm_mlp  # noqa: F401
