"""pytest plugin (`-p mutations.outcome`) that writes one run's outcome as JSON for `nmoe mutate`: counts as
pytest's summary counts them, failing node ids with their messages, assertion failures, and where each
failure was raised. Imported only inside the pytest child; texts pass through `stable`."""

from __future__ import annotations

import collections
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from mutations.execute import OUTCOME_ENV

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")
_MAX_E_LINES = 3


def stable(text: str, root: Path | None = None) -> str:
    """Drop what differs between identical runs: object addresses and the temporary copy's path."""
    if root is not None:
        text = text.replace(f"{root}{os.sep}", "")
    return _ADDRESS.sub(">", text)


def _is_assertion(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_assertion(e) for e in exc.exceptions)
    return isinstance(exc, AssertionError | pytest.fail.Exception)


class _Recorder:
    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config, self.path = config, path
        self.root = Path(str(config.rootpath))
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: dict[str, list[dict[str, str]]] = {"failed": [], "errors": []}
        self.assertions = 0
        self.collect_errors = 0

    def _inside(self, path: str) -> bool:
        return (self.root / path).resolve().is_relative_to(self.root.resolve())

    def _where(self, longrepr: Any) -> str:
        """'file:line: source -> E lines' at the deepest frame inside the tree (not inside a library)."""
        tb = longrepr.chain[0][0] if hasattr(longrepr, "chain") else getattr(longrepr, "reprtraceback", None)
        entries = [e for e in getattr(tb, "reprentries", ()) if getattr(e, "reprfileloc", None) is not None]
        e_lines = [ln[1:].strip()[:200] for e in entries for ln in e.lines if ln.startswith("E ")]
        if not entries or not e_lines:
            return ""
        ours = [e for e in entries if self._inside(e.reprfileloc.path)] or entries
        entry = ours[-1]
        src = next((ln.strip() for ln in entry.lines if ln.strip() and not ln.startswith("E ")), "")
        loc = entry.reprfileloc
        return stable(f"{loc.path}:{loc.lineno}: {src} -> {' | '.join(e_lines[:_MAX_E_LINES])}", self.root)

    def _message(self, report: pytest.CollectReport | pytest.TestReport) -> str:
        longrepr = report.longrepr
        crash = getattr(longrepr, "reprcrash", None)
        if crash is not None:
            text = str(crash.message)
        else:
            e_lines = [ln[1:].strip() for ln in str(longrepr).splitlines() if ln.startswith("E ")]
            text = e_lines[-1] if e_lines else str(longrepr).strip()
        return stable(text.splitlines()[0] if text else "", self.root)

    def _record(self, key: str, report: pytest.CollectReport | pytest.TestReport) -> None:
        self.failures[key].append({"nodeid": report.nodeid, "message": self._message(report),
                                   "where": self._where(report.longrepr)})

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]
                                  ) -> Any:
        report = yield
        if report.failed and call.excinfo is not None and _is_assertion(call.excinfo.value):
            self.assertions += 1
        return report

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.counts["deselected"] += len(items)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.counts["errors"] += 1
            self.collect_errors += 1
            self._record("errors", report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        category = self.config.hook.pytest_report_teststatus(report=report, config=self.config)[0]
        if not category:
            return
        key = "errors" if category == "error" else str(category)
        self.counts[key] += 1
        if key in self.failures:
            self._record(key, report)

    def pytest_sessionfinish(self) -> None:
        failures = self.failures["failed"] + self.failures["errors"]
        data = {"counts": dict(self.counts), "failures": failures, "assertions": self.assertions,
                "collect_errors": self.collect_errors}
        self.path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(OUTCOME_ENV)
    if path:
        config.pluginmanager.register(_Recorder(config, Path(path)), "nmoe-mutate-outcome")
