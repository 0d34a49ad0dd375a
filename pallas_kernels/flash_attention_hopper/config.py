"""Block sizes and the choices they imply for the Hopper flash-attention kernels (no Mosaic GPU import)."""
from __future__ import annotations

import dataclasses
import heapq
import math
import typing

import jax.numpy as jnp
import numpy as np

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def logit_units(scale: float, softcap: float | None):
    """(c, pre): the kernels' logits are s * c (log2 units), or tanh(s * pre) * c with a softcap, for s = q.k.

    Without softcap: c = scale * log2(e), pre None.  With softcap t: logits t * tanh(scale * s / t), so
    pre = scale / t and c = t * log2(e); their gradient with respect to s is (1 - tanh^2) * scale (the backward
    multiplies dS by 1 - tanh^2 and the result by scale, as without softcap).
    """
    if softcap is None:
        return float(scale) * LOG2E, None
    return float(softcap) * LOG2E, float(scale) / float(softcap)
# The defaults below were chosen by device runs. The current measurement of the resulting kernels is
# benchmarks/results/attention_hopper_h100_run12f_rounds5_log.txt (hd128), attention_hopper_h100_run10.md (hd64)
# and attention_hopper_h100_run7_hd64_hd256.md (hd64 / hd256 blocks); the A/B runs behind each switch are under
# the git tag benchmarks-history-2026-11-24 (CONTRIBUTING.md, "Benchmarks").

