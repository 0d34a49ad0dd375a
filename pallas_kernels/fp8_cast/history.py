"""Delayed scaling's amax-history update for several tensors in one launch (Triton-lowered Pallas).

    delayed_update_many(histories, scales, amaxes, fmaxes, *, margin=0, algo="max", interpret=None)
        histories  n arrays [L] fp32 (one L, at most MAX_HISTORY)
        scales     n fp32 scalars (or (1,)): the scales this step cast with
        amaxes     n fp32 scalars (or (1,)): this step's amax of each tensor
        fmaxes     n floats: each tensor's FP8 maximum (E4M3 448, E5M2 57344)
        -> (next scales: n arrays (1,) fp32, next histories: n arrays [L] fp32)

Per tensor, TransformerEngine's rule (te_jax.fp8.quantize.delayed_update, which this equals):
    a = amax if finite else 0;  h' = [a, h[1], ..., h[L-1]]
    window = max(h') ("max") or a ("most_recent")
    next scale = fmax / window / 2**margin where amax and window are finite and > 0 (and the result finite), else the
                 scale as it was
    next history = roll(h', -1) with slot 0 zeroed = [0, h[2], ..., h[L-1], a]

Why a kernel: as XLA ops each tensor's update is four or five kernels of a microsecond or two (the slot write, the
window's max, the scale's select, the roll's concatenate); a Llama layer's FP8 step had about 60 of them. Here one
program walks every tensor of a call site.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._compat import default_interpret, pl, pltriton, triton_params
from .._lower_once import lower_once
from .._shapes import next_pow2

#: The longest history the kernel takes (one program holds a whole history in registers); longer ones: the XLA ops.
MAX_HISTORY = 8192
ALGOS = ("max", "most_recent")


def _kernel(*refs, n, length, fmaxes, margin, most_recent):
    hists, scales, amaxes = refs[:n], refs[n:2 * n], refs[2 * n:3 * n]
    out_scales, out_hists = refs[3 * n:4 * n], refs[4 * n:]
    idx = jnp.arange(next_pow2(length))
    has_next = idx + 1 < length
    for i in range(n):
        a = amaxes[i][0]
        finite = jnp.abs(a) < jnp.inf  # False for inf and NaN
        rec = jnp.where(finite, a, 0.0)
        # h[j + 1] for j < L - 1: the history without its slot 0 (where this step's amax goes), shifted down one
        nxt = pltriton.load(hists[i].at[jnp.minimum(idx + 1, length - 1)], mask=has_next, other=0.0)
        window = rec if most_recent else jnp.maximum(rec, jnp.max(jnp.where(has_next, nxt, 0.0)))
        new_h = jnp.where(idx == 0, 0.0, jnp.where(idx == length - 1, rec, nxt))
        pltriton.store(out_hists[i].at[idx], new_h, mask=idx < length)
        safe = jnp.where(window > 0, window, 1.0)
        sf = (jnp.float32(fmaxes[i]) / safe) / jnp.float32(2.0 ** margin)
        ok = finite & (window > 0) & (jnp.abs(window) < jnp.inf) & (jnp.abs(sf) < jnp.inf)
        out_scales[i][0] = jnp.where(ok, sf, scales[i][0])


def _check(histories, scales, amaxes, fmaxes, margin, algo):
    where = "delayed_update_many"
    n = len(histories)
    if n == 0 or not (len(scales) == len(amaxes) == len(fmaxes) == n):
        raise ValueError(f"{where}: got {n} histories, {len(scales)} scales, {len(amaxes)} amaxes and {len(fmaxes)} "
                         "fmaxes; expected the same number (at least one) of each.")
    lengths = {tuple(h.shape) for h in histories}
    if len(lengths) != 1 or len(next(iter(lengths))) != 1:
        raise ValueError(f"{where}: histories have shapes {sorted(lengths)}; expected one shape [L] for all.")
    length = next(iter(lengths))[0]
    if not 1 <= length <= MAX_HISTORY:
        raise ValueError(f"{where}: history length {length} is outside [1, {MAX_HISTORY}]. Fix: update longer "
                         "histories with te_jax.fp8.quantize.delayed_update.")
    for name, xs in (("scales", scales), ("amaxes", amaxes)):
        for x in xs:
            if jnp.size(x) != 1:
                raise ValueError(f"{where}: {name} holds an array of shape {tuple(jnp.shape(x))}; expected scalars "
                                 "or (1,).")
    if algo not in ALGOS:
        raise ValueError(f"{where}: algo={algo!r}; expected one of {ALGOS}.")
    if margin < 0:
        raise ValueError(f"{where}: margin={margin} must be >= 0.")
    return length


@lower_once(static_argnames=("fmaxes", "margin", "algo", "interpret"))
def _update(histories, scales, amaxes, *, fmaxes, margin, algo, interpret):
    n, length = len(histories), histories[0].shape[0]
    vec = lambda x: jnp.asarray(x, jnp.float32).reshape(1)  # noqa: E731
    outs = pl.pallas_call(
        functools.partial(_kernel, n=n, length=length, fmaxes=fmaxes, margin=margin,
                          most_recent=algo == "most_recent"),
        out_shape=[jax.ShapeDtypeStruct((1,), jnp.float32)] * n + [jax.ShapeDtypeStruct((length,), jnp.float32)] * n,
        grid=(1,),
        compiler_params=triton_params(4 if length >= 1024 else 1, 1),
        interpret=interpret,
        name="fp8_delayed_update",
    )(*[h.astype(jnp.float32) for h in histories], *map(vec, scales), *map(vec, amaxes))
    return tuple(outs[:n]), tuple(outs[n:])


def delayed_update_many(histories, scales, amaxes, fmaxes, *, margin=0, algo="max", interpret=None):
    """See the module docstring: (next scales n x (1,), next histories n x [L]), fp32."""
    _check(histories, scales, amaxes, fmaxes, margin, algo)
    return _update(tuple(histories), tuple(scales), tuple(amaxes), fmaxes=tuple(float(f) for f in fmaxes),
                   margin=float(margin), algo=algo, interpret=default_interpret() if interpret is None else interpret)


__all__ = ["delayed_update_many", "MAX_HISTORY"]
