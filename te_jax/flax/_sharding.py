"""Running an op per shard under a mesh: the one mechanism the Flax modules share (norms, LayerNorm-Dense,
LayerNorm-MLP, attention).

Why: a Pallas kernel (pl.pallas_call) is an opaque custom call to XLA's SPMD partitioner. Under jit on
a mesh whose axes XLA partitions (jax.set_mesh, Auto axes), called on sharded arrays outside shard_map,
it runs replicated: its operands are all-gathered and every device computes the whole global batch.
The modules know the logical axis names of their operands (flax.linen logical axis rules map them to
mesh axes), so `run_per_shard` runs the op in a shard_map over the mesh axes that split the operands
along the axes the op treats independently (rows for a norm; batch and heads for attention): each
device then computes only its own shard, with whatever backend `auto` picks there (inside shard_map
the mesh axes are Manual, so te_jax.backends.policy.partitioned_mesh_axes() no longer names them and
the Pallas kernels are taken again where they serve).

Rules (each a fallback to calling the op as it is, under the partitioner):
  - no mesh axis XLA partitions, no logical axis rules active, or a mesh axis that is Explicit/Manual;
  - an operand axis the op needs whole (not in `split`: a norm's hidden axis, attention's sequence,
    any axis of a parameter) is sharded over a partitioned mesh axis (tensor or sequence parallelism);
    except FSDP: an operand the caller names a parameter (`params`), sharded over a mesh axis that also
    splits the operands along a `split` axis, is passed whole (all-gathered before the shard_map, its
    cotangent summed back), as FSDP gathers it for the op anyway;
  - a split axis does not divide by the product of its mesh axes' sizes, or one mesh axis would
    split two axes of one operand;
  - nothing would be split over a partitioned axis.
The shard_map is manual over the mesh axes that split some operand only: an operand not split over
one of them is passed whole to each shard (a parameter, a broadcast bias) and its cotangent is summed
over that axis by shard_map's transpose; the mesh axes no operand is split over stay Auto.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Collection, Sequence

import flax.linen as nn
from jax.sharding import PartitionSpec as P

from te_jax import _compat
from te_jax.backends import policy

#: Logical names of one array's axes: one name (or None: never split, never checked) per axis.
AxisNames = Sequence["str | None"]


def mesh_axes_of(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def mesh_axes_per_dim(names: AxisNames) -> tuple:
    """The PartitionSpec entry of each axis of one array with these logical names, under the active rules.

    Resolved for the array as a whole, as nn.with_logical_constraint and parameter shardings are (a mesh
    axis goes to the first axis whose name claims it). A name that repeats (a bias's two sequence axes)
    takes its first occurrence's entry.
    """
    first: dict = {}
    unique = []
    for i, n in enumerate(names):
        if n is not None and n in first:
            unique.append(None)
        else:
            unique.append(n)
            if n is not None:
                first[n] = i
    mapped = tuple(nn.logical_to_mesh_axes(tuple(unique)))
    mapped += (None,) * (len(names) - len(mapped))
    return tuple(mapped[first[n]] if n is not None else None for n in names)


def _spec_entry(axes: tuple):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How `run_per_shard` runs an op: shard_map over `manual` with these specs."""

    mesh: Any
    manual: frozenset  # mesh axes the shard_map is manual over
    in_specs: tuple  # one PartitionSpec per operand that is not None
    out_spec: P  # applied to every output leaf (a spec of the leading axes)


def plan_per_shard(args: Sequence, arg_names: Sequence[AxisNames | None], out_names: AxisNames,
                   split: Collection[str], params: Collection[int] = ()) -> tuple[ShardPlan | None, str]:
    """(plan, "") when the op can run per shard under the current mesh and logical axis rules,
    else (None, why not).

    args: the operands (arrays, ShapeDtypeStructs, or None: absent).
    arg_names: per operand, the logical names of its axes (None or (): no names, passed whole).
    out_names: logical names of the output's leading axes (every output leaf gets that spec; names
      not in `split` are left unsplit).
    split: the logical names along which the op is independent (it may run on a slice of them).
    params: indices of the operands that are parameters (FSDP-sharded ones are gathered, see above).
    """
    partitioned = policy.partitioned_mesh_axes()
    if not partitioned:
        return None, "no mesh axis that XLA partitions (no mesh, or inside shard_map)"
    if not nn.get_logical_axis_rules():
        return None, "no logical axis rules active"
    mesh = _compat.current_mesh()
    kinds = _compat.mesh_axis_kinds(mesh)
    if any(k != "auto" for k in kinds.values()):
        return None, f"the mesh has non-Auto axes {kinds}"
    sizes = {a: int(s) for a, s in zip(mesh.axis_names, mesh.axis_sizes)}
    split = frozenset(n for n in split if n is not None)
    # The mesh axes that split some operand along a `split` axis. A parameter whose whole-needed axis is
    # sharded over one of them is the FSDP pattern (("batch", "data") and ("embed", "data")): it is passed
    # whole, all-gathered before the shard_map as FSDP gathers it anyway, and its cotangent summed back.
    # Sharded over any other axis (tensor or sequence parallelism), the op cannot run per shard.
    splitting = set()
    for a, names in zip(args, arg_names):
        if a is not None and names and len(names) == a.ndim:
            for name, entry in zip(names, mesh_axes_per_dim(tuple(names))):
                if name in split:
                    splitting |= {x for x in mesh_axes_of(entry) if x in partitioned}
    manual: set = set()
    specs = []
    for i, (a, names) in enumerate(zip(args, arg_names)):
        if a is None:
            continue
        names = tuple(names) if names else (None,) * a.ndim
        if len(names) != a.ndim:
            raise ValueError(f"operand {i}: {len(names)} logical axis names {names} for shape {tuple(a.shape)}")
        mapped = mesh_axes_per_dim(names)
        entries, used = [], []
        for dim, name, entry in zip(a.shape, names, mapped):
            axes = mesh_axes_of(entry)
            if name not in split:
                hit = tuple(x for x in axes if x in partitioned)
                if hit and not (i in params and set(hit) <= splitting):
                    return None, (f"operand {i} axis {name!r} is sharded over {hit}, and the op needs it whole")
                entries.append(None)
                continue
            n = math.prod(sizes[x] for x in axes)
            if dim % n:
                return None, f"operand {i} axis {name!r} of size {dim} does not divide over {axes} ({n} shards)"
            used += axes
            entries.append(_spec_entry(axes))
        if len(set(used)) != len(used):
            return None, f"operand {i}: one mesh axis would split two of its axes ({used})"
        manual |= set(used)
        specs.append(P(*entries))
    if not manual & set(partitioned):
        return None, f"no operand is split over the partitioned axes {tuple(partitioned)}"
    out_mapped = mesh_axes_per_dim(tuple(out_names))
    out_spec = P(*(_spec_entry(mesh_axes_of(e)) if n in split else None for n, e in zip(out_names, out_mapped)))
    return ShardPlan(mesh, frozenset(manual), tuple(specs), out_spec), ""


def partitioned_axes_of(name: str) -> tuple:
    """The mesh axes XLA partitions (policy.partitioned_mesh_axes) that the logical axis `name` maps to
    under the active rules and mesh; () without them."""
    if not nn.get_logical_axis_rules() or _compat.current_mesh() is None:
        return ()
    partitioned = policy.partitioned_mesh_axes()
    return tuple(a for a in mesh_axes_of(mesh_axes_per_dim((name,))[0]) if a in partitioned)


def run_per_shard(op: str, fn: Callable, args: Sequence, arg_names: Sequence[AxisNames | None],
                  out_names: AxisNames, *, split: Collection[str], params: Collection[int] = ()):
    """fn(*args), run per shard (shard_map) when `plan_per_shard` allows, else called as it is.

    fn must compute each slice of its operands along the `split` axes independently (a norm row by row,
    attention batch entry by batch entry and head by head), so that the per-shard run equals the
    global one. None operands are passed through as None. TE_JAX_DEBUG=1 logs the decision.
    """
    plan, why = plan_per_shard(args, arg_names, out_names, split, params)
    if plan is None:
        if policy.debug_enabled() and policy.partitioned_mesh_axes():
            policy.logger.warning("%s: not run per shard: %s", op, why)
        return fn(*args)
    if policy.debug_enabled():
        policy.logger.warning("%s: run per shard over mesh axes %s (in_specs %s)", op, sorted(plan.manual),
                              plan.in_specs)
    present = [a for a in args if a is not None]

    def body(*arrays):
        it = iter(arrays)
        return fn(*[None if a is None else next(it) for a in args])

    # check_vma=False: Pallas kernels in interpret mode (CPU) fail the varying-manual-axes check.
    return _compat.shard_map(body, mesh=plan.mesh, in_specs=plan.in_specs, out_specs=plan.out_spec,
                             axis_names=plan.manual, check_vma=False)(*present)
