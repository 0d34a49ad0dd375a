#!/usr/bin/env bash
# One H100 call for the checks and timings that belong together (run from the repo root on the device):
#   1. the attention tests through the front door on the real GPU (pallas, cudnn, xla backends),
#      including a time-boxed randomized (hypothesis) run over every serving backend;
#   2. the TransformerLayer benchmark against the plain-JAX cuDNN layer;
#   3. the training example with the GPU preset.
# Logs go to $OUT. Each step has its own time box; the first run (2026-11-22) cut the test and
# training steps short, so their boxes are longer now.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf \
  tests/test_attention_pallas_backend.py tests/test_attention_edge_cases.py > "$OUT/gpu_tests.txt" 2>&1
tail -15 "$OUT/gpu_tests.txt"
# Randomized calls over every backend that serves them (one hypothesis example compiles each backend).
TE_JAX_HYPOTHESIS_EXAMPLES=${TE_JAX_HYPOTHESIS_EXAMPLES:-40} timeout 200 python3 -m pytest -q -p no:cacheprovider -rf \
  --hypothesis-show-statistics tests/test_attention_properties.py > "$OUT/gpu_hypothesis.txt" 2>&1
tail -25 "$OUT/gpu_hypothesis.txt"
timeout 130 python3 benchmarks/transformer_layer_gpu.py 2>&1 | tail -40 | tee "$OUT/transformer_layer.txt"
timeout 240 python3 examples/train_lm.py --preset gpu --steps 300 --no-progress --no-ckpt --out-dir "$OUT/train" \
  2>&1 | tail -40 | tee "$OUT/train_lm_gpu.txt"
