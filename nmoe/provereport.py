"""The `nmoe prove` report as files: the JSON document, and the same tables as markdown (to paste into a
review) and as one HTML page through the shared index writer."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from nmoe.index import Entry, Section, write_index

Table = tuple[str, tuple[str, ...], list[tuple[str, ...]]]
MARK: Final = {"slower": "stale", "faster": "fresh",
               "fail": "stale", "red": "stale", "Survived": "stale", "pass": "fresh", "green": "fresh",
               "Killed": "fresh", "not run": "missing", "Ignored": "missing", "nothing to prove": "missing"}


def _status(sec: Mapping[str, Any]) -> str:
    return str(sec["status"]) + (f": {sec['reason']}" if sec.get("reason") else "")


def _ab_row(r: Mapping[str, Any]) -> tuple[str, ...]:
    if "error" in r:
        why = "; ".join(f"{side}: {e}" for side, e in r["error"].items())
        return (r["name"], r["op"], "", "", "", "", "", f"not run ({why})")
    return (r["name"], r["op"], f"{r['median_base_ms']:.4g}", f"{r['median_new_ms']:.4g}",
            f"{r['median_aa_ms']:.4g}", f"{r['change']:+.1%}", f"±{r['noise']:.1%}", r["verdict"])


def tables(doc: Mapping[str, Any]) -> list[Table]:
    """Every table of the report, in reading order; markdown and HTML render these same rows."""
    c = doc["commits"]
    new = c["head"] + (f" ({c['head_ref']})" if c.get("head_ref", "working tree") != "working tree" else "")
    new += " + uncommitted changes (dirty)" if c["dirty"] else ""
    new += f" + catalog mutant {c['edit']}" if c.get("edit") else ""
    head: list[tuple[str, ...]] = [("verdict", doc["verdict"]), ("BASE", f"{c['base']} ({c['base_ref']})"),
            ("HEAD", new), ("compared", c["compared"]), ("device", doc["device"]),
            *((k, _status(doc[k])) for k in ("parity", "mutation", "bench"))]
    if doc.get("unclaimed"):
        head.append(("unclaimed", "changed op code no op's sources name here: "
                     + ", ".join(doc["unclaimed"])))
    out: list[Table] = [("summary", ("", ""), head),
                        ("touched ops", ("op", "changed files"),
                         [(op, ", ".join(f)) for op, f in doc["ops"].items()])]
    p = doc["parity"]
    if "summary" in p:
        s = p["summary"]
        cases = f"{p['mode']}: {s['passed']} pass, {s['failed']} fail, {s['not_run']} not run"
        k = s["compile"]
        compiles = f"compiles: {k['ok']} ok, {k['fail']} fail, {k['not_run']} not run"
        rows: list[tuple[str, ...]] = [(cases, compiles)]
        rows += [(f"FAIL {f['op']} {f['contract']} {f['arch']} {f['case']}", str(f["reason"]))
                 for f in p["failed"]]
        rows += [(f"FAIL compile {f.get('kernel')} {f.get('arch')}", str(f.get("error") or "").split("\n")[0])
                 for f in p["failed_compiles"]]
        out.append(("parity contracts", ("result", "detail"), rows))
    m = doc["mutation"]
    out.append(("mutants", ("id", "contracts", "status", "reason"),
                [(x["id"], ", ".join(x.get("contracts", [])), x["status"], x.get("reason", ""))
                 for x in m["mutants"]]))
    b = doc["bench"]
    out.append((f"A/B benchmark (medians of {b['repetitions']} interleaved repetitions per tree)",
                ("row", "op", "BASE ms", "new ms", "A/A ms", "change", "noise", "verdict"),
                [_ab_row(r) for r in b["rows"]]))
    return out


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(doc: Mapping[str, Any]) -> str:
    lines = ["# nmoe prove", ""]
    for title, cols, rows in tables(doc):
        lines += [f"## {title}", ""]
        if not rows:
            lines += ["nothing", ""]
            continue
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def sections(doc: Mapping[str, Any]) -> list[Section]:
    return [Section(title, columns=cols, rows=tuple(tuple(Entry(x, mark=MARK.get(x, "")) for x in r)
                                                    for r in rows)) if rows else Section(title)
            for title, cols, rows in tables(doc)]


def write(doc: Mapping[str, Any], out: Path) -> Sequence[Path]:
    """prove.json, prove.md and prove.html under `out`."""
    js, md = out / "prove.json", out / "prove.md"
    js.write_text(json.dumps(doc, indent=1) + "\n")
    md.write_text(markdown(doc))
    c = doc["commits"]
    page = write_index(out / "prove.html", "nmoe prove", sections(doc),
                       f"{doc['verdict']}: {c['compared']}" + (" (dirty tree)" if c["dirty"] else ""))
    return js, md, page
