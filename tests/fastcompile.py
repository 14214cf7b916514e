"""Compile rows of one fast module's KERNELS for every supported arch, through compilecheck's spawner."""

from __future__ import annotations

from collections.abc import Iterable
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
