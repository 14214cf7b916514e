"""`nmoe parity`: fast op vs spec on a GPU; on a CPU, spec self-checks plus sm_90a/sm_100a compiles.
Execution that did not happen is "not run" with its reason, never a pass; exit 1 when any case or
compile fails, 2 on usage errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import hypothesis
import torch
from torch import Tensor

from nmoe.fast.arch import arch_of
from nmoe.provenance import REPO_ROOT, provenance
from parity import report as rep
from parity.compare import (
    Contract,
    Verdict,
    bitwise,
    bound,
    determinism,
    gemm_radius,
    interval,
    merge,
    ratio,
    ulp,
)
from parity.inputs import Inputs, draws, generator
from parity.oracles import Expect
from parity.registry import (
    ARCHS,
    CPU,
    REGISTRY,
    OpEntry,
    fast_declared,
    resolve_fast,
    resolve_reference,
    select,
)
from parity.tree import clone, flatten, to_cpu, to_device, upcast

COMPILECHECK = "nmoe.fast.compilecheck"
COMPILE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Options:
    ops: tuple[str, ...] = ()
    arch: str | None = None
    mode: str = "selfcheck"
    device: str = "cuda"
    seed: int = 0
    cases: int = 3
    compile: bool = True
    quiet: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    params: dict[str, Any]
    adv: str | None


@dataclass
class Outcome:
    status: str
    verdict: Verdict
    reason: str = ""


def _not_run(reason: str) -> Outcome:
    return Outcome("not run", Verdict(False), reason)


def _fail(reason: str, verdict: Verdict | None = None) -> Outcome:
    return Outcome("fail", verdict or Verdict(False), reason)


def _from_verdict(v: Verdict, note: str = "") -> Outcome:
    return Outcome("pass" if v.passed else "fail", v, v.detail if not v.passed else note)


# ----------------------------------------------------------------------------------------------------------
# Cases


def op_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003) ^ zlib.crc32(name.encode())


def make_cases(entry: OpEntry, n_random: int, seed: int, big: bool) -> list[Case]:
    """n_random hypothesis draws plus one case per (adversarial kind, dtype), all from `seed`."""
    s = op_seed(seed, entry.name)
    cases = [Case(f"random/{i}", p, None) for i, p in enumerate(draws(entry.full_space(big), n_random, s))]
    pool = draws(entry.space(big), 4, s + 1) if entry.adversarial else []
    for j, adv in enumerate(entry.adversarial):
        for dtype in entry.dtypes:
            base = dict(pool[(j + 1) % len(pool)]) if pool else {}
            base["dtype"] = dtype
            cases.append(Case(f"adv:{adv}" + (f"/{dtype}" if len(entry.dtypes) > 1 else ""), base, adv))
    return cases


def build(entry: OpEntry, case: Case) -> Inputs:
    return entry.make(case.params, generator(int(case.params.get("seed", 0))), case.adv)


# ----------------------------------------------------------------------------------------------------------
# Calling ops and comparing outputs


def call(fn: Callable[..., Any], inp: Inputs, inplace: Sequence[int]) -> tuple[Any, list[Tensor]]:
    """Run fn on fresh copies of the inputs; in-place ops yield their mutated arguments."""
    args, kwargs = clone(inp.args), clone(dict(inp.kwargs))
    raw = fn(*args, **kwargs)
    if inplace:
        raw = tuple(args[i] for i in inplace)
    return raw, flatten(raw)


def expectations(entry: OpEntry, inp: Inputs, contract: Contract) -> tuple[list[Expect | None] | None, str]:
    """Float64 expectations: the independent oracle, else the spec on fp64 inputs where it accepts them."""
    if entry.oracle is not None:
        return list(entry.oracle(inp, contract)), "independent"
    if entry.ref64:
        ref, why = resolve_reference(entry)
        if ref is None:
            return None, why
        _, outs = call(ref, Inputs(upcast(inp.args), upcast(dict(inp.kwargs))), entry.inplace)
        low = flatten(entry.lowprec(inp)) if entry.lowprec is not None else []
        return [
            Expect(o, lowprec=low[i] if i < len(low) else None) for i, o in enumerate(outs)
        ], "reference@fp64"
    return None, "no float64 oracle"


def compare_output(actual: Tensor, exp: Expect, contract: Contract, what: str) -> Verdict:
    """One output against its expectation under its contract (bitwise contracts compare values here)."""
    if exp.exact or not actual.is_floating_point():
        return bitwise(actual, exp.value, what)
    if contract.kind in ("bitwise", "invariant"):
        return ulp(actual, exp.value, 0, what)
    if contract.kind == "ulp":
        return ulp(actual, exp.value, contract.n, what)
    if contract.kind == "bound":
        if exp.lo is not None and exp.hi is not None:
            return interval(actual, exp.lo, exp.hi, contract.n, what)
        if exp.mag is None:
            return Verdict(False, {}, f"{what}: the oracle gives no magnitude for a bound contract")
        return bound(actual, exp.value, gemm_radius(contract, exp.mag, exp.k), contract.n, what)
    if exp.lowprec is None:
        return Verdict(False, {}, f"{what}: the oracle gives no low-precision baseline for a ratio contract")
    v64 = exp.value.to(torch.float64)
    scale = float(v64.abs().nan_to_num(0.0, 0.0, 0.0).max()) if v64.numel() else 0.0
    return ratio(actual, exp.value, exp.lowprec, contract.c, contract.floor * scale, what)


def _name(entry: OpEntry, i: int) -> str:
    return entry.output_names[i] if i < len(entry.output_names) else f"out[{i}]"


def _check_count(entry: OpEntry, got: int, want: int, who: str) -> Verdict | None:
    if got != want:
        return Verdict(False, {}, f"{who} gave {got} output tensors, expected {want}")
    return None


def selfcheck_case(entry: OpEntry, ref: Callable[..., Any], inp: Inputs) -> Outcome:
    """Spec on one case: runs (or raises where it must), twice bitwise-equal, within contract vs float64."""
    try:
        raw, out = call(ref, inp, entry.inplace)
    except Exception as e:
        if inp.raises:
            return Outcome("pass", Verdict(True), f"raises as the spec requires ({type(e).__name__})")
        return _fail(f"reference raised {type(e).__name__}: {e}")
    if inp.raises:
        return _fail("the spec requires an error on these inputs but the reference returned")
    _, again = call(ref, inp, entry.inplace)
    verdicts = [determinism(out, again)]
    expects, source = expectations(entry, inp, entry.contract_for(CPU))
    if expects is not None:
        bad = _check_count(entry, len(out), len(expects), "reference")
        if bad is not None:
            return _fail(bad.detail, bad)
        for i, (a, ex) in enumerate(zip(out, expects, strict=True)):
            if ex is not None:
                verdicts.append(compare_output(a, ex, entry.contract_for(CPU, i), _name(entry, i)))
    verdicts += [inv(inp, raw) for inv in entry.invariants]
    note = f"vs {source} oracle" if expects is not None else f"determinism/invariants only ({source})"
    return _from_verdict(merge(verdicts), note)


def parity_case(
    entry: OpEntry, ref: Callable[..., Any], fast: Callable[..., Any], inp: Inputs, arch: str, device: str
) -> Outcome:
    """Fast op (on `device`) vs the spec (CPU) on one case, compared on CPU under the arch's contract."""
    dev = Inputs(
        to_device(inp.args, device),
        to_device(dict(inp.kwargs), device),
        inp.shape,
        inp.dtype,
        inp.raises,
        inp.meta,
    )
    if inp.raises:
        try:
            call(fast, dev, entry.inplace)
        except NotImplementedError as e:
            return _not_run(f"fast path does not support this case: {e}")
        except Exception as e:
            return Outcome("pass", Verdict(True), f"raises as the spec requires ({type(e).__name__})")
        return _fail("the spec requires an error on these inputs but the fast op returned")
    try:
        _, ref_out = call(ref, inp, entry.inplace)
    except Exception as e:
        return _fail(f"reference raised {type(e).__name__}: {e}")
    try:
        fast_raw, fast_dev = call(fast, dev, entry.inplace)
    except NotImplementedError as e:
        return _not_run(f"fast path does not support this case: {e}")
    except Exception as e:
        return _fail(f"fast op raised {type(e).__name__}: {e}")
    fast_out = [t.detach().cpu() for t in fast_dev]
    verdicts: list[Verdict] = []
    bad = _check_count(entry, len(fast_out), len(ref_out), "fast op")
    if bad is not None:
        return _fail(bad.detail, bad)
    if entry.deterministic:
        _, again = call(fast, dev, entry.inplace)
        verdicts.append(determinism(fast_out, [t.detach().cpu() for t in again]))
    expects: list[Expect | None] | None = None
    source = ""
    for i, (f, r) in enumerate(zip(fast_out, ref_out, strict=True)):
        c = entry.contract_for(arch, i)
        if c.kind == "bitwise" or not r.is_floating_point():
            verdicts.append(bitwise(f, r, _name(entry, i)))
            continue
        if expects is None:
            expects, source = expectations(entry, inp, entry.contract_for(arch))
            if expects is None:
                return _not_run(f"{_name(entry, i)}: {source}; the {c.label()} contract needs one")
        ex = expects[i] if i < len(expects) else None
        if ex is None:
            return _not_run(f"{_name(entry, i)}: the oracle gives no expectation for a {c.label()} contract")
        verdicts.append(compare_output(f, ex, c, _name(entry, i)))
    fast_cpu = to_cpu(fast_raw)
    verdicts += [inv(inp, fast_cpu) for inv in entry.invariants]
    return _from_verdict(merge(verdicts), f"vs spec and {source} oracle" if source else "vs spec")


