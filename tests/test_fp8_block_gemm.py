"""The block-scaled FP8 GEMM (pallas_kernels.fp8_gemm): its quantization and reference on the CPU (against a numpy
model and a plain fp32 GEMM), its argument checks, and the kernel itself on an sm90 GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_gemm import (block_scaled_gemm, block_scaled_gemm_reference, gemm_shape_reason,
                                     quantize_blocks, row_scales)
from te_jax.fp8.quantize import block_qdq

E4 = jnp.float8_e4m3fn


def _operands(m=256, k=384, n=128, seed=0, w_tiles=(128, 128)):
    """x [m, k] in 1x128 tiles (rows of different magnitudes), w^T [n, k] in w_tiles: 128x128 (weights: the
    forward and dgrad GEMMs) or 1x128 (an activation as b: the wgrad GEMM)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1))), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5 * np.exp(rng.standard_normal((1, n))), jnp.float32)
    xq, xs = quantize_blocks(x, (1, 128), E4)
    wq, ws = quantize_blocks(w.T, w_tiles, E4)
    return x, w, xq, wq, xs.T, row_scales(ws, w_tiles[0])


def _numpy_quantize(x, block, dtype):
    """An independent model of block quantization: per-tile amax with numpy loops, x * (1 / (amax / fp8_max)) in
    float32, clipped and cast with ml_dtypes."""
    x = np.asarray(x, np.float32)
    fmax = float(jnp.finfo(dtype).max)
    q = np.zeros(x.shape, jnp.dtype(dtype))
    s = np.ones((x.shape[0] // block[0], x.shape[1] // block[1]), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            t = x[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            amax = np.abs(t).max()
            s[i, j] = amax / np.float32(fmax) if amax > 0 else 1.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = np.clip(
                t * (np.float32(1) / s[i, j]), -fmax, fmax).astype(jnp.dtype(dtype))
    return q, s


def test_quantize_blocks_and_the_reference_gemm_against_independent_models():
    """quantize_blocks against a numpy model (1x128 activations, 128x128 weights; te_jax's block_qdq is built on
    it); the reference GEMM on those operands equals the fp32 GEMM of the dequantized arrays and is within FP8
    error of the unquantized product."""
    x, w, xq, wq, sa, sb = _operands()
    for a, block, q, scales in ((x, (1, 128), xq, sa.T), (w.T, (128, 128), wq, None)):
        nq, ns = _numpy_quantize(a, block, E4)
        np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), nq.astype(np.float32))
        if scales is not None:
            np.testing.assert_allclose(scales, ns, rtol=2.5e-7)  # XLA divides to within 1 ulp
    dq_x = xq.astype(jnp.float32) * jnp.repeat(sa.T, 128, axis=1)
    dq_w = wq.astype(jnp.float32) * sb.T.repeat(128, axis=1)  # [N, K]
    np.testing.assert_allclose(dq_x, block_qdq(x, (1, 128), E4, jnp.float32), rtol=1e-6, atol=1e-30)
    ref = block_scaled_gemm_reference(xq, wq, sa, sb)
    np.testing.assert_allclose(ref, jnp.dot(dq_x, dq_w.T, precision="highest"), rtol=2e-5, atol=1e-4)
    exact = jnp.dot(x, w, precision="highest")
    assert float(jnp.linalg.norm(ref - exact) / jnp.linalg.norm(exact)) < 0.05


