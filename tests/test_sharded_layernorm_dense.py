"""LayerNormDenseGeneral under data x tensor parallelism (fake CPU devices): the fused Pallas kernel runs per
shard as a column-parallel GEMM (the kernel's feature axes split over "tensor", the input whole over them),
matches one device, and gathers nothing activation-sized.

Before, a kernel sharded along its feature (heads) axis made the module fall back to calling the op under the
partitioner: with the Pallas kernel (forced here; what auto takes on a GPU inside shard_map) it ran replicated,
the [batch, seq, 3, heads, head_dim] qkv output and the kernel all-gathered over "tensor".
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpr_walk
from te_jax.flax import LayerNormDenseGeneral

AUTO = jax.sharding.AxisType.Auto
RULES = (("batch", "data"), ("length", None), ("embed", None), ("qkv", None), ("heads", "tensor"), ("kv", None))
B, S, HIDDEN, HEADS, HEAD_DIM = 4, 8, 32, 4, 8

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices; tests/conftest.py sets them")


def _module(backend, return_ln=False, use_bias=True):
    return LayerNormDenseGeneral(features=(3, HEADS, HEAD_DIM), kernel_axes=("embed", "qkv", "heads", "kv"),
                                 use_bias=use_bias, bias_axes=("qkv", "heads", "kv"), backend=backend,
                                 return_layernorm_output=return_ln,
                                 layernorm_input_axes=("batch", "length", "embed"),
                                 bias_init=nn.initializers.normal(0.1))


def _pallas_calls(jaxpr):
    inside = outside = 0
    for eqn in jaxpr_walk.walk(jaxpr):
        if eqn.primitive.name == "shard_map":
            inside += sum(e.primitive.name == "pallas_call" for e in jaxpr_walk.walk(eqn.params["jaxpr"]))
    total = sum(e.primitive.name == "pallas_call" for e in jaxpr_walk.walk(jaxpr))
    outside = total - inside
    return inside, outside


def _run(return_ln, use_bias=True):
    x = jax.random.normal(jax.random.key(0), (B, S, HIDDEN), jnp.float32) + 0.3
    ref_mod = _module("xla", return_ln, use_bias)
    params = nn.meta.unbox(ref_mod.init(jax.random.key(1), x)["params"])
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape), params)
    outs = jax.eval_shape(lambda: ref_mod.apply({"params": params}, x))
    ws = [jax.random.normal(jax.random.key(3 + i), o.shape) for i, o in enumerate(jax.tree.leaves(outs))]

    def value_and_grads(mod):
        def loss(p, x):
            return sum(jnp.sum(o * w) for o, w in zip(jax.tree.leaves(mod.apply({"params": p}, x)), ws))
        return jax.value_and_grad(loss, argnums=(0, 1))

    ref = jax.jit(value_and_grads(ref_mod))(params, x)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AUTO, AUTO), devices=jax.devices()[:4])
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(lambda: ref_mod.init(jax.random.key(1), x))
        shardings = nn.meta.unbox(nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES))["params"]
        xs = NamedSharding(mesh, P("data"))
        traced = jax.jit(value_and_grads(_module("pallas", return_ln, use_bias)),
                         in_shardings=(shardings, xs)).trace(params, x)
        compiled = traced.lower().compile()
        out = compiled(jax.device_put(params, shardings), jax.device_put(x, xs))
    return out, ref, _pallas_calls(traced.jaxpr.jaxpr), compiled.as_text()


def _assert_close(out, ref):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(ref)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=2e-5 * max(1.0, float(np.max(np.abs(b)))),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("use_bias", [True, False])
def test_column_parallel_per_shard_matches_one_device(use_bias):
    out, ref, (inside, outside), hlo = _run(return_ln=False, use_bias=use_bias)
    assert inside > 0 and outside == 0, (inside, outside)  # every Pallas call per shard
    local = B // 2 * S * HIDDEN  # one data shard's [b, s, hidden] activation
    gathers = [m for m in re.findall(r"= (\S+\[[0-9,]*\])\S* all-gather", hlo)
               if np.prod([int(d) for d in m[m.index("[") + 1:-1].split(",") if d]) >= local // 4]
    assert not gathers, f"all-gathers of the qkv output or the kernel: {gathers}"
    _assert_close(out, ref)


def test_return_layernorm_output_falls_back_and_stays_exact():
    """The normalized input's hidden axis is no feature axis: not split over "tensor"; the result is exact."""
    out, ref, _, _ = _run(return_ln=True)
    _assert_close(out, ref)
