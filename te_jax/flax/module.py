"""Flax linen modules for normalization, dense layers and the MLP block.

Names and arguments follow `transformer_engine.jax.flax`. Every module computes in `dtype`
(inputs are cast to it; None keeps the input's dtype) and stores parameters in `param_dtype`; the math runs in the
te_jax functional ops (`te_jax.normalization.norm`, `te_jax.mlp.layernorm_dense`,
`te_jax.mlp.layernorm_mlp`), which pick their backend (see their `explain_*` functions).
`dtype=None` (the default) computes in the input's dtype, as TransformerEngine does.

Logical axis names of the parameters (defaults; each is a module field):
  LayerNorm             scale ("embed",)                 ln_bias ("embed",)
  DenseGeneral          kernel `kernel_axes`             bias `bias_axes`          (default: none)
  LayerNormDenseGeneral scale/ln_bias ("embed",)         kernel/bias as DenseGeneral
  LayerNormMLP          scale/ln_bias ("embed",)
                        wi_kernel [embed, n_act, mlp] ("embed", "act", "mlp")   wi_bias ("act", "mlp")
                        wo_kernel [mlp, embed]        ("mlp", "embed")          wo_bias ("embed",)

Under a mesh (jax.set_mesh, Auto axes) with logical axis rules, `layernorm_input_axes` (the logical
names of the input's axes, e.g. ("batch", "length", "embed"); TransformerLayer passes them) make
LayerNorm, LayerNormDenseGeneral and LayerNormMLP constrain their input to them and run the op per
shard (shard_map over the mesh axes those names map to; the parameters replicated), so a Pallas
kernel, which XLA's SPMD partitioner cannot split, computes only the local rows. Tensor parallelism runs
per shard too: LayerNormDenseGeneral's kernel sharded along its feature axes (column-parallel), and
LayerNormMLP's "mlp" axis (wi column-parallel, wo row-parallel: partial products summed over the shards,
then wo_bias). FSDP too: parameters sharded over the mesh axis that splits the batch are all-gathered into
the per-shard run. Without the input axes, or when the input's hidden axis or a parameter axis is sharded
any other way, the op runs under the partitioner as before (auto then takes the xla backend, see
te_jax.normalization).
The mechanism is te_jax/flax/_sharding.py's run_per_shard, which the attention modules use too.
"""
from __future__ import annotations

import math

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax import activations as _acts
from te_jax import mlp as _mlp
from te_jax import normalization as _norm
from te_jax.fp8 import context as _fp8_ac
from te_jax.fp8 import norm_cast as _fp8_norm_cast
from te_jax.fp8 import state as _fp8
from te_jax.flax._common import Initializer, check_rate, default_kernel_init, dropout, flat_init, param
from te_jax.flax._sharding import partitioned_axes_of, run_per_shard

_zeros = nn.initializers.zeros
_ones = nn.initializers.ones


def _check_layernorm_type(module: str, layernorm_type: str):
    if layernorm_type not in _norm.LAYERNORM_TYPES:
        raise ValueError(f"{module}: layernorm_type={layernorm_type!r} is unknown; expected one of "
                         f"{_norm.LAYERNORM_TYPES}.")


def _canonical_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _norm_params(module: nn.Module, d: int, layernorm_type: str, zero_centered_gamma: bool, scale_init,
                 scale_axes, bias_init, bias_axes, param_dtype):
    """Create `scale` (and `ln_bias` for layernorm) as TransformerEngine names them."""
    if scale_init is None:
        scale_init = _zeros if zero_centered_gamma else _ones
    gamma = param(module, "scale", scale_init, (d,), param_dtype, scale_axes)
    beta = None
    if layernorm_type == "layernorm":
        beta = param(module, "ln_bias", bias_init, (d,), param_dtype, bias_axes)
    return gamma, beta


