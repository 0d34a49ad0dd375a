"""Attention of the Flax modules under a data / tensor parallel mesh (fake CPU devices): the Pallas
kernel runs per shard, matches the single-device result, and the fallbacks stay exact.

A Pallas kernel is opaque to XLA's SPMD partitioner: called on sharded q/k/v outside shard_map it ran
replicated (operands all-gathered, the whole global batch computed on every device). Without context
parallelism the attention modules now run it in a shard_map over the mesh axes of the batch (and head)
axes; where the operands cannot be split consistently they call it as before. `auto` no longer picks
pallas under such a mesh outside shard_map (it would run replicated) and says why.
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
import te_jax
from helpers import cpu_mesh, rand as _rand
from tolerance import assert_close
import te_jax.attention as attention_mod
from te_jax.backends import selection
from te_jax.flax import DotProductAttention, TransformerLayer

DP_TP_RULES = (("batch", "data"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
               ("length", None), ("embed", None), ("kv", None), ("qkv", None), ("act", None),
               ("relpos_buckets", None))

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices; tests/conftest.py sets them")


def _mesh(dp, tp):
    return cpu_mesh((dp, tp), ("data", "tensor"), auto=True)


def _pallas_calls(jaxpr, inside=False, counts=None):
    """{"inside": n, "outside": n}: pallas_calls inside / outside a shard_map."""
    counts = {"inside": 0, "outside": 0} if counts is None else counts
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            counts["inside" if inside else "outside"] += 1
            continue
        for sub in jaxpr_walk._sub_jaxprs(eqn):
            _pallas_calls(sub, inside or eqn.primitive.name == "shard_map", counts)
    return counts


def _close(a, b, tol, what):
    """Close to tol relative to the array's scale (sums of many fp32 terms, in another order per shard)."""
    assert_close(a, b, tol, what, floor=1.0, rtol=tol)


# ----------------------------------------------------------------------------- TransformerLayer


