"""One static HTML index page of sections, each a list of links, inline images and notes.

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
    """A link to `target` (shown inline when `image`), or a plain note when `target` is None."""

    text: str
    target: Path | None = None
    image: bool = False


@dataclass(frozen=True)
class Section:
    title: str
    entries: tuple[Entry, ...] = field(default_factory=tuple)


def _entry(e: Entry, base: Path) -> str:
    text = html.escape(e.text)
    if e.target is None:
        return f"<li class=note>{text}</li>"
    href = html.escape(Path(os.path.relpath(e.target.resolve(), base.resolve())).as_posix(), quote=True)
    if e.image:
        return f'<li><a href="{href}">{text}<br><img src="{href}" alt="{text}"></a></li>'
    return f'<li><a href="{href}">{text}</a></li>'


def write_index(path: Path, title: str, sections: Sequence[Section], subtitle: str = "") -> Path:
    """Write `path`; links are relative to its directory, so the directory can be moved whole."""
    base = path.parent
    body = [f"<h1>{html.escape(title)}</h1>"] + ([f"<p>{html.escape(subtitle)}</p>"] if subtitle else [])
    for s in sections:
        body.append(f"<h2>{html.escape(s.title)}</h2>\n<ul>")
        body += [_entry(e, base) for e in s.entries] or ["<li class=note>nothing</li>"]
        body.append("</ul>")
    text = (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:1em 2em}}"
        "ul{list-style:none;padding:0}li{margin:.4em 0}img{max-width:100%;border:1px solid #ddd}"
        ".note{color:#555}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    base.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
