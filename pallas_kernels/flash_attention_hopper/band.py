"""Band masks for the Hopper kernels: one segment with token-index positions (data_mask.MaskRule.offset), so key j
is visible to query i iff lo <= j - i - offset <= hi (MaskRule.band(): windows, causal top-left or bottom-right,
any lengths).  A tile walks the blocks of its band with no tables: band_walk gives its first block, its masked edges
and its full middle; band_mask hides the pairs outside the band from iotas.  Pure index arithmetic on traced int32
scalars and tiles: it runs inside the Mosaic GPU kernels and on the CPU alike.

    band_walk(w_min, w_max, full_min, full_max, block, n_blocks, big) -> (first, steps, full_lo, full_hi)
    key_blocks(band, q0, q1, ...) / query_blocks(band, k0, k1, ...)   band_walk for a query tile / a key tile
    heavier_tiles_last(band, q_len, kv_len, rows, block)              launch the grid forward's tiles in reverse?
    walk_band(body, full_lo, full_hi, steps, carry)                    a tile's masked, full, masked loops
    band_mask(x, key_minus_query, c, band, fill)                       -> x outside the band set to fill
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _floor_div(x, d: int, big: int):
    """floor(x / d) for a traced int32 x >= -big * d (lax.div truncates toward zero)."""
    return lax.div(x + big * d, jnp.int32(d)) - big


def _ceil_div(x, d: int, big: int):
    """ceil(x / d) for a traced int32 x >= -big * d, without negation: lax.neg has no lowering in the Mosaic GPU
    warp-level code (a single producer warp) of jax 0.11."""
    return _floor_div(x + (d - 1), d, big)


def band_walk(w_min, w_max, full_min, full_max, block: int, n_blocks: int, big: int):
    """A CTA's walk over the blocks of one axis under a band mask (MaskRule.band): the blocks holding an index in
    [w_min, w_max] (None: unbounded), of which those whose first index lies in [full_min, full_max] are full.
    Returns (first block, steps, full_lo, full_hi) with steps [0, full_lo) and [full_hi, steps) masked and
    [full_lo, full_hi) full (traced int32; big: |every bound| <= big * block)."""
    first = jnp.int32(0) if w_min is None else jnp.clip(_floor_div(w_min, block, big), 0, n_blocks)
    end = jnp.int32(n_blocks) if w_max is None else jnp.clip(_floor_div(w_max, block, big) + 1, first, n_blocks)
    f_lo = first if full_min is None else jnp.clip(_ceil_div(full_min, block, big), first, end)
    f_hi = end if full_max is None else jnp.clip(_floor_div(full_max, block, big) + 1, f_lo, end)
    return first, end - first, f_lo - first, f_hi - first


def key_blocks(band, q0, q1, block: int, n_blocks: int, big: int):
    """band_walk over the key blocks of `block` keys for the queries [q0, q1) (the forward's and the dQ kernel's
    walk): keys in [q0 + off + lo, q1 - 1 + off + hi], full where every query of the tile sees every key."""
    off, lo, hi = band
    return band_walk(None if lo is None else q0 + off + lo, None if hi is None else q1 - 1 + off + hi,
                     None if lo is None else q1 - 1 + off + lo, None if hi is None else q0 + off + hi - block + 1,
                     block, n_blocks, big)


def query_blocks(band, k0, k1, block: int, n_blocks: int, big: int):
    """band_walk over the query blocks of `block` queries for the keys [k0, k1) (the dK/dV kernel's walk):
    queries in [k0 - off - hi, k1 - 1 - off - lo], full where every key of the tile is seen by every query."""
    off, lo, hi = band
    return band_walk(None if hi is None else k0 - off - hi, None if lo is None else k1 - 1 - off - lo,
                     None if hi is None else k1 - 1 - off - hi, None if lo is None else k0 - block + 1 - off - lo,
                     block, n_blocks, big)


def heavier_tiles_last(band, q_len: int, kv_len: int, rows: int, block: int) -> bool:
    """Whether the band's query tiles of `rows` queries walk more key blocks of `block` keys in the second half of
    the queries than in the first (causal-like bands: bottom-right, windows (W, 0), causal given as data).  The grid
    band forward then launches its tiles in reverse, heaviest first, as the causal kernel does, so that short tiles
    fill the last wave (static: evaluated on the host at trace time)."""
    n = q_len // rows
    starts = np.arange(n, dtype=np.int32) * rows
    with jax.ensure_compile_time_eval():  # constants: evaluated now, also inside a jit trace
        steps = np.asarray(key_blocks(band, jnp.asarray(starts), jnp.asarray(starts + rows), block, kv_len // block,
                                      band_big(band, q_len, kv_len))[1])
    return int(steps[n // 2:].sum()) > int(steps[:n - n // 2].sum())


def walk_band(body, full_lo, full_hi, steps, carry):
    """Run a tile's band walk (band_walk's counts): body(step, carry, masked) over [0, full_lo) masked, [full_lo,
    full_hi) full and [full_hi, steps) masked.  Every band kernel walks its tile this way."""
    carry = lax.fori_loop(0, full_lo, lambda s, c: body(s, c, True), carry)
    carry = lax.fori_loop(full_lo, full_hi, lambda s, c: body(s, c, False), carry)
    return lax.fori_loop(full_hi, steps, lambda s, c: body(s, c, True), carry)


def band_mask(x, key_minus_query, c, band, fill=0.0):
    """x [rows, cols] with the pairs outside the band set to `fill`: key_minus_query (key index - query index within
    the tile, an iota difference) - c is j - i - offset for the tile's pairs (c = q0 + offset - k0)."""
    _, lo, hi = band
    if lo is not None:
        x = jnp.where(key_minus_query >= c + lo, x, fill)
    if hi is not None:
        x = jnp.where(key_minus_query <= c + hi, x, fill)
    return x


