"""Where the Hopper data-mask kernels spend their time: forward and forward+backward on prebuilt tables (so the
XLA pre-pass is timed apart), with the backward's dQ accumulated in the dK/dV kernel (atomic) or by the dQ
kernel, for documents, padding and plain causal given as data; then the pre-pass (mask_tables) alone.
bf16 hd128, B4 x 4k, 16 heads, causal.  GPU only.

    PYTHONPATH=. python3 -m benchmarks.hopper_mask_probe
    PYTHONPATH=. python3 -m benchmarks.hopper_mask_probe --split-ab [--rounds 5]
    PYTHONPATH=. python3 -m benchmarks.hopper_mask_probe --aligned-ab [--rounds 5]
    XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python3 -m benchmarks.hopper_mask_probe --prepass
    PYTHONPATH=. python3 -m benchmarks.hopper_mask_probe --band-ab [--rounds 5] [--device-time] [--configs ...]
    XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python3 -m benchmarks.hopper_mask_probe \
        --band-fwd-scaling [--rounds 10]

--band-ab: windows, bottom-right and causal given as data (one segment, positions = token indices): the backward
on the data-mask tables against the band backward (MaskRule.offset: no tables), with the atomic dQ and the dQ
kernel; kernels on prebuilt tables (--configs adds variants, e.g. the persistent dK/dV kernel:
"persistent:bwd_persistent_band=True,bwd_dq_atomic=False").  --band-fwd-ab: their forward as a call runs it, the
data-mask forward with its pre-pass against the band forward (no pre-pass), on its grid and on the persistent grid
(HopperConfig.fwd_persistent_band).  --band-fwd-scaling: the band forward's cost per query tile and per key-block
step, fitted from windows (W, W) of six widths, grid and persistent kernels (device clock).  --kernel-trace DIR:
the same kernels' phases per tile (Q wait, first K wait, steps, epilogue) from Mosaic GPU's in-kernel profiler.
--rendezvous-ab: the data-mask forward's warpgroups meeting on the named barrier or on mbarriers, on documents and
padding (prebuilt tables).  --dense-rendezvous-ab: the same choice on the dense forwards (no mask, causal and not;
1k, 4k and 16k tokens per row, 16384 tokens per call; head dims 64, 128, 256 and 192/128).

--aligned-margin: the aligned forward's static tile count against smaller margins (device clock).
--aligned-ab: hopper_attention on documents with the forward's tiles on the global grid against tiles that start
at every document (mask_aligned=True), and with the backward's on them too (HopperConfig.bwd_aligned); pre-pass and
merges included; forward and forward+backward.
--split-ab: the data-mask forward and backward with their partial tiles split by what their element mask compares
(positions only, segments only, both: data_mask.MaskRule.partial_rules) against one group under the whole rule
(MaskRule.split False), on prebuilt tables, interleaved rounds; thd's 11 documents, 4 documents per row, padding,
causal as data.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from pallas_kernels.flash_attention_hopper import hopper_attention
from pallas_kernels.flash_attention_hopper.backward import flash_bwd
from pallas_kernels.flash_attention_hopper.config import default_config
from pallas_kernels.flash_attention_hopper.data_mask import mask_rule, mask_tables
from pallas_kernels.flash_attention_hopper.forward import flash_fwd
from pallas_kernels.mask import AttentionMask

B, S, H, D = 4, 4096, 16, 128


def mixed_lengths(total: int, seed: int = 0, median: int = 490):
    """Document lengths that fill `total` tokens, drawn log-normal (median 490 tokens, mean about 800, clipped to
    16-8192; the last one cut to fit), a stand-in for a packed pretraining corpus."""
    rng, lens = np.random.default_rng(seed), []
    while sum(lens) < total:
        lens.append(int(np.clip(rng.lognormal(np.log(median), 1.0), 16, 8192)))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def probe_masks(*names):
    """The probe's masks by name (causal): "thd" (11 documents in 16k tokens, one row), "documents" (4 per row,
    B x S), "padding" (rows 4096/3000/2048/3500), "causal as data", "64x256" / "80x200" (equal documents, 16k),
    "mixed" (mixed_lengths: log-normal document lengths in 16k, as packed corpora have), "mixed_short" (the same
    with median 300: more documents than the aligned tiles' margin n / 4 leaves room for)."""
    from benchmarks.attention_masks_gpu import THD_DOCS

    runs = lambda lens, total: np.pad(np.repeat(np.arange(1, len(lens) + 1), lens), (0, total - sum(lens)))[None]
    build = {
        "thd": lambda: AttentionMask.from_segments(runs(THD_DOCS, 16384), causal=True),
        "documents": lambda: AttentionMask.from_segments(runs([1500, 1000, 1096, 500], S).repeat(B, 0), causal=True),
        "padding": lambda: AttentionMask.from_segments(
            (np.arange(S)[None] < np.array([4096, 3000, 2048, 3500])[:, None]).astype(np.int32), causal=True),
        "causal as data": lambda: AttentionMask.full(B, S, S, causal=True),
        "64x256": lambda: AttentionMask.from_segments(runs([256] * 64, 16384), causal=True),
        "80x200": lambda: AttentionMask.from_segments(runs([200] * 80, 16384), causal=True),
        "mixed": lambda: AttentionMask.from_segments(runs(mixed_lengths(16384), 16384), causal=True),
        "mixed_short": lambda: AttentionMask.from_segments(runs(mixed_lengths(16384, median=300), 16384),
                                                           causal=True),
    }
    return {name: build[name]() for name in names}


def main():
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
    base = default_config(D, S, False, S)
    masks = probe_masks("documents", "padding", "causal as data")
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  B{B} S{S} H{H} D{D}")
    for name, m in masks.items():
        vis = int(jnp.sum(m.dense()))
        fl = 4 * H * D * vis
        rule = mask_rule(m)
        for atomic, bkv in ((None, 128), (None, 64), (True, 128)):
            cfg = dataclasses.replace(base, bwd_dq_atomic=atomic, block_kv=bkv)
            t = jax.jit(lambda m: mask_tables(m, cfg))(m)
            kw = dict(scale=D ** -0.5, causal=False, config=cfg, mask_tables=t, mask_rule=rule)
            fwd = jax.jit(lambda q, k, v: flash_fwd(q, k, v, **kw))
            out, lse = fwd(q, k, v)
            bwd = jax.jit(lambda q, k, v, o, l, do: flash_bwd(q, k, v, o, l, do, **kw))
            tf = timing.measure(fwd, (q, k, v), samples=20)[0]
            tb = timing.measure(bwd, (q, k, v, out, lse, do), samples=20)[0]
            print(f"{name:15s} block_kv {bkv:3d} dQ {'atomic' if atomic else 'kernel':6s} fwd {tf * 1e6:7.1f} us "
                  f"{fl / tf / 1e12:5.0f} TFLOP/s | bwd {tb * 1e6:7.1f} us | fwd+bwd {3.5 * fl / (tf + tb) / 1e12:5.0f}"
                  f" TFLOP/s   (visible steps fwd {int(t.fwd[0][..., -1].sum()) * H}, "
                  f"partial {int(t.fwd[0][..., -2].sum()) * H})", flush=True)
        for which, bw in (("forward's list", False), ("all three lists", True)):
            pre = jax.jit(lambda m: mask_tables(m, base, backward=bw))
            print(f"{name:15s} pre-pass (mask_tables, {which}) {timing.measure(pre, (m,), samples=20)[0] * 1e6:7.1f} us",
                  flush=True)
        whole = jax.jit(lambda q, k, v: hopper_attention(q, k, v, scale=D ** -0.5, mask=m)[0])
        sec = timing.measure(whole, (q, k, v), samples=20)[0]
        print(f"{name:15s} hopper_attention(mask=...) forward, pre-pass included {sec * 1e6:7.1f} us "
              f"{fl / sec / 1e12:5.0f} TFLOP/s", flush=True)
    dense = jax.jit(lambda q, k, v: flash_fwd(q, k, v, scale=D ** -0.5, causal=True, config=base))
    sec = timing.measure(dense, (q, k, v), samples=20)[0]
    print(f"plain causal kernel (persistent schedule) fwd {sec * 1e6:7.1f} us "
          f"{4 * H * D * B * S * (S + 1) / 2 / sec / 1e12:5.0f} TFLOP/s")


def _inputs(m, seed: int):
    """(q, k, v) bf16 [batch, q_len, H, D] for mask m, and the forward's FLOPs on its visible area."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(kk, (m.batch, m.q_len, H, D), jnp.bfloat16) for kk in ks)
    return (q, k, v), 4 * H * D * int(jnp.sum(m.dense()))


def split_ab(rounds: int):
    masks = probe_masks("thd", "documents", "padding", "causal as data")
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  H{H} D{D} bf16; forward on prebuilt tables; "
          f"{rounds} interleaved rounds, medians")
    for name, m in masks.items():
        (q, k, v), fl = _inputs(m, 1)
        cfg = default_config(D, m.kv_len, False, m.q_len)
        do = jax.random.normal(jax.random.key(2), q.shape, jnp.bfloat16)
        fns, outs, groups = {}, {}, ""
        for split in (False, True):
            t = jax.jit(lambda m: mask_tables(m, cfg, split=split))(m)
            kw = dict(scale=D ** -0.5, causal=False, config=cfg, mask_tables=t, mask_rule=mask_rule(m, True, split))
            fwd = jax.jit(lambda q, k, v, kw=kw: flash_fwd(q, k, v, **kw))
            out, lse = fwd(q, k, v)
            bwd = jax.jit(lambda q, k, v, o, l, do, kw=kw: flash_bwd(q, k, v, o, l, do, **kw))
            fns[("fwd", split)] = (fwd, (q, k, v))
            fns[("bwd", split)] = (bwd, (q, k, v, out, lse, do))
            outs[split] = (out,) + tuple(bwd(q, k, v, out, lse, do))
            if split:
                groups = "; ".join(f"{kind} {np.diff(c[:-1], prepend=0).tolist()} + full {int(c[-1] - c[-2])}" for
                                   kind, c in (("fwd", np.asarray(t.fwd[0]).sum((0, 1))),
                                               ("dkv", np.asarray(t.dkv[0]).sum((0, 1)))))
        diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                 for a, b in zip(outs[True], outs[False])]
        secs = {key: [] for key in fns}
        for _ in range(rounds):
            for key, (f, args) in fns.items():
                secs[key].append(timing.measure(f, args, samples=20)[0])
        med = {key: statistics.median(v) for key, v in secs.items()}
        f0, f1, b0, b1 = med[("fwd", False)], med[("fwd", True)], med[("bwd", False)], med[("bwd", True)]
        print(f"{name:18s} fwd: one group {f0 * 1e6:7.1f} us, split {f1 * 1e6:7.1f} us (x{f0 / f1:.3f}, "
              f"{fl / f1 / 1e12:.0f} TFLOP/s) | bwd: {b0 * 1e6:7.1f} us, split {b1 * 1e6:7.1f} us (x{b0 / b1:.3f}) | "
              f"fwd+bwd x{(f0 + b0) / (f1 + b1):.3f} ({3.5 * fl / (f1 + b1) / 1e12:.0f} TFLOP/s) | "
              f"max |diff| out, dq, dk, dv {', '.join(f'{d:.1e}' for d in diffs)}", flush=True)
        print(f"{'':18s} partial groups (positions, segments, both): {groups}", flush=True)


def config_overrides(spec: str) -> dict:
    """"name:k=v,k=v;name2:k=v" -> {name: {k: v}} (values Python literals): HopperConfig variants to time."""
    import ast

    out = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, _, kvs = entry.partition(":")
        out[name.strip()] = {k.strip(): ast.literal_eval(v.strip()) for k, v in
                             (kv.split("=", 1) for kv in kvs.split(",") if kv.strip())}
    return out


def band_ab(rounds: int, device: bool = False, configs: str = ""):
    """One-segment masks whose positions are token indices (windows, bottom-right, causal given as data): the
    backward on the data-mask tables (positions read, dQ kernel) against the band backward (MaskRule.offset: no
    tables, the element mask from iotas) with the atomic dQ (forced) and with the dQ kernel; on prebuilt tables, so
    the pre-pass is not timed; the forward (the same kernel) once for scale; interleaved rounds."""
    cases = band_cases()
    variants = {"tables, dQ kernel": (False, {"bwd_dq_atomic": None}),
                # forced: with None (auto) narrow bands run the dQ kernel, and this row timed the same kernels as the
                # next one (the thirteenth session misread that as the atomic dQ)
                "band, atomic dQ": (True, {"bwd_dq_atomic": True}),
                "band, dQ kernel": (True, {"bwd_dq_atomic": False})}
    variants.update({f"band, {name}": (True, kw) for name, kw in config_overrides(configs).items()})
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  H{H} D{D} bf16; kernels on prebuilt tables; "
          f"{rounds} interleaved rounds, medians")
    for name, (m, offset) in cases.items():
        ks = jax.random.split(jax.random.key(5), 4)
        q, do = (jax.random.normal(kk, (B, m.q_len, H, D), jnp.bfloat16) for kk in ks[:2])
        k, v = (jax.random.normal(kk, (B, m.kv_len, H, D), jnp.bfloat16) for kk in ks[2:])
        fl = 4 * H * D * int(jnp.sum(m.dense()))
        base = default_config(D, m.kv_len, False, m.q_len)
        fns, outs, fwd_fn = {}, {}, None
        for vname, (band, overrides) in variants.items():
            cfg = dataclasses.replace(base, **overrides)
            rule = mask_rule(m, False, offset=offset if band else None)
            t = jax.jit(lambda m: mask_tables(m, cfg, segments=False, backward=not band))(m)
            fkw = dict(scale=D ** -0.5, causal=False, config=cfg, mask_tables=t, mask_rule=rule._replace(offset=None))
            fwd = jax.jit(lambda q, k, v, kw=fkw: flash_fwd(q, k, v, **kw))
            out, lse = fwd(q, k, v)
            fwd_fn = fwd_fn or (fwd, (q, k, v))
            kw = dict(scale=D ** -0.5, causal=False, config=cfg, **(
                dict(band=rule.band()) if band else dict(mask_tables=t, mask_rule=rule)))
            bwd = jax.jit(lambda q, k, v, o, l, do, kw=kw: flash_bwd(q, k, v, o, l, do, **kw))
            fns[vname] = (bwd, (q, k, v, out, lse, do))
            outs[vname] = tuple(bwd(q, k, v, out, lse, do))
        fns["forward"] = fwd_fn
        secs = {key: [] for key in fns}
        for _ in range(rounds):
            for key, (f, args) in fns.items():
                secs[key].append(timing.measure(f, args, samples=20)[0])
        med = {key: statistics.median(v) for key, v in secs.items()}
        tf, b0 = med["forward"], med["tables, dQ kernel"]
        print(f"{name}: forward {tf * 1e6:.1f} us ({fl / tf / 1e12:.0f} TFLOP/s on {fl / 1e9:.0f} GFLOP visible)",
              flush=True)
        for vname in variants:
            b1 = med[vname]
            diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))
                     for a, r in zip(outs[vname], outs["tables, dQ kernel"])]
            print(f"  {vname:18s} bwd {b1 * 1e6:7.1f} us ({2.5 * fl / b1 / 1e12:4.0f} TFLOP/s, x{b0 / b1:.3f}) | "
                  f"fwd+bwd {3.5 * fl / (tf + b1) / 1e12:4.0f} TFLOP/s (x{(tf + b0) / (tf + b1):.3f}) | max |diff| "
                  f"dq, dk, dv {', '.join(f'{d:.1e}' for d in diffs)}", flush=True)
            if device:  # the device clock: each kernel of the backward (dK/dV, dQ, the dQ buffer's passes)
                from benchmarks import device_time
                prof = device_time.profiled(*fns[vname], calls=5)
                top = ", ".join(f"{n} {t * 1e6:.0f}" for n, t in prof["durations"].items())
                print(f"    device: {prof['kernel_s'] * 1e6:.1f} us/call in {prof['kernels_per_call']:.0f} kernels "
                      f"(us: {top})", flush=True)


def band_fwd_ab(rounds: int, configs: str = "", only: str = ""):
    """The forward of one-segment masks with token-index positions as a user's call runs it: the data-mask forward
    with its pre-pass (the forward's tables built in the call; windows on the persistent grid) against the band
    kernel (flash_fwd(band=): no pre-pass, no tables); interleaved rounds.  only: comma-separated prefixes of the
    masks' names (band_cases) to run."""
    masks = {n: c for n, c in (band_cases() | more_windows()).items()
             if not only or any(n.startswith(o.strip()) for o in only.split(","))}
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  H{H} D{D} bf16; forward, pre-pass included; "
          f"{rounds} interleaved rounds, medians")
    for name, (m, offset) in masks.items():
        ks = jax.random.split(jax.random.key(6), 3)
        q = jax.random.normal(ks[0], (B, m.q_len, H, D), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (B, m.kv_len, H, D), jnp.bfloat16) for kk in ks[1:])
        fl = 4 * H * D * int(jnp.sum(m.dense()))
        cfg = default_config(D, m.kv_len, False, m.q_len)
        rule = mask_rule(m, False, offset=offset)
        fns = {
            "tables": jax.jit(lambda q, k, v, m: flash_fwd(
                q, k, v, scale=D ** -0.5, causal=False, config=cfg, mask_rule=rule._replace(offset=None),
                mask_tables=mask_tables(m, cfg, backward=False, segments=False))[0]),
            "band": jax.jit(lambda q, k, v, m: flash_fwd(
                q, k, v, scale=D ** -0.5, causal=False, config=dataclasses.replace(cfg, fwd_persistent_band=False),
                band=rule.band())[0]),
            # the band forward on the persistent grid (HopperConfig.fwd_persistent_band)
            "band, persistent": jax.jit(lambda q, k, v, m: flash_fwd(
                q, k, v, scale=D ** -0.5, causal=False, config=dataclasses.replace(cfg, fwd_persistent_band=True),
                band=rule.band())[0]),
        }
        for cname, kw in config_overrides(configs).items():  # --configs: more band forward variants
            kw = {"fwd_persistent_band": False, **kw}  # the grid kernel unless the variant says
            fns[f"band, {cname}"] = jax.jit(lambda q, k, v, m, c=dataclasses.replace(cfg, **kw): flash_fwd(
                q, k, v, scale=D ** -0.5, causal=False, config=c, band=rule.band())[0])
        outs = {key: f(q, k, v, m) for key, f in fns.items()}
        secs = {key: [] for key in fns}
        for _ in range(rounds):
            for key, f in fns.items():
                secs[key].append(timing.measure(f, (q, k, v, m), samples=20)[0])
        t0 = statistics.median(secs["tables"])
        cells = []
        for key in [key for key in fns if key != "tables"]:
            t1 = statistics.median(secs[key])
            diff = float(jnp.max(jnp.abs(outs[key].astype(jnp.float32) - outs["tables"].astype(jnp.float32))))
            cells.append(f"{key} {t1 * 1e6:7.1f} us ({fl / t1 / 1e12:4.0f} TFLOP/s, x{t0 / t1:.3f}; max |out diff| "
                         f"{diff:.1e})")
        print(f"{name:26s} tables {t0 * 1e6:7.1f} us ({fl / t0 / 1e12:4.0f} TFLOP/s) | " + " | ".join(cells),
              flush=True)


