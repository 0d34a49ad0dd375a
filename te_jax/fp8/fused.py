"""When te_jax's FP8 paths use the fused Pallas cast kernels (pallas_kernels/fp8_cast).

One switch for every FP8 path, read at trace time: the environment variable TE_JAX_FP8_FUSED
  unset or "auto": fused on a GPU, unfused elsewhere (off a GPU the kernels would run in interpret mode, slower
                   than XLA's fusions);
  "0": never (A/B timing);  "1": always (on the CPU the kernels run in interpret mode: what the tests use).
Fused means: the dense GEMMs (DenseGeneral, LayerNormDenseGeneral) quantize each operand with cast_transpose,
which writes the FP8 array and its transpose in one pass (so every FP8 GEMM is "TN" and XLA transposes no FP8
array), and LayerNormMLP runs te_jax/fp8/mlp.py (activation + cast, dActivation + cast + transpose).
"""
from __future__ import annotations

import os

import jax

from te_jax._compat import gpu_compute_capability
from te_jax.backends import policy
from te_jax.backends.tuning import FP8_CAST_LAUNCH
from te_jax.fp8.recipe import DelayedScaling, Float8CurrentScaling

FUSED_ENV = "TE_JAX_FP8_FUSED"
FUSED_SETTINGS = ("auto", "0", "1")
#: Launch options of the cast kernels per kind (block_m, block_n, num_warps: pallas_kernels/fp8_cast), read at trace
#: time by te_jax/fp8/mlp.py and quantize.py: te_jax/backends/tuning.FP8_CAST_LAUNCH (benchmarks/fp8_cast_gpu.py
#: --sweep measured them); change an entry here to try others ({} = the kernel's defaults).
KERNEL_OPTIONS = {k: dict(v) for k, v in FP8_CAST_LAUNCH.value.items()}


LAUNCH_ENV = "TE_JAX_FP8_CAST_LAUNCH"
_LAUNCH_KEYS = ("block_m", "block_n", "num_warps", "num_stages")


def launch_env() -> str:
    """TE_JAX_FP8_CAST_LAUNCH as set now (the FP8 paths keep it in their static configuration, so that a trace under
    another value is not served from the cache of one under this)."""
    return os.environ.get(LAUNCH_ENV, "").strip()


def launch_overrides() -> dict:
    """TE_JAX_FP8_CAST_LAUNCH (read at trace time, for A/B runs of launch options): "kind:key=int+key=int kind2:..."
    (kinds apart by spaces, keys joined by "+": benchmarks' comma- and semicolon-separated --env-ab lists carry it)
    replaces KERNEL_OPTIONS[kind] (keys block_m, block_n, num_warps, num_stages; "kind:" gives the kernel's
    defaults). Unset: {}. A malformed value is a ValueError naming the variable and the expected form."""
    raw = launch_env()
    out = {}
    for part in raw.split():
        kind, sep, body = part.partition(":")
        try:
            if not sep or kind not in KERNEL_OPTIONS:
                raise ValueError(kind)
            opts = {}
            for item in filter(None, body.split("+")):
                key, _, val = item.partition("=")
                if key not in _LAUNCH_KEYS:
                    raise ValueError(key)
                opts[key] = int(val)
        except ValueError as e:
            raise ValueError(f"{LAUNCH_ENV}={raw!r}: cannot read {part!r} ({e}); expected "
                             f"\"kind:key=int+key=int kind2:...\" with kind one of {tuple(KERNEL_OPTIONS)} and keys "
                             f"from {_LAUNCH_KEYS}.") from None
        out[kind] = opts
    return out


def launch_options(kind: str, interpret) -> dict:
    """KERNEL_OPTIONS[kind] (or its TE_JAX_FP8_CAST_LAUNCH override) for a compiled (GPU) launch; {} (the kernels'
    defaults, fewer and larger programs) where the kernels run in interpret mode (interpret True, or None off a GPU),
    which the GPU tuning does not concern."""
    interpreted = jax.default_backend() != "gpu" if interpret is None else interpret
    if interpreted:
        return {}
    return dict(launch_overrides().get(kind, KERNEL_OPTIONS[kind]))


