"""The Hopper-mask issue's rows: te_jax against every peer that supports each row, forward and forward+backward.

    bash benchmarks/install_peers.sh; export PYTHONPATH=.:/tmp/site   # carry [".whl"]
    python3 -m benchmarks.attention_masks_gpu [--rounds 3] [--rows window_causal_4k,...] [--device-time]

Rows (bf16, hd128, 16 heads unless said): see ROWS (the dense rows and the sinks rows complete the issue's list; no
peer has sinks, so those rows add te_jax_no_sink: the same call without the sink). Implementations, where each
supports the row:
  te_jax          te_jax.dot_product_attention(backend="auto"): what users get (the kernel it takes is printed)
  te_jax_pallas   the same with backend="pallas" (the Hopper kernel where it serves; only when auto takes another)
  te_jax_portable backend="pallas" with the portable kernel's BlockSizes (what served these rows before)
  te_jax_persistent / te_jax_grid (--persistent, data-mask rows) the Hopper data-mask forward on the persistent
                  grid / one CTA per query tile (HopperConfig.fwd_persistent_masked True / False)
  te_jax_xla_delta (--delta-ab) the Hopper backward with XLA's delta = rowsum(O * dO) instead of the dQ kernel's
                  (HopperConfig.bwd_delta_in_dq=False: the A/B of that choice)
  cudnn           jax.nn.dot_product_attention(implementation="cudnn") (seq lengths, windows; no segments)
  tokamax         tokamax.dot_product_attention(implementation="mosaic")
  fa3             flash_attn3_jax.flash_mha / flash_mha_varlen (causal is bottom-right when lengths differ)
Before timing, each row checks te_jax's output against an fp32 reference built from the row's mask
(pallas_kernels.mask.AttentionMask; the last 512 query rows of each batch row, every row for thd) and its gradients
against the portable kernel's. A peer that fails on a row is reported and left out. Timing: `rounds` interleaved
rounds (every implementation once per round), each the median of timing.measure's samples; the cell is the median
over rounds. TFLOP/s counts the visible area: 4*H*D*visible pairs for the forward, 3.5x that for forward+backward.
--device-time adds, per implementation and pass, the device clock's breakdown (benchmarks.device_time.profiled):
the GPU time of one call's kernels, how many kernels it launches, and the costliest of them, which separates the
attention kernel from the XLA work around it (the mask's pre-pass, layout changes).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from benchmarks import attention_hopper_gpu as ahg  # inputs, peer imports, gpu_warmup
from benchmarks import device_time
from benchmarks.peer_rows import (fa3_varlen, fwd_and_fb, import_peers, peer_rows, print_table, ready_impls,
                                  tflops_rounds)
from pallas_kernels.mask import AttentionMask

D = 128
THD_DOCS = (2048, 512, 3000, 1024, 777, 2500, 1600, 900, 1200, 1823, 1000)  # 11 documents, 16,384 tokens


def sink_logits(h: int):
    """The learnable-sink rows' per-head sink logits [h] (fixed: the timing does not depend on them)."""
    return jnp.linspace(-2.0, 2.0, h, dtype=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    B: int
    Sq: int
    H: int = 16
    Skv: int | None = None  # None: Sq
    causal: bool = False
    softcap: float | None = None
    window: tuple[int, int] | None = None
    seqlens: tuple[int, ...] | None = None      # bshd padding: valid length per batch row (q and kv)
    docs: tuple[int, ...] | None = None         # documents per batch row (bshd segment ids), or thd's documents
    thd: bool = False
    bottom_right: bool = False
    softmax_type: str = "vanilla"  # attention sinks: "off-by-one" or "learnable" (per-head logits SINK_LOGITS)

    @property
    def kv(self):
        return self.Skv or self.Sq

    def mask_type(self):
        """te_jax's attn_mask_type for the row."""
        pad = "padding_" if self.seqlens is not None or self.docs is not None else ""
        if self.bottom_right:
            return pad + "causal_bottom_right"
        if self.causal:
            return pad + "causal"
        return "padding" if pad else "no_mask"

    def attention_mask(self) -> AttentionMask:
        """The row's mask as data (the reference's and the visible-area count's), batch-first; thd as batch 1."""
        b = 1 if self.thd else self.B
        if self.docs is not None:
            ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(self.docs)])
            seg = np.broadcast_to(ids, (b, ids.size))
            return AttentionMask.from_segments(seg, causal=self.causal, window=self.window or (-1, -1))
        if self.seqlens is not None:
            seg = (np.arange(self.Sq)[None] < np.asarray(self.seqlens)[:, None]).astype(np.int32)
            return AttentionMask.from_segments(seg, causal=self.causal, window=self.window or (-1, -1))
        return AttentionMask.full(b, self.Sq, self.kv, causal=self.causal, window=self.window or (-1, -1),
                                  bottom_right=self.bottom_right)


