"""Flax linen attention modules: DotProductAttention, MultiHeadAttention, RelativePositionBiases.

Every attention call goes through `te_jax.dot_product_attention`, or for packed layouts (fused
QKV / KV projections, packed inputs to DotProductAttention) `te_jax.dot_product_attention_packed`,
which reads the packed tensor in place where the Pallas kernel can (or, with `context_parallel_axis`
set, `te_jax.context_parallel.context_parallel_attention` on split q, k, v); these validate the call
and pick the backend.

Logical axis names of the MultiHeadAttention parameters (h heads, g = num_gqa_groups, d head_dim):
  qkv/kernel   [embed, 3, h, d]  ("embed", "qkv", "heads", "kv")      fused self-attention, g == h
  query/kernel [embed, h, d]     ("embed", "heads", "kv")
  kv/kernel    [embed, 2, g, d]  ("embed", "qkv", "kv_heads", "kv")   fused K/V (GQA or cross-attention)
  key/kernel, value/kernel [embed, g, d]  ("embed", "kv_heads", "kv") when fuse_qkv_params=False
  out/kernel   [h, d, embed]     ("heads", "kv", "embed")
  biases: the kernel's names without "embed" (out/bias: ("embed",)); LayerNorm scale/ln_bias ("embed",).
RelativePositionBiases: rel_embedding [h, num_buckets] ("heads", "relpos_buckets").

Under a mesh (jax.set_mesh, Auto axes) with logical axis rules active and no context parallelism, the
attention itself runs per shard: a shard_map over the mesh axes the rules put "batch" on (and "heads"
with "kv_heads", when both map to the same mesh axes), the sequence and head_dim axes whole; seqlens,
segment ids and the bias are split with them (te_jax/flax/_sharding.py, shared with the norm modules).
The activations' names are those above: q [.., "heads", "kv"], k/v [.., "kv_heads", "kv"] after
("batch", "length") (bshd), ("length", "batch") (sbhd) or ("length",) (thd). A Pallas kernel, which
XLA's SPMD partitioner cannot split, then computes only its shard instead of running replicated on
the global batch. Falls back to the plain call (under the partitioner) when the sequence or head_dim
axis is sharded, query and key/value heads map to different mesh axes or do not divide, the batch
does not divide, or attention dropout is active.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax import _compat, layouts, masks
from te_jax.attention import dot_product_attention, dot_product_attention_packed
from te_jax.flax._common import (
    BATCH_AXES,
    HEAD_DIM_AXES,
    HEADS_AXES,
    KV_HEADS_AXES,
    QKV_PACK_AXES,
    SEQ_AXES,
    Initializer,
    batch_seq,
    check_hidden_input,
    check_rate,
    default_kernel_init,
    hidden_axes,
    param,
)
from te_jax.flax._sharding import mesh_axes_of, run_per_shard
from te_jax.flax.module import DenseGeneral, LayerNormDenseGeneral

ROTARY_GROUP_METHODS = ("consecutive", "alternate")
ATTN_BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias")
_PRE = {"bshd": "bs", "sbhd": "sb", "thd": "t"}


# ----------------------------------------------------------------------------- rotary embeddings


def apply_rotary_pos_emb(x, positions, *, group_method: str = "consecutive", windows=(1, 10000)):
    """Rotary position embedding of x [..., heads, head_dim] at `positions` (broadcastable to x.shape[:-2]).

    group_method "consecutive": rotate adjacent pairs (x[2i], x[2i+1]) (GPT-J style);
    "alternate": rotate x[i] with x[i + d/2] (GPT-NeoX / rotate-half style) — TransformerEngine's names.
    Frequencies: position / (min * (max/min) ** (2i/d)) for windows = (min, max). fp32 math, output x.dtype.
    """
    if group_method not in ROTARY_GROUP_METHODS:
        raise ValueError(f"rotary_pos_emb_group_method={group_method!r} is unknown; expected one of "
                         f"{ROTARY_GROUP_METHODS}.")
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got head_dim={d}.")
    half = d // 2
    lo, hi = windows
    timescale = lo * (hi / lo) ** (2.0 * jnp.arange(half, dtype=jnp.float32) / d)
    ang = jnp.asarray(positions, jnp.float32)[..., None, None] / timescale  # [..., 1, half]
    sin, cos = jnp.sin(ang), jnp.cos(ang)
    xf = x.astype(jnp.float32)
    if group_method == "alternate":
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


def _positions(fmt, b, s, offset=0, segment_ids=None, seqlens=None, cp_size=None):
    """Token positions (RoPE) broadcastable to the [.., heads, d] tensor's leading axes in format fmt.

    segment_ids: [b, s] ([s] for thd), positions restart at 0 in every segment; seqlens: thd only
    ([num_seqs] packed lengths). cp_size: the tokens (and segment ids) come in the zig-zag order of
    `reorder_causal_load_balancing(x, cp_size)`; positions are computed in the ORIGINAL order (segment
    ids un-reordered first; seqlens always describe the original order) and then reordered, so a
    document's positions do not restart at chunk boundaries. Returns [b|1, s] (bshd), [s, b|1] (sbhd)
    or [s] (thd).
    """
    from te_jax.context_parallel import inverse_reorder_causal_load_balancing, reorder_causal_load_balancing

    seq_axis = 0 if fmt == "thd" else 1
    if cp_size is not None and segment_ids is not None:
        segment_ids = inverse_reorder_causal_load_balancing(jnp.asarray(segment_ids, jnp.int32), cp_size, seq_axis)
    if fmt == "thd":
        if segment_ids is None and seqlens is not None:
            segment_ids = masks._seqlens_to_packed_segments(jnp.asarray(seqlens, jnp.int32), s)
        if segment_ids is not None:
            pos = masks._positions(jnp.asarray(segment_ids, jnp.int32)[None], False)[0]
        else:
            pos = jnp.arange(s, dtype=jnp.int32)
    elif segment_ids is not None:
        pos = masks._positions(jnp.asarray(segment_ids, jnp.int32), False)  # [b, s]
    else:
        pos = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, s]
    if cp_size is not None:
        pos = reorder_causal_load_balancing(pos, cp_size, seq_axis)
    pos = pos + offset
    return pos if fmt != "sbhd" else pos.T


# ----------------------------------------------------------------------------- the shared attention call


def _dense_mask(mask, fmt, b, h, sq, skv, module):
    """TE-style mask (True = masked out) [b|1, 1|h, sq, skv] -> a boolean array, applied exactly.

    Integer (0/1) and boolean masks are accepted (cast to bool: nonzero = masked out); the
    functional `te_jax.dot_product_attention(mask=...)` applies it on top of the mask type and any
    seqlens / segment ids. A [b, 1, sq, skv] padding mask gives the seqlens result on the valid
    rows (rows masked everywhere give zeros); seqlens / segment ids remain the faster way to say it.
    """
    shape = tuple(getattr(mask, "shape", ()))
    if (len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, h) or shape[2] != sq
            or shape[3] != skv):
        thd = " (thd: batch is 1, seq the token axis)" if fmt == "thd" else ""
        raise ValueError(
            f"{module}: mask has shape {shape}; with attn_input_format={fmt!r} the inputs give batch={b}, "
            f"heads={h}, q_seq={sq}, kv_seq={skv}{thd}, so the mask must be [batch or 1, 1 or heads, q_seq, "
            f"kv_seq] = [{b}, 1, {sq}, {skv}] (always batch-first, True = masked out). If the batch and sequence "
            f"axes are swapped, the inputs' attn_input_format is probably wrong.")
    mask = jnp.asarray(mask)
    if jnp.issubdtype(mask.dtype, jnp.floating):
        raise ValueError(
            f"{module}: mask has dtype {mask.dtype}; it must be boolean (or integer 0/1) with True = masked out. "
            f"Pass an additive float mask as `bias`.")
    return mask.astype(bool)


def _effective_mask_type(mask_type: str, has_padding: bool) -> str:
    """Padding types without padding information drop the padding; given padding upgrades the type."""
    masks.check_mask_type(mask_type)
    spec = masks.MaskSpec(mask_type)
    if has_padding and not spec.padding:
        return {"no_mask": "padding", "causal": "padding_causal",
                "causal_bottom_right": "padding_causal_bottom_right"}[mask_type]
    if not has_padding and spec.padding:
        return {"padding": "no_mask", "padding_causal": "causal",
                "padding_causal_bottom_right": "causal_bottom_right"}[mask_type]
    return mask_type


def _cp_batch_and_head_axes():
    """Mesh axes of the batch and head axes under the active logical axis rules (None without rules),
    so that context-parallel attention keeps data and tensor parallelism instead of replicating."""
    batch = nn.logical_to_mesh_axes((BATCH_AXES,))[0]
    heads = nn.logical_to_mesh_axes(("heads",))[0]
    kv_heads = nn.logical_to_mesh_axes(("kv_heads",))[0]
    # q, k and v share one spec inside context parallelism: shard heads only where both agree.
    return batch, (heads if heads == kv_heads else None)


_LEAD_AXES = {"bshd": (BATCH_AXES, SEQ_AXES), "sbhd": (SEQ_AXES, BATCH_AXES), "thd": (SEQ_AXES,)}


def _tensor_axes(fmt, qkv_layout):
    """Logical names of the axes of the attention tensors as stored: (q, k, v), (q, kv) or (qkv,)."""
    lead = _LEAD_AXES[fmt]
    q = lead + (HEADS_AXES, HEAD_DIM_AXES)
    kv = lead + (KV_HEADS_AXES, HEAD_DIM_AXES)
    lay = layouts.get_qkv_layout(qkv_layout) if qkv_layout is not None else None
    if lay is None or lay.kind == "separate":
        return q, kv, kv
    if lay.kind == "gqa_packed":  # q, k and v heads share one axis: it is not split
        return (lead + (None, HEAD_DIM_AXES),)
    names = list(lead + ((HEADS_AXES if lay.kind == "qkv_packed" else KV_HEADS_AXES), HEAD_DIM_AXES))
    names.insert(lay.pack_axis, QKV_PACK_AXES)
    return (tuple(names),) if lay.kind == "qkv_packed" else (q, tuple(names))


def _head_split(qkv_layout):
    """The head axes' logical names attention may run per shard over: both of "heads" and "kv_heads"
    when the rules map them to the same mesh axes (each key/value head then stays with its query
    heads: h/n query heads and g/n key/value heads per shard, with both divisible, checked by the
    plan), else none (a sharded head axis then makes the call fall back)."""
    kind = layouts.get_qkv_layout(qkv_layout).kind if qkv_layout is not None else "separate"
    if kind == "gqa_packed":
        return ()
    if kind == "qkv_packed":
        return (HEADS_AXES,)
    hq = mesh_axes_of(nn.logical_to_mesh_axes((HEADS_AXES,))[0])
    hk = mesh_axes_of(nn.logical_to_mesh_axes((KV_HEADS_AXES,))[0])
    return (HEADS_AXES, KV_HEADS_AXES) if hq == hk else ()


def _attention_per_shard(module_name, core, tensors, extras, *, fmt, qkv_layout, b, h):
    """core(*tensors, *extras) per shard over the mesh axes of the batch (and heads) axes.

    A Pallas attention kernel is opaque to XLA's SPMD partitioner (te_jax/flax/_sharding.py): under
    a mesh it would run replicated. Attention is independent per batch entry and per head, so it runs
    in a shard_map over the mesh axes the logical rules put "batch" (and "heads"/"kv_heads") on; the
    sequence and head_dim axes stay whole (context parallelism is its own path). extras: q_seqlens,
    kv_seqlens, q_segment_ids, kv_segment_ids, bias, mask (or None), split along the batch ([b] seqlens,
    [b, s] segment ids, a bias / dense mask with b entries) and the bias / mask along the heads (h
    entries); thd seqlens and segment ids, and broadcast bias / mask axes, are passed whole.
    """
    q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, bias, mask = extras
    thd = fmt == "thd"

    def token_axes(a, per_seq):
        if a is None:
            return None
        if thd:
            return (SEQ_AXES,) if (per_seq and a.ndim == 1) else None
        if per_seq:
            return (BATCH_AXES if a.shape[0] == b else None, SEQ_AXES) if a.ndim == 2 else None
        return (BATCH_AXES,) if a.shape == (b,) else None

    def square_axes(a):  # bias / dense mask [b|1, h|1, sq, skv]
        if a is None or a.ndim != 4:
            return None
        return (BATCH_AXES if not thd and a.shape[0] == b and b > 1 else None,
                HEADS_AXES if a.shape[1] == h and h > 1 else None, SEQ_AXES, SEQ_AXES)

    names = _tensor_axes(fmt, qkv_layout) + (token_axes(q_seqlens, False), token_axes(kv_seqlens, False),
                                             token_axes(q_segment_ids, True), token_axes(kv_segment_ids, True),
                                             square_axes(bias), square_axes(mask))
    out_names = _LEAD_AXES[fmt] + (HEADS_AXES, HEAD_DIM_AXES)
    return run_per_shard(module_name, core, tuple(tensors) + tuple(extras), names, out_names,
                         split=(BATCH_AXES,) + _head_split(qkv_layout))


def _qkv_shapes(tensors, qkv_layout, h, g):
    """Shapes (ShapeDtypeStructs) of q, k, v stored as qkv_layout, validated, without slicing anything."""
    return jax.eval_shape(lambda *t: layouts.unpack_qkv(*t, qkv_layout=qkv_layout, num_attention_heads=h,
                                                        num_gqa_groups=g), *tensors)


def attend(module: nn.Module, *tensors, qkv_layout=None, num_attention_heads=None, num_gqa_groups=None,
           attn_input_format, attn_mask_type, mask=None, bias=None,
           attn_bias_type=None, q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None,
           window_size=None, softcap=None, scale=None, dropout_rate=0.0, deterministic=True,
           dropout_rng_name="dropout", float32_logits=False, backend="auto", context_parallel_axis=None,
           context_parallel_strategy="ring", context_parallel_load_balanced=False, module_name="attention"):
    """One attention call from a module: mask/bias/dropout policy, then the functional op.

    tensors: (q, k, v), or with `qkv_layout` (a packed te_jax.QKV_LAYOUTS name) the tensors that layout
    stores, which go to `dot_product_attention_packed` (read in place by the Pallas kernel where it can).
    Without context parallelism the op runs per shard under a mesh (see the module docstring).
    """
    fmt = layouts.check_format(attn_input_format)
    masks.check_mask_type(attn_mask_type)
    if qkv_layout is None:
        q, k, v = tensors
    else:
        q, k, v = _qkv_shapes(tensors, qkv_layout, num_attention_heads, num_gqa_groups)
    b, sq = batch_seq(q, fmt)
    skv = batch_seq(k, fmt)[1]
    given = [n for n, a in (("q_seqlens", q_seqlens), ("kv_seqlens", kv_seqlens),
                            ("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)) if a is not None]
    if mask is not None:
        # Applied exactly as given (not reduced to padding), on top of the mask type and any seqlens/segments.
        mask = _dense_mask(mask, fmt, b, q.shape[-2], sq, skv, module_name)
        if context_parallel_axis:
            raise ValueError(
                f"{module_name}: mask (a dense [b, 1|h, q_seq, kv_seq] mask, shape {tuple(mask.shape)}) cannot be "
                f"split over context_parallel_axis={context_parallel_axis!r}; pass packing/padding as "
                f"q_segment_ids/kv_segment_ids (or q_seqlens/kv_seqlens) and causality as the mask type "
                f"(attn_mask_type / self_attn_mask_type), which context parallelism serves.")
    has_padding = bool(given)
    mask_type = _effective_mask_type(attn_mask_type, has_padding)

    if attn_bias_type is None:
        attn_bias_type = "no_bias" if bias is None else "post_scale_bias"
    if attn_bias_type not in ATTN_BIAS_TYPES:
        raise ValueError(f"{module_name}: attn_bias_type={attn_bias_type!r} is unknown; expected one of "
                         f"{ATTN_BIAS_TYPES} (or None to follow whether a bias is passed).")
    if attn_bias_type == "no_bias" and bias is not None:
        raise ValueError(f"{module_name}: attn_bias_type='no_bias' but a bias was passed; use "
                         "attn_bias_type='post_scale_bias' (or None).")
    if attn_bias_type != "no_bias" and bias is None:
        raise ValueError(f"{module_name}: attn_bias_type={attn_bias_type!r} needs a bias argument.")
    head_dim = q.shape[-1]
    eff_scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if bias is not None:
        if attn_bias_type == "pre_scale_bias":
            if softcap is not None:
                raise ValueError(f"{module_name}: attn_bias_type='pre_scale_bias' cannot be combined with softcap.")
            bias = bias * eff_scale  # (qk + bias)·scale = qk·scale + bias·scale
        bias = bias.astype(jnp.float32 if float32_logits else q.dtype)

    rate = check_rate(module_name, "attention_dropout", dropout_rate)
    active = rate > 0.0 and not deterministic
    rng = module.make_rng(dropout_rng_name) if active else None

    out_dtype = q.dtype
    dt = jnp.float32 if float32_logits else jnp.result_type(*(t.dtype for t in tensors))
    tensors = tuple(t.astype(dt) for t in tensors)
    if qkv_layout is None or context_parallel_axis:
        if qkv_layout is not None:
            tensors = layouts.unpack_qkv(*tensors, qkv_layout=qkv_layout, num_attention_heads=num_attention_heads,
                                         num_gqa_groups=num_gqa_groups)
        q, k, v = tensors

    if context_parallel_axis:
        if bias is not None or active:
            raise ValueError(f"{module_name}: context parallelism (context_parallel_axis="
                             f"{context_parallel_axis!r}) supports neither a bias nor attention dropout.")
        from te_jax.context_parallel import context_parallel_attention  # written concurrently; lazy

        batch_axes, head_axes = _cp_batch_and_head_axes()
        out = context_parallel_attention(
            q, k, v, cp_axis=context_parallel_axis, strategy=context_parallel_strategy,
            load_balanced=context_parallel_load_balanced, attn_input_format=fmt, attn_mask_type=mask_type,
            q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, window_size=window_size, softcap=softcap, scale=eff_scale,
            backend=backend, batch_axes=batch_axes, head_axes=head_axes)
    else:
        common = dict(attn_mask_type=mask_type, window_size=window_size, softcap=softcap, scale=eff_scale,
                      dropout_rate=rate if active else 0.0, dropout_rng=rng, backend=backend)
        n_tensors = len(tensors)
        # Per shard the head counts are the local ones: packed layouts other than "(h+2g)" (whose heads are
        # never split) read them from the tensors' shapes (validated globally above by _qkv_shapes).
        gqa_packed = qkv_layout is not None and layouts.get_qkv_layout(qkv_layout).kind == "gqa_packed"
        heads = dict(num_attention_heads=num_attention_heads, num_gqa_groups=num_gqa_groups) if gqa_packed else {}

        def core(*arrays):
            ts = arrays[:n_tensors]
            qsl, kvsl, qseg, kvseg, bias_, mask_ = arrays[n_tensors:]
            tokens = dict(q_seqlens=qsl, kv_seqlens=kvsl, q_segment_ids=qseg, kv_segment_ids=kvseg, bias=bias_,
                          mask=mask_)
            if qkv_layout is None:
                return dot_product_attention(*ts, attn_input_format=fmt, **tokens, **common)
            return dot_product_attention_packed(ts, qkv_layout=qkv_layout, **heads, **tokens, **common)

        extras = tuple(a if a is None or hasattr(a, "shape") else jnp.asarray(a)
                       for a in (q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, bias, mask))
        if active:  # dropout draws one mask over the global array: no per-shard run (the xla backend serves it)
            out = core(*tensors, *extras)
        else:
            out = _attention_per_shard(module_name, core, tensors, extras, fmt=fmt, qkv_layout=qkv_layout,
                                       b=b, h=q.shape[-2])
    return out.astype(out_dtype)


# ----------------------------------------------------------------------------- DotProductAttention


def _check_heads(module, num_attention_heads, num_gqa_groups):
    h = num_attention_heads
    g = h if num_gqa_groups is None else num_gqa_groups
    for name, val in (("num_attention_heads", h), ("num_gqa_groups", g)):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{module}: {name}={val!r} must be a positive int.")
    if h % g:
        raise ValueError(f"{module}: num_attention_heads={h} is not a multiple of num_gqa_groups={g}; each "
                         f"key/value head serves h/g query heads, so g must divide h (e.g. g in "
                         f"{[x for x in range(1, h + 1) if h % x == 0]}).")
    return int(h), int(g)


class DotProductAttention(nn.Module):
    """Attention core on already-projected q, k, v (te_jax.dot_product_attention).

    __call__(query, key=None, value=None, mask=None, bias=None, *, deterministic=False,
             q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None)

    Inputs follow `attn_input_format` ("bshd" [b, s, h, d], "sbhd" [s, b, h, d], "thd" [t, h, d])
    and `qkv_layout` (te_jax.QKV_LAYOUTS; None infers it from the tensors passed): pass
    (query, key, value) separately, (query, kv) for KV-packed or (qkv,) for QKV-packed layouts.
    mask: TransformerEngine convention, boolean (or 0/1 integer) [b or 1, 1 or h, sq, skv] with True =
      masked out, applied exactly as given on top of attn_mask_type, seqlens / segment ids and window
      (a causal or block-diagonal mask works with attn_mask_type="no_mask"); a query row it hides
      entirely gives zeros. Served by the xla and pallas backends (not cuDNN), not with context
      parallelism; seqlens / segment ids / mask types say padding, packing and causality faster.
      Seqlens / segment ids turn "causal" into "padding_causal" (etc.); a padding mask type without
      seqlens or segment ids behaves as its non-padding variant (the dense mask then does the masking).
    attn_bias_type: None (post-scale when a bias is given), "no_bias", "pre_scale_bias", "post_scale_bias".
    scale_factor: None → 1/sqrt(head_dim). float32_logits: run the attention in fp32.
    softcap: logits ← softcap·tanh(logits/softcap). attention_dropout draws from `dropout_rng_name`.
    context_parallel_axis: a mesh axis name → context-parallel attention over that axis
      (`context_parallel_strategy`, `context_parallel_load_balanced`).
    Returns [..., h, d_v] in the query's format (thd: [t, h, d_v]).
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    dropout_rng_name: str = "dropout"
    dtype: Any = None  # compute dtype; None: the input's dtype (as TransformerEngine)
    float32_logits: bool = False
    qkv_layout: str | None = None
    scale_factor: float | None = None
    attn_input_format: str = "bshd"
    window_size: tuple[int, int] | None = None
    softcap: float | None = None
    backend: str = "auto"
    context_parallel_axis: str | None = None
    context_parallel_strategy: str = "ring"
    context_parallel_load_balanced: bool = False

    @nn.compact
    def __call__(self, query, key=None, value=None, mask=None, bias=None, *, deterministic: bool = False,
                 q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None):
        name = "DotProductAttention"
        fmt = layouts.check_format(self.attn_input_format)
        h, g = _check_heads(name, self.num_attention_heads, self.num_gqa_groups)
        tensors = tuple(t for t in (query, key, value) if t is not None)
        if value is not None and key is None:
            raise ValueError(f"{name}: value was given without key.")
        layout = self.qkv_layout
        if layout is None:
            layout = layouts.infer_qkv_layout(query, key, value, attn_input_format=fmt,
                                              num_attention_heads=h, num_gqa_groups=g)
        lay = layouts.get_qkv_layout(layout)
        if lay.attn_input_format != fmt:
            raise ValueError(f"{name}: qkv_layout={layout!r} is a {lay.attn_input_format!r} layout but "
                             f"attn_input_format={fmt!r}; use a {fmt!r} layout or change attn_input_format.")
        q = _qkv_shapes(tensors, layout, h, g)[0]
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"{name}: head_dim={self.head_dim} but the query has shape {tuple(q.shape)} "
                             f"(head_dim {q.shape[-1]}) in attn_input_format={fmt!r}.")
        tensors = tuple(jnp.asarray(t, self.dtype) for t in tensors)
        # Packed layouts stay packed: dot_product_attention_packed reads them in place where it can.
        return attend(self, *tensors, qkv_layout=None if lay.kind == "separate" else layout,
                      num_attention_heads=h, num_gqa_groups=g, attn_input_format=fmt,
                      attn_mask_type=self.attn_mask_type, mask=mask, bias=bias, attn_bias_type=self.attn_bias_type,
                      q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                      window_size=self.window_size, softcap=self.softcap, scale=self.scale_factor,
                      dropout_rate=self.attention_dropout, deterministic=deterministic,
                      dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_logits,
                      backend=self.backend, context_parallel_axis=self.context_parallel_axis,
                      context_parallel_strategy=self.context_parallel_strategy,
                      context_parallel_load_balanced=self.context_parallel_load_balanced, module_name=name)


