"""A catalogue of bad calls to every public function and module beyond attention's own
(tests/test_attention_errors.py, tests/test_layouts.py): each raises ValueError or TypeError whose
message names the argument and the fix."""
import jax
import jax.numpy as jnp
import pytest

import te_jax
from te_jax import flax as tf

import test_attention_errors
import test_layouts

x = jnp.ones((4, 16))
g, b = jnp.ones(16), jnp.ones(16)
w1, w2 = jnp.ones((16, 1, 32)), jnp.ones((32, 16))
q8 = jnp.ones((2, 8, 2, 8))
h = jnp.ones((2, 8, 64))
KEY = jax.random.key(0)


def _mesh():
    return jax.make_mesh((4,), ("cp",))


def _layer(**kw):
    cfg = dict(hidden_size=64, mlp_hidden_size=128, num_attention_heads=4)
    cfg.update(kw)
    return tf.TransformerLayer(**cfg)


CATALOGUE = [
    # norms
    ("norm unknown type", lambda: te_jax.norm(x, g, b, layernorm_type="batchnorm"), ["layernorm_type='batchnorm'", "rmsnorm"]),
    ("layernorm gamma shape", lambda: te_jax.layernorm(x, jnp.ones(15), b), ["gamma", "(15,)", "(16,)"]),
    ("layernorm beta shape", lambda: te_jax.layernorm(x, g, jnp.ones(3)), ["beta", "(3,)"]),
    ("layernorm int input", lambda: te_jax.layernorm(x.astype(jnp.int32), g, b), ["dtype int32", "astype"]),
    ("layernorm unknown backend", lambda: te_jax.layernorm(x, g, b, backend="cuda"), ["backend='cuda'"]),
    ("rmsnorm 2-d gamma", lambda: te_jax.rmsnorm(x, jnp.ones((2, 16))), ["gamma", "(2, 16)"]),
    # MLP and dense
    ("mlp unknown activation", lambda: te_jax.layernorm_mlp(x, g, b, w1, None, w2, None, activations=("swish",)),
     ["swish", "Valid choices"]),
    ("mlp w1 hidden mismatch", lambda: te_jax.layernorm_mlp(x, g, b, jnp.ones((15, 1, 32)), None, w2, None),
     ["w1", "(15, 1, 32)", "(16, 1, 32)"]),
    ("mlp gated pair needs two", lambda: te_jax.layernorm_mlp(x, g, b, w1, None, w2, None, activations=("silu", "linear")),
     ["w1", "(16, 2, 32)"]),
    ("mlp w2 mismatch", lambda: te_jax.layernorm_mlp(x, g, b, w1, None, jnp.ones((31, 16)), None), ["w2", "(31, 16)"]),
    ("mlp b2 shape", lambda: te_jax.layernorm_mlp(x, g, b, w1, None, w2, jnp.ones(3)), ["b2", "(3,)", "(16,)"]),
    ("dense w first axis", lambda: te_jax.layernorm_dense(x, g, b, jnp.ones((8, 4))), ["w", "(8, 4)", "16"]),
    # context parallelism
    ("cp length not divisible", lambda: te_jax.context_parallel_attention(
        jnp.ones((2, 6, 2, 8)), jnp.ones((2, 6, 2, 8)), jnp.ones((2, 6, 2, 8)), cp_axis="cp", mesh=_mesh(),
        attn_mask_type="causal"), ["sequence length 6", "2·cp_size = 8", "Pad"]),
    ("cp length one", lambda: te_jax.context_parallel_attention(
        jnp.ones((2, 1, 2, 8)), jnp.ones((2, 1, 2, 8)), jnp.ones((2, 1, 2, 8)), cp_axis="cp", mesh=_mesh(),
        attn_mask_type="causal"), ["sequence length 1"]),
    ("cp axis missing", lambda: te_jax.context_parallel_attention(q8, q8, q8, cp_axis="sp", mesh=_mesh()),
     ["cp_axis='sp'", "('cp',)"]),
    ("cp unknown strategy", lambda: te_jax.context_parallel_attention(q8, q8, q8, cp_axis="cp", mesh=_mesh(),
                                                                      strategy="tree"), ["strategy='tree'"]),
    ("cp without mesh", lambda: te_jax.context_parallel_attention(q8, q8, q8, cp_axis="cp"), ["no mesh", "set_mesh"]),
    ("reorder not divisible", lambda: te_jax.reorder_causal_load_balancing(jnp.ones((2, 6, 2, 8)), 4, 1),
     ["sequence length 6", "2·cp_size = 8"]),
    # Flax modules
    ("layer per-head input", lambda: _layer().init(KEY, jnp.ones((2, 8, 4, 16))), ["rank 4", "[batch, seq, hidden]"]),
    ("layer hidden mismatch", lambda: _layer().init(KEY, jnp.ones((2, 8, 48))), ["hidden = 64", "48"]),
    ("layer heads do not divide hidden", lambda: _layer(num_attention_heads=5).init(KEY, h),
     ["num_attention_heads=5", "divisible"]),
    ("layer gqa groups", lambda: _layer(num_gqa_groups=3).init(KEY, h), ["num_gqa_groups=3"]),
    ("layer unknown mask", lambda: _layer(self_attn_mask_type="diag").init(KEY, h), ["attn_mask_type='diag'"]),
    ("layer unknown activation", lambda: _layer(mlp_activations=("swish",)).init(KEY, h), ["swish"]),
    ("layer unknown format", lambda: _layer(attn_input_format="bsh").init(KEY, h), ["attn_input_format='bsh'"]),
    ("mha rank-2 input", lambda: tf.MultiHeadAttention(head_dim=16, num_attention_heads=4).init(
        KEY, jnp.ones((8, 64)), jnp.ones((8, 64))), ["inputs_q", "(8, 64)", "thd"]),
    ("layernorm module type", lambda: tf.LayerNorm(layernorm_type="foo").init(KEY, h), ["layernorm_type='foo'"]),
    ("dense axis out of range", lambda: tf.DenseGeneral(features=8, axis=3).init(KEY, h), ["axis=3"]),
]


@pytest.mark.parametrize("name,fn,fragments", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_call_is_explained(name, fn, fragments):
    with pytest.raises((ValueError, TypeError)) as e:
        fn()
    for f in fragments:
        assert f in str(e.value), f"{name}: {f!r} not in {str(e.value)!r}"


def test_catalogue_covers_at_least_forty_distinct_bad_calls():
    total = len(CATALOGUE) + len(test_attention_errors.BAD) + len(test_layouts.BAD_UNPACK)
    assert total >= 40, total
