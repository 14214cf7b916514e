"""Catalog entry and per-mutant result types, plus the exact-anchor edit every mutant is."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Device = Literal["cpu", "gpu"]
Status = Literal["Killed", "Survived", "Timeout", "CompileError", "NoCoverage", "RuntimeError", "Ignored"]

_ID = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")


@dataclass(frozen=True)
class Mutation:
    """One named semantic defect: replace `anchor` (which must occur exactly once) in `file`."""

    id: str
    file: str
    anchor: str
    replacement: str
    description: str
    tests: tuple[str, ...] = ()
    k: str | None = None
    device: Device = "cpu"
    contracts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _ID.match(self.id):
            raise ValueError(f"mutation id {self.id!r} must look like 'family.defect' (lowercase, dots)")
        if self.anchor == self.replacement:
            raise ValueError(f"mutation {self.id}: replacement equals the anchor (a no-op mutant)")
        if not self.anchor:
            raise ValueError(f"mutation {self.id}: empty anchor; give the exact source text to replace")
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"mutation {self.id}: device must be 'cpu' or 'gpu', got {self.device!r}")

    @property
    def family(self) -> str:
        return self.id.split(".", 1)[0]

    def sep_test_name(self) -> str:
        """Name of the separating test docs/design.md asks for: test_sep_<id with dots -> underscores>."""
        return "test_sep_" + self.id.replace(".", "_")


@dataclass(frozen=True)
class Span:
    """1-based start (inclusive) and end (exclusive) positions, as in the Stryker schema."""

    start_line: int
    start_column: int
    end_line: int
    end_column: int


class AnchorError(ValueError):
    """An anchor that does not match exactly once: the catalog entry no longer fits the source."""


def _position(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return line, column


def anchor_span(source: str, m: Mutation) -> Span:
    """Where the anchor sits; raises unless it occurs exactly once (the catalog's precondition)."""
    n = source.count(m.anchor)
    if n != 1:
        raise AnchorError(
            f"mutation {m.id}: anchor occurs {n} times in {m.file} (must be exactly once); "
            f"re-anchor it on the current source: {m.anchor!r}"
        )
    start = source.index(m.anchor)
    sl, sc = _position(source, start)
    el, ec = _position(source, start + len(m.anchor))
    return Span(sl, sc, el, ec)


def apply(source: str, m: Mutation) -> str:
    anchor_span(source, m)
    return source.replace(m.anchor, m.replacement, 1)


def check_anchors(root: Path, mutations: tuple[Mutation, ...]) -> list[str]:
    """Problems (missing files, anchors not matching exactly once, duplicate ids); empty when sound."""
    problems: list[str] = []
    seen: set[str] = set()
    for m in mutations:
        if m.id in seen:
            problems.append(f"duplicate mutation id {m.id}; ids must be unique")
        seen.add(m.id)
        path = root / m.file
        if not path.is_file():
            problems.append(f"mutation {m.id}: file {m.file} does not exist under {root}")
            continue
        try:
            anchor_span(path.read_text(encoding="utf-8"), m)
        except AnchorError as e:
            problems.append(str(e))
    return problems


@dataclass
class MutantResult:
    """Outcome of running one mutant's tests on its mutated copy."""

    mutation: Mutation
    status: Status
    reason: str
    killed_by: list[str] = field(default_factory=list)
    failed: int = 0
    ran: int = 0
    assertions: int = 0
    seconds: float = 0.0
    output_tail: str = ""

    @property
    def detected(self) -> bool:
        return self.status == "Killed"


def sep_mutation(id: str, file: str, anchor: str, replacement: str, description: str, test_file: str,
                 contracts: tuple[str, ...] = (), device: Device = "cpu") -> Mutation:
    """A catalog entry killed by its separating test `test_file::test_sep_<id with dots -> underscores>`."""
    node = f"{test_file}::test_sep_{id.replace('.', '_')}"
    return Mutation(id, file, anchor, replacement, description, tests=(node,), device=device,
                    contracts=contracts)
