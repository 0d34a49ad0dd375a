"""Context parallelism: attention over a sequence sharded across devices (ring and all-gather).

Every te_jax attention call masks through per-token arrays (`masks.TokenMask`: segment ids and
positions). Here each device keeps the GLOBAL segment ids and positions of its local tokens, and
K/V blocks travel (ring) or are gathered (all-gather) together with their kv segment ids and
positions. The mask of every block pair is therefore exact for every mask type, sliding window,
padding and for the zig-zag load-balancing reorder, with no special case anywhere.

Public functions:
  context_parallel_attention(query, key, value, *, cp_axis, ...)
  reorder_causal_load_balancing(x, cp_size, seq_axis) / inverse_reorder_causal_load_balancing(...)

Ring (`strategy="ring"`): each device keeps its query block; K/V (with kv segment ids/positions)
move one device along the ring per step with `lax.ppermute`, the next block being sent before the
current one is computed on. Partial results merge exactly through the logsumexp. Per step the
kernels' block classification (`pallas_kernels.mask.AttentionMask.block_classes` on the two local
blocks, one tile per block half; conservative: it may only compute too much, never too little)
picks one of: skip the step, the full block pair, the query block against the first half of the
K/V block, or the second half of the query block against the full K/V block. With the zig-zag
layout (device r holds chunks r and 2N-1-r) this reproduces the classic schedule: step 0 is the
causal diagonal, earlier K/V → all queries × first K/V half, later K/V → second query half × all
K/V, so every device does the same work per step. The backward (a
`jax.custom_vjp`) runs the same ring: dQ accumulates locally, dK/dV accumulators (fp32) travel
one step behind their K/V block and arrive home after a full turn; each step calls the inner
backend's `backward` with the final out/lse. Memory per device is O(local sequence).

Mask-free blocks: when the mask is causal or none on unpadded tokens (no window, softcap or
segments), every block pair is either the diagonal (step 0: causal in local order, which the zig-zag
layout keeps exact) or fully visible. Then the per-block calls need no token masks, and on sm90 the
`pallas` backend runs them on the Hopper kernel (`dense_forward` / `dense_backward`); the choice and
its reason are in `explain_context_parallel_backend(...).detail`.

All-gather (`strategy="all_gather"`): K/V and kv segment ids/positions are all-gathered once,
each device attends its queries to the whole sequence; the backward re-gathers K/V and
reduce-scatters dK/dV (`lax.psum_scatter`, fp32). Memory O(global sequence) for K/V.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.mask import EMPTY, AttentionMask
from te_jax import _compat, layouts, masks, sinks
from te_jax.attention import prepare_attention
from te_jax.backends.selection import BACKENDS, choose_backend, unavailable_error

STRATEGIES = ("ring", "all_gather")

__all__ = [
    "STRATEGIES",
    "context_parallel_attention",
    "explain_context_parallel_backend",
    "inverse_reorder_causal_load_balancing",
    "reorder_causal_load_balancing",
]


# --------------------------------------------------------------------------------------
# Load-balancing reorder (dual-chunk zig-zag)
# --------------------------------------------------------------------------------------
def _zigzag_order(cp_size: int) -> np.ndarray:
    """Chunk order: device r holds chunks r and 2·cp−1−r."""
    return np.array([c for r in range(cp_size) for c in (r, 2 * cp_size - 1 - r)], np.int32)


def _check_reorder_args(x, cp_size, seq_axis, fn):
    if not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"{fn}: cp_size={cp_size!r} must be a positive int (the size of the context-parallel "
                         f"mesh axis).")
    ndim = jnp.ndim(x)
    if not -ndim <= seq_axis < ndim:
        raise ValueError(f"{fn}: seq_axis={seq_axis} is out of range for an array of shape {tuple(jnp.shape(x))}.")
    seq_axis = seq_axis % ndim
    s = jnp.shape(x)[seq_axis]
    if s % (2 * cp_size):
        raise ValueError(
            f"{fn}: sequence length {s} (axis {seq_axis} of shape {tuple(jnp.shape(x))}) is not divisible by "
            f"2·cp_size = {2 * cp_size}; the zig-zag layout cuts the sequence into 2·cp_size equal chunks. "
            f"Pad the sequence to a multiple of {2 * cp_size}.")
    return int(cp_size), seq_axis


def _permute_chunks(x, cp_size, seq_axis, order):
    shape = jnp.shape(x)
    n = 2 * cp_size
    s = shape[seq_axis]
    xr = jnp.reshape(x, shape[:seq_axis] + (n, s // n) + shape[seq_axis + 1:])
    idx = (slice(None),) * seq_axis + (jnp.asarray(order),)
    spec = _explicit_spec(xr)
    if spec is None:
        xr = xr[idx]
    else:  # Explicit sharding: the gather must be told its output sharding (that of its input)
        xr = xr.at[idx].get(out_sharding=spec)
    return jnp.reshape(xr, shape)


def _explicit_spec(x):
    """The (abstract) NamedSharding in x's type when x is sharded on Explicit mesh axes, else None."""
    try:
        sh = jax.typeof(x).sharding
        sh.mesh.axis_types  # probe: raises where the type carries no mesh
    except Exception:
        return None
    if sh.mesh.empty or "explicit" not in _compat.mesh_axis_kinds(sh.mesh).values():
        return None
    return sh


