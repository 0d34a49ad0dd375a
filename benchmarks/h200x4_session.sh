#!/usr/bin/env bash
# nvidia-h200-x4 calls for issue #10 (run from the repo root on the device machine):
#   bash benchmarks/h200x4_session.sh cp      context-parallel attention at cp=4, 128k and 512k, ring and
#                                             all-gather, with single-GPU cuDNN / Pallas baselines (~6-9 min)
#   bash benchmarks/h200x4_session.sh train   ring at cp=2 and 512k on GPUs 0,1 beside a single-GPU training run on
#                                             GPU 2 (separate GPUs), then training on a dp=2 x cp=2 mesh (~5 min)
# Logs go to $OUT. NCCL_NVLS_ENABLE=0 is set on the machine; do not override it.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/env.txt"
case "${1:-cp}" in
cp)
  timeout ${BOX:-550} python3 benchmarks/context_parallel_gpu.py --cp 4 --seqs 131072,524288 --reps 3 \
    > "$OUT/context_parallel_cp4.txt" 2>&1
  echo "cp4 rc=$?"; tail -16 "$OUT/context_parallel_cp4.txt" ;;
train)
  CUDA_VISIBLE_DEVICES=0,1 OUT="$OUT/cp2" timeout 300 python3 benchmarks/context_parallel_gpu.py --cp 2 \
    --seqs 524288 --strategies ring --no-single --reps 3 > "$OUT/context_parallel_cp2_512k.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=2 timeout 300 python3 examples/train_lm.py --preset gpu --steps 200 --no-progress --no-ckpt \
    --no-plot --sample-len 0 --out-dir /tmp/train1 > "$OUT/train_lm_1gpu.txt" 2>&1 &
  wait
  tail -6 "$OUT/context_parallel_cp2_512k.txt"; grep -E "devices|compiled|step 200|tokens" "$OUT/train_lm_1gpu.txt"
  timeout 280 python3 examples/train_lm.py --preset gpu --mesh dp=2,cp=2 --batch 32 --steps 200 --no-progress \
    --no-ckpt --sample-len 0 --out-dir "$OUT/train_dp2cp2" > "$OUT/train_lm_dp2cp2.txt" 2>&1
  echo "train rc=$?"; grep -E "devices|compiled|step 200|tokens" "$OUT/train_lm_dp2cp2.txt" ;;
esac
