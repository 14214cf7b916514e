"""Compile fast kernels for one arch without a GPU and check their PTX for expected instructions.

CuTeDSL fixes its target arch at first import, so `compile_rows` runs one fresh
`python -m nmoe.fast.compilecheck --arch A --json` per arch. Rows are the parity report's `compile` rows.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmoe.fast import FAST_MODULES, runtime
from nmoe.fast.arch import SUPPORTED_ARCHS
from nmoe.fast.limits import FAST_PDL
from nmoe.fast.runtime import KernelSpec
from nmoe.provenance import REPO_ROOT

MODULE = "nmoe.fast.compilecheck"
TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Inventory:
    """The kernels of each registry op (`KernelSpec.op` -> kernel names); modules that fail to import."""

    kernels: Mapping[str, tuple[str, ...]]
    broken: tuple[tuple[str, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {"ops": {op: list(ks) for op, ks in self.kernels.items()},
                "broken": [{"module": m, "error": e} for m, e in self.broken]}


@dataclass(frozen=True)
class Selection:
    """Which kernels a compilecheck process compiles: by registry op, module and kernel name (empty: all)."""

    ops: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()
    ptx_dir: str | None = None

    def argv(self) -> list[str]:
        flags = {"--ops": self.ops, "--modules": self.modules, "--kernels": self.kernels}
        out = [a for flag, v in flags.items() if v for a in (flag, ",".join(v))]
        return out + (["--ptx-dir", self.ptx_dir] if self.ptx_dir else [])


def _specs(modules: Sequence[str]) -> tuple[list[KernelSpec], list[tuple[str, str]]]:
    specs: list[KernelSpec] = []
    broken: list[tuple[str, str]] = []
    for name in modules:
        try:
            specs.extend(importlib.import_module(name).KERNELS)
        except Exception as e:
            broken.append((name, f"{type(e).__name__}: {e}"))
    return specs, broken


def inventory(modules: Sequence[str] = FAST_MODULES) -> Inventory:
    """Imports the glue modules only (CuTeDSL stays unloaded), so any process can ask."""
    specs, broken = _specs(modules)
    kernels: dict[str, tuple[str, ...]] = {}
    for s in specs:
        kernels[s.op] = (*kernels.get(s.op, ()), s.name)
    return Inventory(dict(sorted(kernels.items())), tuple(broken))


def row(op: str, kernel: str, arch: str, status: str = "fail", error: str | None = None,
        seconds: float = 0.0, expect: Sequence[str] = (), forbid: Sequence[str] = ()) -> dict[str, Any]:
    """A parity-report `compile` row; `forbidden` (regex -> found) extends the pinned schema."""
    return {"op": op, "kernel": kernel, "arch": arch, "status": status, "seconds": round(seconds, 3),
            "instructions": {rx: False for rx in expect}, "forbidden": {rx: False for rx in forbid},
            "error": error}


PDL_WAIT = r"\bgriddepcontrol\.wait;"
PDL_WAIT_FIRST = r"\A(?:(?!\b(?:ld|st|atom|red)\.global|\bcp\.async)[\s\S])*\bgriddepcontrol\.wait;"
"""The wait before any global load, store, atomic or async copy: a kernel launched early under PDL."""


def pdl_rules(spec: KernelSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(expected, forbidden) additions: under limits.FAST_PDL every kernel nmoe launches waits for the grid
    before it ahead of any memory access (prims.await_upstream); otherwise none waits."""
    if not spec.launched_here:
        return (), ()
    return ((PDL_WAIT_FIRST,), ()) if FAST_PDL else ((), (PDL_WAIT,))


def check(spec: KernelSpec, arch: str, ptx_dir: Path | None = None) -> dict[str, Any]:
    declared = spec.expect.get(arch, ())
    pdl_expect, pdl_forbid = pdl_rules(spec)
    expect = (*declared, *pdl_expect) if declared else declared
    forbid = (*spec.forbid.get(arch, ()), *pdl_forbid)
    r = row(spec.op, spec.name, arch, expect=expect, forbid=forbid)
    t0 = time.perf_counter()
    try:
        ptx = spec.compile(arch)
    except NotImplementedError as e:
        r["status"] = "not run"
        r["error"] = f"not applicable: {e}"
        return r
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        return r
    finally:
        r["seconds"] = round(time.perf_counter() - t0, 3)
    if ptx_dir is not None:
        (ptx_dir / f"{spec.name}.ptx").write_text(ptx)
    r["instructions"] = {rx: re.search(rx, ptx) is not None for rx in expect}
    r["forbidden"] = {rx: re.search(rx, ptx) is not None for rx in forbid}
    missing = [rx for rx, found in r["instructions"].items() if not found]
    present = [rx for rx, found in r["forbidden"].items() if found]
    if not expect:
        r["error"] = f"{spec.name} declares no expected instructions for {arch}"
    elif missing or present:
        r["error"] = f"missing {missing}; forbidden present {present}"
    else:
        r["status"] = "ok"
    return r


