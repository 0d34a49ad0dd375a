"""GPU profile: where te_jax's TransformerLayer fwd+bwd spends its time against the plain-JAX layer (issue #4).

Run on the device machine from the repo root (one call, well under 4 minutes on the H100):
    PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 420 python3 -m benchmarks.transformer_layer_profile_gpu \
        2>&1 | tee $OUT/profile_log.txt
CPU smoke test of the script itself (tiny sizes; cuDNN / Hopper rows report n/a):
    PYTHONPATH=. python -m benchmarks.transformer_layer_profile_gpu --cpu-smoke

Shape (GPU, cases.LAYER_GPU): batch 4 x seq 2048, hidden 4096, 32 heads (head_dim 128), FFN 16384 gelu, causal, bf16
parameters and compute, no bias, no dropout, fused QKV -- as benchmarks/transformer_layer_gpu.py.
One process, fresh random data, every function AOT-compiled once (jit(...).lower().compile()), then
warm-up and the median of >= 10 samples (each sample enqueues `inner` calls and blocks once with
jax.block_until_ready; `inner` is chosen from the first timing so a sample lasts >= ~5 ms).

Sub-blocks, each fwd+bwd (jax.vjp with a random bf16 cotangent; the primal output is returned
too, so the forward is not dead code), te_jax next to the plain-JAX peer of the same math:
  (a) LN + QKV projection (+ split into q, k, v): te LayerNormDenseGeneral + unpack_qkv, backend
      xla (auto on GPU) and pallas; plain: LN, einsum, slices.
  (b) attention alone [B, S, H, D] causal: te pallas (Hopper kernel on sm90), te pallas-portable
      (the Triton-lowered kernel, called directly), te cudnn backend; jax.nn cudnn.
  (c) output projection + residual: te DenseGeneral (this tree) and te DenseGeneral as it was
      before commit "Dense GEMMs output in the compute dtype" (fp32-output dot, monkeypatched);
      plain einsum.
  (d) LN + MLP + residual: te LayerNormMLP backend xla (auto on GPU) and pallas; plain.
  (e) whole layers (loss + value_and_grad, exactly as transformer_layer_gpu.py): te default;
      te with the pre-fix DenseGeneral; te attention_backend="cudnn"; te norm_backend="xla";
      te with every backend as in the plain layer (attention cudnn, norms xla, MLP xla: isolates
      module overhead); the plain-JAX layer with cuDNN attention.
Then, unless --no-trace: a jax.profiler trace of 3 steps of te default and of the plain layer,
summed per HLO op and grouped by sub-block (from the ops' op_name metadata) and fwd/bwd.
Also the optimized HLO of the whole-layer steps: instruction counts outside fusions and every
GEMM custom call with its operand dtypes (an fp32 GEMM shows up there).

Writes to $OUT: profile_table.md (the table, also printed last), profile.json (everything),
hlo.tar.gz (optimized HLO of the whole-layer steps), te_layer.xplane.pb / plain_layer.xplane.pb
(the raw traces, when small enough).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import glob
import importlib
import io
import json
import math
import os
import re
import shutil
import tarfile
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from te_jax import layouts, masks
from te_jax.attention import dot_product_attention
from te_jax.flax import TransformerLayer
from te_jax.flax import module as te_module
from te_jax.flax.module import DenseGeneral, LayerNormDenseGeneral, LayerNormMLP

from benchmarks import cases, timing

AP = argparse.ArgumentParser()
AP.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, to test the script itself")
AP.add_argument("--budget", type=float, default=150.0,
                help="seconds after which the remaining (lower-priority) rows are skipped")
AP.add_argument("--no-trace", action="store_true", help="skip the profiler trace")
AP.add_argument("--layers-only", action="store_true",
                help="whole-layer variants only (more samples, plain timed twice), no sub-blocks")
ARGS = AP.parse_args() if __name__ == "__main__" else AP.parse_args([])  # importable for its helpers
SMOKE = ARGS.cpu_smoke
DATE = str(datetime.date.today())
OUT = os.environ.get("OUT", "/tmp/te_profile_out")
T0 = time.perf_counter()
if SMOKE:
    B, S, HID, HEADS, FFN, N_TIMED, WARM = 2, 128, 128, 2, 256, 10, 1
    PEER = "xla"  # attention implementation of the plain layer (cuDNN needs a GPU)
else:
    (B, S, HID, HEADS, FFN), N_TIMED, WARM = cases.LAYER_GPU, (30 if ARGS.layers_only else 10), 2
    PEER = "cudnn"
HD = HID // HEADS
DT = jnp.bfloat16
EPS = 1e-6
SCALE = 1.0 / math.sqrt(HD)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def over_budget():
    return time.perf_counter() - T0 > ARGS.budget


def _load_layer_bench():
    """benchmarks/transformer_layer_gpu.py (its plain_layer is the peer this script splits up)."""
    return importlib.import_module("benchmarks.transformer_layer_gpu")


# ----------------------------------------------------------------------------- the plain-JAX peer, by sub-block
# Same lines as transformer_layer_gpu.plain_layer, cut into sub-blocks under named scopes (so that
# the trace can attribute its ops); checked equal to plain_layer in --cpu-smoke.


def _ln(x, g, b):
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = ((xf - mu) ** 2).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + EPS) * g.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def plain_qkv(pq, x):
    with jax.named_scope("attention"), jax.named_scope("qkv"):
        h = _ln(x, pq["scale"], pq["ln_bias"])
        qkv = jnp.einsum("bsd,dthk->bsthk", h, pq["kernel"].astype(x.dtype))
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def plain_attn(q, k, v, impl=PEER):
    with jax.named_scope("attention"), jax.named_scope("core"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def plain_out(po, o, x):
    with jax.named_scope("attention"), jax.named_scope("out"):
        return x + jnp.einsum("bshk,hkd->bsd", o, po["kernel"].astype(x.dtype))


def plain_mlp(pm, x):
    with jax.named_scope("mlp"):
        h = _ln(x, pm["scale"], pm["ln_bias"])
        u = jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, pm["wi_kernel"][:, 0].astype(x.dtype)), approximate=True)
        return x + jnp.einsum("bsf,fd->bsd", u, pm["wo_kernel"].astype(x.dtype))


def plain_layer(p, x, impl=PEER):
    a = p["attention"]
    q, k, v = plain_qkv(a["qkv"], x)
    x = plain_out(a["out"], plain_attn(q, k, v, impl), x)
    return plain_mlp(p["mlp"], x)


# ----------------------------------------------------------------------------- te_jax sub-blocks


def te_qkv(pq, x, backend="auto"):
    mod = LayerNormDenseGeneral(features=(3, HEADS, HD), epsilon=EPS, kernel_axes=("embed", "qkv", "heads", "kv"),
                                use_bias=False, dtype=DT, param_dtype=DT, backend=backend)
    qkv, _ = mod.apply({"params": pq}, x)
    return layouts.unpack_qkv(qkv, qkv_layout="bs3hd", num_attention_heads=HEADS, num_gqa_groups=HEADS)


def te_attn(q, k, v, backend="pallas"):
    return dot_product_attention(q, k, v, attn_input_format="bshd", attn_mask_type="causal", scale=SCALE,
                                 backend=backend)


def te_attn_portable(q, k, v):
    """The Triton-lowered Pallas kernel, called as te_jax's pallas backend calls it off sm90."""
    from pallas_kernels import flash_attention as fa

    tm = masks.build_token_mask(masks.MaskSpec("causal"), "bshd", q.shape[0], q.shape[1], k.shape[1])
    out, _ = fa.flash_attention(q, k, v, tm.with_rule(True, (-1, -1)), None, scale=SCALE)
    return out