def fused_setting() -> str:
    return policy.env_choice(FUSED_ENV, FUSED_SETTINGS, "auto")


KEEP_WEIGHTS_ENV = "TE_JAX_FP8_KEEP_WEIGHTS"


def keep_weight_copies(recipe, *, dense: bool = False) -> bool:
    """Whether a fused FP8 path keeps its weights' FP8 copies from the forward for the backward's dgrad GEMMs instead
    of re-casting them there: the LayerNormMLP of mlp.py, or (dense=True) the dense GEMMs of quantize._tn_dense.
    TE_JAX_FP8_KEEP_WEIGHTS, read at trace time: "1" keeps (both paths), "0" re-casts, "auto", the default, keeps the
    MLP's under DelayedScaling only. Float8BlockScaling's paths (block_mlp.py, block.py) follow the same switch.
    Kept: the forward's cast writes both layouts from one read of each weight and the backward casts nothing; the
    cost is the copies (K x N bytes per weight) held from the forward to the GEMM's backward. Why auto is what it is
    (H100 layer, benchmarks/results/fp8_layer_h100.md): the MLP's copies die before the step's peak (its backward
    runs first), so under delayed scaling the step was faster at bf16's temporary memory; under current scaling as
    fast at 4 steps per dispatch, with 112 MiB more. The attention projections' copies live through the MLP's
    backward: 0.1 ms faster per step under delayed scaling, but 40 MiB of temporary memory above bf16's. Under
    block scaling neither paid (device time 12.71 ms re-cast, 12.76 with the MLP's kept, 12.74 with all kept), at
    115-156 MiB more."""
    setting = policy.env_choice(KEEP_WEIGHTS_ENV, ("auto", "0", "1"), "auto")
    if setting == "auto":
        return isinstance(recipe, DelayedScaling) and not dense
    return setting == "1"


NORM_STATS_ENV = "TE_JAX_FP8_NORM_STATS"


def norm_stats_in_kernel() -> bool:
    """Whether a norm in front of an FP8 GEMM computes its row statistics inside the cast kernel
    (pallas_kernels/fp8_cast/norm_stats.py: one read of the input from memory) rather than in an XLA reduction
    before it (TE_JAX_FP8_NORM_STATS, read at trace time: "kernel", the default, or "xla"). Delayed scaling only:
    current scaling needs the output's amax before the cast, so it computes the statistics first anyway.
    The default because the H100 layer step was faster with it (benchmarks/results/fp8_layer_h100_ab_log.txt:
    11.66 against 11.92 ms alone, 11.56 with merged_casts)."""
    return policy.env_choice(NORM_STATS_ENV, ("kernel", "xla"), "kernel") == "kernel"


MERGED_CASTS_ENV = "TE_JAX_FP8_MERGED_CASTS"


def merged_casts() -> bool:
    """Whether GEMMs that share an FP8 operand (GQA self-attention's query and key/value projections read one x_q;
    their weight gradients one x_qT) run as one GEMM over their other operands cast into one stacked buffer
    (pallas_kernels/fp8_cast/many.py), each slice of the output then scaled by its own scale
    (TE_JAX_FP8_MERGED_CASTS, read at trace time: "1", the default, or "0"). XLA's dot merger already joins those
    GEMMs on a GPU, but first concatenates the separately cast operands: 48 + 21 us per step on the H100 layer.
    The default because the H100 layer step was faster with it (benchmarks/results/fp8_layer_h100_ab_log.txt:
    11.76 against 11.92 ms alone, 11.56 with norm_stats_in_kernel)."""
    return policy.env_choice(MERGED_CASTS_ENV, ("1", "0"), "1") == "1"


STATE_KERNEL_ENV = "TE_JAX_FP8_STATE_KERNEL"