def reorder_causal_load_balancing(x, cp_size: int, seq_axis: int = 1):
    """Reorder the sequence axis into the dual-chunk zig-zag layout for `cp_size` devices.

    The sequence is cut into 2·cp_size equal chunks; after the reorder, the r-th of the cp_size
    equal shards holds chunks r and 2·cp_size−1−r, so that every device gets the same amount of
    causal work. Apply it once to the model inputs (tokens, or q/k/v and segment ids), not per
    layer; `inverse_reorder_causal_load_balancing` undoes it. seq_axis: 1 for bshd, 0 for sbhd.
    """
    cp_size, seq_axis = _check_reorder_args(x, cp_size, seq_axis, "reorder_causal_load_balancing")
    return _permute_chunks(x, cp_size, seq_axis, _zigzag_order(cp_size))


def inverse_reorder_causal_load_balancing(x, cp_size: int, seq_axis: int = 1):
    """Undo `reorder_causal_load_balancing` (back to the original token order)."""
    cp_size, seq_axis = _check_reorder_args(x, cp_size, seq_axis, "inverse_reorder_causal_load_balancing")
    return _permute_chunks(x, cp_size, seq_axis, np.argsort(_zigzag_order(cp_size)))


# --------------------------------------------------------------------------------------
# Per-device computation
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Cfg:
    backend: str
    strategy: str
    cp_axis: str
    cp_size: int
    scale: float
    softcap: float | None
    causal: bool
    window: tuple[int, int]
    halves: bool  # ring: the half-block branches are allowed (even local lengths)
    dense: bool = False  # ring: blocks run mask-free (diagonal causal, others full): the Hopper kernel
    kernel_config: object | None = None  # config= of the call (BlockSizes / HopperConfig), for the pallas backend


