"""Hopper flash attention on the GPU: correctness vs an fp32 reference, then timings vs peers.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.attention_hopper_gpu [--quick] [--no-variants]

One process: (1) rel-L2 error of hopper_attention (out, lse, dq, dk, dv) vs a plain-jnp fp32
reference for every case it serves (hd 64/128/256, causal, GQA, bf16/fp16) at real sizes;
(2) forward and forward+backward TFLOP/s for the target rows (bf16, 16 heads, hd 128,
batch*seq = 16384) side by side with cuDNN, tokamax (when importable), XLA and the portable
Pallas kernel, each peer's output checked against an fp32 reference on the last query rows and
its gradients against cuDNN's; (3) tuning variants.  Prints a table (also written to
$OUT/attention_hopper_table.md) and a PNG plot.

Other head sizes: `--head-dim 64` (or 256) times the table with 2048 // head_dim heads (README peer
numbers are not used then); `--seqs 1024,4096` picks the rows; `--cases-head-dim 64` restricts the
correctness sweep; `--variant-set hd64` A/Bs hd64 tile sizes next to cuDNN; `--config-json '{...}'`
merges HopperConfig fields into every correctness case.

tokamax (peer, optional, never a dependency of te_jax): `tokamax.dot_product_attention(...,
implementation="mosaic")` needs jax >= 0.11.1 and Python >= 3.12, so it only runs on the GPU
machine, where it travels as wheels in the ignored folder `.whl/`:

    bash benchmarks/fetch_peer_wheels.sh      # here, once: pip download into .whl/ (about 6 MB)
    # device command (carry [".whl"]):
    bash benchmarks/install_peers.sh; export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1;
    timeout 580 python3 -m benchmarks.attention_hopper_gpu --quick --no-variants --skip-correctness --budget 420

tokamax imports `xprof.cli.tools` at import time (for its own profiler-based timing, unused
here); xprof is a 32 MB wheel with many dependencies, so unless a real xprof is importable this
script puts a stand-in (`get_kernel_stats_tool = None`) into sys.modules first.  When tokamax
cannot be imported (or a row fails in it) the reason is printed and the "best peer" ratio falls
back to the README numbers in TARGETS for that row, marked `*` in the table.

CPU smoke run (no GPU: the Hopper kernel, cuDNN and the portable kernel report errors; XLA and,
with `--tokamax-impl xla`, tokamax run at tiny sizes; checks the plumbing and the table):

    PYTHONPATH=. python3 -m benchmarks.attention_hopper_gpu --cpu-smoke [--tokamax-impl xla]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cases, timing
from pallas_kernels.flash_attention_hopper import (
    HopperConfig, attention_reference, default_config, hopper_attention, supports)
from pallas_kernels.flash_attention_hopper.config import atomic_dq_chosen

OUT = os.environ.get("OUT", "/tmp/attention_hopper_out")
os.makedirs(OUT, exist_ok=True)
T0 = time.time()
LOG = open(os.path.join(OUT, "attention_hopper_log.txt"), "w")

# Targets from shared/README.md (H100, bf16, 16 heads, hd 128, B*S = 16384): fwd, fwd+bwd.
# Used for the 'best peer' ratio only where tokamax could not be measured in this process.
TARGETS = {
    (1024, False): dict(cudnn=(529, 385), tokamax=(532, 434)),
    (1024, True): dict(cudnn=(354, 251), tokamax=(400, 313)),
    (4096, False): dict(cudnn=(629, 525), tokamax=(591, 496)),
    (4096, True): dict(cudnn=(529, 442), tokamax=(573, 431)),
    (16384, False): dict(cudnn=(626, 579), tokamax=(623, 545)),
    (16384, True): dict(cudnn=(551, 545), tokamax=(625, 498)),
}


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def elapsed():
    return time.time() - T0


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(key, B, S, H, G, D, dtype):
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (B, S, H, D), dtype)
    k = jax.random.normal(ks[1], (B, S, G, D), dtype)
    v = jax.random.normal(ks[2], (B, S, G, D), dtype)
    do = jax.random.normal(ks[3], (B, S, H, D), dtype)
    return q, k, v, do


def bench(fn, args, iters=20, warmup=2):
    """Median seconds per call over `iters` samples (benchmarks/timing.py: each sample dispatches
    calls back to back and blocks once, so host dispatch latency does not count)."""
    return timing.measure(fn, args, samples=iters, warmup=warmup)[0]


def gpu_warmup(seconds=2.0):
    """Bring the clocks up (the card idles at 345 MHz) before the first timing."""
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    jax.block_until_ready(mm(a))
    t = time.time()
    while time.time() - t < seconds:
        jax.block_until_ready(mm(a))


def make_ours(scale, causal, config=None):
    fwd = jax.jit(lambda q, k, v: hopper_attention(q, k, v, scale=scale, causal=causal,
                                                   config=config)[0])

    def _fb(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: hopper_attention(q, k, v, scale=scale, causal=causal,
                                                            config=config)[0], q, k, v)
        return vjp(do)

    return fwd, jax.jit(_fb)


def make_jax_nn(impl, scale, causal):
    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                            implementation=impl)

    def fb(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return vjp(do)

    return jax.jit(f), jax.jit(fb)


def make_portable(scale, causal):
    from pallas_kernels.flash_attention import AttentionMask, flash_attention

    def f(q, k, v):
        mask = AttentionMask.full(q.shape[0], q.shape[1], k.shape[1], causal=causal)
        return flash_attention(q, k, v, mask, scale=scale)[0]

    def fb(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return vjp(do)

    return jax.jit(f), jax.jit(fb)


# ------------------------------------------------------------------------------------------
# tokamax (optional peer)
def _xprof_standin():
    """Put a stand-in for `xprof.cli.tools` into sys.modules unless a real xprof is importable.

    tokamax._src.benchmarking does `from xprof.cli.tools import get_kernel_stats_tool` at import
    time; only tokamax's own profiler-based timing uses it, which this script does not.
    Returns True when the stand-in was installed."""
    try:
        if importlib.util.find_spec("xprof.cli.tools") is not None:
            return False
    except (ImportError, ValueError):  # no `xprof` parent package (or a broken one)
        pass
    parent = None
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
        mod = sys.modules.get(name)
        if mod is None:
            mod = types.ModuleType(name, "stand-in for tokamax's optional profiler import")
            if name != "xprof.cli.tools":
                mod.__path__ = []  # a package, so the submodule import resolves
            sys.modules[name] = mod
        if parent is not None:
            setattr(parent, name.rsplit(".", 1)[1], mod)
        parent = mod
    if not hasattr(sys.modules["xprof.cli.tools"], "get_kernel_stats_tool"):
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
    return True


def import_tokamax(impl):
    """(tokamax module or None, one line saying what was found or why it is not usable)."""
    try:
        standin = _xprof_standin()
        import tokamax
    except Exception as e:  # noqa: BLE001  (ImportError, SyntaxError on Python < 3.12, ...)
        return None, f"tokamax not importable: {type(e).__name__}: {str(e)[:300]}"
    ver = getattr(tokamax, "__version__", "?")
    where = os.path.dirname(os.path.dirname(os.path.abspath(tokamax.__file__)))
    if impl == "mosaic":
        # tokamax maps "mosaic" to its "mosaic_gpu" entry on NVIDIA devices, and silently drops
        # that entry when its module fails to import ("Unknown implementation" later): say why.
        try:
            from tokamax._src.ops.attention import api as tk_api
            if "mosaic_gpu" not in tk_api.IMPLEMENTATIONS:
                try:
                    importlib.import_module("tokamax._src.ops.attention.pallas_mosaic_gpu")
                    why = "not registered"
                except Exception as e:  # noqa: BLE001
                    why = f"{type(e).__name__}: {str(e)[:300]}"
                return None, f"tokamax {ver} imported but its Mosaic GPU attention is missing ({why})"
        except Exception:  # noqa: BLE001  (private layout changed: the calls will report)
            pass
    return tokamax, (f"tokamax {ver} (jax {jax.__version__}) from {where}, implementation={impl!r}"
                     + (", xprof stand-in" if standin else ""))


def import_fa3():
    """(flash_attn3_jax module or None, one line saying what was found or why not). An optional peer: carry the
    wheel from benchmarks/fetch_peer_wheels.sh and install it with benchmarks/install_peers.sh."""
    try:
        import flash_attn3_jax
    except Exception as e:  # noqa: BLE001
        return None, f"FlashAttention-3 (flash-attn3-jax) not importable: {type(e).__name__}: {str(e)[:200]}"
    return flash_attn3_jax, f"FlashAttention-3: flash-attn3-jax {getattr(flash_attn3_jax, '__version__', '?')}"


def make_fa3(fa3, scale, causal):
    """flash_attn3_jax.flash_mha takes [B, S, H, D] and a Python-float softmax_scale."""
    def f(q, k, v):
        return fa3.flash_mha(q, k, v, softmax_scale=float(scale), is_causal=causal)

    def fb(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return vjp(do)

    return jax.jit(f), jax.jit(fb)


def make_tokamax(tk, impl, scale, causal):
    """tokamax.dot_product_attention takes [B, S, H, D] like jax.nn.dot_product_attention."""
    def f(q, k, v):
        return tk.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                        implementation=impl)

    def fb(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return vjp(do)

    return jax.jit(f), jax.jit(fb)


def reference_tail(q, k, v, scale, causal, n):
    """fp32 attention output for the last `n` query rows only (the full fp32 reference at 16k
    tokens would hold 16 GiB of logits); causal rows there attend to (nearly) every key."""
    S = q.shape[1]
    f32 = lambda x: x.astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", f32(q[:, S - n:]), f32(k),
                   precision=jax.lax.Precision.HIGHEST) * scale
    if causal:
        qpos = jnp.arange(S - n, S)[:, None]
        s = jnp.where(jnp.arange(S)[None, :] <= qpos, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, f32(v), precision=jax.lax.Precision.HIGHEST)


# ------------------------------------------------------------------------------------------
def worst_tile_rel(out, ref, rows=128):
    """The largest rel. L2 error of one (batch, 128-row query tile, head) block of out [B,S,H,D]: a wrong tile
    (e.g. a badly merged stream-K piece) that the whole array's rel. L2 would dilute."""
    B, S, H, D = out.shape
    d = (out.astype(jnp.float32) - ref).reshape(B, S // rows, rows, H, D)
    r = ref.reshape(B, S // rows, rows, H, D)
    return float(jnp.max(jnp.sqrt(jnp.sum(d * d, axis=(2, 4)) / jnp.sum(r * r, axis=(2, 4)))))


def correctness(quick, budget=190.0):
    log("\n== correctness vs fp32 plain-jnp reference (rel L2) ==")
    AT = "atomic"
    cases = [  # (B, S, H, G, D, causal, dtype[, "atomic"])
        (4, 4096, 16, 16, 128, False, jnp.bfloat16, AT),
        (4, 4096, 16, 16, 128, True, jnp.bfloat16, AT),
        (2, 2048, 16, 4, 128, True, jnp.bfloat16, AT),
        (2, 2048, 16, 2, 64, True, jnp.bfloat16, AT),
        (2, 2048, 16, 16, 64, False, jnp.bfloat16, AT),
        (4, 4096, 16, 16, 128, False, jnp.bfloat16),
        (4, 4096, 16, 16, 128, True, jnp.bfloat16),
        (16, 1024, 16, 16, 128, True, jnp.bfloat16),
        (2, 2048, 16, 4, 128, True, jnp.bfloat16),
        (2, 2048, 16, 16, 64, False, jnp.bfloat16),
        (2, 2048, 16, 2, 64, True, jnp.bfloat16),
        (2, 2048, 8, 8, 256, False, jnp.bfloat16),
        (2, 2048, 8, 2, 256, True, jnp.bfloat16),
        (2, 2048, 16, 16, 128, True, jnp.float16),
        (1, 384, 4, 2, 128, True, jnp.bfloat16),
        (1, 384, 4, 2, 64, True, jnp.bfloat16),  # hd64 with a key length that is no multiple of 256
    ]
    if quick:  # the default (dQ-kernel) path on every served kind of case, plus atomic-dQ cases
        cases = cases[:5] + cases[5:7] + cases[8:9] + cases[10:]
    if CASES_HEAD_DIM:
        cases = [c for c in cases if c[4] == CASES_HEAD_DIM]
    cases = cases[CASES_FROM:]
    rows = []
    for i, (B, S, H, G, D, causal, dt, *extra) in enumerate(cases):
        cfg = dataclasses.replace(default_config(D, S, causal), bwd_dq_atomic=bool(extra), **CONFIG_OVERRIDE)
        name = (f"B{B} S{S} H{H} G{G} D{D} {'causal' if causal else 'full'} {jnp.dtype(dt).name}"
                f" dQ:{'atomic' if atomic_dq_chosen(D, S, cfg, interpret=False) else 'kernel'}")
        r = supports((B, S, H, D), (B, S, G, D), (B, S, G, D), dt, causal)
        if r is not None:
            log(f"  {name}: not served ({r})")
            continue
        try:
            q, k, v, do = inputs(jax.random.key(100 + i), B, S, H, G, D, dt)
            scale = D ** -0.5
            f = lambda q, k, v: hopper_attention(q, k, v, scale=scale, causal=causal, config=cfg)
            (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
            dq, dk, dv = vjp((do, jnp.zeros_like(lse)))
            ref = jax.jit(lambda q, k, v: attention_reference(q, k, v, scale=scale, causal=causal))
            f32 = lambda x: x.astype(jnp.float32)
            (rout, rlse), rvjp = jax.vjp(ref, f32(q), f32(k), f32(v))
            rdq, rdk, rdv = rvjp((f32(do), jnp.zeros_like(rlse)))
            errs = dict(out=rel(out, rout), out_tile=worst_tile_rel(out, rout), lse=rel(lse, rlse), dq=rel(dq, rdq),
                        dk=rel(dk, rdk), dv=rel(dv, rdv))
            # an lse cotangent too (the ring-attention merge path)
            dl = jax.random.normal(jax.random.key(7), lse.shape, jnp.float32)
            g1 = vjp((do, dl))
            g2 = rvjp((f32(do), dl))
            errs["dq_dlse"] = rel(g1[0], g2[0])
            tol = 2e-2
            ok = all(np.isfinite(e) and e < tol for e in errs.values())
            log(f"  {name}: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items())
                + ("  OK" if ok else "  FAIL"))
            rows.append(dict(case=name, ok=ok, **errs))
            del q, k, v, do, out, lse, dq, dk, dv, rout, rlse, rdq, rdk, rdv, g1, g2
        except Exception as e:  # noqa: BLE001
            log(f"  {name}: ERROR {type(e).__name__}: {str(e)[:2000]}")
            traceback.print_exc(file=LOG)
            rows.append(dict(case=name, ok=False, error=str(e)[:300]))
        if elapsed() > budget:
            log("  (stopping correctness early: time budget)")
            break
    return rows


OUT_TOL, GRAD_TOL = 2e-2, 5e-2
ALL_PEERS = ("cudnn", "tokamax", "portable", "xla")


def timing_rows(quick, budget, with_atomic=False, tk=None, tk_impl="mosaic", peers=ALL_PEERS,
                tokens=cases.ATTENTION_TOKENS, H=16, D=128, seqs=cases.ATTENTION_SEQS, iters=20, warmup=2):
    log(f"\n== timings: bf16, H={H}, D={D}, B*S={tokens} (TFLOP/s; fwd+bwd counts 3.5x fwd) ==")
    log(f"   checks: out rel-L2 vs fp32 reference on the last query rows (tol {OUT_TOL:g}); "
        f"dq/dk/dv max rel-L2 vs cuDNN's (tol {GRAD_TOL:g})")
    results = []
    for S in seqs:
        for causal in (False, True):
            if elapsed() > budget:
                log(f"  S={S} causal={causal}: skipped (time budget)")
                continue
            B = tokens // S
            scale = D ** -0.5
            q, k, v, do = inputs(jax.random.key(S + causal), B, S, H, H, D, jnp.bfloat16)
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            row = dict(S=S, causal=causal)
            n_ref = min(S, 1024)
            try:
                ref_out = jax.jit(reference_tail, static_argnums=(3, 4, 5))(q, k, v, scale, causal,
                                                                           n_ref)
            except Exception as e:  # noqa: BLE001
                log(f"  S={S} causal={causal} fp32 reference: ERROR {type(e).__name__}: {str(e)[:400]}")
                ref_out = None
            at_cfg = dataclasses.replace(default_config(D), bwd_dq_atomic=True)
            kern_cfg = dataclasses.replace(default_config(D), bwd_dq_atomic=False)
            impls = [("ours", lambda: make_ours(scale, causal))]  # the default: what users get
            if with_atomic:  # both backward algorithms, forced (same forward as "ours")
                impls.append(("ourskern", lambda: make_ours(scale, causal, kern_cfg)))
                impls.append(("oursat", lambda: make_ours(scale, causal, at_cfg)))
            if "cudnn" in peers:
                impls.append(("cudnn", lambda: make_jax_nn("cudnn", scale, causal)))
            if "tokamax" in peers and tk is not None:
                impls.append(("tokamax", lambda: make_tokamax(tk, tk_impl, scale, causal)))
            if "portable" in peers:
                impls.append(("portable", lambda: make_portable(scale, causal)))
            if "xla" in peers and (S <= 4096 or not quick):
                impls.append(("xla", lambda: make_jax_nn("xla", scale, causal)))
            grads = {}
            for name, mk in impls:
                try:
                    fwd, fb = mk()
                    o = fwd(q, k, v)
                    if name not in ("oursat", "ourskern"):  # same forward as "ours"
                        if ref_out is not None:
                            e = rel(o[:, S - n_ref:], ref_out)
                            row[f"{name}_err"] = e
                            if not (np.isfinite(e) and e < OUT_TOL):
                                log(f"  S={S} causal={causal} {name}: out rel err {e:.1e} FAIL "
                                    f"(tol {OUT_TOL:g})")
                        del o
                        tf = bench(fwd, (q, k, v), iters=iters, warmup=warmup)
                        row[f"{name}_fwd"] = flops / tf / 1e12
                    if elapsed() < budget + 60:
                        grads[name] = fb(q, k, v, do)
                        tb = bench(fb, (q, k, v, do), iters=iters, warmup=warmup)
                        row[f"{name}_fb"] = 3.5 * flops / tb / 1e12
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    log(f"  S={S} causal={causal} {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
                    traceback.print_exc(file=LOG)
            if "cudnn" in grads:
                for name, g in grads.items():
                    if name == "cudnn":
                        continue
                    e = max(rel(a, b) for a, b in zip(g, grads["cudnn"]))
                    row[f"{name}_gerr"] = e
                    if not (np.isfinite(e) and e < GRAD_TOL):
                        log(f"  S={S} causal={causal} {name}: grad rel err vs cuDNN {e:.1e} FAIL "
                            f"(tol {GRAD_TOL:g})")
            log("  " + json.dumps({k: (round(v, 1) if isinstance(v, float) and "err" not in k
                                       else (float(f"{v:.2e}") if isinstance(v, float) else v))
                                   for k, v in row.items() if not k.endswith("_error")}))
            results.append(row)
            del q, k, v, do, ref_out, grads
    return results


def variants(budget, which="all"):
    """Tuning sweep at 4k, hd 128 (and a hd 64 / 256 check); errors vs the default's output.

    which="atomic": only the two backward dQ algorithms (atomic, dQ kernel).
    which="fwd": forward only, 1k/4k/16k (16k tokens), causal and not: the default, the
    ping-pong on an mbarrier instead of a named barrier, and (non-causal) one CTA per tile
    instead of the persistent grid."""
    log("\n== variants (H=16) ==")
    res = []
    if which == "fwd":
        for S in cases.ATTENTION_SEQS:
            for causal in (False, True):
                B, H, D = cases.ATTENTION_TOKENS // S, 16, 128
                q, k, v, _ = inputs(jax.random.key(5), B, S, H, H, D, jnp.bfloat16)
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                cud, _ = make_jax_nn("cudnn", D ** -0.5, causal)
                ref = cud(q, k, v)
                cfgs = [dict(), dict(fwd_named_barrier=False)]
                if not causal:
                    cfgs.append(dict(fwd_persistent=False))
                for kw in cfgs:
                    cfg = dataclasses.replace(default_config(D), **kw)
                    tag = (f"S{S} B{B} D{D} {'causal' if causal else 'full'} fwd "
                           f"{kw or 'default'}")
                    try:
                        fwd, _ = make_ours(D ** -0.5, causal, cfg)
                        err = rel(fwd(q, k, v), ref)
                        tf = bench(fwd, (q, k, v))
                        r = dict(tag=tag, fwd=flops / tf / 1e12, err_vs_cudnn=err)
                        log(f"  {tag}: fwd {r['fwd']:.0f}  (rel vs cudnn {err:.1e})")
                        res.append(r)
                    except Exception as e:  # noqa: BLE001
                        log(f"  {tag}: ERROR {type(e).__name__}: {str(e)[:600]}")
                        traceback.print_exc(file=LOG)
                tf = bench(cud, (q, k, v))
                log(f"  S{S} {'causal' if causal else 'full'} cuDNN fwd {flops / tf / 1e12:.0f}")
                del q, k, v, ref
        return res
    if which == "hd64":
        return hd64_variants(budget)
    if which == "hd64bwd":
        return hd64_variants(budget, configs=HD64_BWD_VARIANTS, time_fwd=False)
    if which == "hd256":
        return hd64_variants(budget, configs=HD256_VARIANTS, D=256, H=8)
    log("   (B=4, S=4096)")
    if which == "atomic":
        sweeps = [
            (128, HopperConfig(block_q=64, block_kv=128, stages=2, bwd_dq_atomic=True)),
            (128, HopperConfig(block_q=64, block_kv=128, stages=2, bwd_dq_atomic=False)),
        ]
    else:
        sweeps = [
            (128, HopperConfig(block_q=64, block_kv=128, stages=2)),
            (128, HopperConfig(block_q=64, block_kv=128, stages=2, bwd_dq_atomic=True)),
            (64, HopperConfig(block_q=64, block_kv=256, stages=2)),
            (64, HopperConfig(block_q=64, block_kv=256, stages=2, bwd_dq_atomic=True)),
            (256, HopperConfig(block_q=64, block_kv=64, stages=2, bwd_wgs=1)),
        ]
    for D, cfg in sweeps:
        for causal in (False, True):
            if elapsed() > budget:
                log("  (variants stopped: time budget)")
                return res
            B, S, H = 4, 4096, 16
            q, k, v, do = inputs(jax.random.key(3), B, S, H, H, D, jnp.bfloat16)
            scale = D ** -0.5
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            tag = (f"D{D} {'causal' if causal else 'full'} bq{cfg.block_q} bkv{cfg.block_kv} "
                   f"st{cfg.stages} | bwd wgs{cfg.bwd_wgs} st{cfg.bwd_stages} atomic-dQ {cfg.bwd_dq_atomic}")
            try:
                fwd, fb = make_ours(scale, causal, cfg)
                cud, _ = make_jax_nn("cudnn", scale, causal)
                err = rel(fwd(q, k, v), cud(q, k, v))
                tf = bench(fwd, (q, k, v))
                tb = bench(fb, (q, k, v, do))
                r = dict(tag=tag, fwd=flops / tf / 1e12, fb=3.5 * flops / tb / 1e12,
                         err_vs_cudnn=err)
                log(f"  {tag}: fwd {r['fwd']:.0f}  fwd+bwd {r['fb']:.0f}  (rel vs cudnn {err:.1e})")
                res.append(r)
            except Exception as e:  # noqa: BLE001
                log(f"  {tag}: ERROR {type(e).__name__}: {str(e)[:600]}")
                traceback.print_exc(file=LOG)
    return res


CASES_HEAD_DIM = 0  # --cases-head-dim: the correctness sweep's cases of this head_dim only (0: all)
CASES_FROM = 0  # --cases-from: skip the sweep's first cases (after the filters above)
TABLE_HEAD_DIM = 128  # --head-dim (the README's peer numbers stand in only for head_dim 128)
CONFIG_OVERRIDE: dict = {}  # --config-json: merged into every config the correctness sweep uses


HD64_VARIANTS = (dict(), dict(block_kv=256, stages=2), dict(block_kv=64, stages=4))
HD64_BWD_VARIANTS = (dict(), dict(bwd_wgs=1, bwd_dq_atomic=True), dict(bwd_block_kv=128),
                     dict(bwd_block_kv=128, bwd_wgs=1, bwd_dq_atomic=True), dict(bwd_block_q=128))
# hd256 candidates that fit shared memory: 128-key forward blocks with a one-stage K/V ring (H100 2026-11-26:
# 0.35-0.5x of the default forward; the two-warpgroup backward with a one-stage ring gave wrong causal gradients and
# is refused by HopperConfig: attention_hopper_h100_hd256_variants_log.txt)
HD256_VARIANTS = (dict(), dict(block_kv=128, stages=1))


def hd64_variants(budget, rounds=2, configs=HD64_VARIANTS, time_fwd=True, D=64, H=32):
    """head_dim D configs (H heads, 16k tokens, bf16; default hd64 with 32 heads) over the shape's default
    config, forward and forward+backward next to cuDNN, 1k/4k/16k, causal and not; `rounds` interleaved rounds;
    outputs and gradients checked against cuDNN's."""
    res = []
    for S in cases.ATTENTION_SEQS:
        for causal in (False, True):
            if elapsed() > budget:
                log("  (variants stopped: time budget)")
                return res
            B = cases.ATTENTION_TOKENS // S
            q, k, v, do = inputs(jax.random.key(11), B, S, H, H, D, jnp.bfloat16)
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            cud, cud_fb = make_jax_nn("cudnn", D ** -0.5, causal)
            ref = cud(q, k, v)
            fns = [("cuDNN", cud, cud_fb)]
            ref_g = cud_fb(q, k, v, do)
            for kw in configs:
                cfg = dataclasses.replace(default_config(D, S, causal), **kw)
                fwd, fb = make_ours(D ** -0.5, causal, cfg)
                try:
                    err = rel(fwd(q, k, v), ref)
                    gerr = max(rel(a, b) for a, b in zip(fb(q, k, v, do), ref_g))
                    log(f"  S{S} {'causal' if causal else 'full'} {kw or 'default'}: rel vs cudnn {err:.1e}, "
                        f"grads {gerr:.1e}")
                    fns.append((str(kw or "default"), fwd, fb))
                except Exception as e:  # noqa: BLE001
                    log(f"  S{S} {kw}: ERROR {type(e).__name__}: {str(e)[:400]}")
            times = {}
            for _ in range(rounds):
                for name, fwd, fb in fns:
                    times.setdefault(name, []).append(
                        (flops / bench(fwd, (q, k, v)) / 1e12 if time_fwd else 0.0,
                         3.5 * flops / bench(fb, (q, k, v, do)) / 1e12))
            for name, t in times.items():
                log(f"  S{S} {'causal' if causal else 'full'} {name}: fwd "
                    + " / ".join(f"{a:.0f}" for a, _ in t) + "  fwd+bwd " + " / ".join(f"{b:.0f}" for _, b in t))
                res.append(dict(tag=f"hd{D} S{S} {'causal' if causal else 'full'} {name}",
                                fwd=float(np.mean([a for a, _ in t])), fb=float(np.mean([b for _, b in t]))))
    return res


def best_peers(r, tk_measured):
    """[(best, tokamax value, tokamax value is a README number) for fwd, for fwd+bwd].

    Where tokamax was measured in this process the best peer is max(cuDNN, tokamax) as measured
    now.  Where it was not (not importable, or this row / this direction failed in it) the README
    numbers stand in for tokamax and the README cuDNN number counts too, as before tokamax was
    measured here."""
    tg = TARGETS.get((r["S"], r["causal"])) if TABLE_HEAD_DIM == 128 else None  # README rows: hd128
    out = []
    for i, suf in enumerate(("fwd", "fb")):
        cud, tkv = r.get(f"cudnn_{suf}") or 0, r.get(f"tokamax_{suf}")
        if tk_measured and tkv:
            out.append((max(cud, tkv), tkv, False))
        elif tg is not None:
            out.append((max(cud, tg["cudnn"][i], tg["tokamax"][i]), tg["tokamax"][i], True))
        else:
            out.append((max(cud, tkv or 0), tkv, False))
    return out


def table(results, tk_measured):
    lines = ["| seq | causal | ours fwd | cuDNN fwd | tokamax fwd | portable fwd | XLA fwd "
             "| best peer fwd | ours/best | ours fwd+bwd (default) | ours fwd+bwd (dQ kernel) "
             "| ours fwd+bwd (atomic dQ) "
             "| cuDNN fwd+bwd | tokamax fwd+bwd | portable fwd+bwd | XLA fwd+bwd | best peer fwd+bwd "
             "| ours(default)/best |",
             "|---" * 18 + "|"]

    def f(r, key):
        v = r.get(key)
        return f"{v:.0f}" if v is not None else "-"

    def tkcell(v, readme):
        return "-" if not v else f"{v:.0f}*" if readme else f"{v:.0f}"

    for r in results:
        (best_f, tkf, rdf), (best_b, tkb, rdb) = best_peers(r, tk_measured)
        rf = f"{r['ours_fwd'] / best_f:.2f}" if r.get("ours_fwd") and best_f else "-"
        ob = r.get("ours_fb") or 0
        rb = f"{ob / best_b:.2f}" if ob and best_b else "-"
        lines.append(f"| {r['S']} | {'yes' if r['causal'] else 'no'} | {f(r, 'ours_fwd')} | "
                     f"{f(r, 'cudnn_fwd')} | {tkcell(tkf, rdf)} | {f(r, 'portable_fwd')} | "
                     f"{f(r, 'xla_fwd')} | {best_f:.0f} | {rf} | {f(r, 'ours_fb')} | "
                     f"{f(r, 'ourskern_fb')} | {f(r, 'oursat_fb')} | {f(r, 'cudnn_fb')} | {tkcell(tkb, rdb)} | "
                     f"{f(r, 'portable_fb')} | {f(r, 'xla_fb')} | {best_b:.0f} | {rb} |")
    return "\n".join(lines)


def error_table(results):
    names = ["ours", "ourskern", "oursat", "cudnn", "tokamax", "portable", "xla"]
    lines = ["| seq | causal | " + " | ".join(f"{n} out err / grad err" for n in names) + " |",
             "|---" * (2 + len(names)) + "|"]

    def cell(r, n):
        e, g, err = r.get(f"{n}_err"), r.get(f"{n}_gerr"), f"{n}_error" in r
        if e is None and g is None:
            return "error" if err else "-"
        c = f"{'-' if e is None else f'{e:.1e}'} / {'-' if g is None else f'{g:.1e}'}"
        return c + " (then error)" if err else c

    for r in results:
        lines.append(f"| {r['S']} | {'yes' if r['causal'] else 'no'} | "
                     + " | ".join(cell(r, n) for n in names) + " |")
    return "\n".join(lines)


def plot(results, tk_measured, device_kind):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        log("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{r['S'] // 1024}k{' c' if r['causal'] else ''}" for r in results]
    x = np.arange(len(results))
    for ax, suf, title in ((axes[0], "fwd", "forward"), (axes[1], "fb", "forward+backward")):
        names = ["ours", "ourskern", "oursat", "cudnn", "portable", "xla"]
        w = 0.8 / (len(names) + 1)
        for i, n in enumerate(names):
            ax.bar(x + i * w, [r.get(f"{n}_{suf}") or 0 for r in results], w, label=n)
        idx = 0 if suf == "fwd" else 1
        tk_vals = [best_peers(r, tk_measured)[idx][1] or 0 for r in results]
        ax.bar(x + len(names) * w, tk_vals, w,
               label="tokamax (measured)" if tk_measured else "tokamax (README)")
        ax.set_xticks(x + 0.4 - w / 2)
        ax.set_xticklabels(labels)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{device_kind} bf16 H=16 D=128 B*S=16k: {title}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(OUT, "attention_hopper_h100.png")
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--only-variants", action="store_true")
    ap.add_argument("--only-correctness", action="store_true",
                    help="the correctness sweep only (stops after --budget seconds)")
    ap.add_argument("--variant-set", default="all", choices=("all", "atomic", "fwd", "hd64", "hd64bwd", "hd256"))
    ap.add_argument("--skip-correctness", action="store_true",
                    help="skip the hopper_attention correctness sweep (timing rows still check outputs)")
    ap.add_argument("--atomic", action="store_true", help="also time the atomic-dQ backward")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds before stopping work")
    ap.add_argument("--peers", default=",".join(ALL_PEERS),
                    help=f"comma-separated peers to time next to ours (default: all of {ALL_PEERS})")
    ap.add_argument("--no-tokamax", action="store_true", help="do not try to import tokamax")
    ap.add_argument("--tokamax-impl", default="mosaic",
                    help="tokamax implementation= (default mosaic; xla for the CPU smoke run)")
    ap.add_argument("--head-dim", type=int, default=128,
                    help="timing table head_dim (heads = 2048 // head_dim: the same hidden size)")
    ap.add_argument("--seqs", default=",".join(map(str, cases.ATTENTION_SEQS)), help="timing table sequence lengths")
    ap.add_argument("--cases-from", type=int, default=0, help="correctness: skip the first N cases")
    ap.add_argument("--cases-head-dim", type=int, default=0,
                    help="correctness sweep: only the cases of this head_dim (default: all)")
    ap.add_argument("--config-json", default="",
                    help='HopperConfig fields merged into every correctness-sweep config, e.g. '
                         '\'{"fwd_overlap": true}\'')
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes, no GPU warm-up / correctness sweep / variants: checks plumbing")
    args = ap.parse_args()
    global TABLE_HEAD_DIM, CASES_HEAD_DIM, CASES_FROM
    TABLE_HEAD_DIM, CASES_HEAD_DIM, CASES_FROM = args.head_dim, args.cases_head_dim, args.cases_from
    if args.config_json:
        CONFIG_OVERRIDE.update(json.loads(args.config_json))
        log(f"config override for the correctness sweep: {CONFIG_OVERRIDE}")
    peers = tuple(p for p in args.peers.split(",") if p)
    unknown = set(peers) - set(ALL_PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {ALL_PEERS}")
    dev = jax.devices()[0]
    log(f"date: {datetime.date.today()}")
    log(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
        f"compute capability {getattr(dev, 'compute_capability', '?')}")
    log(f"supports(hd128 4k causal bf16): {supports((4, 4096, 16, 128), (4, 4096, 16, 128), (4, 4096, 16, 128), jnp.bfloat16, True)}")
    log("default configs: " + ", ".join(f"D{d}: {dataclasses.asdict(default_config(d))}"
                                         for d in (64, 128, 256)))
    tk, tk_info = None, "tokamax not tried (--no-tokamax or not in --peers)"
    if "tokamax" in peers and not args.no_tokamax:
        tk, tk_info = import_tokamax(args.tokamax_impl)
    log(f"peer: {tk_info}")
    corr, res, var = [], [], []
    if args.cpu_smoke:
        res = timing_rows(False, budget=args.budget, tk=tk, tk_impl=args.tokamax_impl, peers=peers,
                          tokens=256, H=2, D=128, seqs=(128, 256), iters=1, warmup=0)
    else:
        gpu_warmup()
        if args.only_correctness:
            corr = correctness(args.quick, budget=args.budget)
        elif not args.only_variants:
            if not args.skip_correctness:
                corr = correctness(args.quick)
            t_budget = args.budget if args.no_variants else args.budget * 0.75
            res = timing_rows(args.quick, budget=t_budget, with_atomic=args.atomic, tk=tk,
                              tk_impl=args.tokamax_impl, peers=peers, H=cases.ATTENTION_HIDDEN // args.head_dim,
                              D=args.head_dim, seqs=tuple(int(x) for x in args.seqs.split(",")))
        if not args.no_variants and not args.only_correctness:
            var = variants(args.budget, args.variant_set)
    tk_measured = any(r.get("tokamax_fwd") for r in res)
    json.dump(dict(tokamax=tk_info, tokamax_measured=tk_measured, correctness=corr, timings=res,
                   variants=var),
              open(os.path.join(OUT, "attention_hopper_results.json"), "w"), indent=1, default=str)
    if res:
        plot(res, tk_measured, dev.device_kind)
        t = table(res, tk_measured)
        if tk_measured:
            src = (f"'best peer' = max(cuDNN, tokamax) both measured in this process ({tk_info}); "
                   f"a tokamax cell marked * is a README number (that row failed in tokamax; "
                   f"README cuDNN counts in that cell's best peer too).")
        else:
            why = tk_info if tk is None else f"{tk_info}; imported, but every call failed: see ERROR lines"
            src = (f"tokamax NOT measured ({why}): tokamax cells marked * are README numbers "
                   f"(H100), and 'best peer' = max(cuDNN measured now, cuDNN and tokamax from "
                   f"shared/README).")
        hdr = (f"Hopper flash attention (Pallas Mosaic GPU), date {datetime.date.today()}, {dev.device_kind}, "
               f"jax {jax.__version__}, head_dim {args.head_dim}, {cases.ATTENTION_HIDDEN // args.head_dim} heads. TFLOP/s: fwd 4*B*H*S^2*D (half when causal), fwd+bwd 3.5x. "
               + src)
        et = error_table(res)
        ehdr = (f"Output rel-L2 vs fp32 reference (last query rows, tol {OUT_TOL:g}) / "
                f"max dq,dk,dv rel-L2 vs cuDNN (tol {GRAD_TOL:g}):")
        open(os.path.join(OUT, "attention_hopper_table.md"), "w").write(
            hdr + "\n\n" + t + "\n\n" + ehdr + "\n\n" + et + "\n")
        log("\n" + ehdr + "\n" + et)
        log("\n" + hdr + "\n" + t)
    if corr:
        bad = [c["case"] for c in corr if not c.get("ok")]
        log(f"\ncorrectness: {len(corr) - len(bad)}/{len(corr)} cases OK" + (f"; FAILED: {bad}" if bad else ""))
    log(f"total {elapsed():.0f}s")


if __name__ == "__main__":
    main()
