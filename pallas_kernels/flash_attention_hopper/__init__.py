"""Hopper (sm90) flash attention: Pallas Mosaic GPU kernels (wgmma, TMA, warp specialisation).

    hopper_attention(q, k, v, *, scale, causal=False, softcap=None, config=None) -> (out, lse)
        q [B,S,H,D], k/v [B,S,G,D] (H % G == 0), bf16/fp16, D in {64,128,256};
        out [B,S,H,D] (q.dtype), lse [B,H,S] float32 (natural log).  Differentiable.
        softcap t > 0: logits t * tanh(scale * q.k / t) (Gemma 2's), its derivative in the backward.
    hopper_attention_fwd(q, k, v, *, scale, causal, softcap, config) -> (out, lse)
    hopper_attention_bwd(q, k, v, out, lse, dout, *, scale, causal, softcap, config, dlse=None) -> (dq, dk, dv)
    supports(q_shape, k_shape, v_shape, dtype, causal, ...) -> None or the reason it cannot serve
        (shapes, dtype, features; the device and jax version are checked by te_jax's dispatcher).

Mosaic GPU is imported lazily; this package imports on any machine.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .backward import flash_bwd
from .config import HopperConfig, check_lengths, default_config, describe_plan
from .forward import flash_fwd
from .reference import attention_reference

__all__ = [
    "HopperConfig",
    "default_config",
    "describe_plan",
    "hopper_attention",
    "hopper_attention_bwd",
    "hopper_attention_fwd",
    "supports",
    "attention_reference",
    "BLOCK",
    "HEAD_DIMS",
]

HEAD_DIMS = (64, 128, 256)
BLOCK = 128  # every sequence length must be a multiple of this
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        return f"softcap={softcap!r} must be a positive number (or None)"
    if dropout_rate:
        return "dropout is not supported by the Hopper kernel"
    dt = jnp.dtype(dtype)
    if dt not in _DTYPES:
        return f"dtype {dt.name} not in {{bfloat16, float16}}"
    b, sq, h, d = q_shape
    bk, skv, g, dk = k_shape
    if tuple(v_shape[:3]) != (bk, skv, g):
        return f"v shape {tuple(v_shape)} does not match k shape {tuple(k_shape)}"
    if v_shape[3] != dk or dk != d:
        return f"head_dim of q/k ({d}/{dk}) and v ({v_shape[3]}) differ"
    if bk != b:
        return f"batch of q ({b}) and k/v ({bk}) differ"
    if d not in HEAD_DIMS:
        return f"head_dim {d} not in {{64,128,256}}"
    if g == 0 or h % g:
        return f"query heads {h} not a multiple of kv heads {g}"
    for name, s in (("sequence length", sq), ("kv sequence length", skv)):
        if s % BLOCK:
            return f"{name} {s} is not a multiple of the block size {BLOCK}"
    if causal and sq != skv:
        return f"causal needs equal query and kv lengths (got {sq} and {skv})"
    return None


def _check(q, k, v, causal, softcap=None):
    reason = supports(q.shape, k.shape, v.shape, q.dtype, causal, softcap=softcap)
    if reason is not None:
        raise ValueError(f"hopper_attention: {reason}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"hopper_attention: q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")


def _softcap(softcap):
    return None if softcap is None else float(softcap)


def hopper_attention_fwd(q, k, v, *, scale: float, causal: bool = False, config=None,
                         interpret: bool | None = None, softcap: float | None = None):
    """Forward only: (out [B,S,H,D], lse [B,H,S] float32)."""
    _check(q, k, v, causal, softcap)
    return flash_fwd(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret,
                     softcap=_softcap(softcap))


def hopper_attention_bwd(q, k, v, out, lse, dout, *, scale: float, causal: bool = False,
                         config=None, dlse=None, interpret: bool | None = None, softcap: float | None = None):
    """Backward only: (dq, dk, dv) from the forward's out and lse (and optional dlse)."""
    _check(q, k, v, causal, softcap)
    return flash_bwd(q, k, v, out, lse, dout, scale=scale, causal=causal, config=config,
                     dlse=dlse, interpret=interpret, softcap=_softcap(softcap))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _attention(q, k, v, scale, causal, config, interpret, softcap):
    return flash_fwd(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret, softcap=softcap)


def _attention_fwd_rule(q, k, v, scale, causal, config, interpret, softcap):
    out, lse = flash_fwd(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret, softcap=softcap)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd_rule(scale, causal, config, interpret, softcap, res, cts):
    q, k, v, out, lse = res
    dout, dlse = cts
    dq, dk, dv = flash_bwd(q, k, v, out, lse, dout.astype(q.dtype), scale=scale, causal=causal,
                           config=config, dlse=dlse, interpret=interpret, softcap=softcap)
    return dq, dk, dv


_attention.defvjp(_attention_fwd_rule, _attention_bwd_rule)


def hopper_attention(q, k, v, *, scale: float, causal: bool = False, config=None,
                     interpret: bool | None = None, softcap: float | None = None):
    """Flash attention on Hopper: (out, lse).  Differentiable (custom_vjp) in q, k, v."""
    _check(q, k, v, causal, softcap)
    if config is not None:  # the backward's blocks too: fail before the forward runs
        check_lengths(config, q.shape[1], k.shape[1])
    return _attention(q, k, v, float(scale), bool(causal), config, interpret, _softcap(softcap))
