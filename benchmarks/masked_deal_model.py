"""CPU model: how evenly a static deal of query tiles spreads the data-mask forward's work over persistent CTAs,
against the grid kernel's dynamic launch (each tile to the first free SM, in grid order).

    python -m benchmarks.masked_deal_model [--ctas 132]

Tile cost = its K/V steps (at least 1) + 0.4 per masked step + 1 (Q load and epilogue), from the real block counts
that data_mask.mask_tables builds for the attention_masks_gpu rows. Printed per deal: the busiest CTA's total over
the ideal (total / CTAs). Deals: "grid (dynamic)"; "snake" (rounds of n_ctas consecutive tiles, CTA j taking
position j, then n_ctas - 1 - j: forward_masked_persistent's); "round-robin"; "rotate s" (position (j + s r) mod
n_ctas in round r). A model, not a measurement: it leaves out L2 locality and overlap.
"""
from __future__ import annotations

import argparse
import heapq

import numpy as np

from pallas_kernels.flash_attention_hopper.config import default_config
from pallas_kernels.flash_attention_hopper.data_mask import mask_tables
from pallas_kernels.mask import AttentionMask


def block_counts(mask: AttentionMask) -> np.ndarray:
    """[B, query tiles, 2] (partial, all) visible blocks per forward tile."""
    cfg = default_config(128, mask.kv_len, False, mask.q_len)
    return np.asarray(mask_tables(mask, cfg, backward=False).fwd[0])[..., -2:]


def _runs(lens, total):
    ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lens)])
    return np.pad(ids, (0, total - ids.size))


def makespans(counts: np.ndarray, heads: int, n_ctas: int, masked: float = 0.4, overhead: float = 1.0) -> dict:
    B, nq = counts.shape[:2]
    cost = np.maximum(counts[..., 1], 1) + masked * counts[..., 0] + overhead
    cost = np.broadcast_to(cost[:, None, :], (B, heads, nq)).reshape(-1).astype(float)
    n = cost.size
    n_ctas = min(n_ctas, n)
    out = {}
    grid_order = np.arange(n).reshape(B, heads, nq).transpose(0, 2, 1).reshape(-1)  # grid (heads, q_seq, batch)
    free = [0.0] * n_ctas
    for t in grid_order:
        heapq.heappush(free, heapq.heappop(free) + cost[t])
    out["grid (dynamic)"] = max(free)

    def static(position):
        load = np.zeros(n_ctas)
        for r in range(-(-n // n_ctas)):
            for j in range(n_ctas):
                t = r * n_ctas + position(j, r)
                if t < n:
                    load[j] += cost[t]
        return load.max()

    out["snake"] = static(lambda j, r: j if r % 2 == 0 else n_ctas - 1 - j)
    out["round-robin"] = static(lambda j, r: j)
    for s in (1, 3, 5):
        out[f"rotate {s}"] = static(lambda j, r, s=s: (j + r * s) % n_ctas)
    ideal = cost.sum() / n_ctas
    return {k: v / ideal for k, v in out.items()}


ROWS = {
    "bshd segments, 4 per row, B4 x 4k": (AttentionMask.from_segments(
        np.stack([_runs([1500, 1000, 1096, 500], 4096)] * 4), causal=True), 16),
    "thd, 11 documents in 16,384 tokens": (AttentionMask.from_segments(
        _runs([2048, 512, 3000, 1024, 777, 2500, 1600, 900, 1200, 1823, 1000], 16384)[None], causal=True), 16),
    "padding_causal 4096/3000/2048/3500": (AttentionMask.from_segments(
        np.stack([_runs([n], 4096) for n in (4096, 3000, 2048, 3500)]), causal=True), 16),
    "window (1024, 0), causal, B4 x 4k": (AttentionMask.full(4, 4096, 4096, causal=True, window=(1024, 0)), 16),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctas", type=int, default=132)
    args = ap.parse_args()
    for name, (mask, heads) in ROWS.items():
        spans = makespans(block_counts(mask), heads, args.ctas)
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in spans.items()))


if __name__ == "__main__":
    main()
