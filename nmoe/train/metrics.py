"""Run bookkeeping in one SQLite experiments db (with the trainer's pid and heartbeat, so a killed run shows
as dead); step metrics in `nmoe.train.metricstore`, which readers query without a lock."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sqlite3
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from nmoe.config import Config, MetricsConfig, fingerprint, to_dict
from nmoe.provenance import provenance
from nmoe.train.metricstore import read_parts

STATUSES: Final[tuple[str, ...]] = ("running", "completed", "stopped", "interrupted", "failed", "dead")
STALE_MS: Final[int] = 30 * 60 * 1000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
  id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY, experiment_id INTEGER NOT NULL REFERENCES experiments(id), name TEXT NOT NULL,
  config_json TEXT NOT NULL, fingerprint TEXT NOT NULL, git_sha TEXT, git_dirty INTEGER, host TEXT,
  world_size INTEGER NOT NULL, status TEXT NOT NULL, start_ms INTEGER NOT NULL, end_ms INTEGER,
  last_step INTEGER NOT NULL DEFAULT 0, metrics_dir TEXT NOT NULL, resumes INTEGER NOT NULL DEFAULT 0);
"""
_ADDED_COLUMNS: Final[dict[str, str]] = {"pid": "INTEGER", "heartbeat_ms": "INTEGER"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _abs(path: str) -> str:
    """Stored absolute, so `nmoe metrics` finds the files from any working directory."""
    return str(Path(path).resolve())


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


class ExperimentsDB:
    """experiments(name) 1—n runs(config, git sha/dirty, status, start/end, last step). WAL journal, so
    `nmoe runs` reading never blocks the trainer's writes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.con = sqlite3.connect(self.path, timeout=30.0)
        have = {row[1] for row in self.con.execute("PRAGMA table_info(runs)")}
        if have >= set(_ADDED_COLUMNS):
            return
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.executescript(_SCHEMA)
        have = {row[1] for row in self.con.execute("PRAGMA table_info(runs)")}
        with self.con:
            for name, kind in _ADDED_COLUMNS.items():
                if name not in have:
                    self.con.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")

    def close(self) -> None:
        self.con.close()

    def start_run(self, run_id: str, cfg: Config, *, world: int, resumed: bool) -> None:
        with self.con:
            if resumed and self.con.execute("SELECT 1 FROM runs WHERE id=?", (run_id,)).fetchone():
                self.con.execute("UPDATE runs SET status='running', end_ms=NULL, resumes=resumes+1, host=?, "
                                 "pid=?, heartbeat_ms=?, metrics_dir=? WHERE id=?",
                                 (socket.gethostname(), os.getpid(), now_ms(), _abs(cfg.metrics.dir), run_id))
                return
            self.con.execute("INSERT OR IGNORE INTO experiments(name, created_ms) VALUES (?, ?)",
                             (cfg.train.experiment, now_ms()))
            (exp_id,) = self.con.execute("SELECT id FROM experiments WHERE name=?",
                                         (cfg.train.experiment,)).fetchone()
            prov = provenance()
            dirty = None if prov["git_dirty"] is None else int(prov["git_dirty"])
            self.con.execute(
                "INSERT INTO runs(id, experiment_id, name, config_json, fingerprint, git_sha, git_dirty, "
                "host, world_size, status, start_ms, metrics_dir, resumes, pid, heartbeat_ms) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, exp_id, cfg.train.run_name, json.dumps(to_dict(cfg), sort_keys=True),
                 fingerprint(cfg), prov["git_sha"], dirty, socket.gethostname(), world, "running", now_ms(),
                 _abs(cfg.metrics.dir), int(resumed), os.getpid(), now_ms()),
            )

    def set_progress(self, run_id: str, step: int) -> None:
        with self.con:
            self.con.execute("UPDATE runs SET last_step=?, heartbeat_ms=? WHERE id=?",
                             (step, now_ms(), run_id))

    def heartbeat(self, run_id: str) -> None:
        with self.con:
            self.con.execute("UPDATE runs SET heartbeat_ms=? WHERE id=?", (now_ms(), run_id))

    def mark_dead(self) -> None:
        """A 'running' run whose process is gone on this host, or silent for STALE_MS anywhere, is dead."""
        rows = self.con.execute("SELECT id, host, pid, heartbeat_ms FROM runs "
                                "WHERE status='running'").fetchall()
        host, now = socket.gethostname(), now_ms()
        for run_id, run_host, pid, beat in rows:
            gone = run_host == host and pid is not None and not _alive(int(pid))
            if gone or now - (beat or 0) > STALE_MS:
                with self.con:
                    self.con.execute("UPDATE runs SET status='dead', end_ms=? "
                                     "WHERE id=? AND status='running'", (beat, run_id))

    def finish_run(self, run_id: str, status: str, step: int) -> None:
        if status not in STATUSES:
            raise ValueError(f"run status {status!r}; use one of {STATUSES}")
        with self.con:
            self.con.execute("UPDATE runs SET status=?, end_ms=?, last_step=? WHERE id=?",
                             (status, now_ms(), step, run_id))

    def runs(self, experiment: str | None = None) -> list[dict[str, Any]]:
        cols = ("id", "experiment", "name", "status", "last_step", "start_ms", "end_ms", "git_sha",
                "git_dirty", "metrics_dir", "world_size", "resumes")
        q = ("SELECT r.id, e.name, r.name, r.status, r.last_step, r.start_ms, r.end_ms, r.git_sha, "
             "r.git_dirty, r.metrics_dir, r.world_size, r.resumes FROM runs r "
             "JOIN experiments e ON r.experiment_id=e.id")
        args: tuple[Any, ...] = ()
        if experiment is not None:
            q, args = q + " WHERE e.name=?", (experiment,)
        rows = self.con.execute(q + " ORDER BY r.start_ms", args).fetchall()
        return [dict(zip(cols, row, strict=True)) for row in rows]


@dataclass(frozen=True)
class _Summary:
    tag: str
    n: int
    first_step: int
    last_step: int
    last: float
    lo: float
    hi: float
    mean: float


def summarize(directory: Path, run_id: str) -> list[_Summary]:
    empty: list[tuple[Any, ...]] = []
    rows = read_parts(directory, lambda con: con.execute(
        "SELECT tag, count(*), min(step), max(step), arg_max(value, step), min(value), max(value), "
        "avg(value) FROM metrics WHERE run=? GROUP BY tag ORDER BY tag", [run_id]).fetchall(), empty)
    return [_Summary(*r) for r in rows]


def series(directory: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of one run in one rank's metrics directory, read without a lock."""
    empty: list[tuple[Any, ...]] = []
    rows = read_parts(directory, lambda con: con.execute(
        "SELECT tag, step, value FROM metrics WHERE run=? ORDER BY tag, step", [run_id]).fetchall(), empty)
    out: dict[str, list[tuple[int, float]]] = {}
    for tag, step, value in rows:
        out.setdefault(str(tag), []).append((int(step), float(value)))
    return out


def fmt_value(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _ts(ms: int | None) -> str:
    return "-" if ms is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000))


def runs_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nmoe runs", description="list experiment runs")
    ap.add_argument("--db", default=MetricsConfig().db_path, help="SQLite experiments db (metrics.db_path)")
    ap.add_argument("--experiment", default=None)
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not Path(args.db).is_file():
        print(f"nmoe runs: no experiments db at {args.db}; pass --db (the config's metrics.db_path)",
              file=sys.stderr)
        return 1
    db = ExperimentsDB(args.db)
    try:
        db.mark_dead()
        runs = db.runs(args.experiment)
    finally:
        db.close()
    rows = []
    for r in runs:
        dur = ((r["end_ms"] or now_ms()) - r["start_ms"]) / 1000
        sha = (r["git_sha"] or "-")[:10] + ("+dirty" if r["git_dirty"] else "")
        rows.append([r["id"], r["experiment"], r["status"], str(r["last_step"]), _ts(r["start_ms"]),
                     f"{dur:.0f}s", sha])
    print(text_table(["run", "experiment", "status", "step", "started (UTC)", "duration", "git"], rows))
    return 0
