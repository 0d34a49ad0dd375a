"""The decode kernel (pallas_kernels/flash_decode): short queries against a KV cache, in interpret mode on the
CPU (the real kernel on a GPU), against an fp32 reference built from the dense mask; and its dispatch.
Kernel and reference run jitted in one program per test (eagerly every op compiles on its own)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
import te_jax.attention as attention_mod
from helpers import qkv, rand
from jaxpr_walk import walk
from pallas_kernels.flash_decode import DecodeConfig, decode_reason, flash_decode, flash_decode_paged
from pallas_kernels.mask import AttentionMask


def reference(q, k, v, mask, scale, softcap=None):
    """fp32 (out, lse) from the dense mask; rows that see no key: out 0, lse -inf."""
    rep = q.shape[2] // k.shape[2]
    f32 = lambda x: x.astype(jnp.float32)
    kk, vv = jnp.repeat(f32(k), rep, axis=2), jnp.repeat(f32(v), rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", f32(q), kk, precision="highest") * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask.dense()[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv, precision="highest"), lse


def cache_mask(lens, sq, skv, *, q_valid=None, causal=True, window=(-1, -1)):
    """A KV cache filled to lens[b] on row b, the sq new tokens the last ones of it (positions lens - sq + t);
    q_valid [b, sq] False marks padding queries."""
    lens = np.asarray(lens)
    b = len(lens)
    kv_seg = (np.arange(skv)[None] < lens[:, None]).astype(np.int32)
    q_seg = np.ones((b, sq), np.int32) if q_valid is None else np.asarray(q_valid, np.int32)
    q_pos = (lens[:, None] - sq + np.arange(sq)[None]).astype(np.int32)
    kv_pos = np.broadcast_to(np.arange(skv, dtype=np.int32), (b, skv))
    return AttentionMask(jnp.asarray(q_seg), jnp.asarray(q_pos), jnp.asarray(kv_seg), jnp.asarray(kv_pos),
                         causal=causal, window=window)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("case", [
    # GQA 8/2, one token, partly filled cache (one row empty: zeros, lse -inf), more shares than some rows fill
    dict(b=3, sq=1, h=8, g=2, d=64, skv=256, lens=[256, 37, 0], cfg=DecodeConfig(block_kv=32, num_splits=4)),
    # speculative tokens, MHA, a padding query, sliding window and softcap, bf16
    dict(b=2, sq=4, h=2, g=2, d=32, skv=200, lens=[200, 90], q_valid=[[1, 1, 1, 1], [1, 1, 1, 0]],
         window=(50, 0), softcap=5.0, dtype=jnp.bfloat16),
    # MQA with 32 query heads x 4 tokens = 128 rows: two row tiles; cache length not a multiple of 16, head_dim 40;
    # not causal (every cached key)
    dict(b=1, sq=4, h=32, g=1, d=40, skv=131, lens=[131], cfg=DecodeConfig(block_rows=64), causal=False),
    # the shares merged inside the kernel by the last program of each tile (DecodeConfig.merge "kernel"): an empty
    # row and rows with fewer blocks than shares (empty shares), GQA; and two row tiles per KV head
    dict(b=3, sq=1, h=8, g=2, d=64, skv=256, lens=[256, 37, 0],
         cfg=DecodeConfig(block_kv=32, num_splits=5, merge="kernel")),
    pytest.param(dict(b=1, sq=4, h=32, g=2, d=32, skv=200, lens=[200], cfg=DecodeConfig(block_rows=32, merge="kernel"),
                      dtype=jnp.bfloat16), marks=pytest.mark.slow),
    # the grid with the share axis fastest (DecodeConfig.shares_last=False), XLA and in-kernel merges
    dict(b=3, sq=1, h=8, g=2, d=64, skv=256, lens=[256, 37, 0],
         cfg=DecodeConfig(block_kv=32, num_splits=4, shares_last=False)),
    dict(b=3, sq=1, h=8, g=2, d=64, skv=256, lens=[256, 37, 0],
         cfg=DecodeConfig(block_kv=32, num_splits=5, merge="kernel", shares_last=False)),
], ids=["gqa-lengths", "spec-window-softcap", "mqa-two-tiles", "merge-in-kernel", "merge-in-kernel-two-tiles",
        "shares-first", "shares-first-merge-in-kernel"])
def test_matches_reference(case):
    dtype = case.get("dtype", jnp.float32)
    b, sq, h, g, d, skv = (case[n] for n in ("b", "sq", "h", "g", "d", "skv"))
    q, k, v, ct = qkv(sum(case["lens"]) + sq, b, sq, skv, h, g, d, dtype=dtype, cotangent=True)
    mask = cache_mask(case["lens"], sq, skv, q_valid=case.get("q_valid"), causal=case.get("causal", True),
                      window=case.get("window", (-1, -1)))
    scale, cap = d ** -0.5, case.get("softcap")
    (out, lse), (rout, rlse) = jax.jit(lambda q, k, v: (
        flash_decode(q, k, v, mask, scale=scale, softcap=cap, config=case.get("cfg")),
        reference(q, k, v, mask, scale, cap)))(q, k, v)
    assert out.shape == (b, sq, h, d) and out.dtype == dtype and lse.shape == (b, h, sq)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    assert _rel(out, rout) < tol
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))  # empty rows: -inf exactly there
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rlse)[fin], atol=1e-4 if dtype == jnp.float32 else 2e-2)
    hidden = ~np.isfinite(np.asarray(rlse))  # [b, h, sq]
    assert np.all(np.asarray(out, np.float32)[np.transpose(hidden, (0, 2, 1))] == 0)


def test_paged_cache_matches_reference():
    """A paged cache (pages of 32 keys shuffled in a shared pool, GQA, per-row lengths, speculative tokens with a
    padding query, a window (positions matter, not only the set of keys), bf16) gives what the contiguous cache gives in the fp32 reference; table entries past a row's
    length are garbage (-1, out of range) and never read."""
    b, sq, h, g, d, page, n_pages = 3, 2, 8, 2, 64, 32, 4
    skv = page * n_pages
    lens = np.array([128, 45, 2])
    q, k, v = qkv(11, b, sq, skv, h, g, d, dtype=jnp.bfloat16)
    perm = np.random.default_rng(0).permutation(b * n_pages)  # logical page (row, i) -> pool page perm[row * 4 + i]
    pool = lambda x: jnp.zeros((b * n_pages, page, g, d), x.dtype).at[perm].set(x.reshape(b * n_pages, page, g, d))
    table = perm.reshape(b, n_pages).copy()
    for r, n in enumerate(lens):
        table[r, -(-n // page):] = -1 if r % 2 else 10**6  # unused entries: never read (and clamped)
    q_valid = np.array([[1, 1], [1, 0], [1, 1]], bool)
    ref_mask = cache_mask(lens, sq, skv, q_valid=q_valid, window=(40, 0))
    (out, lse), (rout, rlse) = jax.jit(lambda q, k, v: (
        flash_decode_paged(q, pool(k), pool(v), jnp.asarray(table), jnp.asarray(lens), scale=0.125,
                           q_valid=q_valid, window=(40, 0), config=DecodeConfig(block_kv=16, num_splits=3)),
        reference(q, k, v, ref_mask, 0.125)))(q, k, v)
    assert _rel(out, rout) < 2e-2
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
    merged = jax.jit(lambda q, k, v: flash_decode_paged(  # the shares merged in the kernel give the same
        q, pool(k), pool(v), jnp.asarray(table), jnp.asarray(lens), scale=0.125, q_valid=q_valid, window=(40, 0),
        config=DecodeConfig(block_kv=16, num_splits=3, merge="kernel")))(q, k, v)
    assert _rel(merged[0], out) < 1e-2 and _rel(merged[1][np.isfinite(rlse)], lse[np.isfinite(rlse)]) < 1e-5
    with pytest.raises(ValueError, match=r"DecodeConfig.merge='gpu' must be one of \('xla', 'kernel'\)"):
        DecodeConfig(merge="gpu")
    with pytest.raises(ValueError, match="page_size 24 is not a multiple of 16"):
        flash_decode_paged(q, jnp.zeros((4, 24, g, d), q.dtype), jnp.zeros((4, 24, g, d), q.dtype),
                           jnp.zeros((b, 2), jnp.int32), jnp.asarray(lens), scale=0.125)
    with pytest.raises(ValueError, match=r"kv_lens has shape \(2,\), expected \[batch\] = \(3,\)"):
        flash_decode_paged(q, pool(k), pool(v), jnp.asarray(table), jnp.array([1, 2]), scale=0.125)


def test_gradients_match_reference():
    """Differentiable through the portable kernel's backward (q, k, v; an lse cotangent too)."""
    b, sq, h, g, d, skv = 2, 2, 4, 2, 32, 128
    q, k, v, ct = qkv(5, b, sq, skv, h, g, d, cotangent=True)
    dl = rand(6, (b, h, sq))
    mask = cache_mask([128, 70], sq, skv)

    def loss(fn):
        return lambda q, k, v: (lambda o, l: jnp.sum(o * ct) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * dl))(
            *fn(q, k, v))

    ours, ref = jax.jit(lambda q, k, v: (  # one compile
        jax.grad(loss(lambda q, k, v: flash_decode(q, k, v, mask, scale=0.2, config=DecodeConfig(block_kv=32))),
                 (0, 1, 2))(q, k, v),
        jax.grad(loss(lambda q, k, v: reference(q, k, v, mask, 0.2)), (0, 1, 2))(q, k, v)))(q, k, v)
    for a, r in zip(ours, ref):
        assert _rel(a, r) < 1e-4


