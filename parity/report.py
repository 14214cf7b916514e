"""Parity reports: docs/reports.md's JSON schema, a validator for it, and the DuckDB history tables.
Non-finite worst values go to JSON as the strings "inf"/"-inf"/"nan" (strict JSON has no Infinity);
DuckDB keeps them as DOUBLE."""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nmoe.outpaths import user_data_dir

if TYPE_CHECKING:
    import duckdb

DB_ENV = "NMOE_PARITY_DB"
WAIT_S = 60.0
STATUSES = ("pass", "fail", "not run")
COMPILE_STATUSES = ("ok", "fail", "not run")
PROVENANCE_KEYS = (
    "git_sha",
    "git_dirty",
    "created_utc",
    "host",
    "gpu",
    "cuda_driver",
    "torch",
    "cutlass_dsl",
    "python",
    "command",
)
CASE_KEYS = ("op", "contract", "arch", "dtype", "shape", "seed", "status", "worst", "reason")
COMPILE_KEYS = ("op", "kernel", "arch", "status", "seconds", "instructions")
WORST_ORDER = ("err_ratio", "bound_ratio", "ulp", "mismatches", "violations")


def json_safe(obj: Any) -> Any:
    """Replace non-finite floats by strings so the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def as_float(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, str):
        return float(v)
    return float(v)


def build(
    provenance: Mapping[str, Any],
    cases: Sequence[Mapping[str, Any]],
    compile_rows: Sequence[Mapping[str, Any]],
    run: Mapping[str, Any],
) -> dict[str, Any]:
    summary = {
        "passed": sum(c["status"] == "pass" for c in cases),
        "failed": sum(c["status"] == "fail" for c in cases),
        "not_run": sum(c["status"] == "not run" for c in cases),
        "compile": {
            s.replace(" ", "_"): sum(r["status"] == s for r in compile_rows) for s in COMPILE_STATUSES
        },
    }
    return {
        "provenance": dict(provenance),
        "run": dict(run),
        "summary": summary,
        "cases": [dict(c) for c in cases],
        "compile": [dict(r) for r in compile_rows],
    }


def validate(report: Mapping[str, Any]) -> list[str]:
    """Problems with `report` against docs/design.md's parity schema (empty list: valid)."""
    errs: list[str] = []
    for key in ("provenance", "summary", "cases", "compile"):
        if key not in report:
            errs.append(f"missing top-level key {key!r}")
    if errs:
        return errs
    prov = report["provenance"]
    errs += [f"provenance lacks {k!r}" for k in PROVENANCE_KEYS if k not in prov]
    summ = report["summary"]
    for k in ("passed", "failed", "not_run"):
        if not isinstance(summ.get(k), int):
            errs.append(f"summary.{k} must be an int")
    for i, c in enumerate(report["cases"]):
        errs += [f"cases[{i}] lacks {k!r}" for k in CASE_KEYS if k not in c]
        if c.get("status") not in STATUSES:
            errs.append(f"cases[{i}].status {c.get('status')!r} not in {STATUSES}")
        if c.get("status") == "not run" and not c.get("reason"):
            errs.append(f"cases[{i}] is not run without a reason")
        worst = c.get("worst", {})
        if not isinstance(worst, dict) or not all(isinstance(v, int | float | str) for v in worst.values()):
            errs.append(f"cases[{i}].worst must map metric -> number")
    for i, r in enumerate(report["compile"]):
        errs += [f"compile[{i}] lacks {k!r}" for k in COMPILE_KEYS if k not in r]
        if r.get("status") not in COMPILE_STATUSES:
            errs.append(f"compile[{i}].status {r.get('status')!r} not in {COMPILE_STATUSES}")
        if r.get("arch") not in ("sm_90a", "sm_100a"):
            errs.append(f"compile[{i}].arch {r.get('arch')!r} is not sm_90a/sm_100a")
    n = len(report["cases"])
    if isinstance(summ.get("passed"), int) and summ["passed"] + summ["failed"] + summ["not_run"] != n:
        errs.append("summary counts do not add up to the number of cases")
    return errs


