#!/usr/bin/env bash
# One GPU call for the FP8 work (run from the repo root on the device; logs to $OUT):
#   1. tests/test_fp8.py on the GPU (incl. the cuBLASLt FP8 custom-call check, direct and qdq styles);
#   2. the HLO custom calls of one FP8 dense fwd+bwd (what XLA made of each GEMM);
#   3. benchmarks.fp8_layer_gpu (bf16 vs DelayedScaling vs Float8CurrentScaling, both GEMM styles).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider -rf tests/test_fp8.py > "$OUT/fp8_tests.txt" 2>&1
tail -15 "$OUT/fp8_tests.txt"
timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/fp8_hlo.txt"
import os, re, jax, jax.numpy as jnp
from te_jax import fp8
from te_jax.flax import DenseGeneral
m = DenseGeneral(features=1024, use_bias=False, dtype=jnp.bfloat16)
x = jnp.ones((4, 512, 1024), jnp.bfloat16)
for style in ("direct", "qdq"):
    os.environ["TE_JAX_FP8_GEMM"] = style
    with fp8.autocast(recipe=fp8.DelayedScaling()):
        v = m.init(jax.random.PRNGKey(0), x)
        f = jax.jit(lambda v, x: jax.value_and_grad(lambda v, x: jnp.sum(m.apply(v, x).astype(jnp.float32)), argnums=(0, 1))(v, x))
        hlo = f.lower(v, x).compile().as_text()
    print(f"== {style}: custom calls")
    for l in hlo.splitlines():
        if "custom_call_target=" in l:
            print("  ", re.search(r'custom_call_target="([^"]+)"', l).group(1), l.strip()[:160])
PY
timeout 420 python3 -m benchmarks.fp8_layer_gpu --gemm-style both 2>&1 | tee "$OUT/fp8_layer.txt" | tail -60
