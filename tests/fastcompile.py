"""Compile rows of one fast module's KERNELS for every supported arch, through compilecheck's spawner, and
the CUDA binary tools the PTX and SASS checks use where some install has them."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nmoe.fast import compilecheck
from nmoe.fast.arch import SUPPORTED_ARCHS
from nmoe.fast.compilecheck import Selection


def compile_rows(module: str, names: Iterable[str] = ()) -> dict[str, list[dict[str, Any]]]:
    """compilecheck rows of `module`.KERNELS (or the named ones) per arch, compiled in parallel."""
    rows = compilecheck.compile_rows(SUPPORTED_ARCHS, Selection(modules=(module,), kernels=tuple(names)))
    return {arch: [r for r in rows if r["arch"] == arch] for arch in SUPPORTED_ARCHS}


def assert_rows_ok(rows: list[dict[str, Any]], arch: str, n: int) -> None:
    """n rows, each compiled for `arch` with every expected instruction and no forbidden one."""
    assert len(rows) == n, [(r["kernel"], r["error"]) for r in rows]
    for row in rows:
        assert row["status"] == "ok" and row["arch"] == arch and row["error"] is None, row
        assert row["instructions"] and all(row["instructions"].values()), row
        assert not any(row["forbidden"].values()), row


def tool(name: str) -> str | None:
    """A CUDA tool (ptxas, nvdisasm): on PATH, under CUDA_HOME or /usr/local/cuda, in an nvidia-* wheel, or
    the copy triton bundles; None where none is installed."""
    found = shutil.which(name)
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        p = Path(base) / "bin" / name
        if base and p.exists():
            return str(p)
    roots: list[Path] = []
    try:
        import nvidia

        roots += [p for root in nvidia.__path__ for p in sorted(Path(root).glob(f"*/bin/{name}"))]
    except ImportError:
        pass
    try:
        import triton

        roots.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    hits = [p for p in roots if p.exists()]
    return str(hits[0]) if hits else None


def assemble(ptx: dict[str, str], arch: str) -> dict[str, dict[str, Any]] | None:
    """ptxas -v on each named kernel's PTX: {name: {"rc", "log"}}, or None where no install has ptxas (the
    probes compile in a fresh process for their arch; only the assembly happens here)."""
    ptxas = tool("ptxas")
    if ptxas is None:
        return None
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as d:
        for name, text in ptx.items():
            src, cubin = Path(d) / f"{name}.ptx", Path(d) / f"{name}.cubin"
            src.write_text(text)
            p = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(cubin)],
                               capture_output=True, text=True, timeout=300)
            out[name] = {"rc": p.returncode, "log": p.stdout + p.stderr}
    return out
