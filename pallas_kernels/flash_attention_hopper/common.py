"""Helpers the Hopper forward and backward kernels share: wgmma wrappers, shared-memory transforms,
int32 arithmetic on traced or Python ints, interpret-mode switches."""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import default_interpret, mosaic_gpu, pl
from .aligned_tiles import ROW_ALIGN


def num_sms() -> int:
    """The first device's SM count (132 on an H100 SXM; 132 where the device does not say, e.g. the CPU)."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


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


def backward_pT(plgpu, *, k_tile, q_tile, lse_ready, lse_tile, lse_release, c: float, pre):
    """The dK/dV kernels' step start: (pT, tT) with pT [bkv, bq] = exp2(S^T c - lse) for S^T = K Q^T of the K tile
    [bkv, D] and the Q tile [bq, D] (softcap, pre not None: tanh(S^T pre) in its place, tT = that tanh, kept for dS's
    1 - tT^2; else tT None); lse [bq] (base 2) read from lse_tile once lse_ready, its slot then handed back."""
    bkv, bq = k_tile.shape[0], q_tile.shape[0]
    sT = mma(plgpu, (bkv, bq), k_tile, q_tile.transpose((1, 0)))
    tT = None
    if pre is not None:
        tT = jnp.tanh(sT * pre)
        sT = tT
    plgpu.barrier_wait(lse_ready)
    lse = plgpu.load(lse_tile, layout=plgpu.Layout.WGMMA.reduce(0))
    lse_release()
    return jnp.exp2(sT * c - lax.broadcast_in_dim(lse, (bkv, bq), [1])), tT


def dv_and_dpT(plgpu, dv_acc, pT16, do_tile, v_tile):
    """The backward's dV += P^T dO and dP^T = V dO^T as one wgmma group (a single wait): (dv_acc [bkv, Dv], dpT
    [bkv, bq]) from pT16 [bkv, bq] in registers, the dO tile [bq, Dv] and the V tile [bkv, Dv] in shared memory.
    GPU only (the interpreter takes mma_into / mma one at a time)."""
    zT = plgpu.layout_cast(jnp.full(pT16.shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def _dv_dp(refs):
        dv_ref, dp_ref = refs
        plgpu.wgmma(dv_ref, pT16, do_tile)
        plgpu.wgmma(dp_ref, v_tile, do_tile.transpose((1, 0)))

    return pl.run_state(_dv_dp)((plgpu.ACC.init(dv_acc), plgpu.ACC.init(zT)))


def swizzle_for(minor: int, dtype, most: int = 128) -> int:
    """The widest shared-memory swizzle (128, 64 or 32 bytes, at most `most`) whose rows divide a tile row of `minor`
    elements: 128 for head dims 64/128/192/256, 64 for 96 or 160, 32 for 80 or 112 (wgmma takes each; both operands
    of one wgmma must share it, and do: they meet on the same head dim).  A wgmma's contraction must be a multiple of
    the swizzle's row (64 bf16 elements at 128 bytes): a kernel contracting over 32 rows passes most=64."""
    row = minor * jnp.dtype(dtype).itemsize
    for swizzle in (128, 64, 32):
        if swizzle <= most and row % swizzle == 0:
            return swizzle
    raise ValueError(f"a shared-memory tile row of {minor} x {jnp.dtype(dtype).name} ({row} bytes) is not a multiple "
                     f"of 32 bytes (head dims must be multiples of 16)")


def smem_transforms(plgpu, dtype, minor: int | None = None, most: int = 128):
    """Tiling + swizzle for a shared-memory tile whose rows hold `minor` elements (None: the widest swizzle up to
    `most` bytes; swizzle_for)."""
    swizzle = most if minor is None else swizzle_for(minor, dtype, most)
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


def named_barrier(plgpu, op: str, barrier_id, num_threads: int):
    """PTX `bar.<op> barrier_id, num_threads` (op "arrive" or "sync"): a hardware named barrier.  barrier_id may
    be traced.  GPU only (inline PTX; the interpreter has none).  Mosaic GPU itself uses ids 0 and 1 + warpgroup."""
    from jax.experimental.mosaic import gpu as mgpu

    if isinstance(barrier_id, int):
        @plgpu.inline_mgpu()
        def _op(_):
            mgpu.utils.inline_ptx(f"bar.{op} {barrier_id}, {num_threads};", has_side_effects=True)

        _op()
    else:
        @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
        def _op_traced(_, bid):
            mgpu.utils.inline_ptx(f"bar.{op} $0, {num_threads};", bid.registers[()], has_side_effects=True)

        _op_traced(jnp.asarray(barrier_id, jnp.int32))


