"""Document-aligned forward tiles (pallas_kernels/flash_attention_hopper/aligned_tiles.py), on the CPU: the tables
against the dense mask through a numpy model of what the forward kernel computes with them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention_hopper import aligned_tiles, data_mask
from pallas_kernels.flash_attention_hopper.config import default_config
from pallas_kernels.flash_attention_hopper.data_mask import NO_SEGMENT, mask_rule
from pallas_kernels.mask import AttentionMask


def _runs(lens, total):
    ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lens)] or [np.zeros(0, np.int32)])
    return np.pad(ids, (0, total - ids.size))


def _kernel_model(a, rule, q_tile, kv_tile, q_len, kv_len, transposed=False):
    """(seen [B, Sq, Skv] int, stored [B, S] int) of a kernel walking the aligned tables a (AlignedTiles): how many
    times each (query, key) pair is added to the tile row that is that token's (out_index; every pair of a full
    block, the pairs its group's element mask keeps on the padded layout's marks of a partial one), and how many
    tile rows that are the token's own reach its place in the output by the tiles' store plans.  Every other row
    reaching it must be one that sees nothing (its output 0) and come through a shared group (a sum).  The tiles
    are query tiles walking key blocks (the forward, dQ), or transposed key tiles walking query blocks (dK/dV)."""
    a = jax.tree_util.tree_map(np.asarray, a)
    g = aligned_tiles.ROW_ALIGN
    (tile, block), (length, other) = ((kv_tile, q_tile), (kv_len, q_len)) if transposed else (
        (q_tile, kv_tile), (q_len, kv_len))
    tile_marks, block_marks = (a.km, a.qm) if transposed else (a.qm, a.km)
    unseen = 0 if transposed else NO_SEGMENT  # what a row of the tiles that is no token's holds
    rules = rule.partial_rules()
    B, T = a.tile_rows.shape
    seen = np.zeros((B, q_len, kv_len), np.int32)
    stored = np.zeros((B, length), np.int32)
    for b in range(B):
        own_row = a.out_index[b]  # each token's row in the padded layout: tile * size + row
        for t in range(T):
            lo, hi, *shared = a.stores[b, t]
            if a.tile_rows[b, t] < 0:  # its CTA exits: it must hold no token
                assert hi <= lo and shared == [-1, -1] and not np.isin(own_row // tile, t).any()
                continue
            marks = tile_marks[b, :, t * tile:(t + 1) * tile]
            tokens = a.tile_rows[b, t] * g + np.arange(tile)
            mine = (tokens < length) & (own_row[np.minimum(tokens, length - 1)] == t * tile + np.arange(tile))
            for r in range(tile):  # the rows this tile stores
                whole, in_shared = lo <= r // g < hi, r // g in shared
                if not (whole or in_shared):
                    continue
                assert tokens[r] < length, "a stored row past the end"
                if mine[r]:
                    stored[b, tokens[r]] += 1
                else:  # another run's row in a shared group: it sees nothing, so it adds 0
                    assert in_shared and not whole and marks[0, r] == unseen, (t, r)
            ends = a.counts[b, t]
            group = 0
            for step in range(ends[-1]):
                while group < len(rules) and step >= ends[group]:
                    group += 1
                blk = a.blocks[b, t, step]
                other_marks = block_marks[b, :, blk * block:(blk + 1) * block]
                others = a.block_rows[b, t, step] * g + np.arange(block)
                q_marks, k_marks = (other_marks, marks) if transposed else (marks, other_marks)
                if group < len(rules):  # partial: the group's element mask on the padded marks
                    keep = np.asarray(rules[group].apply(jnp.ones((tile, block)), (q_marks[0], q_marks[1]),
                                                         (k_marks[0], k_marks[1]), 0.0,
                                                         q_axis=1 if transposed else 0)) > 0
                else:
                    keep = np.ones((tile, block), bool)
                assert not (keep & ~mine[:, None]).any(), "a row that is not the tile's sees something"
                assert others[keep.any(0)].max(initial=-1) < other, "a counted pair past the end"
                for i, j in zip(*np.nonzero(keep)):
                    qi, kj = (others[j], tokens[i]) if transposed else (tokens[i], others[j])
                    seen[b, qi, kj] += 1
    return seen, stored


CASES = {
    "thd documents, causal": lambda: AttentionMask.from_segments(_runs([300, 131, 250, 89, 200], 1024)[None],
                                                                causal=True),
    "tiny documents sharing 8-row groups": lambda: AttentionMask.from_segments(
        _runs([3, 5, 1, 200, 250], 512)[None], causal=True),
    "documents, non-causal, padding": lambda: AttentionMask.from_segments(
        np.stack([_runs([200, 300, 100], 768), _runs([700], 768)])),
    "documents, window": lambda: AttentionMask.from_segments(_runs([140, 500, 128], 768)[None], causal=True,
                                                             window=(100, 0)),
    "cross: other key documents": lambda: AttentionMask.from_segments(
        _runs([60, 200, 120], 512)[None], _runs([300, 100, 250], 768)[None]),
    "documents, bottom-right": lambda: AttentionMask.from_segments(_runs([333, 64, 500], 1024)[None], causal=True,
                                                                  bottom_right=True),
    "load-balanced context-parallel shard": lambda: _zigzag_shard(),
    "one id in two runs": lambda: AttentionMask.from_segments(
        np.concatenate([np.full(100, 1), np.full(50, 2), np.full(80, 1), np.zeros(26)]).astype(np.int32)[None],
        causal=True),
}


def _zigzag_shard():
    """One rank's queries under load-balanced context parallelism (chunks 1 and 6 of 8, positions within their
    documents, documents starting mid-chunk) against the whole sequence's keys (all-gather), causal."""
    from pallas_kernels.mask import segment_positions

    seg = jnp.asarray(_runs([300, 131, 250, 129, 160, 54], 1024)[None])
    pos = segment_positions(seg)
    rows = np.concatenate([np.arange(128, 256), np.arange(768, 896)])
    return AttentionMask(seg[:, rows], pos[:, rows], seg, pos, causal=True)


