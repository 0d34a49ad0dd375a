"""Flash-decoding (split-KV) attention for short queries against a long KV cache (Triton-lowered Pallas).

Layout: q [B, Sq, H, Dqk] with Sq <= MAX_QUERY_LEN (1 for plain decoding, up to 16 for speculative
decoding or chunked prefill tails), k [B, Skv, G, Dqk], v [B, Skv, G, Dv], H % G == 0. Returns
(out [B, Sq, H, Dv] q.dtype, lse [B, H, Sq] f32, natural log, -inf on rows that see no key).

Work split:
- **Query heads of a KV group in one tile.** The R = H / G query heads of each KV head and the Sq
  query tokens form the rows of one tile (row t * R + r: token t, head g * R + r), so every K/V tile is
  read once per KV head, never once per query head. Rows are padded to a power of two >= 16 (Triton's
  smallest dot); more than `block_rows` rows take several tiles.
- **The KV length split across programs** (flash-decoding): program (s, b, tile) takes the s-th of
  shares of row b's *visible* KV blocks, writes a partial output and its logsumexp, and the shares are
  merged by logsumexp after the kernel (`_combine`, a few MB in XLA). The split count is chosen statically
  from the grid size (`DecodeConfig.min_programs`). Every share is the same number of blocks on every row
  (`share_blocks`, from the rows' visible ranges at run time), so a partly filled cache is read only up to
  its filled part and a shorter row uses fewer of its programs (the rest exit at once). With several rows
  the grid holds `DecodeConfig.uneven_split_factor` (4 on a contiguous cache) times the shares: rows of even length use
  the first of them (the longest row over the split count: one program per SM), rows of uneven length all
  of them (shares that many times shorter, so the GPU spreads the short and long rows over its SMs).
- **Masks.** The kernel takes the `AttentionMask` (segment ids and positions per token, causal and window
  static): before the launch XLA reduces its block classes (`AttentionMask.block_classes`, one q tile of
  all Sq tokens) to per-row loop bounds (lo, flo, fhi, hi) as the portable kernel does: blocks outside
  [lo, hi) are never loaded, [flo, fhi) is computed without mask arithmetic, the rest with the element
  mask. Per-row cache lengths (padding), bottom-right causal (each new token sees the cache up to its own
  position), sliding windows and packed segments are all the same mechanism.
- **Backward**: the portable kernel's backward from this forward's out and lse (`flash_attention_bwd`), so
  the op is differentiable although decoding never asks for it.

Units as the portable kernel without a bias: logits in base 2 (times log2 e), exp2(s - m).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import default_interpret, pl, pltriton, triton_params
from .._lower_once import lower_once
from .._shapes import check_blocks as _check_blocks
from .._shapes import next_pow2 as _next_pow2
from .._shapes import pad_axis as _pad_axis
from ..flash_attention import flash_attention_bwd
from ..mask import AttentionMask, loop_bounds, visible

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

#: Longest query (tokens per row) the decode kernel takes; longer queries are prefill, for the flash kernels.
MAX_QUERY_LEN = 16
MAX_HEAD_DIM = 256
#: DecodeConfig.merge's choices.
MERGES = ("xla", "kernel")
#: DecodeConfig.block_kv=None: (keys per step for a grid of about one wave, for a larger grid or a paged cache).
AUTO_BLOCK_KV = (64, 128)


#: DecodeConfig.uneven_split_factor's auto value on a contiguous cache (see there; decode_h100.md, 2026-11-27).
UNEVEN_SPLIT_FACTOR = 4


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiles and launch parameters of the decode kernel (powers of two >= 16 for the blocks).

    block_kv: keys per step (shrunk to a power of two dividing the cache length when possible, so that the
      cache is never copied to pad it). None: 64 for a contiguous cache whose grid is about one wave (fewer than
      2 x min_programs (batch x KV heads x row tiles) before splitting), else 128. On the H100 by the device clock,
      64 read 2-4% faster on every one-wave row swept (batch-16 GQA, batch-1 GQA and MHA); 128 was 7% faster on
      batch-16 MHA (512 programs); benchmarks/results/decode_h100.md, "launch parameters".
    block_rows: most rows (query tokens x heads of a group) per tile.
    num_splits: fixed number of KV shares per (row, KV head); None: the fewest shares that give the grid at
      least `min_programs` programs, at most one share per KV block. 120 is about one program per SM of an H100
      (132 SMs): on the H100 one such wave read fastest on every row swept (128-256 programs beat 264-384 by 2-10%;
      benchmarks/results/decode_h100.md). paged_min_programs: the same for a paged cache, whose blocks are a page
      long (64 keys) and looked up through the block table: there two waves read faster (2.71 TB/s at 264 programs
      against 2.31 at 128, batch 16 GQA 32/8 32k on the H100).
    uneven_split_factor: with more than one row and per-row lengths or a mask (rows that may differ in
      length), the grid holds this many times the shares. At run time `share_blocks` sizes every share as the
      longest row's visible range over the split count when the rows are even (longest <= 9/8 of the mean:
      the extra programs exit at once), and that many times shorter when they are not. 1: no
      extra shares. None (auto): UNEVEN_SPLIT_FACTOR (4) for a contiguous cache, 1 for a paged one (not measured
      with extra shares). On the H100 (benchmarks/results/decode_h100.md, 2026-11-27; batch 16, GQA 32/8, 32k
      slots) rows filled 1k..32k read 2.45 TB/s with 4 against 2.10 with 1 (cuDNN 2.17); rows all filled to 32k
      and given as lengths read 2.65 against 2.81 (cuDNN 2.72): the extra programs cost about 5% there. A call
      without lengths or mask (a whole cache) has no extra shares.
    shares_last: the grid's share axis is its slowest (launched last): the GPU starts share 0 of every (row, KV
      head, row tile) first, and the empty shares (a shorter row's, or every extra share of uneven_split_factor on
      even rows) come last. False: the share axis fastest, as before 2026-11-27 (a row's shares side by side in
      launch order). On the H100 the two orders read within 1-4% of each other on every row measured
      (benchmarks/results/decode_h100.md); the even rows' 5% cost of extra shares is there either way.
    merge: how the KV shares are combined. "xla": after the kernel (`_combine`, a few small XLA fusions);
      "kernel": by the last program of each (row, KV head, row tile) to finish its share. Every program writes its
      partial output and logsumexp, then counts itself in (an atomic add on a zeroed counter per tile); the one
      that sees the count reach num_splits - 1 reads the partials back and writes the merged output. This removes
      the XLA pass and its launches. Opt-in: on the H100 the decode kernel grew by about 5 us (the last program
      of each tile merges alone), more than the launch it saves (benchmarks/results/decode_h100.md).
    """

    block_kv: int | None = None
    block_rows: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    min_programs: int = 120
    paged_min_programs: int = 264
    uneven_split_factor: int | None = None
    shares_last: bool = True
    merge: str = "xla"

    def __post_init__(self):
        _check_blocks("DecodeConfig", block_kv=self.block_kv or AUTO_BLOCK_KV[1], block_rows=self.block_rows)
        factor = self.uneven_split_factor
        if factor is not None and (not isinstance(factor, int) or factor < 1):
            raise ValueError(f"DecodeConfig.uneven_split_factor={factor!r} must be None (auto) or an int >= 1 "
                             f"(1: no extra shares for uneven rows)")
        if not isinstance(self.shares_last, bool):
            raise ValueError(f"DecodeConfig.shares_last={self.shares_last!r} must be True (the share axis launched "
                             f"last) or False (first)")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"DecodeConfig.num_splits={self.num_splits} must be >= 1 (or None: automatic)")
        if self.merge not in MERGES:
            raise ValueError(f"DecodeConfig.merge={self.merge!r} must be one of {MERGES}")


