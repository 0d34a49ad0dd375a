"""Helpers the test files share (import as `from helpers import ...`, like `tolerance`).

rand / qkv: fresh random inputs (never zeros); fwd_bwd: output and gradients in one compile (fwd_bwd_many: several
cases' in one compile); cpu_mesh: a mesh over the first fake CPU devices
(tests/conftest.py makes 8); ref_norm: LayerNorm / RMSNorm written out in fp32; norm_rel_err: the
Frobenius-norm relative error the kernel and FP8 tests bound (the elementwise metric is
tests/tolerance.py's); attention_backends: the registered attention backends
(te_jax.backends.selection.BACKENDS) that run here, so a test loops over the registry, not a list.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def rand(seed, shape, dtype=jnp.float32, scale=1.0):
    """Standard normal (times `scale`) in fp32, cast to `dtype`. seed: an int (drawn by numpy: no per-shape
    compile, which jax.random pays eagerly for every new shape), a numpy Generator, or a jax key."""
    if isinstance(seed, (int, np.integer, np.random.Generator)):
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(int(seed))
        x = rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(scale)
        return jnp.asarray(x.astype(jnp.dtype(dtype)))
    return (scale * jax.random.normal(seed, shape, jnp.float32)).astype(dtype)


def qkv(seed, b, sq, skv, h, g, d, dv=None, dtype=jnp.float32, scale=1.0, *, cotangent=False):
    """q [b, sq, h, d], k [b, skv, g, d], v [b, skv, g, dv or d] (bshd), drawn from numpy's generator seeded
    with `seed`. cotangent=True adds a fourth, an fp32 output cotangent [b, sq, h, dv or d]."""
    rng = np.random.default_rng(seed)
    dv = dv or d
    out = (rand(rng, (b, sq, h, d), dtype, scale), rand(rng, (b, skv, g, d), dtype, scale),
           rand(rng, (b, skv, g, dv), dtype, scale))
    return out + (rand(rng, (b, sq, h, dv)),) if cotangent else out


def fwd_bwd(fn, args, ct):
    """(out, d<out, ct>/d args) of fn(*args) as one jitted vjp: one compile per function, where a jit for the
    output and another for the gradients compile it twice (and eager autodiff compiles every op per shape)."""
    def run(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(jnp.asarray(ct).astype(out.dtype))
    return jax.jit(run)(*args)


def fwd_bwd_many(cases):
    """[(out, d<out, ct>/d args)] for cases [(fn, args, ct)] (ct: a pytree like out), all in ONE jitted program.
    A compile of these tiny programs is mostly fixed cost: cases folded into one compile cost about a third of
    their separate compiles, and each case's result is still checked on its own."""
    fns = [c[0] for c in cases]

    def run(argss, cts):
        res = []
        for fn, a, ct in zip(fns, argss, cts):
            out, vjp = jax.vjp(fn, *a)
            res.append((out, vjp(jax.tree.map(lambda c, o: jnp.asarray(c).astype(o.dtype), ct, out))))
        return res
    return jax.jit(run)([tuple(c[1]) for c in cases], [c[2] for c in cases])


def fwd_bwd_pairs(cases, seed=99):
    """cases [(name, fn, ref_fn, args)] -> [(name, (out, grads), (ref, ref_grads))]: each fn and its reference
    under the same random cotangent (drawn from `seed`, shaped like ref_fn's output), all in one fwd_bwd_many
    program; the caller compares with its own tolerances."""
    runs = []
    for _, fn, ref_fn, args in cases:
        ct = rand(seed, jax.eval_shape(ref_fn, *args).shape)
        runs += [(fn, args, ct), (ref_fn, args, ct)]
    res = fwd_bwd_many(runs)
    return [(c[0], res[2 * i], res[2 * i + 1]) for i, c in enumerate(cases)]


def cpu_mesh(shape, names, *, auto=False):
    """A mesh over the first prod(shape) devices; Explicit axes (jax.make_mesh's default), or Auto ones."""
    shape, names = tuple(shape), tuple(names)
    kwargs = {"axis_types": (jax.sharding.AxisType.Auto,) * len(names)} if auto else {}
    return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))], **kwargs)


def ref_norm(x, gamma, beta, rms=False, zc=False, eps=1e-6):
    """LayerNorm (rms=False) or RMSNorm in fp32; zc: zero-centred gamma (gamma + 1). beta unused for RMSNorm."""
    x = jnp.asarray(x, jnp.float32)
    g = jnp.asarray(gamma, jnp.float32) + (1.0 if zc else 0.0)
    if rms:
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * g + jnp.asarray(beta, jnp.float32)


def norm_rel_err(a, b, floor=0.0) -> float:
    """‖a − b‖ / max(‖b‖, floor·sqrt(b.size)) in float64, after checking `a` is finite. A floor lets an
    exactly-zero reference (e.g. dq of a one-key row) compare absolutely."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor * np.sqrt(b.size)))


@functools.cache
def attention_backends(runnable: bool = True, **capabilities) -> tuple[str, ...]:
    """Names of the registered attention backends whose `Capabilities` have every given flag set
    (e.g. dense_mask=True); runnable: only those that serve a plain fp32 call here when forced (on a
    CPU: xla, and pallas in interpret mode; not cudnn)."""
    import te_jax
    from te_jax.backends.selection import BACKENDS

    names = [n for n, b in BACKENDS.items()
             if all(getattr(b.capabilities, c) == want for c, want in capabilities.items())]
    if runnable:
        q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.float32)
        names = [n for n in names if te_jax.explain_attention_backend(q, q, q, backend=n).reasons[n] is None]
    return tuple(names)


def spy_kernel_configs(monkeypatch, *names):
    """Wrap pallas_kernels.flash_attention entry points `names` so each call records (name, its block_sizes);
    returns (the recorded list, a BlockSizes of 16 everywhere to pass as config=)."""
    import pallas_kernels.flash_attention as fa
    from pallas_kernels.flash_attention import BlockSizes

    seen = []
    for name in names:
        real = getattr(fa, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, kwargs.get("block_sizes")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(fa, name, spy)
    return seen, BlockSizes(block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=16)
