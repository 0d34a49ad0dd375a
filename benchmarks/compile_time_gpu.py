"""Compile time of a jitted training step over a stack of te_jax TransformerLayers, and where it goes.

Run on the GPU machine from the repo root (each measurement in a fresh subprocess, so no cache of an
earlier measurement helps a later one):
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.compile_time_gpu --part stacks  | tee $OUT/log.txt
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.compile_time_gpu --part example | tee $OUT/log.txt
CPU smoke test of the script (tiny sizes): PYTHONPATH=. python -m benchmarks.compile_time_gpu --part stacks --cpu-smoke

Stack (the shape of examples/train_lm.py --preset gpu): hidden 768, 12 heads, FFN 3072 (gelu), batch 16 x
seq 1024, causal, bf16 compute, fp32 parameters, no dropout. One measurement = `jit(value_and_grad(loss))
.lower(shapes).compile()` for (layers, backends, scanned or not), parameters given as shapes only.
Backends: "auto" (te_jax's choice for attention, norms, MLP), "pallas/xla" (Pallas attention, XLA norms
and MLP), "cudnn/xla". "unshared" repeats a row with pallas_kernels._lower_once.disabled(): every call site
lowers its own kernels, as before kernels were shared.

Breakdown per measurement, from jax.monitoring: tracing (jaxpr), lowering to StableHLO (jax's Python
lowering, where Pallas builds Mosaic GPU / Triton IR; the pallas_call lowering rule is also timed and
counted on its own), and XLA's compile (which includes ptxas and the Mosaic GPU / Triton kernel compiles).

--part example: examples/train_lm.py --preset gpu first step with an empty persistent compilation cache,
then again with the cache it wrote (both fresh processes), and its tokens/s; --part steady: the layer
stack's step time with shared and unshared kernels, interleaved rounds in one process.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"auto": ("auto", "auto", "auto"), "pallas/xla": ("pallas", "xla", "xla"),
           "cudnn/xla": ("cudnn", "xla", "xla")}


def _shape(smoke):
    if smoke:
        return dict(hidden=64, heads=4, ffn=128, batch=2, seq=128)
    return dict(hidden=768, heads=12, ffn=3072, batch=16, seq=1024)


# ----------------------------------------------------------------------------- one measurement (subprocess)


def _timed_pallas_lowering(stats):
    """Wrap the pallas_call lowering rule(s) so each lowering is counted and timed (private jax API)."""
    try:
        import dataclasses

        from jax._src.interpreters import mlir
        from jax._src.pallas.pallas_call import pallas_call_p
    except Exception as e:  # pragma: no cover - jax moved it
        stats["pallas_lowering_note"] = f"not measured: {e}"
        return

    def wrap(entry):
        rule = entry.rule

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return rule(*a, **k)
            finally:
                stats["pallas_lowerings"] += 1
                stats["pallas_lowering_s"] += time.perf_counter() - t

        return dataclasses.replace(entry, rule=timed)

    stats["pallas_lowerings"], stats["pallas_lowering_s"] = 0, 0.0
    for table in [mlir._lowerings] + list(mlir._platform_specific_lowerings.values()):
        if pallas_call_p in table:
            table[pallas_call_p] = wrap(table[pallas_call_p])


def make_stack(n_layers, attn, norm, mlp, scanned, shape, dtype):
    """scanned: False (a Python loop of layers), True (nn.scan), or "jit" (a Python loop of nn.jit-wrapped layers:
    jax traces and lowers the layer once and calls it n_layers times; XLA inlines the calls)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from te_jax.flax import TransformerLayer

    kw = dict(hidden_size=shape["hidden"], mlp_hidden_size=shape["ffn"], num_attention_heads=shape["heads"],
              hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0, mlp_activations=("gelu",),
              self_attn_mask_type="causal", enable_relative_embedding=False, dtype=dtype,
              param_dtype=jnp.float32, attention_backend=attn, norm_backend=norm, mlp_backend=mlp)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return TransformerLayer(**kw, name="layer")(x, deterministic=True), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            if scanned == "jit":
                jitted = nn.jit(Block)
                for i in range(n_layers):
                    x, _ = jitted(name=f"layer_{i}")(x, None)
                return x
            if scanned:
                scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                               length=n_layers, metadata_params={nn.PARTITION_NAME: "layers"})
                x, _ = scan(name="layers")(x, None)
                return x
            for i in range(n_layers):
                x = TransformerLayer(**kw, name=f"layer_{i}")(x, deterministic=True)
            return x

    return Stack()


