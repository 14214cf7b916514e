"""`nmoe report`: results mapped to ops, freshness from git history, the op's sources, the page on the real
committed reports."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from headless import chromium, rendered_text

from nmoe import reportindex as ri
from nmoe.index import Entry, Section, write_index
from parity.registry import REGISTRY

REPO = Path(__file__).resolve().parents[1]
OPS = list(REGISTRY)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


def test_freshness_from_git_history(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    first = _commit(tmp_path, {"a.py": "1", "b.py": "1"}, "one")
    second = _commit(tmp_path, {"a.py": "2"}, "two")
    changed = ri.changed_since(tmp_path, first)
    assert changed == {"a.py"}
    assert ri.freshness(changed, ["a.py", "c.py"]) == ri.Freshness("stale", ("a.py",))
    assert ri.freshness(changed, ["b.py"]).state == "fresh"
    assert ri.freshness(ri.changed_since(tmp_path, second), ["a.py"]).state == "fresh"
    assert ri.changed_since(tmp_path, "0123456789abcdef0123456789abcdef01234567") is None
    assert ri.changed_since(tmp_path, None) is None
    assert ri.freshness(None, ["a.py"]).state == "unknown"


@pytest.mark.parametrize(("name", "op"), [
    ("relu2_fwd", "relu2"), ("relu2_bwd_eager_call", "relu2_bwd"), ("rmsnorm_fwd_vs_F.rms_norm", "rmsnorm"),
    ("quantize_mxfp8_b32", "quantize_mxfp8_32"), ("dequantize_mxfp8_b32", "dequantize_mxfp8_32"),
    ("quantize_mxfp8_weight", "quantize_mxfp8_w128"), ("grouped_gemm_fwd_up_zipf1.2", "grouped_gemm"),
    ("grouped_gemm_act_swiglu_up_uniform", "grouped_gemm_act"),
    ("grouped_gemm_fp8_summary", "grouped_gemm_fp8"),
    ("combine_fwd", "combine"), ("moe_layer_uniform", "moe_layer"), ("baseline", None),
])
def test_bench_rows_map_to_ops(name: str, op: str | None) -> None:
    assert ri.bench_op(name, OPS) == op


def test_op_sources_follow_the_compile_cache_graph() -> None:
    relu2 = set(ri.op_sources("relu2", REPO))
    assert {"nmoe/fast/kernels/activation.py", "nmoe/fast/kernels/prims.py", "nmoe/fast/activation.py",
            "nmoe/reference/activation.py", "parity/ops/activation.py"} <= relu2
    assert "nmoe/fast/_swiglu.py" in ri.op_sources("swiglu", REPO)  # the module defining the fast function
    assert "nmoe/fast/kernels/router.py" in ri.op_sources("permute", REPO)  # expert_counts serves permute
    assert "nmoe/fast/gemm/sm90.py" in ri.op_sources("grouped_gemm", REPO)  # the KernelSpecs' module
    rdep = {"nmoe/reference/rdep.py", "parity/ops/rdep.py", "parity/spmd.py", "nmoe/fast/kernels/rdep.py"}
    assert rdep <= set(ri.op_sources("rdep_return", REPO))  # the SPMD adapter is its fast function's module
    assert {"nmoe/fast/kernels/rope.py", "nmoe/fast/rope.py"} <= set(ri.op_sources("rope", REPO))
    assert {"nmoe/fast/attention.py", "nmoe/fast/rope.py"} <= set(ri.op_sources("mla_attention", REPO))
    # a layer built from other ops depends on their kernels and on every module its glue imports
    assert {"nmoe/fast/kernels/rope.py", "nmoe/fast/kernels/norm.py"} <= set(
        ri.op_sources("mla_attention", REPO))
    assert {"nmoe/fast/kernels/sm90/grouped_gemm_wgrad.py", "nmoe/fast/kernels/combine.py"} <= set(
        ri.op_sources("moe_layer", REPO))
    assert "nmoe/fast/rdep/group.py" in ri.op_sources("rdep_dispatch", REPO)
    assert "nmoe/fast/kernels/swiglu.py" not in ri.op_sources("relu2", REPO)  # its glue's other op


def test_mutants_map_through_their_contracts(tmp_path: Path) -> None:
    doc = {"provenance": {"git_sha": "abc", "git_dirty": True, "created_utc": "2026-01-01T00:00:00+00:00"},
           "files": {"x.py": {"mutants": [
               {"id": "gemm.fast_x", "status": "Killed", "contracts": ["grouped_gemm", "grouped_gemm_act"]},
               {"id": "relu2.y", "status": "Ignored"},
               {"id": "model.z", "status": "Killed", "contracts": ["model"]},
           ]}}}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    r = ri.load_report("mutation", path, OPS)
    assert r.ops["grouped_gemm"] == ri.Result("1 Killed", True) and "grouped_gemm_act" in r.ops
    assert r.ops["relu2"] == ri.Result("1 Ignored", False)
    assert r.unmapped == ("model.z",) and r.dirty is True


def test_newest_prefers_a_report_where_the_op_ran(tmp_path: Path) -> None:
    def rep(name: str, created: str, ran: bool) -> ri.Report:
        return ri.Report("parity", tmp_path / name, None, False, created, None, {"relu2": ri.Result("", ran)})

    old, new_not_run = rep("a.json", "2026-01-01", True), rep("b.json", "2026-01-02", False)
    assert ri.newest([old, new_not_run], "relu2", "parity") == old
    assert ri.newest([new_not_run], "relu2", "parity") == new_not_run
    assert ri.newest([old], "relu2", "bench") is None


def test_unreadable_report_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text("{")
    with pytest.raises(ri.ReportIndexError, match=r"r\.json"):
        ri.load_report("parity", tmp_path / "r.json", OPS)
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(ri.ReportIndexError, match="provenance"):
        ri.load_report("parity", tmp_path / "r.json", OPS)


def test_index_table_and_marks(tmp_path: Path) -> None:
    page = write_index(tmp_path / "i.html", "t", [Section("s", columns=("a", "b"), rows=(
        (Entry("x"), Entry("y", tmp_path / "f.json", mark="stale")),))])
    text = page.read_text()
    assert "<th>a</th>" in text and "<td class='mark-stale'><a href=\"f.json\">y</a></td>" in text
    with pytest.raises(ValueError, match="cells"):
        write_index(tmp_path / "j.html", "t",
                    [Section("s", columns=("a",), rows=((Entry("x"), Entry("y")),))])
    with pytest.raises(ValueError, match="mark"):
        write_index(tmp_path / "k.html", "t", [Section("s", (Entry("x", mark="red"),))])


def test_report_on_the_committed_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ri.main(["--out", str(tmp_path / "out")]) == 0
    assert "index.json" in capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "index.json").read_text())
    files = [p for sub in ri.REPORT_DIRS.values() for p in sorted((REPO / sub).glob("*.json"))]
    dirty = sum(json.loads(p.read_text())["provenance"]["git_dirty"] is True for p in files)
    assert doc["summary"]["reports"] == len(files) and doc["summary"]["dirty"] == dirty
    assert list(doc["ops"]) == OPS
    relu2 = doc["ops"]["relu2"]["parity"]
    assert relu2["file"].startswith("parity/reports/") and relu2["freshness"] in ("fresh", "stale", "unknown")
    html = (tmp_path / "out" / "index.html").read_text()
    assert "per op: the newest result of each kind" in html and "<table>" in html


def test_unknown_op_is_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ri.main(["--out", str(tmp_path), "--ops", "relu3"]) == 2
    assert "known ops" in capsys.readouterr().err


@pytest.mark.heavy
def test_report_page_opens_in_chromium(tmp_path: Path) -> None:
    chromium()
    assert ri.main(["--out", str(tmp_path / "out"), "--ops", "relu2,grouped_gemm"]) == 0
    text = rendered_text(tmp_path / "out" / "index.html", tmp_path)
    assert text.startswith("broken-images=0\n"), text[:500]
    lines = text.splitlines()
    for title in ("per op: the newest result of each kind", "committed reports", "relu2", "grouped_gemm"):
        assert title in lines
