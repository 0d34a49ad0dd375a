"""Portable (Triton-lowered) Pallas flash attention: forward, backward, custom_vjp.

Layout (canonical): q [B, Sq, H, Dqk], k [B, Skv, G, Dqk], v [B, Skv, G, Dv], H % G == 0;
query head h reads kv head h // (H // G) through the BlockSpec index maps (K/V are never
repeated in memory).

Masking: the entry points take a `pallas_kernels.mask.AttentionMask` (segment ids and positions
per token, a static causal flag and window). Its rule, `mask.visible` (same nonzero segment, and
the causal / window bounds on positions), is applied to every tile computed with a mask.

Block skipping: before each pallas_call the wrapper classifies, in XLA, every (q block, kv block)
pair as *empty* (no visible key possible), *full* (every key visible) or *partial*
(`AttentionMask.block_classes`, from per-block ranges of segment ids and positions of the
non-padding tokens). For each row of blocks it passes four int32 loop bounds ``lo <= flo <= fhi <= hi`` to the kernel: blocks outside
``[lo, hi)`` are never loaded nor computed; ``[flo, fhi)`` is a run of full blocks computed
without any mask arithmetic; the rest of ``[lo, hi)`` is computed with the per-element mask.
The forward and dQ kernels loop over kv blocks with these bounds, the dK/dV kernel loops over
q blocks with the transposed bounds. Since positions are dynamic arrays this covers causal,
sliding windows, bottom-right alignment, packed segments and padding with one mechanism and
no static special cases. Blocks inside ``[lo, hi)`` that happen to be empty (e.g. a
non-contiguous segment layout) are computed with the mask: correct, just not skipped.

Sequence tails and head dims: the wrapper pads Sq/Skv to block multiples (padded tokens get
segment id 0, so the mask hides them) and head dims to a power of two (zeros, which change
neither q.k nor the valid output columns), and slices the results.

Units: without a bias the kernels work in base 2 (logits times log2 e, exp2(s - m)). With a bias
they keep the logits in natural units (``scaled q.k + bias`` in fp32, as the reference adds them)
and scale only the difference to the row max, exp2((s - m) * log2 e), and the custom VJP saves the
row max m and log l apart (lse = m + log l in fp32 loses log l once |m| >~ 1e7): biases down to
finfo.min (the Flax/HF padding fill) give what the fp32 reference gives, forward and backward; a
bias of -inf acts as a mask.

Packed inputs (`flash_attention_packed`): every head index in the BlockSpec index maps goes
through `_Heads` (an offset and a stride per q/k/v), so a packed tensor viewed as
[B, S, heads, D] (a free reshape) is passed as q, k and v of the same pallas_calls and read
where it lies. That needs no padding of the packed tensor; otherwise it is sliced first.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import default_interpret, pl, triton_params
from .._lower_once import lower_once
from .._shapes import check_blocks as _check_blocks
from .._shapes import next_pow2 as _next_pow2
from .._shapes import pad_axis as _pad_axis
from ..mask import AttentionMask, visible
from ..mask import loop_bounds as _loop_bounds

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles and launch parameters. All block sizes are powers of two >= 16.

    block_q/block_kv, num_warps/num_stages: forward kernel.
    block_q_bwd/block_kv_bwd, num_warps_bwd/num_stages_bwd: dK/dV kernel (and the dQ kernel
    unless block_q_dq/block_kv_dq/num_warps_dq are given).
    split_dkv: compute dK and dV in two kernels (one fp32 accumulator each; P recomputed),
    which relieves register pressure for large head dims.
    """

    block_q: int = 128
    block_kv: int = 64
    block_q_bwd: int = 64
    block_kv_bwd: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    num_warps_dq: int | None = None
    split_dkv: bool = False

    def __post_init__(self):
        _check_blocks("BlockSizes", **{n: getattr(self, n) for n in ("block_q", "block_kv", "block_q_bwd",
                                                                      "block_kv_bwd", "block_q_dq", "block_kv_dq")})

    @property
    def dq_blocks(self) -> tuple[int, int, int]:
        return (self.block_q_dq or self.block_q_bwd, self.block_kv_dq or self.block_kv_bwd,
                self.num_warps_dq or self.num_warps_bwd)


# (max head dim, 2-byte dtype?) -> BlockSizes, tuned on the H100 with benchmarks/flash_attention_gpu.py --sweep
# (results: benchmarks/results/flash_attention_h100.md).
_TABLE_16BIT = (
    (64, BlockSizes(128, 64, 64, 64, num_warps=8, num_stages=3, num_warps_bwd=4,
                    num_stages_bwd=2)),
    (128, BlockSizes(128, 64, 64, 64, num_warps=4, num_stages=2, num_warps_bwd=4,
                     num_stages_bwd=2)),
    # hd > 128: split dK/dV kernels, one fp32 accumulator each, which relieves register pressure.
    (256, BlockSizes(64, 64, 64, 64, num_warps=4, num_stages=3, num_warps_bwd=4,
                     num_stages_bwd=2, block_q_dq=64, block_kv_dq=64, num_warps_dq=4,
                     split_dkv=True)),
)
_TABLE_32BIT = (
    (64, BlockSizes(64, 64, 32, 32, num_warps=4, num_stages=2, num_warps_bwd=4,
                    num_stages_bwd=2)),
    (128, BlockSizes(64, 32, 32, 32, num_warps=4, num_stages=2, num_warps_bwd=4,
                     num_stages_bwd=1)),
    (256, BlockSizes(32, 32, 16, 32, num_warps=4, num_stages=1, num_warps_bwd=4,
                     num_stages_bwd=1)),
)


def default_block_sizes(head_dim_qk: int, head_dim_v: int, dtype) -> BlockSizes:
    """Block sizes for a (head dims, dtype) from a small table tuned on the H100."""
    d = max(_next_pow2(head_dim_qk), _next_pow2(head_dim_v))
    table = _TABLE_16BIT if jnp.dtype(dtype).itemsize <= 2 else _TABLE_32BIT
    for max_d, bs in table:
        if d <= max_d:
            return bs
    return table[-1][1]


# --------------------------------------------------------------------------------------
# Static configuration
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    softcap: float | None
    causal: bool  # the mask's static rule (AttentionMask.causal / .window), for the in-kernel mask
    window: tuple[int, int]
    blocks: BlockSizes
    interpret: bool


