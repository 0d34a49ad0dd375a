"""TransformerLayer against a plain reference with its parameters copied in; formats, dropout,
decoding, training, NNX, context-parallel routing and bad inputs.

Inits and applies run jitted, a test's cases and references in one program where they share one
(test_flax_modules.fwd_and_grads_many): eagerly every op compiles on its own for each new shape."""
import functools
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from test_flax_modules import (
    assert_close,
    assert_tree_close,
    causal_visible,
    fwd_and_grads_many,
    init_many,
    rand,
    ref_mha,
    ref_mlp,
    ref_norm,
    unbox,
)
from te_jax.flax import RelativePositionBiases, TransformerLayer

B, S, D, H, F = 2, 8, 32, 4, 64
NO_DROP = dict(hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0)


def make(**kw):
    args = dict(hidden_size=D, mlp_hidden_size=F, num_attention_heads=H, **NO_DROP)
    args.update(kw)
    return TransformerLayer(**args)


def init(m, *args, **kw):
    """m.init jitted (test_flax_modules.init_many), unboxed."""
    return init_many([(m, args, kw)])[0]


def perturb(p):
    """Non-trivial LayerNorm/bias parameters (they initialise to 1 / 0)."""
    leaves, tree = jax.tree_util.tree_flatten(p)
    return tree.unflatten([a + 0.1 * rand(i + 11, a.shape) for i, a in enumerate(leaves)])


def ref_layer(p, x, enc=None, *, g=H, activations=("gelu",), visible=None, enc_visible=None, post_ln=False,
              output_ln=False, bidirectional=True, layernorm_type="layernorm", rope=None):
    bias = None
    if "relpos_bias" in p:
        bk = RelativePositionBiases.buckets(x.shape[1], x.shape[1], 32, 128, bidirectional)
        bias = p["relpos_bias"]["rel_embedding"][:, bk][None]
    a, ln = ref_mha(p["attention"], x, h=H, g=g, visible=visible, scale=1.0, bias=bias, rope=rope,
                    layernorm_type=layernorm_type, input_layernorm=not output_ln)
    x = a + (ln if post_ln else x)
    if enc is not None:
        c, ln = ref_mha(p["encoder_decoder_attention"], x, enc, h=H, g=g, visible=enc_visible, scale=1.0, rope=rope,
                        layernorm_type=layernorm_type)
        x = c + (ln if post_ln else x)
    mp = p["mlp"]
    ln = ref_norm(x, mp["scale"], mp.get("ln_bias"), layernorm_type)
    z = ref_mlp(mp, x, activations, layernorm_type) + (ln if post_ln else x)
    if output_ln:
        z = ref_norm(z, p["output_layernorm"]["scale"], p["output_layernorm"].get("ln_bias"), layernorm_type)
    return z


ENCODER_CASES = {
    "pre-ln-relpos": (dict(), dict()),
    "post-ln-bias-swiglu-rms": (dict(apply_residual_connection_post_layernorm=True, use_bias=True,
                                     mlp_activations=("silu", "linear"), layernorm_type="rmsnorm",
                                     enable_relative_embedding=False),
                                dict(post_ln=True, activations=("silu", "linear"), layernorm_type="rmsnorm")),
    "output-ln-gqa-rope": (dict(output_layernorm=True, num_gqa_groups=2, enable_relative_embedding=False,
                                enable_rotary_pos_emb=True, rotary_pos_emb_group_method="alternate"),
                           dict(output_ln=True, g=2, rope="alternate")),
}


def test_encoder_layer_vs_reference():
    """ENCODER_CASES, one compile for all and their references, each checked."""
    x = rand(1, (B, S, D))
    mods = [make(self_attn_mask_type="causal", **kw) for kw, _ in ENCODER_CASES.values()]
    cases = []
    for (_, ref_kw), m, v in zip(ENCODER_CASES.values(), mods, init_many([(m, (x,), {}) for m in mods])):
        p = perturb(v["params"])
        cases += [(functools.partial(lambda p, x, m: m.apply({"params": p}, x, deterministic=True), m=m), p, x),
                  (functools.partial(lambda p, x, kw: ref_layer(p, x, visible=causal_visible(S, S), **kw), kw=ref_kw),
                   p, x)]
    res = fwd_and_grads_many(cases)
    for i, case in enumerate(ENCODER_CASES):
        (o, g, _), (ro, rg, _) = res[2 * i], res[2 * i + 1]
        assert_close(o, ro, 3e-5, f"{case} out")
        assert_tree_close(g, rg, 6e-5, f"{case} grad")