@pytest.mark.parametrize("name", list(CASES))
def test_aligned_tables_compute_every_visible_pair_once(name):
    """aligned_tables (through aligned_mask_tables) against the dense mask: in the kernel model every query's own
    row reaches the output exactly once (whole groups in place, shared groups as a sum with zero rows), every
    visible pair is added to it once and no other pair; lse's gather index points at the same rows."""
    m = CASES[name]()
    cfg = dataclasses.replace(default_config(128, m.kv_len, False, m.q_len), block_q=64, block_kv=128)
    t = jax.jit(lambda m: aligned_tiles.aligned_mask_tables(m, cfg, backward=False))(m)
    assert t.fwd is None
    starts = np.asarray(t.aligned.tile_rows)[0] * aligned_tiles.ROW_ALIGN
    assert (starts[starts >= 0] % 128).any(), "the case's first row fell back to the global grid"
    seen, stored = _kernel_model(t.aligned, mask_rule(m), 2 * cfg.block_q, cfg.block_kv, m.q_len, m.kv_len)
    np.testing.assert_array_equal(stored, np.ones((m.batch, m.q_len), np.int32))
    np.testing.assert_array_equal(seen, np.asarray(m.dense()).astype(np.int32))
    # the stores and merge_shared_groups end to end: tile rows carry their token's number + 1 (0 where the row is
    # not the tile's own, as the kernel's rows that see no key), stored by plan into garbage-filled buffers
    a = jax.tree_util.tree_map(np.asarray, t.aligned)
    tq, g = 2 * cfg.block_q, aligned_tiles.ROW_ALIGN
    B, T = a.tile_rows.shape
    out = np.full((B, m.q_len, 1, 1), -7.0, np.float32)
    shared = np.full((B, T, 2, g, 1, 1), -7.0, np.float32)
    for b in range(B):
        for tile in np.nonzero(a.tile_rows[b] >= 0)[0]:
            tokens = a.tile_rows[b, tile] * g + np.arange(tq)
            mine = (tokens < m.q_len) & (a.out_index[b, np.minimum(tokens, m.q_len - 1)] == tile * tq + np.arange(tq))
            value = np.where(mine, tokens + 1.0, 0.0)
            lo, hi, *sh = a.stores[b, tile]
            for i in range(lo, hi):
                out[b, tokens[i * g:(i + 1) * g], 0, 0] = value[i * g:(i + 1) * g]
            for slot, i in enumerate(sh):
                if i >= 0:
                    shared[b, tile, slot, :, 0, 0] = value[i * g:(i + 1) * g]
    merged = aligned_tiles.merge_shared_groups(jnp.asarray(out), jnp.asarray(shared), t.aligned.tile_rows,
                                               t.aligned.stores)
    np.testing.assert_array_equal(np.asarray(merged)[:, :, 0, 0], np.arange(1, m.q_len + 1)[None].repeat(B, 0))
    rows = jnp.arange(t.aligned.qm.shape[-1], dtype=jnp.float32)
    lse = aligned_tiles.gather_row_values(jnp.broadcast_to(rows, (m.batch, 1, rows.size)), t.aligned.out_index)
    np.testing.assert_array_equal(np.asarray(lse)[:, 0], np.asarray(t.aligned.out_index))