def test_bad_operands_are_named():
    x, w, xq, wq, sa, sb = _operands()
    assert gemm_shape_reason(xq.shape, wq.shape, xq.dtype, wq.dtype) is None
    assert "multiple of 128" in gemm_shape_reason((200, 384), (128, 384), E4, E4)
    assert "float8" in gemm_shape_reason((256, 384), (128, 384), jnp.bfloat16, E4)
    assert "contraction lengths differ" in gemm_shape_reason((256, 384), (128, 256), E4, E4)
    with pytest.raises(ValueError, match=r"a_scales has shape \(256, 3\); expected \(3, 256\)"):
        block_scaled_gemm(xq, wq, sa.T, sb)
    from pallas_kernels.fp8_gemm import block_scaled_gemm_persistent

    with pytest.raises(ValueError, match=r"block_scaled_gemm_persistent: b_scales has shape \(128, 3\); expected"):
        block_scaled_gemm_persistent(xq, wq, sa, sb.T)
    with pytest.raises(ValueError, match="M=128 is not a multiple of 256"):  # two 128-row CTAs a cluster
        block_scaled_gemm_persistent(xq[:128], wq, sa[:, :128], sb)
    with pytest.raises(ValueError, match=r"promotion='late'; expected one of \('serial', 'rescale', 'unscaled'\)"):
        block_scaled_gemm_persistent(xq, wq, sa, sb, promotion="late")
    with pytest.raises(ValueError, match="block_n=192; expected 128 or 256"):
        block_scaled_gemm_persistent(xq, wq, sa, sb, block_n=192)
    with pytest.raises(ValueError, match="quantize_blocks: shape"):
        quantize_blocks(x[:, :100], (1, 128), E4)


def _rescaled_sum(xq, wq, sa, sb, factors):
    """The "rescale" promotion's recurrence (pallas_kernels/fp8_gemm/rescale.py) in fp32 jnp: the sum kept in the
    current K block's units, each block's product accumulated unscaled."""
    (ra, fa), (rb, fb) = factors(sa), factors(sb)
    acc = jnp.zeros((xq.shape[0], wq.shape[0]), jnp.float32)
    for kb in range(sa.shape[0]):
        cols = slice(kb * 128, (kb + 1) * 128)
        part = jnp.dot(xq[:, cols].astype(jnp.float32), wq[:, cols].astype(jnp.float32).T, precision="highest")
        acc = acc * ra[kb][:, None] * rb[kb][None, :] + part
    return acc * fa[0][:, None] * fb[0][None, :]


def test_rescale_factors_reproduce_the_promoted_sum_and_bound_tiny_blocks():
    """The rescale recurrence with rescale_factors equals the reference block GEMM (fp32, per-block promotion) on
    random operands whose row scales span 2^-100..2^10 across K blocks (blocks of amax 1e-30 after blocks of amax
    1), with no inf or NaN; without the floor the same recurrence overflows (the floor keeps it finite)."""
    from pallas_kernels.fp8_gemm import rescale_factors

    rng = np.random.default_rng(5)
    m, k, n = 128, 128 * 6, 256
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) * k ** -0.5
    # rows whose later K blocks are 2^-100 of the first (amax 1e-30 after O(1)), and large blocks later
    x[::3, 256:512] *= 2.0 ** -100
    x[1::3, 640:] *= 2.0 ** -90
    x[2::3, 128:256] *= 2.0 ** 10
    w[128 * 3:128 * 4] *= 2.0 ** -100
    xq, xs = quantize_blocks(jnp.asarray(x), (1, 128), E4)
    wq, ws = quantize_blocks(jnp.asarray(w.T), (1, 128), E4)
    sa, sb = xs.T, ws.T
    ref = block_scaled_gemm_reference(xq, wq, sa, sb)
    assert bool(jnp.all(jnp.isfinite(ref)))
    got = _rescaled_sum(xq, wq, sa, sb, rescale_factors)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(ref))))

    def unfloored(s):
        return jnp.concatenate([jnp.ones_like(s[:1]), s[:-1] / s[1:]]), s[-1:]

    assert not bool(jnp.all(jnp.isfinite(_rescaled_sum(xq, wq, sa, sb, unfloored))))


def _on_sm90():
    from te_jax._compat import gpu_compute_capability

    cc = gpu_compute_capability()
    return cc is not None and cc[0] == 9


