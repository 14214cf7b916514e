"""The MoE routing path captured in one CUDA graph: replays on new routing equal eager bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from nmoe.fast.combine import combine
from nmoe.fast.dispatch import permute, unpermute
from nmoe.fast.router import expert_counts, router_topk

gpu = pytest.mark.gpu
T, E, K, H, ALIGN = 1024, 256, 8, 256, 128


def _logits(seed: int, skew: float) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    hot = torch.zeros(E)
    hot[: E // 16] = skew
    return (torch.randn(T, E, generator=g) + hot).cuda()


def _capture(step: Callable[[], tuple[Tensor, ...]]) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]:
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def _check_replays(step: Callable[[], tuple[Tensor, ...]], static_logits: Tensor) -> None:
    graph, outs = _capture(step)
    seen_ids: list[Tensor] = []
    for seed, skew in [(1, 0.0), (2, 3.0), (3, 0.5)]:
        static_logits.copy_(_logits(seed, skew))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for i, (g, e) in enumerate(zip(outs, eager, strict=True)):
            assert g.dtype == e.dtype and g.shape == e.shape
            assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), f"output {i}, routing seed {seed}"
        seen_ids.append(outs[1].clone())
    assert not torch.equal(seen_ids[0], seen_ids[1]), "replays must see new routing"


@gpu
def test_graph_router_permute_unpermute_replays_new_routing() -> None:
    static_logits = _logits(0, 0.0)
    bias = (torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.01).cuda()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).cuda()

    def step() -> tuple[Tensor, ...]:
        w, ids = router_topk(static_logits, bias, K, "sigmoid", 8, 4)
        p = permute(x, ids, E, ALIGN)
        y = unpermute(p.xp * 2, p.slot, T, K)
        return w, ids, expert_counts(ids, E), p.counts, p.offs, p.slot, p.xp, y

    _check_replays(step, static_logits)


@gpu
def test_graph_with_combine_replays_new_routing() -> None:
    static_logits = _logits(0, 0.0)
    bias = torch.zeros(E).cuda()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).cuda()
    shared = torch.randn(T, H, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16).cuda()

    def step() -> tuple[Tensor, ...]:
        w, ids = router_topk(static_logits, bias, K, "sigmoid", 8, 4)
        p = permute(x, ids, E, ALIGN)
        y = unpermute(p.xp, p.slot, T, K)
        out: Tensor = combine(y, w, 2.5, shared)
        return w, ids, out

    _check_replays(step, static_logits)
