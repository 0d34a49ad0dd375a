"""The FP8 layer step's temporary memory, and what XLA keeps in it (the benchmark layer of fp8_layer_gpu.py).

Run on the device machine from the repo root, one recipe per process (XLA_FLAGS is read at backend start):
    PYTHONPATH=. python3 -m benchmarks.fp8_memory_probe delayed      # bf16 | delayed | current | block
Prints the compiled step's temporary bytes (`memory_analysis().temp_size_in_bytes`, what fp8_layer_gpu.py reports)
and copies XLA's memory-usage report and buffer assignment of the step to $OUT/<recipe>_mem.txt / _ba.txt: the
allocations of the temporary buffer by size and offset, which show what keeps it above another recipe's.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys


def main(name: str):
    out = os.environ.get("OUT", "/tmp")
    dump = os.path.join(out, "dump_" + name)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                               " --xla_dump_hlo_module_re=.*jit_loss.*")
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from te_jax import fp8
    from te_jax.flax import TransformerLayer

    B, S, HID, HEADS, KV, FFN = 4, 2048, 4096, 32, 8, 14336
    layer = TransformerLayer(
        hidden_size=HID, mlp_hidden_size=FFN, num_attention_heads=HEADS, num_gqa_groups=KV,
        layernorm_type="rmsnorm", mlp_activations=("silu", "linear"), enable_rotary_pos_emb=True,
        enable_relative_embedding=False, hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
        self_attn_mask_type="causal", use_bias=False, scale_attn_logits=True, dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16, attn_input_format="bshd")
    recipe = {"bf16": None, "delayed": fp8.DelayedScaling(amax_history_len=1024, amax_compute_algo="max"),
              "current": fp8.Float8CurrentScaling(), "block": fp8.Float8BlockScaling()}[name]
    x, ct = jnp.zeros((B, S, HID), jnp.bfloat16), jnp.zeros((B, S, HID), jnp.float32)
    with fp8.autocast(enabled=recipe is not None, recipe=recipe):
        v = jax.jit(lambda k: nn.meta.unbox(layer.init(k, x[:1, :8], deterministic=True)))(jax.random.key(0))
        params, state = v["params"], v.get(fp8.FP8_COLLECTION, {})

        def loss(p, s, x, c):
            vv = {"params": p, **({fp8.FP8_COLLECTION: s} if s else {})}
            return jnp.mean(layer.apply(vv, x, deterministic=True).astype(jnp.float32) * c)

        comp = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(params, state, x, ct).compile()
    print(f"{name} temp MiB {comp.memory_analysis().temp_size_in_bytes / 2**20:.4f}", flush=True)
    for f in sorted(glob.glob(dump + "/*memory-usage-report.txt")):
        shutil.copy(f, os.path.join(out, f"{name}_mem.txt"))
    for f in sorted(glob.glob(dump + "/*after_optimizations-buffer-assignment.txt")):
        shutil.copy(f, os.path.join(out, f"{name}_ba.txt"))
    shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "delayed")
