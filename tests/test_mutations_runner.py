"""The mutation runner on a tiny synthetic tree: every status, the report, the exit code."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mutations import runner
from mutations.execute import child_env, run_pytest, sanity_source
from mutations.model import AnchorError, Mutation, anchor_span, apply, check_anchors
from mutations.report import markdown, summary

TOY = '''\
"""A toy op family."""


def square(x: float) -> float:
    return x * x


def relu(x: float) -> float:
    return max(x, 0.0)
'''

TOY_TEST = '''\
from nmoe.toy import relu, square


def test_square() -> None:
    assert square(3.0) == 9.0


def test_relu() -> None:
    assert relu(-1.0) == 0.0
    assert relu(2.0) == 2.0
'''

OTHER = "def unused() -> int:\n    return 1\n"


@pytest.fixture(autouse=True)
def _lean_child_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy tests need no pytest plugins; skipping their import keeps each child run well under 1 s."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _tree(root: Path, test_text: str = TOY_TEST) -> Path:
    (root / "nmoe").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "nmoe" / "__init__.py").write_text("")
    (root / "nmoe" / "toy.py").write_text(TOY)
    (root / "nmoe" / "other.py").write_text(OTHER)
    (root / "tests" / "test_toy.py").write_text(test_text)
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    return root


def _catalog(path: Path, entries: str) -> Path:
    path.write_text("from mutations.model import Mutation\n\nCATALOG = (\n" + textwrap.indent(entries, "    ")
                    + ")\n")
    return path


SQUARE_DOUBLED = """Mutation("toy.square_doubled", "nmoe/toy.py", "return x * x", "return x + x",
         "square computed as doubling", tests=("tests/test_toy.py::test_square",)),
"""
RELU_NEG_ZERO = """Mutation("toy.relu_negative_zero", "nmoe/toy.py", "max(x, 0.0)", "max(x, -0.0)",
         "clamp at -0.0: equal to 0.0 under ==, so the test cannot tell", tests=("tests/test_toy.py",)),
"""


def _main(tmp_path: Path, catalog: Path, *extra: str, timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    report = tmp_path / "out" / "report.json"
    rc = runner.main(["--root", str(tmp_path / "tree"), "--catalog", str(catalog), "--report", str(report),
                      "--jobs", "2", "--timeout", str(timeout), *extra])
    data = json.loads(report.read_text()) if report.exists() else {}
    return rc, data


def _mutants(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for f in data["files"].values() for m in f["mutants"]}


def test_all_killed_exits_zero_and_writes_stryker_report(tmp_path: Path) -> None:
    _tree(tmp_path / "tree")
    rc, data = _main(tmp_path, _catalog(tmp_path / "cat.py", SQUARE_DOUBLED))
    assert rc == 0
    assert data["schemaVersion"] == "1" and data["thresholds"] == {"high": 100, "low": 100}
    f = data["files"]["nmoe/toy.py"]
    assert f["language"] == "python" and f["source"] == TOY
    m = _mutants(data)["toy.square_doubled"]
    assert m["status"] == "Killed"
    assert m["killedBy"] == ["tests/test_toy.py::test_square"]
    assert m["location"] == {"start": {"line": 5, "column": 5}, "end": {"line": 5, "column": 17}}
    assert m["replacement"] == "return x + x" and m["mutatorName"] == "toy.square_doubled"
    assert m["casesRed"] == 1 and m["assertionsRed"] >= 1
    assert m["statusReason"].startswith("tests/test_toy.py:5: assert square(3.0) == 9.0 -> assert 6.0 == 9.0")
    assert data["summary"] == {"total": 1, "killed": 1, "survived": 0, "timeout": 0, "compile_error": 0,
                               "no_coverage": 0, "runtime_error": 0, "not_run": 0, "score": 100.0}
    assert data["baseline"]["status"] == "pass"
    assert data["sanity"]["status"] == "Killed" and data["sanity"]["file"] == "nmoe/toy.py"
    assert set(data["provenance"]) >= {"git_sha", "git_dirty", "created_utc", "host", "gpu", "cuda_driver",
                                       "torch", "cutlass_dsl", "python", "command"}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| id | description | status | killed by | cases / assertions red |" in md
    assert "| `toy.square_doubled` |" in md


def test_survivor_compile_error_timeout_make_the_runner_exit_nonzero(tmp_path: Path) -> None:
    _tree(tmp_path / "tree")
    entries = SQUARE_DOUBLED + RELU_NEG_ZERO + """\