@pytest.mark.skipif(not _on_sm90(), reason="the Mosaic GPU kernel needs an sm90 GPU (no interpreter on jax 0.10.2)")
@pytest.mark.parametrize("m,k,n,block_n,w_rows,b_uniform,overlap", [
    (256, 384, 128, 128, 128, True, True), (384, 1024, 512, 128, 128, True, False),
    (256, 1024, 384, 128, 1, False, True), (384, 384, 256, 128, 1, False, False),
    (128, 128, 256, 256, 128, False, False), (128, 1152, 256, 128, 128, False, True)])
def test_kernel_matches_the_reference(m, k, n, block_n, w_rows, b_uniform, overlap):
    """Every promotion form (one scalar per K block for 128x128 b tiles, or per-column b scales; promoted after
    the wgmma or during the next one) against the fp32 reference, one K block to nine."""
    _, _, xq, wq, sa, sb = _operands(m, k, n, seed=m + n, w_tiles=(w_rows, 128))
    got = jax.jit(lambda *a: block_scaled_gemm(*a, block_n=block_n, b_uniform=b_uniform, overlap=overlap))(
        xq, wq, sa, sb)
    ref = block_scaled_gemm_reference(xq, wq, sa, sb)
    assert got.dtype == jnp.bfloat16
    assert float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)) < 1e-2


@pytest.mark.skipif(not _on_sm90(), reason="the Mosaic GPU kernel needs an sm90 GPU (no interpreter on jax 0.10.2)")
@pytest.mark.parametrize("m,k,n,w_rows,cluster_m,b_uniform,n_ctas,promotion,block_n", [
    (512, 1024, 384, 128, True, True, None, "serial", 128), (256, 384, 256, 1, True, False, None, "serial", 128),
    (384, 512, 256, 128, False, True, 4, "serial", 128), (1024, 256, 640, 128, True, True, 6, "serial", 128),
    (512, 1024, 512, 128, True, True, None, "serial", 256),
    (256, 640, 768, 1, True, False, 4, "serial", 256), (384, 384, 512, 128, False, True, 2, "serial", 256),
    (512, 1024, 512, 128, True, True, None, "rescale", 256), (256, 1280, 768, 1, True, False, 4, "rescale", 256),
    (384, 384, 256, 128, False, True, 2, "rescale", 128), (256, 640, 384, 1, False, False, None, "rescale", 128)])
def test_persistent_kernel_matches_the_reference(m, k, n, w_rows, cluster_m, b_uniform, n_ctas, promotion,
                                                 block_n):
    """block_scaled_gemm_persistent (clusters of two CTAs sharing b by TMA multicast, or one CTA; output tiles
    looped over fewer CTAs than tiles; the promotion of each K block's product or the rescaled running sum;
    128x128 and 1x128 b tiles; 128- and 256-wide tiles) against the fp32 reference."""
    from pallas_kernels.fp8_gemm import block_scaled_gemm_persistent

    _, _, xq, wq, sa, sb = _operands(m, k, n, seed=m + n + 1, w_tiles=(w_rows, 128))
    got = jax.jit(lambda *a: block_scaled_gemm_persistent(*a, cluster_m=cluster_m, b_uniform=b_uniform,
                                                          n_ctas=n_ctas, promotion=promotion, block_n=block_n))(
        xq, wq, sa, sb)
    ref = block_scaled_gemm_reference(xq, wq, sa, sb)
    assert float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)) < 1e-2


