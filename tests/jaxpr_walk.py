"""Walk a jaxpr's equations recursively (tests that inspect what a traced function does)."""
import jax.extend.core as jex_core  # an explicit import: jax 0.11 no longer loads jax.extend with jax


def _sub_jaxprs(eqn):
    for val in eqn.params.values():
        for x in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(x, jex_core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jex_core.Jaxpr):
                yield x


def walk(jaxpr):
    """Every equation, recursively, except inside pallas_call kernels (their bodies index refs)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name != "pallas_call":
            for sub in _sub_jaxprs(eqn):
                yield from walk(sub)
