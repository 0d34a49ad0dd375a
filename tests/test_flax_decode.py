"""Decoding with the KV cache (MultiHeadAttention / TransformerLayer, decode=True) against the full,
non-decoding forward of the same module and parameters on each row's real tokens only.

Covers padded prompts of different lengths per row (left / right, given by mask, segment ids or seqlens),
prefill in several chunks then single tokens, padding at a decode step, RoPE, GQA, the xla and pallas
backends, a decoder TransformerLayer with cross-attention and relative position biases, and what happens
past the end of the cache (a ValueError eagerly, NaN rows under jit).
"""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_flax_modules import assert_close, rand, unbox
from te_jax.flax import MultiHeadAttention, TransformerLayer

D, H, HD = 32, 4, 8
TOL = 2e-5


def init(m, *args, seed=0, **kw):
    """Variables of m without compiling its init (only its shapes are traced): fresh random parameters
    (kernels ~ N(0, 1/fan_in), norm scales 1 + N(0, 0.1²), biases and the rest N(0, 0.1²)) and, with
    decode=True, the empty cache (zeros)."""
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    shapes = unbox(jax.eval_shape(lambda *a: m.init(rngs, *a, **kw), *args))
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes["params"])
    params = []
    for i, (path, a) in enumerate(leaves):
        name = jax.tree_util.keystr(path[-1:])
        z = rand(seed * 1000 + i, a.shape)
        if "kernel" in name:  # [fan_in, ...] except the output projection [h, d, embed]
            fan_in = np.prod(a.shape[:-1]) if "'out'" in jax.tree_util.keystr(path) else a.shape[0]
            params.append(z / np.sqrt(fan_in))
        else:
            params.append(("scale" in name) + 0.1 * z)
    out = {"params": tree.unflatten(params)}
    if "cache" in shapes:
        out["cache"] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])
    return out


def mha(**kw):
    args = dict(head_dim=HD, num_attention_heads=H, attn_mask_type="causal")
    args.update(kw)
    return MultiHeadAttention(**args)


def padding_args(kind, valid):
    """The padding of a chunk (valid [b, c] bool) as the keyword arguments of one padding kind."""
    valid = jnp.asarray(valid)
    if kind == "mask":
        return dict(mask=~(valid[:, None, :, None] & valid[:, None, None, :]))
    if kind == "segment_ids":
        seg = valid.astype(jnp.int32) * 3  # any non-zero id is a token
        return dict(q_segment_ids=seg, kv_segment_ids=seg)
    assert kind == "seqlens"
    lens = jnp.sum(valid, axis=1, dtype=jnp.int32)
    np.testing.assert_array_equal(valid, jnp.arange(valid.shape[1])[None] < lens[:, None])  # real tokens first
    return dict(q_seqlens=lens, kv_seqlens=lens)


def stream_validity(prompt_lens, prompt_window, n_steps, side, step_padding=()):
    """valid [b, prompt_window + n_steps]: padded prompts, then one token a step (except step_padding)."""
    b = len(prompt_lens)
    idx = np.arange(prompt_window)[None]
    lens = np.asarray(prompt_lens)[:, None]
    prompt = idx >= prompt_window - lens if side == "left" else idx < lens
    steps = np.ones((b, n_steps), bool)
    for row, step in step_padding:
        steps[row, step] = False
    return np.concatenate([prompt, steps], axis=1)


def jit_decode(m, **static):
    """m.apply(decode=True) under jit (compiling whole calls is much faster here than op-by-op dispatch);
    x is one input or a tuple of inputs, kw the traced keyword arguments, static the Python ones."""
    return jax.jit(lambda params, cache, x, kw: m.apply(
        {**params, "cache": cache}, *(x if isinstance(x, tuple) else (x,)), decode=True, mutable=["cache"],
        **static, **kw))


