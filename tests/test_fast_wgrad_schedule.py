"""The wgrad's tile schedule (nmoe/fast/kernels/sm90/grouped_gemm_wgrad.py): groups ordered by rows, heaviest
first, ties by index, tiles dealt to the CTAs in snake rounds. Every tile must still be computed exactly once:
the output is NaN-filled first, so a tile no CTA takes stays NaN and fails the float64 bound."""

from __future__ import annotations

import pytest
import torch
from test_fast_gemm import check_wgrad, zipf_counts

from nmoe.fast import runtime
from nmoe.fast.limits import GEMM_BM

gpu = pytest.mark.gpu

# 40 Zipf groups with repeated sizes and empty groups; n=256, k=512 at bn=128 make 8 tiles per group.
SKEWED = [*zipf_counts(9000, 30), 0, 0, 64, 64, 64, 1, 1, 300, 300, 0]
N, K, BN = 256, 512, 128


@gpu
def test_sep_gemm_fast_wgrad_order_ties_collide() -> None:
    """Groups of equal rows are ordered by index. Ranked by rows alone, two equal groups take one rank and
    another rank is never written."""
    assert len(set(SKEWED)) < len(SKEWED), "some groups have equal row counts"
    check_wgrad(sum(SKEWED) + 5, N, K, SKEWED, seed=23, bn=BN)


@gpu
def test_sep_gemm_fast_wgrad_last_round_dropped() -> None:
    """More than two rounds (so the snake turns), the last one partial: every tile of it is kept."""
    total = len(SKEWED) * (N // GEMM_BM) * (K // BN)
    n_ctas = min(runtime.sm_count(torch.cuda.current_device()), total)
    assert total % n_ctas != 0 and total > 2 * n_ctas, "more than two rounds, the last one partial"
    check_wgrad(sum(SKEWED) + 5, N, K, SKEWED, seed=24, bn=BN)
