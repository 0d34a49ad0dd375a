"""Split head dims on the H100: q/k head_dim 192, v head_dim 128 (DeepSeek-V3), te_jax against every peer that
takes the call, forward and forward+backward.

    bash benchmarks/install_peers.sh; export PYTHONPATH=.:/tmp/site   # carry [".whl"]
    python3 -m benchmarks.attention_head_dims_gpu [--rounds 3] [--rows causal_4k,...] [--configs default,stages3]

Rows (bf16, 16 heads, d_qk 192, d_v 128): ROWS. Implementations:
  te_jax          te_jax.dot_product_attention(backend="auto"): what users get (its kernel is printed)
  te_jax <cfg>    backend="pallas" with a HopperConfig from CONFIGS (the Hopper kernel, tuning candidates)
  cudnn_vpad      jax.nn.dot_product_attention(implementation="cudnn") with v zero-padded to 192 and the output
                  sliced (jax.nn needs equal head dims: what a jax.nn user can do; its PV work is 1.5x)
  tokamax         tokamax.dot_product_attention(implementation="mosaic"), if it takes d_qk != d_v
  fa3             flash_attn3_jax.flash_mha (0.2.3 returns a d_qk-wide output: sliced to d_v)
Before timing: each implementation's output on the last 256 query rows against the fp32 reference, and te_jax's
gradients against cudnn_vpad's (dv sliced). A peer that fails is reported and left out. Timing: interleaved rounds
(every implementation once per round), each the median of timing.measure's samples; the cell is the median.
TFLOP/s: 2*B*H*S^2*(d_qk + d_v) for the forward (half when causal), 3.5x that for forward+backward.
"""
from __future__ import annotations

import argparse
import datetime

import jax
import jax.numpy as jnp

import te_jax
from benchmarks import attention_hopper_gpu as ahg
from benchmarks.peer_rows import fwd_and_fb, import_peers, peer_rows, print_table, ready_impls, tflops_rounds
from pallas_kernels.flash_attention_hopper import HopperConfig, default_config
from pallas_kernels.flash_attention_hopper.reference import attention_reference

DQK, DV, H = 192, 128, 16
ROWS = {  # name: (B, S, causal)
    "causal_4k": (4, 4096, True),
    "noncausal_4k": (4, 4096, False),
    "causal_16k": (1, 16384, True),
    "noncausal_16k": (1, 16384, False),
}
CONFIGS = {
    "default": None,  # default_config(192, head_dim_v=128): 128-key forward blocks (O inside Q), two bwd warpgroups
    # the default before the sixteenth session: dK and dV in two launches
    "two_launches": HopperConfig(block_q=64, block_kv=128, stages=2, bwd_wgs=2, bwd_dkv_together=False),
    "kv64": HopperConfig(block_q=64, block_kv=64, stages=2, bwd_wgs=2),  # 64-key forward blocks
    "bwd1": HopperConfig(block_q=64, block_kv=64, stages=2, bwd_wgs=1),  # one backward warpgroup (hd256's)
}


def makers(causal, scale, tk, fa3, configs):
    mask = "causal" if causal else "no_mask"
    out = {"te_jax": lambda: fwd_and_fb(lambda q, k, v: te_jax.dot_product_attention(
        q, k, v, scale=scale, attn_mask_type=mask))}
    for name in configs:
        cfg = CONFIGS[name]
        out[f"te_jax {name}"] = (lambda cfg: lambda: fwd_and_fb(lambda q, k, v: te_jax.dot_product_attention(
            q, k, v, scale=scale, attn_mask_type=mask, backend="pallas",
            config=cfg if cfg is not None else default_config(DQK, head_dim_v=DV))))(cfg)

    def vpad(q, k, v):
        vp = jnp.pad(v, [(0, 0)] * 3 + [(0, DQK - DV)])
        return jax.nn.dot_product_attention(q, k, vp, scale=scale, is_causal=causal, implementation="cudnn")[..., :DV]

    out["cudnn_vpad"] = lambda: fwd_and_fb(vpad)
    if tk is not None:
        out["tokamax"] = lambda: fwd_and_fb(lambda q, k, v: tk.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="mosaic"))
    if fa3 is not None:
        # flash-attn3-jax 0.2.3 returns a [.., d_qk]-wide output for d_v < d_qk: sliced to d_v
        out["fa3"] = lambda: fwd_and_fb(lambda q, k, v: fa3.flash_mha(
            q, k, v, softmax_scale=float(scale), is_causal=causal)[..., :DV])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    tk, fa3 = import_peers()
    ahg.gpu_warmup()
    table = []
    scale = DQK ** -0.5
    for name in args.rows.split(","):
        B, S, causal = ROWS[name]
        ks = jax.random.split(jax.random.key(S + causal), 4)
        q = jax.random.normal(ks[0], (B, S, H, DQK), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, S, H, DQK), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, S, H, DV), jnp.bfloat16)
        do = jax.random.normal(ks[3], (B, S, H, DV), jnp.bfloat16)
        choice = te_jax.explain_attention_backend(q, k, v, attn_mask_type="causal" if causal else "no_mask")
        print(f"\n== {name}: B {B} S {S} H {H} d_qk {DQK} d_v {DV} causal {causal}\nte_jax auto: {choice.selected}; "
              f"{choice.detail}", flush=True)
        impls = ready_impls(makers(causal, scale, tk, fa3, args.configs.split(",")), q, k, v, do)
        n = 256
        ref, _ = jax.jit(lambda q, k, v: attention_reference(q, k, v, scale=scale, causal=False))(
            q[:1, S - n:].astype(jnp.float32), k[:1].astype(jnp.float32), v[:1].astype(jnp.float32))
        if causal:  # the last n rows see every key up to their own position: the tail rows of a causal call
            from pallas_kernels.flash_attention.reference import reference_attention
            from pallas_kernels.mask import AttentionMask
            m = AttentionMask.full(1, n, S, causal=True, bottom_right=True)
            ref, _ = jax.jit(lambda q, k, v: reference_attention(q, k, v, m, scale=scale))(
                q[:1, S - n:].astype(jnp.float32), k[:1].astype(jnp.float32), v[:1].astype(jnp.float32))
        for iname in impls:
            o = impls[iname][0](q, k, v)[:1, S - n:]
            print(f"  {iname} out (last {n} rows of batch row 0) vs fp32: rel {ahg.rel(o, ref):.2e}", flush=True)
        if "cudnn_vpad" in impls:
            gp = impls["cudnn_vpad"][1](q, k, v, do)
            for iname in impls:
                if iname.startswith("te_jax"):
                    g = impls[iname][1](q, k, v, do)
                    print(f"  {iname} grads vs cudnn_vpad: rel " +
                          ", ".join(f"d{c} {ahg.rel(a, b):.2e}" for c, a, b in zip("qkv", g, gp)), flush=True)
        flops = 2 * B * H * S * S * (DQK + DV) * (0.5 if causal else 1.0)
        tf = tflops_rounds(impls, q, k, v, do, flops, args.rounds)
        table += peer_rows(name, impls, tf, [i for i in impls if i.startswith("te_jax")])
        print("\n".join(table[-2:]), flush=True)
    print_table(f"d_qk 192 / d_v 128: TFLOP/s ({args.rounds} interleaved rounds, medians), "
                f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}", table,
                save_as="attention_head_dims")


if __name__ == "__main__":
    main()
