"""The example's training step (examples/train_lm.py) on a dp=2 × cp=2 mesh of fake CPU devices does a
quarter of the single-device work per device, and moves no activation-sized array but the ring's.

With the Pallas norm / LayerNorm-MLP kernels (what `auto` takes on a GPU; forced here, interpret mode),
each kernel called on a sharded activation outside shard_map ran replicated: XLA's SPMD partitioner
cannot split a Pallas call (on a GPU an opaque custom call: operands all-gathered to every device,
the whole global batch normalized everywhere; in interpret mode on the CPU the kernel's row loop
gathered the sequence). Measured before the fix (2 layers, hidden 128, seq 256, batch 8): per-device
flops 0.42x of the single-device step, with all-gathers of [batch/dp, seq, hidden] activations in
every layer. The Flax modules now run those kernels per shard (shard_map over the axes the logical
rules put the input on): 0.26x, no all-gather. The tests compile 1-layer steps (ONE_LAYER): every layer
runs the same kernels, so one shows a replicated kernel (its gathers, its flops) as two do, at about half
the compile time.

The same held for the Pallas attention without context parallelism (a dp=4 step): it ran replicated
(the global packed qkv all-gathered); the attention modules now run it per shard too (the tests
*_dp_step_*; module-level cases in tests/test_sharded_attention.py).
"""
import importlib.util
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")


def _load():
    name = "train_lm_example"  # the name tests/test_examples.py loads it under: one module either way
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses (the Flax module) look their module up by name
    spec.loader.exec_module(mod)
    return mod


train_lm = _load()

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "2", "--ffn", "128", "--seq-len", "128", "--batch", "8",
         "--dtype", "fp32"]
ONE_LAYER = ["--layers", "1"]  # the tests' steps: one layer shows it
COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)"
                        r"(?:-start)?\(")


def _build(mesh_spec, extra=()):
    args = train_lm.parse_args(SMALL + list(extra) + ["--mesh", mesh_spec])
    sizes = train_lm.parse_mesh(args.mesh, jax.device_count())
    mesh = train_lm.make_mesh(sizes)
    rules = train_lm.logical_rules(args, sizes)
    cp = sizes["cp"]
    model = train_lm.make_model(args, ("context", "ring", True) if cp > 1 else None)
    _, tx = train_lm.make_optimizer(args)
    built = train_lm.build_train_step(model, tx, mesh, rules, args.batch, args.seq_len)
    return args, sizes, mesh, rules, built


def _compile(mesh_spec, extra=()):
    args, sizes, mesh, rules, built = _build(mesh_spec, extra)
    tok = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32, sharding=built["data_sharding"])
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        compiled = built["train_step"].lower(built["abstract_state"], tok, tok, tok).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return args, sizes, float(cost["flops"]), compiled.as_text()


def _elements(shape_text):
    total = 0
    for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", shape_text):
        total += int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    return total


@pytest.fixture
def pallas_norms(monkeypatch):
    monkeypatch.setenv("TE_JAX_NORM_BACKEND", "pallas")
    monkeypatch.setenv("TE_JAX_MLP_BACKEND", "pallas")


def test_dp_cp_step_is_a_quarter_of_the_work_per_device(pallas_norms):
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices; tests/conftest.py sets them")
    _, _, flops_1, _ = _compile("dp=1,cp=1,tp=1", ONE_LAYER)
    args, sizes, flops_4, hlo = _compile("dp=2,cp=2", ONE_LAYER)
    ratio = flops_4 / flops_1
    collectives = [(m.group(2), m.group(1)) for m in COLLECTIVE.finditer(hlo)]
    # one device's share of a [batch, seq, hidden] activation
    local = args.batch // sizes["dp"] * (args.seq_len // sizes["cp"]) * args.hidden
    gathered = [(k, s) for k, s in collectives if k in ("all-gather", "all-to-all") and _elements(s) >= local]
    assert not gathered, f"activation-sized gathers in the dp=2,cp=2 step: {gathered}"
    assert ratio <= 0.3, (f"per-device flops of the dp=2,cp=2 step are {ratio:.3f}x the single-device step's "
                          f"(ideal 0.25): computation is replicated. Collectives: {collectives}")
    assert any(k == "collective-permute" for k, _ in collectives), "the ring's K/V exchange is missing"