def jit_full(m, **static):
    """The full forward under jit; MultiHeadAttention's output without ln_output."""
    def fn(params, x, kw):
        out = m.apply(params, *(x if isinstance(x, tuple) else (x,)), **static, **kw)
        return out[0] if isinstance(out, tuple) else out
    return jax.jit(fn)


def decode_stream(m, params, cache, x, valid, chunks, kind, fmt="bshd"):
    """Apply decode=True chunk by chunk ([start, stop) along the stream); outputs [b, T, D] batch-first."""
    outs = []
    step = jit_decode(m)
    for a, b in chunks:
        xc = x[:, a:b] if fmt == "bshd" else jnp.swapaxes(x[:, a:b], 0, 1)
        kw = padding_args(kind, valid[:, a:b])  # also where every token is real
        (y, _), mut = step(params, cache, xc, kw)
        cache = mut["cache"]
        outs.append(y if fmt == "bshd" else jnp.swapaxes(y, 0, 1))
    return jnp.concatenate(outs, axis=1), cache


def compact(x, valid):
    """Each row's real tokens first, in order (the rest: the padding tokens): [b, T, ...]."""
    order = np.argsort(~np.asarray(valid), axis=1, kind="stable")
    return jnp.take_along_axis(x, jnp.asarray(order).reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)


def check_rows_against_full(m, params, x, valid, y, fmt="bshd", what="decode", extra=(), static=None):
    """The decode outputs at each row's real tokens equal the full causal forward of that row's real tokens
    alone: computed in one call on the rows compacted (real tokens first, no padding arguments), whose
    first L_i outputs see only the row's L_i real tokens (causal attention; everything else is per token)."""
    xc = compact(x, valid)
    xin = xc if fmt == "bshd" else jnp.swapaxes(xc, 0, 1)
    ref = jit_full(m, **(static or {}))(params, (xin,) + tuple(extra), {})
    ref = ref if fmt == "bshd" else jnp.swapaxes(ref, 0, 1)
    lens = np.asarray(valid).sum(1)
    for i in range(x.shape[0]):
        assert_close(y[i][np.asarray(valid[i])], ref[i, :lens[i]], TOL, f"{what}, row {i}")


# ----------------------------------------------------------------------------- MultiHeadAttention


