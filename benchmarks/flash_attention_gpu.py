"""GPU check and benchmark of the portable (Triton-lowered) Pallas flash attention.

  PYTHONPATH=. python3 -m benchmarks.flash_attention_gpu [--parts correctness,timing]
                                                       [--sweep] [--sweep-budget 200]

1. correctness at real sizes (bf16; forward and gradients; relative L2 error against the fp32
   reference_attention on the same bf16 inputs);
2. timing (warm-up, median of >= 20 runs, jax.block_until_ready, random data) of forward and
   forward+backward against jax.nn.dot_product_attention(implementation="cudnn" / "xla");
   TFLOP/s counts 4*B*H*S^2*D for the forward (half when causal), 3.5x that for fwd+bwd;
3. --sweep: a block-size sweep (forward, dK/dV and dQ kernels separately) to fill the table
   in pallas_kernels/flash_attention/kernel.py.

Prints a short table last; full logs go to $OUT when set.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cases
from benchmarks import timing as bench_timing
from pallas_kernels.flash_attention import (
    AttentionMask,
    BlockSizes,
    default_block_sizes,
    flash_attention,
    flash_attention_bwd,
    flash_attention_fwd,
    reference_attention,
)

LOG_LINES: list[str] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG_LINES.append(s)
    d = os.environ.get("OUT")
    if d:  # incremental, so a run stopped at its time limit still leaves its log
        with open(os.path.join(d, "flash_attention_log.txt"), "a") as fh:
            fh.write(s + "\n")


def rel_l2(a, b):
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm((a - b).ravel()) / (jnp.linalg.norm(b.ravel()) + 1e-30))


def inputs(B, Sq, Skv, H, G, Dqk, Dv, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (B, Sq, H, Dqk), dtype)
    k = jax.random.normal(ks[1], (B, Skv, G, Dqk), dtype)
    v = jax.random.normal(ks[2], (B, Skv, G, Dv), dtype)
    do = jax.random.normal(ks[3], (B, Sq, H, Dv), dtype)
    return q, k, v, do


def seg_pos(B, S, offset=0):
    return (jnp.ones((B, S), jnp.int32),
            jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) + offset, (B, S)))


def mask_and_kwargs(qs, qp, ks, kp, kw):
    """A case's kwargs split into its AttentionMask (causal, window_left/right) and the kernel's own."""
    kw = dict(kw)
    mask = AttentionMask(qs, qp, ks, kp, causal=kw.pop("causal", False),
                         window=(kw.pop("window_left", -1), kw.pop("window_right", -1)))
    return mask, kw


def timeit(f, *args, n=20):
    """Median seconds per call, each call blocked on (benchmarks/timing.py, one call per sample)."""
    return bench_timing.measure(f, args, samples=n, warmup=1, inner=1)[0]


# ------------------------------------------------------------------------------ correctness
def correctness(tiny=False):
    cases = [
        # name, B, Sq, Skv, H, G, Dqk, Dv, kwargs, q position offset
        ("causal", 2, 2048, 2048, 8, 8, 128, 128, dict(causal=True), 0),
        ("non-causal", 2, 2048, 2048, 8, 8, 128, 128, dict(), 0),
        ("gqa16:1 hd64 win(-1,0)", 1, 2048, 2048, 16, 1, 64, 64,
         dict(window_left=-1, window_right=0), 0),
        ("hd 192/128 causal", 1, 1024, 1024, 8, 4, 192, 128, dict(causal=True), 0),
        ("odd B2 S4133 H18 D128", 2, 4133, 4133, 18, 18, 128, 128, dict(causal=True), 0),
        ("Sq=1 vs 1000 keys", 4, 1, 1000, 8, 2, 128, 128, dict(causal=True), 999),
        ("softcap+window", 1, 1024, 1024, 8, 8, 64, 64,
         dict(softcap=30.0, causal=True, window_left=255), 0),
        ("hd256 gqa split-dKV", 2, 1024, 1024, 8, 2, 256, 256,
         dict(causal=True, block_sizes=BlockSizes(64, 64, 64, 64, num_warps=4, num_stages=3,
                                                  num_warps_bwd=4, split_dkv=True)), 0),
    ]
    if tiny:  # CPU smoke test of the script itself
        cases = [(c[0], 1, min(c[2], 40), min(c[3], 72), 2, 1 if c[5] < c[4] else 2, c[6],
                  c[7], c[8], min(c[9], 71)) for c in cases]
    rows = []
    for name, B, Sq, Skv, H, G, Dqk, Dv, kw, off in cases:
        try:
            q, k, v, do = inputs(B, Sq, Skv, H, G, Dqk, Dv, seed=1)
            qs, qp = seg_pos(B, Sq, off)
            ks, kp = seg_pos(B, Skv)
            scale = 1.0 / np.sqrt(Dqk)
            mask, fkw = mask_and_kwargs(qs, qp, ks, kp, kw)

            def run(fn):
                def f(q, k, v, do):
                    (o, lse), vjp = jax.vjp(
                        lambda q, k, v: fn(q, k, v, mask, scale=scale, **fkw), q, k, v)
                    dlse = jnp.zeros_like(lse) + 0.1 * (lse > -jnp.inf)
                    return o, lse, vjp((do, dlse))
                return jax.jit(f)(q, k, v, do)

            o, lse, g = run(flash_attention)
            ro, rlse, rg = run(reference_attention)
            errs = [rel_l2(o, ro), rel_l2(lse, rlse)] + [rel_l2(a, b) for a, b in zip(g, rg)]
            finite = all(bool(jnp.all(jnp.isfinite(x))) for x in (o, *g))
            ok = finite and errs[0] < 2e-2 and errs[1] < 1e-3 and max(errs[2:]) < 3e-2
            rows.append((name, errs, ok))
            log(f"[correctness] {name:28s} out {errs[0]:.2e} lse {errs[1]:.2e} dq {errs[2]:.2e} "
                f"dk {errs[3]:.2e} dv {errs[4]:.2e} finite={finite} -> {'PASS' if ok else 'FAIL'}")
            del o, lse, g, ro, rlse, rg
        except Exception as e:  # noqa: BLE001
            log(f"[correctness] {name}: ERROR {type(e).__name__}: {e}")
            log(traceback.format_exc())
            rows.append((name, None, False))
    return rows


# ------------------------------------------------------------------------------ timing
def attn_fns(impl, B, S, H, G, D, causal, block_sizes=None):
    scale = 1.0 / np.sqrt(D)
    mask = AttentionMask(*seg_pos(B, S), *seg_pos(B, S), causal=causal)
    if impl == "pallas":
        def fwd(q, k, v):
            return flash_attention(q, k, v, mask, scale=scale, block_sizes=block_sizes)[0]
    else:
        def fwd(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                implementation=impl)

    def fwd_bwd(q, k, v, do):
        o, vjp = jax.vjp(fwd, q, k, v)
        return vjp(do)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def flops_fwd(B, S, H, D, causal):
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def blocks_from_sweep(best, D):
    """BlockSizes from the sweep's best fwd/dkv/dq entries for head dim D (non-causal),
    or None (the library default) when the sweep did not cover D."""
    keys = [(w, D, False) for w in ("fwd", "dkv", "dq")]
    if not all(k in best for k in keys):
        return None
    (bq, bk, w, st), (bqb, bkb, wb, stb, split), (bqd, bkd, wd, _, _) = \
        (best[k][1] for k in keys)
    return BlockSizes(bq, bk, bqb, bkb, num_warps=w, num_stages=st, num_warps_bwd=wb,
                      num_stages_bwd=stb, block_q_dq=bqd, block_kv_dq=bkd, num_warps_dq=wd,
                      split_dkv=split)


def timing(configs, impls=("pallas", "cudnn", "xla"), n=20, best=None):
    results = []
    for (B, S, H, G, D, causal) in configs:
        q, k, v, do = inputs(B, S, S, H, G, D, D)
        ff = flops_fwd(B, S, H, D, causal)
        row = dict(B=B, S=S, H=H, G=G, D=D, causal=causal)
        bs = blocks_from_sweep(best or {}, D)
        row["blocks"] = "default" if bs is None else "sweep-best"
        if bs is not None:
            log(f"[timing] D{D}: using sweep-best {bs}")
        for impl in impls:
            if impl == "xla" and S > 4096:
                row[impl] = (None, None)
                continue
            try:
                fwd, fb = attn_fns(impl, B, S, H, G, D, causal, block_sizes=bs)
                tf = timeit(fwd, q, k, v, n=n)
                tb = timeit(fb, q, k, v, do, n=n)
                row[impl] = (ff / tf / 1e12, 3.5 * ff / tb / 1e12)
                log(f"[timing] B{B} S{S} H{H} G{G} D{D} causal={causal} {impl:6s} "
                    f"fwd {tf*1e3:8.3f} ms {row[impl][0]:6.1f} TFLOP/s | fwd+bwd {tb*1e3:8.3f} ms "
                    f"{row[impl][1]:6.1f} TFLOP/s")
            except Exception as e:  # noqa: BLE001
                row[impl] = (None, None)
                log(f"[timing] B{B} S{S} D{D} causal={causal} {impl}: FAILED "
                    f"{type(e).__name__}: {str(e)[:300]}")
        results.append(row)
    return results


# ------------------------------------------------------------------------------ sweep
FWD_CANDIDATES = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 3),
                  (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                  (64, 128, 4, 2), (64, 128, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3)]
DKV_CANDIDATES = [(32, 64, 4, 1), (32, 64, 4, 2), (64, 64, 4, 1), (64, 64, 4, 2),
                  (64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 1), (64, 128, 8, 2),
                  (16, 64, 4, 2), (32, 32, 4, 2)]
FWD_CANDIDATES_256 = [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                      (64, 128, 8, 2), (64, 128, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3)]
# (block_q, block_kv, warps, stages, split_dkv)
DKV_CANDIDATES_256 = [(32, 64, 8, 2, False), (64, 64, 8, 2, False), (32, 64, 4, 2, True),
                      (64, 64, 4, 2, True), (64, 64, 8, 2, True), (32, 64, 8, 2, True),
                      (64, 128, 8, 2, True), (32, 128, 8, 2, True), (64, 32, 4, 2, True),
                      (64, 64, 4, 3, True)]
DQ_CANDIDATES_256 = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2),
                     (32, 64, 4, 2), (64, 64, 8, 3), (128, 32, 8, 3)]
DQ_CANDIDATES = [(64, 64, 4, 1), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2),
                 (128, 32, 8, 2), (64, 64, 8, 2), (128, 64, 4, 2), (32, 64, 4, 2)]


def sweep(budget_s, B=4, S=4096, H=16, dims=(128, 64, 256), causals=(False, True),
          n=10, max_cfgs=None, kernels=("fwd", "dkv", "dq")):
    t_end = time.time() + budget_s
    best = {}
    for causal in causals:
        for D in dims:
            q, k, v, do = inputs(B, S, S, H, H, D, D)
            mask = AttentionMask(*seg_pos(B, S), *seg_pos(B, S), causal=causal)
            scale = 1.0 / np.sqrt(D)
            ff = flops_fwd(B, S, H, D, causal)
            base = default_block_sizes(D, D, jnp.bfloat16)
            big = D > 128
            # forward
            res = []
            fwd_cands = (FWD_CANDIDATES_256 if big else FWD_CANDIDATES) if "fwd" in kernels \
                else []
            for bq, bk, w, st in fwd_cands[:max_cfgs]:
                if time.time() > t_end:
                    log("[sweep] budget exhausted")
                    return best
                bs = dataclasses.replace(base, block_q=bq, block_kv=bk, num_warps=w,
                                         num_stages=st)
                try:
                    f = jax.jit(lambda q, k, v, bs=bs: flash_attention_fwd(
                        q, k, v, mask, scale=scale, block_sizes=bs))
                    t = timeit(f, q, k, v, n=n)
                    res.append((ff / t / 1e12, (bq, bk, w, st)))
                    log(f"[sweep] fwd D{D} causal={causal} bq{bq} bk{bk} w{w} s{st}: "
                        f"{ff/t/1e12:6.1f} TFLOP/s")
                except Exception as e:  # noqa: BLE001
                    log(f"[sweep] fwd D{D} bq{bq} bk{bk} w{w} s{st}: FAILED "
                        f"{type(e).__name__}: {str(e)[:200]}")
            if res:
                best[("fwd", D, causal)] = max(res)
                log(f"[sweep] BEST fwd D{D} causal={causal}: {max(res)}")
            # backward kernels: vary the dK/dV and the dQ parameters separately
            o, lse = jax.jit(lambda q, k, v: flash_attention_fwd(q, k, v, mask, scale=scale))(q, k, v)
            dkv_c = DKV_CANDIDATES_256 if big else [c + (False,) for c in DKV_CANDIDATES]
            dq_c = [c + (False,) for c in (DQ_CANDIDATES_256 if big else DQ_CANDIDATES)]
            for which, cands in (("dkv", dkv_c), ("dq", dq_c)):
                if which not in kernels:
                    continue
                res = []
                for bq, bk, w, st, split in cands[:max_cfgs]:
                    if time.time() > t_end:
                        log("[sweep] budget exhausted")
                        return best
                    if which == "dkv":
                        bs = dataclasses.replace(base, block_q_bwd=bq, block_kv_bwd=bk,
                                                 num_warps_bwd=w, num_stages_bwd=st,
                                                 split_dkv=split,
                                                 block_q_dq=base.dq_blocks[0],
                                                 block_kv_dq=base.dq_blocks[1],
                                                 num_warps_dq=base.dq_blocks[2])
                    else:
                        bs = dataclasses.replace(base, block_q_dq=bq, block_kv_dq=bk,
                                                 num_warps_dq=w, num_stages_bwd=st)
                    try:
                        f = jax.jit(lambda q, k, v, o, lse, do, bs=bs: flash_attention_bwd(
                            q, k, v, mask, None, o, lse, do, scale=scale, block_sizes=bs))
                        t = timeit(f, q, k, v, o, lse, do, n=n)
                        res.append((2.5 * ff / t / 1e12, (bq, bk, w, st, split)))
                        log(f"[sweep] bwd({which} varied) D{D} causal={causal} bq{bq} bk{bk} "
                            f"w{w} s{st} split={split}: {t*1e3:7.3f} ms "
                            f"{2.5*ff/t/1e12:6.1f} TFLOP/s")
                    except Exception as e:  # noqa: BLE001
                        log(f"[sweep] bwd({which}) D{D} bq{bq} bk{bk} w{w} s{st}: FAILED "
                            f"{type(e).__name__}: {str(e)[:200]}")
                if res:
                    best[(which, D, causal)] = max(res)
                    log(f"[sweep] BEST {which} D{D} causal={causal}: {max(res)}")
    return best


# ------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="correctness,timing")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-budget", type=float, default=200.0)
    ap.add_argument("--sweep-dims", default="128,64,256")
    ap.add_argument("--sweep-causal", default="0,1")
    ap.add_argument("--sweep-kernels", default="fwd,dkv,dq")
    ap.add_argument("--quick", action="store_true", help="only the 4k rows in timing")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test of this script")
    args = ap.parse_args()
    parts = set(args.parts.split(",")) if args.parts else set()
    dev = jax.devices()[0]
    header = (f"date {datetime.date.today()} | device {dev.device_kind} | jax {jax.__version__}"
              f" | backend {jax.default_backend()}")
    log(header)
    t0 = time.time()
    corr = correctness(args.tiny) if "correctness" in parts else []
    log(f"[time] correctness {time.time()-t0:.0f}s")
    best = {}
    if args.sweep:
        t1 = time.time()
        if args.tiny:
            best = sweep(args.sweep_budget, B=1, S=64, H=2, dims=(64, 256), causals=(False,),
                         n=1, max_cfgs=1)
        else:
            best = sweep(args.sweep_budget,
                         dims=tuple(int(x) for x in args.sweep_dims.split(",")),
                         causals=tuple(bool(int(x)) for x in args.sweep_causal.split(",")),
                         kernels=tuple(args.sweep_kernels.split(",")))
        log(f"[time] sweep {time.time()-t1:.0f}s")
    rows = []
    if "timing" in parts:
        t1 = time.time()
        tok = cases.ATTENTION_TOKENS
        configs = [(tok // S, S, 16, 16, 128, c) for S, c in cases.ATTENTION_ROWS]
        configs += [(4, 4096, 16, 16, 64, False), (4, 4096, 16, 16, 64, True),
                    (4, 4096, 16, 16, 256, False), (4, 4096, 16, 16, 256, True),
                    (4, 4096, 16, 2, 128, True), (8, 2048, 16, 1, 64, True)]
        if args.quick:
            configs = [c for c in configs if c[1] == 4096]
        if args.tiny:
            configs = [(1, 64, 2, 1, 64, True)]
        rows = timing(configs, n=2 if args.tiny else 20, best=best)
        log(f"[time] timing {time.time()-t1:.0f}s")

    # ---------------------------------------------------------------- summary
    out = ["# Flash attention (portable Pallas/Triton) on GPU", "", header, ""]
    if corr:
        out += ["## Correctness (bf16, rel. L2 error vs fp32 reference; grads with dlse != 0)", "",
                "| case | out | lse | dq | dk | dv | ok |", "|---|---|---|---|---|---|---|"]
        for name, errs, ok in corr:
            if errs is None:
                out.append(f"| {name} | error | | | | | FAIL |")
            else:
                out.append(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errs)
                           + f" | {'PASS' if ok else 'FAIL'} |")
        out.append("")
    if best:
        out += ["## Sweep best (TFLOP/s, (block_q, block_kv, warps, stages))", ""]
        for key, val in sorted(best.items(), key=str):
            out.append(f"- {key}: {val[0]:.1f} {val[1]}")
        out.append("")
    if rows:
        f = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
        out += ["## Timing, bf16, TFLOP/s (fwd: 4BHS^2D, /2 causal; fwd+bwd: 3.5x)", "",
                "| B | S | H/G | D | causal | pallas fwd | cudnn fwd | xla fwd | pallas f+b |"
                " cudnn f+b | xla f+b | f+b vs cudnn | blocks |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            p, c, x = r["pallas"], r["cudnn"], r["xla"]
            ratio = "-" if p[1] is None or c[1] is None else f"{p[1]/c[1]:.2f}"
            out.append(f"| {r['B']} | {r['S']} | {r['H']}/{r['G']} | {r['D']} | "
                       f"{'yes' if r['causal'] else 'no'} | {f(p[0])} | {f(c[0])} | {f(x[0])} | "
                       f"{f(p[1])} | {f(c[1])} | {f(x[1])} | {ratio} | {r['blocks']} |")
    text = "\n".join(out)
    print("\n" + text, flush=True)
    d = os.environ.get("OUT")
    if d:
        with open(os.path.join(d, "flash_attention_table.md"), "w") as fh:
            fh.write(text + "\n")
    return 0 if all(ok for _, _, ok in corr) else 1


if __name__ == "__main__":
    sys.exit(main())