def _check_input_axes(module: str, x, input_axes):
    """layernorm_input_axes as a tuple, one logical name (or None) per axis of x; None passes through."""
    if input_axes is None:
        return None
    input_axes = tuple(input_axes)
    if len(input_axes) != x.ndim:
        raise ValueError(f"{module}: layernorm_input_axes={input_axes} names {len(input_axes)} axes but the input "
                         f"has shape {tuple(x.shape)} (rank {x.ndim}); give one logical name (or None) per axis.")
    return input_axes


def _per_shard(module: str, fn, x, weights, weight_axes, input_axes, out_features=(), out_lead=()):
    """fn(x, *weights), run per shard of x (te_jax/flax/_sharding.py) when a mesh and the logical axis rules allow.

    input_axes: logical names of x's axes (None: call fn directly, as before). x is constrained to
    them; fn must act row by row on x's leading axes (norms, norm + GEMMs): it runs per shard over the
    mesh axes those leading names map to, x's last (hidden) axis whole, the weights replicated (their
    cotangents summed over the split axes by shard_map's transpose; FSDP-sharded weights gathered first).
    Falls back to fn(x, *weights) when the hidden axis or a weight is otherwise sharded over a partitioned
    mesh axis, a leading axis does not divide, or the mesh has Explicit / Manual axes (run_per_shard's rules).
    out_features: logical names of the output's trailing (feature) axes when fn computes each output
    feature independently (a column-parallel GEMM): weights sharded along them (tensor parallelism)
    are then split too, x passed whole to each feature shard (its cotangent summed over them).
    out_lead: logical names of leading output axes fn adds (a row-parallel GEMM's partial sums, one
    per shard of a weight axis: fn returns y[None]; the caller sums them).
    """
    if input_axes is None:
        return fn(x, *weights)
    input_axes = _check_input_axes(module, x, input_axes)
    x = nn.with_logical_constraint(x, input_axes)
    lead = input_axes[:-1]
    out_features, out_lead = tuple(out_features), tuple(out_lead)
    split = lead + tuple(n for n in out_features + out_lead if n is not None)
    return run_per_shard(module, fn, (x, *weights), (input_axes, *weight_axes), out_lead + lead + out_features,
                         split=split, params=range(1, 1 + len(weights)))


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis (te_jax.normalization.norm).

    layernorm_type: "layernorm" (params `scale`, `ln_bias`) or "rmsnorm" (`scale` only).
    zero_centered_gamma: y = norm(x) * (1 + scale); `scale` then initialises to zeros.
    Statistics are fp32; the output has dtype `dtype`.
    layernorm_input_axes: logical names of the input's axes; under a mesh with logical axis rules
      the norm then runs per shard (see the module docstring). None: no constraint.
    """

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: Sequence[str] = ("embed",)
    bias_init: Initializer = _zeros
    bias_axes: Sequence[str] = ("embed",)
    dtype: Any = None  # compute dtype; None: the input's dtype (as TransformerEngine)
    param_dtype: Any = jnp.float32
    backend: str = "auto"
    layernorm_input_axes: Sequence[str | None] | None = None

    @nn.compact
    def __call__(self, x):
        _check_layernorm_type("LayerNorm", self.layernorm_type)
        if x.ndim < 1:
            raise ValueError(f"LayerNorm: input has shape {tuple(x.shape)}; expected [..., hidden].")
        gamma, beta = _norm_params(self, x.shape[-1], self.layernorm_type, self.zero_centered_gamma,
                                   self.scale_init, self.scale_axes, self.bias_init, self.bias_axes,
                                   self.param_dtype)

        def fn(x, gamma, beta):
            return _norm.norm(x, gamma, beta, layernorm_type=self.layernorm_type, epsilon=self.epsilon,
                              zero_centered_gamma=self.zero_centered_gamma, backend=self.backend)

        return _per_shard("LayerNorm", fn, jnp.asarray(x, self.dtype), (gamma, beta),
                          (self.scale_axes, self.bias_axes), self.layernorm_input_axes)


def _dense(x, kernel, bias, axis: tuple[int, ...], dtype):
    """Contract `axis` of x with the leading axes of kernel; fp32 accumulation, output in dtype.

    The dot's output type is the compute dtype (GPUs and XLA:CPU accumulate bf16/fp16 GEMMs in
    fp32 anyway), not fp32: autodiff transposes an fp32-output dot into fp32 x fp32 backward GEMMs
    (operands upcast, TF32 instead of bf16 tensor cores), which slowed the te_jax TransformerLayer's
    output projection (issue #4). Same convention as
    pallas_kernels/ln_mlp/reference.mm. The bias is added in fp32.
    """
    x = jnp.asarray(x, dtype)
    dtype = x.dtype
    n_in = len(axis)
    contract = (tuple(axis), tuple(range(n_in)))
    y = lax.dot_general(x, kernel.astype(dtype), (contract, ((), ())), preferred_element_type=dtype)
    if bias is not None:
        y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)
    return y


def _dense_maybe_fp8(module, x, kernel, bias, axis, dtype, fp8_input_scale=None):
    """_dense, or its FP8 version (te_jax/fp8/state.py) when the module's fields / autocast say FP8."""
    recipe, why = _fp8_ac.resolve(type(module).__name__, module.enable_fp8, module.fp8_recipe)
    if recipe is None:
        _fp8_ac.record(module, "kernel", None, why)
        return _dense(x, kernel, bias, axis, dtype)
    return _fp8.dense(module, x, kernel, bias, axis, dtype, recipe, reason=why, input_scale=fp8_input_scale)


def _kernel_param(module, in_dims: tuple, features: tuple):
    """`kernel` [*in_dims, *features] of a Dense-like module (its kernel_init over the flattened matrix)."""
    init = flat_init(module.kernel_init or default_kernel_init(), len(in_dims))
    return param(module, "kernel", init, in_dims + features, module.param_dtype, module.kernel_axes)


def _bias_param(module, features: tuple):
    """`bias` [*features] when module.use_bias, else None."""
    if not module.use_bias:
        return None
    return param(module, "bias", module.bias_init, features, module.param_dtype, module.bias_axes)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_features(module: str, features) -> tuple[int, ...]:
    """features: a positive int or a non-empty tuple/list of them."""
    out = _canonical_tuple(features)
    if not out or not all(_is_int(f) and f > 0 for f in out):
        raise ValueError(f"{module}: features={features!r} must be a positive int or a non-empty tuple of "
                         f"positive ints (the output dims). Fix: e.g. features=8 or features=(4, 16).")
    return tuple(int(f) for f in out)


def _normalize_axes(module: str, axis, ndim: int) -> tuple[int, ...]:
    given = _canonical_tuple(axis)
    if not given or not all(_is_int(a) for a in given):
        raise ValueError(f"{module}: axis={axis!r} must be an int or a non-empty tuple of ints (input axes "
                         f"to contract).")
    axes = tuple(a % ndim if -ndim <= a < ndim else None for a in given)
    if None in axes:
        raise ValueError(f"{module}: axis={axis} is out of range for an input of rank {ndim}.")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{module}: axis={axis} names an input axis twice (rank {ndim}).")
    return axes


class DenseGeneral(nn.Module):
    """y = x · kernel + bias, contracting `axis` of x with kernel[*in_dims, *features].

    features: int or tuple of output dims; axis: int or tuple of input axes (default -1).
    Output axes: the uncontracted input axes (in order) followed by `features`.
    Parameters: `kernel` (logical names `kernel_axes`), `bias` (`bias_axes`), when use_bias.
    The default kernel_init is TE's variance_scaling(1.0, 'fan_in', 'truncated_normal') applied to
    the flattened [prod(in_dims), prod(features)] matrix.
    __call__(inputs, *, fp8_input_scale=None): under DelayedScaling, fp8_input_scale (an fp32 [1] scale) casts
    `inputs` instead of this module's own input_scale, which then only follows (its amax history still records
    the input). MultiHeadAttention passes the query projection's when the key/value projection reads the same
    normalized input, so that input is quantized once, as one fused QKV GEMM would (TransformerEngine's GQA
    layer quantizes it twice). Other recipes ignore it.
    """

    features: int | Sequence[int]
    kernel_init: Initializer | None = None
    kernel_axes: Sequence[str] = ()
    use_bias: bool = True
    bias_init: Initializer = _zeros
    bias_axes: Sequence[str] = ()
    axis: int | Sequence[int] = -1
    dtype: Any = None  # compute dtype; None: the input's dtype (as TransformerEngine)
    param_dtype: Any = jnp.float32
    enable_fp8: bool | None = None  # FP8 GEMM: None follows te_jax.fp8.autocast; True/False force (te_jax/fp8)
    fp8_recipe: Any = None  # a te_jax.fp8 recipe overriding autocast's when FP8 is on

    @nn.compact
    def __call__(self, inputs, *, fp8_input_scale=None):
        features = _check_features("DenseGeneral", self.features)
        axis = _normalize_axes("DenseGeneral", self.axis, inputs.ndim)
        in_dims = tuple(inputs.shape[a] for a in axis)
        kernel, bias = _kernel_param(self, in_dims, features), _bias_param(self, features)
        return _dense_maybe_fp8(self, inputs, kernel, bias, axis, self.dtype, fp8_input_scale)


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm/RMSNorm fused with a dense layer (te_jax.mlp.layernorm_dense): norm(x) · kernel + bias.

    Returns (output, ln_output); ln_output is the normalized input when return_layernorm_output,
    else None (TransformerEngine's convention). Contracts the last axis only.
    Parameters: `scale`, `ln_bias` (scale_axes / ln_bias_axes), `kernel` [hidden, *features]
    (kernel_axes), `bias` [*features] (bias_axes).
    layernorm_input_axes: logical names of the input's axes; under a mesh with logical axis rules
      the op then runs per shard (see the module docstring). None: no constraint.
    Under a per-tensor FP8 recipe with the fused casts (a GPU), no bias and return_layernorm_output=False, the norm
    runs inside the kernel that casts its output to FP8 (te_jax/fp8/norm_dense.py); te_jax.fp8.explain says so.
    """

    features: int | Sequence[int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: Sequence[str] = ("embed",)
    ln_bias_init: Initializer = _zeros
    ln_bias_axes: Sequence[str] = ("embed",)
    kernel_init: Initializer | None = None
    kernel_axes: Sequence[str] = ()
    use_bias: bool = False
    bias_init: Initializer = _zeros
    bias_axes: Sequence[str] = ()
    return_layernorm_output: bool = False
    axis: int | Sequence[int] = -1
    dtype: Any = None  # compute dtype; None: the input's dtype (as TransformerEngine)
    param_dtype: Any = jnp.float32
    backend: str = "auto"
    layernorm_input_axes: Sequence[str | None] | None = None
    enable_fp8: bool | None = None  # FP8 GEMM: None follows te_jax.fp8.autocast; True/False force (te_jax/fp8)
    fp8_recipe: Any = None  # a te_jax.fp8 recipe overriding autocast's when FP8 is on

    def _norm_kw(self):
        return dict(layernorm_type=self.layernorm_type, epsilon=self.epsilon,
                    zero_centered_gamma=self.zero_centered_gamma, backend=self.backend)

    def _gamma_beta(self, d):
        """The norm's `scale` [d] (and `ln_bias` [d] for layernorm, else None)."""
        return _norm_params(self, d, self.layernorm_type, self.zero_centered_gamma, self.scale_init,
                            self.scale_axes, self.ln_bias_init, self.ln_bias_axes, self.param_dtype)

    def _constrained(self, x):
        """x with layernorm_input_axes as its logical sharding constraint (unchanged when None)."""
        if self.layernorm_input_axes is None:
            return x
        return nn.with_logical_constraint(x, _check_input_axes("LayerNormDenseGeneral", x, self.layernorm_input_axes))

    @nn.compact
    def __call__(self, inputs):
        _check_layernorm_type("LayerNormDenseGeneral", self.layernorm_type)
        if _normalize_axes("LayerNormDenseGeneral", self.axis, inputs.ndim) != (inputs.ndim - 1,):
            raise ValueError(f"LayerNormDenseGeneral: axis={self.axis}; only the last axis (-1) is supported.")
        features = _check_features("LayerNormDenseGeneral", self.features)
        d = inputs.shape[-1]
        x = jnp.asarray(inputs, self.dtype)
        kernel, bias = _kernel_param(self, (d,), features), _bias_param(self, features)
        if not self.enable_layernorm:
            y = _dense_maybe_fp8(self, x, kernel, bias, (x.ndim - 1,), self.dtype)
            return y, (x if self.return_layernorm_output else None)
        gamma, beta = self._gamma_beta(d)
        recipe, why = _fp8_ac.resolve("LayerNormDenseGeneral", self.enable_fp8, self.fp8_recipe)
        if recipe is not None:  # norm, then the FP8 GEMM (no per-shard run: XLA partitions it, amax global)
            x = self._constrained(x)
            why_not = _fp8.norm_dense_unavailable(recipe, has_bias=bias is not None,
                                                  returns_ln=self.return_layernorm_output)
            if why_not is None:  # the norm inside x's cast (te_jax/fp8/norm_dense.py)
                path = f"{_fp8.NORM_DENSE_PATH}, {_fp8_norm_cast.describe_stats(recipe, d)}"
                _fp8_ac.record(self, "kernel", recipe, f"{why}; {path}", k=d,
                               n=math.prod(features), shape=f"x{tuple(x.shape)} . kernel{tuple(kernel.shape)}")
                (y,) = _fp8.norm_dense(x, gamma, beta, (kernel,), (_fp8.meta_state(recipe),), recipe,
                                       **self._norm_kw())
                return y, None
            ln = _norm.norm(x, gamma, beta, **self._norm_kw())
            y = _fp8.dense(self, ln, kernel, bias, (x.ndim - 1,), x.dtype, recipe, reason=f"{why}; norm, then "
                           f"the GEMM: {why_not}")
            return y, (ln if self.return_layernorm_output else None)
        _fp8_ac.record(self, "kernel", None, why)

        def fn(x, gamma, beta, kernel, bias):
            return _mlp.layernorm_dense(x, gamma, beta, kernel, bias, layernorm_type=self.layernorm_type,
                                        epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                                        return_layernorm_output=self.return_layernorm_output, backend=self.backend)

        # Column-parallel under tensor parallelism: each output feature is one column of the kernel, so
        # kernels sharded along their feature axes run per shard too (not with return_layernorm_output:
        # the normalized input's hidden axis is not a feature axis).
        feature_axes = ()
        if not self.return_layernorm_output and len(self.kernel_axes) == 1 + len(features):
            feature_axes = tuple(self.kernel_axes[1:])
        out = _per_shard("LayerNormDenseGeneral", fn, x, (gamma, beta, kernel, bias),
                         (self.scale_axes, self.ln_bias_axes, self.kernel_axes, self.bias_axes),
                         self.layernorm_input_axes, out_features=feature_axes)
        if self.return_layernorm_output:
            return out
        return out, None


class LayerNormDenseOperands(LayerNormDenseGeneral):
    """LayerNormDenseGeneral's parameters and FP8 state, made under the same names and in the same order, without the
    GEMM: for a parent that runs this GEMM together with others reading the same norm (MultiHeadAttention's query
    and key/value projections under FP8, te_jax/fp8/norm_dense.py). __call__(inputs, recipe, reason) ->
    (x constrained as LayerNormDenseGeneral would, gamma, beta or None, kernel [hidden, *features], FP8 state or None).
    """

    @nn.compact
    def __call__(self, inputs, recipe, reason):
        features = _check_features("LayerNormDenseGeneral", self.features)
        d = inputs.shape[-1]
        kernel = _kernel_param(self, (d,), features)  # the order of LayerNormDenseGeneral's (its bias is off here)
        gamma, beta = self._gamma_beta(d)
        x = self._constrained(jnp.asarray(inputs, self.dtype))
        _fp8_ac.record(self, "kernel", recipe, reason, k=d, n=math.prod(features),
                       shape=f"x{tuple(x.shape)} . kernel{tuple(kernel.shape)}")
        return x, gamma, beta, kernel, _fp8.meta_state(recipe)


class DenseOperands(DenseGeneral):
    """DenseGeneral's kernel and FP8 state (no bias), made under the same names, without the GEMM (see
    LayerNormDenseOperands). __call__(in_dims, recipe, reason) -> (kernel [*in_dims, *features], FP8 state or None)."""

    @nn.compact
    def __call__(self, in_dims, recipe, reason):
        features = _check_features("DenseGeneral", self.features)
        in_dims = tuple(in_dims)
        kernel = _kernel_param(self, in_dims, features)
        _fp8_ac.record(self, "kernel", recipe, reason, k=math.prod(in_dims), n=math.prod(features),
                       shape=f"kernel{tuple(kernel.shape)}")
        return kernel, _fp8.meta_state(recipe)


class LayerNormMLP(nn.Module):
    """Pre-norm MLP block (te_jax.mlp.layernorm_mlp): norm → wi → activation(s) → dropout → wo.

    activations: ("gelu",), ("relu",), ... or a gated pair ("silu", "linear") (SwiGLU),
      ("gelu", "linear") (GeGLU): wi_kernel is [hidden, len(activations), intermediate_dim].
    intermediate_dropout_rate: dropout on the activation output (RNG stream
      `intermediate_dropout_rng_name`), off when deterministic.
    Returns (output, ln_output) with ln_output None unless return_layernorm_output.
    return_residual: the second output is what the caller adds back as the skip connection: ln_output with
      return_layernorm_output, else the inputs (the same values). Where the fused FP8 MLP runs its norm
      (te_jax.fp8.mlp), the inputs come out of that op, so the skip connection's gradient is added inside the
      norm's backward pass instead of by a pass of its own. TransformerLayer sets it.
    Parameters: scale, ln_bias ("embed",); wi_kernel ("embed", "act", "mlp"); wi_bias ("act", "mlp");
    wo_kernel ("mlp", "embed"); wo_bias ("embed",) (biases only when use_bias).
    layernorm_input_axes: logical names of the input's axes; under a mesh with logical axis rules
      the block then runs per shard (see the module docstring). None: no constraint.
    """

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: Sequence[str] = ("embed",)
    ln_bias_init: Initializer = _zeros
    ln_bias_axes: Sequence[str] = ("embed",)
    kernel_init: Initializer | None = None
    kernel_axes_1: Sequence[str] = ("embed", "act", "mlp")
    kernel_axes_2: Sequence[str] = ("mlp", "embed")
    use_bias: bool = False
    bias_init: Initializer = _zeros
    bias_axes_1: Sequence[str] = ("act", "mlp")
    bias_axes_2: Sequence[str] = ("embed",)
    return_layernorm_output: bool = False
    return_residual: bool = False
    activations: Sequence[str] = ("gelu",)
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
    dtype: Any = None  # compute dtype; None: the input's dtype (as TransformerEngine)
    param_dtype: Any = jnp.float32
    backend: str = "auto"
    layernorm_input_axes: Sequence[str | None] | None = None
    enable_fp8: bool | None = None  # FP8 GEMMs: None follows te_jax.fp8.autocast; True/False force (te_jax/fp8)
    fp8_recipe: Any = None  # a te_jax.fp8 recipe overriding autocast's when FP8 is on

    @nn.compact
    def __call__(self, inputs, deterministic: bool = False):
        _check_layernorm_type("LayerNormMLP", self.layernorm_type)
        acts = _acts.validate_activations(self.activations, "LayerNormMLP: activations")
        rate = check_rate("LayerNormMLP", "intermediate_dropout_rate", self.intermediate_dropout_rate)
        if not isinstance(self.intermediate_dim, int) or self.intermediate_dim <= 0:
            raise ValueError(f"LayerNormMLP: intermediate_dim={self.intermediate_dim!r} must be a positive int.")
        d, f, n_act = inputs.shape[-1], self.intermediate_dim, len(acts)
        x = jnp.asarray(inputs, self.dtype)
        _check_input_axes("LayerNormMLP", x, self.layernorm_input_axes)  # also where no per-shard run follows
        init = self.kernel_init or default_kernel_init()
        w1 = param(self, "wi_kernel", _wi_init(init), (d, n_act, f), self.param_dtype, self.kernel_axes_1)
        w2 = param(self, "wo_kernel", flat_init(init, 1), (f, d), self.param_dtype, self.kernel_axes_2)
        b1 = b2 = None
        if self.use_bias:
            b1 = param(self, "wi_bias", self.bias_init, (n_act, f), self.param_dtype, self.bias_axes_1)
            b2 = param(self, "wo_bias", self.bias_init, (d,), self.param_dtype, self.bias_axes_2)
        active = rate > 0.0 and not deterministic
        rng = self.make_rng(self.intermediate_dropout_rng_name) if active else None
        recipe, why = _fp8_ac.resolve("LayerNormMLP", self.enable_fp8, self.fp8_recipe)
        if recipe is not None:
            # FP8: norm + two FP8 GEMMs on the XLA path (the Pallas ln_mlp custom_vjp has bf16 GEMMs inside;
            # te_jax.explain_mlp_backend(..., fp8_recipe=...) says so); no per-shard run (XLA partitions it).
            gamma = beta = None
            if self.layernorm_input_axes is not None:
                x = nn.with_logical_constraint(x, tuple(self.layernorm_input_axes))
            if self.enable_layernorm:
                gamma, beta = _norm_params(self, d, self.layernorm_type, self.zero_centered_gamma, self.scale_init,
                                           self.scale_axes, self.ln_bias_init, self.ln_bias_axes,
                                           self.param_dtype)
            skip = (self.return_residual and not self.return_layernorm_output
                    and jnp.dtype(x.dtype) == jnp.dtype(inputs.dtype))
            out = _fp8.layernorm_mlp(self, x, gamma, beta, w1, b1, w2, b2, recipe=recipe,
                                     layernorm_type=self.layernorm_type, epsilon=self.epsilon,
                                     zero_centered_gamma=self.zero_centered_gamma, backend=self.backend,
                                     activations=acts, dropout_rate=rate if active else 0.0, dropout_rng=rng,
                                     enable_layernorm=self.enable_layernorm, reason=why, skip=skip)
            if skip:  # the residual out of the fused norm's op (or x itself where it does not run)
                return out[0], out[2]
            return self._with_residual(out[0], out[1] if self.return_layernorm_output else None, inputs)
        for gemm in ("wi_kernel", "wo_kernel"):
            _fp8_ac.record(self, gemm, None, why)
        if not self.enable_layernorm:
            y = _plain_mlp(x, w1, b1, w2, b2, acts, rate if active else 0.0, rng)
            return self._with_residual(y, x if self.return_layernorm_output else None, inputs)
        gamma, beta = _norm_params(self, d, self.layernorm_type, self.zero_centered_gamma, self.scale_init,
                                   self.scale_axes, self.ln_bias_init, self.ln_bias_axes, self.param_dtype)

        def fn(x, gamma, beta, w1, b1, w2, b2):
            return _mlp.layernorm_mlp(x, gamma, beta, w1, b1, w2, b2, layernorm_type=self.layernorm_type,
                                      activations=acts, epsilon=self.epsilon,
                                      zero_centered_gamma=self.zero_centered_gamma,
                                      return_layernorm_output=self.return_layernorm_output, backend=self.backend,
                                      dropout_rate=rate, dropout_rng=rng, deterministic=not active)

        mlp_axis = self.kernel_axes_1[-1] if len(self.kernel_axes_1) == 3 else None
        row_parallel = (self.layernorm_input_axes is not None and not self.return_layernorm_output
                        and mlp_axis is not None and tuple(self.kernel_axes_2[:1]) == (mlp_axis,)
                        and tuple(self.bias_axes_1[-1:]) in ((mlp_axis,), ())
                        and partitioned_axes_of(mlp_axis))
        if active:  # dropout draws one mask over the global array: no per-shard run (the xla path serves it)
            out = fn(x, gamma, beta, w1, b1, w2, b2)
        elif row_parallel:
            # Tensor parallelism (Megatron): wi split along `mlp` (column-parallel), wo along `mlp` too
            # (row-parallel). Each shard returns its partial product [1, ..., hidden]; their sum over the
            # shards (an all-reduce XLA inserts) plus wo_bias is the output.
            def partial(x, gamma, beta, w1, b1, w2):
                return fn(x, gamma, beta, w1, b1, w2, None)[None]

            parts = _per_shard("LayerNormMLP", partial, x, (gamma, beta, w1, b1, w2),
                               (self.scale_axes, self.ln_bias_axes, self.kernel_axes_1, self.bias_axes_1,
                                self.kernel_axes_2), self.layernorm_input_axes, out_lead=(mlp_axis,))
            y = jnp.sum(parts.astype(jnp.float32), axis=0)
            if b2 is not None:
                y = y + b2.astype(jnp.float32)
            out = y.astype(x.dtype)
        else:
            out = _per_shard("LayerNormMLP", fn, x, (gamma, beta, w1, b1, w2, b2),
                             (self.scale_axes, self.ln_bias_axes, self.kernel_axes_1, self.bias_axes_1,
                              self.kernel_axes_2, self.bias_axes_2), self.layernorm_input_axes)
        if self.return_layernorm_output:
            return self._with_residual(*out, inputs)
        return self._with_residual(out, None, inputs)

    def _with_residual(self, y, ln_output, inputs):
        """(y, ln_output), or (y, inputs) with return_residual and no return_layernorm_output."""
        if self.return_residual and not self.return_layernorm_output:
            return y, inputs
        return y, ln_output


def _wi_init(init):
    """Each activation's [hidden, intermediate] slice initialised as its own matrix."""

    def fn(key, shape, dtype=jnp.float32):
        d, n, f = shape
        keys = jax.random.split(key, n)
        return jnp.stack([init(k, (d, f), dtype) for k in keys], axis=1)

    return fn


def _plain_mlp(x, w1, b1, w2, b2, acts, rate, rng):
    """MLP without the norm (enable_layernorm=False): jnp GEMMs with fp32 accumulation.

    GEMM outputs are in x.dtype (see _dense: an fp32-output dot makes the backward GEMMs fp32)."""
    dt = x.dtype
    h = jnp.einsum("...d,daf->...af", x, w1.astype(dt), preferred_element_type=dt)
    a = _acts.biased_activation_dropout(h, b1, acts, rate, rng, dt)
    y = jnp.einsum("...f,fd->...d", a, w2.astype(dt), preferred_element_type=dt)
    if b2 is not None:
        y = y.astype(jnp.float32) + b2.astype(jnp.float32)
    return y.astype(dt)
