"""`nmoe parity` end to end on a CPU: reports, DuckDB history, "not run" accounting, exit codes on a wrong
op injected through the registry API, compile selection and row collection, and the input generators."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
from torch import Tensor

from nmoe.fast import compilecheck
from nmoe.fast.compilecheck import Inventory, Selection
from parity import cli, compiles, inputs, registry, report
from parity.cases import build, make_cases
from parity.ops.activation import square_ties

ROOT = Path(__file__).resolve().parents[1]
BF = torch.bfloat16


CANONICAL_NAN = {BF: 0x7FC0, torch.float32: 0x7FC00000}


def _relu2_correct(x: Tensor) -> Tensor:
    """relu(x)^2 rounded once, NaN as the canonical quiet NaN the spec pins."""
    xf = x.to(torch.float64)
    r = torch.where(xf <= 0, torch.zeros_like(xf), xf)
    out = (r * r).to(torch.float32).to(x.dtype)
    ity = torch.int16 if x.dtype == BF else torch.int32
    nan = torch.tensor(CANONICAL_NAN[x.dtype], dtype=torch.int32).to(ity).view(x.dtype)
    return torch.where(torch.isnan(out), nan, out)


def _relu2_square_dropped(x: Tensor) -> Tensor:
    return torch.where(x <= 0, torch.zeros_like(x), x)


def _run(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "r.json"
    db = str(tmp_path / "h.duckdb")
    rc = cli.main([*args, "--report", str(out), "--db", db, "--quiet", "--no-compile"])
    return rc, json.loads(out.read_text())


def test_selfcheck_writes_schema_valid_report_and_duckdb_rows(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = _run(tmp_path, "--ops", "relu2,permute", "--mode", "selfcheck", "--cases", "2")
    assert rc == 0
    assert report.validate(rep) == []
    cases = rep["cases"]
    assert isinstance(cases, list)
    cpu = [c for c in cases if c["arch"] == "cpu"]
    fast = [c for c in cases if c["arch"] != "cpu"]
    assert cpu and all(c["status"] == "pass" for c in cpu)
    assert {c["case"] for c in cpu} >= {"random/0", "adv:nan/bf16", "adv:ties/fp32", "adv:zipf"}
    assert fast and all(c["status"] == "not run" and c["reason"] for c in fast)
    out = capsys.readouterr().out
    assert "op" in out and "relu2" in out and "cases pass/fail/not run" in out
    con = duckdb.connect(str(tmp_path / "h.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM parity_runs").fetchone() == (1,)
        assert con.execute("SELECT count(*) FROM parity_cases").fetchone() == (len(cases),)
        assert con.execute("SELECT passed, failed, not_run FROM parity_runs").fetchone() == (
            len(cpu), 0, len(fast))
    finally:
        con.close()
    assert cli.main(["--history", "--db", str(tmp_path / "h.duckdb"), "--ops", "relu2"]) == 0
    hist = capsys.readouterr().out
    assert "relu2" in hist and "permute" not in hist


def test_not_run_is_never_counted_as_pass(tmp_path: Path) -> None:
    args = ("--ops", "relu2", "--mode", "parity", "--device", "cpu", "--arch", "sm_90a", "--cases", "2")
    with registry.override("relu2", reference=_relu2_correct, module="no_fast_module_of_this_name"):
        rc, rep = _run(tmp_path, *args)
    assert rc == 0
    cases = rep["cases"]
    assert isinstance(cases, list) and cases
    assert all(c["status"] == "not run" and "no fast implementation" in c["reason"] for c in cases)
    assert rep["summary"] == {**rep["summary"], "passed": 0, "failed": 0, "not_run": len(cases)}
    rc2, rep2 = _run(tmp_path, "--ops", "grouped_gemm_nvfp4", "--mode", "parity", "--device", "cpu", "--arch",
                     "sm_90a", "--cases", "1")
    assert rc2 == 0 and all("sm_100a only" in c["reason"] for c in rep2["cases"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_parity_mode_without_gpu_is_not_run(tmp_path: Path) -> None:
    rc, rep = _run(tmp_path, "--ops", "relu2", "--mode", "parity", "--cases", "1")
    assert rc == 0
    assert all(c["status"] == "not run" and "no CUDA" in c["reason"] for c in rep["cases"])


def test_wrong_fast_op_fails_and_exits_nonzero(tmp_path: Path) -> None:
    entry = registry.REGISTRY["relu2"]
    built = [build(entry, case) for case in make_cases(entry, 2, 0, big=False)]
    assert any(not torch.equal(_relu2_correct(i.args[0]), _relu2_square_dropped(i.args[0])) for i in built)
    args = ("--ops", "relu2", "--mode", "parity", "--device", "cpu", "--arch", "sm_100a", "--cases", "2")
    with registry.override("relu2", fast=_relu2_square_dropped):
        rc, rep = _run(tmp_path, *args)
    assert rc == 1 and rep["summary"]["failed"] > 0
    with registry.override("relu2", fast=_relu2_correct):
        rc, rep = _run(tmp_path, *args)
    assert rc == 0 and rep["summary"]["failed"] == 0
    assert registry.REGISTRY["relu2"].fast is None


def test_wrong_reference_fails_the_selfcheck(tmp_path: Path) -> None:
    with registry.override("relu2", reference=_relu2_square_dropped):
        rc, rep = _run(tmp_path, "--ops", "relu2", "--mode", "selfcheck", "--cases", "1")
    assert rc == 1
    failed = [c for c in rep["cases"] if c["status"] == "fail"]
    assert failed and all("ULP" in c["reason"] for c in failed)


def test_expected_raise_cases(tmp_path: Path) -> None:
    rc, rep = _run(tmp_path, "--ops", "rdep_dispatch", "--mode", "selfcheck", "--cases", "1")
    assert rc == 0
    overflow = [c for c in rep["cases"] if c["case"] == "adv:overflow"]
    assert overflow[0]["status"] == "pass" and "raises" in overflow[0]["reason"]

    def never_raises(xs: list[Tensor], ids: list[Tensor], n_experts: int, capacity: int) -> list[object]:
        return []

    with registry.override("rdep_dispatch", fast=never_raises):
        rc, rep = _run(tmp_path, "--ops", "rdep_dispatch", "--mode", "parity", "--device", "cpu", "--arch",
                       "sm_90a", "--cases", "1")
    assert rc == 1
    overflow = [c for c in rep["cases"] if c["case"] == "adv:overflow"]
    assert overflow[0]["status"] == "fail" and "requires an error" in overflow[0]["reason"]


def test_compile_rows_from_fresh_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_cc.py").write_text(textwrap.dedent("""
        import json, sys
        arch = sys.argv[sys.argv.index("--arch") + 1]
        print("noise a kernel compile may print")
        print(json.dumps([{"op": "relu2", "kernel": "k", "arch": arch, "status": "ok", "seconds": 0.1,
                           "instructions": {"x": True}, "error": None, "argv": sys.argv[1:]}]))
    """))
    (tmp_path / "broken_cc.py").write_text("raise SystemExit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    rows = compilecheck.compile_rows(["sm_90a", "sm_100a"], Selection(ops=("relu2",)), "fake_cc")
    assert [(r["arch"], r["status"]) for r in rows] == [("sm_90a", "ok"), ("sm_100a", "ok")]
    assert rows[0]["argv"] == ["--arch", "sm_90a", "--json", "--ops", "relu2"]
    rows = compilecheck.compile_rows(["sm_90a"], Selection(), "broken_cc")
    assert rows[0]["status"] == "fail" and "exited 3" in rows[0]["error"]
    rows = compilecheck.compile_rows(["sm_100a"], Selection(), "no_such_compilecheck")
    assert rows[0]["status"] == "not run"
    assert all(report.validate(report.build({k: None for k in report.PROVENANCE_KEYS}, [], [r], {})) == []
               for r in rows)


def test_selection_argv() -> None:
    sel = Selection(ops=("a", "b"), modules=("nmoe.fast.norm",), kernels=("k",), ptx_dir="d")
    assert sel.argv() == ["--ops", "a,b", "--modules", "nmoe.fast.norm", "--kernels", "k", "--ptx-dir", "d"]
    assert Selection().argv() == []


def test_compiles_are_selected_by_kernel_spec_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each KernelSpec names its registry op: relu2_bwd compiles its own kernel, not relu2's."""
    kernels = {"relu2": ("relu2_fwd",), "relu2_bwd": ("relu2_bwd",), "combine_bwd": ("combine_bwd",)}
    inv = Inventory(kernels, ())
    monkeypatch.setattr(compilecheck, "inventory", lambda: inv)
    assert compiles.selection(registry.select(["relu2_bwd", "combine_bwd"]), True) == Selection(
        ops=("relu2_bwd", "combine_bwd"))
    assert compiles.selection(registry.select(["relu2", "permute"]), True) == Selection(ops=("relu2",))
    assert compiles.selection(registry.select(["permute", "rope"]), True) is None
    assert compiles.selection(registry.select(["permute"]), False) == Selection()
    broken = Inventory({}, (("nmoe.fast.activation", "ImportError: x"),))
    monkeypatch.setattr(compilecheck, "inventory", lambda: broken)
    spec_only = replace(registry.REGISTRY["rdep_return"], name="spec_only", module="no_module", fast=None)
    reg = {**registry.REGISTRY, "spec_only": spec_only}  # every registry op now has fast code
    assert compiles.selection(registry.select(["relu2", "spec_only"], reg), True) == Selection(ops=("relu2",))


