#!/usr/bin/env bash
# One H100 call: GPU correctness through the front door, the randomized (hypothesis) run over every
# serving backend, and the norm / LayerNorm-MLP benchmark. Logs go to $OUT (run from the repo root).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf -x \
  tests/test_attention_pallas_backend.py tests/test_attention_edge_cases.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -6 "$OUT/gpu_tests.txt"
TE_JAX_HYPOTHESIS_EXAMPLES=${TE_JAX_HYPOTHESIS_EXAMPLES:-40} timeout 170 python3 -m pytest -q -p no:cacheprovider -rf \
  --hypothesis-show-statistics tests/test_attention_properties.py > "$OUT/gpu_hypothesis.txt" 2>&1
echo "hypothesis rc=$?"; tail -25 "$OUT/gpu_hypothesis.txt"
BENCH_BUDGET_S=190 timeout 230 python3 benchmarks/norms_mlp_gpu.py > "$OUT/norms_mlp.txt" 2>&1
echo "norms rc=$?"; tail -32 "$OUT/norms_mlp.txt"
