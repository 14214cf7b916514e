"""The contract registry: every op family's entries (parity/ops/<family>.py, named as nmoe/reference/),
collected in one ordered map. Reference and fast functions resolve lazily by name
(nmoe.reference|fast.<module>.<fn>), so a missing fast op makes its cases "not run", never an import error."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fnmatch
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from parity.entry import ARCHS, CPU, OpEntry
from parity.ops import (
    activation,
    attention,
    combine,
    dispatch,
    formats,
    gemm,
    loss,
    moe,
    norm,
    optim,
    rdep,
    rope,
    router,
)
from parity.ops.gemm import FP8_SM90, FP8_SM100

__all__ = [
    "ARCHS",
    "CPU",
    "FP8_SM90",
    "FP8_SM100",
    "REGISTRY",
    "OpEntry",
    "fast_declared",
    "override",
    "resolve_fast",
    "resolve_reference",
    "select",
]

FAMILIES = (
    formats,
    activation,
    combine,
    router,
    dispatch,
    rdep,
    gemm,
    norm,
    rope,
    attention,
    loss,
    optim,
    moe,
)
ENTRIES: list[OpEntry] = [e for family in FAMILIES for e in family.ENTRIES]

# ----------------------------------------------------------------------------------------------------------
# Resolution


def _lookup(package: str, module: str, fn: str) -> tuple[Callable[..., Any] | None, str]:
    name = f"{package}.{module}"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name):
            return None, f"{name} does not exist"
        raise
    f = getattr(mod, fn, None)
    return (f, "") if callable(f) else (None, f"{name} has no {fn}")


def resolve_reference(entry: OpEntry) -> tuple[Callable[..., Any] | None, str]:
    """(fn, "") or (None, reason); import errors other than the module being absent propagate."""
    if entry.reference is not None:
        return entry.reference, ""
    fn, why = _lookup("nmoe.reference", entry.module, entry.fn)
    return fn, why and f"reference missing: {why}"


def resolve_fast(entry: OpEntry) -> tuple[Callable[..., Any] | None, str]:
    if entry.fast is not None:
        return entry.fast, ""
    fn, why = _lookup("nmoe.fast", entry.module, entry.fn)
    return fn, why and f"no fast implementation ({why})"


def fast_declared(entry: OpEntry) -> bool:
    """Whether nmoe/fast/<module>.py defines <fn>, read from source (no import: cutlass stays unloaded)."""
    if entry.fast is not None:
        return True
    spec = importlib.util.find_spec("nmoe.fast")
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        package = f"{root}/{entry.module}/__init__.py"
        path = package if os.path.exists(package) else f"{root}/{entry.module}.py"
        try:
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except OSError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == entry.fn:
                return True
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == entry.fn for t in targets):
                    return True
    return False


REGISTRY: dict[str, OpEntry] = {e.name: e for e in ENTRIES}


def select(patterns: Sequence[str] | None, registry: Mapping[str, OpEntry] | None = None) -> list[OpEntry]:
    """Entries whose names match any pattern (fnmatch, e.g. "grouped_gemm*"); None/empty selects all."""
    reg = REGISTRY if registry is None else registry
    if not patterns:
        return list(reg.values())
    chosen: list[OpEntry] = []
    for pat in patterns:
        hits = [e for name, e in reg.items() if fnmatch.fnmatchcase(name, pat)]
        if not hits:
            raise ValueError(f"no parity op matches {pat!r}; known ops: {', '.join(reg)}")
        chosen += [h for h in hits if h not in chosen]
    return chosen


@contextlib.contextmanager
def override(
    name: str,
    *,
    reference: Callable[..., Any] | None = None,
    fast: Callable[..., Any] | None = None,
    registry: dict[str, OpEntry] | None = None,
    **fields: Any,
) -> Iterator[OpEntry]:
    """Temporarily swap an entry's reference/fast function (or other fields), e.g. to inject a wrong op."""
    reg = REGISTRY if registry is None else registry
    if name not in reg:
        raise KeyError(f"no parity op {name!r}; known ops: {', '.join(reg)}")
    old = reg[name]
    changes: dict[str, Any] = dict(fields)
    if reference is not None:
        changes["reference"] = reference
    if fast is not None:
        changes["fast"] = fast
    reg[name] = dataclasses.replace(old, **changes)
    try:
        yield reg[name]
    finally:
        reg[name] = old
