"""Pallas kernels for te_jax: pure functions of arrays (no Flax, no env vars, no policy).

Each op lives in its own sub-package with a plain-XLA reference beside the kernel.
"""
