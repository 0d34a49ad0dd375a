"""Flax linen modules of te_jax, named and parameterised as `transformer_engine.jax.flax`.

Switch from TransformerEngine by changing the import and replacing
`transpose_batch_sequence=True/False` with `attn_input_format="sbhd"/"bshd"`.
NNX versions: `te_jax.flax.nnx`. Logical axis names and sharding rules: te_jax/flax/README.md.
"""
from te_jax.flax.attention import (
    DotProductAttention,
    MultiHeadAttention,
    RelativePositionBiases,
    apply_rotary_pos_emb,
)
from te_jax.flax.module import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP
from te_jax.flax.transformer import TransformerLayer, TransformerLayerType

__all__ = [
    "DenseGeneral",
    "DotProductAttention",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
    "apply_rotary_pos_emb",
]
