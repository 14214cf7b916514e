"""The source files of a registry op, from the code rather than a list: its kernel modules' compile-cache
graph, its glue and spec modules, its parity family file. `nmoe report` judges staleness with them and
`nmoe prove` picks the ops a change touches."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path


class SourceGraphError(Exception):
    """An op's sources cannot be found from this checkout; the message names the fix."""


def _file(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


@functools.cache
def _kernel_modules() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """op -> (kernel modules, glue modules whose KERNELS serve it), from every fast module's KernelSpecs."""
    found: dict[str, tuple[set[str], set[str]]] = {}
    for glue, specs in _glue_specs().items():
        for op, kernel in specs:
            mods, glues = found.setdefault(op, (set(), set()))
            mods.add(kernel)
            glues.add(glue)
    return {op: (frozenset(m), frozenset(g)) for op, (m, g) in found.items()}


@functools.cache
def _glue_specs() -> dict[str, tuple[tuple[str, str], ...]]:
    """fast glue module -> (op, kernel module) of each KernelSpec it declares."""
    from nmoe.fast import FAST_MODULES
    from nmoe.fast.op import Compiler

    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for glue in FAST_MODULES:
        pairs = []
        for spec in importlib.import_module(glue).KERNELS:
            if not isinstance(spec.compile, Compiler):
                raise SourceGraphError(f"{glue}: KernelSpec {spec.name} does not compile through a Kernel "
                                       "(build it with Kernel.compiler), so its sources cannot be found")
            pairs.append((spec.op, spec.compile.kernel.module))
        out[glue] = tuple(pairs)
    return out


def _closure(modules: set[str]) -> set[str]:
    """`modules` and every nmoe module they import, transitively."""
    from nmoe.fast.op import imports

    seen: set[str] = set()
    todo = sorted(modules)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(sorted(imports(m) - seen))
    return seen


def op_sources(op: str, repo: Path) -> tuple[str, ...]:
    """Repo-relative source files of `op` (import closure, its kernels' compile-cache graph, its parity family
    file), found from the code so staleness checks and `nmoe prove` see every file that can change it."""
    # The import closure starts from its fast glue and reference modules: those the registry names and those
    # defining its functions and KernelSpecs. The compile-cache graph of every kernel module that another glue
    # module in that closure declares is included too, because a layer built from other ops depends on their
    # kernels.
    from nmoe.fast.op import source_files
    from parity.registry import FAMILIES, REGISTRY, resolve_fast, resolve_reference

    entry = REGISTRY[op]
    kernels, glues = _kernel_modules().get(op, (frozenset(), frozenset()))
    fast, _ = resolve_fast(entry)
    ref, _ = resolve_reference(entry)
    modules = {f"nmoe.fast.{entry.module}", f"nmoe.reference.{entry.module}", *glues,
               *(f.__module__ for f in (fast, ref) if f is not None)}
    modules |= {fam.__name__ for fam in FAMILIES if any(e.name == op for e in fam.ENTRIES)}
    closure = _closure({m for m in modules if _file(m) is not None})
    glue_specs = _glue_specs()
    own = set(glues) | {f"nmoe.fast.{entry.module}"}
    kernels |= {k for g in (closure & glue_specs.keys()) - own for _, k in glue_specs[g]}
    files = {p for p in map(_file, closure) if p is not None}
    files |= {p for k in kernels for p in source_files(k)}
    root = repo.resolve()
    out = []
    for p in files:
        try:
            out.append(p.resolve().relative_to(root).as_posix())
        except ValueError as e:
            raise SourceGraphError(f"{p} is outside the checkout {root}; run the command with the nmoe "
                                   "of that checkout on PYTHONPATH (or installed editable from it)") from e
    return tuple(sorted(out))