def te_out(po, o, x):
    mod = DenseGeneral(features=HID, axis=(-2, -1), kernel_axes=("heads", "kv", "embed"), use_bias=False, dtype=DT,
                       param_dtype=DT)
    return mod.apply({"params": po}, o) + x


def te_mlp(pm, x, backend="auto"):
    mod = LayerNormMLP(intermediate_dim=FFN, epsilon=EPS, activations=("gelu",), intermediate_dropout_rate=0.0,
                       dtype=DT, param_dtype=DT, backend=backend)
    y, _ = mod.apply({"params": pm}, x, deterministic=True)
    return y + x


def _dense_prefix(x, kernel, bias, axis, dtype):
    """te_jax.flax.module._dense before the fix: fp32-output dot (its backward GEMMs become fp32)."""
    x = jnp.asarray(x, dtype)
    dtype = x.dtype
    contract = (tuple(axis), tuple(range(len(axis))))
    y = lax.dot_general(x, kernel.astype(dtype), (contract, ((), ())), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


@contextlib.contextmanager
def prefix_dense(on=True):
    old = te_module._dense
    if on:
        te_module._dense = _dense_prefix
    try:
        yield
    finally:
        te_module._dense = old


def make_layer(**kw):
    return TransformerLayer(
        hidden_size=HID, mlp_hidden_size=FFN, num_attention_heads=HEADS, mlp_activations=("gelu",),
        hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0, self_attn_mask_type="causal",
        enable_relative_embedding=False, scale_attn_logits=True, use_bias=False, dtype=DT, param_dtype=DT,
        attn_input_format="bshd", fuse_qkv_params=True, **kw)


# ----------------------------------------------------------------------------- steps, timing, errors


def vjp_step(f):
    """fwd+bwd of f(*args) with a given cotangent: returns (primal output, grads of every argument)."""

    def step(args, ct):
        out, pull = jax.vjp(f, *args)
        return out, pull(ct)

    return step


def loss_step(fwd, ct):
    """As transformer_layer_gpu.make_step: loss = mean(out * ct), value and grads of (params, x)."""

    def loss(p, x):
        return jnp.sum(fwd(p, x).astype(jnp.float32) * ct) / ct.size

    return jax.value_and_grad(loss, argnums=(0, 1))


def compile_fn(fn, args, name, dense_prefix=False):
    """AOT-compile under a unique jit name (it names the HLO module, which the trace summary keys on)."""
    fn.__name__ = fn.__qualname__ = name
    t = time.perf_counter()
    with prefix_dense(dense_prefix):
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t


def bench(compiled, args):
    return timing.measure(compiled, args, samples=N_TIMED, warmup=WARM)


@jax.jit
def _rel_tree(a, b):
    """max over leaves of ||a - b|| / ||b|| (fp32), on the device."""
    errs = [jnp.linalg.norm((x.astype(jnp.float32) - y.astype(jnp.float32)).ravel())
            / (jnp.linalg.norm(y.astype(jnp.float32).ravel()) + 1e-30)
            for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]
    return jnp.max(jnp.stack(errs))


def rel(a, b):
    try:
        return float(_rel_tree(a, b))
    except Exception as e:  # structure mismatch etc.: report, do not stop
        log(f"  (error comparison failed: {type(e).__name__}: {str(e)[:120]})")
        return None


# ----------------------------------------------------------------------------- HLO statistics


_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")


def computations(text):
    """{computation name: its instruction lines} of an HLO module's text."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = _COMP_RE.match(line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
            continue
        if cur is not None and line.strip() == "}":
            cur = None
            continue
        if cur is not None:
            comps[cur].append(line)
    return comps


def hlo_stats(text):
    """Instruction counts outside fusion bodies, custom-call targets, and the GEMM calls with their dtypes."""
    comps = computations(text)
    fused = set(re.findall(r"calls=%?([\w.\-]+)", text)) | set(re.findall(r"to_apply=%?([\w.\-]+)", text))
    ops, targets, gemms, op_names = collections.Counter(), collections.Counter(), collections.Counter(), {}
    comp_op_name, fusion_calls = {}, {}
    for cname, lines in comps.items():
        for line in lines:
            m = _INSTR_RE.match(line)
            if not m:
                continue
            iname, shape, opcode, rest = m.groups()
            meta = re.search(r'op_name="([^"]*)"', line)
            if meta:
                op_names[iname] = meta.group(1)
                if cname not in comp_op_name or line.lstrip().startswith("ROOT"):
                    comp_op_name[cname] = meta.group(1)
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if opcode == "fusion" and called:
                fusion_calls[iname] = called.group(1)
            if cname in fused:
                continue
            ops[opcode] += 1
            if opcode == "custom-call":
                tgt = re.search(r'custom_call_target="([^"]*)"', line)
                tgt = tgt.group(1) if tgt else "?"
                targets[tgt] += 1
                if "gemm" in tgt.lower() or "matmul" in tgt.lower():
                    operands = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", rest.split("), ")[0])
                    out_t = re.match(r"\(?([a-z]+\d*)\[([\d,]*)\]", shape)
                    sig = (f"{out_t.group(1)}[{out_t.group(2)}]" if out_t else shape[:40]) + " <- " + " x ".join(
                        f"{t}[{s}]" for t, s in operands[:2])
                    gemms[sig] += 1
            elif opcode == "fusion":
                kind = re.search(r"kind=(\w+)", line)
                ops["fusion:" + (kind.group(1) if kind else "?")] += 1
                if kind and kind.group(1) == "kCustom" and re.search(r"gemm|cutlass|matmul", line):
                    operands = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", rest.split("), ")[0])
                    out_t = re.match(r"\(?([a-z]+\d*)\[([\d,]*)\]", shape)
                    sig = "fusion " + (f"{out_t.group(1)}[{out_t.group(2)}]" if out_t else shape[:40]) + " <- " + \
                        " x ".join(f"{t}[{s}]" for t, s in operands[:2])
                    gemms[sig] += 1
    for iname, comp in fusion_calls.items():  # a fusion without metadata: take its fused computation's
        if iname not in op_names and comp in comp_op_name:
            op_names[iname] = comp_op_name[comp]
    return {"ops_outside_fusions": dict(ops.most_common()), "custom_call_targets": dict(targets.most_common()),
            "gemms": dict(gemms.most_common())}, op_names


# ----------------------------------------------------------------------------- trace summary


def _region(op_name):
    """Sub-block of an op from its op_name metadata (flax module path or the plain layer's named scopes)."""
    if not op_name:
        return "unattributed", "?"
    phase = "bwd" if "transpose(" in op_name else "fwd"

    def has(word):
        return re.search(rf"(^|[/(]){word}([/)]|$)", op_name) is not None

    if has("qkv"):
        return "(a) LN+QKV", phase
    if has("out"):
        return "(c) out proj", phase
    if has("mlp"):
        return "(d) LN+MLP", phase
    if has("attention") or has("core"):
        return "(b) attention (+split/copies)", phase
    return "other (residual, loss, casts)", phase


def trace_summary(compiled, args, name, n_steps=3):
    """Profile n_steps of `compiled`; per-op device time per step, grouped by sub-block and fwd/bwd."""
    from jax.profiler import ProfileData

    text = compiled.as_text()
    _, op_names = hlo_stats(text)
    mod_name = re.search(r"HloModule\s+([\w.\-]+)", text)
    mod_name = mod_name.group(1) if mod_name else ""
    by_norm = {k.replace(".", "_").replace("-", "_"): k for k in op_names}
    d = tempfile.mkdtemp(prefix=f"trace_{name}_")
    jax.block_until_ready(compiled(*args))
    with jax.profiler.trace(d):
        for _ in range(n_steps):
            jax.block_until_ready(compiled(*args))
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {"error": "no xplane.pb written"}, None
    pd = ProfileData.from_file(files[0])
    dev_planes = [p for p in pd.planes if p.name.startswith("/device:")]
    planes = dev_planes or [p for p in pd.planes if p.name.startswith("/host:CPU")]
    events = []  # (module, op or None, kernel name, ns per step)
    source = "?"
    for p in planes:
        lines = list(p.lines)
        xla_ops = [ln for ln in lines if ln.name == "XLA Ops"]
        use = xla_ops or [ln for ln in lines if ln.name not in ("XLA Modules", "Steps", "Launch Stats", "python")]
        source = "XLA Ops line" if xla_ops else "kernel events"
        for ln in use:
            for e in ln.events:
                stats = {}
                try:
                    stats = {str(k): v for k, v in e.stats}
                except Exception:
                    pass
                joined = " ".join(str(v) for v in stats.values())
                mod = stats.get("hlo_module")
                if mod is None:
                    m = re.search(r"hlo_module=([\w.\-]+)", joined)
                    mod = m.group(1) if m else ""
                op = stats.get("hlo_op")
                if op is None and xla_ops:
                    op = e.name
                if op is None:
                    m = re.search(r"hlo_op=([\w.\-]+)", joined)
                    op = m.group(1) if m else by_norm.get(e.name.replace(".", "_").replace("-", "_"))
                if not dev_planes and op is None:
                    continue  # host threads: only XLA thunks
                events.append((str(mod), None if op is None else str(op), e.name, float(e.duration_ns) / n_steps))
    mine = [ev for ev in events if not ev[0] or not mod_name or mod_name in ev[0] or ev[0] in mod_name]
    module_filter = "events of this module (or without a module)"
    if not mine:  # module names did not match: keep everything in the trace window (only this step ran)
        mine, module_filter = events, "all events (module names did not match)"
    per_op, per_kernel = collections.Counter(), collections.Counter()
    for _, op, kname, ns in mine:
        per_kernel[kname] += ns
        per_op[op if op is not None else "?kernel:" + kname[:80]] += ns
    regions = collections.Counter()
    for op, ns in per_op.items():
        r, ph = _region(op_names.get(op))
        regions[f"{r} {ph}"] += ns
    top = [{"op": op, "us": ns / 1e3, "op_name": (op_names.get(op) or "")[-140:]}
           for op, ns in per_op.most_common(15)]
    res = {"module": mod_name, "source": source, "filter": module_filter,
           "device_ms_per_step": sum(per_op.values()) / 1e6,
           "regions_ms": {k: v / 1e6 for k, v in sorted(regions.items())}, "top_ops": top,
           "top_kernels_us": {k[:120]: v / 1e3 for k, v in per_kernel.most_common(15)},
           "all_ops_us": {op: ns / 1e3 for op, ns in per_op.items()}}
    return res, (files[0], d)


# ----------------------------------------------------------------------------- main


def main():
    dev = jax.devices()[0]
    log(f"date {DATE}  device {dev.device_kind}  platform {dev.platform}  jax {jax.__version__}"
        + ("  [CPU SMOKE: tiny sizes, timings meaningless]" if SMOKE else ""))
    log(f"shape: batch {B} x seq {S}, hidden {HID}, heads {HEADS} (head_dim {HD}), FFN {FFN}, causal, bf16; "
        f"peer attention '{PEER}'")
    os.makedirs(OUT, exist_ok=True)
    keys = iter(jax.random.split(jax.random.key(0), 32))

    def rnd(shape, dtype=DT):
        return jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)

    layer = make_layer()
    x = rnd((B, S, HID))
    params = jax.jit(lambda k: nn.meta.unbox(layer.init(k, x[:1, :128], deterministic=True))["params"])(next(keys))
    pa, pm = params["attention"], params["mlp"]

    if not SMOKE:  # bring the clocks up (the card idles at a low clock)
        a = rnd((8192, 8192))
        mm = jax.jit(lambda a: a @ a)
        t = time.perf_counter()
        while time.perf_counter() - t < 2.0:
            jax.block_until_ready(mm(a))
        del a

    if SMOKE:  # the split-up peer is the peer of transformer_layer_gpu.py
        tlg = _load_layer_bench()
        ref = tlg.plain_layer(params, x, "xla")
        mine = plain_layer(params, x, "xla")
        assert bool(jnp.all(ref == mine)), "plain_layer split by sub-block differs from transformer_layer_gpu's"
        log("check: the sub-block split of the plain layer equals transformer_layer_gpu.plain_layer (bitwise)")

    rows = []
    compiled_layers = {}

    def save_partial():  # rows so far, in case the run is cut short (the final JSON replaces this file)
        with open(os.path.join(OUT, "profile.json"), "w") as f:
            json.dump({"partial": True, "device": dev.device_kind, "jax": jax.__version__, "rows": rows}, f,
                      indent=1, default=str)

    def run(block, impl, fn, args, peer_of=None, side="te", dense_prefix=False, keep=False, note=""):
        """Compile, time, compare with the block's plain result; record a row."""
        save_partial()
        row = dict(block=block, impl=impl, side=side, ms=None, note=note)
        rows.append(row)
        if over_budget():
            row["note"] = "skipped: time budget"
            log(f"{block} | {impl}: skipped (budget)")
            return None
        try:
            name = re.sub(r"\W+", "_", f"{side}_{block}_{impl}")[:60]
            compiled, ct = compile_fn(fn, args, name, dense_prefix)
            med, best, out = bench(compiled, args)
        except Exception as e:
            row["note"] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
            log(f"{block} | {impl}: {row['note']}")
            return None
        row.update(ms=med * 1e3, best_ms=best * 1e3, compile_s=ct)
        if peer_of is not None:
            row["rel_err_vs_plain"] = rel(out, peer_of)
        log(f"{block} | {impl}: {med * 1e3:.3f} ms (best {best * 1e3:.3f}, compile {ct:.1f} s)"
            + (f", rel.err vs plain {row['rel_err_vs_plain']:.2e}" if row.get("rel_err_vs_plain") is not None else ""))
        if keep:
            compiled_layers[impl] = compiled
        return out

    # (e) whole layers first: the headline numbers.
    ct = jax.random.normal(next(keys), (B, S, HID), jnp.float32)
    L = "(e) whole layer"
    plain_res = run(L, f"plain JAX, {PEER} attention", loss_step(lambda p, x: plain_layer(p, x), ct), (params, x),
                    side="plain", keep=True)
    te_fwd = lambda lay: (lambda p, x: lay.apply({"params": p}, x, deterministic=True))
    te_res = run(L, "te default (auto backends)", loss_step(te_fwd(layer), ct), (params, x), plain_res, keep=True)
    run(L, "te default, pre-fix DenseGeneral (fp32-output dot)", loss_step(te_fwd(layer), ct), (params, x),
        plain_res, dense_prefix=True, keep=True)
    del te_res

    if ARGS.layers_only:  # whole layers only, more samples, the plain layer timed again (noise check)
        for impl, lay in (("te mlp_backend='xla'", make_layer(mlp_backend="xla")),
                          ("te norm_backend='xla', mlp_backend='xla'", make_layer(norm_backend="xla", mlp_backend="xla")),
                          (f"te attention_backend={PEER!r}", make_layer(attention_backend=PEER)),
                          (f"te all backends as plain (attention {PEER}, norm xla, mlp xla)",
                           make_layer(attention_backend=PEER, norm_backend="xla", mlp_backend="xla"))):
            run(L, impl, loss_step(te_fwd(lay), ct), (params, x), plain_res)
        run(L, f"plain JAX, {PEER} attention (again)", loss_step(lambda p, x: plain_layer(p, x), ct), (params, x),
            side="plain")
    else:
        # (b) attention alone.
        q, k, v, do = (rnd((B, S, HEADS, HD)) for _ in range(4))
        Bk = "(b) attention"
        pb = run(Bk, f"jax.nn {PEER}", vjp_step(lambda q, k, v: plain_attn(q, k, v)), ((q, k, v), do), side="plain")
        run(Bk, "te pallas (Hopper on sm90)", vjp_step(te_attn), ((q, k, v), do), pb)
        run(Bk, "te cudnn backend", vjp_step(lambda q, k, v: te_attn(q, k, v, "cudnn")), ((q, k, v), do), pb)
        run(Bk, "te pallas-portable (Triton)", vjp_step(te_attn_portable), ((q, k, v), do), pb)
        del pb

        # (c) output projection + residual.
        o = rnd((B, S, HEADS, HD))
        dy = rnd((B, S, HID))
        Ck = "(c) out proj + residual"
        pc = run(Ck, "plain einsum", vjp_step(plain_out), ((pa["out"], o, x), dy), side="plain")
        run(Ck, "te DenseGeneral", vjp_step(te_out), ((pa["out"], o, x), dy), pc)
        run(Ck, "te DenseGeneral pre-fix (fp32-output dot)", vjp_step(te_out), ((pa["out"], o, x), dy), pc,
            dense_prefix=True)
        del pc

        # (d) LN + MLP + residual.
        Dk = "(d) LN + MLP + residual"
        pdm = run(Dk, "plain", vjp_step(plain_mlp), ((pm, x), dy), side="plain")
        run(Dk, "te LayerNormMLP xla (auto on GPU)", vjp_step(lambda p, x: te_mlp(p, x, "xla")), ((pm, x), dy), pdm)
        run(Dk, "te LayerNormMLP pallas", vjp_step(lambda p, x: te_mlp(p, x, "pallas")), ((pm, x), dy), pdm)
        del pdm

        # (a) LN + QKV projection + split.
        cq = tuple(rnd((B, S, HEADS, HD)) for _ in range(3))
        Ak = "(a) LN + QKV + split"
        pq_ = run(Ak, "plain", vjp_step(plain_qkv), ((pa["qkv"], x), cq), side="plain")
        run(Ak, "te LayerNormDenseGeneral xla (auto on GPU)", vjp_step(lambda p, x: te_qkv(p, x, "xla")),
            ((pa["qkv"], x), cq), pq_)
        run(Ak, "te LayerNormDenseGeneral pallas", vjp_step(lambda p, x: te_qkv(p, x, "pallas")), ((pa["qkv"], x), cq),
            pq_)
        del pq_

        # (e) the remaining whole-layer variants. A variant whose jaxpr equals one already timed is the same
        # program: its row takes that time instead of another whole-layer compile.
        def jaxpr_of(fn):
            try:
                return str(jax.make_jaxpr(fn)(params, x))
            except Exception:
                return None

        timed = {"te default (auto backends)": jaxpr_of(loss_step(te_fwd(layer), ct))}
        variants = [(f"te attention_backend={PEER!r}", make_layer(attention_backend=PEER)),
                    ("te norm_backend='xla'", make_layer(norm_backend="xla")),
                    (f"te all backends as plain (attention {PEER}, norm xla, mlp xla)",
                     make_layer(attention_backend=PEER, norm_backend="xla", mlp_backend="xla"))]
        for impl, lay in variants:
            fn = loss_step(te_fwd(lay), ct)
            jp = jaxpr_of(fn)
            same = next((k for k, v in timed.items() if jp is not None and v == jp), None)
            prev = next((r for r in rows if r["block"] == L and r["impl"] == same), None)
            if prev is not None and prev["ms"] is not None:
                rows.append(dict(block=L, impl=impl, side="te", ms=prev["ms"], best_ms=prev.get("best_ms"),
                                 rel_err_vs_plain=prev.get("rel_err_vs_plain"),
                                 note=f"same jaxpr as '{same}': same program, its time (not re-compiled)"))
                log(f"{L} | {impl}: same jaxpr as '{same}', not re-compiled")
                continue
            run(L, impl, fn, (params, x), plain_res)
            timed[impl] = jp
    del plain_res

    # HLO statistics of the whole-layer steps; the trace.
    results = {"date": DATE, "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
               "smoke": SMOKE, "shape": dict(batch=B, seq=S, hidden=HID, heads=HEADS, head_dim=HD, ffn=FFN),
               "peer_attention": PEER, "n_timed": N_TIMED, "rows": rows, "hlo": {}, "trace": {}}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for impl, c in compiled_layers.items():
            text = c.as_text()
            try:
                stats, _ = hlo_stats(text)
            except Exception as e:
                stats = {"error": f"{type(e).__name__}: {e}", "gemms": {}, "ops_outside_fusions": {}}
            results["hlo"][impl] = stats
            data = text.encode()
            info = tarfile.TarInfo(re.sub(r"\W+", "_", impl)[:60] + ".hlo.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with open(os.path.join(OUT, "hlo.tar.gz"), "wb") as f:
        f.write(buf.getvalue())
    for impl, st in results["hlo"].items():
        log(f"HLO {impl}: gemms {st['gemms']}")
        log(f"    ops outside fusions {dict(list(st['ops_outside_fusions'].items())[:12])}")

    if not ARGS.no_trace:
        for tag, impl, fname in (("te", "te default (auto backends)", "te_layer.xplane.pb"),
                                 ("plain", f"plain JAX, {PEER} attention", "plain_layer.xplane.pb")):
            c = compiled_layers.get(impl)
            if c is None:
                continue
            try:
                summ, paths = trace_summary(c, (params, x), tag)
            except Exception as e:
                summ, paths = {"error": f"{type(e).__name__}: {str(e)[:200]}"}, None
            results["trace"][tag] = summ
            if paths:
                if os.path.getsize(paths[0]) < 15 * 2 ** 20:
                    shutil.copy(paths[0], os.path.join(OUT, fname))
                shutil.rmtree(paths[1], ignore_errors=True)
            log(f"trace {tag}: {json.dumps(summ.get('regions_ms', summ))}")
            for o in summ.get("top_ops", [])[:10]:
                log(f"    {o['us']:9.1f} us  {o['op'][:40]:40s} {o['op_name'][-90:]}")

    # The table.
    md = [f"## TransformerLayer fwd+bwd profile — {DATE}, {dev.device_kind}, jax {jax.__version__}"
          + (" (CPU smoke, tiny sizes: timings meaningless)" if SMOKE else ""),
          "",
          f"batch {B} x seq {S}, hidden {HID}, {HEADS} heads (head_dim {HD}), FFN {FFN} gelu, causal, bf16, no bias; "
          f"median of {N_TIMED} samples (each `inner` back-to-back calls, one block) after {WARM + 1} warm-up calls. "
          f"te/plain = te_jax ms / plain ms of the same block (< 1: te_jax faster).",
          "",
          "| block | implementation | ms | te/plain | rel. err vs plain | note |",
          "|---|---|---|---|---|---|"]
    plain_ms = {r["block"]: r["ms"] for r in rows if r["side"] == "plain"}
    for r in rows:
        ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
        pm_ = plain_ms.get(r["block"])
        ratio = "" if (r["side"] == "plain" or r["ms"] is None or not pm_) else f"{r['ms'] / pm_:.3f}"
        err = r.get("rel_err_vs_plain")
        md.append(f"| {r['block']} | {r['impl']} | {ms} | {ratio} | {'' if err is None else f'{err:.1e}'} | "
                  f"{r['note']} |")

    def pick(block, impl):
        return next((r["ms"] for r in rows if r["block"] == block and r["impl"] == impl), None)

    if ARGS.layers_only:  # no sub-blocks were timed
        te_parts = pl_parts = [None]
    else:
        te_parts = [pick(Ak, "te LayerNormDenseGeneral xla (auto on GPU)"), pick(Bk, "te pallas (Hopper on sm90)"),
                    pick(Ck, "te DenseGeneral"), pick(Dk, "te LayerNormMLP xla (auto on GPU)")]
        pl_parts = [plain_ms.get(b) for b in (Ak, Bk, Ck, Dk)]
    if all(t is not None for t in te_parts + pl_parts):
        ts, ps = sum(te_parts), sum(pl_parts)
        md.append(f"| sum (a)+(b)+(c)+(d) | te defaults / plain | {ts:.3f} / {ps:.3f} | {ts / ps:.3f} | | "
                  "sub-blocks timed alone |")
    for tag, summ in results["trace"].items():
        if "regions_ms" not in summ:
            continue
        md.append("")
        md.append(f"Trace, {tag} ({summ['source']}; device ms per step, total {summ['device_ms_per_step']:.3f}): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in summ["regions_ms"].items()))
    text = "\n".join(md)
    with open(os.path.join(OUT, "profile_table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(OUT, "profile.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    log(f"total {time.perf_counter() - T0:.1f} s; files in {OUT}: {sorted(os.listdir(OUT))}")
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
