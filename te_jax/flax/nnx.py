"""Flax NNX versions of the te_jax modules (linen modules bridged with flax.nnx.bridge.ToNNX).

Each class takes the linen module's arguments plus `rngs` (an nnx.Rngs with a "params" stream, and a
"dropout" stream for dropout); parameters are created on the first call, or eagerly with
`nnx.bridge.lazy_init(module, *sample_inputs)`. Call arguments are those of the linen module.

    from flax import nnx
    from te_jax.flax import nnx as te_nnx

    layer = te_nnx.TransformerLayer(hidden_size=64, mlp_hidden_size=128, num_attention_heads=4,
                                    rngs=nnx.Rngs(params=0, dropout=1))
    nnx.bridge.lazy_init(layer, x)               # create the parameters
    y = layer(x, deterministic=True)
    grads = nnx.grad(lambda m: loss(m(x, deterministic=True)))(layer)

Decoding with the KV cache (MultiHeadAttention / TransformerLayer, decode=True) needs the cache mutable:
create it with `lazy_init(module, x_max_len, decode=True)`, then call `module(x_chunk, decode=True,
mutable=["cache"])`; the updated cache is written back into the module's state (nnx.Cache variables
cached_key, cached_value, cache_index), under nnx.jit too. Without mutable=["cache"] the call fails (the
"cache" collection is immutable).

FP8 (te_jax.fp8.autocast with DelayedScaling): the scaling state lives in variables of type `FP8State` (the
bridge's type for the linen FP8 collection). As in linen, its "gradient" is the next state: differentiate with
respect to it too and write it back with `update_fp8_state`:

    grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, te_nnx.FP8State)))(model)
    te_nnx.update_fp8_state(model, grads)        # then apply nnx.state(grads, nnx.Param) with your optimizer

Parameters are nnx.Param variables carrying the same logical axis names as the linen modules as
metadata (nnx.get_partition_spec reads them); they are not sharded eagerly at creation: map the names
to a mesh with nn.logical_to_mesh_axes / your rules and place the state with jax.device_put or jit.
"""
from __future__ import annotations

import contextlib

from flax import nnx as _nnx
from flax.nnx import bridge
from flax.nnx import variablelib as _variablelib

from te_jax.flax import attention as _attention
from te_jax.flax import module as _module
from te_jax.flax import transformer as _transformer
from te_jax.fp8 import state as _fp8_state

lazy_init = bridge.lazy_init

#: The nnx Variable type of the FP8 scaling state (linen collection te_jax.fp8.FP8_COLLECTION through the bridge).
FP8State = _variablelib.variable_type_from_name(_fp8_state.FP8_COLLECTION, allow_register=True)


def update_fp8_state(model, grads):
    """Write the FP8 state's "gradient" (the next scales and amax histories) into `model`; grads from nnx.grad
    taken with respect to FP8State as well as the parameters. A model without FP8 state is left as it is."""
    _nnx.update(model, _nnx.state(grads, FP8State))


class _Bridged(bridge.ToNNX):
    _linen_cls = None

    def __init__(self, *args, rngs=None, **kwargs):
        super().__init__(self._linen_cls(*args, **kwargs), rngs=rngs)

    def __call__(self, *args, **kwargs):
        # The logical axis names stay as metadata on the nnx.Param variables; they are not applied
        # eagerly (that needs a mesh at creation time). Shard with nnx.get_partition_spec + jit.
        eager = getattr(_nnx, "use_eager_sharding", None)  # absent in older flax (no eager sharding there)
        with (eager(False) if eager is not None else contextlib.nullcontext()):
            return super().__call__(*args, **kwargs)


def _make(linen_cls):
    doc = (f"NNX version of te_jax.flax.{linen_cls.__name__} (flax.nnx.bridge.ToNNX); takes its arguments "
           f"plus rngs.\n\n{linen_cls.__doc__ or ''}")
    return type(linen_cls.__name__, (_Bridged,), {"_linen_cls": linen_cls, "__doc__": doc,
                                                  "__module__": __name__})


LayerNorm = _make(_module.LayerNorm)
DenseGeneral = _make(_module.DenseGeneral)
LayerNormDenseGeneral = _make(_module.LayerNormDenseGeneral)
LayerNormMLP = _make(_module.LayerNormMLP)
DotProductAttention = _make(_attention.DotProductAttention)
MultiHeadAttention = _make(_attention.MultiHeadAttention)
RelativePositionBiases = _make(_attention.RelativePositionBiases)
TransformerLayer = _make(_transformer.TransformerLayer)
TransformerLayerType = _transformer.TransformerLayerType

__all__ = [
    "DenseGeneral", "DotProductAttention", "FP8State", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP",
    "MultiHeadAttention", "RelativePositionBiases", "TransformerLayer", "TransformerLayerType", "lazy_init",
    "update_fp8_state",
]
