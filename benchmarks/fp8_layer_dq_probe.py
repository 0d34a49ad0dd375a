"""benchmarks.fp8_layer_gpu with one more trace-time switch, PROBE_DQ_KERNEL=1: the Hopper attention backward takes
the dQ kernel instead of the atomic dQ (the atomic_dq_chosen that backward.flash_bwd reads is patched; the
layer's causal attention takes no data mask, so masked_atomic_dq_chosen is not involved). For --env-ab:

    PYTHONPATH=. python3 -m benchmarks.fp8_layer_dq_probe --rounds 3 --inner 1,4 --only DelayedScaling \
        --env-ab PROBE_DQ_KERNEL=1
"""
import os
import sys

from pallas_kernels.flash_attention_hopper import backward as BW
from pallas_kernels.flash_attention_hopper import config as C

_orig = C.atomic_dq_chosen


def patched(*a, **k):
    if os.environ.get("PROBE_DQ_KERNEL") == "1":
        return False
    return _orig(*a, **k)


BW.atomic_dq_chosen = patched
from benchmarks import fp8_layer_gpu  # noqa: E402

sys.argv = ["fp8_layer_gpu"] + sys.argv[1:]
fp8_layer_gpu.main()
