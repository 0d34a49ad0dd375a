"""Attention input formats and QKV layouts: parse, validate, split, convert.

Formats (what each axis of an attention input means):
  "bshd": [batch, seq, heads, head_dim]
  "sbhd": [seq, batch, heads, head_dim]
  "thd":  [tokens, heads, head_dim] — sequences packed back to back along one token axis;
          their boundaries come from `q_seqlens`/`kv_seqlens` or segment ids.

QKV layouts (TransformerEngine names). `h` query heads, `g` key/value heads (GQA groups):
  separate:    bshd_bshd_bshd, sbhd_sbhd_sbhd, thd_thd_thd
  KV-packed:   bshd_bs2hd [b,s,2,g,d], bshd_bsh2d [b,s,g,2,d], sbhd_sb2hd, sbhd_sbh2d, thd_t2hd, thd_th2d
  QKV-packed:  bs3hd [b,s,3,h,d], bsh3d [b,s,h,3,d], sb3hd, sbh3d, t3hd, th3d   (needs h == g)
  GQA-packed:  bs(h+2g)d [b,s,h+2g,d], sb(h+2g)d, t(h+2g)d — heads q..., k..., v... on one axis.

Every function here raises ValueError naming the argument, the shape seen, the shape expected
and the fix. `te_jax.dot_product_attention_packed` takes packed tensors without splitting them
where the Pallas kernel can read them in place (it validates with `unpack_qkv` on shapes only).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

FORMATS = ("bshd", "sbhd", "thd")

_FORMAT_AXES = {
    "bshd": "[batch, seq, heads, head_dim]",
    "sbhd": "[seq, batch, heads, head_dim]",
    "thd": "[tokens, heads, head_dim]",
}


@dataclasses.dataclass(frozen=True)
class QKVLayout:
    """How q, k and v are stored. `pack_axis` counts axes of the packed tensor."""

    name: str
    attn_input_format: str
    kind: str  # "separate" | "kv_packed" | "qkv_packed" | "gqa_packed"
    pack_axis: int | None = None  # axis holding the 2 or 3 for kv/qkv packing

    @property
    def num_tensors(self) -> int:
        return {"separate": 3, "kv_packed": 2, "qkv_packed": 1, "gqa_packed": 1}[self.kind]


def _layouts():
    out = {}
    seq_prefix = {"bshd": ("bs", 2), "sbhd": ("sb", 2), "thd": ("t", 1)}
    for fmt, (pre, n_lead) in seq_prefix.items():
        sep = "thd_thd_thd" if fmt == "thd" else f"{fmt}_{fmt}_{fmt}"
        out[sep] = QKVLayout(sep, fmt, "separate")
        for tag, axis in ((f"{pre}2hd", n_lead), (f"{pre}h2d", n_lead + 1)):
            name = f"{fmt}_{tag}"
            out[name] = QKVLayout(name, fmt, "kv_packed", axis)
        for tag, axis in ((f"{pre}3hd", n_lead), (f"{pre}h3d", n_lead + 1)):
            out[tag] = QKVLayout(tag, fmt, "qkv_packed", axis)
        name = f"{pre}(h+2g)d"
        out[name] = QKVLayout(name, fmt, "gqa_packed")
    return out


QKV_LAYOUTS: dict[str, QKVLayout] = _layouts()


def check_format(attn_input_format: str, argname: str = "attn_input_format") -> str:
    """Return the format if it is known, else raise ValueError listing the choices."""
    if attn_input_format not in FORMATS:
        raise ValueError(
            f"{argname}={attn_input_format!r} is not a known format; expected one of {FORMATS} "
            f"(bshd = {_FORMAT_AXES['bshd']}, sbhd = {_FORMAT_AXES['sbhd']}, thd = {_FORMAT_AXES['thd']})."
        )
    return attn_input_format


def get_qkv_layout(qkv_layout: str) -> QKVLayout:
    if qkv_layout not in QKV_LAYOUTS:
        raise ValueError(
            f"qkv_layout={qkv_layout!r} is not a known layout; expected one of {sorted(QKV_LAYOUTS)}."
        )
    return QKV_LAYOUTS[qkv_layout]


def head_axis_rank(attn_input_format: str) -> int:
    """Rank of an unpacked attention tensor in this format (4, or 3 for thd)."""
    return 3 if attn_input_format == "thd" else 4


def check_attention_tensor(x, argname: str, attn_input_format: str):
    """Check the rank of a q/k/v tensor against its declared format."""
    rank = head_axis_rank(attn_input_format)
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        what = "None" if x is None else f"a {type(x).__name__}"
        raise ValueError(
            f"{argname} is {what}; expected a jax or numpy array of shape {_FORMAT_AXES[attn_input_format]} "
            f"(attn_input_format={attn_input_format!r}). Fix: pass an array (jnp.asarray(...) for nested lists).")
    shape = tuple(x.shape)
    if len(shape) != rank:
        hint = ""
        if len(shape) == rank - 1:
            hint = (
                " It looks like a tensor with no head axis ([..., hidden]): reshape the last axis "
                "to [heads, head_dim] first, e.g. x.reshape(*x.shape[:-1], num_heads, hidden // num_heads)."
            )
        raise ValueError(
            f"{argname}: attn_input_format={attn_input_format!r} needs a rank-{rank} tensor "
            f"{_FORMAT_AXES[attn_input_format]}, got shape {shape} (rank {len(shape)}).{hint}"
        )


def to_bshd(x, attn_input_format: str):
    """Convert a tensor of the given format to [batch, seq, heads, dim] (thd → batch 1)."""
    if attn_input_format == "bshd":
        return x
    if attn_input_format == "sbhd":
        return jnp.swapaxes(x, 0, 1)
    return x[None]


def from_bshd(x, attn_input_format: str):
    """Inverse of `to_bshd`."""
    if attn_input_format == "bshd":
        return x
    if attn_input_format == "sbhd":
        return jnp.swapaxes(x, 0, 1)
    return x[0]


def _packed_shape_error(argname, layout, shape, expected, fix):
    return ValueError(
        f"{argname}: qkv_layout={layout.name!r} expects shape {expected}, got {tuple(shape)}. {fix}"
    )


def _lead_names(fmt):
    return {"bshd": "b, s", "sbhd": "s, b", "thd": "t"}[fmt]


def unpack_qkv(*tensors, qkv_layout: str, num_attention_heads: int | None = None,
               num_gqa_groups: int | None = None):
    """Split packed attention inputs into (q, k, v), each in the layout's format.

    Pass the tensors the layout stores: three for separate layouts, (q, kv) for KV-packed,
    one for QKV-packed and GQA-packed. `num_attention_heads` (h) and `num_gqa_groups` (g)
    are required for the GQA-packed form `…(h+2g)d` and checked when given otherwise.
    Returns q [..., h, d], k [..., g, d], v [..., g, d_v].
    """
    layout = get_qkv_layout(qkv_layout)
    fmt = layout.attn_input_format
    if len(tensors) != layout.num_tensors:
        raise ValueError(
            f"qkv_layout={layout.name!r} stores q, k, v in {layout.num_tensors} tensor(s), "
            f"but {len(tensors)} were passed."
        )
    n_lead = 1 if fmt == "thd" else 2
    lead = _lead_names(fmt)

    if layout.kind == "separate":
        q, k, v = tensors
        for name, t in (("query", q), ("key", k), ("value", v)):
            check_attention_tensor(t, name, fmt)
    elif layout.kind in ("kv_packed", "qkv_packed"):
        n = 2 if layout.kind == "kv_packed" else 3
        packed = tensors[-1]
        argname = "kv" if n == 2 else "qkv"
        shape = tuple(packed.shape)
        inner = "2" if n == 2 else "3"
        expected = (f"[{lead}, {inner}, heads, d]" if layout.pack_axis == n_lead
                    else f"[{lead}, heads, {inner}, d]")
        if len(shape) != n_lead + 3 or shape[layout.pack_axis] != n:
            raise _packed_shape_error(
                argname, layout, shape, expected,
                f"Axis {layout.pack_axis} must have size {n}; check that the layout matches how the tensor was packed.")
        # Static slices (backward: pads that XLA fuses into one write), not jnp.take (a gather whose
        # transpose is a scatter-add into zeros per part).
        parts = [lax.index_in_dim(packed, i, axis=layout.pack_axis, keepdims=False) for i in range(n)]
        if n == 2:
            q = tensors[0]
            check_attention_tensor(q, "query", fmt)
            k, v = parts
        else:
            q, k, v = parts
    else:  # gqa_packed
        packed = tensors[0]
        shape = tuple(packed.shape)
        if num_attention_heads is None or num_gqa_groups is None:
            raise ValueError(
                f"qkv_layout={layout.name!r} needs num_attention_heads (h) and num_gqa_groups (g) "
                f"to split the head axis of size h + 2g; got num_attention_heads={num_attention_heads}, "
                f"num_gqa_groups={num_gqa_groups}.")
        h, g = num_attention_heads, num_gqa_groups
        expected = f"[{lead}, h + 2g = {h + 2 * g}, d]"
        if len(shape) != n_lead + 2 or shape[n_lead] != h + 2 * g:
            raise _packed_shape_error(
                "qkv", layout, shape, expected,
                f"The head axis (axis {n_lead}) must hold h={h} query heads then g={g} key and g={g} value heads.")
        q = packed[(slice(None),) * n_lead + (slice(0, h),)]
        k = packed[(slice(None),) * n_lead + (slice(h, h + g),)]
        v = packed[(slice(None),) * n_lead + (slice(h + g, h + 2 * g),)]

    h_seen, g_seen = q.shape[-2], k.shape[-2]
    if num_attention_heads is not None and h_seen != num_attention_heads:
        raise ValueError(
            f"query: num_attention_heads={num_attention_heads} but the query head axis has {h_seen} heads "
            f"(shape {tuple(q.shape)}). Pass the number of query heads the tensor holds.")
    if num_gqa_groups is not None and g_seen != num_gqa_groups:
        raise ValueError(
            f"key: num_gqa_groups={num_gqa_groups} but the key head axis has {g_seen} heads "
            f"(shape {tuple(k.shape)}). Pass the number of key/value heads the tensor holds.")
    return q, k, v


def infer_qkv_layout(query, key=None, value=None, *, attn_input_format: str,
                     num_attention_heads: int | None = None, num_gqa_groups: int | None = None) -> str:
    """Name the QKV layout of the given tensors under `attn_input_format`.

    (q, k, v) → separate; (q, kv) → KV-packed; (qkv,) → QKV-packed, or GQA-packed when
    `num_attention_heads`/`num_gqa_groups` are given and the head axis has h + 2g heads.
    The shapes are validated with `unpack_qkv`.
    """
    fmt = check_format(attn_input_format)
    n_lead = 1 if fmt == "thd" else 2
    pre = {"bshd": "bs", "sbhd": "sb", "thd": "t"}[fmt]
    if key is not None and value is not None:
        name = "thd_thd_thd" if fmt == "thd" else f"{fmt}_{fmt}_{fmt}"
        tensors = (query, key, value)
    elif key is not None:
        axis2 = key.shape[n_lead] if key.ndim > n_lead else None
        name = f"{fmt}_{pre}2hd" if axis2 == 2 else f"{fmt}_{pre}h2d"
        tensors = (query, key)
    elif value is None:
        shape = tuple(query.shape)
        if len(shape) == n_lead + 3:
            name = f"{pre}3hd" if shape[n_lead] == 3 else f"{pre}h3d"
        elif len(shape) == n_lead + 2:
            name = f"{pre}(h+2g)d"
        else:
            raise ValueError(
                f"query: a single packed tensor in format {fmt!r} has rank {n_lead + 3} "
                f"([{_lead_names(fmt)}, 3, h, d]) or {n_lead + 2} ([{_lead_names(fmt)}, h+2g, d]); got {shape}.")
        tensors = (query,)
    else:
        raise ValueError("value was given without key: pass (query, key, value), (query, kv) or (qkv,).")
    unpack_qkv(*tensors, qkv_layout=name, num_attention_heads=num_attention_heads,
               num_gqa_groups=num_gqa_groups)
    return name


@dataclasses.dataclass(frozen=True)
class AttentionDims:
    """Sizes of an attention call in canonical [batch, seq, heads, dim] terms."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int