def write_json(path: str | Path, report: Mapping[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(json_safe(report), indent=1, allow_nan=False) + "\n", encoding="utf-8")


_DDL = (
    """CREATE TABLE IF NOT EXISTS parity_runs (run_id VARCHAR PRIMARY KEY, created_utc VARCHAR,
    git_sha VARCHAR, git_dirty BOOLEAN, host VARCHAR, gpu VARCHAR, cuda_driver VARCHAR, torch VARCHAR,
    cutlass_dsl VARCHAR,
    python VARCHAR, command VARCHAR, mode VARCHAR, arch VARCHAR, seed BIGINT, passed INTEGER, failed INTEGER,
    not_run INTEGER, compile_ok INTEGER, compile_fail INTEGER, compile_not_run INTEGER, report VARCHAR)""",
    """CREATE TABLE IF NOT EXISTS parity_cases (run_id VARCHAR, op VARCHAR, contract VARCHAR, arch VARCHAR,
    dtype VARCHAR, shape VARCHAR, seed BIGINT, case_name VARCHAR, mode VARCHAR, status VARCHAR,
    worst_metric VARCHAR, worst_value DOUBLE, worst VARCHAR, reason VARCHAR, seconds DOUBLE)""",
    """CREATE TABLE IF NOT EXISTS parity_compile (run_id VARCHAR, op VARCHAR, kernel VARCHAR, arch VARCHAR,
    status VARCHAR, seconds DOUBLE, instructions VARCHAR, error VARCHAR)""",
)


def default_db() -> Path:
    """$NMOE_PARITY_DB, else the user's data dir: one history for every checkout and install."""
    env = os.environ.get(DB_ENV)
    return Path(env) if env else user_data_dir() / "parity-history.duckdb"


class HistoryLocked(RuntimeError):
    """Another process kept the history file locked past the wait; the message names it and the fix."""


def _connect(db_path: str | Path, read_only: bool, wait_s: float) -> duckdb.DuckDBPyConnection:
    """DuckDB locks the whole file per process: retry a lock conflict with backoff for up to `wait_s`."""
    import duckdb

    deadline = time.monotonic() + wait_s
    delay = 0.02
    while True:
        try:
            return duckdb.connect(str(db_path), read_only=read_only)
        except duckdb.IOException as e:
            if "lock" not in str(e).lower():
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                held = re.search(r"held in (.+?) \((PID \d+)\)", str(e))
                who = f"{held.group(2)}, {held.group(1)}" if held else str(e).splitlines()[0]
                raise HistoryLocked(
                    f"parity history {db_path} stayed locked by another process ({who}) for {wait_s:g} s; "
                    "retry when it ends, or pass --db OTHER.duckdb or --no-db") from e
            time.sleep(min(left, delay * random.uniform(0.5, 1.5)))
            delay = min(delay * 2, 0.5)


def primary_worst(worst: Mapping[str, Any]) -> tuple[str | None, float | None]:
    for key in WORST_ORDER:
        if key in worst:
            return key, as_float(worst[key])
    return None, None


def append_db(db_path: str | Path, report: Mapping[str, Any], wait_s: float = WAIT_S) -> str:
    """Append one run (its cases and compile rows) to the DuckDB history in one transaction; returns the
    run id. Concurrent appenders take turns; HistoryLocked after `wait_s` of waiting."""
    run_id = uuid.uuid4().hex
    prov, summ, run = report["provenance"], report["summary"], report.get("run", {})
    comp = summ.get("compile", {})
    Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    con = _connect(db_path, read_only=False, wait_s=wait_s)
    try:
        con.begin()
        for ddl in _DDL:
            con.execute(ddl)
        con.execute(
            "INSERT INTO parity_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                run_id,
                prov.get("created_utc"),
                prov.get("git_sha"),
                prov.get("git_dirty"),
                prov.get("host"),
                prov.get("gpu"),
                prov.get("cuda_driver"),
                prov.get("torch"),
                prov.get("cutlass_dsl"),
                prov.get("python"),
                prov.get("command"),
                run.get("mode"),
                run.get("arch"),
                run.get("seed"),
                summ["passed"],
                summ["failed"],
                summ["not_run"],
                comp.get("ok", 0),
                comp.get("fail", 0),
                comp.get("not_run", 0),
                json.dumps(json_safe(report), allow_nan=False),
            ],
        )
        rows = []
        for c in report["cases"]:
            metric, value = primary_worst(c.get("worst", {}))
            rows.append(
                [
                    run_id,
                    c["op"],
                    c["contract"],
                    c["arch"],
                    c["dtype"],
                    json.dumps(c["shape"]),
                    c["seed"],
                    c.get("case"),
                    c.get("mode"),
                    c["status"],
                    metric,
                    value,
                    json.dumps(json_safe(c.get("worst", {}))),
                    c.get("reason"),
                    c.get("seconds"),
                ]
            )
        if rows:
            con.executemany(
                "INSERT INTO parity_cases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows
            )
        crow = [
            [
                run_id,
                r["op"],
                r["kernel"],
                r["arch"],
                r["status"],
                r.get("seconds"),
                json.dumps(r.get("instructions", {})),
                r.get("error"),
            ]
            for r in report["compile"]
        ]
        if crow:
            con.executemany("INSERT INTO parity_compile VALUES (?, ?, ?, ?, ?, ?, ?, ?)", crow)
        con.commit()
    finally:
        con.close()
    return run_id