# head_dim -> key length from which bwd_dq_atomic=None takes the in-kernel dQ (absent: the dQ kernel): shorter,
# its zero-fill and fp32 -> bf16 pass over dQ cost more than the two matmuls it saves.
ATOMIC_DQ_AUTO_MIN_KV = {128: 2048, 64: 2048}
# Key length from which fwd_split_tail=None cuts the persistent forward's last round by K/V steps: shorter, the
# merge after the kernel costs more than the idle SMs it saves.
FWD_SPLIT_TAIL_AUTO_MIN_KV = 4096
# The same for the non-causal dK/dV kernel's cut last tiles (bwd_split_tail, PieceSplit).
BWD_SPLIT_TAIL_AUTO_MIN_KV = 4096


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Block sizes.  Forward CTA = 2 * block_q query rows.  Backward CTA = bwd_wgs * block rows."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    bwd_block_q: int = 64
    bwd_block_kv: int = 64
    bwd_wgs: int = 2
    bwd_stages: int = 2
    # The mask is applied only on blocks that cross the diagonal when True; on every block
    # (simpler, slower) when False.  Kept for debugging.
    split_causal: bool = True
    # dQ accumulated inside the dK/dV kernel (FA3): the CTA's dS tile goes to shared memory and
    # each warpgroup adds its dQ columns to a float32 buffer with TMA reduce-add: 5 matmuls per
    # block pair instead of the dQ kernel's 7, plus a zero-fill and a conversion pass over dQ.
    # None (auto): on when served (see atomic_dq_served) and the key sequence is at least
    # ATOMIC_DQ_AUTO_MIN_KV (shorter, the two extra passes over the fp32 buffer cost more).
    bwd_dq_atomic: bool | None = None
    # Causal dK/dV kernel: walk each CTA's query blocks from the last one down to the diagonal
    # (True), so the CTAs resident together read the same Q/dO blocks at the same time, as the
    # non-causal walk does; or from the diagonal up (False: each CTA starts at its own diagonal, so
    # neighbours read different blocks).  None (auto) = True: the shared reads make the causal backward faster.
    bwd_causal_reverse: bool | None = None
    # Forward, non-causal: a persistent grid (one CTA per SM looping over query tiles; the K/V
    # ring runs on across tiles and the next tile's Q is loaded during this tile's epilogue).
    # None (auto): on for non-causal calls.  (Causal calls: fwd_persistent_causal.)
    fwd_persistent: bool | None = None
    fwd_ctas: int | None = None  # persistent CTAs; None: the device's SM count
    # Causal forward on the persistent grid (CausalDeal: rounds of heavy/light query-tile pairs, then the last tiles
    # one by one to the least-loaded CTA; see persistent_causal_served); False: one CTA per query tile, heaviest
    # first.  None (auto) or True: on where served (elsewhere describe_plan says why not); it gains most at short
    # sequences, where one CTA per tile leaves SMs idle.
    fwd_persistent_causal: bool | None = None
    # Its last tiles dealt one by one to the least-loaded CTA (longest first; CausalDeal) so the CTAs end together;
    # False: whole pairs round-robin to the end (the last round of pairs may leave SMs idle).  None (auto): on.
    fwd_causal_lpt: bool | None = None
    # Forward under a data mask on a persistent grid (forward_masked_persistent: one CTA per SM walking query tiles
    # dealt round by round in snake order; K/V, the next Q and the next block counts load during the current tile).
    # False: one CTA per query tile (forward_masked).  None (auto): sliding windows only (MASKED_PERSISTENT_AUTO).
    fwd_persistent_masked: bool | None = None
    # The persistent forward's last round shared out by K/V steps instead of whole tiles (stream-K, see
    # TailSplit): when the query tiles are no multiple of the CTAs, the last round leaves SMs idle (2048 tiles on
    # 132 SMs: 16 rounds for 15.5 rounds of work).  Tiles cut between two CTAs are merged by their lse after the
    # kernel.  None (auto): on where it applies (tail_split is not None) and the key length is at least
    # FWD_SPLIT_TAIL_AUTO_MIN_KV (the merge after the kernel costs about 10 us).
    fwd_split_tail: bool | None = None
    # The non-causal dK/dV kernel's last n_tiles % SMs key tiles cut into pieces of their query walk, one CTA each
    # (PieceSplit); their dK / dV summed after the kernel.  None (auto): from BWD_SPLIT_TAIL_AUTO_MIN_KV keys.
    bwd_split_tail: bool | None = None
    bwd_ctas: int | None = None  # the SM count PieceSplit plans for; None: the device's
    bwd_pieces: int | None = None  # pieces per cut key tile; None: PieceSplit's choice (1: the piece grid, no cuts)
    # The forward's ping-pong rendezvous on a hardware named barrier (`bar.sync`, inline PTX)
    # instead of an mbarrier arrive + wait.  None (auto): per kernel, rendezvous_named (the named barrier on the
    # GPU but for the persistent band forward over narrow bands and the grid data-mask forward); the interpreter
    # always uses the mbarrier.
    fwd_named_barrier: bool | None = None
    # The forward's K/V ring slots handed back to the producer through hardware named barriers (consumers
    # `bar.arrive`, the producer `bar.sync`) instead of "consumed" mbarriers that the producer polls.  GPU only.
    fwd_named_release: bool | None = None
    # The forward's producer is warp 0 of the memory warpgroup alone (warps 1-3 idle) instead of all four warps
    # polling the ring's barriers beside the compute warps on their schedulers.  GPU only.
    fwd_producer_warp: bool | None = None
    # The same two choices for the backward kernels (dK/dV with its Q, lse, dO and delta rings; dQ with K and V).
    bwd_named_release: bool | None = None
    bwd_producer_warp: bool | None = None
    # Registers per thread of the backward's compute warpgroups (setmaxnreg); the memory warpgroup gets what is
    # left of the CTA's 168 x 384.  None: 232 with two compute warpgroups (producer 40), 240 with one.  The hd64
    # and hd128 default configs: 240 (producer 24, as FA3).
    bwd_compute_registers: int | None = None
    # A CTA's last TMA stores (O and lse, dK / dV, dQ) are waited for until their shared memory is read
    # (`cp.async.bulk.wait_group.read`, what CUTLASS and FlashAttention-3 do before a CTA exits): the writes then
    # complete on their own, by the kernel's end, while the SM starts its next CTA.  False: until the writes are
    # done (what the kernels did before).  The kernels read nothing they store, so either is correct.  H100
    # (benchmarks/results/attention_masks_h100.md, 2026-11-28): documents 0.7-1.4% faster, dense rows within noise.
    exit_wait_read_only: bool = True
    # The data mask's block lists (every table's classification, groups and lists) from one Triton kernel per
    # table (list_kernel: a program per row) instead of XLA's dozen small kernels.  The same tables.  None (auto):
    # on the GPU (H200: packed documents' fwd+bwd tables 102 -> 83 us, thd 1.6-2.9% faster, 4 documents per row
    # within noise; benchmarks/results/attention_masks_h200.md); XLA's where Pallas interprets.
    lists_kernel: bool | None = None
    # Where the dQ kernel runs (not the atomic dQ), it computes delta = rowsum(O * dO) itself from its query tile's
    # O and dO, and writes it for the dK/dV kernel, which then runs after it: no separate XLA pass over O and dO.
    # A cotangent on lse is loaded and subtracted there too.  None (auto): on the GPU; False: XLA's reduction first.
    bwd_delta_in_dq: bool | None = None
    # A band's dK/dV kernel (backward_band_persistent) on a persistent grid: one CTA per SM walking key tiles, the
    # next tile's K/V loading while this one walks, one Q/dO ring across tiles, dK/dV stores not waited for.  For
    # narrow bands (windows), whose short walks leave the grid kernel's per-tile prologue and epilogue exposed.
    # Where the dQ kernel runs and D == Dv <= 128.  None (auto): off; on the H100 it was within noise of the grid
    # kernel on window (256, 256) and slower on wide bands (benchmarks/results/attention_masks_h100.md).
    bwd_persistent_band: bool | None = None
    # A band's forward (where every query sees a key, D == Dv) on a persistent grid (forward_band_persistent: the
    # persistent data-mask forward's schedule with the band's walk, no pre-pass, no marks) instead of the grid band
    # kernel.  None (auto): at head_dim 128 (other head dims are unmeasured) for causal sliding windows of at least
    # band.PERSISTENT_FWD_MIN_BAND keys per query and two-sided windows of at most band.PERSISTENT_FWD_MAX_TWO_SIDED
    # (1.03-1.11x the grid kernel on the H100); other bands stay on the grid.
    fwd_persistent_band: bool | None = None
    # The grid band forward launches its query tiles heaviest first where the band's walks grow toward the end of
    # the queries (band.heavier_tiles_last: bottom-right, windows (W, 0), causal given as data), as the causal kernel
    # does, so that short tiles fill the last wave.  None (auto): on; False: tiles in order.
    fwd_band_heavy_first: bool | None = None
    # The dK/dV kernel's query block (Q / dO rows per step); None: bwd_block_q (the dQ kernel's).  32 halves each
    # step's S and dP tiles, which lets the dK and dV accumulators of head dims above 128 (192/128) share one
    # warpgroup's registers (bwd_dkv_together).
    bwd_dkv_block_q: int | None = None
    # dK and dV accumulated in one dK/dV launch.  None (auto): where max(head_dim, head_dim_v) <= 128, and for
    # 192/128 and 160/160 (measured: DKV_TOGETHER_ABOVE_128; under a mask on 32-row blocks only, measured at
    # 192/128); elsewhere two launches (dK, then dV), each recomputing S.  True: one launch (both accumulators in
    # registers: ptxas spills some at 192/128, and it is still faster there).
    bwd_dkv_together: bool | None = None
    # Where the forward runs on document-aligned tiles (hopper_attention(mask_aligned=True)), the backward's kernels
    # on the same kind of tiles too (aligned_tiles.aligned_tables at their tile sizes): the dQ kernel's query tiles
    # and the dK/dV kernel's key tiles start at every document, dQ, dK and dV are stored in token order by plan
    # with the shared groups merged, and the delta the dQ kernel writes goes to its tiles' layout and is gathered
    # back.  None (auto): whenever the forward is aligned and the atomic dQ is not forced (on the H200, device
    # clock, the whole call 1.07-1.08x the aligned forward with the grid's backward on packed documents of 1-4k
    # tokens; aligned_backward_chosen); False: the grid's backward.
    bwd_aligned: bool | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv"):
            if getattr(self, name) % 64:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 64")
        if self.block_kv % self.block_q:
            raise ValueError("block_kv must be a multiple of block_q")
        if self.stages < 1:
            raise ValueError(f"stages={self.stages} must be >= 1")
        if self.bwd_stages < 2:
            # H100, 2026-11-26: hd256 with bwd_wgs=2 and bwd_stages=1 gave causal gradients 0.75-0.87 off (relative;
            # non-causal ones right): a one-slot Q/dO ring is refused until that is understood (it was slower too)
            raise ValueError(f"bwd_stages={self.bwd_stages}: the backward needs a Q/dO ring of >= 2 stages (one stage "
                             "gave wrong causal gradients on the H100); use bwd_stages=2")
        if self.bwd_wgs not in (1, 2):
            raise ValueError("bwd_wgs must be 1 or 2")
        for name in ("bwd_dq_atomic", "bwd_causal_reverse", "fwd_persistent", "fwd_persistent_causal", "fwd_causal_lpt",
                     "fwd_persistent_masked",
                     "fwd_split_tail", "bwd_split_tail", "fwd_named_barrier", "fwd_named_release",
                     "fwd_producer_warp", "bwd_named_release", "bwd_producer_warp", "bwd_delta_in_dq",
                     "bwd_persistent_band", "fwd_persistent_band", "fwd_band_heavy_first", "bwd_dkv_together",
                     "bwd_aligned", "lists_kernel"):
            if not isinstance(getattr(self, name), (bool, type(None))):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected None (auto), True or False")
        if not isinstance(self.exit_wait_read_only, bool):
            raise ValueError(f"exit_wait_read_only={self.exit_wait_read_only!r}: expected True (wait until the last "
                             "stores have read shared memory) or False (until they are written)")
        if self.bwd_compute_registers is not None:
            r = self.bwd_compute_registers
            if not isinstance(r, int) or r % 8 or not 24 <= r <= 256 or bwd_registers(self)[1] < 24:
                raise ValueError(f"bwd_compute_registers={r!r}: expected None or a multiple of 8 in [24, 256] that "
                                 f"leaves the memory warpgroup >= 24 ({REGISTERS_PER_CTA} per CTA; 240 is the most "
                                 f"with bwd_wgs=2)")
        if self.bwd_aligned and self.bwd_dq_atomic:
            raise ValueError("bwd_aligned=True with bwd_dq_atomic=True: the dK/dV kernel's atomic dQ is not served on "
                             "document-aligned key tiles. Fix: leave bwd_dq_atomic at None (auto) or False.")
        b = self.bwd_dkv_block_q
        if b is not None and (not isinstance(b, int) or b < 32 or (b != 32 and b % 64)):
            raise ValueError(f"bwd_dkv_block_q={b!r}: expected None (bwd_block_q), 32 or a multiple of 64")
        for name in ("fwd_ctas", "bwd_ctas", "bwd_pieces"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or n < 1):
                raise ValueError(f"{name}={n!r}: expected None (the SM count) or an int >= 1")


