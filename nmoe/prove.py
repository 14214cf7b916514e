"""`nmoe prove [BASE]`: the ops whose sources, spec, contract or mutants changed between BASE and the working
tree, then their parity contracts, their mutation catalog and their A/B benchmark, in one report keyed to both
commits. What could not execute here is "not run" with its reason, never a pass."""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from nmoe.abtest import MIN_REPS
from nmoe.checkout import tree_pythonpath
from nmoe.provestage import Plan, StageError, apply_mutant, export, mutant_file, stage, unstage

CATALOG_FILE: Final = re.compile(r"^mutations/catalog/(?!__init__)(\w+)\.py$")
OP_CODE: Final = ("nmoe/fast/", "nmoe/reference/", "parity/ops/")
BENCH_NO_GPU: Final = "no GPU (the A/B benchmark times BASE's tree and the new tree on a CUDA GPU)"
SKIPPED: Final = "skipped by {flag}"
INVENTORY: Final = ("import json; from parity.registry import REGISTRY; "
                    "from mutations.catalog import CATALOG; "
                    "print(json.dumps({'ops': list(REGISTRY), "
                    "'mutants': [[m.id, list(m.contracts)] for m in CATALOG]}))")


class ProveError(Exception):
    """The change cannot be proven as asked; the message names the fix."""


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
    head: str | None = None
    ops: str | None = None
    rows: str | None = None
    reps: int = 10
    bench: bool = True
    mutant: str | None = None


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        why = done.stderr.strip() or done.stdout.strip()
        raise ProveError(f"git {' '.join(args)} failed in {repo}: {why}")
    return done.stdout


def _rev(repo: Path, rev: str, what: str) -> str:
    try:
        return git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    except ProveError as e:
        raise ProveError(f"{what} {rev!r} is no commit in {repo}; pass a sha, branch or tag") from e


def commits(repo: Path, base: str | None, head: str | None = None) -> Plan:
    """BASE and HEAD of the proof. Without `head` the new tree is the working tree and BASE defaults to the
    merge base with `main` (on `main` itself HEAD, so only uncommitted changes count, and the note says how to
    prove the last commit); with `head` REV the new tree is commit REV and BASE defaults to REV~1."""
    if head is not None:
        sha = _rev(repo, head, "--head")
        ref = base if base is not None else f"{head}~1"
        base_sha = _rev(repo, ref, "BASE")
        return Plan(base_sha, ref, sha, head, False, f"{ref} ({base_sha[:10]}) against {head} ({sha[:10]})")
    sha = git(repo, "rev-parse", "HEAD").strip()
    dirty = bool(git(repo, "status", "--porcelain").strip())
    if base is None:
        try:
            base_sha = git(repo, "merge-base", "main", "HEAD").strip()
        except ProveError as e:
            raise ProveError(f"no merge base with a `main` branch ({e}); pass BASE, e.g. "
                             "`nmoe prove HEAD~1`") from e
        ref = "merge-base main HEAD"
    else:
        base_sha, ref = _rev(repo, base, "BASE"), base
    note = f"{ref} ({base_sha[:10]}) against the working tree"
    if base_sha == sha:
        note += ("; BASE is HEAD, so only uncommitted changes are compared (to prove the last commit, pass "
                 "its parent: `nmoe prove HEAD~1`)")
    return Plan(base_sha, ref, sha, "working tree", dirty, note)


def changed_files(repo: Path, base: str, head: str | None = None) -> tuple[str, ...]:
    """Files that differ between `base` and commit `head`, or the working tree: committed, staged, unstaged
    and untracked."""
    if head is not None:
        diff = git(repo, "diff", "--name-only", "--no-renames", base, head)
        return tuple(sorted(f for f in diff.split("\n") if f))
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


def tree_env(tree: Path, plan: Plan, cache: Path) -> dict[str, str]:
    """The environment of a command run in `tree`: that tree's code first, the plan's commit for provenance
    (the tree has no git), and a kernel cache of its own, so trees never share compiled kernels."""
    from nmoe.fast.runtime import CACHE_ENV

    env = dict(os.environ)
    env.update(PYTHONPATH=tree_pythonpath(tree, env.get("PYTHONPATH")), PYTHONDONTWRITEBYTECODE="1",
               NMOE_GIT_SHA=plan.head,
               NMOE_GIT_DIRTY="1" if plan.dirty or plan.edit else "0")
    env[CACHE_ENV] = str(cache)
    return env


