"""The declared interface of an attention backend, and the structured reasons selection records.

A backend is one object with a `name`, frozen `capabilities`, `unsupported_reason(call, forced=False)`
(None when it serves the call, else the why-not), `choice_detail(call)` (a line for the explanation, ""
for none) and `forward(...)`. Each capability it declares adds the methods of the matching protocol
below; `check_backend` verifies the declaration when the backend is registered
(te_jax/backends/selection.py), so callers test `capabilities`, never `hasattr`.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond `forward`."""

    split_backward: bool = False  # forward_only / backward with logsumexp (context parallelism): SplitBackward
    ring_blocks: bool = False  # mask-free per-block kernel for ring attention: RingBlocks
    packed_inputs: bool = False  # reads packed q/k/v in place: PackedInputs
    dense_mask: bool = False  # forward takes a dense boolean mask=
    opaque_kernel: bool = False  # an opaque custom call: runs replicated under a mesh XLA partitions
    kernel_config: bool = False  # takes a kernel configuration (dot_product_attention(config=...))
    # forward(..., with_lse=True) (and forward_packed, with packed_inputs) returns (out, lse [b, h, s_q] f32),
    # differentiable in both: attention sinks (softmax_type, te_jax/sinks.py) are merged after it.
    returns_lse: bool = False


@runtime_checkable
class AttentionBackend(Protocol):
    name: str
    capabilities: Capabilities

    def unsupported_reason(self, call, forced: bool = False) -> str | None:
        """None when this backend serves `call`, else why not. forced: the user asked for this backend."""

    def choice_detail(self, call) -> str:
        """One line on how the backend runs `call` when selected (e.g. which kernel), or ""."""

    def forward(self, call, q, k, v, tm, bias, *, scale, softcap, causal, window, dropout_rate, dropout_rng,
                mask=None):
        """out [b, s, h, d_v] from canonical q/k/v [b, s, heads, d]. A backend declaring returns_lse also
        takes with_lse=True (passed only then) and returns (out, lse [b, h, s] f32; -inf on rows with no
        visible key), differentiable in both."""


# config= of the split and ring-block methods: the call's kernel configuration (AttentionCall.kernel_config),
# which reaches only a backend declaring kernel_config (selection refuses it for the others), or None.
@runtime_checkable
class SplitBackward(Protocol):
    def forward_only(self, q, k, v, tm, bias, *, scale, softcap, causal, window, config=None):
        """(out, lse)."""

    def backward(self, q, k, v, tm, bias, out, lse, dout, dlse=None, *, scale, softcap, causal, window,
                 config=None):
        """(dq, dk, dv, dbias)."""


@runtime_checkable
class RingBlocks(Protocol):
    def ring_block_reason(self, call, q_block_shape, kv_block_shape, half_blocks: bool) -> str | None:
        """None when the mask-free block kernel serves the ring's per-block calls, else why not."""

    def dense_forward(self, q, k, v, *, scale, causal, config=None):
        """(out, lse) of one mask-free block pair."""

    def dense_backward(self, q, k, v, out, lse, dout, *, scale, causal, config=None):
        """(dq, dk, dv) of one mask-free block pair."""


@runtime_checkable
class PackedInputs(Protocol):
    def packed_input_reason(self, call, qkv_layout: str, tensors, num_heads: int, num_gqa_groups: int):
        """None when `forward_packed` reads the packed tensor(s) in place, else why they must be split."""

    def forward_packed(self, call, qkv_layout, tensors, tm, bias, *, num_heads, num_gqa_groups, scale, softcap,
                       causal, window, mask=None):
        """out [b, s, h, d] from the packed tensor(s) as they lie ((out, lse) with with_lse=True, as forward)."""


CAPABILITY_PROTOCOLS = {"split_backward": SplitBackward, "ring_blocks": RingBlocks, "packed_inputs": PackedInputs}


def check_backend(backend) -> None:
    """Raise TypeError unless `backend` satisfies AttentionBackend and the protocol of every capability
    it declares."""
    if not isinstance(backend, AttentionBackend) or not isinstance(getattr(backend, "capabilities", None),
                                                                   Capabilities):
        raise TypeError(f"{backend!r} does not satisfy te_jax.backends.base.AttentionBackend (name, capabilities: "
                        f"Capabilities, unsupported_reason, choice_detail, forward)")
    for cap, proto in CAPABILITY_PROTOCOLS.items():
        if getattr(backend.capabilities, cap) and not isinstance(backend, proto):
            raise TypeError(f"backend {backend.name!r} declares {cap} but does not implement {proto.__name__}")


class ReasonKind(enum.Enum):
    """Why a backend was not taken, as data (`run_backend` falls back only to FALLBACK_ALLOWED)."""

    UNSUPPORTED = "unsupported"  # the backend cannot serve the call
    DISABLED = "disabled"  # turned off by an environment variable
    AVOIDED = "avoided"  # serves the call, but auto does not take it here (e.g. it would run replicated)
    FALLBACK_ALLOWED = "fallback allowed"  # serves the call; another was preferred or forced
    REFUSED = "refused"  # refused at trace time


class Reason(str):
    """An explanation text (a str, printed as is) that carries its `kind`."""

    kind: ReasonKind

    def __new__(cls, text: str, kind: ReasonKind):
        self = super().__new__(cls, text)
        self.kind = kind
        return self

    def __reduce__(self):
        return (Reason, (str(self), self.kind))

    @property
    def fallback_allowed(self) -> bool:
        return self.kind is ReasonKind.FALLBACK_ALLOWED


def reason(text: str | None, kind: ReasonKind) -> Reason | None:
    """`text` as a Reason of `kind` (None stays None; a Reason keeps its own kind)."""
    if text is None or isinstance(text, Reason):
        return text
    return Reason(text, kind)
