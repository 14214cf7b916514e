"""Compile a fast module's KERNELS without a GPU, one fresh process per arch (the DSL fixes its arch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nmoe.fast.arch import SUPPORTED_ARCHS

ROOT = Path(__file__).resolve().parents[1]
_CODE = (
    "import importlib, json, sys\n"
    "from nmoe.fast import compilecheck, runtime\n"
    "runtime.import_cutlass(sys.argv[1])\n"
    "names = set(filter(None, sys.argv[3].split(',')))\n"
    "specs = importlib.import_module(sys.argv[2]).KERNELS\n"
    "print(json.dumps([compilecheck.check(s, sys.argv[1]) for s in specs if not names or s.name in names]))\n"
)


def compile_rows(module: str, names: Iterable[str] = ()) -> dict[str, list[dict[str, Any]]]:
    """compilecheck rows of `module`.KERNELS (or the named ones) for every supported arch, in parallel."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("CUTE_DSL_ARCH", None)
    procs = {arch: subprocess.Popen([sys.executable, "-c", _CODE, arch, module, ",".join(names)], cwd=ROOT,
                                    env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for arch in SUPPORTED_ARCHS}
    rows: dict[str, list[dict[str, Any]]] = {}
    for arch, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        rows[arch] = json.loads(out.strip().splitlines()[-1])
    return rows


def assert_rows_ok(rows: list[dict[str, Any]], arch: str, n: int) -> None:
    """n rows, each compiled for `arch` with every expected instruction and no forbidden one."""
    assert len(rows) == n, [r["kernel"] for r in rows]
    for row in rows:
        assert row["status"] == "ok" and row["arch"] == arch and row["error"] is None, row
        assert row["instructions"] and all(row["instructions"].values()), row
        assert not any(row["forbidden"].values()), row
