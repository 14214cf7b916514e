"""Spec tests of reference/norm.py against float64 formulas written here."""

from typing import Any

import pytest
import torch
from bf16_oracle import bf16_nearest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.reference.norm import add_rmsnorm, add_rmsnorm_bwd, rmsnorm, rmsnorm_bwd


def oracle64(x: Tensor, w: Tensor, eps: float) -> Tensor:
    x64, w64 = x.double(), w.double()
    ms = (x64 * x64).sum(-1, keepdim=True) / x64.shape[-1]
    return x64 / torch.sqrt(ms + eps) * w64


def ulp_dist(a: Tensor, ref64: Tensor, dtype: torch.dtype) -> Tensor:
    """|a - ref| in units of dtype's spacing in the binade of the float64 ref."""
    mant_bits = {torch.float32: 23, torch.bfloat16: 7}[dtype]
    _, exp = torch.frexp(ref64)
    spacing = torch.ldexp(torch.ones_like(ref64), exp - 1 - mant_bits)
    return (a.double() - ref64).abs() / spacing


def gen(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 5), d=st.integers(1, 48), seed=st.integers(0, 2**16))
def test_fwd_fp32_matches_float64_formula(rows: int, d: int, seed: int) -> None:
    x = gen((rows, d), seed, torch.float32)
    w = gen((d,), seed + 1, torch.float32)
    y = rmsnorm(x, w, 1e-6)
    assert y.dtype == torch.float32
    assert float(ulp_dist(y, oracle64(x, w, 1e-6), torch.float32).max()) <= 4.0


def test_fwd_bf16_one_rounding() -> None:
    x = gen((3, 5, 64), 1, torch.bfloat16)
    w = gen((64,), 2, torch.bfloat16)
    y = rmsnorm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    assert float(ulp_dist(y, oracle64(x, w, 1e-5), torch.bfloat16).max()) <= 0.5 + 1e-3


def test_hand_vector() -> None:
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    # mean(x^2) = 12.5, eps = 0 -> r = 1/sqrt(12.5)
    r = 12.5**-0.5
    assert torch.allclose(rmsnorm(x, w, 0.0), torch.tensor([[3 * r, 8 * r]], dtype=torch.float64))


def test_gradcheck_fwd() -> None:
    x = gen((3, 7), 3).requires_grad_()
    w = gen((7,), 4).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rmsnorm(a, b, 1e-3), (x, w))


class _RmsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return rmsnorm(x, w, 1e-3)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return rmsnorm_bwd(dy, x, w, 1e-3)


def test_gradcheck_explicit_bwd() -> None:
    x = gen((2, 3, 6), 5).requires_grad_()
    w = gen((6,), 6).requires_grad_()
    assert torch.autograd.gradcheck(_RmsFn.apply, (x, w))


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 4), d=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_bwd_equals_autograd_of_oracle(rows: int, d: int, seed: int) -> None:
    x = gen((rows, d), seed).requires_grad_()
    w = gen((d,), seed + 1).requires_grad_()
    dy = gen((rows, d), seed + 2)
    gx, gw = torch.autograd.grad(oracle64(x, w, 1e-6), (x, w), dy)
    dx, dw = rmsnorm_bwd(dy, x.detach(), w.detach(), 1e-6)
    assert torch.allclose(dx, gx, rtol=1e-10, atol=1e-12)
    assert torch.allclose(dw, gw, rtol=1e-10, atol=1e-12)


def test_bwd_dtypes_fp32_and_bf16() -> None:
    x = gen((4, 32), 7, torch.bfloat16)
    w = gen((32,), 8, torch.float32)
    dy = gen((4, 32), 9, torch.bfloat16)
    dx, dw = rmsnorm_bwd(dy, x, w, 1e-6)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    gx, gw = torch.autograd.grad(oracle64(x64, w64, 1e-6), (x64, w64), dy.double())
    assert torch.allclose(dx.double(), gx, rtol=2**-7, atol=1e-3)
    assert torch.allclose(dw.double(), gw, rtol=1e-5, atol=1e-5)


