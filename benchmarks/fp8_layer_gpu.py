"""GPU benchmark: a Llama-style te_jax TransformerLayer, fwd+bwd, bf16 vs FP8 (DelayedScaling, Float8CurrentScaling).

Run on the device machine from the repo root:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.fp8_layer_gpu 2>&1 | tee $OUT/fp8_log.txt
    (--gemm-style direct,direct_bf16 traces each FP8 variant once per listed TE_JAX_FP8_GEMM style; --with-block adds Float8BlockScaling,
     a reference implementation that is NOT an FP8 GEMM; --param-dtype fp32 keeps fp32 parameters;
     --fused-mlp both adds each per-tensor FP8 variant with the MLP unfused, TE_JAX_FP8_FUSED=0 at trace time;
     --keep-weights both times it with the MLP's FP8 weight copies kept for the backward and re-cast there,
     TE_JAX_FP8_KEEP_WEIGHTS=1 and 0; the default follows the library: kept for DelayedScaling only)
CPU smoke test of the script itself (tiny sizes; no cuBLASLt, so the FP8 custom-call count is 0 and the
f8 converts are counted instead):
    PYTHONPATH=. python -m benchmarks.fp8_layer_gpu --cpu-smoke

Layer (TransformerEngine-JAX's FP8 comparison point, 1.62x DelayedScaling / 1.44x Float8CurrentScaling
over bf16): hidden 4096, 32 query heads / 8 kv heads (head_dim 128), SwiGLU ("silu", "linear") FFN 14336,
RoPE, RMSNorm, no biases, no dropout, causal self-attention, bf16 compute, batch 4 x seq 2048.
Step: jit(value_and_grad(mean loss)) over the parameters and the input (and, under DelayedScaling, the
FP8 state collection, whose "gradient" is the next state: te_jax/fp8/state.py). Each variant is lowered
and compiled inside its own te_jax.fp8.autocast, so the compiled step carries its recipe.

Reported per variant: median ms over 5 interleaved rounds (each the median of 10 steps), min/max of the
rounds, speed-up vs bf16, the number of `__cublas$lt$matmul$f8` custom calls in the compiled HLO
(15 per layer: 5 GEMM sites -- query (LayerNormDenseGeneral), kv (DenseGeneral; GQA keeps q and kv apart),
out, wi, wo -- x 3 GEMMs each: forward, dgrad, wgrad; fewer when XLA merges the query and kv GEMMs, which read
the same quantized input under current scaling), the number of GEMMs not on FP8 operands (te_jax.fp8.hlo), and
the temp memory of compiled.memory_analysis(). Correctness: after two state-updating steps, loss and
input-gradient relative error of each FP8 variant against bf16 (expected ~1e-2 on the loss scale and
below ~0.1 on gradients). JSON to $OUT/fp8_layer.json.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from te_jax import fp8
from te_jax.fp8.hlo import gemm_kinds
from te_jax.fp8.quantize import GEMM_STYLES
from te_jax.flax import TransformerLayer

DATE = str(datetime.date.today())
F8_CALL = "__cublas$lt$matmul$f8"
SITES = 5  # query, kv, out, wi, wo
EXPECTED_F8_GEMMS = 3 * SITES


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: checks the script, not speed")
    p.add_argument("--plot-only", help="redraw the PNG from this fp8_layer.json and exit")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (median taken)")
    p.add_argument("--inner", default="1",
                   help="steps dispatched back to back per timed sample, comma-separated: 1 blocks after every step "
                        "(host dispatch counts), 4 lets the host queue the next step as a training loop does; "
                        "one table per value, all timed in the same interleaved rounds")
    p.add_argument("--gemm-style", default="direct",
                   help="FP8 GEMM style(s), comma-separated, each a variant (te_jax.fp8.quantize.GEMM_STYLES)")
    p.add_argument("--triton-gemm", choices=["on", "off", "both"], default="on",
                   help="XLA's Triton GEMM fusions: on (XLA's default), off (compiler_options "
                        "xla_gpu_enable_triton_gemm=False for every variant: the qdq style then reaches cuBLASLt's FP8 "
                        "GEMM with the scales folded), or both as variants")
    p.add_argument("--with-block", action="store_true", help="add Float8BlockScaling: the reference (not an FP8 GEMM) and the FP8 block "
                   "GEMM (TE_JAX_FP8_BLOCK_GEMM=pallas; its Mosaic GPU kernels are not counted as FP8 GEMMs)")
    p.add_argument("--only", default="",
                   help="keep bf16 and the variants whose names contain one of these comma-separated strings")
    p.add_argument("--param-dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--fused-mlp", choices=["on", "off", "both"], default="on",
                   help="LayerNormMLP's fused FP8 path (te_jax/fp8/mlp.py; TE_JAX_FP8_FUSED): on, off, or both "
                        "as variants (A/B)")
    p.add_argument("--keep-weights", choices=["auto", "on", "both"], default="auto",
                   help="the fused MLP keeps its weights' FP8 copies for the backward (TE_JAX_FP8_KEEP_WEIGHTS=1) "
                        "instead of re-casting them (=0): auto (the library's default: kept for DelayedScaling "
                        "only), on, or both (=1 and =0 as variants: time and temporary memory side by side)")
    p.add_argument("--env-ab", default="",
                   help='"NAME=VALUE;NAME=VALUE,NAME=VALUE": per entry, a copy of every variant (bf16 too) traced with '
                        'that '
                        'environment (trace-time switches such as TE_JAX_FP8_SPLIT_DOTS=0; an entry may set several, '
                        'comma-separated), labelled [entry]')
    p.add_argument("--trace", action="store_true",
                   help="profile 3 steps of each variant: device time per kernel category and the top ops; "
                        "optimized HLO to $OUT/fp8_hlo_<variant>.txt.gz")
    p.add_argument("--gaps", action="store_true",
                   help="per variant: where the device idles between kernels (span, kernel sum, longest stretches)")
    p.add_argument("--flax-peer", action="store_true",
                   help="add the same block in plain Flax with nn.Fp8DotGeneralOp Dense layers (and bf16), cuDNN attention")
    p.add_argument("--probe-small", action="store_true",
                   help="print the GEMM custom calls of one small FP8 DenseGeneral (K 128, N 256) step")
    return p.parse_args()


#: The issue's targets (x vs te_jax bf16) and TransformerEngine-JAX 2.20.2's ratios on this layer (measured in
#: another process, ../shared notes): drawn beside the bars.
TARGETS = {"DelayedScaling": 1.65, "Float8CurrentScaling": 1.47, "Float8BlockScaling": 1.45}
TE_JAX = {"DelayedScaling": 1.62, "Float8CurrentScaling": 1.44}


def plot(res, path):
    """Bars of x vs bf16 per variant (one bar per --inner value), the targets and TransformerEngine-JAX's ratios as
    marks. Returns False where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n in dict.fromkeys(r["name"] for r in res["rows"]) if n != "bf16"]
    inners = sorted({r["inner"] for r in res["rows"]})
    fig, ax = plt.subplots(figsize=(9, 2.2 + 0.7 * len(names)))
    h = 0.8 / max(len(inners), 1)
    for j, n_in in enumerate(inners):
        vals = [next((r["speedup_vs_bf16"] for r in res["rows"] if r["name"] == n and r["inner"] == n_in), 0.0)
                for n in names]
        ys = [i + j * h for i in range(len(names))]
        ax.barh(ys, vals, height=h, label=f"te_jax, {n_in} step(s) per sample")
        for y, v in zip(ys, vals):
            ax.text(v + 0.01, y, f"{v:.2f}x", va="center", fontsize=8)
    for i, n in enumerate(names):
        key = next((k for k in TARGETS if n.startswith(k)), None)
        y0, y1 = i - h / 2, i + (len(inners) - 0.5) * h
        if key:
            ax.vlines(TARGETS[key], y0, y1, colors="k", linestyles="--", lw=1.2,
                      label="target (issue)" if i == 0 else None)
        if key in TE_JAX:
            ax.vlines(TE_JAX[key], y0, y1, colors="tab:red", lw=1.2,
                      label="TransformerEngine-JAX 2.20.2 (another process)" if i == 0 else None)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_yticks([i + (len(inners) - 1) * h / 2 for i in range(len(names))], names, fontsize=8)
    ax.set_xlabel("speed vs te_jax bf16 (x)")
    ax.set_xlim(0, 1.9)
    ax.set_title(f"Llama-style layer fwd+bwd, FP8 vs bf16\n{res['device']}, jax {res['jax']}, {res['date']}",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def log(*a):
    print(*a, flush=True)


@contextlib.contextmanager
def env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def count_f8_converts(hlo: str) -> int:
    return len(re.findall(r"f8e4m3fn\[|f8e5m2\[", hlo))


def main():
    args = parse()
    if args.plot_only:
        res = json.load(open(args.plot_only))
        out = args.plot_only[:-len(".json")] + ".png" if args.plot_only.endswith(".json") else args.plot_only + ".png"
        print(f"{out}: {plot(res, out)}")
        return
    smoke = args.cpu_smoke
    if smoke:
        B, S, HID, HEADS, KV, FFN = 2, 32, 64, 4, 2, 128
        args.rounds, args.steps = min(args.rounds, 2), min(args.steps, 2)
    else:
        B, S, HID, HEADS, KV, FFN = 4, 2048, 4096, 32, 8, 14336
    pdt = jnp.bfloat16 if args.param_dtype == "bf16" else jnp.float32
    out_dir = os.environ.get("OUT", "/tmp")
    dev = jax.devices()[0]
    log(f"date {DATE}  device {dev.device_kind}  platform {dev.platform}  jax {jax.__version__}"
        + ("  [CPU SMOKE: tiny sizes, timings meaningless]" if smoke else ""))
    log(f"layer: hidden {HID}, heads {HEADS}/{KV} kv, SwiGLU FFN {FFN}, RoPE, RMSNorm, causal, no bias/dropout; "
        f"batch {B} x seq {S}; bf16 compute, {args.param_dtype} params")

    layer = TransformerLayer(
        hidden_size=HID, mlp_hidden_size=FFN, num_attention_heads=HEADS, num_gqa_groups=KV,
        layernorm_type="rmsnorm", mlp_activations=("silu", "linear"), enable_rotary_pos_emb=True,
        enable_relative_embedding=False, hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
        self_attn_mask_type="causal", use_bias=False, scale_attn_logits=True, dtype=jnp.bfloat16,
        param_dtype=pdt, attn_input_format="bshd")
    kx, kp, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, S, HID), jnp.float32).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (B, S, HID), jnp.float32)

    variants = {"bf16": (None, "direct", "1")}
    styles = args.gemm_style.split(",")
    for st in styles:
        if st not in GEMM_STYLES:
            raise SystemExit(f"--gemm-style: {st!r} is not one of {GEMM_STYLES}")
    fused = {"on": ["1"], "off": ["0"], "both": ["1", "0"]}[args.fused_mlp]
    # "1": fused, the library's default for the weights' FP8 copies (TE_JAX_FP8_KEEP_WEIGHTS=auto: kept for
    # DelayedScaling); "1k": kept for every recipe (=1); "1r": re-cast in the backward (=0)
    fused = {"auto": fused, "on": [f + "k" if f == "1" else f for f in fused],
             "both": [v for f in fused for v in ((f + "r", f + "k") if f == "1" else (f,))]}[args.keep_weights]
    for st in styles:
        for fu in fused:
            suffix = "" if len(styles) == 1 else f" [{st}]"
            suffix += " [unfused MLP]" if fu == "0" and len(fused) > 1 else ""
            suffix += {"1k": " [kept weight copies]", "1r": " [weights re-cast]"}.get(fu, "")
            variants[f"DelayedScaling(1024, max){suffix}"] = (
                fp8.DelayedScaling(amax_history_len=1024, amax_compute_algo="max"), st, fu)
            variants[f"Float8CurrentScaling{suffix}"] = (fp8.Float8CurrentScaling(), st, fu)
    if args.with_block:
        variants["Float8BlockScaling (reference)"] = (fp8.Float8BlockScaling(), "direct", "1")
        # the FP8 block GEMM (te_jax/fp8/block.py): style "block-pallas" sets TE_JAX_FP8_BLOCK_GEMM
        variants["Float8BlockScaling (FP8 block GEMM, pallas)"] = (fp8.Float8BlockScaling(), "block-pallas", "1")

    extra_env = {}  # variant name -> {env name: value}, from --env-ab (one entry's switches per copy)
    base = list(variants.items())  # bf16 too: a switch that moves both steps shows in the ratio
    for entry in [e for e in args.env_ab.split(";") if e]:
        settings = dict(s.partition("=")[::2] for s in entry.split(",") if s)
        for name, v in base:
            variants[f"{name} [{entry}]"] = v
            extra_env[f"{name} [{entry}]"] = settings

    peers = {}
    if args.flax_peer:
        from benchmarks.flax_fp8_peer import FlaxLlamaBlock
        impl = None if smoke else "cudnn"
        for label, on in (("flax bf16 Dense (peer)", False), ("flax nn.Fp8DotGeneralOp Dense (peer)", True)):
            variants[label] = (None, "direct", "1")
            peers[label] = FlaxLlamaBlock(hidden=HID, heads=HEADS, kv_heads=KV, ffn=FFN, fp8=on, attn_impl=impl)

    def make_grad_fn(module):
        def loss_fn(params, state, x, ct):
            v = {"params": params}
            if state:
                v[fp8.FP8_COLLECTION] = state
            y = module.apply(v, x, deterministic=True)
            return jnp.mean(y.astype(jnp.float32) * ct)

        # ct is an argument, not a closed-over constant: as a constant, XLA constant-folds the amax of the output
        # gradient (a reduction over B*S*HID elements), which took 79 s of compile time per FP8 variant.
        return jax.value_and_grad(loss_fn, argnums=(0, 1, 2))

    if args.triton_gemm == "both":
        variants = {**{n: v + (False,) for n, v in variants.items()},
                    **{f"{n} [triton gemm off]": v + (True,) for n, v in variants.items()}}
    else:
        variants = {n: v + (args.triton_gemm == "off",) for n, v in variants.items()}

    steps, info = {}, {}
    if args.only:
        keep = [k for k in args.only.split(",") if k]
        variants = {n: v for n, v in variants.items() if n.startswith("bf16") or any(k in n for k in keep)}
    for name, (recipe, style, fused_mlp, no_triton) in variants.items():
        module = peers.get(name, layer)
        grad_fn = make_grad_fn(module)
        block_gemm = "pallas" if style == "block-pallas" else "xla"
        with (fp8.autocast(enabled=recipe is not None, recipe=recipe),
              env("TE_JAX_FP8_GEMM", "direct" if style == "block-pallas" else style),
              env("TE_JAX_FP8_FUSED", fused_mlp[0]), env("TE_JAX_FP8_BLOCK_GEMM", block_gemm),
              env("TE_JAX_FP8_KEEP_WEIGHTS", {"1k": "1", "1r": "0"}.get(fused_mlp, "auto")),
              contextlib.ExitStack() as more):
            for key, value in extra_env.get(name, {}).items():
                more.enter_context(env(key, value))
            variables = jax.jit(lambda k: nn.meta.unbox(module.init(k, x[:1, :8], deterministic=True)))(kp)
            params, state = variables["params"], variables.get(fp8.FP8_COLLECTION, {})
            if name == "bf16":
                base_params = params
            if name not in peers:
                params = base_params  # same weights for every te_jax variant
            if recipe is not None:
                log(f"\n== {name}: te_jax.fp8.explain ==")
                log(str(fp8.explain(lambda: layer.apply({"params": params, **({fp8.FP8_COLLECTION: state}
                                                                              if state else {})},
                                                         x, deterministic=True))))
            # a fresh function per variant: the GEMM style and the fused-MLP switch (env vars read at trace time)
            # are not part of jit's cache key (autocast's recipe is: te_jax/fp8/context.py)
            opts = {"xla_gpu_enable_triton_gemm": False} if no_triton and not smoke else None
            compiled = jax.jit(lambda p, s, x, c: grad_fn(p, s, x, c)).lower(params, state, x, ct).compile(
                compiler_options=opts)
        hlo = compiled.as_text()
        mem = compiled.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
        kinds = gemm_kinds(hlo)
        n_f8 = kinds["fp8 cublaslt"] + kinds["fp8 fusion"]
        n_other = kinds["other"]
        # two state-updating steps (calibrated delayed scales), then the values used for correctness
        loss, (gp, gs, gx) = compiled(params, state, x, ct)
        for _ in range(2):
            if state:
                state = gs
            loss, (gp, gs, gx) = compiled(params, state, x, ct)
        steps[name] = (compiled, (params, state, x, ct))
        info[name] = dict(f8_gemms=n_f8, other_cublas_gemms=n_other, f8_converts=count_f8_converts(hlo),
                          temp_bytes=temp, loss=float(loss), grad_x=gx, style=style,
                          fused_mlp=fused_mlp.startswith("1"),
                          recipe=None if recipe is None else repr(recipe))
        log(f"{name}: compiled; FP8 GEMMs x{n_f8} (at most {EXPECTED_F8_GEMMS if recipe is not None and not recipe.float8_block_scaling() else 0}), "
            f"GEMMs not in FP8 x{n_other}, f8 converts in HLO x{info[name]['f8_converts']}, "
            f"temp {temp / 2**20 if temp is not None else float('nan'):.1f} MiB, loss {float(loss):.6f}")

    log("\n== correctness vs bf16 (after 2 state-updating steps) ==")
    ref = info["bf16"]
    gref = np.asarray(ref["grad_x"], np.float32)
    for name, d in info.items():
        g = np.asarray(d.pop("grad_x"), np.float32)
        d["grad_x_rel_err_vs_bf16"] = float(np.linalg.norm(g - gref) / (np.linalg.norm(gref) + 1e-30))
        d["loss_abs_diff_vs_bf16"] = abs(d["loss"] - ref["loss"])
        if name != "bf16":
            log(f"{name}: loss {d['loss']:.6f} (bf16 {ref['loss']:.6f}), input-gradient rel. err "
                f"{d['grad_x_rel_err_vs_bf16']:.3e}, finite {np.isfinite(g).all()}")

    inners = [int(x) for x in args.inner.split(",")]
    times = {(name, n): [] for n in inners for name in steps}
    for r in range(args.rounds):
        for n in inners:
            for name, (f, a) in steps.items():
                times[(name, n)].append(timing.measure(f, a, samples=args.steps, warmup=1, inner=n)[0])
        log(f"round {r + 1}/{args.rounds} done")

    rows = []
    for n in inners:
        base = statistics.median(times[("bf16", n)])
        log(f"\n## Llama-style TransformerLayer fwd+bwd, bf16 vs FP8 — {DATE}, {dev.device_kind}, jax {jax.__version__}"
            + (" (CPU smoke: timings meaningless)" if smoke else ""))
        log(f"hidden {HID}, {HEADS}/{KV} heads, SwiGLU {FFN}, RoPE, RMSNorm, causal, B{B}xS{S}, bf16; "
            f"{args.rounds} interleaved rounds x median of {args.steps} samples, each {n} step(s) dispatched back to "
            f"back then one block\n")
        log("| variant | ms (median of rounds) | min | max | x vs bf16 | FP8 GEMMs | GEMMs not in FP8 | temp MiB |")
        log("|---|---|---|---|---|---|---|---|")
        for name in steps:
            ts = times[(name, n)]
            med = statistics.median(ts)
            d = info[name]
            temp = d["temp_bytes"] / 2**20 if d["temp_bytes"] is not None else float("nan")
            log(f"| {name} | {med * 1e3:.2f} | {min(ts) * 1e3:.2f} | {max(ts) * 1e3:.2f} | {base / med:.2f}x | "
                f"{d['f8_gemms']} | {d['other_cublas_gemms']} | {temp:.0f} |")
            rows.append(dict(name=name, inner=n, ms=med * 1e3, ms_rounds=[t * 1e3 for t in ts],
                             speedup_vs_bf16=base / med, **d))
    if not smoke:
        for name, d in info.items():
            if name != "bf16" and "Block" not in name and (d["other_cublas_gemms"] or not d["f8_gemms"]):
                log(f"WARNING: {name}: {d['other_cublas_gemms']} GEMMs not in FP8 ({d['f8_gemms']} FP8 GEMMs; "
                    f"{EXPECTED_F8_GEMMS} when XLA merges none)")
    os.makedirs(out_dir, exist_ok=True)
    traces = {}
    if args.trace:
        from benchmarks.fp8_trace import category_table, trace_categories
        for name, (f, a) in steps.items():
            tag = re.sub(r"[^\w]+", "_", name).strip("_")
            try:
                traces[name] = trace_categories(f, a, os.path.join(out_dir, f"fp8_hlo_{tag}.txt.gz"))
            except Exception as e:  # a failed trace must not lose the timings above
                traces[name] = {"error": repr(e)}
        log(category_table(traces))
    if args.gaps:
        from benchmarks.fp8_trace import idle_gaps
        for name, (f, a) in steps.items():
            log(f"\n== idle device time: {name}\n{idle_gaps(f, a)}")
    if args.probe_small:
        from benchmarks.fp8_trace import probe_small_dense
        log(probe_small_dense())
    res = dict(traces=traces, date=DATE, device=dev.device_kind, jax=jax.__version__, smoke=smoke, expected_f8_gemms=EXPECTED_F8_GEMMS,
               shape=dict(batch=B, seq=S, hidden=HID, heads=HEADS, kv_heads=KV, ffn=FFN), rows=rows)
    with open(os.path.join(out_dir, "fp8_layer.json"), "w") as f:
        json.dump(res, f, indent=1)
    log(f"wrote {os.path.join(out_dir, 'fp8_layer.json')}; png: {plot(res, os.path.join(out_dir, 'fp8_layer.png'))}")


if __name__ == "__main__":
    main()
