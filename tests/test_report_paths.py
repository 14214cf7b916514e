"""Where the report commands write: the parity history lives in the user's data dir (never the installed
package) and survives concurrent runs; `--report`/`--out`/`--db` are checked before any work; `nmoe bench`
on a CPU still writes its results file, every row "not run" with the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch

from mutations import runner
from nmoe import benchcli
from parity import cli, report

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    skip = ("COV_CORE_", "COVERAGE_", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    env.setdefault("PYTHONPATH", str(ROOT))
    env.update(extra)
    return env


def _tiny_report(n: int) -> dict[str, Any]:
    case = {"op": "relu2", "contract": "bitwise", "arch": "cpu", "dtype": "bf16", "shape": {"n": n},
            "seed": n, "case": "random/0", "mode": "selfcheck", "status": "pass", "worst": {"ulp": 0},
            "reason": "r"}
    return report.build({k: None for k in report.PROVENANCE_KEYS}, [case], [], {"mode": "selfcheck"})


def _count(db: Path) -> int:
    con = duckdb.connect(str(db), read_only=True)
    try:
        row = con.execute("SELECT count(*) FROM parity_runs").fetchone()
    finally:
        con.close()
    assert row is not None
    return int(row[0])


def test_default_history_follows_the_env_var_then_the_user_data_dir(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(report.DB_ENV, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert report.default_db() == tmp_path / "data" / "nmoe" / "parity-history.duckdb"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert report.default_db() == tmp_path / "home" / ".local" / "share" / "nmoe" / "parity-history.duckdb"
    monkeypatch.setenv(report.DB_ENV, str(tmp_path / "h.duckdb"))
    assert report.default_db() == tmp_path / "h.duckdb"
    assert not report.default_db().is_relative_to(ROOT / "parity")


def test_installed_from_a_wheel_parity_writes_no_file_into_the_package(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "corpus")
    for pkg in ("nmoe", "parity", "mutations"):
        shutil.copytree(ROOT / pkg, site / pkg, ignore=ignore)
    before = {p for p in site.rglob("*") if "__pycache__" not in p.parts}
    env = _env(PYTHONPATH=str(site), XDG_DATA_HOME=str(tmp_path / "data"), PYTHONDONTWRITEBYTECODE="1")
    env.pop(report.DB_ENV, None)
    cmd = [sys.executable, "-m", "nmoe.cli", "parity", "--ops", "relu2", "--cases", "1", "--no-compile",
           "--quiet"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = {p for p in site.rglob("*") if "__pycache__" not in p.parts}
    assert after == before, sorted(map(str, after - before))
    assert _count(tmp_path / "data" / "nmoe" / "parity-history.duckdb") == 1


_APPENDER = textwrap.dedent("""
    import json, sys
    from parity import report
    run = json.loads(open(sys.argv[2]).read())
    for _ in range(int(sys.argv[3])):
        report.append_db(sys.argv[1], run)
""")


def test_two_processes_append_to_one_history_concurrently(tmp_path: Path) -> None:
    db = tmp_path / "h.duckdb"
    report.write_json(tmp_path / "run.json", _tiny_report(0))
    cmd = [sys.executable, "-c", _APPENDER, str(db), str(tmp_path / "run.json"), "15"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in outs]
    assert _count(db) == 30


_HOLDER = textwrap.dedent("""
    import sys, time, duckdb
    con = duckdb.connect(sys.argv[1])
    print("holding", flush=True)
    time.sleep(float(sys.argv[2]))
    con.close()
""")


def _hold(db: Path, seconds: float) -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(db), str(seconds)], env=_env(),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def test_append_waits_for_a_holder_then_gives_up_naming_it(tmp_path: Path) -> None:
    db = tmp_path / "h.duckdb"
    holder = _hold(db, 1.0)
    t0 = time.monotonic()
    report.append_db(db, _tiny_report(0), wait_s=30.0)
    assert time.monotonic() - t0 < 20.0
    holder.wait(timeout=30)
    holder = _hold(db, 60.0)
    try:
        with pytest.raises(report.HistoryLocked) as err:
            report.append_db(db, _tiny_report(1), wait_s=0.5)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    msg = str(err.value)
    assert str(db) in msg and f"PID {holder.pid}" in msg and "--no-db" in msg and "\n" not in msg
    assert _count(db) == 1


def _bad_path(tmp_path: Path) -> Path:
    """Unwritable for root too: its parent is a regular file."""
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "r.json"


def _one_line(err: str, command: str, path: Path, flag: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{command}: "), err
    assert str(path) in lines[0] and flag in lines[0] and "writable" in lines[0]


@pytest.mark.parametrize("flag", ["--report", "--db"])
def test_parity_checks_its_output_paths_before_any_case(flag: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    def no_run(*_: object) -> None:
        raise AssertionError("a case ran before the output paths were checked")

    monkeypatch.setattr(cli, "run", no_run)
    bad = _bad_path(tmp_path)
    good = {"--report": str(tmp_path / "r.json"), "--db": str(tmp_path / "h.duckdb")}
    args = {**good, flag: str(bad)}
    assert cli.main(["--ops", "relu2", "--quiet", *[x for kv in args.items() for x in kv]]) == 2
    _one_line(capsys.readouterr().err, "nmoe parity", bad, flag)


def test_mutate_checks_its_report_path_before_any_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def no_run(*_: object) -> int:
        raise AssertionError("a mutant ran before the report path was checked")

    monkeypatch.setattr(runner, "_run", no_run)
    bad = _bad_path(tmp_path)
    assert runner.main(["--only", "relu2.*", "--report", str(bad)]) == 2
    _one_line(capsys.readouterr().err, "nmoe mutate", bad, "--report")


def test_bench_checks_its_out_path_before_pytest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def no_run(*_: object, **__: object) -> None:
        raise AssertionError("pytest started before --out was checked")

    monkeypatch.setattr(benchcli.subprocess, "run", no_run)
    bad = _bad_path(tmp_path)
    assert benchcli.main(["--out", str(bad)]) == 2
    _one_line(capsys.readouterr().err, "nmoe bench", bad, "--out")


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU path of nmoe bench")
def test_bench_on_a_cpu_writes_every_row_as_not_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "nmoe.cli", "bench", "--out", str(out), "-k", "norm"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc) >= {"provenance", "ceilings", "results"} and doc["provenance"]["command"].startswith(
        "nmoe bench")
    rows = doc["results"]
    assert rows and all(r["status"] == "not run" and r["ms"] is None and "GPU" in r["reason"] for r in rows)
    assert all("norm" in r["name"] for r in rows)
    assert f"{len(rows)} not run" in proc.stderr and str(out) in proc.stderr
