"""Count the GEMMs of a compiled (optimized) HLO module that run on FP8 operands.

An FP8 GEMM reaches the GPU either as a cuBLASLt custom call (`__cublas$lt$matmul$f8`) or, for shapes where XLA's
autotuner prefers it, as a Triton GEMM fusion whose `dot` reads float8 operands. Both count. Used by the GPU
tests and the FP8 benchmarks to check that every projection runs in FP8 (`gemm_kinds(text)`).
"""
from __future__ import annotations

import collections
import re

F8_CUBLAS = "__cublas$lt$matmul$f8"
_F8 = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(?[\w\[\],{}: ]*?\)?)\s+([a-z][\w\-]*)\((.*)$")


def _types(text):
    """{instruction name: its element type} over every computation (names are unique in a module)."""
    out = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            t = re.match(r"\(?([a-z]+\d*[a-z0-9]*)\[", m.group(2))
            out[m.group(1)] = t.group(1) if t else ""
    return out


def gemm_kinds(text: str) -> collections.Counter:
    """Counter of GEMMs by kind: 'fp8 cublaslt', 'fp8 fusion' (a dot on FP8 operands inside a fusion), 'other'."""
    types = _types(text)
    kinds = collections.Counter()
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        opcode, rest = m.group(3), m.group(4)
        if opcode == "custom-call":
            tgt = re.search(r'custom_call_target="([^"]*)"', line)
            tgt = tgt.group(1) if tgt else ""
            if tgt == F8_CUBLAS:
                kinds["fp8 cublaslt"] += 1
            elif re.search(r"gemm|matmul", tgt, re.I):
                kinds["other"] += 1
        elif opcode in ("dot", "scaled-dot"):
            operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            if operands and all(types.get(o, "") in _F8 for o in operands[:2]):
                kinds["fp8 fusion"] += 1
            else:
                kinds["other"] += 1
    return kinds


def fp8_gemm_count(text: str) -> int:
    """Number of FP8 GEMMs (cuBLASLt FP8 calls plus FP8 dots left in fusions) in an optimized HLO module."""
    k = gemm_kinds(text)
    return k["fp8 cublaslt"] + k["fp8 fusion"]
