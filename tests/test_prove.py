"""`nmoe prove`: which ops a change touches, the dirty-tree refusal, the A/B verdict and its interleaved
workers (CPU-timed row: added work is slower, A/A within noise), staging for a host without git, and whole
runs in a snapshot repository of this tree: a broken spec gives a red report, an unrelated edit proves
nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from nmoe import prove
from nmoe.abtest import order, run_ab, verdict
from nmoe.checkout import tree_pythonpath
from nmoe.provereport import markdown
from nmoe.provestage import export

REPO = Path(__file__).resolve().parents[1]
RELU2 = ("    return round_to(r * r, x.dtype)", "    return round_to(r, x.dtype)")
MORE_WORK = ("    return round_to(r * r, x.dtype)",
             "    for _ in range(100):\n        r = r + 0.0 * r\n    return round_to(r * r, x.dtype)")
# A shared 2-core CI runner shifts one worker process against another by up to ~50 % (measured: A/A
# medians 47 % apart on the 0.07 ms row), so the test's floor is 100 %; the added work is about +500 %.
CPU_ROW = {"relu2_spec_cpu": ("relu2", 1.0)}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


def _snapshot(dst: Path) -> Path:
    """This working tree (tracked and untracked, uncommitted edits included) as one commit on `main`."""
    files = _git(REPO, "ls-files", "-co", "--exclude-standard", "-z").split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst / f)
    _git(dst, "init", "-q", "-b", "main")
    _commit(dst, "snapshot")
    return dst


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} must occur once in {path}"
    path.write_text(text.replace(old, new))


def _prove(repo: Path, out: Path, *args: str) -> tuple[int, dict[str, object]]:
    """Run `nmoe prove` in `repo` with its own nmoe, as a user would; a refusal (exit 2), or a --stage run,
    gives no report and an empty doc."""
    env = {k: v for k, v in os.environ.items() if k not in ("NMOE_GIT_SHA", "NMOE_GIT_DIRTY")}
    env["PYTHONPATH"] = str(repo)
    out_args = [] if "--stage" in args else ["--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "nmoe.cli", "prove", *args, *out_args], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=1200, check=False)
    if "--stage" in args:
        assert done.returncode == 0, done.stdout + done.stderr
        return 0, {}
    if done.returncode == 2:
        assert not (out / "prove.json").exists()
        return 2, {"stderr": done.stderr}
    assert (out / "prove.json").is_file(), done.stdout + done.stderr
    assert (out / "prove.md").is_file() and (out / "prove.html").is_file()
    return done.returncode, json.loads((out / "prove.json").read_text())


def test_touched_ops_follow_the_source_graph_and_the_catalog() -> None:
    spec = prove.touched(REPO, ["nmoe/reference/activation.py"])
    assert "relu2" in spec and spec["relu2"] == ("nmoe/reference/activation.py",)
    assert prove.touched(REPO, ["README.md", "docs/design.md", "tests/test_prove.py"]) == {}
    catalog = prove.touched(REPO, ["mutations/catalog/activation.py"])
    assert {"relu2", "swiglu"} <= set(catalog)
    assert prove.catalog_ops(["mutations/catalog/__init__.py"]) == {}


def test_commits_changed_files_and_dirty_refusal(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("a\n")
    _git(tmp_path, "init", "-q", "-b", "feature")
    first = _commit(tmp_path, "one")
    with pytest.raises(prove.ProveError, match="nmoe prove HEAD~1"):
        prove.commits(tmp_path, None)
    _git(tmp_path, "branch", "main")
    (tmp_path / "b.py").write_text("b\n")
    second = _commit(tmp_path, "two")
    c = prove.commits(tmp_path, None)
    assert (c.base, c.head, c.dirty, c.head_ref) == (first, second, False, "working tree")
    assert "BASE is HEAD" not in c.compared
    h = prove.commits(tmp_path, None, "HEAD")
    assert (h.base, h.head, h.base_ref) == (first, second, "HEAD~1")
    assert prove.changed_files(tmp_path, first, second) == ("b.py",)
    (tmp_path / "a.py").write_text("a2\n")
    (tmp_path / "new.py").write_text("n\n")
    assert prove.changed_files(tmp_path, first) == ("a.py", "b.py", "new.py")
    assert prove.commits(tmp_path, "HEAD").dirty and not prove.commits(tmp_path, None, "HEAD").dirty
    assert "BASE is HEAD" in prove.commits(tmp_path, "HEAD").compared
    with pytest.raises(prove.ProveError, match="--allow-dirty"):
        prove.prove(tmp_path, prove.Options(None, tmp_path / "out"), "test")
    with pytest.raises(prove.ProveError, match="no commit"):
        prove.commits(tmp_path, "nosuchref")


def test_gpu_mode_without_a_gpu_is_not_run_never_pass(tmp_path: Path) -> None:
    opt = prove.Options(None, tmp_path, device="gpu")
    env = dict(os.environ)
    why = "no CUDA device on this host"
    par = prove.run_parity(REPO, env, ["relu2"], ["relu2"], opt, None, why)
    mut = prove.run_mutants(REPO, env, ["relu2"], [("relu2.square_dropped", ["relu2"])], opt, None, why)
    bench = prove.run_bench(None, ["relu2"], opt, None, tmp_path)
    assert par["status"] == mut["status"] == bench["status"] == "not run"
    assert "no CUDA device" in par["reason"] and "no GPU" in bench["reason"]
    assert {m["status"] for m in mut["mutants"]} == {"Ignored"}
    assert prove.overall({"parity": par, "mutation": mut, "bench": bench}, ["relu2"]) == "not run"
    assert prove.overall({"parity": {"status": "pass"}, "bench": bench}, ["relu2"]) == "green"
    assert prove.overall({"parity": {"status": "pass"}, "mutation": {"status": "fail"}}, ["relu2"]) == "red"
    assert prove.run_bench(None, ["relu2"], replace(opt, bench=False), None, tmp_path)["reason"] == \
        prove.SKIPPED.format(flag="--no-bench")
    assert set(prove.bench_rows(["relu2"], None)) == {"relu2_fwd"}
    assert set(prove.bench_rows([], "relu2_spec*")) == {"relu2_spec_cpu"}
    with pytest.raises(prove.ProveError, match="matches no A/B row"):
        prove.bench_rows([], "nosuchrow")


def test_a_surviving_mutant_is_red(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_in_tree(tree: Path, env: object, args: list[str], timeout: float) -> tuple[int, str, str]:
        mutant = {"id": "relu2.square_dropped", "contracts": ["relu2"], "device": "cpu", "status": "Survived",
                  "statusReason": "all 3 selected tests passed on the mutant"}
        doc = {"files": {"f.py": {"mutants": [mutant]}}, "baseline": {"status": "pass"},
               "sanity": {"status": "Killed"}, "summary": {"survived": 1}}
        Path(args[args.index("--report") + 1]).write_text(json.dumps(doc))
        assert args[args.index("--device") + 1] == "cpu" and args[args.index("--root") + 1] == str(tree)
        assert args[args.index("--only") + 1] == "relu2.square_dropped"
        return 1, "", ""

    monkeypatch.setattr(prove, "in_tree", fake_in_tree)
    catalog = [("relu2.square_dropped", ["relu2"]), ("combine.x", ["combine"])]
    mut = prove.run_mutants(REPO, {}, ["relu2"], catalog, prove.Options(None, tmp_path), None, "")
    assert mut["status"] == "fail" and "exited 1" in mut["reason"]
    assert [m["status"] for m in mut["mutants"]] == ["Survived"]
    assert prove.overall({"parity": {"status": "pass"}, "mutation": mut}, ["relu2"]) == "red"


def test_ab_verdict() -> None:
    base = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98]
    aa = [1.01, 1.00, 0.99, 1.00, 1.01, 0.99]
    assert verdict(base, aa, aa).verdict == "within noise"
    slower = verdict(base, [x * 1.2 for x in base], aa)
    assert slower.verdict == "slower" and slower.change == pytest.approx(0.2)
    assert verdict(base, [x * 0.8 for x in base], aa).verdict == "faster"
    noisy = [0.7, 1.3, 0.8, 1.2, 1.0, 1.1]
    assert verdict(base, [x * 1.1 for x in base], noisy).verdict == "within noise"
    assert verdict(base, [x * 1.1 for x in base], [1.15] * 4).verdict == "within noise"
    with pytest.raises(ValueError, match="A/A"):
        verdict(base, base, [])
    with pytest.raises(ValueError, match="new"):
        verdict(base, [1.0, float("nan")], aa)


def test_report_renders_bench_rows() -> None:
    v = verdict([1.0, 1.0, 1.0], [1.5, 1.5, 1.5], [1.0, 1.0, 1.0])
    row = {"name": "relu2_fwd", "op": "relu2", "median_base_ms": v.base_ms, "median_new_ms": v.new_ms,
           "median_aa_ms": v.aa_ms, "change": v.change, "noise": v.noise, "verdict": v.verdict}
    broken = {"name": "permute", "op": "permute", "error": {"base": "AttributeError: no permute"}}
    doc = {"verdict": "green", "device": "sm_90a", "ops": {"relu2": ["nmoe/fast/activation.py"]},
           "commits": {"base": "b" * 40, "base_ref": "HEAD~1", "head": "h" * 40, "head_ref": "v1",
                       "dirty": True, "edit": "relu2.fast_square_dropped",
                       "compared": "HEAD~1 against the working tree"},
           "unclaimed": ["nmoe/fast/gone.py"], "parity": {"status": "pass"},
           "mutation": {"status": "pass", "mutants": []},
           "bench": {"status": "pass", "repetitions": 3, "rows": [row, broken]}}
    md = markdown(doc)
    assert "| relu2_fwd | relu2 | 1 | 1.5 | 1 | +50.0% | ±1.0% | slower |" in md
    assert "| permute | permute |  |  |  |  |  | not run (base: AttributeError: no permute) |" in md
    head = f"| HEAD | {'h' * 40} (v1) + uncommitted changes (dirty) + catalog mutant relu2.fast_square"
    assert head + "_dropped |" in md
    assert "nmoe/fast/gone.py" in md and "medians of 3 interleaved repetitions" in md


def test_interleaving_rotates_the_sides() -> None:
    assert [order(r) for r in range(4)] == [("base", "new", "aa"), ("new", "aa", "base"),
                                            ("aa", "base", "new"), ("base", "new", "aa")]


def _trees(tmp_path: Path) -> tuple[Path, Path]:
    base, new = tmp_path / "base", tmp_path / "new"
    export(REPO, None, base)
    export(REPO, None, new)
    _edit(new / "nmoe/reference/activation.py", *MORE_WORK)
    return base, new


def test_ab_added_work_is_slower_and_aa_is_within_noise(tmp_path: Path) -> None:
    """Real worker processes on two trees with the CPU-timed spec row: the tree doing 30 more passes over
    the data is slower; BASE against itself is within noise."""
    base, new = _trees(tmp_path)
    script = REPO / "bench" / "abrows.py"
    [slower] = run_ab(script, {"base": base, "new": new}, CPU_ROW, 8, tmp_path / "ab")
    assert slower["verdict"] == "slower", slower
    assert len(slower["base_ms"]) == len(slower["new_ms"]) == len(slower["aa_ms"]) == 8
    assert slower["change"] > 2.0
    [same] = run_ab(script, {"base": base, "new": base}, CPU_ROW, 8, tmp_path / "aa")
    assert same["verdict"] == "within noise", same


def test_worker_refuses_an_nmoe_from_outside_its_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import abrows
    finally:
        sys.path.remove(str(REPO / "bench"))
    monkeypatch.chdir(tmp_path)
    assert abrows.main([]) == 2
    assert "not from the tree under test" in json.loads(capsys.readouterr().out)["error"]
    assert "unknown" in abrows._answer({}, "build", "nosuchrow")["error"]
    assert "build it first" in abrows._answer({}, "time", "relu2_spec_cpu")["error"]
    with pytest.raises(ValueError, match="at least 4"):
        run_ab(REPO / "bench" / "abrows.py", {"base": tmp_path, "new": tmp_path}, CPU_ROW, 3, tmp_path)


def test_broken_spec_gives_a_red_report_and_unrelated_edit_proves_nothing(tmp_path: Path) -> None:
    repo = _snapshot(tmp_path / "repo")
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nmore words\n")
    _commit(repo, "docs only")
    rc, doc = _prove(repo, tmp_path / "docs", "HEAD~1")
    assert (rc, doc["verdict"], doc["ops"], doc["changed"]) == (0, "nothing to prove", {}, ["README.md"])
    assert isinstance(doc["commits"], dict) and not doc["commits"].get("dirty", True)

    _edit(repo / "nmoe/reference/activation.py", *RELU2)
    rc, doc = _prove(repo, tmp_path / "refused", "--no-mutants", "--no-compile", "--cases", "1")
    assert rc == 2 and "--allow-dirty" in str(doc["stderr"])
    rc, doc = _prove(repo, tmp_path / "red", "--allow-dirty", "--no-mutants", "--no-compile", "--cases", "1")
    par = doc["parity"]
    assert isinstance(par, dict) and isinstance(doc["commits"], dict) and isinstance(doc["ops"], dict)
    assert rc == 1 and doc["verdict"] == "red" and doc["commits"]["dirty"] is True
    assert "BASE is HEAD" in doc["commits"]["compared"]
    assert doc["ops"]["relu2"] == ["nmoe/reference/activation.py"]
    assert par["status"] == "fail" and "relu2" in {f["op"] for f in par["failed"]}
    assert doc["bench"] == {"status": "not run", "reason": prove.BENCH_NO_GPU, "repetitions": 0,
                            "interleaved": True, "rows": []}
    assert "FAIL relu2" in (tmp_path / "red" / "prove.md").read_text()


@pytest.mark.heavy
def test_catalog_edit_runs_compiles_and_cpu_mutants(tmp_path: Path) -> None:
    repo = _snapshot(tmp_path / "repo")
    cat = repo / "mutations/catalog/activation.py"
    cat.write_text(cat.read_text() + "\n")
    _commit(repo, "catalog touched")
    rc, doc = _prove(repo, tmp_path / "out", "HEAD~1", "--cases", "1")
    mut = doc["mutation"]
    assert isinstance(mut, dict) and isinstance(doc["parity"], dict)
    assert rc == 0 and doc["verdict"] == "green", mut
    assert doc["parity"]["summary"]["compile"]["ok"] > 0
    assert {m["status"] for m in mut["mutants"]} <= {"Killed", "Ignored"}


@pytest.mark.heavy
def test_staged_broken_spec_is_red_on_a_host_without_git(tmp_path: Path) -> None:
    """--stage where git is writes both trees and the plan; --staged proves them from a copy without .git."""
    repo = _snapshot(tmp_path / "repo")
    _edit(repo / "nmoe/reference/activation.py", *RELU2)
    broken = _commit(repo, "relu2 spec drops the square")
    stage = tmp_path / "stage"
    rc, doc = _prove(repo, stage, "--head", "HEAD", "--stage", str(stage))
    assert rc == 0 and not (stage / "prove.json").exists()
    plan = json.loads((stage / "plan.json").read_text())["plan"]
    assert (plan["head"], plan["base_ref"], plan["dirty"]) == (broken, "HEAD~1", False)
    assert plan["ops"]["relu2"] == ["nmoe/reference/activation.py"] and "swiglu" in plan["ops"]
    assert sum(f.stat().st_size for f in stage.iterdir()) < 10 * 2**20
    host = tmp_path / "host"
    export(REPO, None, host)
    rc, doc = _prove(host, tmp_path / "out", "--staged", str(stage), "--ops", "relu2", "--no-mutants",
                     "--no-compile", "--cases", "1", "--rows", "relu2_spec_cpu", "--reps", "4")
    par, bench, commits = doc["parity"], doc["bench"], doc["commits"]
    assert isinstance(par, dict) and isinstance(bench, dict) and isinstance(commits, dict)
    assert rc == 1 and doc["verdict"] == "red" and commits["head"] == broken
    assert par["status"] == "fail" and {f["op"] for f in par["failed"]} == {"relu2"}
    assert [r["name"] for r in bench["rows"]] == ["relu2_spec_cpu"] and bench["repetitions"] == 4
    assert doc["ops"] == {"relu2": ["nmoe/reference/activation.py"]}


@pytest.mark.gpu
def test_gpu_ab_double_launch_is_slower_and_aa_is_within_noise(tmp_path: Path) -> None:
    """The CUDA rows on an H200: a relu2 whose glue launches the kernel twice is slower; BASE against itself
    is within noise (graph replays between L2 flushes, one worker process per tree)."""
    base, new = tmp_path / "base", tmp_path / "new"
    export(REPO, None, base)
    export(REPO, None, new)
    twice = "    _relu2_op(x)\n    return _relu2_op(x)\n"
    _edit(new / "nmoe/fast/activation.py", "    return _relu2_op(x)\n", twice)
    script = REPO / "bench" / "abrows.py"
    rows = {"relu2_fwd": ("relu2", 0.01), "swiglu_fwd": ("swiglu", 0.01)}
    slower, same = run_ab(script, {"base": base, "new": new}, rows, 8, tmp_path / "ab")
    assert slower["verdict"] == "slower" and slower["change"] > 0.5, slower
    assert same["verdict"] == "within noise", same
    [aa] = run_ab(script, {"base": base, "new": base}, {"relu2_fwd": ("relu2", 0.01)}, 8, tmp_path / "aa")
    assert aa["verdict"] == "within noise", aa


def test_a_row_neither_tree_runs_is_not_run_but_one_the_change_breaks_is_red() -> None:
    """A row newer than both trees (a historical proof) says so; breaking a row BASE runs is red."""
    faster = {"name": "up", "verdict": "faster"}
    later = {"name": "gathered", "error": {"base": "ImportError", "new": "ImportError", "aa": "ImportError"}}
    regressed = {"name": "down", "error": {"new": "RuntimeError"}}
    assert prove.bench_verdict([faster, later]) == ("pass", "1 faster; neither tree runs gathered")
    assert prove.bench_verdict([later]) == ("not run", "neither tree runs gathered")
    assert prove.bench_verdict([faster, regressed, later]) == \
        ("fail", "the new tree cannot run down; 1 faster; neither tree runs gathered")


def test_tree_env_keeps_installed_packages_but_not_another_checkout(tmp_path: Path) -> None:
    other, site, tree = tmp_path / "other", tmp_path / "site", tmp_path / "tree"
    (other / "nmoe").mkdir(parents=True)
    (site / "cutlass").mkdir(parents=True)
    path = tree_pythonpath(tree, os.pathsep.join([str(other), str(site)]))
    assert path.split(os.pathsep) == [str(tree), str(site)]
    assert tree_pythonpath(tree, None) == str(tree)


def test_the_applied_mutant_is_left_out_of_its_trees_catalog_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def fake_in_tree(tree: Path, env: object, args: list[str], timeout: float) -> tuple[int, str, str]:
        seen.append(args[args.index("--only") + 1])
        return 2, "", "stop here"

    monkeypatch.setattr(prove, "in_tree", fake_in_tree)
    catalog = [("relu2.square_dropped", ["relu2"]), ("relu2.tail", ["relu2"])]
    prove.run_mutants(REPO, {}, ["relu2"], catalog, prove.Options(None, tmp_path), None, "", "relu2.tail")
    assert seen == ["relu2.square_dropped"]
