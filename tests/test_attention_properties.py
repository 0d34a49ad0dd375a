"""Randomized equivalence: attention calls drawn at random, every backend that says it serves the
call checked against the naive attention, forward and gradients.

CI runs the fixed-seed "ci" hypothesis profile; `pytest --hypothesis-profile=long` (or
TE_JAX_HYPOTHESIS_PROFILE=long) draws many more calls.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import te_jax
from helpers import fwd_bwd, norm_rel_err, rand
from te_jax.backends.selection import BACKENDS
from naive_attention import naive_attention, naive_mask

TOL = {"float32": (2e-4, 5e-4), "bfloat16": (2e-2, 5e-2), "float16": (5e-3, 2e-2)}


@st.composite
def attention_calls(draw, max_len=12):
    fmt = draw(st.sampled_from(["bshd", "sbhd", "thd"]))
    g = draw(st.sampled_from([1, 2]))
    h = g * draw(st.sampled_from([1, 2]))
    dqk = draw(st.sampled_from([8, 16]))
    dv = draw(st.sampled_from([dqk, 8]))
    if fmt == "thd":
        mask_type = draw(st.sampled_from(["padding", "padding_causal", "padding_causal_bottom_right"]))
        n_seqs = draw(st.integers(1, 3))
        q_lens = [draw(st.integers(1, 4)) for _ in range(n_seqs)]
        kv_lens = [draw(st.integers(1, 4)) for _ in range(n_seqs)]
        b, sq, skv = 1, sum(q_lens) + draw(st.integers(0, 2)), sum(kv_lens) + draw(st.integers(0, 2))
    else:
        mask_type = draw(st.sampled_from(te_jax.MASK_TYPES))
        b = draw(st.integers(1, 2))
        sq, skv = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
        q_lens = [draw(st.integers(0, sq)) for _ in range(b)] if mask_type.startswith("padding") else None
        kv_lens = [draw(st.integers(0, skv)) for _ in range(b)] if mask_type.startswith("padding") else None
    causal = "causal" in mask_type
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, 4),
                                                 st.sampled_from([-1, 0]) if causal else st.integers(-1, 4))))
    use_bias = draw(st.booleans())
    softcap = draw(st.sampled_from([None, None, 3.0]))
    dtype = draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"]))
    seed = draw(st.integers(0, 2**16))
    return dict(fmt=fmt, b=b, sq=sq, skv=skv, h=h, g=g, dqk=dqk, dv=dv, mask_type=mask_type, q_lens=q_lens,
                kv_lens=kv_lens, window=window, use_bias=use_bias, softcap=softcap, dtype=dtype, seed=seed)


def _segments(lens, total):
    return np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)] + [np.zeros(total - sum(lens), int)])


def _materialize(c):
    rng = np.random.default_rng(c["seed"])  # numpy: no eager per-shape compile (helpers.rand)
    dt = jnp.dtype(c["dtype"])
    b, sq, skv = c["b"], c["sq"], c["skv"]
    q = rand(rng, (b, sq, c["h"], c["dqk"]), dt)
    k = rand(rng, (b, skv, c["g"], c["dqk"]), dt)
    v = rand(rng, (b, skv, c["g"], c["dv"]), dt)
    bias = rand(rng, (1, c["h"], sq, skv)) if c["use_bias"] else None
    kwargs = dict(attn_input_format=c["fmt"], attn_mask_type=c["mask_type"], window_size=c["window"],
                  softcap=c["softcap"])
    if c["fmt"] == "thd":
        q_seg, kv_seg = _segments(c["q_lens"], sq), _segments(c["kv_lens"], skv)
        kwargs.update(q_seqlens=jnp.asarray(c["q_lens"], jnp.int32), kv_seqlens=jnp.asarray(c["kv_lens"], jnp.int32))
        mask = naive_mask(1, sq, skv, c["mask_type"], q_seg=q_seg[None], kv_seg=kv_seg[None], window=c["window"])
    else:
        if c["q_lens"] is not None:
            kwargs.update(q_seqlens=jnp.asarray(c["q_lens"], jnp.int32), kv_seqlens=jnp.asarray(c["kv_lens"], jnp.int32))
        mask = naive_mask(b, sq, skv, c["mask_type"], c["q_lens"], c["kv_lens"], window=c["window"])
    return q, k, v, bias, kwargs, mask


def _rel_err(a, b):
    """‖a − b‖ / ‖b‖ with a floor on ‖b‖ (helpers.norm_rel_err)."""
    return norm_rel_err(a, b, floor=1e-2)


def _check_call(c, backends):
    q, k, v, bias, kwargs, mask = _materialize(c)
    fmt = c["fmt"]
    to_fmt = lambda t: te_jax.from_bshd(t, fmt)
    ref = lambda q, k, v, bias=None: naive_attention(q, k, v, mask, bias=bias, softcap=c["softcap"])
    ct = rand(1, (c["b"], c["sq"], c["h"], c["dv"]))
    args = (q, k, v) if bias is None else (q, k, v, bias)
    ref_out, ref_grads = fwd_bwd(ref, args, ct)
    fwd_tol, grad_tol = TOL[c["dtype"]]
    checked = []
    for name in backends:
        choice = te_jax.explain_attention_backend(*(to_fmt(t) for t in (q, k, v)), bias=bias, backend=name, **kwargs)
        if choice.selected != name:
            continue

        def te(q, k, v, bias=None, name=name):
            o = te_jax.dot_product_attention(*(to_fmt(t) for t in (q, k, v)), bias=bias, backend=name, **kwargs)
            return te_jax.to_bshd(o, fmt).astype(jnp.float32)

        out, grads = fwd_bwd(te, args, ct)
        assert out.shape == ref_out.shape
        assert _rel_err(out, ref_out) < fwd_tol, (name, c, _rel_err(out, ref_out))
        for label, g_te, g_ref in zip("qkvb", grads, ref_grads):
            assert _rel_err(g_te, g_ref) < grad_tol, (name, "d" + label, c, _rel_err(g_te, g_ref))
        checked.append(name)
    return checked


# TE_JAX_HYPOTHESIS_SHARDS=N runs the test N times with independent random draws (profiles without
# derandomize), so pytest-xdist spreads a long GPU run over N workers (compiles are CPU-bound):
#   TE_JAX_HYPOTHESIS_PROFILE=long TE_JAX_HYPOTHESIS_SHARDS=8 XLA_PYTHON_CLIENT_PREALLOCATE=false \
#     python3 -m pytest -n 8 tests/test_attention_properties.py    (8 x 300 random calls)
SHARDS = int(os.environ.get("TE_JAX_HYPOTHESIS_SHARDS", "1"))


@pytest.mark.parametrize("shard", range(SHARDS))
@given(attention_calls())
def test_random_calls_xla_and_gpu_backends(shard, c):
    """xla everywhere; on a GPU also cudnn and pallas wherever they say they serve the call."""
    backends = ["xla"] + ([n for n in BACKENDS if n != "xla"] if jax.default_backend() == "gpu" else [])
    assert "xla" in _check_call(c, backends)


@settings(max_examples=max(4, settings.default.max_examples // 3))
@given(attention_calls(max_len=9))
def test_random_calls_pallas_interpret(c):
    """The Pallas kernel (interpret mode on the CPU) on random calls; fewer examples: it is slow."""
    if jax.default_backend() == "gpu":
        pytest.skip("covered by the GPU run of test_random_calls_xla_and_gpu_backends")
    assert _check_call(c, ["pallas"]) == ["pallas"]
