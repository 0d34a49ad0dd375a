"""Mask types, and the per-token arrays every backend masks with.

Every mask type reduces to four int32 arrays in canonical [batch, seq] form (a `TokenMask`) and
the call's causal flag and window; together they are a `pallas_kernels.mask.AttentionMask`
(`TokenMask.with_rule`; re-exported here), whose module states the one visibility rule (same
segment, not padding, and the causal / window bounds on positions) and implements it (`visible`).

Segment id 0 is padding. Positions count from the start of each segment (top-left alignment)
or, for the `*_bottom_right` types, from its end (q_pos = index - q_segment_end, likewise for
kv), so that the last query of a segment lines up with its last key.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mask import AttentionMask, segment_positions, visible  # noqa: F401  (re-exported)

MASK_TYPES = (
    "no_mask",
    "causal",
    "causal_bottom_right",
    "padding",
    "padding_causal",
    "padding_causal_bottom_right",
)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static description of a mask type."""

    mask_type: str

    @property
    def causal(self) -> bool:
        return "causal" in self.mask_type

    @property
    def bottom_right(self) -> bool:
        return self.mask_type.endswith("bottom_right")

    @property
    def padding(self) -> bool:
        return self.mask_type.startswith("padding")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenMask:
    """Per-token segment ids and positions, [batch, seq] int32 each: the data of an AttentionMask,
    without the call's causal flag and window (backends receive those as arguments)."""

    q_segment_ids: jax.Array
    q_positions: jax.Array
    kv_segment_ids: jax.Array
    kv_positions: jax.Array

    def with_rule(self, causal: bool, window) -> AttentionMask:
        """The AttentionMask of these arrays under `causal` and `window` ((left, right), -1 unbounded)."""
        return AttentionMask(self.q_segment_ids, self.q_positions, self.kv_segment_ids, self.kv_positions,
                             causal=causal, window=window)


def check_mask_type(attn_mask_type: str) -> MaskSpec:
    if attn_mask_type not in MASK_TYPES:
        raise ValueError(f"attn_mask_type={attn_mask_type!r} is not known; expected one of {MASK_TYPES}.")
    return MaskSpec(attn_mask_type)


def check_window(window_size, mask: MaskSpec):
    """Normalise `window_size` to (left, right) ints, -1 meaning unbounded."""
    if window_size is None:
        return (-1, -1)
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size={window_size!r} must be a pair (left, right) of ints, -1 for unbounded, "
            f"e.g. (128, 0) for a causal sliding window of 128 keys.") from None
    for name, w in (("left", left), ("right", right)):
        if w < -1:
            raise ValueError(
                f"window_size={window_size!r}: {name}={w} is negative; use -1 for an unbounded side or a size >= 0.")
    if mask.causal and right > 0:
        raise ValueError(
            f"window_size={window_size!r} has right={right} but attn_mask_type={mask.mask_type!r} is causal, "
            f"which already hides every later key; use right=0 or -1, or a non-causal mask type.")
    return (left, right)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_int_array(x, argname, expected_shape, shape_text):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{argname} must hold integers, got dtype {x.dtype}.")
    if tuple(x.shape) != tuple(expected_shape):
        raise ValueError(
            f"{argname}: got shape {tuple(x.shape)}, expected {tuple(expected_shape)} ({shape_text}).")
    return x.astype(jnp.int32)


def _check_seqlens_values(lens, argname, max_len, what):
    if _is_concrete(lens):
        arr = np.asarray(lens)
        if arr.size and (arr.min() < 0 or arr.max() > max_len):
            raise ValueError(
                f"{argname}={arr.tolist()} has values outside [0, {max_len}]: {what} is {max_len} long. "
                f"Each length must be at most the padded sequence length.")


def _positions(seg, bottom_right: bool):
    """Positions within each run of equal segment ids (`pallas_kernels.mask.segment_positions`)."""
    return segment_positions(seg, bottom_right=bottom_right)


def _seqlens_to_batch_segments(lens, batch, seq_len):
    idx = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    return (idx < lens[:, None]).astype(jnp.int32)


def _seqlens_to_packed_segments(lens, total):
    """Packed lengths [n] → segment ids [total] (1..n, 0 past the sum). Without a loop: a scatter of the
    documents' ends and a running sum. jnp.searchsorted's default method is a loop, which XLA may keep as a while
    loop on a GPU: kernel launches and a host check per step, on every thd call."""
    ends = jnp.cumsum(lens.astype(jnp.int32))
    idx = jnp.arange(total, dtype=jnp.int32)
    marks = jnp.zeros((total + 1,), jnp.int32).at[jnp.clip(ends, 0, total)].add(1)  # ends at or before each token
    seg = jnp.cumsum(marks[:total]) + 1
    return jnp.where(idx < ends[-1], seg, 0).astype(jnp.int32)


