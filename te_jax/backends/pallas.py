"""The `pallas` backend: te_jax's own flash-attention kernels (pallas_kernels/).

Three kernels, in this order: the decode kernel (flash-decoding, pallas_kernels/flash_decode) for
short queries (q_len <= 16) against a KV cache, on every platform; on sm90 the Hopper (Mosaic GPU)
kernel when it serves the call; the portable Triton-lowered kernel otherwise. Off-GPU the
Triton-lowered kernels run in interpret mode (tests).
The Hopper kernel's `supports` checks shapes, dtype and features; the device (sm90) and the jax
version (>= 0.11) are checked here (`hopper_device_reason`).
"""
from __future__ import annotations

import importlib

from te_jax.backends.base import Capabilities

_SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
MAX_HEAD_DIM = 256

# te_jax qkv_layout -> the portable kernel's packed layout (thd tensors get a leading batch axis of 1,
# a free reshape). sbhd layouts are absent: the kernel reads [b, s, h, d], so they are transposed anyway.
KERNEL_PACKED_LAYOUTS = {
    "bs3hd": "bs3hd", "bsh3d": "bsh3d", "bs(h+2g)d": "bs(h+2g)d",
    "bshd_bs2hd": "bshd_bs2hd", "bshd_bsh2d": "bshd_bsh2d",
    "t3hd": "bs3hd", "th3d": "bsh3d", "t(h+2g)d": "bs(h+2g)d",
    "thd_t2hd": "bshd_bs2hd", "thd_th2d": "bshd_bsh2d",
}


def _batched(tensors, fmt):
    """thd tensors as a batch of one ([t, ...] -> [1, t, ...], a reshape, no copy)."""
    if fmt != "thd":
        return tuple(tensors)
    return tuple(t.reshape((1,) + tuple(t.shape)) for t in tensors)


def _kernel_qkv(tensors):
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def hopper_device_reason() -> str | None:
    """None when this process can run the Hopper kernel, else why not (the kernel's `supports` checks only
    shapes, dtype and features; the device and the jax version are the dispatcher's to check)."""
    from te_jax import _compat

    cc = _compat.gpu_compute_capability()
    if cc is None or cc[0] != 9:
        return "not an sm90 GPU"
    if _compat.JAX_VERSION < (0, 11, 0):
        import jax

        return f"jax {jax.__version__} < 0.11 (Mosaic GPU plgpu.kernel API)"
    return None


_CONFIG_KINDS = {"HopperConfig": "hopper", "DecodeConfig": "decode", "BlockSizes": "portable"}


def _kind(config) -> str | None:
    """"portable" (BlockSizes), "hopper" (HopperConfig), "decode" (DecodeConfig) or None: the kernel a
    configuration configures."""
    return None if config is None else _CONFIG_KINDS[type(config).__name__]


def _config_kind(call) -> str | None:
    return _kind(call.kernel_config)


def _of_kind(config, kind):
    """config when it configures kernel `kind`, else None (the other kernel runs with its defaults)."""
    return config if _kind(config) == kind else None


def _block_sizes(call):
    return _of_kind(call.kernel_config, "portable")


def check_kernel_config(config):
    """config as dot_product_attention takes it: None, the portable kernel's BlockSizes, the Hopper
    kernel's HopperConfig or the decode kernel's DecodeConfig; anything else is a ValueError naming `config`."""
    if config is None:
        return None
    from pallas_kernels.flash_attention import BlockSizes
    from pallas_kernels.flash_attention_hopper import HopperConfig
    from pallas_kernels.flash_decode import DecodeConfig

    if not isinstance(config, (BlockSizes, HopperConfig, DecodeConfig)):
        raise ValueError(
            f"config: got {type(config).__name__}; expected pallas_kernels.flash_attention.BlockSizes (the portable "
            f"kernel), pallas_kernels.flash_attention_hopper.HopperConfig (the Hopper kernel) or "
            f"pallas_kernels.flash_decode.DecodeConfig (the decode kernel, q_len <= 16), or None.")
    return config


def _decode_max_q() -> int:
    from pallas_kernels.flash_decode import MAX_QUERY_LEN

    return MAX_QUERY_LEN


def _import(name):
    try:
        return importlib.import_module(name), None
    except Exception as e:  # pragma: no cover - reported as a reason
        return None, f"{type(e).__name__}: {e}"


#: The mask kinds the Hopper kernel serves (each as data: pallas_kernels.mask.AttentionMask); a kind added to
#: te_jax/masks.py is refused by name until it is checked here.
_HOPPER_MASK_KINDS = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                      "padding_causal_bottom_right")


