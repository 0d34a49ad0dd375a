"""Flax linen TransformerLayer (encoder or decoder block), as transformer_engine.jax.flax.TransformerLayer.

Sub-modules (parameter paths): attention (MultiHeadAttention, self), encoder_decoder_attention
(decoder only), mlp (LayerNormMLP), relpos_bias (RelativePositionBiases, when enabled and no
`relative_embedding` module is given), output_layernorm (when output_layernorm).
"""
from __future__ import annotations

import enum
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from te_jax import layouts, sinks
from te_jax.flax._common import (Initializer, batch_seq, check_hidden_input, check_rate, constrain, dropout,
                                 hidden_axes)
from te_jax.flax.attention import MultiHeadAttention, RelativePositionBiases, _check_heads, _query_positions
from te_jax.flax.module import LayerNorm, LayerNormMLP


class TransformerLayerType(enum.Enum):
    """TransformerEngine's layer types; the strings "encoder" / "decoder" work too."""

    ENCODER = "encoder"
    DECODER = "decoder"


def _layer_type(value) -> TransformerLayerType:
    if isinstance(value, TransformerLayerType):
        return value
    if isinstance(value, str) and value.lower() in ("encoder", "decoder"):
        return TransformerLayerType(value.lower())
    raise ValueError(f"TransformerLayer: layer_type={value!r} is unknown; expected 'encoder', 'decoder' or a "
                     "TransformerLayerType.")


