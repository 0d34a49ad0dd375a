"""The tests' one closeness metric: errors relative to the reference's scale.

    scale(ref) = max|ref| + 1e-6            (ref_scale(ref))
               = max(max|ref|, floor)       (ref_scale(ref, floor), e.g. floor=1: absolute below 1)

`rel_err(a, ref)` is max|a - ref| / scale(ref). `assert_close(a, ref, tol, ...)` checks, leaf by leaf of two
pytrees, that every |a - ref| <= tol * scale(ref) (+ rtol * |ref| when rtol is given) with
`chex.assert_trees_all_close`, after checking that `a` is finite and the shapes agree. Inputs of any float
dtype are compared in float32.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def ref_scale(ref, floor=None) -> float:
    """max|ref| + 1e-6, or max(max|ref|, floor) when a floor is given."""
    ref = _f32(ref)
    peak = float(np.max(np.abs(ref))) if ref.size else 0.0
    return peak + 1e-6 if floor is None else max(peak, floor)


def rel_err(a, ref) -> float:
    """max|a - ref| / ref_scale(ref)."""
    a, ref = _f32(a), _f32(ref)
    return float(np.max(np.abs(a - ref)) / ref_scale(ref))


def assert_close(a, ref, tol, what="", *, floor=1.0, rtol=0.0):
    """Every leaf: |a - ref| <= tol * ref_scale(ref_leaf, floor) + rtol * |ref| (chex.assert_trees_all_close)."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lr, tr = jax.tree_util.tree_flatten_with_path(ref)
    assert ta == tr, f"{what}: tree structures differ\n{ta}\n{tr}"
    for (path, x), (_, y) in zip(la, lr):
        name = f"{what}{jax.tree_util.keystr(path)}"
        x, y = _f32(x), _f32(y)
        assert x.shape == y.shape, f"{name}: shape {x.shape} vs {y.shape}"
        assert np.all(np.isfinite(x)), f"{name}: non-finite values"
        scale = ref_scale(y, floor)
        try:
            chex.assert_trees_all_close(x, y, atol=tol * scale, rtol=rtol)
        except AssertionError as e:
            err = float(np.max(np.abs(x - y))) if x.size else 0.0
            raise AssertionError(f"{name}: max err {err:.3g} > {tol:g} x {scale:.3g}\n{e}") from None
