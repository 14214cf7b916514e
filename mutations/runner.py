"""`nmoe mutate`: baseline, forced-fail sanity mutant, then every selected catalog mutant in parallel.

Exit 0 only when the baseline passes, the sanity mutant dies and every executed mutant is killed;
1 otherwise; 2 for usage or catalog errors (unknown glob, anchor not matching exactly once, no CUDA).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mutations.execute import OUTCOME_PLUGIN, PYTEST_FLAGS, SANITY_ID, PytestRun, in_copy, sanity_source
from mutations.model import MutantResult, Mutation, apply, check_anchors
from mutations.report import build, summary, write
from nmoe.checkout import CheckoutError, require_test_extra, source_dir
from nmoe.outpaths import UnwritableError, require_writable
from nmoe.provenance import provenance

GPU_NOT_RUN = "device gpu: executed only by `nmoe mutate --device gpu` on a CUDA host"
DEFAULT_REPORT = {"cpu": "mutations/reports/cpu-latest.json", "gpu": "mutations/reports/gpu-latest.json"}


def load_catalog(spec: str | None) -> tuple[tuple[Mutation, ...], dict[str, tuple[str, ...]]]:
    """CATALOG (and optional TESTS_BY_FILE) from mutations.catalog or from a .py file path."""
    if spec is None:
        mod: Any = importlib.import_module("mutations.catalog")
    else:
        path = Path(spec)
        loader_spec = importlib.util.spec_from_file_location(f"_nmoe_catalog_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"cannot load catalog {spec!r}: give a .py file that defines CATALOG")
        mod = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(mod)
    catalog = tuple(getattr(mod, "CATALOG", ()))
    mapping = dict(getattr(mod, "TESTS_BY_FILE", {}))
    return catalog, mapping


def tests_for(m: Mutation, mapping: Mapping[str, tuple[str, ...]], root: Path) -> tuple[str, ...]:
    """Declared tests, else the recorded file -> tests mapping, else tests/test_<module>.py by name."""
    if m.tests:
        return m.tests
    if m.file in mapping:
        return tuple(mapping[m.file])
    p = Path(m.file)
    guess = f"tests/test_fast_{p.stem}.py" if "fast" in p.parts else f"tests/test_{p.stem}.py"
    return (guess,) if (root / guess).is_file() else ()


def select(catalog: Sequence[Mutation], only: str | None) -> list[Mutation]:
    if only is None:
        return list(catalog)
    globs = [g.strip() for g in only.split(",") if g.strip()]
    return [m for m in catalog if any(fnmatch.fnmatchcase(m.id, g) for g in globs)]


def _cuda_available() -> bool:
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=120, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def classify(m: Mutation, run: PytestRun | None, compile_msg: str | None, timeout: float) -> MutantResult:
    if run is None:
        return MutantResult(m, "CompileError", f"mutated {m.file} does not compile: {compile_msg}")
    first = next((msg for msg in run.messages if msg), "")
    if run.timed_out:
        r = MutantResult(m, "Timeout", f"tests still running after {timeout:g} s")
    elif run.collection_error or (run.returncode == 2 and run.ran == 0):
        why = first or "collection error"
        r = MutantResult(m, "CompileError", f"tests could not import the mutated code: {why}",
                         killed_by=run.failing)
    elif run.returncode == 1:
        r = MutantResult(m, "Killed", (run.details or [first or "test failed"])[0], killed_by=run.failing,
                         failed=run.counts.get("failed", 0) + run.counts.get("errors", 0),
                         assertions=run.assertions)
    elif run.returncode == 0 and run.counts.get("passed", 0) > 0:
        r = MutantResult(m, "Survived", f"all {run.ran} selected tests passed on the mutant")
    elif run.returncode in (0, 5):
        r = MutantResult(m, "NoCoverage",
                         f"no selected test ran (all skipped, deselected or none collected: {run.counts})")
    else:
        r = MutantResult(m, "RuntimeError", f"pytest exited {run.returncode}: {run.tail(300)}")
    r.seconds, r.ran, r.output_tail = run.seconds, run.ran, run.tail()
    return r


def _union(selections: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    out: dict[str, None] = {}
    for sel in selections:
        out.update(dict.fromkeys(sel))
    return tuple(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nmoe mutate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated globs over mutation ids, e.g. 'relu2.*,combine.*'")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="cpu runs device=cpu mutants and lists gpu ones as not run; gpu runs both")
    p.add_argument("--report", help="report path FILE.json (markdown twin FILE.md); default "
                   "mutations/reports/<device>-latest.json")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run in parallel")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant test run")
    p.add_argument("--catalog", help="a .py file defining CATALOG (default: the mutations.catalog package)")
    p.add_argument("--root", help="tree to copy and mutate (default: this repository)")
    p.add_argument("--list", action="store_true", help="print the selected catalog entries and exit")
    p.add_argument("--check", action="store_true", help="only check that every anchor matches exactly once")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argl = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argl)
    args.command = "nmoe mutate " + " ".join(argl)
    if args.jobs < 1 or args.timeout <= 0:
        print("nmoe mutate: --jobs must be >= 1 and --timeout > 0", file=sys.stderr)
        return 2
    try:
        catalog, mapping = load_catalog(args.catalog)
    except (ValueError, ImportError, OSError) as e:
        print(f"nmoe mutate: {e}", file=sys.stderr)
        return 2
    chosen = select(catalog, args.only)
    if not chosen:
        print(f"nmoe mutate: no catalog entry matches --only {args.only!r}; see --list", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.id:<40} {m.device:<4} {m.file}  {m.description}")
        return 0
    try:
        root = Path(args.root).resolve() if args.root else source_dir("nmoe mutate", "tests").parent
        if not args.check:
            require_test_extra("nmoe mutate", ("pytest", "ml_dtypes"))
    except CheckoutError as e:
        print(f"nmoe mutate: {e}", file=sys.stderr)
        return 2
    problems = check_anchors(root, tuple(chosen))
    selections = {m.id: tests_for(m, mapping, root) for m in chosen}
    problems += [f"mutation {m.id}: no tests; declare `tests` or map {m.file} in TESTS_BY_FILE"
                 for m in chosen if not selections[m.id]]
    if problems:
        print("nmoe mutate: catalog does not fit the source:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    print(f"nmoe mutate: {len(chosen)} anchors match exactly once")
    if args.check:
        return 0
    args.out = Path(args.report) if args.report else root / DEFAULT_REPORT[args.device]
    try:
        for path in (args.out, args.out.with_suffix(".md")):
            require_writable("--report", path)
    except UnwritableError as e:
        print(f"nmoe mutate: {e}", file=sys.stderr)
        return 2
    if args.device == "gpu" and not _cuda_available():
        print("nmoe mutate: --device gpu needs a CUDA GPU visible to torch; run on a GPU host or use "
              "--device cpu", file=sys.stderr)
        return 2
    return _run(args, root, chosen, selections)


def _run(args: argparse.Namespace, root: Path, chosen: list[Mutation],
         selections: dict[str, tuple[str, ...]]) -> int:
    t_start = time.perf_counter()
    runnable = [m for m in chosen if m.device == "cpu" or args.device == "gpu"]
    jobs = max(1, min(args.jobs, len(runnable) + 1))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    timeout = float(args.timeout)
    sources = {m.file: (root / m.file).read_text(encoding="utf-8") for m in chosen}
    results: dict[str, MutantResult] = {
        m.id: MutantResult(m, "Ignored", GPU_NOT_RUN) for m in chosen if m not in runnable
    }
    lock = threading.Lock()

    def log(msg: str) -> None:
        with lock:
            print(msg, flush=True)

    baseline: dict[str, Any] = {"status": "not run", "reason": "no runnable mutant"}
    sanity: dict[str, Any] | None = None
    t_base = time.perf_counter()
    if runnable:
        baseline = _baseline(root, runnable, selections, args.device, threads, timeout, jobs, log)
    t_mut = time.perf_counter()
    if baseline["status"] == "pass":
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            target = runnable[0]
            sanity_future = pool.submit(
                in_copy, root, (target.file, sanity_source(sources[target.file])), selections[target.id],
                target.k, args.device, threads, timeout)
            futures: dict[str, Future[tuple[PytestRun | None, str | None]]] = {}
            for m in runnable:
                edit = (m.file, apply(sources[m.file], m))
                futures[m.id] = pool.submit(in_copy, root, edit, selections[m.id], m.k, args.device,
                                            threads, timeout)
            run, msg = sanity_future.result()
            sr = classify(target, run, msg, timeout)
            sanity = {"id": SANITY_ID, "file": target.file, "tests": list(selections[target.id]),
                      "status": sr.status, "killedBy": sr.killed_by, "statusReason": sr.reason}
            log(f"[sanity] {SANITY_ID} on {target.file}: {sr.status}")
            for i, m in enumerate(runnable, 1):
                run, msg = futures[m.id].result()
                r = classify(m, run, msg, timeout)
                results[m.id] = r
                by = f" by {', '.join(r.killed_by)}" if r.killed_by else ""
                log(f"[{i}/{len(runnable)}] {m.id}: {r.status}{by} ({r.seconds:.1f} s)"
                    + ("" if r.detected else f"\n    {r.reason}\n" + _indent(r.output_tail[-1500:])))
    else:
        for m in runnable:
            results[m.id] = MutantResult(m, "Ignored", "not run: the unmutated baseline did not pass")
    t_end = time.perf_counter()
    ordered = [results[m.id] for m in chosen]
    config = {"device": args.device, "only": args.only, "jobs": jobs, "timeout_s": timeout,
              "pytest": " ".join(["python -m pytest", *PYTEST_FLAGS, *OUTCOME_PLUGIN])}
    perf = {"setup": (t_base - t_start) * 1000, "initialRun": (t_mut - t_base) * 1000,
            "mutation": (t_end - t_mut) * 1000}
    report = build(ordered, sources, provenance(args.command), config, baseline, sanity, perf)
    out = args.out
    md = write(report, out)
    s = summary(ordered)
    print(f"nmoe mutate: {s['killed']}/{s['total'] - s['not_run']} killed, {s['survived']} survived, "
          f"{s['timeout']} timeout, {s['compile_error']} compile error, {s['not_run']} not run "
          f"(score {s['score']}); baseline {baseline['status']}; report {out} and {md}")
    ok = baseline["status"] in ("pass", "not run") and all(
        r.status in ("Killed", "Ignored") for r in ordered)
    if runnable and (sanity is None or sanity["status"] != "Killed"):
        print("nmoe mutate: the forced-fail sanity mutant was not killed: mutated copies do not reach the "
              "tests (check PYTHONPATH shadowing and the tests selected for the first mutant)",
              file=sys.stderr)
        ok = False
    return 0 if ok else 1


def _indent(text: str) -> str:
    return "\n".join("    | " + line for line in text.splitlines())


def _baseline(root: Path, runnable: list[Mutation], selections: dict[str, tuple[str, ...]], device: str,
              threads: int, timeout: float, jobs: int, log: Any) -> dict[str, Any]:
    """Union of the selected tests on a pristine copy, once per distinct -k expression."""
    groups: dict[str | None, tuple[str, ...]] = {}
    for m in runnable:
        groups[m.k] = _union([groups.get(m.k, ()), selections[m.id]])
    with ThreadPoolExecutor(max_workers=min(jobs, len(groups))) as pool:
        futs = {k: pool.submit(in_copy, root, None, sel, k, device, threads, timeout * 3)
                for k, sel in groups.items()}
        runs = {k: f.result()[0] for k, f in futs.items()}
    bad: list[str] = []
    seconds = 0.0
    ran = skipped = 0
    for k, run in runs.items():
        assert run is not None
        seconds = max(seconds, run.seconds)
        ran += run.ran
        skipped += run.counts.get("skipped", 0)
        if run.timed_out or run.returncode != 0:
            where = "" if k is None else f" (-k {k!r})"
            what = "timed out" if run.timed_out else f"exit {run.returncode}, failing {run.failing}"
            bad.append(f"{what}{where}:\n" + _indent(run.tail(2000)))
    tests = sorted(_union(list(groups.values())))
    if bad:
        log("nmoe mutate: the unmutated baseline failed; fix the tree or the catalog's tests first:\n"
            + "\n".join(bad))
        return {"status": "fail", "reason": "; ".join(b.splitlines()[0] for b in bad), "tests": tests,
                "ran": ran, "skipped": skipped, "seconds": round(seconds, 2)}
    log(f"[baseline] {ran} tests passed ({skipped} skipped) in {seconds:.1f} s")
    return {"status": "pass", "reason": f"{ran} tests passed, {skipped} skipped", "tests": tests, "ran": ran,
            "skipped": skipped, "seconds": round(seconds, 2)}


if __name__ == "__main__":
    raise SystemExit(main())
