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


NUM_NAMED_BARRIERS = 16  # per CTA on sm90; Mosaic GPU itself uses 0 (CTA) and 1 + warpgroup


def named_barrier(plgpu, op: str, barrier_id, num_threads: int):
    """`bar.<op> barrier_id, num_threads` (op "sync" or "arrive"); barrier_id a Python int or a
    traced int32 scalar."""
    from jax.experimental.mosaic import gpu as mgpu

    if isinstance(barrier_id, int):
        @plgpu.inline_mgpu()
        def _op(_):
            mgpu.utils.inline_ptx(f"bar.{op} {barrier_id}, {num_threads};", has_side_effects=True,
                                  convergent=True)

        _op()
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def _op_dyn(_, bid):
        mgpu.utils.inline_ptx(f"bar.{op} $0, {num_threads};", bid.registers[()], has_side_effects=True,
                              convergent=True)

    _op_dyn(jnp.asarray(barrier_id, jnp.int32))


class SlotRelease:
    """A ring's "slot consumed" signal, from the compute warpgroups to the memory warpgroup.

    mbarrier (`first_id` None; always in the interpreter): arrive on / wait for consumed[slot]
    (every compute thread arrives, the memory warpgroup polls).  named: hardware barrier
    first_id + slot; the compute threads `bar.arrive`, the memory warpgroup `bar.sync`, with
    `threads` = all compute threads + the memory warpgroup's 128: no per-thread shared-memory
    atomics and no polling.
    """

    def __init__(self, plgpu, consumed, first_id=None, threads: int = 0):
        self.plgpu, self.consumed, self.first_id, self.threads = plgpu, consumed, first_id, threads

    def _id(self, slot):
        return self.first_id + slot if isinstance(slot, int) else slot + jnp.int32(self.first_id)

    def arrive(self, slot):
        if self.first_id is None:
            self.plgpu.barrier_arrive(self.consumed.at[slot])
        else:
            named_barrier(self.plgpu, "arrive", self._id(slot), self.threads)

    def wait(self, slot):
        if self.first_id is None:
            self.plgpu.barrier_wait(self.consumed.at[slot])
        else:
            named_barrier(self.plgpu, "sync", self._id(slot), self.threads)


def slot_releases(plgpu, consumed_barriers, *, stages: int, named: bool, first_id: int, compute_wgs: int):
    """One SlotRelease per ring; named barriers first_id, first_id + stages, ... when `named` and
    they fit in the CTA's 16, else the mbarriers."""
    if named and first_id + stages * len(consumed_barriers) <= NUM_NAMED_BARRIERS:
        threads = 128 * (compute_wgs + 1)
        return [SlotRelease(plgpu, bar, first_id + i * stages, threads)
                for i, bar in enumerate(consumed_barriers)]
    return [SlotRelease(plgpu, bar) for bar in consumed_barriers]


def stream_ring(plgpu, total, stages: int, coords, streams):
    """A memory warpgroup's loop: for g = 0 .. total-1, TMA every stream's g-th tile into ring slot
    g % stages once the compute warpgroups have released that slot; then observe the last consumed
    phases, so that every barrier phase is waited on before the CTA exits (the interpreter checks;
    a named barrier must not be left with arrivals pending).

    coords(g): whatever locates step g (computed once per step); streams: (view(coords) -> gmem ref
    view, smem ring [stages, ...], loaded barriers [stages], SlotRelease) each, issued in this order
    at every step.
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
        for view, ring, loaded, release in streams:
            release.wait(slot)
            plgpu.copy_gmem_to_smem(view(c), ring.at[slot], loaded.at[slot])

    lax.fori_loop(0, total - stages, refill, None)

    def drain(step, _):
        slot = rem(step, stages)
        for *_, release in streams:
            release.wait(slot)

    lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)


def warp_specialized_kernel(plgpu, body, *, out_type, scratch, grid, grid_names, compute_wgs: int,
                            interpret: bool, no_auto_barriers: bool = False):
    """plgpu.kernel(body) with `compute_wgs` compute warpgroups and one memory warpgroup (thread axis
    "wg", the memory warpgroup last), fast approximate exp2/log2.

    no_auto_barriers: Pallas inserts no warpgroup barrier around shared-memory stores and TMA
    issues.  Safe for these kernels: no thread reads (ld.shared) what a thread of its warpgroup
    writes (registers only go to shared memory for wgmma / TMA, after commit_smem), and every
    reuse of a TMA-stored buffer follows wait_smem_to_gmem, which ends in a warpgroup barrier."""
    params = dict(approx_math=True)
    if no_auto_barriers:
        params.update(unsafe_no_auto_barriers=True)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(**params),
        interpret=interpret_arg(interpret),
    )
