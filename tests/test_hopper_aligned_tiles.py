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
    """[B, Sq, Skv] int: how many times the forward kernel adds each (query, key) pair to a query's output row, as
    it walks the aligned tables: every pair of a full block, the pairs its group's element mask keeps (on the padded
    layout's marks) of a partial one; only rows that hold a query of the tile (the others are never gathered)."""
    a = jax.tree_util.tree_map(np.asarray, t.aligned)
    tq, bkv = 2 * cfg.block_q, cfg.block_kv
    rules = rule.partial_rules()
    B, T = a.q_rows.shape
    seen = np.zeros((B, q_len, kv_len), np.int32)
    for b in range(B):
        for tile in range(T):
            ends = a.counts[b, tile]
            q_marks = a.qm[b, :, tile * tq:(tile + 1) * tq]
            real = q_marks[0] != NO_SEGMENT
            q_tokens = a.q_rows[b, tile] * aligned_tiles.ROW_ALIGN + np.arange(tq)
            group = 0
            for step in range(ends[-1]):
                while group < len(rules) and step >= ends[group]:
                    group += 1
                blk = a.blocks[b, tile, step]
                k_marks = a.km[b, :, blk * bkv:(blk + 1) * bkv]
                keys = a.kv_rows[b, tile, step] * aligned_tiles.ROW_ALIGN + np.arange(bkv)
                if group < len(rules):  # partial: the group's element mask on the padded marks
                    keep = np.asarray(rules[group].apply(jnp.ones((tq, bkv)), (q_marks[0], q_marks[1]),
                                                         (k_marks[0], k_marks[1]), 0.0, q_axis=0)) > 0
                else:
                    keep = np.ones((tq, bkv), bool)
                keep &= real[:, None]
                assert keys[keep.any(0)].max(initial=-1) < kv_len, "a counted key past the keys' end"
                for i, j in zip(*np.nonzero(keep)):
                    seen[b, q_tokens[i], keys[j]] += 1
    return seen


CASES = {
    "thd documents, causal": lambda: AttentionMask.from_segments(_runs([300, 1, 130, 250, 89, 200], 1024)[None],
                                                                causal=True),
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
    """aligned_tables (through aligned_mask_tables) against the dense mask: the kernel model adds every visible
    pair once and no other pair, and gather_rows brings every query's row back to token order."""
    m = CASES[name]()
    cfg = dataclasses.replace(default_config(128, m.kv_len, False, m.q_len), block_q=64, block_kv=128)
    t = jax.jit(lambda m: aligned_tiles.aligned_mask_tables(m, cfg, backward=False))(m)
    assert t.fwd is None
    seen = _kernel_model(t, mask_rule(m), cfg, m.q_len, m.kv_len)
    np.testing.assert_array_equal(seen, np.asarray(m.dense()).astype(np.int32))
    # gather_rows: the padded layout's row of each query is where its tile computed it
    a = t.aligned
    tq = 2 * cfg.block_q
    tokens = np.asarray(a.q_rows)[:, :, None] * aligned_tiles.ROW_ALIGN + np.arange(tq)  # [B, T, tq]: each row's
    padded = jnp.asarray(tokens.reshape(m.batch, -1), jnp.float32)[:, :, None, None]
    out, lse = aligned_tiles.gather_rows(padded, padded[:, :, :, 0].transpose(0, 2, 1), a.out_index)
    np.testing.assert_array_equal(np.asarray(out)[:, :, 0, 0], np.broadcast_to(np.arange(m.q_len), (m.batch, m.q_len)))
    np.testing.assert_array_equal(np.asarray(lse)[:, 0], np.broadcast_to(np.arange(m.q_len), (m.batch, m.q_len)))


def test_aligned_tiles_start_at_documents_and_fall_back_past_the_bound():
    """run_tiles: tiles start at every document and every `tile` tokens within it; a row with more documents than
    aligned_tile_count leaves room for keeps the global grid; the aligned tables then match the grid's pairs."""
    seg = jnp.asarray(np.stack([_runs([100, 200, 28], 384), _runs([1] * 20, 384)]))
    n_max = aligned_tiles.aligned_tile_count(384, 128)
    assert n_max == 3 + 4
    starts, index, n_tiles = aligned_tiles.run_tiles(seg, 128, n_max)
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
    np.testing.assert_array_equal(_kernel_model(t, mask_rule(m), cfg, 384, 384),
                                  np.asarray(m.dense()).astype(np.int32))
