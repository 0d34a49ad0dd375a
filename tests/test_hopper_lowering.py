"""The GPU kernels lower for CUDA on the CPU: every Hopper (Mosaic GPU) attention variant, forward and backward,
the FP8 block GEMM and the Triton-lowered kernels beside them, through JAX's Mosaic GPU / Triton lowering with
`lowering_platforms=("cuda",)`.

CI has no GPU and no Mosaic GPU interpreter (jax 0.10.2), so this is the only place a CPU run reaches the Mosaic
GPU lowering: layouts, wgmma shapes and swizzles, shared-memory refs, barriers. It does not compile with ptxas or
run anything: numerics are the GPU tests' (test_flash_attention_hopper.py on an sm90 machine). The named-barrier
paths use inline PTX, which jax 0.10.2's Mosaic GPU lacks: there they are switched off (NO_PTX); on jax >= 0.11
both forms lower.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention_hopper import hopper_attention
from pallas_kernels.flash_attention_hopper.config import default_config
from pallas_kernels.mask import AttentionMask

from jaxpr_walk import warp_map_primitives

BF = jnp.bfloat16
NO_PTX = dict(fwd_named_barrier=False, fwd_named_release=False, fwd_producer_warp=False,
              bwd_named_release=False, bwd_producer_warp=False)


def _has_inline_ptx() -> bool:
    from jax.experimental.mosaic.gpu import utils

    return hasattr(utils, "inline_ptx")


PTX_FORMS = [NO_PTX] + ([{}] if _has_inline_ptx() else [])


def _lower(f, *shapes):
    """Lower jit(f) for CUDA on this (CPU) machine; returns the module's text length (> 0)."""
    lowered = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",))
    return len(lowered.as_text())


