"""Run bookkeeping in one SQLite experiments db; step metrics in one DuckDB file per rank.

DuckDB files are opened only while flushing, so `nmoe metrics RUN` can read them while a run is going.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sqlite3
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from nmoe.config import Config, MetricsConfig, fingerprint, to_dict
from nmoe.provenance import provenance

STATUSES: Final[tuple[str, ...]] = ("running", "completed", "stopped", "interrupted", "failed")
PEAK_BF16_FLOPS: Final[dict[str, float]] = {"H100": 989e12, "H200": 989e12, "B200": 2250e12}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
  id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY, experiment_id INTEGER NOT NULL REFERENCES experiments(id), name TEXT NOT NULL,
  config_json TEXT NOT NULL, fingerprint TEXT NOT NULL, git_sha TEXT, git_dirty INTEGER, host TEXT,
  world_size INTEGER NOT NULL, status TEXT NOT NULL, start_ms INTEGER NOT NULL, end_ms INTEGER,
  last_step INTEGER NOT NULL DEFAULT 0, metrics_dir TEXT NOT NULL, resumes INTEGER NOT NULL DEFAULT 0);
"""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


class ExperimentsDB:
    """experiments(name) 1—n runs(config, git sha/dirty, status, start/end, last step)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.con = sqlite3.connect(self.path, timeout=30.0)
        self.con.executescript(_SCHEMA)

    def close(self) -> None:
        self.con.close()

    def start_run(self, run_id: str, cfg: Config, *, world: int, resumed: bool) -> None:
        with self.con:
            if resumed and self.con.execute("SELECT 1 FROM runs WHERE id=?", (run_id,)).fetchone():
                self.con.execute("UPDATE runs SET status='running', end_ms=NULL, resumes=resumes+1 "
                                 "WHERE id=?", (run_id,))
                return
            self.con.execute("INSERT OR IGNORE INTO experiments(name, created_ms) VALUES (?, ?)",
                             (cfg.train.experiment, now_ms()))
            (exp_id,) = self.con.execute("SELECT id FROM experiments WHERE name=?",
                                         (cfg.train.experiment,)).fetchone()
            prov = provenance()
            dirty = None if prov["git_dirty"] is None else int(prov["git_dirty"])
            self.con.execute(
                "INSERT INTO runs(id, experiment_id, name, config_json, fingerprint, git_sha, git_dirty, "
                "host, world_size, status, start_ms, metrics_dir, resumes) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, exp_id, cfg.train.run_name, json.dumps(to_dict(cfg), sort_keys=True),
                 fingerprint(cfg), prov["git_sha"], dirty, prov["host"], world, "running", now_ms(),
                 cfg.metrics.dir, int(resumed)),
            )

    def set_progress(self, run_id: str, step: int) -> None:
        with self.con:
            self.con.execute("UPDATE runs SET last_step=? WHERE id=?", (step, run_id))

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


def rank_db_path(metrics_dir: str | Path, run_id: str, rank: int) -> Path:
    return Path(metrics_dir) / f"{run_id}.rank{rank:03d}.duckdb"


class MetricsWriter:
    """Buffers (run, tag, step, ts_ms, value) rows and appends them to this rank's DuckDB file."""

    def __init__(self, metrics_dir: str | Path, run_id: str, rank: int, flush_rows: int = 2000) -> None:
        import duckdb

        self.duckdb = duckdb
        self.path = rank_db_path(metrics_dir, run_id, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id, self.flush_rows = run_id, flush_rows
        self.rows: list[tuple[str, str, int, int, float]] = []
        with duckdb.connect(str(self.path)) as con:
            con.execute("CREATE TABLE IF NOT EXISTS metrics (run VARCHAR, tag VARCHAR, step BIGINT, "
                        "ts_ms BIGINT, value DOUBLE)")

    def truncate_after(self, step: int) -> None:
        """Drop rows a crashed attempt logged past the checkpoint being resumed, so steps stay unique."""
        with self.duckdb.connect(str(self.path)) as con:
            con.execute("DELETE FROM metrics WHERE run=? AND step>?", [self.run_id, step])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        ts = now_ms()
        self.rows += [(self.run_id, tag, step, ts, float(v)) for tag, v in values.items()]
        if len(self.rows) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        with self.duckdb.connect(str(self.path)) as con:
            for i in range(0, len(self.rows), 1000):
                part = self.rows[i:i + 1000]
                con.execute("INSERT INTO metrics VALUES " + ",".join(["(?, ?, ?, ?, ?)"] * len(part)),
                            [x for row in part for x in row])
        self.rows = []


def router_stats(
    names: Sequence[str], counts: Sequence[Tensor], biases: Sequence[Tensor]
) -> dict[str, float]:
    """Per MoE layer: load CV (std/mean), entropy of the load distribution / log E, max load / mean,
    and bias range (max - min)."""
    out: dict[str, float] = {}
    for name, c, b in zip(names, counts, biases, strict=True):
        load = c.detach().double().cpu()
        e, total = load.numel(), float(load.sum())
        mean = total / e
        p = load / total if total > 0 else torch.full_like(load, 1.0 / e)
        nz = p[p > 0]
        ent = float(-(nz * nz.log()).sum()) / math.log(e) if e > 1 else 1.0
        out[f"router/{name}/load_cv"] = float(load.std(correction=0)) / mean if mean > 0 else 0.0
        out[f"router/{name}/entropy"] = ent
        out[f"router/{name}/max_load"] = float(load.max()) / mean if mean > 0 else 0.0
        bias = b.detach().double().cpu()
        out[f"router/{name}/bias_range"] = float(bias.max() - bias.min())
    return out


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU, or None where MFU has no meaning (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"mem/allocated_gb": torch.cuda.memory_allocated(device) / 2**30,
                "mem/max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"mem/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


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


def summarize(path: Path, run_id: str) -> list[_Summary]:
    import duckdb

    with duckdb.connect(str(path), read_only=True) as con:
        rows = con.execute(
            "SELECT tag, count(*), min(step), max(step), arg_max(value, step), min(value), max(value), "
            "avg(value) FROM metrics WHERE run=? GROUP BY tag ORDER BY tag", [run_id]).fetchall()
    return [_Summary(*r) for r in rows]


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
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
        runs = db.runs(args.experiment)
    finally:
        db.close()
    rows = []
    for r in runs:
        dur = ((r["end_ms"] or now_ms()) - r["start_ms"]) / 1000
        sha = (r["git_sha"] or "-")[:10] + ("+dirty" if r["git_dirty"] else "")
        rows.append([r["id"], r["experiment"], r["status"], str(r["last_step"]), _ts(r["start_ms"]),
                     f"{dur:.0f}s", sha])
    print(_table(["run", "experiment", "status", "step", "started (UTC)", "duration", "git"], rows))
    return 0


def metrics_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nmoe metrics", description="summarise one run's metrics")
    ap.add_argument("run", help="run id (see `nmoe runs`)")
    ap.add_argument("--db", default=MetricsConfig().db_path, help="SQLite experiments db (metrics.db_path)")
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not Path(args.db).is_file():
        print(f"nmoe metrics: no experiments db at {args.db}; pass --db", file=sys.stderr)
        return 1
    db = ExperimentsDB(args.db)
    try:
        runs = {r["id"]: r for r in db.runs()}
    finally:
        db.close()
    if args.run not in runs:
        near = [r for r in runs if args.run in r]
        hint = f"; did you mean {', '.join(near[:5])}?" if near else "; list runs with `nmoe runs`"
        print(f"nmoe metrics: no run {args.run!r} in {args.db}{hint}", file=sys.stderr)
        return 1
    path = rank_db_path(runs[args.run]["metrics_dir"], args.run, args.rank)
    if not path.is_file():
        print(f"nmoe metrics: {path} missing (rank {args.rank} wrote no metrics)", file=sys.stderr)
        return 1
    summary = summarize(path, args.run)
    rows = [[s.tag, str(s.n), f"{s.first_step}-{s.last_step}", _fmt(s.last), _fmt(s.lo), _fmt(s.hi),
             _fmt(s.mean)] for s in summary]
    r = runs[args.run]
    print(f"run {args.run} ({r['status']}, step {r['last_step']}, rank {args.rank})")
    print(_table(["tag", "n", "steps", "last", "min", "max", "mean"], rows))
    return 0
