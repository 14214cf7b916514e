"""Step metrics of one rank: an append-only directory of Parquet parts, each renamed into place whole.
Readers take no lock, so reading can never stop the trainer, and they see every row up to the last flush.
Any DuckDB can `read_parquet('DIR/*.parquet')`; `read_parts` also skips parts a snapshot superseded."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

import duckdb

COLUMNS: Final[str] = "run VARCHAR, tag VARCHAR, step BIGINT, ts_ms BIGINT, value DOUBLE"
COMPACT_PARTS: Final[int] = 256
_PART = re.compile(r"^(\d{8})(\.snap)?\.parquet$")
T = TypeVar("T")


def rank_dir(metrics_dir: str | Path, run_id: str, rank: int) -> Path:
    return Path(metrics_dir) / f"{run_id}.rank{rank:03d}"


def _parts(directory: Path) -> list[tuple[int, bool, Path]]:
    out = []
    for p in directory.iterdir() if directory.is_dir() else ():
        m = _PART.match(p.name)
        if m:
            out.append((int(m.group(1)), m.group(2) is not None, p))
    return sorted(out)


def visible_parts(directory: Path) -> list[Path]:
    """The newest snapshot and every part after it: a snapshot supersedes all parts numbered below it."""
    parts = _parts(directory)
    snap = max((seq for seq, is_snap, _ in parts if is_snap), default=-1)
    return [p for seq, _, p in parts if seq >= snap]


def _sql_list(paths: list[Path]) -> str:
    return "[" + ",".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def read_parts(directory: Path, query: Callable[[duckdb.DuckDBPyConnection], T], empty: T) -> T:
    """Run `query` against a view `metrics` over the visible parts; retried if compaction removed one."""
    for attempt in range(20):
        paths = visible_parts(directory)
        if not paths:
            return empty
        con = duckdb.connect()
        try:
            con.execute(f"CREATE VIEW metrics AS SELECT * FROM read_parquet({_sql_list(paths)})")
            return query(con)
        except duckdb.IOException:
            if attempt == 19:
                raise
            time.sleep(0.05)
        finally:
            con.close()
    raise AssertionError("unreachable")


class MetricsWriter:
    """Buffers (run, tag, step, ts_ms, value) rows; each flush adds one part, renamed into place whole."""

    def __init__(self, metrics_dir: str | Path, run_id: str, rank: int, flush_rows: int = 2000) -> None:
        self.dir = rank_dir(metrics_dir, run_id, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id, self.flush_rows = run_id, flush_rows
        self.rows: list[tuple[str, str, int, int, float]] = []
        self.next_seq = max((seq for seq, _, _ in _parts(self.dir)), default=-1) + 1
        self.con = duckdb.connect()

    def close(self) -> None:
        self.con.close()

    def log(self, step: int, values: Mapping[str, float]) -> None:
        ts = time.time_ns() // 1_000_000
        self.rows += [(self.run_id, tag, step, ts, float(v)) for tag, v in values.items()]
        if len(self.rows) >= self.flush_rows:
            self.flush()

    def _publish(self, fill: Callable[[duckdb.DuckDBPyConnection], None], snapshot: bool) -> None:
        name = f"{self.next_seq:08d}{'.snap' if snapshot else ''}.parquet"
        tmp = self.dir / f".{name}.tmp"
        self.con.execute(f"CREATE OR REPLACE TABLE metrics ({COLUMNS})")
        fill(self.con)
        self.con.execute(f"COPY metrics TO {_sql_list([tmp])[1:-1]} (FORMAT parquet)")
        self.con.execute("DROP TABLE metrics")
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        self.next_seq += 1
        if snapshot:
            for seq, _, p in _parts(self.dir):
                if seq < self.next_seq - 1:
                    p.unlink(missing_ok=True)

    def _snapshot(self, where: str, args: list[Any]) -> None:
        paths = visible_parts(self.dir)

        def fill(con: duckdb.DuckDBPyConnection) -> None:
            if paths:
                con.execute(f"INSERT INTO metrics SELECT * FROM read_parquet({_sql_list(paths)}) "
                            f"WHERE {where}", args)

        self._publish(fill, snapshot=True)

    def flush(self) -> None:
        if not self.rows:
            return
        rows = self.rows

        def fill(con: duckdb.DuckDBPyConnection) -> None:
            for i in range(0, len(rows), 1000):
                part = rows[i:i + 1000]
                con.execute("INSERT INTO metrics VALUES " + ",".join(["(?, ?, ?, ?, ?)"] * len(part)),
                            [x for row in part for x in row])

        self._publish(fill, snapshot=False)
        self.rows = []
        if len(visible_parts(self.dir)) > COMPACT_PARTS:
            self._snapshot("true", [])

    def truncate_after(self, step: int) -> None:
        """Drop rows a crashed attempt logged past the checkpoint being resumed, so steps stay unique."""
        later = read_parts(self.dir, lambda con: con.execute(
            "SELECT count(*) FROM metrics WHERE run=? AND step>?", [self.run_id, step]).fetchone(), None)
        if later is not None and later[0]:
            self._snapshot("NOT (run=? AND step>?)", [self.run_id, step])
