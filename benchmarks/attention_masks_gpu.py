"""The Hopper-mask issue's rows: te_jax against every peer that supports each row, forward and forward+backward.

    bash benchmarks/install_peers.sh; export PYTHONPATH=.:/tmp/site   # carry [".whl"]
    python3 -m benchmarks.attention_masks_gpu [--rounds 3] [--rows softcap_causal_4k,...]

Rows (bf16, hd128): see ROWS. Implementations, where each supports the row:
  te_jax          te_jax.dot_product_attention(backend="auto"): what users get (the kernel it takes is printed)
  te_jax_pallas   the same with backend="pallas" (the Hopper kernel where it serves; only when auto takes another)
  te_jax_portable the portable Triton-lowered kernel (what served these rows before the Hopper kernel did)
  cudnn           jax.nn.dot_product_attention(implementation="cudnn")
  tokamax         tokamax.dot_product_attention(implementation="mosaic")
  fa3             flash_attn3_jax.flash_mha (when its signature takes the row's feature)
Before timing, each row checks te_jax's output on the last 256 query rows against an fp32 reference (relative
error) and its gradients against the portable kernel's. Timing: `rounds` interleaved rounds (every implementation
once per round), each the median of timing.measure's samples; the cell is the median over rounds. TFLOP/s counts
the visible area: 4*B*H*D*visible for the forward, 3.5x that for forward+backward.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import statistics

import jax
import jax.numpy as jnp

import te_jax
from benchmarks import attention_hopper_gpu as ahg  # inputs, peer imports, gpu_warmup
from benchmarks import timing

# name: (B, S, H, causal, softcap)
ROWS = {
    "softcap_causal_4k": (4, 4096, 16, True, 50.0),
    "softcap_full_4k": (4, 4096, 16, False, 50.0),
    "ragged_16534_full": (1, 16534, 18, False, None),  # any length: not a multiple of 128
    "ragged_16534_causal": (1, 16534, 18, True, None),
}
D = 128


def visible(S, causal):
    return S * (S + 1) // 2 if causal else S * S


def reference_tail(q, k, v, scale, causal, softcap, n):
    """fp32 output of the last n query rows (softcap * tanh(s / softcap) on the scaled logits)."""
    S = q.shape[1]
    f32 = lambda x: x.astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", f32(q[:, S - n:]), f32(k), precision=jax.lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if causal:
        s = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(S - n, S)[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), f32(v), precision=jax.lax.Precision.HIGHEST)


def fwd_and_fb(f):
    def fb(q, k, v, do):
        return jax.vjp(f, q, k, v)[1](do)
    return jax.jit(f), jax.jit(fb)


def makers(row, scale, tk, fa3):
    B, S, H, causal, softcap = row
    out = {}
    for name, backend in (("te_jax", "auto"), ("te_jax_pallas", "pallas")):
        out[name] = (lambda backend: lambda: fwd_and_fb(lambda q, k, v: te_jax.dot_product_attention(
            q, k, v, attn_input_format="bshd", attn_mask_type="causal" if causal else "no_mask", softcap=softcap,
            scale=scale, backend=backend)))(backend)

    def portable(q, k, v):
        from pallas_kernels.flash_attention import AttentionMask, flash_attention
        mask = AttentionMask.full(q.shape[0], q.shape[1], k.shape[1], causal=causal)
        return flash_attention(q, k, v, mask, scale=scale, softcap=softcap)[0]

    out["te_jax_portable"] = lambda: fwd_and_fb(portable)
    if softcap is None:
        out["cudnn"] = lambda: fwd_and_fb(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="cudnn"))
    if tk is not None:
        out["tokamax"] = lambda: fwd_and_fb(lambda q, k, v: tk.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, logits_soft_cap=softcap, implementation="mosaic"))
    if fa3 is not None:
        params = inspect.signature(fa3.flash_mha).parameters
        if softcap is None or "softcap" in params:
            extra = {} if softcap is None else {"softcap": float(softcap)}
            out["fa3"] = lambda: fwd_and_fb(lambda q, k, v: fa3.flash_mha(
                q, k, v, softmax_scale=float(scale), is_causal=causal, **extra))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    args = ap.parse_args()
    tk, tk_line = ahg.import_tokamax("mosaic")
    fa3, fa3_line = ahg.import_fa3()
    print(f"{datetime.date.today()}  {jax.devices()[0].device_kind}  jax {jax.__version__}", flush=True)
    print(tk_line, flush=True)
    print(fa3_line, flush=True)
    if fa3 is not None:
        print(f"flash_mha{inspect.signature(fa3.flash_mha)}", flush=True)
    ahg.gpu_warmup()
    table = []
    for name in args.rows.split(","):
        row = ROWS[name]
        B, S, H, causal, softcap = row
        scale = D ** -0.5
        q, k, v, do = ahg.inputs(jax.random.key(hash(name) % 1000), B, S, H, H, D, jnp.bfloat16)
        choice = te_jax.explain_attention_backend(q, k, v, attn_input_format="bshd",
                                                  attn_mask_type="causal" if causal else "no_mask", softcap=softcap)
        print(f"\n== {name}: B{B} S{S} H{H} D{D} causal={causal} softcap={softcap}\n"
              f"te_jax auto: {choice.selected}; {choice.detail}", flush=True)
        impls = {}
        for iname, make in makers(row, scale, tk, fa3).items():
            if iname == "te_jax_pallas" and choice.selected == "pallas":
                continue
            try:
                impls[iname] = make()
                jax.block_until_ready(impls[iname][1](q, k, v, do))
            except Exception as e:  # noqa: BLE001  (a peer that cannot serve the row is reported, not fatal)
                print(f"  {iname}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                impls.pop(iname, None)
        if "te_jax" in impls:
            ref = jax.jit(reference_tail, static_argnums=(3, 4, 5, 6))(q, k, v, scale, causal, softcap, 256)
            out = impls["te_jax"][0](q, k, v)[:, S - 256:].astype(jnp.float32)
            print(f"  te_jax out (last 256 rows) vs fp32: rel {ahg.rel(out, ref):.2e}", flush=True)
            if "te_jax_portable" in impls:
                g = impls["te_jax"][1](q, k, v, do)
                gp = impls["te_jax_portable"][1](q, k, v, do)
                print("  te_jax grads vs portable kernel: rel " +
                      ", ".join(f"{n} {ahg.rel(a, b):.2e}" for n, a, b in zip("qkv", g, gp)), flush=True)
        flops = 4 * B * H * D * visible(S, causal)
        times = {(i, m): [] for i in impls for m in ("fwd", "fb")}
        for r in range(args.rounds):
            for iname, (f, fb) in impls.items():
                times[(iname, "fwd")].append(timing.measure(f, (q, k, v))[0])
                times[(iname, "fb")].append(timing.measure(fb, (q, k, v, do))[0])
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
        med = {key: statistics.median(t) for key, t in times.items()}
        tf = {key: (flops * (1 if key[1] == "fwd" else 3.5)) / t / 1e12 for key, t in med.items()}
        peers = [i for i in impls if not i.startswith("te_jax")]
        for m in ("fwd", "fb"):
            best = max(peers, key=lambda i: tf[(i, m)]) if peers else None
            cells = " | ".join(f"{i} {tf[(i, m)]:.0f}" for i in impls)
            ours = max((i for i in ("te_jax", "te_jax_pallas") if i in impls), key=lambda i: tf[(i, m)], default=None)
            ratio = f"{ours} {tf[(ours, m)] / tf[(best, m)]:.2f} of {best}" if best and ours else "-"
            table.append(f"| {name} | {m} | {cells} | {ratio} |")
    print(f"\n## Hopper masks: TFLOP/s on the visible area ({args.rounds} interleaved rounds, medians), "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}\n")
    print("| row | pass | implementations (TFLOP/s) | te_jax's best / best peer |")
    print("|---|---|---|---|")
    for line in table:
        print(line)


if __name__ == "__main__":
    main()