def _delta_words(hcfg, d, marks: bool) -> str:
    """Where a Hopper backward that runs the dQ kernel gets delta = rowsum(O * dO), in words (marks: the call runs on
    a data mask's tables, whose marks take shared memory in the dQ kernel; a band has none)."""
    from pallas_kernels.flash_attention_hopper.config import delta_in_dq

    if delta_in_dq(hcfg, False, d.head_dim_qk, d.head_dim_v, marks=marks):
        return ", which computes delta = rowsum(O * dO) and runs before the dK/dV kernel"
    return ", delta = rowsum(O * dO) from an XLA reduction first"


ALIGNED_TILES_ENV = "TE_JAX_HOPPER_ALIGNED_TILES"


def aligned_tiles_setting(head_dim_qk: int, head_dim_v: int, kv_len: int) -> tuple[bool, str]:
    """(on, why) for packed documents on document-aligned Hopper tiles: TE_JAX_HOPPER_ALIGNED_TILES=1 / 0; unset or
    auto: tuning.HOPPER_ALIGNED_TILES_AUTO at head dims 128/128, the ones measured, on key rows (kv_len: a bshd row,
    or every thd token) of at least tuning.HOPPER_ALIGNED_TILES_MIN_LEN tokens (shorter rows hold few documents,
    whose tiles the grid already skips: the pre-pass and merges cost more than they save).  why: a phrase for the
    explanation ("auto" when auto takes them)."""
    from te_jax.backends import policy, tuning

    setting = policy.env_choice(ALIGNED_TILES_ENV, ("auto", "1", "0"), "auto")
    if setting != "auto":
        return setting == "1", f"{ALIGNED_TILES_ENV}={setting}"
    if not tuning.HOPPER_ALIGNED_TILES_AUTO.value:
        return False, "auto: tuning.HOPPER_ALIGNED_TILES_AUTO is off"
    if (head_dim_qk, head_dim_v) != (128, 128):
        return False, f"auto: measured at head dims 128/128 only, this call has {head_dim_qk}/{head_dim_v}"
    shortest = tuning.HOPPER_ALIGNED_TILES_MIN_LEN.value
    if kv_len < shortest:
        return False, (f"auto: key rows of {kv_len} tokens, under the {shortest} where they were measured to gain "
                       "(tuning.HOPPER_ALIGNED_TILES_MIN_LEN)")
    return True, "auto"


