"""GPU check of packed q/k/v read in place by the portable Pallas kernel (flash_attention_packed).

  PYTHONPATH=. python3 -m benchmarks.packed_attention_gpu [--seq 4096] [--batch 4] [--reps 20]

NOT YET RUN ON A GPU (written on the CPU machine; the CPU tests check the jaxpr and the numbers in
interpret mode). For each packed layout (bs3hd, bs(h+2g)d with GQA, bshd_bs2hd with GQA), bf16, causal:

1. correctness: in place vs `flash_attention` on q, k, v sliced out in XLA (today's path): relative L2 of
   the output and of the packed gradient (the same kernels run, so expect ~0);
2. no copy: in the *optimized* HLO of the jitted forward, what consumes the packed parameter (through
   bitcasts) — expect only the Triton custom calls, no copy/slice/fusion. (On the CPU, where the kernels
   run in interpret mode, the interpreter copies its operands: this column and the timings mean
   something on a GPU only; a CPU smoke run with --seq 32 --batch 1 --reps 1 checks the script runs.)
3. timing (warm-up, median of --reps runs, jax.block_until_ready): forward and forward+backward,
   in place vs split.

Prints a short table last; the full log goes to $OUT/packed_attention_log.txt when set.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import (AttentionMask, flash_attention, flash_attention_packed,
                                            packed_in_place_reason)
from pallas_kernels.flash_attention.kernel import _Packed

from benchmarks import timing

LINES: list[str] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LINES.append(s)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "packed_attention_log.txt"), "a") as fh:
            fh.write(s + "\n")


def rel_l2(a, b):
    a, b = (jnp.asarray(x, jnp.float32).ravel() for x in (a, b))
    return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def median_ms(fn, *args, reps):
    """Median ms per call after a warm-up, each call blocked on (benchmarks/timing.py)."""
    return timing.measure(fn, args, samples=reps, warmup=0, inner=1)[0] * 1e3


def consumers_of_param(hlo_text: str, index: int = 0) -> list[str]:
    """Opcodes of the ENTRY instructions that read parameter `index`, looking through bitcasts."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    instrs = []  # (name, opcode, text after the opcode's parenthesis)
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)$", line)
        op = m and re.search(r"([a-z][a-z\-]*)\((.*)$", m.group(2))
        if op:
            instrs.append((m.group(1), op.group(1), op.group(2)))
    param = next(n for n, op, rest in instrs if op == "parameter" and rest.startswith(f"{index})"))
    todo, out = [param], []
    while todo:
        cur = todo.pop()
        for n, op, rest in instrs:
            if re.search(rf"%{re.escape(cur)}(?![\w.\-])", rest):
                if op == "bitcast":
                    todo.append(n)
                else:
                    out.append(op)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    B, S, D, dt = a.batch, a.seq, 128, jnp.bfloat16
    log(f"# packed attention, {datetime.date.today()}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if jax.default_backend() != "gpu":
        log("# not a GPU: interpret mode, so the HLO consumers and timings below say nothing about the kernels")
    mask = AttentionMask.full(B, S, S, causal=True)
    kw = dict(scale=D ** -0.5)
    rows = []
    for layout, h, g in (("bs3hd", 16, 16), ("bs(h+2g)d", 16, 4), ("bshd_bs2hd", 16, 4)):
        pk = _Packed(layout, h, g)
        k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        packed = jax.random.normal(k1, pk.expected_shape(B, S, D), jnp.float32).astype(dt)
        qkv = packed if pk.has_q else (jax.random.normal(k2, (B, S, h, D), jnp.float32).astype(dt), packed)
        why = packed_in_place_reason(qkv, layout=layout, num_heads=h, num_kv_heads=g)
        log(f"{layout}: in place = {why is None} ({why or 'no padding needed'})")
        ct = jax.random.normal(k3, (B, S, h, D), jnp.float32).astype(dt)

        def in_place(x):
            return flash_attention_packed(x, mask, layout=layout, num_heads=h, num_kv_heads=g, **kw)[0]

        def split(x):
            q, kk, v = pk.split(x if pk.has_q else x[1])
            return flash_attention(q if pk.has_q else x[0], kk, v, mask, **kw)[0]

        def fwd_bwd(f):
            return jax.jit(lambda x: jax.vjp(f, x)[1](ct))

        fi, fs = jax.jit(in_place), jax.jit(split)
        err_o = rel_l2(fi(qkv), fs(qkv))
        gi, gs = fwd_bwd(in_place)(qkv), fwd_bwd(split)(qkv)
        err_g = max(rel_l2(x, y) for x, y in zip(jax.tree.leaves(gi), jax.tree.leaves(gs)))
        hlo = fi.lower(qkv).compile().as_text()
        cons = consumers_of_param(hlo, index=0 if pk.has_q else 1)
        log(f"  rel L2 out {err_o:.2e}, grads {err_g:.2e}; packed parameter read by: {cons}")
        t = [median_ms(f, qkv, reps=a.reps) for f in (fi, fs, fwd_bwd(in_place), fwd_bwd(split))]
        rows.append((layout, h, g, err_o, err_g, all(c == "custom-call" for c in cons), *t))
    log("")
    log(f"B={B} S={S} D={D} bf16 causal; ms, median of {a.reps}")
    log("| layout | h | g | rel L2 out | rel L2 grad | only kernels read it | fwd in place | fwd split "
        "| fwd+bwd in place | fwd+bwd split |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log("| {} | {} | {} | {:.1e} | {:.1e} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} |".format(*r))


if __name__ == "__main__":
    main()
