"""Benchmark harness: CUDA-event timing (median of warm runs), ceilings measured in the same run, JSON out."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nmoe.provenance import provenance

WARMUP = int(os.environ.get("NMOE_BENCH_WARMUP", "5"))
REPS = int(os.environ.get("NMOE_BENCH_REPS", "20"))
REPLAYS = int(os.environ.get("NMOE_BENCH_REPLAYS", "3"))
EAGER_CALLS = int(os.environ.get("NMOE_BENCH_EAGER_CALLS", "10"))
COMPILE = os.environ.get("NMOE_BENCH_COMPILE", "1") != "0"
NO_GPU = "torch sees no CUDA GPU, and the benchmarks time CUDA kernels"
_RESULTS: list[dict[str, Any]] = []
_CEILINGS: dict[str, float] = {}
_PROVENANCE: dict[str, Any] = {}


def cuda_median_ms(fn: Callable[[], object], warmup: int = WARMUP, reps: int = REPS) -> float:
    """Median over `reps` CUDA-event-timed calls after `warmup` calls, L2 flushed between calls."""
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra_bytes(step: Callable[[], object]) -> int:
    """Peak bytes allocated by one call of `step` above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def ceilings() -> dict[str, float]:
    """HBM copy TB/s and bf16 dense TFLOP/s on random normal data, measured once per run."""
    if not _CEILINGS:
        n = 2 * 2**30
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        ms = cuda_median_ms(lambda: dst.copy_(src))
        _CEILINGS["hbm_copy_TBps"] = 2 * n / (ms * 1e-3) / 1e12
        del src, dst
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ms = cuda_median_ms(lambda: a @ b)
        _CEILINGS["bf16_dense_TFLOPs"] = 2 * 8192**3 / (ms * 1e-3) / 1e12
    return _CEILINGS


def record(
    name: str,
    shape: dict[str, int],
    ms: float,
    *,
    nbytes: float | None = None,
    flops: float | None = None,
    baseline: tuple[str, float] | None = None,
) -> dict[str, Any]:
    """Add one result row (docs/reports.md); the floor comes from the bytes/FLOPs and the ceilings."""
    ceil = ceilings()
    row: dict[str, Any] = {"name": name, "shape": shape, "ms": ms}
    floors = []
    if nbytes is not None:
        row["tbps"] = nbytes / (ms * 1e-3) / 1e12
        row["bytes"] = nbytes
        floors.append(nbytes / (ceil["hbm_copy_TBps"] * 1e12) * 1e3)
        row["frac_of_copy_ceiling"] = row["tbps"] / ceil["hbm_copy_TBps"]
    if flops is not None:
        row["tflops"] = flops / (ms * 1e-3) / 1e12
        row["flops"] = flops
        floors.append(flops / (ceil["bf16_dense_TFLOPs"] * 1e12) * 1e3)
    row["floor_ms"] = max(floors) if floors else None
    if baseline is not None:
        row["baseline"] = {"name": baseline[0], "ms": baseline[1]}
        row["speedup"] = baseline[1] / ms
    return append_row(row)


def append_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row that is no timing (an op not run, a summary) goes in the same results file, with ms None."""
    row.setdefault("ms", None)
    _RESULTS.append(row)
    _write()
    return row


def capture(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`step` run once eagerly on a side stream (compiles kernels, warms the allocator), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def nvtx_probe(fn: Callable[[], object], warm: int = 3) -> None:
    """`warm` calls, then one alone inside the NVTX range "probe", for ncu --nvtx --nvtx-include probe/."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("probe")  # type: ignore[no-untyped-call]
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]


def sustained_ms(fn: Callable[[], object], replays: int = REPLAYS, reps: int = REPS) -> float:
    """GPU ms per call of `replays` back-to-back calls per L2-flushed sample: the GPU runs under load as in
    training, where a lone call after a sync can run at clocks the 700 W cap does not sustain."""

    def run() -> None:
        for _ in range(replays):
            fn()

    return cuda_median_ms(run, reps=reps) / replays


def replay_median_ms(graph: torch.cuda.CUDAGraph, calls: int = 1, replays: int = REPLAYS,
                     reps: int = REPS) -> float:
    """GPU ms per op call: sustained_ms of a `calls`-call graph's replays."""
    return sustained_ms(graph.replay, replays, reps) / calls


