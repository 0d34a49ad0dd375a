"""Where a training step's wall time goes that no kernel uses: device idle gaps of the Llama-style layer step.

For each variant (bf16 with auto backends, bf16 with cuDNN attention, FP8 delayed scaling), after warm-up:
  wall     ms per step, `inner` steps dispatched back to back then one block (median of samples);
  kernels  ms per step summed over the device's kernel events (jax.profiler trace of `inner` steps);
  busy     ms per step in the union of kernel intervals; span: first kernel start to last kernel end / inner;
  gaps     the largest idle intervals between kernels, with the kernels on either side.
If span ~ wall and busy < span, the GPU waits inside the step (host-side stalls between launches); if span < wall,
the wait is outside the kernels' timeline.

    PYTHONPATH=. python3 -m benchmarks.step_gap_probe [--cpu-smoke]
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks import timing
from te_jax import fp8
from te_jax.flax import TransformerLayer


def device_events(d):
    """[(start_ns, end_ns, name)] of every kernel-level event on the first device plane of the trace in d."""
    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    pd = ProfileData.from_file(files[0])
    planes = [p for p in pd.planes if p.name.startswith("/device:")]
    if not planes:
        return []
    out = []
    for ln in planes[0].lines:
        if ln.name in ("XLA Modules", "Steps", "XLA Ops", "Launch Stats", "Source"):
            continue
        for e in ln.events:
            out.append((e.start_ns, e.start_ns + e.duration_ns, f"{ln.name}: {e.name[:90]}"))
    return sorted(out)


def gap_summary(events, steps, top=12):
    busy, gaps, end, prev = 0.0, [], None, None
    for s, e, name in events:
        if end is not None and s > end:
            gaps.append((s - end, prev, name))
        if end is None or s > end:
            busy += e - s
        elif e > end:
            busy += e - end
        if end is None or e > end:
            end, prev = e, name
    kernels = sum(e - s for s, e, _ in events)
    span = events[-1][1] - events[0][0] if events else 0
    gaps.sort(key=lambda g: -g[0])
    return kernels / steps / 1e6, busy / steps / 1e6, span / steps / 1e6, gaps[:top], len(events)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--inner", type=int, default=6)
    args = ap.parse_args()
    if args.cpu_smoke:
        B, S, HID, HEADS, KV, FFN = 2, 32, 64, 4, 2, 128
    else:
        B, S, HID, HEADS, KV, FFN = 4, 2048, 4096, 32, 8, 14336

    def layer(attn):
        return TransformerLayer(
            hidden_size=HID, mlp_hidden_size=FFN, num_attention_heads=HEADS, num_gqa_groups=KV,
            layernorm_type="rmsnorm", mlp_activations=("silu", "linear"), enable_rotary_pos_emb=True,
            enable_relative_embedding=False, hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
            self_attn_mask_type="causal", use_bias=False, scale_attn_logits=True, dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16, attn_input_format="bshd", attention_backend=attn)

    kx, kp, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, S, HID), jnp.float32).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (B, S, HID), jnp.float32)
    variants = {"bf16 auto": ("auto", None), "bf16 cudnn attention": ("cudnn", None),
                "FP8 delayed, auto": ("auto", fp8.DelayedScaling(amax_history_len=1024, amax_compute_algo="max"))}
    if args.cpu_smoke:
        variants.pop("bf16 cudnn attention")
    lines = []
    for name, (attn, recipe) in variants.items():
        module = layer(attn)

        def loss_fn(params, state, x, ct):
            v = {"params": params, **({fp8.FP8_COLLECTION: state} if state else {})}
            return jnp.mean(module.apply(v, x, deterministic=True).astype(jnp.float32) * ct)

        with fp8.autocast(enabled=recipe is not None, recipe=recipe):
            variables = jax.jit(lambda k: nn.meta.unbox(module.init(k, x[:1, :8], deterministic=True)))(kp)
            params, state = variables["params"], variables.get(fp8.FP8_COLLECTION, {})
            f = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2))).lower(params, state, x, ct).compile()
        a = (params, state, x, ct)
        wall = statistics.median(timing.measure(f, a, samples=5, warmup=2, inner=args.inner)[0] for _ in range(3))
        d = tempfile.mkdtemp(prefix="gap_")
        jax.block_until_ready(f(*a))
        with jax.profiler.trace(d):
            jax.block_until_ready([f(*a) for _ in range(args.inner)])
        ev = device_events(d)
        if not ev:
            lines.append(f"{name}: wall {wall * 1e3:.2f} ms; no device events (CPU)")
            continue
        kernels, busy, span, gaps, n = gap_summary(ev, args.inner)
        lines.append(f"\n### {name}\nwall {wall * 1e3:.2f} ms/step; kernels {kernels:.2f}; busy {busy:.2f}; "
                     f"span {span:.2f}; {n / args.inner:.0f} events/step")
        for g, before, after in gaps:
            lines.append(f"- gap {g / 1e3:.0f} us after [{before}] before [{after}]")
        print(lines[-len(gaps) - 1] if gaps else lines[-1], flush=True)
    print(f"\n## Step gap probe, {jax.devices()[0].device_kind}, jax {jax.__version__}, inner {args.inner}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