def _attention_fwd_bwd(S, D, Dv, *, causal=False, Skv=None, H=2, G=1, mask=None, softcap=None, dtype=BF,
                       mask_segments=True, mask_aligned=False, mask_offset=None, **cfg_kw):
    Skv = Skv or S
    pq, pkv = -(-S // 128) * 128, -(-Skv // 128) * 128
    cfg = dataclasses.replace(default_config(D, pkv, causal, pq, head_dim_v=Dv), **cfg_kw)
    q = jax.ShapeDtypeStruct((1, S, H, D), dtype)
    k = jax.ShapeDtypeStruct((1, Skv, G, D), dtype)
    v = jax.ShapeDtypeStruct((1, Skv, G, Dv), dtype)

    def f(q, k, v):
        (o, lse), vjp = jax.vjp(lambda q, k, v: hopper_attention(q, k, v, scale=0.1, causal=causal, mask=mask,
                                                                 softcap=softcap, interpret=False, config=cfg,
                                                                 mask_segments=mask_segments,
                                                                 mask_aligned=mask_aligned, mask_offset=mask_offset),
                                q, k, v)
        return o, lse, vjp((o, jnp.zeros_like(lse)))

    return _lower(f, q, k, v)


CASES = {  # name: keyword arguments of _attention_fwd_bwd
    "hd128": dict(S=512, D=128, Dv=128),
    "hd128 causal": dict(S=512, D=128, Dv=128, causal=True),
    "hd64 causal gqa": dict(S=512, D=64, Dv=64, causal=True, H=4, G=2),
    "hd256 softcap": dict(S=256, D=256, Dv=256, softcap=2.0),
    "192/128 causal": dict(S=512, D=192, Dv=128, causal=True),
    "192/128": dict(S=384, D=192, Dv=128),
    "192/128 causal, dK and dV in one launch": dict(S=512, D=192, Dv=128, causal=True, bwd_dkv_together=True),
    "192/128, dK and dV in one launch": dict(S=384, D=192, Dv=128, bwd_dkv_together=True),
    "192/128 causal, one launch, 32-row query blocks (64-byte swizzle)": dict(
        S=512, D=192, Dv=128, causal=True, bwd_dkv_together=True, bwd_dkv_block_q=32),
    "128 causal, 32-row dK/dV query blocks": dict(S=256, D=128, Dv=128, causal=True, bwd_dkv_block_q=32),
    "64/128 (v wider)": dict(S=256, D=64, Dv=128),
    "128/192 (v wider, separate O tile)": dict(S=256, D=128, Dv=192, causal=True),
    "256/128": dict(S=256, D=256, Dv=128),
    "96 (64-byte swizzle)": dict(S=384, D=96, Dv=96),
    "80 causal (32-byte swizzle)": dict(S=256, D=80, Dv=80, causal=True),
    "160 softcap ragged": dict(S=300, D=160, Dv=160, causal=True, softcap=2.0),
    "ragged kv (padded keys masked)": dict(S=129, D=128, Dv=128, Skv=1000),
    "atomic dQ": dict(S=512, D=128, Dv=128, bwd_dq_atomic=True),
    "delta from XLA (bwd_delta_in_dq=False)": dict(S=512, D=128, Dv=128, causal=True, bwd_delta_in_dq=False),
    "grid forward": dict(S=512, D=128, Dv=128, causal=True, fwd_persistent=False, fwd_persistent_causal=False),
    "stream-K tails (fwd and bwd)": dict(S=512, D=128, Dv=128, fwd_ctas=3, fwd_split_tail=True, bwd_ctas=3,
                                         bwd_split_tail=True),
    "fp16": dict(S=256, D=128, Dv=128, dtype=jnp.float16),
}


@pytest.mark.parametrize("ptx", PTX_FORMS, ids=lambda p: "no-ptx" if p else "ptx")
@pytest.mark.parametrize("name", list(CASES))
def test_hopper_attention_lowers_for_cuda(name, ptx):
    if name == "atomic dQ" and not _has_inline_ptx():
        # jax 0.10.2 cannot lower the dQ buffer's jax.new_ref inside the custom VJP's backward under jit
        # ("JaxprInputEffect ... does not have a corresponding jaxpr input"); jax 0.11 (the GPU machine's) does.
        pytest.skip("jax 0.10.2 cannot lower a jax.new_ref in a custom VJP backward under jit (jax >= 0.11 can)")
    assert _attention_fwd_bwd(**CASES[name], **ptx) > 0


def test_every_head_dim_lowers_within_shared_memory():
    """Every head dim that is a multiple of 16 up to 256, with v's head dim equal or 128 (64 below 64), causal and
    not: the default configs' forward and backward lower, which includes Mosaic GPU's check of each kernel's shared
    memory against the H100's 227 KB (192/192's dQ kernel asked 251 KB before delta_in_dq checked it)."""
    failed = []
    for d in range(16, 257, 16):
        for dv in sorted({d, 128 if d >= 64 else 64}):
            for causal in (False, True):
                try:
                    _attention_fwd_bwd(256, d, dv, causal=causal, **NO_PTX)
                except Exception as e:  # collect every geometry that fails, not only the first
                    failed.append((d, dv, causal, str(e).split("\n")[0][:160]))
    assert not failed, failed


def test_every_head_dim_lowers_under_a_data_mask():
    """The same under packed documents (the data-mask kernels, whose marks take shared memory too: 176/176's dQ
    kernel with delta asked 232640 bytes before delta_in_dq counted them), head dims 64 to 256 in steps of 16."""
    mask = AttentionMask.from_segments(_segments(100, 1, 250, 189, total=600), causal=True)
    failed = []
    for d in range(64, 257, 16):
        try:
            _attention_fwd_bwd(mask.q_len, d, d, Skv=mask.kv_len, mask=mask, **NO_PTX)
        except Exception as e:  # collect every geometry that fails
            failed.append((d, str(e).split("\n")[0][:160]))
    assert not failed, failed


def _segments(*runs, total):
    ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(runs)])
    return np.pad(ids, (0, total - ids.size))[None]


