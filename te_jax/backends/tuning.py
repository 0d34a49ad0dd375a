"""te_jax's measured choices, as data: each a `Tuned` record (value, one line of evidence, results file).

`results` is the current results file of the benchmark (benchmarks/results/); measurements of older runs
that a line quotes are kept under the git tag HISTORY_TAG (`git show benchmarks-history-2026-11-24:<path>`).
The Hopper kernel's own defaults (e.g. ATOMIC_DQ_AUTO_MIN_KV, FWD_SPLIT_TAIL_AUTO_MIN_KV) stay in
pallas_kernels/flash_attention_hopper/config.py: the kernels import nothing from te_jax.
Change a value here only with a device run that shows it (CONTRIBUTING.md, "GPU runs").
"""
from __future__ import annotations

import dataclasses
from typing import Any

HISTORY_TAG = "benchmarks-history-2026-11-24"

ATTENTION_HOPPER_RESULTS = "benchmarks/results/attention_hopper_h100_run12f_rounds5_log.txt"  # hd128
# hd64 (and the hd128 non-causal 16k tie behind HOPPER_FASTER_MAX_LEN[(128, False)]); hd256:
ATTENTION_HOPPER_HD64_RESULTS = "benchmarks/results/attention_hopper_h100_run10.md"
ATTENTION_HOPPER_HD256_RESULTS = "benchmarks/results/attention_hopper_h100_run7_hd64_hd256.md"
ATTENTION_PORTABLE_RESULTS = "benchmarks/results/flash_attention_h100.md"
DECODE_RESULTS = "benchmarks/results/decode_h100.md"
NORM_RESULTS = "benchmarks/results/norm_shapes_h100.md"
NORM_MLP_RESULTS = "benchmarks/results/norms_mlp_h100.md"


@dataclasses.dataclass(frozen=True)
class Tuned:
    """A measured choice: `value`, the `evidence` for it (one line), and the `results` file that holds it."""

    value: Any
    evidence: str
    results: str


# ----------------------------------------------------------------------------- attention (selection.py)

#: Backend order off the GPU: the compiled xla reference first; pallas would run in interpret mode.
ATTENTION_OTHER_PREFERENCE = Tuned(
    ("xla", "pallas", "cudnn"),
    "off-GPU the Pallas kernels run only in interpret mode (for tests) and cuDNN not at all",
    ATTENTION_PORTABLE_RESULTS)

#: Backend order on a GPU where the Hopper kernel does not serve (or is slower there).
ATTENTION_GPU_PREFERENCE = Tuned(
    ("cudnn", "pallas", "xla"),
    "cuDNN measured faster than the portable Pallas kernel on H100",
    ATTENTION_PORTABLE_RESULTS)

#: Backend order on a GPU for short queries (q_len <= pallas_kernels.flash_decode.MAX_QUERY_LEN) against a KV cache.
DECODE_GPU_PREFERENCE = Tuned(
    ("pallas", "cudnn", "xla"),
    "H100, bf16 hd128, q 1/8 x cache 8k-128k x GQA/MHA x batch 1/16, host clock: 0.94-8.0x the best of cuDNN and "
    "FlashAttention-3 (20 of 25 rows >= 1.0, the rest 0.94-0.99); cuDNN trails far on q 8 GQA (0.3-1.4 TB/s "
    "against 0.6-2.9). By kernel time 15 of 25 rows >= 1.0; cuDNN leads by 1-3% on batch-16 MHA and by 9% on "
    "q 1 batch-1 GQA 8k",
    DECODE_RESULTS)

#: te_jax.paged_decode_attention on a GPU: "pallas" (pallas_kernels.flash_decode_paged) or "xla" (gather the pages,
#: then the reference).
PAGED_DECODE_GPU_PREFERENCE = Tuned(
    "pallas",
    "H100, q1 b16 GQA 32/8 hd128, 32k cache in shuffled 64-key pages: the paged kernel 2.79 TB/s, as fast as the "
    "contiguous cache (2.79), the xla gather 0.82; output within 9.5e-4 of the contiguous kernel's",
    "benchmarks/results/gpu_tests_h100.md")

