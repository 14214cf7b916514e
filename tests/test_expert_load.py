"""Per-expert load: each expert's share of its layer's routed tokens, brought to the host in one copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nmoe.train.stepstats import router_stats


def test_per_expert_share_sums_to_one_per_layer() -> None:
    s = router_stats(["a", "b"], [torch.tensor([1, 2, 3, 2]), torch.tensor([0, 0, 5])],
                     [torch.zeros(4), torch.tensor([0.5, 0.0, -0.5])])
    assert [s[f"router/a/load/{e}"] for e in range(4)] == [0.125, 0.25, 0.375, 0.25]
    assert [s[f"router/b/load/{e}"] for e in range(3)] == [0.0, 0.0, 1.0]
    assert s["router/b/bias_range"] == 1.0
    empty = router_stats(["c"], [torch.zeros(2)], [torch.zeros(2)])
    assert empty["router/c/load/0"] == 0.0 and empty["router/c/load/1"] == 0.0
    assert router_stats([], [], []) == {}


def test_one_host_copy_for_all_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []
    real = torch.Tensor.cpu

    def counted(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        copies.append(self.numel())
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    names = [f"layers.{i}.ffn" for i in range(6)]
    router_stats(names, [torch.ones(8) for _ in names], [torch.zeros(8) for _ in names])
    assert copies == [6 * 16]


def test_mismatched_layers_fail() -> None:
    with pytest.raises(ValueError):
        router_stats(["a", "b"], [torch.ones(2), torch.ones(2)], [torch.zeros(2)])
