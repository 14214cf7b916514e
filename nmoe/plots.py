"""`nmoe plots`: PNG plots of bench results and of a training run's metrics, and an index page linking them.

Figures are drawn with matplotlib's object API on the Agg canvas, so plotting needs no display and
changes no global backend.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Final

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from nmoe.index import Entry, Section, write_index

Row = Mapping[str, Any]
Series = dict[str, list[tuple[int, float]]]

NOT_TIMINGS: Final = frozenset({"not run", "error", "summary"})
DERIVED_SIZES: Final = frozenset({"M", "N", "Kred", "R", "align"})
MOE_LAYER_PREFIX: Final = "moe_layer"
TRAINING_TAGS: Final = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"),
                        ("mfu", "MFU"))
ROUTER_STATS: Final = (("max_load", "max load / mean load"), ("load_cv", "load CV (std / mean)"),
                       ("entropy", "load entropy / log E"))


class PlotError(Exception):
    """Input that cannot be plotted; the message names the fix."""


def _is_timing(row: Row) -> bool:
    ms = row.get("ms")
    return (isinstance(ms, int | float) and math.isfinite(ms) and ms > 0
            and row.get("status") not in NOT_TIMINGS and not str(row.get("name", "")).endswith("_eager_call"))


def kind(row: Row) -> str | None:
    """Which plot a timing row belongs to: the MoE layer, compute-bound (TFLOP/s) or memory-bound (TB/s)."""
    if not _is_timing(row):
        return None
    if str(row["name"]).startswith(MOE_LAYER_PREFIX):
        return "moe"
    if "tflops" in row:
        return "gemm"
    return "memory" if "frac_of_copy_ceiling" in row else None


def family(row: Row) -> str:
    """The benchmark without its routing suffix: one plot per family, one group per shape and routing."""
    name, routing = str(row["name"]), row.get("routing")
    return name[: -len(routing) - 1] if isinstance(routing, str) and name.endswith("_" + routing) else name


def shape_label(row: Row) -> str:
    shape = row.get("shape") or {}
    text = " ".join(f"{k}{v}" for k, v in shape.items() if k not in DERIVED_SIZES)
    routing = row.get("routing")
    return f"{text} {routing}" if isinstance(routing, str) else text


def measured_baselines(row: Row) -> list[tuple[str, float]]:
    """(name, ms) of every baseline the row measured (`baselines`, else its one `baseline`)."""
    out = []
    for b in row.get("baselines") or ([row["baseline"]] if row.get("baseline") else []):
        ms = b.get("ms")
        if isinstance(ms, int | float) and math.isfinite(ms) and ms > 0:
            out.append((str(b["name"]), float(ms)))
    return out


def dense_ceilings(rows: Sequence[Row], ceilings: Mapping[str, Any]) -> dict[str, float]:
    """The run's bf16 ceiling, plus any `<format>_dense_TFLOPs` its rows measured (e.g. fp8)."""
    found = {"bf16": ceilings.get("bf16_dense_TFLOPs")}
    for r in rows:
        found |= {k.removesuffix("_dense_TFLOPs"): v for k, v in r.items() if k.endswith("_dense_TFLOPs")}
    return {k: float(v) for k, v in found.items() if isinstance(v, int | float) and math.isfinite(v)}


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def _grouped_bars(ax: Axes, labels: Sequence[str], bars: Mapping[str, Sequence[float | None]],
                  lines: Mapping[str, float]) -> None:
    width = 0.8 / max(len(bars), 1)
    top = 0.0
    for i, (name, values) in enumerate(bars.items()):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.bar(xs, ys, width, label=name)
        top = max([top, *ys])
    for (name, value), color in zip(lines.items(), ("tab:red", "tab:purple", "tab:brown"), strict=False):
        ax.axhline(value, color=color, ls="--", lw=1, label=name)
        top = max(top, value)
    ax.set_ylim(0, 1.3 * top if top > 0 else 1)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.legend(fontsize=8, ncols=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)


