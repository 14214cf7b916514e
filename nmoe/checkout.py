"""Commands that run the repository's own bench/ and tests/ (`nmoe bench`, `nmoe mutate`): they need a source
checkout and the `test` extra, and stop at once, naming the fix, when either is missing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Final

from nmoe.provenance import REPO_ROOT

INSTALL: Final[str] = "pip install -e '.[test]'"
PIP_NAMES: Final[dict[str, str]] = {"pytest": "pytest", "pytest_benchmark": "pytest-benchmark",
                                    "ml_dtypes": "ml_dtypes"}


class CheckoutError(RuntimeError):
    """The command cannot run from this installation; the message is one line naming the fix."""


def source_dir(command: str, name: str) -> Path:
    """`name` (bench or tests) of the checkout this nmoe was imported from; a wheel install has none."""
    found = REPO_ROOT / name
    if (REPO_ROOT / "pyproject.toml").is_file() and found.is_dir():
        return found
    raise CheckoutError(f"{command} runs {name}/ of a source checkout, and this nmoe is installed without "
                        f"one ({REPO_ROOT / 'nmoe'}); clone the repository and run `{INSTALL}` there")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_test_extra(command: str, modules: tuple[str, ...]) -> None:
    """The packages of the `test` extra that `command` runs (its pytest children import them)."""
    missing = [PIP_NAMES[m] for m in modules if not _importable(m)]
    if missing:
        raise CheckoutError(f"{command} needs {', '.join(missing)} (the `test` extra); run `{INSTALL}` in "
                            "the source checkout")


def tree_pythonpath(tree: Path, inherited: str | None) -> str:
    """`tree` first, then the inherited entries (where installed packages such as CuTeDSL may live) except
    those that hold another checkout's `nmoe`, which would shadow the tree's own code."""
    keep = [e for e in (inherited or "").split(os.pathsep) if e and not (Path(e) / "nmoe").is_dir()]
    return os.pathsep.join([str(tree), *keep])
