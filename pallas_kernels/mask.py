"""The attention mask: one value, one visibility rule, one block classification.

An `AttentionMask` holds four int32 arrays in [batch, seq] form and two static settings:

  q_segment_ids [B, Sq], q_positions [B, Sq], kv_segment_ids [B, Skv], kv_positions [B, Skv]
  causal: bool, window: (left, right) with -1 for an unbounded side

and says that key j is visible to query i (in batch row b) iff

  q_seg[i] == kv_seg[j] != 0
  and (not causal  or kv_pos[j] <= q_pos[i])
  and (left < 0    or kv_pos[j] >= q_pos[i] - left)
  and (right < 0   or kv_pos[j] <= q_pos[i] + right)

Segment id 0 is padding: a padding query sees nothing and a padding key is seen by no query. Every
mask kind is data in these arrays: no mask (one segment, positions 0..S-1), causal top-left or
bottom-right (positions counted from the start or from the end of each segment: `segment_positions`),
padding (segment 0 past the valid length), packed sequences (one id per sequence), sliding windows,
and any reorder of the tokens (context parallelism's zig-zag keeps each token's own position).

`visible` is the rule, written once: the reference materialises it (`AttentionMask.dense`), the
Pallas kernels apply it to each (q tile, kv tile) they compute. `tile_stats` / `classify` (and
`AttentionMask.block_classes`) sort a tile pair into EMPTY / PARTIAL / FULL from the per-tile range
of segment ids and positions, conservatively: EMPTY only when no pair can be visible, FULL only when
every pair is. The kernels skip EMPTY tiles and compute FULL ones without the element mask; context
parallelism classifies whole ring blocks the same way (one tile = a local chunk).

This module imports jax and numpy only (kernels never import te_jax).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Tile classes (int8 values of `classify` / `AttentionMask.block_classes`).
EMPTY = 0    # no (query, key) pair of the tile is visible: skip it
PARTIAL = 1  # some may be: compute with the element mask
FULL = 2     # every pair is visible: compute without the element mask

UNBOUNDED = -1  # a window side without a bound

_I32 = np.iinfo(np.int32)


def check_window(window) -> tuple[int, int]:
    """`window` as a (left, right) pair of ints >= -1; ValueError otherwise."""
    try:
        left, right = (int(w) for w in window)
    except (TypeError, ValueError):
        raise ValueError(f"window={window!r} must be a pair (left, right) of ints, -1 for unbounded") from None
    if left < -1 or right < -1:
        raise ValueError(f"window={window!r}: each side is an int >= 0, or -1 for unbounded")
    return (left, right)


def visible(q_seg, q_pos, kv_seg, kv_pos, *, causal: bool = False, window=(UNBOUNDED, UNBOUNDED)):
    """THE visibility rule, elementwise with broadcasting: True where the key is visible to the query.

    Pass query values and key values in shapes that broadcast against each other: [B, Sq, 1] and
    [B, 1, Skv] give the dense [B, Sq, Skv] mask; [bq, 1] and [1, bk] a kernel tile ([bk, 1] and
    [1, bq] its transpose). `causal` and `window` are static (Python values).
    """
    left, right = window
    mask = (q_seg == kv_seg) & (q_seg != 0)
    if causal:
        mask &= kv_pos <= q_pos
    if left >= 0:
        mask &= kv_pos >= q_pos - left
    if right >= 0:
        mask &= kv_pos <= q_pos + right
    return mask


# --------------------------------------------------------------------------------------
# Block classification
# --------------------------------------------------------------------------------------
class TileStats(NamedTuple):
    """Per-tile summary of one side (queries or keys), arrays [..., n_tiles].

    seg_min/seg_max, pos_min/pos_max: ranges over the tile's valid tokens (segment id != 0). A tile
    without a valid token has seg_min = int32 max > seg_max = int32 min (and the same sentinels for
    positions), so no segment range overlaps it. all_valid: no padding token in the tile.
    """

    seg_min: jax.Array
    seg_max: jax.Array
    pos_min: jax.Array
    pos_max: jax.Array
    all_valid: jax.Array


def tile_stats(seg, pos, block: int) -> TileStats:
    """TileStats of [..., S] segment ids / positions cut into tiles of `block` tokens (S % block == 0)."""
    s = seg.shape[-1]
    if s % block:
        raise ValueError(f"sequence length {s} is not a multiple of the tile size {block}")
    shape = seg.shape[:-1] + (s // block, block)
    seg = seg.reshape(shape)
    pos = pos.reshape(shape)
    valid = seg != 0
    big, small = jnp.int32(_I32.max), jnp.int32(_I32.min)
    return TileStats(jnp.min(jnp.where(valid, seg, big), -1), jnp.max(jnp.where(valid, seg, small), -1),
                     jnp.min(jnp.where(valid, pos, big), -1), jnp.max(jnp.where(valid, pos, small), -1),
                     jnp.all(valid, -1))


def classify(q: TileStats, kv: TileStats, *, causal: bool = False, window=(UNBOUNDED, UNBOUNDED)):
    """int8 EMPTY / PARTIAL / FULL for every (q tile, kv tile): [..., nq, nk] from [..., nq] and [..., nk].

    Conservative, from the ranges alone. "Possible" (not EMPTY): the valid segment ranges overlap and
    each position bound of the rule holds for some pair of the ranges. FULL: both tiles are free of
    padding and lie in one and the same segment, and each position bound holds for every pair.
    """
    left, right = window
    qsmin, qsmax, qpmin, qpmax, qall = (x[..., :, None] for x in q)
    ksmin, ksmax, kpmin, kpmax, kall = (x[..., None, :] for x in kv)
    possible = (ksmin <= qsmax) & (qsmin <= ksmax)  # false for a tile without valid tokens (sentinels)
    full = qall & kall & (qsmin == qsmax) & (ksmin == ksmax) & (qsmin == ksmin)
    if causal:
        possible &= kpmin <= qpmax
        full &= kpmax <= qpmin
    if left >= 0:
        possible &= kpmax >= qpmin - left
        full &= kpmin >= qpmax - left
    if right >= 0:
        possible &= kpmin <= qpmax + right
        full &= kpmax <= qpmin + right
    full &= possible
    return jnp.where(full, jnp.int8(FULL), jnp.where(possible, jnp.int8(PARTIAL), jnp.int8(EMPTY)))


# --------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------
def segment_positions(seg, *, bottom_right: bool = False):
    """Positions [..., S] int32 within each run of equal segment ids in `seg` [..., S].

    Top-left: index - run start (0, 1, ... from each run's first token). Bottom-right: index - run end
    (..., -2, -1 up to each run's last token), so that the last query of a segment lines up with its
    last key whatever the two lengths are.
    """
    seg = jnp.asarray(seg)
    s = seg.shape[-1]
    idx = jnp.arange(s, dtype=jnp.int32)
    change = seg[..., 1:] != seg[..., :-1]
    edge = jnp.ones_like(seg[..., :1], bool)
    if bottom_right:
        run_end = jnp.concatenate([change, edge], axis=-1)
        end = jax.lax.cummin(jnp.where(run_end, idx + 1, s), axis=seg.ndim - 1, reverse=True)
        return (idx - end).astype(jnp.int32)
    new_run = jnp.concatenate([edge, change], axis=-1)
    start = jax.lax.cummax(jnp.where(new_run, idx, 0), axis=seg.ndim - 1)
    return (idx - start).astype(jnp.int32)


def _iota(batch: int, length: int, shift: int = 0):
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) - shift, (batch, length))


# --------------------------------------------------------------------------------------
# The mask value
# --------------------------------------------------------------------------------------
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_segment_ids", "q_positions", "kv_segment_ids", "kv_positions"],
                   meta_fields=["causal", "window"])
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query sees: see the module docstring for the rule.

    Data (pytree leaves, traced under jit): q_segment_ids, q_positions [B, Sq] and kv_segment_ids,
    kv_positions [B, Skv], int32; segment id 0 is padding. Static (part of the pytree structure, so
    of jit's cache key): causal (bool) and window ((left, right) ints, -1 unbounded).
    """

    q_segment_ids: jax.Array
    q_positions: jax.Array
    kv_segment_ids: jax.Array
    kv_positions: jax.Array
    causal: bool = False
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)

    def __post_init__(self):
        object.__setattr__(self, "causal", bool(self.causal))
        object.__setattr__(self, "window", check_window(self.window))

    # ---- constructors
    @classmethod
    def full(cls, batch: int, q_len: int, kv_len: int, *, causal: bool = False,
             window=(UNBOUNDED, UNBOUNDED), bottom_right: bool = False) -> "AttentionMask":
        """No padding: one segment, positions 0..S-1 (top-left) or -S..-1 (bottom-right alignment)."""
        return cls(jnp.ones((batch, q_len), jnp.int32), _iota(batch, q_len, q_len if bottom_right else 0),
                   jnp.ones((batch, kv_len), jnp.int32), _iota(batch, kv_len, kv_len if bottom_right else 0),
                   causal=causal, window=window)

    @classmethod
    def from_segments(cls, q_segment_ids, kv_segment_ids=None, *, causal: bool = False,
                      window=(UNBOUNDED, UNBOUNDED), bottom_right: bool = False) -> "AttentionMask":
        """Segment ids [B, S] (0 = padding; kv defaults to q's), positions counted within each run of
        equal ids (`segment_positions`): packed sequences, padding, and their causal forms."""
        q_seg = jnp.asarray(q_segment_ids, jnp.int32)
        kv_seg = q_seg if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
        return cls(q_seg, segment_positions(q_seg, bottom_right=bottom_right),
                   kv_seg, segment_positions(kv_seg, bottom_right=bottom_right), causal=causal, window=window)

    def replace(self, **changes) -> "AttentionMask":
        return dataclasses.replace(self, **changes)

    # ---- shapes
    @property
    def batch(self) -> int:
        return self.q_segment_ids.shape[0]

    @property
    def q_len(self) -> int:
        return self.q_segment_ids.shape[1]

    @property
    def kv_len(self) -> int:
        return self.kv_segment_ids.shape[1]

    def pad(self, q_len: int, kv_len: int) -> "AttentionMask":
        """The mask with padding tokens (segment 0, position 0) appended up to q_len / kv_len; arrays
        already that long are returned as they are (int32)."""
        def grow(x, n):
            x = x.astype(jnp.int32)
            return x if x.shape[1] == n else jnp.pad(x, ((0, 0), (0, n - x.shape[1])))

        return dataclasses.replace(self, q_segment_ids=grow(self.q_segment_ids, q_len),
                                   q_positions=grow(self.q_positions, q_len),
                                   kv_segment_ids=grow(self.kv_segment_ids, kv_len),
                                   kv_positions=grow(self.kv_positions, kv_len))

    # ---- the rule
    def dense(self):
        """bool [B, Sq, Skv]: key j is visible to query i."""
        return visible(self.q_segment_ids[:, :, None], self.q_positions[:, :, None],
                       self.kv_segment_ids[:, None, :], self.kv_positions[:, None, :],
                       causal=self.causal, window=self.window)

    def block_classes(self, block_q: int, block_kv: int):
        """int8 [B, ceil(Sq / block_q), ceil(Skv / block_kv)]: EMPTY, PARTIAL or FULL per (q tile, kv tile)
        (`classify`); a sequence that is not a multiple of its tile is padded with segment 0 first."""
        m = self.pad(-(-self.q_len // block_q) * block_q, -(-self.kv_len // block_kv) * block_kv)
        return classify(tile_stats(m.q_segment_ids, m.q_positions, block_q),
                        tile_stats(m.kv_segment_ids, m.kv_positions, block_kv),
                        causal=self.causal, window=self.window)


def loop_bounds(classes):
    """Reduce the last axis of int8 block classes (`AttentionMask.block_classes`) to int32
    [..., 4] = (lo, flo, fhi, hi): blocks outside [lo, hi) are empty, [flo, fhi) is a run of full blocks,
    the rest of [lo, hi) needs the element mask (the kernels' loop bounds)."""
    possible, full = classes != EMPTY, classes == FULL
    n = classes.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    hi = jnp.max(jnp.where(possible, idx + 1, 0), axis=-1)
    lo = jnp.minimum(jnp.min(jnp.where(possible, idx, n), axis=-1), hi)
    flo = jnp.min(jnp.where(full, idx, n), axis=-1)
    fhi = jnp.min(jnp.where(~full & (idx > flo[..., None]), idx, n), axis=-1)
    none_full = flo >= n
    flo = jnp.where(none_full, hi, flo)
    fhi = jnp.where(none_full, hi, jnp.minimum(fhi, hi))
    return jnp.stack([lo, flo, fhi, hi], axis=-1).astype(jnp.int32)


__all__ = ["AttentionMask", "EMPTY", "FULL", "PARTIAL", "TileStats", "UNBOUNDED", "check_window", "classify",
           "loop_bounds", "segment_positions", "tile_stats", "visible"]