def test_unmasked_cache_matches_reference():
    """mask=None (every query sees every key: a whole cache, cross-attention): the kernel makes the key rows from
    the cache length (no [B, Skv] rows around it), and gives the output, lse and gradients of the fp32 reference
    over the full mask; also a cache that is not a whole number of blocks (131 keys: its padding hidden) and the
    in-kernel merge."""
    b, sq, h, g, d = 2, 2, 8, 2, 32
    for skv, cfg in ((128, DecodeConfig(block_kv=32, num_splits=3)), (131, None),
                     (96, DecodeConfig(block_kv=16, num_splits=4, merge="kernel"))):
        q, k, v, ct = qkv(skv, b, sq, skv, h, g, d, cotangent=True)
        full = AttentionMask.full(b, sq, skv)
        loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v)[0] * ct))
        ours = lambda q, k, v: flash_decode(q, k, v, None, scale=0.3, config=cfg)
        ref = lambda q, k, v: reference(q, k, v, full, 0.3)
        (out, lse), (rout, rlse), g_ours, g_ref = jax.jit(lambda q, k, v: (
            ours(q, k, v), ref(q, k, v), jax.grad(loss(ours), (0, 1, 2))(q, k, v),
            jax.grad(loss(ref), (0, 1, 2))(q, k, v)))(q, k, v)
        assert _rel(out, rout) < 1e-5 and _rel(lse, rlse) < 1e-5, skv
        for a, r in zip(g_ours, g_ref):
            assert _rel(a, r) < 1e-4, skv
    jaxpr = jax.make_jaxpr(lambda q, k, v: flash_decode(q, k, v, None, scale=0.3))(q, k, v).jaxpr
    calls = [e for e in walk(jaxpr) if e.primitive.name == "pallas_call"]
    # meta, q, k, v and the query rows: no [B, Skv] key rows
    assert len(calls) == 1 and len(calls[0].invars) == 6, calls
    assert all(skv not in v.aval.shape for v in calls[0].invars if v.aval.dtype == jnp.int32), calls[0].invars


