"""`nmoe plots` on synthetic bench results and a synthetic training run: which rows go to which plot, the
PNGs and the index linking them, one-line errors; (heavy) the index opens in headless Chromium."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from headless import chromium, rendered_text
from PIL import Image

from nmoe import plots
from nmoe.config import from_dict
from nmoe.train.metrics import ExperimentsDB
from nmoe.train.metricstore import MetricsWriter

SHAPE = {"T": 4096, "H": 1024, "E": 8, "K": 2, "M": 8192}
CEILINGS = {"hbm_copy_TBps": 4.0, "bf16_dense_TFLOPs": 800.0}


def _mem(name: str, tbps: float, **more: Any) -> dict[str, Any]:
    return {"name": name, "shape": SHAPE, "ms": 0.1, "bytes": tbps * 1e8, "tbps": tbps,
            "frac_of_copy_ceiling": tbps / 4.0,
            "baselines": [{"name": "torch.compile", "ms": 0.2}, {"name": "torch_eager", "ms": None,
                                                                  "missing": "no compile"}], **more}


def _gemm(name: str, routing: str, tflops: float, **more: Any) -> dict[str, Any]:
    return {"name": f"{name}_{routing}", "routing": routing, "shape": {**SHAPE, "N": 512}, "ms": 1.0,
            "flops": tflops * 1e9, "tflops": tflops, "tbps": 0.5, "frac_of_copy_ceiling": 0.1,
            "baselines": [{"name": "torch._grouped_mm", "ms": 1.2}, {"name": "cublas_dense_mm", "ms": 0.9}],
            **more}


def _results(tmp: Path, rows: list[dict[str, Any]], name: str = "run.json") -> Path:
    path = tmp / name
    path.write_text(json.dumps({"provenance": {}, "ceilings": CEILINGS, "results": rows}))
    return path


ROWS = [
    _mem("relu2_fwd", 3.5), _mem("relu2_fwd_eager_call", 1.0), _mem("combine_fwd", 4.2),
    _gemm("grouped_gemm_fwd_up", "uniform", 650.0), _gemm("grouped_gemm_fwd_up", "zipf1.2", 600.0),
    _gemm("grouped_gemm_fp8_up", "uniform", 1000.0, fp8_dense_TFLOPs=1300.0, baselines=None,
          baseline={"name": "nmoe grouped_gemm (bf16)", "ms": 1.5}),
    {"name": "grouped_gemm_fwd_summary", "shape": {}, "ms": None, "status": "summary"},
    {"name": "permute", "shape": SHAPE, "ms": None, "status": "not run", "reason": "no kernel"},
]


def test_rows_sorted_into_plots() -> None:
    kinds = [plots.kind(r) for r in ROWS]
    assert kinds == ["memory", None, "memory", "gemm", "gemm", "gemm", None, None]
    assert plots.kind({"name": "moe_layer_fwd", "ms": 2.0, "tflops": 1.0}) == "moe"
    assert plots.family(ROWS[4]) == "grouped_gemm_fwd_up"
    assert plots.shape_label(ROWS[4]) == "T4096 H1024 E8 K2 zipf1.2"
    assert plots.measured_baselines(ROWS[0]) == [("torch.compile", 0.2)]
    assert plots.measured_baselines(ROWS[5]) == [("nmoe grouped_gemm (bf16)", 1.5)]
    assert plots.dense_ceilings(ROWS[5:6], CEILINGS) == {"bf16": 800.0, "fp8": 1300.0}


def _index_links(out: Path) -> list[str]:
    return re.findall(r'(?:href|src)="([^"]+)"', (out / "index.html").read_text())


def test_bench_plots_and_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = _results(tmp_path, ROWS)
    page = tmp_path / "mut.html"
    page.write_text("<html></html>")
    out = tmp_path / "out"
    assert plots.main([str(res), "--out", str(out), "--mutations", str(page)]) == 0
    assert "index.html" in capsys.readouterr().out
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["run.gemm.grouped_gemm_fp8_up.png", "run.gemm.grouped_gemm_fwd_up.png", "run.memory.png"]
    for p in out.glob("*.png"):
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size[0] >= 600
    links = _index_links(out)
    assert all(not Path(link).is_absolute() and (out / link).is_file() for link in links)
    assert set(pngs) <= set(links) and "../mut.html" in links
    index = (out / "index.html").read_text()
    assert "no MoE layer rows" in index


def test_moe_layer_rows_get_a_plot(tmp_path: Path) -> None:
    rows = [{"name": "moe_layer_fwd", "shape": SHAPE, "ms": 2.0, "tflops": 100.0, "flops": 2e11,
             "baselines": [{"name": "torch", "ms": 5.0}, {"name": "SonicMoE", "ms": 2.5}]}]
    out = tmp_path / "out"
    assert plots.main([str(_results(tmp_path, rows)), "--out", str(out)]) == 0
    assert (out / "run.moe.moe_layer_fwd.png").is_file()
    index = (out / "index.html").read_text()
    assert "no memory-bound rows" in index and "no compute-bound rows" in index


def test_file_without_results_is_noted(tmp_path: Path) -> None:
    ablate = tmp_path / "ablate.json"
    ablate.write_text(json.dumps({"provenance": {}, "notes": {}, "rows": {}}))
    out = tmp_path / "out"
    assert plots.main([str(ablate), "--out", str(out)]) == 0
    assert "no `results` list" in (out / "index.html").read_text() and not list(out.glob("*.png"))


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert plots.main([str(bad), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nmoe bench --out" in err
    assert plots.main(["--out", str(tmp_path / "o")]) == 2
    assert "--run" in capsys.readouterr().err
    assert plots.main([str(tmp_path / "none.json"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "f").write_text("")
    assert plots.main([str(_results(tmp_path, ROWS)), "--out", str(tmp_path / "f" / "o")]) == 1
    assert "writable --out" in capsys.readouterr().err


def _training_run(tmp_path: Path, router: bool = True) -> tuple[Path, str]:
    cfg = from_dict({"train": {"run_name": "t", "experiment": "e"},
                     "metrics": {"db_path": str(tmp_path / "x.sqlite"), "dir": str(tmp_path / "m")}}, env={})
    db = ExperimentsDB(cfg.metrics.db_path)
    db.start_run("t-1", cfg, world=1, resumed=False)
    db.close()
    w = MetricsWriter(cfg.metrics.dir, "t-1", 0)
    for step in range(1, 21):
        values = {"loss": 10.0 / step, "lr": 1e-3 * min(1.0, step / 5), "tokens_per_s": 1000.0 + step}
        if router:
            for layer in ("layers.1.ffn", "layers.2.ffn"):
                values |= {f"router/{layer}/max_load": 1.0 + 1 / step, f"router/{layer}/load_cv": 0.5 / step,
                           f"router/{layer}/entropy": 1.0 - 0.1 / step, f"router/{layer}/bias_range": 0.01}
                values |= {f"router/{layer}/load/{e}": (e + step) / (4 * step + 6) for e in range(4)}
        w.log(step, values)
    w.flush()
    return Path(cfg.metrics.db_path), "t-1"


def test_training_run_series_and_plots(tmp_path: Path) -> None:
    db, run = _training_run(tmp_path)
    series = plots.run_series(db, run, 0)
    assert series["loss"][:2] == [(1, 10.0), (2, 5.0)] and len(series["lr"]) == 20
    out = tmp_path / "out"
    assert plots.main(["--run", run, "--db", str(db), "--out", str(out)]) == 0
    assert {p.name for p in out.glob("*.png")} == {"t-1.training.png", "t-1.router.png", "t-1.experts.png"}
    links = _index_links(out)
    assert {"t-1.training.png", "t-1.router.png", "t-1.experts.png"} <= set(links)


def test_per_expert_load_heatmap_per_layer(tmp_path: Path) -> None:
    db, run = _training_run(tmp_path)
    loads = plots.expert_loads(plots.run_series(db, run, 0))
    assert sorted(loads) == ["layers.1.ffn", "layers.2.ffn"] and sorted(loads["layers.1.ffn"]) == [0, 1, 2, 3]
    assert loads["layers.1.ffn"][3][:2] == [(1, 0.4), (2, 5 / 14)]
    path = plots.plot_expert_load(loads, "t", tmp_path / "e.png")
    with Image.open(path) as im:
        assert im.size[1] > 400  # two layers stacked
    one = {"l": {0: [(5, 0.25)], 3: [(5, 0.75)]}}  # one logged step, experts 1-2 never logged
    assert plots.plot_expert_load(one, "t", tmp_path / "one.png").is_file()


def test_training_run_without_router_stats_is_noted(tmp_path: Path) -> None:
    db, run = _training_run(tmp_path, router=False)
    sections = plots.training_sections(plots.run_series(db, run, 0), run, tmp_path)
    notes = [e.text for s in sections for e in s.entries if e.target is None]
    assert notes == ["run t-1 logged no router stats (router/<layer>/<stat>)",
                     "run t-1 logged no per-expert load (router/<layer>/load/<expert>)"]


def test_unknown_run_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db, _ = _training_run(tmp_path)
    assert plots.main(["--run", "t-9", "--db", str(db), "--out", str(tmp_path / "o")]) == 1
    assert "nmoe runs" in capsys.readouterr().err
    assert plots.main(["--run", "t-1", "--db", str(tmp_path / "no.sqlite"), "--out", str(tmp_path)]) == 1
    assert "pass --db" in capsys.readouterr().err


def test_unreadable_metrics_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db, run = _training_run(tmp_path)
    parts = sorted((tmp_path / "m" / f"{run}.rank000").glob("*.parquet"))
    assert parts
    parts[0].write_bytes(b"\xff" * 4096)
    assert plots.main(["--run", run, "--db", str(db), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot read" in err


@pytest.mark.heavy
def test_index_opens_in_chromium(tmp_path: Path) -> None:
    chromium()
    db, run = _training_run(tmp_path)
    out = tmp_path / "out"
    assert plots.main([str(_results(tmp_path, ROWS)), "--run", run, "--db", str(db), "--out", str(out)]) == 0
    text = rendered_text(out / "index.html", tmp_path)
    assert text.startswith("broken-images=0\n"), text[:500]
    for title in ("run.json: memory-bound kernels", "run.json: grouped GEMM (TFLOP/s)",
                  "training run t-1", "router health, run t-1"):
        assert title in text.splitlines()