def test_errors_name_the_fix() -> None:
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match="weight shape"):
        rmsnorm(x, torch.ones(3), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rmsnorm(x, torch.ones(4), -1.0)
    with pytest.raises(ValueError, match="dy shape"):
        rmsnorm_bwd(torch.ones(2, 3), x, torch.ones(4), 1e-6)


def test_sep_rmsnorm_eps_outside_sqrt() -> None:
    eps = 1e-6
    x = gen((2, 16), 10) * 1e-3
    w = gen((16,), 11)
    x64 = x.double()
    correct = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w
    mutated = x64 / (torch.sqrt((x64 * x64).mean(-1, keepdim=True)) + eps) * w
    assert not torch.allclose(correct, mutated, rtol=1e-2)
    y = rmsnorm(x.float(), w.float(), eps).double()
    assert torch.allclose(y, correct, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y, mutated, rtol=1e-2)


def bf16_t(t64: Tensor) -> Tensor:
    return torch.from_numpy(bf16_nearest(t64.numpy()))


def test_add_rmsnorm_stream_rounded_once_then_normed() -> None:
    """s is h + a in exact arithmetic rounded once to bf16; y is rmsnorm of that s (0.5 ULP + fp32 noise)."""
    h = gen((5, 48), 21, torch.bfloat16)
    a = (gen((5, 48), 22) / 3).to(torch.bfloat16)
    w = gen((48,), 23, torch.bfloat16)
    s, y = add_rmsnorm(h, a, w, 1e-6)
    s64 = bf16_t(h.double() + a.double())
    assert s.dtype == y.dtype == torch.bfloat16 and torch.equal(s.double(), s64)
    assert float(ulp_dist(y, oracle64(s64, w, 1e-6), torch.bfloat16).max()) <= 0.5 + 1e-3


def test_sep_rmsnorm_add_normed_before_add() -> None:
    """The norm reads the summed stream: on data where a moves h's rms, rmsnorm(h) is another result."""
    h = gen((3, 32), 24)
    a = 2.0 * gen((3, 32), 25)
    w = gen((32,), 26)
    correct, mutated = oracle64(h + a, w, 1e-6), oracle64(h, w, 1e-6)
    assert not torch.allclose(correct, mutated, rtol=1e-2)
    s, y = add_rmsnorm(h, a, w, 1e-6)
    assert torch.equal(s, h + a)
    assert torch.allclose(y, correct, rtol=1e-12, atol=1e-12)


class _AddFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, a: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        s, y = add_rmsnorm(h, a, w, 1e-3)
        ctx.save_for_backward(s, w)
        return s, y

    @staticmethod
    def backward(ctx: Any, ds: Tensor, dy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        s, w = ctx.saved_tensors
        dh, dw = add_rmsnorm_bwd(ds, dy, s, w, 1e-3)
        return dh, dh, dw


def test_add_rmsnorm_gradcheck_autograd_and_explicit_bwd() -> None:
    h, a = gen((2, 3, 6), 27).requires_grad_(), gen((2, 3, 6), 28).requires_grad_()
    w = gen((6,), 29).requires_grad_()
    assert torch.autograd.gradcheck(lambda p, q, r: add_rmsnorm(p, q, r, 1e-3), (h, a, w))
    assert torch.autograd.gradcheck(_AddFn.apply, (h, a, w))


def test_add_rmsnorm_bwd_rounds_the_norms_dx_before_adding() -> None:
    """bf16: dh = bf16(ds + bf16(dx)), the two roundings autograd's separate add makes."""
    s = gen((4, 40), 30, torch.bfloat16)
    w = gen((40,), 31, torch.bfloat16)
    ds, dy = gen((4, 40), 32, torch.bfloat16), gen((4, 40), 33, torch.bfloat16)
    dh, dw = add_rmsnorm_bwd(ds, dy, s, w, 1e-6)
    dx, dw_norm = rmsnorm_bwd(dy, s, w, 1e-6)
    assert torch.equal(dh.double(), bf16_t(ds.double() + dx.double())) and torch.equal(dw, dw_norm)


def test_add_rmsnorm_errors_name_the_fix() -> None:
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match="residual branch"):
        add_rmsnorm(x, torch.ones(2, 3), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="stream's gradient"):
        add_rmsnorm_bwd(torch.ones(2, 4, dtype=torch.bfloat16), x, x, torch.ones(4), 1e-6)
