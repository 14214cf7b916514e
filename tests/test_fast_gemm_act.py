"""nmoe.fast.gemm's fused-activation forward on the GPU: bit for bit the unfused fast composition, and inside
the grouped_gemm_act bound against float64; its autograd, graph replay and torch.compile; and the separating
inputs of the fused epilogue's mutants."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from test_fast_gemm import cumsum, make, offs_of, uniform_counts, zipf_counts
from torch import Tensor

from nmoe.fast.activation import relu2, swiglu
from nmoe.fast.gemm import grouped_gemm, grouped_gemm_act
from nmoe.fast.gemm import sm90 as gemm
from parity.compare import interval
from parity.inputs import Inputs
from parity.ops import gemm as oracles
from parity.registry import REGISTRY

gpu = pytest.mark.gpu

FAST_ACT = {"swiglu": swiglu, "relu2": relu2}
ACTS = pytest.mark.parametrize("act", ["swiglu", "relu2"])


def bits(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.int16)


def assert_act_bound(a: Tensor, x: Tensor, w: Tensor, ends: Sequence[int], act: str) -> None:
    """The parity contract: GEMM bound plus h's rounding pushed through act as an interval, then n ULPs."""
    contract = REGISTRY["grouped_gemm_act"].contract
    offs = torch.tensor(list(ends), dtype=torch.int32)
    (expect,) = oracles.grouped_gemm_act(Inputs((x.cpu(), w.cpu(), offs, act)), contract)
    assert expect is not None and expect.lo is not None and expect.hi is not None
    verdict = interval(a.cpu(), expect.lo, expect.hi, contract.n)
    assert verdict.passed, verdict.detail


