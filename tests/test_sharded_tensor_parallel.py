"""LayerNormDenseGeneral and LayerNormMLP under data x tensor parallelism (fake CPU devices): the fused Pallas
kernels run per shard, Megatron-style, match one device, and gather nothing activation-sized.
  - LayerNormDenseGeneral (QKV): column-parallel, the kernel's feature axes split over "tensor", the input
    whole over them.
  - LayerNormMLP: wi column-parallel and wo row-parallel along "mlp"; each shard's partial product is summed
    over the shards outside the shard_map (an all-reduce), wo_bias added once.
Before, a kernel sharded along a feature or "mlp" axis made the module fall back to calling the op under the
partitioner: with the Pallas kernels (forced here; what auto takes on a GPU inside shard_map) they ran
replicated, e.g. the [batch, seq, 3, heads, head_dim] qkv output and the kernel all-gathered over "tensor".
"""
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpr_walk
from helpers import cpu_mesh, rand
from tolerance import assert_close
from te_jax.flax import LayerNormDenseGeneral, LayerNormMLP

RULES = (("batch", "data"), ("length", None), ("embed", None), ("qkv", None), ("heads", "tensor"), ("kv", None),
         ("act", None), ("mlp", "tensor"))
# FSDP on top: parameters' hidden axis over "data" too (an activation's "data" goes to its batch axis first)
FSDP_RULES = (("batch", "data"), ("embed", "data")) + RULES[1:2] + RULES[3:]
B, S, HIDDEN, HEADS, HEAD_DIM = 4, 12, 32, 4, 8  # S = 12: no parameter has an axis of that size

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices; tests/conftest.py sets them")


def _module(backend, return_ln=False, use_bias=True, kind="dense"):
    if kind == "mlp":
        return LayerNormMLP(intermediate_dim=16, activations=("silu", "linear"), use_bias=use_bias,
                            bias_init=nn.initializers.normal(0.1), backend=backend, return_layernorm_output=return_ln,
                            intermediate_dropout_rate=0.0, layernorm_input_axes=("batch", "length", "embed"))
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


def _value_and_grads(mod, kind, ws):
    def loss(p, x):
        out = mod.apply({"params": p}, x, **({"deterministic": True} if kind == "mlp" else {}))
        return sum(jnp.sum(o * w) for o, w in zip(jax.tree.leaves(out), ws))
    return jax.value_and_grad(loss, argnums=(0, 1))


@functools.cache
def _reference(return_ln, use_bias, kind):
    """(x, params, cotangent weights, loss and grads on one device with the xla backend in fp32): shared by the
    tests of one module configuration (inputs numpy-drawn, init jitted: no op-by-op compiles)."""
    x = rand(0, (B, S, HIDDEN)) + 0.3
    ref_mod = _module("xla", return_ln, use_bias, kind)
    kw = {"deterministic": True} if kind == "mlp" else {}
    params = nn.meta.unbox(jax.jit(lambda k, x: ref_mod.init(k, x, **kw))(jax.random.key(1), x)["params"])
    params = jax.tree.map(lambda p: p + rand(2, p.shape, scale=0.1), params)
    outs = jax.eval_shape(lambda: ref_mod.apply({"params": params}, x, **kw))
    ws = [rand(3 + i, o.shape) for i, o in enumerate(jax.tree.leaves(outs))]
    return x, params, ws, jax.jit(_value_and_grads(ref_mod, kind, ws))(params, x)


def _run(return_ln, use_bias=True, kind="dense", dtype=jnp.float32, rules=RULES):
    """(loss and grads under the dp=2 x tp=2 mesh, Pallas forced, inputs in dtype; the same on one device with
    the xla backend in fp32; (Pallas calls inside, outside shard_map); the compiled HLO)."""
    x, params, ws, ref = _reference(return_ln, use_bias, kind)
    ref_mod = _module("xla", return_ln, use_bias, kind)
    kw = {"deterministic": True} if kind == "mlp" else {}
    value_and_grads = lambda mod: _value_and_grads(mod, kind, ws)  # noqa: E731
    xd = np.asarray(x.astype(dtype))
    mesh = cpu_mesh((2, 2), ("data", "tensor"), auto=True)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(lambda: ref_mod.init(jax.random.key(1), x, **kw))
        shardings = nn.meta.unbox(nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules))["params"]
        xs = NamedSharding(mesh, P("data"))
        traced = jax.jit(value_and_grads(_module("pallas", return_ln, use_bias, kind)),
                         in_shardings=(shardings, xs)).trace(params, xd)
        compiled = traced.lower().compile()
        out = compiled(jax.device_put(params, shardings), jax.device_put(xd, xs))
    return out, ref, _pallas_calls(traced.jaxpr.jaxpr), compiled.as_text()


def _assert_close(out, ref, tol=2e-5):
    assert_close(jax.tree.leaves(out), jax.tree.leaves(ref), tol, floor=1.0, rtol=tol)


@pytest.mark.parametrize("kind", ["dense", "mlp"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_tensor_parallel_per_shard_matches_one_device(use_bias, kind):
    out, ref, (inside, outside), hlo = _run(return_ln=False, use_bias=use_bias, kind=kind)
    assert inside > 0 and outside == 0, (inside, outside)  # every Pallas call per shard
    local = B // 2 * S * HIDDEN  # one data shard's [b, s, hidden] activation
    gathers = [m for m in re.findall(r"= (\S+\[[0-9,]*\])\S* all-gather", hlo)
               if np.prod([int(d) for d in m[m.index("[") + 1:-1].split(",") if d]) >= local // 4]
    assert not gathers, f"all-gathers of the qkv output or the kernel: {gathers}"
    _assert_close(out, ref)


@pytest.mark.parametrize("kind", ["dense", "mlp"])
def test_return_layernorm_output_falls_back_and_stays_exact(kind):
    """The normalized input's hidden axis is no feature axis: not split over "tensor"; the result is exact."""
    out, ref, _, _ = _run(return_ln=True, kind=kind)
    _assert_close(out, ref)


@pytest.mark.parametrize("kind", ["dense", "mlp"])
def test_tensor_parallel_bf16_close_to_fp32(kind):
    """bf16 inputs (partial products rounded to bf16 per shard before their fp32 sum): every gradient within
    bf16 error of the fp32 single-device one, relative to its scale. (The scalar loss, a sum of terms of both
    signs, cancels too much to compare at bf16 precision; the gradients carry the whole computation.)"""
    out, ref, (inside, outside), _ = _run(return_ln=False, kind=kind, dtype=jnp.bfloat16)
    assert inside > 0 and outside == 0, (inside, outside)
    _assert_close(out[1], ref[1], tol=3e-2)


@pytest.mark.parametrize("kind", ["dense", "mlp"])
def test_fsdp_parameters_are_gathered_and_the_kernels_run_per_shard(kind):
    """FSDP + tensor parallelism: the parameters' hidden axis is sharded over "data", the axis that splits the
    batch. They are passed whole to the per-shard run (all-gathered first, as FSDP does), so the Pallas
    kernels still run per shard (before: a fallback to the partitioned call), gather no activation, and
    match one device."""
    out, ref, (inside, outside), hlo = _run(return_ln=False, kind=kind, rules=FSDP_RULES)
    assert inside > 0 and outside == 0, (inside, outside)
    gathered = re.findall(r"= \S+\[([0-9,]*)\]\S* all-gather", hlo)
    assert gathered, "the FSDP parameters should be all-gathered"
    activations = [g for g in gathered if str(S) in g.split(",")]  # only activations have a sequence axis
    assert not activations, f"activation all-gathers: {activations}"
    _assert_close(out, ref)