@pytest.mark.parametrize("ptx", PTX_FORMS, ids=lambda p: "no-ptx" if p else "ptx")
@pytest.mark.parametrize("name,D,Dv,cfg_kw", [
    ("documents", 128, 128, {}), ("window", 128, 128, {}), ("bottom right", 128, 128, {}),
    ("documents", 192, 128, {}), ("window", 96, 96, {}), ("documents", 64, 128, {}),
    # one dK/dV launch on 32-row query blocks under a mask (tables and band walks at that grain)
    ("documents", 192, 128, dict(bwd_dkv_together=True, bwd_dkv_block_q=32)),
    ("window", 192, 128, dict(bwd_dkv_together=True, bwd_dkv_block_q=32))])
def test_hopper_data_mask_lowers_for_cuda(name, D, Dv, cfg_kw, ptx):
    mask = {"documents": AttentionMask.from_segments(_segments(100, 1, 250, 189, total=600), causal=True),
            "window": AttentionMask.full(1, 512, 512, causal=True, window=(128, 0)),
            "bottom right": AttentionMask.full(1, 256, 640, causal=True, bottom_right=True)}[name]
    # one-segment masks (window, bottom right) lower as the front door runs them: positions compared only
    assert _attention_fwd_bwd(mask.q_len, D, Dv, Skv=mask.kv_len, mask=mask, mask_segments=name == "documents",
                              **cfg_kw, **ptx) > 0


@pytest.mark.parametrize("ptx", PTX_FORMS, ids=lambda p: "no-ptx" if p else "ptx")
@pytest.mark.parametrize("name,cfg_kw", [("window", dict(bwd_dq_atomic=False)), ("bottom right", {}),
                                         ("window", dict(D=192, Dv=128)), ("bottom right", dict(bwd_dq_atomic=True)),
                                         ("window", dict(D=256, Dv=256, softcap=2.0)), ("bottom right", dict(D=64, Dv=64)),
                                         ("rows that see no key", {}),
                                         ("window", dict(bwd_persistent_band=True, bwd_ctas=3)),
                                         ("window", dict(bwd_persistent_band=True, D=64, Dv=64, softcap=2.0)),
                                         ("bottom right", dict(bwd_persistent_band=True, bwd_dq_atomic=False)),
                                         ("window", dict(fwd_persistent_band=True, fwd_ctas=3, softcap=2.0)),
                                         ("bottom right", dict(fwd_persistent_band=True, D=64, Dv=64)),
                                         ("window", dict(fwd_band_heavy_first=False))])
def test_hopper_band_kernels_lower_for_cuda(name, cfg_kw, ptx):
    """One-segment masks with positions as token indices (mask_offset): the band forward and the band backward, with
    the dQ kernel and with the atomic dQ in the dK/dV kernel (jax >= 0.11), at several head dims; a band that leaves
    queries without a key takes the data-mask forward with the band backward; the persistent band dK/dV kernel
    (bwd_persistent_band) and forward (fwd_persistent_band), on 3 CTAs: several tiles per CTA."""
    cfg_kw = dict(cfg_kw)
    D, Dv = cfg_kw.pop("D", 128), cfg_kw.pop("Dv", 128)
    softcap = cfg_kw.pop("softcap", None)
    mask, offset = {"window": (AttentionMask.full(1, 512, 512, causal=True, window=(128, 0)), 0),
                    "bottom right": (AttentionMask.full(1, 256, 640, causal=True, bottom_right=True), 384),
                    "rows that see no key": (AttentionMask.full(1, 640, 256, causal=True, bottom_right=True), -384),
                    }[name]
    if cfg_kw.get("bwd_dq_atomic") and not _has_inline_ptx():
        pytest.skip("jax 0.10.2 cannot lower a jax.new_ref in a custom VJP backward under jit (jax >= 0.11 can)")
    assert _attention_fwd_bwd(mask.q_len, D, Dv, Skv=mask.kv_len, mask=mask, mask_segments=False,
                              mask_offset=offset, softcap=softcap, **cfg_kw, **ptx) > 0


@pytest.mark.parametrize("ptx", PTX_FORMS, ids=lambda p: "no-ptx" if p else "ptx")
@pytest.mark.parametrize("D,Dv,bwd", [(128, 128, dict(bwd_aligned=False)), (192, 128, dict(bwd_aligned=False)),
                                      (128, 128, {}), (128, 128, dict(bwd_aligned=True, bwd_delta_in_dq=False)),
                                      (192, 128, {})],
                         ids=["128 grid bwd", "192/128 grid bwd", "128 aligned bwd", "128 aligned bwd, XLA delta",
                              "192/128 aligned bwd"])