def plot_memory(rows: Sequence[Row], ceiling_tbps: float, title: str, path: Path) -> Path:
    """Each memory-bound kernel's TB/s against the HBM copy ceiling measured in the same run."""
    labels = [f"{r['name']}  {shape_label(r)}" for r in rows]
    fig = Figure(figsize=(10, 2.5 + 0.28 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    ys = range(len(rows))
    ax.barh(ys, [float(r["tbps"]) for r in rows], color="tab:blue", label="nmoe")
    best = [(i, float(r["bytes"]) / (min(ms for _, ms in bl) * 1e-3) / 1e12)
            for i, r in enumerate(rows) if "bytes" in r and (bl := measured_baselines(r))]
    if best:
        ax.plot([v for _, v in best], [i for i, _ in best], "k|", markersize=10, zorder=3,
                label="fastest baseline (same bytes)")
    for i, r in enumerate(rows):
        ax.text(float(r["tbps"]), i, f" {100 * float(r['frac_of_copy_ceiling']):.0f}%", va="center",
                fontsize=7)
    ax.axvline(ceiling_tbps, color="tab:red", ls="--", label=f"HBM copy ceiling {ceiling_tbps:.2f} TB/s")
    ax.set_xlim(0, 1.12 * max(ceiling_tbps, *(float(r["tbps"]) for r in rows)))
    ax.set_yticks(ys, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("TB/s (label: fraction of the copy ceiling)")
    ax.set_title(title, fontsize=10)
    fig.legend(fontsize=8, loc="outside lower center", ncols=3)
    return _save(fig, path)


def plot_gemm(rows: Sequence[Row], ceilings: Mapping[str, float], title: str, path: Path) -> Path:
    """One GEMM family's TFLOP/s per shape against every measured baseline at the same FLOPs."""
    names = list(dict.fromkeys(n for r in rows for n, _ in measured_baselines(r)))
    bars: dict[str, list[float | None]] = {"nmoe": [float(r["tflops"]) for r in rows]}
    for n in names:
        bars[n] = [next((float(r["flops"]) / (ms * 1e-3) / 1e12 for b, ms in measured_baselines(r)
                         if b == n and "flops" in r), None) for r in rows]
    fig = Figure(figsize=(10, 5), layout="constrained")
    ax = fig.add_subplot()
    _grouped_bars(ax, [shape_label(r) for r in rows], bars,
                  {f"{k} dense ceiling {v:.0f} TFLOP/s": v for k, v in ceilings.items()})
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def plot_moe(rows: Sequence[Row], title: str, path: Path) -> Path:
    """The MoE layer's time per shape against each baseline (lower is better)."""
    names = list(dict.fromkeys(n for r in rows for n, _ in measured_baselines(r)))
    bars: dict[str, list[float | None]] = {"nmoe": [float(r["ms"]) for r in rows]}
    for n in names:
        bars[n] = [next((ms for b, ms in measured_baselines(r) if b == n), None) for r in rows]
    fig = Figure(figsize=(10, 5), layout="constrained")
    ax = fig.add_subplot()
    _grouped_bars(ax, [shape_label(r) for r in rows], bars, {})
    ax.set_ylabel("ms per call (lower is better)")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def load_results(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlotError(f"cannot read {path} ({e}); pass a results file of `nmoe bench --out`") from e
    if not isinstance(doc, dict):
        raise PlotError(f"{path} holds no JSON object; pass a results file of `nmoe bench --out`")
    return doc


def bench_sections(path: Path, out: Path) -> list[Section]:
    """Plots of one results file, one section per kind; a kind without rows gets a line saying so."""
    doc = load_results(path)
    stem, rows = slug(path.stem), doc.get("results")
    if not isinstance(rows, list):
        return [Section(path.name, (Entry("no `results` list (not a `nmoe bench --out` file); "
                                          "nothing plotted"),))]
    ceil = doc.get("ceilings") or {}
    by: dict[str, dict[str, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if (k := kind(r)) is not None:
            by[k][family(r)].append(r)
    memory = [r for fam in by["memory"].values() for r in fam]
    mem_entries = [Entry("no memory-bound rows (rows with `tbps` and `frac_of_copy_ceiling`)")]
    if memory and isinstance(ceil.get("hbm_copy_TBps"), int | float):
        p = plot_memory(memory, float(ceil["hbm_copy_TBps"]), f"{path.name}: memory-bound kernels",
                        out / f"{stem}.memory.png")
        mem_entries = [Entry("memory-bound kernels vs the HBM copy ceiling", p, image=True)]
    elif memory:
        mem_entries = [Entry("memory-bound rows but no `ceilings.hbm_copy_TBps`; nothing plotted")]
    gemm = [Entry(f"{fam} vs its baselines", plot_gemm(fr, dense_ceilings(fr, ceil), f"{path.name}: {fam}",
                                                       out / f"{stem}.gemm.{slug(fam)}.png"), image=True)
            for fam, fr in by["gemm"].items()]
    moe = [Entry(f"{fam} vs its baselines", plot_moe(fr, f"{path.name}: {fam}",
                                                     out / f"{stem}.moe.{slug(fam)}.png"), image=True)
           for fam, fr in by["moe"].items()]
    return [
        Section(f"{path.name}: memory-bound kernels", tuple(mem_entries)),
        Section(f"{path.name}: grouped GEMM (TFLOP/s)", tuple(gemm) or (Entry("no compute-bound rows"),)),
        Section(f"{path.name}: MoE layer", tuple(moe) or (
            Entry(f"no MoE layer rows (`{MOE_LAYER_PREFIX}*`) in this file; nothing plotted"),)),
    ]


def run_series(db: Path, run_id: str, rank: int) -> Series:
    """tag -> [(step, value)] of one run and rank: the one place plots read the trainer's metrics."""
    import duckdb

    from nmoe.train.metrics import ExperimentsDB, series
    from nmoe.train.metricstore import rank_dir

    if not db.is_file():
        raise PlotError(f"no experiments db at {db}; pass --db (the config's metrics.db_path)")
    exp = ExperimentsDB(db)
    try:
        runs = {r["id"]: r for r in exp.runs()}
    finally:
        exp.close()
    if run_id not in runs:
        raise PlotError(f"no run {run_id!r} in {db}; list runs with `nmoe runs --db {db}`")
    path = rank_dir(runs[run_id]["metrics_dir"], run_id, rank)
    if not path.is_dir():
        raise PlotError(f"{path} missing (rank {rank} of run {run_id} wrote no metrics)")
    try:
        return series(path, run_id)
    except duckdb.Error as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PlotError(f"cannot read {path} ({first}); check the run's metrics parts") from e


def _steps_figure(panels: Sequence[tuple[str, Mapping[str, list[tuple[int, float]]]]], title: str,
                  path: Path) -> Path:
    fig = Figure(figsize=(10, 2.6 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (ylabel, lines) in zip(axes, panels, strict=True):
        for name, points in lines.items():
            ax.plot([s for s, _ in points], [v for _, v in points], label=name, lw=1)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=7, ncols=min(len(lines), 4))
    axes[-1].set_xlabel("step")
    axes[0].set_title(title, fontsize=10)
    return _save(fig, path)


def expert_loads(series: Series) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """layer -> expert -> [(step, share of the layer's routed tokens)], from `router/<layer>/load/<e>`."""
    out: dict[str, dict[int, list[tuple[int, float]]]] = defaultdict(dict)
    for tag, points in series.items():
        parts = tag.split("/")
        if len(parts) == 4 and parts[0] == "router" and parts[2] == "load" and parts[3].isdigit() and points:
            out[parts[1]][int(parts[3])] = points
    return dict(out)


def plot_expert_load(loads: Mapping[str, Mapping[int, list[tuple[int, float]]]], title: str,
                     path: Path) -> Path:
    """One heatmap per MoE layer: expert x logged step, coloured by load / mean load (1 is balanced)."""
    fig = Figure(figsize=(10, 0.6 + 2.4 * len(loads)), layout="constrained")
    axes = fig.subplots(len(loads), 1, squeeze=False)[:, 0]
    for ax, (layer, experts) in zip(axes, sorted(loads.items()), strict=True):
        steps = sorted({s for pts in experts.values() for s, _ in pts})
        col = {s: j for j, s in enumerate(steps)}
        grid = np.full((max(experts) + 1, len(steps)), np.nan)
        for e, pts in experts.items():
            for s, v in pts:
                grid[e, col[s]] = v * grid.shape[0]
        mids = [(a + b) / 2 for a, b in itertools.pairwise(steps)]
        edges = [2 * steps[0] - mids[0] if mids else steps[0] - 0.5, *mids,
                 2 * steps[-1] - mids[-1] if mids else steps[-1] + 0.5]
        top = max(2.0, float(np.nanmax(grid)))
        mesh = ax.pcolormesh(edges, np.arange(grid.shape[0] + 1) - 0.5, np.ma.masked_invalid(grid),
                             cmap="coolwarm", vmin=0.0, vmax=top)
        ax.invert_yaxis()
        fig.colorbar(mesh, ax=ax, label="load / mean")
        ax.set_ylabel(f"{layer}\nexpert", fontsize=9)
    axes[-1].set_xlabel("step")
    axes[0].set_title(title, fontsize=10)
    return _save(fig, path)


def training_sections(series: Series, run_id: str, out: Path) -> list[Section]:
    """Loss, lr and tokens/s over steps; per-layer router load and per-expert load over steps (the router's
    health)."""
    stem = slug(run_id)
    panels = [(label, {tag: series[tag]}) for tag, label in TRAINING_TAGS if series.get(tag)]
    train = [Entry("loss, lr, tokens/s and MFU over steps", _steps_figure(
        panels, f"run {run_id}", out / f"{stem}.training.png"), image=True)] if panels else [
        Entry(f"run {run_id} logged none of {', '.join(t for t, _ in TRAINING_TAGS)}")]
    router: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(dict)
    for tag, points in series.items():
        parts = tag.split("/")
        if len(parts) == 3 and parts[0] == "router" and points:
            router[parts[2]][parts[1]] = points
    rpanels = [(label, router[stat]) for stat, label in ROUTER_STATS if router.get(stat)]
    health = [Entry("per-layer expert load over steps", _steps_figure(
        rpanels, f"run {run_id}: router health", out / f"{stem}.router.png"), image=True)] if rpanels else [
        Entry(f"run {run_id} logged no router stats (router/<layer>/<stat>)")]
    loads = expert_loads(series)
    health.append(Entry("per-expert load over steps, one heatmap per MoE layer", plot_expert_load(
        loads, f"run {run_id}: per-expert load", out / f"{stem}.experts.png"), image=True) if loads
        else Entry(f"run {run_id} logged no per-expert load (router/<layer>/load/<expert>)"))
    return [Section(f"training run {run_id}", tuple(train)), Section(f"router health, run {run_id}",
                                                                      tuple(health))]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nmoe plots", description="plot bench results and a training run's "
                                 "metrics as PNGs, with an index.html linking them")
    ap.add_argument("results", nargs="*", type=Path, help="results files of `nmoe bench --out`")
    ap.add_argument("--out", type=Path, required=True, help="directory for the PNGs and index.html")
    ap.add_argument("--run", default=None, help="a training run id (see `nmoe runs`) to plot")
    ap.add_argument("--db", type=Path, default=None, help="SQLite experiments db (the config's "
                    "metrics.db_path; default runs/experiments.sqlite)")
    ap.add_argument("--rank", type=int, default=0, help="whose metrics to plot (default 0)")
    ap.add_argument("--mutations", type=Path, action="append", default=[],
                    help="a page of `nmoe mutate-html` to link from the index (repeatable)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.results and args.run is None:
        print("nmoe plots: nothing to plot; pass results files and/or --run RUN_ID", file=sys.stderr)
        return 2
    missing = [str(p) for p in [*args.results, *args.mutations] if not p.is_file()]
    if missing:
        print(f"nmoe plots: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    jobs: list[Callable[[], list[Section]]] = [partial(bench_sections, p, args.out) for p in args.results]
    if args.run is not None:
        from nmoe.config import MetricsConfig

        db = args.db or Path(MetricsConfig().db_path)
        jobs.append(lambda: training_sections(run_series(db, args.run, args.rank), args.run, args.out))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        sections = [s for job in jobs for s in job()]
    except PlotError as e:
        print(f"nmoe plots: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nmoe plots: cannot write into {args.out} ({e}); pass a writable --out", file=sys.stderr)
        return 1
    if args.mutations:
        sections.append(Section("mutation reports", tuple(Entry(p.name, p) for p in args.mutations)))
    index = write_index(args.out / "index.html", "nmoe plots", sections,
                        "Bench plots use the ceilings measured in the same run as their rows.")
    print(f"nmoe plots: wrote {index}")
    return 0