class NamedSlots:
    """Ring slots handed back to the producer through hardware named barriers (ids first .. first + stages - 1)
    instead of "consumed" mbarriers: consumers `bar.arrive`, the producer `bar.sync` (a hardware wait, no polling).
    num_threads = the consumers' threads + the producer's.  The consumers `prime()` every slot once before their
    first release (the producer syncs before every load, the first `stages` included)."""

    primed = True  # the producer waits before every load; nothing to observe at the end

    def __init__(self, plgpu, first: int, stages: int, num_threads: int):
        if first + stages > 16:
            raise ValueError(f"named barriers {first}..{first + stages - 1}: sm90 has 16")
        self.plgpu, self.first, self.stages, self.num_threads = plgpu, first, stages, num_threads

    def release(self, slot):
        named_barrier(self.plgpu, "arrive", self.first + slot, self.num_threads)

    def wait(self, slot):
        named_barrier(self.plgpu, "sync", self.first + slot, self.num_threads)

    def prime(self):
        for s in range(self.stages):
            named_barrier(self.plgpu, "arrive", self.first + s, self.num_threads)


class MbarrierSlots:
    """Ring slots handed back through "consumed" mbarriers (one per slot; arrivals = consumer warpgroups)."""

    primed = False  # the first `stages` loads need no wait; the last phases are observed at the end

    def __init__(self, plgpu, bars):
        self.plgpu, self.bars = plgpu, bars

    def release(self, slot):
        self.plgpu.barrier_arrive(self.bars.at[slot])

    def wait(self, slot):
        self.plgpu.barrier_wait(self.bars.at[slot])

    def prime(self):
        pass


RING_BAR_ID = 6  # named-barrier ring slots start here (Mosaic GPU uses 0 and 1 + warpgroup; the forward's schedule 4)


def ring_slots(plgpu, consumed, stages: int, *, named: bool, producer_warp: bool, compute_wgs: int):
    """The slot hand-back of each ring (one "consumed" Barrier ref [stages] per ring): NamedSlots (ids from
    RING_BAR_ID, `stages` per ring) when `named` and the 16 hardware barriers suffice, else MbarrierSlots."""
    if not named or RING_BAR_ID + len(consumed) * stages > 16:
        return [MbarrierSlots(plgpu, bars) for bars in consumed]
    n = 128 * compute_wgs + (32 if producer_warp else 128)
    return [NamedSlots(plgpu, RING_BAR_ID + i * stages, stages, n) for i in range(len(consumed))]


def stream_ring(plgpu, total, stages: int, coords, streams):
    """A memory warpgroup's loop: for g = 0 .. total-1, TMA every stream's g-th tile into ring slot
    g % stages once the compute warpgroups have released that slot; then, for mbarrier slots, observe the
    last consumed phases, so that every barrier phase is waited on before the CTA exits (the interpreter
    checks).

    coords(g): whatever locates step g (computed once per step); streams: (view(coords) -> gmem ref
    view, smem ring [stages, ...], loaded barriers [stages], slot hand-back: NamedSlots or MbarrierSlots)
    each, issued in this order at every step.
    """
    def load(g, slot):
        c = coords(g)
        for view, ring, loaded, slots in streams:
            if slots.primed:
                slots.wait(slot)
            plgpu.copy_gmem_to_smem(view(c), ring.at[slot], loaded.at[slot])

    for i in range(stages):
        when(i < total, functools.partial(load, jnp.int32(i), i))

    def refill(step, _):
        slot = rem(step, stages)
        c = coords(step + stages)
        for view, ring, loaded, slots in streams:
            slots.wait(slot)
            plgpu.copy_gmem_to_smem(view(c), ring.at[slot], loaded.at[slot])

    lax.fori_loop(0, total - stages, refill, None)

    if not all(slots.primed for *_, slots in streams):
        def drain(step, _):
            for *_, slots in streams:
                if not slots.primed:
                    slots.wait(rem(step, stages))

        lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)


