"""FP8 state as a Flax variable collection, and the FP8 GEMM paths of the te_jax Flax modules.

Collection: FP8_COLLECTION = flax's OVERWRITE_WITH_GRADIENT ("_overwrite_with_gradient"), the name
flax's Fp8DotGeneralOp, MaxText and praxis use. Under DelayedScaling each FP8 GEMM owns a submodule
`Fp8Meta` (named "fp8_meta", or "wi_fp8_meta" / "wo_fp8_meta" in LayerNormMLP) holding flax's six
variables: input_scale (1,), input_amax_history (L,), kernel_scale (1,), kernel_amax_history (L,),
output_grad_scale (1,), output_grad_amax_history (L,), all fp32 (scales init 1, histories 0).
The backward amax travels through the gradient of this collection as in flax's Fp8DotGeneralOp: take
gradients with respect to it too, and replace it by its gradient (update_fp8_state). Float8CurrentScaling
and Float8BlockScaling have no state.

Train step:
    def loss_fn(params, fp8_state):
        return loss(model.apply({"params": params, FP8_COLLECTION: fp8_state}, x))
    loss, (g_params, new_fp8_state) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8_state)
or, with one variables dict: grads = jax.grad(f)(variables); variables = update_fp8_state(new_variables, grads).
nn.scan over layers: variable_axes={"params": 0, FP8_COLLECTION: 0} (one state per layer); nn.remat needs nothing.
A checkpoint stores the collection like any other (flax.serialization.to_state_dict / orbax).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax import activations as _acts
from te_jax import normalization as _norm
from te_jax.fp8 import block_mlp as _block_mlp
from te_jax.fp8 import context as _ac
from te_jax.fp8 import mlp as _fp8_mlp
from te_jax.fp8 import norm_cast as _norm_cast
from te_jax.fp8 import norm_dense as _norm_dense
from te_jax.fp8.fused import fused_cast_unavailable, keep_weight_copies
from te_jax.fp8.quantize import STATE_KEYS, fp8_dot_general, gemm_style
from te_jax.fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

try:
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT as FP8_COLLECTION
except ImportError:  # pragma: no cover - flax without fp8_ops
    FP8_COLLECTION = "_overwrite_with_gradient"


class Fp8Meta(nn.Module):
    """The delayed-scaling state of one GEMM (variables in FP8_COLLECTION); returns it as a dict."""

    amax_history_len: int = 1024

    @nn.compact
    def __call__(self):
        L = self.amax_history_len
        out = {}
        for k in STATE_KEYS:
            shape = (L,) if k.endswith("history") else (1,)
            fill = jnp.zeros if k.endswith("history") else jnp.ones
            if (not self.is_initializing() and not self.has_variable(FP8_COLLECTION, k)
                    and not self.is_mutable_collection(FP8_COLLECTION)):
                raise ValueError(
                    f"{'/'.join(self.path)}: FP8 DelayedScaling state {FP8_COLLECTION!r}/{k} is missing from the "
                    "variables. Fix: run model.init under the same te_jax.fp8.autocast(recipe=DelayedScaling(...)) "
                    f"and pass the {FP8_COLLECTION!r} collection to apply.")
            v = self.variable(FP8_COLLECTION, k, lambda s=shape, f=fill: f(s, jnp.float32)).value
            if tuple(v.shape) != shape:
                raise ValueError(f"{'/'.join(self.path)}: FP8 state {k} has shape {tuple(v.shape)}; the recipe's "
                                 f"amax_history_len={L} wants {shape}. Fix: initialize with the same recipe.")
            out[k] = v
        return out


def update_fp8_state(variables, grads):
    """variables with its FP8_COLLECTION replaced by grads[FP8_COLLECTION] (the new scales and histories)."""
    if FP8_COLLECTION not in grads:
        return variables
    out = dict(variables)
    out[FP8_COLLECTION] = grads[FP8_COLLECTION]
    return type(variables)(out) if not isinstance(variables, dict) else out


def split_fp8_state(variables):
    """(variables without FP8_COLLECTION, the FP8 collection or {})."""
    rest = {k: v for k, v in dict(variables).items() if k != FP8_COLLECTION}
    return rest, dict(variables).get(FP8_COLLECTION, {})


def meta_state(recipe, name="fp8_meta"):
    """The calling module's FP8 state under `recipe` (an Fp8Meta submodule named `name`; None without state)."""
    if isinstance(recipe, DelayedScaling):
        return Fp8Meta(amax_history_len=recipe.amax_history_len, name=name)()
    return None


NORM_DENSE_PATH = "the norm fused into x's cast (te_jax.fp8.norm_dense: its output never stored)"