def _make_cfg(q, v, mask: AttentionMask | None, scale, softcap, block_sizes, interpret):
    if block_sizes is None:
        block_sizes = default_block_sizes(q.shape[-1], v.shape[-1], q.dtype)
    if interpret is None:
        interpret = default_interpret()
    causal, window = (False, (-1, -1)) if mask is None else (mask.causal, mask.window)
    return _Cfg(float(scale), None if softcap is None else float(softcap), causal, window, block_sizes,
                bool(interpret))


def _check_mask(mask, fn: str) -> AttentionMask:
    if not isinstance(mask, AttentionMask):
        raise TypeError(
            f"{fn}: mask must be a pallas_kernels.mask.AttentionMask (segment ids and positions [batch, seq], "
            f"causal, window), got {type(mask).__name__}; e.g. AttentionMask(q_segment_ids, q_positions, "
            f"kv_segment_ids, kv_positions, causal=True) or AttentionMask.full(batch, q_len, kv_len)")
    return mask


def _seq_block(block: int, seq: int) -> int:
    """Shrink a block for short sequences (but keep >= 16, Triton's smallest dot)."""
    return max(16, min(block, _next_pow2(seq)))


@dataclasses.dataclass(frozen=True)
class _Geom:
    bq: int
    bk: int
    bq_b: int
    bk_b: int
    bq_dq: int
    bk_dq: int
    sq_pad: int
    skv_pad: int
    dqk_pad: int
    dv_pad: int


