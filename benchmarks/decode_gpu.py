"""Decode attention: short queries against a KV cache, te_jax against every peer that supports the call.

    bash benchmarks/install_peers.sh; export PYTHONPATH=.:/tmp/site   # carry [".whl"] (FlashAttention-3)
    python3 -m benchmarks.decode_gpu [--rounds 3] [--budget 240] [--configs] [--device-time]

Rows (bf16, head_dim 128, 32 query heads): q 1 and 8 tokens x caches of 8k, 32k, 128k x GQA 32/8 and MHA 32/32 x
batch 1 and 16, the whole cache visible (attn_mask_type "no_mask"), plus a partly filled cache (batch 16, 32k slots,
per-row lengths from 1k to 32k; te_jax and cuDNN take them as kv_seqlens / key_value_seq_lengths), the same cache with
every row filled (given as kv_seqlens too, as the Flax decode path gives it), and a paged cache
(te_jax.paged_decode_attention, 64-key pages shuffled in a pool) against the same cache contiguous.
Implementations:
  te_jax   te_jax.dot_product_attention(backend="auto") (the kernel it takes is printed)
  cudnn    jax.nn.dot_product_attention(implementation="cudnn")
  fa3      flash_attn3_jax.flash_mha (full-cache rows only: it takes no per-row lengths)
Bandwidth: K/V bytes each row must read (its filled part) / time, next to the HBM copy bandwidth measured in the same
process (x * 2 on 4 GiB of bf16: bytes read + written / time). Before timing, te_jax's output is checked against an
fp32 reference on the moderate rows. Timing: `rounds` interleaved rounds of timing.measure's median; the cell is the
median over rounds. `--configs` adds te_jax with other DecodeConfigs on the batch-16 GQA and batch-1 rows (tuning
evidence): the old 264-program split, the shares merged inside the kernel (DecodeConfig.merge "kernel"), and every
row's call with its padding given as segment ids ("te_jax mask rows": the kernel reads [B, Skv] key rows), against
te_jax's own path that builds none (no mask on full caches, the cache lengths on the partly filled row).
`--device-time` adds a second table from the device clock (benchmarks/device_time.profiled: the GPU time of every
kernel and memset one call launches, summed, over 20 profiled calls). It leaves out the host: a call of 10-60 us
(the batch-1 rows) dispatched from Python is bound by dispatch, for every implementation alike, while inside a
jitted decoding step the kernels run back to back. Gaps between one call's own kernels are not counted either.
The script stops starting rows after `--budget` seconds and says so.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp

import te_jax
from benchmarks import attention_hopper_gpu as ahg  # import_fa3, gpu_warmup, rel
from benchmarks import device_time, timing
from benchmarks.peer_rows import save_and_plot

H, D = 32, 128
T0 = time.perf_counter()


def rows():
    out = []
    for sq in (1, 8):
        for b in (16, 1):
            for g in (8, 32):
                for s in (8192, 32768, 131072):
                    out.append((f"q{sq} b{b} {'GQA 32/8' if g == 8 else 'MHA'} cache {s // 1024}k", b, sq, g, s, None))
    out.sort(key=lambda r: (r[2] != 1, r[1] != 16, r[3] != 8))  # the row (q1 b16 GQA) first
    lens = jnp.linspace(1024, 32768, 16).astype(jnp.int32)
    out.insert(3, ("q1 b16 GQA 32/8 cache 32k, rows filled 1k..32k", 16, 1, 8, 32768, lens))
    out.insert(4, ("q1 b16 GQA 32/8 cache 32k, every row filled (kv_seqlens)", 16, 1, 8, 32768,
                   jnp.full((16,), 32768, jnp.int32)))
    return out


def copy_bandwidth():
    x = jnp.ones((2**31,), jnp.bfloat16)  # 4 GiB
    f = jax.jit(lambda x: x * 2)
    t = timing.measure(f, (x,), samples=10)[0]
    del x
    return 2 * 2**31 * 2 / t / 1e12


def makers(sq, g, lens, fa3, configs, mask_rows=False):
    scale = D ** -0.5
    kw = dict(attn_input_format="bshd")
    if lens is not None:
        kw.update(attn_mask_type="padding", q_seqlens=jnp.ones_like(lens) * sq, kv_seqlens=lens)
    impls = {"te_jax": jax.jit(lambda q, k, v: te_jax.dot_product_attention(q, k, v, scale=scale, **kw))}
    for name, cfg in configs.items():
        impls[name] = jax.jit(lambda q, k, v, cfg=cfg: te_jax.dot_product_attention(q, k, v, scale=scale, config=cfg,
                                                                                       backend="pallas", **kw))
    if mask_rows:  # the same call with its padding as segment ids, which the decode kernel reads as [B, Skv] key
        # rows: A/B of the no-mask path (full-cache rows: flash_decode's mask None) and of the cache-lengths path
        # (kv_seqlens: flash_decode_cache); neither builds key rows or block classes around the kernel
        def as_segments(q, k, v):
            filled = k.shape[1] if lens is None else lens[:, None]
            kv_seg = (jnp.arange(k.shape[1])[None] < filled).astype(jnp.int32)
            return te_jax.dot_product_attention(
                q, k, v, scale=scale, attn_input_format="bshd", attn_mask_type="padding",
                q_segment_ids=jnp.ones(q.shape[:2], jnp.int32), kv_segment_ids=jnp.broadcast_to(kv_seg, k.shape[:2]))
        impls["te_jax mask rows"] = jax.jit(as_segments)
    if lens is None:
        impls["cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale,
                                                                              implementation="cudnn"))
        if fa3 is not None:
            impls["fa3"] = jax.jit(lambda q, k, v: fa3.flash_mha(q, k, v, softmax_scale=float(scale), is_causal=False))
    else:
        impls["cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, query_seq_lengths=jnp.ones_like(lens) * sq, key_value_seq_lengths=lens,
            implementation="cudnn"))
    return impls, kw


def drop_failing(impls, *args):
    """Run each implementation once (compiling it); one that cannot serve the row is reported and dropped."""
    for name in list(impls):
        try:
            jax.block_until_ready(impls[name](*args))
        except Exception as e:  # noqa: BLE001  (a peer that cannot serve the row is reported, not fatal)
            print(f"  {name}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
            impls.pop(name)
    return impls


def reference(q, k, v, lens):
    """fp32 output (every query sees the row's first lens[b] keys, or the whole cache)."""
    rep = q.shape[2] // k.shape[2]
    f32 = lambda x: x.astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", f32(q), jnp.repeat(f32(k), rep, axis=2)) * D ** -0.5
    if lens is not None:
        s = jnp.where(jnp.arange(k.shape[1])[None, None, None, :] < lens[:, None, None, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), jnp.repeat(f32(v), rep, axis=2))


def paged_row(rounds, cpu_smoke=False):
    """The paged cache (te_jax.paged_decode_attention, backend="pallas") against the same cache contiguous (the
    decode kernel through dot_product_attention) and the xla gather path: output check and TB/s."""
    b, g, s, page = (2, 8, 512, 64) if cpu_smoke else (16, 8, 32768, 64)
    n_pages = s // page
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (b, 1, H, D), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (b, s, g, D), jnp.bfloat16) for kk in ks[1:])
    perm = jax.random.permutation(jax.random.key(8), b * n_pages)
    pool = lambda x: jnp.zeros((b * n_pages, page, g, D), x.dtype).at[perm].set(x.reshape(b * n_pages, page, g, D))
    kp, vp, table = pool(k), pool(v), perm.reshape(b, n_pages)
    lens = jnp.full((b,), s, jnp.int32)
    impls = {
        "te_jax paged (pallas)": jax.jit(lambda q, kp, vp: te_jax.paged_decode_attention(
            q, kp, vp, table, lens, backend="pallas")),
        "te_jax paged (xla gather)": jax.jit(lambda q, kp, vp: te_jax.paged_decode_attention(
            q, kp, vp, table, lens, backend="xla")),
    }
    contiguous = jax.jit(lambda q: te_jax.dot_product_attention(q, k, v, attn_input_format="bshd",
                                                                 attn_mask_type="padding_causal_bottom_right",
                                                                 q_seqlens=jnp.ones((b,), jnp.int32), kv_seqlens=lens))
    ref = contiguous(q).astype(jnp.float32)
    for name, f in impls.items():
        print(f"  {name} vs contiguous te_jax: rel {ahg.rel(f(q, kp, vp).astype(jnp.float32), ref):.2e}", flush=True)
    nbytes = 2 * b * s * g * D * 2
    times = {n: [] for n in list(impls) + ["te_jax contiguous"]}
    for _ in range(rounds):
        for n, f in impls.items():
            times[n].append(timing.measure(f, (q, kp, vp), samples=10)[0])
        times["te_jax contiguous"].append(timing.measure(contiguous, (q,), samples=10)[0])
    cells = " | ".join(f"{n} {nbytes / statistics.median(t) / 1e12:.2f}" for n, t in times.items())
    return f"| q1 b{b} GQA 32/8 cache {s // 1024}k, paged ({page}-key pages, shuffled) | {cells} | - | - |"