def test_layer_bf16_compute_fp32_params():
    m = make(dtype=jnp.bfloat16, mlp_activations=("gelu", "linear"), enable_relative_embedding=False)
    x = rand(1, (B, S, D))
    v = jax.jit(m.init)({"params": jax.random.key(0)}, x.astype(jnp.bfloat16))
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(unbox(v)))
    p = perturb(unbox(v)["params"])
    # dtype=None (default) computes in the input's dtype, as TransformerEngine does
    default = make(mlp_activations=("gelu", "linear"), enable_relative_embedding=False)
    (o, g, _), (ro, rg, _), (o_default, _, _) = fwd_and_grads_many([
        (lambda p, x: m.apply({"params": p}, x.astype(jnp.bfloat16), deterministic=True), p, x),
        (lambda p, x: ref_layer(p, x, visible=causal_visible(S, S), activations=("gelu", "linear")), p, x),
        (lambda p, x: default.apply({"params": p}, x.astype(jnp.bfloat16), deterministic=True), p, x)])
    assert o.dtype == jnp.bfloat16
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(g[0]))
    assert_close(o, ro, 5e-2, "out")
    assert_tree_close(g, rg, 8e-2, "grad")
    assert o_default.dtype == jnp.bfloat16
    assert_close(o_default, o, 1e-6, "dtype=None follows the bf16 input")


def test_decoder_layer_vs_reference():
    m = make(layer_type="decoder", num_gqa_groups=2)
    x, enc = rand(1, (B, S, D)), rand(2, (B, 12, D))
    enc_len = jnp.array([12, 5])
    enc_vis = jnp.broadcast_to((jnp.arange(12)[None] < enc_len[:, None])[:, None, None, :], (B, 1, S, 12))
    p = perturb(init(m, x, enc)["params"])
    assert set(p) == {"attention", "encoder_decoder_attention", "mlp", "relpos_bias"}
    fn = lambda p, x, e: m.apply({"params": p}, x, e, encoder_decoder_mask=~enc_vis, deterministic=True)
    # the same padding given as seqlens
    fn2 = lambda p, x, e: m.apply({"params": p}, x, e, deterministic=True, encoder_kv_seqlens=enc_len,
                                  encoder_q_seqlens=jnp.full((B,), S))
    (o, g, _), (ro, rg, _), (o2, _, _) = fwd_and_grads_many([
        (fn, p, x, enc),
        (lambda p, x, e: ref_layer(p, x, e, g=2, visible=causal_visible(S, S), enc_visible=enc_vis,
                                   bidirectional=False), p, x, enc),
        (fn2, p, x, enc)])
    assert_close(o, ro, 3e-5, "out")
    assert_tree_close(g, rg, 6e-5, "grad")
    assert_close(o2, o, 1e-5, "seqlens == mask")


def test_layer_bshd_vs_sbhd():
    x = rand(1, (B, S, D))
    mb = make(layer_type="decoder", attn_input_format="bshd")
    ms = make(layer_type="decoder", attn_input_format="sbhd")
    enc = rand(2, (B, 6, D))
    p = perturb(init(mb, x, enc)["params"])
    t = lambda a: jnp.swapaxes(a, 0, 1)
    yb, ys = jax.jit(lambda p, x, enc: (mb.apply({"params": p}, x, enc, deterministic=True),
                                        ms.apply({"params": p}, t(x), t(enc), deterministic=True)))(p, x, enc)
    assert ys.shape == (S, B, D)
    assert_close(t(ys), yb, 1e-5, "sbhd == bshd transposed")