def test_aligned_tiles_start_at_documents_and_fall_back_past_the_bound():
    """run_tiles: tiles start at every document and every `tile` tokens within it; a row with more documents than
    aligned_tile_count leaves room for keeps the global grid; the aligned tables then match the grid's pairs."""
    seg = jnp.asarray(np.stack([_runs([100, 200, 28], 384), _runs([1] * 20, 384)]))
    n_max = aligned_tiles.aligned_tile_count(384, 128)
    assert n_max == 3 + 4
    starts, index, rows = aligned_tiles.run_tiles(seg, 128, n_max)
    n_tiles = (rows[..., 1] > rows[..., 0]).sum(-1)
    # the second document's first tile starts at 96 (100 rounded down to 8 rows), its second at 96 + 128; the
    # third document's at 296 (300 rounded down), the padding run's at 328
    np.testing.assert_array_equal(np.asarray(starts[0, :5]), [0, 96, 224, 296, 328])
    assert int(n_tiles[0]) == 5
    np.testing.assert_array_equal(np.asarray(starts[1, :3]), [0, 128, 256])  # 21 runs > 7 tiles: the grid
    np.testing.assert_array_equal(np.asarray(index[1]), np.arange(384))
    assert int(n_tiles[1]) == 3
    with pytest.raises(ValueError, match="cannot hold"):
        aligned_tiles.run_tiles(seg, 128, 2)
    m = AttentionMask.from_segments(np.asarray(seg), causal=True)
    cfg = dataclasses.replace(default_config(128, 384, False, 384), block_q=64, block_kv=128)
    t = jax.jit(lambda m: aligned_tiles.aligned_mask_tables(m, cfg, backward=False))(m)
    seen, stored = _kernel_model(t.aligned, mask_rule(m), 2 * cfg.block_q, cfg.block_kv, 384, 384)
    np.testing.assert_array_equal(seen, np.asarray(m.dense()).astype(np.int32))
    np.testing.assert_array_equal(stored, np.ones((2, 384), np.int32))


@pytest.mark.parametrize("name", ["tiny documents sharing 8-row groups", "cross: other key documents",
                                  "documents, bottom-right", "load-balanced context-parallel shard"])