def default_config(head_dim: int, kv_len: int | None = None, causal: bool = False,
                   q_len: int | None = None, head_dim_v: int | None = None, masked: bool = False) -> HopperConfig:
    """The tuned config for a head_dim, the key / query lengths and the mask.

    masked: the call has a data mask or band (which carries causal; causal is then False).

    hd64 (benchmarks/results/attention_hopper_h100_run7_hd64_hd256.md):
    * forward: 256-key tiles, faster except causal below 4k keys, where half of each diagonal block is
      masked.  They need kv_len % 256 == 0.
    * backward: 128-row query blocks.  They need q_len % 256 == 0 (the dQ kernel's CTA takes 2 x 128 rows).
    """
    if head_dim_v is not None and head_dim_v != head_dim:
        if head_dim == 192 and head_dim_v == 128:
            # DeepSeek-V3's 192/128 (attention_head_dims_h100.md): 128-key forward blocks (the O tiles live inside
            # the Q tiles, so two stages fit: 208 KB), two backward warpgroups, dK and dV in one launch
            # (bwd_dkv_together auto): causal and masked with 32-row query blocks (1.07-1.09x two launches; under
            # documents or a window 1.04-1.07x), non-causal with 64-row blocks and 240 registers (1.05-1.12x)
            if causal or masked:
                return HopperConfig(block_q=64, block_kv=128, stages=2, bwd_wgs=2, bwd_dkv_block_q=32)
            return HopperConfig(block_q=64, block_kv=128, stages=2, bwd_wgs=2, bwd_compute_registers=240)
        head_dim = max(head_dim, head_dim_v)
    if head_dim <= 64:
        wide = kv_len is None or (kv_len % 256 == 0 and not (causal and kv_len < 4096))
        rows = 128 if (q_len if q_len is not None else kv_len or 0) % 256 == 0 else 64
        # 240 / 24 registers in the backward: faster causal, a tie without a mask.
        if wide:
            return HopperConfig(block_q=64, block_kv=256, stages=2, bwd_block_q=rows, bwd_compute_registers=240)
        return HopperConfig(block_q=64, block_kv=128, stages=3, bwd_block_q=rows, bwd_compute_registers=240)
    if head_dim <= 128:
        # 240 / 24 registers in the backward: faster causal, a tie without a mask.
        return HopperConfig(block_q=64, block_kv=128, stages=2, bwd_compute_registers=240)
    if head_dim <= 192:
        # 192 (q/k 192 with v 192, or another split): 64-key forward blocks; two backward warpgroups (their Q/dO and
        # K/V tiles fit shared memory, unlike hd256's).  160/160 (the accumulators of 192/128): dK and dV in one
        # launch on 32-row query blocks with 240 registers, 1.04x two launches causal and not (B4 x 4k;
        # attention_head_dims_h100.md, seventeenth session)
        if (head_dim, head_dim_v or head_dim) == (160, 160):
            return HopperConfig(block_q=64, block_kv=64, stages=2, bwd_wgs=2, bwd_dkv_block_q=32,
                                bwd_compute_registers=240)
        return HopperConfig(block_q=64, block_kv=64, stages=2, bwd_wgs=2)
    return HopperConfig(block_q=64, block_kv=64, stages=2, bwd_wgs=1)


class DkvGeometry(typing.NamedTuple):
    """The dK/dV kernels' shapes: q [B, S, H, D], k [B, Skv, G, D]; a CTA takes wgs x bkv keys and walks query
    blocks of bq rows."""
    B: int
    S: int
    H: int
    D: int
    Skv: int
    G: int
    rep: int  # query heads per K/V head
    dtype: object
    bq: int
    bkv: int
    wgs: int
    nq: int  # query blocks
    n_kt: int  # key tiles of wgs x bkv keys
    stages: int  # Q/dO ring depth


def dkv_block_q(cfg: HopperConfig) -> int:
    """The dK/dV kernel's query block: bwd_dkv_block_q, else bwd_block_q."""
    return cfg.bwd_dkv_block_q or cfg.bwd_block_q


#: Head dims (q/k, v) above 128 whose dK and dV run in one launch under auto: 192/128's 64 x 192 and 64 x 128 fp32
#: accumulators fill 160 of a warpgroup's 232-240 registers, as 160/160's do; ptxas spills 8-568 bytes at 192/128,
#: and the launch is still 1.04-1.12x two launches fwd+bwd on the H100 (160/160: 1.04x; attention_head_dims_h100.md,
#: sixteenth and seventeenth sessions).  Larger accumulators (176/176 up, 192/192, 256) keep two launches.
DKV_TOGETHER_ABOVE_128 = ((192, 128), (160, 160))


