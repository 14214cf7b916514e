"""Stryker mutation-testing-report-schema JSON (plus provenance and summary) and its markdown twin."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mutations.model import MutantResult, anchor_span

SCHEMA_VERSION = "1"
THRESHOLDS = {"high": 100, "low": 100}
COLUMNS = ("id", "description", "status", "killed by", "cases / assertions red")


def summary(results: Sequence[MutantResult]) -> dict[str, Any]:
    """Counts per status; score = killed / executed mutants in percent (not-run GPU mutants excluded)."""
    def n(status: str) -> int:
        return sum(1 for r in results if r.status == status)

    not_run = n("Ignored")
    executed = len(results) - not_run
    killed = n("Killed")
    return {
        "total": len(results),
        "killed": killed,
        "survived": n("Survived"),
        "timeout": n("Timeout"),
        "compile_error": n("CompileError"),
        "no_coverage": n("NoCoverage"),
        "runtime_error": n("RuntimeError"),
        "not_run": not_run,
        "score": round(100.0 * killed / executed, 2) if executed else None,
    }


def _mutant_json(r: MutantResult, source: str) -> dict[str, Any]:
    m = r.mutation
    span = anchor_span(source, m)
    out: dict[str, Any] = {
        "id": m.id,
        "mutatorName": m.id,
        "replacement": m.replacement,
        "location": {
            "start": {"line": span.start_line, "column": span.start_column},
            "end": {"line": span.end_line, "column": span.end_column},
        },
        "status": r.status,
        "killedBy": list(r.killed_by),
        "description": m.description,
        "statusReason": r.reason,
        "coveredBy": list(m.tests),
        "testsCompleted": r.ran,
        "duration": round(r.seconds * 1000.0, 1),
        "static": False,
        "device": m.device,
        "contracts": list(m.contracts),
        "casesRed": r.failed,
        "assertionsRed": r.assertions,
    }
    if m.k is not None:
        out["k"] = m.k
    return out


def build(results: Sequence[MutantResult], sources: Mapping[str, str], provenance: Mapping[str, Any],
          config: Mapping[str, Any], baseline: Mapping[str, Any], sanity: Mapping[str, Any] | None,
          performance: Mapping[str, float]) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for r in results:
        path = r.mutation.file
        entry = files.setdefault(path, {"language": "python", "source": sources[path], "mutants": []})
        entry["mutants"].append(_mutant_json(r, sources[path]))
    return {
        "schemaVersion": SCHEMA_VERSION,
        "thresholds": dict(THRESHOLDS),
        "files": files,
        "framework": {"name": "nmoe mutate", "version": "1"},
        "config": dict(config),
        "performance": {k: round(v, 1) for k, v in performance.items()},
        "provenance": dict(provenance),
        "summary": summary(results),
        "baseline": dict(baseline),
        "sanity": None if sanity is None else dict(sanity),
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def markdown(report: Mapping[str, Any]) -> str:
    """The reviewer's table: one row per mutant, in catalog order."""
    s = report["summary"]
    prov = report.get("provenance", {})
    lines = [
        "# Mutation report",
        "",
        f"- git: `{prov.get('git_sha')}` (dirty: {prov.get('git_dirty')}), "
        f"created {prov.get('created_utc')}, host {prov.get('host')}, gpu {prov.get('gpu')}, "
        f"torch {prov.get('torch')}",
        f"- command: `{prov.get('command')}`",
        f"- summary: {s['total']} mutants, {s['killed']} killed, {s['survived']} survived, "
        f"{s['timeout']} timeout, {s['compile_error']} compile error, {s['no_coverage']} no coverage, "
        f"{s['runtime_error']} runtime error, {s['not_run']} not run; score {s['score']}",
    ]
    base = report.get("baseline", {})
    lines.append(f"- baseline (unmutated): {base.get('status')} — {base.get('reason', '')}")
    san = report.get("sanity")
    if san is not None:
        lines.append(f"- sanity mutant `{san.get('id')}` on `{san.get('file')}`: {san.get('status')}")
    lines += ["", f"| {' | '.join(COLUMNS)} |", "|---" * len(COLUMNS) + "|"]
    for path, entry in report["files"].items():
        for mu in entry["mutants"]:
            status = mu["status"] if mu["status"] != "Ignored" else "not run"
            if mu["status"] not in ("Killed", "Ignored"):
                status = f"**{status}**"
            reason = "" if mu["status"] == "Killed" else f" ({_cell(mu['statusReason'])})"
            killed_by = ", ".join(f"`{t}`" for t in mu["killedBy"]) or "—"
            red = f"{mu['casesRed']} of {mu['testsCompleted']} / {mu['assertionsRed']}"
            desc = f"{_cell(mu['description'])} (`{path}`)"
            cells = (f"`{mu['id']}`", desc, status + reason, killed_by, red)
            lines.append(f"| {' | '.join(cells)} |")
    evidence = [f"- `{mu['id']}`: {_cell(mu['statusReason'])}" for entry in report["files"].values()
                for mu in entry["mutants"] if mu["status"] == "Killed"]
    if evidence:
        lines += ["", "## Where each killed mutant failed", "", *evidence]
    return "\n".join(lines) + "\n"


def write(report: Mapping[str, Any], path: Path) -> Path:
    """Write FILE.json and its markdown twin FILE.md; returns the markdown path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    md = path.with_suffix(".md")
    md.write_text(markdown(report), encoding="utf-8")
    return md