def _branch(cfg: _Cfg, qseg, qpos, kseg, kpos):
    """0: skip, 1: full block pair, 2: all queries × first K/V half, 3: second query half × all K/V.

    The block pair is classified as the kernels classify their tiles, one tile per block (per half of
    each block with `halves`); a tile pair counts when it is not EMPTY in any batch row."""
    sq, skv = qseg.shape[1], kseg.shape[1]
    mask = AttentionMask(qseg, qpos, kseg, kpos, causal=cfg.causal, window=cfg.window)
    if not cfg.halves:
        return jnp.any(mask.block_classes(sq, skv) != EMPTY).astype(jnp.int32)
    need = jnp.any(mask.block_classes(sq // 2, skv // 2) != EMPTY, axis=0)  # [q half, kv half]
    any_pair = jnp.any(need)
    need_k2 = jnp.any(need[:, 1])  # some query sees the second K/V half
    need_q1 = jnp.any(need[0, :])  # the first query half sees some key
    return jnp.where(~any_pair, 0, jnp.where(~need_k2, 2, jnp.where(~need_q1, 3, 1))).astype(jnp.int32)


def _fwd_call(cfg: _Cfg, q, k, v, qseg, qpos, kseg, kpos, diagonal=False):
    if cfg.dense:  # no token masks: causal on the diagonal block pair, every other pair fully visible
        return BACKENDS[cfg.backend].dense_forward(q, k, v, scale=cfg.scale, causal=cfg.causal and diagonal,
                                                   config=cfg.kernel_config)
    tm = masks.TokenMask(qseg, qpos, kseg, kpos)
    return BACKENDS[cfg.backend].forward_only(q, k, v, tm, None, scale=cfg.scale, softcap=cfg.softcap,
                                              causal=cfg.causal, window=cfg.window, config=cfg.kernel_config)


def _bwd_call(cfg: _Cfg, q, k, v, qseg, qpos, kseg, kpos, out, lse, dout, diagonal=False):
    if cfg.dense:
        dq, dk, dv = BACKENDS[cfg.backend].dense_backward(q, k, v, out, lse, dout, scale=cfg.scale,
                                                          causal=cfg.causal and diagonal, config=cfg.kernel_config)
    else:
        tm = masks.TokenMask(qseg, qpos, kseg, kpos)
        dq, dk, dv, _ = BACKENDS[cfg.backend].backward(
            q, k, v, tm, None, out, lse, dout, None, scale=cfg.scale, softcap=cfg.softcap, causal=cfg.causal,
            window=cfg.window, config=cfg.kernel_config)
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def _merge(acc_out, acc_lse, out_blk, lse_blk):
    """Exact merge of two partial attentions by their logsumexp; rows with -inf lse stay zero."""
    both_empty = jnp.isneginf(acc_lse) & jnp.isneginf(lse_blk)
    d = jnp.where(both_empty, 0.0, lse_blk - acc_lse)  # +inf if acc empty, -inf if block empty
    w = jax.nn.sigmoid(d)  # [B, H, Sq]
    w = jnp.swapaxes(w, 1, 2)[..., None]  # [B, Sq, H, 1]
    out = acc_out - w * (acc_out - out_blk.astype(jnp.float32))
    lse = jnp.logaddexp(acc_lse, lse_blk)
    return out, lse


def _ring_fwd_step(cfg: _Cfg, q, qseg, qpos, acc, kv, diagonal=False):
    """Merge the contribution of one K/V block into the accumulator (acc_out f32, acc_lse).

    diagonal: the K/V block is this device's own (ring step 0)."""
    k, v, kseg, kpos = kv
    if cfg.dense and diagonal:  # unpadded tokens: the diagonal pair always has visible keys
        return _merge(*acc, *_fwd_call(cfg, q, k, v, qseg, qpos, kseg, kpos, diagonal=True))

    def skip(acc):
        return acc

    def full(acc):
        o, l = _fwd_call(cfg, q, k, v, qseg, qpos, kseg, kpos)
        return _merge(*acc, o, l)

    def kv_first_half(acc):
        hk = k.shape[1] // 2
        o, l = _fwd_call(cfg, q, k[:, :hk], v[:, :hk], qseg, qpos, kseg[:, :hk], kpos[:, :hk])
        return _merge(*acc, o, l)

    def q_second_half(acc):
        hq = q.shape[1] // 2
        o, l = _fwd_call(cfg, q[:, hq:], k, v, qseg[:, hq:], qpos[:, hq:], kseg, kpos)
        acc_out, acc_lse = acc
        mo, ml = _merge(acc_out[:, hq:], acc_lse[:, :, hq:], o, l)
        return (jnp.concatenate([acc_out[:, :hq], mo], axis=1),
                jnp.concatenate([acc_lse[:, :, :hq], ml], axis=2))

    branches = [skip, full] + ([kv_first_half, q_second_half] if cfg.halves else [])
    return lax.switch(_branch(cfg, qseg, qpos, kseg, kpos), branches, acc)


def _ring_bwd_step(cfg: _Cfg, q, qseg, qpos, out, lse, dout, kv, diagonal=False):
    """Gradient contributions (dq f32 [local q], dk/dv f32 [this K/V block]) of one block pair."""
    k, v, kseg, kpos = kv
    f32 = jnp.float32
    if cfg.dense and diagonal:
        return _bwd_call(cfg, q, k, v, qseg, qpos, kseg, kpos, out, lse, dout, diagonal=True)

    def skip():
        return (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))

    def full():
        return _bwd_call(cfg, q, k, v, qseg, qpos, kseg, kpos, out, lse, dout)

    def kv_first_half():
        hk = k.shape[1] // 2
        dq, dk, dv = _bwd_call(cfg, q, k[:, :hk], v[:, :hk], qseg, qpos, kseg[:, :hk], kpos[:, :hk],
                               out, lse, dout)
        pad = ((0, 0), (0, k.shape[1] - hk), (0, 0), (0, 0))
        return dq, jnp.pad(dk, pad), jnp.pad(dv, pad)

    def q_second_half():
        hq = q.shape[1] // 2
        dq, dk, dv = _bwd_call(cfg, q[:, hq:], k, v, qseg[:, hq:], qpos[:, hq:], kseg, kpos,
                               out[:, hq:], lse[:, :, hq:], dout[:, hq:])
        return jnp.pad(dq, ((0, 0), (hq, 0), (0, 0), (0, 0))), dk, dv

    branches = [skip, full] + ([kv_first_half, q_second_half] if cfg.halves else [])
    idx = _branch(cfg, qseg, qpos, kseg, kpos)
    return lax.switch(idx, [lambda _, b=b: b() for b in branches], None)


def _ring_perm(cfg: _Cfg):
    n = cfg.cp_size
    return [(i, (i + 1) % n) for i in range(n)]


def _ring_forward(cfg: _Cfg, q, k, v, qseg, qpos, kseg, kpos):
    b, sq, h, _ = q.shape
    acc = (jnp.zeros((b, sq, h, v.shape[-1]), jnp.float32), jnp.full((b, h, sq), -jnp.inf, jnp.float32))
    kv = (k, v, kseg, kpos)
    perm = _ring_perm(cfg)
    if cfg.cp_size == 1:
        out, lse = _ring_fwd_step(cfg, q, qseg, qpos, acc, kv, diagonal=True)
        return out.astype(q.dtype), lse
    # Step 0 (own K/V, the diagonal) is peeled off the loop: its mask differs from every other step's.
    nxt = lax.ppermute(kv, cfg.cp_axis, perm)  # send the next block before computing
    acc = _ring_fwd_step(cfg, q, qseg, qpos, acc, kv, diagonal=True)
    kv = nxt
    if cfg.cp_size > 2:
        def body(carry, _):
            kv, acc = carry
            nxt = lax.ppermute(kv, cfg.cp_axis, perm)
            acc = _ring_fwd_step(cfg, q, qseg, qpos, acc, kv)
            return (nxt, acc), None

        (kv, acc), _ = lax.scan(body, (kv, acc), None, length=cfg.cp_size - 2)
    out, lse = _ring_fwd_step(cfg, q, qseg, qpos, acc, kv)
    return out.astype(q.dtype), lse


def _ring_backward(cfg: _Cfg, res, dout):
    q, k, v, qseg, qpos, kseg, kpos, out, lse = res
    perm = _ring_perm(cfg)
    dq = jnp.zeros(q.shape, jnp.float32)
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    kv = (k, v, kseg, kpos)

    def step(kv, dkv, dq, diagonal=False):
        dq_p, dk_p, dv_p = _ring_bwd_step(cfg, q, qseg, qpos, out, lse, dout, kv, diagonal=diagonal)
        # dK/dV accumulators travel one step behind their K/V block.
        send = (dkv[0] + dk_p, dkv[1] + dv_p)
        return lax.ppermute(send, cfg.cp_axis, perm) if cfg.cp_size > 1 else send, dq + dq_p

    if cfg.cp_size == 1:
        (dk, dv), dq = step(kv, dkv, dq, diagonal=True)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    nxt = lax.ppermute(kv, cfg.cp_axis, perm)  # step 0, the diagonal, peeled off the loop
    dkv, dq = step(kv, dkv, dq, diagonal=True)
    kv = nxt
    if cfg.cp_size > 2:
        def body(carry, _):
            kv, dkv, dq = carry
            nxt = lax.ppermute(kv, cfg.cp_axis, perm)
            dkv, dq = step(kv, dkv, dq)
            return (nxt, dkv, dq), None

        (kv, dkv, dq), _ = lax.scan(body, (kv, dkv, dq), None, length=cfg.cp_size - 2)
    (dk, dv), dq = step(kv, dkv, dq)  # the last send brings each block's dK/dV home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _gather_kv(cfg: _Cfg, k, v, kseg, kpos):
    ag = functools.partial(lax.all_gather, axis_name=cfg.cp_axis, axis=1, tiled=True)
    return ag(k), ag(v), ag(kseg), ag(kpos)


def _allgather_forward(cfg: _Cfg, q, k, v, qseg, qpos, kseg, kpos):
    kf, vf, ksf, kpf = _gather_kv(cfg, k, v, kseg, kpos)
    return _fwd_call(cfg, q, kf, vf, qseg, qpos, ksf, kpf)


def _allgather_backward(cfg: _Cfg, res, dout):
    q, k, v, qseg, qpos, kseg, kpos, out, lse = res
    kf, vf, ksf, kpf = _gather_kv(cfg, k, v, kseg, kpos)
    dq, dkf, dvf = _bwd_call(cfg, q, kf, vf, qseg, qpos, ksf, kpf, out, lse, dout)
    rs = functools.partial(lax.psum_scatter, axis_name=cfg.cp_axis, scatter_dimension=1, tiled=True)
    return dq.astype(q.dtype), rs(dkf).astype(k.dtype), rs(dvf).astype(v.dtype)


_FORWARD = {"ring": _ring_forward, "all_gather": _allgather_forward}
_BACKWARD = {"ring": _ring_backward, "all_gather": _allgather_backward}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cp_attention_local(cfg: _Cfg, q, k, v, qseg, qpos, kseg, kpos):
    out, _ = _FORWARD[cfg.strategy](cfg, q, k, v, qseg, qpos, kseg, kpos)
    return out


def _cp_attention_local_fwd(cfg, q, k, v, qseg, qpos, kseg, kpos):
    out, lse = _FORWARD[cfg.strategy](cfg, q, k, v, qseg, qpos, kseg, kpos)
    return out, (q, k, v, qseg, qpos, kseg, kpos, out, lse)


def _cp_attention_local_bwd(cfg, res, dout):
    dq, dk, dv = _BACKWARD[cfg.strategy](cfg, res, dout)
    return dq, dk, dv, None, None, None, None


_cp_attention_local.defvjp(_cp_attention_local_fwd, _cp_attention_local_bwd)


# Attention sinks (softmax_type, te_jax/sinks.py): the sink is merged into the ring's final (out, lse). The
# backward of attention with a sink is the vanilla backward run with the MERGED out' and lse' (the sink is a
# key of value 0: P = exp(S - lse') over the real keys, delta = rowsum(dO·O')), so the ring backward (and the
# Hopper block kernels) need no lse cotangent; the sink logit's gradient is -Σ P_sink·rowsum(dO·O') with
# P_sink = exp(sink - lse'). Per shard that is a partial sum over the local batch and tokens: shard_map's
# transpose sums it over the mesh axes the sink is not split on (context parallel and batch axes).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cp_attention_local_sink(cfg: _Cfg, q, k, v, qseg, qpos, kseg, kpos, sink):
    return _cp_attention_local_sink_fwd(cfg, q, k, v, qseg, qpos, kseg, kpos, sink)[0]


def _cp_attention_local_sink_fwd(cfg, q, k, v, qseg, qpos, kseg, kpos, sink):
    out, lse = _FORWARD[cfg.strategy](cfg, q, k, v, qseg, qpos, kseg, kpos)
    out, lse = sinks.merge_sink(out, lse, sink)
    return out, (q, k, v, qseg, qpos, kseg, kpos, out, lse, sink)


def _cp_attention_local_sink_bwd(cfg, res, dout):
    q, k, v, qseg, qpos, kseg, kpos, out, lse, sink = res
    dq, dk, dv = _BACKWARD[cfg.strategy](cfg, (q, k, v, qseg, qpos, kseg, kpos, out, lse), dout)
    delta = jnp.einsum("bshd,bshd->bhs", dout.astype(jnp.float32), out.astype(jnp.float32))
    p_sink = jnp.exp(sink.astype(jnp.float32)[None, :, None] - lse)  # rows with no key: out 0, so delta 0
    dsink = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sink.dtype)
    return dq, dk, dv, None, None, None, None, dsink


