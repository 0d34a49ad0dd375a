#!/usr/bin/env bash
# One H100 call: the TransformerLayer per-sub-block profile (te_jax vs plain JAX) and the training
# example with the GPU preset for 300 steps. Logs go to $OUT (run from the repo root).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 320 python3 benchmarks/transformer_layer_profile_gpu.py > "$OUT/profile_log.txt" 2>&1
echo "profile rc=$?"; tail -45 "$OUT/profile_log.txt"
timeout 255 python3 examples/train_lm.py --preset gpu --steps 300 --no-progress --no-ckpt --out-dir "$OUT/train" \
  > "$OUT/train_lm_gpu.txt" 2>&1
echo "train rc=$?"; tail -14 "$OUT/train_lm_gpu.txt"
