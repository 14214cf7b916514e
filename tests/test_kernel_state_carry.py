"""A CuTeDSL loop or dynamic `if` carries out only the names it assigns or calls a method on. A pipeline
state passed to a helper that advances it, with nothing assigned back, restarts every iteration: the wgrad
producer's did (H200: hangs past one tile per CTA). This reads every kernel's source for that shape."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "nmoe" / "fast" / "kernels"
Region = ast.For | ast.While | ast.If
Loop = ast.For | ast.While
MUTATORS = ("advance", "set")
"""Methods that change staged state in place: a pipeline state's position, a TiledMma's fields."""


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.args]


def _base(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _callee(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def _advanced_args(call: ast.Call, advancers: dict[str, set[str]], fns: dict[str, list[str]]) -> list[str]:
    """Names passed to call in a parameter slot the callee advances."""
    name = _callee(call)
    if name not in advancers:
        return []
    params = fns[name]
    out = [a.id for i, a in enumerate(call.args) if isinstance(a, ast.Name) and i < len(params)
           and params[i] in advancers[name]]
    out += [kw.value.id for kw in call.keywords
            if isinstance(kw.value, ast.Name) and kw.arg in advancers[name]]
    return out


def _functions(trees: list[ast.Module]) -> dict[str, ast.FunctionDef]:
    return {n.name: n for t in trees for n in ast.walk(t) if isinstance(n, ast.FunctionDef)}


def advancers_of(trees: list[ast.Module]) -> dict[str, set[str]]:
    """Function -> the parameters it advances (`p.advance()`, `p.set(...)`, or p handed on to a slot that
    does), to a fixpoint."""
    fns = _functions(trees)
    params = {name: _params(fn) for name, fn in fns.items()}
    adv: dict[str, set[str]] = {}
    changed = True
    while changed:
        changed = False
        for name, fn in fns.items():
            found = set(adv.get(name, set()))
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                    found.add(_base(node.func.value) or "")
                found.update(_advanced_args(node, adv, params))
            found &= set(params[name])
            if found != adv.get(name, set()):
                adv[name] = found
                changed = True
    return {k: v for k, v in adv.items() if v}


def _is_dynamic(region: Region) -> bool:
    """Regions the DSL stages (constexpr ifs and unrolled loops run in Python and carry everything)."""
    test = region.iter if isinstance(region, ast.For) else region.test
    if not isinstance(test, ast.Call):
        return True
    name = _callee(test) or (test.func.attr if isinstance(test.func, ast.Attribute) else "")
    return name not in ("const_expr", "range_constexpr")


def _carried(region: Region) -> set[str]:
    """What the DSL yields out of a region: every stored name and every method call's base."""
    names: set[str] = set()
    body = [*region.body, *region.orelse] + ([region.test] if isinstance(region, ast.While) else [])
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                names.add(_base(node.func) or "")
    return names


def _read_after(fn: ast.FunctionDef, region: Region, name: str) -> bool:
    end = region.end_lineno or region.lineno
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) and n.lineno > end
               for n in ast.walk(fn))


def uncarried(trees: list[ast.Module]) -> list[str]:
    """Every call inside a staged region that advances a name the region does not carry out, where the
    name is live past it: the region is a loop or sits in one, or the function reads the name after it."""
    adv = advancers_of(trees)
    params = {name: _params(fn) for name, fn in _functions(trees).items()}
    found: list[str] = []

    def visit(node: ast.AST, regions: list[Region], fn: ast.FunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef):
                visit(child, [], child)
                continue
            if isinstance(child, ast.Call) and fn is not None:
                for name in _advanced_args(child, adv, params):
                    for i, region in enumerate(regions):
                        looped = any(isinstance(r, Loop) for r in regions[: i + 1])
                        live = looped or _read_after(fn, region, name)
                        if live and name not in _carried(region):
                            found.append(f"line {child.lineno}: {_callee(child)}() advances {name!r}, which "
                                         f"the region at line {region.lineno} does not carry")
            inner = [*regions, child] if isinstance(child, Region) and _is_dynamic(child) else regions
            visit(child, inner, fn)

    for tree in trees:
        visit(tree, [], None)
    return found


BROKEN = '''
def load(mainloop, state, t):
    for kt in range(t):
        mainloop.producer_acquire(state)
        state.advance()

def produce(mainloop, total):
    state = make_state()
    for rnd in range(total):
        if rnd < total:
            load(mainloop, state, rnd)
'''
FIXED = BROKEN.replace("        state.advance()\n", "        state.advance()\n    return state\n").replace(
    "            load(mainloop, state, rnd)", "            state = load(mainloop, state, rnd)")


MMA = '''
def block(mma, acc):
    mma.set(ACCUMULATE, False)
    gemm(mma, acc)

def tiles(mma, acc, n):
    for t in range(n):
        block(mma, acc)
    if n > 0:
        block(mma, acc)
    return 0
'''


def test_separating_sources_an_mma_field_set_in_a_helper_and_dropped_by_the_loop() -> None:
    """The loop drops the rebinding (flagged); the trailing `if` does too, but nothing reads mma after it."""
    assert advancers_of([ast.parse(MMA)]) == {"block": {"mma"}, "tiles": {"mma"}}
    found = uncarried([ast.parse(MMA)])
    assert len(found) == 1 and "line 8" in found[0], found
    fixed = MMA.replace("    gemm(mma, acc)\n", "    gemm(mma, acc)\n    return mma\n").replace(
        "        block(mma, acc)\n    if", "        mma = block(mma, acc)\n    if")
    assert uncarried([ast.parse(fixed)]) == []


def test_separating_sources_the_helper_that_restarts_its_state_and_the_one_that_returns_it() -> None:
    assert advancers_of([ast.parse(BROKEN)]) == {"load": {"state"}}
    broken = uncarried([ast.parse(BROKEN)])
    assert len(broken) == 2, broken
    assert all("'state'" in b for b in broken)
    assert uncarried([ast.parse(FIXED)]) == []


def test_no_kernel_loop_or_dynamic_if_drops_an_advanced_pipeline_state() -> None:
    files = sorted(KERNELS.rglob("*.py"))
    assert len(files) > 10, "the kernel sources are where this test expects them"
    trees = [ast.parse(f.read_text(), str(f)) for f in files]
    assert advancers_of(trees), "some kernel helper advances a pipeline state it is handed"
    assert uncarried(trees) == []
