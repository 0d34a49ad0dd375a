"""A first look at te_jax: causal GQA attention on random data, with the backend choice explained.

    python examples/quickstart.py
"""
import jax
import jax.numpy as jnp

import te_jax


def main():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    batch, seq, heads, kv_heads, head_dim = 2, 128, 8, 2, 64
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.float32)

    print(te_jax.explain_attention_backend(q, k, v, attn_input_format="bshd", attn_mask_type="causal"))
    attn = jax.jit(lambda q, k, v: te_jax.dot_product_attention(
        q, k, v, attn_input_format="bshd", attn_mask_type="causal"))
    out = attn(q, k, v)
    ref = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="xla")
    print(f"output {out.shape} {out.dtype}; max |out - xla reference| = {float(jnp.max(jnp.abs(out - ref))):.2e}")


if __name__ == "__main__":
    main()
