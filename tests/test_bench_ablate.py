"""The GEMM and MoE layer performance ablations stay applicable: each anchor matches once in the source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.ablations import COMPOUNDS, SETS, variants_of
from mutations.model import apply, check_anchors

ROOT = Path(__file__).resolve().parents[1]


def test_ablation_anchors_match_once() -> None:
    parts = tuple(m for c in COMPOUNDS.values() for v in c for m in v[:1])
    assert set(SETS) == {"gemm", "gather", "layer", "fp8", "step"} and all(SETS.values())
    assert check_anchors(ROOT, tuple(a for s in SETS.values() for a in s) + parts) == []


@pytest.mark.parametrize("which", list(SETS))
def test_each_ablation_changes_its_files_in_order(which: str) -> None:
    """Every edit of a variant matches exactly once in the source its earlier edits left, and changes it."""
    for variant in variants_of(which):
        sources: dict[str, str] = {}
        for a in variant:
            source = sources.get(a.file, (ROOT / a.file).read_text(encoding="utf-8"))
            assert source.count(a.anchor) == 1, (variant[0].id, a.id)
            sources[a.file] = apply(source, a)
            assert sources[a.file] != source
        for file, edited in sources.items():
            compile(edited, file, "exec")


def test_variant_ids_are_unique_and_compounds_are_in_their_sets() -> None:
    ids = [v[0].id for w in SETS for v in variants_of(w)]
    assert len(ids) == len(set(ids))
    for which, compounds in COMPOUNDS.items():
        assert {v[0].id for v in compounds} <= {v[0].id for v in variants_of(which)}


def test_unknown_routing_is_refused_before_any_copy(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.ablate import main
    with pytest.raises(SystemExit):
        main(["--routings", "uniform,zipf9"])
    assert "zipf9" in capsys.readouterr().err


class Child:
    """A bench.ablate child that compiles at once and times one row."""

    returncode = 0
    stdout = ('{"shape": "s", "ms": 1.0, "tflops": 1.0, "bn": 0}\n',)

    def communicate(self) -> tuple[str, None]:
        return ("", None)

    def wait(self) -> int:
        return 0


def _fake_children(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run: Any) -> Any:
    """bench.ablate with its copies of nmoe/ alone under tmp_path and its children made by `run`."""
    import bench.ablate as ab

    monkeypatch.setattr(ab, "copy_tree", lambda src, dst: ab.shutil.copytree(src / "nmoe", dst / "nmoe"))
    monkeypatch.setattr(ab.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(ab, "_run", run)
    return ab


def test_compiles_run_in_waves_of_jobs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The baseline compiles alone into the shared kernel cache, then --jobs bounds the compile children alive
    at once (each layer-set child holds a layer's GPU memory)."""
    alive: list[int] = []
    live = [0]

    class Counted(Child):
        def __init__(self, compile_only: bool) -> None:
            self.compile_only = compile_only
            live[0] += compile_only
            alive.append(live[0])

        def communicate(self) -> tuple[str, None]:
            live[0] -= self.compile_only
            return ("", None)

    ab = _fake_children(monkeypatch, tmp_path, lambda copy, compile_only, *a: Counted(compile_only))
    only = ",".join(v[0].id for v in variants_of("layer")[:5])
    assert ab.main(["--set", "layer", "--only", only, "--jobs", "3"]) == 0
    assert alive[:7] == [1, 1, 2, 3, 1, 2, 3] and len(alive) == 2 * 7
    with pytest.raises(SystemExit):
        ab.main(["--jobs", "-1"])