def test_hopper_aligned_data_mask_forward_lowers_for_cuda(D, Dv, bwd, ptx):
    """The forward on document-aligned tiles (aligned_tiles: Q and K/V loaded at the documents' rows, O stored in
    token order by plan, the shared groups merged), with the grid's backward (bwd_aligned=False) or the backward's
    kernels on aligned tiles too (bwd_aligned auto, or forced)."""
    mask = AttentionMask.from_segments(_segments(100, 1, 250, 189, total=600), causal=True)
    assert _attention_fwd_bwd(mask.q_len, D, Dv, mask=mask, mask_aligned=True, **bwd, **ptx) > 0


@pytest.mark.parametrize("aligned", [False, True])
def test_attention_with_the_lists_kernel_lowers_for_cuda(aligned):
    """A documents mask's forward and backward with HopperConfig.lists_kernel (the tables' lists from list_kernel,
    Triton) on the grid's tiles and on aligned tiles, lowered for CUDA as one program."""
    mask = AttentionMask.from_segments(_segments(100, 1, 250, 189, total=768), causal=True)
    assert _attention_fwd_bwd(mask.q_len, 128, 128, mask=mask, mask_aligned=aligned, lists_kernel=True,
                              **NO_PTX) > 0


@pytest.mark.parametrize("case", ["dense causal", "aligned documents", "persistent data mask"])
def test_exit_wait_setting_reaches_the_kernels(case):
    """HopperConfig.exit_wait_read_only changes what every kernel of the call lowers to (the CTAs' last TMA stores
    waited for until read, or until written): the field is not dropped on the way to the kernels."""
    kw = {"dense causal": dict(S=512, D=128, Dv=128, causal=True),
          "aligned documents": dict(D=128, Dv=128, mask_aligned=True),
          "persistent data mask": dict(D=128, Dv=128, fwd_persistent_masked=True, fwd_ctas=3)}[case]
    if "S" not in kw:
        kw["mask"] = AttentionMask.from_segments(_segments(100, 1, 250, 189, total=768), causal=True)
        kw["S"] = kw["mask"].q_len
    lengths = {ro: _attention_fwd_bwd(exit_wait_read_only=ro, **kw, **NO_PTX) for ro in (True, False)}
    assert lengths[True] != lengths[False]


@pytest.mark.parametrize("ptx", PTX_FORMS, ids=lambda p: "no-ptx" if p else "ptx")
@pytest.mark.parametrize("D", [128, 64])
def test_hopper_persistent_data_mask_forward_lowers_for_cuda(D, ptx):
    """The persistent data-mask forward (3 CTAs walking several query tiles each; an empty padding tile)."""
    mask = AttentionMask.from_segments(_segments(100, 1, 250, 189, total=768), causal=True)
    assert _attention_fwd_bwd(mask.q_len, D, D, mask=mask, fwd_persistent_masked=True, fwd_ctas=3, **ptx) > 0


@pytest.mark.parametrize("b_uniform,overlap,block_n", [(True, True, 128), (False, False, 128), (False, False, 256)])
def test_fp8_block_gemm_lowers_for_cuda(b_uniform, overlap, block_n):
    from pallas_kernels.fp8_gemm import block_scaled_gemm

    e4 = jnp.float8_e4m3fn
    a, b = jax.ShapeDtypeStruct((256, 512), e4), jax.ShapeDtypeStruct((512, 512), e4)
    sa, sb = jax.ShapeDtypeStruct((4, 256), jnp.float32), jax.ShapeDtypeStruct((4, 512), jnp.float32)
    f = lambda *x: block_scaled_gemm(*x, block_n=block_n, b_uniform=b_uniform, overlap=overlap, interpret=False)
    assert _lower(f, a, b, sa, sb) > 0


