"""The selection policy every op shares (attention, norms, MLP).

Precedence: a `backend=` argument (not "auto") > the op's TE_JAX_<OP>_BACKEND variable > the
op's automatic preference. A TE_JAX_PALLAS_<OP>=0 style variable disables one backend: 0, false,
no, off (any case) disable, 1, true, yes, on or empty leave it on, anything else raises ValueError.
TE_JAX_DEBUG=1 logs every choice with its reasons (logger "te_jax"; the same false spellings
turn it off).
"""
from __future__ import annotations

import logging
import os

from te_jax import _compat

logger = logging.getLogger("te_jax")


FALSE_SPELLINGS = ("0", "false", "no", "off")
TRUE_SPELLINGS = ("", "1", "true", "yes", "on")


def debug_enabled() -> bool:
    return os.environ.get("TE_JAX_DEBUG", "").strip().lower() not in ("",) + FALSE_SPELLINGS


def disabled_by_env(var: str) -> str | None:
    """The reason a backend is off when `var` is set to a false spelling (0, false, no, off; any case),
    else None. Raises ValueError naming the variable for a value that is neither true nor false."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in FALSE_SPELLINGS:
        return f"disabled by environment {var}={raw.strip()}"
    if value in TRUE_SPELLINGS:
        return None
    raise ValueError(f"environment {var}={raw!r} is not understood: set it to 0, false, no or off to disable "
                     f"the backend, 1, true, yes or on (or unset it) to leave it enabled.")


def env_choice(var: str, choices: tuple[str, ...], default: str) -> str:
    """The value of environment variable `var` (default when unset), which must be one of `choices`; a
    ValueError naming the variable, the value and the choices otherwise."""
    value = os.environ.get(var, default)
    if value not in choices:
        raise ValueError(f"{var}={value!r} must be one of {choices} (unset: {default!r}).")
    return value


def resolve_request(op: str, requested: str, names: tuple[str, ...], force_env: str) -> tuple[str | None, str]:
    """(forced backend or None for auto, where the decision came from). Raises on unknown names."""
    if not isinstance(requested, str) or (requested != "auto" and requested not in names):
        raise ValueError(f"{op}: backend={requested!r} is not known; expected 'auto' or one of {names}.")
    env = os.environ.get(force_env, "").strip()
    if env and env != "auto" and env not in names:
        raise ValueError(f"{op}: environment {force_env}={env!r} is not known; expected one of {names} "
                         f"(or unset it).")
    if requested != "auto":
        return requested, "argument"
    if env and env != "auto":
        return env, f"environment {force_env}={env}"
    return None, "auto"


def log_choice(choice) -> None:
    if debug_enabled():
        logger.warning("%s", choice)


def partitioned_mesh_axes() -> dict:
    """{axis: size} of the current mesh's axes (jax.set_mesh) that XLA's SPMD partitioner splits
    arrays over: not Manual (inside shard_map), size > 1. Empty without a mesh.

    A Pallas kernel is an opaque custom call to that partitioner: called on arrays sharded over
    these axes outside shard_map, it runs replicated (operands all-gathered, the whole global
    array computed on every device). The Flax modules run their Pallas norm / MLP / attention
    kernels per shard (shard_map, te_jax/flax/_sharding.py) where the logical axis rules tell them
    how the operands are split.
    """
    mesh = _compat.current_mesh()
    if mesh is None:
        return {}
    kinds = _compat.mesh_axis_kinds(mesh)
    return {a: int(s) for a, s in zip(mesh.axis_names, mesh.axis_sizes) if kinds[a] != "manual" and int(s) > 1}


def pallas_replicated_reason(axes) -> str:
    """Why a Pallas kernel is not taken automatically under a mesh whose `axes` XLA partitions
    (the text norms and attention share; axes: names, or partitioned_mesh_axes()'s dict)."""
    return (f"under a mesh whose axes {tuple(axes)} XLA partitions, a Pallas kernel would run replicated on "
            "every device (an opaque custom call to the SPMD partitioner: operands all-gathered, the whole "
            "global array computed everywhere); call inside shard_map or through te_jax.flax modules (which do)")


def pallas_forced_replicated_note(axes) -> str:
    """The note on a forced Pallas kernel under a mesh whose `axes` XLA partitions (outside shard_map)."""
    return (f"pallas forced outside shard_map under a mesh whose axes {tuple(axes)} XLA partitions: the kernel "
            "runs replicated (operands all-gathered, the whole global array computed on every device); call "
            "inside shard_map or through te_jax.flax modules (which do)")