ROWS = {
    "softcap_causal_4k": Row("softcap 50, causal, B4 x 4k", 4, 4096, causal=True, softcap=50.0),
    "softcap_full_4k": Row("softcap 50, non-causal, B4 x 4k", 4, 4096, softcap=50.0),
    "ragged_16534_full": Row("seq 16,534, 18 heads, non-causal", 1, 16534, H=18),
    "ragged_16534_causal": Row("seq 16,534, 18 heads, causal", 1, 16534, H=18, causal=True),
    "window_causal_4k": Row("window (1024, 0), causal, B4 x 4k", 4, 4096, causal=True, window=(1024, 0)),
    "window_256_256_4k": Row("window (256, 256), non-causal, B4 x 4k", 4, 4096, window=(256, 256)),
    "padding_causal_4k": Row("padding_causal, rows 4096/3000/2048/3500", 4, 4096, causal=True,
                             seqlens=(4096, 3000, 2048, 3500)),
    "thd_11_docs_16k": Row("thd, 11 documents in 16,384 tokens, causal", 1, 16384, causal=True, docs=THD_DOCS,
                           thd=True),
    "segments_bshd_4docs": Row("segment ids, 4 documents per row, causal, B4 x 4k", 4, 4096, causal=True,
                               docs=(1500, 1000, 1096, 500)),
    "bottom_right_2k_8k": Row("causal bottom-right, q 2k x kv 8k, B4", 4, 2048, Skv=8192, causal=True,
                              bottom_right=True),
    "sinks_learnable_causal_4k": Row("learnable sinks, causal, B4 x 4k", 4, 4096, causal=True,
                                     softmax_type="learnable"),
    "sinks_off_by_one_4k": Row("off-by-one sinks, non-causal, B4 x 4k", 4, 4096, softmax_type="off-by-one"),
    "dense_causal_4k": Row("dense causal, B4 x 4k", 4, 4096, causal=True),
    "dense_full_4k": Row("dense, no mask, B4 x 4k", 4, 4096),
}


def visible_pairs(row: Row) -> int:
    """Visible (query, key) pairs of the whole call (all batch rows), counted from the mask in chunks."""
    m = row.attention_mask()
    total = 0
    for b in range(m.batch):
        one = jax.tree_util.tree_map(lambda x: x[b:b + 1], m)
        for s in range(0, m.q_len, 2048):
            part = dataclasses.replace(one, q_segment_ids=one.q_segment_ids[:, s:s + 2048],
                                       q_positions=one.q_positions[:, s:s + 2048])
            total += int(jnp.sum(part.dense()))
    return total * (1 if row.thd else row.B // m.batch)


def _te_kwargs(row: Row):
    kw = dict(attn_input_format="thd" if row.thd else "bshd", attn_mask_type=row.mask_type(), softcap=row.softcap)
    if row.softmax_type != "vanilla":
        kw["softmax_type"] = row.softmax_type
        if row.softmax_type == "learnable":
            kw["softmax_offset"] = sink_logits(row.H)
    if row.window is not None:
        kw["window_size"] = row.window
    if row.seqlens is not None:
        kw["q_seqlens"] = kw["kv_seqlens"] = jnp.asarray(row.seqlens, jnp.int32)
    if row.docs is not None:
        if row.thd:
            kw["q_seqlens"] = kw["kv_seqlens"] = jnp.asarray(row.docs, jnp.int32)
        else:
            ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(row.docs)])
            kw["q_segment_ids"] = kw["kv_segment_ids"] = jnp.asarray(np.broadcast_to(ids, (row.B, ids.size)))
    return kw


@contextlib.contextmanager
def _aligned_tiles_on():
    """tuning.HOPPER_ALIGNED_TILES_AUTO switched on while a call traces (te_jax_aligned)."""
    from te_jax.backends import tuning

    before = tuning.HOPPER_ALIGNED_TILES_AUTO
    tuning.HOPPER_ALIGNED_TILES_AUTO = dataclasses.replace(before, value=True)
    try:
        yield
    finally:
        tuning.HOPPER_ALIGNED_TILES_AUTO = before


def _traced_aligned(fn):
    def call(*args):
        with _aligned_tiles_on():
            return fn(*args)
    return call