def test_layer_thd_matches_padded_bshd():
    lens = [5, 3]
    m = make(self_attn_mask_type="padding_causal", enable_rotary_pos_emb=True, enable_relative_embedding=False)
    x = rand(1, (B, S, D))
    p = init(m, x)["params"]
    valid = jnp.arange(S)[None] < jnp.array(lens)[:, None]
    packed = jnp.concatenate([x[0, :5], x[1, :3]])  # [tokens, hidden]
    mt = make(self_attn_mask_type="padding_causal", enable_rotary_pos_emb=True, enable_relative_embedding=False,
              attn_input_format="thd")
    yb, yt = jax.jit(lambda p, x, packed: (  # one compile
        m.apply({"params": p}, x, attention_mask=~(valid[:, None, :, None] & valid[:, None, None, :]),
                deterministic=True),
        mt.apply({"params": p}, packed, deterministic=True, q_seqlens=jnp.array(lens), kv_seqlens=jnp.array(lens))))(
        p, x, packed)
    assert yt.shape == (8, D)
    assert_close(yt, jnp.concatenate([yb[0, :5], yb[1, :3]]), 1e-5, "thd == padded bshd")


def test_layer_dropout_semantics():
    m = make(hidden_dropout=0.3, attention_dropout=0.3, intermediate_dropout=0.3, drop_path=0.2)
    x = rand(1, (B, S, D))
    p = init(m, x)
    ref, det = jax.jit(lambda p, x: (make().apply(p, x, deterministic=True), m.apply(p, x, deterministic=True)))(p, x)
    np.testing.assert_array_equal(det, ref)  # deterministic switches every dropout off
    dropped = jax.jit(lambda p, x, key: m.apply(p, x, deterministic=False, rngs={"dropout": key}))
    run = lambda s: dropped(p, x, jax.random.key(s))
    np.testing.assert_array_equal(run(1), run(1))  # the "dropout" stream drives it
    assert float(jnp.max(jnp.abs(run(1) - det))) > 1e-3
    assert float(jnp.max(jnp.abs(run(1) - run(2)))) > 1e-3
    with pytest.raises(Exception, match="dropout"):  # traced only: the error comes before anything runs
        jax.eval_shape(lambda p, x: m.apply(p, x, deterministic=False), p, x)  # no "dropout" RNG given
    # drop_path alone drops whole residual branches per example: some examples equal "branch removed"
    only_path = jax.jit(lambda p, x, key: make(drop_path=0.5).apply(p, x, deterministic=False, rngs={"dropout": key}))
    outs = [only_path(p, x, jax.random.key(s)) for s in range(4)]
    assert any(float(jnp.max(jnp.abs(o - det))) > 1e-3 for o in outs)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_layer_decode_matches_full_causal_forward(fmt):
    m = make(enable_rotary_pos_emb=True, num_gqa_groups=2, attn_input_format=fmt)  # relpos on (TE default)
    x = rand(1, (B, S, D))
    xf = x if fmt == "bshd" else jnp.swapaxes(x, 0, 1)
    ax = 1 if fmt == "bshd" else 0
    v = init(m, xf, decode=True, max_decode_length=S, deterministic=True)
    params, cache = {"params": v["params"]}, v["cache"]
    full = jax.jit(lambda p, x: m.apply(p, x, deterministic=True))(params, xf)
    outs = []
    step = jax.jit(lambda v, x: m.apply(v, x, deterministic=True, decode=True, max_decode_length=S,
                                        mutable=["cache"]))  # one compile for every step
    for t in range(S):
        y, mut = step({**params, "cache": cache}, jax.lax.slice_in_dim(xf, t, t + 1, axis=ax))
        cache = mut["cache"]
        outs.append(y)
    assert_close(jnp.concatenate(outs, axis=ax), full, 3e-5, "step-by-step decode")


def test_two_layer_training_step_learns_reversal():
    V, L = 8, 8

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tok):
            x = nn.Embed(V, D)(tok) + self.param("pos", nn.initializers.normal(0.5), (L, D))
            for i in range(2):
                x = make(self_attn_mask_type="no_mask", enable_relative_embedding=False, mlp_activations=("gelu",),
                         name=f"layer{i}")(x, deterministic=True)
            return nn.Dense(V)(x)

    model = Model()
    params = jax.jit(model.init)(jax.random.key(1), jnp.zeros((2, L), jnp.int32))
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, key):
        tok = jax.random.randint(key, (32, L), 0, V)
        loss_fn = lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, tok), tok[:, ::-1]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(80):
        params, state, loss = step(params, state, jax.random.key(100 + i))
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses


def test_transformer_layer_from_nnx():
    from flax import nnx

    from te_jax.flax import nnx as te_nnx

    x = rand(1, (B, S, D))
    layer = te_nnx.TransformerLayer(hidden_size=D, mlp_hidden_size=F, num_attention_heads=H, hidden_dropout=0.2,
                                    rngs=nnx.Rngs(params=0, dropout=1))
    te_nnx.lazy_init(layer, x, deterministic=True)  # eager, as documented
    specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
    assert tuple(specs["mlp"]["wi_kernel"].get_value()) == ("embed", "act", "mlp")
    # calls below through nnx.jit (eagerly every op compiles on its own)
    call = nnx.jit(lambda mdl, x, deterministic: mdl(x, deterministic=deterministic), static_argnums=2)
    y = call(layer, x, True)
    # same parameters through the linen module give the same output
    linen_params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    y_linen = jax.jit(lambda p, x: make(hidden_dropout=0.2).apply({"params": p}, x, deterministic=True))(
        linen_params, x)
    assert_close(y, y_linen, 1e-6, "nnx == linen")
    assert float(jnp.max(jnp.abs(call(layer, x, False) - y))) > 1e-3  # dropout from the nnx rngs

    def loss(mdl):
        return jnp.mean(mdl(x, deterministic=True) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer)
    g = nnx.to_pure_dict(nnx.state(grads, nnx.Param))
    assert g["mlp"]["wo_kernel"].shape == (F, D)
    opt = nnx.Optimizer(layer, optax.sgd(0.1), wrt=nnx.Param)
    jloss = nnx.jit(loss)
    before = jloss(layer)
    nnx.jit(lambda opt, mdl, grads: opt.update(mdl, grads))(opt, layer, grads)
    assert jloss(layer) < before


@pytest.fixture
def recorded_cp_calls(monkeypatch):
    """Replace context-parallel attention with a stub that records its keyword arguments."""
    calls = []

    def fake_cp(query, key, value, **kw):
        calls.append(kw)
        return jnp.zeros(query.shape[:-1] + value.shape[-1:], query.dtype)

    monkeypatch.setitem(sys.modules, "te_jax.context_parallel",
                        types.SimpleNamespace(context_parallel_attention=fake_cp))
    return calls


def test_context_parallel_arguments_are_passed_down(recorded_cp_calls):
    calls = recorded_cp_calls
    m = make(context_parallel_axis="cp", context_parallel_strategy="all_gather", context_parallel_load_balanced=True,
             enable_relative_embedding=False, self_attn_mask_type="causal", window_size=(4, 0))
    x = rand(1, (B, S, D))
    m.apply(init(m, x), x, deterministic=True)
    kw = calls[-1]
    assert kw["cp_axis"] == "cp" and kw["strategy"] == "all_gather" and kw["load_balanced"] is True
    assert kw["attn_input_format"] == "bshd" and kw["attn_mask_type"] == "causal" and kw["window_size"] == (4, 0)
    assert kw["scale"] == 1.0


def test_context_parallel_keeps_data_and_tensor_axes_of_the_logical_rules(recorded_cp_calls):
    """Under logical axis rules, context-parallel attention is told the batch/head mesh axes (so a
    dp x cp mesh does not replicate attention over the data axis)."""
    calls = recorded_cp_calls
    m = make(context_parallel_axis="cp", enable_relative_embedding=False, self_attn_mask_type="causal")
    x = rand(1, (B, S, D))
    p = init(m, x)
    with nn.logical_axis_rules([("batch", "data"), ("heads", "model"), ("kv_heads", "model")]):
        m.apply(p, x, deterministic=True)
    assert calls[-1]["batch_axes"] == "data" and calls[-1]["head_axes"] == "model"
    m.apply(p, x, deterministic=True)  # no rules: nothing assumed
    assert calls[-1]["batch_axes"] is None and calls[-1]["head_axes"] is None


