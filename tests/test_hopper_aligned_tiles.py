"""Document-aligned forward tiles (pallas_kernels/flash_attention_hopper/aligned_tiles.py), on the CPU: the tables
against the dense mask through a numpy model of what the forward kernel computes with them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention_hopper import aligned_tiles
from pallas_kernels.flash_attention_hopper.config import default_config
from pallas_kernels.flash_attention_hopper.data_mask import NO_SEGMENT, mask_rule
from pallas_kernels.mask import AttentionMask


def _runs(lens, total):
    ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lens)] or [np.zeros(0, np.int32)])
    return np.pad(ids, (0, total - ids.size))


def _kernel_model(t, rule, cfg, q_len, kv_len):
    """(seen [B, Sq, Skv] int, stored [B, Sq] int) of the forward kernel walking the aligned tables: how many times
    each (query, key) pair is added to the tile row whose output is that query's (out_index; every pair of a full
    block, the pairs its group's element mask keeps on the padded layout's marks of a partial one), and how many
    tile rows that are the query's own reach its place in the output by the tiles' store plans.  Every other row
    reaching it must be one that sees no key (its output 0) and come through a shared group (a sum)."""
    a = jax.tree_util.tree_map(np.asarray, t.aligned)
    tq, bkv, g = 2 * cfg.block_q, cfg.block_kv, aligned_tiles.ROW_ALIGN
    rules = rule.partial_rules()
    B, T = a.q_rows.shape
    seen = np.zeros((B, q_len, kv_len), np.int32)
    stored = np.zeros((B, q_len), np.int32)
    for b in range(B):
        own_row = a.out_index[b]  # each query's row in the padded layout: tile * tq + row
        for tile in range(T):
            lo, hi, *shared = a.stores[b, tile]
            if a.q_rows[b, tile] < 0:  # its CTA exits: it must hold no token
                assert hi <= lo and shared == [-1, -1] and not np.isin(own_row // tq, tile).any()
                continue
            q_marks = a.qm[b, :, tile * tq:(tile + 1) * tq]
            q_tokens = a.q_rows[b, tile] * g + np.arange(tq)
            mine = (q_tokens < q_len) & (own_row[np.minimum(q_tokens, q_len - 1)] == tile * tq + np.arange(tq))
            for r in range(tq):  # the rows this tile stores
                whole, in_shared = lo <= r // g < hi, r // g in shared
                if not (whole or in_shared):
                    continue
                assert q_tokens[r] < q_len, "a stored row past the queries' end"
                if mine[r]:
                    stored[b, q_tokens[r]] += 1
                else:  # another run's row in a shared group: it sees no key, so it adds 0
                    assert in_shared and not whole and q_marks[0, r] == NO_SEGMENT, (tile, r)
            ends = a.counts[b, tile]
            group = 0
            for step in range(ends[-1]):
                while group < len(rules) and step >= ends[group]:
                    group += 1
                blk = a.blocks[b, tile, step]
                k_marks = a.km[b, :, blk * bkv:(blk + 1) * bkv]
                keys = a.kv_rows[b, tile, step] * g + np.arange(bkv)
                if group < len(rules):  # partial: the group's element mask on the padded marks
                    keep = np.asarray(rules[group].apply(jnp.ones((tq, bkv)), (q_marks[0], q_marks[1]),
                                                         (k_marks[0], k_marks[1]), 0.0, q_axis=0)) > 0
                else:
                    keep = np.ones((tq, bkv), bool)
                assert not (keep & ~mine[:, None]).any(), "a row that is not the tile's sees a key"
                assert keys[keep.any(0)].max(initial=-1) < kv_len, "a counted key past the keys' end"
                for i, j in zip(*np.nonzero(keep)):
                    seen[b, q_tokens[i], keys[j]] += 1
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
}


@pytest.mark.parametrize("name", list(CASES))
def test_aligned_tables_compute_every_visible_pair_once(name):
    """aligned_tables (through aligned_mask_tables) against the dense mask: in the kernel model every query's own
    row reaches the output exactly once (whole groups in place, shared groups as a sum with zero rows), every
    visible pair is added to it once and no other pair; lse's gather index points at the same rows."""
    m = CASES[name]()
    cfg = dataclasses.replace(default_config(128, m.kv_len, False, m.q_len), block_q=64, block_kv=128)
    t = jax.jit(lambda m: aligned_tiles.aligned_mask_tables(m, cfg, backward=False))(m)
    assert t.fwd is None
    starts = np.asarray(t.aligned.q_rows)[0] * aligned_tiles.ROW_ALIGN
    assert (starts[starts >= 0] % 128).any(), "the case's first row fell back to the global grid"
    seen, stored = _kernel_model(t, mask_rule(m), cfg, m.q_len, m.kv_len)
    np.testing.assert_array_equal(stored, np.ones((m.batch, m.q_len), np.int32))
    np.testing.assert_array_equal(seen, np.asarray(m.dense()).astype(np.int32))
    # the stores and merge_shared_groups end to end: tile rows carry their token's number + 1 (0 where the row is
    # not the tile's own, as the kernel's rows that see no key), stored by plan into garbage-filled buffers
    a = jax.tree_util.tree_map(np.asarray, t.aligned)
    tq, g = 2 * cfg.block_q, aligned_tiles.ROW_ALIGN
    B, T = a.q_rows.shape
    out = np.full((B, m.q_len, 1, 1), -7.0, np.float32)
    shared = np.full((B, T, 2, g, 1, 1), -7.0, np.float32)
    for b in range(B):
        for tile in np.nonzero(a.q_rows[b] >= 0)[0]:
            tokens = a.q_rows[b, tile] * g + np.arange(tq)
            mine = (tokens < m.q_len) & (a.out_index[b, np.minimum(tokens, m.q_len - 1)] == tile * tq + np.arange(tq))
            value = np.where(mine, tokens + 1.0, 0.0)
            lo, hi, *sh = a.stores[b, tile]
            for i in range(lo, hi):
                out[b, tokens[i * g:(i + 1) * g], 0, 0] = value[i * g:(i + 1) * g]
            for slot, i in enumerate(sh):
                if i >= 0:
                    shared[b, tile, slot, :, 0, 0] = value[i * g:(i + 1) * g]
    merged = aligned_tiles.merge_shared_groups(jnp.asarray(out), jnp.asarray(shared), t.aligned.q_rows,
                                               t.aligned.stores)
    np.testing.assert_array_equal(np.asarray(merged)[:, :, 0, 0], np.arange(1, m.q_len + 1)[None].repeat(B, 0))
    rows = jnp.arange(t.aligned.qm.shape[-1], dtype=jnp.float32)
    lse = aligned_tiles.gather_lse(jnp.broadcast_to(rows, (m.batch, 1, rows.size)), t.aligned.out_index)
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
    seen, stored = _kernel_model(t, mask_rule(m), cfg, 384, 384)
    np.testing.assert_array_equal(seen, np.asarray(m.dense()).astype(np.int32))
    np.testing.assert_array_equal(stored, np.ones((2, 384), np.int32))