def band_walk_counts(band, q_len: int, kv_len: int, cfg) -> tuple[int, int]:
    """(query tiles, key-block steps) of one (batch, head) under the band forward: its CTAs take 2 x block_q queries
    and walk band.key_blocks of block_kv keys."""
    from pallas_kernels.flash_attention_hopper.band import band_big, key_blocks

    rows, n_kv = 2 * cfg.block_q, kv_len // cfg.block_kv
    big = band_big(band, q_len, kv_len)
    steps = sum(int(key_blocks(band, t * rows, (t + 1) * rows, cfg.block_kv, n_kv, big)[1])
                for t in range(q_len // rows))
    return q_len // rows, steps


def band_fwd_scaling(calls: int, windows=(64, 128, 256, 512, 1024, 2048)):
    """The band forward's kernel time by the device clock against its work: windows (W, W), non-causal, B x S x H,
    on the grid band kernel and the persistent one.  A least-squares fit of time = (tiles * per_tile + steps *
    per_step) / SMs gives each kernel's cost per query tile (prologue, Q load, epilogue, exposed pipeline fill) and
    per key-block step, in SM-microseconds; per_step against the wgmma bound says how close the inner loop runs."""
    from benchmarks import device_time

    sms = getattr(jax.devices()[0], "core_count", None) or 132
    cfg = default_config(D, S, False, S)
    step_flops = 4 * (2 * cfg.block_q) * cfg.block_kv * D  # QK^T and PV of one key block for the CTA's rows
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  B{B} S{S} H{H} D{D} bf16, {sms} SMs; band forward "
          f"kernel time (device clock, {calls} calls); one step = {step_flops / 1e6:.1f} MFLOP, "
          f"{step_flops / (989e12 / sms) * 1e6:.2f} SM-us at 989 TFLOP/s dense peak")
    rows = []
    ks = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
    for w in windows:
        m = AttentionMask.full(B, S, S, window=(w, w))
        band = mask_rule(m, False, offset=0).band()
        tiles, steps = (n * B * H for n in band_walk_counts(band, S, S, cfg))
        cells = {}
        for kname, persistent in (("grid", False), ("persistent", True)):
            c = dataclasses.replace(cfg, fwd_persistent_band=persistent)
            f = jax.jit(lambda q, k, v, c=c: flash_fwd(q, k, v, scale=D ** -0.5, causal=False, config=c,
                                                       band=band)[0])
            prof = device_time.profiled(f, (q, k, v), calls=calls)
            cells[kname] = sum(t for n, t in prof["durations"].items() if "attn_fwd" in n)
        rows.append((w, tiles, steps, cells))
        print(f"window ({w}, {w}): {tiles} tiles, {steps} steps ({steps / tiles:.1f} per tile) | "
              + " | ".join(f"{kname} {t * 1e6:7.1f} us ({4 * D * int(jnp.sum(m.dense())) * H / t / 1e12:4.0f} "
                           f"TFLOP/s)" for kname, t in cells.items()), flush=True)
    x = np.array([[t / sms, s / sms] for _, t, s, _ in rows])
    for kname in ("grid", "persistent"):
        y = np.array([c[kname] * 1e6 for *_, c in rows])
        (per_tile, per_step), *_ = np.linalg.lstsq(x, y, rcond=None)
        worst = float(np.max(np.abs(x @ np.array([per_tile, per_step]) - y) / y))
        print(f"{kname:10s} fit: {per_tile:6.2f} SM-us per tile + {per_step:5.2f} SM-us per step "
              f"(worst row off by {worst:.1%})", flush=True)


def summarize_kernel_trace(path: str) -> dict:
    """One Mosaic GPU profiler trace (common.profiling; Chrome-trace JSON: pid = SM + 1, tid = one CTA's warpgroup,
    B/E events in us) -> {"regions": {name: (count, mean us)}, "tiles_per_trace", "trace_span_us", "sm_gap_us"}:
    each named region's mean time per entry, the mean span of one warpgroup's trace, and on each SM the mean idle time
    between one trace's end and the next trace's start (the grid kernel's CTA turnover; 0 for one CTA per SM)."""
    import collections
    import json

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    open_at, spans = {}, collections.defaultdict(list)
    bounds = {}  # tid -> (pid, first ts, last ts)
    for e in events:
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key] = e["ts"]
        elif key in open_at:
            spans[e["name"]].append(e["ts"] - open_at.pop(key))
        pid, lo, hi = bounds.get(e["tid"], (e["pid"], e["ts"], e["ts"]))
        bounds[e["tid"]] = (pid, min(lo, e["ts"]), max(hi, e["ts"]))
    by_sm = collections.defaultdict(list)
    for pid, lo, hi in bounds.values():
        by_sm[pid].append((lo, hi))
    gaps = []
    for runs in by_sm.values():
        runs.sort()
        gaps += [max(0.0, b[0] - a[1]) for a, b in zip(runs, runs[1:]) if b[0] >= a[1]]
    regions = {name: (len(d), float(np.mean(d))) for name, d in spans.items()}
    n_traces = max(len(bounds), 1)
    return {"regions": regions, "traces": len(bounds),
            "tiles_per_trace": regions.get("steps", (0, 0))[0] / n_traces,
            "trace_span_us": float(np.mean([hi - lo for _, lo, hi in bounds.values()])) if bounds else 0.0,
            "sm_gap_us": float(np.mean(gaps)) if gaps else 0.0}


