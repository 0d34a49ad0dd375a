"""Hopper (Mosaic GPU) flash attention.

* Always (CPU CI, jax 0.10.2): the package imports and `supports` gives the exact reasons.
* jax >= 0.11 with Mosaic GPU's interpreter (`plgpu.InterpretGPUParams`): the kernels run on
  the CPU in the GPU interpreter (wgmma, TMA, barriers and warpgroups simulated) against the
  fp32 reference, forward and gradients.  Slow-ish (seconds per case): marked slow.
* On an sm90 GPU: the real kernels at small sizes.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.flash_attention_hopper as fah
from helpers import norm_rel_err as _rel
from pallas_kernels.flash_attention_hopper import attention_reference, hopper_attention, supports


def _has_interpreter():
    try:
        from pallas_kernels._compat import mosaic_gpu

        return hasattr(mosaic_gpu(), "InterpretGPUParams")
    except Exception:  # noqa: BLE001
        return False


def _on_sm90():
    from te_jax._compat import gpu_compute_capability

    cc = gpu_compute_capability()
    return cc is not None and cc[0] == 9


BF = jnp.bfloat16


# ---------------------------------------------------------------- supports (CPU, always)
@pytest.mark.parametrize(
    "q,k,v,dtype,causal,kw,reason",
    [
        ((2, 256, 8, 72), (2, 256, 8, 72), (2, 256, 8, 72), BF, False, {},
         "head_dim 72 is not a multiple of 16 from 16 to 256 (q (2, 256, 8, 72), expected [batch, seq, heads, 16..256 "
         "in steps of 16]; pad the head dim with zeros to the next multiple of 16 and pass scale explicitly)"),
        ((2, 256, 8, 96), (2, 256, 8, 96), (2, 256, 8, 96), BF, False, {}, None),
        ((2, 256, 8, 192), (2, 256, 8, 192), (2, 256, 8, 264), BF, False, {},
         "v head_dim 264 is not a multiple of 16 from 16 to 256 (v (2, 256, 8, 264), expected [batch, seq, heads, "
         "16..256 in steps of 16]; pad the head dim with zeros to the next multiple of 16 and pass scale "
         "explicitly)"),
        ((2, 256, 8, 192), (2, 256, 8, 192), (2, 256, 8, 128), BF, True, {}, None),  # DeepSeek-V3's 192/128
        ((2, 1000, 8, 128), (2, 1000, 8, 128), (2, 1000, 8, 128), BF, False, {}, None),  # ragged: padded
        ((2, 256, 8, 128), (2, 200, 8, 128), (2, 200, 8, 128), BF, False, {}, None),
        ((2, 0, 8, 128), (2, 200, 8, 128), (2, 200, 8, 128), BF, False, {}, "sequence length 0 is empty"),
        ((2, 256, 8, 128), (2, 256, 8, 128), (2, 256, 8, 128), jnp.float32, False, {},
         "dtype float32 not in {bfloat16, float16}"),
        ((2, 256, 8, 128), (2, 256, 3, 128), (2, 256, 3, 128), BF, False, {},
         "query heads 8 not a multiple of kv heads 3"),
        ((2, 256, 8, 128), (2, 256, 8, 64), (2, 256, 8, 64), BF, False, {},
         "head_dim of q (128) and k (64) differ"),
        ((2, 256, 8, 128), (2, 512, 8, 128), (2, 512, 8, 128), BF, True, {},
         "causal needs equal query and kv lengths (got 256 and 512)"),
        ((2, 256, 8, 128), (2, 256, 8, 128), (2, 256, 8, 128), BF, False, {"window": (64, 0)},
         "sliding windows are not supported by the Hopper kernel"),
        ((2, 256, 8, 128), (2, 256, 8, 128), (2, 256, 8, 128), BF, False, {"segment_ids": 1},
         "segment ids / padding masks are not supported by the Hopper kernel"),
        ((2, 256, 8, 128), (2, 256, 8, 128), (2, 256, 8, 128), BF, False, {"bias": 1},
         "attention bias is not supported by the Hopper kernel"),
        ((2, 256, 8, 128), (2, 256, 8, 128), (2, 256, 8, 128), BF, False, {"softcap": 0.0},
         "softcap=0.0 must be a finite positive number (or None)"),
    ],
)
def test_supports_reasons(q, k, v, dtype, causal, kw, reason):
    assert supports(q, k, v, dtype, causal, **kw) == reason


def test_supports_device_reason_on_cpu():
    # supports() checks shapes, dtype and features only; the device and jax version are the dispatcher's.
    from te_jax.backends.pallas import hopper_device_reason

    shape = (2, 256, 8, 128)
    assert supports(shape, shape, shape, BF, True) is None
    assert supports(shape, (2, 256, 2, 128), (2, 256, 2, 128), jnp.float16, False) is None
    if jax.default_backend() != "gpu":
        assert hopper_device_reason() == "not an sm90 GPU"


def test_public_names():
    for name in ("hopper_attention", "hopper_attention_fwd", "hopper_attention_bwd", "supports"):
        assert callable(getattr(fah, name))


def test_rejects_unsupported_call():
    x = jnp.zeros((1, 128, 2, 72), BF)
    with pytest.raises(ValueError, match="head_dim 72 is not a multiple of 16"):
        hopper_attention(x, x, x, scale=0.1)
    x = jnp.zeros((1, 100, 2, 64), BF)
    with pytest.raises(ValueError, match="causal needs equal query and kv lengths"):
        hopper_attention(x, x[:, :50], x[:, :50], scale=0.1, causal=True)


# ---------------------------------------------------------------- kernels
def _mode():
    if _on_sm90():
        return False  # real GPU
    if _has_interpreter():
        return True  # Mosaic GPU interpreter on the CPU
    return None


needs_kernel = pytest.mark.skipif(
    _mode() is None,
    reason="needs an sm90 GPU or jax>=0.11's Mosaic GPU interpreter (CI runs jax 0.10.2)")


def test_block_entry_points_name_ragged_lengths():
    """hopper_attention pads a ragged length; the block entry points (ring attention's) do not, and say so."""
    from pallas_kernels.flash_attention_hopper import hopper_attention_fwd, lengths_reason

    assert lengths_reason(256, 384) is None
    assert "kv sequence length 200 is not a multiple of the block size 128" in lengths_reason(256, 200)
    q = jnp.zeros((1, 200, 2, 64), BF)
    with pytest.raises(ValueError, match="sequence length 200 is not a multiple .* hopper_attention does"):
        hopper_attention_fwd(q, q, q, scale=0.125)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize(
    "S,H,G,D,causal,softcap",
    [(512, 2, 2, 64, False, None), (384, 2, 1, 64, True, None), (512, 2, 2, 128, True, None),
     (256, 2, 1, 256, True, None),
     # softcap: tanh in the score path (logits of 3-4 sigma: the cap bends them), every forward and backward kernel
     (512, 2, 2, 128, False, 2.0), (384, 2, 1, 64, True, 1.5), (256, 2, 1, 256, True, 2.0),
     # ragged lengths (padded to 128, padded keys masked: non-causal; hidden by the diagonal: causal); length 1
     (129, 2, 1, 128, False, None), (200, 2, 2, 64, True, None), (1, 2, 1, 128, False, None),
     (1000, 2, 1, 128, True, 2.0), (300, 2, 2, 256, False, None)],
)
def test_forward_and_grads(S, H, G, D, causal, softcap):
    _check_forward_and_grads(S, H, G, D, D, causal, softcap, BF, seed=S + D + causal)


def _check_forward_and_grads(S, H, G, D, Dv, causal, softcap, dtype, seed):
    """hopper_attention on fresh random q/k [1,S,*,D], v [1,S,G,Dv]: out, lse, dq, dk, dv against the fp32
    reference (a random cotangent on out and on lse)."""
    interpret = _mode()
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (1, S, H, D), dtype)
    k = jax.random.normal(ks[1], (1, S, G, D), dtype)
    v = jax.random.normal(ks[2], (1, S, G, Dv), dtype)
    do = jax.random.normal(ks[3], (1, S, H, Dv), dtype)
    dl = jax.random.normal(ks[4], (1, H, S), jnp.float32)
    scale = D ** -0.5
    f = lambda q, k, v: hopper_attention(q, k, v, scale=scale, causal=causal, interpret=interpret, softcap=softcap)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v: attention_reference(q, k, v, scale=scale, causal=causal, softcap=softcap)
    (rout, rlse), rvjp = jax.vjp(ref, f32(q), f32(k), f32(v))
    assert out.shape == (1, S, H, Dv)
    assert _rel(out, rout) < 1e-2
    assert _rel(lse, rlse) < 1e-4
    for g, rg in zip(vjp((do, dl)), rvjp((f32(do), dl))):
        assert g.shape == rg.shape
        assert _rel(g, rg) < 2e-2


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize(
    "S,H,G,D,Dv,causal,softcap,dtype",
    [(512, 4, 2, 192, 128, True, None, BF), (256, 2, 1, 192, 128, False, None, jnp.float16),
     (384, 2, 2, 192, 128, False, None, BF), (300, 2, 1, 192, 128, False, 2.0, BF),
     (256, 2, 1, 192, 192, True, None, BF), (256, 2, 2, 128, 64, True, None, BF), (256, 2, 1, 64, 128, False, None, BF),
     (200, 2, 1, 192, 128, True, None, BF),
     # head dims that are not multiples of 64: 64-byte (96, 160) and 32-byte (80, 112) swizzled tiles
     (256, 2, 1, 80, 80, True, None, BF), (384, 2, 2, 96, 96, False, None, BF), (300, 2, 1, 160, 160, True, 2.0, BF),
     (256, 2, 1, 112, 80, False, None, BF),
     # the rest of the multiples of 16 up to 256 (not yet GPU-run: auto keeps them off the Hopper kernel until they
     # pass here and join tuning.HOPPER_GPU_VERIFIED)
     (256, 2, 1, 144, 144, True, None, BF), (300, 2, 1, 176, 176, False, 2.0, BF),
     (256, 2, 2, 208, 208, True, None, BF), (256, 2, 1, 224, 224, False, None, BF),
     (384, 2, 1, 240, 240, True, None, BF), (256, 2, 1, 32, 32, True, None, BF),
     (256, 2, 1, 48, 48, False, None, jnp.float16), (256, 2, 1, 16, 16, True, None, BF)],
)
def test_split_head_dims_forward_and_grads(S, H, G, D, Dv, causal, softcap, dtype):
    """q/k head_dim D and v head_dim Dv (DeepSeek-V3's 192/128 and others), with GQA, ragged lengths, softcap and
    float16; and every other multiple of 16 up to 256."""
    _check_forward_and_grads(S, H, G, D, Dv, causal, softcap, dtype, seed=S + D + Dv)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("D,Dv,causal,softcap,with_dlse", [(128, 128, True, None, True), (128, 128, False, 2.0, False),
                                                           (64, 64, True, None, False), (192, 128, True, None, True)])
