"""What the kernels need from JAX that differs between the supported versions (0.10.2 and 0.11.x).

Kernels import Pallas and these helpers from here only (never from te_jax: a kernel imports jax and
this package, nothing else). te_jax/_compat.py re-exports these names and adds the library's own
(shard_map, meshes, the GPU's compute capability).
"""
from __future__ import annotations

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported)
from jax.experimental.pallas import triton as pltriton  # noqa: F401  (re-exported)


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Compiler params that force Triton lowering on every supported JAX.

    With `compiler_params=None`, jax 0.10.2 lowers GPU pallas_calls to Mosaic GPU and
    0.11.x to Triton, so every Triton-style kernel must pass these explicitly.
    """
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def default_interpret() -> bool:
    """Pallas kernels run in interpret mode when the default backend is not a GPU."""
    return jax.default_backend() != "gpu"


class _LoadIndexOptional:
    """Pallas's Mosaic GPU module with `load(src, idx=(), ...)`: jax 0.10.2 requires the index, which 0.11 made
    optional and the kernels omit (a whole-ref load). Everything else is the module's own."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def load(self, src, idx=(), **kwargs):
        return self._module.load(src, idx, **kwargs)


_MOSAIC_GPU = []


def mosaic_gpu():
    """Import Pallas's Mosaic GPU module lazily (it needs absl-py); on jax 0.10.2 wrapped so that the kernels'
    index-free `load` traces (and lowers for CUDA on a CPU machine: tests/test_hopper_lowering.py)."""
    if not _MOSAIC_GPU:
        import inspect

        from jax.experimental.pallas import mosaic_gpu as plgpu

        idx = inspect.signature(plgpu.load).parameters.get("idx")
        needs_idx = idx is not None and idx.default is inspect.Parameter.empty
        _MOSAIC_GPU.append(_LoadIndexOptional(plgpu) if needs_idx else plgpu)
    return _MOSAIC_GPU[0]
