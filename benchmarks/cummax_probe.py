"""lax.cummax against pallas_kernels._scan's two-level form on the GPU, by the device clock: the primitive alone at
several lengths, and the Hopper kernels' aligned pre-pass (every table of a documents mask's forward and backward)
built with each.

    PYTHONPATH=. python3 -m benchmarks.cummax_probe
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_time
from pallas_kernels import _scan


@contextlib.contextmanager
def two_level_cummax():
    """jax.lax.cummax / cummin on the last axis replaced by _scan's while tracing (the pre-pass modules call them
    through jax.lax)."""
    orig = jax.lax.cummax, jax.lax.cummin

    def patched(orig_fn, ours):
        def f(x, axis=0, reverse=False):
            return ours(x, reverse) if axis in (-1, x.ndim - 1) else orig_fn(x, axis=axis, reverse=reverse)
        return f

    jax.lax.cummax, jax.lax.cummin = patched(orig[0], _scan.cummax_last), patched(orig[1], _scan.cummin_last)
    try:
        yield
    finally:
        jax.lax.cummax, jax.lax.cummin = orig


def main():
    from benchmarks.hopper_mask_probe import D, _rebuilt, probe_masks
    from pallas_kernels.flash_attention_hopper.aligned_tiles import aligned_backward_tables, aligned_mask_tables
    from pallas_kernels.flash_attention_hopper.config import default_config
    from pallas_kernels.flash_attention_hopper.data_mask import mask_rule

    print(jax.devices()[0].device_kind, jax.__version__, "device clock, us per call (20 calls)", flush=True)
    rng = np.random.default_rng(0)
    for b, s in ((1, 4096), (4, 4096), (1, 16384), (1, 65536), (1, 262144)):
        new_run = rng.random((b, s)) < 1e-3
        x = jnp.asarray(np.where(new_run, np.arange(s), 0), jnp.int32)
        lax_f = jax.jit(lambda x: jax.lax.cummax(x, axis=1))
        ours = jax.jit(_scan.cummax_last)
        assert bool((lax_f(x) == ours(x)).all())
        t = {n: device_time.profiled(f, (x,), calls=20) for n, f in (("lax.cummax", lax_f), ("two-level", ours))}
        print(f"B{b} S{s:7d}: " + " | ".join(f"{n} {p['kernel_s'] * 1e6:7.2f} us in {p['kernels_per_call']:.0f} "
                                            f"kernels" for n, p in t.items()), flush=True)
    for name, m in probe_masks("thd", "documents").items():
        cfg = default_config(D, m.kv_len, False, m.q_len)

        def tables(m):
            return aligned_backward_tables(aligned_mask_tables(_rebuilt(m), cfg, backward=False),
                                           mask_rule(_rebuilt(m)), cfg)

        plain = jax.jit(tables)
        with two_level_cummax():
            ours = jax.jit(tables).lower(m).compile()
        same = all(bool((a == c).all()) for a, c in zip(jax.tree.leaves(plain(m)), jax.tree.leaves(ours(m))))
        t = {n: device_time.profiled(f, (m,), calls=20) for n, f in (("lax.cummax", plain), ("two-level", ours))}
        print(f"{name:10s} aligned fwd+bwd tables: " + " | ".join(
            f"{n} {p['kernel_s'] * 1e6:7.1f} us in {p['kernels_per_call']:.0f} kernels" for n, p in t.items())
            + f" | same tables {same}", flush=True)


if __name__ == "__main__":
    main()
