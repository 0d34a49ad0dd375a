"""Every difference between the supported JAX versions (0.10.2 and 0.11.x) lives here or in
pallas_kernels/_compat.py.

Library code imports Pallas, shard_map and mesh helpers from this module only; the kernels'
share (pl, pltriton, triton_params, default_interpret, mosaic_gpu) is defined in
pallas_kernels/_compat.py and re-exported here, so a new JAX release means editing these two files.
"""
from __future__ import annotations

import contextlib
import functools

import jax

# The kernels' half lives in pallas_kernels/_compat.py (jax imports only), re-exported here.
from pallas_kernels._compat import (  # noqa: F401  (re-exported)
    default_interpret,
    mosaic_gpu,
    pl,
    pltriton,
    triton_params,
)

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


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