def test_delta_in_the_dq_kernel_equals_the_xla_delta(D, Dv, causal, softcap, with_dlse):
    """HopperConfig.bwd_delta_in_dq: the dQ kernel computes delta = rowsum(O * dO) - dlse from its own tiles and the
    dK/dV kernel reads it. The gradients equal those with XLA's delta (bwd_delta_in_dq=False) up to the fp32 sum's
    order, with and without a cotangent on lse, and match the fp32 reference."""
    S, H, G = 384, 4, 2
    ks = jax.random.split(jax.random.key(D + causal), 5)
    q = jax.random.normal(ks[0], (1, S, H, D), BF)
    k = jax.random.normal(ks[1], (1, S, G, D), BF)
    v = jax.random.normal(ks[2], (1, S, G, Dv), BF)
    do = jax.random.normal(ks[3], (1, S, H, Dv), BF)
    dl = jax.random.normal(ks[4], (1, H, S), jnp.float32) if with_dlse else None
    scale = D ** -0.5
    base = dataclasses.replace(fah.default_config(D, S, causal, S, head_dim_v=Dv), bwd_dq_atomic=False)
    kw = dict(scale=scale, causal=causal, softcap=softcap, interpret=_mode())
    out, lse = fah.hopper_attention_fwd(q, k, v, config=base, **kw)
    grads = {on: fah.hopper_attention_bwd(q, k, v, out, lse, do, dlse=dl, **kw,
                                          config=dataclasses.replace(base, bwd_delta_in_dq=on)) for on in (True, False)}
    for a, b in zip(grads[True], grads[False]):
        assert _rel(a, b) < 2e-3
    f32 = lambda x: x.astype(jnp.float32)
    _, rvjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, scale=scale, causal=causal, softcap=softcap),
                      f32(q), f32(k), f32(v))
    ref = rvjp((f32(do), jnp.zeros((1, H, S), jnp.float32) if dl is None else dl))
    for g, rg in zip(grads[True], ref):
        assert _rel(g, rg) < 2e-2


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("split,reverse", [(True, False), (False, True)])
def test_causal_backward_walk_directions(split, reverse):
    """The dK/dV kernel's two causal walks (the default, from the last query block down to the diagonal,
    is covered by test_forward_and_grads; here the other one, and reverse with every block masked), with
    GQA: two heads per K/V head, so the walk restarts per head.  Against the fp32 reference."""
    from pallas_kernels.flash_attention_hopper.config import default_config

    interpret = _mode()
    B, S, H, G, D = 1, 384, 2, 1, 64
    ks = jax.random.split(jax.random.key(7 + split + 2 * reverse), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, n, D), BF) for kk, n in zip(ks, (H, G, G, H)))
    cfg = dataclasses.replace(default_config(D, S, True, S), bwd_causal_reverse=reverse, split_causal=split)
    f = lambda q, k, v: hopper_attention(q, k, v, scale=D ** -0.5, causal=True, config=cfg,
                                         interpret=interpret)[0]
    out, vjp = jax.vjp(f, q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v: attention_reference(q, k, v, scale=D ** -0.5, causal=True)[0]
    rout, rvjp = jax.vjp(ref, f32(q), f32(k), f32(v))
    assert _rel(out, rout) < 1e-2
    for g, rg in zip(vjp(do), rvjp(f32(do))):
        assert _rel(g, rg) < 2e-2


@pytest.mark.skipif(not _has_interpreter(), reason="cross-lowering for CUDA on a CPU needs jax>=0.11 (CI runs 0.10.2)")
def test_gpu_kernels_carry_their_names():
    """Profiles tell the kernels apart: the CUDA lowering names each one (forward, dK/dV, dQ).  Causal with 2 query
    tiles: the persistent causal forward (heavy/light pairs); with 3 (no pairs): one CTA per tile."""
    import re

    def names(S):
        q = jax.ShapeDtypeStruct((1, S, 2, 64), BF)

        def fwd_bwd(q, k, v, do):
            f = lambda q, k, v: hopper_attention(q, k, v, scale=0.125, causal=True, interpret=False)[0]
            return jax.vjp(f, q, k, v)[1](do)

        text = jax.jit(fwd_bwd).trace(q, q, q, q).lower(lowering_platforms=("cuda",)).as_text()
        return set(re.findall(r"te_jax_attn_[a-z_]+?(?=_\d|_mosaic|\b)", text))

    paired, per_tile = names(256), names(384)
    assert {"te_jax_attn_fwd_persistent_causal", "te_jax_attn_bwd_dkdv", "te_jax_attn_bwd_dq"} <= paired, paired
    assert {"te_jax_attn_fwd_causal", "te_jax_attn_bwd_dkdv", "te_jax_attn_bwd_dq"} <= per_tile, per_tile


@pytest.mark.skipif(not _has_interpreter(), reason="cross-lowering for CUDA on a CPU needs jax>=0.11 (CI runs 0.10.2)")
@pytest.mark.parametrize("on", [True, False])
def test_ring_hand_back_lowers_for_cuda(on):
    """The GPU path hands ring slots back through named barriers (`bar.arrive`) fed by a single producer warp,
    forward and backward; switched off, no kernel arrives on a named barrier.  Lowered for CUDA (the CPU
    interpreter has no inline PTX; the GPU check is benchmarks/attention_hopper_gpu.py --only-correctness)."""
    q = jax.ShapeDtypeStruct((1, 2048, 2, 128), BF)
    cfg = dataclasses.replace(fah.default_config(128, 2048, True, 2048), fwd_named_release=on, fwd_producer_warp=on,
                              bwd_named_release=on, bwd_producer_warp=on)

    def fwd_bwd(q, k, v, do):
        f = lambda q, k, v: hopper_attention(q, k, v, scale=0.125, causal=True, config=cfg, interpret=False)[0]
        return jax.vjp(f, q, k, v)[1](do)

    text = jax.jit(fwd_bwd).trace(q, q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert ("bar.arrive" in text) == on


def test_ring_choices_and_named_barrier_budget():
    """Named-barrier hand-back and the single producer warp are GPU-only, on by default; a ring needing more
    than the 16 hardware barriers keeps its mbarriers."""
    from pallas_kernels.flash_attention_hopper.common import RING_BAR_ID, MbarrierSlots, NamedSlots, ring_slots
    from pallas_kernels.flash_attention_hopper.config import HopperConfig, ring_choices

    auto = HopperConfig()
    assert ring_choices(auto, interpret=False, backward=False) == (True, True)
    assert ring_choices(auto, interpret=False, backward=True) == (True, True)
    assert ring_choices(auto, interpret=True, backward=True) == (False, False)
    off = HopperConfig(fwd_named_release=False, bwd_producer_warp=False)
    assert ring_choices(off, interpret=False, backward=False) == (False, True)
    assert ring_choices(off, interpret=False, backward=True) == (True, False)
    four_rings = [object()] * 4
    assert all(isinstance(r, NamedSlots) for r in ring_slots(None, four_rings, 2, named=True, producer_warp=True,
                                                             compute_wgs=2))
    assert RING_BAR_ID + 4 * 3 > 16  # four rings of 3 stages do not fit: mbarriers
    assert all(isinstance(r, MbarrierSlots) for r in ring_slots(None, four_rings, 3, named=True, producer_warp=True,
                                                                compute_wgs=2))
    threads = ring_slots(None, four_rings[:2], 2, named=True, producer_warp=False, compute_wgs=2)[0].num_threads
    assert threads == 2 * 128 + 128  # two compute warpgroups + the four-warp producer
    assert ring_slots(None, four_rings[:2], 2, named=True, producer_warp=True, compute_wgs=1)[1].first == RING_BAR_ID + 2


def test_atomic_dq_policy():
    """Where the backward accumulates dQ inside the dK/dV kernel (GPU-only: TMA reduce-add)."""
    from pallas_kernels.flash_attention_hopper.config import (
        ATOMIC_DQ_AUTO_MIN_KV, HopperConfig, atomic_dq_chosen, atomic_dq_served, default_config, dq_split)

    auto = default_config(128)
    assert auto.bwd_dq_atomic is None  # auto: by key length
    assert atomic_dq_served(128, auto, interpret=False)
    assert not atomic_dq_served(128, auto, interpret=True)  # the interpreter has no TMA reduce
    assert not atomic_dq_served(64, auto, interpret=False)  # 32 dQ columns or rows per warpgroup
    assert dq_split(128, auto) == "cols" and dq_split(64, auto) is None
    hd64 = default_config(64, 4096, True, 4096)  # 128-row query blocks: each warpgroup adds 64 whole rows
    assert dq_split(64, hd64) == "rows" and atomic_dq_served(64, hd64, interpret=False)
    assert dq_split(64, default_config(64, 384, True, 384)) is None  # 64-row query blocks (384 % 256 != 0)
    assert not atomic_dq_served(256, default_config(256), interpret=False)  # shared memory
    assert not atomic_dq_served(128, HopperConfig(bwd_dq_atomic=False), interpret=False)
    assert atomic_dq_served(128, HopperConfig(bwd_dq_atomic=True), interpret=False)
    assert ATOMIC_DQ_AUTO_MIN_KV == {128: 2048, 64: 2048}
    assert atomic_dq_chosen(64, 2048, hd64, interpret=False) and not atomic_dq_chosen(64, 1024, hd64, interpret=False)
    assert atomic_dq_chosen(64, 1024, dataclasses.replace(hd64, bwd_dq_atomic=True), interpret=False)
    assert not atomic_dq_chosen(64, 4096, hd64, interpret=True)
    # 32-row dK/dV query blocks: no 64-row dQ share, so the dQ kernel runs (even where the atomic dQ is asked)
    q32 = dataclasses.replace(auto, bwd_dkv_block_q=32)
    assert dq_split(128, q32) is None and not atomic_dq_chosen(128, 4096, q32, interpret=False)
    assert not atomic_dq_chosen(128, 4096, dataclasses.replace(q32, bwd_dq_atomic=True), interpret=False)


def test_masked_backward_and_persistent_band_choices():
    """The choices flash_bwd / flash_fwd make under a data mask or a band, which the backend explanation reads too:
    the atomic dQ under a data mask only when forced, under a band for wide bands (band_is_wide) or when forced,
    never with split head dims; the persistent band kernels only where asked and their head dims fit; delta in the
    dQ kernel on the GPU up to head_dim 192."""
    from pallas_kernels.flash_attention_hopper.band import ATOMIC_DQ_MIN_BAND
    from pallas_kernels.flash_attention_hopper.config import (
        SMEM_BYTES, HopperConfig, default_config, delta_in_dq, dq_kernel_smem, masked_atomic_dq_chosen,
        persistent_band_bwd_chosen, persistent_band_fwd_chosen)

    cfg = default_config(128, 4096, False, 4096)  # auto takes the atomic dQ from 2048 keys on plain calls
    narrow, wide, open_ = (0, -255, 0), (0, -ATOMIC_DQ_MIN_BAND + 1, 0), (0, None, 0)
    assert not masked_atomic_dq_chosen(128, 128, 4096, cfg, False)  # a data mask: the dQ kernel
    assert masked_atomic_dq_chosen(128, 128, 4096, dataclasses.replace(cfg, bwd_dq_atomic=True), False)
    assert not masked_atomic_dq_chosen(128, 128, 4096, cfg, False, band=narrow)
    assert masked_atomic_dq_chosen(128, 128, 4096, cfg, False, band=wide)
    assert masked_atomic_dq_chosen(128, 128, 4096, cfg, False, band=open_)
    assert not masked_atomic_dq_chosen(128, 128, 1024, cfg, False, band=open_)  # short keys: auto says no
    assert not masked_atomic_dq_chosen(128, 64, 4096, dataclasses.replace(cfg, bwd_dq_atomic=True), False)
    assert not masked_atomic_dq_chosen(128, 128, 4096, cfg, True, band=open_)  # the interpreter: no TMA reduce
    assert not persistent_band_bwd_chosen(cfg, 128, 128)  # opt-in
    on = dataclasses.replace(cfg, bwd_persistent_band=True, fwd_persistent_band=True)
    assert persistent_band_bwd_chosen(on, 128, 128) and persistent_band_bwd_chosen(on, 64, 64)
    assert not persistent_band_bwd_chosen(on, 192, 128) and not persistent_band_bwd_chosen(on, 256, 256)
    assert not persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16)  # no band given
    assert persistent_band_fwd_chosen(on, 128, 128, jnp.bfloat16)
    assert not persistent_band_fwd_chosen(on, 192, 128, jnp.bfloat16)
    # auto: causal sliding windows of PERSISTENT_FWD_MIN_BAND keys or more and two-sided windows of at most
    # PERSISTENT_FWD_MAX_TWO_SIDED, head_dim 128; the grid kernel for wide two-sided windows, unbounded bands (causal
    # as data, bottom-right) and narrow causal windows
    from pallas_kernels.flash_attention_hopper.band import (NAMED_RENDEZVOUS_MIN_BAND, PERSISTENT_FWD_MAX_TWO_SIDED,
                                                            PERSISTENT_FWD_MIN_BAND, named_rendezvous)
    w_causal, w256 = (0, -PERSISTENT_FWD_MIN_BAND + 1, 0), (0, -256, 256)
    assert persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16, w_causal)
    assert persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16, (0, -2047, -5))
    assert not persistent_band_fwd_chosen(cfg, 64, 64, jnp.bfloat16, w_causal)  # measured at head_dim 128 only
    assert not persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16, (0, -PERSISTENT_FWD_MIN_BAND + 2, 0))
    assert not persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16, (0, -1024, 1024))  # wide two-sided
    assert not persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16, open_)  # unbounded
    assert PERSISTENT_FWD_MAX_TWO_SIDED == 513  # window (256, 256), the row
    assert persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16, w256)
    assert persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16, (0, -64, 64))
    assert not persistent_band_fwd_chosen(cfg, 128, 128, jnp.bfloat16, (0, -256, 257))
    # the warpgroups' rendezvous: the named barrier over wide or unbounded bands, mbarriers over narrow ones
    assert named_rendezvous((0, -NAMED_RENDEZVOUS_MIN_BAND + 1, 0)) and named_rendezvous(open_)
    assert not named_rendezvous(w256) and not named_rendezvous((0, -NAMED_RENDEZVOUS_MIN_BAND + 2, 0))
    # ... as each forward kernel takes it: the config's choice first, the interpreter always on mbarriers
    from pallas_kernels.flash_attention_hopper.config import rendezvous_named

    named_cfg, mbar_cfg = (dataclasses.replace(cfg, fwd_named_barrier=v) for v in (True, False))
    assert rendezvous_named(cfg, False) and not rendezvous_named(cfg, False, "data mask")
    assert rendezvous_named(cfg, False, "persistent band", open_)
    assert not rendezvous_named(cfg, False, "persistent band", w256)
    assert rendezvous_named(named_cfg, False, "data mask")
    assert rendezvous_named(named_cfg, False, "persistent band", w256)
    assert not rendezvous_named(mbar_cfg, False) and not rendezvous_named(named_cfg, True)
    with pytest.raises(ValueError, match=r"kernel='band'; expected one of \('grid', 'persistent band', 'data mask'\)"):
        rendezvous_named(cfg, False, "band")
    assert not persistent_band_fwd_chosen(cfg, 256, 256, jnp.bfloat16, (0, -2047, 0))
    assert not persistent_band_fwd_chosen(dataclasses.replace(cfg, fwd_persistent_band=False), 128, 128,
                                          jnp.bfloat16, open_)
    assert persistent_band_fwd_chosen(on, 128, 128, jnp.bfloat16, w256)  # forced
    assert delta_in_dq(HopperConfig(), False, 128, 128) and delta_in_dq(HopperConfig(), False, 192, 128)
    assert not delta_in_dq(HopperConfig(), True, 128, 128)  # auto: the GPU only
    assert not delta_in_dq(HopperConfig(), False, 256, 256)  # O's tiles do not fit
    # nor at 192/192 beside Q, dO and the K/V ring (251 KB asked on the H100: sixteenth session's GPU tests)
    assert not delta_in_dq(default_config(192, 4096, True), False, 192, 192)
    assert dq_kernel_smem(default_config(192, 4096, True), 192, 192, with_o=False) <= SMEM_BYTES
    # 176/176 fits without a data mask's marks and not with them (232640 bytes in the lowering's count)
    assert delta_in_dq(default_config(176), False, 176, 176) and not delta_in_dq(default_config(176), False, 176, 176,
                                                                                  marks=True)
    assert not delta_in_dq(HopperConfig(bwd_delta_in_dq=False), False, 128, 128)


