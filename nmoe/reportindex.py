"""`nmoe report`: one index page over the committed parity, mutation and bench reports, per registry op:
the newest result of each kind, its commit, whether its tree was dirty, and whether the op's sources changed
in git since that commit. An HTML page and its JSON twin."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from nmoe.index import Entry, Section, write_index
from nmoe.opsources import SourceGraphError, op_sources

KINDS: Final = ("parity", "mutation", "bench")
REPORT_DIRS: Final = {"parity": "parity/reports", "mutation": "mutations/reports", "bench": "bench/results"}
BENCH_TOKENS: Final = {"b32": "32", "b128": "128", "weight": "w128"}
MAPPING: Final = {
    "parity": "cases[].op",
    "mutation": "each op in the mutant's `contracts` (the contracts expected to kill it); mutant ids are "
                "<family>.<defect>, so the id names the op only where its prefix is one",
    "bench": "row name without `_eager_call` and the `fwd` token, with b32/b128/weight read as 32/128/w128: "
             "the longest op name it equals or starts with (then `_`)",
}


class ReportIndexError(Exception):
    """A report or the checkout cannot be read; the message names the fix."""


@dataclass(frozen=True)
class Result:
    """One op's result in one report: a one-line summary, and whether anything of the op ran there."""

    summary: str
    ran: bool


@dataclass(frozen=True)
class Report:
    kind: str
    path: Path
    sha: str | None
    dirty: bool | None
    created: str
    gpu: str | None
    ops: Mapping[str, Result]
    unmapped: tuple[str, ...] = ()


@dataclass(frozen=True)
class Freshness:
    """`fresh`, `stale` (an op source changed after the report's commit) or `unknown` (commit not in git)."""

    state: str
    changed: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpView:
    op: str
    sources: tuple[str, ...]
    newest: Mapping[str, Report] = field(default_factory=dict)
    fresh: Mapping[str, Freshness] = field(default_factory=dict)


def _counts(c: Counter[str]) -> str:
    return ", ".join(f"{n} {s}" for s, n in sorted(c.items()))


def bench_op(name: str, ops: Iterable[str]) -> str | None:
    """The registry op a bench row measures (MAPPING["bench"]), or None."""
    tokens = [BENCH_TOKENS.get(t, t) for t in name.removesuffix("_eager_call").split("_") if t != "fwd"]
    joined = "_".join(tokens)
    hits = [o for o in ops if joined == o or joined.startswith(o + "_")]
    return max(hits, key=len) if hits else None


def _parity(doc: Mapping[str, Any], ops: Sequence[str]) -> tuple[dict[str, Result], list[str]]:
    status: dict[str, Counter[str]] = {}
    where: dict[str, set[str]] = {}
    unmapped: list[str] = []
    for case in doc.get("cases") or []:
        op = str(case.get("op"))
        if op not in ops:
            unmapped.append(op)
            continue
        status.setdefault(op, Counter())[str(case.get("status"))] += 1
        where.setdefault(op, set()).add(f"{case.get('mode')} {case.get('arch')}")
    out = {op: Result(f"{'/'.join(sorted(where[op]))}: {_counts(c)}", c["pass"] + c["fail"] > 0)
           for op, c in status.items()}
    return out, sorted(set(unmapped))


def _mutation(doc: Mapping[str, Any], ops: Sequence[str]) -> tuple[dict[str, Result], list[str]]:
    status: dict[str, Counter[str]] = {}
    unmapped: list[str] = []
    for f in (doc.get("files") or {}).values():
        for m in f.get("mutants") or []:
            mid = str(m.get("id"))
            named = [c for c in m.get("contracts") or [mid.partition(".")[0]] if c in ops]
            if not named:
                unmapped.append(mid)
            for op in named:
                status.setdefault(op, Counter())[str(m.get("status"))] += 1
    out = {op: Result(_counts(c), sum(c.values()) > c["Ignored"]) for op, c in status.items()}
    return out, sorted(set(unmapped))


