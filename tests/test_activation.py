"""Spec tests for relu2 / swiglu against float64 oracles written here (numpy), never against the code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.reference.activation import relu2, relu2_bwd, swiglu, swiglu_bwd


def all_bf16() -> Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def f32_to_bf16_bits(x32: np.ndarray) -> np.ndarray:
    """RNE fp32 -> bf16 written with integer ops (NaN excluded by callers)."""
    b = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def round_once_bf16_bits(x64: np.ndarray) -> np.ndarray:
    """Correctly rounded float64 -> bf16 (one RNE). Going through fp32 double-rounds exactly when the
    fp32 value lands on a bf16 midpoint it was not equal to; that case is resolved by the true side."""
    with np.errstate(over="ignore"):
        r32 = x64.astype(np.float32)
    bits = r32.view(np.uint32)
    out = f32_to_bf16_bits(r32)
    with np.errstate(invalid="ignore"):
        trap = ((bits & 0xFFFF) == 0x8000) & (r32.astype(np.float64) != x64) & np.isfinite(r32)
        away = np.abs(x64) > np.abs(r32.astype(np.float64))
    fixed = ((bits >> 16) + away.astype(np.uint32)).astype(np.uint16)
    return np.where(trap, fixed, out)


def bits16(t: Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def ordered(b: np.ndarray) -> np.ndarray:
    """Map bf16 bit patterns to integers monotone in value, so ulp distance is a difference."""
    s = b.astype(np.int64)
    out: np.ndarray = np.where(s & 0x8000, 0x8000 - s, s)
    return out


def test_round_once_helper_hand_vectors() -> None:
    x = np.array([1 + 2**-8 + 2**-30, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 - 2**-30, -(1 + 2**-8 + 2**-30)])
    want = np.array([1 + 2**-7, 1.0, 1 + 2**-6, 1.0, -(1 + 2**-7)])
    got = torch.from_numpy(round_once_bf16_bits(x).view(np.int16)).view(torch.bfloat16).double().numpy()
    assert np.array_equal(got, want)


def relu64(x: np.ndarray) -> np.ndarray:
    r = x.copy()
    r[x <= 0] = 0.0
    return r


def test_relu2_all_bf16_bit_patterns() -> None:
    x = all_bf16()
    got = bits16(relu2(x))
    x64 = x.double().numpy()
    nan = np.isnan(x64)
    assert np.isnan(relu2(x).double().numpy()[nan]).all()
    sq = relu64(x64[~nan]) ** 2
    with np.errstate(over="ignore"):
        spec = f32_to_bf16_bits(sq.astype(np.float32))
    assert np.array_equal(got[~nan], spec)
    exact_in_fp32 = (sq == 0) | (sq >= 2.0**-126)
    assert np.array_equal(got[~nan][exact_in_fp32], round_once_bf16_bits(sq[exact_in_fp32]))
    assert (got[~nan][x64[~nan] <= 0] == 0).all()


def test_relu2_fp32_matches_float64_rounded_once() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 1e3
    x64 = x.double().numpy()
    want = (relu64(x64) ** 2).astype(np.float32)
    assert np.array_equal(relu2(x).numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dy", [1.0, -1.5, 3.0078125, 1e-30, -7.5e20, 0.0])
def test_relu2_bwd_all_bf16_bit_patterns(dy: float) -> None:
    x = all_bf16()
    d = torch.full_like(x, dy)
    got = bits16(relu2_bwd(d, x))
    x64, d64 = x.double().numpy(), d.double().numpy()
    nan = np.isnan(x64)
    with np.errstate(over="ignore", invalid="ignore"):
        two_r = (2 * relu64(x64[~nan])).astype(np.float32).astype(np.float64)
        prod = (d64[~nan] * two_r).astype(np.float32)
    ok = ~np.isnan(prod)
    assert np.array_equal(got[~nan][ok], f32_to_bf16_bits(prod[ok]))
    assert np.isnan(relu2_bwd(d, x).double().numpy()[~nan][~ok]).all()


def swiglu64(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out: np.ndarray = g / (1.0 + np.exp(-g)) * u
    return out


@pytest.mark.parametrize("u", [1.0, -3.5, 0.0078125, 1.0e30])
def test_swiglu_all_finite_bf16_gates_ulp1(u: float) -> None:
    """silu(g) is an fp32 intermediate (the spec); where it is fp32-subnormal only |u| <= 1 keeps ulp(1)."""
    g = all_bf16()
    g = g[torch.isfinite(g)]
    h = torch.stack((g, torch.full_like(g, u)), dim=-1).flatten()
    got = ordered(bits16(swiglu(h)))
    g64, u64 = g.double().numpy(), h[1::2].double().numpy()
    want = ordered(round_once_bf16_bits(swiglu64(g64, u64)))
    in_contract = (np.abs(swiglu64(g64, np.ones_like(g64))) >= 2.0**-126) | (np.abs(u64) <= 1)
    assert in_contract.sum() > 45000
    assert int(np.abs(got - want)[in_contract].max()) <= 1


def test_swiglu_interleaved_layout_hand_vector() -> None:
    h = torch.tensor([[2.0, 3.0, -1.0, 5.0, 0.0, 7.0]])
    s2, sm1 = 1 / (1 + np.exp(-2.0)), 1 / (1 + np.exp(1.0))
    want = np.array([[2.0 * s2 * 3.0, -1.0 * sm1 * 5.0, 0.0]])
    assert np.allclose(swiglu(h).double().numpy(), want, rtol=1e-6, atol=0)


def swiglu_t64(h: Tensor) -> Tensor:
    g, u = h[..., 0::2], h[..., 1::2]
    return g / (1 + torch.exp(-g)) * u


def relu2_t64(x: Tensor) -> Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x)) ** 2


class _Relu2Explicit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return relu2(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return relu2_bwd(dy, x)


class _SwigluExplicit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, h: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        return swiglu(h)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return swiglu_bwd(dy, h)


def _away_from_zero(n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    return x + 0.1 * torch.sign(x)


def test_gradcheck_float64() -> None:
    x = _away_from_zero(12, 1).requires_grad_()
    assert torch.autograd.gradcheck(relu2, (x,))
    assert torch.autograd.gradcheck(_Relu2Explicit.apply, (x,))
    h = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    assert torch.autograd.gradcheck(swiglu, (h,))
    assert torch.autograd.gradcheck(_SwigluExplicit.apply, (h,))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 5), inner=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_explicit_bwd_matches_autograd_of_float64_formula(rows: int, inner: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, dtype=torch.float64, generator=gen).requires_grad_()
    dy = torch.randn(rows, inner, dtype=torch.float64, generator=gen)
    (want,) = torch.autograd.grad(relu2_t64(x), x, dy)
    assert torch.allclose(relu2_bwd(dy, x.detach()), want, rtol=1e-14, atol=0)
    h = (torch.randn(rows, 2 * inner, dtype=torch.float64, generator=gen) * 4).requires_grad_()
    (want_h,) = torch.autograd.grad(swiglu_t64(h), h, dy)
    assert torch.allclose(swiglu_bwd(dy, h.detach()), want_h, rtol=1e-12, atol=1e-15)
    assert torch.allclose(swiglu(h.detach()), swiglu_t64(h.detach()), rtol=1e-13, atol=1e-300)


def test_swiglu_bwd_bf16_close_to_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    h = (torch.randn(64, 32, generator=gen) * 3).to(torch.bfloat16)
    dy = torch.randn(64, 16, generator=gen).to(torch.bfloat16)
    h64 = h.double().requires_grad_()
    (want,) = torch.autograd.grad(swiglu_t64(h64), h64, dy.double())
    got = swiglu_bwd(dy, h)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), want, rtol=2**-7, atol=1e-30)


def test_shape_and_dtype_errors() -> None:
    with pytest.raises(ValueError, match="odd"):
        swiglu(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="halved"):
        swiglu_bwd(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="matching"):
        relu2_bwd(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="floating"):
        relu2(torch.zeros(2, dtype=torch.int32))


def test_relu2_pins_nan_and_negative_zero() -> None:
    out = relu2(torch.tensor([float("nan"), -0.0, -2.0], dtype=torch.bfloat16))
    assert torch.isnan(out[0]) and bits16(out[1:]).tolist() == [0, 0]


# ---- separating inputs: the mutated formula (written here) differs on the data, the code is correct ----


def test_sep_relu2_square_dropped() -> None:
    x = torch.tensor([3.0, 0.5, -2.0], dtype=torch.bfloat16)
    x64 = x.double().numpy()
    correct, mutant = relu64(x64) ** 2, relu64(x64)
    assert not np.array_equal(correct, mutant)
    assert np.array_equal(relu2(x).double().numpy(), correct)


def test_sep_relu2_silu() -> None:
    x = torch.tensor([-1.0, 2.0], dtype=torch.bfloat16)
    x64 = x.double().numpy()
    correct, mutant = relu64(x64) ** 2, x64 / (1 + np.exp(-x64))
    assert not np.allclose(correct, mutant, rtol=0.05)
    assert np.array_equal(relu2(x).double().numpy(), correct)


def test_sep_relu2_square_in_bf16() -> None:
    x = torch.tensor([1.0 + 2**-12, 3.0001, 1e-3], dtype=torch.float32)
    x64 = x.double().numpy()
    correct = (relu64(x64) ** 2).astype(np.float32)
    xb = torch.from_numpy(f32_to_bf16_bits(x.numpy()).view(np.int16)).view(torch.bfloat16).double().numpy()
    sq_b = torch.from_numpy(f32_to_bf16_bits((relu64(xb) ** 2).astype(np.float32)).view(np.int16))
    mutant = sq_b.view(torch.bfloat16).float().numpy()
    assert not np.array_equal(correct, mutant)
    assert np.array_equal(relu2(x).numpy(), correct)


def test_sep_swiglu_concat_layout() -> None:
    h = torch.tensor([[1.0, 2.0, -3.0, 0.5]], dtype=torch.float64)
    correct = swiglu_t64(h)
    g, u = h[..., :2], h[..., 2:]
    mutant = g / (1 + torch.exp(-g)) * u
    assert not torch.allclose(correct, mutant)
    assert torch.allclose(swiglu(h.float()).double(), correct, rtol=1e-6, atol=0)


def test_swiglu_fp32_underflow_corner() -> None:
    """docs/spec-corners.md: the ulp(1) contract widens by fp32's absolute floor where sigmoid(g) leaves
    fp32's normal range. exp(-104) is below half the smallest fp32 subnormal, so there silu(g)*u is ±0;
    at g = -95 the spec keeps the subnormal sigmoid, within that floor of the float64 value."""
    assert np.float32(np.exp(np.float64(-104.5))) == 0.0
    u = 2.0**100
    h = torch.tensor([[-104.5, u, -95.0, u]], dtype=torch.bfloat16)
    out = swiglu(h).double().numpy()[0]
    assert out[0] == 0.0
    v64 = -95.0 * np.exp(-95.0) / (1 + np.exp(-95.0)) * u
    floor = u * (95.0 + 2) * 2.0**-148
    assert v64 != 0 and abs(out[1] - v64) <= abs(v64) * 2.0**-8 + floor


def test_swiglu_bwd_overflow_of_dy_u_is_outside_the_contract() -> None:
    """dy*u past fp32's range is Inf in the spec's fp32 formula while float64 stays finite, so the domain
    of the contract excludes it (docs/spec-corners.md); the spec's own value there is that Inf."""
    dy = torch.tensor([[4.0]], dtype=torch.bfloat16)
    h = torch.tensor([[0.5, 2.0**127]], dtype=torch.bfloat16)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(4.0) * np.float32(2.0**127))
    dg = swiglu_bwd(dy, h).float()[0, 0].item()
    assert np.isinf(dg) and dg > 0


def test_sep_swiglu_sigmoid_flushes() -> None:
    g = torch.tensor([-95.0])
    assert torch.sigmoid(g).item() == 0.0 and np.float32(np.exp(np.float64(-95.0))) > 0
    h = torch.tensor([[-95.0, 2.0**100]], dtype=torch.bfloat16)
    v64 = -95.0 * np.exp(-95.0) * 2.0**100
    assert abs(swiglu(h).double().item() - v64) <= abs(v64) * 2.0**-7