def test_front_door_gives_the_kernel_the_lightest_mask(monkeypatch):
    """dot_product_attention hands the decode kernel mask=None for no_mask and for a one-token bottom-right causal
    call (every key visible); bshd/sbhd padding from seqlens goes to flash_decode_cache (key rows from the lengths),
    with causal top-left or bottom-right, a window and padding queries; segment ids, windows without padding and a
    top-left causal query keep their mask rows. Outputs and gradients equal the xla backend's either way, and the
    explanation says which."""
    from pallas_kernels.flash_decode import kernel as fd_kernel
    import pallas_kernels.flash_decode as fd_pkg

    seen = []
    real, real_cache = fd_kernel.flash_decode, fd_kernel.flash_decode_cache
    monkeypatch.setattr(fd_pkg, "flash_decode", lambda q, k, v, mask, **kw: seen.append(
        "none" if mask is None else "rows") or real(q, k, v, mask, **kw))
    monkeypatch.setattr(fd_pkg, "flash_decode_cache", lambda *a, **kw: seen.append("cache") or real_cache(*a, **kw))
    b, skv, h, g, d = 2, 160, 8, 2, 32
    lens = dict(kv_seqlens=jnp.array([160, 45]))
    cases = [(dict(attn_mask_type="no_mask"), 1, "none"), (dict(attn_mask_type="causal_bottom_right"), 1, "none"),
             (dict(attn_mask_type="causal_bottom_right"), 3, "rows"), (dict(attn_mask_type="causal"), 1, "rows"),
             (dict(attn_mask_type="no_mask", window_size=(40, 40)), 1, "rows"),
             (dict(attn_mask_type="padding", q_seqlens=jnp.array([1, 1]), **lens), 1, "cache"),
             # the Flax decode path's form
             (dict(attn_mask_type="padding_causal_bottom_right", q_seqlens=jnp.array([1, 1]), **lens), 1, "cache"),
             (dict(attn_mask_type="padding_causal_bottom_right", q_seqlens=jnp.array([3, 2]), **lens), 3, "cache"),
             (dict(attn_mask_type="padding_causal_bottom_right", q_seqlens=jnp.array([4, 1]), window_size=(30, 0),
                   **lens), 4, "cache"),
             (dict(attn_mask_type="padding_causal", q_seqlens=jnp.array([2, 2]), kv_seqlens=jnp.array([7, 0])), 2,
              "cache"),
             (dict(attn_mask_type="padding_causal_bottom_right", q_segment_ids=jnp.ones((b, 1), jnp.int32),
                   kv_segment_ids=(jnp.arange(skv)[None] < jnp.array([[160], [45]])).astype(jnp.int32)), 1, "rows")]
    runs = [("bshd", c) for c in cases] + [("sbhd", cases[8])]
    for fmt, (kw, sq, mode) in runs:
        q, k, v, ct = qkv(sq, b, sq, skv, h, g, d, cotangent=True)
        if fmt == "sbhd":
            q, k, v, ct = (jnp.swapaxes(x, 0, 1) for x in (q, k, v, ct))
        kw = dict(attn_input_format=fmt, **kw)
        detail = te_jax.explain_attention_backend(q, k, v, backend="pallas", **kw).detail
        assert detail.startswith("decode kernel"), (kw, detail)
        assert ("no mask: the key rows" in detail) == (mode == "none"), (kw, detail)
        assert ("filled to each row's length" in detail) == (mode == "cache"), (kw, detail)
        seen.clear()
        fn = lambda backend: (lambda q, k, v: te_jax.dot_product_attention(q, k, v, backend=backend, **kw))
        grads = lambda backend: jax.grad(lambda q, k, v: jnp.sum(fn(backend)(q, k, v) * ct), (0, 1, 2))
        if mode != "cache":  # (the other modes' gradients: test_unmasked_cache_matches_reference, test_gradients_match_reference)
            grads = lambda backend: (lambda q, k, v: ())
        ours, ref, g_ours, g_ref = jax.jit(lambda q, k, v: (fn("pallas")(q, k, v), fn("xla")(q, k, v),
                                                            grads("pallas")(q, k, v), grads("xla")(q, k, v)))(q, k, v)
        assert seen and set(seen) == {mode}, (kw, seen)
        assert _rel(ours, ref) < 1e-5, kw
        for a, r in zip(g_ours, g_ref):  # (a query that sees one key has dq 0: compare absolutely there)
            assert _rel(a, r) < 1e-4 or float(jnp.max(jnp.abs(a - r))) < 1e-6, kw