_HISTORY_SQL = """
WITH per AS (
  SELECT c.op, c.arch, c.run_id, r.created_utc, r.git_sha, r.git_dirty, r.mode,
         sum(CASE WHEN c.status = 'pass' THEN 1 ELSE 0 END) AS n_pass,
         sum(CASE WHEN c.status = 'fail' THEN 1 ELSE 0 END) AS n_fail,
         sum(CASE WHEN c.status = 'not run' THEN 1 ELSE 0 END) AS n_not_run,
         arg_max(c.worst_metric, c.worst_value) AS metric, max(c.worst_value) AS worst
  FROM parity_cases c JOIN parity_runs r USING (run_id)
  GROUP BY ALL
), ranked AS (
  SELECT *, row_number() OVER (PARTITION BY op, arch ORDER BY created_utc DESC, run_id) AS k FROM per
)
SELECT op, arch, created_utc, git_sha, git_dirty, mode, n_pass, n_fail, n_not_run, metric, worst
FROM ranked WHERE k <= ? ORDER BY op, arch, created_utc DESC
"""


def history(db_path: str | Path, ops: Sequence[str] | None = None, last: int = 5, wait_s: float = WAIT_S
            ) -> str:
    """The last `last` runs per (op, arch) as a text table."""
    if not Path(db_path).exists():
        return f"no parity history at {db_path}; run `nmoe parity` first"
    con = _connect(db_path, read_only=True, wait_s=wait_s)
    try:
        rows = con.execute(_HISTORY_SQL, [last]).fetchall()
    finally:
        con.close()
    if ops:
        import fnmatch

        rows = [r for r in rows if any(fnmatch.fnmatchcase(r[0], p) for p in ops)]
    table = [["op", "arch", "created (UTC)", "git", "mode", "pass/fail/not run", "worst"]]
    for op, arch, created, sha, dirty, mode, npass, nfail, nnr, metric, worst in rows:
        git = (sha or "?")[:10] + ("+dirty" if dirty else "")
        shown = "-" if metric is None else f"{metric}={worst:.3g}"
        table.append([op, arch, str(created), git, str(mode), f"{npass}/{nfail}/{nnr}", shown])
    return format_table(table)


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