def measure_one(n_layers, config, scanned, unshared, smoke):
    import jax
    import jax.numpy as jnp
    from jax import monitoring

    from pallas_kernels import _lower_once

    stats = {"trace_s": 0.0, "lower_s": 0.0, "backend_compile_s": 0.0}
    events = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "backend_compile_s"}

    def listener(event, duration, **_):
        if event in events:
            stats[events[event]] += duration

    monitoring.register_event_duration_secs_listener(listener)
    _timed_pallas_lowering(stats)
    shape = _shape(smoke)
    dtype = jnp.float32 if smoke else jnp.bfloat16
    model = make_stack(n_layers, *CONFIGS[config], scanned, shape, dtype)
    x = jax.ShapeDtypeStruct((shape["batch"], shape["seq"], shape["hidden"]), dtype)
    params = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(p, x):
        return jnp.mean(jnp.square(model.apply(p, x).astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss))
    ctx = _lower_once.disabled() if unshared else _nullcontext()
    with ctx:
        t0 = time.perf_counter()
        lowered = step.lower(params, x)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
    stats.update(layers=n_layers, config=config, scanned=scanned, unshared=unshared,
                 lower_wall_s=t1 - t0, compile_wall_s=t2 - t1, total_s=t2 - t0)
    return stats


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


XLA_TIMER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0",
                 "TF_CPP_VMODULE": "gpu_compiler=1,nvptx_compiler=1,compile_module_to_llvm_ir=1,autotuner_pass=1"}
_TIMER_RE = re.compile(r"\]\s*(.+?)\s+time:\s+([\d.]+)\s*(s|ms|us|min)\b")


def xla_phase_seconds(stderr: str) -> dict:
    """Sum XLA's scoped logging timers ("<label> time: 1.23 s") per label, numbers and ids stripped."""
    unit = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "min": 60.0}
    out = {}
    for m in _TIMER_RE.finditer(stderr):
        label = re.sub(r"\[.*?\]", "[]", m.group(1))
        label = re.sub(r"\b(for|of)\b.*$", "", label).strip()
        label = re.sub(r"[\d.]+", "#", label)[:90]
        out[label] = out.get(label, 0.0) + float(m.group(2)) * unit[m.group(3)]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def run_subprocess(args, timeout, xla_timers=False):
    cmd = [sys.executable, os.path.abspath(__file__)] + args
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if xla_timers:
        env.update(XLA_TIMER_ENV)
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    wall = time.perf_counter() - t
    return p, wall


# ----------------------------------------------------------------------------- parts


def part_stacks(opts):
    rows = []
    plan = []
    for scanned in {"no": (False,), "yes": (True,), "both": (False, True), "jit": ("jit",),
                    "no,jit": (False, "jit"), "all": (False, True, "jit")}[opts.scanned]:
        for config in opts.configs.split(","):
            if opts.cpu_smoke and config == "cudnn/xla":
                continue  # no cuDNN on the CPU
            for n in opts.layers:
                plan.append((n, config, scanned, False))
    if opts.unshared_layers:
        for n in opts.unshared_layers:
            plan.append((n, "auto", False, True))
    for n, config, scanned, unshared in plan:
        args = ["--one", str(n), config, "jit" if scanned == "jit" else "1" if scanned else "0", "1" if unshared else "0"]
        if opts.cpu_smoke:
            args.append("--cpu-smoke")
        p, wall = run_subprocess(args, opts.timeout, xla_timers=opts.xla_timers)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            print(f"FAILED {n} {config} scanned={scanned} unshared={unshared}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}",
                  flush=True)
            continue
        r = json.loads(line[0][len("RESULT "):])
        r["process_wall_s"] = wall
        if opts.xla_timers:
            r["xla_phases_s"] = xla_phase_seconds(p.stderr)
            tag = (f"{n}_{config.replace('/', '-')}_{'jit' if scanned == 'jit' else 'scan' if scanned else 'unscan'}"
                   f"{'_unshared' if unshared else ''}")
            out_dir = os.environ.get("OUT")
            if out_dir:
                with open(os.path.join(out_dir, f"xla_timers_{tag}.txt"), "w") as f:
                    f.write(p.stderr)
        rows.append(r)
        print(json.dumps(r), flush=True)
    _print_stack_table(rows)
    if opts.xla_timers:
        print("\nXLA compile phases (seconds, summed per timer label; nested timers overlap):")
        for r in rows:
            top = list(r.get("xla_phases_s", {}).items())[:14]
            print(f"- {r['layers']} layers {r['config']} scanned={r['scanned']}: "
                  + "; ".join(f"{k} {v:.2f}" for k, v in top))
    _dump(opts, "compile_time_stacks.json", rows)


