#!/usr/bin/env python3
"""Context-parallel attention (ring and all-gather) on several GPUs vs single-GPU attention.

For the 2-GPU machine:  PYTHONPATH=. python3 -m benchmarks.context_parallel_gpu
CPU smoke test (8 fake devices, tiny sizes): PYTHONPATH=. python3 -m benchmarks.context_parallel_gpu --cpu-smoke

What it does, in one process:
 1. correctness first, at a small size: ring and all-gather (load balanced, causal, bf16) outputs
    and dq/dk/dv against single-device te_jax attention (xla backend, fp32 inputs);
 2. timings (median of --reps after a warm-up, jax.block_until_ready) of forward and
    forward+backward at global sequence 32k and 128k, bf16, 16 heads, head_dim 128, causal, batch 1,
    inputs in the zig-zag load-balanced order, inner per-block backend pallas (fallback xla);
 3. single-GPU te_jax attention (backend cudnn, and backend pallas: whichever Pallas kernel te_jax
    picks there) at the same global sequence where it fits; scaling efficiency = single-GPU time / (n_devices × CP time).
A table is printed last; full logs and JSON go to $OUT when set.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

DATE = str(datetime.date.today())


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="8 fake CPU devices, tiny sizes (checks the script)")
    p.add_argument("--seqs", type=str, default=None, help="comma-separated global sequence lengths")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--cp", type=int, default=None, help="devices on the cp axis (default: all)")
    p.add_argument("--backend", default=None, help="inner backend: pallas (default on GPU) or xla")
    p.add_argument("--strategies", default="ring,all_gather")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--check-seq", type=int, default=None, help="global sequence of the correctness check")
    p.add_argument("--no-single", action="store_true", help="skip the single-GPU baselines")
    return p.parse_args()


ARGS = _parse()
_flags = os.environ.get("XLA_FLAGS", "")
if ARGS.cpu_smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "xla_force_host_platform_device_count" not in _flags:
        _flags += " --xla_force_host_platform_device_count=8"
elif "xla_gpu_enable_latency_hiding_scheduler" not in _flags:
    _flags += " --xla_gpu_enable_latency_hiding_scheduler=true"  # overlaps ppermute with compute
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import te_jax  # noqa: E402
from te_jax import _compat  # noqa: E402
from te_jax import context_parallel as tcp  # noqa: E402
from benchmarks import timing  # noqa: E402

OUT = os.environ.get("OUT")
_LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    _LOG.append(s)


def _config():
    smoke = ARGS.cpu_smoke
    seqs = [int(s) for s in ARGS.seqs.split(",")] if ARGS.seqs else ([128, 256] if smoke else [32768, 131072])
    heads = ARGS.heads or (2 if smoke else 16)
    hd = ARGS.head_dim or (16 if smoke else 128)
    ndev = ARGS.cp or len(jax.devices())
    reps = ARGS.reps or (2 if smoke else 5)
    check_seq = ARGS.check_seq or (128 if smoke else 4096)
    return seqs, heads, hd, ndev, reps, check_seq


def _inner_backend(mesh, heads, hd, seq):
    """The inner backend, explained at the benchmark's first timed sequence length (the per-block
    kernel depends on the local block length)."""
    want = ARGS.backend or ("xla" if ARGS.cpu_smoke else "pallas")
    x = jnp.zeros((1, seq, heads, hd), jnp.bfloat16)
    try:
        choice = tcp.explain_context_parallel_backend(x, x, x, cp_axis="cp", mesh=mesh, backend=want,
                                                      attn_mask_type="causal")
        if choice.selected:
            return choice.selected, str(choice)
    except Exception as e:  # noqa: BLE001
        log(f"inner backend {want!r} refused: {e}; falling back to xla")
    return "xla", "fallback"


def _rand(key, shape, dtype, sharding):
    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype), out_shardings=sharding)(key)


def _median_time(fn, args, reps):
    """Median seconds per call after a warm-up, each call blocked on (benchmarks/timing.py)."""
    return timing.measure(fn, args, samples=reps, warmup=0, inner=1)[0]


def _fwd_bwd(f):
    def run(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do)
    return jax.jit(run)


def _flops(b, h, s, d, causal=True):
    fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return fwd, 3.5 * fwd


def _rel(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def correctness(mesh, ndev, heads, hd, inner, s):
    """CP (load balanced, causal, bf16) vs single-device fp32 te_jax attention: out and grads."""
    log(f"\n== correctness: global seq {s}, {heads} heads, head_dim {hd}, cp={ndev}, inner={inner} ==")
    ks = jax.random.split(jax.random.key(1), 4)
    shape = (1, s, heads, hd)
    q, k, v, do = (jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16) for kk in ks)
    f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
    ref_f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="xla")  # noqa
    with jax.default_device(jax.devices()[0]):
        ref_out, ref_g = _fwd_bwd(ref_f)(f32(q), f32(k), f32(v), f32(do))
    ok = True
    for strategy in ARGS.strategies.split(","):
        def f(q, k, v, strategy=strategy):
            q, k, v = (tcp.reorder_causal_load_balancing(t, ndev, 1) for t in (q, k, v))
            o = tcp.context_parallel_attention(q, k, v, cp_axis="cp", strategy=strategy, load_balanced=True,
                                               attn_mask_type="causal", backend=inner)
            return tcp.inverse_reorder_causal_load_balancing(o, ndev, 1)
        with _compat.use_mesh(mesh):
            sh = NamedSharding(mesh, P(None, "cp"))
            args = [jax.device_put(t, sh) for t in (q, k, v, do)]
            out, g = _fwd_bwd(f)(*args)
        errs = {"out": _rel(out, ref_out)}
        errs.update({f"d{n}": _rel(a, b) for n, a, b in zip("qkv", g, ref_g)})
        finite = all(np.isfinite(np.asarray(t, np.float32)).all() for t in (out, *g))
        good = finite and max(errs.values()) < 2e-2
        ok &= good
        log(f"  {strategy:10s} relative L2 error vs fp32 single device: "
            + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()) + f"  -> {'OK' if good else 'FAIL'}")
    return ok


def bench_cp(mesh, ndev, strategy, inner, s, heads, hd, reps):
    sh = NamedSharding(mesh, P(None, "cp"))
    shape = (1, s, heads, hd)
    ks = jax.random.split(jax.random.key(s), 4)
    # Random data: already "in zig-zag order" as far as timing is concerned (load_balanced=True).
    args = [_rand(kk, shape, jnp.bfloat16, sh) for kk in ks]

    def f(q, k, v):
        return tcp.context_parallel_attention(q, k, v, cp_axis="cp", strategy=strategy, load_balanced=True,
                                              attn_mask_type="causal", backend=inner)
    with _compat.use_mesh(mesh):
        fwd = jax.jit(f)
        t_fwd = _median_time(fwd, args[:3], reps)
        t_fb = _median_time(_fwd_bwd(f), args, reps)
    return t_fwd, t_fb


def bench_single(backend, s, heads, hd, reps):
    dev = jax.devices()[0]
    shape = (1, s, heads, hd)
    ks = jax.random.split(jax.random.key(s + 1), 4)
    args = [_rand(kk, shape, jnp.bfloat16, jax.sharding.SingleDeviceSharding(dev)) for kk in ks]

    def f(q, k, v):
        return te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend=backend)
    t_fwd = _median_time(jax.jit(f), args[:3], reps)
    t_fb = _median_time(_fwd_bwd(f), args, reps)
    return t_fwd, t_fb


def _try(fn, *a):
    try:
        return fn(*a), None
    except Exception as e:  # noqa: BLE001  (OOM, refusal: reported in the table)
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        log(f"  failed: {msg}")
        _LOG.append(traceback.format_exc())
        return None, msg


def main():
    seqs, heads, hd, ndev, reps, check_seq = _config()
    devs = jax.devices()[:ndev]
    mesh = _compat.make_mesh((ndev,), ("cp",), devices=devs)
    gpu = devs[0].device_kind
    log(f"date {DATE} (run {datetime.datetime.now().isoformat(timespec='seconds')}), jax {jax.__version__}, "
        f"{ndev} x {gpu}, XLA_FLAGS={os.environ.get('XLA_FLAGS')}")
    inner, why = _inner_backend(mesh, heads, hd, seqs[0])
    log(f"inner backend: {inner}\n{why}")

    ok = correctness(mesh, ndev, heads, hd, inner, check_seq)
    if not ok:
        log("correctness check FAILED; timings below are of a wrong computation")

    rows = []
    single_backends = [] if ARGS.no_single else (["cudnn", "pallas"] if jax.default_backend() == "gpu"
                                                  else ["xla"])
    for s in seqs:
        fl_fwd, fl_fb = _flops(1, heads, s, hd)
        singles = {}
        for b in single_backends:
            log(f"\n== single device, {b}, seq {s} ==")
            t, err = _try(bench_single, b, s, heads, hd, reps)
            singles[b] = t
            rows.append(dict(kind="single", strategy=f"single-{b}", devices=1, seq=s,
                             fwd_ms=None if t is None else t[0] * 1e3, fb_ms=None if t is None else t[1] * 1e3,
                             err=err))
            if t:
                log(f"  fwd {t[0]*1e3:.2f} ms ({fl_fwd/t[0]/1e12:.0f} TFLOP/s), fwd+bwd {t[1]*1e3:.2f} ms "
                    f"({fl_fb/t[1]/1e12:.0f} TFLOP/s)")
        for strategy in ARGS.strategies.split(","):
            log(f"\n== {strategy}, cp={ndev}, seq {s}, inner {inner} ==")
            t, err = _try(bench_cp, mesh, ndev, strategy, inner, s, heads, hd, reps)
            row = dict(kind="cp", strategy=strategy, devices=ndev, seq=s, inner=inner,
                       fwd_ms=None if t is None else t[0] * 1e3, fb_ms=None if t is None else t[1] * 1e3, err=err)
            if t:
                log(f"  fwd {t[0]*1e3:.2f} ms, fwd+bwd {t[1]*1e3:.2f} ms "
                    f"({fl_fb/t[1]/ndev/1e12:.0f} TFLOP/s per device)")
                for b, ts in singles.items():
                    if ts:
                        row[f"eff_fb_vs_{b}"] = ts[1] / (ndev * t[1])
                        row[f"eff_fwd_vs_{b}"] = ts[0] / (ndev * t[0])
            rows.append(row)

    if OUT:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "context_parallel_gpu.json"), "w") as fh:
            json.dump(dict(date=DATE, jax=jax.__version__, devices=f"{ndev} x {gpu}", heads=heads, head_dim=hd,
                           inner=inner, correct=ok, rows=rows), fh, indent=1)
        with open(os.path.join(OUT, "context_parallel_gpu.log"), "w") as fh:
            fh.write("\n".join(_LOG) + "\n")

    # ---- table (printed last) ----
    print()
    print(f"Context-parallel attention, {DATE}, {ndev} x {gpu}, jax {jax.__version__}; bf16, batch 1, "
          f"{heads} heads, head_dim {hd}, causal, zig-zag load balanced; inner backend {inner}; "
          f"correctness {'OK' if ok else 'FAILED'}.")
    print("TFLOP/s per device: fwd 2·B·H·S²·D (causal), fwd+bwd 3.5× that, divided by devices. "
          "Efficiency = single-device time / (devices × CP time).")
    effs = [b for b in single_backends]
    head = "| " + " | ".join(["run", "devices", "seq", "fwd ms", "fwd+bwd ms", "fwd+bwd TFLOP/s/dev"]
                             + [f"eff fwd+bwd vs {b}" for b in effs]) + " |"
    print(head)
    print("|" + "---|" * (6 + len(effs)))
    for r in rows:
        _, fl_fb = _flops(1, heads, r["seq"], hd)
        if r["fb_ms"] is None:
            cells = ["n/a", "n/a", f"failed: {r['err'][:60]}"]
        else:
            cells = [f"{r['fwd_ms']:.2f}", f"{r['fb_ms']:.2f}", f"{fl_fb / (r['fb_ms'] / 1e3) / r['devices'] / 1e12:.1f}"]
        eff_cells = []
        for b in effs:
            e = r.get(f"eff_fb_vs_{b}")
            eff_cells.append("" if r["kind"] == "single" else ("n/a" if e is None else f"{100 * e:.0f}%"))
        print(f"| {r['strategy']} | {r['devices']} | {r['seq']} | " + " | ".join(cells + eff_cells) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
