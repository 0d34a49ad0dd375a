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

from te_jax import _compat, layouts, masks, sinks
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
from te_jax.flax.module import DenseGeneral, DenseOperands, LayerNormDenseGeneral, LayerNormDenseOperands
from te_jax.fp8 import context as _fp8_ac
from te_jax.fp8 import fused as _fp8_fused
from te_jax.fp8 import norm_cast as _fp8_norm_cast
from te_jax.fp8 import state as _fp8_state

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
        # out[2i] = x[2i] cos_i - x[2i+1] sin_i, out[2i+1] = x[2i+1] cos_i + x[2i] sin_i, as one elementwise pass
        # over x's own layout: x * cos2 + swap(x) * (-+sin2), swap exchanging the two lanes of each pair (a reverse
        # of a size-2 axis; its transpose is itself, so the backward is the same pass with no zeros or pads).
        # (A stack of the strided halves made XLA write a [..., d/2, 2] layout: a concatenate fusion at about half
        # the copy bandwidth on an H100; shifted slices instead made the backward pad with a zeros buffer.)
        cos2 = jnp.repeat(cos, 2, axis=-1)
        sin2 = jnp.repeat(sin, 2, axis=-1) * jnp.tile(jnp.array([-1.0, 1.0], jnp.float32), half)
        swap = lax.rev(xf.reshape(*x.shape[:-1], half, 2), (xf.ndim,)).reshape(x.shape)
        out = xf * cos2 + swap * sin2
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


def _query_positions(fmt, b, s, *, mask=None, q_seqlens=None, kv_seqlens=None, q_segment_ids=None,
                     kv_segment_ids=None, cache_index=None, self_attention=True, kv_len=None,
                     module="MultiHeadAttention", cp_size=None):
    """RoPE positions of the query tokens, batch-first: [b or 1, s] (bshd/sbhd) or [t] (thd).

    Full forward: positions restart at 0 in every segment, so they count each row's real tokens when
    padding is given by segment ids or by a mask (read as segment ids, as the attention reads it);
    seqlens (real tokens first) and no padding give 0..s-1; thd packs sequences from seqlens or ids.
    Decoding (cache_index [b] given): cache_index[row] + the rank of the token among the row's real
    tokens of this chunk (_decode_validity), i.e. the row's real tokens counted since the cache started.
    Shared by MultiHeadAttention (self-attention) and TransformerLayer (the cross-attention's query).
    cp_size: tokens in the zig-zag order of load-balanced context parallelism (see `_positions`).
    """
    if cache_index is not None:
        valid = _decode_validity(module, b, s, mask, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids)
        rank = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1
        return jnp.asarray(cache_index, jnp.int32)[:, None] + jnp.maximum(rank, 0)
    seg = q_segment_ids if (q_segment_ids is not None or not self_attention) else kv_segment_ids
    if seg is None and mask is not None and fmt != "thd":
        seg = _padding_from_mask(mask, fmt, b, s, s if kv_len is None else kv_len, module)[0]
    pos = _positions(fmt, b, s, 0, seg, q_seqlens if fmt == "thd" else None, cp_size)
    return pos.T if fmt == "sbhd" else pos


def _fmt_positions(pos, fmt):
    """Batch-first positions [b|1, s] -> broadcastable to the tensors' leading axes in format fmt."""
    return pos.T if fmt == "sbhd" else pos


# ----------------------------------------------------------------------------- decoding with the KV cache


