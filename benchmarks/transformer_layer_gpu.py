"""GPU benchmark: one te_jax TransformerLayer forward+backward against a plain-JAX GPT layer.

Run on the device machine from the repo root:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.transformer_layer_gpu 2>&1 | tee $OUT/log.txt
CPU smoke test of the script itself (tiny sizes, XLA attention for the peer):
    PYTHONPATH=. python -m benchmarks.transformer_layer_gpu --cpu-smoke

Shape (GPU, cases.LAYER_GPU): hidden 4096, 32 heads (head_dim 128), FFN 16384 (gelu), batch 4 x seq 2048, causal,
bf16 compute and bf16 parameters, no dropout, pre-LN, no biases.
  te_jax:  te_jax.flax.TransformerLayer (fused QKV; attention, norm and MLP backends chosen by te_jax)
  peer:    a plain-JAX GPT layer on the SAME parameters, attention by
           jax.nn.dot_product_attention(implementation="cudnn") (and, as a second peer, "xla").
Both are timed as a jitted step computing the loss and the gradients of every parameter and the
input. Correctness first (forward output and gradients of te_jax vs the peer, relative error),
then warm-up and the median of >= 10 timed steps. Prints te_jax's backend explanations and a
table with ms, tokens/s and the ratio; writes JSON to $OUT/transformer_layer.json.
"""
from __future__ import annotations

import datetime
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from te_jax import mlp as te_mlp
from te_jax import normalization as te_norm
from te_jax.flax import TransformerLayer

from benchmarks import cases, timing

DATE = str(datetime.date.today())
SMOKE = "--cpu-smoke" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
if SMOKE:
    B, S, HID, HEADS, FFN, N_TIMED, WARM = 2, 16, 64, 4, 128, 10, 1
    PEER_IMPLS = ("xla",)
else:
    (B, S, HID, HEADS, FFN), N_TIMED, WARM = cases.LAYER_GPU, 20, 3
    PEER_IMPLS = ("cudnn", "xla")
HD = HID // HEADS
DT = jnp.bfloat16
EPS = 1e-6


def log(*a):
    print(*a, flush=True)


def make_layer():
    return TransformerLayer(
        hidden_size=HID, mlp_hidden_size=FFN, num_attention_heads=HEADS, mlp_activations=("gelu",),
        hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0, self_attn_mask_type="causal",
        enable_relative_embedding=False, scale_attn_logits=True, use_bias=False, dtype=DT, param_dtype=DT,
        attn_input_format="bshd", fuse_qkv_params=True)


def plain_layer(p, x, impl):
    """Plain-JAX pre-LN GPT layer on te_jax's parameter tree (same math, no te_jax calls)."""
    a, m = p["attention"], p["mlp"]

    def ln(x, g, b):
        xf = x.astype(jnp.float32)
        mu = xf.mean(-1, keepdims=True)
        var = ((xf - mu) ** 2).mean(-1, keepdims=True)
        return ((xf - mu) * jax.lax.rsqrt(var + EPS) * g.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)

    h = ln(x, a["qkv"]["scale"], a["qkv"]["ln_bias"])
    qkv = jnp.einsum("bsd,dthk->bsthk", h, a["qkv"]["kernel"].astype(x.dtype))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    x = x + jnp.einsum("bshk,hkd->bsd", o, a["out"]["kernel"].astype(x.dtype))
    h = ln(x, m["scale"], m["ln_bias"])
    u = jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, m["wi_kernel"][:, 0].astype(x.dtype)), approximate=True)
    return x + jnp.einsum("bsf,fd->bsd", u, m["wo_kernel"].astype(x.dtype))


def make_step(fwd, ct):
    def loss(p, x):
        return jnp.sum(fwd(p, x).astype(jnp.float32) * ct) / ct.size

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def timed(f, *args):
    """(median seconds per step, first output) after WARM warm-up steps (benchmarks/timing.py)."""
    med, _, out = timing.measure(f, args, samples=N_TIMED, warmup=WARM, inner=1)
    return med, out


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32)).ravel()
    b = np.asarray(jnp.asarray(b, jnp.float32)).ravel()
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def explain():
    """te_jax's backend choices for the calls the layer makes."""
    q = jax.ShapeDtypeStruct((B, S, HEADS, HD), DT)
    x = jax.ShapeDtypeStruct((B, S, HID), DT)
    lines = []
    try:
        lines.append(str(te_jax.explain_attention_backend(q, q, q, attn_mask_type="causal", attn_input_format="bshd",
                                                          scale=1.0 / HD ** 0.5)))
    except Exception:  # explain may need concrete arrays
        z = jnp.zeros(q.shape, q.dtype)
        lines.append(str(te_jax.explain_attention_backend(z, z, z, attn_mask_type="causal", attn_input_format="bshd",
                                                          scale=1.0 / HD ** 0.5)))
    lines.append(str(te_norm.explain_norm_backend(x, layernorm_type="layernorm")))
    lines.append(str(te_mlp.explain_mlp_backend(x, op="layernorm_dense")))
    lines.append(str(te_mlp.explain_mlp_backend(x, activations=("gelu",))))
    return "\n".join(lines)