#: Hopper-kernel features auto takes only at the head dims where a GPU run has checked them against fp32 (feature ->
#: head dims); elsewhere the portable kernel serves them until a run does. An explicit HopperConfig bypasses this.
#: A feature or head dim added to the kernel starts out of this table.
HOPPER_GPU_VERIFIED = Tuned(
    {"head dims": ((64, 64), (128, 128), (256, 256), (192, 128), (192, 192), (128, 64), (64, 128), (80, 80),
                   (96, 96), (160, 160), (112, 80),
                   (16, 16), (32, 32), (48, 48), (144, 144), (176, 176), (208, 208), (224, 224), (240, 240)),
     "softcap": (64, 128, 160, 176, 192, 256), "ragged lengths": (64, 128, 160, 176, 192, 256),
     "data mask": (64, 128, 192, 256)},
    "H100, 2026-11-26: tests/test_flash_attention_hopper.py::test_forward_and_grads (out, lse, dq, dk, dv against "
    "fp32) passed for softcap 1.5-2 (where tanh bends the logits) at hd64/128/256, causal and not, and ragged "
    "lengths 1, 129, 200, 300, 1000 at hd64/128/256; data masks (third session): "
    "test_data_mask_forward_and_grads passed for padding, documents, windows (one- and two-sided, with softcap), "
    "bottom-right causal (q 256, kv 640), rows that see nothing and ragged q 129 / kv 1000 at hd64/128/256; "
    "split head dims (fourth session): test_split_head_dims_forward_and_grads passed for head_dim_qk/head_dim_v "
    "192/128 (causal and not, GQA, softcap, ragged 200 and 300), 192/192, 128/64, 64/128, 80/80, 96/96, 160/160 "
    "(softcap, ragged 300) and 112/80 (so softcap and ragged lengths at head_dim_qk 160 and 192 too); fifth session: "
    "test_data_mask_split_head_dims passed for documents, padding and a window at 192/128; seventeenth session: "
    "test_split_head_dims_forward_and_grads passed for 16, 32, 48 (float16), 144, 176 (softcap, ragged 300), 208 "
    "(GQA), 224 and 240",
    "benchmarks/results/gpu_tests_h100.md")

#: Whether auto runs the Hopper data-mask kernels on document-aligned tiles (hopper_attention(mask_aligned=True);
#: the backward follows) for calls with documents (thd, segment ids) at head dims 128/128.
HOPPER_ALIGNED_TILES_AUTO = Tuned(
    True,
    "H200 (twentieth session), head dims 128/128, forward and backward on aligned tiles, pre-pass and merges "
    "included, against the global grid, device clock: 0.90x on thd (11 documents in 16k), 0.91x on 4 documents per "
    "row, 0.91x on 27 documents of mixed lengths (log-normal, median 490); host clock 1.07-1.09x (0.71 / 0.74 of "
    "FA3 forward+backward); documents of 200-256 tokens each run 1.08-1.14x slower (TE_JAX_HOPPER_ALIGNED_TILES=0)",
    "benchmarks/results/attention_masks_h100.md")

#: The shortest key row (bshd/sbhd: kv_len; thd: all packed tokens) where auto takes document-aligned tiles.
HOPPER_ALIGNED_TILES_MIN_LEN = Tuned(
    4096,
    "H200 (twenty-first session), examples/train_lm.py --preset gpu --heads 6 --pack (rows of 1024 tokens, 1.6 "
    "documents per row, head dims 128/128): aligned tiles 512k tokens/s against the grid's 517k (1% slower) and its "
    "first step compiled in 19.2 s against 13.5 s; H100, the same at rows of 4096 (4 documents per row): 3.4% "
    "faster training steps (425k against 411k tokens/s); kernels alone on 4k and 16k rows 9-10% faster",
    "benchmarks/results/attention_masks_h100.md")

#: (head_dim, causal) -> longest q_len where the Hopper kernel beat cuDNN forward+backward on the H100
#: (0: never). auto takes the Hopper kernel up to it, cuDNN beyond.
_HOPPER_HD64 = Tuned(16384, "fwd+bwd 1.01-1.14x the best of cuDNN and tokamax on every row 1k-16k, kernel time and "
                            "host clock", ATTENTION_HOPPER_HD64_RESULTS)
_HOPPER_HD256 = Tuned(1024, "fwd+bwd against cuDNN: 1k 1.05-1.06x, 4k-16k 0.85-0.97x", ATTENTION_HOPPER_HD256_RESULTS)
HOPPER_FASTER_MAX_LEN = {
    (128, False): Tuned(4096, "fwd+bwd 1.01-1.04x the best of cuDNN and tokamax at 1k-4k; 16k a tie with cuDNN "
                              "(1.02 kernel time, 0.98 host clock), so cuDNN keeps it", ATTENTION_HOPPER_HD64_RESULTS),
    (128, True): Tuned(16640, "fwd+bwd 1.05-1.13x the best of cuDNN and tokamax at 1k-16k, kernel time and host "
                              "clock; at 16,534 (padded to 16,640) 1.09x cuDNN fwd+bwd (attention_masks_h100.md)",
                       ATTENTION_HOPPER_RESULTS),
    (64, False): _HOPPER_HD64,
    (64, True): _HOPPER_HD64,
    (256, False): _HOPPER_HD256,
    (256, True): _HOPPER_HD256,
}

