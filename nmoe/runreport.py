"""`nmoe metrics RUN`: one run's metrics as a table, a PNG of loss, lr, throughput and MFU over steps, and a
report JSON (per-step loss, tokens/s, MFU, peak memory; the run's commit and this host's versions)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from nmoe.config import MetricsConfig
from nmoe.plots import slug, training_sections
from nmoe.provenance import provenance
from nmoe.train.metrics import ExperimentsDB, fmt_value, series, summarize, text_table
from nmoe.train.metricstore import rank_dir, visible_parts
from parity.report import json_safe

REPORT_TAGS: Final = ("loss", "lr", "tokens_per_s", "ms_per_step", "mfu", "mem/max_allocated_gb")
RUN_FIELDS: Final = ("id", "experiment", "name", "status", "last_step", "start_ms", "end_ms", "git_sha",
                     "git_dirty", "world")


def report(run: Mapping[str, Any], data: Mapping[str, list[tuple[int, float]]]) -> dict[str, Any]:
    """One row per logged step with the REPORT_TAGS it logged (None where a tag was not logged that step)."""
    by_tag = {t: dict(data.get(t, [])) for t in REPORT_TAGS}
    steps = sorted({s for points in by_tag.values() for s in points})
    return {"run": {k: run.get(k) for k in RUN_FIELDS}, "exported_on": provenance(),
            "steps": [{"step": s, **{t: by_tag[t].get(s) for t in REPORT_TAGS}} for s in steps]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nmoe metrics", description="summarise one run's metrics: a table, "
                                 "a PNG of loss and throughput over steps, and a report JSON")
    ap.add_argument("run", help="run id (see `nmoe runs`)")
    ap.add_argument("--db", default=MetricsConfig().db_path, help="SQLite experiments db (metrics.db_path)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="directory for the PNGs and report JSON (default: "
                    "the run's metrics directory)")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not Path(args.db).is_file():
        print(f"nmoe metrics: no experiments db at {args.db}; pass --db", file=sys.stderr)
        return 1
    db = ExperimentsDB(args.db)
    try:
        db.mark_dead()
        runs = {r["id"]: r for r in db.runs()}
    finally:
        db.close()
    if args.run not in runs:
        near = [r for r in runs if args.run in r]
        hint = f"; did you mean {', '.join(near[:5])}?" if near else "; list runs with `nmoe runs`"
        print(f"nmoe metrics: no run {args.run!r} in {args.db}{hint}", file=sys.stderr)
        return 1
    r = runs[args.run]
    path = rank_dir(r["metrics_dir"], args.run, args.rank)
    if not visible_parts(path):
        print(f"nmoe metrics: {path} holds no metrics yet (rank {args.rank} has not flushed)",
              file=sys.stderr)
        return 1
    rows = [[s.tag, str(s.n), f"{s.first_step}-{s.last_step}", fmt_value(s.last), fmt_value(s.lo),
             fmt_value(s.hi), fmt_value(s.mean)] for s in summarize(path, args.run)]
    print(f"run {args.run} ({r['status']}, step {r['last_step']}, rank {args.rank})")
    print(text_table(["tag", "n", "steps", "last", "min", "max", "mean"], rows))
    out: Path = args.out if args.out is not None else Path(r["metrics_dir"])
    out.mkdir(parents=True, exist_ok=True)
    data = series(path, args.run)
    images = [e.target for s in training_sections(data, args.run, out) for e in s.entries if e.image]
    doc = out / f"{slug(args.run)}.report.json"
    doc.write_text(json.dumps(json_safe(report(r, data)), indent=1, allow_nan=False) + "\n")
    print("wrote " + ", ".join(str(p) for p in (*images, doc)))
    return 0
