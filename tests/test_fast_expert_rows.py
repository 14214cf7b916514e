"""nmoe.fast.combine.expert_rows_bwd, the MoE layer's one pass over its expert rows in the backward, against
the fast kernels it replaces (act, combine_bwd and combine with K = 1, act_bwd): bit for bit on the GPU;
argument checks on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from nmoe.fast import activation as fa
from nmoe.fast import combine as fc

BF16 = torch.bfloat16
ACT = {"swiglu": (fa.swiglu, fa.swiglu_bwd, 2), "relu2": (fa.relu2, fa.relu2_bwd, 1)}


def _bits(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == BF16 else torch.int32)


def _rows(r: int, n: int, activation: str, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """dz, h and router weights w (0 on every fifth row: pad rows), w away from 1 so scaling shows."""
    g = torch.Generator().manual_seed(seed)
    width = ACT[activation][2]
    dz = torch.randn(r, n, generator=g).to(BF16)
    h = (2 * torch.randn(r, width * n, generator=g)).to(BF16)
    w = 0.1 + torch.rand(r, generator=g) * 0.7
    w[::5] = 0.0
    return dz.cuda(), h.cuda(), w.cuda()


def _composed(dz: Tensor, h: Tensor, w: Tensor, activation: str) -> tuple[Tensor, Tensor, Tensor]:
    """(aw, dot, dh) from the separate fast kernels, as the layer ran them before the fused pass."""
    act, act_bwd, _ = ACT[activation]
    a = act(h)
    dzw, dot = fc.combine_bwd(dz, a[:, None], w[:, None], 1.0)[:2]
    aw = fc.combine(a[:, None], w[:, None], 1.0)
    return aw, dot.view(-1), act_bwd(dzw[:, 0], h)


def _fused(dz: Tensor, h: Tensor, w: Tensor, activation: str) -> tuple[Tensor, Tensor, Tensor]:
    dh = h.clone()
    aw, dot = fc.expert_rows_bwd(dz, dh, w, activation)
    return aw, dot, dh


def test_expert_rows_bwd_checks_its_arguments() -> None:
    dz, h, w = torch.zeros(4, 8, dtype=BF16), torch.zeros(4, 16, dtype=BF16), torch.zeros(4)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        fc.expert_rows_bwd(dz, h, w, "gelu")
    with pytest.raises(ValueError, match=r"h \[R,1I\] \(relu2\)"):
        fc.expert_rows_bwd(dz, h, w, "relu2")
    with pytest.raises(ValueError, match="dz and h bf16, w fp32"):
        fc.expert_rows_bwd(dz, h, w.double(), "swiglu")
    with pytest.raises(ValueError, match="must be contiguous"):
        fc.expert_rows_bwd(dz, torch.zeros(4, 32, dtype=BF16)[:, ::2], w, "swiglu")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize(("r", "n"), [(300, 96), (37, 100), (5, 8)])
def test_expert_rows_bwd_is_the_separate_kernels_bit_for_bit(activation: str, r: int, n: int) -> None:
    """n = 100 takes the scalar path (vec 1) in both; a row's dot sums in the same lane order either way."""
    dz, h, w = _rows(r, n, activation, r + n)
    for got, want in zip(_fused(dz, h, w, activation), _composed(dz, h, w, activation), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.gpu
def test_expert_rows_bwd_keeps_nan_and_pad_rows() -> None:
    dz, h, w = _rows(64, 64, "swiglu", 1)
    h[3, 5] = float("nan")
    dz[7, 2] = float("inf")
    got, want = _fused(dz, h, w, "swiglu"), _composed(dz, h, w, "swiglu")
    for g, x in zip(got, want, strict=True):
        assert torch.equal(_bits(g), _bits(x))
    assert bool(got[0][::5].eq(0).all()), "pad rows (w = 0) scale a to zeros"


@pytest.mark.gpu
def test_sep_combine_fast_rows_dot_of_scaled_dz() -> None:
    """The row dot is <a, dz>, not <a, bf16(dz * w)>: on w away from 1 the two differ."""
    dz, h, w = _rows(40, 64, "swiglu", 7)
    a = fa.swiglu(h).float()
    right = (a * dz.float()).sum(-1)
    wrong = (a * (dz.float() * w[:, None]).to(BF16).float()).sum(-1)
    real = w != 0
    assert not torch.allclose(right[real], wrong[real], rtol=1e-2, atol=1e-3)
    got = _fused(dz, h, w, "swiglu")[1]
    assert torch.equal(_bits(got), _bits(_composed(dz, h, w, "swiglu")[1]))
    torch.testing.assert_close(got, right, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_sep_combine_fast_rows_dh_unscaled() -> None:
    """dh is act_bwd(bf16(dz * w), h): the router weight scales it (an unscaled dz gives other values)."""
    dz, h, w = _rows(40, 64, "relu2", 8)
    right = fa.relu2_bwd((dz.float() * w[:, None]).to(BF16), h)
    wrong = fa.relu2_bwd(dz, h)
    assert not torch.equal(right, wrong)
    got = _fused(dz, h, w, "relu2")[2]
    assert torch.equal(_bits(got), _bits(right))
