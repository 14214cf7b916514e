"""Benchmark harness: CUDA-event timing (median of warm runs), ceilings measured in the same run, JSON out."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nmoe.provenance import provenance

WARMUP = int(os.environ.get("NMOE_BENCH_WARMUP", "5"))
REPS = int(os.environ.get("NMOE_BENCH_REPS", "20"))
_RESULTS: list[dict[str, Any]] = []
_CEILINGS: dict[str, float] = {}


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
    """Add one result row (DESIGN.md bench schema); the floor comes from the bytes/FLOPs and the ceilings."""
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
    _RESULTS.append(row)
    return row


@pytest.fixture(scope="session", autouse=True)
def _require_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("benchmarks need a CUDA GPU: not run")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("NMOE_BENCH_OUT")
    if not out or not _RESULTS:
        return
    doc = {"provenance": provenance(), "ceilings": _CEILINGS, "results": _RESULTS}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2) + "\n")
