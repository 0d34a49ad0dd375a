"""The README's nn.jit recipe ("Compile time"): a Python loop of nn.jit-wrapped TransformerLayers computes what the
plain loop computes (outputs and gradients, fp32), while jax traces and lowers the layer once whatever the depth
(the lowered program holds the layer's GEMMs, forward and backward, in two copies: the first layer, whose input
needs no gradient, and the others; each is called per layer)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from te_jax.flax import TransformerLayer
from tolerance import assert_close

B, S, D, H, F = 2, 8, 32, 4, 64
LAYER = dict(hidden_size=D, mlp_hidden_size=F, num_attention_heads=H, num_gqa_groups=2,
             attention_backend="xla", norm_backend="xla", mlp_backend="xla")


# --- the recipe, as in README.md ("Compile time")
class Layer(nn.Module):
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        return TransformerLayer(**LAYER, name="layer")(x, deterministic=self.deterministic)


JitLayer = nn.jit(Layer)


class JitStack(nn.Module):
    num_layers: int = 3

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = JitLayer(name=f"layer_{i}")(x)
        return x
# ---


class LoopStack(nn.Module):
    num_layers: int = 3

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = TransformerLayer(**LAYER, name=f"layer_{i}")(x, deterministic=True)
        return x


def _loss(model):
    return lambda p, x: jnp.mean(jnp.square(model.apply(p, x)))


@pytest.mark.slow  # 12 s; CI keeps test_train_lm_jit_layers_equals_the_plain_model_and_decodes and the GEMM count
def test_jit_layers_equal_the_plain_loop_forward_and_gradients():
    x = jax.random.normal(jax.random.key(1), (B, S, D), jnp.float32)
    loop = LoopStack()
    p = jax.jit(loop.init)(jax.random.key(0), x)  # jitted: eagerly every op compiles on its own
    p_jit = {"params": {k: {"layer": v} for k, v in p["params"].items()}}
    assert jax.tree_util.tree_structure(p_jit) == jax.tree_util.tree_structure(
        jax.eval_shape(JitStack().init, jax.random.key(0), x))
    (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(_loss(m)))(q, x) for m, q in ((loop, p), (JitStack(), p_jit)))
    assert_close(l1, l0, 1e-5)
    g1 = {"params": {k: v["layer"] for k, v in g1["params"].items()}}
    assert_close(g1, g0, 1e-5)
    assert float(jnp.abs(jax.tree_util.tree_leaves(g0)[0]).max()) > 0  # the gradients are not all zero


def test_jit_layers_are_traced_and_lowered_once():
    x = jax.ShapeDtypeStruct((B, S, D), jnp.float32)

    def dots(model):
        p = jax.eval_shape(model.init, jax.random.key(0), x)
        return jax.jit(jax.value_and_grad(_loss(model))).lower(p, x).as_text().count("stablehlo.dot_general")

    assert dots(LoopStack(num_layers=4)) == 4 * dots(LoopStack(num_layers=1))
    # two variants of the layer: the first (its input needs no cotangent) and every later one
    assert dots(JitStack(num_layers=6)) == dots(JitStack(num_layers=3)) == 2 * dots(JitStack(num_layers=1)) > 0


def test_train_lm_jit_layers_equals_the_plain_model_and_decodes():
    """examples/train_lm.py --jit-layers: the same parameters (one level deeper) give the same logits, and KV-cache
    decoding through the jitted layers (their mutable cache) gives the plain model's greedy tokens."""
    import importlib.util
    import os
    import sys

    import numpy as np

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_lm.py")
    spec = importlib.util.spec_from_file_location("train_lm_example", script)
    train_lm = sys.modules.get(spec.name)
    if train_lm is None:
        train_lm = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = train_lm
        spec.loader.exec_module(train_lm)
    tiny = ["--layers", "2", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq-len", "32", "--dtype", "fp32",
            "--no-compile-cache"]
    args, jit_args = train_lm.parse_args(tiny), train_lm.parse_args(tiny + ["--jit-layers"])
    model, jitted = train_lm.make_model(args), train_lm.make_model(jit_args)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    pos = jnp.arange(16)[None]
    params = nn.unbox(jax.jit(model.init)(jax.random.key(1), tokens, pos)["params"])  # jitted: eagerly every op
    nested = {k: ({"layer": v} if k.startswith("layer_") else v) for k, v in params.items()}  # compiles on its own
    want = jax.tree.map(jnp.shape, nn.unbox(jax.eval_shape(jitted.init, jax.random.key(1), tokens, pos)["params"]))
    assert jax.tree.map(jnp.shape, nested) == want
    y_jit, y = jax.jit(lambda nested, params: (jitted.apply({"params": nested}, tokens, pos),
                                               model.apply({"params": params}, tokens, pos)))(nested, params)
    np.testing.assert_allclose(y_jit, y, rtol=1e-5, atol=1e-5)
    greedy = train_lm.generate(args, params, "def ", 3, seed=0, temperature=0.0)
    assert train_lm.generate(jit_args, nested, "def ", 3, seed=0, temperature=0.0) == greedy
