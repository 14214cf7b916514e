"""nmoe.fast.combine.combine_gather against the spec: bitwise on a GPU; argument checks on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from nmoe.reference import combine as ref

gpu = pytest.mark.gpu
BF16 = torch.bfloat16


def _inputs(t: int, k: int, h: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """yp has distinct rows scattered in a random order, one spare zero row past the last real one."""
    g = torch.Generator().manual_seed(seed)
    n_rows = t * k + 2 * k + 1
    rows = torch.randperm(n_rows - 1, generator=g)[: t * k]
    yp = torch.zeros(n_rows, h, dtype=BF16)
    yp[rows] = torch.randn(t * k, h, generator=g).to(BF16)
    w = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    shared = torch.randn(t, h, generator=g).to(BF16)
    return yp, rows.to(torch.int32).view(t, k), w, shared


def _fast(yp: Tensor, row_of: Tensor, w: Tensor, scale: float, shared: Tensor | None) -> Tensor:
    from nmoe.fast.combine import combine_gather
    return combine_gather(yp.cuda(), row_of.cuda(), w.cuda(), scale,
                          None if shared is None else shared.cuda()).cpu()


@gpu
@pytest.mark.parametrize(("t", "k", "h", "with_shared"), [(300, 8, 4096, True), (17, 1, 24, False),
                                                           (64, 6, 1536, False), (5, 3, 7, True)])
def test_combine_gather_bitwise(t: int, k: int, h: int, with_shared: bool) -> None:
    yp, row_of, w, shared = _inputs(t, k, h, t + k)
    sh = shared if with_shared else None
    want = ref.combine_gather(yp, row_of, w, 2.5, sh)
    assert torch.equal(_fast(yp, row_of, w, 2.5, sh).view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_combine_fast_gather_row_off_by_one() -> None:
    """Rows are distinct random vectors, so the next row's sum differs from the slot's own on every token."""
    yp, row_of, w, _ = _inputs(128, 4, 256, 3)
    correct = ref.combine_gather(yp, row_of, w, 1.0)
    shifted = ref.combine_gather(yp, row_of + 1, w, 1.0)
    assert bool((correct != shifted).any(-1).all())
    assert torch.equal(_fast(yp, row_of, w, 1.0, None).view(torch.int16), correct.view(torch.int16))


@pytest.mark.parametrize(("yp", "row_of", "w", "match"), [
    (torch.zeros(4, 8, dtype=BF16), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2), "int32"),
    (torch.zeros(4, 8, dtype=BF16), torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 3), "need yp"),
    (torch.zeros(4, 8), torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2), "bf16"),
])
def test_combine_gather_rejects(yp: Tensor, row_of: Tensor, w: Tensor, match: str) -> None:
    from nmoe.fast.combine import _check_gather
    with pytest.raises(ValueError, match=match):
        _check_gather(yp, row_of, w)