def test_compilecheck_lists_its_kernels_by_op(capsys: pytest.CaptureFixture[str]) -> None:
    assert compilecheck.main(["--list"]) == 0
    listed = json.loads(capsys.readouterr().out)
    inv = compilecheck.inventory()
    assert listed == inv.to_json() and listed["broken"] == []
    assert all(listed["ops"].values()) and set(listed["ops"]) == set(inv.kernels)
    with pytest.raises(SystemExit):
        compilecheck.main(["--arch", "sm_90a", "--ops", "no_such_op"])
    with pytest.raises(SystemExit):
        compilecheck.main(["--ops", "relu2"])


TEST_ONLY = ("pytest", "_pytest", "ml_dtypes", "pytest_benchmark", "coverage", "pytest_cov", "ruff", "mypy")

_BLOCK = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {TEST_ONLY!r}:
            raise ModuleNotFoundError(f"test-only package {{name}} imported on the main path")
sys.meta_path.insert(0, Block())
"""


def test_main_command_needs_no_test_only_package(tmp_path: Path) -> None:
    """`nmoe parity` (with its compile processes) on the runtime dependencies alone: a sitecustomize on the
    path makes every test-only package unimportable in the runner and in its children."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COV_CORE_", "COVERAGE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    probe = subprocess.run([sys.executable, "-c", "import pytest"], env=env, capture_output=True, text=True,
                           check=False)
    assert probe.returncode != 0 and "test-only package pytest" in probe.stderr
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "nmoe.cli", "parity", "--ops", "relu2", "--cases", "1", "--no-db", "--quiet",
           "--report", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["summary"]["passed"] > 0 and rep["summary"]["not_run"] == len(registry.ARCHS)
    assert rep["compile"] and all(r["status"] == "ok" for r in rep["compile"]), rep["compile"]


