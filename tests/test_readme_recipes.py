"""README recipes that are easy to get wrong: meshes need Auto axes under logical axis rules, and NNX
decoding needs mutable=["cache"]."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from te_jax.flax import TransformerLayer
from tolerance import assert_close

B, S, D, H, F = 4, 8, 32, 4, 64
RULES = (("batch", "data"), ("embed", None), ("heads", "model"), ("kv_heads", "model"), ("mlp", "model"),
         ("length", None), ("kv", None), ("qkv", None), ("act", None), ("relpos_buckets", None))


def _init_and_apply(layer, mesh, x):
    """README "Meshes: Auto axes": initialise under the rules, sharded by jit, then apply."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(lambda: layer.init(jax.random.key(0), x, deterministic=True))
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
        params = jax.jit(lambda: nn.meta.unbox(layer.init(jax.random.key(0), x, deterministic=True)),
                         out_shardings=nn.meta.unbox(shardings))()
        y = jax.jit(lambda p, x: layer.apply(p, x, deterministic=True))(
            params, jax.device_put(x, NamedSharding(mesh, P("data"))))
    return params, y


def test_logical_axis_rules_need_a_mesh_with_auto_axes():
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices; tests/conftest.py sets 8")
    layer = TransformerLayer(hidden_size=D, mlp_hidden_size=F, num_attention_heads=H)
    x = jax.random.normal(jax.random.key(1), (B, S, D))
    # jax.make_mesh's default axis types are Explicit: flax's logical constraints then act as asserts and fail
    explicit = jax.make_mesh((2, 2), ("data", "model"))
    with pytest.raises(Exception, match="Explicit"):
        _init_and_apply(layer, explicit, x)
    # the documented way: Auto axes
    auto = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params, y = _init_and_apply(layer, auto, x)
    assert params["params"]["mlp"]["wi_kernel"].sharding.spec == P(None, None, "model")
    assert_close(y, layer.apply(jax.device_get(params), x, deterministic=True), 1e-5, "sharded == unsharded")


@pytest.mark.slow  # 15 s; NNX decoding with its mutable cache runs in CI as test_flax_decode::test_nnx_decode_with_mutable_cache
def test_nnx_decoding_needs_mutable_cache():
    from flax import errors, nnx

    from te_jax.flax import nnx as te_nnx

    x = jax.random.normal(jax.random.key(1), (2, S, D))
    layer = te_nnx.TransformerLayer(hidden_size=D, mlp_hidden_size=F, num_attention_heads=H,
                                    rngs=nnx.Rngs(params=0, dropout=1))
    te_nnx.lazy_init(layer, x, decode=True, max_decode_length=S, deterministic=True)  # params + an empty cache
    empty_cache = nnx.clone(nnx.state(layer, nnx.Cache))
    full = layer(x, deterministic=True)
    with pytest.raises(errors.ModifyScopeVariableError, match="cache"):
        layer(x[:, :1], decode=True, max_decode_length=S, deterministic=True)  # the cache is read-only by default
    steps = [layer(x[:, t:t + 1], decode=True, max_decode_length=S, deterministic=True, mutable=["cache"])
             for t in range(S)]
    assert_close(jnp.concatenate(steps, axis=1), full, 3e-5, "NNX step-by-step decode")
    assert (nnx.state(layer, nnx.Cache)["attention"]["cache_index"].get_value() == S).all()  # per-row lengths
    nnx.update(layer, empty_cache)  # a new sequence starts from the empty cache
    again = layer(x[:, :1], decode=True, max_decode_length=S, deterministic=True, mutable=["cache"])
    assert_close(again, steps[0], 1e-6, "after resetting the cache")