def decode_reason(q_shape, k_shape, v_shape) -> str | None:
    """None when the decode kernel takes these [B, S, heads, D] shapes (q_len <= MAX_QUERY_LEN < kv_len), else
    why not."""
    B, sq, h, dqk = q_shape
    skv, g, dv = k_shape[1], k_shape[2], v_shape[3]
    if sq > MAX_QUERY_LEN:
        return (f"q_len {sq} > {MAX_QUERY_LEN}: the decode kernel serves short queries (decoding, speculative "
                f"tokens) against a KV cache")
    if skv <= sq:
        return f"kv_len {skv} <= q_len {sq}: not a short query against a longer KV cache"
    if h % g:
        return f"{h} query heads are not a multiple of {g} KV heads"
    if max(dqk, dv) > MAX_HEAD_DIM:
        return f"head_dim {max(dqk, dv)} > {MAX_HEAD_DIM}: the kernel keeps a whole head row in registers"
    return None


@dataclasses.dataclass(frozen=True)
class _Geom:
    rep: int  # query heads per KV head (R)
    rows: int  # Sq * R
    bm: int  # rows per tile
    n_tiles: int  # row tiles per KV head
    bk: int  # keys per step
    skv_pad: int
    n_splits: int  # shares per row for even rows
    grid_splits: int  # shares per row in the grid (n_splits x uneven_split_factor where rows may be uneven)
    dqk_pad: int
    dv_pad: int