def dkv_together(cfg: HopperConfig, head_dim: int, head_dim_v: int, masked: bool = False) -> bool:
    """Whether one dK/dV launch accumulates both dK and dV (HopperConfig.bwd_dkv_together; auto: head dims up to
    128, and DKV_TOGETHER_ABOVE_128; under a data mask or band only on 32-row query blocks, as default_config(...,
    masked=True) gives them: with 64-row blocks the masked kernel was 0.95x two launches on documents), rather than
    two launches, dK then dV."""
    if cfg.bwd_dkv_together is not None:
        return cfg.bwd_dkv_together
    if max(head_dim, head_dim_v) <= 128:
        return True
    return (head_dim, head_dim_v) in DKV_TOGETHER_ABOVE_128 and (not masked or dkv_block_q(cfg) == 32)


def describe_dkv(cfg: HopperConfig, head_dim: int, head_dim_v: int, masked: bool = False) -> str:
    """How the backward's dK/dV kernel runs for head dims above 128, in words ("" at or below 128: one launch)."""
    if max(head_dim, head_dim_v) <= 128:
        return ""
    if dkv_together(cfg, head_dim, head_dim_v, masked):
        return f"dK and dV in one launch ({dkv_block_q(cfg)}-row query blocks)"
    return "dK and dV in two launches (their accumulators do not fit one warpgroup's registers together)"


