"""Dead rows: a consumer warpgroup whose rows of a tile all lie past its group's end (a ragged group's last
tile, a cluster's tile past the end) waits for and frees each stage but issues no wgmma, and a ping-pong tile
whose live rows fit its first 64 issues only their wgmmas. Rows never mix in a wgmma, so every live row keeps
its bits; the contract is the float64 bound on every row, the lone live rows at each edge included (a group
of 128 j + 1 rows: row 0 of its last tile; 128 j + 65: row 64, the cooperative second warpgroup's only row
and the first past a ping-pong half)."""

from __future__ import annotations

import pytest
import torch
from test_fast_gemm import assert_bound, cumsum, make, offs_of, oracle, violates

from nmoe.fast.gemm import sm90 as gemm
from nmoe.fast.limits import GEMM_BM

gpu = pytest.mark.gpu

COUNTS = [65, 1, 193, 129, 0, 64, 300, 257]
N, K = 256, 1152


def lone_rows(counts: list[int], first_row: int) -> list[int]:
    """Rows that are the only live row of a warpgroup whose rows start first_row into each 128-row tile."""
    rows, start = [], 0
    for c in counts:
        for row0 in range(start, start + c, GEMM_BM):
            if start + c - (row0 + first_row) == 1:
                rows.append(row0 + first_row)
        start += c
    return rows


def test_the_counts_give_each_warpgroup_a_lone_row() -> None:
    assert lone_rows(COUNTS, 0) == [65, 387, 1008]
    assert lone_rows(COUNTS, GEMM_BM // 2) == [64, 258]


def _case(pingpong: bool, lone: list[int]) -> None:
    m = sum(COUNTS) + 7
    x, w = make(m, N, K, len(COUNTS), seed=23)
    ends = cumsum(COUNTS)
    ref, mag = oracle(x, lambda e: w[e].t(), ends, N)
    mutated = ref.clone()
    mutated[lone] = 0.0
    assert violates(mutated, ref, mag, K), "a lone row left at zero breaks the bound"
    y = torch.full((m, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm._launch("test", x, w, offs_of(ends), y, True, 128, pingpong=pingpong)
    torch.cuda.synchronize()
    assert_bound(y, ref, mag, K)


@gpu
@pytest.mark.parametrize("pingpong", [False, True], ids=["cooperative", "pingpong"])
def test_sep_gemm_fast_dead_rows_off_by_one(pingpong: bool) -> None:
    """Off by one, a warpgroup whose rows hold one live row counts them dead."""
    _case(pingpong, lone_rows(COUNTS, 0) + ([] if pingpong else lone_rows(COUNTS, GEMM_BM // 2)))


@gpu
def test_sep_gemm_fast_pingpong_half_off_by_one() -> None:
    """Off by one, a ping-pong tile of 65 live rows takes the first half's wgmmas alone."""
    _case(True, lone_rows(COUNTS, GEMM_BM // 2))
