"""FP8 quantization math and the FP8 GEMM with its custom VJP (TransformerEngine's `jax/quantize` role).

Conventions (TransformerEngine's): a per-tensor `scale` MULTIPLIES before the cast,
    q = saturate(x * scale) -> float8,   x ~= q * scale_inv,   scale_inv = 1 / scale,
    scale = fp8_max / amax / 2**margin.
flax's fp8_ops stores the reciprocal (its "scale" divides); the numbers are the same.

Saturating casts: x * scale is clipped to [-fp8_max, fp8_max] before the convert, so an overflow
(amax grown past what a delayed scale expected) saturates instead of giving inf/NaN. A zero, tiny (the
scale would be inf) or non-finite amax keeps the previous scale (TE's rule, `compute_scale`).

Delayed scaling (`delayed_update`, TE's amax-history rule): this step's amax goes to amax_history[0];
the NEXT step's scale is computed from the whole window (max over it, or amax_history[0] for
"most_recent"); the history then rotates by -1 and slot 0 is zeroed:
    [a_t, a_1, ..., a_{L-1}] -> scale_{t+1} = f(window) -> [0, a_2, ..., a_{L-1}, a_t]
A non-finite amax is not recorded (0 is written instead) and leaves the scale as it was.

fp8_dot_general(x, w, dimension_numbers, recipe, state) is lax.dot_general with FP8 operands:
  forward   y    = dot(q(x) [fwd dtype], q(w) [fwd dtype]) * scale_inv_x * scale_inv_w
  backward  dx   = dot(q(g) [bwd dtype], q(w)) * scale_inv_g * scale_inv_w          (dgrad, FP8)
            dw   = dot(q(x), q(g)) * scale_inv_x * scale_inv_g                     (wgrad, FP8)
  HYBRID: fwd dtype float8_e4m3fn, bwd (the output gradient g) float8_e5m2; E4M3: both e4m3fn.
  The residuals saved for the backward are q(x) and q(w) in FP8 (half the bytes of bf16).
  Two GEMM styles (module variable GEMM_STYLE, env TE_JAX_FP8_GEMM):
    "direct": dot_general on the float8 operands (preferred_element_type = the compute dtype), then the
              product of the two scale_invs: XLA's GPU GEMM rewriter turns an f8 x f8 dot into
              __cublas$lt$matmul$f8 (flax's Fp8DirectDotGeneralOp). On a GPU with FP8 tensor cores (compute
              capability 8.9 or newer; `f8_dot`, `fp8_tensor_cores`) the dot names the
              algorithm DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM (what DEFAULT precision gives cuBLASLt
              anyway) and the scale multiplies the output in the output dtype: Triton's GEMM fusion refuses that
              algorithm, so the FP8 GEMM rewriter sees dot and multiply together and folds the scale into the
              cuBLASLt call (its d_scale), with no pass over the output and no GEMM autotuning at compile time.
              The folded scale is the product of the scale_invs rounded to the output dtype (bf16: a factor
              within 2^-9 of it, the same for the whole output); the output is rounded once, after the scale
              (benchmarks/results/fp8_layer_h100.md, fp8_gemm_probe);
    "qdq":    dot_general on dequantized operands (convert(f8) -> compute dtype -> * scale_inv), flax's
              Fp8DotGeneralOp pattern. On the H100 with jax 0.11.2 it is an FP8 GEMM (scales folded, no extra
              pass) only when the step is compiled with xla_gpu_enable_triton_gemm=False; by default XLA puts
              the converts into a Triton fusion and runs bf16 GEMMs (benchmarks/results/fp8_layer_h100.md);
    "wgrad_qdq": the weight-gradient GEMMs as qdq (their output feeds no cast kernel that could take the
              scale, so "direct" pays a pass over dw for it), every other GEMM as direct.
  On CPU both run as upcast GEMMs; the HLO still carries the f8 converts.
  state (DelayedScaling only; None otherwise): a dict of fp32 arrays
      input_scale (1,), input_amax_history (L,), kernel_scale (1,), kernel_amax_history (L,),
      output_grad_scale (1,), output_grad_amax_history (L,)
  (flax's Fp8DotGeneralBase names). The custom_vjp returns the UPDATED state as the "gradient" of
  `state`: the forward's new input/kernel scales and histories are computed in the forward and handed
  out by the backward; the output-gradient ones are computed in the backward. This is how flax's
  Fp8DotGeneralOp moves values out of a backward pass (its OVERWRITE_WITH_GRADIENT collection), and
  TransformerEngine-JAX's fp8_meta handling before it: the train step replaces the collection by its
  gradient (te_jax.fp8.flax.update_fp8_state). Consequences: the state only advances when gradients
  are taken; a GEMM used twice in one step sums its two "gradients" (do not share FP8 state); a scale
  that arrives as 0 or non-finite (a GEMM whose output did not reach the loss gets a zero "gradient")
  is read as 1.
  Float8CurrentScaling: the amax of x, w (forward) and g (backward) is computed on the spot.
  Float8BlockScaling: FP8 GEMMs with block scales where te_jax/fp8/block.py takes the operands (an sm90 GPU
  with jax >= 0.11, M, K and N multiples of 128, no mesh axis XLA partitions; TE_JAX_FP8_BLOCK_GEMM
  overrides), else a reference implementation (blockwise quantize -> dequantize -> GEMM in the compute
  dtype; NOT an FP8 GEMM). Only dense dimension numbers (x's trailing axes with w's leading axes, no
  batch axes).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp8_cast import cast_transpose, cast_transpose_many, cast_transposed, many_block
from pallas_kernels.fp8_cast.history import MAX_HISTORY, delayed_update_many
from pallas_kernels.fp8_gemm import quantize_blocks
from te_jax._compat import gpu_compute_capability
from te_jax.backends import policy
from te_jax.fp8 import norm_cast as _nc
from te_jax.fp8.block import block_gemm_mode, block_gemm_reason, block_scaled_dot
from te_jax.fp8.fused import fused_cast_unavailable, keep_weight_copies, launch_env, launch_options, state_update_kernel
from te_jax.fp8.recipe import DelayedScaling, Float8BlockScaling, check_recipe

GEMM_STYLES = ("direct", "qdq", "wgrad_qdq")
#: Default GEMM style (see the module docstring); TE_JAX_FP8_GEMM overrides it at trace time.
GEMM_STYLE = "direct"

STATE_KEYS = ("input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history",
              "output_grad_scale", "output_grad_amax_history")


def gemm_style() -> str:
    return policy.env_choice("TE_JAX_FP8_GEMM", GEMM_STYLES, GEMM_STYLE)


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def amax(x) -> jax.Array:
    """max |x| as an fp32 scalar."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def compute_scale(amax_value, scale, fmax, margin=0):
    """fp8_max / amax / 2**margin, or `scale` where amax is 0 or non-finite or the result is not finite."""
    amax_value = jnp.asarray(amax_value, jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    safe = jnp.where(amax_value > 0, amax_value, 1.0)
    sf = (jnp.float32(fmax) / safe) / jnp.float32(2.0 ** margin)
    ok = (amax_value > 0) & jnp.isfinite(amax_value) & jnp.isfinite(sf)
    return jnp.where(ok, sf, scale)


def delayed_update(amax_history, scale, new_amax, fmax, margin=0, algo="max"):
    """One delayed-scaling update (TE's rule; see the module docstring).

    amax_history [L] fp32, scale [1] or scalar fp32, new_amax this step's amax (scalar).
    Returns (next_scale like scale, next_history [L]).
    """
    new_amax = jnp.asarray(new_amax, jnp.float32)
    finite = jnp.isfinite(new_amax)
    h = amax_history.astype(jnp.float32).at[0].set(jnp.where(finite, new_amax, 0.0))
    window = jnp.max(h) if algo == "max" else h[0]
    nxt = jnp.where(finite, compute_scale(window, scale, fmax, margin), jnp.asarray(scale, jnp.float32))
    h = jnp.roll(h, -1).at[0].set(0.0)
    return nxt, h


def delayed_updates(recipe, items, interpret, kernel):
    """delayed_update for each of items [(history [L], scale, this step's amax, fmax), ...] under recipe (a
    DelayedScaling) -> [(next scale (1,), next history [L]), ...]. A fused path's states: in one kernel
    (pallas_kernels.fp8_cast.history, the same values) where `kernel` (its cfg's fused.state_update_kernel(), read
    before its custom_vjp: a setting read inside would be cached with the traced function) and L <= the kernel's
    MAX_HISTORY, else as XLA ops per tensor. interpret: the fused path's (None: interpret off a GPU)."""
    if kernel and items[0][0].shape[0] <= MAX_HISTORY:
        scales, hists = delayed_update_many([h for h, _, _, _ in items], [s for _, s, _, _ in items],
                                            [a for _, _, a, _ in items], [f for _, _, _, f in items],
                                            margin=recipe.margin, algo=recipe.amax_compute_algo, interpret=interpret)
        return list(zip(scales, hists))
    out = []
    for h, s, a, f in items:
        nxt, nh = delayed_update(h, s, a, f, recipe.margin, recipe.amax_compute_algo)
        out.append((nxt.reshape(1), nh))
    return out


def quantize(x, scale, dtype):
    """Saturating cast: clip(x * scale, -fp8_max, fp8_max) -> dtype (math in fp32: never inf/NaN from range)."""
    m = fp8_max(dtype)
    y = x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32).reshape(())
    return jnp.clip(y, -m, m).astype(dtype)


