"""benchmarks.hopper_mask_probe.summarize_kernel_trace on a synthetic Mosaic GPU profiler trace (the format of
jax.experimental.mosaic.gpu.profiler: B/E events, pid = SM + 1, tid = a CTA's warpgroup, ts in us), so the GPU
run's --kernel-trace reads its traces right."""
import json

import pytest

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