CASES = {  # backend, prompt side, how the padding is given, module options
    "xla-left-mask-rope-gqa": ("xla", "left", "mask", dict(enable_rotary_pos_emb=True, num_gqa_groups=2)),
    "xla-left-segids-rope-fused": ("xla", "left", "segment_ids", dict(enable_rotary_pos_emb=True)),
    "xla-right-seqlens-norope-mqa": ("xla", "right", "seqlens", dict(num_gqa_groups=1, fuse_qkv_params=False)),
    "pallas-left-segids-rope-gqa": ("pallas", "left", "segment_ids", dict(enable_rotary_pos_emb=True,
                                                                           num_gqa_groups=2)),
    "pallas-right-seqlens-rope": ("pallas", "right", "seqlens", dict(enable_rotary_pos_emb=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_padded_prompts_decode_as_full_forward_per_row(case):
    """Prompts of lengths 6, 3 and 1 in a window of 6 (left or right padded), prefilled in two chunks of 3,
    then 4 single-token steps with one padding token at a step; the cache holds 12 > 10 tokens."""
    backend, side, kind, kw = CASES[case]
    m = mha(backend=backend, **kw)
    b, window, n_steps, max_len = 3, 6, 4, 12
    valid = stream_validity([6, 3, 1], window, n_steps, side, step_padding=[(1, 2)])
    x = rand(zlib.crc32(case.encode()) % 1000, (b, window + n_steps, D))  # stable per case (hash() is salted)
    v = init(m, rand(7, (b, max_len, D)), decode=True)
    params, cache = {"params": v["params"]}, v["cache"]
    assert cache["cached_key"].shape == (b, max_len, kw.get("num_gqa_groups", H), HD)
    np.testing.assert_array_equal(cache["cache_index"], np.zeros(b))
    chunks = [(0, 3), (3, 6)] + [(t, t + 1) for t in range(window, window + n_steps)]
    y, cache = decode_stream(m, params, cache, x, valid, chunks, kind)
    check_rows_against_full(m, params, x, valid, y, what=case)
    np.testing.assert_array_equal(cache["cache_index"], valid.sum(1))  # each row's real tokens
    # the full forward with the same padding arguments agrees on the prompt's real tokens
    full = jit_full(m)(params, x[:, :window], padding_args(kind, valid[:, :window]))
    vp = valid[:, :window]
    assert_close(y[:, :window][vp], full[vp], TOL, "full forward with padding")


def test_sbhd_right_padding_with_segment_ids():
    m = mha(attn_input_format="sbhd", enable_rotary_pos_emb=True, rotary_pos_emb_group_method="alternate",
            num_gqa_groups=2, backend="xla")
    b, window, n_steps = 2, 5, 3
    valid = stream_validity([2, 5], window, n_steps, "right", step_padding=[(0, 0)])
    x = rand(11, (b, window + n_steps, D))
    v = init(m, jnp.swapaxes(rand(7, (b, 9, D)), 0, 1), decode=True)
    params, cache = {"params": v["params"]}, v["cache"]
    chunks = [(0, 2), (2, 5), (5, 6), (6, 7), (7, 8)]
    y, cache = decode_stream(m, params, cache, x, valid, chunks, "segment_ids", fmt="sbhd")
    np.testing.assert_array_equal(cache["cache_index"], valid.sum(1))
    check_rows_against_full(m, params, x, valid, y, fmt="sbhd")


def test_whole_cache_prefill_then_nothing_past_it():
    """A prefill as long as the cache (left-padded) fills it exactly where each row has that many tokens."""
    m = mha(enable_rotary_pos_emb=True, backend="xla")
    b, max_len = 2, 6
    valid = stream_validity([6, 4], max_len, 0, "left")
    x = rand(5, (b, max_len, D))
    v = init(m, x, decode=True)
    params, cache = {"params": v["params"]}, v["cache"]
    y, cache = decode_stream(m, params, cache, x, valid, [(0, max_len)], "mask")
    np.testing.assert_array_equal(cache["cache_index"], [6, 4])
    check_rows_against_full(m, params, x, valid, y)


def test_decode_bias_by_position_or_by_chunk_rows():
    """A bias [1, h, max_len, max_len] is read by token position; [b, h, chunk, max_len] as this call's rows.
    Both decode as the full forward with the bias; other shapes are a ValueError naming the expected ones."""
    m = mha(enable_rotary_pos_emb=True, backend="xla")
    b, max_len = 2, 6
    x, bias = rand(1, (b, max_len, D)), rand(2, (1, H, max_len, max_len))
    v = init(m, x, decode=True)
    params = {"params": v["params"]}
    full = jit_full(m)(params, x, dict(bias=bias))
    step = jit_decode(m)
    for per_chunk in (False, True):
        cache, outs = v["cache"], []
        for a, e in [(0, 4), (4, 5), (5, 6)]:
            bc = jnp.broadcast_to(bias[:, :, a:e], (b, H, e - a, max_len)) if per_chunk else bias
            (y, _), mut = step(params, cache, x[:, a:e], dict(bias=bc))
            cache = mut["cache"]
            outs.append(y)
        assert_close(jnp.concatenate(outs, axis=1), full, TOL, f"bias, per_chunk={per_chunk}")
    with pytest.raises(ValueError, match=r"bias has shape \(1, 4, 1, 1\).*\[1 or 2, 1 or heads, 6, 6\]"):
        m.apply(v, x[:, :1], decode=True, mutable=["cache"], bias=bias[:, :, :1, :1])


# ----------------------------------------------------------------------------- past the cache


def test_chunk_longer_than_cache_is_a_value_error():
    m = mha(backend="xla")
    v = init(m, rand(1, (2, 4, D)), decode=True)
    with pytest.raises(ValueError, match=r"chunk of 5 tokens.*max_len=4"):
        m.apply(v, rand(2, (2, 5, D)), decode=True, mutable=["cache"])


def test_eager_step_past_the_cache_is_a_value_error():
    m = mha(backend="xla")
    v = init(m, rand(1, (2, 4, D)), decode=True)
    params, cache = {"params": v["params"]}, v["cache"]
    # row 0: 3 real tokens, row 1: 1 (right padding by seqlens)
    step = jit_decode(m)
    _, mut = step(params, cache, rand(2, (2, 3, D)), dict(q_seqlens=jnp.array([3, 1])))
    _, mut = step(params, mut["cache"], rand(3, (2, 1, D)), {})
    cache = mut["cache"]  # concrete arrays: the next eager call knows where each row stands
    np.testing.assert_array_equal(cache["cache_index"], [4, 2])
    with pytest.raises(ValueError, match=r"max_len=4.*row 0 already holds 4.*chunk of 1 tokens") as e:
        m.apply({**params, "cache": cache}, rand(4, (2, 1, D)), decode=True, mutable=["cache"])
    assert "kv_seqlens" not in str(e.value)
    # a row that is padding at this step does not advance: no error when only row 1 has a token
    _, mut = step(params, cache, rand(4, (2, 1, D)), dict(q_seqlens=jnp.array([0, 1])))
    np.testing.assert_array_equal(mut["cache"]["cache_index"], [4, 3])


def test_jit_step_past_the_cache_gives_nan_rows():
    """Under jit the index is not known at trace time: the rows that overflow give NaN, the others are right,
    and cache_index stays at max_len."""
    m = mha(enable_rotary_pos_emb=True, backend="xla")
    b, max_len = 2, 4
    v = init(m, rand(1, (b, max_len, D)), decode=True)
    params, cache = {"params": v["params"]}, v["cache"]
    step = jax.jit(lambda c, xc, lens: m.apply({**params, "cache": c}, xc, decode=True, mutable=["cache"],
                                               q_seqlens=lens))
    x = rand(8, (b, 6, D))
    valid = np.array([[1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 1, 1]], bool)
    outs = []
    for a, e in [(0, 3), (3, 4), (4, 5), (5, 6)]:
        (y, _), mut = step(cache, x[:, a:e], jnp.asarray(valid[:, a:e].sum(1), jnp.int32))
        cache = mut["cache"]
        outs.append(y)
    y = jnp.concatenate(outs, axis=1)
    np.testing.assert_array_equal(cache["cache_index"], [4, 4])
    assert bool(jnp.all(jnp.isnan(y[0, 4:]))), "row 0 decoded past the cache: its outputs must be NaN"
    assert bool(jnp.all(jnp.isfinite(y[0, :4])))
    assert bool(jnp.all(jnp.isfinite(y[1])))
    check_rows_against_full(m, params, x[:1, :4], np.ones((1, 4), bool), y[:1, :4], what="row 0, before the overflow")
    check_rows_against_full(m, params, x[1:], valid[1:], y[1:], what="row 1, within its cache")


# ----------------------------------------------------------------------------- bad decode inputs


def test_decode_padding_arguments_are_validated():
    m = mha(backend="xla")
    v = init(m, rand(1, (2, 6, D)), decode=True)
    x = rand(2, (2, 3, D))
    run = lambda **kw: m.apply(v, x, decode=True, mutable=["cache"], **kw)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 1, 3, 6\).*\[2, 1, 3, 3\]"):
        run(mask=jnp.zeros((2, 1, 3, 6), bool))
    with pytest.raises(ValueError, match=r"q_segment_ids: got shape \(2, 6\), expected \(2, 3\)"):
        run(q_segment_ids=jnp.ones((2, 6), jnp.int32))
    with pytest.raises(ValueError, match="one sequence per batch row"):
        run(q_segment_ids=jnp.array([[1, 1, 2], [1, 1, 1]]))
    with pytest.raises(ValueError, match=r"q_seqlens=\[4, 1\] has values outside \[0, 3\]"):
        run(q_seqlens=jnp.array([4, 1]))
    with pytest.raises(ValueError, match="either mask or q_seqlens"):
        run(mask=jnp.zeros((2, 1, 3, 3), bool), q_seqlens=jnp.array([3, 3]))
    old = dict(v, cache={**v["cache"], "cache_index": jnp.array(0, jnp.int32)})
    with pytest.raises(ValueError, match=r"cache_index has shape \(\), expected \[batch\]"):
        m.apply(old, x, decode=True, mutable=["cache"])


# ----------------------------------------------------------------------------- cross-attention and the layer


def test_cross_attention_query_chunk_equals_rows_of_full_query():
    m = mha(enable_rotary_pos_emb=True, attn_mask_type="padding", num_gqa_groups=2, backend="xla")
    x, enc = rand(1, (2, 8, D)), rand(2, (2, 5, D))
    p = init(m, x, enc)
    fn = jit_full(m)
    full = fn(p, (x, enc), {})
    chunk = fn(p, (x[:, 3:6], enc), dict(q_positions=jnp.arange(3, 6)[None]))
    assert_close(chunk, full[:, 3:6], TOL, "cross-attention query chunk")
    with pytest.raises(ValueError, match=r"q_positions has shape \(3,\)"):
        m.apply(p, x[:, 3:6], enc, q_positions=jnp.arange(3, 6))
    with pytest.raises(ValueError, match="q_positions is for cross-attention"):
        m.apply(p, x, q_positions=jnp.arange(8)[None])


def layer(**kw):
    args = dict(hidden_size=D, mlp_hidden_size=64, num_attention_heads=H, hidden_dropout=0.0, attention_dropout=0.0,
                intermediate_dropout=0.0, layer_type="decoder", enable_rotary_pos_emb=True, attention_backend="xla")
    args.update(kw)
    return TransformerLayer(**args)


def test_decoder_layer_with_rope_decodes_as_full_forward():
    """Decoder layer (RoPE, cross-attention over `encoded` with padding, relative position biases):
    a 3-token prefill then single steps, without max_decode_length, equal the full forward."""
    m = layer(enable_relative_embedding=True, num_gqa_groups=2)
    b, s = 2, 7
    x, enc = rand(1, (b, s, D)), rand(2, (b, 5, D))
    enc_vis = jnp.arange(5)[None] < jnp.array([5, 3])[:, None]
    enc_mask = lambda sq: ~jnp.broadcast_to(enc_vis[:, None, None, :], (b, 1, sq, 5))
    v = init(m, x, enc, encoder_decoder_mask=enc_mask(s), decode=True, deterministic=True)
    params, cache = {"params": v["params"]}, v["cache"]
    full = jit_full(m, deterministic=True)(params, (x, enc), dict(encoder_decoder_mask=enc_mask(s)))
    step = jit_decode(m, deterministic=True)
    outs = []
    for a, e in [(0, 3)] + [(t, t + 1) for t in range(3, s)]:
        y, mut = step(params, cache, (x[:, a:e], enc), dict(encoder_decoder_mask=enc_mask(e - a)))
        cache = mut["cache"]
        outs.append(y)
    assert_close(jnp.concatenate(outs, axis=1), full, 3e-5, "decoder layer decode")


def test_decoder_layer_left_padded_prompts_decode_per_row():
    """Left-padded decoder prompts (segment ids) with RoPE and relative position biases: each row's real
    tokens decode as the full forward of that row alone (max_decode_length given, equal to the cache)."""
    m = layer(enable_relative_embedding=True)
    b, window, n_steps, max_len = 2, 4, 2, 8
    valid = stream_validity([4, 2], window, n_steps, "left")
    x, enc = rand(3, (b, window + n_steps, D)), rand(4, (b, 5, D))
    v = init(m, rand(5, (b, max_len, D)), enc, decode=True, max_decode_length=max_len, deterministic=True)
    params, cache = {"params": v["params"]}, v["cache"]
    step = jit_decode(m, deterministic=True, max_decode_length=max_len)
    full = jit_full(m, deterministic=True)
    outs = []
    for a, e in [(0, 4), (4, 5), (5, 6)]:
        seg = jnp.asarray(valid[:, a:e], jnp.int32)
        y, mut = step(params, cache, (x[:, a:e], enc), dict(q_segment_ids=seg, kv_segment_ids=seg))
        cache = mut["cache"]
        outs.append(y)
    y = jnp.concatenate(outs, axis=1)
    check_rows_against_full(m, params, x, valid, y, extra=(enc,), static=dict(deterministic=True))
    # and the padded full forward (same segment ids) agrees on the real tokens
    seg = jnp.asarray(valid[:, :window], jnp.int32)
    full = full(params, (x[:, :window], enc), dict(q_segment_ids=seg, kv_segment_ids=seg))
    assert_close(y[:, :window][valid[:, :window]], full[valid[:, :window]], 3e-5, "padded full forward")


def test_layer_max_decode_length_must_match_the_cache():
    m = layer(layer_type="encoder", enable_relative_embedding=True)
    x = rand(1, (2, 6, D))
    v = init(m, x, decode=True, deterministic=True)
    with pytest.raises(ValueError, match=r"max_decode_length=8 but the KV cache holds 6"):
        m.apply(v, x[:, :1], decode=True, max_decode_length=8, deterministic=True, mutable=["cache"])


def test_nnx_decode_with_mutable_cache():
    from flax import nnx

    from te_jax.flax import nnx as te_nnx

    b, s = 2, 6
    x = rand(1, (b, s, D))
    kw = dict(head_dim=HD, num_attention_heads=H, enable_rotary_pos_emb=True, backend="xla")
    m = te_nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(params=0))
    te_nnx.lazy_init(m, x, decode=True)  # creates the parameters and the cache
    step = nnx.jit(lambda mod, xc: mod(xc, decode=True, mutable=["cache"])[0])  # updates the module's cache
    outs = [step(m, x[:, :3])] + [step(m, x[:, t:t + 1]) for t in range(3, s)]
    np.testing.assert_array_equal(m.cache_index[...], [s, s])
    full = te_nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(params=0))
    nnx.update(full, nnx.state(m, nnx.Param))
    assert_close(jnp.concatenate(outs, axis=1), nnx.jit(lambda mod, x: mod(x)[0])(full, x), TOL, "nnx decode")


