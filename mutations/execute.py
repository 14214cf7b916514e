"""Run pytest on one (possibly mutated) copy of the tree in a fresh process and read its verdict."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TREE: tuple[str, ...] = ("nmoe", "parity", "mutations", "tests", "configs", "pyproject.toml", "conftest.py")
PYTEST_FLAGS: tuple[str, ...] = ("-x", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis", ".mypy_cache")

_OUTCOME = re.compile(r"^(FAILED|ERROR) (.+?)(?: - (.*))?$")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")
_TOTALS_LINE = re.compile(r"\bin \d+(?:\.\d+)?s\b")
_ASSERTION = re.compile(r"^E\s+(?:AssertionError\b|assert\b|Failed\b|Falsifying example)")
_SECTION = re.compile(r"^_{3,} .+ _{3,}$")
_FRAME = re.compile(r"^(\S+\.py:\d+): in \S+$")
_COLLECT_ERROR = re.compile(r"error(?:s)? during collection|ERROR collecting|ImportError while importing")


@dataclass
class PytestRun:
    """What one pytest process said: exit code, per-outcome counts, failing node ids, output."""

    returncode: int | None
    timed_out: bool
    seconds: float
    output: str
    counts: dict[str, int] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    assertions: int = 0
    details: list[str] = field(default_factory=list)

    @property
    def collection_error(self) -> bool:
        return bool(_COLLECT_ERROR.search(self.output))

    @property
    def ran(self) -> int:
        return sum(self.counts.get(k, 0) for k in ("passed", "failed", "errors", "xfailed", "xpassed"))

    def tail(self, n: int = 3000) -> str:
        return self.output[-n:]


def parse_pytest_output(out: str) -> tuple[dict[str, int], list[str], list[str], int]:
    """Counts from the totals line, failing node ids + messages from -rfE lines, assertion reports."""
    counts: dict[str, int] = {}
    failing: list[str] = []
    messages: list[str] = []
    for line in out.splitlines():
        m = _OUTCOME.match(line)
        if m:
            failing.append(m.group(2).strip())
            messages.append((m.group(3) or "").strip())
    for line in reversed(out.splitlines()):
        if _TOTALS_LINE.search(line) and _COUNT.search(line):
            for num, key in _COUNT.findall(line):
                counts["errors" if key.startswith("error") else key] = int(num)
            break
    assertions = sum(1 for line in out.splitlines() if _ASSERTION.match(line))
    return counts, failing, messages, assertions


def failure_details(out: str, max_e_lines: int = 3) -> list[str]:
    """Per failure of a --tb=short report: 'file:line: source -> E lines', at the deepest frame inside
    the tree (tests or project code) rather than inside a library such as torch's gradcheck."""
    details: list[str] = []
    frames: list[tuple[str, str]] = []
    e_lines: list[str] = []
    in_section = False
    lines = out.splitlines()

    def flush() -> None:
        if not e_lines:
            return
        ours = [f for f in frames if not f[0].startswith("/")]
        msg = " | ".join(e_lines[:max_e_lines])
        where, src = (ours or frames or [("", "")])[-1]
        details.append(f"{where}: {src} -> {msg}" if where else msg)

    for i, line in enumerate(lines):
        if _SECTION.match(line):
            if in_section:
                flush()
            frames, e_lines, in_section = [], [], True
        elif in_section and (m := _FRAME.match(line)):
            if not e_lines:
                frames.append((m.group(1), lines[i + 1].strip() if i + 1 < len(lines) else ""))
        elif in_section and line.startswith("E  "):
            e_lines.append(line[1:].strip()[:200])
        elif line.startswith("=") and "short test summary" in line:
            break
    if in_section:
        flush()
    return details


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
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(copy) + (os.pathsep + old if old else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["COLUMNS"] = "200"
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", str(threads))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_pytest(copy: Path, selection: Sequence[str], k: str | None, env: Mapping[str, str],
               timeout: float) -> PytestRun:
    """One fresh interpreter per run (no CUDA context or imported module survives between mutants)."""
    cmd = [sys.executable, "-m", "pytest", *PYTEST_FLAGS, *selection]
    if k is not None:
        cmd += ["-k", k]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=copy, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    counts, failing, messages, assertions = parse_pytest_output(out or "")
    return PytestRun(None if timed_out else proc.returncode, timed_out, seconds, out or "", counts,
                     failing, messages, assertions, failure_details(out or ""))


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
    """Forced-fail mutant: every function and method defined in this module raises AssertionError."""
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


_nmoe_mutate_sanity()
'''


def sanity_source(source: str) -> str:
    """The built-in forced-fail mutant of a file: proves a mutated copy really reaches the tests."""
    return source.rstrip("\n") + "\n" + _SANITY_TAIL