def in_tree(tree: Path, env: Mapping[str, str], args: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr tail) of `python ARGS` run in `tree`."""
    try:
        done = subprocess.run([sys.executable, *args], cwd=tree, env=dict(env), capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        return 124, "", f"timed out after {timeout:.0f} s: {e}"
    return done.returncode, done.stdout, done.stderr[-3000:]


def inventory(tree: Path, env: Mapping[str, str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The new tree's own registry ops and catalog mutants (id, contracts): old trees have other entries."""
    rc, out, err = in_tree(tree, env, ["-c", INVENTORY], 300)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        raise ProveError(f"the new tree's parity registry or mutation catalog does not import: {err}")
    doc = json.loads(lines[-1])
    return list(doc["ops"]), [(i, list(c)) for i, c in doc["mutants"]]


def run_parity(tree: Path, env: Mapping[str, str], ops: Sequence[str], known: Sequence[str], opt: Options,
               arch: str | None, why: str) -> dict[str, Any]:
    """The new tree's `nmoe parity` on the ops it registers: contracts on a supported GPU; on a CPU the
    spec self-checks plus compiles with PTX checks."""
    if opt.device == "gpu" and arch is None:
        return {"status": "not run", "reason": f"--device gpu and {why}"}
    chosen = [op for op in ops if op in known]
    missing = [op for op in ops if op not in known]
    gone = f"not in the new tree's registry: {', '.join(missing)}" if missing else ""
    if not chosen:
        return {"status": "not run", "reason": gone}
    mode = "parity" if arch is not None else "selfcheck"
    cases = opt.cases if opt.cases is not None else (3 if mode == "selfcheck" else 8)
    path = opt.out / "parity.json"
    path.unlink(missing_ok=True)
    args = ["-m", "nmoe.cli", "parity", "--ops", ",".join(chosen), "--mode", mode, "--cases", str(cases),
            "--seed", str(opt.seed), "--no-db", "--quiet", "--report", str(path.resolve())]
    rc, out, err = in_tree(tree, env, args + ([] if opt.compile else ["--no-compile"]), opt.timeout * 4)
    if not path.is_file():
        tail = (out + err)[-3000:]
        return {"status": "fail", "reason": f"nmoe parity exited {rc} without a report: {tail}"}
    report = json.loads(path.read_text())
    s = report["summary"]
    failed = [c for c in report["cases"] if c["status"] == "fail"]
    failed_compiles = [c for c in report["compile"] if c.get("status") == "fail"]
    ran = s["passed"] + s["failed"] + s["compile"]["ok"] + s["compile"]["fail"]
    status = "fail" if failed or failed_compiles or rc != 0 else "pass" if ran else "not run"
    skipped = "" if opt.compile or mode != "selfcheck" else "compiles " + SKIPPED.format(flag="--no-compile")
    reasons = [gone, skipped,
               f"nmoe parity exited {rc}" if rc != 0 and not (failed or failed_compiles) else ""]
    return {"status": status, "reason": "; ".join(r for r in reasons if r), "mode": mode, "report": path.name,
            "summary": s,
            "failed": [{k: c.get(k) for k in ("op", "contract", "arch", "case", "reason")} for c in failed],
            "failed_compiles": failed_compiles}


def run_mutants(tree: Path, env: Mapping[str, str], ops: Sequence[str],
                catalog: Sequence[tuple[str, list[str]]], opt: Options, arch: str | None,
                why: str, applied: str = "") -> dict[str, Any]:
    """The new tree's catalog mutants whose `contracts` name a touched op: CPU mutants on a CPU, all of them
    on a GPU; the mutant `applied` to the tree is left out (its anchor is gone from the mutated source)."""
    if not opt.mutants:
        return {"status": "not run", "reason": SKIPPED.format(flag="--no-mutants"), "mutants": []}
    chosen = [i for i, contracts in catalog if set(contracts) & set(ops) and i != applied]
    if not chosen:
        return {"status": "not run", "reason": "no mutant names these ops in its contracts",
                "mutants": []}
    device = "gpu" if arch is not None else "cpu"
    if opt.device == "gpu" and arch is None:
        return {"status": "not run", "reason": f"--device gpu and {why}",
                "mutants": [{"id": i, "status": "Ignored"} for i in chosen]}
    path = opt.out / "mutations.json"
    path.unlink(missing_ok=True)
    args = ["-m", "nmoe.cli", "mutate", "--device", device, "--only", ",".join(chosen), "--report",
            str(path.resolve()), "--root", str(tree), "--jobs", str(opt.jobs), "--timeout", str(opt.timeout)]
    rc, out, err = in_tree(tree, env, args, opt.timeout * len(chosen) + 600)
    if rc == 2 or not path.is_file():
        tail = (out + err)[-3000:]
        why = f"nmoe mutate exited {rc} without a report: {tail}"
        return {"status": "fail", "reason": why, "mutants": []}
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