Mutation("toy.syntax", "nmoe/toy.py", "return x * x", "return x *", "syntax error",
         tests=("tests/test_toy.py",)),
Mutation("toy.import_fails", "nmoe/toy.py", '\"\"\"A toy op family.\"\"\"',
         "import nmoe_no_such_module", "module import fails", tests=("tests/test_toy.py",)),
Mutation("toy.hangs", "nmoe/toy.py", "return max(x, 0.0)", "while True:\\n        pass",
         "never returns", tests=("tests/test_toy.py::test_relu",)),
Mutation("toy.gpu_only", "nmoe/toy.py", "return x * x", "return x ** 3", "gpu-host mutant",
         tests=("tests/test_toy.py",), device="gpu"),
"""
    rc, data = _main(tmp_path, _catalog(tmp_path / "cat.py", entries), timeout=5.0)
    assert rc == 1
    muts = _mutants(data)
    assert muts["toy.square_doubled"]["status"] == "Killed"
    assert muts["toy.relu_negative_zero"]["status"] == "Survived"
    assert muts["toy.relu_negative_zero"]["killedBy"] == []
    assert muts["toy.syntax"]["status"] == "CompileError"
    assert "does not compile" in muts["toy.syntax"]["statusReason"]
    assert muts["toy.import_fails"]["status"] == "CompileError"
    assert muts["toy.hangs"]["status"] == "Timeout"
    assert muts["toy.gpu_only"]["status"] == "Ignored"
    assert "--device gpu" in muts["toy.gpu_only"]["statusReason"]
    s = data["summary"]
    assert (s["total"], s["killed"], s["survived"], s["compile_error"], s["timeout"], s["not_run"]) == (
        6, 1, 1, 2, 1, 1)
    assert s["score"] == 20.0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**Survived**" in md and "not run" in md


def test_gpu_mutant_alone_is_not_counted_killed(tmp_path: Path) -> None:
    _tree(tmp_path / "tree")
    entries = SQUARE_DOUBLED.replace('tests=("tests/test_toy.py::test_square",)',
                                     'tests=("tests/test_toy.py::test_square",), device="gpu"')
    rc, data = _main(tmp_path, _catalog(tmp_path / "cat.py", entries))
    assert rc == 0
    assert data["summary"]["killed"] == 0 and data["summary"]["not_run"] == 1
    assert data["summary"]["score"] is None and data["baseline"]["status"] == "not run"


def test_failing_baseline_runs_no_mutant_and_exits_nonzero(tmp_path: Path) -> None:
    _tree(tmp_path / "tree", TOY_TEST.replace("== 9.0", "== 10.0"))
    rc, data = _main(tmp_path, _catalog(tmp_path / "cat.py", SQUARE_DOUBLED))
    assert rc == 1
    assert data["baseline"]["status"] == "fail"
    assert _mutants(data)["toy.square_doubled"]["status"] == "Ignored"
    assert data["sanity"] is None


def test_unkillable_sanity_mutant_fails_the_run(tmp_path: Path) -> None:
    _tree(tmp_path / "tree")
    entries = """Mutation("toy.other_changed", "nmoe/other.py", "return 1", "return 2", "unreached file",
         tests=("tests/test_toy.py",)),
"""
    rc, data = _main(tmp_path, _catalog(tmp_path / "cat.py", entries))
    assert rc == 1
    assert data["sanity"]["status"] == "Survived"
    assert _mutants(data)["toy.other_changed"]["status"] == "Survived"


def test_bad_anchors_and_unknown_glob_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    _tree(tmp_path / "tree")
    twice = """Mutation("toy.twice", "nmoe/toy.py", "x", "y", "ambiguous", tests=("tests/test_toy.py",)),