def norm_dense_unavailable(recipe, *, has_bias: bool, returns_ln: bool) -> str | None:
    """Why a norm -> FP8 GEMM(s) would NOT run as te_jax.fp8.norm_dense (None: it does)."""
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return f"{type(recipe).__name__} is not a per-tensor recipe"
    why = fused_cast_unavailable(recipe)
    if why is not None:
        return why
    if has_bias:
        return "biases (use_bias=True)"
    if returns_ln:
        return "the norm's output is returned (return_layernorm_output), so it is stored anyway"
    return None


def norm_dense(x, gamma, beta, kernels, states, recipe, *, layernorm_type, epsilon, zero_centered_gamma, backend,
               skip=False):
    """te_jax.fp8.norm_dense.norm_fp8_dense for modules: x [..., K] -> a tuple of x . kernel_i, the norm fused in
    (skip=True: x itself last, for the residual add; its gradient joins the norm's backward pass)."""
    spec = _norm_cast.norm_spec(x, gamma, beta, layernorm_type=layernorm_type, epsilon=epsilon,
                                zero_centered_gamma=zero_centered_gamma, backend=backend)
    return _norm_dense.norm_fp8_dense(x, gamma, beta, kernels, states if isinstance(recipe, DelayedScaling) else None,
                                      recipe, spec, gemm_style=gemm_style(), skip=skip)


def dense(module, x, kernel, bias, axis, dtype, recipe, *, meta_name="fp8_meta", gemm="kernel", reason="",
          input_scale=None):
    """FP8 version of te_jax.flax.module._dense: x [..., *in] . kernel [*in, *features] (+ bias, fp32 add).

    The GEMM output is in the compute dtype; dx/dw come back in the compute dtype (dw then to param dtype).
    input_scale (DelayedScaling; fp32 [1]): cast x with this scale instead of the state's own input_scale (another
    GEMM's, reading the same x: both casts are then one, XLA merging the identical kernel calls). This state's
    input history still records x's amax and its next input_scale is computed from it as usual.
    """
    x = jnp.asarray(x, dtype)
    dtype = x.dtype
    axis = tuple(axis)
    n_in = len(axis)
    k = 1
    for a in axis:
        k *= x.shape[a]
    _ac.record(module, gemm, recipe, reason, k=k, n=kernel.size // max(k, 1),
               shape=f"x{tuple(x.shape)} . {gemm}{tuple(kernel.shape)}")
    dn = ((axis, tuple(range(n_in))), ((), ()))
    state = meta_state(recipe, meta_name)
    if state is not None and input_scale is not None:
        # the value of the shared scale, the gradient of this state's own: the custom VJP hands this GEMM's next
        # input scale out as the "gradient" of state["input_scale"], which must reach this module's variable (and
        # not add to the other GEMM's)
        if jnp.size(input_scale) != 1:
            raise ValueError(f"{'/'.join(module.path) or type(module).__name__}: fp8_input_scale has shape "
                             f"{tuple(jnp.shape(input_scale))}; expected a scalar or shape (1,) (another GEMM's "
                             "DelayedScaling input_scale).")
        own = state["input_scale"]
        shared = jnp.asarray(input_scale, jnp.float32).reshape(1)
        state = {**state, "input_scale": own + jax.lax.stop_gradient(shared - own)}
    y = fp8_dot_general(x, kernel.astype(dtype), dn, recipe, state)
    if bias is not None:
        y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)
    return y


def input_scale_of(module, child, meta_name="fp8_meta"):
    """The DelayedScaling input_scale [1] of submodule `child` of `module` (already called), or None when it has none
    (FP8 off there, or a recipe without state)."""
    meta = module.variables.get(FP8_COLLECTION, {}).get(child, {}).get(meta_name, {})
    return meta.get("input_scale")