def test_fp8_fused_gqa_decode_with_padding_matches_full_forward(monkeypatch):
    """FP8 DelayedScaling with the fused casts (the GPU path, here in interpret mode): GQA self-attention runs its
    norm inside one cast for the query and K/V GEMMs (te_jax/fp8/norm_dense.py). A fixed scale quantizes each token
    the same way in a decode step as in the full forward, so left-padded prompts decoded in chunks, then token by
    token with a padding step, equal the full causal forward of each row's real tokens."""
    from te_jax import fp8

    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")
    m = mha(enable_rotary_pos_emb=True, num_gqa_groups=2, backend="xla", input_layernorm=True, dtype=jnp.float32)
    b, window, n_steps, max_len = 3, 6, 3, 10
    valid = stream_validity([6, 3, 1], window, n_steps, "left", step_padding=[(1, 1)])
    x = rand(21, (b, window + n_steps, D))
    with fp8.autocast(recipe=fp8.DelayedScaling(amax_history_len=4)):
        v = init(m, rand(7, (b, max_len, D)), decode=True)
        shapes = jax.eval_shape(lambda a: m.init({"params": jax.random.key(0)}, a, decode=True),
                                rand(7, (b, max_len, D)))[fp8.FP8_COLLECTION]
        # scales away from 1 (so a wrong one would show), empty histories
        state = jax.tree_util.tree_map_with_path(
            lambda p, a: jnp.full(a.shape, 8.0 if "scale" in jax.tree_util.keystr(p) else 0.0, a.dtype), shapes)
        params = {"params": v["params"], fp8.FP8_COLLECTION: state}
        info = fp8.explain(lambda: m.apply({**params, "cache": v["cache"]}, x[:, :3], decode=True,
                                           mutable=["cache"]))
        assert [i.module for i in info if "shared by query and kv" in i.reason] == ["query", "kv"], info
        chunks = [(0, 3), (3, 6)] + [(t, t + 1) for t in range(window, window + n_steps)]
        y, cache = decode_stream(m, params, v["cache"], x, valid, chunks, "mask")
        check_rows_against_full(m, params, x, valid, y, what="fp8 fused gqa decode")
    np.testing.assert_array_equal(cache["cache_index"], valid.sum(1))


