"""The README's nn.scan recipe: N TransformerLayers scanned over a stacked "layers" parameter axis equal the
same per-layer parameters applied in a Python loop (outputs and gradients, fp32)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.core import meta

from te_jax.flax import TransformerLayer
from tolerance import assert_close

N, B, S, D, H, F = 2, 2, 8, 32, 4, 64
LAYER = dict(hidden_size=D, mlp_hidden_size=F, num_attention_heads=H, num_gqa_groups=2)


# --- the recipe, as in README.md ("Stacking layers with nn.scan")
class Block(nn.Module):
    """One layer in scan's (carry, x) -> (carry, y) form."""
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, _):
        return TransformerLayer(**LAYER, name="layer")(x, deterministic=self.deterministic), None


class Stack(nn.Module):
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                          length=N, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = scanned(self.deterministic, name="layers")(x, None)
        return x
# ---


def _loop(stacked, x):
    """The same parameters, layer by layer, without scan."""
    layer = TransformerLayer(**LAYER)
    for i in range(N):
        x = layer.apply({"params": jax.tree.map(lambda a: a[i], stacked)}, x, deterministic=True)
    return x


def test_scanned_layers_equal_a_python_loop_forward_and_gradients():
    """(Everything jitted: eagerly every op compiles on its own.)"""
    x = jax.random.normal(jax.random.key(1), (B, S, D))
    variables = jax.jit(Stack().init)({"params": jax.random.key(0)}, x)
    spec = nn.get_partition_spec(variables)["params"]["layers"]["layer"]["mlp"]["wi_kernel"]
    assert tuple(spec) == ("layers", "embed", "act", "mlp")  # the stacked axis gets its logical name
    params = meta.unbox(variables)["params"]
    stacked = params["layers"]["layer"]
    assert stacked["mlp"]["wi_kernel"].shape == (N, D, 1, F)
    assert float(jnp.max(jnp.abs(stacked["mlp"]["wi_kernel"][0] - stacked["mlp"]["wi_kernel"][1]))) > 1e-3

    ct = jax.random.normal(jax.random.key(2), (B, S, D))
    scan_loss = lambda p, x: jnp.sum(Stack().apply({"params": p}, x) * ct)
    loop_loss = lambda p, x: jnp.sum(_loop(p["layers"]["layer"], x) * ct)

    @jax.jit  # one compile for both forms, forward and gradients, and the dropout run
    def run(params, x, key):
        return (Stack().apply({"params": params}, x), _loop(params["layers"]["layer"], x),
                jax.grad(scan_loss, argnums=(0, 1))(params, x), jax.grad(loop_loss, argnums=(0, 1))(params, x),
                Stack(deterministic=False).apply({"params": params}, x, rngs={"dropout": key}))

    y_scan, y_loop, g_scan, g_loop, y_drop = run(params, x, jax.random.key(3))
    assert_close(y_scan, y_loop, 1e-5, "scan forward")
    assert_close(g_scan, g_loop, 1e-5, "scan grads")
    # dropout: one "dropout" key, split per layer
    assert float(jnp.max(jnp.abs(y_drop - y_scan))) > 1e-3


def test_scan_without_metadata_params_needs_them():
    """Why the recipe passes metadata_params: the parameters carry logical axis names."""
    x = jnp.ones((B, S, D))

    class Unnamed(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=N)
            return scanned(name="layers")(x, None)[0]

    with pytest.raises(Exception, match="PARTITION_NAME|metadata_params|Partitioning"):  # traced only
        jax.eval_shape(Unnamed().init, jax.random.key(0), x)
