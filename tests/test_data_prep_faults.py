"""`nmoe prep` under faults: stopped early it never claims 100% or leaves a complete-looking dataset; every
fault ends in one line naming the fix; a second prep into the same --out is refused, naming the holder."""

from __future__ import annotations

import errno
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nmoe.data import prep

PREP = ["--workers", "1", "--shard-bytes", "200"]


def _jsonl(path: Path, n: int, bad_at: int | None = None) -> Path:
    lines = [json.dumps({"text": f"document number {i} " + "word " * 40}) for i in range(n)]
    if bad_at is not None:
        lines[bad_at] = '{"text": "unterminated'
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("nmoe prep:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, n_docs: int) -> None:
    real = prep.iter_file_documents

    def docs(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
        for i, item in enumerate(real(path, text_field)):
            if i == n_docs:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(prep, "iter_file_documents", docs)


def test_bad_json_line_at_15_percent_does_not_report_100(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    src = _jsonl(tmp_path / "a.jsonl", 100, bad_at=15)
    out = tmp_path / "out"
    assert prep.main([str(src), "--out", str(out), *PREP]) == 1
    err = capsys.readouterr().err
    assert "100.0%" not in err
    assert "a.jsonl:16: invalid JSON" in _one_line_error(err)
    assert not (out / "manifest.json").exists()


def test_ctrl_c_at_30_percent_stops_without_100_or_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    src = _jsonl(tmp_path / "a.jsonl", 100)
    out = tmp_path / "out"
    _interrupt_after(monkeypatch, 30)
    assert prep.main([str(src), "--out", str(out), *PREP]) == 130
    err = capsys.readouterr().err
    assert "100.0%" not in err
    line = _one_line_error(err)
    assert "interrupted" in line and "re-run the same command" in line
    assert not (out / "manifest.json").exists()
    with pytest.raises(prep.PrepError, match="did not finish"):
        prep.read_manifest(out)
    monkeypatch.undo()
    assert prep.main([str(src), "--out", str(out), *PREP, "--no-progress"]) == 0
    assert prep.verify(out) == []


def test_interrupted_rerun_does_not_leave_the_old_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    src = _jsonl(tmp_path / "a.jsonl", 100)
    out = tmp_path / "out"
    assert prep.main([str(src), "--out", str(out), *PREP, "--no-progress"]) == 0
    for f in out.glob("shard_00001.*"):
        f.unlink()
    _interrupt_after(monkeypatch, 3)
    assert prep.main([str(src), "--out", str(out), *PREP, "--no-progress"]) == 130
    with pytest.raises(prep.PrepError, match="did not finish"):
        prep.read_manifest(out)


def test_truncated_gz_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = gzip.compress(_jsonl(tmp_path / "a.jsonl", 200).read_bytes())
    src = tmp_path / "b.jsonl.gz"
    src.write_bytes(raw[: len(raw) // 2])
    assert prep.main([str(src), "--out", str(tmp_path / "out"), *PREP]) == 1
    err = capsys.readouterr().err
    line = _one_line_error(err)
    assert "b.jsonl.gz" in line and "truncated or corrupt gzip" in line
    assert "100.0%" not in err


def _fail_writes(monkeypatch: pytest.MonkeyPatch, out: Path, code: int) -> None:
    real_open = os.open

    def fake_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if str(path).startswith(str(out)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake_open)


def test_read_only_out_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    src = _jsonl(tmp_path / "a.jsonl", 10)
    out = tmp_path / "ro"
    out.mkdir()
    _fail_writes(monkeypatch, out, errno.EROFS)
    assert prep.main([str(src), "--out", str(out), *PREP]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "cannot write" in line and "writable --out" in line


def test_full_out_is_one_line_and_leaves_no_partial_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    src = _jsonl(tmp_path / "a.jsonl", 100)
    out = tmp_path / "out"

    def full(self: Any, flat: np.ndarray, lengths: np.ndarray) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.tmp))

    monkeypatch.setattr(prep._ShardWriter, "add", full)
    assert prep.main([str(src), "--out", str(out), *PREP]) == 1
    err = capsys.readouterr().err
    line = _one_line_error(err)
    assert "no space left" in line.lower() and "free space" in line
    assert "100.0%" not in err
    assert not list(out.glob("*.tmp")) and not (out / "manifest.json").exists()


def test_out_naming_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _jsonl(tmp_path / "a.jsonl", 10)
    target = tmp_path / "file.txt"
    target.write_text("x")
    assert prep.main([str(src), "--out", str(target), *PREP]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "is a file" in line and "--out" in line
    assert prep.main([str(src), "--out", str(target / "sub"), *PREP]) == 1
    assert "is a file" in _one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("kind", ["config_error", "not_utf8", "directory", "missing"])
def test_bad_config_is_one_line(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    if kind == "config_error":
        cfg.write_text("[data]\nno_such_key = 1\n")
    elif kind == "not_utf8":
        cfg.write_bytes(b"[data]\ndataset_dir = \"\xff\xfe\"\n")
    elif kind == "directory":
        cfg.mkdir()
    assert prep.main(["--config", str(cfg), *PREP]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert str(cfg) in line
    want = {"config_error": "no_such_key", "not_utf8": "UTF-8", "directory": "is a directory",
            "missing": "not found"}[kind]
    assert want in line


def test_second_prep_into_the_same_out_is_refused_naming_the_holder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _jsonl(tmp_path / "a.jsonl", 20)
    out = tmp_path / "out"
    out.mkdir()
    with prep.out_lock(out):
        assert prep.main([str(src), "--out", str(out), *PREP]) == 1
        line = _one_line_error(capsys.readouterr().err)
        assert f"pid {os.getpid()}" in line and "another `nmoe prep`" in line
        assert not (out / "plan.json").exists()
    assert prep.main([str(src), "--out", str(out), *PREP, "--no-progress"]) == 0
    assert prep.verify(out) == []


def test_verify_flags_out_of_vocab_ids_and_bad_manifest(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "a.jsonl", 20)
    out = tmp_path / "out"
    assert prep.main([str(src), "--out", str(out), *PREP, "--no-progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["vocab_size"] = 100
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = prep.verify(out)
    assert problems and all("token id" in p and ">= vocab_size 100" in p for p in problems)
    (out / "manifest.json").write_text('{"format": ')
    with pytest.raises(prep.PrepError, match=r"manifest\.json is not valid JSON"):
        prep.read_manifest(out)


@pytest.mark.heavy
def test_real_sigint_with_workers_ends_in_one_line(tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group: the spawned workers must not print tracebacks of their own."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "nmoe.cli", "prep", "--out", str(out), "--workers", "2", "--shard-bytes",
           "300000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("shard_*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "100.0%" not in err
    assert "interrupted" in _one_line_error(err)
    assert not (out / "manifest.json").exists()
