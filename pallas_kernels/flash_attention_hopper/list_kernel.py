"""The data mask's block lists in one Triton-lowered Pallas kernel (data_mask.tile_lists with kernel=True).

    block_lists_kernel(row_stats, col_stats, row_marks, col_marks, fits, rule, *, transposed, kinds, interpret=None)
        -> (counts [B, R, n_groups + 1] int32, blocks [B, R, C] int32)
        row_stats / col_stats   mask.TileStats [B, R] / [B, C]: the tiles whose lists these are (query tiles, or key
                                tiles where transposed) and the blocks they walk
        row_marks / col_marks   TileStats whose positions are data_mask._combined_marks' g (partial_kinds), or None
                                where the rule has one partial group
        fits                    bool scalar: the combined marks' bounds hold (else no segments-only group)
        kinds                   data_mask.partial_kinds (passed in: data_mask imports this module)

The same lists as XLA's mask.classify -> data_mask.partial_kinds -> data_mask.block_lists (the tests compare them),
from one program per (batch, row): it classifies its row against every block, groups the partial ones, and places
each block by a running count per group, the unlisted ones last (blocks is the stable sort of the list keys, every
entry written). XLA runs the same as several small kernels per table (a packed-documents call's whole pre-pass is
59-68 kernels on an H100). Rows of up to MAX_COLS blocks, read into vectors of the next power of two by masked loads
(no padded copies of the statistics). HopperConfig.lists_kernel: auto on the GPU (H200: thd's fwd+bwd tables 102 ->
83 us of kernels, benchmarks/results/attention_masks_h200.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._compat import default_interpret, pl, pltriton, triton_params
from ..mask import FULL, PARTIAL, TileStats, classify

#: The most blocks a row of the kernel classifies (its vectors are padded to a power of two).
MAX_COLS = 1024


#: A block past the row's end, as the kernel reads it (masked lanes): no valid token (segment range empty), so
#: EMPTY and placed after every real block.  TileStats' order: seg_min, seg_max, pos_min, pos_max, all_valid.
_EMPTY_STATS = (jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max,
                jnp.iinfo(jnp.int32).min, 0)


def _pad_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _kernel(*refs, n_stats: int, n_cols: int, npad: int, rule, transposed: bool, n_groups: int, kinds):
    grouped = n_groups > 1
    n_in = 2 * n_stats + (2 * 2 + 1 if grouped else 0)
    ins, (counts_ref, blocks_ref) = refs[:n_in], refs[n_in:]
    b, r = pl.program_id(0), pl.program_id(1)
    idx = jnp.arange(npad, dtype=jnp.int32)
    real = idx < n_cols  # the vectors' lanes past the row's blocks: no valid token, so EMPTY and listed last
    cols = lambda ref, pad: pltriton.load(ref.at[b, idx], mask=real, other=pad)
    valid = lambda s: s._replace(all_valid=s.all_valid != 0)  # int32 0 / 1 in memory
    row = valid(TileStats(*(jnp.broadcast_to(ref[b, r], (1,)) for ref in ins[:n_stats])))
    col = valid(TileStats(*(cols(ref, v) for ref, v in zip(ins[n_stats:2 * n_stats], _EMPTY_STATS))))
    q, kv = (col, row) if transposed else (row, col)
    flat = lambda x: x.reshape(npad)  # [1, npad] or [npad, 1] -> [npad]
    classes = flat(classify(q, kv, causal=rule.causal, window=rule.window)).astype(jnp.int32)
    if grouped:
        g_in = ins[2 * n_stats:]
        row_g = (jnp.broadcast_to(g_in[0][b, r], (1,)), jnp.broadcast_to(g_in[1][b, r], (1,)))
        col_g = (cols(g_in[2], _EMPTY_STATS[2]), cols(g_in[3], _EMPTY_STATS[3]))
        marks = lambda s, g: s._replace(pos_min=g[0], pos_max=g[1])
        qg, kg = (marks(col, col_g), marks(row, row_g)) if transposed else (marks(row, row_g), marks(col, col_g))
        groups = flat(kinds(q, kv, qg, kg, rule, g_in[4][0] != 0))
    else:
        groups = jnp.zeros((npad,), jnp.int32)
    key = jnp.where(classes == PARTIAL, groups, jnp.where(classes == FULL, n_groups, n_groups + 1))
    slot = jnp.zeros((npad,), jnp.int32)
    start = jnp.int32(0)
    for g in range(n_groups + 2):  # the partial groups, the full blocks, then the unlisted ones
        hit = key == g
        slot = jnp.where(hit, start + jnp.cumsum(hit.astype(jnp.int32)) - 1, slot)
        start = start + jnp.sum(hit.astype(jnp.int32))
        if g <= n_groups:
            counts_ref[b, r, g] = start
    # the lanes past the row come last, at slots >= n_cols: every real block's slot is written, nothing else
    pltriton.store(blocks_ref.at[b, r, slot], idx, mask=real)


def block_lists_kernel(row_stats: TileStats, col_stats: TileStats, row_marks, col_marks, fits, rule, *,
                       transposed: bool, kinds=None, interpret=None):
    """See the module docstring; kinds: data_mask.partial_kinds (the caller's, where the rule has groups)."""
    B, R = row_stats.seg_min.shape
    C = col_stats.seg_min.shape[-1]
    if C > MAX_COLS:
        raise ValueError(f"block_lists_kernel: {C} blocks per row; the kernel takes at most {MAX_COLS} "
                         f"(use data_mask.tile_lists(kernel=False)).")
    n_groups = len(rule.partial_rules())
    grouped = n_groups > 1
    if grouped and (row_marks is None or col_marks is None or fits is None or kinds is None):
        raise ValueError(f"block_lists_kernel: rule {rule} has {len(rule.partial_rules())} partial groups and "
                         f"needs row_marks, col_marks, fits and kinds (data_mask.partial_kinds).")
    npad = _pad_pow2(C)
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    ins = [i32(x) for x in row_stats] + [i32(x) for x in col_stats]
    if grouped:
        ins += [i32(row_marks.pos_min), i32(row_marks.pos_max), i32(col_marks.pos_min), i32(col_marks.pos_max),
                i32(jnp.reshape(fits, (1,)))]
    counts, blocks = pl.pallas_call(
        functools.partial(_kernel, n_stats=len(_EMPTY_STATS), n_cols=C, npad=npad, rule=rule,
                          transposed=transposed, n_groups=n_groups, kinds=kinds),
        out_shape=(jax.ShapeDtypeStruct((B, R, n_groups + 1), jnp.int32),
                   jax.ShapeDtypeStruct((B, R, C), jnp.int32)),
        grid=(B, R),
        compiler_params=triton_params(4 if npad <= 256 else 8, 1),
        interpret=default_interpret() if interpret is None else interpret,
        name="te_jax_attn_block_lists",
    )(*ins)
    return counts, blocks