def dequantize(q, scale_inv, dtype):
    """q (FP8) -> dtype, times scale_inv: the convert-then-multiply pattern XLA's GEMM rewriter matches."""
    return q.astype(dtype) * jnp.asarray(scale_inv, jnp.float32).reshape(()).astype(dtype)


def qdq(x, scale, dtype):
    """Quantize then dequantize back to x.dtype (what the FP8 GEMM sees of x)."""
    return dequantize(quantize(x, scale, dtype), 1.0 / jnp.asarray(scale, jnp.float32), x.dtype)


def init_state(amax_history_len: int) -> dict:
    """Initial delayed-scaling state of one GEMM: scales 1, histories 0 (TE's and flax's init)."""
    ones = jnp.ones((1,), jnp.float32)
    zeros = jnp.zeros((amax_history_len,), jnp.float32)
    return {k: (ones if k.endswith("scale") else zeros) for k in STATE_KEYS}


def _read_scale(s):
    """A stored scale; 0 or non-finite (e.g. a zero 'gradient' of the state) reads as 1."""
    s = jnp.asarray(s, jnp.float32).reshape(())
    return jnp.where((s > 0) & jnp.isfinite(s), s, 1.0)


# --- dimension numbers of the two backward GEMMs (after flax.linen.fp8_ops, which follows jax's
# dot_general transpose rules) ---------------------------------------------------------------------