def _geometry(cfg: _Cfg, sq, skv, dqk, dv) -> _Geom:
    b = cfg.blocks
    bq_dq, bk_dq, _ = b.dq_blocks
    bq, bq_b, bq_dq = (_seq_block(x, sq) for x in (b.block_q, b.block_q_bwd, bq_dq))
    bk, bk_b, bk_dq = (_seq_block(x, skv) for x in (b.block_kv, b.block_kv_bwd, bk_dq))
    mq = max(bq, bq_b, bq_dq)
    mk = max(bk, bk_b, bk_dq)
    return _Geom(bq, bk, bq_b, bk_b, bq_dq, bk_dq, -(-sq // mq) * mq, -(-skv // mk) * mk,
                 max(16, _next_pow2(dqk)), max(16, _next_pow2(dv)))


def _lin(off: int, stride: int, x):
    """off + stride * x, leaving x untouched in the plain case (index maps stay as before)."""
    if stride != 1:
        x = stride * x
    return x if off == 0 else off + x


@dataclasses.dataclass(frozen=True)
class _Heads:
    """Where the heads sit on axis 2 of the q, k and v arrays the kernels are given.

    Query head h is ``q[:, :, q_off + q_stride * h]``, kv head g is ``k[:, :, k_off + k_stride * g]``
    and ``v[:, :, v_off + v_stride * g]``. The plain case (``_Heads.of(q, k)``: offsets 0, strides 1)
    is three bshd arrays; a packed tensor viewed as [B, S, heads, D] is passed as q, k and v at once
    with offsets (and, for interleaved forms, strides), so the kernels read it where it lies.
    """

    h: int
    g: int
    q_off: int = 0
    q_stride: int = 1
    k_off: int = 0
    k_stride: int = 1
    v_off: int = 0
    v_stride: int = 1

    def __post_init__(self):
        if self.h <= 0 or self.g <= 0 or self.h % self.g:
            raise ValueError(f"num_heads={self.h} must be a positive multiple of num_kv_heads={self.g}")
        rep = self.h // self.g
        if not (self.q_stride == 1 and self.q_off % rep == 0) and rep != 1:
            raise ValueError(f"query heads at offset {self.q_off}, stride {self.q_stride}: the dK/dV kernel "
                             f"reads the {rep} query heads of a group as one block, which needs stride 1 "
                             f"and an offset that is a multiple of {rep}")

    @staticmethod
    def of(q, k) -> "_Heads":
        return _Heads(q.shape[2], k.shape[2])

    @property
    def rep(self) -> int:
        return self.h // self.g

    @property
    def plain(self) -> bool:
        return self == _Heads(self.h, self.g)

    def q(self, h):
        return _lin(self.q_off, self.q_stride, h)

    def k(self, g):
        return _lin(self.k_off, self.k_stride, g)

    def v(self, g):
        return _lin(self.v_off, self.v_stride, g)

    def q_group(self, g):
        """Block index (in blocks of rep heads) of kv head g's query heads, for the dK/dV kernel."""
        if self.q_stride == 1 and self.q_off % self.rep == 0:
            return _lin(self.q_off // self.rep, 1, g)
        return self.q(g)  # rep == 1 (checked in __post_init__)

    def check(self, q, k, v):
        for name, x, first, stride, n in (("q", q, self.q_off, self.q_stride, self.h),
                                          ("k", k, self.k_off, self.k_stride, self.g),
                                          ("v", v, self.v_off, self.v_stride, self.g)):
            last = first + stride * (n - 1)
            if first < 0 or stride < 1 or last >= x.shape[2]:
                raise ValueError(f"{name} heads {first}..{last} (stride {stride}) do not fit the head "
                                 f"axis of {name}{tuple(x.shape)}")


# --------------------------------------------------------------------------------------
# Block schedule (computed in XLA from the dynamic segment ids / positions)
# --------------------------------------------------------------------------------------
def block_schedule(mask: AttentionMask, *, block_q=16, block_kv=16, transpose=False):
    """Debug hook: the (lo, flo, fhi, hi) loop bounds the kernels use, int32 [B, n_rows, 4].

    Rows are q blocks (forward / dQ) or, with transpose=True, kv blocks (dK/dV). Sequence
    lengths are padded to multiples of the blocks. ``hi - lo`` is the number of blocks visited.
    """
    classes = _check_mask(mask, "block_schedule").block_classes(block_q, block_kv)
    return _loop_bounds(classes.swapaxes(1, 2) if transpose else classes)


# --------------------------------------------------------------------------------------
# Shared in-kernel helpers
# --------------------------------------------------------------------------------------
def _logits2(s, cfg: _Cfg, bias):
    """Raw q.k (fp32) -> logits in the kernels' units; also tanh for softcap grads.

    Without a bias: base-2 units (times log2 e), so probabilities are exp2(s - m).
    With a bias: natural units, ``scaled q.k + bias`` added in fp32 as the reference adds them,
    and probabilities are exp2((s - m) * log2 e) (`_exp2_of`): the row maximum is subtracted
    before the scaling. A huge negative bias (-1e9, finfo.min) then neither overflows
    (finfo.min * log2 e = -inf made a row of -inf and -inf - -inf = NaN) nor loses the q.k
    differences a second time to the rounding of bias * log2 e.
    """
    t = None
    post = LOG2E if bias is None else 1.0
    if cfg.softcap is not None:
        t = jnp.tanh(s * (cfg.scale / cfg.softcap))
        s = t * (cfg.softcap * post)
    else:
        s = s * (cfg.scale * post)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    return s, t


def _exp2_of(d, natural: bool):
    """exp of a logit difference d <= 0 given in the kernels' units (natural: times log2 e first).

    (s - m) * log2 e may overflow to -inf for d near finfo.min: exp2 gives 0, as it should."""
    return jnp.exp2(d * LOG2E) if natural else jnp.exp2(d)


def _bwd_probs(s, shift, ll):
    """P recomputed in the backward: exp2(s - shift) (base 2, no bias; shift = lse in base 2), or
    with a bias exp((s - m) - log l) (natural units, ll not None): the row max subtracted first,
    so that log l survives however large |m| is."""
    if ll is None:
        return jnp.exp2(s - shift)
    return jnp.exp2(((s - shift) - ll) * LOG2E)


def _mask(cfg: _Cfg, qseg, qpos, kseg, kpos, transpose=False):
    """`mask.visible` on a [len(q), len(k)] tile (or [len(k), len(q)] if transpose)."""
    if transpose:
        qs, qp, ks, kp = qseg[None, :], qpos[None, :], kseg[:, None], kpos[:, None]
    else:
        qs, qp, ks, kp = qseg[:, None], qpos[:, None], kseg[None, :], kpos[None, :]
    return visible(qs, qp, ks, kp, causal=cfg.causal, window=cfg.window)


def _run_schedule(meta_ref, body, carry):
    """Run body(j, carry, masked) over [flo, fhi) unmasked and [lo, flo) + [fhi, hi) masked."""
    lo, flo, fhi, hi = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    carry = lax.fori_loop(flo, fhi, lambda j, c: body(j, c, False), carry)
    n_first = flo - lo

    def masked(t, c):
        j = jnp.where(t < n_first, lo + t, fhi + (t - n_first))
        return body(j, c, True)

    return lax.fori_loop(0, n_first + (hi - fhi), masked, carry)


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------
def _fwd_kernel(meta_ref, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref, *refs,
                cfg: _Cfg, bk: int, has_bias: bool):
    """Online softmax over the visible kv blocks of one q block.

    Outputs o and lse (natural log); with a bias also the row max m and log l apart (natural
    units; 0 and -inf for empty rows), the backward's residual: with m ~ -1e9, m + log l rounds
    to m in fp32, and exp(s - lse) would give 1 instead of 1/l (`_bwd_stats`).
    """
    if has_bias:
        bias_ref, o_ref, lse_ref, m_ref, ll_ref = refs
    else:
        bias_ref = m_ref = ll_ref = None
        o_ref, lse_ref = refs
    bq = q_ref.shape[0]
    dv = v_ref.shape[-1]
    q = q_ref[...]
    qseg = qseg_ref[...]
    qpos = qpos_ref[...]

    def body(j, carry, masked):
        acc, m, l = carry
        start = pl.multiple_of(j * bk, bk)
        sl = pl.ds(start, bk)
        k = k_ref[sl, :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        s, _ = _logits2(s, cfg, None if bias_ref is None else bias_ref[:, sl])
        if masked:
            mask = _mask(cfg, qseg, qpos, kseg_ref[sl], kpos_ref[sl])
            s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A bias of -inf can empty a row in an unmasked block too.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if (masked or has_bias) else m_new
        alpha = _exp2_of(m - m_use, has_bias)
        p = _exp2_of(s - m_use[:, None], has_bias)
        l = l * alpha + jnp.sum(p, axis=1)
        v = v_ref[sl, :]
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
        return acc, m_new, l

    acc = jnp.zeros((bq, dv), jnp.float32)
    m = jnp.full((bq,), -jnp.inf, jnp.float32)
    l = jnp.zeros((bq,), jnp.float32)
    acc, m, l = _run_schedule(meta_ref, body, (acc, m, l))
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    if has_bias:  # natural units
        ll = jnp.log(l_safe)
        lse_ref[...] = jnp.where(empty, -jnp.inf, m + ll)
        m_ref[...] = jnp.where(empty, 0.0, m)
        ll_ref[...] = jnp.where(empty, -jnp.inf, ll)
    else:
        lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)


def _bias_spec(bias, block, index):
    """BlockSpec for a [Bb, Hb, Sq, Skv] bias; index(b, h, i, j) gives the grid's block ids."""
    bb, hb = bias.shape[0], bias.shape[1]
    return pl.BlockSpec((None, None) + block,
                        lambda *g: (lambda b, h, i, j: (b if bb > 1 else 0, h if hb > 1 else 0,
                                                        i, j))(*index(*g)))


def _prepare(cfg, heads: _Heads, q, k, v, mask: AttentionMask, bias):
    """Pad sequences/head dims; returns the geometry, the padded arrays and the padded mask.

    An array that needs no padding is returned as is (the same traced value): a packed tensor
    passed as q, k and v stays one operand of the kernels.
    """
    B, Sq, _, Dqk = q.shape
    H = heads.h
    Skv, Dv = k.shape[1], v.shape[-1]
    if k.shape[0] != B or v.shape[:2] != k.shape[:2] or k.shape[-1] != Dqk:
        raise ValueError(f"bad shapes q{q.shape} k{k.shape} v{v.shape}")
    if heads.plain and v.shape[2] != k.shape[2]:
        raise ValueError(f"bad shapes q{q.shape} k{k.shape} v{v.shape}")
    heads.check(q, k, v)
    geo = _geometry(cfg, Sq, Skv, Dqk, Dv)
    q = _pad_axis(_pad_axis(q, 1, geo.sq_pad), 3, geo.dqk_pad)
    k = _pad_axis(_pad_axis(k, 1, geo.skv_pad), 3, geo.dqk_pad)
    v = _pad_axis(_pad_axis(v, 1, geo.skv_pad), 3, geo.dv_pad)
    if (mask.batch, mask.q_len, mask.kv_len) != (B, Sq, Skv):
        raise ValueError(f"mask arrays [{mask.batch}, {mask.q_len}] / [{mask.batch}, {mask.kv_len}] do not "
                         f"match q{q.shape} k{k.shape}: expected [{B}, {Sq}] / [{B}, {Skv}]")
    mask = mask.pad(geo.sq_pad, geo.skv_pad)  # padded tokens get segment 0: the mask hides them
    if bias is not None:
        if bias.ndim != 4 or bias.shape[0] not in (1, B) or bias.shape[1] not in (1, H) or \
                bias.shape[2:] != (Sq, Skv):
            raise ValueError(f"bias shape {bias.shape} is not [1|B, 1|H, Sq, Skv]")
        bias = _pad_axis(_pad_axis(bias, 2, geo.sq_pad), 3, geo.skv_pad)
    return geo, q, k, v, mask, bias


def _mask_arrays(mask: AttentionMask):
    """The four arrays the kernels take, in their operand order."""
    return [mask.q_segment_ids, mask.q_positions, mask.kv_segment_ids, mask.kv_positions]


def _q_row_specs(nq, bq, skv, dqk, dv, heads: _Heads):
    """Specs shared by the kernels gridded over (q blocks, B, H): block bounds, one q block, the
    whole K/V of the head's group, and the mask arrays. Program i takes q block nq-1-i (longest
    causal rows first). Head indices go through `heads` (offsets into a packed tensor)."""
    rep = heads.rep
    return [
        pl.BlockSpec((None, None, 4), lambda i, b, h: (b, nq - 1 - i, 0)),
        pl.BlockSpec((None, bq, None, dqk), lambda i, b, h: (b, nq - 1 - i, heads.q(h), 0)),
        pl.BlockSpec((None, skv, None, dqk), lambda i, b, h: (b, 0, heads.k(h // rep), 0)),
        pl.BlockSpec((None, skv, None, dv), lambda i, b, h: (b, 0, heads.v(h // rep), 0)),
        pl.BlockSpec((None, bq), lambda i, b, h: (b, nq - 1 - i)),
        pl.BlockSpec((None, bq), lambda i, b, h: (b, nq - 1 - i)),
        pl.BlockSpec((None, skv), lambda i, b, h: (b, 0)),
        pl.BlockSpec((None, skv), lambda i, b, h: (b, 0)),
    ]


def _fwd_padded(cfg: _Cfg, geo: _Geom, heads: _Heads, q, k, v, mask: AttentionMask, bias):
    B, Sqp, _, Dqk = q.shape
    H = heads.h
    Skvp, Dv = k.shape[1], v.shape[-1]
    bq, bk = geo.bq, geo.bk
    nq = Sqp // bq
    meta = _loop_bounds(mask.block_classes(bq, bk))  # [B, nq, 4]
    # Program i handles q block nq-1-i: under a causal mask the longest rows start first,
    # which shortens the tail of the launch.
    grid = (nq, B, H)
    in_specs = _q_row_specs(nq, bq, Skvp, Dqk, Dv, heads)
    args = [meta, q, k, v, *_mask_arrays(mask)]
    if bias is not None:
        in_specs.append(_bias_spec(bias, (bq, Skvp), lambda i, b, h: (b, h, nq - 1 - i, 0)))
        args.append(bias)
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i))
    row_shape = jax.ShapeDtypeStruct((B, H, Sqp), jnp.float32)
    n_rows = 3 if bias is not None else 1  # lse (+ m, log l with a bias)
    out, lse, *stats = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, bk=bk, has_bias=bias is not None),
        grid=grid,
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, Dv), lambda i, b, h: (b, nq - 1 - i, h, 0))]
        + [row_spec] * n_rows,
        out_shape=[jax.ShapeDtypeStruct((B, Sqp, H, Dv), q.dtype)] + [row_shape] * n_rows,
        compiler_params=triton_params(num_warps=cfg.blocks.num_warps,
                                      num_stages=cfg.blocks.num_stages),
        interpret=cfg.interpret,
        name="te_flash_attention_fwd",
    )(*args)
    return out, lse, (tuple(stats) if stats else None)


@lower_once(static_argnames=("cfg", "heads", "with_stats"))
def _fwd_impl(cfg: _Cfg, q, k, v, mask: AttentionMask, bias, heads: _Heads | None = None,
              with_stats: bool = False):
    """(out, lse), or (out, lse, stats) with with_stats: stats is the (row max, log l) pair
    the backward needs with a bias (natural units, [B, H, Sq] f32 each), None without one."""
    heads = heads or _Heads.of(q, k)
    Sq, Dv = q.shape[1], v.shape[-1]
    geo, *padded = _prepare(cfg, heads, q, k, v, mask, bias)
    out, lse, stats = _fwd_padded(cfg, geo, heads, *padded)
    out, lse = out[:, :Sq, :, :Dv], lse[:, :, :Sq]
    if not with_stats:
        return out, lse
    return out, lse, (None if stats is None else tuple(x[:, :, :Sq] for x in stats))


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------
def _dkv_kernel(meta_ref, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref,
                do_ref, lse_ref, delta_ref, *refs, cfg: _Cfg, bq: int, rep: int,
                has_bias: bool, bias_heads: int, outputs: str = "dkdv"):
    """One kv block of one kv head; loops over the rep query heads and the visible q blocks.

    Works with transposed tiles ([bk, bq]) so only loaded operands are transposed.
    outputs: "dkdv" (both), or "dk" / "dv" alone (split mode for large head dims: one
    [bk, D] fp32 accumulator per kernel instead of two, at the price of recomputing P).
    """
    want_dk, want_dv = "dk" in outputs, "dv" in outputs
    refs = list(refs)
    ll_ref = refs.pop(0) if has_bias else None  # lse_ref then holds the row max (natural units)
    bias_ref = refs.pop(0) if has_bias else None
    dk_ref = refs.pop(0) if want_dk else None
    dv_ref = refs.pop(0) if want_dv else None
    bk, dqk = k_ref.shape
    dv_dim = v_ref.shape[-1]
    k = k_ref[...]
    v = v_ref[...] if want_dk else None
    kseg = kseg_ref[...]
    kpos = kpos_ref[...]

    def head_loop(r, carry):
        def body(i, carry, masked):
            dk, dv = carry
            start = pl.multiple_of(i * bq, bq)
            sl = pl.ds(start, bq)
            q = q_ref[sl, r, :]
            do = do_ref[sl, r, :]
            lse2 = lse_ref[r, sl]
            st = jnp.dot(k, q.T, preferred_element_type=jnp.float32)  # [bk, bq]
            bias_t = None
            if bias_ref is not None:
                bias_t = bias_ref[r if bias_heads > 1 else 0, sl, :].T
            st, tt = _logits2(st, cfg, bias_t)
            if masked:
                mask_t = _mask(cfg, qseg_ref[sl], qpos_ref[sl], kseg, kpos, transpose=True)
                st = jnp.where(mask_t, st, -jnp.inf)
            pt = _bwd_probs(st, lse2[None, :], None if ll_ref is None else ll_ref[r, sl][None, :])
            if want_dv:
                dv = dv + jnp.dot(pt.astype(do.dtype), do, preferred_element_type=jnp.float32)
            if want_dk:
                delta = delta_ref[r, sl]
                dpt = jnp.dot(v, do.T, preferred_element_type=jnp.float32)
                dst = pt * (dpt - delta[None, :])
                if tt is not None:
                    dst = dst * (1.0 - tt * tt)
                dk = dk + jnp.dot(dst.astype(q.dtype), q, preferred_element_type=jnp.float32)
            return dk, dv

        return _run_schedule(meta_ref, body, carry)

    carry = (jnp.zeros((bk, dqk), jnp.float32) if want_dk else jnp.zeros((), jnp.float32),
             jnp.zeros((bk, dv_dim), jnp.float32) if want_dv else jnp.zeros((), jnp.float32))
    if rep == 1:
        dk, dv = head_loop(0, carry)
    else:
        dk, dv = lax.fori_loop(0, rep, head_loop, carry)
    if want_dk:
        dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    if want_dv:
        dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(meta_ref, q_ref, k_ref, v_ref, qseg_ref, qpos_ref, kseg_ref, kpos_ref,
               do_ref, lse_ref, delta_ref, *refs, cfg: _Cfg, bk: int, nk: int,
               has_bias: bool):
    if has_bias:  # lse_ref holds the row max (natural units), ll_ref log l
        ll_ref, bias_ref, dq_ref, dbias_ref = refs
    else:
        ll_ref = bias_ref = dbias_ref = None
        (dq_ref,) = refs
    bq, dqk = q_ref.shape
    q = q_ref[...]
    do = do_ref[...]
    lse2 = lse_ref[...]
    ll = None if ll_ref is None else ll_ref[...][:, None]
    delta = delta_ref[...]
    qseg = qseg_ref[...]
    qpos = qpos_ref[...]

    def body(j, dq, masked):
        start = pl.multiple_of(j * bk, bk)
        sl = pl.ds(start, bk)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        s, t = _logits2(s, cfg, None if bias_ref is None else bias_ref[:, sl])
        if masked:
            s = jnp.where(_mask(cfg, qseg, qpos, kseg_ref[sl], kpos_ref[sl]), s, -jnp.inf)
        p = _bwd_probs(s, lse2[:, None], ll)
        dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        if dbias_ref is not None:
            dbias_ref[:, sl] = ds.astype(dbias_ref.dtype)
        if t is not None:
            ds = ds * (1.0 - t * t)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = _run_schedule(meta_ref, body, jnp.zeros((bq, dqk), jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)
    if dbias_ref is not None:
        # Blocks outside [lo, hi) were skipped: their bias gradient is zero.
        zeros = jnp.zeros((bq, bk), dbias_ref.dtype)

        def zero(j, c):
            dbias_ref[:, pl.ds(pl.multiple_of(j * bk, bk), bk)] = zeros
            return c

        lax.fori_loop(0, meta_ref[0], zero, 0)
        lax.fori_loop(meta_ref[3], nk, zero, 0)


def _bwd_stats(lse, stats, has_bias):
    """(shift, ll) for `_bwd_probs` from the forward's lse and (with a bias) its (m, log l).

    Empty rows (lse = -inf) get 0 so that exp2(-inf - 0) = 0, never NaN. Without a bias: shift is
    lse in base 2, ll None (as before). With a bias: natural units, shift = m and ll = log l kept
    apart; given lse alone (`flash_attention_bwd` from a merged lse) shift = lse, ll = 0, which is
    exact unless the bias is so large that log l is lost to the rounding of m + log l."""
    lse = lse.astype(jnp.float32)
    empty = lse == -jnp.inf
    if not has_bias:
        return jnp.where(empty, 0.0, lse * LOG2E), None
    m, ll = (lse, jnp.zeros_like(lse)) if stats is None else stats
    return (jnp.where(empty, 0.0, m).astype(jnp.float32),
            jnp.where(empty, 0.0, ll).astype(jnp.float32))


def _bwd_padded(cfg: _Cfg, geo: _Geom, heads: _Heads, q, k, v, mask: AttentionMask, bias, out,
                lse2, ll, dout, dlse):
    """lse2, ll: `_bwd_stats` (padded rows 0)."""
    B, Sqp, _, Dqk = q.shape
    H, G, rep = heads.h, heads.g, heads.rep
    Skvp, Dv = k.shape[1], v.shape[-1]
    blocks = cfg.blocks
    # Preprocessing (XLA, memory bound): delta = rowsum(dout * out) - dlse.
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    has_bias = bias is not None
    bias_heads = 1 if bias is None else bias.shape[1]

    # ---- dK / dV: grid over (kv blocks, B, kv heads), loop over q heads of the group.
    bq, bk = geo.bq_b, geo.bk_b
    nk = Skvp // bk
    meta_kv = _loop_bounds(mask.block_classes(bq, bk).swapaxes(1, 2))  # [B, nk, 4]
    in_specs = [
        pl.BlockSpec((None, None, 4), lambda j, b, g: (b, j, 0)),
        pl.BlockSpec((None, Sqp, rep, Dqk), lambda j, b, g: (b, 0, heads.q_group(g), 0)),
        pl.BlockSpec((None, bk, None, Dqk), lambda j, b, g: (b, j, heads.k(g), 0)),
        pl.BlockSpec((None, bk, None, Dv), lambda j, b, g: (b, j, heads.v(g), 0)),
        pl.BlockSpec((None, Sqp), lambda j, b, g: (b, 0)),
        pl.BlockSpec((None, Sqp), lambda j, b, g: (b, 0)),
        pl.BlockSpec((None, bk), lambda j, b, g: (b, j)),
        pl.BlockSpec((None, bk), lambda j, b, g: (b, j)),
        pl.BlockSpec((None, Sqp, rep, Dv), lambda j, b, g: (b, 0, g, 0)),
        pl.BlockSpec((None, rep, Sqp), lambda j, b, g: (b, g, 0)),
        pl.BlockSpec((None, rep, Sqp), lambda j, b, g: (b, g, 0)),
    ]
    args = [meta_kv, q, k, v, *_mask_arrays(mask), dout, lse2, delta]
    if has_bias:
        in_specs.append(pl.BlockSpec((None, rep, Sqp), lambda j, b, g: (b, g, 0)))
        args.append(ll)
        bb = bias.shape[0]
        if bias_heads > 1:
            spec = pl.BlockSpec((None, rep, Sqp, bk),
                                lambda j, b, g: (b if bb > 1 else 0, g, 0, j))
        else:
            spec = pl.BlockSpec((None, 1, Sqp, bk), lambda j, b, g: (b if bb > 1 else 0, 0, 0, j))
        in_specs.append(spec)
        args.append(bias)
    dk_spec = pl.BlockSpec((None, bk, None, Dqk), lambda j, b, g: (b, j, g, 0))
    dv_spec = pl.BlockSpec((None, bk, None, Dv), lambda j, b, g: (b, j, g, 0))
    dk_shape = jax.ShapeDtypeStruct((B, Skvp, G, Dqk), k.dtype)
    dv_shape = jax.ShapeDtypeStruct((B, Skvp, G, Dv), v.dtype)

    def dkv_call(outputs):
        specs = {"dk": [dk_spec], "dv": [dv_spec], "dkdv": [dk_spec, dv_spec]}[outputs]
        shapes = {"dk": [dk_shape], "dv": [dv_shape], "dkdv": [dk_shape, dv_shape]}[outputs]
        return pl.pallas_call(
            functools.partial(_dkv_kernel, cfg=cfg, bq=bq, rep=rep, has_bias=has_bias,
                              bias_heads=bias_heads, outputs=outputs),
            grid=(nk, B, G),
            in_specs=in_specs,
            out_specs=specs,
            out_shape=shapes,
            compiler_params=triton_params(num_warps=blocks.num_warps_bwd,
                                          num_stages=blocks.num_stages_bwd),
            interpret=cfg.interpret,
            name=f"te_flash_attention_{outputs}",
        )(*args)

    if blocks.split_dkv:
        (dk,), (dv,) = dkv_call("dk"), dkv_call("dv")
    else:
        dk, dv = dkv_call("dkdv")

    # ---- dQ (and per-element dS for the bias gradient): grid over (q blocks, B, H).
    bq, bk, warps_dq = geo.bq_dq, geo.bk_dq, blocks.dq_blocks[2]
    nq, nk = Sqp // bq, Skvp // bk
    meta_q = _loop_bounds(mask.block_classes(bq, bk))  # [B, nq, 4]
    in_specs = _q_row_specs(nq, bq, Skvp, Dqk, Dv, heads) + [
        pl.BlockSpec((None, bq, None, Dv), lambda i, b, h: (b, nq - 1 - i, h, 0)),
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i)),
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i)),
    ]
    args = [meta_q, q, k, v, *_mask_arrays(mask), dout, lse2, delta]
    out_specs = [pl.BlockSpec((None, bq, None, Dqk), lambda i, b, h: (b, nq - 1 - i, h, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, Sqp, H, Dqk), q.dtype)]
    if has_bias:
        in_specs.append(pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i)))
        args.append(ll)
        in_specs.append(_bias_spec(bias, (bq, Skvp), lambda i, b, h: (b, h, nq - 1 - i, 0)))
        args.append(bias)
        out_specs.append(pl.BlockSpec((None, None, bq, Skvp),
                                      lambda i, b, h: (b, h, nq - 1 - i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, Sqp, Skvp), jnp.float32))
    res = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, bk=bk, nk=nk, has_bias=has_bias),
        grid=(nq, B, H),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps=warps_dq, num_stages=blocks.num_stages_bwd),
        interpret=cfg.interpret,
        name="te_flash_attention_dq",
    )(*args)
    dq = res[0]
    dbias = None
    if has_bias:
        dbias = res[1]
        if bias.shape[0] == 1:
            dbias = dbias.sum(0, keepdims=True)
        if bias.shape[1] == 1:
            dbias = dbias.sum(1, keepdims=True)
    return dq, dk, dv, dbias