Mutation("toy.absent", "nmoe/toy.py", "return x - x", "return 0", "stale", tests=("tests/test_toy.py",)),
Mutation("toy.nofile", "nmoe/gone.py", "a", "b", "no file", tests=("tests/test_toy.py",)),
"""
    rc, data = _main(tmp_path, _catalog(tmp_path / "cat.py", twice))
    err = capsys.readouterr().err
    assert rc == 2 and data == {}
    assert "toy.twice: anchor occurs" in err and "toy.absent: anchor occurs 0 times" in err
    assert "nmoe/gone.py does not exist" in err
    rc, _ = _main(tmp_path, _catalog(tmp_path / "cat2.py", SQUARE_DOUBLED), "--only", "nothing.*")
    assert rc == 2


def test_list_and_check_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nmoe.cli import main as nmoe_main

    _tree(tmp_path / "tree")
    cat = _catalog(tmp_path / "cat.py", SQUARE_DOUBLED + RELU_NEG_ZERO)
    base = ["mutate", "--root", str(tmp_path / "tree"), "--catalog", str(cat)]
    assert nmoe_main([*base, "--list", "--only", "toy.relu*"]) == 0
    out = capsys.readouterr().out
    assert "toy.relu_negative_zero" in out and "toy.square_doubled" not in out
    assert nmoe_main([*base, "--check"]) == 0
    assert "2 anchors match exactly once" in capsys.readouterr().out


def test_anchor_span_apply_and_check() -> None:
    m = Mutation("toy.a", "f.py", "b\ncd", "X", "d")
    src = "a\nb\ncd e\n"
    span = anchor_span(src, m)
    assert (span.start_line, span.start_column, span.end_line, span.end_column) == (2, 1, 3, 3)
    assert apply(src, m) == "a\nX e\n"
    with pytest.raises(AnchorError, match="2 times"):
        anchor_span("b\ncd b\ncd", m)
    with pytest.raises(ValueError, match="no-op"):
        Mutation("toy.b", "f.py", "a", "a", "d")
    with pytest.raises(ValueError, match=r"family\.defect"):
        Mutation("Bad", "f.py", "a", "b", "d")
    assert m.sep_test_name() == "test_sep_toy_a"
    assert any(p.startswith("duplicate mutation id") for p in check_anchors(Path("/nonexistent"), (m, m)))


GHOST_TEST = '''\
from nmoe.toy import square


class Check:
    @staticmethod
    def close(a: float, b: float) -> bool:
        return a == b


def test_square() -> None:
    print("FAILED tests/test_toy.py::test_ghost - printed by the test, not a failure")
    print("ERROR tests/test_toy.py::test_other_ghost")
    assert Check.close(square(3.0), 9.0)
'''


def test_killing_tests_come_from_pytest_not_from_its_terminal_text(tmp_path: Path) -> None:
    """A test printing lines that look like pytest's summary names no extra killer; the address of a
    function in pytest's assertion explanation never reaches the reports."""
    _tree(tmp_path / "tree", GHOST_TEST)
    rc, data = _main(tmp_path, _catalog(tmp_path / "cat.py", SQUARE_DOUBLED))
    assert rc == 0
    m = _mutants(data)["toy.square_doubled"]
    assert m["killedBy"] == ["tests/test_toy.py::test_square"]
    assert (m["casesRed"], m["testsCompleted"], m["assertionsRed"]) == (1, 1, 1)
    assert m["statusReason"].startswith("tests/test_toy.py:13: assert Check.close(square(3.0), 9.0) -> ")
    assert "<function Check.close>" in m["statusReason"]
    md = (tmp_path / "out" / "report.md").read_text()
    json_text = (tmp_path / "out" / "report.json").read_text()
    assert " at 0x" not in md and " at 0x" not in json_text


