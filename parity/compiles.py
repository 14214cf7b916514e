"""What a CPU parity run compiles: every kernel, or the kernels whose `KernelSpec.op` is a selected op."""

from __future__ import annotations

from collections.abc import Sequence

from nmoe.fast import compilecheck
from nmoe.fast.compilecheck import Selection
from parity.registry import OpEntry, fast_declared


def selection(entries: Sequence[OpEntry], filtered: bool) -> Selection | None:
    """None when no selected op has kernels. A fast module that fails to import hides its ops, so then every
    selected op with fast code is asked for and the compile processes report the broken module."""
    if not filtered:
        return Selection()
    inv = compilecheck.inventory()
    ops = tuple(e.name for e in entries if e.name in inv.kernels or (inv.broken and fast_declared(e)))
    return Selection(ops=ops) if ops else None
