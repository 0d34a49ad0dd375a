"""A catalogue of bad calls to every public function and module beyond attention's own
(tests/test_attention_errors.py, tests/test_layouts.py): each raises ValueError or TypeError whose
message names the argument and the fix."""
import jax
import jax.numpy as jnp
import pytest

import te_jax
from helpers import cpu_mesh
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
    return cpu_mesh((4,), ("cp",))


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
    # traced only (jax.eval_shape): the layer's parts before the bad one would otherwise run op by op, each op
    # compiled on its own, before the error (a static check either way)
    ("layer unknown mask", lambda: jax.eval_shape(_layer(self_attn_mask_type="diag").init, KEY, h),
     ["attn_mask_type='diag'"]),
    ("layer unknown activation", lambda: jax.eval_shape(_layer(mlp_activations=("swish",)).init, KEY, h), ["swish"]),
    ("layer unknown format", lambda: _layer(attn_input_format="bsh").init(KEY, h), ["attn_input_format='bsh'"]),
    ("mha rank-2 input", lambda: tf.MultiHeadAttention(head_dim=16, num_attention_heads=4).init(
        KEY, jnp.ones((8, 64)), jnp.ones((8, 64))), ["inputs_q", "(8, 64)", "thd"]),
    ("layernorm module type", lambda: tf.LayerNorm(layernorm_type="foo").init(KEY, h), ["layernorm_type='foo'"]),
    ("dense axis out of range", lambda: tf.DenseGeneral(features=8, axis=3).init(KEY, h), ["axis=3"]),
    # small errors that used to give NaN or a crash deep inside (issue point 7)
    ("layernorm negative epsilon", lambda: te_jax.layernorm(x, g, b, epsilon=-1e-5), ["epsilon=-1e-05", ">= 0"]),
    ("rmsnorm nan epsilon", lambda: te_jax.rmsnorm(x, g, epsilon=float("nan")), ["epsilon=nan", "finite"]),
    ("norm epsilon not a number", lambda: te_jax.norm(x, g, b, epsilon="small"), ["epsilon='small'"]),
    ("mlp negative epsilon", lambda: te_jax.layernorm_mlp(x, g, b, w1, None, w2, None, epsilon=-1.0), ["epsilon=-1.0"]),
    ("dense inf epsilon", lambda: te_jax.layernorm_dense(x, g, b, jnp.ones((16, 4)), epsilon=float("inf")),
     ["epsilon=inf"]),
    ("layernorm module negative epsilon", lambda: tf.LayerNorm(epsilon=-1e-6).init(KEY, h), ["epsilon=-1e-06"]),
    ("ln-mlp module negative epsilon", lambda: tf.LayerNormMLP(intermediate_dim=32, epsilon=-1e-6).init(KEY, h),
     ["epsilon=-1e-06"]),
    ("attention key None", lambda: te_jax.dot_product_attention(q8, None, q8), ["key is None", "array", "[batch, seq"]),
    ("attention nested list query", lambda: te_jax.dot_product_attention([[1.0, 2.0]], q8, q8),
     ["query is a list", "jnp.asarray"]),
    ("attention value None thd", lambda: te_jax.dot_product_attention(q8[0], q8[0], None, attn_input_format="thd"),
     ["value is None", "[tokens"]),
    ("attention zero heads", lambda: te_jax.dot_product_attention(jnp.ones((2, 8, 0, 8)), q8, q8),
     ["empty axis", "query (2, 8, 0, 8)"]),
    ("relpos zero buckets", lambda: tf.RelativePositionBiases(num_buckets=0, max_distance=128,
                                                               num_attention_heads=2).init(KEY, 8, 8),
     ["num_buckets=0", ">= 4"]),
    ("relpos unidirectional one bucket", lambda: tf.RelativePositionBiases(num_buckets=1, max_distance=128,
                                                                           num_attention_heads=2).init(KEY, 8, 8, False),
     ["num_buckets=1", ">= 2"]),
    ("relpos max_distance too small", lambda: tf.RelativePositionBiases(num_buckets=32, max_distance=8,
                                                                        num_attention_heads=2).init(KEY, 8, 8),
     ["max_distance=8", "> 8"]),
    ("relpos zero heads", lambda: tf.RelativePositionBiases(num_buckets=32, max_distance=128,
                                                            num_attention_heads=0).init(KEY, 8, 8),
     ["num_attention_heads=0"]),
    ("relpos static buckets", lambda: tf.RelativePositionBiases.buckets(8, 8, num_buckets=2, max_distance=128),
     ["num_buckets=2"]),
    ("dense negative features", lambda: tf.DenseGeneral(features=-8).init(KEY, h), ["features=-8", "positive"]),
    ("dense zero in features", lambda: tf.DenseGeneral(features=(4, 0)).init(KEY, h), ["features=(4, 0)"]),
    ("dense float axis", lambda: tf.DenseGeneral(features=8, axis=1.5).init(KEY, h), ["axis=1.5", "int"]),
    ("dense repeated axis", lambda: tf.DenseGeneral(features=8, axis=(2, -1)).init(KEY, h), ["axis=(2, -1)", "twice"]),
    ("ln-dense negative features", lambda: tf.LayerNormDenseGeneral(features=-1).init(KEY, h), ["features=-1"]),
]


@pytest.mark.parametrize("name,fn,fragments", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_call_is_explained(name, fn, fragments):
    with pytest.raises((ValueError, TypeError)) as e:
        fn()
    for f in fragments:
        assert f in str(e.value), f"{name}: {f!r} not in {str(e.value)!r}"


@pytest.mark.parametrize("var", ["TE_JAX_PALLAS_ATTN", "TE_JAX_PALLAS_NORM", "TE_JAX_PALLAS_MLP"])
@pytest.mark.parametrize("value", ["0", "false", "False", "NO", " off "])
def test_disable_variables_take_the_usual_false_spellings(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    explain = {"TE_JAX_PALLAS_ATTN": lambda: te_jax.explain_attention_backend(q8, q8, q8),
               "TE_JAX_PALLAS_NORM": lambda: te_jax.explain_norm_backend(x, g, b),
               "TE_JAX_PALLAS_MLP": lambda: te_jax.explain_mlp_backend(x)}[var]
    assert f"disabled by environment {var}={value.strip()}" in explain().reasons["pallas"]
    for on in ("1", "true", "on", ""):
        monkeypatch.setenv(var, on)
        assert "disabled" not in (explain().reasons["pallas"] or "")


@pytest.mark.parametrize("var", ["TE_JAX_PALLAS_ATTN", "TE_JAX_CUDNN_ATTN", "TE_JAX_PALLAS_NORM", "TE_JAX_PALLAS_MLP"])
def test_disable_variable_with_nonsense_value_is_explained(monkeypatch, var):
    monkeypatch.setenv(var, "maybe")
    call = {"TE_JAX_PALLAS_NORM": lambda: te_jax.layernorm(x, g, b),
            "TE_JAX_PALLAS_MLP": lambda: te_jax.layernorm_mlp(x, g, b, w1, None, w2, None)}.get(
        var, lambda: te_jax.dot_product_attention(q8, q8, q8))
    with pytest.raises(ValueError) as e:
        call()
    for f in (var, "'maybe'", "false", "off"):
        assert f in str(e.value)


def test_catalogue_covers_at_least_forty_distinct_bad_calls():
    total = len(CATALOGUE) + len(test_attention_errors.BAD) + len(test_layouts.BAD_UNPACK)
    assert total >= 40, total