def test_cache_lengths_entry_against_the_reference():
    """flash_decode_cache (a contiguous cache filled to per-row lengths, key rows made in the kernel) against the
    fp32 reference over the equivalent dense mask: default and explicit query positions, padding queries, an empty
    row, a window, softcap, top-left and bottom-right causal, not causal; out, lse and gradients; and its kernel
    gets no [B, Skv] rows."""
    from pallas_kernels.flash_decode import flash_decode_cache

    rng = np.random.default_rng(7)
    b, sq, h, g, d, skv = 3, 3, 8, 2, 32, 144
    for causal, window, cap, explicit in ((True, (-1, -1), None, False), (True, (20, 0), 4.0, True),
                                          (False, (-1, -1), None, True), (False, (10, 10), None, False)):
        lens = np.array([144, int(rng.integers(1, 144)), 0])
        q_valid = rng.random((b, sq)) < 0.8
        q_pos = (rng.integers(0, 150, (b, sq)) if explicit else lens[:, None] - sq + np.arange(sq)[None])
        q, k, v, ct = qkv(int(rng.integers(1000)), b, sq, skv, h, g, d, cotangent=True)
        mask = AttentionMask(jnp.asarray(q_valid, jnp.int32), jnp.asarray(q_pos, jnp.int32),
                             jnp.asarray(np.arange(skv)[None] < lens[:, None], jnp.int32),
                             jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (b, skv)), causal=causal,
                             window=window)
        ours = lambda q, k, v: flash_decode_cache(q, k, v, jnp.asarray(lens), q_positions=jnp.asarray(q_pos) if
                                                  explicit else None, q_valid=jnp.asarray(q_valid), causal=causal,
                                                  window=window, softcap=cap, scale=0.3,
                                                  config=DecodeConfig(block_kv=16, num_splits=3))
        ref = lambda q, k, v: reference(q, k, v, mask, 0.3, cap)
        loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v)[0] * ct))
        (out, lse), (rout, rlse), g_ours, g_ref = jax.jit(lambda q, k, v: (
            ours(q, k, v), ref(q, k, v), jax.grad(loss(ours), (0, 1, 2))(q, k, v),
            jax.grad(loss(ref), (0, 1, 2))(q, k, v)))(q, k, v)
        case = (causal, window, cap, explicit)
        assert _rel(out, rout) < 1e-5, case
        np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
        fin = np.isfinite(np.asarray(rlse))
        np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rlse)[fin], rtol=1e-5, atol=1e-5)
        for a, r in zip(g_ours, g_ref):
            assert _rel(a, r) < 1e-4, case
    jaxpr = jax.make_jaxpr(lambda q, k, v: flash_decode_cache(q, k, v, jnp.asarray(lens), scale=0.3))(q, k, v).jaxpr
    calls = [e for e in walk(jaxpr) if e.primitive.name == "pallas_call"]
    assert len(calls) == 1 and len(calls[0].invars) == 6, calls
    assert all(skv not in v.aval.shape for v in calls[0].invars if v.aval.dtype == jnp.int32), calls[0].invars
    with pytest.raises(ValueError, match=r"kv_lens has shape \(2,\), expected \[batch\] = \(3,\)"):
        flash_decode_cache(q, k, v, jnp.array([1, 2]), scale=0.3)
    with pytest.raises(ValueError, match=r"q_valid has shape \(3, 1\), expected \[batch, q_len\] = \(3, 3\)"):
        flash_decode_cache(q, k, v, jnp.asarray(lens), q_valid=jnp.ones((3, 1), bool), scale=0.3)
    with pytest.raises(ValueError, match=r"expected q \[B, Sq, H, Dqk\], k \[B, Skv, G, Dqk\]"):
        flash_decode_cache(q, k[:2], v[:2], jnp.asarray(lens), scale=0.3)


