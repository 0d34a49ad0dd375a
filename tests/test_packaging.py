"""Packaging metadata that CI checks: the installed jax lies inside pyproject.toml's bounds, the extras and
the version agree, and `.ci/run` runs the README's test command."""
import importlib.metadata
import os
import re
import tomllib

import jax
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import te_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirement(name, reqs):
    found = [r for r in map(Requirement, reqs) if r.name == name]
    assert len(found) == 1, f"expected one requirement on {name} in {reqs}"
    return found[0]


def _installed(name):
    if name == "jax":
        return jax.__version__
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        import jaxlib  # noqa: F401  (jaxlib without distribution metadata: read its module)
        return jaxlib.__version__


@pytest.mark.parametrize("name", ["jax", "jaxlib"])
def test_installed_jax_is_inside_the_pyproject_bounds(name):
    """te_jax is tested on the jax versions pyproject.toml allows; a jax outside them fails CI here
    (raise the upper bound only after running the suite on the new jax)."""
    req = _requirement(name, _pyproject()["project"]["dependencies"])
    uppers = [s for s in req.specifier if s.operator in ("<", "<=")]
    assert uppers, f"{req} has no upper bound"
    installed = _installed(name)
    assert req.specifier.contains(Version(installed), prereleases=True), (
        f"installed {name} {installed} is outside pyproject.toml's bounds {req.specifier}: te_jax is not tested "
        f"there. Install a jax inside the bounds, or test the new version and move the bounds.")


def test_cuda_extras_use_the_core_jax_bounds():
    project = _pyproject()["project"]
    core = _requirement("jax", project["dependencies"]).specifier
    for extra in ("cuda12", "cuda13"):
        req = _requirement("jax", project["optional-dependencies"][extra])
        assert req.extras == {extra} and req.specifier == core, (extra, str(req), str(core))


def test_test_and_example_only_packages_are_not_core_dependencies():
    project = _pyproject()["project"]
    core = {Requirement(r).name for r in project["dependencies"]}
    assert not core & {"chex", "optax", "pytest", "orbax-checkpoint"}, core
    extras = project["optional-dependencies"]
    assert "chex" in {Requirement(r).name for r in extras["test"]}
    assert "optax" in {Requirement(r).name for r in extras["examples"]}


def test_version_license_and_typed_markers():
    project = _pyproject()
    assert te_jax.__version__ == project["project"]["version"]
    assert project["project"]["license"] == {"text": "Apache-2.0"}
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read(2000)
    for pkg in ("te_jax", "pallas_kernels"):
        assert os.path.isfile(os.path.join(ROOT, pkg, "py.typed"))
        assert project["tool"]["setuptools"]["package-data"][pkg] == ["py.typed"]


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    m = re.search(r'pip install -e "\.\[test\]" && (python -m pytest [^\n`]*)', readme)
    assert m, "README lost its test command"
    assert m.group(1).replace("python ", "python3 ", 1) in ci, (m.group(1), ci)
    min_python = _pyproject()["project"]["requires-python"]
    assert min_python == ">=3.11" and f"`requires-python = \"{min_python}\"`" in readme
