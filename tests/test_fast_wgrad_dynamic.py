"""The wgrad's dynamic schedule (GEMM_WGRAD_DYNAMIC): each CTA's producer warp takes the next tile of the
heaviest-first list from a device counter and hands it to its consumers through a shared ring. Which CTA
computes a tile never changes its bits, so the contract is the static snake schedule's, bit for bit, every
tile written (NaN-filled outputs, float64 bound). The counter's buffer needs no GPU."""

from __future__ import annotations

import pytest
import torch
from test_fast_gemm import check_wgrad, cumsum, offs_of, zipf_counts

from nmoe.fast.gemm import sm90 as gemm
from nmoe.fast.gemm.sm90 import wgrad_split
from nmoe.fast.limits import GEMM_BM

gpu = pytest.mark.gpu

SKEWED = [*zipf_counts(9000, 30), 0, 0, 64, 64, 64, 1, 1, 300, 300, 0]
N, K, BN = 256, 512, 128


def test_dynamic_plan_allocates_its_counter_even_without_a_split() -> None:
    """The tile counter sits after the split's per-tile counters (index groups x tiles per group) and is
    zeroed per launch; a plan that splits nothing still gets it, a static one without a split gets none."""
    tpg = -(-N // GEMM_BM) * -(-K // BN)
    static = wgrad_split(32768 * 8, 2048, 4096, 256, 128, 132)
    dynamic = wgrad_split(32768 * 8, 2048, 4096, 256, 128, 132, dynamic=True)
    keep, (ws, counters, *_) = static.args(torch.device("cpu"))
    assert static.ws_tiles == 0 and keep == () and ws == counters == 0
    keep, (ws, counters, *_) = dynamic.args(torch.device("cpu"))
    assert ws == 0 and counters != 0 and keep[0].numel() == dynamic.counters + 1 and not bool(keep[0].any())
    split = wgrad_split(sum(SKEWED) + 5, N, K, BN, len(SKEWED), 132, dynamic=True)
    assert split.counters == len(SKEWED) * tpg and split.ws_tiles > 0


def run_wgrad(counts: list[int], seed: int, monkeypatch: pytest.MonkeyPatch, n: int = N,
              **flags: object) -> torch.Tensor:
    """The wgrad of seeded dy [m, n] and x [m, K] into a NaN-filled dw, with gemm's `flags` set first."""
    for name, value in flags.items():
        monkeypatch.setattr(gemm, name, value)
    m = sum(counts) + 5
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, K, generator=g).to(torch.bfloat16).cuda()
    dw = torch.full((len(counts), n, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm._launch_wgrad(dy, x, offs_of(cumsum(counts)), dw, BN)
    torch.cuda.synchronize()
    return dw


def run_chunks(seed: int, monkeypatch: pytest.MonkeyPatch, n: int = N, accumulate: bool = False,
               **flags: object) -> torch.Tensor:
    """The layer's column-chunk wgrad: x's two K-wide column chunks into one dw (rows ld apart), stored into
    NaNs or added to seeded values, with gemm's `flags` set first."""
    for name, value in flags.items():
        monkeypatch.setattr(gemm, name, value)
    m = sum(SKEWED) + 5
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, 2 * K, generator=g).to(torch.bfloat16).cuda()
    dw = torch.randn(len(SKEWED), n, 2 * K, generator=g).to(torch.bfloat16).cuda()
    if not accumulate:
        dw.fill_(float("nan"))
    offs = offs_of(cumsum(SKEWED))
    gemm.grouped_gemm_wgrad_cols(dy, x[:, K:].contiguous(), offs, dw, K, accumulate=accumulate)
    gemm.grouped_gemm_wgrad_cols(dy, x[:, :K].contiguous(), offs, dw, 0, accumulate=accumulate)
    torch.cuda.synchronize()
    return dw


@gpu
@pytest.mark.parametrize("counts", [SKEWED, [1024] * 16, [0, 0, 7000, 3]], ids=["zipf", "uniform", "one"])
def test_dynamic_schedule_equals_the_static_one(counts: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    static = run_wgrad(counts, 31, monkeypatch, GEMM_WGRAD_DYNAMIC=False)
    dynamic = run_wgrad(counts, 31, monkeypatch, GEMM_WGRAD_DYNAMIC=True)
    assert not bool(dynamic.isnan().any()), "a tile no CTA took stays NaN"
    assert torch.equal(dynamic.view(torch.int16), static.view(torch.int16))


@gpu
def test_dynamic_schedule_column_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's column-chunk wgrad (rows ld apart, groups gs apart) under the dynamic schedule."""
    static = run_chunks(32, monkeypatch, GEMM_WGRAD_DYNAMIC=False)
    dynamic = run_chunks(32, monkeypatch, GEMM_WGRAD_DYNAMIC=True)
    assert torch.equal(dynamic.view(torch.int16), static.view(torch.int16))


@gpu
def test_sep_gemm_fast_wgrad_grab_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each take advances the counter by one tile: a step of two leaves every other tile of the list unwritten
    (NaN), which the float64 bound refuses."""
    monkeypatch.setattr(gemm, "GEMM_WGRAD_DYNAMIC", True)
    check_wgrad(sum(SKEWED) + 5, N, K, SKEWED, seed=33, bn=BN)
