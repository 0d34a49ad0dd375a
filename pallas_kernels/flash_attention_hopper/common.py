"""Helpers the Hopper forward and backward kernels share: wgmma wrappers, shared-memory transforms,
int32 arithmetic on traced or Python ints, interpret-mode switches."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from te_jax._compat import default_interpret, mosaic_gpu, pl


def resolve_interpret(interpret):
    return default_interpret() if interpret is None else bool(interpret)


def interpret_arg(interpret: bool):
    if not interpret:
        return None
    plgpu = mosaic_gpu()
    return plgpu.InterpretGPUParams()


def mma_into(plgpu, acc, a, b, *, interpret: bool, after=None):
    """acc + a @ b on the tensor cores (wgmma).  `after` runs while the wgmma is in flight."""
    if interpret:
        # The CPU interpreter cannot seed an accumulator with a value, nor take the A operand
        # from registers: emulate with a plain dot (same bf16 operands, fp32 accumulation).
        if isinstance(a, jax.Array):
            out = acc + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
            if after is not None:
                after()
            return out

        def f(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            if after is not None:
                after()
            return acc_ref[...]

        return acc + pl.run_scoped(f, plgpu.ACC(acc.shape, jnp.float32))

    def g(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if after is not None:
            after()

    return pl.run_state(g)(plgpu.ACC.init(acc))


def mma(plgpu, shape, a, b, *, after=None):
    """a @ b into a fresh fp32 accumulator."""

    def f(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if after is not None:
            after()
        return acc_ref[...]

    return pl.run_scoped(f, plgpu.ACC(shape, jnp.float32))


def smem_transforms(plgpu, dtype):
    swizzle = 128
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def cdiv(a, b: int):
    if isinstance(a, int):
        return -(-a // b)
    return lax.div(a + (b - 1), jnp.int32(b))


def rem(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    return lax.rem(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def div(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def when(cond, fn):
    """pl.when that also accepts a Python bool."""
    if isinstance(cond, bool):
        if cond:
            fn()
        return
    pl.when(cond)(fn)


def stream_ring(plgpu, total, stages: int, coords, streams):
    """A memory warpgroup's loop: for g = 0 .. total-1, TMA every stream's g-th tile into ring slot
    g % stages once the compute warpgroups have released that slot; then observe the last consumed
    phases, so that every barrier phase is waited on before the CTA exits (the interpreter checks).

    coords(g): whatever locates step g (computed once per step); streams: (view(coords) -> gmem ref
    view, smem ring [stages, ...], loaded barriers [stages], consumed barriers [stages]) each, issued
    in this order at every step.
    """
    def load(g, slot):
        c = coords(g)
        for view, ring, loaded, _ in streams:
            plgpu.copy_gmem_to_smem(view(c), ring.at[slot], loaded.at[slot])

    for i in range(stages):
        when(i < total, functools.partial(load, jnp.int32(i), i))

    def refill(step, _):
        slot = rem(step, stages)
        c = coords(step + stages)
        for view, ring, loaded, consumed in streams:
            plgpu.barrier_wait(consumed.at[slot])
            plgpu.copy_gmem_to_smem(view(c), ring.at[slot], loaded.at[slot])

    lax.fori_loop(0, total - stages, refill, None)

    def drain(step, _):
        slot = rem(step, stages)
        for *_, consumed in streams:
            plgpu.barrier_wait(consumed.at[slot])

    lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)


def warp_specialized_kernel(plgpu, body, *, out_type, scratch, grid, grid_names, compute_wgs: int,
                            interpret: bool, name: str):
    """plgpu.kernel(body) with `compute_wgs` compute warpgroups and one memory warpgroup (thread axis
    "wg", the memory warpgroup last), fast approximate exp2/log2.  `name` names the GPU kernel (Mosaic GPU
    takes it from the body's __name__), so profiles tell the forward and backward kernels apart."""
    body.__name__ = name
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_arg(interpret),
    )