# ----------------------------------------------------------------------------- MultiHeadAttention


def _rope_qk(tensors, packed_layout, q_pos, kv_pos, rope):
    """RoPE on the query and key heads of the stored tensors, keeping a packed layout packed.

    Packed ("…3hd": [.., 3, h, d], self-attention so q and k share positions; "…2hd": q, [.., 2, g, d]):
    the q/k part is rotated and concatenated back with v along the packing axis (one elementwise XLA
    fusion writing the packed tensor, as many bytes as rotating q and k and slicing v out).
    """
    if packed_layout is None:
        q, k, v = tensors
        return apply_rotary_pos_emb(q, q_pos, **rope), apply_rotary_pos_emb(k, kv_pos, **rope), v
    kind = layouts.get_qkv_layout(packed_layout).kind
    x = tensors[-1]  # the packed tensor, packing axis -3
    n_rot = 2 if kind == "qkv_packed" else 1
    part = lax.slice_in_dim(x, 0, n_rot, axis=x.ndim - 3)
    flat = part.reshape(*part.shape[:-3], n_rot * part.shape[-2], part.shape[-1])
    rot = apply_rotary_pos_emb(flat, kv_pos, **rope).reshape(part.shape)
    x = jnp.concatenate([rot, lax.slice_in_dim(x, n_rot, x.shape[-3], axis=x.ndim - 3)], axis=x.ndim - 3)
    if kind == "qkv_packed":
        return (x,)
    return apply_rotary_pos_emb(tensors[0], q_pos, **rope), x


