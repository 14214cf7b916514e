"""The GEMM performance ablations stay applicable: each anchor matches exactly once in the current source."""

from __future__ import annotations

from pathlib import Path

from bench.ablate import ABLATIONS, GATHER_ABLATIONS
from mutations.model import apply, check_anchors

ROOT = Path(__file__).resolve().parents[1]


def test_ablation_anchors_match_once() -> None:
    assert ABLATIONS and GATHER_ABLATIONS and check_anchors(ROOT, ABLATIONS + GATHER_ABLATIONS) == []


def test_each_ablation_changes_its_file() -> None:
    for a in ABLATIONS + GATHER_ABLATIONS:
        source = (ROOT / a.file).read_text(encoding="utf-8")
        edited = apply(source, a)
        assert edited != source
        compile(edited, a.file, "exec")