def _print_stack_table(rows):
    import jax

    dev = jax.devices()[0].device_kind
    print(f"\n## Compile time of jit(value_and_grad) over a TransformerLayer stack, {dev}, jax {jax.__version__}, "
          f"{datetime.date.today()}\n")
    print("| layers | backends (attn/norm+MLP) | scanned | kernels | lower + compile s | trace s | to StableHLO s "
          "| of which Pallas lowering s (count) | XLA compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pl = (f"{r['pallas_lowering_s']:.1f} ({r['pallas_lowerings']})" if "pallas_lowerings" in r else "n/a")
        print(f"| {r['layers']} | {r['config']} | {'no, nn.jit layers' if r['scanned'] == 'jit' else 'yes' if r['scanned'] else 'no'} | "
              f"{'per call site' if r['unshared'] else 'shared'} | {r['total_s']:.1f} | {r['trace_s']:.1f} | "
              f"{r['lower_s']:.1f} | {pl} | {r['backend_compile_s']:.1f} |")
    by = {(r["layers"], r["config"], r["scanned"], r["unshared"]): r["total_s"] for r in rows}
    print()
    for scanned in (False, True, "jit"):
        tag = "unscanned, nn.jit layers" if scanned == "jit" else "scanned" if scanned else "unscanned"
        for n in sorted({r["layers"] for r in rows}):
            a, c = by.get((n, "auto", scanned, False)), by.get((n, "cudnn/xla", scanned, False))
            if a and c:
                print(f"- {tag}, {n} layers: auto / cudnn-xla = {a / c:.2f}")
        ns = sorted({r["layers"] for r in rows})
        if len(ns) >= 2:
            a_hi, a_mid = by.get((ns[-1], "auto", scanned, False)), by.get((ns[-2], "auto", scanned, False))
            if a_hi and a_mid:
                print(f"- {tag}, auto: {ns[-1]} layers / {ns[-2]} layers = {a_hi / a_mid:.2f}")


def _first_step_and_speed(text):
    first = re.search(r"compiled and ran the first step in ([0-9.]+)s", text)
    tps = re.search(r"tokens/s ([0-9,]+) \(2nd half ([0-9,]+)\)", text)
    return (float(first.group(1)) if first else None,
            (int(tps.group(1).replace(",", "")), int(tps.group(2).replace(",", ""))) if tps else None)


def part_example(opts):
    cache = tempfile.mkdtemp(prefix="te_jax_compile_cache_")
    base = [os.path.join(ROOT, "examples", "train_lm.py"), "--no-plot", "--no-progress", "--no-ckpt",
            "--sample-len", "0", "--compile-cache-dir", cache, "--out-dir", tempfile.mkdtemp()]
    if opts.cpu_smoke:
        base += ["--steps", "4", "--eval-every", "100", "--log-every", "1"]
    else:
        base += ["--preset", "gpu", "--steps", str(opts.example_steps), "--eval-every", "1000", "--log-every", "20"]
    results = []
    for label, extra in (("cold cache", []), ("warm cache", []), ("scan-layers, cold", ["--scan-layers",
                                                                                         "--compile-cache-dir",
                                                                                         tempfile.mkdtemp()])):
        t = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable] + base + extra, capture_output=True, text=True, timeout=opts.timeout,
                           env=env, cwd=ROOT)
        wall = time.perf_counter() - t
        first, tps = _first_step_and_speed(p.stdout + p.stderr)
        print(f"--- {label}: rc {p.returncode}, wall {wall:.1f}s, first step {first}s, tokens/s {tps}", flush=True)
        if p.returncode:
            print(p.stdout[-3000:], p.stderr[-3000:], flush=True)
        results.append(dict(run=label, rc=p.returncode, wall_s=wall, first_step_s=first,
                            tokens_per_s=tps[0] if tps else None, steady_tokens_per_s=tps[1] if tps else None))
    import jax

    print(f"\n## examples/train_lm.py {'--cpu-smoke' if opts.cpu_smoke else '--preset gpu'}, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}, "
          f"{opts.example_steps} steps\n")
    print("| run | first step s (compile + run) | whole process s | tokens/s | tokens/s, 2nd half |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['first_step_s']} | {r['wall_s']:.1f} | {r['tokens_per_s']} | "
              f"{r['steady_tokens_per_s']} |")
    _dump(opts, "compile_time_example.json", results)


