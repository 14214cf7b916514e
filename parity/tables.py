"""The text tables `nmoe parity` prints: the per-op summary of a report and the registered contracts."""

from __future__ import annotations

import math
from typing import Any

from parity import report as rep
from parity.registry import REGISTRY


def summary_table(report: dict[str, Any]) -> str:
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in report["cases"]:
        groups.setdefault((c["op"], c["contract"], c["arch"]), []).append(c)
    table = [["op", "contract", "arch", "cases pass/fail/not run", "worst"]]
    for (op, contract, arch), cs in groups.items():
        n = [sum(c["status"] == s for c in cs) for s in rep.STATUSES]
        worst: dict[str, float] = {}
        for c in cs:
            for k, v in c["worst"].items():
                worst[k] = max(worst.get(k, -math.inf), float(v))
        metric, value = rep.primary_worst(worst)
        shown = "-" if metric is None or value is None else f"{metric}={value:.3g}"
        table.append([op, contract, arch, f"{n[0]}/{n[1]}/{n[2]}", shown])
    out = rep.format_table(table)
    if report["compile"]:
        ctab = [["op", "kernel", "arch", "compile", "seconds", "note"]]
        for r in report["compile"]:
            ctab.append(
                [
                    r["op"],
                    r["kernel"],
                    r["arch"],
                    r["status"],
                    f"{float(r.get('seconds') or 0):.2f}",
                    (r.get("error") or "").splitlines()[0][:70] if r.get("error") else "",
                ]
            )
        out += "\n\n" + rep.format_table(ctab)
    s = report["summary"]
    out += (
        f"\n\ncases: {s['passed']} pass, {s['failed']} fail, {s['not_run']} not run; compiles: "
        f"{s['compile']['ok']} ok, {s['compile']['fail']} fail, {s['compile']['not_run']} not run"
    )
    return out


def list_table() -> str:
    rows = [["op", "spec", "contract", "dtypes", "archs", "oracle"]]
    notes = []
    for e in REGISTRY.values():
        oracle = "independent" if e.oracle else ("spec@fp64" if e.ref64 else "invariants")
        spec = f"reference/{e.module}.py::{e.fn}"
        rows.append([e.name, spec, e.label(), ",".join(e.dtypes), ",".join(e.archs), oracle])
        contracts = [e.contract, *e.arch_contracts.values(), *e.output_contracts.values()]
        notes += [f"  {e.name}: {c.label()}: {c.note}" for c in dict.fromkeys(contracts) if c.note]
        notes += [f"  {e.name}: {e.note}"] if e.note else []
    return rep.format_table(rows) + "\n\nderivations:\n" + "\n".join(notes)
