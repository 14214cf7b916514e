"""One case of one op: the spec alone (self-check against float64 expectations) or the fast op against the
spec, compared under the op's contract. Execution that did not happen is "not run" with its reason."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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
from parity.inputs import Inputs
from parity.oracles import Expect
from parity.registry import CPU, OpEntry, resolve_reference
from parity.tree import clone, flatten, to_cpu, to_device, upcast


@dataclass
class Outcome:
    status: str
    verdict: Verdict
    reason: str = ""


def not_run(reason: str) -> Outcome:
    return Outcome("not run", Verdict(False), reason)


def fail(reason: str, verdict: Verdict | None = None) -> Outcome:
    return Outcome("fail", verdict or Verdict(False), reason)


def _from_verdict(v: Verdict, note: str = "") -> Outcome:
    return Outcome("pass" if v.passed else "fail", v, v.detail if not v.passed else note)


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
        return fail(f"reference raised {type(e).__name__}: {e}")
    if inp.raises:
        return fail("the spec requires an error on these inputs but the reference returned")
    _, again = call(ref, inp, entry.inplace)
    verdicts = [determinism(out, again)]
    expects, source = expectations(entry, inp, entry.contract_for(CPU))
    if expects is not None:
        bad = _check_count(entry, len(out), len(expects), "reference")
        if bad is not None:
            return fail(bad.detail, bad)
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
            return not_run(f"fast path does not support this case: {e}")
        except Exception as e:
            return Outcome("pass", Verdict(True), f"raises as the spec requires ({type(e).__name__})")
        return fail("the spec requires an error on these inputs but the fast op returned")
    try:
        _, ref_out = call(ref, inp, entry.inplace)
    except Exception as e:
        return fail(f"reference raised {type(e).__name__}: {e}")
    try:
        fast_raw, fast_dev = call(fast, dev, entry.inplace)
    except NotImplementedError as e:
        return not_run(f"fast path does not support this case: {e}")
    except Exception as e:
        return fail(f"fast op raised {type(e).__name__}: {e}")
    fast_out = [t.detach().cpu() for t in fast_dev]
    verdicts: list[Verdict] = []
    bad = _check_count(entry, len(fast_out), len(ref_out), "fast op")
    if bad is not None:
        return fail(bad.detail, bad)
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
                return not_run(f"{_name(entry, i)}: {source}; the {c.label()} contract needs one")
        ex = expects[i] if i < len(expects) else None
        if ex is None:
            return not_run(f"{_name(entry, i)}: the oracle gives no expectation for a {c.label()} contract")
        verdicts.append(compare_output(f, ex, c, _name(entry, i)))
    fast_cpu = to_cpu(fast_raw)
    verdicts += [inv(inp, fast_cpu) for inv in entry.invariants]
    return _from_verdict(merge(verdicts), f"vs spec and {source} oracle" if source else "vs spec")