@pytest.mark.parametrize("cluster_m,b_uniform,promotion,block_n", [
    (True, True, "serial", 128), (True, False, "serial", 128), (False, True, "serial", 128),
    (False, True, "unscaled", 128), (True, True, "unscaled", 256), (True, True, "serial", 256),
    (True, False, "serial", 256), (True, True, "rescale", 256), (True, False, "rescale", 256),
    (False, True, "rescale", 128), (False, False, "rescale", 128)])
def test_fp8_block_gemm_persistent_lowers_for_cuda(cluster_m, b_uniform, promotion, block_n):
    from pallas_kernels.fp8_gemm import block_scaled_gemm_persistent

    e4 = jnp.float8_e4m3fn
    a, b = jax.ShapeDtypeStruct((512, 1024), e4), jax.ShapeDtypeStruct((512, 1024), e4)
    sa, sb = jax.ShapeDtypeStruct((8, 512), jnp.float32), jax.ShapeDtypeStruct((8, 512), jnp.float32)
    f = lambda *x: block_scaled_gemm_persistent(*x, cluster_m=cluster_m, b_uniform=b_uniform, promotion=promotion,
                                                block_n=block_n)
    assert _lower(f, a, b, sa, sb) > 0


@pytest.mark.parametrize("cols", [160, 600])
def test_block_lists_kernel_lowers_for_cuda(cols):
    """list_kernel (the data mask's block lists, one Triton program per row) for CUDA: grouped and one-group rules,
    per query tile and per key tile (transposed), rows padded to 256 (4 warps) and 1024 blocks (8 warps)."""
    from pallas_kernels.flash_attention_hopper.data_mask import MaskRule, partial_kinds
    from pallas_kernels.flash_attention_hopper.list_kernel import block_lists_kernel
    from pallas_kernels.mask import TileStats

    stats = lambda n: TileStats(*(jax.ShapeDtypeStruct((2, n), jnp.int32),) * 4, jax.ShapeDtypeStruct((2, n), bool))
    fits = jax.ShapeDtypeStruct((), bool)
    for rule in (MaskRule(True, (-1, -1)), MaskRule(True, (-1, -1), split=False), MaskRule(False, (40, 70))):
        for transposed in (False, True):
            f = lambda r, c, rm, cm, fits, rule=rule, t=transposed: block_lists_kernel(
                r, c, rm, cm, fits, rule, transposed=t, kinds=partial_kinds, interpret=False)
            text = jax.jit(f).trace(stats(96), stats(cols), stats(96), stats(cols), fits).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "te_jax_attn_block_lists" in text and "triton" in text.lower()


