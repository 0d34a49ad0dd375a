#!/usr/bin/env bash
# One nvidia-h200-x2 call for the multi-GPU work (run from the repo root on the device):
#   1. context-parallel attention (ring, all-gather) at 32k and 128k vs single-GPU attention;
#   2. the training example on a dp=1 x cp=2 mesh.
# Logs go to $OUT. NCCL_NVLS_ENABLE=0 is set on the machine; do not override it.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
timeout 330 python3 benchmarks/context_parallel_gpu.py > "$OUT/context_parallel.txt" 2>&1
tail -40 "$OUT/context_parallel.txt"
timeout 240 python3 examples/train_lm.py --preset gpu --mesh dp=1,cp=2 --steps 200 --no-progress --no-ckpt \
  --out-dir "$OUT/train_cp2" > "$OUT/train_lm_cp2.txt" 2>&1
tail -12 "$OUT/train_lm_cp2.txt"
