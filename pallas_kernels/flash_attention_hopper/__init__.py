"""Hopper (sm90) flash attention: Pallas Mosaic GPU kernels (wgmma, TMA, warp specialisation).

    hopper_attention(q, k, v, *, scale, causal=False, softcap=None, config=None) -> (out, lse)
        q/k [B,Sq,H,D] / [B,Skv,G,D], v [B,Skv,G,Dv] (H % G == 0), bf16/fp16, D and Dv multiples of 16 up to 256
        (they may differ, e.g. DeepSeek-V3's 192/128: not the persistent forwards); any lengths >= 1 (causal:
        Sq == Skv): a length that is not a multiple of 128 is padded with zeros up to one (a copy of the
        operands) and the padded keys are masked in the kernels (causal: by the diagonal itself);
        out [B,S,H,Dv] (q.dtype), lse [B,H,S] float32 (natural log).  Differentiable.
        softcap t > 0: logits t * tanh(scale * q.k / t) (Gemma 2's), its derivative in the backward.
        mask (pallas_kernels.mask.AttentionMask [B, Sq] / [B, Skv], causal=False): any mask as data (padding,
        documents, causal top-left or bottom-right, windows, explicit positions); Sq and Skv may differ.  The
        kernels skip the tiles the mask empties and apply it only where a tile is partly visible; rows that see no
        key give out 0, lse -inf, and zero gradients.
    hopper_attention_fwd(q, k, v, *, scale, causal, softcap, config) -> (out, lse)
    hopper_attention_bwd(q, k, v, out, lse, dout, *, scale, causal, softcap, config, dlse=None) -> (dq, dk, dv)
        (block entry points, e.g. for ring attention: lengths must be multiples of 128; `lengths_reason`)
    supports(q_shape, k_shape, v_shape, dtype, causal, ...) -> None or the reason it cannot serve
        (shapes, dtype, features; the device and jax version are checked by te_jax's dispatcher).

Mosaic GPU is imported lazily; this package imports on any machine.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from .band import band_forward_chosen
from .backward import flash_bwd
from .config import HopperConfig, check_lengths, default_config, describe_plan
from ..mask import AttentionMask
from .aligned_tiles import aligned_mask_tables
from .data_mask import mask_rule, mask_tables
from .forward import flash_fwd
from .reference import attention_reference

__all__ = [
    "HopperConfig",
    "default_config",
    "describe_plan",
    "hopper_attention",
    "hopper_attention_bwd",
    "hopper_attention_fwd",
    "lengths_reason",
    "supports",
    "attention_reference",
    "BLOCK",
    "compares_segments",
    "masked_config",
    "HEAD_DIMS",
]

HEAD_DIMS = tuple(range(16, 257, 16))  # multiples of 16 up to 256 (64/128/192/256 use 128-byte swizzled tiles)
BLOCK = 128  # the kernels' lengths are multiples of this (hopper_attention pads ragged ones up to it)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def masked_config(head_dim: int, head_dim_v: int, q_len: int, kv_len: int) -> HopperConfig:
    """The config hopper_attention(mask=...) runs when given none: default_config on the lengths padded to whole
    blocks, for a masked call (te_jax's explanation reads the same)."""
    pq, pkv = -(-q_len // BLOCK) * BLOCK, -(-kv_len // BLOCK) * BLOCK
    return default_config(head_dim, pkv, False, pq, head_dim_v=head_dim_v, masked=True)


def _positive_finite(x) -> bool:
    """A real number (Python or numpy) in (0, inf)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and 0 < float(x) < float("inf")


def supports(q_shape, k_shape, v_shape, dtype, causal: bool = False, *, window=None,
             segment_ids=None, bias=None, softcap=None, dropout_rate: float = 0.0) -> str | None:
    """None when `hopper_attention` can serve this call, else the reason (for the dispatcher).

    Shapes, dtype and features only: whether this process can run the kernel (an sm90 GPU,
    jax >= 0.11) is the dispatcher's question (te_jax/backends/pallas.py, `hopper_device_reason`).
    """
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return "q, k and v must be 4-D [batch, seq, heads, head_dim] (BSHD)"
    if window is not None and tuple(window) not in ((-1, -1), (None, None)):
        return "sliding windows are not supported by the Hopper kernel"
    if segment_ids is not None:
        return "segment ids / padding masks are not supported by the Hopper kernel"
    if bias is not None:
        return "attention bias is not supported by the Hopper kernel"
    if softcap is not None and not _positive_finite(softcap):
        return f"softcap={softcap!r} must be a finite positive number (or None)"
    if dropout_rate:
        return "dropout is not supported by the Hopper kernel"
    dt = jnp.dtype(dtype)
    if dt not in _DTYPES:
        return f"dtype {dt.name} not in {{bfloat16, float16}}"
    b, sq, h, d = q_shape
    bk, skv, g, dk = k_shape
    if tuple(v_shape[:3]) != (bk, skv, g):
        return f"v shape {tuple(v_shape)} does not match k shape {tuple(k_shape)}"
    if dk != d:
        return f"head_dim of q ({d}) and k ({dk}) differ"
    if bk != b:
        return f"batch of q ({b}) and k/v ({bk}) differ"
    for label, x, shape in (("head_dim", d, q_shape), ("v head_dim", v_shape[3], v_shape)):
        if x not in HEAD_DIMS:
            return (f"{label} {x} is not a multiple of 16 from 16 to 256 ({'q' if shape is q_shape else 'v'} "
                    f"{tuple(shape)}, expected [batch, seq, heads, 16..256 in steps of 16]; pad the head dim with "
                    f"zeros to the next multiple of 16 and pass scale explicitly)")
    if g == 0 or h % g:
        return f"query heads {h} not a multiple of kv heads {g}"
    for name, s in (("sequence length", sq), ("kv sequence length", skv)):
        if s < 1:
            return f"{name} {s} is empty"
    if causal and sq != skv:
        return f"causal needs equal query and kv lengths (got {sq} and {skv})"
    return None


def lengths_reason(q_len: int, kv_len: int) -> str | None:
    """Why the block entry points (hopper_attention_fwd / _bwd) cannot take these lengths (None: they can)."""
    for name, s in (("sequence length", q_len), ("kv sequence length", kv_len)):
        if s % BLOCK:
            return (f"{name} {s} is not a multiple of the block size {BLOCK} (the block entry points do not pad; "
                    f"hopper_attention does)")
    return None


def _check(q, k, v, causal, softcap=None, whole_blocks=False):
    reason = supports(q.shape, k.shape, v.shape, q.dtype, causal, softcap=softcap)
    if reason is None and whole_blocks:
        reason = lengths_reason(q.shape[1], k.shape[1])
    if reason is not None:
        raise ValueError(f"hopper_attention: {reason}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"hopper_attention: q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")


def _softcap(softcap):
    return None if softcap is None else float(softcap)


def hopper_attention_fwd(q, k, v, *, scale: float, causal: bool = False, config=None,
                         interpret: bool | None = None, softcap: float | None = None):
    """Forward only: (out [B,S,H,D], lse [B,H,S] float32)."""
    _check(q, k, v, causal, softcap, whole_blocks=True)
    return flash_fwd(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret,
                     softcap=_softcap(softcap))


def hopper_attention_bwd(q, k, v, out, lse, dout, *, scale: float, causal: bool = False,
                         config=None, dlse=None, interpret: bool | None = None, softcap: float | None = None):
    """Backward only: (dq, dk, dv) from the forward's out and lse (and optional dlse)."""
    _check(q, k, v, causal, softcap, whole_blocks=True)
    return flash_bwd(q, k, v, out, lse, dout, scale=scale, causal=causal, config=config,
                     dlse=dlse, interpret=interpret, softcap=_softcap(softcap))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _attention(q, k, v, scale, causal, config, interpret, softcap, kv_valid):
    return flash_fwd(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret, softcap=softcap,
                     kv_valid=kv_valid)


def _attention_fwd_rule(q, k, v, scale, causal, config, interpret, softcap, kv_valid):
    out, lse = flash_fwd(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret, softcap=softcap,
                         kv_valid=kv_valid)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd_rule(scale, causal, config, interpret, softcap, kv_valid, res, cts):
    q, k, v, out, lse = res
    dout, dlse = cts
    dq, dk, dv = flash_bwd(q, k, v, out, lse, dout.astype(q.dtype), scale=scale, causal=causal,
                           config=config, dlse=dlse, interpret=interpret, softcap=softcap, kv_valid=kv_valid)
    return dq, dk, dv


def _pad_seq(x, n):
    """x [B, S, ...] zero-padded along S to n (a differentiable copy: its transpose slices the gradient)."""
    if x.shape[1] == n:
        return x
    return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


_attention.defvjp(_attention_fwd_rule, _attention_bwd_rule)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _masked_attention(q, k, v, tables, scale, config, interpret, softcap, rule):
    return flash_fwd(q, k, v, scale=scale, causal=False, config=config, interpret=interpret, softcap=softcap,
                     mask_tables=tables, mask_rule=rule)


def _masked_fwd_rule(q, k, v, tables, scale, config, interpret, softcap, rule):
    out, lse = _masked_attention(q, k, v, tables, scale, config, interpret, softcap, rule)
    return (out, lse), (q, k, v, out, lse, tables)


def _masked_bwd_rule(scale, config, interpret, softcap, rule, res, cts):
    q, k, v, out, lse, tables = res
    dout, dlse = cts
    by_band = dict(band=rule.band()) if rule.offset is not None else dict(mask_tables=tables, mask_rule=rule)
    dq, dk, dv = flash_bwd(q, k, v, out, lse, dout.astype(q.dtype), scale=scale, causal=False, config=config,
                           dlse=dlse, interpret=interpret, softcap=softcap, **by_band)
    return dq, dk, dv, None


_masked_attention.defvjp(_masked_fwd_rule, _masked_bwd_rule)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _band_attention(q, k, v, scale, config, interpret, softcap, band):
    return flash_fwd(q, k, v, scale=scale, causal=False, config=config, interpret=interpret, softcap=softcap,
                     band=band)


def _band_fwd_rule(q, k, v, scale, config, interpret, softcap, band):
    out, lse = _band_attention(q, k, v, scale, config, interpret, softcap, band)
    return (out, lse), (q, k, v, out, lse)


def _band_bwd_rule(scale, config, interpret, softcap, band, res, cts):
    q, k, v, out, lse = res
    dout, dlse = cts
    return flash_bwd(q, k, v, out, lse, dout.astype(q.dtype), scale=scale, causal=False, config=config, dlse=dlse,
                     interpret=interpret, softcap=softcap, band=band)


_band_attention.defvjp(_band_fwd_rule, _band_bwd_rule)


def compares_segments(mask_segments: bool, q_len: int, kv_len: int) -> bool:
    """Whether the data-mask kernels compare segment ids: asked (mask_segments), or lengths padded to whole tiles
    (the padded tokens are told apart by their segment)."""
    return bool(mask_segments or q_len % BLOCK or kv_len % BLOCK)


def _hopper_masked(q, k, v, mask, *, scale, config, interpret, softcap, segments=True, aligned=False, offset=None):
    if not isinstance(mask, AttentionMask):
        raise ValueError(f"hopper_attention: mask={type(mask).__name__} must be a pallas_kernels.mask.AttentionMask "
                         f"(segment ids and positions [batch, length]; AttentionMask.from_segments / .full build one).")
    _check(q, k, v, False, softcap)
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    want = (b, sq, skv)
    if (mask.batch, mask.q_len, mask.kv_len) != want:
        raise ValueError(f"hopper_attention: mask is for [batch, q_len, kv_len] = {[mask.batch, mask.q_len, mask.kv_len]}"
                         f", q/k are {list(want)}. Fix: build the AttentionMask from these q/k lengths.")
    pq, pkv = -(-sq // BLOCK) * BLOCK, -(-skv // BLOCK) * BLOCK
    cfg = config or masked_config(q.shape[-1], v.shape[-1], sq, skv)
    check_lengths(cfg, pq, pkv)
    padded = mask.pad(pq, pkv)  # padded tokens: segment 0, seen by no query and seeing nothing
    segments = compares_segments(segments, sq, skv)
    offset = None if segments else offset  # padded to whole tiles: the padded tokens need their segment ids
    rule = mask_rule(padded, segments, offset=offset)
    if offset is not None and band_forward_chosen(rule.band(), sq, skv):  # the band kernels: no pre-pass, no tables
        return _band_attention(q, k, v, float(scale), cfg, interpret, _softcap(softcap), rule.band())
    # the backward adds its lists (flash_bwd)
    tables = (aligned_mask_tables if aligned else mask_tables)(padded, cfg, backward=False, segments=segments)
    out, lse = _masked_attention(_pad_seq(q, pq), _pad_seq(k, pkv), _pad_seq(v, pkv), tables, float(scale), cfg,
                                 interpret, _softcap(softcap), rule)  # a rule with an offset: the band backward
    if pq != sq:
        out, lse = out[:, :sq], lse[:, :, :sq]
    return out, lse


def hopper_attention(q, k, v, *, scale: float, causal: bool = False, config=None,
                     interpret: bool | None = None, softcap: float | None = None, mask=None,
                     mask_segments: bool = True, mask_aligned: bool = False, mask_offset: int | None = None):
    """Flash attention on Hopper: (out, lse).  Differentiable (custom_vjp) in q, k, v.

    mask: a pallas_kernels.mask.AttentionMask (the data-mask kernels). mask_segments=False: the caller knows that
    every query and key of the mask is in one segment (no padding, no documents; windows, bottom-right or
    position-based causal only), so the element mask compares positions only. It is ignored where the lengths are
    padded to whole tiles (the padded tokens are told apart by their segment). A mask with several segments under
    mask_segments=False gives wrong results. mask_aligned=True: the forward's query tiles and key blocks start at
    every run of equal segment ids (aligned_tiles: packed documents compute a tenth of the pairs outside the
    visible area instead of a quarter), its output gathered back to token order; any mask, best with documents.
    mask_offset (with mask_segments=False): the caller knows that the mask's positions are token indices, query i
    at i + mask_offset relative to key j at j (AttentionMask.full: 0 top-left, kv_len - q_len bottom-right), so
    the visible pairs form a band of key - query index differences (data_mask.MaskRule.band) and the kernels walk
    it as the plain causal ones walk their triangle: no pre-pass or tables, the edges masked from iotas, dQ in the
    dK/dV kernel for wide bands (band.ATOMIC_DQ_MIN_BAND). Like mask_segments=False it is ignored where the lengths
    are padded to whole tiles, and a mask whose positions are not these gives wrong results."""
    if mask is not None:
        if causal:
            raise ValueError("hopper_attention: pass causal in the mask (AttentionMask(causal=True)), not both")
        if mask_offset is not None and (mask_segments or mask_aligned or isinstance(mask_offset, bool)
                                        or not isinstance(mask_offset, int)):
            raise ValueError(f"hopper_attention: mask_offset={mask_offset!r} must be an int, with "
                             f"mask_segments=False and mask_aligned=False (got {mask_segments}, {mask_aligned}). "
                             f"Fix: pass mask_segments=False for a one-segment mask, or mask_offset=None.")
        return _hopper_masked(q, k, v, mask, scale=scale, config=config, interpret=interpret, softcap=softcap,
                              segments=mask_segments, aligned=mask_aligned, offset=mask_offset)
    if mask_aligned or not mask_segments or mask_offset is not None:
        raise ValueError(f"hopper_attention: mask_aligned={mask_aligned}, mask_segments={mask_segments}, "
                         f"mask_offset={mask_offset} apply to a data mask, and mask=None. Fix: pass "
                         f"mask=AttentionMask(...), or leave them at their defaults (False, True, None).")
    _check(q, k, v, causal, softcap)
    sq, skv = q.shape[1], k.shape[1]
    pq, pkv = -(-sq // BLOCK) * BLOCK, -(-skv // BLOCK) * BLOCK
    if config is not None:  # the backward's blocks too: fail before the forward runs
        check_lengths(config, pq, pkv)
    # Ragged lengths: zeros up to whole blocks. Causal (Sq == Skv): a padded key sits right of every real query's
    # diagonal, so the causal mask hides it; otherwise the kernels mask keys from kv_valid on. Padded query rows
    # are computed and dropped (their output cotangent is zero, so they add nothing to dk / dv).
    kv_valid = None if (causal or pkv == skv) else skv
    if config is not None and kv_valid is not None and pkv - skv >= config.block_kv:
        # A forward key block of padding alone can be a whole stream-K piece of the persistent forward: its row
        # max stays -inf and the piece's lse is NaN. Blocks of 128 keys or more always hold a real key.
        raise ValueError(
            f"hopper_attention: HopperConfig.block_kv={config.block_kv} with kv_len {skv} (padded to {pkv}): a key "
            f"block would hold only padding. Fix: block_kv >= {pkv - skv + 1} (e.g. 128), a kv_len that is a "
            f"multiple of {BLOCK}, or config=None.")
    out, lse = _attention(_pad_seq(q, pq), _pad_seq(k, pkv), _pad_seq(v, pkv), float(scale), bool(causal), config,
                          interpret, _softcap(softcap), kv_valid)
    if pq != sq:
        out, lse = out[:, :sq], lse[:, :, :sq]
    return out, lse