def _ranges_like(*xs):
    start = 0
    for x in xs:
        yield range(start, start + len(x))
        start += len(x)


def _remaining(original, *removed_lists):
    removed = set(a for lst in removed_lists for a in lst)
    return [i for i in original if i not in removed]


def _transpose_lhs(g, y, x_ndim, dimension_numbers, gemm, swap_ans=False):
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(range(x_ndim), x_contract, x_batch)
    y_kept = _remaining(range(y.ndim), y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_sorted_by_y)
    return lax.transpose(gemm(g, y, dims), tuple(int(a) for a in out_axes))


def _transpose_rhs(g, x, y_ndim, dimension_numbers, gemm):
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(g, x, y_ndim, swapped, gemm, swap_ans=True)


#: The dot algorithm of an FP8 GEMM on a GPU (see the module docstring's "direct"); the CPU has none.
F8_GPU_ALGORITHM = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM


def fp8_tensor_cores() -> bool:
    """Whether the default device is a GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper and
    later), where the FP8 dots take F8_GPU_ALGORITHM and their scale folds into cuBLASLt. Elsewhere (the CPU, older
    or non-CUDA GPUs) the dots keep DEFAULT precision: XLA upcasts them."""
    return (gpu_compute_capability() or (0, 0)) >= (8, 9)


def f8_dot(a, b, dims, out_dtype):
    """dot_general of two float8 operands -> out_dtype: with the F8_GPU_ALGORITHM preset where fp8_tensor_cores()
    (Triton's GEMM fusion refuses it, so the dot reaches XLA's FP8 cuBLASLt rewrite as written), elsewhere at
    DEFAULT precision (a global jax_default_matmul_precision="highest" must not reach the FP8 dots either way)."""
    precision = F8_GPU_ALGORITHM if fp8_tensor_cores() else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)


def _scaled_gemm(style, out_dtype, a_sinv, b_sinv):
    """GEMM of two FP8 operands with per-tensor scale_invs, output in out_dtype."""
    s = (a_sinv * b_sinv).astype(jnp.float32)
    fold = fp8_tensor_cores()  # the scale folded into the cuBLASLt call (module docstring, "direct")

    # Every dot names its precision (f8_dot: the FP8 algorithm on FP8 tensor cores, else DEFAULT, as flax's fp8_ops
    # does): a global jax_default_matmul_precision="highest" must not reach the FP8 dots.
    def gemm(a, b, dims):
        if style == "qdq":  # (wgrad_qdq is direct here: its wgrad GEMMs call with wgrad_style(style) == "qdq")
            # the FP8 values pass a barrier: where XLA made them (the unfused path's quantize), its GPU pipeline
            # would otherwise fold convert(convert(x, f8), bf16) into x and the GEMM would run unquantized (found
            # on an H100 by test_wgrad_qdq_style_runs_only_the_weight_gradient_as_qdq; block_qdq has the same)
            a, b = lax.optimization_barrier((a, b))
            return lax.dot_general(dequantize(a, a_sinv, out_dtype), dequantize(b, b_sinv, out_dtype), dims,
                                   precision=lax.Precision.DEFAULT, preferred_element_type=out_dtype)
        y = f8_dot(a, b, dims, out_dtype)
        if fold:
            return y * s.astype(out_dtype)
        return (y.astype(jnp.float32) * s).astype(out_dtype)

    return gemm


def wgrad_style(style: str) -> str:
    """The style of the weight-gradient GEMMs: "wgrad_qdq" runs them as qdq (cuBLASLt folds both scales into the
    FP8 call, with xla_gpu_enable_triton_gemm=False) and every other GEMM as direct."""
    return "qdq" if style == "wgrad_qdq" else style


