"""The expert-parallel layer beyond RDEP's bitwise ops, run SPMD on one GPU shared by W ranks: a captured
forward and backward over the exchange writes and reads the return buffers its capture named, whatever eager
RDEP calls ran between its replays (train() with train.cuda_graph over expert parallelism:
tests/test_fast_ep_model.py); fp8 experts quantize at their owner (tests/test_fast_rdep.py holds the layer to
one process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_fast_rdep import _bits, _moe_ep_case, _moe_ep_outcomes, _need, _routes, _with_slots
from torch import Tensor

from nmoe.fast import rdep as fast
from parity import spmd

gpu = pytest.mark.gpu
WARMUP = 2


def graph_job(group: object, x: Tensor, ids: Tensor, c: Tensor, x2: Tensor) -> dict[str, Any]:
    """Capture out = ep_return(2 * ep_dispatch(x)) and loss = sum(c * out)'s backward as one graph, replay
    it, run one eager forward (one return, so the host's return count turns odd against the capture's),
    then replay on x2: out and dx of both replays."""
    got: dict[str, Any] = _with_slots(group, _graph_rank, x, ids, c, x2)
    return got


def _graph_rank(group: Any, slots: Any, x: Tensor, ids: Tensor, c: Tensor, x2: Tensor) -> dict[str, Any]:
    from nmoe.fast.rdep import ep

    dev = group.device
    ex = ep.Exchange(group, slots)
    xs = x.to(dev).requires_grad_()
    idd, cd = ids.to(dev), c.to(dev)[:, :, None]

    def step() -> Tensor:
        rows, _, _ = ep.ep_dispatch(xs, idd, ex)
        out = ep.ep_return(rows * 2, idd, ex)
        (out.float() * cd).sum().backward()
        return out

    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
            xs.grad = None
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    assert xs.grad is not None
    first = {"out1": out.detach().clone(), "dx1": xs.grad.clone()}
    before = group.returns
    with torch.no_grad():
        eager = ep.ep_return(ep.ep_dispatch(xs, idd, ex)[0], idd, ex).clone()
    odd = (group.returns - before) % 2 == 1
    with torch.no_grad():
        xs.copy_(x2.to(dev))
    graph.replay()
    group.sync_check()
    slots.sync_check()
    got = {**first, "out2": out.detach().clone(), "dx2": xs.grad.clone(), "eager": eager}
    return {**{k: v.cpu() for k, v in got.items()}, "odd": odd}


def _graph_outcomes(w: int, seed: int) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor],
                                                 list[dict[str, Any]]]:
    from nmoe.fast.rdep import spmd as ranks

    t, k, nl = 24, 3, 2
    xs, ids = _routes(w, nl, t, k, "uniform", seed)
    g = torch.Generator().manual_seed(seed + 1)
    cs = [torch.randint(-3, 4, (t, k), generator=g).float() for _ in range(w)]
    x2s = [torch.randn(t, 40, generator=g).to(torch.bfloat16) for _ in range(w)]
    shape = fast.RdepShape(world=w, n_experts=w * nl, tokens=t, top_k=k, hidden=40, dtype=torch.bfloat16,
                           capacity=_need(ids, w * nl))
    args = tuple(zip(xs, ids, cs, x2s, strict=True))
    return xs, cs, x2s, ids, spmd.pool(w).run(ranks.Job(graph_job, shape, args))


def _assert_replays(w: int, seed: int) -> None:
    xs, cs, x2s, ids, outs = _graph_outcomes(w, seed)
    t, k = ids[0].shape
    for r, o in enumerate(outs):
        for x, name in ((xs[r], "out1"), (x2s[r], "out2")):
            two = (x.float() * 2).to(torch.bfloat16)[:, None, :].expand(t, k, 40)
            assert torch.equal(_bits(o[name]), _bits(two)), f"rank {r} {name}"
        assert torch.equal(_bits(o["eager"]), _bits(xs[r][:, None, :].expand(t, k, 40))), f"rank {r} eager"
        want = (2 * cs[r].sum(1))[:, None].expand(t, 40).to(torch.bfloat16)
        for name in ("dx1", "dx2"):
            assert torch.equal(_bits(o[name]), _bits(want)), f"rank {r} {name}"


@gpu
@pytest.mark.parametrize("w", [2, 4], ids=["W2", "W4"])
def test_graph_over_rdep_replays_its_own_return_buffers(w: int) -> None:
    _assert_replays(w, 31)


@gpu
def test_sep_rdep_fast_return_buffer_by_device_count() -> None:
    """Between the replays one eager return runs: the device's return count then has the other parity than
    the capture's host count, so a kernel choosing its buffer by the device count writes the buffer the
    replay does not read; x2 differs from x, so the stale rows cannot pass for the new ones."""
    xs, _, x2s, _, outs = _graph_outcomes(2, 32)
    assert all(o["odd"] for o in outs), "an odd count of eager returns must run between the replays"
    assert all(not torch.equal(_bits(a), _bits(b)) for a, b in zip(xs, x2s, strict=True))
    _assert_replays(2, 32)


@gpu
def test_sep_moe_fast_ep_fp8_down_unquantized() -> None:
    """Quantizing this case's w2 to e4m3 in 128 x 128 blocks moves its values, so a down projection run on the
    bf16 weights cannot match the one-process fp8 layer bit for bit."""
    from nmoe.reference.formats import dequantize_mxfp8_weight, quantize_mxfp8_weight

    xs, p, cfg, douts, shape = _moe_ep_case(2, "fp8")
    w2 = p.w2.float()
    assert not torch.equal(dequantize_mxfp8_weight(*quantize_mxfp8_weight(w2)), w2)
    outs = _moe_ep_outcomes(2, xs, p, cfg, douts, shape)
    assert all(o["out_bitwise"] for o in outs)
