"""`nmoe train`: the config is read before any GPU check, `device` means what it says, the spec model runs
only when named, and the exit status tells a finished run from an interrupted or failed one."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nmoe import traincli
from nmoe.cli import main as nmoe_main
from nmoe.data import prep
from nmoe.train.loop import TrainResult

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny.toml")


def test_missing_config_gets_the_missing_file_message(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert nmoe_main(["train", str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err
    assert "nope.toml: file not found" in err and "sm_90a" not in err


def test_cpu_device_with_the_fast_model_is_refused_before_any_gpu_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert traincli.main([TINY, "--train.model=fast"]) == 2
    err = capsys.readouterr().err
    assert 'train.model: "fast" on device "cpu"' in err and "no CUDA device" not in err


@pytest.mark.skipif(traincli.gpu_problem() is None, reason="a supported GPU is present")
def test_fast_model_without_gpu_stops_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert traincli.main([TINY, "--train.device=cuda", "--train.model=fast"]) == 2
    err = capsys.readouterr().err
    assert "sm_90a" in err and "sm_100a" in err and "no CUDA device" in err and 'model = "reference"' in err


@pytest.mark.parametrize(("status", "signum", "code"), [
    ("completed", None, 0), ("stopped", None, 0), ("interrupted", 15, 143), ("interrupted", 2, 130),
    ("failed", None, 1),
])
def test_exit_code_follows_the_run(status: str, signum: int | None, code: int) -> None:
    assert traincli.exit_code(TrainResult("r", status, 3, 96, signum=signum)) == code


def test_interrupted_run_exits_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traincli, "train", lambda *a, **k: TrainResult("r", "interrupted", 3, 96, signum=15))
    monkeypatch.setattr(traincli, "build_model", lambda cfg, rank, world: None)
    assert traincli.main([TINY]) == 143


def test_tiny_config_trains_the_spec_model_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    assert prep.main(["--out", str(data), "--workers", "1", "--no-progress"]) == 0
    args = [TINY, f"--data.dataset_dir={data}", f"--checkpoint.dir={tmp_path / 'ck'}",
            f"--metrics.db_path={tmp_path / 'x.sqlite'}", f"--metrics.dir={tmp_path / 'm'}",
            "--schedule.total_tokens=64", "--schedule.warmup_tokens=0"]
    assert nmoe_main(["train", *args]) == 0
    assert "completed at step 1" in capsys.readouterr().out


def test_torchrun_two_cpu_ranks_train_one_run(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m nmoe.cli train` on the CPU (gloo): one progress line per step, one
    closing line, and both ranks' metrics under rank 0's run id."""
    data = tmp_path / "data"
    assert prep.main(["--out", str(data), "--workers", "1", "--no-progress"]) == 0
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "nmoe.cli", "train",
            TINY, f"--data.dataset_dir={data}", f"--checkpoint.dir={tmp_path / 'ck'}",
            f"--metrics.db_path={tmp_path / 'x.sqlite'}", f"--metrics.dir={tmp_path / 'm'}",
            "--data.batch_size=1", "--schedule.total_tokens=192", "--schedule.warmup_tokens=64",
            "--train.log_every=1"]
    p = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [ln for ln in p.stderr.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/3", "2/3", "3/3"], p.stderr[-3000:]
    (done,) = [ln for ln in p.stdout.splitlines() if "completed at step 3" in ln]
    run = done.rsplit("run ", 1)[1]
    assert sorted(d.name for d in (tmp_path / "m").iterdir()) == [f"{run}.rank000", f"{run}.rank001"]


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [f"{node.module}.{a.name}" for a in node.names]
    return []


def test_train_package_never_imports_the_spec() -> None:
    """Checked on the source, so an import inside a function (a fallback path) counts too."""
    found = [f"{path.name}: {name}" for path in sorted((REPO / "nmoe" / "train").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) for name in _imported(node)
             if name.startswith(("nmoe.reference", "parity"))]
    assert found == []


def test_the_loss_chunk_comes_from_the_config() -> None:
    from nmoe.config import load_config

    cfg = load_config(TINY, env={}, overrides=["--train.ce_chunk=7"])
    assert traincli.build_model(cfg).ce_chunk == 7