def _canonical_dn(dimension_numbers):
    (xc, wc), (xb, wb) = dimension_numbers
    return ((tuple(int(a) for a in xc), tuple(int(a) for a in wc)), (tuple(int(a) for a in xb),
                                                                     tuple(int(a) for a in wb)))


# --- per-tensor recipes (delayed, current) ---------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _per_tensor_dot(x, w, state, dn, recipe, dtypes, style):
    return _per_tensor_fwd(x, w, state, dn, recipe, dtypes, style)[0]


def _forward_scales(recipe, state, x, w):
    """(scale of x, scale of w, the forward's updated state or None, the output-gradient state or None)."""
    fmax = recipe.fp8_format.max_fwd
    ax, aw = amax(x), amax(w)
    if isinstance(recipe, DelayedScaling):
        sx, sw = _read_scale(state["input_scale"]), _read_scale(state["kernel_scale"])
        nx, hx = delayed_update(state["input_amax_history"], sx, ax, fmax, recipe.margin, recipe.amax_compute_algo)
        nw, hw = delayed_update(state["kernel_amax_history"], sw, aw, fmax, recipe.margin,
                                recipe.amax_compute_algo)
        return sx, sw, (nx.reshape(1), hx, nw.reshape(1), hw), (state["output_grad_scale"],
                                                                 state["output_grad_amax_history"])
    # current scaling: this tensor's own amax
    return compute_scale(ax, 1.0, fmax), compute_scale(aw, 1.0, fmax), None, None


def _grad_scale(recipe, g_state, fwd_state, g):
    """(scale of the output gradient g, the state's "gradient": the updated state, or None)."""
    bmax = recipe.fp8_format.max_bwd
    ag = amax(g)
    if isinstance(recipe, DelayedScaling):
        sg = _read_scale(g_state[0])
        ng, hg = delayed_update(g_state[1], sg, ag, bmax, recipe.margin, recipe.amax_compute_algo)
        return sg, dict(zip(STATE_KEYS, fwd_state + (ng.reshape(1), hg)))
    return compute_scale(ag, 1.0, bmax), None


def _per_tensor_fwd(x, w, state, dn, recipe, dtypes, style):
    fdt = recipe.fp8_format.fwd_dtype
    sx, sw, fwd_state, g_state = _forward_scales(recipe, state, x, w)
    xq, wq = quantize(x, sx, fdt), quantize(w, sw, fdt)
    sxi, swi = 1.0 / sx, 1.0 / sw
    y = _scaled_gemm(style, dtypes[2], sxi, swi)(xq, wq, dn)
    return y, (xq, sxi, wq, swi, fwd_state, g_state)


def _per_tensor_bwd(dn, recipe, dtypes, style, res, g):
    xq, sxi, wq, swi, fwd_state, g_state = res
    bdt = recipe.fp8_format.bwd_dtype
    sg, state_ct = _grad_scale(recipe, g_state, fwd_state, g)
    gq = quantize(g, sg, bdt)
    sgi = 1.0 / sg
    dx = _transpose_lhs(gq, wq, xq.ndim, dn, _scaled_gemm(style, dtypes[0], sgi, swi))
    dw = _transpose_rhs(gq, xq, wq.ndim, dn, _scaled_gemm(wgrad_style(style), dtypes[1], sxi, sgi))
    return dx.astype(dtypes[0]), dw.astype(dtypes[1]), state_ct


_per_tensor_dot.defvjp(_per_tensor_fwd, _per_tensor_bwd)


# --- block scaling (reference implementation) ------------------------------------------------------

def block_qdq(a, tile, dtype, out_dtype):
    """Quantize a 2D array with one scale per (tile[0] x tile[1]) tile, dequantize (the block recipe's numerics:
    pallas_kernels.fp8_gemm.quantize_blocks, scale = amax / fp8_max, 1 for an all-zero tile).

    A tile larger than the array shrinks to it; edges that do not fill a tile are padded with zeros (which do not
    change a tile's amax). Returns an array of a's shape in out_dtype.

    The FP8 values pass an optimization barrier: XLA's GPU pipeline (simplify-fp-conversions, with excess precision
    allowed, its default) would otherwise fold the f32 -> FP8 -> f32 converts into nothing, and the recipe would
    silently compute in full precision on a GPU (found by tests/test_fp8_block_gemm.py on an H100).
    """
    r, c = a.shape
    tr, tc = min(tile[0], r), min(tile[1], c)
    ap = jnp.pad(a.astype(jnp.float32), ((0, -r % tr), (0, -c % tc)))
    q, scale_inv = quantize_blocks(ap, (tr, tc), dtype)
    q = jax.lax.optimization_barrier(q)
    dq = q.astype(jnp.float32) * jnp.repeat(jnp.repeat(scale_inv, tr, axis=0), tc, axis=1)
    return dq[:r, :c].astype(out_dtype)


