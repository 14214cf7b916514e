"""Gradient accumulation in place: while adding_to_grads() is on, a layer that can add a weight's gradient
into the .grad it already holds does so itself and hands autograd none (the fast MoE layer's routed experts:
no second gradient in memory, no separate add pass). The trainer turns it on for every microbatch after a
step's first; torch.autograd.grad, which never touches .grad, must run with it off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_ON = [False]
"""A list, not a thread-local: autograd runs backward functions on its own threads."""


def adding() -> bool:
    return _ON[0]


@contextlib.contextmanager
def adding_to_grads(on: bool = True) -> Iterator[None]:
    before = _ON[0]
    _ON[0] = on
    try:
        yield
    finally:
        _ON[0] = before
