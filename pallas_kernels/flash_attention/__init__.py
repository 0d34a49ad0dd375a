"""Portable (Triton-lowered) Pallas flash attention, forward and backward.

See kernel.py for the design (block skipping, padding) and pallas_kernels/mask.py for the mask
(`AttentionMask`, re-exported here) that every entry point takes.
"""
from pallas_kernels.flash_attention.kernel import (
    BlockSizes,
    block_schedule,
    default_block_sizes,
    flash_attention,
    flash_attention_bwd,
    flash_attention_fwd,
    flash_attention_packed,
    packed_in_place_reason,
    PACKED_LAYOUTS,
)
from pallas_kernels.flash_attention.reference import reference_attention
from pallas_kernels.mask import AttentionMask

__all__ = [
    "AttentionMask",
    "BlockSizes",
    "block_schedule",
    "default_block_sizes",
    "flash_attention",
    "flash_attention_bwd",
    "flash_attention_fwd",
    "flash_attention_packed",
    "packed_in_place_reason",
    "PACKED_LAYOUTS",
    "reference_attention",
]