def _both_sides(q_value, kv_value, what, q_len, kv_len):
    """Self-attention may pass padding for one side only: the other side shares it."""
    if q_value is None or kv_value is None:
        if q_len != kv_len:
            raise ValueError(f"Only one of q_{what}/kv_{what} was given and q and kv lengths differ "
                             f"({q_len} vs {kv_len}); pass both.")
        q_value = kv_value if q_value is None else q_value
        kv_value = q_value if kv_value is None else kv_value
    return q_value, kv_value


def build_token_mask(mask: MaskSpec, attn_input_format: str, batch: int, q_len: int, kv_len: int,
                     q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None) -> TokenMask:
    """Validate the padding arguments and build the TokenMask for canonical [batch, seq] inputs.

    bshd/sbhd: `q_seqlens`/`kv_seqlens` are [batch] valid lengths (tokens past them are padding);
    segment ids are [batch, seq]. thd: `q_seqlens`/`kv_seqlens` are [num_seqs] lengths of the
    sequences packed back to back, segment ids are [tokens]; one of the two is required.
    """
    fmt = attn_input_format
    has_lens = q_seqlens is not None or kv_seqlens is not None
    has_segs = q_segment_ids is not None or kv_segment_ids is not None
    if has_lens and has_segs:
        raise ValueError("Pass either q_seqlens/kv_seqlens or q_segment_ids/kv_segment_ids, not both.")
    if (has_lens or has_segs) and not mask.padding:
        raise ValueError(
            f"attn_mask_type={mask.mask_type!r} does not use padding, but sequence lengths or segment ids were "
            f"passed; use attn_mask_type='padding', 'padding_causal' or 'padding_causal_bottom_right'.")
    if mask.padding and not (has_lens or has_segs):
        raise ValueError(
            f"attn_mask_type={mask.mask_type!r} needs q_seqlens/kv_seqlens or q_segment_ids/kv_segment_ids "
            f"to know which tokens are padding.")
    if fmt == "thd" and not (has_lens or has_segs):
        raise ValueError(
            "attn_input_format='thd' packs several sequences on one token axis: pass q_seqlens/kv_seqlens "
            "([num_seqs] lengths) or q_segment_ids/kv_segment_ids ([tokens]) with a padding mask type.")

    if has_segs:
        q_segment_ids, kv_segment_ids = _both_sides(q_segment_ids, kv_segment_ids, "segment_ids", q_len, kv_len)
        if fmt == "thd":
            q_seg = _check_int_array(q_segment_ids, "q_segment_ids", (q_len,), "[tokens] for thd")[None]
            kv_seg = _check_int_array(kv_segment_ids, "kv_segment_ids", (kv_len,), "[tokens] for thd")[None]
        else:
            q_seg = _check_int_array(q_segment_ids, "q_segment_ids", (batch, q_len), "[batch, q_seq]")
            kv_seg = _check_int_array(kv_segment_ids, "kv_segment_ids", (batch, kv_len), "[batch, kv_seq]")
    elif has_lens:
        q_seqlens, kv_seqlens = _both_sides(q_seqlens, kv_seqlens, "seqlens", q_len, kv_len)
        if fmt == "thd":
            q_lens = jnp.asarray(q_seqlens)
            kv_lens = jnp.asarray(kv_seqlens)
            if q_lens.ndim != 1 or kv_lens.ndim != 1 or q_lens.shape != kv_lens.shape:
                raise ValueError(
                    f"q_seqlens/kv_seqlens: for thd both are [num_seqs] with the same length; got shapes "
                    f"{tuple(q_lens.shape)} and {tuple(kv_lens.shape)}.")
            q_lens = _check_int_array(q_lens, "q_seqlens", q_lens.shape, "[num_seqs]")
            kv_lens = _check_int_array(kv_lens, "kv_seqlens", kv_lens.shape, "[num_seqs]")
            for name, lens, total in (("q_seqlens", q_lens, q_len), ("kv_seqlens", kv_lens, kv_len)):
                if _is_concrete(lens) and int(np.sum(np.asarray(lens))) > total:
                    raise ValueError(
                        f"{name}={np.asarray(lens).tolist()} sums to {int(np.sum(np.asarray(lens)))}, more than the "
                        f"{total} tokens of the packed tensor.")
                _check_seqlens_values(lens, name, total, "the token axis")
            q_seg = _seqlens_to_packed_segments(q_lens, q_len)[None]
            kv_seg = _seqlens_to_packed_segments(kv_lens, kv_len)[None]
        else:
            q_lens = _check_int_array(q_seqlens, "q_seqlens", (batch,), "[batch]")
            kv_lens = _check_int_array(kv_seqlens, "kv_seqlens", (batch,), "[batch]")
            _check_seqlens_values(q_lens, "q_seqlens", q_len, "the query sequence")
            _check_seqlens_values(kv_lens, "kv_seqlens", kv_len, "the key/value sequence")
            q_seg = _seqlens_to_batch_segments(q_lens, batch, q_len)
            kv_seg = _seqlens_to_batch_segments(kv_lens, batch, kv_len)
    else:
        q_seg = jnp.ones((batch, q_len), jnp.int32)
        kv_seg = jnp.ones((batch, kv_len), jnp.int32)

    if has_lens or has_segs:
        # Positions within each segment; segment 0 (padding) never matches, so its positions are irrelevant.
        q_pos = _positions(q_seg, mask.bottom_right)
        kv_pos = _positions(kv_seg, mask.bottom_right)
        if has_lens and fmt != "thd":
            # bshd/sbhd padding: the valid run is [0, len); its end is the length, not the padded end.
            idx_q = jnp.arange(q_len, dtype=jnp.int32)[None, :]
            idx_kv = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
            if mask.bottom_right:
                q_pos = idx_q - q_lens[:, None]
                kv_pos = idx_kv - kv_lens[:, None]
            else:
                q_pos = jnp.broadcast_to(idx_q, (batch, q_len))
                kv_pos = jnp.broadcast_to(idx_kv, (batch, kv_len))
    else:
        shift_q = q_len if mask.bottom_right else 0
        shift_kv = kv_len if mask.bottom_right else 0
        q_pos = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32)[None] - shift_q, (batch, q_len))
        kv_pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32)[None] - shift_kv, (batch, kv_len))
    return TokenMask(q_seg, q_pos.astype(jnp.int32), kv_seg, kv_pos.astype(jnp.int32))