def bench_rows(ops: Sequence[str], chosen: str | None) -> dict[str, tuple[str, float, str]]:
    """name -> (op, min noise, timer) of the A/B rows: by default the CUDA rows of the touched ops; `--rows`
    globs pick among every row instead (the CPU rows are only ever picked so)."""
    rows = _abrows().ROWS
    if chosen is None:
        picked = [n for n, r in rows.items() if r.op in ops and r.timer == "cuda"]
    else:
        globs = [g for g in chosen.split(",") if g]
        unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n in rows)]
        if unmatched:
            raise ProveError(f"--rows {','.join(unmatched)} matches no A/B row; rows: {', '.join(rows)}")
        picked = [n for n in rows if any(fnmatch.fnmatchcase(n, g) for g in globs)]
    return {n: (rows[n].op, rows[n].min_noise, rows[n].timer) for n in picked}


def _abrows() -> Any:
    from nmoe.checkout import source_dir

    path = source_dir("nmoe prove", "bench") / "abrows.py"
    spec = importlib.util.spec_from_file_location("nmoe_prove_abrows", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_bench(trees: Mapping[str, Path] | None, ops: Sequence[str], opt: Options, arch: str | None,
              work: Path) -> dict[str, Any]:
    """The A/B benchmark of BASE's tree against the new tree (`nmoe.abtest.run_ab`), or not run with why."""
    empty = {"repetitions": 0, "interleaved": True, "rows": []}
    if not opt.bench:
        return {"status": "not run", "reason": SKIPPED.format(flag="--no-bench"), **empty}
    rows = bench_rows(ops, opt.rows)
    if not rows:
        return {"status": "not run", "reason": "no A/B row times these ops (bench/abrows.py)", **empty}
    if arch is None and any(t == "cuda" for _, _, t in rows.values()):
        return {"status": "not run", "reason": BENCH_NO_GPU, **empty}
    assert trees is not None
    from nmoe.abtest import ABError, run_ab

    script = Path(_abrows().__file__)
    try:
        results = run_ab(script, trees, {n: (op, floor) for n, (op, floor, _) in rows.items()}, opt.reps,
                         work / "bench")
    except (ABError, ValueError) as e:
        return {"status": "fail", "reason": str(e), **empty}
    status, reason = bench_verdict(results)
    return {"status": status, "reason": reason, "repetitions": opt.reps, "interleaved": True, "rows": results}


def bench_verdict(results: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """Red only when the new tree breaks a row BASE runs; a row neither tree runs is not run (it postdates
    both), never a failure of the change."""
    broken = [r["name"] for r in results if "new" in r.get("error", {}) and "base" not in r["error"]]
    absent = [r["name"] for r in results if {"new", "base"} <= set(r.get("error", {}))]
    counts = {v: sum(r.get("verdict") == v for r in results) for v in ("faster", "slower", "within noise")}
    timed = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    status = "fail" if broken else "pass" if timed else "not run"
    parts = [f"the new tree cannot run {', '.join(broken)}" if broken else "", timed,
             f"neither tree runs {', '.join(absent)}" if absent else ""]
    return status, "; ".join(p for p in parts if p)


def overall(sections: Mapping[str, Mapping[str, Any]], ops: Sequence[str]) -> str:
    if not ops:
        return "nothing to prove"
    states = [s["status"] for s in sections.values()]
    return "red" if "fail" in states else "green" if "pass" in states else "not run"


def choose_ops(ops: Mapping[str, tuple[str, ...]], chosen: str | None) -> dict[str, tuple[str, ...]]:
    """The touched ops, or those `--ops` names (each with the changed files that touch it, if any)."""
    if chosen is None:
        return dict(ops)
    from parity.registry import REGISTRY

    names = [o for o in chosen.split(",") if o]
    unknown = [o for o in names if o not in REGISTRY]
    if unknown or not names:
        raise ProveError(f"--ops {chosen!r}: {', '.join(unknown) or 'empty'} not registry ops; "
                         "`nmoe parity --list` lists them")
    return {o: ops.get(o) or ("chosen by --ops",) for o in names}


def plan(repo: Path, opt: Options) -> Plan:
    """What to prove, from git: the commits, the changed files, the touched ops (this checkout's source graph;
    for an old --head, files it no longer has touch no op and are listed as unclaimed)."""
    c = commits(repo, opt.base, opt.head)
    if c.dirty and not opt.allow_dirty:
        raise ProveError("the working tree has uncommitted changes, so the report could not name the code it "
                         "proves; commit them, or pass --allow-dirty to get a report marked dirty")
    changed = changed_files(repo, c.base, opt.head)
    if opt.mutant:
        changed = tuple(sorted({*changed, mutant_file(opt.mutant)}))
    hit = touched(repo, changed)
    claimed = {f for files in hit.values() for f in files}
    unclaimed = tuple(f for f in changed if f.startswith(OP_CODE) and f.endswith(".py") and f not in claimed)
    edit = f"catalog mutant {opt.mutant} applied" if opt.mutant else ""
    compared = c.compared + (f", with {edit}" if edit else "")
    return Plan(c.base, c.base_ref, c.head, c.head_ref, c.dirty, compared, changed,
                choose_ops(hit, opt.ops), unclaimed, opt.mutant or "")


def export_trees(repo: Path, p: Plan, work: Path, in_place: bool) -> dict[str, Path]:
    """BASE exported under `work`; the new tree is the checkout itself when `in_place` and it is the working
    tree unedited, else exported too (commit --head, or the working tree with a mutant applied)."""
    base = work / "base"
    export(repo, p.base, base)
    if in_place and p.head_ref == "working tree" and not p.edit:
        return {"base": base, "new": repo}
    new = work / "new"
    export(repo, None if p.head_ref == "working tree" else p.head, new)
    if p.edit:
        apply_mutant(new, p.edit)
    return {"base": base, "new": new}


def execute(p: Plan, trees: Mapping[str, Path], opt: Options, command: str, work: Path) -> dict[str, Any]:
    """Parity and mutants of the new tree, run by its own `nmoe` (old trees have older internals), and the A/B
    benchmark of both trees; one report keyed to both commits."""
    from nmoe.provenance import provenance

    arch, why = (None, "--device cpu") if opt.device == "cpu" else gpu_arch()
    names = list(p.ops)
    if names:
        env = tree_env(trees["new"], p, work / "kernels-new")
        known, catalog = inventory(trees["new"], env)
        sections = {"parity": run_parity(trees["new"], env, names, known, opt, arch, why),
                    "mutation": run_mutants(trees["new"], env, names, catalog, opt, arch, why, p.edit),
                    "bench": run_bench(trees, names, opt, arch, work)}
    else:
        why = "no op touched"
        sections = {"parity": {"status": "not run", "reason": why},
                    "mutation": {"status": "not run", "reason": why, "mutants": []},
                    "bench": {"status": "not run", "reason": why, "repetitions": 0, "interleaved": True,
                              "rows": []}}
    commits_doc = {"base": p.base, "base_ref": p.base_ref, "head": p.head, "head_ref": p.head_ref,
                   "dirty": p.dirty, "edit": p.edit, "compared": p.compared}
    return {"provenance": provenance(command), "commits": commits_doc, "device": arch or "cpu",
            "changed": list(p.changed), "ops": {op: list(f) for op, f in p.ops.items()},
            "unclaimed": list(p.unclaimed), **sections, "verdict": overall(sections, names)}


def prove(repo: Path, opt: Options, command: str) -> dict[str, Any]:
    p = plan(repo, opt)
    with tempfile.TemporaryDirectory(prefix="nmoe-prove-") as tmp:
        work = Path(tmp)
        trees = export_trees(repo, p, work, in_place=True) if p.ops else {}
        return execute(p, trees, opt, command, work)


def prove_staged(staged: Path, opt: Options, command: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="nmoe-prove-") as tmp:
        work = Path(tmp)
        p, trees = unstage(staged, work)
        if opt.ops is not None:
            p = replace(p, ops=choose_ops(p.ops, opt.ops))
        return execute(p, trees, opt, command, work)


def stage_plan(repo: Path, opt: Options, out: Path, command: str) -> Sequence[Path]:
    p = plan(repo, opt)
    with tempfile.TemporaryDirectory(prefix="nmoe-prove-") as tmp:
        return stage(p, export_trees(repo, p, Path(tmp), in_place=False), out, command)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nmoe prove", description=__doc__)
    ap.add_argument("base", nargs="?", help="commit to compare against (default: `git merge-base main HEAD`, "
                    "or REV~1 with --head REV)")
    ap.add_argument("--out", type=Path, help="directory for prove.json, prove.md, prove.html")
    ap.add_argument("--head", help="prove commit REV instead of the working tree (a change from history)")
    ap.add_argument("--stage", type=Path, metavar="DIR", help="write both trees and the plan to DIR "
                    "(where git is) for `--staged DIR` on a host without the repository's git history; "
                    "runs nothing")
    ap.add_argument("--staged", type=Path, metavar="DIR", help="prove what `--stage DIR` wrote")
    ap.add_argument("--mutant", help="apply this catalog mutant to the new tree (a known-bad change)")
    ap.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                    help="auto: GPU parity and mutants on a supported GPU, else the CPU half; gpu: the GPU "
                    "half only, reported not run without a GPU")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="prove uncommitted changes; the report is marked dirty")
    ap.add_argument("--ops", help="comma-separated registry ops to prove instead of the touched ones")
    ap.add_argument("--rows", help="comma-separated globs over the A/B rows (bench/abrows.py; default: the "
                    "CUDA rows of the ops proven)")
    ap.add_argument("--reps", type=int, default=10, help="interleaved A/B repetitions per tree")
    ap.add_argument("--no-bench", action="store_true", help="skip the A/B benchmark")
    ap.add_argument("--cases", type=int, help="random parity cases per op (default 3 on CPU, 8 on GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="skip the sm_90a/sm_100a compiles (CPU)")
    ap.add_argument("--no-mutants", action="store_true", help="skip the mutation catalog")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run in parallel")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant test run")
    return ap


