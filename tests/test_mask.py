"""pallas_kernels.mask: the visibility rule, the block classification and the AttentionMask value.

The rule is checked against a plain Python loop written here from the documented rule; the block
classes against the dense mask of fresh random masks (EMPTY tiles hold no visible pair, FULL tiles
only visible pairs), which is what lets the kernels skip and unmask tiles.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mask import (
    EMPTY,
    FULL,
    PARTIAL,
    AttentionMask,
    check_window,
    classify,
    segment_positions,
    tile_stats,
    visible,
)

# Jitted once per shape and static setting: eager op-by-op dispatch would dominate the run time.
_positions = jax.jit(segment_positions, static_argnames="bottom_right")


_classes = jax.jit(lambda m, bq, bk: m.block_classes(bq, bk), static_argnums=(1, 2))


def classes_of(m, bq, bk):
    return np.asarray(_classes(m, bq, bk))


RULES = [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1)), (True, (0, 0)), (False, (2, 1)),
         (False, (-1, 0)), (False, (0, -1)), (True, (7, 0))]
# Every bound of the rule alone and combined (each static setting costs the block test a compile).
BLOCK_RULES = [(False, (-1, -1)), (True, (3, -1)), (False, (2, 1)), (False, (-1, 0)), (True, (0, 0))]


# ----------------------------------------------------------------------------- plain references
def loop_visible(qs, qp, ks, kp, causal, window):
    """The documented rule, one (query, key) pair at a time."""
    left, right = window
    B, Sq = qs.shape
    Skv = ks.shape[1]
    out = np.zeros((B, Sq, Skv), bool)
    for b in range(B):
        for i in range(Sq):
            for j in range(Skv):
                ok = qs[b, i] == ks[b, j] and qs[b, i] != 0
                if causal:
                    ok = ok and kp[b, j] <= qp[b, i]
                if left >= 0:
                    ok = ok and kp[b, j] >= qp[b, i] - left
                if right >= 0:
                    ok = ok and kp[b, j] <= qp[b, i] + right
                out[b, i, j] = ok
    return out


def loop_positions(seg, bottom_right):
    """Index within each run of equal ids (from its start), or index - run end (bottom-right)."""
    out = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        row = list(seg[b])
        start = 0
        for i in range(len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                for t in range(start, i):
                    out[b, t] = t - i if bottom_right else t - start
                start = i
    return out


def random_rows(rng, batch, s, packed=True):
    """Segment ids [batch, s]: sorted runs with trailing padding (packed), or unsorted ids with 0s."""
    if packed:
        seg = np.sort(rng.integers(1, 4, (batch, s)), axis=1)
        lens = rng.integers(0, s + 1, batch)
        seg[np.arange(s)[None] >= lens[:, None]] = 0
        return seg.astype(np.int32)
    return rng.integers(0, 3, (batch, s)).astype(np.int32)


def random_mask(rng, batch, sq, skv, causal, window):
    """A batch of random masks mixing the kinds: packed / padded (top-left or bottom-right positions),
    no padding, unsorted ids with arbitrary positions."""
    kind = rng.integers(3)
    if kind == 0:
        qs, ks = random_rows(rng, batch, sq), random_rows(rng, batch, skv)
        br = bool(rng.integers(2))
        qp, kp = (np.asarray(_positions(x, bottom_right=br)) for x in (qs, ks))
    elif kind == 1:
        qs, ks = np.ones((batch, sq), np.int32), np.ones((batch, skv), np.int32)
        qp = np.broadcast_to(np.arange(sq) + rng.integers(-skv, skv, (batch, 1)), (batch, sq))
        kp = np.broadcast_to(np.arange(skv), (batch, skv))
    else:
        qs, ks = random_rows(rng, batch, sq, packed=False), random_rows(rng, batch, skv, packed=False)
        qp, kp = rng.integers(-12, 12, (batch, sq)), rng.integers(-12, 12, (batch, skv))
    arrays = (np.asarray(x, np.int32) for x in (qs, qp, ks, kp))
    return AttentionMask(*(jnp.asarray(x) for x in arrays), causal=causal, window=window)


def np_arrays(m):
    return tuple(np.asarray(x) for x in (m.q_segment_ids, m.q_positions, m.kv_segment_ids, m.kv_positions))


# ----------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("causal,window", RULES)
def test_visible_matches_the_loop(causal, window):
    rng = np.random.default_rng(hash((causal, window)) % 2 ** 32)
    for _ in range(4):
        m = random_mask(rng, 3, 7, 9, causal, window)
        want = loop_visible(*np_arrays(m), causal, window)
        np.testing.assert_array_equal(np.asarray(m.dense()), want)
        qs, qp, ks, kp = np_arrays(m)
        # A kernel tile and its transpose ([bk, 1] x [1, bq]) are the same rule.
        tile = visible(qs[0][:, None], qp[0][:, None], ks[0][None, :], kp[0][None, :], causal=causal, window=window)
        tile_t = visible(qs[0][None, :], qp[0][None, :], ks[0][:, None], kp[0][:, None], causal=causal,
                         window=window)
        np.testing.assert_array_equal(np.asarray(tile), want[0])
        np.testing.assert_array_equal(np.asarray(tile_t), want[0].T)


def test_segment_positions_match_the_loop():
    rng = np.random.default_rng(1)
    seg = np.concatenate([random_rows(rng, 4, 13), random_rows(rng, 4, 13, packed=False)])
    for br in (False, True):
        np.testing.assert_array_equal(np.asarray(segment_positions(seg, bottom_right=br)), loop_positions(seg, br))


def test_constructors_bottom_right_and_padding():
    # No padding, causal bottom-right: the last query lines up with the last key.
    m = AttentionMask.full(2, 3, 5, causal=True, bottom_right=True)
    np.testing.assert_array_equal(np.asarray(m.dense()), np.broadcast_to(np.tril(np.ones((3, 5), bool), k=2),
                                                                         (2, 3, 5)))
    top = AttentionMask.full(1, 3, 5, causal=True)
    np.testing.assert_array_equal(np.asarray(top.dense())[0], np.tril(np.ones((3, 5), bool)))
    # Padded rows (segment 0) see nothing and are seen by nobody; bottom-right counts from each segment's end.
    q_seg = jnp.array([[1, 1, 0]], jnp.int32)
    kv_seg = jnp.array([[1, 1, 1, 0]], jnp.int32)
    m = AttentionMask.from_segments(q_seg, kv_seg, causal=True, bottom_right=True)
    np.testing.assert_array_equal(np.asarray(m.dense())[0], [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(m.dense()), loop_visible(*np_arrays(m), True, (-1, -1)))
    # kv defaults to q's segments.
    m = AttentionMask.from_segments(jnp.array([[1, 1, 2, 2]]), causal=True)
    np.testing.assert_array_equal(np.asarray(m.dense())[0], [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])


def test_window_is_checked():
    assert check_window([3, -1]) == (3, -1)
    assert AttentionMask.full(1, 2, 2, window=(np.int64(2), 0)).window == (2, 0)
    for bad in ((-2, 0), (1,), "ab", None):
        with pytest.raises(ValueError, match="window"):
            AttentionMask.full(1, 2, 2, window=bad)


# ----------------------------------------------------------------------------- block classes
def tiles(dense, bq, bk):
    """[B, nq, nk, bq*bk] of the dense mask padded (with False) to whole tiles."""
    B, sq, skv = dense.shape
    nq, nk = -(-sq // bq), -(-skv // bk)
    pad = np.zeros((B, nq * bq, nk * bk), bool)
    pad[:, :sq, :skv] = dense
    return pad.reshape(B, nq, bq, nk, bk).transpose(0, 1, 3, 2, 4).reshape(B, nq, nk, bq * bk)


def test_block_classes_are_sound_on_random_masks():
    """EMPTY: no visible pair; FULL: every pair visible, and (the converse) a tile whose pairs are all visible
    is FULL. Many random rows per call (the batch axis), every rule, block sizes from 1 to whole sequences."""
    rng = np.random.default_rng(2026)
    sq, skv = 24, 40
    blocks = [(1, 1), (4, 8), (3, 5), (16, 16), (sq, skv)]
    run = jax.jit(lambda m: (m.dense(), [m.block_classes(bq, bk) for bq, bk in blocks]))  # a trace per rule
    seen = {EMPTY: 0, PARTIAL: 0, FULL: 0}
    for (causal, window), _ in itertools.product(BLOCK_RULES, range(4)):
        m = random_mask(rng, 48, sq, skv, causal, window)
        dense, all_classes = run(m)
        for (bq, bk), cls in zip(blocks, all_classes):
            cls = np.asarray(cls)
            assert cls.dtype == np.int8 and cls.shape == (48, -(-sq // bq), -(-skv // bk))
            t = tiles(np.asarray(dense), bq, bk)
            assert not t[cls == EMPTY].any(), ("EMPTY tile with a visible pair", causal, window, bq, bk)
            assert t[cls == FULL].all(), ("FULL tile with a hidden pair", causal, window, bq, bk)
            np.testing.assert_array_equal(cls == FULL, t.all(-1))
            assert set(np.unique(cls)) <= {EMPTY, PARTIAL, FULL}
            for c in seen:
                seen[c] += int((cls == c).sum())
    assert all(n > 100 for n in seen.values()), seen  # the random masks exercise every class


def test_block_classes_are_useful():
    """Plain causal: strictly upper tiles EMPTY, strictly lower FULL, diagonal PARTIAL. No mask: all FULL.
    Padding tiles EMPTY. A sliding window: tiles out of its reach EMPTY."""
    n = 8
    causal = classes_of(AttentionMask.full(2, 16 * n, 16 * n, causal=True), 16, 16)
    want = np.where(np.tri(n, k=-1, dtype=bool), FULL, np.where(np.eye(n, dtype=bool), PARTIAL, EMPTY))
    np.testing.assert_array_equal(causal, np.broadcast_to(want, (2, n, n)))
    assert np.all(classes_of(AttentionMask.full(1, 40, 24), 8, 8) == FULL)
    seg = jnp.ones((1, 64), jnp.int32).at[:, 48:].set(0)
    pad = classes_of(AttentionMask.from_segments(seg), 16, 16)[0]
    np.testing.assert_array_equal(pad[3:], EMPTY)
    np.testing.assert_array_equal(pad[:, 3:], EMPTY)
    np.testing.assert_array_equal(pad[:3, :3], FULL)
    win = classes_of(AttentionMask.full(1, 128, 128, causal=True, window=(15, -1)), 16, 16)[0]
    i, j = np.indices(win.shape)
    np.testing.assert_array_equal(win[(j > i) | (j < i - 1)], EMPTY)
    assert np.all(win[(j == i) | (j == i - 1)] == PARTIAL)


def test_whole_block_classification_for_ring_steps():
    """One tile per local chunk (context parallelism): classify on per-chunk stats is the same function."""
    rng = np.random.default_rng(3)
    for causal, window in (RULES[1], RULES[2], RULES[4]):
        m = random_mask(rng, 16, 12, 20, causal, window)
        qs, qp, ks, kp = m.q_segment_ids, m.q_positions, m.kv_segment_ids, m.kv_positions
        whole = classify(tile_stats(qs, qp, 12), tile_stats(ks, kp, 20), causal=causal, window=window)
        np.testing.assert_array_equal(np.asarray(whole), classes_of(m, 12, 20))
        dense = np.asarray(m.dense())
        assert not dense[np.asarray(whole)[:, 0, 0] == EMPTY].any()
    with pytest.raises(ValueError, match="multiple of the tile size"):
        tile_stats(qs, qp, 5)


# ----------------------------------------------------------------------------- the pytree value
def test_pytree_round_trip_under_jit():
    m = AttentionMask.full(2, 8, 8, causal=False, window=(3, -1))
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 4 and all(x.dtype == jnp.int32 for x in leaves)
    assert jax.tree_util.tree_unflatten(treedef, leaves) == m
    traces = []

    @jax.jit
    def f(mask):
        traces.append(mask.causal)
        return mask.dense(), mask

    dense, back = f(m)
    assert isinstance(back, AttentionMask) and (back.causal, back.window) == (False, (3, -1))
    np.testing.assert_array_equal(np.asarray(back.q_positions), np.asarray(m.q_positions))
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(m.dense()))
    # New data, same static fields: no retrace. A static field changed: a new trace and another mask.
    f(m.replace(q_positions=m.q_positions + 1))
    assert traces == [False]
    dense_c, back_c = f(m.replace(causal=True))
    assert traces == [False, True] and back_c.causal
    np.testing.assert_array_equal(np.asarray(dense_c), np.asarray(dense) & np.tril(np.ones((8, 8), bool)))
    f(m.replace(window=(2, -1)))
    assert len(traces) == 3


# ----------------------------------------------------------------------------- a new mask kind at the front door
def test_backends_that_list_mask_kinds_refuse_a_new_one():
    """CONTRIBUTING's "Adding a mask kind": a kind added to te_jax/masks.py is refused by name where a backend
    serves only some kinds (cudnn, the Hopper kernel), instead of being run as the causal mask its name suggests."""
    import dataclasses

    from te_jax import masks
    from te_jax.attention import prepare_attention
    from te_jax.backends.selection import BACKENDS

    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
    call = prepare_attention(q, q, q, attn_mask_type="causal").call
    gpu = dataclasses.replace(call, platform="gpu", compute_capability=(9, 0))
    assert BACKENDS["cudnn"].unsupported_reason(gpu) is None  # the known kind is served
    new = dataclasses.replace(gpu, mask=masks.MaskSpec("chunked_causal"))
    assert new.mask.causal  # what a name-based check would have believed
    assert "chunked_causal" in BACKENDS["cudnn"].unsupported_reason(new)
    assert "chunked_causal" in BACKENDS["pallas"].hopper_reason(new)


def test_packed_lengths_become_segment_ids_without_a_loop():
    """thd lengths -> segment ids (te_jax.masks): equal to numpy's searchsorted on random lengths (empty documents,
    a sum short of the tensor, one document filling it), and the traced function holds no loop (which XLA may keep as
    a while loop on a GPU: launches and a host check per step)."""
    from jaxpr_walk import walk
    from te_jax.masks import _seqlens_to_packed_segments

    rng = np.random.default_rng(0)
    cases = [np.array([300, 1, 723]), np.array([0, 5, 0, 7, 0]), np.array([64]), rng.integers(0, 40, size=9),
             np.array([0])]
    for lens in cases:
        total = int(lens.sum()) + int(rng.integers(0, 5))
        total = max(total, 1)
        got = np.asarray(jax.jit(_seqlens_to_packed_segments, static_argnums=1)(jnp.asarray(lens, jnp.int32), total))
        ends = np.cumsum(lens)
        idx = np.arange(total)
        want = np.where(idx < ends[-1], np.searchsorted(ends, idx, side="right") + 1, 0)
        np.testing.assert_array_equal(got, want, err_msg=str(lens))
    jaxpr = jax.make_jaxpr(_seqlens_to_packed_segments, static_argnums=1)(jnp.ones((4,), jnp.int32), 16)
    assert not {e.primitive.name for e in walk(jaxpr.jaxpr)} & {"scan", "while"}, jaxpr