def fused(x: Tensor, w: Tensor, offs: Tensor, act: str, bn: int | None) -> tuple[Tensor, Tensor]:
    """(a, h) from one fused launch; outputs start as NaN so an element the kernel skips cannot pass."""
    if bn is None:
        a, h = torch.ops.nmoe.grouped_gemm_act(x, w, offs, act)
        return a, h
    width = w.shape[1] // 2 if act == "swiglu" else w.shape[1]
    a = torch.full((x.shape[0], width), float("nan"), dtype=torch.bfloat16, device="cuda")
    h = torch.full((x.shape[0], w.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm._launch("test", x, w, offs, h, True, bn, act_out=a, activation=act)
    return a, h


def check_act(m: int, n: int, k: int, counts: Sequence[int], act: str, seed: int = 0,
              bn: int | None = None) -> None:
    x, w = make(m, n, k, len(counts), seed)
    ends = cumsum(counts)
    offs = offs_of(ends)
    a, h = fused(x, w, offs, act, bn)
    h_plain = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm._launch("test", x, w, offs, h_plain, True, bn)
    assert torch.equal(bits(h), bits(h_plain))
    assert torch.equal(bits(a), bits(FAST_ACT[act](h_plain)))
    if bn is None:
        assert torch.equal(bits(grouped_gemm_act(x, w, offs, act)), bits(a))
    assert_act_bound(a, x, w, ends, act)


@gpu
@ACTS
def test_act_uniform_and_zipf(act: str) -> None:
    check_act(1024, 512, 256, uniform_counts(1024, 8), act, seed=30)
    check_act(1500, 512, 256, zipf_counts(1500, 16), act, seed=31)


@gpu
@ACTS
def test_act_empty_and_one_row_groups_and_ragged_m(act: str) -> None:
    counts = [0, 1, 0, 0, 129, 1, 2, 127, 0, 1, 300, 0]
    check_act(sum(counts) + 5, 256, 128, counts, act, seed=32)


@gpu
@ACTS
@pytest.mark.parametrize("bn", [128, 256])
def test_act_both_tile_widths_and_ragged_n(act: str, bn: int) -> None:
    counts = [130, 0, 257, 3, 64]
    check_act(sum(counts) + 2, 200, 72, counts, act, seed=33, bn=bn)
    check_act(sum(counts), 520, 256, counts, act, seed=34, bn=bn)


@gpu
@ACTS
@pytest.mark.parametrize("counts", [[0, 0, 0], [333], [0, 0, 333]])
def test_act_degenerate_routings(act: str, counts: list[int]) -> None:
    check_act(333, 256, 128, counts, act, seed=35)


@gpu
@ACTS
def test_act_wide_tile_default_large_n(act: str) -> None:
    check_act(2048, 4096, 256, zipf_counts(2048, 32), act, seed=36)


def unfused(x: Tensor, w: Tensor, offs: Tensor, act: str) -> Tensor:
    out: Tensor = FAST_ACT[act](grouped_gemm(x, w, offs))
    return out


@gpu
@ACTS
def test_act_autograd_matches_the_unfused_composition_bitwise(act: str) -> None:
    """Same backward kernels on the same h and da: dx and dw agree with the unfused fast path bit for bit."""
    counts = [100, 0, 1, 155, 300]
    offs = offs_of(cumsum(counts))
    x, w = make(sum(counts) + 3, 264, 136, len(counts), seed=37)
    grads = []
    for fn in (grouped_gemm_act, unfused):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        a = fn(xr, wr, offs, act)
        da = torch.randn(a.shape, generator=torch.Generator().manual_seed(38)).to(torch.bfloat16).cuda()
        torch.autograd.backward(a, da)
        assert xr.grad is not None and wr.grad is not None
        grads.append((a.detach(), xr.grad, wr.grad))
    for got, want in zip(*grads, strict=True):
        assert torch.equal(bits(got), bits(want))


@gpu
@ACTS
def test_act_cuda_graph_replay_follows_new_offs(act: str) -> None:
    x, w = make(1024, 256, 256, 8, seed=39)
    offs = offs_of(cumsum(uniform_counts(1024, 8)))
    grouped_gemm_act(x, w, offs, act)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = grouped_gemm_act(x, w, offs, act)
    offs.copy_(offs_of(cumsum([0, 500, 3, 0, 0, 200, 1, 250])))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(a), bits(unfused(x, w, offs, act)))


@gpu
def test_act_under_torch_compile() -> None:
    x, w = make(512, 256, 128, 4, seed=40)
    offs = offs_of(cumsum([100, 200, 0, 150]))
    a = torch.compile(lambda p, q, o: grouped_gemm_act(p, q, o, "swiglu"), fullgraph=True)(x, w, offs)
    assert torch.equal(bits(a), bits(unfused(x, w, offs, "swiglu")))


@gpu
def test_sep_gemm_fast_act_staged_wrong_buffer() -> None:
    """Full tiles stage each 16-column act(h) subtile for its TMA store; staged in the other buffer, a subtile
    would leave with its neighbour's values, which differ from its own on this data."""
    counts = [256, 128]
    x, w = make(384, 512, 128, 2, seed=43)
    offs = offs_of(cumsum(counts))
    want = swiglu(grouped_gemm(x, w, offs))
    assert float((bits(want[:, 16:]) != bits(want[:, :-16])).double().mean()) > 0.5
    a, _ = fused(x, w, offs, "swiglu", None)
    assert torch.equal(bits(a), bits(want))


@gpu
def test_sep_gemm_fast_epilogue_act_swapped() -> None:
    """silu(gate) * up against silu(up) * gate on the same bf16 h: they differ, so bitwise equality with the
    unfused swiglu (and the interval bound) pins which column of each pair is the gate."""
    counts = [70, 0, 130]
    x, w = make(200, 256, 128, 3, seed=41)
    offs = offs_of(cumsum(counts))
    h = grouped_gemm(x, w, offs)
    g, u = h[:, 0::2].double().cpu(), h[:, 1::2].double().cpu()
    right = (g * torch.sigmoid(g) * u).to(torch.bfloat16)
    swapped = (u * torch.sigmoid(u) * g).to(torch.bfloat16)
    assert float((bits(right) != bits(swapped)).double().mean()) > 0.5
    a, h_fused = fused(x, w, offs, "swiglu", None)
    assert torch.equal(bits(h_fused), bits(h))
    assert torch.equal(bits(a), bits(swiglu(h)))
    assert_act_bound(a, x, w, cumsum(counts), "swiglu")
