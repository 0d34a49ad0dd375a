"""A/B on the GPU: the Hopper kernels of an earlier commit against the current ones, in one process.

Forward and forward+backward at 16k causal, 4k causal and 16k non-causal (16 heads, head_dim 128, 16k tokens),
with cuDNN as the fixed yardstick, 3 interleaved rounds; the gradients of the two versions are compared.
The earlier version is imported as `old_hopper` from ab_old/ (git-ignored, recreate it first):

    mkdir -p ab_old/old_hopper && for f in __init__.py kernel.py reference.py; do \
        git show 8c99742:pallas_kernels/flash_attention_hopper/$f > ab_old/old_hopper/$f; done
    # device call, carry ["ab_old"]:
    python3 benchmarks/attention_hopper_ab_commit.py

(8c99742 is run 6's commit, before the kernels were split into config/common/forward/backward.py.)"""
import sys
sys.path[:0] = [".", "benchmarks", "ab_old"]  # old_hopper lives in ab_old/
import jax, jax.numpy as jnp
import timing
import old_hopper
import pallas_kernels.flash_attention_hopper as new_hopper

def make(mod, causal, D):
    def fb(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: mod.hopper_attention(q, k, v, scale=D ** -0.5, causal=causal)[0], q, k, v)
        return vjp(do)
    fwd = jax.jit(lambda q, k, v: mod.hopper_attention(q, k, v, scale=D ** -0.5, causal=causal)[0])
    return fwd, jax.jit(fb)

def cud(causal, D):
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=D ** -0.5, is_causal=causal, implementation="cudnn")
    def fb(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return vjp(do)
    return jax.jit(f), jax.jit(fb)

for S, causal in ((16384, True), (4096, True), (16384, False)):
    B, H, D = 16384 // S, 16, 128
    ks = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    fns = {"old (run 6 commit)": make(old_hopper, causal, D), "new": make(new_hopper, causal, D), "cuDNN": cud(causal, D)}
    g_old, g_new = fns["old (run 6 commit)"][1](q, k, v, do), fns["new"][1](q, k, v, do)
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(g_old, g_new))
    print(f"S{S} causal={causal}: max |grad old - grad new| = {err:.2e}", flush=True)
    res = {n: [] for n in fns}
    for r in range(3):
        for n, (f, fb) in fns.items():
            res[n].append((flops / timing.measure(f, (q, k, v), samples=15)[0] / 1e12,
                           3.5 * flops / timing.measure(fb, (q, k, v, do), samples=15)[0] / 1e12))
    for n, t in res.items():
        print(f"  {n}: fwd " + " / ".join(f"{a:.0f}" for a, _ in t) + "   fwd+bwd " + " / ".join(f"{b:.0f}" for _, b in t), flush=True)