def _dense_split(dn, x_ndim, w_ndim):
    """For dense dimension numbers (x's trailing axes with w's leading axes, in order, no batch):
    the number of contracted axes; else None."""
    (xc, wc), (xb, wb) = dn
    n = len(xc)
    if xb or wb or tuple(xc) != tuple(range(x_ndim - n, x_ndim)) or tuple(wc) != tuple(range(n)):
        return None
    return n


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _block_dot(x, w, dn, recipe, dtypes):
    return _block_fwd(x, w, dn, recipe, dtypes)[0]


def _block_fwd(x, w, dn, recipe, dtypes):
    """x [..., K...] and w [K..., N...] flattened to x2 [M, K], w2 [K, N]."""
    fdt = recipe.fp8_format.fwd_dtype
    n = _dense_split(dn, x.ndim, w.ndim)
    k = math.prod(x.shape[x.ndim - n:])
    x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
    xd = block_qdq(x2, (1, recipe.x_block), fdt, dtypes[2])               # 1 x 128 tiles along K
    wd = block_qdq(w2, (recipe.w_block, recipe.w_block), fdt, dtypes[2])  # 128 x 128 tiles
    y = jnp.dot(xd, wd, preferred_element_type=dtypes[2])
    return y.reshape(x.shape[:x.ndim - n] + w.shape[n:]), (x2, wd)


def _block_bwd(dn, recipe, dtypes, res, g):
    x2, wd = res
    dtypes, x_shape, w_shape = dtypes[:3], dtypes[3], dtypes[4]
    fdt, bdt = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    g2 = g.reshape(x2.shape[0], wd.shape[1])
    gd_row = block_qdq(g2, (1, recipe.x_block), bdt, dtypes[0])   # dgrad g @ w^T: 1 x 128 tiles along N
    dx = jnp.dot(gd_row, wd.T.astype(dtypes[0]), preferred_element_type=dtypes[0])
    xd_col = block_qdq(x2, (recipe.x_block, 1), fdt, dtypes[1])   # wgrad x^T @ g: 128 x 1 tiles along M
    gd_col = block_qdq(g2, (recipe.x_block, 1), bdt, dtypes[1])
    dw = jnp.dot(xd_col.T, gd_col, preferred_element_type=dtypes[1])
    return dx.reshape(x_shape).astype(dtypes[0]), dw.reshape(w_shape).astype(dtypes[1])


_block_dot.defvjp(_block_fwd, _block_bwd)


# --- dense GEMMs with every FP8 operand K-major ("TN", what cuBLASLt's FP8 GEMM takes), fused casts ---------
#
# x [..., K...] . w [K..., N...] flattened to x2 [M, K], w2 [K, N]. Each of the three GEMMs contracts the
# minor (last) axis of both operands, so XLA transposes no FP8 array (its transposes of 1-byte arrays ran at a
# tenth of the copy bandwidth on the H100, and it moves a transpose of the bf16 input past the cast onto the FP8
# array: benchmarks/results/fp8_layer_h100.md). The transposed FP8 copies come from the Pallas cast_transpose
# kernel, which writes an array and its transpose from one read (te_jax/fp8/fused.py says when it runs):
#   forward  y  = x2_q [M, K] . (w2^T)_q [N, K]
#   dgrad    dx = g_q  [M, N] . w2_q     [K, N]      (w2_q re-cast from w2 in the backward)
#   wgrad    dw = (x2^T)_q [K, M] . (g^T)_q [N, M]   ((x2^T)_q saved from the forward)
# Delayed scaling takes each amax from the kernel that casts (the NEXT step's scale); current scaling reduces
# the amax in XLA first, then casts.

_TN = (((1,), (1,)), ((), ()))


def _tn_gemm(a, b, out_dtype, a_sinv, b_sinv, style="direct"):
    """a [M, K] . b [N, K] -> [M, N] out_dtype, FP8 operands with per-tensor scale_invs (_scaled_gemm's style)."""
    return _scaled_gemm(style, out_dtype, a_sinv, b_sinv)(a, b, _TN)


def _cast_both(a, scale, dtype, interpret):
    """(a_q [M, N], a_qT [N, M], amax |a|) in one pass (pallas_kernels.fp8_cast.cast_transpose)."""
    return cast_transpose(a, jnp.asarray(scale, jnp.float32).reshape(()), out_dtype=dtype, interpret=interpret,
                          **launch_options("cast", interpret))


