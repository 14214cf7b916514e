"""The parity run: every case of every selected op in the chosen mode, the "not run" rows for what could not
execute here, and the sm_90a/sm_100a compile rows, assembled into one report."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

import hypothesis
import torch

from nmoe.fast import compilecheck
from nmoe.fast.arch import arch_of
from nmoe.provenance import provenance
from parity import report as rep
from parity.cases import Case, build, make_cases
from parity.compiles import selection
from parity.execute import Outcome, fail, not_run, parity_case, selfcheck_case
from parity.inputs import Inputs
from parity.registry import (
    ARCHS,
    CPU,
    REGISTRY,
    OpEntry,
    fast_declared,
    resolve_fast,
    resolve_reference,
    select,
)

THREADS = os.cpu_count() or 1


@dataclass(frozen=True)
class Options:
    ops: tuple[str, ...] = ()
    arch: str | None = None
    mode: str = "selfcheck"
    device: str = "cuda"
    seed: int = 0
    cases: int = 3
    compile: bool = True
    quiet: bool = False
    jobs: int = 1


class Progress:
    """Stderr progress for long runs: silent for the first seconds, one line per op after that."""

    def __init__(self, total: int, quiet: bool, stream: TextIO = sys.stderr) -> None:
        self.total, self.quiet, self.stream = total, quiet, stream
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()

    def op(self, i: int, name: str, n_cases: int) -> None:
        dt = time.perf_counter() - self.t0
        if self.quiet or dt < 3.0:
            return
        line = f"[parity] {i}/{self.total} ops  {dt:6.1f}s  {name} ({n_cases} cases)"
        self.stream.write(("\r" + line.ljust(78)) if self.tty else line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and not self.quiet and time.perf_counter() - self.t0 >= 3.0:
            self.stream.write("\n")


def _row(
    entry: OpEntry, arch: str, mode: str, case: Case, inp: Inputs | None, out: Outcome, secs: float
) -> dict[str, Any]:
    shape = (
        dict(inp.shape)
        if inp is not None
        else {k: v for k, v in case.params.items() if k not in ("seed", "dtype")}
    )
    return {
        "op": entry.name,
        "contract": entry.label(arch),
        "arch": arch,
        "dtype": (inp.dtype if inp is not None and inp.dtype else case.params.get("dtype", "")),
        "shape": shape,
        "seed": int(case.params.get("seed", 0)),
        "status": out.status,
        "worst": {k: float(v) for k, v in out.verdict.worst.items()},
        "reason": out.reason,
        "case": case.name,
        "mode": mode,
        "seconds": round(secs, 4),
    }


def run_entry(entry: OpEntry, opts: Options, arch: str) -> list[dict[str, Any]]:
    """All cases of one op in the chosen mode."""
    mode = opts.mode
    cases = make_cases(entry, opts.cases, opts.seed, big=mode == "parity" and opts.device != "cpu")
    rows: list[dict[str, Any]] = []
    row_arch = CPU if mode == "selfcheck" else arch
    ref, why = resolve_reference(entry)
    fast: Callable[..., Any] | None = None
    fast_why = ""
    if mode == "parity":
        if arch not in entry.archs:
            why_arch = f"contract defined for {', '.join(entry.archs)} only; this run is {arch}"
            return [_row(entry, arch, mode, c, None, not_run(why_arch), 0.0) for c in cases]
        try:
            fast, fast_why = resolve_fast(entry)
        except Exception as e:
            return [
                _row(
                    entry,
                    arch,
                    mode,
                    c,
                    None,
                    fail(f"importing the fast module raised {type(e).__name__}: {e}"),
                    0.0,
                )
                for c in cases
            ]
    for case in cases:
        if ref is None:
            rows.append(_row(entry, row_arch, mode, case, None, not_run(why), 0.0))
            continue
        if mode == "parity" and fast is None:
            rows.append(_row(entry, row_arch, mode, case, None, not_run(fast_why), 0.0))
            continue
        t0 = time.perf_counter()
        try:
            inp = build(entry, case)
        except ModuleNotFoundError as e:
            rows.append(
                _row(entry, row_arch, mode, case, None, not_run(f"input builder needs {e.name}"), 0.0)
            )
            continue
        except Exception as e:
            rows.append(
                _row(
                    entry,
                    row_arch,
                    mode,
                    case,
                    None,
                    fail(f"input builder raised {type(e).__name__}: {e}"),
                    0.0,
                )
            )
            continue
        if mode == "parity":
            assert fast is not None
            out = parity_case(entry, ref, fast, inp, arch, opts.device)
        else:
            out = selfcheck_case(entry, ref, inp)
        rows.append(_row(entry, row_arch, mode, case, inp, out, time.perf_counter() - t0))
    return rows


def fast_not_run_rows(entry: OpEntry, archs: Sequence[str], reason: str) -> list[dict[str, Any]]:
    """CPU mode: one "not run" row per (op, arch), so the report shows fast execution did not happen."""
    rows = []
    for arch in archs:
        if arch not in entry.archs:
            continue
        why = reason if fast_declared(entry) else "no fast implementation"
        case = Case("fast/*", {}, None)
        rows.append(_row(entry, arch, "parity", case, None, not_run(why), 0.0))
        rows[-1]["dtype"] = ",".join(entry.dtypes)
    return rows


def detect_arch() -> tuple[str | None, str]:
    if not torch.cuda.is_available():
        return None, "no CUDA device on this host"
    cap = torch.cuda.get_device_capability()
    arch = arch_of(cap)
    return arch, "" if arch else f"GPU sm_{cap[0]}{cap[1]} is none of {', '.join(ARCHS)}"


def _entry_rows(name: str, opts: Options, arch: str, archs: Sequence[str]) -> list[dict[str, Any]]:
    """One op's rows, by registry name (what a worker process receives)."""
    if opts.mode == "selfcheck" or opts.jobs > 1:
        torch.set_num_threads(1 if opts.mode == "selfcheck" else max(1, THREADS // opts.jobs))
    entry = REGISTRY[name]
    rows = run_entry(entry, opts, arch)
    if opts.mode == "selfcheck":
        rows += fast_not_run_rows(entry, archs, "no CUDA device: fast path not executed")
    return rows


def _run_entries(entries: Sequence[OpEntry], opts: Options, arch: str, archs: Sequence[str],
                 progress: Progress) -> list[dict[str, Any]]:
    """Ops one after the other, or over opts.jobs spawned processes (each op whole in one of them, the rows
    in registry order either way): the oracles' float64 math is CPU-bound, one process per core."""
    if opts.jobs <= 1 or len(entries) <= 1:
        rows: list[dict[str, Any]] = []
        for i, entry in enumerate(entries, 1):
            progress.op(i, entry.name, opts.cases + len(entry.adversarial) * len(entry.dtypes))
            rows += _entry_rows(entry.name, opts, arch, archs)
        return rows
    with ProcessPoolExecutor(max_workers=opts.jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_entry_rows, e.name, opts, arch, list(archs)) for e in entries]
        done: list[list[dict[str, Any]]] = []
        for i, (entry, fut) in enumerate(zip(entries, futures, strict=True), 1):
            done.append(fut.result())
            progress.op(i, entry.name, len(done[-1]))
    return [r for rows_ in done for r in rows_]


def run(opts: Options, command: str = "nmoe parity") -> dict[str, Any]:
    """Execute the selected contracts and return the report (not yet written anywhere)."""
    entries = select(list(opts.ops) or None)
    archs = [opts.arch] if opts.arch else list(ARCHS)
    t0 = time.perf_counter()
    sel = selection(entries, bool(opts.ops)) if opts.compile else None
    procs = compilecheck.spawn(archs, sel) if sel is not None else []
    threads = torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    progress = Progress(len(entries), opts.quiet)
    try:
        gpu_arch, gpu_why = (None, "") if opts.mode == "selfcheck" else (opts.arch, "")
        if opts.mode == "parity" and opts.device != "cpu":
            detected, gpu_why = detect_arch()
            gpu_arch = opts.arch or detected
            if detected is None or (opts.arch and opts.arch != detected):
                gpu_why = gpu_why or f"this GPU is {detected}, not the requested {opts.arch}"
                gpu_arch = None
        if opts.mode == "parity" and gpu_arch is None:
            for entry in entries:
                rows += [
                    _row(entry, opts.arch or "sm_90a", "parity", c, None, not_run(gpu_why), 0.0)
                    for c in make_cases(entry, opts.cases, opts.seed, big=False)
                ]
        else:
            rows = _run_entries(entries, opts, gpu_arch or CPU, archs, progress)
    finally:
        torch.set_num_threads(threads)
        progress.done()
    compile_rows = compilecheck.collect(procs, t0)
    run_info = {
        "mode": opts.mode,
        "arch": opts.arch,
        "device": opts.device if opts.mode == "parity" else "cpu",
        "seed": opts.seed,
        "cases_per_op": opts.cases,
        "jobs": opts.jobs,
        "ops": list(opts.ops),
        "hypothesis": hypothesis.__version__,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return rep.build(provenance(command), rows, compile_rows, run_info)
