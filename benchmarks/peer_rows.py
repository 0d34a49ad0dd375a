"""What the attention-against-peers benchmarks share: jitted forward / forward+backward pairs, interleaved timing
rounds in TFLOP/s, and the table rows "te_jax's best / best peer" (attention_masks_gpu, attention_head_dims_gpu).

    fwd_and_fb(f) -> (jit(f), jit(q, k, v, do -> vjp cotangents))
    tflops_rounds(impls, q, k, v, do, flops, rounds) -> {(name, "fwd" | "fb"): TFLOP/s}  (median over rounds;
        forward+backward counts 3.5x the forward's FLOPs)
    peer_rows(label, impls, tf, ours) -> two table lines (fwd, fb): every implementation's TFLOP/s and the best of
        `ours` (names) over the best peer (the names not starting with "te_jax")
    print_table(title, lines, save_as=None)   (save_as: also $OUT/<save_as>_table.md and <save_as>.png)
    import_peers() -> (tokamax or None, flash_attn3 or None), printing the date, the device and each peer's line
    ready_impls(makers, q, k, v, do) -> {name: (fwd, fb)} of the makers whose forward+backward ran once; the others
        are printed as errors (a peer that cannot serve a row is reported, not fatal)
    fa3_varlen(fa3, lens, scale, causal) -> f(q, k, v): FlashAttention-3's varlen call on documents of these lengths,
        packed back to back ([B, S, H, D] or [T, H, D] in and out)
"""
from __future__ import annotations

import datetime
import statistics

import jax

from benchmarks import timing


def fa3_varlen(fa3, lens, scale: float, causal: bool):
    """f(q, k, v) -> out: fa3.flash_mha_varlen (flash-attn3-jax) over documents of `lens` tokens packed back to back
    in q, k, v's leading axes (their tokens in order), out in q's shape."""
    import jax.numpy as jnp
    import numpy as np

    lens = [int(n) for n in lens]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)

    def varlen(q, k, v):
        flat = lambda x: x.reshape((-1,) + x.shape[-2:])
        o = fa3.flash_mha_varlen(flat(q), flat(k), flat(v), cu, cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                                 softmax_scale=float(scale), is_causal=causal)
        return o.reshape(q.shape)

    return varlen


def import_peers():
    from benchmarks import attention_hopper_gpu as ahg

    tk, tk_line = ahg.import_tokamax("mosaic")
    fa3, fa3_line = ahg.import_fa3()
    print(f"{datetime.date.today()}  {jax.devices()[0].device_kind}  jax {jax.__version__}", flush=True)
    print(tk_line, flush=True)
    print(fa3_line, flush=True)
    return tk, fa3


def ready_impls(makers, q, k, v, do):
    impls = {}
    for name, make in makers.items():
        try:
            impls[name] = make()
            jax.block_until_ready(impls[name][1](q, k, v, do))
        except Exception as e:  # noqa: BLE001  (a peer that cannot serve the row is reported, not fatal)
            print(f"  {name}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
            impls.pop(name, None)
    return impls


def fwd_and_fb(f):
    def fb(q, k, v, do):
        return jax.vjp(f, q, k, v)[1](do)
    return jax.jit(f), jax.jit(fb)


def tflops_rounds(impls, q, k, v, do, flops, rounds):
    times = {(i, m): [] for i in impls for m in ("fwd", "fb")}
    for r in range(rounds):
        for name, (f, fb) in impls.items():
            times[(name, "fwd")].append(timing.measure(f, (q, k, v))[0])
            times[(name, "fb")].append(timing.measure(fb, (q, k, v, do))[0])
        print(f"  round {r + 1}/{rounds} done", flush=True)
    return {key: flops * (1 if key[1] == "fwd" else 3.5) / statistics.median(t) / 1e12 for key, t in times.items()}


def peer_rows(label, impls, tf, ours):
    peers = [i for i in impls if not i.startswith("te_jax")]
    lines = []
    for m in ("fwd", "fb"):
        cells = " | ".join(f"{i} {tf[(i, m)]:.0f}" for i in impls)
        mine = max((i for i in ours if i in impls), key=lambda i: tf[(i, m)], default=None)
        best = max(peers, key=lambda i: tf[(i, m)]) if peers else None
        ratio = f"{mine} {tf[(mine, m)] / tf[(best, m)]:.2f} of {best}" if best and mine else "-"
        lines.append(f"| {label} | {m} | {cells} | {ratio} |")
    return lines


def print_table(title, lines, save_as: str | None = None):
    """Print the table; with save_as and $OUT set, also write it to $OUT/<save_as>_table.md and draw
    $OUT/<save_as>.png (te_jax / best peer per row: benchmarks.plot_peer_table)."""
    text = "\n".join([f"## {title}", "", "| row | pass | implementations (TFLOP/s) | te_jax's best / best peer |",
                      "|---|---|---|---|", *lines])
    print("\n" + text)
    if save_as:
        save_and_plot(text, save_as)


def save_and_plot(text: str, name: str) -> None:
    """With $OUT set: text to $OUT/<name>_table.md and its te_jax / best peer plot to $OUT/<name>.png."""
    import os

    from benchmarks import plot_peer_table

    out = os.environ.get("OUT")
    if not out:
        return
    path = os.path.join(out, f"{name}_table.md")
    with open(path, "w") as f:
        f.write(text + "\n")
    print(f"table: {path}; plot: {plot_peer_table.plot([path], os.path.join(out, name + '.png'))}", flush=True)
