"""Run pytest on one (possibly mutated) copy of the tree in a fresh process and read its verdict."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmoe.checkout import tree_pythonpath

TREE: tuple[str, ...] = ("nmoe", "parity", "mutations", "tests", "configs", "pyproject.toml", "conftest.py")
PYTEST_FLAGS: tuple[str, ...] = ("-x", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short")
OUTCOME_PLUGIN: tuple[str, ...] = ("-p", "mutations.outcome")
OUTCOME_ENV = "NMOE_MUTATE_OUTCOME"
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis", ".mypy_cache")

@dataclass
class PytestRun:
    """What one pytest process reported through `mutations.outcome`: exit code, per-outcome counts, failing
    node ids with messages and where they were raised, and its output (for humans only)."""

    returncode: int | None
    timed_out: bool
    seconds: float
    output: str
    counts: dict[str, int] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    assertions: int = 0
    details: list[str] = field(default_factory=list)
    collect_errors: int = 0

    @property
    def collection_error(self) -> bool:
        return self.collect_errors > 0

    @property
    def ran(self) -> int:
        return sum(self.counts.get(k, 0) for k in ("passed", "failed", "errors", "xfailed", "xpassed"))

    def tail(self, n: int = 3000) -> str:
        return self.output[-n:]


def read_outcome(path: Path) -> dict[str, Any]:
    """The plugin's JSON; empty when pytest never reached the end of its session (killed, or a conftest
    that does not import), which leaves the exit code to speak."""
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data


def copy_tree(root: Path, dest: Path) -> None:
    """Copy the parts of the repo the tests need; the copy shadows any installed nmoe."""
    for name in TREE:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=_IGNORE)
        elif src.is_file():
            shutil.copy2(src, dest / name)


def compile_error(path: Path) -> str | None:
    """Byte-compile message for a mutated file that no longer parses, else None (what py_compile checks)."""
    try:
        compile(path.read_text(encoding="utf-8"), str(path.name), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def child_env(copy: Path, device: str, threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = tree_pythonpath(copy, env.get("PYTHONPATH"))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["COLUMNS"] = "200"
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", str(threads))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_pytest(copy: Path, selection: Sequence[str], k: str | None, env: Mapping[str, str],
               timeout: float, flags: Sequence[str] = PYTEST_FLAGS) -> PytestRun:
    """One fresh interpreter per run (no CUDA context or imported module survives between mutants); the
    verdict comes from the outcome plugin, never from pytest's terminal text."""
    cmd = [sys.executable, "-m", "pytest", *flags, *OUTCOME_PLUGIN, *selection]
    if k is not None:
        cmd += ["-k", k]
    fd, name = tempfile.mkstemp(prefix="nmoe-outcome-", suffix=".json")
    os.close(fd)
    outcome_path = Path(name)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, cwd=copy, env={**env, OUTCOME_ENV: name}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        seconds = time.perf_counter() - t0
        outcome = read_outcome(outcome_path)
    finally:
        outcome_path.unlink(missing_ok=True)
    failures = outcome.get("failures", [])
    return PytestRun(None if timed_out else proc.returncode, timed_out, seconds, out or "",
                     counts=dict(outcome.get("counts", {})), failing=[f["nodeid"] for f in failures],
                     messages=[f["message"] for f in failures], assertions=int(outcome.get("assertions", 0)),
                     details=[f["where"] for f in failures if f["where"]],
                     collect_errors=int(outcome.get("collect_errors", 0)))


def in_copy(root: Path, edit: tuple[str, str] | None, fn_selection: Sequence[str], k: str | None,
            device: str, threads: int, timeout: float) -> tuple[PytestRun | None, str | None]:
    """Copy the tree, write `edit` = (relative file, new text), compile-check it, run pytest.

    Returns (run, compile_message); run is None when the mutated file does not compile.
    """
    with tempfile.TemporaryDirectory(prefix="nmoe-mutant-") as tmp:
        copy = Path(tmp)
        copy_tree(root, copy)
        if edit is not None:
            target = copy / edit[0]
            target.write_text(edit[1], encoding="utf-8")
            msg = compile_error(target)
            if msg is not None:
                return None, msg
        return run_pytest(copy, fn_selection, k, child_env(copy, device, threads), timeout), None


SANITY_ID = "sanity.forced_fail"

_SANITY_TAIL = '''

def _nmoe_mutate_sanity() -> None:
    """Forced-fail mutant: every function, method and static method defined in this module raises."""
    import functools
    import inspect

    def _wrap(fn):  # type: ignore[no-untyped-def]
        @functools.wraps(fn)
        def _raise(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("nmoe mutate sanity mutant: " + fn.__qualname__ + " forced to fail")
        return _raise

    g = globals()
    for name, obj in list(g.items()):
        if name == "_nmoe_mutate_sanity":
            continue
        if inspect.isfunction(obj) and obj.__module__ == __name__:
            g[name] = _wrap(obj)
        elif inspect.isclass(obj) and obj.__module__ == __name__:
            for attr, val in list(vars(obj).items()):
                if inspect.isfunction(val):
                    setattr(obj, attr, _wrap(val))
                elif isinstance(val, staticmethod):
                    setattr(obj, attr, staticmethod(_wrap(val.__func__)))


_nmoe_mutate_sanity()
'''


def sanity_source(source: str) -> str:
    """The built-in forced-fail mutant of a file: proves a mutated copy really reaches the tests."""
    return source.rstrip("\n") + "\n" + _SANITY_TAIL
