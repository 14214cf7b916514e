"""`nmoe mutate-html`: the page inlines the element bundle and the report safely, fails fast without npm,
and (heavy) renders a committed report's mutants in headless Chromium with the network cut off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from headless import chromium, rendered_text, screenshot
from PIL import Image

from mutations import html as mh

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "mutations" / "reports" / "cpu-2026-11-30.json"


def _report(description: str = "square dropped") -> dict[str, Any]:
    mutant = {"id": "relu2.square_dropped", "mutatorName": "relu2.square_dropped", "replacement": "r",
              "location": {"start": {"line": 1, "column": 1}, "end": {"line": 1, "column": 5}},
              "status": "Killed", "description": description}
    return {"schemaVersion": "1", "thresholds": {"high": 100, "low": 100},
            "files": {"nmoe/reference/activation.py": {"language": "python", "source": "x = 1\n",
                                                        "mutants": [mutant]}},
            "provenance": {"git_sha": "abc123", "git_dirty": True, "created_utc": "2026-01-01T00:00:00Z"},
            "summary": {"total": 1, "killed": 1, "score": 100.0}}


def _fake_cache(root: Path, version: str = mh.ELEMENTS_VERSION, js: str = "window.fake = 1;") -> Path:
    bundle = mh.bundle_path(root)
    bundle.parent.mkdir(parents=True)
    bundle.write_text(js)
    (bundle.parent.parent / "package.json").write_text(json.dumps({"version": version}))
    return root


def _report_in_page(page: str) -> Any:
    marker = "document.querySelector('mutation-test-report-app').report = "
    start = page.index(marker) + len(marker)
    return json.loads(page[start:page.index(";</script>", start)])


def test_page_inlines_bundle_and_report_once() -> None:
    page = mh.page(_report(), "window.bundle = 42;", "t")
    assert page.count("window.bundle = 42;") == 1
    assert page.count("<mutation-test-report-app") == 1
    assert _report_in_page(page) == _report()
    assert "abc123" in page and "dirty tree" in page


def test_report_text_cannot_close_the_script() -> None:
    evil = "</script><script>alert(1)</script><!--"
    page = mh.page(_report(evil), "", "t")
    assert "</script><script>alert" not in page and "<!--" not in page
    assert _report_in_page(page)["files"]["nmoe/reference/activation.py"]["mutants"][0]["description"] == evil


def test_bundle_with_a_script_tag_is_refused() -> None:
    with pytest.raises(mh.RenderError, match="cannot be inlined"):
        mh.page(_report(), "var s = '</SCRIPT>';", "t")


def test_non_finite_number_is_refused() -> None:
    bad = _report()
    bad["summary"]["score"] = float("nan")
    with pytest.raises(mh.RenderError, match="non-finite"):
        mh.page(bad, "", "t")


def test_missing_npm_fails_fast_naming_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (tmp_path / "r.json").write_text(json.dumps(_report()))
    rc = mh.main([str(tmp_path / "r.json"), "--npm-cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1
    assert "npm not found on PATH" in err and "--npm-cache" in err
    assert not (tmp_path / "r.html").exists()


def test_cached_bundle_is_used_without_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cache = _fake_cache(tmp_path / "cache")
    (tmp_path / "r.json").write_text(json.dumps(_report()))
    assert mh.main([str(tmp_path / "r.json"), "--npm-cache", str(cache)]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "window.fake = 1;" in page and _report_in_page(page) == _report()


def test_cache_holding_another_version_is_refused(tmp_path: Path) -> None:
    cache = _fake_cache(tmp_path / "cache", version="0.0.1")
    with pytest.raises(mh.RenderError, match=r"0\.0\.1, not the pinned"):
        mh.ensure_bundle(cache)


def test_file_that_is_no_mutation_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b.json").write_text(json.dumps({"results": []}))
    assert mh.main([str(tmp_path / "b.json"), "--npm-cache", str(_fake_cache(tmp_path / "c"))]) == 1
    assert "no mutation report" in capsys.readouterr().err


def test_unwritable_out_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r.json").write_text(json.dumps(_report()))
    (tmp_path / "file").write_text("")
    rc = mh.main([str(tmp_path / "r.json"), "--out", str(tmp_path / "file" / "x.html"),
                  "--npm-cache", str(_fake_cache(tmp_path / "c"))])
    assert rc == 1 and "pass a writable --out" in capsys.readouterr().err


@pytest.mark.heavy
def test_committed_report_renders_offline_in_chromium(tmp_path: Path) -> None:
    chromium()
    if shutil.which("npm") is None:
        pytest.skip("npm not installed: the mutation-testing-elements bundle cannot be fetched")
    page = mh.render(COMMITTED, tmp_path / "cpu.html", mh.default_cache())
    report = json.loads(COMMITTED.read_text())
    overview = rendered_text(page, tmp_path)
    assert "All files" in overview and "Killed" in overview
    s = report["summary"]
    assert str(s["total"]) in overview.splitlines() and str(s["killed"]) in overview.splitlines()
    name = "nmoe/reference/activation.py"
    mutants = report["files"][name]["mutants"]
    file_view = rendered_text(page, tmp_path, fragment="#mutant/reference/activation.py")
    assert "Killed\n(\n" + str(len(mutants)) + "\n)" in file_view, file_view[:2000]
    assert "relu2_bwd" in file_view.splitlines()
    shot = screenshot(page, tmp_path / "cpu.png", tmp_path)
    with Image.open(shot) as im:
        assert im.size == (1280, 800)
        assert len(im.convert("RGB").getcolors(1 << 16) or []) > 20, "the screenshot is blank"