def kernel_trace(out_dir: str):
    """The band forward's phases inside the kernel (Mosaic GPU's profiler; common.profiling): per query tile, how
    long each compute warpgroup waits for its Q tile and first K block, walks its steps, and stores its output, on
    the grid band kernel and the persistent one, for windows (256, 256) and (1024, 0) causal."""
    import glob
    import os

    from pallas_kernels import _lower_once
    from pallas_kernels.flash_attention_hopper import common

    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  B{B} S{S} H{H} D{D} bf16; band forward phases "
          f"per warpgroup and tile (Mosaic GPU profiler, one call after warm-up; us)")
    ks = jax.random.split(jax.random.key(8), 3)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
    cfg = default_config(D, S, False, S)
    for wname, m in (("window (256, 256)", AttentionMask.full(B, S, S, window=(256, 256))),
                     ("window (1024, 0) causal", AttentionMask.full(B, S, S, causal=True, window=(1024, 0)))):
        band = mask_rule(m, False, offset=0).band()
        for kname, persistent in (("grid", False), ("persistent", True)):
            d = os.path.join(out_dir, f"{wname.split()[1].strip('(),')}_{kname}")
            os.makedirs(d, exist_ok=True)
            c = dataclasses.replace(cfg, fwd_persistent_band=persistent)
            with common.profiling(d), _lower_once.disabled():
                f = jax.jit(lambda q, k, v, c=c: flash_fwd(q, k, v, scale=D ** -0.5, causal=False, config=c,
                                                           band=band)[0])
                for _ in range(3):
                    jax.block_until_ready(f(q, k, v))
            jax.effects_barrier()
            last = sorted(glob.glob(os.path.join(d, "*-trace.json")))[-1]
            t = summarize_kernel_trace(last)
            regions = " | ".join(f"{n} {mean:6.2f} (x{cnt})" for n, (cnt, mean) in sorted(t["regions"].items()))
            print(f"{wname:24s} {kname:10s} {t['traces']} warpgroup traces, {t['tiles_per_trace']:.1f} tiles each, "
                  f"span {t['trace_span_us']:.1f}, SM gap between traces {t['sm_gap_us']:.2f} | {regions}",
                  flush=True)