@pytest.mark.parametrize("transposed", [False, True], ids=["dQ tiles", "dK/dV tiles"])
def test_backward_geometries_compute_every_visible_pair_once(name, transposed):
    """aligned_tables for the backward kernels' tiles (dQ: 128-row query tiles walking 64-key blocks; dK/dV:
    128-key tiles walking 64-row query blocks, transposed) against the dense mask, as the forward's test: every
    token's own row stored once, every visible pair counted once."""
    m = CASES[name]()
    q_tile, kv_tile = (64, 128) if transposed else (128, 64)
    a = jax.jit(lambda m: aligned_tiles.aligned_tables(
        (m.q_segment_ids, m.q_positions, m.kv_segment_ids, m.kv_positions), mask_rule(m), q_tile, kv_tile,
        transposed=transposed))(m)
    seen, stored = _kernel_model(a, mask_rule(m), q_tile, kv_tile, m.q_len, m.kv_len, transposed)
    np.testing.assert_array_equal(stored, np.ones((m.batch, m.kv_len if transposed else m.q_len), np.int32))
    np.testing.assert_array_equal(seen, np.asarray(m.dense()).astype(np.int32))


@pytest.mark.parametrize("name,H", [("thd documents, causal", 2), ("tiny documents sharing 8-row groups", 6)])
def test_triton_merge_matches_the_xla_merge(name, H):
    """aligned_merge's kernel (interpreted) against merge_shared_groups' XLA scatters on the tables' store plans:
    random copies in every shared slot (so a group that sums the wrong slots, or misses a slot between unused
    ones, differs), random values elsewhere in out kept as they are.  H 6: programs of 2 heads each."""
    m = CASES[name]()
    cfg = dataclasses.replace(default_config(128, m.kv_len, False, m.q_len), block_q=64, block_kv=128)
    a = jax.jit(lambda m: aligned_tiles.aligned_mask_tables(m, cfg, backward=False))(m).aligned
    B, T = a.tile_rows.shape
    Dv = 16
    k1, k2 = jax.random.split(jax.random.key(3))
    out = jax.random.normal(k1, (B, m.q_len, H, Dv), jnp.float32)
    shared = jax.random.normal(k2, (B, T, 2, aligned_tiles.ROW_ALIGN, H, Dv), jnp.float32)
    assert int((np.asarray(a.stores)[..., 2:] >= 0).sum()) >= 3  # the case has shared groups
    want = aligned_tiles.merge_shared_groups(out, shared, a.tile_rows, a.stores, kernel=False)
    got = aligned_tiles.merge_shared_groups(out, shared, a.tile_rows, a.stores, kernel=True, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(want), np.asarray(out))  # the merge changed something
    # two arrays on the same tiles in one launch (the dK/dV kernel's dK and dV), each its own head_dim
    out2 = jax.random.normal(k1, (B, m.q_len, H, 2 * Dv), jnp.float32) + 3.0
    shared2 = jax.random.normal(k2, (B, T, 2, aligned_tiles.ROW_ALIGN, H, 2 * Dv), jnp.float32) - 3.0
    got1, got2 = aligned_tiles.merge_shared_groups((out, out2), (shared, shared2), a.tile_rows, a.stores,
                                                   kernel=True, interpret=True)
    want2 = aligned_tiles.merge_shared_groups(out2, shared2, a.tile_rows, a.stores, kernel=False)
    np.testing.assert_allclose(np.asarray(got1), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got2), np.asarray(want2), rtol=1e-6, atol=1e-6)