# ----------------------------------------------------------------------------- norms and MLP (ops.py, mlp.py)

#: What the GPU benchmark measured as faster per norm; auto takes pallas on a GPU only where it says "pallas".
#: (H100, bf16, GPU kernel time, 11 shapes from 8192x768 to 32768x8192 and 16384x12288.)
NORM_GPU_PREFERENCE = {
    "layernorm": Tuned(
        "pallas", "pallas/xla fwd+bwd 1.32-1.99x at every shape measured; forward alone 1.01-1.11x, except "
                  "0.87x at 8192x768, where a forward-only call would be faster on xla", NORM_RESULTS),
    "rmsnorm": Tuned(
        "xla", "pallas/xla fwd+bwd 0.76-1.00x at every shape measured (forward alone 0.96-1.05x); a training "
               "step runs both, so xla", NORM_RESULTS),
}

#: A norm's backward that also adds a skip connection's gradient (the FP8 fused norm paths with the Flax layer's
#: residual, te_jax/fp8/norm_cast.backward): "pallas" runs the Pallas kernel's one pass where the norm's backend was
#: chosen automatically on a GPU; "xla" keeps the norm's own choice.
NORM_BWD_WITH_SKIP = Tuned(
    "pallas", "H100, 8192 x 4096 bf16 RMSNorm backward + residual gradient: the Pallas kernel's one pass 106.9 us "
              "(2.51 TB/s) against XLA's two passes 153.2 us, or the kernel then an XLA add 149.5 us (kernel time); "
              "in the FP8 layer step 10.29 -> 10.14 ms (delayed), 11.05 -> 10.95 (current), device clock",
    "benchmarks/results/fp8_layer_h100.md")

#: LayerNormMLP on a GPU: the pallas path (Pallas norm + first GEMM + XLA second GEMM, recompute backward).
MLP_GPU_PREFERENCE = Tuned(
    "pallas", "8192 tok, 4096/16384, bf16: 0.968x (gelu) / 0.997x (SwiGLU) plain-XLA fwd+bwd time, 0.12x / 0.18x "
              "saved residuals", NORM_MLP_RESULTS)

#: The pallas MLP path's first GEMM on a GPU ("xla": cuBLAS via XLA; "pallas": the fused LN-prologue GEMM).
MLP_FIRST_GEMM = Tuned("xla", "the fused LN-prologue Pallas GEMM was 1.24-1.39x slower than XLA's", NORM_MLP_RESULTS)


# ----------------------------------------------------------------------------- FP8 cast kernels (te_jax/fp8)

FP8_CAST_RESULTS = "benchmarks/results/fp8_cast_h100_sweep_log.txt"

#: Launch options (block_m, block_n, num_warps) of the Triton-lowered FP8 cast kernels
#: (pallas_kernels/fp8_cast), per kind; {} = the kernel's defaults (128 x 64).
FP8_CAST_LAUNCH = Tuned(
    {"act": dict(block_m=32, block_n=256, num_warps=8),          # act_cast
     "act_amax": dict(block_m=32, block_n=128, num_warps=4),     # act_amax (current scaling)
     "dact": dict(block_m=64, block_n=128, num_warps=8),         # dact_cast_transpose
     "dact_amax": dict(block_m=32, block_n=128, num_warps=8),    # dact_amax (current scaling)
     "cast": dict(block_m=32, block_n=128, num_warps=8),         # cast_transpose of x and dy
     "weight": dict(block_m=32, block_n=128, num_warps=4),       # cast_transposed of a weight
     "norm_stats": dict()},                                       # norm_stats_cast_transpose (te_jax/fp8/norm_cast)
    "H100 sweep at the Llama MLP shapes (M 8192, D 4096, F 14336): against the 128x64 default, act_cast "
    "0.324 -> 0.302 ms, dact_cast_transpose 0.580 -> 0.514, act_amax 0.207 -> 0.183, dact_amax 0.305 -> 0.266, "
    "the wi weight's cast_transposed 0.152 -> 0.145, cast_transpose 0.064 -> 0.062", FP8_CAST_RESULTS)
