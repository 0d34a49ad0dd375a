"""A plain-Flax Llama-style block whose Dense layers take flax's `nn.Fp8DotGeneralOp` (the FP8 peer row of
benchmarks/fp8_layer_gpu.py), or plain bf16 dots. Same shapes and math as the te_jax layer there: RMSNorm, q / kv /
out projections without bias, RoPE, causal GQA attention (jax.nn.dot_product_attention, cuDNN on the GPU), SwiGLU
MLP, residuals. `fp8=True` puts every projection's dot_general through nn.Fp8DotGeneralOp (its delayed-scaling state
lives in flax's OVERWRITE_WITH_GRADIENT collection, like te_jax's)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def _rope(x, base=10000.0):
    """x [b, s, h, d] rotated by position (half-split convention)."""
    d = x.shape[-1]
    inv = 1.0 / base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv[None]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class FlaxLlamaBlock(nn.Module):
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    fp8: bool = False
    dtype: jnp.dtype = jnp.bfloat16
    attn_impl: str | None = None  # jax.nn.dot_product_attention implementation (None: XLA picks; "cudnn" on GPU)

    def _dense(self, feats, name):
        kw = {"dot_general_cls": nn.Fp8DotGeneralOp} if self.fp8 else {}
        return nn.Dense(feats, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name=name, **kw)

    @nn.compact
    def __call__(self, x, deterministic=True):
        del deterministic
        b, s, _ = x.shape
        hd = self.hidden // self.heads
        h = nn.RMSNorm(dtype=self.dtype, param_dtype=self.dtype, name="ln1")(x)
        q = self._dense(self.heads * hd, "q")(h).reshape(b, s, self.heads, hd)
        kv = self._dense(2 * self.kv_heads * hd, "kv")(h).reshape(b, s, 2, self.kv_heads, hd)
        k, v = kv[:, :, 0], kv[:, :, 1]
        o = jax.nn.dot_product_attention(_rope(q), _rope(k), v, is_causal=True, implementation=self.attn_impl)
        x = x + self._dense(self.hidden, "out")(o.reshape(b, s, self.heads * hd))
        h = nn.RMSNorm(dtype=self.dtype, param_dtype=self.dtype, name="ln2")(x)
        gu = self._dense(2 * self.ffn, "wi")(h)
        g, u = jnp.split(gu, 2, axis=-1)
        return x + self._dense(self.hidden, "wo")(nn.silu(g) * u)