def test_transformer_layer_pallas_attention_per_shard_matches_single_device():
    """Forward + backward of a TransformerLayer with the Pallas attention forced, on a data=2 x tensor=2
    mesh: the kernel sits inside the shard_map, split along the batch ("data") and along the 4 query /
    2 key-value heads and the relative-position bias ("tensor": 2 query heads with their key-value head
    per shard); the step gathers no activation-sized array; loss and every gradient match one device
    (computed with the xla backend). The pure dp=4 step: tests/test_sharded_train_step.py."""
    dp, tp, gqa = 2, 2, 2
    b, s, hidden, h = 4, 16, 64, 4
    layer = TransformerLayer(hidden_size=hidden, mlp_hidden_size=128, num_attention_heads=h, num_gqa_groups=gqa,
                             hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
                             enable_relative_embedding=(tp > 1), attention_backend="pallas", norm_backend="xla",
                             mlp_backend="xla")
    x = _rand(0, (b, s, hidden))
    xla_layer = layer.clone(attention_backend="xla")  # same parameters; its init compiles fast
    params = nn.meta.unbox(jax.jit(lambda x: xla_layer.init(jax.random.key(1), x, deterministic=True))(x)["params"])
    w = _rand(2, (b, s, hidden))

    def value_and_grads(layer):
        def loss_fn(p, x):
            return jnp.sum(layer.apply({"params": p}, x, deterministic=True) * w)
        return jax.value_and_grad(loss_fn, argnums=(0, 1))

    grad_fn = value_and_grads(layer)
    # the single-device reference: the xla backend (an independent implementation; compiles faster)
    loss_1, (gp_1, gx_1) = jax.jit(value_and_grads(xla_layer))(params, x)

    mesh = _mesh(dp, tp)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DP_TP_RULES):
        abstract = jax.eval_shape(lambda: xla_layer.init(jax.random.key(1), x, deterministic=True))
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, DP_TP_RULES)["params"]
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, P()) if s is None else s, nn.meta.unbox(shardings),
                                 is_leaf=lambda s: s is None)
        xs = NamedSharding(mesh, P("data"))
        step = jax.jit(grad_fn, in_shardings=(shardings, xs))
        traced = step.trace(params, x)
        calls = _pallas_calls(traced.jaxpr.jaxpr)
        compiled = traced.lower().compile()
        loss_n, (gp_n, gx_n) = compiled(jax.device_put(params, shardings), jax.device_put(x, xs))
    hlo = compiled.as_text()
    assert calls["inside"] > 0 and calls["outside"] == 0, calls
    local = b // dp * s * hidden
    gathers = [m for m in re.findall(r"= (\S+\[[0-9,]*\])\S* all-gather", hlo)
               if np.prod([int(d) for d in m[m.index("[") + 1:-1].split(",") if d]) >= local]
    assert not gathers, f"activation-sized all-gathers: {gathers}"
    _close(loss_n, loss_1, 2e-5, "loss")
    _close(gx_n, gx_1, 2e-5, "input gradient")
    for (path, a), bb in zip(jax.tree_util.tree_leaves_with_path(gp_n), jax.tree.leaves(gp_1)):
        _close(a, bb, 2e-5, jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------- DotProductAttention cases


def _dpa_case(mesh, rules, *, backend="pallas", b=4, s=16, h=4, g=4, d=16, fmt="bshd", mask_type="causal",
              bias_shape=None, seg=False, seqlens=False, layout=None, tensors=None):
    """(ran per shard?, loss and gradients under the mesh, the same on one device with the xla backend)
    for DotProductAttention; per shard, every Pallas call must sit inside the shard_map."""
    def module(backend):
        return DotProductAttention(head_dim=d, num_attention_heads=h, num_gqa_groups=g, attn_mask_type=mask_type,
                                   attn_input_format=fmt, qkv_layout=layout, backend=backend, scale_factor=0.25)

    if tensors is None:
        lead = (s,) if fmt == "thd" else ((b, s) if fmt == "bshd" else (s, b))
        tensors = (_rand(1, lead + (h, d)), _rand(2, lead + (g, d)), _rand(3, lead + (g, d)))
    floats, ints = {}, {}
    if bias_shape is not None:
        floats["bias"] = _rand(4, bias_shape)
    if seg:
        ids = np.ones((b, s), np.int32)
        ids[:, s // 2:] = 2
        ids[1, -3:] = 0
        ints["q_segment_ids"] = ints["kv_segment_ids"] = jnp.asarray(ids)
    if seqlens:
        lens = [5, s - 5] if fmt == "thd" else [s, s // 2, 3, s - 1][:b]
        ints["q_seqlens"] = ints["kv_seqlens"] = jnp.asarray(lens, jnp.int32)
    w = _rand(5, jax.eval_shape(lambda: module("xla").apply({}, *tensors, deterministic=True, **floats,
                                                            **ints)).shape)

    def value_and_grads(backend):
        def loss(tensors, floats):
            return jnp.sum(module(backend).apply({}, *tensors, deterministic=True, **floats, **ints) * w)
        return jax.value_and_grad(loss, argnums=(0, 1))

    ref = jax.jit(value_and_grads("xla"))(tensors, floats)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        traced = jax.jit(value_and_grads(backend)).trace(tensors, floats)
        jaxpr = traced.jaxpr.jaxpr
        out = traced.lower().compile()(tensors, floats)
    per_shard = any(e.primitive.name == "shard_map" for e in jaxpr_walk.walk(jaxpr))
    if backend == "pallas":
        calls = _pallas_calls(jaxpr)
        assert calls["inside" if per_shard else "outside"] > 0 and calls["outside" if per_shard else "inside"] == 0
    return per_shard, out, ref


def _assert_same(out, ref, tol=2e-5):
    for (path, a), bb in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(ref)):
        _close(a, bb, tol, jax.tree_util.keystr(path))


B, S, H, D = 4, 16, 4, 16


@pytest.mark.parametrize("case", [
    # bias split along the heads (whole over the batch), [b] seqlens along the batch; GQA 4 / 2 heads
    dict(bias_shape=(1, H, S, S), seqlens=True, mask_type="padding_causal", g=2),
    # sbhd; a bias split along the batch (whole over the heads) and [b, s] segment ids along the batch
    dict(fmt="sbhd", bias_shape=(B, 1, S, S), seg=True, mask_type="padding"),
    # thd: no batch axis, per shard over the heads only; the packed sequences' lengths whole
    dict(fmt="thd", seqlens=True, mask_type="padding_causal"),
    # packed: QKV-packed [b, s, 3, h, d] split along batch and heads
    dict(layout="bs3hd", tensors=(_rand(6, (B, S, 3, H, D)),)),
    # GQA-packed [b, s, h + 2g, d]: one axis holds every head, so along the batch only
    dict(layout="bs(h+2g)d", g=2, tensors=(_rand(7, (B, S, H + 4, D)),)),
], ids=["bias_heads_seqlens_gqa", "sbhd_bias_batch_segments", "thd_seqlens", "qkv_packed", "gqa_packed"])
def test_dot_product_attention_pallas_runs_per_shard(case):
    per_shard, out, ref = _dpa_case(_mesh(2, 2), DP_TP_RULES, **case)
    assert per_shard
    _assert_same(out, ref)


def _rules(**changes):
    return tuple((k, changes.pop(k, v)) for k, v in DP_TP_RULES) + tuple(changes.items())


@pytest.mark.parametrize("case,rules", [
    (dict(g=1, backend="pallas"), DP_TP_RULES),          # 1 key/value head cannot split over tensor=2
    (dict(g=2), _rules(kv_heads=None)),                  # heads on "tensor", key/value heads whole
    (dict(b=3, seqlens=True, mask_type="padding"), _rules(heads=None, kv_heads=None)),  # batch 3 over data=2
    (dict(), _rules(length="tensor", heads=None, kv_heads=None)),  # sequence sharded, no context parallelism
], ids=["mqa_heads_not_divisible", "heads_and_kv_heads_differ", "batch_not_divisible", "sequence_sharded"])
def test_fallbacks_stay_exact(case, rules):
    """Where q/k/v cannot be split consistently the op is called as before, under the partitioner
    (the first case with the Pallas kernel itself, the others with the xla backend: same call)."""
    per_shard, out, ref = _dpa_case(_mesh(2, 2), rules, **{"backend": "xla", **case})
    assert not per_shard
    _assert_same(out, ref)


# ----------------------------------------------------------------------------- backend selection


def test_auto_attention_backend_under_a_mesh_is_not_a_replicated_pallas_kernel(monkeypatch):
    """On a GPU, auto may take pallas (the Hopper kernel for short sequences); under a mesh whose axes XLA
    partitions, outside shard_map, that kernel would run replicated: auto takes another backend and the
    explanation says why. Inside shard_map pallas is taken again; a forced pallas is honoured with a note."""
    for var in ("TE_JAX_ATTN_BACKEND", "TE_JAX_PALLAS_ATTN", "TE_JAX_CUDNN_ATTN", "TE_JAX_XLA_ATTN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(attention_mod, "current_platform", lambda: ("gpu", (9, 0)))
    monkeypatch.setattr(selection.BACKENDS["pallas"], "hopper_reason", lambda call: None)
    q = jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.bfloat16)
    assert te_jax.explain_attention_backend(q, q, q, attn_mask_type="causal").selected == "pallas"
    mesh = cpu_mesh((4,), ("data",), auto=True)
    with jax.set_mesh(mesh):
        choice = te_jax.explain_attention_backend(q, q, q, attn_mask_type="causal")
        assert choice.selected != "pallas", str(choice)
        why = choice.reasons["pallas"]
        assert "under a mesh whose axes ('data',) XLA partitions" in why and "replicated" in why, why
        assert "pallas  not taken: under a mesh whose axes ('data',) XLA partitions" in str(choice), str(choice)
        forced = te_jax.explain_attention_backend(q, q, q, attn_mask_type="causal", backend="pallas")
        assert forced.selected == "pallas" and "runs replicated" in str(forced), str(forced)
        packed = te_jax.explain_attention_backend_packed(
            jax.ShapeDtypeStruct((8, 256, 3, 4, 64), jnp.bfloat16), qkv_layout="bs3hd", attn_mask_type="causal")
        assert packed.selected != "pallas" and "XLA partitions" in packed.reasons["pallas"]
        seen = []

        def body(a):
            seen.append(te_jax.explain_attention_backend(a, a, a, attn_mask_type="causal").selected)
            return a

        jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False),
                       q)
    assert seen == ["pallas"]