def dkv_geometry(q, k, cfg: HopperConfig) -> DkvGeometry:
    B, S, H, D = q.shape
    Skv, G = k.shape[1], k.shape[2]
    bq, bkv, wgs = dkv_block_q(cfg), cfg.bwd_block_kv, cfg.bwd_wgs
    return DkvGeometry(B, S, H, D, Skv, G, H // G, q.dtype, bq, bkv, wgs, S // bq, Skv // (wgs * bkv), cfg.bwd_stages)


REGISTERS_PER_CTA = 168 * 384  # what ptxas allocates to a 3-warpgroup CTA (168 per thread)


def bwd_registers(cfg: HopperConfig) -> tuple[int, int]:
    """(compute, memory) warpgroup registers per thread for the backward kernels (multiples of 8; memory <= 40)."""
    regs = cfg.bwd_compute_registers or (232 if cfg.bwd_wgs == 2 else 240)
    left = (REGISTERS_PER_CTA - cfg.bwd_wgs * 128 * regs) // 128
    return regs, min(40, left - left % 8)


def ring_choices(cfg: HopperConfig, interpret: bool, *, backward: bool) -> tuple[bool, bool]:
    """(named_release, producer_warp) for the forward or backward kernels: GPU only (inline PTX, warp-level
    code: the interpreter keeps mbarriers and a four-warp producer); None (auto) = on."""
    if interpret:
        return False, False
    if backward:
        return cfg.bwd_named_release is not False, cfg.bwd_producer_warp is not False
    return cfg.fwd_named_release is not False, cfg.fwd_producer_warp is not False


RENDEZVOUS_KERNELS = ("grid", "persistent band", "data mask")


def rendezvous_named(cfg: HopperConfig, interpret: bool, kernel: str = "grid", band=None) -> bool:
    """Whether a forward kernel's two warpgroups take turns through the hardware named barrier rather than mbarriers:
    HopperConfig.fwd_named_barrier when set, else by kernel (one of RENDEZVOUS_KERNELS): "grid" (the dense, causal
    and grid band forwards, and the persistent data-mask forward) the named barrier; "persistent band" the named
    barrier over bands of band.NAMED_RENDEZVOUS_MIN_BAND keys or more (band.named_rendezvous), mbarriers below;
    "data mask" (the grid data-mask forward: documents, padding) mbarriers, 2-7% faster there on the H100
    (attention_masks_h100.md, fifteenth session).  The interpreter always takes mbarriers."""
    if kernel not in RENDEZVOUS_KERNELS:
        raise ValueError(f"rendezvous_named: kernel={kernel!r}; expected one of {RENDEZVOUS_KERNELS}")
    if interpret:
        return False
    if cfg.fwd_named_barrier is not None:
        return bool(cfg.fwd_named_barrier)
    if kernel == "persistent band":
        from .band import named_rendezvous

        return named_rendezvous(band)
    return kernel == "grid"


def check_lengths(cfg: HopperConfig, q_len: int, kv_len: int, *, forward: bool = True,
                  backward: bool = True) -> None:
    """ValueError naming the config field when a sequence length is no multiple of its block."""
    rules = []
    if forward:
        rules += [("q_len", q_len, 2 * cfg.block_q, "2 x block_q"), ("kv_len", kv_len, cfg.block_kv, "block_kv")]
    if backward:
        rules += [("q_len", q_len, cfg.bwd_wgs * cfg.bwd_block_q, "bwd_wgs x bwd_block_q"),
                  ("q_len", q_len, dkv_block_q(cfg), "the dK/dV kernel's query block (bwd_dkv_block_q)"),
                  ("kv_len", kv_len, cfg.bwd_wgs * cfg.bwd_block_kv, "bwd_wgs x bwd_block_kv")]
    for name, n, m, what in rules:
        if n % m:
            raise ValueError(
                f"HopperConfig: {name}={n} is not a multiple of {what} = {m} ({cfg}). Fix: pass config=None "
                f"(the default picks block sizes for the lengths) or blocks that divide {name}.")


SMEM_BYTES = 227 * 1024  # sm90 dynamic shared memory per CTA


def persistent_fits(cfg: HopperConfig, head_dim: int, dtype) -> bool:
    """The persistent forward's shared memory (2 Q/O buffers per warpgroup + the K/V ring)."""
    item = jnp.dtype(dtype).itemsize
    need = (4 * cfg.block_q + 2 * cfg.stages * cfg.block_kv) * head_dim * item + 4096
    return need <= SMEM_BYTES


def persistent_chosen(cfg: HopperConfig, kv_len: int, head_dim: int, dtype) -> bool:
    """Whether the non-causal forward runs on the persistent grid: allowed (fwd_persistent), its shared memory fits,
    and each query tile takes at least two K/V steps.  Tiles of one K/V step stay on the grid kernel: on the H100
    (2026-11-26) the persistent forward with one-step tiles and an uneven tile count per CTA (12 tiles on 5 CTAs,
    hd64, 256 keys) once gave zero output for whole tiles.  The diagnostic probe (hopper_persistent_probe: 2-7
    CTAs, with and without the tail split) did not reproduce it later that day, so a race that shows only
    sometimes is not ruled out and the guard stays (gpu_tests_h100.md)."""
    return (cfg.fwd_persistent is not False and persistent_fits(cfg, head_dim, dtype)
            and kv_len // cfg.block_kv >= 2)


# fwd_persistent_masked=None (auto) takes the persistent data-mask forward for sliding-window masks only
# (benchmarks/results/attention_masks_h100.md, 2026-11-26 A/B in one process, forward TFLOP/s persistent / grid:
# window (1024, 0) causal 395 / 362, window (256, 256) 323 / 285, bottom-right 535 / 520, thd documents 243 / 231,
# padding 374 / 374, bshd segments 196 / 232).  A window gives every query tile about the same walk, which the
# static deal balances; documents and padding give walks of very different lengths, which the grid kernel's
# hardware CTA scheduler balances better.
MASKED_PERSISTENT_AUTO = "window"
#: Head dims at which auto takes it: those its GPU test ran (test_persistent_masked_forward, hd64 and hd128).
MASKED_PERSISTENT_AUTO_HEAD_DIMS = (64, 128)


def persistent_masked_fits(cfg: HopperConfig, head_dim: int, dtype) -> bool:
    """The persistent data-mask forward's shared memory: persistent_fits plus the double-buffered query marks and
    the keys' marks ring (int32 (segment, position) rows)."""
    item = jnp.dtype(dtype).itemsize
    need = (4 * cfg.block_q + 2 * cfg.stages * cfg.block_kv) * head_dim * item + 4096
    marks = 4 * 2 * cfg.block_q * 4 + cfg.stages * 2 * cfg.block_kv * 4
    return need + marks <= SMEM_BYTES


def persistent_masked_chosen(cfg: HopperConfig, head_dim: int, head_dim_v: int, dtype,
                             window: tuple[int, int] = (-1, -1)) -> bool:
    """Whether a data-mask forward runs on the persistent grid: asked for (or auto: a sliding window at a head_dim
    in MASKED_PERSISTENT_AUTO_HEAD_DIMS, see MASKED_PERSISTENT_AUTO), equal q/k and v head_dims, and its shared
    memory fits."""
    if cfg.fwd_persistent_masked is None:
        wanted = (MASKED_PERSISTENT_AUTO == "window" and max(window) >= 0
                  and head_dim in MASKED_PERSISTENT_AUTO_HEAD_DIMS)
    else:
        wanted = cfg.fwd_persistent_masked
    return bool(wanted) and head_dim == head_dim_v and persistent_masked_fits(cfg, head_dim, dtype)


def persistent_causal_served(cfg: HopperConfig, q_len: int, head_dim: int, dtype) -> bool:
    """Whether the causal forward can run on the persistent grid: block_kv = 2 x block_q (a query tile's diagonal
    is its last K/V block, the same for both warpgroups), an even number of query tiles (heavy/light pairs), and
    the persistent grid's shared memory."""
    return (cfg.block_kv == 2 * cfg.block_q and (q_len // (2 * cfg.block_q)) % 2 == 0
            and persistent_fits(cfg, head_dim, dtype))


def persistent_causal_chosen(cfg: HopperConfig, q_len: int, head_dim: int, dtype) -> bool:
    """Whether this causal forward runs on the persistent grid (auto: wherever served)."""
    return cfg.fwd_persistent_causal is not False and persistent_causal_served(cfg, q_len, head_dim, dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class CausalDeal:
    """The persistent causal forward's work per CTA (all static).  block_kv = 2 x block_q, so query tile qt of a
    (batch, head) has qt + 1 K/V steps, the last one its diagonal block.

    Every CTA first runs `pair_rounds` heavy/light pairs (tiles n_qt - 1 - j and j of one (batch, head): n_qt + 1
    steps each), pairs c, c + n_ctas, ... in (batch, head, j) order, so CTAs running together share K/V.  The other
    pairs' tiles are then dealt one by one, longest first, each to the CTA with the least work so far (LPT), so that
    the CTAs end together instead of a last round of whole pairs leaving SMs idle.  Tiles are numbered
    (batch * H + head) * n_qt + qt; tail[c] lists CTA c's tail tiles in run order.
    """

    n_qt: int
    n_ctas: int
    pair_rounds: int
    tail: tuple[tuple[int, ...], ...]

    def pair_tiles(self, cta: int) -> list[int]:
        """CTA `cta`'s pair-round tiles, in run order."""
        return [t for r in range(self.pair_rounds) for t in pair_tiles(cta + r * self.n_ctas, self.n_qt)]

    def steps(self, cta: int) -> int:
        """K/V steps of CTA `cta` (pairs and tail)."""
        return sum(t % self.n_qt + 1 for t in self.pair_tiles(cta) + list(self.tail[cta]))

    @property
    def table_items(self) -> int:
        return max(1, max(len(t) for t in self.tail))

    @property
    def table_steps(self) -> int:
        return max(1, max(sum(t % self.n_qt + 1 for t in tail) for tail in self.tail))

    def table(self) -> np.ndarray:
        """int32 [n_ctas, 2 + 2 * table_items + table_steps]: per CTA its tail's tile count and step count, its tail
        tiles, the first ring step of each, and for every tail ring step its tile * n_qt + K/V block (the
        producer's lookup)."""
        items, steps = self.table_items, self.table_steps
        out = np.zeros((self.n_ctas, 2 + 2 * items + steps), np.int32)
        first = self.pair_rounds * (self.n_qt + 1)
        for c, tail in enumerate(self.tail):
            g, walk = first, []
            for k, t in enumerate(tail):
                out[c, 2 + k], out[c, 2 + items + k] = t, g
                walk += [t * self.n_qt + blk for blk in range(t % self.n_qt + 1)]
                g += t % self.n_qt + 1
            out[c, 0], out[c, 1] = len(tail), len(walk)
            out[c, 2 + 2 * items: 2 + 2 * items + len(walk)] = walk
        return out


def pair_tiles(p: int, n_qt: int) -> tuple[int, int]:
    """Pair p's two tiles, heavy first: tiles n_qt - 1 - j and j of (batch, head) p // (n_qt / 2),
    j = p % (n_qt / 2)."""
    bh, j = divmod(p, n_qt // 2)
    return bh * n_qt + n_qt - 1 - j, bh * n_qt + j


def causal_deal(n_bh: int, n_qt: int, n_ctas: int, lpt: bool = True) -> CausalDeal:
    """The CausalDeal of n_bh (batch, head)s of n_qt query tiles (n_qt even) on n_ctas <= n_bh * n_qt CTAs: whole
    pair rounds while at least two rounds' worth of pairs remain, the rest by LPT.  lpt=False: whole pairs
    round-robin to the end (the pairs of the last round are each dealt whole, heavy tile first)."""
    n_pairs = n_bh * n_qt // 2
    if not lpt:
        pair_rounds = n_pairs // n_ctas
        tail = [[] for _ in range(n_ctas)]
        for p in range(pair_rounds * n_ctas, n_pairs):
            tail[p % n_ctas] += pair_tiles(p, n_qt)
        return CausalDeal(n_qt, n_ctas, pair_rounds, tuple(tuple(t) for t in tail))
    pair_rounds = max(n_pairs // n_ctas - 1, 0)
    load = [pair_rounds * (n_qt + 1)] * n_ctas
    tail = [[] for _ in range(n_ctas)]
    rest = [t for p in range(pair_rounds * n_ctas, n_pairs) for t in pair_tiles(p, n_qt)]
    heap = [(load[c], c) for c in range(n_ctas)]
    heapq.heapify(heap)
    for t in sorted(rest, key=lambda t: (-(t % n_qt), t)):
        w, c = heapq.heappop(heap)
        tail[c].append(t)
        heapq.heappush(heap, (w + t % n_qt + 1, c))
    return CausalDeal(n_qt, n_ctas, pair_rounds, tuple(tuple(t) for t in tail))


@dataclasses.dataclass(frozen=True)
class TailSplit:
    """Work of n_tiles equal tiles of `steps` steps each on n_ctas CTAs with a stream-K tail (all static).

    Forward: a tile is a query tile, a step one K/V block.  Backward (dK/dV): a tile is a key tile, a step one
    query block of one query head of its group.  Tiles [0, first_tile) run whole (dp_rounds rounds).  The rest,
    `units` = (n_tiles - first_tile) * steps steps in tile-major order, is cut into n_ctas contiguous runs: tail
    CTA c takes units [start(c), start(c + 1)).  Every run is at least `steps` long, so a tile is cut at most once,
    between tail CTAs c - 1 (its last piece: slot 1) and c (its first piece: slot 0).
    """

    n_tiles: int
    steps: int
    n_ctas: int
    dp_rounds: int
    first_tile: int
    units: int

    def start(self, cta: int) -> int:
        """First tail unit of tail CTA `cta` (the in-kernel formula, on Python ints)."""
        return cta * self.units // self.n_ctas

    def cut_tiles(self) -> list[tuple[int, int]]:
        """(tile, cta) for every tile cut between tail CTAs cta - 1 (slot 1) and cta (slot 0)."""
        cuts = []
        for cta in range(1, self.n_ctas):
            b = self.start(cta)
            if b % self.steps:
                cuts.append((self.first_tile + b // self.steps, cta))
        return cuts

    def tail_pieces(self, cta: int) -> list[tuple[int, int, int]]:
        """(tile, first step, end step) of every piece tail CTA `cta` runs, in order."""
        s, e = self.start(cta), self.start(cta + 1)
        return [(self.first_tile + t, max(s - t * self.steps, 0), min(e - t * self.steps, self.steps))
                for t in range(s // self.steps, (e - 1) // self.steps + 1)]

    def pieces(self, cta: int) -> list[tuple[int, int, int]]:
        """The persistent forward's CTA `cta`: its whole tiles (cta, cta + n_ctas, ...), then its tail pieces."""
        return [(cta + i * self.n_ctas, 0, self.steps) for i in range(self.dp_rounds)] + self.tail_pieces(cta)


def tail_split(n_tiles: int, steps: int, n_ctas: int) -> TailSplit | None:
    """The stream-K plan for n_tiles tiles of `steps` steps on n_ctas CTAs (or SMs), or None where it changes
    nothing: the tiles are a multiple of the CTAs (no idle SMs), or fewer (one tile per CTA), or steps == 1."""
    if steps < 2 or n_tiles <= n_ctas or n_tiles % n_ctas == 0:
        return None
    dp_rounds = n_tiles // n_ctas - 1  # the tail keeps >= n_ctas tiles: runs of >= `steps` units
    first_tile = dp_rounds * n_ctas
    return TailSplit(n_tiles, steps, n_ctas, dp_rounds, first_tile, (n_tiles - first_tile) * steps)


def split_tail_chosen(cfg: HopperConfig, n_tiles: int, steps: int, n_ctas: int, kv_len: int) -> TailSplit | None:
    """The persistent forward's TailSplit for this call (forced by the config, or auto: from
    FWD_SPLIT_TAIL_AUTO_MIN_KV keys), or None."""
    if cfg.fwd_split_tail is False or (cfg.fwd_split_tail is None and kv_len < FWD_SPLIT_TAIL_AUTO_MIN_KV):
        return None
    return tail_split(n_tiles, steps, n_ctas)


@dataclasses.dataclass(frozen=True)
class PieceSplit:
    """The non-causal dK/dV kernel's grid with its last tiles cut into pieces (all static).

    One CTA per key tile for tiles [0, n_whole); each of the `rest` = n_tiles - n_whole last tiles is cut into
    `pieces` runs of its query steps, one CTA each, CTA n_whole + k * rest + i running piece k of tile n_whole + i
    (steps [k * steps // pieces, (k + 1) * steps // pieces)).  The pieces start at the same query step for every
    tile, so CTAs of one head running together walk the same query blocks (Q / dO reads and dQ reduce-adds shared
    in L2).  Cut tiles' dK / dV are the sums of their pieces' partials, added after the kernel.
    """

    n_tiles: int
    steps: int
    n_whole: int
    pieces: int

    @property
    def rest(self) -> int:
        return self.n_tiles - self.n_whole

    @property
    def n_ctas(self) -> int:
        return self.n_whole + self.rest * self.pieces

    def cta_work(self, cta: int) -> tuple[int, int, int]:
        """(tile, first step, end step) of CTA `cta` (the in-kernel formula, on Python ints)."""
        if cta < self.n_whole:
            return cta, 0, self.steps
        k, i = divmod(cta - self.n_whole, self.rest)
        return self.n_whole + i, k * self.steps // self.pieces, (k + 1) * self.steps // self.pieces


def piece_split(n_tiles: int, steps: int, n_sms: int, max_pieces: int = 4,
                pieces: int | None = None) -> PieceSplit | None:
    """Cut the last n_tiles % n_sms tiles (the ones that would run in a part-empty last round) into the number of
    pieces (2 .. max_pieces) that ends the grid soonest when all CTAs take equal time per step, or None where no cut
    helps (no part-empty round, fewer tiles than SMs, or one step per tile)."""
    rest = n_tiles % n_sms
    if rest == 0 or n_tiles < n_sms or steps < 2:
        return None
    if pieces is not None:  # forced (diagnostics)
        return PieceSplit(n_tiles, steps, n_tiles - rest, min(pieces, steps))
    rounds = lambda p: -(-rest * p // n_sms) / p  # the last rounds' length, in tiles
    best = min(range(2, min(max_pieces, steps) + 1), key=lambda p: (rounds(p), p))
    if rounds(best) >= 1:
        return None
    return PieceSplit(n_tiles, steps, n_tiles - rest, best)


def piece_split_chosen(cfg: HopperConfig, n_tiles: int, steps: int, n_sms: int, kv_len: int) -> PieceSplit | None:
    """The non-causal dK/dV kernel's PieceSplit for this call (forced by the config, or auto: from
    BWD_SPLIT_TAIL_AUTO_MIN_KV keys), or None."""
    if cfg.bwd_split_tail is False or (cfg.bwd_split_tail is None and kv_len < BWD_SPLIT_TAIL_AUTO_MIN_KV):
        return None
    return piece_split(n_tiles, steps, n_sms, pieces=cfg.bwd_pieces)


def dq_split(head_dim: int, cfg: HopperConfig) -> str | None:
    """How the CTA's warpgroups share the in-kernel dQ block (bwd_block_q x head_dim) of a step: "cols" (warpgroup
    w adds dQ columns [w*D/wgs, (w+1)*D/wgs) of every row), "rows" (rows [w*bq/wgs, ...) of every column), or None.
    Each share must be whole 64-wide tiles: a warpgroup's wgmma takes 64 rows, and a column slice of a swizzled
    shared-memory tile must be whole 128-byte swizzle rows.  hd128: cols; hd64 with 128-row query blocks: rows.
    The block is the dK/dV kernel's query block (dkv_block_q): 32-row blocks have no 64-row share."""
    bq = dkv_block_q(cfg)
    if head_dim % 64 or bq % 64:
        return None
    if (head_dim // cfg.bwd_wgs) % 64 == 0:
        return "cols"
    if (bq // cfg.bwd_wgs) % 64 == 0:
        return "rows"
    return None


def atomic_dq_served(head_dim: int, cfg: HopperConfig, interpret: bool) -> bool:
    """Whether flash_bwd can accumulate dQ inside the dK/dV kernel for this config.

    Needs: the GPU (the CPU interpreter has no TMA reduce-add), head_dim <= 128 (shared memory),
    and a dq_split (each warpgroup's share of dQ is whole 64-wide tiles).
    """
    return (cfg.bwd_dq_atomic is not False and not interpret and head_dim <= 128
            and dq_split(head_dim, cfg) is not None)


def dq_kernel_smem(cfg: HopperConfig, head_dim: int, head_dim_v: int, itemsize: int = 2, *,
                   with_o: bool, marks: bool = False) -> int:
    """Bytes of shared memory the dQ kernel takes: its warpgroups' Q and dO tiles, the K/V ring, lse / delta / dlse
    rows, with_o (delta computed in the kernel) the O tiles, and marks (a data mask's tables) the query and key
    marks."""
    wgs, bq, bkv, st = cfg.bwd_wgs, cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_stages
    tiles = wgs * bq * (head_dim + head_dim_v * (2 if with_o else 1)) + st * bkv * (head_dim + head_dim_v)
    rows = 3 * wgs * bq + (2 * wgs * bq + 2 * st * bkv if marks else 0)
    # + barriers and alignment: 192/192 measured 251024 bytes against 249344 for the tiles and rows; 176/176 under a
    # data mask 232640 (the lowering's count)
    return tiles * itemsize + 4 * rows + 4096


#: The widest head dim with delta in the dQ kernel (HopperConfig.bwd_delta_in_dq): 256's O tiles do not fit beside
#: its Q, dO and K/V ring (234,600 bytes of the 232,448), and larger splits are not GPU-tested with it; below, the
#: tiles must still fit (dq_kernel_smem).
DELTA_IN_DQ_MAX_HEAD_DIM_V = 192


def delta_in_dq(cfg: HopperConfig, interpret: bool, head_dim: int, head_dim_v: int, marks: bool = False) -> bool:
    """Whether a backward that runs the dQ kernel has it compute delta (HopperConfig.bwd_delta_in_dq): head dims up
    to DELTA_IN_DQ_MAX_HEAD_DIM_V whose O tiles fit its shared memory beside the rest (dq_kernel_smem, with a data
    mask's marks when `marks`: 192/128 fits, 192/192 does not, 176/176 only without marks), on the GPU unless the
    config says otherwise."""
    if (max(head_dim, head_dim_v) > DELTA_IN_DQ_MAX_HEAD_DIM_V
            or dq_kernel_smem(cfg, head_dim, head_dim_v, with_o=True, marks=marks) > SMEM_BYTES):
        return False
    return (not interpret) if cfg.bwd_delta_in_dq is None else cfg.bwd_delta_in_dq


def masked_atomic_dq_chosen(head_dim: int, head_dim_v: int, kv_len: int, cfg: HopperConfig, interpret: bool, *,
                            band=None) -> bool:
    """Whether flash_bwd under a data mask (band None) or a band accumulates dQ in the dK/dV kernel: where
    atomic_dq_chosen says so, and then under a data mask only when the config forces it (with the element mask the
    dK/dV kernel spills registers: the H100 measured the dQ kernel 5-11% faster, benchmarks/hopper_mask_probe.py),
    under a band for wide bands (band.band_is_wide) or when forced."""
    from .band import band_is_wide

    if head_dim_v != head_dim or not atomic_dq_chosen(head_dim, kv_len, cfg, interpret):
        return False
    return cfg.bwd_dq_atomic is True or (band is not None and band_is_wide(band))


def aligned_backward_chosen(cfg: HopperConfig) -> bool:
    """Whether a backward whose forward ran on document-aligned tiles runs on them too (HopperConfig.bwd_aligned):
    forced, or auto unless the atomic dQ is forced (the dK/dV kernel on aligned tiles has no atomic dQ)."""
    return cfg.bwd_aligned is True or (cfg.bwd_aligned is None and cfg.bwd_dq_atomic is not True)


def persistent_band_bwd_chosen(cfg: HopperConfig, head_dim: int, head_dim_v: int) -> bool:
    """Whether a band's dK/dV runs on the persistent kernel (HopperConfig.bwd_persistent_band, opt-in): where the
    dQ kernel runs and D == Dv <= 128 (dK and dV accumulated together)."""
    return bool(cfg.bwd_persistent_band) and head_dim == head_dim_v <= 128


def persistent_band_fwd_chosen(cfg: HopperConfig, head_dim: int, head_dim_v: int, dtype, band=None) -> bool:
    """Whether a band's forward runs on the persistent kernel (HopperConfig.fwd_persistent_band: forced, or auto for
    wide causal sliding windows and narrow two-sided ones at head_dim 128, the one measured,
    band.persistent_forward_band): D == Dv and two Q/O buffers per warpgroup fit beside the K/V ring
    (persistent_fits).  The caller also needs every query to see a key (band.every_query_sees_a_key)."""
    from .band import persistent_forward_band

    if cfg.fwd_persistent_band is False or head_dim != head_dim_v or not persistent_fits(cfg, head_dim, dtype):
        return False
    return bool(cfg.fwd_persistent_band) or (band is not None and head_dim == 128 and persistent_forward_band(band))


def atomic_dq_chosen(head_dim: int, kv_len: int, cfg: HopperConfig, interpret: bool) -> bool:
    """Whether flash_bwd accumulates dQ inside the dK/dV kernel for this call (forced by the config, or auto)."""
    if not atomic_dq_served(head_dim, cfg, interpret):
        return False
    min_kv = ATOMIC_DQ_AUTO_MIN_KV.get(head_dim)
    return bool(cfg.bwd_dq_atomic) or (min_kv is not None and kv_len >= min_kv)


def describe_plan(head_dim: int, kv_len: int, causal: bool, dtype, cfg: HopperConfig | None = None,
                  head_dim_v: int | None = None) -> str:
    """How the kernels run a call on the GPU, in words (for the backend explanation)."""
    cfg = cfg or default_config(head_dim, kv_len, causal, head_dim_v=head_dim_v)
    if head_dim_v is not None and head_dim_v != head_dim:
        where = "inside its Q tile" if head_dim_v < head_dim else "in its own tile"
        return (f"split head dims {head_dim}/{head_dim_v}: forward one CTA per query tile (block_kv {cfg.block_kv}; "
                f"each warpgroup's O tile {where}){'; causal' if causal else ''}; backward "
                + (describe_dkv(cfg, head_dim, head_dim_v) or "dK and dV in one launch")
                + f" and a separate dQ kernel ({cfg.bwd_wgs} warpgroups each)")
    if causal and persistent_causal_chosen(cfg, kv_len, head_dim, dtype):
        fwd = ("forward on a persistent grid (one CTA per SM; query tiles paired heavy with light"
               + ("; the last tiles dealt to the least-loaded CTA)" if cfg.fwd_causal_lpt is not False else ")"))
    elif causal:
        fwd = "forward one CTA per query tile, heaviest first"
        if cfg.fwd_persistent_causal is False:
            fwd += " (fwd_persistent_causal=False)"
        else:
            why = []
            if cfg.block_kv != 2 * cfg.block_q or (kv_len // (2 * cfg.block_q)) % 2:
                why.append(f"block_kv = 2 x block_q and an even number of query tiles: block_q {cfg.block_q}, "
                           f"block_kv {cfg.block_kv}, {kv_len // (2 * cfg.block_q)} tiles")
            if not persistent_fits(cfg, head_dim, dtype):
                why.append(f"shared memory for two Q/O buffers beside the K/V ring (head_dim {head_dim})")
            fwd += f" (the persistent causal grid needs {'; and '.join(why)})"
    elif persistent_chosen(cfg, kv_len, head_dim, dtype):
        fwd = "forward on a persistent grid (one CTA per SM"
        if cfg.fwd_split_tail is False:
            fwd += "; whole tiles only: fwd_split_tail=False)"
        elif cfg.fwd_split_tail or kv_len >= FWD_SPLIT_TAIL_AUTO_MIN_KV:
            fwd += "; a last round that leaves SMs idle is shared out by K/V steps)"
        else:
            fwd += f"; whole tiles: keys {kv_len} < {FWD_SPLIT_TAIL_AUTO_MIN_KV})"
    else:
        fwd = "forward one CTA per query tile" + (
            "" if cfg.fwd_persistent is False
            else f" (head_dim {head_dim}: no shared memory for the persistent grid)"
            if not persistent_fits(cfg, head_dim, dtype)
            else f" (keys {kv_len}: one K/V step per tile, which the persistent grid does not take)")
    if causal:
        fwd += ("; backward walks each key tile's query blocks from the diagonal up (bwd_causal_reverse=False)"
                if cfg.bwd_causal_reverse is False else
                "; backward walks each key tile's query blocks from the last one down to the diagonal")
    min_kv = ATOMIC_DQ_AUTO_MIN_KV.get(head_dim)
    if atomic_dq_chosen(head_dim, kv_len, cfg, interpret=False):
        bwd = "backward dQ accumulated in the dK/dV kernel (fp32 TMA reduce-add)"
    elif cfg.bwd_dq_atomic is False:
        bwd = "backward with a separate dQ kernel (bwd_dq_atomic=False)"
    elif not atomic_dq_served(head_dim, cfg, interpret=False):
        bwd = (f"backward with a separate dQ kernel (the in-kernel dQ needs head_dim <= 128 and whole 64-wide "
               f"shares per warpgroup; head_dim {head_dim}, dK/dV query block {dkv_block_q(cfg)}, bwd_wgs "
               f"{cfg.bwd_wgs})")
    elif min_kv is None:
        bwd = f"backward with a separate dQ kernel (the in-kernel dQ is not the default for head_dim {head_dim})"
    else:
        bwd = f"backward with a separate dQ kernel (keys {kv_len} < {min_kv}: faster there)"
    if not atomic_dq_chosen(head_dim, kv_len, cfg, interpret=False):
        if delta_in_dq(cfg, False, head_dim, head_dim_v or head_dim):
            bwd += "; the dQ kernel runs first and computes delta = rowsum(O * dO) for the dK/dV kernel"
        elif cfg.bwd_delta_in_dq is False:
            bwd += "; delta = rowsum(O * dO) from an XLA reduction (bwd_delta_in_dq=False)"
        else:
            bwd += (f"; delta = rowsum(O * dO) from an XLA reduction (head_dim {max(head_dim, head_dim_v or 0)}: no "
                    f"shared memory for O's tiles in the dQ kernel)")
    dkv = describe_dkv(cfg, head_dim, head_dim_v or head_dim)
    return f"{fwd}; {bwd}" + (f"; {dkv}" if dkv else "")
