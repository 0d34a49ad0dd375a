"""Attention sinks: TransformerEngine's `softmax_type` ("vanilla", "off-by-one", "learnable").

For logits S = scale·Q·Kᵀ (then softcap, bias and masks, as te_jax applies them) of one head h:

    "vanilla":    P_j = exp(S_j) / Σ_k exp(S_k)
    "off-by-one": P_j = exp(S_j) / (1 + Σ_k exp(S_k))             (a sink logit fixed at 0)
    "learnable":  P_j = exp(S_j) / (exp(α_h) + Σ_k exp(S_k))      (α = softmax_offset, one per head; gpt-oss)

The sink is one more key per row with logit `sink` (0, or α_h) and value 0, as TransformerEngine defines it
(its JAX reference adds the offset to the softmax denominator beside the already scaled logits): the sink
logit is not scaled, not soft-capped, not biased and never masked. Sums run over the keys a row sees; a row
that sees no key gives zeros, like vanilla (TransformerEngine's reference does the same).

How te_jax computes it: the sink is merged AFTER the vanilla attention over the visible keys, from the row
logsumexp that attention returns. With (out, lse) of the vanilla attention,

    lse' = logaddexp(lse, sink),   out' = out · exp(lse - lse') = out · sigmoid(lse - sink)

(rows with no visible key, lse = -inf: out' = 0, lse' = sink). This is exact (the sink's value is 0, so it
only rescales each row) and differentiable: autodiff through the merge hands the kernel an lse cotangent,
which te_jax's kernels take (the backward's delta = rowsum(dO·O) − dlse), and gives the offset's gradient
d α_h = −Σ_{batch, rows of head h} P_sink · rowsum(dO'·O'), with P_sink = exp(sink − lse') = 1 − sigmoid(lse − sink).

A backend serves sinks when its forward returns the row logsumexp differentiably (Capabilities.returns_lse):
"xla" and "pallas" (portable and Hopper kernels). "cudnn" does not: jax.nn.dot_product_attention returns the
output only; `unsupported_reason` says so in `explain_attention_backend`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# TransformerEngine-JAX's AttnSoftmaxType.from_str spells it with an underscore; its Flax docstrings and
# PyTorch use the hyphen. Both are accepted; the hyphen is canonical here.
_ALIASES = {"off_by_one": "off-by-one"}


def check_softmax_type(softmax_type, where: str = "") -> str:
    """The canonical softmax_type ("vanilla", "off-by-one" or "learnable"); ValueError for anything else."""
    prefix = f"{where}: " if where else ""
    if isinstance(softmax_type, str):
        name = _ALIASES.get(softmax_type, softmax_type)
        if name in SOFTMAX_TYPES:
            return name
    raise ValueError(
        f"{prefix}softmax_type={softmax_type!r} is unknown; expected one of {SOFTMAX_TYPES} "
        f"(TransformerEngine's names: 'vanilla' = plain softmax, 'off-by-one' = a sink logit 0 in every row's "
        f"denominator, 'learnable' = a learned sink logit per head, passed as softmax_offset).")


def check_softmax_offset(softmax_type: str, softmax_offset, num_heads: int, where: str = ""):
    """Validate softmax_offset against softmax_type (already canonical) and the query head count.

    "learnable" needs softmax_offset of shape [h] or [1, h, 1, 1] (TransformerEngine stores it so), a float
    array; the other types take none. Returns the offset as given (or None)."""
    prefix = f"{where}: " if where else ""
    if softmax_type != "learnable":
        if softmax_offset is not None:
            raise ValueError(
                f"{prefix}softmax_offset was given with softmax_type={softmax_type!r}; only softmax_type="
                f"'learnable' takes a softmax_offset (off-by-one's sink logit is fixed at 0). Pass "
                f"softmax_type='learnable' or drop softmax_offset.")
        return None
    if softmax_offset is None:
        raise ValueError(
            f"{prefix}softmax_type='learnable' needs softmax_offset, the per-head sink logit: a float array of "
            f"shape [h] = [{num_heads}] (or TransformerEngine's [1, h, 1, 1] = [1, {num_heads}, 1, 1]).")
    shape = tuple(getattr(softmax_offset, "shape", ()))
    if shape not in ((num_heads,), (1, num_heads, 1, 1)):
        raise ValueError(
            f"{prefix}softmax_offset has shape {shape}; softmax_type='learnable' takes one sink logit per query "
            f"head: [h] = [{num_heads}] or TransformerEngine's [1, h, 1, 1] = [1, {num_heads}, 1, 1].")
    dtype = getattr(softmax_offset, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{prefix}softmax_offset has dtype {dtype}; it must be a float array (it is used in fp32).")
    return softmax_offset


def sink_logits(softmax_type: str, softmax_offset, num_heads: int):
    """The per-head sink logit [h] float32 for a validated call, or None for "vanilla"."""
    if softmax_type == "vanilla":
        return None
    if softmax_type == "off-by-one":
        return jnp.zeros((num_heads,), jnp.float32)
    return jnp.asarray(softmax_offset).reshape((num_heads,)).astype(jnp.float32)


def merge_sink(out, lse, sink):
    """Fold the sink into a finished attention: (out', lse') from out [b, s, h, d], lse [b, h, s] f32, sink [h].

    out' = out · sigmoid(lse − sink) in out.dtype (the arithmetic in fp32); lse' = logaddexp(lse, sink).
    Rows with lse = -inf (no visible key) give out' = 0 and lse' = sink, with zero (finite) gradients.
    """
    sink_b = jnp.asarray(sink, jnp.float32)[None, :, None]  # [1, h, 1]
    lse = lse.astype(jnp.float32)
    finite = jnp.isfinite(lse)
    lse_safe = jnp.where(finite, lse, sink_b)  # keeps -inf out of the arithmetic (and its gradient)
    w = jnp.where(finite, jax.nn.sigmoid(lse_safe - sink_b), 0.0)  # [b, h, s]: 1 - P_sink
    new_lse = jnp.where(finite, jnp.logaddexp(lse_safe, sink_b), sink_b)
    scaled = out.astype(jnp.float32) * jnp.swapaxes(w, 1, 2)[..., None]
    return scaled.astype(out.dtype), new_lse


def unsupported_reason(backend: str, softmax_type: str) -> str:
    """Why a backend without Capabilities.returns_lse does not serve a call with attention sinks."""
    why = {"cudnn": "jax.nn.dot_product_attention(implementation='cudnn') returns the output only, not the "
                    "row logsumexp"}.get(backend, f"the {backend} backend does not return the row logsumexp")
    return (f"softmax_type={softmax_type!r} (attention sink): te_jax adds the sink to each row's softmax "
            f"denominator by merging it with the attention's row logsumexp, and {why}; the 'pallas' and 'xla' "
            f"backends serve it")


def selected_note(backend: str, softmax_type: str) -> str:
    """The explanation's note on how the selected backend serves a call with attention sinks."""
    return (f"softmax_type={softmax_type!r}: the sink is merged after the {backend} attention from its row "
            f"logsumexp (te_jax/sinks.py), in the forward and through the backward")