def test_triton_merge_lowers_for_cuda():
    """The merge kernel's Triton lowering for CUDA (on any machine: the GPU check runs it for real)."""
    from pallas_kernels.flash_attention_hopper import aligned_merge

    for H, Dv in ((4, 128), (16, 128), (18, 256)):  # head blocks of 4, 16 (8 warps) and 2
        out = jax.ShapeDtypeStruct((1, 1024, H, Dv), jnp.bfloat16)
        shared = jax.ShapeDtypeStruct((1, 26, aligned_tiles.ROW_ALIGN, H, Dv), jnp.bfloat16)
        first = jax.ShapeDtypeStruct((1, 26), jnp.int32)
        f = jax.jit(lambda o, s, i: aligned_merge.merge_shared(o, s, i, interpret=False))
        assert "triton" in f.trace(out, shared, first).lower(lowering_platforms=("cuda",)).as_text().lower()
    g = aligned_tiles.ROW_ALIGN
    assert [aligned_merge.head_block(h, g, dims) for h, dims in (
        (16, [128]), (16, [256]), (16, [128, 256]), (18, [128]), (12, [64]), (1, [512]), (32, [128]))] == [
        16, 8, 8, 2, 4, 1, 16]
    with pytest.raises(ValueError, match="power of two"):
        aligned_merge.merge_shared(jnp.zeros((1, 16, 1, 96)), jnp.zeros((1, 2, 8, 1, 96)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"shared \(1, 2, 8, 2, 64\).*expected shared \[B, n, G, H, Dv\]"):
        aligned_merge.merge_shared(jnp.zeros((1, 16, 1, 64)), jnp.zeros((1, 2, 8, 2, 64)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="1 outputs and 2 side buffers"):
        aligned_merge.merge_shared_many((jnp.zeros((1, 16, 1, 64)),), (jnp.zeros((1, 2, 8, 1, 64)),) * 2,
                                        jnp.zeros((1, 2), jnp.int32))


def test_shared_segment_ids_give_one_run_computation():
    """Queries and keys from one segment array (self-attention, as te_jax's front door builds them) at one tile
    size: the aligned tables compute their runs once (XLA merges the two identical computations), so the compiled
    tables hold one run_tiles' scatter, not two; other key ids keep their own."""
    seg = _runs([300, 131, 250, 89, 200], 1024)[None]
    cfg = dataclasses.replace(default_config(128, 1024, False, 1024), block_q=64, block_kv=128)

    def scatters(build):
        f = jax.jit(lambda s: aligned_tiles.aligned_mask_tables(build(s), cfg, backward=False).aligned)
        return f.lower(jnp.asarray(seg)).compile().as_text().count("scatter(")

    one = scatters(lambda s: AttentionMask.from_segments(s, causal=True))
    two = scatters(lambda s: AttentionMask.from_segments(s, s + (s > 0) * 100, causal=True))
    assert one == 1 and two == 2, (one, two)
    # the backward's aligned tables (dQ: 128-row query tiles on 64-key blocks; dK/dV: 64-row query blocks on
    # 128-key tiles) start from the forward's arrays: two tile sizes in all, so two runs' computations
    assert (data_mask.dq_tiles(cfg), data_mask.dkv_tiles(cfg)) == ((128, 64), (64, 128))

    def both_passes(s):
        m = AttentionMask.from_segments(s, causal=True)
        t = aligned_tiles.aligned_mask_tables(m, cfg, backward=False)
        return aligned_tiles.aligned_backward_tables(t, mask_rule(m), cfg)

    assert jax.jit(both_passes).lower(jnp.asarray(seg)).compile().as_text().count("scatter(") == 2


def test_aligned_backward_follows_the_forward():
    """HopperConfig.bwd_aligned: auto (None) runs the backward on aligned tiles whenever the forward's are, unless
    the atomic dQ is forced (the aligned dK/dV kernel has none); False keeps the grid's backward, True forces it."""
    from pallas_kernels.flash_attention_hopper.config import aligned_backward_chosen

    cfg = default_config(128, 1024, False, 1024)
    chosen = {(a, atomic): aligned_backward_chosen(dataclasses.replace(cfg, bwd_aligned=a, bwd_dq_atomic=atomic))
              for a in (None, False, True) for atomic in (None, False, True) if not (a and atomic)}
    assert chosen == {(None, None): True, (None, False): True, (None, True): False, (False, None): False,
                      (False, False): False, (False, True): False, (True, None): True, (True, False): True}