class PallasBackend:
    name = "pallas"
    capabilities = Capabilities(split_backward=True, ring_blocks=True, packed_inputs=True, dense_mask=True,
                                opaque_kernel=True, kernel_config=True, returns_lse=True)

    def unsupported_reason(self, call, forced: bool = False) -> str | None:
        d = call.dims
        mod, err = _import("pallas_kernels.flash_attention")
        if mod is None or not hasattr(mod, "flash_attention"):
            return f"the Pallas kernel could not be imported ({err or 'no flash_attention'})"
        if call.dropout_rate > 0:
            return "dropout_rate > 0: dropout is served by the xla backend only (the Pallas kernels have no dropout)"
        if call.dtype_name not in _SUPPORTED_DTYPES:
            return f"dtype {call.dtype_name}: the Pallas kernel takes {', '.join(_SUPPORTED_DTYPES)}"
        for label, hd in (("head_dim_qk", d.head_dim_qk), ("head_dim_v", d.head_dim_v)):
            if hd > MAX_HEAD_DIM:
                return f"{label}={hd} > {MAX_HEAD_DIM}: the kernel keeps a whole head row in registers"
        if call.platform == "gpu":
            if call.compute_capability is not None and call.compute_capability < (8, 0):
                return f"GPU arch {call.gpu_arch}: the Triton-lowered kernel needs sm80 or newer"
        elif not forced:
            return (f"not a GPU (default backend is {call.platform!r}): the Pallas kernel would run in interpret "
                    f"mode, which is for tests; pass backend='pallas' to force it")
        if _config_kind(call) == "hopper":
            why = self.hopper_reason(call) if call.platform == "gpu" else "not a GPU"
            if why is not None:
                return f"config is a HopperConfig, but the Hopper kernel does not serve this call: {why}"
        if _config_kind(call) == "decode":
            why = self.decode_reason(call)
            if why is not None:
                return f"config is a DecodeConfig, but the decode kernel does not serve this call: {why}"
        return None

    @staticmethod
    def decode_reason(call) -> str | None:
        """Why the decode kernel (short queries against a KV cache) does not serve this call (None when it does)."""
        kind = _config_kind(call)
        if kind in ("portable", "hopper"):
            return f"config is the {kind} kernel's {type(call.kernel_config).__name__}"
        mod, err = _import("pallas_kernels.flash_decode")
        if mod is None or not hasattr(mod, "decode_reason"):
            return f"the decode kernel could not be imported ({err or 'no decode_reason()'})"
        if call.mask_shape is not None:
            return "mask (a dense boolean mask): the decode kernel has no bias to fold it into"
        if call.bias_shape is not None:
            return "bias: the decode kernel has no bias"
        if call.needs_split_vjp:
            return "context parallelism calls the portable kernel per ring block"
        d = call.dims
        return mod.decode_reason((d.batch, d.q_len, d.num_heads, d.head_dim_qk),
                                 (d.batch, d.kv_len, d.num_kv_heads, d.head_dim_qk),
                                 (d.batch, d.kv_len, d.num_kv_heads, d.head_dim_v))

    @staticmethod
    def decode_mode(call) -> str:
        """How the decode kernel gets the call's mask:
        "no_mask": every query sees every key (no padding, segments or window; no mask, or bottom-right causal over
        a single query token): flash_decode(mask=None), the key rows made in the kernel;
        "cache_lengths": bshd/sbhd padding from kv_seqlens (a cache filled to each row's length; causal and windows
        on positions): flash_decode_cache, the key rows made in the kernel from the lengths;
        "mask_rows": anything else (segment ids, thd): flash_decode with the [B, Skv] key rows."""
        d = call.dims
        if call.attn_input_format != "thd" and call.padding_source == "seqlens":
            return "cache_lengths"
        if (call.padding_source == "none" and call.window == (-1, -1) and call.attn_input_format != "thd"
                and (call.mask.mask_type == "no_mask"
                     or (call.mask.mask_type == "causal_bottom_right" and d.q_len == 1))):
            return "no_mask"
        return "mask_rows"

    @staticmethod
    def hopper_data_mask(call) -> bool:
        """Whether the Hopper kernel runs this call under a data mask (pallas_kernels.mask.AttentionMask: padding,
        segments / thd documents, windows, bottom-right or unequal-length causal) rather than its plain no-mask /
        top-left causal schedules."""
        d = call.dims
        plain = call.mask.mask_type in ("no_mask", "causal") or (
            call.mask.mask_type == "causal_bottom_right" and d.q_len == d.kv_len)
        return not (plain and call.padding_source == "none" and call.window == (-1, -1)
                    and not (call.mask.causal and d.q_len != d.kv_len))

    @staticmethod
    def hopper_mask_segments(call) -> bool:
        """Whether the Hopper data-mask kernels must compare segment ids: the call has padding or documents (thd,
        segment ids); without them every token is in one segment and the element mask compares positions only."""
        return call.padding_source != "none" or call.attn_input_format == "thd"

    @classmethod
    def hopper_mask_offset(cls, call) -> int | None:
        """For a one-segment call (no padding, no documents): the offset of the query positions against the keys'
        when both are token indices (masks.build_token_mask: kv_len - q_len bottom-right, else 0), so the Hopper
        kernels walk the call as a band (hopper_attention(mask_offset=...)); None otherwise."""
        if cls.hopper_mask_segments(call):
            return None
        d = call.dims
        return d.kv_len - d.q_len if call.mask.bottom_right else 0

    @staticmethod
    def hopper_aligned_tiles(call) -> bool:
        """Whether the Hopper data-mask kernels start their tiles at every document (aligned_tiles; the backward
        follows the forward, HopperConfig.bwd_aligned): calls with documents (thd, segment ids), where
        TE_JAX_HOPPER_ALIGNED_TILES says so (1 / 0; unset or auto: tuning.HOPPER_ALIGNED_TILES_AUTO). Padding from
        lengths keeps the global grid: its one document per row starts at row 0, where the grid already starts.
        Auto takes them at head dims 128/128 on key rows of 4096 tokens or more (measured there: 1.06-1.10x the grid
        on packed documents of mixed lengths, 0.87-0.92x where every document is 200-256 tokens; rows of 1024 with
        1.6 documents each: 1% slower training steps)."""
        d = call.dims
        return (PallasBackend.hopper_documents(call)
                and aligned_tiles_setting(d.head_dim_qk, d.head_dim_v, d.kv_len)[0])

    def _data_mask_forward_words(self, call, persistent: bool) -> str:
        """How the data-mask forward lays out its tiles, for choice_detail: document-aligned (and why), a persistent
        grid, or one CTA per query tile (with why the aligned tiles are off, for documents)."""
        d = call.dims
        aligned_why = aligned_tiles_setting(d.head_dim_qk, d.head_dim_v, d.kv_len)[1]
        if self.hopper_aligned_tiles(call):
            return ("on document-aligned tiles (query tiles and key blocks start at every document; the output stored "
                    "in token order, the 8-row groups two documents share summed after the kernel; " + (
                        "auto: TE_JAX_HOPPER_ALIGNED_TILES=0 keeps the global grid, faster where every document is a "
                        "few hundred tokens" if aligned_why == "auto" else aligned_why) + ")")
        if persistent:
            return ("on a persistent grid (one CTA per SM walking query tiles dealt in rounds; the next tile's Q and "
                    "K/V load during the current one)")
        off = ("; document-aligned tiles off (" + aligned_why + "; TE_JAX_HOPPER_ALIGNED_TILES=1 turns them on: faster "
               "on packed documents of mixed lengths, slower where every document is a few hundred tokens)")
        return ("one CTA per query tile (the hardware balances tiles of uneven walks; the persistent grid serves "
                "sliding windows, or fwd_persistent_masked=True)" + (off if self.hopper_documents(call) else ""))

    @staticmethod
    def hopper_documents(call) -> bool:
        """Whether the call packs documents (thd, or segment ids), the calls document-aligned tiles can serve."""
        return call.padding_source == "segment_ids" or call.attn_input_format == "thd"

    @staticmethod
    def _hopper_feature_reason(call):
        """(module, reason): what about the call keeps the Hopper kernel out (arch, mask, features)."""
        if call.compute_capability != (9, 0):
            return None, f"GPU arch {call.gpu_arch} is not sm90"
        mod, err = _import("pallas_kernels.flash_attention_hopper")
        if mod is None or not hasattr(mod, "supports"):
            return None, f"the Hopper kernel could not be imported ({err or 'no supports()'})"
        if call.mask.mask_type not in _HOPPER_MASK_KINDS:
            return mod, (f"attn_mask_type={call.mask.mask_type!r}: the Hopper kernel serves "
                         f"{', '.join(_HOPPER_MASK_KINDS)} (as segment ids and positions)")
        if call.mask_shape is not None:
            return mod, "mask (a dense boolean mask): the Hopper kernel has neither a mask nor a bias to fold it into"
        if call.bias_shape is not None:
            return mod, "bias: the Hopper kernel has no bias"
        return mod, None

    def hopper_reason(self, call) -> str | None:
        """Why the Hopper kernel does not serve this call (None when it does)."""
        if _config_kind(call) in ("portable", "decode"):
            return f"config is the {_config_kind(call)} kernel's {type(call.kernel_config).__name__}"
        if self.decode_reason(call) is None:
            return (f"q_len {call.dims.q_len} <= {_decode_max_q()}: the decode kernel serves short queries (the Hopper "
                    f"kernel would pad them to a 128-row tile)")
        mod, why = self._hopper_feature_reason(call)
        if why is not None:
            return why
        if call.needs_split_vjp:
            return ("context parallelism calls the kernel per ring block: see the ring's inner-kernel "
                    "explanation (explain_context_parallel_backend)")
        d = call.dims
        data_mask = self.hopper_data_mask(call)  # the mask's causal rule then runs as data, any lengths
        return mod.supports((d.batch, d.q_len, d.num_heads, d.head_dim_qk),
                            (d.batch, d.kv_len, d.num_kv_heads, d.head_dim_qk),
                            (d.batch, d.kv_len, d.num_kv_heads, d.head_dim_v),
                            call.dtype, call.mask.causal and not data_mask, softcap=call.softcap) or (
            self._unverified_reason(call, mod.BLOCK)) or hopper_device_reason()

    @staticmethod
    def _unverified_reason(call, block):
        """Features of the Hopper kernel that no GPU run has checked at this head_dim yet (tuning.HOPPER_GPU_VERIFIED):
        auto leaves them to the portable kernel; an explicit HopperConfig takes them anyway."""
        if _config_kind(call) == "hopper":
            return None
        from te_jax.backends import tuning

        d = call.dims
        used = [f for f, on in (("softcap", call.softcap is not None),
                                ("ragged lengths", d.q_len % block or d.kv_len % block),
                                ("data mask", PallasBackend.hopper_data_mask(call))) if on]
        verified = tuning.HOPPER_GPU_VERIFIED
        dims = (d.head_dim_qk, d.head_dim_v)
        if dims not in verified.value["head dims"]:
            checked = ", ".join(f"{a}/{b}" for a, b in verified.value["head dims"])
            return (f"head_dim_qk/head_dim_v {dims[0]}/{dims[1]}: not yet checked on a GPU for the Hopper kernel "
                    f"(checked: {checked}; {verified.results}); pass config=HopperConfig() to use it anyway")
        missing = [f for f in used if d.head_dim_qk not in verified.value[f]]
        if missing:
            checked = verified.value[missing[0]]
            where = f"checked at head_dim {', '.join(map(str, checked))}" if checked else "checked at no head_dim yet"
            return (f"{' and '.join(missing)} at head_dim {d.head_dim_qk}: not yet checked on a GPU for the Hopper "
                    f"kernel ({where}: {verified.results}); pass config=HopperConfig() to use it anyway")
        return None

    def ring_block_reason(self, call, q_block_shape, kv_block_shape, half_blocks: bool) -> str | None:
        """Why the Hopper kernel cannot serve the per-block calls of ring attention (None when it can).

        Ring blocks are called without token masks: the diagonal block pair with a causal mask, every
        other pair fully visible. That holds when the only mask is causal (or none) on unpadded tokens.
        q_block_shape / kv_block_shape: local [b, s, h, d]; half_blocks: the causal zig-zag schedule
        also calls halves of the blocks (their lengths must fit the kernel too).
        """
        if _config_kind(call) == "portable":
            return "config is the portable kernel's BlockSizes"
        mod, why = self._hopper_feature_reason(call)
        if why is not None:
            return why
        if call.softcap is not None:
            return "softcap: the ring calls the Hopper kernel's block entry points, which take no softcap"
        if call.mask.causal and q_block_shape[1] != kv_block_shape[1]:
            return "causal with different local query and key lengths"
        v_shape = tuple(kv_block_shape[:3]) + (call.dims.head_dim_v,)
        shapes = [(tuple(q_block_shape), tuple(kv_block_shape))]
        if half_blocks:
            hq = (q_block_shape[0], q_block_shape[1] // 2) + tuple(q_block_shape[2:])
            hk = (kv_block_shape[0], kv_block_shape[1] // 2) + tuple(kv_block_shape[2:])
            shapes += [(q_block_shape, hk), (hq, kv_block_shape)]
        for qs, ks in shapes:
            why = (mod.supports(qs, ks, tuple(ks[:3]) + (v_shape[3],), call.dtype, False)
                   or mod.lengths_reason(qs[1], ks[1]) or hopper_device_reason())
            if why is not None:
                return f"ring block q{tuple(qs)} x kv{tuple(ks)}: {why}"
        return None

    def dense_forward(self, q, k, v, *, scale, causal, config=None):
        """Mask-free block forward (Hopper kernel): (out [b,s,h,dv], lse [b,h,s] f32)."""
        from pallas_kernels import flash_attention_hopper as fh
        return fh.hopper_attention_fwd(q, k, v, scale=scale, causal=causal, config=_of_kind(config, "hopper"))

    def dense_backward(self, q, k, v, out, lse, dout, *, scale, causal, config=None):
        """Mask-free block backward (Hopper kernel) from the final out/lse: (dq, dk, dv)."""
        from pallas_kernels import flash_attention_hopper as fh
        return fh.hopper_attention_bwd(q, k, v, out, lse, dout.astype(q.dtype), scale=scale, causal=causal,
                                       config=_of_kind(config, "hopper"))

    def choice_detail(self, call) -> str:
        """Which Pallas kernel runs the call, and why not the Hopper kernel when it does not."""
        if self.decode_reason(call) is None:
            from pallas_kernels import flash_decode as fd

            d = call.dims
            return "decode kernel (flash-decoding): " + fd.describe(
                (d.batch, d.q_len, d.num_heads, d.head_dim_qk), (d.batch, d.kv_len, d.num_kv_heads, d.head_dim_qk),
                (d.batch, d.kv_len, d.num_kv_heads, d.head_dim_v), _of_kind(call.kernel_config, "decode"),
                mode=self.decode_mode(call))
        hr = self.hopper_reason(call) if call.platform == "gpu" else "not a GPU"
        cfg = "" if call.kernel_config is None else f"; config={call.kernel_config!r}"
        if hr is not None:
            return f"portable Triton-lowered kernel (Hopper kernel not used: {hr}){cfg}"
        from pallas_kernels import flash_attention_hopper as fh

        d = call.dims
        kv_padded = -(-d.kv_len // fh.BLOCK) * fh.BLOCK  # the kernels run (and choose schedules on) padded lengths
        if self.hopper_data_mask(call):
            what = [x for x, on in ((f"attn_mask_type={call.mask.mask_type!r}", call.mask.mask_type != "no_mask"),
                                    (f"padding from {call.padding_source}", call.padding_source != "none"),
                                    (f"window_size={call.window}", call.window != (-1, -1))) if on]
            from pallas_kernels.flash_attention_hopper.config import (aligned_backward_chosen, describe_dkv,
                                                                      masked_atomic_dq_chosen,
                                                                      persistent_masked_chosen)

            q_padded = -(-d.q_len // fh.BLOCK) * fh.BLOCK
            hcfg = _of_kind(call.kernel_config, "hopper") or fh.masked_config(d.head_dim_qk, d.head_dim_v, d.q_len,
                                                                             d.kv_len)
            window = tuple(call.window) if call.window is not None else (-1, -1)
            persistent = persistent_masked_chosen(hcfg, d.head_dim_qk, d.head_dim_v, call.dtype, window)
            band_plan = self._hopper_band_plan(call, hcfg, q_padded, kv_padded)
            plan = ("data-mask schedule (" + ", ".join(what) + ") as a band" + band_plan) if band_plan else (
                    "data-mask schedule (" + ", ".join(what) + "): the mask's segment ids and positions are "
                    "classified per tile before the kernels; empty tiles are never loaded, full tiles run without "
                    "the element mask, partial tiles apply it; forward "
                    + self._data_mask_forward_words(call, persistent)
                    + ("; backward dQ accumulated in the dK/dV kernel (bwd_dq_atomic=True)"
                       if masked_atomic_dq_chosen(d.head_dim_qk, d.head_dim_v, kv_padded, hcfg, False) else
                       "; backward dQ from its own kernel" + _delta_words(hcfg, d, marks=True))
                    + ("; the backward's dQ and dK/dV kernels on document-aligned tiles too (bwd_aligned)"
                       if self.hopper_aligned_tiles(call) and aligned_backward_chosen(hcfg) else ""))
            dkv = describe_dkv(hcfg, d.head_dim_qk, d.head_dim_v, masked=True)
            plan += f"; backward {dkv}" if dkv else ""
        else:
            plan = fh.describe_plan(d.head_dim_qk, kv_padded, call.mask.causal, call.dtype, call.kernel_config,
                                    head_dim_v=d.head_dim_v)
        if call.softcap is not None:
            plan += f"; softcap {call.softcap:g} (tanh on every score tile, its derivative in the backward)"
        ragged = [f"{n} {x}" for n, x in (("q_len", d.q_len), ("kv_len", d.kv_len)) if x % fh.BLOCK]
        if ragged:
            plan += (f"; {', '.join(ragged)} padded with zeros to a multiple of {fh.BLOCK} (a copy of the operands), "
                     + ("the padded tokens masked as padding" if self.hopper_data_mask(call)
                        else "the padded keys hidden by the causal diagonal" if call.mask.causal
                        else "the padded keys masked on every K/V step"))
        return f"Hopper (Mosaic GPU) kernel: {plan}{cfg}"

    def _hopper_band_plan(self, call, hcfg, q_padded: int, kv_padded: int) -> str | None:
        """How the Hopper kernels walk a one-segment call as a band (hopper_attention(mask_offset=)), in words; None
        for calls that are not bands (padding, documents, or lengths padded to whole tiles)."""
        from pallas_kernels import flash_attention_hopper as fh
        from pallas_kernels.flash_attention_hopper.band import band_forward_chosen, heavier_tiles_last
        from pallas_kernels.flash_attention_hopper.config import (masked_atomic_dq_chosen, persistent_band_bwd_chosen,
                                                                  persistent_band_fwd_chosen, rendezvous_named)
        from pallas_kernels.flash_attention_hopper.data_mask import MaskRule

        d = call.dims
        offset = self.hopper_mask_offset(call)
        if offset is None or fh.compares_segments(False, d.q_len, d.kv_len):
            return None
        window = tuple(call.window) if call.window is not None else (-1, -1)
        band = MaskRule(call.mask.causal, window, segments=False, offset=offset).band()
        atomic = masked_atomic_dq_chosen(d.head_dim_qk, d.head_dim_v, kv_padded, hcfg, False, band=band)
        return (" (positions only: one segment; token indices, offset " + str(offset) + "): each query tile (forward, "
                "dQ) and key tile (dK/dV) walks only the blocks of its band of visible pairs, the edge blocks masked "
                "from iotas; no pre-pass, no tables; backward dQ " + (
                    "accumulated in the dK/dV kernel (a wide band)" if atomic else
                    "from its own kernel" + _delta_words(hcfg, d, marks=False) + (
                        "; dK/dV on a persistent grid (bwd_persistent_band)"
                        if persistent_band_bwd_chosen(hcfg, d.head_dim_qk, d.head_dim_v) else "")) + (
                    ("; forward on a persistent grid (fwd_persistent_band)" + (
                        "" if rendezvous_named(hcfg, False, "persistent band", band)
                        else ", its warpgroups taking turns through mbarriers (a narrow band)")
                     if persistent_band_fwd_chosen(hcfg, d.head_dim_qk, d.head_dim_v, call.dtype, band) else
                     "; forward tiles launched heaviest first (fwd_band_heavy_first)"
                     if hcfg.fwd_band_heavy_first is not False and heavier_tiles_last(
                         band, q_padded, kv_padded, 2 * hcfg.block_q, hcfg.block_kv) else "")
                    if band_forward_chosen(band, d.q_len, d.kv_len) else
                    "; forward on the data-mask tables (some queries see no key)"))

    def data_mask_tiles(self, call, tm, window) -> str | None:
        """For a call the Hopper kernel runs under a data mask, with concrete mask arrays: how its forward walks
        the (query tile, key tile) pairs, e.g. "forward tiles: 96 of 256 computed (40 with the element mask, 56
        full), 160 skipped". None otherwise (other kernels, traced masks)."""
        if call.platform != "gpu" or self.kernel_name(call) != "hopper" or not self.hopper_data_mask(call):
            return None
        import jax

        from te_jax.masks import _is_concrete

        mask = tm.with_rule(call.mask.causal, window)
        if not all(_is_concrete(x) for x in jax.tree_util.tree_leaves(mask)):
            return None
        from pallas_kernels import flash_attention_hopper as fh
        from pallas_kernels.flash_attention_hopper.aligned_tiles import aligned_mask_tables
        from pallas_kernels.flash_attention_hopper.data_mask import mask_tables

        d = call.dims
        pq, pkv = -(-d.q_len // fh.BLOCK) * fh.BLOCK, -(-d.kv_len // fh.BLOCK) * fh.BLOCK
        cfg = _of_kind(call.kernel_config, "hopper") or fh.masked_config(d.head_dim_qk, d.head_dim_v, d.q_len,
                                                                         d.kv_len)
        aligned = self.hopper_aligned_tiles(call)
        t = (aligned_mask_tables if aligned else mask_tables)(mask.pad(pq, pkv), cfg, backward=False,
                                                              segments=self.hopper_mask_segments(call))
        counts = jax.device_get(t.aligned.counts if aligned else t.fwd[0])  # [B, query tiles, groups + 1]
        ends = [int(counts[..., j].sum()) for j in range(counts.shape[-1])]
        partial, visible = ends[-2], ends[-1]
        groups = ""
        if len(ends) == 4:  # data_mask.MaskRule.partial_rules: positions only, segments only, both
            sizes = [ends[0], ends[1] - ends[0], ends[2] - ends[1]]
            groups = ": " + ", ".join(f"{n} {what}" for n, what in zip(sizes, (
                "comparing positions only", "segments only", "both")))
        what = f"({partial} with the element mask{groups}; {visible - partial} full)"
        if aligned:  # the tiles in use vary with the documents: no grid to count skipped tiles against
            return (f"forward tiles ({2 * cfg.block_q} queries x {cfg.block_kv} keys, per head, starting at every "
                    f"document): {visible} computed {what}")
        total = counts.shape[0] * counts.shape[1] * (pkv // cfg.block_kv)
        return (f"forward tiles ({2 * cfg.block_q} queries x {cfg.block_kv} keys, per head): {visible} of {total} "
                f"computed {what}, {total - visible} skipped")

    def kernel_name(self, call) -> str:
        """"decode", "hopper" or "portable": the kernel that runs `call`."""
        if self.decode_reason(call) is None:
            return "decode"
        if call.platform == "gpu" and self.hopper_reason(call) is None:
            return "hopper"
        return "portable"

    @staticmethod
    def _fold_mask(tm, bias, mask, *, causal, window):
        """A dense mask as the portable kernel takes it: (bias with DENSE_MASK_NEG on masked-out elements,
        [B, Sq, H|1, 1] rows that see a key). Exact: a masked element's exp() underflows to 0 next to any
        visible logit; rows the mask (with the token mask) hides entirely are zeroed after the kernel,
        which zeroes their cotangent too, so they add nothing to any gradient."""
        from te_jax import masks

        return (masks.fold_dense_mask(bias, mask, masks.DENSE_MASK_NEG),
                masks.dense_mask_rows_visible(tm, mask, causal=causal, window=window))

    @staticmethod
    def _zero_hidden_rows(out, lse, rows, with_lse):
        """Rows the dense mask hides entirely: out 0 and lse -inf (their folded-bias lse is finite but
        meaningless). Returns out, or (out, lse) with with_lse."""
        import jax.numpy as jnp

        if rows is not None:
            out = jnp.where(rows, out, jnp.zeros((), out.dtype))
            if with_lse:
                lse = jnp.where(jnp.swapaxes(rows[..., 0], 1, 2), lse, -jnp.inf)  # [B, Sq, H|1] -> [B, H|1, Sq]
        return (out, lse) if with_lse else out

    def forward(self, call, q, k, v, tm, bias, *, scale, softcap, causal, window, dropout_rate, dropout_rng,
                mask=None, with_lse=False):
        """with_lse: (out, lse), both differentiable (every kernel's custom VJP takes an lse cotangent)."""
        del dropout_rate, dropout_rng
        rows = None
        if mask is not None:  # never the Hopper or decode kernel: their reasons name the mask
            bias, rows = self._fold_mask(tm, bias, mask, causal=causal, window=window)
        kernel = self.kernel_name(call)
        if kernel == "decode":
            from pallas_kernels import flash_decode as fd
            cfg, mode = _of_kind(call.kernel_config, "decode"), self.decode_mode(call)
            if mode == "cache_lengths":  # key j of row b: segment (j < kv_len), position j - kv_positions[b, 0]
                import jax.numpy as jnp

                out, lse = fd.flash_decode_cache(
                    q, k, v, jnp.sum(tm.kv_segment_ids != 0, axis=1, dtype=jnp.int32),
                    q_positions=tm.q_positions - tm.kv_positions[:, :1], q_valid=tm.q_segment_ids != 0,
                    causal=causal, window=window, scale=scale, softcap=softcap, config=cfg)
            else:
                mask = None if mode == "no_mask" else tm.with_rule(causal, window)
                out, lse = fd.flash_decode(q, k, v, mask, scale=scale, softcap=softcap, config=cfg)
            return (out, lse) if with_lse else out
        if kernel == "hopper":
            from pallas_kernels import flash_attention_hopper as fh
            if self.hopper_data_mask(call):
                out, lse = fh.hopper_attention(q, k, v, scale=scale, config=call.kernel_config, softcap=softcap,
                                               mask=tm.with_rule(causal, window),
                                               mask_segments=self.hopper_mask_segments(call),
                                               mask_aligned=self.hopper_aligned_tiles(call),
                                               mask_offset=self.hopper_mask_offset(call))
            else:
                out, lse = fh.hopper_attention(q, k, v, scale=scale, causal=causal, config=call.kernel_config,
                                               softcap=softcap)
            return (out, lse) if with_lse else out
        from pallas_kernels import flash_attention as fa
        out, lse = fa.flash_attention(q, k, v, tm.with_rule(causal, window), bias, scale=scale, softcap=softcap,
                                      block_sizes=_block_sizes(call))
        return self._zero_hidden_rows(out, lse, rows, with_lse)

    def packed_input_reason(self, call, qkv_layout: str, tensors, num_heads: int, num_gqa_groups: int):
        """None when `forward_packed` reads the packed tensor(s) in place, else why they must be split.

        `tensors` are what the qkv_layout stores (arrays or ShapeDtypeStructs), in its format.
        """
        if self.kernel_name(call) in ("hopper", "decode"):
            return f"the {self.kernel_name(call)} kernel takes separate q, k, v arrays"
        if call.attn_input_format == "sbhd":
            return ("attn_input_format='sbhd': the kernel reads [b, s, h, d], so sbhd tensors are transposed "
                    "(a copy) whatever the layout; only bshd and thd packed tensors are read in place")
        kernel_layout = KERNEL_PACKED_LAYOUTS.get(qkv_layout)
        if kernel_layout is None:
            return f"qkv_layout={qkv_layout!r} is not a packed layout the kernel knows"
        mod, err = _import("pallas_kernels.flash_attention")
        if mod is None or not hasattr(mod, "packed_in_place_reason"):
            return f"the kernel's packed entry could not be imported ({err or 'no packed_in_place_reason'})"
        import jax

        lead = (1,) if call.attn_input_format == "thd" else ()
        shapes = [jax.ShapeDtypeStruct(lead + tuple(t.shape), t.dtype) for t in tensors]
        why = mod.packed_in_place_reason(_kernel_qkv(shapes), layout=kernel_layout, num_heads=num_heads,
                                         num_kv_heads=num_gqa_groups, block_sizes=_block_sizes(call))
        return None if why is None else f"the packed tensor would need padding: {why}"

    def forward_packed(self, call, qkv_layout, tensors, tm, bias, *, num_heads, num_gqa_groups, scale, softcap,
                       causal, window, mask=None, with_lse=False):
        """The portable kernel on the packed tensor(s) as they lie; returns out [b, s, h, d] (bshd), or
        (out, lse) with with_lse."""
        from pallas_kernels import flash_attention as fa
        rows = None
        if mask is not None:
            bias, rows = self._fold_mask(tm, bias, mask, causal=causal, window=window)
        out, lse = fa.flash_attention_packed(
            _kernel_qkv(_batched(tensors, call.attn_input_format)), tm.with_rule(causal, window), bias,
            layout=KERNEL_PACKED_LAYOUTS[qkv_layout], num_heads=num_heads, num_kv_heads=num_gqa_groups,
            scale=scale, softcap=softcap, block_sizes=_block_sizes(call))
        return self._zero_hidden_rows(out, lse, rows, with_lse)

    def forward_only(self, q, k, v, tm, bias, *, scale, softcap, causal, window, config=None):
        from pallas_kernels import flash_attention as fa
        return fa.flash_attention_fwd(q, k, v, tm.with_rule(causal, window), bias, scale=scale, softcap=softcap,
                                      block_sizes=_of_kind(config, "portable"))

    def backward(self, q, k, v, tm, bias, out, lse, dout, dlse=None, *, scale, softcap, causal, window,
                 config=None):
        from pallas_kernels import flash_attention as fa
        return fa.flash_attention_bwd(q, k, v, tm.with_rule(causal, window), bias, out, lse, dout, dlse,
                                      scale=scale, softcap=softcap, block_sizes=_of_kind(config, "portable"))
