"""Walk a jaxpr's equations recursively (tests that inspect what a traced function does)."""
import jax.extend.core as jex_core  # an explicit import: jax 0.11 no longer loads jax.extend with jax

#: Primitives whose sub-jaxprs are kernel bodies: Pallas calls, and Mosaic GPU kernels traced outside interpret
#: mode (plgpu.kernel: mpmd_map / core_map).
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map", "core_map")


def _sub_jaxprs(eqn):
    for val in eqn.params.values():
        for x in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(x, jex_core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jex_core.Jaxpr):
                yield x


def walk(jaxpr):
    """Every equation, recursively, except inside kernels (KERNEL_PRIMITIVES: their bodies index refs)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name not in KERNEL_PRIMITIVES:
            for sub in _sub_jaxprs(eqn):
                yield from walk(sub)


def walk_resolved(jaxpr, env=None):
    """(eqn, origin) for every equation, recursively as `walk`; origin(v) is the outermost variable that v
    stands for: a sub-jaxpr's inputs are its caller's operands at the same positions (a nested jit, a
    custom_vjp call), so one array passed three times to a jitted kernel is one origin."""
    env = env or {}

    def origin(v):
        return v if isinstance(v, jex_core.Literal) else env.get(v, v)

    for eqn in jaxpr.eqns:
        yield eqn, origin
        if eqn.primitive.name not in KERNEL_PRIMITIVES:
            for sub in _sub_jaxprs(eqn):
                aligned = len(sub.invars) == len(eqn.invars)
                sub_env = ({iv: origin(ov) for iv, ov in zip(sub.invars, eqn.invars)
                            if not isinstance(iv, jex_core.Literal)} if aligned else {})
                yield from walk_resolved(sub, sub_env)


def warp_map_primitives(jaxpr, in_warp: bool = False):
    """Names of the primitives traced inside plgpu.warp_map (a core_map over a WarpMesh: a single warp's code),
    recursively through every sub-jaxpr, kernel bodies included."""
    for eqn in jaxpr.eqns:
        warp_mesh = eqn.primitive.name == "core_map" and type(eqn.params.get("mesh")).__name__ == "WarpMesh"
        if in_warp and eqn.primitive.name != "core_map":
            yield eqn.primitive.name
        for sub in _sub_jaxprs(eqn):
            yield from warp_map_primitives(sub, in_warp or warp_mesh)