def _bench(doc: Mapping[str, Any], ops: Sequence[str]) -> tuple[dict[str, Result], list[str]]:
    rows: dict[str, list[Mapping[str, Any]]] = {}
    unmapped: list[str] = []
    results = doc.get("results")
    for r in results if isinstance(results, list) else []:
        op = bench_op(str(r.get("name")), ops)
        if op is None:
            unmapped.append(str(r.get("name")))
        else:
            rows.setdefault(op, []).append(r)
    out = {}
    for op, rs in rows.items():
        timed = [r for r in rs if isinstance(r.get("ms"), int | float) and r.get("status") not in
                 ("not run", "error", "summary")]
        speed = [float(r["speedup"]) for r in timed if isinstance(r.get("speedup"), int | float)
                 and math.isfinite(r["speedup"])]
        text = f"{len(timed)} timings"
        if speed:
            text += f", {min(speed):.2f}-{max(speed):.2f}x vs baseline"
        out[op] = Result(text, bool(timed))
    return out, sorted(set(unmapped))


TREE: Final = {True: "dirty", False: "clean", None: "unknown"}
READERS: Final = {"parity": _parity, "mutation": _mutation, "bench": _bench}


def load_report(kind: str, path: Path, ops: Sequence[str]) -> Report:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportIndexError(f"cannot read {path} ({e}); fix or remove the file") from e
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    if not isinstance(prov, dict):
        raise ReportIndexError(f"{path} has no `provenance` block (docs/reports.md); regenerate it")
    results, unmapped = READERS[kind](doc, ops)
    sha = prov.get("git_sha")
    return Report(kind, path, sha if isinstance(sha, str) and sha else None, prov.get("git_dirty"),
                  str(prov.get("created_utc") or ""), prov.get("gpu"), results, tuple(unmapped))


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60, check=False)