OUTCOME_TESTS = '''\
import pytest


def test_ok() -> None:
    pass


@pytest.mark.skip(reason="no")
def test_skipped() -> None:
    pass


@pytest.mark.xfail(reason="known")
def test_xfail() -> None:
    assert False


@pytest.mark.parametrize("a", ["x-y"])
def test_fails(a: str) -> None:
    assert len(a) == 4


@pytest.fixture
def broken() -> None:
    raise RuntimeError("boom")


def test_setup_error(broken: None) -> None:
    pass


def test_raises() -> None:
    with pytest.raises(RuntimeError):
        pass


def test_deep() -> None:
    import json
    json.loads("{")


def test_deselected_one() -> None:
    pass
'''


def test_outcome_plugin_records_counts_failures_and_where(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_o.py").write_text(OUTCOME_TESTS)
    run = run_pytest(tmp_path, ("tests/test_o.py",), "not deselected_one", child_env(tmp_path, "cpu", 1), 120,
                     flags=("-q", "-p", "no:cacheprovider", "--tb=short"))
    assert run.returncode == 1 and not run.collection_error
    assert run.counts == {"passed": 1, "skipped": 1, "xfailed": 1, "failed": 3, "errors": 1, "deselected": 1}
    assert run.ran == 6
    assert run.failing == ["tests/test_o.py::test_fails[x-y]", "tests/test_o.py::test_raises",
                           "tests/test_o.py::test_deep", "tests/test_o.py::test_setup_error"]
    assert run.messages[0] == "AssertionError: assert 3 == 4"
    assert run.messages[2].startswith("json.decoder.JSONDecodeError: Expecting property name")
    raise_msg = re.fullmatch(r"Failed: DID NOT RAISE (<class 'RuntimeError'>|RuntimeError)", run.messages[1])
    assert raise_msg, run.messages[1]  # pytest 9.2 names the class bare
    assert run.messages[3] == "RuntimeError: boom"
    assert run.assertions == 2
    assert run.details == [
        "tests/test_o.py:20: assert len(a) == 4 -> AssertionError: assert 3 == 4 | +  where 3 = len('x-y')",
        f"tests/test_o.py:33: with pytest.raises(RuntimeError): -> {run.messages[1]}",
        "tests/test_o.py:39: json.loads(\"{\") -> json.decoder.JSONDecodeError: Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)",
        "tests/test_o.py:25: raise RuntimeError(\"boom\") -> RuntimeError: boom",
    ]


def test_collection_error_is_recorded(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_c.py").write_text("import nmoe_no_such_module\n")
    run = run_pytest(tmp_path, ("tests/test_c.py",), None, child_env(tmp_path, "cpu", 1), 120)
    assert run.returncode == 2 and run.collection_error and run.counts == {"errors": 1}
    assert run.failing == ["tests/test_c.py"]
    assert "No module named 'nmoe_no_such_module'" in run.messages[0]


def test_sanity_source_makes_every_function_raise(tmp_path: Path) -> None:
    ns: dict[str, Any] = {"__name__": "toy_sanity"}
    src = TOY + ("\n\nclass C:\n    def m(self) -> int:\n        return 1\n\n    @staticmethod\n"
                 "    def st() -> int:\n        return 2\n")
    exec(compile(sanity_source(src), "toy_sanity.py", "exec"), ns)
    with pytest.raises(AssertionError, match="sanity mutant"):
        ns["square"](2.0)
    with pytest.raises(AssertionError, match="sanity mutant"):
        ns["relu"](1.0)
    with pytest.raises(AssertionError, match="sanity mutant"):
        ns["C"]().m()
    with pytest.raises(AssertionError, match="sanity mutant"):
        ns["C"].st()


def test_summary_of_nothing() -> None:
    s = summary([])
    assert s["total"] == 0 and s["score"] is None
    md = markdown({"summary": s, "files": {}, "baseline": {"status": "not run"}, "sanity": None})
    assert "| id |" in md