def main():
    dev = jax.devices()[0]
    log(f"date {DATE}  device {dev.device_kind}  platform {dev.platform}  jax {jax.__version__}"
        + ("  [CPU SMOKE: tiny sizes]" if SMOKE else ""))
    log(f"shape: batch {B} x seq {S}, hidden {HID}, heads {HEADS} (head_dim {HD}), FFN {FFN}, causal, bf16")
    layer = make_layer()
    kx, kp, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, S, HID), jnp.float32).astype(DT)
    ct = jax.random.normal(kc, (B, S, HID), jnp.float32)
    params = jax.jit(lambda k: nn.meta.unbox(layer.init(k, x[:1, :8], deterministic=True))["params"])(kp)

    log("\n== te_jax backend choices ==")
    log(explain())

    te_fwd = lambda p, x: layer.apply({"params": p}, x, deterministic=True)
    steps = {"te_jax TransformerLayer": make_step(te_fwd, ct)}
    for impl in PEER_IMPLS:
        steps[f"plain JAX, {impl} attention"] = make_step(lambda p, x, impl=impl: plain_layer(p, x, impl), ct)

    log("\n== correctness (te_jax vs plain JAX, same parameters) ==")
    y_te = jax.jit(te_fwd)(params, x)
    results = {"date": DATE, "device": dev.device_kind, "jax": jax.__version__, "smoke": SMOKE,
               "shape": dict(batch=B, seq=S, hidden=HID, heads=HEADS, ffn=FFN), "rows": []}
    ref_impl = PEER_IMPLS[0]
    y_ref = jax.jit(lambda p, x: plain_layer(p, x, ref_impl))(params, x)
    err = {"forward": rel(y_te, y_ref)}
    log(f"forward rel. error vs plain ({ref_impl}): {err['forward']:.3e}")

    rows = []
    grads = {}
    for name, step in steps.items():
        try:
            t, (loss, g) = timed(step, params, x)
        except Exception as e:  # a peer may be unavailable (e.g. cuDNN attention off-GPU)
            log(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(name=name, ms=None))
            continue
        grads[name] = g
        rows.append(dict(name=name, ms=t * 1e3, tokens_per_s=B * S / t, loss=float(loss)))
        log(f"{name}: {t * 1e3:.2f} ms")
    te_name = "te_jax TransformerLayer"
    peer = f"plain JAX, {ref_impl} attention"
    if te_name in grads and peer in grads:
        gp, gx = grads[te_name]
        rp, rx = grads[peer]
        err["grad_input"] = rel(gx, rx)
        err["grad_params_max"] = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(gp),
                                                               jax.tree_util.tree_leaves(rp)))
        log(f"grad rel. error: input {err['grad_input']:.3e}, worst parameter {err['grad_params_max']:.3e}")
    ok = err["forward"] < 2e-2 and err.get("grad_input", 0) < 5e-2 and err.get("grad_params_max", 0) < 5e-2
    log("correctness: " + ("OK" if ok else "MISMATCH (see errors above)"))
    results["errors"] = err
    results["correct"] = ok
    results["rows"] = rows

    te_ms = next((r["ms"] for r in rows if r["name"] == te_name), None)
    log(f"\n## TransformerLayer fwd+bwd — {DATE}, {dev.device_kind}, jax {jax.__version__}"
        + (" (CPU smoke, tiny sizes: timings meaningless)" if SMOKE else ""))
    log(f"batch {B} x seq {S}, hidden {HID}, {HEADS} heads, FFN {FFN}, causal, bf16; median of {N_TIMED} "
        f"after {WARM + 1} warm-up steps\n")
    log("| layer | ms | tokens/s | te_jax speed-up (peer ms / te_jax ms) |")
    log("|---|---|---|---|")
    for r in rows:
        if r["ms"] is None:
            log(f"| {r['name']} | failed | | |")
            continue
        ratio = (r["ms"] / te_ms) if te_ms else float("nan")
        log(f"| {r['name']} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {ratio:.2f}x |")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "transformer_layer.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