@pytest.mark.skipif(not _on_sm90(), reason="the Mosaic GPU kernel needs an sm90 GPU (no interpreter on jax 0.10.2)")
def test_persistent_unscaled_ceiling_is_the_plain_fp8_product():
    """promotion="unscaled" (the benchmark's ceiling, 128- and 256-wide tiles) ignores the scales: it is the plain
    product of the FP8 operands, in fp32 accumulation."""
    from pallas_kernels.fp8_gemm import block_scaled_gemm_persistent

    _, _, xq, wq, sa, sb = _operands(512, 1024, 512, seed=3)
    ref = block_scaled_gemm_reference(xq, wq, jnp.ones_like(sa), jnp.ones_like(sb))
    for promotion, block_n in (("unscaled", 128), ("unscaled", 256)):
        got = jax.jit(lambda *a: block_scaled_gemm_persistent(*a, b_uniform=True, promotion=promotion,
                                                              block_n=block_n))(xq, wq, sa * 7.0, sb)
        assert float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)) < 1e-2, promotion


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_block_gemm_path_equals_the_reference_path(monkeypatch, fmt):
    """te_jax/fp8/block.py's layouts and scales (TE_JAX_FP8_BLOCK_GEMM=emulate: the kernel's jnp reference in its
    place) give fp8_dot_general's Float8BlockScaling results: the reference path's to bf16 rounding (it GEMMs
    bf16-dequantized operands), forward, dx and dw, and both within FP8 error of fp32. Shapes off the 128 grid
    fall back to the reference path."""
    from te_jax.fp8 import quantize as Q
    from te_jax.fp8.recipe import Float8BlockScaling, Format

    recipe = Float8BlockScaling(fp8_format=getattr(Format, fmt))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 384)) * 256 ** -0.5, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((2, 128, 384)), jnp.bfloat16)
    dn = (((2,), (0,)), ((), ()))

    def run(mode, fused="0"):
        monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", mode)
        monkeypatch.setenv("TE_JAX_FP8_FUSED", fused)
        f = lambda x, w: Q.fp8_dot_general(x, w, dn, recipe)
        step = jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, x, w)))
        return step(x, w, g), step.lower(x, w, g).as_text()

    (y, dx, dw), text = run("emulate")
    (y0, dx0, dw0), text0 = run("xla")
    (yf, dxf, dwf), textf = run("emulate", fused="1")  # the one-pass block cast kernel (interpret mode)
    assert "@block_cast_transpose" in textf and "@block_cast_transpose" not in text
    for a, b in ((yf, y), (dxf, dx), (dwf, dw)):  # the same quantized values: the same results
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert "f8E4M3FN" in text and y.dtype == jnp.bfloat16 and dw.dtype == w.dtype
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
    for a, b in ((y, y0), (dx, dx0), (dw, dw0)):
        assert rel(a, b) < 2.0 ** -6, rel(a, b)
    exact = jax.vjp(lambda x, w: jnp.einsum("bsk,kn->bsn", x.astype(jnp.float32), w.astype(jnp.float32)), x, w)
    ey, evjp = exact
    edx, edw = evjp(g.astype(jnp.float32))
    assert rel(y, ey) < 0.05 and rel(dx, edx) < 0.1 and rel(dw, edw) < 0.1
    # off the grid (N = 200): the reference path, whatever the mode
    from te_jax.fp8 import block

    assert "N=200 not a multiple of 128" in block.block_gemm_reason(x.shape, (256, 200), 1)
    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "emulate")
    monkeypatch.setattr(Q, "block_scaled_dot", lambda *a, **k: (_ for _ in ()).throw(AssertionError("taken")))
    y_odd = Q.fp8_dot_general(x, w[:, :200], dn, recipe)
    assert y_odd.shape == (2, 128, 200)
    with pytest.raises(ValueError, match="TE_JAX_FP8_BLOCK_GEMM='gpu' must be one of"):
        monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "gpu")
        Q.fp8_dot_general(x, w, dn, recipe)


