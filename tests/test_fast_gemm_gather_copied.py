"""The gathering fwd/dgrad with A's rows copied by 16-byte cp.async (GEMM_GATHER_CP_ASYNC) instead of one TMA
per row: thread p copies chunk p % 8 of tile rows p // 8 + 16 i, their tokens looked up once per tile and
shuffled within the row's eight threads. Its contract is the row-TMA kernel's: every output bit equal."""

from __future__ import annotations

import pytest
import torch
from test_fast_gemm_gather_cluster import Case, _case
from test_fast_gemm_gather_dynamic import CASES, assert_runs_equal, poisoned_runs
from torch import Tensor

from nmoe.fast.gemm import sm90
from nmoe.fast.kernels.sm90 import gatherplan

gpu = pytest.mark.gpu

def _runs(case: Case, monkeypatch: pytest.MonkeyPatch, copied: bool, x: Tensor | None = None) -> list[Tensor]:
    """h, act(h) and the gathered dgrad with A's rows by cp.async or by row TMA, NaN-poisoned."""
    monkeypatch.setattr(sm90, "GEMM_GATHER_CP_ASYNC", copied)
    return poisoned_runs(case, x)


def test_copied_rows_run_unclustered(monkeypatch: pytest.MonkeyPatch) -> None:
    """cp.async cannot multicast, so the copying kernel never runs in N clusters, and refuses one."""
    monkeypatch.setattr(sm90, "GEMM_GATHER_CP_ASYNC", True)
    assert sm90.gather_cluster_n(2048, 256, False) == 1
    from nmoe.fast.kernels.sm90 import grouped_gemm_gather as km
    with pytest.raises(ValueError, match="cannot be multicast"):
        km.compile_args_gather(2048, 4096, 256, "swiglu", cn=2, cp_async=True)


def test_copied_rows_cover_every_tile_row_once() -> None:
    """The copying producer's map (gatherplan, traced by the kernel): its threads' rows at their chunk columns
    tile a stage's 128 x 8 chunks once each, and every thread's i-th row is the one the lane it reads the
    token from looked up."""
    per_row, threads = gatherplan.ROW_CHUNKS, gatherplan.PRODUCER_THREADS
    rows = range(gatherplan.ROWS_PER_THREAD)
    seen = [(gatherplan.copied_row(p, i), p % per_row) for p in range(threads) for i in rows]
    assert sorted(seen) == [(r, c) for r in range(128) for c in range(per_row)]
    for p in range(threads):
        lane = p % 32
        for i in rows:
            src = p - lane + gatherplan.copied_lane(lane, i)
            assert gatherplan.copied_lookup(src) == gatherplan.copied_row(p, i), (p, i)


def test_copied_kernels_are_compile_checked() -> None:
    names = {s.name: s for s in sm90.KERNELS if s.name.endswith("_copied") or "_copied_" in s.name}
    assert set(names) == {"grouped_gemm_act_gathered_swiglu_n256_copied",
                          "grouped_gemm_act_gathered_relu2_n128_copied_k288",
                          "grouped_gemm_dgrad_gathered_n256_copied"}
    for spec in names.values():
        assert any("cp\\.async\\.cg" in rx for rx in spec.expect["sm_90a"])
        assert any("tensor\\.2d\\.shared::cta\\.global" in rx for rx in spec.forbid["sm_90a"])


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}-{c[6]}" for c in CASES])
def test_copied_rows_equal_the_row_tma_kernel(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dynamic schedule's cases: a K tail of 32 columns, skew, T = 5 of mostly pad rows, several units
    per CTA in the layer's 256-wide N tiles."""
    assert_runs_equal(_runs(case, monkeypatch, True), _runs(case, monkeypatch, False), "with copied rows")


@gpu
def test_sep_gemm_fast_gather_copied_token_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row p // 8 + 16 i copied from the token looked up for row p // 8 + 16 (i + 1): uniform routing puts
    different tokens 16 rows apart, so h changes."""
    case = CASES[4]
    slot = _case(case)[3]
    real = slot[:128]
    assert bool((real[:-16] // case[1] != real[16:] // case[1]).any()), "rows 16 apart name different tokens"
    want = _runs(case, monkeypatch, False)[0]
    got = _runs(case, monkeypatch, True)[0]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_gemm_fast_gather_copied_pad_rows_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pad rows and rows past the group copied from token 0 (the clamped token) instead of zero-filled: with
    token 0 nonzero, their h is x_0 @ w_e^T, not zeros."""
    case = CASES[0]
    x, _, _, slot, _ = _case(case)
    assert int((slot < 0).sum()) > 0 and bool(x[0].abs().sum() > 0), "pad rows exist and token 0 is nonzero"
    want = _runs(case, monkeypatch, False)[0]
    got = _runs(case, monkeypatch, True)[0]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_gemm_fast_gather_copied_k_tail_unmasked(monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 288: the last box's columns 288..319 of token t's row are token t + 1's first 32 in memory. With
    those infinite, copying them (times B's zero-filled columns) makes NaN in token t's rows."""
    case = CASES[0]
    hid = case[2]
    assert hid % 64 == 32, "the case has a K tail"
    x, _, _, slot, _ = _case(case)
    x = x.cpu()
    x[1::2, :32] = float("inf")
    x = x.cuda()
    assert torch.isinf(x.view(-1)[hid:hid + 32]).all(), "token 0's row is followed by infinite columns"
    even = (slot >= 0) & ((slot // case[1]) % 2 == 0)
    want = _runs(case, monkeypatch, False, x)[0]
    assert bool(even.any()) and torch.isfinite(want[even].float()).all(), "row TMAs keep even tokens finite"
    got = _runs(case, monkeypatch, True, x)[0]
    assert torch.equal(got[even].view(torch.int16), want[even].view(torch.int16))
