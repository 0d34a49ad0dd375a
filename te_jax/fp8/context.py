"""`autocast` (TransformerEngine's name) and the per-GEMM FP8 decision, with its explanation.

    with te_jax.fp8.autocast(enabled=True, recipe=te_jax.fp8.DelayedScaling()):
        variables = model.init(...)          # creates the FP8 state collection (DelayedScaling)
        step = jax.jit(train_step); step(...)  # traced here: the GEMMs run in FP8

FP8 is off by default. autocast is read when a module is TRACED (init / apply under jit), like
TransformerEngine-JAX, and its setting is a jax.make_user_context, part of jit's cache key: the same jitted
function called inside and outside autocast (or under two recipes) is traced and compiled once per setting,
never a stale trace reused (a jax without make_user_context falls back to a contextvar: then a jitted
function keeps the setting of its first trace). Alternatively set the modules' own `enable_fp8` /
`fp8_recipe` fields (te_jax.flax modules
DenseGeneral, LayerNormDenseGeneral, LayerNormMLP): enable_fp8=None follows autocast, True forces FP8
(recipe: fp8_recipe, else autocast's, else DelayedScaling()), False keeps the module in the compute dtype;
fp8_recipe overrides autocast's recipe whenever FP8 is on.

te_jax.fp8.explain(fn, *args) traces fn abstractly (jax.eval_shape) and lists every te_jax GEMM:
where it is, whether it runs as an FP8 GEMM, and if not, why (see GemmInfo).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

from te_jax.fp8.recipe import DelayedScaling, Float8BlockScaling, check_recipe

# The autocast state is a jax.make_user_context: part of jit's tracing/compilation cache key, so a function
# jitted once and called inside and outside autocast (or under two recipes) is traced once per setting
# instead of silently reusing the first trace. Fallback (a jax without it): a contextvar (then wrap tracing).
_make_user_context = getattr(jax, "make_user_context", None)
_AUTOCAST_CTX = _make_user_context((False, None)) if _make_user_context is not None else None
_AUTOCAST = contextvars.ContextVar("te_jax_fp8_autocast", default=(False, None))
_RECORDER = contextvars.ContextVar("te_jax_fp8_recorder", default=None)


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe=None):
    """Run te_jax GEMMs in FP8 inside the block (traced there). recipe: default DelayedScaling().

    enabled=False inside an enabled block turns FP8 off for the inner block.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"autocast: enabled={enabled!r} must be a bool.")
    if recipe is None:
        recipe = DelayedScaling()
    check_recipe(recipe, "autocast: recipe")
    value = (enabled, recipe)
    token = _AUTOCAST.set(value)
    try:
        if _AUTOCAST_CTX is not None:
            with _AUTOCAST_CTX(value):
                yield recipe
        else:
            yield recipe
    finally:
        _AUTOCAST.reset(token)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = False, fp8_recipe=None, mesh_resource=None):
    """TransformerEngine-JAX's older spelling: fp8_autocast(enabled=False, fp8_recipe=None, mesh_resource=None).

    mesh_resource must be None: amax reductions need no mesh description here (under a mesh, XLA
    partitions the FP8 ops and every amax is a global max).
    """
    if mesh_resource is not None:
        raise ValueError("fp8_autocast: mesh_resource is not supported (amax is a global max under XLA's "
                         "partitioner); pass None.")
    with autocast(enabled=enabled, recipe=fp8_recipe) as r:
        yield r


def get_autocast():
    """(enabled, recipe) of the innermost autocast; (False, None) outside any."""
    if _AUTOCAST_CTX is not None:
        return _AUTOCAST_CTX.value
    return _AUTOCAST.get()


def is_fp8_enabled() -> bool:
    return get_autocast()[0]


def resolve(where: str, enable_fp8=None, fp8_recipe=None):
    """The recipe a module's GEMMs use (None: not FP8) and why, from the module fields and autocast."""
    if enable_fp8 is not None and not isinstance(enable_fp8, bool):
        raise ValueError(f"{where}: enable_fp8={enable_fp8!r} must be None, True or False.")
    if fp8_recipe is not None:
        check_recipe(fp8_recipe, f"{where}: fp8_recipe")
    on, ac_recipe = get_autocast()
    if enable_fp8 is False:
        return None, "the module's enable_fp8=False"
    if enable_fp8 is None and not on:
        return None, "FP8 is off (no te_jax.fp8.autocast(enabled=True) at trace time, enable_fp8=None)"
    recipe = fp8_recipe or ac_recipe or DelayedScaling()
    src = "module fp8_recipe" if fp8_recipe is not None else ("autocast" if ac_recipe is not None else "default")
    return recipe, f"{'enable_fp8=True' if enable_fp8 else 'autocast'}; recipe from {src}"


