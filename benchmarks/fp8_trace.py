"""Where an FP8 training step's device time goes: per kernel category, from a jax.profiler trace.

Used by `benchmarks/fp8_layer_gpu.py --trace` (and `--probe-small`). Categories come from the compiled HLO:
  fp8 gemm      custom call __cublas$lt$matmul$f8
  gemm          any other cuBLAS / cuBLASLt GEMM or GEMM fusion
  pallas        Mosaic GPU / Triton custom calls (attention, norms)
  fp8 cast      a fusion whose body converts to float8 (quantize passes: amax and cast often fused)
  transpose     a fusion or op whose body transposes / copies with a layout change
  reduce        other fusions with a reduction (norms, amax alone, loss)
  elementwise   other fusions
  other         everything else (copies, collectives, small ops)
"""
from __future__ import annotations

import collections
import gzip
import re

from benchmarks.transformer_layer_profile_gpu import _INSTR_RE, computations, trace_summary

F8_TYPES = ("f8e4m3fn", "f8e5m2")


def instruction_categories(text):
    """{instruction name: (category, short description)} for every instruction outside fusion bodies."""
    comps = computations(text)
    out = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR_RE.match(line)
            if not m:
                continue
            iname, shape, opcode, rest = m.groups()
            body = ""
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if called and called.group(1) in comps:
                body = "\n".join(comps[called.group(1)])
            tgt = re.search(r'custom_call_target="([^"]*)"', line)
            tgt = tgt.group(1) if tgt else ""
            if "$f8" in tgt:
                cat = "fp8 gemm"
            elif re.search(r"gemm|matmul|cublas", tgt, re.I) or (opcode == "fusion" and re.search(
                    r"__triton_gemm|kind=kCustom.*(gemm|cutlass|matmul)", line)):
                cat = "gemm"
            elif opcode == "custom-call" and re.search(r"mosaic|triton|pallas", tgt, re.I):
                cat = "pallas"
            elif opcode == "fusion" and any(f"{t}[" in body for t in F8_TYPES) and "convert(" in body:
                cat = "fp8 cast"
            elif opcode in ("transpose", "copy") or (opcode == "fusion" and re.search(r"\btranspose\(", body)):
                cat = "transpose"
            elif opcode == "fusion" and re.search(r"\breduce\(", body):
                cat = "reduce"
            elif opcode == "fusion":
                cat = "elementwise"
            else:
                cat = "other"
            out[iname] = (cat, f"{opcode}{'(' + tgt + ')' if tgt else ''} -> {shape[:70]}")
    return out


def trace_categories(compiled, args, hlo_path=None, n_steps=3):
    """Profile `compiled(*args)`; ms per step per category and the 25 costliest ops with their category."""
    text = compiled.as_text()
    if hlo_path:
        with gzip.open(hlo_path, "wt") as f:
            f.write(text)
    cats = instruction_categories(text)
    res, _ = trace_summary(compiled, args, "fp8", n_steps=n_steps)
    per_op = res.get("all_ops_us", {})
    by_cat = collections.Counter()
    for op, us in per_op.items():
        by_cat[cats.get(op, ("unmatched", ""))[0]] += us
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:25]
    return {"device_ms_per_step": res.get("device_ms_per_step"),
            "category_ms": {k: v / 1e3 for k, v in by_cat.most_common()},
            "top_ops": [{"op": op, "us": us, "category": cats.get(op, ("unmatched", ""))[0],
                         "what": cats.get(op, ("", ""))[1]} for op, us in top],
            "all_ops": [{"op": op, "us": us, "category": cats.get(op, ("unmatched", ""))[0],
                         "what": cats.get(op, ("", ""))[1]} for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])]}


def category_table(traces):
    """Markdown: ms per step per category (rows) for each variant (columns), then each variant's top ops."""
    names = [n for n, t in traces.items() if "category_ms" in t]
    cats = sorted({c for n in names for c in traces[n]["category_ms"]},
                  key=lambda c: -max(traces[n]["category_ms"].get(c, 0) for n in names))
    lines = ["\n## Device time per step by kernel category (ms, jax.profiler trace of 3 steps)\n",
             "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(f"{traces[n]['category_ms'].get(c, 0):.2f}" for n in names) + " |")
    lines.append("| total | " + " | ".join(f"{traces[n]['device_ms_per_step'] or 0:.2f}" for n in names) + " |")
    for n, t in traces.items():
        if "error" in t:
            lines.append(f"\n{n}: trace failed: {t['error']}")
            continue
        lines.append(f"\n### {n}: costliest ops (us per step)")
        for o in t["top_ops"]:
            lines.append(f"- {o['us']:.0f} us  {o['category']:<12} {o['op']}: {o['what']}")
    return "\n".join(lines)


def probe_small_dense():
    """The GEMM custom calls and FP8 dots of one small FP8 DenseGeneral step (tests/test_fp8.py's GPU test)."""
    import jax
    import jax.numpy as jnp

    from te_jax import fp8
    from te_jax.flax import DenseGeneral

    m = DenseGeneral(features=256, use_bias=False, dtype=jnp.bfloat16)
    kx, kc = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (4, 64, 128), jnp.bfloat16)
    ct = jax.random.normal(kc, (4, 64, 256), jnp.float32)
    with fp8.autocast(recipe=fp8.DelayedScaling(amax_history_len=16)):
        v = m.init(jax.random.PRNGKey(0), x)
        f = jax.jit(lambda v, x, ct: jax.value_and_grad(
            lambda v, x: jnp.sum(m.apply(v, x).astype(jnp.float32) * ct), argnums=(0, 1))(v, x))
        hlo = f.lower(v, x, ct).compile().as_text()
    keep = [ln.strip()[:400] for ln in hlo.splitlines()
            if "custom_call_target" in ln or ("dot(" in ln and "f8" in ln) or "__triton_gemm" in ln]
    return "\n## small FP8 DenseGeneral probe: GEMM-related instructions\n" + "\n".join(keep)


def idle_gaps(fn, args, *, calls=4, top=12):
    """Where the device idles during `calls` back-to-back calls of fn(*args) (benchmarks.device_time's events):
    per call the span, the kernels' summed time and the idle time between them, and the `top` longest idle
    stretches with the kernels on either side (a stretch between two calls is marked)."""
    from benchmarks import device_time

    prof = device_time.profiled(fn, args, calls=calls)
    events = prof["events"]
    gaps, end, prev = [], events[0][1], events[0][2]
    for start, stop, name in events[1:]:
        if start > end:
            gaps.append(((start - end) * 1e-3, prev[:60], name[:60]))
        if stop > end:
            end, prev = stop, name
    idle_us = sum(g for g, _, _ in gaps) / calls
    lines = [f"span {prof['span_s'] * 1e3:.2f} ms/call, kernels {prof['kernel_s'] * 1e3:.2f} ms/call "
             f"({prof['kernels_per_call']:.0f} per call), idle {idle_us / 1e3:.2f} ms/call in {len(gaps) / calls:.0f} "
             f"stretches; longest (us, after -> before):"]
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {g:8.1f}  {a} -> {b}")
    small = [g for g, _, _ in gaps if g < 20]
    lines.append(f"  stretches under 20 us: {len(small) / calls:.0f} per call, {sum(small) / calls / 1e3:.2f} ms/call")
    return "\n".join(lines)