_cp_attention_local_sink.defvjp(_cp_attention_local_sink_fwd, _cp_attention_local_sink_bwd)


# --------------------------------------------------------------------------------------
# Mesh, specs and validation
# --------------------------------------------------------------------------------------
def _resolve_mesh(mesh, cp_axis):
    if mesh is None:
        mesh = _compat.current_mesh()
        if mesh is None:
            raise ValueError(
                "context_parallel_attention: no mesh. Pass mesh=<jax.sharding.Mesh> or call it under "
                "`with jax.set_mesh(mesh):` (a mesh with the context-parallel axis, e.g. "
                "jax.make_mesh((cp,), ('cp',))).")
    names = tuple(mesh.axis_names)
    if not isinstance(cp_axis, str) or cp_axis not in names:
        raise ValueError(
            f"context_parallel_attention: cp_axis={cp_axis!r} is not an axis of the mesh; the mesh has axes "
            f"{dict(zip(names, mesh.axis_sizes))}. Pass one of {names}.")
    return mesh


def _as_axes(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_entry(axes):
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _input_spec_axes(x, dim, mesh):
    """The mesh axes dimension `dim` of `x` is sharded on, when its type says so (Explicit axes)."""
    try:
        sh = jax.typeof(x).sharding
        spec = sh.spec
        if tuple(sh.mesh.axis_names) != tuple(mesh.axis_names):
            return ()
    except Exception:  # no sharding in the type (Auto axes, numpy input, older jax)
        return ()
    if spec is None or dim >= len(spec):
        return ()
    return _as_axes(spec[dim])


def _resolve_axes(given, inferred, argname, cp_axis, mesh, size, what):
    # Inferred from the input's sharding: a cp_axis entry there is dropped (the input gets resharded).
    axes = _as_axes(given) if given is not None else tuple(a for a in inferred if a != cp_axis)
    names = tuple(mesh.axis_names)
    for a in axes:
        if a not in names:
            raise ValueError(f"context_parallel_attention: {argname} names axis {a!r}, which is not in the mesh "
                             f"axes {names}.")
    if cp_axis in axes:
        raise ValueError(
            f"context_parallel_attention: the {what} axis is sharded on cp_axis={cp_axis!r}; the context-parallel "
            f"axis must shard the sequence only. Reshard the input (e.g. jax.reshard) or pass {argname}.")
    n = int(np.prod([dict(zip(names, mesh.axis_sizes))[a] for a in axes])) if axes else 1
    if size % n:
        raise ValueError(
            f"context_parallel_attention: {what} size {size} is not divisible by the {n} devices of mesh axes "
            f"{axes} ({argname}).")
    return axes


def _place(x, mesh, spec):
    """Put x on `spec` (jax.reshard for Explicit meshes, a sharding constraint otherwise)."""
    explicit = hasattr(mesh, "axis_types") and "explicit" in _compat.mesh_axis_kinds(mesh).values()
    if isinstance(mesh, jax.sharding.AbstractMesh):
        if explicit:
            return jax.reshard(x, spec)
        return lax.with_sharding_constraint(x, spec)
    sharding = NamedSharding(mesh, spec)
    if explicit:
        return jax.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _check_seq(name, s, cp_size, load_balanced):
    div = 2 * cp_size if load_balanced else cp_size
    if s % div:
        how = (f"2·cp_size = {div} (load_balanced=True cuts it into 2·cp_size zig-zag chunks)"
               if load_balanced else f"cp_size = {div}")
        raise ValueError(
            f"context_parallel_attention: {name} sequence length {s} is not divisible by {how}. Pad the sequence "
            f"to a multiple of {div} (padding tokens masked with q_seqlens/kv_seqlens or segment id 0).")


def _global_token_mask(prep, mask, fmt, cp_size, load_balanced, q_seqlens, kv_seqlens, q_segment_ids,
                       kv_segment_ids):
    """The global TokenMask in the order the tokens are given (positions computed in original order)."""
    d = prep.call.dims
    if not load_balanced:
        return prep.token_mask
    inv = functools.partial(inverse_reorder_causal_load_balancing, cp_size=cp_size, seq_axis=1)
    fwd = functools.partial(reorder_causal_load_balancing, cp_size=cp_size, seq_axis=1)
    qs = None if q_segment_ids is None else inv(jnp.asarray(q_segment_ids))
    ks = None if kv_segment_ids is None else inv(jnp.asarray(kv_segment_ids))
    tm = masks.build_token_mask(mask, fmt, d.batch, d.q_len, d.kv_len, q_seqlens, kv_seqlens, qs, ks)
    return masks.TokenMask(*(fwd(a) for a in (tm.q_segment_ids, tm.q_positions, tm.kv_segment_ids,
                                               tm.kv_positions)))


def _prepare(query, key, value, *, cp_axis, mesh, strategy, load_balanced, attn_input_format, attn_mask_type,
             q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, window_size, softcap, scale, backend, config=None,
             softmax_type="vanilla", softmax_offset=None):
    if strategy not in STRATEGIES:
        raise ValueError(f"context_parallel_attention: strategy={strategy!r} is not known; expected one of "
                         f"{STRATEGIES}.")
    fmt = layouts.check_format(attn_input_format)
    if fmt == "thd":
        raise ValueError(
            "context_parallel_attention: attn_input_format='thd' is not supported (not wired here: the packed "
            "token axis and its seqlens are not split over devices). The same computation in a supported form: "
            "add a batch axis of 1 (q[None], bshd) and pass the packing as q_segment_ids/kv_segment_ids of "
            "shape [1, tokens] (ids 1, 2, ... per sequence, 0 for padding) with attn_mask_type='padding' or "
            "'padding_causal'.")
    mesh = _resolve_mesh(mesh, cp_axis)
    cp_size = int(dict(zip(mesh.axis_names, mesh.axis_sizes))[cp_axis])
    prep = prepare_attention(
        query, key, value, attn_input_format=fmt, attn_mask_type=attn_mask_type, q_seqlens=q_seqlens,
        kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        window_size=window_size, softcap=softcap, scale=scale, needs_split_vjp=True, runs_per_shard=True,
        config=config, softmax_type=softmax_type, softmax_offset=softmax_offset)
    d = prep.call.dims
    _check_seq("query", d.q_len, cp_size, load_balanced)
    _check_seq("key/value", d.kv_len, cp_size, load_balanced)
    choice = choose_backend(prep.call, backend)
    if choice.selected is None:
        raise unavailable_error(choice)
    if not BACKENDS[choice.selected].capabilities.split_backward:
        raise ValueError(
            f"context_parallel_attention: backend {choice.selected!r} has no split forward/backward, which "
            f"context parallelism needs; use backend='pallas' or 'xla'.\n{choice}")
    dense, detail = _inner_kernel(choice.selected, prep.call, strategy, cp_size)
    if detail:
        choice = dataclasses.replace(choice, detail=detail)
    return mesh, cp_size, prep, choice, dense


def _inner_kernel(backend, call, strategy, cp_size):
    """(dense, detail): whether the per-block calls run mask-free on the backend's dense kernel
    (the Hopper kernel for pallas on sm90), and the explanation line."""
    b = BACKENDS[backend]
    if not b.capabilities.ring_blocks:
        return False, ""
    d = call.dims
    q_blk = (d.batch, d.q_len // cp_size, d.num_heads, d.head_dim_qk)
    kv_blk = (d.batch, d.kv_len // cp_size, d.num_kv_heads, d.head_dim_qk)
    if strategy == "all_gather":
        kv_blk = (d.batch, d.kv_len, d.num_kv_heads, d.head_dim_qk)
        why = ("all_gather with a causal mask: the gathered K/V needs token masks (use strategy='ring')"
               if call.mask.causal or call.mask.mask_type != "no_mask" else None)
        halves = False
    else:
        why = None
        halves = call.mask.causal and q_blk[1] % 2 == 0 and kv_blk[1] % 2 == 0
    if why is None and call.platform == "gpu":
        why = b.ring_block_reason(call, q_blk, kv_blk, halves)
    elif why is None:
        why = f"not a GPU ({call.platform})"
    if why is None:
        return True, (f"per-block Hopper (Mosaic GPU) kernel, mask-free ({strategy}: "
                      + ("causal on the diagonal block pair, the others fully visible)" if call.mask.causal
                         else "no mask)"))
    return False, f"per-block portable Triton-lowered kernel with token masks (Hopper kernel not used: {why})"


def explain_context_parallel_backend(query, key, value, *, cp_axis, mesh=None, backend="auto", **kwargs):
    """Which inner attention backend `context_parallel_attention` runs per block, and why not the others."""
    kw = dict(strategy="ring", load_balanced=True, attn_input_format="bshd", attn_mask_type="no_mask",
              q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None, window_size=None,
              softcap=None, scale=None, config=None, softmax_type="vanilla", softmax_offset=None)
    kw.update(kwargs)
    return _prepare(query, key, value, cp_axis=cp_axis, mesh=mesh, backend=backend, **kw)[3]


def context_parallel_attention(query, key, value, *, cp_axis: str, mesh=None, strategy: str = "ring",
                               load_balanced: bool = True, attn_input_format: str = "bshd",
                               attn_mask_type: str = "no_mask", q_seqlens=None, kv_seqlens=None,
                               q_segment_ids=None, kv_segment_ids=None, window_size=None, softcap=None,
                               scale=None, backend: str = "auto", batch_axes=None, head_axes=None, config=None,
                               softmax_type: str = "vanilla", softmax_offset=None):
    """Attention over a sequence sharded on mesh axis `cp_axis` (context parallelism).

    query/key/value are GLOBAL arrays ("bshd" [b, s, h, d] or "sbhd" [s, b, h, d]; "thd" is refused)
    whose sequence axis is (or will be) sharded over `cp_axis`; the result has the query's format
    and sharding (sequence on `cp_axis`). Arguments and semantics as `te_jax.dot_product_attention`
    (mask types, seqlens / segment ids, GQA, sliding window, softcap, scale, attention sinks:
    softmax_type / softmax_offset, merged into the ring's final logsumexp); no bias, no dropout.

    mesh: a jax.sharding.Mesh, or None for the current mesh (`jax.set_mesh`). Works inside jax.jit.
    strategy: "ring" (K/V blocks circulate with ppermute; memory O(local sequence)) or
      "all_gather" (K/V gathered once; dK/dV reduce-scattered).
    load_balanced: the inputs (and segment ids) are in the zig-zag order of
      `reorder_causal_load_balancing(x, cp_size, seq_axis)`, and the output comes back in that order.
      q_seqlens/kv_seqlens always describe the original order. Positions are computed in the
      original order, so every mask type stays exact. Needs sequence lengths divisible by 2·cp_size
      (by cp_size when False).
    backend: inner per-block attention, "auto" (GPU: pallas; else xla), "pallas" or "xla"
      (cudnn cannot serve: it exposes no split forward/backward). See
      `explain_context_parallel_backend`.
    batch_axes / head_axes: mesh axes the batch / head axes are sharded on inside the
      computation (e.g. "data", "tensor"). None: read from the query's sharding when the mesh has
      Explicit axes (`jax.make_mesh` default), else replicated. The sequence is always sharded on
      `cp_axis` alone; the inputs are resharded to P(batch_axes, cp_axis, head_axes, None) (bshd)
      if they are not already.
    """
    mesh, cp_size, prep, choice, dense = _prepare(
        query, key, value, cp_axis=cp_axis, mesh=mesh, strategy=strategy, load_balanced=load_balanced,
        attn_input_format=attn_input_format, attn_mask_type=attn_mask_type, q_seqlens=q_seqlens,
        kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        window_size=window_size, softcap=softcap, scale=scale, backend=backend, config=config,
        softmax_type=softmax_type, softmax_offset=softmax_offset)
    fmt = prep.call.attn_input_format
    d = prep.call.dims
    tm = _global_token_mask(prep, prep.call.mask, fmt, cp_size, load_balanced, q_seqlens, kv_seqlens,
                            q_segment_ids, kv_segment_ids)

    b_dim, h_dim = (0, 2) if fmt == "bshd" else (1, 2)
    b_axes = _resolve_axes(batch_axes, _input_spec_axes(query, b_dim, mesh), "batch_axes", cp_axis, mesh,
                           d.batch, "batch")
    h_axes = _resolve_axes(head_axes, _input_spec_axes(query, h_dim, mesh), "head_axes", cp_axis, mesh,
                           d.num_kv_heads, "key/value heads")
    bspec, hspec = _spec_entry(b_axes), _spec_entry(h_axes)
    x_spec = P(bspec, cp_axis, hspec, None)
    m_spec = P(bspec, cp_axis)

    hq, hk = prep.call.dims.q_len // cp_size, prep.call.dims.kv_len // cp_size
    cfg = _Cfg(backend=choice.selected, strategy=strategy, cp_axis=cp_axis, cp_size=cp_size, scale=prep.scale,
               softcap=prep.softcap, causal=prep.call.mask.causal, window=prep.window,
               halves=(hq % 2 == 0 and hk % 2 == 0), dense=dense, kernel_config=prep.call.kernel_config)
    q, k, v = (_place(t, mesh, x_spec) for t in (prep.q, prep.k, prep.v))
    mask_arrays = [_place(a, mesh, m_spec) for a in (tm.q_segment_ids, tm.q_positions, tm.kv_segment_ids,
                                                      tm.kv_positions)]
    if prep.sink is None:
        fn = _compat.shard_map(functools.partial(_cp_attention_local, cfg), mesh=mesh,
                               in_specs=(x_spec,) * 3 + (m_spec,) * 4, out_specs=x_spec, check_vma=False)
        out = fn(q, k, v, *mask_arrays)
    else:  # the sink [h] is split with the query heads (contiguous blocks, as the heads of q)
        fn = _compat.shard_map(functools.partial(_cp_attention_local_sink, cfg), mesh=mesh,
                               in_specs=(x_spec,) * 3 + (m_spec,) * 4 + (P(hspec),), out_specs=x_spec,
                               check_vma=False)
        out = fn(q, k, v, *mask_arrays, _place(prep.sink, mesh, P(hspec)))
    return layouts.from_bshd(out, fmt)
