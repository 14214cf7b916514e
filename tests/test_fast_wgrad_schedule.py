"""The wgrad's work schedule (nmoe/fast/kernels/sm90/grouped_gemm_wgrad.py): groups ranked by rows, heaviest
first (ties by index); a group with more rows than a CTA's average share is cut into chunks whose fp32
partials are summed in chunk order; the tiles are dealt to the CTAs in snake rounds. Outputs are NaN-filled
first, so a tile no CTA writes stays NaN and fails the float64 bound. The split's sizes need no GPU."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_fast_gemm import check_wgrad, cumsum, offs_of, zipf_counts

from nmoe.fast import runtime
from nmoe.fast.gemm import grouped_gemm_wgrad
from nmoe.fast.gemm import sm90 as gemm
from nmoe.fast.gemm.sm90 import wgrad_cols, wgrad_split
from nmoe.fast.limits import GEMM_BK, GEMM_BM

gpu = pytest.mark.gpu

# 40 Zipf groups with repeated sizes and empty groups; n=256, k=512 at bn=128 make 8 tiles per group.
SKEWED = [*zipf_counts(9000, 30), 0, 0, 64, 64, 64, 1, 1, 300, 300, 0]
N, K, BN = 256, 512, 128


def _chunks(counts: list[int], thresh: int, rows: int) -> int:
    """Workspace slices the kernel's rule takes: every chunk of every group that splits into more than one."""
    parts = [-(-c // rows) if c > thresh else 1 for c in counts]
    return sum(p for p in parts if p > 1)


def test_split_workspace_holds_every_routing() -> None:
    """Adversarial routings (all rows in one group, just past the threshold, ragged) never need more
    workspace than the plan allocates from shapes alone; a plan where no group can exceed a CTA's share
    splits nothing."""
    rng = random.Random(0)
    for m, n, k, bn, e, sms in [(9005, 256, 512, 128, 40, 132), (20007, 128, 256, 256, 2, 132),
                                (196608, 1536, 256, 256, 128, 132), (3000, 128, 128, 128, 2, 148)]:
        plan = wgrad_split(m, n, k, bn, e, sms)
        tpg = -(-n // GEMM_BM) * -(-k // bn)
        assert plan.rows % GEMM_BK == 0 and plan.rows >= 4 * GEMM_BK and plan.counters == e * tpg
        worst = [m] + [0] * (e - 1)
        just = [plan.thresh + 1] * min(e, m // (plan.thresh + 1))
        cases = [worst, just] + [[rng.randint(0, m // e * 3) for _ in range(e)] for _ in range(200)]
        for counts in cases:
            if sum(counts) <= m:
                assert _chunks(counts, plan.thresh, plan.rows) * tpg <= plan.ws_tiles, (m, counts[:4])
    assert wgrad_split(32768 * 8, 2048, 4096, 256, 128, 132).ws_tiles == 0, "wide tiles: nothing splits"


def test_column_chunk_width() -> None:
    """The chunk width keeps x's copy within dy's row bytes, in whole 128-wide tiles (or all of x)."""
    for k, n in [(4096, 2048), (1536, 512), (4096, 1024), (2048, 1024), (7168, 4096), (384, 64), (128, 4096)]:
        cols = wgrad_cols(k, n)
        assert cols == k or (cols % 128 == 0 and (cols <= n or cols == 128)), (k, n, cols)


def _lanes_cover(own: object, per_row: int) -> bool:
    """Every chunk's shuffled source lane looks up that chunk's own row, and each stage row is looked up by
    exactly one of the 16 lanes 0..15 of exactly one warp."""
    from nmoe.fast.kernels.sm90.gatherplan import gather_lanes, source_lane

    q, rows, chunks = gather_lanes(per_row)
    looked = sorted(own(lane, w, q) for w in range(4) for lane in range(rows))  # type: ignore[operator]
    return looked == list(range(GEMM_BK)) and all(
        own(source_lane(i, lane, per_row, q), w, q) == (32 * w + lane) // per_row + 4 * q * i  # type: ignore[operator]
        for w in range(4) for lane in range(32) for i in range(chunks))


def test_sep_gemm_fast_wgrad_gather_lanes_unspread() -> None:
    """The gathered wgrad looks up each stage row's source once, in one lane, and shuffles it to the lanes
    that copy that row's chunks (box rows of 16 and 32 chunks). Rows q apart instead of 4q cover the stage
    twice over in part and miss the rest."""
    from nmoe.fast.kernels.sm90.gatherplan import gather_lanes, own_row

    def unspread(lane: int, warp: int, q: int) -> int:
        j = lane % (GEMM_BK // 4)
        return warp * q + j % q + q * (j // q)

    for per_row in (16, 32):
        assert not _lanes_cover(unspread, per_row), "the separating mapping fails the cover"
        assert _lanes_cover(own_row, per_row), per_row
    with pytest.raises(ValueError, match="do not tile a warp"):
        gather_lanes(12)


@gpu
def test_sep_gemm_fast_wgrad_order_ties_collide() -> None:
    """Groups of equal rows are ordered by index. Ranked by rows alone, two equal groups take one rank and
    another rank is never written."""
    assert len(set(SKEWED)) < len(SKEWED), "some groups have equal row counts"
    check_wgrad(sum(SKEWED) + 5, N, K, SKEWED, seed=23, bn=BN)


@gpu
def test_sep_gemm_fast_wgrad_last_round_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static deal (GEMM_WGRAD_DYNAMIC off): more than two rounds (so the snake turns), the last one
    partial: every tile of it is kept."""
    monkeypatch.setattr(gemm, "GEMM_WGRAD_DYNAMIC", False)
    plan = wgrad_split(sum(SKEWED) + 5, N, K, BN, len(SKEWED), runtime.sm_count(torch.cuda.current_device()))
    assert plan.ws_tiles > 0, "the heaviest groups split, so units outnumber groups"
    units = len(SKEWED) + sum(-(-c // plan.rows) - 1 for c in SKEWED if c > plan.thresh)
    total = units * (N // GEMM_BM) * (K // BN)
    n_ctas = min(runtime.sm_count(torch.cuda.current_device()), total)
    assert total % n_ctas != 0 and total > 2 * n_ctas, "more than two rounds, the last one partial"
    check_wgrad(sum(SKEWED) + 5, N, K, SKEWED, seed=24, bn=BN)


@gpu
def test_sep_gemm_fast_wgrad_split_partial_dropped() -> None:
    """A split group's result is the sum of all its chunks: without the first chunk's partial, the bound
    fails on its rows' share."""
    counts = [4000, 5, 300]
    plan = wgrad_split(sum(counts), 128, 256, 256, 3, runtime.sm_count(torch.cuda.current_device()))
    assert counts[0] > plan.thresh and -(-counts[0] // plan.rows) >= 3, "group 0 splits into 3+ chunks"
    check_wgrad(sum(counts), 128, 256, counts, seed=25, bn=256)


@gpu
def test_sep_gemm_fast_wgrad_split_order_reversed() -> None:
    """The chunks' fp32 partials are added in chunk order, whichever CTA finishes last. dw[0][0, 0] gets
    2^24 from chunk 0, 1 from chunk 1 and -2^24 from chunk 2: in chunk order (2^24 + 1) rounds to 2^24
    and the sum is 0; in reverse order it is 1 (the float64 value, also inside the bound)."""
    a, b, c = torch.tensor(2.0**24), torch.tensor(1.0), torch.tensor(-(2.0**24))
    assert float((a + b) + c) == 0.0 and float((c + b) + a) == 1.0, "the two orders differ in fp32"
    counts, n, k = [1200, 40], 128, 128
    m = sum(counts)
    plan = wgrad_split(m, n, k, 128, 2, runtime.sm_count(torch.cuda.current_device()))
    assert counts[0] > plan.thresh and counts[0] > 2 * plan.rows, "group 0 splits into 3+ chunks"
    g = torch.Generator().manual_seed(26)
    dy = torch.randn(m, n, generator=g)
    x = torch.randn(m, k, generator=g)
    dy[:, 0] = 0.0
    x[:, 0] = 0.0
    for row, (u, w) in zip((3, plan.rows + 5, 2 * plan.rows + 7), ((4096.0, 4096.0), (1.0, 1.0),
                                                                   (-4096.0, 4096.0)), strict=True):
        dy[row, 0], x[row, 0] = u, w
    dw = torch.full((2, n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm._launch_wgrad(dy.to(torch.bfloat16).cuda(), x.to(torch.bfloat16).cuda(), offs_of(cumsum(counts)), dw,
                       128)
    assert float(dw[0, 0, 0]) == 0.0, f"chunk partials summed out of order: {float(dw[0, 0, 0])}"



def _in_chunks(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """dw from grouped_gemm_wgrad_cols over x's column ranges [bounds[i], bounds[i+1]), NaN-filled first."""
    shape = (offs.numel(), dy.shape[1], x.shape[1])
    dw = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    for c0, c1 in itertools.pairwise(bounds):
        gemm.grouped_gemm_wgrad_cols(dy, x[:, c0:c1].contiguous(), offs, dw, c0)
    return dw


def _check_cols(seed: int, bounds: list[int]) -> None:
    """Column chunks (ragged: each width its own compile) of a wide dw under skewed groups that split: each
    chunk's columns are bit for bit the narrow wgrad of its columns of x, none left NaN."""
    m = sum(SKEWED) + 5
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, N, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, bounds[-1], generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(SKEWED))
    want = torch.cat([grouped_gemm_wgrad(dy, x[:, c0:c1].contiguous(), offs)
                      for c0, c1 in itertools.pairwise(bounds)], dim=2)
    got = _in_chunks(dy, x, offs, bounds)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_gemm_fast_wgrad_cols_ld_ignored() -> None:
    """Chunks of 256, 384 and 128 columns of a 768-wide dw: stored with its own width as the row pitch, a
    chunk's rows land inside other rows."""
    _check_cols(27, [0, 256, 640, 768])


@gpu
def test_sep_gemm_fast_wgrad_cols_offset_dropped() -> None:
    """Chunks at columns 0, 128 and 384: each launched at dw's first column, the later ones overwrite the
    first and leave their own columns NaN."""
    _check_cols(28, [0, 128, 384, 512])


@gpu
def test_sep_gemm_fast_wgrad_rows_group_stride_ignored() -> None:
    """Chunks of dy's columns (dw's rows 0, 128 and 384 of 512) under skewed groups that split: group e's
    block starts at row e * 512 + row0; stored e * (chunk rows) apart, groups past the first land inside
    earlier groups' rows and leave their own NaN. Each block is bit for bit the narrow wgrad."""
    m, bounds = sum(SKEWED) + 5, [0, 128, 384, 512]
    g = torch.Generator().manual_seed(29)
    dy = torch.randn(m, bounds[-1], generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, N, generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(SKEWED))
    assert len(SKEWED) > 1 and bounds[1] < bounds[-1], "several groups, chunks narrower than dw's rows"
    want = torch.cat([grouped_gemm_wgrad(dy[:, r0:r1].contiguous(), x, offs)
                      for r0, r1 in itertools.pairwise(bounds)], dim=1)
    got = torch.full((offs.numel(), bounds[-1], N), float("nan"), dtype=torch.bfloat16, device="cuda")
    for r0, r1 in itertools.pairwise(bounds):
        gemm.grouped_gemm_wgrad_cols(dy[:, r0:r1].contiguous(), x, offs, got, 0, r0)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
