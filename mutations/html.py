"""`nmoe mutate-html`: a mutation report JSON as one HTML page that opens offline.

The page inlines Stryker's mutation-testing-elements bundle, installed from npm into a cache outside the
repository at render time, so the repository carries no third-party code.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from nmoe.outpaths import user_cache_dir

ELEMENTS: Final = "mutation-testing-elements"
ELEMENTS_VERSION: Final = "3.9.0"
BUNDLE: Final = "dist/mutation-test-elements.js"
_SCRIPT_TAG = re.compile(r"</?script", re.IGNORECASE)


class RenderError(Exception):
    """A page that cannot be made; the message names the fix."""


def default_cache() -> Path:
    return user_cache_dir() / "npm"


def bundle_path(cache: Path) -> Path:
    return cache / f"{ELEMENTS}-{ELEMENTS_VERSION}" / "node_modules" / ELEMENTS / BUNDLE


def _installed_version(bundle: Path) -> str | None:
    try:
        return str(json.loads((bundle.parent.parent / "package.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def ensure_bundle(cache: Path) -> Path:
    """The pinned bundle in `cache`, installed with npm the first time."""
    bundle = bundle_path(cache)
    if not bundle.is_file():
        npm = shutil.which("npm")
        if npm is None:
            raise RenderError("npm not found on PATH: install Node.js with npm (e.g. `apt-get install npm`), "
                              f"or pass --npm-cache DIR where {ELEMENTS}@{ELEMENTS_VERSION} is installed")
        prefix = bundle.parents[3]
        cmd = [npm, "install", "--prefix", str(prefix), "--no-save", "--ignore-scripts", "--no-audit",
               "--no-fund", "--loglevel=error", f"{ELEMENTS}@{ELEMENTS_VERSION}"]
        try:
            prefix.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RenderError(f"`{' '.join(cmd[1:])}` failed ({e}); pass a writable --npm-cache DIR") from e
        if done.returncode != 0 or not bundle.is_file():
            why = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RenderError(f"`npm install {ELEMENTS}@{ELEMENTS_VERSION}` into {prefix} failed ({why}); "
                              "run it where the npm registry is reachable, or pass --npm-cache DIR")
    found = _installed_version(bundle)
    if found != ELEMENTS_VERSION:
        raise RenderError(f"{bundle} is {ELEMENTS} {found}, not the pinned {ELEMENTS_VERSION}; "
                          "delete that directory or pass another --npm-cache DIR")
    return bundle


def _header(report: Mapping[str, Any]) -> str:
    prov, s = report.get("provenance") or {}, report.get("summary") or {}
    sha = str(prov.get("git_sha") or "no git")[:12] + (" (dirty tree)" if prov.get("git_dirty") else "")
    counts = ", ".join(f"{k.replace('_', ' ')} {s[k]}" for k in ("total", "killed", "survived", "timeout",
                       "compile_error", "no_coverage", "runtime_error", "not_run") if s.get(k))
    parts = [f"score {s.get('score', '-')}", counts, f"commit {sha}", str(prov.get("created_utc", "")),
             str(prov.get("gpu") or prov.get("host") or ""), str(prov.get("command", ""))]
    return "<p class=nmoe>" + " · ".join(html.escape(p) for p in parts if p) + "</p>"


def page(report: Mapping[str, Any], bundle_js: str, title: str) -> str:
    """One self-contained page: the report's provenance line, the element, its bundle and the report."""
    if _SCRIPT_TAG.search(bundle_js):
        raise RenderError(f"the {ELEMENTS} bundle holds a script tag and cannot be inlined; pin another "
                          "version in mutations/html.py")
    try:
        data = json.dumps(report, allow_nan=False).replace("<", "\\u003c")
    except ValueError as e:
        raise RenderError(f"the report holds a non-finite number ({e}); reports write it as a string") from e
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{margin:0;font-family:sans-serif}.nmoe{margin:0;padding:.5em 1em;font-size:13px;"
        "background:#f3f4f6;color:#111}</style>\n"
        f"<script>{bundle_js}</script>\n</head><body>\n{_header(report)}\n"
        '<mutation-test-report-app title-postfix="nmoe mutate"></mutation-test-report-app>\n'
        f"<script>document.querySelector('mutation-test-report-app').report = {data};</script>\n"
        "</body></html>\n"
    )


def render(report_path: Path, out: Path, cache: Path) -> Path:
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError) as e:
        raise RenderError(f"cannot read {report_path} ({e}); pass a report of `nmoe mutate --report`") from e
    if not isinstance(report, dict) or "files" not in report or "schemaVersion" not in report:
        raise RenderError(f"{report_path} is no mutation report (no `schemaVersion`/`files`); pass one "
                          "written by `nmoe mutate --report`")
    text = page(report, ensure_bundle(cache).read_text(), f"{report_path.name} · nmoe mutate")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        raise RenderError(f"cannot write {out} ({e}); pass a writable --out") from e
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nmoe mutate-html", description="render a mutation report JSON as one "
                                 "HTML page that opens offline (mutation-testing-elements, from npm)")
    ap.add_argument("report", type=Path, help="a report of `nmoe mutate --report FILE.json`")
    ap.add_argument("--out", type=Path, default=None, help="the page (default: the report's path, .html)")
    ap.add_argument("--npm-cache", type=Path, default=None,
                    help=f"where {ELEMENTS}@{ELEMENTS_VERSION} is installed (default: {default_cache()})")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = args.out or args.report.with_suffix(".html")
    try:
        render(args.report, out, args.npm_cache or default_cache())
    except RenderError as e:
        print(f"nmoe mutate-html: {e}", file=sys.stderr)
        return 1
    print(f"nmoe mutate-html: wrote {out}")
    return 0