@lower_once(static_argnames=("cfg", "heads"))
def _bwd_impl(cfg: _Cfg, q, k, v, mask: AttentionMask, bias, out, lse, dout, dlse,
              heads: _Heads | None = None, stats=None):
    heads = heads or _Heads.of(q, k)
    Sq, Skv, Dqk, Dv = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    geo, qp, kp, vp, maskp, biasp = _prepare(cfg, heads, q, k, v, mask, bias)
    outp = _pad_axis(_pad_axis(out, 1, geo.sq_pad), 3, geo.dv_pad)
    doutp = _pad_axis(_pad_axis(dout.astype(out.dtype), 1, geo.sq_pad), 3, geo.dv_pad)
    shift, ll = _bwd_stats(lse, stats, bias is not None)
    shift = _pad_axis(shift, 2, geo.sq_pad)
    ll = None if ll is None else _pad_axis(ll, 2, geo.sq_pad)
    dlsep = None if dlse is None else _pad_axis(dlse, 2, geo.sq_pad)
    dq, dk, dv, dbias = _bwd_padded(cfg, geo, heads, qp, kp, vp, maskp, biasp, outp, shift, ll, doutp,
                                    dlsep)
    dq = dq[:, :Sq, :, :Dqk]
    dk = dk[:, :Skv, :, :Dqk]
    dv = dv[:, :Skv, :, :Dv]
    if dbias is not None:
        dbias = dbias[:, :, :Sq, :Skv].astype(bias.dtype)
    return dq, dk, dv, dbias


