"""The expert-parallel layer beyond RDEP's bitwise ops, run SPMD on one GPU shared by W ranks: a captured
forward and backward over the exchange writes and reads the return buffers its capture named, whatever eager
RDEP calls ran between its replays (train() with train.cuda_graph over expert parallelism:
tests/test_fast_ep_model.py); fp8 experts quantize at their owner (tests/test_fast_rdep.py holds the layer to
one process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_fast_moe_glue import EXPERT_SUBS
from test_fast_rdep import _bits, _moe_ep_case, _moe_ep_outcomes, _need, _OneRank, _routes, _with_slots
from torch import Tensor

from nmoe.fast import rdep as fast
from nmoe.reference.moe import ACTIVATIONS
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


# ------------------------------------------------------------------ fp8 experts' glue on CPU


class _SpecSwiglu(torch.autograd.Function):
    """The spec's swiglu with its spec backward, as the fast op carries its own."""

    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        out: Tensor = ACTIVATIONS["swiglu"][0](h)
        return out

    @staticmethod
    def backward(ctx: Any, da: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        dh: Tensor = ACTIVATIONS["swiglu"][1](da.contiguous(), h)
        return dh


def _fp8_glue(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Tensor], list[Tensor]]:
    """ep_routed with fp8 experts on CPU, the spec's ops standing in for the kernels and a one-rank stand-in
    for RDEP (one expert, rows in slot order), against the spec's fp8 experts on the same rows: (out and
    the gradients of x, weights, w_up, w2) of each."""
    import nmoe.fast.experts as fx
    from nmoe.fast.rdep import ep
    from nmoe.reference import moe as rm

    t, k, d, i = 4, 2, 128, 128
    for name, fn in EXPERT_SUBS.items():
        monkeypatch.setattr(fx, name, fn)
    monkeypatch.setattr(ep, "BY_NAME", {"swiglu": (_SpecSwiglu.apply, ACTIVATIONS["swiglu"][1])})
    def combine(y: Tensor, w: Tensor, scale: float, shared: Tensor | None) -> Tensor:
        out: Tensor = rm._apply(rm._Combine, y, w, scale, shared)
        return out

    monkeypatch.setattr(ep, "combine", combine)
    monkeypatch.setattr(ep, "rdep_dispatch", lambda g, x, ids: g.dispatch(g, x, ids))
    monkeypatch.setattr(ep, "rdep_return", lambda g, y, sent=None: g.ret(g, y, sent))
    ex = ep.Exchange(_OneRank(t, k), _OneRank(t * k, 1))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(41)

    def leaves() -> list[Tensor]:
        g.manual_seed(41)
        return [torch.randn(t, d, generator=g).to(torch.bfloat16).requires_grad_(),
                (torch.rand(t, k, generator=g) + 0.1).requires_grad_(),
                (torch.randn(1, 2 * i, d, generator=g) / d**0.5).to(torch.bfloat16).requires_grad_(),
                (torch.randn(1, d, i, generator=g) / i**0.5).to(torch.bfloat16).requires_grad_()]

    dout = torch.randn(t, d, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    x, w, up, w2 = mine = leaves()
    out = ep.ep_routed(x, w, torch.zeros(t, k, dtype=torch.int64), up, w2, "swiglu", 2.5, None, ex, "fp8")
    x, w, up, w2 = spec = leaves()
    y = rm.ffn(x.repeat_interleave(k, 0), up[0], w2[0], "swiglu", "fp8")
    want = combine(y.view(t, k, d), w, 2.5, None)
    return ([out, *torch.autograd.grad(out, mine, dout)], [want, *torch.autograd.grad(want, spec, dout)])


def test_ep_routed_fp8_glue_matches_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out, the router weights' and the experts' gradients bit for bit (the same spec ops in the same order:
    the straight-through bf16 dgrad/wgrad of the unquantized rows and weights); dx within a bf16 rounding
    (the dispatch's backward sums a token's K rows in fp32, autograd's repeat in bf16)."""
    (out, dx, dw, dup, dw2), (want, wdx, wdw, wup, wdw2) = _fp8_glue(monkeypatch)
    assert torch.equal(_bits(out), _bits(want))
    for name, a, b in (("weights", dw, wdw), ("w_up", dup, wup), ("w2", dw2, wdw2)):
        assert torch.equal(_bits(a), _bits(b)), f"d{name}"
    assert float((dx.double() - wdx.double()).abs().max()) <= 2.0**-7 * float(wdx.double().abs().max())


def test_sep_moe_fast_experts_fp8_weight_grad_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec's expert weight gradients are far from zero here, so an fp8 GEMM whose backward gives its
    weight none cannot match them."""
    (_, _, _, dup, dw2), (_, _, _, wup, wdw2) = _fp8_glue(monkeypatch)
    assert float(wup.abs().max()) > 0.01 and float(wdw2.abs().max()) > 0.01
    assert torch.equal(_bits(dup), _bits(wup)) and torch.equal(_bits(dw2), _bits(wdw2))


# ------------------------------------------------------------------ the return buffer, named by the host


class _Words:
    device = 0

    def read(self) -> tuple[int, ...]:
        return (0, 0, 0, 0)


def _cpu_group() -> Any:
    """An RdepGroup's host state on CPU (no windows): what rdep_return reads before it launches."""
    from nmoe.fast.rdep.group import Layout, RdepGroup

    shape = fast.RdepShape(world=2, n_experts=4, tokens=3, top_k=2, hidden=8, dtype=torch.bfloat16,
                           capacity=12)
    g = object.__new__(RdepGroup)
    g.shape, g.rank, g.device, g.arch, g.layout = shape, 0, torch.device("cpu"), "sm_90a", Layout.of(shape)
    g.status, g.returns, g.limit_ns = _Words(), 0, 1
    g.recv_row = torch.zeros(12, dtype=torch.int64)
    g.local = torch.zeros(2, dtype=torch.int32)
    g.peers, g.epoch = torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    g.outs = torch.zeros(2, 3, 2, 8, dtype=torch.bfloat16)
    return g


def test_sep_rdep_return_view_other_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rdep_return hands its caller the very buffer it names to the kernel (the last launch argument),
    alternating call by call: a CUDA graph replays both. The two buffers are distinct memory, so a view of
    the other one cannot pass."""
    import nmoe.fast.rdep.group as grp

    told: list[int] = []

    class _Kernel:
        def launcher(self, arch: str, **spec: Any) -> Any:
            return lambda device, *values: told.append(int(values[-1]))

    monkeypatch.setattr(grp, "RETURN", _Kernel())
    g = _cpu_group()
    assert g.outs[0].data_ptr() != g.outs[1].data_ptr()
    y = torch.zeros(12, 8, dtype=torch.bfloat16)
    got = [grp.rdep_return(g, y) for _ in range(3)]
    assert told == [1, 0, 1]
    assert [t.data_ptr() for t in got] == [g.outs[b].data_ptr() for b in told]