class TransformerLayer(nn.Module):
    """One transformer block: self-attention [+ cross-attention] + MLP, each with a residual.

    __call__(inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None, deterministic=False,
             decode=False, max_decode_length=None, *, q_seqlens=None, kv_seqlens=None, q_segment_ids=None,
             kv_segment_ids=None) -> output with the shape of inputs.

    attn_input_format: "bshd" → inputs/outputs [batch, seq, hidden]; "sbhd" → [seq, batch, hidden];
      "thd" → [tokens, hidden] with seqlens / segment ids. (TransformerEngine's
      transpose_batch_sequence=True corresponds to "sbhd".)
    Structure (pre-LN by default): x + drop(attn(LN(x))) [→ + drop(cross_attn(LN(·), encoded))]
      → + drop(mlp(LN(·))). apply_residual_connection_post_layernorm: residuals start from the LN
      output. output_layernorm: no input LayerNorm before self-attention; a LayerNorm on the output.
    layer_type: "encoder" or "decoder" (decoder adds cross-attention over `encoded`,
      mask `encoder_decoder_mask`). self_attn_mask_type applies to self-attention; q_seqlens/... add
      padding; attention_mask / encoder_decoder_mask (TE convention, boolean True = masked out,
      [b, 1, q, kv]) are applied exactly as given (see DotProductAttention's `mask`).
    Dropouts (RNG stream `dropout_rng_name`, off when deterministic): hidden_dropout (after
      attention and MLP, default 0.1), attention_dropout (probabilities, 0.1), intermediate_dropout
      (MLP activation, 0.0), drop_path (stochastic depth per example on each residual branch, 0.0).
    Defaults are TransformerEngine-JAX 2.20's (mlp_activations=("gelu",), intermediate_dropout=0.0,
      mha_kernel_init variance_scaling(1.0, "fan_in", "normal"), mlp_kernel_init the same with
      "truncated_normal"); te_jax/flax/README.md lists the remaining differences.
    dtype: compute dtype (inputs are cast; None: the input's dtype); param_dtype: parameter storage dtype.
    enable_relative_embedding: T5 relative position biases (TE's default True); enable_rotary_pos_emb: RoPE
      in the self-attention and, as TransformerEngine does, in the cross-attention: the decoder tokens are
      rotated at their self-attention positions (0.. counting real tokens when padding is given by segment
      ids or a mask; from the cache when decoding), `encoded` at 0..s_enc-1 (or per encoder segment).
    decode: the self-attention decodes with its KV cache (MultiHeadAttention: per-row valid lengths,
      padding per call from attention_mask / q_seqlens / q_segment_ids, chunks up to max_len, past the cache
      a ValueError eagerly and NaN rows under jit); apply with mutable=["cache"]. The cross-attention
      recomputes its keys/values from `encoded` every call (encoder_decoder_mask then covers this call's
      query rows). Relative position biases are computed over the cache length (the one it was initialised
      with); max_decode_length may be left out, and if given must equal it.
    context_parallel_axis / _strategy / _load_balanced: passed to the self-attention (context-parallel
      attention over that mesh axis).
    softmax_type: "vanilla" (default), "off-by-one" or "learnable" (attention sinks, TransformerEngine's
      names), passed to the self-attention and, as TransformerEngine does, to the cross-attention; with
      "learnable" each owns its parameter `softmax_offset` [h] (attention/softmax_offset,
      encoder_decoder_attention/softmax_offset). See te_jax.dot_product_attention.
    Parameter logical axes: see MultiHeadAttention, LayerNormMLP and te_jax/flax/README.md.
    """

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: int | None = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: tuple = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Initializer | None = None  # None: variance_scaling(1.0, "fan_in", "normal"), as TE
    mlp_kernel_init: Initializer | None = None
    mlp_activations: tuple = ("gelu",)
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: Any = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: str | None = None
    enable_relative_embedding: bool = True
    relative_embedding: nn.Module | None = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    dtype: Any = None  # compute dtype; None: the input's dtype (as TransformerEngine)
    param_dtype: Any = jnp.float32
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    attn_input_format: str = "bshd"
    enable_sequence_parallel: bool = False  # accepted for TE compatibility; shard with logical axis rules
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: tuple[int, int] | None = None
    softcap: float | None = None
    attention_backend: str = "auto"
    norm_backend: str = "auto"
    mlp_backend: str = "auto"
    context_parallel_axis: str | None = None
    context_parallel_strategy: str = "ring"
    context_parallel_load_balanced: bool = False
    softmax_type: str = "vanilla"

    def _validate(self):
        name = "TransformerLayer"
        for f in ("hidden_size", "mlp_hidden_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: {f}={v!r} must be a positive int.")
        _check_heads(name, self.num_attention_heads, self.num_gqa_groups)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{name}: hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}; head_dim = hidden_size / num_attention_heads must be an int.")
        for f in ("hidden_dropout", "attention_dropout", "intermediate_dropout", "drop_path"):
            check_rate(name, f, getattr(self, f))
        layouts.check_format(self.attn_input_format)
        sinks.check_softmax_type(self.softmax_type, name)
        return _layer_type(self.layer_type)

    @nn.compact
    def __call__(self, inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None,
                 deterministic: bool = False, decode: bool = False, max_decode_length=None, *,
                 q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None,
                 encoder_q_seqlens=None, encoder_kv_seqlens=None, encoder_q_segment_ids=None,
                 encoder_kv_segment_ids=None):
        name = "TransformerLayer"
        layer_type = self._validate()
        fmt = self.attn_input_format
        check_hidden_input(inputs, fmt, "inputs", name, self.hidden_size)
        is_decoder = layer_type == TransformerLayerType.DECODER
        if is_decoder:
            if encoded is None:
                raise ValueError(f"{name}: layer_type='decoder' needs `encoded` (the encoder output).")
            check_hidden_input(encoded, fmt, "encoded", name, self.hidden_size)
        elif encoded is not None:
            raise ValueError(f"{name}: `encoded` was passed to an encoder layer; use layer_type='decoder' for "
                             "cross-attention.")
        head_dim = self.hidden_size // self.num_attention_heads
        cdt = self.dtype or inputs.dtype
        x_in = constrain(jnp.asarray(inputs, cdt), fmt)
        seq_axis, batch_axis = {"bshd": (1, 0), "sbhd": (0, 1), "thd": (0, None)}[fmt]

        # The self-attention's KV cache (decode): its length and each row's valid length, before this call.
        cache = self.variables.get("cache", {}).get("attention", {}) if decode else {}
        cache_index = cache.get("cache_index")
        max_len = cache["cached_key"].shape[1] if "cached_key" in cache else inputs.shape[seq_axis]
        if decode and max_decode_length is not None and max_decode_length != max_len:
            raise ValueError(
                f"{name}: max_decode_length={max_decode_length} but the KV cache holds {max_len} tokens per row "
                f"(the length of the input it was initialised with): pass max_decode_length={max_len}, or leave it "
                f"out (the cache's length is used), or initialise with an input of {max_decode_length} tokens.")

        attn_bias = None
        if self.enable_relative_embedding:
            rel_emb = self.relative_embedding or RelativePositionBiases(
                num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads,
                dtype=self.dtype or jnp.float32, param_dtype=self.param_dtype, name="relpos_bias")
            length = max_len if decode else inputs.shape[seq_axis]
            # decoding: [1, h, max_len, max_len] by token position; the attention takes each row's rows
            attn_bias = rel_emb(length, length, not is_decoder)

        mha_common = dict(
            head_dim=head_dim, num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
            attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
            layernorm_type=self.layernorm_type, layernorm_epsilon=self.layernorm_epsilon,
            zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=self.apply_residual_connection_post_layernorm, use_bias=self.use_bias,
            bias_init=self.bias_init,
            kernel_init=self.mha_kernel_init or nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
            enable_rotary_pos_emb=self.enable_rotary_pos_emb, rotary_pos_emb_windows=self.rotary_pos_emb_windows,
            rotary_pos_emb_group_method=self.rotary_pos_emb_group_method, dtype=self.dtype,
            param_dtype=self.param_dtype, fuse_qkv_params=self.fuse_qkv_params, attn_input_format=fmt,
            scale_attn_logits=self.scale_attn_logits, scaled_query_init=self.scaled_query_init,
            float32_logits=self.float32_attention_logits, softcap=self.softcap, backend=self.attention_backend,
            norm_backend=self.norm_backend, softmax_type=self.softmax_type)

        def hidden_drop(y):
            dims = tuple(self.hidden_dropout_dims)
            return dropout(self, y, self.hidden_dropout, deterministic, self.dropout_rng_name, dims)

        def path_drop(y):
            if self.drop_path == 0.0 or deterministic:
                return y
            bcast = tuple(i for i in range(y.ndim) if i != batch_axis) if batch_axis is not None else ()
            return dropout(self, y, self.drop_path, deterministic, self.dropout_rng_name, bcast)

        # self-attention; return_residual: the skip connection's input (x_in, or the norm's output with
        # apply_residual_connection_post_layernorm) comes back from the attention, out of the FP8 fused norm where
        # that runs, so its gradient is added in the norm's backward pass
        x, residual = MultiHeadAttention(
            input_layernorm=not self.output_layernorm, attn_mask_type=self.self_attn_mask_type, return_residual=True,
            attn_bias_type=self.self_attn_bias_type, window_size=self.window_size,
            context_parallel_axis=self.context_parallel_axis,
            context_parallel_strategy=self.context_parallel_strategy,
            context_parallel_load_balanced=self.context_parallel_load_balanced, name="attention",
            **mha_common)(x_in, None, attention_mask, attn_bias, decode=decode, deterministic=deterministic,
                          q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids,
                          kv_segment_ids=kv_segment_ids)
        x = path_drop(hidden_drop(x))
        x = constrain(x + residual, fmt)

        mlp_input = x
        if is_decoder:
            residual = x
            q_positions = None
            if self.enable_rotary_pos_emb:  # the decoder tokens' own positions, as in the self-attention
                b, s = batch_seq(inputs, fmt)
                q_positions = _query_positions(
                    fmt, b, s, mask=attention_mask, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                    q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                    cache_index=cache_index, module=name)
            y, ln_out = MultiHeadAttention(
                input_layernorm=True, attn_mask_type="padding", name="encoder_decoder_attention",
                **mha_common)(x, jnp.asarray(encoded, cdt), encoder_decoder_mask, None,
                              deterministic=deterministic, q_seqlens=encoder_q_seqlens,
                              kv_seqlens=encoder_kv_seqlens, q_segment_ids=encoder_q_segment_ids,
                              kv_segment_ids=encoder_kv_segment_ids, q_positions=q_positions)
            y = hidden_drop(y)
            if self.apply_residual_connection_post_layernorm:
                residual = ln_out
            mlp_input = constrain(y + residual, fmt)

        z, residual = LayerNormMLP(
            intermediate_dim=self.mlp_hidden_size, layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            kernel_init=self.mlp_kernel_init, use_bias=self.use_bias, bias_init=self.bias_init,
            return_layernorm_output=self.apply_residual_connection_post_layernorm, return_residual=True,
            activations=self.mlp_activations, intermediate_dropout_rng_name=self.dropout_rng_name,
            intermediate_dropout_rate=self.intermediate_dropout, dtype=self.dtype, param_dtype=self.param_dtype,
            backend=self.mlp_backend, layernorm_input_axes=hidden_axes(fmt), name="mlp")(
                mlp_input, deterministic=deterministic)
        z = path_drop(hidden_drop(z))
        z = constrain(z + residual, fmt)

        if self.output_layernorm:
            z = LayerNorm(epsilon=self.layernorm_epsilon, layernorm_type=self.layernorm_type,
                          zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype,
                          param_dtype=self.param_dtype, backend=self.norm_backend,
                          layernorm_input_axes=hidden_axes(fmt), name="output_layernorm")(z)
        return z
