"""Attention backend selection: automatic, overridable by argument and environment, explainable.

The shared policy (te_jax/backends/policy.py): `backend=` argument > TE_JAX_ATTN_BACKEND > the
automatic preference below. TE_JAX_PALLAS_ATTN=0 / TE_JAX_CUDNN_ATTN=0 / TE_JAX_XLA_ATTN=0 disable a
backend everywhere. TE_JAX_DEBUG=1 logs every choice with its reasons (logger "te_jax").

Under a mesh whose axes XLA partitions (jax.set_mesh, outside shard_map) `auto` does not take pallas:
a Pallas kernel is an opaque custom call to the SPMD partitioner and would run replicated (operands
all-gathered, the whole global batch computed on every device). The te_jax.flax attention modules run
the attention per shard (shard_map over the batch / head axes), where pallas is taken again; a
forced pallas is honoured, with a note saying it runs replicated.
"""
from __future__ import annotations

from te_jax import sinks
from te_jax.backends import policy, tuning
from te_jax.backends.base import Reason, ReasonKind, check_backend
from te_jax.backends.choice import BackendChoice, Decision, OpTable, choose
from te_jax.backends.cudnn import CudnnBackend
from te_jax.backends.pallas import PallasBackend
from te_jax.backends.xla import XlaBackend


def _register(*backends) -> dict:
    """The attention backends by name, each checked against te_jax.backends.base.AttentionBackend."""
    for b in backends:
        check_backend(b)
    return {b.name: b for b in backends}


# Registration: a new backend is one file in te_jax/backends/ plus its instance here. Everything else derives
# from this line: the names, the TE_JAX_<NAME>_ATTN switch, forcing by name, the explanation, and the protocol and
# conformance tests. auto takes it only once it has a place in a measured preference order
# (te_jax/backends/tuning.py); until then its reason says so and backend=<name> runs it.
BACKENDS = _register(PallasBackend(), CudnnBackend(), XlaBackend())
BACKEND_NAMES = tuple(BACKENDS)
FORCE_ENV = "TE_JAX_ATTN_BACKEND"


def disable_env(name: str) -> str:
    """The variable that disables backend `name` (TE_JAX_PALLAS_ATTN=0, TE_JAX_CUDNN_ATTN=0, ...)."""
    return f"TE_JAX_{name.upper()}_ATTN"

def gpu_preference(call) -> tuple[tuple[str, ...], str]:
    """Backend order on a GPU for this call, with the measurement that justifies it (te_jax/backends/tuning.py)."""
    if BACKENDS["pallas"].decode_reason(call) is None:
        rec = tuning.DECODE_GPU_PREFERENCE
        return rec.value, (f"q_len {call.dims.q_len} (a short query against a KV cache) runs te_jax's decode "
                           f"kernel: {rec.evidence} ({rec.results})")
    hopper = BACKENDS["pallas"].hopper_reason(call) is None
    d, causal = call.dims.head_dim_qk, call.mask.causal
    kind = f"head_dim {d} {'causal' if causal else 'non-causal'}"
    rec = tuning.HOPPER_FASTER_MAX_LEN.get((d, causal))
    limit = rec.value if rec is not None else 0
    evidence = (f"{rec.evidence}; {rec.results}" if rec is not None
                else f"no measurement for head_dim {d}; {tuning.ATTENTION_HOPPER_RESULTS}")
    if hopper and call.dims.q_len <= limit:
        return ("pallas",) + tuple(n for n in tuning.ATTENTION_GPU_PREFERENCE.value if n != "pallas"), (
            f"te_jax's Hopper kernel measured faster than cuDNN forward+backward on H100 for "
            f"{kind} q_len <= {limit} ({evidence})")
    portable = tuning.ATTENTION_GPU_PREFERENCE
    if hopper:
        scope = f"q_len > {limit}" if limit else "any q_len measured (1k-16k)"
        why = (f"cuDNN measured as fast or faster forward+backward than te_jax's Hopper kernel on H100 for "
               f"{kind} {scope} ({evidence})")
    else:
        why = f"{portable.evidence} ({portable.results})"
    return portable.value, why


def _auto(call, reasons) -> Decision:
    """auto: the measured preference order; a Pallas-style opaque kernel is avoided under a mesh XLA
    partitions; every other serving backend is recorded as a fallback."""
    mesh_axes = call.partitioned_axes
    if mesh_axes:
        for name, b in BACKENDS.items():
            if b.capabilities.opaque_kernel and reasons[name] is None:
                reasons[name] = Reason(policy.pallas_replicated_reason(mesh_axes), ReasonKind.AVOIDED)
    if call.platform == "gpu":
        order, why = gpu_preference(call)
    else:
        order, why = tuning.ATTENTION_OTHER_PREFERENCE.value, f"the xla backend comes first on {call.platform}"
    for name in BACKENDS:
        if name not in order and reasons[name] is None:
            reasons[name] = Reason(
                f"serves the call, but has no place in the automatic preference order on {call.platform} "
                f"(te_jax/backends/tuning.py, a measured choice); pass backend={name!r} to use it", ReasonKind.AVOIDED)
    selected = next((n for n in order if reasons[n] is None), None)
    if selected is not None and selected != order[0]:
        why = f"{why}; {order[0]!r}, first in that order, is not taken here (see its reason)"
    for name in order:
        if name != selected and reasons[name] is None and selected is not None:
            reasons[name] = Reason(f"serves the call, but {selected!r} is preferred: {why}",
                                   ReasonKind.FALLBACK_ALLOWED)
    return Decision(selected)


def _forced(call, forced, source, requested, reasons) -> Decision:
    selected = forced if reasons[forced] is None else None
    for name in BACKENDS:
        if name != forced and reasons[name] is None:
            reasons[name] = Reason(f"serves the call, but {forced!r} was forced by {source}",
                                   ReasonKind.FALLBACK_ALLOWED)
    notes = ()
    if selected is not None and call.partitioned_axes and BACKENDS[selected].capabilities.opaque_kernel:
        notes = (policy.pallas_forced_replicated_note(call.partitioned_axes),)
    return Decision(selected, notes)


ATTENTION = OpTable("attention", BACKEND_NAMES, FORCE_ENV, {n: disable_env(n) for n in BACKEND_NAMES},
                    auto=_auto, forced=_forced)


def choose_backend(call, backend: str = "auto") -> BackendChoice:
    """Decide which backend serves `call` and record the reason for every other one."""
    def unsupported(name, forced):
        b = BACKENDS[name]
        if call.kernel_config is not None and not b.capabilities.kernel_config:
            return (f"config={type(call.kernel_config).__name__}(...) configures a Pallas kernel; the {name} "
                    f"backend takes no kernel configuration")
        if call.softmax_type != "vanilla" and not b.capabilities.returns_lse:
            return sinks.unsupported_reason(name, call.softmax_type)
        return b.unsupported_reason(call, forced=forced)

    choice = choose(ATTENTION, backend, unsupported, ctx=call, detail=lambda name: BACKENDS[name].choice_detail(call))
    if call.softmax_type != "vanilla" and choice.selected is not None:
        choice.notes.append(sinks.selected_note(choice.selected, call.softmax_type))
    return choice


def unavailable_error(choice: BackendChoice) -> ValueError:
    lines = "\n".join(f"  {n}: {w}" for n, w in choice.reasons.items())
    return ValueError(
        f"No attention backend can serve this call ({choice.source}). Reasons:\n{lines}\n"
        f"Change what a reason names (dtype, head_dim, mask, window, ...), allow another backend, or "
        f"use backend='xla', which serves every call.")