def rendezvous_ab(rounds: int):
    """The data-mask forward's warpgroups taking turns through the hardware named barrier or mbarriers
    (HopperConfig.fwd_named_barrier), on its grid and on the persistent grid, for thd's 11 documents, 4 documents per
    row and padding; kernels on prebuilt tables, interleaved rounds."""
    variants = {"grid named": dict(fwd_named_barrier=True), "grid auto": {},
                "persistent named": dict(fwd_persistent_masked=True, fwd_named_barrier=True),
                "persistent mbarrier": dict(fwd_persistent_masked=True, fwd_named_barrier=False)}
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  H{H} D{D} bf16; the data-mask forward on prebuilt "
          f"tables; {rounds} interleaved rounds, medians")
    for name, m in probe_masks("thd", "documents", "padding").items():
        (q, k, v), fl = _inputs(m, 3)
        base, rule = default_config(D, m.kv_len, False, m.q_len), mask_rule(m)
        fns = {}
        for vname, kw in variants.items():
            cfg = dataclasses.replace(base, **kw)
            t = jax.jit(lambda m, cfg=cfg: mask_tables(m, cfg, backward=False))(m)
            fns[vname] = jax.jit(lambda q, k, v, cfg=cfg, t=t: flash_fwd(
                q, k, v, scale=D ** -0.5, causal=False, config=cfg, mask_tables=t, mask_rule=rule)[0])
        outs = {n: f(q, k, v).astype(jnp.float32) for n, f in fns.items()}
        secs = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                secs[n].append(timing.measure(f, (q, k, v), samples=20)[0])
        print(f"{name:10s} " + " | ".join(
            f"{n} {statistics.median(t) * 1e6:7.1f} us ({fl / statistics.median(t) / 1e12:4.0f} TFLOP/s; max |diff| "
            f"{float(jnp.max(jnp.abs(outs[n] - outs['grid named']))):.1e})" for n, t in secs.items()), flush=True)


