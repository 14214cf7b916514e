"""The gathering fwd/dgrad in N clusters (GEMM_GATHER_CLUSTER_N): the CTAs of a cluster take one M tile's
adjacent N tiles and each gathers its share of A's rows for all of them by multicast row TMA; with
GEMM_GATHER_CLUSTER_M as well, cm x cn clusters whose CTAs also share each B box along M. Its contract is
the unclustered gathering kernel's: every output bit equal. The schedule's choice needs no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def _runs(case: Case, monkeypatch: pytest.MonkeyPatch, cn: int, cm: int = 1) -> list[Tensor]:
    """h, act(h) and the gathered dgrad dy[slot // K] @ w (N = hid: whole clusters only where hid allows),
    with GEMM_GATHER_CLUSTER_N = cn and GEMM_GATHER_CLUSTER_M = cm."""
    monkeypatch.setattr(sm90, "GEMM_GATHER_CLUSTER_N", cn)
    monkeypatch.setattr(sm90, "GEMM_GATHER_CLUSTER_M", cm)
    x, w, dy, slot, offs = _case(case)
    k, act = case[1], case[6]
    a, h = sm90.grouped_gemm_act_gathered(x, slot, k, w, offs, act)
    dx = sm90.grouped_gemm_dgrad_gathered(dy, slot, k, w, offs)
    torch.cuda.synchronize()
    return [h, a, dx]


def test_schedule_clusters_only_whole_cooperative_n_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
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
    two_way = {"grouped_gemm_act_gathered_swiglu_cm2_cn2", "grouped_gemm_dgrad_gathered_cm2_cn2"}
    assert names == {*plain, *(f"{n}_deferred" for n in plain), "grouped_gemm_act_gathered_swiglu_cn4",
                     *two_way}
    for s in sm90.KERNELS:
        if "_cn" in s.name:
            assert any(r"2d\.shared::cluster" in rx and "multicast" in rx for rx in s.expect["sm_90a"])
        if s.name in two_way:
            assert any(r"3d\.shared::cluster" in rx and "multicast" in rx for rx in s.expect["sm_90a"]), \
                "B's box is multicast along M too"


_PLACES = """
import json
from nmoe.fast import runtime; runtime.import_cutlass("sm_90a")
from cutlass import Int32
from nmoe.fast.kernels.sm90 import grouped_gemm as g, grouped_gemm_gather as k
out = {}
for cm, cn in ((2, 2), (2, 4), (4, 2), (1, 4), (4, 1)):
    rows = []
    for r in range(cm * cn):
        m, n = g.cluster_coords(Int32(r), cm, cn)
        a, b = g.cluster_masks(Int32(r), cm, cn) if cm > 1 and cn > 1 else (0, 0)
        rows.append([int(m), int(n), int(a), int(b)])
    out[f"{cm}x{cn}"] = rows
refused = []
for cm, cn in ((3, 1), (4, 4)):
    try:
        k.compile_args_gather(2048, 4096, 256, "swiglu", True, cn=cn, cm=cm)
    except ValueError as e:
        refused.append(str(e))
out["refused"] = refused
print(json.dumps(out))
"""


def test_cluster_places_follow_the_pipeline_layout_and_masks_reach_the_sharers() -> None:
    """CTA r of a cm x cn cluster sits at the column-major place of CuTe's (1, cm, cn, 1) layout, which the
    operand pipeline frees stages by; A's mask names the CTAs on its M tile, B's those on its N tile."""
    r = subprocess.run([sys.executable, "-c", _PLACES], env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for shape, rows in out.items():
        if shape == "refused":
            continue
        cm, cn = map(int, shape.split("x"))
        places = [(m, n) for m, n, _, _ in rows]
        assert places == [(r % cm, r // cm) for r in range(cm * cn)], shape
        for m, n, a, b in rows:
            if cm > 1 and cn > 1:
                assert a == sum(1 << j for j, p in enumerate(places) if p[0] == m), (shape, m, n)
                assert b == sum(1 << j for j, p in enumerate(places) if p[1] == n), (shape, m, n)
    assert len(out["refused"]) == 2 and all("cluster of" in e for e in out["refused"]), out["refused"]


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


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}-{c[6]}" for c in CASES])
def test_two_way_cluster_equals_the_unclustered_kernel(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clusters of 2 x 2 CTAs: two M tiles by two N tiles, A's rows multicast along N and B along M."""
    want = _runs(case, monkeypatch, 1)
    got = _runs(case, monkeypatch, 2, 2)
    assert sm90.gather_cluster_n(case[3], sm90.pick_bn(case[3]), False) == 2, "the case ran clustered"
    for name, g, w in zip(("h", "act(h)", "dgrad"), got, want, strict=True):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{name} differs in 2 x 2 clusters"


@gpu
def test_sep_gemm_fast_gather_cluster_b_mask_same_m(monkeypatch: pytest.MonkeyPatch) -> None:
    """B's half boxes multicast to the CTAs on the sender's M tile instead of its N tile still complete every
    stage's byte count, but half of each CTA's B then comes from the other N tile: h differs."""
    case = CASES[2]
    _, w, _, _, _ = _case(case)
    assert not torch.equal(w[:, :256], w[:, 256:512]), "adjacent N tiles' weights differ"
    want = _runs(case, monkeypatch, 1)[0]
    got = _runs(case, monkeypatch, 2, 2)[0]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