def gemm_support_reason(recipe, k: int, n: int) -> str | None:
    """Why XLA would NOT run a per-tensor FP8 GEMM of contraction size k and output width n (None: it would)."""
    if isinstance(recipe, Float8BlockScaling):
        from te_jax.fp8.block import BLOCK_GEMM_ENV, block_gemm_mode, block_gemm_reason

        mode = block_gemm_mode()
        if mode == "pallas" and recipe.x_block == recipe.w_block == 128:
            why = block_gemm_reason((128, k), (k, n), 1)  # the token count is not known here
            if why is not None:
                return (f"the FP8 block GEMM ({BLOCK_GEMM_ENV} resolved to pallas) cannot take it: {why}; the "
                        "reference implementation runs (block-scaling numerics, not an FP8 GEMM)")
            return None  # FP8 block GEMMs (te_jax/fp8/block.py), the token count permitting
        from te_jax.backends.pallas import hopper_device_reason

        where = hopper_device_reason() or f"{BLOCK_GEMM_ENV}={mode}"
        return (f"Float8BlockScaling on XLA ({where}) is a reference implementation (blockwise quantize -> "
                "dequantize -> GEMM in the compute dtype): block-scaling numerics, not an FP8 GEMM (the FP8 block "
                f"GEMM runs on sm90 GPUs with jax >= 0.11; {BLOCK_GEMM_ENV}=pallas forces it)")
    backend = jax.default_backend()
    if backend == "cpu":
        return "CPU: XLA runs the FP8 GEMM as an upcast GEMM (FP8 numerics, f8 converts in the HLO, no FP8 speed)"
    if backend == "gpu":
        from te_jax._compat import gpu_compute_capability

        cc = gpu_compute_capability()
        if cc is not None and cc < (8, 9):
            return f"GPU compute capability {cc[0]}.{cc[1]} < 8.9: no FP8 tensor cores (XLA upcasts)"
    if k % 16 or n % 16:
        return (f"contraction {k} / output width {n} not a multiple of 16: cuBLASLt's FP8 GEMM needs both, "
                "XLA then runs an upcast GEMM")
    return None


@dataclasses.dataclass
class GemmInfo:
    """One GEMM seen while tracing: where (module path + GEMM name), FP8 or not, and why."""

    module: str
    gemm: str
    fp8: bool  # quantized to FP8 under a recipe (the numerics); `fp8_gemm` says whether an FP8 GEMM runs
    fp8_gemm: bool
    recipe: str
    reason: str
    shape: str = ""

    def __str__(self):
        mark = "FP8 GEMM" if self.fp8_gemm else ("FP8 numerics, not an FP8 GEMM" if self.fp8 else "not FP8")
        return f"{self.module}/{self.gemm} {self.shape}: {mark} [{self.recipe}] — {self.reason}"


class Explanation(list):
    """A list of GemmInfo that prints one line per GEMM."""

    def __str__(self):
        return "\n".join(str(g) for g in self) if self else "no te_jax GEMM traced"


def record(module, gemm: str, recipe, reason: str, k: int = 0, n: int = 0, shape: str = ""):
    """Called by the modules at each GEMM (a no-op unless te_jax.fp8.explain is tracing)."""
    rec = _RECORDER.get()
    if rec is None:
        return
    path = "/".join(getattr(module, "path", ()) or ()) or type(module).__name__
    if recipe is None:
        rec.append(GemmInfo(path, gemm, False, False, "-", reason, shape))
        return
    why_not = gemm_support_reason(recipe, k, n)
    rec.append(GemmInfo(path, gemm, True, why_not is None, type(recipe).__name__,
                        reason if why_not is None else f"{reason}; {why_not}", shape))


def explain(fn, *args, **kwargs) -> Explanation:
    """Trace fn(*args, **kwargs) abstractly and list each te_jax GEMM's FP8 status (forward GEMMs; under
    FP8 each has its dgrad and wgrad in FP8 too, except for Float8BlockScaling's reference path).

    Example: te_jax.fp8.explain(lambda: model.init(key, x)) inside or outside an autocast block.
    """
    token = _RECORDER.set([])
    try:
        jax.eval_shape(lambda *a, **k: fn(*a, **k), *args, **kwargs)
        return Explanation(_RECORDER.get())
    finally:
        _RECORDER.reset(token)


__all__ = ["autocast", "fp8_autocast", "get_autocast", "is_fp8_enabled", "resolve", "explain", "GemmInfo",
           "Explanation", "record", "gemm_support_reason"]
