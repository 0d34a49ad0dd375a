"""`dot_product_attention`: validate → choose a backend (with reasons) → call it."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from te_jax import layouts, masks, sinks
from te_jax.backends import policy
from te_jax.backends.base import Reason, ReasonKind
from te_jax.backends.call import AttentionCall, current_platform
from te_jax.backends.pallas import check_kernel_config
from te_jax.backends.selection import BACKENDS, BackendChoice, choose_backend, unavailable_error

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class PreparedAttention:
    """A validated call in canonical form: q/k/v [B, S, heads, dim], TokenMask, bias [B|1, H|1, Sq, Skv],
    mask (dense boolean, True = masked out) [B|1, H|1, Sq, Skv] or None."""

    call: AttentionCall
    q: jax.Array
    k: jax.Array
    v: jax.Array
    token_mask: masks.TokenMask
    bias: jax.Array | None
    scale: float
    softcap: float | None
    window: tuple[int, int]
    mask: jax.Array | None = None
    sink: jax.Array | None = None  # [h] float32 sink logits (softmax_type != "vanilla"), te_jax/sinks.py


def _check_dtypes(query, key, value):
    dts = [jnp.dtype(t.dtype).name for t in (query, key, value)]
    for name, dt in zip(("query", "key", "value"), dts):
        if dt not in _FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {dt}; attention takes {', '.join(_FLOAT_DTYPES)}.")
    if len(set(dts)) != 1:
        raise ValueError(
            f"query/key/value dtypes differ: {dts[0]}, {dts[1]}, {dts[2]}; cast them to one dtype "
            f"(e.g. key.astype(query.dtype)).")
    return jnp.dtype(query.dtype)


def _check_bias(bias, dims: layouts.AttentionDims):
    if bias is None:
        return None
    expected = (dims.batch, dims.num_heads, dims.q_len, dims.kv_len)
    shape = tuple(bias.shape)
    ok = (len(shape) == 4 and shape[0] in (1, dims.batch) and shape[1] in (1, dims.num_heads)
          and shape[2:] == expected[2:])
    if not ok:
        raise ValueError(
            f"bias: got shape {shape}, expected [batch or 1, heads or 1, q_seq, kv_seq] = "
            f"[{dims.batch} or 1, {dims.num_heads} or 1, {dims.q_len}, {dims.kv_len}] (whatever attn_input_format). "
            f"Add broadcast axes with bias[None, None] or reshape.")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ValueError(f"bias has dtype {bias.dtype}; it must be a float array (use a mask type for masking).")
    return bias


def _check_scalars(scale, softcap, dropout_rate, dropout_rng, head_dim):
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        try:
            scale = float(scale)
        except TypeError:
            raise ValueError(f"scale must be a Python float, got {type(scale).__name__}.") from None
        if not math.isfinite(scale) or scale == 0:
            raise ValueError(f"scale={scale} must be finite and non-zero.")
    if softcap is not None:
        softcap = float(softcap)
        if not 0 < softcap < float("inf"):
            raise ValueError(f"softcap={softcap} must be a finite number > 0 (or None for no soft-capping: an "
                             f"infinite cap caps nothing).")
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={dropout_rate} must be in [0, 1).")
    if dropout_rate > 0 and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng (a jax.random key).")
    return scale, softcap, dropout_rate


def prepare_attention(query, key, value, *, attn_input_format="bshd", attn_mask_type="no_mask",
                      q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None,
                      window_size=None, bias=None, softcap=None, scale=None, dropout_rate=0.0,
                      dropout_rng=None, needs_split_vjp=False, runs_per_shard=False, mask=None,
                      config=None, softmax_type="vanilla", softmax_offset=None) -> PreparedAttention:
    """Validate every argument and bring the call to canonical form (shared by all entry points).

    runs_per_shard: the caller runs the backend inside its own shard_map over every mesh axis
    (context parallelism), so the current mesh's partitioned axes do not make a Pallas kernel replicated.
    """
    call, tm, bias, scale, softcap, window, mask, sink = _validate_call(
        query, key, value, attn_input_format=attn_input_format, attn_mask_type=attn_mask_type,
        q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        window_size=window_size, bias=bias, softcap=softcap, scale=scale, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, needs_split_vjp=needs_split_vjp, runs_per_shard=runs_per_shard, mask=mask,
        config=config, softmax_type=softmax_type, softmax_offset=softmax_offset)
    q, k, v = (layouts.to_bshd(t, call.attn_input_format) for t in (query, key, value))
    return PreparedAttention(call, q, k, v, tm, bias, scale, softcap, window, mask, sink)


def _validate_call(query, key, value, *, attn_input_format="bshd", attn_mask_type="no_mask", q_seqlens=None,
                   kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None, window_size=None, bias=None,
                   softcap=None, scale=None, dropout_rate=0.0, dropout_rng=None, needs_split_vjp=False,
                   runs_per_shard=False, mask=None, config=None, softmax_type="vanilla", softmax_offset=None):
    """Every check of `prepare_attention`; q/k/v only need .shape and .dtype (ShapeDtypeStructs do)."""
    config = check_kernel_config(config)
    softmax_type = sinks.check_softmax_type(softmax_type)
    dense_mask, mask = mask, None  # `mask` below is the MaskSpec of attn_mask_type
    fmt = layouts.check_format(attn_input_format)
    dims = layouts.check_qkv(query, key, value, fmt)
    dtype = _check_dtypes(query, key, value)
    softmax_offset = sinks.check_softmax_offset(softmax_type, softmax_offset, dims.num_heads)
    mask = masks.check_mask_type(attn_mask_type)
    window = masks.check_window(window_size, mask)
    bias = _check_bias(bias, dims)
    dense = masks.check_dense_mask(dense_mask, dims.batch, dims.num_heads, dims.q_len, dims.kv_len, fmt)
    if dense is not None and needs_split_vjp:
        raise ValueError(
            f"mask: a dense mask (shape {tuple(dense.shape)}) cannot be split over a context-parallel axis; express "
            f"it with q_segment_ids/kv_segment_ids (packed documents, padding) and attn_mask_type (causal, "
            f"windows), which context parallelism serves.")
    scale, softcap, dropout_rate = _check_scalars(scale, softcap, dropout_rate, dropout_rng, dims.head_dim_qk)
    tm = masks.build_token_mask(mask, fmt, dims.batch, dims.q_len, dims.kv_len, q_seqlens, kv_seqlens,
                                q_segment_ids, kv_segment_ids)
    padding_source = ("segment_ids" if q_segment_ids is not None or kv_segment_ids is not None
                      else "seqlens" if q_seqlens is not None or kv_seqlens is not None else "none")
    if fmt == "thd" and padding_source == "seqlens":
        padding_source = "segment_ids"  # packed lengths become segment ids
    platform, cc = current_platform()
    partitioned = () if runs_per_shard else tuple(policy.partitioned_mesh_axes())
    call = AttentionCall(fmt, dims, dtype, mask, padding_source, window,
                         None if bias is None else tuple(bias.shape), softcap, dropout_rate, platform, cc,
                         needs_split_vjp, partitioned, None if dense is None else tuple(dense.shape), config,
                         softmax_type)
    return call, tm, bias, scale, softcap, window, dense, sinks.sink_logits(softmax_type, softmax_offset,
                                                                            dims.num_heads)


def _choose(prep: PreparedAttention, backend: str) -> BackendChoice:
    return choose_backend(prep.call, backend)


def explain_attention_backend(query, key, value, *, backend="auto", **kwargs) -> BackendChoice:
    """Which backend `dot_product_attention` would run for these arguments, and why not the others.

    Takes exactly the arguments of `dot_product_attention`. `str()` of the result is a readable table.
    """
    kwargs.pop("dropout_rng", None)
    rate = kwargs.get("dropout_rate", 0.0)
    prep = prepare_attention(query, key, value, dropout_rng=jax.random.key(0) if rate else None, **kwargs)
    choice = _choose(prep, backend)
    if choice.selected == "pallas":  # the Hopper kernel under a data mask: how many tiles it computes and skips
        tiles = BACKENDS["pallas"].data_mask_tiles(prep.call, prep.token_mask, prep.window)
        if tiles:
            choice.detail += f"; {tiles}"
    return choice


def dot_product_attention(query, key, value, *, attn_input_format="bshd", attn_mask_type="no_mask",
                          q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None,
                          window_size=None, bias=None, softcap=None, scale=None, dropout_rate=0.0,
                          dropout_rng=None, backend="auto", mask=None, config=None, softmax_type="vanilla",
                          softmax_offset=None):
    """Scaled dot-product attention with masks, GQA, bias, softcap, dropout and attention sinks.

    query: [b, s_q, h, d_qk] ("bshd"), [s_q, b, h, d_qk] ("sbhd") or [t_q, h, d_qk] ("thd").
    key:   same format with g key/value heads (h % g == 0) and d_qk; value: g heads, d_v.
    Returns the output in the query's format: [..., h, d_v].

    attn_mask_type: "no_mask", "causal" (top-left), "causal_bottom_right", "padding",
      "padding_causal", "padding_causal_bottom_right". Padding comes from q_seqlens/kv_seqlens
      ([batch] valid lengths; for thd, [num_seqs] lengths of the packed sequences) or from segment
      ids ([batch, seq], or [tokens] for thd; id 0 is padding).
    window_size: (left, right), -1 unbounded; composes with the mask.
    bias: [batch or 1, heads or 1, s_q, s_kv], added after scaling (and after softcap).
    mask: dense boolean [batch or 1, heads or 1, s_q, s_kv] (batch-first in every format; thd: batch 1),
      True = masked out (TransformerEngine's convention), applied exactly on top of attn_mask_type,
      padding and window. Served by "xla" and "pallas" (folded into the bias); not by "cudnn" nor
      context parallelism. Prefer seqlens / segment ids / mask types where they express the mask: the
      kernels then skip hidden blocks instead of reading an [s_q, s_kv] array.
    softcap: logits ← softcap·tanh(logits/softcap). scale defaults to 1/sqrt(d_qk).
    backend: "auto", "pallas", "cudnn" or "xla"; see `explain_attention_backend`. Under a mesh whose
      axes XLA partitions (jax.set_mesh, outside shard_map) auto does not take pallas: the kernel would
      run replicated; call inside shard_map, or through the te_jax.flax modules, which do.
    config: a kernel configuration for the pallas backend, validated and recorded in the explanation:
      pallas_kernels.flash_attention.BlockSizes (the portable kernel) or
      pallas_kernels.flash_attention_hopper.HopperConfig (the Hopper kernel, sm90); None for the defaults.
      Only pallas takes one: the other backends give it as their reason.
    softmax_type: TransformerEngine's "vanilla" (default), "off-by-one" (a sink logit 0 in every row's
      softmax denominator: p_j = exp(s_j) / (1 + Σ_k exp(s_k))) or "learnable" (a per-head sink logit
      softmax_offset[h]: p_j = exp(s_j) / (exp(offset_h) + Σ_k exp(s_k)), gpt-oss's sinks); "off_by_one"
      (TE-JAX's spelling) is accepted too. s are the logits after scale, softcap and bias; the sink logit
      is not scaled, capped or biased, and has value 0. softmax_offset: "learnable" only, a float array of
      shape [h] or TransformerEngine's [1, h, 1, 1], used in fp32 and differentiable. The sink is merged
      after the attention from its row logsumexp (te_jax/sinks.py): served by "pallas" and "xla", not by
      "cudnn" (jax.nn returns no logsumexp; the explanation says so). A row with no visible key still
      gives zeros.
    Rows with no visible key give zeros (and finite gradients). A row emptied by the mask gives zeros;
    one emptied by a bias (every visible key at the same huge negative value: finfo.min, -1e9) gives the
    uniform mean of value over the keys the mask allows, as fp32 softmax does (all logits round to the
    same number), with the matching gradients, on every backend; a bias of -inf acts as a mask (zeros).
    """
    prep = prepare_attention(
        query, key, value, attn_input_format=attn_input_format, attn_mask_type=attn_mask_type,
        q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        window_size=window_size, bias=bias, softcap=softcap, scale=scale, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, mask=mask, config=config, softmax_type=softmax_type,
        softmax_offset=softmax_offset)
    choice = _choose(prep, backend)
    if choice.selected is None:
        raise unavailable_error(choice)
    out = run_backend(choice, prep, dropout_rng=dropout_rng)
    return layouts.from_bshd(out, prep.call.attn_input_format)


def _sink_kw(sink):
    """Backends return (out, lse) only when asked (with_lse=True), which only a call with a sink does."""
    return {} if sink is None else {"with_lse": True}


def _with_sink(result, sink):
    """The backend's out, with the sink merged when there is one (result is then (out, lse))."""
    if sink is None:
        return result
    out, lse = result
    return sinks.merge_sink(out, lse, sink)[0]


def _mask_kw(mask):
    """Backends' forward take `mask=` only when there is one (stand-ins in tests need not know it)."""
    return {} if mask is None else {"mask": mask}


def run_backend(choice: BackendChoice, prep: PreparedAttention, dropout_rng=None):
    """Run the chosen backend; in auto mode a trace-time refusal falls back to the next one."""
    order = [choice.selected] + [n for n, why in choice.reasons.items()
                                 if n != choice.selected and isinstance(why, Reason) and why.fallback_allowed]
    last_err = None
    for name in order:
        try:
            return _with_sink(BACKENDS[name].forward(
                prep.call, prep.q, prep.k, prep.v, prep.token_mask, prep.bias, scale=prep.scale,
                softcap=prep.softcap, causal=prep.call.mask.causal, window=prep.window,
                dropout_rate=prep.call.dropout_rate, dropout_rng=dropout_rng, **_mask_kw(prep.mask),
                **_sink_kw(prep.sink)), prep.sink)
        except (NotImplementedError, RuntimeError) as e:
            if choice.source != "auto":
                raise ValueError(f"backend {name!r} refused the call: {type(e).__name__}: {e}") from e
            last_err = e
            choice.reasons[name] = Reason(f"refused at trace time: {type(e).__name__}: {e}", ReasonKind.REFUSED)
    raise ValueError(f"every backend refused the call; last error: {last_err}\n{choice}")


# ----------------------------------------------------------------------------- packed q/k/v

_PACKED_FORMS = {"separate": "(query, key, value)", "kv_packed": "(query, kv)",
                 "qkv_packed": "the packed tensor qkv (or (qkv,))", "gqa_packed": "the packed tensor qkv (or (qkv,))"}


@dataclasses.dataclass
class _PackedPlan:
    layout: layouts.QKVLayout
    tensors: tuple
    num_heads: int
    num_gqa_groups: int
    call: AttentionCall
    token_mask: masks.TokenMask
    bias: jax.Array | None
    scale: float
    softcap: float | None
    window: tuple[int, int]
    choice: BackendChoice
    in_place: bool
    mask: jax.Array | None = None
    sink: jax.Array | None = None


def _packed_tensors(qkv, layout: layouts.QKVLayout) -> tuple:
    tensors = tuple(qkv) if isinstance(qkv, (tuple, list)) else (qkv,)
    if len(tensors) != layout.num_tensors:
        raise ValueError(
            f"qkv: qkv_layout={layout.name!r} stores q, k, v in {layout.num_tensors} tensor(s), got "
            f"{len(tensors)} ({', '.join(str(tuple(getattr(t, 'shape', ()))) for t in tensors)}). "
            f"Pass qkv={_PACKED_FORMS[layout.kind]}.")
    return tensors


def _plan_packed(qkv, *, qkv_layout, num_attention_heads, num_gqa_groups, attn_input_format, backend,
                 for_explain=False, **kwargs) -> _PackedPlan:
    layout = layouts.get_qkv_layout(qkv_layout)
    fmt = layout.attn_input_format
    if attn_input_format is not None:
        layouts.check_format(attn_input_format)
        if attn_input_format != fmt:
            raise ValueError(
                f"attn_input_format={attn_input_format!r} but qkv_layout={qkv_layout!r} is a {fmt!r} layout; "
                f"pass a {attn_input_format!r} layout, attn_input_format={fmt!r}, or leave attn_input_format "
                f"out (the layout names the format).")
    tensors = _packed_tensors(qkv, layout)
    # Validate the shapes and learn q/k/v's without slicing anything (eval_shape traces abstractly).
    q, k, v = jax.eval_shape(
        lambda *t: layouts.unpack_qkv(*t, qkv_layout=qkv_layout, num_attention_heads=num_attention_heads,
                                      num_gqa_groups=num_gqa_groups), *tensors)
    if for_explain and kwargs.get("dropout_rate", 0.0):
        kwargs["dropout_rng"] = jax.random.key(0)
    call, tm, bias, scale, softcap, window, mask, sink = _validate_call(q, k, v, attn_input_format=fmt, **kwargs)
    h, g = call.dims.num_heads, call.dims.num_kv_heads
    choice = choose_backend(call, backend)
    in_place = False
    if layout.kind == "separate":
        choice.packed = f"qkv_layout={qkv_layout!r} is not packed: q, k and v are passed as they are"
    elif choice.selected is None:
        choice.packed = "no backend serves the call"
    elif not BACKENDS[choice.selected].capabilities.packed_inputs:
        choice.packed = (f"split into q, k, v by XLA slicing (a copy) before the call: the {choice.selected!r} "
                         f"backend takes separate q, k, v; only te_jax's portable Pallas kernel reads packed input "
                         f"in place")
    else:
        why = BACKENDS[choice.selected].packed_input_reason(call, qkv_layout, tensors, h, g)
        in_place = why is None
        choice.packed = ("read in place by the portable Pallas kernel: the packed tensor is one operand of the "
                         "kernels, which address q, k and v by head offsets (no slice, no copy)" if in_place
                         else f"split into q, k, v by XLA slicing (a copy) before the Pallas kernel: {why}")
    return _PackedPlan(layout, tensors, h, g, call, tm, bias, scale, softcap, window, choice, in_place, mask, sink)


def explain_attention_backend_packed(qkv, *, qkv_layout, backend="auto", **kwargs) -> BackendChoice:
    """`explain_attention_backend` for `dot_product_attention_packed` (takes exactly its arguments).

    The result's `packed` note (last line of `str()`) says whether the packed input is read in place
    by the kernel or split into q, k, v first, and why.
    """
    kwargs.pop("dropout_rng", None)
    args = dict(num_attention_heads=None, num_gqa_groups=None, attn_input_format=None)
    args.update(kwargs)
    return _plan_packed(qkv, qkv_layout=qkv_layout, backend=backend, for_explain=True, **args).choice


def dot_product_attention_packed(qkv, *, qkv_layout, num_attention_heads=None, num_gqa_groups=None,
                                 attn_input_format=None, attn_mask_type="no_mask", q_seqlens=None,
                                 kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None, window_size=None,
                                 bias=None, softcap=None, scale=None, dropout_rate=0.0, dropout_rng=None,
                                 backend="auto", mask=None, config=None, softmax_type="vanilla",
                                 softmax_offset=None):
    """`dot_product_attention` on q, k, v stored as `qkv_layout` says (TransformerEngine's layouts).

    qkv: the packed tensor for QKV-packed and GQA-packed layouts ("bs3hd" [b, s, 3, h, d],
      "bsh3d" [b, s, h, 3, d], "bs(h+2g)d" [b, s, h + 2g, d], and their sbhd / thd forms);
      (query, kv) for KV-packed layouts ("bshd_bs2hd" kv [b, s, 2, g, d], "bshd_bsh2d" [b, s, g, 2, d], ...);
      (query, key, value) for separate layouts. See te_jax.QKV_LAYOUTS.
    num_attention_heads (h) / num_gqa_groups (g): needed for "(h+2g)" layouts, checked otherwise.
    attn_input_format: optional, the layout names it (given, it must agree).
    Every other argument is `dot_product_attention`'s (config= too: the kernel configuration reaches the
    kernel whether it reads the packed tensor in place or q, k, v are split out first; softmax_type /
    softmax_offset: attention sinks, merged after the packed call as there). Returns [..., h, d] in the layout's
    format.
    Gradients come back in the packed shape(s).

    When the Pallas backend runs the portable kernel on a bshd (or thd) packed tensor that needs no
    padding (sequence a multiple of the kernel blocks, head_dim a power of two >= 16), the kernel reads
    the packed tensor where it lies; otherwise q, k, v are sliced out first, as `unpack_qkv` does.
    `explain_attention_backend_packed` says which happens and why.
    """
    plan = _plan_packed(
        qkv, qkv_layout=qkv_layout, num_attention_heads=num_attention_heads, num_gqa_groups=num_gqa_groups,
        attn_input_format=attn_input_format, backend=backend, attn_mask_type=attn_mask_type,
        q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        window_size=window_size, bias=bias, softcap=softcap, scale=scale, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, needs_split_vjp=False, mask=mask, config=config, softmax_type=softmax_type,
        softmax_offset=softmax_offset)
    choice, call = plan.choice, plan.call
    if choice.selected is None:
        raise unavailable_error(choice)
    fmt = call.attn_input_format
    if plan.in_place:
        try:
            out = _with_sink(BACKENDS[choice.selected].forward_packed(
                call, plan.layout.name, plan.tensors, plan.token_mask, plan.bias, num_heads=plan.num_heads,
                num_gqa_groups=plan.num_gqa_groups, scale=plan.scale, softcap=plan.softcap,
                causal=call.mask.causal, window=plan.window, **_mask_kw(plan.mask), **_sink_kw(plan.sink)),
                plan.sink)
            return layouts.from_bshd(out, fmt)
        except (NotImplementedError, RuntimeError) as e:
            if choice.source != "auto":
                raise ValueError(f"backend {choice.selected!r} refused the packed call: {type(e).__name__}: {e}") from e
            choice.packed = f"split after the in-place call was refused at trace time: {type(e).__name__}: {e}"
    q, k, v = layouts.unpack_qkv(*plan.tensors, qkv_layout=plan.layout.name, num_attention_heads=plan.num_heads,
                                 num_gqa_groups=plan.num_gqa_groups)
    prep = PreparedAttention(call, *(layouts.to_bshd(t, fmt) for t in (q, k, v)), plan.token_mask, plan.bias,
                             plan.scale, plan.softcap, plan.window, plan.mask, plan.sink)
    return layouts.from_bshd(run_backend(choice, prep, dropout_rng=dropout_rng), fmt)
