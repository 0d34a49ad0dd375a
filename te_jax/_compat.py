"""Every difference between the supported JAX versions (0.10.2 and 0.11.x) lives here.

Kernels and library code import Pallas, shard_map and mesh helpers from this module
only, so that a new JAX release means editing one file.
"""
from __future__ import annotations

import contextlib
import functools

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported)
from jax.experimental.pallas import triton as pltriton  # noqa: F401  (re-exported)

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Compiler params that force Triton lowering on every supported JAX.

    With `compiler_params=None`, jax 0.10.2 lowers GPU pallas_calls to Mosaic GPU and
    0.11.x to Triton, so every Triton-style kernel must pass these explicitly.
    """
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def default_interpret() -> bool:
    """Pallas kernels run in interpret mode when the default backend is not a GPU."""
    return jax.default_backend() != "gpu"


def mosaic_gpu():
    """Import Pallas's Mosaic GPU module lazily (it needs absl-py and a GPU build)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def shard_map(f, *, mesh, in_specs, out_specs, check_vma: bool = True, axis_names=None):
    """`jax.shard_map` with keyword arguments, the form both versions accept.

    axis_names: the mesh axes the body is manual over (None: all of them); the others stay Auto,
    partitioned by XLA inside the body.
    """
    kwargs = {} if axis_names is None else {"axis_names": frozenset(axis_names)}
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **kwargs)


def current_mesh():
    """The current abstract mesh (set by `jax.set_mesh`; inside shard_map its manual axes say so),
    or None when there is none."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    if get is None:  # pragma: no cover - older jax
        return None
    mesh = get()
    if mesh is None or mesh.empty:
        return None
    return mesh


def mesh_axis_kinds(mesh) -> dict:
    """{axis name: "auto" | "explicit" | "manual"} of a mesh (jax.sharding.AxisType by name)."""
    return {a: str(getattr(t, "name", t)).lower() for a, t in zip(mesh.axis_names, mesh.axis_types)}


@contextlib.contextmanager
def use_mesh(mesh):
    """Make `mesh` the current mesh (jax.set_mesh where present)."""
    if hasattr(jax, "set_mesh"):
        with jax.set_mesh(mesh):
            yield
    else:  # pragma: no cover - older jax
        with mesh:
            yield


def make_mesh(axis_shapes, axis_names, devices=None):
    """A mesh with Explicit axes on both supported versions."""
    kwargs = {}
    if devices is not None:
        kwargs["devices"] = devices
    return jax.make_mesh(tuple(axis_shapes), tuple(axis_names), **kwargs)


@functools.lru_cache(maxsize=None)
def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first GPU, or None when the default backend is not a GPU."""
    if jax.default_backend() != "gpu":
        return None
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if cc is None:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)