def dense_rendezvous_ab(rounds: int):
    """The dense forwards (persistent non-causal and causal, and the split-head-dim grid kernel) with their
    warpgroups meeting on the named barrier (auto) or on mbarriers (HopperConfig.fwd_named_barrier=False);
    interleaved rounds, medians; TFLOP/s counts 2*B*H*S^2*(D + Dv) (half when causal)."""
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  H{H} bf16, 16384 tokens per call; dense forward, "
          f"{rounds} interleaved rounds, medians")
    rows = [(s, c, 128, 128) for s in (1024, 4096, 16384) for c in (False, True)]
    rows += [(4096, c, d, dv) for d, dv in ((64, 64), (256, 256), (192, 128)) for c in (False, True)]
    for s, causal, d, dv in rows:
        b = 16384 // s
        ks = jax.random.split(jax.random.key(s + d), 3)
        q, k = (jax.random.normal(kk, (b, s, H, d), jnp.bfloat16) for kk in ks[:2])
        v = jax.random.normal(ks[2], (b, s, H, dv), jnp.bfloat16)
        base = default_config(d, s, causal, s, head_dim_v=dv)
        fns = {}
        for vname, named in (("auto", None), ("mbarriers", False), ("named", True)):
            cfg = dataclasses.replace(base, fwd_named_barrier=named)
            fns[vname] = jax.jit(lambda q, k, v, cfg=cfg: flash_fwd(q, k, v, scale=d ** -0.5, causal=causal,
                                                                     config=cfg)[0])
        outs = {n: f(q, k, v).astype(jnp.float32) for n, f in fns.items()}
        secs = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                secs[n].append(timing.measure(f, (q, k, v), samples=20)[0])
        fl = 2 * b * H * s * s * (d + dv) * (0.5 if causal else 1.0)
        med = {n: statistics.median(t) for n, t in secs.items()}
        print(f"S{s:6d} {'causal' if causal else 'full  '} d{d}/{dv}: " + " | ".join(
            f"{n} {med[n] * 1e6:7.1f} us ({fl / med[n] / 1e12:4.0f} TFLOP/s, x{med['auto'] / med[n]:.3f}; max |diff| "
            f"{float(jnp.max(jnp.abs(outs[n] - outs['auto']))):.1e})" for n in fns), flush=True)


