"""The deferred epilogue (GEMM_WGRAD_DEFERRED, GEMM_FWD_DEFERRED): a finished tile's bf16 subtiles wait in
registers and leave one per K box of the CTA's next tile, under its wgmmas. The values and their rounding are
the plain epilogue's, so the contract is that epilogue's output bit for bit, every tile written (NaN-filled
outputs): split and unsplit groups, tiles cut by n and k, tiles with fewer K boxes than subtiles, the
accumulating wgrad, the cooperative fwd and dgrad, and the last tile of each CTA."""

from __future__ import annotations

import pytest
import torch
from test_fast_gemm import cumsum, offs_of, zipf_counts
from test_fast_wgrad_schedule import SKEWED

from nmoe.fast.gemm import sm90 as gemm

gpu = pytest.mark.gpu
CASES = {"zipf": SKEWED, "uniform": [1024] * 16, "one": [0, 0, 7000, 3], "short": [70, 1, 130, 0, 64],
         "many": zipf_counts(40000, 128)}


def _both(run: object, monkeypatch: pytest.MonkeyPatch,
          flag: str = "GEMM_WGRAD_DEFERRED") -> list[torch.Tensor]:
    outs = []
    for deferred in (False, True):
        monkeypatch.setattr(gemm, flag, deferred)
        outs.append(run())  # type: ignore[operator]
    return outs


@gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("n", "k", "bn"), [(1024, 1024, 128), (200, 136, 128), (384, 1024, 256)])
def test_deferred_epilogue_equals_the_plain_one(case: str, n: int, k: int, bn: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    counts = CASES[case]
    m = sum(counts) + 5
    g = torch.Generator().manual_seed(41)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(counts))

    def run() -> torch.Tensor:
        dw = torch.full((len(counts), n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm._launch_wgrad(dy, x, offs, dw, bn)
        torch.cuda.synchronize()
        return dw

    plain, deferred = _both(run, monkeypatch)
    assert not bool(deferred.isnan().any()), "a held subtile never left"
    assert torch.equal(deferred.view(torch.int16), plain.view(torch.int16))


@gpu
def test_deferred_epilogue_accumulates_column_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's accumulating column-chunk wgrad: two chunks added into a random dw, bit for bit."""
    n, k = 256, 512
    m = sum(SKEWED) + 5
    g = torch.Generator().manual_seed(42)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(SKEWED))
    old = torch.randn(len(SKEWED), n, 2 * k, generator=g).to(torch.bfloat16).cuda()

    def run() -> torch.Tensor:
        dw = old.clone()
        gemm.grouped_gemm_wgrad_cols(dy, x[:, k:].contiguous(), offs, dw, k, accumulate=True)
        gemm.grouped_gemm_wgrad_cols(dy, x[:, :k].contiguous(), offs, dw, 0, accumulate=True)
        torch.cuda.synchronize()
        return dw

    plain, deferred = _both(run, monkeypatch)
    assert torch.equal(deferred.view(torch.int16), plain.view(torch.int16))


@gpu
def test_sep_gemm_fast_wgrad_deferred_subtile_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Box kt sending subtile kt + 1 instead of kt: subtile 1 of a held tile never leaves when the CTA's next
    tile has two or more K boxes (256 tiles over at most 132 CTAs, groups of 2-5 boxes), so NaN stays where
    the plain epilogue writes numbers."""
    counts = [300, 200, 0, 129]
    m = sum(counts)
    g = torch.Generator().manual_seed(43)
    dy = torch.randn(m, 1024, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, 1024, generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(counts))

    def run() -> torch.Tensor:
        dw = torch.full((len(counts), 1024, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm._launch_wgrad(dy, x, offs, dw, 128)
        torch.cuda.synchronize()
        return dw

    plain, deferred = _both(run, monkeypatch)
    assert not bool(plain.isnan().any())
    assert not bool(deferred.isnan().any()), "a held subtile never left"
    assert torch.equal(deferred.view(torch.int16), plain.view(torch.int16))


@gpu
@pytest.mark.parametrize("case", ["zipf", "uniform", "one", "short"])
@pytest.mark.parametrize(("op", "n", "k", "bn"), [("grouped_gemm", 1024, 2048, 256),
                                                  ("grouped_gemm", 200, 192, 128),
                                                  ("grouped_gemm_dgrad", 1024, 2048, 256)])
def test_deferred_fwd_equals_the_plain_one(case: str, op: str, n: int, k: int, bn: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The cooperative fwd and dgrad (forced at K = 192 too, 3 K boxes under 4 subtiles)."""
    counts = CASES[case]
    m = sum(counts) + 5
    g = torch.Generator().manual_seed(44)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    fwd = op == "grouped_gemm"
    w = torch.randn(len(counts), *((n, k) if fwd else (k, n)), generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(counts))

    def run() -> torch.Tensor:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm._launch(op, a, w, offs, out, fwd, bn, pingpong=False)
        torch.cuda.synchronize()
        return out

    plain, deferred = _both(run, monkeypatch, "GEMM_FWD_DEFERRED")
    assert not bool(deferred[: sum(counts)].isnan().any()), "a held subtile never left"
    assert torch.equal(deferred.view(torch.int16), plain.view(torch.int16))


@gpu
def test_sep_gemm_fast_fwd_deferred_subtile_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Box kt sending subtile kt + 1: subtile 1 of every held tile never leaves (32 K boxes a tile, 512 tiles
    over at most 132 CTAs), so NaN stays where the plain epilogue writes numbers."""
    test_deferred_fwd_equals_the_plain_one("uniform", "grouped_gemm", 1024, 2048, 256, monkeypatch)
