#!/usr/bin/env bash
# One H100 call: GPU correctness through the front door (pytest-xdist, 4 workers sharing the GPU),
# the randomized (hypothesis) run over every serving backend, and the whole-TransformerLayer timing
# variants. Logs go to $OUT (run from the repo root). Extra test files: TESTS="tests/x.py ...".
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf -n 4 \
  tests/test_attention_pallas_backend.py tests/test_attention_edge_cases.py ${TESTS:-} > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -8 "$OUT/gpu_tests.txt"
TE_JAX_HYPOTHESIS_EXAMPLES=${TE_JAX_HYPOTHESIS_EXAMPLES:-25} timeout 200 python3 -m pytest -q -p no:cacheprovider -rf \
  -n 4 --hypothesis-show-statistics tests/test_attention_properties.py > "$OUT/gpu_hypothesis.txt" 2>&1
echo "hypothesis rc=$?"; tail -30 "$OUT/gpu_hypothesis.txt"
unset XLA_PYTHON_CLIENT_PREALLOCATE
timeout 200 python3 benchmarks/transformer_layer_profile_gpu.py --layers-only --no-trace --budget 170 \
  > "$OUT/layers_log.txt" 2>&1
echo "layers rc=$?"; tail -16 "$OUT/layers_log.txt"