@pytest.mark.slow  # 15 s; the layer under load-balanced ring CP with RoPE runs in CI as
# test_rope_context_parallel::test_transformer_layer_rope_segments_load_balanced_cp_matches_one_device
def test_context_parallel_layer_matches_single_device():
    """A real context-parallel run (2 fake CPU devices, ring, load-balanced zig-zag order, RoPE)."""
    from te_jax.context_parallel import inverse_reorder_causal_load_balancing, reorder_causal_load_balancing

    kw = dict(enable_relative_embedding=False, enable_rotary_pos_emb=True, num_gqa_groups=2)
    base = make(**kw)
    x = rand(1, (B, S, D))
    p = init(base, x)
    loss = lambda m: (lambda p, x: jnp.sum(m.apply(p, x, deterministic=True) ** 2))
    y_ref, g_ref = jax.jit(lambda p, x: (base.apply(p, x, deterministic=True), jax.grad(loss(base))(p, x)))(p, x)
    m = make(context_parallel_axis="cp", context_parallel_load_balanced=True, context_parallel_strategy="ring", **kw)
    mesh = jax.make_mesh((2,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        xz = reorder_causal_load_balancing(x, 2, 1)
        y = jax.jit(lambda p, x: m.apply(p, x, deterministic=True))(p, xz)
        g = jax.jit(jax.grad(loss(m)))(p, xz)
    assert_close(inverse_reorder_causal_load_balancing(y, 2, 1), y_ref, 2e-5, "context-parallel forward")
    assert_tree_close(g, g_ref, 5e-5, "context-parallel grads")


def test_context_parallel_layer_on_an_explicit_dp_cp_mesh():
    """jax.make_mesh's default (Explicit) axes, batch on "dp", sequence on "cp": the whole layer
    (norms and MLP included) runs on the sharded activations and matches one device."""
    from te_jax.context_parallel import inverse_reorder_causal_load_balancing, reorder_causal_load_balancing
    from jax.sharding import NamedSharding, PartitionSpec as P

    kw = dict(enable_relative_embedding=False, self_attn_mask_type="causal")
    base = make(**kw)
    x = rand(3, (2, 16, D))
    p = init(base, x)
    y_ref = jax.jit(lambda p, x: base.apply(p, x, deterministic=True))(p, x)
    m = make(context_parallel_axis="cp", context_parallel_load_balanced=True, **kw)
    mesh = jax.make_mesh((2, 4), ("dp", "cp"))
    with jax.set_mesh(mesh):
        xz = jax.device_put(reorder_causal_load_balancing(x, 4, 1), NamedSharding(mesh, P("dp", "cp", None)))
        y = jax.jit(lambda p, x: m.apply(p, x, deterministic=True))(p, xz)
    assert_close(inverse_reorder_causal_load_balancing(np.asarray(y), 4, 1), y_ref, 2e-5, "explicit-mesh CP forward")


def test_logical_axis_rules_shard_a_layer():
    """The README's rules: data parallel on "batch", tensor parallel on heads/mlp, FSDP on embed."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = (("batch", "data"), ("embed", "data"), ("heads", "model"), ("kv_heads", "model"), ("mlp", "model"),
             ("length", None), ("kv", None), ("qkv", None), ("act", None), ("relpos_buckets", None))
    m = make()
    x = rand(1, (4, S, D))
    with nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(lambda: m.init(jax.random.key(0), x))
        spec = nn.get_partition_spec(abstract)
        shardings = nn.logical_to_mesh_sharding(spec, mesh, rules)
        assert shardings["params"]["mlp"]["wi_kernel"].spec == jax.sharding.PartitionSpec("data", None, "model")
        assert shardings["params"]["attention"]["qkv"]["kernel"].spec == \
            jax.sharding.PartitionSpec("data", None, "model", None)
        params = jax.jit(lambda: unbox(m.init(jax.random.key(0), x)),
                         out_shardings=nn.meta.unbox(shardings))()
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        y = jax.jit(lambda p, x: m.apply(p, x, deterministic=True))(params, xs)
    y_ref = jax.jit(lambda p, x: m.apply(p, x, deterministic=True))(jax.device_get(params), x)
    assert_close(y, y_ref, 1e-5, "sharded == unsharded")


def test_bad_inputs_layer():
    x = rand(1, (B, S, D))
    with pytest.raises(ValueError, match=r"attn_input_format='bshd' expects \[batch, seq, hidden\] with hidden = 48"):
        make(hidden_size=48, num_attention_heads=4).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="hidden_size=30 is not divisible by num_attention_heads=4"):
        make(hidden_size=30).init(jax.random.key(0), rand(1, (B, S, 30)))
    with pytest.raises(ValueError, match=r"shape \(2, 8\) \(rank 2\), but attn_input_format='sbhd' expects a rank-3"):
        make(attn_input_format="sbhd").init(jax.random.key(0), x[:, :, 0])
    with pytest.raises(ValueError, match=r"rank 3\), but attn_input_format='thd' expects a rank-2 tensor"):
        make(attn_input_format="thd").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="mlp_activations|activations"):
        make(mlp_activations=("tanh",)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="self_attn_mask_type|attn_mask_type='sliding'"):
        make(self_attn_mask_type="sliding").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="layer_type"):
        make(layer_type="encoder_decoder").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="needs `encoded`"):
        make(layer_type="decoder").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="num_gqa_groups=3"):
        make(num_gqa_groups=3).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="hidden_dropout"):
        make(hidden_dropout=1.5).init(jax.random.key(0), x)
    # an sbhd tensor given to a bshd layer with a [batch, 1, seq, seq] mask: the mask no longer fits
    xs = rand(1, (S, B, D))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 1, 8, 8\); with attn_input_format='bshd'"):
        make(self_attn_mask_type="padding_causal").init(jax.random.key(0), xs, None, jnp.zeros((B, 1, S, S), bool))


# TransformerEngine-JAX 2.20's defaults (transformer_engine/jax/flax/transformer.py, TransformerLayer) for the
# fields te_jax shares by name; te_jax/flax/README.md lists the fields whose defaults still differ.
TE_2_20_TRANSFORMER_LAYER_DEFAULTS = dict(
    hidden_size=512, mlp_hidden_size=2048, num_attention_heads=8, num_gqa_groups=None, layernorm_type="layernorm",
    layernorm_epsilon=1e-6, zero_centered_gamma=False, hidden_dropout=0.1, hidden_dropout_dims=(),
    attention_dropout=0.1, intermediate_dropout=0.0, dropout_rng_name="dropout", mlp_kernel_init=None,
    mlp_activations=("gelu",), use_bias=False, apply_residual_connection_post_layernorm=False,
    output_layernorm=False, float32_attention_logits=False, self_attn_mask_type="causal", self_attn_bias_type=None,
    enable_relative_embedding=True, relative_embedding=None, enable_rotary_pos_emb=False,
    rotary_pos_emb_windows=(1, 10000), rotary_pos_emb_group_method="consecutive", drop_path=0.0,
    fuse_qkv_params=True, enable_sequence_parallel=False, scale_attn_logits=False, scaled_query_init=True,
    window_size=None)


def test_transformer_layer_defaults_follow_transformer_engine_2_20():
    layer = TransformerLayer()
    got = {k: getattr(layer, k) for k in TE_2_20_TRANSFORMER_LAYER_DEFAULTS}
    assert got == TE_2_20_TRANSFORMER_LAYER_DEFAULTS
    assert layer.attn_input_format == "bshd"  # TE: transpose_batch_sequence=False
    # mha_kernel_init=None means TE's variance_scaling(1.0, "fan_in", "normal") (std 1/sqrt(fan_in), untruncated);
    # the query columns are scaled by 1/sqrt(head_dim) (scaled_query_init)
    m = make(hidden_size=256, num_attention_heads=4, mlp_hidden_size=64, enable_relative_embedding=False)
    k = init(m, rand(1, (1, 2, 256)))["params"]["attention"]["qkv"]["kernel"]  # [embed, 3, h, d]
    kv = np.asarray(k[:, 1:]).ravel() * np.sqrt(256)
    assert abs(kv.std() - 1.0) < 0.05 and np.abs(kv).max() > 2.5  # truncated_normal would stop at 2 std
    np.testing.assert_allclose(np.asarray(k[:, 0]).std() * np.sqrt(256) * np.sqrt(64), 1.0, atol=0.05)
