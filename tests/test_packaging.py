"""pyproject.toml declares what the code imports, and tool floors under which tests/check.sh passes."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from nmoe.checkout import PIP_NAMES

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Module -> the only files that may import it without a runtime dependency: prep imports datasets (--hf) and
# pyarrow (.parquet) lazily, naming the install when absent; the outcome plugin runs only inside the pytest
# children of `nmoe mutate`, which checks the `test` extra first.
OPTIONAL = {"datasets": {"nmoe/data/prep.py"}, "pyarrow": {"nmoe/data/prep.py"},
            "pytest": {"mutations/outcome.py"}}
# Modules whose distribution the installed metadata does not name uniquely.
DISTRIBUTION_OF = {"cutlass": "nvidia-cutlass-dsl", "cuda.bindings": "cuda-bindings"}


def _name(req: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]).lower()


def _third_party_imports() -> dict[str, set[str]]:
    """Imported module (top level, or `cuda.bindings`) -> files importing it, over the installed packages."""
    found: dict[str, set[str]] = {}
    for pkg in ("nmoe", "parity", "mutations"):
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in ("nmoe", "parity", "mutations"):
                        continue
                    key = "cuda.bindings" if name.startswith("cuda.bindings") else top
                    found.setdefault(key, set()).add(str(f.relative_to(ROOT)))
    return found


def test_every_imported_package_is_a_declared_dependency() -> None:
    declared = {_name(r) for r in PROJECT["dependencies"]}
    packages = md.packages_distributions()
    undeclared = []
    for module, files in sorted(_third_party_imports().items()):
        if files <= OPTIONAL.get(module, set()):
            continue
        dists = [DISTRIBUTION_OF[module]] if module in DISTRIBUTION_OF else packages.get(module, [])
        assert len(dists) == 1, f"{module}: distributions {dists}; add it to DISTRIBUTION_OF"
        if _name(dists[0]) not in declared:
            undeclared.append(f"{dists[0]} (imports {module}: {sorted(files)[:2]})")
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"


def test_cuda_bindings_range_admits_what_cutlass_dsl_pulls_in() -> None:
    spec = next(r for r in PROJECT["dependencies"] if _name(r) == "cuda-bindings")
    assert ">=12.8" in spec.replace(" ", "")
    installed = md.version("cuda-bindings")
    upper = re.search(r"<(\d+)", spec)
    assert upper is None or int(installed.split(".")[0]) < int(upper.group(1)), (spec, installed)


def test_commands_name_packages_of_the_test_extra() -> None:
    extra = {_name(r) for r in PROJECT["optional-dependencies"]["test"]}
    assert {_name(n) for n in PIP_NAMES.values()} <= extra


def _floor(tool: str) -> str:
    spec = next(r for r in PROJECT["optional-dependencies"]["dev"] if _name(r) == tool)
    m = re.search(r">=\s*([\w.]+)", spec)
    assert m, spec
    return m.group(1)


@pytest.mark.heavy
@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_check_passes_at_the_declared_tool_floor(tool: str, tmp_path: Path) -> None:
    """The lint and type steps of tests/check.sh at the oldest versions pyproject admits (needs the index)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"{tool}=={_floor(tool)}"], check=True)
    cmd = ([str(venv / "bin" / "ruff"), "check", "."] if tool == "ruff" else
           [str(venv / "bin" / "mypy"), "--strict", "--python-executable", sys.executable,
            "--cache-dir", str(tmp_path / "cache"), "nmoe"])
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