@pytest.mark.parametrize("name", ["thd documents, causal", "tiny documents sharing 8-row groups"])
def test_triton_merge_matches_the_xla_merge(name):
    """aligned_merge's kernel (interpreted) against merge_shared_groups' XLA scatters on the tables' store plans:
    random copies in every shared slot (so a group that sums the wrong slots, or misses a slot between unused
    ones, differs), random values elsewhere in out kept as they are."""
    m = CASES[name]()
    cfg = dataclasses.replace(default_config(128, m.kv_len, False, m.q_len), block_q=64, block_kv=128)
    a = jax.jit(lambda m: aligned_tiles.aligned_mask_tables(m, cfg, backward=False))(m).aligned
    B, T = a.q_rows.shape
    H, Dv = 2, 16
    k1, k2 = jax.random.split(jax.random.key(3))
    out = jax.random.normal(k1, (B, m.q_len, H, Dv), jnp.float32)
    shared = jax.random.normal(k2, (B, T, 2, aligned_tiles.ROW_ALIGN, H, Dv), jnp.float32)
    assert int((np.asarray(a.stores)[..., 2:] >= 0).sum()) >= 3  # the case has shared groups
    want = aligned_tiles.merge_shared_groups(out, shared, a.q_rows, a.stores, kernel=False)
    got = aligned_tiles.merge_shared_groups(out, shared, a.q_rows, a.stores, kernel=True, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(want), np.asarray(out))  # the merge changed something


def test_triton_merge_lowers_for_cuda():
    """The merge kernel's Triton lowering for CUDA (on any machine: the GPU check runs it for real)."""
    from pallas_kernels.flash_attention_hopper import aligned_merge

    out = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    shared = jax.ShapeDtypeStruct((1, 26, aligned_tiles.ROW_ALIGN, 4, 128), jnp.bfloat16)
    first = jax.ShapeDtypeStruct((1, 26), jnp.int32)
    f = jax.jit(lambda o, s, i: aligned_merge.merge_shared(o, s, i, interpret=False))
    assert "triton" in f.trace(out, shared, first).lower(lowering_platforms=("cuda",)).as_text().lower()
    with pytest.raises(ValueError, match="power of two"):
        aligned_merge.merge_shared(jnp.zeros((1, 16, 1, 96)), jnp.zeros((1, 2, 8, 1, 96)), jnp.zeros((1, 2), jnp.int32))


def test_shared_segment_ids_give_one_run_computation():
    """Queries and keys from one segment array (self-attention, as te_jax's front door builds them) at one tile
    size: the aligned tables compute their runs once (XLA merges the two identical computations), so the compiled
    tables hold one run_tiles' pair of scatters, not two; other key ids keep their own."""
    seg = _runs([300, 131, 250, 89, 200], 1024)[None]
    cfg = dataclasses.replace(default_config(128, 1024, False, 1024), block_q=64, block_kv=128)

    def scatters(build):
        f = jax.jit(lambda s: aligned_tiles.aligned_mask_tables(build(s), cfg, backward=False).aligned)
        return f.lower(jnp.asarray(seg)).compile().as_text().count("scatter(")

    one = scatters(lambda s: AttentionMask.from_segments(s, causal=True))
    two = scatters(lambda s: AttentionMask.from_segments(s, s + (s > 0) * 100, causal=True))
    assert one == 2 and two == 4, (one, two)
