"""CPU: compare the HLO of te_jax's TransformerLayer fwd+bwd with the plain-JAX peer (issue #4).

    PYTHONPATH=. python benchmarks/transformer_layer_hlo_cpu.py

Small shape (B2 S128 hidden 256, 4 heads, FFN 1024, causal, bf16, fused QKV, no bias), attention
backend xla for both. Three programs, each the loss + value_and_grad step of transformer_layer_gpu.py:
  te      te_jax.flax.TransformerLayer(attention_backend="xla")
  plain   transformer_layer_gpu.plain_layer with jax.nn.dot_product_attention(implementation="xla")
  plain+te_attn  the plain layer with te_jax.dot_product_attention(backend="xla") in place of jax.nn's,
          so that te vs plain+te_attn isolates the modules (projections, norms, MLP, QKV split).
Prints instruction counts of the pre-optimization HLO and of XLA:CPU's optimized HLO (XLA:CPU
upcasts bf16 arithmetic, so its convert counts say little about a GPU), and every dot of the
pre-optimization HLO that has an fp32 output outside the attention core.
"""
from __future__ import annotations

import collections
import importlib.util
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

import te_jax
from te_jax.flax import TransformerLayer

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_layer_gpu.py")
_spec = importlib.util.spec_from_file_location("transformer_layer_gpu", _path)
tlg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tlg)

B, S, HID, HEADS, FFN = 2, 128, 256, 4, 1024
DT = jnp.bfloat16
OPS = ("dot", "transpose", "copy", "convert", "reduce", "fusion", "select", "gather", "scatter", "pad", "slice",
       "concatenate", "custom-call")


def layer():
    return TransformerLayer(
        hidden_size=HID, mlp_hidden_size=FFN, num_attention_heads=HEADS, mlp_activations=("gelu",),
        hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0, self_attn_mask_type="causal",
        enable_relative_embedding=False, scale_attn_logits=True, use_bias=False, dtype=DT, param_dtype=DT,
        attn_input_format="bshd", fuse_qkv_params=True, attention_backend="xla")


def te_attention(q, k, v, is_causal, implementation):
    del implementation
    return te_jax.dot_product_attention(q, k, v, attn_mask_type="causal" if is_causal else "no_mask",
                                        scale=q.shape[-1] ** -0.5, backend="xla")


def plain_with_te_attention(p, x):
    orig = jax.nn.dot_product_attention
    jax.nn.dot_product_attention = te_attention
    try:
        return tlg.plain_layer(p, x, "xla")
    finally:
        jax.nn.dot_product_attention = orig


def counts(text):
    c = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][\w\-]*)\(", line)
        if m:
            c[m.group(2)] += 1
    return c


def fp32_dots(text):
    """Pre-optimization dots with an fp32 result whose op_name is not in the attention core."""
    out = []
    for line in text.splitlines():
        if not re.search(r"\sdot\(", line):
            continue
        shape = re.search(r"=\s*(\w+\[[\d,]*\])", line).group(1)
        name = re.search(r'op_name="([^"]*)"', line)
        name = name.group(1) if name else ""
        if shape.startswith("f32") and not re.search(r"reference_attention|_logits|dot_product_attention|"
                                                      r"bgrqk|bqgrd|BNTS|BTNH", name + line):
            out.append(f"{shape}  {name[-90:]}")
    return out


def main():
    lay = layer()
    x = jax.random.normal(jax.random.key(0), (B, S, HID), jnp.float32).astype(DT)
    ct = jax.random.normal(jax.random.key(1), (B, S, HID), jnp.float32)
    params = nn.meta.unbox(lay.init(jax.random.key(2), x, deterministic=True))["params"]
    progs = {"te": lambda p, x: lay.apply({"params": p}, x, deterministic=True),
             "plain": lambda p, x: tlg.plain_layer(p, x, "xla"),
             "plain+te_attn": plain_with_te_attention}
    pre, opt, f32 = {}, {}, {}
    for name, f in progs.items():
        def loss(p, x, f=f):
            return jnp.sum(f(p, x).astype(jnp.float32) * ct) / ct.size

        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x)
        text = lowered.as_text(dialect="hlo", debug_info=True)
        pre[name], opt[name], f32[name] = counts(text), counts(lowered.compile().as_text()), fp32_dots(text)
    names = list(progs)
    print(f"jax {jax.__version__}; B{B} S{S} hidden {HID} heads {HEADS} FFN {FFN}, bf16, causal, attention xla\n")
    print("| op | " + " | ".join(f"{n} pre-opt" for n in names) + " | " + " | ".join(f"{n} XLA:CPU opt" for n in names)
          + " |")
    print("|---" * (2 * len(names) + 1) + "|")
    for op in OPS:
        print(f"| {op} | " + " | ".join(str(pre[n][op]) for n in names) + " | "
              + " | ".join(str(opt[n][op]) for n in names) + " |")
    for n in names:
        print(f"\n{n}: fp32-output dots outside the attention core (pre-opt): {len(f32[n])}")
        for d in f32[n]:
            print("   ", d)


if __name__ == "__main__":
    sys.exit(main())
