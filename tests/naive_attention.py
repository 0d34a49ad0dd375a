"""An independent naive attention for tests: the mask is built by explicit Python loops from the
mask-type definitions (not from te_jax.masks), the softmax is jax.nn.softmax in fp32."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _runs(seg_row):
    """For each token: (start, end) of its contiguous run of equal segment id."""
    n = len(seg_row)
    starts, ends = np.zeros(n, int), np.zeros(n, int)
    i = 0
    while i < n:
        j = i
        while j < n and seg_row[j] == seg_row[i]:
            j += 1
        starts[i:j], ends[i:j] = i, j
        i = j
    return starts, ends


def naive_mask(batch, sq, skv, mask_type, q_lens=None, kv_lens=None, q_seg=None, kv_seg=None,
               window=None):
    """Boolean [batch, sq, skv] from the definitions: padding by lengths or segments (0 = padding),
    causal top-left (j <= i within the sequence) or bottom-right (aligned at the ends)."""
    causal = "causal" in mask_type
    bottom_right = mask_type.endswith("bottom_right")
    left, right = window if window is not None else (-1, -1)
    m = np.zeros((batch, sq, skv), bool)
    for b in range(batch):
        if q_seg is not None:
            qs, ks = np.asarray(q_seg[b]), np.asarray(kv_seg[b])
            q_st, q_en = _runs(qs)
            k_st, k_en = _runs(ks)
        for i in range(sq):
            for j in range(skv):
                if q_seg is not None:
                    if qs[i] == 0 or qs[i] != ks[j]:
                        continue
                    qi, kj = i - q_st[i], j - k_st[j]
                    ql, kl = q_en[i] - q_st[i], k_en[j] - k_st[j]
                elif q_lens is not None:
                    if i >= q_lens[b] or j >= kv_lens[b]:
                        continue
                    qi, kj, ql, kl = i, j, q_lens[b], kv_lens[b]
                else:
                    qi, kj, ql, kl = i, j, sq, skv
                diag = qi + (kl - ql if bottom_right else 0)  # the key aligned with query i
                if causal and kj > diag:
                    continue
                if left >= 0 and kj < diag - left:
                    continue
                if right >= 0 and kj > diag + right:
                    continue
                m[b, i, j] = True
    return m


def naive_attention(q, k, v, mask, bias=None, softcap=None, scale=None):
    """q [B,Sq,H,D], k [B,Skv,G,D], v [B,Skv,G,Dv], mask [B,Sq,Skv] bool. fp32 out [B,Sq,H,Dv]."""
    q, k, v = (jnp.asarray(t, jnp.float32) for t in (q, k, v))
    h, g = q.shape[2], k.shape[2]
    k = jnp.repeat(k, h // g, axis=2)
    v = jnp.repeat(v, h // g, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + jnp.asarray(bias, jnp.float32)
    mask4 = jnp.asarray(mask)[:, None]
    any_key = mask4.any(-1, keepdims=True)
    p = jax.nn.softmax(jnp.where(mask4, s, -1e30), axis=-1)
    p = jnp.where(mask4 & any_key, p, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)