def _random_qkv_do(seed, B, S, H, G, D):
    """Fresh bf16 q [B,S,H,D], k / v [B,S,G,D] and an output cotangent do [B,S,H,D]."""
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (B, S, H, D), BF), jax.random.normal(ks[1], (B, S, G, D), BF),
            jax.random.normal(ks[2], (B, S, G, D), BF), jax.random.normal(ks[3], (B, S, H, D), BF))


def _fp32_reference_vjp(q, k, v, causal=False):
    """((out, lse), vjp) of the fp32 reference on the same inputs."""
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v: attention_reference(q, k, v, scale=q.shape[-1] ** -0.5, causal=causal)
    return jax.vjp(ref, f32(q), f32(k), f32(v))


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("ctas", [3, 5])
def test_persistent_forward_loops_over_tiles(ctas):
    """Non-causal forward on a persistent grid with fewer CTAs than query tiles (uneven split with 5 CTAs); the next
    tile's Q loaded during the tile's second step.  512 keys in 256-key blocks: two K/V steps per tile (one-step
    tiles stay on the grid kernel: config.persistent_chosen)."""
    from pallas_kernels.flash_attention_hopper.config import default_config, persistent_chosen

    interpret = _mode()
    B, S, H, G, D = 2, 512, 3, 1, 64  # 2 * 3 * 4 = 24 query tiles
    q, k, v, do = _random_qkv_do(ctas, B, S, H, G, D)
    cfg = dataclasses.replace(default_config(D), fwd_ctas=ctas)
    assert persistent_chosen(cfg, S, D, q.dtype)
    f = lambda q, k, v: hopper_attention(q, k, v, scale=D ** -0.5, causal=False, config=cfg,
                                         interpret=interpret)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    (rout, rlse), rvjp = _fp32_reference_vjp(q, k, v)
    assert _rel(out, rout) < 1e-2
    assert _rel(lse, rlse) < 1e-4
    for g, rg in zip(vjp((do, jnp.zeros_like(lse))), rvjp((f32(do), jnp.zeros_like(rlse)))):
        assert _rel(g, rg) < 2e-2


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("ctas,lpt", [(3, True), (16, True), (3, False)])
def test_persistent_causal_forward_pairs_heavy_with_light_tiles(ctas, lpt):
    """Causal forward on the persistent grid (CausalDeal): each (batch, head)'s query tiles paired heavy with light,
    pairs dealt round-robin, the last ones tile by tile to the least-loaded CTA (LPT: 3 CTAs, 4 pair rounds and 8
    tail tiles; 16 CTAs, all 32 tiles by LPT) or as whole pairs (lpt=False), GQA.  Out and lse against fp32 tile
    by tile, gradients through the backward kernels, and equal to the per-tile grid's forward up to rounding."""
    from pallas_kernels.flash_attention_hopper.config import default_config, persistent_causal_served

    interpret = _mode()
    B, S, H, G, D = 2, 512, 4, 2, 64  # 4 query tiles per (batch, head): 2 pairs; 2 * 4 * 2 = 16 pairs
    cfg = dataclasses.replace(default_config(D, S, True, S), fwd_ctas=ctas, fwd_causal_lpt=lpt)
    assert persistent_causal_served(cfg, S, D, BF) and cfg.fwd_persistent_causal is None  # auto: on
    q, k, v, do = _random_qkv_do(20 + ctas, B, S, H, G, D)
    f = lambda cfg: lambda q, k, v: hopper_attention(q, k, v, scale=D ** -0.5, causal=True, config=cfg,
                                                     interpret=interpret)
    (out, lse), vjp = jax.vjp(f(cfg), q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    (rout, rlse), rvjp = _fp32_reference_vjp(q, k, v, causal=True)
    assert _rel(out, rout) < 1e-2
    assert _rel(lse, rlse) < 1e-4
    per_tile = np.abs(np.asarray(f32(out)) - np.asarray(rout)).reshape(B, S // 128, 128, H, D).max(axis=(2, 4))
    assert per_tile.max() < 8 * np.median(per_tile) + 1e-3  # no tile (heavy or light) off
    for g, rg in zip(vjp((do, jnp.zeros_like(lse))), rvjp((f32(do), jnp.zeros_like(rlse)))):
        assert _rel(g, rg) < 2e-2
    grid_out, grid_lse = f(dataclasses.replace(cfg, fwd_persistent_causal=False))(q, k, v)
    assert _rel(out, grid_out) < 4e-3 and _rel(lse, grid_lse) < 1e-5


@pytest.mark.parametrize("n_bh,n_qt,n_ctas", [(256, 8, 132), (64, 32, 132), (16, 128, 132), (8, 4, 3), (2, 4, 8),
                                               (3, 6, 5)])
@pytest.mark.parametrize("lpt", [True, False])
def test_causal_deal_runs_every_tile_once_and_ends_the_ctas_together(n_bh, n_qt, n_ctas, lpt):
    """The persistent causal forward's deal: every query tile of every (batch, head) exactly once; pair rounds in
    (batch, head) order; the busiest CTA within one tile of the average (LPT tail) and never later than dealing
    whole pairs round-robin (lpt=False: exactly that); the table's entries agree with the deal (what the kernel
    reads)."""
    from pallas_kernels.flash_attention_hopper.config import causal_deal

    deal = causal_deal(n_bh, n_qt, n_ctas, lpt=lpt)
    tiles = [t for c in range(n_ctas) for t in deal.pair_tiles(c) + list(deal.tail[c])]
    assert sorted(tiles) == list(range(n_bh * n_qt))
    if lpt or n_ctas <= n_bh * n_qt // 2:  # (the kernel deals whole pairs on at most that many CTAs)
        assert all(deal.pair_tiles(c) or deal.tail[c] for c in range(n_ctas))  # no CTA without work
    steps = [deal.steps(c) for c in range(n_ctas)]
    assert sum(steps) == n_bh * n_qt * (n_qt + 1) // 2
    assert max(steps) <= -(-(n_bh * n_qt // 2) // n_ctas) * (n_qt + 1)  # whole pairs round-robin
    if lpt:
        assert max(steps) <= sum(steps) / n_ctas + n_qt
    table, items = deal.table(), deal.table_items
    for c in range(n_ctas):
        tail = deal.tail[c]
        assert table[c, 0] == len(tail) and table[c, 1] == sum(t % n_qt + 1 for t in tail)
        assert list(table[c, 2:2 + len(tail)]) == list(tail)
        g = deal.pair_rounds * (n_qt + 1)
        walk = table[c, 2 + 2 * items:]
        for k, t in enumerate(tail):
            assert table[c, 2 + items + k] == g  # first ring step of the tile
            assert [divmod(int(x), n_qt) for x in walk[g - deal.pair_rounds * (n_qt + 1):][:t % n_qt + 1]] == [
                (t, blk) for blk in range(t % n_qt + 1)]
            g += t % n_qt + 1


@pytest.mark.parametrize("n_tiles,steps,n_ctas", [(8, 4, 3), (2048, 128, 132), (2048, 8, 132), (2048, 32, 132),
                                                 (300, 2, 132), (133, 5, 132), (1000, 3, 7)])
def test_tail_split_covers_every_step_once_and_cuts_a_tile_at_most_once(n_tiles, steps, n_ctas):
    """The stream-K plan: every (tile, K/V step) runs exactly once; a tile is whole on one CTA or cut once, between
    consecutive CTAs (the last piece of c - 1, the first piece of c: what _merge_cut_tiles reads); the busiest CTA
    runs at most ceil(average) + 1 steps instead of ceil(n_tiles / n_ctas) whole tiles."""
    from pallas_kernels.flash_attention_hopper.config import tail_split

    plan = tail_split(n_tiles, steps, n_ctas)
    seen = np.zeros((n_tiles, steps), np.int32)
    owners = {}
    for cta in range(n_ctas):
        pieces = plan.pieces(cta)
        assert pieces, f"CTA {cta} has no work"
        for j, (tile, k0, k1) in enumerate(pieces):
            assert 0 <= k0 < k1 <= steps
            seen[tile, k0:k1] += 1
            owners.setdefault(tile, []).append((cta, j, len(pieces), k0, k1))
    assert (seen == 1).all()
    cut = {t: c for t, c in plan.cut_tiles()}
    for tile, own in owners.items():
        if tile not in cut:
            assert len(own) == 1
            continue
        (c0, j0, n0, a0, b0), (c1, j1, _, a1, b1) = own
        assert c1 == c0 + 1 == cut[tile] and j0 == n0 - 1 and j1 == plan.dp_rounds  # c - 1's last piece, c's first tail piece
        assert a0 == 0 and b0 == a1 and b1 == steps
    busiest = max(sum(k1 - k0 for _, k0, k1 in plan.pieces(c)) for c in range(n_ctas))
    assert busiest <= -(-n_tiles * steps // n_ctas) + 1
    assert busiest <= -(-n_tiles // n_ctas) * steps  # never worse than whole tiles


def test_tail_split_is_off_where_it_changes_nothing():
    from pallas_kernels.flash_attention_hopper.config import HopperConfig, split_tail_chosen, tail_split

    assert tail_split(264, 16, 132) is None  # whole rounds
    assert tail_split(100, 16, 132) is None  # one tile per CTA
    assert tail_split(2048, 1, 132) is None  # one K/V step per tile: nothing to cut
    auto, on, off = HopperConfig(), HopperConfig(fwd_split_tail=True), HopperConfig(fwd_split_tail=False)
    assert split_tail_chosen(auto, 2048, 32, 132, 4096) == tail_split(2048, 32, 132)
    assert split_tail_chosen(auto, 2048, 8, 132, 1024) is None  # auto: from 4k keys (the merge costs ~10 us)
    assert split_tail_chosen(on, 2048, 8, 132, 1024) == tail_split(2048, 8, 132)
    assert split_tail_chosen(off, 2048, 128, 132, 16384) is None


@pytest.mark.parametrize("n_tiles,steps,n_sms", [(2048, 256, 132), (2048, 64, 132), (8, 16, 3), (8, 16, 5),
                                                   (4096, 512, 132), (1000, 8, 9)])
def test_piece_split_runs_every_step_once_and_ends_sooner(n_tiles, steps, n_sms):
    """The backward's cut last tiles: every (key tile, query step) runs exactly once; the cut tiles' pieces start at
    the same step for every tile (L2 sharing); in the equal-speed model the grid ends before the whole-tile grid."""
    from pallas_kernels.flash_attention_hopper.config import piece_split

    plan = piece_split(n_tiles, steps, n_sms)
    seen = np.zeros((n_tiles, steps), np.int32)
    starts = {}
    for cta in range(plan.n_ctas):
        tile, lo, hi = plan.cta_work(cta)
        assert 0 <= lo < hi <= steps
        seen[tile, lo:hi] += 1
        if cta >= plan.n_whole:
            starts.setdefault((cta - plan.n_whole) // plan.rest, set()).add(lo)
    assert (seen == 1).all()
    assert all(len(v) == 1 for v in starts.values()) and len(starts) == plan.pieces
    # list scheduling of the grid in order, a CTA's time = its steps
    free = [0.0] * n_sms
    for cta in range(plan.n_ctas):
        _, lo, hi = plan.cta_work(cta)
        i = free.index(min(free))
        free[i] += hi - lo
    assert max(free) < -(-n_tiles // n_sms) * steps


def test_piece_split_is_off_where_it_changes_nothing():
    from pallas_kernels.flash_attention_hopper.config import HopperConfig, piece_split, piece_split_chosen

    assert piece_split(264, 16, 132) is None  # whole rounds
    assert piece_split(100, 16, 132) is None  # fewer tiles than SMs
    assert piece_split(2048, 1, 132) is None  # one step per tile
    assert piece_split(1980 + 131, 256, 132) is None  # 131 of 132 SMs busy in the last round: no cut gains
    auto = HopperConfig()
    assert piece_split_chosen(auto, 2048, 256, 132, 4096) == piece_split(2048, 256, 132)
    assert piece_split_chosen(auto, 2048, 32, 132, 2048) is None  # auto: from 4k keys
    assert piece_split_chosen(HopperConfig(bwd_split_tail=True), 2048, 32, 132, 2048) == piece_split(2048, 32, 132)
    assert piece_split_chosen(HopperConfig(bwd_split_tail=True, bwd_pieces=1), 2048, 32, 132, 2048).pieces == 1
    assert piece_split_chosen(HopperConfig(bwd_split_tail=False), 2048, 256, 132, 16384) is None


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("ctas", [3, 5])
def test_stream_k_tails_with_cut_tiles_match_the_reference(ctas):
    """The cut tiles, forward and backward: 32 query tiles of 4 K/V steps on 3 / 5 persistent CTAs (stream-K: tiles
    cut between two CTAs, merged by their lse) and 16 key tiles of 16 query steps planned for 3 / 5 SMs (the last
    tiles cut into pieces, their dK / dV summed; two batches, so the tile numbering's batch axis counts).  Output, lse and gradients against fp32, tile by tile; equal to
    the whole-tile kernels up to rounding."""
    from pallas_kernels.flash_attention_hopper.config import default_config, piece_split, tail_split

    interpret = _mode()
    B, S, H, G, D = 2, 512, 4, 2, 128  # 2 * 4 * 4 = 32 query tiles; 512 / 128 = 4 K/V steps each
    assert tail_split(B * H * (S // 128), 4, ctas).cut_tiles()
    q, k, v, do = _random_qkv_do(10 + ctas, B, S, H, G, D)
    cfg = dataclasses.replace(default_config(D), fwd_ctas=ctas, fwd_split_tail=True,  # auto: from 4k keys
                              bwd_ctas=ctas, bwd_split_tail=True)
    assert piece_split(B * G * (S // 128), H // G * (S // 64), ctas)  # backward: B x G x key tiles, rep x q blocks
    f = lambda q, k, v: hopper_attention(q, k, v, scale=D ** -0.5, causal=False, config=cfg, interpret=interpret)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    (rout, rlse), rvjp = _fp32_reference_vjp(q, k, v)
    assert _rel(out, rout) < 1e-2
    assert _rel(lse, rlse) < 1e-4
    per_tile = np.abs(np.asarray(f32(out)) - np.asarray(rout)).reshape(B, S // 128, 128, H, D).max(axis=(2, 4))
    assert per_tile.max() < 8 * np.median(per_tile) + 1e-3  # no tile (cut or whole) off
    grads = vjp((do, jnp.zeros_like(lse)))
    for g, rg in zip(grads, rvjp((f32(do), jnp.zeros_like(rlse)))):
        assert _rel(g, rg) < 2e-2
        per_tile = np.abs(np.asarray(f32(g)) - np.asarray(rg)).reshape(B, S // 128, 128, -1).max(axis=(2, 3))
        assert per_tile.max() < 8 * np.median(per_tile) + 1e-3
    whole = dataclasses.replace(cfg, fwd_split_tail=False, bwd_split_tail=False)
    (out_w, lse_w), vjp_w = jax.vjp(lambda q, k, v: hopper_attention(q, k, v, scale=D ** -0.5, causal=False,
                                                                     config=whole, interpret=interpret), q, k, v)
    close = lambda a, b: float(jnp.max(jnp.abs(f32(a) - f32(b)))) <= 2 * 2.0 ** -8 * float(jnp.max(jnp.abs(f32(b))))
    assert close(out, out_w)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_w), rtol=1e-5, atol=1e-5)
    for g, gw in zip(grads, vjp_w((do, jnp.zeros_like(lse_w)))):
        assert close(g, gw)


def test_persistent_forward_shared_memory_budget():
    from pallas_kernels.flash_attention_hopper.config import default_config, persistent_fits

    assert persistent_fits(default_config(128), 128, jnp.bfloat16)
    assert persistent_fits(default_config(64), 64, jnp.bfloat16)
    assert persistent_fits(default_config(64, 384), 64, jnp.bfloat16)
    assert not persistent_fits(default_config(256), 256, jnp.bfloat16)  # grid path serves hd256


def test_hd64_default_tiles_follow_the_key_length():
    """hd64 takes 256-key forward tiles where the key length allows (causal: from 4k keys), 128-key
    tiles (3 stages) otherwise; 128-row backward query blocks where the query length allows."""
    from pallas_kernels.flash_attention_hopper.config import default_config

    assert default_config(64, 4096).block_kv == 256
    assert default_config(64, 1024).block_kv == 256
    assert default_config(64, 4096, causal=True).block_kv == 256
    assert default_config(64, 1024, causal=True).block_kv == 128  # half of each diagonal block masked
    fallback = default_config(64, 384)
    assert fallback.block_kv == 128 and fallback.stages == 3 and 384 % fallback.block_kv == 0
    assert default_config(128, 384, causal=True) == default_config(128)
    # backward: 128-row query blocks where the query length is a multiple of 256 (the dQ CTA's rows)
    assert default_config(64, 4096).bwd_block_q == 128
    assert default_config(64, 1024, causal=True).bwd_block_q == 128
    assert default_config(64, 384).bwd_block_q == 64
    assert default_config(64, 4096, q_len=384).bwd_block_q == 64


@pytest.mark.parametrize("kw", [dict(fwd_ctas=0), dict(fwd_ctas=-2), dict(fwd_ctas=1.5), dict(bwd_dq_atomic="yes"),
                                dict(bwd_delta_in_dq=1), dict(bwd_persistent_band="on"), dict(fwd_persistent_band=1),
                                dict(fwd_band_heavy_first="auto"),
                                dict(bwd_causal_reverse=1), dict(fwd_persistent=1.0), dict(fwd_named_barrier="auto"),
                                dict(fwd_named_release=1), dict(fwd_producer_warp="on"),
                                dict(bwd_named_release="x"), dict(bwd_producer_warp=2), dict(fwd_split_tail="auto"),
                                dict(bwd_split_tail=0), dict(bwd_ctas=0), dict(bwd_pieces=0),
                                dict(fwd_persistent_causal=1), dict(fwd_causal_lpt="x"),
                                dict(bwd_compute_registers=248), dict(bwd_compute_registers=236),
                                dict(bwd_aligned="on"), dict(bwd_aligned=True, bwd_dq_atomic=True),
                                dict(lists_kernel="on"), dict(exit_wait_read_only=None)])
def test_config_rejects_bad_switches(kw):
    from pallas_kernels.flash_attention_hopper.config import HopperConfig

    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        HopperConfig(**kw)


def test_describe_plan_names_each_choice(monkeypatch):
    d = fah.describe_plan
    assert "persistent grid" in d(128, 4096, False, jnp.bfloat16) and "reduce-add" in d(128, 4096, False, jnp.bfloat16)
    assert "paired heavy with light; the last tiles dealt to the least-loaded CTA" in d(128, 16384, True, jnp.bfloat16)
    assert "least-loaded" not in d(128, 4096, True, jnp.bfloat16, fah.HopperConfig(fwd_causal_lpt=False))
    assert "heaviest first (fwd_persistent_causal=False)" in d(128, 4096, True, jnp.bfloat16,
                                                               fah.HopperConfig(fwd_persistent_causal=False))
    assert "an even number of query tiles" in d(128, 384, True, jnp.bfloat16)  # 3 tiles: no pairs
    assert "block_kv 256" in d(64, 4096, True, jnp.bfloat16)  # hd64's 256-key tiles: no diagonal per tile
    smem = d(256, 4096, True, jnp.bfloat16, fah.HopperConfig(block_kv=128))  # the tiles fit, the shared memory not
    assert "shared memory for two Q/O buffers" in smem and "block_kv = 2 x block_q" not in smem
    assert "shared out by K/V steps" in d(128, 4096, False, jnp.bfloat16)  # the stream-K tail, from 4k keys
    assert "whole tiles: keys 1024 < 4096" in d(128, 1024, False, jnp.bfloat16)
    assert "fwd_split_tail=False" in d(128, 4096, False, jnp.bfloat16, fah.HopperConfig(fwd_split_tail=False))
    assert "from the last one down to the diagonal" in d(128, 4096, True, jnp.bfloat16)
    assert "from the diagonal up" in d(128, 4096, True, jnp.bfloat16, fah.HopperConfig(bwd_causal_reverse=False))
    assert "walks" not in d(128, 4096, False, jnp.bfloat16)
    assert "no shared memory for the persistent grid" in d(256, 4096, False, jnp.bfloat16)
    assert "reduce-add" in d(64, 4096, True, jnp.bfloat16)  # hd64, 128-row query blocks: in-kernel dQ from 2k keys
    assert "keys 1024 < 2048" in d(64, 1024, False, jnp.bfloat16)
    assert "head_dim 64, dK/dV query block 64, bwd_wgs 2" in d(64, 384, True, jnp.bfloat16)  # 32-column shares
    assert "head_dim 256" in d(256, 4096, True, jnp.bfloat16).split("backward with")[-1]
    assert "keys 1024 < 2048" in d(128, 1024, False, jnp.bfloat16)
    from pallas_kernels.flash_attention_hopper import config

    monkeypatch.delitem(config.ATOMIC_DQ_AUTO_MIN_KV, 64)  # a head_dim served but never auto
    assert "not the default for head_dim 64" in d(64, 4096, True, jnp.bfloat16)
    forced = fah.HopperConfig(bwd_dq_atomic=False, fwd_persistent=False)
    assert d(128, 4096, False, jnp.bfloat16, forced) == (
        "forward one CTA per query tile; backward with a separate dQ kernel (bwd_dq_atomic=False); the dQ kernel "
        "runs first and computes delta = rowsum(O * dO) for the dK/dV kernel")
    xla_delta = dataclasses.replace(forced, bwd_delta_in_dq=False)
    assert "from an XLA reduction (bwd_delta_in_dq=False)" in d(128, 4096, False, jnp.bfloat16, xla_delta)
    assert "head_dim 256: no shared memory for O's tiles" in d(256, 4096, True, jnp.bfloat16)
    assert "delta" not in d(128, 4096, False, jnp.bfloat16)  # the atomic dQ: delta from XLA, beside the zeroed dQ


@pytest.mark.parametrize("kw,field", [(dict(block_kv=256), "kv_len=384 is not a multiple of block_kv = 256"),
                                      (dict(bwd_block_q=128), "q_len=384 is not a multiple of bwd_wgs x bwd_block_q = 256"),
                                      (dict(bwd_dkv_block_q=256), r"q_len=384 is not a multiple of the dK/dV kernel's "
                                                                  r"query block \(bwd_dkv_block_q\) = 256")])
def test_config_blocks_that_do_not_divide_the_lengths_are_a_clear_error(kw, field):
    """An explicit config whose blocks do not divide the sequence is refused before any kernel runs,
    naming the field, the length and the fix (the forward and the backward blocks alike)."""
    from pallas_kernels.flash_attention_hopper.config import HopperConfig

    q = jnp.ones((1, 384, 2, 64), BF)
    with pytest.raises(ValueError, match=field) as err:
        hopper_attention(q, q, q, scale=0.125, config=HopperConfig(**kw))
    assert "config=None" in str(err.value)


def test_config_refuses_a_one_stage_backward_ring():
    """bwd_stages=1 gave wrong causal gradients on the H100 (hd256, two warpgroups): HopperConfig refuses it with the
    fix; stages=1 (the forward's ring) stays allowed."""
    from pallas_kernels.flash_attention_hopper.config import HopperConfig

    with pytest.raises(ValueError, match="bwd_stages=1: .*use bwd_stages=2"):
        HopperConfig(bwd_stages=1)
    with pytest.raises(ValueError, match="stages=0 must be >= 1"):
        HopperConfig(stages=0)
    assert HopperConfig(stages=1).stages == 1


def test_backward_register_split():
    """setmaxnreg of the backward: the compute and memory warpgroups share the CTA's 168 x 384 registers."""
    from pallas_kernels.flash_attention_hopper.config import REGISTERS_PER_CTA, HopperConfig, bwd_registers, default_config

    assert bwd_registers(default_config(128)) == (240, 24)  # hd128 (run 10)
    assert bwd_registers(default_config(64)) == (240, 24) == bwd_registers(default_config(64, 1024, True, 1024))
    assert bwd_registers(HopperConfig()) == (232, 40)  # a config without the field
    assert bwd_registers(default_config(256)) == (240, 40)  # one compute warpgroup
    for cfg in (default_config(128), default_config(64), HopperConfig(bwd_compute_registers=232)):
        regs, producer = bwd_registers(cfg)
        assert cfg.bwd_wgs * 128 * regs + 128 * producer <= REGISTERS_PER_CTA and producer >= 24


# ---------------------------------------------------------------- data masks (segments, padding, windows, positions)
def _runs(lengths, total):
    """Segment ids [total]: run i (1-based) of lengths[i] tokens, then padding (0) up to total."""
    ids = np.zeros(total, np.int32)
    at = 0
    for i, n in enumerate(lengths):
        ids[at:at + n] = i + 1
        at += n
    return ids


def _masked_case(name):
    """(B, Sq, Skv, H, G, D, AttentionMask, softcap) of a named data-mask case."""
    from pallas_kernels.mask import AttentionMask

    if name == "padding":  # rows 512 and 300 valid, non-causal, GQA
        seg = np.stack([_runs([512], 512), _runs([300], 512)])
        return 2, 512, 512, 4, 2, 128, AttentionMask.from_segments(seg), None
    if name == "padding_causal_hd64":
        seg = np.stack([_runs([200], 384), _runs([384], 384)])
        return 2, 384, 384, 2, 1, 64, AttentionMask.from_segments(seg, causal=True), None
    if name == "documents_causal":  # packed documents, one of length 1, ragged total (padded to 640)
        seg = _runs([100, 1, 250, 189], 600)[None]
        return 1, 600, 600, 2, 2, 128, AttentionMask.from_segments(seg, causal=True), None
    if name == "short_documents":  # documents of 1-7 tokens sharing 8-row groups; row 2 past the aligned bound
        seg = np.stack([_runs([3, 5, 1, 200, 250], 512), _runs([3, 9, 1, 2, 60, 5, 7, 80, 1, 40, 6, 70], 512)])
        return 2, 512, 512, 2, 1, 128, AttentionMask.from_segments(seg, causal=True), None
    if name == "documents_softcap_gqa":  # packed documents under softcap, 4 query heads on 2 KV heads
        seg = _runs([300, 7, 120, 173], 600)[None]
        return 1, 600, 600, 4, 2, 128, AttentionMask.from_segments(seg, causal=True), 5.0
    if name == "window_causal_hd64":
        return 1, 768, 768, 2, 1, 64, AttentionMask.full(1, 768, 768, causal=True, window=(128, 0)), None
    if name == "window_two_sided_softcap_hd256":
        return 1, 384, 384, 2, 1, 256, AttentionMask.full(1, 384, 384, window=(100, 50)), 2.0
    if name == "bottom_right_causal":  # q 256 against kv 640
        return 1, 256, 640, 2, 1, 128, AttentionMask.full(1, 256, 640, causal=True, bottom_right=True), None
    if name == "empty_rows":  # padding queries and a query segment no key has: their rows see nothing
        q_seg = np.stack([_runs([100, 100], 256), np.full(256, 3, np.int32)])
        kv_seg = np.stack([_runs([60, 140], 384), _runs([384], 384)])
        q_seg[0, 150:170] = 7
        return 2, 256, 384, 2, 1, 128, AttentionMask.from_segments(q_seg, kv_seg), None
    if name == "ragged_lengths":  # q 129 against kv 1000, padding within
        q_seg = _runs([129], 129)[None]
        kv_seg = _runs([700], 1000)[None]
        return 1, 129, 1000, 2, 2, 128, AttentionMask.from_segments(q_seg, kv_seg), None
    raise KeyError(name)


MASKED_CASES = ["padding", "padding_causal_hd64", "documents_causal", "window_causal_hd64",
                "window_two_sided_softcap_hd256", "bottom_right_causal", "empty_rows", "ragged_lengths"]
#: Cases whose mask has one segment and whole-tile lengths: run with mask_segments=False (positions compared only).
ONE_SEGMENT_CASES = ("window_causal_hd64", "window_two_sided_softcap_hd256", "bottom_right_causal")


def test_compares_segments_where_asked_or_lengths_are_padded():
    """compares_segments (hopper_attention and the front door's explanation): positions alone only for one-segment
    calls whose lengths need no padding tokens (those are told apart by their segment)."""
    from pallas_kernels.flash_attention_hopper import compares_segments

    assert compares_segments(True, 256, 256) and not compares_segments(False, 256, 384)
    assert compares_segments(False, 129, 256) and compares_segments(False, 256, 1000)


def test_one_segment_rule_equals_the_full_rule_on_one_segment():
    """MaskRule(segments=False) (what hopper_attention(mask_segments=False) runs) hides exactly the pairs the full
    rule hides when every token is in one segment, for causal, windows and both; with two segments it would not."""
    from pallas_kernels.flash_attention_hopper.data_mask import MaskRule

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    q_pos, k_pos = jnp.asarray(rng.integers(0, 100, 64)), jnp.asarray(rng.integers(0, 100, 48))
    one_q, one_k = jnp.ones(64, jnp.int32), jnp.ones(48, jnp.int32)
    two_k = jnp.asarray(rng.integers(1, 3, 48))
    for causal, window in ((True, (-1, -1)), (False, (20, 5)), (True, (10, -1))):
        full, lean = MaskRule(causal, window), MaskRule(causal, window, segments=False)
        for q_axis, xx in ((0, x), (1, x.T)):
            a = full.apply(xx, (one_q, q_pos), (one_k, k_pos), -jnp.inf, q_axis=q_axis)
            b = lean.apply(xx, (one_q, q_pos), (one_k, k_pos), -jnp.inf, q_axis=q_axis)
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(full.apply(x, (one_q, q_pos), (two_k, k_pos), -jnp.inf, q_axis=0),
                                  lean.apply(x, (one_q, q_pos), (two_k, k_pos), -jnp.inf, q_axis=0))


def _band_cases():
    """(causal, window, q_len, kv_len, bottom_right) one-segment masks for the band tests."""
    return [(True, (-1, -1), 512, 512, False), (True, (128, 0), 768, 768, False), (False, (100, 50), 384, 384, False),
            (True, (-1, -1), 256, 640, True), (True, (200, -1), 256, 1024, True), (False, (-1, 70), 512, 256, False),
            (True, (-1, -1), 640, 256, True), (False, (0, 0), 256, 256, False), (True, (64, -1), 384, 512, False)]


def test_walk_band_runs_masked_full_masked_steps_once_each():
    """band.walk_band (every band kernel's loops): each step of [0, steps) once, masked outside [full_lo, full_hi),
    in order, with traced bounds; an empty walk runs nothing."""
    from pallas_kernels.flash_attention_hopper.band import walk_band

    def run(flo, fhi, steps):
        def body(step, carry, masked):
            seen, order = carry
            return seen.at[step].add(jnp.where(masked, 1, 10)), order.at[step].set(jnp.max(order) + 1)

        return jax.jit(lambda a, b, c: walk_band(body, a, b, c, (jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32))))(
            jnp.int32(flo), jnp.int32(fhi), jnp.int32(steps))

    seen, order = run(2, 5, 7)
    assert seen.tolist() == [1, 1, 10, 10, 10, 1, 1, 0] and order.tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert run(0, 0, 0)[0].tolist() == [0] * 8
    assert run(0, 3, 3)[0].tolist() == [10, 10, 10, 0, 0, 0, 0, 0]


def test_band_walks_cover_exactly_the_visible_pairs():
    """MaskRule.band with band.query_blocks / key_blocks / band_mask, as the dK/dV kernel (per key tile, walking
    query blocks) and the forward and dQ kernel (per query tile, walking key blocks) call them, against the dense
    mask of AttentionMask.full: the walked blocks hold every visible pair, the full ones only visible pairs, and
    band_mask on the masked ones keeps exactly the visible pairs and none is fully visible; blocks outside the walk
    hold none, and the walk starts and ends on blocks with a visible pair (no wasted steps); on the cases of
    _band_cases and random bands."""
    from pallas_kernels.flash_attention_hopper.band import band_big, band_mask, key_blocks, query_blocks
    from pallas_kernels.flash_attention_hopper.data_mask import mask_rule
    from pallas_kernels.mask import AttentionMask

    rng = np.random.default_rng(0)  # and random bands, edges on and off the block boundaries
    rand = [(bool(rng.integers(2)), tuple(int(x) for x in rng.choice([-1, 0, 1, 62, 63, 64, 65, 127, 200], 2)),
             int(rng.choice([128, 256, 384])), int(rng.choice([128, 256, 384])), bool(rng.integers(2)))
            for _ in range(24)]
    for causal, window, sq, skv, br in _band_cases() + rand:
        if not causal and window == (-1, -1):
            continue  # no mask: not a band
        m = AttentionMask.full(1, sq, skv, causal=causal, window=window, bottom_right=br)
        dense = np.asarray(m.dense()[0])  # [sq, skv]
        band = mask_rule(m, False, offset=skv - sq if br else 0).band()
        off = band[0]
        big = band_big(band, sq, skv)
        for keys_fixed, tile, block in ((True, 128, 64), (False, 128, 128), (True, 128, 128), (False, 64, 64)):
            fixed, walked = (skv, sq) if keys_fixed else (sq, skv)
            for t0 in range(0, fixed, tile):
                t1 = t0 + tile
                # the dK/dV kernel's walk (keys [t0, t1) over query blocks), or the forward's and the dQ kernel's
                walk = query_blocks if keys_fixed else key_blocks
                first, steps, flo, fhi = (int(x) for x in walk(band, t0, t1, block, walked // block, big))
                walked_blocks = set(range(first, first + steps))
                tile_of = lambda blk: (dense[blk * block:(blk + 1) * block, t0:t1].T if keys_fixed
                                       else dense[t0:t1, blk * block:(blk + 1) * block])
                if steps:  # tight: the walk starts and ends on blocks that hold a visible pair
                    assert tile_of(first).any() and tile_of(first + steps - 1).any(), (band, t0, first, steps)
                for blk in range(walked // block):
                    w0 = blk * block
                    sub = tile_of(blk)
                    if blk not in walked_blocks:
                        assert not sub.any(), (band, t0, blk)
                        continue
                    j = blk - first
                    if flo <= j < fhi:
                        assert sub.all(), (band, t0, blk, "full")
                    else:  # rows: the fixed axis, columns the walked one
                        assert not sub.all(), (band, t0, blk, "a full block walked with the mask")
                        kmq = (np.arange(block)[None, :] - np.arange(tile)[:, None] if not keys_fixed else
                               np.arange(tile)[:, None] - np.arange(block)[None, :])
                        c = (t0 + off - w0) if not keys_fixed else (w0 + off - t0)
                        kept = np.asarray(band_mask(jnp.ones((tile, block)), jnp.asarray(kmq), c, band)) > 0
                        np.testing.assert_array_equal(kept, sub, err_msg=f"{band} tile {t0} block {blk}")


#: Scalar primitives with a Mosaic GPU lowering in warp-level code (a single producer warp, jax 0.10-0.11; the
#: GPU run of 2026-11-27 found lax.neg missing there on jax 0.11.2, which the CPU lowering on 0.10.2 does not see).
_WARP_LOWERABLE = {"add", "sub", "mul", "div", "rem", "max", "min", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
                   "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical", "convert_element_type"}


def test_producer_index_arithmetic_lowers_in_warp_level_code():
    """What the persistent kernels' single producer warp computes (band.key_blocks / query_blocks, the tile deal)
    traces to primitives that Mosaic GPU lowers at warp level: no lax.neg, clamp or select (test_hopper_lowering
    checks whole kernels against jax's own table)."""
    from jaxpr_walk import walk
    from pallas_kernels.flash_attention_hopper.band import key_blocks, query_blocks
    from pallas_kernels.flash_attention_hopper.persistent_steps import snake_tile, tiles_of_cta

    fns = [lambda t: snake_tile(t, t + 1, 132), lambda t: tiles_of_cta(t, 1000, 132)]
    for band in ((0, -1024, 0), (0, -256, 256), (2048, None, 0), (0, None, 70), (0, 64, None)):
        fns += [lambda t, b=band: key_blocks(b, t * 256, t * 256 + 256, 128, 32, 64),
                lambda t, b=band: query_blocks(b, t * 128, t * 128 + 128, 64, 64, 64)]
    for fn in fns:
        used = {e.primitive.name for e in walk(jax.make_jaxpr(fn)(jnp.int32(3)).jaxpr)} - {"jit", "pjit"}
        assert used <= _WARP_LOWERABLE, sorted(used - _WARP_LOWERABLE)


def test_grid_band_forward_launches_growing_walks_heaviest_first():
    """band.heavier_tiles_last (the grid band forward's launch order, HopperConfig.fwd_band_heavy_first): true where
    the query tiles' key walks grow toward the end (windows (W, 0), causal given as data, bottom-right), false where
    they are even or shrink (symmetric windows, windows open to the right); usable inside a jit trace."""
    from pallas_kernels.flash_attention_hopper.band import heavier_tiles_last
    from pallas_kernels.flash_attention_hopper.data_mask import mask_rule
    from pallas_kernels.mask import AttentionMask

    cases = [(AttentionMask.full(1, 1024, 1024, causal=True, window=(256, 0)), 0, True),
             (AttentionMask.full(1, 1024, 1024, causal=True), 0, True),
             (AttentionMask.full(1, 256, 1024, causal=True, bottom_right=True), 768, True),
             (AttentionMask.full(1, 1024, 1024, window=(128, 128)), 0, False),
             (AttentionMask.full(1, 1024, 1024, window=(0, -1)), 0, False)]
    for m, offset, expected in cases:
        band = mask_rule(m, False, offset=offset).band()
        assert heavier_tiles_last(band, m.q_len, m.kv_len, 128, 128) is expected, (band, expected)
    assert jax.jit(lambda x: x * heavier_tiles_last((0, None, 0), 1024, 1024, 128, 128))(3) == 3


def test_band_forward_only_where_every_query_sees_a_key():
    """band.every_query_sees_a_key against the dense mask on every band of _band_cases, and the dispatch it drives:
    hopper_attention(mask_offset=...) runs the band forward (kernel te_jax_attn_fwd) where every query has a key,
    else the data-mask forward (te_jax_attn_fwd_masked, whose empty rows are GPU-tested); the band backward both
    times (no dQ or dK/dV tables: te_jax_attn_bwd_* kernels without the masked ones' tables)."""
    from pallas_kernels.flash_attention_hopper.band import every_query_sees_a_key
    from pallas_kernels.flash_attention_hopper.data_mask import mask_rule
    from pallas_kernels.mask import AttentionMask

    for causal, window, sq, skv, br in _band_cases():
        m = AttentionMask.full(1, sq, skv, causal=causal, window=window, bottom_right=br)
        band = mask_rule(m, False, offset=skv - sq if br else 0).band()
        assert every_query_sees_a_key(band, sq, skv) == bool(np.asarray(m.dense()).any(-1).all()), (band, sq, skv)
        q = jax.ShapeDtypeStruct((1, sq, 2, 128), BF)
        k = jax.ShapeDtypeStruct((1, skv, 1, 128), BF)
        f = lambda q, k, v: jax.vjp(lambda q, k, v: hopper_attention(
            q, k, v, scale=0.1, mask=m, mask_segments=False, mask_offset=skv - sq if br else 0, interpret=False)[0],
            q, k, v)[1](jnp.zeros((1, sq, 2, 128), BF))
        text = str(jax.make_jaxpr(f)(q, k, k))
        assert ("te_jax_attn_fwd_masked" in text) != every_query_sees_a_key(band, sq, skv), (band, sq, skv)
        assert "te_jax_attn_bwd" in text


def test_mask_offset_arguments_are_checked():
    """hopper_attention's mask_offset: an int, only with a data mask, mask_segments=False and mask_aligned=False;
    MaskRule's offset only without the segment compare."""
    from pallas_kernels.flash_attention_hopper.data_mask import mask_rule
    from pallas_kernels.mask import AttentionMask

    q = jnp.zeros((1, 128, 2, 64), BF)
    m = AttentionMask.full(1, 128, 128, causal=True)
    for kw in (dict(mask=m, mask_offset=0), dict(mask=m, mask_segments=False, mask_offset=0.5),
               dict(mask=m, mask_segments=False, mask_aligned=True, mask_offset=0), dict(mask_offset=0)):
        with pytest.raises(ValueError, match="mask_offset"):
            hopper_attention(q, q, q, scale=0.1, **kw)
    with pytest.raises(ValueError, match="segments=False"):
        mask_rule(m, True, offset=0)
    from pallas_kernels.flash_attention_hopper.backward import flash_bwd
    from pallas_kernels.flash_attention_hopper.data_mask import mask_tables
    from pallas_kernels.flash_attention_hopper.forward import flash_fwd

    band = (0, None, 0)
    with pytest.raises(ValueError, match="band"):
        flash_fwd(q, q, q, scale=0.1, causal=True, band=band, interpret=False)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="band or mask tables"):
        flash_bwd(q, q, q, q, lse, q, scale=0.1, causal=False, band=band, interpret=False,
                  mask_tables=mask_tables(m, fah.default_config(64, 128, False, 128)), mask_rule=mask_rule(m))


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name", ONE_SEGMENT_CASES)
@pytest.mark.parametrize("atomic", [None, True])
def test_band_backward_forward_and_grads(name, atomic):
    """One-segment masks with positions as token indices (mask_offset: the backward walks the band, no tables; dQ
    from the dQ kernel at these lengths, or in the dK/dV kernel where `atomic` forces it, as auto does from 2k
    keys) against the fp32 reference, as test_data_mask_forward_and_grads."""
    from pallas_kernels.flash_attention_hopper.config import default_config

    B, Sq, Skv, H, G, D, mask, softcap = _masked_case(name)
    cfg = dataclasses.replace(default_config(D, Skv, False, Sq), bwd_dq_atomic=atomic)
    offset = Skv - Sq if name == "bottom_right_causal" else 0
    _check_data_mask(name, mask_offset=offset, config=cfg)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("case", range(len(_band_cases())))
def test_band_backward_on_awkward_bands(case):
    """The band backward on every band of _band_cases (empty walks, q longer than kv bottom-right with rows that see
    nothing, one-sided windows, the diagonal alone) against the fp32 reference: out, lse, dq, dk, dv."""
    _check_band(case)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("case", [1, 2, 4, 5, 7])
@pytest.mark.parametrize("ctas,named", [(3, None), (None, None), (3, True)])
def test_persistent_band_kernels(case, ctas, named):
    """HopperConfig.fwd_persistent_band and bwd_persistent_band: the band's forward and dK/dV kernels on persistent
    grids (3 CTAs: several tiles each, the next tile's Q or K/V loading during this one and one ring running across
    tiles; None: one CTA per SM) on bands of _band_cases (a window, a two-sided window, bottom-right with a left
    window, one-sided with q longer than kv, the diagonal alone) against the fp32 reference: out from the forward,
    dk and dv from the dK/dV kernel.  named: the forward's warpgroups take turns through the named barrier (True) or
    as auto says (None: mbarriers on these narrow bands, band.named_rendezvous)."""
    from pallas_kernels.flash_attention_hopper.config import default_config

    causal, window, sq, skv, br = _band_cases()[case]
    cfg = dataclasses.replace(default_config(128, skv, False, sq), bwd_persistent_band=True, bwd_dq_atomic=False,
                              bwd_ctas=ctas, fwd_persistent_band=True, fwd_ctas=ctas, fwd_named_barrier=named)
    _check_band(case, config=cfg)


def _check_band(case, config=None):
    """hopper_attention on band case `case` of _band_cases (GQA 2/1, hd128) against the fp32 reference."""
    from pallas_kernels.flash_attention.reference import reference_attention
    from pallas_kernels.mask import AttentionMask

    causal, window, sq, skv, br = _band_cases()[case]
    m = AttentionMask.full(1, sq, skv, causal=causal, window=window, bottom_right=br)
    ks = jax.random.split(jax.random.key(case), 4)
    q, do = (jax.random.normal(kk, (1, sq, 2, 128), BF) for kk in ks[:2])
    k, v = (jax.random.normal(kk, (1, skv, 1, 128), BF) for kk in ks[2:])
    f = lambda q, k, v: hopper_attention(q, k, v, scale=0.1, mask=m, mask_segments=False,
                                         mask_offset=skv - sq if br else 0, interpret=_mode(), config=config)[0]
    out, vjp = jax.vjp(f, q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    rout, rvjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, m, scale=0.1)[0], f32(q), f32(k), f32(v))
    assert _rel(out, rout) < 1e-2
    for g, rg in zip(vjp(do), rvjp(f32(do))):
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
        if float(jnp.max(jnp.abs(rg))) < 1e-3:  # the diagonal alone: softmax over one key, dq exactly 0
            assert float(jnp.max(jnp.abs(f32(g)))) < 1e-2
        else:
            assert _rel(g, rg) < 2e-2, _rel(g, rg)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name", MASKED_CASES)
def test_data_mask_forward_and_grads(name):
    """hopper_attention(mask=AttentionMask) against the fp32 reference with the same mask: out, lse, dq, dk, dv;
    rows that see no key give out 0, lse -inf and zero dq."""
    _check_data_mask(name)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name", ["documents_causal", "empty_rows"])
def test_data_mask_forward_with_the_named_barrier(name):
    """The grid data-mask forward with its warpgroups' turns through the hardware named barrier
    (HopperConfig.fwd_named_barrier=True; auto takes mbarriers there) against the fp32 reference."""
    from pallas_kernels.flash_attention_hopper.config import default_config

    B, Sq, Skv, H, G, D, mask, softcap = _masked_case(name)
    _check_data_mask(name, config=dataclasses.replace(default_config(D, Skv, False, Sq), fwd_named_barrier=True))


ALIGNED_CASES = ["documents_causal", "short_documents", "padding", "empty_rows", "ragged_lengths",
                 "window_causal_hd64", "documents_softcap_gqa"]


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name", ALIGNED_CASES)
def test_aligned_data_mask_forward_and_grads(name):
    """The forward on document-aligned tiles (mask_aligned=True: Q and K/V loaded at each document's rows, out
    stored in token order by the groups each tile owns, lse gathered back from the tiles' padded layout) against the
    fp32 reference, as test_data_mask_forward_and_grads (the backward is the grid's, bwd_aligned=False, fed the
    aligned forward's out and lse; test_aligned_backward_forward_and_grads runs the aligned backward)."""
    from pallas_kernels.flash_attention_hopper import masked_config

    B, Sq, Skv, H, G, D, mask, softcap = _masked_case(name)
    _check_data_mask(name, mask_aligned=True,
                     config=dataclasses.replace(masked_config(D, D, Sq, Skv), bwd_aligned=False))


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name,head_dims", [("documents_causal", None), ("short_documents", None),
                                             ("empty_rows", None), ("ragged_lengths", None),
                                             ("documents_causal", (192, 128)), ("documents_softcap_gqa", None)])
@pytest.mark.parametrize("xla_delta", [False, True], ids=["delta in dQ", "XLA delta"])
def test_aligned_backward_forward_and_grads(name, head_dims, xla_delta):
    """The backward on document-aligned tiles too (HopperConfig.bwd_aligned): the dQ kernel's query tiles and the
    dK/dV kernel's key tiles start at every document, dQ, dK and dV are stored in token order by plan with the
    shared groups merged, and the delta the dQ kernel computes is gathered back for the dK/dV kernel; with the
    aligned forward, against the fp32 reference (as test_aligned_data_mask_forward_and_grads, an lse cotangent
    too; 192/128 as DeepSeek-V3's geometry)."""
    from pallas_kernels.flash_attention_hopper import masked_config

    B, Sq, Skv, H, G, D, mask, softcap = _masked_case(name)
    D, Dv = head_dims or (D, D)
    cfg = dataclasses.replace(masked_config(D, Dv, Sq, Skv), bwd_aligned=None if name == "short_documents" else True,
                              bwd_delta_in_dq=False if xla_delta else None)  # None: auto follows the forward
    _check_data_mask(name, head_dims=head_dims, mask_aligned=True, config=cfg)


def _check_data_mask(name, head_dims=None, **kw):
    """hopper_attention(mask=...) on the named case (head_dims: (q/k, v) head_dims in place of the case's) against
    the fp32 reference with the same mask: out, lse, dq, dk, dv; rows that see no key give out 0, lse -inf and
    zero dq. kw: more hopper_attention arguments."""
    from pallas_kernels.flash_attention.reference import reference_attention

    interpret = _mode()
    B, Sq, Skv, H, G, D, mask, softcap = _masked_case(name)
    D, Dv = head_dims or (D, D)
    ks = jax.random.split(jax.random.key(len(name) + D + Dv), 5)
    q = jax.random.normal(ks[0], (B, Sq, H, D), BF)
    k = jax.random.normal(ks[1], (B, Skv, G, D), BF)
    v = jax.random.normal(ks[2], (B, Skv, G, Dv), BF)
    do = jax.random.normal(ks[3], (B, Sq, H, Dv), BF)
    seen = np.asarray(mask.dense().any(-1))  # [B, Sq]: rows that see a key
    dl = jax.random.normal(ks[4], (B, H, Sq), jnp.float32) * seen[:, None, :]
    scale = D ** -0.5
    f = lambda q, k, v: hopper_attention(q, k, v, scale=scale, mask=mask, interpret=interpret, softcap=softcap,
                                         mask_segments=name not in ONE_SEGMENT_CASES, **kw)
    (out, lse), vjp = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v))(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v: reference_attention(q, k, v, mask, scale=scale, softcap=softcap)
    (rout, rlse), rvjp = jax.vjp(ref, f32(q), f32(k), f32(v))
    assert out.shape == (B, Sq, H, Dv) and _rel(out, rout) < 1e-2, _rel(out, rout)
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    rows = np.broadcast_to(seen[:, None, :], lse.shape)
    assert np.all(lse[~rows] == -np.inf) and np.all(np.isfinite(lse[rows]))
    assert _rel(lse[rows], rlse[rows]) < 1e-4
    assert np.all(np.asarray(out, np.float32)[~seen] == 0)
    grads = jax.jit(vjp)((do, dl))
    for g, rg in zip(grads, rvjp((f32(do), dl))):
        assert g.shape == rg.shape and np.all(np.isfinite(np.asarray(g, np.float32)))
        assert _rel(g, rg) < 2e-2, _rel(g, rg)
    assert np.all(np.asarray(grads[0], np.float32)[~seen] == 0)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name", MASKED_CASES)
def test_persistent_masked_forward(name):
    """The persistent data-mask forward (HopperConfig.fwd_persistent_masked; 3 CTAs, so each walks several query
    tiles in snake order, the K/V ring and the Q double buffer running on across them) against the fp32 reference:
    out and lse, rows that see nothing 0 / -inf; its gradients (the data-mask backward from its out and lse)."""
    from pallas_kernels.flash_attention.reference import reference_attention
    from pallas_kernels.flash_attention_hopper.config import default_config, persistent_masked_chosen

    interpret = _mode()
    B, Sq, Skv, H, G, D, mask, softcap = _masked_case(name)
    ks = jax.random.split(jax.random.key(len(name) + 1), 4)
    q = jax.random.normal(ks[0], (B, Sq, H, D), BF)
    k = jax.random.normal(ks[1], (B, Skv, G, D), BF)
    v = jax.random.normal(ks[2], (B, Skv, G, D), BF)
    do = jax.random.normal(ks[3], (B, Sq, H, D), BF)
    pq, pkv = -(-Sq // 128) * 128, -(-Skv // 128) * 128
    cfg = dataclasses.replace(default_config(D, pkv, False, pq), fwd_persistent_masked=True, fwd_ctas=3)
    if not persistent_masked_chosen(cfg, D, D, BF):
        pytest.skip(f"head_dim {D}: the persistent data-mask forward's shared memory does not fit")
    f = lambda q, k, v: hopper_attention(q, k, v, scale=D ** -0.5, mask=mask, interpret=interpret, softcap=softcap,
                                         config=cfg, mask_segments=name not in ONE_SEGMENT_CASES)
    (out, lse), vjp = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v))(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v: reference_attention(q, k, v, mask, scale=D ** -0.5, softcap=softcap)
    (rout, rlse), rvjp = jax.vjp(ref, f32(q), f32(k), f32(v))
    seen = np.asarray(mask.dense().any(-1))
    assert _rel(out, rout) < 1e-2, _rel(out, rout)
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    rows = np.broadcast_to(seen[:, None, :], lse.shape)
    assert np.all(lse[~rows] == -np.inf) and _rel(lse[rows], rlse[rows]) < 1e-4
    assert np.all(np.asarray(out, np.float32)[~seen] == 0)
    dl = jnp.zeros_like(rlse)
    for g, rg in zip(jax.jit(vjp)((do, dl)), rvjp((f32(do), dl))):
        assert g.shape == rg.shape and _rel(g, rg) < 2e-2, _rel(g, rg)


def test_persistent_masked_forward_auto_takes_sliding_windows():
    """fwd_persistent_masked=None (auto) puts sliding-window data masks on the persistent forward (even walks, which
    its static deal balances) and leaves documents and padding (uneven walks) one CTA per query tile; True / False
    force it; split head dims, head dims whose buffers do not fit, and (under auto) head dims its GPU test did not
    run stay on the grid kernel."""
    from pallas_kernels.flash_attention_hopper.config import default_config, persistent_masked_chosen

    cfg = default_config(128, 1024, False, 1024)
    assert persistent_masked_chosen(cfg, 128, 128, BF, (128, 0))
    assert persistent_masked_chosen(cfg, 128, 128, BF, (-1, 64))
    assert not persistent_masked_chosen(cfg, 128, 128, BF)
    assert persistent_masked_chosen(dataclasses.replace(cfg, fwd_persistent_masked=True), 128, 128, BF)
    assert not persistent_masked_chosen(dataclasses.replace(cfg, fwd_persistent_masked=False), 128, 128, BF, (128, 0))
    assert not persistent_masked_chosen(default_config(192, 1024, False, 1024, head_dim_v=128), 192, 128, BF, (128, 0))
    assert not persistent_masked_chosen(default_config(256, 1024, False, 1024), 256, 256, BF, (128, 0))
    hd96 = default_config(96, 1024, False, 1024)  # fits, but auto keeps to the GPU-checked head dims
    assert not persistent_masked_chosen(hd96, 96, 96, BF, (128, 0))
    assert persistent_masked_chosen(dataclasses.replace(hd96, fwd_persistent_masked=True), 96, 96, BF)


def test_snake_deal_gives_every_tile_once():
    """snake_tile / tiles_of_cta (the persistent data-mask forward's deal, pure int arithmetic): every query tile
    goes to exactly one CTA, whatever the tile and CTA counts; snake_coords names each once as (batch, head, tile),
    traced or not."""
    from pallas_kernels.flash_attention_hopper.persistent_steps import snake_coords, snake_tile, tiles_of_cta

    for n_tiles, n_ctas in [(10, 3), (12, 3), (7, 7), (5, 132), (2048, 132), (265, 132)]:
        n_ctas = min(n_ctas, n_tiles)
        got = [int(snake_tile(c, i, n_ctas)) for c in range(n_ctas)
               for i in range(int(tiles_of_cta(c, n_tiles, n_ctas)))]
        assert sorted(got) == list(range(n_tiles)), (n_tiles, n_ctas)
    batch, heads, per_head = 3, 4, 5
    n, n_ctas = batch * heads * per_head, 7
    coords = jax.jit(lambda c, i: snake_coords(c, i, n_ctas, heads, per_head))
    got = sorted(tuple(int(x) for x in coords(jnp.int32(c), jnp.int32(i))) for c in range(n_ctas)
                 for i in range(int(tiles_of_cta(c, n, n_ctas))))
    assert got == [(b, h, t) for b in range(batch) for h in range(heads) for t in range(per_head)]


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name,aligned,head_dims", [
    ("documents_causal", False, (192, 128)), ("padding", False, (192, 128)), ("window_causal_hd64", False, (192, 128)),
    ("documents_causal", True, (192, 128)),
    ("documents_causal", False, (176, 176)), ("documents_causal", False, (160, 160))],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
# (176/176: its dQ kernel takes XLA's delta, the marks leaving no room for O's tiles; 160/160: dK and dV in one launch)
def test_data_mask_split_head_dims(name, aligned, head_dims):
    """A data mask with q/k head_dim 192 and v head_dim 128 (DeepSeek-V3's geometry with packed documents, padding,
    a window; documents on aligned tiles too), 176/176 and 160/160: out, lse, dq, dk, dv against the fp32 reference with the
    same mask (_check_data_mask)."""
    _check_data_mask(name, head_dims=head_dims, mask_aligned=aligned)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name", ["documents_causal", "window_causal_hd64"])
def test_data_mask_split_head_dims_one_dkv_launch(name):
    """192/128 under a data mask and a band with dK and dV in one launch on 32-row query blocks (not auto under
    masks, but a config may ask for it): against the fp32 reference (_check_data_mask)."""
    from pallas_kernels.flash_attention_hopper.config import default_config

    B, Sq, Skv, H, G, D, mask, _ = _masked_case(name)
    cfg = dataclasses.replace(default_config(192, -(-Skv // 128) * 128, False, -(-Sq // 128) * 128, head_dim_v=128),
                              bwd_dkv_together=True, bwd_dkv_block_q=32)
    _check_data_mask(name, head_dims=(192, 128), config=cfg)


def _check_tables(m, cfg, segments=True):
    """mask_tables(m) against m's dense mask: each tile's block list holds every block with a visible (query, key)
    pair, each once, the blocks after the partial ones all fully visible; for the forward's, the dQ kernel's and the
    dK/dV kernel's (transposed) tiles.  Their partial blocks are grouped by MaskRule.partial_rules (the backward's
    by data_mask.backward_rule's): on each listed tile its group's element mask hides exactly the pairs the dense
    mask hides.  -> the group sizes summed over the lists that are grouped."""
    from pallas_kernels.flash_attention_hopper.config import dkv_block_q
    from pallas_kernels.flash_attention_hopper.data_mask import backward_rule, mask_rule, mask_tables

    B, pq, pkv = m.batch, m.q_len, m.kv_len
    t = jax.jit(lambda m: mask_tables(m, cfg, segments=segments))(m)
    dense = np.asarray(m.dense())
    qseg = np.where(np.asarray(m.q_segment_ids) == 0, np.iinfo(np.int32).min, m.q_segment_ids)  # padding queries
    np.testing.assert_array_equal(np.asarray(t.qm), np.stack([qseg, m.q_positions], 1))
    rules = mask_rule(m, segments).partial_rules()
    bwd_groups = len(backward_rule(mask_rule(m, segments)).partial_rules())
    marks = [jnp.asarray(a) for a in (qseg, m.q_positions, m.kv_segment_ids, m.kv_positions)]
    by_group = [np.stack([np.asarray(r.apply(jnp.ones(dense.shape[1:]), (marks[0][b], marks[1][b]),
                                             (marks[2][b], marks[3][b]), 0.0, q_axis=0)) > 0 for b in range(B)])
                for r in rules]
    sizes = np.zeros(len(rules), int)
    for (counts, blocks), qt, kt, transposed, n_groups in (
            (t.fwd, 2 * cfg.block_q, cfg.block_kv, False, len(rules)),
            (t.dq, cfg.bwd_wgs * cfg.bwd_block_q, cfg.bwd_block_kv, False, bwd_groups),
            (t.dkv, dkv_block_q(cfg), cfg.bwd_wgs * cfg.bwd_block_kv, True, bwd_groups)):
        counts, blocks = np.asarray(counts), np.asarray(blocks)

        def cut(x):  # [B, nq, nk, qt, kt], or per key tile [B, nk, nq, kt, qt]
            x = x.reshape(B, pq // qt, qt, pkv // kt, kt).transpose(0, 1, 3, 2, 4)
            return x.transpose(0, 2, 1, 4, 3) if transposed else x

        tiles = cut(dense)
        any_seen, all_seen = tiles.any((-1, -2)), tiles.all((-1, -2))
        assert counts.shape == any_seen.shape[:2] + (n_groups + 1,) and blocks.shape == any_seen.shape
        for b in range(B):
            for r in range(any_seen.shape[1]):
                n = counts[b, r, -1]
                listed = blocks[b, r, :n]
                assert len(set(listed.tolist())) == n
                assert set(np.flatnonzero(any_seen[b, r])) <= set(listed.tolist())
                assert all_seen[b, r, listed[counts[b, r, -2]:]].all()
                if n_groups > 1:
                    start = 0
                    for g in range(n_groups):
                        for blk in listed[start:counts[b, r, g]]:
                            np.testing.assert_array_equal(cut(by_group[g])[b, r, blk], tiles[b, r, blk])
                        sizes[g] += counts[b, r, g] - start
                        start = counts[b, r, g]
    return sizes


@pytest.mark.parametrize("name", MASKED_CASES)
def test_data_mask_tables_list_the_visible_tiles(name):
    """mask_tables (CPU) against the dense mask (_check_tables), for each data-mask case."""
    from pallas_kernels.flash_attention_hopper.config import default_config

    B, Sq, Skv, H, G, D, mask, _ = _masked_case(name)
    pq, pkv = -(-Sq // 128) * 128, -(-Skv // 128) * 128
    sizes = _check_tables(mask.pad(pq, pkv), default_config(D, pkv, False, pq))
    if name == "documents_causal":  # every group has tiles: the diagonal, a document's start, both
        assert len(sizes) == 3 and sizes.min() > 0, sizes


@pytest.mark.parametrize("seed", range(3))
def test_data_mask_tables_on_random_documents(seed, monkeypatch):
    """_check_tables on random packed documents (lengths 1 to 300, padding after them) under causal (top-left and
    bottom-right), windows and no position rule, and with segment ids past partial_kinds' bounds (no tile then
    compares segments only), the backward's lists grouped too. With a left window no tile that mixes documents can
    be proved segments-only (the combined marks of two documents lie 2^21 apart), so those compare both."""
    import dataclasses

    from pallas_kernels.flash_attention_hopper.config import default_config
    from pallas_kernels.mask import AttentionMask

    rng = np.random.default_rng(seed)
    S = 512
    seg = np.zeros((2, S), np.int32)
    for b in range(2):
        lens = rng.integers(1, 300, 8)
        seg[b] = _runs(list(lens[np.cumsum(lens) <= S - 20]), S)
    cfg = dataclasses.replace(default_config(128, S, False, S), block_q=64, block_kv=64)
    for kw in (dict(causal=True), dict(causal=True, bottom_right=True), dict(causal=True, window=(100, 0)),
               dict(window=(40, 70)), dict()):
        m = AttentionMask.from_segments(seg, **kw)
        sizes = _check_tables(m, cfg)
        if kw.get("causal") and "window" not in kw:  # (a left window across documents fails the g proof)
            assert sizes[1] > 0, (kw, sizes)  # some tile compares segments only
    big = AttentionMask.from_segments(np.where(seg > 0, seg + 5000, 0), causal=True)
    assert _check_tables(big, cfg)[1] == 0
    # the backward's lists grouped too (the kernels walk them; data_mask.BACKWARD_SPLIT is off by measurement)
    from pallas_kernels.flash_attention_hopper import data_mask
    monkeypatch.setattr(data_mask, "BACKWARD_SPLIT", True)
    _check_tables(AttentionMask.from_segments(seg, causal=True), cfg)
    # 32-row dK/dV query blocks (HopperConfig.bwd_dkv_block_q): the key tiles' lists at that grain
    _check_tables(AttentionMask.from_segments(seg, causal=True, window=(100, 0)),
                  dataclasses.replace(cfg, bwd_dkv_block_q=32))


def test_list_kernel_gives_the_xla_lists():
    """data_mask.tile_lists(kernel=True) (list_kernel: one Triton program per row, interpreted here) against XLA's
    lists on random packed documents with padding, under causal (bottom-right; top-left with segment ids past
    partial_kinds' bounds), windows, rules of one group, and more keys than queries: the same counts, the same listed
    blocks,
    and every block once per row (the unlisted ones after the list, as the stable sort places them); for the
    forward's, the dQ kernel's and the dK/dV kernel's (transposed) tiles, on the global grid and on aligned tiles."""
    from pallas_kernels.flash_attention_hopper import aligned_tiles, list_kernel
    from pallas_kernels.flash_attention_hopper.data_mask import backward_rule, mask_rule, tile_lists, token_marks
    from pallas_kernels.flash_attention_hopper.data_mask import marks_only
    from pallas_kernels.mask import AttentionMask

    rng = np.random.default_rng(5)
    S = 512
    seg = np.zeros((2, S), np.int32)
    for b in range(2):
        lens = rng.integers(1, 300, 8)
        seg[b] = _runs(list(lens[np.cumsum(lens) <= S - 20]), S)
    cases = [(seg, dict(causal=True, bottom_right=True)), (seg, dict(window=(40, 70))),
             (np.where(seg > 0, seg + 5000, 0), dict(causal=True))]
    kv_seg = np.concatenate([seg, seg[:, :128]], axis=1)  # 640 keys against 512 queries: rows and blocks differ
    masks = [AttentionMask.from_segments(s, **kw) for s, kw in cases] + [
        AttentionMask.full(2, 256, 640, causal=True, bottom_right=True),
        AttentionMask.from_segments(seg, kv_seg, causal=True, bottom_right=True)]
    for m in masks:
        for i, rule in enumerate((mask_rule(m), backward_rule(mask_rule(m)))):  # grouped (where it compares both), one
            for marks in (token_marks(marks_only(m)), None)[:2 - i]:  # aligned tiles' padded layout: the first rule
                if marks is None:  # the padded layout of document-aligned tiles
                    a = aligned_tiles.aligned_tables((m.q_segment_ids, m.q_positions, m.kv_segment_ids,
                                                      m.kv_positions), rule, 128, 64)
                    marks = (jnp.where(a.qm[:, 0] < 0, 0, a.qm[:, 0]), a.qm[:, 1], a.km[:, 0], a.km[:, 1])
                for q_tile, kv_tile, transposed in ((128, 64, False), (64, 128, True)):
                    qs, qp, ks, kp = marks
                    if qs.shape[1] % q_tile or ks.shape[1] % kv_tile:
                        continue
                    want = tile_lists(qs, qp, ks, kp, rule, q_tile, kv_tile, transposed)
                    got = tile_lists(qs, qp, ks, kp, rule, q_tile, kv_tile, transposed, kernel=True)
                    counts, blocks = (np.asarray(x) for x in got)
                    np.testing.assert_array_equal(counts, np.asarray(want[0]), err_msg=str((m.causal, m.window, rule)))
                    visible = counts[..., -1]
                    for r in np.ndindex(visible.shape):
                        np.testing.assert_array_equal(blocks[r][:visible[r]], np.asarray(want[1])[r][:visible[r]])
                        assert sorted(blocks[r].tolist()) == list(range(blocks.shape[-1]))
    # HopperConfig.lists_kernel reaches every table: the grid's forward, dQ and dK/dV lists, and the aligned ones
    import dataclasses

    from pallas_kernels.flash_attention_hopper.config import default_config
    from pallas_kernels.flash_attention_hopper.data_mask import mask_tables

    m = AttentionMask.from_segments(seg, causal=True)
    cfg = dataclasses.replace(default_config(128, S, False, S), block_q=64, block_kv=64)
    build = lambda c: (mask_tables(m, c), aligned_tiles.aligned_backward_tables(
        aligned_tiles.aligned_mask_tables(m, c, backward=False), mask_rule(m), c))
    calls = []
    orig = list_kernel.block_lists_kernel
    list_kernel.block_lists_kernel = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        on = build(dataclasses.replace(cfg, lists_kernel=True))
    finally:
        list_kernel.block_lists_kernel = orig
    off = build(cfg)
    assert len(calls) == 6  # fwd, dq, dkv on the grid and on aligned tiles
    for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
        assert a.shape == b.shape


def test_block_lists_kernel_refuses_what_it_cannot_list():
    """list_kernel.block_lists_kernel: more blocks per row than MAX_COLS, or a grouped rule without its marks, is a
    ValueError naming what was seen and what it takes (tile_lists falls back to XLA's lists before either)."""
    from pallas_kernels.flash_attention_hopper.data_mask import MaskRule, partial_kinds
    from pallas_kernels.flash_attention_hopper.list_kernel import MAX_COLS, block_lists_kernel
    from pallas_kernels.mask import TileStats

    stats = lambda n: TileStats(*(jnp.zeros((1, n), jnp.int32),) * 4, jnp.ones((1, n), bool))
    one_group = MaskRule(True, (-1, -1), split=False)
    with pytest.raises(ValueError, match=f"{MAX_COLS + 1} blocks per row; the kernel takes at most {MAX_COLS}"):
        block_lists_kernel(stats(4), stats(MAX_COLS + 1), None, None, None, one_group, transposed=False)
    grouped = MaskRule(True, (-1, -1))
    assert len(grouped.partial_rules()) > 1
    with pytest.raises(ValueError, match="needs row_marks, col_marks, fits and kinds"):
        block_lists_kernel(stats(4), stats(8), None, None, None, grouped, transposed=False, kinds=partial_kinds)


def test_lists_kernel_auto_on_the_gpu_only(monkeypatch):
    """HopperConfig.lists_kernel None (auto) takes list_kernel where Pallas compiles (a GPU) and XLA's lists where it
    interprets; True / False force either."""
    import dataclasses

    from pallas_kernels.flash_attention_hopper import data_mask
    from pallas_kernels.flash_attention_hopper.config import default_config

    cfg = default_config(128, 1024, False, 1024)
    for interpreting, want in ((True, False), (False, True)):
        monkeypatch.setattr(data_mask, "default_interpret", lambda v=interpreting: v)
        assert data_mask.lists_by_kernel(cfg) is want
        for forced in (True, False):
            assert data_mask.lists_by_kernel(dataclasses.replace(cfg, lists_kernel=forced)) is forced


def test_block_lists_one_hot_and_sort_agree(monkeypatch):
    """block_lists: partial blocks first, then full ones, each group in index order, built the same by the one-hot
    sum (short rows) and the stable sort (long rows); counts = (partial, visible)."""
    from pallas_kernels.flash_attention_hopper import data_mask

    rng = np.random.default_rng(0)
    classes = jnp.asarray(rng.integers(0, 3, (3, 5, 40)), jnp.int8)
    groups = jnp.asarray(rng.integers(0, 3, (3, 5, 40)), jnp.int32)
    for grouped in (False, True):
        args = (classes, groups, 3) if grouped else (classes,)
        monkeypatch.setattr(data_mask, "ONE_HOT_MAX", 256)
        counts, blocks = data_mask.block_lists(*args)
        monkeypatch.setattr(data_mask, "ONE_HOT_MAX", 8)
        counts2, blocks2 = data_mask.block_lists(*args)
        c, g = np.asarray(classes), np.asarray(groups if grouped else jnp.zeros_like(groups))
        for r in np.ndindex(c.shape[:-1]):
            parts = [np.flatnonzero((c[r] == 1) & (g[r] == j)) for j in range(3 if grouped else 1)]
            want = np.concatenate(parts + [np.flatnonzero(c[r] == 2)])
            ends = tuple(np.cumsum([len(p) for p in parts])) + (len(want),)
            assert tuple(np.asarray(counts)[r]) == ends == tuple(np.asarray(counts2)[r])
            np.testing.assert_array_equal(np.asarray(blocks)[r][:len(want)], want)
            np.testing.assert_array_equal(np.asarray(blocks2)[r][:len(want)], want)


def test_one_step_tiles_stay_off_the_persistent_forward():
    """config.persistent_chosen: the non-causal persistent forward needs two K/V steps per tile (one-step tiles with
    an uneven tile count per CTA gave zero output tiles on the H100); the explanation says why."""
    from pallas_kernels.flash_attention_hopper.config import default_config, describe_plan, persistent_chosen

    cfg = default_config(64)  # 256-key blocks
    assert not persistent_chosen(cfg, 256, 64, BF) and persistent_chosen(cfg, 512, 64, BF)
    assert not persistent_chosen(default_config(128), 128, 128, BF) and persistent_chosen(default_config(128), 256,
                                                                                          128, BF)
    assert "one K/V step per tile" in describe_plan(64, 256, False, BF, cfg)
    assert "persistent grid" in describe_plan(64, 512, False, BF, cfg)


def test_data_mask_bad_arguments_are_named():
    """hopper_attention(mask=...) refuses, before any kernel: a mask built for other lengths (both shapes named, and
    the fix), causal given twice, a mask that is not an AttentionMask, and the data-mask options without a mask."""
    from pallas_kernels.mask import AttentionMask

    q = jnp.zeros((2, 256, 2, 128), BF)
    k = jnp.zeros((2, 384, 2, 128), BF)
    with pytest.raises(ValueError, match=r"mask is for \[batch, q_len, kv_len\] = \[2, 256, 256\], q/k are "
                                         r"\[2, 256, 384\]\. Fix: build the AttentionMask"):
        hopper_attention(q, k, k, scale=0.1, mask=AttentionMask.full(2, 256, 256))
    with pytest.raises(ValueError, match="pass causal in the mask"):
        hopper_attention(q, k, k, scale=0.1, causal=True, mask=AttentionMask.full(2, 256, 384, causal=True))
    with pytest.raises(ValueError, match="mask=ndarray must be a pallas_kernels.mask.AttentionMask"):
        hopper_attention(q, k, k, scale=0.1, mask=np.ones((2, 256, 384), bool))
    for kw in (dict(mask_aligned=True), dict(mask_segments=False)):  # data-mask options without a data mask
        with pytest.raises(ValueError, match="apply to a data mask, and mask=None. Fix: pass mask=AttentionMask"):
            hopper_attention(q, k, k, scale=0.1, **kw)


def test_split_head_dims_config_and_plan():
    """192/128 takes 128-key forward blocks with each O tile inside its Q tile (o_tiles_in_q: 208 KB of shared
    memory at two stages) and one dK/dV launch (causal with 32-row query blocks, non-causal with 240 registers);
    other splits and 192/192 keep 64-key blocks and two dK / dV launches; the plan names the split and the
    backward's launches."""
    from pallas_kernels.flash_attention_hopper.config import dkv_block_q, dkv_together
    from pallas_kernels.flash_attention_hopper.config import default_config, describe_plan
    from pallas_kernels.flash_attention_hopper.forward_step import o_tiles_in_q

    assert default_config(192, 4096, True, head_dim_v=128).block_kv == 128
    assert default_config(192, 4096, True, head_dim_v=128).bwd_wgs == 2
    assert default_config(192, 4096, True).block_kv == 64 and default_config(192).bwd_wgs == 2
    assert (dataclasses.asdict(default_config(64, 4096, False, head_dim_v=128))
            == dataclasses.asdict(default_config(128, 4096, False)))
    assert o_tiles_in_q(64, 192, 128, BF) and not o_tiles_in_q(64, 64, 128, BF) and not o_tiles_in_q(64, 128, 128, BF)
    plan = describe_plan(192, 4096, True, BF, head_dim_v=128)
    assert "split head dims 192/128" in plan and "block_kv 128" in plan and "inside its Q tile" in plan, plan
    assert "dK and dV in one launch (32-row query blocks)" in plan and "separate dQ" in plan, plan
    causal, full = default_config(192, 4096, True, head_dim_v=128), default_config(192, 4096, False, head_dim_v=128)
    assert dkv_together(causal, 192, 128) and dkv_block_q(causal) == 32 and causal.bwd_block_q == 64
    assert dkv_together(full, 192, 128) and dkv_block_q(full) == 64 and full.bwd_compute_registers == 240
    assert "one launch (64-row" in describe_plan(192, 4096, False, BF, head_dim_v=128)
    for c in (True, False):  # 160/160 (the accumulators of 192/128): one launch on 32-row blocks, 240 registers
        cfg = default_config(160, 4096, c)
        assert dkv_together(cfg, 160, 160) and dkv_block_q(cfg) == 32 and cfg.bwd_compute_registers == 240
    assert "dK and dV in one launch (32-row" in describe_plan(160, 4096, True, BF)
    for d, dv in ((192, 192), (256, 256), (128, 192), (256, 128)):
        cfg = default_config(d, 4096, True, head_dim_v=dv)
        assert not dkv_together(cfg, d, dv), (d, dv)
        assert "two launches" in describe_plan(d, 4096, True, BF, head_dim_v=dv) or d == dv
    assert dkv_together(default_config(128), 128, 128) and dkv_together(default_config(64, head_dim_v=128), 64, 128)
    assert not dkv_together(dataclasses.replace(causal, bwd_dkv_together=False), 192, 128)
    assert not dkv_together(full, 192, 128, masked=True) and dkv_together(default_config(128), 128, 128, True)
    masked = default_config(192, 4096, False, 4096, head_dim_v=128, masked=True)  # documents, windows: 32-row
    assert dkv_block_q(masked) == 32 and dkv_together(masked, 192, 128, masked=True)
    # what hopper_attention(mask=...) and te_jax's explanation take: the padded lengths, masked
    from pallas_kernels.flash_attention_hopper import masked_config

    assert masked_config(192, 128, 4000, 4000) == masked
    assert masked_config(128, 128, 300, 1000) == default_config(128, 1024, False, 384, head_dim_v=128, masked=True)
    assert not dkv_together(default_config(192, 4096, False, 4096, masked=True), 192, 192, masked=True)
    assert "in its own tile" in describe_plan(64, 4096, False, BF, head_dim_v=128)
    with pytest.raises(ValueError, match="bwd_dkv_block_q"):
        dataclasses.replace(causal, bwd_dkv_block_q=48)
    with pytest.raises(ValueError, match="bwd_dkv_together"):
        dataclasses.replace(causal, bwd_dkv_together=1)


def test_swizzle_follows_the_tile_row():
    """Shared-memory tiles take the widest swizzle (up to a cap) that divides their row: 128 bytes at head dims
    64/128/192/256,
    64 at 96/160, 32 at 80/112/16; a row that is no multiple of 32 bytes is refused by name."""
    from pallas_kernels.flash_attention_hopper.common import swizzle_for

    assert [swizzle_for(d, BF) for d in (64, 128, 192, 256)] == [128] * 4
    assert [swizzle_for(d, BF) for d in (96, 160, 32)] == [64] * 3
    assert [swizzle_for(d, BF) for d in (80, 112, 16)] == [32] * 3
    assert swizzle_for(64, jnp.float32) == 128 and swizzle_for(24, jnp.float32) == 32
    # capped (a wgmma contracting over 32 rows: the dK/dV kernel's 32-row query blocks)
    assert [swizzle_for(d, BF, most=64) for d in (192, 128, 96, 80)] == [64, 64, 64, 32]
    with pytest.raises(ValueError, match="72 x bfloat16 .144 bytes. is not a multiple of 32 bytes"):
        swizzle_for(72, BF)
