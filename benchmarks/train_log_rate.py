"""Steady-state tokens/s from an examples/train_lm.py log.

The example prints a cumulative average (tokens since step 2 / time since step 2), which still rises at step
200 because the first steps after the compile are slow. This takes two logged points a and b (default: the
middle and the last) and prints (b - a) * tokens_per_step / (t_b - t_a), with t_n = (n - 1) * tokens_per_step /
rate_n (evaluation pauses are excluded from the example's clock).

    python3 -m benchmarks.train_log_rate LOG TOKENS_PER_STEP
"""
from __future__ import annotations

import re
import sys


def steady_rate(path: str, tokens_per_step: int) -> tuple[int, int, float]:
    points = {}
    for line in open(path):
        m = re.match(r"step (\d+)/\d+ .*tok_s ([\d,]+)", line)
        if m:
            points[int(m.group(1))] = int(m.group(2).replace(",", ""))
    steps = sorted(points)
    if len(steps) < 3:
        raise ValueError(f"{path}: fewer than 3 logged steps with a tok_s value")
    a, b = steps[len(steps) // 2], steps[-1]
    t_a = (a - 1) * tokens_per_step / points[a]
    t_b = (b - 1) * tokens_per_step / points[b]
    return a, b, (b - a) * tokens_per_step / (t_b - t_a)


if __name__ == "__main__":
    a, b, rate = steady_rate(sys.argv[1], int(sys.argv[2]))
    print(f"steps {a}-{b}: {rate:,.0f} tokens/s")