# --------------------------------------------------------------------------------------
# custom_vjp and public entry points
# --------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, mask, bias):
    return _fwd_impl(cfg, q, k, v, mask, bias)


def _flash_fwd(cfg, q, k, v, mask, bias):
    out, lse, stats = _fwd_impl(cfg, q, k, v, mask, bias, with_stats=True)
    return (out, lse), (q, k, v, mask, bias, out, lse, stats)


def _flash_bwd(cfg, res, cts):
    q, k, v, mask, bias, out, lse, stats = res
    dout, dlse = cts
    dq, dk, dv, dbias = _bwd_impl(cfg, q, k, v, mask, bias, out, lse, dout, dlse, stats=stats)
    return dq, dk, dv, None, dbias  # None: no cotangent for the (integer) mask


_flash.defvjp(_flash_fwd, _flash_bwd)

_STATIC = ("scale", "softcap", "block_sizes", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_attention(q, k, v, mask: AttentionMask, bias=None, *, scale: float,
                    softcap: float | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool | None = None):
    """Flash attention with a custom VJP. Returns (out [B,Sq,H,Dv] q.dtype, lse [B,H,Sq] f32).

    mask: an `AttentionMask` ([B, Sq] / [B, Skv] segment ids and positions, causal, window).
    Differentiable in q, k, v, bias, including through lse (a nonzero lse cotangent enters
    the backward as delta = rowsum(dout * out) - dlse).
    """
    mask = _check_mask(mask, "flash_attention")
    cfg = _make_cfg(q, v, mask, scale, softcap, block_sizes, interpret)
    return _flash(cfg, q, k, v, mask, bias)


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_attention_fwd(q, k, v, mask: AttentionMask, bias=None, *, scale: float,
                        softcap: float | None = None, block_sizes: BlockSizes | None = None,
                        interpret: bool | None = None):
    """Forward only (no custom_vjp): (out, lse). For context parallelism."""
    mask = _check_mask(mask, "flash_attention_fwd")
    cfg = _make_cfg(q, v, mask, scale, softcap, block_sizes, interpret)
    return _fwd_impl(cfg, q, k, v, mask, bias)


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_attention_bwd(q, k, v, mask: AttentionMask, bias, out, lse, dout, dlse=None, *, scale: float,
                        softcap: float | None = None, block_sizes: BlockSizes | None = None,
                        interpret: bool | None = None):
    """Gradients (dq, dk, dv, dbias or None) given the saved out/lse and the cotangents.

    ``out``/``lse`` may come from a larger computation (e.g. merged across context-parallel
    steps): P is recomputed as exp(s - lse) for this k/v chunk. With a bias so large and negative
    that it fills a whole row (|m| >~ 1e7), fp32 ``lse = m + log l`` has lost ``log l`` and this
    entry cannot recover it; `flash_attention` (whose residuals keep m and log l apart) is exact there.
    """
    mask = _check_mask(mask, "flash_attention_bwd")
    cfg = _make_cfg(q, v, mask, scale, softcap, block_sizes, interpret)
    return _bwd_impl(cfg, q, k, v, mask, bias, out, lse, dout, dlse)


# --------------------------------------------------------------------------------------
# Packed inputs: one tensor holding q, k and v (or k and v), read where it lies
# --------------------------------------------------------------------------------------
# layout -> (tensor holding q too?, axis of the 2/3 (None: heads h+2g on one axis))
PACKED_LAYOUTS = {
    "bs3hd": ("qkv", 2),       # [B, S, 3, H, D]         (H == G)
    "bsh3d": ("qkv", 3),       # [B, S, H, 3, D]         (H == G)
    "bs(h+2g)d": ("qkv", None),  # [B, S, H + 2G, D]     (q heads, then k, then v)
    "bshd_bs2hd": ("kv", 2),   # q [B, Sq, H, D], kv [B, S, 2, G, D]
    "bshd_bsh2d": ("kv", 3),   # q [B, Sq, H, D], kv [B, S, G, 2, D]
}


@dataclasses.dataclass(frozen=True)
class _Packed:
    """A packed layout with its head counts: how to view it, where its heads are, its gradient."""

    layout: str
    h: int
    g: int

    @property
    def has_q(self) -> bool:
        return PACKED_LAYOUTS[self.layout][0] == "qkv"

    @property
    def n(self) -> int:  # parts along the packing axis (3 or 2)
        return 3 if self.has_q else 2

    def expected_shape(self, b, s, d) -> tuple[int, ...]:
        h, g = self.h, self.g
        return {"bs3hd": (b, s, 3, h, d), "bsh3d": (b, s, h, 3, d), "bs(h+2g)d": (b, s, h + 2 * g, d),
                "bshd_bs2hd": (b, s, 2, g, d), "bshd_bsh2d": (b, s, g, 2, d)}[self.layout]

    def heads(self) -> _Heads:
        h, g = self.h, self.g
        if self.layout in ("bs3hd", "bs(h+2g)d"):
            return _Heads(h, g, 0, 1, h, 1, h + g, 1)
        if self.layout == "bsh3d":
            return _Heads(h, g, 0, 3, 1, 3, 2, 3)
        if self.layout == "bshd_bs2hd":
            return _Heads(h, g, 0, 1, 0, 1, g, 1)
        return _Heads(h, g, 0, 1, 0, 2, 1, 2)  # bshd_bsh2d

    def view(self, packed):
        """[B, S, heads, D] view of the packed tensor: a reshape of contiguous axes (no copy)."""
        B, S, D = packed.shape[0], packed.shape[1], packed.shape[-1]
        return packed.reshape(B, S, math.prod(packed.shape[2:-1]), D)

    def split(self, packed):
        """The fallback: (q or None, k, v) sliced out in XLA (copies)."""
        if self.layout == "bs(h+2g)d":
            h, g = self.h, self.g
            return packed[:, :, :h], packed[:, :, h:h + g], packed[:, :, h + g:]
        axis = PACKED_LAYOUTS[self.layout][1]
        parts = [lax.index_in_dim(packed, i, axis, keepdims=False) for i in range(self.n)]
        return tuple(parts) if self.has_q else (None, *parts)

    def assemble(self, dq, dk, dv):
        """Gradient of the packed tensor from dq (qkv layouts), dk, dv."""
        parts = [dq, dk, dv] if self.has_q else [dk, dv]
        if self.layout == "bs(h+2g)d":
            return jnp.concatenate(parts, axis=2)
        return jnp.stack(parts, axis=PACKED_LAYOUTS[self.layout][1])


def _check_packed(qkv, layout, num_heads, num_kv_heads):
    """(spec, q or None, packed) after checking the shapes; ValueError names what is wrong."""
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a packed layout; expected one of {tuple(PACKED_LAYOUTS)}")
    h = int(num_heads)
    g = h if num_kv_heads is None else int(num_kv_heads)
    if layout in ("bs3hd", "bsh3d") and h != g:
        raise ValueError(f"layout={layout!r} packs as many k/v heads as q heads; got num_heads={h}, "
                         f"num_kv_heads={g} (use 'bs(h+2g)d' for grouped-query packing)")
    pk = _Packed(layout, h, g)
    if pk.has_q:
        if isinstance(qkv, (tuple, list)):
            if len(qkv) != 1:
                raise ValueError(f"layout={layout!r} takes one packed tensor, got {len(qkv)}")
            qkv = qkv[0]
        q, packed = None, qkv
    else:
        if not isinstance(qkv, (tuple, list)) or len(qkv) != 2:
            raise ValueError(f"layout={layout!r} takes (q, kv); got {type(qkv).__name__}")
        q, packed = qkv
        if q.ndim != 4 or q.shape[2] != h:
            raise ValueError(f"q shape {tuple(q.shape)} is not [B, Sq, num_heads={h}, D]")
    if packed.ndim < 4:
        raise ValueError(f"packed shape {tuple(packed.shape)} has rank {packed.ndim}, layout={layout!r} "
                         f"expects {pk.expected_shape('B', 'S', 'D')}")
    B, S, D = packed.shape[0], packed.shape[1], packed.shape[-1]
    if tuple(packed.shape) != pk.expected_shape(B, S, D):
        raise ValueError(f"packed shape {tuple(packed.shape)} does not match layout={layout!r} with "
                         f"num_heads={h}, num_kv_heads={g}: expected {pk.expected_shape(B, S, D)}")
    if q is not None and (q.shape[0] != B or q.shape[-1] != D):
        raise ValueError(f"q shape {tuple(q.shape)} and kv shape {tuple(packed.shape)} need the same batch "
                         f"and head dim")
    return pk, q, packed


def packed_in_place_reason(qkv, *, layout: str, num_heads: int, num_kv_heads: int | None = None,
                           block_sizes: BlockSizes | None = None) -> str | None:
    """None when `flash_attention_packed` reads the packed tensor in place, else why it slices.

    In place needs no padding of the packed tensor: its sequence length a multiple of the
    kernels' blocks and its head dim a power of two >= 16 (what `_prepare` would pad to). A
    separate q (KV-packed layouts) may still be padded: that is q's own copy. Takes arrays or
    anything with .shape/.dtype (jax.ShapeDtypeStruct).
    """
    pk, q, packed = _check_packed(qkv, layout, num_heads, num_kv_heads)
    S, D = packed.shape[1], packed.shape[-1]
    cfg = _make_cfg(packed, packed, None, 1.0, None, block_sizes, True)
    sq = S if q is None else q.shape[1]
    geo = _geometry(cfg, sq, S, D, D)
    why = []
    if geo.skv_pad != S or (q is None and geo.sq_pad != S):
        pad = geo.skv_pad if q is not None else max(geo.sq_pad, geo.skv_pad)
        why.append(f"sequence length {S} is not a multiple of the kernel blocks (it would be padded to {pad})")
    if geo.dqk_pad != D:
        why.append(f"head_dim {D} is not a power of two >= 16 (it would be padded to {geo.dqk_pad})")
    return "; ".join(why) if why else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash_packed(cfg, pk: _Packed, q, packed, mask, bias):
    return _flash_packed_fwd(cfg, pk, q, packed, mask, bias)[0]


def _packed_operands(pk: _Packed, q, packed):
    view = pk.view(packed)
    return (view if q is None else q), view, view


def _flash_packed_fwd(cfg, pk, q, packed, mask, bias):
    qa, ka, va = _packed_operands(pk, q, packed)
    out, lse, stats = _fwd_impl(cfg, qa, ka, va, mask, bias, heads=pk.heads(), with_stats=True)
    return (out, lse), (q, packed, mask, bias, out, lse, stats)


def _flash_packed_bwd(cfg, pk, res, cts):
    q, packed, mask, bias, out, lse, stats = res
    dout, dlse = cts
    qa, ka, va = _packed_operands(pk, q, packed)
    dq, dk, dv, dbias = _bwd_impl(cfg, qa, ka, va, mask, bias, out, lse, dout, dlse, heads=pk.heads(),
                                  stats=stats)
    if q is None:
        return None, pk.assemble(dq, dk, dv), None, dbias
    return dq, pk.assemble(None, dk, dv), None, dbias


_flash_packed.defvjp(_flash_packed_fwd, _flash_packed_bwd)


@functools.partial(jax.jit, static_argnames=_STATIC + ("layout", "num_heads", "num_kv_heads"))
def flash_attention_packed(qkv, mask: AttentionMask, bias=None, *, layout: str, num_heads: int,
                           num_kv_heads: int | None = None, scale: float, softcap: float | None = None,
                           block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """`flash_attention` on packed inputs. Returns (out [B, Sq, H, D], lse [B, H, Sq] f32).

    qkv: the packed tensor for "bs3hd" [B, S, 3, H, D], "bsh3d" [B, S, H, 3, D] and
    "bs(h+2g)d" [B, S, H + 2G, D]; the pair (q [B, Sq, H, D], kv) for "bshd_bs2hd"
    (kv [B, S, 2, G, D]) and "bshd_bsh2d" (kv [B, S, G, 2, D]). num_heads H, num_kv_heads G
    (default H) say how the head axis splits.

    Two paths, decided from static shapes (`packed_in_place_reason` says which and why):
    - in place: the packed tensor is reshaped (free, contiguous axes) to [B, S, heads, D] and passed
      as q, k and v of the same pallas_calls; the BlockSpec index maps add each part's head offset
      (and stride for the interleaved forms). No slice of the input is made.
    - split: when the packed tensor would need padding (sequence not a multiple of the blocks,
      head dim not a power of two >= 16), it is sliced into q, k, v in XLA and `flash_attention`
      runs on them.
    Either way the gradient comes back in the packed form (in place: dq, dk, dv are written by the
    kernels separately and stacked/concatenated into the packed shape).
    """
    pk, q, packed = _check_packed(qkv, layout, num_heads, num_kv_heads)
    mask = _check_mask(mask, "flash_attention_packed")
    cfg = _make_cfg(packed, packed, mask, scale, softcap, block_sizes, interpret)
    if packed_in_place_reason(qkv, layout=layout, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              block_sizes=cfg.blocks) is None:
        return _flash_packed(cfg, pk, q, packed, mask, bias)
    qs, k, v = pk.split(packed)
    return _flash(cfg, qs if q is None else q, k, v, mask, bias)
