"""Kernels are traced and lowered once per (shapes, dtypes, static configuration), not once per call site.

pallas_kernels/_lower_once.py wraps each kernel entry point in jax.jit: identical layers then share one
lowered function in the module (what keeps compile time flat in the number of layers on a GPU), and
calls that differ in a shape or a static argument never share one.
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _lower_once
from pallas_kernels.flash_attention_hopper import backward as hopper_bwd
from pallas_kernels.flash_attention_hopper import forward as hopper_fwd
from te_jax.flax import TransformerLayer


class _Stack(nn.Module):
    heads: tuple = (4, 4)
    epsilons: tuple = (1e-6, 1e-6)

    @nn.compact
    def __call__(self, x):
        for i, (h, eps) in enumerate(zip(self.heads, self.epsilons)):
            x = TransformerLayer(hidden_size=32, mlp_hidden_size=64, num_attention_heads=h, layernorm_epsilon=eps,
                                 hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
                                 mlp_activations=("gelu",), enable_relative_embedding=False,
                                 attention_backend="pallas", norm_backend="pallas", mlp_backend="pallas",
                                 name=f"layer_{i}")(x, deterministic=True)
        return x


def _step(model):
    x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(1), x)  # shapes only: lowering runs no kernel
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2))), params, x


def _definitions(text, name):
    """How many functions of the lowered module are the kernel entry point `name` (name, name_12, ...)."""
    return len(re.findall(rf"func\.func (?:private |public )?@{name}(?:_\d+)?\(", text))


def _lowered_text(model):
    f, params, x = _step(model)
    return f.lower(params, x).as_text()


def test_identical_layers_share_one_lowered_kernel():
    text = _lowered_text(_Stack())
    for name in ("norm_fwd", "_fwd_impl", "_bwd_impl"):
        assert _definitions(text, name) == 1, name
    # the shared function is called from both layers
    fwd_calls = len(re.findall(r"call @flash_attention\b", text))
    assert fwd_calls == 2


def test_different_shapes_or_configurations_never_share():
    text = _lowered_text(_Stack(heads=(4, 2)))  # head count differs: other q/k/v shapes
    assert _definitions(text, "_fwd_impl") == 2
    assert _definitions(text, "_bwd_impl") == 2
    text = _lowered_text(_Stack(epsilons=(1e-6, 1e-5)))  # a static argument of the norm differs
    assert _definitions(text, "norm_fwd") == 2


def test_disabled_lowers_at_every_call_site_with_the_same_result():
    f, params, x = _step(_Stack())
    with _lower_once.disabled():
        text = f.lower(params, x).as_text()
    assert _definitions(text, "norm_fwd") == 0
    from pallas_kernels.norms import norm

    xs = jax.random.normal(jax.random.key(2), (8, 32), jnp.float32)
    gamma = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), (32,), jnp.float32)
    beta = 0.1 * jax.random.normal(jax.random.key(4), (32,), jnp.float32)
    shared = norm.norm_fwd(xs, gamma, beta, epsilon=1e-5)
    with _lower_once.disabled():
        inline = norm.norm_fwd(xs, gamma, beta, epsilon=1e-5)
    for a, b in zip(shared, inline):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_hopper_entry_points_are_shared():
    # The Hopper kernels lower only for an sm90 GPU (jax >= 0.11); their sharing is measured by
    # benchmarks/compile_time_gpu.py. Here: both entry points go through the same wrapper.
    for fn in (hopper_fwd.flash_fwd, hopper_bwd.flash_bwd):
        assert callable(getattr(fn, "shared", None)), fn
