"""`nmoe prove [BASE]`: the ops whose sources, spec, contract or mutants changed between BASE and the working
tree, then their parity contracts, their mutation catalog and their A/B benchmark, in one report keyed to both
commits. What could not execute here is "not run" with its reason, never a pass."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from nmoe.abtest import verdict

CATALOG_FILE: Final = re.compile(r"^mutations/catalog/(?!__init__)(\w+)\.py$")
BENCH_NO_GPU: Final = "no GPU (the A/B benchmark times BASE's tree and the new tree on a CUDA GPU)"
BENCH_NOT_BUILT: Final = "the A/B benchmark of BASE's tree against the new tree is not built yet"
SKIPPED: Final = "skipped by {flag}"


class ProveError(Exception):
    """The change cannot be proven as asked; the message names the fix."""


@dataclass(frozen=True)
class Commits:
    """BASE and HEAD as shas; `dirty`: the working tree differs from HEAD; `note`: what is compared."""

    base: str
    base_ref: str
    head: str
    dirty: bool
    note: str


@dataclass(frozen=True)
class Options:
    base: str | None
    out: Path
    device: str = "auto"
    allow_dirty: bool = False
    cases: int | None = None
    seed: int = 0
    compile: bool = True
    mutants: bool = True
    jobs: int = 1
    timeout: float = 300.0


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        why = done.stderr.strip() or done.stdout.strip()
        raise ProveError(f"git {' '.join(args)} failed in {repo}: {why}")
    return done.stdout


def commits(repo: Path, base: str | None) -> Commits:
    """BASE defaults to the merge base with `main`; on `main` itself that is HEAD, so only the uncommitted
    changes are compared, and the note says how to prove the last commit instead."""
    head = git(repo, "rev-parse", "HEAD").strip()
    dirty = bool(git(repo, "status", "--porcelain").strip())
    if base is None:
        try:
            sha = git(repo, "merge-base", "main", "HEAD").strip()
        except ProveError as e:
            raise ProveError(f"no merge base with a `main` branch ({e}); pass BASE, e.g. "
                             "`nmoe prove HEAD~1`") from e
        ref = "merge-base main HEAD"
    else:
        try:
            sha = git(repo, "rev-parse", "--verify", f"{base}^{{commit}}").strip()
        except ProveError as e:
            raise ProveError(f"BASE {base!r} is no commit in {repo}; pass a sha, branch or tag") from e
        ref = base
    note = f"{ref} ({sha[:10]}) against the working tree"
    if sha == head:
        note += ("; BASE is HEAD, so only uncommitted changes are compared (to prove the last commit, pass "
                 "its parent: `nmoe prove HEAD~1`)")
    return Commits(sha, ref, head, dirty, note)


def changed_files(repo: Path, base: str) -> tuple[str, ...]:
    """Files that differ between `base` and the working tree: committed, staged, unstaged and untracked."""
    tracked = git(repo, "diff", "--name-only", "--no-renames", base).split("\n")
    untracked = git(repo, "ls-files", "--others", "--exclude-standard").split("\n")
    return tuple(sorted({f for f in (*tracked, *untracked) if f}))


def catalog_ops(changed: Sequence[str]) -> dict[str, list[str]]:
    """op -> the changed catalog files whose mutants name it in their `contracts`."""
    out: dict[str, list[str]] = {}
    for f in changed:
        m = CATALOG_FILE.match(f)
        if m is None:
            continue
        try:
            mod = importlib.import_module(f"mutations.catalog.{m.group(1)}")
        except ModuleNotFoundError:
            continue
        for op in sorted({c for mut in mod.MUTATIONS for c in mut.contracts}):
            out.setdefault(op, []).append(f)
    return out


def touched(repo: Path, changed: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """op -> the changed files that make it touched: its sources (`nmoe.opsources`, the graph `nmoe report`
    reads too) or its mutants' catalog file."""
    from nmoe.opsources import op_sources
    from parity.registry import REGISTRY

    by_catalog = catalog_ops(changed)
    out = {}
    for op in REGISTRY:
        hit = sorted(set(changed).intersection(op_sources(op, repo)) | set(by_catalog.get(op, ())))
        if hit:
            out[op] = tuple(hit)
    return out