def _scaled_init(init, n_blocks: int, scale_first: float):
    """Init a flattened [fan_in, n_blocks·w] kernel block by block, scaling the first block (the query)."""

    def fn(key, shape, dtype=jnp.float32):
        fan_in, n = shape
        w = n // n_blocks
        keys = jax.random.split(key, n_blocks)
        blocks = [init(kk, (fan_in, w), dtype) for kk in keys]
        blocks[0] = blocks[0] * jnp.asarray(scale_first, dtype)
        return jnp.concatenate(blocks, axis=1)

    return fn


class MultiHeadAttention(nn.Module):
    """Multi-head attention with projections: [LayerNorm] → Q/K/V → [RoPE] → attention → output projection.

    __call__(inputs_q, inputs_kv=None, mask=None, bias=None, *, decode=False, deterministic=False,
             q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None)
      -> (output, ln_output)   (ln_output None unless return_layernorm_output)

    inputs: [b, s, hidden] ("bshd"), [s, b, hidden] ("sbhd") or [t, hidden] ("thd").
    Self-attention when inputs_kv is None or is inputs_q (the input LayerNorm feeds Q, K and V);
    cross-attention otherwise (K/V projected from inputs_kv without a norm).
    fuse_qkv_params: one [embed, 3, h, d] QKV kernel for self-attention with h == g ("bs3hd"); with GQA
      or cross-attention Q stays separate and K/V share one [embed, 2, g, d] kernel ("bshd_bs2hd").
      The packed projection goes to te_jax.dot_product_attention_packed (RoPE is applied on it without
      unpacking), so the Pallas kernel reads it in place where it can; decoding with the KV cache and
      context parallelism split it. False: separate query/key/value kernels.
    num_gqa_groups: g key/value heads (None = h; 1 = multi-query attention); must divide h.
    enable_rotary_pos_emb: RoPE on Q and K, rotary_pos_emb_group_method "consecutive" or "alternate",
      rotary_pos_emb_windows (min, max) timescales; positions restart at 0 in every segment
      when segment ids are given (and for thd), and continue from the cache index when decoding.
    decode: autoregressive self-attention with a KV cache in the "cache" collection
      (cached_key, cached_value [b, max_len, g, d], cache_index). Initialise with decode=True on an
      input of the maximum length, then apply step by step with mutable=["cache"]; each step attends
      causally to everything cached so far (masks other than the causal structure are not applied
      while decoding; a bias over [.., max_len, max_len] is sliced to the current rows).
    scale_attn_logits / scaled_query_init: TransformerEngine's convention — by default the logits are
      not scaled (scale 1.0) and the query kernel is initialised divided by sqrt(head_dim);
      scale_attn_logits=True scales the logits by 1/sqrt(head_dim) (scale_factor overrides both).
    context_parallel_axis: a mesh axis name → the attention runs as te_jax.context_parallel.
      context_parallel_attention over that axis (global arrays in, the mesh from jax.set_mesh);
      context_parallel_load_balanced=True means the tokens come in the zig-zag order of
      reorder_causal_load_balancing, segment ids too (seqlens describe the original order); RoPE
      positions are computed in the original order and then reordered, so documents keep their
      positions across chunk boundaries. No bias / dense mask / attention dropout.
    Other arguments: as DotProductAttention (attn_mask_type, window_size, softcap, float32_logits,
    attention_dropout), LayerNorm (layernorm_type, epsilon, zero_centered_gamma).
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    return_layernorm_output: bool = False
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    kernel_init: Initializer | None = None
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    dtype: Any = None  # compute dtype; None: the input's dtype (as TransformerEngine)
    param_dtype: Any = jnp.float32
    fuse_qkv_params: bool = True
    attn_input_format: str = "bshd"
    enable_sequence_parallel: bool = False  # accepted for TE compatibility; shard with logical axis rules
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    scale_factor: float | None = None
    float32_logits: bool = False
    window_size: tuple[int, int] | None = None
    softcap: float | None = None
    backend: str = "auto"
    norm_backend: str = "auto"
    context_parallel_axis: str | None = None
    context_parallel_strategy: str = "ring"
    context_parallel_load_balanced: bool = False

    @nn.compact
    def __call__(self, inputs_q, inputs_kv=None, mask=None, bias=None, *, decode: bool = False,
                 deterministic: bool = False, q_seqlens=None, kv_seqlens=None, q_segment_ids=None,
                 kv_segment_ids=None):
        name = "MultiHeadAttention"
        fmt = layouts.check_format(self.attn_input_format)
        h, g = _check_heads(name, self.num_attention_heads, self.num_gqa_groups)
        d = self.head_dim
        if not isinstance(d, (int, np.integer)) or d <= 0:
            raise ValueError(f"{name}: head_dim={d!r} must be a positive int.")
        if self.enable_rotary_pos_emb and self.rotary_pos_emb_group_method not in ROTARY_GROUP_METHODS:
            raise ValueError(f"{name}: rotary_pos_emb_group_method={self.rotary_pos_emb_group_method!r} is unknown; "
                             f"expected one of {ROTARY_GROUP_METHODS}.")
        is_self = inputs_kv is None or inputs_kv is inputs_q
        check_hidden_input(inputs_q, fmt, "inputs_q", name)
        if not is_self:
            check_hidden_input(inputs_kv, fmt, "inputs_kv", name)
            if fmt != "thd" and batch_seq(inputs_kv, fmt)[0] != batch_seq(inputs_q, fmt)[0]:
                raise ValueError(
                    f"{name}: inputs_q {tuple(inputs_q.shape)} and inputs_kv {tuple(inputs_kv.shape)} have "
                    f"different batch sizes under attn_input_format={fmt!r}.")
        hidden = inputs_q.shape[-1]

        base_init = self.kernel_init or default_kernel_init()
        q_scale = 1.0 / math.sqrt(d) if self.scaled_query_init else 1.0
        if self.scale_factor is not None:
            scale = self.scale_factor
        else:
            scale = 1.0 / math.sqrt(d) if self.scale_attn_logits else 1.0
        common = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.use_bias,
                      bias_init=self.bias_init)
        ln_args = dict(enable_layernorm=self.input_layernorm, layernorm_type=self.layernorm_type,
                       epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
                       backend=self.norm_backend, layernorm_input_axes=hidden_axes(fmt))
        pre = _PRE[fmt]
        ln_out = None
        if self.fuse_qkv_params and is_self and h == g:
            qkv, ln_out = LayerNormDenseGeneral(
                features=(3, h, d), kernel_init=_scaled_init(base_init, 3, q_scale),
                kernel_axes=("embed", "qkv", "heads", "kv"), bias_axes=("qkv", "heads", "kv"),
                return_layernorm_output=self.return_layernorm_output, name="qkv", **ln_args, **common)(inputs_q)
            packed_layout, tensors = f"{pre}3hd", (qkv,)
        else:
            q, ln_q = LayerNormDenseGeneral(
                features=(h, d), kernel_init=_scaled_init(base_init, 1, q_scale),
                kernel_axes=("embed", "heads", "kv"), bias_axes=("heads", "kv"),
                return_layernorm_output=True, name="query", **ln_args, **common)(inputs_q)
            ln_out = ln_q if self.return_layernorm_output else None
            kv_in = ln_q if is_self else inputs_kv
            if self.fuse_qkv_params:
                kv = DenseGeneral(features=(2, g, d), kernel_init=_scaled_init(base_init, 2, 1.0),
                                  kernel_axes=("embed", "qkv", "kv_heads", "kv"),
                                  bias_axes=("qkv", "kv_heads", "kv"), name="kv", **common)(kv_in)
                packed_layout, tensors = f"{fmt}_{pre}2hd", (q, kv)
            else:
                dense = dict(features=(g, d), kernel_init=base_init, kernel_axes=("embed", "kv_heads", "kv"),
                             bias_axes=("kv_heads", "kv"), **common)
                k = DenseGeneral(name="key", **dense)(kv_in)
                v = DenseGeneral(name="value", **dense)(kv_in)
                packed_layout, tensors = None, (q, k, v)

        use_cache = decode and is_self
        if use_cache and packed_layout is not None:  # the KV cache keeps k and v apart
            tensors = layouts.unpack_qkv(*tensors, qkv_layout=packed_layout, num_attention_heads=h,
                                         num_gqa_groups=g)
            packed_layout = None
        # Fused projections stay packed ("…3hd" / "…2hd") down to dot_product_attention_packed, whose Pallas
        # path reads them in place; every stored tensor has the same leading (batch/seq) axes.
        b, sq = batch_seq(tensors[0], fmt)
        skv = batch_seq(tensors[-1], fmt)[1]
        cache_ready = use_cache and self.has_variable("cache", "cached_key")
        if use_cache and fmt == "thd":
            raise ValueError(f"{name}: decode=True is not supported with attn_input_format='thd'; use 'bshd' "
                             "or 'sbhd'.")
        offset = 0
        if cache_ready:
            cache_index = self.get_variable("cache", "cache_index")
            offset = cache_index

        if self.enable_rotary_pos_emb:
            rope = dict(group_method=self.rotary_pos_emb_group_method, windows=self.rotary_pos_emb_windows)
            # Load-balanced context parallelism: tokens come zig-zag reordered; positions are computed in
            # the original order and reordered (for segment ids, seqlens, thd and no packing alike).
            cp = (self._load_balanced_cp_size() if self.context_parallel_axis and self.context_parallel_load_balanced
                  and not use_cache else None)
            q_pos = _positions(fmt, b, sq, offset, q_segment_ids, q_seqlens if fmt == "thd" else None, cp)
            if is_self:
                kv_pos = q_pos
            else:
                kv_pos = _positions(fmt, b, skv, 0, kv_segment_ids, kv_seqlens if fmt == "thd" else None, cp)
            tensors = _rope_qk(tensors, packed_layout, q_pos, kv_pos, rope)

        attn_args = dict(attn_bias_type=self.attn_bias_type, window_size=self.window_size, softcap=self.softcap,
                         scale=scale, dropout_rate=self.attention_dropout, deterministic=deterministic,
                         dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_logits,
                         backend=self.backend, module_name=name)
        if use_cache:
            q, k, v = tensors
            qb, kb, vb = (layouts.to_bshd(t, fmt) for t in (q, k, v))
            ck = self.variable("cache", "cached_key", jnp.zeros, kb.shape, kb.dtype)
            cv = self.variable("cache", "cached_value", jnp.zeros, vb.shape, vb.dtype)
            ci = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
            if cache_ready:
                max_len = ck.value.shape[1]
                if kb.shape[0] != ck.value.shape[0] or kb.shape[2:] != ck.value.shape[2:]:
                    raise ValueError(f"{name}: decode step keys {tuple(kb.shape)} do not fit the cache "
                                     f"{tuple(ck.value.shape)} ([batch, max_len, kv_heads, head_dim]).")
                cur = ci.value
                ck.value = lax.dynamic_update_slice(ck.value, kb.astype(ck.value.dtype), (0, cur, 0, 0))
                cv.value = lax.dynamic_update_slice(cv.value, vb.astype(cv.value.dtype), (0, cur, 0, 0))
                ci.value = cur + sq
                if bias is not None and bias.shape[-2] == max_len and sq != max_len:
                    bias = lax.dynamic_slice_in_dim(bias, cur, sq, axis=-2)
                out = attend(self, qb, ck.value, cv.value, attn_input_format="bshd",
                             attn_mask_type="padding_causal_bottom_right", bias=bias,
                             q_seqlens=jnp.full((b,), sq, jnp.int32), kv_seqlens=jnp.full((b,), cur + sq, jnp.int32),
                             **attn_args)
                out = layouts.from_bshd(out, fmt)
            else:
                out = None
        else:
            out = None
        if out is None:
            out = attend(self, *tensors, qkv_layout=packed_layout, num_attention_heads=h, num_gqa_groups=g,
                         attn_input_format=fmt, attn_mask_type=self.attn_mask_type, mask=mask,
                         bias=bias, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids,
                         kv_segment_ids=kv_segment_ids, context_parallel_axis=self.context_parallel_axis,
                         context_parallel_strategy=self.context_parallel_strategy,
                         context_parallel_load_balanced=self.context_parallel_load_balanced, **attn_args)

        y = DenseGeneral(features=hidden, axis=(-2, -1), kernel_init=base_init, kernel_axes=("heads", "kv", "embed"),
                         bias_axes=("embed",), name="out", **common)(out)
        return y, ln_out

    def _load_balanced_cp_size(self) -> int:
        """Size of the context-parallel mesh axis, for RoPE positions of zig-zag reordered tokens."""
        mesh = _compat.current_mesh()
        names = tuple(getattr(mesh, "axis_names", ()) or ())
        if self.context_parallel_axis not in names:
            raise ValueError(
                f"MultiHeadAttention: context_parallel_axis={self.context_parallel_axis!r} with "
                f"context_parallel_load_balanced=True and rotary embeddings needs the mesh to be set "
                f"(jax.set_mesh(mesh)) to know the context-parallel size; current mesh axes: {names}.")
        return int(mesh.shape[self.context_parallel_axis])


# ----------------------------------------------------------------------------- RelativePositionBiases


class RelativePositionBiases(nn.Module):
    """T5-style bucketed relative position biases, as TransformerEngine's RelativePositionBiases.

    __call__(q_seqlen, k_seqlen, bidirectional=True) -> [1, heads, q_seqlen, k_seqlen] in `dtype`,
    to pass as `bias` (post-scale) to the attention modules.
    Parameter: rel_embedding [heads, num_buckets], logical names `embedding_axes`.
    """

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Initializer = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")
    embedding_axes: Sequence[str] = ("heads", "relpos_buckets")
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @staticmethod
    def _check(num_buckets, max_distance, bidirectional, **positive):
        """ValueError naming the argument: the bucket math divides by max_exact = nb // 2 (nb =
        num_buckets, halved when bidirectional) and by log(max_distance / max_exact)."""
        def is_int(x):
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        for name, x in positive.items():  # sequence lengths may be 0
            least = 0 if name.endswith("seqlen") else 1
            if not is_int(x) or x < least:
                raise ValueError(f"RelativePositionBiases: {name}={x!r} must be an int >= {least}.")
        least = 4 if bidirectional else 2
        if not is_int(num_buckets) or num_buckets < least:
            raise ValueError(
                f"RelativePositionBiases: num_buckets={num_buckets!r} must be an int >= {least} "
                f"(bidirectional={bidirectional} gives each direction {'half of ' if bidirectional else ''}the "
                f"buckets, and half of those are exact offsets: at least one). T5 uses 32.")
        max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        if not is_int(max_distance) or max_distance <= max_exact:
            raise ValueError(
                f"RelativePositionBiases: max_distance={max_distance!r} must be an int > {max_exact}, the "
                f"largest exactly bucketed offset for num_buckets={num_buckets} (bidirectional={bidirectional}). "
                f"T5 uses 128.")

    @staticmethod
    def buckets(q_seqlen, k_seqlen, num_buckets, max_distance, bidirectional=True):
        """Bucket index [q_seqlen, k_seqlen] of each relative position (numpy, static)."""
        RelativePositionBiases._check(num_buckets, max_distance, bidirectional, q_seqlen=q_seqlen,
                                      k_seqlen=k_seqlen)
        ctx = np.arange(q_seqlen, dtype=np.int32)[:, None]
        mem = np.arange(k_seqlen, dtype=np.int32)[None, :]
        n = -(mem - ctx)
        bucket = np.zeros_like(n)
        nb = num_buckets
        if bidirectional:
            nb //= 2
            bucket += (n < 0).astype(np.int32) * nb
            n = np.abs(n)
        else:
            n = np.maximum(n, 0)
        max_exact = nb // 2
        is_small = n < max_exact
        large = max_exact + (np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
                             / np.log(max_distance / max_exact) * (nb - max_exact)).astype(np.int32)
        large = np.minimum(large, nb - 1)
        return bucket + np.where(is_small, n, large)

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True):
        self._check(self.num_buckets, self.max_distance, bidirectional,
                    num_attention_heads=self.num_attention_heads)
        rp_bucket = self.buckets(q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional)
        table = param(self, "rel_embedding", self.embedding_init, (self.num_attention_heads, self.num_buckets),
                      self.param_dtype, self.embedding_axes)
        values = jnp.asarray(table, self.dtype)[:, rp_bucket]  # [h, q, k]
        return values[None]
