"""Test configuration: 8 fake CPU devices for multi-device tests (set before JAX is imported)."""
import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Property-based tests: a small fixed-seed profile for CI, a long one on demand
# (`pytest --hypothesis-profile=long` or TE_JAX_HYPOTHESIS_PROFILE=long).
try:
    from hypothesis import HealthCheck, settings

    _common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                   print_blob=True)
    settings.register_profile("ci", max_examples=4, derandomize=True, **_common)
    settings.register_profile("long", max_examples=300, derandomize=False, **_common)
    if os.environ.get("TE_JAX_HYPOTHESIS_EXAMPLES"):  # e.g. a time-boxed GPU run
        settings.register_profile("custom", max_examples=int(os.environ["TE_JAX_HYPOTHESIS_EXAMPLES"]),
                                  derandomize=False, **_common)
        settings.load_profile("custom")
    else:
        settings.load_profile(os.environ.get("TE_JAX_HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is in the test extra
    pass