def _scale_then_cast(recipe, a, stored_scale, fmax, dtype, interpret, transposed_only=False):
    """(a_q, a_qT, amax, scale used): delayed scaling casts with the stored scale, current with a's own.
    transposed_only: a_q is not written (None; pallas_kernels.fp8_cast.cast_transposed)."""
    s = _read_scale(stored_scale) if isinstance(recipe, DelayedScaling) else compute_scale(amax(a), 1.0, fmax)
    if transposed_only:
        qt, am = cast_transposed(a, jnp.asarray(s, jnp.float32).reshape(()), out_dtype=dtype, interpret=interpret,
                                 **launch_options("weight", interpret))
        return None, qt, am, s
    q, qt, am = _cast_both(a, s, dtype, interpret)
    return q, qt, am, s


def _merged_casts(recipe, arrays, stored_scales, fmax, dtype, interpret, write_q):
    """Several arrays with the same rows cast in one kernel, their transposes stacked
    (pallas_kernels.fp8_cast.cast_transpose_many): (a_q each or None, the stacked a_qT, amax each, scale each)."""
    if isinstance(recipe, DelayedScaling):
        scales = [_read_scale(s) for s in stored_scales]
    else:
        scales = [compute_scale(amax(a), 1.0, fmax) for a in arrays]
    qs, qt, amaxes = cast_transpose_many(tuple(arrays), tuple(scales), out_dtype=dtype, write_q=write_q,
                                         interpret=interpret, **launch_options("weight", interpret))
    return qs, qt, list(amaxes), scales


def _split_cols(y, widths, sinvs, dtype):
    """y [R, sum(widths)] -> its column blocks, block i times sinvs[i] (in fp32), in dtype."""
    out, start = [], 0
    for w, s in zip(widths, sinvs):
        out.append((y[:, start:start + w].astype(jnp.float32) * s).astype(dtype))
        start += w
    return out


def _merge(cfg, kernels) -> bool:
    """Whether _tn_dense runs its GEMMs that share x_q / x_qT as one GEMM over stacked casts (cfg.merged_casts,
    several kernels of one dtype whose widths share a column tile)."""
    return (cfg.merged_casts and len(kernels) > 1 and len({w.dtype for w in kernels}) == 1
            and many_block([w.shape[1] for w in kernels], 128) is not None)


@dataclasses.dataclass(frozen=True)
class _TNCfg:
    recipe: object
    norm: object  # a te_jax.fp8.norm_cast.NormSpec (x is the norm's input; gamma / beta given) or None
    out_dtype: object
    style: str
    interpret: bool | None
    x_dtype: object  # dx's dtype
    keep_weights: bool = False  # fused.keep_weight_copies: the forward's FP8 weight copies go to the backward
    merged_casts: bool = False  # fused.merged_casts: GEMMs sharing x_q / x_qT run as one over stacked casts
    state_kernel: bool = dataclasses.field(default_factory=state_update_kernel)  # delayed_updates' kernel
    # the launch overrides of this trace (fused.launch_overrides, read inside the custom VJP): part of the cache key
    launch: str = dataclasses.field(default_factory=launch_env)
    skip: bool = False  # (with norm) x2 is also returned (last); its cotangent joins the norm's backward (norm_cast)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _tn_dense(x2, gamma, beta, kernels, states, cfg):
    """(x2 [M, K] (normalized first when cfg.norm) . kernels[i] [K, N_i] for each i): FP8 GEMMs from ONE cast of x2.
    states: one DelayedScaling state per kernel, or None. The first state's input scale casts x2 for every GEMM (the
    others' input histories still record its amax); each GEMM keeps its own kernel and output-gradient scales.
    cfg.skip (with cfg.norm): x2 itself comes last, for a skip connection; its gradient is added to the norm input's
    in the norm's backward pass."""
    return _tn_dense_fwd(x2, gamma, beta, kernels, states, cfg)[0]