# ----------------------------------------------------------------------------------------------------------
# Compiles


def _compile_cmd(arch: str, ops: Sequence[str] | None) -> list[str]:
    cmd = [sys.executable, "-m", COMPILECHECK, "--arch", arch, "--json"]
    return cmd + (["--ops", ",".join(ops)] if ops else [])


def _spawn(cmd: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env
    )


Compile = tuple[str, Sequence[str] | None, subprocess.Popen[str]]


def start_compiles(archs: Sequence[str], ops: Sequence[str] | None) -> list[Compile]:
    """One fresh `python -m nmoe.fast.compilecheck --arch A --json` process per arch, started now."""
    return [(arch, ops, _spawn(_compile_cmd(arch, ops))) for arch in archs]


def _compile_row(arch: str, status: str, error: str, seconds: float = 0.0) -> dict[str, Any]:
    return {
        "op": "*",
        "kernel": "*",
        "arch": arch,
        "status": status,
        "seconds": round(seconds, 3),
        "instructions": {},
        "error": error,
    }


def _known_ops(err: str) -> list[str] | None:
    """compilecheck's usage error lists the ops it has kernels for; None when it said something else."""
    marker = "known ops:"
    if marker not in err:
        return None
    return [o.strip() for o in err.split(marker, 1)[1].strip().splitlines()[0].split(",") if o.strip()]


