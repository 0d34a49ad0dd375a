"""The aligned forward's shared output groups summed into place (Triton-lowered Pallas), for
aligned_tiles.merge_shared_groups.

    merge_shared(out, shared, first, *, interpret=None) -> out
    merge_shared_many(outs, shareds, first, *, interpret=None) -> outs   (several arrays on the same tiles, one
                                          launch: the dK/dV kernel's dK and dV)
        out     [B, S, H, Dv]             the forward's output, token order, the shared groups not yet written
        shared  [B, n, G, H, Dv]          each slot's copy of a shared group of G = ROW_ALIGN rows (the rows of
                                          other runs are 0 in it)
        first   [B, n] int32              each slot's group's first token row in out, -1 for an unused slot; the
                                          used slots' rows never decrease along n (aligned_tiles.store_plan's order)
        -> out with each shared group = the sum of its slots' copies (out is updated in place: aliased)

Why a kernel: the slots are a static bound (two per aligned tile) and few are used (one per document start that is
not a multiple of G).  An XLA scatter over every slot read the whole side buffer (16 us on the H100 for thd's 320
slots).  Here a program per (slot, block of heads) reads its slot's row number and exits unless its slot leads its
group; the leader sums the copies that follow it (a group of G rows holds at most G runs: at most 2 G slots to look
at), loading only the slots of its group.  A block holds as many heads as divide H in a power of two, up to
MAX_BLOCK elements per copy, so few programs launch (one per (slot, head) took 13 us on 4 x 4k rows: 5120 programs,
most of them idle).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import default_interpret, pl, triton_params
from .._lower_once import lower_once


#: The most elements of one copy a program sums (G rows x its heads x Dv), so that its fp32 sum stays in registers.
MAX_BLOCK = 16384


def head_block(heads: int, g: int, head_dims) -> int:
    """Heads per program: the largest power of two dividing `heads` with g x it x max(head_dims) <= MAX_BLOCK (1 at
    least)."""
    hb = heads & -heads  # the largest power of two dividing heads
    while hb > 1 and g * hb * max(head_dims) > MAX_BLOCK:
        hb //= 2
    return hb


def _kernel(first_ref, *refs, n: int, g: int, window: int, count: int, hb: int):
    shared_refs, out_refs = refs[:count], refs[2 * count:]  # refs[count:2 count]: aliased with out_refs
    b, i = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(pl.multiple_of(pl.program_id(2) * hb, hb), hb)
    row = first_ref[b, i]
    earlier = [first_ref[b, jnp.maximum(i - k, 0)] for k in range(1, window + 1)]
    lead = row >= 0
    for k, r in enumerate(earlier, start=1):
        lead &= (i - k < 0) | (r != row)

    @pl.when(lead)
    def _():
        later = []
        for k in range(1, window + 1):
            j = jnp.minimum(i + k, n - 1)
            later.append((j, (i + k < n) & (first_ref[b, j] == row)))
        for shared_ref, out_ref in zip(shared_refs, out_refs):
            acc = shared_ref[b, i, :, heads, :].astype(jnp.float32)
            for j, same in later:  # a slot of another group is not loaded
                acc = lax.cond(same, lambda a, j=j, r=shared_ref: a + r[b, j, :, heads, :].astype(jnp.float32),
                               lambda a: a, acc)
            out_ref[b, pl.ds(row, g), heads, :] = acc.astype(out_ref.dtype)


@lower_once(static_argnames=("interpret",))
def _merge(outs, shareds, first, *, interpret):
    B, n, g, H, _ = shareds[0].shape
    count = len(outs)
    hb = head_block(H, g, [s.shape[-1] for s in shareds])
    return pl.pallas_call(
        functools.partial(_kernel, n=n, g=g, window=2 * g, count=count, hb=hb),
        out_shape=tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs),
        grid=(B, n, H // hb),
        input_output_aliases={1 + count + c: c for c in range(count)},
        compiler_params=triton_params(8 if g * hb * max(s.shape[-1] for s in shareds) >= 8192 else 4, 1),
        interpret=interpret,
        name="te_jax_attn_aligned_merge",
    )(first, *shareds, *outs)


def served(head_dim_v: int) -> bool:
    """Whether the kernel takes this v head_dim (Triton blocks are powers of two)."""
    return head_dim_v >= 16 and head_dim_v & (head_dim_v - 1) == 0


def merge_shared_many(outs, shareds, first, *, interpret=None):
    """merge_shared for several (out, shared) pairs on the same slots (same B, S, H; each its own Dv), in one
    launch; returns a tuple."""
    outs, shareds = tuple(outs), tuple(shareds)
    if not outs or len(outs) != len(shareds):
        raise ValueError(f"merge_shared_many: {len(outs)} outputs and {len(shareds)} side buffers: expected the "
                         f"same number, at least one.")
    B, S, H = outs[0].shape[:3]
    for out, shared in zip(outs, shareds):
        Dv = out.shape[-1]
        if (out.shape[:3] != (B, S, H) or shared.ndim != 5 or shared.shape[0] != B or shared.shape[3:] != (H, Dv)
                or first.shape != shared.shape[:2] or shared.shape[1:3] != shareds[0].shape[1:3]):
            raise ValueError(f"merge_shared: out {out.shape}, shared {shared.shape}, first {first.shape}: expected "
                             f"shared [B, n, G, H, Dv] and first [B, n] for out [B, S, H, Dv], every pair on the "
                             f"same B, S, H, n and G.")
        if not served(Dv):
            raise ValueError(f"merge_shared: v head_dim {Dv} is not a power of two (>= 16); use the XLA merge.")
    return _merge(outs, tuple(s.astype(o.dtype) for o, s in zip(outs, shareds)), first.astype(jnp.int32),
                  interpret=default_interpret() if interpret is None else interpret)


def merge_shared(out, shared, first, *, interpret=None):
    """See the module docstring."""
    return merge_shared_many((out,), (shared,), first, interpret=interpret)[0]
