"""The trainer under faults: a concurrent metrics reader, an unwritable or busy checkpoint dir, corrupt
shard values, a SIGKILLed run, and `nmoe metrics` from another directory."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_train_loop import REPO, make_cfg, run

from nmoe.data import prep
from nmoe.data.tokenizer import EOS_ID
from nmoe.runreport import main as metrics_main
from nmoe.train import checkpoint as ckpt
from nmoe.train.data import DataError
from nmoe.train.metrics import ExperimentsDB, runs_main
from nmoe.train.metricstore import MetricsWriter


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "default"
    assert prep.main(["--out", str(out), "--workers", "1", "--no-progress"]) == 0
    return out


READER = textwrap.dedent("""
    import contextlib, io, sys, time
    from pathlib import Path
    from nmoe.runreport import main as metrics_main
    run, db, ready, stop = sys.argv[1:5]
    seen, reads = 0, 0
    while True:
        last = Path(stop).exists()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = metrics_main([run, "--db", db])
        if rc == 0:
            n = int(next(ln.split()[1] for ln in out.getvalue().splitlines() if ln.startswith("loss ")))
            assert n >= seen, (n, seen)
            seen, reads = n, reads + 1
            Path(ready).touch()
        if last:
            break
    print(reads, seen)
""")


def test_concurrent_reader_never_disturbs_training(tmp_path: Path, dataset: Path) -> None:
    cfg = make_cfg(tmp_path, dataset, "--train.log_every=1")
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    procs: list[subprocess.Popen[str]] = []

    def start_reader(step: int, loss: float) -> None:
        if step == 1:
            db = ExperimentsDB(cfg.metrics.db_path)
            (row,) = db.runs()
            db.close()
            procs.append(subprocess.Popen([sys.executable, "-c", READER, row["id"], cfg.metrics.db_path,
                                           str(ready), str(stop)], text=True, stdout=subprocess.PIPE,
                                          env={**os.environ, "PYTHONPATH": str(REPO)}))
        if step == 3:
            deadline = time.monotonic() + 60
            while not ready.exists() and procs[0].poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)

    try:
        res = run(cfg, 16, on_step=start_reader)
    finally:
        stop.touch()
        out, _ = procs[0].communicate(timeout=120)
    assert res.status == "stopped" and res.step == 16
    assert procs[0].returncode == 0, out
    reads, seen = map(int, out.split())
    assert reads >= 2 and seen == 16


def test_failing_flush_still_ends_the_run(tmp_path: Path, dataset: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg(tmp_path, dataset, "--train.log_every=1")

    def broken(self: MetricsWriter) -> None:
        raise OSError("metrics disk gone")

    monkeypatch.setattr(MetricsWriter, "flush", broken)
    with pytest.raises(OSError, match="metrics disk gone"):
        run(cfg, 3)
    db = ExperimentsDB(cfg.metrics.db_path)
    (row,) = db.runs()
    db.close()
    assert row["status"] == "failed"


def test_unwritable_checkpoint_dir_fails_before_step_1(tmp_path: Path, dataset: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    cfg = make_cfg(tmp_path, dataset, f"--checkpoint.dir={blocker / 'ck'}")
    steps: list[int] = []
    with pytest.raises(ckpt.CheckpointError, match="not writable"):
        run(cfg, 5, on_step=lambda s, loss: steps.append(s))
    assert steps == []


def test_second_trainer_on_one_checkpoint_dir_is_refused(tmp_path: Path, dataset: Path) -> None:
    cfg = make_cfg(tmp_path, dataset)
    holder = rf"in use by run holder-run \(pid {os.getpid()}"
    with ckpt.DirLock(cfg.checkpoint.dir, run="holder-run"), \
            pytest.raises(ckpt.CheckpointError, match=holder):
        run(cfg, 2)
    assert run(cfg, 2).step == 2


def _copy(dataset: Path, to: Path) -> Path:
    to.mkdir()
    for f in dataset.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def test_corrupt_shard_value_is_found_at_run_start(tmp_path: Path, dataset: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bad = _copy(dataset, tmp_path / "bad")
    shard = bad / "shard_00000.bin"
    ids = np.fromfile(shard, dtype="<u4")
    ids[10] ^= 1
    ids.tofile(shard)
    with pytest.raises(DataError, match=r"shard_00000\.bin: .*sha256.*nmoe prep --verify"):
        run(make_cfg(tmp_path, bad), 1)


def test_out_of_vocab_id_names_the_shard_and_verify(tmp_path: Path, dataset: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bad = _copy(dataset, tmp_path / "bad")
    shard = bad / "shard_00000.bin"
    ids = np.fromfile(shard, dtype="<u4")
    first_half = (np.arange(ids.size) < ids.size // 2) & (ids != EOS_ID)  # the index still matches
    ids[first_half] = 250_000  # beyond the 201088-token vocab
    ids.tofile(shard)
    manifest = (bad / "manifest.json").read_text()
    old = next(m["sha256"] for m in prep.read_manifest(bad)["shards"] if m["file"] == shard.name)
    (bad / "manifest.json").write_text(manifest.replace(old, prep.sha256_file(shard)))
    with pytest.raises(DataError, match=r"shard_00000\.bin: token id 250000 .*vocab.*nmoe prep --verify"):
        run(make_cfg(tmp_path, bad), 30)


def test_shard_verification_is_cached_by_size_and_mtime(tmp_path: Path, dataset: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = _copy(dataset, tmp_path / "data")
    calls: list[Path] = []
    real = prep.verify

    def counting(directory: Path) -> list[str]:
        calls.append(directory)
        return real(directory)

    monkeypatch.setattr(prep, "verify", counting)
    run(make_cfg(tmp_path, data, name="a"), 1)
    run(make_cfg(tmp_path, data, name="b"), 1)
    assert len(calls) == 1
    shard = data / "shard_00000.bin"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    run(make_cfg(tmp_path, data, name="c"), 1)
    assert len(calls) == 2


KILLED = textwrap.dedent("""
    import os, signal, sys
    from nmoe.config import from_dict
    from nmoe.train.metrics import ExperimentsDB
    cfg = from_dict({"metrics": {"db_path": sys.argv[1]}}, env={})
    ExperimentsDB(sys.argv[1]).start_run("killed-run", cfg, world=1, resumed=False)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_sigkilled_run_is_reported_dead(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db_path = tmp_path / "x.sqlite"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", KILLED, str(db_path)], env=env, check=False)
    assert p.returncode == -signal.SIGKILL
    assert runs_main(["--db", str(db_path)]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("killed-run")]
    assert " dead " in line and "running" not in line
    db = ExperimentsDB(db_path)
    (row,) = db.runs()
    db.close()
    assert row["status"] == "dead"


def test_metrics_from_another_directory(tmp_path: Path, dataset: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    cfg = make_cfg(Path("rel"), dataset)
    res = run(cfg, 5)
    monkeypatch.chdir(elsewhere)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert metrics_main([res.run_id, "--db", str(work / cfg.metrics.db_path)]) == 0
    assert "\nloss " in out.getvalue()