def test_reasons_and_errors():
    assert decode_reason((2, 1, 8, 64), (2, 4096, 2, 64), (2, 4096, 2, 64)) is None
    assert "q_len 17 > 16" in decode_reason((2, 17, 8, 64), (2, 4096, 2, 64), (2, 4096, 2, 64))
    assert "kv_len 8 <= q_len 8" in decode_reason((2, 8, 8, 64), (2, 8, 2, 64), (2, 8, 2, 64))
    q, k, v = qkv(0, 1, 1, 64, 4, 2, 16)
    with pytest.raises(ValueError, match=r"mask arrays \[1, 1\] / \[1, 32\] do not match"):
        flash_decode(q, k, v, cache_mask([32], 1, 32), scale=0.25)
    with pytest.raises(ValueError, match="DecodeConfig.block_kv=48 must be a power of two"):
        DecodeConfig(block_kv=48)
    from pallas_kernels.flash_attention import BlockSizes  # the same shared check
    with pytest.raises(ValueError, match="BlockSizes.block_q_dq=48 must be a power of two"):
        BlockSizes(block_q_dq=48)


def test_sm90_auto_takes_the_decode_kernel(monkeypatch):
    """On an sm90 GPU auto takes Pallas's decode kernel for a short query against a cache, ahead of cuDNN and the
    Hopper kernel (which would pad the query to a 128-row tile), and explains why; a prefill stays where it was."""
    monkeypatch.setattr(attention_mod, "current_platform", lambda: ("gpu", (9, 0)))
    shapes = lambda sq, skv: [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in
                              ((16, sq, 32, 128), (16, skv, 8, 128), (16, skv, 8, 128))]
    choice = te_jax.explain_attention_backend(*shapes(1, 8192), attn_input_format="bshd")
    assert choice.selected == "pallas" and choice.detail.startswith("decode kernel"), choice
    assert "decode kernel" in str(choice) and "short query" in str(choice)
    prefill = te_jax.explain_attention_backend(*shapes(2048, 2048), attn_input_format="bshd", attn_mask_type="causal")
    assert not prefill.detail.startswith("decode kernel")


