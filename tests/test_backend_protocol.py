"""The declared backend interface (te_jax/backends/base.py): every registered backend satisfies it,
capabilities replace hasattr probes, and reasons carry a kind that fallback reads instead of text."""
import dataclasses

import jax.numpy as jnp
import pytest

import te_jax
from helpers import qkv, spy_kernel_configs
from te_jax.backends import base, selection


@pytest.mark.parametrize("name", list(selection.BACKENDS))
def test_registered_backend_satisfies_protocol(name):
    b = selection.BACKENDS[name]
    assert isinstance(b, base.AttentionBackend)
    assert isinstance(b.capabilities, base.Capabilities) and b.name == name
    for cap, proto in base.CAPABILITY_PROTOCOLS.items():
        if getattr(b.capabilities, cap):
            assert isinstance(b, proto), (name, cap)
    base.check_backend(b)


def test_declared_capabilities():
    caps = {n: b.capabilities for n, b in selection.BACKENDS.items()}
    assert caps["pallas"].split_backward and caps["pallas"].ring_blocks and caps["pallas"].packed_inputs
    assert caps["pallas"].opaque_kernel and caps["pallas"].dense_mask
    assert caps["xla"].split_backward and caps["xla"].dense_mask and not caps["xla"].ring_blocks
    assert caps["cudnn"] == base.Capabilities()
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps["xla"].split_backward = False


def test_check_backend_refuses_undeclared_methods():
    class Half:
        name = "half"
        capabilities = base.Capabilities(split_backward=True)

        def unsupported_reason(self, call, forced=False):
            return None

        def choice_detail(self, call):
            return ""

        def forward(self, *a, **k):
            raise NotImplementedError

    with pytest.raises(TypeError, match="declares split_backward but does not implement SplitBackward"):
        base.check_backend(Half())
    with pytest.raises(TypeError, match="does not satisfy"):
        base.check_backend(object())


def test_disable_env_names():
    assert selection.disable_env("pallas") == "TE_JAX_PALLAS_ATTN" and selection.disable_env("xla") == "TE_JAX_XLA_ATTN"
    assert selection.ATTENTION.disable_env == {n: selection.disable_env(n) for n in selection.BACKEND_NAMES}


SMALL = (0, 1, 8, 8, 2, 2, 16)  # helpers.qkv(seed, b, sq, skv, h, g, d)


def test_reasons_carry_kinds(monkeypatch):
    choice = te_jax.explain_attention_backend(*qkv(*SMALL))  # CPU: xla first, pallas needs forcing
    assert choice.selected == "xla"
    assert choice.reasons["pallas"].kind is base.ReasonKind.UNSUPPORTED
    assert choice.reasons["cudnn"].kind is base.ReasonKind.UNSUPPORTED
    forced = te_jax.explain_attention_backend(*qkv(*SMALL), backend="pallas")
    assert forced.reasons["xla"].kind is base.ReasonKind.FALLBACK_ALLOWED and forced.reasons["xla"].fallback_allowed
    assert forced.reasons["xla"] == "serves the call, but 'pallas' was forced by argument"  # still a str
    monkeypatch.setenv("TE_JAX_CUDNN_ATTN", "0")
    off = te_jax.explain_attention_backend(*qkv(*SMALL))
    assert off.reasons["cudnn"].kind is base.ReasonKind.DISABLED
    assert off.reasons["cudnn"] == "disabled by environment TE_JAX_CUDNN_ATTN=0"


def test_fallback_follows_kind_not_text(monkeypatch):
    """A reason whose text starts like a fallback but whose kind is not FALLBACK_ALLOWED is not tried."""
    choice = te_jax.explain_attention_backend(*qkv(*SMALL))
    choice.reasons["pallas"] = base.Reason("serves the call, but no", base.ReasonKind.UNSUPPORTED)
    from te_jax import attention

    prep = attention.prepare_attention(*qkv(*SMALL))
    xla = selection.BACKENDS["xla"]

    def refuse(*a, **k):
        raise NotImplementedError("stand-in refusal")

    monkeypatch.setattr(xla, "forward", refuse)
    with pytest.raises(ValueError, match="every backend refused the call") as e:
        attention.run_backend(choice, prep)
    assert choice.reasons["xla"].kind is base.ReasonKind.REFUSED
    assert "refused at trace time: NotImplementedError: stand-in refusal" in str(e.value)


