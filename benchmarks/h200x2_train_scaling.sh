#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue #10's training part, after the per-shard Pallas fix): the training example on
# a data x context mesh (dp=1, cp=2) and on a data-parallel mesh (dp=2), 120 steps each, seq 1024, 16 sequences
# per data shard. The single-GPU H200 figure comes from the 4 x H200 call (same kind of GPU, same jax).
# Steady-state tokens/s is read off the log afterwards (benchmarks/train_log_rate.py).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
A="--preset gpu --steps 120 --no-progress --no-ckpt --no-plot --sample-len 0"
timeout 150 python3 examples/train_lm.py $A --mesh dp=1,cp=2 --batch 16 --out-dir /tmp/cp2 > "$OUT/train_dp1cp2.txt" 2>&1
echo "dp1cp2 rc=$?"; grep -E "devices|compiled|summary|Error" "$OUT/train_dp1cp2.txt"
timeout 110 python3 examples/train_lm.py $A --mesh dp=2,cp=1 --batch 32 --out-dir /tmp/dp2 > "$OUT/train_dp2.txt" 2>&1
echo "dp2 rc=$?"; grep -E "devices|compiled|summary|Error" "$OUT/train_dp2.txt"