def test_fp8_fused_layer_decode_with_padding_matches_full_forward(monkeypatch):
    """The TransformerLayer under FP8 DelayedScaling with the fused paths (interpret mode here): its attention and
    MLP hand the skip connection's input back out of their fused norm ops (return_residual). Left-padded prompts
    (segment ids) decoded in a chunk, then token by token with a padding step, equal each row's full causal forward;
    the explanation says the residual's gradient joins the norm's backward on both blocks."""
    from te_jax import fp8

    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")
    m = layer(layer_type="encoder", self_attn_mask_type="causal", num_gqa_groups=2, layernorm_type="rmsnorm",
              mlp_activations=("silu", "linear"), use_bias=False, dtype=jnp.float32)
    b, window, n_steps, max_len = 3, 4, 3, 8
    valid = stream_validity([4, 2, 1], window, n_steps, "left", step_padding=[(1, 1)])
    x = rand(31, (b, window + n_steps, D))
    with fp8.autocast(recipe=fp8.DelayedScaling(amax_history_len=4)):
        v = init(m, rand(8, (b, max_len, D)), decode=True, deterministic=True)
        shapes = jax.eval_shape(lambda a: m.init({"params": jax.random.key(0)}, a, decode=True, deterministic=True),
                                rand(8, (b, max_len, D)))[fp8.FP8_COLLECTION]
        state = jax.tree_util.tree_map_with_path(  # scales away from 1, empty histories
            lambda p, a: jnp.full(a.shape, 8.0 if "scale" in jax.tree_util.keystr(p) else 0.0, a.dtype), shapes)
        params = {"params": v["params"], fp8.FP8_COLLECTION: state}
        cache = v["cache"]
        info = fp8.explain(lambda: m.apply({**params, "cache": cache}, x[:, :window], decode=True,
                                           deterministic=True, mutable=["cache"]))
        joined = [i.module for i in info if "residual's gradient added" in i.reason]
        assert joined == ["attention/query", "attention/kv", "mlp", "mlp"], [i.reason for i in info]
        step = jit_decode(m, deterministic=True)
        outs = []
        for a, e in [(0, window)] + [(t, t + 1) for t in range(window, window + n_steps)]:
            seg = jnp.asarray(valid[:, a:e], jnp.int32)
            y, mut = step(params, cache, x[:, a:e], dict(q_segment_ids=seg, kv_segment_ids=seg))
            cache = mut["cache"]
            outs.append(y)
        check_rows_against_full(m, params, x, valid, jnp.concatenate(outs, axis=1), what="fp8 fused layer decode",
                                static=dict(deterministic=True))
        full_fp8 = jit_full(m, deterministic=True)(params, x, {})
    # and the FP8 full forward is the fp32 layer's within E4M3 error (about 0.05 here; with the norm's output taken
    # as a residual instead of the input, 0.27)
    full_fp32 = jit_full(m, deterministic=True)({"params": v["params"]}, x, {})
    err = float(jnp.linalg.norm(full_fp8 - full_fp32) / jnp.linalg.norm(full_fp32))
    assert err < 0.1, err