def device_row(name, impls, args, nbytes, copy):
    """A table line of TB/s by the device clock (device_time.profiled's kernel_s) for each implementation."""
    tb = {}
    for iname, f in impls.items():
        prof = device_time.profiled(f, args, calls=20)
        tb[iname] = nbytes / prof["kernel_s"] / 1e12
        print(f"  {iname} device: {prof['kernel_s'] * 1e6:.1f} us/call in {prof['kernels_per_call']:.0f} kernels "
              f"({', '.join(f'{n} {t * 1e6:.1f}' for n, t in prof['durations'].items())})", flush=True)
    peers = [i for i in impls if not i.startswith("te_jax")]
    best = max(peers, key=tb.get) if peers else None
    ratio = f"{tb['te_jax'] / tb[best]:.2f} of {best}" if best and "te_jax" in tb else "-"
    copy_frac = f"{tb['te_jax'] / copy:.2f}" if "te_jax" in tb else "-"
    return f"| {name} | {' | '.join(f'{i} {tb[i]:.2f}' for i in impls)} | {ratio} | {copy_frac} |"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--configs", action="store_true",
                    help="also time DecodeConfig(min_programs=264), the default before the split sweep "
                         "(benchmarks/decode_splits_gpu.py), on the batch-16 GQA and the batch-1 rows")
    ap.add_argument("--device-time", action="store_true",
                    help="also a table of TB/s by the device clock (the GPU time of each call's kernels, summed)")
    ap.add_argument("--uneven-factors", default="",
                    help="comma-separated factors: on the rows given by kv_seqlens, te_jax with "
                         "DecodeConfig(uneven_split_factor=N) for each (4 is the default, 1: no extra shares), and "
                         "DecodeConfig(min_programs=512, uneven_split_factor=1) (4 shares on every row)")
    ap.add_argument("--shares-first", action="store_true",
                    help="on every row, te_jax with DecodeConfig(shares_last=False) (the grid's share axis fastest, "
                         "the order before 2026-11-27), and with --uneven-factors each factor in that order too")
    ap.add_argument("--rows", default="", help="comma-separated substrings: only the rows whose name holds one "
                                               "(the paged row: 'paged')")
    ap.add_argument("--cpu-smoke", action="store_true", help="two tiny rows on the CPU (checks the script runs)")
    args = ap.parse_args()
    wanted = [w for w in args.rows.split(",") if w]
    picked = lambda name: not wanted or any(w in name for w in wanted)
    from pallas_kernels.flash_decode import DecodeConfig

    fa3, fa3_line = ahg.import_fa3()
    print(f"{datetime.date.today()}  {jax.devices()[0].device_kind}  jax {jax.__version__}", flush=True)
    print(fa3_line, flush=True)
    if args.cpu_smoke:
        smoke_lens = jnp.array([100, 512], jnp.int32)
        row_list, copy = [("smoke", 2, 1, 8, 512, None), ("smoke lens", 2, 1, 8, 512, smoke_lens)], 1.0
    else:
        ahg.gpu_warmup()
        row_list, copy = rows(), copy_bandwidth()
    print(f"HBM copy bandwidth (x * 2, 4 GiB bf16, read + write): {copy:.2f} TB/s", flush=True)
    configs, b1_configs = {}, {}
    if args.configs:
        old = {"te_jax 264 programs": DecodeConfig(min_programs=264),  # the default before the split sweep
               "te_jax merge in kernel": DecodeConfig(merge="kernel")}  # the shares merged by the last program
        configs, b1_configs = old, old
    table, dev_table, skipped = [], [], []
    for name, b, sq, g, s, lens in row_list:
        if not picked(name):
            continue
        if time.perf_counter() - T0 > args.budget:
            skipped.append(name)
            continue
        ks = jax.random.split(jax.random.key(hash(name) % 1000), 3)
        q = jax.random.normal(ks[0], (b, sq, H, D), jnp.bfloat16)
        # 8k random keys tiled along the cache (the time does not depend on the values; no fp32 temporary of a
        # 17 GB cache)
        part = min(s, 8192)
        k, v = (jnp.tile(jax.random.normal(kk, (b, part, g, D), jnp.bfloat16), (1, s // part, 1, 1)) for kk in ks[1:])
        row_configs = configs if (b == 16 and g == 8 and lens is None) else b1_configs if b == 1 else {}
        if lens is not None and args.uneven_factors:
            row_configs = {f"te_jax uneven factor {n}": DecodeConfig(uneven_split_factor=int(n))
                           for n in args.uneven_factors.split(",")}
            row_configs["te_jax 4 shares every row"] = DecodeConfig(min_programs=512, uneven_split_factor=1)
            if args.shares_first:
                row_configs.update({f"te_jax uneven factor {n} shares first":
                                    DecodeConfig(uneven_split_factor=int(n), shares_last=False)
                                    for n in args.uneven_factors.split(",")})
        if args.shares_first:
            row_configs = {**row_configs, "te_jax shares first": DecodeConfig(shares_last=False)}
        ab_rows = bool(row_configs) or (args.configs and lens is not None)
        impls, kw = makers(sq, g, lens, fa3, row_configs, mask_rows=ab_rows)
        choice = te_jax.explain_attention_backend(q, k, v, **kw)
        print(f"\n== {name}: te_jax auto: {choice.selected}; {choice.detail[:160]}", flush=True)
        drop_failing(impls, q, k, v)
        if "te_jax" in impls and b * s * g <= 16 * 32768 * 8:  # moderate rows
            ref = jax.jit(reference)(q, k, v, lens)
            for iname in impls:
                print(f"  {iname} vs fp32: rel {ahg.rel(impls[iname](q, k, v).astype(jnp.float32), ref):.2e}",
                      flush=True)
            del ref
        filled = b * s if lens is None else int(jnp.sum(lens))
        nbytes = 2 * filled * g * D * 2
        times = {i: [] for i in impls}
        for _ in range(args.rounds):
            for iname, f in impls.items():
                times[iname].append(timing.measure(f, (q, k, v), samples=10)[0])
        tb = {i: nbytes / statistics.median(t) / 1e12 for i, t in times.items()}
        peers = [i for i in impls if not i.startswith("te_jax")]
        best = max(peers, key=tb.get) if peers else None
        ratio = f"{tb['te_jax'] / tb[best]:.2f} of {best}" if best and "te_jax" in tb else "-"
        cells = " | ".join(f"{i} {tb[i]:.2f}" for i in impls)
        copy_frac = f"{tb['te_jax'] / copy:.2f}" if "te_jax" in tb else "-"
        line = f"| {name} | {cells} | {ratio} | {copy_frac} |"
        print(line, flush=True)
        table.append(line)
        if args.device_time and not args.cpu_smoke:
            dev_table.append(device_row(name, impls, (q, k, v), nbytes, copy))
            print(dev_table[-1], flush=True)
        del q, k, v
    if picked("paged") and (time.perf_counter() - T0 <= args.budget or args.cpu_smoke):
        table.append(paged_row(args.rounds, args.cpu_smoke))
        print(table[-1], flush=True)
    elif picked("paged"):
        skipped.append("paged")
    head = ["| row | implementations (TB/s) | te_jax / best peer | te_jax / copy |", "|---|---|---|---|"]
    text = "\n".join([f"## Decode attention, TB/s of K/V read ({args.rounds} interleaved rounds, medians), "
                      f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}; HBM copy "
                      f"{copy:.2f} TB/s", "", *head, *table])
    if dev_table:
        text += "\n\n" + "\n".join(["## The same rows by the device clock: K/V bytes / (the GPU time of one call's "
                                     "kernels, summed over 20 profiled calls)", "", *head, *dev_table])
    print("\n" + text)
    save_and_plot(text, "decode")
    if skipped:
        print(f"\nnot run (time budget {args.budget:.0f} s): {', '.join(skipped)}")


if __name__ == "__main__":
    main()