@pytest.mark.parametrize("spec", [
    # dp x cp against one device also runs in CI as tests/test_examples.py (dp=2,cp=4): slow here
    pytest.param("dp=2,cp=2", marks=pytest.mark.slow),
    "dp=2,tp=2",
])
def test_sharded_step_matches_single_device(pallas_norms, spec):
    """The per-shard Pallas kernels give the single-device loss and gradient norm (fp32); under dp x tp the
    QKV LayerNormDenseGeneral and the LayerNormMLP run tensor-parallel per shard (test_sharded_tensor_parallel.py)."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices; tests/conftest.py sets them")
    args, _, _, _, _ = _build("dp=1,cp=1,tp=1", ONE_LAYER)
    x, y = train_lm.sample_batch(np.arange(4096, dtype=np.uint8) * 7 % 251, args.batch, args.seq_len, 0, 1, 0)
    pos = np.broadcast_to(np.arange(args.seq_len, dtype=np.int32)[None], x.shape)
    out = {}
    for mesh_spec in ("dp=1,cp=1,tp=1", spec):
        args, sizes, mesh, rules, built = _build(mesh_spec, ONE_LAYER)
        xs, ys, ps = x, y, pos
        if sizes["cp"] > 1:
            from te_jax.context_parallel import reorder_causal_load_balancing
            xs, ys, ps = (np.asarray(reorder_causal_load_balancing(a, sizes["cp"], seq_axis=1)) for a in (x, y, pos))
        batch = [jax.device_put(np.ascontiguousarray(a), built["data_sharding"]) for a in (xs, ys, ps)]
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            state = built["init"](jax.random.key(0))
            _, loss, gnorm = built["train_step"](state, *batch)
        out[mesh_spec] = (float(loss), float(gnorm))
    np.testing.assert_allclose(out[spec], out["dp=1,cp=1,tp=1"], rtol=2e-5)


@pytest.fixture
def pallas_attention(monkeypatch):
    monkeypatch.setenv("TE_JAX_ATTN_BACKEND", "pallas")


def _activation_gathers(args, sizes, hlo):
    collectives = [(m.group(2), m.group(1)) for m in COLLECTIVE.finditer(hlo)]
    local = args.batch // sizes["dp"] * (args.seq_len // sizes["cp"]) * args.hidden
    return [(k, s) for k, s in collectives if k in ("all-gather", "all-to-all") and _elements(s) >= local]


def test_dp_step_runs_the_pallas_attention_per_shard(pallas_norms, pallas_attention):
    """dp=4, no context parallelism, every Pallas kernel forced (interpret mode): the attention kernel
    used to run replicated, its packed qkv all-gathered (before: f32[8,128,6,32] x18, f32[8,128,2,32] x4,
    f32[8,2,128] x4 per step with 2 layers); the Flax attention now runs it per shard: no activation-sized
    gather (checked on a 1-layer step)."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices; tests/conftest.py sets them")
    args, sizes, _, hlo = _compile("dp=4", ONE_LAYER)
    gathered = _activation_gathers(args, sizes, hlo)
    assert not gathered, f"activation-sized gathers in the dp=4 step: {gathered}"


@pytest.mark.slow  # 15 s; CI keeps the dp x cp quarter-of-the-work test and the per-shard Pallas step
def test_dp_step_with_an_opaque_attention_kernel_is_a_quarter_of_the_work(monkeypatch, pallas_attention):
    """Per-device flops of the dp=4 step with the attention forced to pallas, the kernel replaced by a
    stand-in that behaves as on a GPU: opaque to the SPMD partitioner (outside shard_map it runs
    replicated: its operands and output constrained to replicated) but with XLA-visible flops (the
    reference attention; the interpret-mode kernel's loop bodies are counted once whatever the shape,
    so they hide the replication). The 1-layer step here: before 0.459x the single-device step's, now
    0.253x (2 layers: 0.488x -> 0.252x)."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices; tests/conftest.py sets them")
    from te_jax import masks
    from te_jax.backends import policy
    from te_jax.backends.pallas import PallasBackend
    from te_jax.backends.xla import XlaBackend

    xla = XlaBackend()

    def opaque_forward(self, call, q, k, v, tm, bias, **kw):
        if not policy.partitioned_mesh_axes():  # inside shard_map (or no mesh): local, as a kernel
            return xla.forward(call, q, k, v, tm, bias, **kw)

        def rep(a):
            return None if a is None else jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec())

        tm = masks.TokenMask(rep(tm.q_segment_ids), rep(tm.q_positions), rep(tm.kv_segment_ids),
                             rep(tm.kv_positions))
        return rep(xla.forward(call, rep(q), rep(k), rep(v), tm, rep(bias), **kw))

    monkeypatch.setattr(PallasBackend, "forward", opaque_forward)
    monkeypatch.setattr(PallasBackend, "packed_input_reason", lambda self, *a, **k: "stand-in: split q, k, v")
    _, _, flops_1, _ = _compile("dp=1,cp=1,tp=1", ONE_LAYER)
    args, sizes, flops_4, hlo = _compile("dp=4", ONE_LAYER)
    ratio = flops_4 / flops_1
    assert ratio <= 0.3, (f"per-device flops of the dp=4 step are {ratio:.3f}x the single-device step's "
                          "(ideal 0.25): the attention is replicated")
    assert not _activation_gathers(args, sizes, hlo)


def test_auto_norm_backend_under_a_mesh_is_not_a_replicated_pallas_kernel(monkeypatch):
    """On a GPU, auto picks pallas for layernorm / the MLP; under a mesh whose axes XLA partitions
    (outside shard_map) that kernel would run replicated, so auto takes xla there, and pallas again
    per shard inside shard_map (where the Flax modules call it)."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices; tests/conftest.py sets them")
    from te_jax.mlp import explain_mlp_backend
    from te_jax.normalization import explain_norm_backend

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jax.ShapeDtypeStruct((8, 64, 128), jnp.bfloat16)
    assert explain_norm_backend(x).selected == "pallas"
    assert explain_mlp_backend(x).selected == "pallas"
    mesh = jax.make_mesh((2, 2), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        choice = explain_norm_backend(x)
        assert choice.selected == "xla" and "replicated" in str(choice), str(choice)
        assert explain_mlp_backend(x).selected == "xla"
        seen = []

        def body(a):
            seen.append((explain_norm_backend(a).selected, explain_mlp_backend(a).selected))
            return a

        P = jax.sharding.PartitionSpec
        jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P("data", "context"), out_specs=P("data", "context"),
                                     check_vma=False), x)
    assert seen == [("pallas", "pallas")]