def _decode_validity(module, b, sq, mask=None, q_seqlens=None, kv_seqlens=None, q_segment_ids=None,
                     kv_segment_ids=None):
    """Which tokens of a decode chunk are real: bool [b, sq] (all of them without padding arguments).

    While decoding, the padding arguments describe the sq tokens given in this call, batch-first in
    every format: mask [b, 1 or h, sq, sq] (True = masked out; a token is padding when its row or its
    column is masked everywhere), q/kv_segment_ids [b, sq] (0 = padding, any other id = a real token:
    one sequence per row), q/kv_seqlens [b] (the first len tokens of the row are real). Padding may sit
    anywhere in the chunk (left, right, between). Both q_ and kv_ forms given: a token must be real in both.
    """
    given = [n for n, a in (("q_seqlens", q_seqlens), ("kv_seqlens", kv_seqlens),
                            ("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)) if a is not None]
    if mask is not None and given:
        raise ValueError(f"{module}: pass either mask or {'/'.join(given)}, not both.")
    if any("seqlens" in n for n in given) and any("segment" in n for n in given):
        raise ValueError(f"{module}: pass either q_seqlens/kv_seqlens or q_segment_ids/kv_segment_ids, not both.")
    if mask is not None:
        shape = tuple(mask.shape)
        if len(shape) != 4 or shape[0] != b or shape[2] != sq or shape[3] != sq:
            raise ValueError(
                f"{module}: decoding, mask has shape {shape} but this call gives {sq} tokens per row for a batch "
                f"of {b}: the mask must be [batch, 1 or heads, chunk, chunk] = [{b}, 1, {sq}, {sq}] (always "
                f"batch-first) and describes this call's tokens only (the cache keeps the earlier ones' padding).")
        q_seg, kv_seg = _padding_from_mask(mask, "bshd", b, sq, sq, module)
        return (q_seg != 0) & (kv_seg != 0)
    valid = jnp.ones((b, sq), bool)
    for argname, seg in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if seg is None:
            continue
        seg = masks._check_int_array(seg, argname, (b, sq), "[batch, chunk], batch-first in every format: "
                                     "while decoding the segment ids describe this call's tokens")
        if masks._is_concrete(seg):
            arr = np.asarray(seg)
            rows = [i for i in range(b) if len(set(arr[i][arr[i] != 0].tolist())) > 1]
            if rows:
                raise ValueError(
                    f"{module}: decoding, {argname} holds several non-zero ids in row(s) {rows} "
                    f"({arr[rows[0]].tolist()}): the KV cache keeps one sequence per batch row, so in decode "
                    f"segment ids only mark padding (0) against tokens (one non-zero id per row).")
        valid = valid & (seg != 0)
    for argname, lens in (("q_seqlens", q_seqlens), ("kv_seqlens", kv_seqlens)):
        if lens is None:
            continue
        lens = masks._check_int_array(lens, argname, (b,), "[batch]: while decoding, the number of real tokens "
                                      "at the start of each row of this call's chunk")
        masks._check_seqlens_values(lens, argname, sq, "the decode chunk of this call")
        valid = valid & (jnp.arange(sq, dtype=jnp.int32)[None, :] < lens[:, None])
    return valid


def _decode_bias(module, bias, b, sq, max_len, positions, order):
    """The bias rows of the compacted chunk queries: [b or 1, h or 1, sq, max_len] or None.

    bias [1 or b, 1 or h, max_len, max_len] is indexed by token positions (row = query position, column =
    cache slot = key position), as RelativePositionBiases(max_len, max_len) gives it: each row takes the
    rows of its queries' positions. bias [1 or b, 1 or h, sq, max_len] gives this call's query rows in the
    order the tokens were passed; they are reordered with the queries.
    """
    if bias is None:
        return None
    shape = tuple(bias.shape)
    if len(shape) != 4 or shape[0] not in (1, b) or shape[-1] != max_len or shape[-2] not in (max_len, sq):
        raise ValueError(
            f"{module}: decoding with a cache of max_len={max_len} and a chunk of {sq} tokens, bias has shape "
            f"{shape}; expected [1 or {b}, 1 or heads, {max_len}, {max_len}] (rows and columns by token "
            f"position, e.g. RelativePositionBiases over max_len; TransformerLayer: pass max_decode_length="
            f"{max_len} or leave it out) or [1 or {b}, 1 or heads, {sq}, {max_len}] (this call's query rows).")
    if shape[-2] == max_len:
        rows = jnp.clip(jnp.take_along_axis(positions, order, axis=1), 0, max_len - 1)  # [b, sq]
        if shape[0] == 1:
            return jnp.moveaxis(bias[0][:, rows], 1, 0)  # [h, b, sq, max_len] -> [b, h, sq, max_len]
        return jax.vmap(lambda bb, r: bb[:, r])(bias, rows)
    bias = jnp.broadcast_to(bias, (b,) + shape[1:])
    return jnp.take_along_axis(bias, order[:, None, :, None], axis=2)


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


def _padding_from_mask(mask, fmt, b, sq, skv, module):
    """The padding a dense mask implies: (q_segment_ids, kv_segment_ids) [b, sq], [b, skv] int32, 0 = padding.

    A query row (key column) masked everywhere is a padding token. Used for RoPE positions (which count a
    row's real tokens) and to find the real tokens of a decode chunk; the attention applies the mask itself.
    """
    shape = tuple(getattr(mask, "shape", ()))
    heads = shape[1] if len(shape) == 4 else 1  # any head count: only the padding is read here
    mask = _dense_mask(mask, fmt, b, heads, sq, skv, module)
    visible = jnp.logical_not(mask)
    q_seg = jnp.broadcast_to(jnp.any(visible, axis=(1, 3)), (b, sq)).astype(jnp.int32)
    kv_seg = jnp.broadcast_to(jnp.any(visible, axis=(1, 2)), (b, skv)).astype(jnp.int32)
    return q_seg, kv_seg


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
    kv_seqlens, q_segment_ids, kv_segment_ids, bias, mask, softmax_offset (or None), split along the batch
    ([b] seqlens, [b, s] segment ids, a bias / dense mask with b entries) and the bias / mask / softmax_offset
    ([h]) along the heads (h entries); thd seqlens and segment ids, and broadcast bias / mask axes, are passed
    whole.
    """
    q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, bias, mask, softmax_offset = extras
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

    split = (BATCH_AXES,) + _head_split(qkv_layout)
    # The learnable sink logits [h] go with their query heads where the heads are split, else whole.
    offset_names = (HEADS_AXES,) if softmax_offset is not None and HEADS_AXES in split else None
    names = _tensor_axes(fmt, qkv_layout) + (token_axes(q_seqlens, False), token_axes(kv_seqlens, False),
                                             token_axes(q_segment_ids, True), token_axes(kv_segment_ids, True),
                                             square_axes(bias), square_axes(mask), offset_names)
    out_names = _LEAD_AXES[fmt] + (HEADS_AXES, HEAD_DIM_AXES)
    return run_per_shard(module_name, core, tuple(tensors) + tuple(extras), names, out_names, split=split)


def _qkv_shapes(tensors, qkv_layout, h, g):
    """Shapes (ShapeDtypeStructs) of q, k, v stored as qkv_layout, validated, without slicing anything."""
    return jax.eval_shape(lambda *t: layouts.unpack_qkv(*t, qkv_layout=qkv_layout, num_attention_heads=h,
                                                        num_gqa_groups=g), *tensors)


def attend(module: nn.Module, *tensors, qkv_layout=None, num_attention_heads=None, num_gqa_groups=None,
           attn_input_format, attn_mask_type, mask=None, bias=None,
           attn_bias_type=None, q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None,
           window_size=None, softcap=None, scale=None, dropout_rate=0.0, deterministic=True,
           dropout_rng_name="dropout", float32_logits=False, backend="auto", context_parallel_axis=None,
           context_parallel_strategy="ring", context_parallel_load_balanced=False, module_name="attention",
           softmax_type="vanilla", softmax_offset=None):
    """One attention call from a module: mask/bias/dropout policy, then the functional op.

    softmax_type / softmax_offset: attention sinks (te_jax.sinks), passed to the functional op (and, per
    shard, the [h] offset split with the query heads).

    tensors: (q, k, v), or with `qkv_layout` (a packed te_jax.QKV_LAYOUTS name) the tensors that layout
    stores, which go to `dot_product_attention_packed` (read in place by the Pallas kernel where it can).
    Without context parallelism the op runs per shard under a mesh (see the module docstring).
    """
    fmt = layouts.check_format(attn_input_format)
    masks.check_mask_type(attn_mask_type)
    softmax_type = sinks.check_softmax_type(softmax_type, module_name)
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
            backend=backend, batch_axes=batch_axes, head_axes=head_axes, softmax_type=softmax_type,
            softmax_offset=softmax_offset)
    else:
        common = dict(attn_mask_type=mask_type, window_size=window_size, softcap=softcap, scale=eff_scale,
                      dropout_rate=rate if active else 0.0, dropout_rng=rng, backend=backend,
                      softmax_type=softmax_type)
        n_tensors = len(tensors)
        # Per shard the head counts are the local ones: packed layouts other than "(h+2g)" (whose heads are
        # never split) read them from the tensors' shapes (validated globally above by _qkv_shapes).
        gqa_packed = qkv_layout is not None and layouts.get_qkv_layout(qkv_layout).kind == "gqa_packed"
        heads = dict(num_attention_heads=num_attention_heads, num_gqa_groups=num_gqa_groups) if gqa_packed else {}

        def core(*arrays):
            ts = arrays[:n_tensors]
            qsl, kvsl, qseg, kvseg, bias_, mask_, offset_ = arrays[n_tensors:]
            tokens = dict(q_seqlens=qsl, kv_seqlens=kvsl, q_segment_ids=qseg, kv_segment_ids=kvseg, bias=bias_,
                          mask=mask_, softmax_offset=offset_)
            if qkv_layout is None:
                return dot_product_attention(*ts, attn_input_format=fmt, **tokens, **common)
            return dot_product_attention_packed(ts, qkv_layout=qkv_layout, **heads, **tokens, **common)

        extras = tuple(a if a is None or hasattr(a, "shape") else jnp.asarray(a)
                       for a in (q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, bias, mask, softmax_offset))
        if active:  # dropout draws one mask over the global array: no per-shard run (the xla backend serves it)
            out = core(*tensors, *extras)
        else:
            out = _attention_per_shard(module_name, core, tensors, extras, fmt=fmt, qkv_layout=qkv_layout,
                                       b=b, h=q.shape[-2])
    return out.astype(out_dtype)


# ----------------------------------------------------------------------------- DotProductAttention


def _softmax_offset_param(module: nn.Module, softmax_type, num_heads: int, name: str):
    """The module's sink: (canonical softmax_type, its learnable `softmax_offset` parameter or None).

    "learnable" owns a float32 parameter `softmax_offset` [h] (logical axes ("heads",), so it is sharded with
    the other head-sharded parameters), initialised to zeros as TransformerEngine does. TE stores it as
    [1, h, 1, 1]; a TE checkpoint's entry needs .reshape(h).
    """
    softmax_type = sinks.check_softmax_type(softmax_type, name)
    if softmax_type != "learnable":
        return softmax_type, None
    return softmax_type, param(module, "softmax_offset", nn.initializers.zeros, (num_heads,), jnp.float32,
                               (HEADS_AXES,))



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
    softmax_type: TransformerEngine's "vanilla" (default), "off-by-one" (a sink logit 0 in every row's softmax
      denominator) or "learnable" (a learned sink logit per head: the parameter `softmax_offset` [h], float32,
      zeros at init, logical axes ("heads",)); see te_jax.dot_product_attention. Served by the xla and pallas
      backends and context parallelism, not by cuDNN.
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
    softmax_type: str = "vanilla"

    @nn.compact
    def __call__(self, query, key=None, value=None, mask=None, bias=None, *, deterministic: bool = False,
                 q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None):
        name = "DotProductAttention"
        fmt = layouts.check_format(self.attn_input_format)
        h, g = _check_heads(name, self.num_attention_heads, self.num_gqa_groups)
        softmax_type, softmax_offset = _softmax_offset_param(self, self.softmax_type, h, name)
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
                      context_parallel_load_balanced=self.context_parallel_load_balanced, module_name=name,
                      softmax_type=softmax_type, softmax_offset=softmax_offset)


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
             q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None, q_positions=None)
      -> (output, ln_output)   (ln_output None unless return_layernorm_output)
      -> (output, residual)    with return_residual=True (see below)

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
      rotary_pos_emb_windows (min, max) timescales; positions restart at 0 in every segment when
      segment ids (or a padding mask, read as segment ids) are given, and for thd; when decoding they
      continue from each row's cache_index, counting only real tokens.
    decode: autoregressive self-attention with a KV cache in the "cache" collection:
        cached_key, cached_value [b, max_len, g, d]  (bshd whatever the format; RoPE already applied to keys)
        cache_index              [b] int32           each row's valid length: its real tokens cached so far
      Each row's real tokens sit contiguously in slots [0, cache_index[row]); that is also the RoPE position
      of the row's next real token and the slot it is written to (a per-row valid length, not one index for
      the batch). Initialise with decode=True on an input of max_len tokens (this creates an empty cache),
      then apply chunks of any length <= max_len (a prefill in one or several chunks, then one token a step)
      with mutable=["cache"]. Padding is given per call for that call's tokens, batch-first in every format:
      mask [b, 1 or h, chunk, chunk], q/kv_segment_ids [b, chunk] (0 = padding; one sequence per row) or
      q/kv_seqlens [b] (real tokens first); padding may be anywhere (left-padded prompts, a row with no token
      at a step). Padding tokens are not cached and do not advance their row; each real token attends
      causally to its row's cached tokens, so decoding equals the full forward on each row's real tokens
      (RoPE positions count only real tokens, as with segment ids in the full forward). The attention runs
      on every backend through q_seqlens / kv_seqlens (padding_causal_bottom_right, queries compacted);
      decoding is always causal whatever attn_mask_type. On the pallas backend (auto's choice on a GPU) chunks
      of up to 16 tokens run the decode kernel (pallas_kernels.flash_decode): each row reads only its filled
      slots, split across the GPU and merged by logsumexp. bias: [1 or b, 1 or h, max_len, max_len] indexed by
      token positions (each row takes the rows of its tokens' positions; RelativePositionBiases over max_len)
      or [1 or b, 1 or h, chunk, max_len].
      Past the cache: a chunk longer than max_len is a ValueError; eagerly (concrete cache_index) a call
      that would take a row past max_len real tokens is a ValueError naming max_len and the chunk; under
      jit (traced index) the outputs of every row that overflowed are NaN (documented poisoning, no
      checkify needed), nothing is written past the cache and cache_index stays at max_len.
    q_positions: cross-attention only, int [b or 1, q_seq] (batch-first; [t] for thd): the RoPE positions
      of the query tokens (default: derived from q_segment_ids / the mask rows, else 0..q_seq-1), e.g. a
      decoder chunk's positions; TransformerLayer passes the decoder self-attention's positions.
    scale_attn_logits / scaled_query_init: TransformerEngine's convention — by default the logits are
      not scaled (scale 1.0) and the query kernel is initialised divided by sqrt(head_dim);
      scale_attn_logits=True scales the logits by 1/sqrt(head_dim) (scale_factor overrides both).
    context_parallel_axis: a mesh axis name → the attention runs as te_jax.context_parallel.
      context_parallel_attention over that axis (global arrays in, the mesh from jax.set_mesh);
      context_parallel_load_balanced=True means the tokens come in the zig-zag order of
      reorder_causal_load_balancing, segment ids too (seqlens describe the original order); RoPE
      positions are computed in the original order and then reordered, so documents keep their
      positions across chunk boundaries. No bias / dense mask / attention dropout.
    softmax_type: attention sinks as DotProductAttention ("vanilla", "off-by-one", "learnable"; "learnable"
      owns the parameter `softmax_offset` [h], float32, zeros at init, logical axes ("heads",)); applied in
      the full forward, when decoding with the KV cache and under context parallelism.
    return_residual: the second output is what the caller adds back as the skip connection, as TransformerEngine's
      MultiHeadAttention returns it: ln_output with return_layernorm_output, else inputs_q (the same values). Where
      the FP8 fused norm runs (te_jax.fp8.norm_dense), inputs_q comes out of that op, so the skip connection's
      gradient is added inside the norm's backward pass instead of by a pass of its own. TransformerLayer sets it.
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
    return_residual: bool = False
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
    softmax_type: str = "vanilla"

    @nn.compact
    def __call__(self, inputs_q, inputs_kv=None, mask=None, bias=None, *, decode: bool = False,
                 deterministic: bool = False, q_seqlens=None, kv_seqlens=None, q_segment_ids=None,
                 kv_segment_ids=None, q_positions=None):
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
        ln_out = x_skip = None
        if self.fuse_qkv_params and is_self and h == g:
            qkv, ln_out = LayerNormDenseGeneral(
                features=(3, h, d), kernel_init=_scaled_init(base_init, 3, q_scale),
                kernel_axes=("embed", "qkv", "heads", "kv"), bias_axes=("qkv", "heads", "kv"),
                return_layernorm_output=self.return_layernorm_output, name="qkv", **ln_args, **common)(inputs_q)
            packed_layout, tensors = f"{pre}3hd", (qkv,)
        elif (fp8_plan := self._fp8_norm_qkv(is_self)) is not None:
            # FP8, GQA self-attention: one norm inside one cast of x feeds the query and the K/V GEMMs
            # (te_jax/fp8/norm_dense.py); the parameters and FP8 states keep LayerNormDenseGeneral's and
            # DenseGeneral's names ("query/...", "kv/...")
            recipe, why = fp8_plan
            stats = _fp8_norm_cast.describe_stats(recipe, inputs_q.shape[-1])
            merged = ("; the query and K/V weights cast into one buffer for one GEMM (TE_JAX_FP8_MERGED_CASTS)"
                      if _fp8_fused.merged_casts() else "")
            why = f"{why}; {_fp8_state.NORM_DENSE_PATH}, {stats}, shared by query and kv{merged}"
            cdt = self.dtype or inputs_q.dtype
            skip = self.return_residual and jnp.dtype(cdt) == jnp.dtype(inputs_q.dtype)
            if skip:  # the residual out of the norm's op: its gradient joins the norm's backward pass
                spec = _fp8_norm_cast.norm_spec(jax.ShapeDtypeStruct(inputs_q.shape, cdt), None, None,
                                                layernorm_type=self.layernorm_type, epsilon=self.layernorm_epsilon,
                                                zero_centered_gamma=self.zero_centered_gamma,
                                                backend=self.norm_backend)
                why = f"{why}; {_fp8_norm_cast.describe_skip(spec)}"
            q_kw = dict(features=(h, d), kernel_init=_scaled_init(base_init, 1, q_scale),
                        kernel_axes=("embed", "heads", "kv"), name="query", **ln_args, **common)
            x_q, gamma, beta, wq, sq = LayerNormDenseOperands(**q_kw)(inputs_q, recipe, why)
            wkv, skv = DenseOperands(features=(2, g, d), kernel_init=_scaled_init(base_init, 2, 1.0),
                                     kernel_axes=("embed", "qkv", "kv_heads", "kv"), name="kv", **common)(
                                         (x_q.shape[-1],), recipe, why)
            outs = _fp8_state.norm_dense(x_q, gamma, beta, (wq, wkv), (sq, skv), recipe,
                                         layernorm_type=self.layernorm_type, epsilon=self.layernorm_epsilon,
                                         zero_centered_gamma=self.zero_centered_gamma, backend=self.norm_backend,
                                         skip=skip)
            q, kv = outs[:2]
            x_skip = outs[2] if skip else None
            packed_layout, tensors = f"{fmt}_{pre}2hd", (q, kv)
        else:
            q, ln_q = LayerNormDenseGeneral(
                features=(h, d), kernel_init=_scaled_init(base_init, 1, q_scale),
                kernel_axes=("embed", "heads", "kv"), bias_axes=("heads", "kv"),
                return_layernorm_output=True, name="query", **ln_args, **common)(inputs_q)
            ln_out = ln_q if self.return_layernorm_output else None
            kv_in = ln_q if is_self else inputs_kv
            # self-attention under DelayedScaling: K/V's GEMM casts ln(x) with the query's input scale, so that the
            # two casts of ln(x) are one (te_jax.fp8.state.dense); None otherwise
            shared = _fp8_state.input_scale_of(self, "query") if is_self else None
            if self.fuse_qkv_params:
                kv = DenseGeneral(features=(2, g, d), kernel_init=_scaled_init(base_init, 2, 1.0),
                                  kernel_axes=("embed", "qkv", "kv_heads", "kv"),
                                  bias_axes=("qkv", "kv_heads", "kv"), name="kv", **common)(
                                      kv_in, fp8_input_scale=shared)
                packed_layout, tensors = f"{fmt}_{pre}2hd", (q, kv)
            else:
                dense = dict(features=(g, d), kernel_init=base_init, kernel_axes=("embed", "kv_heads", "kv"),
                             bias_axes=("kv_heads", "kv"), **common)
                k = DenseGeneral(name="key", **dense)(kv_in, fp8_input_scale=shared)
                v = DenseGeneral(name="value", **dense)(kv_in, fp8_input_scale=shared)
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
        if q_positions is not None and is_self:
            raise ValueError(f"{name}: q_positions is for cross-attention (inputs_kv given); self-attention takes "
                             "its RoPE positions from segment ids / the mask, or from the KV cache when decoding.")
        padding = dict(mask=mask, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids,
                       kv_segment_ids=kv_segment_ids)
        step = None
        if cache_ready:
            step = self._decode_plan(name, b, sq, padding)

        if self.enable_rotary_pos_emb:
            rope = dict(group_method=self.rotary_pos_emb_group_method, windows=self.rotary_pos_emb_windows)
            # Load-balanced context parallelism: tokens come zig-zag reordered; positions are computed in
            # the original order and reordered (for segment ids, seqlens, thd and no packing alike).
            cp = (self._load_balanced_cp_size() if self.context_parallel_axis and self.context_parallel_load_balanced
                  and not use_cache else None)
            if step is not None:
                q_pos = step["positions"]
            elif q_positions is not None:
                q_pos = self._check_q_positions(name, q_positions, fmt, b, sq)
            else:
                q_pos = _query_positions(fmt, b, sq, self_attention=is_self, kv_len=skv, module=name, cp_size=cp,
                                         **padding)
            q_pos = _fmt_positions(q_pos, fmt)
            if is_self:
                kv_pos = q_pos
            else:
                kv_seg = kv_segment_ids
                if kv_seg is None and mask is not None and fmt != "thd":
                    kv_seg = _padding_from_mask(mask, fmt, b, sq, skv, name)[1]
                kv_pos = _positions(fmt, b, skv, 0, kv_seg, kv_seqlens if fmt == "thd" else None, cp)
            tensors = _rope_qk(tensors, packed_layout, q_pos, kv_pos, rope)

        softmax_type, softmax_offset = _softmax_offset_param(self, self.softmax_type, h, name)
        attn_args = dict(attn_bias_type=self.attn_bias_type, window_size=self.window_size, softcap=self.softcap,
                         scale=scale, dropout_rate=self.attention_dropout, deterministic=deterministic,
                         dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_logits,
                         backend=self.backend, module_name=name, softmax_type=softmax_type,
                         softmax_offset=softmax_offset)
        out = None
        if use_cache:
            qb, kb, vb = (layouts.to_bshd(t, fmt) for t in tensors)
            ck = self.variable("cache", "cached_key", jnp.zeros, kb.shape, kb.dtype)
            cv = self.variable("cache", "cached_value", jnp.zeros, vb.shape, vb.dtype)
            ci = self.variable("cache", "cache_index", lambda: jnp.zeros((b,), jnp.int32))
            if step is not None:
                out = layouts.from_bshd(self._decode_attend(name, step, qb, kb, vb, ck, cv, ci, bias, attn_args), fmt)
        if out is None:
            out = attend(self, *tensors, qkv_layout=packed_layout, num_attention_heads=h, num_gqa_groups=g,
                         attn_input_format=fmt, attn_mask_type=self.attn_mask_type, mask=mask,
                         bias=bias, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids,
                         kv_segment_ids=kv_segment_ids, context_parallel_axis=self.context_parallel_axis,
                         context_parallel_strategy=self.context_parallel_strategy,
                         context_parallel_load_balanced=self.context_parallel_load_balanced, **attn_args)

        y = DenseGeneral(features=hidden, axis=(-2, -1), kernel_init=base_init, kernel_axes=("heads", "kv", "embed"),
                         bias_axes=("embed",), name="out", **common)(out)
        if self.return_residual and not self.return_layernorm_output:
            return y, (inputs_q if x_skip is None else x_skip)
        return y, ln_out

    def _fp8_norm_qkv(self, is_self):
        """(recipe, reason) when the query and fused K/V projections run as one te_jax.fp8.norm_dense call (FP8 on,
        a per-tensor recipe with the fused casts, self-attention, fuse_qkv_params, the input norm on, its output not
        returned, no biases); None otherwise (then LayerNormDenseGeneral + DenseGeneral, each explaining itself)."""
        if not (is_self and self.fuse_qkv_params and self.input_layernorm) or self.return_layernorm_output:
            return None
        recipe, why = _fp8_ac.resolve("LayerNormDenseGeneral", None, None)
        if recipe is None or _fp8_state.norm_dense_unavailable(recipe, has_bias=self.use_bias, returns_ln=False):
            return None
        return recipe, why

    def _decode_plan(self, name, b, sq, padding):
        """This decode call's tokens against the cache: validity, per-row counts, RoPE positions, checks."""
        ck = self.get_variable("cache", "cached_key")
        lens = self.get_variable("cache", "cache_index")
        max_len = ck.shape[1]
        if tuple(jnp.shape(lens)) != (b,):
            raise ValueError(
                f"{name}: cache_index has shape {tuple(jnp.shape(lens))}, expected [batch] = ({b},) (one valid "
                f"length per row); a cache made by an older te_jax keeps one index for the batch: re-create it "
                f"with init(..., decode=True).")
        if sq > max_len:
            raise ValueError(
                f"{name}: decoding a chunk of {sq} tokens, longer than the KV cache (max_len={max_len}, the "
                f"length of the input the cache was initialised with): pass at most {max_len} tokens per call, "
                f"or initialise the cache with a longer input.")
        valid = _decode_validity(name, b, sq, **padding)
        n = jnp.sum(valid, axis=1, dtype=jnp.int32)  # real tokens per row in this call
        if masks._is_concrete(lens) and masks._is_concrete(n):
            over = np.nonzero(np.asarray(lens) + np.asarray(n) > max_len)[0]
            if over.size:
                r = int(over[0])
                raise ValueError(
                    f"{name}: decoding past the KV cache: it holds max_len={max_len} tokens per row, row {r} "
                    f"already holds {int(np.asarray(lens)[r])} and this chunk of {sq} tokens adds "
                    f"{int(np.asarray(n)[r])} real ones (rows over: {over.tolist()}). Initialise the cache with "
                    f"an input as long as the longest prompt plus the tokens to generate, or stop those rows.")
        rank = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1
        positions = lens[:, None] + jnp.maximum(rank, 0)  # [b, sq]: each row's real tokens counted
        return dict(valid=valid, n=n, rank=rank, lens=lens, positions=positions, max_len=max_len)

    def _decode_attend(self, name, step, qb, kb, vb, ck, cv, ci, bias, attn_args):
        """Write this call's real keys/values after each row's cached ones; attend; q/k/v/out bshd."""
        b, sq = qb.shape[:2]
        valid, n, lens, max_len = step["valid"], step["n"], step["lens"], step["max_len"]
        if kb.shape[0] != ck.value.shape[0] or kb.shape[2:] != ck.value.shape[2:]:
            raise ValueError(f"{name}: decode step keys {tuple(kb.shape)} do not fit the cache "
                             f"{tuple(ck.value.shape)} ([batch, max_len, kv_heads, head_dim]); decode with the "
                             f"batch size and heads the cache was initialised with.")
        # Real tokens go to slots lens + rank (each row's cache stays contiguous from slot 0); padding
        # tokens and rows past the cache go to slot max_len, which the scatter drops.
        slot = jnp.where(valid, lens[:, None] + step["rank"], max_len)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, sq))
        ck.value = ck.value.at[rows, slot].set(kb.astype(ck.value.dtype), mode="drop")
        cv.value = cv.value.at[rows, slot].set(vb.astype(cv.value.dtype), mode="drop")
        total = lens + n
        overflow = total > max_len
        new_lens = jnp.minimum(total, max_len)
        ci.value = new_lens
        # The queries are compacted (real tokens first, in order) so that per-row lengths describe them:
        # query r of row i sits at position lens[i] + r and sees cache slots <= lens[i] + r
        # (padding_causal_bottom_right with q_seqlens = n, kv_seqlens = lens + n).
        order = jnp.argsort(jnp.logical_not(valid), axis=1, stable=True)  # [b, sq]
        qc = jnp.take_along_axis(qb, order[:, :, None, None], axis=1)
        bias = _decode_bias(name, bias, b, sq, max_len, step["positions"], order)
        out = attend(self, qc, ck.value, cv.value, attn_input_format="bshd",
                     attn_mask_type="padding_causal_bottom_right", bias=bias, q_seqlens=n, kv_seqlens=new_lens,
                     **attn_args)
        inverse = jnp.argsort(order, axis=1)
        out = jnp.take_along_axis(out, inverse[:, :, None, None], axis=1)
        # Past the cache under jit (no concrete index to raise on): the rows that overflowed give NaN.
        return jnp.where(overflow[:, None, None, None], jnp.asarray(jnp.nan, out.dtype), out)

    @staticmethod
    def _check_q_positions(name, q_positions, fmt, b, sq):
        pos = jnp.asarray(q_positions)
        expected = ((sq,),) if fmt == "thd" else ((b, sq), (1, sq))
        if tuple(pos.shape) not in expected or not jnp.issubdtype(pos.dtype, jnp.integer):
            want = "[tokens]" if fmt == "thd" else f"[batch or 1, q_seq] = [{b} or 1, {sq}] (batch-first)"
            raise ValueError(f"{name}: q_positions has shape {tuple(pos.shape)} and dtype {pos.dtype}; expected "
                             f"integers of shape {want}, the RoPE positions of the query tokens.")
        return pos.astype(jnp.int32)

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