def check_qkv(query, key, value, attn_input_format: str) -> AttentionDims:
    """Validate q, k, v against the format and each other; return their dims."""
    fmt = check_format(attn_input_format)
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_attention_tensor(t, name, fmt)
    q, k, v = (tuple(t.shape) for t in (query, key, value))
    ax = _FORMAT_AXES[fmt]
    if fmt == "thd":
        bq = bk = bv = 1
        (sq, hq, dq), (sk, hk, dk), (sv, hv, dv) = q, k, v
    elif fmt == "bshd":
        (bq, sq, hq, dq), (bk, sk, hk, dk), (bv, sv, hv, dv) = q, k, v
    else:
        (sq, bq, hq, dq), (sk, bk, hk, dk), (sv, bv, hv, dv) = q, k, v
    if fmt != "thd" and not (bq == bk == bv):
        raise ValueError(
            f"key/value: batch sizes differ: query {q}, key {k}, value {v} in {fmt!r} {ax}. "
            f"All three need the same batch size {bq}.")
    if sk != sv:
        raise ValueError(
            f"value: key and value need the same sequence length, got key {k} and value {v} in {fmt!r} {ax}.")
    if hk != hv:
        raise ValueError(
            f"value: key and value need the same number of heads, got key {k} and value {v} in {fmt!r} {ax}.")
    if dq != dk:
        raise ValueError(
            f"key: query and key need the same head_dim, got query {q} (head_dim {dq}) and key {k} "
            f"(head_dim {dk}) in {fmt!r} {ax}.")
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"key: the query heads ({hq}) must be a multiple of the key/value heads ({hk}) for grouped-query "
            f"attention; got query {q} and key {k} in {fmt!r} {ax}. Use a number of key/value heads that divides {hq}.")
    if min(q + k + v) == 0:
        raise ValueError(f"query/key/value: empty axis in query {q}, key {k}, value {v}.")
    return AttentionDims(bq, sq, sk, hq, hk, dq, dv)
