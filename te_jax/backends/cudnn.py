"""The `cudnn` backend: `jax.nn.dot_product_attention(implementation="cudnn")` where it serves."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.backends.base import Capabilities

# The mask types jax.nn's cuDNN path can express (causal flags and seqlens); any other kind is refused by name,
# so a mask type added to te_jax/masks.py is never served here by accident.
_SERVED_MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                      "padding_causal_bottom_right")


class CudnnBackend:
    name = "cudnn"
    capabilities = Capabilities()  # forward only: no split backward, no packed input, no dense mask

    def choice_detail(self, call) -> str:
        return ""

    def unsupported_reason(self, call, forced: bool = False) -> str | None:
        del forced  # the same either way
        d = call.dims
        if call.platform != "gpu":
            return f"not a GPU (default backend is {call.platform!r}); cuDNN attention needs an NVIDIA GPU"
        if call.compute_capability is not None and call.compute_capability < (8, 0):
            return f"GPU arch {call.gpu_arch} is older than sm80, which cuDNN flash attention needs"
        if call.dtype_name not in ("bfloat16", "float16"):
            return f"dtype {call.dtype_name}: cuDNN flash attention takes bfloat16 or float16 only"
        hopper = call.compute_capability is not None and call.compute_capability >= (9, 0)
        max_d = 256 if hopper else 128
        for label, hd in (("head_dim_qk", d.head_dim_qk), ("head_dim_v", d.head_dim_v)):
            if hd > max_d or hd % 8:
                return f"{label}={hd}: cuDNN needs a multiple of 8 that is <= {max_d} on {call.gpu_arch}"
        if d.head_dim_qk != d.head_dim_v:
            # jax.nn checks value's shape against the query's ("value shape should be [..., d_qk]") before
            # cuDNN's own MLA support is reached (jax 0.11.2).
            return (f"head_dim_qk={d.head_dim_qk} != head_dim_v={d.head_dim_v}: jax.nn.dot_product_attention "
                    f"requires value's head_dim to equal the query's")
        if call.mask_shape is not None:
            return (f"mask (a dense boolean mask, shape {call.mask_shape}): jax.nn's cuDNN path folds a boolean mask "
                    f"into a finite large negative bias in the input dtype, so a row the mask hides entirely "
                    f"gives an average of the values, not te_jax's zeros; express padding with q_seqlens/kv_seqlens "
                    f"and causality with attn_mask_type to use cuDNN")
        if call.mask.mask_type not in _SERVED_MASK_TYPES:
            return (f"attn_mask_type={call.mask.mask_type!r}: jax.nn's cuDNN path serves "
                    f"{', '.join(_SERVED_MASK_TYPES)} only")
        if call.attn_input_format == "thd":
            return "attn_input_format='thd' (packed sequences) is not exposed by jax.nn.dot_product_attention"
        if call.padding_source == "segment_ids":
            return "segment ids (packed sequences) are not exposed by jax.nn.dot_product_attention; pass q_seqlens/kv_seqlens"
        if call.mask.bottom_right and (call.padding_source != "none" or d.q_len != d.kv_len):
            return (f"attn_mask_type={call.mask.mask_type!r} with q_len={d.q_len}, kv_len={d.kv_len}"
                    f"{' and padding' if call.padding_source != 'none' else ''}: jax.nn's cuDNN path has top-left causal only")
        left, right = call.window
        if (left, right) != (-1, -1) and not (call.mask.causal or right == 0):
            return (f"window_size={call.window}: jax.nn's cuDNN path serves windows with right=0 only "
                    f"(or a causal mask)")
        if call.softcap is not None:
            return "softcap is not exposed by jax.nn.dot_product_attention"
        if call.dropout_rate > 0:
            return "dropout is not exposed by jax.nn.dot_product_attention"
        if call.needs_split_vjp:
            return ("context parallelism needs a separate forward (with logsumexp) and backward; jax.nn's cuDNN "
                    "call exposes neither")
        return None

    def forward(self, call, q, k, v, tm, bias, *, scale, softcap, causal, window, dropout_rate, dropout_rng,
                mask=None):
        """jax.nn's cuDNN attention. Odd lengths are padded to even ones (_even_lengths): jax.nn's cuDNN call refuses
        odd lengths in its backward (jax 0.11.2: 'Unsupported sequence length'; with a bias, in its forward too)."""
        if mask is not None:
            raise NotImplementedError("a dense mask is not served by the cudnn backend (see unsupported_reason)")
        del softcap, dropout_rate, dropout_rng  # refused in unsupported_reason
        left, right = window
        is_causal = causal or right == 0
        local = (left, 0) if left >= 0 else None
        if not is_causal and local is None and (left, right) != (-1, -1):
            raise ValueError(f"window {window} not servable by cuDNN")
        padded = call.padding_source != "none"
        q_lens = kv_lens = None
        sq = q.shape[1]
        if padded:
            q_ok = tm.q_segment_ids != 0  # [B, Sq]
            kv_ok = tm.kv_segment_ids != 0  # [B, Skv]
            q_lens = jnp.sum(q_ok, axis=1).astype(jnp.int32)
            kv_lens = jnp.sum(kv_ok, axis=1).astype(jnp.int32)
            # cuDNN leaves outputs and gradients of padded tokens unspecified, and a sequence of length 0 is
            # undefined behaviour (non-finite dV for a batch with kv length 0). So: cuDNN sees lengths >= 1, and
            # padded tokens reach it through a select, whose transpose drops whatever cuDNN writes into their
            # gradients.
            zero = jnp.zeros((), q.dtype)
            q = jnp.where(q_ok[:, :, None, None], q, zero)
            k = jnp.where(kv_ok[:, :, None, None], k, zero)
            v = jnp.where(kv_ok[:, :, None, None], v, zero)
        q, k, v, bias, cu_q_lens, cu_kv_lens = _even_lengths(q, k, v, bias, q_lens, kv_lens)
        out = jax.nn.dot_product_attention(
            q, k, v, bias=None if bias is None else bias.astype(q.dtype), scale=scale, is_causal=is_causal,
            query_seq_lengths=cu_q_lens, key_value_seq_lengths=cu_kv_lens,
            local_window_size=local, implementation="cudnn")[:, :sq]
        if not padded:
            # No padding: every query row sees at least one key (top-left causal, or bottom-right with
            # q_len == kv_len, the only cases served), so there is no row to zero.
            return out
        # Rows with no visible key are zeros by contract (cuDNN leaves them unspecified). Zeroing them also
        # zeroes their output cotangent, so the key a length-0 sequence was clamped to gets no gradient.
        row_ok = q_ok & (kv_lens[:, None] > 0)
        if is_causal and local is not None:
            # Top-left causal with a left window: query i sees keys [i - left, i] of [0, kv_len), empty once
            # i - left >= kv_len (found by the CPU contract test: XLA averages such a row, cuDNN may too).
            row_ok &= tm.q_positions - left < kv_lens[:, None]
        return jnp.where(row_ok[:, :, None, None], out, jnp.zeros((), out.dtype))


def _even_lengths(q, k, v, bias, q_lens, kv_lens):
    """(q, k, v, bias, q_lens, kv_lens) for jax.nn's cuDNN call: an odd query or key length gets one zero token at the
    end, hidden from every query by the key lengths (a padding mask cuDNN applies) and dropped from the output by the
    caller's slice; padding's transpose drops its gradients. Lengths are clamped to >= 1 (a length-0 sequence is
    undefined behaviour in cuDNN; the caller zeroes those rows). Even lengths pass unchanged."""
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    pq, pkv = sq % 2, skv % 2
    if pq or pkv:
        if q_lens is None:
            q_lens = jnp.full((b,), sq, jnp.int32)
            kv_lens = jnp.full((b,), skv, jnp.int32)
        grow = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))
        q, k, v = grow(q, pq), grow(k, pkv), grow(v, pkv)
        if bias is not None:  # [b|1, h|1, sq|1, skv|1]
            bias = jnp.pad(bias, [(0, 0), (0, 0), (0, pq if bias.shape[2] == sq else 0),
                                  (0, pkv if bias.shape[3] == skv else 0)])
    clamp = lambda lens: None if lens is None else jnp.maximum(lens, 1)
    return q, k, v, bias, clamp(q_lens), clamp(kv_lens)