def layernorm_mlp(module, x, gamma, beta, w1, b1, w2, b2, *, recipe, layernorm_type, epsilon, zero_centered_gamma,
                  backend, activations, dropout_rate, dropout_rng, enable_layernorm=True, reason="", skip=False):
    """norm (te_jax.normalization.norm, its own backend) -> FP8 GEMM wi -> activation(s) -> dropout -> FP8 GEMM wo.

    x [..., D]; w1 [D, n_act, F]; b1 [n_act, F] | None; w2 [F, D]; b2 [D] | None. Returns (y, ln_out), and with
    skip=True (y, ln_out, x_skip): x for the caller's residual add, out of the fused norm path where it runs (its
    gradient then joins the norm's backward pass), else x itself.
    Two paths, the same math (te_jax/fp8/README.md, "Fused quantization"):
      fused (te_jax.fp8.mlp.fused_fp8_mlp): a per-tensor recipe, no biases, no active dropout, no mesh XLA
        partitions, a GPU (or TE_JAX_FP8_FUSED=1), TE_JAX_FP8_FUSED not 0: the activation, its gradient
        and every cast run in Pallas kernels that also write the transposed FP8 operands and the amaxes; the norm
        runs inside x's cast (te_jax.fp8.norm_cast: its output is stored only if the caller uses `ln`);
      fused block-scaled (te_jax.fp8.block_mlp.fused_block_fp8_mlp): Float8BlockScaling with the FP8 block GEMM on
        (block.block_gemm_mode() not "xla"), no biases, no active dropout, no partitioned mesh, token count, D, F
        and Dout multiples of 128: the activation and its gradient write the GEMMs' 1x128 block casts;
      unfused: two `dense` calls (fp8_dot_general) with te_jax's activation between, all on XLA.
    te_jax.fp8.explain says which one ran and why. The Pallas ln_mlp path (bf16 GEMMs inside its custom_vjp) is
    not used under FP8.
    """
    dt = x.dtype
    ln = _norm.norm(x, gamma, beta, layernorm_type=layernorm_type, epsilon=epsilon,
                    zero_centered_gamma=zero_centered_gamma, backend=backend) if enable_layernorm else x
    has_bias = b1 is not None or b2 is not None
    if isinstance(recipe, Float8BlockScaling):
        d, n_act, f = w1.shape
        why_not = _block_mlp.block_mlp_unavailable(recipe, has_bias=has_bias, dropout_rate=dropout_rate,
                                                   m=math.prod(ln.shape[:-1]), d=d, f=f, d_out=w2.shape[-1])
        if why_not is None:
            path = "fused block-scaled FP8 MLP (te_jax.fp8.block_mlp: the activation kernels write both block casts)"
            _ac.record(module, "wi_kernel", recipe, f"{reason}; {path}", k=d, n=n_act * f,
                       shape=f"x{tuple(ln.shape)} . wi_kernel{tuple(w1.shape)}")
            _ac.record(module, "wo_kernel", recipe, f"{reason}; {path}", k=f, n=w2.shape[-1],
                       shape=f"x{tuple(ln.shape[:-1]) + (f,)} . wo_kernel{tuple(w2.shape)}")
            y = _block_mlp.fused_block_fp8_mlp(ln.astype(dt), w1, w2, recipe, activations=activations)
            return (y, ln, x) if skip else (y, ln)
    else:
        why_not = _fp8_mlp.fused_mlp_unavailable(recipe, has_bias=has_bias, dropout_rate=dropout_rate)
    if why_not is None:
        d, n_act, f = w1.shape
        spec = None if not enable_layernorm else _norm_cast.norm_spec(
            x, gamma, beta, layernorm_type=layernorm_type, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
            backend=backend)
        path = "fused FP8 MLP (te_jax.fp8.mlp: cast/activation kernels write FP8 operands, transposes and amaxes"
        path += f"; the norm fused into x's cast, {_norm_cast.describe_stats(recipe, d)}" if enable_layernorm else ""
        path += f"; {_norm_cast.describe_skip(spec)}" if skip and enable_layernorm else ""
        path += ("; the weights' FP8 copies kept for the backward, TE_JAX_FP8_KEEP_WEIGHTS)"
                 if keep_weight_copies(recipe) else ")")
        _ac.record(module, "wi_kernel", recipe, f"{reason}; {path}", k=d, n=n_act * f,
                   shape=f"x{tuple(ln.shape)} . wi_kernel{tuple(w1.shape)}")
        _ac.record(module, "wo_kernel", recipe, f"{reason}; {path}", k=f, n=w2.shape[-1],
                   shape=f"x{tuple(ln.shape[:-1]) + (f,)} . wo_kernel{tuple(w2.shape)}")
        states = (meta_state(recipe, "wi_fp8_meta"), meta_state(recipe, "wo_fp8_meta"))
        if enable_layernorm:  # x's cast applies the norm itself (te_jax/fp8/norm_cast.py); `ln` is only returned
            y = _fp8_mlp.fused_fp8_mlp(x.astype(dt), w1, w2, recipe, *states, activations=activations, norm=spec,
                                       gamma=gamma, beta=beta, skip=skip)
            if skip:
                return y[0], ln, y[1]
        else:
            y = _fp8_mlp.fused_fp8_mlp(ln.astype(dt), w1, w2, recipe, *states, activations=activations)
        return (y, ln, x) if skip else (y, ln)
    reason = f"{reason}; unfused FP8 MLP: {why_not}"
    h = dense(module, ln, w1, None, (ln.ndim - 1,), dt, recipe, meta_name="wi_fp8_meta", gemm="wi_kernel",
              reason=reason)
    a = _acts.biased_activation_dropout(h, b1, activations, dropout_rate, dropout_rng, dt)
    y = dense(module, a, w2, b2, (a.ndim - 1,), dt, recipe, meta_name="wo_fp8_meta", gemm="wo_kernel",
              reason=reason)
    return (y, ln, x) if skip else (y, ln)


__all__ = ["FP8_COLLECTION", "Fp8Meta", "update_fp8_state", "split_fp8_state", "dense", "input_scale_of",
           "layernorm_mlp", "meta_state", "norm_dense", "norm_dense_unavailable", "NORM_DENSE_PATH"]
