"""Dead rows: a consumer warpgroup whose rows of a tile all lie past its group's end (a ragged group's last
tile, a cluster's tile past the end) waits for and frees each stage but issues no wgmma, and a ping-pong tile
whose live rows fit its first 64 issues only their wgmmas. Rows never mix in a wgmma, so every live row keeps
its bits; the contract is the float64 bound on every row, the lone live rows at each edge included (a group
of 128 j + 1 rows: row 0 of its last tile; 128 j + 65: row 64, the cooperative second warpgroup's only row
and the first past a ping-pong half). N is wide enough that every CTA runs several tiles, so a dead
warpgroup also follows a held (deferred) tile over more K boxes than the ring has stages: its held subtiles
must leave box by box, in step with its partner's epilogue barrier, or the two wait on each other."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_fast_gemm import ROOT, assert_bound, child_env, count_tiles, cumsum, make, offs_of, oracle, violates

from nmoe.fast.gemm import sm90 as gemm
from nmoe.fast.kernels.sm90.tiles import stages_for
from nmoe.fast.limits import GEMM_BK, GEMM_BM, GEMM_CLUSTER_M, pingpong_bn

gpu = pytest.mark.gpu

COUNTS = [65, 1, 193, 129, 0, 64, 300, 257]
N, K = 2048, 1152


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


def test_every_cta_runs_several_tiles_over_more_k_boxes_than_stages() -> None:
    h200_clusters = 132 // GEMM_CLUSTER_M
    units = count_tiles(cumsum(COUNTS), sum(COUNTS) + 7, N, 128, GEMM_CLUSTER_M)
    assert units >= 2 * h200_clusters
    assert stages_for(128) < K // GEMM_BK


def _case(pingpong: bool, lone: list[int]) -> None:
    m = sum(COUNTS) + 7
    x, w = make(m, N, K, len(COUNTS), seed=23)
    ends = cumsum(COUNTS)
    ref, mag = oracle(x, lambda e: w[e].t(), ends, N)
    mutated = ref.clone()
    mutated[lone] = 0.0
    assert violates(mutated, ref, mag, K), "a lone row left at zero breaks the bound"
    y = torch.full((m, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    bn = pingpong_bn("none") if pingpong else 128
    gemm._launch("test", x, w, offs_of(ends), y, True, bn, pingpong=pingpong)
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


_HELD_THEN_DEAD = f"""
import torch
from nmoe.fast.gemm import sm90
counts = {COUNTS}
m, n, k = sum(counts) + 7, {N}, {K}
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
w = torch.randn(len(counts), n, k, device="cuda").to(torch.bfloat16)
offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
sm90._launch("test", x, w, offs, y, True, 128, pingpong=False)
torch.cuda.synchronize()
print("RETURNED")
"""
HANG_S = 120


@gpu
def test_sep_gemm_fast_dead_rows_emit_at_once() -> None:
    """A cooperative launch whose dead warpgroups follow held tiles returns (in a child process, so a hang
    fails the test instead of holding the GPU): the held subtiles leave box by box on both warpgroups."""
    assert gemm.GEMM_FWD_DEFERRED, "the held tiles are the deferred epilogue's"
    try:
        out = subprocess.run([sys.executable, "-c", _HELD_THEN_DEAD], capture_output=True, text=True,
                             timeout=HANG_S, cwd=ROOT, env=child_env())
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launch had not returned after {HANG_S} s: the warpgroups wait on each other")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "RETURNED"
