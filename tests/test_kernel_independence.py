"""Kernels stand alone: pallas_kernels imports jax and pallas_kernels._compat, never te_jax."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHECK = (
    "import sys, pallas_kernels.flash_attention, pallas_kernels.norms, pallas_kernels.ln_mlp, pallas_kernels.fp8_cast, "
    "pallas_kernels.flash_attention_hopper, pallas_kernels.fp8_gemm; "
    "bad = sorted(m for m in sys.modules if m == 'te_jax' or m.startswith('te_jax.')); "
    "assert not bad, bad"
)


def test_importing_the_kernels_imports_no_te_jax():
    # A fresh interpreter: this test process has te_jax imported already.
    r = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


_TE_JAX_IMPORT = re.compile(r"^\s*(from\s+te_jax[\s.]|import\s+te_jax\b)", re.MULTILINE)


def test_no_kernel_source_imports_te_jax():
    files = sorted((ROOT / "pallas_kernels").rglob("*.py"))
    assert files
    offenders = [f"{p.relative_to(ROOT)}:{s[:m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
                 for p in files for s in [p.read_text()] for m in _TE_JAX_IMPORT.finditer(s)]
    assert not offenders, "pallas_kernels must not import te_jax:\n" + "\n".join(offenders)