def part_steady(opts):
    """Step time of the layer stack with shared and with per-call-site kernels, interleaved rounds."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import _lower_once

    shape = _shape(opts.cpu_smoke)
    dtype = jnp.float32 if opts.cpu_smoke else jnp.bfloat16
    n = opts.steady_layers
    model = make_stack(n, "auto", "auto", "auto", False, shape, dtype)
    x = jax.random.normal(jax.random.key(1), (shape["batch"], shape["seq"], shape["hidden"]), dtype)
    params = model.init(jax.random.key(0), x)

    def loss(p, x):
        return jnp.mean(jnp.square(model.apply(p, x).astype(jnp.float32)))

    steps = {}
    compiled_hlo = {}
    if opts.steady_compare == "jit":  # a Python loop of layers against the same loop of nn.jit-wrapped layers
        jit_model = make_stack(n, "auto", "auto", "auto", "jit", shape, dtype)
        jit_params = {"params": {k: {"layer": v} for k, v in params["params"].items()}}
        jit_loss = lambda p, x: jnp.mean(jnp.square(jit_model.apply(p, x).astype(jnp.float32)))
        variants = {"loop": (loss, params), "nn.jit layers": (jit_loss, jit_params)}
    else:
        variants = {"shared": (loss, params), "per call site": (loss, params)}
    args_of = {}
    for label, (fn, p) in variants.items():
        ctx = _lower_once.disabled() if label == "per call site" else _nullcontext()
        with ctx:
            f = jax.jit(jax.value_and_grad(fn))
            c = f.lower(p, x).compile()
        compiled_hlo[label] = c.as_text()
        steps[label] = c
        args_of[label] = p
    outs = {k: f(args_of[k], x) for k, f in steps.items()}
    (k0, k1) = list(steps)
    print(f"loss {k0} {float(outs[k0][0]):.6f} vs {k1} {float(outs[k1][0]):.6f}", flush=True)
    n_kernels = {k: len(re.findall(r"custom_call_target=\"(?:mosaic_gpu|__gpu\$xla\.gpu\.triton)", v))
                 for k, v in compiled_hlo.items()}
    print(f"kernel custom calls in the compiled HLO: {n_kernels}", flush=True)
    ts = {k: [] for k in steps}
    for _ in range(opts.rounds):
        for k, f in steps.items():
            jax.block_until_ready(f(args_of[k], x))
            samples = []
            for _ in range(opts.samples):
                t = time.perf_counter()
                jax.block_until_ready(f(args_of[k], x))
                samples.append(time.perf_counter() - t)
            ts[k].append(statistics.median(samples))
    print(f"\n## Step time, {n}-layer stack (auto backends), {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{datetime.date.today()}; {opts.rounds} interleaved rounds x median of {opts.samples} steps\n")
    print("| variant | ms median of rounds | min | max |")
    print("|---|---|---|---|")
    for k, v in ts.items():
        print(f"| {k} | {1e3 * statistics.median(v):.2f} | {1e3 * min(v):.2f} | {1e3 * max(v):.2f} |")
    ratio = statistics.median(ts[k1]) / statistics.median(ts[k0])
    print(f"\n{k0} speed / {k1} speed = {ratio:.3f}")
    _dump(opts, "compile_time_steady.json", {"ms": {k: [1e3 * t for t in v] for k, v in ts.items()},
                                             "kernel_custom_calls": n_kernels})


def _dump(opts, name, obj):
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=1)


def main():
    if "--one" in sys.argv:
        i = sys.argv.index("--one")
        n, config, scanned, unshared = sys.argv[i + 1:i + 5]
        smoke = "--cpu-smoke" in sys.argv
        r = measure_one(int(n), config, "jit" if scanned == "jit" else scanned == "1", unshared == "1", smoke)
        print("RESULT " + json.dumps(r), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["stacks", "example", "steady"], required=True)
    ap.add_argument("--layers", default="1,12,32", help="stack depths, comma-separated")
    ap.add_argument("--scanned", choices=["no", "yes", "both", "jit", "no,jit", "all"], default="both",
                    help="no: a Python loop of layers; yes: nn.scan; jit: a Python loop of nn.jit-wrapped layers")
    ap.add_argument("--unshared-layers", default="12", help="depths to measure with per-call-site kernels too")
    ap.add_argument("--example-steps", type=int, default=60)
    ap.add_argument("--steady-layers", type=int, default=12)
    ap.add_argument("--steady-compare", choices=["kernels", "jit"], default="kernels",
                    help="--part steady: shared against per-call-site kernels, or a loop of layers against nn.jit layers")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=400, help="seconds for one subprocess")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"backend sets, comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--xla-timers", action="store_true",
                    help="log XLA's per-phase compile timers (TF_CPP_VMODULE) and sum them per phase")
    opts = ap.parse_args()
    opts.layers = [int(v) for v in opts.layers.split(",") if v]
    opts.unshared_layers = [int(v) for v in opts.unshared_layers.split(",") if v]
    {"stacks": part_stacks, "example": part_example, "steady": part_steady}[opts.part](opts)


if __name__ == "__main__":
    main()
