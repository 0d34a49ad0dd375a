#!/usr/bin/env bash
# The long randomized run on the GPU (issue #9): about 300 random attention calls (the "long" profile's
# count) over every serving backend, split into 8 independent shards that pytest-xdist runs in parallel
# (compiles are CPU-bound; the GPU is shared, so no preallocation). ~6-8 minutes on the H100.
#   TE_JAX_HYPOTHESIS_SHARDS x TE_JAX_HYPOTHESIS_EXAMPLES = random calls in all.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export TE_JAX_HYPOTHESIS_SHARDS=${TE_JAX_HYPOTHESIS_SHARDS:-8} TE_JAX_HYPOTHESIS_EXAMPLES=${TE_JAX_HYPOTHESIS_EXAMPLES:-38}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout ${BOX:-540} python3 -m pytest -q -p no:cacheprovider -rf -n "$TE_JAX_HYPOTHESIS_SHARDS" \
  --hypothesis-show-statistics tests/test_attention_properties.py -k xla_and_gpu > "$OUT/gpu_hypothesis_long.txt" 2>&1
echo "hypothesis rc=$?"; grep -E "passing|failing|passed|failed|Falsifying" "$OUT/gpu_hypothesis_long.txt" | tail -30