def test_block_promotion_follows_the_recipe_unless_the_environment_says(monkeypatch):
    from te_jax.fp8 import block
    from te_jax.fp8.recipe import Float8BlockScaling

    monkeypatch.delenv(block.BLOCK_PROMOTION_ENV, raising=False)
    assert block.block_promotion(Float8BlockScaling()) == "rescale"
    assert block.block_promotion(Float8BlockScaling(use_split_accumulator=True)) == "serial"
    monkeypatch.setenv(block.BLOCK_PROMOTION_ENV, "serial")
    assert block.block_promotion(Float8BlockScaling()) == "serial"
    monkeypatch.setenv(block.BLOCK_PROMOTION_ENV, "fast")
    with pytest.raises(ValueError, match="TE_JAX_FP8_BLOCK_PROMOTION='fast' must be one of"):
        block.block_promotion(Float8BlockScaling())


def test_block_gemm_mode_auto_takes_the_kernel_only_where_hopper_runs(monkeypatch):
    """TE_JAX_FP8_BLOCK_GEMM unset ("auto"): the FP8 block GEMM on an sm90 GPU with jax >= 0.11, the reference
    elsewhere, and te_jax.fp8's explanation says which and why; an explicit value wins."""
    from te_jax.backends import pallas as pallas_mod
    from te_jax.fp8 import block
    from te_jax.fp8.context import gemm_support_reason
    from te_jax.fp8.recipe import Float8BlockScaling

    monkeypatch.delenv("TE_JAX_FP8_BLOCK_GEMM", raising=False)
    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: "not an sm90 GPU")
    assert block.block_gemm_mode() == "xla"
    why = gemm_support_reason(Float8BlockScaling(), 4096, 4096)
    assert "reference implementation" in why and "not an sm90 GPU" in why, why
    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)
    assert block.block_gemm_mode() == "pallas"
    assert gemm_support_reason(Float8BlockScaling(), 4096, 4096) is None
    assert "N=200" in gemm_support_reason(Float8BlockScaling(), 4096, 200)
    monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", "xla")
    assert block.block_gemm_mode() == "xla"


@pytest.mark.parametrize("tiles,dtype,in_dtype", [("rows", E4, jnp.bfloat16), ("square", E4, jnp.float32),
                                                  ("rows", jnp.float8_e5m2, jnp.float32)])
def test_block_cast_transpose_matches_quantize_blocks(tiles, dtype, in_dtype):
    """The one-pass block cast (interpret mode on the CPU) writes quantize_blocks' values bit for bit, in both
    layouts, with the scales in the GEMM's [blocks, rows] layout; an all-zero tile gets scale 1."""
    from pallas_kernels.fp8_gemm import block_cast_transpose

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((256, 384)) * np.exp(rng.standard_normal((256, 1))), in_dtype)
    x = x.at[128:, :128].set(0)
    q, qs, qt, qts = block_cast_transpose(x, out_dtype=dtype, tiles=tiles, interpret=True)
    block = (1, 128) if tiles == "rows" else (128, 128)
    rq, rs = quantize_blocks(x, block, dtype)
    rqt, rts = quantize_blocks(x.T, block, dtype)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    np.testing.assert_array_equal(f32(q), f32(rq))
    np.testing.assert_array_equal(f32(qt), f32(rqt))
    want_qs = rs.T if tiles == "rows" else row_scales(rs, 128)
    want_qts = rts.T if tiles == "rows" else row_scales(rts, 128)
    np.testing.assert_array_equal(qs, want_qs)
    np.testing.assert_array_equal(qts, want_qts)
    assert float(qs.min()) > 0 and (tiles == "rows" or float(qs[0, 128]) == 1.0)
    with pytest.raises(ValueError, match=r"multiples of 128; got shape \(256, 100\)"):
        block_cast_transpose(x[:, :100], out_dtype=dtype)
    with pytest.raises(ValueError, match="tiles='cols' must be one of"):
        block_cast_transpose(x, out_dtype=dtype, tiles="cols")
    # one layout only (a weight's forward / backward): the same arrays, the other pair None
    only_q = block_cast_transpose(x, out_dtype=dtype, tiles=tiles, interpret=True, write="q")
    only_qt = block_cast_transpose(x, out_dtype=dtype, tiles=tiles, interpret=True, write="qt")
    assert only_q[2:] == (None, None) and only_qt[:2] == (None, None)
    for got, want in zip(only_q[:2] + only_qt[2:], (q, qs, qt, qts)):
        np.testing.assert_array_equal(f32(got), f32(want))
    with pytest.raises(ValueError, match="write='t' must be one of"):
        block_cast_transpose(x, out_dtype=dtype, write="t")
    with pytest.raises(ValueError, match="out_dtype=.*must be float8_e4m3fn or float8_e5m2"):
        block_cast_transpose(x, out_dtype=jnp.bfloat16)