def _usage(a: argparse.Namespace) -> str | None:
    if a.stage is not None and a.staged is not None:
        return "--stage and --staged exclude each other: stage where git is, then prove the staged DIR"
    if a.staged is not None and (a.base or a.head or a.mutant or a.allow_dirty):
        return ("--staged DIR proves the plan staged in DIR; BASE, --head, --mutant and --allow-dirty belong "
                "to the --stage run")
    if a.stage is None and a.out is None:
        return "--out DIR is required (or --stage DIR to stage for another host)"
    if a.reps < MIN_REPS:
        return f"--reps {a.reps}: the A/B test needs at least {MIN_REPS} repetitions per tree"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from nmoe.checkout import CheckoutError, source_dir
    from nmoe.opsources import SourceGraphError
    from nmoe.outpaths import UnwritableError, require_writable
    from nmoe.provereport import write

    argl = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argl)
    command = "nmoe prove " + " ".join(argl)
    problem = _usage(a)
    if problem:
        print(f"nmoe prove: {problem}", file=sys.stderr)
        return 2
    opt = Options(a.base, a.out or a.stage, a.device, a.allow_dirty, a.cases, a.seed, not a.no_compile,
                  not a.no_mutants, a.jobs, a.timeout, a.head, a.ops, a.rows, a.reps, not a.no_bench,
                  a.mutant)
    try:
        repo = source_dir("nmoe prove", "parity").parent
        if a.stage is not None:
            require_writable("--stage", a.stage / "plan.json")
            paths = stage_plan(repo, opt, a.stage, command)
            size = sum(q.stat().st_size for q in paths) / 2**20
            print(f"nmoe prove: staged {', '.join(map(str, paths))} ({size:.1f} MiB); on the GPU host run "
                  f"`nmoe prove --staged {a.stage} --out DIR`")
            return 0
        require_writable("--out", opt.out / "prove.json")
        doc = prove_staged(a.staged, opt, command) if a.staged else prove(repo, opt, command)
    except (CheckoutError, ProveError, SourceGraphError, StageError, UnwritableError) as e:
        print(f"nmoe prove: {e}", file=sys.stderr)
        return 2
    paths = write(doc, opt.out)
    print(f"nmoe prove: {doc['verdict']} for {len(doc['ops'])} ops ({doc['commits']['compared']}); "
          f"wrote {', '.join(map(str, paths))}")
    return 1 if doc["verdict"] in ("red", "not run") else 0


if __name__ == "__main__":
    raise SystemExit(main())