def _tn_dense_fwd(x2, gamma, beta, kernels, states, cfg):
    recipe, fmt = cfg.recipe, cfg.recipe.fp8_format
    delayed = isinstance(recipe, DelayedScaling)
    fused_stats = _nc.stats_in_kernel(x2, cfg.norm, delayed)
    st = None if cfg.norm is None or fused_stats else _nc.stats(x2, gamma, beta, cfg.norm)
    if cfg.norm is None:
        xq, xtq, ax, sx = _scale_then_cast(recipe, x2, states[0]["input_scale"] if delayed else None, fmt.max_fwd,
                                           fmt.fwd_dtype, cfg.interpret)
    elif fused_stats:  # the norm's statistics inside the cast kernel (one read of x)
        sx = _read_scale(states[0]["input_scale"])
        xq, xtq, ax, st = _nc.stats_and_cast(x2, gamma, beta, sx, cfg.norm, fmt.fwd_dtype, cfg.interpret)
    else:
        sx = (_read_scale(states[0]["input_scale"]) if delayed else
              compute_scale(amax(_nc.output(x2, gamma, beta, st, cfg.norm)), 1.0, fmt.max_fwd))
        xq, xtq, ax = _nc.cast(x2, gamma, beta, st, sx, cfg.norm, fmt.fwd_dtype, interpret=cfg.interpret,
                               **launch_options("cast", cfg.interpret))
    if _merge(cfg, kernels):  # one GEMM over the weights' stacked transposes (fused.merged_casts)
        widths = [w.shape[1] for w in kernels]
        wqs, wtq_all, aws, sws = _merged_casts(recipe, kernels, [st_["kernel_scale"] for st_ in states] if delayed
                                               else [None] * len(kernels), fmt.max_fwd, fmt.fwd_dtype, cfg.interpret,
                                               write_q=cfg.keep_weights)
        y_all = _tn_gemm(xq, wtq_all, cfg.out_dtype, 1.0 / sx, 1.0, cfg.style)
        ys = _split_cols(y_all, widths, [1.0 / sw for sw in sws], cfg.out_dtype)
        wqs = list(wqs) if cfg.keep_weights else [None] * len(kernels)
    else:
        ys, sws, wqs, aws = [], [], [], []
        for i, w2 in enumerate(kernels):
            # the forward needs w's transposed copy; kept weights: the same cast writes w_q for the backward's dgrad,
            # else the backward re-casts w
            wq, wtq, aw, sw = _scale_then_cast(recipe, w2, states[i]["kernel_scale"] if delayed else None,
                                               fmt.max_fwd, fmt.fwd_dtype, cfg.interpret,
                                               transposed_only=not cfg.keep_weights)
            ys.append(_tn_gemm(xq, wtq, cfg.out_dtype, 1.0 / sx, 1.0 / sw, cfg.style))
            sws.append(sw)
            wqs.append(wq)
            aws.append(aw)
    new_fwd = []
    if delayed:  # every input and kernel history of the call in one update
        items = [item for i, s in enumerate(states) for item in (
            (s["input_amax_history"], _read_scale(s["input_scale"]), ax, fmt.max_fwd),
            (s["kernel_amax_history"], sws[i], aws[i], fmt.max_fwd))]
        ups = delayed_updates(recipe, items, cfg.interpret, cfg.state_kernel)
        for i, s in enumerate(states):
            new_fwd.append(ups[2 * i] + ups[2 * i + 1] + (s["output_grad_scale"], s["output_grad_amax_history"]))
    norm_res = None if cfg.norm is None else (x2, gamma, beta, st)
    outs = tuple(ys) + ((x2,) if cfg.skip else ())
    return outs, (xtq, 1.0 / sx, tuple(kernels), tuple(sws), tuple(wqs) if cfg.keep_weights else None,
                  tuple(new_fwd) if delayed else None, norm_res)


def _tn_dense_bwd(cfg, res, gs):
    xtq, sxi, kernels, sws, wqs, new_fwd, norm_res = res
    recipe, fmt = cfg.recipe, cfg.recipe.fp8_format
    x_dtype = cfg.x_dtype
    dskip = gs[-1] if cfg.skip else None
    g2s = [g.reshape(xtq.shape[1], w2.shape[1]) for w2, g in zip(kernels, gs)]
    stored = [f[4] for f in new_fwd] if new_fwd is not None else [None] * len(kernels)
    if _merge(cfg, kernels):  # the output gradients' transposes stacked: one weight-gradient GEMM
        gqs, gtq_all, ags, sgs = _merged_casts(recipe, g2s, stored, fmt.max_bwd, fmt.bwd_dtype, cfg.interpret,
                                               write_q=True)
        dw_all = _tn_gemm(xtq, gtq_all, kernels[0].dtype, sxi, 1.0, wgrad_style(cfg.style))
        dws = _split_cols(dw_all, [w.shape[1] for w in kernels], [1.0 / sg for sg in sgs], kernels[0].dtype)
    else:
        gqs, ags, sgs, dws = [], [], [], []
        for w2, g2, st_ in zip(kernels, g2s, stored):
            gq, gtq, ag, sg = _scale_then_cast(recipe, g2, st_, fmt.max_bwd, fmt.bwd_dtype, cfg.interpret)
            gqs.append(gq)
            ags.append(ag)
            sgs.append(sg)
            dws.append(_tn_gemm(xtq, gtq, w2.dtype, sxi, 1.0 / sg, wgrad_style(cfg.style)))  # wgrad
    dx, state_cts = None, []
    for i, (w2, sw) in enumerate(zip(kernels, sws)):
        # the values of the forward cast's w^T: its kept copy, or cast again
        wq = wqs[i] if wqs is not None else quantize(w2, sw, fmt.fwd_dtype)
        d = _tn_gemm(gqs[i], wq, x_dtype, 1.0 / sgs[i], 1.0 / sw, cfg.style)  # dgrad
        dx = d if dx is None else dx + d                                       # summed as autodiff would
    if new_fwd is not None:  # every output-gradient history of the call in one update
        ups = delayed_updates(recipe, [(f[5], sg, ag, fmt.max_bwd) for f, sg, ag in zip(new_fwd, sgs, ags)],
                              cfg.interpret, cfg.state_kernel)
        state_cts = [dict(zip(STATE_KEYS, f[:4] + up)) for f, up in zip(new_fwd, ups)]
    dgamma = dbeta = None
    if norm_res is not None:  # dx is the norm output's cotangent: through the norm's backward
        x2, gamma, beta, st = norm_res
        dx, dgamma, dbeta = _nc.backward(dx, x2, gamma, beta, st, cfg.norm, cfg.interpret, dres=dskip)
    return dx, dgamma, dbeta, tuple(dws), (tuple(state_cts) if new_fwd is not None else None)