def collect_compiles(
    procs: Sequence[Compile], t0: float, timeout: float = COMPILE_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Compile rows of every arch; ops without kernels are retried away, process failures become rows."""
    rows: list[dict[str, Any]] = []
    for arch, ops, proc in procs:
        cmd = _compile_cmd(arch, ops)
        try:
            out, err = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            known = _known_ops(err) if proc.returncode == 2 and ops else None
            if known is not None:
                ops = [o for o in (ops or []) if o in known]
                if not ops:
                    continue
                cmd = _compile_cmd(arch, ops)
                proc = _spawn(cmd)
                out, err = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            rows.append(_compile_row(arch, "fail", f"compile check timed out after {timeout:.0f}s"))
            continue
        secs = time.perf_counter() - t0
        if proc.returncode != 0 and f"No module named {COMPILECHECK}" in err:
            rows.append(_compile_row(arch, "not run", f"{COMPILECHECK} does not exist", secs))
            continue
        try:
            got = json.loads(out) if proc.returncode == 0 else None
        except json.JSONDecodeError:
            got = None
        if not isinstance(got, list):
            tail = (err or out).strip().splitlines()[-3:]
            rows.append(
                _compile_row(
                    arch, "fail", f"`{' '.join(cmd[1:])}` exited {proc.returncode}: " + " | ".join(tail), secs
                )
            )
            continue
        rows += [r for r in got if isinstance(r, dict)]
    return rows


def compile_ops(entries: Sequence[OpEntry], filtered: bool) -> list[str] | None:
    """--ops for compilecheck: None (all kernels) when unfiltered, else the selected ops with fast code and
    their forward op names (a backward kernel may be declared under its forward op, e.g. relu2)."""
    if not filtered:
        return None
    names: list[str] = []
    for e in entries:
        if fast_declared(e):
            for n in (e.name, e.name.rsplit("_", 1)[0]):
                if n not in names:
                    names.append(n)
    return names


# ----------------------------------------------------------------------------------------------------------
# Driver


class Progress:
    """Stderr progress for long runs: silent for the first seconds, one line per op after that."""

    def __init__(self, total: int, quiet: bool, stream: TextIO = sys.stderr) -> None:
        self.total, self.quiet, self.stream = total, quiet, stream
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()

    def op(self, i: int, name: str, n_cases: int) -> None:
        dt = time.perf_counter() - self.t0
        if self.quiet or dt < 3.0:
            return
        line = f"[parity] {i}/{self.total} ops  {dt:6.1f}s  {name} ({n_cases} cases)"
        self.stream.write(("\r" + line.ljust(78)) if self.tty else line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and not self.quiet and time.perf_counter() - self.t0 >= 3.0:
            self.stream.write("\n")


def _row(
    entry: OpEntry, arch: str, mode: str, case: Case, inp: Inputs | None, out: Outcome, secs: float
) -> dict[str, Any]:
    shape = (
        dict(inp.shape)
        if inp is not None
        else {k: v for k, v in case.params.items() if k not in ("seed", "dtype")}
    )
    return {
        "op": entry.name,
        "contract": entry.label(arch),
        "arch": arch,
        "dtype": (inp.dtype if inp is not None and inp.dtype else case.params.get("dtype", "")),
        "shape": shape,
        "seed": int(case.params.get("seed", 0)),
        "status": out.status,
        "worst": {k: float(v) for k, v in out.verdict.worst.items()},
        "reason": out.reason,
        "case": case.name,
        "mode": mode,
        "seconds": round(secs, 4),
    }


def run_entry(entry: OpEntry, opts: Options, arch: str) -> list[dict[str, Any]]:
    """All cases of one op in the chosen mode."""
    mode = opts.mode
    cases = make_cases(entry, opts.cases, opts.seed, big=mode == "parity" and opts.device != "cpu")
    rows: list[dict[str, Any]] = []
    row_arch = CPU if mode == "selfcheck" else arch
    ref, why = resolve_reference(entry)
    fast: Callable[..., Any] | None = None
    fast_why = ""
    if mode == "parity":
        if arch not in entry.archs:
            why_arch = f"contract defined for {', '.join(entry.archs)} only; this run is {arch}"
            return [_row(entry, arch, mode, c, None, _not_run(why_arch), 0.0) for c in cases]
        try:
            fast, fast_why = resolve_fast(entry)
        except Exception as e:
            return [
                _row(
                    entry,
                    arch,
                    mode,
                    c,
                    None,
                    _fail(f"importing the fast module raised {type(e).__name__}: {e}"),
                    0.0,
                )
                for c in cases
            ]
    for case in cases:
        if ref is None:
            rows.append(_row(entry, row_arch, mode, case, None, _not_run(why), 0.0))
            continue
        if mode == "parity" and fast is None:
            rows.append(_row(entry, row_arch, mode, case, None, _not_run(fast_why), 0.0))
            continue
        t0 = time.perf_counter()
        try:
            inp = build(entry, case)
        except ModuleNotFoundError as e:
            rows.append(
                _row(entry, row_arch, mode, case, None, _not_run(f"input builder needs {e.name}"), 0.0)
            )
            continue
        except Exception as e:
            rows.append(
                _row(
                    entry,
                    row_arch,
                    mode,
                    case,
                    None,
                    _fail(f"input builder raised {type(e).__name__}: {e}"),
                    0.0,
                )
            )
            continue
        if mode == "parity":
            assert fast is not None
            out = parity_case(entry, ref, fast, inp, arch, opts.device)
        else:
            out = selfcheck_case(entry, ref, inp)
        rows.append(_row(entry, row_arch, mode, case, inp, out, time.perf_counter() - t0))
    return rows


def fast_not_run_rows(entry: OpEntry, archs: Sequence[str], reason: str) -> list[dict[str, Any]]:
    """CPU mode: one "not run" row per (op, arch), so the report shows fast execution did not happen."""
    rows = []
    for arch in archs:
        if arch not in entry.archs:
            continue
        why = reason if fast_declared(entry) else "no fast implementation"
        case = Case("fast/*", {}, None)
        rows.append(_row(entry, arch, "parity", case, None, _not_run(why), 0.0))
        rows[-1]["dtype"] = ",".join(entry.dtypes)
    return rows


def detect_arch() -> tuple[str | None, str]:
    if not torch.cuda.is_available():
        return None, "no CUDA device on this host"
    cap = torch.cuda.get_device_capability()
    arch = arch_of(cap)
    return arch, "" if arch else f"GPU sm_{cap[0]}{cap[1]} is neither sm_90a nor sm_100a"


def run(opts: Options, command: str = "nmoe parity") -> dict[str, Any]:
    """Execute the selected contracts and return the report (not yet written anywhere)."""
    entries = select(list(opts.ops) or None)
    archs = [opts.arch] if opts.arch else list(ARCHS)
    t0 = time.perf_counter()
    wanted = compile_ops(entries, bool(opts.ops))
    procs = start_compiles(archs, wanted) if opts.compile and wanted != [] else []
    threads = torch.get_num_threads()
    if opts.mode == "selfcheck":
        torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    progress = Progress(len(entries), opts.quiet)
    try:
        gpu_arch, gpu_why = (None, "") if opts.mode == "selfcheck" else (opts.arch, "")
        if opts.mode == "parity" and opts.device != "cpu":
            detected, gpu_why = detect_arch()
            gpu_arch = opts.arch or detected
            if detected is None or (opts.arch and opts.arch != detected):
                gpu_why = gpu_why or f"this GPU is {detected}, not the requested {opts.arch}"
                gpu_arch = None
        for i, entry in enumerate(entries, 1):
            progress.op(i, entry.name, opts.cases + len(entry.adversarial) * len(entry.dtypes))
            if opts.mode == "parity" and gpu_arch is None:
                rows += [
                    _row(entry, opts.arch or "sm_90a", "parity", c, None, _not_run(gpu_why), 0.0)
                    for c in make_cases(entry, opts.cases, opts.seed, big=False)
                ]
                continue
            rows += run_entry(entry, opts, gpu_arch or CPU)
            if opts.mode == "selfcheck":
                rows += fast_not_run_rows(entry, archs, "no CUDA device: fast path not executed")
    finally:
        torch.set_num_threads(threads)
        progress.done()
    compile_rows = collect_compiles(procs, t0) if procs else []
    run_info = {
        "mode": opts.mode,
        "arch": opts.arch,
        "device": opts.device if opts.mode == "parity" else "cpu",
        "seed": opts.seed,
        "cases_per_op": opts.cases,
        "ops": list(opts.ops),
        "hypothesis": hypothesis.__version__,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return rep.build(provenance(command), rows, compile_rows, run_info)


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nmoe parity", description=__doc__)
    p.add_argument("--ops", default="", help="comma-separated op names or globs (default: all)")
    p.add_argument("--arch", choices=ARCHS, help="restrict compiles (CPU) / assert the GPU arch (GPU)")
    p.add_argument("--report", help="write the JSON report here")
    p.add_argument("--history", action="store_true", help="print the last runs per op from --db and exit")
    p.add_argument("--last", type=int, default=5, help="runs per op shown by --history")
    p.add_argument("--db", default=str(rep.DEFAULT_DB), help="DuckDB history file")
    p.add_argument("--no-db", action="store_true", help="do not append this run to the DuckDB history")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, help="random cases per op (default 3 on CPU, 8 on GPU)")
    p.add_argument(
        "--mode",
        choices=("auto", "selfcheck", "parity"),
        default="auto",
        help="auto: parity on a supported GPU, else reference self-checks",
    )
    p.add_argument(
        "--device", default="cuda", help="device of the fast op in parity mode (cpu: harness tests)"
    )
    p.add_argument("--no-compile", action="store_true", help="skip the sm_90a/sm_100a compile checks")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--list", action="store_true", help="list the registered contracts and exit")
    return p


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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    if args.list:
        print(list_table())
        return 0
    if args.history:
        print(rep.history(args.db, ops or None, args.last))
        return 0
    try:
        select(list(ops) or None)
    except ValueError as e:
        print(f"nmoe parity: {e}", file=sys.stderr)
        return 2
    mode = args.mode
    if mode == "auto":
        mode = "parity" if detect_arch()[0] is not None else "selfcheck"
    if mode == "parity" and args.device == "cpu" and args.arch is None:
        print("nmoe parity: --device cpu needs --arch to pick the contract's arch", file=sys.stderr)
        return 2
    cases = args.cases if args.cases is not None else (3 if mode == "selfcheck" else 8)
    opts = Options(
        ops=ops,
        arch=args.arch,
        mode=mode,
        device=args.device,
        seed=args.seed,
        cases=cases,
        compile=not args.no_compile and mode == "selfcheck",
        quiet=args.quiet,
    )
    report = run(opts, "nmoe parity " + " ".join(sys.argv[1:] if argv is None else argv))
    problems = rep.validate(report)
    if problems:
        print("nmoe parity: report does not match the schema: " + "; ".join(problems[:5]), file=sys.stderr)
        return 1
    if args.report:
        rep.write_json(args.report, report)
    if not args.no_db:
        rep.append_db(args.db, report)
    print(summary_table(report))
    s = report["summary"]
    return 1 if s["failed"] or s["compile"]["fail"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