def test_triton_kernels_lower_for_cuda():
    """The block casts (FP8, alone and fused with the activation), the delayed-scaling state update and the decode
    kernel, Triton-lowered Pallas, for CUDA."""
    from pallas_kernels.flash_decode import flash_decode
    from pallas_kernels.fp8_gemm import act_block_cast, block_cast_transpose, dact_block_cast_transpose

    x = jax.ShapeDtypeStruct((256, 384), BF)
    assert _lower(lambda x: block_cast_transpose(x, out_dtype=jnp.float8_e4m3fn, tiles="rows", interpret=False),
                  x) > 0
    gu, dh = jax.ShapeDtypeStruct((256, 2, 384), BF), jax.ShapeDtypeStruct((256, 384), BF)
    kw = dict(activation="silu", round_to=BF, interpret=False)
    assert _lower(lambda gu: act_block_cast(gu, out_dtype=jnp.float8_e4m3fn, **kw), gu) > 0
    assert _lower(lambda dh, gu: dact_block_cast_transpose(dh, gu, out_dtype=jnp.float8_e5m2, **kw), dh, gu) > 0
    from pallas_kernels.fp8_cast import norm_cast_transpose

    v, st = jax.ShapeDtypeStruct((384,), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.float32)
    assert _lower(lambda x, m, r, g, b: norm_cast_transpose(x, m, r, g, b, 2.0, out_dtype=jnp.float8_e4m3fn,
                                                            interpret=False, block_m=32, block_n=128),
                  x, st, st, v, v) > 0
    from pallas_kernels.fp8_cast import cast_transpose_many  # stacked transposes (several arrays, one kernel)

    w1, w2 = jax.ShapeDtypeStruct((256, 256), BF), jax.ShapeDtypeStruct((256, 128), BF)
    assert _lower(lambda a, b: cast_transpose_many((a, b), (2.0, 0.5), out_dtype=jnp.float8_e5m2, interpret=False,
                                                   block_m=32, block_n=128), w1, w2) > 0
    from pallas_kernels.fp8_cast import norm_stats_cast_transpose  # the statistics inside the kernel

    for rms in (True, False):
        assert _lower(lambda x, g, b, rms=rms: norm_stats_cast_transpose(
            x, g, None if rms else b, 2.0, rms=rms, epsilon=1e-6, out_dtype=jnp.float8_e4m3fn, interpret=False,
            block_n=128), x, v, v) > 0
    from pallas_kernels.fp8_cast.history import delayed_update_many  # several delayed-scaling states, one launch

    for length, algo in ((1024, "max"), (5, "most_recent")):
        h, s1 = jax.ShapeDtypeStruct((length,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32)
        assert _lower(lambda h1, h2, s, a: delayed_update_many([h1, h2], [s, s], [a, a], [448.0, 57344.0], algo=algo,
                                                               interpret=False), h, h, s1, s1) > 0
    q = jax.ShapeDtypeStruct((2, 1, 8, 128), BF)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, 128), BF)
    mask = AttentionMask.full(2, 1, 1024, causal=True, bottom_right=True)
    assert _lower(lambda q, k, v: flash_decode(q, k, v, mask, scale=0.1, interpret=False), q, kv, kv) > 0
    from pallas_kernels.flash_decode import DecodeConfig  # the shares merged by the last program (atomic count)

    merged = DecodeConfig(merge="kernel")
    assert _lower(lambda q, k, v: flash_decode(q, k, v, mask, scale=0.1, interpret=False, config=merged),
                  q, kv, kv) > 0
    for cfg in (None, merged):  # no mask (every key visible): no loop bounds or mask rows
        assert _lower(lambda q, k, v: flash_decode(q, k, v, None, scale=0.1, interpret=False, config=cfg),
                      q, kv, kv) > 0
    from pallas_kernels.flash_decode import flash_decode_paged  # key segments and positions made in the kernel

    pages = jax.ShapeDtypeStruct((32, 64, 2, 128), BF)
    table, lens = jnp.zeros((2, 16), jnp.int32), jnp.array([1000, 37], jnp.int32)
    assert _lower(lambda q, k, v: flash_decode_paged(q, k, v, table, lens, scale=0.1, window=(100, 0),
                                                     interpret=False), q, pages, pages) > 0


@pytest.mark.parametrize("activation,gated,block,scaled", [("silu", True, 64, False), ("silu", True, 128, True),
                                                           ("gelu", False, 64, True)])
def test_fp8_tma_casts_lower_for_cuda(activation, gated, block, scaled):
    """The TMA cast kernels (pallas_kernels/fp8_cast/tma.py: each tile stored row-major and, through a transposed
    shared-memory view, from the WGMMA_TRANSPOSED register layout): dact and act with and without owed input scales,
    the cast + transpose of bf16 and of fp32 (a weight's master copy) with and without the row-major copy."""
    from pallas_kernels.fp8_cast.tma import act_cast_tma, cast_transpose_tma, dact_cast_transpose_tma

    M, F = 256, 384
    dh = jax.ShapeDtypeStruct((M, F), BF)
    gu = jax.ShapeDtypeStruct((M, 2, F) if gated else (M, F), BF)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    act = dict(activation=activation, gated=gated, block=block, round_to=BF)
    owed = dict(gu_scale=jnp.float32(0.5)) if scaled else {}
    e5, e4 = jnp.float8_e5m2, jnp.float8_e4m3fn
    assert _lower(lambda dh, gu, s: dact_cast_transpose_tma(dh, gu, s, out_dtype=e5, **act, **owed,
                                                            **(dict(dh_scale=jnp.float32(2.0)) if scaled else {})),
                  dh, gu, s) > 0
    assert _lower(lambda gu, s: act_cast_tma(gu, s, out_dtype=e4, **act, **owed), gu, s) > 0
    x = jax.ShapeDtypeStruct((M, F), BF if scaled else jnp.float32)
    assert _lower(lambda x, s: cast_transpose_tma(x, s, out_dtype=e4, write_q=scaled, block=block, round_to=BF),
                  x, s) > 0