@pytest.mark.skipif(not _on_sm90(), reason="the Mosaic GPU kernel needs an sm90 GPU (no interpreter on jax 0.10.2)")
@pytest.mark.parametrize("split", [False, True])
def test_te_jax_block_gemm_path_on_the_gpu(monkeypatch, split):
    """TE_JAX_FP8_BLOCK_GEMM=pallas (the kernel, with the one-pass block casts) against =emulate (the same FP8
    operands through the jnp reference GEMM): forward, dx and dw within bf16 rounding, with either promotion
    (use_split_accumulator False: "rescale", 256-wide tiles for dx's N 512 and 128-wide for N 384)."""
    from te_jax.fp8 import quantize as Q
    from te_jax.fp8.recipe import Float8BlockScaling

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 256, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 384)) * 512 ** -0.5, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((2, 256, 384)), jnp.bfloat16)
    dn = (((2,), (0,)), ((), ()))
    outs = {}
    for mode in ("pallas", "emulate"):
        monkeypatch.setenv("TE_JAX_FP8_BLOCK_GEMM", mode)
        f = lambda x, w: Q.fp8_dot_general(x, w, dn, Float8BlockScaling(use_split_accumulator=split))
        outs[mode] = jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, x, w)))(x, w, g)
    for a, b in zip(outs["pallas"], outs["emulate"]):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        assert float(jnp.linalg.norm(a32 - b32) / jnp.linalg.norm(b32)) < 2.0 ** -7


def test_block_qdq_keeps_its_fp8_values_behind_a_barrier():
    """XLA's GPU pipeline (simplify-fp-conversions, excess precision allowed by default) folds f32 -> FP8 -> f32
    converts away: on an H100 the reference Float8BlockScaling then computed in bf16 (a 3.6e-2 error against the
    real FP8 path). block_qdq keeps the FP8 values behind an optimization barrier, which the lowered program shows;
    and its values are the quantized ones."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((128, 256)), jnp.float32)
    text = jax.jit(lambda x: block_qdq(x, (1, 128), E4, jnp.bfloat16)).lower(x).as_text()
    assert "optimization_barrier" in text and "f8E4M3FN" in text
    q, s = quantize_blocks(x, (1, 128), E4)
    want = q.astype(jnp.float32) * jnp.repeat(s, 128, axis=1)
    np.testing.assert_array_equal(np.asarray(block_qdq(x, (1, 128), E4, jnp.float32)), np.asarray(want))


def test_block_gemm_ring_depth_fits_shared_memory():
    """The ring is capped at what sm90's shared memory holds beside the output tile (block_n 256 with 4 stages
    overflowed it: 268 KB, found by tests/test_hopper_lowering.py)."""
    from pallas_kernels.fp8_gemm.kernel import SMEM_BYTES, max_stages

    assert max_stages(128, jnp.bfloat16) == 5 and max_stages(256, jnp.bfloat16) == 3
    for bn in (128, 256):
        per_stage = 2 * 64 * 128 + bn * 128 + 2 * 64 * 4 + bn * 4
        n = max_stages(bn, jnp.bfloat16)
        assert n * per_stage + 2 * 64 * bn * 2 <= SMEM_BYTES < (n + 1) * per_stage + 2 * 64 * bn * 2
