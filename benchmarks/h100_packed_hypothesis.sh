#!/usr/bin/env bash
# One H100 call: the Pallas-kernel tests (incl. packed layouts read in place) through the front door,
# the randomized (hypothesis) run over every serving backend, and the packed-attention GPU check.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf -n 4 tests/test_attention_packed.py \
  tests/test_attention_pallas_backend.py tests/test_attention_edge_cases.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -8 "$OUT/gpu_tests.txt"
TE_JAX_HYPOTHESIS_EXAMPLES=${TE_JAX_HYPOTHESIS_EXAMPLES:-25} timeout 210 python3 -m pytest -q -p no:cacheprovider -rf \
  -n 4 --hypothesis-show-statistics tests/test_attention_properties.py > "$OUT/gpu_hypothesis.txt" 2>&1
echo "hypothesis rc=$?"; tail -40 "$OUT/gpu_hypothesis.txt"
unset XLA_PYTHON_CLIENT_PREALLOCATE
timeout 120 python3 benchmarks/packed_attention_gpu.py --reps 15 > "$OUT/packed_attention.txt" 2>&1
echo "packed rc=$?"; tail -25 "$OUT/packed_attention.txt"