# ----------------------------------------------------------------------------- dense boolean masks
#
# A dense `mask` ([batch|1, heads|1, s_q, s_kv], bool, True = masked out: TransformerEngine's
# convention) is applied exactly, on top of the mask type / padding / window: key j is visible to
# query i iff the rule above holds AND not mask[b, h, i, j]. A row that sees no key gives zeros.

# What the Pallas backend adds to the logits of masked-out elements (folded into the bias). Finite, so the
# kernel's online softmax never subtracts -inf from -inf; large enough that exp() of a masked logit is 0 in
# fp32 next to any visible one (a difference beyond ~104 underflows). Rows that the mask hides entirely are
# zeroed after the kernel (their softmax over -1e9 logits would be an average, not the contract's zeros).
DENSE_MASK_NEG = -1e9


def check_dense_mask(mask, batch, heads, q_len, kv_len, attn_input_format="bshd"):
    """Validate a dense boolean mask; returns it (a jax array). Shapes are canonical (batch first)."""
    if mask is None:
        return None
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        mask = jnp.asarray(mask)
    shape = tuple(mask.shape)
    thd = " (thd: batch is 1, seq the token axis)" if attn_input_format == "thd" else ""
    ok = (len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, heads)
          and shape[2:] == (q_len, kv_len))
    if not ok:
        raise ValueError(
            f"mask: got shape {shape}, expected [batch or 1, heads or 1, q_seq, kv_seq] = [{batch} or 1, "
            f"{heads} or 1, {q_len}, {kv_len}]{thd}, batch-first whatever attn_input_format={attn_input_format!r}. "
            f"Add broadcast axes with mask[None, None] (a [q_seq, kv_seq] mask) or reshape; if the batch and "
            f"sequence axes look swapped, attn_input_format is probably wrong.")
    if jnp.dtype(mask.dtype) != jnp.bool_:
        raise ValueError(
            f"mask has dtype {jnp.dtype(mask.dtype).name}; it must be boolean with True = masked out "
            f"(TransformerEngine's convention): pass `mask != 0` for an integer 0/1 mask (1 = masked out), "
            f"`~keep` for a True = attend mask, or an additive float mask as `bias`.")
    return jnp.asarray(mask)


def fold_dense_mask(bias, mask, neg):
    """bias (or 0) + `neg` where mask is True, in float32: [broadcast of bias and mask shapes]."""
    add = jnp.where(mask, jnp.float32(neg), jnp.float32(0.0))
    return add if bias is None else bias.astype(jnp.float32) + add


def dense_mask_rows_visible(tm: TokenMask, mask, *, causal, window):
    """[B, Sq, H|1, 1] bool: the query row sees at least one key under the token mask AND the dense mask."""
    vis = tm.with_rule(causal, window).dense()  # [B, Sq, Skv]
    rows = jnp.any(vis[:, None] & jnp.logical_not(mask), axis=-1)  # [B, H|1, Sq]
    return jnp.transpose(rows, (0, 2, 1))[..., None]