def gpu_arch() -> tuple[str | None, str]:
    from parity.runner import detect_arch

    return detect_arch()


def run_parity(ops: Sequence[str], opt: Options, arch: str | None, why: str, command: str) -> dict[str, Any]:
    """Parity on a supported GPU; on a CPU the spec self-checks plus compiles with PTX checks."""
    from parity import report as rep
    from parity.runner import Options as ParityOptions
    from parity.runner import run

    if opt.device == "gpu" and arch is None:
        return {"status": "not run", "reason": f"--device gpu and {why}"}
    mode = "parity" if arch is not None else "selfcheck"
    cases = opt.cases if opt.cases is not None else (3 if mode == "selfcheck" else 8)
    report = run(ParityOptions(ops=tuple(ops), mode=mode, seed=opt.seed, cases=cases,
                               compile=opt.compile and mode == "selfcheck", quiet=True), command)
    path = opt.out / "parity.json"
    rep.write_json(path, report)
    s = report["summary"]
    failed = [c for c in report["cases"] if c["status"] == "fail"]
    failed_compiles = [c for c in report["compile"] if c.get("status") == "fail"]
    ran = s["passed"] + s["failed"] + s["compile"]["ok"] + s["compile"]["fail"]
    status = "fail" if failed or failed_compiles else "pass" if ran else "not run"
    reason = "" if opt.compile or mode != "selfcheck" else "compiles " + SKIPPED.format(flag="--no-compile")
    return {"status": status, "reason": reason, "mode": mode, "report": path.name, "summary": s,
            "failed": [{k: c.get(k) for k in ("op", "contract", "arch", "case", "reason")} for c in failed],
            "failed_compiles": failed_compiles}


def run_mutants(repo: Path, ops: Sequence[str], opt: Options, arch: str | None, why: str) -> dict[str, Any]:
    """The catalog mutants whose `contracts` name a touched op: CPU mutants on a CPU, all of them on a GPU."""
    from mutations.catalog import CATALOG
    from mutations.runner import main as mutate

    if not opt.mutants:
        return {"status": "not run", "reason": SKIPPED.format(flag="--no-mutants"), "mutants": []}
    chosen = [m.id for m in CATALOG if set(m.contracts) & set(ops)]
    if not chosen:
        return {"status": "not run", "reason": "no mutant names these ops in its contracts",
                "mutants": []}
    device = "gpu" if arch is not None else "cpu"
    if opt.device == "gpu" and arch is None:
        return {"status": "not run", "reason": f"--device gpu and {why}",
                "mutants": [{"id": i, "status": "Ignored"} for i in chosen]}
    path = opt.out / "mutations.json"
    rc = mutate(["--device", device, "--only", ",".join(chosen), "--report", str(path), "--root", str(repo),
                 "--jobs", str(opt.jobs), "--timeout", str(opt.timeout)])
    if rc == 2:
        return {"status": "fail", "reason": "nmoe mutate refused the selection (its message is above)",
                "mutants": []}
    doc = json.loads(path.read_text())
    mutants = [{"id": m["id"], "contracts": m.get("contracts", []), "device": m.get("device"),
                "status": m["status"], "reason": m.get("statusReason", "")}
               for f in doc["files"].values() for m in f["mutants"]]
    executed = [m for m in mutants if m["status"] != "Ignored"]
    status = "fail" if rc != 0 else "pass" if executed else "not run"
    reason = "" if rc == 0 else f"baseline {doc['baseline']['status']}, sanity " \
        f"{(doc.get('sanity') or {}).get('status', 'not run')}; nmoe mutate exited {rc}"
    return {"status": status, "reason": reason, "device": device, "report": path.name,
            "summary": doc["summary"], "mutants": mutants}


