"""te_jax.paged_decode_attention: a paged KV cache (shuffled pages of a shared pool, a block table per row) gives
what the same cache laid out contiguously gives through dot_product_attention, on both backends; bad arguments
are named; auto's choice is explained."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
import te_jax.backends.ops as ops_mod
from helpers import qkv

B, SQ, H, G, D, PAGE, N_PAGES = 2, 3, 4, 2, 32, 16, 4


def paged_case(seed=0, dtype=jnp.float32):
    """q, contiguous k/v [B, PAGE*N_PAGES, G, D], their pages shuffled into a pool, the block table, kv_lens."""
    q, k, v = qkv(seed, B, SQ, PAGE * N_PAGES, H, G, D, dtype=dtype)
    perm = np.random.default_rng(seed).permutation(B * N_PAGES)
    pool = lambda x: jnp.zeros((B * N_PAGES, PAGE, G, D), x.dtype).at[perm].set(x.reshape(B * N_PAGES, PAGE, G, D))
    return q, k, v, pool(k), pool(v), jnp.asarray(perm.reshape(B, N_PAGES)), jnp.array([64, 21])


@pytest.mark.parametrize("backend,fmt", [("xla", "bshd"), ("pallas", "sbhd")])
def test_matches_the_contiguous_cache(backend, fmt):
    q, k, v, kp, vp, table, lens = paged_case()
    ref, out = jax.jit(lambda q, k, v, kp, vp: (  # one compile (eagerly every op compiles on its own)
        te_jax.dot_product_attention(q, k, v, attn_input_format="bshd", attn_mask_type="padding_causal_bottom_right",
                                     q_seqlens=jnp.full((B,), SQ), kv_seqlens=lens, backend="xla"),
        te_jax.paged_decode_attention(te_jax.from_bshd(q, fmt), kp, vp, table, lens, attn_input_format=fmt,
                                      backend=backend)))(q, k, v, kp, vp)
    np.testing.assert_allclose(te_jax.to_bshd(out, fmt), ref, atol=2e-5, rtol=2e-5)


def test_window_and_padding_queries():
    """window (8, 0) and a padding query on row 1 (zeros there), xla against the kernel."""
    q, k, v, kp, vp, table, lens = paged_case(1)
    q_valid = jnp.array([[True] * SQ, [True, True, False]])
    kw = dict(window_size=(8, 0), q_valid=q_valid)
    ours, ref, full = jax.jit(lambda q, kp, vp: (  # one compile
        te_jax.paged_decode_attention(q, kp, vp, table, lens, backend="pallas", **kw),
        te_jax.paged_decode_attention(q, kp, vp, table, lens, backend="xla", **kw),
        te_jax.paged_decode_attention(q, kp, vp, table, lens, backend="xla")))(q, kp, vp)
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(ours)[1, 2] == 0)
    assert not np.allclose(full[0], ref[0], atol=1e-3)  # the window changes the answer


@pytest.mark.parametrize("change,match", [
    (dict(attn_input_format="thd"), "attn_input_format='thd': paged decoding takes one query chunk per cache row"),
    (dict(k_pages=jnp.zeros((8, 16, 2))), r"k_pages: got shape \(8, 16, 2\); expected \[num_pages, page_size"),
    (dict(block_table=jnp.zeros((3, 4), jnp.int32)), r"block_table: got shape \(3, 4\); expected \[batch, max_pages\]"),
    (dict(kv_lens=jnp.zeros((2, 1), jnp.int32)), r"kv_lens: got shape \(2, 1\); expected \[batch\] = \(2,\)"),
    (dict(block_table=jnp.zeros((2, 4))), "block_table: got dtype float32; expected an integer array"),
    (dict(window_size=(8, 4)), r"window_size: got \(8, 4\); expected \(left, 0\)"),
    (dict(k_pages=jnp.zeros((8, 24, 2, 32)), v_pages=jnp.zeros((8, 24, 2, 32))), "page_size 24 is not a multiple of 16"),
    (dict(k_pages=jnp.zeros((8, 16, 2, 64))), r"k_pages has shape \(8, 16, 2, 64\); expected \[num_pages, page_size, "
                                               r"kv_heads, 32\]"),
    (dict(v_pages=jnp.zeros((8, 16, 1, 32))), r"v_pages has shape \(8, 16, 1, 32\); expected \[8, 16, 2, head_dim_v\]"),
    (dict(q_valid=jnp.ones((2, 2), bool)), r"q_valid: got shape \(2, 2\); expected \[batch, new_tokens\] = \(2, 3\)"),
])
def test_bad_arguments_are_named(change, match):
    q, k, v, kp, vp, table, lens = paged_case()
    args = dict(query=q, k_pages=kp, v_pages=vp, block_table=table, kv_lens=lens)
    args.update(change)
    kwargs = {n: args.pop(n) for n in ("attn_input_format", "window_size", "q_valid") if n in args}
    with pytest.raises(ValueError, match=match):
        te_jax.paged_decode_attention(**args, **kwargs)


def test_auto_on_a_gpu_takes_the_measured_paged_kernel(monkeypatch):
    """On a GPU auto takes the paged kernel (measured there as fast as the contiguous cache) and says why."""
    monkeypatch.setattr(ops_mod.jax, "default_backend", lambda: "gpu")
    q, k, v, kp, vp, table, lens = paged_case()
    choice = te_jax.explain_paged_decode_backend(q, kp, vp, table, lens)
    assert choice.selected == "pallas", str(choice)
    assert "2.79 TB/s" in str(choice) and "gpu_tests_h100.md" in str(choice), str(choice)
