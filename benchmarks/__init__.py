"""te_jax's maintained benchmark suite (GPU scripts; run from the repo root as modules,
`PYTHONPATH=. python3 -m benchmarks.<script>`). Index and current results: benchmarks/results/README.md."""
