"""The gathering fwd/dgrad in N clusters (GEMM_GATHER_CLUSTER_N): the CTAs of a cluster take one M tile's
adjacent N tiles and each gathers its share of A's rows for all of them by multicast row TMA. Its contract is
the unclustered gathering kernel's: every output bit equal. The schedule's choice needs no GPU."""

from __future__ import annotations

import pytest
import torch
from test_fast_gemm_gather import CASES as GATHER_CASES
from test_fast_gemm_gather import _ids
from torch import Tensor

from nmoe.fast.dispatch import permute
from nmoe.fast.gemm import sm90

gpu = pytest.mark.gpu

# The gathering test's cases (K tails, skew, a mostly zero-filled tail at T = 5) with N widened so the
# 256-wide N tiles fill clusters of two, and of four where N allows.
CASES = [(*c[:3], n, *c[4:]) for c, n in zip(GATHER_CASES, (512, 1024, 2048, 512), strict=True)]


Case = tuple[int, int, int, int, int, int, str, str]


def _case(case: Case) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    t, k, hid, n, e, align, _, routing = case
    g = torch.Generator().manual_seed(t * 11 + e)
    x = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(e, n, hid, generator=g) / hid**0.5).to(torch.bfloat16).cuda()
    dy = torch.randn(t, n, generator=g).to(torch.bfloat16).cuda()
    p = permute(x.new_empty(t, 0), _ids(t, k, e, routing, g).cuda(), e, align)
    return x, w, dy, p.slot, p.offs


def _runs(case: Case, monkeypatch: pytest.MonkeyPatch, cn: int) -> list[Tensor]:
    """h, act(h) and the gathered dgrad dy[slot // K] @ w (N = hid: whole clusters only where hid allows),
    with GEMM_GATHER_CLUSTER_N = cn (rows by TMA: cp.async cannot multicast)."""
    monkeypatch.setattr(sm90, "GEMM_GATHER_CP_ASYNC", False)
    monkeypatch.setattr(sm90, "GEMM_GATHER_CLUSTER_N", cn)
    x, w, dy, slot, offs = _case(case)
    k, act = case[1], case[6]
    a, h = sm90.grouped_gemm_act_gathered(x, slot, k, w, offs, act)
    dx = sm90.grouped_gemm_dgrad_gathered(dy, slot, k, w, offs)
    torch.cuda.synchronize()
    return [h, a, dx]


def test_schedule_clusters_only_whole_cooperative_n_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sm90, "GEMM_GATHER_CP_ASYNC", False)
    monkeypatch.setattr(sm90, "GEMM_GATHER_CLUSTER_N", 2)
    assert sm90.gather_cluster_n(2048, 256, False) == 2
    assert sm90.gather_cluster_n(256, 256, False) == 1, "one N tile: no pair to share A with"
    assert sm90.gather_cluster_n(1152, 128, False) == 1, "nine N tiles do not pair up"
    assert sm90.gather_cluster_n(2048, 128, True) == 1, "ping-pong tiles stay alone"
    monkeypatch.setattr(sm90, "GEMM_GATHER_CLUSTER_N", 4)
    assert sm90.gather_cluster_n(2048, 256, False) == 4
    assert sm90.gather_cluster_n(512, 256, False) == 2, "two N tiles: the widest cluster they fill"
    monkeypatch.setattr(sm90, "GEMM_GATHER_CLUSTER_N", 1)
    assert sm90.gather_cluster_n(2048, 256, False) == 1


def test_n_cluster_kernels_are_compile_checked() -> None:
    names = {s.name for s in sm90.KERNELS if "_cn" in s.name}
    plain = {"grouped_gemm_act_gathered_swiglu_cn2", "grouped_gemm_dgrad_gathered_cn2",
             "grouped_gemm_act_gathered_swiglu_cn2_act_only"}
    others = {"grouped_gemm_act_gathered_swiglu_cn4", "grouped_gemm_act_gathered_swiglu_cn2_dynamic",
              "grouped_gemm_dgrad_gathered_cn2_dynamic"}
    assert names == {*plain, *(f"{n}_deferred" for n in plain), *others}
    for s in sm90.KERNELS:
        if "_cn" in s.name:
            assert any("multicast::cluster" in rx for rx in s.expect["sm_90a"])


def test_n_cluster_launches_whole_clusters_of_ctas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sm90.runtime, "sm_count", lambda device: 132)
    assert sm90.fwd_ctas(0, 1 << 18, 2048, 128, 256, 1, 2) == 132
    assert sm90.fwd_ctas(0, 128, 512, 1, 256, 1, 2) == 6, "at most 3 units (M tiles + partial ones) of 2 CTAs"


@gpu
@pytest.mark.parametrize("cn", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}-{c[6]}" for c in CASES])
def test_n_cluster_equals_the_unclustered_kernel(case: Case, cn: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    want = _runs(case, monkeypatch, 1)
    got = _runs(case, monkeypatch, cn)
    assert sm90.gather_cluster_n(case[3], sm90.pick_bn(case[3]), False) > 1, "the case ran clustered"
    for name, g, w in zip(("h", "act(h)", "dgrad"), got, want, strict=True):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{name} differs in N clusters of {cn}"


@gpu
def test_sep_gemm_fast_gather_cluster_rows_same_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both CTAs gathering the first half of A's rows delivers the same bytes (no hang) but never the second
    half: rows 64-127 of every tile then hold another stage's rows, so h differs from the unclustered run."""
    case = CASES[0]
    want = _runs(case, monkeypatch, 1)[0]
    got = _runs(case, monkeypatch, 2)[0]
    rows = want[64:128].float()
    assert bool(rows.abs().sum() > 0), "the second half of the first tile is not all zero: a lost half shows"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_gemm_fast_gather_cluster_same_n_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster whose CTAs both took the unit's first N tile would leave every other tile unwritten (torch's
    empty output): the clustered h matches the unclustered one on every tile, the odd ones included."""
    case = CASES[2]
    want = _runs(case, monkeypatch, 1)[0]
    got = _runs(case, monkeypatch, 2)[0]
    odd = want.view(want.shape[0], -1, 256)[:, 1::2]
    assert bool(odd.abs().sum() > 0), "the odd N tiles hold nonzero values"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
