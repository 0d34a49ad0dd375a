"""Benchmark helpers that run on the CPU, checked before their GPU runs depend on them:
benchmarks.hopper_mask_probe.summarize_kernel_trace on a synthetic Mosaic GPU profiler trace (the format of
jax.experimental.mosaic.gpu.profiler: B/E events, pid = SM + 1, tid = a CTA's warpgroup, ts in us), and
benchmarks.plot_peer_table on the tables the peer benchmarks print."""
import json

import pytest

from benchmarks import plot_peer_table
from benchmarks.hopper_mask_probe import summarize_kernel_trace


def _region(name, start, end, pid, tid):
    return [dict(name=name, ph="B", ts=start, pid=pid, tid=tid), dict(name=name, ph="E", ts=end, pid=pid, tid=tid)]


def test_regions_spans_and_sm_gaps(tmp_path):
    ev = []
    # SM 1: two CTAs one after the other (a 2 us gap), each one warpgroup trace of one tile
    ev += _region("q_wait", 0, 1, 1, 1) + _region("steps", 1, 9, 1, 1) + _region("epilogue", 9, 10, 1, 1)
    ev += _region("q_wait", 12, 14, 1, 4) + _region("steps", 14, 20, 1, 4) + _region("epilogue", 20, 21, 1, 4)
    # SM 2: one trace, two tiles
    ev += _region("steps", 0, 5, 2, 7) + _region("steps", 6, 11, 2, 7)
    path = tmp_path / "1-trace.json"
    path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": ev}))
    t = summarize_kernel_trace(str(path))
    assert t["traces"] == 3
    assert t["regions"]["q_wait"] == (2, pytest.approx(1.5))
    assert t["regions"]["steps"] == (4, pytest.approx((8 + 6 + 5 + 5) / 4))
    assert t["regions"]["epilogue"] == (2, pytest.approx(1.0))
    assert t["tiles_per_trace"] == pytest.approx(4 / 3)
    assert t["trace_span_us"] == pytest.approx((10 + 9 + 11) / 3)
    assert t["sm_gap_us"] == pytest.approx(2.0)


MASKS_LOG = """== window row progress (ignored: before any table heading)
| window (1024, 0), causal, B4 x 4k | fwd | te_jax 999 | fa3 1 | te_jax 999 of fa3 |

## Hopper masks: TFLOP/s on the visible area (3 interleaved rounds, medians), NVIDIA H100 80GB HBM3

| row | pass | implementations (TFLOP/s) | te_jax's best / best peer |
|---|---|---|---|
| window (1024, 0), causal, B4 x 4k | fwd | te_jax 444 | te_jax_portable 284 | cudnn 361 | fa3 462 | te_jax 0.96 of fa3 |
| window (1024, 0), causal, B4 x 4k | fb | te_jax 331 | te_jax_portable 278 | cudnn 300 | fa3 369 | te_jax 0.90 of fa3 |
| sinks, B4 x 4k | fwd | te_jax 500 | te_jax_portable 200 | - |
"""

DECODE_LOG = """## Decode attention, TB/s of K/V read (3 interleaved rounds, medians), NVIDIA H100 80GB HBM3

| row | implementations (TB/s) | te_jax / best peer | te_jax / copy |
|---|---|---|---|
| q1 b16 GQA 32/8 cache 8k | te_jax 2.66 | te_jax shares first 2.64 | cudnn 2.59 | fa3 2.70 | 0.99 of fa3 | 1.01 |

## The same rows by the device clock

| row | implementations (TB/s) | te_jax / best peer | te_jax / copy |
|---|---|---|---|
| q1 b16 GQA 32/8 cache 8k | te_jax 2.96 | cudnn 3.05 | 0.97 of cudnn | 1.12 |
"""


def test_peer_tables_read_and_plot(tmp_path):
    masks, decode = tmp_path / "masks.txt", tmp_path / "decode.txt"
    masks.write_text(MASKS_LOG)
    decode.write_text(DECODE_LOG)
    (title, rows), = plot_peer_table.read_tables(str(masks))
    assert title.startswith("Hopper masks") and len(rows) == 3
    assert rows[("window (1024, 0), causal, B4 x 4k", "fb")] == {"te_jax": 331, "te_jax_portable": 278,
                                                                 "cudnn": 300, "fa3": 369}
    got = plot_peer_table.ratios(rows)  # the row without a peer is left out
    assert [(n, round(r, 3), p) for n, r, p in got] == [
        ("window (1024, 0), causal, B4 x 4k (fwd)", round(444 / 462, 3), "fa3"),
        ("window (1024, 0), causal, B4 x 4k (fwd+bwd)", round(331 / 369, 3), "fa3")]
    sections = plot_peer_table.read_tables(str(decode))
    assert len(sections) == 2
    assert sections[0][1][("q1 b16 GQA 32/8 cache 8k", "")]["te_jax shares first"] == 2.64
    assert plot_peer_table.ratios(sections[1][1])[0][1] == pytest.approx(2.96 / 3.05)
    # a later log's row replaces the same row of an earlier one
    later = tmp_path / "later.txt"
    later.write_text(MASKS_LOG.replace("te_jax 444", "te_jax 470"))
    merged = plot_peer_table.merged([str(masks), str(later)])
    assert merged[0][1][("window (1024, 0), causal, B4 x 4k", "fwd")]["te_jax"] == 470
    pytest.importorskip("matplotlib")
    png = tmp_path / "decode.png"
    assert plot_peer_table.plot([str(decode)], str(png), "decode") == str(png) and png.stat().st_size > 1000