def makers(row: Row, scale, tk, fa3, persistent=False, delta_ab=False, aligned=False):
    from pallas_kernels.flash_attention import BlockSizes
    from pallas_kernels.flash_attention_hopper.config import default_config

    kw = _te_kwargs(row)
    out = {}
    variants = [("te_jax", dict(backend="auto")), ("te_jax_pallas", dict(backend="pallas")),
                ("te_jax_portable", dict(backend="pallas", config=BlockSizes()))]
    if persistent:
        hopper = default_config(D, -(-row.kv // 128) * 128, row.causal, -(-row.Sq // 128) * 128)
        variants += [(f"te_jax_{n}", dict(backend="pallas", config=dataclasses.replace(
            hopper, fwd_persistent_masked=on))) for n, on in (("persistent", True), ("grid", False))]
    if delta_ab:  # the backward with XLA's delta = rowsum(O * dO) instead of the dQ kernel's (bwd_delta_in_dq)
        hopper = default_config(D, -(-row.kv // 128) * 128, row.causal, -(-row.Sq // 128) * 128)
        variants.append(("te_jax_xla_delta", dict(backend="pallas", config=dataclasses.replace(
            hopper, bwd_delta_in_dq=False))))
    for name, extra in variants:
        out[name] = (lambda extra: lambda: fwd_and_fb(lambda q, k, v: te_jax.dot_product_attention(
            q, k, v, scale=scale, **kw, **extra)))(extra)
    if aligned:  # auto with the documents on aligned tiles, forward and backward (HOPPER_ALIGNED_TILES_AUTO on)
        out["te_jax_aligned"] = lambda: fwd_and_fb(_traced_aligned(lambda q, k, v: te_jax.dot_product_attention(
            q, k, v, scale=scale, **kw)))
    if row.softmax_type != "vanilla":  # no peer has sinks: the same call without them, for their cost
        plain = {n: a for n, a in kw.items() if n not in ("softmax_type", "softmax_offset")}
        out["te_jax_no_sink"] = lambda: fwd_and_fb(lambda q, k, v: te_jax.dot_product_attention(
            q, k, v, scale=scale, **plain))
        return out
    docs = row.docs is not None
    if row.softcap is None and not docs and not row.bottom_right and not row.thd:
        lens = None if row.seqlens is None else jnp.asarray(row.seqlens, jnp.int32)
        win = {} if row.window is None else {"local_window_size": row.window}
        out["cudnn"] = lambda: fwd_and_fb(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=row.causal, query_seq_lengths=lens, key_value_seq_lengths=lens,
            implementation="cudnn", **win))
    if tk is not None and not docs and not row.bottom_right and not row.thd:
        params = inspect.signature(tk.dot_product_attention).parameters
        extra = {}
        if row.seqlens is not None:
            extra.update(query_seq_lengths=jnp.asarray(row.seqlens, jnp.int32),
                         key_value_seq_lengths=jnp.asarray(row.seqlens, jnp.int32))
        if row.window is not None:
            extra["local_window_size"] = row.window
        if row.softcap is not None:
            extra["logits_soft_cap"] = row.softcap
        if all(p in params for p in extra):
            out["tokamax"] = lambda: fwd_and_fb(lambda q, k, v: tk.dot_product_attention(
                q, k, v, scale=scale, is_causal=row.causal, implementation="mosaic", **extra))
    if fa3 is not None and row.softcap is None and row.seqlens is None:
        params = inspect.signature(fa3.flash_mha).parameters
        if docs:
            varlen = fa3_varlen(fa3, row.docs if row.thd else row.docs * row.B, scale, row.causal)
            out["fa3"] = lambda: fwd_and_fb(varlen)
        elif row.window is None or "window_size" in params:
            extra = {} if row.window is None else {"window_size": tuple(row.window)}
            out["fa3"] = lambda: fwd_and_fb(lambda q, k, v: fa3.flash_mha(
                q, k, v, softmax_scale=float(scale), is_causal=row.causal, **extra))
    return out


def inputs(row: Row, key):
    ks = jax.random.split(key, 4)
    lead = () if row.thd else (row.B,)
    q = jax.random.normal(ks[0], lead + (row.Sq, row.H, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], lead + (row.kv, row.H, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], lead + (row.kv, row.H, D), jnp.bfloat16)
    do = jax.random.normal(ks[3], lead + (row.Sq, row.H, D), jnp.bfloat16)
    return q, k, v, do


def reference_rows(row: Row, q, k, v, scale, n=512):
    """fp32 output of the last n query rows of every batch row under the row's mask, and te_jax's index for them."""
    from pallas_kernels.flash_attention.reference import reference_attention

    m = row.attention_mask()
    batched = (lambda x: x[None]) if row.thd else (lambda x: x)
    qb, kb, vb = (batched(x).astype(jnp.float32) for x in (q, k, v))
    s0 = max(0, m.q_len - n)
    tail = dataclasses.replace(m, q_segment_ids=m.q_segment_ids[:, s0:], q_positions=m.q_positions[:, s0:])
    out, lse = jax.jit(lambda q, k, v: reference_attention(q, k, v, tail, scale=scale, softcap=row.softcap))(
        qb[:, s0:], kb, vb)
    if row.softmax_type != "vanilla":  # the sink as one more logit in each row's softmax: out * e^lse / (e^lse + e^s)
        sink = jnp.zeros((row.H,)) if row.softmax_type == "off-by-one" else sink_logits(row.H)
        keep = jnp.exp(lse - jnp.logaddexp(lse, sink[None, :, None]))  # [b, h, s]
        out = out * jnp.swapaxes(keep, 1, 2)[..., None]
    return out, s0


def print_device_time(impls, q, k, v, do):
    """Per implementation and pass: the device clock's kernel time per call, its kernel count and the costliest."""
    for name, (f, fb) in impls.items():
        for what, fn, args in (("fwd", f, (q, k, v)), ("fwd+bwd", fb, (q, k, v, do))):
            prof = device_time.profiled(fn, args, calls=5)
            top = ", ".join(f"{n} {t * 1e6:.0f}" for n, t in prof["durations"].items())
            print(f"  {name} {what} device: {prof['kernel_s'] * 1e3:.3f} ms/call in {prof['kernels_per_call']:.0f} "
                  f"kernels (us: {top})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--persistent", action="store_true",
                    help="add te_jax_persistent and te_jax_grid (the data-mask forward's two schedules) on "
                         "data-mask rows")
    ap.add_argument("--aligned", action="store_true",
                    help="add te_jax_aligned (documents: the forward and the backward on document-aligned tiles) on "
                    "data-mask rows")
    ap.add_argument("--delta-ab", action="store_true",
                    help="add te_jax_xla_delta: the Hopper backward with XLA's delta instead of the dQ kernel's")
    ap.add_argument("--device-time", action="store_true",
                    help="per implementation: the device clock's kernel time, kernel count and costliest kernels")
    args = ap.parse_args()
    tk, fa3 = import_peers()
    if fa3 is not None:
        print(f"flash_mha{inspect.signature(fa3.flash_mha)}", flush=True)
        if hasattr(fa3, "flash_mha_varlen"):
            print(f"flash_mha_varlen{inspect.signature(fa3.flash_mha_varlen)}", flush=True)
    ahg.gpu_warmup()
    table = []
    for name in args.rows.split(","):
        row = ROWS[name]
        scale = D ** -0.5
        q, k, v, do = inputs(row, jax.random.key(hash(name) % 1000))
        choice = te_jax.explain_attention_backend(q, k, v, **_te_kwargs(row))
        print(f"\n== {name}: {row}\nte_jax auto: {choice.selected}; {choice.detail}", flush=True)
        data_mask = "data-mask schedule" in choice.detail
        impls = ready_impls({n: m for n, m in makers(row, scale, tk, fa3,
                                                     persistent=args.persistent and data_mask,
                                                     delta_ab=args.delta_ab,
                                                     aligned=args.aligned and data_mask).items()
                             if not (n == "te_jax_pallas" and choice.selected == "pallas")}, q, k, v, do)
        ref, s0 = reference_rows(row, q, k, v, scale)
        for iname in impls:
            o = impls[iname][0](q, k, v)
            o = (o[None] if row.thd else o)[:, s0:].astype(jnp.float32)
            print(f"  {iname} out (last {ref.shape[1]} rows of each batch row) vs fp32: rel {ahg.rel(o, ref):.2e}",
                  flush=True)
        if "te_jax_portable" in impls:
            gp = impls["te_jax_portable"][1](q, k, v, do)
            for iname in ("te_jax", "te_jax_pallas", "te_jax_persistent", "te_jax_grid", "te_jax_xla_delta",
                          "te_jax_aligned"):
                if iname in impls:
                    g = impls[iname][1](q, k, v, do)
                    print(f"  {iname} grads vs portable kernel: rel " +
                          ", ".join(f"d{n} {ahg.rel(a, b):.2e}" for n, a, b in zip("qkv", g, gp)), flush=True)
        flops = 4 * row.H * D * visible_pairs(row)
        tf = tflops_rounds(impls, q, k, v, do, flops, args.rounds)
        if args.device_time:
            print_device_time(impls, q, k, v, do)
        table += peer_rows(row.label, impls, tf, ("te_jax", "te_jax_pallas", "te_jax_persistent", "te_jax_grid",
                                                  "te_jax_aligned"))
    print_table(f"Hopper masks: TFLOP/s on the visible area ({args.rounds} interleaved rounds, medians), "
                f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}", table,
                save_as="attention_masks")


if __name__ == "__main__":
    main()
