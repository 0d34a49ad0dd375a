"""Cases shared by more than one benchmark script (import as `from benchmarks import cases`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# The dense attention table (issue #7): bf16, batch * seq = 16384 tokens, 16 heads x head_dim 128 (hidden 2048;
# other head dims keep the hidden size: heads = ATTENTION_HIDDEN // head_dim), every seq causal and not.
# attention_hopper_gpu.py (host clock, every peer) and attention_hopper_rounds_gpu.py (interleaved rounds,
# kernel time) time these rows.
ATTENTION_TOKENS = 16384
ATTENTION_HIDDEN = 2048
ATTENTION_SEQS = (1024, 4096, 16384)
ATTENTION_ROWS = tuple((s, causal) for s in ATTENTION_SEQS for causal in (False, True))

# The GPU TransformerLayer (transformer_layer_gpu.py and transformer_layer_profile_gpu.py): batch, seq, hidden,
# heads (head_dim 128), FFN (gelu); causal, bf16 compute and parameters, fused QKV, no bias, no dropout.
LAYER_GPU = (4, 2048, 4096, 32, 16384)


def norm_inputs(m: int, d: int, seed: int):
    """Norm inputs: x [m, d] bf16, gamma [d] f32 (around 1), beta [d] f32, dy [m, d] bf16: fresh normal draws."""
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (m, d)).astype(jnp.bfloat16)
    g = 1 + 0.1 * jax.random.normal(k[1], (d,))
    b = 0.1 * jax.random.normal(k[2], (d,))
    dy = jax.random.normal(k[3], (m, d)).astype(jnp.bfloat16)
    return x, g, b, dy
