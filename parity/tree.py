"""Walk op arguments and results (tensors inside tuples, lists, dicts and frozen dataclasses), so one
code path moves MLAParams, RdepRecv lists, Permuted and plain tuples between devices and dtypes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def tree_map(fn: Callable[[Tensor], Tensor], obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(tree_map(fn, v) for v in obj)
    if isinstance(obj, list):
        return [tree_map(fn, v) for v in obj]
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: tree_map(fn, getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if _holds_tensor(getattr(obj, f.name))
        }
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, Tensor):
        return True
    if isinstance(obj, tuple | list):
        return any(_holds_tensor(v) for v in obj)
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_holds_tensor(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False


def flatten(obj: Any) -> list[Tensor]:
    """Tensors of a result in a fixed order; Python numbers become 0-dim tensors, None is skipped."""
    if obj is None:
        return []
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, bool | int | float):
        return [torch.tensor(obj)]
    if isinstance(obj, tuple | list):
        return [t for v in obj for t in flatten(v)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in flatten(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in flatten(getattr(obj, f.name))]
    raise TypeError(f"cannot flatten a {type(obj).__name__} result; return tensors, tuples or dataclasses")


def clone(obj: Any) -> Any:
    return tree_map(lambda t: t.clone(), obj)


def upcast(obj: Any) -> Any:
    """Float tensors to float64 (values unchanged); integer tensors untouched."""
    return tree_map(lambda t: t.to(torch.float64) if t.is_floating_point() else t, obj)


def to_device(obj: Any, device: str | torch.device) -> Any:
    return tree_map(lambda t: t.to(device), obj)


def to_cpu(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu(), obj)