def test_report_validation_and_strict_json(tmp_path: Path) -> None:
    case = {"op": "x", "contract": "ulp(1)", "arch": "cpu", "dtype": "bf16", "shape": {}, "seed": 0,
            "status": "fail", "worst": {"ulp": float("inf")}, "reason": "r"}
    rep = report.build({k: None for k in report.PROVENANCE_KEYS}, [case], [], {})
    assert report.validate(rep) == []
    report.write_json(tmp_path / "r.json", rep)
    assert json.loads((tmp_path / "r.json").read_text())["cases"][0]["worst"]["ulp"] == "inf"
    bad = report.build({}, [{**case, "status": "not run", "reason": ""}], [], {})
    errs = report.validate(bad)
    assert any("provenance" in e for e in errs) and any("without a reason" in e for e in errs)


def test_usage_errors() -> None:
    assert cli.main(["--ops", "no_such_op", "--no-db"]) == 2
    assert cli.main(["--mode", "parity", "--device", "cpu", "--no-db"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["--arch", "sm_80"])


# ----------------------------------------------------------------------------------------------------------
# Inputs

def test_draws_are_reproducible_and_seeded() -> None:
    space = registry.REGISTRY["grouped_gemm"].full_space(False)
    assert inputs.draws(space, 5, 11) == inputs.draws(space, 5, 11)
    assert inputs.draws(space, 5, 11) != inputs.draws(space, 5, 12)
    assert len(inputs.draws(space, 5, 11)) == 5


def test_adversarial_values_are_what_they_claim() -> None:
    g = inputs.generator(0)
    for dtype in (BF, torch.float32):
        s = inputs.subnormals(64, dtype, g).to(torch.float64)
        assert bool(((s != 0) & (s.abs() < torch.finfo(dtype).tiny)).all())
    x = square_ties(BF, 256, g).to(BF)
    sq_bits = (x.float() * x.float()).view(torch.int32)
    assert bool(((sq_bits & 0xFFFF) == 0x8000).all())
    mids = inputs.e4m3_midpoints(256, g).to(torch.float64)
    lo = mids.abs().to(torch.float8_e4m3fn).to(torch.float64)
    assert bool((lo != mids.abs()).all())


def test_routing_skews() -> None:
    g = inputs.generator(1)
    zipf = torch.bincount(inputs.route(512, 2, 16, g, "zipf").reshape(-1), minlength=16)
    flat = torch.bincount(inputs.route(512, 2, 16, g, "uniform").reshape(-1), minlength=16)
    empty = torch.bincount(inputs.route(64, 2, 16, g, "empty").reshape(-1), minlength=16)
    assert zipf.max() > 4 * zipf.min().clamp(min=1) and flat.max() < 2 * flat.min()
    assert int((empty == 0).sum()) >= 8
    ids = inputs.route(64, 4, 8, g)
    assert all(len(set(r)) == 4 for r in ids.tolist())


def test_registry_covers_the_inventory() -> None:
    names = set(registry.REGISTRY)
    inventory = [
        "quantize_mxfp8_32", "dequantize_mxfp8_128", "quantize_mxfp8_w128", "dequantize_nvfp4", "relu2_bwd",
        "swiglu_bwd", "combine_bwd", "router_topk", "router_logits", "bias_update", "permute", "unpermute",
        "grouped_gemm_wgrad", "grouped_gemm_fp8", "grouped_gemm_nvfp4", "grouped_gemm_act", "rdep_return",
        "rmsnorm_bwd", "rope", "mla_attention", "cross_entropy_bwd", "adamw", "muon", "moe_layer",
    ]
    assert set(inventory) <= names
    assert registry.select(["grouped_gemm*"])[0].name == "grouped_gemm"
    with pytest.raises(ValueError, match="known ops"):
        registry.select(["nope"])


def test_jobs_spread_ops_over_processes_with_the_same_rows() -> None:
    from parity.runner import Options, run

    opts = Options(ops=("relu2", "rmsnorm", "combine"), mode="selfcheck", cases=2, compile=False, quiet=True)
    one, many = run(opts), run(replace(opts, jobs=3))

    def rows(r: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in c.items() if k != "seconds"} for c in r["cases"]]

    assert rows(one) == rows(many) and many["run"]["jobs"] == 3 and report.validate(many) == []
