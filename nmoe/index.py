"""One static HTML index page of sections, each a table and/or a list of links, inline images and notes.

Pages that gather reports (plots, mutation pages, per-op summaries) describe themselves as sections and
share this writer, so every index looks and escapes the same way.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Entry:
    """A link to `target` (shown inline when `image`), or a plain note when `target` is None; `mark` names a
    state the page colours (one of MARKS)."""

    text: str
    target: Path | None = None
    image: bool = False
    mark: str = ""


@dataclass(frozen=True)
class Section:
    """A table (`columns`, then `rows` of one Entry per cell) above a list of `entries`."""

    title: str
    entries: tuple[Entry, ...] = field(default_factory=tuple)
    columns: tuple[str, ...] = ()
    rows: tuple[tuple[Entry, ...], ...] = ()


MARKS = {"stale": "#b00000", "unknown": "#a05a00", "dirty": "#a05a00", "missing": "#777", "fresh": "#06702c"}


def _content(e: Entry, base: Path) -> tuple[str, list[str]]:
    if e.mark and e.mark not in MARKS:
        raise ValueError(f"index entry mark {e.mark!r}; use one of {', '.join(MARKS)}")
    classes = [f"mark-{e.mark}"] if e.mark else []
    text = html.escape(e.text)
    if e.target is None:
        return text, ["note", *classes]
    href = html.escape(Path(os.path.relpath(e.target.resolve(), base.resolve())).as_posix(), quote=True)
    if e.image:
        return f'<a href="{href}">{text}<br><img src="{href}" alt="{text}"></a>', classes
    return f'<a href="{href}">{text}</a>', classes


def _tag(name: str, e: Entry, base: Path) -> str:
    inner, classes = _content(e, base)
    attr = f" class='{' '.join(classes)}'" if classes else ""
    return f"<{name}{attr}>{inner}</{name}>"


def _table(s: Section, base: Path) -> list[str]:
    for r in s.rows:
        if len(r) != len(s.columns):
            raise ValueError(f"section {s.title!r}: a row of {len(r)} cells under {len(s.columns)} columns")
    head = "<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in s.columns) + "</tr>"
    return ["<table>", head, *("<tr>" + "".join(_tag("td", c, base) for c in r) + "</tr>" for r in s.rows),
            "</table>"]


def write_index(path: Path, title: str, sections: Sequence[Section], subtitle: str = "") -> Path:
    """Write `path`; links are relative to its directory, so the directory can be moved whole."""
    base = path.parent
    body = [f"<h1>{html.escape(title)}</h1>"] + ([f"<p>{html.escape(subtitle)}</p>"] if subtitle else [])
    for s in sections:
        body.append(f"<h2>{html.escape(s.title)}</h2>")
        body += _table(s, base) if s.columns else []
        if s.entries or not s.columns:
            body.append("<ul>")
            body += [_tag("li", e, base) for e in s.entries] or ["<li class=note>nothing</li>"]
            body.append("</ul>")
    text = (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:1em 2em}}"
        "ul{list-style:none;padding:0}li{margin:.4em 0}img{max-width:100%;border:1px solid #ddd}"
        ".note{color:#555}table{border-collapse:collapse;font-size:90%}"
        "td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}"
        + "".join(f".mark-{k},.mark-{k} a{{color:{c}}}" for k, c in MARKS.items())
        + "</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    base.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