# ----------------------------------------------------------------------------------------------------------
# The one spawner: a fresh process per arch


Spawned = tuple[str, list[str], subprocess.Popen[str]]


def spawn(archs: Sequence[str], sel: Selection, module: str = MODULE) -> list[Spawned]:
    """Start `python -m <module> --arch A --json ...` for every arch now; `collect` waits for them."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("CUTE_DSL_ARCH", None)
    out: list[Spawned] = []
    for arch in archs:
        cmd = [sys.executable, "-m", module, "--arch", arch, "--json", *sel.argv()]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                env=env)
        out.append((arch, cmd, proc))
    return out


def collect(procs: Sequence[Spawned], t0: float, timeout: float = TIMEOUT_S) -> list[dict[str, Any]]:
    """Rows of every arch in order; a process that times out, is missing or exits badly becomes one row."""
    rows: list[dict[str, Any]] = []
    for arch, cmd, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            rows.append(row("*", "*", arch, error=f"compile check timed out after {timeout:.0f}s"))
            continue
        secs = time.perf_counter() - t0
        module = cmd[cmd.index("-m") + 1]
        if proc.returncode != 0 and f"No module named {module}" in err:
            rows.append(row("*", "*", arch, "not run", f"{module} does not exist", secs))
            continue
        lines = out.strip().splitlines()
        try:
            got = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
        except json.JSONDecodeError:
            got = None
        if not isinstance(got, list):
            tail = " | ".join((err or out).strip().splitlines()[-3:])
            rows.append(row("*", "*", arch, error=f"`{' '.join(cmd[1:])}` exited {proc.returncode}: {tail}",
                            seconds=secs))
            continue
        rows += [r for r in got if isinstance(r, dict)]
    return rows


def compile_rows(archs: Sequence[str], sel: Selection, module: str = MODULE) -> list[dict[str, Any]]:
    return collect(spawn(archs, sel, module), time.perf_counter())


# ----------------------------------------------------------------------------------------------------------
# The child


def _csv(s: str) -> list[str]:
    return [o for o in s.split(",") if o]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nmoe.fast.compilecheck", description=__doc__)
    p.add_argument("--arch", choices=SUPPORTED_ARCHS, help="the arch to compile for (required to compile)")
    p.add_argument("--list", action="store_true", help="print the kernels of every op as JSON and exit")
    p.add_argument("--ops", default="", help="comma-separated registry ops (KernelSpec.op; default: all)")
    p.add_argument("--modules", default="", help="comma-separated fast modules (default: all)")
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    p.add_argument("--ptx-dir", type=Path, help="also write each kernel's PTX as <dir>/<arch>/<kernel>.ptx")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.list:
        print(json.dumps(inventory().to_json()))
        return 0
    if args.arch is None:
        p.error("--arch is required to compile (or pass --list)")
    ops, modules, kernels = _csv(args.ops), _csv(args.modules), _csv(args.kernels)
    unknown = [m for m in modules if m not in FAST_MODULES]
    if unknown:
        p.error(f"unknown modules {unknown}; the fast modules are {', '.join(FAST_MODULES)}")
    specs, broken = _specs(modules or FAST_MODULES)
    unknown = [o for o in ops if o not in {s.op for s in specs}]
    unknown += [k for k in kernels if k not in {s.name for s in specs}]
    if unknown and not broken:
        p.error(f"no kernels named or declared for {unknown}; `--list` prints the kernels of every op")
    if "cutlass" not in sys.modules:
        os.environ["CUTE_DSL_ARCH"] = args.arch
    elif runtime.dsl_arch() != args.arch:
        print(f"compilecheck: CuTeDSL is already imported for {runtime.dsl_arch()}; run a fresh process",
              file=sys.stderr)
        return 2
    rows = [row(m, "*", args.arch, error=e) for m, e in broken]
    selected = [s for s in specs if (not ops or s.op in ops) and (not kernels or s.name in kernels)]
    try:
        runtime.import_cutlass(args.arch)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        rows += [row(s.op, s.name, args.arch, error=error, expect=s.expect.get(args.arch, ()))
                 for s in selected]
        selected = []
    ptx_dir = None if args.ptx_dir is None else args.ptx_dir / args.arch
    if ptx_dir is not None:
        ptx_dir.mkdir(parents=True, exist_ok=True)
    rows += [check(s, args.arch, ptx_dir) for s in selected]
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['status']:4} {r['arch']} {r['op']}/{r['kernel']} {r['seconds']:.2f}s"
                  + (f"  {r['error']}" if r["error"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