def band_cases():
    """One-segment masks with token-index positions: name -> (mask, offset of the query positions)."""
    return {
        "window (1024, 0) causal": (AttentionMask.full(B, S, S, causal=True, window=(1024, 0)), 0),
        "window (256, 256)": (AttentionMask.full(B, S, S, window=(256, 256)), 0),
        "bottom-right 2k x 8k": (AttentionMask.full(B, 2048, 8192, causal=True, bottom_right=True), 8192 - 2048),
        "causal as data": (AttentionMask.full(B, S, S, causal=True), 0),
    }


def more_windows():
    """Further windows for --band-fwd-ab --masks (walks of 3 to 9 key blocks per query tile)."""
    return {f"window ({w}, {w})": (AttentionMask.full(B, S, S, window=(w, w)), 0) for w in (128, 512)} | {
        "window (512, 0) causal": (AttentionMask.full(B, S, S, causal=True, window=(512, 0)), 0)}


def _rebuilt(m):
    """The causal documents mask m built again from its query segment ids inside the traced call (queries and keys
    one array, as te_jax's front door builds them: their tables' shared computations are then merged by XLA)."""
    return AttentionMask.from_segments(m.q_segment_ids, causal=True)


def aligned_ab(rounds: int, device: bool = False, only: str = ""):
    """hopper_attention(mask=...) as a user calls it (the mask built in the call, pre-pass and merges included) on
    the global grid, with the forward on document-aligned tiles (mask_aligned=True) and the grid's backward
    (HopperConfig.bwd_aligned=False), and with the backward on them too (bwd_aligned auto): forward, and
    forward+backward, interleaved rounds."""
    from pallas_kernels.flash_attention_hopper import masked_config

    names = [n for n in ("thd", "documents", "64x256", "80x200", "mixed", "mixed_short")
             if not only or n in only.split(",")]
    masks = probe_masks(*names)
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  H{H} D{D} bf16; hopper_attention with the "
          f"mask (pre-pass included), {rounds} interleaved rounds, medians")
    variants = ("grid", "aligned", "aligned + bwd")
    for name, m in masks.items():
        (q, k, v), fl = _inputs(m, 3)
        fns, outs = {}, {}
        for var in variants:  # the mask is built from its segment ids in the call, as te_jax builds it
            cfg = (dataclasses.replace(masked_config(D, D, m.q_len, m.kv_len), bwd_aligned=False)
                   if var == "aligned" else None)  # "aligned + bwd": bwd_aligned auto
            f = lambda q, k, v, m, var=var, cfg=cfg: hopper_attention(
                q, k, v, scale=D ** -0.5, mask=_rebuilt(m), mask_aligned=var != "grid", config=cfg)[0]
            fns[("fwd", var)] = jax.jit(f)
            fns[("fwd+bwd", var)] = jax.jit(jax.grad(
                lambda q, k, v, m, f=f: jnp.sum(f(q, k, v, m).astype(jnp.float32)), argnums=(0, 1, 2)))
            outs[var] = fns[("fwd", var)](q, k, v, m)
        diff = float(jnp.max(jnp.abs(outs["aligned"].astype(jnp.float32) - outs["grid"].astype(jnp.float32))))
        grads = {var: fns[("fwd+bwd", var)](q, k, v, m) for var in ("grid", "aligned + bwd")}
        gdiff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                    for a, b in zip(grads["grid"], grads["aligned + bwd"]))
        secs = {key: [] for key in fns}
        for _ in range(rounds):
            for key, f in fns.items():
                secs[key].append(timing.measure(f, (q, k, v, m), samples=20)[0])
        med = {key: statistics.median(v) for key, v in secs.items()}

        def cell(p):
            grid = med[(p, "grid")]
            parts = [f"grid {grid * 1e6:7.1f} us"]
            for var in variants[1:]:
                t = med[(p, var)]
                parts.append(f"{var} {t * 1e6:7.1f} us (x{grid / t:.3f}, "
                             f"{(1 if p == 'fwd' else 3.5) * fl / t / 1e12:.0f} TFLOP/s)")
            return f"{p}: " + ", ".join(parts)

        line = " | ".join(cell(p) for p in ("fwd", "fwd+bwd"))
        print(f"{name:20s} {line} | max |out grid - aligned| {diff:.1e}, |grads grid - aligned + bwd| {gdiff:.1e}",
              flush=True)
        if device:  # the device clock: kernel time per call and the costliest kernels
            from benchmarks import device_time
            for (p, var), f in fns.items():
                prof = device_time.profiled(f, (q, k, v, m), calls=5)
                top = ", ".join(f"{n} {t * 1e6:.0f}" for n, t in list(prof["durations"].items())[:8])
                print(f"  {p} {var} device: {prof['kernel_s'] * 1e6:.1f} us/call in "
                      f"{prof['kernels_per_call']:.0f} kernels (us: {top})", flush=True)


