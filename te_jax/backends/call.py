"""The static description of an attention call that backend selection reasons about."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from te_jax import _compat
from te_jax.layouts import AttentionDims
from te_jax.masks import MaskSpec


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """Everything about a call that decides which backend may serve it (no array values)."""

    attn_input_format: str
    dims: AttentionDims
    dtype: jnp.dtype
    mask: MaskSpec
    padding_source: str  # "none" | "seqlens" | "segment_ids"
    window: tuple[int, int]
    bias_shape: tuple[int, ...] | None
    softcap: float | None
    dropout_rate: float
    platform: str
    compute_capability: tuple[int, int] | None
    needs_split_vjp: bool = False  # context parallelism calls forward/backward separately
    # Mesh axes XLA's SPMD partitioner splits arrays over at this call (jax.set_mesh, outside shard_map):
    # a Pallas kernel here would run replicated. Empty inside shard_map and for callers that run the
    # backend per shard themselves (context parallelism).
    partitioned_axes: tuple[str, ...] = ()
    # Shape of a dense boolean `mask` ([B|1, H|1, Sq, Skv], True = masked out), None without one.
    mask_shape: tuple[int, ...] | None = None
    # A kernel configuration the caller passed (dot_product_attention(config=...)): the portable kernel's
    # BlockSizes or the Hopper kernel's HopperConfig, served by the pallas backend only. None: defaults.
    kernel_config: object | None = None
    # TransformerEngine's softmax_type: "vanilla", "off-by-one" or "learnable" (attention sinks, te_jax/sinks.py),
    # served by the backends whose forward returns the row logsumexp (Capabilities.returns_lse).
    softmax_type: str = "vanilla"

    @property
    def dtype_name(self) -> str:
        return jnp.dtype(self.dtype).name

    @property
    def gpu_arch(self) -> str:
        if self.compute_capability is None:
            return self.platform
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"


def current_platform() -> tuple[str, tuple[int, int] | None]:
    return jax.default_backend(), _compat.gpu_compute_capability()