#: Primitives that Mosaic GPU lowers inside plgpu.warp_map (the single producer warp) under both of its lowering
#: semantics on jax 0.10.2 (lane and warpgroup), plus jit and select_n, which the GPU machine's jax 0.11.2 lowers
#: there too (the dense kernels' producers use them and pass there). The GPU run of 2026-11-27 failed on jax 0.11.2
#: with "Unimplemented primitive ... neg ... PrimitiveSemantics.Warp", which the lane lowering above (jax 0.10.2)
#: does not see.
def _warp_lowerable() -> set[str]:
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu import lowering as gpu_lowering

    rules = gpu_lowering.mosaic_lowering_rules
    return ({p.name for p in rules[gpu_core.LANExWARP_SEMANTICS]} & {p.name for p in rules[gpu_core.WGxWARP_SEMANTICS]}
            | {"jit", "pjit", "select_n"})


@pytest.mark.parametrize("name,mask_kw,cfg_kw", [
    ("dense causal", dict(causal=True), {}),
    ("window band, persistent fwd and bwd", dict(band="window"), dict(fwd_persistent_band=True, fwd_ctas=3,
                                                                      bwd_persistent_band=True, bwd_ctas=3)),
    ("bottom right band, persistent fwd and bwd", dict(band="bottom right"),
     dict(fwd_persistent_band=True, bwd_persistent_band=True, bwd_dq_atomic=False)),
    ("window band, grid", dict(band="window"), dict(bwd_dq_atomic=False)),
    ("documents, persistent fwd", dict(documents=True), dict(fwd_persistent_masked=True, fwd_ctas=3)),
    ("documents", dict(documents=True), {})])
def test_single_producer_warp_uses_warp_lowerable_primitives(name, mask_kw, cfg_kw):
    """Every kernel with the single-warp producer (the default on the GPU) traces only warp-lowerable primitives
    inside its warp_map: index arithmetic there must avoid lax.neg (unary minus), not and clamp."""
    S, D, mask, offset, seg = 512, 128, None, None, True
    if mask_kw.get("band") == "window":
        mask, offset, seg = AttentionMask.full(1, 512, 512, causal=True, window=(128, 0)), 0, False
    elif mask_kw.get("band") == "bottom right":
        mask, offset, seg = AttentionMask.full(1, 256, 640, causal=True, bottom_right=True), 384, False
    elif mask_kw.get("documents"):
        mask = AttentionMask.from_segments(_segments(100, 1, 250, 189, total=768), causal=True)
    Sq, Skv = (mask.q_len, mask.kv_len) if mask is not None else (S, S)
    cfg = dataclasses.replace(default_config(D, Skv, mask_kw.get("causal", False), Sq, head_dim_v=D),
                              fwd_producer_warp=True, bwd_producer_warp=True, **cfg_kw)
    q = jax.ShapeDtypeStruct((1, Sq, 2, D), BF)
    kv = jax.ShapeDtypeStruct((1, Skv, 2, D), BF)

    def f(q, k, v):
        (o, lse), vjp = jax.vjp(lambda q, k, v: hopper_attention(
            q, k, v, scale=0.1, causal=mask_kw.get("causal", False), mask=mask, interpret=False, config=cfg,
            mask_segments=seg, mask_offset=offset), q, k, v)
        return vjp((o, jnp.zeros_like(lse)))

    used = set(warp_map_primitives(jax.make_jaxpr(f)(q, kv, kv).jaxpr))
    assert used, "no warp_map found: the producer warp is off"
    assert used <= _warp_lowerable(), sorted(used - _warp_lowerable())
