"""Two of the project's written rules that a linter does not check: docstrings under nmoe/ say why in at
most three lines (detail goes to a comment beside the code), and source files stay at most 800 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_DOC_LINES = 3
MAX_FILE_LINES = 800
SOURCE_DIRS = ("nmoe", "tests", "bench", "parity", "mutations")


def long_docstrings(source: str) -> list[tuple[str, int]]:
    """(name, lines) of each function or class docstring in `source` longer than MAX_DOC_LINES."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and len(doc.strip().splitlines()) > MAX_DOC_LINES:
                out.append((node.name, len(doc.strip().splitlines())))
    return out


def test_the_scan_finds_a_long_docstring() -> None:
    four = 'def f():\n    """one\n    two\n    three\n    four"""\n'
    three = 'def f():\n    """one\n    two\n    three"""\n'
    assert long_docstrings(four) == [("f", 4)] and long_docstrings(three) == []


def test_docstrings_under_nmoe_are_at_most_three_lines() -> None:
    bad = {f"{p.relative_to(ROOT)}:{name}": n for p in sorted((ROOT / "nmoe").rglob("*.py"))
           for name, n in long_docstrings(p.read_text())}
    assert not bad, f"docstrings over {MAX_DOC_LINES} lines (move the detail into a comment): {bad}"


def test_source_files_stay_under_the_size_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))}
    assert len(sizes) > 100, "the scan must see the tree"
    big = {p: n for p, n in sizes.items() if n > MAX_FILE_LINES}
    assert not big, f"files over {MAX_FILE_LINES} lines (split them by job): {big}"
