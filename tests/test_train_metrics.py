"""Metrics: router statistics on hand-derived loads, experiments db lifecycle, DuckDB rows, CLI summaries."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nmoe.config import from_dict
from nmoe.runreport import main as metrics_main
from nmoe.train import metricstore
from nmoe.train.metrics import ExperimentsDB, runs_main
from nmoe.train.metricstore import MetricsWriter, rank_dir, read_parts
from nmoe.train.stepstats import router_stats


def test_router_stats_hand_values() -> None:
    names = ["layers.1.ffn", "layers.2.ffn"]
    counts = [torch.tensor([2, 2, 2, 2]), torch.tensor([4, 0, 0, 0])]
    biases = [torch.tensor([0.0, 0.001, -0.002, 0.0]), torch.zeros(4)]
    s = router_stats(names, counts, biases)
    assert s["router/layers.1.ffn/load_cv"] == 0.0
    assert s["router/layers.1.ffn/entropy"] == pytest.approx(1.0)
    assert s["router/layers.1.ffn/max_load"] == 1.0
    assert s["router/layers.1.ffn/bias_range"] == pytest.approx(0.003)
    # loads (4,0,0,0): mean 1, population std sqrt(((3)^2 + 3·1)/4) = sqrt(3)
    assert s["router/layers.2.ffn/load_cv"] == pytest.approx(math.sqrt(3))
    assert s["router/layers.2.ffn/entropy"] == 0.0
    assert s["router/layers.2.ffn/max_load"] == 4.0
    p = [1 / 6, 2 / 6, 3 / 6]
    s3 = router_stats(["x"], [torch.tensor([1, 2, 3])], [torch.zeros(3)])
    assert s3["router/x/entropy"] == pytest.approx(-sum(q * math.log(q) for q in p) / math.log(3))


def test_run_lifecycle_rows_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = from_dict({"train": {"run_name": "t", "experiment": "exp1"},
                     "metrics": {"db_path": str(tmp_path / "x.sqlite"), "dir": str(tmp_path / "m")}}, env={})
    db = ExperimentsDB(cfg.metrics.db_path)
    db.start_run("t-1", cfg, world=1, resumed=False)
    w = MetricsWriter(cfg.metrics.dir, "t-1", 0, flush_rows=3)
    for step in range(1, 6):
        w.log(step, {"loss": 10.0 - step, "lr": 1e-3})
    w.flush()
    w.truncate_after(3)  # a resume from step 3 drops what a crashed attempt logged past it
    w.log(4, {"loss": 5.5})
    w.flush()
    db.finish_run("t-1", "interrupted", 4)
    db.start_run("t-1", cfg, world=1, resumed=True)
    db.finish_run("t-1", "completed", 4)
    (row,) = db.runs("exp1")
    db.close()
    assert row["status"] == "completed" and row["resumes"] == 1 and row["last_step"] == 4
    assert row["end_ms"] >= row["start_ms"]
    q = "SELECT tag, step, value FROM metrics WHERE run='t-1' ORDER BY tag, step"
    rows = read_parts(rank_dir(cfg.metrics.dir, "t-1", 0), lambda con: con.execute(q).fetchall(), [])
    assert rows == [("loss", 1, 9.0), ("loss", 2, 8.0), ("loss", 3, 7.0), ("loss", 4, 5.5),
                    ("lr", 1, 1e-3), ("lr", 2, 1e-3), ("lr", 3, 1e-3)]
    assert runs_main(["--db", cfg.metrics.db_path]) == 0
    out = capsys.readouterr().out
    assert "t-1" in out and "exp1" in out and "completed" in out
    assert metrics_main(["t-1", "--db", cfg.metrics.db_path]) == 0
    lines = capsys.readouterr().out.splitlines()
    loss = next(line.split() for line in lines if line.startswith("loss "))
    assert loss == ["loss", "4", "1-4", "5.5", "5.5", "9", "7.375"]
    assert metrics_main(["t-", "--db", cfg.metrics.db_path]) == 1
    assert "did you mean t-1" in capsys.readouterr().err


def test_cli_without_db_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert runs_main(["--db", str(tmp_path / "none.sqlite")]) == 1
    assert "--db" in capsys.readouterr().err
    with pytest.raises(ValueError, match="run status"):
        db = ExperimentsDB(tmp_path / "y.sqlite")
        db.finish_run("nope", "weird", 0)


def test_compaction_keeps_every_row_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metricstore, "COMPACT_PARTS", 4)
    w = MetricsWriter(tmp_path, "r", 0, flush_rows=1)
    for step in range(1, 12):
        w.log(step, {"loss": float(step)})
    directory = rank_dir(tmp_path, "r", 0)
    assert len(list(directory.glob("*.parquet"))) <= 5 and list(directory.glob("*.snap.parquet"))
    w.truncate_after(7)
    w.log(8, {"loss": 80.0})
    w.flush()
    w.close()
    q = "SELECT step, value FROM metrics ORDER BY step"
    rows = read_parts(directory, lambda con: con.execute(q).fetchall(), [])
    assert rows == [(s, float(s)) for s in range(1, 8)] + [(8, 80.0)]
    newest = max(int(p.name[:8]) for p in directory.glob("*.parquet"))
    assert MetricsWriter(tmp_path, "r", 0).next_seq == newest + 1


def test_progress_line_carries_mfu_and_peak_memory_where_measured() -> None:
    from nmoe.train.loop import gpu_fields

    assert gpu_fields({"loss": 1.0}) == ""
    assert gpu_fields({"mfu": 0.3604, "mem/max_allocated_gb": 71.25}) == " MFU 36.0% peak mem 71.2 GiB"
    assert gpu_fields({"mem/max_rss_gb": 2.0}) == ""