def changed_since(repo: Path, sha: str | None) -> frozenset[str] | None:
    """Repo-relative files that differ between `sha` and HEAD, or None when git does not know `sha`."""
    if sha is None or _git(repo, "cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        return None
    done = _git(repo, "diff", "--name-only", "--no-renames", sha, "HEAD")
    if done.returncode != 0:
        raise ReportIndexError(f"git diff {sha[:10]} HEAD failed in {repo}: {done.stderr.strip()}")
    return frozenset(done.stdout.split())


def freshness(changed: frozenset[str] | None, sources: Iterable[str]) -> Freshness:
    if changed is None:
        return Freshness("unknown")
    hit = tuple(sorted(changed.intersection(sources)))
    return Freshness("stale" if hit else "fresh", hit)


def collect(repo: Path, ops: Sequence[str]) -> list[Report]:
    return [load_report(kind, p, ops) for kind, sub in REPORT_DIRS.items()
            for p in sorted((repo / sub).glob("*.json"))]


def newest(reports: Iterable[Report], op: str, kind: str) -> Report | None:
    """The newest report of `kind` where `op` ran; else the newest that names `op` at all."""
    have = [r for r in reports if r.kind == kind and op in r.ops]
    pool = [r for r in have if r.ops[op].ran] or have
    return max(pool, key=_age) if pool else None


def _age(r: Report) -> tuple[str, str]:
    return (r.created, r.path.name)


def views(repo: Path, reports: Sequence[Report], ops: Sequence[str]) -> list[OpView]:
    changed = {r.sha: changed_since(repo, r.sha) for r in reports}
    out = []
    for op in ops:
        sources = op_sources(op, repo)
        pick = {k: r for k in KINDS if (r := newest(reports, op, k)) is not None}
        fresh = {k: freshness(changed[r.sha], sources) for k, r in pick.items()}
        out.append(OpView(op, sources, pick, fresh))
    return out


def _sha(r: Report) -> str:
    dirty = {True: " dirty", False: "", None: " dirty?"}[r.dirty]
    return f"{(r.sha or 'no sha')[:7]}{dirty}"


def _rel(path: Path, repo: Path) -> str:
    return path.resolve().relative_to(repo.resolve()).as_posix()


def to_json(repo: Path, reports: Sequence[Report], ops: Sequence[OpView]) -> dict[str, Any]:
    from nmoe.provenance import provenance

    def one(v: OpView, kind: str) -> dict[str, Any] | None:
        r = v.newest.get(kind)
        if r is None:
            return None
        f = v.fresh[kind]
        return {"file": _rel(r.path, repo), "git_sha": r.sha, "git_dirty": r.dirty, "created_utc": r.created,
                "gpu": r.gpu, "summary": r.ops[v.op].summary, "ran": r.ops[v.op].ran, "freshness": f.state,
                "changed": list(f.changed)}

    stale = [f"{v.op}/{k}" for v in ops for k, f in v.fresh.items() if f.state == "stale"]
    unknown = [f"{v.op}/{k}" for v in ops for k, f in v.fresh.items() if f.state == "unknown"]
    return {
        "provenance": provenance(),
        "mapping": dict(MAPPING),
        "summary": {"reports": len(reports), "dirty": sum(r.dirty is True for r in reports),
                    "stale": stale, "unknown": unknown},
        "reports": [{"kind": r.kind, "file": _rel(r.path, repo), "git_sha": r.sha, "git_dirty": r.dirty,
                     "created_utc": r.created, "gpu": r.gpu, "ops": sorted(r.ops),
                     "unmapped": list(r.unmapped)} for r in reports],
        "ops": {v.op: {"sources": list(v.sources), **{k: one(v, k) for k in KINDS}} for v in ops},
    }


def _cell(v: OpView, kind: str) -> Entry:
    r = v.newest.get(kind)
    if r is None:
        return Entry("no report", mark="missing")
    state = v.fresh[kind].state
    mark = "dirty" if r.dirty and state == "fresh" else state
    return Entry(f"{r.ops[v.op].summary} | {_sha(r)} | {state}", r.path, mark=mark)


def sections(repo: Path, reports: Sequence[Report], ops: Sequence[OpView]) -> list[Section]:
    """The per-op table (newest result of each kind, its commit, fresh or stale), the reports, the mapping."""
    rows = []
    for v in ops:
        changed = sorted({f for fr in v.fresh.values() for f in fr.changed})
        rows.append((Entry(v.op), *(_cell(v, k) for k in KINDS),
                     Entry(", ".join(changed) or "-", mark="stale" if changed else "")))
    files = tuple((Entry(r.kind), Entry(r.path.name, r.path), Entry(r.created), Entry(r.gpu or "no GPU"),
                   Entry((r.sha or "no sha")[:10]),
                   Entry(TREE[r.dirty], mark="dirty" if r.dirty is not False else ""),
                   Entry(str(len(r.ops))), Entry(", ".join(r.unmapped) or "-")) for r in reports)
    legend = Entry("A cell: what the report says of the op | its commit (dirty: made from uncommitted "
                   "changes) | fresh, stale or unknown.")
    return [
        Section("per op: the newest result of each kind", columns=("op", *KINDS, "op sources changed since"),
                rows=tuple(rows), entries=(legend,)),
        Section("committed reports", columns=("kind", "file", "created (UTC)", "GPU", "commit", "tree", "ops",
                                              "not mapped to an op"), rows=files),
        Section("how results map to ops", tuple(Entry(f"{k}: {v}") for k, v in MAPPING.items())),
    ]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nmoe report", description="index the committed parity, mutation and "
                                 "bench reports per op (newest result, sha, dirty tree, stale against the "
                                 "op's sources) as index.html and index.json")
    ap.add_argument("--out", type=Path, required=True, help="directory for index.html and index.json")
    ap.add_argument("--ops", default="", help="comma-separated registry ops (default: all)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from nmoe.checkout import CheckoutError, source_dir
    from parity.registry import REGISTRY

    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    ops = [o for o in args.ops.split(",") if o] or list(REGISTRY)
    if unknown := [o for o in ops if o not in REGISTRY]:
        print(f"nmoe report: no registry op {', '.join(unknown)}; known ops: {', '.join(REGISTRY)}",
              file=sys.stderr)
        return 2
    try:
        repo = source_dir("nmoe report", "parity").parent
        if _git(repo, "rev-parse", "HEAD").returncode != 0:
            raise ReportIndexError(f"{repo} is not a git checkout; staleness needs the repository's history")
        reports = collect(repo, ops)
        vs = views(repo, reports, ops)
        args.out.mkdir(parents=True, exist_ok=True)
        doc = to_json(repo, reports, vs)
        (args.out / "index.json").write_text(json.dumps(doc, indent=1) + "\n")
        s = doc["summary"]
        page = write_index(args.out / "index.html", "nmoe reports", sections(repo, reports, vs),
                           f"{s['reports']} committed reports, {s['dirty']} from dirty trees; "
                           f"{len(s['stale'])} op results stale, {len(s['unknown'])} of unknown commit. "
                           "Stale: a source file of the op changed in git after the report's commit.")
    except (CheckoutError, ReportIndexError, SourceGraphError) as e:
        print(f"nmoe report: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nmoe report: cannot write into {args.out} ({e}); pass a writable --out", file=sys.stderr)
        return 1
    print(f"nmoe report: wrote {page} and {args.out / 'index.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
