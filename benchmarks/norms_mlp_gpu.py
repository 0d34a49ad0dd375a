"""GPU benchmark for the norm and LayerNorm-MLP ops: correctness, then timing, in one process.

Run on the device machine from the repo root:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.norms_mlp_gpu 2>&1 | tee $OUT/log.txt
CPU smoke test of the script itself (tiny sizes):
    PYTHONPATH=. BENCH_SMALL=1 python3 -m benchmarks.norms_mlp_gpu

1. Correctness on the GPU (relative error vs an fp32 reference): Pallas layernorm/rmsnorm fwd
   and grads; layernorm_mlp (Pallas norm + XLA GEMMs, and the fused LN-prologue Pallas GEMM).
2. Norms on 32768x4096 bf16: forward and forward+backward, TB/s (fwd: read x + write y;
   fwd+bwd: four passes of x's size), Pallas (a small launch sweep) vs plain XLA.
3. layernorm_mlp fwd+bwd, 8192 tokens, hidden 4096, FFN 16384, bf16, gelu and SwiGLU:
   time and memory (temp bytes of the compiled grad step; residual bytes kept by jax.vjp,
   parameters excluded) vs the same computation in plain JAX.
Prints a markdown table last.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ln_mlp import ln_mlp as kern
from pallas_kernels.ln_mlp import reference as mlp_ref
from pallas_kernels.norms import norm as pnorm
from pallas_kernels.norms import reference as nref

from benchmarks import timing

T0 = time.time()
BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", "330"))
OUT = os.environ.get("OUT", "/tmp")
RESULTS = {"date": str(datetime.date.today())}
QUICK = "--quick" in sys.argv
INNER = 10
SMALL = os.environ.get("BENCH_SMALL") == "1"  # CPU smoke test of the script itself


def elapsed():
    return time.time() - T0


def log(*a):
    print(f"[{elapsed():6.1f}s]", *a, flush=True)


def bench(f, *args, n=25, warm=3, inner=1):
    """Median over n samples; each sample enqueues `inner` calls and blocks once (benchmarks/timing.py)."""
    return timing.measure(f, args, samples=n, warmup=warm, inner=inner)[0]


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def keys(seed, n):
    return jax.random.split(jax.random.PRNGKey(seed), n)


# ----------------------------------------------------------------------------- correctness


def check_norms():
    res = {}
    k = keys(1, 4)
    for (m, d) in ([(64, 128), (30, 100)] if SMALL else [(4096, 4096), (1000, 1000)]):
        x = (jax.random.normal(k[0], (m, d)) * 2 + 0.3).astype(jnp.bfloat16)
        g = 1 + 0.2 * jax.random.normal(k[1], (d,))
        b = 0.2 * jax.random.normal(k[2], (d,))
        dy = jax.random.normal(k[3], (m, d)).astype(jnp.bfloat16)
        for name in ("layernorm", "rmsnorm"):
            if name == "layernorm":
                fp = lambda x, g, b: pnorm.layernorm(x, g, b)
                fr = lambda x, g, b: nref.layernorm(x.astype(jnp.float32), g, b)
            else:
                fp = lambda x, g, b: pnorm.rmsnorm(x, g) + (0 * b[0]).astype(x.dtype)
                fr = lambda x, g, b: nref.rmsnorm(x.astype(jnp.float32), g) + 0 * b[0]
            yp, vp = jax.vjp(jax.jit(fp), x, g, b)
            yr, vr = jax.vjp(fr, x, g, b)
            gp, gr = vp(dy), vr(dy.astype(jnp.float32))
            errs = [rel(yp, yr)] + [rel(p, q) for p, q in zip(gp, gr)][: 3 if name == "layernorm" else 2]
            res[f"{name} {m}x{d}"] = errs
            log(f"correctness {name} {m}x{d} bf16: rel err y/dx/dgamma(/dbeta) = "
                + ", ".join(f"{e:.2e}" for e in errs))
    return res


def mlp_inputs(seed, t, d, f, acts, dtype=jnp.bfloat16):
    n = len(acts)
    k = keys(seed, 8)
    x = jax.random.normal(k[0], (t, d)).astype(dtype)
    g = 1 + 0.1 * jax.random.normal(k[1], (d,))
    b = 0.1 * jax.random.normal(k[2], (d,))
    w1 = (jax.random.normal(k[3], (d, n, f)) / np.sqrt(d)).astype(dtype)
    b1 = (0.1 * jax.random.normal(k[4], (n, f))).astype(dtype)
    w2 = (jax.random.normal(k[5], (f, d)) / np.sqrt(f)).astype(dtype)
    b2 = (0.1 * jax.random.normal(k[6], (d,))).astype(dtype)
    dy = jax.random.normal(k[7], (t, d)).astype(dtype)
    return (x, g, b, w1, b1, w2, b2), dy


def plain_bf16_act(x, g, b, w1, b1, w2, b2, *, activations):
    """Plain JAX with the activation evaluated in x.dtype (what a casual implementation does)."""
    from pallas_kernels.ln_mlp.activations import apply_activations
    ln = nref.layernorm(x, g, b)
    d, n, f = w1.shape
    h = (mlp_ref.mm(ln, w1.reshape(d, n * f)) + b1.reshape(-1).astype(jnp.float32)).astype(x.dtype)
    a = apply_activations(h.reshape(-1, n, f), activations)
    return (mlp_ref.mm(a, w2) + b2.astype(jnp.float32)).astype(x.dtype)


VARIANTS = {
    "plain JAX (xla)": lambda acts: (lambda *a: mlp_ref.layernorm_mlp(*a, activations=acts)),
    "plain JAX, act in bf16": lambda acts: (lambda *a: plain_bf16_act(*a, activations=acts)),
    "te pallas: Pallas norm + XLA GEMMs, recompute vjp": lambda acts: (
        lambda *a: kern.layernorm_mlp(*a, activations=acts, norm_impl="pallas", gemm_impl="xla")),
    "recompute vjp, XLA norm": lambda acts: (
        lambda *a: kern.layernorm_mlp(*a, activations=acts, norm_impl="xla", gemm_impl="xla")),
    "fused LN-prologue Pallas GEMM1": lambda acts: (
        lambda *a: kern.layernorm_mlp(*a, activations=acts, norm_impl="pallas", gemm_impl="pallas")),
}


def check_mlp():
    res = {}
    for acts in [("gelu",), ("silu", "linear")]:
        args, dy = mlp_inputs(2, *((32, 64, 128) if SMALL else (512, 1024, 2048)), acts)
        f32 = jax.tree.map(lambda a: a.astype(jnp.float32), args)
        yr, vr = jax.vjp(lambda *a: mlp_ref.layernorm_mlp(*a, activations=acts), *f32)
        gr = vr(dy.astype(jnp.float32))
        for vname, mk in VARIANTS.items():
            fn = jax.jit(mk(acts))
            yp, vp = jax.vjp(fn, *args)
            gp = vp(dy)
            errs = [rel(yp, yr)] + [rel(p, q) for p, q in zip(gp, gr)]
            res[f"{acts} {vname}"] = errs
            log(f"correctness mlp {acts} [{vname}] bf16 vs fp32 ref: rel err y/dx/dg/db/dw1/db1/dw2/db2 = "
                + ", ".join(f"{e:.1e}" for e in errs))
    return res


# ----------------------------------------------------------------------------- norm timing


def time_norms():
    m, d = (256, 512) if SMALL else (32768, 4096)
    k = keys(3, 4)
    x = jax.random.normal(k[0], (m, d)).astype(jnp.bfloat16)
    g = 1 + 0.1 * jax.random.normal(k[1], (d,))
    b = 0.1 * jax.random.normal(k[2], (d,))
    dy = jax.random.normal(k[3], (m, d)).astype(jnp.bfloat16)
    nbytes = x.size * x.dtype.itemsize
    out = {}
    fwd_cfgs = [(1, 4), (1, 8), (2, 8), (4, 8), (2, 16), (4, 16)]
    bwd_cfgs = [(1, 4, 528), (1, 8, 528), (2, 8, 528), (1, 8, 1056), (2, 8, 264), (4, 16, 264), (1, 4, 2112)]
    if QUICK:
        fwd_cfgs, bwd_cfgs = fwd_cfgs[:2], bwd_cfgs[:2]
    for name in ("layernorm", "rmsnorm"):
        rms = name == "rmsnorm"
        if rms:
            xla_f = lambda x, g, b: nref.rmsnorm(x, g)
            pal = lambda cfg: (lambda x, g, b: pnorm.rmsnorm(x, g, config=cfg))
        else:
            xla_f = lambda x, g, b: nref.layernorm(x, g, b)
            pal = lambda cfg: (lambda x, g, b: pnorm.layernorm(x, g, b, config=cfg))
        nargs = 2 if rms else 3

        def fb(f):
            def step(x, g, b, dy):
                y, vjp = jax.vjp(f, x, g, b)
                return vjp(dy)[:nargs]
            return jax.jit(step)

        r = {}
        t = bench(jax.jit(xla_f), x, g, b, inner=INNER)
        r["xla_fwd"] = 2 * nbytes / t / 1e12
        t = bench(fb(xla_f), x, g, b, dy, inner=INNER)
        r["xla_fwdbwd"] = 4 * nbytes / t / 1e12
        log(f"{name} XLA: fwd {r['xla_fwd']:.2f} TB/s, fwd+bwd {r['xla_fwdbwd']:.2f} TB/s")
        best = (0, None)
        t_def = bench(jax.jit(pal(pnorm.NormConfig())), x, g, b, inner=INNER)
        r["pallas_fwd_default"] = 2 * nbytes / t_def / 1e12
        log(f"{name} Pallas fwd default config: {r['pallas_fwd_default']:.2f} TB/s")
        if name == "layernorm":  # the statistics mode: one pass (default) vs two passes
            t2 = bench(jax.jit(pal(pnorm.NormConfig(fwd_stats="two_pass"))), x, g, b, inner=INNER)
            r["pallas_fwd_two_pass"] = 2 * nbytes / t2 / 1e12
            log(f"{name} Pallas fwd two-pass statistics: {r['pallas_fwd_two_pass']:.2f} TB/s")
        for br, nw in fwd_cfgs:
            if elapsed() > BUDGET_S * 0.45:
                break
            try:
                t = bench(jax.jit(pal(pnorm.NormConfig(block_rows=br, num_warps=nw))), x, g, b, inner=INNER)
            except Exception as e:  # noqa: BLE001
                log(f"  fwd cfg rows={br} warps={nw} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tb = 2 * nbytes / t / 1e12
            log(f"  fwd cfg rows={br} warps={nw}: {tb:.2f} TB/s")
            if tb > best[0]:
                best = (tb, (br, nw))
        r["pallas_fwd_best"], r["pallas_fwd_best_cfg"] = best
        t_def = bench(fb(pal(pnorm.NormConfig())), x, g, b, dy, inner=INNER)
        r["pallas_fwdbwd_default"] = 4 * nbytes / t_def / 1e12
        log(f"{name} Pallas fwd+bwd default config: {r['pallas_fwdbwd_default']:.2f} TB/s")
        bbest = (0, None)
        fbr, fnw = best[1] or (None, None)
        for br, nw, grid in bwd_cfgs:
            if elapsed() > BUDGET_S * 0.6:
                break
            cfg = pnorm.NormConfig(block_rows=fbr, num_warps=fnw, bwd_block_rows=br, bwd_num_warps=nw,
                                   bwd_grid=grid)
            try:
                t = bench(fb(pal(cfg)), x, g, b, dy, inner=INNER)
            except Exception as e:  # noqa: BLE001
                log(f"  bwd cfg {br},{nw},{grid} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tb = 4 * nbytes / t / 1e12
            log(f"  fwd+bwd cfg bwd rows={br} warps={nw} grid={grid}: {tb:.2f} TB/s")
            if tb > bbest[0]:
                bbest = (tb, (br, nw, grid))
        r["pallas_fwdbwd_best"], r["pallas_fwdbwd_best_cfg"] = bbest
        out[name] = r
    return out


# ----------------------------------------------------------------------------- MLP timing + memory


def residual_bytes(fn, args, n_param_args=None):
    """Bytes of the residuals jax.vjp keeps for fn: outputs of the vjp closure's jaxpr, except the
    weights (args[1:]) forwarded unchanged or only reshaped/cast/transposed. x counts. Shapes only."""
    from jax.extend import core as jcore

    closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*args)
    jaxpr = closed.jaxpr
    weights = set(jaxpr.invars[1:])
    alias = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("reshape", "convert_element_type", "transpose", "squeeze", "expand_dims",
                                  "copy") and len(eqn.invars) == 1 and not isinstance(eqn.invars[0], jcore.Literal):
            alias[eqn.outvars[0]] = alias.get(eqn.invars[0], eqn.invars[0])
    total, seen = 0, set()
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Literal) or v in seen:
            continue
        seen.add(v)
        if alias.get(v, v) in weights:
            continue
        total += int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
    return total


def time_mlp():
    t, d, f = (64, 128, 256) if SMALL else (8192, 4096, 16384)
    out = {}
    for acts, label in [(("gelu",), "gelu"), (("silu", "linear"), "SwiGLU")]:
        args, dy = mlp_inputs(4, t, d, f, acts)
        r = {}
        for vname, mk in VARIANTS.items():
            if elapsed() > BUDGET_S * 0.95:
                log(f"  skip {vname}: time budget")
                continue
            fn = mk(acts)

            def step(*a, fn=fn):
                y, vjp = jax.vjp(fn, *a[:-1])
                return vjp(a[-1])

            jstep = jax.jit(step)
            try:
                compiled = jstep.lower(*args, dy).compile()
                ma = compiled.memory_analysis()
                temp = getattr(ma, "temp_size_in_bytes", None)
                tm = bench(compiled, *args, dy, n=20, inner=2)
                rb = residual_bytes(fn, args, 6)
            except Exception as e:  # noqa: BLE001
                log(f"  {label} [{vname}] failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            flops = 2 * t * d * f * len(acts) * 3 + 2 * t * f * d * 3
            r[vname] = {"ms": tm * 1e3, "tflops": flops / tm / 1e12, "temp_bytes": temp, "resid_bytes": rb}
            log(f"mlp {label} [{vname}]: fwd+bwd {tm * 1e3:.2f} ms ({flops / tm / 1e12:.0f} TFLOP/s), "
                f"temp {temp / 2**20 if temp is not None else float('nan'):.0f} MiB, residuals {rb / 2**20:.0f} MiB")
        out[label] = r
    return out


def main():
    dev = jax.devices()[0]
    gpu = getattr(dev, "device_kind", str(dev))
    RESULTS.update(gpu=gpu, jax=jax.__version__)
    log(f"device {gpu}, jax {jax.__version__}, backend {jax.default_backend()}")
    RESULTS["correct_norm"] = check_norms()
    RESULTS["correct_mlp"] = check_mlp()
    RESULTS["norms"] = time_norms()
    RESULTS["mlp"] = time_mlp()
    with open(os.path.join(OUT, "results.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1, default=str)

    # ------------------------------------------------------------------ table
    lines = [f"# norms / LayerNorm-MLP on {gpu}, jax {jax.__version__}, {datetime.date.today()}",
             "", "## Norms, 32768x4096 bf16 (TB/s; fwd = read x + write y; fwd+bwd = 4 passes of x)", "",
             "| op | XLA fwd | Pallas fwd (default) | Pallas fwd (best cfg) | XLA fwd+bwd | Pallas fwd+bwd (default) "
             "| Pallas fwd+bwd (best cfg) | target fwd |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in RESULTS["norms"].items():
        lines.append(f"| {name} | {r['xla_fwd']:.2f} | {r['pallas_fwd_default']:.2f} | {r['pallas_fwd_best']:.2f} "
                     f"{r['pallas_fwd_best_cfg']} | {r['xla_fwdbwd']:.2f} | {r['pallas_fwdbwd_default']:.2f} | "
                     f"{r['pallas_fwdbwd_best']:.2f} {r['pallas_fwdbwd_best_cfg']} | >= 2.64 |")
    lines += ["", "## layernorm_mlp fwd+bwd, 8192 tokens, hidden 4096, FFN 16384, bf16", "",
              "| activation | variant | ms | x plain | TFLOP/s | temp MiB | x plain | residual MiB | x plain |",
              "|---|---|---|---|---|---|---|---|---|"]
    for label, r in RESULTS["mlp"].items():
        base = r.get("plain JAX (xla)")
        for vname, v in r.items():
            tr = v["ms"] / base["ms"] if base else float("nan")
            mr = v["temp_bytes"] / base["temp_bytes"] if base and base["temp_bytes"] else float("nan")
            rr = v["resid_bytes"] / base["resid_bytes"] if base and base["resid_bytes"] else float("nan")
            lines.append(f"| {label} | {vname} | {v['ms']:.2f} | {tr:.3f} | {v['tflops']:.0f} | "
                         f"{(v['temp_bytes'] or 0) / 2**20:.0f} | {mr:.2f} | {v['resid_bytes'] / 2**20:.0f} | {rr:.2f} |")
    lines += ["", "Targets: norm fwd >= 2.64 TB/s; layernorm_mlp time <= 1.0x plain JAX, saved-activation memory "
              "<= 0.6x plain JAX.", "",
              "Correctness (rel. error vs fp32 reference, bf16 inputs): "
              + "; ".join(f"{k}: max {max(v):.1e}" for k, v in {**RESULTS['correct_norm'],
                                                                  **RESULTS['correct_mlp']}.items())]
    table = "\n".join(lines)
    with open(os.path.join(OUT, "table.md"), "w") as fh:
        fh.write(table + "\n")
    print("\n" + table, flush=True)


if __name__ == "__main__":
    main()