def bench_row(name: str, op: str, base_ms: Sequence[float], new_ms: Sequence[float],
              aa_ms: Sequence[float]) -> dict[str, Any]:
    """One A/B row: every repetition's timing of both trees and of the A/A run, and the verdict on them."""
    v = verdict(base_ms, new_ms, aa_ms)
    return {"name": name, "op": op, "base_ms": list(base_ms), "new_ms": list(new_ms), "aa_ms": list(aa_ms),
            "median_base_ms": v.base_ms, "median_new_ms": v.new_ms, "median_aa_ms": v.aa_ms,
            "change": v.change, "noise": v.noise, "verdict": v.verdict}


def run_bench(arch: str | None) -> dict[str, Any]:
    return {"status": "not run", "reason": BENCH_NO_GPU if arch is None else BENCH_NOT_BUILT,
            "repetitions": 0, "interleaved": True, "rows": []}


def overall(sections: Mapping[str, Mapping[str, Any]], ops: Sequence[str]) -> str:
    if not ops:
        return "nothing to prove"
    states = [s["status"] for s in sections.values()]
    return "red" if "fail" in states else "green" if "pass" in states else "not run"


def prove(repo: Path, opt: Options, command: str) -> dict[str, Any]:
    from nmoe.provenance import provenance

    c = commits(repo, opt.base)
    if c.dirty and not opt.allow_dirty:
        raise ProveError("the working tree has uncommitted changes, so the report could not name the code it "
                         "proves; commit them, or pass --allow-dirty to get a report marked dirty")
    changed = changed_files(repo, c.base)
    ops = touched(repo, changed)
    arch, why = (None, "--device cpu") if opt.device == "cpu" else gpu_arch()
    names = list(ops)
    if names:
        sections = {"parity": run_parity(names, opt, arch, why, command),
                    "mutation": run_mutants(repo, names, opt, arch, why), "bench": run_bench(arch)}
    else:
        why = "no op touched"
        sections = {"parity": {"status": "not run", "reason": why},
                    "mutation": {"status": "not run", "reason": why, "mutants": []},
                    "bench": {**run_bench(arch), "reason": why}}
    return {"provenance": provenance(command),
            "commits": {"base": c.base, "base_ref": c.base_ref, "head": c.head, "dirty": c.dirty,
                        "compared": c.note},
            "device": arch or "cpu", "changed": list(changed), "ops": {op: list(f) for op, f in ops.items()},
            **sections, "verdict": overall(sections, names)}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nmoe prove", description=__doc__)
    ap.add_argument("base", nargs="?", help="commit to compare against (default: `git merge-base main HEAD`)")
    ap.add_argument("--out", type=Path, required=True, help="directory for prove.json, prove.md, prove.html")
    ap.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                    help="auto: GPU parity and mutants on a supported GPU, else the CPU half; gpu: the GPU "
                    "half only, reported not run without a GPU")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="prove uncommitted changes; the report is marked dirty")
    ap.add_argument("--cases", type=int, help="random parity cases per op (default 3 on CPU, 8 on GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="skip the sm_90a/sm_100a compiles (CPU)")
    ap.add_argument("--no-mutants", action="store_true", help="skip the mutation catalog")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run in parallel")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant test run")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from nmoe.checkout import CheckoutError, source_dir
    from nmoe.opsources import SourceGraphError
    from nmoe.outpaths import UnwritableError, require_writable
    from nmoe.provereport import write

    argl = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argl)
    opt = Options(a.base, a.out, a.device, a.allow_dirty, a.cases, a.seed, not a.no_compile,
                  not a.no_mutants, a.jobs, a.timeout)
    try:
        repo = source_dir("nmoe prove", "parity").parent
        require_writable("--out", opt.out / "prove.json")
        doc = prove(repo, opt, "nmoe prove " + " ".join(argl))
    except (CheckoutError, ProveError, SourceGraphError, UnwritableError) as e:
        print(f"nmoe prove: {e}", file=sys.stderr)
        return 2
    paths = write(doc, opt.out)
    print(f"nmoe prove: {doc['verdict']} for {len(doc['ops'])} touched ops ({doc['commits']['compared']}); "
          f"wrote {', '.join(map(str, paths))}")
    return 1 if doc["verdict"] in ("red", "not run") else 0


if __name__ == "__main__":
    raise SystemExit(main())
