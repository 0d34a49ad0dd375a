"""Huge negative biases (the Flax/HF way to mask: finfo.min, -0.7·finfo.max, -2**27, -1e9) and -inf.

Every backend must give what the xla backend (and a plain-jnp fp32 softmax) gives, forward and
gradients: a row whose visible keys all carry the same huge negative bias is the uniform mean over
the keys the *mask* allows (q·k is lost to rounding, every logit is the same number); a row emptied
by a bias of -inf, or by the mask, gives zeros. The portable kernel used to return NaN for the
first (finfo.min · log2 e overflowed to -inf, then -inf - -inf) and gradients 3-100x off for the
finite ones (the backward recomputed P from an fp32 lse in which m + log l had lost log l).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import attention_backends, qkv
from naive_attention import naive_mask
from pallas_kernels.flash_attention import AttentionMask, flash_attention_fwd, reference_attention

S, D = 64, 32
F32 = jnp.finfo(jnp.float32)
HUGE = [float(F32.min), -0.7 * float(F32.max), -2.0 ** 27, -1e9, -1e4, -float("inf")]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _inputs(seed, h, g, dtype):
    return qkv(seed, 1, S, S, h, g, D, dtype=dtype, cotangent=True)


def _naive(q, k, v, bias, mask):
    """fp32 softmax attention; mask: bool [1, S, S] (numpy). Rows without a finite logit give 0."""
    h, g = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), h // g, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), h // g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf,
                   precision=jax.lax.Precision.HIGHEST) / np.sqrt(D)
    s = jnp.where(jnp.asarray(mask)[:, None], s + bias.astype(jnp.float32), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision=jax.lax.Precision.HIGHEST)


def _vjp_fn(attn):
    """jit(bias, q, k, v, ct) -> (out, dq, dk, dv, dbias): the bias is traced, one compile per fn."""
    def run(bias, q, k, v, ct):
        out, vjp = jax.vjp(attn, q, k, v, bias)
        return (out,) + vjp(ct.astype(out.dtype))
    return jax.jit(run)


def _close(name, got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{name}: not finite"
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


def _check(results, tol, label):
    names = ("out", "dq", "dk", "dv", "dbias")
    for backend in set(results) - {"xla", "naive"}:
        for name, a, b in zip(names, results[backend], results["xla"]):
            _close(f"{label} {name} {backend} vs xla", a, b, tol)
    if "naive" in results:
        for name, a, b in zip(names, results["xla"], results["naive"]):
            _close(f"{label} {name} xla vs naive", a, b, tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_huge_bias_rows_without_mask(dtype):
    """Row 10 all keys at `neg`, row 20 half its keys, row 30 one key; every backend agrees."""
    q, k, v, ct = _inputs(0, 1, 1, dtype)
    fns = {b: _vjp_fn(lambda q, k, v, bias, b=b: te_jax.dot_product_attention(q, k, v, bias=bias, backend=b))
           for b in attention_backends()}
    if dtype == jnp.float32:
        mask = np.ones((1, S, S), bool)
        fns["naive"] = _vjp_fn(lambda q, k, v, bias: _naive(q, k, v, bias, mask))
    noise = 0.5 * jax.random.normal(jax.random.key(7), (1, 1, S, S))
    for neg in HUGE:
        bias = noise.at[:, :, 10, :].set(neg).at[:, :, 20, :32].set(neg).at[:, :, 30, 5].set(neg)
        res = {name: f(bias, q, k, v, ct) for name, f in fns.items()}
        _check(res, TOL[dtype], f"{jnp.dtype(dtype).name} bias {neg:g}")
        out = np.asarray(res["pallas"][0], np.float32)
        if neg == -float("inf"):
            assert np.all(out[0, 10] == 0), "a row emptied by -inf is masked: zeros"
        elif neg <= -1e9:  # q·k lost to rounding: the uniform mean of v
            want = np.asarray(v, np.float32)[0].mean(0)
            np.testing.assert_allclose(out[0, 10], want, atol=TOL[dtype] * 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_huge_bias_with_causal_segments_and_gqa(dtype):
    """Bias-emptied rows where the mask also removes keys (causal, two segments, padding), two query
    heads on one kv head with a per-head bias: the uniform mean over the keys the mask allows."""
    q, k, v, ct = _inputs(1, 2, 1, dtype)
    seg = jnp.asarray([[1] * 40 + [2] * 20 + [0] * 4], jnp.int32)
    mask = naive_mask(1, S, S, "padding_causal", q_seg=np.asarray(seg), kv_seg=np.asarray(seg))
    kw = dict(attn_mask_type="padding_causal", q_segment_ids=seg, kv_segment_ids=seg)
    fns = {b: _vjp_fn(lambda q, k, v, bias, b=b: te_jax.dot_product_attention(q, k, v, bias=bias, backend=b, **kw))
           for b in attention_backends()}
    if dtype == jnp.float32:
        fns["naive"] = _vjp_fn(lambda q, k, v, bias: _naive(q, k, v, bias, mask))
    noise = 0.5 * jax.random.normal(jax.random.key(8), (1, 2, S, S))
    for neg in (float(F32.min), -1e9, -float("inf")):
        bias = (noise.at[:, :, 10, :].set(neg)      # every key: the mask leaves keys 0..10
                .at[:, 0, 5, :6].set(neg)            # head 0: only the keys the mask allows
                .at[:, :, 50, :].set(neg)            # second segment: keys 40..50
                .at[:, 1, 45, 40:43].set(neg)        # head 1: part of its visible keys
                .at[:, :, 62, :].set(neg))           # a padding row: zeros whatever the bias
        res = {name: f(bias, q, k, v, ct) for name, f in fns.items()}
        _check(res, TOL[dtype], f"{jnp.dtype(dtype).name} bias {neg:g}")
        out = np.asarray(res["pallas"][0], np.float32)
        vf = np.asarray(v, np.float32)[0, :, 0]
        assert np.all(out[0, 62] == 0)
        if neg == -float("inf"):
            assert np.all(out[0, 10] == 0) and np.all(out[0, 5, 0] == 0)
        else:
            np.testing.assert_allclose(out[0, 10, 1], vf[:11].mean(0), atol=TOL[dtype] * 4)
            np.testing.assert_allclose(out[0, 5, 0], vf[:6].mean(0), atol=TOL[dtype] * 4)
            np.testing.assert_allclose(out[0, 50, 0], vf[40:51].mean(0), atol=TOL[dtype] * 4)


def test_huge_bias_lse_and_packed_input():
    """The kernel's lse of bias-filled rows is the reference's (fp32 m + log l), and the packed
    (in place) entry, which keeps its own residuals, gives xla's gradients."""
    q, k, v, ct = _inputs(2, 2, 2, jnp.float32)
    seg = jnp.ones((1, S), jnp.int32)
    pos = jnp.arange(S, dtype=jnp.int32)[None]
    bias = 0.5 * jax.random.normal(jax.random.key(9), (1, 1, S, S))
    bias = bias.at[:, :, 3, :].set(F32.min).at[:, :, 4, :].set(-1e9).at[:, :, 5, :].set(-jnp.inf)
    bias = bias.at[:, :, 6, ::2].set(-2.0 ** 27)
    am = AttentionMask(seg, pos, seg, pos)
    out, lse = flash_attention_fwd(q, k, v, am, bias, scale=D ** -0.5)
    rout, rlse = jax.jit(lambda q, k, v, bias: reference_attention(q, k, v, am, bias, scale=D ** -0.5))(q, k, v, bias)
    _close("out", out, rout, 1e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    fin = np.isfinite(np.asarray(rlse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rlse)[fin], rtol=1e-6, atol=1e-5)

    qkv = jnp.stack([q, k, v], axis=2)  # bs3hd
    fns = {b: _vjp_fn(lambda qkv, _k, _v, bias, b=b: te_jax.dot_product_attention_packed(
        qkv, qkv_layout="bs3hd", bias=bias, backend=b)) for b in attention_backends()}
    res = {name: f(bias, qkv, None, None, ct) for name, f in fns.items()}
    for name, a, b in zip(("out", "dqkv", "-", "-", "dbias"), res["pallas"], res["xla"]):
        if a is not None:
            _close(f"packed {name}", a, b, 1e-5)