def test_split_count_targets_one_wave_contiguous_and_two_waves_paged():
    """The automatic share count: the fewest shares giving >= min_programs programs (contiguous cache) or
    >= paged_min_programs (paged cache: page-long blocks through the block table), at most one per KV block."""
    from pallas_kernels.flash_decode.kernel import _geometry
    cfg = DecodeConfig()
    # batch 16 x 8 KV heads x 1 row tile = 128 programs: one share contiguous, 3 shares paged (384 >= 264)
    assert _geometry(cfg, 16, 1, 32, 32768, 8, 128, 128).n_splits == 1
    assert _geometry(cfg, 16, 1, 32, 32768, 8, 128, 128, page_size=64).n_splits == 3
    # batch 1 x 8 KV heads: 15 shares (120 programs); never more shares than KV blocks (64-key blocks: one wave)
    assert _geometry(cfg, 1, 1, 32, 32768, 8, 128, 128).n_splits == 15
    assert _geometry(cfg, 1, 1, 32, 256, 8, 128, 128).n_splits == 4
    # block_kv None: 64 keys per step for a grid of about one wave, 128 for a larger one or a paged cache
    assert _geometry(cfg, 16, 1, 32, 8192, 8, 128, 128).bk == 64  # 128 programs
    assert _geometry(cfg, 16, 1, 32, 8192, 32, 128, 128).bk == 128  # MHA: 512 programs
    assert _geometry(cfg, 16, 1, 32, 8192, 8, 128, 128, page_size=64).bk == 64  # the page length
    assert _geometry(cfg, 16, 1, 32, 8192, 8, 128, 128, page_size=256).bk == 128
    assert _geometry(DecodeConfig(block_kv=256), 1, 1, 32, 8192, 8, 128, 128).bk == 256
    assert _geometry(DecodeConfig(num_splits=5), 1, 1, 32, 32768, 8, 128, 128, page_size=64).n_splits == 5


