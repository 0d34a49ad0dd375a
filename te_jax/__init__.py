"""te_jax: transformer layers for JAX with Pallas GPU kernels.

Functional ops live at the top level; Flax modules in `te_jax.flax`.
"""
from te_jax.attention import (
    dot_product_attention,
    dot_product_attention_packed,
    explain_attention_backend,
    explain_attention_backend_packed,
)
from te_jax.backends.selection import BACKEND_NAMES as ATTENTION_BACKENDS, BackendChoice
from te_jax.layouts import FORMATS, QKV_LAYOUTS, from_bshd, infer_qkv_layout, to_bshd, unpack_qkv
from te_jax.masks import MASK_TYPES
from te_jax.sinks import SOFTMAX_TYPES
from te_jax.normalization import explain_norm_backend, layernorm, norm, rmsnorm
from te_jax.mlp import explain_mlp_backend, layernorm_dense, layernorm_mlp
from te_jax.paged_decode import explain_paged_decode_backend, paged_decode_attention
from te_jax.context_parallel import (
    context_parallel_attention,
    explain_context_parallel_backend,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)

__version__ = "0.2.0"

__all__ = [
    "ATTENTION_BACKENDS", "BackendChoice", "FORMATS", "MASK_TYPES", "QKV_LAYOUTS", "SOFTMAX_TYPES",
    "dot_product_attention", "dot_product_attention_packed", "explain_attention_backend",
    "explain_attention_backend_packed", "from_bshd", "infer_qkv_layout",
    "to_bshd", "unpack_qkv",
    "layernorm", "rmsnorm", "norm", "explain_norm_backend",
    "layernorm_mlp", "layernorm_dense", "explain_mlp_backend",
    "paged_decode_attention", "explain_paged_decode_backend",
    "context_parallel_attention", "explain_context_parallel_backend", "reorder_causal_load_balancing", "inverse_reorder_causal_load_balancing",
]
