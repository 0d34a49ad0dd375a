"""Flash-decoding: short queries (decode steps, speculative tokens) against a long KV cache.

See kernel.py for the design (query heads of a KV group in one tile, the KV length split across
programs and merged by logsumexp, per-row visible ranges from the `AttentionMask`); `flash_decode_paged`
reads a paged KV cache (a pool of pages and a block table per row); `flash_decode_cache` a contiguous cache
filled to per-row lengths.
"""
from pallas_kernels.flash_decode.kernel import (
    MAX_QUERY_LEN,
    DecodeConfig,
    decode_reason,
    describe,
    flash_decode,
    flash_decode_cache,
    flash_decode_paged,
    paged_cache_mask,
    paged_reason,
)

__all__ = ["DecodeConfig", "MAX_QUERY_LEN", "decode_reason", "describe", "flash_decode", "flash_decode_cache", "flash_decode_paged", "paged_cache_mask",
           "paged_reason"]