def test_shares_are_even_across_rows_and_finer_where_the_rows_are_uneven():
    """Every share is the same number of KV blocks on every row: the longest visible range over the split count
    where the rows are even, over uneven_split_factor times it where they are not (the grid holds that many
    shares wherever rows may differ: per-row lengths or a mask, batch > 1, no num_splits given). Against the
    fp32 reference on very uneven rows (full, 17 keys, 300, empty) and on even ones."""
    from pallas_kernels.flash_decode import flash_decode_cache
    from pallas_kernels.flash_decode.kernel import _geometry, share_blocks

    uneven = jnp.array([[0, 0, 32, 32], [0, 0, 1, 2], [3, 4, 10, 19], [0, 0, 0, 0]], jnp.int32)
    assert share_blocks(uneven, 2, 8).tolist() == [4] * 4  # ceil(32 / 8): uneven rows, the fine split
    even = jnp.array([[0, 0, 32, 32], [0, 0, 30, 30], [2, 2, 31, 31]], jnp.int32)  # longest 32 <= 9/8 of 30.3
    assert share_blocks(even, 2, 8).tolist() == [16] * 3  # ceil(32 / 2): the coarse split, the rest exit at once
    assert share_blocks(uneven, 64, 64).tolist() == [1] * 4  # at least one block
    assert share_blocks(jnp.zeros((2, 4), jnp.int32), 3, 12).tolist() == [1, 1]
    # auto (None): 4 on a contiguous cache since the GPU run of 2026-11-27, 1 on a paged one (unmeasured)
    auto = lambda **kw: _geometry(DecodeConfig(min_programs=16), 4, 1, 8, 512, 2, 32, 32, uneven=True, **kw)
    assert DecodeConfig().uneven_split_factor is None and auto().grid_splits == 4 * auto().n_splits
    assert auto(page_size=64).grid_splits == auto(page_size=64).n_splits
    cfg = DecodeConfig(block_kv=16, min_programs=16, uneven_split_factor=4)
    geo = lambda **kw: _geometry(cfg, 4, 1, 8, 512, 2, 32, 32, **kw)
    assert (geo().n_splits, geo().grid_splits) == (2, 2)  # 16 programs / (4 rows x 2 KV heads); whole caches
    assert geo(uneven=True).grid_splits == 8  # x uneven_split_factor 4
    assert _geometry(cfg, 1, 1, 8, 512, 2, 32, 32, uneven=True).grid_splits == 8  # one row: nothing uneven
    assert _geometry(DecodeConfig(num_splits=3, uneven_split_factor=4), 4, 1, 8, 512, 2, 32, 32,
                     uneven=True).grid_splits == 3
    for lens in (np.array([512, 17, 300, 0]), np.array([512, 500, 480, 512])):
        q, k, v = qkv(3, 4, 1, 512, 8, 2, 32)
        out, lse = jax.jit(lambda q, k, v: flash_decode_cache(q, k, v, jnp.asarray(lens), scale=0.2,
                                                              config=cfg))(q, k, v)
        rout, rlse = reference(q, k, v, cache_mask(lens, 1, 512), 0.2)
        assert _rel(out, rout) < 1e-5, lens
        fin = np.isfinite(np.asarray(rlse))
        np.testing.assert_array_equal(np.isfinite(lse), fin)
        np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rlse)[fin], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="uneven_split_factor=0"):
        DecodeConfig(uneven_split_factor=0)
    with pytest.raises(ValueError, match="uneven_split_factor=2.5"):
        DecodeConfig(uneven_split_factor=2.5)
    with pytest.raises(ValueError, match="shares_last='yes'"):
        DecodeConfig(shares_last="yes")


def test_cache_loop_bounds_are_sound_and_as_tight_as_the_block_classes():
    """The paged kernel's loop bounds from the cache lengths alone (no [B, Skv] key rows): on random lengths,
    speculative queries with padding, causal or not, windows and block sizes, no visible key lies outside [lo, hi),
    every key of [flo, fhi) is visible to every query, and the run is the one the block classes give
    (`loop_bounds(block_classes)` on `paged_cache_mask`'s rows)."""
    from pallas_kernels.flash_decode.kernel import cache_loop_bounds, paged_cache_mask
    from pallas_kernels.mask import loop_bounds

    rng = np.random.default_rng(7)
    for trial in range(40):
        b, sq, block = 4, int(rng.integers(1, 5)), int(rng.choice([16, 32]))
        n_blocks = int(rng.integers(1, 6))
        skv = n_blocks * block
        lens = rng.integers(0, skv + 1, size=b)
        q_valid = rng.random((b, sq)) < 0.8 if trial % 3 else None
        causal = bool(trial % 2)
        window = (int(rng.choice([-1, 3, 20])), -1 if causal else int(rng.choice([-1, 0, 5])))
        mask = paged_cache_mask(lens, sq, skv, q_valid=q_valid, causal=causal, window=window)
        got = np.asarray(cache_loop_bounds(lens, mask.q_positions, mask.q_segment_ids, causal=causal, window=window,
                                           block=block, n_blocks=n_blocks))
        ref = np.asarray(loop_bounds(mask.block_classes(sq, block))[:, 0, :])
        dense = np.asarray(mask.dense())  # [B, Sq, Skv]
        for r in range(b):
            lo, flo, fhi, hi = got[r]
            assert lo <= flo <= fhi <= hi <= n_blocks, (trial, r, got[r])
            keys = np.nonzero(dense[r].any(axis=0))[0]
            assert np.all((keys >= lo * block) & (keys < hi * block)), (trial, r, got[r], keys)
            if fhi > flo:
                assert dense[r][:, flo * block:fhi * block].all(), (trial, r, got[r])
        # the same full run and no wider walk than the block classes give
        assert np.all(got[:, 0] >= ref[:, 0]) and np.all(got[:, 3] <= ref[:, 3]), (trial, got, ref)
        full_ref = ref[:, 2] - ref[:, 1]
        assert np.all(got[:, 2] - got[:, 1] >= full_ref), (trial, got, ref)
