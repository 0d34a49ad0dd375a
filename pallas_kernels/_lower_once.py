"""Trace and lower each kernel once per process for every (shapes, dtypes, static configuration).

A Pallas kernel called from N identical layers is, by default, traced and lowered N times: each call
site binds its own `pallas_call`, and lowering one (Mosaic GPU or Triton IR built in Python) takes
seconds. Wrapping a kernel's entry point in `jax.jit` makes every call site with the same argument
shapes, dtypes and static arguments reuse one traced jaxpr (jax's tracing cache) and one lowered
private function of the module (jax's lowering cache), so compile time no longer grows with the
number of identical layers. Different shapes, dtypes or static arguments are different cache keys:
they never share a kernel. XLA inlines the call, so the compiled program is the same as without it.
"""
from __future__ import annotations

import contextlib
import functools

import jax

_enabled = True


@contextlib.contextmanager
def disabled():
    """Within this context, calls lower the kernel at every call site (the old behaviour; for A/B timing)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def lower_once(*, static_argnames: tuple[str, ...]):
    """Decorator: calls go through `jax.jit(fn, static_argnames=...)`; static arguments must be hashable."""

    def wrap(fn):
        shared = jax.jit(fn, static_argnames=static_argnames)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return (shared if _enabled else fn)(*args, **kwargs)

        call.shared = shared
        return call

    return wrap