def state_update_kernel() -> bool:
    """Whether a fused FP8 path updates its delayed-scaling states (the amax histories and next scales of every
    tensor its GEMMs cast: up to four in a forward, two in a backward) in one kernel
    (pallas_kernels/fp8_cast/history.py) rather than as XLA ops, four or five small kernels per tensor
    (TE_JAX_FP8_STATE_KERNEL, read at trace time: "1", the default, or "0"). Same values either way."""
    return policy.env_choice(STATE_KERNEL_ENV, ("1", "0"), "1") == "1"


TMA_CASTS_ENV = "TE_JAX_FP8_TMA_CASTS"
TMA_CAST_KINDS = ("act", "dact", "weight", "cast")
#: The casts that run on the TMA kernels when TE_JAX_FP8_TMA_CASTS is unset: none. On the H100 the SwiGLU casts beat
#: their Triton twins alone, but inside the layer step they are slower by the device clock (forward 322 against 288
#: us, backward 503 against 496: benchmarks/results/fp8_layer_h100.md, seventeenth session).
DEFAULT_TMA_CASTS = ""
#: The TMA cast kernels' tile (64: 40 KiB of shared memory per CTA for the SwiGLU backward, so several CTAs share an
#: SM and overlap one another's loads and stores; a 128 tile would take 160 KiB, one CTA per SM).
TMA_BLOCK = 64


def tma_cast_kinds() -> tuple[str, ...]:
    """The kinds TE_JAX_FP8_TMA_CASTS lists (read at trace time): kinds of TMA_CAST_KINDS separated by "," or "+"
    ("+" fits benchmark switches that split on commas); "none" or "" for none; unset: DEFAULT_TMA_CASTS."""
    raw = os.environ.get(TMA_CASTS_ENV, DEFAULT_TMA_CASTS)
    kinds = tuple(k.strip() for k in raw.replace("+", ",").split(",") if k.strip() and k.strip() != "none")
    bad = [k for k in kinds if k not in TMA_CAST_KINDS]
    if bad:
        raise ValueError(f"{TMA_CASTS_ENV}={raw!r}: {bad} not among {TMA_CAST_KINDS} (a subset separated by ',' or "
                         f"'+'; 'none' for none; unset: {DEFAULT_TMA_CASTS!r}).")
    return kinds


def tma_cast(kind: str, interpret, *arrays) -> bool:
    """Whether the fused FP8 path runs the `kind` cast ("act": the activation's cast, "dact": the activation
    gradient's, "weight": a weight's cast + transpose, "cast": an activation's or gradient's cast + transpose) on
    its TMA kernel (pallas_kernels/fp8_cast/tma.py: TMA loads and stores, sm90 only) instead of the Triton-lowered
    one: where tma_cast_kinds() lists it, on an sm90 GPU (not in interpret mode), with both of each array's outer
    dims multiples of TMA_BLOCK and one dtype among the arrays. Otherwise the Triton kernel runs."""
    kinds = tma_cast_kinds()
    if kind not in kinds:
        return False
    interpreted = jax.default_backend() != "gpu" if interpret is None else interpret
    if interpreted or (gpu_compute_capability() or (9, 0)) != (9, 0):
        return False
    return (len({a.dtype for a in arrays}) == 1
            and all(d % TMA_BLOCK == 0 for a in arrays for d in (a.shape[0], a.shape[-1])))


def fused_cast_unavailable(recipe) -> str | None:
    """Why an FP8 GEMM would NOT quantize through the fused Pallas cast kernels (None: it does)."""
    setting = fused_setting()
    if setting == "0":
        return f"{FUSED_ENV}=0"
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return f"{type(recipe).__name__} is not a per-tensor recipe"
    axes = policy.partitioned_mesh_axes()
    if axes:
        return policy.pallas_replicated_reason(axes)
    backend = jax.default_backend()
    if setting == "auto" and backend != "gpu":
        return (f"backend {backend}: the Pallas cast kernels would run in interpret mode, slower than XLA's fusions "
                f"({FUSED_ENV}=1 forces them)")
    return None