#: The narrowest band (keys per query: hi - lo + 1; unbounded on one side counts as wide) whose backward takes the
#: atomic dQ in the dK/dV kernel where the plain kernels would (atomic_dq_chosen).  H100, hd128, B4 x 4k x 16 heads
#: (hopper_mask_probe --band-ab, attention_masks_h100.md): the backward with the atomic dQ against the dQ kernel was
#: 1.06x on causal given as data and 1.11x on causal bottom-right q 2k x kv 8k (unbounded), 0.99x on window (1024, 0)
#: and 0.94x on window (256, 256): short key-tile walks do not amortize the dQ buffer's zeroing and conversion.  With
#: delta computed in the dQ kernel (2026-11-27) bottom-right still reads 1.05-1.07x for the atomic dQ; a threshold of
#: 1024 made window (1024, 0)'s fwd+bwd read 331 TFLOP/s against 343 with the dQ kernel (attention_masks_h100.md).
ATOMIC_DQ_MIN_BAND = 2048


#: Which bands' forward runs on the persistent band kernel where the config leaves it to auto
#: (HopperConfig.fwd_persistent_band None): causal sliding windows (the band's right edge at or left of the diagonal)
#: of at least PERSISTENT_FWD_MIN_BAND keys per query, and two-sided windows of at most PERSISTENT_FWD_MAX_TWO_SIDED.
#: Its two warpgroups meet on the hardware named barrier for bands of NAMED_RENDEZVOUS_MIN_BAND keys or more, on
#: mbarriers below (HopperConfig.fwd_named_barrier None).  H100, hd128, B4 x 4k x 16 heads, the forward as a call
#: runs it (hopper_mask_probe --band-fwd-ab, attention_masks_h100.md, fifteenth session), us per call, against the
#: grid band kernel (tiles heaviest first):
#:   window (1024, 0): persistent 273 (named) / 285 (mbarriers), grid 298;  (512, 0): 185 / 187, grid 207;
#:   window (128, 128): persistent 187 (named) / 150 (mbarriers), grid 160;  (256, 256): 238 / 201, grid 206;
#:   window (512, 512): 364 / 331, grid 314;  bottom-right 2k x 8k: 869 / 873, grid 867;  causal as data: 536 / 529,
#:   grid 520.
#: Over walks of a few key blocks the named-barrier rendezvous costs the persistent kernel 15-20% (its steps 24%
#: slower than the grid kernel's in --kernel-trace); over long walks it gains 2-4%.
PERSISTENT_FWD_MIN_BAND = 512
PERSISTENT_FWD_MAX_TWO_SIDED = 513
NAMED_RENDEZVOUS_MIN_BAND = 1024