def test_one_choice_type_for_every_op():
    """Attention, norms and MLP go through one selector (choice.choose) and return one BackendChoice."""
    import jax

    from te_jax.backends import choice, ops

    x = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16)
    got = [te_jax.explain_norm_backend(x), te_jax.explain_mlp_backend(x), te_jax.explain_attention_backend(*qkv(*SMALL))]
    assert all(type(c) is choice.BackendChoice for c in got)
    assert te_jax.BackendChoice is choice.BackendChoice and te_jax.normalization.BackendChoice is choice.BackendChoice
    assert [c.op for c in got] == ["layernorm", "layernorm_mlp", "attention"]
    assert ops.NORM.names == ops.MLP.names == ("pallas", "xla") and selection.ATTENTION.names == selection.BACKEND_NAMES
    forced = te_jax.explain_norm_backend(jax.ShapeDtypeStruct((4, 40000), jnp.bfloat16), backend="pallas")
    assert forced.selected is None and forced.reasons["pallas"].kind is base.ReasonKind.UNSUPPORTED
    assert forced.reasons["xla"] is None


def test_choose_with_a_new_table(monkeypatch):
    from te_jax.backends import choice

    table = choice.OpTable("toy", ("a", "b"), "TE_JAX_TOY_BACKEND", {"a": "TE_JAX_A_TOY"},
                           auto=lambda ctx, reasons: choice.Decision(next(n for n in ("a", "b") if reasons[n] is None)),
                           forced=lambda ctx, name, source, requested, reasons: choice.Decision(name))
    assert choice.choose(table, "auto", lambda n, f: None).selected == "a"
    monkeypatch.setenv("TE_JAX_A_TOY", "off")
    c = choice.choose(table, "auto", lambda n, f: None)
    assert c.selected == "b" and c.reasons["a"].kind is base.ReasonKind.DISABLED
    monkeypatch.setenv("TE_JAX_TOY_BACKEND", "b")
    assert choice.choose(table, "auto", lambda n, f: None).source == "environment TE_JAX_TOY_BACKEND=b"
    with pytest.raises(ValueError, match="toy: backend='c' is not known"):
        choice.choose(table, "c", lambda n, f: None)


def test_tuning_is_data():
    """te_jax's measured choices are Tuned records (value, one line of evidence, a current results file)."""
    import os

    from te_jax.backends import tuning

    recs = [v for v in vars(tuning).values() if isinstance(v, tuning.Tuned)]
    recs += [r for d in (tuning.HOPPER_FASTER_MAX_LEN, tuning.NORM_GPU_PREFERENCE) for r in d.values()]
    assert len(recs) >= 10
    root = os.path.dirname(os.path.dirname(os.path.abspath(tuning.__file__ + "/..")))
    for r in recs:
        assert r.evidence and "\n" not in r.evidence
        assert r.results.startswith("benchmarks/results/") and os.path.exists(os.path.join(root, r.results)), r
    assert tuning.HISTORY_TAG == "benchmarks-history-2026-11-24"
    assert tuning.HOPPER_FASTER_MAX_LEN[(128, True)].value == 16640
    assert te_jax.mlp.GPU_FIRST_GEMM == tuning.MLP_FIRST_GEMM.value == "xla"


# ----------------------------------------------------------------------------- kernel configurations


def test_block_sizes_config_reaches_the_portable_kernel(monkeypatch):
    import jax
    import numpy as np

    seen, cfg = spy_kernel_configs(monkeypatch, "flash_attention")
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, 32, 2, 16), jnp.float32) for kk in ks)
    out = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="pallas", config=cfg)
    assert seen == [("flash_attention", cfg)]
    ref = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="xla")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    choice = te_jax.explain_attention_backend(q, k, v, backend="pallas", config=cfg)
    assert choice.selected == "pallas" and "config=BlockSizes(block_q=16" in choice.detail
    assert "portable Triton-lowered kernel" in choice.detail
    # the other backends say why they take no config; auto on CPU has no backend for it
    assert "takes no kernel configuration" in choice.reasons["xla"]
    with pytest.raises(ValueError, match="No attention backend can serve"):
        te_jax.dot_product_attention(q, k, v, config=cfg)


