"""The wgrad with a whole output tile staged (GEMM_WGRAD_STAGED_TILE): only where the output waits in shared
memory changes, so it is held bit for bit to the two-subtile wgrad, every tile written (NaN-filled outputs),
on uniform, skewed (split) and one-group routings, both tile widths, and the accumulating column chunks."""

from __future__ import annotations

import pytest
import torch
from test_fast_wgrad_dynamic import SKEWED, column_chunk_runs, nan_wgrad

from nmoe.fast.gemm import sm90 as gemm
from nmoe.fast.kernels.sm90.grouped_gemm_wgrad import epi_bufs, stages_for

gpu = pytest.mark.gpu


def test_staged_tile_costs_one_stage_at_bn_256() -> None:
    """A whole 128 x 256 tile is 64 KB of subtiles: one 48 KB operand stage gives way; bn = 128 keeps 5."""
    assert (epi_bufs(256, True), epi_bufs(256, False)) == (8, 2)
    assert (stages_for(256, True), stages_for(256)) == (3, 4)
    assert (stages_for(128, True), stages_for(128)) == (5, 6)


def _wgrad(counts: list[int], bn: int, staged: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(gemm, "GEMM_WGRAD_STAGED_TILE", staged)
    return nan_wgrad(counts, 41, bn=bn)


@gpu
@pytest.mark.parametrize("bn", [128, 256])
@pytest.mark.parametrize("counts", [SKEWED, [1024] * 16, [0, 0, 7000, 3]], ids=["zipf", "uniform", "one"])
def test_staged_equals_two_subtiles(counts: list[int], bn: int, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _wgrad(counts, bn, False, monkeypatch)
    staged = _wgrad(counts, bn, True, monkeypatch)
    assert not bool(staged.isnan().any()), "a tile the staged epilogue never stored stays NaN"
    assert torch.equal(staged.view(torch.int16), plain.view(torch.int16))


@gpu
def test_staged_column_chunks_accumulate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's accumulating column chunks (TMA reduce-add for full tiles) through a staged tile."""
    plain, staged = column_chunk_runs(monkeypatch, "GEMM_WGRAD_STAGED_TILE", 42, accumulate=True)
    assert torch.equal(staged.view(torch.int16), plain.view(torch.int16))