def band_keys(band) -> int | None:
    """Keys each query sees at most under the band (hi - lo + 1), None when unbounded on a side."""
    _, lo, hi = band
    return None if lo is None or hi is None else hi - lo + 1


def band_is_wide(band) -> bool:
    """Whether the band's backward takes the atomic dQ: at least ATOMIC_DQ_MIN_BAND keys per query, or unbounded."""
    keys = band_keys(band)
    return keys is None or keys >= ATOMIC_DQ_MIN_BAND


def persistent_forward_band(band) -> bool:
    """Whether auto runs the band's forward on the persistent kernel: a causal sliding window (bounded, its right
    edge at or left of the diagonal: hi <= 0) of at least PERSISTENT_FWD_MIN_BAND keys per query, or a two-sided
    window (hi > 0) of at most PERSISTENT_FWD_MAX_TWO_SIDED."""
    keys = band_keys(band)
    if keys is None:
        return False
    return keys >= PERSISTENT_FWD_MIN_BAND if band[2] <= 0 else keys <= PERSISTENT_FWD_MAX_TWO_SIDED


def named_rendezvous(band) -> bool:
    """Whether the persistent band forward's warpgroups meet on the hardware named barrier where the config leaves
    it to auto: bands of at least NAMED_RENDEZVOUS_MIN_BAND keys per query, or unbounded; mbarriers below."""
    keys = band_keys(band)
    return keys is None or keys >= NAMED_RENDEZVOUS_MIN_BAND


def band_big(band, *lengths) -> int:
    """band_walk's `big` for a band over these lengths: every bound it is given stays above -big * block for any
    block of 16 rows or more (and big * block stays far inside int32 for any length the kernels take)."""
    off, lo, hi = band
    return (sum(lengths) + abs(off) + abs(lo or 0) + abs(hi or 0)) // 16 + 4


#: Whether a band's forward runs the band grid kernel (no pre-pass, no tables; forward.flash_fwd(band=)) rather than
#: the data-mask forward on tables (whose windows take the persistent grid), per kind of band: "window" (bounded on
#: both sides) or "open" (causal, bottom-right, one-sided windows).  H100, hd128, B4 x 4k x 16 heads, the forward as
#: a call runs it (hopper_mask_probe --band-fwd-ab, attention_masks_h100.md): band against tables 0.99x on window
#: (1024, 0), 1.00x on window (256, 256), 1.11x on causal bottom-right q 2k x kv 8k, 1.04x on causal given as data.
BAND_FORWARD = {"window": True, "open": True}


def every_query_sees_a_key(band, q_len: int, kv_len: int) -> bool:
    """Whether every query row of [q_len] has a visible key in [0, kv_len) under the band (rows that see none: a
    bottom-right band with q_len > kv_len, or a window that slides off the keys)."""
    off, lo, hi = band
    return (hi is None or off + hi >= 0) and (lo is None or q_len - 1 + off + lo <= kv_len - 1)


def band_forward_chosen(band, q_len: int, kv_len: int) -> bool:
    """Whether hopper_attention runs this band's forward on the band kernel (BAND_FORWARD).  Bands that leave some
    query without a key keep the data-mask forward: the band forward's walks that come out empty have not run on a
    GPU (the band backward's have: gpu_tests_h100.md)."""
    _, lo, hi = band
    kind = "window" if lo is not None and hi is not None else "open"
    return BAND_FORWARD[kind] and every_query_sees_a_key(band, q_len, kv_len)
