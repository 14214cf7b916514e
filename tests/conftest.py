"""Shared test setup: GPU tests skip on machines without a supported CUDA device, saying why."""

from __future__ import annotations

import pytest
import torch

from nmoe.fast.arch import arch_of


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: fast-path execution not run (CPU compiles are checked by `nmoe parity`)"
    major, minor = torch.cuda.get_device_capability()
    if arch_of((major, minor)) is None:
        return f"GPU sm_{major}{minor} is not sm_90a/sm_100a: fast-path execution not run"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(marker)