def aligned_margin():
    """The aligned forward's static tile count (aligned_tiles.aligned_tile_count: the grid's n tiles + n / 4 for
    the documents; the tiles a row does not use are CTAs that exit at once) against n / 2, n / 8 and n / 16 (a row
    with more documents than that keeps the global grid's tiles in the aligned kernel): the forward
    on prebuilt tables (kernel, merge, lse gather) by the device clock, beside the grid's kernel."""
    from benchmarks import device_time
    from pallas_kernels.flash_attention_hopper import aligned_tiles

    now = aligned_tiles.aligned_tile_count
    counts = {"n/4 (now)": now, "n/2": lambda L, t: -(-L // t) + max(4, -(-L // t) // 2),
              "n/8": lambda L, t: -(-L // t) + max(4, -(-L // t) // 8),
              "n/16": lambda L, t: -(-L // t) + max(2, -(-L // t) // 16)}
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  forward on prebuilt tables, device clock, us per "
          f"call")
    for name, m in probe_masks("thd", "documents", "64x256", "mixed", "mixed_short").items():
        (q, k, v), _ = _inputs(m, 3)
        cfg = default_config(D, m.kv_len, False, m.q_len)
        rule = mask_rule(m)
        tables = {"grid": jax.jit(lambda m: mask_tables(m, cfg, backward=False))(m)}
        for label, count in counts.items():
            aligned_tiles.aligned_tile_count = count
            try:
                tables[label] = jax.jit(lambda m: aligned_tiles.aligned_mask_tables(m, cfg, backward=False))(m)
            finally:
                aligned_tiles.aligned_tile_count = now
        for label, t in tables.items():
            f = jax.jit(lambda q, k, v, t: flash_fwd(q, k, v, scale=D ** -0.5, causal=False, config=cfg,
                                                     mask_tables=t, mask_rule=rule)[0])
            jax.block_until_ready(f(q, k, v, t))
            prof = device_time.profiled(f, (q, k, v, t), calls=10)
            extra = "" if t.aligned is None else (
                f", T {t.aligned.tile_rows.shape[1]}, rows aligned "
                f"{int(((t.aligned.tile_rows * 8) % 128 != 0).any(-1).sum())}/{m.batch}")
            print(f"{name:10s} {label:10s} {prof['kernel_s'] * 1e6:7.1f} us in {prof['kernels_per_call']:.0f} "
                  f"kernels{extra}", flush=True)


def tile_stats():
    """Runs anywhere (no kernel): per head, each kernel's tiles (forward, dQ, dK/dV), their steps (partial: with
    the element mask) and the pairs they compute against the visible pairs, on the global grid and on
    document-aligned tiles, for the document masks.  With a kernel's device time, steps / time is its per-step
    rate."""
    from pallas_kernels.flash_attention_hopper import masked_config
    from pallas_kernels.flash_attention_hopper.aligned_tiles import aligned_backward_tables, aligned_mask_tables
    from pallas_kernels.flash_attention_hopper.data_mask import dkv_tiles, dq_tiles

    print("tiles per head of each kernel: steps (partial), computed pairs, visible / computed")
    for name, m in probe_masks("thd", "documents", "mixed", "mixed_short", "64x256", "80x200").items():
        cfg = masked_config(D, D, m.q_len, m.kv_len)
        visible = int(np.asarray(m.dense()).sum())
        g = jax.jit(lambda m: mask_tables(m, cfg, backward=True))(m)
        a = jax.jit(lambda m: aligned_backward_tables(aligned_mask_tables(m, cfg, backward=False), mask_rule(m),
                                                      cfg))(m)
        kernels = (("fwd", (2 * cfg.block_q, cfg.block_kv), g.fwd, a.aligned),
                   ("dQ", dq_tiles(cfg), g.dq, a.aligned_dq), ("dK/dV", dkv_tiles(cfg), g.dkv, a.aligned_dkv))
        for kernel, (tq, tk), lists, tiles in kernels:
            grid, aligned = np.asarray(lists[0]), np.asarray(tiles.counts)
            used = int((np.asarray(tiles.tile_rows) >= 0).sum())
            cells = []
            for label, c, n in (("grid", grid, grid.shape[0] * grid.shape[1]), ("aligned", aligned, used)):
                steps, partial = int(c[..., -1].sum()), int(c[..., -2].sum())
                cells.append(f"{label} {n} tiles, {steps} steps ({partial} partial), {steps * tq * tk / 1e6:.2f}M "
                             f"pairs, {visible / (steps * tq * tk):.2f}")
            print(f"{name:11s} {kernel:5s} {tq}x{tk}, visible {visible / 1e6:.2f}M | " + " | ".join(cells),
                  flush=True)


def prepass(rounds: int):
    """The XLA pre-pass alone, by the device clock: every kernel of mask_tables (the grid forward's lists),
    aligned_tiles.aligned_mask_tables and the backward's lists, on thd's 11 documents (H16 does not matter here),
    the mask's positions derived from its segment ids in the call (as te_jax does); and the forward+backward tables
    with their lists from list_kernel (HopperConfig.lists_kernel); and the whole forward call, kernel by kernel."""
    import collections

    from benchmarks import device_time
    from pallas_kernels.flash_attention_hopper.aligned_tiles import aligned_backward_tables, aligned_mask_tables

    m = probe_masks("thd")["thd"]
    cfg = dataclasses.replace(default_config(D, m.kv_len, False, m.q_len), lists_kernel=False)
    fns = {"grid forward lists": jax.jit(lambda m: mask_tables(_rebuilt(m), cfg, backward=False)),
           "aligned forward lists": jax.jit(lambda m: aligned_mask_tables(_rebuilt(m), cfg, backward=False)),
           "grid forward + backward lists": jax.jit(lambda m: mask_tables(_rebuilt(m), cfg, backward=True)),
           "aligned forward + aligned backward lists": jax.jit(lambda m: aligned_backward_tables(
               aligned_mask_tables(_rebuilt(m), cfg, backward=False), mask_rule(_rebuilt(m)), cfg))}
    kcfg = dataclasses.replace(cfg, lists_kernel=True)
    fns["aligned forward lists, lists kernel"] = jax.jit(lambda m: aligned_mask_tables(_rebuilt(m), kcfg,
                                                                                       backward=False))
    fns["aligned forward + aligned backward lists, lists kernel"] = jax.jit(lambda m: aligned_backward_tables(
        aligned_mask_tables(_rebuilt(m), kcfg, backward=False), mask_rule(_rebuilt(m)), kcfg))
    fns["grid forward + backward lists, lists kernel"] = jax.jit(lambda m: mask_tables(_rebuilt(m), kcfg,
                                                                                       backward=True))
    fns = {name: (f, (m,)) for name, f in fns.items()}
    q = jax.random.normal(jax.random.key(0), (m.batch, m.q_len, H, D), jnp.float32).astype(jnp.bfloat16)
    fns["the whole forward call (auto)"] = (jax.jit(lambda m, q: hopper_attention(
        q, q, q, scale=D ** -0.5, mask=_rebuilt(m), mask_aligned=True)[0]), (m, q))
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  thd 11 documents in 16384 tokens; device clock")
    for name, (f, args) in fns.items():
        jax.block_until_ready(f(*args))
        prof = device_time.profiled(f, args, calls=rounds)
        per = collections.Counter()
        for start, end, kname in prof["events"]:
            per[kname[:50]] += (end - start) * 1e-3 / rounds
        print(f"{name}: {prof['kernel_s'] * 1e6:.1f} us of kernels in {prof['kernels_per_call']:.0f} per call "
              f"(span {prof['span_s'] * 1e6:.1f} us)", flush=True)
        for kname, us in per.most_common():
            print(f"    {us:7.2f} us  {kname}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--split-ab", action="store_true")
    ap.add_argument("--aligned-ab", action="store_true")
    ap.add_argument("--band-ab", action="store_true", help="one-segment masks: the backward on tables against "
                    "the band backward (MaskRule.offset)")
    ap.add_argument("--configs", default="", help="--band-ab, --band-fwd-ab: more band variants, "
                    "'name:k=v,k=v;name2:k=v' (HopperConfig fields, e.g. 'stages3:bwd_stages=3')")
    ap.add_argument("--kernel-trace", default="", metavar="DIR", help="the band forward's phases per tile from "
                    "Mosaic GPU's in-kernel profiler (traces written under DIR)")
    ap.add_argument("--band-fwd-scaling", action="store_true", help="the band forward's kernel time against "
                    "windows (W, W): a fit of its cost per query tile and per key-block step (device clock)")
    ap.add_argument("--band-fwd-ab", action="store_true", help="one-segment masks: the data-mask forward with its "
                    "pre-pass against the band forward (grid and persistent)")
    ap.add_argument("--rendezvous-ab", action="store_true", help="the data-mask forward's warpgroup rendezvous: "
                    "named barrier or mbarriers, grid and persistent, on documents and padding")
    ap.add_argument("--dense-rendezvous-ab", action="store_true", help="the dense forwards' warpgroup rendezvous: "
                    "named barrier (auto) or mbarriers, hd 64/128/256 and 192/128, 1k-16k")
    ap.add_argument("--tile-stats", action="store_true", help="(any machine) each kernel's tiles, steps and "
                    "computed pairs on the grid and on aligned tiles, for the document masks")
    ap.add_argument("--prepass", action="store_true", help="every kernel of the XLA pre-pass, by the device clock")
    ap.add_argument("--aligned-margin", action="store_true", help="the aligned forward's tile count (idle CTAs) "
                    "against smaller margins, by the device clock")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--masks", default="", help="--band-fwd-ab: prefixes of the masks to run, e.g. \"window\"; "
                    "--aligned-ab: names, e.g. \"64x256,80x200\"")
    ap.add_argument("--device-time", action="store_true", help="--aligned-ab, --band-ab: the device clock's "
                    "kernels too (run with XLA_FLAGS=--xla_gpu_enable_command_buffer= so that each kernel is seen)")
    a = ap.parse_args()
    if a.prepass:
        prepass(a.rounds)
    elif a.aligned_margin:
        aligned_margin()
    elif a.band_ab:
        band_ab(a.rounds, a.device_time, a.configs)
    elif a.band_fwd_ab:
        band_fwd_ab(a.rounds, a.configs, a.masks)
    elif a.band_fwd_scaling:
        band_fwd_scaling(a.rounds)
    elif a.kernel_trace:
        kernel_trace(a.kernel_trace)
    elif a.rendezvous_ab:
        rendezvous_ab(a.rounds)
    elif a.dense_rendezvous_ab:
        dense_rendezvous_ab(a.rounds)
    elif a.tile_stats:
        tile_stats()
    else:
        split_ab(a.rounds) if a.split_ab else aligned_ab(a.rounds, a.device_time, a.masks) if a.aligned_ab else main()
