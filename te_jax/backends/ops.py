"""The norm and MLP ops' backend tables for the shared selector (te_jax/backends/choice.py).

Backends "pallas" (Triton-lowered Pallas kernels; interpret mode off-GPU, for tests) and "xla". auto
takes pallas on a GPU where it serves and was measured faster (te_jax/backends/tuning.py), xla
elsewhere, and xla under a mesh whose axes XLA partitions (the kernel would run replicated).
"""
from __future__ import annotations

import dataclasses

import jax

from te_jax.backends import policy, tuning
from te_jax.backends.choice import BackendChoice, Decision, OpTable, choose

NAMES = ("pallas", "xla")


@dataclasses.dataclass(frozen=True)
class _Ctx:
    op: str
    pref_key: str  # "layernorm" | "rmsnorm" | "mlp": the key of the measured preference
    auto_notes: tuple


def _preference(key) -> tuning.Tuned | None:
    if key == "mlp":
        return tuning.MLP_GPU_PREFERENCE
    if key == "paged_decode":
        return tuning.PAGED_DECODE_GPU_PREFERENCE
    return tuning.NORM_GPU_PREFERENCE.get(key)


def _evidence(key) -> str:
    rec = None if key == "mlp" else _preference(key)  # the MLP's evidence is in its own auto notes (mlp.py)
    return f" ({rec.evidence}; {rec.results})" if rec is not None else ""


def _auto(ctx: _Ctx, reasons) -> Decision:
    notes = []
    on_gpu = jax.default_backend() == "gpu"
    mesh_axes = policy.partitioned_mesh_axes()
    if reasons.get("pallas") is None and on_gpu and getattr(_preference(ctx.pref_key), "value", None) == "pallas":
        if mesh_axes:
            selected = "xla"
            notes.append(f"auto: pallas not taken: {policy.pallas_replicated_reason(mesh_axes)}; so xla "
                         "(which XLA partitions). The Flax modules given layernorm_input_axes run pallas per "
                         "shard")
        else:
            selected = "pallas"
            notes.append("auto: on GPU pallas serves this call and was measured faster than xla"
                         + _evidence(ctx.pref_key))
    else:
        selected = "xla"
        if not on_gpu:
            notes.append(f"auto: default backend is {jax.default_backend()!r}, not a GPU; the Pallas "
                         "kernels would run only in interpret mode (for tests), so xla")
        elif reasons.get("pallas") is not None:
            notes.append("auto: pallas cannot serve this call, so xla")
        else:
            notes.append("auto: on GPU xla is this op's measured choice" + _evidence(ctx.pref_key))
    notes.extend(ctx.auto_notes)
    return Decision(selected, tuple(notes))


def _forced_by(table_force_env):
    def forced(ctx: _Ctx, name, source, requested, reasons) -> Decision:
        notes = [f"backend {name!r} forced by the {source}"]
        error = None
        selected = name
        on_gpu = jax.default_backend() == "gpu"
        if reasons.get(name) is not None:
            error = (f"{ctx.op}: backend {name!r} was forced but cannot serve this call: "
                     f"{reasons[name]}. Fix: use backend='auto' or 'xla'" +
                     (f" (and unset {table_force_env})" if requested == "auto" else "") + ".")
            selected = None
        elif name == "pallas" and not on_gpu:
            notes.append("pallas on a non-GPU backend runs in interpret mode (slow; meant for tests)")
        mesh_axes = policy.partitioned_mesh_axes()
        if name == "pallas" and mesh_axes:
            notes.append(policy.pallas_forced_replicated_note(mesh_axes))
        return Decision(selected, tuple(notes), error)
    return forced


def _table(kind, force_env, disable_var) -> OpTable:
    return OpTable(kind, NAMES, force_env, {"pallas": disable_var}, auto=_auto, forced=_forced_by(force_env),
                   disabled_replaces=False, style="compact")


NORM = _table("norm", "TE_JAX_NORM_BACKEND", "TE_JAX_PALLAS_NORM")
MLP = _table("mlp", "TE_JAX_MLP_BACKEND", "TE_JAX_PALLAS_MLP")
TABLES = {t.force_env: t for t in (NORM, MLP)}


def select_backend(op: str, requested: str, reasons: dict, *, force_env: str, disable_env: str,
                   pref_key: str, auto_notes: tuple = ()) -> BackendChoice:
    """`choose` for the norm and MLP ops. reasons: backend -> None (can serve) or why not."""
    table = TABLES.get(force_env)
    if table is None or table.disable_env["pallas"] != disable_env:
        table = _table(op, force_env, disable_env)
    return choose(table, requested, lambda name, forced: reasons.get(name), op=op,
                  ctx=_Ctx(op, pref_key, tuple(auto_notes)))