def test_wrong_config_type_is_a_value_error_naming_config():
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"^config: got dict; expected .*BlockSizes.*HopperConfig"):
        te_jax.dot_product_attention(q, q, q, backend="pallas", config={"block_q": 16})
    with pytest.raises(ValueError, match="^config: got int"):
        te_jax.explain_attention_backend(q, q, q, config=3)


def test_hopper_config_needs_the_hopper_kernel():
    from pallas_kernels.flash_attention_hopper import HopperConfig

    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    choice = te_jax.explain_attention_backend(q, q, q, backend="pallas", config=HopperConfig())
    assert choice.selected is None
    assert choice.reasons["pallas"] == ("config is a HopperConfig, but the Hopper kernel does not serve this call: "
                                        "not a GPU")
    assert choice.reasons["pallas"].kind is base.ReasonKind.UNSUPPORTED


def test_config_reaches_the_kernel_through_the_packed_entry(monkeypatch):
    """dot_product_attention_packed(config=...): validated as the dense entry does, recorded in the explanation,
    and handed to the kernel that reads the packed tensor in place."""
    import jax
    import numpy as np

    seen, cfg = spy_kernel_configs(monkeypatch, "flash_attention_packed")
    x = jax.random.normal(jax.random.key(0), (1, 32, 3, 2, 16), jnp.float32)
    kw = dict(qkv_layout="bs3hd", attn_mask_type="causal", backend="pallas")
    choice = te_jax.explain_attention_backend_packed(x, config=cfg, **kw)
    assert choice.selected == "pallas" and "config=BlockSizes(block_q=16" in choice.detail
    assert choice.packed.startswith("read in place")
    out = te_jax.dot_product_attention_packed(x, config=cfg, **kw)
    assert seen == [("flash_attention_packed", cfg)]
    ref = te_jax.dot_product_attention_packed(x, qkv_layout="bs3hd", attn_mask_type="causal", backend="xla")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert "takes no kernel configuration" in choice.reasons["xla"]
    with pytest.raises(ValueError, match=r"^config: got dict; expected .*BlockSizes.*HopperConfig"):
        te_jax.dot_product_attention_packed(x, config={"block_q": 16}, **kw)


def test_registration_is_one_line(monkeypatch):
    """Everything about the attention backends derives from the registry (`_register(...)` in selection.py):
    the names, their TE_JAX_<NAME>_ATTN switches, the op table, the public list. One registered but absent from
    the automatic preference order is explained and runs when forced."""
    from te_jax.backends import tuning

    assert selection.BACKEND_NAMES == tuple(selection.BACKENDS) == selection.ATTENTION.names == te_jax.ATTENTION_BACKENDS
    assert set(selection.ATTENTION.disable_env) == set(selection.BACKEND_NAMES)
    monkeypatch.setattr(tuning, "ATTENTION_OTHER_PREFERENCE", tuning.Tuned(("pallas", "cudnn"), "stand-in", ""))
    choice = te_jax.explain_attention_backend(*qkv(*SMALL))
    assert choice.selected is None
    assert choice.reasons["xla"].kind is base.ReasonKind.AVOIDED and "preference order" in choice.reasons["xla"]
    assert "backend='xla'" in choice.reasons["xla"]
    assert te_jax.explain_attention_backend(*qkv(*SMALL), backend="xla").selected == "xla"


def test_block_sizes_keep_the_ring_blocks_on_the_portable_kernel(monkeypatch):
    """A BlockSizes config names the portable kernel: the ring's mask-free (Hopper) block path says no, even on sm90."""
    import te_jax.attention as attention_mod
    from pallas_kernels.flash_attention import BlockSizes

    monkeypatch.setattr(attention_mod, "current_platform", lambda: ("gpu", (9, 0)))
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    call = attention_mod.prepare_attention(q, q, q, attn_mask_type="causal", needs_split_vjp=True,
                                           config=BlockSizes(block_q=64, block_kv=64)).call
    why = selection.BACKENDS["pallas"].ring_block_reason(call, q.shape, q.shape, True)
    assert why == "config is the portable kernel's BlockSizes"