def run_producer(plgpu, fn, *, single_warp: bool):
    """The memory warpgroup runs fn on all four warps (TMA issued by one elected thread, waits by all), or, with
    single_warp, on warp 0 alone while warps 1-3 go idle: three fewer warps polling barriers beside the compute
    warps on their schedulers.  single_warp needs the kernel compiled without automatic warpgroup barriers."""
    if not single_warp:
        fn()
        return

    def per_warp(warp):
        pl.when(warp == 0)(fn)

    plgpu.warp_map(per_warp)


#: Mosaic GPU's intra-kernel profiler for the warp-specialized kernels: (profile_space, profile_dir) while
#: `profiling(...)` is active, else None.  The kernels mark their phases with jax.named_scope (region names such as
#: "q_wait", "k0_wait", "steps", "epilogue"); with the profiler on, each warpgroup records when it enters and leaves
#: them, and every call writes a Chrome-trace JSON file (pid: SM, tid: CTA x warpgroup, ts in us) to profile_dir.
_PROFILE: tuple[int, str] | None = None


@contextlib.contextmanager
def profiling(profile_dir: str, events: int = 256):
    """Kernels traced inside this context record their named regions (up to `events` per warpgroup per CTA) and
    write one trace per call to profile_dir (GPU only; for benchmarks.hopper_mask_probe --kernel-trace).  The
    kernels must be traced here: call them through a fresh jax.jit, with _lower_once.disabled()."""
    global _PROFILE
    before, _PROFILE = _PROFILE, (events, profile_dir)
    try:
        yield
    finally:
        _PROFILE = before


def warp_specialized_kernel(plgpu, body, *, out_type, scratch, grid, grid_names, compute_wgs: int,
                            interpret: bool, name: str, no_auto_barriers: bool = False):
    """plgpu.kernel(body) with `compute_wgs` compute warpgroups and one memory warpgroup (thread axis
    "wg", the memory warpgroup last), fast approximate exp2/log2.  `name` names the GPU kernel (Mosaic GPU
    takes it from the body's __name__), so profiles tell the forward and backward kernels apart.  no_auto_barriers:
    Mosaic GPU inserts no warpgroup barriers around loads and stores (needed by a single-warp producer; safe
    here: no thread reads and writes one shared-memory region, and nothing is read back after commit_smem)."""
    body.__name__ = name
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **(
            {"unsafe_no_auto_barriers": True} if no_auto_barriers else {}), **(
            {} if _PROFILE is None or interpret else {"profile_space": _PROFILE[0], "profile_dir": _PROFILE[1]})),
        interpret=interpret_arg(interpret),
    )


def store_planned(plgpu, src, o_ref, shared_ref, plan_ref, b, h, qt, wg, rows_ref, bq: int):
    """Document-aligned tiles (aligned_tiles): TMA this warpgroup's tile src [bq, Dv] of an output (O, dQ) by tile
    qt's store plan (aligned_tiles.store_plan, plan_ref[b, qt] in ROW_ALIGN-row groups of the tile's rows; the tile
    starts at row rows_ref[b, qt] * ROW_ALIGN, this warpgroup bq rows further per wg): its whole groups to their
    token rows of o_ref [B, S, H, Dv] (one copy where the warpgroup's rows are all whole), its shared groups to
    shared_ref [B, T, 2, ROW_ALIGN, H, Dv] (aligned_tiles.merge_shared_groups sums them in place)."""
    g, n = ROW_ALIGN, bq // ROW_ALIGN
    lo = plan_ref[b, qt, 0] - wg * n
    hi = plan_ref[b, qt, 1] - wg * n
    row = lambda i: rows_ref[b, qt] * g + wg * bq + i * g  # computed where used (the interpreter)
    whole = (lo <= 0) & (hi >= n)
    group = lambda i: src.at[pl.ds(i * g, g)]

    @pl.when(whole)
    def _():
        plgpu.copy_smem_to_gmem(src, o_ref.at[b, pl.ds(row(0), bq), h])

    @pl.when(jnp.logical_not(whole))
    def _():
        for i in range(n):
            pl.when((lo <= i) & (i < hi))(lambda i=i: plgpu.copy_smem_to_gmem(
                group(i), o_ref.at[b, pl.ds(row(i), g), h]))
        for slot in range(2):
            shared = plan_ref[b, qt, 2 + slot] - wg * n
            for i in range(n):
                pl.when(shared == i)(lambda i=i, slot=slot: plgpu.copy_smem_to_gmem(
                    group(i), shared_ref.at[b, qt, slot, :, h]))
