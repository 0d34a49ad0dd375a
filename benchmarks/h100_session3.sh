#!/usr/bin/env bash
# One H100 call (2026-11-22, 3rd session): the cuDNN padding contract and the norm tests on the GPU,
# the norm forward in interleaved rounds (#5), then the long randomized run again after the cuDNN fix (#9).
set -u
export PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cudnn_padding_contract.py tests/test_norms.py \
  > "$OUT/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.txt"
timeout 120 python3 benchmarks/norm_fwd_rounds_gpu.py > "$OUT/norm_fwd_rounds.txt" 2>&1; echo "norm rounds rc=$?"
tail -16 "$OUT/norm_fwd_rounds.txt"
BOX=${BOX:-300} bash benchmarks/h100_long_hypothesis.sh
