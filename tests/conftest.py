"""Test configuration: 8 fake CPU devices for multi-device tests (set before JAX is imported), and one persistent
compilation cache per test run, shared by the xdist workers."""
import atexit
import os
import shutil
import tempfile

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache per run (a fresh temporary directory, made by the first process that loads this
# file and inherited by the xdist workers through the environment; removed when that process exits): a program
# that two tests compile alike (the example's three runs, references shared by tests) compiles once. About 5% of
# the suite's time on the 2-core machine. TE_JAX_TEST_COMPILE_CACHE=0 turns it off.
_CACHE_ENV = "TE_JAX_TEST_COMPILE_CACHE"
if os.environ.get(_CACHE_ENV) != "0":
    if not os.environ.get(_CACHE_ENV):
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="te_jax_test_compile_cache_")
        atexit.register(shutil.rmtree, os.environ[_CACHE_ENV], ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)

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