def test_configs_pick_rows_and_reach_every_child(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--configs names the layer or gather rows to time, in its order; every compile and timing child gets
    it; anything but row indices is refused before any copy."""
    seen: list[str] = []

    def run(copy: Path, compile_only: bool, *rest: str) -> Child:
        seen.append(rest[3])
        return Child()

    ab = _fake_children(monkeypatch, tmp_path, run)
    assert ab._picked("abc", "2,0") == ["c", "a"] and ab._picked("ab", "") == ["a", "b"]
    assert ab.main(["--set", "layer", "--only", variants_of("layer")[0][0].id, "--configs", "0,2"]) == 0
    assert seen == ["0,2"] * 6
    with pytest.raises(SystemExit):
        ab.main(["--set", "layer", "--configs", "c1"])


def test_copies_share_one_kernel_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every copy's child keys kernels by source content into one cache beside the copies, so the baseline's
    kernels serve every variant that leaves their sources alone."""
    import bench.ablate as ab

    envs: list[tuple[str, str]] = []
    monkeypatch.setattr(ab.subprocess, "Popen", lambda *a, env, **k: envs.append(
        (env["NMOE_KERNEL_CACHE"], env[ab.PROGRESS_ENV])))
    for name in ("baseline", "ablate.x"):
        ab._run(tmp_path / name, True, "layer", "fwd", "uniform", "", tmp_path / "p.progress")
    assert envs == [(str(tmp_path / ".kernels"), str(tmp_path / "p.progress"))] * 2


def test_children_name_each_row_in_the_progress_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A child appends its copy's name and the row it starts, so a run cut by a hung kernel names it."""
    import bench.ablate as ab

    (tmp_path / "ablate.x").mkdir()
    monkeypatch.chdir(tmp_path / "ablate.x")
    monkeypatch.delenv(ab.PROGRESS_ENV, raising=False)
    ab._note("nowhere")
    monkeypatch.setenv(ab.PROGRESS_ENV, str(tmp_path / "p.progress"))
    ab._note("up_gathered T=1")
    ab._note("up_copied T=1")
    lines = (tmp_path / "p.progress").read_text().splitlines()
    assert [ln.split(" ", 1)[1] for ln in lines] == ["ablate.x up_gathered T=1", "ablate.x up_copied T=1"]


def test_passes_are_checked_per_set_and_reach_every_child(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """The layer set takes fwd and fwd_bwd (both by default), the gemm set fwd, dgrad and wgrad; a pass the
    set lacks is refused before any copy."""
    seen: list[str] = []

    def run(copy: Path, compile_only: bool, which: str, passes: str, *rest: str) -> Child:
        seen.append(passes)
        return Child()

    ab = _fake_children(monkeypatch, tmp_path, run)
    only = variants_of("layer")[0][0].id
    assert ab.main(["--set", "layer", "--only", only, "--passes", "fwd_bwd"]) == 0
    assert seen == ["fwd_bwd"] * 6
    assert ab.main(["--set", "layer", "--only", only]) == 0
    assert seen[6:] == ["fwd,fwd_bwd"] * 6
    for argv in (["--set", "layer", "--passes", "wgrad"], ["--set", "gemm", "--passes", "fwd_bwd"]):
        with pytest.raises(SystemExit):
            ab.main(argv)


def test_a_row_past_its_timeout_ends_its_child(tmp_path: Path) -> None:
    """A child whose row outlasts --row-timeout exits with its stacks dumped, even while blocked outside
    Python (as in a wait for a kernel that never returns); the progress file names the row."""
    import os
    import subprocess
    import sys

    import bench.ablate as ab
    from nmoe.checkout import tree_pythonpath

    (tmp_path / "ablate.x").mkdir()
    env = {**os.environ, "PYTHONPATH": tree_pythonpath(ROOT, os.environ.get("PYTHONPATH")),
           ab.ROW_TIMEOUT_ENV: "1", ab.PROGRESS_ENV: str(tmp_path / "p.progress")}
    code = "import time\nfrom bench.ablate import _note\n_note('stuck T=1')\ntime.sleep(60)\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "ablate.x", env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "Timeout" in done.stderr and "time.sleep" not in done.stdout
    assert (tmp_path / "p.progress").read_text().split(" ", 1)[1] == "ablate.x stuck T=1\n"


def test_a_child_that_fails_after_some_rows_is_an_error_with_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A timing child that ends badly (its row timeout, a crash) leaves its copy's rows as an error holding
    the rows it did time; the other copies are timed all the same, and the run exits 1."""
    import json

    class Cut(Child):
        returncode = 1

        def wait(self) -> int:
            return 1

    ab = _fake_children(monkeypatch, tmp_path, lambda copy, compile_only, *a: (
        Cut() if copy.name != "baseline" and not compile_only else Child()))
    out = tmp_path_factory.mktemp("out") / "ab.json"
    only = variants_of("layer")[0][0].id
    assert ab.main(["--set", "layer", "--only", only, "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert rows["baseline"] == [json.loads(Child.stdout[0])]
    assert rows[only]["timed"] == [json.loads(Child.stdout[0])] and "error" in rows[only]


def test_step_set_compiles_one_child_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A step-set child holds a moonlet model and its optimizer (~70 GB): by default its compile children
    run one after another, and more at once is refused before any copy."""
    live, peak = [0], [0]

    class Counted(Child):
        def __init__(self, compile_only: bool) -> None:
            self.compile_only = compile_only
            live[0] += compile_only
            peak[0] = max(peak[0], live[0])

        def communicate(self) -> tuple[str, None]:
            live[0] -= self.compile_only
            return ("", None)

    ab = _fake_children(monkeypatch, tmp_path, lambda copy, compile_only, *a: Counted(compile_only))
    assert ab.main(["--set", "step"]) == 0
    assert peak == [1]
    with pytest.raises(SystemExit):
        ab.main(["--set", "step", "--jobs", "2"])