_tn_dense.defvjp(_tn_dense_fwd, _tn_dense_bwd)


# --- public entry point ----------------------------------------------------------------------------

def fp8_dot_general(x, w, dimension_numbers, recipe, state=None, *, preferred_element_type=None,
                    gemm_style_override: str | None = None):
    """lax.dot_general(x, w, dimension_numbers) with FP8 operands under `recipe` (see the module docstring).

    x, w: floating arrays (the compute dtype, e.g. bf16; fp32 works). Output dtype:
    preferred_element_type or x.dtype. dx has x.dtype, dw has w.dtype.
    state: DelayedScaling's dict (init_state(recipe.amax_history_len)); None for the other recipes.
    The updated state comes back as the gradient with respect to `state`.
    """
    check_recipe(recipe, "fp8_dot_general: recipe")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating) or jnp.dtype(a.dtype).itemsize < 2:
            raise ValueError(f"fp8_dot_general: {name} has dtype {a.dtype}; expected a float dtype of >= 16 bits "
                             "(the compute dtype; quantization to FP8 happens inside).")
    dn = _canonical_dn(dimension_numbers)
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    dtypes = (jnp.dtype(x.dtype), jnp.dtype(w.dtype), out_dtype)
    if isinstance(recipe, Float8BlockScaling):
        n_contract = _dense_split(dn, x.ndim, w.ndim)
        if n_contract is None:
            raise ValueError(f"fp8_dot_general: Float8BlockScaling supports dense dimension_numbers only (x's "
                             f"trailing axes with w's leading axes, no batch axes); got {dn}.")
        mode = block_gemm_mode()
        if (mode != "xla" and recipe.x_block == recipe.w_block == 128
                and block_gemm_reason(x.shape, w.shape, n_contract) is None):
            return block_scaled_dot(x, w, n_contract, recipe, out_dtype, mode)
        return _block_dot(x, w, dn, recipe, dtypes + (tuple(x.shape), tuple(w.shape)))
    if isinstance(recipe, DelayedScaling):
        if state is None or set(state) != set(STATE_KEYS):
            raise ValueError(f"fp8_dot_general: DelayedScaling needs state, a dict with keys {STATE_KEYS} "
                             "(te_jax.fp8.quantize.init_state(recipe.amax_history_len)).")
        L = recipe.amax_history_len
        for k in STATE_KEYS:
            want = (L,) if k.endswith("history") else (1,)
            if tuple(jnp.shape(state[k])) != want:
                raise ValueError(f"fp8_dot_general: state[{k!r}] has shape {tuple(jnp.shape(state[k]))}; expected "
                                 f"{want} for amax_history_len={L} (was the state made with another recipe?).")
        state = {k: jnp.asarray(state[k], jnp.float32) for k in STATE_KEYS}
    else:
        state = None
    style = gemm_style_override or gemm_style()
    if style not in GEMM_STYLES:
        raise ValueError(f"fp8_dot_general: gemm_style_override={style!r} must be one of {GEMM_STYLES}.")
    n_contract = _dense_split(dn, x.ndim, w.ndim)
    if n_contract is not None and fused_cast_unavailable(recipe) is None:  # every GEMM TN, the fused casts
        k = math.prod(x.shape[x.ndim - n_contract:])
        cfg = _TNCfg(recipe, None, out_dtype, style, None, jnp.dtype(x.dtype), keep_weight_copies(recipe, dense=True))
        (y,) = _tn_dense(x.reshape(-1, k), None, None, (w.reshape(k, -1),), None if state is None else (state,), cfg)
        return y.reshape(x.shape[:x.ndim - n_contract] + w.shape[n_contract:])
    return _per_tensor_dot(x, w, state, dn, recipe, dtypes, style)


__all__ = ["fp8_dot_general", "quantize", "dequantize", "qdq", "compute_scale", "delayed_update", "delayed_updates",
           "amax",
           "fp8_max", "init_state", "block_qdq", "STATE_KEYS", "GEMM_STYLES", "GEMM_STYLE", "gemm_style",
           "wgrad_style"]
