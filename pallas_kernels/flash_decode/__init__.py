"""Flash-decoding: short queries (decode steps, speculative tokens) against a long KV cache.

See kernel.py for the design (query heads of a KV group in one tile, the KV length split across
programs and merged by logsumexp, per-row visible ranges from the `AttentionMask`).
"""
from pallas_kernels.flash_decode.kernel import MAX_QUERY_LEN, DecodeConfig, decode_reason, describe, flash_decode

__all__ = ["DecodeConfig", "MAX_QUERY_LEN", "decode_reason", "describe", "flash_decode"]