def eager_call_ms(step: Callable[[], object], calls: int = 1, samples: int = 5) -> tuple[float, float]:
    """(stream ms, host ms) per op call over >= EAGER_CALLS back-to-back eager calls: shows host overhead."""
    repeat = max(1, -(-EAGER_CALLS // calls))
    step()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    stream, host = [], []
    for _ in range(samples):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(repeat):
            step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        stream.append(start.elapsed_time(end))
    n = repeat * calls
    return statistics.median(stream) / n, statistics.median(host) / n


def _why(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def try_compile(fn: Callable[..., Any], *warm_args: Any) -> tuple[Callable[..., Any] | None, str]:
    """(torch.compile(fn) run once on warm_args, note), or (None, why): a failed compile never fails a run."""
    if not COMPILE:
        return None, "skipped: NMOE_BENCH_COMPILE=0"
    t0 = time.perf_counter()
    try:
        cfn = torch.compile(fn, dynamic=False)
        cfn(*warm_args)
        torch.cuda.synchronize()
    except Exception as e:
        return None, f"torch.compile failed: {_why(e)}"
    return cfn, f"compiled in {time.perf_counter() - t0:.1f} s"


def baseline(name: str, step: Callable[[], object] | None, calls: int = 1, note: str = "",
             reps: int = REPS) -> dict[str, Any]:
    """A CUDA-graph-timed baseline entry; an absent step, or one failing to capture, is recorded missing."""
    if step is None:
        return {"name": name, "ms": None, "missing": note}
    try:
        ms = replay_median_ms(capture(step), calls, reps=reps)
    except Exception as e:
        return {"name": name, "ms": None, "missing": f"CUDA graph capture/replay failed: {_why(e)}"}
    return {"name": name, "ms": ms, "timing": "cuda_graph", "note": note}


def record_vs(
    name: str, shape: dict[str, int], ms: float, *, nbytes: float, baselines: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """record() against the fastest measured baseline; every baseline, measured or missing, is kept."""
    measured = [b for b in baselines if b["ms"] is not None]
    best = min(measured, key=lambda b: float(b["ms"])) if measured else None
    pick = None if best is None else (str(best["name"]), float(best["ms"]))
    row = record(name, shape, ms, nbytes=nbytes, baseline=pick)
    row.setdefault("baseline", None)
    row.setdefault("speedup", None)
    row["baselines"] = baselines
    row.update(extra)
    return row


def measure_op(
    benchmark: Any, name: str, shape: dict[str, int], nbytes: float, fast: Callable[[], object],
    torch_eager: Callable[[], object], torch_compiled: Callable[[], object] | None, compile_note: str,
    calls: int = 1, **extra: Any,
) -> dict[str, Any]:
    """Rows `name` (CUDA-graph GPU time vs the fastest torch baseline) and `name`_eager_call (eager stream
    time per call, host launch cost included, vs torch eager); pytest-benchmark times a synced replay."""
    graph = capture(fast)
    ms = replay_median_ms(graph, calls)
    eager_ms, host_ms = eager_call_ms(fast, calls)
    torch_ms, torch_host_ms = eager_call_ms(torch_eager, calls)
    baselines = [baseline("torch_eager", torch_eager, calls),
                 baseline("torch.compile", torch_compiled, calls, compile_note)]
    row = record_vs(name, shape, ms, nbytes=nbytes, baselines=baselines, **extra)
    record_vs(f"{name}_eager_call", shape, eager_ms, nbytes=nbytes, host_ms=host_ms,
              baselines=[{"name": "torch_eager", "ms": torch_ms, "timing": "eager",
                          "host_ms": torch_host_ms}])
    benchmark.extra_info.update(row)

    def run() -> None:
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    return row


def mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """None if got == want within atol + rtol*|want| (exact when both are 0), else a one-line summary."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    if rtol == 0.0 and atol == 0.0:
        bad = int((got != want).sum())
    else:
        g, w = got.float(), want.float()
        bad = int(((g - w).abs() > atol + rtol * w.abs()).sum() + (g.isnan() != w.isnan()).sum())
    return None if bad == 0 else f"{bad} of {got.numel()} elements differ beyond rtol={rtol}, atol={atol}"


@pytest.fixture(scope="session", autouse=True)
def _require_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without a GPU the results file still names every selected benchmark, each "not run" with why."""
    if torch.cuda.is_available():
        return
    for item in session.items:
        _RESULTS.append({"name": item.name, "shape": {}, "ms": None, "status": "not run", "reason": NO_GPU})
    _write()


def _write() -> None:
    """Rewritten after every row, so a run stopped early still leaves what it measured."""
    out = os.environ.get("NMOE_BENCH_OUT")
    if not out or not _RESULTS:
        return
    if not _PROVENANCE:
        _PROVENANCE.update(provenance(os.environ.get("NMOE_BENCH_COMMAND")))
    doc = {"provenance": _PROVENANCE, "ceilings": _CEILINGS, "results": _RESULTS}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2) + "\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write()