def _geometry(cfg: DecodeConfig, B, sq, h, skv, g, dqk, dv, page_size=None, uneven: bool = False) -> _Geom:
    """uneven: rows that may differ in length (per-row lengths or a mask; DecodeConfig.uneven_split_factor)."""
    rep = h // g
    rows = sq * rep
    bm = min(max(16, _next_pow2(rows)), cfg.block_rows)
    n_tiles = -(-rows // bm)
    # The largest power-of-two block <= block_kv that divides the cache (or a page of a paged one): no copy of the
    # cache to pad it.
    whole = page_size or skv
    want = cfg.block_kv
    if want is None:
        one_wave = page_size is None and B * g * n_tiles < 2 * cfg.min_programs
        want = AUTO_BLOCK_KV[0] if one_wave else AUTO_BLOCK_KV[1]
    bk = next((b for b in (want, want // 2, want // 4, want // 8) if b >= 16 and whole % b == 0),
              min(want, max(16, _next_pow2(skv))))
    skv_pad = -(-skv // bk) * bk
    nk = skv_pad // bk
    programs = cfg.min_programs if page_size is None else cfg.paged_min_programs
    n_splits = cfg.num_splits or -(-programs // (B * g * n_tiles))
    n_splits = max(1, min(n_splits, nk))
    grid_splits = n_splits  # a set num_splits is taken as it is
    if uneven and B > 1 and cfg.num_splits is None:
        factor = cfg.uneven_split_factor
        if factor is None:  # auto: the factor measured on contiguous caches; paged ones are unmeasured
            factor = UNEVEN_SPLIT_FACTOR if page_size is None else 1
        grid_splits = min(n_splits * factor, nk)
    return _Geom(rep, rows, bm, n_tiles, bk, skv_pad, n_splits, grid_splits, max(16, _next_pow2(dqk)),
                 max(16, _next_pow2(dv)))


def describe(q_shape, k_shape, v_shape, config: DecodeConfig | None = None, mode: str = "mask_rows") -> str:
    """One line on how the kernel runs these shapes (for te_jax's backend explanation); mode: "no_mask"
    (flash_decode's mask None: every query sees every key), "cache_lengths" (flash_decode_cache) or "mask_rows"
    (flash_decode with a mask)."""
    B, sq, h, dqk = q_shape
    skv, g, dv = k_shape[1], k_shape[2], v_shape[3]
    geo = _geometry(config or DecodeConfig(), B, sq, h, skv, g, dqk, dv, uneven=mode != "no_mask")
    how = {"no_mask": "no mask: the key rows are made in the kernel from the cache length, and no mask rows or block "
                      "classes are built around it",
           "cache_lengths": "a cache filled to each row's length (kv_seqlens): the key rows are made in the kernel "
                            "from the lengths and the loop bounds come from them (no [batch, kv_len] mask rows); "
                            "each row reads only the blocks below its length that its causal / window bounds leave "
                            "visible",
           "mask_rows": "each row reads only the blocks its mask leaves visible (per-row cache lengths, causal, "
                        "window)"}[mode]
    line = (f"{sq} query token(s) x {geo.rep} query heads per KV head in {geo.n_tiles} tile(s) of {geo.bm} rows "
            f"(K/V read once per KV head); {geo.bk}-key steps; the KV length split into {geo.n_splits} share(s) per "
            f"(row, KV head), of the same length on every row (a shorter row uses fewer)"
            + (f", {geo.grid_splits} shorter ones where the rows' lengths are uneven" if geo.grid_splits > geo.n_splits
               else "")
            + f", merged by logsumexp; {how}; backward: the portable kernel's")
    copies = []
    if geo.skv_pad != skv:
        copies.append(f"kv_len {skv} padded to {geo.skv_pad}")
    if geo.dqk_pad != dqk or geo.dv_pad != dv:
        copies.append(f"head_dim {dqk}/{dv} padded to {geo.dqk_pad}/{geo.dv_pad}")
    if copies:
        line += f"; {' and '.join(copies)} (a copy of the cache: a multiple of 16 keys and a power-of-two head_dim avoid it)"
    return line


# --------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------
def _decode_kernel(*refs, scale: float, softcap: float | None, causal: bool, window, bk: int, n_splits: int,
                   page_size: int | None, merge_in_kernel: bool = False, tiles: int = 1, interpret: bool = False,
                   cache_keys: bool = False, shares_last: bool = False):
    """One (KV share, batch row, row tile): online softmax over the share's visible KV blocks. The grid is
    (row, tile, share) with shares_last (DecodeConfig.shares_last), else (share, row, tile).

    refs: meta [5] (lo, flo, fhi, hi: the row's loop bounds; the blocks per share), q, k, v, the query and key
    (segment, position) rows, then the outputs. cache_keys (a cache filled to its length): meta is [8] with the
    row's key count at 4 and the blocks per share at 5, and there are no key rows: key j has segment 1 below that
    count (else 0) and position j. Share s of a row is blocks [lo + s * per, lo + (s + 1) * per) cut at hi.

    Paged (page_size given): k_ref / v_ref are the whole page pool of this KV head [P, page_size, D] and the
    extra table_ref [max_pages] maps the row's logical pages to pool pages; a block never crosses a page.
    merge_in_kernel (DecodeConfig.merge "kernel"): refs end with the counters [B, G * tiles] (zeroed, aliased) and
    the whole partial arrays [B, G, n_splits, M, Dv] / [B, G, n_splits, M] instead of this program's blocks, the
    counters again (the output the input is aliased to), then the merged output's and lse's blocks; see
    _merge_last."""
    if cache_keys:
        meta_ref, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, *refs = refs
    else:
        meta_ref, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref, *refs = refs
    if merge_in_kernel:  # inputs end with the counters, aliased to the third output (the same buffer)
        *tables, _, o_ref, lse_ref, count_ref, out_ref, out_lse_ref = refs
    else:
        *tables, o_ref, lse_ref = refs
    if page_size is None:
        load = lambda ref, j: ref[pl.ds(pl.multiple_of(j * bk, bk), bk), :]
    else:
        (table_ref,) = tables

        def load(ref, j):
            start = j * bk
            return ref[table_ref[start // page_size], pl.ds(pl.multiple_of(start % page_size, bk), bk), :]
    b, i, share = (pl.program_id(0), pl.program_id(1), pl.program_id(2)) if shares_last else \
        (pl.program_id(1), pl.program_id(2), pl.program_id(0))
    lo, flo, fhi, hi = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    per = meta_ref[5] if cache_keys else meta_ref[4]
    a = jnp.minimum(lo + share * per, hi)
    e = jnp.minimum(a + per, hi)
    q = q_ref[...]
    qseg = qseg_ref[...]
    qpos = qpos_ref[...]

    def body(j, carry, masked):
        acc, m, l = carry
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        s = jnp.dot(q, load(k_ref, j).T, preferred_element_type=jnp.float32)
        if softcap is not None:
            s = jnp.tanh(s * (scale / softcap)) * (softcap * LOG2E)
        else:
            s = s * (scale * LOG2E)
        if masked:
            if cache_keys:
                kpos = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
                kseg = (kpos < meta_ref[4]).astype(jnp.int32)
            else:
                kseg, kpos = kseg_ref[sl], kpos_ref[sl]
            vis = visible(qseg[:, None], qpos[:, None], kseg[None, :], kpos[None, :], causal=causal, window=window)
            s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = load(v_ref, j)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, l

    bm, dv = q.shape[0], v_ref.shape[-1]
    carry = (jnp.zeros((bm, dv), jnp.float32), jnp.full((bm,), -jnp.inf, jnp.float32),
             jnp.zeros((bm,), jnp.float32))
    # The share [a, e) in the row's three runs: masked [lo, flo), full [flo, fhi), masked [fhi, hi).
    carry = lax.fori_loop(a, jnp.minimum(e, flo), lambda j, c: body(j, c, True), carry)
    carry = lax.fori_loop(jnp.maximum(a, flo), jnp.minimum(e, fhi), lambda j, c: body(j, c, False), carry)
    acc, m, l = lax.fori_loop(jnp.maximum(a, fhi), e, lambda j, c: body(j, c, True), carry)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_part = acc / l_safe[:, None]
    lse_part = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
    if not merge_in_kernel:
        o_ref[...] = o_part
        lse_ref[...] = lse_part
        return
    g, t = i // tiles, i % tiles
    rows = pl.ds(pl.multiple_of(t * bm, bm), bm)
    o_ref[b, g, share, rows, :] = o_part
    lse_ref[b, g, share, rows] = lse_part
    _merge_last(o_ref, lse_ref, count_ref, out_ref, out_lse_ref, b=b, g=g, i=i, rows=rows, n_splits=n_splits,
                interpret=interpret)


def _merge_last(o_ref, lse_ref, count_ref, out_ref, out_lse_ref, *, b, g, i, rows, n_splits: int, interpret: bool):
    """DecodeConfig.merge "kernel": count this program's share in; the last of the tile's n_splits programs reads
    every share's partial (out, lse) back and writes the logsumexp merge (as _combine) to out_ref / out_lse_ref.

    Ordering on the GPU: the barrier puts every thread's partial stores before the count (an acquire-release
    atomic, so the last program's reads come after every other program's stores); the partials are read with
    volatile loads, past an L1 that may hold a stale line.  (The interpreter runs the programs one after another.)
    Not yet run on a GPU."""
    if not interpret:
        pltriton.debug_barrier()
    done = pltriton.atomic_add(count_ref, (b, i), jnp.int32(1))

    @pl.when(done == n_splits - 1)
    def _():
        def body(s, carry):
            acc, mx, tot = carry
            lse_s = pltriton.load(lse_ref.at[b, g, s, rows], volatile=True)
            o_s = pltriton.load(o_ref.at[b, g, s, rows, :], volatile=True)
            new = jnp.maximum(mx, lse_s)
            base = jnp.where(jnp.isfinite(new), new, 0.0)
            keep = jnp.exp(mx - base)  # exp(-inf) = 0 for the shares (and rows) that saw nothing
            w = jnp.exp(lse_s - base)
            return acc * keep[:, None] + w[:, None] * o_s, new, tot * keep + w

        bm, dv = rows.size, o_ref.shape[4]
        init = (jnp.zeros((bm, dv), jnp.float32), jnp.full((bm,), -jnp.inf, jnp.float32),
                jnp.zeros((bm,), jnp.float32))
        acc, mx, tot = lax.fori_loop(0, n_splits, body, init)
        seen = tot > 0
        tot_safe = jnp.where(seen, tot, 1.0)
        out_ref[...] = (acc / tot_safe[:, None]).astype(out_ref.dtype)
        out_lse_ref[...] = jnp.where(seen, jnp.where(jnp.isfinite(mx), mx, 0.0) + jnp.log(tot_safe), -jnp.inf)


def share_blocks(bounds, n_splits: int, grid_splits: int):
    """int32 [B]: the KV blocks of each share, the same on every row (at least 1). From the [B, 4] loop bounds'
    visible ranges hi - lo: the longest over n_splits where the rows are even (the longest at most 9/8 of the
    mean), the longest over grid_splits where they are not. A row's share s is [lo + s * per, lo + (s + 1) *
    per) cut at its hi, so a shorter row leaves its last programs empty."""
    span = bounds[:, 3] - bounds[:, 0]
    longest = jnp.max(span)
    even = longest * 8 * span.shape[0] <= jnp.sum(span) * 9
    parts = jnp.where(even, n_splits, grid_splits)
    per = jnp.maximum((longest + parts - 1) // parts, 1)
    return jnp.full((bounds.shape[0],), per, jnp.int32)


def _combine(o, lse):
    """Merge the shares by logsumexp: o [..., n_splits, M, D], lse [..., n_splits, M] -> [..., M, D], [..., M]."""
    mx = jnp.max(lse, axis=-2)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse - mx[..., None, :])  # exp(-inf) = 0 for empty shares
    tot = jnp.sum(w, axis=-2)
    out = jnp.sum(w[..., None] * o, axis=-3) / jnp.where(tot > 0, tot, 1.0)[..., None]
    return out, jnp.where(tot > 0, mx + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)


def cache_loop_bounds(kv_lens, q_positions, q_segment_ids, *, causal: bool, window, block: int, n_blocks: int):
    """int32 [B, 4] = (lo, flo, fhi, hi) as `loop_bounds` gives them, for a cache filled to kv_lens [B] (key j:
    segment 1 below the length, else 0; position j) and this call's queries (q_positions, q_segment_ids [B, Sq],
    segment 0 = a padding query), from the lengths alone: blocks outside [lo, hi) hold no visible key, and every
    key of [flo, fhi) is visible to every query (none when a query is padding; then flo = fhi = hi)."""
    lens = jnp.asarray(kv_lens, jnp.int32)
    pos = jnp.asarray(q_positions, jnp.int32)
    valid = jnp.asarray(q_segment_ids) != 0
    big = jnp.iinfo(jnp.int32).max // 2
    pmin = jnp.min(jnp.where(valid, pos, big), axis=1)
    pmax = jnp.max(jnp.where(valid, pos, -big), axis=1)
    left, right = window
    reach = 0 if causal else (right if right >= 0 else None)  # keys past a query's position it can see
    # keys some query sees: [ulo, uhi); keys every query sees: [ilo, ihi)
    ulo = jnp.maximum(pmin - left, 0) if left >= 0 else jnp.zeros_like(lens)
    ilo = jnp.maximum(pmax - left, 0) if left >= 0 else jnp.zeros_like(lens)
    uhi = lens if reach is None else jnp.minimum(pmax + reach + 1, lens)
    ihi = lens if reach is None else jnp.minimum(pmin + reach + 1, lens)
    some = jnp.any(valid, axis=1) & (uhi > ulo)
    lo = jnp.where(some, ulo // block, 0)
    hi = jnp.where(some, jnp.minimum(-(-uhi // block), n_blocks), 0)
    flo, fhi = -(-ilo // block), ihi // block
    full = jnp.all(valid, axis=1) & some & (flo < fhi)
    flo, fhi = jnp.where(full, flo, hi), jnp.where(full, fhi, hi)
    return jnp.stack([lo, flo, fhi, hi], axis=1).astype(jnp.int32)


def _block_spec(shape, index_map, *, shares_last: bool):
    """pl.BlockSpec with index_map(share, row, tile) on the grid (row, tile, share) (shares_last) or (share, row,
    tile)."""
    if shares_last:
        return pl.BlockSpec(shape, lambda b, i, s: index_map(s, b, i))
    return pl.BlockSpec(shape, index_map)


@lower_once(static_argnames=("scale", "softcap", "config", "interpret"))
def _decode_impl(q, k, v, mask: AttentionMask | None, block_table=None, *, scale, softcap, config: DecodeConfig,
                 interpret: bool, kv_lens=None):
    """Contiguous: k, v [B, Skv, G, D]. Paged: k, v [P, page_size, G, D] pools, block_table [B, max_pages]
    (the mask then spans the logical max_pages * page_size keys). kv_lens [B] (the mask is
    `paged_cache_mask(kv_lens, ...)`'s): the loop bounds come from the lengths (`cache_loop_bounds`) and the kernel
    derives each key's segment and position, so the [B, Skv] key rows are neither built nor read. mask None
    (every query sees every key) is that with every row's length the whole cache."""
    B, sq, h, dqk = q.shape
    g, dv = k.shape[2], v.shape[3]
    page_size = None if block_table is None else k.shape[1]
    skv = k.shape[1] if block_table is None else block_table.shape[1] * page_size
    geo = _geometry(config, B, sq, h, skv, g, dqk, dv, page_size, uneven=mask is not None or kv_lens is not None)
    R, M = geo.rep, geo.n_tiles * geo.bm
    spec = functools.partial(_block_spec, shares_last=config.shares_last)
    if mask is None:  # the whole cache, seen by every query: its rows are never built (see kv_lens)
        kv_lens = jnp.full((B,), skv, jnp.int32)
        mask = paged_cache_mask(kv_lens, sq, skv, causal=False)
    # q rows per KV head: [B, G, Sq * R, D] (row t * R + r), padded rows / columns of zeros.
    qp = q.reshape(B, sq, g, R, dqk).transpose(0, 2, 1, 3, 4).reshape(B, g, geo.rows, dqk)
    qp = _pad_axis(_pad_axis(qp, 2, M), 3, geo.dqk_pad)
    if block_table is None:
        k, v = _pad_axis(k, 1, geo.skv_pad), _pad_axis(v, 1, geo.skv_pad)
    k, v = _pad_axis(k, 3, geo.dqk_pad), _pad_axis(v, 3, geo.dv_pad)
    nt, bm, S = geo.n_tiles, geo.bm, geo.grid_splits
    qseg = _pad_axis(jnp.repeat(mask.q_segment_ids.astype(jnp.int32), R, axis=1), 1, M)  # 0: hidden rows
    qpos = _pad_axis(jnp.repeat(mask.q_positions.astype(jnp.int32), R, axis=1), 1, M)
    mask_specs = [spec((None, bm), lambda s, b, i: (b, i % nt)),
                  spec((None, bm), lambda s, b, i: (b, i % nt))]
    mask_args = [qseg, qpos]
    if kv_lens is not None:  # [lo, flo, fhi, hi, kv_len, blocks per share, 0, 0] per row; no key rows
        lens = jnp.asarray(kv_lens, jnp.int32)
        bounds = cache_loop_bounds(lens, mask.q_positions, mask.q_segment_ids, causal=mask.causal,
                                   window=mask.window, block=geo.bk, n_blocks=geo.skv_pad // geo.bk)
        meta = jnp.concatenate([bounds, lens[:, None], share_blocks(bounds, geo.n_splits, S)[:, None],
                                jnp.zeros((B, 2), jnp.int32)], axis=1)
    else:
        # Loop bounds of the single q tile (all Sq tokens) per row; padded keys get segment 0 (hidden).
        bounds = loop_bounds(mask.block_classes(sq, geo.bk))[:, 0, :]  # [B, 4]
        meta = jnp.concatenate([bounds, share_blocks(bounds, geo.n_splits, S)[:, None]], axis=1).astype(jnp.int32)
        kmask = mask.pad(sq, geo.skv_pad)
        mask_specs += [spec((None, geo.skv_pad), lambda s, b, i: (b, 0)),
                       spec((None, geo.skv_pad), lambda s, b, i: (b, 0))]
        mask_args += [kmask.kv_segment_ids, kmask.kv_positions]
    in_kernel = config.merge == "kernel"
    if block_table is None:
        kv_spec = lambda d: spec((None, geo.skv_pad, None, d), lambda s, b, i: (b, 0, i // nt, 0))
        paged_specs, paged_args = [], []
    else:
        kv_spec = lambda d: spec((k.shape[0], page_size, None, d), lambda s, b, i: (0, 0, i // nt, 0))
        paged_specs = [spec((None, block_table.shape[1]), lambda s, b, i: (b, 0))]
        paged_args = [block_table.astype(jnp.int32)]
    part_shapes = [jax.ShapeDtypeStruct((B, g, S, M, geo.dv_pad), jnp.float32),
                   jax.ShapeDtypeStruct((B, g, S, M), jnp.float32)]
    if in_kernel:  # whole partial arrays and counters, then the merged output (see _merge_last)
        whole = lambda shape: spec(shape, lambda s, b, i: (0,) * len(shape))
        count_shape = (B, g * nt)
        merge_specs = [whole(count_shape)]
        merge_args = [jnp.zeros(count_shape, jnp.int32)]
        out_specs = [whole(part_shapes[0].shape), whole(part_shapes[1].shape), whole(count_shape),
                     spec((None, None, bm, geo.dv_pad), lambda s, b, i: (b, i // nt, i % nt, 0)),
                     spec((None, None, bm), lambda s, b, i: (b, i // nt, i % nt))]
        out_shape = part_shapes + [jax.ShapeDtypeStruct(count_shape, jnp.int32),
                                   jax.ShapeDtypeStruct((B, g, M, geo.dv_pad), jnp.float32),
                                   jax.ShapeDtypeStruct((B, g, M), jnp.float32)]
        n_in = 1 + 3 + len(mask_args) + len(paged_args)  # meta, q, k, v, the mask rows, the table
        aliases = {n_in: 2}
    else:
        merge_specs, merge_args, aliases = [], [], {}
        out_specs = [
            spec((None, None, None, bm, geo.dv_pad), lambda s, b, i: (b, i // nt, s, i % nt, 0)),
            spec((None, None, None, bm), lambda s, b, i: (b, i // nt, s, i % nt)),
        ]
        out_shape = part_shapes
    qkv_specs = [spec((None, None, bm, geo.dqk_pad), lambda s, b, i: (b, i // nt, i % nt, 0)),
                 kv_spec(geo.dqk_pad), kv_spec(geo.dv_pad)]
    meta_spec = spec((None, meta.shape[1]), lambda s, b, i: (b, 0))
    outs = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, softcap=softcap, causal=mask.causal, window=mask.window,
                          bk=geo.bk, n_splits=S, page_size=page_size, merge_in_kernel=in_kernel, tiles=nt,
                          shares_last=config.shares_last,
                          interpret=bool(interpret), cache_keys=kv_lens is not None),
        grid=(B, g * nt, S) if config.shares_last else (S, B, g * nt),
        in_specs=[meta_spec] + qkv_specs + mask_specs + paged_specs + merge_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_params(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="te_flash_decode",
    )(meta, qp, k, v, *mask_args, *paged_args, *merge_args)
    o, lse = outs[3:] if in_kernel else _combine(*outs)  # [B, G, M, Dvp], [B, G, M]
    out = o[:, :, :geo.rows, :dv].reshape(B, g, sq, R, dv).transpose(0, 2, 1, 3, 4).reshape(B, sq, h, dv)
    lse = lse[:, :, :geo.rows].reshape(B, g, sq, R).transpose(0, 1, 3, 2).reshape(B, h, sq)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _decode(q, k, v, mask, kv_lens, scale, softcap, config, interpret):
    return _decode_impl(q, k, v, mask, scale=scale, softcap=softcap, config=config, interpret=interpret,
                        kv_lens=kv_lens)


def _decode_fwd(q, k, v, mask, kv_lens, scale, softcap, config, interpret):
    out, lse = _decode(q, k, v, mask, kv_lens, scale, softcap, config, interpret)
    return (out, lse), (q, k, v, mask, out, lse)


def _decode_bwd(scale, softcap, config, interpret, res, cts):
    q, k, v, mask, out, lse = res
    dout, dlse = cts
    if mask is None:  # every query sees every key
        mask = AttentionMask.full(q.shape[0], q.shape[1], k.shape[1])
    dq, dk, dv, _ = flash_attention_bwd(q, k, v, mask, None, out, lse, dout, dlse, scale=scale, softcap=softcap,
                                        interpret=interpret)
    return dq, dk, dv, None, None


_decode.defvjp(_decode_fwd, _decode_bwd)


def _check_qkv(where, q, k, v):
    """A ValueError naming the shapes seen and expected unless q, k, v are decode shapes the kernel takes."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] \
            or q.shape[3] != k.shape[3]:
        raise ValueError(f"{where}: expected q [B, Sq, H, Dqk], k [B, Skv, G, Dqk], v [B, Skv, G, Dv]; got "
                         f"q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    why = decode_reason(q.shape, k.shape, v.shape)
    if why is not None:
        raise ValueError(f"{where}: q{tuple(q.shape)} k{tuple(k.shape)}: {why}")


def flash_decode(q, k, v, mask: AttentionMask | None, *, scale: float, softcap: float | None = None,
                 config: DecodeConfig | None = None, interpret: bool | None = None):
    """Attention of a short query against a KV cache: (out [B, Sq, H, Dv], lse [B, H, Sq] f32).

    q [B, Sq, H, Dqk] (Sq <= MAX_QUERY_LEN), k [B, Skv, G, Dqk], v [B, Skv, G, Dv]; mask: an
    `AttentionMask` with [B, Sq] / [B, Skv] segment ids and positions (a cache filled to length n_b on
    row b: kv segment ids 1 on [0, n_b), 0 after; new tokens at positions n_b - Sq + t with causal=True),
    or None when every query sees every key (a whole cache, cross-attention): then the kernel makes the key rows
    from the cache length and the loop bounds come from it (as for a paged cache), so no [B, Skv] mask rows or
    block classes are computed around the kernel.
    Differentiable (the portable kernel's backward). Raises ValueError for shapes it does not take
    (`decode_reason`).
    """
    if mask is not None and not isinstance(mask, AttentionMask):
        raise TypeError(f"flash_decode: mask must be a pallas_kernels.mask.AttentionMask or None, got "
                        f"{type(mask).__name__}")
    _check_qkv("flash_decode", q, k, v)
    if mask is not None and (mask.batch, mask.q_len, mask.kv_len) != (q.shape[0], q.shape[1], k.shape[1]):
        raise ValueError(f"flash_decode: mask arrays [{mask.batch}, {mask.q_len}] / [{mask.batch}, {mask.kv_len}] do "
                         f"not match q{tuple(q.shape)} k{tuple(k.shape)}: expected [{q.shape[0]}, {q.shape[1]}] / "
                         f"[{q.shape[0]}, {k.shape[1]}]")
    return _decode(q, k, v, mask, None, float(scale), None if softcap is None else float(softcap),
                   config or DecodeConfig(), default_interpret() if interpret is None else bool(interpret))


def flash_decode_cache(q, k, v, kv_lens, *, scale: float, softcap: float | None = None, causal: bool = True,
                       window=(-1, -1), q_positions=None, q_valid=None, config: DecodeConfig | None = None,
                       interpret: bool | None = None):
    """Decode against a contiguous cache filled to per-row lengths: (out [B, Sq, H, Dv], lse [B, H, Sq] f32).

    q [B, Sq, H, Dqk] (Sq <= MAX_QUERY_LEN), k [B, Skv, G, Dqk], v [B, Skv, G, Dv]; kv_lens [B] int: row b holds
    keys [0, kv_lens[b]) (blocks past the length are never read; keys past it in the last block read are hidden, and
    must be finite, since their zero weights multiply them). q_positions [B, Sq] int: each query's
    position in the keys' frame (key j is at position j); default kv_lens - Sq + t, i.e. this call's tokens are the
    last Sq of the cache. q_valid [B, Sq] bool: False marks padding queries (out 0, lse -inf). causal / window:
    as `flash_decode`'s mask (a query at position p sees keys j <= p under causal).
    The kernel makes each key's segment and position from its index and the row's length, so no [B, Skv] mask
    rows are built or read (as `flash_decode(mask=None)` and `flash_decode_paged`). Differentiable (the portable
    kernel's backward, under the equivalent `paged_cache_mask`).
    """
    _check_qkv("flash_decode_cache", q, k, v)
    B, sq = q.shape[:2]
    if jnp.shape(kv_lens) != (B,):
        raise ValueError(f"flash_decode_cache: kv_lens has shape {jnp.shape(kv_lens)}, expected [batch] = ({B},)")
    for name, x in (("q_positions", q_positions), ("q_valid", q_valid)):
        if x is not None and jnp.shape(x) != (B, sq):
            raise ValueError(f"flash_decode_cache: {name} has shape {jnp.shape(x)}, expected [batch, q_len] = "
                             f"({B}, {sq})")
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    mask = paged_cache_mask(kv_lens, sq, k.shape[1], q_valid=q_valid, causal=causal, window=tuple(window),
                            q_positions=q_positions)
    return _decode(q, k, v, mask, kv_lens, float(scale), None if softcap is None else float(softcap),
                   config or DecodeConfig(), default_interpret() if interpret is None else bool(interpret))


def paged_cache_mask(kv_lens, q_len: int, max_keys: int, *, q_valid=None, causal: bool = True,
                     window=(-1, -1), q_positions=None) -> AttentionMask:
    """The AttentionMask of a cache holding kv_lens[b] keys on row b (key j: segment 1 below the length, else 0;
    position j) whose last q_len are this call's queries (query t at position kv_lens[b] - q_len + t, or
    q_positions [B, q_len] in the keys' frame; q_valid [B, q_len] False marks padding queries)."""
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    B = kv_lens.shape[0]
    idx = jnp.arange(max_keys, dtype=jnp.int32)
    q_seg = jnp.ones((B, q_len), jnp.int32) if q_valid is None else jnp.asarray(q_valid).astype(jnp.int32)
    if q_positions is None:
        q_positions = kv_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None]
    return AttentionMask(q_seg, jnp.asarray(q_positions, jnp.int32),
                         (idx[None] < kv_lens[:, None]).astype(jnp.int32), jnp.broadcast_to(idx, (B, max_keys)),
                         causal=causal, window=window)


def paged_reason(q_shape, k_pages_shape, v_pages_shape, block_table_shape) -> str | None:
    """None when flash_decode_paged takes these shapes, else why not."""
    if len(q_shape) != 4 or len(k_pages_shape) != 4 or len(v_pages_shape) != 4 or len(block_table_shape) != 2:
        return "expected q [B, Sq, H, Dqk], pages [P, page_size, G, D] and block_table [B, max_pages]"
    B, sq, h, dqk = q_shape
    P, page, g, dk = k_pages_shape
    if dk != dqk:
        return (f"k_pages has shape {tuple(k_pages_shape)}; expected [num_pages, page_size, kv_heads, {dqk}] (q's "
                f"head_dim, q {tuple(q_shape)})")
    if tuple(v_pages_shape[:3]) != (P, page, g):
        return (f"v_pages has shape {tuple(v_pages_shape)}; expected [{P}, {page}, {g}, head_dim_v] (k_pages' "
                f"{tuple(k_pages_shape[:3])})")
    if block_table_shape[0] != B:
        return f"block_table has {block_table_shape[0]} rows, q has batch {B}"
    if page % 16:
        return f"page_size {page} is not a multiple of 16 (a key block never crosses a page)"
    return decode_reason(q_shape, (B, block_table_shape[1] * page, g, dqk), (B, block_table_shape[1] * page, g,
                                                                            v_pages_shape[3]))


def flash_decode_paged(q, k_pages, v_pages, block_table, kv_lens, *, scale: float, softcap: float | None = None,
                       causal: bool = True, window=(-1, -1), q_valid=None, config: DecodeConfig | None = None,
                       interpret: bool | None = None):
    """Decode against a paged KV cache (forward only): (out [B, Sq, H, Dv], lse [B, H, Sq] f32).

    q [B, Sq, H, Dqk] (Sq <= MAX_QUERY_LEN); k_pages [P, page_size, G, Dqk], v_pages [P, page_size, G, Dv]: a pool
    of pages shared by the batch; block_table [B, max_pages] int: row b's logical page i is pool page
    block_table[b, i]; kv_lens [B] int: keys cached on row b, this call's Sq tokens included (the last Sq of
    them). Only the pages holding a row's first kv_lens[b] keys are read, so table entries past them may be
    anything; entries outside [0, P) are clamped. causal / window: the new tokens see the cache up to their own
    position (bottom-right), within the window. q_valid [B, Sq] bool marks real queries (padding rows give 0).
    """
    why = paged_reason(q.shape, k_pages.shape, v_pages.shape, block_table.shape)
    if why is not None:
        raise ValueError(f"flash_decode_paged: {why}")
    if jnp.shape(kv_lens) != (q.shape[0],):
        raise ValueError(f"flash_decode_paged: kv_lens has shape {jnp.shape(kv_lens)}, expected [batch] = "
                         f"({q.shape[0]},)")
    if q_valid is not None and jnp.shape(q_valid) != tuple(q.shape[:2]):
        raise ValueError(f"flash_decode_paged: q_valid has shape {jnp.shape(q_valid)}, expected [batch, q_len] = "
                         f"{tuple(q.shape[:2])}")
    mask = paged_cache_mask(kv_lens, q.shape[1], block_table.shape[1] * k_pages.shape[1], q_valid=q_valid,
                            causal=causal, window=window)
    table = jnp.clip(jnp.asarray(block_table, jnp.int32), 0, k_pages.shape[0] - 1)
    return _decode_impl(q, k_pages, v_pages, mask, table, scale=float(scale),
                        softcap=None if softcap is None else float(softcap), config=config or DecodeConfig(),
                        interpret=default_interpret() if interpret is None else bool(interpret),
                        kv_lens=jnp.asarray(kv_lens, jnp.int32))
