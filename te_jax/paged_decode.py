"""Decode attention against a paged KV cache: validate, choose a backend (pallas | xla), dispatch.

A paged cache keeps the keys and values of every sequence in fixed-size pages of one shared pool, and a block
table per sequence lists its pages in order (the layout of vLLM-style serving):
  k_pages, v_pages  [num_pages, page_size, kv_heads, head_dim]
  block_table       [batch, max_pages] int    row b's logical page i is pool page block_table[b, i]
  kv_lens           [batch] int              keys cached on row b, this call's new tokens included
The query holds each row's newest 1-16 tokens (the last ones of its cache), in `attn_input_format` ("bshd" or
"sbhd"). Backends (the `pallas_kernels.flash_decode` kernel, or xla: gather the pages into a contiguous cache and
run the fp32 reference) are chosen as the norm and MLP ops choose (`TE_JAX_PAGED_DECODE_BACKEND`,
`TE_JAX_PALLAS_PAGED_DECODE=0`); `explain_paged_decode_backend` says why.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from te_jax import layouts
from te_jax.backends import ops

FORCE_ENV = "TE_JAX_PAGED_DECODE_BACKEND"
DISABLE_ENV = "TE_JAX_PALLAS_PAGED_DECODE"


def _check(query, k_pages, v_pages, block_table, kv_lens, attn_input_format, q_valid=None):
    """q in bshd, after every check a user can fail with a message naming the argument and the fix."""
    fmt = layouts.check_format(attn_input_format)
    if fmt == "thd":
        raise ValueError("attn_input_format='thd': paged decoding takes one query chunk per cache row; pass the "
                         "query as 'bshd' [batch, new_tokens, heads, head_dim] (or 'sbhd').")
    layouts.check_attention_tensor(query, "query", fmt)
    q = layouts.to_bshd(query, fmt)
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if jnp.ndim(x) != 4:
            raise ValueError(f"{name}: got shape {tuple(jnp.shape(x))}; expected [num_pages, page_size, kv_heads, "
                             f"head_dim] (a pool of pages shared by the batch).")
    if jnp.ndim(block_table) != 2 or jnp.shape(block_table)[0] != q.shape[0]:
        raise ValueError(f"block_table: got shape {tuple(jnp.shape(block_table))}; expected [batch, max_pages] = "
                         f"[{q.shape[0]}, max_pages] (row b's pages in order, as pool indices).")
    if jnp.shape(kv_lens) != (q.shape[0],):
        raise ValueError(f"kv_lens: got shape {tuple(jnp.shape(kv_lens))}; expected [batch] = ({q.shape[0]},): the "
                         f"keys cached on each row, this call's tokens included.")
    if q_valid is not None and jnp.shape(q_valid) != tuple(q.shape[:2]):
        raise ValueError(f"q_valid: got shape {tuple(jnp.shape(q_valid))}; expected [batch, new_tokens] = "
                         f"{tuple(q.shape[:2])} (batch-first in every format): True for real query tokens.")
    for name, x in (("block_table", block_table), ("kv_lens", kv_lens)):
        if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
            raise ValueError(f"{name}: got dtype {jnp.asarray(x).dtype}; expected an integer array.")
    from pallas_kernels.flash_decode import paged_reason

    why = paged_reason(q.shape, jnp.shape(k_pages), jnp.shape(v_pages), jnp.shape(block_table))
    if why is not None:
        raise ValueError(f"paged decode: query {tuple(q.shape)} (bshd), k_pages {tuple(jnp.shape(k_pages))}, "
                         f"v_pages {tuple(jnp.shape(v_pages))}, block_table {tuple(jnp.shape(block_table))}: {why}.")
    return fmt, q


def _choice(q, k_pages, v_pages, backend):
    reasons = {"pallas": None, "xla": None}
    dtype = jnp.dtype(q.dtype).name
    if dtype not in ("bfloat16", "float16", "float32"):
        reasons["pallas"] = f"dtype {dtype}: the decode kernel takes bfloat16, float16 or float32"
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        reasons["pallas"] = (f"k_pages / v_pages dtypes {k_pages.dtype} / {v_pages.dtype} differ from the query's "
                             f"{q.dtype}")
    return ops.select_backend("paged_decode", backend, reasons, force_env=FORCE_ENV, disable_env=DISABLE_ENV,
                              pref_key="paged_decode")


def explain_paged_decode_backend(query, k_pages, v_pages, block_table, kv_lens, *, attn_input_format="bshd",
                                 backend="auto"):
    """The BackendChoice paged_decode_attention would make for these arguments (shapes and dtypes only)."""
    _, q = _check(query, k_pages, v_pages, block_table, kv_lens, attn_input_format)
    return _choice(q, k_pages, v_pages, backend)


def paged_decode_attention(query, k_pages, v_pages, block_table, kv_lens, *, attn_input_format="bshd",
                           scale=None, softcap=None, window_size=None, q_valid=None, backend="auto"):
    """Attention of each row's newest tokens against its paged KV cache (forward only). Returns the output in
    `attn_input_format`, [batch, new_tokens, heads, head_dim_v] for bshd.

    query [b, s, h, d] (bshd; s <= 16, the last s of each row's kv_lens[b] keys, already written to its pages);
    k_pages / v_pages [num_pages, page_size, g, d] (page_size a multiple of 16, h % g == 0); block_table
    [b, max_pages] int (entries past a row's pages are never read; out-of-range ones are clamped); kv_lens [b].
    Each new token sees its row's keys up to its own position (causal, bottom-right), within window_size
    (left, 0) if given. q_valid [b, s] bool marks real query tokens (padding ones give zeros). scale defaults
    to 1/sqrt(head_dim). The layout and names follow vLLM's paged attention; te_jax's Flax decode cache is
    contiguous and does not use this op.
    """
    fmt, q = _check(query, k_pages, v_pages, block_table, kv_lens, attn_input_format, q_valid)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    window = (-1, -1) if window_size is None else tuple(int(w) for w in window_size)
    if len(window) != 2 or window[1] not in (-1, 0):
        raise ValueError(f"window_size: got {window_size!r}; expected (left, 0) or (left, -1): a new token never "
                         f"sees keys after its own position in a cache.")
    choice = _choice(q, k_pages, v_pages, backend)
    if choice.selected is None:
        raise ValueError(choice.error or str(choice))
    from pallas_kernels import flash_decode as fd

    if choice.selected == "pallas":
        out, _ = fd.flash_decode_paged(q, k_pages, v_pages, block_table, kv_lens, scale=scale, softcap=softcap,
                                       window=window, q_valid=q_valid)
    else:
        from pallas_kernels.flash_attention.reference import reference_attention

        b, n_pages = block_table.shape
        table = jnp.clip(jnp.asarray(block_table, jnp.int32), 0, k_pages.shape[0] - 1)
        gather = lambda x: x[table].reshape((b, n_pages * x.shape[1]) + x.shape[2:])  # [b, max_pages * page, g, d]
        mask = fd.paged_cache_mask(kv_lens, q.shape[1], n_pages * k_pages.shape[1], q_valid=q_valid, window=window)
        out, _ = reference_attention(q, gather(k_pages), gather(v_pages), mask, None, scale=scale, softcap=softcap)
    return layouts.from_bshd(out, fmt)
