"""`nmoe bench` and `nmoe mutate` run the repository's bench/ and tests/: installed from a wheel, or without
the `test` extra, they stop at once with one line naming the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_ONLY = ("pytest", "_pytest", "ml_dtypes", "pytest_benchmark")
_BLOCK = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {TEST_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Block())
"""
COMMANDS = {"bench": ["bench", "--out", "r.json"],
            "mutate": ["mutate", "--device", "cpu", "--report", "r.json"]}


def _env(*path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COV_CORE_", "COVERAGE_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nmoe.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _one_line(proc: subprocess.CompletedProcess[str], command: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout[-2000:],
                                                      proc.stderr[-2000:])
    assert lines[0].startswith(f"nmoe {command}: ")
    return lines[0]


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packages a wheel installs (pyproject's packages.find), without bench/, tests/ or pyproject."""
    site = tmp_path_factory.mktemp("site-packages")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "corpus")
    for pkg in ("nmoe", "parity", "mutations"):
        shutil.copytree(ROOT / pkg, site / pkg, ignore=ignore)
    return site


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_installed_from_a_wheel_names_the_source_checkout(command: str, wheel_site: Path, tmp_path: Path
                                                          ) -> None:
    proc = _run(COMMANDS[command], tmp_path, _env(wheel_site))
    line = _one_line(proc, command)
    assert "source checkout" in line and "pip install -e '.[test]'" in line
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(("command", "missing"), [("bench", "pytest, pytest-benchmark"),
                                                  ("mutate", "pytest, ml_dtypes")])
def test_without_the_test_extra_names_it(command: str, missing: str, tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(_BLOCK)
    proc = _run(COMMANDS[command], tmp_path, _env(tmp_path, ROOT))
    line = _one_line(proc, command)
    assert f"needs {missing}" in line and "the `test` extra" in line
    assert not (tmp_path / "r.json").exists()
