"""Compile every fast kernel for one arch without a GPU and check its PTX for expected instructions.

Run one fresh process per arch (`python -m nmoe.fast.compilecheck --arch sm_90a --json`): CuTeDSL fixes
its target arch at first import. Rows are the `compile` rows of the parity report; exit 0 even on fail.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from nmoe.fast import FAST_MODULES, runtime
from nmoe.fast.arch import SUPPORTED_ARCHS
from nmoe.fast.runtime import KernelSpec


def _specs(modules: Sequence[str]) -> tuple[list[KernelSpec], list[dict[str, Any]]]:
    specs: list[KernelSpec] = []
    broken: list[dict[str, Any]] = []
    for name in modules:
        try:
            specs.extend(importlib.import_module(name).KERNELS)
        except Exception as e:
            broken.append({"module": name, "error": f"{type(e).__name__}: {e}"})
    return specs, broken


def _row(op: str, kernel: str, arch: str, expect: Sequence[str], forbid: Sequence[str]) -> dict[str, Any]:
    """A failing parity-report `compile` row; `forbidden` (regex -> found) extends the pinned schema."""
    return {"op": op, "kernel": kernel, "arch": arch, "status": "fail", "seconds": 0.0,
            "instructions": {rx: False for rx in expect}, "forbidden": {rx: False for rx in forbid},
            "error": None}


def check(spec: KernelSpec, arch: str) -> dict[str, Any]:
    expect = spec.expect.get(arch, ())
    forbid = spec.forbid.get(arch, ())
    row = _row(spec.op, spec.name, arch, expect, forbid)
    t0 = time.perf_counter()
    try:
        ptx = spec.compile(arch)
    except NotImplementedError as e:
        row["status"] = "not run"
        row["error"] = f"not applicable: {e}"
        return row
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        return row
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 3)
    row["instructions"] = {rx: re.search(rx, ptx) is not None for rx in expect}
    row["forbidden"] = {rx: re.search(rx, ptx) is not None for rx in forbid}
    missing = [rx for rx, found in row["instructions"].items() if not found]
    present = [rx for rx, found in row["forbidden"].items() if found]
    if not expect:
        row["error"] = f"{spec.name} declares no expected instructions for {arch}"
    elif missing or present:
        row["error"] = f"missing {missing}; forbidden present {present}"
    else:
        row["status"] = "ok"
    return row


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nmoe.fast.compilecheck", description=__doc__)
    p.add_argument("--arch", required=True, choices=SUPPORTED_ARCHS)
    p.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    specs, broken = _specs(FAST_MODULES)
    known = sorted({s.op for s in specs})
    unknown = [o for o in ops if o not in known]
    if unknown and not broken:
        print(f"compilecheck: unknown ops {unknown}; known ops: {', '.join(known)}", file=sys.stderr)
        return 2
    if "cutlass" not in sys.modules:
        os.environ["CUTE_DSL_ARCH"] = args.arch
    elif runtime.dsl_arch() != args.arch:
        print(f"compilecheck: CuTeDSL is already imported for {runtime.dsl_arch()}; run a fresh process",
              file=sys.stderr)
        return 2
    rows = [{**_row(b["module"], "*", args.arch, (), ()), "error": b["error"]} for b in broken]
    selected = [s for s in specs if not ops or s.op in ops]
    try:
        runtime.import_cutlass(args.arch)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        rows += [{**_row(s.op, s.name, args.arch, s.expect.get(args.arch, ()), ()), "error": error}
                 for s in selected]
        selected = []
    rows += [check(s, args.arch) for s in selected]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['status']:4} {r['arch']} {r['op']}/{r['kernel']} {r['seconds']:.2f}s"
                  + (f"  {r['error']}" if r["error"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
