"""Backend selection: automatic, forced by argument or environment, and explained."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
import te_jax.attention as attention_mod
from helpers import qkv
from jaxpr_walk import walk
from te_jax.backends import selection


def _qkv(b=2, sq=8, skv=8, h=4, g=2, d=64, dv=None, dtype=jnp.bfloat16, fmt="bshd"):
    """helpers.qkv in `fmt`; long ones as shapes only (the explanation reads shapes: no 32k-token arrays drawn)."""
    make = lambda: tuple(te_jax.from_bshd(t, fmt) for t in qkv(0, b, sq, skv, h, g, d, dv, dtype))
    return jax.eval_shape(make) if b * max(sq, skv) * h * d > 2**20 else make()


@pytest.fixture
def fake_h100(monkeypatch):
    """Pretend to be on an sm90 GPU: selection reasons only, nothing is executed."""
    monkeypatch.setattr(attention_mod, "current_platform", lambda: ("gpu", (9, 0)))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (selection.FORCE_ENV, "TE_JAX_DEBUG", *map(selection.disable_env, selection.BACKEND_NAMES)):
        monkeypatch.delenv(var, raising=False)


def test_cpu_auto_picks_xla_and_says_why_not_others():
    choice = te_jax.explain_attention_backend(*_qkv())
    assert choice.selected == "xla" and choice.source == "auto"
    assert "interpret mode" in choice.reasons["pallas"]
    assert "not a GPU" in choice.reasons["cudnn"]
    assert "xla" in str(choice) and "cudnn" in str(choice)


def test_gpu_auto_prefers_cudnn_then_explains(fake_h100):
    choice = te_jax.explain_attention_backend(*_qkv(), attn_mask_type="causal")
    assert choice.selected in ("cudnn", "pallas")
    assert all(w is None or isinstance(w, str) for w in choice.reasons.values())
    assert "serves the call" in choice.reasons["xla"]


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(softcap=30.0), "softcap"),
    (dict(dropout_rate=0.1), "dropout"),
    (dict(attn_mask_type="causal_bottom_right"), None),  # equal lengths: cuDNN serves
    (dict(window_size=(4, 4)), "right=0"),
    (dict(attn_mask_type="padding", q_segment_ids=jnp.ones((2, 8), jnp.int32),
          kv_segment_ids=jnp.ones((2, 8), jnp.int32)), "segment ids"),
])
def test_cudnn_reasons_name_the_feature(fake_h100, kwargs, fragment):
    choice = te_jax.explain_attention_backend(*_qkv(), **kwargs)
    why = choice.reasons["cudnn"]
    if fragment is None:
        assert why is None or why.startswith("serves the call")
    else:
        assert fragment in why, why
        assert choice.selected in ("pallas", "xla")


def test_cudnn_reasons_dtype_headdim_arch(fake_h100, monkeypatch):
    assert "float32" in te_jax.explain_attention_backend(*_qkv(dtype=jnp.float32)).reasons["cudnn"]
    assert "head_dim_qk=264" in te_jax.explain_attention_backend(*_qkv(d=264)).reasons["cudnn"]
    assert "head_dim_qk=264" in te_jax.explain_attention_backend(*_qkv(d=264)).reasons["pallas"]
    monkeypatch.setattr(attention_mod, "current_platform", lambda: ("gpu", (8, 0)))
    choice = te_jax.explain_attention_backend(*_qkv(d=192))
    assert "<= 128 on sm80" in choice.reasons["cudnn"]
    choice = te_jax.explain_attention_backend(*_qkv(d=64, dv=32))
    assert "requires value's head_dim to equal the query's" in choice.reasons["cudnn"]
    monkeypatch.setattr(attention_mod, "current_platform", lambda: ("gpu", (9, 0)))
    choice = te_jax.explain_attention_backend(*_qkv(d=64, dv=32))  # found on the H100: jax.nn refuses d_v != d_qk
    assert "requires value's head_dim to equal the query's" in choice.reasons["cudnn"]
    q, k, v = _qkv()
    choice = te_jax.explain_attention_backend(q[:, :1], k[:, :3], v[:, :3])  # odd lengths (q 1, kv 3): cuDNN
    # served padded to even: no backward reason for this forward-only call, only the decode kernel's preference
    assert "odd" not in choice.reasons["cudnn"] and "serves the call" in choice.reasons["cudnn"], choice
    choice = te_jax.explain_attention_backend(q[:, :3], k[:, :3], v[:, :3], backend="cudnn")
    assert choice.selected == "cudnn"
    monkeypatch.setattr(attention_mod, "current_platform", lambda: ("gpu", (7, 5)))
    choice = te_jax.explain_attention_backend(*_qkv())
    assert "sm75" in choice.reasons["cudnn"] and "sm75" in choice.reasons["pallas"]
    assert choice.selected == "xla"


def test_thd_is_not_cudnn(fake_h100):
    q, k, v = (t.reshape(16, *t.shape[2:]) for t in _qkv())
    choice = te_jax.explain_attention_backend(q, k, v, attn_input_format="thd", attn_mask_type="padding",
                                              q_seqlens=jnp.array([8, 8]), kv_seqlens=jnp.array([8, 8]))
    assert "thd" in choice.reasons["cudnn"]


def test_env_force_and_disable(monkeypatch, fake_h100):
    monkeypatch.setenv("TE_JAX_ATTN_BACKEND", "xla")
    choice = te_jax.explain_attention_backend(*_qkv())
    assert choice.selected == "xla" and "TE_JAX_ATTN_BACKEND" in choice.source
    assert "forced" in choice.reasons["cudnn"]
    monkeypatch.delenv("TE_JAX_ATTN_BACKEND")
    monkeypatch.setenv("TE_JAX_CUDNN_ATTN", "0")
    monkeypatch.setenv("TE_JAX_PALLAS_ATTN", "0")
    choice = te_jax.explain_attention_backend(*_qkv())
    assert choice.selected == "xla"
    assert "TE_JAX_CUDNN_ATTN=0" in choice.reasons["cudnn"]
    assert "TE_JAX_PALLAS_ATTN=0" in choice.reasons["pallas"]


def test_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("TE_JAX_ATTN_BACKEND", "cudnn")
    choice = te_jax.explain_attention_backend(*_qkv(), backend="xla")
    assert choice.selected == "xla" and choice.source == "argument"


def test_forced_backend_that_cannot_serve_lists_every_reason(monkeypatch):
    with pytest.raises(ValueError) as e:
        te_jax.dot_product_attention(*_qkv(), backend="cudnn")
    msg = str(e.value)
    assert "cudnn: not a GPU" in msg and "xla" in msg and "backend='xla'" in msg
    monkeypatch.setenv("TE_JAX_XLA_ATTN", "0")
    with pytest.raises(ValueError, match="TE_JAX_XLA_ATTN=0"):
        te_jax.dot_product_attention(*_qkv())


def test_forced_pallas_on_cpu_is_allowed_by_selection():
    choice = te_jax.explain_attention_backend(*_qkv(), backend="pallas")
    assert choice.reasons["pallas"] is None or "could not be imported" in choice.reasons["pallas"]


def test_unknown_names(monkeypatch):
    with pytest.raises(ValueError, match="backend='fast' is not known"):
        te_jax.dot_product_attention(*_qkv(), backend="fast")
    monkeypatch.setenv("TE_JAX_ATTN_BACKEND", "triton")
    with pytest.raises(ValueError, match="TE_JAX_ATTN_BACKEND='triton'"):
        te_jax.dot_product_attention(*_qkv())


def test_debug_env_logs_each_choice(monkeypatch, caplog):
    monkeypatch.setenv("TE_JAX_DEBUG", "1")
    with caplog.at_level(logging.WARNING, logger="te_jax"):
        te_jax.dot_product_attention(*_qkv(dtype=jnp.float32))
    assert "attention backend: xla" in caplog.text and "cudnn" in caplog.text


def test_dropout_reason_for_pallas(fake_h100):
    choice = te_jax.explain_attention_backend(*_qkv(), dropout_rate=0.1)
    assert "dropout is served by the xla backend only" in choice.reasons["pallas"]
    assert choice.selected == "xla"


def test_selected_backend_runs_and_matches_xla():
    q, k, v = _qkv(dtype=jnp.float32)
    np.testing.assert_allclose(te_jax.dot_product_attention(q, k, v),
                               te_jax.dot_product_attention(q, k, v, backend="xla"), rtol=1e-6)


def test_gpu_preference_follows_measurements(fake_h100, monkeypatch):
    """On sm90, the Hopper kernel is preferred where it measured faster; cuDNN elsewhere."""
    from te_jax.backends import selection

    monkeypatch.setattr(selection.BACKENDS["pallas"], "hopper_reason", lambda call: None)
    short = te_jax.explain_attention_backend(*_qkv(sq=1024, skv=1024, d=128), attn_mask_type="causal")
    assert short.selected == "pallas" and "Hopper kernel measured faster" in short.reasons["cudnn"]
    assert "head_dim 128 causal q_len <= 16640" in short.reasons["cudnn"]
    # the explanation says how the kernel runs the call: causal 1k keys -> persistent forward (heavy/light tile
    # pairs), dQ kernel
    assert "paired heavy with light" in short.detail and "separate dQ kernel (keys 1024 < 2048" in short.detail
    long = te_jax.explain_attention_backend(*_qkv(b=1, sq=8192, skv=8192, d=128), attn_mask_type="causal")
    assert long.selected == "pallas" and "head_dim 128 causal q_len <= 16640" in long.reasons["cudnn"]
    # 16,534 (padded to 16,640 by the Hopper kernel) was measured: Hopper 1.09x cuDNN fwd+bwd
    odd = te_jax.explain_attention_backend(*_qkv(b=1, sq=16534, skv=16534, d=128), attn_mask_type="causal")
    assert odd.selected == "pallas" and "head_dim 128 causal q_len <= 16640" in odd.reasons["cudnn"], odd
    longest = te_jax.explain_attention_backend(*_qkv(b=1, sq=32768, skv=32768, d=128), attn_mask_type="causal")
    assert longest.selected == "cudnn" and "cuDNN measured as fast or faster" in longest.reasons["pallas"]
    # non-causal up to 4k (tuning.HOPPER_FASTER_MAX_LEN), cuDNN beyond
    mid = te_jax.explain_attention_backend(*_qkv(b=1, sq=4096, skv=4096, d=128))
    assert mid.selected == "pallas" and "head_dim 128 non-causal q_len <= 4096" in mid.reasons["cudnn"]
    assert "persistent grid" in mid.detail and "dQ accumulated in the dK/dV kernel" in mid.detail
    longer = te_jax.explain_attention_backend(*_qkv(b=1, sq=8192, skv=8192, d=128))
    assert longer.selected == "cudnn" and "non-causal q_len > 4096" in longer.reasons["pallas"]
    # head_dim 64 / 256 follow their own measurements: hd64 up to 16k, hd256 up to 1k
    hd64 = te_jax.explain_attention_backend(*_qkv(b=1, sq=4096, skv=4096, d=64))
    assert hd64.selected == "pallas" and "head_dim 64 non-causal q_len <= 16384" in hd64.reasons["cudnn"]
    assert "_run10.md" in hd64.reasons["cudnn"] and "dQ accumulated in the dK/dV kernel" in hd64.detail
    hd64_32k = te_jax.explain_attention_backend(*_qkv(b=1, sq=32768, skv=32768, d=64))
    assert hd64_32k.selected == "cudnn" and "head_dim 64 non-causal q_len > 16384" in hd64_32k.reasons["pallas"]
    from te_jax.backends import tuning

    monkeypatch.setitem(tuning.HOPPER_FASTER_MAX_LEN, (64, False),  # a (head_dim, mask) never faster
                        tuning.Tuned(0, "stand-in", tuning.ATTENTION_HOPPER_RESULTS))
    never = te_jax.explain_attention_backend(*_qkv(b=1, sq=1024, skv=1024, d=64))
    assert never.selected == "cudnn" and "head_dim 64 non-causal any q_len measured" in never.reasons["pallas"]
    hd64c = te_jax.explain_attention_backend(*_qkv(b=1, sq=1024, skv=1024, d=64), attn_mask_type="causal")
    assert hd64c.selected == "pallas" and "head_dim 64 causal q_len <= 16384" in hd64c.reasons["cudnn"]
    assert "separate dQ kernel (keys 1024 < 2048" in hd64c.detail
    hd64c32k = te_jax.explain_attention_backend(*_qkv(b=1, sq=32768, skv=32768, d=64), attn_mask_type="causal")
    assert hd64c32k.selected == "cudnn" and "q_len > 16384" in hd64c32k.reasons["pallas"]
    hd256 = te_jax.explain_attention_backend(*_qkv(b=1, sq=1024, skv=1024, d=256))
    assert hd256.selected == "pallas" and "run7_hd64_hd256" in hd256.reasons["cudnn"]
    hd256_4k = te_jax.explain_attention_backend(*_qkv(b=1, sq=4096, skv=4096, d=256), attn_mask_type="causal")
    assert hd256_4k.selected == "cudnn" and "head_dim 256 causal q_len > 1024" in hd256_4k.reasons["pallas"]
    monkeypatch.setattr(selection.BACKENDS["pallas"], "hopper_reason", lambda call: "GPU arch sm80 is not sm90")
    other = te_jax.explain_attention_backend(*_qkv(sq=1024, skv=1024, d=128), attn_mask_type="causal")
    assert other.selected == "cudnn" and "portable Pallas kernel" in other.reasons["pallas"]
    # Where cuDNN cannot serve (softcap), the Pallas kernel runs and the explanation names the Hopper reason.
    capped = te_jax.explain_attention_backend(*_qkv(), softcap=30.0)
    assert capped.selected == "pallas" and "portable" in capped.detail


def test_trace_time_refusal_falls_back_in_auto_and_is_explained(monkeypatch):
    """A backend that refuses at trace time (as cuDNN does for an unsupported plan) hands the call to
    the next serving backend in auto mode, and raises a ValueError naming it when forced."""
    from te_jax.backends import selection

    q, k, v = _qkv(dtype=jnp.float32)
    pallas = selection.BACKENDS["pallas"]

    def refuse(*args, **kwargs):
        raise NotImplementedError("no valid execution plan")

    monkeypatch.setattr(pallas, "forward", refuse)
    from te_jax.backends import tuning

    monkeypatch.setattr(tuning, "ATTENTION_OTHER_PREFERENCE", tuning.Tuned(("pallas", "xla", "cudnn"), "stand-in", ""))
    monkeypatch.setattr(pallas, "unsupported_reason", lambda call, forced=False: None)
    out = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal")
    np.testing.assert_allclose(out, te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="xla"),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="backend 'pallas' refused the call: NotImplementedError"):
        te_jax.dot_product_attention(q, k, v, backend="pallas")


def test_sm90_hopper_features_wait_for_a_gpu_check(fake_h100, monkeypatch):
    """Auto takes a Hopper-kernel feature only at the head dims a GPU run checked against fp32
    (tuning.HOPPER_GPU_VERIFIED): softcap and ragged lengths are checked at every head dim the kernel has, so auto
    takes them; a feature missing from the table runs on the portable kernel (cuDNN has no softcap) and the
    explanation says why; config=HopperConfig() takes the Hopper kernel anyway. An invalid softcap is refused by
    the kernel by name."""
    from pallas_kernels.flash_attention_hopper import HopperConfig, supports
    from te_jax.backends import pallas as pallas_mod
    from te_jax.backends import tuning

    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)  # sm90 and jax >= 0.11
    shapes = _qkv(sq=1024, skv=1024, d=128)
    capped = te_jax.explain_attention_backend(*shapes, softcap=30.0, attn_mask_type="causal")
    assert capped.selected == "pallas" and "Hopper (Mosaic GPU) kernel" in capped.detail, capped
    assert "softcap 30" in capped.detail and "softcap" in capped.reasons["cudnn"]
    ragged64 = te_jax.explain_attention_backend(*_qkv(sq=1000, skv=1000, d=64), backend="pallas")
    assert "Hopper (Mosaic GPU) kernel" in ragged64.detail, ragged64.detail

    monkeypatch.setattr(tuning, "HOPPER_GPU_VERIFIED", tuning.Tuned({"head dims": ((64, 64), (128, 128)), "softcap": (), "ragged lengths": (128,)},
                                                                    "stand-in", "results.md"))
    capped = te_jax.explain_attention_backend(*shapes, softcap=30.0, attn_mask_type="causal")
    assert capped.selected == "pallas" and capped.detail.startswith("portable"), capped
    assert "softcap at head_dim 128: not yet checked on a GPU" in capped.detail, capped.detail
    assert "checked at no head_dim yet" in capped.detail and "config=HopperConfig()" in capped.detail
    forced = te_jax.explain_attention_backend(*shapes, softcap=30.0, attn_mask_type="causal", config=HopperConfig())
    assert "Hopper (Mosaic GPU) kernel" in forced.detail and "softcap 30" in forced.detail, forced.detail
    ragged64 = te_jax.explain_attention_backend(*_qkv(sq=1000, skv=1000, d=64), backend="pallas")
    assert "ragged lengths at head_dim 64: not yet checked on a GPU for the Hopper kernel (checked at head_dim 128" in ragged64.detail
    plain = te_jax.explain_attention_backend(*shapes, attn_mask_type="causal")
    assert "Hopper (Mosaic GPU) kernel" in plain.detail and "softcap" not in plain.detail
    for bad in (-2.0, float("inf"), "2"):
        assert "finite positive" in supports((1, 128, 4, 64), (1, 128, 2, 64), (1, 128, 2, 64), jnp.bfloat16,
                                             softcap=bad)
    assert supports((1, 128, 4, 64), (1, 128, 2, 64), (1, 128, 2, 64), jnp.bfloat16, softcap=np.float32(2)) is None
    with pytest.raises(ValueError, match="softcap=inf must be a finite number > 0"):
        te_jax.dot_product_attention(*_qkv(), softcap=float("inf"))


def test_sm90_split_head_dims_take_the_hopper_kernel_once_checked(fake_h100, monkeypatch):
    """DeepSeek-V3's head_dim_qk 192 / head_dim_v 128 on sm90: cuDNN is refused (jax.nn needs equal head dims), so
    auto takes the pallas backend; it runs the Hopper kernel once a GPU run checked the pair
    (tuning.HOPPER_GPU_VERIFIED["head dims"]), else the portable kernel with the reason; a data mask at head_dim 192
    waits for its own GPU check ("data mask"); config=HopperConfig() takes the Hopper kernel anyway."""
    from pallas_kernels.flash_attention_hopper import HopperConfig
    from te_jax.backends import pallas as pallas_mod
    from te_jax.backends import tuning

    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)
    q = jax.ShapeDtypeStruct((2, 1024, 8, 192), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1024, 2, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16)
    base = dict(tuning.HOPPER_GPU_VERIFIED.value)
    for pairs in (((128, 128),), ((128, 128), (192, 128))):
        monkeypatch.setattr(tuning, "HOPPER_GPU_VERIFIED", tuning.Tuned(dict(base, **{"head dims": pairs}),
                                                                        "stand-in", "results.md"))
        e = te_jax.explain_attention_backend(q, k, v, attn_mask_type="causal")
        assert e.selected == "pallas" and "head_dim" in e.reasons["cudnn"], e
        if (192, 128) in pairs:
            assert "Hopper (Mosaic GPU) kernel" in e.detail, e.detail
        else:
            assert e.detail.startswith("portable") and "192/128: not yet checked on a GPU" in e.detail, e.detail
            forced = te_jax.explain_attention_backend(q, k, v, attn_mask_type="causal", config=HopperConfig())
            assert "Hopper (Mosaic GPU) kernel" in forced.detail, forced.detail
    for data_mask_dims in ((64, 128, 256), (64, 128, 192, 256)):
        monkeypatch.setattr(tuning, "HOPPER_GPU_VERIFIED", tuning.Tuned(dict(base, **{"data mask": data_mask_dims}),
                                                                        "stand-in", "results.md"))
        seg = te_jax.explain_attention_backend(q, k, v, attn_mask_type="padding_causal", backend="pallas",
                                               q_seqlens=jnp.array([1000, 700]), kv_seqlens=jnp.array([1000, 700]))
        if 192 in data_mask_dims:
            assert "Hopper (Mosaic GPU) kernel" in seg.detail, seg.detail
        else:
            assert seg.detail.startswith("portable") and "data mask at head_dim 192: not yet checked" in seg.detail, \
                seg.detail


def test_hopper_refuses_a_config_whose_key_block_would_be_all_padding():
    """hopper_attention pads a ragged kv_len to whole 128-blocks; a HopperConfig with 64-key forward blocks could
    then make a block of padding alone (a NaN stream-K piece): refused by name before anything runs."""
    from pallas_kernels.flash_attention_hopper import HopperConfig, hopper_attention

    q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    k = jnp.zeros((1, 4000, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"block_kv=64 with kv_len 4000 \(padded to 4096\): a key block would hold "
                                         r"only padding"):
        hopper_attention(q, k, k, scale=0.1, config=HopperConfig(block_kv=64))


def test_sm90_ragged_lengths_take_the_hopper_kernel_padded(fake_h100, monkeypatch):
    """Lengths that are not multiples of 128 are served by the Hopper kernel (zeros up to whole blocks, padded keys
    masked, or hidden by the causal diagonal); the explanation says so."""
    from te_jax.backends import pallas as pallas_mod

    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)
    full = te_jax.explain_attention_backend(*_qkv(sq=1000, skv=1500, d=128))
    assert full.selected == "pallas" and "Hopper (Mosaic GPU) kernel" in full.detail, full
    assert "q_len 1000, kv_len 1500 padded with zeros to a multiple of 128" in full.detail
    assert "masked on every K/V step" in full.detail
    causal = te_jax.explain_attention_backend(*_qkv(sq=1000, skv=1000, d=128), attn_mask_type="causal")
    assert "hidden by the causal diagonal" in causal.detail, causal.detail
    whole = te_jax.explain_attention_backend(*_qkv(sq=1024, skv=1024, d=128), attn_mask_type="causal")
    assert "padded" not in whole.detail


def test_sm90_data_masks_take_the_hopper_kernel(fake_h100, monkeypatch):
    """On sm90, padding (seqlens or segment ids), thd documents, windows, bottom-right and unequal-length causal
    run on the Hopper kernel's data-mask schedule (GPU-checked: tuning.HOPPER_GPU_VERIFIED), one-segment ones as
    bands (the explanation says so, with the offset); a dense mask and a
    bias keep it out by name; without the GPU check auto leaves data masks to the portable kernel."""
    from te_jax.backends import pallas as pallas_mod
    from te_jax.backends import tuning

    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)
    monkeypatch.setattr(tuning, "HOPPER_ALIGNED_TILES_MIN_LEN", tuning.Tuned(1024, "test", "none"))
    q, k, v = _qkv(b=2, sq=1024, skv=1024, d=128)
    lens = jnp.array([1024, 700], jnp.int32)
    seg = jnp.concatenate([jnp.ones((2, 300), jnp.int32), 2 * jnp.ones((2, 724), jnp.int32)], axis=1)
    cases = {
        "padding_causal from seqlens": dict(attn_mask_type="padding_causal", q_seqlens=lens, kv_seqlens=lens),
        "segments": dict(attn_mask_type="padding_causal", q_segment_ids=seg, kv_segment_ids=seg),
        "window": dict(attn_mask_type="causal", window_size=(128, 0)),
        "two-sided window": dict(window_size=(64, 64)),
    }
    for name, kw in cases.items():
        choice = te_jax.explain_attention_backend(q, k, v, backend="pallas", **kw)
        assert choice.selected == "pallas" and "data-mask schedule" in choice.detail, (name, choice.detail)
        # windows (one segment, token-index positions) as bands; documents and padding on tables
        assert ("as a band" in choice.detail) == ("window" in name), (name, choice.detail)
        # documents on document-aligned tiles (tuning.HOPPER_ALIGNED_TILES_AUTO), padding on the grid's
        assert ("one CTA per query tile" in choice.detail) == (name == "padding_causal from seqlens"), (
            name, choice.detail)
        assert ("forward on document-aligned tiles" in choice.detail) == (name == "segments"), (name, choice.detail)
        # the dQ kernel computes delta (HopperConfig.bwd_delta_in_dq) on every one of these (narrow bands, tables)
        assert "which computes delta = rowsum(O * dO)" in choice.detail, (name, choice.detail)
    br = te_jax.explain_attention_backend(*_qkv(b=2, sq=256, skv=1024, d=128), attn_mask_type="causal_bottom_right",
                                          backend="pallas")
    assert "data-mask schedule" in br.detail and "causal_bottom_right" in br.detail, br.detail
    assert "as a band" in br.detail and "offset 768" in br.detail and "no pre-pass" in br.detail, br.detail
    from pallas_kernels.flash_attention_hopper import HopperConfig

    off = te_jax.explain_attention_backend(
        q, k, v, backend="pallas", attn_mask_type="padding_causal", q_segment_ids=seg, kv_segment_ids=seg,
        config=HopperConfig(bwd_delta_in_dq=False))
    assert "from an XLA reduction first" in off.detail, off.detail
    persistent = te_jax.explain_attention_backend(q, k, v, backend="pallas", window_size=(64, 64),
                                                  config=HopperConfig(bwd_persistent_band=True,
                                                                      fwd_persistent_band=True))
    assert "dK/dV on a persistent grid (bwd_persistent_band)" in persistent.detail, persistent.detail
    assert "forward on a persistent grid (fwd_persistent_band)" in persistent.detail, persistent.detail
    # auto: a causal band of 512 keys or more runs its forward on the persistent grid (its warpgroups on the named
    # barrier from 1024 keys), a narrower one on the grid kernel; a two-sided window of at most 513 keys too
    wide = te_jax.explain_attention_backend(q, k, v, backend="pallas", attn_mask_type="causal", window_size=(1023, 0))
    mid = te_jax.explain_attention_backend(q, k, v, backend="pallas", attn_mask_type="causal", window_size=(511, 0))
    narrow = te_jax.explain_attention_backend(q, k, v, backend="pallas", attn_mask_type="causal",
                                              window_size=(255, 0))
    assert "forward on a persistent grid" in wide.detail and "forward on a persistent grid" not in narrow.detail, (
        wide.detail, narrow.detail)
    assert "through mbarriers" not in wide.detail and "through mbarriers (a narrow band)" in mid.detail, mid.detail
    two_sided = te_jax.explain_attention_backend(q, k, v, backend="pallas", window_size=(256, 256))
    assert "forward on a persistent grid (fwd_persistent_band), its warpgroups taking turns through mbarriers" in (
        two_sided.detail), two_sided.detail
    assert "heaviest first" in narrow.detail and "heaviest first" in br.detail, (narrow.detail, br.detail)
    # 192/128 under documents and a window: dK and dV in one launch on 32-row query blocks (default_config(...,
    # masked=True), the config hopper_attention(mask=) takes); 192/192 in two
    for kw in (dict(attn_mask_type="padding_causal", q_segment_ids=seg, kv_segment_ids=seg),
               dict(attn_mask_type="causal", window_size=(128, 0))):
        split = te_jax.explain_attention_backend(*_qkv(b=2, sq=1024, skv=1024, d=192, dv=128), backend="pallas",
                                                 **kw)
        assert "backward dK and dV in one launch (32-row query blocks)" in split.detail, split.detail
        same = te_jax.explain_attention_backend(*_qkv(b=2, sq=1024, skv=1024, d=192), backend="pallas", **kw)
        assert "backward dK and dV in two launches" in same.detail, same.detail
    assert "dK and dV in" not in te_jax.explain_attention_backend(q, k, v, backend="pallas", **kw).detail
    tq, tk, tv = _qkv(b=1, sq=1024, skv=1024, d=128, fmt="thd")
    docs = jnp.array([300, 1, 723], jnp.int32)
    thd = te_jax.explain_attention_backend(tq, tk, tv, attn_input_format="thd", attn_mask_type="padding_causal",
                                           q_seqlens=docs, kv_seqlens=docs, backend="pallas")
    assert "data-mask schedule" in thd.detail, thd.detail
    dense = te_jax.explain_attention_backend(q, k, v, mask=jnp.zeros((2, 1, 1024, 1024), bool), backend="pallas")
    assert dense.detail.startswith("portable") and "dense boolean mask" in dense.detail, dense.detail
    biased = te_jax.explain_attention_backend(q, k, v, bias=jnp.zeros((1, 4, 1024, 1024), jnp.bfloat16),
                                              backend="pallas")
    assert biased.detail.startswith("portable") and "bias" in biased.detail, biased.detail
    plain = te_jax.explain_attention_backend(q, k, v, attn_mask_type="causal", backend="pallas")
    assert "data-mask" not in plain.detail and "Hopper (Mosaic GPU) kernel" in plain.detail
    monkeypatch.setattr(tuning, "HOPPER_GPU_VERIFIED", tuning.Tuned(
        {"head dims": ((128, 128),), "softcap": (128,), "ragged lengths": (128,), "data mask": ()}, "stand-in",
        "results.md"))
    unchecked = te_jax.explain_attention_backend(q, k, v, backend="pallas", **cases["window"])
    assert unchecked.detail.startswith("portable") and "data mask at head_dim 128: not yet checked" in unchecked.detail


def test_sm90_data_mask_explanation_counts_the_tiles(fake_h100, monkeypatch):
    """With concrete seqlens, the explanation of a data-mask call on the Hopper kernel counts the forward's
    (query tile, key tile) pairs it computes, masks and skips (per head), from the same tables the kernel reads."""
    from te_jax.backends import pallas as pallas_mod

    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)
    q, k, v = _qkv(b=2, sq=512, skv=512, d=128)
    lens = jnp.array([512, 200], jnp.int32)
    choice = te_jax.explain_attention_backend(q, k, v, attn_mask_type="padding_causal", q_seqlens=lens,
                                              kv_seqlens=lens, backend="pallas")
    # 128 x 128 tiles, 16 per batch row. Row 0 (causal, 512 tokens): 10 visible, the 4 diagonal ones partial.
    # Row 1 (200 tokens): query tile 0 sees key tile 0 (diagonal: partial); query tile 1 (rows 128-199 valid)
    # sees key tiles 0 and 1, both partial (padding rows); query tiles 2 and 3 are padding and see nothing.
    # The partial ones by what their element mask compares: the 5 diagonal tiles without padding positions only;
    # row 1's (query tile 1, key tile 0) segments only (every valid query is past every key), its diagonal both.
    assert ("forward tiles (128 queries x 128 keys, per head): 13 of 32 computed (7 with the element mask: 5 "
            "comparing positions only, 1 segments only, 1 both; 6 full), 19 skipped") in choice.detail, choice.detail
    plain = te_jax.explain_attention_backend(q, k, v, attn_mask_type="causal", backend="pallas")
    assert "forward tiles" not in plain.detail


def test_sm90_data_mask_compares_segments_only_where_there_are_any(fake_h100, monkeypatch):
    """The front door tells the Hopper data-mask kernels whether a call has more than one segment: windows and
    bottom-right causal without padding compare positions only (mask_segments=False, and the explanation says so),
    computed from token indices (mask_offset: kv_len - q_len bottom-right, else 0; checked against the mask's
    positions); padding (lengths or segment ids) and thd documents keep the segment compare and read positions.
    The kernel is recorded, not run."""
    import pallas_kernels.flash_attention_hopper as fh
    from te_jax.backends import pallas as pallas_mod

    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)
    seen = []

    offsets = []

    def record(q, k, v, *, mask=None, mask_segments=True, mask_offset=None, **kw):
        seen.append(mask_segments)
        offsets.append(mask_offset)
        if mask_offset is not None:  # the front door's claim: query i at i + offset, key j at j (token indices)
            qd = np.asarray(mask.q_positions) - np.arange(mask.q_len)
            kd = np.asarray(mask.kv_positions) - np.arange(mask.kv_len)
            assert np.all(qd - kd[:, :1] == mask_offset) and np.all(kd == kd[:, :1]), (mask_offset, qd, kd)
        return (jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1])))

    monkeypatch.setattr(fh, "hopper_attention", record)
    x = jnp.zeros((2, 512, 4, 128), jnp.bfloat16)
    t = jnp.zeros((512, 4, 128), jnp.bfloat16)
    lens = jnp.array([512, 300], jnp.int32)
    calls = [(dict(attn_mask_type="causal", window_size=(128, 0)), (x, x, x), False),
             (dict(attn_mask_type="no_mask", window_size=(64, 64)), (x, x, x), False),
             (dict(attn_mask_type="causal_bottom_right"), (x[:, :256], x, x), False),
             (dict(attn_mask_type="causal", window_size=(64, 0)), (x[:, :256], x, x), False),
             (dict(attn_mask_type="padding_causal", window_size=(128, 0), q_seqlens=lens, kv_seqlens=lens), (x, x, x),
              True),
             (dict(attn_mask_type="padding", q_segment_ids=jnp.ones((2, 512), jnp.int32),
                   kv_segment_ids=jnp.ones((2, 512), jnp.int32)), (x, x, x), True),
             (dict(attn_input_format="thd", attn_mask_type="padding_causal", q_seqlens=jnp.array([200, 312]),
                   kv_seqlens=jnp.array([200, 312])), (t, t, t), True)]
    for kw, shapes, segments in calls:
        kw = {"attn_input_format": "bshd", **kw}
        seen.clear()
        offsets.clear()
        te_jax.dot_product_attention(*shapes, backend="pallas", **kw)  # eager: record sees concrete positions
        assert seen == [segments], (kw, seen)
        bottom_right = kw["attn_mask_type"].endswith("bottom_right")
        want = None if segments else (shapes[1].shape[1] - shapes[0].shape[1]) * bottom_right  # kv_len - q_len
        assert offsets == [want], (kw, offsets)
        detail = te_jax.explain_attention_backend(*shapes, backend="pallas", **kw).detail
        assert "data-mask schedule" in detail and ("positions only: one segment" in detail) == (not segments), detail


@pytest.mark.parametrize("env", [None, "auto", "1", "0"])
def test_sm90_aligned_tiles_only_for_documents_and_only_when_tuned_on(fake_h100, monkeypatch, env):
    """tuning.HOPPER_ALIGNED_TILES_AUTO (on by measurement; both values tried): where it is on (at head dims
    128/128 only), or with TE_JAX_HOPPER_ALIGNED_TILES=1, auto passes mask_aligned=True for documents (segment ids,
    thd) and not for padding from lengths or windows (TE_JAX_HOPPER_ALIGNED_TILES=0: never); the explanation counts
    the aligned tiles without a grid total, says the backward follows and how to turn them off, or why they are off
    and how to turn them on."""
    import pallas_kernels.flash_attention_hopper as fh
    from te_jax.backends import pallas as pallas_mod
    from te_jax.backends import tuning

    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)
    seen = []
    real = fh.hopper_attention

    def record(q, k, v, *, mask_aligned=False, **kw):
        seen.append(mask_aligned)
        return (jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1])))

    x = jnp.zeros((2, 512, 4, 128), jnp.bfloat16)
    t = jnp.zeros((512, 4, 128), jnp.bfloat16)
    lens = jnp.array([512, 300], jnp.int32)
    docs = jnp.asarray(np.repeat(np.arange(1, 4), [100, 300, 112])[None].repeat(2, 0), jnp.int32)
    calls = [(dict(attn_mask_type="padding_causal", q_segment_ids=docs, kv_segment_ids=docs), (x, x, x), True),
             (dict(attn_input_format="thd", attn_mask_type="padding_causal", q_seqlens=jnp.array([200, 312]),
                   kv_seqlens=jnp.array([200, 312])), (t, t, t), True),
             (dict(attn_mask_type="padding_causal", q_seqlens=lens, kv_seqlens=lens), (x, x, x), False),
             (dict(attn_mask_type="causal", window_size=(128, 0)), (x, x, x), False)]
    if env is None:
        monkeypatch.delenv("TE_JAX_HOPPER_ALIGNED_TILES", raising=False)
    else:
        monkeypatch.setenv("TE_JAX_HOPPER_ALIGNED_TILES", env)
    monkeypatch.setattr(tuning, "HOPPER_ALIGNED_TILES_MIN_LEN", tuning.Tuned(512, "test", "none"))
    for tuned in (False, True):
        monkeypatch.setattr(tuning, "HOPPER_ALIGNED_TILES_AUTO", tuning.Tuned(tuned, "test", "none"))
        on = tuned if env in (None, "auto") else env == "1"
        for kw, shapes, aligned in calls:
            kw = {"attn_input_format": "bshd", **kw}
            seen.clear()
            monkeypatch.setattr(fh, "hopper_attention", record)
            jax.make_jaxpr(lambda q, k, v: te_jax.dot_product_attention(q, k, v, backend="pallas", **kw))(*shapes)
            assert seen == [on and aligned], (on, kw, seen)
            monkeypatch.setattr(fh, "hopper_attention", real)
            detail = te_jax.explain_attention_backend(*shapes, backend="pallas", **kw).detail
            assert ("forward on document-aligned tiles" in detail) == (on and aligned), detail
            assert ("backward's dQ and dK/dV kernels on document-aligned tiles" in detail) == (on and aligned)
            assert ("TE_JAX_HOPPER_ALIGNED_TILES=1 turns them on" in detail) == (not on and aligned), detail
            assert ("TE_JAX_HOPPER_ALIGNED_TILES=0 keeps the global grid" in detail) == (
                on and aligned and env in (None, "auto")), detail
            if on and aligned and kw["attn_input_format"] == "bshd":
                assert "starting at every document" in detail and "skipped" not in detail, detail
    # auto takes them at head dims 128/128 only (the ones measured)
    monkeypatch.setattr(tuning, "HOPPER_ALIGNED_TILES_AUTO", tuning.Tuned(True, "test", "none"))
    x64 = jnp.zeros((2, 512, 4, 64), jnp.bfloat16)
    detail = te_jax.explain_attention_backend(x64, x64, x64, backend="pallas", attn_input_format="bshd",
                                              **calls[0][0]).detail
    assert (env in (None, "auto")) == ("measured at head dims 128/128 only, this call has 64/64" in detail), detail
    assert ("forward on document-aligned tiles" in detail) == (env == "1"), detail
    # ... and on key rows of at least tuning.HOPPER_ALIGNED_TILES_MIN_LEN tokens (bshd rows; thd: every token)
    monkeypatch.setattr(tuning, "HOPPER_ALIGNED_TILES_MIN_LEN", tuning.Tuned(1024, "test", "none"))
    for kw, shapes, _ in calls[:2]:
        detail = te_jax.explain_attention_backend(*shapes, backend="pallas", **{"attn_input_format": "bshd", **kw}
                                                  ).detail
        assert (env in (None, "auto")) == ("key rows of 512 tokens, under the 1024" in detail), detail
        assert ("forward on document-aligned tiles" in detail) == (env == "1"), detail
    monkeypatch.setenv("TE_JAX_HOPPER_ALIGNED_TILES", "yes")
    with pytest.raises(ValueError, match="TE_JAX_HOPPER_ALIGNED_TILES='yes' must be one of"):
        te_jax.explain_attention_backend(x, x, x, backend="pallas", attn_input_format="bshd", **calls[0][0])


def test_sm90_work_around_the_kernels_has_no_loop(fake_h100, monkeypatch):
    """What runs around the attention kernels on sm90 for thd lengths (forward and gradients; the data-mask work
    that padding and segment ids share) and a decode step with cache lengths holds no scan or while loop: XLA may
    keep a loop as a GPU while loop, with kernel launches and a host check per step, on every call. Traced only
    (jax.make_jaxpr): the Hopper kernels trace on the CPU when not in interpret mode."""
    from pallas_kernels.flash_attention_hopper import common as hopper_common
    from te_jax.backends import pallas as pallas_mod

    monkeypatch.setattr(pallas_mod, "hopper_device_reason", lambda: None)
    monkeypatch.setattr(hopper_common, "default_interpret", lambda: False)
    shape = lambda *s: jnp.zeros(s, jnp.bfloat16)
    lens, docs = jnp.array([1024, 700], jnp.int32), jnp.array([300, 1, 723], jnp.int32)
    calls = {
        "thd lengths": (dict(attn_input_format="thd", attn_mask_type="padding_causal", q_seqlens=docs,
                             kv_seqlens=docs), (shape(1024, 4, 128),) * 3),
        "decode step": (dict(attn_mask_type="padding", q_seqlens=jnp.ones(2, jnp.int32), kv_seqlens=lens),
                        (shape(2, 1, 4, 128), shape(2, 1024, 4, 128), shape(2, 1024, 4, 128))),
    }
    for name, (kw, shapes) in calls.items():
        f = lambda q, k, v, kw=kw: te_jax.dot_product_attention(q, k, v, backend="pallas", **kw)
        detail = te_jax.explain_attention_backend(*shapes, backend="pallas", **kw).detail
        assert "data-mask schedule" in detail or "decode kernel" in detail, (name, detail)
        grad = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        fns = (("forward", f), ("gradients", grad)) if name == "thd lengths" else (("forward", f),)  # CI time
        for what, fn in fns:
            loops = {e.primitive.name for e in walk(jax.make_jaxpr(fn)(*shapes).jaxpr)} & {"scan", "while"}
            assert not loops, (name, what, loops)
